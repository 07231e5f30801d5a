//! The bridge: the export pod the reconciler rendered, run as a real `ucm export-server`, and
//! every internal link downloaded through it (used by `pvc`, `manifests` and `links`).

use super::*;

pub(super) fn int_urls(e: &VirtualMachineExport) -> Vec<String> {
    let int = e.status.clone().unwrap().links.unwrap().internal.unwrap();
    let mut out: Vec<String> = int
        .volumes
        .unwrap()
        .into_iter()
        .flat_map(|v| v.formats.unwrap())
        .map(|f| f.url)
        .collect();
    out.extend(int.manifests.unwrap().into_iter().map(|m| m.url));
    out
}

/// Content of the fixture for one exported claim: a disk image for raw/gzip volumes, a small
/// tree (with a `lost+found` that must not be served) for archive volumes.
pub(super) fn bridge_image(pvc: &str) -> Vec<u8> {
    let seed = pvc
        .bytes()
        .fold(7u32, |a, b| a.wrapping_mul(31).wrapping_add(u32::from(b)));
    (0..200_000u32)
        .map(|i| ((i.wrapping_mul(seed) >> 3) % 251) as u8)
        .collect()
}

/// Runs the rendered pod's command with its environment and volume mounts (each mount path
/// mapped to a temp dir filled from the Secret, ConfigMap or a claim fixture it names) and
/// downloads every internal link through it, checking each body. Returns the bodies by URL.
///
/// The manifests are also fetched as YAML and printed back to back (`all`, then the secret), as
/// `virtctl vmexport download --manifest --include-secret` does, and that text must be accepted
/// by `kubectl apply --dry-run=server` against the real API server.
pub(super) async fn bridge(
    env: &TestEnv,
    pod: &Pod,
    token: &str,
    urls: &[String],
) -> BTreeMap<String, Vec<u8>> {
    let b = Bridge::start(env, pod).await;
    let ca = b.ca.clone();
    b.check(env, token, urls, &ca, b.port).await
}

/// Waits until a started process listens on 127.0.0.1:`port`; fails with its log.
pub(super) fn wait_listening(port: u16, what: &str, log: &std::path::Path) {
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{what} did not start: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The export server running the rendered pod's command (see `bridge`).
pub(super) struct Bridge {
    _tmp: tempfile::TempDir,
    child: std::process::Child,
    /// The server's HTTPS port on 127.0.0.1.
    pub(super) port: u16,
    /// The CA of the internal links (from the pod's certificate Secret).
    pub(super) ca: std::path::PathBuf,
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Bridge {
    /// Where the pod's mount paths are (`<root>/cert`, `<root>/export-volumes/...`).
    pub(super) fn root(&self) -> &std::path::Path {
        self._tmp.path()
    }

    /// The server's exit status once it has exited, or `None` if it still runs.
    pub(super) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }

    pub(super) async fn start(env: &TestEnv, pod: &Pod) -> Bridge {
        let (c, ns) = (&env.client, env.ns.as_str());
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let spec = pod.spec.clone().unwrap();
        let ctr = &spec.containers[0];
        let map = |p: &str| root.join(p.trim_start_matches('/'));
        let mut envs: BTreeMap<String, String> = BTreeMap::new();
        for e in ctr.env.clone().unwrap() {
            let Some(v) = e.value else { continue };
            let v = if e.name.ends_with("_EXPORT_PATH") || e.name.ends_with("_FILE") {
                map(&v).to_string_lossy().into_owned()
            } else {
                v
            };
            envs.insert(e.name, v);
        }
        // claim fixtures, by the export path the pod mounts them at
        let mut raw_by_path = BTreeMap::new();
        for (k, v) in &envs {
            if let Some(i) = k
                .strip_prefix("VOLUME")
                .and_then(|r| r.strip_suffix("_EXPORT_RAW_URI"))
            {
                let pvc = v.split('/').nth(2).unwrap().to_string();
                raw_by_path.insert(envs[&format!("VOLUME{i}_EXPORT_PATH")].clone(), pvc);
            }
        }
        for m in ctr.volume_mounts.clone().unwrap() {
            let dir = map(&m.mount_path);
            std::fs::create_dir_all(&dir).unwrap();
            let vol = spec
                .volumes
                .as_ref()
                .unwrap()
                .iter()
                .find(|v| v.name == m.name)
                .unwrap_or_else(|| panic!("mount {} names no pod volume", m.name));
            assert_eq!(m.read_only, Some(true), "mount {} is read-only", m.name);
            let files: BTreeMap<String, Vec<u8>> = if let Some(sec) = &vol.secret {
                let s = get_secret(c, ns, sec.secret_name.as_deref().unwrap())
                    .await
                    .unwrap_or_else(|| panic!("Secret of volume {}", m.name));
                s.data.unwrap().into_iter().map(|(k, v)| (k, v.0)).collect()
            } else if let Some(cm) = &vol.config_map {
                assert_eq!(
                    m.mount_path, "/manifest_data",
                    "the server reads the manifest data where the pod mounts it"
                );
                envs.insert(
                    "MANIFEST_DATA_DIR".into(),
                    dir.to_string_lossy().into_owned(),
                );
                Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(c.clone(), ns)
                    .get(&cm.name)
                    .await
                    .unwrap()
                    .data
                    .unwrap()
                    .into_iter()
                    .map(|(k, v)| (k, v.into_bytes()))
                    .collect()
            } else if vol.persistent_volume_claim.is_some() {
                let path = dir.to_string_lossy().into_owned();
                match raw_by_path.get(&path) {
                    Some(pvc) => BTreeMap::from([("disk.img".to_string(), bridge_image(pvc))]),
                    None => {
                        std::fs::create_dir_all(dir.join("lost+found")).unwrap();
                        BTreeMap::from([
                            ("a.txt".to_string(), b"archive a\n".to_vec()),
                            ("sub/b.txt".to_string(), b"archive b\n".to_vec()),
                        ])
                    }
                }
            } else {
                panic!("unexpected volume kind for mount {}", m.name)
            };
            for (k, v) in files {
                let f = dir.join(k);
                std::fs::create_dir_all(f.parent().unwrap()).unwrap();
                std::fs::write(f, v).unwrap();
            }
        }
        assert!(
            ctr.volume_devices.is_none(),
            "the bridge maps filesystem volumes only"
        );
        let ca = root.join("bridge-ca.crt");
        let cert_secret = spec
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find(|v| v.name == "certificates")
            .and_then(|v| v.secret.as_ref()?.secret_name.clone())
            .unwrap();
        std::fs::write(
            &ca,
            data(&get_secret(c, ns, &cert_secret).await.unwrap(), "ca.crt"),
        )
        .unwrap();
        let port = free_port();
        envs.insert("LISTEN_ADDR".into(), format!("127.0.0.1:{port}"));
        envs.insert("METRICS_ADDR".into(), format!("127.0.0.1:{}", free_port()));
        assert_eq!(ctr.command.as_deref(), Some(&["ucm".to_string()][..]));
        let log = root.join("server.log");
        let child = Command::new(env!("CARGO_BIN_EXE_ucm"))
            .args(ctr.args.clone().unwrap())
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(&envs)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        wait_listening(port, "export server", &log);
        Bridge {
            _tmp: tmp,
            child,
            port,
            ca,
        }
    }

    /// Downloads every URL, its host connected to 127.0.0.1:`port` and verified against `ca`, with
    /// the token in the header, and checks each body as a user would (gunzip, tar, listing). Raw
    /// images are also fetched in two ranges. The manifests are applied with `--dry-run=server`.
    pub(super) async fn check(
        &self,
        env: &TestEnv,
        token: &str,
        urls: &[String],
        ca: &std::path::Path,
        port: u16,
    ) -> BTreeMap<String, Vec<u8>> {
        let ns = env.ns.as_str();
        let curl_with = |url: &str, extra: &[&str]| {
            let authority = url
                .trim_start_matches("https://")
                .split('/')
                .next()
                .unwrap()
                .to_string();
            let host = if authority.contains(':') {
                authority
            } else {
                format!("{authority}:443")
            };
            let out = Command::new("curl")
                .args([
                    "-sSfL",
                    "--cacert",
                    ca.to_str().unwrap(),
                    "--connect-to",
                    &format!("{host}:127.0.0.1:{port}"),
                    "-H",
                    &format!("x-kubevirt-export-token: {token}"),
                ])
                .args(extra)
                .arg(url)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{url}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            out.stdout
        };
        let curl = |url: &str| curl_with(url, &[]);
        let pipe = |cmd: &str, args: &[&str], input: Vec<u8>| {
            let mut p = Command::new(cmd)
                .args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut stdin = p.stdin.take().unwrap();
            let feeder = std::thread::spawn(move || {
                use std::io::Write;
                let _ = stdin.write_all(&input);
            });
            let out = p.wait_with_output().unwrap();
            feeder.join().unwrap();
            assert!(out.status.success(), "{cmd} {args:?} failed");
            out.stdout
        };
        let mut bodies = BTreeMap::new();
        for url in urls {
            let body = curl(url);
            let pvc = url
                .split("/volumes/")
                .nth(1)
                .map(|r| r.split('/').next().unwrap());
            if url.ends_with("/disk.img") {
                let image = bridge_image(pvc.unwrap());
                assert_eq!(body, image, "{url}");
                // Range passes through: a middle range and the tail, as a resumed download asks.
                assert_eq!(
                    curl_with(url, &["-r", "1000-1999"]),
                    image[1000..2000],
                    "{url}"
                );
                let n = image.len();
                assert_eq!(
                    curl_with(url, &["-r", &format!("{}-", n - 100)]),
                    image[n - 100..],
                    "{url}"
                );
            } else if url.ends_with("/disk.img.gz") {
                assert_eq!(
                    pipe("gzip", &["-dc"], body.clone()),
                    bridge_image(pvc.unwrap()),
                    "{url}"
                );
            } else if url.ends_with("/disk.tar.gz") {
                let list = String::from_utf8(pipe("tar", &["-tzf", "-"], body.clone())).unwrap();
                assert!(
                    list.contains("./a.txt")
                        && list.contains("./sub/b.txt")
                        && !list.contains("lost+found"),
                    "{url}: {list}"
                );
            } else if url.ends_with("/dir") {
                let listing = String::from_utf8_lossy(&body).into_owned();
                assert!(
                    listing.contains("a.txt")
                        && listing.contains("sub/")
                        && !listing.contains("lost+found"),
                    "{url}: {listing}"
                );
                assert_eq!(curl(&format!("{url}/sub/b.txt")), b"archive b\n");
            } else if url.ends_with("/manifests/secret") {
                assert!(String::from_utf8_lossy(&body).contains(token), "{url}");
            } else if url.ends_with("/manifests/all") {
                let list: serde_json::Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(list["kind"], "List", "{url}");
            } else {
                panic!("unexpected link {url}");
            }
            bodies.insert(url.clone(), body);
        }
        let mut yaml = String::new();
        for kind in ["/manifests/all", "/manifests/secret"] {
            for url in urls.iter().filter(|u| u.ends_with(kind)) {
                let body = curl_with(url, &["-H", "Accept: application/yaml"]);
                yaml.push_str(&String::from_utf8(body).unwrap());
            }
        }
        if !yaml.is_empty() {
            let kc = env.kubeconfig.clone();
            let ns = ns.to_string();
            let text = yaml.clone();
            let (ok, out) = tokio::task::spawn_blocking(move || {
                crate::common::kubectl(
                    &kc,
                    &["apply", "--dry-run=server", "-n", &ns, "-f", "-"],
                    Some(&text),
                )
            })
            .await
            .unwrap();
            assert!(
                ok,
                "kubectl apply --dry-run=server refused the manifests: {out}\n{yaml}"
            );
            assert!(out.contains("header-secret-"), "{out}");
        }
        bodies
    }
}

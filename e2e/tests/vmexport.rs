//! The vmexport reconciler against a real API server (no kubelet: the tests patch the export
//! pod's status as the kubelet would), and the bridge test: the pod the reconciler rendered is
//! run as a real `ucm export-server` and every internal link is downloaded through it.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use k8s_openapi::api::core::v1::{LimitRange, PersistentVolumeClaim, Pod, Secret, Service};
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use ucm::vmexport::VirtualMachineExport;

const WAIT: Duration = Duration::from_secs(30);

fn manager(env: &TestEnv) -> Manager {
    Manager::start(ManagerOpts::new(&env.kubeconfig, &env.ns).only("vmexport"))
}

async fn create_pvc(client: &Client, ns: &str, name: &str, content: Option<&str>, block: bool) {
    let mut ann = serde_json::Map::new();
    if let Some(c) = content {
        ann.insert("cdi.kubevirt.io/storage.contentType".into(), json!(c));
    }
    let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": ann},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "volumeMode": if block { "Block" } else { "Filesystem" },
            "resources": {"requests": {"storage": "1Gi"}},
            "storageClassName": "none",
        }
    }))
    .unwrap();
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pvc)
        .await
        .unwrap();
}

async fn create_export(
    client: &Client,
    ns: &str,
    name: &str,
    source: serde_json::Value,
    ttl: Option<&str>,
) -> Result<VirtualMachineExport, kube::Error> {
    let mut spec = json!({"source": source});
    if let Some(t) = ttl {
        spec["ttlDuration"] = json!(t);
    }
    let e: VirtualMachineExport = serde_json::from_value(json!({
        "apiVersion": "export.kubevirt.io/v1",
        "kind": "VirtualMachineExport",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .unwrap();
    Api::<VirtualMachineExport>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &e)
        .await
}

fn pvc_source(name: &str) -> serde_json::Value {
    json!({"kind": "PersistentVolumeClaim", "name": name})
}

async fn export(client: &Client, ns: &str, name: &str) -> Option<VirtualMachineExport> {
    Api::<VirtualMachineExport>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .unwrap()
}

fn ready_reason(e: &VirtualMachineExport) -> (String, String, String) {
    let st = e.status.clone().unwrap_or_default();
    let c = st
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap_or_default();
    (
        st.phase.unwrap_or_default(),
        c.reason.unwrap_or_default(),
        c.message.unwrap_or_default(),
    )
}

async fn wait_phase(
    client: &Client,
    ns: &str,
    name: &str,
    phase: &str,
    reason: &str,
) -> VirtualMachineExport {
    let start = Instant::now();
    loop {
        if let Some(e) = export(client, ns, name).await {
            let (p, r, _) = ready_reason(&e);
            if p == phase && r == reason {
                return e;
            }
            if start.elapsed() > WAIT {
                panic!("export {name}: want {phase}/{reason}, have {:?}", e.status);
            }
        } else if start.elapsed() > WAIT {
            panic!("export {name} is gone");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What the kubelet would write for a running, ready export server.
async fn mark_pod(client: &Client, ns: &str, name: &str, phase: &str, ready: bool) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let body = json!({"status": {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        "containerStatuses": [{
            "name": "exporter", "ready": ready, "restartCount": 0, "image": "ucm", "imageID": "",
            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        }],
    }});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(body))
        .await
        .unwrap();
}

async fn user_pod(client: &Client, ns: &str, name: &str, claim: &str) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "c", "image": "busybox"}],
            "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": claim}}],
        }
    }))
    .unwrap();
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
}

async fn get_secret(client: &Client, ns: &str, name: &str) -> Option<Secret> {
    Api::<Secret>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .unwrap()
}

fn data(s: &Secret, k: &str) -> Vec<u8> {
    s.data.as_ref().unwrap()[k].0.clone()
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e1_pvc_export_objects_ready_links_and_bridge() {
    let env = TestEnv::new("vmx-e1").await;
    let m = manager(&env);
    m.wait_ready().await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    create_pvc(&c, &ns, "disk", Some("kubevirt"), false).await;
    create_pvc(&c, &ns, "files", None, false).await;
    create_pvc(&c, &ns, "blk", None, true).await;
    create_export(&c, &ns, "e1", pvc_source("disk"), None)
        .await
        .unwrap();
    create_export(&c, &ns, "e2", pvc_source("files"), None)
        .await
        .unwrap();
    create_export(&c, &ns, "e3", pvc_source("blk"), None)
        .await
        .unwrap();

    for e in ["e1", "e2", "e3"] {
        wait_phase(&c, &ns, e, "Pending", "PodPending").await;
    }
    // the children, owned by the export
    let svc = Api::<Service>::namespaced(c.clone(), &ns)
        .get("virt-export-e1")
        .await
        .unwrap();
    let pod = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("virt-export-e1")
        .await
        .unwrap();
    let token = get_secret(&c, &ns, "export-token-e1")
        .await
        .expect("token Secret");
    let cert = get_secret(&c, &ns, "export-cert-e1")
        .await
        .expect("cert Secret");
    for owners in [
        svc.owner_references(),
        pod.owner_references(),
        token.owner_references(),
        cert.owner_references(),
    ] {
        let o = &owners[0];
        assert_eq!(
            (o.kind.as_str(), o.api_version.as_str(), o.name.as_str()),
            ("VirtualMachineExport", "export.kubevirt.io/v1", "e1")
        );
        assert_eq!(
            (o.controller, o.block_owner_deletion),
            (Some(true), Some(true))
        );
    }
    let tok = String::from_utf8(data(&token, "token")).unwrap();
    assert!(tok.len() >= 32 && tok.bytes().all(|b| b.is_ascii_alphanumeric()));

    for e in ["e1", "e2", "e3"] {
        mark_pod(&c, &ns, &format!("virt-export-{e}"), "Running", true).await;
    }
    let e1 = wait_phase(&c, &ns, "e1", "Ready", "PodReady").await;
    let st = e1.status.clone().unwrap();
    assert_eq!(st.token_secret_ref.as_deref(), Some("export-token-e1"));
    assert_eq!(st.service_name.as_deref(), Some("virt-export-e1"));
    let ca = get_secret(&c, &ns, "ucm-export-ca")
        .await
        .expect("CA Secret in the manager namespace");
    let int = st.links.clone().unwrap().internal.unwrap();
    assert_eq!(
        int.cert,
        String::from_utf8(data(&ca, "tls.crt")).unwrap().trim()
    );
    assert!(st.links.unwrap().external.is_none());
    let h = format!("https://virt-export-e1.{ns}.svc");
    let vols = serde_json::to_value(&int.volumes).unwrap();
    assert_eq!(
        vols,
        json!([{"name": "disk", "formats": [
        {"format": "raw", "url": format!("{h}/volumes/disk/disk.img")},
        {"format": "gzip", "url": format!("{h}/volumes/disk/disk.img.gz")}]}])
    );
    assert_eq!(
        serde_json::to_value(&int.manifests).unwrap(),
        json!([{"type": "auth-header-secret", "url": format!("{h}/internal/manifests/secret")}])
    );
    let e2 = wait_phase(&c, &ns, "e2", "Ready", "PodReady").await;
    let h2 = format!("https://virt-export-e2.{ns}.svc");
    assert_eq!(
        serde_json::to_value(
            e2.status
                .clone()
                .unwrap()
                .links
                .unwrap()
                .internal
                .unwrap()
                .volumes
        )
        .unwrap(),
        json!([{"name": "files", "formats": [
        {"format": "dir", "url": format!("{h2}/volumes/files/dir")},
        {"format": "tar.gz", "url": format!("{h2}/volumes/files/disk.tar.gz")}]}])
    );
    let e3 = wait_phase(&c, &ns, "e3", "Ready", "PodReady").await;
    let blk = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("virt-export-e3")
        .await
        .unwrap();
    assert!(
        blk.spec.unwrap().containers[0]
            .volume_devices
            .as_ref()
            .unwrap()[0]
            .device_path
            .starts_with("/dev/export-volumes/")
    );
    assert_eq!(
        e3.status
            .unwrap()
            .links
            .unwrap()
            .internal
            .unwrap()
            .volumes
            .unwrap()[0]
            .formats
            .as_ref()
            .unwrap()
            .len(),
        2
    );

    // a deleted child is recreated
    Api::<Service>::namespaced(c.clone(), &ns)
        .delete("virt-export-e1", &Default::default())
        .await
        .unwrap();
    eventually(WAIT, "the Service to be recreated", || async {
        Api::<Service>::namespaced(c.clone(), &ns)
            .get_opt("virt-export-e1")
            .await
            .unwrap()
            .is_some_and(|s| s.metadata.deletion_timestamp.is_none())
    })
    .await;

    // the pods the reconciler wrote run as they are: kubevirt and archive content
    bridge(&env, &pod, &tok, &int_urls(&e1)).await;
    let pod2 = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("virt-export-e2")
        .await
        .unwrap();
    let tok2 = String::from_utf8(data(
        &get_secret(&c, &ns, "export-token-e2").await.unwrap(),
        "token",
    ))
    .unwrap();
    bridge(&env, &pod2, &tok2, &int_urls(&e2)).await;
}

fn int_urls(e: &VirtualMachineExport) -> Vec<String> {
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
fn bridge_image(pvc: &str) -> Vec<u8> {
    let seed = pvc
        .bytes()
        .fold(7u32, |a, b| a.wrapping_mul(31).wrapping_add(b as u32));
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
async fn bridge(
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
fn wait_listening(port: u16, what: &str, log: &std::path::Path) {
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
struct Bridge {
    _tmp: tempfile::TempDir,
    child: std::process::Child,
    /// The server's HTTPS port on 127.0.0.1.
    port: u16,
    /// The CA of the internal links (from the pod's certificate Secret).
    ca: std::path::PathBuf,
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Bridge {
    async fn start(env: &TestEnv, pod: &Pod) -> Bridge {
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
    async fn check(
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

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e2_e3_missing_then_in_use_pvc() {
    let env = TestEnv::new("vmx-e3").await;
    let m = manager(&env);
    m.wait_ready().await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    create_export(&c, &ns, "late", pvc_source("d"), None)
        .await
        .unwrap();
    let e = wait_phase(&c, &ns, "late", "Pending", "Initializing").await;
    let pvc_cond = e
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "PVCReady")
        .unwrap();
    assert_eq!(pvc_cond.reason.as_deref(), Some("PVCNotFound"));
    assert_eq!(
        pvc_cond.message,
        Some(format!("PersistentVolumeClaim {ns}/d not found"))
    );
    // what the user must act on is also a Warning event (kubectl describe, event alerting)
    eventually(WAIT, "a PVCNotFound Warning event", || async {
        let evs: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(c.clone(), &ns);
        evs.list(&Default::default())
            .await
            .unwrap()
            .items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("PVCNotFound")
                    && e.type_.as_deref() == Some("Warning")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("late")
            })
    })
    .await;
    // a user pod appears before the claim: once the claim exists the export waits for the user
    user_pod(&c, &ns, "user", "d").await;
    mark_pod(&c, &ns, "user", "Running", true).await;
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    let (_, _, msg) = ready_reason(&wait_phase(&c, &ns, "late", "Pending", "InUse").await);
    assert_eq!(msg, format!("PersistentVolumeClaim {ns}/d is in use"));
    assert!(
        Api::<Pod>::namespaced(c.clone(), &ns)
            .get_opt("virt-export-late")
            .await
            .unwrap()
            .is_none()
    );
    // the user finishes: the export proceeds
    Api::<Pod>::namespaced(c.clone(), &ns)
        .patch_status(
            "user",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
        )
        .await
        .unwrap();
    wait_phase(&c, &ns, "late", "Pending", "PodPending").await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e9_ttl_deletes_without_pod_and_counts() {
    let env = TestEnv::new("vmx-e9").await;
    let m = manager(&env);
    m.wait_ready().await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    create_export(&c, &ns, "short", pvc_source("absent"), Some("10s"))
        .await
        .unwrap();
    create_export(
        &c,
        &ns,
        "skipped",
        json!({"kind": "Pod", "name": "x"}),
        Some("10s"),
    )
    .await
    .unwrap();
    let e = wait_phase(&c, &ns, "short", "Pending", "Initializing").await;
    let expiry = e.status.unwrap().ttl_expiration_time.unwrap().0;
    let created = e.metadata.creation_timestamp.unwrap().0;
    assert_eq!(
        expiry.duration_since(created),
        jiff::SignedDuration::from_secs(10)
    );
    wait_phase(&c, &ns, "skipped", "Skipped", "UnsupportedSource").await;
    loop {
        let a = export(&c, &ns, "short").await;
        let b = export(&c, &ns, "skipped").await;
        let now = jiff::Timestamp::now();
        if a.is_none() && b.is_none() {
            assert!(
                now.duration_since(expiry) < jiff::SignedDuration::from_millis(1500),
                "deleted {:?} after expiry",
                now.duration_since(expiry)
            );
            break;
        }
        assert!(
            now < expiry + jiff::SignedDuration::from_secs(2),
            "not deleted at expiry"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eventually(WAIT, "the TTL counter", || async {
        m.metrics()
            .await
            .contains("ucm_vmexport_ttl_deletions_total 2")
    })
    .await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e10_e12_e16_validation_unsupported_and_alpha() {
    let env = TestEnv::new("vmx-e10").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    let m = manager(&env);
    m.wait_ready().await;
    create_export(&c, &ns, "imm", pvc_source("a"), None)
        .await
        .unwrap();
    let api: Api<VirtualMachineExport> = Api::namespaced(c.clone(), &ns);
    let err = api
        .patch(
            "imm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"source": {"name": "b"}}})),
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("spec is immutable after creation"),
        "{err}"
    );
    api.patch(
        "imm",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
    )
    .await
    .unwrap();
    let err = create_export(&c, &ns, "neg", pvc_source("a"), Some("-1h"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("ttlDuration"), "{err}");
    let err = create_export(&c, &ns, "bad", pvc_source("a"), Some("soon"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("ttlDuration"), "{err}");
    assert!(
        create_export(
            &c,
            &ns,
            "blank",
            json!({"kind": "PersistentVolumeClaim", "name": ""}),
            None
        )
        .await
        .is_err()
    );

    create_export(&c, &ns, "pod", json!({"kind": "Pod", "name": "x"}), None)
        .await
        .unwrap();
    create_export(
        &c,
        &ns,
        "foo",
        json!({"kind": "VirtualMachine", "apiGroup": "foo.io", "name": "x"}),
        None,
    )
    .await
    .unwrap();
    for n in ["pod", "foo"] {
        let (_, _, msg) =
            ready_reason(&wait_phase(&c, &ns, n, "Skipped", "UnsupportedSource").await);
        assert!(msg.contains("supported sources are"), "{msg}");
    }

    // `dot.x` and `dot-x` map to one Service name: the second export must not borrow it
    create_export(&c, &ns, "dot.x", pvc_source("a"), None)
        .await
        .unwrap();
    eventually(WAIT, "the Service of dot.x", || async {
        Api::<Service>::namespaced(c.clone(), &ns)
            .get_opt("virt-export-dot-x")
            .await
            .unwrap()
            .is_some()
    })
    .await;
    create_export(&c, &ns, "dot-x", pvc_source("a"), None)
        .await
        .unwrap();
    let (_, _, msg) =
        ready_reason(&wait_phase(&c, &ns, "dot-x", "Pending", "ObjectCreationFailed").await);
    assert!(
        msg.contains("virt-export-dot-x") && msg.contains("dot.x"),
        "{msg}"
    );

    // v1alpha1 in, v1 (storage) out
    let ar = ApiResource {
        group: "export.kubevirt.io".into(),
        version: "v1alpha1".into(),
        api_version: "export.kubevirt.io/v1alpha1".into(),
        kind: "VirtualMachineExport".into(),
        plural: "virtualmachineexports".into(),
    };
    let alpha: Api<DynamicObject> = Api::namespaced_with(c.clone(), &ns, &ar);
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "export.kubevirt.io/v1alpha1", "kind": "VirtualMachineExport",
        "metadata": {"name": "alpha"},
        "spec": {"source": {"kind": "PersistentVolumeClaim", "name": "a"}, "ttlDuration": "90m", "tokenSecretRef": "mine"},
    })).unwrap();
    alpha.create(&PostParams::default(), &obj).await.unwrap();
    let beta = api.get("alpha").await.unwrap();
    assert_eq!(beta.spec.ttl_duration.as_deref(), Some("90m"));
    assert_eq!(beta.spec.token_secret_ref.as_deref(), Some("mine"));
    assert_eq!(beta.spec.source.name, "a");
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e13_pod_creation_refused_still_writes_status() {
    let env = TestEnv::new("vmx-e13").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    let lr: LimitRange = serde_json::from_value(json!({
        "metadata": {"name": "tiny"},
        "spec": {"limits": [{"type": "Container", "max": {"cpu": "50m"}}]},
    }))
    .unwrap();
    let lrs: Api<LimitRange> = Api::namespaced(c.clone(), &ns);
    lrs.create(&PostParams::default(), &lr).await.unwrap();
    let m = manager(&env);
    m.wait_ready().await;
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    create_export(&c, &ns, "lr", pvc_source("d"), None)
        .await
        .unwrap();
    let (_, _, msg) =
        ready_reason(&wait_phase(&c, &ns, "lr", "Pending", "PodCreationFailed").await);
    assert!(
        msg.contains("virt-export-lr") && msg.to_lowercase().contains("cpu"),
        "{msg}"
    );
    lrs.delete("tiny", &Default::default()).await.unwrap();
    // the error backoff (capped at 60 s) retries the create
    let start = Instant::now();
    loop {
        if Api::<Pod>::namespaced(c.clone(), &ns)
            .get_opt("virt-export-lr")
            .await
            .unwrap()
            .is_some()
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(75),
            "pod not created after the LimitRange went away"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn pod_uid(c: &Client, ns: &str, name: &str) -> Option<String> {
    Api::<Pod>::namespaced(c.clone(), ns)
        .get_opt(name)
        .await
        .unwrap()
        .and_then(|p| p.metadata.uid)
}

async fn has_event(c: &Client, ns: &str, reason: &str) -> bool {
    let evs: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(c.clone(), ns);
    evs.list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .any(|e| e.reason.as_deref() == Some(reason))
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e4_e8_e18_pause_pod_lifecycle_and_phase_metric() {
    let env = TestEnv::new("vmx-e4").await;
    let m = manager(&env);
    m.wait_ready().await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    create_export(&c, &ns, "p", pvc_source("d"), None)
        .await
        .unwrap();
    wait_phase(&c, &ns, "p", "Pending", "PodPending").await;
    mark_pod(&c, &ns, "virt-export-p", "Running", true).await;
    let ready = wait_phase(&c, &ns, "p", "Ready", "PodReady").await;
    let links = ready.status.unwrap().links;
    let start = Instant::now();
    loop {
        let text = m.metrics().await;
        if text.contains("ucm_vmexport_exports{phase=\"Ready\"} 1") {
            break;
        }
        assert!(
            start.elapsed() < WAIT,
            "no Ready export in the phase metric:\n{}",
            text.lines()
                .filter(|l| l.contains("vmexport"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A new user of the claim pauses the export: pod deleted, links gone
    user_pod(&c, &ns, "user", "d").await;
    let paused = wait_phase(&c, &ns, "p", "Pending", "InUse").await;
    assert!(paused.status.unwrap().links.is_none());
    eventually(WAIT, "the export pod to be deleted", || async {
        pod_uid(&c, &ns, "virt-export-p").await.is_none()
    })
    .await;
    eventually(WAIT, "an ExportPaused event", || async {
        has_event(&c, &ns, "ExportPaused").await
    })
    .await;
    Api::<Pod>::namespaced(c.clone(), &ns)
        .patch_status(
            "user",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Failed"}})),
        )
        .await
        .unwrap();
    wait_phase(&c, &ns, "p", "Pending", "PodPending").await;
    mark_pod(&c, &ns, "virt-export-p", "Running", true).await;
    let again = wait_phase(&c, &ns, "p", "Ready", "PodReady").await;
    assert_eq!(
        again.status.unwrap().links,
        links,
        "the URLs do not change across a pause"
    );

    // A failed pod is replaced
    let uid = pod_uid(&c, &ns, "virt-export-p").await.unwrap();
    mark_pod(&c, &ns, "virt-export-p", "Failed", false).await;
    eventually(WAIT, "a new export pod after Failed", || async {
        pod_uid(&c, &ns, "virt-export-p")
            .await
            .is_some_and(|u| u != uid)
    })
    .await;
    eventually(WAIT, "an ExporterPodFailedOrCompleted event", || async {
        has_event(&c, &ns, "ExporterPodFailedOrCompleted").await
    })
    .await;
    // ... and so is one that exited at DEADLINE
    let uid = pod_uid(&c, &ns, "virt-export-p").await.unwrap();
    mark_pod(&c, &ns, "virt-export-p", "Succeeded", false).await;
    eventually(WAIT, "a new export pod after Succeeded", || async {
        pod_uid(&c, &ns, "virt-export-p")
            .await
            .is_some_and(|u| u != uid)
    })
    .await;
    // a deleted token Secret is recreated with a new token
    let old = get_secret(&c, &ns, "export-token-p").await.unwrap();
    Api::<Secret>::namespaced(c.clone(), &ns)
        .delete("export-token-p", &Default::default())
        .await
        .unwrap();
    eventually(WAIT, "the token Secret to be recreated", || async {
        get_secret(&c, &ns, "export-token-p")
            .await
            .is_some_and(|s| s.metadata.uid != old.metadata.uid)
    })
    .await;
    // ... so are a deleted serving-certificate Secret and a deleted pod
    let old = get_secret(&c, &ns, "export-cert-p").await.unwrap();
    Api::<Secret>::namespaced(c.clone(), &ns)
        .delete("export-cert-p", &Default::default())
        .await
        .unwrap();
    eventually(WAIT, "the cert Secret to be recreated", || async {
        get_secret(&c, &ns, "export-cert-p")
            .await
            .is_some_and(|s| s.metadata.uid != old.metadata.uid && !data(&s, "tls.crt").is_empty())
    })
    .await;
    let uid = pod_uid(&c, &ns, "virt-export-p").await.unwrap();
    Api::<Pod>::namespaced(c.clone(), &ns)
        .delete("virt-export-p", &Default::default())
        .await
        .unwrap();
    eventually(WAIT, "a new export pod after deletion", || async {
        pod_uid(&c, &ns, "virt-export-p")
            .await
            .is_some_and(|u| u != uid)
    })
    .await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e14_e15_e17_external_links_cert_params_and_gc() {
    let env = TestEnv::new("vmx-e14").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    let ca_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        ca_file.path(),
        "-----BEGIN CERTIFICATE-----\nEXTERNAL\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let m = Manager::start(
        ManagerOpts::new(&env.kubeconfig, &ns)
            .only("vmexport")
            .args([
                "--export-external-host=proxy.example.test:8443".to_string(),
                format!("--export-external-ca-file={}", ca_file.path().display()),
            ]),
    );
    m.wait_ready().await;
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    create_export(&c, &ns, "x", pvc_source("d"), None)
        .await
        .unwrap();
    wait_phase(&c, &ns, "x", "Pending", "PodPending").await;
    mark_pod(&c, &ns, "virt-export-x", "Running", true).await;
    let e = wait_phase(&c, &ns, "x", "Ready", "PodReady").await;
    let ext = e
        .status
        .unwrap()
        .links
        .unwrap()
        .external
        .expect("external links with --export-external-host");
    assert_eq!(
        ext.cert,
        "-----BEGIN CERTIFICATE-----\nEXTERNAL\n-----END CERTIFICATE-----"
    );
    let base = format!(
        "https://proxy.example.test:8443/api/export.kubevirt.io/v1/namespaces/{ns}/virtualmachineexports/x"
    );
    let urls: Vec<_> = ext.volumes.unwrap()[0]
        .formats
        .clone()
        .unwrap()
        .into_iter()
        .map(|f| f.url)
        .collect();
    assert_eq!(
        urls,
        [
            format!("{base}/volumes/d/disk.img"),
            format!("{base}/volumes/d/disk.img.gz")
        ]
    );
    assert_eq!(
        ext.manifests.unwrap()[0].url,
        format!("{base}/external/manifests/secret")
    );

    // A restart with another certificate duration replaces the pod
    let uid = pod_uid(&c, &ns, "virt-export-x").await.unwrap();
    drop(m);
    let m2 = Manager::start(
        ManagerOpts::new(&env.kubeconfig, &ns)
            .only("vmexport")
            .args(["--export-cert-duration=12h"]),
    );
    m2.wait_ready().await;
    eventually(
        WAIT,
        "a new pod with the new certificate parameters",
        || async {
            match Api::<Pod>::namespaced(c.clone(), &ns)
                .get_opt("virt-export-x")
                .await
                .unwrap()
            {
                Some(p) => {
                    p.metadata.uid.as_deref() != Some(uid.as_str())
                        && p.annotations()
                            .get("kubevirt.io/export.certParameters")
                            .map(String::as_str)
                            == Some("{\"Duration\":43200000000000,\"RenewBefore\":8640000000000}")
                }
                None => false,
            }
        },
    )
    .await;
    eventually(WAIT, "a CertificateParametersChanged event", || async {
        has_event(&c, &ns, "CertificateParametersChanged").await
    })
    .await;

    // Deleting the export lets the garbage collector remove every child
    Api::<VirtualMachineExport>::namespaced(c.clone(), &ns)
        .delete("x", &Default::default())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(60),
        "GC of the Service, Secrets and Pod",
        || async {
            Api::<Service>::namespaced(c.clone(), &ns)
                .get_opt("virt-export-x")
                .await
                .unwrap()
                .is_none()
                && get_secret(&c, &ns, "export-token-x").await.is_none()
                && get_secret(&c, &ns, "export-cert-x").await.is_none()
                && pod_uid(&c, &ns, "virt-export-x").await.is_none()
        },
    )
    .await;
}

/// Schema-only KubeVirt CRDs (the e2e suite has no KubeVirt): VirtualMachine and
/// VirtualMachineInstance, any content accepted, with a status subresource.
async fn install_kubevirt_crds(client: &Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for (kind, plural) in [
        ("VirtualMachine", "virtualmachines"),
        ("VirtualMachineInstance", "virtualmachineinstances"),
    ] {
        let crd: CustomResourceDefinition = serde_json::from_value(json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": format!("{plural}.kubevirt.io")},
            "spec": {
                "group": "kubevirt.io", "scope": "Namespaced",
                "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(), "listKind": format!("{kind}List")},
                "versions": [{"name": "v1", "served": true, "storage": true, "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}],
            }
        })).unwrap();
        apply_crd(&crds, &crd).await;
        wait_established(&crds, &format!("{plural}.kubevirt.io")).await;
    }
}

fn kv(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "kubevirt.io".into(),
        version: "v1".into(),
        api_version: "kubevirt.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

async fn create_vm(c: &Client, ns: &str, name: &str, volumes: serde_json::Value) {
    let ar = kv("VirtualMachine", "virtualmachines");
    let vm: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {}, "volumes": volumes}}},
    }))
    .unwrap();
    Api::<DynamicObject>::namespaced_with(c.clone(), ns, &ar)
        .create(&PostParams::default(), &vm)
        .await
        .unwrap();
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e5_e6_vm_source_stopped_running_missing_and_empty() {
    let env = TestEnv::new("vmx-e5").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    install_kubevirt_crds(&c).await;
    let m = manager(&env);
    m.wait_ready().await;
    create_pvc(&c, &ns, "rootdisk", Some("kubevirt"), false).await;
    create_pvc(&c, &ns, "data", None, false).await;
    create_pvc(&c, &ns, "dump", None, false).await;
    create_vm(
        &c,
        &ns,
        "vm1",
        json!([
            {"name": "root", "persistentVolumeClaim": {"claimName": "rootdisk"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
            {"name": "root-again", "persistentVolumeClaim": {"claimName": "rootdisk"}},
            {"name": "dump", "memoryDump": {"claimName": "dump"}},
            {"name": "cloudinit", "cloudInitNoCloud": {"userData": "x"}},
        ]),
    )
    .await;
    let vm_source =
        |n: &str| json!({"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": n});
    create_export(&c, &ns, "vmx", vm_source("vm1"), None)
        .await
        .unwrap();
    let e = wait_phase(&c, &ns, "vmx", "Pending", "PodPending").await;
    assert_eq!(
        e.status.unwrap().virtual_machine_name.as_deref(),
        Some("vm1")
    );
    let pod = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("virt-export-vmx")
        .await
        .unwrap();
    let claims: Vec<String> = pod
        .spec
        .unwrap()
        .volumes
        .unwrap()
        .into_iter()
        .filter_map(|v| v.persistent_volume_claim.map(|p| p.claim_name))
        .collect();
    assert_eq!(claims, ["rootdisk", "data", "dump"], "each claim once");
    mark_pod(&c, &ns, "virt-export-vmx", "Running", true).await;
    let e = wait_phase(&c, &ns, "vmx", "Ready", "PodReady").await;
    let int = e.status.unwrap().links.unwrap().internal.unwrap();
    let manifests: Vec<(String, String)> = int
        .manifests
        .clone()
        .unwrap()
        .into_iter()
        .map(|m| (m.type_, m.url))
        .collect();
    let h = format!("https://virt-export-vmx.{ns}.svc");
    assert_eq!(
        manifests,
        [
            ("all".to_string(), format!("{h}/internal/manifests/all")),
            (
                "auth-header-secret".to_string(),
                format!("{h}/internal/manifests/secret")
            ),
        ]
    );
    let cm = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(c.clone(), &ns)
        .get("exporter-vm-manifest-vmx")
        .await
        .unwrap();
    let data = cm.data.unwrap();
    assert!(data["virtualmachine-manifest"].contains("\"vm1\""));
    assert!(data.contains_key("dv-rootdisk") && data.contains_key("dv-data"));
    assert_eq!(cm.metadata.owner_references.unwrap()[0].name, "vmx");
    let vols = int.volumes.unwrap();
    let shape: Vec<(String, Vec<String>)> = vols
        .into_iter()
        .map(|v| {
            (
                v.name,
                v.formats.unwrap().into_iter().map(|f| f.format).collect(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (
                "rootdisk".to_string(),
                vec!["raw".to_string(), "gzip".to_string()]
            ),
            (
                "data".to_string(),
                vec!["dir".to_string(), "tar.gz".to_string()]
            ),
            (
                "dump".to_string(),
                vec!["dir".to_string(), "tar.gz".to_string()]
            ),
        ]
    );

    // starting the VM pauses the export; a finished VMI lets it proceed
    let vmis = Api::<DynamicObject>::namespaced_with(
        c.clone(),
        &ns,
        &kv("VirtualMachineInstance", "virtualmachineinstances"),
    );
    let vmi: DynamicObject = serde_json::from_value(json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "vm1"}, "spec": {}})).unwrap();
    vmis.create(&PostParams::default(), &vmi).await.unwrap();
    let (_, _, msg) = ready_reason(&wait_phase(&c, &ns, "vmx", "Pending", "InUse").await);
    assert_eq!(msg, format!("Virtual Machine {ns}/vm1 is running"));
    eventually(WAIT, "an ExportPaused event", || async {
        has_event(&c, &ns, "ExportPaused").await
    })
    .await;
    vmis.patch_status(
        "vm1",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await
    .unwrap();
    wait_phase(&c, &ns, "vmx", "Pending", "PodPending").await;

    // missing VM: Skipped until it appears
    create_export(&c, &ns, "late", vm_source("vm2"), None)
        .await
        .unwrap();
    let (_, _, msg) = ready_reason(&wait_phase(&c, &ns, "late", "Skipped", "VMNotFound").await);
    assert_eq!(msg, format!("Virtual Machine {ns}/vm2 not found"));
    create_vm(
        &c,
        &ns,
        "vm2",
        json!([{"name": "root", "persistentVolumeClaim": {"claimName": "rootdisk"}}]),
    )
    .await;
    // VM sources have no per-claim in-use check: vmx's pod on rootdisk does not block it
    wait_phase(&c, &ns, "late", "Pending", "PodPending").await;

    // a claim that does not exist yet: not populated until it does
    create_vm(
        &c,
        &ns,
        "vm3",
        json!([{"name": "root", "dataVolume": {"name": "later"}}]),
    )
    .await;
    create_export(&c, &ns, "np", vm_source("vm3"), None)
        .await
        .unwrap();
    wait_phase(&c, &ns, "np", "Pending", "VolumesNotPopulated").await;
    create_pvc(&c, &ns, "later", Some("kubevirt"), false).await;
    wait_phase(&c, &ns, "np", "Pending", "PodPending").await;

    // no exportable volumes: Skipped, naming what was ignored
    create_vm(
        &c,
        &ns,
        "vm4",
        json!([{"name": "ci", "cloudInitNoCloud": {"userData": "x"}}]),
    )
    .await;
    create_export(&c, &ns, "empty", vm_source("vm4"), None)
        .await
        .unwrap();
    let (_, _, msg) = ready_reason(&wait_phase(&c, &ns, "empty", "Skipped", "VMNoVolumes").await);
    assert!(msg.contains("ci"), "{msg}");
}

async fn install_crd(client: &Client, group: &str, version: &str, kind: &str, plural: &str) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        // k8s.io groups are protected; the real external-snapshotter CRD carries this annotation.
        "metadata": {"name": format!("{plural}.{group}"), "annotations": {"api-approved.kubernetes.io": "https://github.com/kubernetes-csi/external-snapshotter/pull/814"}},
        "spec": {
            "group": group, "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(), "listKind": format!("{kind}List")},
            "versions": [{"name": version, "served": true, "storage": true, "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}],
        }
    })).unwrap();
    apply_crd(&crds, &crd).await;
    wait_established(&crds, &format!("{plural}.{group}")).await;
}

fn dynapi(
    c: &Client,
    ns: &str,
    group: &str,
    version: &str,
    kind: &str,
    plural: &str,
) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    };
    Api::namespaced_with(c.clone(), ns, &ar)
}

async fn create_dyn(api: &Api<DynamicObject>, body: serde_json::Value) {
    let status = body.get("status").cloned();
    let obj: DynamicObject = serde_json::from_value(body).unwrap();
    let name = obj.name_any();
    api.create(&PostParams::default(), &obj).await.unwrap();
    if let Some(st) = status {
        api.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": st})),
        )
        .await
        .unwrap();
    }
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e7_snapshot_source_restore_pvcs() {
    let env = TestEnv::new("vmx-e7").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    install_crd(
        &c,
        "snapshot.kubevirt.io",
        "v1beta1",
        "VirtualMachineSnapshot",
        "virtualmachinesnapshots",
    )
    .await;
    install_crd(
        &c,
        "snapshot.kubevirt.io",
        "v1beta1",
        "VirtualMachineSnapshotContent",
        "virtualmachinesnapshotcontents",
    )
    .await;
    install_crd(
        &c,
        "snapshot.storage.k8s.io",
        "v1",
        "VolumeSnapshot",
        "volumesnapshots",
    )
    .await;
    let m = manager(&env);
    m.wait_ready().await;
    let snaps = dynapi(
        &c,
        &ns,
        "snapshot.kubevirt.io",
        "v1beta1",
        "VirtualMachineSnapshot",
        "virtualmachinesnapshots",
    );
    let contents = dynapi(
        &c,
        &ns,
        "snapshot.kubevirt.io",
        "v1beta1",
        "VirtualMachineSnapshotContent",
        "virtualmachinesnapshotcontents",
    );
    let vss = dynapi(
        &c,
        &ns,
        "snapshot.storage.k8s.io",
        "v1",
        "VolumeSnapshot",
        "volumesnapshots",
    );
    let src = |n: &str| json!({"apiGroup": "snapshot.kubevirt.io", "kind": "VirtualMachineSnapshot", "name": n});

    // not found: Skipped with both conditions
    create_export(&c, &ns, "none", src("nope"), None)
        .await
        .unwrap();
    let e = wait_phase(&c, &ns, "none", "Skipped", "VMSnapshotNotFound").await;
    let conds = e.status.unwrap().conditions.unwrap();
    let vc = conds.iter().find(|c| c.type_ == "VolumesCreated").unwrap();
    assert_eq!(
        (vc.status.as_str(), vc.reason.as_deref()),
        ("False", Some("VMSnapshotNoVolumes"))
    );

    create_dyn(&snaps, json!({"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshot",
        "metadata": {"name": "snap1"}, "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm1"}},
        "status": {"readyToUse": false}})).await;
    create_export(&c, &ns, "sx", src("snap1"), None)
        .await
        .unwrap();
    let e = wait_phase(&c, &ns, "sx", "Pending", "NotAllPVCsCreated").await;
    assert_eq!(
        e.status.as_ref().unwrap().virtual_machine_name.as_deref(),
        Some("vm1")
    );

    create_dyn(&vss, json!({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": {"name": "vs-root"}, "spec": {"source": {"persistentVolumeClaimName": "rootdisk"}},
        "status": {"restoreSize": "2Gi", "readyToUse": true}})).await;
    create_dyn(&contents, json!({"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshotContent",
        "metadata": {"name": "content1"},
        "spec": {
            "source": {"virtualMachine": {"spec": {"template": {"spec": {"volumes": [{"name": "root", "dataVolume": {"name": "rootdisk"}}]}}}}},
            "volumeBackups": [{"volumeName": "root", "volumeSnapshotName": "vs-root", "persistentVolumeClaim": {
                "metadata": {"name": "rootdisk", "labels": {"app": "db"}, "annotations": {"restore.kubevirt.io/name": "old"}},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, "volumeMode": "Filesystem", "storageClassName": "none"}}}],
        },
        "status": {"volumeSnapshotStatus": [{"volumeSnapshotName": "vs-root"}]}})).await;
    snaps.patch_status("snap1", &PatchParams::default(), &Patch::Merge(json!({"status": {"readyToUse": true, "virtualMachineSnapshotContentName": "content1"}}))).await.unwrap();

    let e = wait_phase(&c, &ns, "sx", "Pending", "PodPending").await;
    let vc = e
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "VolumesCreated")
        .unwrap();
    assert_eq!(
        vc.reason.as_deref(),
        Some("NotAllPVCsReady"),
        "the restore PVC is not Bound (no provisioner)"
    );
    let pvc = Api::<PersistentVolumeClaim>::namespaced(c.clone(), &ns)
        .get("sx-rootdisk")
        .await
        .unwrap();
    let uid = pvc.metadata.uid.clone();
    let spec = pvc.spec.clone().unwrap();
    let ds = spec.data_source.unwrap();
    assert_eq!(
        (ds.kind.as_str(), ds.name.as_str(), ds.api_group.as_deref()),
        ("VolumeSnapshot", "vs-root", Some("snapshot.storage.k8s.io"))
    );
    assert_eq!(
        spec.resources.unwrap().requests.unwrap()["storage"].0,
        "2Gi"
    );
    assert_eq!(pvc.labels()["app"], "db");
    assert_eq!(
        pvc.annotations()
            .get("cdi.kubevirt.io/storage.contentType")
            .map(String::as_str),
        Some("kubevirt")
    );
    assert!(!pvc.annotations().contains_key("restore.kubevirt.io/name"));
    assert_eq!(pvc.owner_references()[0].name, "sx");

    mark_pod(&c, &ns, "virt-export-sx", "Running", true).await;
    let e = wait_phase(&c, &ns, "sx", "Ready", "PodReady").await;
    let v = &e
        .status
        .unwrap()
        .links
        .unwrap()
        .internal
        .unwrap()
        .volumes
        .unwrap()[0];
    assert_eq!(
        v.name, "rootdisk",
        "the export prefix is stripped from the name"
    );
    assert_eq!(
        v.formats.as_ref().unwrap()[0].url,
        format!("https://virt-export-sx.{ns}.svc/volumes/sx-rootdisk/disk.img")
    );
    // the restore PVC is not re-created
    assert_eq!(
        Api::<PersistentVolumeClaim>::namespaced(c.clone(), &ns)
            .get("sx-rootdisk")
            .await
            .unwrap()
            .metadata
            .uid,
        uid
    );
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e11_without_kubevirt_crds_then_installed() {
    // A control plane of its own: the shared one gets the KubeVirt test CRDs from other tests.
    let own = tokio::task::spawn_blocking(Harness::start_own)
        .await
        .unwrap();
    let c = client_for(&own.kubeconfig).await;
    install_crds(&c).await;
    let ns = create_namespace(&c, "vmx-e11").await;
    let m = Manager::start(ManagerOpts::new(&own.kubeconfig, &ns).only("vmexport"));
    m.wait_ready().await;
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    create_export(
        &c,
        &ns,
        "vmx",
        json!({"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm1"}),
        None,
    )
    .await
    .unwrap();
    create_export(&c, &ns, "pvcx", pvc_source("d"), None)
        .await
        .unwrap();
    let (_, _, msg) =
        ready_reason(&wait_phase(&c, &ns, "vmx", "Pending", "SourceAPINotInstalled").await);
    assert!(
        msg.contains("kubevirt.io") && msg.contains("VirtualMachine"),
        "{msg}"
    );
    wait_phase(&c, &ns, "pvcx", "Pending", "PodPending").await;
    assert_eq!(
        m.readyz().await.map(|r| r.0),
        Some(200),
        "the manager stays healthy"
    );

    // the API appears: discovery (every 60 s) starts the watch and re-checks the export
    install_kubevirt_crds(&c).await;
    create_vm(
        &c,
        &ns,
        "vm1",
        json!([{"name": "root", "persistentVolumeClaim": {"claimName": "d"}}]),
    )
    .await;
    let start = Instant::now();
    loop {
        let (p, r, _) = ready_reason(&export(&c, &ns, "vmx").await.unwrap());
        if (p.as_str(), r.as_str()) == ("Pending", "PodPending") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(75),
            "still {p}/{r} after the API appeared"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A stand-in for KubeVirt's virt-api behind the API server's aggregation layer (APIService
/// `v1.subresources.kubevirt.io` → an ExternalName Service → this HTTPS server on localhost).
/// It expands a VM as virt-api would for a `u1.small` instancetype: the reference goes, the
/// CPU and memory it stands for go into the template. A VM named `broken` gets a 500.
struct FakeVirtApi {
    port: u16,
    calls: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    stop: tokio_util::sync::CancellationToken,
    _dir: tempfile::TempDir,
}

impl Drop for FakeVirtApi {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn expand_like_virt_api(mut vm: serde_json::Value) -> serde_json::Value {
    let spec = vm["spec"].as_object_mut().unwrap();
    spec.remove("instancetype");
    spec.remove("preference");
    let domain = &mut vm["spec"]["template"]["spec"]["domain"];
    domain["cpu"] = json!({"sockets": 1, "cores": 2, "threads": 1});
    domain["memory"] = json!({"guest": "2Gi"});
    vm
}

async fn fake_virt_api_response(
    c: Client,
    req: http::Request<hyper::body::Incoming>,
) -> http::Response<http_body_util::Full<bytes::Bytes>> {
    use http_body_util::BodyExt;
    let reply = |code: u16, body: serde_json::Value| {
        http::Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_string(),
            )))
            .unwrap()
    };
    let status = |code: u16, msg: &str| json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "message": msg});
    let path = req.uri().path().to_string();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (req.method().as_str(), parts.as_slice()) {
        ("GET", ["apis", "subresources.kubevirt.io", "v1"]) => reply(
            200,
            json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "subresources.kubevirt.io/v1",
                "resources": [
                    {"name": "virtualmachines/expand-spec", "singularName": "", "namespaced": true, "kind": "VirtualMachine", "verbs": ["get"]},
                    {"name": "expand-vm-spec", "singularName": "", "namespaced": true, "kind": "VirtualMachine", "verbs": ["update"]}]}),
        ),
        (
            "GET",
            [
                "apis",
                "subresources.kubevirt.io",
                "v1",
                "namespaces",
                ns,
                "virtualmachines",
                name,
                "expand-spec",
            ],
        ) => {
            if *name == "broken" {
                return reply(500, status(500, "instancetype u1.large not found"));
            }
            let vms = Api::<DynamicObject>::namespaced_with(
                c,
                ns,
                &kv("VirtualMachine", "virtualmachines"),
            );
            match vms.get_opt(name).await {
                Ok(Some(vm)) => reply(200, expand_like_virt_api(serde_json::to_value(vm).unwrap())),
                _ => reply(404, status(404, "virtualmachine not found")),
            }
        }
        (
            "PUT",
            [
                "apis",
                "subresources.kubevirt.io",
                "v1",
                "namespaces",
                _ns,
                "expand-vm-spec",
            ],
        ) => {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            match serde_json::from_slice::<serde_json::Value>(&body) {
                Ok(vm) if vm["kind"] == "VirtualMachine" => reply(200, expand_like_virt_api(vm)),
                _ => reply(400, status(400, "the body is not a VirtualMachine")),
            }
        }
        _ => reply(404, status(404, "not found")),
    }
}

impl FakeVirtApi {
    async fn start(c: Client) -> FakeVirtApi {
        use hyper_util::rt::{TokioExecutor, TokioIo};
        let dir = tempfile::tempdir().unwrap();
        let now = jiff::Timestamp::now();
        let ca = ucm::vmexport::certs::new_ca(now).unwrap();
        let pem = ucm::vmexport::certs::issue_serving(
            &ca,
            "virt-api",
            "kubevirt",
            now,
            Duration::from_secs(3600),
        )
        .unwrap();
        let (crt, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&crt, &pem.cert).unwrap();
        std::fs::write(&key, &pem.key).unwrap();
        let tls = ucm::vmexport::server::tls::server_config(&crt, &key, None, None).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = tokio_util::sync::CancellationToken::new();
        let (calls2, stop2) = (calls.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let (tcp, _) = tokio::select! {
                    _ = stop2.cancelled() => return,
                    a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                };
                let (acceptor, c, calls) = (acceptor.clone(), c.clone(), calls2.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let svc = hyper::service::service_fn(move |req: http::Request<_>| {
                        calls.lock().unwrap().push(format!(
                            "{} {}",
                            req.method(),
                            req.uri().path()
                        ));
                        let c = c.clone();
                        async move {
                            Ok::<_, std::convert::Infallible>(fake_virt_api_response(c, req).await)
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        FakeVirtApi {
            port,
            calls,
            stop,
            _dir: dir,
        }
    }

    fn called(&self, call: &str) -> bool {
        self.calls.lock().unwrap().iter().any(|c| c == call)
    }
}

/// The APIService is cluster-wide: it goes away with this guard (also when the test fails), so
/// the shared control plane's discovery never points at a stopped server.
struct ApiServiceGuard {
    kubeconfig: std::path::PathBuf,
}

impl Drop for ApiServiceGuard {
    fn drop(&mut self) {
        let (ok, out) = kubectl(
            &self.kubeconfig,
            &[
                "delete",
                "apiservice",
                "v1.subresources.kubevirt.io",
                "--ignore-not-found",
                "--wait=true",
            ],
            None,
        );
        assert!(
            ok || std::thread::panicking(),
            "cannot remove the APIService: {out}"
        );
    }
}

async fn register_fake_virt_api(env: &TestEnv, port: u16) -> ApiServiceGuard {
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "virt-api"},
        "spec": {"type": "ExternalName", "externalName": "localhost"},
    }))
    .unwrap();
    Api::<Service>::namespaced(env.client.clone(), &env.ns)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let guard = ApiServiceGuard {
        kubeconfig: env.kubeconfig.clone(),
    };
    let apisvc = json!({
        "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
        "metadata": {"name": "v1.subresources.kubevirt.io"},
        "spec": {"group": "subresources.kubevirt.io", "version": "v1",
            "groupPriorityMinimum": 1000, "versionPriority": 15, "insecureSkipTLSVerify": true,
            "service": {"namespace": env.ns, "name": "virt-api", "port": port}},
    });
    let (ok, out) = kubectl(
        &env.kubeconfig,
        &["apply", "-f", "-"],
        Some(&apisvc.to_string()),
    );
    assert!(ok, "APIService: {out}");
    eventually(
        WAIT,
        "the fake virt-api APIService to be Available",
        || async {
            let (_, out) = kubectl(
                &env.kubeconfig,
                &[
                    "get",
                    "apiservice",
                    "v1.subresources.kubevirt.io",
                    "-o",
                    "jsonpath={.status.conditions[?(@.type==\"Available\")].status}",
                ],
                None,
            );
            out.trim() == "True"
        },
    )
    .await;
    guard
}

fn pod_env(p: &Pod) -> BTreeMap<String, String> {
    p.spec.as_ref().unwrap().containers[0]
        .env
        .clone()
        .unwrap()
        .into_iter()
        .filter_map(|e| Some((e.name, e.value?)))
        .collect()
}

async fn manifest_vm(c: &Client, ns: &str, export: &str) -> serde_json::Value {
    let cm = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(c.clone(), ns)
        .get(&format!("exporter-vm-manifest-{export}"))
        .await
        .unwrap();
    serde_json::from_str(&cm.data.unwrap()["virtualmachine-manifest"]).unwrap()
}

fn manifest_types(e: &VirtualMachineExport) -> Vec<String> {
    e.status
        .clone()
        .unwrap()
        .links
        .unwrap()
        .internal
        .unwrap()
        .manifests
        .unwrap()
        .into_iter()
        .map(|m| m.type_)
        .collect()
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e19_instancetypes_expanded_by_kubevirt_for_the_all_manifest() {
    let env = TestEnv::new("vmx-e19").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    install_kubevirt_crds(&c).await;
    for (g, v, k, p) in [
        (
            "snapshot.kubevirt.io",
            "v1beta1",
            "VirtualMachineSnapshot",
            "virtualmachinesnapshots",
        ),
        (
            "snapshot.kubevirt.io",
            "v1beta1",
            "VirtualMachineSnapshotContent",
            "virtualmachinesnapshotcontents",
        ),
        // the `all` manifest's DataVolumes are applied (dry run) as CDI's
        ("cdi.kubevirt.io", "v1beta1", "DataVolume", "datavolumes"),
        (
            "snapshot.storage.k8s.io",
            "v1",
            "VolumeSnapshot",
            "volumesnapshots",
        ),
    ] {
        install_crd(&c, g, v, k, p).await;
    }
    let fake = FakeVirtApi::start(c.clone()).await;
    let _apiservice = register_fake_virt_api(&env, fake.port).await;
    let m = manager(&env);
    m.wait_ready().await;
    create_pvc(&c, &ns, "rootdisk", Some("kubevirt"), false).await;
    create_pvc(&c, &ns, "data", None, false).await;
    let vms = Api::<DynamicObject>::namespaced_with(
        c.clone(),
        &ns,
        &kv("VirtualMachine", "virtualmachines"),
    );
    for (name, it) in [("it", "u1.small"), ("broken", "u1.large")] {
        create_dyn(&vms, json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
            "spec": {"runStrategy": "Halted",
                "instancetype": {"kind": "VirtualMachineClusterInstancetype", "name": it},
                "preference": {"kind": "VirtualMachineClusterPreference", "name": "fedora"},
                "template": {"spec": {"domain": {"devices": {}}, "volumes": [
                    {"name": "root", "persistentVolumeClaim": {"claimName": "rootdisk"}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]}}}})).await;
    }
    let vm_source =
        |n: &str| json!({"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": n});
    create_export(&c, &ns, "itx", vm_source("it"), None)
        .await
        .unwrap();
    create_export(&c, &ns, "brk", vm_source("broken"), None)
        .await
        .unwrap();
    wait_phase(&c, &ns, "itx", "Pending", "PodPending").await;
    wait_phase(&c, &ns, "brk", "Pending", "PodPending").await;

    // a live VM is expanded by name; the manifest holds the expanded spec
    assert!(fake.called(&format!(
        "GET /apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachines/it/expand-spec"
    )));
    let vm = manifest_vm(&c, &ns, "itx").await;
    assert!(
        vm["spec"].get("instancetype").is_none() && vm["spec"].get("preference").is_none(),
        "{vm}"
    );
    assert_eq!(vm["spec"]["template"]["spec"]["domain"]["cpu"]["cores"], 2);
    let pods: Api<Pod> = Api::namespaced(c.clone(), &ns);
    let itx_pod = pods.get("virt-export-itx").await.unwrap();
    assert_eq!(
        pod_env(&itx_pod)
            .get("EXPORT_VM_DEF_URI")
            .map(String::as_str),
        Some("/manifests/all")
    );

    // expand-spec failing: a Warning event, and the export goes on without the all manifest
    eventually(WAIT, "a ManifestFailed event", || async {
        has_event(&c, &ns, "ManifestFailed").await
    })
    .await;
    let brk_pod = pods.get("virt-export-brk").await.unwrap();
    assert!(!pod_env(&brk_pod).contains_key("EXPORT_VM_DEF_URI"));
    assert!(
        Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(c.clone(), &ns)
            .get_opt("exporter-vm-manifest-brk")
            .await
            .unwrap()
            .is_none()
    );

    mark_pod(&c, &ns, "virt-export-itx", "Running", true).await;
    mark_pod(&c, &ns, "virt-export-brk", "Running", true).await;
    let itx = wait_phase(&c, &ns, "itx", "Ready", "PodReady").await;
    let brk = wait_phase(&c, &ns, "brk", "Ready", "PodReady").await;
    assert_eq!(manifest_types(&itx), ["all", "auth-header-secret"]);
    assert_eq!(manifest_types(&brk), ["auth-header-secret"]);

    // the pod runs as written and serves the expanded VM in the all manifest
    let tok = String::from_utf8(data(
        &get_secret(&c, &ns, "export-token-itx").await.unwrap(),
        "token",
    ))
    .unwrap();
    let bodies = bridge(&env, &itx_pod, &tok, &int_urls(&itx)).await;
    let all: serde_json::Value = serde_json::from_slice(
        &bodies[&format!("https://virt-export-itx.{ns}.svc/internal/manifests/all")],
    )
    .unwrap();
    let kinds: Vec<&str> = all["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["ConfigMap", "VirtualMachine", "DataVolume", "DataVolume"]
    );
    let served_vm = &all["items"][1];
    assert!(
        served_vm["spec"].get("instancetype").is_none(),
        "{served_vm}"
    );
    assert_eq!(
        served_vm["spec"]["template"]["spec"]["domain"]["memory"]["guest"],
        "2Gi"
    );

    // a snapshot's copy of the VM is expanded from the body (the live VM may differ or be gone)
    let snaps = dynapi(
        &c,
        &ns,
        "snapshot.kubevirt.io",
        "v1beta1",
        "VirtualMachineSnapshot",
        "virtualmachinesnapshots",
    );
    let contents = dynapi(
        &c,
        &ns,
        "snapshot.kubevirt.io",
        "v1beta1",
        "VirtualMachineSnapshotContent",
        "virtualmachinesnapshotcontents",
    );
    let vss = dynapi(
        &c,
        &ns,
        "snapshot.storage.k8s.io",
        "v1",
        "VolumeSnapshot",
        "volumesnapshots",
    );
    create_dyn(&vss, json!({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": {"name": "vs-root"}, "spec": {"source": {"persistentVolumeClaimName": "rootdisk"}},
        "status": {"restoreSize": "1Gi", "readyToUse": true}})).await;
    create_dyn(&contents, json!({"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshotContent",
        "metadata": {"name": "content-it"},
        "spec": {
            "source": {"virtualMachine": {"metadata": {"name": "it-then"}, "spec": {
                "instancetype": {"kind": "VirtualMachineClusterInstancetype", "name": "u1.small", "revisionName": "it-u1.small-1"},
                "template": {"spec": {"domain": {}, "volumes": [{"name": "root", "persistentVolumeClaim": {"claimName": "rootdisk"}}]}}}}},
            "volumeBackups": [{"volumeName": "root", "volumeSnapshotName": "vs-root", "persistentVolumeClaim": {
                "metadata": {"name": "rootdisk"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, "volumeMode": "Filesystem", "storageClassName": "none"}}}],
        },
        "status": {"volumeSnapshotStatus": [{"volumeSnapshotName": "vs-root"}]}})).await;
    create_dyn(&snaps, json!({"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshot",
        "metadata": {"name": "snap-it"}, "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "it-then"}},
        "status": {"readyToUse": true, "virtualMachineSnapshotContentName": "content-it"}})).await;
    create_export(&c, &ns, "six", json!({"apiGroup": "snapshot.kubevirt.io", "kind": "VirtualMachineSnapshot", "name": "snap-it"}), None)
        .await
        .unwrap();
    wait_phase(&c, &ns, "six", "Pending", "PodPending").await;
    assert!(fake.called(&format!(
        "PUT /apis/subresources.kubevirt.io/v1/namespaces/{ns}/expand-vm-spec"
    )));
    let vm = manifest_vm(&c, &ns, "six").await;
    assert!(vm["spec"].get("instancetype").is_none(), "{vm}");
    assert_eq!(vm["metadata"]["name"], "it-then");
    assert_eq!(vm["spec"]["template"]["spec"]["domain"]["cpu"]["cores"], 2);
    assert_eq!(
        pod_env(&pods.get("virt-export-six").await.unwrap())
            .get("EXPORT_VM_DEF_URI")
            .map(String::as_str),
        Some("/manifests/all")
    );
}

/// `ucm export-proxy` as a process, authenticated as the shipped proxy identity
/// (config/rbac/vmexport/proxy_role.yaml bound to a ServiceAccount of the test namespace),
/// forwarding every upstream to the bridged export server on 127.0.0.1:`upstream`.
struct Proxy {
    child: std::process::Child,
    port: u16,
    metrics: u16,
    log: std::path::PathBuf,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn proxy_identity(admin: &std::path::Path, ns: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let text =
        std::fs::read_to_string(repo_root().join("config/rbac/vmexport/proxy_role.yaml")).unwrap();
    let role = yaml_docs(&text)
        .into_iter()
        .find(|d| d["kind"] == "ClusterRole")
        .unwrap();
    let shared = format!("ucm-e2e-{ns}-export-proxy");
    let docs = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "ucm-export-proxy", "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": shared}, "rules": role["rules"]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": shared},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": shared},
         "subjects": [{"kind": "ServiceAccount", "name": "ucm-export-proxy", "namespace": ns}]},
    ]});
    let (ok, out) = kubectl(
        admin,
        &[
            "apply",
            "--server-side",
            "--field-manager=ucm-e2e",
            "-f",
            "-",
        ],
        Some(&docs.to_string()),
    );
    assert!(ok, "installing the proxy identity failed:\n{out}");
    let (ok, token) = kubectl(
        admin,
        &[
            "create",
            "token",
            "ucm-export-proxy",
            "-n",
            ns,
            "--duration=1h",
        ],
        None,
    );
    assert!(ok, "{token}");
    let mut kc: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(admin).unwrap()).unwrap();
    kc["users"] = json!([{"name": "proxy", "user": {"token": token.trim()}}]);
    for ctx in kc["contexts"].as_array_mut().unwrap() {
        ctx["context"]["user"] = "proxy".into();
    }
    let path = dir.join("kubeconfig-export-proxy");
    std::fs::write(&path, serde_saphyr::to_string(&kc).unwrap()).unwrap();
    path
}

impl Proxy {
    fn start(kubeconfig: &std::path::Path, ns: &str, port: u16, upstream: u16) -> Proxy {
        let metrics = free_port();
        let log = kubeconfig.with_file_name(format!("proxy-{port}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_ucm"))
            .args([
                "export-proxy",
                &format!("--listen-address=127.0.0.1:{port}"),
                &format!("--metrics-bind-address=127.0.0.1:{metrics}"),
                &format!("--kubeconfig={}", kubeconfig.display()),
                &format!("--namespace={ns}"),
                &format!("--upstream-address=127.0.0.1:{upstream}"),
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        wait_listening(port, "export proxy", &log);
        Proxy {
            child,
            port,
            metrics,
            log,
        }
    }

    fn metric(&self, name: &str) -> f64 {
        let out = Command::new("curl")
            .args([
                "-sSf",
                &format!("http://127.0.0.1:{}/metrics", self.metrics),
            ])
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
            .parse()
            .unwrap()
    }

    /// The HTTP status of `url` through the proxy, with `extra` curl arguments (no token added).
    fn status(&self, url: &str, ca: &std::path::Path, extra: &[&str]) -> u16 {
        let authority = url
            .trim_start_matches("https://")
            .split('/')
            .next()
            .unwrap();
        let out = Command::new("curl")
            .args([
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--cacert",
                ca.to_str().unwrap(),
                "--connect-to",
                &format!("{authority}:127.0.0.1:{}", self.port),
            ])
            .args(extra)
            .arg(url)
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().parse().unwrap()
    }
}

fn link_urls(l: &ucm::vmexport::types::VirtualMachineExportLink) -> Vec<String> {
    let mut urls: Vec<String> = l
        .volumes
        .iter()
        .flatten()
        .flat_map(|v| v.formats.iter().flatten().map(|f| f.url.clone()))
        .collect();
    urls.extend(l.manifests.iter().flatten().map(|m| m.url.clone()));
    urls
}

/// Both client generations (README, "VM export: API versions, clients and external links"):
/// what virtctl does with only `export.kubevirt.io/v1` (v1.9 and later) and with only
/// `v1beta1` (v1.8): create a VM export with a token Secret of its own, wait for `phase=Ready`
/// and links, download every format through the internal link and through `ucm export-proxy`
/// (the external link; also under the v1beta1 and v1alpha1 paths), resume a download, apply the
/// manifests with `--dry-run=server`, delete.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e20_v1_and_v1beta1_clients_internal_and_proxy_links() {
    let env = TestEnv::new("vmx-e20").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    install_kubevirt_crds(&c).await;
    // the `all` manifest's DataVolumes are applied (dry run) as CDI's
    install_crd(
        &c,
        "cdi.kubevirt.io",
        "v1beta1",
        "DataVolume",
        "datavolumes",
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    // The export CA exists before the manager starts (it never overwrites one), so its
    // certificate can be the external CA: the proxy issues its certificate from it.
    let ca = ucm::vmexport::certs::new_ca(jiff::Timestamp::now()).unwrap();
    let ca_secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "ucm-export-ca"}, "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": ca.cert, "tls.key": ca.key},
    }))
    .unwrap();
    Api::<Secret>::namespaced(c.clone(), &ns)
        .create(&PostParams::default(), &ca_secret)
        .await
        .unwrap();
    let ca_file = dir.path().join("external-ca.crt");
    std::fs::write(&ca_file, &ca.cert).unwrap();
    let proxy_port = free_port();
    let ext_host = format!("ucm-export-proxy.{ns}.svc:{proxy_port}");
    let m = Manager::start(
        ManagerOpts::new(&env.kubeconfig, &ns)
            .only("vmexport")
            .args([
                format!("--export-external-host={ext_host}"),
                format!("--export-external-ca-file={}", ca_file.display()),
            ]),
    );
    m.wait_ready().await;
    let proxy_kc = {
        let (admin, ns, d) = (env.kubeconfig.clone(), ns.clone(), dir.path().to_path_buf());
        tokio::task::spawn_blocking(move || proxy_identity(&admin, &ns, &d))
            .await
            .unwrap()
    };
    create_pvc(&c, &ns, "rootdisk", Some("kubevirt"), false).await;
    create_pvc(&c, &ns, "data", None, false).await;
    create_vm(
        &c,
        &ns,
        "vm1",
        json!([
            {"name": "root", "persistentVolumeClaim": {"claimName": "rootdisk"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
        ]),
    )
    .await;

    for version in ["v1", "v1beta1"] {
        let api = dynapi(
            &c,
            &ns,
            "export.kubevirt.io",
            version,
            "VirtualMachineExport",
            "virtualmachineexports",
        );
        let name = format!("flow-{version}");
        let token = format!("token-of-{version}-0123456789abcdefghijklmnop");
        create_dyn(
            &api,
            json!({
                "apiVersion": format!("export.kubevirt.io/{version}"), "kind": "VirtualMachineExport",
                "metadata": {"name": name},
                "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm1"},
                         "tokenSecretRef": format!("secret-{name}")},
            }),
        )
        .await;
        // virtctl creates its token Secret after the export
        let tok_secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": format!("secret-{name}")}, "stringData": {"token": token},
        }))
        .unwrap();
        Api::<Secret>::namespaced(c.clone(), &ns)
            .create(&PostParams::default(), &tok_secret)
            .await
            .unwrap();
        let pod_name = format!("virt-export-{name}");
        eventually(WAIT, "the export Pod", || async {
            Api::<Pod>::namespaced(c.clone(), &ns)
                .get_opt(&pod_name)
                .await
                .unwrap()
                .is_some()
        })
        .await;
        mark_pod(&c, &ns, &pod_name, "Running", true).await;
        // virtctl waits for phase=Ready and links, read through its own version only
        let t0 = Instant::now();
        let obj = loop {
            let o = api.get(&name).await.unwrap();
            if o.data["status"]["phase"] == "Ready"
                && !o.data["status"]["links"]["external"].is_null()
            {
                break o;
            }
            assert!(
                t0.elapsed() < WAIT,
                "{name} not Ready with links: {:?}",
                o.data["status"]
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            obj.types.as_ref().unwrap().api_version,
            format!("export.kubevirt.io/{version}")
        );
        let links: ucm::vmexport::types::VirtualMachineExportLinks =
            serde_json::from_value(obj.data["status"]["links"].clone()).unwrap();
        let (int, ext) = (links.internal.unwrap(), links.external.unwrap());
        assert_eq!(ext.cert, ca.cert.trim());
        let int_urls = link_urls(&int);
        let ext_urls = link_urls(&ext);
        let base = format!(
            "https://{ext_host}/api/export.kubevirt.io/v1/namespaces/{ns}/virtualmachineexports/{name}"
        );
        let int_base = format!("https://virt-export-{name}.{ns}.svc");
        assert_eq!(
            ext_urls,
            int_urls
                .iter()
                .map(|u| u
                    .replace(&int_base, &base)
                    .replace("/internal/manifests/", "/external/manifests/"))
                .collect::<Vec<_>>()
        );
        let formats: Vec<&str> = ext_urls
            .iter()
            .map(|u| u.rsplit('/').next().unwrap())
            .collect();
        assert_eq!(
            formats,
            [
                "disk.img",
                "disk.img.gz",
                "dir",
                "disk.tar.gz",
                "all",
                "secret"
            ],
            "every format and both manifests"
        );

        let pod = Api::<Pod>::namespaced(c.clone(), &ns)
            .get(&pod_name)
            .await
            .unwrap();
        let b = Bridge::start(&env, &pod).await;
        b.check(&env, &token, &int_urls, &b.ca, b.port).await;

        let proxy = Proxy::start(&proxy_kc, &ns, proxy_port, b.port);
        let bodies = b.check(&env, &token, &ext_urls, &ca_file, proxy_port).await;
        // KubeVirt's proxy scheme of every served version reaches the same export
        let raw = ext_urls.iter().find(|u| u.ends_with("/disk.img")).unwrap();
        let alt: Vec<String> = ["v1beta1", "v1alpha1"]
            .iter()
            .map(|v| {
                raw.replace(
                    "/export.kubevirt.io/v1/",
                    &format!("/export.kubevirt.io/{v}/"),
                )
            })
            .collect();
        b.check(&env, &token, &alt, &ca_file, proxy_port).await;
        // the proxy checks the token as the export server does
        let hdr = format!("x-kubevirt-export-token: {token}");
        assert_eq!(proxy.status(raw, &ca_file, &[]), 401);
        assert_eq!(
            proxy.status(raw, &ca_file, &["-H", "x-kubevirt-export-token: wrong"]),
            401
        );
        assert_eq!(
            proxy.status(
                &format!("{raw}?x-kubevirt-export-token={token}"),
                &ca_file,
                &[]
            ),
            200
        );
        assert_eq!(proxy.status(raw, &ca_file, &["-H", &hdr]), 200);
        let other = raw.replace(
            &format!("/virtualmachineexports/{name}/"),
            "/virtualmachineexports/nope/",
        );
        assert_eq!(proxy.status(&other, &ca_file, &["-H", &hdr]), 404);
        // a download cut short resumes through the proxy (`curl -C -`)
        let image = bridge_image("rootdisk");
        let part = dir.path().join(format!("partial-{version}.img"));
        std::fs::write(&part, &image[..70_000]).unwrap();
        let authority = raw
            .trim_start_matches("https://")
            .split('/')
            .next()
            .unwrap();
        let out = Command::new("curl")
            .args([
                "-sSf",
                "--cacert",
                ca_file.to_str().unwrap(),
                "--connect-to",
                &format!("{authority}:127.0.0.1:{proxy_port}"),
                "-H",
                &hdr,
                "-C",
                "-",
                "-o",
                part.to_str().unwrap(),
                raw,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(std::fs::read(&part).unwrap(), image, "resumed download");
        // metrics: every body byte counted, nothing left in flight
        let received: usize = bodies.values().map(Vec::len).sum();
        assert!(
            proxy.metric("ucm_export_proxy_bytes_forwarded_total") >= received as f64,
            "{}",
            std::fs::read_to_string(&proxy.log).unwrap_or_default()
        );
        eventually(WAIT, "no active downloads", || async {
            proxy.metric("ucm_export_proxy_active_downloads") == 0.0
        })
        .await;
        let log = std::fs::read_to_string(&proxy.log).unwrap();
        assert!(!log.contains(&token), "the proxy logged the token");
        drop(proxy);
        drop(b);

        // virtctl vmexport delete, through the same version; the Pod goes with it (and frees
        // the claims for the next flow)
        api.delete(&name, &Default::default()).await.unwrap();
        eventually(WAIT, "the export and its Pod to be gone", || async {
            api.get_opt(&name).await.unwrap().is_none()
                && Api::<Pod>::namespaced(c.clone(), &ns)
                    .get_opt(&pod_name)
                    .await
                    .unwrap()
                    .is_none()
        })
        .await;
    }
}

/// External links (docs/vmexport.md, "Settings"): without --export-external-host, links.external
/// comes from the Ingress in the manager's namespace that routes to Service ucm-export-proxy, with
/// the CA of its TLS Secret, as KubeVirt finds its proxy's Ingress; it follows the Ingress
/// (created, then deleted).
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e21_external_links_from_the_proxy_ingress() {
    use k8s_openapi::api::networking::v1::Ingress;
    let env = TestEnv::new("vmx-e21").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    let m = manager(&env);
    m.wait_ready().await;
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    create_export(&c, &ns, "x", pvc_source("d"), None)
        .await
        .unwrap();
    wait_phase(&c, &ns, "x", "Pending", "PodPending").await;
    mark_pod(&c, &ns, "virt-export-x", "Running", true).await;
    let e = wait_phase(&c, &ns, "x", "Ready", "PodReady").await;
    assert!(
        e.status.unwrap().links.unwrap().external.is_none(),
        "no external host, no Ingress: no external links"
    );

    let tls = ucm::vmexport::certs::new_ca(jiff::Timestamp::now()).unwrap();
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "proxy-tls"}, "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": tls.cert, "tls.key": tls.key},
    }))
    .unwrap();
    Api::<Secret>::namespaced(c.clone(), &ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let ing: Ingress = serde_json::from_value(json!({
        "metadata": {"name": "vmexport"},
        "spec": {
            "tls": [{"hosts": ["vmexport.example.test"], "secretName": "proxy-tls"}],
            "rules": [{"host": "vmexport.example.test", "http": {"paths": [{
                "path": "/api/export.kubevirt.io", "pathType": "Prefix",
                "backend": {"service": {"name": "ucm-export-proxy", "port": {"number": 443}}}}]}}],
        },
    }))
    .unwrap();
    let ings: Api<Ingress> = Api::namespaced(c.clone(), &ns);
    ings.create(&PostParams::default(), &ing).await.unwrap();
    let exports: Api<VirtualMachineExport> = Api::namespaced(c.clone(), &ns);
    let base = format!(
        "https://vmexport.example.test/api/export.kubevirt.io/v1/namespaces/{ns}/virtualmachineexports/x"
    );
    eventually(WAIT, "external links from the Ingress", || async {
        let e = exports.get("x").await.unwrap();
        let Some(ext) = e.status.and_then(|s| s.links).and_then(|l| l.external) else {
            return false;
        };
        assert_eq!(
            ext.cert,
            tls.cert.trim(),
            "the CA of the Ingress TLS Secret"
        );
        let urls: Vec<_> = ext.volumes.unwrap()[0]
            .formats
            .clone()
            .unwrap()
            .into_iter()
            .map(|f| f.url)
            .collect();
        assert_eq!(
            urls,
            [
                format!("{base}/volumes/d/disk.img"),
                format!("{base}/volumes/d/disk.img.gz")
            ]
        );
        true
    })
    .await;
    ings.delete("vmexport", &Default::default()).await.unwrap();
    eventually(WAIT, "external links gone with the Ingress", || async {
        let e = exports.get("x").await.unwrap();
        e.status
            .and_then(|s| s.links)
            .is_some_and(|l| l.external.is_none() && l.internal.is_some())
    })
    .await;
}

/// A fresh install is healthy before anyone exports: the export proxy of config/default waits
/// for the CA, so the leader creates it as it starts leading; a restart keeps it.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e22_the_export_ca_exists_before_the_first_export_and_survives_a_restart() {
    let env = TestEnv::new("vmx-e22").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    let m = manager(&env);
    m.wait_ready().await;
    let exports: Api<VirtualMachineExport> = Api::namespaced(c.clone(), &ns);
    assert!(
        exports
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    eventually(WAIT, "the export CA Secret", || async {
        get_secret(&c, &ns, "ucm-export-ca").await.is_some()
    })
    .await;
    let ca = get_secret(&c, &ns, "ucm-export-ca").await.unwrap();
    let cert = String::from_utf8(data(&ca, "tls.crt")).unwrap();
    assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"), "{cert}");
    assert!(!data(&ca, "tls.key").is_empty());
    drop(m);
    let m = manager(&env);
    m.wait_ready().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let again = get_secret(&c, &ns, "ucm-export-ca").await.unwrap();
    assert_eq!(again.metadata.uid, ca.metadata.uid, "the CA was replaced");
    assert_eq!(data(&again, "tls.crt"), data(&ca, "tls.crt"));
}

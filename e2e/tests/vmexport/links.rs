//! Links: external links and certificate parameters, v1 and v1beta1 clients through the
//! virt-exportproxy, the proxy's ingress, and the export CA across a restart.

use super::*;

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
        Proxy::start_with(kubeconfig, ns, port, upstream, &[])
    }

    fn start_with(
        kubeconfig: &std::path::Path,
        ns: &str,
        port: u16,
        upstream: u16,
        extra: &[&str],
    ) -> Proxy {
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
            .args(extra)
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

/// Both client generations (docs/vmexport.md, "What clients see"):
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
        let pods = Api::<Pod>::namespaced(c.clone(), &ns);
        let owner = api.get(&name).await.unwrap().metadata.uid;
        let pod = pods.get(&pod_name).await.unwrap();
        assert!(
            pod.owner_references()
                .iter()
                .any(|o| o.controller == Some(true) && Some(&o.uid) == owner.as_ref()),
            "the export owns its Pod"
        );
        api.delete(&name, &Default::default()).await.unwrap();
        eventually(WAIT, "the export to be gone", || async {
            api.get_opt(&name).await.unwrap().is_none()
        })
        .await;
        // The garbage collector's part: it notices CRDs installed after it started (this test
        // installs one) at its next discovery resync, which can hold its queue for a while.
        eventually(Duration::from_secs(120), "its Pod to be gone", || async {
            pods.get_opt(&pod_name).await.unwrap().is_none()
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

/// Issue 34: `ucm export-proxy --max-transfers=2 --queue-timeout=2`: two slow downloads take
/// both slots (`ucm_export_proxy_active_downloads` 2); a third request waits
/// (`ucm_export_proxy_queued_requests` 1), then gets 429 with `Retry-After`; a request with a bad
/// token is answered 401 at once without a slot; once a download ends, the next one is served,
/// and the slow ones complete byte-exact.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e23_proxy_admission_limit_answers_429_with_retry_after() {
    let env = TestEnv::new("vmx-e23").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    let dir = tempfile::tempdir().unwrap();
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
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    create_export(&c, &ns, "q", pvc_source("d"), None)
        .await
        .unwrap();
    wait_phase(&c, &ns, "q", "Pending", "PodPending").await;
    mark_pod(&c, &ns, "virt-export-q", "Running", true).await;
    let ready = wait_phase(&c, &ns, "q", "Ready", "PodReady").await;
    let raw = link_urls(&ready.status.unwrap().links.unwrap().external.unwrap())
        .into_iter()
        .find(|u| u.ends_with("/disk.img"))
        .unwrap();
    let pod = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("virt-export-q")
        .await
        .unwrap();
    let b = Bridge::start(&env, &pod).await;
    let vol_dir = std::fs::read_dir(b.root().join("export-volumes"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let content: Vec<u8> = (0..24u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    std::fs::write(vol_dir.join("disk.img"), &content).unwrap();
    let token = String::from_utf8(data(
        &get_secret(&c, &ns, "export-token-q").await.unwrap(),
        "token",
    ))
    .unwrap();
    let proxy = Proxy::start_with(
        &proxy_kc,
        &ns,
        proxy_port,
        b.port,
        &["--max-transfers=2", "--queue-timeout=2"],
    );
    let hdr = format!("x-kubevirt-export-token: {token}");
    let authority = raw
        .trim_start_matches("https://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let curl = |extra: &[&str]| {
        let mut cmd = Command::new("curl");
        cmd.args([
            "-sS",
            "--cacert",
            ca_file.to_str().unwrap(),
            "--connect-to",
            &format!("{authority}:127.0.0.1:{proxy_port}"),
        ])
        .args(extra)
        .arg(&raw);
        cmd
    };
    // Two slow downloads (about 8 s each at 3 MiB/s) take both slots.
    let outs: Vec<_> = (0..2)
        .map(|i| dir.path().join(format!("slow-{i}.img")))
        .collect();
    let mut slow: Vec<_> = outs
        .iter()
        .map(|o| {
            curl(&[
                "-f",
                "--limit-rate",
                "3M",
                "-H",
                &hdr,
                "-o",
                o.to_str().unwrap(),
            ])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    eventually(WAIT, "two transfers in flight", || async {
        proxy.metric("ucm_export_proxy_active_downloads") == 2.0
    })
    .await;
    // A bad token is refused at once, without waiting for a slot.
    let t0 = Instant::now();
    assert_eq!(
        proxy.status(&raw, &ca_file, &["-H", "x-kubevirt-export-token: wrong"]),
        401
    );
    assert!(t0.elapsed() < Duration::from_secs(1));
    // A third waits in the queue, then gets 429 with Retry-After.
    let third = curl(&["-D", "-", "-o", "/dev/null", "-H", &hdr])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    eventually(Duration::from_secs(2), "a queued request", || async {
        proxy.metric("ucm_export_proxy_queued_requests") == 1.0
    })
    .await;
    let out = tokio::task::spawn_blocking(move || third.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let head = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(
        head.starts_with("http/1.1 429") || head.starts_with("http/2 429"),
        "{head}"
    );
    assert!(head.contains("retry-after: 10"), "{head}");
    assert!(
        t0.elapsed() >= Duration::from_millis(1500),
        "429 before the queue timeout"
    );
    assert_eq!(proxy.metric("ucm_export_proxy_queued_requests"), 0.0);
    // One download ends: its slot serves the next request.
    let mut first = slow.remove(0);
    first.kill().unwrap();
    first.wait().unwrap();
    assert_eq!(
        proxy.status(&raw, &ca_file, &["-H", &hdr, "-r", "0-1023"]),
        206
    );
    let out = tokio::task::spawn_blocking(move || slow.remove(0).wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::read(&outs[1]).unwrap() == content,
        "a slow download differs"
    );
    eventually(WAIT, "no transfer left", || async {
        proxy.metric("ucm_export_proxy_active_downloads") == 0.0
    })
    .await;
    let log = std::fs::read_to_string(&proxy.log).unwrap();
    assert!(log.contains("status=429"), "{log}");
    drop(m);
}

/// Issue 34: the Ingress that routes to `ucm export-proxy` gets the download time-outs of
/// ingress-nginx and of the OpenShift/HAProxy router, applied by ucm under its own field manager;
/// a value the user set is kept, and a later change by the user is not reverted; an Ingress to
/// another Service is not touched.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e25_proxy_ingress_gets_download_timeouts_and_keeps_user_values() {
    use k8s_openapi::api::networking::v1::Ingress;
    let env = TestEnv::new("vmx-e25").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    let m = manager(&env);
    m.wait_ready().await;
    let ings: Api<Ingress> = Api::namespaced(c.clone(), &ns);
    let ingress = |name: &str, service: &str| -> Ingress {
        serde_json::from_value(json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": {"name": name, "annotations": {
                // the user's own route time-out
                "haproxy.router.openshift.io/timeout": "5m"}},
            "spec": {"rules": [{"host": format!("{name}.example.test"), "http": {"paths": [{
                "path": "/api/export.kubevirt.io", "pathType": "Prefix",
                "backend": {"service": {"name": service, "port": {"number": 443}}}}]}}]},
        }))
        .unwrap()
    };
    // The user applies them server-side, as `kubectl apply --server-side` or Helm would.
    for (name, svc) in [
        ("vmexport", "ucm-export-proxy"),
        ("other", "something-else"),
    ] {
        ings.patch(
            name,
            &PatchParams::apply("user-kubectl"),
            &Patch::Apply(ingress(name, svc)),
        )
        .await
        .unwrap();
    }
    let ann = |i: &Ingress, k: &str| i.annotations().get(k).cloned();
    eventually(WAIT, "the time-outs on the proxy's Ingress", || async {
        let i = ings.get("vmexport").await.unwrap();
        ann(&i, "nginx.ingress.kubernetes.io/proxy-read-timeout").as_deref() == Some("86400")
            && ann(&i, "nginx.ingress.kubernetes.io/proxy-send-timeout").as_deref() == Some("86400")
    })
    .await;
    let i = ings.get("vmexport").await.unwrap();
    assert_eq!(
        ann(&i, "haproxy.router.openshift.io/timeout").as_deref(),
        Some("5m"),
        "the user's value is kept"
    );
    // Field ownership: ucm's manager owns its two annotations and not the user's.
    let mf = i.metadata.managed_fields.clone().unwrap_or_default();
    let ours = mf
        .iter()
        .find(|f| f.manager.as_deref() == Some("ucm-vmexport-timeouts"))
        .expect("ucm's field manager");
    let fields = serde_json::to_string(&ours.fields_v1).unwrap();
    assert!(fields.contains("proxy-read-timeout") && fields.contains("proxy-send-timeout"));
    assert!(!fields.contains("haproxy"), "{fields}");
    let rv = i.metadata.resource_version.clone();

    // The user re-applies with its own read time-out (forced, as server-side apply asks when
    // another manager owns a field; `kubectl annotate` would need nothing): it wins and ucm does
    // not revert it.
    let mut mine = ingress("vmexport", "ucm-export-proxy");
    mine.metadata.annotations.as_mut().unwrap().insert(
        "nginx.ingress.kubernetes.io/proxy-read-timeout".into(),
        "3600".into(),
    );
    let applied = ings
        .patch(
            "vmexport",
            &PatchParams::apply("user-kubectl").force(),
            &Patch::Apply(mine),
        )
        .await
        .unwrap();
    assert_ne!(applied.metadata.resource_version, rv);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let i = ings.get("vmexport").await.unwrap();
    assert_eq!(
        ann(&i, "nginx.ingress.kubernetes.io/proxy-read-timeout").as_deref(),
        Some("3600")
    );
    assert_eq!(
        ann(&i, "nginx.ingress.kubernetes.io/proxy-send-timeout").as_deref(),
        Some("86400")
    );
    assert_eq!(
        ann(&i, "haproxy.router.openshift.io/timeout").as_deref(),
        Some("5m")
    );
    // An Ingress to another Service is left as the user wrote it.
    let o = ings.get("other").await.unwrap();
    assert!(ann(&o, "nginx.ingress.kubernetes.io/proxy-read-timeout").is_none());
    assert!(
        !o.metadata
            .managed_fields
            .unwrap_or_default()
            .iter()
            .any(|f| f.manager.as_deref() == Some("ucm-vmexport-timeouts"))
    );
    drop(m);
}

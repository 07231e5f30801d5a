//! The `all` manifest: instancetypes expanded as KubeVirt's virt-api does (a fake virt-api
//! behind an APIService).

use super::*;

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
        let (tls, _) = ucm::vmexport::server::tls::server_config(&crt, &key, None, None).unwrap();
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
    let [snaps, contents, vss] = snapshot_apis(&c, &ns);
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

//! The vmexport reconciler against a real API server (no kubelet: the tests patch the export
//! pod's status as the kubelet would), and the bridge test: the pod the reconciler rendered is
//! run as a real `ucm export-server` and every internal link is downloaded through it.
//!
//! By subject: `pvc` (PVC sources, the bridge test), `sources` (VirtualMachine and snapshot
//! sources), `templates` (the VirtualMachineTemplate source), `oci` (the `oci` format, issue 34),
//! `lifecycle` (the export pod, TTL, validation), `links` (external links, the export
//! proxy, the CA), `manifests` (the `all` manifest); `bridge` holds the bridge, and `server`
//! tests `ucm export-server` on its own. The helpers every subject uses are here.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use k8s_openapi::api::core::v1::{LimitRange, PersistentVolumeClaim, Pod, Secret, Service};
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use ucm::vmexport::VirtualMachineExport;

mod bridge;
mod lifecycle;
mod links;
mod manifests;
mod oci;
mod pvc;
mod server;
mod sources;
mod templates;

use bridge::{Bridge, bridge, bridge_image, int_urls, wait_listening};

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

/// The VirtualMachineSnapshot, VirtualMachineSnapshotContent and VolumeSnapshot APIs of `ns`.
fn snapshot_apis(c: &Client, ns: &str) -> [Api<DynamicObject>; 3] {
    let kv = "snapshot.kubevirt.io";
    [
        dynapi(
            c,
            ns,
            kv,
            "v1beta1",
            "VirtualMachineSnapshot",
            "virtualmachinesnapshots",
        ),
        dynapi(
            c,
            ns,
            kv,
            "v1beta1",
            "VirtualMachineSnapshotContent",
            "virtualmachinesnapshotcontents",
        ),
        dynapi(
            c,
            ns,
            "snapshot.storage.k8s.io",
            "v1",
            "VolumeSnapshot",
            "volumesnapshots",
        ),
    ]
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

/// The serving certificate a new TLS handshake to 127.0.0.1:`port` for `host` gets (PEM body,
/// no armour).
fn presented_cert(port: u16, host: &str) -> String {
    let out = Command::new("openssl")
        .args([
            "s_client",
            "-connect",
            &format!("127.0.0.1:{port}"),
            "-servername",
            host,
        ])
        .stdin(Stdio::null())
        .output()
        .expect("openssl is required for this test");
    pem_body(&String::from_utf8_lossy(&out.stdout))
}

/// The first certificate of a PEM text, its base64 body without armour or whitespace.
fn pem_body(text: &str) -> String {
    text.split("-----BEGIN CERTIFICATE-----")
        .nth(1)
        .and_then(|r| r.split("-----END CERTIFICATE-----").next())
        .map(|b| b.split_whitespace().collect())
        .unwrap_or_default()
}

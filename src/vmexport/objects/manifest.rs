//! The manifest ConfigMap of VM, snapshot and template sources (docs/vmexport.md, "Export
//! server", "Optional APIs"): the cleaned VM (or VirtualMachineTemplate) with DataVolumes for its
//! claims, and the expand-spec request for a VM with an instancetype or preference.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;

use crate::runtime::meta::controller_ref;
use crate::vmexport::api::*;
use crate::vmexport::naming;
use crate::vmexport::sources::kind::SourceKind;
use crate::vmexport::types::VirtualMachineExport;

/// What the manifest ConfigMap is built from.
pub struct ManifestInput<'a> {
    pub export: &'a VirtualMachineExport,
    /// The VirtualMachine object (for snapshot sources, the copy in the snapshot content; for
    /// template sources, the VirtualMachineTemplate).
    pub vm: &'a serde_json::Value,
    /// Claim name → the source claim's spec, for DataVolumes of non-template volumes.
    pub claims: &'a BTreeMap<String, k8s_openapi::api::core::v1::PersistentVolumeClaimSpec>,
    pub internal_cert: &'a str,
    pub external_host: Option<&'a str>,
    pub external_cert: &'a str,
    /// Snapshot sources serve restore PVCs `<export>-<claim>`.
    pub volume_prefix: Option<String>,
}

/// A DataVolume's `spec.storage` for a copy of `claim`, as KubeVirt builds it: access modes,
/// volume mode and the requested size of the source, so a block claim imports as block.
pub fn dv_storage(
    claim: &k8s_openapi::api::core::v1::PersistentVolumeClaimSpec,
) -> serde_json::Value {
    let mut st = serde_json::Map::new();
    if let Some(m) = claim.access_modes.as_ref().filter(|m| !m.is_empty()) {
        st.insert("accessModes".into(), serde_json::json!(m));
    }
    if let Some(m) = &claim.volume_mode {
        st.insert("volumeMode".into(), serde_json::json!(m));
    }
    if let Some(q) = claim
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
    {
        st.insert(
            "resources".into(),
            serde_json::json!({"requests": {"storage": q.0}}),
        );
    }
    serde_json::Value::Object(st)
}

/// KubeVirt's API that expands instancetypes and preferences into a VM spec ("Optional APIs").
pub const EXPAND_API: &str = "subresources.kubevirt.io/v1";

/// Whether the VM references an instancetype or a preference, which only KubeVirt can expand
/// into the `all` manifest ("Optional APIs").
pub fn needs_expansion(vm: &serde_json::Value) -> bool {
    ["instancetype", "preference"]
        .iter()
        .any(|k| vm["spec"].get(*k).is_some_and(|v| !v.is_null()))
}

/// The expand-spec call for a source's VM ("Optional APIs"). A live VM is expanded by name with
/// `GET virtualmachines/<name>/expand-spec`. A snapshot's VM is the copy in the snapshot
/// content, which the live VM may no longer match (or no longer exist), so that copy is sent to
/// `PUT expand-vm-spec`, KubeVirt's endpoint for expanding a VM given in the body.
pub fn expand_request(
    ns: &str,
    kind: SourceKind,
    vm_name: &str,
    vm: &serde_json::Value,
) -> Result<http::Request<Vec<u8>>, String> {
    let base = format!("/apis/{EXPAND_API}/namespaces/{ns}");
    let req = match kind {
        SourceKind::VirtualMachine => {
            http::Request::get(format!("{base}/virtualmachines/{vm_name}/expand-spec"))
                .body(Vec::new())
        }
        _ => {
            let mut body = vm.clone();
            body["apiVersion"] = "kubevirt.io/v1".into();
            body["kind"] = "VirtualMachine".into();
            if body["metadata"]["name"].is_null() {
                body["metadata"]["name"] = vm_name.into();
            }
            body["metadata"]["namespace"] = ns.into();
            http::Request::put(format!("{base}/expand-vm-spec"))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(body.to_string().into_bytes())
        }
    };
    req.map_err(|e| format!("cannot build the expand-spec request: {e}"))
}

/// The ConfigMap mounted at /manifest_data, from a VM whose instancetypes and preferences are
/// already expanded. `Err` names why the `all` manifest cannot be built.
pub fn build_manifest_configmap(
    m: &ManifestInput<'_>,
) -> Result<k8s_openapi::api::core::v1::ConfigMap, String> {
    use serde_json::{Value, json};
    let export = m.export;
    let ns = export.namespace().unwrap_or_default();
    if needs_expansion(m.vm) {
        return Err(format!(
            "the VirtualMachine still references an instancetype or preference after {EXPAND_API} expand-spec; the all manifest is not offered"
        ));
    }
    let meta = &m.vm["metadata"];
    let mut clean_meta = serde_json::Map::new();
    for k in ["name", "namespace", "labels", "annotations"] {
        if let Some(v) = meta.get(k) {
            clean_meta.insert(k.into(), v.clone());
        }
    }
    let vm = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": Value::Object(clean_meta),
        "spec": m.vm["spec"].clone(),
    });
    let templates: Vec<String> = m.vm["spec"]["dataVolumeTemplates"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t["metadata"]["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let mut data = common_data(m);
    data.insert("virtualmachine-manifest".to_string(), vm.to_string());
    if let Some(p) = &m.volume_prefix {
        data.insert("volume-prefix".into(), p.clone());
    }
    for v in m.vm["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let claim = v["dataVolume"]["name"]
            .as_str()
            .or_else(|| v["persistentVolumeClaim"]["claimName"].as_str());
        let Some(claim) = claim else { continue };
        if templates.iter().any(|t| t == claim) {
            continue;
        }
        let storage = m
            .claims
            .get(claim)
            .map(dv_storage)
            .unwrap_or_else(|| json!({}));
        let dv = json!({
            "apiVersion": "cdi.kubevirt.io/v1beta1",
            "kind": "DataVolume",
            "metadata": {"name": claim, "namespace": ns},
            "spec": {"storage": storage},
        });
        data.insert(format!("dv-{claim}"), dv.to_string());
    }
    Ok(configmap(export, data))
}

/// The keys every manifest ConfigMap carries: the hosts and CAs of both link kinds, the
/// export's name.
fn common_data(m: &ManifestInput<'_>) -> BTreeMap<String, String> {
    let export = m.export;
    let name = export.name_any();
    let ns = export.namespace().unwrap_or_default();
    let service = naming::service_name(&name);
    let mut data = BTreeMap::from([
        (
            "internal_host".to_string(),
            format!("https://{service}.{ns}.svc"),
        ),
        (
            "internal_ca_cm".to_string(),
            m.internal_cert.trim().to_string(),
        ),
        ("export-name".to_string(), name.clone()),
    ]);
    if let Some(h) = m.external_host {
        data.insert(
            "external_host".into(),
            format!(
                "https://{h}/api/{OWNER_API_VERSION}/namespaces/{ns}/virtualmachineexports/{name}"
            ),
        );
        data.insert("external_ca_cm".into(), m.external_cert.trim().to_string());
    }
    data
}

fn configmap(
    export: &VirtualMachineExport,
    data: BTreeMap<String, String>,
) -> k8s_openapi::api::core::v1::ConfigMap {
    k8s_openapi::api::core::v1::ConfigMap {
        metadata: ObjectMeta {
            name: Some(naming::manifest_configmap_name(&export.name_any())),
            namespace: export.namespace(),
            owner_references: controller_ref(export).map(|o| vec![o]),
            ..Default::default()
        },
        data: Some(data),
        ..Default::default()
    }
}

/// The manifest ConfigMap of a template source (docs/vmexport.md, "Export server"): the
/// template as upstream keeps it under `virtualmachinetemplate-manifest` (`m.vm` is the
/// VirtualMachineTemplate, read with `api_version`), and a DataVolume `dv-<claim>` for each
/// exported claim, so the `all` manifest recreates the claims the template's DataVolume
/// templates and volumes name. Like the template, the DataVolumes carry no namespace.
pub fn build_template_configmap(
    m: &ManifestInput<'_>,
    api_version: &str,
) -> k8s_openapi::api::core::v1::ConfigMap {
    let ns = m.export.namespace().unwrap_or_default();
    let mut data = common_data(m);
    let tpl = crate::vmexport::sources::template::manifest_template(m.vm, api_version, &ns);
    data.insert(VM_TEMPLATE_MANIFEST_KEY.to_string(), tpl.to_string());
    for (claim, spec) in m.claims {
        let dv = serde_json::json!({
            "apiVersion": "cdi.kubevirt.io/v1beta1",
            "kind": "DataVolume",
            "metadata": {"name": claim},
            "spec": {"storage": dv_storage(spec)},
        });
        data.insert(format!("dv-{claim}"), dv.to_string());
    }
    configmap(m.export, data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmexport::fixtures::export;

    #[test]
    fn manifest_configmap_cleans_the_vm_and_adds_datavolumes() {
        let e = export("e1");
        let vm = serde_json::json!({
            "metadata": {"name": "vm1", "namespace": "ns1", "labels": {"a": "b"}, "managedFields": [{}], "resourceVersion": "7", "uid": "x"},
            "spec": {
                "dataVolumeTemplates": [{"metadata": {"name": "root"}, "spec": {"sourceRef": {"kind": "DataSource", "name": "fedora"}}}],
                "template": {"spec": {"volumes": [
                    {"name": "r", "dataVolume": {"name": "root"}},
                    {"name": "d", "persistentVolumeClaim": {"claimName": "data"}},
                    {"name": "c", "cloudInitNoCloud": {}},
                ]}},
            },
            "status": {"ready": true},
        });
        let claims = BTreeMap::from([(
            "data".to_string(),
            serde_json::from_value(serde_json::json!({
                "accessModes": ["ReadWriteMany"], "volumeMode": "Block",
                "resources": {"requests": {"storage": "5Gi"}},
            }))
            .unwrap(),
        )]);
        let cm = build_manifest_configmap(&ManifestInput {
            export: &e,
            vm: &vm,
            claims: &claims,
            internal_cert: "CA\n",
            external_host: Some("proxy:443"),
            external_cert: "EXT",
            volume_prefix: None,
        })
        .unwrap();
        assert_eq!(cm.metadata.name.as_deref(), Some("exporter-vm-manifest-e1"));
        let d = cm.data.unwrap();
        assert_eq!(d["internal_host"], "https://virt-export-e1.ns1.svc");
        assert_eq!(d["internal_ca_cm"], "CA");
        assert_eq!(
            d["external_host"],
            "https://proxy:443/api/export.kubevirt.io/v1/namespaces/ns1/virtualmachineexports/e1"
        );
        assert_eq!(d["export-name"], "e1");
        let vmj: serde_json::Value = serde_json::from_str(&d["virtualmachine-manifest"]).unwrap();
        assert!(vmj.get("status").is_none());
        assert!(
            vmj["metadata"].get("managedFields").is_none() && vmj["metadata"].get("uid").is_none()
        );
        assert_eq!(vmj["metadata"]["labels"]["a"], "b");
        assert!(
            !d.contains_key("dv-root"),
            "templates are not duplicated as DataVolumes"
        );
        let dv: serde_json::Value = serde_json::from_str(&d["dv-data"]).unwrap();
        // KubeVirt copies access modes, volume mode and size, and sets the namespace.
        assert_eq!(
            dv,
            serde_json::json!({
                "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
                "metadata": {"name": "data", "namespace": "ns1"},
                "spec": {"storage": {
                    "accessModes": ["ReadWriteMany"], "volumeMode": "Block",
                    "resources": {"requests": {"storage": "5Gi"}},
                }},
            })
        );
        // instancetypes must be expanded first
        let mut it = vm.clone();
        it["spec"]["instancetype"] = serde_json::json!({"name": "u1.small"});
        assert!(
            build_manifest_configmap(&ManifestInput {
                export: &e,
                vm: &it,
                claims: &claims,
                internal_cert: "",
                external_host: None,
                external_cert: "",
                volume_prefix: None
            })
            .is_err()
        );
    }

    #[test]
    fn template_configmap_carries_the_cleaned_template_and_datavolumes_for_its_claims() {
        let e = export("e1");
        let tpl = serde_json::json!({
            "apiVersion": "template.kubevirt.io/v1beta1", "kind": "VirtualMachineTemplate",
            "metadata": {"name": "t1", "namespace": "ns1", "uid": "u", "managedFields": [{}], "labels": {"a": "b"}},
            "spec": {
                "parameters": [{"name": "SRC", "value": "golden"}],
                "virtualMachine": {"spec": {
                    "dataVolumeTemplates": [{"metadata": {"name": "root"}, "spec": {"sourceRef": {"kind": "DataSource", "name": "f"}, "source": {"pvc": {"name": "${SRC}"}}}}],
                    "template": {"spec": {"volumes": [{"name": "r", "dataVolume": {"name": "root"}}]}},
                }},
            },
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        });
        let claims = BTreeMap::from([(
            "golden".to_string(),
            serde_json::from_value(serde_json::json!({
                "accessModes": ["ReadWriteOnce"], "volumeMode": "Block",
                "resources": {"requests": {"storage": "2Gi"}},
            }))
            .unwrap(),
        )]);
        let cm = build_template_configmap(
            &ManifestInput {
                export: &e,
                vm: &tpl,
                claims: &claims,
                internal_cert: "CA\n",
                external_host: None,
                external_cert: "",
                volume_prefix: None,
            },
            "template.kubevirt.io/v1beta1",
        );
        assert_eq!(cm.metadata.name.as_deref(), Some("exporter-vm-manifest-e1"));
        assert_eq!(cm.metadata.owner_references.unwrap()[0].name, "e1");
        let d = cm.data.unwrap();
        assert_eq!(d["internal_host"], "https://virt-export-e1.ns1.svc");
        assert_eq!(d["internal_ca_cm"], "CA");
        assert_eq!(d["export-name"], "e1");
        assert!(!d.contains_key("external_host") && !d.contains_key("virtualmachine-manifest"));
        let t: serde_json::Value =
            serde_json::from_str(&d["virtualmachinetemplate-manifest"]).unwrap();
        assert_eq!(t["kind"], "VirtualMachineTemplate");
        assert_eq!(t["apiVersion"], "template.kubevirt.io/v1beta1");
        assert_eq!(
            t["metadata"],
            serde_json::json!({"name": "t1", "labels": {"a": "b"}})
        );
        assert!(t.get("status").is_none());
        assert_eq!(
            t["spec"]["virtualMachine"]["spec"]["dataVolumeTemplates"][0]["spec"],
            serde_json::json!({"source": {"pvc": {"name": "golden"}}})
        );
        let dv: serde_json::Value = serde_json::from_str(&d["dv-golden"]).unwrap();
        assert_eq!(
            dv,
            serde_json::json!({
                "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
                "metadata": {"name": "golden"},
                "spec": {"storage": {
                    "accessModes": ["ReadWriteOnce"], "volumeMode": "Block",
                    "resources": {"requests": {"storage": "2Gi"}},
                }},
            })
        );
    }

    #[test]
    fn expand_spec_only_for_instancetypes_and_preferences() {
        let plain = serde_json::json!({"spec": {"template": {"spec": {}}}});
        assert!(!needs_expansion(&plain));
        let mut it = plain.clone();
        it["spec"]["instancetype"] = serde_json::json!({"name": "u1.small"});
        assert!(needs_expansion(&it));
        let mut pref = plain.clone();
        pref["spec"]["preference"] = serde_json::json!({"name": "fedora"});
        assert!(needs_expansion(&pref));
        let mut null = plain.clone();
        null["spec"]["instancetype"] = serde_json::Value::Null;
        assert!(!needs_expansion(&null));
    }

    #[test]
    fn expand_request_by_name_for_vms_and_by_body_for_snapshots() {
        let vm = serde_json::json!({"metadata": {"name": "vm1"}, "spec": {"instancetype": {"name": "u1.small", "revisionName": "r1"}}});
        let r = expand_request("ns1", SourceKind::VirtualMachine, "vm1", &vm).unwrap();
        assert_eq!(r.method(), http::Method::GET);
        assert_eq!(
            r.uri().path(),
            "/apis/subresources.kubevirt.io/v1/namespaces/ns1/virtualmachines/vm1/expand-spec"
        );
        assert!(r.body().is_empty());
        // a snapshot's copy carries no apiVersion/kind; the endpoint needs a whole object
        let copy = serde_json::json!({"spec": {"instancetype": {"name": "u1.small", "revisionName": "r1"}}});
        let r = expand_request("ns1", SourceKind::VirtualMachineSnapshot, "vm1", &copy).unwrap();
        assert_eq!(r.method(), http::Method::PUT);
        assert_eq!(
            r.uri().path(),
            "/apis/subresources.kubevirt.io/v1/namespaces/ns1/expand-vm-spec"
        );
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(body["apiVersion"], "kubevirt.io/v1");
        assert_eq!(body["kind"], "VirtualMachine");
        assert_eq!(body["metadata"]["name"], "vm1");
        assert_eq!(body["metadata"]["namespace"], "ns1");
        assert_eq!(body["spec"], copy["spec"], "the spec is sent as captured");
    }
}

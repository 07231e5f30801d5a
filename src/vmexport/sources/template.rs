//! What a VirtualMachineTemplate source says (docs/vmexport.md, "Sources", "VirtualMachineTemplate"):
//! whether it is Ready, which claims its embedded VirtualMachine names (with `${PARAM}`
//! placeholders resolved from the parameters' default values), and the template as the manifest
//! ConfigMap carries it. Pure.

use serde_json::{Map, Value, json};

/// The template's `status.conditions` has `Ready` with status `True`.
pub fn is_ready(tpl: &Value) -> bool {
    tpl["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

/// The template's `spec.parameters`.
pub fn parameters(tpl: &Value) -> &[Value] {
    tpl["spec"]["parameters"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// `s` with every `${NAME}` of a parameter that has a non-empty `value` replaced by it; `None`
/// when a `${` is left (a parameter without default, or an unknown one), as upstream: such a
/// name cannot be looked up, so the element is skipped.
pub fn resolve(s: &str, params: &[Value]) -> Option<String> {
    let mut out = s.to_string();
    for p in params {
        let (Some(name), Some(value)) = (p["name"].as_str(), p["value"].as_str()) else {
            continue;
        };
        if value.is_empty() {
            continue;
        }
        out = out.replace(&format!("${{{name}}}"), value);
    }
    (!out.contains("${")).then_some(out)
}

/// A DataVolume template of the embedded VM whose source is a claim in the template's
/// namespace (or no namespace): its index, its name as written, and the claim's resolved name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalTemplate {
    pub index: usize,
    pub name: String,
    pub claim: String,
}

/// Upstream's local DataVolume templates: `spec.source.pvc` with a name that resolves and a
/// namespace that is empty or the template's, and a `metadata.name`. Others (another
/// namespace, `sourceRef`, HTTP, registry, ...) have no claim here to export.
pub fn local_templates(vm: &Value, params: &[Value], ns: &str) -> Vec<LocalTemplate> {
    let mut out = Vec::new();
    for (index, t) in vm["spec"]["dataVolumeTemplates"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let Some(pvc) = t["spec"]["source"]["pvc"].as_object() else {
            continue;
        };
        let src_ns = pvc.get("namespace").and_then(Value::as_str).unwrap_or("");
        if !src_ns.is_empty() && src_ns != ns {
            continue;
        }
        let Some(claim) = pvc
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .and_then(|n| resolve(n, params))
        else {
            continue;
        };
        let Some(name) = t["metadata"]["name"].as_str().filter(|n| !n.is_empty()) else {
            continue;
        };
        out.push(LocalTemplate {
            index,
            name: name.to_string(),
            claim,
        });
    }
    out
}

/// `(name as written, resolved claim)` of each `persistentVolumeClaim` or `dataVolume` volume,
/// in volume order, once per name as written; a name that does not resolve is skipped.
pub fn volume_claims(vm: &Value, params: &[Value]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for v in vm["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let raw = v["persistentVolumeClaim"]["claimName"]
            .as_str()
            .filter(|n| !n.is_empty())
            .or_else(|| v["dataVolume"]["name"].as_str().filter(|n| !n.is_empty()));
        let Some(raw) = raw else { continue };
        let Some(claim) = resolve(raw, params) else {
            continue;
        };
        if !out.iter().any(|(r, _)| r == raw) {
            out.push((raw.to_string(), claim));
        }
    }
    out
}

/// The claims a template export serves, as upstream finds them: the claims of the local
/// DataVolume templates, then those of the volumes that do not name one of those templates.
/// A claim may appear twice; the caller de-duplicates.
pub fn template_claims(vm: &Value, params: &[Value], ns: &str) -> Vec<String> {
    let locals = local_templates(vm, params, ns);
    let mut out: Vec<String> = locals.iter().map(|t| t.claim.clone()).collect();
    for (raw, claim) in volume_claims(vm, params) {
        if !locals.iter().any(|t| t.name == raw) {
            out.push(claim);
        }
    }
    out
}

/// The embedded VM as the manifest carries it (upstream's rewrite): each local DataVolume
/// template's source becomes `pvc: {name: <resolved claim>}` (its `sourceRef` dropped), and each
/// `dataVolume` volume that names no DataVolume template becomes a `persistentVolumeClaim`
/// volume of the resolved name. Elements that do not resolve are kept as written.
pub fn rewrite_vm(vm: &Value, params: &[Value], ns: &str) -> Value {
    let mut out = vm.clone();
    let locals = local_templates(vm, params, ns);
    if let Some(tpls) = out
        .pointer_mut("/spec/dataVolumeTemplates")
        .and_then(Value::as_array_mut)
    {
        for l in &locals {
            if let Some(spec) = tpls
                .get_mut(l.index)
                .and_then(|t| t.get_mut("spec"))
                .and_then(Value::as_object_mut)
            {
                spec.insert("source".into(), json!({"pvc": {"name": l.claim}}));
                spec.remove("sourceRef");
            }
        }
    }
    let template_names: Vec<String> = vm["spec"]["dataVolumeTemplates"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["metadata"]["name"].as_str().filter(|n| !n.is_empty()))
        .map(str::to_string)
        .collect();
    if let Some(vols) = out
        .pointer_mut("/spec/template/spec/volumes")
        .and_then(Value::as_array_mut)
    {
        for v in vols.iter_mut() {
            let Some(dv) = v["dataVolume"]["name"].as_str().filter(|n| !n.is_empty()) else {
                continue;
            };
            if template_names.iter().any(|t| t == dv) {
                continue;
            }
            let Some(claim) = resolve(dv, params) else {
                continue;
            };
            *v = json!({"name": v["name"].clone(), "persistentVolumeClaim": {"claimName": claim}});
        }
    }
    out
}

/// The template as the manifest ConfigMap carries it under `virtualmachinetemplate-manifest`
/// (upstream's cleaning): no status, metadata reduced to name, labels and annotations, the
/// embedded VM rewritten ([`rewrite_vm`]). `api_version` is the version it was read with, so
/// the manifest can be applied as it is.
pub fn manifest_template(tpl: &Value, api_version: &str, ns: &str) -> Value {
    let mut meta = Map::new();
    for k in ["name", "labels", "annotations"] {
        if let Some(v) = tpl["metadata"].get(k).filter(|v| !v.is_null()) {
            meta.insert(k.into(), v.clone());
        }
    }
    let mut spec = tpl["spec"].clone();
    if let Some(vm) = spec.get("virtualMachine").filter(|v| !v.is_null()) {
        let rewritten = rewrite_vm(vm, parameters(tpl), ns);
        spec["virtualMachine"] = rewritten;
    }
    json!({
        "apiVersion": api_version,
        "kind": "VirtualMachineTemplate",
        "metadata": Value::Object(meta),
        "spec": spec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(p: &[(&str, &str)]) -> Vec<Value> {
        p.iter()
            .map(|(n, v)| json!({"name": n, "value": v}))
            .collect()
    }

    #[test]
    fn parameters_resolve_from_defaults_only() {
        let p = params(&[("VM_NAME", "my-vm"), ("EMPTY", "")]);
        assert_eq!(
            resolve("${VM_NAME}-rootdisk", &p).as_deref(),
            Some("my-vm-rootdisk")
        );
        assert_eq!(resolve("plain-name", &[]).as_deref(), Some("plain-name"));
        // no default, unknown, or one of several unresolved: skipped
        assert_eq!(resolve("${EMPTY}-disk", &p), None);
        assert_eq!(resolve("${UNKNOWN}-disk", &p), None);
        assert_eq!(resolve("${VM_NAME}-${UNKNOWN}", &p), None);
        // a parameter without a value field, or a generator only, is no default
        let generated = vec![json!({"name": "G", "generate": "expression", "from": "[a-z]{4}"})];
        assert_eq!(resolve("${G}", &generated), None);
        assert_eq!(
            resolve("${VM_NAME}/${VM_NAME}", &p).as_deref(),
            Some("my-vm/my-vm")
        );
    }

    #[test]
    fn readiness_is_the_ready_condition() {
        assert!(is_ready(
            &json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        ));
        assert!(!is_ready(
            &json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        ));
        assert!(!is_ready(&json!({"status": {}})));
        assert!(!is_ready(&json!({})));
    }

    fn vm() -> Value {
        json!({"spec": {
            "dataVolumeTemplates": [
                {"metadata": {"name": "root"}, "spec": {"source": {"pvc": {"name": "${SRC}", "namespace": "ns1"}}, "sourceRef": {"kind": "DataSource", "name": "x"}}},
                {"metadata": {"name": "other-ns"}, "spec": {"source": {"pvc": {"name": "golden", "namespace": "elsewhere"}}}},
                {"metadata": {"name": "http"}, "spec": {"source": {"http": {"url": "https://example.com/d.img"}}}},
                {"metadata": {"name": "unresolved"}, "spec": {"source": {"pvc": {"name": "${NOPE}"}}}},
                {"metadata": {}, "spec": {"source": {"pvc": {"name": "nameless"}}}},
            ],
            "template": {"spec": {"volumes": [
                {"name": "r", "dataVolume": {"name": "root"}},
                {"name": "d", "persistentVolumeClaim": {"claimName": "${DATA}"}},
                {"name": "s", "dataVolume": {"name": "standalone-${DATA}"}},
                {"name": "u", "dataVolume": {"name": "${NOPE}"}},
                {"name": "h", "dataVolume": {"name": "http"}},
                {"name": "c", "cloudInitNoCloud": {"userData": "x"}},
                {"name": "d2", "persistentVolumeClaim": {"claimName": "${DATA}", "readOnly": true}},
            ]}},
        }})
    }

    #[test]
    fn volume_discovery_follows_upstream() {
        let p = params(&[("SRC", "golden-root"), ("DATA", "data1")]);
        let locals = local_templates(&vm(), &p, "ns1");
        assert_eq!(
            locals,
            [LocalTemplate {
                index: 0,
                name: "root".into(),
                claim: "golden-root".into()
            }],
            "other namespaces, non-PVC sources, unresolved names and nameless templates are skipped"
        );
        assert_eq!(
            volume_claims(&vm(), &p),
            [
                ("root".to_string(), "root".to_string()),
                ("${DATA}".to_string(), "data1".to_string()),
                (
                    "standalone-${DATA}".to_string(),
                    "standalone-data1".to_string()
                ),
                ("http".to_string(), "http".to_string()),
            ]
        );
        // the volume naming the local template is that template's claim; a volume naming a
        // template with another source is looked up as a claim of its name, as upstream does
        assert_eq!(
            template_claims(&vm(), &p, "ns1"),
            ["golden-root", "data1", "standalone-data1", "http"]
        );
        // a template in another namespace is not local
        assert_eq!(
            template_claims(&vm(), &p, "ns2"),
            ["root", "data1", "standalone-data1", "http"]
        );
        assert!(template_claims(&json!({"spec": {}}), &[], "ns1").is_empty());
        assert!(template_claims(&Value::Null, &[], "ns1").is_empty());
    }

    #[test]
    fn the_manifest_template_is_cleaned_and_points_at_the_exported_claims() {
        let tpl = json!({
            "apiVersion": "template.kubevirt.io/v1beta1", "kind": "VirtualMachineTemplate",
            "metadata": {"name": "t1", "namespace": "ns1", "uid": "u", "resourceVersion": "9", "generation": 3,
                         "managedFields": [{}], "labels": {"app": "x"}, "annotations": {"note": "v"}, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"parameters": [{"name": "SRC", "value": "golden-root"}, {"name": "DATA", "value": "data1"}, {"name": "NAME", "required": true}],
                     "message": "hello", "virtualMachine": vm()},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        });
        let m = manifest_template(&tpl, "template.kubevirt.io/v1beta1", "ns1");
        assert_eq!(m["apiVersion"], "template.kubevirt.io/v1beta1");
        assert_eq!(m["kind"], "VirtualMachineTemplate");
        assert_eq!(
            m["metadata"],
            json!({"name": "t1", "labels": {"app": "x"}, "annotations": {"note": "v"}}),
            "no namespace, uid, versions, managed fields or timestamps"
        );
        assert!(m.get("status").is_none());
        assert_eq!(m["spec"]["parameters"], tpl["spec"]["parameters"]);
        assert_eq!(m["spec"]["message"], "hello");
        let dvts = m["spec"]["virtualMachine"]["spec"]["dataVolumeTemplates"]
            .as_array()
            .unwrap();
        assert_eq!(
            dvts[0]["spec"],
            json!({"source": {"pvc": {"name": "golden-root"}}}),
            "local template points at the exported claim, sourceRef and namespace dropped"
        );
        assert_eq!(dvts[1], vm()["spec"]["dataVolumeTemplates"][1], "kept");
        assert_eq!(dvts[2], vm()["spec"]["dataVolumeTemplates"][2], "kept");
        assert_eq!(dvts[3], vm()["spec"]["dataVolumeTemplates"][3], "kept");
        let vols = m["spec"]["virtualMachine"]["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap();
        assert_eq!(
            vols[0],
            json!({"name": "r", "dataVolume": {"name": "root"}})
        );
        assert_eq!(
            vols[1],
            vm()["spec"]["template"]["spec"]["volumes"][1],
            "claims are kept as written"
        );
        assert_eq!(
            vols[2],
            json!({"name": "s", "persistentVolumeClaim": {"claimName": "standalone-data1"}})
        );
        assert_eq!(
            vols[3],
            json!({"name": "u", "dataVolume": {"name": "${NOPE}"}})
        );
        assert_eq!(
            vols[4],
            json!({"name": "h", "dataVolume": {"name": "http"}})
        );
        assert_eq!(vols[5]["cloudInitNoCloud"]["userData"], "x");
        // the source object is not changed
        assert_eq!(tpl["metadata"]["uid"], "u");
    }
}

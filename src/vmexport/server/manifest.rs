//! The `all` manifest (docs/vmexport.md, "Export server"): built per request from the manifest
//! ConfigMap the reconciler mounts at MANIFEST_DATA_DIR, so an updated ConfigMap takes effect
//! without a restart. Keys: `internal_host`/`external_host` hold the URL base of the links (for
//! example `https://virt-export-e.ns.svc`), `internal_ca_cm`/`external_ca_cm` the CA PEM,
//! `virtualmachine-manifest` the cleaned VM (JSON or YAML), `virtualmachinetemplate-manifest` the
//! cleaned VirtualMachineTemplate of a template source (JSON), `dv-<name>` DataVolumes (JSON or
//! YAML) for volumes that are not DataVolume templates.

use std::path::Path;

use serde_json::{Value, json};

use crate::vmexport::naming;

fn read(dir: &Path, k: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(k))
        .ok()
        .filter(|s| !s.trim().is_empty())
}

fn parse(text: &str) -> anyhow::Result<Value> {
    Ok(serde_json::from_str(text).or_else(|_| serde_saphyr::from_str(text))?)
}

/// Items in order: CA ConfigMap, VM (DataVolume templates switched to an HTTP source) or
/// VirtualMachineTemplate (as the reconciler wrote it: its DataVolume templates already name the
/// exported claims), DataVolumes.
/// `gzip_uris` maps a served volume's `<pvc>` segment to its `disk.img.gz` URI: as KubeVirt, a
/// DataVolume's `http.url` is set only where such a URI exists (a directory volume has none, and
/// pointing at one would import a 404).
pub fn all_manifest(
    dir: &Path,
    export: &str,
    external: bool,
    gzip_uris: &std::collections::BTreeMap<String, String>,
) -> anyhow::Result<Vec<Value>> {
    let (host_key, ca_key) = if external {
        ("external_host", "external_ca_cm")
    } else {
        ("internal_host", "internal_ca_cm")
    };
    let host = read(dir, host_key).ok_or_else(|| anyhow::anyhow!("{host_key} missing"))?;
    let host = host.trim().trim_end_matches('/').to_string();
    let ca = read(dir, ca_key).unwrap_or_default();
    // Snapshot sources serve restore PVCs `<export>-<claim>`.
    let prefix = read(dir, "volume-prefix").unwrap_or_default();
    let ca_cm_name = naming::ca_configmap_name(export);
    let header_secret = naming::header_secret_name(export);
    let mut items = vec![json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": ca_cm_name},
        "data": {"ca.pem": ca},
    })];
    let http_source = |pvc: &str| {
        // CDI's `url` is not omitempty: KubeVirt writes "" where there is no gzip disk.
        let url = gzip_uris
            .get(&format!("{prefix}{pvc}"))
            .map(|uri| format!("{host}{uri}"))
            .unwrap_or_default();
        json!({"http": {
            "url": url,
            "certConfigMap": ca_cm_name,
            "secretExtraHeaders": [header_secret],
        }})
    };
    if let Some(vm_text) = read(dir, "virtualmachine-manifest") {
        let mut vm = parse(&vm_text)?;
        if let Some(tpls) = vm
            .pointer_mut("/spec/dataVolumeTemplates")
            .and_then(Value::as_array_mut)
        {
            for t in tpls {
                let name = t
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                if let Some(spec) = t.get_mut("spec").and_then(Value::as_object_mut) {
                    spec.insert("source".into(), http_source(&name));
                    spec.remove("sourceRef");
                }
            }
        }
        items.push(vm);
    }
    if let Some(tpl_text) = read(dir, crate::vmexport::api::VM_TEMPLATE_MANIFEST_KEY) {
        items.push(parse(&tpl_text)?);
    }
    let mut dv_keys: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("dv-"))
        .collect();
    dv_keys.sort();
    for k in dv_keys {
        if let Some(text) = read(dir, &k) {
            let mut dv = parse(&text)?;
            let name = dv
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            if let Some(spec) = dv.get_mut("spec").and_then(Value::as_object_mut) {
                spec.insert("source".into(), http_source(&name));
            }
            items.push(dv);
        }
    }
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_export_serves_its_template_and_the_datavolumes_of_its_claims() {
        let dir = tempfile::tempdir().unwrap();
        let w = |k: &str, v: &str| std::fs::write(dir.path().join(k), v).unwrap();
        w("internal_host", "https://virt-export-e1.ns1.svc");
        w("internal_ca_cm", "CA");
        w("export-name", "e1");
        let tpl = json!({"apiVersion": "template.kubevirt.io/v1beta1", "kind": "VirtualMachineTemplate",
            "metadata": {"name": "t1"},
            "spec": {"virtualMachine": {"spec": {"dataVolumeTemplates": [
                {"metadata": {"name": "root"}, "spec": {"source": {"pvc": {"name": "golden"}}}}]}}}});
        w("virtualmachinetemplate-manifest", &tpl.to_string());
        w(
            "dv-golden",
            &json!({"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
                "metadata": {"name": "golden"}, "spec": {"storage": {}}})
            .to_string(),
        );
        let gz = std::collections::BTreeMap::from([(
            "golden".to_string(),
            "/volumes/golden/disk.img.gz".to_string(),
        )]);
        let items = all_manifest(dir.path(), "e1", false, &gz).unwrap();
        let kinds: Vec<&str> = items.iter().map(|i| i["kind"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["ConfigMap", "VirtualMachineTemplate", "DataVolume"]);
        assert_eq!(items[1], tpl, "the template as the reconciler wrote it");
        assert_eq!(
            items[2]["spec"]["source"],
            json!({"http": {
                "url": "https://virt-export-e1.ns1.svc/volumes/golden/disk.img.gz",
                "certConfigMap": "export-ca-cm-e1",
                "secretExtraHeaders": ["header-secret-e1"],
            }})
        );
        // the external manifest needs the external host
        assert!(all_manifest(dir.path(), "e1", true, &gz).is_err());
    }
}

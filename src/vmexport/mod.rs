//! The `vmexport` feature: the VirtualMachineExport reconciler and `ucm export-server`
//! (shared/spec/vmexport.md).

pub mod build;
pub mod certs;
pub mod duration;
pub mod naming;
pub mod server;
pub mod types;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

pub use types::{VirtualMachineExport, VirtualMachineExportSpec, VirtualMachineExportStatus};

/// The CRDs this feature serves: VirtualMachineExport with `v1beta1` (storage) and `v1alpha1`
/// (served, identical schema, conversion `None`).
pub fn crds() -> Vec<CustomResourceDefinition> {
    let mut crd = VirtualMachineExport::crd();
    let mut alpha = crd.spec.versions[0].clone();
    alpha.name = "v1alpha1".into();
    alpha.storage = false;
    alpha.served = true;
    crd.spec.versions.push(alpha);
    vec![crd]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn schema(crd: &CustomResourceDefinition, version: &str) -> Value {
        let v = crd
            .spec
            .versions
            .iter()
            .find(|v| v.name == version)
            .unwrap();
        serde_json::to_value(
            v.schema
                .as_ref()
                .unwrap()
                .open_api_v3_schema
                .as_ref()
                .unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn crd_names_versions_and_columns() {
        let crd = &crds()[0];
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some("virtualmachineexports.export.kubevirt.io")
        );
        assert_eq!(crd.spec.scope, "Namespaced");
        let names = &crd.spec.names;
        assert_eq!(names.kind, "VirtualMachineExport");
        assert_eq!(
            names.short_names.as_deref(),
            Some(&["vmexport".to_string(), "vmexports".to_string()][..])
        );
        assert_eq!(names.categories.as_deref(), Some(&["all".to_string()][..]));
        let vs: Vec<_> = crd
            .spec
            .versions
            .iter()
            .map(|v| (v.name.as_str(), v.served, v.storage))
            .collect();
        assert_eq!(vs, [("v1beta1", true, true), ("v1alpha1", true, false)]);
        assert_eq!(schema(crd, "v1beta1"), schema(crd, "v1alpha1"));
        for v in &crd.spec.versions {
            assert!(v.subresources.as_ref().unwrap().status.is_some());
            let cols: Vec<_> = v
                .additional_printer_columns
                .as_ref()
                .unwrap()
                .iter()
                .map(|c| (c.name.as_str(), c.json_path.as_str()))
                .collect();
            assert_eq!(
                cols,
                [
                    ("SourceKind", ".spec.source.kind"),
                    ("SourceName", ".spec.source.name"),
                    ("Phase", ".status.phase")
                ]
            );
        }
        assert!(
            crd.spec
                .conversion
                .as_ref()
                .is_none_or(|c| c.strategy == "None")
        );
    }

    #[test]
    fn crd_schema_validation_and_list_types() {
        let s = schema(&crds()[0], "v1beta1");
        assert_eq!(s["required"], json!(["spec"]));
        let spec = &s["properties"]["spec"];
        assert_eq!(spec["required"], json!(["source"]));
        assert_eq!(
            spec["x-kubernetes-validations"][0]["rule"],
            "self == oldSelf"
        );
        assert_eq!(
            spec["x-kubernetes-validations"][0]["message"],
            "spec is immutable after creation"
        );
        let src = &spec["properties"]["source"];
        assert_eq!(src["required"], json!(["kind", "name"]));
        assert_eq!(src["properties"]["kind"]["minLength"], 1);
        assert_eq!(src["properties"]["name"]["minLength"], 1);
        assert_eq!(
            spec["properties"]["ttlDuration"]["x-kubernetes-validations"][0]["rule"],
            "duration(self) >= duration('0s')"
        );
        let link = &s["properties"]["status"]["properties"]["links"]["properties"]["internal"];
        assert_eq!(link["required"], json!(["cert"]));
        assert_eq!(
            link["properties"]["volumes"]["x-kubernetes-list-type"],
            "map"
        );
        assert_eq!(
            link["properties"]["volumes"]["x-kubernetes-list-map-keys"],
            json!(["name"])
        );
        assert_eq!(
            link["properties"]["manifests"]["x-kubernetes-list-map-keys"],
            json!(["type"])
        );
        let cond = &s["properties"]["status"]["properties"]["conditions"]["items"];
        assert_eq!(cond["required"], json!(["status", "type"]));
        // the seed's explain text
        assert_eq!(
            s["description"],
            "VirtualMachineExport defines the operation of exporting a VM source"
        );
    }

    #[test]
    fn status_links_null_is_serialised() {
        // A merge patch must carry links: null to remove stale links.
        let st = VirtualMachineExportStatus::default();
        assert_eq!(serde_json::to_value(&st).unwrap(), json!({"links": null}));
    }
}

//! The `vmexport` feature: the VirtualMachineExport reconciler and `ucm export-server`
//! (design: docs/vmexport.md).

pub mod api;
pub mod apply;
pub mod certs;
pub mod context;
pub mod decide;
#[cfg(test)]
mod fixtures;
pub mod ingress;
pub mod naming;
pub mod objects;
pub mod observe;
pub mod optional;
pub mod podcache;
pub mod proxy;
pub mod run;
pub mod server;
pub mod sources;
pub mod status;
pub mod types;

use clap::{Args, FromArgMatches};
use k8s_openapi::{
    api::rbac::v1::PolicyRule,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::CustomResourceExt;

use crate::runtime::rbac::rule;
use crate::runtime::{Feature, Runtime};

pub use types::{VirtualMachineExport, VirtualMachineExportSpec, VirtualMachineExportStatus};

/// The CRDs this feature serves: VirtualMachineExport with `v1` (storage, as KubeVirt ≥ 1.9)
/// and `v1beta1`, `v1alpha1` (served and deprecated with KubeVirt's warnings). The schemas are
/// identical, so conversion is `None`: objects stored as v1beta1 read back as v1 unchanged.
pub fn crds() -> Vec<CustomResourceDefinition> {
    let mut crd = VirtualMachineExport::crd();
    let v1 = crd.spec.versions[0].clone();
    for name in ["v1beta1", "v1alpha1"] {
        let mut old = v1.clone();
        old.name = name.into();
        old.storage = false;
        old.served = true;
        old.deprecated = Some(true);
        old.deprecation_warning = Some(deprecation_warning(name));
        crd.spec.versions.push(old);
    }
    vec![crd]
}

/// KubeVirt's wording for a deprecated version (`kubectl` prints it as `Warning: …`).
pub fn deprecation_warning(version: &str) -> String {
    format!(
        "export.kubevirt.io/{version} VirtualMachineExport is now deprecated and will be removed in v2."
    )
}

pub fn rbac() -> Vec<PolicyRule> {
    let read = ["get", "list", "watch"];
    vec![
        rule(
            &[api::GROUP],
            &["virtualmachineexports"],
            &["get", "list", "watch", "delete"],
        ),
        rule(
            &[api::GROUP],
            &["virtualmachineexports/status"],
            &["patch", "update"],
        ),
        // Children carry a controller ownerRef with blockOwnerDeletion.
        rule(
            &[api::GROUP],
            &["virtualmachineexports/finalizers"],
            &["update"],
        ),
        rule(
            &[""],
            &["pods", "services", "secrets", "configmaps"],
            &["get", "list", "watch", "create", "patch", "delete"],
        ),
        rule(
            &[""],
            &["persistentvolumeclaims"],
            &["get", "list", "watch", "create"],
        ),
        rule(
            &["kubevirt.io"],
            &["virtualmachines", "virtualmachineinstances"],
            &read,
        ),
        // Instancetypes and preferences for the `all` manifest (docs/vmexport.md, "Optional
        // APIs"): a live VM by name, a
        // snapshot's copy of the VM in the request body.
        rule(
            &["subresources.kubevirt.io"],
            &["virtualmachines/expand-spec"],
            &["get"],
        ),
        rule(
            &["subresources.kubevirt.io"],
            &["expand-vm-spec"],
            &["update"],
        ),
        rule(
            &["snapshot.kubevirt.io"],
            &["virtualmachinesnapshots", "virtualmachinesnapshotcontents"],
            &read,
        ),
        rule(
            &["template.kubevirt.io"],
            &["virtualmachinetemplates"],
            &read,
        ),
        rule(&["snapshot.storage.k8s.io"], &["volumesnapshots"], &read),
        rule(&["cdi.kubevirt.io"], &["datavolumes"], &read),
        rule(&["events.k8s.io"], &["events"], &["create", "patch"]),
    ]
}

/// In the manager's namespace: the Ingress that routes to `ucm export-proxy` gives the external
/// host of the links, and gets the download time-outs (patch: server-side apply of those
/// annotations only; ingress.rs). (The CA Secret there is covered by the cluster-wide secrets
/// rule.)
pub fn namespaced_rbac() -> Vec<PolicyRule> {
    vec![rule(
        &["networking.k8s.io"],
        &["ingresses"],
        &["get", "list", "watch", "patch"],
    )]
}

fn start(
    rt: Runtime,
    matches: clap::ArgMatches,
) -> futures::future::BoxFuture<'static, Result<(), String>> {
    Box::pin(async move {
        let s = context::Args::from_arg_matches(&matches).map_err(|e| e.to_string())?;
        let pod = s.pod_settings()?;
        let external_ca = match &s.external_ca_file {
            Some(p) => std::fs::read_to_string(p).map_err(|e| {
                format!(
                    "invalid value for '--export-external-ca-file': cannot read {}: {e}",
                    p.display()
                )
            })?,
            None => String::new(),
        };
        let cfg = context::Settings {
            pod,
            ca_secret: s.ca_secret.clone(),
            manager_namespace: rt.config.manager_namespace.clone(),
            external_host: s.external_host.clone(),
            external_ca,
            oci: s.oci,
        };
        run::run(rt, cfg).await;
        Ok(())
    })
}

pub static FEATURE: Feature = Feature {
    name: "vmexport",
    about: "KubeVirt VirtualMachineExport reconciler; its data path is `ucm export-server`",
    crds,
    rbac,
    namespaced_rbac,
    settings: <context::Args as Args>::augment_args,
    start,
    agents: &[server::args::AGENT, proxy::AGENT],
};

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
        assert_eq!(
            vs,
            [
                ("v1", true, true),
                ("v1beta1", true, false),
                ("v1alpha1", true, false)
            ]
        );
        assert_eq!(schema(crd, "v1"), schema(crd, "v1beta1"));
        assert_eq!(schema(crd, "v1"), schema(crd, "v1alpha1"));
        let dep: Vec<_> = crd
            .spec
            .versions
            .iter()
            .map(|v| (v.deprecated, v.deprecation_warning.clone()))
            .collect();
        assert_eq!(
            dep,
            [
                (None, None),
                (
                    Some(true),
                    Some("export.kubevirt.io/v1beta1 VirtualMachineExport is now deprecated and will be removed in v2.".into())
                ),
                (
                    Some(true),
                    Some("export.kubevirt.io/v1alpha1 VirtualMachineExport is now deprecated and will be removed in v2.".into())
                ),
            ]
        );
        // Owner references and links carry the version the reconciler reads with.
        assert_eq!(
            api::OWNER_API_VERSION,
            <VirtualMachineExport as kube::Resource>::api_version(&())
        );
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
        let s = schema(&crds()[0], "v1");
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
        // upstream's explain text
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
        // and external links when only internal ones remain
        let links = types::VirtualMachineExportLinks {
            internal: Some(Default::default()),
            external: None,
        };
        assert_eq!(
            serde_json::to_value(&links).unwrap()["external"],
            serde_json::Value::Null
        );
        assert!(
            serde_json::to_value(&links)
                .unwrap()
                .as_object()
                .unwrap()
                .contains_key("external")
        );
    }
}

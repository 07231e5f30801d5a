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

use std::time::Duration;

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

// The manager's settings for this feature (docs/vmexport.md, "Settings").
#[derive(Args, Debug, Clone)]
// clap names the group after the struct; every feature's struct is `Settings`.
#[group(id = "vmexport-settings")]
pub struct Settings {
    /// Image that contains `ucm` on PATH, run by every export pod.
    #[arg(long = "export-server-image", default_value = concat!("ucm:", env!("CARGO_PKG_VERSION")), value_name = "IMAGE")]
    pub image: String,

    /// Pull policy of the export container.
    #[arg(long = "export-image-pull-policy", default_value = "IfNotPresent", value_parser = ["Always", "IfNotPresent", "Never"], value_name = "POLICY")]
    pub pull_policy: String,

    /// host[:port] of the external proxy; without it, status.links.external stays null.
    #[arg(long = "export-external-host", value_name = "HOST")]
    pub external_host: Option<String>,

    /// PEM file whose contents go into links.external.cert.
    #[arg(long = "export-external-ca-file", value_name = "PATH")]
    pub external_ca_file: Option<std::path::PathBuf>,

    /// The CA Secret, in the manager's namespace.
    #[arg(
        long = "export-ca-secret",
        default_value = "ucm-export-ca",
        value_name = "NAME"
    )]
    pub ca_secret: String,

    /// Validity of serving certificates.
    #[arg(long = "export-cert-duration", default_value = "24h", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub cert_duration: Duration,

    /// Renewal margin of serving certificates. Default: 20% of --export-cert-duration.
    #[arg(long = "export-cert-renew-before", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub cert_renew_before: Option<Duration>,

    /// After an export's TTL, how long its deletion waits for downloads in flight to finish
    /// (the export server takes no new request after the TTL and exits when the last one ends).
    #[arg(long = "export-ttl-transfer-wait", default_value = "24h", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub ttl_transfer_wait: Duration,

    /// Serve the `oci` format (KubeVirt 1.9's `OCIExport` gate, off there too): VM, snapshot and
    /// template exports get an `oci` manifest link to `/export.oci.tar` and the `OCIReady`
    /// condition; the export server computes the layers' digests before it reports ready.
    #[arg(long = "export-oci", value_parser = crate::runtime::cli::parse_go_bool, default_missing_value = "true", num_args = 0..=1, require_equals = true, action = clap::ArgAction::Set, default_value = "false", value_name = "BOOL")]
    pub oci: bool,

    /// CPU request of the export container.
    #[arg(
        long = "export-server-cpu-request",
        default_value = "100m",
        value_name = "QUANTITY"
    )]
    pub cpu_request: String,

    /// Memory request of the export container.
    #[arg(
        long = "export-server-memory-request",
        default_value = "200Mi",
        value_name = "QUANTITY"
    )]
    pub memory_request: String,

    /// CPU limit of the export container; raise it for faster gzip.
    #[arg(
        long = "export-server-cpu-limit",
        default_value = "1",
        value_name = "QUANTITY"
    )]
    pub cpu_limit: String,

    /// Memory limit of the export container.
    #[arg(
        long = "export-server-memory-limit",
        default_value = "1024Mi",
        value_name = "QUANTITY"
    )]
    pub memory_limit: String,

    /// Minimum TLS version of the export server, as a numeric TLS version ID (771 = TLS 1.2, 772 = TLS 1.3).
    #[arg(long = "export-tls-min-version", value_name = "ID")]
    pub tls_min_version: Option<u16>,

    /// TLS 1.2 cipher suites of the export server, as a JSON array of suite IDs.
    #[arg(long = "export-tls-cipher-suites", value_name = "JSON")]
    pub tls_cipher_suites: Option<String>,
}

impl Settings {
    /// The export pod's settings, or why a present value is invalid.
    pub fn pod_settings(&self) -> Result<objects::pod::PodSettings, String> {
        if self.cert_duration.is_zero() {
            return Err(
                "invalid value for '--export-cert-duration': must be greater than 0".into(),
            );
        }
        let renew = self.cert_renew_before.unwrap_or(self.cert_duration / 5);
        if renew >= self.cert_duration {
            return Err("invalid value for '--export-cert-renew-before': must be less than --export-cert-duration".into());
        }
        if let Some(s) = &self.tls_cipher_suites
            && serde_json::from_str::<Vec<u16>>(s).is_err()
        {
            return Err(format!(
                "invalid value for '--export-tls-cipher-suites': {s:?} is not a JSON array of suite IDs"
            ));
        }
        Ok(objects::pod::PodSettings {
            image: self.image.clone(),
            pull_policy: self.pull_policy.clone(),
            cpu_request: self.cpu_request.clone(),
            memory_request: self.memory_request.clone(),
            cpu_limit: self.cpu_limit.clone(),
            memory_limit: self.memory_limit.clone(),
            tls_min_version: self.tls_min_version.map(|v| v.to_string()),
            tls_cipher_suites: self.tls_cipher_suites.clone(),
            cert_duration: self.cert_duration,
            cert_renew_before: renew,
            ttl_transfer_wait: self.ttl_transfer_wait,
        })
    }
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
        let s = Settings::from_arg_matches(&matches).map_err(|e| e.to_string())?;
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
        let cfg = context::Config {
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
    settings: <Settings as Args>::augment_args,
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

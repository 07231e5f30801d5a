//! The `exporter` feature: Jumpstarter Exporter, Lease and Client reconcilers
//! (`jumpstarter.dev/v1alpha1`). See `../shared/spec/exporter.md`.

pub mod client_status;
pub mod exporter_status;
pub mod godur;
pub mod lease_logic;
pub mod schema;
pub mod selector;
pub mod token;
pub mod types;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// The four CRDs this feature serves, in the form `ucm crds` writes to `crds/`.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        schema::fixup_crd(types::Client::crd()),
        schema::fixup_crd(types::ExporterAccessPolicy::crd()),
        schema::fixup_crd(types::Exporter::crd()),
        schema::fixup_crd(types::Lease::crd()),
    ]
}

#[cfg(test)]
mod crd_compat_tests;

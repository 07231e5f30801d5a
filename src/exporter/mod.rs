//! The `exporter` feature: Jumpstarter Exporter, Lease and Client reconcilers
//! (`jumpstarter.dev/v1alpha1`). Design: docs/exporter.md ("Code map" lists every file). This
//! file is the Feature: its CRDs, RBAC and flags.
//!
//! By concern:
//! - `crd`: the four CRDs, their schema rules and the upstream compatibility tests;
//! - `auth`: who presents a token (internal tokens and their signing key, JWT issuers,
//!   ServiceAccount tokens);
//! - the servers: `grpc` (the controller's services), `router` (the data path and its tokens;
//!   also the `ucm router` agent), `login` (what `jmp login` reads), sharing `tls`; `proto`:
//!   the Jumpstarter protocol;
//! - the reconcilers: `context` (the shared state, the settings and flags), `observe` (cache
//!   reads), `decide` (the pure decisions of the Exporter, Client and Lease passes), `lease`
//!   (label selectors and the lease-hooks record), `apply` (the three passes, what triggers
//!   them, and the credential Secret), `own_writes` (what our writes changed that the caches may
//!   not show yet), `run` (the wiring), `config` (the upstream ConfigMap, with the JWT issuers),
//!   `startup` (the ConfigMap and signing key read at start), `metrics`.

pub mod apply;
pub mod auth;
pub mod config;
pub mod context;
pub mod crd;
pub mod decide;
pub mod grpc;
pub mod lease;
pub mod login;
pub mod metrics;
pub mod observe;
pub mod own_writes;
pub mod proto;
pub mod router;
pub mod run;
pub mod startup;
pub mod tls;

use clap::Args as _;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

use crate::runtime::Feature;
use crate::runtime::rbac::rule;

/// The four CRDs this feature serves, in the form `ucm crds` writes to `crds/`.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        crate::exporter::crd::schema::fixup_crd(crate::exporter::crd::Client::crd()),
        crate::exporter::crd::schema::fixup_crd(crate::exporter::crd::ExporterAccessPolicy::crd()),
        crate::exporter::crd::schema::fixup_crd(crate::exporter::crd::Exporter::crd()),
        crate::exporter::crd::schema::fixup_crd(crate::exporter::crd::Lease::crd()),
    ]
}

/// RBAC, cluster-wide form (docs/exporter.md, "Settings and RBAC"). `exporters/finalizers` and
/// `clients/finalizers` let the controller ownerRefs on credential Secrets and Leases set
/// `blockOwnerDeletion`.
pub fn rbac() -> Vec<PolicyRule> {
    const ALL: &[&str] = &[
        "get", "list", "watch", "create", "update", "patch", "delete",
    ];
    vec![
        rule(
            &["jumpstarter.dev"],
            &["exporters", "leases", "clients"],
            ALL,
        ),
        rule(
            &["jumpstarter.dev"],
            &["exporters/status", "leases/status", "clients/status"],
            &["get", "update", "patch"],
        ),
        rule(
            &["jumpstarter.dev"],
            &["exporters/finalizers", "clients/finalizers"],
            &["update"],
        ),
        rule(
            &["jumpstarter.dev"],
            &["exporteraccesspolicies"],
            &["get", "list", "watch"],
        ),
        rule(&[""], &["secrets"], ALL),
        rule(&["events.k8s.io"], &["events"], &["create", "patch"]),
        // `authentication.k8s.enabled`: ServiceAccount tokens are checked with a TokenReview.
        rule(&["authentication.k8s.io"], &["tokenreviews"], &["create"]),
    ]
}

/// In the manager's namespace: the optional `jumpstarter-controller` ConfigMap (read by the
/// gRPC service), and the pending dials every replica leaves and claims (ConfigMaps,
/// docs/exporter.md, "Dial and Listen across replicas"), and the router Service's EndpointSlices
/// (the ready routers a Dial names, "Routers that drain"). Its Secrets are covered by the
/// cluster-wide Secret rule.
pub fn namespaced_rbac() -> Vec<PolicyRule> {
    vec![
        rule(
            &[""],
            &["configmaps"],
            &["get", "list", "watch", "create", "delete"],
        ),
        rule(
            &["discovery.k8s.io"],
            &["endpointslices"],
            &["get", "list", "watch"],
        ),
    ]
}

pub static FEATURE: Feature = Feature {
    name: "exporter",
    about: "Jumpstarter Exporter, Lease and Client reconcilers (jumpstarter.dev/v1alpha1)",
    crds,
    rbac,
    namespaced_rbac,
    settings: context::Args::augment_args,
    start: |rt, matches| Box::pin(run::start(rt, matches)),
    agents: &[crate::exporter::router::AGENT],
};

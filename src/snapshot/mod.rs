//! The `snapshot` feature: the MiroirSnapshot round coordinator (manager side) and
//! `ucm snapshot-agent` (the per-node data path).
//!
//! This file is the `Feature` (CRDs, RBAC, start); the manager's files are `context`, `observe`,
//! `decide`, `apply`, `status` and `run`, beside the shared `round` and `types`
//! (docs/snapshot.md, "Code map").
//!
//! Design: docs/snapshot.md. Upstream (Miroir) is AGPL: this is a clean-room design from
//! upstream's documented behaviour only.

pub mod agent;
pub mod apply;
pub mod context;
pub mod decide;
pub mod grant;
pub mod observe;
pub mod round;
pub mod run;
pub mod status;
pub mod types;

use clap::{Args, FromArgMatches};
use k8s_openapi::{
    api::rbac::v1::PolicyRule,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::CustomResourceExt;

use crate::runtime::{Feature, Runtime, rbac::rule};
use context::Settings;

/// Every CRD this feature ships: MiroirSnapshot and the MiroirVolume subset.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![types::MiroirSnapshot::crd(), types::MiroirVolume::crd()]
}

/// The manager's rules (docs/snapshot.md, "Settings and RBAC").
pub fn rbac() -> Vec<PolicyRule> {
    vec![
        rule(
            &[types::GROUP],
            &["miroirsnapshots"],
            &["get", "list", "watch", "patch"],
        ),
        rule(&[types::GROUP], &["miroirsnapshots/status"], &["patch"]),
        rule(
            &[types::GROUP],
            &["miroirvolumes"],
            &["get", "list", "watch"],
        ),
        rule(&["events.k8s.io"], &["events"], &["create", "patch"]),
    ]
}

/// In the agent namespace (by default the manager's): the agents' heartbeat Leases (read) and
/// the volumes' round grants (docs/snapshot.md, "One round per volume").
pub fn namespaced_rbac() -> Vec<PolicyRule> {
    vec![rule(
        &["coordination.k8s.io"],
        &["leases"],
        &["get", "list", "watch", "create", "patch"],
    )]
}

fn start(
    rt: Runtime,
    matches: clap::ArgMatches,
) -> futures::future::BoxFuture<'static, Result<(), String>> {
    Box::pin(async move {
        let s = Settings::from_arg_matches(&matches).map_err(|e| e.to_string())?;
        if s.deadline.is_zero() {
            return Err("invalid value for '--snapshot-deadline': must be greater than 0".into());
        }
        let agent_namespace = s
            .agent_namespace
            .clone()
            .unwrap_or_else(|| rt.config.manager_namespace.clone());
        run::run(rt, s, agent_namespace).await;
        Ok(())
    })
}

pub static FEATURE: Feature = Feature {
    name: "snapshot",
    about: "MiroirSnapshot round coordinator for crash-consistent replicated-volume snapshots",
    crds,
    rbac,
    namespaced_rbac,
    settings: <Settings as Args>::augment_args,
    start,
    agents: &[agent::AGENT],
};

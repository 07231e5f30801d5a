//! The `snapshot` feature: the MiroirSnapshot round coordinator (manager side) and
//! `ucm snapshot-agent` (the per-node data path).
//!
//! Design: docs/snapshot.md. Upstream (Miroir) is AGPL: this is a clean-room design from
//! upstream's documented behaviour only.

pub mod agent;
pub mod build;
pub mod reconcile;
pub mod round;
pub mod types;

use std::time::Duration;

use clap::{Args, FromArgMatches};
use k8s_openapi::{
    api::rbac::v1::PolicyRule,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::CustomResourceExt;

use crate::runtime::{Feature, Runtime, rbac::rule};

/// Every CRD this feature ships: MiroirSnapshot and the MiroirVolume subset.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![types::MiroirSnapshot::crd(), types::MiroirVolume::crd()]
}

// The manager's settings for this feature (docs/snapshot.md, "Settings and RBAC").
#[derive(Args, Debug, Clone)]
pub struct Settings {
    /// D: a snapshot round is voided this long after it opened; keep equal to the agents' value.
    #[arg(long = "snapshot-deadline", default_value = "60s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub deadline: Duration,

    /// B: after a void, the next round of that snapshot waits this long.
    #[arg(long = "snapshot-void-backoff", default_value = "30s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub void_backoff: Duration,

    /// Namespace of the snapshot agents' heartbeat Leases. Default: the manager's namespace.
    #[arg(long = "snapshot-agent-namespace", value_name = "NAMESPACE")]
    pub agent_namespace: Option<String>,

    /// Heartbeat age after which a node's snapshot agent counts as down (no round opens).
    #[arg(long = "snapshot-agent-stale-after", default_value = "60s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub agent_stale_after: Duration,
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

/// In the agent namespace (by default the manager's): the agents' heartbeat Leases.
pub fn namespaced_rbac() -> Vec<PolicyRule> {
    vec![rule(
        &["coordination.k8s.io"],
        &["leases"],
        &["get", "list", "watch"],
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
        let settings = build::Settings {
            deadline: s.deadline,
            void_backoff: s.void_backoff,
            agent_stale_after: s.agent_stale_after,
        };
        reconcile::run(rt, settings, agent_namespace).await;
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

//! What one reconcile of a MiroirSnapshot works with: the manager's [`Settings`] (its flags and
//! the timing [`decide`](super::decide::decide) reads), the shared [`Context`] (writer, API,
//! caches, [`RoundMetrics`], per-volume locks) and the reconcile [`Error`] (docs/snapshot.md,
//! "Settings and RBAC" and "Metrics and alert").
//!
//! The agent's settings stay apart, in `agent/context.rs`: the agent is another process
//! (`ucm snapshot-agent`, a DaemonSet) with flags of its own; only the deadline D is set on
//! both sides, and each side must be given the same value.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, runtime::reflector::Store};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts};

use super::types::{MiroirSnapshot, MiroirVolume};
use crate::runtime::{Guarded, ReconcileError, WriteError, Writer};

// The manager's settings for this feature (docs/snapshot.md, "Settings and RBAC"): its flags, and
// the timing `decide` reads. `agent_namespace` is resolved by `start` (unset: the manager's
// namespace) and handed to `run` on its own.
#[derive(Args, Debug, Clone, PartialEq, Eq)]
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

    /// K: during an open round, a diskful leg not yet `Done` whose agent has not renewed its
    /// heartbeat for this long (counted from the later of its last renewal and the open) voids
    /// the round before the deadline, so the other legs resume at once; "0s" turns it off.
    /// Agents renew every `--round-heartbeat-interval` (2s) while a round names them.
    #[arg(long = "snapshot-round-stale-after", default_value = "10s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub round_stale_after: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            deadline: Duration::from_secs(60),
            void_backoff: Duration::from_secs(30),
            agent_namespace: None,
            agent_stale_after: Duration::from_secs(60),
            round_stale_after: Duration::from_secs(10),
        }
    }
}

/// Each variant names the step; the cause stays its `source`, so the runtime's `error_chain`
/// prints every cause once.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("write")]
    Write(#[from] WriteError),
    #[error("read")]
    Read(#[source] kube::Error),
    #[error("a fenced write was rejected: the round changed since it was read")]
    Fenced,
    #[error("encode patch")]
    Encode(#[from] serde_json::Error),
}

impl ReconcileError for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::Write(e) => e.metric_label(),
            Error::Read(_) => "read",
            Error::Fenced => "fenced",
            Error::Encode(_) => "encode",
        }
    }

    fn own_metric_labels() -> &'static [&'static str] {
        &["read", "fenced", "encode"]
    }

    fn is_conflict(&self) -> bool {
        match self {
            Error::Fenced => true,
            Error::Write(e) => e.is_conflict(),
            _ => false,
        }
    }
}

/// The manager's round metrics.
#[derive(Clone)]
pub struct RoundMetrics {
    pub rounds_total: IntCounterVec,
    /// From `suspendedAt` to the publish or void that closed the round (second precision: the
    /// stamp has whole seconds). The per-leg held time is the agents' histogram.
    pub round_open_seconds: HistogramVec,
}

impl RoundMetrics {
    pub fn register(registry: &prometheus::Registry) -> Self {
        let rounds_total = IntCounterVec::new(
            Opts::new(
                "ucm_snapshot_rounds_total",
                "Snapshot rounds closed, by result",
            ),
            &["result"],
        )
        .expect("valid metric");
        let round_open_seconds = HistogramVec::new(
            HistogramOpts::new(
                "ucm_snapshot_round_open_seconds",
                "Time a snapshot round stayed open (suspendedAt to publish or void)",
            )
            .buckets(vec![
                1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
            ]),
            &["result"],
        )
        .expect("valid metric");
        // Registration fails only if another instance registered first (tests); reuse is fine.
        let _ = registry.register(Box::new(rounds_total.clone()));
        let _ = registry.register(Box::new(round_open_seconds.clone()));
        for r in ["success", "expired", "silent", "failed"] {
            rounds_total.with_label_values(&[r]);
        }
        RoundMetrics {
            rounds_total,
            round_open_seconds,
        }
    }
}

pub struct Context {
    pub writer: Writer,
    pub snapshots: Api<MiroirSnapshot>,
    pub snapshot_store: Store<Guarded<MiroirSnapshot>>,
    pub volumes: Store<Guarded<MiroirVolume>>,
    /// Every Lease of the agent namespace: the volumes' round grants (and the heartbeats).
    pub leases: Store<Lease>,
    /// The agents' heartbeat Leases only ([`super::round::AGENT_LEASE_LABEL`]): a pass reads
    /// them all, so their number must not grow with the volumes.
    pub heartbeat_leases: Store<Lease>,
    /// The round grants' Leases (docs/snapshot.md, "One round per volume").
    pub round_leases: Api<Lease>,
    pub agent_namespace: String,
    pub settings: Settings,
    /// Opens once the volume, grant and heartbeat caches have listed: before that, an empty
    /// heartbeat cache would read as every agent silent (row 8a) and void live rounds.
    pub synced: crate::runtime::Synced,
    pub metrics: RoundMetrics,
    /// Per-volume lock around the grant-and-open step, so this process's own passes never race
    /// for a grant (I8, docs/snapshot.md, "One round per volume"); across processes the grant's
    /// fenced write decides.
    pub(super) volume_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Context {
    pub(super) fn volume_lock(&self, volume: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.volume_locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(volume.to_string())
            .or_default()
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_chain_prints_each_cause_once() {
        let cause = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let text = cause.to_string();
        let chain = crate::runtime::controller::error_chain(&Error::Encode(cause));
        assert_eq!(chain, format!("encode patch: {text}"));
    }
}

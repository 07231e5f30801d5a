//! What the manager reports besides the round fields (docs/snapshot.md, "Conditions and events"
//! and "Metrics and alert"): the `Ready` condition a decision asks for, merged into the status
//! conditions, and the round metrics. The round writes themselves are `round.rs`.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts};

use super::decide::Decision;
use super::types::{MiroirSnapshot, READY};
use crate::conditions::{self, Desired};

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
        for r in ["success", "expired", "failed"] {
            rounds_total.with_label_values(&[r]);
        }
        RoundMetrics {
            rounds_total,
            round_open_seconds,
        }
    }
}

pub(super) fn desired_conditions(
    snap: &MiroirSnapshot,
    d: &Decision,
    now: Timestamp,
) -> (Vec<Condition>, bool) {
    let mut conds = snap
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let changed = match &d.ready {
        Some(r) => conditions::set(
            &mut conds,
            Desired::new(READY, r.status, r.reason, r.message.clone()),
            snap.metadata.generation,
            &conditions::truncate(now),
        ),
        None => false,
    };
    (conds, changed)
}

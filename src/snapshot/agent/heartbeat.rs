//! The agent's heartbeat Lease (`ucm-snapshot-agent-<node>`): the manager reads its renewals
//! to tell a live node from a lost one. While a live round names this node (a slot of its own,
//! or a barrier in its journal) it renews every `--round-heartbeat-interval`, so the manager can
//! void a round whose leg fell silent long before the deadline (docs/snapshot.md, "Deadline,
//! void and recovery").

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::context::Context;
use crate::runtime::time::after;
use crate::snapshot::round::{AGENT_LEASE_LABEL, AGENT_LEASE_PREFIX, RoundView, parse_stamp};
use crate::snapshot::types::MiroirSnapshot;

/// Whether `s` holds a live round (open, not published, before its deadline D) that names
/// `node` in its slots: the rounds during which the manager watches this agent's heartbeat.
pub(super) fn names_in_live_round(
    s: &MiroirSnapshot,
    node: &str,
    now: Timestamp,
    deadline: Duration,
) -> bool {
    let r = RoundView::of(s);
    r.io_suspended
        && !r.ready
        && r.slots.contains_key(node)
        && r.suspended_at
            .and_then(parse_stamp)
            .is_some_and(|t| now < after(t, deadline))
}

impl Context {
    /// This node is in a live round: named by one, or holding a barrier.
    fn in_round(&self) -> bool {
        let held = !self
            .journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty();
        let now = Timestamp::now();
        held || self.snap_store.state().iter().any(|g| {
            g.0.as_ref()
                .is_ok_and(|s| names_in_live_round(s, &self.node, now, self.settings.deadline))
        })
    }
}

pub(super) async fn heartbeat(
    client: Client,
    namespace: String,
    ctx: Arc<Context>,
    interval: Duration,
    round_interval: Duration,
    stop: CancellationToken,
) {
    let node = ctx.node.clone();
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    let name = format!("{AGENT_LEASE_PREFIX}{node}");
    loop {
        let now = MicroTime(Timestamp::now());
        let spec = LeaseSpec {
            holder_identity: Some(node.clone()),
            renew_time: Some(now.clone()),
            lease_duration_seconds: Some(
                i32::try_from(interval.as_secs().saturating_mul(3)).unwrap_or(i32::MAX),
            ),
            ..Default::default()
        };
        // One request per beat: patch, and create only when the Lease is not there yet.
        let patched = api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({
                    "metadata": {"labels": {AGENT_LEASE_LABEL.0: AGENT_LEASE_LABEL.1}},
                    "spec": spec,
                })),
            )
            .await;
        let res = match patched {
            Ok(_) => Ok(()),
            Err(e) if crate::runtime::writer::is_not_found(&e) => {
                let lease = Lease {
                    metadata: kube::api::ObjectMeta {
                        name: Some(name.clone()),
                        labels: Some(
                            [(
                                AGENT_LEASE_LABEL.0.to_string(),
                                AGENT_LEASE_LABEL.1.to_string(),
                            )]
                            .into(),
                        ),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        acquire_time: Some(now),
                        ..spec
                    }),
                };
                api.create(&PostParams::default(), &lease).await.map(|_| ())
            }
            Err(e) => Err(e),
        };
        if let Err(e) = res {
            warn!(error = %e, "heartbeat Lease renewal failed");
        }
        // A round naming this node wakes a slow wait at once (the snapshot watch calls
        // `beat_now`); during one, beats come every `round_interval`.
        let wait = if ctx.in_round() {
            round_interval.min(interval)
        } else {
            interval
        };
        let woken = ctx.beat_now.notified();
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
            _ = woken => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::types::{MiroirSnapshotSpec, MiroirSnapshotStatus, SlotState};

    fn snap(open: bool, ready: bool, at: &str, slots: &[&str]) -> MiroirSnapshot {
        let mut s = MiroirSnapshot::new(
            "s",
            MiroirSnapshotSpec {
                volume_name: "v".into(),
            },
        );
        s.status = Some(MiroirSnapshotStatus {
            io_suspended: Some(open),
            ready_to_use: Some(ready),
            suspended_at: Some(at.into()),
            per_node: Some(
                slots
                    .iter()
                    .map(|n| (n.to_string(), SlotState::Pending))
                    .collect(),
            ),
            ..Default::default()
        });
        s
    }

    #[test]
    fn fast_beats_only_while_a_live_round_names_the_node() {
        let t0: Timestamp = "2025-03-01T10:00:00Z".parse().unwrap();
        let d = Duration::from_secs(60);
        let at = |s: i64| Timestamp::from_second(t0.as_second() + s).unwrap();
        let live = snap(true, false, "2025-03-01T10:00:00Z", &["a", "b"]);
        assert!(names_in_live_round(&live, "a", at(5), d));
        assert!(!names_in_live_round(&live, "c", at(5), d), "not a leg");
        assert!(!names_in_live_round(&live, "a", at(60), d), "past D");
        let closed = snap(false, false, "2025-03-01T10:00:00Z", &["a"]);
        assert!(!names_in_live_round(&closed, "a", at(5), d), "voided");
        let published = snap(true, true, "2025-03-01T10:00:00Z", &["a"]);
        assert!(!names_in_live_round(&published, "a", at(5), d));
        let junk = snap(true, false, "garbage", &["a"]);
        assert!(!names_in_live_round(&junk, "a", at(5), d));
    }
}

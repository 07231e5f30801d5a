//! What the manager reads for one snapshot (docs/snapshot.md, "Manager states" and "Open gates"):
//! its volume and the agents' heartbeats from the caches, and which watch events concern which
//! snapshot (a heartbeat of an agent it waits on, a round closing on its volume). Another
//! snapshot's round on the volume is the grant's business (`grant.rs`).

use std::collections::BTreeMap;

use jiff::Timestamp;
use kube::{ResourceExt, runtime::reflector::ObjectRef};

use super::context::Context;
use super::decide;
use super::round::{AGENT_LEASE_PREFIX, RoundView};
use super::types::{MiroirSnapshot, MiroirVolume, READY};
use crate::conditions;

impl Context {
    pub(super) fn volume(&self, name: &str) -> Option<MiroirVolume> {
        self.volumes
            .get(&ObjectRef::new(name))
            .and_then(|g| g.0.as_ref().ok().cloned())
    }

    pub(super) fn heartbeats(&self) -> BTreeMap<String, Timestamp> {
        self.heartbeat_leases
            .state()
            .iter()
            .filter_map(|l| {
                let node = l.name_any().strip_prefix(AGENT_LEASE_PREFIX)?.to_string();
                let spec = l.spec.as_ref()?;
                let t = spec
                    .renew_time
                    .as_ref()
                    .or(spec.acquire_time.as_ref())
                    .map(|t| t.0)?;
                Some((node, t))
            })
            .collect()
    }
}

/// Whether a heartbeat of `node`'s agent can change this snapshot's decision: a deletion that
/// waits on that node's finalizer, or an open gated on replicas or on a leg silent since the
/// last void (rows 1 and 11 of docs/snapshot.md, "Manager states"). Every replica
/// node has a finalizer, so the finalizer list names the nodes that matter.
pub fn waits_on_agent(s: &MiroirSnapshot, node: &str) -> bool {
    let mine = super::types::teardown_finalizer(node);
    if !s.finalizers().contains(&mine) {
        return false;
    }
    if s.metadata.deletion_timestamp.is_some() {
        return true;
    }
    let r = RoundView::of(s);
    !r.ready
        && !r.io_suspended
        && s.status.as_ref().is_some_and(|st| {
            conditions::find(&st.conditions, READY).is_some_and(|c| {
                c.reason == decide::reason::WAITING_FOR_REPLICAS
                    || c.reason == decide::reason::AGENT_SILENT
            })
        })
}

/// The snapshot waits for another snapshot's round on its volume (manager row 12).
pub fn waits_on_round(s: &MiroirSnapshot) -> bool {
    s.status.as_ref().is_some_and(|st| {
        conditions::find(&st.conditions, READY)
            .is_some_and(|c| c.reason == decide::reason::WAITING_FOR_ROUND)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::types::{MiroirSnapshotSpec, MiroirSnapshotStatus};

    fn snap(name: &str, vol: &str, open: bool) -> MiroirSnapshot {
        let mut s = MiroirSnapshot::new(
            name,
            MiroirSnapshotSpec {
                volume_name: vol.into(),
            },
        );
        s.status = Some(MiroirSnapshotStatus {
            io_suspended: Some(open),
            ready_to_use: Some(false),
            ..Default::default()
        });
        s
    }

    #[test]
    fn heartbeats_wake_only_snapshots_gated_on_that_agent() {
        use crate::snapshot::types::teardown_finalizer;
        let mut s = snap("a", "v", false);
        s.metadata.finalizers = Some(vec![teardown_finalizer("n1")]);
        assert!(!waits_on_agent(&s, "n1"), "no WaitingForReplicas condition");
        s.status.as_mut().unwrap().conditions =
            vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: READY.into(),
                status: "False".into(),
                reason: decide::reason::WAITING_FOR_REPLICAS.into(),
                message: "n1: no snapshot agent heartbeat".into(),
                observed_generation: None,
                last_transition_time: conditions::now(),
            }];
        assert!(waits_on_agent(&s, "n1"));
        assert!(!waits_on_agent(&s, "n2"));
        // Gate 4b: after a void for a silent leg, its next beat may open the round.
        s.status.as_mut().unwrap().conditions[0].reason = decide::reason::AGENT_SILENT.into();
        assert!(waits_on_agent(&s, "n1"));
        s.status.as_mut().unwrap().io_suspended = Some(true);
        assert!(
            !waits_on_agent(&s, "n1"),
            "an open round does not wait on heartbeats"
        );
        s.metadata.deletion_timestamp = Some(conditions::now());
        assert!(waits_on_agent(&s, "n1"));
    }
}

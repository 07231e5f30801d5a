//! What the manager reports besides the round fields (docs/snapshot.md, "Conditions and
//! events"): the `Ready` condition a decision asks for, merged into the status conditions. The
//! round writes themselves are `round.rs`; the round metrics are counted by `apply.rs`.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use super::decide::Decision;
use super::types::{MiroirSnapshot, READY};
use crate::conditions::{self, Desired};

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
            &conditions::time(now),
        ),
        None => false,
    };
    (conds, changed)
}

//! Preemption (docs/exporter.md, "Lease scheduling"): which lease held under spot access a
//! waiting lease ends, and the status of the lease it ends.

use std::collections::HashMap;

use jiff::{SignedDuration, Timestamp};

use super::access::Approved;
use super::{ENDED, PREEMPTED, Preempt, READY};
use crate::conditions::{self, Desired};
use crate::exporter::crd::{
    Exporter, ExporterStatusValue, HookPhase, Lease, LeaseQueue, LeaseStatus,
};

/// The preemption a lease at the head of the queue decides when every exporter it may use is
/// leased: the [`victim`] among the exporters it may use under non-spot access, at the time its
/// last status named for the same victim, else `grace` from now. None when there is none.
pub(super) fn choose(
    ordered: &[Approved<'_>],
    holders: &HashMap<&str, &Lease>,
    previous: Option<&LeaseQueue>,
    grace: SignedDuration,
    now: Timestamp,
) -> Option<Preempt> {
    let non_spot: Vec<Held<'_>> = ordered
        .iter()
        .filter(|a| !a.spot_access)
        .filter_map(|a| {
            Some(Held {
                exporter: a.exporter,
                lease: holders.get(a.name())?,
            })
        })
        .collect();
    let my_priority = ordered
        .iter()
        .filter(|a| !a.spot_access)
        .map(|a| a.priority)
        .max()?;
    let victim = victim(my_priority, &non_spot)?;
    let lease = victim.lease.metadata.name.clone().unwrap_or_default();
    let exporter = victim.exporter.metadata.name.clone().unwrap_or_default();
    let at = previous
        .filter(|q| q.preempting.as_deref() == Some(lease.as_str()))
        .and_then(|q| q.preempt_at.as_ref())
        .map(|t| t.0)
        .unwrap_or_else(|| conditions::time(now + grace).0);
    Some(Preempt {
        lease,
        exporter,
        at,
        due: at <= now,
    })
}

/// The status of a spot lease that `by` preempted: ended, with `Ended` (reason `Preempted`)
/// naming the preempting lease, and `Ready` false.
pub fn preempted_status(victim: &Lease, by: &str, now: Timestamp) -> LeaseStatus {
    let stamp = conditions::time(now);
    let generation = victim.metadata.generation;
    let mut status = victim.status.clone().unwrap_or_default();
    let mut conds = status.conditions.take().unwrap_or_default();
    let message = format!(
        "Preempted by lease {by}, which has priority over this lease's spot access to the exporter"
    );
    conditions::set(
        &mut conds,
        Desired::new(READY, false, PREEMPTED, message.clone()),
        generation,
        &stamp,
    );
    conditions::set(
        &mut conds,
        Desired::new(ENDED, true, PREEMPTED, message),
        generation,
        &stamp,
    );
    status.conditions = Some(conds);
    status.ended = true;
    status.end_time = Some(stamp);
    status.queue = None;
    status
}

/// An exporter held by an active lease, as preemption reads it.
#[derive(Debug, Clone)]
pub struct Held<'a> {
    pub exporter: &'a Exporter,
    pub lease: &'a Lease,
}

impl Held<'_> {
    fn spot(&self) -> bool {
        self.lease.status.as_ref().and_then(|s| s.spot_access) == Some(true)
    }

    fn priority(&self) -> i64 {
        self.lease
            .status
            .as_ref()
            .and_then(|s| s.priority)
            .unwrap_or(0)
    }

    /// Its exporter runs the beforeLease hook of this lease.
    fn in_before_lease_hook(&self) -> bool {
        let lease = self.lease.metadata.name.as_deref().unwrap_or_default();
        let Some(status) = self.exporter.status.as_ref() else {
            return false;
        };
        if status.exporter_status == Some(ExporterStatusValue::BeforeLeaseHook)
            && status.lease_ref.as_ref().map(|r| r.name.as_str()) == Some(lease)
        {
            return true;
        }
        status.lease_hooks.as_ref().is_some_and(|h| {
            h.lease_ref.as_ref().map(|r| r.name.as_str()) == Some(lease)
                && h.before_lease.as_ref().map(|b| b.phase) == Some(HookPhase::Running)
        })
    }
}

/// The lease to preempt for a non-spot lease of `priority`: among `held` (exporters the waiting
/// lease may use under non-spot access), those held under spot access at a priority no higher,
/// not in their beforeLease hook; the youngest (latest start, then the last name). A non-spot
/// lease is never preempted.
pub fn victim<'h, 'a>(priority: i64, held: &'h [Held<'a>]) -> Option<&'h Held<'a>> {
    held.iter()
        .filter(|h| h.spot() && h.priority() <= priority && !h.in_before_lease_hook())
        .max_by(|a, b| {
            let begin = |h: &Held<'_>| {
                h.lease
                    .status
                    .as_ref()
                    .and_then(|s| s.begin_time.as_ref())
                    .map(|t| t.0)
            };
            begin(a)
                .cmp(&begin(b))
                .then(a.lease.metadata.name.cmp(&b.lease.metadata.name))
        })
}

//! The status a Lease shows after a pass (docs/exporter.md, "The Lease pass"): the assignment
//! written in, the start, and the end rules (invalid, released, expired).

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::expiry::{expiration, lease_duration};
use super::{Assignment, INVALID, PENDING, READY, UNSATISFIABLE};
use crate::conditions::{self, Desired};
use crate::exporter::crd::{Lease, LeaseStatus, LocalObjectReference};

/// The result of one Lease pass (docs/exporter.md, "The Lease pass").
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseOutcome {
    pub status: LeaseStatus,
    pub requeue_after: Option<Duration>,
    /// The exporter assigned in this pass (acquisition success when persisted).
    pub assigned: Option<String>,
}

/// One pass over a lease: assignment (when given), start, and end rules.
/// `assignment` is the result of [`decide_assignment`](super::assign::decide_assignment) when
/// the lease was not ended and had no exporter (the caller skips the decision otherwise).
pub fn build_status(lease: &Lease, assignment: Option<Assignment>, now: Timestamp) -> LeaseOutcome {
    let mut status = lease.status.clone().unwrap_or_default();
    let mut pass = Pass {
        generation: lease.metadata.generation,
        stamp: conditions::time(now),
        conds: status.conditions.take().unwrap_or_default(),
    };
    // Only a lease that waits in the queue has a place in it (set below).
    status.queue = None;

    let duration = match lease_duration(lease) {
        Some(Err(message)) if !status.ended => {
            pass.set(INVALID, true, "InvalidDuration", message);
            None
        }
        Some(Ok(d)) => Some(d),
        _ => None,
    };
    let mut requeue_after = None;
    let mut assigned = None;
    if !status.ended
        && let Some(assignment) = assignment
    {
        (requeue_after, assigned) = write_assignment(&mut pass, &mut status, assignment, now);
    }

    // Start: Pending keeps its last value (upstream quirk).
    if status.exporter_ref_name().is_some() && status.begin_time.is_none() {
        status.begin_time = Some(pass.stamp.clone());
        pass.set(
            READY,
            true,
            "Ready",
            "An exporter has been acquired for the client",
        );
    }
    if !status.ended {
        match end(&mut pass, &mut status, lease, duration, now) {
            End::Ended => requeue_after = None,
            End::ExpiresIn(at) => requeue_after = at,
            End::Open => {}
        }
    }

    status.conditions = Some(pass.conds);
    LeaseOutcome {
        status,
        requeue_after,
        assigned,
    }
}

/// The conditions of one pass, set with its generation and time.
struct Pass {
    generation: Option<i64>,
    stamp: Time,
    conds: Vec<Condition>,
}

impl Pass {
    fn set(&mut self, kind: &str, value: bool, reason: &'static str, message: impl Into<String>) {
        conditions::set(
            &mut self.conds,
            Desired::new(kind, value, reason, message),
            self.generation,
            &self.stamp,
        );
    }
}

/// Writes the assignment into the status: its condition, its place in the queue or the
/// exporter it got. Returns when to look again and the exporter assigned.
fn write_assignment(
    pass: &mut Pass,
    status: &mut LeaseStatus,
    assignment: Assignment,
    now: Timestamp,
) -> (Option<Duration>, Option<String>) {
    match assignment {
        Assignment::Scheduled(wait) => return (Some(wait), None),
        Assignment::Invalid { reason, message } => pass.set(INVALID, true, reason, message),
        Assignment::Unsatisfiable { reason, message } => {
            pass.set(UNSATISFIABLE, true, reason, message);
        }
        // OURS: no timer. What a pending lease waits for (an exporter freed, online, ready or
        // relabelled; a policy or its client changed) brings its next pass; a timer per pending
        // lease kept the queue busy for ever.
        Assignment::Pending { reason, message } => pass.set(PENDING, true, reason, message),
        Assignment::Queued {
            reason,
            message,
            queue,
            preempt,
        } => {
            pass.set(PENDING, true, reason, message);
            status.queue = Some(queue);
            // The preemption's grace period ends: look again then.
            let requeue = preempt.map(|p| {
                let wait: Duration = now.duration_until(p.at).try_into().unwrap_or_default();
                wait.max(Duration::from_secs(1))
            });
            return (requeue, None);
        }
        Assignment::Assign {
            exporter,
            priority,
            spot_access,
        } => {
            status.exporter_ref = Some(LocalObjectReference::new(&exporter));
            // Go's omitempty: zero priority and false spot access are not written.
            status.priority = (priority != 0).then_some(priority);
            status.spot_access = spot_access.then_some(true);
            return (None, Some(exporter));
        }
    }
    (None, None)
}

/// What the end rules found.
enum End {
    /// Ended now (invalid or unsatisfiable, released, expired): no timer.
    Ended,
    /// Started and not expired: look again at expiry.
    ExpiresIn(Option<Duration>),
    /// Not started, nothing ends it.
    Open,
}

/// The end rules, first match wins: invalid or unsatisfiable, released, expired.
fn end(
    pass: &mut Pass,
    status: &mut LeaseStatus,
    lease: &Lease,
    duration: Option<SignedDuration>,
    now: Timestamp,
) -> End {
    let refused = conditions::is_true(&pass.conds, UNSATISFIABLE)
        || conditions::is_true(&pass.conds, INVALID);
    if refused {
        // Ends as it is: the condition says why.
    } else if lease.spec.release == Some(true) {
        pass.set(READY, false, "Released", "The lease was marked for release");
    } else if status.begin_time.is_some() {
        let mut started = lease.clone();
        started.status = Some(status.clone());
        match expiration(&started, duration) {
            Some(at) if at > now => return End::ExpiresIn(now.duration_until(at).try_into().ok()),
            _ => pass.set(READY, false, "Expired", "The lease has expired"),
        }
    } else {
        return End::Open;
    }
    status.ended = true;
    status.end_time = Some(pass.stamp.clone());
    End::Ended
}

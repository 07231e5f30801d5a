//! The status a Lease shows after a pass (docs/exporter.md, "The Lease pass"): the assignment
//! written in, the start, and the end rules (invalid, released, expired).

use std::time::Duration;

use jiff::Timestamp;

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
/// `assignment` is the result of [`decide_assignment`] when the lease was not ended and had no
/// exporter (the caller skips the decision otherwise).
pub fn build_status(lease: &Lease, assignment: Option<Assignment>, now: Timestamp) -> LeaseOutcome {
    let generation = lease.metadata.generation;
    let stamp = conditions::time(now);
    let mut status = lease.status.clone().unwrap_or_default();
    let mut conds = status.conditions.take().unwrap_or_default();
    let mut requeue_after = None;
    let mut assigned = None;
    // Only a lease that waits in the queue has a place in it (set below).
    status.queue = None;

    let duration = match lease_duration(lease) {
        Some(Err(message)) if !status.ended => {
            conditions::set(
                &mut conds,
                Desired::new(INVALID, true, "InvalidDuration", message),
                generation,
                &stamp,
            );
            None
        }
        Some(Ok(d)) => Some(d),
        _ => None,
    };

    if !status.ended {
        match assignment {
            None => {}
            Some(Assignment::Scheduled(wait)) => requeue_after = Some(wait),
            Some(Assignment::Invalid { reason, message }) => {
                conditions::set(
                    &mut conds,
                    Desired::new(INVALID, true, reason, message),
                    generation,
                    &stamp,
                );
            }
            Some(Assignment::Unsatisfiable { reason, message }) => {
                conditions::set(
                    &mut conds,
                    Desired::new(UNSATISFIABLE, true, reason, message),
                    generation,
                    &stamp,
                );
            }
            Some(Assignment::Pending { reason, message }) => {
                conditions::set(
                    &mut conds,
                    Desired::new(PENDING, true, reason, message),
                    generation,
                    &stamp,
                );
                // OURS: no timer. What a pending lease waits for (an exporter
                // freed, online, ready or relabelled; a policy or its client changed) brings
                // its next pass; a timer per pending lease kept the queue busy for ever.
            }
            Some(Assignment::Queued {
                reason,
                message,
                queue,
                preempt,
            }) => {
                conditions::set(
                    &mut conds,
                    Desired::new(PENDING, true, reason, message),
                    generation,
                    &stamp,
                );
                status.queue = Some(queue);
                // The preemption's grace period ends: look again then.
                requeue_after = preempt.map(|p| {
                    let wait: Duration = now.duration_until(p.at).try_into().unwrap_or_default();
                    wait.max(Duration::from_secs(1))
                });
            }
            Some(Assignment::Assign {
                exporter,
                priority,
                spot_access,
            }) => {
                status.exporter_ref = Some(LocalObjectReference::new(&exporter));
                // Go's omitempty: zero priority and false spot access are not written.
                status.priority = (priority != 0).then_some(priority);
                status.spot_access = spot_access.then_some(true);
                assigned = Some(exporter);
            }
        }
    }

    // Start: Pending keeps its last value (upstream quirk).
    if status.exporter_ref_name().is_some() && status.begin_time.is_none() {
        status.begin_time = Some(stamp.clone());
        conditions::set(
            &mut conds,
            Desired::new(
                READY,
                true,
                "Ready",
                "An exporter has been acquired for the client",
            ),
            generation,
            &stamp,
        );
    }

    // End, first match wins.
    if !status.ended {
        if conditions::is_true(&conds, UNSATISFIABLE) || conditions::is_true(&conds, INVALID) {
            status.ended = true;
            status.end_time = Some(stamp.clone());
            requeue_after = None;
        } else if lease.spec.release == Some(true) {
            conditions::set(
                &mut conds,
                Desired::new(READY, false, "Released", "The lease was marked for release"),
                generation,
                &stamp,
            );
            status.ended = true;
            status.end_time = Some(stamp.clone());
            requeue_after = None;
        } else if status.begin_time.is_some() {
            let mut started = lease.clone();
            started.status = Some(status.clone());
            match expiration(&started, duration) {
                Some(at) if at > now => {
                    requeue_after = now.duration_until(at).try_into().ok();
                }
                _ => {
                    conditions::set(
                        &mut conds,
                        Desired::new(READY, false, "Expired", "The lease has expired"),
                        generation,
                        &stamp,
                    );
                    status.ended = true;
                    status.end_time = Some(stamp.clone());
                    requeue_after = None;
                }
            }
        }
    }

    status.conditions = Some(conds);
    LeaseOutcome {
        status,
        requeue_after,
        assigned,
    }
}

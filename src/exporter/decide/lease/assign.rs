//! The assignment (docs/exporter.md, "Lease assignment", "Lease scheduling"): the decision order
//! that takes a ready exporter for a lease, or says why it waits, is invalid or unsatisfiable.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::access::{Approved, approve, attach_existing, filter_out_disabled, gate_suffix, is_ready, labels_of, name_of, order};
use super::expiry::{expiration, lease_duration, time_range_problem};
use super::queue::{self, QueueKey};
use super::preempt::{Held, victim};
use super::{Assignment, Preempt};
use crate::conditions;
use crate::exporter::crd::{Client, Exporter, ExporterAccessPolicy, Lease, LeaseQueue};
use crate::exporter::decide::exporter::{ONLINE, REGISTERED};
use crate::exporter::lease::selector;

const MAX_DESCRIPTIONS: usize = 4096;

/// What the queue adds to the decision (docs/exporter.md, "Lease scheduling"). Without it the
/// decision is upstream's, except that spot access is granted.
pub struct QueueInputs<'a> {
    /// The namespace's waiting leases and bookings ([`queue::waiting`]).
    pub field: &'a queue::Field<'a>,
    /// How long a preempted lease keeps its exporter after the preemption is decided.
    pub grace: SignedDuration,
}

/// The decision and the waiting leases behind this one, whose shown position changes when
/// this one enters or leaves the queue.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub assignment: Assignment,
    pub behind: Vec<String>,
}

impl From<Assignment> for Decision {
    fn from(assignment: Assignment) -> Self {
        Decision {
            assignment,
            behind: Vec::new(),
        }
    }
}

/// Everything the decision reads, gathered by the reconciler from its caches.
pub struct AssignInputs<'a> {
    pub lease: &'a Lease,
    /// Every Exporter in the lease's namespace.
    pub exporters: &'a [&'a Exporter],
    /// The active Leases in the namespace (no ended label, `status.ended` false), with the
    /// assignments this replica made that the cache does not show yet.
    pub active_leases: &'a [&'a Lease],
    /// The ExporterAccessPolicies in the namespace.
    pub policies: &'a [&'a ExporterAccessPolicy],
    /// The lease's Client; only read when policies exist.
    pub client: Option<&'a Client>,
    pub now: Timestamp,
    /// The queue; None decides as upstream (first ready exporter, no order among leases).
    pub queue: Option<&'a QueueInputs<'a>>,
}

/// The decision order of docs/exporter.md, "Lease assignment". Runs only while the lease is not
/// ended and has no exporter.
pub fn decide_assignment(inp: &AssignInputs<'_>) -> Assignment {
    decide(inp).assignment
}

/// [`decide_assignment`] with the waiting leases behind this one.
pub fn decide(inp: &AssignInputs<'_>) -> Decision {
    let mut behind = Vec::new();
    let assignment = decide_inner(inp, &mut behind);
    Decision { assignment, behind }
}

fn decide_inner(inp: &AssignInputs<'_>, behind: &mut Vec<String>) -> Assignment {
    let lease = inp.lease;
    if let Some(invalid) = time_range_problem(lease) {
        return invalid;
    }
    // No exporter is taken for a lease that build_status will end as InvalidDuration.
    if let Some(Err(message)) = lease_duration(lease) {
        return Assignment::Invalid {
            reason: "InvalidDuration",
            message,
        };
    }
    if let Some(begin) = &lease.spec.begin_time
        && begin.0 > inp.now
    {
        let wait = inp
            .now
            .duration_until(begin.0)
            .try_into()
            .unwrap_or_default();
        return Assignment::Scheduled(wait);
    }
    let pinned = lease.spec.exporter_ref_name();
    let sel = &lease.spec.selector;
    if let Err(e) = selector::validate(sel) {
        return Assignment::Invalid {
            reason: "InvalidSelector",
            message: format!("The selector for the lease is invalid: {}", e.0),
        };
    }
    if selector::is_empty(sel) && pinned.is_none() {
        return Assignment::Invalid {
            reason: "InvalidSelector",
            message: "The selector for the lease is empty, a selector is required".into(),
        };
    }

    let matching: Vec<&Exporter> = if let Some(name) = pinned {
        let Some(exporter) = inp.exporters.iter().copied().find(|e| name_of(e) == name) else {
            return Assignment::Unsatisfiable {
                reason: "ExporterNotFound",
                message: format!("Requested exporter {name} was not found"),
            };
        };
        if !selector::is_empty(sel) && !selector::matches(sel, labels_of(exporter)).unwrap_or(false)
        {
            return Assignment::Unsatisfiable {
                reason: "SelectorMismatch",
                message: format!(
                    "Requested exporter {name} does not match selector {}",
                    selector::format(sel)
                ),
            };
        }
        if !exporter.spec.is_enabled() && lease.spec.allow_disabled != Some(true) {
            return Assignment::Unsatisfiable {
                reason: "ExporterDisabled",
                message: format!(
                    "Requested exporter {name} is disabled. To lease a disabled exporter, set spec.allowDisabled: true on the Lease, or use --allow-disabled with jmp create lease or jmp shell"
                ),
            };
        }
        vec![exporter]
    } else if let Some(enabled) = inp
        .queue
        .and_then(|q| q.field.matching(lease))
        .filter(|m| !m.is_empty())
    {
        // The queue scanned every exporter for this selection already (same snapshot).
        enabled.to_vec()
    } else {
        let listed: Vec<&Exporter> = inp
            .exporters
            .iter()
            .copied()
            .filter(|e| selector::matches_valid(sel, labels_of(e)))
            .collect();
        let enabled = filter_out_disabled(&listed);
        if enabled.is_empty() && !listed.is_empty() {
            return Assignment::Unsatisfiable {
                reason: "AllDisabled",
                message: format!(
                    "All {} exporters matching the selector are disabled",
                    listed.len()
                ),
            };
        }
        enabled
    };

    let approval = match approve(inp.lease, inp.policies, inp.client, &matching) {
        Ok(a) => a,
        Err(pending) => return pending,
    };
    let (approved, unmatched) = (approval.approved, approval.unmatched_descriptions);
    if approved.is_empty() {
        let base = format!(
            "While there are {} exporters matching the selector, none of them are approved by any policy for your client",
            matching.len()
        );
        let message = if unmatched.is_empty() {
            base
        } else {
            let mut desc = unmatched.join("; ");
            if desc.len() > MAX_DESCRIPTIONS {
                crate::runtime::text::cut_at_char_boundary(&mut desc, MAX_DESCRIPTIONS);
                desc.push_str("...");
            }
            format!("{base}. Matching policies: {desc}")
        };
        // OURS: policy entries that could never approve anything are named, so the fix is clear.
        let message = if approval.problems.is_empty() {
            message
        } else {
            format!(
                "{message}. Unusable policy entries: {}",
                approval.problems.join("; ")
            )
        };
        return Assignment::Unsatisfiable {
            reason: "NoAccess",
            message,
        };
    }

    let online: Vec<Approved<'_>> = approved
        .iter()
        .filter(|a| {
            let conds = a
                .exporter
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_deref())
                .unwrap_or_default();
            conditions::is_true(conds, REGISTERED) && conditions::is_true(conds, ONLINE)
        })
        .cloned()
        .collect();
    if online.is_empty() {
        return Assignment::Pending {
            reason: "Offline",
            message: format!(
                "While there are {} available exporters (i.e. {}), none of them are online",
                approved.len(),
                approved[0].name()
            ),
        };
    }

    let ordered = order(attach_existing(online, inp.active_leases));
    queue_tail(inp, &approved, ordered, behind)
}

/// The end of the decision, from the ordered online approvals: take a ready exporter when the
/// queue lets this lease, else wait with its place in the queue, preempting a spot lease when
/// that is what it waits for (docs/exporter.md, "Lease scheduling").
fn queue_tail(
    inp: &AssignInputs<'_>,
    approved: &[Approved<'_>],
    ordered: Vec<Approved<'_>>,
    behind: &mut Vec<String>,
) -> Assignment {
    let lease = inp.lease;
    let now = inp.now;
    // One entry per exporter: its best approval (the order puts non-spot, then higher
    // priority, first).
    let mut seen = std::collections::HashSet::new();
    let ordered: Vec<Approved<'_>> = ordered
        .into_iter()
        .filter(|a| seen.insert(name_of(a.exporter)))
        .collect();
    let first = ordered[0].name().to_string();
    let priority = approved.iter().map(|a| a.priority).max().unwrap_or(0);
    let mine: std::collections::BTreeSet<&str> = ordered.iter().map(|a| a.name()).collect();
    let empty = queue::Field::default();
    let field = inp.queue.map_or(&empty, |q| q.field);
    let standing = queue::standing(&QueueKey::of(lease, priority), &mine, &field.waiting);

    let available: Vec<&Approved<'_>> = ordered
        .iter()
        .filter(|a| a.existing_spot.is_none())
        .collect();
    let ready: Vec<&&Approved<'_>> = available.iter().filter(|a| is_ready(a.exporter)).collect();
    if !ready.is_empty() && standing.may_take(ready.len()) {
        *behind = standing.behind;
        let selected = ready[0];
        return Assignment::Assign {
            exporter: selected.name().to_string(),
            priority: selected.priority,
            spot_access: selected.spot_access,
        };
    }

    // Waiting: where it stands.
    let holders: std::collections::HashMap<&str, &Lease> = inp
        .active_leases
        .iter()
        .filter_map(|l| {
            let s = l.status.as_ref()?;
            (!s.ended).then_some((s.exporter_ref_name()?, *l))
        })
        .collect();
    let free_at: Vec<(&str, Option<Timestamp>)> = ordered
        .iter()
        .map(|a| {
            let at = match holders.get(a.name()) {
                None => Some(now),
                Some(holder) => expiration(holder, queue::duration_of(holder)).map(|t| t.max(now)),
            };
            (a.name(), at)
        })
        .collect();
    let previous = lease.status.as_ref().and_then(|s| s.queue.as_ref());
    let mut estimate = standing
        .shown()
        .then(|| {
            queue::estimate_start(
                &free_at.iter().map(|(_, t)| *t).collect::<Vec<_>>(),
                &standing.ahead_durations,
            )
        })
        .flatten()
        .map(|t| conditions::time(t).0);
    // An estimate that moved less than a minute, or that says "now" again, keeps its last
    // value: no write for jitter.
    if let (Some(new), Some(old)) = (
        estimate,
        previous.and_then(|q| q.estimated_start_time.as_ref()),
    ) && (new.duration_since(old.0).abs() < SignedDuration::from_secs(60)
        || (new <= now && old.0 <= now))
    {
        estimate = Some(old.0);
    }
    let mut place = if standing.shown() {
        format!("position {} in the queue", standing.position())
    } else {
        format!(
            "more than {} leases ahead in the queue",
            queue::POSITION_CAP
        )
    };
    match estimate {
        Some(t) if t <= now => place.push_str(", estimated start now"),
        Some(t) => place.push_str(&format!(", estimated start {t}")),
        None if standing.shown() => place.push_str(", estimated start unknown"),
        None => {}
    }
    if let (Some(d), false) = (queue::duration_of(lease), field.bookings.is_empty())
        && let Some((window, exporter, booking)) =
            queue::longest_free_window(&free_at, d, &field.bookings)
    {
        place.push_str(&format!(
            "; the requested {} does not fit before the next booking on any matching exporter: the longest free window is {} on exporter {exporter}, before lease {} at {}",
            queue::human(d),
            queue::human(window),
            booking.name,
            booking.begin
        ));
    }
    let mut status = LeaseQueue {
        estimated_start_time: estimate.map(Time),
        position: standing
            .shown()
            .then(|| i64::try_from(standing.position()).unwrap_or(i64::MAX)),
        priority: (priority != 0).then_some(priority),
        ..Default::default()
    };
    let queued =
        |reason: &'static str, message: String, status: LeaseQueue, preempt| Assignment::Queued {
            reason,
            message,
            queue: status,
            preempt,
        };

    if !ready.is_empty() {
        return queued(
            "Queued",
            format!(
                "{} leases ahead are served first by the {} free exporters (i.e. {}); {place}",
                standing.ahead,
                ready.len(),
                ready[0].name()
            ),
            status,
            None,
        );
    }
    if available.is_empty() {
        // Every exporter is leased: the head of the queue preempts a spot lease it may take.
        if inp.queue.is_some() && standing.ahead == 0 {
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
                .max();
            if let Some(my_priority) = my_priority
                && let Some(victim) = victim(my_priority, &non_spot)
            {
                let victim_name = victim.lease.metadata.name.clone().unwrap_or_default();
                let exporter = victim.exporter.metadata.name.clone().unwrap_or_default();
                let grace = inp.queue.map_or(SignedDuration::ZERO, |q| q.grace);
                let at = previous
                    .filter(|q| q.preempting.as_deref() == Some(victim_name.as_str()))
                    .and_then(|q| q.preempt_at.as_ref())
                    .map(|t| t.0)
                    .unwrap_or_else(|| conditions::time(now + grace).0);
                status.preempting = Some(victim_name.clone());
                status.preempt_at = Some(Time(at));
                return queued(
                    "Preempting",
                    format!(
                        "Exporter {exporter} is leased by lease {victim_name} under spot access; that lease is preempted for this one at {at}; {place}"
                    ),
                    status,
                    Some(Preempt {
                        lease: victim_name,
                        exporter,
                        at,
                        due: at <= now,
                    }),
                );
            }
        }
        return queued(
            "NotAvailable",
            format!(
                "There are {} approved exporters, (i.e. {first}) but all of them are already leased; {place}",
                ordered.len(),
            ),
            status,
            None,
        );
    }
    let mut message = format!(
        "There are {} online exporters, but none are ready (still cleaning up previous lease)",
        available.len()
    );
    message.push_str(&gate_suffix(available.iter().map(|a| a.exporter)));
    message.push_str(&format!("; {place}"));
    queued("NotReady", message, status, None)
}

#[cfg(test)]
#[path = "assign_tests.rs"]
mod tests;

//! The assignment (docs/exporter.md, "Lease assignment", "Lease scheduling"): the decision order
//! that takes a ready exporter for a lease, or says why it waits, is invalid or unsatisfiable.

use std::collections::{BTreeSet, HashMap, HashSet};

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::Assignment;
use super::access::{
    Approval, Approved, approve, attach_existing, filter_out_disabled, gate_suffix, is_ready,
    labels_of, name_of, order,
};
use super::expiry::{expiration, lease_duration, time_range_problem};
use super::preempt;
use super::queue::{self, QueueKey};
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
    if let Some(not_now) = time_problem(inp).or_else(|| selection_problem(inp.lease)) {
        return not_now;
    }
    let matching = match selected(inp) {
        Ok(m) => m,
        Err(unsatisfiable) => return unsatisfiable,
    };
    let approval = match approve(inp.lease, inp.policies, inp.client, &matching) {
        Ok(a) => a,
        Err(pending) => return pending,
    };
    if approval.approved.is_empty() {
        return no_access(matching.len(), &approval);
    }
    let approved = approval.approved;
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

/// The time fields first: a range that ends before it begins or a bad duration is invalid (no
/// exporter is taken for a lease that build_status will end as InvalidDuration); a lease that
/// begins later is scheduled.
fn time_problem(inp: &AssignInputs<'_>) -> Option<Assignment> {
    let lease = inp.lease;
    if let Some(invalid) = time_range_problem(lease) {
        return Some(invalid);
    }
    if let Some(Err(message)) = lease_duration(lease) {
        return Some(Assignment::Invalid {
            reason: "InvalidDuration",
            message,
        });
    }
    let begin = lease.spec.begin_time.as_ref().filter(|b| b.0 > inp.now)?;
    let wait = inp
        .now
        .duration_until(begin.0)
        .try_into()
        .unwrap_or_default();
    Some(Assignment::Scheduled(wait))
}

/// An invalid selector, or an empty one with no pinned exporter, is invalid.
fn selection_problem(lease: &Lease) -> Option<Assignment> {
    let sel = &lease.spec.selector;
    if let Err(e) = selector::validate(sel) {
        return Some(Assignment::Invalid {
            reason: "InvalidSelector",
            message: format!("The selector for the lease is invalid: {}", e.0),
        });
    }
    (selector::is_empty(sel) && lease.spec.exporter_ref_name().is_none()).then(|| {
        Assignment::Invalid {
            reason: "InvalidSelector",
            message: "The selector for the lease is empty, a selector is required".into(),
        }
    })
}

/// The exporters the lease selects, enabled (its pinned exporter, or those its selector
/// matches); Unsatisfiable when that can never be any.
// The error is a decision, built once per pass; boxing it buys nothing.
#[allow(clippy::result_large_err)]
fn selected<'a>(inp: &AssignInputs<'a>) -> Result<Vec<&'a Exporter>, Assignment> {
    let lease = inp.lease;
    let sel = &lease.spec.selector;
    if let Some(name) = lease.spec.exporter_ref_name() {
        return pinned(inp, name).map(|e| vec![e]);
    }
    if let Some(enabled) = inp
        .queue
        .and_then(|q| q.field.matching(lease))
        .filter(|m| !m.is_empty())
    {
        // The queue scanned every exporter for this selection already (same snapshot).
        return Ok(enabled.to_vec());
    }
    let listed: Vec<&Exporter> = inp
        .exporters
        .iter()
        .copied()
        .filter(|e| selector::matches_valid(sel, labels_of(e)))
        .collect();
    let enabled = filter_out_disabled(&listed);
    if enabled.is_empty() && !listed.is_empty() {
        return Err(Assignment::Unsatisfiable {
            reason: "AllDisabled",
            message: format!(
                "All {} exporters matching the selector are disabled",
                listed.len()
            ),
        });
    }
    Ok(enabled)
}

/// The exporter the lease names: it must exist, match the selector when there is one, and be
/// enabled unless the lease allows a disabled one.
#[allow(clippy::result_large_err)]
fn pinned<'a>(inp: &AssignInputs<'a>, name: &str) -> Result<&'a Exporter, Assignment> {
    let lease = inp.lease;
    let sel = &lease.spec.selector;
    let Some(exporter) = inp.exporters.iter().copied().find(|e| name_of(e) == name) else {
        return Err(Assignment::Unsatisfiable {
            reason: "ExporterNotFound",
            message: format!("Requested exporter {name} was not found"),
        });
    };
    if !selector::is_empty(sel) && !selector::matches(sel, labels_of(exporter)).unwrap_or(false) {
        return Err(Assignment::Unsatisfiable {
            reason: "SelectorMismatch",
            message: format!(
                "Requested exporter {name} does not match selector {}",
                selector::format(sel)
            ),
        });
    }
    if !exporter.spec.is_enabled() && lease.spec.allow_disabled != Some(true) {
        return Err(Assignment::Unsatisfiable {
            reason: "ExporterDisabled",
            message: format!(
                "Requested exporter {name} is disabled. To lease a disabled exporter, set spec.allowDisabled: true on the Lease, or use --allow-disabled with jmp create lease or jmp shell"
            ),
        });
    }
    Ok(exporter)
}

/// No policy rule approves any of the `matching` exporters for the lease's Client: NoAccess,
/// naming the rules that matched an exporter but not the client, and (OURS) the policy entries
/// that could never approve anything, so the fix is clear.
fn no_access(matching: usize, approval: &Approval<'_>) -> Assignment {
    let base = format!(
        "While there are {matching} exporters matching the selector, none of them are approved by any policy for your client"
    );
    let unmatched = &approval.unmatched_descriptions;
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
    let message = if approval.problems.is_empty() {
        message
    } else {
        format!(
            "{message}. Unusable policy entries: {}",
            approval.problems.join("; ")
        )
    };
    Assignment::Unsatisfiable {
        reason: "NoAccess",
        message,
    }
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
    // One entry per exporter: its best approval (the order puts non-spot, then higher
    // priority, first).
    let mut seen = HashSet::new();
    let ordered: Vec<Approved<'_>> = ordered
        .into_iter()
        .filter(|a| seen.insert(name_of(a.exporter)))
        .collect();
    let priority = approved.iter().map(|a| a.priority).max().unwrap_or(0);
    let mine: BTreeSet<&str> = ordered.iter().map(|a| a.name()).collect();
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

    waiting(
        inp, &ordered, &available, &ready, &standing, priority, field,
    )
}

/// A lease that may not take an exporter now waits in the queue (`Queued`): behind the leases
/// served first by the free exporters (`Queued`), for a spot lease it preempts (`Preempting`),
/// for a leased exporter (`NotAvailable`) or for one still cleaning up (`NotReady`), with its
/// place.
fn waiting(
    inp: &AssignInputs<'_>,
    ordered: &[Approved<'_>],
    available: &[&Approved<'_>],
    ready: &[&&Approved<'_>],
    standing: &queue::Standing,
    priority: i64,
    field: &queue::Field<'_>,
) -> Assignment {
    let lease = inp.lease;
    // Waiting: where it stands.
    let holders = holders(inp.active_leases);
    let free_at = free_at(ordered, &holders, inp.now);
    let previous = lease.status.as_ref().and_then(|s| s.queue.as_ref());
    let (place, mut status) = queue::place(
        lease, standing, &free_at, field, previous, priority, inp.now,
    );
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
        let grace = inp.queue.filter(|_| standing.ahead == 0).map(|q| q.grace);
        if let Some(grace) = grace
            && let Some(p) = preempt::choose(ordered, &holders, previous, grace, inp.now)
        {
            status.preempting = Some(p.lease.clone());
            status.preempt_at = Some(Time(p.at));
            return queued(
                "Preempting",
                format!(
                    "Exporter {} is leased by lease {} under spot access; that lease is preempted for this one at {}; {place}",
                    p.exporter, p.lease, p.at
                ),
                status,
                Some(p),
            );
        }
        return queued(
            "NotAvailable",
            format!(
                "There are {} approved exporters, (i.e. {}) but all of them are already leased; {place}",
                ordered.len(),
                ordered[0].name(),
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

/// The exporter each active lease holds (not ended), by exporter name.
fn holders<'a>(active: &[&'a Lease]) -> HashMap<&'a str, &'a Lease> {
    active
        .iter()
        .filter_map(|l| {
            let s = l.status.as_ref()?;
            (!s.ended).then_some((s.exporter_ref_name()?, *l))
        })
        .collect()
}

/// When each of the lease's exporters comes free: now when no lease holds it, its holder's
/// expiration (not before now) when it has one, None when its holder has no end.
fn free_at<'a>(
    ordered: &'a [Approved<'_>],
    holders: &HashMap<&str, &Lease>,
    now: Timestamp,
) -> Vec<(&'a str, Option<Timestamp>)> {
    ordered
        .iter()
        .map(|a| {
            let at = match holders.get(a.name()) {
                None => Some(now),
                Some(holder) => expiration(holder, queue::duration_of(holder)).map(|t| t.max(now)),
            };
            (a.name(), at)
        })
        .collect()
}

#[cfg(test)]
#[path = "assign_tests.rs"]
mod tests;

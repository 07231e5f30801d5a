//! Pure Lease decisions (docs/exporter.md, "Lease assignment" and "The Lease pass"): the
//! assignment decision order, policy approval, filters and ordering, the Pending decisions, and
//! the start/end/expiry rules. The reconciler gathers the inputs (IO) and writes the result.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::conditions::{self, Desired};
use crate::exporter::crd::{
    Client, Exporter, ExporterAccessPolicy, ExporterStatusValue, Lease, LeaseQueue, LeaseStatus,
    LocalObjectReference,
};
use crate::exporter::decide::exporter::{ONLINE, REGISTERED, owes_after_lease};
use crate::exporter::decide::lease::queue::{self, QueueKey};
use crate::exporter::lease::selector;
use crate::godur;

pub const PENDING: &str = "Pending";
pub const READY: &str = "Ready";
pub const UNSATISFIABLE: &str = "Unsatisfiable";
pub const INVALID: &str = "Invalid";
/// OURS: set on a lease a higher-priority lease preempted (docs/exporter.md, "Lease scheduling").
pub const ENDED: &str = "Ended";
pub const PREEMPTED: &str = "Preempted";

/// Label that marks ended leases (the cheap filter for active ones).
pub const ENDED_LABEL: &str = "jumpstarter.dev/lease-ended";
pub const ENDED_VALUE: &str = "true";

const MAX_DESCRIPTIONS: usize = 4096;

/// What the assignment step decided (docs/exporter.md, "Lease assignment").
#[derive(Debug, Clone, PartialEq)]
pub enum Assignment {
    /// Row 3: scheduled for later; no condition.
    Scheduled(Duration),
    Invalid {
        reason: &'static str,
        message: String,
    },
    Unsatisfiable {
        reason: &'static str,
        message: String,
    },
    Pending {
        reason: &'static str,
        message: String,
    },
    Assign {
        exporter: String,
        priority: i64,
        spot_access: bool,
    },
    /// OURS: waiting in the queue (a `Pending` condition), with its place in it.
    Queued {
        reason: &'static str,
        message: String,
        queue: LeaseQueue,
        preempt: Option<Preempt>,
    },
}

/// A lease held under spot access that a waiting lease preempts.
#[derive(Debug, Clone, PartialEq)]
pub struct Preempt {
    pub lease: String,
    pub exporter: String,
    pub at: Timestamp,
    /// The grace period is over: end it now.
    pub due: bool,
}

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

#[derive(Debug, Clone)]
struct Approved<'a> {
    exporter: &'a Exporter,
    priority: i64,
    spot_access: bool,
    existing_spot: Option<bool>,
}

impl Approved<'_> {
    fn name(&self) -> &str {
        self.exporter.metadata.name.as_deref().unwrap_or_default()
    }
}

fn name_of(e: &Exporter) -> &str {
    e.metadata.name.as_deref().unwrap_or_default()
}

static NO_LABELS: std::collections::BTreeMap<String, String> = std::collections::BTreeMap::new();

fn labels_of(e: &Exporter) -> &std::collections::BTreeMap<String, String> {
    e.metadata.labels.as_ref().unwrap_or(&NO_LABELS)
}

/// The requested duration for policy limits: `spec.duration`, else `endTime − beginTime`.
fn requested_duration(lease: &Lease) -> SignedDuration {
    if let Some(d) = lease
        .spec
        .duration
        .as_deref()
        .and_then(|d| godur::parse_signed(d).ok())
    {
        return d;
    }
    match (&lease.spec.begin_time, &lease.spec.end_time) {
        (Some(b), Some(e)) => e.0.duration_since(b.0),
        _ => SignedDuration::ZERO,
    }
}

/// `spec.duration`, parsed; `Err` is the InvalidDuration message. OURS: as on the gRPC path
/// (docs/exporter.md, "Lease time fields"), a duration must be positive.
fn lease_duration(lease: &Lease) -> Option<Result<SignedDuration, String>> {
    let d = lease.spec.duration.as_deref()?;
    Some(match godur::parse_signed(d) {
        Err(e) => Err(format!("spec.duration: {e}")),
        Ok(v) if v <= SignedDuration::ZERO => Err(format!(
            "spec.duration: {d:?} is not positive; set a duration such as 1h"
        )),
        Ok(v) => Ok(v),
    })
}

/// OURS: a lease that would end before it begins can never be served.
fn time_range_problem(lease: &Lease) -> Option<Assignment> {
    let (Some(b), Some(e)) = (&lease.spec.begin_time, &lease.spec.end_time) else {
        return None;
    };
    (b.0 >= e.0).then(|| Assignment::Invalid {
        reason: "InvalidTimeRange",
        message: format!(
            "spec.beginTime {} is not before spec.endTime {}; set an endTime after the beginTime",
            b.0, e.0
        ),
    })
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

    let approval = match approve(inp, &matching) {
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
            let non_spot: Vec<queue::Held<'_>> = ordered
                .iter()
                .filter(|a| !a.spot_access)
                .filter_map(|a| {
                    Some(queue::Held {
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
                && let Some(victim) = queue::victim(my_priority, &non_spot)
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

/// The exporters `lease` selects (its pinned exporter or its selector), enabled unless it allows
/// a disabled pinned one; None when its selector is invalid or it selects nothing at all. Leases
/// with the same pinned exporter, selector and `allowDisabled` select the same.
pub fn matching<'e>(lease: &Lease, exporters: &[&'e Exporter]) -> Option<Vec<&'e Exporter>> {
    let sel = &lease.spec.selector;
    let pinned = lease.spec.exporter_ref_name();
    if selector::validate(sel).is_err() || (selector::is_empty(sel) && pinned.is_none()) {
        return None;
    }
    Some(
        exporters
            .iter()
            .copied()
            .filter(|e| match pinned {
                Some(name) => {
                    name_of(e) == name
                        && (selector::is_empty(sel) || selector::matches_valid(sel, labels_of(e)))
                        && (e.spec.is_enabled() || lease.spec.allow_disabled == Some(true))
                }
                None => selector::matches_valid(sel, labels_of(e)) && e.spec.is_enabled(),
            })
            .collect(),
    )
}

/// A lease's candidates for the queue (docs/exporter.md, "Lease scheduling"), from the exporters
/// it selects ([`matching`]): those a policy rule approves for it (online or not), and its
/// priority, the highest of the rules that approve it. None when it can never get one.
pub fn approved_candidates(
    lease: &Lease,
    matching: &[&Exporter],
    policies: &[&ExporterAccessPolicy],
    client: Option<&Client>,
    now: Timestamp,
) -> Option<(i64, std::collections::BTreeSet<String>)> {
    // Approval reads the lease, its Client and the policies, not the other exporters.
    let inp = AssignInputs {
        lease,
        exporters: matching,
        active_leases: &[],
        policies,
        client,
        now,
        queue: None,
    };
    let approval = approve(&inp, matching).ok()?;
    let priority = approval.approved.iter().map(|a| a.priority).max()?;
    Some((
        priority,
        approval
            .approved
            .iter()
            .map(|a| a.name().to_string())
            .collect(),
    ))
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

/// Disabled exporters are dropped from selector matches; the input is not modified.
fn filter_out_disabled<'a>(exporters: &[&'a Exporter]) -> Vec<&'a Exporter> {
    exporters
        .iter()
        .copied()
        .filter(|e| e.spec.is_enabled())
        .collect()
}

struct Approval<'a> {
    approved: Vec<Approved<'a>>,
    /// Non-empty, de-duplicated descriptions of rules that matched an exporter but not the client.
    unmatched_descriptions: Vec<String>,
    /// OURS: policy entries that can never approve (a malformed selector or maximumDuration).
    problems: Vec<String>,
}

/// Policy approval (docs/exporter.md, "Lease assignment"): one approval per applicable rule. A
/// missing Client, needed only when policies exist, is `Pending/ClientNotFound` (OURS: upstream
/// retries with no condition, so the user sees nothing).
// The error is a decision, built once per pass; boxing it buys nothing.
#[allow(clippy::result_large_err)]
fn approve<'a>(
    inp: &AssignInputs<'_>,
    candidates: &[&'a Exporter],
) -> Result<Approval<'a>, Assignment> {
    let plain = |e: &'a Exporter| Approved {
        exporter: e,
        priority: 0,
        spot_access: false,
        existing_spot: None,
    };
    if inp.policies.is_empty() {
        return Ok(Approval {
            approved: candidates.iter().map(|e| plain(e)).collect(),
            unmatched_descriptions: Vec::new(),
            problems: Vec::new(),
        });
    }
    let client_name = &inp.lease.spec.client_ref.name;
    let Some(client) = inp.client else {
        let message = if client_name.is_empty() {
            "spec.clientRef.name is empty; the ExporterAccessPolicies in this namespace approve exporters per Client, so set it to an existing Client".to_string()
        } else {
            format!(
                "Client {client_name} was not found; the ExporterAccessPolicies in this namespace approve exporters per Client, so create it or fix spec.clientRef.name"
            )
        };
        return Err(Assignment::Pending {
            reason: "ClientNotFound",
            message,
        });
    };
    let mut problems = policy_problems(inp.policies);
    let client_labels = client.metadata.labels.clone().unwrap_or_default();
    let requested = requested_duration(inp.lease);
    let mut approved = Vec::new();
    let mut unmatched: Vec<String> = Vec::new();
    for exporter in candidates {
        let labels = labels_of(exporter);
        for policy in inp.policies {
            let exporter_selector = policy.spec.exporter_selector.clone().unwrap_or_default();
            if !selector::matches(&exporter_selector, labels).unwrap_or(false) {
                continue;
            }
            for rule in policy.spec.policies.iter().flatten() {
                let mut client_matched = false;
                for from in rule.from.iter().flatten() {
                    let client_selector = from.client_selector.clone().unwrap_or_default();
                    if !selector::matches(&client_selector, &client_labels).unwrap_or(false) {
                        continue;
                    }
                    client_matched = true;
                    if let Some(max) = &rule.maximum_duration {
                        // An unparsable limit approves nothing rather than everything.
                        match godur::parse_signed(max) {
                            Ok(max) if requested <= max => {}
                            _ => continue,
                        }
                    }
                    approved.push(Approved {
                        exporter,
                        priority: rule.priority.unwrap_or(0),
                        spot_access: rule.spot_access.unwrap_or(false),
                        existing_spot: None,
                    });
                }
                if let Some(desc) = rule.description.as_deref().filter(|d| !d.is_empty())
                    && !client_matched
                    && !unmatched.iter().any(|u| u == desc)
                {
                    unmatched.push(desc.to_string());
                }
            }
        }
    }
    problems.dedup();
    Ok(Approval {
        approved,
        unmatched_descriptions: unmatched,
        problems,
    })
}

/// Entries of the policies that can never approve anything, named for the NoAccess message.
fn policy_problems(policies: &[&ExporterAccessPolicy]) -> Vec<String> {
    let mut out = Vec::new();
    for p in policies {
        let name = p.metadata.name.as_deref().unwrap_or_default();
        if let Some(sel) = &p.spec.exporter_selector
            && let Err(e) = selector::validate(sel)
        {
            out.push(format!("{name}: spec.exporterSelector: {}", e.0));
        }
        for (i, rule) in p.spec.policies.iter().flatten().enumerate() {
            if let Some(max) = &rule.maximum_duration
                && godur::parse_signed(max).is_err()
            {
                out.push(format!(
                    "{name}: spec.policies[{i}].maximumDuration {max:?} is not a duration such as 8h or 30m"
                ));
            }
            for (j, from) in rule.from.iter().flatten().enumerate() {
                if let Some(sel) = &from.client_selector
                    && let Err(e) = selector::validate(sel)
                {
                    out.push(format!(
                        "{name}: spec.policies[{i}].from[{j}].clientSelector: {}",
                        e.0
                    ));
                }
            }
        }
    }
    out
}

/// Attach each candidate's active lease (its spot flag), the last one in list order as upstream.
/// One pass over the leases, not one per candidate: a pass runs under the ledger's lock.
fn attach_existing<'a>(mut approved: Vec<Approved<'a>>, active: &[&Lease]) -> Vec<Approved<'a>> {
    let mut held: std::collections::HashMap<&str, bool> = std::collections::HashMap::new();
    for status in active.iter().filter_map(|l| l.status.as_ref()) {
        if let Some(exporter) = status.exporter_ref_name().filter(|_| !status.ended) {
            held.insert(exporter, status.spot_access.unwrap_or(false));
        }
    }
    for a in &mut approved {
        a.existing_spot = held.get(a.name()).copied();
    }
    approved
}

/// Ordering: unleased first, non-spot first, higher priority first, then name.
fn order(mut approved: Vec<Approved<'_>>) -> Vec<Approved<'_>> {
    approved.sort_by(|a, b| {
        a.existing_spot
            .is_some()
            .cmp(&b.existing_spot.is_some())
            .then(a.spot_access.cmp(&b.spot_access))
            .then(b.priority.cmp(&a.priority))
            .then(a.name().cmp(b.name()))
    });
    approved
}

/// Ready filter (row 14): `Available`, `Unspecified` or absent, and (OURS) not owing afterLease.
pub fn is_ready(exporter: &Exporter) -> bool {
    let Some(status) = exporter.status.as_ref() else {
        return true;
    };
    let status_ok = matches!(
        status.exporter_status,
        None | Some(ExporterStatusValue::Available | ExporterStatusValue::Unspecified)
    );
    status_ok && !owes_after_lease(status)
}

/// docs/exporter.md, "Lease hooks: the assignment gate": the chosen exporter, read fresh just
/// before the write, must still be ready. Returns the Pending decision that replaces the assignment
/// when it is not.
pub fn gate_on_fresh(exporter: &Exporter) -> Option<Assignment> {
    if is_ready(exporter) {
        return None;
    }
    let mut message =
        "There are 1 online exporters, but none are ready (still cleaning up previous lease)"
            .to_string();
    message.push_str(&gate_suffix(std::iter::once(exporter)));
    Some(Assignment::Pending {
        reason: "NotReady",
        message,
    })
}

/// `; afterLease hook owed for lease <lease> by exporter <exporter> (and K more)` for the
/// gated exporters, first by name; empty when none is gated.
fn gate_suffix<'a>(exporters: impl Iterator<Item = &'a Exporter>) -> String {
    let mut gated: Vec<&Exporter> = exporters
        .filter(|e| e.status.as_ref().is_some_and(owes_after_lease))
        .collect();
    gated.sort_by(|a, b| name_of(a).cmp(name_of(b)));
    gated.dedup_by(|a, b| name_of(a) == name_of(b));
    let Some(first) = gated.first() else {
        return String::new();
    };
    let lease = first
        .status
        .as_ref()
        .and_then(|s| s.lease_hooks.as_ref())
        .and_then(|r| r.lease_ref.as_ref())
        .map_or("", |r| r.name.as_str());
    let mut out = format!(
        "; afterLease hook owed for lease {lease} by exporter {}",
        name_of(first)
    );
    if gated.len() > 1 {
        out.push_str(&format!(" (and {} more)", gated.len() - 1));
    }
    out
}

/// The result of one Lease pass (docs/exporter.md, "The Lease pass").
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseOutcome {
    pub status: LeaseStatus,
    pub requeue_after: Option<Duration>,
    /// The exporter assigned in this pass (acquisition success when persisted).
    pub assigned: Option<String>,
}

/// The expiration instant of a started lease: `spec.endTime`, else `spec.beginTime + duration`,
/// else `status.beginTime + duration`; None when no field gives one (expires at once).
pub fn expiration(lease: &Lease, duration: Option<SignedDuration>) -> Option<Timestamp> {
    let begun = lease.status.as_ref().and_then(|s| s.begin_time.as_ref())?;
    if let Some(end) = &lease.spec.end_time {
        return Some(end.0);
    }
    let d = duration?;
    Some(match &lease.spec.begin_time {
        Some(b) => b.0 + d,
        None => begun.0 + d,
    })
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

/// Whether a Lease is active for the purpose of `leaseRef` and the leased filter.
pub fn is_active(lease: &Lease) -> bool {
    !is_ended_label(lease) && lease.status.as_ref().is_some_and(|s| !s.ended)
}

/// The lease carries the ended label (its status may not say so yet).
pub fn is_ended_label(lease: &Lease) -> bool {
    lease
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.get(ENDED_LABEL).map(String::as_str) == Some(ENDED_VALUE))
}

/// The lease an exporter holds (docs/exporter.md, "The Exporter pass", step 3): active, assigned to
/// it; with several (which should not happen), the earliest `status.beginTime`, then the lowest
/// name. The bool reports that several matched.
pub fn held_lease<'a>(exporter_name: &str, leases: &'a [Lease]) -> (Option<&'a Lease>, bool) {
    let mut held: Vec<&Lease> = leases
        .iter()
        .filter(|l| {
            is_active(l)
                && l.status.as_ref().and_then(|s| s.exporter_ref_name()) == Some(exporter_name)
        })
        .collect();
    held.sort_by(|a, b| {
        let begin = |l: &Lease| {
            l.status
                .as_ref()
                .and_then(|s| s.begin_time.clone())
                .map(|t: Time| t.0)
        };
        match (begin(a), begin(b)) {
            (Some(x), Some(y)) => x.cmp(&y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => std::cmp::Ordering::Equal,
        }
        .then_with(|| a.metadata.name.cmp(&b.metadata.name))
    });
    (held.first().copied(), held.len() > 1)
}

#[cfg(test)]
#[path = "assign_tests.rs"]
mod tests;

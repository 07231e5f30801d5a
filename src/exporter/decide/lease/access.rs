//! Which exporters a Lease may have (docs/exporter.md, "Lease assignment"): those it selects,
//! enabled, approved by a policy rule for its Client (with the rule's priority and spot access),
//! and ready; and the order among them.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::Assignment;
use super::expiry::requested_duration;
use crate::exporter::crd::{Client, Exporter, ExporterAccessPolicy, ExporterStatusValue, Lease};
use crate::exporter::decide::exporter::owes_after_lease;
use crate::exporter::lease::selector;
use crate::godur;

#[derive(Debug, Clone)]
pub(super) struct Approved<'a> {
    pub(super) exporter: &'a Exporter,
    pub(super) priority: i64,
    pub(super) spot_access: bool,
    pub(super) existing_spot: Option<bool>,
}

impl Approved<'_> {
    pub(super) fn name(&self) -> &str {
        self.exporter.metadata.name.as_deref().unwrap_or_default()
    }
}

pub(super) fn name_of(e: &Exporter) -> &str {
    e.metadata.name.as_deref().unwrap_or_default()
}

static NO_LABELS: BTreeMap<String, String> = std::collections::BTreeMap::new();

pub(super) fn labels_of(e: &Exporter) -> &BTreeMap<String, String> {
    e.metadata.labels.as_ref().unwrap_or(&NO_LABELS)
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
) -> Option<(i64, BTreeSet<String>)> {
    // Approval reads the lease, its Client and the policies, not the other exporters.
    let approval = approve(lease, policies, client, matching).ok()?;
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

/// Disabled exporters are dropped from selector matches; the input is not modified.
pub(super) fn filter_out_disabled<'a>(exporters: &[&'a Exporter]) -> Vec<&'a Exporter> {
    exporters
        .iter()
        .copied()
        .filter(|e| e.spec.is_enabled())
        .collect()
}

pub(super) struct Approval<'a> {
    pub(super) approved: Vec<Approved<'a>>,
    /// Non-empty, de-duplicated descriptions of rules that matched an exporter but not the client.
    pub(super) unmatched_descriptions: Vec<String>,
    /// OURS: policy entries that can never approve (a malformed selector or maximumDuration).
    pub(super) problems: Vec<String>,
}

/// Policy approval (docs/exporter.md, "Lease assignment"): one approval per applicable rule. A
/// missing Client, needed only when policies exist, is `Pending/ClientNotFound` (OURS: upstream
/// retries with no condition, so the user sees nothing).
// The error is a decision, built once per pass; boxing it buys nothing.
#[allow(clippy::result_large_err)]
pub(super) fn approve<'a>(
    lease: &Lease,
    policies: &[&ExporterAccessPolicy],
    client: Option<&Client>,
    candidates: &[&'a Exporter],
) -> Result<Approval<'a>, Assignment> {
    let plain = |e: &'a Exporter| Approved {
        exporter: e,
        priority: 0,
        spot_access: false,
        existing_spot: None,
    };
    if policies.is_empty() {
        return Ok(Approval {
            approved: candidates.iter().map(|e| plain(e)).collect(),
            unmatched_descriptions: Vec::new(),
            problems: Vec::new(),
        });
    }
    let client_name = &lease.spec.client_ref.name;
    let Some(client) = client else {
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
    let mut problems = policy_problems(policies);
    let client_labels = client.metadata.labels.clone().unwrap_or_default();
    let requested = requested_duration(lease);
    let mut approved = Vec::new();
    let mut unmatched: Vec<String> = Vec::new();
    for exporter in candidates {
        let labels = labels_of(exporter);
        for policy in policies {
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
pub(super) fn attach_existing<'a>(
    mut approved: Vec<Approved<'a>>,
    active: &[&Lease],
) -> Vec<Approved<'a>> {
    let mut held: HashMap<&str, bool> = HashMap::new();
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
pub(super) fn order(mut approved: Vec<Approved<'_>>) -> Vec<Approved<'_>> {
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
pub(super) fn gate_suffix<'a>(exporters: impl Iterator<Item = &'a Exporter>) -> String {
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

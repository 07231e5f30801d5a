//! Unit tests of the Lease decisions (docs/exporter.md, "Lease assignment", "The Lease pass",
//! "Lease hooks: the assignment gate"): upstream's decision matrix, ordering, pending leases
//! without a timer, scheduling and expiry, and the afterLease gate.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::api::ObjectMeta;

use super::*;
use crate::conditions::Desired;
use crate::exporter::crd::{
    ClientSpec, ExporterAccessPolicySpec, ExporterSpec, ExporterStatus, ExporterStatusValue, From,
    HookPhase, HookState, LeaseHooks, LeaseSpec, LeaseStatus, LocalObjectReference, Policy,
};
use crate::exporter::decide::lease::access::filter_out_disabled;
use crate::exporter::decide::lease::access::gate_on_fresh;
use crate::exporter::decide::lease::expiry::{held_lease, is_active};
use crate::exporter::decide::lease::preempt::preempted_status;
use crate::exporter::decide::lease::status::build_status;
use crate::exporter::decide::lease::{
    ENDED, ENDED_LABEL, ENDED_VALUE, INVALID, PENDING, PREEMPTED, READY, UNSATISFIABLE,
};

const NOW: i64 = 1_800_000_000;

fn ts(s: i64) -> Timestamp {
    Timestamp::from_second(s).unwrap()
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn meta(name: &str, l: &[(&str, &str)]) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some("lab".into()),
        labels: Some(labels(l)),
        generation: Some(1),
        ..Default::default()
    }
}

/// An exporter that is registered and online, reporting `Available`.
fn online(name: &str, l: &[(&str, &str)]) -> Exporter {
    let mut conds = Vec::new();
    let now = conditions::time(ts(NOW));
    conditions::set(
        &mut conds,
        Desired::new(ONLINE, true, "Seen", ""),
        Some(1),
        &now,
    );
    conditions::set(
        &mut conds,
        Desired::new(REGISTERED, true, "Register", ""),
        Some(1),
        &now,
    );
    Exporter {
        metadata: meta(name, l),
        spec: ExporterSpec::default(),
        status: Some(ExporterStatus {
            conditions: Some(conds),
            exporter_status: Some(ExporterStatusValue::Available),
            devices: Some(vec![]),
            ..Default::default()
        }),
    }
}

fn offline(name: &str, l: &[(&str, &str)]) -> Exporter {
    Exporter {
        metadata: meta(name, l),
        spec: ExporterSpec::default(),
        status: None,
    }
}

fn disabled(mut e: Exporter) -> Exporter {
    e.spec.enabled = Some(false);
    e
}

fn with_status(mut e: Exporter, s: ExporterStatusValue) -> Exporter {
    e.status.as_mut().unwrap().exporter_status = Some(s);
    e
}

fn owing(mut e: Exporter, lease: &str) -> Exporter {
    let s = e.status.as_mut().unwrap();
    s.records_lease_hooks = Some(true);
    s.lease_hooks = Some(LeaseHooks {
        lease_ref: Some(LocalObjectReference::new(lease)),
        lease_uid: Some("u".into()),
        client_name: Some("c".into()),
        before_lease: None,
        after_lease: Some(HookState {
            phase: HookPhase::Running,
            attempts: Some(1),
            last_transition_time: None,
            message: None,
            on_failure: None,
        }),
    });
    e
}

fn lease_sel(l: &[(&str, &str)]) -> Lease {
    Lease {
        metadata: meta("mine", &[]),
        spec: LeaseSpec {
            client_ref: LocalObjectReference::new("c1"),
            selector: LabelSelector {
                match_labels: Some(labels(l)),
                match_expressions: None,
            },
            duration: Some("1h".into()),
            ..Default::default()
        },
        status: None,
    }
}

fn lease_pinned(name: &str) -> Lease {
    let mut l = lease_sel(&[]);
    l.spec.exporter_ref = Some(LocalObjectReference::new(name));
    l
}

fn active_on(name: &str, exporter: &str, spot: bool) -> Lease {
    let mut l = lease_sel(&[("x", "y")]);
    l.metadata.name = Some(name.into());
    l.status = Some(LeaseStatus {
        exporter_ref: Some(LocalObjectReference::new(exporter)),
        spot_access: spot.then_some(true),
        begin_time: Some(Time(ts(NOW - 10))),
        ..Default::default()
    });
    l
}

fn client(l: &[(&str, &str)]) -> Client {
    client_named("c1", l)
}

fn client_named(name: &str, l: &[(&str, &str)]) -> Client {
    Client {
        metadata: meta(name, l),
        spec: ClientSpec::default(),
        status: None,
    }
}

fn policy(exporter_sel: &[(&str, &str)], rules: Vec<Policy>) -> ExporterAccessPolicy {
    ExporterAccessPolicy {
        metadata: meta("p", &[]),
        spec: ExporterAccessPolicySpec {
            exporter_selector: Some(LabelSelector {
                match_labels: Some(labels(exporter_sel)),
                match_expressions: None,
            }),
            policies: Some(rules),
        },
        status: None,
    }
}

fn rule(client_sel: &[(&str, &str)], priority: i64, spot: bool, desc: Option<&str>) -> Policy {
    Policy {
        description: desc.map(str::to_string),
        from: Some(vec![From {
            client_selector: Some(LabelSelector {
                match_labels: Some(labels(client_sel)),
                match_expressions: None,
            }),
        }]),
        maximum_duration: None,
        priority: (priority != 0).then_some(priority),
        spot_access: spot.then_some(true),
    }
}

struct World {
    exporters: Vec<Exporter>,
    active: Vec<Lease>,
    policies: Vec<ExporterAccessPolicy>,
    client: Option<Client>,
}

impl World {
    fn new(exporters: Vec<Exporter>) -> Self {
        World {
            exporters,
            active: vec![],
            policies: vec![],
            client: Some(client(&[])),
        }
    }

    fn decide(&self, lease: &Lease) -> Assignment {
        decide_assignment(&AssignInputs {
            lease,
            exporters: &self.exporters.iter().collect::<Vec<_>>(),
            active_leases: &self.active.iter().collect::<Vec<_>>(),
            policies: &self.policies.iter().collect::<Vec<_>>(),
            client: self.client.as_ref(),
            now: ts(NOW),
            queue: None,
        })
    }
}

fn assigned(a: &Assignment) -> &str {
    match a {
        Assignment::Assign { exporter, .. } => exporter,
        other => panic!("expected an assignment, got {other:?}"),
    }
}

fn reason_of(a: Assignment) -> (&'static str, &'static str, String) {
    match a {
        Assignment::Invalid { reason, message } => (INVALID, reason, message),
        Assignment::Unsatisfiable { reason, message } => (UNSATISFIABLE, reason, message),
        Assignment::Pending { reason, message } => (PENDING, reason, message),
        // Upstream's message, without the place in the queue that ucm appends.
        Assignment::Queued {
            reason, message, ..
        } => {
            let upstream = message.split("; position ").next().unwrap_or_default();
            (PENDING, reason, upstream.to_string())
        }
        other => panic!("expected a condition, got {other:?}"),
    }
}

#[test]
fn invalid_without_selector_or_exporter_ref() {
    let w = World::new(vec![online("a", &[])]);
    let (t, r, m) = reason_of(w.decide(&lease_sel(&[])));
    assert_eq!((t, r), (INVALID, "InvalidSelector"));
    assert_eq!(
        m,
        "The selector for the lease is empty, a selector is required"
    );
    // An unusable selector is also Invalid rather than a retry loop.
    let mut l = lease_sel(&[]);
    l.spec.selector.match_expressions = Some(vec![LabelSelectorRequirement {
        key: "k".into(),
        operator: "Bogus".into(),
        values: None,
    }]);
    assert_eq!(reason_of(w.decide(&l)).1, "InvalidSelector");
}

#[test]
fn pinned_with_empty_selector_is_acquired() {
    let w = World::new(vec![online("a", &[]), online("b", &[])]);
    assert_eq!(assigned(&w.decide(&lease_pinned("b"))), "b");
}

#[test]
fn pinned_not_found_and_selector_mismatch() {
    let w = World::new(vec![online("a", &[("board", "rpi")])]);
    let (t, r, m) = reason_of(w.decide(&lease_pinned("zz")));
    assert_eq!((t, r), (UNSATISFIABLE, "ExporterNotFound"));
    assert_eq!(m, "Requested exporter zz was not found");
    let mut l = lease_pinned("a");
    l.spec.selector.match_labels = Some(labels(&[("board", "qemu")]));
    let (t, r, m) = reason_of(w.decide(&l));
    assert_eq!((t, r), (UNSATISFIABLE, "SelectorMismatch"));
    assert_eq!(m, "Requested exporter a does not match selector board=qemu");
    l.spec.selector.match_labels = Some(labels(&[("board", "rpi")]));
    assert_eq!(assigned(&w.decide(&l)), "a");
}

#[test]
fn pinned_disabled_needs_allow_disabled() {
    let w = World::new(vec![disabled(online("a", &[]))]);
    let mut l = lease_pinned("a");
    let (t, r, m) = reason_of(w.decide(&l));
    assert_eq!((t, r), (UNSATISFIABLE, "ExporterDisabled"));
    assert!(
        m.contains("spec.allowDisabled") && m.contains("--allow-disabled"),
        "{m}"
    );
    l.spec.allow_disabled = Some(true);
    assert_eq!(assigned(&w.decide(&l)), "a");
}

#[test]
fn selector_skips_disabled_and_reports_all_disabled() {
    let w = World::new(vec![
        disabled(online("a", &[("t", "x")])),
        online("b", &[("t", "x")]),
    ]);
    assert_eq!(assigned(&w.decide(&lease_sel(&[("t", "x")]))), "b");
    let w = World::new(vec![
        disabled(online("a", &[("t", "x")])),
        disabled(online("b", &[("t", "x")])),
    ]);
    let (t, r, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert_eq!((t, r), (UNSATISFIABLE, "AllDisabled"));
    assert_eq!(m, "All 2 exporters matching the selector are disabled");
}

#[test]
fn filtering_disabled_does_not_mutate_input() {
    let a = disabled(online("a", &[]));
    let b = online("b", &[]);
    let input = vec![&a, &b];
    let out = filter_out_disabled(&input);
    assert_eq!(out.len(), 1);
    assert_eq!(input.len(), 2);
    assert_eq!(name_of(input[0]), "a");
}

#[test]
fn no_match_is_no_access() {
    let w = World::new(vec![online("a", &[("t", "x")])]);
    let (t, r, m) = reason_of(w.decide(&lease_sel(&[("t", "nope")])));
    assert_eq!((t, r), (UNSATISFIABLE, "NoAccess"));
    assert_eq!(
        m,
        "While there are 0 exporters matching the selector, none of them are approved by any policy for your client"
    );
}

#[test]
fn no_access_lists_unique_non_empty_descriptions() {
    let mut w = World::new(vec![online("a", &[("t", "x")]), online("b", &[("t", "x")])]);
    w.policies = vec![policy(
        &[("t", "x")],
        vec![
            rule(&[("team", "red")], 0, false, Some("Requires red team")),
            rule(&[("team", "blue")], 0, false, Some("")),
            rule(&[("team", "green")], 0, false, None),
        ],
    )];
    w.client = Some(client(&[("team", "yellow")]));
    let (_, r, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert_eq!(r, "NoAccess");
    assert_eq!(
        m,
        "While there are 2 exporters matching the selector, none of them are approved by any policy for your client. Matching policies: Requires red team"
    );
    // Without descriptions, no suffix.
    w.policies = vec![policy(
        &[("t", "x")],
        vec![rule(&[("team", "red")], 0, false, None)],
    )];
    let (_, _, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert!(m.ends_with("for your client"), "{m}");
    // Descriptions are capped at 4096 bytes plus an ellipsis.
    let long = "d".repeat(5000);
    w.policies = vec![policy(
        &[("t", "x")],
        vec![rule(&[("team", "red")], 0, false, Some(&long))],
    )];
    let (_, _, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert!(m.ends_with(&format!("{}...", "d".repeat(10))));
    assert!(m.len() < 4096 + 200);
}

#[test]
fn matching_policy_with_description_succeeds_with_priority() {
    let mut w = World::new(vec![online("a", &[("t", "x")])]);
    w.policies = vec![policy(
        &[("t", "x")],
        vec![rule(&[("team", "red")], 7, false, Some("red only"))],
    )];
    w.client = Some(client(&[("team", "red")]));
    assert_eq!(
        w.decide(&lease_sel(&[("t", "x")])),
        Assignment::Assign {
            exporter: "a".into(),
            priority: 7,
            spot_access: false
        }
    );
}

#[test]
fn policy_maximum_duration_skips_rule_silently() {
    let mut w = World::new(vec![online("a", &[("t", "x")])]);
    let mut r = rule(&[], 0, false, Some("short"));
    r.maximum_duration = Some("30m".into());
    w.policies = vec![policy(&[("t", "x")], vec![r])];
    let (_, reason, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert_eq!(reason, "NoAccess");
    // The client matched, so the description is not listed (#460).
    assert!(!m.contains("short"), "{m}");
    let mut l = lease_sel(&[("t", "x")]);
    l.spec.duration = Some("20m".into());
    assert_eq!(assigned(&w.decide(&l)), "a");
}

#[test]
fn missing_client_with_policies_is_pending_client_not_found() {
    let mut w = World::new(vec![online("a", &[("t", "x")])]);
    w.policies = vec![policy(&[("t", "x")], vec![rule(&[], 0, false, None)])];
    w.client = None;
    let (t, reason, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert_eq!((t, reason), (PENDING, "ClientNotFound"));
    assert!(m.contains("Client c1 was not found"), "{m}");
    assert!(m.contains("fix spec.clientRef.name"), "{m}");
    let mut l = lease_sel(&[("t", "x")]);
    l.spec.client_ref = LocalObjectReference::new("");
    let (_, reason, m) = reason_of(w.decide(&l));
    assert_eq!(reason, "ClientNotFound");
    assert!(m.starts_with("spec.clientRef.name is empty"), "{m}");
    // Without policies the Client is not needed.
    w.policies.clear();
    assert_eq!(assigned(&w.decide(&l)), "a");
}

#[test]
fn unusable_policy_entries_are_named_in_no_access() {
    let mut w = World::new(vec![online("a", &[("t", "x")])]);
    let mut r = rule(&[], 0, false, None);
    r.maximum_duration = Some("forever".into());
    let mut p = policy(&[("t", "x")], vec![r]);
    p.metadata.name = Some("lab".into());
    let mut broken = policy(&[("bad key!", "x")], vec![rule(&[], 0, false, None)]);
    broken.metadata.name = Some("typo".into());
    w.policies = vec![p, broken];
    let (_, reason, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert_eq!(reason, "NoAccess");
    assert!(
        m.contains("lab: spec.policies[0].maximumDuration \"forever\" is not a duration"),
        "{m}"
    );
    assert!(
        m.contains("typo: spec.exporterSelector: key: Invalid value: \"bad key!\""),
        "{m}"
    );
}

#[test]
fn a_lease_that_ends_before_it_begins_is_invalid() {
    let w = World::new(vec![online("a", &[("t", "x")])]);
    let mut l = lease_sel(&[("t", "x")]);
    l.spec.duration = None;
    l.spec.begin_time = Some(Time(ts(NOW + 200)));
    l.spec.end_time = Some(Time(ts(NOW + 100)));
    let (t, reason, m) = reason_of(w.decide(&l));
    assert_eq!((t, reason), (INVALID, "InvalidTimeRange"));
    assert!(m.contains("is not before spec.endTime"), "{m}");
    l.spec.end_time = Some(Time(ts(NOW + 300)));
    assert!(matches!(w.decide(&l), Assignment::Scheduled(_)));
}

#[test]
fn offline_with_and_without_approval_and_mixed() {
    let w = World::new(vec![
        offline("a", &[("t", "x")]),
        offline("b", &[("t", "x")]),
    ]);
    let (t, r, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert_eq!((t, r), (PENDING, "Offline"));
    assert_eq!(
        m,
        "While there are 2 available exporters (i.e. a), none of them are online"
    );
    let mut w = World::new(vec![offline("a", &[("t", "x")])]);
    w.policies = vec![policy(&[("t", "x")], vec![rule(&[], 0, false, None)])];
    assert_eq!(reason_of(w.decide(&lease_sel(&[("t", "x")]))).1, "Offline");
    let w = World::new(vec![
        offline("a", &[("t", "x")]),
        online("b", &[("t", "x")]),
    ]);
    assert_eq!(assigned(&w.decide(&lease_sel(&[("t", "x")]))), "b");
}

#[test]
fn not_ready_hooks_and_ready_one_wins() {
    let w = World::new(vec![
        with_status(
            online("a", &[("t", "x")]),
            ExporterStatusValue::AfterLeaseHook,
        ),
        with_status(
            online("b", &[("t", "x")]),
            ExporterStatusValue::BeforeLeaseHook,
        ),
    ]);
    let (t, r, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert_eq!((t, r), (PENDING, "NotReady"));
    assert_eq!(
        m,
        "There are 2 online exporters, but none are ready (still cleaning up previous lease)"
    );
    assert!(m.contains("none are ready"));
    let w = World::new(vec![
        with_status(
            online("a", &[("t", "x")]),
            ExporterStatusValue::AfterLeaseHookFailed,
        ),
        with_status(online("b", &[("t", "x")]), ExporterStatusValue::Unspecified),
    ]);
    assert_eq!(assigned(&w.decide(&lease_sel(&[("t", "x")]))), "b");
    // Absent exporterStatus (old exporters) is ready.
    let mut old = online("c", &[("t", "x")]);
    old.status.as_mut().unwrap().exporter_status = None;
    assert_eq!(
        assigned(&World::new(vec![old]).decide(&lease_sel(&[("t", "x")]))),
        "c"
    );
}

#[test]
fn not_available_then_acquired_after_release() {
    let mut w = World::new(vec![online("a", &[("t", "x")])]);
    w.active = vec![active_on("other", "a", false)];
    let (t, r, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert_eq!((t, r), (PENDING, "NotAvailable"));
    assert_eq!(
        m,
        "There are 1 approved exporters, (i.e. a) but all of them are already leased"
    );
    w.active.clear();
    assert_eq!(assigned(&w.decide(&lease_sel(&[("t", "x")]))), "a");
}

#[test]
fn ordering_leased_spot_priority_name() {
    // Unleased before leased-by-spot (which a non-spot lease preempts only when nothing is
    // free).
    let mut w = World::new(vec![online("a", &[("t", "x")]), online("b", &[("t", "x")])]);
    w.active = vec![active_on("s", "a", true)];
    assert_eq!(assigned(&w.decide(&lease_sel(&[("t", "x")]))), "b");
    // Only a spot-leased exporter left, and no queue: NotAvailable (no preemption without it).
    let mut w = World::new(vec![online("a", &[("t", "x")])]);
    w.active = vec![active_on("s", "a", true)];
    let (_, r, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert_eq!(r, "NotAvailable");
    assert_eq!(
        m,
        "There are 1 approved exporters, (i.e. a) but all of them are already leased"
    );
    // Priority, then name.
    let mut w = World::new(vec![
        online("a", &[("t", "x"), ("p", "low")]),
        online("b", &[("t", "x"), ("p", "high")]),
        online("c", &[("t", "x"), ("p", "high")]),
    ]);
    w.policies = vec![
        policy(&[("p", "low")], vec![rule(&[], 1, false, None)]),
        policy(&[("p", "high")], vec![rule(&[], 5, false, None)]),
    ];
    assert_eq!(assigned(&w.decide(&lease_sel(&[("t", "x")]))), "b");
    // Non-spot before spot even at lower priority.
    w.policies = vec![
        policy(&[("p", "low")], vec![rule(&[], 1, false, None)]),
        policy(&[("p", "high")], vec![rule(&[], 9, true, None)]),
    ];
    assert_eq!(
        w.decide(&lease_sel(&[("t", "x")])),
        Assignment::Assign {
            exporter: "a".into(),
            priority: 1,
            spot_access: false
        }
    );
    // Only spot access possible: granted as spot (OURS: upstream refuses it as SpotAccess).
    w.policies = vec![policy(&[("t", "x")], vec![rule(&[], 9, true, None)])];
    assert_eq!(
        w.decide(&lease_sel(&[("t", "x")])),
        Assignment::Assign {
            exporter: "a".into(),
            priority: 9,
            spot_access: true
        }
    );
}

#[test]
fn ordering_mixed_case_is_stable_and_total() {
    let e = [
        online("d", &[]),
        online("a", &[]),
        online("c", &[]),
        online("b", &[]),
    ];
    let mk = |i: usize, p: i64, spot: bool, leased: Option<bool>| Approved {
        exporter: &e[i],
        priority: p,
        spot_access: spot,
        existing_spot: leased,
    };
    let sorted = order(vec![
        mk(0, 1, false, Some(true)),
        mk(1, 1, true, None),
        mk(2, 5, false, None),
        mk(3, 5, false, None),
    ]);
    let names: Vec<_> = sorted.iter().map(|a| a.name().to_string()).collect();
    assert_eq!(names, ["b", "c", "a", "d"]);
}

#[test]
fn gate_makes_owing_exporter_not_ready_also_pinned() {
    let w = World::new(vec![
        owing(online("b", &[("t", "x")]), "old-2"),
        owing(online("a", &[("t", "x")]), "old-1"),
    ]);
    let (t, r, m) = reason_of(w.decide(&lease_sel(&[("t", "x")])));
    assert_eq!((t, r), (PENDING, "NotReady"));
    assert_eq!(
        m,
        "There are 2 online exporters, but none are ready (still cleaning up previous lease); afterLease hook owed for lease old-1 by exporter a (and 1 more)"
    );
    // Pinned with allowDisabled is gated too.
    let w = World::new(vec![disabled(owing(online("a", &[]), "old"))]);
    let mut l = lease_pinned("a");
    l.spec.allow_disabled = Some(true);
    let (_, r, m) = reason_of(w.decide(&l));
    assert_eq!(r, "NotReady");
    assert!(
        m.ends_with("; afterLease hook owed for lease old by exporter a"),
        "{m}"
    );
    // A non-recording exporter with the same record is not gated.
    let mut e = owing(online("a", &[("t", "x")]), "old");
    e.status.as_mut().unwrap().records_lease_hooks = Some(false);
    assert_eq!(
        assigned(&World::new(vec![e]).decide(&lease_sel(&[("t", "x")]))),
        "a"
    );
    // Once afterLease is terminal, it is leased.
    let mut e = owing(online("a", &[("t", "x")]), "old");
    e.status
        .as_mut()
        .unwrap()
        .lease_hooks
        .as_mut()
        .unwrap()
        .after_lease
        .as_mut()
        .unwrap()
        .phase = HookPhase::Succeeded;
    assert_eq!(
        assigned(&World::new(vec![e]).decide(&lease_sel(&[("t", "x")]))),
        "a"
    );
}

#[test]
fn scheduled_lease_waits_for_begin_time() {
    let w = World::new(vec![online("a", &[("t", "x")])]);
    let mut l = lease_sel(&[("t", "x")]);
    l.spec.begin_time = Some(Time(ts(NOW + 90)));
    assert_eq!(w.decide(&l), Assignment::Scheduled(Duration::from_secs(90)));
    l.spec.begin_time = Some(Time(ts(NOW)));
    assert_eq!(assigned(&w.decide(&l)), "a");
}

fn cond<'a>(
    s: &'a LeaseStatus,
    t: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    conditions::find(s.conditions.as_deref().unwrap_or_default(), t)
}

fn assign_a() -> Option<Assignment> {
    Some(Assignment::Assign {
        exporter: "a".into(),
        priority: 0,
        spot_access: false,
    })
}

#[test]
fn assignment_starts_the_lease() {
    let l = lease_sel(&[("t", "x")]);
    let out = build_status(&l, assign_a(), ts(NOW));
    assert_eq!(out.assigned.as_deref(), Some("a"));
    let s = &out.status;
    assert_eq!(s.exporter_ref_name(), Some("a"));
    assert_eq!(s.begin_time, Some(Time(ts(NOW))));
    let ready = cond(s, READY).unwrap();
    assert_eq!(
        (
            ready.status.as_str(),
            ready.reason.as_str(),
            ready.message.as_str()
        ),
        (
            "True",
            "Ready",
            "An exporter has been acquired for the client"
        )
    );
    assert!(!s.ended);
    assert_eq!(s.priority, None);
    assert_eq!(s.spot_access, None);
    // Expires after spec.duration (1 h) from status.beginTime.
    assert_eq!(out.requeue_after, Some(Duration::from_secs(3600)));
}

#[test]
fn pending_keeps_its_value_after_acquisition() {
    let mut l = lease_sel(&[("t", "x")]);
    let pending = Some(Assignment::Pending {
        reason: "Offline",
        message: "m".into(),
    });
    let out = build_status(&l, pending, ts(NOW));
    // A pending lease waits on its triggers, not on a timer.
    assert_eq!(out.requeue_after, None);
    l.status = Some(out.status);
    let out = build_status(&l, assign_a(), ts(NOW + 5));
    let p = cond(&out.status, PENDING).unwrap();
    assert_eq!((p.status.as_str(), p.reason.as_str()), ("True", "Offline"));
}

#[test]
fn unsatisfiable_and_invalid_end_the_lease_at_once() {
    let l = lease_sel(&[("t", "x")]);
    for a in [
        Assignment::Unsatisfiable {
            reason: "NoAccess",
            message: "m".into(),
        },
        Assignment::Invalid {
            reason: "InvalidSelector",
            message: "m".into(),
        },
    ] {
        let out = build_status(&l, Some(a), ts(NOW));
        assert!(out.status.ended);
        assert_eq!(out.status.end_time, Some(Time(ts(NOW))));
        assert_eq!(out.requeue_after, None);
    }
}

#[test]
fn release_before_and_after_start() {
    let mut l = lease_sel(&[("t", "x")]);
    l.spec.release = Some(true);
    let pending = Some(Assignment::Pending {
        reason: "Offline",
        message: "m".into(),
    });
    let out = build_status(&l, pending, ts(NOW));
    assert!(out.status.ended);
    let r = cond(&out.status, READY).unwrap();
    assert_eq!(
        (r.status.as_str(), r.reason.as_str(), r.message.as_str()),
        ("False", "Released", "The lease was marked for release")
    );
    assert_eq!(out.requeue_after, None);
    // Early release of a running lease.
    let mut l = active_on("mine", "a", false);
    l.spec.release = Some(true);
    let out = build_status(&l, None, ts(NOW));
    assert!(out.status.ended);
    assert_eq!(cond(&out.status, READY).unwrap().reason, "Released");
    assert_eq!(
        out.status.exporter_ref_name(),
        Some("a"),
        "exporterRef is kept after the end"
    );
}

#[test]
fn expiry_sources() {
    // status.beginTime + duration.
    let mut l = active_on("mine", "a", false);
    l.spec.duration = Some("60s".into());
    let begin = NOW - 10;
    let out = build_status(&l, None, ts(NOW));
    assert_eq!(out.requeue_after, Some(Duration::from_secs(50)));
    let out = build_status(&l, None, ts(begin + 60));
    assert!(out.status.ended);
    let r = cond(&out.status, READY).unwrap();
    assert_eq!(
        (r.reason.as_str(), r.message.as_str()),
        ("Expired", "The lease has expired")
    );
    // spec.beginTime + duration (scheduled lease).
    l.spec.begin_time = Some(Time(ts(NOW - 30)));
    assert_eq!(
        build_status(&l, None, ts(NOW)).requeue_after,
        Some(Duration::from_secs(30))
    );
    // spec.endTime wins.
    l.spec.end_time = Some(Time(ts(NOW + 5)));
    assert_eq!(
        build_status(&l, None, ts(NOW)).requeue_after,
        Some(Duration::from_secs(5))
    );
    // A past endTime expires at once.
    l.spec.end_time = Some(Time(ts(NOW - 1)));
    assert!(build_status(&l, None, ts(NOW)).status.ended);
    // Neither duration nor endTime: expires immediately.
    let mut l = active_on("mine", "a", false);
    l.spec.duration = None;
    assert!(build_status(&l, None, ts(NOW)).status.ended);
    // A lease created with only endTime starts now and expires at endTime.
    let mut l = lease_sel(&[("t", "x")]);
    l.spec.duration = None;
    l.spec.end_time = Some(Time(ts(NOW + 100)));
    let out = build_status(&l, assign_a(), ts(NOW));
    assert!(!out.status.ended);
    assert_eq!(out.requeue_after, Some(Duration::from_secs(100)));
}

#[test]
fn bad_duration_is_invalid() {
    let w = World::new(vec![online("a", &[("t", "x")])]);
    for (bad, says) in [
        ("forever", "invalid duration"),
        ("-1h", "is not positive"),
        ("0s", "is not positive"),
    ] {
        let mut l = lease_sel(&[("t", "x")]);
        l.spec.duration = Some(bad.into());
        // No exporter is taken for it.
        let decided = w.decide(&l);
        assert!(matches!(
            decided,
            Assignment::Invalid {
                reason: "InvalidDuration",
                ..
            }
        ));
        let out = build_status(&l, Some(decided), ts(NOW));
        assert!(out.status.ended, "{bad}");
        assert!(out.status.exporter_ref.is_none(), "{bad}");
        let c = cond(&out.status, INVALID).unwrap();
        assert_eq!(c.reason, "InvalidDuration");
        assert!(c.message.contains(says), "{bad}: {}", c.message);
    }
}

#[test]
fn ended_lease_is_left_alone() {
    let mut l = active_on("mine", "a", false);
    l.status.as_mut().unwrap().ended = true;
    l.status.as_mut().unwrap().end_time = Some(Time(ts(NOW - 100)));
    let out = build_status(&l, None, ts(NOW));
    let mut expected = l.status.clone().unwrap();
    expected.conditions = Some(vec![]);
    assert_eq!(out.status, expected);
    assert_eq!(out.requeue_after, None);
}

#[test]
fn second_pass_over_a_running_lease_changes_nothing() {
    let l = lease_sel(&[("t", "x")]);
    let first = build_status(&l, assign_a(), ts(NOW));
    let mut l2 = l.clone();
    l2.status = Some(first.status.clone());
    let second = build_status(&l2, None, ts(NOW + 7));
    assert_eq!(second.status, first.status);
    assert_eq!(second.requeue_after, Some(Duration::from_secs(3600 - 7)));
}

#[test]
fn active_and_held_lease_selection() {
    let a1 = active_on("z-lease", "a", false);
    let mut a2 = active_on("b-lease", "a", false);
    a2.status.as_mut().unwrap().begin_time = Some(Time(ts(NOW - 100)));
    let mut ended = active_on("ended", "a", false);
    ended.status.as_mut().unwrap().ended = true;
    let mut labelled = active_on("labelled", "a", false);
    labelled.metadata.labels = Some(labels(&[(ENDED_LABEL, ENDED_VALUE)]));
    let other = active_on("other", "b", false);
    assert!(is_active(&a1));
    assert!(!is_active(&ended) && !is_active(&labelled));
    let leases = vec![a1.clone(), ended, labelled, other, a2];
    let (held, several) = held_lease("a", &leases);
    assert_eq!(held.unwrap().metadata.name.as_deref(), Some("b-lease"));
    assert!(several);
    let (held, several) = held_lease("a", &leases[..1]);
    assert_eq!(held.unwrap().metadata.name.as_deref(), Some("z-lease"));
    assert!(!several);
    assert!(held_lease("c", &leases).0.is_none());
}

#[test]
fn fresh_gate_replaces_a_stale_assignment() {
    assert_eq!(gate_on_fresh(&online("a", &[])), None);
    let (t, r, m) = reason_of(gate_on_fresh(&owing(online("a", &[]), "prev")).unwrap());
    assert_eq!((t, r), (PENDING, "NotReady"));
    assert!(
        m.ends_with("; afterLease hook owed for lease prev by exporter a"),
        "{m}"
    );
    let busy = with_status(online("a", &[]), ExporterStatusValue::LeaseReady);
    assert_eq!(reason_of(gate_on_fresh(&busy).unwrap()).1, "NotReady");
}

// ---- The queue (docs/exporter.md, "Lease scheduling") ----

fn queued_lease(name: &str, created: i64) -> Lease {
    let mut l = lease_sel(&[("t", "x")]);
    l.metadata.name = Some(name.into());
    l.metadata.creation_timestamp = Some(Time(ts(NOW + created)));
    l
}

impl World {
    /// Decides `lease` with the queue of the waiting leases among `others` (and `lease`).
    fn decide_queued(&self, lease: &Lease, others: &[&Lease], grace: i64) -> Decision {
        let mut all: Vec<&Lease> = others.to_vec();
        all.push(lease);
        all.extend(self.active.iter());
        let exporters: Vec<&Exporter> = self.exporters.iter().collect();
        let policies: Vec<&ExporterAccessPolicy> = self.policies.iter().collect();
        let client = self.client.as_ref();
        let plain = client_named("plain", &[]);
        let lookup = |name: &str| {
            if name == "plain" {
                Some(&plain)
            } else {
                client
            }
        };
        let field = queue::waiting(&exporters, &all, &policies, &lookup, ts(NOW));
        let q = QueueInputs {
            field: &field,
            grace: SignedDuration::from_secs(grace),
        };
        decide(&AssignInputs {
            lease,
            exporters: &exporters,
            active_leases: &self.active.iter().collect::<Vec<_>>(),
            policies: &policies,
            client,
            now: ts(NOW),
            queue: Some(&q),
        })
    }
}

fn queue_of(a: &Assignment) -> (&'static str, &str, &LeaseQueue) {
    match a {
        Assignment::Queued {
            reason,
            message,
            queue,
            ..
        } => (reason, message, queue),
        other => panic!("expected a queued lease, got {other:?}"),
    }
}

#[test]
fn only_the_head_takes_a_free_exporter() {
    let w = World::new(vec![online("a", &[("t", "x")])]);
    let (first, second) = (queued_lease("zz-first", 1), queued_lease("aa-second", 2));
    let d = w.decide_queued(&first, &[&second], 30);
    assert_eq!(assigned(&d.assignment), "a");
    // Its departure moves the one behind.
    assert_eq!(d.behind, ["aa-second"]);
    let d = w.decide_queued(&second, &[&first], 30);
    let (reason, message, q) = queue_of(&d.assignment);
    assert_eq!(reason, "Queued");
    assert_eq!(
        message,
        "1 leases ahead are served first by the 1 free exporters (i.e. a); position 2 in the queue, estimated start 2027-01-15T09:00:00Z"
    );
    assert_eq!(q.position, Some(2));
    // The lease ahead takes it now for 1h.
    assert_eq!(
        q.estimated_start_time.as_ref().map(|t| t.0),
        Some(ts(NOW + 3600))
    );
    // A higher priority overtakes: a policy gives the client of "aa-second" priority 5.
    let mut first = first;
    first.spec.client_ref = LocalObjectReference::new("plain");
    let mut w = w;
    w.client = Some(client(&[("tier", "gold")]));
    w.policies = vec![policy(
        &[("t", "x")],
        vec![
            rule(&[("tier", "gold")], 5, false, None),
            rule(&[], 0, false, None),
        ],
    )];
    assert_eq!(
        assigned(&w.decide_queued(&second, &[&first], 30).assignment),
        "a"
    );
}

#[test]
fn a_waiting_lease_shows_its_position_and_an_unknown_estimate() {
    let mut w = World::new(vec![online("a", &[("t", "x")])]);
    let mut holder = active_on("holder", "a", false);
    holder.spec.duration = None; // holds with no end
    w.active = vec![holder];
    let ahead = queued_lease("ahead", 1);
    let me = queued_lease("me", 2);
    let d = w.decide_queued(&me, &[&ahead], 30);
    let (reason, message, q) = queue_of(&d.assignment);
    assert_eq!(reason, "NotAvailable");
    assert_eq!(
        message,
        "There are 1 approved exporters, (i.e. a) but all of them are already leased; position 2 in the queue, estimated start unknown"
    );
    assert_eq!(
        (q.position, q.estimated_start_time.clone()),
        (Some(2), None)
    );
    // build_status writes it in the Pending condition and status.queue, with no timer.
    let out = build_status(&me, Some(d.assignment.clone()), ts(NOW));
    let st = out.status;
    assert_eq!(st.queue.as_ref().and_then(|q| q.position), Some(2));
    let c = st.conditions.unwrap();
    assert!(c.iter().any(|c| c.type_ == PENDING && c.message == message));
    assert_eq!(out.requeue_after, None);
    // An estimate that moved by less than a minute keeps its value (no write for jitter).
    let mut later = me.clone();
    let mut shifted = q.clone();
    shifted.estimated_start_time = Some(Time(ts(NOW + 3600)));
    later.status = Some(LeaseStatus {
        queue: Some(shifted),
        ..Default::default()
    });
    w.active[0].spec.duration = Some("1h".into());
    w.active[0].status.as_mut().unwrap().begin_time = Some(Time(ts(NOW - 30)));
    let d = w.decide_queued(&later, &[&ahead], 30);
    let (_, _, q2) = queue_of(&d.assignment);
    // Holder ends at +59m30s, the lease ahead takes 1h: +1h59m30s, not within a minute of +1h.
    assert_eq!(
        q2.estimated_start_time.as_ref().map(|t| t.0),
        Some(ts(NOW + 7170))
    );
    let mut close = later.clone();
    close
        .status
        .as_mut()
        .unwrap()
        .queue
        .as_mut()
        .unwrap()
        .estimated_start_time = Some(Time(ts(NOW + 7200)));
    let d = w.decide_queued(&close, &[&ahead], 30);
    let (_, message, q3) = queue_of(&d.assignment);
    assert_eq!(
        q3.estimated_start_time.as_ref().map(|t| t.0),
        Some(ts(NOW + 7200))
    );
    assert!(
        message.ends_with("estimated start 2027-01-15T10:00:00Z"),
        "{message}"
    );
    // Once assigned, the queue is gone from the status.
    let mut assigned_lease = me.clone();
    assigned_lease.status = Some(LeaseStatus {
        queue: Some(q.clone()),
        ..Default::default()
    });
    let out = build_status(
        &assigned_lease,
        Some(Assignment::Assign {
            exporter: "a".into(),
            priority: 0,
            spot_access: false,
        }),
        ts(NOW),
    );
    assert_eq!(out.status.queue, None);
}

#[test]
fn a_priority_lease_preempts_the_youngest_spot_lease_after_the_grace_period() {
    let mut w = World::new(vec![
        online("a", &[("t", "x"), ("kind", "spot")]),
        online("b", &[("t", "x"), ("kind", "spot")]),
    ]);
    w.client = Some(client(&[("tier", "gold")]));
    // Gold clients: non-spot at priority 10; everyone: spot at 0.
    w.policies = vec![policy(
        &[("t", "x")],
        vec![
            rule(&[("tier", "gold")], 10, false, None),
            rule(&[], 0, true, None),
        ],
    )];
    let mut old = active_on("old", "a", true);
    old.status.as_mut().unwrap().begin_time = Some(Time(ts(NOW - 600)));
    let young = active_on("young", "b", true);
    w.active = vec![old, young];
    let me = queued_lease("me", 0);
    let d = w.decide_queued(&me, &[], 30);
    let Assignment::Queued {
        reason,
        queue: q,
        preempt: Some(p),
        ..
    } = &d.assignment
    else {
        panic!("expected a preemption, got {:?}", d.assignment)
    };
    assert_eq!(*reason, "Preempting");
    assert_eq!((p.lease.as_str(), p.exporter.as_str()), ("young", "b"));
    assert_eq!((p.at, p.due), (ts(NOW + 30), false));
    assert_eq!(q.preempting.as_deref(), Some("young"));
    // The pass looks again when the grace period ends.
    let out = build_status(&me, Some(d.assignment.clone()), ts(NOW));
    assert_eq!(out.requeue_after, Some(Duration::from_secs(30)));
    // The deadline is kept from the status: 30s later it is due.
    let mut me_later = me.clone();
    me_later.status = Some(out.status);
    let mut w_later = w;
    let later = {
        let exporters: Vec<&Exporter> = w_later.exporters.iter().collect();
        let policies: Vec<&ExporterAccessPolicy> = w_later.policies.iter().collect();
        let client = w_later.client.as_ref();
        let all: Vec<&Lease> = w_later.active.iter().chain([&me_later]).collect();
        let lookup = |_: &str| client;
        let field = queue::waiting(&exporters, &all, &policies, &lookup, ts(NOW + 30));
        let q = QueueInputs {
            field: &field,
            grace: SignedDuration::from_secs(30),
        };
        decide_assignment(&AssignInputs {
            lease: &me_later,
            exporters: &exporters,
            active_leases: &w_later.active.iter().collect::<Vec<_>>(),
            policies: &policies,
            client,
            now: ts(NOW + 30),
            queue: Some(&q),
        })
    };
    let Assignment::Queued {
        preempt: Some(p), ..
    } = later
    else {
        panic!("expected a due preemption, got {later:?}")
    };
    assert!(p.due);
    // Grace 0: due at once.
    let d = w_later.decide_queued(&me, &[], 0);
    let Assignment::Queued {
        preempt: Some(p), ..
    } = d.assignment
    else {
        panic!("expected a preemption")
    };
    assert!(p.due);
    // The victim's end names the preempting lease.
    let young = w_later.active[1].clone();
    let st = preempted_status(&young, "me", ts(NOW));
    assert!(st.ended);
    let conds = st.conditions.unwrap();
    let ended = conds.iter().find(|c| c.type_ == ENDED).unwrap();
    assert_eq!(
        (ended.status.as_str(), ended.reason.as_str()),
        ("True", PREEMPTED)
    );
    assert!(ended.message.contains("lease me"), "{}", ended.message);
    // A non-spot holder is never preempted: plain NotAvailable.
    w_later.active = vec![active_on("young", "b", false), active_on("old", "a", false)];
    let (reason, _, _) = queue_of(&w_later.decide_queued(&me, &[], 0).assignment);
    assert_eq!(reason, "NotAvailable");
}

/// The scale of the bench figure, in process (no API server): 5,000 Exporters (500 online,
/// 50 of them with the contested label), 2,000 waiting Leases of three priorities. One pass per
/// Lease, each from the same caches as the reconciler's (the queue built from every Lease):
/// prints the cost per pass, and checks that exactly the 50 heads get an exporter, none ahead
/// of an earlier Lease of its priority.
/// `cargo test --release --lib lease_queue_at_scale -- --ignored --nocapture`
#[test]
#[ignore = "scale figure: seconds in a debug build"]
fn lease_queue_at_scale() {
    let mut exporters = Vec::new();
    for i in 0..5000 {
        let board = if i < 50 { "contested" } else { "other" };
        let name = format!("e{i:04}");
        let labels = [("board", board)];
        exporters.push(if i % 10 == 0 || i < 50 {
            online(&name, &labels)
        } else {
            offline(&name, &labels)
        });
    }
    let mut w = World::new(exporters);
    w.policies = vec![policy(
        &[("board", "contested")],
        vec![
            rule(&[("tier", "high")], 10, false, None),
            rule(&[("tier", "mid")], 5, false, None),
            rule(&[], 0, false, None),
        ],
    )];
    let tiers = ["high", "mid", "low"];
    let clients: Vec<Client> = tiers
        .iter()
        .map(|t| client_named(t, &[("tier", t)]))
        .collect();
    let leases: Vec<Lease> = (0..2000)
        .map(|i| {
            let mut l = lease_sel(&[("board", "contested")]);
            l.metadata.name = Some(format!("l{i:04}"));
            // Arrivals one second apart, tiers interleaved.
            l.metadata.creation_timestamp = Some(Time(ts(NOW - 3000 + i)));
            l.spec.client_ref = LocalObjectReference::new(tiers[(i % 3) as usize]);
            l
        })
        .collect();
    let exporter_refs: Vec<&Exporter> = w.exporters.iter().collect();
    let policies: Vec<&ExporterAccessPolicy> = w.policies.iter().collect();
    let lease_refs: Vec<&Lease> = leases.iter().collect();
    let lookup = |n: &str| {
        clients
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(n))
    };
    let start = std::time::Instant::now();
    let mut assigned = Vec::new();
    let mut slowest = std::time::Duration::ZERO;
    for lease in &leases {
        let pass = std::time::Instant::now();
        let field = queue::waiting(&exporter_refs, &lease_refs, &policies, &lookup, ts(NOW));
        let q = QueueInputs {
            field: &field,
            grace: SignedDuration::from_secs(30),
        };
        let d = decide(&AssignInputs {
            lease,
            exporters: &exporter_refs,
            active_leases: &[],
            policies: &policies,
            client: lookup(&lease.spec.client_ref.name),
            now: ts(NOW),
            queue: Some(&q),
        });
        slowest = slowest.max(pass.elapsed());
        if let Assignment::Assign { .. } = d.assignment {
            assigned.push(lease);
        }
    }
    let total = start.elapsed();
    eprintln!(
        "2,000 passes over 5,000 Exporters and 2,000 Leases: {:?} per pass on average, slowest {:?}",
        total / 2000,
        slowest
    );
    // The 50 heads: the 50 earliest "high" Leases (every third from l0000).
    assert_eq!(assigned.len(), 50);
    for (k, l) in assigned.iter().enumerate() {
        assert_eq!(l.spec.client_ref.name, "high");
        assert_eq!(l.metadata.name, Some(format!("l{:04}", 3 * k)));
    }
}

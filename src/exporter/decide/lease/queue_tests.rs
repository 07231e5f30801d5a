//! Table-driven tests of the queue: order, FIFO under churn, bookings, preemption, estimates
//! and free windows.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use kube::api::ObjectMeta;

use super::*;
use crate::exporter::crd::{
    ExporterSpec, ExporterStatus, ExporterStatusValue, HookPhase, HookState, LeaseHooks, LeaseSpec,
    LeaseStatus, LocalObjectReference,
};
use crate::exporter::decide::lease::preempt::{Held, victim};

const NOW: i64 = 1_800_000_000;

fn ts(s: i64) -> Timestamp {
    Timestamp::from_second(s).unwrap()
}

fn mins(m: i64) -> SignedDuration {
    SignedDuration::from_mins(m)
}

fn exporter(name: &str) -> Exporter {
    Exporter {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("lab".into()),
            labels: Some(BTreeMap::from([("board".into(), "x".into())])),
            ..Default::default()
        },
        spec: ExporterSpec::default(),
        status: Some(ExporterStatus::default()),
    }
}

/// A lease asking for `board=x`, created at NOW + `created` seconds.
fn lease(name: &str, created: i64, duration: Option<&str>) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("lab".into()),
            creation_timestamp: Some(Time(ts(NOW + created))),
            ..Default::default()
        },
        spec: LeaseSpec {
            client_ref: LocalObjectReference::new("c1"),
            selector: LabelSelector {
                match_labels: Some(BTreeMap::from([("board".into(), "x".into())])),
                match_expressions: None,
            },
            duration: duration.map(str::to_string),
            ..Default::default()
        },
        status: None,
    }
}

fn holding(mut l: Lease, exporter: &str, spot: bool, priority: i64, began: i64) -> Lease {
    l.status = Some(LeaseStatus {
        exporter_ref: Some(LocalObjectReference::new(exporter)),
        spot_access: spot.then_some(true),
        priority: (priority != 0).then_some(priority),
        begin_time: Some(Time(ts(NOW + began))),
        ..Default::default()
    });
    l
}

fn key(name: &str, priority: i64, created: i64) -> QueueKey {
    QueueKey {
        priority,
        created: Some(ts(NOW + created)),
        name: name.into(),
    }
}

fn names(field: &Field<'_>) -> Vec<String> {
    field.waiting.iter().map(|c| c.key.name.clone()).collect()
}

fn field_of<'a>(exporters: &[&'a Exporter], leases: &[&'a Lease]) -> Field<'a> {
    waiting(exporters, leases, &[], &|_| None, ts(NOW))
}

#[test]
fn order_is_priority_then_creation_then_name() {
    // (keys in arrival order, expected queue order)
    let cases: Vec<(Vec<QueueKey>, Vec<&str>)> = vec![
        (
            vec![key("b", 0, 1), key("a", 0, 2)],
            vec!["b", "a"], // FIFO: the earlier one first, whatever its name
        ),
        (vec![key("b", 0, 1), key("a", 0, 1)], vec!["a", "b"]), // same second: by name
        (
            vec![key("old", 0, 1), key("new-high", 5, 9), key("mid", 1, 3)],
            vec!["new-high", "mid", "old"], // higher priority first
        ),
        (
            vec![key("n", -1, 0), key("z", 0, 5)],
            vec!["z", "n"], // negative priorities sort after 0
        ),
    ];
    for (mut keys, want) in cases {
        keys.sort();
        let got: Vec<&str> = keys.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(got, want);
    }
}

#[test]
fn waiting_skips_assigned_ended_released_and_booked_leases() {
    let e = exporter("e1");
    let held = holding(lease("held", 0, Some("1h")), "e1", false, 0, 0);
    let w1 = lease("w1", 2, Some("1h"));
    let w0 = lease("w0", 1, Some("1h"));
    let mut released = lease("released", 0, Some("1h"));
    released.spec.release = Some(true);
    let mut ended = lease("ended", 0, Some("1h"));
    ended.status = Some(LeaseStatus {
        ended: true,
        ..Default::default()
    });
    let mut booked = lease("booked", -5, Some("1h"));
    booked.spec.begin_time = Some(Time(ts(NOW + 600)));
    let mut begun = lease("begun", 3, Some("1h"));
    begun.spec.begin_time = Some(Time(ts(NOW - 1)));
    let mut elsewhere = lease("elsewhere", 0, Some("1h"));
    elsewhere.spec.selector.match_labels = Some(BTreeMap::from([("board".into(), "y".into())]));
    let leases = [
        &held, &w1, &w0, &released, &ended, &booked, &begun, &elsewhere,
    ];
    let field = field_of(&[&e], &leases);
    // A booking holds no queue; a lease whose beginTime has passed waits as any other; a lease
    // no exporter matches waits for nothing.
    assert_eq!(names(&field), ["w0", "w1", "begun"]);
    assert_eq!(field.bookings.len(), 1);
    assert_eq!(field.bookings[0].name, "booked");
    assert_eq!(field.bookings[0].begin, ts(NOW + 600));
}

#[test]
fn fifo_holds_under_churn() {
    // Leases arrive, the head is served, more arrive: nobody is overtaken by a later lease of
    // the same priority, and the head is always the oldest still waiting.
    let e = exporter("e1");
    let mut all: Vec<Lease> = (0..6)
        .map(|i| lease(&format!("l{i}"), i, Some("10m")))
        .collect();
    let mut served = Vec::new();
    for round in 0..6 {
        if round % 2 == 0 {
            // Churn: a newcomer arrives whose name sorts first.
            all.push(lease(&format!("a{round}"), 10 + round, Some("10m")));
        }
        let refs: Vec<&Lease> = all.iter().collect();
        let field = field_of(&[&e], &refs);
        let mine = BTreeSet::from(["e1"]);
        let heads: Vec<&str> = field
            .waiting
            .iter()
            .filter(|c| standing(&c.key, &mine, &field.waiting).may_take(1))
            .map(|c| c.key.name.as_str())
            .collect();
        assert_eq!(heads.len(), 1, "one free exporter, one head: {heads:?}");
        let head = heads[0].to_string();
        // Every lease behind the head was created no earlier.
        let head_key = &field.waiting[0].key;
        assert_eq!(head_key.name, head);
        for c in &field.waiting[1..] {
            assert!(c.key.created >= head_key.created, "{head} overtook");
        }
        served.push(head.clone());
        let l = all
            .iter_mut()
            .find(|l| l.metadata.name.as_deref() == Some(&head));
        l.unwrap().status = Some(LeaseStatus {
            ended: true,
            ..Default::default()
        });
    }
    assert_eq!(served, ["l0", "l1", "l2", "l3", "l4", "l5"]);
}

#[test]
fn standing_counts_only_competitors_and_lists_those_behind() {
    let (e1, e2) = (exporter("e1"), exporter("e2"));
    let mut other = exporter("o1");
    other.metadata.labels = Some(BTreeMap::from([("board".into(), "y".into())]));
    let a = lease("a", 1, Some("1h"));
    let b = lease("b", 2, None);
    let c = lease("c", 3, Some("1h"));
    let mut y = lease("y", 0, Some("1h"));
    y.spec.selector.match_labels = Some(BTreeMap::from([("board".into(), "y".into())]));
    let field = field_of(&[&e1, &e2, &other], &[&c, &y, &b, &a]);
    let mine = BTreeSet::from(["e1", "e2"]);
    let s = standing(&field.waiting[2].key, &mine, &field.waiting);
    assert_eq!(field.waiting[2].key.name, "b");
    // y competes for other exporters: not ahead even though older.
    assert_eq!((s.ahead, s.position()), (1, 2));
    assert_eq!(s.ahead_durations, [Some(mins(60))]);
    assert_eq!(s.behind, ["c"]);
    assert!(s.may_take(2) && !s.may_take(1));
}

#[test]
fn standing_caps_what_it_shows() {
    let e = exporter("e1");
    let many: Vec<Lease> = (0..250)
        .map(|i| lease(&format!("l{i:03}"), i, Some("1m")))
        .collect();
    let refs: Vec<&Lease> = many.iter().collect();
    let field = field_of(&[&e], &refs);
    let mine = BTreeSet::from(["e1"]);
    let last = standing(&field.waiting[249].key, &mine, &field.waiting);
    assert_eq!(last.ahead, 249);
    assert!(!last.shown());
    assert_eq!(last.ahead_durations.len(), POSITION_CAP);
    let head = standing(&field.waiting[0].key, &mine, &field.waiting);
    // Only the leases whose shown position can change are woken.
    assert_eq!(head.behind.len(), POSITION_CAP + 1);
}

#[test]
fn estimates_from_ends_and_durations() {
    let t = |m: i64| Some(ts(NOW + m * 60));
    // (free times of the exporters, durations ahead, expected start)
    type Case = (
        Vec<Option<Timestamp>>,
        Vec<Option<SignedDuration>>,
        Option<Timestamp>,
    );
    let cases: Vec<Case> = vec![
        (vec![t(0)], vec![], t(0)),                        // free: now
        (vec![t(30)], vec![], t(30)),                      // held until +30m
        (vec![t(30)], vec![Some(mins(60))], t(90)),        // one ahead of 1h
        (vec![t(30), t(10)], vec![Some(mins(60))], t(30)), // ahead takes e2 at 10
        (vec![t(30), t(10)], vec![Some(mins(5))], t(15)),  // ... and frees it at 15
        (vec![None], vec![], None),                        // holder with no end
        (vec![t(10)], vec![None], None),                   // lease ahead with no end
        (vec![t(10), None], vec![None], None),             // both slots end never
        (vec![t(10), t(20)], vec![None], t(20)),           // the other slot frees
        (vec![], vec![], None),                            // no exporter
    ];
    for (free, ahead, want) in cases {
        assert_eq!(estimate_start(&free, &ahead), want, "{free:?} {ahead:?}");
    }
}

fn with_before_hook(mut e: Exporter, lease: &str, phase: HookPhase) -> Exporter {
    e.status.as_mut().unwrap().lease_hooks = Some(LeaseHooks {
        lease_ref: Some(LocalObjectReference::new(lease)),
        before_lease: Some(HookState {
            attempts: None,
            last_transition_time: None,
            message: None,
            on_failure: None,
            phase,
        }),
        ..Default::default()
    });
    e
}

#[test]
fn preemption_rules() {
    let (e1, e2, e3) = (exporter("e1"), exporter("e2"), exporter("e3"));
    let old_spot = holding(lease("old-spot", 0, Some("1h")), "e1", true, 0, -600);
    let young_spot = holding(lease("young-spot", 0, Some("1h")), "e2", true, 0, -60);
    let non_spot = holding(lease("non-spot", 0, Some("1h")), "e3", false, 0, -1);
    let high_spot = holding(lease("high-spot", 0, Some("1h")), "e2", true, 9, -1);
    let hooked = with_before_hook(exporter("e2"), "young-spot", HookPhase::Running);
    let hook_done = with_before_hook(exporter("e2"), "young-spot", HookPhase::Succeeded);
    let mut reporting = exporter("e2");
    reporting.status.as_mut().unwrap().exporter_status = Some(ExporterStatusValue::BeforeLeaseHook);
    reporting.status.as_mut().unwrap().lease_ref = Some(LocalObjectReference::new("young-spot"));
    let h = |exporter: &'static Exporter, lease: &'static Lease| Held { exporter, lease };
    let leak = |x: Exporter| -> &'static Exporter { Box::leak(Box::new(x)) };
    let leakl = |x: Lease| -> &'static Lease { Box::leak(Box::new(x)) };
    let (e1, e2, e3) = (leak(e1), leak(e2), leak(e3));
    let (old_spot, young_spot, non_spot, high_spot) = (
        leakl(old_spot),
        leakl(young_spot),
        leakl(non_spot),
        leakl(high_spot),
    );
    let (hooked, hook_done, reporting) = (leak(hooked), leak(hook_done), leak(reporting));
    // (priority of the waiting lease, held exporters, expected victim)
    let cases: Vec<(i64, Vec<Held<'static>>, Option<&str>)> = vec![
        // The youngest spot lease.
        (
            0,
            vec![h(e1, old_spot), h(e2, young_spot)],
            Some("young-spot"),
        ),
        // Never a non-spot lease.
        (0, vec![h(e3, non_spot)], None),
        (0, vec![h(e3, non_spot), h(e1, old_spot)], Some("old-spot")),
        // Equal or higher priority only.
        (0, vec![h(e2, high_spot)], None),
        (9, vec![h(e2, high_spot)], Some("high-spot")),
        // Never during its beforeLease hook (recorded or reported); after it, yes.
        (
            0,
            vec![h(hooked, young_spot), h(e1, old_spot)],
            Some("old-spot"),
        ),
        (0, vec![h(reporting, young_spot)], None),
        (0, vec![h(hook_done, young_spot)], Some("young-spot")),
        (0, vec![], None),
    ];
    for (priority, held, want) in cases {
        let got = victim(priority, &held).map(|h| h.lease.metadata.name.clone().unwrap());
        assert_eq!(got.as_deref(), want, "priority {priority}");
    }
}

#[test]
fn longest_free_window_when_the_duration_does_not_fit() {
    let at = |m: i64| ts(NOW + m * 60);
    let both = Arc::new(BTreeSet::from(["e1".to_string(), "e2".to_string()]));
    let only_e1 = Arc::new(BTreeSet::from(["e1".to_string()]));
    let bookings = vec![
        Booking {
            name: "b1".into(),
            begin: at(45),
            candidates: only_e1.clone(),
        },
        Booking {
            name: "b2".into(),
            begin: at(30),
            candidates: both.clone(),
        },
    ];
    // Both exporters are booked from +30m: 1h fits on neither; the longest window is e1's
    // (free now until b2 at +30m) — e2 frees at +10m.
    let free = [("e1", Some(at(0))), ("e2", Some(at(10)))];
    let (window, exporter, booking) = longest_free_window(&free, mins(60), &bookings).unwrap();
    assert_eq!(
        (window, exporter.as_str(), booking.name.as_str()),
        (mins(30), "e1", "b2")
    );
    // 30 minutes fit on e1.
    assert!(longest_free_window(&free, mins(30), &bookings).is_none());
    // An exporter with no booking after it frees fits anything.
    let later = [("e1", Some(at(0))), ("e2", Some(at(31)))];
    assert!(longest_free_window(&later, mins(600), &bookings).is_none());
    assert_eq!(human(mins(90)), "1h30m");
    assert_eq!(human(SignedDuration::from_secs(20)), "20s");
}

#[test]
fn who_holds_an_exporter_is_not_what_every_waiting_lease_reads() {
    let base = exporter("e1");
    let sig = shared_signature(&base);
    let mut held = base.clone();
    let st = held.status.get_or_insert_default();
    st.lease_ref = Some(LocalObjectReference::new("l1"));
    st.exporter_status = Some(ExporterStatusValue::LeaseReady);
    assert_eq!(
        shared_signature(&held),
        sig,
        "a lease taking it wakes only the heads"
    );
    let mut relabelled = base.clone();
    relabelled
        .metadata
        .labels
        .get_or_insert_default()
        .insert("board".into(), "y".into());
    assert_ne!(
        shared_signature(&relabelled),
        sig,
        "new labels wake everyone"
    );
    let mut online = base.clone();
    let conds = online
        .status
        .get_or_insert_default()
        .conditions
        .get_or_insert_default();
    let desired = crate::conditions::Desired::new(ONLINE, true, "Seen", "");
    conditions::set(conds, desired, Some(1), &conditions::time(ts(NOW)));
    assert_ne!(
        shared_signature(&online),
        sig,
        "coming online wakes everyone"
    );
}

#[test]
fn only_a_lease_showing_its_position_is_near_the_head() {
    let mut l = lease("l1", 0, Some("1h"));
    assert!(!near_head(&l), "not decided yet");
    l.status = Some(LeaseStatus::default());
    assert!(!near_head(&l), "pending without a place (e.g. offline)");
    l.status.as_mut().unwrap().queue = Some(crate::exporter::crd::LeaseQueue::default());
    assert!(!near_head(&l), "more than 100 ahead");
    l.status.as_mut().unwrap().queue.as_mut().unwrap().position = Some(101);
    assert!(near_head(&l));
}

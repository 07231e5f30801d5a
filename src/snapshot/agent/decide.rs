//! The agent's state table (docs/snapshot.md, "Agent states"; rows below are its rows) as one
//! pure `decide` function, plus the pure parts of the cut gate ("Raise and cut") and the deadline
//! and cutoff clocks (I7 of "Invariants"; "Deadline, void and recovery").

use std::time::Duration;

use jiff::Timestamp;
use kube::ResourceExt;

use super::context::Settings;
use crate::runtime::time::{after, before};
use crate::snapshot::round::{RoundView, parse_stamp};
use crate::snapshot::types::{MiroirSnapshot, MiroirVolume, SlotState, teardown_finalizer};

/// What the journal records for this snapshot (matched by uid): the round this agent raised a
/// barrier for and how long ago, on the monotonic clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held<'a> {
    pub suspended_at: &'a str,
    pub since_raise: Duration,
}

/// Everything the agent looks at for one snapshot on its node.
#[derive(Clone, Copy, Debug)]
pub struct Observed<'a> {
    pub node: &'a str,
    /// None: the object is gone; only the journal still knows it.
    pub snapshot: Option<&'a MiroirSnapshot>,
    pub volume: Option<&'a MiroirVolume>,
    pub held: Option<Held<'a>>,
    /// The kernel reports the volume's DRBD resource Primary on this node. Only consulted for
    /// nodes without a diskful leg (docs/snapshot.md, "Special legs").
    pub local_primary: bool,
    pub now: Timestamp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// resume-io, thaw, drop the journal entry; then tear down if asked.
    Lift { teardown: bool },
    /// Delete the backend snapshot of this name (in every pool unless this node is a
    /// tie-breaker), then remove this node's finalizer.
    Teardown { delete_backends: bool },
    /// Write this value into the own slot (fenced).
    WriteSlot(SlotState),
    /// Preconditions, journal, freeze if mounted here, suspend-io, then slot `Suspended`.
    /// Idempotent, so a raise whose slot write was lost is simply repeated.
    Raise,
    /// Unreplicated volume: sync, delete, cut, `Done`, no barrier (docs/snapshot.md, "Special
    /// legs").
    CutUnreplicated,
    /// Cut gate holds on the slots: check the kernel view, re-assert suspend-io, sync, delete, cut.
    Cut,
    /// Nothing to do now.
    Wait,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub step: Step,
    /// When to look again without a watch event (deadline lift).
    pub wake_at: Option<Timestamp>,
}

fn step(step: Step) -> Decision {
    Decision {
        step,
        wake_at: None,
    }
}

/// The moment a held barrier must be lifted: the earlier of `suspendedAt` + D (wall clock) and
/// raise + D (monotonic, expressed on the wall clock from `now`).
pub fn lift_at(held: &Held<'_>, now: Timestamp, s: &Settings) -> Timestamp {
    let mono = after(now, s.deadline.saturating_sub(held.since_raise));
    match parse_stamp(held.suspended_at) {
        Some(t) => after(t, s.deadline).min(mono),
        None => now,
    }
}

/// I7: a cut may start and a `Done` may be written only before the cutoff, on both clocks.
pub fn before_cutoff(
    suspended_at: &str,
    since_raise: Option<Duration>,
    now: Timestamp,
    s: &Settings,
) -> bool {
    let Some(t) = parse_stamp(suspended_at) else {
        return false;
    };
    let guard_window = s.deadline.saturating_sub(s.cut_guard);
    now < after(t, guard_window) && since_raise.is_none_or(|d| d < guard_window)
}

/// The wall-clock cutoff of a round (`suspendedAt` + D − G).
pub fn cutoff(suspended_at: &str, s: &Settings) -> Option<Timestamp> {
    parse_stamp(suspended_at).map(|t| before(after(t, s.deadline), s.cut_guard))
}

/// I2 on the kernel's view: the first connected Primary peer whose slot is not `Suspended` or
/// `Done`. A diskful agent must not cut while one exists.
pub fn primary_holding_back<'n>(
    primary_peers: &'n [String],
    snapshot: &MiroirSnapshot,
) -> Option<&'n str> {
    let r = RoundView::of(snapshot);
    primary_peers
        .iter()
        .find(|n| !matches!(r.slot(n), Some(SlotState::Suspended | SlotState::Done)))
        .map(String::as_str)
}

/// The agent's decision for snapshot `o.snapshot` on node `o.node` (docs/snapshot.md, "Agent
/// states"; first match wins).
pub fn decide(o: &Observed<'_>, s: &Settings) -> Decision {
    // Row 1: gone or deleting.
    let Some(snap) = o.snapshot else {
        return step(if o.held.is_some() {
            Step::Lift { teardown: false }
        } else {
            Step::Wait
        });
    };
    if snap.metadata.deletion_timestamp.is_some() {
        let mine = teardown_finalizer(o.node);
        let has_finalizer = snap.finalizers().contains(&mine);
        if o.held.is_some() {
            return step(Step::Lift {
                teardown: has_finalizer,
            });
        }
        if !has_finalizer {
            return step(Step::Wait);
        }
        // A tie-breaker (per the volume, when it exists) holds no data; a node that left the
        // replica set, or any node of a deleted volume, still deletes in every pool.
        let tie_breaker = o
            .volume
            .and_then(|v| v.replica_on(o.node))
            .is_some_and(|r| !r.is_diskful());
        return step(Step::Teardown {
            delete_backends: !tie_breaker,
        });
    }

    let r = RoundView::of(snap);

    if let Some(h) = &o.held {
        // Row 2: the round this barrier was raised for is over.
        if r.ready || !r.io_suspended || r.suspended_at != Some(h.suspended_at) {
            return step(Step::Lift { teardown: false });
        }
        // Row 3: the deadline, with no API call needed.
        if o.now >= lift_at(h, o.now, s) {
            return step(Step::Lift { teardown: false });
        }
    }
    let lift_timer = o.held.as_ref().map(|h| lift_at(h, o.now, s));
    let wait = Decision {
        step: Step::Wait,
        wake_at: lift_timer,
    };

    // Everything below needs a live round and the volume.
    let Some(stamp) = r.suspended_at.filter(|_| r.io_suspended && !r.ready) else {
        return wait;
    };
    let live = parse_stamp(stamp).is_some_and(|t| o.now < after(t, s.deadline));
    let Some(volume) = o.volume.filter(|_| live) else {
        return wait;
    };

    let diskful = volume.diskful_nodes();
    let own = r.slot(o.node);
    let is_diskful = diskful.iter().any(|n| n == o.node);
    let since_raise = o.held.map(|h| h.since_raise);
    let in_time = before_cutoff(stamp, since_raise, o.now, s);

    // Row 4: every diskful leg is cut; lift at once (resume before publish, I4).
    if r.all_diskful_in(&diskful, &[SlotState::Done]) {
        return if o.held.is_some() {
            step(Step::Lift { teardown: false })
        } else {
            wait
        };
    }

    // Row 5: the slot claims a barrier this agent does not hold (e.g. after a reboot).
    if matches!(own, Some(SlotState::Suspended | SlotState::Done)) && o.held.is_none() {
        return step(Step::WriteSlot(SlotState::Error));
    }

    // Row 6: a diskful leg still Pending.
    if is_diskful && own == Some(SlotState::Pending) {
        if !in_time {
            return wait;
        }
        return step(if volume.is_replicated() {
            Step::Raise
        } else {
            Step::CutUnreplicated
        });
    }

    // Row 7: a diskless Primary joins the round with its own slot (I2).
    if !is_diskful && own.is_none() && o.local_primary && volume.is_replicated() && in_time {
        return step(Step::Raise);
    }

    // Row 8: the cut gate, as far as the slots tell (the kernel view is checked before cutting).
    if is_diskful
        && own == Some(SlotState::Suspended)
        && o.held.is_some()
        && in_time
        && r.first_error().is_none()
        && r.all_diskful_in(&diskful, &[SlotState::Suspended, SlotState::Done])
    {
        return step(Step::Cut);
    }

    // Row 9.
    wait
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::types::{MiroirSnapshotSpec, MiroirSnapshotStatus};
    use SlotState::*;
    use serde_json::json;

    const T0: &str = "2025-03-01T10:00:00Z";

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(T0.parse::<Timestamp>().unwrap().as_second() + secs).unwrap()
    }

    fn vol(replicas: serde_json::Value) -> MiroirVolume {
        serde_json::from_value(json!({
            "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirVolume",
            "metadata": {"name": "pvc-1"}, "spec": {"sizeBytes": 4096, "replicas": replicas}
        }))
        .unwrap()
    }

    fn three() -> MiroirVolume {
        vol(
            json!([{"node": "a", "backend": "loopfile"}, {"node": "b", "backend": "loopfile"},
                   {"node": "c", "backend": "loopfile"}]),
        )
    }

    fn with_tie_breaker() -> MiroirVolume {
        vol(
            json!([{"node": "a", "backend": "loopfile"}, {"node": "b", "backend": "loopfile"},
                   {"node": "t", "diskless": true}]),
        )
    }

    fn snap(open: bool, slots: &[(&str, SlotState)]) -> MiroirSnapshot {
        let mut s = MiroirSnapshot::new(
            "snap-1",
            MiroirSnapshotSpec {
                volume_name: "pvc-1".into(),
            },
        );
        s.metadata.uid = Some("uid-1".into());
        s.metadata.finalizers = Some(
            ["a", "b", "c"]
                .iter()
                .map(|n| teardown_finalizer(n))
                .collect(),
        );
        s.status = Some(MiroirSnapshotStatus {
            ready_to_use: Some(false),
            io_suspended: Some(open),
            suspended_at: Some(T0.into()),
            per_node: Some(slots.iter().map(|(n, st)| (n.to_string(), *st)).collect()),
            ..Default::default()
        });
        s
    }

    fn held(secs: u64) -> Option<Held<'static>> {
        Some(Held {
            suspended_at: T0,
            since_raise: Duration::from_secs(secs),
        })
    }

    fn run(
        node: &str,
        s: Option<&MiroirSnapshot>,
        v: Option<&MiroirVolume>,
        h: Option<Held<'_>>,
        primary: bool,
        now: i64,
    ) -> Decision {
        decide(
            &Observed {
                node,
                snapshot: s,
                volume: v,
                held: h,
                local_primary: primary,
                now: at(now),
            },
            &Settings::default(),
        )
    }

    fn st(d: Decision) -> Step {
        d.step
    }

    #[test]
    fn row1_gone_lifts_only_what_the_journal_holds() {
        assert_eq!(
            st(run("a", None, None, held(1), false, 1)),
            Step::Lift { teardown: false }
        );
        assert_eq!(st(run("a", None, None, None, false, 1)), Step::Wait);
    }

    #[test]
    fn row1_deleting_lifts_then_tears_down_its_own_finalizer() {
        let mut s = snap(true, &[("a", Suspended), ("b", Pending), ("c", Pending)]);
        s.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(1)));
        let v = three();
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(1), false, 2)),
            Step::Lift { teardown: true }
        );
        assert_eq!(
            st(run("b", Some(&s), Some(&v), None, false, 2)),
            Step::Teardown {
                delete_backends: true
            }
        );
        // Volume already gone: still delete in every pool (docs/snapshot.md, "Finalizers and
        // deletion").
        assert_eq!(
            st(run("b", Some(&s), None, None, false, 2)),
            Step::Teardown {
                delete_backends: true
            }
        );
        // A node whose finalizer is gone has nothing left to do.
        assert_eq!(st(run("z", Some(&s), Some(&v), None, false, 2)), Step::Wait);
        // A tie-breaker removes its finalizer at once.
        s.metadata.finalizers = Some(vec![teardown_finalizer("t")]);
        assert_eq!(
            st(run(
                "t",
                Some(&s),
                Some(&with_tie_breaker()),
                None,
                false,
                2
            )),
            Step::Teardown {
                delete_backends: false
            }
        );
    }

    #[test]
    fn row2_round_over_lifts() {
        let v = three();
        // Voided.
        let s = snap(false, &[("a", Pending), ("b", Pending), ("c", Pending)]);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(5), false, 5)),
            Step::Lift { teardown: false }
        );
        // Published.
        let mut s = snap(false, &[("a", Done), ("b", Done), ("c", Done)]);
        s.status.as_mut().unwrap().ready_to_use = Some(true);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(5), false, 5)),
            Step::Lift { teardown: false }
        );
        // Replaced by a newer round of the same snapshot.
        let mut s = snap(true, &[("a", Pending), ("b", Pending), ("c", Pending)]);
        s.status.as_mut().unwrap().suspended_at = Some("2025-03-01T10:01:30Z".into());
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(95), false, 95)),
            Step::Lift { teardown: false }
        );
    }

    #[test]
    fn row3_deadline_lifts_on_either_clock() {
        let v = three();
        let s = snap(true, &[("a", Done), ("b", Suspended), ("c", Pending)]);
        // Wall clock.
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(10), false, 60)),
            Step::Lift { teardown: false }
        );
        // Monotonic clock: raised 60 s ago although the wall clock says 30 s.
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(60), false, 30)),
            Step::Lift { teardown: false }
        );
        // Before both: wait, with a timer at the earlier lift time.
        let d = run("a", Some(&s), Some(&v), held(5), false, 20);
        assert_eq!(d.step, Step::Wait);
        assert_eq!(d.wake_at, Some(at(60)));
        let d = run("a", Some(&s), Some(&v), held(30), false, 20);
        assert_eq!(d.wake_at, Some(at(50)));
    }

    #[test]
    fn row4_all_done_lifts_before_publish() {
        let v = three();
        let s = snap(true, &[("a", Done), ("b", Done), ("c", Done)]);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(2), false, 2)),
            Step::Lift { teardown: false }
        );
        assert_eq!(st(run("b", Some(&s), Some(&v), None, false, 2)), Step::Wait);
        // A diskless Primary lifts on the same trigger (its slot is not diskful).
        let v = with_tie_breaker();
        let s = snap(true, &[("a", Done), ("b", Done), ("t", Suspended)]);
        assert_eq!(
            st(run("t", Some(&s), Some(&v), held(2), true, 2)),
            Step::Lift { teardown: false }
        );
    }

    #[test]
    fn row5_lost_barrier_reports_error() {
        let v = three();
        let s = snap(true, &[("a", Suspended), ("b", Pending), ("c", Pending)]);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), None, false, 3)),
            Step::WriteSlot(Error)
        );
        let s = snap(true, &[("a", Done), ("b", Suspended), ("c", Suspended)]);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), None, false, 3)),
            Step::WriteSlot(Error)
        );
    }

    #[test]
    fn row6_pending_diskful_raises_before_the_cutoff_only() {
        let v = three();
        let s = snap(true, &[("a", Pending), ("b", Pending), ("c", Pending)]);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), None, false, 0)),
            Step::Raise
        );
        assert_eq!(
            st(run("a", Some(&s), Some(&v), None, false, 54)),
            Step::Raise
        );
        assert_eq!(
            st(run("a", Some(&s), Some(&v), None, false, 55)),
            Step::Wait
        );
        // Raised but the slot write is not visible yet: repeat the (idempotent) raise.
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(1), false, 1)),
            Step::Raise
        );
    }

    #[test]
    fn t2_unreplicated_cuts_without_a_barrier() {
        let v = vol(json!([{"node": "a", "backend": "zfs"}]));
        let s = snap(true, &[("a", Pending)]);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), None, false, 0)),
            Step::CutUnreplicated
        );
        let s = snap(true, &[("a", Done)]);
        assert_eq!(st(run("a", Some(&s), Some(&v), None, false, 1)), Step::Wait);
    }

    #[test]
    fn row7_diskless_primary_joins_tie_breaker_stays_out() {
        let v = with_tie_breaker();
        let s = snap(true, &[("a", Pending), ("b", Pending)]);
        assert_eq!(st(run("t", Some(&s), Some(&v), None, true, 1)), Step::Raise);
        // A client leg (not in spec.replicas) that is Primary joins too.
        assert_eq!(
            st(run("client", Some(&s), Some(&v), None, true, 1)),
            Step::Raise
        );
        // A healthy secondary tie-breaker holds no barrier (I12).
        assert_eq!(st(run("t", Some(&s), Some(&v), None, false, 1)), Step::Wait);
        // Never after the cutoff.
        assert_eq!(st(run("t", Some(&s), Some(&v), None, true, 56)), Step::Wait);
        // Its slot is Suspended and held: no cut, just wait.
        let s = snap(
            true,
            &[("a", Suspended), ("b", Suspended), ("t", Suspended)],
        );
        assert_eq!(
            st(run("t", Some(&s), Some(&v), held(1), true, 2)),
            Step::Wait
        );
    }

    #[test]
    fn row8_cut_gate_on_the_slots() {
        let v = three();
        let all_up = snap(true, &[("a", Suspended), ("b", Suspended), ("c", Done)]);
        assert_eq!(
            st(run("a", Some(&all_up), Some(&v), held(2), false, 2)),
            Step::Cut
        );
        // I1: not while a diskful slot is still Pending.
        let s = snap(true, &[("a", Suspended), ("b", Pending), ("c", Suspended)]);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(2), false, 2)),
            Step::Wait
        );
        // Not with an Error anywhere.
        let s = snap(true, &[("a", Suspended), ("b", Suspended), ("c", Error)]);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(2), false, 2)),
            Step::Wait
        );
        // I7: not after the cutoff on the wall clock ...
        assert_eq!(
            st(run("a", Some(&all_up), Some(&v), held(2), false, 55)),
            Step::Wait
        );
        // ... nor on the monotonic clock.
        assert_eq!(
            st(run("a", Some(&all_up), Some(&v), held(55), false, 2)),
            Step::Wait
        );
        // Already Done: nothing more (until every slot is Done).
        let s = snap(true, &[("a", Done), ("b", Suspended), ("c", Suspended)]);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(2), false, 2)),
            Step::Wait
        );
    }

    #[test]
    fn t11_missing_tie_breaker_slot_does_not_gate_the_cut() {
        let v = with_tie_breaker();
        let s = snap(true, &[("a", Suspended), ("b", Suspended)]);
        assert_eq!(
            st(run("a", Some(&s), Some(&v), held(1), false, 1)),
            Step::Cut
        );
    }

    #[test]
    fn unrelated_nodes_and_dead_rounds_wait() {
        let v = three();
        let s = snap(true, &[("a", Pending), ("b", Pending), ("c", Pending)]);
        assert_eq!(st(run("x", Some(&s), Some(&v), None, false, 1)), Step::Wait);
        // Expired round, nothing held: nothing to do.
        assert_eq!(
            st(run("a", Some(&s), Some(&v), None, false, 61)),
            Step::Wait
        );
        // Volume unknown: no raise.
        assert_eq!(st(run("a", Some(&s), None, None, false, 1)), Step::Wait);
    }

    #[test]
    fn cutoff_and_primary_gate_helpers() {
        let s = Settings::default();
        assert_eq!(cutoff(T0, &s), Some(at(55)));
        assert!(before_cutoff(T0, None, at(54), &s));
        assert!(!before_cutoff(T0, None, at(55), &s));
        assert!(!before_cutoff(T0, Some(Duration::from_secs(55)), at(1), &s));
        assert!(!before_cutoff("nonsense", None, at(0), &s));

        let sn = snap(true, &[("a", Suspended), ("b", Suspended), ("p", Pending)]);
        let peers = vec!["p".to_string()];
        assert_eq!(primary_holding_back(&peers, &sn), Some("p"));
        let sn = snap(
            true,
            &[("a", Suspended), ("b", Suspended), ("p", Suspended)],
        );
        assert_eq!(primary_holding_back(&peers, &sn), None);
        let sn = snap(true, &[("a", Suspended), ("b", Suspended)]);
        assert_eq!(primary_holding_back(&peers, &sn), Some("p"));
    }

    #[test]
    fn lift_at_is_the_earlier_clock() {
        let s = Settings::default();
        let h = Held {
            suspended_at: T0,
            since_raise: Duration::from_secs(10),
        };
        // Raised 10 s ago at wall 20: mono says 70, wall says 60.
        assert_eq!(lift_at(&h, at(20), &s), at(60));
        let h = Held {
            suspended_at: T0,
            since_raise: Duration::from_secs(40),
        };
        assert_eq!(lift_at(&h, at(10), &s), at(30));
    }
}

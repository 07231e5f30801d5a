//! The manager's state table (docs/snapshot.md, "Manager states"; rows below are its rows) as
//! one pure `decide` function. I1–I13: docs/snapshot.md, "Invariants".
//!
//! Input: the snapshot, its volume, the agents' heartbeats, whether another snapshot of the
//! volume holds an open round, and the clock. Output: one step to write, the desired `Ready`
//! condition, the event to emit after a successful write and the exact moment to look again.
//! No round state lives outside the object.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use kube::ResourceExt;

use super::context::Settings;
use super::round::{RoundView, clock, elapsed, format_stamp, human, parse_stamp};
use super::types::{FINALIZER_PREFIX, MiroirSnapshot, MiroirVolume, SlotState, teardown_finalizer};
use crate::runtime::time::{after, whole_seconds};

/// Everything the manager looks at for one snapshot.
#[derive(Clone, Copy, Debug)]
pub struct Observed<'a> {
    pub snapshot: &'a MiroirSnapshot,
    pub volume: Option<&'a MiroirVolume>,
    /// Last renewal of each node's agent Lease.
    pub heartbeats: &'a BTreeMap<String, Timestamp>,
    /// Name of another snapshot of the same volume whose round is open.
    pub other_round: Option<&'a str>,
    /// The snapshot comes from an uncached read (row 8 decides only on one).
    pub fresh: bool,
    pub now: Timestamp,
}

/// Why a round was voided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VoidCause {
    /// The deadline passed with a diskful leg not `Done`.
    Expired,
    /// A leg reported `Error`.
    Failed,
    /// A diskful leg not `Done` whose agent stopped renewing its heartbeat during the round
    /// (row 8a): voided before the deadline so the other legs resume.
    Silent,
}

/// Round results for `ucm_snapshot_rounds_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoundResult {
    Success,
    Expired,
    Silent,
    Failed,
}

impl RoundResult {
    pub fn label(self) -> &'static str {
        match self {
            RoundResult::Success => "success",
            RoundResult::Expired => "expired",
            RoundResult::Silent => "silent",
            RoundResult::Failed => "failed",
        }
    }
}

/// The one write (or non-write) the manager does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Write nothing but the Ready condition, and only if it changed.
    Wait,
    /// Replace the finalizer list with this one (a superset of the current list).
    SetFinalizers(Vec<String>),
    /// Row 8 on a cached object: read the snapshot uncached, then decide again.
    ReRead,
    /// Row 13: open a round stamped `stamp` over these diskful nodes.
    Open { stamp: String, diskful: Vec<String> },
    /// Row 2, a forged publish: `readyToUse` back to false (and any open round closed), pinned
    /// to the resourceVersion the forgery was seen at.
    Unpublish,
    /// Row 7: publish, keeping only the diskful slots.
    Publish {
        round: String,
        size_bytes: i64,
        source_formatted: bool,
        slots: BTreeMap<String, SlotState>,
    },
    /// Rows 6, 8 and 8a: void the round `round` and re-stamp with `stamp`.
    Void {
        round: String,
        cause: VoidCause,
        stamp: String,
        diskful: Vec<String>,
    },
}

/// The desired `Ready` condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ready {
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Ready {
    fn new(status: bool, reason: &'static str, message: impl Into<String>) -> Self {
        Ready {
            status,
            reason,
            message: message.into(),
        }
    }
}

/// An event the caller emits once the step's write succeeded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub step: Step,
    /// None: leave the condition as it is.
    pub ready: Option<Ready>,
    pub event: Option<Event>,
    pub result: Option<RoundResult>,
    /// The exact moment something becomes due; None: wait for a watch event.
    pub requeue_at: Option<Timestamp>,
}

impl Decision {
    fn wait(ready: Option<Ready>, requeue_at: Option<Timestamp>) -> Self {
        Decision {
            step: Step::Wait,
            ready,
            event: None,
            result: None,
            requeue_at,
        }
    }
}

/// Condition reasons (docs/snapshot.md, "Conditions and events").
pub mod reason {
    pub const SNAPSHOT_READY: &str = "SnapshotReady";
    pub const VOLUME_NOT_FOUND: &str = "VolumeNotFound";
    pub const WAITING_FOR_REPLICAS: &str = "WaitingForReplicas";
    pub const WAITING_FOR_ROUND: &str = "WaitingForRound";
    pub const BARRIER_RAISED: &str = "BarrierRaised";
    pub const BARRIER_EXPIRED: &str = "BarrierExpired";
    /// OURS: voided before the deadline, a leg's agent having gone silent during the round.
    pub const AGENT_SILENT: &str = "AgentSilent";
    pub const CUT_FAILED: &str = "CutFailed";
    pub const TEARDOWN_PENDING: &str = "TeardownPending";
    /// OURS: a replica node name that cannot form its teardown finalizer.
    pub const INVALID_VOLUME: &str = "InvalidVolume";
    /// OURS: `readyToUse` was true but no node reports a Done cut, so no round of ours
    /// published it (another writer set it): set back to false and reported.
    pub const READY_WITHOUT_CUT: &str = "ReadyWithoutCut";
    /// Every reason the manager writes, for validation tests.
    pub const ALL: &[&str] = &[
        SNAPSHOT_READY,
        VOLUME_NOT_FOUND,
        WAITING_FOR_REPLICAS,
        WAITING_FOR_ROUND,
        BARRIER_RAISED,
        BARRIER_EXPIRED,
        AGENT_SILENT,
        CUT_FAILED,
        TEARDOWN_PENDING,
        INVALID_VOLUME,
        READY_WITHOUT_CUT,
    ];
}

/// Event reasons the manager emits (docs/snapshot.md, "Conditions and events").
pub mod event {
    pub const ROUND_OPENED: &str = "RoundOpened";
    pub const ROUND_SUCCEEDED: &str = "RoundSucceeded";
    pub const ROUND_VOIDED: &str = "RoundVoided";
    /// OURS: a forged `readyToUse` was set back to false (the condition reason of the same name).
    pub const READY_WITHOUT_CUT: &str = super::reason::READY_WITHOUT_CUT;
}

fn list(nodes: &[String]) -> String {
    nodes.join(", ")
}

/// Nodes named by this snapshot's teardown finalizers.
pub fn teardown_nodes(s: &MiroirSnapshot) -> Vec<String> {
    s.finalizers()
        .iter()
        .filter_map(|f| f.strip_prefix(FINALIZER_PREFIX))
        .map(str::to_string)
        .collect()
}

/// Whether `node` can form its teardown finalizer: the API server refuses a finalizer whose
/// name part (`teardown-<node>`) is over 63 characters or is not letters, digits, `-`, `_` and
/// `.` ending in a letter or digit, so such a node could never be protected.
pub fn finalizer_node_ok(node: &str) -> bool {
    crate::k8s_names::is_qualified_name(&teardown_finalizer(node))
}

/// The heartbeat age of `node`'s agent, None if it never renewed.
fn heartbeat_age(o: &Observed<'_>, node: &str) -> Option<Duration> {
    o.heartbeats.get(node).map(|t| elapsed(*t, o.now))
}

fn is_stale(o: &Observed<'_>, s: &Settings, node: &str) -> bool {
    heartbeat_age(o, node).is_none_or(|age| age >= s.agent_stale_after)
}

/// When the first of these (currently fresh) heartbeats turns stale.
fn next_staleness(o: &Observed<'_>, s: &Settings, nodes: &[String]) -> Option<Timestamp> {
    nodes
        .iter()
        .filter(|n| !is_stale(o, s, n))
        .filter_map(|n| o.heartbeats.get(n.as_str()))
        .map(|t| after(*t, s.agent_stale_after))
        .min()
}

/// Row 8a: when `node`'s leg of the round stamped `stamp` counts as silent: K after the later of
/// its agent's last heartbeat and the open (an agent renews every few seconds while a round
/// names it, so a live one is never K behind). None when K is 0 (turned off).
fn silent_at(o: &Observed<'_>, s: &Settings, node: &str, stamp: Timestamp) -> Option<Timestamp> {
    if s.round_stale_after.is_zero() {
        return None;
    }
    let from = o.heartbeats.get(node).map_or(stamp, |b| (*b).max(stamp));
    Some(after(from, s.round_stale_after))
}

/// Gate 4b: after a void for a silent leg (row 8a; the `Ready` reason it wrote, `AgentSilent`,
/// stays until the next open), a diskful leg whose agent has not renewed since the void keeps
/// the next round shut until it beats: reopening with a dead leg would suspend the live ones for
/// K once more. A live agent renews within the backoff B (30 s, more than the 20 s heartbeat
/// interval); the silent one last beat at least K before the void. Not `voided - K`: the stamp
/// is cut to whole seconds, so a leg whose last beat fell in the second before the open could
/// pass that and be voided a second time (the e2e test did). Voids for other causes keep the
/// old behaviour: the next round opens after B.
fn silent_since_void(o: &Observed<'_>, node: &str, voided: Timestamp) -> bool {
    o.heartbeats.get(node).is_none_or(|b| *b < voided)
}

/// The last void was for a silent leg: its `AgentSilent` reason is still the `Ready` condition.
fn voided_as_silent(snap: &MiroirSnapshot) -> bool {
    snap.status.as_ref().is_some_and(|st| {
        crate::conditions::find(&st.conditions, super::types::READY)
            .is_some_and(|c| c.reason == reason::AGENT_SILENT)
    })
}

fn stale_message(o: &Observed<'_>, node: &str) -> String {
    match heartbeat_age(o, node) {
        Some(age) => format!(
            "{node}: no snapshot agent heartbeat for {}; is ucm snapshot-agent running there?",
            human(age)
        ),
        None => {
            format!("{node}: no snapshot agent heartbeat; is ucm snapshot-agent running there?")
        }
    }
}

/// Open gate 5 (docs/snapshot.md, "Open gates"), read from the volume status: the first failing
/// diskful node and why.
fn replica_health(volume: &MiroirVolume, diskful: &[String]) -> Option<String> {
    let per_node = volume.status.as_ref().map(|st| &st.per_node)?;
    for n in diskful {
        let Some(ns) = per_node.get(n) else { continue };
        if ns.device_created == Some(false) {
            return Some(format!("{n}: the volume's device is not created yet"));
        }
        if ns.split_brain == Some(true) {
            return Some(format!(
                "{n}: DRBD reports split brain; resolve it before this volume can be snapshotted"
            ));
        }
        if volume.is_replicated()
            && let Some(ds) = ns.disk_state.as_deref()
            && ds != "UpToDate"
        {
            return Some(format!(
                "{n}: disk state is {ds}; waiting for UpToDate (resync in progress?)"
            ));
        }
    }
    None
}

fn open_message(stamp: Timestamp, deadline: Duration, diskful: &[String]) -> String {
    format!(
        "round open since {} on {}; deadline {}",
        clock(stamp),
        list(diskful),
        clock(after(stamp, deadline))
    )
}

/// The manager's decision for one snapshot (docs/snapshot.md, "Manager states"; first match wins).
pub fn decide(o: &Observed<'_>, s: &Settings) -> Decision {
    let snap = o.snapshot;
    let r = RoundView::of(snap);

    // Row 1: deleting. The agents tear down; the manager only reports a stuck teardown.
    if snap.metadata.deletion_timestamp.is_some() {
        let remaining = teardown_nodes(snap);
        if let Some(dead) = remaining.iter().find(|n| is_stale(o, s, n)) {
            let msg = format!(
                "{} remains and the agent on {dead} is down; if the node is gone for good, delete its backend snapshot and remove the finalizer by hand",
                teardown_finalizer(dead).trim_start_matches("miroir.home-operations.com/")
            );
            return Decision::wait(Some(Ready::new(false, reason::TEARDOWN_PENDING, msg)), None);
        }
        return Decision::wait(None, next_staleness(o, s, &remaining));
    }

    // Row 2: published snapshots never change (I13). A `readyToUse` no round of ours wrote
    // (no slot says Done) is a stranger's: CSI consumers read the boolean, so it is set back to
    // false, once, with a Warning; rows 3-13 then cut the snapshot for real.
    if r.ready {
        let cut: Vec<String> = r
            .slots
            .iter()
            .filter(|(_, st)| **st == SlotState::Done)
            .map(|(n, _)| n.clone())
            .collect();
        if cut.is_empty() {
            let msg = "status.readyToUse was true but no node reports a Done cut in status.perNode: no snapshot round published it, so it held no data; set back to false, a round will cut it";
            return Decision {
                step: Step::Unpublish,
                ready: Some(Ready::new(false, reason::READY_WITHOUT_CUT, msg)),
                event: Some(Event {
                    warning: true,
                    reason: event::READY_WITHOUT_CUT,
                    note: msg.to_string(),
                }),
                result: None,
                requeue_at: None,
            };
        }
        let msg = format!("cut on {}", list(&cut));
        return Decision::wait(Some(Ready::new(true, reason::SNAPSHOT_READY, msg)), None);
    }

    // Row 3 (no write of its own): until the first status write, `readyToUse` and `ioSuspended`
    // count as false; whichever write comes first (a condition, or the open) makes them present.

    // Row 4: the volume's own watch brings us back.
    let Some(volume) = o.volume else {
        let msg = format!(
            "MiroirVolume {} not found; create it or delete this snapshot",
            snap.spec.volume_name
        );
        return Decision::wait(Some(Ready::new(false, reason::VOLUME_NOT_FOUND, msg)), None);
    };

    // Row 5: a finalizer for every replica node, before any open.
    let mut finalizers: Vec<String> = snap.finalizers().to_vec();
    let mut missing = false;
    for n in volume.replica_nodes() {
        let f = teardown_finalizer(&n);
        if !finalizers.contains(&f) {
            // OURS: the API server would refuse the finalizer on every pass; say so instead.
            if !finalizer_node_ok(&n) {
                let msg = format!(
                    "MiroirVolume {}: replica node {n:?} cannot carry the teardown finalizer {f:?} (node names of at most 54 letters, digits, '-', '_' or '.', ending in a letter or digit); fix the volume's spec.replicas or delete this snapshot",
                    snap.spec.volume_name
                );
                return Decision::wait(Some(Ready::new(false, reason::INVALID_VOLUME, msg)), None);
            }
            finalizers.push(f);
            missing = true;
        }
    }
    if missing {
        return Decision {
            step: Step::SetFinalizers(finalizers),
            ready: None,
            event: None,
            result: None,
            requeue_at: None,
        };
    }

    let diskful = volume.diskful_nodes();
    let stamp = r.suspended_at.and_then(parse_stamp);

    if r.io_suspended {
        let round = r.suspended_at.unwrap_or_default().to_string();
        let void =
            |cause: VoidCause, msg: String, result: RoundResult, why: &'static str| Decision {
                step: Step::Void {
                    round: round.clone(),
                    cause,
                    stamp: format_stamp(o.now),
                    diskful: diskful.clone(),
                },
                ready: Some(Ready::new(false, why, msg.clone())),
                event: Some(Event {
                    warning: true,
                    reason: event::ROUND_VOIDED,
                    note: msg,
                }),
                result: Some(result),
                requeue_at: Some(after(whole_seconds(o.now), s.void_backoff)),
            };
        let retry_at = clock(after(whole_seconds(o.now), s.void_backoff));

        // Row 6: an Error slot voids the round at once (I6).
        if let Some(node) = r.first_error() {
            let msg = format!(
                "{node} reported Error; see its Warning events on this object; retry at {retry_at}"
            );
            return void(
                VoidCause::Failed,
                msg,
                RoundResult::Failed,
                reason::CUT_FAILED,
            );
        }

        // Row 7: complete rounds ship, also after the deadline.
        if r.all_diskful_in(&diskful, &[SlotState::Done]) {
            let slots: BTreeMap<String, SlotState> = r
                .slots
                .iter()
                .filter(|(n, _)| diskful.contains(n))
                .map(|(n, st)| (n.clone(), *st))
                .collect();
            let took = stamp.map(|t| elapsed(t, o.now)).unwrap_or_default();
            return Decision {
                step: Step::Publish {
                    round,
                    size_bytes: volume.spec.size_bytes,
                    source_formatted: volume
                        .status
                        .as_ref()
                        .and_then(|st| st.formatted)
                        .unwrap_or(false),
                    slots,
                },
                ready: Some(Ready::new(
                    true,
                    reason::SNAPSHOT_READY,
                    format!("cut on {}", list(&diskful)),
                )),
                event: Some(Event {
                    warning: false,
                    reason: event::ROUND_SUCCEEDED,
                    note: format!("round completed in {} on {}", human(took), list(&diskful)),
                }),
                result: Some(RoundResult::Success),
                requeue_at: None,
            };
        }

        // Row 8: the deadline (an unreadable stamp counts as expired).
        let deadline = stamp.map(|t| after(t, s.deadline));
        if deadline.is_none_or(|d| o.now >= d) {
            if !o.fresh {
                return Decision {
                    step: Step::ReRead,
                    ready: None,
                    event: None,
                    result: None,
                    requeue_at: None,
                };
            }
            let late: Vec<String> = diskful
                .iter()
                .filter(|n| r.slot(n) != Some(SlotState::Done))
                .map(|n| match r.slot(n) {
                    Some(st) => format!("{n} (last state {st})"),
                    None => format!("{n} (no slot)"),
                })
                .collect();
            let msg = format!(
                "barrier expired after {}s; {} did not finish; retry at {retry_at}",
                s.deadline.as_secs(),
                list(&late)
            );
            return void(
                VoidCause::Expired,
                msg,
                RoundResult::Expired,
                reason::BARRIER_EXPIRED,
            );
        }

        // Row 8a (ours): a leg not yet Done whose agent went silent in the round (a killed
        // agent, a node powered off) voids it now instead of at the deadline, so the other legs
        // resume at once (docs/snapshot.md, "Deadline, void and recovery"). Like row 8, only on
        // an uncached read: a cached copy may miss the leg's Done.
        let pending: Vec<&String> = diskful
            .iter()
            .filter(|n| r.slot(n) != Some(SlotState::Done))
            .collect();
        let t = stamp.unwrap_or(o.now);
        if let Some(dead) = pending
            .iter()
            .find(|n| silent_at(o, s, n, t).is_some_and(|at| o.now >= at))
        {
            if !o.fresh {
                return Decision {
                    step: Step::ReRead,
                    ready: None,
                    event: None,
                    result: None,
                    requeue_at: None,
                };
            }
            let quiet = match heartbeat_age(o, dead) {
                Some(age) => format!("no snapshot agent heartbeat for {}", human(age)),
                None => "no snapshot agent heartbeat".to_string(),
            };
            let msg = format!(
                "{dead}: {quiet} during the round (last state {}); voided before the deadline so the other legs resume; retry at {retry_at}",
                r.slot(dead)
                    .map_or_else(|| "no slot".to_string(), |st| st.to_string())
            );
            return void(
                VoidCause::Silent,
                msg,
                RoundResult::Silent,
                reason::AGENT_SILENT,
            );
        }

        // Row 9: nothing to do but wait for slots, a silent leg or the deadline. The message is
        // fixed for the whole round so slot changes cause no extra status writes under the
        // barrier.
        let ts = stamp.unwrap_or(o.now);
        let msg = open_message(ts, s.deadline, &diskful_of_round(&r, &diskful));
        let next_silence = pending.iter().filter_map(|n| silent_at(o, s, n, t)).min();
        let requeue = match (deadline, next_silence) {
            (Some(d), Some(q)) => Some(d.min(q)),
            (d, q) => d.or(q),
        };
        return Decision::wait(
            Some(Ready::new(false, reason::BARRIER_RAISED, msg)),
            requeue,
        );
    }

    // Row 10: backoff after a void.
    if let Some(t) = stamp {
        let reopen = after(t, s.void_backoff);
        if o.now < reopen {
            return Decision::wait(None, Some(reopen));
        }
    }

    // Row 11: open gates 2, 4 and 5.
    if diskful.is_empty() {
        let msg = format!(
            "MiroirVolume {} has no diskful replica; nothing to cut",
            volume.name_any()
        );
        return Decision::wait(
            Some(Ready::new(false, reason::WAITING_FOR_REPLICAS, msg)),
            None,
        );
    }
    if let Some(dead) = diskful.iter().find(|n| is_stale(o, s, n)) {
        let msg = stale_message(o, dead);
        return Decision::wait(
            Some(Ready::new(false, reason::WAITING_FOR_REPLICAS, msg)),
            None,
        );
    }
    if let Some(voided) = stamp
        && voided_as_silent(snap)
        && let Some(dead) = diskful.iter().find(|n| silent_since_void(o, n, voided))
    {
        let msg = format!(
            "{dead}: no snapshot agent heartbeat since the round was voided for its silence ({}); the next round waits for one; is ucm snapshot-agent running there?",
            clock(voided)
        );
        return Decision::wait(Some(Ready::new(false, reason::AGENT_SILENT, msg)), None);
    }
    if let Some(msg) = replica_health(volume, &diskful) {
        return Decision::wait(
            Some(Ready::new(false, reason::WAITING_FOR_REPLICAS, msg)),
            None,
        );
    }

    // Row 12: one round per volume (I8).
    if let Some(other) = o.other_round {
        let msg = format!(
            "volume {} is being snapshotted by {other}; this snapshot follows",
            volume.name_any()
        );
        return Decision::wait(
            Some(Ready::new(false, reason::WAITING_FOR_ROUND, msg)),
            None,
        );
    }

    // Row 13: open. A new stamp must differ from the last one (docs/snapshot.md, "Objects").
    let now = whole_seconds(o.now);
    if let Some(prev) = stamp
        && now <= prev
    {
        return Decision::wait(None, Some(after(prev, Duration::from_secs(1))));
    }
    Decision {
        step: Step::Open {
            stamp: format_stamp(now),
            diskful: diskful.clone(),
        },
        ready: Some(Ready::new(
            false,
            reason::BARRIER_RAISED,
            open_message(now, s.deadline, &diskful),
        )),
        event: Some(Event {
            warning: false,
            reason: event::ROUND_OPENED,
            note: format!("round opened on {}", list(&diskful)),
        }),
        result: None,
        requeue_at: Some(after(now, s.deadline)),
    }
}

/// The diskful legs of an open round as its slots list them at open (so the row 9 message
/// equals the one the open wrote), falling back to the volume's current diskful nodes.
fn diskful_of_round(r: &RoundView<'_>, diskful: &[String]) -> Vec<String> {
    let from_slots: Vec<String> = diskful
        .iter()
        .filter(|n| r.slots.contains_key(n.as_str()))
        .cloned()
        .collect();
    if from_slots.is_empty() {
        diskful.to_vec()
    } else {
        from_slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::types::{MiroirSnapshotSpec, MiroirSnapshotStatus};
    use serde_json::json;

    const T0: &str = "2025-03-01T10:00:00Z";

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(ts(T0).as_second() + secs).unwrap()
    }

    fn volume(replicas: serde_json::Value, status: serde_json::Value) -> MiroirVolume {
        serde_json::from_value(json!({
            "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirVolume",
            "metadata": {"name": "pvc-1"},
            "spec": {"sizeBytes": 4096, "replicas": replicas},
            "status": status,
        }))
        .unwrap()
    }

    fn three() -> MiroirVolume {
        volume(
            json!([{"node": "a", "backend": "loopfile"}, {"node": "b", "backend": "loopfile"},
                   {"node": "c", "backend": "loopfile"}, ]),
            json!({"formatted": true}),
        )
    }

    fn snap() -> MiroirSnapshot {
        let mut s = MiroirSnapshot::new(
            "snap-1",
            MiroirSnapshotSpec {
                volume_name: "pvc-1".into(),
            },
        );
        s.metadata.uid = Some("uid-1".into());
        s.metadata.resource_version = Some("10".into());
        s.metadata.finalizers = Some(
            ["a", "b", "c"]
                .iter()
                .map(|n| teardown_finalizer(n))
                .collect(),
        );
        s.status = Some(MiroirSnapshotStatus {
            ready_to_use: Some(false),
            io_suspended: Some(false),
            ..Default::default()
        });
        s
    }

    fn with_round(
        mut s: MiroirSnapshot,
        open: bool,
        at: &str,
        slots: &[(&str, SlotState)],
    ) -> MiroirSnapshot {
        let st = s.status.get_or_insert_with(Default::default);
        st.io_suspended = Some(open);
        st.suspended_at = Some(at.into());
        st.per_node = Some(slots.iter().map(|(n, s)| (n.to_string(), *s)).collect());
        s
    }

    fn beats(now: Timestamp) -> BTreeMap<String, Timestamp> {
        ["a", "b", "c"]
            .iter()
            .map(|n| (n.to_string(), now))
            .collect()
    }

    struct Case {
        snap: MiroirSnapshot,
        volume: Option<MiroirVolume>,
        heartbeats: BTreeMap<String, Timestamp>,
        other: Option<&'static str>,
        fresh: bool,
        now: Timestamp,
        settings: Settings,
    }

    impl Case {
        fn new(snap: MiroirSnapshot, now: Timestamp) -> Self {
            Case {
                snap,
                volume: Some(three()),
                heartbeats: beats(now),
                other: None,
                fresh: false,
                now,
                settings: Settings::default(),
            }
        }
        fn decide(&self) -> Decision {
            decide(
                &Observed {
                    snapshot: &self.snap,
                    volume: self.volume.as_ref(),
                    heartbeats: &self.heartbeats,
                    other_round: self.other,
                    fresh: self.fresh,
                    now: self.now,
                },
                &self.settings,
            )
        }
    }

    use SlotState::*;

    fn reason_of(d: &Decision) -> Option<&'static str> {
        d.ready.as_ref().map(|r| r.reason)
    }

    #[test]
    fn row13_opens_with_every_diskful_node_pending() {
        let d = Case::new(snap(), at(0)).decide();
        assert_eq!(
            d.step,
            Step::Open {
                stamp: T0.into(),
                diskful: vec!["a".into(), "b".into(), "c".into()]
            }
        );
        let ready = d.ready.unwrap();
        assert_eq!(
            (ready.status, ready.reason),
            (false, reason::BARRIER_RAISED)
        );
        assert_eq!(
            ready.message,
            "round open since 10:00:00Z on a, b, c; deadline 10:01:00Z"
        );
        assert_eq!(d.event.unwrap().reason, event::ROUND_OPENED);
        assert_eq!(d.requeue_at, Some(at(60)));
    }

    #[test]
    fn open_stamp_has_second_precision_and_always_moves_on() {
        let now: Timestamp = "2025-03-01T10:00:00.750Z".parse().unwrap();
        let d = Case::new(snap(), now).decide();
        assert!(matches!(d.step, Step::Open { ref stamp, .. } if stamp == T0));
        // Without a backoff, a void stamped this very second must not be reused as the open
        // stamp: wait for the next second.
        let s = with_round(snap(), false, T0, &[("a", Pending)]);
        let mut c = Case::new(s, now);
        c.settings.void_backoff = Duration::ZERO;
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        assert_eq!(d.requeue_at, Some(at(1)));
        c.now = at(1);
        assert!(
            matches!(c.decide().step, Step::Open { ref stamp, .. } if stamp == "2025-03-01T10:00:01Z")
        );
    }

    #[test]
    fn row1_deleting_reports_only_dead_agents() {
        let mut s = snap();
        s.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(0)));
        let mut c = Case::new(s, at(10));
        c.heartbeats.insert("a".into(), at(5));
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        assert_eq!(d.ready, None);
        // Node a's heartbeat goes stale first, at 5 + 60.
        assert_eq!(d.requeue_at, Some(at(65)));
        c.heartbeats.remove("c");
        let d = c.decide();
        let r = d.ready.unwrap();
        assert_eq!((r.status, r.reason), (false, reason::TEARDOWN_PENDING));
        assert_eq!(
            r.message,
            "teardown-c remains and the agent on c is down; if the node is gone for good, delete its backend snapshot and remove the finalizer by hand"
        );
    }

    #[test]
    fn row2_ready_is_terminal() {
        let mut s = with_round(snap(), false, T0, &[("a", Done), ("b", Done), ("c", Done)]);
        s.status.as_mut().unwrap().ready_to_use = Some(true);
        let mut c = Case::new(s, at(500));
        c.volume = None; // even without the volume
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        assert_eq!(d.ready.unwrap().reason, reason::SNAPSHOT_READY);
        assert_eq!(d.requeue_at, None);
    }

    #[test]
    fn row2_a_forged_ready_is_set_back_to_false_once() {
        // Forged on a snapshot never initialised, on one waiting, and during an open round.
        let mut never = snap();
        never.status = Some(MiroirSnapshotStatus {
            ready_to_use: Some(true),
            ..Default::default()
        });
        let mut waiting = snap();
        waiting.status.as_mut().unwrap().ready_to_use = Some(true);
        let mut open = with_round(snap(), true, T0, &[("a", Suspended), ("b", Pending)]);
        open.status.as_mut().unwrap().ready_to_use = Some(true);
        for s in [never, waiting, open] {
            let mut c = Case::new(s.clone(), at(5));
            c.volume = None;
            let d = c.decide();
            assert_eq!(d.step, Step::Unpublish, "{s:?}");
            assert_eq!(reason_of(&d), Some(reason::READY_WITHOUT_CUT));
            assert!(!d.ready.as_ref().unwrap().status);
            let ev = d.event.expect("one Warning for the correction");
            assert!(ev.warning && ev.reason == event::READY_WITHOUT_CUT);
            // The correction's own write, then the table again: not ready, never corrected twice.
            let mut doc = serde_json::to_value(&s).unwrap();
            let p = crate::snapshot::round::unpublish_patch("uid-1", "10", &[]);
            json_patch::patch(
                &mut doc,
                &serde_json::from_value::<json_patch::Patch>(p).unwrap(),
            )
            .unwrap();
            let next: MiroirSnapshot = serde_json::from_value(doc).unwrap();
            let st = next.status.as_ref().unwrap();
            assert_eq!(
                (st.ready_to_use, st.io_suspended),
                (Some(false), Some(false))
            );
            let d2 = Case::new(next, at(5)).decide();
            assert_ne!(d2.step, Step::Unpublish);
        }
    }

    #[test]
    fn row3_the_first_write_makes_the_flags_present() {
        // No status yet: the snapshot opens at once, in one write that also makes readyToUse
        // and ioSuspended present (round::open_patch_of picks the resourceVersion fence).
        let mut s = snap();
        s.status = None;
        let d = Case::new(s.clone(), at(0)).decide();
        let Step::Open { stamp, diskful } = &d.step else {
            panic!("{d:?}")
        };
        let mut doc = serde_json::to_value(&s).unwrap();
        let p = crate::snapshot::round::open_patch_of(&s, stamp, diskful, &[]);
        json_patch::patch(
            &mut doc,
            &serde_json::from_value::<json_patch::Patch>(p).unwrap(),
        )
        .unwrap();
        let next: MiroirSnapshot = serde_json::from_value(doc).unwrap();
        let st = next.status.as_ref().unwrap();
        assert_eq!(
            (st.ready_to_use, st.io_suspended),
            (Some(false), Some(true))
        );
        // A waiting one writes its condition with the flags (apply's init_patch).
        let mut c = Case::new(s, at(0));
        c.volume = None;
        let d = c.decide();
        assert_eq!(
            (&d.step, reason_of(&d)),
            (&Step::Wait, Some(reason::VOLUME_NOT_FOUND))
        );
    }

    #[test]
    fn row4_volume_missing() {
        let mut c = Case::new(snap(), at(0));
        c.volume = None;
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        let r = d.ready.unwrap();
        assert_eq!(r.reason, reason::VOLUME_NOT_FOUND);
        assert_eq!(
            r.message,
            "MiroirVolume pvc-1 not found; create it or delete this snapshot"
        );
        assert_eq!(d.requeue_at, None);
    }

    #[test]
    fn row5_a_node_that_cannot_carry_a_finalizer_is_reported() {
        for bad in ["", &"n".repeat(55), "node/a", "node-", "Node A"] {
            let mut s = snap();
            s.metadata.finalizers = None;
            let mut c = Case::new(s, at(0));
            c.volume = Some(volume(
                json!([{"node": "a", "backend": "zfs"}, {"node": bad, "backend": "zfs"}]),
                json!({}),
            ));
            let d = c.decide();
            assert_eq!(d.step, Step::Wait, "{bad:?}");
            let r = d.ready.unwrap();
            assert_eq!(r.reason, reason::INVALID_VOLUME);
            assert!(r.message.contains(&format!("{bad:?}")), "{}", r.message);
            assert!(r.message.contains("fix the volume's spec.replicas"));
        }
        for ok in ["a", &"n".repeat(54), "ip-10-0-0-1.ec2.internal", "Node_A"] {
            assert!(finalizer_node_ok(ok), "{ok}");
        }
    }

    #[test]
    fn row5_finalizers_before_the_first_open_and_for_new_replicas() {
        let mut s = snap();
        s.metadata.finalizers = Some(vec!["other/keep".into(), teardown_finalizer("a")]);
        let mut c = Case::new(s, at(0));
        c.volume = Some(volume(
            json!([{"node": "a", "backend": "zfs"}, {"node": "b", "backend": "zfs"},
                   {"node": "t", "diskless": true}]),
            json!({}),
        ));
        let d = c.decide();
        assert_eq!(
            d.step,
            Step::SetFinalizers(vec![
                "other/keep".into(),
                teardown_finalizer("a"),
                teardown_finalizer("b"),
                teardown_finalizer("t"),
            ])
        );
        assert_eq!(d.ready, None);
    }

    #[test]
    fn row6_error_slot_voids_with_cut_failed() {
        let s = with_round(snap(), true, T0, &[("a", Done), ("b", Error), ("c", Done)]);
        let d = Case::new(s, at(10)).decide();
        assert_eq!(
            d.step,
            Step::Void {
                round: T0.into(),
                cause: VoidCause::Failed,
                stamp: "2025-03-01T10:00:10Z".into(),
                diskful: vec!["a".into(), "b".into(), "c".into()],
            }
        );
        let r = d.ready.unwrap();
        assert_eq!(r.reason, reason::CUT_FAILED);
        assert_eq!(
            r.message,
            "b reported Error; see its Warning events on this object; retry at 10:00:40Z"
        );
        let e = d.event.unwrap();
        assert!(e.warning);
        assert_eq!(
            (e.reason, e.note.as_str()),
            (event::ROUND_VOIDED, r.message.as_str())
        );
        assert_eq!(d.result, Some(RoundResult::Failed));
        assert_eq!(d.requeue_at, Some(at(40)));
    }

    #[test]
    fn row7_publishes_when_every_diskful_slot_is_done() {
        let mut v = volume(
            json!([{"node": "a", "backend": "loopfile"}, {"node": "b", "backend": "loopfile"},
                   {"node": "t", "diskless": true}]),
            json!({"formatted": true}),
        );
        v.spec.size_bytes = 1 << 30;
        let mut s = with_round(
            snap(),
            true,
            T0,
            &[("a", Done), ("b", Done), ("t", Suspended)],
        );
        s.metadata.finalizers = Some(
            ["a", "b", "t"]
                .iter()
                .map(|n| teardown_finalizer(n))
                .collect(),
        );
        let mut c = Case::new(s, at(3));
        c.volume = Some(v);
        let d = c.decide();
        assert_eq!(
            d.step,
            Step::Publish {
                round: T0.into(),
                size_bytes: 1 << 30,
                source_formatted: true,
                slots: [("a".to_string(), Done), ("b".to_string(), Done)].into(),
            }
        );
        let r = d.ready.unwrap();
        assert_eq!(
            (r.status, r.reason, r.message.as_str()),
            (true, reason::SNAPSHOT_READY, "cut on a, b")
        );
        assert_eq!(d.event.unwrap().note, "round completed in 3s on a, b");
        assert_eq!(d.result, Some(RoundResult::Success));
        assert_eq!(d.requeue_at, None);
    }

    #[test]
    fn row7_not_while_a_diskful_slot_is_missing_or_suspended() {
        let s = with_round(snap(), true, T0, &[("a", Done), ("b", Done)]);
        let d = Case::new(s, at(3)).decide();
        assert_eq!(d.step, Step::Wait);
        let s = with_round(
            snap(),
            true,
            T0,
            &[("a", Done), ("b", Done), ("c", Suspended)],
        );
        let d = Case::new(s, at(3)).decide();
        assert_eq!(d.step, Step::Wait);
        assert_eq!(reason_of(&d), Some(reason::BARRIER_RAISED));
    }

    #[test]
    fn t9_complete_round_ships_after_the_deadline() {
        let s = with_round(snap(), true, T0, &[("a", Done), ("b", Done), ("c", Done)]);
        let d = Case::new(s, at(75)).decide();
        assert!(matches!(d.step, Step::Publish { .. }));
    }

    #[test]
    fn row8_expiry_rereads_then_voids_naming_the_late_leg() {
        let s = with_round(
            snap(),
            true,
            T0,
            &[("a", Done), ("b", Done), ("c", Suspended)],
        );
        let mut c = Case::new(s, at(60));
        assert_eq!(c.decide().step, Step::ReRead);
        c.fresh = true;
        let d = c.decide();
        assert!(
            matches!(d.step, Step::Void { cause: VoidCause::Expired, ref stamp, .. } if stamp == "2025-03-01T10:01:00Z")
        );
        let r = d.ready.unwrap();
        assert_eq!(r.reason, reason::BARRIER_EXPIRED);
        assert_eq!(
            r.message,
            "barrier expired after 60s; c (last state Suspended) did not finish; retry at 10:01:30Z"
        );
        assert_eq!(d.result, Some(RoundResult::Expired));
        assert_eq!(d.requeue_at, Some(at(90)));
    }

    #[test]
    fn row8_unreadable_stamp_counts_as_expired() {
        let s = with_round(snap(), true, "garbage", &[("a", Pending)]);
        let mut c = Case::new(s, at(0));
        c.fresh = true;
        assert!(
            matches!(c.decide().step, Step::Void { cause: VoidCause::Expired, ref round, .. } if round == "garbage")
        );
    }

    #[test]
    fn row9_waits_for_the_deadline_with_a_fixed_message() {
        let s = with_round(
            snap(),
            true,
            T0,
            &[("a", Pending), ("b", Pending), ("c", Pending)],
        );
        let d1 = Case::new(s, at(1)).decide();
        let s = with_round(
            snap(),
            true,
            T0,
            &[("a", Done), ("b", Suspended), ("c", Suspended)],
        );
        let d2 = Case::new(s, at(20)).decide();
        assert_eq!(d1.step, Step::Wait);
        // Every agent beat just now: look again when the first could fall silent (row 8a).
        assert_eq!(d1.requeue_at, Some(at(11)));
        let mut quiet = Case::new(with_round(snap(), true, T0, &[("a", Pending)]), at(1));
        quiet.settings.round_stale_after = Duration::ZERO;
        assert_eq!(
            quiet.decide().requeue_at,
            Some(at(60)),
            "K = 0: the deadline"
        );
        assert_eq!(d1.ready, d2.ready);
        // The open wrote the same message, so row 9 causes no status write.
        let open = Case::new(snap(), at(0)).decide();
        assert_eq!(open.ready, d1.ready);
    }

    #[test]
    fn row8a_a_silent_leg_voids_before_the_deadline() {
        let s = with_round(
            snap(),
            true,
            T0,
            &[("a", Suspended), ("b", Suspended), ("c", Pending)],
        );
        // c's agent last beat 5 s before the open; a and b beat all along.
        let mut c = Case::new(s, at(9));
        c.heartbeats.insert("c".into(), at(-5));
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        assert_eq!(reason_of(&d), Some(reason::BARRIER_RAISED));
        assert_eq!(d.requeue_at, Some(at(10)), "K after the open, not the beat");
        c.now = at(10);
        c.heartbeats.insert("a".into(), at(10));
        c.heartbeats.insert("b".into(), at(10));
        assert_eq!(c.decide().step, Step::ReRead, "only on an uncached read");
        c.fresh = true;
        let d = c.decide();
        assert!(
            matches!(d.step, Step::Void { cause: VoidCause::Silent, ref round, ref stamp, .. }
                if round == T0 && stamp == "2025-03-01T10:00:10Z")
        );
        let r = d.ready.unwrap();
        assert_eq!(r.reason, reason::AGENT_SILENT);
        assert_eq!(
            r.message,
            "c: no snapshot agent heartbeat for 15s during the round (last state Pending); voided before the deadline so the other legs resume; retry at 10:00:40Z"
        );
        assert_eq!(d.result, Some(RoundResult::Silent));
        assert_eq!(d.event.unwrap().reason, event::ROUND_VOIDED);
        assert_eq!(d.requeue_at, Some(at(40)));
    }

    #[test]
    fn row8a_counts_from_the_last_beat_and_ignores_done_legs() {
        // b beat at 20 during the round, then died: silent at 30, not at 10.
        let s = with_round(
            snap(),
            true,
            T0,
            &[("a", Suspended), ("b", Suspended), ("c", Done)],
        );
        let mut c = Case::new(s, at(25));
        c.fresh = true;
        c.heartbeats.insert("b".into(), at(20));
        // c is Done: its agent may die, the round completes without it.
        c.heartbeats.insert("c".into(), at(-100));
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        assert_eq!(d.requeue_at, Some(at(30)));
        c.now = at(30);
        c.heartbeats.insert("a".into(), at(30));
        assert!(matches!(
            c.decide().step,
            Step::Void {
                cause: VoidCause::Silent,
                ..
            }
        ));
        // With K = 0 the round runs to its deadline.
        c.settings.round_stale_after = Duration::ZERO;
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        assert_eq!(d.requeue_at, Some(at(60)));
        // An agent that never beat is silent K after the open.
        let s = with_round(
            snap(),
            true,
            T0,
            &[("a", Pending), ("b", Pending), ("c", Pending)],
        );
        let mut c = Case::new(s, at(10));
        c.fresh = true;
        c.heartbeats.remove("b");
        let d = c.decide();
        assert!(matches!(
            d.step,
            Step::Void {
                cause: VoidCause::Silent,
                ..
            }
        ));
        assert!(
            d.ready.unwrap().message.starts_with(
                "b: no snapshot agent heartbeat during the round (last state Pending);"
            )
        );
    }

    #[test]
    fn gate4b_after_a_void_a_silent_leg_must_beat_again() {
        // Voided at 0 with c silent (its last beat at -8, in the second before the open at -9:
        // stamps are whole seconds); the backoff is over at 30, and c's beat is younger than
        // --snapshot-agent-stale-after, yet reopening would suspend a and b for another K: wait
        // for c's next beat.
        let s = with_round(
            snap(),
            false,
            T0,
            &[("a", Pending), ("b", Pending), ("c", Pending)],
        );
        let mut c = Case::new(s, at(30));
        c.heartbeats.insert("c".into(), at(-8));
        // After a void for another cause (here: none recorded), the round reopens after B.
        assert!(matches!(c.decide().step, Step::Open { .. }));
        c.snap.status.as_mut().unwrap().conditions =
            vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: crate::snapshot::types::READY.into(),
                status: "False".into(),
                reason: reason::AGENT_SILENT.into(),
                message: "c: no snapshot agent heartbeat for 18s during the round".into(),
                observed_generation: None,
                last_transition_time: crate::conditions::now(),
            }];
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        let r = d.ready.unwrap();
        assert_eq!(r.reason, reason::AGENT_SILENT);
        assert_eq!(
            r.message,
            "c: no snapshot agent heartbeat since the round was voided for its silence (10:00:00Z); the next round waits for one; is ucm snapshot-agent running there?"
        );
        assert_eq!(d.requeue_at, None, "its heartbeat wakes the snapshot");
        // Any beat since the void opens it (a live agent beats within the backoff).
        c.heartbeats.insert("c".into(), at(0));
        assert!(matches!(c.decide().step, Step::Open { .. }));
        c.heartbeats.insert("c".into(), at(31));
        c.now = at(31);
        assert!(matches!(c.decide().step, Step::Open { .. }));
    }

    #[test]
    fn row10_backoff_after_a_void() {
        let s = with_round(
            snap(),
            false,
            T0,
            &[("a", Pending), ("b", Pending), ("c", Pending)],
        );
        let d = Case::new(s.clone(), at(29)).decide();
        assert_eq!(d.step, Step::Wait);
        assert_eq!(d.ready, None);
        assert_eq!(d.requeue_at, Some(at(30)));
        let d = Case::new(s, at(30)).decide();
        assert!(matches!(d.step, Step::Open { .. }));
    }

    #[test]
    fn row11_dead_agent_blocks_the_open_naming_the_node() {
        let mut c = Case::new(snap(), at(200));
        c.heartbeats.insert("c".into(), at(70));
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        let r = d.ready.unwrap();
        assert_eq!(r.reason, reason::WAITING_FOR_REPLICAS);
        assert_eq!(
            r.message,
            "c: no snapshot agent heartbeat for 2m10s; is ucm snapshot-agent running there?"
        );
        c.heartbeats.remove("c");
        assert!(
            c.decide()
                .ready
                .unwrap()
                .message
                .starts_with("c: no snapshot agent heartbeat;")
        );
    }

    #[test]
    fn t11_dead_tie_breaker_does_not_block() {
        let mut s = snap();
        s.metadata.finalizers = Some(
            ["a", "b", "t"]
                .iter()
                .map(|n| teardown_finalizer(n))
                .collect(),
        );
        let mut c = Case::new(s, at(0));
        c.volume = Some(volume(
            json!([{"node": "a", "backend": "loopfile"}, {"node": "b", "backend": "loopfile"},
                   {"node": "t", "diskless": true}]),
            json!({"perNode": {"t": {"diskState": "Diskless", "deviceCreated": false}}}),
        ));
        c.heartbeats.remove("t");
        let d = c.decide();
        assert_eq!(
            d.step,
            Step::Open {
                stamp: T0.into(),
                diskful: vec!["a".into(), "b".into()]
            }
        );
    }

    #[test]
    fn t3_open_waits_for_healthy_replicas() {
        let cases = [
            (
                json!({"b": {"deviceCreated": false}}),
                "b: the volume's device is not created yet",
            ),
            (
                json!({"b": {"deviceCreated": true, "diskState": "Inconsistent"}}),
                "b: disk state is Inconsistent; waiting for UpToDate (resync in progress?)",
            ),
            (
                json!({"c": {"deviceCreated": true, "diskState": "UpToDate", "splitBrain": true}}),
                "c: DRBD reports split brain; resolve it before this volume can be snapshotted",
            ),
        ];
        for (per_node, want) in cases {
            let mut c = Case::new(snap(), at(0));
            let mut v = three();
            v.status = Some(serde_json::from_value(json!({"perNode": per_node})).unwrap());
            c.volume = Some(v.clone());
            let d = c.decide();
            assert_eq!(d.step, Step::Wait, "{want}");
            let r = d.ready.unwrap();
            assert_eq!(
                (r.reason, r.message.as_str()),
                (reason::WAITING_FOR_REPLICAS, want)
            );
            // The fix opens the round.
            v.status = Some(
                serde_json::from_value(json!({"perNode": {
                    "a": {"deviceCreated": true, "diskState": "UpToDate", "splitBrain": false},
                    "b": {"deviceCreated": true, "diskState": "UpToDate", "splitBrain": false},
                    "c": {"deviceCreated": true, "diskState": "UpToDate", "splitBrain": false}}}))
                .unwrap(),
            );
            c.volume = Some(v);
            assert!(matches!(c.decide().step, Step::Open { .. }));
        }
    }

    #[test]
    fn unreplicated_volume_ignores_disk_state() {
        let mut c = Case::new(snap(), at(0));
        c.volume = Some(volume(
            json!([{"node": "a", "backend": "lvmthin"}]),
            json!({"perNode": {"a": {"deviceCreated": true}}}),
        ));
        let d = c.decide();
        assert_eq!(
            d.step,
            Step::Open {
                stamp: T0.into(),
                diskful: vec!["a".into()]
            }
        );
    }

    #[test]
    fn no_diskful_replica_waits() {
        let mut s = snap();
        s.metadata.finalizers = Some(vec![teardown_finalizer("t")]);
        let mut c = Case::new(s, at(0));
        c.volume = Some(volume(json!([{"node": "t", "diskless": true}]), json!({})));
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        assert_eq!(
            d.ready.unwrap().message,
            "MiroirVolume pvc-1 has no diskful replica; nothing to cut"
        );
    }

    #[test]
    fn row12_one_round_per_volume() {
        let mut c = Case::new(snap(), at(0));
        c.other = Some("snap-x");
        let d = c.decide();
        assert_eq!(d.step, Step::Wait);
        let r = d.ready.unwrap();
        assert_eq!(r.reason, reason::WAITING_FOR_ROUND);
        assert_eq!(
            r.message,
            "volume pvc-1 is being snapshotted by snap-x; this snapshot follows"
        );
    }

    #[test]
    fn reasons_are_valid_condition_reasons() {
        for r in reason::ALL {
            let ok = r.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                && r.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_,:".contains(c))
                && r.len() <= 1024;
            assert!(ok, "{r}");
        }
    }
}

//! The agent's settings and shared state ([`Context`]): caches, journal, in-memory round memory,
//! and the small lookups every action and the worker use.
//!
//! The agent's [`Settings`] are not the manager's (`snapshot/context.rs`): the agent is another
//! process (`ucm snapshot-agent`, a DaemonSet) with flags of its own (docs/snapshot.md,
//! "Settings and RBAC"); only the deadline D is set on both sides, to the same value.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::runtime::Guarded;
use jiff::Timestamp;
use kube::{
    Api, Resource, ResourceExt,
    runtime::{
        events::{Event as KubeEvent, EventType, Recorder},
        reflector::{ObjectRef, Store},
    },
};
use tokio::sync::Notify;
use tracing::debug;

use super::backend::Backend;
use super::barrier::Barrier;
use super::journal::{Entry, Journal};
use crate::runtime::time::after;
use crate::snapshot::round::{RoundView, elapsed, parse_stamp};
use crate::snapshot::types::{MiroirSnapshot, MiroirVolume, SlotState};

use super::metrics::AgentMetrics;

/// Agent timing (docs/snapshot.md, "Settings and RBAC").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// D: every barrier is lifted this long after `suspendedAt` or after its raise.
    pub deadline: Duration,
    /// G: no cut starts and no `Done` is written within G of the deadline.
    pub cut_guard: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            deadline: Duration::from_secs(60),
            cut_guard: Duration::from_secs(5),
        }
    }
}

/// Agent event reasons (docs/snapshot.md, "Conditions and events").
pub mod event {
    pub const BARRIER_STUCK: &str = "BarrierStuck";
    pub const CUT_FAILED: &str = "CutFailed";
    pub const WAITING_FOR_PRIMARY: &str = "WaitingForPrimary";
    pub const CLOCK_SKEW: &str = "ClockSkew";
    pub const RAISE_REFUSED: &str = "RaiseRefused";
}

pub(super) type RoundKey = (String, String);

/// In-memory state that is safe to lose on restart (the journal and the object hold the rest).
#[derive(Default)]
pub(super) struct Memory {
    /// Monotonic raise time per snapshot uid (this process's raises).
    pub(super) raised: HashMap<String, Instant>,
    /// When this process's freeze (or suspend, without a file system) began, per snapshot uid:
    /// the start of the writers' IO pause (docs/snapshot.md, "Metrics and alert").
    pub(super) paused: HashMap<String, Instant>,
    /// The most advanced slot of each node this agent has written or seen, per round (masks a
    /// stale copy; see [`merge_seen`]).
    pub(super) seen: HashMap<RoundKey, BTreeMap<String, SlotState>>,
    /// Consecutive barrier or cut failures per round.
    pub(super) failures: HashMap<RoundKey, u32>,
    /// When I2 started holding back the cut, and whether the event went out.
    pub(super) held_back: HashMap<RoundKey, (Instant, bool)>,
    /// The kernel's "Primary here" per round, for nodes without a diskful leg.
    pub(super) primary: HashMap<RoundKey, bool>,
    /// Rounds that already emitted ClockSkew, or an Error on stop.
    pub(super) noted: HashMap<(RoundKey, &'static str), ()>,
    /// Lifts that failed (BarrierStuck sent once per entry).
    pub(super) stuck: HashMap<String, ()>,
}

pub(super) struct Context {
    pub(super) node: String,
    pub(super) settings: Settings,
    pub(super) fail_limit: u32,
    pub(super) snapshots: Api<MiroirSnapshot>,
    pub(super) snap_store: Store<Guarded<MiroirSnapshot>>,
    pub(super) vol_store: Store<Guarded<MiroirVolume>>,
    pub(super) barrier: Arc<dyn Barrier>,
    pub(super) pools: BTreeMap<String, Arc<dyn Backend>>,
    pub(super) journal: Mutex<Journal>,
    pub(super) mem: Mutex<Memory>,
    pub(super) recorder: Recorder,
    pub(super) metrics: AgentMetrics,
    pub(super) workers: Mutex<HashMap<String, Arc<Notify>>>,
    /// Initial lists done: (snapshots, volumes).
    pub(super) synced: tokio::sync::watch::Sender<(bool, bool)>,
    pub(super) volume_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    pub(super) stopping: AtomicBool,
    /// Wakes the heartbeat for an immediate renewal when a round naming this node appears.
    pub(super) beat_now: Notify,
}

/// What an action leaves behind for the worker's loop.
pub(super) enum Next {
    /// Decide again right away on this (newer) object.
    Again(Box<MiroirSnapshot>),
    /// Decide again from the cache (after a fenced rejection, re-read uncached).
    Reread,
    /// Stop here; look again at this time (or on the next event).
    Until(Option<Timestamp>),
}

pub(super) fn soon(d: Duration) -> Next {
    Next::Until(Some(after(Timestamp::now(), d)))
}

pub(super) fn rank(s: Option<SlotState>) -> u8 {
    match s {
        None | Some(SlotState::Pending) => 0,
        Some(SlotState::Suspended) => 1,
        Some(SlotState::Done) => 2,
        Some(SlotState::Error) => 3,
    }
}

/// Masks a stale copy: slots only move forward within a round (only the manager resets them,
/// and it does so with a new round stamp), so `s` is read with the most advanced slot of each
/// node in `seen` (this agent's writes and earlier copies), and `seen` learns from `s`. Without
/// it, a watch event older than the patch response the agent acted on (it lifted on "every leg
/// Done") looked like a barrier the agent had lost, and it reported Error (agent row 5).
pub fn merge_seen(s: &mut MiroirSnapshot, seen: &mut BTreeMap<String, SlotState>) {
    let Some(st) = s.status.as_mut() else { return };
    let slots = st.per_node.get_or_insert_with(BTreeMap::new);
    for (node, state) in slots.iter() {
        let known = seen.entry(node.clone()).or_insert(*state);
        if rank(Some(*known)) < rank(Some(*state)) {
            *known = *state;
        }
    }
    for (node, state) in seen.iter() {
        slots.insert(node.clone(), *state);
    }
}

impl Context {
    pub(super) fn round_key(s: &MiroirSnapshot) -> Option<RoundKey> {
        Some((s.uid()?, RoundView::of(s).suspended_at?.to_string()))
    }

    pub(super) fn volume_lock(&self, v: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.volume_locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(v.to_string())
            .or_default()
            .clone()
    }

    pub(super) fn journal_get(&self, uid: &str) -> Option<Entry> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .cloned()
    }

    pub(super) fn journal_put(&self, e: Entry) -> std::io::Result<()> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .put(e)
    }

    pub(super) fn journal_remove(&self, uid: &str) -> std::io::Result<()> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(uid)
    }

    pub(super) fn journal_for_volume(&self, v: &str) -> Vec<Entry> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entries()
            .filter(|e| e.volume == v)
            .cloned()
            .collect()
    }

    pub(super) fn since_raise(&self, e: &Entry) -> Duration {
        if let Some(i) = self
            .mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .raised
            .get(&e.uid)
        {
            return i.elapsed();
        }
        // Raised by an earlier run of this agent: the wall clock is all there is.
        parse_stamp(&e.raised_at)
            .map(|t| elapsed(t, Timestamp::now()))
            .unwrap_or(self.settings.deadline)
    }

    pub(super) fn snapshots_of(&self, volume: &str) -> Vec<MiroirSnapshot> {
        self.snap_store
            .state()
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .filter(|s| s.spec.volume_name == volume)
            .cloned()
            .collect()
    }

    pub(super) fn volume(&self, name: &str) -> Option<MiroirVolume> {
        self.vol_store
            .get(&ObjectRef::new(name))
            .and_then(|g| g.0.as_ref().ok().cloned())
    }

    pub(super) async fn event(
        &self,
        s: &MiroirSnapshot,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let ev = KubeEvent {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            note: Some(super::cmd::bounded(&format!("{}: {note}", self.node), 900)),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &s.object_ref(&())).await {
            debug!(error = %e, "could not publish event");
        }
    }

    pub(super) async fn update_gauge(&self) {
        if let Ok(v) = self.barrier.suspended().await {
            self.metrics.suspended.set(v.len() as i64);
        }
    }

    /// Another live round of `volume`, not `uid`, per the cache.
    pub(super) fn other_live_round(&self, volume: &str, uid: &str) -> bool {
        let now = Timestamp::now();
        self.snapshots_of(volume).iter().any(|s| {
            let r = RoundView::of(s);
            s.uid().as_deref() != Some(uid)
                && r.io_suspended
                && !r.ready
                && r.suspended_at
                    .and_then(parse_stamp)
                    .is_some_and(|t| now < after(t, self.settings.deadline))
        })
    }

    pub(super) fn backend_for(
        &self,
        vol: &MiroirVolume,
    ) -> Result<(Arc<dyn Backend>, String), String> {
        let r = vol
            .replica_on(&self.node)
            .ok_or_else(|| format!("node {} holds no replica of {}", self.node, vol.name_any()))?;
        let pool = r.pool_name().to_string();
        let b = self.pools.get(&pool).ok_or_else(|| {
            format!(
                "pool {pool} is not configured on node {} (see --pools)",
                self.node
            )
        })?;
        if let Some(kind) = r.backend
            && kind != b.kind()
        {
            return Err(format!(
                "pool {pool} on node {} is {}, but the replica says {}",
                self.node,
                b.kind().as_str(),
                kind.as_str()
            ));
        }
        Ok((b.clone(), pool))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::types::{MiroirSnapshotSpec, MiroirSnapshotStatus};

    #[test]
    fn seen_slots_never_regress_within_a_round() {
        use SlotState::*;
        let copy = |slots: &[(&str, SlotState)]| {
            let mut s = MiroirSnapshot::new(
                "s",
                MiroirSnapshotSpec {
                    volume_name: "v".into(),
                },
            );
            s.status = Some(MiroirSnapshotStatus {
                per_node: Some(slots.iter().map(|(n, st)| (n.to_string(), *st)).collect()),
                ..Default::default()
            });
            s
        };
        let mut seen = BTreeMap::from([("a".to_string(), Suspended)]);
        // Own write masks a stale Pending.
        let mut s = copy(&[("a", Pending), ("b", Pending)]);
        merge_seen(&mut s, &mut seen);
        assert_eq!(RoundView::of(&s).slot("a"), Some(Suspended));
        // A newer copy advances what is known...
        let mut s = copy(&[("a", Done), ("b", Done), ("c", Done)]);
        merge_seen(&mut s, &mut seen);
        // ...and an older copy read afterwards shows every leg Done (the bench's stale event).
        let mut s = copy(&[("a", Done), ("b", Suspended), ("c", Pending)]);
        merge_seen(&mut s, &mut seen);
        for n in ["a", "b", "c"] {
            assert_eq!(RoundView::of(&s).slot(n), Some(Done), "{n}");
        }
    }
}

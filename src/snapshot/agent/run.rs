//! `ucm snapshot-agent`: the IO around [`decide`]. It watches MiroirSnapshots and MiroirVolumes
//! cluster-wide, runs one worker per volume (one action per DRBD resource at a time, volumes in
//! parallel), and acts on watch events and on exact timers (cutoff, deadline, retries), never
//! on a poll loop. It lifts its own barriers at the deadline without any API call.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, FromArgMatches, ValueEnum};
use futures::StreamExt;
use futures::future::BoxFuture;
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{ListParams, Patch, PatchParams, PostParams},
    core::DeserializeGuard,
    runtime::{
        WatchStreamExt,
        events::{Event as KubeEvent, EventType, Recorder, Reporter},
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use prometheus::{HistogramOpts, HistogramVec, IntGauge};
use serde_json::json;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::backend::Backend;
use super::barrier::{self, Barrier, drbd::Drbd, fake::FakeBarrier};
use super::cmd::Runner;
use super::decide::{self, Held, Step};
use super::journal::{Entry, Journal};
use super::pools;
use crate::runtime::cli::{BindAddress, LogFormat, parse_bind_address, parse_go_bool};
use crate::runtime::{Agent, health::Health, http, logging, metrics::Metrics, shutdown};
use crate::snapshot::reconcile::AGENT_LEASE_PREFIX;
use crate::snapshot::round::{self, RoundView, after, elapsed, parse_stamp};
use crate::snapshot::types::{MiroirSnapshot, MiroirVolume, SlotState, teardown_finalizer};

pub const NAME: &str = "snapshot-agent";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BarrierKind {
    /// DRBD suspend-io/resume-io and FIFREEZE/FITHAW.
    Drbd,
    /// The recording test double: no kernel or DRBD state is touched.
    Fake,
}

// `ucm snapshot-agent` flags (spec §15); a plain comment so the subcommand keeps its about.
#[derive(Args, Debug, Clone)]
pub struct AgentArgs {
    /// This node's name (the DaemonSet sets it from the downward API).
    #[arg(long, env = "NODE_NAME", value_name = "NODE")]
    pub node_name: String,

    /// Path to a kubeconfig. Unset: KUBECONFIG, then ~/.kube/config, then in-cluster config.
    #[arg(long, env = "KUBECONFIG", value_name = "PATH")]
    pub kubeconfig: Option<String>,

    /// Namespace of this agent's heartbeat Lease. Default: POD_NAMESPACE, else "default".
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pub namespace: Option<String>,

    /// D: every barrier is lifted this long after the round opened (keep equal to the manager's).
    #[arg(long = "snapshot-deadline", default_value = "60s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub deadline: Duration,

    /// G: no cut starts and no Done is written this close to the deadline; must exceed clock skew.
    #[arg(long = "snapshot-cut-guard", default_value = "5s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub cut_guard: Duration,

    /// How often the heartbeat Lease is renewed.
    #[arg(long, default_value = "20s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub heartbeat_interval: Duration,

    /// IO barrier implementation.
    #[arg(long, value_enum, default_value = "drbd")]
    pub barrier: BarrierKind,

    /// State and event-log directory of the fake barrier (with --barrier=fake).
    #[arg(long, value_name = "DIR")]
    pub fake_barrier_dir: Option<PathBuf>,

    /// Bound on each DRBD call and on a freeze.
    #[arg(long, default_value = "30s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub barrier_timeout: Duration,

    /// Bound on each backend command.
    #[arg(long, default_value = "2m", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub backend_timeout: Duration,

    /// Consecutive barrier or cut failures before the leg reports Error.
    #[arg(long, default_value = "5", value_name = "N")]
    pub barrier_fail_limit: u32,

    /// Interval of the stale-barrier sweep (also run at start and stop).
    #[arg(long, default_value = "5m", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub sweep_interval: Duration,

    /// Pool configuration file (pool name → backend). Unset: diskless legs only.
    #[arg(long, value_name = "PATH")]
    pub pools: Option<PathBuf>,

    /// Allow sparse full copies where the loopfile pool's filesystem has no reflink.
    #[arg(long, default_value = "false", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", action = clap::ArgAction::Set, value_parser = parse_go_bool,
          value_name = "BOOL")]
    pub loopfile_full_copy: bool,

    /// The barrier journal; keep it on a node-local tmpfs so a reboot clears it.
    #[arg(
        long,
        default_value = "/run/ucm-snapshot-agent/journal.json",
        value_name = "PATH"
    )]
    pub journal: PathBuf,

    /// Address of /metrics: ":8080", "host:port", or "0" to disable.
    #[arg(long, default_value = ":8080", value_parser = parse_bind_address, value_name = "ADDR")]
    pub metrics_bind_address: BindAddress,

    /// Address of /healthz and /readyz: ":8081", "host:port", or "0" to disable.
    #[arg(long, default_value = ":8081", value_parser = parse_bind_address, value_name = "ADDR")]
    pub health_probe_bind_address: BindAddress,

    /// Log filter directive. Default: RUST_LOG, else "info".
    #[arg(long, value_name = "DIRECTIVE")]
    pub log_level: Option<String>,

    /// Log output format.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

fn command() -> clap::Command {
    AgentArgs::augment_args(
        clap::Command::new(NAME)
            .about("Run the per-node snapshot agent (barrier and cut of each leg)"),
    )
}

fn run_agent(m: clap::ArgMatches) -> BoxFuture<'static, anyhow::Result<()>> {
    Box::pin(async move {
        let args = AgentArgs::from_arg_matches(&m)?;
        main(args).await
    })
}

/// The agent as registered with the feature.
pub const AGENT: Agent = Agent {
    name: NAME,
    command,
    run: run_agent,
};

/// Agent metrics (spec §13).
#[derive(Clone)]
pub struct AgentMetrics {
    pub barrier_held_seconds: HistogramVec,
    pub cut_seconds: HistogramVec,
    pub suspended: IntGauge,
}

impl AgentMetrics {
    pub fn register(registry: &prometheus::Registry) -> Self {
        let buckets = vec![
            0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0,
        ];
        let held = HistogramVec::new(
            HistogramOpts::new(
                "ucm_snapshot_barrier_held_seconds",
                "Per leg: from the start of the raise to the end of resume and thaw",
            )
            .buckets(buckets.clone()),
            &["backend"],
        )
        .expect("valid metric");
        let cut = HistogramVec::new(
            HistogramOpts::new(
                "ucm_snapshot_cut_seconds",
                "Sync, delete and cut of one leg",
            )
            .buckets(buckets),
            &["backend"],
        )
        .expect("valid metric");
        let suspended = IntGauge::new(
            "miroir_volume_suspended",
            "DRBD resources on this node with the user-suspend flag set",
        )
        .expect("valid metric");
        let _ = registry.register(Box::new(held.clone()));
        let _ = registry.register(Box::new(cut.clone()));
        let _ = registry.register(Box::new(suspended.clone()));
        AgentMetrics {
            barrier_held_seconds: held,
            cut_seconds: cut,
            suspended,
        }
    }
}

/// Agent event reasons (spec §9, plus `RaiseRefused` for failed preconditions).
pub mod event {
    pub const BARRIER_STUCK: &str = "BarrierStuck";
    pub const CUT_FAILED: &str = "CutFailed";
    pub const WAITING_FOR_PRIMARY: &str = "WaitingForPrimary";
    pub const CLOCK_SKEW: &str = "ClockSkew";
    pub const RAISE_REFUSED: &str = "RaiseRefused";
}

type RoundKey = (String, String);

/// In-memory state that is safe to lose on restart (the journal and the object hold the rest).
#[derive(Default)]
struct Memory {
    /// Monotonic raise time per snapshot uid (this process's raises).
    raised: HashMap<String, Instant>,
    /// The most advanced slot of each node this agent has written or seen, per round (masks a
    /// stale copy; see [`merge_seen`]).
    seen: HashMap<RoundKey, BTreeMap<String, SlotState>>,
    /// Consecutive barrier or cut failures per round.
    failures: HashMap<RoundKey, u32>,
    /// When I2 started holding back the cut, and whether the event went out.
    held_back: HashMap<RoundKey, (Instant, bool)>,
    /// The kernel's "Primary here" per round, for nodes without a diskful leg.
    primary: HashMap<RoundKey, bool>,
    /// Rounds that already emitted ClockSkew, or an Error on stop.
    noted: HashMap<(RoundKey, &'static str), ()>,
    /// Lifts that failed (BarrierStuck sent once per entry).
    stuck: HashMap<String, ()>,
}

struct Ctx {
    node: String,
    settings: decide::Settings,
    fail_limit: u32,
    snapshots: Api<MiroirSnapshot>,
    snap_store: Store<DeserializeGuard<MiroirSnapshot>>,
    vol_store: Store<DeserializeGuard<MiroirVolume>>,
    barrier: Arc<dyn Barrier>,
    pools: BTreeMap<String, Arc<dyn Backend>>,
    journal: Mutex<Journal>,
    mem: Mutex<Memory>,
    recorder: Recorder,
    metrics: AgentMetrics,
    workers: Mutex<HashMap<String, Arc<Notify>>>,
    /// Initial lists done: (snapshots, volumes).
    synced: tokio::sync::watch::Sender<(bool, bool)>,
    volume_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    stopping: AtomicBool,
}

/// What an action leaves behind for the worker's loop.
enum Next {
    /// Decide again right away on this (newer) object.
    Again(Box<MiroirSnapshot>),
    /// Decide again from the cache (after a fenced rejection, re-read uncached).
    Reread,
    /// Stop here; look again at this time (or on the next event).
    Until(Option<Timestamp>),
}

fn soon(d: Duration) -> Next {
    Next::Until(Some(after(Timestamp::now(), d)))
}

fn rank(s: Option<SlotState>) -> u8 {
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
/// Done") looked like a barrier the agent had lost, and it reported Error (row 5).
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

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

impl Ctx {
    fn round_key(s: &MiroirSnapshot) -> Option<RoundKey> {
        Some((s.uid()?, RoundView::of(s).suspended_at?.to_string()))
    }

    fn volume_lock(&self, v: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.volume_locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(v.to_string())
            .or_default()
            .clone()
    }

    fn journal_get(&self, uid: &str) -> Option<Entry> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .cloned()
    }

    fn journal_put(&self, e: Entry) -> std::io::Result<()> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .put(e)
    }

    fn journal_remove(&self, uid: &str) -> std::io::Result<()> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(uid)
    }

    fn journal_for_volume(&self, v: &str) -> Vec<Entry> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entries()
            .filter(|e| e.volume == v)
            .cloned()
            .collect()
    }

    fn since_raise(&self, e: &Entry) -> Duration {
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

    fn snapshots_of(&self, volume: &str) -> Vec<MiroirSnapshot> {
        self.snap_store
            .state()
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .filter(|s| s.spec.volume_name == volume)
            .cloned()
            .collect()
    }

    fn volume(&self, name: &str) -> Option<MiroirVolume> {
        self.vol_store
            .get(&ObjectRef::new(name))
            .and_then(|g| g.0.as_ref().ok().cloned())
    }

    fn notify(self: &Arc<Self>, volume: &str) {
        let n = {
            let mut w = self.workers.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = w.get(volume) {
                n.notify_one();
                return;
            }
            let n = Arc::new(Notify::new());
            w.insert(volume.to_string(), n.clone());
            n
        };
        tokio::spawn(volume_worker(self.clone(), volume.to_string(), n));
    }

    fn notify_all(self: &Arc<Self>) {
        for n in self
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            n.notify_one();
        }
    }

    async fn event(
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

    async fn update_gauge(&self) {
        if let Ok(v) = self.barrier.suspended().await {
            self.metrics.suspended.set(v.len() as i64);
        }
    }

    /// Another live round of `volume`, not `uid`, per the cache.
    fn other_live_round(&self, volume: &str, uid: &str) -> bool {
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

    fn backend_for(&self, vol: &MiroirVolume) -> Result<(Arc<dyn Backend>, String), String> {
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

    /// The fenced slot write (spec §5.3).
    async fn write_slot(&self, s: &MiroirSnapshot, state: SlotState) -> Next {
        let (Some(uid), Some(at)) = (s.uid(), RoundView::of(s).suspended_at.map(str::to_string))
        else {
            return Next::Until(None);
        };
        let patch = round::agent_slot_patch(&uid, &at, &self.node, state);
        let patch: json_patch::Patch = match serde_json::from_value(patch) {
            Ok(p) => p,
            Err(e) => {
                error!(error = %e, "cannot encode slot patch");
                return Next::Until(None);
            }
        };
        match self
            .snapshots
            .patch_status(
                &s.name_any(),
                &PatchParams::default(),
                &Patch::<()>::Json(patch),
            )
            .await
        {
            Ok(obj) => {
                self.mem
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .seen
                    .entry((uid, at))
                    .or_default()
                    .insert(self.node.clone(), state);
                debug!(snapshot = %s.name_any(), slot = %state, "slot written");
                Next::Again(Box::new(obj))
            }
            Err(e) if crate::runtime::writer::is_fenced_out(&e) => {
                debug!(snapshot = %s.name_any(), "slot write fenced out: the round moved on");
                Next::Reread
            }
            Err(e) if is_not_found(&e) => Next::Until(None),
            Err(e) => {
                // Fail closed: the barrier stays; resend while the round is live (5.3.4).
                warn!(snapshot = %s.name_any(), error = %e, "slot write failed; retrying");
                soon(Duration::from_secs(1))
            }
        }
    }

    fn count_failure(&self, key: &RoundKey) -> u32 {
        let mut m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.failures.entry(key.clone()).or_insert(0);
        *n += 1;
        *n
    }

    fn clear_failures(&self, key: &RoundKey) {
        self.mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .failures
            .remove(key);
    }

    /// Failure handling shared by raise and cut: retry 1 s apart until the limit or the cutoff,
    /// then write Error with a Warning event.
    async fn failed(
        &self,
        s: &MiroirSnapshot,
        key: &RoundKey,
        reason: &'static str,
        msg: String,
    ) -> Next {
        let n = self.count_failure(key);
        let in_time = decide::before_cutoff(&key.1, None, Timestamp::now(), &self.settings);
        warn!(snapshot = %s.name_any(), attempt = n, error = %msg, "{reason}");
        if n >= self.fail_limit || !in_time {
            self.event(s, true, reason, "Snapshot", format!("{msg} ({n} attempts)"))
                .await;
            return self.write_slot(s, SlotState::Error).await;
        }
        soon(Duration::from_secs(1))
    }

    async fn refuse(&self, s: &MiroirSnapshot, msg: String) -> Next {
        warn!(snapshot = %s.name_any(), "{msg}");
        self.event(s, true, event::RAISE_REFUSED, "Raise", msg)
            .await;
        self.write_slot(s, SlotState::Error).await
    }

    async fn raise(&self, s: &MiroirSnapshot, vol: &MiroirVolume) -> Next {
        let Some(key) = Ctx::round_key(s) else {
            return Next::Until(None);
        };
        let (uid, at) = key.clone();
        let v = vol.name_any();
        let diskful = vol.diskful_nodes().contains(&self.node);
        // This process already raised for this round: only the slot write is missing.
        let ours = self.journal_get(&uid).is_some_and(|e| e.suspended_at == at)
            && self
                .mem
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .raised
                .contains_key(&uid);
        if ours {
            return self.write_slot(s, SlotState::Suspended).await;
        }
        if diskful && let Err(msg) = self.backend_for(vol) {
            return self.refuse(s, msg).await;
        }
        let status = match self.barrier.status(&v).await {
            Ok(Some(st)) => st,
            Ok(None) => {
                return self
                    .refuse(
                        s,
                        format!("DRBD resource {v} is not configured on node {}", self.node),
                    )
                    .await;
            }
            Err(e) => return self.failed(s, &key, event::BARRIER_STUCK, e.0).await,
        };
        let peers: Vec<String> = vol
            .diskful_nodes()
            .into_iter()
            .filter(|n| *n != self.node)
            .collect();
        if let Err(msg) = barrier::healthy(&status, diskful, &peers) {
            return self
                .refuse(s, format!("cannot raise the barrier on {v}: {msg}"))
                .await;
        }
        let holds = self.journal_get(&uid).is_some_and(|e| e.suspended_at == at);
        if let Err(msg) = barrier::flag_free(&status, &v, holds) {
            return self.refuse(s, msg).await;
        }
        let started = Instant::now();
        let mut entry = Entry {
            volume: v.clone(),
            snapshot: s.name_any(),
            uid: uid.clone(),
            suspended_at: at.clone(),
            mountpoint: None,
            raised_at: Timestamp::now().to_string(),
        };
        if let Err(e) = self.journal_put(entry.clone()) {
            return self
                .failed(s, &key, event::BARRIER_STUCK, format!("journal: {e}"))
                .await;
        }
        self.mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .raised
            .entry(uid.clone())
            .or_insert(started);
        // Freeze before suspend, so flushed pages still replicate (I11).
        let mountpoint = match self.barrier.mountpoint(&v).await {
            Ok(mp) => mp,
            Err(e) => return self.raise_failed(s, &key, &entry, e.0).await,
        };
        if let Some(mp) = &mountpoint {
            entry.mountpoint = Some(mp.clone());
            if let Err(e) = self.journal_put(entry.clone()) {
                return self
                    .raise_failed(s, &key, &entry, format!("journal: {e}"))
                    .await;
            }
            if let Err(e) = self.barrier.freeze(&v, mp).await {
                return self.raise_failed(s, &key, &entry, e.0).await;
            }
        }
        if let Err(e) = self.barrier.suspend(&v).await {
            return self.raise_failed(s, &key, &entry, e.0).await;
        }
        self.clear_failures(&key);
        let next = self.write_slot(s, SlotState::Suspended).await;
        self.update_gauge().await;
        next
    }

    /// A failed freeze or suspend: thaw, clear the flag the call may have set unless another
    /// live round holds the volume (#382), forget the entry, then count the failure.
    async fn raise_failed(
        &self,
        s: &MiroirSnapshot,
        key: &RoundKey,
        entry: &Entry,
        msg: String,
    ) -> Next {
        if let Some(mp) = &entry.mountpoint
            && let Err(e) = self.barrier.thaw(&entry.volume, mp).await
        {
            warn!(volume = %entry.volume, error = %e, "thaw after a failed raise failed");
        }
        if !self.other_live_round(&entry.volume, &entry.uid)
            && let Err(e) = self.barrier.resume(&entry.volume).await
        {
            warn!(volume = %entry.volume, error = %e, "resume-io after a failed raise failed");
        }
        let _ = self.journal_remove(&entry.uid);
        self.mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .raised
            .remove(&entry.uid);
        self.update_gauge().await;
        self.failed(
            s,
            key,
            event::BARRIER_STUCK,
            format!("raise on {}: {msg}", entry.volume),
        )
        .await
    }

    async fn cut(&self, s: &MiroirSnapshot, vol: &MiroirVolume, replicated: bool) -> Next {
        let Some(key) = Ctx::round_key(s) else {
            return Next::Until(None);
        };
        let v = vol.name_any();
        let name = s.name_any();
        let (backend, _pool) = match self.backend_for(vol) {
            Ok(b) => b,
            Err(msg) => return self.refuse(s, msg).await,
        };
        let since_raise = self.journal_get(&key.0).map(|e| self.since_raise(&e));
        if replicated {
            // The kernel view (6.2.3) and I2, read once before the cut.
            let status = match self.barrier.status(&v).await {
                Ok(Some(st)) => st,
                Ok(None) => {
                    return self
                        .failed(
                            s,
                            &key,
                            event::CUT_FAILED,
                            format!("DRBD resource {v} vanished"),
                        )
                        .await;
                }
                Err(e) => return self.failed(s, &key, event::CUT_FAILED, e.0).await,
            };
            let peers: Vec<String> = vol
                .diskful_nodes()
                .into_iter()
                .filter(|n| *n != self.node)
                .collect();
            if let Err(msg) = barrier::healthy(&status, true, &peers) {
                return self.failed(s, &key, event::CUT_FAILED, msg).await;
            }
            let primaries = status.primary_peers();
            if let Some(p) = decide::primary_holding_back(&primaries, s) {
                let (since, sent) = *self
                    .mem
                    .lock()
                    .unwrap_or_else(|x| x.into_inner())
                    .held_back
                    .entry(key.clone())
                    .or_insert((Instant::now(), false));
                if since.elapsed() >= Duration::from_secs(5) && !sent {
                    self.mem
                        .lock()
                        .unwrap_or_else(|x| x.into_inner())
                        .held_back
                        .insert(key.clone(), (since, true));
                    let msg =
                        format!("the Primary {p} has not raised its barrier; the cut waits for it");
                    self.event(s, true, event::WAITING_FOR_PRIMARY, "Cut", msg)
                        .await;
                }
                // Its slot change wakes us; the timer only drives the event.
                return if sent {
                    Next::Until(None)
                } else {
                    Next::Until(Some(after(
                        Timestamp::now(),
                        Duration::from_secs(5).saturating_sub(since.elapsed()),
                    )))
                };
            }
            // Re-assert suspend-io before every cut (I10).
            if let Err(e) = self.barrier.suspend(&v).await {
                return self.failed(s, &key, event::BARRIER_STUCK, e.0).await;
            }
        }
        if !decide::before_cutoff(&key.1, since_raise, Timestamp::now(), &self.settings) {
            return Next::Until(None);
        }
        let t0 = Instant::now();
        let res = async {
            backend.sync(&v).await?;
            // Delete then cut (I9): a leftover from a voided round never passes as this one.
            backend.delete(&name).await?;
            backend.cut(&v, &name).await
        }
        .await;
        let took = t0.elapsed();
        self.metrics
            .cut_seconds
            .with_label_values(&[backend.kind().as_str()])
            .observe(took.as_secs_f64());
        if let Err(e) = res {
            return self.failed(s, &key, event::CUT_FAILED, e.to_string()).await;
        }
        self.barrier.note_cut(&v, &name, took).await;
        self.clear_failures(&key);
        // I7: a cut that finished after the cutoff is not reported.
        let since_raise = self.journal_get(&key.0).map(|e| self.since_raise(&e));
        if !decide::before_cutoff(&key.1, since_raise, Timestamp::now(), &self.settings) {
            warn!(snapshot = %name, "cut finished after the cutoff; not reporting it (the round will be voided and recut)");
            return Next::Until(None);
        }
        self.write_slot(s, SlotState::Done).await
    }

    /// resume-io, then thaw, then drop the entry: only what the journal holds.
    async fn lift(&self, e: &Entry, s: Option<&MiroirSnapshot>) -> Result<(), ()> {
        let stuck = |msg: String| async move {
            let first = self
                .mem
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .stuck
                .insert(e.uid.clone(), ())
                .is_none();
            error!(volume = %e.volume, snapshot = %e.snapshot, error = %msg, "lifting the barrier failed; retrying in 5s");
            if first && let Some(s) = s {
                self.event(s, true, event::BARRIER_STUCK, "Lift", msg).await;
            }
        };
        if let Err(err) = self.barrier.resume(&e.volume).await {
            stuck(format!("resume-io {}: {}", e.volume, err.0)).await;
            return Err(());
        }
        if let Some(mp) = &e.mountpoint
            && let Err(err) = self.barrier.thaw(&e.volume, mp).await
        {
            stuck(format!("thaw {}: {}", mp.display(), err.0)).await;
            return Err(());
        }
        let _ = self.journal_remove(&e.uid);
        let raised = {
            let mut m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
            m.stuck.remove(&e.uid);
            m.raised.remove(&e.uid)
        };
        let backend = self
            .volume(&e.volume)
            .and_then(|v| self.backend_for(&v).ok())
            .map(|(b, _)| b.kind().as_str())
            .unwrap_or("none");
        if let Some(t) = raised {
            self.metrics
                .barrier_held_seconds
                .with_label_values(&[backend])
                .observe(t.elapsed().as_secs_f64());
        }
        self.update_gauge().await;
        info!(volume = %e.volume, snapshot = %e.snapshot, "barrier lifted");
        Ok(())
    }

    /// Deletes the backend snapshot in every pool (unless a tie-breaker), then removes only
    /// this node's finalizer.
    async fn teardown(&self, s: &MiroirSnapshot, delete_backends: bool) -> Next {
        let name = s.name_any();
        if delete_backends {
            for (pool, b) in &self.pools {
                match b.delete(&name).await {
                    Ok(()) => {}
                    Err(super::backend::BackendError::Busy(msg)) => {
                        info!(snapshot = %name, pool = %pool, "backend snapshot busy; retrying in 30s: {msg}");
                        return soon(Duration::from_secs(30));
                    }
                    Err(e) => {
                        warn!(snapshot = %name, pool = %pool, error = %e, "deleting the backend snapshot failed; retrying in 30s");
                        self.event(
                            s,
                            true,
                            event::CUT_FAILED,
                            "Teardown",
                            format!("pool {pool}: {e}"),
                        )
                        .await;
                        return soon(Duration::from_secs(30));
                    }
                }
            }
        }
        let mine = teardown_finalizer(&self.node);
        let keep: Vec<String> = s
            .finalizers()
            .iter()
            .filter(|f| **f != mine)
            .cloned()
            .collect();
        let patch = round::finalizers_patch(
            &s.uid().unwrap_or_default(),
            &s.resource_version().unwrap_or_default(),
            &keep,
        );
        let patch: json_patch::Patch = serde_json::from_value(patch).expect("valid patch");
        match self
            .snapshots
            .patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => {
                info!(snapshot = %name, "teardown done; finalizer removed");
                Next::Until(None)
            }
            Err(e) if is_not_found(&e) => Next::Until(None),
            Err(e) if crate::runtime::writer::is_fenced_out(&e) => Next::Reread,
            Err(e) => {
                warn!(snapshot = %name, error = %e, "removing the finalizer failed; retrying");
                soon(Duration::from_secs(1))
            }
        }
    }

    /// Whether the volume is Primary on this node, asked once per round (client legs and
    /// tie-breakers only).
    async fn local_primary(&self, s: &MiroirSnapshot, vol: &MiroirVolume) -> bool {
        let Some(key) = Ctx::round_key(s) else {
            return false;
        };
        if vol.diskful_nodes().contains(&self.node) || !vol.is_replicated() {
            return false;
        }
        let r = RoundView::of(s);
        if !r.io_suspended || r.ready || r.slot(&self.node).is_some() {
            return false;
        }
        if let Some(p) = self
            .mem
            .lock()
            .unwrap_or_else(|x| x.into_inner())
            .primary
            .get(&key)
        {
            return *p;
        }
        let p =
            matches!(self.barrier.status(&vol.name_any()).await, Ok(Some(st)) if st.is_primary());
        self.mem
            .lock()
            .unwrap_or_else(|x| x.into_inner())
            .primary
            .insert(key, p);
        p
    }

    /// Decides and acts for one snapshot until it has to wait; returns the next timer.
    async fn handle(&self, mut s: MiroirSnapshot) -> Option<Timestamp> {
        let volume_name = s.spec.volume_name.clone();
        for _ in 0..8 {
            let vol = self.volume(&volume_name);
            let key = Ctx::round_key(&s);
            if let Some(k) = &key {
                merge_seen(
                    &mut s,
                    self.mem
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .seen
                        .entry(k.clone())
                        .or_default(),
                );
                self.check_skew(&s, k).await;
            }
            let entry = s.uid().and_then(|u| self.journal_get(&u));
            let since = entry.as_ref().map(|e| self.since_raise(e));
            let held = entry.as_ref().zip(since).map(|(e, d)| Held {
                suspended_at: e.suspended_at.as_str(),
                since_raise: d,
            });
            let local_primary = match &vol {
                Some(v) => self.local_primary(&s, v).await,
                None => false,
            };
            let d = decide::decide(
                &decide::Observed {
                    node: &self.node,
                    snapshot: Some(&s),
                    volume: vol.as_ref(),
                    held,
                    local_primary,
                    now: Timestamp::now(),
                },
                &self.settings,
            );
            // Stop (8.5): a held barrier of a live round reports Error once, then waits.
            if self.stopping.load(Ordering::Relaxed)
                && let (Some(k), Some(_)) = (&key, &entry)
                && matches!(d.step, Step::Wait | Step::Cut)
                && RoundView::of(&s).io_suspended
            {
                let first = self
                    .mem
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .noted
                    .insert((k.clone(), "stop"), ())
                    .is_none();
                if first {
                    info!(snapshot = %s.name_any(), "stopping: reporting Error so the round is voided");
                    match self.write_slot(&s, SlotState::Error).await {
                        Next::Again(o) => {
                            s = *o;
                            continue;
                        }
                        _ => return d.wake_at,
                    }
                }
                return d.wake_at;
            }
            let next = match d.step {
                Step::Wait => return d.wake_at,
                Step::Lift { teardown } => {
                    let e = entry?;
                    if self.lift(&e, Some(&s)).await.is_err() {
                        return Some(after(Timestamp::now(), Duration::from_secs(5)));
                    }
                    if teardown {
                        Next::Again(Box::new(s.clone()))
                    } else {
                        Next::Until(None)
                    }
                }
                Step::Teardown { delete_backends } => self.teardown(&s, delete_backends).await,
                Step::WriteSlot(st) => self.write_slot(&s, st).await,
                Step::Raise => match &vol {
                    Some(v) => self.raise(&s, v).await,
                    None => Next::Until(None),
                },
                Step::CutUnreplicated => match &vol {
                    Some(v) => self.cut(&s, v, false).await,
                    None => Next::Until(None),
                },
                Step::Cut => match &vol {
                    Some(v) => self.cut(&s, v, true).await,
                    None => Next::Until(None),
                },
            };
            match next {
                Next::Again(o) => s = *o,
                Next::Reread => match self.snapshots.get_opt(&s.name_any()).await {
                    Ok(Some(o)) => s = o,
                    Ok(None) => return None,
                    Err(e) => {
                        warn!(error = %e, "re-read failed");
                        return Some(after(Timestamp::now(), Duration::from_secs(1)));
                    }
                },
                Next::Until(t) => {
                    // Whatever the action, a held barrier keeps its deadline timer.
                    let lift = s.uid().and_then(|u| self.journal_get(&u)).map(|e| {
                        decide::lift_at(
                            &Held {
                                suspended_at: &e.suspended_at,
                                since_raise: self.since_raise(&e),
                            },
                            Timestamp::now(),
                            &self.settings,
                        )
                    });
                    return [t, lift].into_iter().flatten().min();
                }
            }
        }
        Some(after(Timestamp::now(), Duration::from_millis(200)))
    }

    async fn check_skew(&self, s: &MiroirSnapshot, key: &RoundKey) {
        let Some(t) = parse_stamp(&key.1) else { return };
        if t > after(Timestamp::now(), self.settings.cut_guard) {
            let first = self
                .mem
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .noted
                .insert((key.clone(), "skew"), ())
                .is_none();
            if first {
                let msg = format!(
                    "suspendedAt {} is more than {}s in this node's future; check NTP",
                    key.1,
                    self.settings.cut_guard.as_secs()
                );
                warn!(snapshot = %s.name_any(), "{msg}");
                self.event(s, true, event::CLOCK_SKEW, "Raise", msg).await;
            }
        }
    }

    /// One pass over a volume: every snapshot of it, then journal entries whose object is gone.
    async fn pass(&self, volume: &str) -> Option<Timestamp> {
        let lock = self.volume_lock(volume);
        let _g = lock.lock().await;
        let snaps = self.snapshots_of(volume);
        let mut wake: Option<Timestamp> = None;
        for s in &snaps {
            if let Some(t) = self.handle(s.clone()).await {
                wake = Some(wake.map_or(t, |w| w.min(t)));
            }
        }
        let present: Vec<String> = snaps.iter().filter_map(|s| s.uid()).collect();
        for e in self.journal_for_volume(volume) {
            if !present.contains(&e.uid) && self.lift(&e, None).await.is_err() {
                let t = after(Timestamp::now(), Duration::from_secs(5));
                wake = Some(wake.map_or(t, |w| w.min(t)));
            }
        }
        wake
    }

    /// Lifts this volume's journal entries whose deadline passed, without any API call.
    async fn lift_expired(&self, volume: &str) {
        let lock = self.volume_lock(volume);
        let _g = lock.lock().await;
        for e in self.journal_for_volume(volume) {
            let held = Held {
                suspended_at: &e.suspended_at,
                since_raise: self.since_raise(&e),
            };
            if Timestamp::now() >= decide::lift_at(&held, Timestamp::now(), &self.settings) {
                warn!(volume = %e.volume, snapshot = %e.snapshot, "deadline passed without the API; lifting");
                let _ = self.lift(&e, None).await;
            }
        }
    }

    /// Forgets in-memory round state of snapshots that left the cache (bounded memory).
    fn prune_memory(&self) {
        let present: std::collections::HashSet<String> = self
            .snap_store
            .state()
            .iter()
            .filter_map(|g| g.0.as_ref().ok().and_then(|s| s.uid()))
            .collect();
        let journal: std::collections::HashSet<String> = self
            .journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entries()
            .map(|e| e.uid.clone())
            .collect();
        let keep = |uid: &String| present.contains(uid) || journal.contains(uid);
        let mut m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        m.raised.retain(|u, _| keep(u));
        m.seen.retain(|(u, _), _| keep(u));
        m.failures.retain(|(u, _), _| keep(u));
        m.held_back.retain(|(u, _), _| keep(u));
        m.primary.retain(|(u, _), _| keep(u));
        m.noted.retain(|((u, _), _), _| keep(u));
        m.stuck.retain(|u, _| keep(u));
    }

    /// The stale-barrier sweep (8.4): kernel flags and journal entries without a live round are
    /// lifted; live rounds are kept (and adopted through the journal).
    async fn sweep(self: &Arc<Self>) {
        let live: Option<Vec<(String, String, String)>> = match self
            .snapshots
            .list(&ListParams::default())
            .await
        {
            Ok(l) => {
                let now = Timestamp::now();
                Some(
                    l.items
                        .iter()
                        .filter_map(|s| {
                            let r = RoundView::of(s);
                            let at = r.suspended_at?;
                            let live = r.io_suspended
                                && !r.ready
                                && parse_stamp(at)
                                    .is_some_and(|t| now < after(t, self.settings.deadline));
                            live.then(|| {
                                (
                                    s.spec.volume_name.clone(),
                                    s.uid().unwrap_or_default(),
                                    at.to_string(),
                                )
                            })
                        })
                        .collect(),
                )
            }
            Err(e) => {
                warn!(error = %e, "sweep: cannot list snapshots; only expired journal entries are lifted");
                None
            }
        };
        let entries: Vec<Entry> = self
            .journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entries()
            .cloned()
            .collect();
        for e in &entries {
            let is_live = match &live {
                Some(l) => l
                    .iter()
                    .any(|(_, u, at)| *u == e.uid && *at == e.suspended_at),
                // Without the API, only the deadline decides (8.2).
                None => {
                    Timestamp::now()
                        < decide::lift_at(
                            &Held {
                                suspended_at: &e.suspended_at,
                                since_raise: self.since_raise(e),
                            },
                            Timestamp::now(),
                            &self.settings,
                        )
                }
            };
            if !is_live {
                let lock = self.volume_lock(&e.volume);
                let _g = lock.lock().await;
                warn!(volume = %e.volume, snapshot = %e.snapshot, "lifting stale IO barrier");
                let _ = self.lift(e, None).await;
            } else {
                // Adopted: the volume's worker continues the round from the journal.
                self.notify(&e.volume);
            }
        }
        let (Some(live), Ok(flags)) = (&live, self.barrier.suspended().await) else {
            return;
        };
        for v in flags {
            if live.iter().any(|(vol, _, _)| *vol == v) {
                continue;
            }
            let lock = self.volume_lock(&v);
            let _g = lock.lock().await;
            if !self.journal_for_volume(&v).is_empty() {
                continue;
            }
            warn!(volume = %v, "lifting stale IO barrier");
            if let Err(e) = self.barrier.resume(&v).await {
                error!(volume = %v, error = %e, "sweep: resume-io failed");
                continue;
            }
            if let Ok(Some(mp)) = self.barrier.mountpoint(&v).await
                && let Err(e) = self.barrier.thaw(&v, &mp).await
            {
                warn!(volume = %v, error = %e, "sweep: thaw failed");
            }
        }
        self.update_gauge().await;
    }
}

async fn volume_worker(ctx: Arc<Ctx>, volume: String, notify: Arc<Notify>) {
    // Never act on a partial cache: a journal entry whose snapshot is merely not listed yet
    // must not look like a deleted snapshot. Held barriers still lift at the deadline.
    let mut synced = ctx.synced.subscribe();
    let ready = synced.wait_for(|(a, b)| *a && *b);
    let deadline = ctx
        .journal_for_volume(&volume)
        .iter()
        .map(|e| {
            let at = decide::lift_at(
                &Held {
                    suspended_at: &e.suspended_at,
                    since_raise: ctx.since_raise(e),
                },
                Timestamp::now(),
                &ctx.settings,
            );
            elapsed(Timestamp::now(), at)
        })
        .min();
    match deadline {
        Some(d) => {
            if tokio::time::timeout(d, ready).await.is_err() {
                // No API, no list: lift what expired, with no API call (8.2).
                ctx.lift_expired(&volume).await;
                let _ = synced.wait_for(|(a, b)| *a && *b).await;
            }
        }
        None => {
            let _ = ready.await;
        }
    }
    loop {
        let wake = ctx.pass(&volume).await;
        let sleep = wake.map(|t| elapsed(Timestamp::now(), t).max(Duration::from_millis(10)));
        match sleep {
            Some(d) => {
                tokio::select! {
                    _ = notify.notified() => {}
                    _ = tokio::time::sleep(d) => {}
                }
            }
            None => notify.notified().await,
        }
    }
}

async fn heartbeat(
    client: Client,
    namespace: String,
    node: String,
    interval: Duration,
    stop: CancellationToken,
) {
    let api: Api<Lease> = Api::namespaced(client, &namespace);
    let name = format!("{AGENT_LEASE_PREFIX}{node}");
    loop {
        let now = MicroTime(Timestamp::now());
        let spec = LeaseSpec {
            holder_identity: Some(node.clone()),
            renew_time: Some(now.clone()),
            lease_duration_seconds: Some(
                i32::try_from(interval.as_secs().saturating_mul(3)).unwrap_or(i32::MAX),
            ),
            ..Default::default()
        };
        // One request per beat: patch, and create only when the Lease is not there yet.
        let patched = api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": spec })),
            )
            .await;
        let res = match patched {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                let lease = Lease {
                    metadata: kube::api::ObjectMeta {
                        name: Some(name.clone()),
                        labels: Some(
                            [(
                                "app.kubernetes.io/name".to_string(),
                                "ucm-snapshot-agent".to_string(),
                            )]
                            .into(),
                        ),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        acquire_time: Some(now),
                        ..spec
                    }),
                };
                api.create(&PostParams::default(), &lease).await.map(|_| ())
            }
            Err(e) => Err(e),
        };
        if let Err(e) = res {
            warn!(error = %e, "heartbeat Lease renewal failed");
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

async fn client(kubeconfig: Option<&str>) -> anyhow::Result<Client> {
    crate::runtime::manager::client(kubeconfig).await
}

pub async fn main(args: AgentArgs) -> anyhow::Result<()> {
    logging::init(args.log_level.as_deref(), args.log_format).map_err(|e| anyhow::anyhow!(e))?;
    if args.node_name.is_empty() {
        anyhow::bail!("--node-name (or NODE_NAME) is required");
    }
    if args.cut_guard >= args.deadline {
        anyhow::bail!("--snapshot-cut-guard must be shorter than --snapshot-deadline");
    }
    let node = args.node_name.clone();
    let barrier: Arc<dyn Barrier> = match args.barrier {
        BarrierKind::Drbd => Arc::new(Drbd::new(Runner::new(args.barrier_timeout))),
        BarrierKind::Fake => {
            let dir = args
                .fake_barrier_dir
                .clone()
                .ok_or_else(|| anyhow::anyhow!("--barrier=fake needs --fake-barrier-dir"))?;
            std::fs::create_dir_all(&dir)?;
            Arc::new(FakeBarrier::new(node.clone(), dir))
        }
    };
    let pools = match &args.pools {
        Some(p) => pools::build(
            &pools::load(p).map_err(|e| anyhow::anyhow!(e))?,
            args.backend_timeout,
            args.loopfile_full_copy,
        ),
        None => BTreeMap::new(),
    };
    for (name, b) in &pools {
        if let Err(e) = b.probe().await {
            warn!(pool = %name, error = %e, "pool probe failed; cuts in this pool will fail until it is fixed");
        }
    }
    let journal = Journal::open(&args.journal)
        .map_err(|e| anyhow::anyhow!("journal {}: {e}", args.journal.display()))?;
    let namespace = args
        .namespace
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".into());
    info!(node = %node, barrier = ?args.barrier, pools = ?pools.keys().collect::<Vec<_>>(), journal = %args.journal.display(), "starting ucm snapshot-agent");

    let client = client(args.kubeconfig.as_deref()).await?;
    let metrics = Arc::new(Metrics::new());
    let agent_metrics = AgentMetrics::register(&metrics.registry);
    let health = Health::new();
    let token = CancellationToken::new();
    shutdown::install(token.clone());
    let servers_stop = CancellationToken::new();
    let mut servers = tokio::task::JoinSet::new();
    if let Some(addr) = args.metrics_bind_address.addr() {
        let l = http::bind(addr, "--metrics-bind-address").await?;
        servers.spawn(http::serve_metrics(
            l,
            metrics.clone(),
            servers_stop.clone(),
        ));
    }
    if let Some(addr) = args.health_probe_bind_address.addr() {
        let l = http::bind(addr, "--health-probe-bind-address").await?;
        servers.spawn(http::serve_health(l, health.clone(), servers_stop.clone()));
    }
    health.set(
        "informers-synced",
        Err("waiting for the initial list of snapshots and volumes".into()),
    );

    let (snap_reader, snap_writer) = reflector::store::<DeserializeGuard<MiroirSnapshot>>();
    let (vol_reader, vol_writer) = reflector::store::<DeserializeGuard<MiroirVolume>>();
    let ctx = Arc::new(Ctx {
        node: node.clone(),
        settings: decide::Settings {
            deadline: args.deadline,
            cut_guard: args.cut_guard,
        },
        fail_limit: args.barrier_fail_limit.max(1),
        snapshots: Api::all(client.clone()),
        snap_store: snap_reader.clone(),
        vol_store: vol_reader.clone(),
        barrier,
        pools,
        journal: Mutex::new(journal),
        mem: Mutex::new(Memory::default()),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "ucm-snapshot-agent".into(),
                instance: Some(node.clone()),
            },
        ),
        metrics: agent_metrics,
        workers: Mutex::new(HashMap::new()),
        synced: tokio::sync::watch::channel((false, false)).0,
        volume_locks: Mutex::new(HashMap::new()),
        stopping: AtomicBool::new(false),
    });

    // Sweep at start (before acting on anything), then every interval.
    ctx.sweep().await;
    ctx.update_gauge().await;

    let snap_events = watcher(
        Api::<DeserializeGuard<MiroirSnapshot>>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(snap_writer);
    let vol_events = watcher(
        Api::<DeserializeGuard<MiroirVolume>>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(vol_writer);
    let c1 = ctx.clone();
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(async move {
        let mut s = std::pin::pin!(snap_events);
        while let Some(ev) = s.next().await {
            match ev {
                Ok(
                    watcher::Event::Apply(g)
                    | watcher::Event::Delete(g)
                    | watcher::Event::InitApply(g),
                ) => {
                    if let Ok(snap) = &g.0 {
                        c1.notify(&snap.spec.volume_name);
                    }
                }
                // The store swaps in the new list at InitDone: look at every volume again.
                Ok(watcher::Event::InitDone) => {
                    c1.synced.send_modify(|s| s.0 = true);
                    c1.notify_all();
                }
                Ok(_) => {}
                Err(e) => warn!(error = %e, "snapshot watch error"),
            }
        }
    });
    let c2 = ctx.clone();
    tasks.spawn(async move {
        let mut s = std::pin::pin!(vol_events);
        while let Some(ev) = s.next().await {
            match ev {
                Ok(watcher::Event::Apply(g) | watcher::Event::Delete(g)) => {
                    let name = g.name_any();
                    let exists = c2
                        .workers
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .contains_key(&name);
                    if exists {
                        c2.notify(&name);
                    }
                }
                Ok(watcher::Event::InitDone) => {
                    c2.synced.send_modify(|s| s.1 = true);
                    c2.notify_all();
                }
                Ok(_) => {}
                Err(e) => warn!(error = %e, "volume watch error"),
            }
        }
    });
    // Journal entries from an earlier run: their workers start now, even before any event.
    let vols: Vec<String> = ctx
        .journal
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entries()
        .map(|e| e.volume.clone())
        .collect();
    for v in vols {
        ctx.notify(&v);
    }
    {
        let h = health.clone();
        let mut rx = ctx.synced.subscribe();
        tasks.spawn(async move {
            if rx.wait_for(|(a, b)| *a && *b).await.is_ok() {
                h.set("informers-synced", Ok(()));
            }
        });
    }
    tasks.spawn(heartbeat(
        client.clone(),
        namespace,
        node.clone(),
        args.heartbeat_interval,
        token.clone(),
    ));
    let c3 = ctx.clone();
    let sweep_interval = args.sweep_interval;
    tasks.spawn(async move {
        loop {
            tokio::time::sleep(sweep_interval).await;
            c3.sweep().await;
            c3.prune_memory();
        }
    });
    let c4 = ctx.clone();
    tasks.spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(15)).await;
            c4.update_gauge().await;
        }
    });

    token.cancelled().await;
    health.set("shutdown", Err("shutting down".into()));
    // Stop (8.5): report Error for held barriers of live rounds, keep them until the round ends
    // or the deadline passes, then lift and exit.
    ctx.stopping.store(true, Ordering::Relaxed);
    ctx.notify_all();
    let limit = Instant::now() + args.deadline + Duration::from_secs(5);
    while !ctx
        .journal
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_empty()
        && Instant::now() < limit
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ctx.sweep().await;
    tasks.abort_all();
    servers_stop.cancel();
    info!("stopped");
    Ok(())
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

    #[test]
    fn agent_flags_parse_with_defaults() {
        let m = command()
            .try_get_matches_from(["snapshot-agent", "--node-name", "n1"])
            .unwrap();
        let a = AgentArgs::from_arg_matches(&m).unwrap();
        assert_eq!(a.deadline, Duration::from_secs(60));
        assert_eq!(a.cut_guard, Duration::from_secs(5));
        assert_eq!(a.heartbeat_interval, Duration::from_secs(20));
        assert_eq!(a.barrier, BarrierKind::Drbd);
        assert_eq!(a.barrier_timeout, Duration::from_secs(30));
        assert_eq!(a.backend_timeout, Duration::from_secs(120));
        assert_eq!(a.barrier_fail_limit, 5);
        assert_eq!(a.sweep_interval, Duration::from_secs(300));
        assert!(!a.loopfile_full_copy);
        for (arg, want) in [
            ("--loopfile-full-copy", true),
            ("--loopfile-full-copy=true", true),
            ("--loopfile-full-copy=false", false),
        ] {
            let m = command()
                .try_get_matches_from(["snapshot-agent", "--node-name", "n1", arg])
                .unwrap();
            assert_eq!(
                AgentArgs::from_arg_matches(&m).unwrap().loopfile_full_copy,
                want,
                "{arg}"
            );
        }
    }
}

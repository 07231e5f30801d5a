//! The MiroirSnapshot reconciler (IO): reads the snapshot, its volume and the agents' heartbeats,
//! asks [`build::decide`] and performs the one fenced write it returns. Progress is driven by
//! watch events (snapshots with status-only changes, volumes, agent Leases) and by the exact
//! timers the decision names; there is no polling.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::runtime::Guarded;
use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{
    Api, Resource, ResourceExt,
    api::ListParams,
    runtime::{
        WatchStreamExt,
        controller::Action,
        events::EventType,
        reflector::{ObjectRef, Store},
        watcher,
    },
};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts};
use tracing::{debug, info};

use super::build::{self, Decision, Observed, RoundResult, Step};
use super::round::{self, RoundView};
use super::types::{MiroirSnapshot, MiroirVolume, READY};
use crate::conditions::{self, Desired};
use crate::runtime::{ReconcileError, Runtime, Trigger, WriteError, Writer, controller};

/// Name of the manager's controller (metrics label, field manager `ucm-miroirsnapshot`).
pub const CONTROLLER: &str = "miroirsnapshot";
/// Prefix of the agents' heartbeat Leases.
pub const AGENT_LEASE_PREFIX: &str = "ucm-snapshot-agent-";

/// Each variant names the step; the cause stays its `source`, so the runtime's `error_chain`
/// prints every cause once.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("write")]
    Write(#[from] WriteError),
    #[error("read")]
    Read(#[source] kube::Error),
    #[error("a fenced write was rejected: the round changed since it was read")]
    Fenced,
    #[error("encode patch")]
    Encode(#[from] serde_json::Error),
}

impl ReconcileError for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::Write(e) => e.metric_label(),
            Error::Read(_) => "read",
            Error::Fenced => "fenced",
            Error::Encode(_) => "encode",
        }
    }

    fn own_metric_labels() -> &'static [&'static str] {
        &["read", "fenced", "encode"]
    }

    fn is_conflict(&self) -> bool {
        match self {
            Error::Fenced => true,
            Error::Write(e) => e.is_conflict(),
            _ => false,
        }
    }
}

/// The manager's round metrics.
#[derive(Clone)]
pub struct RoundMetrics {
    pub rounds_total: IntCounterVec,
    /// From `suspendedAt` to the publish or void that closed the round (second precision: the
    /// stamp has whole seconds). The per-leg held time is the agents' histogram.
    pub round_open_seconds: HistogramVec,
}

impl RoundMetrics {
    pub fn register(registry: &prometheus::Registry) -> Self {
        let rounds_total = IntCounterVec::new(
            Opts::new(
                "ucm_snapshot_rounds_total",
                "Snapshot rounds closed, by result",
            ),
            &["result"],
        )
        .expect("valid metric");
        let round_open_seconds = HistogramVec::new(
            HistogramOpts::new(
                "ucm_snapshot_round_open_seconds",
                "Time a snapshot round stayed open (suspendedAt to publish or void)",
            )
            .buckets(vec![
                1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
            ]),
            &["result"],
        )
        .expect("valid metric");
        // Registration fails only if another instance registered first (tests); reuse is fine.
        let _ = registry.register(Box::new(rounds_total.clone()));
        let _ = registry.register(Box::new(round_open_seconds.clone()));
        for r in ["success", "expired", "failed"] {
            rounds_total.with_label_values(&[r]);
        }
        RoundMetrics {
            rounds_total,
            round_open_seconds,
        }
    }
}

pub struct Context {
    pub writer: Writer,
    pub snapshots: Api<MiroirSnapshot>,
    pub snapshot_store: Store<Guarded<MiroirSnapshot>>,
    pub volumes: Store<Guarded<MiroirVolume>>,
    pub leases: Store<Lease>,
    pub settings: build::Settings,
    pub metrics: RoundMetrics,
    /// Per-volume lock around the check-and-open step (I8, docs/snapshot.md, "Invariants").
    volume_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Context {
    fn volume_lock(&self, volume: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.volume_locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(volume.to_string())
            .or_default()
            .clone()
    }

    fn volume(&self, name: &str) -> Option<MiroirVolume> {
        self.volumes
            .get(&ObjectRef::new(name))
            .and_then(|g| g.0.as_ref().ok().cloned())
    }

    fn heartbeats(&self) -> BTreeMap<String, Timestamp> {
        self.leases
            .state()
            .iter()
            .filter_map(|l| {
                let node = l.name_any().strip_prefix(AGENT_LEASE_PREFIX)?.to_string();
                let spec = l.spec.as_ref()?;
                let t = spec
                    .renew_time
                    .as_ref()
                    .or(spec.acquire_time.as_ref())
                    .map(|t| t.0)?;
                Some((node, t))
            })
            .collect()
    }
}

/// Whether a heartbeat of `node`'s agent can change this snapshot's decision: a deletion that
/// waits on that node's finalizer, or an open gated on replicas (rows 1 and 11 of
/// docs/snapshot.md, "Manager states"). Every replica
/// node has a finalizer, so the finalizer list names the nodes that matter.
pub fn waits_on_agent(s: &MiroirSnapshot, node: &str) -> bool {
    let mine = super::types::teardown_finalizer(node);
    if !s.finalizers().contains(&mine) {
        return false;
    }
    if s.metadata.deletion_timestamp.is_some() {
        return true;
    }
    let r = RoundView::of(s);
    !r.ready
        && !r.io_suspended
        && s.status.as_ref().is_some_and(|st| {
            conditions::find(&st.conditions, READY)
                .is_some_and(|c| c.reason == build::reason::WAITING_FOR_REPLICAS)
        })
}

/// The snapshot waits for another snapshot's round on its volume (manager row 12).
pub fn waits_on_round(s: &MiroirSnapshot) -> bool {
    s.status.as_ref().is_some_and(|st| {
        conditions::find(&st.conditions, READY)
            .is_some_and(|c| c.reason == build::reason::WAITING_FOR_ROUND)
    })
}

/// Another snapshot of `volume` with an open round, among `candidates`.
fn other_open_round<'a>(
    me: &MiroirSnapshot,
    candidates: impl Iterator<Item = &'a MiroirSnapshot>,
) -> Option<String> {
    let mut names: Vec<String> = candidates
        .filter(|s| s.spec.volume_name == me.spec.volume_name && s.name_any() != me.name_any())
        .filter(|s| RoundView::of(s).io_suspended && !RoundView::of(s).ready)
        .map(|s| s.name_any())
        .collect();
    names.sort();
    names.into_iter().next()
}

fn desired_conditions(
    snap: &MiroirSnapshot,
    d: &Decision,
    now: Timestamp,
) -> (
    Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
    bool,
) {
    let mut conds = snap
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let changed = match &d.ready {
        Some(r) => conditions::set(
            &mut conds,
            Desired::new(READY, r.status, r.reason, r.message.clone()),
            snap.metadata.generation,
            &conditions::truncate(now),
        ),
        None => false,
    };
    (conds, changed)
}

fn to_patch(v: serde_json::Value) -> Result<json_patch::Patch, Error> {
    Ok(serde_json::from_value(v)?)
}

/// One reconcile of one snapshot.
pub async fn reconcile(snap: Arc<MiroirSnapshot>, ctx: Arc<Context>) -> Result<Action, Error> {
    let mut snap = (*snap).clone();
    let mut fresh = false;
    // At most: one uncached re-read (manager row 8) and one re-decision under the volume lock
    // (row 13).
    for _ in 0..3 {
        let now = Timestamp::now();
        let volume = ctx.volume(&snap.spec.volume_name);
        let heartbeats = ctx.heartbeats();
        // By reference: cloning every cached snapshot on each pass made a pass O(n) deep copies.
        let cached = ctx.snapshot_store.state();
        let other = other_open_round(&snap, cached.iter().filter_map(|g| g.0.as_ref().ok()));
        let obs = Observed {
            snapshot: &snap,
            volume: volume.as_ref(),
            heartbeats: &heartbeats,
            other_round: other.as_deref(),
            fresh,
            now,
        };
        let d = build::decide(&obs, &ctx.settings);
        match &d.step {
            Step::ReRead => {
                snap = ctx
                    .snapshots
                    .get(&snap.name_any())
                    .await
                    .map_err(Error::Read)?;
                fresh = true;
                continue;
            }
            // Opening, or waiting for another snapshot's round per the cache: decide again under
            // the per-volume lock with uncached data (I8), so a stale cache neither opens a
            // second round nor leaves this one waiting for a round that already closed.
            _ if !fresh
                && (matches!(d.step, Step::Open { .. })
                    || d.ready
                        .as_ref()
                        .is_some_and(|r| r.reason == build::reason::WAITING_FOR_ROUND)) =>
            {
                let lock = ctx.volume_lock(&snap.spec.volume_name);
                let _g = lock.lock().await;
                let same_volume = ListParams::default()
                    .fields(&format!("spec.volumeName={}", snap.spec.volume_name));
                let all = ctx
                    .snapshots
                    .list(&same_volume)
                    .await
                    .map_err(Error::Read)?;
                let Some(me) = all.items.iter().find(|s| s.uid() == snap.uid()).cloned() else {
                    return Ok(Action::await_change());
                };
                let other = other_open_round(&me, all.items.iter());
                let obs = Observed {
                    snapshot: &me,
                    volume: volume.as_ref(),
                    heartbeats: &heartbeats,
                    other_round: other.as_deref(),
                    fresh: true,
                    now: Timestamp::now(),
                };
                let d = build::decide(&obs, &ctx.settings);
                return act(&me, d, &ctx).await;
            }
            _ => return act(&snap, d, &ctx).await,
        }
    }
    Ok(Action::requeue(Duration::from_secs(1)))
}

async fn act(snap: &MiroirSnapshot, d: Decision, ctx: &Context) -> Result<Action, Error> {
    let now = Timestamp::now();
    let name = snap.name_any();
    let uid = snap.uid().unwrap_or_default();
    let rv = snap.resource_version().unwrap_or_default();
    let r = RoundView::of(snap);
    let (conds, cond_changed) = desired_conditions(snap, &d, now);
    let patch = match &d.step {
        Step::Wait | Step::ReRead => {
            let initialised = snap
                .status
                .as_ref()
                .is_some_and(|s| s.io_suspended.is_some());
            if cond_changed && !initialised {
                // E.g. TeardownPending on a snapshot deleted before its first status write.
                Some(round::init_patch(&uid, &rv, snap.status.as_ref(), &conds))
            } else if cond_changed {
                Some(round::conditions_patch(
                    &uid,
                    r.io_suspended,
                    r.suspended_at,
                    &conds,
                ))
            } else {
                None
            }
        }
        Step::Initialise => Some(round::init_patch(&uid, &rv, snap.status.as_ref(), &conds)),
        Step::SetFinalizers(f) => {
            let p = to_patch(round::finalizers_patch(&uid, &rv, f))?;
            ctx.writer
                .patch(&ctx.snapshots, &name, &kube::api::Patch::<()>::Json(p))
                .await
                .map_err(|e| {
                    if e.is_conflict() {
                        Error::Fenced
                    } else {
                        Error::Write(e)
                    }
                })?;
            debug!(snapshot = %name, "teardown finalizers added");
            return Ok(Action::await_change());
        }
        Step::Open { stamp, diskful } => Some(round::open_patch(
            &uid,
            r.suspended_at,
            &rv,
            stamp,
            diskful,
            &conds,
        )),
        Step::Publish {
            size_bytes,
            source_formatted,
            slots,
            ..
        } => Some(round::publish_patch(
            &uid,
            r.suspended_at,
            &rv,
            *size_bytes,
            *source_formatted,
            slots,
            &conds,
        )),
        Step::Void { stamp, diskful, .. } => Some(round::void_patch(
            &uid,
            r.suspended_at,
            &rv,
            stamp,
            diskful,
            &conds,
        )),
    };
    if let Some(p) = patch {
        let p = to_patch(p)?;
        ctx.writer
            .json_patch_status(&ctx.snapshots, &name, p)
            .await
            .map_err(|e| {
                if e.is_conflict() {
                    Error::Fenced
                } else {
                    Error::Write(e)
                }
            })?;
    }
    // Only after the write landed: metrics, events, logs.
    if let Some(result) = d.result {
        ctx.metrics
            .rounds_total
            .with_label_values(&[result.label()])
            .inc();
        if let Some(t) = r.suspended_at.and_then(round::parse_stamp) {
            ctx.metrics
                .round_open_seconds
                .with_label_values(&[result.label()])
                .observe(round::elapsed(t, now).as_secs_f64());
        }
        info!(snapshot = %name, volume = %snap.spec.volume_name, result = result.label(), "round closed");
    }
    if matches!(d.step, Step::Open { .. }) {
        info!(snapshot = %name, volume = %snap.spec.volume_name, "round opened");
    }
    if let Some(ev) = &d.event {
        let t = if ev.warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        let action = match d.result {
            Some(RoundResult::Success) => "Publish",
            Some(_) => "Void",
            None => "Open",
        };
        ctx.writer
            .event(&snap.object_ref(&()), t, ev.reason, action, ev.note.clone())
            .await;
    }
    Ok(match d.requeue_at {
        Some(at) => Action::requeue(round::elapsed(now, at).max(Duration::from_millis(100))),
        None => Action::await_change(),
    })
}

/// Builds and runs the controller until shutdown.
pub async fn run(rt: Runtime, settings: build::Settings, agent_namespace: String) {
    let client = rt.client.clone();
    let snapshots: Api<MiroirSnapshot> = Api::all(client.clone());
    let guarded: Api<Guarded<MiroirSnapshot>> = Api::all(client.clone());

    let (vol_reader, volume_events) = rt.reflect(
        "miroirvolumes",
        Api::<Guarded<MiroirVolume>>::all(client.clone()),
        watcher::Config::default(),
    );
    let (lease_reader, lease_events) = rt.reflect(
        "snapshot-agent-leases",
        Api::<Lease>::namespaced(client.clone(), &agent_namespace),
        watcher::Config::default(),
    );
    let lease_events = lease_events.filter(|l| {
        futures::future::ready(
            l.as_ref()
                .map(|l| l.name_any().starts_with(AGENT_LEASE_PREFIX))
                .unwrap_or(true),
        )
    });

    // One watch for two consumers: the controller, and the mapping of every snapshot change
    // to the siblings that wait on it (a round closing, by publish, void or deletion, lets the
    // next snapshot of that volume open).
    let (store, events) = rt.reflect_fanout(
        CONTROLLER,
        guarded,
        watcher::Config::default(),
        2,
        controller::drop_managed_fields,
    );
    let [primary, sibling_events]: [_; 2] = events.try_into().ok().expect("two streams");
    let controller =
        rt.controller_on::<MiroirSnapshot>(CONTROLLER, store.clone(), primary, Trigger::AnyChange);
    let by_volume = store.clone();
    let waiting = store.clone();
    let siblings = store.clone();
    let sibling_events = sibling_events.touched_objects();
    let controller =
        controller.watches_stream(sibling_events, move |changed: Guarded<MiroirSnapshot>| {
            let Ok(changed) = changed.0 else {
                return Vec::new();
            };
            siblings
                .state()
                .iter()
                .filter(|s| {
                    s.0.as_ref().is_ok_and(|s| {
                        s.spec.volume_name == changed.spec.volume_name
                            && s.uid() != changed.uid()
                            && waits_on_round(s)
                    })
                })
                .map(|s| ObjectRef::from_obj(&**s))
                .collect::<Vec<_>>()
        });
    let controller = controller
        .watches_stream(volume_events, move |v: Guarded<MiroirVolume>| {
            let name = v.name_any();
            by_volume
                .state()
                .iter()
                .filter(|s| s.0.as_ref().is_ok_and(|s| s.spec.volume_name == name))
                .map(|s| ObjectRef::from_obj(&**s))
                .collect::<Vec<_>>()
        })
        .watches_stream(lease_events, move |l: Lease| {
            let node = l
                .name_any()
                .strip_prefix(AGENT_LEASE_PREFIX)
                .map(str::to_string)
                .unwrap_or_default();
            waiting
                .state()
                .iter()
                .filter(|s| s.0.as_ref().is_ok_and(|s| waits_on_agent(s, &node)))
                .map(|s| ObjectRef::from_obj(&**s))
                .collect::<Vec<_>>()
        });

    let ctx = Arc::new(Context {
        writer: rt.writer(CONTROLLER),
        snapshots,
        snapshot_store: store,
        volumes: vol_reader,
        leases: lease_reader,
        settings,
        metrics: RoundMetrics::register(&rt.metrics.registry),
        volume_locks: Mutex::new(HashMap::new()),
    });
    controller::run(
        &rt,
        CONTROLLER,
        controller,
        ctx,
        Duration::from_secs(60),
        reconcile,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::types::{MiroirSnapshotSpec, MiroirSnapshotStatus};

    fn snap(name: &str, vol: &str, open: bool) -> MiroirSnapshot {
        let mut s = MiroirSnapshot::new(
            name,
            MiroirSnapshotSpec {
                volume_name: vol.into(),
            },
        );
        s.status = Some(MiroirSnapshotStatus {
            io_suspended: Some(open),
            ready_to_use: Some(false),
            ..Default::default()
        });
        s
    }

    #[test]
    fn the_error_chain_prints_each_cause_once() {
        let cause = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let text = cause.to_string();
        let chain = crate::runtime::controller::error_chain(&Error::Encode(cause));
        assert_eq!(chain, format!("encode patch: {text}"));
    }

    #[test]
    fn heartbeats_wake_only_snapshots_gated_on_that_agent() {
        use crate::snapshot::types::teardown_finalizer;
        let mut s = snap("a", "v", false);
        s.metadata.finalizers = Some(vec![teardown_finalizer("n1")]);
        assert!(!waits_on_agent(&s, "n1"), "no WaitingForReplicas condition");
        s.status.as_mut().unwrap().conditions =
            vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: READY.into(),
                status: "False".into(),
                reason: build::reason::WAITING_FOR_REPLICAS.into(),
                message: "n1: no snapshot agent heartbeat".into(),
                observed_generation: None,
                last_transition_time: conditions::now(),
            }];
        assert!(waits_on_agent(&s, "n1"));
        assert!(!waits_on_agent(&s, "n2"));
        s.status.as_mut().unwrap().io_suspended = Some(true);
        assert!(
            !waits_on_agent(&s, "n1"),
            "an open round does not wait on heartbeats"
        );
        s.metadata.deletion_timestamp = Some(conditions::now());
        assert!(waits_on_agent(&s, "n1"));
    }

    #[test]
    fn other_open_round_ignores_self_other_volumes_and_closed_rounds() {
        let me = snap("a", "v", false);
        let all = [
            snap("a", "v", true),
            snap("b", "v", false),
            snap("c", "w", true),
            snap("d", "v", true),
        ];
        assert_eq!(other_open_round(&me, all.iter()), Some("d".into()));
        assert_eq!(other_open_round(&me, all[..3].iter()), None);
    }
}

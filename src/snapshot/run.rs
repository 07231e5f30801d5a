//! The MiroirSnapshot reconciler's wiring (IO): [`reconcile`] reads the snapshot, its volume and
//! the agents' heartbeats (`observe.rs`), asks [`decide`](super::decide::decide) and performs the
//! one fenced write it returns (`apply.rs`); [`run`] builds the watches and the controller.
//! Progress is driven by watch events (snapshots with status-only changes, volumes, agent
//! Leases) and by the exact timers the decision names; there is no polling (docs/snapshot.md,
//! "Manager states").

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{
    Api, ResourceExt,
    api::ListParams,
    runtime::{WatchStreamExt, controller::Action, reflector::ObjectRef, watcher},
};

use super::apply::act;
use super::context::{Context, Error, RoundMetrics, Settings};
use super::decide::{self, Observed, Step};
use super::observe::{AGENT_LEASE_PREFIX, other_open_round, waits_on_agent, waits_on_round};
use super::types::{MiroirSnapshot, MiroirVolume};
use crate::runtime::{Guarded, Runtime, Trigger, controller};

/// Name of the manager's controller (metrics label, field manager `ucm-miroirsnapshot`).
pub const CONTROLLER: &str = "miroirsnapshot";

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
        let d = decide::decide(&obs, &ctx.settings);
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
                        .is_some_and(|r| r.reason == decide::reason::WAITING_FOR_ROUND)) =>
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
                let d = decide::decide(&obs, &ctx.settings);
                return act(&me, d, &ctx).await;
            }
            _ => return act(&snap, d, &ctx).await,
        }
    }
    Ok(Action::requeue(Duration::from_secs(1)))
}

/// Builds and runs the controller until shutdown.
pub async fn run(rt: Runtime, settings: Settings, agent_namespace: String) {
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

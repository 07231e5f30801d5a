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
    runtime::{WatchStreamExt, controller::Action, reflector::ObjectRef, watcher},
};

use super::apply::apply;
use super::context::{Context, Error, RoundMetrics, Settings};
use super::decide::{self, Observed, Step};
use super::grant;
use super::observe::{waits_on_agent, waits_on_round};
use super::round::{AGENT_LEASE_LABEL, AGENT_LEASE_PREFIX};
use super::types::{MiroirSnapshot, MiroirVolume};
use crate::runtime::index::NameIndex;
use crate::runtime::{Guarded, Runtime, Trigger, controller};

/// Name of the manager's controller (metrics label, field manager `ucm-miroirsnapshot`).
pub const CONTROLLER: &str = "miroirsnapshot";

/// One reconcile of one snapshot.
pub async fn reconcile(snap: Arc<MiroirSnapshot>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Decide only on listed caches: an empty heartbeat cache would read as every agent silent.
    if !ctx.synced.wait().await {
        return Ok(Action::await_change());
    }
    let mut snap = (*snap).clone();
    let mut fresh = false;
    // At most one uncached re-read of the snapshot (manager row 8).
    for _ in 0..2 {
        let now = Timestamp::now();
        let volume = ctx.volume(&snap.spec.volume_name);
        let heartbeats = ctx.heartbeats();
        let obs = Observed {
            snapshot: &snap,
            volume: volume.as_ref(),
            heartbeats: &heartbeats,
            other_round: None,
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
            // Opening: take the volume's round grant first (I8, docs/snapshot.md, "One round per
            // volume"); while another snapshot holds it, decide again as waiting on that one.
            Step::Open { stamp, .. } => {
                let Some(volume) = volume.as_ref() else {
                    return apply(&snap, d, &ctx).await;
                };
                let lock = ctx.volume_lock(&snap.spec.volume_name);
                let _g = lock.lock().await;
                match ctx.take_grant(&snap, volume, stamp, now).await? {
                    None => return apply(&snap, d, &ctx).await,
                    Some((holder, until)) => {
                        let obs = Observed {
                            other_round: Some(&holder),
                            ..obs
                        };
                        let mut d = decide::decide(&obs, &ctx.settings);
                        d.requeue_at = d.requeue_at.or(until);
                        return apply(&snap, d, &ctx).await;
                    }
                }
            }
            _ => return apply(&snap, d, &ctx).await,
        }
    }
    Ok(Action::requeue(Duration::from_secs(1)))
}

impl Context {
    /// Writes the volume's round grant for `snap`'s round stamped `stamp` (docs/snapshot.md,
    /// "One round per volume"). `Ok(None)`: granted, open now. `Ok(Some((holder, until)))`:
    /// another snapshot's round holds the volume; look again at `until` if it never opens (its
    /// closing wakes this snapshot otherwise). A grant taken meanwhile by another writer fails the
    /// fenced write: `Error::Fenced`, decided again.
    async fn take_grant(
        &self,
        snap: &MiroirSnapshot,
        volume: &MiroirVolume,
        stamp: &str,
        now: Timestamp,
    ) -> Result<Option<(String, Option<Timestamp>)>, Error> {
        let name = grant::lease_name(&snap.spec.volume_name);
        let lease = self
            .leases
            .get(&ObjectRef::new(&name).within(&self.agent_namespace))
            .map(|l| (*l).clone());
        let uid = snap.uid().unwrap_or_default();
        if let Some(g) = lease.as_ref().and_then(grant::grant_of) {
            let cached = self
                .snapshot_store
                .get(&ObjectRef::new(&g.snapshot))
                .and_then(|h| h.0.as_ref().ok().cloned());
            let deadline = self.settings.deadline;
            let mut state = grant::holder_state(&g, cached.as_ref(), &uid, now, deadline, false);
            if state == grant::Holder::Unknown {
                // Not cached (a restart, or a cache behind the Lease's watch): one uncached read
                // of that one snapshot, never a list.
                let fresh = self
                    .snapshots
                    .get_opt(&g.snapshot)
                    .await
                    .map_err(Error::Read)?;
                state = grant::holder_state(&g, fresh.as_ref(), &uid, now, deadline, true);
            }
            match state {
                grant::Holder::Over => {}
                grant::Holder::Open | grant::Holder::Unknown => {
                    return Ok(Some((g.snapshot, None)));
                }
                grant::Holder::Pending(until) => return Ok(Some((g.snapshot, Some(until)))),
            }
        }
        let deadline = self.settings.deadline;
        let written = match lease {
            None => {
                let l = grant::new_lease(&self.agent_namespace, volume, snap, stamp, deadline);
                self.writer.create(&self.round_leases, &l).await.map(|_| ())
            }
            Some(l) => {
                let rv = l.resource_version().unwrap_or_default();
                let p: json_patch::Patch =
                    serde_json::from_value(grant::grant_patch(&rv, snap, stamp, deadline))?;
                self.writer
                    .patch(&self.round_leases, &name, &kube::api::Patch::<()>::Json(p))
                    .await
                    .map(|_| ())
            }
        };
        written.map_err(|e| {
            if e.is_conflict() || e.is_already_exists() {
                Error::Fenced
            } else {
                Error::Write(e)
            }
        })?;
        Ok(None)
    }
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
    // The round grants (one Lease per volume), read by name; the heartbeats apart, since every
    // pass reads all of them.
    let (lease_reader, grant_events) = rt.reflect(
        "snapshot-round-leases",
        Api::<Lease>::namespaced(client.clone(), &agent_namespace),
        watcher::Config::default(),
    );
    // Nothing is mapped from a grant's change (its snapshot's own write follows it): the
    // stream only keeps the cache.
    let stop = rt.shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = grant_events.for_each(|_| futures::future::ready(())) => {}
            _ = stop.cancelled() => {}
        }
    });
    let (heartbeat_reader, lease_events) = rt.reflect(
        "snapshot-agent-leases",
        Api::<Lease>::namespaced(client.clone(), &agent_namespace),
        watcher::Config::default()
            .labels(&format!("{}={}", AGENT_LEASE_LABEL.0, AGENT_LEASE_LABEL.1)),
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
    // Snapshots by volume, so a change finds its volume's snapshots without a scan of all
    // (docs/architecture.md, "Caches and indexes").
    let by_volume_ix = Arc::new(NameIndex::new(snapshot_volume));
    let (store, events) = rt.reflect_fanout(
        CONTROLLER,
        guarded,
        watcher::Config::default(),
        2,
        controller::drop_managed_fields,
        Some(Arc::clone(&by_volume_ix)),
    );
    let [primary, sibling_events]: [_; 2] = events.try_into().ok().expect("two streams");
    let controller =
        rt.controller_on::<MiroirSnapshot>(CONTROLLER, store.clone(), primary, Trigger::AnyChange);
    let by_volume = Arc::clone(&by_volume_ix);
    let waiting = store.clone();
    let (siblings, sibling_ix) = (store.clone(), by_volume_ix);
    let sibling_events = sibling_events.touched_objects();
    let controller =
        controller.watches_stream(sibling_events, move |changed: Guarded<MiroirSnapshot>| {
            let Ok(changed) = changed.0 else {
                return Vec::new();
            };
            sibling_ix
                .names("", &changed.spec.volume_name)
                .iter()
                .filter_map(|n| siblings.get(&ObjectRef::new(n)))
                .filter(|s| {
                    s.0.as_ref()
                        .is_ok_and(|s| s.uid() != changed.uid() && waits_on_round(s))
                })
                .map(|s| ObjectRef::from_obj(&*s))
                .collect::<Vec<_>>()
        });
    let controller = controller
        .watches_stream(volume_events, move |v: Guarded<MiroirVolume>| {
            by_volume
                .names("", &v.name_any())
                .iter()
                .map(|n| ObjectRef::new(n))
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
        heartbeat_leases: heartbeat_reader,
        round_leases: Api::namespaced(client.clone(), &agent_namespace),
        agent_namespace,
        settings,
        synced: rt.synced(&[
            "miroirvolumes",
            "snapshot-round-leases",
            "snapshot-agent-leases",
        ]),
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

/// The key of [`NameIndex`] for snapshots: the volume they cut (immutable).
fn snapshot_volume(s: &Guarded<MiroirSnapshot>) -> Vec<String> {
    s.0.as_ref()
        .map(|s| vec![s.spec.volume_name.clone()])
        .unwrap_or_default()
}

//! The shared controller-manager runtime: flags, leader election, metrics, health, shutdown and
//! the plumbing every feature's controllers run on.
//!
//! How a feature plugs in (see `crate::FEATURES`):
//! 1. `src/<feature>/mod.rs` defines `pub static FEATURE: Feature` ([`feature::Feature`]).
//! 2. Its `start(rt, matches)` parses its settings from `matches`, builds controllers with
//!    [`Runtime::controller`] (primary kind, [`guarded::Guarded`], backoff, predicate,
//!    concurrency, reconcile-all on leadership, graceful shutdown) and runs each with
//!    [`controller::run`] (leadership check, metrics, error policy, logging).
//! 3. Every write goes through a [`writer::Writer`] from [`Runtime::writer`]: it refuses writes
//!    unless this replica leads.
//! 4. Leader-only servers follow [`leader::Leadership::subscribe`].
//! 5. Secondary watches (for `watches_stream`, mappers) come from [`Runtime::reflect`], so
//!    readiness waits for their initial list too.
//! 6. RBAC: `rbac` lists cluster rules (read access to the feature's CRDs is added for you),
//!    `namespaced_rbac` rules in the manager's namespace; build them with [`rbac::rule`].

pub mod cli;
pub mod controller;
pub mod crd_bounds;
pub mod events;
pub mod feature;
pub mod guarded;
pub mod health;
pub mod http;
pub mod index;
pub mod kube_errors;
pub mod leader;
pub mod logging;
pub mod manager;
pub mod meta;
pub mod metrics;
pub mod own_writes;
pub mod rbac;
pub mod shutdown;
pub mod text;
pub mod time;
pub mod timers;
pub mod trim;
pub mod unreadable;
pub mod writer;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use kube::{Api, Client, Resource, core::NamespaceResourceScope};
use tokio_util::sync::CancellationToken;

pub use controller::{ReconcileError, Trigger};
pub use feature::{Agent, Feature};
pub use guarded::Guarded;
pub use leader::Leadership;
pub use writer::{WriteError, Writer};

/// Settings every feature may read.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// The manager's own namespace: generated Secrets, the leader Lease.
    pub manager_namespace: String,
    /// `--watch-namespace`; `None` watches all namespaces.
    pub watch_namespace: Option<String>,
    pub max_concurrent_reconciles: u16,
    /// `POD_NAME` when running in a Pod (event reporting instance, leader label).
    pub pod_name: Option<String>,
    /// This replica's leader-election identity.
    pub identity: String,
}

/// The handle a feature gets: one client, leadership, registry, health and shutdown token.
#[derive(Clone)]
pub struct Runtime {
    pub client: Client,
    pub leadership: Leadership,
    pub metrics: Arc<metrics::Metrics>,
    pub health: health::Health,
    pub shutdown: CancellationToken,
    pub config: Arc<RuntimeConfig>,
    /// The feature this handle was given to (set by the manager before `start`).
    feature: Option<&'static str>,
    /// Watches per feature: (feature, watch name) → synced.
    watches: Arc<Mutex<BTreeMap<(&'static str, &'static str), bool>>>,
    /// Woken whenever a watch finishes its initial list (see [`Synced`]).
    synced_changed: Arc<tokio::sync::Notify>,
}

impl Runtime {
    pub fn new(
        client: Client,
        leadership: Leadership,
        metrics: Arc<metrics::Metrics>,
        health: health::Health,
        shutdown: CancellationToken,
        config: RuntimeConfig,
    ) -> Self {
        Runtime {
            client,
            leadership,
            metrics,
            health,
            shutdown,
            config: Arc::new(config),
            feature: None,
            watches: Default::default(),
            synced_changed: Default::default(),
        }
    }

    /// An Api over the watched namespaces: `--watch-namespace`, or all.
    pub fn watched<K>(&self) -> Api<K>
    where
        K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>,
    {
        match &self.config.watch_namespace {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::all(self.client.clone()),
        }
    }

    /// An Api in the manager's own namespace.
    pub fn own_namespace<K>(&self) -> Api<K>
    where
        K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.config.manager_namespace)
    }

    /// A leadership-gated writer with field manager `ucm-<controller>`.
    pub fn writer(&self, controller: &str) -> Writer {
        let instance = self
            .config
            .pod_name
            .clone()
            .or_else(|| Some(self.config.identity.clone()));
        Writer::new(
            self.client.clone(),
            self.leadership.clone(),
            controller,
            instance,
        )
    }

    /// This handle, for one feature: its watches gate that feature's readiness check.
    pub(crate) fn for_feature(&self, feature: &'static str) -> Runtime {
        Runtime {
            feature: Some(feature),
            ..self.clone()
        }
    }

    /// Keeps `/readyz` failing (`informers-synced`, and `feature-<name>` until every watch of the
    /// feature has listed) until the returned tracker sees the end of the watch's initial list.
    /// Event-driven: kube's `Store::wait_until_ready` wakes only its most recent waiter, which
    /// is the Controller.
    pub fn track_synced(&self, name: &'static str) -> SyncTracker {
        let key = (self.feature.unwrap_or(""), name);
        self.watches.lock().expect("lock").insert(key, false);
        self.publish_synced();
        SyncTracker {
            rt: self.clone(),
            key,
            started: std::time::Instant::now(),
            listed: 0,
        }
    }

    /// A gate that opens once the named watches of this feature have listed, for reconcilers
    /// that read caches other than their own.
    pub fn synced(&self, names: &[&'static str]) -> Synced {
        Synced {
            rt: self.clone(),
            names: names.to_vec(),
        }
    }

    fn publish_synced(&self) {
        self.synced_changed.notify_waiters();
        let watches = self.watches.lock().expect("lock");
        let pending: Vec<_> = watches
            .iter()
            .filter(|(_, synced)| !**synced)
            .map(|((_, w), _)| *w)
            .collect();
        self.health.set(
            "informers-synced",
            if pending.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "waiting for the initial list of: {}",
                    pending.join(", ")
                ))
            },
        );
        if let Some(f) = self.feature {
            let mine: Vec<_> = watches.iter().filter(|((feat, _), _)| *feat == f).collect();
            if !mine.is_empty() && mine.iter().all(|(_, synced)| **synced) {
                self.health.set(&format!("feature-{f}"), Ok(()));
            }
        }
    }
}

/// Counts one watch's initial list and marks the watch synced at its end (see
/// [`Runtime::track_synced`]); feed it every event with `.inspect(move |ev| t.observe(ev))`.
pub struct SyncTracker {
    rt: Runtime,
    key: (&'static str, &'static str),
    started: std::time::Instant,
    listed: usize,
}

impl SyncTracker {
    pub fn observe<K, E>(&mut self, ev: &Result<kube::runtime::watcher::Event<K>, E>) {
        use kube::runtime::watcher::Event;
        match ev {
            Ok(Event::InitApply(_)) => self.listed += 1,
            Ok(Event::InitDone) => self.mark("initial list done"),
            _ => {}
        }
    }

    /// For a readiness gate that is not a watch (a feature's start-up reads).
    pub fn done(mut self) {
        self.mark("start-up reads done");
    }

    fn mark(&mut self, what: &'static str) {
        let first = self.rt.watches.lock().expect("lock").insert(self.key, true) == Some(false);
        if first {
            // Where start-up time goes, watch by watch (docs/benchmarks.md, "Start-up").
            tracing::info!(
                feature = self.key.0,
                watch = self.key.1,
                objects = self.listed,
                ms = self.started.elapsed().as_millis() as u64,
                "{what}"
            );
            self.rt.publish_synced();
        }
    }
}

/// See [`Runtime::synced`]. Any number of tasks may wait on it at once, unlike kube's
/// `Store::wait_until_ready`, which wakes only its latest waiter (the Controller's own).
#[derive(Clone)]
pub struct Synced {
    rt: Runtime,
    names: Vec<&'static str>,
}

impl Synced {
    fn open(&self) -> bool {
        let feature = self.rt.feature.unwrap_or("");
        let watches = self.rt.watches.lock().expect("lock");
        self.names
            .iter()
            .all(|n| watches.get(&(feature, *n)).copied().unwrap_or(false))
    }

    /// Waits until every named watch has listed; false when shutdown came first.
    pub async fn wait(&self) -> bool {
        loop {
            let notified = self.rt.synced_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.open() {
                return true;
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = self.rt.shutdown.cancelled() => return false,
            }
        }
    }
}

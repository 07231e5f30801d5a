//! Running a kube-runtime Controller the ucm way, so every feature gets the same behaviour:
//! a [`Guarded`] primary stream with backoff and a generation/finalizer predicate,
//! concurrency from `--max-concurrent-reconciles`, `reconcile_all_on` leadership acquisition,
//! `graceful_shutdown_on` the shared token, metrics around every reconcile, the leadership check
//! before it, one error policy with per-object exponential backoff, and the run stream drained
//! with one log line per error.

use std::{
    collections::HashMap,
    fmt::Debug,
    future::Future,
    hash::{Hash, Hasher},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::StreamExt;
use kube::{
    Api, Resource,
    runtime::{
        Controller, Predicate, WatchStreamExt,
        controller::{Action, Config},
        predicates,
        reflector::{self, ObjectRef},
        watcher,
    },
};
use rand::Rng;
use serde::de::DeserializeOwned;
use tracing::{Instrument, debug, info_span, warn};

use super::index::NameIndex;
use super::{Runtime, metrics::ControllerMetrics, metrics::ReconcileResult};

/// A reconciler's error: one fixed metric label per variant, and whether it is a write conflict
/// (requeued within ~100 ms and not counted as a failure).
pub trait ReconcileError: std::error::Error + Send + Sync + 'static {
    fn metric_label(&self) -> &'static str;
    fn is_conflict(&self) -> bool {
        false
    }
    /// The labels [`ReconcileError::metric_label`] can return besides the write errors' own
    /// ([`super::writer::WriteError::METRIC_LABELS`]); all of them start at 0.
    fn own_metric_labels() -> &'static [&'static str]
    where
        Self: Sized,
    {
        &[]
    }
    /// `Some(limit)` for a failure the reconciler has already reported on the object (a
    /// condition says what failed): retried with the per-object error backoff, at the latest
    /// after `limit`, and not counted as a reconcile error (bad input is a condition, never an
    /// error).
    fn reported(&self) -> Option<Duration> {
        None
    }
}

/// Which watch events of the primary kind trigger a reconcile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// Spec (generation) and finalizer changes only: status-only updates, including our own, are
    /// skipped. Deletion passes, since setting deletionTimestamp bumps generation.
    SpecAndFinalizers,
    /// Every change, status included (a controller that reacts to status written by others).
    AnyChange,
    /// Every change except one that touches only these status fields (and the resourceVersion
    /// and managedFields every write bumps). For fields another writer keeps fresh without
    /// changing anything derived from them (the exporter heartbeat's `lastSeen`): the pass they
    /// would trigger finds nothing to do, and the timer of the last pass still runs.
    AnyChangeExceptStatus(&'static [&'static str]),
    /// Spec (generation) and finalizer changes, and status changes by another writer: a status
    /// entry in managedFields by a manager other than ours (`ucm-<controller>`) as recent as our
    /// own latest one. Another writer's status is corrected by the pass it triggers, while our
    /// own status writes trigger nothing.
    SpecFinalizersAndForeignStatus,
}

/// The hash [`Trigger::SpecFinalizersAndForeignStatus`] compares.
fn hash_spec_or_foreign_status<K: Resource>(obj: &Guarded<K>, ours: &str) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let meta = obj.meta();
    meta.generation.hash(&mut h);
    meta.finalizers.hash(&mut h);
    let status_entries = || {
        meta.managed_fields
            .iter()
            .flatten()
            .filter(|f| f.subresource.as_deref() == Some("status"))
    };
    let our_latest = status_entries()
        .filter(|f| f.manager.as_deref() == Some(ours))
        .filter_map(|f| f.time.as_ref().map(|t| t.0))
        .max();
    let foreign = status_entries()
        .filter(|f| f.manager.as_deref() != Some(ours))
        .any(|f| match (f.time.as_ref().map(|t| t.0), our_latest) {
            (_, None) => true,
            (Some(t), Some(o)) => t >= o,
            (None, Some(_)) => false,
        });
    if foreign || obj.0.is_err() {
        meta.resource_version.hash(&mut h);
    }
    Some(h.finish())
}

/// The hash [`Trigger::AnyChangeExceptStatus`] compares: the object as JSON without the ignored
/// status fields, resourceVersion and managedFields. An object that failed to deserialize hashes
/// its resourceVersion, so every change of it passes.
pub fn hash_except_status<K: serde::Serialize + Resource>(
    obj: &Guarded<K>,
    ignored: &[&str],
) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    match &obj.0 {
        Ok(k) => {
            let mut v = serde_json::to_value(k).ok()?;
            if let Some(meta) = v.get_mut("metadata").and_then(|m| m.as_object_mut()) {
                meta.remove("resourceVersion");
                meta.remove("managedFields");
            }
            if let Some(status) = v.get_mut("status").and_then(|s| s.as_object_mut()) {
                for f in ignored {
                    status.remove(*f);
                }
            }
            v.to_string().hash(&mut h);
        }
        Err(_) => obj.meta().resource_version.hash(&mut h),
    }
    Some(h.finish())
}

pub use super::guarded::Guarded;

/// One consumer's events of a [`Runtime::reflect_fanout`] watch.
pub type FanoutStream<K> =
    futures::stream::BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>;

/// Error-policy backoff: 1 s doubling to `cap`, ±10 % jitter.
pub fn backoff(failures: u32, cap: Duration) -> Duration {
    let base = Duration::from_secs(1).saturating_mul(1u32 << failures.saturating_sub(1).min(20));
    let d = base.min(cap);
    let jitter = rand::rng().random_range(0.9..1.1);
    d.mul_f64(jitter)
}

/// The Controller's backoff on its merged trigger streams: 500 ms doubling to 5 s, reset by any
/// event. kube's default (800 ms doubling to 30 s) stacks on each watch's own backoff and
/// pauses every trigger of the controller, healthy ones included: after a minute of dropped
/// connections the soak saw the snapshot controller blind for another minute after the API
/// server was fine again. The watches built here back off on their own (client-go's 800 ms →
/// 30 s); this only spaces the retries of `.owns()`/`.watches()` streams, which have none.
#[derive(Clone, Copy, Debug)]
pub struct TriggerBackoff {
    next: Duration,
}

pub const TRIGGER_BACKOFF_MIN: Duration = Duration::from_millis(500);
pub const TRIGGER_BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Default for TriggerBackoff {
    fn default() -> Self {
        TriggerBackoff {
            next: TRIGGER_BACKOFF_MIN,
        }
    }
}

impl Iterator for TriggerBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let d = self.next;
        self.next = (d * 2).min(TRIGGER_BACKOFF_MAX);
        Some(d)
    }
}

impl kube::runtime::utils::Backoff for TriggerBackoff {
    fn reset(&mut self) {
        *self = TriggerBackoff::default();
    }
}

/// How long [`changed`] remembers an object it has not seen since (kube's predicate default).
const CHANGED_TTL: Duration = Duration::from_secs(3600);

/// kube's `predicate_filter` with a smaller memory: objects pass when `property` changed since
/// this stream last passed them (or could not be hashed), and after [`CHANGED_TTL`] without an
/// event. kube keeps each object's name, namespace and uid as strings (some 270 bytes per object
/// per filter); this keeps a hash of them and of the property, about 50 (memory per cached
/// Exporter: docs/benchmarks.md, "Memory per object").
pub fn changed<K, S>(
    stream: S,
    property: impl Predicate<K> + Send + 'static,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send
where
    K: Resource + Send,
    S: futures::Stream<Item = Result<K, watcher::Error>> + Send,
{
    let mut memory = ChangeMemory::default();
    stream.filter(move |item| {
        let pass = match item {
            Ok(obj) => match property.hash_property(obj) {
                Some(value) => memory.changed(obj.meta(), value),
                None => true,
            },
            Err(_) => true,
        };
        futures::future::ready(pass)
    })
}

/// The last hashed value of one property per object, in about 50 bytes per object (a hash of
/// its namespace, name and uid, the value and when it was recorded): [`changed`]'s memory, and
/// that of a mapper that wakes differently by what changed. An entry older than [`CHANGED_TTL`]
/// counts as unknown.
pub struct ChangeMemory {
    seen: HashMap<u64, (u64, Instant)>,
    swept: Instant,
}

impl Default for ChangeMemory {
    fn default() -> Self {
        ChangeMemory {
            seen: HashMap::new(),
            swept: Instant::now(),
        }
    }
}

impl ChangeMemory {
    /// Records `value` for the object; true when it differs from the last one recorded, or
    /// none is known.
    pub fn changed(&mut self, meta: &kube::api::ObjectMeta, value: u64) -> bool {
        let now = Instant::now();
        if now.duration_since(self.swept) >= CHANGED_TTL {
            self.seen
                .retain(|_, (_, at)| now.duration_since(*at) < CHANGED_TTL);
            self.swept = now;
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&meta.namespace, &meta.name, &meta.uid).hash(&mut h);
        match self.seen.insert(h.finish(), (value, now)) {
            Some((before, at)) => before != value || now.duration_since(at) >= CHANGED_TTL,
            None => true,
        }
    }
}

/// The short jittered delay after a write conflict ("immediately" in the feature specs).
pub fn conflict_delay() -> Duration {
    Duration::from_millis(rand::rng().random_range(10..100))
}

impl Runtime {
    /// A Controller on the primary kind `K` with ucm's stream, concurrency, leadership and
    /// shutdown wiring. `api` decides the scope (see [`Runtime::watched`]). Add `.owns(..)` or
    /// `.watches(..)` and pass it to [`run`]. `index`, when given, is kept from the primary
    /// watch's events, each after the store applied it, for mappers that look up primaries by
    /// a key.
    pub fn controller<K>(
        &self,
        name: &'static str,
        api: Api<Guarded<K>>,
        cfg: watcher::Config,
        trigger: Trigger,
        index: Option<Arc<NameIndex<Guarded<K>>>>,
    ) -> Controller<Guarded<K>>
    where
        K: Resource<DynamicType = ()>
            + Clone
            + DeserializeOwned
            + serde::Serialize
            + Debug
            + Send
            + Sync
            + 'static,
    {
        // Only this trigger reads managedFields; every other cache drops them.
        let slim: fn(&mut Guarded<K>) =
            if matches!(trigger, Trigger::SpecFinalizersAndForeignStatus) {
                |_| {}
            } else {
                drop_managed_fields
            };
        let (reader, events) = self.reflected_events(name, api, cfg, slim, index);
        self.controller_on(name, reader, events, trigger)
    }

    /// [`Runtime::controller`] on a watch made elsewhere: one of [`Runtime::reflect_fanout`]'s
    /// streams with its store, so the primary kind is watched and cached once for every
    /// controller that maps it. Those caches hold no managedFields, which
    /// [`Trigger::SpecFinalizersAndForeignStatus`] reads: it is not for this.
    pub fn controller_on<K>(
        &self,
        name: &'static str,
        reader: reflector::Store<Guarded<K>>,
        events: impl futures::Stream<Item = Result<watcher::Event<Guarded<K>>, watcher::Error>>
        + Send
        + 'static,
        trigger: Trigger,
    ) -> Controller<Guarded<K>>
    where
        K: Resource<DynamicType = ()>
            + Clone
            + DeserializeOwned
            + serde::Serialize
            + Debug
            + Send
            + Sync
            + 'static,
    {
        let stream = events.applied_objects();
        let stream = match trigger {
            Trigger::SpecAndFinalizers => changed(
                stream,
                predicates::generation.combine(predicates::finalizers),
            )
            .boxed(),
            Trigger::AnyChange => stream.boxed(),
            Trigger::SpecFinalizersAndForeignStatus => {
                let ours = format!("ucm-{name}");
                changed(stream, move |o: &Guarded<K>| {
                    hash_spec_or_foreign_status(o, &ours)
                })
                .boxed()
            }
            Trigger::AnyChangeExceptStatus(ignored) => {
                changed(stream, move |o: &Guarded<K>| hash_except_status(o, ignored)).boxed()
            }
        };
        Controller::for_stream(stream, reader)
            .trigger_backoff(TriggerBackoff::default())
            .with_config(Config::default().concurrency(self.config.max_concurrent_reconciles))
            .reconcile_all_on(self.leadership.acquisitions())
            .graceful_shutdown_on(self.shutdown.clone().cancelled_owned())
    }
}

impl Runtime {
    /// A secondary watch for `Controller::watches_stream`/`owns_stream` or a mapper's lookups:
    /// watcher with backoff, reflected into a store, counted in `informers-synced`, yielding
    /// every touched object.
    pub fn reflect<K>(
        &self,
        name: &'static str,
        api: Api<K>,
        cfg: watcher::Config,
    ) -> (
        reflector::Store<K>,
        impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static,
    )
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    {
        let (reader, events) = self.reflected_events(name, api, cfg, drop_managed_fields, None);
        (reader, events.touched_objects())
    }

    /// [`Runtime::reflect`] for a kind several controllers read: one watch and one store, and
    /// `n` streams of its events (after the store applied each), for a primary
    /// ([`Runtime::controller_on`]) or `touched_objects()` mappers. Each consumer reads the very
    /// cache its triggers come from, so a pass never runs on a change its cache lacks. A task
    /// of its own drives the watch until shutdown. The queues are unbounded: a consumer that
    /// waits for this very watch to list (a Controller whose workers wait on
    /// [`super::Synced`]) must never hold the list back, so a slow consumer's queue grows
    /// instead. The store and the streams hold each object as `slim` leaves it (at least
    /// [`drop_managed_fields`]).
    pub fn reflect_fanout<K>(
        &self,
        name: &'static str,
        api: Api<K>,
        cfg: watcher::Config,
        n: usize,
        slim: fn(&mut K),
        index: Option<Arc<NameIndex<K>>>,
    ) -> (reflector::Store<K>, Vec<FanoutStream<K>>)
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    {
        let (reader, events) = self.reflected_events(name, api, cfg, slim, index);
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..n)
            .map(|_| futures::channel::mpsc::unbounded::<watcher::Event<K>>())
            .unzip();
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            loop {
                let next = tokio::select! {
                    next = events.next() => next,
                    _ = shutdown.cancelled() => None,
                };
                match next {
                    None => break,
                    // The watcher retries on its own backoff; consumers only need events.
                    Some(Err(e)) => warn!(watch = name, error = %e, "watch failed; retrying"),
                    Some(Ok(ev)) => {
                        for tx in &senders {
                            // A consumer that stopped (shutdown) is skipped.
                            let _ = tx.unbounded_send(ev.clone());
                        }
                    }
                }
            }
        });
        let streams = receivers
            .into_iter()
            .map(|rx| rx.map(Ok as fn(_) -> _).boxed())
            .collect();
        (reader, streams)
    }

    /// Watcher with backoff, reflected into a store (and `index`, right after the store); the end
    /// of the initial list clears the watch's readiness gate.
    fn reflected_events<K>(
        &self,
        name: &'static str,
        api: Api<K>,
        cfg: watcher::Config,
        slim: fn(&mut K),
        index: Option<Arc<NameIndex<K>>>,
    ) -> (
        reflector::Store<K>,
        impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    )
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    {
        let (reader, writer) = reflector::store();
        let mut synced = self.track_synced(name);
        let stream = watcher(api, cfg)
            .default_backoff()
            .modify(slim)
            .inspect(move |ev| synced.observe(ev))
            .reflect(writer)
            .inspect(move |ev| {
                if let (Some(ix), Ok(ev)) = (&index, ev) {
                    ix.apply(ev);
                }
            });
        (reader, stream)
    }
}

/// What every cache drops: managedFields are often the largest part of an object, and only the
/// foreign-status trigger reads them (its caches keep them).
pub fn drop_managed_fields<K: Resource>(o: &mut K) {
    o.meta_mut().managed_fields = None;
}

/// Per-controller state shared by the wrapped reconcile and error policy.
pub struct Runner<K: Resource, C> {
    pub ctx: Arc<C>,
    metrics: ControllerMetrics,
    leadership: super::leader::Leadership,
    failures: Mutex<HashMap<ObjectRef<Guarded<K>>, u32>>,
    /// Write conflicts in a row per object (reset by a pass that ends without one).
    conflicts: Mutex<HashMap<ObjectRef<Guarded<K>>, u32>>,
    backoff_cap: Duration,
    /// Reports unreadable objects (a condition and an event on the object).
    writer: super::writer::Writer,
    /// Reads the raw object of an unreadable one.
    client: kube::Client,
}

/// Conflicts in a row retried at once before the error backoff takes over.
const MAX_QUICK_CONFLICTS: u32 = 8;

impl<K: Resource<DynamicType = ()>, C> Runner<K, C> {
    fn count_failure(&self, oref: &ObjectRef<Guarded<K>>) -> u32 {
        let mut m = self.failures.lock().expect("lock");
        let n = m.entry(oref.clone()).or_insert(0);
        *n = n.saturating_add(1);
        *n
    }

    fn count_conflict(&self, oref: &ObjectRef<Guarded<K>>) -> u32 {
        let mut m = self.conflicts.lock().expect("lock");
        let n = m.entry(oref.clone()).or_insert(0);
        *n += 1;
        *n
    }
}

pub async fn run<K, C, E, F, Fut>(
    rt: &Runtime,
    name: &'static str,
    controller: Controller<Guarded<K>>,
    ctx: Arc<C>,
    backoff_cap: Duration,
    reconcile: F,
) where
    K: Resource<DynamicType = ()>
        + kube::CustomResourceExt
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static,
    C: Send + Sync + 'static,
    E: ReconcileError,
    F: Fn(Arc<K>, Arc<C>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
{
    let runner = Arc::new(Runner::<K, C> {
        ctx,
        metrics: rt
            .metrics
            .controller(name, rt.config.max_concurrent_reconciles),
        leadership: rt.leadership.clone(),
        failures: Mutex::new(HashMap::new()),
        conflicts: Mutex::new(HashMap::new()),
        backoff_cap,
        writer: rt.writer(name),
        client: rt.client.clone(),
    });
    runner
        .metrics
        .init_reasons(super::writer::WriteError::METRIC_LABELS);
    runner.metrics.init_reasons(E::own_metric_labels());
    let reconcile = Arc::new(reconcile);
    let metrics = runner.metrics.clone();
    controller
        .run(
            move |guard: Arc<Guarded<K>>, runner: Arc<Runner<K, C>>| {
                let reconcile = reconcile.clone();
                async move {
                    // A standby keeps its caches warm but never acts; acquisition re-enqueues all.
                    if !runner.leadership.is_leader() {
                        return Ok(Action::await_change());
                    }
                    let oref = ObjectRef::from_obj(&*guard);
                    let obj = match &guard.0 {
                        Ok(obj) => obj.clone(),
                        Err(invalid) => {
                            runner.metrics.invalid_object();
                            warn!(controller = name, object = %oref, error = %invalid, "object cannot be read; waiting for it to change");
                            super::unreadable::report::<K>(&runner.client, &runner.writer, &invalid.metadata).await;
                            return Ok(Action::await_change());
                        }
                    };
                    let span = info_span!("reconcile", controller = name, namespace = oref.namespace.as_deref().unwrap_or(""), name = %oref.name);
                    let mut measure = runner.metrics.measure();
                    let result = reconcile(Arc::new(obj), runner.ctx.clone()).instrument(span).await;
                    match result {
                        Ok(action) => {
                            runner.failures.lock().expect("lock").remove(&oref);
                            runner.conflicts.lock().expect("lock").remove(&oref);
                            if action != Action::await_change() {
                                measure.set_result(ReconcileResult::RequeueAfter);
                            }
                            Ok(action)
                        }
                        // Reported on the object already (bad input is a condition, never
                        // an error): retried with the object's backoff, uncounted.
                        Err(e) if e.reported().is_some() => {
                            runner.conflicts.lock().expect("lock").remove(&oref);
                            let limit = e.reported().unwrap_or(runner.backoff_cap);
                            let n = runner.count_failure(&oref);
                            measure.set_result(ReconcileResult::RequeueAfter);
                            Ok(Action::requeue(backoff(n, runner.backoff_cap).min(limit).max(Duration::from_millis(1))))
                        }
                        // Quickly again from fresh state, a few times in a row; a write that
                        // keeps being fenced out (a stale cache, or a patch that can never
                        // apply) then backs off like any failure.
                        Err(e) if e.is_conflict() && runner.count_conflict(&oref) <= MAX_QUICK_CONFLICTS => {
                            debug!(controller = name, object = %oref, "write conflict; reconciling again from fresh state");
                            measure.set_result(ReconcileResult::RequeueAfter);
                            Ok(Action::requeue(conflict_delay()))
                        }
                        Err(e) => {
                            measure.set_result(ReconcileResult::Error);
                            runner.metrics.error(e.metric_label());
                            Err(e)
                        }
                    }
                }
            },
            |guard: Arc<Guarded<K>>, _err: &E, runner: Arc<Runner<K, C>>| {
                let n = runner.count_failure(&ObjectRef::from_obj(&*guard));
                runner.metrics.retry();
                Action::requeue(backoff(n, runner.backoff_cap))
            },
            runner,
        )
        .for_each(|res| {
            match res {
                Ok((obj, _)) => debug!(controller = name, object = %obj, "reconciled"),
                Err(kube::runtime::controller::Error::ReconcilerFailed(e, obj)) => {
                    warn!(controller = name, object = %obj, error = %error_chain(&e), "reconcile failed");
                }
                Err(kube::runtime::controller::Error::QueueError(e)) => {
                    metrics.watch_error();
                    warn!(controller = name, error = %error_chain(&e), "watch error");
                }
                Err(kube::runtime::controller::Error::ObjectNotFound(obj)) => debug!(controller = name, object = %obj, "object gone"),
                Err(e) => warn!(controller = name, error = %error_chain(&e), "controller error"),
            }
            futures::future::ready(())
        })
        .await;
}

/// `a: b: c` for an error and its sources, logged once where the run stream is drained. Our
/// errors keep the cause as `source` and leave it out of their own message; a cause whose text
/// the link before it already printed (kube's `Error::Api` shows its `Status` and also returns it
/// as the source) is skipped, so each cause is printed once.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut prev = e.to_string();
    let mut s = prev.clone();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !prev.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        prev = text;
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_chain_prints_a_cause_its_parent_already_shows_once() {
        let e = crate::runtime::writer::WriteError::Kube(kube::Error::Api(Box::new(
            kube::core::Status {
                code: 403,
                message: "leases is forbidden".into(),
                reason: "Forbidden".into(),
                ..Default::default()
            },
        )));
        let chain = error_chain(&e);
        assert_eq!(
            chain.matches("leases is forbidden: Forbidden").count(),
            1,
            "{chain}"
        );
        assert!(
            chain.starts_with("ApiError: leases is forbidden"),
            "{chain}"
        );
    }

    #[test]
    fn except_status_hash_ignores_only_the_named_fields_and_write_bookkeeping() {
        use crate::exporter::crd::Exporter;
        let obj = |rv: &str, seen: &str, online: &str, label: &str| -> Guarded<Exporter> {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
                "metadata": {"name": "e", "namespace": "lab", "resourceVersion": rv,
                    "labels": {"board": label},
                    "managedFields": [{"manager": "ucm", "time": format!("2026-01-01T00:00:0{rv}Z")}]},
                "spec": {},
                "status": {"lastSeen": seen, "conditions": [{"type": "Online", "status": online,
                    "reason": "Seen", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
            }))
            .unwrap()
        };
        let h = |o: &Guarded<Exporter>| hash_except_status(o, &["lastSeen"]).unwrap();
        let base = h(&obj("1", "2026-01-01T00:00:00Z", "True", "a"));
        assert_eq!(base, h(&obj("2", "2026-01-01T00:00:20Z", "True", "a")));
        assert_ne!(base, h(&obj("3", "2026-01-01T00:00:20Z", "False", "a")));
        assert_ne!(base, h(&obj("4", "2026-01-01T00:00:00Z", "True", "b")));
    }

    #[tokio::test]
    async fn changed_passes_an_object_when_its_property_changes_and_a_new_object_of_the_same_name()
    {
        use k8s_openapi::api::core::v1::ConfigMap;
        let cm = |uid: &str, value: &str| -> Result<ConfigMap, watcher::Error> {
            Ok(serde_json::from_value(serde_json::json!({
                "metadata": {"name": "c", "namespace": "lab", "uid": uid},
                "data": {"k": value},
            }))
            .unwrap())
        };
        let value = |c: &ConfigMap| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            c.data.hash(&mut h);
            Some(h.finish())
        };
        let input = vec![
            cm("u1", "a"),
            cm("u1", "a"), // unchanged: dropped
            cm("u1", "b"),
            cm("u2", "b"), // same name, another object (recreated): passes
            cm("u2", "b"),
            cm("u1", "b"), // the first object's last value: dropped
        ];
        let passed: Vec<String> = changed(futures::stream::iter(input), value)
            .map(|c| {
                let c = c.unwrap();
                format!("{}={}", c.metadata.uid.unwrap(), c.data.unwrap()["k"])
            })
            .collect()
            .await;
        assert_eq!(passed, ["u1=a", "u1=b", "u2=b"]);
    }

    #[test]
    fn backoff_doubles_to_the_cap_with_jitter() {
        let cap = Duration::from_secs(300);
        let within =
            |d: Duration, secs: f64| d.as_secs_f64() >= secs * 0.9 && d.as_secs_f64() <= secs * 1.1;
        assert!(within(backoff(1, cap), 1.0));
        assert!(within(backoff(2, cap), 2.0));
        assert!(within(backoff(4, cap), 8.0));
        assert!(within(backoff(30, cap), 300.0));
        assert!(within(backoff(9, Duration::from_secs(30)), 30.0));
    }

    /// The controller-level pause stays short (the watches escalate on their own), resets on
    /// the next event, and never gives up (a `None` would end the controller's triggers).
    #[test]
    fn trigger_backoff_is_short_and_resets() {
        let mut b = TriggerBackoff::default();
        let first: Vec<_> = (&mut b).take(4).collect();
        assert_eq!(
            first,
            [500, 1000, 2000, 4000].map(Duration::from_millis).to_vec()
        );
        for _ in 0..100 {
            assert_eq!(b.next(), Some(TRIGGER_BACKOFF_MAX));
        }
        kube::runtime::utils::Backoff::reset(&mut b);
        assert_eq!(b.next(), Some(TRIGGER_BACKOFF_MIN));
    }

    #[test]
    fn conflicts_requeue_within_100ms() {
        for _ in 0..100 {
            assert!(conflict_delay() < Duration::from_millis(100));
        }
    }
}

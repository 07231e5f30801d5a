//! Timed wake-ups of a controller's objects ("reconcile again at T"), kept outside kube's
//! scheduler.
//!
//! Why: kube's scheduler keeps each requeued object's request twice (its map and its delay queue),
//! each with the object's name, namespace, uid and resourceVersion: some 700 bytes per object.
//! Every Exporter and Client with a token has a timer (its renewal or `TokenExpiring` threshold, at
//! the latest `--exporter-max-requeue` away), so at 5,000 Exporters that is a seventh of the memory
//! per cached Exporter (docs/benchmarks.md, "Memory per object"). Here a timer is one
//! `namespace/name` string and its due time, about 200 bytes. The controller takes the wake-ups as
//! a trigger stream ([`Timers::fired`] into `Controller::reconcile_on`).
//!
//! Each pass decides its object's next wake-up ([`Timers::set`]), replacing the one before, as
//! a pass's `Action` replaces kube's scheduled requeue.

use std::collections::{BTreeMap, HashMap};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Resource;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::Notify;
use tokio::time::Instant;

pub struct Timers<K> {
    inner: Mutex<Inner>,
    /// A timer was set: the stream looks at the earliest again.
    changed: Notify,
    _kind: PhantomData<fn() -> K>,
}

#[derive(Default)]
struct Inner {
    /// `namespace/name` → its timer's place in `queue`.
    due: HashMap<Arc<str>, (Instant, u64)>,
    /// (when, sequence) → `namespace/name`, earliest first.
    queue: BTreeMap<(Instant, u64), Arc<str>>,
    seq: u64,
}

impl<K> Default for Timers<K> {
    fn default() -> Self {
        Timers {
            inner: Mutex::default(),
            changed: Notify::new(),
            _kind: PhantomData,
        }
    }
}

impl Inner {
    fn set(&mut self, key: &str, at: Option<Instant>) {
        if let Some(old) = self.due.remove(key) {
            self.queue.remove(&old);
        }
        if let Some(at) = at {
            self.seq += 1;
            let key: Arc<str> = Arc::from(key);
            self.queue.insert((at, self.seq), key.clone());
            self.due.insert(key, (at, self.seq));
        }
    }

    /// The first timer due at `now`, removed; else when the earliest falls due.
    fn pop_due(&mut self, now: Instant) -> Result<Arc<str>, Option<Instant>> {
        match self.queue.first_key_value() {
            Some((&(at, _), _)) if at <= now => {
                let (_, key) = self.queue.pop_first().expect("a first entry");
                self.due.remove(&key);
                Ok(key)
            }
            Some((&(at, _), _)) => Err(Some(at)),
            None => Err(None),
        }
    }
}

impl<K> Timers<K> {
    /// Wakes `namespace/name` after `after`, or never (`None`), replacing its earlier timer.
    pub fn set(&self, namespace: &str, name: &str, after: Option<Duration>) {
        let at = after.map(|d| Instant::now() + d);
        let key = format!("{namespace}/{name}");
        self.inner.lock().expect("lock").set(&key, at);
        self.changed.notify_one();
    }
}

impl<K> Timers<K> {
    /// Wakes `namespace/name` within `within`: keeps a timer due sooner, else sets one. Many
    /// calls in a row cost one wake-up (they coalesce), and a wake-up is never pushed back.
    pub fn wake_within(&self, namespace: &str, name: &str, within: Duration) {
        let at = Instant::now() + within;
        let key = format!("{namespace}/{name}");
        let mut inner = self.inner.lock().expect("lock");
        if inner
            .due
            .get(key.as_str())
            .is_some_and(|(due, _)| *due <= at)
        {
            return;
        }
        inner.set(&key, Some(at));
        drop(inner);
        self.changed.notify_one();
    }
}

impl<K: Resource<DynamicType = ()> + 'static> Timers<K> {
    /// The objects whose timers fall due, as they do. Never ends (the controller's shutdown
    /// stops it).
    pub fn fired(self: Arc<Self>) -> impl futures::Stream<Item = ObjectRef<K>> + Send + 'static {
        futures::stream::unfold(self, |timers| async move {
            loop {
                let next = timers.inner.lock().expect("lock").pop_due(Instant::now());
                match next {
                    Ok(key) => {
                        // Names and namespaces hold no '/'.
                        let (ns, name) = key.split_once('/').unwrap_or(("", &key));
                        let obj = ObjectRef::new(name).within(ns);
                        return Some((obj, timers));
                    }
                    // `notify_one` keeps a permit when nobody waits, so a timer set since the
                    // look above wakes this at once.
                    Err(Some(at)) => tokio::select! {
                        _ = tokio::time::sleep_until(at) => {}
                        _ = timers.changed.notified() => {}
                    },
                    Err(None) => timers.changed.notified().await,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::crd::Exporter;
    use futures::StreamExt;

    #[test]
    fn a_timer_replaces_the_objects_earlier_one_and_none_clears_it() {
        let t0 = Instant::now();
        let mut inner = Inner::default();
        inner.set("lab/a", Some(t0 + Duration::from_secs(10)));
        inner.set("lab/b", Some(t0 + Duration::from_secs(5)));
        inner.set("lab/a", Some(t0 + Duration::from_secs(1)));
        inner.set("lab/c", Some(t0 + Duration::from_secs(2)));
        inner.set("lab/c", None);
        assert_eq!(inner.due.len(), 2);
        assert_eq!(inner.queue.len(), 2);
        assert_eq!(inner.pop_due(t0), Err(Some(t0 + Duration::from_secs(1))));
        let at = t0 + Duration::from_secs(6);
        assert_eq!(inner.pop_due(at).as_deref(), Ok("lab/a"));
        assert_eq!(inner.pop_due(at).as_deref(), Ok("lab/b"));
        assert_eq!(inner.pop_due(at), Err(None));
        assert!(inner.due.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn wake_within_coalesces_and_never_postpones() {
        let timers = Timers::<Exporter>::default();
        let due =
            |t: &Timers<Exporter>, key: &str| t.inner.lock().unwrap().due.get(key).map(|d| d.0);
        let start = Instant::now();
        timers.wake_within("lab", "a", Duration::from_secs(1));
        tokio::time::advance(Duration::from_millis(500)).await;
        // A second wake within the window keeps the first deadline.
        timers.wake_within("lab", "a", Duration::from_secs(1));
        assert_eq!(due(&timers, "lab/a"), Some(start + Duration::from_secs(1)));
        // A later timer (a lease's end) is brought forward.
        timers.set("lab", "b", Some(Duration::from_secs(3600)));
        timers.wake_within("lab", "b", Duration::from_secs(1));
        assert_eq!(
            due(&timers, "lab/b"),
            Some(start + Duration::from_millis(1500))
        );
        assert_eq!(timers.inner.lock().unwrap().queue.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn fired_yields_each_object_when_due_including_timers_set_while_waiting() {
        let timers = Arc::new(Timers::<Exporter>::default());
        timers.set("lab", "late", Some(Duration::from_secs(60)));
        let mut fired = Box::pin(timers.clone().fired());
        let start = Instant::now();
        // Set while the stream sleeps towards "late": it must wake for the earlier one.
        let setter = timers.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            setter.set("lab", "early", Some(Duration::from_secs(5)));
        });
        let first = fired.next().await.unwrap();
        assert_eq!(
            (first.name.as_str(), first.namespace.as_deref()),
            ("early", Some("lab"))
        );
        assert_eq!(start.elapsed(), Duration::from_secs(6));
        let second = fired.next().await.unwrap();
        assert_eq!(second.name, "late");
        assert_eq!(start.elapsed(), Duration::from_secs(60));
    }
}

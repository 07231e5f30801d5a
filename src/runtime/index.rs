//! A secondary index of a watched kind: object names by (namespace, key), kept from the same
//! watch events as the kind's store (docs/architecture.md, "Caches and indexes"). Mappers use it
//! to find the objects an event concerns without scanning the whole store, which would cost O(N)
//! per event and O(N^2) per bulk of N objects.
//!
//! It only narrows candidates: whoever acts reads each one from its store.

use std::collections::{BTreeSet, HashMap};
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};

use kube::Resource;
use kube::runtime::watcher;

type Key = (String, String);

#[derive(Default)]
struct Maps {
    /// (namespace, key) → object names.
    by_key: HashMap<Key, BTreeSet<String>>,
    /// (namespace, object) → its keys, so an update or delete removes exactly what it added.
    by_object: HashMap<Key, Vec<String>>,
}

impl Maps {
    fn remove(&mut self, obj: &Key) {
        for k in self.by_object.remove(obj).unwrap_or_default() {
            let kk = (obj.0.clone(), k);
            if let Some(set) = self.by_key.get_mut(&kk) {
                set.remove(&obj.1);
                if set.is_empty() {
                    self.by_key.remove(&kk);
                }
            }
        }
    }

    fn insert(&mut self, obj: Key, keys: Vec<String>) {
        self.remove(&obj);
        if keys.is_empty() {
            return;
        }
        for k in &keys {
            self.by_key
                .entry((obj.0.clone(), k.clone()))
                .or_default()
                .insert(obj.1.clone());
        }
        self.by_object.insert(obj, keys);
    }
}

/// Names of `K` objects by (namespace, key); `keys` says which keys an object has.
pub struct NameIndex<K> {
    keys: fn(&K) -> Vec<String>,
    live: RwLock<Maps>,
    /// The relist in progress (between `Init` and `InitDone`).
    relist: RwLock<Option<Maps>>,
    /// Set by the first complete list: before it, "nothing has this key" would be a guess.
    ready: AtomicBool,
}

impl<K: Resource> NameIndex<K> {
    pub fn new(keys: fn(&K) -> Vec<String>) -> Self {
        Self {
            keys,
            live: RwLock::default(),
            relist: RwLock::default(),
            ready: AtomicBool::new(false),
        }
    }

    fn entry(&self, o: &K) -> Option<(Key, Vec<String>)> {
        let m = o.meta();
        // A cluster-scoped object is under the namespace "".
        let ns = m.namespace.clone().unwrap_or_default();
        Some(((ns, m.name.clone()?), (self.keys)(o)))
    }

    /// Feed every event of the watch, after its store applied it.
    pub fn apply(&self, ev: &watcher::Event<K>) {
        match ev {
            watcher::Event::Apply(o) => {
                if let Some((obj, keys)) = self.entry(o) {
                    self.live
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(obj, keys);
                }
            }
            watcher::Event::Delete(o) => {
                if let Some((obj, _)) = self.entry(o) {
                    self.live
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&obj);
                }
            }
            watcher::Event::Init => {
                *self.relist.write().unwrap_or_else(|e| e.into_inner()) = Some(Maps::default());
            }
            watcher::Event::InitApply(o) => {
                if let (Some(m), Some((obj, keys))) = (
                    self.relist
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .as_mut(),
                    self.entry(o),
                ) {
                    m.insert(obj, keys);
                }
            }
            watcher::Event::InitDone => {
                if let Some(m) = self
                    .relist
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                {
                    *self.live.write().unwrap_or_else(|e| e.into_inner()) = m;
                }
                self.ready.store(true, Ordering::Release);
            }
        }
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Names of the objects in `ns` that have `key`, in name order.
    pub fn names(&self, ns: &str, key: &str) -> Vec<String> {
        self.live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_key
            .get(&(ns.to_string(), key.to_string()))
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    /// A ConfigMap's keys: its data keys.
    fn cm(ns: &str, name: &str, keys: &[&str]) -> ConfigMap {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": ns},
            "data": keys.iter().map(|k| (k.to_string(), "")).collect::<std::collections::BTreeMap<_, _>>(),
        }))
        .unwrap()
    }

    fn keys(c: &ConfigMap) -> Vec<String> {
        c.data.iter().flatten().map(|(k, _)| k.clone()).collect()
    }

    #[test]
    fn names_follow_applies_deletes_and_relists() {
        let ix = NameIndex::new(keys);
        ix.apply(&watcher::Event::Init);
        ix.apply(&watcher::Event::InitApply(cm("a", "p1", &["d", "e"])));
        ix.apply(&watcher::Event::InitApply(cm("b", "p2", &["d"])));
        assert!(ix.names("a", "d").is_empty(), "visible only after InitDone");
        assert!(!ix.is_ready());
        ix.apply(&watcher::Event::InitDone);
        assert!(ix.is_ready());
        assert_eq!(ix.names("a", "d"), ["p1"]);
        assert_eq!(ix.names("a", "e"), ["p1"]);
        assert_eq!(ix.names("b", "d"), ["p2"]);
        ix.apply(&watcher::Event::Apply(cm("a", "p3", &["d"])));
        assert_eq!(ix.names("a", "d"), ["p1", "p3"]);
        // same name, new keys (deleted and recreated between two events)
        ix.apply(&watcher::Event::Apply(cm("a", "p1", &["f"])));
        assert_eq!(ix.names("a", "d"), ["p3"]);
        assert!(ix.names("a", "e").is_empty());
        assert_eq!(ix.names("a", "f"), ["p1"]);
        ix.apply(&watcher::Event::Delete(cm("a", "p3", &["d"])));
        assert!(ix.names("a", "d").is_empty());
        // an object losing every key leaves nothing behind
        ix.apply(&watcher::Event::Apply(cm("a", "p1", &[])));
        assert!(ix.names("a", "f").is_empty());
        // a relist replaces everything
        ix.apply(&watcher::Event::Init);
        ix.apply(&watcher::Event::InitApply(cm("c", "p9", &["z"])));
        ix.apply(&watcher::Event::InitDone);
        assert!(ix.names("a", "f").is_empty() && ix.names("b", "d").is_empty());
        assert_eq!(ix.names("c", "z"), ["p9"]);
    }
}

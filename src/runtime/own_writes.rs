//! Our own writes that a watch cache may not show yet (docs/runtime.md, "Own writes"). A pass
//! reads caches; between one of our writes and the watch event that brings it back, the cache
//! shows the object as it was. [`OwnWrites`] remembers, per object (namespace, name), what a
//! write of ours left, until the cache catches up, the entry expires, or the feature forgets it.
//! Each feature keeps one per thing it must not lose:
//! - the versions our writes replaced ([`Replaced`]): a pass that still sees one of them runs
//!   before the watch delivered our write, so it skips its writes and looks again after
//!   [`STALE_RECHECK`] (exporter, vmexport);
//! - the children we created (vmexport: without it the next pass would create them again);
//! - the lease assignments in flight and the tokens of credential Secrets (exporter).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a stale pass waits before it looks again: the watch delivers our own write within
/// milliseconds, and the recheck reads only caches.
pub const STALE_RECHECK: Duration = Duration::from_millis(250);

/// (namespace, name).
pub type Key = (String, String);

/// Per object, what one of our writes left that the cache may not show yet.
pub struct OwnWrites<V> {
    inner: Mutex<Memory<V>>,
}

impl<V> Default for OwnWrites<V> {
    /// Entries live until forgotten.
    fn default() -> Self {
        OwnWrites {
            inner: Mutex::new(Memory {
                entries: HashMap::new(),
                ttl: None,
            }),
        }
    }
}

/// The entries under the lock of an [`OwnWrites`], for a decision that must read and change
/// them at once.
pub struct Memory<V> {
    entries: HashMap<Key, (Instant, V)>,
    /// Entries older than this are gone (None: they live until forgotten).
    ttl: Option<Duration>,
}

impl<V> Memory<V> {
    fn live(&self, at: Instant) -> bool {
        self.ttl.is_none_or(|ttl| at.elapsed() < ttl)
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<&V> {
        let (at, v) = self.entries.get(&key(namespace, name))?;
        self.live(*at).then_some(v)
    }

    /// Remembers `value`; with a TTL, expired entries go first.
    pub fn insert(&mut self, namespace: &str, name: &str, value: V) {
        if let Some(ttl) = self.ttl {
            self.entries.retain(|_, (at, _)| at.elapsed() < ttl);
        }
        self.entries
            .insert(key(namespace, name), (Instant::now(), value));
    }

    pub fn remove(&mut self, namespace: &str, name: &str) -> Option<V> {
        self.entries.remove(&key(namespace, name)).map(|(_, v)| v)
    }

    /// Keeps the entries `keep` accepts.
    pub fn retain(&mut self, mut keep: impl FnMut(&Key, &mut V) -> bool) {
        self.entries.retain(|k, (_, v)| keep(k, v));
    }

    /// The live entries.
    pub fn iter(&self) -> impl Iterator<Item = (&Key, &V)> {
        self.entries
            .iter()
            .filter(|(_, (at, _))| self.live(*at))
            .map(|(k, (_, v))| (k, v))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

fn key(namespace: &str, name: &str) -> Key {
    (namespace.to_string(), name.to_string())
}

impl<V: Clone> OwnWrites<V> {
    /// Entries that expire after `ttl`, so that an object deleted before the cache saw it is not
    /// believed for ever.
    pub fn with_ttl(ttl: Duration) -> Self {
        OwnWrites {
            inner: Mutex::new(Memory {
                entries: HashMap::new(),
                ttl: Some(ttl),
            }),
        }
    }

    /// The entries, locked (a poisoned lock is taken over: the map stays consistent).
    pub fn lock(&self) -> MutexGuard<'_, Memory<V>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn remember(&self, namespace: &str, name: &str, value: V) {
        self.lock().insert(namespace, name, value);
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<V> {
        self.lock().get(namespace, name).cloned()
    }

    pub fn forget(&self, namespace: &str, name: &str) -> Option<V> {
        self.lock().remove(namespace, name)
    }

    /// The cached object, else what we wrote: once the cache shows the object the entry goes
    /// (a later deletion then reads as absent).
    pub fn overlay(&self, namespace: &str, name: &str, cached: Option<V>) -> Option<V> {
        let mut memory = self.lock();
        if cached.is_some() {
            memory.remove(namespace, name);
            return cached;
        }
        memory.get(namespace, name).cloned()
    }
}

/// The resourceVersions our latest writes to an object replaced (a status write and the
/// metadata patch after it). A pass that still sees one of them in its cache runs before the
/// watch delivered our writes (another trigger queued it): its writes would only conflict (409)
/// or repeat ours, so it skips its work. It cannot count on our writes' own events to bring the
/// next pass (a status write of ours wakes no Client), and it replaced the timer the writing
/// pass set, so it looks again after [`STALE_RECHECK`].
pub type Replaced = OwnWrites<Vec<String>>;

impl OwnWrites<Vec<String>> {
    /// Whether the cached object (`rv`) predates our latest writes to it. Seeing any other
    /// version forgets the entry.
    pub fn is_stale(&self, namespace: &str, name: &str, rv: &str) -> bool {
        let mut memory = self.lock();
        match memory.get(namespace, name) {
            Some(replaced) if replaced.iter().any(|r| r == rv) => true,
            Some(_) => {
                memory.remove(namespace, name);
                false
            }
            None => false,
        }
    }

    /// Our write turned version `replaced` of the object into `written`. A write the API server
    /// found to change nothing keeps the version: the cache then never moves past it, so it is
    /// not noted (a pass on it is as fresh as it gets).
    pub fn note(&self, namespace: &str, name: &str, replaced: &str, written: &str) {
        if replaced == written {
            return;
        }
        let mut memory = self.lock();
        // Only an optimisation: an object deleted right after a write leaves its entry, so the
        // map is dropped whole when it grows past any plausible burst.
        if memory.len() >= 16_384 {
            memory.clear();
        }
        let mut versions = memory.remove(namespace, name).unwrap_or_default();
        if versions.len() >= 4 {
            versions.remove(0);
        }
        versions.push(replaced.to_string());
        memory.insert(namespace, name, versions);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_on_the_version_our_write_replaced_is_stale() {
        let r = Replaced::default();
        assert!(!r.is_stale("lab", "l1", "10"));
        r.note("lab", "l1", "10", "11");
        assert!(r.is_stale("lab", "l1", "10"));
        assert!(!r.is_stale("lab", "l2", "10"));
        // A pass that wrote twice (status, then metadata) replaced two versions.
        r.note("lab", "l1", "11", "12");
        assert!(r.is_stale("lab", "l1", "10"));
        assert!(r.is_stale("lab", "l1", "11"));
        // The watch delivered our last write: a newer version, the entry goes.
        assert!(!r.is_stale("lab", "l1", "12"));
        assert!(!r.is_stale("lab", "l1", "10"));
    }

    #[test]
    fn a_write_that_changed_nothing_leaves_no_stale_version() {
        let r = Replaced::default();
        // The API server kept version 10: the cache will never show a newer one, so a pass on
        // 10 must run rather than wait for it.
        r.note("lab", "l1", "10", "10");
        assert!(!r.is_stale("lab", "l1", "10"));
    }

    /// What we wrote counts as present until the cache shows it; then the cache wins.
    #[test]
    fn an_overlay_covers_a_cache_that_is_behind() {
        let r: OwnWrites<&str> = OwnWrites::with_ttl(Duration::from_secs(30));
        assert_eq!(r.overlay("ns", "a", None), None);
        r.remember("ns", "a", "ours");
        assert_eq!(r.overlay("ns", "a", None), Some("ours"));
        // other names and namespaces are not covered
        assert_eq!(r.overlay("other", "a", None), None);
        assert_eq!(r.overlay("ns", "b", None), None);
        // once the cache has it, the entry goes: a later deletion reads as absent
        assert_eq!(r.overlay("ns", "a", Some("cached")), Some("cached"));
        assert_eq!(r.overlay("ns", "a", None), None);
    }

    /// An entry past its TTL is gone: an object deleted before the cache saw it is not believed
    /// for ever.
    #[test]
    fn entries_expire_after_their_ttl() {
        let r: OwnWrites<u8> = OwnWrites::with_ttl(Duration::ZERO);
        r.remember("ns", "a", 1);
        assert_eq!(r.get("ns", "a"), None);
        assert_eq!(r.lock().iter().count(), 0);
        let forever: OwnWrites<u8> = OwnWrites::default();
        forever.remember("ns", "a", 1);
        assert_eq!(forever.get("ns", "a"), Some(1));
        assert_eq!(forever.forget("ns", "a"), Some(1));
        assert_eq!(forever.get("ns", "a"), None);
    }
}

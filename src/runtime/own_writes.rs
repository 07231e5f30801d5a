//! Writes whose echo has not arrived: a pass that still sees, in its cache, a version of an
//! object that one of our own writes replaced runs before the watch delivered that write. Its
//! writes would only conflict (409) or repeat ours, so it skips them and looks again shortly.
//! Used by the exporter feature (docs/exporter.md) and the vmexport feature's status write
//! (docs/vmexport.md, "Pass steps").

use std::collections::HashMap;
use std::sync::Mutex;

/// (namespace, name).
type Key = (String, String);

/// (namespace, name) → the resourceVersions our latest writes replaced (a status write and the
/// metadata patch after it). A pass that still sees one of them in its cache runs before the
/// watch delivered our writes (another trigger queued it): its writes would only conflict or
/// repeat ours, so it skips its work. It cannot count on our writes' own events to bring the
/// next pass (a status write of ours wakes no Client), and it replaced the timer the writing
/// pass set, so it looks again shortly (the exporter's `STALE_RECHECK`).
#[derive(Default)]
pub struct Replaced {
    inner: Mutex<HashMap<Key, Vec<String>>>,
}

impl Replaced {
    /// Whether the cached object (`rv`) predates our latest writes to it. Seeing any other
    /// version forgets the entry.
    pub fn is_stale(&self, namespace: &str, name: &str, rv: &str) -> bool {
        let mut inner = self.inner.lock().expect("lock");
        let key = (namespace.to_string(), name.to_string());
        match inner.get(&key) {
            Some(replaced) if replaced.iter().any(|r| r == rv) => true,
            Some(_) => {
                inner.remove(&key);
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
        let rv = replaced;
        let mut inner = self.inner.lock().expect("lock");
        // Only an optimisation: an object deleted right after a write leaves its entry, so the
        // map is dropped whole when it grows past any plausible burst.
        if inner.len() >= 16_384 {
            inner.clear();
        }
        let versions = inner
            .entry((namespace.to_string(), name.to_string()))
            .or_default();
        if versions.len() >= 4 {
            versions.remove(0);
        }
        versions.push(rv.to_string());
    }
}

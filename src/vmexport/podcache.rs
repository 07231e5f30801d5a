//! The Pod cache of the in-use check (vmexport.md §4.2): every Pod in the watched namespaces is
//! cached with only what the check and the event mapper read (identity, owner references,
//! deletion mark, its PVC volumes and `status.phase`), and indexed by namespace and claim name.
//! The export Pod itself is always read with a full GET.

use std::collections::{BTreeSet, HashMap};
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::core::v1::{
    PersistentVolumeClaimVolumeSource, Pod, PodSpec, PodStatus, Volume,
};
use kube::api::ObjectMeta;
use kube::runtime::watcher;

/// Reduces a Pod to what the vmexport reconciler reads from the cache. A Pod that mounts no
/// claim keeps no volumes, so the many Pods unrelated to exports cost little more than their
/// metadata.
pub fn slim_pod(pod: &mut Pod) {
    let m = std::mem::take(&mut pod.metadata);
    pod.metadata = ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        owner_references: m.owner_references,
        deletion_timestamp: m.deletion_timestamp,
        ..Default::default()
    };
    let volumes: Vec<Volume> = pod
        .spec
        .take()
        .and_then(|s| s.volumes)
        .into_iter()
        .flatten()
        .filter_map(|v| {
            let claim = v.persistent_volume_claim?;
            Some(Volume {
                name: v.name,
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.claim_name,
                    read_only: None,
                }),
                ..Default::default()
            })
        })
        .collect();
    pod.spec = Some(PodSpec {
        containers: Vec::new(),
        volumes: (!volumes.is_empty()).then_some(volumes),
        ..Default::default()
    });
    let phase = pod.status.take().and_then(|s| s.phase);
    pod.status = phase.map(|p| PodStatus {
        phase: Some(p),
        ..Default::default()
    });
}

type Key = (String, String);

fn claims_of(pod: &Pod) -> Vec<String> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| {
            v.persistent_volume_claim
                .as_ref()
                .map(|c| c.claim_name.clone())
        })
        .collect()
}

fn pod_key(pod: &Pod) -> Option<Key> {
    Some((pod.metadata.namespace.clone()?, pod.metadata.name.clone()?))
}

#[derive(Default)]
struct Index {
    /// (namespace, claim) → pod names.
    by_claim: HashMap<Key, BTreeSet<String>>,
    /// (namespace, pod) → claims, so an update or delete removes exactly what it added.
    by_pod: HashMap<Key, Vec<String>>,
}

impl Index {
    fn remove(&mut self, key: &Key) {
        for claim in self.by_pod.remove(key).unwrap_or_default() {
            let ck = (key.0.clone(), claim);
            if let Some(set) = self.by_claim.get_mut(&ck) {
                set.remove(&key.1);
                if set.is_empty() {
                    self.by_claim.remove(&ck);
                }
            }
        }
    }

    fn insert(&mut self, pod: &Pod) {
        let Some(key) = pod_key(pod) else { return };
        self.remove(&key);
        let claims = claims_of(pod);
        if claims.is_empty() {
            return;
        }
        for c in &claims {
            self.by_claim
                .entry((key.0.clone(), c.clone()))
                .or_default()
                .insert(key.1.clone());
        }
        self.by_pod.insert(key, claims);
    }
}

/// Pods by (namespace, claim name), kept from the same watch events as the Pod store. It only
/// narrows the candidates: the in-use check reads each candidate from the store.
#[derive(Default)]
pub struct ClaimIndex {
    live: RwLock<Index>,
    /// The relist in progress (between `Init` and `InitDone`).
    relist: RwLock<Option<Index>>,
    /// Set by the first complete list: before it, "no pod mounts the claim" would be a guess.
    ready: AtomicBool,
}

impl ClaimIndex {
    pub fn apply(&self, ev: &watcher::Event<Pod>) {
        match ev {
            watcher::Event::Apply(p) => self
                .live
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(p),
            watcher::Event::Delete(p) => {
                if let Some(k) = pod_key(p) {
                    self.live
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&k);
                }
            }
            watcher::Event::Init => {
                *self.relist.write().unwrap_or_else(|e| e.into_inner()) = Some(Index::default())
            }
            watcher::Event::InitApply(p) => {
                if let Some(ix) = self
                    .relist
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_mut()
                {
                    ix.insert(p);
                }
            }
            watcher::Event::InitDone => {
                if let Some(ix) = self
                    .relist
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                {
                    *self.live.write().unwrap_or_else(|e| e.into_inner()) = ix;
                }
                self.ready.store(true, Ordering::Release);
            }
        }
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Names of the Pods in `ns` that mount `claim`.
    pub fn pods(&self, ns: &str, claim: &str) -> Vec<String> {
        self.live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_claim
            .get(&(ns.to_string(), claim.to_string()))
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(ns: &str, name: &str, claims: &[&str]) -> Pod {
        let mut vols: Vec<_> = claims
            .iter()
            .enumerate()
            .map(|(i, c)| json!({"name": format!("v{i}"), "persistentVolumeClaim": {"claimName": c, "readOnly": true}}))
            .collect();
        vols.push(json!({"name": "cm", "configMap": {"name": "x"}}));
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}"),
                "labels": {"app": "x"}, "annotations": {"big": "x".repeat(1000)},
                "managedFields": [{"manager": "kubectl"}],
                "ownerReferences": [{"apiVersion": "export.kubevirt.io/v1beta1", "kind": "VirtualMachineExport", "name": "e", "uid": "u1", "controller": true}]},
            "spec": {"containers": [{"name": "c", "image": "busybox", "env": [{"name": "A", "value": "b"}]}],
                "volumes": vols},
            "status": {"phase": "Running", "podIP": "10.0.0.9", "containerStatuses": [{"name": "c", "ready": true, "restartCount": 0, "image": "b", "imageID": ""}]},
        }))
        .unwrap()
    }

    #[test]
    fn slim_pod_keeps_only_what_the_in_use_check_reads() {
        let full = pod("ns", "p", &["d"]);
        let mut slim = full.clone();
        slim_pod(&mut slim);
        assert_eq!(
            serde_json::to_value(&slim).unwrap(),
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "ns", "uid": "uid-p",
                    "ownerReferences": [{"apiVersion": "export.kubevirt.io/v1beta1", "kind": "VirtualMachineExport", "name": "e", "uid": "u1", "controller": true}]},
                "spec": {"containers": [], "volumes": [{"name": "v0", "persistentVolumeClaim": {"claimName": "d"}}]},
                "status": {"phase": "Running"},
            })
        );
        // The decisions are the same on the slim copy.
        for uid in ["u1", "other"] {
            assert_eq!(
                crate::vmexport::build::pvc_in_use([&full], "d", uid).is_some(),
                crate::vmexport::build::pvc_in_use([&slim], "d", uid).is_some()
            );
        }
        let mut none = pod("ns", "q", &[]);
        slim_pod(&mut none);
        assert!(none.spec.unwrap().volumes.is_none());
    }

    #[test]
    fn claim_index_follows_watch_events() {
        let ix = ClaimIndex::default();
        ix.apply(&watcher::Event::Init);
        ix.apply(&watcher::Event::InitApply(pod("a", "p1", &["d", "e"])));
        ix.apply(&watcher::Event::InitApply(pod("b", "p2", &["d"])));
        assert!(ix.pods("a", "d").is_empty(), "visible only after InitDone");
        assert!(!ix.is_ready());
        ix.apply(&watcher::Event::InitDone);
        assert!(ix.is_ready());
        assert_eq!(ix.pods("a", "d"), ["p1"]);
        assert_eq!(ix.pods("a", "e"), ["p1"]);
        assert_eq!(ix.pods("b", "d"), ["p2"]);
        ix.apply(&watcher::Event::Apply(pod("a", "p3", &["d"])));
        assert_eq!(ix.pods("a", "d"), ["p1", "p3"]);
        // same name, new claims (deleted and recreated between two events)
        ix.apply(&watcher::Event::Apply(pod("a", "p1", &["f"])));
        assert_eq!(ix.pods("a", "d"), ["p3"]);
        assert!(ix.pods("a", "e").is_empty());
        assert_eq!(ix.pods("a", "f"), ["p1"]);
        ix.apply(&watcher::Event::Delete(pod("a", "p3", &["d"])));
        assert!(ix.pods("a", "d").is_empty());
        // a relist replaces everything
        ix.apply(&watcher::Event::Init);
        ix.apply(&watcher::Event::InitApply(pod("c", "p9", &["z"])));
        ix.apply(&watcher::Event::InitDone);
        assert!(ix.pods("a", "f").is_empty() && ix.pods("b", "d").is_empty());
        assert_eq!(ix.pods("c", "z"), ["p9"]);
    }
}

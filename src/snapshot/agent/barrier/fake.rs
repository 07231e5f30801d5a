//! The fake barrier (`--barrier=fake`, docs/snapshot.md, "Testing"): models the kernel's
//! user-suspend flag, roles and disk states, and records freeze, suspend, cut, resume and thaw per
//! node. It touches no kernel or DRBD state.
//!
//! Files in the shared directory `DIR`:
//! - `cluster.json`, written by the test: the volumes, their Primary (the mounting node) and
//!   each leg's disk state, plus optional faults;
//! - `<node>.state.json`, this node's "kernel": suspended and frozen resources. It lives in a
//!   file so an agent restart keeps it, like the real kernel; deleting it models a reboot;
//! - `<node>.events.jsonl`, this node's event log, one JSON object per line: every kernel
//!   state transition (an idempotent repeat is not one) and every cut.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use super::{Barrier, BarrierError, Peer, ResourceStatus, Result};

/// One volume in `cluster.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FakeVolume {
    /// The node where the volume is Primary and mounted (freeze and thaw happen there only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<String>,
    /// Node → local disk state (`UpToDate`, `Diskless`, …).
    pub legs: BTreeMap<String, String>,
}

/// Injected faults for one node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FakeFaults {
    /// `suspend` fails; with `suspendSetsFlag` the flag is set anyway (a wedged call, #382).
    #[serde(default)]
    pub suspend_fails: bool,
    #[serde(default)]
    pub suspend_sets_flag: bool,
    /// `resume` fails.
    #[serde(default)]
    pub resume_fails: bool,
}

/// `cluster.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FakeCluster {
    #[serde(default)]
    pub volumes: BTreeMap<String, FakeVolume>,
    #[serde(default)]
    pub faults: BTreeMap<String, FakeFaults>,
}

/// `<node>.state.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FakeKernel {
    #[serde(default)]
    pub suspended: BTreeSet<String>,
    #[serde(default)]
    pub frozen: BTreeSet<String>,
}

/// One line of `<node>.events.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FakeEvent {
    /// Wall clock, nanoseconds since the epoch (one clock for every process on the machine).
    pub at_ns: u128,
    pub node: String,
    /// `freeze`, `suspend`, `cut`, `resume` or `thaw`.
    pub event: String,
    pub volume: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// For `cut`: how long sync, delete and cut took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ns: Option<u128>,
}

pub fn cluster_path(dir: &Path) -> PathBuf {
    dir.join("cluster.json")
}

pub fn kernel_path(dir: &Path, node: &str) -> PathBuf {
    dir.join(format!("{node}.state.json"))
}

pub fn events_path(dir: &Path, node: &str) -> PathBuf {
    dir.join(format!("{node}.events.jsonl"))
}

/// Writes `cluster.json` atomically (tests).
pub fn write_cluster(dir: &Path, c: &FakeCluster) -> std::io::Result<()> {
    write_atomic(
        &cluster_path(dir),
        &serde_json::to_vec_pretty(c).unwrap_or_default(),
    )
}

/// Reads a node's event log (tests).
pub fn read_events(dir: &Path, node: &str) -> Vec<FakeEvent> {
    std::fs::read_to_string(events_path(dir, node))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Reads a node's kernel state (tests).
pub fn read_kernel(dir: &Path, node: &str) -> FakeKernel {
    std::fs::read(kernel_path(dir, node))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn write_atomic(p: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = p.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(tmp, p)
}

pub struct FakeBarrier {
    node: String,
    dir: PathBuf,
    kernel: Mutex<()>,
    /// `cluster.json` as last parsed, keyed by the file's identity: a bench with thousands of
    /// volumes would otherwise parse the whole file on every call (O(N) per round).
    parsed: Mutex<Option<(FileKey, Arc<FakeCluster>)>>,
}

/// What tells one version of `cluster.json` from another: `write_cluster` renames a new file
/// into place, so the inode changes with every write; size and mtime cover an in-place edit.
type FileKey = (u64, u64, Option<SystemTime>);

impl FakeBarrier {
    pub fn new(node: impl Into<String>, dir: impl Into<PathBuf>) -> Self {
        FakeBarrier {
            node: node.into(),
            dir: dir.into(),
            kernel: Mutex::new(()),
            parsed: Mutex::new(None),
        }
    }

    fn cluster(&self) -> Result<Arc<FakeCluster>> {
        let path = cluster_path(&self.dir);
        let meta = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Arc::new(FakeCluster::default()));
            }
            Err(e) => return Err(BarrierError(format!("fake cluster.json: {e}"))),
        };
        let key = (meta.ino(), meta.len(), meta.modified().ok());
        let mut parsed = self.parsed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((k, c)) = parsed.as_ref()
            && *k == key
        {
            return Ok(c.clone());
        }
        let c: FakeCluster = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| BarrierError(format!("fake cluster.json: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => FakeCluster::default(),
            Err(e) => return Err(BarrierError(format!("fake cluster.json: {e}"))),
        };
        let c = Arc::new(c);
        *parsed = Some((key, c.clone()));
        Ok(c)
    }

    fn faults(&self) -> Result<FakeFaults> {
        Ok(self
            .cluster()?
            .faults
            .get(&self.node)
            .cloned()
            .unwrap_or_default())
    }

    /// Changes the kernel state; returns whether anything changed (the event log records
    /// transitions only, so an idempotent re-assert of suspend-io leaves no second entry).
    fn update(&self, f: impl FnOnce(&mut FakeKernel) -> bool) -> Result<bool> {
        let _g = self.kernel.lock().unwrap_or_else(|p| p.into_inner());
        let mut k = read_kernel(&self.dir, &self.node);
        if !f(&mut k) {
            return Ok(false);
        }
        let bytes = serde_json::to_vec(&k).unwrap_or_default();
        write_atomic(&kernel_path(&self.dir, &self.node), &bytes)
            .map_err(|e| BarrierError(format!("fake kernel state: {e}")))?;
        Ok(true)
    }

    fn record(&self, event: &str, volume: &str, snapshot: Option<&str>) {
        self.record_with(event, volume, snapshot, None);
    }

    fn record_with(
        &self,
        event: &str,
        volume: &str,
        snapshot: Option<&str>,
        duration_ns: Option<u128>,
    ) {
        let ev = FakeEvent {
            at_ns: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default(),
            node: self.node.clone(),
            event: event.into(),
            volume: volume.into(),
            snapshot: snapshot.map(str::to_string),
            duration_ns,
        };
        let line = serde_json::to_string(&ev).unwrap_or_default();
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(events_path(&self.dir, &self.node))
        {
            let _ = writeln!(f, "{line}");
        }
    }

    fn status_now(&self, resource: &str) -> Result<Option<ResourceStatus>> {
        let c = self.cluster()?;
        let Some(v) = c.volumes.get(resource) else {
            return Ok(None);
        };
        let primary = v.primary.as_deref();
        let here = v
            .legs
            .get(&self.node)
            .cloned()
            .or_else(|| (primary == Some(&self.node)).then(|| "Diskless".to_string()));
        let Some(disk) = here else { return Ok(None) };
        let role = |n: &str| {
            if primary == Some(n) {
                "Primary"
            } else {
                "Secondary"
            }
        };
        let mut peers: Vec<Peer> = v
            .legs
            .iter()
            .filter(|(n, _)| **n != self.node)
            .map(|(n, d)| Peer {
                node: n.clone(),
                connection: "Connected".into(),
                disk: d.clone(),
                role: role(n).into(),
                resyncing: false,
            })
            .collect();
        // A client leg that is Primary elsewhere is a diskless peer.
        if let Some(p) = primary
            && p != self.node
            && !v.legs.contains_key(p)
        {
            peers.push(Peer {
                node: p.into(),
                connection: "Connected".into(),
                disk: "Diskless".into(),
                role: "Primary".into(),
                resyncing: false,
            });
        }
        Ok(Some(ResourceStatus {
            suspended_user: read_kernel(&self.dir, &self.node)
                .suspended
                .contains(resource),
            role: role(&self.node).into(),
            disk,
            peers,
        }))
    }
}

impl Barrier for FakeBarrier {
    fn status<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<ResourceStatus>>> {
        Box::pin(async move { self.status_now(resource) })
    }

    fn suspend<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let faults = self.faults()?;
            if faults.suspend_fails {
                if faults.suspend_sets_flag {
                    self.update(|k| k.suspended.insert(resource.to_string()))?;
                }
                return Err(BarrierError(format!("fake: suspend-io {resource} failed")));
            }
            if self.update(|k| k.suspended.insert(resource.to_string()))? {
                self.record("suspend", resource, None);
            }
            Ok(())
        })
    }

    fn resume<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if self.faults()?.resume_fails {
                return Err(BarrierError(format!("fake: resume-io {resource} failed")));
            }
            if self.update(|k| k.suspended.remove(resource))? {
                self.record("resume", resource, None);
            }
            Ok(())
        })
    }

    fn suspended(&self) -> BoxFuture<'_, Result<Vec<String>>> {
        Box::pin(async move {
            Ok(read_kernel(&self.dir, &self.node)
                .suspended
                .into_iter()
                .collect())
        })
    }

    fn mountpoint<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<PathBuf>>> {
        Box::pin(async move {
            let c = self.cluster()?;
            let mounted = c
                .volumes
                .get(resource)
                .is_some_and(|v| v.primary.as_deref() == Some(self.node.as_str()));
            Ok(mounted.then(|| self.dir.join("mnt").join(&self.node).join(resource)))
        })
    }

    fn freeze<'a>(&'a self, resource: &'a str, _mountpoint: &'a Path) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if self.update(|k| k.frozen.insert(resource.to_string()))? {
                self.record("freeze", resource, None);
            }
            Ok(())
        })
    }

    fn thaw<'a>(&'a self, resource: &'a str, _mountpoint: &'a Path) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if self.update(|k| k.frozen.remove(resource))? {
                self.record("thaw", resource, None);
            }
            Ok(())
        })
    }

    fn note_cut<'a>(
        &'a self,
        resource: &'a str,
        snapshot: &'a str,
        took: std::time::Duration,
    ) -> BoxFuture<'a, ()> {
        Box::pin(
            async move { self.record_with("cut", resource, Some(snapshot), Some(took.as_nanos())) },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> FakeCluster {
        FakeCluster {
            volumes: [(
                "pvc-1".to_string(),
                FakeVolume {
                    primary: Some("a".into()),
                    legs: [("a", "UpToDate"), ("b", "UpToDate"), ("t", "Diskless")]
                        .iter()
                        .map(|(n, d)| (n.to_string(), d.to_string()))
                        .collect(),
                },
            )]
            .into(),
            faults: BTreeMap::new(),
        }
    }

    #[tokio::test]
    async fn models_roles_flags_and_records_events() {
        let dir = tempfile::tempdir().unwrap();
        write_cluster(dir.path(), &cluster()).unwrap();
        let a = FakeBarrier::new("a", dir.path());
        let b = FakeBarrier::new("b", dir.path());
        let x = FakeBarrier::new("x", dir.path());

        let sa = a.status("pvc-1").await.unwrap().unwrap();
        assert!(sa.is_primary() && !sa.suspended_user);
        assert_eq!(sa.disk, "UpToDate");
        assert_eq!(
            sa.peers.iter().map(|p| p.node.as_str()).collect::<Vec<_>>(),
            ["b", "t"]
        );
        let sb = b.status("pvc-1").await.unwrap().unwrap();
        assert_eq!(sb.primary_peers(), ["a"]);
        assert_eq!(x.status("pvc-1").await.unwrap(), None);
        assert_eq!(a.status("other").await.unwrap(), None);

        // Freeze and thaw only make sense where the volume is mounted.
        let mp = a.mountpoint("pvc-1").await.unwrap().unwrap();
        assert_eq!(b.mountpoint("pvc-1").await.unwrap(), None);

        a.freeze("pvc-1", &mp).await.unwrap();
        a.suspend("pvc-1").await.unwrap();
        // Re-asserting is idempotent, like the kernel: no second transition.
        a.suspend("pvc-1").await.unwrap();
        a.freeze("pvc-1", &mp).await.unwrap();
        assert!(a.status("pvc-1").await.unwrap().unwrap().suspended_user);
        assert_eq!(a.suspended().await.unwrap(), ["pvc-1"]);
        a.note_cut("pvc-1", "snap-1", std::time::Duration::from_millis(3))
            .await;
        a.resume("pvc-1").await.unwrap();
        a.thaw("pvc-1", &mp).await.unwrap();
        a.resume("pvc-1").await.unwrap();
        a.thaw("pvc-1", &mp).await.unwrap();
        assert!(a.suspended().await.unwrap().is_empty());

        let cut = read_events(dir.path(), "a")
            .into_iter()
            .find(|e| e.event == "cut")
            .unwrap();
        assert_eq!(
            (cut.snapshot.as_deref(), cut.duration_ns),
            (Some("snap-1"), Some(3_000_000))
        );
        let evs: Vec<String> = read_events(dir.path(), "a")
            .into_iter()
            .map(|e| e.event)
            .collect();
        assert_eq!(evs, ["freeze", "suspend", "cut", "resume", "thaw"]);
        assert!(read_events(dir.path(), "b").is_empty());
        let k = read_kernel(dir.path(), "a");
        assert!(k.suspended.is_empty() && k.frozen.is_empty());
    }

    #[tokio::test]
    async fn the_flag_survives_a_restart_and_faults_apply() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = cluster();
        write_cluster(dir.path(), &c).unwrap();
        FakeBarrier::new("b", dir.path())
            .suspend("pvc-1")
            .await
            .unwrap();
        // A new instance (agent restart) sees the kernel flag.
        assert_eq!(
            FakeBarrier::new("b", dir.path()).suspended().await.unwrap(),
            ["pvc-1"]
        );
        // A wedged suspend fails but leaves the flag set (#382).
        c.faults.insert(
            "a".into(),
            FakeFaults {
                suspend_fails: true,
                suspend_sets_flag: true,
                resume_fails: false,
            },
        );
        write_cluster(dir.path(), &c).unwrap();
        let a = FakeBarrier::new("a", dir.path());
        assert!(a.suspend("pvc-1").await.is_err());
        assert!(a.status("pvc-1").await.unwrap().unwrap().suspended_user);
        assert!(read_events(dir.path(), "a").is_empty());
    }

    #[tokio::test]
    async fn a_client_leg_primary_appears_as_a_diskless_peer() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = cluster();
        c.volumes.get_mut("pvc-1").unwrap().primary = Some("client".into());
        write_cluster(dir.path(), &c).unwrap();
        let client = FakeBarrier::new("client", dir.path())
            .status("pvc-1")
            .await
            .unwrap()
            .unwrap();
        assert!(client.is_primary());
        assert_eq!(client.disk, "Diskless");
        let a = FakeBarrier::new("a", dir.path())
            .status("pvc-1")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(a.primary_peers(), ["client"]);
    }

    #[tokio::test]
    async fn a_rewritten_cluster_file_is_read_again_by_the_same_barrier() {
        let dir = tempfile::tempdir().unwrap();
        write_cluster(dir.path(), &cluster()).unwrap();
        let a = FakeBarrier::new("a", dir.path());
        assert!(a.mountpoint("pvc-1").await.unwrap().is_some());
        assert!(a.mountpoint("pvc-1").await.unwrap().is_some());
        // The test moves the Primary: the parsed copy must not outlive the file it came from.
        let mut c = cluster();
        c.volumes.get_mut("pvc-1").unwrap().primary = Some("b".into());
        write_cluster(dir.path(), &c).unwrap();
        assert!(a.mountpoint("pvc-1").await.unwrap().is_none());
        std::fs::remove_file(cluster_path(dir.path())).unwrap();
        assert!(a.status("pvc-1").await.unwrap().is_none());
    }
}

//! The DRBD barrier: `drbdadm suspend-io|resume-io <vol>`, `drbdsetup status --json [<vol>]`,
//! each bounded by `--barrier-timeout` (#222/#226); FIFREEZE/FITHAW on the mount point of the
//! resource's device.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::Value;

use super::{Barrier, BarrierError, Peer, ResourceStatus, Result, mount};
use crate::snapshot::agent::cmd::{Runner, argv};

/// Block major of DRBD devices.
pub const DRBD_MAJOR: u32 = 147;

pub fn suspend_argv(resource: &str) -> Vec<String> {
    argv(["drbdadm", "suspend-io", resource])
}

pub fn resume_argv(resource: &str) -> Vec<String> {
    argv(["drbdadm", "resume-io", resource])
}

pub fn status_argv(resource: Option<&str>) -> Vec<String> {
    let mut a = argv(["drbdsetup", "status", "--json"]);
    a.extend(resource.map(str::to_string));
    a
}

fn s<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("Unknown")
}

/// Parses `drbdsetup status --json` into (resource name, status, minor of volume 0).
pub fn parse_status(
    json: &str,
) -> std::result::Result<Vec<(String, ResourceStatus, Option<u32>)>, String> {
    let v: Value =
        serde_json::from_str(json).map_err(|e| format!("drbdsetup status --json: {e}"))?;
    let arr = v.as_array().ok_or("drbdsetup status --json: not a list")?;
    let mut out = Vec::new();
    for r in arr {
        let name = r
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let dev0 = r
            .get("devices")
            .and_then(Value::as_array)
            .and_then(|d| d.first());
        let peers = r
            .get("connections")
            .and_then(Value::as_array)
            .map(|cs| {
                cs.iter()
                    .map(|c| {
                        let pd0 = c
                            .get("peer_devices")
                            .and_then(Value::as_array)
                            .and_then(|d| d.first());
                        let repl = pd0.map(|p| s(p, "replication-state")).unwrap_or("Off");
                        Peer {
                            node: s(c, "name").to_string(),
                            connection: s(c, "connection-state").to_string(),
                            disk: pd0
                                .map(|p| s(p, "peer-disk-state"))
                                .unwrap_or("DUnknown")
                                .to_string(),
                            role: s(c, "peer-role").to_string(),
                            resyncing: repl.starts_with("Sync") || repl.starts_with("PausedSync"),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let st = ResourceStatus {
            suspended_user: r
                .get("suspended-user")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            role: s(r, "role").to_string(),
            disk: dev0
                .map(|d| s(d, "disk-state"))
                .unwrap_or("Diskless")
                .to_string(),
            peers,
        };
        let minor = dev0
            .and_then(|d| d.get("minor"))
            .and_then(Value::as_u64)
            .map(|m| m as u32);
        out.push((name, st, minor));
    }
    Ok(out)
}

fn not_configured(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("no such resource") || t.contains("not defined") || t.contains("unknown resource")
}

pub struct Drbd {
    runner: Runner,
    /// Bound on each DRBD call and on a freeze.
    timeout: Duration,
    mountinfo: PathBuf,
}

impl Drbd {
    pub fn new(runner: Runner) -> Self {
        let timeout = runner.timeout;
        Drbd {
            runner,
            timeout,
            mountinfo: PathBuf::from("/proc/self/mountinfo"),
        }
    }

    async fn status_of(
        &self,
        resource: Option<&str>,
    ) -> Result<Vec<(String, ResourceStatus, Option<u32>)>> {
        let out = self
            .runner
            .output(&status_argv(resource))
            .await
            .map_err(|e| BarrierError(e.to_string()))?;
        if !out.success() {
            if not_configured(&out.text()) {
                return Ok(Vec::new());
            }
            return Err(BarrierError(format!(
                "drbdsetup status failed: {}",
                out.text()
            )));
        }
        parse_status(&out.stdout).map_err(BarrierError)
    }
}

impl Barrier for Drbd {
    fn status<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<ResourceStatus>>> {
        Box::pin(async move {
            Ok(self
                .status_of(Some(resource))
                .await?
                .into_iter()
                .find(|(n, _, _)| n == resource)
                .map(|(_, st, _)| st))
        })
    }

    fn suspend<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.runner
                .run(&suspend_argv(resource))
                .await
                .map(|_| ())
                .map_err(|e| BarrierError(e.to_string()))
        })
    }

    fn resume<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.runner
                .run(&resume_argv(resource))
                .await
                .map(|_| ())
                .map_err(|e| BarrierError(e.to_string()))
        })
    }

    fn suspended(&self) -> BoxFuture<'_, Result<Vec<String>>> {
        Box::pin(async move {
            Ok(self
                .status_of(None)
                .await?
                .into_iter()
                .filter(|(_, st, _)| st.suspended_user)
                .map(|(n, _, _)| n)
                .collect())
        })
    }

    fn mountpoint<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<PathBuf>>> {
        Box::pin(async move {
            let minor = self
                .status_of(Some(resource))
                .await?
                .into_iter()
                .find(|(n, _, _)| n == resource)
                .and_then(|(_, _, m)| m);
            let Some(minor) = minor else { return Ok(None) };
            let info = tokio::fs::read_to_string(&self.mountinfo)
                .await
                .map_err(|e| BarrierError(format!("read {}: {e}", self.mountinfo.display())))?;
            Ok(mount::find_mountpoint(&info, DRBD_MAJOR, minor))
        })
    }

    fn freeze<'a>(&'a self, _resource: &'a str, mountpoint: &'a Path) -> BoxFuture<'a, Result<()>> {
        Box::pin(mount::freeze(mountpoint, self.timeout))
    }

    fn thaw<'a>(&'a self, _resource: &'a str, mountpoint: &'a Path) -> BoxFuture<'a, Result<()>> {
        Box::pin(mount::thaw(mountpoint, self.timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::agent::cmd::testing::FakeBin;

    const STATUS: &str = r#"[
{
  "name": "pvc-1", "node-id": 0, "role": "Primary", "suspended": true,
  "suspended-user": true, "suspended-no-data": false, "suspended-fencing": false,
  "devices": [{"volume": 0, "minor": 1000, "disk-state": "UpToDate", "client": false}],
  "connections": [
    {"peer-node-id": 1, "name": "node-b", "connection-state": "Connected", "peer-role": "Secondary",
     "peer_devices": [{"volume": 0, "replication-state": "Established", "peer-disk-state": "UpToDate"}]},
    {"peer-node-id": 2, "name": "node-c", "connection-state": "Connected", "peer-role": "Secondary",
     "peer_devices": [{"volume": 0, "replication-state": "SyncSource", "peer-disk-state": "Inconsistent"}]}
  ]
},
{
  "name": "pvc-2", "role": "Secondary", "suspended-user": false,
  "devices": [{"volume": 0, "minor": 1001, "disk-state": "Diskless", "client": true}],
  "connections": [
    {"name": "node-a", "connection-state": "Connecting", "peer-role": "Unknown", "peer_devices": []}
  ]
}
]"#;

    #[test]
    fn exact_argument_vectors() {
        assert_eq!(suspend_argv("pvc-1"), ["drbdadm", "suspend-io", "pvc-1"]);
        assert_eq!(resume_argv("pvc-1"), ["drbdadm", "resume-io", "pvc-1"]);
        assert_eq!(
            status_argv(Some("pvc-1")),
            ["drbdsetup", "status", "--json", "pvc-1"]
        );
        assert_eq!(status_argv(None), ["drbdsetup", "status", "--json"]);
    }

    #[test]
    fn parses_status_json() {
        let st = parse_status(STATUS).unwrap();
        assert_eq!(st.len(), 2);
        let (name, a, minor) = &st[0];
        assert_eq!((name.as_str(), *minor), ("pvc-1", Some(1000)));
        assert!(a.suspended_user && a.is_primary());
        assert_eq!(a.disk, "UpToDate");
        assert_eq!(
            a.peers,
            vec![
                Peer {
                    node: "node-b".into(),
                    connection: "Connected".into(),
                    disk: "UpToDate".into(),
                    role: "Secondary".into(),
                    resyncing: false
                },
                Peer {
                    node: "node-c".into(),
                    connection: "Connected".into(),
                    disk: "Inconsistent".into(),
                    role: "Secondary".into(),
                    resyncing: true
                },
            ]
        );
        let (_, b, _) = &st[1];
        assert_eq!((b.disk.as_str(), b.suspended_user), ("Diskless", false));
        assert_eq!(b.peers[0].disk, "DUnknown");
        assert!(parse_status("{}").is_err());
        assert!(parse_status("not json").is_err());
    }

    fn fake_drbd(bin: &FakeBin) {
        let json = bin.dir.path().join("status.json");
        std::fs::write(&json, STATUS).unwrap();
        bin.script("drbdadm", "exit 0").script(
            "drbdsetup",
            &format!(
                "if [ \"$4\" = missing ]; then echo \"missing: No such resource\" >&2; exit 10; fi; cat '{}'",
                json.display()
            ),
        );
    }

    #[tokio::test]
    async fn barrier_calls_go_through_drbdadm_and_drbdsetup() {
        let bin = FakeBin::new();
        fake_drbd(&bin);
        let d = Drbd::new(bin.runner(Duration::from_secs(5)));
        d.suspend("pvc-1").await.unwrap();
        d.resume("pvc-1").await.unwrap();
        assert!(d.status("pvc-1").await.unwrap().unwrap().suspended_user);
        assert_eq!(d.status("missing").await.unwrap(), None);
        assert_eq!(d.suspended().await.unwrap(), ["pvc-1"]);
        assert_eq!(
            bin.calls(),
            [
                "drbdadm suspend-io pvc-1",
                "drbdadm resume-io pvc-1",
                "drbdsetup status --json pvc-1",
                "drbdsetup status --json missing",
                "drbdsetup status --json",
            ]
        );
    }

    #[tokio::test]
    async fn mountpoint_is_found_by_device_number() {
        let bin = FakeBin::new();
        fake_drbd(&bin);
        let mut d = Drbd::new(bin.runner(Duration::from_secs(5)));
        let info = bin.dir.path().join("mountinfo");
        std::fs::write(
            &info,
            "22 1 253:1 / / rw - ext4 /dev/vda1 rw\n36 22 147:1000 / /var/lib/kubelet/pods/p/mount rw - ext4 /dev/drbd1000 rw\n",
        )
        .unwrap();
        d.mountinfo = info;
        assert_eq!(
            d.mountpoint("pvc-1").await.unwrap(),
            Some(PathBuf::from("/var/lib/kubelet/pods/p/mount"))
        );
        assert_eq!(d.mountpoint("pvc-2").await.unwrap(), None);
    }

    #[tokio::test]
    async fn failed_and_hanging_calls() {
        let bin = FakeBin::new();
        bin.script("drbdadm", "echo 'pvc-1: State change failed' >&2; exit 11");
        let d = Drbd::new(bin.runner(Duration::from_secs(5)));
        let err = d.suspend("pvc-1").await.unwrap_err();
        assert_eq!(
            err.0,
            "drbdadm failed (exit Some(11)): pvc-1: State change failed"
        );

        let bin = FakeBin::new();
        bin.script("drbdadm", "exec sleep 30");
        let d = Drbd::new(bin.runner(Duration::from_millis(300)));
        let start = std::time::Instant::now();
        let err = d.suspend("pvc-1").await.unwrap_err();
        assert!(err.0.contains("timeout"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}

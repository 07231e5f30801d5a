//! The DRBD barrier (docs/snapshot.md, "Backends and barrier"): `drbdsetup suspend-io|resume-io
//! <minor>` and `drbdsetup events2 --now [<res>]`, each bounded by `--barrier-timeout`
//! (#222/#226); FIFREEZE/FITHAW on the mount point of the resource's device. Only `drbdsetup`
//! forms that read the kernel's state: they need no resource file (a Miroir node keeps its own
//! where ucm's agent does not see it) and work on DRBD 9 and the in-tree 8.4 alike, where
//! `drbdsetup status --json` does not exist.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;

use super::{Barrier, BarrierError, Peer, ResourceStatus, Result, mount};
use crate::snapshot::agent::cmd::{Runner, argv};

/// Block major of DRBD devices.
pub const DRBD_MAJOR: u32 = 147;

pub fn suspend_argv(minor: u32) -> Vec<String> {
    argv([
        "drbdsetup".to_string(),
        "suspend-io".into(),
        minor.to_string(),
    ])
}

pub fn resume_argv(minor: u32) -> Vec<String> {
    argv([
        "drbdsetup".to_string(),
        "resume-io".into(),
        minor.to_string(),
    ])
}

pub fn status_argv(resource: Option<&str>) -> Vec<String> {
    let mut a = argv(["drbdsetup", "events2", "--now"]);
    a.extend(resource.map(str::to_string));
    a
}

/// One `exists <kind> key:value…` line of `drbdsetup events2 --now`.
fn fields(line: &str) -> Option<(&str, HashMap<&str, &str>)> {
    let mut it = line.split_whitespace();
    if it.next()? != "exists" {
        return None;
    }
    let kind = it.next()?;
    Some((kind, it.filter_map(|kv| kv.split_once(':')).collect()))
}

/// Parses `drbdsetup events2 --now` (DRBD 9 and 8.4) into (resource name, status, minor of
/// volume 0), in the order the resources appear. DRBD 8.4 calls its one peer `peer` (see
/// [`ResourceStatus::name_peer`]). An unknown resource is an empty answer (`exists -`, exit 0).
pub fn parse_status(
    text: &str,
) -> std::result::Result<Vec<(String, ResourceStatus, Option<u32>)>, String> {
    let mut out: Vec<(String, ResourceStatus, Option<u32>)> = Vec::new();
    let mut complete = false;
    for line in text.lines() {
        if line.trim() == "exists -" {
            complete = true;
            continue;
        }
        let Some((kind, f)) = fields(line) else {
            continue;
        };
        let Some(name) = f.get("name").map(|n| n.to_string()) else {
            continue;
        };
        let g = |k: &str| f.get(k).copied().unwrap_or("Unknown").to_string();
        if kind == "resource" {
            out.push((
                name,
                ResourceStatus {
                    suspended_user: f
                        .get("suspended")
                        .is_some_and(|v| v.split(',').any(|x| x == "user")),
                    role: g("role"),
                    disk: "Diskless".into(),
                    peers: Vec::new(),
                },
                None,
            ));
            continue;
        }
        let Some((_, st, minor)) = out.iter_mut().rev().find(|(n, _, _)| *n == name) else {
            continue;
        };
        let peer = f.get("conn-name").copied().unwrap_or("").to_string();
        let vol0 = f.get("volume").is_none_or(|v| *v == "0");
        match kind {
            "connection" => st.peers.push(Peer {
                node: peer,
                connection: g("connection"),
                disk: "DUnknown".into(),
                role: g("role"),
                resyncing: false,
            }),
            "device" if vol0 => {
                st.disk = g("disk");
                *minor = f.get("minor").and_then(|m| m.parse().ok());
            }
            "peer-device" if vol0 => {
                if let Some(p) = st.peers.iter_mut().find(|p| p.node == peer) {
                    let repl = g("replication");
                    p.disk = g("peer-disk");
                    p.resyncing = repl.starts_with("Sync") || repl.starts_with("PausedSync");
                }
            }
            _ => {}
        }
    }
    if !complete && !out.is_empty() {
        return Err("drbdsetup events2 --now: output ends before \"exists -\"".into());
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
    /// The minor of each resource's volume 0 as last read: `suspend-io`/`resume-io` address the
    /// device, and the raise reads the status right before, so the barrier costs no extra call.
    minors: Mutex<HashMap<String, u32>>,
}

impl Drbd {
    pub fn new(runner: Runner) -> Self {
        let timeout = runner.timeout;
        Drbd {
            runner,
            timeout,
            mountinfo: PathBuf::from("/proc/self/mountinfo"),
            minors: Mutex::new(HashMap::new()),
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
                "drbdsetup events2 failed: {}",
                out.text()
            )));
        }
        let all = parse_status(&out.stdout).map_err(BarrierError)?;
        let mut minors = self.minors.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = resource
            && !all.iter().any(|(n, _, m)| n == r && m.is_some())
        {
            minors.remove(r);
        }
        for (n, _, m) in &all {
            if let Some(m) = m {
                minors.insert(n.clone(), *m);
            }
        }
        Ok(all)
    }

    /// The resource's minor: as last read, else read now; None when it has no device here.
    async fn minor(&self, resource: &str) -> Result<Option<u32>> {
        let known = self
            .minors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(resource)
            .copied();
        if known.is_some() {
            return Ok(known);
        }
        Ok(self
            .status_of(Some(resource))
            .await?
            .into_iter()
            .find(|(n, _, _)| n == resource)
            .and_then(|(_, _, m)| m))
    }

    async fn device_minor(&self, resource: &str) -> Result<u32> {
        self.minor(resource).await?.ok_or_else(|| {
            BarrierError(format!(
                "DRBD resource {resource} has no device on this node"
            ))
        })
    }

    async fn call(&self, argv: Vec<String>) -> Result<()> {
        self.runner
            .run(&argv)
            .await
            .map(|_| ())
            .map_err(|e| BarrierError(e.to_string()))
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
            self.call(suspend_argv(self.device_minor(resource).await?))
                .await
        })
    }

    fn resume<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.call(resume_argv(self.device_minor(resource).await?))
                .await
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
            let Some(minor) = self.minor(resource).await? else {
                return Ok(None);
            };
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
    use crate::snapshot::agent::barrier::healthy;
    use crate::snapshot::agent::cmd::testing::FakeBin;

    // Real outputs recorded in the storage lab (docs/snapshot.md, "Testing"): drbd-utils 9.22
    // against DRBD 9.3.3 and the in-tree 8.4.11 on Debian's 6.1 kernel, resource vol1 on guests
    // lab-a (Primary) and lab-b.
    const D9_PRIMARY: &str = include_str!("testdata/drbd9-primary.events2");
    const D9_SECONDARY: &str = include_str!("testdata/drbd9-secondary.events2");
    const D9_SUSPENDED: &str = include_str!("testdata/drbd9-suspended.events2");
    const D9_STANDALONE: &str = include_str!("testdata/drbd9-standalone.events2");
    const D84_PRIMARY: &str = include_str!("testdata/drbd84-primary.events2");
    const D84_SECONDARY: &str = include_str!("testdata/drbd84-secondary.events2");
    const D84_SUSPENDED: &str = include_str!("testdata/drbd84-suspended.events2");
    const D84_SYNCING: &str = include_str!("testdata/drbd84-syncsource.events2");
    const NONE: &str = include_str!("testdata/none.events2");

    fn peer(node: &str, connection: &str, disk: &str, role: &str, resyncing: bool) -> Peer {
        Peer {
            node: node.into(),
            connection: connection.into(),
            disk: disk.into(),
            role: role.into(),
            resyncing,
        }
    }

    fn one(text: &str) -> (String, ResourceStatus, Option<u32>) {
        let mut v = parse_status(text).unwrap();
        assert_eq!(v.len(), 1, "{text}");
        v.remove(0)
    }

    #[test]
    fn exact_argument_vectors() {
        assert_eq!(suspend_argv(1000), ["drbdsetup", "suspend-io", "1000"]);
        assert_eq!(resume_argv(1000), ["drbdsetup", "resume-io", "1000"]);
        assert_eq!(
            status_argv(Some("pvc-1")),
            ["drbdsetup", "events2", "--now", "pvc-1"]
        );
        assert_eq!(status_argv(None), ["drbdsetup", "events2", "--now"]);
    }

    #[test]
    fn parses_drbd9_events2() {
        let (name, st, minor) = one(D9_PRIMARY);
        assert_eq!((name.as_str(), minor), ("vol1", Some(0)));
        assert!(st.is_primary() && !st.suspended_user);
        assert_eq!(st.disk, "UpToDate");
        assert_eq!(
            st.peers,
            [peer("lab-b", "Connected", "UpToDate", "Secondary", false)]
        );
        let (_, st, _) = one(D9_SECONDARY);
        assert_eq!(st.role, "Secondary");
        assert_eq!(st.primary_peers(), ["lab-a"]);
        assert!(one(D9_SUSPENDED).1.suspended_user);
        let (_, st, _) = one(D9_STANDALONE);
        assert_eq!(st.disk, "Diskless");
        assert_eq!(
            st.peers,
            [peer("lab-b", "StandAlone", "DUnknown", "Unknown", false)]
        );
        assert_eq!(parse_status(NONE).unwrap(), []);
    }

    #[test]
    fn parses_drbd84_events2_and_names_its_peer() {
        let (name, st, minor) = one(D84_PRIMARY);
        assert_eq!((name.as_str(), minor), ("vol1", Some(0)));
        assert!(st.is_primary() && !st.suspended_user);
        assert_eq!(
            st.peers,
            [peer("peer", "Connected", "UpToDate", "Secondary", false)]
        );
        let others = ["lab-b".to_string()];
        let named = st.name_peer(&others);
        assert_eq!(named.peers[0].node, "lab-b");
        assert_eq!(healthy(&named, true, &others), Ok(()));
        let st = one(D84_SECONDARY).1.name_peer(&["lab-a".to_string()]);
        assert_eq!(st.primary_peers(), ["lab-a"]);
        assert!(one(D84_SUSPENDED).1.suspended_user);
        let st = one(D84_SYNCING).1.name_peer(&others);
        assert_eq!(
            healthy(&st, true, &others),
            Err("peer lab-b disk is Inconsistent, not UpToDate".into())
        );
        // A peer named as one of the volume's nodes, or several peers, keep their names.
        let st = one(D9_PRIMARY).1.name_peer(&["lab-b".to_string()]);
        assert_eq!(st.peers[0].node, "lab-b");
        let st = one(D9_PRIMARY)
            .1
            .name_peer(&["x".to_string(), "y".to_string()]);
        assert_eq!(st.peers[0].node, "lab-b");
    }

    #[test]
    fn truncated_output_is_an_error() {
        let cut: String = D9_PRIMARY
            .lines()
            .take(3)
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(parse_status(&cut).is_err());
        assert_eq!(parse_status("").unwrap(), []);
    }

    fn fake_drbd(bin: &FakeBin, suspended: &str) {
        let dir = bin.dir.path();
        std::fs::write(dir.join("vol1"), D9_PRIMARY).unwrap();
        std::fs::write(dir.join("all"), suspended).unwrap();
        std::fs::write(dir.join("none"), NONE).unwrap();
        // The answers of the real drbdsetup: events2 of a resource, of all, of an unknown one
        // (empty, exit 0); suspend-io/resume-io of minor 0.
        bin.script(
            "drbdsetup",
            &format!(
                "d='{}'; case \"$1 $2 $3\" in\n\
                 'events2 --now vol1') cat \"$d/vol1\";;\n\
                 'events2 --now ') cat \"$d/all\";;\n\
                 'events2 --now '*) cat \"$d/none\";;\n\
                 'suspend-io 0 '|'resume-io 0 ') ;;\n\
                 *) echo \"$2: Failure: (127) Device minor not allocated\" >&2; exit 10;;\n\
                 esac",
                dir.display()
            ),
        );
    }

    #[tokio::test]
    async fn barrier_calls_go_through_drbdsetup_by_minor() {
        let bin = FakeBin::new();
        fake_drbd(&bin, D9_SUSPENDED);
        let d = Drbd::new(bin.runner(Duration::from_secs(5)));
        // Unknown before any status: suspend reads the minor first.
        d.suspend("vol1").await.unwrap();
        d.resume("vol1").await.unwrap();
        assert!(!d.status("vol1").await.unwrap().unwrap().suspended_user);
        assert_eq!(d.status("missing").await.unwrap(), None);
        assert_eq!(d.suspended().await.unwrap(), ["vol1"]);
        let err = d.suspend("missing").await.unwrap_err();
        assert_eq!(err.0, "DRBD resource missing has no device on this node");
        assert_eq!(
            bin.calls(),
            [
                "drbdsetup events2 --now vol1",
                "drbdsetup suspend-io 0",
                "drbdsetup resume-io 0",
                "drbdsetup events2 --now vol1",
                "drbdsetup events2 --now missing",
                "drbdsetup events2 --now",
                "drbdsetup events2 --now missing",
            ]
        );
    }

    #[tokio::test]
    async fn mountpoint_is_found_by_device_number() {
        let bin = FakeBin::new();
        fake_drbd(&bin, D9_PRIMARY);
        let mut d = Drbd::new(bin.runner(Duration::from_secs(5)));
        let info = bin.dir.path().join("mountinfo");
        std::fs::write(
            &info,
            "22 1 253:1 / / rw - ext4 /dev/vda1 rw\n36 22 147:0 / /mnt/vol1 rw - ext4 /dev/drbd0 rw\n",
        )
        .unwrap();
        d.mountinfo = info;
        assert_eq!(
            d.mountpoint("vol1").await.unwrap(),
            Some(PathBuf::from("/mnt/vol1"))
        );
        assert_eq!(d.mountpoint("pvc-2").await.unwrap(), None);
    }

    #[tokio::test]
    async fn failed_and_hanging_calls() {
        let bin = FakeBin::new();
        bin.script(
            "drbdsetup",
            "if [ \"$1\" = events2 ]; then echo 'exists resource name:vol1 role:Primary suspended:no'; echo 'exists device name:vol1 volume:0 minor:7 disk:UpToDate'; echo 'exists -'; exit 0; fi\n\
             echo '7: Failure: (127) Device minor not allocated' >&2; exit 10",
        );
        let d = Drbd::new(bin.runner(Duration::from_secs(5)));
        let err = d.suspend("vol1").await.unwrap_err();
        assert_eq!(
            err.0,
            "drbdsetup failed (exit Some(10)): 7: Failure: (127) Device minor not allocated"
        );

        let bin = FakeBin::new();
        bin.script("drbdsetup", "exec sleep 30");
        let d = Drbd::new(bin.runner(Duration::from_millis(300)));
        let start = std::time::Instant::now();
        let err = d.suspend("vol1").await.unwrap_err();
        assert!(err.0.contains("timeout"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}

//! LVM thin backend (docs/snapshot.md, "Backends and barrier"): snapshots are inactive thin LVs
//! `VG/miroir-<snap>` with activation skip, so cutting never suspends a device (#276/#277). LVM
//! commands are serialised node-wide.

use futures::future::BoxFuture;
use tokio::sync::Mutex;

use super::{Backend, BackendError, Result};
use crate::snapshot::agent::cmd::{Runner, argv};
use crate::snapshot::types::BackendKind;

/// One lvm command at a time on this node (UPSTREAM, #276/#277).
static LVM: Mutex<()> = Mutex::const_new(());

/// `miroir-` avoids LVM's reserved `snapshot*` names.
pub fn snapshot_lv(snap: &str) -> String {
    format!("miroir-{snap}")
}

pub fn sync_argv(vg: &str, volume: &str) -> Vec<String> {
    argv([
        "blockdev".to_string(),
        "--flushbufs".into(),
        format!("/dev/{vg}/{volume}"),
    ])
}

pub fn cut_argv(vg: &str, volume: &str, snap: &str) -> Vec<String> {
    argv([
        "lvcreate".to_string(),
        "--snapshot".into(),
        "--name".into(),
        snapshot_lv(snap),
        "--setactivationskip".into(),
        "y".into(),
        "--activate".into(),
        "n".into(),
        format!("{vg}/{volume}"),
    ])
}

pub fn exists_argv(vg: &str, snap: &str) -> Vec<String> {
    argv([
        "lvs".to_string(),
        "--noheadings".into(),
        "-o".into(),
        "lv_name".into(),
        format!("{vg}/{}", snapshot_lv(snap)),
    ])
}

pub fn delete_argv(vg: &str, snap: &str) -> Vec<String> {
    argv([
        "lvremove".to_string(),
        "--yes".into(),
        format!("{vg}/{}", snapshot_lv(snap)),
    ])
}

pub fn restore_argvs(vg: &str, snap: &str, new_volume: &str) -> [Vec<String>; 2] {
    [
        argv([
            "lvcreate".to_string(),
            "--snapshot".into(),
            "--name".into(),
            new_volume.into(),
            format!("{vg}/{}", snapshot_lv(snap)),
        ]),
        argv([
            "lvchange".to_string(),
            "-ay".into(),
            "--ignoreactivationskip".into(),
            format!("{vg}/{new_volume}"),
        ]),
    ]
}

fn not_found(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("failed to find") || t.contains("not found")
}

fn already_exists(text: &str) -> bool {
    text.to_ascii_lowercase().contains("already exists")
}

pub struct LvmThin {
    pool: String,
    vg: String,
    runner: Runner,
}

impl LvmThin {
    pub fn new(pool: impl Into<String>, vg: impl Into<String>, runner: Runner) -> Self {
        LvmThin {
            pool: pool.into(),
            vg: vg.into(),
            runner,
        }
    }

    fn failed(&self, text: String) -> BackendError {
        BackendError::Failed(format!("pool {}: {text}", self.pool))
    }

    async fn exists_locked(&self, snap: &str) -> Result<bool> {
        let out = self.runner.output(&exists_argv(&self.vg, snap)).await?;
        if out.success() {
            Ok(true)
        } else if not_found(&out.text()) {
            Ok(false)
        } else {
            Err(self.failed(out.text()))
        }
    }
}

impl Backend for LvmThin {
    fn kind(&self) -> BackendKind {
        BackendKind::Lvmthin
    }

    fn probe(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let _g = LVM.lock().await;
            self.runner
                .run(&argv([
                    "vgs".to_string(),
                    "--noheadings".into(),
                    self.vg.clone(),
                ]))
                .await
                .map_err(|e| self.failed(e.to_string()))?;
            Ok(())
        })
    }

    fn sync<'a>(&'a self, volume: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.runner
                .run(&sync_argv(&self.vg, volume))
                .await
                .map_err(|e| self.failed(e.to_string()))?;
            Ok(())
        })
    }

    fn cut<'a>(&'a self, volume: &'a str, snap: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let _g = LVM.lock().await;
            let out = self
                .runner
                .output(&cut_argv(&self.vg, volume, snap))
                .await?;
            if out.success() || already_exists(&out.text()) {
                Ok(())
            } else {
                Err(self.failed(out.text()))
            }
        })
    }

    fn delete<'a>(&'a self, snap: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let _g = LVM.lock().await;
            if !self.exists_locked(snap).await? {
                return Ok(());
            }
            let out = self.runner.output(&delete_argv(&self.vg, snap)).await?;
            if out.success() || not_found(&out.text()) {
                Ok(())
            } else {
                // An LV that will not go away is in use: retry later.
                Err(BackendError::Busy(format!(
                    "pool {}: {}",
                    self.pool,
                    out.text()
                )))
            }
        })
    }

    fn restore<'a>(
        &'a self,
        _source_volume: &'a str,
        snap: &'a str,
        new_volume: &'a str,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let _g = LVM.lock().await;
            let [create, activate] = restore_argvs(&self.vg, snap, new_volume);
            let out = self.runner.output(&create).await?;
            if !(out.success() || already_exists(&out.text())) {
                return Err(self.failed(out.text()));
            }
            self.runner
                .run(&activate)
                .await
                .map_err(|e| self.failed(e.to_string()))?;
            Ok(())
        })
    }

    fn exists<'a>(&'a self, snap: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let _g = LVM.lock().await;
            self.exists_locked(snap).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::agent::cmd::testing::FakeBin;
    use std::time::Duration;

    #[test]
    fn exact_argument_vectors() {
        assert_eq!(
            sync_argv("vg0", "pvc-1"),
            ["blockdev", "--flushbufs", "/dev/vg0/pvc-1"]
        );
        assert_eq!(
            cut_argv("vg0", "pvc-1", "snap-1"),
            [
                "lvcreate",
                "--snapshot",
                "--name",
                "miroir-snap-1",
                "--setactivationskip",
                "y",
                "--activate",
                "n",
                "vg0/pvc-1"
            ]
        );
        assert_eq!(
            delete_argv("vg0", "snap-1"),
            ["lvremove", "--yes", "vg0/miroir-snap-1"]
        );
        assert_eq!(
            exists_argv("vg0", "snap-1"),
            ["lvs", "--noheadings", "-o", "lv_name", "vg0/miroir-snap-1"]
        );
        let [c, a] = restore_argvs("vg0", "snap-1", "pvc-2");
        assert_eq!(
            c,
            [
                "lvcreate",
                "--snapshot",
                "--name",
                "pvc-2",
                "vg0/miroir-snap-1"
            ]
        );
        assert_eq!(
            a,
            ["lvchange", "-ay", "--ignoreactivationskip", "vg0/pvc-2"]
        );
    }

    fn fake() -> FakeBin {
        let bin = FakeBin::new();
        bin.script("blockdev", "exit 0")
            .script("lvcreate", "exit 0")
            .script("lvchange", "exit 0");
        bin
    }

    #[tokio::test]
    async fn cut_and_restore_run_the_commands_in_order() {
        let bin = fake();
        let b = LvmThin::new("thin", "vg0", bin.runner(Duration::from_secs(5)));
        b.sync("pvc-1").await.unwrap();
        b.cut("pvc-1", "snap-1").await.unwrap();
        b.restore("pvc-1", "snap-1", "pvc-2").await.unwrap();
        assert_eq!(
            bin.calls(),
            [
                "blockdev --flushbufs /dev/vg0/pvc-1",
                "lvcreate --snapshot --name miroir-snap-1 --setactivationskip y --activate n vg0/pvc-1",
                "lvcreate --snapshot --name pvc-2 vg0/miroir-snap-1",
                "lvchange -ay --ignoreactivationskip vg0/pvc-2",
            ]
        );
    }

    #[tokio::test]
    async fn existing_snapshot_counts_as_cut() {
        let bin = FakeBin::new();
        bin.script(
            "lvcreate",
            "echo '  Logical Volume \"miroir-snap-1\" already exists in volume group \"vg0\"' >&2; exit 5",
        );
        let b = LvmThin::new("thin", "vg0", bin.runner(Duration::from_secs(5)));
        b.cut("pvc-1", "snap-1").await.unwrap();
    }

    #[tokio::test]
    async fn failed_cut_carries_the_command_output() {
        let bin = FakeBin::new();
        bin.script("lvcreate", "echo '  Insufficient free space' >&2; exit 5");
        let b = LvmThin::new("thin", "vg0", bin.runner(Duration::from_secs(5)));
        assert_eq!(
            b.cut("pvc-1", "snap-1").await.unwrap_err(),
            BackendError::Failed("pool thin: Insufficient free space".into())
        );
    }

    #[tokio::test]
    async fn delete_missing_is_success_and_failure_is_busy() {
        let bin = FakeBin::new();
        bin.script(
            "lvs",
            "echo '  Failed to find logical volume \"vg0/miroir-snap-1\"' >&2; exit 5",
        );
        let b = LvmThin::new("thin", "vg0", bin.runner(Duration::from_secs(5)));
        b.delete("snap-1").await.unwrap();
        assert!(!b.exists("snap-1").await.unwrap());
        assert_eq!(
            bin.calls(),
            ["lvs --noheadings -o lv_name vg0/miroir-snap-1"; 2]
        );

        let bin = FakeBin::new();
        bin.script("lvs", "echo miroir-snap-1").script(
            "lvremove",
            "echo '  Logical volume vg0/miroir-snap-1 in use.' >&2; exit 5",
        );
        let b = LvmThin::new("thin", "vg0", bin.runner(Duration::from_secs(5)));
        assert_eq!(
            b.delete("snap-1").await.unwrap_err(),
            BackendError::Busy("pool thin: Logical volume vg0/miroir-snap-1 in use.".into())
        );
        assert_eq!(
            bin.calls().last().unwrap(),
            "lvremove --yes vg0/miroir-snap-1"
        );
    }

    #[tokio::test]
    async fn hanging_lvcreate_is_killed_at_the_backend_timeout() {
        let bin = FakeBin::new();
        bin.script("lvcreate", "exec sleep 30");
        let b = LvmThin::new("thin", "vg0", bin.runner(Duration::from_millis(300)));
        let start = std::time::Instant::now();
        let err = b.cut("pvc-1", "snap-1").await.unwrap_err();
        assert!(err.to_string().contains("timeout"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}

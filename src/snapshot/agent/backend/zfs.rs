//! ZFS backend (docs/snapshot.md, "Backends and barrier"): volumes are zvols `DS/<vol>`, snapshots
//! `DS/<vol>@<snap>`. Deletion searches every dataset under DS for `@<snap>`, because promoting a
//! clone can move a snapshot to another dataset.

use std::path::PathBuf;
use std::time::Duration;

use futures::future::BoxFuture;

use super::{Backend, BackendError, Result};
use crate::snapshot::agent::cmd::{Runner, argv};
use crate::snapshot::types::BackendKind;

pub fn zvol_device(dev_root: &str, dataset: &str, volume: &str) -> String {
    format!("{dev_root}/zvol/{dataset}/{volume}")
}

/// The zpool a dataset lives in.
pub fn zpool_of(dataset: &str) -> &str {
    dataset.split('/').next().unwrap_or(dataset)
}

pub fn sync_argvs(dataset: &str, volume: &str) -> [Vec<String>; 2] {
    [
        argv([
            "blockdev".to_string(),
            "--flushbufs".into(),
            zvol_device("/dev", dataset, volume),
        ]),
        argv(["zpool", "sync", zpool_of(dataset)]),
    ]
}

pub fn cut_argv(dataset: &str, volume: &str, snap: &str) -> Vec<String> {
    argv([
        "zfs".to_string(),
        "snapshot".into(),
        format!("{dataset}/{volume}@{snap}"),
    ])
}

pub fn list_argv(dataset: &str) -> Vec<String> {
    argv([
        "zfs", "list", "-H", "-o", "name", "-t", "snapshot", "-r", dataset,
    ])
}

pub fn destroy_argv(full_name: &str) -> Vec<String> {
    argv(["zfs", "destroy", "-d", full_name])
}

pub fn clone_argv(dataset: &str, source_volume: &str, snap: &str, new_volume: &str) -> Vec<String> {
    argv([
        "zfs".to_string(),
        "clone".into(),
        format!("{dataset}/{source_volume}@{snap}"),
        format!("{dataset}/{new_volume}"),
    ])
}

/// Snapshot names in `zfs list` output that carry `@<snap>`, in any dataset.
pub fn matching_snapshots(list_output: &str, snap: &str) -> Vec<String> {
    list_output
        .lines()
        .map(str::trim)
        .filter(|l| l.rsplit_once('@').is_some_and(|(_, s)| s == snap))
        .map(str::to_string)
        .collect()
}

pub struct Zfs {
    pool: String,
    dataset: String,
    runner: Runner,
    /// Where device nodes appear (`/dev`); tests point it at a temporary directory.
    dev_root: PathBuf,
}

impl Zfs {
    pub fn new(pool: impl Into<String>, dataset: impl Into<String>, runner: Runner) -> Self {
        Zfs {
            pool: pool.into(),
            dataset: dataset.into(),
            runner,
            dev_root: PathBuf::from("/dev"),
        }
    }

    #[cfg(test)]
    fn with_dev_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.dev_root = root.into();
        self
    }

    fn failed(&self, text: impl std::fmt::Display) -> BackendError {
        BackendError::Failed(format!("pool {}: {text}", self.pool))
    }

    async fn find(&self, snap: &str) -> Result<Vec<String>> {
        let out = self
            .runner
            .run(&list_argv(&self.dataset))
            .await
            .map_err(|e| self.failed(e))?;
        Ok(matching_snapshots(&out.stdout, snap))
    }
}

impl Backend for Zfs {
    fn kind(&self) -> BackendKind {
        BackendKind::Zfs
    }

    fn probe(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            self.runner
                .run(&argv(["zfs", "list", "-H", "-o", "name", &self.dataset]))
                .await
                .map_err(|e| self.failed(e))?;
            Ok(())
        })
    }

    fn sync<'a>(&'a self, volume: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            for a in sync_argvs(&self.dataset, volume) {
                self.runner.run(&a).await.map_err(|e| self.failed(e))?;
            }
            Ok(())
        })
    }

    fn cut<'a>(&'a self, volume: &'a str, snap: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let out = self
                .runner
                .output(&cut_argv(&self.dataset, volume, snap))
                .await?;
            if out.success() || out.text().contains("dataset already exists") {
                Ok(())
            } else {
                Err(self.failed(out.text()))
            }
        })
    }

    fn delete<'a>(&'a self, snap: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            for name in self.find(snap).await? {
                let out = self.runner.output(&destroy_argv(&name)).await?;
                if out.success() || out.text().contains("could not find any snapshots") {
                    continue;
                }
                if out.text().contains("busy") {
                    return Err(BackendError::Busy(format!(
                        "pool {}: {}",
                        self.pool,
                        out.text()
                    )));
                }
                return Err(self.failed(out.text()));
            }
            Ok(())
        })
    }

    fn restore<'a>(
        &'a self,
        source_volume: &'a str,
        snap: &'a str,
        new_volume: &'a str,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let out = self
                .runner
                .output(&clone_argv(&self.dataset, source_volume, snap, new_volume))
                .await?;
            if !(out.success() || out.text().contains("dataset already exists")) {
                return Err(self.failed(out.text()));
            }
            // udev creates the zvol's device node asynchronously.
            let dev = PathBuf::from(zvol_device(
                &self.dev_root.to_string_lossy(),
                &self.dataset,
                new_volume,
            ));
            let waited = tokio::time::timeout(self.runner.timeout, async {
                while !dev.exists() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
            waited.map_err(|_| self.failed(format!("{} did not appear", dev.display())))
        })
    }

    fn exists<'a>(&'a self, snap: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move { Ok(!self.find(snap).await?.is_empty()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::agent::cmd::testing::FakeBin;

    #[test]
    fn exact_argument_vectors() {
        let [flush, sync] = sync_argvs("tank/miroir", "pvc-1");
        assert_eq!(
            flush,
            ["blockdev", "--flushbufs", "/dev/zvol/tank/miroir/pvc-1"]
        );
        assert_eq!(sync, ["zpool", "sync", "tank"]);
        assert_eq!(
            cut_argv("tank/miroir", "pvc-1", "snap-1"),
            ["zfs", "snapshot", "tank/miroir/pvc-1@snap-1"]
        );
        assert_eq!(
            list_argv("tank/miroir"),
            [
                "zfs",
                "list",
                "-H",
                "-o",
                "name",
                "-t",
                "snapshot",
                "-r",
                "tank/miroir"
            ]
        );
        assert_eq!(
            destroy_argv("tank/miroir/pvc-1@snap-1"),
            ["zfs", "destroy", "-d", "tank/miroir/pvc-1@snap-1"]
        );
        assert_eq!(
            clone_argv("tank/miroir", "pvc-1", "snap-1", "pvc-2"),
            [
                "zfs",
                "clone",
                "tank/miroir/pvc-1@snap-1",
                "tank/miroir/pvc-2"
            ]
        );
    }

    #[test]
    fn snapshot_search_matches_the_exact_name_in_any_dataset() {
        let out = "tank/miroir/pvc-1@snap-1\ntank/miroir/pvc-9@snap-1\ntank/miroir/pvc-1@snap-10\ntank/miroir/pvc-2@other\n";
        assert_eq!(
            matching_snapshots(out, "snap-1"),
            ["tank/miroir/pvc-1@snap-1", "tank/miroir/pvc-9@snap-1"]
        );
        assert!(matching_snapshots("", "snap-1").is_empty());
    }

    #[tokio::test]
    async fn sync_cut_and_delete_across_datasets() {
        let bin = FakeBin::new();
        bin.script("blockdev", "exit 0")
            .script("zpool", "exit 0")
            .script(
                "zfs",
                r#"case "$1" in
  list) printf 'tank/m/pvc-1@snap-1\ntank/m/pvc-7@snap-1\ntank/m/pvc-1@keep\n' ;;
  *) exit 0 ;;
esac"#,
            );
        let z = Zfs::new("fast", "tank/m", bin.runner(Duration::from_secs(5)));
        z.sync("pvc-1").await.unwrap();
        z.cut("pvc-1", "snap-1").await.unwrap();
        z.delete("snap-1").await.unwrap();
        assert_eq!(
            bin.calls(),
            [
                "blockdev --flushbufs /dev/zvol/tank/m/pvc-1",
                "zpool sync tank",
                "zfs snapshot tank/m/pvc-1@snap-1",
                "zfs list -H -o name -t snapshot -r tank/m",
                "zfs destroy -d tank/m/pvc-1@snap-1",
                "zfs destroy -d tank/m/pvc-7@snap-1",
            ]
        );
    }

    #[tokio::test]
    async fn busy_destroy_maps_to_busy_and_missing_is_success() {
        let bin = FakeBin::new();
        bin.script(
            "zfs",
            r#"case "$1" in
  list) echo 'tank/m/pvc-1@snap-1' ;;
  destroy) echo "cannot destroy 'tank/m/pvc-1@snap-1': dataset is busy" >&2; exit 1 ;;
esac"#,
        );
        let z = Zfs::new("fast", "tank/m", bin.runner(Duration::from_secs(5)));
        assert_eq!(
            z.delete("snap-1").await.unwrap_err(),
            BackendError::Busy(
                "pool fast: cannot destroy 'tank/m/pvc-1@snap-1': dataset is busy".into()
            )
        );
        assert!(z.exists("snap-1").await.unwrap());
        assert!(!z.exists("snap-2").await.unwrap());
        // Nothing listed: nothing to destroy.
        z.delete("snap-2").await.unwrap();
        assert_eq!(
            bin.calls().last().unwrap(),
            "zfs list -H -o name -t snapshot -r tank/m"
        );
    }

    #[tokio::test]
    async fn restore_clones_and_waits_for_the_device() {
        let bin = FakeBin::new();
        let dev = tempfile::tempdir().unwrap();
        let node = dev.path().join("zvol/tank/m/pvc-2");
        bin.script(
            "zfs",
            &format!(
                "mkdir -p '{}'; touch '{}'",
                node.parent().unwrap().display(),
                node.display()
            ),
        );
        let z = Zfs::new("fast", "tank/m", bin.runner(Duration::from_secs(5)))
            .with_dev_root(dev.path());
        z.restore("pvc-1", "snap-1", "pvc-2").await.unwrap();
        assert_eq!(bin.calls(), ["zfs clone tank/m/pvc-1@snap-1 tank/m/pvc-2"]);

        // A device that never appears fails at the timeout.
        let bin = FakeBin::new();
        bin.script("zfs", "exit 0");
        let z = Zfs::new("fast", "tank/m", bin.runner(Duration::from_millis(300)))
            .with_dev_root(dev.path());
        let err = z.restore("pvc-1", "snap-1", "pvc-3").await.unwrap_err();
        assert!(err.to_string().contains("did not appear"), "{err}");
    }

    #[tokio::test]
    async fn hanging_zfs_is_killed_at_the_timeout() {
        let bin = FakeBin::new();
        bin.script("zfs", "exec sleep 30");
        let z = Zfs::new("fast", "tank/m", bin.runner(Duration::from_millis(300)));
        let start = std::time::Instant::now();
        assert!(z.cut("pvc-1", "snap-1").await.is_err());
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}

//! Loopfile backend: volumes are files `BASE/volumes/<vol>.img`, snapshots are reflinks
//! `BASE/snapshots/<snap>.img` (docs/snapshot.md, "Backends and barrier"). With
//! `--loopfile-full-copy`, a sparse-aware full copy replaces the reflink where the filesystem has
//! none.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;

use super::{Backend, BackendError, Result};
use crate::snapshot::types::BackendKind;

/// Reflink support as found by the probe: unknown, yes, no.
const UNKNOWN: u8 = 0;
const YES: u8 = 1;
const NO: u8 = 2;

pub struct Loopfile {
    pool: String,
    base: PathBuf,
    full_copy: bool,
    timeout: Duration,
    reflink: AtomicU8,
    /// Tests only: behave as on a filesystem without reflink, so the refusal and full-copy
    /// paths run on any test machine.
    try_reflink: bool,
}

impl Loopfile {
    pub fn new(
        pool: impl Into<String>,
        base: impl Into<PathBuf>,
        full_copy: bool,
        timeout: Duration,
    ) -> Self {
        Loopfile {
            pool: pool.into(),
            base: base.into(),
            full_copy,
            timeout,
            reflink: AtomicU8::new(UNKNOWN),
            try_reflink: true,
        }
    }

    #[cfg(test)]
    fn without_reflink(mut self) -> Self {
        self.try_reflink = false;
        self
    }

    pub fn volume_path(&self, volume: &str) -> PathBuf {
        self.base.join("volumes").join(format!("{volume}.img"))
    }

    pub fn snapshot_path(&self, snap: &str) -> PathBuf {
        self.base.join("snapshots").join(format!("{snap}.img"))
    }

    fn tmp_of(p: &Path) -> PathBuf {
        let mut s = p.as_os_str().to_owned();
        s.push(".tmp");
        PathBuf::from(s)
    }

    /// What the probe found: Some(true) reflink works, Some(false) it does not, None not probed.
    pub fn reflink_supported(&self) -> Option<bool> {
        match self.reflink.load(Ordering::Relaxed) {
            YES => Some(true),
            NO => Some(false),
            _ => None,
        }
    }

    fn no_reflink_message(&self) -> String {
        format!(
            "pool {}: the filesystem under {} does not support reflink (XFS with reflink=1, or btrfs); set --loopfile-full-copy to allow full copies",
            self.pool,
            self.base.display()
        )
    }

    /// Runs blocking file work off the runtime, bounded by the backend timeout.
    async fn blocking<T, F>(&self, what: &str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T> + Send + 'static,
    {
        match tokio::time::timeout(self.timeout, tokio::task::spawn_blocking(f)).await {
            Err(_) => Err(BackendError::Failed(format!(
                "pool {}: {what} did not finish within {}s",
                self.pool,
                self.timeout.as_secs()
            ))),
            Ok(Err(e)) => Err(BackendError::Failed(format!(
                "pool {}: {what}: {e}",
                self.pool
            ))),
            Ok(Ok(r)) => r,
        }
    }

    /// Copies `src` to `dst` through `dst.tmp`: reflink, else (when allowed) a sparse full copy;
    /// fsync, rename, fsync the directory. A stale tmp from an interrupted copy is replaced.
    fn copy_plan(&self) -> CopyPlan {
        CopyPlan {
            try_reflink: self.try_reflink,
            full_copy: self.full_copy,
            no_reflink: self.no_reflink_message(),
        }
    }
}

struct CopyPlan {
    try_reflink: bool,
    full_copy: bool,
    no_reflink: String,
}

impl CopyPlan {
    fn copy(&self, src: &Path, dst: &Path) -> Result<bool> {
        let failed = |what: &str, p: &Path, e: io::Error| {
            BackendError::Failed(format!("{what} {}: {e}", p.display()))
        };
        let tmp = Loopfile::tmp_of(dst);
        let dir = dst.parent().unwrap_or(Path::new("/"));
        fs::create_dir_all(dir).map_err(|e| failed("create", dir, e))?;
        let from = File::open(src).map_err(|e| failed("open", src, e))?;
        let to = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| failed("create", &tmp, e))?;
        let attempt = if self.try_reflink {
            reflink(&from, &to)
        } else {
            Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
        };
        let reflinked = match attempt {
            Ok(()) => true,
            Err(e) if is_no_reflink(&e) => {
                if !self.full_copy {
                    drop(to);
                    let _ = fs::remove_file(&tmp);
                    return Err(BackendError::Unsupported(self.no_reflink.clone()));
                }
                sparse_copy(&from, &to).map_err(|e| failed("copy to", &tmp, e))?;
                false
            }
            Err(e) => return Err(failed("reflink to", &tmp, e)),
        };
        to.sync_all().map_err(|e| failed("fsync", &tmp, e))?;
        drop(to);
        fs::rename(&tmp, dst).map_err(|e| failed("rename", &tmp, e))?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(reflinked)
    }
}

/// `FICLONE`: make `to` share `from`'s extents.
fn reflink(from: &File, to: &File) -> io::Result<()> {
    // SAFETY: both descriptors are open for the duration of the call; FICLONE takes the source
    // descriptor as its integer argument.
    let rc = unsafe { libc::ioctl(to.as_raw_fd(), libc::FICLONE, from.as_raw_fd()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn is_no_reflink(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::ENOTTY | libc::EXDEV | libc::EINVAL | libc::ENOSYS)
    )
}

const CHUNK: usize = 1 << 20;

/// Copies the data extents of `from` into `to`, leaving holes where `from` has holes or all-zero
/// chunks, so a sparse volume stays sparse and the copy stays byte-identical.
pub fn sparse_copy(from: &File, to: &File) -> io::Result<()> {
    let len = from.metadata()?.len();
    to.set_len(0)?;
    let fd = from.as_raw_fd();
    let mut buf = vec![0u8; CHUNK];
    let mut pos: u64 = 0;
    while pos < len {
        let Some((start, end)) = data_extent(fd, pos, len) else {
            break;
        };
        let mut off = start;
        while off < end {
            let n = ((end - off) as usize).min(CHUNK);
            from.read_exact_at(&mut buf[..n], off)?;
            if buf[..n].iter().any(|b| *b != 0) {
                to.write_all_at(&buf[..n], off)?;
            }
            off += n as u64;
        }
        pos = end;
    }
    to.set_len(len)
}

/// The next data extent at or after `pos`: [start, end). None when only holes remain. Falls
/// back to "everything is data" where SEEK_DATA is unsupported.
fn data_extent(fd: libc::c_int, pos: u64, len: u64) -> Option<(u64, u64)> {
    // SAFETY: lseek on a valid descriptor has no memory effects; the offset is restored by the
    // positional reads that follow (read_at ignores the file offset).
    let start = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
    if start < 0 {
        let err = io::Error::last_os_error();
        return if err.raw_os_error() == Some(libc::ENXIO) {
            None
        } else {
            Some((pos, len))
        };
    }
    // SAFETY: as above.
    let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
    let end = if end < 0 { len } else { (end as u64).min(len) };
    Some((start as u64, end))
}

fn remove_if_present(p: &Path) -> Result<()> {
    match fs::remove_file(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(BackendError::Failed(format!("remove {}: {e}", p.display()))),
    }
}

impl Backend for Loopfile {
    fn kind(&self) -> BackendKind {
        BackendKind::Loopfile
    }

    fn probe(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let base = self.base.clone();
            let try_reflink = self.try_reflink;
            let ok = self
                .blocking("probe", move || {
                    let fail = |e: io::Error| {
                        BackendError::Failed(format!("probe {}: {e}", base.display()))
                    };
                    fs::create_dir_all(base.join("volumes")).map_err(fail)?;
                    fs::create_dir_all(base.join("snapshots")).map_err(fail)?;
                    let a = base.join(format!(".ucm-probe-{}-a", std::process::id()));
                    let b = base.join(format!(".ucm-probe-{}-b", std::process::id()));
                    let res = (|| -> io::Result<bool> {
                        fs::write(&a, b"probe")?;
                        let from = File::open(&a)?;
                        let to = OpenOptions::new()
                            .write(true)
                            .create(true)
                            .truncate(true)
                            .open(&b)?;
                        if !try_reflink {
                            return Ok(false);
                        }
                        match reflink(&from, &to) {
                            Ok(()) => Ok(true),
                            Err(e) if is_no_reflink(&e) => Ok(false),
                            Err(e) => Err(e),
                        }
                    })();
                    let _ = fs::remove_file(&a);
                    let _ = fs::remove_file(&b);
                    res.map_err(fail)
                })
                .await?;
            self.reflink
                .store(if ok { YES } else { NO }, Ordering::Relaxed);
            Ok(())
        })
    }

    fn sync<'a>(&'a self, volume: &'a str) -> BoxFuture<'a, Result<()>> {
        let p = self.volume_path(volume);
        Box::pin(self.blocking("fsync", move || {
            let f = File::open(&p)
                .map_err(|e| BackendError::Failed(format!("open {}: {e}", p.display())))?;
            f.sync_all()
                .map_err(|e| BackendError::Failed(format!("fsync {}: {e}", p.display())))
        }))
    }

    fn cut<'a>(&'a self, volume: &'a str, snap: &'a str) -> BoxFuture<'a, Result<()>> {
        let src = self.volume_path(volume);
        let dst = self.snapshot_path(snap);
        let plan = self.copy_plan();
        Box::pin(async move {
            // Idempotent: an existing snapshot of this name counts as success (I9 of
            // docs/snapshot.md, "Invariants", is the agent's delete-then-cut).
            if dst.exists() {
                return Ok(());
            }
            let reflinked = self.blocking("cut", move || plan.copy(&src, &dst)).await?;
            if !reflinked {
                self.reflink.store(NO, Ordering::Relaxed);
            }
            Ok(())
        })
    }

    fn delete<'a>(&'a self, snap: &'a str) -> BoxFuture<'a, Result<()>> {
        let p = self.snapshot_path(snap);
        Box::pin(self.blocking("delete", move || {
            remove_if_present(&p)?;
            remove_if_present(&Loopfile::tmp_of(&p))
        }))
    }

    fn restore<'a>(
        &'a self,
        _source_volume: &'a str,
        snap: &'a str,
        new_volume: &'a str,
    ) -> BoxFuture<'a, Result<()>> {
        let src = self.snapshot_path(snap);
        let dst = self.volume_path(new_volume);
        let plan = self.copy_plan();
        Box::pin(async move {
            if dst.exists() {
                return Ok(());
            }
            self.blocking("restore", move || plan.copy(&src, &dst).map(|_| ()))
                .await
        })
    }

    fn exists<'a>(&'a self, snap: &'a str) -> BoxFuture<'a, Result<bool>> {
        let p = self.snapshot_path(snap);
        Box::pin(async move { Ok(p.exists()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    const T: Duration = Duration::from_secs(30);

    /// A 64 MiB sparse volume with data at three places.
    fn make_volume(lf: &Loopfile, name: &str) -> Vec<u8> {
        let p = lf.volume_path(name);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        let f = File::create(&p).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(b"superblock", 0).unwrap();
        f.write_all_at(&[7u8; 8192], 10 << 20).unwrap();
        f.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        fs::read(&p).unwrap()
    }

    fn allocated(p: &Path) -> u64 {
        fs::metadata(p).unwrap().blocks() * 512
    }

    #[tokio::test]
    async fn full_copy_cut_is_byte_identical_and_sparse() {
        let dir = tempfile::tempdir().unwrap();
        let lf = Loopfile::new("default", dir.path(), true, T);
        lf.probe().await.unwrap();
        let data = make_volume(&lf, "pvc-1");
        lf.sync("pvc-1").await.unwrap();
        lf.cut("pvc-1", "snap-1").await.unwrap();
        let snap = lf.snapshot_path("snap-1");
        assert_eq!(fs::read(&snap).unwrap(), data);
        assert!(lf.exists("snap-1").await.unwrap());
        // Sparse: far less allocated than the 64 MiB virtual size.
        assert!(allocated(&snap) < 8 << 20, "allocated {}", allocated(&snap));
        assert!(!Loopfile::tmp_of(&snap).exists());
    }

    #[tokio::test]
    async fn delete_then_cut_replaces_an_old_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let lf = Loopfile::new("default", dir.path(), true, T);
        make_volume(&lf, "pvc-1");
        lf.cut("pvc-1", "snap-1").await.unwrap();
        // The volume changes; a cut over an existing snapshot keeps the old one (idempotent) ...
        let v = OpenOptions::new()
            .write(true)
            .open(lf.volume_path("pvc-1"))
            .unwrap();
        v.write_all_at(b"NEW", 0).unwrap();
        lf.cut("pvc-1", "snap-1").await.unwrap();
        assert_eq!(&fs::read(lf.snapshot_path("snap-1")).unwrap()[..3], b"sup");
        // ... which is why the agent deletes first.
        lf.delete("snap-1").await.unwrap();
        assert!(!lf.exists("snap-1").await.unwrap());
        lf.cut("pvc-1", "snap-1").await.unwrap();
        assert_eq!(&fs::read(lf.snapshot_path("snap-1")).unwrap()[..3], b"NEW");
        // Deleting a missing snapshot is success.
        lf.delete("snap-1").await.unwrap();
        lf.delete("snap-1").await.unwrap();
    }

    #[tokio::test]
    async fn interrupted_copy_leaves_no_tmp_after_retry() {
        let dir = tempfile::tempdir().unwrap();
        let lf = Loopfile::new("default", dir.path(), true, T);
        let data = make_volume(&lf, "pvc-1");
        let tmp = Loopfile::tmp_of(&lf.snapshot_path("snap-1"));
        fs::create_dir_all(tmp.parent().unwrap()).unwrap();
        fs::write(&tmp, b"half a copy").unwrap();
        lf.cut("pvc-1", "snap-1").await.unwrap();
        assert!(!tmp.exists());
        assert_eq!(fs::read(lf.snapshot_path("snap-1")).unwrap(), data);
        // delete also clears a stale tmp.
        fs::write(&tmp, b"half a copy").unwrap();
        lf.delete("snap-1").await.unwrap();
        assert!(!tmp.exists());
    }

    #[tokio::test]
    async fn restore_creates_an_identical_volume() {
        let dir = tempfile::tempdir().unwrap();
        let lf = Loopfile::new("default", dir.path(), true, T);
        let data = make_volume(&lf, "pvc-1");
        lf.cut("pvc-1", "snap-1").await.unwrap();
        lf.restore("pvc-1", "snap-1", "pvc-2").await.unwrap();
        assert_eq!(fs::read(lf.volume_path("pvc-2")).unwrap(), data);
        assert!(!Loopfile::tmp_of(&lf.volume_path("pvc-2")).exists());
    }

    #[tokio::test]
    async fn cut_of_a_missing_volume_fails_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let lf = Loopfile::new("default", dir.path(), true, T);
        let err = lf.cut("nope", "snap-1").await.unwrap_err();
        assert!(
            matches!(err, BackendError::Failed(ref m) if m.contains("nope.img")),
            "{err}"
        );
        assert!(lf.sync("nope").await.is_err());
    }

    #[tokio::test]
    async fn refuses_without_reflink_unless_full_copy_is_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let lf = Loopfile::new("default", dir.path(), false, T).without_reflink();
        lf.probe().await.unwrap();
        assert_eq!(lf.reflink_supported(), Some(false));
        let data = make_volume(&lf, "pvc-1");
        let want = BackendError::Unsupported(format!(
            "pool default: the filesystem under {} does not support reflink (XFS with reflink=1, or btrfs); set --loopfile-full-copy to allow full copies",
            dir.path().display()
        ));
        assert_eq!(lf.cut("pvc-1", "snap-1").await.unwrap_err(), want);
        assert!(!lf.exists("snap-1").await.unwrap());
        assert!(!Loopfile::tmp_of(&lf.snapshot_path("snap-1")).exists());

        // The same pool with the flag makes full copies.
        let lf = Loopfile::new("default", dir.path(), true, T).without_reflink();
        lf.cut("pvc-1", "snap-1").await.unwrap();
        assert_eq!(fs::read(lf.snapshot_path("snap-1")).unwrap(), data);
        let lf = Loopfile::new("default", dir.path(), false, T).without_reflink();
        assert_eq!(
            lf.restore("pvc-1", "snap-1", "pvc-2").await.unwrap_err(),
            want
        );
        assert!(!lf.volume_path("pvc-2").exists());
    }

    /// Reflink on a real reflink-capable filesystem: a loop-mounted btrfs or XFS image. Where the
    /// tools are missing or the kernel refuses the mount, this test reports a named exclusion
    /// in its output instead of passing silently.
    #[tokio::test]
    async fn reflink_on_a_loop_mounted_filesystem() {
        let Some(mnt) = reflink_mount::try_mount() else {
            return;
        };
        let lf = Loopfile::new("default", mnt.path(), false, T);
        lf.probe().await.unwrap();
        assert_eq!(
            lf.reflink_supported(),
            Some(true),
            "{} should support reflink",
            mnt.path().display()
        );
        let data = make_volume(&lf, "pvc-1");
        lf.cut("pvc-1", "snap-1").await.unwrap();
        assert_eq!(fs::read(lf.snapshot_path("snap-1")).unwrap(), data);
        lf.restore("pvc-1", "snap-1", "pvc-2").await.unwrap();
        assert_eq!(fs::read(lf.volume_path("pvc-2")).unwrap(), data);
        lf.delete("snap-1").await.unwrap();
        assert!(!lf.exists("snap-1").await.unwrap());
    }

    mod reflink_mount {
        use std::path::Path;
        use std::process::Command;

        const NAME: &str = "loopfile::reflink_on_a_loop_mounted_filesystem";

        pub struct Mounted {
            dir: tempfile::TempDir,
            mnt: std::path::PathBuf,
        }

        impl Mounted {
            pub fn path(&self) -> &Path {
                &self.mnt
            }
        }

        impl Drop for Mounted {
            fn drop(&mut self) {
                let _ = Command::new("umount").arg(&self.mnt).status();
                let _ = self.dir.path();
            }
        }

        fn excluded(why: &str) -> Option<Mounted> {
            eprintln!("EXCLUDED {NAME}: {why}");
            None
        }

        fn on_path(tool: &str) -> bool {
            Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {tool}"))
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        }

        pub fn try_mount() -> Option<Mounted> {
            // btrfs needs a smaller image than XFS (300 MiB minimum).
            let (mkfs, args, size): (&str, &[&str], u64) = if on_path("mkfs.btrfs") {
                ("mkfs.btrfs", &["-q", "-f"], 256 << 20)
            } else if on_path("mkfs.xfs") {
                ("mkfs.xfs", &["-q", "-f", "-m", "reflink=1"], 320 << 20)
            } else {
                return excluded("neither mkfs.btrfs nor mkfs.xfs is installed");
            };
            let dir = tempfile::tempdir().ok()?;
            let img = dir.path().join("fs.img");
            let mnt = dir.path().join("mnt");
            std::fs::create_dir(&mnt).ok()?;
            let f = std::fs::File::create(&img).ok()?;
            f.set_len(size).ok()?;
            drop(f);
            let ok = Command::new(mkfs).args(args).arg(&img).output();
            match ok {
                Ok(o) if o.status.success() => {}
                Ok(o) => {
                    return excluded(&format!(
                        "{mkfs} failed: {}",
                        String::from_utf8_lossy(&o.stderr).trim()
                    ));
                }
                Err(e) => return excluded(&format!("{mkfs} could not run: {e}")),
            }
            let m = Command::new("mount")
                .arg("-o")
                .arg("loop")
                .arg(&img)
                .arg(&mnt)
                .output();
            match m {
                Ok(o) if o.status.success() => Some(Mounted { dir, mnt }),
                Ok(o) => excluded(&format!(
                    "the kernel refused the loop mount: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Err(e) => excluded(&format!("mount could not run: {e}")),
            }
        }
    }
}

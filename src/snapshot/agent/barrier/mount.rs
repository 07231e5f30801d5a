//! Mount table lookup by device number and FIFREEZE/FITHAW, each bounded by a timeout.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{BarrierError, Result};

/// Decodes the octal escapes (`\040` for a space) the kernel uses in mountinfo paths.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The first mount point of device `major:minor` in `/proc/self/mountinfo` text. Bind mounts of
/// the same filesystem share one superblock, so any of them freezes it.
pub fn find_mountpoint(mountinfo: &str, major: u32, minor: u32) -> Option<PathBuf> {
    let want = format!("{major}:{minor}");
    mountinfo.lines().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() > 4 && f[2] == want).then(|| PathBuf::from(unescape(f[4])))
    })
}

/// Major and minor of a block device node.
pub fn device_number(dev: &Path) -> io::Result<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let rdev = std::fs::metadata(dev)?.rdev();
    Ok((libc::major(rdev), libc::minor(rdev)))
}

const FIFREEZE: libc::Ioctl = libc::_IOWR::<libc::c_int>(b'X' as u32, 119);
const FITHAW: libc::Ioctl = libc::_IOWR::<libc::c_int>(b'X' as u32, 120);

fn ioctl_on(mountpoint: &Path, req: libc::Ioctl) -> io::Result<()> {
    let f = File::open(mountpoint)?;
    // SAFETY: FIFREEZE/FITHAW take an int argument that the kernel ignores; the descriptor is
    // open for the duration of the call.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), req, 0 as libc::c_int) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Freezes the filesystem at `mountpoint`. "Already frozen" (EBUSY) is success. A freeze that
/// lands after the timeout is thawed at once (docs/snapshot.md, "Backends and barrier"), so it
/// can never outlive the caller.
pub async fn freeze(mountpoint: &Path, timeout: Duration) -> Result<()> {
    let mp = mountpoint.to_path_buf();
    let task = tokio::task::spawn_blocking(move || {
        let r = ioctl_on(&mp, FIFREEZE);
        (r, mp)
    });
    match tokio::time::timeout(timeout, task).await {
        Ok(Ok((Ok(()), _))) => Ok(()),
        Ok(Ok((Err(e), _))) if e.raw_os_error() == Some(libc::EBUSY) => Ok(()),
        Ok(Ok((Err(e), mp))) => Err(BarrierError(format!("freeze {}: {e}", mp.display()))),
        Ok(Err(e)) => Err(BarrierError(format!(
            "freeze {}: {e}",
            mountpoint.display()
        ))),
        Err(_) => {
            // The blocking call may still land: thaw as soon as it does.
            let mp = mountpoint.to_path_buf();
            tokio::task::spawn_blocking(move || {
                let _ = ioctl_on(&mp, FITHAW);
            });
            Err(BarrierError(format!(
                "freeze {} did not finish within {}s",
                mountpoint.display(),
                timeout.as_secs()
            )))
        }
    }
}

/// Thaws the filesystem at `mountpoint`. "Not frozen" (EINVAL) is success.
pub async fn thaw(mountpoint: &Path, timeout: Duration) -> Result<()> {
    let mp = mountpoint.to_path_buf();
    let task = tokio::task::spawn_blocking(move || ioctl_on(&mp, FITHAW));
    match tokio::time::timeout(timeout, task).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(e))) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        Ok(Ok(Err(e))) => Err(BarrierError(format!("thaw {}: {e}", mountpoint.display()))),
        Ok(Err(e)) => Err(BarrierError(format!("thaw {}: {e}", mountpoint.display()))),
        Err(_) => Err(BarrierError(format!(
            "thaw {} did not finish within {}s",
            mountpoint.display(),
            timeout.as_secs()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
35 22 147:1000 / /var/lib/kubelet/plugins/kubernetes.io/csi/miroir/abc/globalmount rw shared:30 - ext4 /dev/drbd1000 rw
36 22 147:1000 / /var/lib/kubelet/pods/uid/volumes/kubernetes.io~csi/pvc-1/mount rw shared:30 - ext4 /dev/drbd1000 rw
37 22 147:1001 / /mnt/with\\040space rw - xfs /dev/drbd1001 rw
";

    #[test]
    fn finds_the_first_mount_of_a_device() {
        assert_eq!(
            find_mountpoint(INFO, 147, 1000),
            Some(PathBuf::from(
                "/var/lib/kubelet/plugins/kubernetes.io/csi/miroir/abc/globalmount"
            ))
        );
        assert_eq!(
            find_mountpoint(INFO, 147, 1001),
            Some(PathBuf::from("/mnt/with space"))
        );
        assert_eq!(find_mountpoint(INFO, 147, 7), None);
        // 147:10 must not match 147:1000.
        assert_eq!(find_mountpoint(INFO, 147, 10), None);
    }

    #[test]
    fn device_numbers_of_real_nodes() {
        assert_eq!(device_number(Path::new("/dev/null")).unwrap(), (1, 3));
    }

    #[test]
    fn ioctl_numbers_match_the_kernel_abi() {
        // _IOWR('X', 119, int) and _IOWR('X', 120, int) on the generic ioctl layout.
        // The cast matters where `Ioctl` is `c_int` (musl).
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        #[allow(clippy::unnecessary_cast)]
        {
            assert_eq!(FIFREEZE as u64, 0xC004_5877);
            assert_eq!(FITHAW as u64, 0xC004_5878);
        }
    }

    #[tokio::test]
    async fn thaw_of_an_unfrozen_filesystem_is_success() {
        // EINVAL ("not frozen") counts as success; needs CAP_SYS_ADMIN, otherwise EPERM.
        let dir = tempfile::tempdir().unwrap();
        match thaw(dir.path(), Duration::from_secs(5)).await {
            Ok(()) => {}
            Err(e) if e.0.contains("Operation not permitted") => {
                eprintln!(
                    "EXCLUDED mount::thaw_of_an_unfrozen_filesystem_is_success: no CAP_SYS_ADMIN ({e})"
                );
            }
            Err(e) => panic!("{e}"),
        }
    }
}

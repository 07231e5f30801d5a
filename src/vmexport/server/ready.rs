//! Volume readability (docs/vmexport.md, "Export server"): a failure is logged and reported on
//! /exportready instead of exiting (upstream exits, which becomes a crash loop: #14490, #9742).
//! While a check fails, /exportready repeats it at most every 5 s so a fixed volume becomes ready.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::config::VolumeConfig;

pub const RECHECK: Duration = Duration::from_secs(5);

/// Why an image volume's `disk.img` is not served although it exists.
#[derive(Debug)]
pub struct Refused(&'static str);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Refused {}

/// Whether `e` is a [`Refused`] image: the caller answers 404, as for any path outside a volume.
pub fn is_refused(e: &std::io::Error) -> bool {
    e.get_ref().is_some_and(|r| r.is::<Refused>())
}

/// The file an image volume serves: the device node itself, or `disk.img` in the mount. The
/// volume's content is the user's, so a `disk.img` that leads outside the volume (a symlink to
/// the server's key or token, say) or is not a regular file (a FIFO would block the server) is
/// refused, like anything outside the root of the `dir` format.
pub fn image_file(v: &VolumeConfig) -> std::io::Result<PathBuf> {
    match fs::metadata(&v.path) {
        Ok(m) if m.is_dir() => {
            let root = v.path.canonicalize()?;
            let real = v.path.join("disk.img").canonicalize()?;
            if !real.starts_with(&root) {
                return Err(std::io::Error::other(Refused(
                    "disk.img leads outside the volume",
                )));
            }
            if !fs::metadata(&real)?.is_file() {
                return Err(std::io::Error::other(Refused(
                    "disk.img is not a regular file",
                )));
            }
            Ok(real)
        }
        _ => Ok(v.path.clone()),
    }
}

/// `Err` carries a message naming the volume and the error, never a secret path.
pub fn check_volume(v: &VolumeConfig) -> Result<(), String> {
    let fail = |what: &Path, e: std::io::Error| {
        let rel = what.strip_prefix(&v.path).unwrap_or(Path::new(""));
        let shown = if rel.as_os_str().is_empty() {
            String::new()
        } else {
            format!(" ({})", rel.display())
        };
        format!("volume {}{shown}: {e}", v.name)
    };
    if v.is_image() {
        let p = image_file(v).map_err(|e| fail(&v.path.join("disk.img"), e))?;
        File::open(&p).map(|_| ()).map_err(|e| fail(&p, e))
    } else {
        let entries = fs::read_dir(&v.path).map_err(|e| fail(&v.path, e))?;
        for e in entries {
            let e = e.map_err(|err| fail(&v.path, err))?;
            if e.file_name() == "lost+found" {
                continue;
            }
            let p = e.path();
            let md = fs::symlink_metadata(&p).map_err(|err| fail(&p, err))?;
            if md.is_dir() {
                fs::read_dir(&p).map(|_| ()).map_err(|err| fail(&p, err))?;
            } else if md.is_file() {
                File::open(&p).map(|_| ()).map_err(|err| fail(&p, err))?;
            }
        }
        Ok(())
    }
}

pub struct Readiness {
    volumes: Vec<VolumeConfig>,
    state: Mutex<(Instant, Vec<String>)>,
}

impl Readiness {
    pub fn new(volumes: Vec<VolumeConfig>) -> Self {
        let failures = Self::run(&volumes);
        Readiness {
            volumes,
            state: Mutex::new((Instant::now(), failures)),
        }
    }

    fn run(volumes: &[VolumeConfig]) -> Vec<String> {
        let failures: Vec<String> = volumes
            .iter()
            .filter_map(|v| check_volume(v).err())
            .collect();
        for f in &failures {
            tracing::error!(error = %f, "export volume is not readable");
        }
        failures
    }

    /// Current failures; re-checked when failing and the last check is older than 5 s.
    pub fn failures(&self) -> Vec<String> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !st.1.is_empty() && st.0.elapsed() >= RECHECK {
            st.1 = Self::run(&self.volumes);
            st.0 = Instant::now();
            if st.1.is_empty() {
                tracing::info!("all export volumes are readable now");
            }
        }
        st.1.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(path: &Path) -> VolumeConfig {
        VolumeConfig {
            index: 0,
            name: "v".into(),
            path: path.to_path_buf(),
            raw_uri: Some("/volumes/v/disk.img".into()),
            gzip_uri: None,
            archive_uri: None,
            dir_uri: None,
        }
    }

    #[test]
    fn disk_img_must_be_a_regular_file_inside_the_volume() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("key"), "secret").unwrap();
        let root = tempfile::tempdir().unwrap();
        let v = volume(root.path());
        // Missing: an ordinary error (not refused).
        let e = image_file(&v).unwrap_err();
        assert!(!is_refused(&e));
        // A symlink out of the volume is refused, and so is the readiness check.
        std::os::unix::fs::symlink(outside.path().join("key"), root.path().join("disk.img"))
            .unwrap();
        assert!(is_refused(&image_file(&v).unwrap_err()));
        let msg = check_volume(&v).unwrap_err();
        assert!(msg.contains("leads outside the volume"), "{msg}");
        assert!(!msg.contains(outside.path().to_str().unwrap()), "{msg}");
        // A directory is not an image.
        std::fs::remove_file(root.path().join("disk.img")).unwrap();
        std::fs::create_dir(root.path().join("disk.img")).unwrap();
        assert!(is_refused(&image_file(&v).unwrap_err()));
        // A symlink inside the volume is followed.
        std::fs::remove_dir(root.path().join("disk.img")).unwrap();
        std::fs::write(root.path().join("v2.img"), "img").unwrap();
        std::os::unix::fs::symlink("v2.img", root.path().join("disk.img")).unwrap();
        let p = image_file(&v).unwrap();
        assert_eq!(std::fs::read(p).unwrap(), b"img");
        // A device path (not a directory) is served as configured.
        let dev = volume(&root.path().join("v2.img"));
        assert_eq!(image_file(&dev).unwrap(), root.path().join("v2.img"));
    }
}

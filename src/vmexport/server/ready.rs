//! Volume readability (vmexport.md §13.1.3): a failure is logged and reported on /exportready
//! instead of exiting (upstream exits, which becomes a crash loop: #14490, #9742). While a check
//! fails, /exportready repeats it at most every 5 s so a fixed volume becomes ready.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::config::VolumeConfig;

pub const RECHECK: Duration = Duration::from_secs(5);

/// The file an image volume serves: the device node itself, or `disk.img` in the mount.
pub fn image_path(v: &VolumeConfig) -> PathBuf {
    match fs::metadata(&v.path) {
        Ok(m) if m.is_dir() => v.path.join("disk.img"),
        _ => v.path.clone(),
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
        let p = image_path(v);
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

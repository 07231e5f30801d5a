//! `ucm export-server` configuration: only the environment, as the pod sets it (docs/vmexport.md,
//! "Export pod" and "Export server"). Parsing is pure so the rules are unit-tested.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeConfig {
    pub index: usize,
    /// Mount path (a directory) or device node.
    pub path: PathBuf,
    /// The `<pvc>` segment of its URIs: used in logs, metrics-free messages and /exportready.
    pub name: String,
    pub raw_uri: Option<String>,
    pub gzip_uri: Option<String>,
    pub archive_uri: Option<String>,
    pub dir_uri: Option<String>,
}

impl VolumeConfig {
    /// Disk-image volumes serve `raw`/`gzip`; the others serve `dir`/`tar.gz`.
    pub fn is_image(&self) -> bool {
        self.raw_uri.is_some() || self.gzip_uri.is_some()
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub token_file: PathBuf,
    pub deadline: Option<jiff::Timestamp>,
    pub volumes: Vec<VolumeConfig>,
    pub vm_def_uri: Option<String>,
    pub secret_def_uri: Option<String>,
    /// `EXPORT_OCI_URI` (`/export.oci.tar`): the `oci` format is served (docs/vmexport.md, "OCI
    /// format"); the manager sets it only with `--export-oci`.
    pub oci_uri: Option<String>,
    pub export_name: Option<String>,
    pub manifest_data_dir: PathBuf,
    pub metrics_addr: Option<SocketAddr>,
    pub tls_min_version: Option<u16>,
    pub tls_cipher_suites: Option<Vec<u16>>,
    /// `IDLE_TIMEOUT_SECONDS`: a connection without a request in flight is closed after this.
    pub idle_timeout: Duration,
    /// `DRAIN_SECONDS`: after DEADLINE or SIGTERM, how long requests in flight may still run.
    pub drain: Duration,
}

/// Requests in flight at DEADLINE or SIGTERM get this long without `DRAIN_SECONDS` (OURS).
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(30);

/// `:8443` means every address of both families, as Go's listeners read it: `[::]:8443`, which
/// `bind_listener` opens dual-stack (IPv6-only and IPv4-only clusters both reach the Pod).
pub fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    let full = if s.starts_with(':') {
        format!("[::]{s}")
    } else {
        s.to_string()
    };
    full.parse()
        .map_err(|e| format!("invalid listen address {s:?}: {e}"))
}

fn volume_name(uri: &str) -> Option<String> {
    let rest = uri.strip_prefix("/volumes/")?;
    let (n, _) = rest.split_once('/')?;
    Some(n.to_string())
}

pub fn from_env(vars: impl IntoIterator<Item = (String, String)>) -> Result<Config, String> {
    let env: BTreeMap<String, String> = vars.into_iter().collect();
    let get = |k: &str| env.get(k).filter(|v| !v.is_empty()).cloned();
    let required = |k: &str| get(k).ok_or_else(|| format!("{k} must be set"));

    let mut indexes: Vec<usize> = env
        .keys()
        .filter_map(|k| {
            let (n, _) = k.strip_prefix("VOLUME")?.split_once('_')?;
            n.parse().ok()
        })
        .collect();
    indexes.sort_unstable();
    indexes.dedup();
    let mut volumes = Vec::new();
    for i in indexes {
        let v = |suffix: &str| get(&format!("VOLUME{i}_{suffix}"));
        let path = v("EXPORT_PATH").ok_or_else(|| format!("VOLUME{i}_EXPORT_PATH must be set"))?;
        let raw_uri = v("EXPORT_RAW_URI");
        let gzip_uri = v("EXPORT_RAW_GZIP_URI");
        let archive_uri = v("EXPORT_ARCHIVE_URI");
        let dir_uri = v("EXPORT_DIR_URI");
        let name = [&raw_uri, &gzip_uri, &archive_uri, &dir_uri]
            .into_iter()
            .flatten()
            .find_map(|u| volume_name(u))
            .ok_or_else(|| format!("VOLUME{i} has no /volumes/<name>/ URI"))?;
        volumes.push(VolumeConfig {
            index: i,
            path: path.into(),
            name,
            raw_uri,
            gzip_uri,
            archive_uri,
            dir_uri,
        });
    }

    let deadline = match get("DEADLINE") {
        None => None,
        Some(d) => Some(
            d.parse::<jiff::Timestamp>()
                .map_err(|e| format!("DEADLINE {d:?} is not an RFC 3339 time: {e}"))?,
        ),
    };
    let tls_min_version = match get("TLS_MIN_VERSION") {
        None => None,
        Some(v) => Some(
            v.parse::<u16>()
                .map_err(|_| format!("TLS_MIN_VERSION {v:?} is not a numeric TLS version ID"))?,
        ),
    };
    let tls_cipher_suites = match get("TLS_CIPHER_SUITES") {
        None => None,
        Some(v) => Some(serde_json::from_str::<Vec<u16>>(&v).map_err(|_| {
            format!("TLS_CIPHER_SUITES {v:?} is not a JSON array of cipher suite IDs")
        })?),
    };
    let seconds = |k: &str, default: Duration| -> Result<Duration, String> {
        match get(k) {
            None => Ok(default),
            Some(v) => v
                .parse::<u64>()
                .map(Duration::from_secs)
                .map_err(|_| format!("{k} {v:?} is not a whole number of seconds")),
        }
    };
    let idle_timeout = seconds("IDLE_TIMEOUT_SECONDS", super::conn::IDLE_TIMEOUT)?;
    if idle_timeout.is_zero() {
        return Err("IDLE_TIMEOUT_SECONDS must be positive".into());
    }
    let drain = seconds("DRAIN_SECONDS", DEFAULT_DRAIN)?;
    Ok(Config {
        listen: parse_addr(&get("LISTEN_ADDR").unwrap_or_else(|| ":8443".into()))?,
        cert_file: required("CERT_FILE")?.into(),
        key_file: required("KEY_FILE")?.into(),
        token_file: required("TOKEN_FILE")?.into(),
        deadline,
        volumes,
        vm_def_uri: get("EXPORT_VM_DEF_URI"),
        secret_def_uri: get("EXPORT_SECRET_DEF_URI"),
        oci_uri: get("EXPORT_OCI_URI"),
        export_name: get("EXPORT_NAME"),
        manifest_data_dir: get("MANIFEST_DATA_DIR")
            .unwrap_or_else(|| "/manifest_data".into())
            .into(),
        metrics_addr: get("METRICS_ADDR").map(|a| parse_addr(&a)).transpose()?,
        tls_min_version,
        tls_cipher_suites,
        idle_timeout,
        drain,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Vec<(String, String)> {
        [
            ("CERT_FILE", "/cert/tls.crt"),
            ("KEY_FILE", "/cert/tls.key"),
            ("TOKEN_FILE", "/token/token"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    fn with(extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut v = base();
        v.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        v
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(parse_addr(":8443").unwrap(), "[::]:8443".parse().unwrap());
        assert_eq!(
            parse_addr("127.0.0.1:9").unwrap(),
            "127.0.0.1:9".parse().unwrap()
        );
        assert_eq!(parse_addr("[::1]:9").unwrap(), "[::1]:9".parse().unwrap());
        assert!(parse_addr("8443").is_err() && parse_addr("host:1").is_err());
    }

    #[test]
    fn required_files() {
        for missing in ["CERT_FILE", "KEY_FILE", "TOKEN_FILE"] {
            let vars: Vec<_> = base().into_iter().filter(|(k, _)| k != missing).collect();
            assert!(from_env(vars).unwrap_err().contains(missing));
        }
        let c = from_env(base()).unwrap();
        assert_eq!(c.listen, "[::]:8443".parse().unwrap());
        assert_eq!(c.manifest_data_dir, PathBuf::from("/manifest_data"));
        assert_eq!(c.idle_timeout, Duration::from_secs(60));
        assert_eq!(c.drain, DEFAULT_DRAIN);
    }

    #[test]
    fn volumes_in_numeric_order() {
        let mut extra = Vec::new();
        let names: Vec<String> = (0..11).map(|i| format!("d{i}")).collect();
        let keys: Vec<(String, String, String, String)> = (0..11)
            .map(|i| {
                (
                    format!("VOLUME{i}_EXPORT_PATH"),
                    format!("/export-volumes/v{i}-d{i}"),
                    format!("VOLUME{i}_EXPORT_RAW_URI"),
                    format!("/volumes/d{i}/disk.img"),
                )
            })
            .collect();
        for (a, b, c, d) in &keys {
            extra.push((a.as_str(), b.as_str()));
            extra.push((c.as_str(), d.as_str()));
        }
        let c = from_env(with(&extra)).unwrap();
        let got: Vec<_> = c.volumes.iter().map(|v| v.name.clone()).collect();
        assert_eq!(got, names);
        assert!(c.volumes[0].is_image());
    }

    #[test]
    fn parses_optional_values() {
        let c = from_env(with(&[
            ("DEADLINE", "2026-01-01T02:00:00Z"),
            ("TLS_MIN_VERSION", "772"),
            ("TLS_CIPHER_SUITES", "[4865, 49199]"),
            ("METRICS_ADDR", ":8080"),
            ("LISTEN_ADDR", "127.0.0.1:9443"),
            ("VOLUME0_EXPORT_PATH", "/export-volumes/v0-files"),
            ("VOLUME0_EXPORT_DIR_URI", "/volumes/files/dir/"),
            ("VOLUME0_EXPORT_ARCHIVE_URI", "/volumes/files/disk.tar.gz"),
        ]))
        .unwrap();
        assert_eq!(c.deadline.unwrap().to_string(), "2026-01-01T02:00:00Z");
        assert_eq!(c.tls_min_version, Some(772));
        assert_eq!(c.tls_cipher_suites, Some(vec![4865, 49199]));
        assert_eq!(c.metrics_addr, Some("[::]:8080".parse().unwrap()));
        assert_eq!(c.listen, "127.0.0.1:9443".parse().unwrap());
        assert_eq!(c.volumes[0].name, "files");
        assert!(!c.volumes[0].is_image());
        assert!(from_env(with(&[("DEADLINE", "tomorrow")])).is_err());
        let c = from_env(with(&[
            ("IDLE_TIMEOUT_SECONDS", "5"),
            ("DRAIN_SECONDS", "86400"),
        ]))
        .unwrap();
        assert_eq!(c.idle_timeout, Duration::from_secs(5));
        assert_eq!(c.drain, Duration::from_secs(86400));
        assert!(from_env(with(&[("DRAIN_SECONDS", "1h")])).is_err());
        assert!(from_env(with(&[("IDLE_TIMEOUT_SECONDS", "0")])).is_err());
        assert!(from_env(with(&[("TLS_CIPHER_SUITES", "x")])).is_err());
    }
}

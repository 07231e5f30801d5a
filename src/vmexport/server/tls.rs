//! rustls server configuration (docs/vmexport.md, "Export server"): TLS 1.2 minimum unless
//! TLS_MIN_VERSION says 1.3; TLS_CIPHER_SUITES filters the TLS 1.2 suites (as in Go, TLS 1.3 suites
//! are not configurable); ALPN offers h2 and http/1.1.
//!
//! A certificate read from files is reloaded when the files change ([`CertFiles`]): the kubelet
//! updates a mounted Secret in place, new handshakes get the new certificate and connections
//! already open keep theirs, so a rotation never cuts a download.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// Go's `tls.VersionTLS13`.
const TLS13_ID: u16 = 0x0304;

/// How often the certificate files' metadata (inode, size, mtime) is compared with what was
/// loaded; a stat a second costs nothing, and files are read only when it changed.
pub const RELOAD_EVERY: Duration = Duration::from_secs(1);

/// The serving certificate read from `cert_file`/`key_file`, swapped in when they change.
#[derive(Debug)]
pub struct CertFiles {
    cert_file: PathBuf,
    key_file: PathBuf,
    provider: Arc<CryptoProvider>,
    /// The PEM text last loaded (to tell a change) and the key served.
    current: RwLock<(Vec<u8>, Vec<u8>, Arc<CertifiedKey>)>,
    /// The files' metadata when they were last read.
    seen: std::sync::Mutex<Option<[FileStamp; 2]>>,
}

type FileStamp = (u64, u64, Option<std::time::SystemTime>);

fn stamp(p: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some((m.ino(), m.len(), m.modified().ok()))
}

impl ResolvesServerCert for CertFiles {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.current.read().ok()?.2))
    }
}

fn certified(
    cert: &[u8],
    key: &[u8],
    provider: &CryptoProvider,
    what: &Path,
) -> anyhow::Result<CertifiedKey> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("cannot parse certificate {}: {e}", what.display()))?;
    if certs.is_empty() {
        anyhow::bail!("no certificate in {}", what.display());
    }
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|e| anyhow::anyhow!("cannot parse the private key of {}: {e}", what.display()))?;
    // from_der checks that the key matches the certificate: the kubelet swaps both files at
    // once, but a read between the two could see a new certificate with the old key.
    CertifiedKey::from_der(certs, key, provider)
        .map_err(|e| anyhow::anyhow!("certificate {} and its key: {e}", what.display()))
}

impl CertFiles {
    fn load(
        cert_file: &Path,
        key_file: &Path,
        provider: Arc<CryptoProvider>,
    ) -> anyhow::Result<CertFiles> {
        let cert = std::fs::read(cert_file)
            .map_err(|e| anyhow::anyhow!("cannot read certificate {}: {e}", cert_file.display()))?;
        let key = std::fs::read(key_file)
            .map_err(|e| anyhow::anyhow!("cannot read private key {}: {e}", key_file.display()))?;
        let ck = certified(&cert, &key, &provider, cert_file)?;
        Ok(CertFiles {
            cert_file: cert_file.into(),
            key_file: key_file.into(),
            provider,
            current: RwLock::new((cert, key, Arc::new(ck))),
            seen: std::sync::Mutex::new(None),
        })
    }

    /// Reads the files again; swaps the served certificate when they changed and load.
    /// `Ok(true)` when a new certificate is served.
    pub fn reload(&self) -> anyhow::Result<bool> {
        let now = stamp(&self.cert_file)
            .zip(stamp(&self.key_file))
            .map(|(a, b)| [a, b]);
        {
            let mut seen = self.seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
            if now.is_some() && *seen == now {
                return Ok(false);
            }
            // Read below; a failure clears it so the next tick tries again.
            *seen = now;
        }
        let r = self.read_and_swap();
        if r.is_err()
            && let Ok(mut seen) = self.seen.lock()
        {
            *seen = None;
        }
        r
    }

    fn read_and_swap(&self) -> anyhow::Result<bool> {
        let cert = std::fs::read(&self.cert_file)?;
        let key = std::fs::read(&self.key_file)?;
        {
            let cur = self
                .current
                .read()
                .map_err(|_| anyhow::anyhow!("poisoned"))?;
            if cur.0 == cert && cur.1 == key {
                return Ok(false);
            }
        }
        let ck = certified(&cert, &key, &self.provider, &self.cert_file)?;
        *self
            .current
            .write()
            .map_err(|_| anyhow::anyhow!("poisoned"))? = (cert, key, Arc::new(ck));
        Ok(true)
    }

    /// Reloads every [`RELOAD_EVERY`] until the process ends; a failed read keeps the current
    /// certificate (logged once per kind of failure, as a half-updated volume fixes itself).
    pub fn spawn_reloader(self: Arc<Self>) {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RELOAD_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_err = String::new();
            loop {
                tick.tick().await;
                let me = Arc::clone(&self);
                match tokio::task::spawn_blocking(move || me.reload()).await {
                    Ok(Ok(true)) => {
                        last_err.clear();
                        tracing::info!(
                            file = %self.cert_file.display(),
                            "serving certificate reloaded; open connections keep the previous one"
                        );
                    }
                    Ok(Ok(false)) => last_err.clear(),
                    Ok(Err(e)) => {
                        let e = e.to_string();
                        if e != last_err {
                            tracing::warn!(error = %e, "cannot reload the serving certificate; serving the previous one");
                            last_err = e;
                        }
                    }
                    Err(_) => {}
                }
            }
        });
    }
}

/// The configuration serving the certificate in `cert_file`/`key_file`, and the handle that
/// reloads them ([`CertFiles::spawn_reloader`]).
pub fn server_config(
    cert_file: &Path,
    key_file: &Path,
    min_version: Option<u16>,
    suites: Option<&[u16]>,
) -> anyhow::Result<(Arc<ServerConfig>, Arc<CertFiles>)> {
    let provider = Arc::new(provider(suites));
    let files = Arc::new(CertFiles::load(cert_file, key_file, Arc::clone(&provider))?);
    let cfg = build(
        provider,
        min_version,
        Arc::clone(&files) as Arc<dyn ResolvesServerCert>,
    )?;
    Ok((cfg, files))
}

/// The same configuration from PEM text (`ucm export-proxy`'s certificate issued in memory).
pub fn server_config_pem(cert: &str, key: &str) -> anyhow::Result<Arc<ServerConfig>> {
    let provider = Arc::new(provider(None));
    let ck = certified(
        cert.as_bytes(),
        key.as_bytes(),
        &provider,
        Path::new("(issued)"),
    )?;
    build(provider, None, Arc::new(Fixed(Arc::new(ck))))
}

/// One certificate, never reloaded.
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }
}

fn provider(suites: Option<&[u16]>) -> CryptoProvider {
    let mut provider = rustls::crypto::ring::default_provider();
    if let Some(ids) = suites {
        let keep: Vec<_> = provider
            .cipher_suites
            .iter()
            .filter(|s| {
                s.version() == &rustls::version::TLS13 || ids.contains(&u16::from(s.suite()))
            })
            .copied()
            .collect();
        let tls12_left = keep.iter().any(|s| s.version() == &rustls::version::TLS12);
        if tls12_left {
            provider.cipher_suites = keep;
        } else {
            tracing::warn!("none of TLS_CIPHER_SUITES is supported; using the default suites");
        }
    }
    provider
}

fn build(
    provider: Arc<CryptoProvider>,
    min_version: Option<u16>,
    resolver: Arc<dyn ResolvesServerCert>,
) -> anyhow::Result<Arc<ServerConfig>> {
    let versions: &[&rustls::SupportedProtocolVersion] = match min_version {
        Some(v) if v >= TLS13_ID => &[&rustls::version::TLS13],
        _ => &[&rustls::version::TLS12, &rustls::version::TLS13],
    };
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

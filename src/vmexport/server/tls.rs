//! rustls server configuration (docs/vmexport.md, "Export server"): TLS 1.2 minimum unless
//! TLS_MIN_VERSION says 1.3; TLS_CIPHER_SUITES filters the TLS 1.2 suites (as in Go, TLS 1.3 suites
//! are not configurable); ALPN offers h2 and http/1.1.

use std::path::Path;
use std::sync::Arc;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Go's `tls.VersionTLS13`.
const TLS13_ID: u16 = 0x0304;

pub fn server_config(
    cert_file: &Path,
    key_file: &Path,
    min_version: Option<u16>,
    suites: Option<&[u16]>,
) -> anyhow::Result<Arc<ServerConfig>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
        .map_err(|e| anyhow::anyhow!("cannot read certificate {}: {e}", cert_file.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("cannot parse certificate {}: {e}", cert_file.display()))?;
    if certs.is_empty() {
        anyhow::bail!("no certificate in {}", cert_file.display());
    }
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| anyhow::anyhow!("cannot read private key {}: {e}", key_file.display()))?;
    build(certs, key, min_version, suites)
}

/// The same configuration from PEM text (`ucm export-proxy`'s certificate issued in memory).
pub fn server_config_pem(cert: &str, key: &str) -> anyhow::Result<Arc<ServerConfig>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("cannot parse certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes())
        .map_err(|e| anyhow::anyhow!("cannot parse private key: {e}"))?;
    build(certs, key, None, None)
}

fn build(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    min_version: Option<u16>,
    suites: Option<&[u16]>,
) -> anyhow::Result<Arc<ServerConfig>> {
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
    let versions: &[&rustls::SupportedProtocolVersion] = match min_version {
        Some(v) if v >= TLS13_ID => &[&rustls::version::TLS13],
        _ => &[&rustls::version::TLS12, &rustls::version::TLS13],
    };
    let mut cfg = ServerConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(versions)?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

//! Server certificates for the controller gRPC service and `ucm router` (docs/exporter.md,
//! "Certificates"): `EXTERNAL_CERT_PEM`/`EXTERNAL_KEY_PEM`, each the path of a PEM file as upstream
//! v0.9.0 and its operator use them (`/tls/tls.crt`, `/tls/tls.key`) or the PEM text itself, else a
//! self-signed certificate for the host of the advertised endpoint. The private key is never
//! logged, nor is a file's content in an error.

#[derive(Clone)]
pub struct CertPair {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for CertPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CertPair(<redacted>)")
    }
}

impl CertPair {
    pub fn identity(&self) -> tonic::transport::Identity {
        tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem)
    }

    pub fn server_tls(&self) -> tonic::transport::ServerTlsConfig {
        tonic::transport::ServerTlsConfig::new().identity(self.identity())
    }
}

/// The configured pair from the environment: both set, neither set, or an error.
pub fn from_env() -> Result<Option<CertPair>, String> {
    let read = |var: &str| pem_or_file(var, std::env::var(var).ok()).transpose();
    from_values(read("EXTERNAL_CERT_PEM")?, read("EXTERNAL_KEY_PEM")?)
}

/// The PEM a variable carries: its value when that is PEM text, else the content of the file it
/// names. `None` when unset or empty.
pub fn pem_or_file(var: &str, value: Option<String>) -> Option<Result<String, String>> {
    let value = value.filter(|v| !v.trim().is_empty())?;
    if value.contains("-----BEGIN ") {
        return Some(Ok(value));
    }
    Some(
        std::fs::read_to_string(value.trim())
            .map_err(|e| format!("{var}: cannot read the PEM file {}: {e}", value.trim())),
    )
}

pub fn from_values(cert: Option<String>, key: Option<String>) -> Result<Option<CertPair>, String> {
    match (
        cert.filter(|s| !s.is_empty()),
        key.filter(|s| !s.is_empty()),
    ) {
        (Some(cert_pem), Some(key_pem)) => {
            if !cert_pem.contains("-----BEGIN CERTIFICATE-----") {
                return Err(
                    "EXTERNAL_CERT_PEM is neither a PEM certificate nor a file holding one".into(),
                );
            }
            if !key_pem.contains("PRIVATE KEY-----") {
                return Err(
                    "EXTERNAL_KEY_PEM is neither a PEM private key nor a file holding one".into(),
                );
            }
            Ok(Some(CertPair { cert_pem, key_pem }))
        }
        (None, None) => Ok(None),
        _ => Err("EXTERNAL_CERT_PEM and EXTERNAL_KEY_PEM must be set together".into()),
    }
}

/// The host part of `host:port` (brackets of an IPv6 literal removed).
pub fn endpoint_host(endpoint: &str) -> String {
    let e = endpoint
        .trim_start_matches("https://")
        .trim_start_matches("http://");
    if let Some(rest) = e.strip_prefix('[') {
        return rest.split(']').next().unwrap_or_default().to_string();
    }
    match e.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h.to_string(),
        _ => e.to_string(),
    }
}

/// A self-signed certificate for the endpoint's host, plus `localhost` and 127.0.0.1 so local
/// runs work with the default endpoints.
pub fn self_signed(endpoint: &str) -> Result<CertPair, String> {
    self_signed_with(endpoint, &[])
}

/// [`self_signed`] with more names: a router's Pod address (docs/exporter.md, "The router").
pub fn self_signed_with(endpoint: &str, more: &[&str]) -> Result<CertPair, String> {
    let mut names = vec![endpoint_host(endpoint)];
    for extra in more.iter().copied().chain(["localhost", "127.0.0.1"]) {
        if !names.iter().any(|n| n == extra) {
            names.push(extra.into());
        }
    }
    names.retain(|n| !n.is_empty());
    let ck = rcgen::generate_simple_self_signed(names)
        .map_err(|e| format!("cannot create a self-signed certificate: {e}"))?;
    Ok(CertPair {
        cert_pem: ck.cert.pem(),
        key_pem: ck.signing_key.serialize_pem(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_of_endpoints() {
        assert_eq!(endpoint_host("localhost:8082"), "localhost");
        assert_eq!(endpoint_host("grpc.example.com:443"), "grpc.example.com");
        assert_eq!(endpoint_host("[::1]:8083"), "::1");
        assert_eq!(endpoint_host("router.svc"), "router.svc");
    }

    #[test]
    fn env_pairs_must_be_complete() {
        assert!(from_values(None, None).unwrap().is_none());
        assert!(from_values(Some("x".into()), None).is_err());
        let pair = self_signed("ucm.example.com:8082").unwrap();
        let got = from_values(Some(pair.cert_pem.clone()), Some(pair.key_pem.clone()))
            .unwrap()
            .unwrap();
        assert_eq!(got.cert_pem, pair.cert_pem);
        assert_eq!(format!("{got:?}"), "CertPair(<redacted>)");
    }

    #[test]
    fn env_values_are_pem_text_or_paths_of_pem_files() {
        let pair = self_signed("ucm.example.com:8082").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (crt, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&crt, &pair.cert_pem).unwrap();
        std::fs::write(&key, &pair.key_pem).unwrap();
        let read = |v: &str| pem_or_file("EXTERNAL_CERT_PEM", Some(v.to_string()));
        assert_eq!(read(crt.to_str().unwrap()).unwrap().unwrap(), pair.cert_pem);
        assert_eq!(read(&pair.cert_pem).unwrap().unwrap(), pair.cert_pem);
        assert!(read("").is_none());
        assert!(pem_or_file("EXTERNAL_CERT_PEM", None).is_none());
        let missing = read("/nonexistent/tls.crt").unwrap().unwrap_err();
        assert!(missing.contains("EXTERNAL_CERT_PEM") && missing.contains("/nonexistent/tls.crt"));
        // The key file's content never reaches an error: a file that is not PEM is named, not shown.
        let got = from_values(
            read(crt.to_str().unwrap()).unwrap().ok(),
            pem_or_file("EXTERNAL_KEY_PEM", Some(crt.to_str().unwrap().into()))
                .unwrap()
                .ok(),
        )
        .unwrap_err();
        assert!(!got.contains("BEGIN"), "{got}");
        let both = from_values(
            read(crt.to_str().unwrap()).unwrap().ok(),
            pem_or_file("EXTERNAL_KEY_PEM", Some(key.to_str().unwrap().into()))
                .unwrap()
                .ok(),
        )
        .unwrap()
        .unwrap();
        assert_eq!(both.key_pem, pair.key_pem);
    }
}

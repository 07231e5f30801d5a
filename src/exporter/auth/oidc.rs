//! External JWT issuers (`authentication.jwt[]`; docs/exporter.md, "External issuers and the login
//! service"): the verifier of an issuer validated by `crate::exporter::config::jwt`: OIDC
//! discovery and the JWKS fetched from the issuer, cached and fetched again (at most every
//! [`REFRESH_MIN_INTERVAL`]) when a token names an unknown `kid`.
//!
//! Nothing here logs or returns token text.

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use http_body_util::{BodyExt, Empty, Limited};
use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::Mutex;

use crate::exporter::config::jwt::{JwtAuthenticator, check_url};

/// Tolerated clock difference for `exp`, `nbf` and `iat` (bounded, not configurable).
pub const CLOCK_SKEW: Duration = Duration::from_secs(5);
/// Least time between two JWKS fetches that an unknown `kid` triggers.
pub const REFRESH_MIN_INTERVAL: Duration = Duration::from_secs(10);
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_DOCUMENT: usize = 1 << 20;
const ALGORITHMS: &[Algorithm] = &[
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
    Algorithm::ES256,
    Algorithm::ES384,
];

// ---- Verification ----

/// Why an external token was refused. Carries no token content.
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone)]
pub enum OidcError {
    #[error("token is malformed")]
    Malformed,
    #[error("token algorithm is not accepted")]
    Algorithm,
    #[error("token is signed with an unknown key")]
    UnknownKey,
    #[error("token signature does not verify")]
    Signature,
    #[error("token audience is wrong")]
    Audience,
    #[error("token has expired")]
    Expired,
    #[error("token is not valid yet")]
    NotYetValid,
    #[error("token lacks the username claim {0}")]
    NoUsername(String),
    #[error("token claim {0} does not have the required value")]
    ClaimRule(String),
    #[error("token email is not verified")]
    EmailNotVerified,
    #[error("username would collide with internal identities")]
    InternalPrefix,
    #[error("the issuer's keys cannot be fetched: {0}")]
    Keys(String),
}

/// The unverified `iss` of a JWT (to choose the verifier), or None when it is not a JWT.
pub fn unverified_issuer(token: &str) -> Option<String> {
    let payload = token.split('.').nth(1)?;
    let v: Value = serde_json::from_slice(&B64.decode(payload).ok()?).ok()?;
    v.get("iss")?.as_str().map(str::to_string)
}

#[derive(Default)]
struct KeyCache {
    keys: Vec<Jwk>,
    fetched: Option<Instant>,
    /// Why the last fetch failed (cleared by a successful one).
    error: Option<String>,
}

/// One issuer's verifier with its key cache.
pub struct Verifier {
    pub config: JwtAuthenticator,
    http: HttpClient,
    cache: Mutex<KeyCache>,
}

type HttpClient = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Empty<bytes::Bytes>,
>;

fn http_client(ca: Option<&str>) -> Result<HttpClient, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(pem) => {
            for c in CertificateDer::pem_slice_iter(pem.as_bytes()).flatten() {
                roots
                    .add(c)
                    .map_err(|e| format!("certificateAuthority: {e}"))?;
            }
        }
        None => {
            for c in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(c);
            }
        }
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1()
        .build();
    Ok(
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(https),
    )
}

#[derive(Deserialize)]
struct Discovery {
    issuer: String,
    jwks_uri: String,
}

impl Verifier {
    pub fn new(config: JwtAuthenticator) -> Result<Verifier, String> {
        Ok(Verifier {
            http: http_client(config.certificate_authority.as_deref())?,
            config,
            cache: Mutex::new(KeyCache::default()),
        })
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, url: &str) -> Result<T, String> {
        let uri: http::Uri = url.parse().map_err(|_| format!("bad URL {url}"))?;
        let req = http::Request::get(uri)
            .header("accept", "application/json")
            .body(Empty::new())
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(FETCH_TIMEOUT, self.http.request(req))
            .await
            .map_err(|_| format!("GET {url}: timed out"))?
            .map_err(|e| format!("GET {url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("GET {url}: HTTP {}", resp.status()));
        }
        let body = tokio::time::timeout(
            FETCH_TIMEOUT,
            Limited::new(resp.into_body(), MAX_DOCUMENT).collect(),
        )
        .await
        .map_err(|_| format!("GET {url}: timed out"))?
        .map_err(|e| format!("GET {url}: {e}"))?
        .to_bytes();
        serde_json::from_slice(&body).map_err(|e| format!("GET {url}: {e}"))
    }

    /// Discovery, then the JWKS. Keys for encryption and of kinds jsonwebtoken cannot read
    /// are skipped (Keycloak publishes an RSA-OAEP key next to its signing keys).
    async fn fetch_keys(&self) -> Result<Vec<Jwk>, String> {
        let d: Discovery = self.get_json(&self.config.discovery_url).await?;
        if d.issuer != self.config.issuer {
            return Err(format!(
                "the discovery document names issuer {:?}, not {:?}",
                d.issuer, self.config.issuer
            ));
        }
        check_url("jwks_uri", &d.jwks_uri)?;
        #[derive(Deserialize)]
        struct Set {
            keys: Vec<Value>,
        }
        let set: Set = self.get_json(&d.jwks_uri).await?;
        Ok(set
            .keys
            .into_iter()
            .filter(|k| k.get("use").and_then(Value::as_str) != Some("enc"))
            .filter_map(|k| serde_json::from_value::<Jwk>(k).ok())
            .collect())
    }

    /// The key for `kid` (or, with no kid, every key), fetching the JWKS when it is not cached
    /// yet or does not hold `kid` and the last fetch is at least [`REFRESH_MIN_INTERVAL`] old.
    async fn keys_for(&self, kid: Option<&str>) -> Result<Vec<Jwk>, OidcError> {
        let mut cache = self.cache.lock().await;
        let pick = |keys: &[Jwk]| -> Vec<Jwk> {
            keys.iter()
                .filter(|k| kid.is_none() || k.common.key_id.as_deref() == kid)
                .cloned()
                .collect()
        };
        let found = pick(&cache.keys);
        let may_fetch = cache
            .fetched
            .is_none_or(|t| t.elapsed() >= REFRESH_MIN_INTERVAL);
        if !found.is_empty() || !may_fetch {
            return match (found.is_empty(), &cache.error) {
                (false, _) => Ok(found),
                (true, Some(e)) if cache.keys.is_empty() => Err(OidcError::Keys(e.clone())),
                (true, _) => Err(OidcError::UnknownKey),
            };
        }
        cache.fetched = Some(Instant::now());
        match self.fetch_keys().await {
            Ok(keys) => {
                tracing::info!(issuer = %self.config.issuer, keys = keys.len(), "fetched the issuer's signing keys");
                cache.keys = keys;
                cache.error = None;
            }
            Err(e) => {
                tracing::warn!(issuer = %self.config.issuer, error = %e, "cannot fetch the issuer's signing keys");
                cache.error = Some(e.clone());
                if cache.keys.is_empty() {
                    return Err(OidcError::Keys(e));
                }
            }
        }
        let found = pick(&cache.keys);
        if found.is_empty() {
            Err(OidcError::UnknownKey)
        } else {
            Ok(found)
        }
    }

    /// Verifies signature, `iss`, `aud`, `exp`, `nbf` and the claim rules; returns the username.
    pub async fn verify(&self, token: &str, internal_prefix: &str) -> Result<String, OidcError> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| OidcError::Malformed)?;
        if !ALGORITHMS.contains(&header.alg) {
            return Err(OidcError::Algorithm);
        }
        let keys = self.keys_for(header.kid.as_deref()).await?;
        let mut validation = Validation::new(header.alg);
        validation.leeway = CLOCK_SKEW.as_secs();
        validation.validate_nbf = true;
        validation.set_issuer(&[&self.config.issuer]);
        validation.set_audience(&self.config.audiences);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        let mut last = OidcError::UnknownKey;
        for jwk in keys {
            if jwk
                .common
                .key_algorithm
                .is_some_and(|a| format!("{a:?}") != format!("{:?}", header.alg))
            {
                continue;
            }
            let Ok(key) = DecodingKey::from_jwk(&jwk) else {
                continue;
            };
            use jsonwebtoken::errors::ErrorKind as K;
            match jsonwebtoken::decode::<Value>(token, &key, &validation) {
                Ok(data) => return self.username(&data.claims, internal_prefix),
                Err(e) => {
                    last = match e.kind() {
                        K::InvalidSignature | K::InvalidAlgorithm | K::InvalidKeyFormat => {
                            OidcError::Signature
                        }
                        K::ExpiredSignature => return Err(OidcError::Expired),
                        K::ImmatureSignature => return Err(OidcError::NotYetValid),
                        K::InvalidAudience => return Err(OidcError::Audience),
                        K::InvalidIssuer => return Err(OidcError::Malformed),
                        K::MissingRequiredClaim(c) if c == "aud" => {
                            return Err(OidcError::Audience);
                        }
                        _ => OidcError::Malformed,
                    }
                }
            }
        }
        Err(last)
    }

    fn username(&self, claims: &Value, internal_prefix: &str) -> Result<String, OidcError> {
        let c = &self.config;
        for (claim, want) in &c.required_claims {
            if claims.get(claim).and_then(Value::as_str) != Some(want.as_str()) {
                return Err(OidcError::ClaimRule(claim.clone()));
            }
        }
        let value = claims
            .get(&c.username_claim)
            .and_then(Value::as_str)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| OidcError::NoUsername(c.username_claim.clone()))?;
        // As Kubernetes: an `email` username counts only when the email is verified.
        if c.username_claim == "email"
            && let Some(v) = claims.get("email_verified")
            && v != &Value::Bool(true)
        {
            return Err(OidcError::EmailNotVerified);
        }
        let username = format!("{}{value}", c.username_prefix);
        if username.starts_with(internal_prefix) {
            return Err(OidcError::InternalPrefix);
        }
        Ok(username)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::config::jwt::tests::parse;

    #[test]
    fn username_rules() {
        let yaml = "- issuer: {url: https://a.example, audiences: [x]}\n  claimMappings: {username: {claim: email, prefix: ''}}\n  claimValidationRules: [{claim: hd, requiredValue: example.com}]\n";
        let v = Verifier::new(parse(yaml).unwrap().remove(0)).unwrap();
        let user = |c: Value| v.username(&c, "internal:");
        let ok = serde_json::json!({"email": "a@example.com", "email_verified": true, "hd": "example.com"});
        assert_eq!(user(ok.clone()).unwrap(), "a@example.com");
        let mut c = ok.clone();
        c["email_verified"] = Value::Bool(false);
        assert_eq!(user(c).unwrap_err(), OidcError::EmailNotVerified);
        let mut c = ok.clone();
        c["hd"] = "evil.example".into();
        assert_eq!(user(c).unwrap_err(), OidcError::ClaimRule("hd".into()));
        let mut c = ok.clone();
        c["email"] = "internal:client:lab:dev:uid".into();
        assert_eq!(user(c).unwrap_err(), OidcError::InternalPrefix);
        let mut c = ok;
        c.as_object_mut().unwrap().remove("email");
        assert_eq!(user(c).unwrap_err(), OidcError::NoUsername("email".into()));
    }

    #[tokio::test]
    async fn an_unreachable_issuer_is_reported_and_not_refetched_at_once() {
        let yaml = "- issuer: {url: 'https://127.0.0.1:1/realms/x', audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n";
        let v = Verifier::new(parse(yaml).unwrap().remove(0)).unwrap();
        let token = format!(
            "{}.{}.c2ln",
            B64.encode(br#"{"alg":"RS256","kid":"k1"}"#),
            B64.encode(br#"{"iss":"https://127.0.0.1:1/realms/x"}"#)
        );
        for _ in 0..2 {
            let e = v.verify(&token, "internal:").await.unwrap_err();
            assert!(
                matches!(e, OidcError::Keys(ref m) if m.contains("127.0.0.1:1")),
                "{e:?}"
            );
        }
        let fetched = v.cache.lock().await.fetched.unwrap();
        assert!(
            fetched.elapsed() < REFRESH_MIN_INTERVAL,
            "one fetch, then the cached error"
        );
        let none = format!("{}.e30.c2ln", B64.encode(br#"{"alg":"none"}"#));
        assert_eq!(
            v.verify(&none, "internal:").await.unwrap_err(),
            OidcError::Malformed
        );
        let hs = format!("{}.e30.c2ln", B64.encode(br#"{"alg":"HS256"}"#));
        assert_eq!(
            v.verify(&hs, "internal:").await.unwrap_err(),
            OidcError::Algorithm
        );
    }

    #[test]
    fn unverified_issuer_reads_only_the_payload() {
        let p = B64.encode(br#"{"iss":"https://a"}"#);
        assert_eq!(
            unverified_issuer(&format!("x.{p}.y")).as_deref(),
            Some("https://a")
        );
        assert_eq!(unverified_issuer("not-a-jwt"), None);
    }
}

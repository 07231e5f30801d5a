//! External JWT issuers (`authentication.jwt[]`; docs/exporter.md, "External issuers and the login
//! service"): the subset of Kubernetes' `JWTAuthenticator` (apiserver.config.k8s.io/v1beta1) that
//! upstream's controller takes, validated here, and the verifier: OIDC discovery and the JWKS
//! fetched from the issuer, cached and fetched again (at most every [`REFRESH_MIN_INTERVAL`]) when
//! a token names an unknown `kid`.
//!
//! Supported: `issuer.{url, discoveryURL, audiences, audienceMatchPolicy, certificateAuthority}`,
//! `claimMappings.username.{claim, prefix}` and the expression form `claims.<name>`,
//! `claimMappings.{groups, uid}` (parsed; ucm authorizes by username only, as upstream),
//! `claimValidationRules[].{claim, requiredValue}`. Refused with a message naming the field: any
//! other CEL expression, `claimMappings.extra`, `userValidationRules`.
//!
//! Nothing here logs or returns token text.

use std::collections::BTreeMap;
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

// ---- The configuration (strict, as upstream's UnmarshalStrict) ----

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawJwtAuthenticator {
    #[serde(default)]
    issuer: RawIssuer,
    #[serde(default)]
    claim_validation_rules: Vec<RawClaimValidationRule>,
    #[serde(default)]
    claim_mappings: RawClaimMappings,
    #[serde(default)]
    user_validation_rules: Vec<serde_json::Value>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawIssuer {
    #[serde(default)]
    url: String,
    #[serde(default, rename = "discoveryURL")]
    discovery_url: Option<String>,
    #[serde(default)]
    certificate_authority: Option<String>,
    #[serde(default)]
    audiences: Vec<String>,
    #[serde(default)]
    audience_match_policy: Option<String>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawClaimValidationRule {
    #[serde(default)]
    claim: Option<String>,
    #[serde(default)]
    required_value: Option<String>,
    #[serde(default)]
    expression: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    message: Option<String>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct RawClaimMappings {
    #[serde(default)]
    username: RawPrefixedClaim,
    #[serde(default)]
    groups: Option<RawPrefixedClaim>,
    #[serde(default)]
    uid: Option<RawPrefixedClaim>,
    #[serde(default)]
    extra: Vec<serde_json::Value>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct RawPrefixedClaim {
    #[serde(default)]
    claim: Option<String>,
    #[serde(default)]
    prefix: Option<String>,
    #[serde(default)]
    expression: Option<String>,
}

/// A validated issuer.
#[derive(Debug, Clone, PartialEq)]
pub struct JwtAuthenticator {
    pub issuer: String,
    /// Where the discovery document is read (`discoveryURL`, else `<url>/.well-known/openid-configuration`).
    pub discovery_url: String,
    pub audiences: Vec<String>,
    /// PEM certificates trusted for discovery and JWKS (none: the system roots).
    pub certificate_authority: Option<String>,
    /// The username is `<prefix><claims[claim]>`.
    pub username_claim: String,
    pub username_prefix: String,
    /// `claimValidationRules`: claim → required value.
    pub required_claims: BTreeMap<String, String>,
}

/// `claims.<name>` (the one CEL form supported): the claim's name.
fn claim_of_expression(expr: &str) -> Option<&str> {
    let name = expr.trim().strip_prefix("claims.")?;
    (!name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .then_some(name)
}

fn check_url(field: &str, url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("https://")
        .ok_or_else(|| format!("{field} {url:?} must be an https:// URL"))?;
    let host = rest.split('/').next().unwrap_or_default();
    if host.is_empty() || url.contains(['?', '#']) || host.contains('@') {
        return Err(format!(
            "{field} {url:?} must be an https:// URL with a host and no user, query or fragment"
        ));
    }
    Ok(())
}

/// Reads a PEM bundle, or (as upstream) the path of a file holding one.
fn certificate_authority(field: &str, value: &str) -> Result<String, String> {
    let pem = if value.contains("-----BEGIN") {
        value.to_string()
    } else {
        std::fs::read_to_string(value)
            .map_err(|e| format!("{field}: neither PEM nor a readable file ({e})"))?
    };
    // Checked as the HTTPS client will use it, so a bad bundle is a config error, not a gRPC
    // server that cannot start.
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let c = c.map_err(|e| format!("{field}: {e}"))?;
        roots
            .add(c)
            .map_err(|e| format!("{field}: not a usable certificate ({e})"))?;
    }
    if roots.is_empty() {
        return Err(format!("{field}: no PEM certificate found"));
    }
    Ok(pem)
}

/// Validates `authentication.jwt` (`field` is its path in the ConfigMap, for messages).
pub fn validate(
    field: &str,
    raw: Vec<RawJwtAuthenticator>,
    internal_prefix: &str,
) -> Result<Vec<JwtAuthenticator>, String> {
    let mut out: Vec<JwtAuthenticator> = Vec::new();
    for (i, a) in raw.into_iter().enumerate() {
        let f = |name: &str| format!("{field}[{i}].{name}");
        // Exact, as Kubernetes compares it with `iss` (Auth0's issuers end in a slash).
        let url = a.issuer.url.clone();
        if a.issuer.url.is_empty() {
            return Err(format!("{} is required", f("issuer.url")));
        }
        check_url(&f("issuer.url"), &url)?;
        if url == crate::exporter::auth::token::ISSUER {
            return Err(format!(
                "{} {url:?} is the internal issuer of ucm's own tokens",
                f("issuer.url")
            ));
        }
        if out.iter().any(|o| o.issuer == url) {
            return Err(format!("{} {url:?} is configured twice", f("issuer.url")));
        }
        let discovery_url = match a.issuer.discovery_url.filter(|d| !d.is_empty()) {
            Some(d) => {
                check_url(&f("issuer.discoveryURL"), &d)?;
                d
            }
            None => format!(
                "{}/.well-known/openid-configuration",
                url.trim_end_matches('/')
            ),
        };
        if a.issuer.audiences.is_empty() || a.issuer.audiences.iter().any(String::is_empty) {
            return Err(format!(
                "{} must list at least one non-empty audience",
                f("issuer.audiences")
            ));
        }
        match a.issuer.audience_match_policy.as_deref() {
            None | Some("") if a.issuer.audiences.len() == 1 => {}
            Some("MatchAny") => {}
            None | Some("") => {
                return Err(format!(
                    "{} must be MatchAny when several audiences are listed",
                    f("issuer.audienceMatchPolicy")
                ));
            }
            Some(p) => {
                return Err(format!(
                    "{} {p:?} is not supported; accepted: MatchAny",
                    f("issuer.audienceMatchPolicy")
                ));
            }
        }
        let ca = a
            .issuer
            .certificate_authority
            .filter(|c| !c.trim().is_empty())
            .map(|c| certificate_authority(&f("issuer.certificateAuthority"), &c))
            .transpose()?;

        let u = a.claim_mappings.username;
        let (claim, prefix) = match (u.claim.filter(|c| !c.is_empty()), u.expression) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "{} and {} are mutually exclusive",
                    f("claimMappings.username.claim"),
                    f("claimMappings.username.expression")
                ));
            }
            (Some(claim), None) => {
                let Some(prefix) = u.prefix else {
                    return Err(format!(
                        "{} is required when claim is set (use \"\" for none)",
                        f("claimMappings.username.prefix")
                    ));
                };
                (claim, prefix)
            }
            (None, Some(expr)) => {
                if u.prefix.is_some() {
                    return Err(format!(
                        "{} must not be set with an expression",
                        f("claimMappings.username.prefix")
                    ));
                }
                let claim = claim_of_expression(&expr).ok_or_else(|| {
                    format!(
                        "{} {expr:?}: ucm supports only the form claims.<name>; use claim and prefix",
                        f("claimMappings.username.expression")
                    )
                })?;
                (claim.to_string(), String::new())
            }
            (None, None) => {
                return Err(format!(
                    "{} (or expression) is required",
                    f("claimMappings.username.claim")
                ));
            }
        };
        // OURS: an external username must never look like an internal one. An empty prefix is
        // allowed; such usernames that start with the internal prefix are refused per token.
        if !prefix.is_empty()
            && (prefix.starts_with(internal_prefix) || internal_prefix.starts_with(&prefix))
        {
            return Err(format!(
                "{} {prefix:?} overlaps the internal prefix {internal_prefix:?}",
                f("claimMappings.username.prefix")
            ));
        }
        for (name, m) in [
            ("groups", &a.claim_mappings.groups),
            ("uid", &a.claim_mappings.uid),
        ] {
            if let Some(e) = m.as_ref().and_then(|m| m.expression.as_deref())
                && claim_of_expression(e).is_none()
            {
                return Err(format!(
                    "{} {e:?}: ucm supports only the form claims.<name>",
                    f(&format!("claimMappings.{name}.expression"))
                ));
            }
        }
        if !a.claim_mappings.extra.is_empty() {
            return Err(format!(
                "{} is not supported by ucm (it authorizes by username only)",
                f("claimMappings.extra")
            ));
        }
        if !a.user_validation_rules.is_empty() {
            return Err(format!(
                "{} (CEL) is not supported by ucm; use claimValidationRules with claim and requiredValue",
                f("userValidationRules")
            ));
        }
        let mut required_claims = BTreeMap::new();
        for (j, r) in a.claim_validation_rules.into_iter().enumerate() {
            let rf = |n: &str| f(&format!("claimValidationRules[{j}].{n}"));
            match (r.claim.filter(|c| !c.is_empty()), r.expression) {
                (Some(c), None) => {
                    required_claims.insert(c, r.required_value.unwrap_or_default());
                }
                (None, Some(e)) => {
                    return Err(format!(
                        "{} {e:?}: CEL expressions are not supported by ucm; use claim and requiredValue",
                        rf("expression")
                    ));
                }
                _ => {
                    return Err(format!(
                        "{} needs exactly one of claim and expression",
                        f(&format!("claimValidationRules[{j}]"))
                    ));
                }
            }
        }
        out.push(JwtAuthenticator {
            issuer: url,
            discovery_url,
            audiences: a.issuer.audiences,
            certificate_authority: ca,
            username_claim: claim,
            username_prefix: prefix,
            required_claims,
        });
    }
    Ok(out)
}

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

    fn parse(yaml: &str) -> Result<Vec<JwtAuthenticator>, String> {
        let raw: Vec<RawJwtAuthenticator> =
            serde_saphyr::from_str(yaml).map_err(|e| e.to_string())?;
        validate("authentication.jwt", raw, "internal:")
    }

    const OK: &str = "- issuer:\n    url: https://kc.example.com/realms/lab\n    audiences: [jumpstarter-cli]\n  claimMappings:\n    username:\n      claim: preferred_username\n      prefix: \"kc:\"\n";

    #[test]
    fn the_supported_form_is_read() {
        let a = &parse(OK).unwrap()[0];
        assert_eq!(a.issuer, "https://kc.example.com/realms/lab");
        assert_eq!(
            a.discovery_url,
            "https://kc.example.com/realms/lab/.well-known/openid-configuration"
        );
        assert_eq!(
            (a.username_claim.as_str(), a.username_prefix.as_str()),
            ("preferred_username", "kc:")
        );
        let e = &parse("- issuer: {url: https://a.example, audiences: [x]}\n  claimMappings:\n    username: {expression: claims.email}\n  claimValidationRules:\n  - {claim: hd, requiredValue: example.com}\n").unwrap()[0];
        assert_eq!(
            (e.username_claim.as_str(), e.username_prefix.as_str()),
            ("email", "")
        );
        assert_eq!(e.required_claims["hd"], "example.com");
        // The URL is kept exactly (it must equal `iss`); discovery gets one slash.
        let slash = &parse("- issuer: {url: 'https://tenant.auth0.com/', audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n").unwrap()[0];
        assert_eq!(slash.issuer, "https://tenant.auth0.com/");
        assert_eq!(
            slash.discovery_url,
            "https://tenant.auth0.com/.well-known/openid-configuration"
        );
    }

    #[test]
    fn invalid_forms_name_the_field() {
        for (yaml, want) in [
            (
                "- issuer: {audiences: [x]}\n",
                "authentication.jwt[0].issuer.url is required",
            ),
            (
                "- issuer: {url: http://a, audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n",
                "issuer.url \"http://a\" must be an https:// URL",
            ),
            (
                "- issuer: {url: https://a}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n",
                "issuer.audiences must list",
            ),
            (
                "- issuer: {url: https://a, audiences: [x, y]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n",
                "audienceMatchPolicy must be MatchAny",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n  claimMappings: {username: {claim: sub}}\n",
                "claimMappings.username.prefix is required",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n",
                "claimMappings.username.claim (or expression) is required",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n  claimMappings: {username: {expression: 'claims.a + claims.b'}}\n",
                "supports only the form claims.<name>",
            ),
            (
                "- issuer: {url: https://a, audiences: [x], certificateAuthority: /nonexistent}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n",
                "issuer.certificateAuthority: neither PEM nor a readable file",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: 'internal:x'}}\n",
                "overlaps the internal prefix",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n  claimValidationRules: [{expression: 'claims.x == 1'}]\n",
                "claimValidationRules[0].expression",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n  userValidationRules: [{expression: 'true'}]\n",
                "userValidationRules (CEL) is not supported",
            ),
            (
                "- issuer: {url: 'https://localhost:8085', audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n",
                "internal issuer",
            ),
        ] {
            let e = parse(yaml).unwrap_err();
            assert!(e.contains(want), "{yaml}: {e}");
        }
        let two = format!("{OK}{OK}");
        assert!(parse(&two).unwrap_err().contains("configured twice"));
    }

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

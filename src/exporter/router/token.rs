//! Router tokens (docs/exporter.md, "Dial and Listen" and "The router"): HS256 JWTs that `Dial`
//! mints and `ucm router` checks. The stream id is `sub`; the two streams carrying the same `sub`
//! are paired. The key and the token text are never logged or put in errors.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use hmac::{Hmac, KeyInit, Mac};
use jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

pub const ISSUER: &str = "https://jumpstarter.dev/stream";
pub const AUDIENCE: &str = "https://jumpstarter.dev/router";
pub const LIFETIME: SignedDuration = SignedDuration::from_secs(30 * 60);

/// The HMAC key (`ROUTER_KEY`, or the generated Secret `ucm-router-key`).
#[derive(Clone)]
pub struct RouterKey(Vec<u8>);

impl std::fmt::Debug for RouterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RouterKey(<redacted>)")
    }
}

impl RouterKey {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<Self> {
        let bytes = bytes.into();
        (!bytes.is_empty()).then_some(RouterKey(bytes))
    }

    /// 32 random bytes as URL-safe base64 text (the form kept in the Secret and in `ROUTER_KEY`).
    pub fn generate_text() -> String {
        let bytes: [u8; 32] = rand::random();
        B64.encode(bytes)
    }

    fn mac(&self) -> Hmac<Sha256> {
        <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0).expect("HMAC takes any key length")
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Claims {
    pub iss: String,
    pub aud: Audience,
    pub sub: String,
    pub exp: i64,
    pub nbf: i64,
    pub iat: i64,
    pub jti: String,
}

/// `aud` may be a string or a list (RFC 7519).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Audience {
    One(String),
    Many(Vec<String>),
}

impl Audience {
    fn contains(&self, want: &str) -> bool {
        match self {
            Audience::One(a) => a == want,
            Audience::Many(v) => v.iter().any(|a| a == want),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouterTokenError {
    #[error("malformed token")]
    Malformed,
    #[error("unsupported token algorithm")]
    Algorithm,
    #[error("invalid token signature")]
    Signature,
    #[error("invalid token issuer or audience")]
    Claims,
    #[error("token expired")]
    Expired,
    #[error("token not yet valid")]
    NotYetValid,
}

/// A new token for a new stream id: `(token, stream id, expiry)`.
pub fn mint(key: &RouterKey, now: Timestamp) -> (String, String, Timestamp) {
    let c = claims(now);
    let exp = now + LIFETIME;
    (sign(key, &c), c.sub.clone(), exp)
}

/// The claims of a new token for a new stream id (random `sub` and `jti`), valid from `now`.
pub fn claims(now: Timestamp) -> Claims {
    Claims {
        iss: ISSUER.into(),
        aud: Audience::One(AUDIENCE.into()),
        sub: uuid::Uuid::new_v4().to_string(),
        exp: (now + LIFETIME).as_second(),
        nbf: now.as_second(),
        iat: now.as_second(),
        jti: uuid::Uuid::new_v4().to_string(),
    }
}

pub fn sign(key: &RouterKey, claims: &Claims) -> String {
    let header = B64.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
    let payload = B64.encode(serde_json::to_vec(claims).expect("claims serialize"));
    let input = format!("{header}.{payload}");
    let mut mac = key.mac();
    mac.update(input.as_bytes());
    let sig = B64.encode(mac.finalize().into_bytes());
    format!("{input}.{sig}")
}

/// Checks signature (HS256 only), issuer, audience, `iat`, `exp` and `nbf`.
pub fn verify(key: &RouterKey, token: &str, now: Timestamp) -> Result<Claims, RouterTokenError> {
    let mut parts = token.split('.');
    let (Some(h), Some(p), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(RouterTokenError::Malformed);
    };
    let header: serde_json::Value = B64
        .decode(h)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or(RouterTokenError::Malformed)?;
    if header["alg"] != "HS256" {
        return Err(RouterTokenError::Algorithm);
    }
    let sig = B64.decode(s).map_err(|_| RouterTokenError::Malformed)?;
    let mut mac = key.mac();
    mac.update(format!("{h}.{p}").as_bytes());
    mac.verify_slice(&sig)
        .map_err(|_| RouterTokenError::Signature)?;
    let claims: Claims = B64
        .decode(p)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or(RouterTokenError::Malformed)?;
    if claims.iss != ISSUER || !claims.aud.contains(AUDIENCE) || claims.sub.is_empty() {
        return Err(RouterTokenError::Claims);
    }
    let now = now.as_second();
    if claims.exp <= now {
        return Err(RouterTokenError::Expired);
    }
    // A minute of leeway for clock skew between manager and router.
    if claims.nbf > now + 60 || claims.iat > now + 60 {
        return Err(RouterTokenError::NotYetValid);
    }
    Ok(claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> RouterKey {
        RouterKey::new(b"k".repeat(32)).unwrap()
    }

    #[test]
    fn minted_token_verifies_with_upstream_claims() {
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        let (tok, sub, exp) = mint(&key(), now);
        let c = verify(&key(), &tok, now).unwrap();
        assert_eq!(c.sub, sub);
        assert_eq!(c.iss, ISSUER);
        assert_eq!(c.aud, Audience::One(AUDIENCE.into()));
        assert_eq!(c.exp, exp.as_second());
        assert_eq!(c.exp - c.iat, 1800);
        assert!(!c.jti.is_empty());
    }

    #[test]
    fn rejects_other_key_expiry_claims_and_algorithms() {
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        let (tok, _, exp) = mint(&key(), now);
        let other = RouterKey::new(b"other".to_vec()).unwrap();
        assert_eq!(verify(&other, &tok, now), Err(RouterTokenError::Signature));
        assert_eq!(verify(&key(), &tok, exp), Err(RouterTokenError::Expired));
        assert_eq!(verify(&key(), "a.b", now), Err(RouterTokenError::Malformed));
        let mut c = verify(&key(), &tok, now).unwrap();
        c.aud = Audience::One("https://elsewhere".into());
        assert_eq!(
            verify(&key(), &sign(&key(), &c), now),
            Err(RouterTokenError::Claims)
        );
        c.aud = Audience::Many(vec!["x".into(), AUDIENCE.into()]);
        assert!(verify(&key(), &sign(&key(), &c), now).is_ok());
        let none = format!(
            "{}.{}.",
            B64.encode(br#"{"alg":"none"}"#),
            tok.split('.').nth(1).unwrap()
        );
        assert_eq!(verify(&key(), &none, now), Err(RouterTokenError::Algorithm));
    }

    #[test]
    fn errors_and_debug_never_show_secrets() {
        assert_eq!(format!("{:?}", key()), "RouterKey(<redacted>)");
        assert!(RouterKey::new(Vec::new()).is_none());
    }
}

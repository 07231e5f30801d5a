//! Internal credential tokens: the ES256 signing key (docs/exporter.md, "The signing key") and the
//! JWTs of the `<name>-exporter` and `<name>-client` Secrets ("Credentials", "Renewal").
//!
//! The key never appears in `Debug` output, logs or errors.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use jiff::{SignedDuration, Timestamp};
use p256::ecdsa::signature::{Signer, Verifier};
use p256::ecdsa::{Signature, VerifyingKey};
use p256::pkcs8::{DecodePrivateKey, EncodePrivateKey, LineEnding};
use serde::{Deserialize, Serialize};

pub const ISSUER: &str = crate::exporter::config::jwt::INTERNAL_ISSUER;
pub const AUDIENCE: &str = "jumpstarter";
pub const KEY_ID: &str = "default";
/// Where the configuration defines it; named here too, beside the tokens it prefixes.
pub use crate::exporter::config::DEFAULT_PREFIX;

/// Annotations that replace the namespace and uid in a token subject (objects migrated from
/// another cluster keep their tokens valid).
pub const MIGRATED_NAMESPACE: &str = "jumpstarter.dev/migrated-namespace";
pub const MIGRATED_UID: &str = "jumpstarter.dev/migrated-uid";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("CONTROLLER_KEY is set but empty")]
    EmptySeed,
    #[error("the signing key is not a PKCS#8 PEM P-256 private key")]
    BadPem,
}

/// The P-256 key that signs and verifies internal tokens.
#[derive(Clone)]
pub struct SigningKey {
    inner: p256::ecdsa::SigningKey,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningKey(<redacted>)")
    }
}

impl PartialEq for SigningKey {
    fn eq(&self, other: &Self) -> bool {
        self.verifying_key() == other.verifying_key()
    }
}

impl SigningKey {
    /// Derives the key from the `CONTROLLER_KEY` seed as the upstream controller does
    /// ([`super::seed`]), so tokens either of them minted verify with the other's key.
    pub fn from_seed(seed: &str) -> Result<Self, KeyError> {
        if seed.is_empty() {
            return Err(KeyError::EmptySeed);
        }
        let scalar = super::seed::scalar_from_seed(seed.as_bytes());
        let secret = p256::SecretKey::from_slice(&scalar)
            .expect("b mod (n - 1) + 1 is a scalar in [1, n - 1]");
        Ok(Self {
            inner: (&secret).into(),
        })
    }

    /// Reads a PKCS#8 PEM P-256 private key (the `key.pem` of a key Secret).
    pub fn from_pkcs8_pem(pem: &str) -> Result<Self, KeyError> {
        let secret = p256::SecretKey::from_pkcs8_pem(pem.trim()).map_err(|_| KeyError::BadPem)?;
        Ok(Self {
            inner: (&secret).into(),
        })
    }

    /// A fresh random key (the leader's generated key when no source is configured).
    pub fn generate() -> Self {
        loop {
            let bytes: [u8; 32] = rand::random();
            if let Ok(secret) = p256::SecretKey::from_slice(&bytes) {
                return Self {
                    inner: (&secret).into(),
                };
            }
        }
    }

    /// PKCS#8 PEM, for storing a generated key in its Secret.
    pub fn to_pkcs8_pem(&self) -> String {
        self.inner
            .to_pkcs8_pem(LineEnding::LF)
            .expect("a P-256 key encodes as PKCS#8")
            .to_string()
    }

    pub fn verifying_key(&self) -> &VerifyingKey {
        self.inner.verifying_key()
    }
}

/// The claims of an internal token.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Claims {
    pub iss: String,
    #[serde(deserialize_with = "string_or_list")]
    pub aud: Vec<String>,
    pub sub: String,
    pub iat: i64,
    pub exp: i64,
    /// (OURS) Unique per mint, so a token rotated within the same second is still a new token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jti: Option<String>,
    /// (OURS) The object ucm minted the token for (`<kind>:<namespace>:<name>:<uid>`, see
    /// [`holder`]). The subject alone can be claimed by any object through the migration
    /// annotations; the holder cannot, so auth checks it whenever present. Tokens minted
    /// elsewhere (migrated from upstream) have none and are judged by subject, as upstream does.
    #[serde(
        default,
        rename = "ucm.io/holder",
        skip_serializing_if = "Option::is_none"
    )]
    pub holder: Option<String>,
}

fn string_or_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

impl Claims {
    /// What [`judge`] reads of these claims (see [`Read`]).
    pub fn for_judging(&self) -> Claims {
        Claims {
            iss: String::new(),
            aud: Vec::new(),
            jti: None,
            sub: self.sub.clone(),
            holder: self.holder.clone(),
            iat: self.iat,
            exp: self.exp,
        }
    }

    pub fn expires_at(&self) -> Timestamp {
        Timestamp::from_second(self.exp).unwrap_or(Timestamp::MAX)
    }
    pub fn issued_at(&self) -> Timestamp {
        Timestamp::from_second(self.iat).unwrap_or(Timestamp::MIN)
    }
}

#[derive(Serialize, Deserialize)]
struct Header {
    alg: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    typ: Option<String>,
}

/// Why a token was not accepted. Carries no token content.
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone, Copy)]
pub enum TokenError {
    #[error("token is malformed")]
    Malformed,
    #[error("token algorithm is not ES256")]
    Algorithm,
    #[error("token signature does not verify with the current key")]
    Signature,
    #[error("token issuer is wrong")]
    Issuer,
    #[error("token audience is wrong")]
    Audience,
    #[error("token has expired")]
    Expired,
}

/// Mints a token for `sub`, valid from `now` (whole seconds) for `lifetime`.
pub fn mint(
    key: &SigningKey,
    sub: &str,
    now: Timestamp,
    lifetime: SignedDuration,
) -> (String, Claims) {
    mint_for(key, sub, None, now, lifetime)
}

/// [`mint`] for the object `holder` names (see [`Claims::holder`]).
pub fn mint_for(
    key: &SigningKey,
    sub: &str,
    holder: Option<&str>,
    now: Timestamp,
    lifetime: SignedDuration,
) -> (String, Claims) {
    let iat = now.as_second();
    let claims = Claims {
        iss: ISSUER.to_string(),
        aud: vec![AUDIENCE.to_string()],
        sub: sub.to_string(),
        iat,
        exp: iat.saturating_add(lifetime.as_secs()),
        jti: Some(format!("{:032x}", rand::random::<u128>())),
        holder: holder.map(str::to_string),
    };
    (sign(key, &claims), claims)
}

/// The object a token is minted for: the subject's form without the migration annotations.
pub fn holder(kind_prefix: &str, namespace: &str, name: &str, uid: &str) -> String {
    format!("{kind_prefix}:{namespace}:{name}:{uid}")
}

/// Signs `claims` as an ES256 JWT with kid `default` (the form of every internal token).
pub fn sign(key: &SigningKey, claims: &Claims) -> String {
    let header = Header {
        alg: "ES256".into(),
        kid: Some(KEY_ID.into()),
        typ: Some("JWT".into()),
    };
    let signing_input = format!(
        "{}.{}",
        B64.encode(serde_json::to_vec(&header).expect("header serialises")),
        B64.encode(serde_json::to_vec(claims).expect("claims serialise"))
    );
    let signature: Signature = key.inner.sign(signing_input.as_bytes());
    format!("{signing_input}.{}", B64.encode(signature.to_bytes()))
}

/// Verifies alg, signature, `iss`, `aud` and `exp`. The subject is the caller's check.
pub fn verify(key: &SigningKey, token: &str, now: Timestamp) -> Result<Claims, TokenError> {
    let claims = verify_signed(key, token)?;
    if claims.exp <= now.as_second() {
        return Err(TokenError::Expired);
    }
    Ok(claims)
}

/// [`verify`] but for the time: signed by `key`, our issuer and audience. What it finds holds
/// for as long as the key does; only expiry depends on when it is asked.
fn verify_signed(key: &SigningKey, token: &str) -> Result<Claims, TokenError> {
    let mut parts = token.trim().split('.');
    let (Some(h), Some(p), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(TokenError::Malformed);
    };
    let header: Header = B64
        .decode(h)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or(TokenError::Malformed)?;
    if header.alg != "ES256" {
        return Err(TokenError::Algorithm);
    }
    let sig_bytes = B64.decode(s).map_err(|_| TokenError::Malformed)?;
    let signature = Signature::from_slice(&sig_bytes).map_err(|_| TokenError::Signature)?;
    let signing_input = &token.trim()[..h.len() + 1 + p.len()];
    key.verifying_key()
        .verify(signing_input.as_bytes(), &signature)
        .map_err(|_| TokenError::Signature)?;
    let claims: Claims = B64
        .decode(p)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or(TokenError::Malformed)?;
    if claims.iss != ISSUER {
        return Err(TokenError::Issuer);
    }
    if !claims.aud.iter().any(|a| a == AUDIENCE) {
        return Err(TokenError::Audience);
    }
    Ok(claims)
}

/// `exporter:<ns>:<name>:<uid>` or `client:<ns>:<name>:<uid>`, with the migration annotations
/// replacing namespace and uid.
pub fn subject(
    kind_prefix: &str,
    namespace: &str,
    name: &str,
    uid: &str,
    annotations: Option<&std::collections::BTreeMap<String, String>>,
) -> String {
    let ann = |k: &str| annotations.and_then(|a| a.get(k)).filter(|v| !v.is_empty());
    let namespace = ann(MIGRATED_NAMESPACE).map_or(namespace, String::as_str);
    let uid = ann(MIGRATED_UID).map_or(uid, String::as_str);
    format!("{kind_prefix}:{namespace}:{name}:{uid}")
}

/// Token lifetime and renewal settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenPolicy {
    /// `authentication.internal.tokenLifetime` (default 365 days).
    pub lifetime: SignedDuration,
    /// `--exporter-token-renew-before` (default 720h); zero disables renewal.
    pub renew_before: SignedDuration,
    /// `--exporter-token-renew-fraction` (default 1/3).
    pub renew_fraction: f64,
}

impl Default for TokenPolicy {
    fn default() -> Self {
        Self {
            lifetime: SignedDuration::from_hours(365 * 24),
            renew_before: SignedDuration::from_hours(720),
            renew_fraction: 0.3333,
        }
    }
}

impl TokenPolicy {
    /// Client tokens are never renewed automatically (clients use RotateToken).
    pub fn without_renewal(self) -> Self {
        Self {
            renew_before: SignedDuration::ZERO,
            ..self
        }
    }

    /// The instant at which a token with these claims is renewed: `exp − R`, with
    /// `R = min(renew_before, fraction × (exp − iat))`. None when renewal is disabled.
    pub fn renewal_at(&self, claims: &Claims) -> Option<Timestamp> {
        if self.renew_before.is_zero() || self.renew_before.is_negative() {
            return None;
        }
        let lifetime_secs = (claims.exp - claims.iat).max(0) as f64;
        let fraction_secs = (lifetime_secs * self.renew_fraction).floor() as i64;
        let margin = self.renew_before.as_secs().min(fraction_secs);
        Timestamp::from_second(claims.exp - margin).ok()
    }
}

/// Why a token is (re)minted; drives the `CredentialCreated` event text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MintReason {
    /// No Secret, or a Secret without a token.
    Created,
    /// The stored token is invalid: another key, wrong claims, wrong subject, expired.
    Replaced(Invalid),
    /// Renewal is due.
    Renewed,
}

/// What made a stored token invalid (for logs; never the token itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    Token(TokenError),
    Subject,
    NotUtf8,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TokenAction {
    Keep(Claims),
    Mint(MintReason),
}

/// A stored token apart from the time: its claims when `key` signed it for our issuer and
/// audience, or why it is not ours. Only what [`judge`] reads is kept (subject, holder, issue
/// and expiry times), so the credential cache holds a few short strings per token, not the JWT.
pub type Read = Result<Claims, Invalid>;

/// Reads a stored token once (see [`Read`]).
pub fn read(stored: &[u8], key: &SigningKey) -> Read {
    let text = std::str::from_utf8(stored).map_err(|_| Invalid::NotUtf8)?;
    Ok(verify_signed(key, text)
        .map_err(Invalid::Token)?
        .for_judging())
}

/// docs/exporter.md, "Credentials" and "Renewal": whether a stored token, [`read`] earlier (`None`
/// when the Secret or its `token` key is missing), can stay at `now`.
pub fn judge(
    stored: Option<&Read>,
    expected_subject: &str,
    now: Timestamp,
    policy: &TokenPolicy,
) -> TokenAction {
    let claims = match stored {
        None => return TokenAction::Mint(MintReason::Created),
        Some(Err(invalid)) => return TokenAction::Mint(MintReason::Replaced(*invalid)),
        Some(Ok(claims)) => claims,
    };
    if claims.exp <= now.as_second() {
        return TokenAction::Mint(MintReason::Replaced(Invalid::Token(TokenError::Expired)));
    }
    if claims.sub != expected_subject {
        return TokenAction::Mint(MintReason::Replaced(Invalid::Subject));
    }
    if policy.renewal_at(claims).is_some_and(|at| at <= now) {
        return TokenAction::Mint(MintReason::Renewed);
    }
    TokenAction::Keep(claims.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Read and judge at once, as a pass on a fresh GET does.
    fn decide(
        stored: Option<&[u8]>,
        key: &SigningKey,
        expected_subject: &str,
        now: Timestamp,
        policy: &TokenPolicy,
    ) -> TokenAction {
        judge(
            stored.map(|b| read(b, key)).as_ref(),
            expected_subject,
            now,
            policy,
        )
    }

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }
    const NOW: i64 = 1_800_000_000;
    const DAY: i64 = 86_400;

    fn decode_part(token: &str, i: usize) -> serde_json::Value {
        let part = token.split('.').nth(i).unwrap();
        serde_json::from_slice(&B64.decode(part).unwrap()).unwrap()
    }

    #[test]
    fn seed_derivation_is_deterministic_and_seed_specific() {
        let a = SigningKey::from_seed("s3cret").unwrap();
        let b = SigningKey::from_seed("s3cret").unwrap();
        let c = SigningKey::from_seed("other").unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(SigningKey::from_seed(""), Err(KeyError::EmptySeed));
        // A token minted by one derivation verifies with the other (two replicas).
        let (t, _) = mint(
            &a,
            "exporter:ns:e:u",
            ts(NOW),
            SignedDuration::from_hours(1),
        );
        assert!(verify(&b, &t, ts(NOW)).is_ok());
        assert_eq!(verify(&c, &t, ts(NOW)), Err(TokenError::Signature));
    }

    /// Seeds → keys → tokens, from the independent Go program `e2e/tools/upstream-keys golden`
    /// (the standard library's `math/rand` and `filippo.io/keygen` v1.0.0, as upstream derives).
    #[test]
    fn seed_derivation_matches_upstream_golden_vectors() {
        #[derive(Deserialize)]
        struct Vector {
            seed: String,
            scalar: String,
            public: String,
            sub: String,
            token: String,
        }
        let vectors: Vec<Vector> =
            serde_json::from_str(include_str!("testdata/upstream_keys.json")).unwrap();
        assert!(vectors.len() >= 5);
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        for v in vectors {
            let key = SigningKey::from_seed(&v.seed).unwrap();
            assert_eq!(hex(&key.inner.to_bytes()), v.scalar, "seed {:?}", v.seed);
            let public = key.verifying_key().to_sec1_point(false);
            assert_eq!(hex(public.as_bytes()), v.public, "seed {:?}", v.seed);
            // Upstream's token (no kid, `typ: JWT`) verifies and reads as upstream wrote it.
            let claims = verify(&key, &v.token, ts(1_800_000_000)).unwrap();
            assert_eq!(claims.sub, v.sub);
            assert_eq!(claims.holder, None);
            assert_eq!(
                decode_part(&v.token, 0),
                serde_json::json!({"alg": "ES256", "typ": "JWT"})
            );
        }
    }

    #[test]
    fn pem_round_trip_and_rejection() {
        let k = SigningKey::generate();
        let pem = k.to_pkcs8_pem();
        assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----"));
        assert_eq!(SigningKey::from_pkcs8_pem(&pem).unwrap(), k);
        assert_eq!(SigningKey::from_pkcs8_pem("nope"), Err(KeyError::BadPem));
        assert_ne!(SigningKey::generate(), k);
    }

    #[test]
    fn debug_never_shows_the_key() {
        let k = SigningKey::from_seed("s3cret").unwrap();
        let text = format!("{k:?}");
        assert_eq!(text, "SigningKey(<redacted>)");
    }

    #[test]
    fn minted_token_has_upstream_header_and_claims() {
        let k = SigningKey::from_seed("x").unwrap();
        let (t, claims) = mint(
            &k,
            "exporter:lab:e1:uid-1",
            ts(NOW),
            SignedDuration::from_hours(365 * 24),
        );
        let header = decode_part(&t, 0);
        assert_eq!(header["alg"], "ES256");
        assert_eq!(header["kid"], "default");
        let payload = decode_part(&t, 1);
        assert_eq!(payload["iss"], "https://localhost:8085");
        assert_eq!(payload["aud"], serde_json::json!(["jumpstarter"]));
        assert_eq!(payload["sub"], "exporter:lab:e1:uid-1");
        assert_eq!(payload["iat"], NOW);
        assert_eq!(payload["exp"], NOW + 365 * DAY);
        assert_eq!(claims.expires_at(), ts(NOW + 365 * DAY));
        // ES256 signatures are the 64-byte r||s form.
        assert_eq!(B64.decode(t.split('.').nth(2).unwrap()).unwrap().len(), 64);
        assert_eq!(verify(&k, &t, ts(NOW)).unwrap(), claims);
    }

    fn forge(k: &SigningKey, header: serde_json::Value, claims: serde_json::Value) -> String {
        let input = format!(
            "{}.{}",
            B64.encode(serde_json::to_vec(&header).unwrap()),
            B64.encode(serde_json::to_vec(&claims).unwrap())
        );
        let sig: Signature = k.inner.sign(input.as_bytes());
        format!("{input}.{}", B64.encode(sig.to_bytes()))
    }

    #[test]
    fn verify_rejects_each_invalid_part() {
        let k = SigningKey::from_seed("x").unwrap();
        let good = serde_json::json!({"iss": ISSUER, "aud": ["jumpstarter"], "sub": "s", "iat": NOW, "exp": NOW + 10});
        let h = serde_json::json!({"alg": "ES256", "kid": "default"});
        assert!(verify(&k, &forge(&k, h.clone(), good.clone()), ts(NOW)).is_ok());
        // A string audience is accepted, as JWT allows.
        let mut c = good.clone();
        c["aud"] = "jumpstarter".into();
        assert!(verify(&k, &forge(&k, h.clone(), c), ts(NOW)).is_ok());
        let mut c = good.clone();
        c["iss"] = "https://evil".into();
        assert_eq!(
            verify(&k, &forge(&k, h.clone(), c), ts(NOW)),
            Err(TokenError::Issuer)
        );
        let mut c = good.clone();
        c["aud"] = serde_json::json!(["other"]);
        assert_eq!(
            verify(&k, &forge(&k, h.clone(), c), ts(NOW)),
            Err(TokenError::Audience)
        );
        assert_eq!(
            verify(&k, &forge(&k, h.clone(), good.clone()), ts(NOW + 10)),
            Err(TokenError::Expired)
        );
        let hs = serde_json::json!({"alg": "HS256"});
        assert_eq!(
            verify(&k, &forge(&k, hs, good.clone()), ts(NOW)),
            Err(TokenError::Algorithm)
        );
        let other = SigningKey::from_seed("y").unwrap();
        assert_eq!(
            verify(&k, &forge(&other, h, good), ts(NOW)),
            Err(TokenError::Signature)
        );
        for junk in ["", "a.b", "a.b.c.d", "!!.??.**"] {
            assert!(verify(&k, junk, ts(NOW)).is_err(), "{junk}");
        }
        // Tampering with the payload breaks the signature.
        let (t, _) = mint(&k, "s", ts(NOW), SignedDuration::from_hours(1));
        let mut parts: Vec<&str> = t.split('.').collect();
        let evil = B64.encode(br#"{"iss":"https://localhost:8085","aud":["jumpstarter"],"sub":"admin","iat":0,"exp":9999999999}"#);
        parts[1] = &evil;
        assert_eq!(
            verify(&k, &parts.join("."), ts(NOW)),
            Err(TokenError::Signature)
        );
    }

    #[test]
    fn subject_honours_migration_annotations() {
        assert_eq!(
            subject("exporter", "ns", "e", "u1", None),
            "exporter:ns:e:u1"
        );
        let mut ann = std::collections::BTreeMap::new();
        ann.insert(MIGRATED_NAMESPACE.to_string(), "old-ns".to_string());
        assert_eq!(
            subject("exporter", "ns", "e", "u1", Some(&ann)),
            "exporter:old-ns:e:u1"
        );
        ann.insert(MIGRATED_UID.to_string(), "old-uid".to_string());
        assert_eq!(
            subject("client", "ns", "c", "u1", Some(&ann)),
            "client:old-ns:c:old-uid"
        );
    }

    #[test]
    fn decide_covers_every_remint_rule() {
        let k = SigningKey::from_seed("x").unwrap();
        let p = TokenPolicy::default();
        let sub = "exporter:ns:e:u";
        let (t, claims) = mint(&k, sub, ts(NOW), p.lifetime);
        let TokenAction::Keep(kept) = decide(Some(t.as_bytes()), &k, sub, ts(NOW + DAY), &p) else {
            panic!("a fresh token of ours is kept")
        };
        assert_eq!(
            (kept.sub, kept.holder, kept.iat, kept.exp),
            (claims.sub, claims.holder, claims.iat, claims.exp)
        );
        assert_eq!(
            decide(None, &k, sub, ts(NOW), &p),
            TokenAction::Mint(MintReason::Created)
        );
        assert_eq!(
            decide(Some(b"\xff\xfe"), &k, sub, ts(NOW), &p),
            TokenAction::Mint(MintReason::Replaced(Invalid::NotUtf8))
        );
        let other = SigningKey::from_seed("rotated").unwrap();
        assert_eq!(
            decide(Some(t.as_bytes()), &other, sub, ts(NOW), &p),
            TokenAction::Mint(MintReason::Replaced(Invalid::Token(TokenError::Signature)))
        );
        assert_eq!(
            decide(
                Some(t.as_bytes()),
                &k,
                "exporter:ns:e:other-uid",
                ts(NOW),
                &p
            ),
            TokenAction::Mint(MintReason::Replaced(Invalid::Subject))
        );
        assert_eq!(
            decide(Some(t.as_bytes()), &k, sub, ts(NOW + 365 * DAY), &p),
            TokenAction::Mint(MintReason::Replaced(Invalid::Token(TokenError::Expired)))
        );
        // Renewal at exp − 30 d with the defaults (365 d lifetime: 30 d < 365/3 d).
        let renew_at = NOW + 335 * DAY;
        assert!(matches!(
            decide(Some(t.as_bytes()), &k, sub, ts(renew_at - 1), &p),
            TokenAction::Keep(_)
        ));
        assert_eq!(
            decide(Some(t.as_bytes()), &k, sub, ts(renew_at), &p),
            TokenAction::Mint(MintReason::Renewed)
        );
        // Renewal disabled: kept until expiry.
        let off = p.without_renewal();
        assert!(matches!(
            decide(Some(t.as_bytes()), &k, sub, ts(renew_at + DAY), &off),
            TokenAction::Keep(_)
        ));
    }

    /// The credential cache keeps a token read once; judged later, it gets the answer a fresh
    /// read would: expiry and renewal follow the clock, not the time of the read.
    #[test]
    fn a_token_read_once_is_judged_at_the_time_asked() {
        let k = SigningKey::from_seed("x").unwrap();
        let p = TokenPolicy::default();
        let sub = "exporter:ns:e:u";
        let (t, _) = mint(&k, sub, ts(NOW), p.lifetime);
        let read_now = read(t.as_bytes(), &k);
        for at in [NOW + DAY, NOW + 335 * DAY, NOW + 365 * DAY] {
            assert_eq!(
                judge(Some(&read_now), sub, ts(at), &p),
                decide(Some(t.as_bytes()), &k, sub, ts(at), &p),
                "at {at}"
            );
        }
        assert_eq!(
            judge(Some(&read_now), sub, ts(NOW + 365 * DAY), &p),
            TokenAction::Mint(MintReason::Replaced(Invalid::Token(TokenError::Expired)))
        );
        // Only what judging reads is kept.
        let kept = read_now.unwrap();
        assert!(kept.iss.is_empty() && kept.aud.is_empty() && kept.jti.is_none());
        // A token of another key is remembered as such.
        let other = SigningKey::from_seed("rotated").unwrap();
        assert_eq!(
            read(t.as_bytes(), &other),
            Err(Invalid::Token(TokenError::Signature))
        );
    }

    #[test]
    fn renewal_margin_is_min_of_before_and_fraction() {
        let p = TokenPolicy::default();
        let claims = |lifetime_days: i64| Claims {
            iss: ISSUER.into(),
            aud: vec![AUDIENCE.into()],
            sub: "s".into(),
            iat: NOW,
            exp: NOW + lifetime_days * DAY,
            jti: None,
            holder: None,
        };
        // 365 d: R = 30 d.
        assert_eq!(p.renewal_at(&claims(365)), Some(ts(NOW + 335 * DAY)));
        // 30 d: R = 0.3333 × 30 d = 9.999 d (floored to the second).
        let c = claims(30);
        let r = (30.0 * DAY as f64 * 0.3333).floor() as i64;
        assert_eq!(p.renewal_at(&c), Some(ts(NOW + 30 * DAY - r)));
        assert_eq!(p.without_renewal().renewal_at(&c), None);
    }
}

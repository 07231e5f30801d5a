//! Who presents a bearer token (docs/exporter.md, "Who may call"): ucm's internal tokens, the
//! configured external JWT issuers (`authentication.jwt[]`) and, with `authentication.k8s.enabled`,
//! ServiceAccount (and other API-server) tokens through a TokenReview. The token's unverified `iss`
//! picks the verifier, as Kubernetes' union of JWT authenticators does; a token no verifier claims
//! is refused. Refusals are `Unauthenticated` and carry the reason, never the token.

mod gorand_table;
pub mod oidc;
mod seed;
pub mod signing;
pub mod token;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::Api;
use kube::api::PostParams;
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;
use tonic::Status;

use crate::exporter::config::ControllerConfig;
use oidc::Verifier;
use token::SigningKey;

/// How long a TokenReview answer is reused (a revoked token keeps working at most this long).
pub const TOKEN_REVIEW_TTL: Duration = Duration::from_secs(10);
const TOKEN_REVIEW_CACHE_MAX: usize = 4096;

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub username: String,
    /// The object an internal token was minted for (see [`token::Claims::holder`]).
    pub holder: Option<String>,
    /// From an internal token (auto-provisioning serves external identities only).
    pub internal: bool,
}

pub struct Authn {
    key: SigningKey,
    prefix: String,
    jwt: Vec<Verifier>,
    k8s: Option<Reviewer>,
}

/// Token hash → when the API server answered and the username it accepted (None: refused).
type Reviews = HashMap<[u8; 32], (Instant, Option<String>)>;

struct Reviewer {
    client: kube::Client,
    cache: Mutex<Reviews>,
}

fn refused(reason: impl std::fmt::Display) -> Status {
    Status::unauthenticated(format!("authentication failed: {reason}"))
}

impl Authn {
    pub fn new(
        key: SigningKey,
        config: &ControllerConfig,
        client: &kube::Client,
    ) -> Result<Authn, String> {
        let jwt = config
            .jwt
            .iter()
            .cloned()
            .map(Verifier::new)
            .collect::<Result<_, _>>()?;
        Ok(Authn {
            key,
            prefix: config.prefix.clone(),
            jwt,
            k8s: config.k8s_auth.then(|| Reviewer {
                client: client.clone(),
                cache: Mutex::new(HashMap::new()),
            }),
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub async fn authenticate(&self, tok: &str, now: Timestamp) -> Result<Identity, Status> {
        let iss = oidc::unverified_issuer(tok);
        if iss.as_deref() == Some(token::ISSUER) {
            let claims = token::verify(&self.key, tok, now).map_err(refused)?;
            return Ok(Identity {
                username: format!("{}{}", self.prefix, claims.sub),
                holder: claims.holder,
                internal: true,
            });
        }
        if let Some(v) = self
            .jwt
            .iter()
            .find(|v| iss.as_deref() == Some(v.config.issuer.as_str()))
        {
            // An unreachable issuer is a retryable outage, not a verdict on the token.
            let username = v.verify(tok, &self.prefix).await.map_err(|e| match e {
                oidc::OidcError::Keys(_) => Status::unavailable(format!("{e}; retry later")),
                e => refused(e),
            })?;
            return Ok(Identity {
                username,
                holder: None,
                internal: false,
            });
        }
        if let Some(r) = &self.k8s {
            return r.review(tok, &self.prefix).await.map(|username| Identity {
                username,
                holder: None,
                internal: false,
            });
        }
        Err(refused(match iss {
            Some(_) => "token issuer is not trusted",
            None => "token is malformed",
        }))
    }
}

impl Reviewer {
    /// The API server's verdict on `tok`, reused for [`TOKEN_REVIEW_TTL`] (keyed by its hash).
    async fn review(&self, tok: &str, internal_prefix: &str) -> Result<String, Status> {
        let digest: [u8; 32] = Sha256::digest(tok.as_bytes()).into();
        if let Some((at, answer)) = self.cache.lock().await.get(&digest)
            && at.elapsed() < TOKEN_REVIEW_TTL
        {
            return answer
                .clone()
                .ok_or_else(|| refused("the API server did not accept the token"));
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: tok.to_string(),
                audiences: None,
            },
            ..Default::default()
        };
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let status = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "TokenReview failed");
                Status::unavailable("cannot review the token; retry later")
            })?
            .status
            .unwrap_or_default();
        let answer = status
            .authenticated
            .unwrap_or(false)
            .then(|| status.user.and_then(|u| u.username))
            .flatten()
            .filter(|u| !u.is_empty() && !u.starts_with(internal_prefix));
        let mut cache = self.cache.lock().await;
        if cache.len() >= TOKEN_REVIEW_CACHE_MAX {
            cache.retain(|_, (at, _)| at.elapsed() < TOKEN_REVIEW_TTL);
            if cache.len() >= TOKEN_REVIEW_CACHE_MAX {
                cache.clear();
            }
        }
        cache.insert(digest, (Instant::now(), answer.clone()));
        answer.ok_or_else(|| refused("the API server did not accept the token"))
    }
}

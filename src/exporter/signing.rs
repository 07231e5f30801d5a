//! Loading the signing key (rule 4.1.7): from the `CONTROLLER_KEY` seed, from a configured
//! Secret, or from the generated Secret `ucm-exporter-signing-key`, which only the leader
//! creates and nobody overwrites. The key is never logged.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::ObjectMeta;
use tracing::{info, warn};

use super::FEATURE;
use super::settings::{GENERATED_KEY_SECRET, KEY_PEM, KeySource};
use super::token::SigningKey;
use crate::runtime::Runtime;
use crate::runtime::controller::backoff;

fn key_from_secret(secret: &Secret, name: &str) -> Result<SigningKey, String> {
    let pem = secret
        .data
        .as_ref()
        .and_then(|d| d.get(KEY_PEM))
        .ok_or_else(|| format!("Secret {name} has no {KEY_PEM} key"))?;
    let pem =
        std::str::from_utf8(&pem.0).map_err(|_| format!("Secret {name}: {KEY_PEM} is not text"))?;
    SigningKey::from_pkcs8_pem(pem).map_err(|e| format!("Secret {name}: {e}"))
}

/// Resolves the key. A configured source that cannot be read is an error (the feature reports
/// it as not ready). The generated Secret is awaited until the leader has created it; `None`
/// means shutdown came first.
pub async fn load(rt: &Runtime, source: &KeySource) -> Result<Option<SigningKey>, String> {
    load_inner(rt, source).await.map(Some).or_else(|e| match e {
        Stop::Shutdown => Ok(None),
        Stop::Failed(msg) => Err(msg),
    })
}

enum Stop {
    Shutdown,
    Failed(String),
}

impl From<String> for Stop {
    fn from(msg: String) -> Self {
        Stop::Failed(msg)
    }
}

/// Reads a Secret, retrying API errors with backoff until shutdown: an API server that is
/// restarting or unreachable while the manager starts must not disable the feature for the
/// life of the process (a missing or invalid Secret is still reported at once).
async fn read(rt: &Runtime, api: &Api<Secret>, name: &str) -> Result<Option<Secret>, Stop> {
    let mut failures = 0u32;
    loop {
        match api.get_opt(name).await {
            Ok(s) => return Ok(s),
            Err(e) => {
                failures += 1;
                let wait = backoff(failures, Duration::from_secs(30));
                let msg = format!("cannot read Secret {name}: {e}; retrying");
                warn!(secret = name, error = %e, retry_in = ?wait, "cannot read the signing key Secret; retrying");
                rt.health.set(&FEATURE.check_name(), Err(msg));
                tokio::select! {
                    _ = rt.shutdown.cancelled() => return Err(Stop::Shutdown),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

async fn load_inner(rt: &Runtime, source: &KeySource) -> Result<SigningKey, Stop> {
    let secrets: Api<Secret> = rt.own_namespace();
    match source {
        KeySource::Seed(seed) => Ok(SigningKey::from_seed(seed).map_err(|e| e.to_string())?),
        KeySource::Secret(name) => {
            let secret = read(rt, &secrets, name).await?.ok_or_else(|| {
                format!(
                    "signing key Secret {name} not found in {}",
                    rt.config.manager_namespace
                )
            })?;
            Ok(key_from_secret(&secret, name)?)
        }
        KeySource::Generated => loop {
            if let Some(secret) = read(rt, &secrets, GENERATED_KEY_SECRET).await? {
                return Ok(key_from_secret(&secret, GENERATED_KEY_SECRET)?);
            }
            if rt.leadership.is_leader() {
                let key = SigningKey::generate();
                let secret = Secret {
                    metadata: ObjectMeta {
                        name: Some(GENERATED_KEY_SECRET.into()),
                        namespace: Some(rt.config.manager_namespace.clone()),
                        ..Default::default()
                    },
                    type_: Some("Opaque".into()),
                    data: Some(BTreeMap::from([(
                        KEY_PEM.to_string(),
                        ByteString(key.to_pkcs8_pem().into_bytes()),
                    )])),
                    ..Default::default()
                };
                match rt.writer("exporter").create(&secrets, &secret).await {
                    Ok(_) => {
                        info!(
                            secret = GENERATED_KEY_SECRET,
                            "generated the exporter signing key"
                        );
                        return Ok(key);
                    }
                    // Another leader created it first: use theirs.
                    Err(e) if matches!(&e, crate::runtime::WriteError::Kube(kube::Error::Api(s)) if s.code == 409) =>
                    {
                        continue;
                    }
                    // Leadership lost or the API server unreachable: look again after the
                    // pause below (a new leader may create it meanwhile).
                    Err(e) => {
                        warn!(secret = GENERATED_KEY_SECRET, error = %e, "cannot create the signing key Secret; retrying");
                    }
                }
            }
            tokio::select! {
                _ = rt.shutdown.cancelled() => return Err(Stop::Shutdown),
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::{Leadership, RuntimeConfig, health::Health, metrics::Metrics};
    use std::sync::Arc;
    use tokio_util::sync::CancellationToken;

    /// A Runtime whose API server refuses connections.
    fn unreachable() -> Runtime {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cfg = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        Runtime::new(
            kube::Client::try_from(cfg).unwrap(),
            Leadership::always(),
            Arc::new(Metrics::new()),
            Health::new(),
            CancellationToken::new(),
            RuntimeConfig {
                manager_namespace: "ucm".into(),
                watch_namespace: None,
                max_concurrent_reconciles: 1,
                pod_name: None,
                identity: "test".into(),
            },
        )
    }

    /// An unreachable API server while the key is loaded is waited out (readiness says why),
    /// not turned into a failed feature for the life of the process.
    #[tokio::test]
    async fn api_errors_while_loading_the_key_are_retried_until_shutdown() {
        for source in [KeySource::Generated, KeySource::Secret("mine".into())] {
            let rt = unreachable();
            let stop = rt.shutdown.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                stop.cancel();
            });
            let started = std::time::Instant::now();
            assert!(matches!(load(&rt, &source).await, Ok(None)));
            assert!(started.elapsed() >= Duration::from_millis(1400));
            let (ok, text) = rt.health.report(None).unwrap();
            assert!(!ok);
            assert!(text.contains("cannot read Secret"), "{text}");
        }
    }
}

//! Loading the signing key (rule 4.1.7): from the `CONTROLLER_KEY` seed, from a configured
//! Secret, or from the generated Secret `ucm-exporter-signing-key`, which only the leader
//! creates and nobody overwrites. The key is never logged.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::ObjectMeta;
use tracing::info;

use super::settings::{GENERATED_KEY_SECRET, KEY_PEM, KeySource};
use super::token::SigningKey;
use crate::runtime::Runtime;

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

async fn load_inner(rt: &Runtime, source: &KeySource) -> Result<SigningKey, Stop> {
    let secrets: Api<Secret> = rt.own_namespace();
    match source {
        KeySource::Seed(seed) => Ok(SigningKey::from_seed(seed).map_err(|e| e.to_string())?),
        KeySource::Secret(name) => {
            let secret = secrets
                .get_opt(name)
                .await
                .map_err(|e| format!("cannot read the signing key Secret {name}: {e}"))?
                .ok_or_else(|| {
                    format!(
                        "signing key Secret {name} not found in {}",
                        rt.config.manager_namespace
                    )
                })?;
            Ok(key_from_secret(&secret, name)?)
        }
        KeySource::Generated => loop {
            if let Some(secret) = secrets
                .get_opt(GENERATED_KEY_SECRET)
                .await
                .map_err(|e| format!("cannot read Secret {GENERATED_KEY_SECRET}: {e}"))?
            {
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
                    Err(e) => {
                        return Err(
                            format!("cannot create Secret {GENERATED_KEY_SECRET}: {e}").into()
                        );
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

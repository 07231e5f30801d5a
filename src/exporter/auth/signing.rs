//! Loading the signing key (docs/exporter.md, "The signing key"): from the `CONTROLLER_KEY` seed,
//! from the Secret named by `--exporter-signing-key-secret`, or from the generated Secret
//! `ucm-exporter-signing-key`, which only the leader creates and nobody overwrites. Every replica
//! and every restart resolve the same key; a key Secret that is missing or invalid keeps the
//! feature not ready (with the reason) until it is fixed. The key is never logged.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::ObjectMeta;
use tracing::info;

use crate::exporter::auth::token::SigningKey;
use crate::exporter::settings::{GENERATED_KEY_SECRET, KEY_PEM, KeySource};
use crate::exporter::startup::{Step, settle};
use crate::runtime::Runtime;

/// The key in `key.pem` of a key Secret, or why it cannot be used (actionable, no key material).
pub fn key_from_secret(secret: &Secret, name: &str) -> Result<SigningKey, String> {
    let pem = secret
        .data
        .as_ref()
        .and_then(|d| d.get(KEY_PEM))
        .ok_or_else(|| format!("Secret {name} has no {KEY_PEM} key"))?;
    let pem =
        std::str::from_utf8(&pem.0).map_err(|_| format!("Secret {name}: {KEY_PEM} is not text"))?;
    SigningKey::from_pkcs8_pem(pem).map_err(|e| {
        let hint = if pem.contains("BEGIN EC PRIVATE KEY") {
            " (this is a SEC1 key: convert it with `openssl pkcs8 -topk8 -nocrypt`)"
        } else {
            ""
        };
        format!("Secret {name}, key {KEY_PEM}: {e}{hint}")
    })
}

/// The generated key's Secret.
fn generated_secret(key: &SigningKey, namespace: &str) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(GENERATED_KEY_SECRET.into()),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            KEY_PEM.to_string(),
            ByteString(key.to_pkcs8_pem().into_bytes()),
        )])),
        ..Default::default()
    }
}

/// Resolves the key. An invalid seed is an error (the feature reports it and stays off); key
/// Secrets are awaited until usable. `None` means shutdown came first.
pub async fn load(rt: &Runtime, source: &KeySource) -> Result<Option<SigningKey>, String> {
    let secrets: Api<Secret> = rt.own_namespace();
    let ns = rt.config.manager_namespace.clone();
    match source {
        KeySource::Seed(seed) => SigningKey::from_seed(seed)
            .map(Some)
            .map_err(|e| e.to_string()),
        KeySource::Secret(name) => Ok(settle::<Secret, _, _, _>(rt, name, || {
            let secrets = secrets.clone();
            let ns = ns.clone();
            let name = name.clone();
            async move {
                match secrets.get_opt(&name).await {
                    Err(e) => Step::Wait(format!("cannot read the signing key Secret {name}: {e}")),
                    Ok(None) => Step::Wait(format!(
                        "signing key Secret {name} (--exporter-signing-key-secret) not found in namespace {ns}; create it with a PKCS#8 P-256 private key under {KEY_PEM}"
                    )),
                    Ok(Some(s)) => match key_from_secret(&s, &name) {
                        Ok(key) => Step::Done(key),
                        Err(msg) => Step::Wait(msg),
                    },
                }
            }
        })
        .await),
        KeySource::Generated => {
            let writer = rt.writer("exporter");
            let leadership = rt.leadership.clone();
            Ok(settle::<Secret, _, _, _>(rt, GENERATED_KEY_SECRET, || {
                let secrets = secrets.clone();
                let ns = ns.clone();
                let writer = writer.clone();
                let leader = leadership.is_leader();
                async move {
                    match secrets.get_opt(GENERATED_KEY_SECRET).await {
                        Err(e) => Step::Wait(format!(
                            "cannot read Secret {GENERATED_KEY_SECRET}: {e}"
                        )),
                        // Never overwritten: a broken one is for the operator to delete.
                        Ok(Some(s)) => match key_from_secret(&s, GENERATED_KEY_SECRET) {
                            Ok(key) => Step::Done(key),
                            Err(msg) => Step::Wait(format!(
                                "{msg}; delete Secret {GENERATED_KEY_SECRET} to generate a new key (every token is then re-minted)"
                            )),
                        },
                        Ok(None) if !leader => Step::Wait(format!(
                            "waiting for the leader to generate Secret {GENERATED_KEY_SECRET}"
                        )),
                        Ok(None) => {
                            let key = SigningKey::generate();
                            match writer.create(&secrets, &generated_secret(&key, &ns)).await {
                                Ok(_) => {
                                    info!(
                                        secret = GENERATED_KEY_SECRET,
                                        "generated the exporter signing key"
                                    );
                                    Step::Done(key)
                                }
                                // Created meanwhile (a previous leader): its watch event
                                // brings the next evaluation, which reads that key.
                                Err(e) if e.is_conflict() => Step::Wait(format!(
                                    "Secret {GENERATED_KEY_SECRET} appeared meanwhile; reading it"
                                )),
                                Err(e) => Step::Wait(format!(
                                    "cannot create Secret {GENERATED_KEY_SECRET}: {e}"
                                )),
                            }
                        }
                    }
                }
            })
            .await)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(data: &[(&str, &[u8])]) -> Secret {
        Secret {
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.to_vec())))
                    .collect(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn key_secret_round_trip_and_errors() {
        let key = SigningKey::generate();
        let s = generated_secret(&key, "ns");
        assert_eq!(s.metadata.name.as_deref(), Some(GENERATED_KEY_SECRET));
        assert_eq!(key_from_secret(&s, "k").unwrap(), key);

        let e = key_from_secret(&secret(&[("tls.key", b"x")]), "k").unwrap_err();
        assert_eq!(e, "Secret k has no key.pem key");
        let e = key_from_secret(&secret(&[("key.pem", b"\xff")]), "k").unwrap_err();
        assert!(e.contains("not text"), "{e}");
        let e = key_from_secret(&secret(&[("key.pem", b"garbage")]), "k").unwrap_err();
        assert!(e.contains("not a PKCS#8 PEM P-256 private key"), "{e}");
        // SEC1 PEM (what `openssl ecparam -genkey` prints) gets a conversion hint.
        let sec1 = b"-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n";
        let e = key_from_secret(&secret(&[("key.pem", sec1)]), "k").unwrap_err();
        assert!(e.contains("openssl pkcs8 -topk8"), "{e}");
        assert!(!e.contains("AAAA"), "no key material in errors: {e}");
    }
}

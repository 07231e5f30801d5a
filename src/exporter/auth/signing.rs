//! Where the signing key comes from (docs/exporter.md, "The signing key"): the `CONTROLLER_KEY`
//! seed, the Secret named by `--exporter-signing-key-secret`, or the generated Secret
//! `ucm-exporter-signing-key`; and the key of a key Secret. Reading it at start-up is
//! `crate::exporter::startup::load_key`. The key is never logged.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::ObjectMeta;

use crate::exporter::auth::token::SigningKey;

/// The Secret the leader generates when no key is given.
pub const GENERATED_KEY_SECRET: &str = "ucm-exporter-signing-key";
/// The key of a key Secret that holds the PEM.
pub const KEY_PEM: &str = "key.pem";

/// Where the signing key comes from (docs/exporter.md, "The signing key").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    Seed(String),
    Secret(String),
    Generated,
}

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
pub fn generated_secret(key: &SigningKey, namespace: &str) -> Secret {
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

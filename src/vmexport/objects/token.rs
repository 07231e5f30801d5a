//! The token and the default token Secret (docs/vmexport.md, "Token").

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;

use super::app_labels;
use crate::runtime::meta::controller_ref;
use crate::vmexport::api::*;
use crate::vmexport::types::VirtualMachineExport;

/// A token of `len` characters from `[0-9A-Za-z]`, uniformly: the OS CSPRNG with rejection
/// sampling (bytes >= 248 are dropped so every symbol has the same probability).
pub fn generate_token(len: usize) -> String {
    use rand::TryRngCore;
    const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut out = String::with_capacity(len);
    let mut buf = [0u8; 64];
    while out.len() < len {
        rand::rngs::OsRng
            .try_fill_bytes(&mut buf)
            .expect("the OS random number generator failed");
        for b in buf {
            if b < 248 && out.len() < len {
                out.push(ALPHABET[usize::from(b % 62)] as char);
            }
        }
    }
    out
}

pub fn build_token_secret(
    export: &VirtualMachineExport,
    name: &str,
    token: &str,
) -> k8s_openapi::api::core::v1::Secret {
    k8s_openapi::api::core::v1::Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: export.namespace(),
            labels: Some(app_labels()),
            owner_references: controller_ref(export).map(|o| vec![o]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            TOKEN_KEY.to_string(),
            k8s_openapi::ByteString(token.as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmexport::fixtures::export;

    #[test]
    fn token_is_long_alphanumeric_and_random() {
        let a = generate_token(TOKEN_LENGTH);
        let b = generate_token(TOKEN_LENGTH);
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(a, b);
        let s = build_token_secret(&export("e1"), "export-token-e1", &a);
        assert_eq!(s.type_.as_deref(), Some("Opaque"));
        assert_eq!(s.data.unwrap()["token"].0, a.as_bytes());
        assert_eq!(
            s.metadata.owner_references.unwrap()[0].controller,
            Some(true)
        );
    }
}

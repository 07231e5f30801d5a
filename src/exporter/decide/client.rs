//! Pure derivation of the Client status (docs/exporter.md, "The Client pass"): credential,
//! endpoint, `tokenExpiresAt`, `TokenExpiring`, the next threshold wake-up, and the events.

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::conditions;
use crate::exporter::auth::token::Claims;
use crate::exporter::crd::{Client, ClientStatus, LocalObjectReference};
use crate::exporter::decide::credential::{TOKEN_EXPIRING, expiry_thresholds, token_expiring};
use crate::exporter::decide::events::EventSpec;
use crate::exporter::decide::time::{next_delay, rfc3339};

#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub status: ClientStatus,
    pub requeue_after: Option<std::time::Duration>,
}

/// `token` is the claims of the token in `<name>-client` after any mint in this pass.
pub fn decide(
    client: &Client,
    token: &Claims,
    endpoint: &str,
    max_requeue: SignedDuration,
    now: Timestamp,
) -> Decision {
    let name = client.metadata.name.clone().unwrap_or_default();
    let mut status = client.status.clone().unwrap_or_default();
    status.credential = Some(LocalObjectReference::new(format!("{name}-client")));
    status.endpoint = Some(endpoint.to_string());
    status.token_expires_at = Some(Time(token.expires_at()));
    let mut conds = status.conditions.take().unwrap_or_default();
    conditions::set(
        &mut conds,
        token_expiring(token.expires_at(), now),
        client.metadata.generation,
        &conditions::time(now),
    );
    status.conditions = Some(conds);
    // OURS: wake at the next TokenExpiring threshold instead of every 24 h.
    let requeue_after = next_delay(&expiry_thresholds(token.expires_at()), now, max_requeue);
    Decision {
        status,
        requeue_after,
    }
}

/// The status of a Client that cannot get a credential (`problem` is its `TokenExpiring`):
/// no credential, no expiry.
pub fn without_credential(
    client: &Client,
    problem: conditions::Desired<'_>,
    endpoint: &str,
    now: Timestamp,
) -> ClientStatus {
    let mut status = client.status.clone().unwrap_or_default();
    status.credential = None;
    status.token_expires_at = None;
    status.endpoint = Some(endpoint.to_string());
    let mut conds = status.conditions.take().unwrap_or_default();
    conditions::set(
        &mut conds,
        problem,
        client.metadata.generation,
        &conditions::time(now),
    );
    status.conditions = Some(conds);
    status
}

/// Events after a persisted status write: `TokenExpiringSoon` when `TokenExpiring` became True
/// (upstream's text). `CredentialCreated` follows the Secret write instead
/// ([`crate::exporter::decide::events::mint_note`]).
pub fn events(name: &str, old: Option<&ClientStatus>, new: &ClientStatus) -> Vec<EventSpec> {
    let mut out = Vec::new();
    let was = old.is_some_and(|s| {
        conditions::is_true(s.conditions.as_deref().unwrap_or_default(), TOKEN_EXPIRING)
    });
    let is = conditions::is_true(
        new.conditions.as_deref().unwrap_or_default(),
        TOKEN_EXPIRING,
    );
    if !was && is {
        let expires = new
            .token_expires_at
            .as_ref()
            .map(|t| rfc3339(t.0))
            .unwrap_or_default();
        out.push(EventSpec {
            warning: true,
            reason: "TokenExpiringSoon",
            note: format!("Token for client {name} is expiring soon: expires={expires}"),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::auth::token::{AUDIENCE, ISSUER, Invalid, MintReason};
    use crate::exporter::crd::ClientSpec;
    use crate::exporter::decide::events::mint_note;
    use kube::api::ObjectMeta;

    const NOW: i64 = 1_800_000_000;
    const DAY: i64 = 86_400;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    fn client(status: Option<ClientStatus>) -> Client {
        Client {
            metadata: ObjectMeta {
                name: Some("c1".into()),
                generation: Some(2),
                ..Default::default()
            },
            spec: ClientSpec::default(),
            status,
        }
    }

    fn claims(exp: i64) -> Claims {
        Claims {
            iss: ISSUER.into(),
            aud: vec![AUDIENCE.into()],
            sub: "client:ns:c1:u".into(),
            iat: exp - 365 * DAY,
            exp,
            jti: None,
            holder: None,
        }
    }

    #[test]
    fn status_fields_and_next_threshold() {
        let d = decide(
            &client(None),
            &claims(NOW + 100 * DAY + 60),
            "ctrl:8082",
            SignedDuration::from_hours(24 * 400),
            ts(NOW),
        );
        assert_eq!(
            d.status.credential,
            Some(LocalObjectReference::new("c1-client"))
        );
        assert_eq!(d.status.endpoint.as_deref(), Some("ctrl:8082"));
        assert_eq!(
            d.status.token_expires_at,
            Some(Time(ts(NOW + 100 * DAY + 60)))
        );
        let c = conditions::find(d.status.conditions.as_deref().unwrap(), TOKEN_EXPIRING).unwrap();
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "Valid"));
        assert_eq!(c.observed_generation, Some(2));
        // Next threshold: exp − 30 d.
        assert_eq!(
            d.requeue_after,
            Some(std::time::Duration::from_secs((70 * DAY + 60) as u64))
        );
        // Capped by the max requeue.
        let capped = decide(
            &client(None),
            &claims(NOW + 100 * DAY),
            "e",
            SignedDuration::from_hours(24),
            ts(NOW),
        );
        assert_eq!(
            capped.requeue_after,
            Some(std::time::Duration::from_secs(DAY as u64))
        );
        // Past every threshold: watch-driven only.
        let expired = decide(
            &client(None),
            &claims(NOW - 1),
            "e",
            SignedDuration::from_hours(24),
            ts(NOW),
        );
        assert_eq!(expired.requeue_after, None);
    }

    #[test]
    fn second_pass_is_unchanged() {
        let token = claims(NOW + 100 * DAY + 3600);
        let first = decide(
            &client(None),
            &token,
            "e",
            SignedDuration::from_hours(24),
            ts(NOW),
        );
        let second = decide(
            &client(Some(first.status.clone())),
            &token,
            "e",
            SignedDuration::from_hours(24),
            ts(NOW + 30),
        );
        assert_eq!(first.status, second.status);
    }

    #[test]
    fn events_follow_upstream_texts() {
        let soon = decide(
            &client(None),
            &claims(NOW + 10 * DAY),
            "e",
            SignedDuration::from_hours(24),
            ts(NOW),
        )
        .status;
        let ev = events("c1", None, &soon);
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].reason, "TokenExpiringSoon");
        assert_eq!(
            ev[0].note,
            format!(
                "Token for client c1 is expiring soon: expires={}",
                rfc3339(ts(NOW + 10 * DAY))
            )
        );
        assert!(events("c1", Some(&soon), &soon).is_empty());
        assert_eq!(
            mint_note("client", MintReason::Created, "c1-client"),
            "Credential secret created for client: secret=c1-client"
        );
        assert_eq!(
            mint_note(
                "client",
                MintReason::Replaced(Invalid::Subject),
                "c1-client"
            ),
            "Credential token replaced (invalid) for client: secret=c1-client"
        );
        assert_eq!(
            mint_note("exporter", MintReason::Renewed, "e1-exporter"),
            "Credential token renewed for exporter: secret=e1-exporter"
        );
    }
}

//! The credential conditions the Exporter and Client statuses share (docs/exporter.md,
//! "TokenExpiring", "Credentials"): `TokenExpiring` as upstream words it, the instants at which
//! it changes, and the two OURS reasons no credential can be issued.

use jiff::{SignedDuration, Timestamp};

use crate::conditions::Desired;
use crate::exporter::decide::time::rfc3339;

pub const TOKEN_EXPIRING: &str = "TokenExpiring";

pub const REASON_EXPIRED: &str = "Expired";
pub const REASON_WITHIN_7: &str = "ExpiresWithin7Days";
pub const REASON_WITHIN_30: &str = "ExpiresWithin30Days";
pub const REASON_VALID: &str = "Valid";
/// OURS: the object's name leaves no room for its credential Secret's name.
pub const REASON_CREDENTIAL_NAME_TOO_LONG: &str = "CredentialNameTooLong";
pub const REASON_SECRET_CONFLICT: &str = "SecretConflict";

pub(crate) const DAY: i64 = 86_400;

/// OURS: Kubernetes names are at most 253 characters, so an Exporter or Client whose credential
/// Secret name (`<name><suffix>`) would be longer can never get a credential. Instead of failing
/// every pass, `TokenExpiring` says so.
pub fn credential_name_too_long(kind: &str, name: &str, suffix: &str) -> Option<Desired<'static>> {
    let len = name.len() + suffix.len();
    (len > 253).then(|| {
        Desired::new(
            TOKEN_EXPIRING,
            true,
            REASON_CREDENTIAL_NAME_TOO_LONG,
            format!(
                "No credential can be issued: its Secret name would be {len} characters, over the Kubernetes limit of 253; recreate the {kind} with a name of at most {} characters",
                253 - suffix.len()
            ),
        )
    })
}

/// The credential Secret's name is taken by a Secret this object does not control: ucm leaves
/// it untouched (it may belong to something else) and issues no credential until it is gone.
pub fn secret_conflict(kind: &str, namespace: &str, secret: &str) -> Desired<'static> {
    Desired::new(
        TOKEN_EXPIRING,
        true,
        REASON_SECRET_CONFLICT,
        format!(
            "No credential can be issued: Secret {namespace}/{secret} already exists and is not controlled by this {kind}; ucm leaves it untouched. Delete or rename that Secret, or recreate the {kind} under another name"
        ),
    )
}

/// `TokenExpiring` as upstream's `token_expiry.go` words it. `remaining` keeps `now`'s fraction
/// of a second, as Go's `time.Until`: a token minted in this pass (whole-second `iat`) already
/// reads "364 days", so the next pass does not rewrite the message.
pub fn token_expiring(exp: Timestamp, now: Timestamp) -> Desired<'static> {
    let remaining = now.duration_until(exp);
    let when = rfc3339(exp);
    let days = remaining.as_secs() / DAY;
    let message = format!("Token expires on {when} ({days} days remaining)");
    let remaining = remaining.as_secs() + i64::from(remaining.subsec_nanos() > 0);
    if remaining <= 0 {
        Desired::new(
            TOKEN_EXPIRING,
            true,
            REASON_EXPIRED,
            format!("Token expired on {when}"),
        )
    } else if remaining <= 7 * DAY {
        Desired::new(TOKEN_EXPIRING, true, REASON_WITHIN_7, message)
    } else if remaining <= 30 * DAY {
        Desired::new(TOKEN_EXPIRING, true, REASON_WITHIN_30, message)
    } else {
        Desired::new(TOKEN_EXPIRING, false, REASON_VALID, message)
    }
}

/// The instants at which `TokenExpiring` changes: `exp − 30 d`, `exp − 7 d`, `exp`.
pub fn expiry_thresholds(exp: Timestamp) -> [Timestamp; 3] {
    [
        exp - SignedDuration::from_hours(30 * 24),
        exp - SignedDuration::from_hours(7 * 24),
        exp,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conditions;

    const NOW: i64 = 1_800_000_000;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn token_expiring_boundaries() {
        let exp = ts(NOW);
        let at = |days_left: i64| token_expiring(exp, ts(NOW - days_left * DAY));
        assert_eq!(
            (at(31).status, at(31).reason),
            (conditions::Status::False, REASON_VALID)
        );
        assert_eq!(
            (at(30).status, at(30).reason),
            (conditions::Status::True, REASON_WITHIN_30)
        );
        assert_eq!(
            at(30).message,
            format!("Token expires on {} (30 days remaining)", rfc3339(exp))
        );
        assert_eq!(at(8).reason, REASON_WITHIN_30);
        assert_eq!(at(7).reason, REASON_WITHIN_7);
        assert_eq!(at(0).reason, REASON_EXPIRED);
        assert_eq!(at(0).message, format!("Token expired on {}", rfc3339(exp)));
        assert_eq!(token_expiring(exp, ts(NOW + 5)).reason, REASON_EXPIRED);
        // Partial days are floored, as Go's int(hours/24).
        assert_eq!(
            token_expiring(exp, ts(NOW - 2 * DAY - 3600)).message,
            format!("Token expires on {} (2 days remaining)", rfc3339(exp))
        );
    }

    #[test]
    fn a_name_with_no_room_for_the_credential_secret_is_reported() {
        assert!(credential_name_too_long("Exporter", &"e".repeat(244), "-exporter").is_none());
        let d = credential_name_too_long("Exporter", &"e".repeat(245), "-exporter").unwrap();
        assert_eq!(d.type_, TOKEN_EXPIRING);
        assert_eq!(d.status, conditions::Status::True);
        assert_eq!(d.reason, REASON_CREDENTIAL_NAME_TOO_LONG);
        assert!(
            d.message
                .contains("254 characters, over the Kubernetes limit of 253"),
            "{}",
            d.message
        );
        assert!(d.message.contains("at most 244 characters"));
        let d = credential_name_too_long("Client", &"c".repeat(250), "-client").unwrap();
        assert!(
            d.message
                .contains("recreate the Client with a name of at most 246")
        );
    }
}

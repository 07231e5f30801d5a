//! External JWT issuers' configuration (`authentication.jwt[]`; docs/exporter.md, "External
//! issuers and the login service"): the subset of Kubernetes' `JWTAuthenticator`
//! (apiserver.config.k8s.io/v1beta1) that upstream's controller takes, read strictly (as
//! upstream's UnmarshalStrict) and validated with a message naming the field. The verifier that
//! uses it is `crate::exporter::auth::oidc`.
//!
//! Supported: `issuer.{url, discoveryURL, audiences, audienceMatchPolicy, certificateAuthority}`,
//! `claimMappings.username.{claim, prefix}` and the expression form `claims.<name>`,
//! `claimMappings.{groups, uid}` (parsed; ucm authorizes by username only, as upstream),
//! `claimValidationRules[].{claim, requiredValue}`. Refused with a message naming the field: any
//! other CEL expression, `claimMappings.extra`, `userValidationRules`.

use std::collections::BTreeMap;

use serde::Deserialize;

/// The issuer of ucm's own tokens (`crate::exporter::auth::token`): no external issuer may
/// take it.
pub const INTERNAL_ISSUER: &str = "https://localhost:8085";

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RawJwtAuthenticator {
    #[serde(default)]
    issuer: RawIssuer,
    #[serde(default)]
    claim_validation_rules: Vec<RawClaimValidationRule>,
    #[serde(default)]
    claim_mappings: RawClaimMappings,
    #[serde(default)]
    user_validation_rules: Vec<serde_json::Value>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawIssuer {
    #[serde(default)]
    url: String,
    #[serde(default, rename = "discoveryURL")]
    discovery_url: Option<String>,
    #[serde(default)]
    certificate_authority: Option<String>,
    #[serde(default)]
    audiences: Vec<String>,
    #[serde(default)]
    audience_match_policy: Option<String>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawClaimValidationRule {
    #[serde(default)]
    claim: Option<String>,
    #[serde(default)]
    required_value: Option<String>,
    #[serde(default)]
    expression: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    message: Option<String>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct RawClaimMappings {
    #[serde(default)]
    username: RawPrefixedClaim,
    #[serde(default)]
    groups: Option<RawPrefixedClaim>,
    #[serde(default)]
    uid: Option<RawPrefixedClaim>,
    #[serde(default)]
    extra: Vec<serde_json::Value>,
}

#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields)]
struct RawPrefixedClaim {
    #[serde(default)]
    claim: Option<String>,
    #[serde(default)]
    prefix: Option<String>,
    #[serde(default)]
    expression: Option<String>,
}

/// A validated issuer.
#[derive(Debug, Clone, PartialEq)]
pub struct JwtAuthenticator {
    pub issuer: String,
    /// Where the discovery document is read (`discoveryURL`, else `<url>/.well-known/openid-configuration`).
    pub discovery_url: String,
    pub audiences: Vec<String>,
    /// PEM certificates trusted for discovery and JWKS (none: the system roots).
    pub certificate_authority: Option<String>,
    /// The username is `<prefix><claims[claim]>`.
    pub username_claim: String,
    pub username_prefix: String,
    /// `claimValidationRules`: claim → required value.
    pub required_claims: BTreeMap<String, String>,
}

/// `claims.<name>` (the one CEL form supported): the claim's name.
fn claim_of_expression(expr: &str) -> Option<&str> {
    let name = expr.trim().strip_prefix("claims.")?;
    (!name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .then_some(name)
}

pub(crate) fn check_url(field: &str, url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("https://")
        .ok_or_else(|| format!("{field} {url:?} must be an https:// URL"))?;
    let host = rest.split('/').next().unwrap_or_default();
    if host.is_empty() || url.contains(['?', '#']) || host.contains('@') {
        return Err(format!(
            "{field} {url:?} must be an https:// URL with a host and no user, query or fragment"
        ));
    }
    Ok(())
}

/// Reads a PEM bundle, or (as upstream) the path of a file holding one.
fn certificate_authority(field: &str, value: &str) -> Result<String, String> {
    let pem = if value.contains("-----BEGIN") {
        value.to_string()
    } else {
        std::fs::read_to_string(value)
            .map_err(|e| format!("{field}: neither PEM nor a readable file ({e})"))?
    };
    // Checked as the HTTPS client will use it, so a bad bundle is a config error, not a gRPC
    // server that cannot start.
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let c = c.map_err(|e| format!("{field}: {e}"))?;
        roots
            .add(c)
            .map_err(|e| format!("{field}: not a usable certificate ({e})"))?;
    }
    if roots.is_empty() {
        return Err(format!("{field}: no PEM certificate found"));
    }
    Ok(pem)
}

/// Validates `authentication.jwt` (`field` is its path in the ConfigMap, for messages). Each
/// entry's fields are checked in the order of the schema; the first problem is the error.
pub fn validate(
    field: &str,
    raw: Vec<RawJwtAuthenticator>,
    internal_prefix: &str,
) -> Result<Vec<JwtAuthenticator>, String> {
    let mut out: Vec<JwtAuthenticator> = Vec::new();
    for (i, a) in raw.into_iter().enumerate() {
        let f = |name: &str| format!("{field}[{i}].{name}");
        let mut v = issuer(&f, a.issuer, &out)?;
        (v.username_claim, v.username_prefix) =
            username(&f, a.claim_mappings.username, internal_prefix)?;
        for (name, m) in [
            ("groups", &a.claim_mappings.groups),
            ("uid", &a.claim_mappings.uid),
        ] {
            if let Some(e) = m.as_ref().and_then(|m| m.expression.as_deref())
                && claim_of_expression(e).is_none()
            {
                return Err(format!(
                    "{} {e:?}: ucm supports only the form claims.<name>",
                    f(&format!("claimMappings.{name}.expression"))
                ));
            }
        }
        if !a.claim_mappings.extra.is_empty() {
            return Err(format!(
                "{} is not supported by ucm (it authorizes by username only)",
                f("claimMappings.extra")
            ));
        }
        if !a.user_validation_rules.is_empty() {
            return Err(format!(
                "{} (CEL) is not supported by ucm; use claimValidationRules with claim and requiredValue",
                f("userValidationRules")
            ));
        }
        v.required_claims = required_claims(&f, a.claim_validation_rules)?;
        out.push(v);
    }
    Ok(out)
}

/// The `issuer` of an entry: its URL (not ucm's own, not configured twice in `known`),
/// discovery URL, audiences and trusted certificates. The username fields are left empty.
fn issuer(
    f: &dyn Fn(&str) -> String,
    raw: RawIssuer,
    known: &[JwtAuthenticator],
) -> Result<JwtAuthenticator, String> {
    // Exact, as Kubernetes compares it with `iss` (Auth0's issuers end in a slash).
    let url = raw.url.clone();
    if raw.url.is_empty() {
        return Err(format!("{} is required", f("issuer.url")));
    }
    check_url(&f("issuer.url"), &url)?;
    if url == INTERNAL_ISSUER {
        return Err(format!(
            "{} {url:?} is the internal issuer of ucm's own tokens",
            f("issuer.url")
        ));
    }
    if known.iter().any(|o| o.issuer == url) {
        return Err(format!("{} {url:?} is configured twice", f("issuer.url")));
    }
    let discovery_url = match raw.discovery_url.filter(|d| !d.is_empty()) {
        Some(d) => {
            check_url(&f("issuer.discoveryURL"), &d)?;
            d
        }
        None => format!(
            "{}/.well-known/openid-configuration",
            url.trim_end_matches('/')
        ),
    };
    if raw.audiences.is_empty() || raw.audiences.iter().any(String::is_empty) {
        return Err(format!(
            "{} must list at least one non-empty audience",
            f("issuer.audiences")
        ));
    }
    match raw.audience_match_policy.as_deref() {
        None | Some("") if raw.audiences.len() == 1 => {}
        Some("MatchAny") => {}
        None | Some("") => {
            return Err(format!(
                "{} must be MatchAny when several audiences are listed",
                f("issuer.audienceMatchPolicy")
            ));
        }
        Some(p) => {
            return Err(format!(
                "{} {p:?} is not supported; accepted: MatchAny",
                f("issuer.audienceMatchPolicy")
            ));
        }
    }
    let ca = raw
        .certificate_authority
        .filter(|c| !c.trim().is_empty())
        .map(|c| certificate_authority(&f("issuer.certificateAuthority"), &c))
        .transpose()?;
    Ok(JwtAuthenticator {
        issuer: url,
        discovery_url,
        audiences: raw.audiences,
        certificate_authority: ca,
        username_claim: String::new(),
        username_prefix: String::new(),
        required_claims: BTreeMap::new(),
    })
}

/// `claimMappings.username`: the claim and prefix, from `claim` + `prefix` or the expression
/// `claims.<name>` (no prefix).
fn username(
    f: &dyn Fn(&str) -> String,
    u: RawPrefixedClaim,
    internal_prefix: &str,
) -> Result<(String, String), String> {
    let (claim, prefix) = match (u.claim.filter(|c| !c.is_empty()), u.expression) {
        (Some(_), Some(_)) => {
            return Err(format!(
                "{} and {} are mutually exclusive",
                f("claimMappings.username.claim"),
                f("claimMappings.username.expression")
            ));
        }
        (Some(claim), None) => {
            let Some(prefix) = u.prefix else {
                return Err(format!(
                    "{} is required when claim is set (use \"\" for none)",
                    f("claimMappings.username.prefix")
                ));
            };
            (claim, prefix)
        }
        (None, Some(expr)) => {
            if u.prefix.is_some() {
                return Err(format!(
                    "{} must not be set with an expression",
                    f("claimMappings.username.prefix")
                ));
            }
            let claim = claim_of_expression(&expr).ok_or_else(|| {
                format!(
                    "{} {expr:?}: ucm supports only the form claims.<name>; use claim and prefix",
                    f("claimMappings.username.expression")
                )
            })?;
            (claim.to_string(), String::new())
        }
        (None, None) => {
            return Err(format!(
                "{} (or expression) is required",
                f("claimMappings.username.claim")
            ));
        }
    };
    // OURS: an external username must never look like an internal one. An empty prefix is
    // allowed; such usernames that start with the internal prefix are refused per token.
    if !prefix.is_empty()
        && (prefix.starts_with(internal_prefix) || internal_prefix.starts_with(&prefix))
    {
        return Err(format!(
            "{} {prefix:?} overlaps the internal prefix {internal_prefix:?}",
            f("claimMappings.username.prefix")
        ));
    }
    Ok((claim, prefix))
}

/// `claimValidationRules`: claim → required value; CEL expressions are refused.
fn required_claims(
    f: &dyn Fn(&str) -> String,
    rules: Vec<RawClaimValidationRule>,
) -> Result<BTreeMap<String, String>, String> {
    let mut required = BTreeMap::new();
    for (j, r) in rules.into_iter().enumerate() {
        let rf = |n: &str| f(&format!("claimValidationRules[{j}].{n}"));
        match (r.claim.filter(|c| !c.is_empty()), r.expression) {
            (Some(c), None) => {
                required.insert(c, r.required_value.unwrap_or_default());
            }
            (None, Some(e)) => {
                return Err(format!(
                    "{} {e:?}: CEL expressions are not supported by ucm; use claim and requiredValue",
                    rf("expression")
                ));
            }
            _ => {
                return Err(format!(
                    "{} needs exactly one of claim and expression",
                    f(&format!("claimValidationRules[{j}]"))
                ));
            }
        }
    }
    Ok(required)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `authentication.jwt` read and validated, for the verifier's tests too.
    pub(crate) fn parse(yaml: &str) -> Result<Vec<JwtAuthenticator>, String> {
        let raw: Vec<RawJwtAuthenticator> =
            serde_saphyr::from_str(yaml).map_err(|e| e.to_string())?;
        validate("authentication.jwt", raw, "internal:")
    }

    pub(crate) const OK: &str = "- issuer:\n    url: https://kc.example.com/realms/lab\n    audiences: [jumpstarter-cli]\n  claimMappings:\n    username:\n      claim: preferred_username\n      prefix: \"kc:\"\n";

    #[test]
    fn the_supported_form_is_read() {
        let a = &parse(OK).unwrap()[0];
        assert_eq!(a.issuer, "https://kc.example.com/realms/lab");
        assert_eq!(
            a.discovery_url,
            "https://kc.example.com/realms/lab/.well-known/openid-configuration"
        );
        assert_eq!(
            (a.username_claim.as_str(), a.username_prefix.as_str()),
            ("preferred_username", "kc:")
        );
        let e = &parse("- issuer: {url: https://a.example, audiences: [x]}\n  claimMappings:\n    username: {expression: claims.email}\n  claimValidationRules:\n  - {claim: hd, requiredValue: example.com}\n").unwrap()[0];
        assert_eq!(
            (e.username_claim.as_str(), e.username_prefix.as_str()),
            ("email", "")
        );
        assert_eq!(e.required_claims["hd"], "example.com");
        // The URL is kept exactly (it must equal `iss`); discovery gets one slash.
        let slash = &parse("- issuer: {url: 'https://tenant.auth0.com/', audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n").unwrap()[0];
        assert_eq!(slash.issuer, "https://tenant.auth0.com/");
        assert_eq!(
            slash.discovery_url,
            "https://tenant.auth0.com/.well-known/openid-configuration"
        );
    }

    #[test]
    fn invalid_forms_name_the_field() {
        for (yaml, want) in [
            (
                "- issuer: {audiences: [x]}\n",
                "authentication.jwt[0].issuer.url is required",
            ),
            (
                "- issuer: {url: http://a, audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n",
                "issuer.url \"http://a\" must be an https:// URL",
            ),
            (
                "- issuer: {url: https://a}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n",
                "issuer.audiences must list",
            ),
            (
                "- issuer: {url: https://a, audiences: [x, y]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n",
                "audienceMatchPolicy must be MatchAny",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n  claimMappings: {username: {claim: sub}}\n",
                "claimMappings.username.prefix is required",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n",
                "claimMappings.username.claim (or expression) is required",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n  claimMappings: {username: {expression: 'claims.a + claims.b'}}\n",
                "supports only the form claims.<name>",
            ),
            (
                "- issuer: {url: https://a, audiences: [x], certificateAuthority: /nonexistent}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n",
                "issuer.certificateAuthority: neither PEM nor a readable file",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: 'internal:x'}}\n",
                "overlaps the internal prefix",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n  claimValidationRules: [{expression: 'claims.x == 1'}]\n",
                "claimValidationRules[0].expression",
            ),
            (
                "- issuer: {url: https://a, audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n  userValidationRules: [{expression: 'true'}]\n",
                "userValidationRules (CEL) is not supported",
            ),
            (
                "- issuer: {url: 'https://localhost:8085', audiences: [x]}\n  claimMappings: {username: {claim: sub, prefix: ''}}\n",
                "internal issuer",
            ),
        ] {
            let e = parse(yaml).unwrap_err();
            assert!(e.contains(want), "{yaml}: {e}");
        }
        let two = format!("{OK}{OK}");
        assert!(parse(&two).unwrap_err().contains("configured twice"));
    }
}

//! The optional ConfigMap `jumpstarter-controller` in the manager's namespace (docs/exporter.md,
//! "Settings and RBAC"): key `config` (strict YAML in upstream's schema), the legacy key
//! `authentication` (upstream's `AuthenticationConfiguration`, used when `config` is absent) and
//! key `router`. Absent means the defaults. Pure: the caller reads the ConfigMap.
//!
//! The reconcilers use `authentication.internal.tokenLifetime`; the rest is parsed and validated
//! here for the gRPC service (prefix, external issuers, ServiceAccount tokens, provisioning,
//! routers, keepalive, lease policy, labels, telemetry).

use std::collections::BTreeMap;

use jiff::SignedDuration;
use serde::Deserialize;

use crate::godur;

pub mod jwt;

use jwt::{JwtAuthenticator, RawJwtAuthenticator};

pub const CONFIGMAP: &str = "jumpstarter-controller";
/// The username prefix of internal identities (`authentication.internal.prefix`).
pub const DEFAULT_PREFIX: &str = "internal:";
/// Upstream's `defaultMaxTags`, used when `leasePolicy.maxTags` is unset or 0.
pub const DEFAULT_MAX_TAGS: u32 = 10;
pub const DEFAULT_TOKEN_LIFETIME: SignedDuration = SignedDuration::from_hours(365 * 24);

/// The validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ControllerConfig {
    /// `authentication.internal.prefix`: internal usernames are `<prefix><sub>`.
    pub prefix: String,
    /// `authentication.internal.tokenLifetime`: lifetime of minted Exporter and Client tokens.
    pub token_lifetime: SignedDuration,
    /// `authentication.k8s.enabled`: tokens the API server accepts (TokenReview).
    pub k8s_auth: bool,
    /// `authentication.jwt[]`: external OIDC issuers.
    pub jwt: Vec<JwtAuthenticator>,
    /// `provisioning.enabled`: an external identity naming a missing Client gets one.
    pub provisioning: bool,
    pub keepalive: Keepalive,
    /// `leasePolicy.maxTags` (10 when unset or 0).
    pub max_tags: u32,
    /// `hiddenLabels.keys`.
    pub hidden_label_keys: Vec<String>,
    /// `deprecatedLabels.keys`: deprecated key → message.
    pub deprecated_label_keys: BTreeMap<String, String>,
    /// `telemetry`, when enabled.
    pub telemetry: Option<Telemetry>,
    /// Key `router`: name → entry. Empty: the one router is `--exporter-router-endpoint`.
    pub routers: BTreeMap<String, RouterEntry>,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_string(),
            token_lifetime: DEFAULT_TOKEN_LIFETIME,
            k8s_auth: false,
            jwt: Vec::new(),
            provisioning: false,
            keepalive: Keepalive::default(),
            max_tags: DEFAULT_MAX_TAGS,
            hidden_label_keys: vec![],
            deprecated_label_keys: BTreeMap::new(),
            telemetry: None,
            routers: BTreeMap::new(),
        }
    }
}

/// `grpc.keepalive`: the server's enforcement policy and parameters. Unset durations are unset
/// (gRPC's own defaults apply), except `minTime` (1 s) and `permitWithoutStream` (true).
#[derive(Debug, Clone, PartialEq)]
pub struct Keepalive {
    pub min_time: SignedDuration,
    pub permit_without_stream: bool,
    pub timeout: Option<SignedDuration>,
    pub interval_time: Option<SignedDuration>,
    pub max_connection_idle: Option<SignedDuration>,
    pub max_connection_age: Option<SignedDuration>,
    pub max_connection_age_grace: Option<SignedDuration>,
}

impl Default for Keepalive {
    fn default() -> Self {
        Self {
            min_time: SignedDuration::from_secs(1),
            permit_without_stream: true,
            timeout: None,
            interval_time: None,
            max_connection_idle: None,
            max_connection_age: None,
            max_connection_age_grace: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Telemetry {
    /// Default `jumpstarter-telemetry.<manager namespace>:9093`.
    pub endpoint: String,
    pub certificate: String,
    /// `logging.filter.minSeverity` (default `info`).
    pub min_severity: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RouterEntry {
    pub endpoint: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

// ---- The YAML schemas (unknown fields are errors, as upstream's UnmarshalStrict) ----

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawConfig {
    #[serde(default)]
    authentication: Option<RawAuthentication>,
    #[serde(default)]
    provisioning: Option<RawProvisioning>,
    #[serde(default)]
    grpc: Option<RawGrpc>,
    #[serde(default)]
    lease_policy: Option<RawLeasePolicy>,
    #[serde(default)]
    hidden_labels: Option<RawHiddenLabels>,
    #[serde(default)]
    deprecated_labels: Option<RawDeprecatedLabels>,
    #[serde(default)]
    telemetry: Option<RawTelemetry>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAuthentication {
    #[serde(default)]
    internal: Option<RawInternal>,
    #[serde(default)]
    k8s: Option<RawK8s>,
    /// apiserver `JWTAuthenticator`s (see [`oidc`]).
    #[serde(default)]
    jwt: Option<Vec<RawJwtAuthenticator>>,
}

/// The legacy key `authentication`: upstream's `AuthenticationConfiguration` document.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawLegacyAuthentication {
    #[serde(default)]
    #[allow(dead_code)]
    api_version: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    kind: Option<String>,
    #[serde(default)]
    internal: Option<RawLegacyInternal>,
    #[serde(default)]
    jwt: Option<Vec<RawJwtAuthenticator>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLegacyInternal {
    #[serde(default)]
    prefix: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawInternal {
    #[serde(default)]
    prefix: Option<String>,
    #[serde(default)]
    token_lifetime: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawK8s {
    #[serde(default)]
    enabled: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawProvisioning {
    #[serde(default)]
    enabled: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawGrpc {
    #[serde(default)]
    keepalive: Option<RawKeepalive>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawKeepalive {
    #[serde(default)]
    min_time: Option<String>,
    #[serde(default)]
    permit_without_stream: Option<bool>,
    #[serde(default)]
    timeout: Option<String>,
    #[serde(default)]
    interval_time: Option<String>,
    #[serde(default)]
    max_connection_idle: Option<String>,
    #[serde(default)]
    max_connection_age: Option<String>,
    #[serde(default)]
    max_connection_age_grace: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawLeasePolicy {
    #[serde(default)]
    max_tags: Option<i64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawHiddenLabels {
    #[serde(default)]
    keys: Option<Vec<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDeprecatedLabels {
    #[serde(default)]
    keys: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTelemetry {
    #[serde(default)]
    enabled: Option<bool>,
    #[serde(default)]
    endpoint: Option<String>,
    #[serde(default)]
    certificate: Option<String>,
    #[serde(default)]
    logging: Option<RawTelemetryLogging>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTelemetryLogging {
    #[serde(default)]
    filter: Option<RawTelemetryFilter>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawTelemetryFilter {
    #[serde(default)]
    min_severity: Option<String>,
}

const SEVERITIES: &[&str] = &["debug", "info", "warning", "error", "critical"];

/// YAML that may be empty (an empty key means all defaults).
fn yaml<T: serde::de::DeserializeOwned + Default>(key: &str, text: &str) -> Result<T, String> {
    if text.trim().is_empty() {
        return Ok(T::default());
    }
    crate::yaml::from_str::<Option<T>>(text)
        .map(Option::unwrap_or_default)
        .map_err(|e| format!("ConfigMap {CONFIGMAP}, key {key}: {e}"))
}

fn duration(field: &str, value: Option<&String>) -> Result<Option<SignedDuration>, String> {
    match value.map(String::as_str) {
        None | Some("") => Ok(None),
        Some(v) => godur::parse_signed(v)
            .map(Some)
            .map_err(|e| format!("ConfigMap {CONFIGMAP}, key config: {field}: {e}")),
    }
}

/// The result of reading the ConfigMap: the configuration plus warnings for settings that are
/// accepted but not acted on.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    pub config: ControllerConfig,
    pub warnings: Vec<String>,
}

/// Validates the ConfigMap's `data` (None: no ConfigMap, all defaults).
pub fn parse(
    data: Option<&BTreeMap<String, String>>,
    manager_namespace: &str,
) -> Result<Loaded, String> {
    let mut cfg = ControllerConfig::default();
    let mut warnings = Vec::new();
    let Some(data) = data else {
        return Ok(Loaded {
            config: cfg,
            warnings,
        });
    };

    if let Some(text) = data.get("router") {
        let routers: BTreeMap<String, RouterEntry> = yaml("router", text)?;
        if let Some((name, _)) = routers.iter().find(|(_, r)| r.endpoint.is_empty()) {
            return Err(format!(
                "ConfigMap {CONFIGMAP}, key router: entry {name} has no endpoint"
            ));
        }
        cfg.routers = routers;
    }

    match (data.get("config"), data.get("authentication")) {
        (Some(text), legacy) => {
            if legacy.is_some() {
                warnings.push(format!(
                    "ConfigMap {CONFIGMAP}: the legacy key authentication is ignored because key config is present"
                ));
            }
            apply_config(&mut cfg, yaml("config", text)?, manager_namespace)?;
        }
        (None, Some(text)) => {
            let legacy: RawLegacyAuthentication = yaml("authentication", text)?;
            if let Some(p) = legacy
                .internal
                .and_then(|i| i.prefix)
                .filter(|p| !p.is_empty())
            {
                cfg.prefix = p;
            }
            cfg.jwt = jwt::validate("jwt", legacy.jwt.unwrap_or_default(), &cfg.prefix)
                .map_err(|e| format!("ConfigMap {CONFIGMAP}, key authentication: {e}"))?;
        }
        (None, None) => {}
    }
    Ok(Loaded {
        config: cfg,
        warnings,
    })
}

fn apply_config(
    cfg: &mut ControllerConfig,
    raw: RawConfig,
    manager_namespace: &str,
) -> Result<(), String> {
    let auth = raw.authentication.unwrap_or_default();
    let internal = auth.internal.unwrap_or_default();
    if let Some(p) = internal.prefix.filter(|p| !p.is_empty()) {
        cfg.prefix = p;
    }
    if let Some(lifetime) = duration(
        "authentication.internal.tokenLifetime",
        internal.token_lifetime.as_ref(),
    )? {
        if lifetime <= SignedDuration::ZERO {
            return Err(format!(
                "ConfigMap {CONFIGMAP}, key config: authentication.internal.tokenLifetime must be greater than 0"
            ));
        }
        cfg.token_lifetime = lifetime;
    }
    cfg.k8s_auth = auth.k8s.and_then(|k| k.enabled).unwrap_or(false);
    cfg.jwt = jwt::validate(
        "authentication.jwt",
        auth.jwt.unwrap_or_default(),
        &cfg.prefix,
    )
    .map_err(|e| format!("ConfigMap {CONFIGMAP}, key config: {e}"))?;
    cfg.provisioning = raw.provisioning.and_then(|p| p.enabled).unwrap_or(false);

    cfg.keepalive = keepalive(raw.grpc.and_then(|g| g.keepalive).unwrap_or_default())?;

    cfg.max_tags = match raw.lease_policy.and_then(|l| l.max_tags) {
        None | Some(0) => DEFAULT_MAX_TAGS,
        Some(n) if n > 0 => u32::try_from(n).map_err(|_| {
            format!("ConfigMap {CONFIGMAP}, key config: leasePolicy.maxTags is too large")
        })?,
        Some(_) => {
            return Err(format!(
                "ConfigMap {CONFIGMAP}, key config: leasePolicy.maxTags must not be negative"
            ));
        }
    };
    cfg.hidden_label_keys = raw.hidden_labels.and_then(|h| h.keys).unwrap_or_default();
    cfg.deprecated_label_keys = raw
        .deprecated_labels
        .and_then(|d| d.keys)
        .unwrap_or_default();

    cfg.telemetry = raw
        .telemetry
        .filter(|t| t.enabled == Some(true))
        .map(|t| telemetry(t, manager_namespace))
        .transpose()?;
    Ok(())
}

/// `grpc.keepalive`: its durations, none negative.
fn keepalive(ka: RawKeepalive) -> Result<Keepalive, String> {
    let field = |name: &str, v: Option<&String>| duration(&format!("grpc.keepalive.{name}"), v);
    let keepalive = Keepalive {
        min_time: field("minTime", ka.min_time.as_ref())?.unwrap_or(Keepalive::default().min_time),
        permit_without_stream: ka.permit_without_stream.unwrap_or(true),
        timeout: field("timeout", ka.timeout.as_ref())?,
        interval_time: field("intervalTime", ka.interval_time.as_ref())?,
        max_connection_idle: field("maxConnectionIdle", ka.max_connection_idle.as_ref())?,
        max_connection_age: field("maxConnectionAge", ka.max_connection_age.as_ref())?,
        max_connection_age_grace: field(
            "maxConnectionAgeGrace",
            ka.max_connection_age_grace.as_ref(),
        )?,
    };
    if [
        Some(keepalive.min_time),
        keepalive.timeout,
        keepalive.interval_time,
        keepalive.max_connection_idle,
        keepalive.max_connection_age,
        keepalive.max_connection_age_grace,
    ]
    .into_iter()
    .flatten()
    .any(|d| d.is_negative())
    {
        return Err(format!(
            "ConfigMap {CONFIGMAP}, key config: grpc.keepalive durations must not be negative"
        ));
    }
    Ok(keepalive)
}

/// An enabled `telemetry`: its endpoint (default: the telemetry Service in the manager's
/// namespace), certificate and minimum severity.
fn telemetry(t: RawTelemetry, manager_namespace: &str) -> Result<Telemetry, String> {
    let logging = t.logging.unwrap_or_default();
    let min_severity = logging
        .filter
        .and_then(|f| f.min_severity)
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "info".into());
    if !SEVERITIES.contains(&min_severity.as_str()) {
        return Err(format!(
            "ConfigMap {CONFIGMAP}, key config: telemetry.logging.filter.minSeverity {min_severity:?} is not valid, accepted values: {}",
            SEVERITIES.join(", ")
        ));
    }
    Ok(Telemetry {
        endpoint: t
            .endpoint
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| format!("jumpstarter-telemetry.{manager_namespace}:9093")),
        certificate: t.certificate.unwrap_or_default(),
        min_severity,
    })
}

/// docs/exporter.md, "Dial and Listen": the router for an exporter with `labels`. One router is
/// always chosen; with several (OURS) the one whose labels match most of the exporter's, ties by
/// name. None: no `router` key.
pub fn choose_router<'a>(
    routers: &'a BTreeMap<String, RouterEntry>,
    labels: &BTreeMap<String, String>,
) -> Option<&'a str> {
    let matches = |r: &RouterEntry| {
        r.labels
            .iter()
            .filter(|(k, v)| labels.get(*k) == Some(*v))
            .count()
    };
    // max_by_key keeps the last maximum; iterate names in reverse so ties go to the first name.
    routers
        .iter()
        .rev()
        .max_by_key(|(_, r)| matches(r))
        .map(|(_, r)| r.endpoint.as_str())
}

#[cfg(test)]
mod tests {
    #[test]
    fn router_choice_most_matching_labels_then_name() {
        let entry = |ep: &str, l: &[(&str, &str)]| RouterEntry {
            endpoint: ep.to_string(),
            labels: l
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let labels: BTreeMap<String, String> = [("site", "a"), ("rack", "1")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(choose_router(&BTreeMap::new(), &labels), None);
        let one = BTreeMap::from([("x".to_string(), entry("x:1", &[("site", "b")]))]);
        assert_eq!(
            choose_router(&one, &labels),
            Some("x:1"),
            "one router is always chosen"
        );
        let many = BTreeMap::from([
            ("a".to_string(), entry("a:1", &[("site", "b")])),
            ("b".to_string(), entry("b:1", &[("site", "a")])),
            (
                "c".to_string(),
                entry("c:1", &[("site", "a"), ("rack", "1")]),
            ),
            (
                "d".to_string(),
                entry("d:1", &[("site", "a"), ("rack", "1")]),
            ),
        ]);
        assert_eq!(
            choose_router(&many, &labels),
            Some("c:1"),
            "most matches, tie by name"
        );
        assert_eq!(
            choose_router(&many, &BTreeMap::new()),
            Some("a:1"),
            "all tie: first name"
        );
    }

    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn ok(pairs: &[(&str, &str)]) -> Loaded {
        parse(Some(&data(pairs)), "ucm-system").unwrap()
    }

    fn err(pairs: &[(&str, &str)]) -> String {
        parse(Some(&data(pairs)), "ucm-system").unwrap_err()
    }

    #[test]
    fn absent_or_empty_means_defaults() {
        let none = parse(None, "ns").unwrap();
        assert_eq!(none.config, ControllerConfig::default());
        assert!(none.warnings.is_empty());
        assert_eq!(none.config.prefix, "internal:");
        assert_eq!(none.config.token_lifetime, SignedDuration::from_hours(8760));
        assert_eq!(none.config.max_tags, 10);
        assert_eq!(ok(&[]).config, ControllerConfig::default());
        assert_eq!(
            ok(&[("config", ""), ("router", "")]).config,
            ControllerConfig::default()
        );
    }

    #[test]
    fn full_upstream_config_is_read() {
        let l = ok(&[
            (
                "config",
                r#"
authentication:
  internal:
    prefix: "lab:"
    tokenLifetime: 720h
  k8s:
    enabled: false
  jwt: []
provisioning:
  enabled: false
grpc:
  keepalive:
    minTime: 5s
    permitWithoutStream: false
    timeout: 30s
    intervalTime: 10s
    maxConnectionIdle: 5m
    maxConnectionAge: 30m
    maxConnectionAgeGrace: 10s
leasePolicy:
  maxTags: 4
hiddenLabels:
  keys: [internal.example.com/id]
deprecatedLabels:
  keys:
    old: use new
telemetry:
  enabled: true
  logging:
    filter:
      minSeverity: warning
"#,
            ),
            (
                "router",
                "default:\n  endpoint: router.example.com:443\n  labels:\n    zone: a\n",
            ),
        ]);
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
        let c = l.config;
        assert_eq!(c.prefix, "lab:");
        assert_eq!(c.token_lifetime, SignedDuration::from_hours(720));
        assert_eq!(
            c.keepalive,
            Keepalive {
                min_time: SignedDuration::from_secs(5),
                permit_without_stream: false,
                timeout: Some(SignedDuration::from_secs(30)),
                interval_time: Some(SignedDuration::from_secs(10)),
                max_connection_idle: Some(SignedDuration::from_mins(5)),
                max_connection_age: Some(SignedDuration::from_mins(30)),
                max_connection_age_grace: Some(SignedDuration::from_secs(10)),
            }
        );
        assert_eq!(c.max_tags, 4);
        assert_eq!(c.hidden_label_keys, vec!["internal.example.com/id"]);
        assert_eq!(c.deprecated_label_keys["old"], "use new");
        let t = c.telemetry.unwrap();
        assert_eq!(t.endpoint, "jumpstarter-telemetry.ucm-system:9093");
        assert_eq!(t.min_severity, "warning");
        let r = &c.routers["default"];
        assert_eq!(r.endpoint, "router.example.com:443");
        assert_eq!(r.labels["zone"], "a");
    }

    #[test]
    fn upstream_defaults_for_partial_config() {
        let c = ok(&[(
            "config",
            "authentication:\n  internal: {}\ngrpc:\n  keepalive: {}\nleasePolicy: {}\ntelemetry:\n  enabled: false\n",
        )])
        .config;
        assert_eq!(c, ControllerConfig::default());
        let c = ok(&[("config", "leasePolicy:\n  maxTags: 0\n")]).config;
        assert_eq!(c.max_tags, 10);
    }

    #[test]
    fn strict_yaml_names_the_unknown_field() {
        let e = err(&[("config", "authentication:\n  internal:\n    prefx: x\n")]);
        assert!(e.contains("key config"), "{e}");
        assert!(e.contains("unknown field `prefx`"), "{e}");
        let e = err(&[("config", "tokenLifetime: 1h\n")]);
        assert!(e.contains("unknown field `tokenLifetime`"), "{e}");
        let e = err(&[("config", "invalid: yaml: content:")]);
        assert!(
            e.starts_with("ConfigMap jumpstarter-controller, key config:"),
            "{e}"
        );
    }

    #[test]
    fn invalid_values_are_reported_with_the_field() {
        for (yaml, want) in [
            (
                "authentication:\n  internal:\n    tokenLifetime: 30d\n",
                "authentication.internal.tokenLifetime: unknown unit \"d\" in duration \"30d\"",
            ),
            (
                "authentication:\n  internal:\n    tokenLifetime: 0s\n",
                "tokenLifetime must be greater than 0",
            ),
            (
                "authentication:\n  internal:\n    tokenLifetime: -1h\n",
                "tokenLifetime must be greater than 0",
            ),
            (
                "grpc:\n  keepalive:\n    timeout: abc\n",
                "grpc.keepalive.timeout: invalid duration",
            ),
            (
                "grpc:\n  keepalive:\n    intervalTime: xyz\n",
                "grpc.keepalive.intervalTime",
            ),
            (
                "grpc:\n  keepalive:\n    maxConnectionAge: -1s\n",
                "must not be negative",
            ),
            (
                "leasePolicy:\n  maxTags: -1\n",
                "maxTags must not be negative",
            ),
            (
                "telemetry:\n  enabled: true\n  logging:\n    filter:\n      minSeverity: loud\n",
                "minSeverity \"loud\" is not valid",
            ),
        ] {
            let e = err(&[("config", yaml)]);
            assert!(e.contains(want), "{yaml}: {e}");
        }
        let e = err(&[("router", "default:\n  labels: {a: b}\n")]);
        assert!(e.contains("key router"), "{e}");
        let e = err(&[("router", "default:\n  endpoint: \"\"\n")]);
        assert!(e.contains("entry default has no endpoint"), "{e}");
    }

    #[test]
    fn legacy_authentication_key_is_accepted() {
        let l = ok(&[(
            "authentication",
            "apiVersion: jumpstarter.dev/v1alpha1\nkind: AuthenticationConfiguration\ninternal:\n  prefix: \"old:\"\njwt:\n- issuer:\n    url: https://dex.example.com\n    audiences: [jumpstarter]\n  claimMappings:\n    username:\n      claim: email\n      prefix: \"dex:\"\n",
        )]);
        assert_eq!(l.config.prefix, "old:");
        assert_eq!(l.config.token_lifetime, DEFAULT_TOKEN_LIFETIME);
        assert_eq!(l.config.jwt.len(), 1);
        assert_eq!(l.config.jwt[0].issuer, "https://dex.example.com");
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
        // Strict too.
        let e = err(&[("authentication", "internal:\n  tokenLifetime: 1h\n")]);
        assert!(e.contains("key authentication"), "{e}");
        // With both keys, config wins (as upstream) and the legacy key is reported as ignored.
        let l = ok(&[
            (
                "config",
                "authentication:\n  internal:\n    prefix: \"new:\"\n",
            ),
            ("authentication", "internal:\n  prefix: \"old:\"\n"),
        ]);
        assert_eq!(l.config.prefix, "new:");
        assert!(l.warnings[0].contains("legacy key authentication is ignored"));
    }

    #[test]
    fn authentication_settings_are_read() {
        let l = ok(&[(
            "config",
            "authentication:\n  k8s:\n    enabled: true\n  jwt:\n  - issuer: {url: https://a, audiences: [x]}\n    claimMappings: {username: {claim: sub, prefix: 'a:'}}\nprovisioning:\n  enabled: true\n",
        )]);
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
        assert!(l.config.k8s_auth && l.config.provisioning);
        assert_eq!(l.config.jwt[0].username_prefix, "a:");
        let e = err(&[(
            "config",
            "authentication:\n  jwt:\n  - issuer: {url: https://a}\n",
        )]);
        assert!(
            e.starts_with("ConfigMap jumpstarter-controller, key config: authentication.jwt[0].issuer.audiences"),
            "{e}"
        );
    }
}

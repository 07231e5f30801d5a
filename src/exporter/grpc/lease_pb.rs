//! Pure conversions between the CRD objects and `jumpstarter.client.v1` messages (docs/exporter.md,
//! "ClientService" and "Lease time fields"): resource identifiers, label-selector text, Go duration
//! strings, the lease time fields, and the Exporter/Lease views `jmp` reads. No IO here.

use std::collections::{BTreeMap, HashMap};

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    Condition, LabelSelector, LabelSelectorRequirement, ObjectMeta, Time,
};
use kube::ResourceExt;

use crate::conditions;
use crate::exporter::config::ControllerConfig;
use crate::exporter::crd::{Exporter, ExporterStatusValue, Lease, LeaseSpec, LocalObjectReference};
use crate::exporter::decide::exporter::ONLINE;
use crate::exporter::lease::selector;
use crate::exporter::proto::jumpstarter::client::v1 as cpb;
use crate::exporter::proto::jumpstarter::v1 as pb;
use crate::godur;

/// Lease labels mirroring `spec.tags` carry this prefix (docs/exporter.md, "Lease time fields").
pub const TAG_LABEL_PREFIX: &str = "metadata.jumpstarter.dev/";
/// `leasePolicy.maxTags` default (upstream's; the CRD caps tags at 10 as well).
pub const DEFAULT_MAX_TAGS: usize = 10;

// ---------------------------------------------------------------------------------------------
// Identifiers: `namespaces/<ns>` and `namespaces/<ns>/<kind>/<name>`
// ---------------------------------------------------------------------------------------------

pub fn parse_namespace(id: &str) -> Result<String, String> {
    match id.split('/').collect::<Vec<_>>().as_slice() {
        ["namespaces", ns] if !ns.is_empty() => Ok((*ns).to_string()),
        _ => Err(format!(
            "invalid parent {id:?}: expected namespaces/<namespace>"
        )),
    }
}

/// `(namespace, name)` of `namespaces/<ns>/<kind>/<name>`.
pub fn parse_object(id: &str, kind: &str) -> Result<(String, String), String> {
    match id.split('/').collect::<Vec<_>>().as_slice() {
        ["namespaces", ns, k, name] if *k == kind && !ns.is_empty() && !name.is_empty() => {
            Ok(((*ns).to_string(), (*name).to_string()))
        }
        _ => Err(format!(
            "invalid name {id:?}: expected namespaces/<namespace>/{kind}/<name>"
        )),
    }
}

pub fn object_id(ns: &str, kind: &str, name: &str) -> String {
    format!("namespaces/{ns}/{kind}/{name}")
}

// ---------------------------------------------------------------------------------------------
// Label selector text (`labels.Parse` syntax) to metav1.LabelSelector
// ---------------------------------------------------------------------------------------------

/// Splits on commas outside parentheses.
fn split_requirements(text: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (vec![], 0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&text[start..]);
    out
}

fn check_key(key: &str) -> Result<&str, String> {
    if key.is_empty()
        || key
            .chars()
            .any(|c| c.is_whitespace() || "=!(),".contains(c))
    {
        return Err(format!("invalid label key {key:?}"));
    }
    Ok(key)
}

fn check_value(v: &str) -> Result<String, String> {
    let v = v.trim();
    if v.chars().any(|c| c.is_whitespace() || "=!(),".contains(c)) {
        return Err(format!("invalid label value {v:?}"));
    }
    Ok(v.to_string())
}

fn expr(key: &str, op: &str, values: Vec<String>) -> LabelSelectorRequirement {
    LabelSelectorRequirement {
        key: key.to_string(),
        operator: op.to_string(),
        values: Some(values),
    }
}

/// Parses selector text as `jmp -l` sends it: `k=v`, `k==v` (matchLabels), `k!=v` (NotIn, merged
/// per key), `k in (a,b)`, `k notin (a,b)`, `k` (Exists), `!k` (DoesNotExist). Empty text is the
/// empty selector. Two different equality values for one key are an error.
pub fn parse_selector(text: &str) -> Result<LabelSelector, String> {
    let mut labels: BTreeMap<String, String> = BTreeMap::new();
    let mut exprs: Vec<LabelSelectorRequirement> = vec![];
    let mut not_equal: BTreeMap<String, Vec<String>> = BTreeMap::new();
    if text.trim().is_empty() {
        return Ok(LabelSelector::default());
    }
    for raw in split_requirements(text) {
        let req = raw.trim();
        if req.is_empty() {
            return Err(format!("invalid selector {text:?}: empty requirement"));
        }
        if let Some(key) = req.strip_prefix('!') {
            exprs.push(expr(check_key(key.trim())?, "DoesNotExist", vec![]));
        } else if let Some(open) = req.find('(') {
            let (head, tail) = req.split_at(open);
            let inner = tail
                .strip_prefix('(')
                .and_then(|t| t.strip_suffix(')'))
                .ok_or_else(|| format!("invalid selector {text:?}: unbalanced parentheses"))?;
            let mut words = head.split_whitespace();
            let (Some(key), Some(op), None) = (words.next(), words.next(), words.next()) else {
                return Err(format!("invalid selector requirement {req:?}"));
            };
            let op = match op {
                "in" => "In",
                "notin" => "NotIn",
                other => return Err(format!("unsupported selector operator {other:?}")),
            };
            let values = inner
                .split(',')
                .map(check_value)
                .collect::<Result<Vec<_>, _>>()?;
            if values.iter().all(String::is_empty) {
                return Err(format!("invalid selector requirement {req:?}: no values"));
            }
            exprs.push(expr(check_key(key)?, op, values));
        } else if let Some((k, v)) = req.split_once("!=") {
            let vals = not_equal
                .entry(check_key(k.trim())?.to_string())
                .or_default();
            let v = check_value(v)?;
            if !vals.contains(&v) {
                vals.push(v);
            }
        } else if let Some((k, v)) = req.split_once("==").or_else(|| req.split_once('=')) {
            let key = check_key(k.trim())?.to_string();
            let v = check_value(v)?;
            match labels.get(&key) {
                Some(old) if *old != v => {
                    return Err(format!(
                        "invalid selector: label {key} cannot have multiple equality requirements with different values ({old} and {v})"
                    ));
                }
                _ => {
                    labels.insert(key, v);
                }
            }
        } else if req.contains(['<', '>']) {
            return Err(format!("unsupported selector operator in {req:?}"));
        } else {
            exprs.push(expr(check_key(req)?, "Exists", vec![]));
        }
    }
    for (k, vals) in not_equal {
        exprs.push(expr(&k, "NotIn", vals));
    }
    Ok(LabelSelector {
        match_labels: (!labels.is_empty()).then_some(labels),
        match_expressions: (!exprs.is_empty()).then_some(exprs),
    })
}

/// `tag_filter` keys prefixed with [`TAG_LABEL_PREFIX`], as selector text.
pub fn tag_filter_selector(tag_filter: &str) -> Result<Option<String>, String> {
    let sel = parse_selector(tag_filter)?;
    if selector::is_empty(&sel) {
        return Ok(None);
    }
    let prefixed = LabelSelector {
        match_labels: sel.match_labels.map(|m| {
            m.into_iter()
                .map(|(k, v)| (format!("{TAG_LABEL_PREFIX}{k}"), v))
                .collect()
        }),
        match_expressions: sel.match_expressions.map(|es| {
            es.into_iter()
                .map(|mut e| {
                    e.key = format!("{TAG_LABEL_PREFIX}{}", e.key);
                    e
                })
                .collect()
        }),
    };
    Ok(Some(selector::format(&prefixed)))
}

// ---------------------------------------------------------------------------------------------
// Durations and times
// ---------------------------------------------------------------------------------------------

pub fn ts_from_pb(t: &prost_types::Timestamp) -> Result<Timestamp, String> {
    Timestamp::new(t.seconds, t.nanos).map_err(|e| format!("invalid timestamp: {e}"))
}

pub fn ts_to_pb(t: &Time) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.0.as_second(),
        nanos: t.0.subsec_nanosecond(),
    }
}

pub fn dur_from_pb(d: &prost_types::Duration) -> SignedDuration {
    SignedDuration::new(d.seconds, d.nanos)
}

pub fn dur_to_pb(d: SignedDuration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs(),
        nanos: d.subsec_nanos(),
    }
}

/// The requested times of a lease (docs/exporter.md, "Lease time fields").
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TimeFields {
    pub begin: Option<Timestamp>,
    pub end: Option<Timestamp>,
    pub duration: Option<SignedDuration>,
}

/// `ReconcileLeaseTimeFields`: begin+end derive the duration (a given one must agree), end+duration
/// derive the begin; a duration is then required and must be positive.
pub fn reconcile_time_fields(t: TimeFields) -> Result<TimeFields, String> {
    let mut out = t;
    match (t.begin, t.end, t.duration) {
        (Some(b), Some(e), d) => {
            let calculated = e.duration_since(b);
            if d.is_some_and(|d| d.is_positive() && d != calculated) {
                return Err("duration conflicts with begin_time and end_time".into());
            }
            out.duration = Some(calculated);
        }
        (None, Some(e), Some(d)) if d.is_positive() => {
            out.begin = Some(e - d);
        }
        _ => {}
    }
    match out.duration {
        None => Err(
            "duration is required (must specify Duration, or both BeginTime and EndTime)".into(),
        ),
        Some(d) if !d.is_positive() => Err(format!(
            "duration must be positive, got {}",
            godur::format_signed(d)
        )),
        Some(_) => Ok(out),
    }
}

/// The spec's time fields, parsed (a duration the API accepted but Go cannot parse is absent).
pub fn spec_times(spec: &LeaseSpec) -> TimeFields {
    TimeFields {
        begin: spec.begin_time.as_ref().map(|t| t.0),
        end: spec.end_time.as_ref().map(|t| t.0),
        duration: spec
            .duration
            .as_deref()
            .and_then(|d| godur::parse_signed(d).ok()),
    }
}

/// Writes time fields into a spec at whole seconds (docs/exporter.md, "Objects").
pub fn set_spec_times(spec: &mut LeaseSpec, t: TimeFields) {
    spec.begin_time = t.begin.map(conditions::time);
    spec.end_time = t.end.map(conditions::time);
    spec.duration = t.duration.map(godur::format_signed);
}

// ---------------------------------------------------------------------------------------------
// Tags
// ---------------------------------------------------------------------------------------------

fn valid_label_value(v: &str) -> bool {
    v.len() <= 63
        && (v.is_empty()
            || (v.starts_with(|c: char| c.is_ascii_alphanumeric())
                && v.ends_with(|c: char| c.is_ascii_alphanumeric())
                && v.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))))
}

/// `ValidateLeaseTags`: at most `max` entries, simple keys (no prefix, no `/`) that form valid
/// label keys under [`TAG_LABEL_PREFIX`], valid label values.
pub fn validate_tags(tags: &BTreeMap<String, String>, max: usize) -> Result<(), String> {
    if tags.len() > max {
        return Err(format!("too many tags: {} (maximum {max})", tags.len()));
    }
    for (k, v) in tags {
        if k.starts_with(TAG_LABEL_PREFIX) || k.starts_with("jumpstarter.dev/") {
            return Err(format!("tag key {k:?} must not use reserved prefix"));
        }
        if k.contains('/') {
            return Err(format!(
                "tag key {k:?} must not contain '/' (use simple names without prefix)"
            ));
        }
        if k.is_empty() || !valid_label_value(k) {
            return Err(format!("tag key {k:?} is not a valid label key"));
        }
        if !valid_label_value(v) {
            return Err(format!(
                "tag value for key {k:?} is not a valid label value"
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Lease and Exporter messages
// ---------------------------------------------------------------------------------------------

/// The Lease a gRPC create makes (`LeaseFromProtobuf`): selector parsed from text, time fields
/// reconciled, matchLabels copied to the labels (tag-prefixed ones excluded) plus the mirrored tags.
pub fn lease_from_pb(
    req: &cpb::Lease,
    namespace: &str,
    name: &str,
    client: &str,
) -> Result<Lease, String> {
    let sel = parse_selector(&req.selector)?;
    let times = reconcile_time_fields(TimeFields {
        begin: req.begin_time.as_ref().map(ts_from_pb).transpose()?,
        end: req.end_time.as_ref().map(ts_from_pb).transpose()?,
        duration: req.duration.as_ref().map(dur_from_pb),
    })?;
    let tags: BTreeMap<String, String> = req.tags.clone().into_iter().collect();
    let exporter = req.exporter_name.clone().filter(|n| !n.is_empty());
    let mut spec = LeaseSpec {
        client_ref: LocalObjectReference::new(client),
        selector: sel,
        tags: (!tags.is_empty()).then(|| tags.clone()),
        exporter_ref: exporter.map(LocalObjectReference::new),
        allow_disabled: req.allow_disabled.then_some(true),
        ..Default::default()
    };
    set_spec_times(&mut spec, times);
    Ok(new_lease(namespace, name, spec, &tags))
}

/// The legacy `ControllerService.RequestLease`: a selector message and a duration.
pub fn lease_from_request(
    req: &pb::RequestLeaseRequest,
    namespace: &str,
    name: &str,
    client: &str,
) -> Result<Lease, String> {
    let sel = req.selector.clone().unwrap_or_default();
    let selector = LabelSelector {
        match_labels: (!sel.match_labels.is_empty())
            .then(|| sel.match_labels.into_iter().collect()),
        match_expressions: (!sel.match_expressions.is_empty()).then(|| {
            sel.match_expressions
                .into_iter()
                .map(|e| LabelSelectorRequirement {
                    key: e.key,
                    operator: e.operator,
                    values: Some(e.values),
                })
                .collect()
        }),
    };
    selector::validate(&selector).map_err(|e| e.0)?;
    let times = reconcile_time_fields(TimeFields {
        duration: req.duration.as_ref().map(dur_from_pb),
        ..Default::default()
    })?;
    let mut spec = LeaseSpec {
        client_ref: LocalObjectReference::new(client),
        selector,
        ..Default::default()
    };
    set_spec_times(&mut spec, times);
    Ok(new_lease(namespace, name, spec, &BTreeMap::new()))
}

fn new_lease(ns: &str, name: &str, spec: LeaseSpec, tags: &BTreeMap<String, String>) -> Lease {
    let mut labels: BTreeMap<String, String> = spec
        .selector
        .match_labels
        .iter()
        .flatten()
        .filter(|(k, _)| !k.starts_with(TAG_LABEL_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, v) in tags {
        labels.insert(format!("{TAG_LABEL_PREFIX}{k}"), v.clone());
    }
    let mut lease = Lease::new(name, spec);
    lease.metadata = ObjectMeta {
        name: Some(name.to_string()),
        namespace: Some(ns.to_string()),
        labels: (!labels.is_empty()).then_some(labels),
        ..Default::default()
    };
    lease
}

fn condition_to_pb(c: &Condition) -> pb::Condition {
    pb::Condition {
        r#type: Some(c.type_.clone()),
        status: Some(c.status.clone()),
        observed_generation: Some(c.observed_generation.unwrap_or_default()),
        last_transition_time: Some(pb::Time {
            seconds: Some(c.last_transition_time.0.as_second()),
            nanos: Some(c.last_transition_time.0.subsec_nanosecond()),
        }),
        reason: Some(c.reason.clone()),
        message: Some(c.message.clone()),
    }
}

/// `Lease.ToProtobuf`: requested times from the spec, effective ones from the status (the
/// effective duration runs to `now` while the lease is active).
pub fn lease_to_pb(l: &Lease, now: Timestamp) -> cpb::Lease {
    let ns = l.namespace().unwrap_or_default();
    let st = l.status.clone().unwrap_or_default();
    let effective_duration = st.begin_time.as_ref().map(|b| {
        let end = st.end_time.as_ref().map_or(now, |e| e.0);
        dur_to_pb(end.duration_since(b.0).max(SignedDuration::ZERO))
    });
    cpb::Lease {
        name: object_id(&ns, "leases", &l.name_any()),
        selector: selector::format(&l.spec.selector),
        duration: l
            .spec
            .duration
            .as_deref()
            .and_then(|d| godur::parse_signed(d).ok())
            .map(dur_to_pb),
        effective_duration,
        begin_time: l.spec.begin_time.as_ref().map(ts_to_pb),
        effective_begin_time: st.begin_time.as_ref().map(ts_to_pb),
        end_time: l.spec.end_time.as_ref().map(ts_to_pb),
        effective_end_time: st.end_time.as_ref().map(ts_to_pb),
        client: Some(object_id(&ns, "clients", &l.spec.client_ref.name)),
        exporter: st
            .exporter_ref_name()
            .map(|e| object_id(&ns, "exporters", e)),
        conditions: st
            .conditions
            .iter()
            .flatten()
            .map(condition_to_pb)
            .collect(),
        exporter_name: l.spec.exporter_ref_name().map(str::to_string),
        tags: l
            .spec
            .tags
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect(),
        allow_disabled: l.spec.allow_disabled.unwrap_or(false),
        deprecated_labels: Default::default(),
    }
}

/// The proto enum value of an `exporterStatus` (absent is Unspecified).
pub fn status_to_pb(v: Option<ExporterStatusValue>) -> i32 {
    let v = v.unwrap_or(ExporterStatusValue::Unspecified);
    ExporterStatusValue::ALL
        .iter()
        .position(|x| *x == v)
        .unwrap_or_default() as i32
}

/// `Exporter.ToProtobuf`: `online` (deprecated) is `Online=True`; `enabled` defaults to true.
#[allow(deprecated)]
pub fn exporter_to_pb(e: &Exporter, cfg: &ControllerConfig) -> cpb::Exporter {
    let st = e.status.clone().unwrap_or_default();
    // `hiddenLabels` are never shown; `deprecatedLabels` are shown apart, with their message.
    let (mut labels, mut deprecated) = (HashMap::new(), HashMap::new());
    for (k, v) in e.labels() {
        if let Some(msg) = cfg.deprecated_label_keys.get(k) {
            deprecated.insert(k.clone(), msg.clone());
        } else if !cfg.hidden_label_keys.contains(k) {
            labels.insert(k.clone(), v.clone());
        }
    }
    cpb::Exporter {
        name: object_id(
            &e.namespace().unwrap_or_default(),
            "exporters",
            &e.name_any(),
        ),
        labels,
        online: conditions::is_true(st.conditions.as_deref().unwrap_or_default(), ONLINE),
        status: status_to_pb(st.exporter_status),
        status_message: st.status_message.unwrap_or_default(),
        enabled: Some(e.spec.is_enabled()),
        deprecated_labels: deprecated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(text: &str) -> serde_json::Value {
        serde_json::to_value(parse_selector(text).unwrap()).unwrap()
    }

    #[test]
    fn selector_text_as_jmp_sends_it() {
        assert_eq!(sel(""), serde_json::json!({}));
        assert_eq!(
            sel("board=rpi, arch==arm64"),
            serde_json::json!({"matchLabels": {"arch": "arm64", "board": "rpi"}})
        );
        assert_eq!(
            sel("a!=x,a!=y,b in (1, 2),c notin (z),d,!e"),
            serde_json::json!({"matchExpressions": [
                {"key": "b", "operator": "In", "values": ["1", "2"]},
                {"key": "c", "operator": "NotIn", "values": ["z"]},
                {"key": "d", "operator": "Exists", "values": []},
                {"key": "e", "operator": "DoesNotExist", "values": []},
                {"key": "a", "operator": "NotIn", "values": ["x", "y"]},
            ]})
        );
        assert_eq!(
            sel("a=x,a=x"),
            serde_json::json!({"matchLabels": {"a": "x"}})
        );
        for bad in ["a=x,a=y", "a in (x", "a gt (1)", ",", "a>1", "a b"] {
            assert!(parse_selector(bad).is_err(), "{bad} accepted");
        }
        // Round trip through the metav1 formatter the Lease view uses.
        let s = parse_selector("b in (1,2),a=x").unwrap();
        assert_eq!(selector::format(&s), "a=x,b in (1,2)");
        assert_eq!(
            tag_filter_selector("team=a").unwrap().as_deref(),
            Some("metadata.jumpstarter.dev/team=a")
        );
        assert_eq!(tag_filter_selector("").unwrap(), None);
    }

    #[test]
    fn identifiers() {
        assert_eq!(parse_namespace("namespaces/lab").unwrap(), "lab");
        assert_eq!(
            parse_object("namespaces/lab/leases/l1", "leases").unwrap(),
            ("lab".into(), "l1".into())
        );
        assert!(parse_object("namespaces/lab/exporters/l1", "leases").is_err());
        assert!(parse_namespace("lab").is_err());
        assert!(parse_namespace("namespaces/").is_err());
    }

    #[test]
    fn time_fields_table_of_6_6() {
        let t0: Timestamp = "2030-01-01T00:00:00Z".parse().unwrap();
        let h = SignedDuration::from_hours(1);
        let ok = |b, e, d| {
            reconcile_time_fields(TimeFields {
                begin: b,
                end: e,
                duration: d,
            })
        };
        // duration only: starts now.
        assert_eq!(
            ok(None, None, Some(h)).unwrap(),
            TimeFields {
                begin: None,
                end: None,
                duration: Some(h)
            }
        );
        // begin + end: duration derived; begin after end rejected.
        assert_eq!(ok(Some(t0), Some(t0 + h), None).unwrap().duration, Some(h));
        assert!(ok(Some(t0 + h), Some(t0), None).is_err());
        // end + duration: begin derived.
        assert_eq!(ok(None, Some(t0 + h), Some(h)).unwrap().begin, Some(t0));
        // all three must agree.
        assert!(ok(Some(t0), Some(t0 + h), Some(h)).is_ok());
        assert_eq!(
            ok(Some(t0), Some(t0 + h), Some(h * 2)).unwrap_err(),
            "duration conflicts with begin_time and end_time"
        );
        // end only, or no positive duration: rejected.
        assert!(
            ok(None, Some(t0), None)
                .unwrap_err()
                .starts_with("duration is required")
        );
        assert!(ok(None, None, Some(SignedDuration::ZERO)).is_err());
        assert!(ok(None, None, Some(-h)).is_err());
    }

    #[test]
    fn tags_are_checked() {
        let t = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        assert!(validate_tags(&t("build", "a-1"), 10).is_ok());
        assert!(validate_tags(&t("x/y", "a"), 10).is_err());
        assert!(validate_tags(&t("jumpstarter.dev/x", "a"), 10).is_err());
        assert!(validate_tags(&t("ok", "bad value"), 10).is_err());
        assert!(validate_tags(&t("ok", "a"), 0).is_err());
    }

    #[test]
    fn lease_from_create_request_and_back() {
        let req = cpb::Lease {
            selector: "board=rpi".into(),
            duration: Some(dur_to_pb(SignedDuration::from_mins(30))),
            tags: [("build".to_string(), "42".to_string())].into(),
            ..Default::default()
        };
        let mut l = lease_from_pb(&req, "lab", "l1", "alice").unwrap();
        assert_eq!(l.spec.duration.as_deref(), Some("30m0s"));
        assert_eq!(l.spec.client_ref.name, "alice");
        assert_eq!(
            l.labels(),
            &BTreeMap::from([
                ("board".to_string(), "rpi".to_string()),
                (
                    "metadata.jumpstarter.dev/build".to_string(),
                    "42".to_string()
                ),
            ])
        );
        assert!(l.spec.exporter_ref.is_none());
        // Neither selector nor exporter: the CEL rule would refuse it; the view still converts.
        let begin: Timestamp = "2030-01-01T00:00:00Z".parse().unwrap();
        l.status = Some(crate::exporter::crd::LeaseStatus {
            begin_time: Some(Time(begin)),
            exporter_ref: Some(LocalObjectReference::new("e1")),
            ..Default::default()
        });
        let v = lease_to_pb(&l, begin + SignedDuration::from_secs(90));
        assert_eq!(v.name, "namespaces/lab/leases/l1");
        assert_eq!(v.client.as_deref(), Some("namespaces/lab/clients/alice"));
        assert_eq!(v.exporter.as_deref(), Some("namespaces/lab/exporters/e1"));
        assert_eq!(v.selector, "board=rpi");
        assert_eq!(v.duration.unwrap().seconds, 1800);
        assert_eq!(v.effective_duration.unwrap().seconds, 90);
        assert!(v.effective_end_time.is_none());
        assert_eq!(v.tags.get("build").map(String::as_str), Some("42"));

        let pinned = cpb::Lease {
            exporter_name: Some("e1".into()),
            duration: Some(dur_to_pb(SignedDuration::from_hours(1))),
            allow_disabled: true,
            ..Default::default()
        };
        let l = lease_from_pb(&pinned, "lab", "l2", "alice").unwrap();
        assert_eq!(l.spec.exporter_ref_name(), Some("e1"));
        assert_eq!(l.spec.allow_disabled, Some(true));
        assert_eq!(lease_to_pb(&l, begin).selector, "<none>");
        assert!(lease_from_pb(&cpb::Lease::default(), "lab", "l3", "alice").is_err());
    }

    #[test]
    fn legacy_request_lease() {
        let req = pb::RequestLeaseRequest {
            duration: Some(dur_to_pb(SignedDuration::from_mins(5))),
            selector: Some(pb::LabelSelector {
                match_labels: [("board".to_string(), "rpi".to_string())].into(),
                match_expressions: vec![],
            }),
        };
        let l = lease_from_request(&req, "lab", "l1", "alice").unwrap();
        assert_eq!(l.spec.duration.as_deref(), Some("5m0s"));
        assert_eq!(l.labels().get("board").map(String::as_str), Some("rpi"));
        assert!(lease_from_request(&pb::RequestLeaseRequest::default(), "lab", "l", "a").is_err());
    }

    #[test]
    #[allow(deprecated)]
    fn exporter_view() {
        let mut e = Exporter::new("e1", Default::default());
        e.metadata.namespace = Some("lab".into());
        e.metadata.labels = Some(BTreeMap::from([("board".into(), "rpi".into())]));
        let v = exporter_to_pb(&e, &ControllerConfig::default());
        assert_eq!(v.name, "namespaces/lab/exporters/e1");
        assert_eq!((v.online, v.status, v.enabled), (false, 0, Some(true)));
        e.spec.enabled = Some(false);
        e.status = Some(crate::exporter::crd::ExporterStatus {
            exporter_status: Some(ExporterStatusValue::LeaseReady),
            status_message: Some("Ready for commands".into()),
            ..Default::default()
        });
        let v = exporter_to_pb(&e, &ControllerConfig::default());
        assert_eq!(v.status, pb::ExporterStatus::LeaseReady as i32);
        assert_eq!(v.status_message, "Ready for commands");
        assert_eq!(v.enabled, Some(false));
    }
}

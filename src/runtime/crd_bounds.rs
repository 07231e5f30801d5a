//! Schema bounds for values the API server admits but ucm cannot represent. `format: date-time`
//! admits any RFC 3339 year up to 9999, while ucm's timestamps end on 9999-12-30: one such
//! object would be unreadable (docs/runtime.md, "Unreadable objects"). Every date-time field of
//! every CRD is bounded: outside `status`, by a CEL rule whose message states the limit; inside
//! `status` (written by controllers, not typed by people), by a `pattern` on the date. A schema
//! with any CEL rule makes the API server add "some validation rules were not checked" to every
//! type error, so an Exporter (whose only timestamps are in its status) answers
//! `spec.enabled: "yes"` with the type error alone.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Value, json};

/// The latest timestamp a ucm CRD accepts (jiff's range ends at 9999-12-30T22:00Z).
pub const MAX_TIMESTAMP: &str = "9999-12-30T00:00:00Z";

fn rule() -> Value {
    json!({
        "rule": format!("self <= timestamp('{MAX_TIMESTAMP}')"),
        "message": format!("must be at most {MAX_TIMESTAMP}, the latest time ucm can represent"),
    })
}

/// The dates up to 9999-12-28 (any time, any offset: at most 9999-12-29T23:59:59Z), as a
/// pattern on an RFC 3339 date-time: stricter than [`rule`] by two days, for status only.
pub const STATUS_TIMESTAMP_PATTERN: &str = r"^([0-8][0-9]{3}|9[0-8][0-9]{2}|99[0-8][0-9]|999[0-8]|9999-(0[1-9]|1[01])|9999-12-([01][0-9]|2[0-8]))";

fn walk(schema: &mut Value, in_status: bool) {
    let Some(obj) = schema.as_object_mut() else {
        return;
    };
    if obj.get("type") == Some(&json!("string")) && obj.get("format") == Some(&json!("date-time")) {
        if in_status {
            obj.insert("pattern".into(), json!(STATUS_TIMESTAMP_PATTERN));
            return;
        }
        let rules = obj
            .entry("x-kubernetes-validations")
            .or_insert_with(|| json!([]));
        if let Some(list) = rules.as_array_mut()
            && !list.contains(&rule())
        {
            list.push(rule());
        }
    }
    for key in ["properties", "patternProperties", "definitions"] {
        if let Some(Value::Object(props)) = obj.get_mut(key) {
            props.values_mut().for_each(|v| walk(v, in_status));
        }
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(v) = obj.get_mut(key) {
            walk(v, in_status);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(Value::Array(list)) = obj.get_mut(key) {
            list.iter_mut().for_each(|v| walk(v, in_status));
        }
    }
}

/// The root of a version's schema: `status` is walked as status, everything else not.
fn walk_root(schema: &mut Value) {
    let Some(Value::Object(props)) = schema.get_mut("properties") else {
        return walk(schema, false);
    };
    for (name, v) in props.iter_mut() {
        walk(v, name == "status");
    }
}

/// Adds the timestamp bound to every `format: date-time` string of every served version.
pub fn bound_timestamps(crd: CustomResourceDefinition) -> CustomResourceDefinition {
    let mut v = serde_json::to_value(&crd).expect("a CRD serialises");
    if let Some(versions) = v["spec"]["versions"].as_array_mut() {
        for ver in versions {
            walk_root(&mut ver["schema"]["openAPIV3Schema"]);
        }
    }
    serde_json::from_value(v).expect("a bounded CRD deserialises")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lease_timestamp_is_bounded() {
        let crd = crate::exporter::crds()
            .into_iter()
            .find(|c| c.metadata.name.as_deref() == Some("leases.jumpstarter.dev"))
            .unwrap();
        let v = serde_json::to_value(bound_timestamps(crd)).unwrap();
        let s = &v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"];
        for field in [
            &s["spec"]["properties"]["beginTime"],
            &s["spec"]["properties"]["endTime"],
        ] {
            let rules = field["x-kubernetes-validations"].as_array().unwrap();
            assert!(rules.contains(&rule()), "{field}");
        }
        let status_time = &s["status"]["properties"]["beginTime"];
        assert_eq!(status_time["pattern"], json!(STATUS_TIMESTAMP_PATTERN));
        assert!(status_time.get("x-kubernetes-validations").is_none());
        // Idempotent.
        let again =
            serde_json::to_value(bound_timestamps(serde_json::from_value(v.clone()).unwrap()))
                .unwrap();
        assert_eq!(again, v);
    }

    /// The Exporter's timestamps are all in its status: no CEL rule anywhere in its schema, so a
    /// type error in its spec comes without "some validation rules were not checked".
    #[test]
    fn the_exporter_schema_has_no_cel_rule() {
        let crd = crate::exporter::crds()
            .into_iter()
            .find(|c| c.metadata.name.as_deref() == Some("exporters.jumpstarter.dev"))
            .unwrap();
        let v = serde_json::to_string(&bound_timestamps(crd)).unwrap();
        assert!(!v.contains("x-kubernetes-validations"));
        assert!(v.contains(STATUS_TIMESTAMP_PATTERN));
    }
}

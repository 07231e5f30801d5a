//! Schema bounds for values the API server admits but ucm cannot represent. `format: date-time`
//! admits any RFC 3339 year up to 9999, while ucm's timestamps end on 9999-12-30: one such
//! object would be unreadable (docs/runtime.md, "Unreadable objects"). Every date-time field of
//! every CRD gets a CEL rule that refuses it with a message stating the limit.

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

fn walk(schema: &mut Value) {
    let Some(obj) = schema.as_object_mut() else {
        return;
    };
    if obj.get("type") == Some(&json!("string")) && obj.get("format") == Some(&json!("date-time")) {
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
            props.values_mut().for_each(walk);
        }
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(v) = obj.get_mut(key) {
            walk(v);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(Value::Array(list)) = obj.get_mut(key) {
            list.iter_mut().for_each(walk);
        }
    }
}

/// Adds the timestamp bound to every `format: date-time` string of every served version.
pub fn bound_timestamps(crd: CustomResourceDefinition) -> CustomResourceDefinition {
    let mut v = serde_json::to_value(&crd).expect("a CRD serialises");
    if let Some(versions) = v["spec"]["versions"].as_array_mut() {
        for ver in versions {
            walk(&mut ver["schema"]["openAPIV3Schema"]);
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
            &s["status"]["properties"]["beginTime"],
        ] {
            let rules = field["x-kubernetes-validations"].as_array().unwrap();
            assert!(rules.contains(&rule()), "{field}");
        }
        // Idempotent.
        let again =
            serde_json::to_value(bound_timestamps(serde_json::from_value(v.clone()).unwrap()))
                .unwrap();
        assert_eq!(again, v);
    }
}

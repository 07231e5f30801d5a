//! Objects the schema admitted but ucm cannot read (a timestamp past what it can represent, say):
//! the reconciler skips them, and the object itself says why, in a condition naming the field
//! (type `Invalid`, reason `UnreadableObject`) and a Warning event, so its owner can fix it.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{ApiResource, DynamicObject, ObjectMeta};
use kube::runtime::events::EventType;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tracing::warn;

use super::writer::Writer;

pub const CONDITION: &str = "Invalid";
pub const REASON: &str = "UnreadableObject";

/// Why `value` does not decode as `K`: the field's path (`spec.beginTime`) and serde's error.
pub fn why_unreadable<K: DeserializeOwned>(value: Value) -> Option<(String, String)> {
    match serde_path_to_error::deserialize::<_, K>(value) {
        Ok(_) => None,
        Err(e) => Some((e.path().to_string(), e.inner().to_string())),
    }
}

/// The condition message: the field, the error, and what to do.
pub fn message(path: &str, error: &str) -> String {
    let mut m = format!(
        "ucm cannot read field {path}: {error}; fix or remove that field (timestamps must be at most 9999-12-30T00:00:00Z); until then ucm ignores this object"
    );
    super::text::cut_at_char_boundary(&mut m, 1000);
    m
}

/// The `status.conditions` list with the `Invalid` condition set to `message`, or `None` when
/// it already says so (an unchanged unreadable object costs no write).
pub fn desired_conditions(
    status: &Value,
    message: &str,
    generation: Option<i64>,
    now: &str,
) -> Option<Vec<Value>> {
    let mut conds = status["conditions"].as_array().cloned().unwrap_or_default();
    if conds.iter().any(|c| {
        c["type"] == CONDITION
            && c["status"] == "True"
            && c["reason"] == REASON
            && c["message"] == message
    }) {
        return None;
    }
    conds.retain(|c| c["type"] != CONDITION);
    let mut c = json!({"type": CONDITION, "status": "True", "reason": REASON,
        "message": message, "lastTransitionTime": now});
    if let Some(g) = generation {
        c["observedGeneration"] = json!(g);
    }
    conds.push(c);
    Some(conds)
}

/// The status body: the object's status with the conditions, and a zero value for each field
/// the status schema requires that is missing (an object nobody wrote a status for yet, such as
/// a Lease's `ended`), so that the API server accepts the write.
pub fn status_body(status: &Value, conditions: Vec<Value>, schema: &Value) -> Value {
    let mut out = serde_json::Map::new();
    for field in schema["required"].as_array().into_iter().flatten() {
        let Some(field) = field.as_str() else {
            continue;
        };
        if status.get(field).is_none() {
            let zero = match schema["properties"][field]["type"].as_str() {
                Some("boolean") => json!(false),
                Some("integer" | "number") => json!(0),
                Some("array") => json!([]),
                Some("object") => json!({}),
                _ => json!(""),
            };
            out.insert(field.to_string(), zero);
        }
    }
    out.insert("conditions".into(), Value::Array(conditions));
    Value::Object(out)
}

/// The `status` schema of the CRD's storage version.
fn status_schema<K: kube::CustomResourceExt>() -> Value {
    let crd = serde_json::to_value(K::crd()).unwrap_or_default();
    crd["spec"]["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["storage"] == true)
        .map(|v| v["schema"]["openAPIV3Schema"]["properties"]["status"].clone())
        .unwrap_or_default()
}

/// Reads the object raw, finds the field it cannot be read at and reports it (leader only;
/// failures are logged: the object is skipped either way).
pub async fn report<K>(client: &kube::Client, writer: &Writer, meta: &ObjectMeta)
where
    K: Resource<DynamicType = ()> + DeserializeOwned + kube::CustomResourceExt,
{
    if !writer.is_leader() {
        return;
    }
    let ar = ApiResource::erase::<K>(&());
    let Some(name) = meta.name.as_deref() else {
        return;
    };
    let api: Api<DynamicObject> = match meta.namespace.as_deref() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let raw = match api.get_opt(name).await {
        Ok(Some(raw)) => raw,
        Ok(None) => return,
        Err(e) => {
            warn!(kind = %ar.kind, name, error = %e, "cannot read the unreadable object raw");
            return;
        }
    };
    let Ok(value) = serde_json::to_value(&raw) else {
        return;
    };
    let Some((path, error)) = why_unreadable::<K>(value) else {
        return; // readable again: its change event brings a normal pass
    };
    let msg = message(&path, &error);
    let now = jiff::fmt::strtime::format("%Y-%m-%dT%H:%M:%SZ", jiff::Timestamp::now())
        .unwrap_or_default();
    let Some(conds) = desired_conditions(&raw.data["status"], &msg, raw.metadata.generation, &now)
    else {
        return;
    };
    let status = status_body(&raw.data["status"], conds, &status_schema::<K>());
    let rv = raw.metadata.resource_version.clone().unwrap_or_default();
    match writer.merge_status_fenced(&api, name, &rv, &status).await {
        Ok(_) => {}
        Err(crate::runtime::WriteError::NotLeader) => return,
        Err(e) => {
            warn!(kind = %ar.kind, name, error = %e, "cannot write the UnreadableObject condition");
        }
    }
    let regarding = ObjectReference {
        api_version: Some(ar.api_version.clone()),
        kind: Some(ar.kind.clone()),
        name: Some(name.to_string()),
        namespace: meta.namespace.clone(),
        uid: meta.uid.clone(),
        resource_version: meta.resource_version.clone(),
        ..Default::default()
    };
    writer
        .event(&regarding, EventType::Warning, REASON, "Read", msg)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::crd::Lease;

    #[test]
    fn names_the_field_a_lease_cannot_be_read_at() {
        let lease = json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
            "metadata": {"name": "l", "namespace": "n"},
            "spec": {"clientRef": {"name": "c"}, "selector": {},
                     "beginTime": "9999-12-31T23:59:59Z"}});
        let (path, _) = why_unreadable::<Lease>(lease.clone()).expect("unreadable");
        assert_eq!(path, "spec.beginTime");
        let mut ok = lease;
        ok["spec"]["beginTime"] = json!("2026-01-01T00:00:00Z");
        assert!(why_unreadable::<Lease>(ok).is_none());
    }

    #[test]
    fn a_status_nobody_wrote_gets_its_required_fields() {
        let schema = status_schema::<Lease>();
        let body = status_body(&Value::Null, vec![json!({"type": CONDITION})], &schema);
        assert_eq!(
            body,
            json!({"ended": false, "conditions": [{"type": CONDITION}]})
        );
        let body = status_body(&json!({"ended": true}), vec![], &schema);
        assert_eq!(body, json!({"conditions": []}));
    }

    #[test]
    fn the_condition_is_written_once_and_keeps_the_others() {
        let status = json!({"conditions": [{"type": "Pending", "status": "True"}]});
        let msg = message("spec.beginTime", "overflow");
        let conds = desired_conditions(&status, &msg, Some(2), "2026-01-01T00:00:00Z").unwrap();
        assert_eq!(conds.len(), 2);
        assert_eq!(conds[1]["reason"], REASON);
        assert_eq!(conds[1]["observedGeneration"], 2);
        let again = json!({ "conditions": conds });
        assert!(desired_conditions(&again, &msg, Some(2), "2026-01-01T00:00:09Z").is_none());
    }
}

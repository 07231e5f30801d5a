//! Hand-written schema pieces for the upstream-compatible Jumpstarter CRDs.
//!
//! schemars derives most of the schema from the Rust types. The pieces here are the Kubernetes
//! types whose upstream (controller-gen) schema carries validation or list/map markers that the
//! k8s-openapi schemars impls lack: `metav1.Condition`, `LocalObjectReference`, `LabelSelector`.
//! `fixup_crd` then removes what schemars adds but upstream has not (`nullable`, a required
//! `spec`), so the generated CRD is a superset of upstream's (checked by `compat_tests`).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use schemars::{Schema, SchemaGenerator, json_schema};
use serde_json::Value;

/// `[]metav1.Condition` exactly as upstream's controller-gen output (note its double space).
pub fn conditions(_: &mut SchemaGenerator) -> Schema {
    crate::conditions::metav1_schema(
        "lastTransitionTime is the last time the condition transitioned from one status to another.\nThis should be when the underlying condition changed.  If that is not known, then using the time when the API field changed is acceptable.",
    )
}

/// `corev1.LocalObjectReference`: `name` defaults to "" and the reference is atomic.
pub fn local_object_reference(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "properties": {
            "name": {
                "default": "",
                "description": "Name of the referent.\nThis field is effectively required, but due to backwards compatibility is\nallowed to be empty. Instances of this type with an empty value here are\nalmost certainly wrong.\nMore info: https://kubernetes.io/docs/concepts/overview/working-with-objects/names/#names",
                "type": "string"
            }
        },
        "x-kubernetes-map-type": "atomic"
    })
}

/// `metav1.LabelSelector` as controller-gen renders it (atomic map, atomic lists).
pub fn label_selector(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "properties": {
            "matchExpressions": {
                "description": "matchExpressions is a list of label selector requirements. The requirements are ANDed.",
                "type": "array",
                "items": {
                    "description": "A label selector requirement is a selector that contains values, a key, and an operator that\nrelates the key and values.",
                    "type": "object",
                    "required": ["key", "operator"],
                    "properties": {
                        "key": {
                            "description": "key is the label key that the selector applies to.",
                            "type": "string"
                        },
                        "operator": {
                            "description": "operator represents a key's relationship to a set of values.\nValid operators are In, NotIn, Exists and DoesNotExist.",
                            "type": "string"
                        },
                        "values": {
                            "description": "values is an array of string values. If the operator is In or NotIn,\nthe values array must be non-empty. If the operator is Exists or DoesNotExist,\nthe values array must be empty. This array is replaced during a strategic\nmerge patch.",
                            "type": "array",
                            "items": {"type": "string"},
                            "x-kubernetes-list-type": "atomic"
                        }
                    }
                },
                "x-kubernetes-list-type": "atomic"
            },
            "matchLabels": {
                "description": "matchLabels is a map of {key,value} pairs. A single {key,value} in the matchLabels\nmap is equivalent to an element of matchExpressions, whose key field is \"key\", the\noperator is \"In\", and the values array contains only \"value\". The requirements are ANDed.",
                "type": "object",
                "additionalProperties": {"type": "string"}
            }
        },
        "x-kubernetes-map-type": "atomic"
    })
}

/// A plain Go `int` field: controller-gen emits no `format`.
pub fn integer(_: &mut SchemaGenerator) -> Schema {
    json_schema!({"type": "integer"})
}

/// A `metav1.Duration` field: a Go duration string such as `1h30m`.
pub fn duration(_: &mut SchemaGenerator) -> Schema {
    json_schema!({"type": "string"})
}

/// Removes what the derive adds but upstream does not declare.
///
/// - `nullable: true` and the `null` enum value on every `Option` field: upstream fields are not
///   nullable, and ucm never writes null (absent fields are omitted).
/// - the root `required: [spec]`: upstream's `spec` is `omitempty`, so a spec-less object is valid.
///
/// And adds what controller-gen declares but the derive leaves out: `listKind` and the root
/// `apiVersion`, `kind` and `metadata` properties.
pub fn fixup_crd(mut crd: CustomResourceDefinition) -> CustomResourceDefinition {
    if crd.spec.names.list_kind.is_none() {
        crd.spec.names.list_kind = Some(format!("{}List", crd.spec.names.kind));
    }
    for version in &mut crd.spec.versions {
        let Some(validation) = version.schema.as_mut() else {
            continue;
        };
        let Some(props) = validation.open_api_v3_schema.take() else {
            continue;
        };
        let mut value = serde_json::to_value(props).expect("schema serialises");
        strip_nullable(&mut value);
        if let Value::Object(root) = &mut value {
            root.remove("required");
            root.remove("title");
            root.insert("type".into(), Value::String("object".into()));
            let props = root
                .entry("properties")
                .or_insert_with(|| Value::Object(Default::default()));
            if let Value::Object(props) = props {
                props.insert("apiVersion".into(), serde_json::json!({
                    "description": "APIVersion defines the versioned schema of this representation of an object.\nServers should convert recognized schemas to the latest internal value, and\nmay reject unrecognized values.\nMore info: https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md#resources",
                    "type": "string"
                }));
                props.insert("kind".into(), serde_json::json!({
                    "description": "Kind is a string value representing the REST resource this object represents.\nServers may infer this from the endpoint the client submits requests to.\nCannot be updated.\nIn CamelCase.\nMore info: https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md#types-kinds",
                    "type": "string"
                }));
                props.insert("metadata".into(), serde_json::json!({"type": "object"}));
            }
        }
        validation.open_api_v3_schema =
            Some(serde_json::from_value(value).expect("schema deserialises"));
    }
    crd
}

fn strip_nullable(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.remove("nullable");
            if let Some(Value::Array(values)) = map.get_mut("enum") {
                values.retain(|v| !v.is_null());
            }
            map.values_mut().for_each(strip_nullable);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_nullable),
        _ => {}
    }
}

//! The generated CRDs are a superset of upstream's v0.9.0 CRDs (docs/exporter.md, "Objects"), which
//! this test reads as reference data from [`reference_dir`].
//!
//! Every upstream schema node must exist in ucm's CRD with identical keywords (type, format,
//! default, required, enum, CEL rules, list/map markers, limits; descriptions compared with
//! whitespace collapsed). The only additions allowed are the seed's Exporter status fields, the
//! Lease's `status.queue` (docs/exporter.md, "Lease scheduling") and the enum validations.
//! Names, scope, printer columns and subresources must match.

use std::path::PathBuf;

use serde_json::{Map, Value};

use crate::exporter::crds;

fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/reference/jumpstarter-crds")
}

fn load_upstream(file: &str) -> Value {
    let path = reference_dir().join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("upstream CRD {} must be readable: {e}", path.display()));
    serde_saphyr::from_str(&text).expect("upstream CRD parses")
}

fn generated(name: &str) -> Value {
    let crd = crds()
        .into_iter()
        .find(|c| c.metadata.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("ucm generates {name}"));
    serde_json::to_value(crd).unwrap()
}

/// Paths (in ucm's schema) where ucm may add something upstream lacks.
struct Allowed {
    added_properties: &'static [&'static str],
    added_enums: &'static [&'static str],
}

const NONE: Allowed = Allowed {
    added_properties: &[],
    added_enums: &[],
};

const EXPORTER: Allowed = Allowed {
    added_properties: &[
        ".status.leaseHooks",
        ".status.recordsLeaseHooks",
        ".status.tokenExpiresAt",
    ],
    added_enums: &[],
};

const LEASE: Allowed = Allowed {
    added_properties: &[".status.queue"],
    added_enums: &[],
};

fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn compare(
    path: &str,
    up: &Map<String, Value>,
    ours: &Map<String, Value>,
    allowed: &Allowed,
    errors: &mut Vec<String>,
) {
    for (key, up_value) in up {
        let Some(our_value) = ours.get(key) else {
            errors.push(format!("{path}: missing keyword `{key}`"));
            continue;
        };
        match key.as_str() {
            "properties" => {
                let (Some(up_props), Some(our_props)) =
                    (up_value.as_object(), our_value.as_object())
                else {
                    errors.push(format!("{path}: properties is not an object"));
                    continue;
                };
                for (name, up_child) in up_props {
                    let child_path = format!("{path}.{name}");
                    match our_props.get(name) {
                        None => errors.push(format!("{child_path}: missing property")),
                        Some(our_child) => compare(
                            &child_path,
                            up_child.as_object().unwrap(),
                            our_child.as_object().unwrap(),
                            allowed,
                            errors,
                        ),
                    }
                }
                for name in our_props.keys().filter(|n| !up_props.contains_key(*n)) {
                    let child_path = format!("{path}.{name}");
                    if !allowed.added_properties.contains(&child_path.as_str()) {
                        errors.push(format!("{child_path}: property not in upstream"));
                    }
                }
            }
            "items" | "additionalProperties" if up_value.is_object() => compare(
                &format!("{path}[{key}]"),
                up_value.as_object().unwrap(),
                our_value.as_object().unwrap_or(&Map::new()),
                allowed,
                errors,
            ),
            "description" => {
                if collapse(up_value.as_str().unwrap_or_default())
                    != collapse(our_value.as_str().unwrap_or_default())
                {
                    errors.push(format!(
                        "{path}: description differs: {our_value} vs upstream {up_value}"
                    ));
                }
            }
            // JSONSchemaProps holds limits as f64, so `0` comes back as `0.0`.
            _ if up_value.is_number() && our_value.is_number() => {
                if up_value.as_f64() != our_value.as_f64() {
                    errors.push(format!(
                        "{path}: `{key}` is {our_value}, upstream {up_value}"
                    ));
                }
            }
            _ => {
                if up_value != our_value {
                    errors.push(format!(
                        "{path}: `{key}` is {our_value}, upstream {up_value}"
                    ));
                }
            }
        }
    }
    for key in ours.keys().filter(|k| !up.contains_key(*k)) {
        let allowed_here = match key.as_str() {
            "enum" => allowed.added_enums.contains(&path),
            // A description where upstream has none only adds `kubectl explain` text.
            "description" => true,
            _ => false,
        };
        if !allowed_here {
            errors.push(format!(
                "{path}: keyword `{key}` not in upstream: {}",
                ours[key]
            ));
        }
    }
}

fn check(file: &str, name: &str, allowed: &Allowed) {
    let up = load_upstream(file);
    let ours = generated(name);
    let mut errors = Vec::new();

    assert_eq!(ours["spec"]["group"], up["spec"]["group"]);
    assert_eq!(ours["spec"]["names"], up["spec"]["names"], "{name}: names");
    assert_eq!(ours["spec"]["scope"], up["spec"]["scope"], "{name}: scope");
    let up_versions = up["spec"]["versions"].as_array().unwrap();
    let our_versions = ours["spec"]["versions"].as_array().unwrap();
    assert_eq!(
        up_versions.len(),
        our_versions.len(),
        "{name}: version count"
    );
    for (u, o) in up_versions.iter().zip(our_versions) {
        for key in [
            "name",
            "served",
            "storage",
            "subresources",
            "additionalPrinterColumns",
        ] {
            assert_eq!(o.get(key), u.get(key), "{name}: versions[].{key}");
        }
        compare(
            "",
            u["schema"]["openAPIV3Schema"].as_object().unwrap(),
            o["schema"]["openAPIV3Schema"].as_object().unwrap(),
            allowed,
            &mut errors,
        );
    }
    assert!(
        errors.is_empty(),
        "{name} is not a superset of upstream:\n{}",
        errors.join("\n")
    );
}

#[test]
fn exporter_crd_is_upstream_superset() {
    check(
        "jumpstarter.dev_exporters.yaml",
        "exporters.jumpstarter.dev",
        &EXPORTER,
    );
}

#[test]
fn lease_crd_is_upstream_superset() {
    check(
        "jumpstarter.dev_leases.yaml",
        "leases.jumpstarter.dev",
        &LEASE,
    );
}

#[test]
fn client_crd_is_upstream_superset() {
    check(
        "jumpstarter.dev_clients.yaml",
        "clients.jumpstarter.dev",
        &NONE,
    );
}

#[test]
fn exporter_access_policy_crd_is_upstream_superset() {
    check(
        "jumpstarter.dev_exporteraccesspolicies.yaml",
        "exporteraccesspolicies.jumpstarter.dev",
        &NONE,
    );
}

/// The Exporter's enums are validated by the schema (docs/exporter.md, "Objects").
#[test]
fn exporter_schema_validates_seed_enums() {
    let crd = generated("exporters.jumpstarter.dev");
    let status = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
    assert_eq!(
        status["exporterStatus"]["enum"],
        serde_json::json!([
            "Unspecified",
            "Offline",
            "Available",
            "BeforeLeaseHook",
            "LeaseReady",
            "AfterLeaseHook",
            "BeforeLeaseHookFailed",
            "AfterLeaseHookFailed"
        ])
    );
    for hook in ["beforeLease", "afterLease"] {
        let h = &status["leaseHooks"]["properties"][hook]["properties"];
        assert_eq!(
            h["phase"]["enum"],
            serde_json::json!(["Running", "Succeeded", "Failed", "Skipped"])
        );
        assert_eq!(
            h["onFailure"]["enum"],
            serde_json::json!(["warn", "endLease", "exit"])
        );
        assert_eq!(h["attempts"]["type"], "integer");
        assert_eq!(h["lastTransitionTime"]["format"], "date-time");
    }
    let lh = &status["leaseHooks"]["properties"];
    assert_eq!(lh["leaseUID"]["type"], "string");
    assert_eq!(lh["clientName"]["type"], "string");
    assert_eq!(lh["leaseRef"]["properties"]["name"]["type"], "string");
    assert_eq!(status["recordsLeaseHooks"]["type"], "boolean");
    assert_eq!(status["tokenExpiresAt"]["format"], "date-time");
    assert!(!serde_json::to_string(&crd).unwrap().contains("nullable"));
}

/// The whole schema is structural: every node has a type, and no untyped maps.
#[test]
fn schemas_are_structural() {
    fn walk(path: &str, node: &Value, errors: &mut Vec<String>) {
        let Some(obj) = node.as_object() else { return };
        if !obj.contains_key("type") && !obj.contains_key("x-kubernetes-preserve-unknown-fields") {
            errors.push(format!("{path}: no type"));
        }
        for bad in ["anyOf", "oneOf", "allOf", "$ref"] {
            if obj.contains_key(bad) {
                errors.push(format!("{path}: {bad}"));
            }
        }
        if let Some(props) = obj.get("properties").and_then(Value::as_object) {
            for (k, v) in props {
                walk(&format!("{path}.{k}"), v, errors);
            }
        }
        for key in ["items", "additionalProperties"] {
            if let Some(v) = obj.get(key).filter(|v| v.is_object()) {
                walk(&format!("{path}[{key}]"), v, errors);
            }
        }
    }
    for crd in crds() {
        let v = serde_json::to_value(&crd).unwrap();
        let mut errors = Vec::new();
        walk(
            "",
            &v["spec"]["versions"][0]["schema"]["openAPIV3Schema"],
            &mut errors,
        );
        assert!(errors.is_empty(), "{:?}: {errors:?}", crd.metadata.name);
    }
}

/// The comparator itself catches a dropped field, a retyped field, a changed default and an
/// extra keyword, so a passing superset test means something.
#[test]
fn comparator_detects_differences() {
    let up = load_upstream("jumpstarter.dev_leases.yaml");
    let up_schema = up["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        .as_object()
        .unwrap()
        .clone();
    let ours = generated("leases.jumpstarter.dev");
    let our_schema = ours["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        .as_object()
        .unwrap()
        .clone();
    type Mutation = (&'static str, fn(&mut Value));
    let mutations: [Mutation; 4] = [
        ("drop", |s| {
            s["properties"]["spec"]["properties"]
                .as_object_mut()
                .unwrap()
                .remove("release");
        }),
        ("retype", |s| {
            s["properties"]["status"]["properties"]["ended"]["type"] = "string".into();
        }),
        ("default", |s| {
            s["properties"]["spec"]["properties"]["selector"]["default"] =
                serde_json::json!({"matchLabels": {}});
        }),
        ("extra", |s| {
            s["properties"]["spec"]["properties"]["tags"]["minProperties"] = 1.into();
        }),
    ];
    let mut clean = Vec::new();
    compare("", &up_schema, &our_schema, &LEASE, &mut clean);
    assert!(clean.is_empty(), "{clean:?}");
    for (name, mutate) in mutations {
        let mut mutated = Value::Object(our_schema.clone());
        mutate(&mut mutated);
        let mut errors = Vec::new();
        compare(
            "",
            &up_schema,
            mutated.as_object().unwrap(),
            &NONE,
            &mut errors,
        );
        assert!(!errors.is_empty(), "mutation {name} went unnoticed");
    }
}

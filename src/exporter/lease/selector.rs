//! `metav1.LabelSelector` matching and formatting (apimachinery semantics).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::k8s_names;

/// A selector that cannot be evaluated (an unknown operator or a malformed requirement).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidSelector(pub String);

/// True when the selector has neither `matchLabels` nor `matchExpressions` entries.
pub fn is_empty(selector: &LabelSelector) -> bool {
    selector
        .match_labels
        .as_ref()
        .is_none_or(BTreeMap::is_empty)
        && selector
            .match_expressions
            .as_ref()
            .is_none_or(Vec::is_empty)
}

/// Whether `labels` satisfy every requirement. An empty selector matches everything.
pub fn matches(
    selector: &LabelSelector,
    labels: &BTreeMap<String, String>,
) -> Result<bool, InvalidSelector> {
    validate(selector)?;
    Ok(matches_valid(selector, labels))
}

/// [`matches`] for a selector [`validate`] accepted: no checks per call, for loops over many
/// label sets (a lease decision reads every Exporter of its namespace).
pub fn matches_valid(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let labels_ok = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let exprs_ok = selector.match_expressions.iter().flatten().all(|req| {
        let values = req.values.as_deref().unwrap_or_default();
        let current = labels.get(&req.key);
        match req.operator.as_str() {
            "In" => current.is_some_and(|v| values.contains(v)),
            "NotIn" => current.is_none_or(|v| !values.contains(v)),
            "Exists" => current.is_some(),
            _ => current.is_none(), // DoesNotExist (validated)
        }
    });
    labels_ok && exprs_ok
}

/// apimachinery's label key check (`IsQualifiedName`).
fn key_problem(key: &str) -> Option<String> {
    (!k8s_names::is_qualified_name(key)).then(|| {
        format!(
            "key: Invalid value: {key:?}: a label key is an optional DNS subdomain prefix and '/', then a name of at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        )
    })
}

/// apimachinery's label value check (`IsValidLabelValue`): empty, or a name part.
fn value_problem(key: &str, value: &str) -> Option<String> {
    (!k8s_names::is_label_value(value)).then(|| {
        format!(
            "values: Invalid value: {value:?} (key {key:?}): a label value is empty or at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        )
    })
}

/// The checks of `LabelSelectorAsSelector`: known operators, values present for In/NotIn and
/// absent for Exists/DoesNotExist, and well-formed label keys and values.
pub fn validate(selector: &LabelSelector) -> Result<(), InvalidSelector> {
    for (k, v) in selector.match_labels.iter().flatten() {
        if let Some(p) = key_problem(k).or_else(|| value_problem(k, v)) {
            return Err(InvalidSelector(p));
        }
    }
    for req in selector.match_expressions.iter().flatten() {
        if let Some(p) = key_problem(&req.key).or_else(|| {
            req.values
                .iter()
                .flatten()
                .find_map(|v| value_problem(&req.key, v))
        }) {
            return Err(InvalidSelector(p));
        }
        let n = req.values.as_ref().map_or(0, Vec::len);
        match req.operator.as_str() {
            "In" | "NotIn" if n == 0 => {
                return Err(InvalidSelector(format!(
                    "values: Invalid value: []: for 'in', 'notin' operators, values set can't be empty (key {:?})",
                    req.key
                )));
            }
            "Exists" | "DoesNotExist" if n != 0 => {
                return Err(InvalidSelector(format!(
                    "values: Invalid value: for 'exists', 'doesnotexist' operators, values set must be empty (key {:?})",
                    req.key
                )));
            }
            "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
            other => {
                return Err(InvalidSelector(format!(
                    "{other:?} is not a valid label selector operator"
                )));
            }
        }
    }
    Ok(())
}

/// `metav1.FormatLabelSelector`: requirements sorted by key, `<none>` when empty.
pub fn format(selector: &LabelSelector) -> String {
    let mut parts: Vec<(String, String)> = Vec::new();
    for (k, v) in selector.match_labels.iter().flatten() {
        parts.push((k.clone(), format!("{k}={v}")));
    }
    for req in selector.match_expressions.iter().flatten() {
        let mut values = req.values.clone().unwrap_or_default();
        values.sort();
        values.dedup();
        let text = match req.operator.as_str() {
            "In" => format!("{} in ({})", req.key, values.join(",")),
            "NotIn" => format!("{} notin ({})", req.key, values.join(",")),
            "Exists" => req.key.clone(),
            "DoesNotExist" => format!("!{}", req.key),
            other => format!("{} {other} ({})", req.key, values.join(",")),
        };
        parts.push((req.key.clone(), text));
    }
    parts.sort_by(|a, b| a.0.cmp(&b.0));
    if parts.is_empty() {
        return "<none>".to_string();
    }
    parts
        .into_iter()
        .map(|(_, t)| t)
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn req(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: (!values.is_empty()).then(|| values.iter().map(|v| v.to_string()).collect()),
        }
    }

    #[test]
    fn empty_selector_matches_everything() {
        let s = LabelSelector::default();
        assert!(is_empty(&s));
        assert!(matches(&s, &labels(&[])).unwrap());
        assert!(matches(&s, &labels(&[("a", "b")])).unwrap());
        let s = LabelSelector {
            match_labels: Some(BTreeMap::new()),
            match_expressions: Some(vec![]),
        };
        assert!(is_empty(&s));
    }

    #[test]
    fn match_labels_and_expressions_are_anded() {
        let s = LabelSelector {
            match_labels: Some(labels(&[("board", "rpi")])),
            match_expressions: Some(vec![
                req("site", "In", &["a", "b"]),
                req("broken", "DoesNotExist", &[]),
                req("tier", "NotIn", &["prod"]),
                req("owner", "Exists", &[]),
            ]),
        };
        assert!(!is_empty(&s));
        let good = labels(&[("board", "rpi"), ("site", "a"), ("owner", "x")]);
        assert!(matches(&s, &good).unwrap());
        let mut bad = good.clone();
        bad.insert("broken".into(), "yes".into());
        assert!(!matches(&s, &bad).unwrap());
        let mut bad = good.clone();
        bad.insert("site".into(), "c".into());
        assert!(!matches(&s, &bad).unwrap());
        let mut bad = good.clone();
        bad.insert("tier".into(), "prod".into());
        assert!(!matches(&s, &bad).unwrap());
        let mut bad = good.clone();
        bad.remove("owner");
        assert!(!matches(&s, &bad).unwrap());
        let mut bad = good;
        bad.insert("board".into(), "qemu".into());
        assert!(!matches(&s, &bad).unwrap());
    }

    #[test]
    fn invalid_selectors_are_reported() {
        for r in [
            req("a", "Equals", &["x"]),
            req("a", "In", &[]),
            req("a", "Exists", &["x"]),
        ] {
            let s = LabelSelector {
                match_expressions: Some(vec![r]),
                ..Default::default()
            };
            assert!(matches(&s, &labels(&[])).is_err());
        }
    }

    #[test]
    fn malformed_label_keys_and_values_are_reported() {
        let bad_labels = [
            ("bad key!", "x"),
            ("", "x"),
            ("Example.com/a", "x"),
            ("a/b/c", "x"),
            (&*"k".repeat(64), "x"),
            ("a", "not valid"),
            ("a", &*"v".repeat(64)),
            ("a", "-x"),
        ];
        for (k, v) in bad_labels {
            let s = LabelSelector {
                match_labels: Some(labels(&[(k, v)])),
                ..Default::default()
            };
            assert!(validate(&s).is_err(), "{k:?}={v:?}");
        }
        let s = LabelSelector {
            match_expressions: Some(vec![req("a", "In", &["ok", "not ok"])]),
            ..Default::default()
        };
        assert!(validate(&s).unwrap_err().0.contains("\"not ok\""));
        let good = LabelSelector {
            match_labels: Some(labels(&[
                ("jumpstarter.dev/board", "rpi-4"),
                ("app.kubernetes.io/name", ""),
                ("Board_Type", "A.b_c"),
            ])),
            match_expressions: Some(vec![req("example.com/site", "In", &["a", "b"])]),
        };
        assert_eq!(validate(&good), Ok(()));
    }

    #[test]
    fn formats_like_apimachinery() {
        assert_eq!(format(&LabelSelector::default()), "<none>");
        let s = LabelSelector {
            match_labels: Some(labels(&[("z", "1"), ("a", "2")])),
            match_expressions: Some(vec![
                req("m", "In", &["y", "x"]),
                req("b", "DoesNotExist", &[]),
            ]),
        };
        assert_eq!(format(&s), "a=2,!b,m in (x,y),z=1");
    }
}

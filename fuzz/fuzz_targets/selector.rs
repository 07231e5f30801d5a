//! Label selectors (src/exporter/lease/selector.rs) as the API server hands them over: any
//! `LabelSelector` and any label set. Properties: no panic; `matches` fails exactly when
//! `validate` does; a valid selector matches exactly when an independent reading of each
//! requirement does; `matchLabels` and the equivalent `In` expressions agree; negating the only
//! requirement negates the result; `format` ignores requirement order.
#![no_main]

use std::collections::BTreeMap;

use arbitrary::Arbitrary;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use libfuzzer_sys::fuzz_target;
use ucm::exporter::lease::selector::{format, is_empty, matches, validate};

/// Small alphabets so keys and values collide often.
fn word(b: u8) -> String {
    ["a", "b", "app", "", "x/y", "a b", "ä"][b as usize % 7].to_string()
}

#[derive(Arbitrary, Debug)]
struct Req {
    key: u8,
    op: u8,
    values: Option<Vec<u8>>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    match_labels: Option<Vec<(u8, u8)>>,
    exprs: Option<Vec<Req>>,
    labels: Vec<(u8, u8)>,
    raw_op: Option<String>,
}

fn op(b: u8, raw: &Option<String>) -> String {
    match b % 5 {
        0 => "In".into(),
        1 => "NotIn".into(),
        2 => "Exists".into(),
        3 => "DoesNotExist".into(),
        _ => raw.clone().unwrap_or_else(|| "in".into()),
    }
}

/// The apimachinery meaning of one requirement, written independently of the crate.
fn oracle(req: &LabelSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let vals = req.values.clone().unwrap_or_default();
    match (req.operator.as_str(), labels.get(&req.key)) {
        ("In", Some(v)) => vals.iter().any(|x| x == v),
        ("In", None) => false,
        ("NotIn", Some(v)) => vals.iter().all(|x| x != v),
        ("NotIn", None) => true,
        ("Exists", v) => v.is_some(),
        ("DoesNotExist", v) => v.is_none(),
        _ => unreachable!("validated"),
    }
}

fn negate(op: &str) -> &'static str {
    match op {
        "In" => "NotIn",
        "NotIn" => "In",
        "Exists" => "DoesNotExist",
        _ => "Exists",
    }
}

fuzz_target!(|inp: Input| {
    let sel = LabelSelector {
        match_labels: inp
            .match_labels
            .map(|l| l.into_iter().map(|(k, v)| (word(k), word(v))).collect()),
        match_expressions: inp.exprs.map(|rs| {
            rs.into_iter()
                .map(|r| LabelSelectorRequirement {
                    key: word(r.key),
                    operator: op(r.op, &inp.raw_op),
                    values: r.values.map(|v| v.into_iter().map(word).collect()),
                })
                .collect()
        }),
    };
    let labels: BTreeMap<String, String> = inp
        .labels
        .into_iter()
        .map(|(k, v)| (word(k), word(v)))
        .collect();

    let valid = validate(&sel).is_ok();
    let got = matches(&sel, &labels);
    assert_eq!(
        got.is_ok(),
        valid,
        "matches and validate disagree on {sel:?}"
    );
    let text = format(&sel);
    assert_eq!(
        text == "<none>",
        is_empty(&sel),
        "{sel:?} formats as {text}"
    );
    let Ok(got) = got else { return };

    let want = sel
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v))
        && sel
            .match_expressions
            .iter()
            .flatten()
            .all(|r| oracle(r, &labels));
    assert_eq!(got, want, "{sel:?} on {labels:?}");
    if is_empty(&sel) {
        assert!(got, "an empty selector matches everything");
    }

    // matchLabels k=v is the requirement `k In (v)`.
    let mut as_exprs = sel.clone();
    let mut exprs: Vec<_> = sel
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| LabelSelectorRequirement {
            key: k.clone(),
            operator: "In".into(),
            values: Some(vec![v.clone()]),
        })
        .collect();
    exprs.extend(sel.match_expressions.clone().unwrap_or_default());
    as_exprs.match_labels = None;
    as_exprs.match_expressions = Some(exprs);
    assert_eq!(matches(&as_exprs, &labels), Ok(got), "{as_exprs:?}");

    // One requirement and its negation never agree.
    if sel.match_labels.as_ref().is_none_or(BTreeMap::is_empty)
        && let Some([r]) = sel.match_expressions.as_deref()
    {
        let mut n = r.clone();
        n.operator = negate(&r.operator).into();
        if n.operator == "Exists" || n.operator == "DoesNotExist" {
            n.values = None;
        } else if n.values.as_ref().is_none_or(Vec::is_empty) {
            n.values = Some(vec![String::new()]);
        }
        let neg = LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![n.clone()]),
        };
        if matches!(r.operator.as_str(), "In" | "NotIn")
            == matches!(n.operator.as_str(), "In" | "NotIn")
            && r.values == n.values
        {
            assert_eq!(matches(&neg, &labels), Ok(!got), "{r:?} vs {n:?}");
        }
    }

    // Requirement order does not change the text (keys are sorted; equal keys keep order).
    let mut rev = sel.clone();
    if let Some(e) = rev.match_expressions.as_mut() {
        let mut keys: Vec<_> = e.iter().map(|r| r.key.clone()).collect();
        keys.sort();
        keys.dedup();
        if keys.len() == e.len() {
            e.reverse();
            assert_eq!(format(&rev), text);
        }
    }
});

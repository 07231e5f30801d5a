//! The conditions library shared by every feature.
//!
//! Two modes:
//! - metav1 mode ([`set`]) for `metav1.Condition` lists (Exporter, Lease, Client, MiroirSnapshot):
//!   apimachinery `SetStatusCondition` semantics, `lastTransitionTime` moves only when `status` moves.
//! - KubeVirt mode ([`set_kubevirt`]) for VirtualMachineExport: `lastTransitionTime` moves when status,
//!   reason or message moves, and `lastProbeTime` is always null (KubeVirt's own condition helper).
//!
//! Every setter returns whether it changed anything, so callers skip no-op status writes.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use schemars::{Schema, json_schema};
use serde::{Deserialize, Serialize};

pub const TRUE: &str = "True";
pub const FALSE: &str = "False";
pub const UNKNOWN: &str = "Unknown";

/// The metav1.Condition schema's limit on `message` (characters).
pub const MAX_MESSAGE_CHARS: usize = 32768;
const TRUNCATION_MARKER: &str = "… (truncated)";

/// Condition status as the API spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    True,
    False,
    Unknown,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::True => TRUE,
            Status::False => FALSE,
            Status::Unknown => UNKNOWN,
        }
    }
}

impl From<bool> for Status {
    fn from(b: bool) -> Self {
        if b { Status::True } else { Status::False }
    }
}

/// What a controller wants a condition to say. `reason` is a `&'static str` so reasons are
/// constants that unit tests can validate, never formatted data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired<'a> {
    pub type_: &'a str,
    pub status: Status,
    pub reason: &'static str,
    pub message: String,
}

impl<'a> Desired<'a> {
    pub fn new(
        type_: &'a str,
        status: impl Into<Status>,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Desired {
            type_,
            status: status.into(),
            reason,
            message: message.into(),
        }
    }
}

/// `now` truncated to whole seconds: metav1.Time serialises at second precision, so a
/// sub-second value would differ after a round trip and cause a write on every reconcile.
pub fn now() -> Time {
    time(jiff::Timestamp::now())
}

/// The metav1 `Time` of `ts`, at whole seconds (`runtime::time::whole_seconds`).
pub fn time(ts: jiff::Timestamp) -> Time {
    Time(crate::runtime::time::whole_seconds(ts))
}

/// Caps a message at the schema's limit (characters, not bytes), with a marker, so the API
/// server never rejects a status patch because of a long error text.
pub fn cap_message(message: &str) -> String {
    if message.chars().count() <= MAX_MESSAGE_CHARS {
        return message.to_string();
    }
    let keep = MAX_MESSAGE_CHARS - TRUNCATION_MARKER.chars().count();
    let mut out: String = message.chars().take(keep).collect();
    out.push_str(TRUNCATION_MARKER);
    out
}

/// metav1 `reason`: 1–1024 characters matching `^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`.
pub fn is_valid_reason(reason: &str) -> bool {
    let b = reason.as_bytes();
    if b.is_empty() || b.len() > 1024 || !b[0].is_ascii_alphabetic() {
        return false;
    }
    let body_ok = b
        .iter()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b',' | b':'));
    let last = b[b.len() - 1];
    body_ok && (last.is_ascii_alphanumeric() || last == b'_')
}

/// metav1 `type`: at most 316 characters, a qualified name (`CamelCase` or `example.com/CamelCase`).
pub fn is_valid_type(type_: &str) -> bool {
    if type_.is_empty() || type_.len() > 316 {
        return false;
    }
    let (prefix, name) = match type_.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, type_),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.bytes()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            })
    });
    name_ok && prefix_ok
}

pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == TRUE)
}

/// Removes a condition; returns whether one was removed.
pub fn remove(conditions: &mut Vec<Condition>, type_: &str) -> bool {
    let before = conditions.len();
    conditions.retain(|c| c.type_ != type_);
    conditions.len() != before
}

/// metav1 mode, `SetStatusCondition` semantics:
/// absent → appended with `lastTransitionTime = now`; status differs → status and time updated;
/// status equal → time kept, reason/message/observedGeneration updated. Order is kept.
/// Returns whether anything changed.
pub fn set(
    conditions: &mut Vec<Condition>,
    desired: Desired<'_>,
    generation: Option<i64>,
    now: &Time,
) -> bool {
    debug_assert!(
        is_valid_type(desired.type_),
        "invalid condition type {}",
        desired.type_
    );
    debug_assert!(
        is_valid_reason(desired.reason),
        "invalid condition reason {}",
        desired.reason
    );
    let message = cap_message(&desired.message);
    let status = desired.status.as_str();
    match conditions.iter_mut().find(|c| c.type_ == desired.type_) {
        None => {
            conditions.push(Condition {
                type_: desired.type_.to_string(),
                status: status.to_string(),
                reason: desired.reason.to_string(),
                message,
                observed_generation: generation,
                last_transition_time: now.clone(),
            });
            true
        }
        Some(c) => {
            let mut changed = false;
            if c.status != status {
                c.status = status.to_string();
                c.last_transition_time = now.clone();
                changed = true;
            }
            changed |= replace(&mut c.reason, desired.reason);
            changed |= replace(&mut c.message, &message);
            if c.observed_generation != generation {
                c.observed_generation = generation;
                changed = true;
            }
            changed
        }
    }
}

fn replace(field: &mut String, value: &str) -> bool {
    if field == value {
        return false;
    }
    *field = value.to_string();
    true
}

// KubeVirt's condition shape (`VirtualMachineExportCondition` and friends): no
// observedGeneration, and a `lastProbeTime` that KubeVirt always leaves null (ucm leaves it out).
// The doc comments are upstream VirtualMachineExport CRD's: they become `kubectl explain` text.
/// Condition defines conditions
#[derive(kube::KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KubeVirtCondition {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_probe_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub status: String,
    /// ConditionType is the const type for Conditions
    #[serde(rename = "type")]
    pub type_: String,
}

/// KubeVirt mode: `lastTransitionTime` changes when status, reason or message changes;
/// `lastProbeTime` is always null. Returns whether anything changed.
pub fn set_kubevirt(
    conditions: &mut Vec<KubeVirtCondition>,
    desired: Desired<'_>,
    now: &Time,
) -> bool {
    debug_assert!(
        is_valid_reason(desired.reason),
        "invalid condition reason {}",
        desired.reason
    );
    let wanted = KubeVirtCondition {
        type_: desired.type_.to_string(),
        status: desired.status.as_str().to_string(),
        last_probe_time: None,
        last_transition_time: None,
        reason: Some(desired.reason.to_string()),
        message: Some(desired.message),
    };
    set_kubevirt_condition(conditions, wanted, now)
}

/// [`set_kubevirt`] for a condition built elsewhere (VirtualMachineExport's reasons travel as
/// conditions through its plan). A new `Ready` condition goes first, as KubeVirt orders them.
pub fn set_kubevirt_condition(
    conditions: &mut Vec<KubeVirtCondition>,
    mut wanted: KubeVirtCondition,
    now: &Time,
) -> bool {
    wanted.last_probe_time = None;
    wanted.last_transition_time = Some(now.clone());
    wanted.message = Some(cap_message(wanted.message.as_deref().unwrap_or_default()));
    let text = |o: &Option<String>| o.clone().unwrap_or_default();
    match conditions.iter_mut().find(|c| c.type_ == wanted.type_) {
        None => {
            if wanted.type_ == "Ready" {
                conditions.insert(0, wanted);
            } else {
                conditions.push(wanted);
            }
            true
        }
        Some(c) => {
            let same = c.status == wanted.status
                && text(&c.reason) == text(&wanted.reason)
                && text(&c.message) == text(&wanted.message);
            if same && c.last_probe_time.is_none() {
                return false;
            }
            if !same {
                *c = wanted;
            } else {
                c.last_probe_time = None;
            }
            true
        }
    }
}

/// Removes a KubeVirt-mode condition; returns whether one was removed.
pub fn remove_kubevirt(conditions: &mut Vec<KubeVirtCondition>, type_: &str) -> bool {
    let before = conditions.len();
    conditions.retain(|c| c.type_ != type_);
    conditions.len() != before
}

/// Whether a freshly built status differs from the observed one: callers skip the write when it
/// does not, so an unchanged object costs no API request.
pub fn status_changed<S: Serialize>(observed: Option<&S>, desired: &S) -> bool {
    match observed {
        None => true,
        Some(o) => serde_json::to_value(o).ok() != serde_json::to_value(desired).ok(),
    }
}

/// The `[]metav1.Condition` schema as controller-gen renders it, shared by every CRD with
/// metav1 conditions. Contracts differ in one sentence of `lastTransitionTime`'s description
/// (upstream Jumpstarter has a double space where upstream Miroir has one), so it is a parameter.
pub fn metav1_schema(transition_description: &str) -> Schema {
    json_schema!({
        "type": "array",
        "items": {
            "description": "Condition contains details for one aspect of the current state of this API Resource.",
            "type": "object",
            "required": ["lastTransitionTime", "message", "reason", "status", "type"],
            "properties": {
                "lastTransitionTime": {
                    "description": transition_description,
                    "type": "string",
                    "format": "date-time"
                },
                "message": {
                    "description": "message is a human readable message indicating details about the transition.\nThis may be an empty string.",
                    "type": "string",
                    "maxLength": 32768
                },
                "observedGeneration": {
                    "description": "observedGeneration represents the .metadata.generation that the condition was set based upon.\nFor instance, if .metadata.generation is currently 12, but the .status.conditions[x].observedGeneration is 9, the condition is out of date\nwith respect to the current state of the instance.",
                    "type": "integer",
                    "format": "int64",
                    "minimum": 0
                },
                "reason": {
                    "description": "reason contains a programmatic identifier indicating the reason for the condition's last transition.\nProducers of specific condition types may define expected values and meanings for this field,\nand whether the values are considered a guaranteed API.\nThe value should be a CamelCase string.\nThis field may not be empty.",
                    "type": "string",
                    "maxLength": 1024,
                    "minLength": 1,
                    "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
                },
                "status": {
                    "description": "status of the condition, one of True, False, Unknown.",
                    "type": "string",
                    "enum": ["True", "False", "Unknown"]
                },
                "type": {
                    "description": "type of condition in CamelCase or in foo.example.com/CamelCase.",
                    "type": "string",
                    "maxLength": 316,
                    "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Time {
        Time(jiff::Timestamp::from_second(s).unwrap())
    }

    #[test]
    fn append_sets_transition_time_and_generation() {
        let mut cs = vec![];
        assert!(set(
            &mut cs,
            Desired::new("Ready", true, "Ok", "fine"),
            Some(3),
            &t(10)
        ));
        assert_eq!(cs.len(), 1);
        assert_eq!(cs[0].status, "True");
        assert_eq!(cs[0].last_transition_time, t(10));
        assert_eq!(cs[0].observed_generation, Some(3));
    }

    #[test]
    fn same_status_keeps_transition_time_but_updates_reason_and_message() {
        let mut cs = vec![];
        set(
            &mut cs,
            Desired::new("Ready", true, "Ok", "a"),
            Some(1),
            &t(10),
        );
        assert!(set(
            &mut cs,
            Desired::new("Ready", true, "Better", "b"),
            Some(2),
            &t(20)
        ));
        assert_eq!(cs[0].last_transition_time, t(10));
        assert_eq!(cs[0].reason, "Better");
        assert_eq!(cs[0].message, "b");
        assert_eq!(cs[0].observed_generation, Some(2));
    }

    #[test]
    fn status_change_moves_transition_time() {
        let mut cs = vec![];
        set(
            &mut cs,
            Desired::new("Ready", true, "Ok", "a"),
            Some(1),
            &t(10),
        );
        assert!(set(
            &mut cs,
            Desired::new("Ready", false, "Broken", "a"),
            Some(1),
            &t(20)
        ));
        assert_eq!(cs[0].last_transition_time, t(20));
        assert_eq!(cs[0].status, "False");
    }

    #[test]
    fn identical_set_is_a_no_op() {
        let mut cs = vec![];
        set(
            &mut cs,
            Desired::new("Ready", true, "Ok", "a"),
            Some(1),
            &t(10),
        );
        let before = cs.clone();
        assert!(!set(
            &mut cs,
            Desired::new("Ready", true, "Ok", "a"),
            Some(1),
            &t(99)
        ));
        assert_eq!(cs, before);
    }

    #[test]
    fn observed_generation_change_alone_counts() {
        let mut cs = vec![];
        set(
            &mut cs,
            Desired::new("Ready", true, "Ok", "a"),
            Some(1),
            &t(10),
        );
        assert!(set(
            &mut cs,
            Desired::new("Ready", true, "Ok", "a"),
            Some(2),
            &t(10)
        ));
    }

    #[test]
    fn order_is_kept_and_new_types_append() {
        let mut cs = vec![];
        set(&mut cs, Desired::new("B", true, "Ok", ""), None, &t(1));
        set(&mut cs, Desired::new("A", true, "Ok", ""), None, &t(2));
        set(&mut cs, Desired::new("B", false, "No", ""), None, &t(3));
        let types: Vec<_> = cs.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["B", "A"]);
    }

    #[test]
    fn find_is_true_remove() {
        let mut cs = vec![];
        set(&mut cs, Desired::new("Ready", true, "Ok", ""), None, &t(1));
        set(
            &mut cs,
            Desired::new("Online", false, "Gone", ""),
            None,
            &t(1),
        );
        assert!(is_true(&cs, "Ready"));
        assert!(!is_true(&cs, "Online"));
        assert!(!is_true(&cs, "Missing"));
        assert_eq!(find(&cs, "Online").unwrap().reason, "Gone");
        assert!(remove(&mut cs, "Ready"));
        assert!(!remove(&mut cs, "Ready"));
        assert_eq!(cs.len(), 1);
    }

    #[test]
    fn reason_validation() {
        for ok in [
            "Ready",
            "A",
            "ExpiresWithin7Days",
            "Some_Reason",
            "a:b,c_d",
            "X1",
        ] {
            assert!(is_valid_reason(ok), "{ok} should be valid");
        }
        let long = "A".repeat(1025);
        for bad in [
            "",
            "1Ready",
            "Ready!",
            "Has Space",
            "Trailing:",
            "Trailing,",
            "-x",
            long.as_str(),
        ] {
            assert!(!is_valid_reason(bad), "{bad} should be invalid");
        }
    }

    #[test]
    fn type_validation() {
        for ok in [
            "Ready",
            "TokenExpiring",
            "example.com/Ready",
            "a.b-c.io/Online",
        ] {
            assert!(is_valid_type(ok), "{ok}");
        }
        for bad in ["", "Bad Type", "/Ready", "Example.COM/Ready", "x/", "-a"] {
            assert!(!is_valid_type(bad), "{bad}");
        }
    }

    #[test]
    fn long_messages_are_capped_in_characters() {
        let long = "é".repeat(MAX_MESSAGE_CHARS + 10);
        let capped = cap_message(&long);
        assert_eq!(capped.chars().count(), MAX_MESSAGE_CHARS);
        assert!(capped.ends_with(TRUNCATION_MARKER));
        assert_eq!(cap_message("short"), "short");
        let mut cs = vec![];
        set(
            &mut cs,
            Desired::new("Ready", false, "Err", long),
            None,
            &t(1),
        );
        assert_eq!(cs[0].message.chars().count(), MAX_MESSAGE_CHARS);
    }

    #[test]
    fn now_is_whole_seconds() {
        let n = now();
        assert_eq!(n.0.subsec_nanosecond(), 0);
    }

    #[test]
    fn kubevirt_mode_moves_time_on_reason_or_message() {
        let mut cs = vec![];
        assert!(set_kubevirt(
            &mut cs,
            Desired::new("Ready", false, "PodPending", "a"),
            &t(1)
        ));
        assert!(!set_kubevirt(
            &mut cs,
            Desired::new("Ready", false, "PodPending", "a"),
            &t(2)
        ));
        assert_eq!(cs[0].last_transition_time, Some(t(1)));
        assert!(set_kubevirt(
            &mut cs,
            Desired::new("Ready", false, "PodPending", "b"),
            &t(3)
        ));
        assert_eq!(cs[0].last_transition_time, Some(t(3)));
        assert!(set_kubevirt(
            &mut cs,
            Desired::new("Ready", false, "InUse", "b"),
            &t(4)
        ));
        assert_eq!(cs[0].last_transition_time, Some(t(4)));
        assert!(set_kubevirt(
            &mut cs,
            Desired::new("Ready", true, "InUse", "b"),
            &t(5)
        ));
        assert_eq!(cs[0].last_transition_time, Some(t(5)));
        assert!(cs[0].last_probe_time.is_none());
        // Left out, which reads back as null.
        let json = serde_json::to_value(&cs[0]).unwrap();
        assert!(json.get("lastProbeTime").is_none());
    }

    #[test]
    fn kubevirt_mode_clears_a_probe_time() {
        let mut cs = vec![KubeVirtCondition {
            type_: "Ready".into(),
            status: "True".into(),
            last_probe_time: Some(t(1)),
            last_transition_time: Some(t(1)),
            reason: Some("Ok".into()),
            message: Some("m".into()),
        }];
        assert!(set_kubevirt(
            &mut cs,
            Desired::new("Ready", true, "Ok", "m"),
            &t(5)
        ));
        assert_eq!(cs[0].last_transition_time, Some(t(1)));
        assert!(cs[0].last_probe_time.is_none());
    }

    #[test]
    fn status_changed_detects_no_ops() {
        #[derive(Serialize)]
        struct S {
            a: u32,
        }
        assert!(status_changed(None, &S { a: 1 }));
        assert!(!status_changed(Some(&S { a: 1 }), &S { a: 1 }));
        assert!(status_changed(Some(&S { a: 1 }), &S { a: 2 }));
    }
}

//! metav1.Condition helpers with apimachinery `SetStatusCondition` semantics.
//!
//! Kept local to the feature until the shared `crate::conditions` library lands on main; the
//! semantics are those of runtime.md §8 so the switch is mechanical.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

const MAX_MESSAGE_CHARS: usize = 32768;

/// Truncates to whole seconds: metav1.Time serialises at second precision.
pub fn truncate(ts: Timestamp) -> Timestamp {
    Timestamp::from_second(ts.as_second()).expect("in range")
}

pub fn status_str(status: bool) -> &'static str {
    if status { "True" } else { "False" }
}

/// Sets a condition; `lastTransitionTime` changes only when `status` changes. Returns whether
/// anything changed.
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> bool {
    let status = status_str(status);
    let message = truncate_message(message);
    let now = Time(truncate(now));
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        None => {
            conditions.push(Condition {
                type_: type_.to_string(),
                status: status.to_string(),
                reason: reason.to_string(),
                message,
                observed_generation: generation,
                last_transition_time: now,
            });
            true
        }
        Some(existing) => {
            let before = existing.clone();
            if existing.status != status {
                existing.status = status.to_string();
                existing.last_transition_time = now;
            }
            existing.reason = reason.to_string();
            existing.message = message;
            existing.observed_generation = generation;
            *existing != before
        }
    }
}

pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

fn truncate_message(message: &str) -> String {
    if message.chars().count() <= MAX_MESSAGE_CHARS {
        return message.to_string();
    }
    let marker = "... (truncated)";
    let keep = MAX_MESSAGE_CHARS - marker.chars().count();
    message.chars().take(keep).chain(marker.chars()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn transition_time_moves_only_with_status() {
        let mut c = Vec::new();
        assert!(set(&mut c, "Online", true, "Seen", "a", Some(1), ts(100)));
        assert!(!set(&mut c, "Online", true, "Seen", "a", Some(1), ts(200)));
        assert_eq!(c[0].last_transition_time.0, ts(100));
        assert!(set(&mut c, "Online", true, "Seen", "b", Some(2), ts(300)));
        assert_eq!(c[0].last_transition_time.0, ts(100));
        assert_eq!(c[0].observed_generation, Some(2));
        assert!(set(&mut c, "Online", false, "Seen", "b", Some(2), ts(400)));
        assert_eq!(c[0].last_transition_time.0, ts(400));
        assert!(set(
            &mut c,
            "Registered",
            false,
            "Unregister",
            "",
            Some(2),
            ts(400)
        ));
        assert_eq!(c.len(), 2);
        assert!(!is_true(&c, "Online"));
        assert!(find(&c, "Registered").is_some());
    }

    #[test]
    fn sub_second_now_is_truncated() {
        let mut c = Vec::new();
        let now = Timestamp::from_millisecond(100_500).unwrap();
        set(&mut c, "A", true, "R", "", None, now);
        assert_eq!(c[0].last_transition_time.0, ts(100));
    }

    #[test]
    fn long_messages_are_truncated() {
        let mut c = Vec::new();
        set(&mut c, "A", true, "R", &"x".repeat(40000), None, ts(1));
        assert_eq!(c[0].message.chars().count(), MAX_MESSAGE_CHARS);
    }
}

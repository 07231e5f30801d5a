//! Times in the feature's texts and timers: RFC 3339 and Go's `metav1.Time.String()` as
//! upstream's condition and event texts print them (docs/exporter.md, "TokenExpiring",
//! "Events"), and the delay to the next wake-up ("Wake-ups").

use jiff::{SignedDuration, Timestamp};

pub fn rfc3339(ts: Timestamp) -> String {
    jiff::fmt::strtime::format("%Y-%m-%dT%H:%M:%SZ", ts).expect("a timestamp formats")
}

/// Go's `metav1.Time.String()`, used in upstream's event texts.
pub fn go_time_string(ts: Option<Timestamp>) -> String {
    match ts {
        Some(ts) => jiff::fmt::strtime::format("%Y-%m-%d %H:%M:%S +0000 UTC", ts).expect("formats"),
        None => "0001-01-01 00:00:00 +0000 UTC".into(),
    }
}

/// Delay until the earliest instant after `now`, capped. None when there is none.
pub fn next_delay(
    instants: &[Timestamp],
    now: Timestamp,
    cap: SignedDuration,
) -> Option<std::time::Duration> {
    let earliest = instants.iter().copied().filter(|i| *i > now).min()?;
    let delay = now.duration_until(earliest).min(cap);
    delay.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn go_time_format() {
        assert_eq!(go_time_string(Some(ts(0))), "1970-01-01 00:00:00 +0000 UTC");
        assert_eq!(go_time_string(None), "0001-01-01 00:00:00 +0000 UTC");
    }
}

//! Time arithmetic every feature shares: whole seconds (what Kubernetes stores in `Time`) and
//! saturating offsets, so a huge duration or a far stamp never panics a pass.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

/// `ts` truncated to whole seconds.
pub fn whole_seconds(ts: Timestamp) -> Timestamp {
    Timestamp::from_second(ts.as_second()).unwrap_or(ts)
}

/// `ts + d`, saturating at the end of jiff's range.
pub fn after(ts: Timestamp, d: Duration) -> Timestamp {
    let d = SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX);
    ts.checked_add(d).unwrap_or(Timestamp::MAX)
}

/// `ts - d`, saturating at the start of jiff's range.
pub fn before(ts: Timestamp, d: Duration) -> Timestamp {
    let d = SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX);
    ts.checked_sub(d).unwrap_or(Timestamp::MIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_saturate_and_truncation_drops_the_fraction() {
        let t: Timestamp = "2026-12-03T10:00:00.750Z".parse().unwrap();
        assert_eq!(whole_seconds(t).to_string(), "2026-12-03T10:00:00Z");
        assert_eq!(
            after(t, Duration::from_secs(60)).as_second(),
            t.as_second() + 60
        );
        assert_eq!(
            before(t, Duration::from_secs(60)).as_second(),
            t.as_second() - 60
        );
        assert_eq!(after(t, Duration::MAX), Timestamp::MAX);
        assert_eq!(before(t, Duration::MAX), Timestamp::MIN);
    }
}

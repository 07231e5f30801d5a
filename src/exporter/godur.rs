//! Go `time.Duration` strings (`metav1.Duration` fields such as `spec.duration` and
//! `maximumDuration`), and the human rendering of the offline threshold.

use jiff::SignedDuration;

/// Parses Go's `time.ParseDuration` syntax with the runtime's parser
/// ([`crate::runtime::cli::parse_go_duration`]), adding what only these fields need: an optional
/// sign (a negative `spec.duration` must reach the Lease rules, not fail to parse) and Go's range
/// (at most `i64::MAX` nanoseconds). Errors read like Go's.
pub fn parse(input: &str) -> Result<SignedDuration, String> {
    let invalid = || format!("invalid duration {input:?}");
    let (negative, magnitude) = match input.as_bytes().first() {
        Some(b'-') => (true, &input[1..]),
        Some(b'+') => (false, &input[1..]),
        _ => (false, input),
    };
    let d = crate::runtime::cli::parse_go_duration(magnitude).map_err(|_| invalid())?;
    let nanos = i64::try_from(d.as_nanos()).map_err(|_| invalid())?;
    let nanos = if negative { -nanos } else { nanos };
    Ok(SignedDuration::from_nanos(nanos))
}

/// Renders the offline threshold for condition and status messages: `1 minute` for 60 s (the
/// upstream text), `N minutes` for whole minutes, else `N seconds`.
pub fn human_threshold(threshold: SignedDuration) -> String {
    let secs = threshold.as_secs();
    if secs == 60 {
        "1 minute".to_string()
    } else if secs > 0 && secs % 60 == 0 && threshold.subsec_nanos() == 0 {
        format!("{} minutes", secs / 60)
    } else {
        format!("{secs} seconds")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_durations() {
        let cases = [
            ("0", 0i64),
            ("1s", 1_000_000_000),
            ("1h", 3_600_000_000_000),
            ("1h30m", 5_400_000_000_000),
            ("1h0m0s", 3_600_000_000_000),
            ("1.5h", 5_400_000_000_000),
            ("300ms", 300_000_000),
            ("-2m", -120_000_000_000),
            ("2h45m10.5s", 9_910_500_000_000),
            ("10us", 10_000),
            ("7µs", 7_000),
            ("1ns", 1),
            (".5s", 500_000_000),
            ("+90s", 90_000_000_000),
            ("8760h", 31_536_000_000_000_000),
        ];
        for (text, nanos) in cases {
            assert_eq!(parse(text).unwrap().as_nanos(), i128::from(nanos), "{text}");
        }
    }

    #[test]
    fn rejects_bad_durations() {
        for text in [
            "",
            "1",
            "h",
            "1d",
            "1.2.3s",
            "abc",
            "1h-1m",
            "-",
            "+",
            "--1s",
            "9999999999h",
        ] {
            assert!(parse(text).is_err(), "{text:?} should be rejected");
        }
    }

    #[test]
    fn renders_threshold_like_upstream() {
        assert_eq!(human_threshold(SignedDuration::from_secs(60)), "1 minute");
        assert_eq!(human_threshold(SignedDuration::from_secs(120)), "2 minutes");
        assert_eq!(human_threshold(SignedDuration::from_secs(90)), "90 seconds");
        assert_eq!(human_threshold(SignedDuration::from_secs(30)), "30 seconds");
    }
}

//! Go `time.Duration` strings (`metav1.Duration` fields such as `spec.duration` and
//! `maximumDuration`), and the human rendering of the offline threshold.

use jiff::SignedDuration;

/// Parses Go's `time.ParseDuration` syntax: an optional sign, then one or more
/// `<number>[.<fraction>]<unit>` with units `ns`, `us`, `µs`, `μs`, `ms`, `s`, `m`, `h`; or `0`.
pub fn parse(input: &str) -> Result<SignedDuration, String> {
    let invalid = || format!("invalid duration {input:?}");
    let (negative, mut rest) = match input.as_bytes().first() {
        Some(b'-') => (true, &input[1..]),
        Some(b'+') => (false, &input[1..]),
        _ => (false, input),
    };
    if rest == "0" {
        return Ok(SignedDuration::ZERO);
    }
    if rest.is_empty() {
        return Err(invalid());
    }
    let mut total: i128 = 0; // nanoseconds
    while !rest.is_empty() {
        let digits = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.')
            .count();
        if digits == 0 {
            return Err(invalid());
        }
        let (number, tail) = rest.split_at(digits);
        let unit_len = tail
            .char_indices()
            .find(|(_, c)| c.is_ascii_digit() || *c == '.')
            .map_or(tail.len(), |(i, _)| i);
        let (unit, tail) = tail.split_at(unit_len);
        let scale: i128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60 * 1_000_000_000,
            "h" => 3_600 * 1_000_000_000,
            _ => return Err(invalid()),
        };
        let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
        if (whole.is_empty() && frac.is_empty()) || frac.contains('.') {
            return Err(invalid());
        }
        let whole: i128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| invalid())?
        };
        let mut value = whole.checked_mul(scale).ok_or_else(invalid)?;
        let mut place = scale;
        for digit in frac.bytes() {
            place /= 10;
            value += i128::from(digit - b'0') * place;
        }
        total = total.checked_add(value).ok_or_else(invalid)?;
        if total > i128::from(i64::MAX) {
            return Err(invalid());
        }
        rest = tail;
    }
    let nanos = if negative { -total } else { total };
    Ok(SignedDuration::from_nanos(nanos as i64))
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

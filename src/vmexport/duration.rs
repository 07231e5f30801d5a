//! Go `time.ParseDuration` syntax, which is what `ttlDuration` (a metav1.Duration upstream) and
//! the CRD's CEL `duration()` accept, so a value the API server admits also parses here.

use std::time::Duration;

/// Parses `2h`, `90m`, `1h30m`, `1.5s`, `300ms`, `0`. Negative values are an error, as they
/// make no sense for a lifetime (the CRD rejects them too).
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let orig = s;
    let mut s = s;
    if let Some(rest) = s.strip_prefix('+') {
        s = rest;
    } else if s.starts_with('-') {
        return Err(format!("negative duration {orig:?}"));
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err(format!("invalid duration {orig:?}"));
    }
    let mut total: f64 = 0.0;
    while !s.is_empty() {
        let num_end = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("missing unit in duration {orig:?}"))?;
        let num = &s[..num_end];
        if num.is_empty() || num == "." || num.matches('.').count() > 1 {
            return Err(format!("invalid duration {orig:?}"));
        }
        let value: f64 = num
            .parse()
            .map_err(|_| format!("invalid duration {orig:?}"))?;
        s = &s[num_end..];
        let unit_end = s
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(s.len());
        let nanos_per = match &s[..unit_end] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            u => return Err(format!("unknown unit {u:?} in duration {orig:?}")),
        };
        total += value * nanos_per;
        s = &s[unit_end..];
    }
    // Go's limit is ~292 years; anything beyond is an overflow there.
    if total > i64::MAX as f64 {
        return Err(format!("invalid duration {orig:?}"));
    }
    Ok(Duration::from_nanos(total.round() as u64))
}

/// Formats like Go's `Duration.String()` for whole seconds (`2h0m0s`), used in messages.
pub fn format_go_duration(d: Duration) -> String {
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_syntax() {
        let ok = [
            ("2h", 7200),
            ("90m", 5400),
            ("1h30m", 5400),
            ("10s", 10),
            ("0", 0),
            ("0s", 0),
            ("+5m", 300),
            ("1.5h", 5400),
        ];
        for (s, secs) in ok {
            assert_eq!(
                parse_go_duration(s).unwrap(),
                Duration::from_secs(secs),
                "{s}"
            );
        }
        assert_eq!(
            parse_go_duration("300ms").unwrap(),
            Duration::from_millis(300)
        );
        assert_eq!(parse_go_duration("2us").unwrap(), Duration::from_micros(2));
    }

    #[test]
    fn rejects_bad_values() {
        for s in ["", "-1h", "2", "h", "2x", "1..5s", ".s", "2h-1m", "abc"] {
            assert!(parse_go_duration(s).is_err(), "{s:?} should fail");
        }
    }

    #[test]
    fn formats_whole_seconds() {
        assert_eq!(format_go_duration(Duration::from_secs(7200)), "2h0m0s");
        assert_eq!(format_go_duration(Duration::from_secs(75)), "1m15s");
        assert_eq!(format_go_duration(Duration::from_secs(5)), "5s");
    }
}

//! Go's `time.Duration` text, in one place: every duration ucm reads (flags, `metav1.Duration`
//! fields such as `ttlDuration`, `spec.duration`, `maximumDuration`, the jumpstarter-controller
//! ConfigMap) is parsed as Go's `time.ParseDuration` does, so a value the API server's CEL
//! `duration()` or an upstream controller admits parses here too, and every duration ucm writes
//! or logs reads as Go's `Duration.String()` (`1h30m0s`, `1.5s`).

use std::time::Duration;

use jiff::SignedDuration;

/// Go's `time.ParseDuration`: an optional sign, then one or more decimal numbers (with an
/// optional fraction) each followed by a unit `ns`, `us` (`µs`, `μs`), `ms`, `s`, `m`, `h`;
/// `0` alone is zero. Go's range: at most 2^63−1 nanoseconds either way. Errors read like Go's.
pub fn parse_signed(input: &str) -> Result<SignedDuration, String> {
    let invalid = || format!("invalid duration {input:?}");
    let (negative, mut s) = match input.as_bytes().first() {
        Some(b'-') => (true, &input[1..]),
        Some(b'+') => (false, &input[1..]),
        _ => (false, input),
    };
    if s == "0" {
        return Ok(SignedDuration::ZERO);
    }
    if s.is_empty() {
        return Err(invalid());
    }
    let mut total: u64 = 0;
    while !s.is_empty() {
        if !s.starts_with(|c: char| c == '.' || c.is_ascii_digit()) {
            return Err(invalid());
        }
        let int_len = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let whole: u64 = if int_len == 0 {
            0
        } else {
            s[..int_len].parse().map_err(|_| invalid())?
        };
        s = &s[int_len..];
        let mut frac = "";
        if let Some(rest) = s.strip_prefix('.') {
            let len = rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len());
            frac = &rest[..len];
            s = &rest[len..];
        }
        if int_len == 0 && frac.is_empty() {
            return Err(invalid()); // "." or ".s"
        }
        let unit_len = s
            .find(|c: char| c == '.' || c.is_ascii_digit())
            .unwrap_or(s.len());
        let nanos_per: u64 = match &s[..unit_len] {
            "" => return Err(format!("missing unit in duration {input:?}")),
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            u => return Err(format!("unknown unit {u:?} in duration {input:?}")),
        };
        s = &s[unit_len..];
        let mut value = whole.checked_mul(nanos_per).ok_or_else(invalid)?;
        // The fraction, digit by digit as Go does (exact; digits past a nanosecond are dropped).
        let mut scale = nanos_per;
        for d in frac.bytes() {
            scale /= 10;
            if scale == 0 {
                break;
            }
            value = value
                .checked_add(u64::from(d - b'0') * scale)
                .ok_or_else(invalid)?;
        }
        total = total.checked_add(value).ok_or_else(invalid)?;
    }
    let limit = if negative {
        i64::MAX as u64 + 1
    } else {
        i64::MAX as u64
    };
    if total > limit {
        return Err(invalid());
    }
    let nanos = if negative {
        i128::from(total).wrapping_neg() as i64
    } else {
        total as i64
    };
    Ok(SignedDuration::from_nanos(nanos))
}

/// As [`parse_signed`], for values that cannot be negative (flags, lifetimes).
pub fn parse(input: &str) -> Result<Duration, String> {
    let d = parse_signed(input)?;
    if d.is_negative() {
        return Err(format!("negative duration {input:?}"));
    }
    Duration::try_from(d).map_err(|_| format!("invalid duration {input:?}"))
}

/// Go's `Duration.String()`, the form `metav1.Duration` serialises to: `0s`, `1h30m0s`,
/// `1.5s`, `1.5ms`, `2µs`, `-1m30s`.
pub fn format_signed(d: SignedDuration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    let sign = if d.is_negative() { "-" } else { "" };
    let total = d.as_nanos().unsigned_abs();
    let frac = |value: u128, unit: u128| {
        let (whole, rest) = (value / unit, value % unit);
        if rest == 0 {
            whole.to_string()
        } else {
            let digits = unit.to_string().len() - 1;
            let f = format!("{rest:0digits$}");
            format!("{whole}.{}", f.trim_end_matches('0'))
        }
    };
    if total < 1_000 {
        return format!("{sign}{total}ns");
    }
    if total < 1_000_000 {
        return format!("{sign}{}µs", frac(total, 1_000));
    }
    if total < 1_000_000_000 {
        return format!("{sign}{}ms", frac(total, 1_000_000));
    }
    let secs_nanos = total % 60_000_000_000;
    let minutes = (total / 60_000_000_000) % 60;
    let hours = total / 3_600_000_000_000;
    let s = format!("{}s", frac(secs_nanos, 1_000_000_000));
    if hours > 0 {
        format!("{sign}{hours}h{minutes}m{s}")
    } else if minutes > 0 {
        format!("{sign}{minutes}m{s}")
    } else {
        format!("{sign}{s}")
    }
}

/// [`format_signed`] for an unsigned duration (saturating at Go's range).
pub fn format(d: Duration) -> String {
    let nanos = i64::try_from(d.as_nanos()).unwrap_or(i64::MAX);
    format_signed(SignedDuration::from_nanos(nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_syntax() {
        let cases = [
            ("0", 0i64),
            ("+0", 0),
            ("0s", 0),
            ("1s", 1_000_000_000),
            ("15s", 15_000_000_000),
            ("1m30s", 90_000_000_000),
            ("1h", 3_600_000_000_000),
            ("1h30m", 5_400_000_000_000),
            ("1h0m0s", 3_600_000_000_000),
            ("1.5h", 5_400_000_000_000),
            ("300ms", 300_000_000),
            ("-2m", -120_000_000_000),
            ("2h45m10.5s", 9_910_500_000_000),
            ("10us", 10_000),
            ("7µs", 7_000),
            ("7μs", 7_000),
            ("1ns", 1),
            (".5s", 500_000_000),
            ("5.s", 5_000_000_000),
            ("+90s", 90_000_000_000),
            ("8760h", 31_536_000_000_000_000),
            ("1.0000000001s", 1_000_000_000),
            ("2562047h47m16.854775807s", i64::MAX),
            ("-2562047h47m16.854775808s", i64::MIN),
        ];
        for (text, nanos) in cases {
            assert_eq!(
                parse_signed(text).unwrap().as_nanos(),
                i128::from(nanos),
                "{text}"
            );
        }
    }

    #[test]
    fn rejects_what_go_rejects_with_gos_words() {
        for (text, why) in [
            ("", "invalid duration"),
            ("-", "invalid duration"),
            ("+", "invalid duration"),
            ("--1s", "invalid duration"),
            ("abc", "invalid duration"),
            ("forever", "invalid duration"),
            (".", "invalid duration"),
            (".s", "invalid duration"),
            ("h", "invalid duration"),
            ("1h-1m", "unknown unit \"h-\" in duration"),
            ("1h+", "unknown unit \"h+\" in duration"),
            ("-1h-1m", "unknown unit \"h-\" in duration"),
            ("9999999999h", "invalid duration"),
            ("2562047h47m16.854775808s", "invalid duration"),
            ("1", "missing unit in duration"),
            ("1..5s", "missing unit in duration"),
            ("1s2", "missing unit in duration"),
            ("30d", "unknown unit \"d\" in duration"),
            ("2x", "unknown unit \"x\" in duration"),
        ] {
            let e = parse_signed(text).expect_err(text);
            assert!(
                e.starts_with(why) && e.ends_with(&format!("{text:?}")),
                "{text:?}: {e}"
            );
        }
    }

    #[test]
    fn unsigned_values_refuse_a_sign_of_minus() {
        assert_eq!(parse("1.5h").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse("+5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse("-1h").unwrap_err(), "negative duration \"-1h\"");
        assert_eq!(parse("-0s").unwrap(), Duration::ZERO);
    }

    #[test]
    fn formats_as_go_prints() {
        let s = |secs: i64, nanos: i32| format_signed(SignedDuration::new(secs, nanos));
        assert_eq!(s(0, 0), "0s");
        assert_eq!(s(5, 0), "5s");
        assert_eq!(s(75, 0), "1m15s");
        assert_eq!(s(1800, 0), "30m0s");
        assert_eq!(s(5400, 0), "1h30m0s");
        assert_eq!(s(7200, 0), "2h0m0s");
        assert_eq!(s(86400, 0), "24h0m0s");
        assert_eq!(s(1, 500_000_000), "1.5s");
        assert_eq!(s(0, 1_500_000), "1.5ms");
        assert_eq!(s(0, 2_000), "2µs");
        assert_eq!(s(0, 7), "7ns");
        assert_eq!(s(-90, 0), "-1m30s");
        assert_eq!(format(Duration::from_millis(2500)), "2.5s");
        assert_eq!(format(Duration::MAX), "2562047h47m16.854775807s");
    }

    #[test]
    fn what_it_prints_parses_back() {
        for v in [
            "0s", "30m0s", "1h30m0s", "1.5s", "1.5ms", "2µs", "7ns", "-1m30s",
        ] {
            assert_eq!(format_signed(parse_signed(v).unwrap()), v);
        }
    }
}

//! Single byte ranges (docs/vmexport.md, "Export server"): `a-b`, `a-` and `-n`. Several ranges in
//! one request get the whole body, as do malformed headers (RFC 9110 lets a server ignore Range).

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeReq {
    Full,
    /// Inclusive `start..=end`.
    Partial(u64, u64),
    Unsatisfiable,
}

pub fn parse_range(header: Option<&str>, size: u64) -> RangeReq {
    let Some(h) = header else {
        return RangeReq::Full;
    };
    let Some(spec) = h.trim().strip_prefix("bytes=") else {
        return RangeReq::Full;
    };
    if spec.contains(',') {
        return RangeReq::Full;
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return RangeReq::Full;
    };
    let (a, b) = (a.trim(), b.trim());
    if a.is_empty() {
        // suffix: last n bytes
        let Ok(n) = b.parse::<u64>() else {
            return RangeReq::Full;
        };
        if n == 0 || size == 0 {
            return RangeReq::Unsatisfiable;
        }
        return RangeReq::Partial(size.saturating_sub(n), size - 1);
    }
    let Ok(start) = a.parse::<u64>() else {
        return RangeReq::Full;
    };
    let end = if b.is_empty() {
        size.saturating_sub(1)
    } else {
        match b.parse::<u64>() {
            Ok(e) if e >= start => e.min(size.saturating_sub(1)),
            _ => return RangeReq::Full,
        }
    };
    if start >= size {
        return RangeReq::Unsatisfiable;
    }
    RangeReq::Partial(start, end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range(None, 10), RangeReq::Full);
        assert_eq!(parse_range(Some("bytes=0-3"), 10), RangeReq::Partial(0, 3));
        assert_eq!(parse_range(Some("bytes=4-"), 10), RangeReq::Partial(4, 9));
        assert_eq!(parse_range(Some("bytes=-3"), 10), RangeReq::Partial(7, 9));
        assert_eq!(parse_range(Some("bytes=-30"), 10), RangeReq::Partial(0, 9));
        assert_eq!(
            parse_range(Some("bytes=5-100"), 10),
            RangeReq::Partial(5, 9)
        );
        assert_eq!(parse_range(Some("bytes=10-"), 10), RangeReq::Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=-0"), 10), RangeReq::Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=0-1,3-4"), 10), RangeReq::Full);
        assert_eq!(parse_range(Some("bytes=5-2"), 10), RangeReq::Full);
        assert_eq!(parse_range(Some("items=0-1"), 10), RangeReq::Full);
        assert_eq!(parse_range(Some("bytes=0-0"), 0), RangeReq::Unsatisfiable);
    }
}

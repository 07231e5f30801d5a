//! `Range` header parsing of the export server (src/vmexport/server/range.rs). Properties: no
//! panic on any header and size; a partial range always lies inside the file; headers that
//! are not a single `bytes=` range get the whole body; and on well-formed single ranges the
//! result is exactly RFC 9110's (suffix ranges, open ends, clamping, 416 past the end).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use ucm::vmexport::server::range::{RangeReq, parse_range};

#[derive(Arbitrary, Debug)]
struct Input {
    header: Option<String>,
    size: u64,
    small: bool,
    first: Option<u64>,
    last: Option<u64>,
    spaces: bool,
}

fuzz_target!(|inp: Input| {
    let size = if inp.small { inp.size % 4096 } else { inp.size };

    // Any header.
    let r = parse_range(inp.header.as_deref(), size);
    if let RangeReq::Partial(a, b) = r {
        assert!(a <= b && b < size, "{:?} on {size}: {r:?}", inp.header);
    }
    match inp.header.as_deref() {
        None => assert_eq!(r, RangeReq::Full),
        Some(h) if !h.trim_start().starts_with("bytes=") || h.contains(',') => {
            assert_eq!(r, RangeReq::Full, "{h:?}")
        }
        _ => {}
    }

    // Well-formed single ranges, against the RFC's rules.
    let sp = if inp.spaces { " " } else { "" };
    let text = |v: Option<u64>| v.map(|n| n.to_string()).unwrap_or_default();
    let h = format!(
        "bytes={sp}{}{sp}-{sp}{}{sp}",
        text(inp.first),
        text(inp.last)
    );
    let want = match (inp.first, inp.last) {
        (None, None) => RangeReq::Full,
        (None, Some(n)) => {
            if n == 0 || size == 0 {
                RangeReq::Unsatisfiable
            } else {
                RangeReq::Partial(size - n.min(size), size - 1)
            }
        }
        (Some(a), Some(b)) if b < a => RangeReq::Full,
        (Some(a), _) if a >= size => RangeReq::Unsatisfiable,
        (Some(a), None) => RangeReq::Partial(a, size - 1),
        (Some(a), Some(b)) => RangeReq::Partial(a, b.min(size - 1)),
    };
    assert_eq!(parse_range(Some(&h), size), want, "{h:?} on {size}");
    // A second range makes it a multi-range request: the whole body.
    assert_eq!(parse_range(Some(&format!("{h},0-0")), size), RangeReq::Full);
});

//! Internal ES256 tokens (src/exporter/auth/token.rs). Properties: `verify` never panics on any
//! text; a token minted for a subject verifies to exactly the claims minted, until `exp` and
//! not after; it does not verify under another key; changing any one byte of it makes it
//! fail (or, if the change only adds surrounding whitespace, yields the same claims); `decide`
//! keeps a token only when it verifies, names the expected subject and is not due for renewal.
#![no_main]

use arbitrary::Arbitrary;
use jiff::{SignedDuration, Timestamp};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use ucm::exporter::auth::token::{
    MintReason, SigningKey, TokenAction, TokenError, TokenPolicy, decide, mint, verify,
};

fn keys() -> &'static (SigningKey, SigningKey) {
    static K: OnceLock<(SigningKey, SigningKey)> = OnceLock::new();
    K.get_or_init(|| {
        (
            SigningKey::from_seed("fuzz-seed-a").unwrap(),
            SigningKey::from_seed("fuzz-seed-b").unwrap(),
        )
    })
}

#[derive(Arbitrary, Debug)]
struct Input {
    sub: String,
    /// Seconds around 2027, and a lifetime up to ~30 years, possibly zero or negative.
    now: u32,
    lifetime: i32,
    check_at: i32,
    flip_at: u16,
    flip_to: u8,
    junk: String,
    renew_before_h: u16,
    renew_fraction: u8,
}

fuzz_target!(|inp: Input| {
    let (key, other) = keys();
    let now = Timestamp::from_second(1_800_000_000 + i64::from(inp.now)).unwrap();
    let policy = TokenPolicy::default();

    // Arbitrary text is never accepted (nobody but the key holder can sign).
    let junk = verify(key, &inp.junk, now);
    assert!(junk.is_err(), "junk verified: {:?}", inp.junk);

    let lifetime = SignedDuration::from_secs(i64::from(inp.lifetime));
    let (token, claims) = mint(key, &inp.sub, now, lifetime);
    assert_eq!(claims.sub, inp.sub);
    assert_eq!(claims.iat, now.as_second());
    assert_eq!(claims.exp, now.as_second() + i64::from(inp.lifetime));

    let at = Timestamp::from_second(now.as_second() + i64::from(inp.check_at)).unwrap();
    match verify(key, &token, at) {
        Ok(c) => {
            assert_eq!(c, claims, "a verified token has the claims we minted");
            assert!(at.as_second() < claims.exp);
        }
        Err(e) => {
            assert_eq!(e, TokenError::Expired, "{e:?}");
            assert!(at.as_second() >= claims.exp);
        }
    }
    assert_ne!(
        verify(other, &token, at).err(),
        None,
        "a token verified under another key"
    );

    // One changed byte breaks it.
    let mut bytes = token.clone().into_bytes();
    let i = usize::from(inp.flip_at) % bytes.len();
    if bytes[i] != inp.flip_to {
        bytes[i] = inp.flip_to;
        if let Ok(t) = String::from_utf8(bytes) {
            match verify(key, &t, at) {
                Ok(c) => {
                    assert_eq!(t.trim(), token, "a modified token verified: {t:?}");
                    assert_eq!(c, claims);
                }
                Err(_) => {}
            }
        }
    }

    // Keep / mint decisions.
    let p = TokenPolicy {
        renew_before: SignedDuration::from_hours(i64::from(inp.renew_before_h)),
        renew_fraction: f64::from(inp.renew_fraction) / 255.0,
        ..policy
    };
    let expected = format!("exporter:{}", inp.sub);
    let (t2, c2) = mint(key, &expected, now, lifetime);
    match decide(Some(t2.as_bytes()), key, &expected, at, &p) {
        TokenAction::Keep(c) => {
            assert_eq!(c, c2);
            assert!(verify(key, &t2, at).is_ok());
            assert!(p.renewal_at(&c).is_none_or(|r| r > at));
        }
        TokenAction::Mint(MintReason::Renewed) => {
            let r = p.renewal_at(&c2).expect("renewed without a renewal time");
            assert!(r <= at);
        }
        TokenAction::Mint(MintReason::Replaced(_)) => assert!(verify(key, &t2, at).is_err()),
        TokenAction::Mint(MintReason::Created) => panic!("a stored token counts as missing"),
    }
    match decide(Some(t2.as_bytes()), key, "exporter:someone-else", at, &p) {
        TokenAction::Keep(_) => panic!("kept a token for another subject"),
        TokenAction::Mint(_) => {}
    }
});

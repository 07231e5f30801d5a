//! Router tokens (src/exporter/router/token.rs), HS256. Properties: `verify` never panics on
//! any text and accepts none it did not sign; `sign`→`verify` gives back exactly the claims
//! when they are valid at that instant, and the error names the first rule they break
//! otherwise; a token signed with another key, or with one byte changed, never verifies.
#![no_main]

use arbitrary::Arbitrary;
use jiff::Timestamp;
use libfuzzer_sys::fuzz_target;
use ucm::exporter::router::token::{
    AUDIENCE, Audience, Claims, ISSUER, RouterKey, RouterTokenError, mint, sign, verify,
};

#[derive(Arbitrary, Debug)]
struct Input {
    key: Vec<u8>,
    junk: String,
    right_iss: bool,
    aud: Vec<bool>,
    aud_list: bool,
    sub: String,
    exp: i32,
    nbf: i32,
    iat: i32,
    jti: String,
    flip_at: u16,
    flip_to: u8,
}

const NOW: i64 = 1_800_000_000;

fuzz_target!(|inp: Input| {
    let Some(key) = RouterKey::new(if inp.key.is_empty() {
        vec![1]
    } else {
        inp.key.clone()
    }) else {
        return;
    };
    let other = RouterKey::new([inp.key.as_slice(), b"x"].concat()).unwrap();
    let now = Timestamp::from_second(NOW).unwrap();
    assert!(verify(&key, &inp.junk, now).is_err(), "junk verified");

    let auds: Vec<String> = inp
        .aud
        .iter()
        .map(|ok| {
            if *ok {
                AUDIENCE.to_string()
            } else {
                "https://elsewhere".to_string()
            }
        })
        .collect();
    let aud = match (inp.aud_list, auds.first()) {
        (false, Some(a)) => Audience::One(a.clone()),
        _ => Audience::Many(auds.clone()),
    };
    let aud_ok = match &aud {
        Audience::One(a) => a == AUDIENCE,
        Audience::Many(v) => v.iter().any(|a| a == AUDIENCE),
    };
    let claims = Claims {
        iss: if inp.right_iss {
            ISSUER.into()
        } else {
            "https://jumpstarter.dev/other".into()
        },
        aud,
        sub: inp.sub.clone(),
        exp: NOW + i64::from(inp.exp),
        nbf: NOW + i64::from(inp.nbf),
        iat: NOW + i64::from(inp.iat),
        jti: inp.jti.clone(),
    };
    let token = sign(&key, &claims);
    let want = if !inp.right_iss || !aud_ok || inp.sub.is_empty() {
        Err(RouterTokenError::Claims)
    } else if claims.exp <= NOW {
        Err(RouterTokenError::Expired)
    } else if claims.nbf > NOW + 60 || claims.iat > NOW + 60 {
        Err(RouterTokenError::NotYetValid)
    } else {
        Ok(claims.clone())
    };
    assert_eq!(verify(&key, &token, now), want);
    assert_eq!(
        verify(&other, &token, now),
        Err(RouterTokenError::Signature)
    );

    let mut bytes = token.clone().into_bytes();
    let i = usize::from(inp.flip_at) % bytes.len();
    if bytes[i] != inp.flip_to {
        bytes[i] = inp.flip_to;
        if let Ok(t) = String::from_utf8(bytes) {
            assert!(
                verify(&key, &t, now).is_err(),
                "a modified token verified: {t:?}"
            );
        }
    }

    // Minted tokens: fresh stream ids, valid for their lifetime, not after it.
    let (t, sub, exp) = mint(&key, now);
    let c = verify(&key, &t, now).expect("a minted token verifies");
    assert_eq!(c.sub, sub);
    assert_eq!(c.exp, exp.as_second());
    assert_eq!(verify(&key, &t, exp), Err(RouterTokenError::Expired));
});

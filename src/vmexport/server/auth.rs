//! Token check (docs/vmexport.md, "Export server"): header or query parameter
//! `x-kubevirt-export-token`, the expected value re-read from TOKEN_FILE on every request (rotation
//! without restart), compared in constant time. Never logged.

use std::path::Path;

use subtle::ConstantTimeEq;

use crate::vmexport::api::TOKEN_HEADER;

#[derive(Debug, PartialEq, Eq)]
pub enum AuthResult {
    Ok,
    /// Missing or wrong token, or an empty token file.
    Unauthorized,
    /// The token file cannot be read.
    Error,
}

/// Splits the query into the token (if present) and the remaining query string.
pub fn take_query_token(query: Option<&str>) -> (Option<String>, Option<String>) {
    let Some(q) = query else { return (None, None) };
    let mut token = None;
    let mut rest = Vec::new();
    for pair in q.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == TOKEN_HEADER {
            token = Some(percent_decode(v));
        } else if !pair.is_empty() {
            rest.push(pair);
        }
    }
    let rest = (!rest.is_empty()).then(|| rest.join("&"));
    (token, rest)
}

pub fn check(token_file: &Path, presented: Option<&[u8]>) -> AuthResult {
    match std::fs::read(token_file) {
        Ok(t) => check_token(&t, presented),
        Err(_) => AuthResult::Error,
    }
}

/// The same rule against a token already read (`ucm export-proxy` reads it from the Secret).
pub fn check_token(expected: &[u8], presented: Option<&[u8]>) -> AuthResult {
    let expected = trim_ascii(expected);
    let Some(got) = presented else {
        return AuthResult::Unauthorized;
    };
    if expected.is_empty() {
        return AuthResult::Unauthorized;
    }
    if bool::from(expected.ct_eq(got)) {
        AuthResult::Ok
    } else {
        AuthResult::Unauthorized
    }
}

fn trim_ascii(b: &[u8]) -> &[u8] {
    // A Secret written by hand often ends with a newline; the token alphabet has no spaces.
    b.trim_ascii()
}

/// Decodes `%XX` and `+` (form encoding) in a query value or path segment.
pub fn percent_decode(s: &str) -> String {
    percent_decode_bytes(s, true)
}

pub fn percent_decode_path(s: &str) -> String {
    percent_decode_bytes(s, false)
}

fn percent_decode_bytes(s: &str, plus_is_space: bool) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' if plus_is_space => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_token_is_removed() {
        let (t, rest) = take_query_token(Some("a=1&x-kubevirt-export-token=abc%2B1&b=2"));
        assert_eq!(t.as_deref(), Some("abc+1"));
        assert_eq!(rest.as_deref(), Some("a=1&b=2"));
        assert_eq!(take_query_token(None), (None, None));
        let (t, rest) = take_query_token(Some("x-kubevirt-export-token=z"));
        assert_eq!((t.as_deref(), rest), (Some("z"), None));
    }

    #[test]
    fn token_file_rules() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("token");
        assert_eq!(check(&f, Some(b"x")), AuthResult::Error);
        std::fs::write(&f, "secret\n").unwrap();
        assert_eq!(check(&f, Some(b"secret")), AuthResult::Ok);
        assert_eq!(check(&f, Some(b"secreT")), AuthResult::Unauthorized);
        assert_eq!(check(&f, Some(b"")), AuthResult::Unauthorized);
        assert_eq!(check(&f, None), AuthResult::Unauthorized);
        std::fs::write(&f, "").unwrap();
        assert_eq!(check(&f, Some(b"")), AuthResult::Unauthorized);
    }

    #[test]
    fn decoding() {
        assert_eq!(percent_decode_path("a%20b+c%2"), "a b+c%2");
        assert_eq!(percent_decode("a+b%41"), "a bA");
    }
}

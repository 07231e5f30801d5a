//! Kubernetes name syntax (apimachinery's `IsDNS1123Subdomain`, `IsQualifiedName`,
//! `IsValidLabelValue`), for user input that ucm turns into names the API server would refuse.

/// A lowercase RFC 1123 subdomain of at most 253 characters: object names such as Secrets.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

/// The name part of a qualified name: at most 63 letters, digits, `-`, `_` and `.`, starting and
/// ending with a letter or digit (label keys' names, finalizer names).
pub fn is_qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
}

/// An optional DNS subdomain prefix and `/`, then a name part (label keys, finalizers).
pub fn is_qualified_name(s: &str) -> bool {
    match s.rsplit_once('/') {
        Some((prefix, name)) => is_dns_subdomain(prefix) && is_qualified_name_part(name),
        None => is_qualified_name_part(s),
    }
}

/// A label value: empty, or a name part.
pub fn is_label_value(s: &str) -> bool {
    s.is_empty() || is_qualified_name_part(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn as_apimachinery() {
        for ok in ["a", "a-b.c", "0.example.com", &"s".repeat(253)] {
            assert!(is_dns_subdomain(ok), "{ok}");
        }
        for bad in ["", "A", "a_b", "-a", "a-", "a..b", "a/b", &"s".repeat(254)] {
            assert!(!is_dns_subdomain(bad), "{bad:?}");
        }
        for ok in ["a", "Board_Type", "A.b-c", &"n".repeat(63)] {
            assert!(is_qualified_name_part(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "a b", "a/b", &"n".repeat(64)] {
            assert!(!is_qualified_name_part(bad), "{bad:?}");
        }
        assert!(is_qualified_name("jumpstarter.dev/board"));
        assert!(is_qualified_name("board"));
        for bad in ["Example.com/a", "a/b/c", "/a", "a/", "bad key!"] {
            assert!(!is_qualified_name(bad), "{bad:?}");
        }
        assert!(is_label_value("") && is_label_value("rpi-4"));
        assert!(!is_label_value("not valid") && !is_label_value("-x"));
    }
}

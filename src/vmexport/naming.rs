//! Object names (docs/vmexport.md, "Names"). UPSTREAM names are what `virtctl vmexport` and users
//! look up, so they follow openshift library-go `naming.GetName` with KubeVirt's 63-character
//! limit.

/// DNS-1035 label limit used for every export child name.
pub const MAX_NAME: usize = 63;

fn fnv32a_hex(s: &str) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for b in s.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("{h:08x}")
}

/// `<base>-<suffix>` if it fits in `max`; otherwise the base is truncated and an 8-hex FNV-32a
/// hash inserted (library-go `GetName`). A suffix of exactly `max - 10` characters leaves no room
/// for the base; library-go would then produce a name starting with `-`, which is no valid label,
/// so (as upstream's golden value `v-efa2f187-…` shows) the first base character is kept and the
/// result cut to `max`. OURS: a cut that leaves a trailing `-` or `.` (the suffix had one at
/// that position) drops it, since a name ending so is refused by the API server (found by the
/// `vmexport_links` fuzz target).
pub fn get_name(base: &str, suffix: &str, max: usize) -> String {
    let name = format!("{base}-{suffix}");
    if name.len() <= max {
        return name;
    }
    let hash_len = 10; // "-" + 8 hex + "-"
    if suffix.len() + hash_len > max {
        // Suffix too long: keep a prefix of the base and hash the whole name.
        let keep = base.len().min(max.saturating_sub(9));
        let short = format!("{}-{}", &base[..keep], fnv32a_hex(&name));
        return short[..short.len().min(max)].to_string();
    }
    let base_len = (max - hash_len - suffix.len()).max(1).min(base.len());
    let out = format!("{}-{}-{}", &base[..base_len], fnv32a_hex(base), suffix);
    out[..out.len().min(max)]
        .trim_end_matches(['-', '.'])
        .to_string()
}

/// Service name: dots are not allowed in a DNS-1035 label.
pub fn service_name(export: &str) -> String {
    get_name("virt-export", &export.replace('.', "-"), MAX_NAME)
}

/// Pod name: dots kept (a pod name is a DNS subdomain).
pub fn pod_name(export: &str) -> String {
    get_name("virt-export", export, MAX_NAME)
}

pub fn token_secret_name(export: &str) -> String {
    get_name("export-token", export, MAX_NAME)
}

pub fn cert_secret_name(export: &str) -> String {
    get_name("export-cert", export, MAX_NAME)
}

pub fn manifest_configmap_name(export: &str) -> String {
    format!("exporter-vm-manifest-{export}")
}

/// Name of the Secret the `auth-header-secret` manifest returns (UPSTREAM).
pub fn header_secret_name(export: &str) -> String {
    format!("header-secret-{export}")
}

/// Name of the CA ConfigMap in the `all` manifest (UPSTREAM).
pub fn ca_configmap_name(export: &str) -> String {
    format!("export-ca-cm-{export}")
}

/// Restore PVC of a snapshot source (docs/vmexport.md, "Sources").
pub fn restore_pvc_name(export: &str, pvc: &str) -> String {
    format!("{export}-{pvc}")
}

/// Value of the pod selector label `kubevirt.io.virt-export-service`: label values are limited to
/// 63 characters.
pub fn selector_label_value(export: &str) -> String {
    if export.len() <= MAX_NAME {
        export.to_string()
    } else {
        get_name("virt-export", export, MAX_NAME)
    }
}

/// Pod volume name `v<i>-<pvc>` (OURS, docs/vmexport.md, "Names"): the index keeps names unique
/// even when two claims sanitise to the same text (`my.disk`, `my-disk`).
pub fn pod_volume_name(index: usize, pvc: &str) -> String {
    let mut name = format!("v{index}-{}", pvc.replace('.', "-"));
    name.truncate(MAX_NAME);
    while name.ends_with('-') {
        name.pop();
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_golden_values() {
        assert_eq!(service_name("test"), "virt-export-test");
        assert_eq!(service_name("test.com"), "virt-export-test-com");
        let long = "a".repeat(53);
        let svc = service_name(&long);
        assert!(svc.starts_with("v-efa2f187-"), "{svc}");
        assert_eq!(svc.len(), 63);
    }

    #[test]
    fn names_never_exceed_63() {
        for n in [1, 20, 51, 52, 53, 54, 60, 63, 64, 200, 253] {
            let export = "b".repeat(n);
            for name in [
                service_name(&export),
                pod_name(&export),
                token_secret_name(&export),
                cert_secret_name(&export),
                selector_label_value(&export),
                pod_volume_name(12, &export),
            ] {
                assert!(name.len() <= 63, "{n}: {name}");
                assert!(!name.starts_with('-') && !name.ends_with('-'), "{name}");
            }
        }
    }

    #[test]
    fn a_cut_never_leaves_a_trailing_separator() {
        // 53 characters whose 52nd is a separator: the cut to 63 drops the last one.
        for sep in ['-', '.'] {
            let export = format!("{}{sep}z", "a".repeat(51));
            assert_eq!(export.len(), 53);
            for name in [
                service_name(&export),
                pod_name(&export),
                token_secret_name(&export),
                cert_secret_name(&export),
            ] {
                assert!(name.len() <= 63, "{name}");
                assert!(
                    name.ends_with(|c: char| c.is_ascii_alphanumeric()),
                    "{name:?} ends with a separator"
                );
            }
        }
        assert!(service_name(&"a".repeat(53)).starts_with("v-efa2f187-"));
    }

    #[test]
    fn short_names_are_plain_joins() {
        assert_eq!(pod_name("my.export"), "virt-export-my.export");
        assert_eq!(service_name("my.export"), "virt-export-my-export");
        assert_eq!(token_secret_name("e1"), "export-token-e1");
        assert_eq!(cert_secret_name("e1"), "export-cert-e1");
        assert_eq!(selector_label_value("e1"), "e1");
    }

    #[test]
    fn long_names_hash_deterministically_and_differ() {
        let a = service_name(&"x".repeat(60));
        let b = service_name(&"y".repeat(60));
        assert_ne!(a, b);
        assert_eq!(a, service_name(&"x".repeat(60)));
        // a suffix longer than the limit keeps a base prefix and hashes the full name
        let v = get_name("virt-export", &"z".repeat(70), 63);
        assert!(v.starts_with("virt-export-") && v.len() == 20, "{v}");
        // selector label value of a 64-char name is hashed into a valid label value
        let l = selector_label_value(&"q".repeat(64));
        assert!(l.starts_with("virt-export-") && l.len() <= 63, "{l}");
    }

    #[test]
    fn pod_volume_names_are_unique_and_trimmed() {
        assert_eq!(pod_volume_name(0, "my.disk"), "v0-my-disk");
        assert_eq!(pod_volume_name(1, "my-disk"), "v1-my-disk");
        let long = format!("{}-{}", "a".repeat(59), "b".repeat(10));
        let v = pod_volume_name(3, &long);
        assert_eq!(v, format!("v3-{}", "a".repeat(59)));
        assert!(!v.ends_with('-'));
    }
}

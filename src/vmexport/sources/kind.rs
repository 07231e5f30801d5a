//! Which kind of source an export names, and whether its `spec.tokenSecretRef` can name a Secret
//! (docs/vmexport.md, "Sources"). Pure.

use super::super::types::VirtualMachineExportSpec;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    Pvc,
    VirtualMachine,
    VirtualMachineSnapshot,
    VirtualMachineTemplate,
    Unsupported,
}

pub fn classify_source(spec: &VirtualMachineExportSpec) -> SourceKind {
    let group = spec.source.api_group.as_deref().unwrap_or("");
    match (spec.source.kind.as_str(), group) {
        ("PersistentVolumeClaim", "") => SourceKind::Pvc,
        ("VirtualMachine", "kubevirt.io") => SourceKind::VirtualMachine,
        ("VirtualMachineSnapshot", "snapshot.kubevirt.io") => SourceKind::VirtualMachineSnapshot,
        ("VirtualMachineTemplate", "template.kubevirt.io") => SourceKind::VirtualMachineTemplate,
        _ => SourceKind::Unsupported,
    }
}

/// Message of `Skipped/UnsupportedSource`: names what was asked and what is supported.
pub fn unsupported_source_message(spec: &VirtualMachineExportSpec) -> String {
    let group = spec.source.api_group.as_deref().unwrap_or("");
    let group = if group.is_empty() { "core" } else { group };
    format!(
        "source kind {:?} in API group {:?} is not supported; supported sources are PersistentVolumeClaim (core group), VirtualMachine (kubevirt.io), VirtualMachineSnapshot (snapshot.kubevirt.io) and VirtualMachineTemplate (template.kubevirt.io)",
        spec.source.kind, group
    )
}

/// OURS: a `spec.tokenSecretRef` that is not a Secret name can never be mounted, so the export
/// Pod would wait in ContainerCreating forever, and the spec cannot change. `Skipped` says so.
pub fn token_secret_ref_problem(spec: &VirtualMachineExportSpec) -> Option<String> {
    let name = spec.token_secret_ref.as_deref()?;
    (!crate::k8s_names::is_dns_subdomain(name)).then(|| {
        format!(
            "spec.tokenSecretRef {name:?} is not a valid Secret name (lower-case letters, digits, '-' and '.', at most 253 characters); the spec cannot change, so delete this export and create one that names an existing Secret, or leave tokenSecretRef out to get a generated token"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmexport::fixtures::export;

    #[test]
    fn token_secret_refs_that_cannot_name_a_secret() {
        let mut spec = export("e").spec;
        assert_eq!(token_secret_ref_problem(&spec), None);
        for ok in ["secret-e1", "a.b-c", &"s".repeat(253)] {
            spec.token_secret_ref = Some(ok.into());
            assert_eq!(token_secret_ref_problem(&spec), None, "{ok}");
        }
        for bad in ["", "Bad_Name", "a/b", "-a", "a..b", &"s".repeat(254)] {
            spec.token_secret_ref = Some(bad.into());
            let m = token_secret_ref_problem(&spec).unwrap_or_else(|| panic!("{bad:?}"));
            assert!(m.contains("is not a valid Secret name"), "{m}");
            assert!(m.contains("delete this export"), "{m}");
        }
    }

    #[test]
    fn classify_sources() {
        let mut spec = export("e").spec;
        assert_eq!(classify_source(&spec), SourceKind::Pvc);
        spec.source.api_group = Some(String::new());
        assert_eq!(classify_source(&spec), SourceKind::Pvc);
        spec.source.kind = "VirtualMachine".into();
        spec.source.api_group = Some("kubevirt.io".into());
        assert_eq!(classify_source(&spec), SourceKind::VirtualMachine);
        spec.source.api_group = Some("foo.io".into());
        assert_eq!(classify_source(&spec), SourceKind::Unsupported);
        spec.source.kind = "VirtualMachineSnapshot".into();
        spec.source.api_group = Some("snapshot.kubevirt.io".into());
        assert_eq!(classify_source(&spec), SourceKind::VirtualMachineSnapshot);
        spec.source.kind = "VirtualMachineTemplate".into();
        spec.source.api_group = Some("template.kubevirt.io".into());
        assert_eq!(classify_source(&spec), SourceKind::VirtualMachineTemplate);
        spec.source.api_group = Some("kubevirt.io".into());
        assert_eq!(classify_source(&spec), SourceKind::Unsupported);
        spec.source.kind = "Pod".into();
        spec.source.api_group = None;
        assert_eq!(classify_source(&spec), SourceKind::Unsupported);
        let msg = unsupported_source_message(&spec);
        assert!(
            msg.contains("\"Pod\"")
                && msg.contains("core")
                && msg.contains("VirtualMachineSnapshot")
                && msg.contains("VirtualMachineTemplate (template.kubevirt.io)")
        );
    }
}

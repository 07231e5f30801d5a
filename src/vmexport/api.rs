//! The constants of the API ucm serves and of the objects it makes (docs/vmexport.md, "API
//! versions and validation", "Phases and conditions", "Export pod"): group, kind, phases,
//! conditions and reasons, labels, annotations, ports and paths. UPSTREAM values unless marked.

use std::time::Duration;

pub const GROUP: &str = "export.kubevirt.io";
/// The version the reconciler reads and writes exports with (the storage version). Owner
/// references and links carry it, as KubeVirt's controller does with the version it uses; the
/// API server serves every stored object in it (conversion `None`), whichever version a client
/// wrote.
pub const OWNER_API_VERSION: &str = "export.kubevirt.io/v1";
pub const KIND: &str = "VirtualMachineExport";

pub const PHASE_PENDING: &str = "Pending";
pub const PHASE_READY: &str = "Ready";
pub const PHASE_TERMINATED: &str = "Terminated";
pub const PHASE_SKIPPED: &str = "Skipped";

pub const COND_READY: &str = "Ready";
pub const COND_PVC_READY: &str = "PVCReady";
pub const COND_VOLUMES_CREATED: &str = "VolumesCreated";
/// KubeVirt 1.9's `OCIExport` gate: the `oci` format's digests are computed (the export server
/// is ready only then). Written only with `--export-oci`.
pub const COND_OCI_READY: &str = "OCIReady";

pub const REASON_INITIALIZING: &str = "Initializing";
pub const REASON_PVC_NOT_FOUND: &str = "PVCNotFound";
pub const REASON_PVC_BOUND: &str = "PVCBound";
pub const REASON_PVC_PENDING: &str = "PVCPending";
pub const REASON_UNKNOWN: &str = "Unknown";
pub const REASON_IN_USE: &str = "InUse";
pub const REASON_POD_PENDING: &str = "PodPending";
pub const REASON_POD_READY: &str = "PodReady";
pub const REASON_POD_COMPLETED: &str = "PodCompleted";
pub const REASON_VM_NOT_FOUND: &str = "VMNotFound";
pub const REASON_VM_NO_VOLUMES: &str = "VMNoVolumes";
pub const REASON_VOLUMES_NOT_POPULATED: &str = "VolumesNotPopulated";
pub const REASON_VMSNAPSHOT_NOT_FOUND: &str = "VMSnapshotNotFound";
pub const REASON_VMSNAPSHOT_NO_VOLUMES: &str = "VMSnapshotNoVolumes";
pub const REASON_NOT_ALL_PVCS_CREATED: &str = "NotAllPVCsCreated";
pub const REASON_ALL_PVCS_READY: &str = "AllPVCsReady";
pub const REASON_NOT_ALL_PVCS_READY: &str = "NotAllPVCsReady";
pub const REASON_VM_TEMPLATE_NOT_FOUND: &str = "VMTemplateNotFound";
pub const REASON_VM_TEMPLATE_NOT_READY: &str = "VMTemplateNotReady";
pub const REASON_DIGESTS_COMPUTED: &str = "DigestsComputed";
pub const REASON_DIGESTS_PENDING: &str = "DigestsPending";
// OURS ("Failures")
pub const REASON_UNSUPPORTED_SOURCE: &str = "UnsupportedSource";
pub const REASON_SOURCE_API_NOT_INSTALLED: &str = "SourceAPINotInstalled";
pub const REASON_POD_CREATION_FAILED: &str = "PodCreationFailed";
pub const REASON_OBJECT_CREATION_FAILED: &str = "ObjectCreationFailed";
pub const REASON_INVALID_TOKEN_SECRET_REF: &str = "InvalidTokenSecretRef";
/// The TTL passed while the export Pod runs: deletion waits for downloads in flight.
pub const REASON_WAITING_FOR_TRANSFERS: &str = "WaitingForTransfers";

/// Every reason this feature writes, for validation tests.
pub const ALL_REASONS: &[&str] = &[
    REASON_INITIALIZING,
    REASON_PVC_NOT_FOUND,
    REASON_PVC_BOUND,
    REASON_PVC_PENDING,
    REASON_UNKNOWN,
    REASON_IN_USE,
    REASON_POD_PENDING,
    REASON_POD_READY,
    REASON_POD_COMPLETED,
    REASON_VM_NOT_FOUND,
    REASON_VM_NO_VOLUMES,
    REASON_VOLUMES_NOT_POPULATED,
    REASON_VMSNAPSHOT_NOT_FOUND,
    REASON_VMSNAPSHOT_NO_VOLUMES,
    REASON_NOT_ALL_PVCS_CREATED,
    REASON_ALL_PVCS_READY,
    REASON_NOT_ALL_PVCS_READY,
    REASON_VM_TEMPLATE_NOT_FOUND,
    REASON_VM_TEMPLATE_NOT_READY,
    REASON_DIGESTS_COMPUTED,
    REASON_DIGESTS_PENDING,
    REASON_UNSUPPORTED_SOURCE,
    REASON_SOURCE_API_NOT_INSTALLED,
    REASON_INVALID_TOKEN_SECRET_REF,
    REASON_POD_CREATION_FAILED,
    REASON_OBJECT_CREATION_FAILED,
    REASON_WAITING_FOR_TRANSFERS,
];

pub const APP_LABEL: &str = "kubevirt.io";
pub const APP_LABEL_VALUE: &str = "virt-exporter";
pub const EXPORT_SERVICE_LABEL: &str = "kubevirt.io.virt-export-service";
pub const ANN_CERT_PARAMS: &str = "kubevirt.io/export.certParameters";
/// On the serving-certificate Secret (OURS): when it is renewed in place (notAfter −
/// renewBefore, RFC 3339), so a pass knows from the cached metadata alone.
pub const ANN_CERT_RENEW_AT: &str = "ucm.io/renew-at";
pub const ANN_CONTENT_TYPE: &str = "cdi.kubevirt.io/storage.contentType";

pub const TOKEN_KEY: &str = "token";
pub const TOKEN_HEADER: &str = "x-kubevirt-export-token";
/// OURS: upstream uses 20 characters ("Token").
pub const TOKEN_LENGTH: usize = 32;

pub const DEFAULT_TTL: Duration = Duration::from_secs(2 * 3600);
pub const SERVER_PORT: i32 = 8443;
pub const METRICS_PORT: i32 = 8080;
pub const READINESS_PATH: &str = "/exportready";
pub const BLOCK_MOUNT_PATH: &str = "/dev/export-volumes";
pub const FS_MOUNT_PATH: &str = "/export-volumes";
pub const MANIFESTS_ALL_PATH: &str = "/manifests/all";
pub const MANIFESTS_SECRET_PATH: &str = "/manifests/secret";
/// The `oci` format's archive (`EXPORT_OCI_URI`); its links carry no /internal or /external.
pub const OCI_PATH: &str = "/export.oci.tar";
/// The manifest ConfigMap's key for a template source's VirtualMachineTemplate (upstream's key).
pub const VM_TEMPLATE_MANIFEST_KEY: &str = "virtualmachinetemplate-manifest";
/// qemu UID/GID that owns CDI disk images (#9742).
pub const KVM_ID: i64 = 107;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_camel_case() {
        let re = |s: &str| {
            let b = s.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphabetic()
                && b.iter().all(|c| c.is_ascii_alphanumeric())
                && s.len() <= 1024
        };
        for r in ALL_REASONS {
            assert!(re(r), "{r}");
        }
    }
}

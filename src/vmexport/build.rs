//! Pure decision logic of the vmexport reconciler: no client, no clock (time is a parameter).
//! Each function turns plain inputs into plain objects (docs/architecture.md, "How a pass is
//! built"). Section headers below name the sections of docs/vmexport.md.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource,
    HTTPGetAction, ObjectFieldSelector, PersistentVolumeClaim, PersistentVolumeClaimVolumeSource,
    Pod, PodSecurityContext, PodSpec, Probe, ResourceRequirements, SeccompProfile,
    SecretVolumeSource, SecurityContext, Service, ServicePort, ServiceSpec, Volume, VolumeDevice,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;

use super::naming;
use super::types::{
    Condition, VirtualMachineExport, VirtualMachineExportLink, VirtualMachineExportLinks,
    VirtualMachineExportManifest, VirtualMachineExportSpec, VirtualMachineExportStatus,
    VirtualMachineExportVolume, VirtualMachineExportVolumeFormat,
};
use crate::godur;

// ---- API constants (UPSTREAM values unless marked) ----

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
// OURS ("Failures")
pub const REASON_UNSUPPORTED_SOURCE: &str = "UnsupportedSource";
pub const REASON_SOURCE_API_NOT_INSTALLED: &str = "SourceAPINotInstalled";
pub const REASON_POD_CREATION_FAILED: &str = "PodCreationFailed";
pub const REASON_OBJECT_CREATION_FAILED: &str = "ObjectCreationFailed";
pub const REASON_INVALID_TOKEN_SECRET_REF: &str = "InvalidTokenSecretRef";

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
    REASON_UNSUPPORTED_SOURCE,
    REASON_SOURCE_API_NOT_INSTALLED,
    REASON_INVALID_TOKEN_SECRET_REF,
    REASON_POD_CREATION_FAILED,
    REASON_OBJECT_CREATION_FAILED,
];

pub const APP_LABEL: &str = "kubevirt.io";
pub const APP_LABEL_VALUE: &str = "virt-exporter";
pub const EXPORT_SERVICE_LABEL: &str = "kubevirt.io.virt-export-service";
pub const ANN_CERT_PARAMS: &str = "kubevirt.io/export.certParameters";
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
/// qemu UID/GID that owns CDI disk images (#9742).
pub const KVM_ID: i64 = 107;

// ---- Source classification ("Sources") ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    Pvc,
    VirtualMachine,
    VirtualMachineSnapshot,
    Unsupported,
}

pub fn classify_source(spec: &VirtualMachineExportSpec) -> SourceKind {
    let group = spec.source.api_group.as_deref().unwrap_or("");
    match (spec.source.kind.as_str(), group) {
        ("PersistentVolumeClaim", "") => SourceKind::Pvc,
        ("VirtualMachine", "kubevirt.io") => SourceKind::VirtualMachine,
        ("VirtualMachineSnapshot", "snapshot.kubevirt.io") => SourceKind::VirtualMachineSnapshot,
        _ => SourceKind::Unsupported,
    }
}

/// Message of `Skipped/UnsupportedSource`: names what was asked and what is supported.
pub fn unsupported_source_message(spec: &VirtualMachineExportSpec) -> String {
    let group = spec.source.api_group.as_deref().unwrap_or("");
    let group = if group.is_empty() { "core" } else { group };
    format!(
        "source kind {:?} in API group {:?} is not supported; supported sources are PersistentVolumeClaim (core group), VirtualMachine (kubevirt.io) and VirtualMachineSnapshot (snapshot.kubevirt.io)",
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

// ---- TTL ("TTL") ----

/// The lifetime to apply, and a warning text when the stored value does not parse (the CRD's
/// CEL rule normally prevents that; an object stored before the rule existed falls back to 2h).
pub fn ttl_duration(spec: &VirtualMachineExportSpec) -> (Duration, Option<String>) {
    match spec.ttl_duration.as_deref() {
        None => (DEFAULT_TTL, None),
        Some(s) => match godur::parse(s) {
            Ok(d) => (d, None),
            Err(e) => (
                DEFAULT_TTL,
                Some(format!(
                    "ttlDuration {s:?} is invalid ({e}); using the default {}",
                    godur::format(DEFAULT_TTL)
                )),
            ),
        },
    }
}

/// `creationTimestamp + ttlDuration`, whole seconds (metav1.Time precision).
pub fn ttl_expiration(created: jiff::Timestamp, ttl: Duration) -> jiff::Timestamp {
    let secs = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX / 2);
    let t = created
        .checked_add(jiff::SignedDuration::from_secs(secs))
        .unwrap_or(jiff::Timestamp::MAX);
    jiff::Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// `None` when expired (delete now), else the exact wait until expiry.
pub fn until_expiry(now: jiff::Timestamp, expiry: jiff::Timestamp) -> Option<Duration> {
    if now >= expiry {
        return None;
    }
    let d = expiry.duration_since(now);
    Some(Duration::try_from(d).unwrap_or(Duration::ZERO))
}

// ---- Conditions, KubeVirt mode ("Phases and conditions") ----

pub fn condition(type_: &str, status: bool, reason: &str, message: impl Into<String>) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_probe_time: None,
        last_transition_time: None,
    }
}

// ---- PVCs ("Sources": populated, content, in use) ----

pub fn is_block(pvc: &PersistentVolumeClaim) -> bool {
    pvc.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some("Block")
}

pub fn pvc_phase(pvc: &PersistentVolumeClaim) -> &str {
    pvc.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// The controlling owner of kind DataVolume (group cdi.kubevirt.io), if any.
pub fn owning_datavolume(pvc: &PersistentVolumeClaim) -> Option<&str> {
    pvc.metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| {
            o.controller == Some(true)
                && o.kind == "DataVolume"
                && o.api_version.starts_with("cdi.kubevirt.io/")
        })
        .map(|o| o.name.as_str())
}

/// Content is "kubevirt" (a disk image) when the annotation says `kubevirt` or is empty; without
/// the annotation the owning DataVolume's `spec.contentType` decides; otherwise "archive".
pub fn is_kubevirt_content(pvc: &PersistentVolumeClaim, dv_content_type: Option<&str>) -> bool {
    if let Some(v) = pvc.annotations().get(ANN_CONTENT_TYPE) {
        return v.is_empty() || v == "kubevirt";
    }
    match (owning_datavolume(pvc), dv_content_type) {
        (Some(_), Some(ct)) => ct.is_empty() || ct == "kubevirt",
        _ => false,
    }
}

/// Populated unless a controlling DataVolume exists and has not `Succeeded`. `dv_phase` is the
/// owning DataVolume's phase, `None` when the DataVolume API is absent or the DV not found
/// (then CDI cannot be asked, and the PVC counts as populated).
pub fn is_populated(pvc: &PersistentVolumeClaim, dv_phase: Option<&str>) -> bool {
    match owning_datavolume(pvc) {
        None => true,
        Some(_) => dv_phase.is_none_or(|p| p == "Succeeded"),
    }
}

/// `PVCReady` from the claim phase, or `PVCNotFound`.
pub fn pvc_condition(ns: &str, name: &str, pvc: Option<&PersistentVolumeClaim>) -> Condition {
    match pvc {
        None => condition(
            COND_PVC_READY,
            false,
            REASON_PVC_NOT_FOUND,
            format!("PersistentVolumeClaim {ns}/{name} not found"),
        ),
        Some(p) => match pvc_phase(p) {
            "Bound" => condition(COND_PVC_READY, true, REASON_PVC_BOUND, ""),
            "Pending" => condition(COND_PVC_READY, false, REASON_PVC_PENDING, ""),
            _ => condition(COND_PVC_READY, false, REASON_UNKNOWN, ""),
        },
    }
}

fn pod_mounts_claim(pod: &Pod, claim: &str) -> bool {
    pod.spec.as_ref().is_some_and(|s| {
        s.volumes.iter().flatten().any(|v| {
            v.persistent_volume_claim
                .as_ref()
                .is_some_and(|p| p.claim_name == claim)
        })
    })
}

/// A claim is in use if a pod in its namespace mounts it, is not this export's own pod (matched
/// by controller owner UID), and has not terminated. Terminating pods still count; another
/// export's pod counts ("Sources").
pub fn pvc_in_use<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    claim: &str,
    export_uid: &str,
) -> Option<&'a Pod> {
    pods.into_iter().find(|pod| {
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded") | Some("Failed")) {
            return false;
        }
        let own = pod
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && o.uid == export_uid);
        !own && pod_mounts_claim(pod, claim)
    })
}

// ---- Export pod state ("Phases and conditions") ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodState {
    Pending,
    Ready,
    Succeeded,
    /// Running but not ready, Failed or Unknown.
    NotReady,
}

pub fn pod_state(pod: &Pod) -> PodState {
    let status = pod.status.as_ref();
    match status.and_then(|s| s.phase.as_deref()) {
        Some("Pending") | None => PodState::Pending,
        Some("Succeeded") => PodState::Succeeded,
        Some("Running") => {
            let statuses = status.and_then(|s| s.container_statuses.as_ref());
            match statuses {
                Some(cs) if !cs.is_empty() && cs.iter().all(|c| c.ready) => PodState::Ready,
                _ => PodState::NotReady,
            }
        }
        _ => PodState::NotReady,
    }
}

/// Phase and Ready condition from the export pod.
pub fn phase_from_pod(state: PodState, pod_name: &str) -> (&'static str, Condition) {
    match state {
        PodState::Pending => (
            PHASE_PENDING,
            condition(COND_READY, false, REASON_POD_PENDING, ""),
        ),
        PodState::Ready => (
            PHASE_READY,
            condition(COND_READY, true, REASON_POD_READY, ""),
        ),
        PodState::Succeeded => (
            PHASE_TERMINATED,
            condition(COND_READY, false, REASON_POD_COMPLETED, ""),
        ),
        PodState::NotReady => (
            PHASE_PENDING,
            condition(
                COND_READY,
                false,
                REASON_UNKNOWN,
                format!(
                    "export server pod {pod_name} is not ready; see its log and its {READINESS_PATH} endpoint"
                ),
            ),
        ),
    }
}

// ---- Volumes and environment ("Export pod", "Sources") ----

/// One volume the pod serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportVolume {
    /// Claim mounted by the pod (for snapshot sources, the restore PVC).
    pub pvc: String,
    pub block: bool,
    pub kubevirt_content: bool,
}

impl ExportVolume {
    pub fn from_pvc(pvc: &PersistentVolumeClaim, dv_content_type: Option<&str>) -> Self {
        ExportVolume {
            pvc: pvc.name_any(),
            block: is_block(pvc),
            kubevirt_content: is_kubevirt_content(pvc, dv_content_type),
        }
    }
}

/// Deduplicates by claim name, keeping first occurrence order ("Names", rule 4).
pub fn dedup_volumes(vols: Vec<ExportVolume>) -> Vec<ExportVolume> {
    let mut seen = std::collections::HashSet::new();
    vols.into_iter()
        .filter(|v| seen.insert(v.pvc.clone()))
        .collect()
}

fn env(name: impl Into<String>, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    }
}

/// `VOLUME<i>_*` variables of one volume.
pub fn volume_env(i: usize, v: &ExportVolume) -> Vec<EnvVar> {
    let podvol = naming::pod_volume_name(i, &v.pvc);
    let path = if v.block {
        format!("{BLOCK_MOUNT_PATH}/{podvol}")
    } else {
        format!("{FS_MOUNT_PATH}/{podvol}")
    };
    let base = format!("/volumes/{}", v.pvc);
    let mut out = vec![env(format!("VOLUME{i}_EXPORT_PATH"), path)];
    if v.block || v.kubevirt_content {
        out.push(env(
            format!("VOLUME{i}_EXPORT_RAW_URI"),
            format!("{base}/disk.img"),
        ));
        out.push(env(
            format!("VOLUME{i}_EXPORT_RAW_GZIP_URI"),
            format!("{base}/disk.img.gz"),
        ));
    } else {
        out.push(env(
            format!("VOLUME{i}_EXPORT_ARCHIVE_URI"),
            format!("{base}/disk.tar.gz"),
        ));
        out.push(env(
            format!("VOLUME{i}_EXPORT_DIR_URI"),
            format!("{base}/dir/"),
        ));
    }
    out
}

// ---- Links ("Links") ----

/// Formats in upstream's order, with the env suffix that carries each URI.
const FORMATS: [(&str, &str); 4] = [
    ("raw", "EXPORT_RAW_URI"),
    ("gzip", "EXPORT_RAW_GZIP_URI"),
    ("dir", "EXPORT_DIR_URI"),
    ("tar.gz", "EXPORT_ARCHIVE_URI"),
];

/// Where the links point.
#[derive(Clone, Debug, Default)]
pub struct LinkSettings {
    pub namespace: String,
    pub export_name: String,
    pub service_name: String,
    /// The ucm CA, PEM.
    pub internal_cert: String,
    /// `--export-external-host`.
    pub external_host: Option<String>,
    /// Contents of `--export-external-ca-file`, or empty.
    pub external_cert: String,
    /// For snapshot sources: the `<export>-` prefix stripped from volume names.
    pub strip_prefix: Option<String>,
}

/// Builds `status.links` from the ready pod's environment: the links describe what that pod
/// serves, and the volume name is the `/volumes/<pvc>/` segment of the URI ("Links", rule 2).
pub fn links_from_pod(pod: &Pod, s: &LinkSettings) -> VirtualMachineExportLinks {
    let envs: BTreeMap<String, String> = pod
        .spec
        .as_ref()
        .and_then(|sp| sp.containers.first())
        .and_then(|c| c.env.as_ref())
        .map(|e| {
            e.iter()
                .filter_map(|v| Some((v.name.clone(), v.value.clone()?)))
                .collect()
        })
        .unwrap_or_default();
    // Indexes in numeric order, not lexical order of the names.
    let mut indexes: Vec<usize> = envs
        .keys()
        .filter_map(|k| {
            let rest = k.strip_prefix("VOLUME")?;
            let (n, _) = rest.split_once('_')?;
            n.parse().ok()
        })
        .collect();
    indexes.sort_unstable();
    indexes.dedup();

    let internal_base = format!("https://{}.{}.svc", s.service_name, s.namespace);
    let external_base = s.external_host.as_ref().map(|h| {
        format!(
            "https://{h}/api/{OWNER_API_VERSION}/namespaces/{}/virtualmachineexports/{}",
            s.namespace, s.export_name
        )
    });

    let build = |base: &str, manifest_prefix: &str, cert: &str| {
        let mut volumes = Vec::new();
        for i in &indexes {
            let mut formats = Vec::new();
            let mut name = None;
            for (format, suffix) in FORMATS {
                if let Some(uri) = envs.get(&format!("VOLUME{i}_{suffix}")) {
                    if name.is_none() {
                        name = volume_name_from_uri(uri);
                    }
                    let uri = uri.trim_end_matches('/');
                    formats.push(VirtualMachineExportVolumeFormat {
                        format: format.into(),
                        url: format!("{base}{uri}"),
                    });
                }
            }
            let Some(mut name) = name else { continue };
            if let Some(p) = &s.strip_prefix
                && let Some(stripped) = name.strip_prefix(&format!("{p}-"))
            {
                name = stripped.to_string();
            }
            volumes.push(VirtualMachineExportVolume {
                name,
                formats: Some(formats),
            });
        }
        let mut manifests = Vec::new();
        if let Some(uri) = envs.get("EXPORT_VM_DEF_URI") {
            manifests.push(VirtualMachineExportManifest {
                type_: "all".into(),
                url: format!("{base}/{manifest_prefix}{uri}"),
            });
        }
        if let Some(uri) = envs.get("EXPORT_SECRET_DEF_URI") {
            manifests.push(VirtualMachineExportManifest {
                type_: "auth-header-secret".into(),
                url: format!("{base}/{manifest_prefix}{uri}"),
            });
        }
        VirtualMachineExportLink {
            cert: cert.to_string(),
            volumes: Some(volumes),
            manifests: (!manifests.is_empty()).then_some(manifests),
        }
    };
    VirtualMachineExportLinks {
        internal: Some(build(&internal_base, "internal", s.internal_cert.trim())),
        external: external_base.map(|b| build(&b, "external", s.external_cert.trim())),
    }
}

/// The external host from an Ingress that routes to the export proxy's Service, as KubeVirt finds
/// its proxy's Ingress: a default backend on the Service (host of the first rule), else the first
/// rule with a path to it. Also returns the TLS Secret listed for that host, if any.
pub fn external_from_ingresses<'a>(
    ingresses: impl IntoIterator<Item = &'a k8s_openapi::api::networking::v1::Ingress>,
    service: &str,
) -> Option<(String, Option<String>)> {
    let mut found: Vec<(String, String, Option<String>)> = Vec::new();
    for ing in ingresses {
        let Some(spec) = &ing.spec else { continue };
        let to_proxy = |b: &k8s_openapi::api::networking::v1::IngressBackend| {
            b.service.as_ref().is_some_and(|s| s.name == service)
        };
        let rules = spec.rules.as_deref().unwrap_or_default();
        let host = if spec.default_backend.as_ref().is_some_and(to_proxy) {
            rules.first().and_then(|r| r.host.clone())
        } else {
            rules
                .iter()
                .find(|r| {
                    r.http
                        .as_ref()
                        .is_some_and(|h| h.paths.iter().any(|p| to_proxy(&p.backend)))
                })
                .and_then(|r| r.host.clone())
        };
        let Some(host) = host.filter(|h| !h.is_empty()) else {
            continue;
        };
        let secret = spec
            .tls
            .iter()
            .flatten()
            .find(|t| t.hosts.as_ref().is_some_and(|hs| hs.contains(&host)))
            .and_then(|t| t.secret_name.clone());
        found.push((ing.metadata.name.clone().unwrap_or_default(), host, secret));
    }
    // Deterministic when several match: the first by name.
    found.sort();
    found.into_iter().next().map(|(_, h, s)| (h, s))
}

/// The CA users should trust for an Ingress TLS Secret: `ca.crt` if present, else the last
/// certificate of the `tls.crt` chain (the one closest to the root; a self-signed certificate is
/// its own).
pub fn ingress_ca(secret: &k8s_openapi::api::core::v1::Secret) -> String {
    let d = secret.data.clone().unwrap_or_default();
    let text = |k: &str| d.get(k).map(|b| String::from_utf8_lossy(&b.0).into_owned());
    if let Some(ca) = text("ca.crt").filter(|c| !c.trim().is_empty()) {
        return ca.trim().to_string();
    }
    let chain = text("tls.crt").unwrap_or_default();
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    match chain.rfind(BEGIN) {
        Some(i) => chain[i..].trim().to_string(),
        None => String::new(),
    }
}

fn volume_name_from_uri(uri: &str) -> Option<String> {
    let rest = uri.strip_prefix("/volumes/")?;
    let (name, _) = rest.split_once('/')?;
    (!name.is_empty()).then(|| name.to_string())
}

// ---- Children ("Children", "Export pod") ----

pub fn owner_reference(export: &VirtualMachineExport) -> OwnerReference {
    OwnerReference {
        api_version: OWNER_API_VERSION.into(),
        kind: KIND.into(),
        name: export.name_any(),
        uid: export.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn app_labels() -> BTreeMap<String, String> {
    BTreeMap::from([(APP_LABEL.to_string(), APP_LABEL_VALUE.to_string())])
}

pub fn build_service(export: &VirtualMachineExport) -> Service {
    let name = export.name_any();
    let mut labels = app_labels();
    labels.extend(export.labels().clone());
    Service {
        metadata: ObjectMeta {
            name: Some(naming::service_name(&name)),
            namespace: export.namespace(),
            labels: Some(labels),
            annotations: (!export.annotations().is_empty()).then(|| export.annotations().clone()),
            owner_references: Some(vec![owner_reference(export)]),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort {
                protocol: Some("TCP".into()),
                port: 443,
                target_port: Some(IntOrString::Int(SERVER_PORT)),
                ..Default::default()
            }]),
            selector: Some(BTreeMap::from([(
                EXPORT_SERVICE_LABEL.to_string(),
                naming::selector_label_value(&name),
            )])),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Why an existing Service of this export's name cannot be used: it is controlled by another
/// object. Upstream's naming maps `.` to `-`, so the exports `a.b` and `a-b` of one namespace
/// share the Service name `virt-export-a-b`; the second one must not advertise links that
/// reach the first one's server.
pub fn service_conflict(existing: &Service, export: &VirtualMachineExport) -> Option<String> {
    let uid = export.uid().unwrap_or_default();
    let owner = existing
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true));
    match owner {
        Some(o) if o.uid == uid => None,
        Some(o) => Some(format!(
            "Service {} already exists and belongs to {} {}; VirtualMachineExport names that differ only in '.' and '-' share a Service name, rename this export",
            existing.name_any(),
            o.kind,
            o.name
        )),
        None => Some(format!(
            "Service {} already exists and is not owned by this VirtualMachineExport; delete it or rename this export",
            existing.name_any()
        )),
    }
}

/// A token of `len` characters from `[0-9A-Za-z]`, uniformly: the OS CSPRNG with rejection
/// sampling (bytes >= 248 are dropped so every symbol has the same probability).
pub fn generate_token(len: usize) -> String {
    use rand::TryRngCore;
    const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut out = String::with_capacity(len);
    let mut buf = [0u8; 64];
    while out.len() < len {
        rand::rngs::OsRng
            .try_fill_bytes(&mut buf)
            .expect("the OS random number generator failed");
        for b in buf {
            if b < 248 && out.len() < len {
                out.push(ALPHABET[usize::from(b % 62)] as char);
            }
        }
    }
    out
}

pub fn build_token_secret(
    export: &VirtualMachineExport,
    name: &str,
    token: &str,
) -> k8s_openapi::api::core::v1::Secret {
    k8s_openapi::api::core::v1::Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: export.namespace(),
            labels: Some(app_labels()),
            owner_references: Some(vec![owner_reference(export)]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            TOKEN_KEY.to_string(),
            k8s_openapi::ByteString(token.as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}

/// Manager settings that shape the export pod ("Settings").
#[derive(Clone, Debug)]
pub struct PodSettings {
    pub image: String,
    pub pull_policy: String,
    pub cpu_request: String,
    pub memory_request: String,
    pub cpu_limit: String,
    pub memory_limit: String,
    pub tls_min_version: Option<String>,
    pub tls_cipher_suites: Option<String>,
    pub cert_duration: Duration,
    pub cert_renew_before: Duration,
}

impl Default for PodSettings {
    fn default() -> Self {
        PodSettings {
            image: format!("ucm:{}", env!("CARGO_PKG_VERSION")),
            pull_policy: "IfNotPresent".into(),
            cpu_request: "100m".into(),
            memory_request: "200Mi".into(),
            cpu_limit: "1".into(),
            memory_limit: "1024Mi".into(),
            tls_min_version: None,
            tls_cipher_suites: None,
            cert_duration: Duration::from_secs(24 * 3600),
            cert_renew_before: Duration::from_secs(24 * 3600 / 5),
        }
    }
}

impl PodSettings {
    /// The `kubevirt.io/export.certParameters` annotation: Go's JSON of `time.Duration` fields,
    /// nanoseconds. A change recreates the pod ("Pass steps", step 7).
    pub fn cert_params(&self) -> String {
        format!(
            "{{\"Duration\":{},\"RenewBefore\":{}}}",
            self.cert_duration.as_nanos(),
            self.cert_renew_before.as_nanos()
        )
    }
}

/// Everything the pod needs from the current pass.
#[derive(Clone, Debug)]
pub struct PodInput<'a> {
    pub export: &'a VirtualMachineExport,
    pub volumes: &'a [ExportVolume],
    pub token_secret: &'a str,
    pub cert_secret: &'a str,
    pub deadline: jiff::Timestamp,
    /// VM and snapshot sources with a manifest ConfigMap.
    pub vm_manifest: bool,
}

pub fn build_pod(input: &PodInput<'_>, s: &PodSettings) -> Pod {
    let export = input.export;
    let name = export.name_any();
    let mut labels = BTreeMap::from([(
        EXPORT_SERVICE_LABEL.to_string(),
        naming::selector_label_value(&name),
    )]);
    labels.extend(export.labels().clone());
    let mut annotations = export.annotations().clone();
    annotations.insert(ANN_CERT_PARAMS.into(), s.cert_params());

    let mut env_vars = vec![EnvVar {
        name: "POD_NAME".into(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: "metadata.name".into(),
                api_version: None,
            }),
            ..Default::default()
        }),
    }];
    let mut volumes = Vec::new();
    let mut mounts = Vec::new();
    let mut devices = Vec::new();
    for (i, v) in input.volumes.iter().enumerate() {
        let podvol = naming::pod_volume_name(i, &v.pvc);
        volumes.push(Volume {
            name: podvol.clone(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: v.pvc.clone(),
                read_only: None,
            }),
            ..Default::default()
        });
        if v.block {
            devices.push(VolumeDevice {
                name: podvol.clone(),
                device_path: format!("{BLOCK_MOUNT_PATH}/{podvol}"),
            });
        } else {
            mounts.push(VolumeMount {
                name: podvol.clone(),
                mount_path: format!("{FS_MOUNT_PATH}/{podvol}"),
                read_only: Some(true),
                ..Default::default()
            });
        }
        env_vars.extend(volume_env(i, v));
    }
    env_vars.extend([
        env("CERT_FILE", "/cert/tls.crt"),
        env("KEY_FILE", "/cert/tls.key"),
        env("TOKEN_FILE", "/token/token"),
        env(
            "DEADLINE",
            jiff::Timestamp::from_second(input.deadline.as_second())
                .unwrap_or(input.deadline)
                .to_string(),
        ),
    ]);
    if input.vm_manifest {
        env_vars.push(env("EXPORT_VM_DEF_URI", MANIFESTS_ALL_PATH));
    }
    env_vars.push(env("EXPORT_SECRET_DEF_URI", MANIFESTS_SECRET_PATH));
    env_vars.push(env("EXPORT_NAME", name.clone()));
    env_vars.push(env("METRICS_ADDR", format!(":{METRICS_PORT}")));
    if let Some(v) = &s.tls_min_version {
        env_vars.push(env("TLS_MIN_VERSION", v.clone()));
    }
    if let Some(v) = &s.tls_cipher_suites {
        env_vars.push(env("TLS_CIPHER_SUITES", v.clone()));
    }

    volumes.push(Volume {
        name: "certificates".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(input.cert_secret.into()),
            ..Default::default()
        }),
        ..Default::default()
    });
    volumes.push(Volume {
        name: "token".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(input.token_secret.into()),
            ..Default::default()
        }),
        ..Default::default()
    });
    mounts.push(VolumeMount {
        name: "certificates".into(),
        mount_path: "/cert".into(),
        read_only: Some(true),
        ..Default::default()
    });
    mounts.push(VolumeMount {
        name: "token".into(),
        mount_path: "/token".into(),
        read_only: Some(true),
        ..Default::default()
    });
    if input.vm_manifest {
        volumes.push(Volume {
            name: "manifest-data".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: naming::manifest_configmap_name(&name),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: "manifest-data".into(),
            mount_path: "/manifest_data".into(),
            read_only: Some(true),
            ..Default::default()
        });
    }

    let q = |v: &str| Quantity(v.to_string());
    let container = Container {
        name: "exporter".into(),
        image: Some(s.image.clone()),
        image_pull_policy: Some(s.pull_policy.clone()),
        command: Some(vec!["ucm".into()]),
        args: Some(vec!["export-server".into()]),
        env: Some(env_vars),
        ports: Some(vec![
            ContainerPort {
                name: Some("export".into()),
                container_port: SERVER_PORT,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            ContainerPort {
                name: Some("metrics".into()),
                container_port: METRICS_PORT,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
        ]),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), q(&s.cpu_request)),
                ("memory".to_string(), q(&s.memory_request)),
            ])),
            limits: Some(BTreeMap::from([
                ("cpu".to_string(), q(&s.cpu_limit)),
                ("memory".to_string(), q(&s.memory_limit)),
            ])),
            ..Default::default()
        }),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some(READINESS_PATH.into()),
                port: IntOrString::Int(SERVER_PORT),
                scheme: Some("HTTPS".into()),
                ..Default::default()
            }),
            initial_delay_seconds: Some(5),
            period_seconds: Some(5),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                add: None,
            }),
            read_only_root_filesystem: Some(true),
            ..Default::default()
        }),
        volume_mounts: Some(mounts),
        volume_devices: (!devices.is_empty()).then_some(devices),
        ..Default::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(naming::pod_name(&name)),
            namespace: export.namespace(),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: Some(vec![owner_reference(export)]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            automount_service_account_token: Some(false),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(KVM_ID),
                run_as_group: Some(KVM_ID),
                fs_group: Some(KVM_ID),
                fs_group_change_policy: Some("OnRootMismatch".into()),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    localhost_profile: None,
                }),
                ..Default::default()
            }),
            containers: vec![container],
            volumes: Some(volumes),
            ..Default::default()
        }),
        status: None,
    }
}

/// `DEADLINE = min(cert notAfter - renewBefore, ttlExpirationTime)` ("Certificates", rule 4).
pub fn deadline(
    cert_not_after: jiff::Timestamp,
    renew_before: Duration,
    ttl_expiry: jiff::Timestamp,
) -> jiff::Timestamp {
    let renew = jiff::SignedDuration::try_from(renew_before).unwrap_or(jiff::SignedDuration::ZERO);
    let cert_deadline = cert_not_after
        .checked_sub(renew)
        .unwrap_or(jiff::Timestamp::MIN);
    cert_deadline.min(ttl_expiry)
}

/// The initial status of a new export ("Pass steps", step 2).
pub fn initial_status(ttl_expiry: jiff::Timestamp, now: &Time) -> VirtualMachineExportStatus {
    let mut conds = Vec::new();
    crate::conditions::set_kubevirt_condition(
        &mut conds,
        condition(COND_READY, false, REASON_INITIALIZING, ""),
        now,
    );
    VirtualMachineExportStatus {
        phase: Some(PHASE_PENDING.into()),
        conditions: Some(conds),
        ttl_expiration_time: Some(Time(ttl_expiry)),
        ..Default::default()
    }
}

#[cfg(test)]
#[path = "build_tests.rs"]
mod tests;

// ---- Manifest ConfigMap ("Export server"), VM and snapshot sources ----

/// What the manifest ConfigMap is built from.
pub struct ManifestInput<'a> {
    pub export: &'a VirtualMachineExport,
    /// The VirtualMachine object (for snapshot sources, the copy in the snapshot content).
    pub vm: &'a serde_json::Value,
    /// Claim name → the source claim's spec, for DataVolumes of non-template volumes.
    pub claims: &'a BTreeMap<String, k8s_openapi::api::core::v1::PersistentVolumeClaimSpec>,
    pub internal_cert: &'a str,
    pub external_host: Option<&'a str>,
    pub external_cert: &'a str,
    /// Snapshot sources serve restore PVCs `<export>-<claim>`.
    pub volume_prefix: Option<String>,
}

/// A DataVolume's `spec.storage` for a copy of `claim`, as KubeVirt builds it: access modes,
/// volume mode and the requested size of the source, so a block claim imports as block.
pub fn dv_storage(
    claim: &k8s_openapi::api::core::v1::PersistentVolumeClaimSpec,
) -> serde_json::Value {
    let mut st = serde_json::Map::new();
    if let Some(m) = claim.access_modes.as_ref().filter(|m| !m.is_empty()) {
        st.insert("accessModes".into(), serde_json::json!(m));
    }
    if let Some(m) = &claim.volume_mode {
        st.insert("volumeMode".into(), serde_json::json!(m));
    }
    if let Some(q) = claim
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
    {
        st.insert(
            "resources".into(),
            serde_json::json!({"requests": {"storage": q.0}}),
        );
    }
    serde_json::Value::Object(st)
}

/// KubeVirt's API that expands instancetypes and preferences into a VM spec ("Optional APIs").
pub const EXPAND_API: &str = "subresources.kubevirt.io/v1";

/// Whether the VM references an instancetype or a preference, which only KubeVirt can expand
/// into the `all` manifest ("Optional APIs").
pub fn needs_expansion(vm: &serde_json::Value) -> bool {
    ["instancetype", "preference"]
        .iter()
        .any(|k| vm["spec"].get(*k).is_some_and(|v| !v.is_null()))
}

/// The expand-spec call for a source's VM ("Optional APIs"). A live VM is expanded by name with
/// `GET virtualmachines/<name>/expand-spec`. A snapshot's VM is the copy in the snapshot
/// content, which the live VM may no longer match (or no longer exist), so that copy is sent to
/// `PUT expand-vm-spec`, KubeVirt's endpoint for expanding a VM given in the body.
pub fn expand_request(
    ns: &str,
    kind: SourceKind,
    vm_name: &str,
    vm: &serde_json::Value,
) -> Result<http::Request<Vec<u8>>, String> {
    let base = format!("/apis/{EXPAND_API}/namespaces/{ns}");
    let req = match kind {
        SourceKind::VirtualMachine => {
            http::Request::get(format!("{base}/virtualmachines/{vm_name}/expand-spec"))
                .body(Vec::new())
        }
        _ => {
            let mut body = vm.clone();
            body["apiVersion"] = "kubevirt.io/v1".into();
            body["kind"] = "VirtualMachine".into();
            if body["metadata"]["name"].is_null() {
                body["metadata"]["name"] = vm_name.into();
            }
            body["metadata"]["namespace"] = ns.into();
            http::Request::put(format!("{base}/expand-vm-spec"))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(body.to_string().into_bytes())
        }
    };
    req.map_err(|e| format!("cannot build the expand-spec request: {e}"))
}

/// The ConfigMap mounted at /manifest_data, from a VM whose instancetypes and preferences are
/// already expanded. `Err` names why the `all` manifest cannot be built.
pub fn build_manifest_configmap(
    m: &ManifestInput<'_>,
) -> Result<k8s_openapi::api::core::v1::ConfigMap, String> {
    use serde_json::{Value, json};
    let export = m.export;
    let name = export.name_any();
    let ns = export.namespace().unwrap_or_default();
    if needs_expansion(m.vm) {
        return Err(format!(
            "the VirtualMachine still references an instancetype or preference after {EXPAND_API} expand-spec; the all manifest is not offered"
        ));
    }
    let meta = &m.vm["metadata"];
    let mut clean_meta = serde_json::Map::new();
    for k in ["name", "namespace", "labels", "annotations"] {
        if let Some(v) = meta.get(k) {
            clean_meta.insert(k.into(), v.clone());
        }
    }
    let vm = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": Value::Object(clean_meta),
        "spec": m.vm["spec"].clone(),
    });
    let templates: Vec<String> = m.vm["spec"]["dataVolumeTemplates"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t["metadata"]["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let service = naming::service_name(&name);
    let mut data = BTreeMap::from([
        (
            "internal_host".to_string(),
            format!("https://{service}.{ns}.svc"),
        ),
        (
            "internal_ca_cm".to_string(),
            m.internal_cert.trim().to_string(),
        ),
        ("virtualmachine-manifest".to_string(), vm.to_string()),
        ("export-name".to_string(), name.clone()),
    ]);
    if let Some(h) = m.external_host {
        data.insert(
            "external_host".into(),
            format!(
                "https://{h}/api/{OWNER_API_VERSION}/namespaces/{ns}/virtualmachineexports/{name}"
            ),
        );
        data.insert("external_ca_cm".into(), m.external_cert.trim().to_string());
    }
    if let Some(p) = &m.volume_prefix {
        data.insert("volume-prefix".into(), p.clone());
    }
    for v in m.vm["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let claim = v["dataVolume"]["name"]
            .as_str()
            .or_else(|| v["persistentVolumeClaim"]["claimName"].as_str());
        let Some(claim) = claim else { continue };
        if templates.iter().any(|t| t == claim) {
            continue;
        }
        let storage = m
            .claims
            .get(claim)
            .map(dv_storage)
            .unwrap_or_else(|| json!({}));
        let dv = json!({
            "apiVersion": "cdi.kubevirt.io/v1beta1",
            "kind": "DataVolume",
            "metadata": {"name": claim, "namespace": ns},
            "spec": {"storage": storage},
        });
        data.insert(format!("dv-{claim}"), dv.to_string());
    }
    Ok(k8s_openapi::api::core::v1::ConfigMap {
        metadata: ObjectMeta {
            name: Some(naming::manifest_configmap_name(&name)),
            namespace: export.namespace(),
            owner_references: Some(vec![owner_reference(export)]),
            ..Default::default()
        },
        data: Some(data),
        ..Default::default()
    })
}

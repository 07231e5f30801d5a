//! IO side of the VirtualMachineExport reconciler (vmexport.md §6): read the source and the
//! children, create what is missing, write the status once at the end of every pass (also when
//! a create failed, #19020), and requeue exactly at the TTL expiry.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolumeClaim, Pod, Secret, Service};
use kube::api::{DeleteParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use prometheus::{IntCounter, IntGaugeVec, Opts};

use super::build::*;
use super::certs::{self, Pem};
use super::naming;
use super::optional::{self, Kind, Optional};
use super::types::{VirtualMachineExport, VirtualMachineExportStatus};
use crate::runtime::controller::{self as rtc, Guarded};
use crate::runtime::{ReconcileError, Runtime, Trigger, WriteError, Writer};

pub const CONTROLLER: &str = "vmexport";
/// OURS: the error backoff cap is lower than the runtime default (§6.1).
const BACKOFF_CAP: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Write(#[from] WriteError),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("export CA: {0}")]
    Ca(String),
}

impl ReconcileError for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::Write(e) => e.metric_label(),
            Error::Kube(_) => "kube",
            Error::Ca(_) => "ca",
        }
    }
    fn is_conflict(&self) -> bool {
        match self {
            Error::Write(e) => e.is_conflict(),
            Error::Kube(kube::Error::Api(s)) => s.code == 409,
            _ => false,
        }
    }
}

/// Settings resolved at start (§5).
#[derive(Clone, Debug)]
pub struct Config {
    pub pod: PodSettings,
    pub ca_secret: String,
    pub manager_namespace: String,
    pub external_host: Option<String>,
    pub external_ca: String,
}

pub struct Context {
    pub writer: Writer,
    pub cfg: Config,
    pub pods: Store<Pod>,
    pub pvcs: Store<PersistentVolumeClaim>,
    pub optional: Arc<Optional>,
    ca: tokio::sync::Mutex<Option<Pem>>,
    pub ttl_deletions: IntCounter,
    failures: Mutex<BTreeMap<String, u32>>,
}

fn is_already_exists(e: &WriteError) -> bool {
    matches!(e, WriteError::Kube(kube::Error::Api(s)) if s.code == 409 && s.reason == "AlreadyExists")
}

fn object_ref(e: &VirtualMachineExport) -> ObjectReference {
    e.object_ref(&())
}

impl Context {
    fn client(&self) -> kube::Client {
        self.writer.client().clone()
    }

    /// The CA: read; on NotFound create; on AlreadyExists (another leader won) read again.
    /// An existing CA is never overwritten (§7.4.1).
    async fn ca(&self) -> Result<Pem, Error> {
        let mut guard = self.ca.lock().await;
        if let Some(p) = guard.as_ref() {
            return Ok(p.clone());
        }
        let api: Api<Secret> = Api::namespaced(self.client(), &self.cfg.manager_namespace);
        let read = |s: &Secret| -> Result<Pem, Error> {
            let d = s.data.clone().unwrap_or_default();
            let get = |k: &str| {
                d.get(k)
                    .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                    .ok_or_else(|| Error::Ca(format!("Secret {} has no {k}", self.cfg.ca_secret)))
            };
            Ok(Pem {
                cert: get("tls.crt")?,
                key: get("tls.key")?,
            })
        };
        let pem = match api.get_opt(&self.cfg.ca_secret).await? {
            Some(s) => read(&s)?,
            None => {
                let ca =
                    certs::new_ca(jiff::Timestamp::now()).map_err(|e| Error::Ca(e.to_string()))?;
                let secret = Secret {
                    metadata: kube::api::ObjectMeta {
                        name: Some(self.cfg.ca_secret.clone()),
                        namespace: Some(self.cfg.manager_namespace.clone()),
                        ..Default::default()
                    },
                    type_: Some("kubernetes.io/tls".into()),
                    data: Some(BTreeMap::from([
                        (
                            "tls.crt".to_string(),
                            k8s_openapi::ByteString(ca.cert.clone().into_bytes()),
                        ),
                        (
                            "tls.key".to_string(),
                            k8s_openapi::ByteString(ca.key.clone().into_bytes()),
                        ),
                    ])),
                    ..Default::default()
                };
                match self.writer.create(&api, &secret).await {
                    Ok(_) => ca,
                    Err(e) if is_already_exists(&e) => read(&api.get(&self.cfg.ca_secret).await?)?,
                    Err(e) => return Err(e.into()),
                }
            }
        };
        // Validate once so an unusable CA is reported, not used.
        certs::issue_serving(
            &pem,
            "probe",
            "probe",
            jiff::Timestamp::now(),
            Duration::from_secs(60),
        )
        .map_err(|e| {
            Error::Ca(format!(
                "Secret {} does not hold a usable CA: {e}",
                self.cfg.ca_secret
            ))
        })?;
        *guard = Some(pem.clone());
        Ok(pem)
    }
}

fn store_ready<K: kube::runtime::reflector::Lookup + Clone + 'static>(store: &Store<K>) -> bool
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    use futures::FutureExt;
    matches!(store.wait_until_ready().now_or_never(), Some(Ok(())))
}

/// What the source resolution found (§9.2).
struct Source {
    volumes: Vec<ExportVolume>,
    available: bool,
    /// Ready condition while there is no pod.
    ready: Condition,
    phase_without_pod: &'static str,
    extra: Option<Condition>,
    pause_message: String,
}

use super::types::Condition;

/// The owning DataVolume's `(phase, contentType)` when the DataVolume API is watched.
fn dv_info(ctx: &Context, pvc: &PersistentVolumeClaim) -> (Option<String>, Option<String>) {
    let (Some(dv), Some(store)) = (owning_datavolume(pvc), ctx.optional.store(Kind::DataVolume))
    else {
        return (None, None);
    };
    let ns = pvc.namespace().unwrap_or_default();
    match store.get(&ObjectRef::new_with(dv, Kind::DataVolume.resource()).within(&ns)) {
        None => (Some(String::new()), None),
        Some(o) => (
            Some(
                o.data["status"]["phase"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            ),
            o.data["spec"]["contentType"].as_str().map(str::to_string),
        ),
    }
}

fn in_use_by_pod(ctx: &Context, ns: &str, claim: &str, export_uid: &str) -> bool {
    let pods = ctx.pods.state();
    let local: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.namespace().as_deref() == Some(ns))
        .map(|p| p.as_ref())
        .collect();
    pvc_in_use(local, claim, export_uid).is_some()
}

/// VM source (§9.2): the claims of its volumes and its backend-storage PVC, blocked while a
/// VMI of the same name is not finished.
fn resolve_vm(ctx: &Context, export: &VirtualMachineExport) -> Source {
    let ns = export.namespace().unwrap_or_default();
    let name = export.spec.source.name.clone();
    let Some(vms) = ctx.optional.store(Kind::VirtualMachine) else {
        return unavailable(
            PHASE_PENDING,
            REASON_SOURCE_API_NOT_INSTALLED,
            format!(
                "the {} API is not installed; the export proceeds once it is",
                Kind::VirtualMachine.gvk()
            ),
        );
    };
    let Some(vm) =
        vms.get(&ObjectRef::new_with(&name, Kind::VirtualMachine.resource()).within(&ns))
    else {
        return unavailable(
            PHASE_SKIPPED,
            REASON_VM_NOT_FOUND,
            format!("Virtual Machine {ns}/{name} not found"),
        );
    };
    let mut claims: Vec<(String, bool)> = Vec::new(); // (claim, forced archive content)
    let mut ignored: Vec<String> = Vec::new();
    let empty = Vec::new();
    let vols = vm.data["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap_or(&empty);
    for v in vols {
        let vname = v["name"].as_str().unwrap_or_default().to_string();
        if let Some(c) = v["dataVolume"]["name"].as_str() {
            claims.push((c.to_string(), false));
        } else if let Some(c) = v["persistentVolumeClaim"]["claimName"].as_str() {
            claims.push((c.to_string(), false));
        } else if let Some(c) = v["memoryDump"]["claimName"].as_str() {
            claims.push((c.to_string(), true));
        } else {
            ignored.push(vname);
        }
    }
    // The backend-storage PVC (TPM/EFI state) is archive content.
    for p in ctx.pvcs.state() {
        if p.namespace().as_deref() == Some(ns.as_str())
            && p.labels().get("persistent-state-for").map(String::as_str) == Some(name.as_str())
        {
            claims.push((p.name_any(), true));
        }
    }
    if claims.is_empty() {
        let msg = if ignored.is_empty() {
            format!("Virtual Machine {ns}/{name} has no volumes to export")
        } else {
            format!(
                "Virtual Machine {ns}/{name} has no volumes to export; ignored volumes of other types: {}",
                ignored.join(", ")
            )
        };
        return unavailable(PHASE_SKIPPED, REASON_VM_NO_VOLUMES, msg);
    }
    let mut volumes = Vec::new();
    let mut populated = true;
    for (claim, archive) in &claims {
        match ctx.pvcs.get(&ObjectRef::new(claim).within(&ns)) {
            None => populated = false,
            Some(pvc) => {
                let (phase, ct) = dv_info(ctx, &pvc);
                if !is_populated(&pvc, phase.as_deref()) {
                    populated = false;
                }
                let mut v = ExportVolume::from_pvc(&pvc, ct.as_deref());
                if *archive {
                    v.kubevirt_content = false;
                }
                volumes.push(v);
            }
        }
    }
    let volumes = dedup_volumes(volumes);
    if !populated {
        let msg = format!("Not all volumes in the Virtual Machine {ns}/{name} are populated");
        return Source {
            volumes,
            available: false,
            ready: condition(COND_READY, false, REASON_VOLUMES_NOT_POPULATED, msg.clone()),
            phase_without_pod: PHASE_PENDING,
            extra: None,
            pause_message: msg,
        };
    }
    if let Some(vmis) = ctx.optional.store(Kind::VirtualMachineInstance)
        && let Some(vmi) = vmis
            .get(&ObjectRef::new_with(&name, Kind::VirtualMachineInstance.resource()).within(&ns))
        && !matches!(
            vmi.data["status"]["phase"].as_str(),
            Some("Succeeded") | Some("Failed")
        )
    {
        let msg = format!("Virtual Machine {ns}/{name} is running");
        return Source {
            volumes,
            available: false,
            ready: condition(COND_READY, false, REASON_IN_USE, msg.clone()),
            phase_without_pod: PHASE_PENDING,
            extra: None,
            pause_message: msg,
        };
    }
    Source {
        volumes,
        available: true,
        ready: condition(COND_READY, false, REASON_INITIALIZING, ""),
        phase_without_pod: PHASE_PENDING,
        extra: None,
        pause_message: String::new(),
    }
}

/// The VM whose manifest the `all` endpoint serves: the source VM, or the snapshot's copy.
fn source_vm(
    ctx: &Context,
    export: &VirtualMachineExport,
    kind: SourceKind,
) -> Option<serde_json::Value> {
    let ns = export.namespace().unwrap_or_default();
    let name = &export.spec.source.name;
    match kind {
        SourceKind::VirtualMachine => {
            let vm = get_dyn(ctx, Kind::VirtualMachine, &ns, name)??;
            serde_json::to_value(&*vm).ok()
        }
        SourceKind::VirtualMachineSnapshot => {
            let snap = get_dyn(ctx, Kind::VirtualMachineSnapshot, &ns, name)??;
            let content_name = snap.data["status"]["virtualMachineSnapshotContentName"].as_str()?;
            let content = get_dyn(ctx, Kind::VirtualMachineSnapshotContent, &ns, content_name)??;
            Some(content.data["spec"]["source"]["virtualMachine"].clone())
        }
        _ => None,
    }
}

/// Creates or updates the manifest ConfigMap; `Ok(false)` when the `all` manifest cannot be
/// offered (Warning event `ManifestFailed`; the pod then has no EXPORT_VM_DEF_URI).
async fn ensure_manifest(
    ctx: &Context,
    export: &VirtualMachineExport,
    kind: SourceKind,
    volumes: &[ExportVolume],
) -> Result<bool, String> {
    let ns = export.namespace().unwrap_or_default();
    let Some(vm) = source_vm(ctx, export, kind) else {
        return Ok(false);
    };
    let mut sizes = BTreeMap::new();
    for v in volumes {
        if let Some(p) = ctx.pvcs.get(&ObjectRef::new(&v.pvc).within(&ns))
            && let Some(q) = p
                .spec
                .as_ref()
                .and_then(|s| s.resources.as_ref())
                .and_then(|r| r.requests.as_ref())
                .and_then(|r| r.get("storage"))
        {
            let claim = match kind {
                SourceKind::VirtualMachineSnapshot => v
                    .pvc
                    .strip_prefix(&format!("{}-", export.name_any()))
                    .unwrap_or(&v.pvc)
                    .to_string(),
                _ => v.pvc.clone(),
            };
            sizes.insert(claim, q.0.clone());
        }
    }
    let ca = ctx.ca().await.map_err(|e| e.to_string())?;
    let input = ManifestInput {
        export,
        vm: &vm,
        sizes: &sizes,
        internal_cert: &ca.cert,
        external_host: ctx.cfg.external_host.as_deref(),
        external_cert: &ctx.cfg.external_ca,
        volume_prefix: (kind == SourceKind::VirtualMachineSnapshot)
            .then(|| format!("{}-", export.name_any())),
    };
    let desired = match build_manifest_configmap(&input) {
        Ok(cm) => cm,
        Err(msg) => {
            ctx.writer
                .event(
                    &object_ref(export),
                    EventType::Warning,
                    "ManifestFailed",
                    "Create",
                    msg,
                )
                .await;
            return Ok(false);
        }
    };
    let api: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(ctx.client(), &ns);
    let name = desired.name_any();
    let existing = api
        .get_opt(&name)
        .await
        .map_err(|e| format!("ConfigMap {name}: {e}"))?;
    if existing.as_ref().and_then(|c| c.data.as_ref()) != desired.data.as_ref() {
        ctx.writer
            .apply(&api, &desired)
            .await
            .map_err(|e| format!("ConfigMap {name}: {e}"))?;
        if existing.is_none() {
            ctx.writer
                .event(
                    &object_ref(export),
                    EventType::Normal,
                    "DataManifestCreated",
                    "Create",
                    format!("Created exporter data manifest {ns}/{name}"),
                )
                .await;
        }
    }
    Ok(true)
}

fn get_dyn(
    ctx: &Context,
    k: Kind,
    ns: &str,
    name: &str,
) -> Option<Option<Arc<kube::api::DynamicObject>>> {
    let (store, ar) = ctx.optional.store_with_resource(k)?;
    Some(store.get(&ObjectRef::new_with(name, ar).within(ns)))
}

/// The restore PVC of one volume backup (§9.5).
fn restore_pvc(
    export: &VirtualMachineExport,
    backup: &serde_json::Value,
    vm_volumes: &[serde_json::Value],
    restore_size: Option<&str>,
) -> Option<PersistentVolumeClaim> {
    let src = &backup["persistentVolumeClaim"];
    let orig = src["metadata"]["name"].as_str()?;
    let snap = backup["volumeSnapshotName"].as_str()?;
    let mut spec = src["spec"].clone();
    let spec_obj = spec.as_object_mut()?;
    spec_obj.retain(|k, _| {
        matches!(
            k.as_str(),
            "accessModes" | "resources" | "storageClassName" | "volumeMode"
        )
    });
    let source = serde_json::json!({"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": snap});
    spec_obj.insert("dataSource".into(), source.clone());
    spec_obj.insert("dataSourceRef".into(), source);
    // The larger of the request and the snapshot's restore size.
    if let Some(rs) = restore_size {
        let req = spec["resources"]["requests"]["storage"]
            .as_str()
            .map(str::to_string);
        let bigger = match req {
            Some(r) if quantity_bytes(&r) >= quantity_bytes(rs) => r,
            _ => rs.to_string(),
        };
        spec["resources"]["requests"]["storage"] = serde_json::json!(bigger);
    }
    // Restore bookkeeping annotations are dropped; the content type is kept, and set to
    // kubevirt for disks of the VM.
    let mut ann: BTreeMap<String, String> =
        serde_json::from_value(src["metadata"]["annotations"].clone()).unwrap_or_default();
    ann.retain(|k, _| {
        k == ANN_CONTENT_TYPE
            || !(k.contains("restore")
                || k.starts_with("pv.kubernetes.io/")
                || k.starts_with("volume."))
    });
    let vol_name = backup["volumeName"].as_str().unwrap_or_default();
    if vm_volumes.iter().any(|v| {
        v["name"].as_str() == Some(vol_name)
            && (v.get("dataVolume").is_some() || v.get("persistentVolumeClaim").is_some())
    }) {
        ann.insert(ANN_CONTENT_TYPE.into(), "kubevirt".into());
    }
    let labels: BTreeMap<String, String> =
        serde_json::from_value(src["metadata"]["labels"].clone()).unwrap_or_default();
    Some(PersistentVolumeClaim {
        metadata: kube::api::ObjectMeta {
            name: Some(naming::restore_pvc_name(&export.name_any(), orig)),
            namespace: export.namespace(),
            labels: (!labels.is_empty()).then_some(labels),
            annotations: (!ann.is_empty()).then_some(ann),
            owner_references: Some(vec![owner_reference(export)]),
            ..Default::default()
        },
        spec: serde_json::from_value(spec).ok(),
        status: None,
    })
}

/// Bytes of a quantity like `1Gi`, `500M` or `1073741824` (for comparisons only).
fn quantity_bytes(q: &str) -> f64 {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let n: f64 = q[..split].parse().unwrap_or(0.0);
    let mult = match &q[split..] {
        "Ki" => 1024f64,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        _ => 1.0,
    };
    n * mult
}

/// VirtualMachineSnapshot source (§9.2, §9.5): restore PVCs `<export>-<pvc>` from the
/// snapshot content, created once and never re-created.
async fn resolve_snapshot(
    ctx: &Context,
    export: &VirtualMachineExport,
) -> (Source, Option<String>) {
    let ns = export.namespace().unwrap_or_default();
    let name = export.spec.source.name.clone();
    let missing_api = |k: Kind| {
        unavailable(
            PHASE_PENDING,
            REASON_SOURCE_API_NOT_INSTALLED,
            format!(
                "the {} API is not installed; the export proceeds once it is",
                k.gvk()
            ),
        )
    };
    for k in [
        Kind::VirtualMachineSnapshot,
        Kind::VirtualMachineSnapshotContent,
        Kind::VolumeSnapshot,
    ] {
        if ctx.optional.store(k).is_none() {
            return (missing_api(k), None);
        }
    }
    let volumes_created =
        |ok: bool, reason: &str| Some(condition(COND_VOLUMES_CREATED, ok, reason, ""));
    let Some(Some(snap)) = get_dyn(ctx, Kind::VirtualMachineSnapshot, &ns, &name) else {
        let mut s = unavailable(
            PHASE_SKIPPED,
            REASON_VMSNAPSHOT_NOT_FOUND,
            format!("VirtualMachineSnapshot {ns}/{name} not found"),
        );
        s.extra = volumes_created(false, REASON_VMSNAPSHOT_NO_VOLUMES);
        return (s, None);
    };
    let vm_name = snap.data["spec"]["source"]["name"]
        .as_str()
        .map(str::to_string);
    let not_created = |msg: String| {
        let mut s = unavailable(PHASE_PENDING, REASON_NOT_ALL_PVCS_CREATED, msg);
        s.extra = volumes_created(false, REASON_NOT_ALL_PVCS_CREATED);
        s
    };
    if snap.data["status"]["readyToUse"].as_bool() != Some(true) {
        return (
            not_created(format!(
                "VirtualMachineSnapshot {ns}/{name} is not ready to use"
            )),
            vm_name,
        );
    }
    let content_name = snap.data["status"]["virtualMachineSnapshotContentName"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let Some(Some(content)) = get_dyn(ctx, Kind::VirtualMachineSnapshotContent, &ns, &content_name)
    else {
        return (
            not_created(format!(
                "VirtualMachineSnapshotContent {ns}/{content_name} not found"
            )),
            vm_name,
        );
    };
    let empty = Vec::new();
    let backups = content.data["spec"]["volumeBackups"]
        .as_array()
        .unwrap_or(&empty);
    if backups.is_empty() {
        let mut s = unavailable(
            PHASE_SKIPPED,
            REASON_VMSNAPSHOT_NO_VOLUMES,
            format!("VirtualMachineSnapshot {ns}/{name} has no volumes"),
        );
        s.extra = volumes_created(false, REASON_VMSNAPSHOT_NO_VOLUMES);
        return (s, vm_name);
    }
    let vm_volumes =
        content.data["spec"]["source"]["virtualMachine"]["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client(), &ns);
    let mut volumes = Vec::new();
    let mut all_bound = true;
    for b in backups {
        let restore_size = b["volumeSnapshotName"].as_str().and_then(|vs| {
            get_dyn(ctx, Kind::VolumeSnapshot, &ns, vs)
                .flatten()
                .and_then(|o| o.data["status"]["restoreSize"].as_str().map(str::to_string))
        });
        let Some(desired) = restore_pvc(export, b, &vm_volumes, restore_size.as_deref()) else {
            continue;
        };
        let pname = desired.name_any();
        let existing = match ctx.pvcs.get(&ObjectRef::new(&pname).within(&ns)) {
            Some(p) => Some((*p).clone()),
            None => match pvcs.get_opt(&pname).await {
                Ok(p) => p,
                Err(e) => {
                    return (
                        not_created(format!("PersistentVolumeClaim {pname}: {e}")),
                        vm_name,
                    );
                }
            },
        };
        let pvc = match existing {
            Some(p) => p,
            None => match ctx.writer.create(&pvcs, &desired).await {
                Ok(p) => p,
                Err(e) if is_already_exists(&e) => desired,
                Err(e) => {
                    let mut s = unavailable(
                        PHASE_PENDING,
                        REASON_OBJECT_CREATION_FAILED,
                        format!("PersistentVolumeClaim {pname}: {e}"),
                    );
                    s.extra = volumes_created(false, REASON_NOT_ALL_PVCS_CREATED);
                    return (s, vm_name);
                }
            },
        };
        if pvc_phase(&pvc) != "Bound" {
            all_bound = false;
        }
        volumes.push(ExportVolume::from_pvc(&pvc, None));
    }
    let expected = content.data["status"]["volumeSnapshotStatus"]
        .as_array()
        .map(Vec::len);
    let extra = if expected.is_some_and(|n| n != volumes.len()) {
        volumes_created(false, REASON_NOT_ALL_PVCS_CREATED)
    } else if all_bound {
        volumes_created(true, REASON_ALL_PVCS_READY)
    } else {
        volumes_created(false, REASON_NOT_ALL_PVCS_READY)
    };
    (
        Source {
            volumes: dedup_volumes(volumes),
            available: true,
            ready: condition(COND_READY, false, REASON_INITIALIZING, ""),
            phase_without_pod: PHASE_PENDING,
            extra,
            pause_message: String::new(),
        },
        vm_name,
    )
}

fn resolve_pvc(ctx: &Context, export: &VirtualMachineExport) -> Source {
    let ns = export.namespace().unwrap_or_default();
    let name = export.spec.source.name.clone();
    let pvc = ctx.pvcs.get(&ObjectRef::new(&name).within(&ns));
    let extra = Some(pvc_condition(&ns, &name, pvc.as_deref()));
    let Some(pvc) = pvc else {
        return Source {
            volumes: vec![],
            available: false,
            ready: condition(COND_READY, false, REASON_INITIALIZING, ""),
            phase_without_pod: PHASE_PENDING,
            extra,
            pause_message: format!("PersistentVolumeClaim {ns}/{name} not found"),
        };
    };
    // Without the DataVolume API a DV-owned claim counts as populated (§4).
    let (dv_phase, dv_content) = dv_info(ctx, &pvc);
    let volumes = vec![ExportVolume::from_pvc(&pvc, dv_content.as_deref())];
    let uid = export.uid().unwrap_or_default();
    if !is_populated(&pvc, dv_phase.as_deref()) {
        return Source {
            volumes,
            available: false,
            ready: condition(COND_READY, false, REASON_PVC_PENDING, ""),
            phase_without_pod: PHASE_PENDING,
            extra,
            pause_message: format!("PersistentVolumeClaim {ns}/{name} is not populated"),
        };
    }
    if in_use_by_pod(ctx, &ns, &name, &uid) {
        let msg = format!("PersistentVolumeClaim {ns}/{name} is in use");
        return Source {
            volumes,
            available: false,
            ready: condition(COND_READY, false, REASON_IN_USE, msg.clone()),
            phase_without_pod: PHASE_PENDING,
            extra,
            pause_message: msg,
        };
    }
    Source {
        volumes,
        available: true,
        ready: condition(COND_READY, false, REASON_INITIALIZING, ""),
        phase_without_pod: PHASE_PENDING,
        extra,
        pause_message: String::new(),
    }
}

fn unavailable(phase: &'static str, reason: &str, msg: String) -> Source {
    Source {
        volumes: vec![],
        available: false,
        ready: condition(COND_READY, false, reason, msg.clone()),
        phase_without_pod: phase,
        extra: None,
        pause_message: msg,
    }
}

async fn ensure_service(
    ctx: &Context,
    export: &VirtualMachineExport,
    api: &Api<Service>,
) -> Result<(), String> {
    let svc = build_service(export);
    let name = svc.name_any();
    match api.get_opt(&name).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => match ctx.writer.create(api, &svc).await {
            Ok(_) => {
                ctx.writer
                    .event(
                        &object_ref(export),
                        EventType::Normal,
                        "ServiceCreated",
                        "Create",
                        format!(
                            "Created service {}/{name}",
                            export.namespace().unwrap_or_default()
                        ),
                    )
                    .await;
                Ok(())
            }
            Err(e) if is_already_exists(&e) => Ok(()),
            Err(e) => Err(format!("Service {name}: {e}")),
        },
        Err(e) => Err(format!("Service {name}: {e}")),
    }
}

/// Creates the token Secret if missing; a deleted one is recreated with a new token (§7.3).
async fn ensure_token(
    ctx: &Context,
    export: &VirtualMachineExport,
    name: &str,
) -> Result<(), String> {
    let api: Api<Secret> = Api::namespaced(ctx.client(), &export.namespace().unwrap_or_default());
    match api.get_opt(name).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => {
            let s = build_token_secret(export, name, &generate_token(TOKEN_LENGTH));
            match ctx.writer.create(&api, &s).await {
                Ok(_) => {
                    ctx.writer
                        .event(
                            &object_ref(export),
                            EventType::Normal,
                            "SecretCreated",
                            "Create",
                            format!(
                                "Created default secret {}/{name}",
                                export.namespace().unwrap_or_default()
                            ),
                        )
                        .await;
                    Ok(())
                }
                Err(e) if is_already_exists(&e) => Ok(()),
                Err(e) => Err(format!("Secret {name}: {e}")),
            }
        }
        Err(e) => Err(format!("Secret {name}: {e}")),
    }
}

/// Ensures a valid serving certificate; returns its notAfter (§7.4.3).
async fn ensure_cert(
    ctx: &Context,
    export: &VirtualMachineExport,
    ca: &Pem,
) -> Result<jiff::Timestamp, String> {
    let ns = export.namespace().unwrap_or_default();
    let svc = naming::service_name(&export.name_any());
    let name = naming::cert_secret_name(&export.name_any());
    let api: Api<Secret> = Api::namespaced(ctx.client(), &ns);
    let now = jiff::Timestamp::now();
    let existing = api
        .get_opt(&name)
        .await
        .map_err(|e| format!("Secret {name}: {e}"))?;
    if let Some(s) = &existing {
        let crt = s
            .data
            .as_ref()
            .and_then(|d| d.get("tls.crt"))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned());
        if let Some(crt) = crt
            && let Ok(info) = certs::inspect(&crt, &ca.cert)
            && !certs::needs_reissue(&info, &svc, &ns, now, ctx.cfg.pod.cert_renew_before)
        {
            return Ok(info.not_after);
        }
    }
    let pem = certs::issue_serving(ca, &svc, &ns, now, ctx.cfg.pod.cert_duration)
        .map_err(|e| format!("Secret {name}: {e}"))?;
    let not_after = certs::inspect(&pem.cert, &ca.cert)
        .map_err(|e| format!("Secret {name}: {e}"))?
        .not_after;
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(ns.clone()),
            labels: Some(BTreeMap::from([(
                APP_LABEL.to_string(),
                APP_LABEL_VALUE.to_string(),
            )])),
            owner_references: Some(vec![owner_reference(export)]),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            (
                "tls.crt".to_string(),
                k8s_openapi::ByteString(pem.cert.into_bytes()),
            ),
            (
                "tls.key".to_string(),
                k8s_openapi::ByteString(pem.key.into_bytes()),
            ),
            (
                "ca.crt".to_string(),
                k8s_openapi::ByteString(ca.cert.clone().into_bytes()),
            ),
        ])),
        ..Default::default()
    };
    // Reissued in place: apply replaces the data of our own Secret.
    ctx.writer
        .apply(&api, &secret)
        .await
        .map_err(|e| format!("Secret {name}: {e}"))?;
    Ok(not_after)
}

pub async fn reconcile(
    export: Arc<VirtualMachineExport>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    if export.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    // Decisions need the pod and claim caches: before their initial list an empty cache would
    // read as "claim not found" and pause a running export.
    if !store_ready(&ctx.pods) || !store_ready(&ctx.pvcs) {
        return Ok(Action::requeue(Duration::from_millis(200)));
    }
    let ns = export.namespace().unwrap_or_default();
    let name = export.name_any();
    let now_ts = jiff::Timestamp::now();
    let now = crate::conditions::truncate(now_ts);
    let exports: Api<VirtualMachineExport> = Api::namespaced(ctx.client(), &ns);
    let oref = object_ref(&export);

    // Step 2: initialise.
    let old_status = export.status.clone();
    let mut status = match &old_status {
        Some(s) if s.ttl_expiration_time.is_some() => s.clone(),
        other => {
            let (ttl, warn) = ttl_duration(&export.spec);
            if let Some(w) = warn {
                ctx.writer
                    .event(&oref, EventType::Warning, "InvalidTTL", "Initialize", w)
                    .await;
            }
            let created = export
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0)
                .unwrap_or(now_ts);
            let mut s = initial_status(ttl_expiration(created, ttl), &now);
            if let Some(o) = other {
                s.token_secret_ref = o.token_secret_ref.clone();
            }
            s
        }
    };
    let expiry = status
        .ttl_expiration_time
        .as_ref()
        .map(|t| t.0)
        .unwrap_or(now_ts);

    // Step 3: TTL, in any phase, whether or not a pod exists (§12).
    let Some(until) = until_expiry(now_ts, expiry) else {
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: export.uid(),
                resource_version: None,
            }),
            ..Default::default()
        };
        ctx.writer.check()?;
        match exports.delete(&name, &dp).await {
            Ok(_) => {
                ctx.ttl_deletions.inc();
                ctx.writer
                    .event(
                        &oref,
                        EventType::Normal,
                        "TTLExpired",
                        "Delete",
                        format!("VirtualMachineExport {ns}/{name} reached its TTL and was deleted"),
                    )
                    .await;
            }
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(Action::await_change());
    };

    let services: Api<Service> = Api::namespaced(ctx.client(), &ns);
    let pods: Api<Pod> = Api::namespaced(ctx.client(), &ns);
    let mut failure: Option<Condition> = None;

    // Step 5: the Service, even without a source.
    if let Err(msg) = ensure_service(&ctx, &export, &services).await {
        failure = Some(condition(
            COND_READY,
            false,
            REASON_OBJECT_CREATION_FAILED,
            msg,
        ));
    }
    status.service_name = Some(naming::service_name(&name));

    // Step 4: the source.
    let kind = classify_source(&export.spec);
    let source = match kind {
        SourceKind::Pvc => resolve_pvc(&ctx, &export),
        SourceKind::Unsupported => unavailable(
            PHASE_SKIPPED,
            REASON_UNSUPPORTED_SOURCE,
            unsupported_source_message(&export.spec),
        ),
        SourceKind::VirtualMachine => {
            status.virtual_machine_name = Some(export.spec.source.name.clone());
            resolve_vm(&ctx, &export)
        }
        SourceKind::VirtualMachineSnapshot => {
            let (src, vm) = resolve_snapshot(&ctx, &export).await;
            if vm.is_some() {
                status.virtual_machine_name = vm;
            }
            src
        }
    };
    if let Some(t) = &export.spec.token_secret_ref {
        status.token_secret_ref = Some(t.clone());
    }

    // Step 6: token, certificate, pod.
    let pod_name = naming::pod_name(&name);
    let mut pod = pods.get_opt(&pod_name).await?;
    if source.available && !source.volumes.is_empty() && failure.is_none() {
        let token_name = match &export.spec.token_secret_ref {
            Some(t) => Some(t.clone()),
            None => {
                let n = status
                    .token_secret_ref
                    .clone()
                    .unwrap_or_else(|| naming::token_secret_name(&name));
                status.token_secret_ref = Some(n.clone());
                match ensure_token(&ctx, &export, &n).await {
                    Ok(()) => Some(n),
                    Err(msg) => {
                        failure = Some(condition(
                            COND_READY,
                            false,
                            REASON_OBJECT_CREATION_FAILED,
                            msg,
                        ));
                        None
                    }
                }
            }
        };
        // The manifest ConfigMap (VM and snapshot sources), kept up to date.
        let mut vm_manifest = false;
        if matches!(
            kind,
            SourceKind::VirtualMachine | SourceKind::VirtualMachineSnapshot
        ) {
            match ensure_manifest(&ctx, &export, kind, &source.volumes).await {
                Ok(ok) => vm_manifest = ok,
                Err(msg) => {
                    failure = Some(condition(
                        COND_READY,
                        false,
                        REASON_OBJECT_CREATION_FAILED,
                        msg,
                    ))
                }
            }
        }
        if let (Some(token_name), None, None) = (token_name, &pod, &failure) {
            let ca = ctx.ca().await?;
            match ensure_cert(&ctx, &export, &ca).await {
                Err(msg) => {
                    failure = Some(condition(
                        COND_READY,
                        false,
                        REASON_OBJECT_CREATION_FAILED,
                        msg,
                    ))
                }
                Ok(not_after) => {
                    let volumes = dedup_volumes(source.volumes.clone());
                    let input = PodInput {
                        export: &export,
                        volumes: &volumes,
                        token_secret: &token_name,
                        cert_secret: &naming::cert_secret_name(&name),
                        deadline: deadline(not_after, ctx.cfg.pod.cert_renew_before, expiry),
                        vm_manifest,
                    };
                    let desired = build_pod(&input, &ctx.cfg.pod);
                    match ctx.writer.create(&pods, &desired).await {
                        Ok(p) => {
                            ctx.writer
                                .event(
                                    &oref,
                                    EventType::Normal,
                                    "ExporterPodCreated",
                                    "Create",
                                    format!("Created exporter pod {ns}/{pod_name}"),
                                )
                                .await;
                            pod = Some(p);
                        }
                        Err(e) => {
                            let msg = format!("Pod {pod_name}: {e}");
                            ctx.writer
                                .event(
                                    &oref,
                                    EventType::Warning,
                                    REASON_POD_CREATION_FAILED,
                                    "Create",
                                    msg.clone(),
                                )
                                .await;
                            failure = Some(condition(
                                COND_READY,
                                false,
                                REASON_POD_CREATION_FAILED,
                                msg,
                            ));
                        }
                    }
                }
            }
        }
    }

    // Step 7: pause, completion, changed certificate parameters.
    let mut status_pod = pod.clone();
    if let Some(p) = &pod {
        let state = pod_state(p);
        let delete_reason = if !source.available {
            Some(("ExportPaused", source.pause_message.clone()))
        } else if matches!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded") | Some("Failed")
        ) {
            Some((
                "ExporterPodFailedOrCompleted",
                format!(
                    "Exporter pod {ns}/{pod_name} is in phase {}",
                    p.status
                        .as_ref()
                        .and_then(|s| s.phase.clone())
                        .unwrap_or_default()
                ),
            ))
        } else if p.annotations().get(ANN_CERT_PARAMS) != Some(&ctx.cfg.pod.cert_params()) {
            Some((
                "CertificateParametersChanged",
                "Exporter TLS certificate parameters updated".to_string(),
            ))
        } else {
            None
        };
        if let Some((reason, msg)) = delete_reason {
            if p.metadata.deletion_timestamp.is_none() {
                ctx.writer
                    .event(&oref, EventType::Warning, reason, "Delete", msg)
                    .await;
                ctx.writer.delete(&pods, &pod_name).await?;
            }
            // A completed pod still shapes this pass's status (Terminated); others do not.
            if !(reason == "ExporterPodFailedOrCompleted" && state == PodState::Succeeded) {
                status_pod = if reason == "ExporterPodFailedOrCompleted" {
                    Some(p.clone())
                } else {
                    None
                };
            }
        }
    }

    // Step 8: the status.
    let mut conds = status.conditions.clone().unwrap_or_default();
    let (phase, ready) = match (&failure, &status_pod) {
        (Some(f), _) => (PHASE_PENDING, f.clone()),
        (None, Some(p)) => {
            let (ph, c) = phase_from_pod(pod_state(p), &pod_name);
            (ph, c)
        }
        (None, None) => (source.phase_without_pod, source.ready.clone()),
    };
    set_condition(&mut conds, ready, &now);
    match &source.extra {
        Some(c) => {
            set_condition(&mut conds, c.clone(), &now);
        }
        None => {
            remove_condition(&mut conds, COND_PVC_READY);
        }
    }
    status.conditions = Some(conds);
    status.phase = Some(phase.to_string());
    status.links = match (&status_pod, failure.is_none()) {
        (Some(p), true) if pod_state(p) == PodState::Ready => {
            let ca = ctx.ca().await?;
            Some(links_from_pod(
                p,
                &LinkSettings {
                    namespace: ns.clone(),
                    export_name: name.clone(),
                    service_name: naming::service_name(&name),
                    internal_cert: ca.cert,
                    external_host: ctx.cfg.external_host.clone(),
                    external_cert: ctx.cfg.external_ca.clone(),
                    strip_prefix: (kind == SourceKind::VirtualMachineSnapshot)
                        .then(|| name.clone()),
                },
            ))
        }
        _ => None,
    };
    if old_status.as_ref() != Some(&status) {
        write_status(&ctx, &exports, &export, &status).await?;
    }

    // Step 9: the smallest pending requeue: TTL expiry, or the backoff after a failed create
    // (1 s doubling to 60 s, per object; the status above already says what failed).
    let key = format!("{ns}/{name}");
    let mut failures = ctx.failures.lock().unwrap_or_else(|e| e.into_inner());
    let wait = if failure.is_some() {
        let n = failures.entry(key).or_insert(0);
        *n = n.saturating_add(1);
        until.min(rtc::backoff(*n, BACKOFF_CAP))
    } else {
        failures.remove(&key);
        until
    };
    Ok(Action::requeue(wait.max(Duration::from_millis(1))))
}

async fn write_status(
    ctx: &Context,
    api: &Api<VirtualMachineExport>,
    export: &VirtualMachineExport,
    status: &VirtualMachineExportStatus,
) -> Result<(), Error> {
    let rv = export.resource_version().unwrap_or_default();
    ctx.writer
        .merge_status_fenced(api, &export.name_any(), &rv, status)
        .await?;
    Ok(())
}

/// Exports whose source is the PVC `ns/claim`.
fn exports_of_claim(
    store: &Store<Guarded<VirtualMachineExport>>,
    ns: &str,
    claim: &str,
) -> Vec<ObjectRef<Guarded<VirtualMachineExport>>> {
    store
        .state()
        .iter()
        .filter_map(|g| {
            let e = g.0.as_ref().ok()?;
            (e.namespace().as_deref() == Some(ns)
                && classify_source(&e.spec) == SourceKind::Pvc
                && e.spec.source.name == claim)
                .then(|| ObjectRef::from_obj(g.as_ref()))
        })
        .collect()
}

/// Exports in `ns` with a source of `kind` (and `name`, when given).
fn exports_of_kind(
    store: &Store<Guarded<VirtualMachineExport>>,
    ns: &str,
    kind: SourceKind,
    name: Option<&str>,
) -> Vec<ObjectRef<Guarded<VirtualMachineExport>>> {
    store
        .state()
        .iter()
        .filter_map(|g| {
            let e = g.0.as_ref().ok()?;
            (e.namespace().as_deref() == Some(ns)
                && classify_source(&e.spec) == kind
                && name.is_none_or(|n| e.spec.source.name == n))
            .then(|| ObjectRef::from_obj(g.as_ref()))
        })
        .collect()
}

/// Exports to re-check for an optional-API event; `None` means the API just appeared.
fn exports_of_optional(
    store: &Store<Guarded<VirtualMachineExport>>,
    kind: Kind,
    obj: Option<&kube::api::DynamicObject>,
) -> Vec<ObjectRef<Guarded<VirtualMachineExport>>> {
    let Some(obj) = obj else {
        // Every export that may be waiting for this API.
        return store
            .state()
            .iter()
            .filter(|g| {
                g.0.as_ref().is_ok_and(|e| {
                    let k = classify_source(&e.spec);
                    k == SourceKind::VirtualMachine
                        || k == SourceKind::VirtualMachineSnapshot
                        || (kind == Kind::DataVolume && k == SourceKind::Pvc)
                })
            })
            .map(|g| ObjectRef::from_obj(g.as_ref()))
            .collect();
    };
    let ns = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    match kind {
        Kind::VirtualMachine | Kind::VirtualMachineInstance => {
            exports_of_kind(store, &ns, SourceKind::VirtualMachine, Some(&name))
        }
        Kind::DataVolume => {
            let mut out = exports_of_claim(store, &ns, &name);
            out.extend(exports_of_kind(
                store,
                &ns,
                SourceKind::VirtualMachine,
                None,
            ));
            out
        }
        Kind::VirtualMachineSnapshot => {
            exports_of_kind(store, &ns, SourceKind::VirtualMachineSnapshot, Some(&name))
        }
        Kind::VirtualMachineSnapshotContent | Kind::VolumeSnapshot => {
            exports_of_kind(store, &ns, SourceKind::VirtualMachineSnapshot, None)
        }
    }
}

fn owner_export(meta: &kube::api::ObjectMeta) -> Option<ObjectRef<Guarded<VirtualMachineExport>>> {
    let o = meta.owner_references.as_ref()?.iter().find(|o| {
        o.controller == Some(true)
            && o.kind == KIND
            && o.api_version.starts_with(&format!("{GROUP}/"))
    })?;
    Some(ObjectRef::new(&o.name).within(meta.namespace.as_deref().unwrap_or_default()))
}

/// Runs the reconciler until shutdown.
pub async fn run(rt: Runtime, cfg: Config) {
    let ttl_deletions = IntCounter::new(
        "ucm_vmexport_ttl_deletions_total",
        "VirtualMachineExports deleted at TTL expiry",
    )
    .expect("valid metric");
    let _ = rt
        .metrics
        .registry
        .register(Box::new(ttl_deletions.clone()));

    let (pod_store, pod_events) =
        rt.reflect::<Pod>("vmexport-pods", rt.watched(), watcher::Config::default());
    let (pvc_store, pvc_events) = rt.reflect::<PersistentVolumeClaim>(
        "vmexport-pvcs",
        rt.watched(),
        watcher::Config::default(),
    );
    let controller = rt.controller::<VirtualMachineExport>(
        CONTROLLER,
        rt.watched(),
        watcher::Config::default(),
        Trigger::SpecAndFinalizers,
    );
    let store = controller.store();

    // Exports by phase, computed from the cache at scrape time (§14): no timer.
    if let Err(e) = rt
        .metrics
        .registry
        .register(Box::new(PhaseCollector::new(store.clone())))
    {
        tracing::warn!(error = %e, "cannot register ucm_vmexport_exports");
    }

    // Optional APIs: discovery, their watches, and the exports they re-trigger.
    let optional_state = Arc::new(Optional::default());
    let (opt_tx, mut opt_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(optional::run(
        rt.client.clone(),
        rt.config.watch_namespace.clone(),
        Arc::clone(&optional_state),
        opt_tx,
        rt.shutdown.clone(),
    ));
    let s3 = store.clone();
    let optional_triggers =
        futures::stream::poll_fn(move |cx| opt_rx.poll_recv(cx)).flat_map(move |(kind, obj)| {
            futures::stream::iter(exports_of_optional(&s3, kind, obj.as_ref()))
        });

    let s1 = store.clone();
    let s2 = store.clone();
    let controller = controller
        .reconcile_on(optional_triggers)
        .owns(
            rt.watched::<Service>(),
            watcher::Config::default().labels("kubevirt.io=virt-exporter"),
        )
        .owns(
            rt.watched::<Secret>(),
            watcher::Config::default().labels("kubevirt.io=virt-exporter"),
        )
        .watches_stream(pvc_events.boxed(), move |pvc: PersistentVolumeClaim| {
            let ns = pvc.namespace().unwrap_or_default();
            let mut out = exports_of_claim(&s1, &ns, &pvc.name_any());
            // A VM's claims (and its backend PVC) are not indexed: VM exports of the namespace
            // are re-checked, which is cheap and idempotent.
            out.extend(exports_of_kind(&s1, &ns, SourceKind::VirtualMachine, None));
            out
        })
        .watches_stream(pod_events.boxed(), move |pod: Pod| {
            let ns = pod.namespace().unwrap_or_default();
            let mut out: Vec<_> = owner_export(&pod.metadata).into_iter().collect();
            for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
                if let Some(c) = &v.persistent_volume_claim {
                    out.extend(exports_of_claim(&s2, &ns, &c.claim_name));
                }
            }
            out
        });
    let ctx = Arc::new(Context {
        writer: rt.writer(CONTROLLER),
        cfg,
        pods: pod_store,
        pvcs: pvc_store,
        optional: optional_state,
        ca: tokio::sync::Mutex::new(None),
        ttl_deletions,
        failures: Mutex::new(BTreeMap::new()),
    });
    rtc::run(&rt, CONTROLLER, controller, ctx, BACKOFF_CAP, reconcile).await;
}

/// `ucm_vmexport_exports{phase}` from the export cache, evaluated on every scrape.
struct PhaseCollector {
    store: Store<Guarded<VirtualMachineExport>>,
    desc: prometheus::core::Desc,
}

impl PhaseCollector {
    const PHASES: [&'static str; 5] = ["Pending", "Ready", "Terminated", "Skipped", "Unset"];

    fn new(store: Store<Guarded<VirtualMachineExport>>) -> Self {
        let desc = prometheus::core::Desc::new(
            "ucm_vmexport_exports".into(),
            "VirtualMachineExports by phase".into(),
            vec!["phase".into()],
            Default::default(),
        )
        .expect("valid metric");
        PhaseCollector { store, desc }
    }
}

impl prometheus::core::Collector for PhaseCollector {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let g = IntGaugeVec::new(
            Opts::new("ucm_vmexport_exports", "VirtualMachineExports by phase"),
            &["phase"],
        )
        .expect("valid metric");
        for p in Self::PHASES {
            g.with_label_values(&[p]).set(0);
        }
        for e in self.store.state() {
            let phase =
                e.0.as_ref()
                    .ok()
                    .and_then(|e| e.status.as_ref()?.phase.clone())
                    .unwrap_or_default();
            let key = Self::PHASES
                .into_iter()
                .find(|k| *k == phase)
                .unwrap_or("Unset");
            g.with_label_values(&[key]).inc();
        }
        prometheus::core::Collector::collect(&g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::reflector;
    use prometheus::Encoder;

    #[test]
    fn restore_pvc_rules() {
        let mut e = VirtualMachineExport::new("ex", Default::default());
        e.metadata.namespace = Some("ns".into());
        e.metadata.uid = Some("u".into());
        let backup = serde_json::json!({"volumeName": "root", "volumeSnapshotName": "vs1", "persistentVolumeClaim": {
            "metadata": {"name": "disk", "annotations": {"restore.kubevirt.io/x": "1", "keep": "me"}},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "3Gi"}}, "volumeName": "pv-1", "storageClassName": "sc"}}});
        let vm_vols = vec![
            serde_json::json!({"name": "root", "persistentVolumeClaim": {"claimName": "disk"}}),
        ];
        let p = restore_pvc(&e, &backup, &vm_vols, Some("2Gi")).unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("ex-disk"));
        let spec = p.spec.clone().unwrap();
        assert_eq!(
            spec.resources.unwrap().requests.unwrap()["storage"].0,
            "3Gi",
            "request larger than restoreSize"
        );
        assert!(spec.volume_name.is_none(), "the bound PV is not copied");
        assert_eq!(spec.storage_class_name.as_deref(), Some("sc"));
        assert_eq!(spec.data_source_ref.unwrap().name, "vs1");
        let ann = p.metadata.annotations.unwrap();
        assert_eq!(
            ann.get(ANN_CONTENT_TYPE).map(String::as_str),
            Some("kubevirt")
        );
        assert_eq!(ann.get("keep").map(String::as_str), Some("me"));
        assert!(!ann.contains_key("restore.kubevirt.io/x"));
        let p = restore_pvc(&e, &backup, &[], Some("5Gi")).unwrap();
        assert_eq!(
            p.spec.unwrap().resources.unwrap().requests.unwrap()["storage"].0,
            "5Gi"
        );
        assert!(quantity_bytes("1Gi") > quantity_bytes("1G"));
        assert_eq!(quantity_bytes("1024"), 1024.0);
    }

    #[test]
    fn phase_collector_counts_from_the_cache() {
        let (reader, mut writer) = reflector::store::<Guarded<VirtualMachineExport>>();
        for (name, phase) in [
            ("a", Some("Ready")),
            ("b", Some("Pending")),
            ("c", None),
            ("d", Some("Ready")),
        ] {
            let mut e = VirtualMachineExport::new(name, Default::default());
            e.metadata.namespace = Some("ns".into());
            e.status = phase.map(|p| VirtualMachineExportStatus {
                phase: Some(p.into()),
                ..Default::default()
            });
            let g: Guarded<VirtualMachineExport> =
                serde_json::from_value(serde_json::to_value(&e).unwrap()).unwrap();
            writer.apply_watcher_event(&watcher::Event::Apply(g));
        }
        let registry = prometheus::Registry::new();
        registry
            .register(Box::new(PhaseCollector::new(reader)))
            .unwrap();
        let mut buf = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&registry.gather(), &mut buf)
            .unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert!(
            text.contains("ucm_vmexport_exports{phase=\"Ready\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("ucm_vmexport_exports{phase=\"Pending\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ucm_vmexport_exports{phase=\"Unset\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ucm_vmexport_exports{phase=\"Skipped\"} 0"),
            "{text}"
        );
    }
}

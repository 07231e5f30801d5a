//! Source resolution (docs/vmexport.md, "Sources"): what a PVC, VirtualMachine,
//! VirtualMachineSnapshot or VirtualMachineTemplate source provides, whether it is available, and
//! the conditions that say why not. It reads the caches only (`Stores`), so it sends no request and
//! is unit-tested with filled stores.
//! Its pure parts: `kind` (which kind of source an export names), `pvc` (what a claim says) and
//! `template` (what a VirtualMachineTemplate says).

pub mod kind;
pub mod pvc;
pub mod template;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::reflector::ObjectRef;

use super::api::*;
use super::context::Stores;
use super::naming;
use super::objects::pod::{ExportVolume, dedup_volumes};
use super::objects::status::condition;
use super::optional::Kind;
use super::types::{Condition, VirtualMachineExport};
use crate::runtime::meta::controller_ref;
use kind::SourceKind;
use pvc::*;

/// What the source resolution found.
#[derive(Clone, Debug)]
pub struct Source {
    pub volumes: Vec<ExportVolume>,
    pub available: bool,
    /// Ready condition while there is no pod.
    pub ready: Condition,
    pub phase_without_pod: &'static str,
    pub extra: Option<Condition>,
    pub pause_message: String,
    /// Restore PVCs of a snapshot source that the cache does not show: created before the
    /// pass goes on (their absence in the volumes' phases is already accounted for).
    pub create_pvcs: Vec<PersistentVolumeClaim>,
}

/// The owning DataVolume's `(phase, contentType)` when the DataVolume API is watched.
pub(super) fn dv_info(
    st: &Stores,
    pvc: &PersistentVolumeClaim,
) -> (Option<String>, Option<String>) {
    let (Some(dv), Some(store)) = (owning_datavolume(pvc), st.optional.store(Kind::DataVolume))
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

pub(super) fn in_use_by_pod(st: &Stores, ns: &str, claim: &str, export_uid: &str) -> bool {
    // The claim index names the candidates; the store holds their phase and owners.
    let candidates: Vec<Arc<Pod>> = st
        .claims
        .names(ns, claim)
        .into_iter()
        .filter_map(|p| st.pods.get(&ObjectRef::new(&p).within(ns)))
        .collect();
    pvc_in_use(candidates.iter().map(|p| p.as_ref()), claim, export_uid).is_some()
}

/// VM source: the claims of its volumes and its backend-storage PVC, blocked while a
/// VMI of the same name is not finished.
pub(super) fn resolve_vm(st: &Stores, export: &VirtualMachineExport) -> Source {
    let ns = export.namespace().unwrap_or_default();
    let name = export.spec.source.name.clone();
    let Some(vms) = st.optional.store(Kind::VirtualMachine) else {
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
    for p in st.pvcs.state() {
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
        match st.pvcs.get(&ObjectRef::new(claim).within(&ns)) {
            None => populated = false,
            Some(pvc) => {
                let (phase, ct) = dv_info(st, &pvc);
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
            create_pvcs: Vec::new(),
        };
    }
    if let Some(vmis) = st.optional.store(Kind::VirtualMachineInstance)
        && let Some(vmi) = vmis
            .get(&ObjectRef::new_with(&name, Kind::VirtualMachineInstance.resource()).within(&ns))
        && !matches!(
            vmi.data["status"]["phase"].as_str(),
            Some("Succeeded" | "Failed")
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
            create_pvcs: Vec::new(),
        };
    }
    Source {
        volumes,
        available: true,
        ready: condition(COND_READY, false, REASON_INITIALIZING, ""),
        phase_without_pod: PHASE_PENDING,
        extra: None,
        pause_message: String::new(),
        create_pvcs: Vec::new(),
    }
}

/// VirtualMachineTemplate source (docs/vmexport.md, "Sources"): the claims its embedded VM
/// names, once the template is `Ready`. Messages and reasons are upstream's; as upstream, the
/// claims are not checked for other users (the template's claims are its golden images).
pub(super) fn resolve_template(st: &Stores, export: &VirtualMachineExport) -> Source {
    let ns = export.namespace().unwrap_or_default();
    let name = export.spec.source.name.clone();
    let Some(found) = get_dyn(st, Kind::VirtualMachineTemplate, &ns, &name) else {
        return unavailable(
            PHASE_PENDING,
            REASON_SOURCE_API_NOT_INSTALLED,
            format!(
                "the {} API is not installed; the export proceeds once it is",
                Kind::VirtualMachineTemplate.gvk()
            ),
        );
    };
    let Some(tpl) = found else {
        return unavailable(
            PHASE_SKIPPED,
            REASON_VM_TEMPLATE_NOT_FOUND,
            format!("VirtualMachineTemplate {ns}/{name} not found"),
        );
    };
    if !template::is_ready(&tpl.data) {
        return unavailable(
            PHASE_SKIPPED,
            REASON_VM_TEMPLATE_NOT_READY,
            format!("VirtualMachineTemplate {ns}/{name} is not ready"),
        );
    }
    let claims = template::template_claims(
        &tpl.data["spec"]["virtualMachine"],
        template::parameters(&tpl.data),
        &ns,
    );
    let mut volumes = Vec::new();
    let mut populated = true;
    for claim in &claims {
        match st.pvcs.get(&ObjectRef::new(claim).within(&ns)) {
            None => populated = false,
            Some(pvc) => {
                let (phase, ct) = dv_info(st, &pvc);
                if !is_populated(&pvc, phase.as_deref()) {
                    populated = false;
                }
                volumes.push(ExportVolume::from_pvc(&pvc, ct.as_deref()));
            }
        }
    }
    let volumes = dedup_volumes(volumes);
    if !populated {
        let msg = format!("Not all volumes in VirtualMachineTemplate {ns}/{name} are populated");
        return Source {
            // Upstream: no claim found yet means no content, so Skipped until one appears.
            phase_without_pod: if volumes.is_empty() {
                PHASE_SKIPPED
            } else {
                PHASE_PENDING
            },
            volumes,
            available: false,
            ready: condition(COND_READY, false, REASON_VOLUMES_NOT_POPULATED, msg.clone()),
            extra: None,
            pause_message: msg,
            create_pvcs: Vec::new(),
        };
    }
    if volumes.is_empty() {
        return unavailable(
            PHASE_SKIPPED,
            REASON_VM_NO_VOLUMES,
            format!("VirtualMachineTemplate {ns}/{name} has no volumes"),
        );
    }
    Source {
        volumes,
        available: true,
        ready: condition(COND_READY, false, REASON_INITIALIZING, ""),
        phase_without_pod: PHASE_PENDING,
        extra: None,
        pause_message: String::new(),
        create_pvcs: Vec::new(),
    }
}

/// A template source's VirtualMachineTemplate and the `apiVersion` it was read with.
pub(super) fn source_template(
    st: &Stores,
    export: &VirtualMachineExport,
) -> Option<(serde_json::Value, String)> {
    let ns = export.namespace().unwrap_or_default();
    let (store, ar) = st
        .optional
        .store_with_resource(Kind::VirtualMachineTemplate)?;
    let tpl = store.get(&ObjectRef::new_with(&export.spec.source.name, ar.clone()).within(&ns))?;
    Some((serde_json::to_value(&*tpl).ok()?, ar.api_version))
}

/// The VM whose manifest the `all` endpoint serves: the source VM, or the snapshot's copy.
pub(super) fn source_vm(
    st: &Stores,
    export: &VirtualMachineExport,
    kind: SourceKind,
) -> Option<serde_json::Value> {
    let ns = export.namespace().unwrap_or_default();
    let name = &export.spec.source.name;
    match kind {
        SourceKind::VirtualMachine => {
            let vm = get_dyn(st, Kind::VirtualMachine, &ns, name)??;
            serde_json::to_value(&*vm).ok()
        }
        SourceKind::VirtualMachineSnapshot => {
            let snap = get_dyn(st, Kind::VirtualMachineSnapshot, &ns, name)??;
            let content_name = snap.data["status"]["virtualMachineSnapshotContentName"].as_str()?;
            let content = get_dyn(st, Kind::VirtualMachineSnapshotContent, &ns, content_name)??;
            Some(content.data["spec"]["source"]["virtualMachine"].clone())
        }
        _ => None,
    }
}

pub(super) fn get_dyn(
    st: &Stores,
    k: Kind,
    ns: &str,
    name: &str,
) -> Option<Option<Arc<DynamicObject>>> {
    let (store, ar) = st.optional.store_with_resource(k)?;
    Some(store.get(&ObjectRef::new_with(name, ar).within(ns)))
}

/// The restore PVC of one volume backup.
pub(super) fn restore_pvc(
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
            owner_references: controller_ref(export).map(|o| vec![o]),
            ..Default::default()
        },
        spec: serde_json::from_value(spec).ok(),
        status: None,
    })
}

/// Bytes of a quantity like `1Gi`, `500M` or `1073741824` (for comparisons only).
pub(super) fn quantity_bytes(q: &str) -> f64 {
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

/// VirtualMachineSnapshot source: restore PVCs `<export>-<pvc>` from the
/// snapshot content, created once and never re-created.
pub(super) fn resolve_snapshot(
    st: &Stores,
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
        if st.optional.store(k).is_none() {
            return (missing_api(k), None);
        }
    }
    let volumes_created =
        |ok: bool, reason: &str| Some(condition(COND_VOLUMES_CREATED, ok, reason, ""));
    let Some(Some(snap)) = get_dyn(st, Kind::VirtualMachineSnapshot, &ns, &name) else {
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
    let Some(Some(content)) = get_dyn(st, Kind::VirtualMachineSnapshotContent, &ns, &content_name)
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
    let mut volumes = Vec::new();
    let mut create_pvcs = Vec::new();
    let mut all_bound = true;
    for b in backups {
        let restore_size = b["volumeSnapshotName"].as_str().and_then(|vs| {
            get_dyn(st, Kind::VolumeSnapshot, &ns, vs)
                .flatten()
                .and_then(|o| o.data["status"]["restoreSize"].as_str().map(str::to_string))
        });
        let Some(desired) = restore_pvc(export, b, &vm_volumes, restore_size.as_deref()) else {
            continue;
        };
        let pvc = match st
            .pvcs
            .get(&ObjectRef::new(&desired.name_any()).within(&ns))
        {
            Some(p) => (*p).clone(),
            None => {
                create_pvcs.push(desired.clone());
                desired
            }
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
            create_pvcs,
        },
        vm_name,
    )
}

/// The source after creating a restore PVC failed: pending, and the pass stops there.
pub(super) fn restore_failed(msg: String) -> Source {
    let mut s = unavailable(PHASE_PENDING, REASON_OBJECT_CREATION_FAILED, msg);
    s.extra = Some(condition(
        COND_VOLUMES_CREATED,
        false,
        REASON_NOT_ALL_PVCS_CREATED,
        "",
    ));
    s
}

pub(super) fn resolve_pvc(st: &Stores, export: &VirtualMachineExport) -> Source {
    let ns = export.namespace().unwrap_or_default();
    let name = export.spec.source.name.clone();
    let pvc = st.pvcs.get(&ObjectRef::new(&name).within(&ns));
    let extra = Some(pvc_condition(&ns, &name, pvc.as_deref()));
    let Some(pvc) = pvc else {
        return Source {
            volumes: vec![],
            available: false,
            ready: condition(COND_READY, false, REASON_INITIALIZING, ""),
            phase_without_pod: PHASE_PENDING,
            extra,
            pause_message: format!("PersistentVolumeClaim {ns}/{name} not found"),
            create_pvcs: Vec::new(),
        };
    };
    // Without the DataVolume API a DV-owned claim counts as populated (docs/vmexport.md, "Optional
    // APIs").
    let (dv_phase, dv_content) = dv_info(st, &pvc);
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
            create_pvcs: Vec::new(),
        };
    }
    if in_use_by_pod(st, &ns, &name, &uid) {
        let msg = format!("PersistentVolumeClaim {ns}/{name} is in use");
        return Source {
            volumes,
            available: false,
            ready: condition(COND_READY, false, REASON_IN_USE, msg.clone()),
            phase_without_pod: PHASE_PENDING,
            extra,
            pause_message: msg,
            create_pvcs: Vec::new(),
        };
    }
    Source {
        volumes,
        available: true,
        ready: condition(COND_READY, false, REASON_INITIALIZING, ""),
        phase_without_pod: PHASE_PENDING,
        extra,
        pause_message: String::new(),
        create_pvcs: Vec::new(),
    }
}

pub(super) fn unavailable(phase: &'static str, reason: &str, msg: String) -> Source {
    Source {
        volumes: vec![],
        available: false,
        ready: condition(COND_READY, false, reason, msg.clone()),
        phase_without_pod: phase,
        extra: None,
        pause_message: msg,
        create_pvcs: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

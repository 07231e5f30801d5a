//! What a source claim says (docs/vmexport.md, "Sources"): block or filesystem, its phase, the
//! DataVolume that owns it, whether it holds a KubeVirt disk image, whether it is populated, its
//! `PVCReady` condition, and which other Pod uses it. Pure.

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::ResourceExt;

use crate::vmexport::api::*;
use crate::vmexport::objects::status::condition;
use crate::vmexport::types::Condition;

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
        if matches!(phase, Some("Succeeded" | "Failed")) {
            return false;
        }
        let own = pod
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && o.uid == export_uid);
        !own && pod_mounts_claim(pod, claim)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmexport::fixtures::user_pod;
    use k8s_openapi::api::core::v1::{PersistentVolumeClaimSpec, PersistentVolumeClaimStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use std::collections::BTreeMap;

    fn pvc(name: &str, block: bool, ann: Option<&str>, phase: &str) -> PersistentVolumeClaim {
        let mut p = PersistentVolumeClaim::default();
        p.metadata.name = Some(name.into());
        p.metadata.namespace = Some("ns1".into());
        if let Some(a) = ann {
            p.metadata.annotations = Some(BTreeMap::from([(
                ANN_CONTENT_TYPE.to_string(),
                a.to_string(),
            )]));
        }
        p.spec = Some(PersistentVolumeClaimSpec {
            volume_mode: Some(if block { "Block" } else { "Filesystem" }.into()),
            ..Default::default()
        });
        p.status = Some(PersistentVolumeClaimStatus {
            phase: Some(phase.into()),
            ..Default::default()
        });
        p
    }

    fn dv_owned(mut p: PersistentVolumeClaim) -> PersistentVolumeClaim {
        p.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "cdi.kubevirt.io/v1beta1".into(),
            kind: "DataVolume".into(),
            name: p.name_any(),
            uid: "dv".into(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        p
    }

    #[test]
    fn content_type_detection() {
        // annotation decides
        assert!(is_kubevirt_content(
            &pvc("a", false, Some("kubevirt"), "Bound"),
            None
        ));
        assert!(is_kubevirt_content(
            &pvc("a", false, Some(""), "Bound"),
            None
        ));
        assert!(!is_kubevirt_content(
            &pvc("a", false, Some("archive"), "Bound"),
            Some("kubevirt")
        ));
        // no annotation: owning DataVolume's content type
        let owned = dv_owned(pvc("a", false, None, "Bound"));
        assert!(is_kubevirt_content(&owned, Some("kubevirt")));
        assert!(is_kubevirt_content(&owned, Some("")));
        assert!(!is_kubevirt_content(&owned, Some("archive")));
        // plain PVC: archive
        assert!(!is_kubevirt_content(&pvc("a", false, None, "Bound"), None));
    }

    #[test]
    fn populated_rules() {
        assert!(is_populated(&pvc("a", false, None, "Pending"), None));
        let owned = dv_owned(pvc("a", false, None, "Bound"));
        assert!(is_populated(&owned, Some("Succeeded")));
        assert!(!is_populated(&owned, Some("ImportInProgress")));
        assert!(
            is_populated(&owned, None),
            "no DataVolume API: counts as populated"
        );
    }

    #[test]
    fn pvc_ready_condition() {
        let c = pvc_condition("ns1", "d", Some(&pvc("d", false, None, "Bound")));
        assert_eq!(
            (c.status.as_str(), c.reason.as_deref()),
            ("True", Some(REASON_PVC_BOUND))
        );
        let c = pvc_condition("ns1", "d", Some(&pvc("d", false, None, "Pending")));
        assert_eq!(
            (c.status.as_str(), c.reason.as_deref()),
            ("False", Some(REASON_PVC_PENDING))
        );
        let c = pvc_condition("ns1", "d", Some(&pvc("d", false, None, "Lost")));
        assert_eq!(
            (c.status.as_str(), c.reason.as_deref()),
            ("False", Some(REASON_UNKNOWN))
        );
        let c = pvc_condition("ns1", "d", None);
        assert_eq!(c.reason.as_deref(), Some(REASON_PVC_NOT_FOUND));
        assert_eq!(
            c.message.as_deref(),
            Some("PersistentVolumeClaim ns1/d not found")
        );
    }

    #[test]
    fn in_use_detection() {
        let running = user_pod("d", "Running", None);
        let pending = user_pod("d", "Pending", None);
        let succeeded = user_pod("d", "Succeeded", None);
        let failed = user_pod("d", "Failed", None);
        let own = user_pod("d", "Running", Some("uid-1"));
        let other_export = user_pod("d", "Running", Some("uid-2"));
        let other_claim = user_pod("other", "Running", None);
        assert!(pvc_in_use([&running], "d", "uid-1").is_some());
        assert!(pvc_in_use([&pending], "d", "uid-1").is_some());
        assert!(pvc_in_use([&succeeded, &failed, &own, &other_claim], "d", "uid-1").is_none());
        assert!(pvc_in_use([&other_export], "d", "uid-1").is_some());
    }
}

//! Test fixtures shared by the unit tests of `objects/` and `sources/`: an export, a user's Pod
//! and the export pod's input.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    PersistentVolumeClaimVolumeSource, Pod, PodSpec, PodStatus, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use super::api::*;
use super::objects::pod::{ExportVolume, PodInput};
use super::types::{TypedLocalObjectReference, VirtualMachineExport, VirtualMachineExportSpec};

pub(super) fn export(name: &str) -> VirtualMachineExport {
    let mut e = VirtualMachineExport::new(
        name,
        VirtualMachineExportSpec {
            source: TypedLocalObjectReference {
                api_group: None,
                kind: "PersistentVolumeClaim".into(),
                name: "disk".into(),
            },
            ..Default::default()
        },
    );
    e.metadata.namespace = Some("ns1".into());
    e.metadata.uid = Some("uid-1".into());
    e.metadata.labels = Some(BTreeMap::from([("team".to_string(), "a".to_string())]));
    e.metadata.annotations = Some(BTreeMap::from([("note".to_string(), "x".to_string())]));
    e
}

pub(super) fn user_pod(claim: &str, phase: &str, owner_uid: Option<&str>) -> Pod {
    let mut p = Pod::default();
    p.metadata.name = Some(format!("user-{phase}"));
    if let Some(uid) = owner_uid {
        p.metadata.owner_references = Some(vec![OwnerReference {
            api_version: OWNER_API_VERSION.into(),
            kind: KIND.into(),
            name: "x".into(),
            uid: uid.into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
    }
    p.spec = Some(PodSpec {
        volumes: Some(vec![Volume {
            name: "d".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.into(),
                read_only: None,
            }),
            ..Default::default()
        }]),
        ..Default::default()
    });
    p.status = Some(PodStatus {
        phase: Some(phase.into()),
        ..Default::default()
    });
    p
}

pub(super) fn input<'a>(
    e: &'a VirtualMachineExport,
    vols: &'a [ExportVolume],
    vm: bool,
) -> PodInput<'a> {
    PodInput {
        export: e,
        volumes: vols,
        token_secret: "export-token-e1",
        cert_secret: "export-cert-e1",
        deadline: "2026-01-01T02:00:00Z".parse().unwrap(),
        vm_manifest: vm,
        oci: false,
    }
}

use super::*;
use crate::vmexport::context::Stores;
use crate::vmexport::objects::pod::{ExportVolume, PodSettings};
use crate::vmexport::optional::Optional;
use crate::vmexport::podcache::claim_index;
use crate::vmexport::sources::kind::{classify_source, unsupported_source_message};
use crate::vmexport::sources::{resolve_pvc, resolve_template, resolve_vm};
use crate::vmexport::types::{TypedLocalObjectReference, VirtualMachineExportSpec};
use k8s_openapi::api::core::v1::{
    ContainerStatus, PersistentVolumeClaimSpec, PersistentVolumeClaimStatus, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::runtime::{reflector, watcher};
use std::collections::BTreeMap;
use std::sync::Arc;

const UID: &str = "uid-1";

fn t0() -> jiff::Timestamp {
    "2026-01-01T00:00:00Z".parse().unwrap()
}

fn now() -> jiff::Timestamp {
    t0() + jiff::SignedDuration::from_secs(60)
}

fn cfg() -> Settings {
    Settings {
        pod: PodSettings::default(),
        ca_secret: "ucm-export-ca".into(),
        manager_namespace: "ucm".into(),
        external_host: None,
        external_ca: String::new(),
        oci: false,
    }
}

fn export_of(kind: &str, source: &str) -> VirtualMachineExport {
    let mut e = VirtualMachineExport::new(
        "ex",
        VirtualMachineExportSpec {
            source: TypedLocalObjectReference {
                api_group: None,
                kind: kind.into(),
                name: source.into(),
            },
            ..Default::default()
        },
    );
    e.metadata.namespace = Some("ns".into());
    e.metadata.uid = Some(UID.into());
    e.metadata.creation_timestamp = Some(Time(t0()));
    e
}

fn export() -> VirtualMachineExport {
    export_of("PersistentVolumeClaim", "disk")
}

fn owner(uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: OWNER_API_VERSION.into(),
        kind: KIND.into(),
        name: "ex".into(),
        uid: uid.into(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn meta(name: &str, owner_uid: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some("ns".into()),
        owner_references: owner_uid.map(|u| vec![owner(u)]),
        ..Default::default()
    }
}

fn available() -> Source {
    Source {
        volumes: vec![ExportVolume {
            pvc: "disk".into(),
            block: false,
            kubevirt_content: false,
        }],
        available: true,
        ready: condition(COND_READY, false, REASON_INITIALIZING, ""),
        phase_without_pod: PHASE_PENDING,
        extra: Some(condition(COND_PVC_READY, true, REASON_PVC_BOUND, "")),
        pause_message: String::new(),
        create_pvcs: Vec::new(),
    }
}

fn paused(reason: &str, msg: &str) -> Source {
    Source {
        available: false,
        ready: condition(COND_READY, false, reason, msg),
        pause_message: msg.into(),
        ..available()
    }
}

/// An export pod of this export in `phase`, ready or not, with the shipped cert parameters.
fn pod(phase: &str, ready: bool) -> Pod {
    let mut p = Pod {
        metadata: meta(&naming::pod_name("ex"), Some(UID)),
        status: Some(PodStatus {
            phase: Some(phase.into()),
            container_statuses: Some(vec![ContainerStatus {
                name: "exporter".into(),
                ready,
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    p.metadata.uid = Some("pod-uid".into());
    p.metadata.annotations = Some(BTreeMap::from([(
        ANN_CERT_PARAMS.to_string(),
        PodSettings::default().cert_params(),
    )]));
    p
}

/// Every child present and ours, no pod yet.
fn observed(source: Source) -> Observed {
    let e = export();
    Observed {
        kind: classify_source(&e.spec),
        export: e,
        source,
        snapshot_vm: None,
        service: Some(meta(&naming::service_name("ex"), Some(UID))),
        token: Some(meta(&naming::token_secret_name("ex"), Some(UID))),
        cert: Some(cert_meta("2026-01-01T19:12:00Z")),
        pod: None,
    }
}

/// Our certificate Secret, renewed in place at `renew_at`.
fn cert_meta(renew_at: &str) -> ObjectMeta {
    let mut m = meta(&naming::cert_secret_name("ex"), Some(UID));
    m.annotations = Some(BTreeMap::from([(
        ANN_CERT_RENEW_AT.to_string(),
        renew_at.to_string(),
    )]));
    m
}

fn with_pod(mut o: Observed, p: Pod) -> Observed {
    o.pod = Some(p);
    o
}

fn ready_cond(p: &Decision) -> (String, String, String) {
    let c = p
        .status
        .conditions
        .as_ref()
        .unwrap()
        .iter()
        .find(|c| c.type_ == COND_READY)
        .unwrap();
    (
        c.status.clone(),
        c.reason.clone().unwrap_or_default(),
        c.message.clone().unwrap_or_default(),
    )
}

fn phase(p: &Decision) -> &str {
    p.status.phase.as_deref().unwrap()
}

fn reasons(p: &Decision) -> Vec<&'static str> {
    p.events.iter().map(|e| e.reason).collect()
}

#[test]
fn a_new_export_creates_its_children_and_pod() {
    let mut o = observed(available());
    o.service = None;
    o.token = None;
    o.cert = None;
    let p = decide(&o, &cfg(), now());
    assert!(!p.expired);
    assert_eq!(
        p.create_service
            .as_ref()
            .and_then(|s| s.metadata.name.clone()),
        Some(naming::service_name("ex"))
    );
    assert_eq!(
        p.token,
        Some(TokenStep::Create(naming::token_secret_name("ex")))
    );
    assert!(!p.manifest, "PVC sources have no manifest ConfigMap");
    assert_eq!(p.cert, CertStep::Valid);
    assert_eq!(p.pod, PodStep::Create);
    assert_eq!(p.failure, None);
    // The pod about to be made is pending.
    assert_eq!(phase(&p), PHASE_PENDING);
    assert_eq!(
        ready_cond(&p),
        ("False".into(), REASON_POD_PENDING.into(), String::new())
    );
    assert_eq!(p.status.service_name, Some(naming::service_name("ex")));
    assert_eq!(
        p.status.token_secret_ref,
        Some(naming::token_secret_name("ex"))
    );
    assert_eq!(
        p.status.ttl_expiration_time,
        Some(Time(t0() + jiff::SignedDuration::from_secs(2 * 3600)))
    );
    // The requeue is the TTL expiry.
    assert_eq!(p.requeue, Duration::from_secs(2 * 3600 - 60));
    assert!(p.events.is_empty());
    assert!(p.links_pod.is_none());
}

#[test]
fn present_children_are_not_made_again() {
    let p = decide(&observed(available()), &cfg(), now());
    assert!(p.create_service.is_none());
    assert_eq!(
        p.token,
        Some(TokenStep::Present(naming::token_secret_name("ex")))
    );
    assert_eq!(p.cert, CertStep::Valid);
    assert_eq!(p.pod, PodStep::Create);
}

#[test]
fn a_token_secret_ref_is_used_as_given() {
    let mut o = observed(available());
    o.export.spec.token_secret_ref = Some("mine".into());
    o.token = None;
    let p = decide(&o, &cfg(), now());
    assert_eq!(p.token, Some(TokenStep::Given("mine".into())));
    assert_eq!(p.status.token_secret_ref.as_deref(), Some("mine"));
    assert_eq!(p.pod, PodStep::Create);
}

#[test]
fn a_ready_pod_is_kept_and_gives_the_links() {
    let p = decide(
        &with_pod(observed(available()), pod("Running", true)),
        &cfg(),
        now(),
    );
    assert_eq!(p.pod, PodStep::Keep);
    assert_eq!(p.cert, CertStep::Present);
    assert_eq!(phase(&p), PHASE_READY);
    assert_eq!(
        ready_cond(&p),
        ("True".into(), REASON_POD_READY.into(), String::new())
    );
    assert!(p.links_pod.is_some());
    assert!(p.events.is_empty());
}

#[test]
fn a_pending_pod_is_kept_without_links() {
    let p = decide(
        &with_pod(observed(available()), pod("Pending", false)),
        &cfg(),
        now(),
    );
    assert_eq!(p.pod, PodStep::Keep);
    assert_eq!(phase(&p), PHASE_PENDING);
    assert_eq!(ready_cond(&p).1, REASON_POD_PENDING);
    assert!(p.links_pod.is_none());
}

#[test]
fn a_running_pod_that_is_not_ready_says_where_to_look() {
    let p = decide(
        &with_pod(observed(available()), pod("Running", false)),
        &cfg(),
        now(),
    );
    assert_eq!(p.pod, PodStep::Keep);
    assert_eq!(phase(&p), PHASE_PENDING);
    let (st, reason, msg) = ready_cond(&p);
    assert_eq!((st.as_str(), reason.as_str()), ("False", REASON_UNKNOWN));
    assert!(msg.contains(READINESS_PATH), "{msg}");
}

#[test]
fn a_completed_pod_is_deleted_and_the_export_is_terminated() {
    let p = decide(
        &with_pod(observed(available()), pod("Succeeded", false)),
        &cfg(),
        now(),
    );
    assert_eq!(
        p.pod,
        PodStep::Delete {
            uid: "pod-uid".into(),
            reason: "ExporterPodFailedOrCompleted"
        }
    );
    assert_eq!(phase(&p), PHASE_TERMINATED);
    assert_eq!(ready_cond(&p).1, REASON_POD_COMPLETED);
    assert_eq!(reasons(&p), ["ExporterPodFailedOrCompleted"]);
    assert!(p.events[0].note.contains("is in phase Succeeded"));
}

#[test]
fn a_failed_pod_is_deleted_and_the_export_pending() {
    let p = decide(
        &with_pod(observed(available()), pod("Failed", false)),
        &cfg(),
        now(),
    );
    assert!(matches!(
        p.pod,
        PodStep::Delete {
            reason: "ExporterPodFailedOrCompleted",
            ..
        }
    ));
    assert_eq!(phase(&p), PHASE_PENDING);
    assert_eq!(ready_cond(&p).1, REASON_UNKNOWN);
}

#[test]
fn an_unavailable_source_pauses_the_pod() {
    let msg = "PersistentVolumeClaim ns/disk is in use";
    let p = decide(
        &with_pod(observed(paused(REASON_IN_USE, msg)), pod("Running", true)),
        &cfg(),
        now(),
    );
    assert_eq!(
        p.pod,
        PodStep::Delete {
            uid: "pod-uid".into(),
            reason: "ExportPaused"
        }
    );
    assert_eq!(p.events[0].note, msg);
    assert_eq!(p.events[0].type_, EventType::Warning);
    assert_eq!(p.events[0].action, "Delete");
    // The status is the source's, not the deleted pod's.
    assert_eq!(phase(&p), PHASE_PENDING);
    assert_eq!(
        ready_cond(&p),
        ("False".into(), REASON_IN_USE.into(), msg.into())
    );
    assert!(p.links_pod.is_none());
    assert_eq!(
        p.token, None,
        "no token, certificate or pod step while paused"
    );
    assert_eq!(p.cert, CertStep::None);
}

#[test]
fn changed_certificate_parameters_recreate_the_pod() {
    let mut old = pod("Running", true);
    old.metadata.annotations = Some(BTreeMap::from([(
        ANN_CERT_PARAMS.to_string(),
        "{}".to_string(),
    )]));
    let p = decide(&with_pod(observed(available()), old), &cfg(), now());
    assert_eq!(
        p.pod,
        PodStep::Delete {
            uid: "pod-uid".into(),
            reason: "CertificateParametersChanged"
        }
    );
    assert_eq!(phase(&p), PHASE_PENDING);
    assert_eq!(ready_cond(&p).1, REASON_INITIALIZING);
    assert!(p.links_pod.is_none());
}

#[test]
fn a_terminating_pod_is_not_deleted_again() {
    let mut p0 = pod("Succeeded", false);
    p0.metadata.deletion_timestamp = Some(Time(t0()));
    let p = decide(&with_pod(observed(available()), p0), &cfg(), now());
    assert_eq!(p.pod, PodStep::Terminating);
    assert!(p.events.is_empty());
    assert_eq!(phase(&p), PHASE_TERMINATED);
}

#[test]
fn a_foreign_pod_is_a_conflict_and_left_alone() {
    let mut foreign = pod("Running", true);
    foreign.metadata.owner_references = None;
    let p = decide(&with_pod(observed(available()), foreign), &cfg(), now());
    assert_eq!(p.pod, PodStep::Absent);
    assert_eq!(p.token, None);
    assert_eq!(phase(&p), PHASE_PENDING);
    let (st, reason, msg) = ready_cond(&p);
    assert_eq!(
        (st.as_str(), reason.as_str()),
        ("False", REASON_POD_CONFLICT)
    );
    assert!(
        msg.contains("Pod ns/virt-export-ex already exists"),
        "{msg}"
    );
    assert!(p.links_pod.is_none());
}

#[test]
fn a_foreign_service_is_a_creation_failure() {
    let mut o = observed(available());
    o.service = Some(meta(&naming::service_name("ex"), Some("other")));
    let p = decide(&o, &cfg(), now());
    assert!(p.create_service.is_none());
    assert_eq!(p.pod, PodStep::Absent);
    assert_eq!(ready_cond(&p).1, REASON_OBJECT_CREATION_FAILED);
    assert!(ready_cond(&p).2.contains("already exists and belongs to"));
}

#[test]
fn a_foreign_token_or_certificate_secret_is_a_conflict() {
    let mut o = observed(available());
    o.token = Some(meta(&naming::token_secret_name("ex"), None));
    let p = decide(&o, &cfg(), now());
    assert_eq!(p.token, None);
    assert_eq!(p.pod, PodStep::Absent);
    assert_eq!(ready_cond(&p).1, "SecretConflict");
    assert!(ready_cond(&p).2.contains("spec.tokenSecretRef"));

    let mut o = observed(available());
    o.cert = Some(meta(&naming::cert_secret_name("ex"), Some("other")));
    let p = decide(&o, &cfg(), now());
    assert_eq!(p.pod, PodStep::Absent);
    assert_eq!(p.cert, CertStep::None);
    assert_eq!(ready_cond(&p).1, "SecretConflict");
    // also while a pod runs
    let p = decide(&with_pod(o, pod("Running", true)), &cfg(), now());
    assert_eq!(p.cert, CertStep::None);
    assert_eq!(ready_cond(&p).1, "SecretConflict");
    assert!(p.links_pod.is_none());
}

#[test]
fn an_unsupported_source_is_skipped() {
    let e = export_of("Deployment", "x");
    let mut o = observed(unavailable(
        PHASE_SKIPPED,
        REASON_UNSUPPORTED_SOURCE,
        unsupported_source_message(&e.spec),
    ));
    o.kind = classify_source(&e.spec);
    o.export = e;
    let p = decide(&o, &cfg(), now());
    assert_eq!(phase(&p), PHASE_SKIPPED);
    assert_eq!(ready_cond(&p).1, REASON_UNSUPPORTED_SOURCE);
    assert_eq!(p.pod, PodStep::Absent);
    // No PVCReady row without a PVC source.
    assert!(
        !p.status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == COND_PVC_READY)
    );
}

#[test]
fn an_invalid_token_secret_ref_is_skipped() {
    let mut o = observed(available());
    o.export.spec.token_secret_ref = Some("Not_A_Name".into());
    let p = decide(&o, &cfg(), now());
    assert_eq!(phase(&p), PHASE_SKIPPED);
    assert_eq!(ready_cond(&p).1, REASON_INVALID_TOKEN_SECRET_REF);
    assert_eq!(p.pod, PodStep::Absent);
}

#[test]
fn the_pvc_row_follows_the_source() {
    let p = decide(&observed(available()), &cfg(), now());
    let row = |p: &Decision, t: &str| {
        p.status
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == t)
            .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
    };
    assert_eq!(
        row(&p, COND_PVC_READY),
        Some(("True".into(), REASON_PVC_BOUND.into()))
    );
    // A snapshot source reports VolumesCreated instead; a stale PVCReady row goes.
    let mut o = observed(available());
    o.export.status = Some(p.status.clone());
    o.source.extra = Some(condition(
        COND_VOLUMES_CREATED,
        false,
        REASON_NOT_ALL_PVCS_READY,
        "",
    ));
    let p2 = decide(&o, &cfg(), now());
    assert_eq!(
        row(&p2, COND_VOLUMES_CREATED),
        Some(("False".into(), REASON_NOT_ALL_PVCS_READY.into()))
    );
    o.source.extra = None;
    let p3 = decide(&o, &cfg(), now());
    assert_eq!(row(&p3, COND_PVC_READY), None);
}

#[test]
fn vm_and_snapshot_sources_name_the_vm_and_keep_a_manifest() {
    let mut o = observed(available());
    o.export = export_of("VirtualMachine", "vm1");
    o.kind = SourceKind::VirtualMachine;
    let p = decide(&o, &cfg(), now());
    assert_eq!(p.status.virtual_machine_name.as_deref(), Some("vm1"));
    assert!(p.manifest);

    let mut o = observed(available());
    o.export = export_of("VirtualMachineSnapshot", "snap");
    o.kind = SourceKind::VirtualMachineSnapshot;
    o.snapshot_vm = Some("vm2".into());
    o.source.create_pvcs = vec![PersistentVolumeClaim::default()];
    let p = decide(&o, &cfg(), now());
    assert_eq!(p.status.virtual_machine_name.as_deref(), Some("vm2"));
    assert!(p.manifest);
    assert_eq!(p.restore_pvcs.len(), 1, "the missing restore PVCs are made");
}

#[test]
fn template_sources_keep_a_manifest_and_name_no_vm() {
    let mut o = observed(available());
    o.export = export_of("VirtualMachineTemplate", "t1");
    o.export.spec.source.api_group = Some("template.kubevirt.io".into());
    o.kind = SourceKind::VirtualMachineTemplate;
    let p = decide(&o, &cfg(), now());
    assert!(p.manifest);
    assert_eq!(p.status.virtual_machine_name, None);
}

#[test]
fn the_ttl_deletes_the_export_in_any_phase() {
    for p in [
        None,
        Some(pod("Pending", false)),
        Some(pod("Succeeded", false)),
        Some(pod("Failed", false)),
    ] {
        let mut o = observed(available());
        o.pod = p;
        o.export.spec.ttl_duration = Some("30s".into());
        let p = decide(&o, &cfg(), now());
        assert!(p.expired);
        assert_eq!(p.pod, PodStep::Absent, "nothing else is done");
        assert!(p.create_service.is_none());
        assert!(p.events.is_empty());
    }
    // Before the expiry, the requeue is the expiry.
    let mut o = with_pod(observed(available()), pod("Running", true));
    o.export.spec.ttl_duration = Some("30s".into());
    let p = decide(&o, &cfg(), t0() + jiff::SignedDuration::from_secs(10));
    assert!(!p.expired);
    assert_eq!(p.requeue, Duration::from_secs(20));
}

#[test]
fn after_the_ttl_a_running_pod_finishes_its_downloads_within_the_wait() {
    let mut o = with_pod(observed(available()), pod("Running", true));
    o.export.spec.ttl_duration = Some("30s".into());
    let mut c = cfg();
    c.pod.ttl_transfer_wait = Duration::from_secs(3600);
    // 30 s after the expiry: not deleted, nothing made, no links, told once, requeued at the
    // end of the wait.
    let p = decide(&o, &c, now());
    assert!(!p.expired);
    assert_eq!(p.pod, PodStep::Absent);
    assert!(p.create_service.is_none() && p.token.is_none());
    assert_eq!(phase(&p), PHASE_TERMINATED);
    let (st, reason, msg) = ready_cond(&p);
    assert_eq!(
        (st.as_str(), reason.as_str()),
        ("False", REASON_WAITING_FOR_TRANSFERS)
    );
    assert!(
        msg.contains("2026-01-01T00:00:30Z") && msg.contains("2026-01-01T01:00:30Z"),
        "{msg}"
    );
    assert!(p.status.links.is_none());
    assert_eq!(reasons(&p), [REASON_WAITING_FOR_TRANSFERS]);
    assert_eq!(p.requeue, Duration::from_secs(3600 - 30));
    // The next pass with that status: the same status, no second event.
    o.export.status = Some(p.status.clone());
    let p2 = decide(&o, &c, now() + jiff::SignedDuration::from_secs(5));
    assert!(p2.events.is_empty());
    assert_eq!(p2.status, p.status);
    // The server exited (Succeeded): deleted.
    let mut done = o.clone();
    done.pod = Some(pod("Succeeded", false));
    assert!(decide(&done, &c, now()).expired);
    // The wait is over: deleted, even with the Pod running.
    assert!(decide(&o, &c, t0() + jiff::SignedDuration::from_secs(3630)).expired);
    // A terminating Pod or one this export does not control holds nothing.
    let mut term = pod("Running", true);
    term.metadata.deletion_timestamp = Some(Time(t0()));
    assert!(decide(&with_pod(o.clone(), term), &c, now()).expired);
    let mut foreign = pod("Running", true);
    foreign.metadata.owner_references = Some(vec![owner("other")]);
    assert!(decide(&with_pod(o.clone(), foreign), &c, now()).expired);
    // A zero wait restores deletion at the TTL.
    c.pod.ttl_transfer_wait = Duration::ZERO;
    assert!(decide(&o, &c, now()).expired);
}

#[test]
fn the_certificate_is_renewed_under_a_running_pod_when_due() {
    let o = with_pod(observed(available()), pod("Running", true));
    // Not due: kept, and the pass looks again one minute before renew-at, or at the TTL
    // (2 h after t0) when that comes first.
    let mut o2 = o.clone();
    o2.cert = Some(cert_meta("2026-01-01T00:31:00Z"));
    let p = decide(&o2, &cfg(), now());
    assert_eq!(p.cert, CertStep::Present);
    assert_eq!(p.pod, PodStep::Keep);
    assert_eq!(p.requeue, Duration::from_secs(29 * 60));
    let p = decide(&o, &cfg(), now());
    assert_eq!(p.requeue, Duration::from_secs(7200 - 60));
    // Due (within the minute): renewed in place; the Pod is kept.
    o2.cert = Some(cert_meta("2026-01-01T00:01:30Z"));
    let p = decide(&o2, &cfg(), now());
    assert_eq!(p.cert, CertStep::Renew);
    assert_eq!(p.pod, PodStep::Keep);
    assert!(p.events.is_empty());
    // Made by an older ucm (no annotation): renewed once.
    o2.cert = Some(meta(&naming::cert_secret_name("ex"), Some(UID)));
    assert_eq!(decide(&o2, &cfg(), now()).cert, CertStep::Renew);
    // Missing: issued again as before.
    o2.cert = None;
    assert_eq!(decide(&o2, &cfg(), now()).cert, CertStep::Present);
}

#[test]
fn an_invalid_ttl_is_told_once_at_initialisation() {
    let mut o = observed(available());
    o.export.spec.ttl_duration = Some("soon".into());
    let p = decide(&o, &cfg(), now());
    assert_eq!(reasons(&p), ["InvalidTTL"]);
    assert_eq!(p.events[0].action, "Initialize");
    // The next pass starts from the written status: no second event.
    o.export.status = Some(p.status.clone());
    assert!(decide(&o, &cfg(), now()).events.is_empty());
}

#[test]
fn an_unchanged_export_plans_the_status_it_has() {
    let o = with_pod(observed(available()), pod("Running", true));
    let p = decide(&o, &cfg(), now());
    let mut o2 = o.clone();
    o2.export.status = Some(p.status.clone());
    let later = now() + jiff::SignedDuration::from_secs(600);
    let p2 = decide(&o2, &cfg(), later);
    assert_eq!(p2.status, p.status, "no write, transition times kept");
    assert_eq!(p2.pod, PodStep::Keep);
    assert!(p2.create_service.is_none() && p2.events.is_empty());
}

#[test]
fn a_failed_create_turns_into_the_status() {
    let p = decide(&observed(available()), &cfg(), now());
    let f = condition(
        COND_READY,
        false,
        REASON_POD_CREATION_FAILED,
        "Pod virt-export-ex: forbidden",
    );
    let s = p.status_with(Some(&f));
    assert_eq!(s.phase.as_deref(), Some(PHASE_PENDING));
    let ready = &s.conditions.as_ref().unwrap()[0];
    assert_eq!(ready.reason.as_deref(), Some(REASON_POD_CREATION_FAILED));
    assert_eq!(s.links, None);
    assert_eq!(p.status_with(None), p.status);
}

#[test]
fn failures_are_told_each_time_and_conflicts_once() {
    let failed = condition(
        COND_READY,
        false,
        REASON_OBJECT_CREATION_FAILED,
        "Service x: boom",
    );
    let ev = failure_event(None, &failed).unwrap();
    assert_eq!(
        (ev.type_, ev.reason, ev.action),
        (EventType::Warning, REASON_OBJECT_CREATION_FAILED, "Create")
    );
    let mut old = VirtualMachineExportStatus {
        conditions: Some(vec![failed.clone()]),
        ..Default::default()
    };
    assert!(failure_event(Some(&old), &failed).is_some());

    let conflict = condition(COND_READY, false, "SecretConflict", "Secret ns/x ...");
    assert!(failure_event(Some(&old), &conflict).is_some());
    old.conditions = Some(vec![conflict.clone()]);
    assert!(failure_event(Some(&old), &conflict).is_none());
    // Pod creation failures have their event where the create fails.
    let pod_failed = condition(COND_READY, false, REASON_POD_CREATION_FAILED, "x");
    assert!(failure_event(None, &pod_failed).is_none());
}

// ---- Source resolution from the stores ----

fn stores(pvcs: Vec<PersistentVolumeClaim>, pods: Vec<Pod>) -> Stores {
    let (pvc_r, mut pvc_w) = reflector::store();
    for p in pvcs {
        pvc_w.apply_watcher_event(&watcher::Event::Apply(p));
    }
    let (pod_r, mut pod_w) = reflector::store();
    let claims = Arc::new(claim_index());
    claims.apply(&watcher::Event::Init);
    for p in pods {
        claims.apply(&watcher::Event::InitApply(p.clone()));
        pod_w.apply_watcher_event(&watcher::Event::Apply(p));
    }
    claims.apply(&watcher::Event::InitDone);
    Stores {
        pods: pod_r,
        claims,
        pvcs: pvc_r,
        services: reflector::store().0,
        secrets: reflector::store().0,
        ingresses: reflector::store().0,
        optional: Arc::new(Optional::default()),
    }
}

fn bound_pvc(name: &str) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: meta(name, None),
        spec: Some(PersistentVolumeClaimSpec {
            volume_mode: Some("Filesystem".into()),
            ..Default::default()
        }),
        status: Some(PersistentVolumeClaimStatus {
            phase: Some("Bound".into()),
            ..Default::default()
        }),
    }
}

fn user_of(claim: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "user", "namespace": "ns", "uid": "u"},
        "spec": {"containers": [], "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": claim}}]},
        "status": {"phase": "Running"},
    }))
    .unwrap()
}

#[test]
fn pvc_source_from_the_stores() {
    let e = export();
    let s = resolve_pvc(&stores(vec![], vec![]), &e);
    assert!(!s.available);
    assert_eq!(
        s.extra.as_ref().unwrap().reason.as_deref(),
        Some(REASON_PVC_NOT_FOUND)
    );
    assert_eq!(s.pause_message, "PersistentVolumeClaim ns/disk not found");

    let s = resolve_pvc(&stores(vec![bound_pvc("disk")], vec![]), &e);
    assert!(s.available);
    assert_eq!(s.volumes.len(), 1);
    assert_eq!(s.ready.reason.as_deref(), Some(REASON_INITIALIZING));

    let s = resolve_pvc(&stores(vec![bound_pvc("disk")], vec![user_of("disk")]), &e);
    assert!(!s.available);
    assert_eq!(s.ready.reason.as_deref(), Some(REASON_IN_USE));
    // ... but not by the export's own pod
    let mut own = user_of("disk");
    own.metadata.owner_references = Some(vec![owner(UID)]);
    let s = resolve_pvc(&stores(vec![bound_pvc("disk")], vec![own]), &e);
    assert!(s.available);

    let mut pending = bound_pvc("disk");
    pending.status.as_mut().unwrap().phase = Some("Pending".into());
    let s = resolve_pvc(&stores(vec![pending], vec![]), &e);
    assert!(
        s.available,
        "only a DataVolume decides whether a claim is populated"
    );
    assert_eq!(
        s.extra.as_ref().unwrap().reason.as_deref(),
        Some(REASON_PVC_PENDING)
    );
}

fn template(name: &str, ready: bool, volumes: serde_json::Value) -> kube::api::DynamicObject {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "template.kubevirt.io/v1beta1", "kind": "VirtualMachineTemplate",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {
            "parameters": [{"name": "SRC", "value": "golden"}, {"name": "NAME"}],
            "virtualMachine": {"spec": {
                "dataVolumeTemplates": [{"metadata": {"name": "${NAME}-root"}, "spec": {"source": {"pvc": {"name": "${SRC}"}}}}],
                "template": {"spec": {"volumes": volumes}},
            }},
        },
        "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    }))
    .unwrap()
}

#[test]
fn template_source_from_the_stores() {
    let mut e = export_of("VirtualMachineTemplate", "t1");
    e.spec.source.api_group = Some("template.kubevirt.io".into());
    let with = |pvcs: Vec<PersistentVolumeClaim>, tpls: Vec<kube::api::DynamicObject>| {
        let mut st = stores(pvcs, vec![]);
        st.optional = Arc::new(Optional::listed(
            crate::vmexport::optional::Kind::VirtualMachineTemplate,
            tpls,
        ));
        st
    };
    let reason = |s: &crate::vmexport::sources::Source| s.ready.reason.clone().unwrap();
    // without virt-template: waits for its API
    let s = resolve_template(&stores(vec![], vec![]), &e);
    assert_eq!(
        (s.phase_without_pod, reason(&s).as_str()),
        (PHASE_PENDING, REASON_SOURCE_API_NOT_INSTALLED)
    );
    assert!(
        s.ready
            .message
            .as_deref()
            .unwrap()
            .contains("template.kubevirt.io/v1beta1 or v1alpha1 VirtualMachineTemplate")
    );
    let s = resolve_template(&with(vec![], vec![]), &e);
    assert_eq!(
        (s.phase_without_pod, reason(&s).as_str()),
        (PHASE_SKIPPED, REASON_VM_TEMPLATE_NOT_FOUND)
    );
    assert_eq!(
        s.ready.message.as_deref(),
        Some("VirtualMachineTemplate ns/t1 not found")
    );
    let vols = serde_json::json!([
        {"name": "root", "dataVolume": {"name": "${NAME}-root"}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
        {"name": "again", "dataVolume": {"name": "data"}},
    ]);
    let s = resolve_template(&with(vec![], vec![template("t1", false, vols.clone())]), &e);
    assert_eq!(
        (s.phase_without_pod, reason(&s).as_str()),
        (PHASE_SKIPPED, REASON_VM_TEMPLATE_NOT_READY)
    );
    assert_eq!(
        s.ready.message.as_deref(),
        Some("VirtualMachineTemplate ns/t1 is not ready")
    );
    // Ready, no claim found yet: Skipped (no content); one found: Pending
    let s = resolve_template(&with(vec![], vec![template("t1", true, vols.clone())]), &e);
    assert_eq!(
        (s.phase_without_pod, reason(&s).as_str(), s.available),
        (PHASE_SKIPPED, REASON_VOLUMES_NOT_POPULATED, false)
    );
    assert_eq!(
        s.ready.message.as_deref(),
        Some("Not all volumes in VirtualMachineTemplate ns/t1 are populated")
    );
    let s = resolve_template(
        &with(
            vec![bound_pvc("golden")],
            vec![template("t1", true, vols.clone())],
        ),
        &e,
    );
    assert_eq!(
        (s.phase_without_pod, reason(&s).as_str()),
        (PHASE_PENDING, REASON_VOLUMES_NOT_POPULATED)
    );
    let s = resolve_template(
        &with(
            vec![bound_pvc("golden"), bound_pvc("data")],
            vec![template("t1", true, vols.clone())],
        ),
        &e,
    );
    assert!(s.available);
    let claims: Vec<&str> = s.volumes.iter().map(|v| v.pvc.as_str()).collect();
    assert_eq!(claims, ["golden", "data"], "each claim once");
    // claims in use by another Pod do not block it (upstream does not check)
    let mut st = with(
        vec![bound_pvc("golden"), bound_pvc("data")],
        vec![template("t1", true, vols)],
    );
    st.pods = stores(vec![], vec![user_of("golden")]).pods;
    assert!(resolve_template(&st, &e).available);
    // nothing to export: no DataVolume template cloning a claim, no claim volume
    let mut bare = template("t1", true, serde_json::json!([]));
    bare.data["spec"]["virtualMachine"]["spec"]["dataVolumeTemplates"] = serde_json::json!([]);
    let s = resolve_template(&with(vec![], vec![bare]), &e);
    assert_eq!(
        (s.phase_without_pod, reason(&s).as_str()),
        (PHASE_SKIPPED, REASON_VM_NO_VOLUMES)
    );
    assert_eq!(
        s.ready.message.as_deref(),
        Some("VirtualMachineTemplate ns/t1 has no volumes")
    );
    // the missing template is told once as a Warning event
    let s = resolve_template(&with(vec![], vec![]), &e);
    let ev = source_event(None, &s).unwrap();
    assert_eq!(ev.reason, REASON_VM_TEMPLATE_NOT_FOUND);
}

#[test]
fn vm_source_without_the_kubevirt_api_waits_for_it() {
    let e = export_of("VirtualMachine", "vm1");
    let s = resolve_vm(&stores(vec![], vec![]), &e);
    assert!(!s.available);
    assert_eq!(s.phase_without_pod, PHASE_PENDING);
    assert_eq!(
        s.ready.reason.as_deref(),
        Some(REASON_SOURCE_API_NOT_INSTALLED)
    );
}

#[test]
fn a_missing_source_is_a_warning_event_once() {
    let e = export();
    let missing = resolve_pvc(&stores(vec![], vec![]), &e);
    let p = decide(&observed(missing.clone()), &cfg(), now());
    let warned: Vec<_> = p
        .events
        .iter()
        .filter(|e| e.reason == REASON_PVC_NOT_FOUND)
        .collect();
    assert_eq!(warned.len(), 1, "{:?}", p.events);
    assert_eq!(warned[0].type_, EventType::Warning);
    assert_eq!(warned[0].note, "PersistentVolumeClaim ns/disk not found");
    // The next pass, with the condition already in the status: no second event.
    let mut o = observed(missing);
    o.export.status = Some(p.status.clone());
    let p2 = decide(&o, &cfg(), now());
    assert!(
        !reasons(&p2).contains(&REASON_PVC_NOT_FOUND),
        "{:?}",
        p2.events
    );
    // A source that is there: none.
    let p3 = decide(&observed(available()), &cfg(), now());
    assert!(!reasons(&p3).contains(&REASON_PVC_NOT_FOUND));
}

/// Status once per state a user sees (docs/vmexport.md, "Pass steps" step 8): the first pass
/// already shows the pod it creates as pending, so the passes its children's events bring, with
/// the pod pending, compute the very status it wrote (no second write); the ready pod changes it
/// once. No pass on the way emits an event.
#[test]
fn a_new_export_changes_status_once_per_state_and_emits_no_event() {
    let mut o = observed(available());
    (o.service, o.token, o.cert) = (None, None, None);
    let first = decide(&o, &cfg(), now());
    // Its write lands; the children and the pending pod appear in the caches.
    let mut o = with_pod(observed(available()), pod("Pending", false));
    o.export.status = Some(first.status.clone());
    let later = decide(&o, &cfg(), now() + jiff::SignedDuration::from_secs(1));
    assert_eq!(
        later.status, first.status,
        "a pass with nothing new writes nothing"
    );
    let mut o = with_pod(observed(available()), pod("Running", true));
    o.export.status = Some(first.status.clone());
    let ready = decide(&o, &cfg(), now() + jiff::SignedDuration::from_secs(2));
    assert_ne!(ready.status, first.status);
    assert_eq!(phase(&ready), PHASE_READY);
    for p in [&first, &later, &ready] {
        assert!(p.events.is_empty(), "{:?}", reasons(p));
    }
}

/// `--export-oci`: VM, snapshot and template exports carry `OCIReady`, `True/DigestsComputed`
/// only once a ready Pod serves the format; without the flag (or for a PVC) there is none, and a
/// stale or forged one is removed.
#[test]
fn oci_ready_follows_the_export_server_with_the_flag() {
    use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec};
    let oci_cfg = Settings { oci: true, ..cfg() };
    let vm = |p: Option<Pod>| {
        let mut o = observed(available());
        o.export = export_of("VirtualMachine", "vm1");
        o.export.spec.source.api_group = Some("kubevirt.io".into());
        o.kind = classify_source(&o.export.spec);
        o.pod = p;
        o
    };
    let oci = |p: &Decision| {
        p.status
            .conditions
            .as_ref()
            .unwrap()
            .iter()
            .find(|c| c.type_ == COND_OCI_READY)
            .map(|c| {
                (
                    c.status.clone(),
                    c.reason.clone().unwrap_or_default(),
                    c.message.clone().unwrap_or_default(),
                )
            })
    };
    let serving = |env: bool| {
        let mut p = pod("Running", true);
        p.spec = Some(PodSpec {
            containers: vec![Container {
                name: "exporter".into(),
                env: Some(if env {
                    vec![EnvVar {
                        name: "EXPORT_OCI_URI".into(),
                        value: Some(OCI_PATH.into()),
                        value_from: None,
                    }]
                } else {
                    Vec::new()
                }),
                ..Default::default()
            }],
            ..Default::default()
        });
        p
    };

    let p = decide(&vm(None), &oci_cfg, now());
    assert!(p.oci && p.pod == PodStep::Create);
    assert_eq!(
        oci(&p),
        Some(("False".into(), REASON_DIGESTS_PENDING.into(), String::new()))
    );
    let p = decide(&vm(Some(pod("Running", false))), &oci_cfg, now());
    assert_eq!(oci(&p).unwrap().1, REASON_DIGESTS_PENDING);
    let p = decide(&vm(Some(serving(true))), &oci_cfg, now());
    assert_eq!(
        oci(&p),
        Some(("True".into(), REASON_DIGESTS_COMPUTED.into(), String::new()))
    );
    let p = decide(&vm(Some(serving(false))), &oci_cfg, now());
    let (status, reason, msg) = oci(&p).unwrap();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", REASON_DIGESTS_PENDING)
    );
    assert!(msg.contains("without the oci format"), "{msg}");

    // without the flag: none, and a condition another writer left is removed
    let mut o = vm(Some(serving(true)));
    o.export.status = Some(p.status.clone());
    let p = decide(&o, &cfg(), now());
    assert!(!p.oci);
    assert_eq!(oci(&p), None);
    // a PVC export has no oci format
    let p = decide(&observed(available()), &oci_cfg, now());
    assert!(!p.oci);
    assert_eq!(oci(&p), None);
}

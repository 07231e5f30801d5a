//! The decisions of a VirtualMachineExport pass (docs/vmexport.md, "Pass steps"; the steps below
//! are its steps), as a pure function of what the pass observed: `decide(&Observed, &Settings, now) ->
//! Decision`. `run` observes (observe.rs, caches only), plans, and applies the plan (apply.rs); the
//! plan says which children to make, what to do with the export Pod and why, the events, the
//! status and when to look again. What only applying can tell (a create that fails) turns into
//! the status with [`Decision::status_with`]. Also here: when a child of the export's name is not
//! its own (a conflict, docs/vmexport.md, "Failures").

use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::ObjectMeta;
use kube::runtime::events::EventType;

use super::api::*;
use super::context::Settings;
use super::naming;
use super::objects::service::{build_service, service_conflict};
use super::objects::status::{
    PodState, condition, initial_status, phase_from_pod, pod_state, ttl_duration, ttl_expiration,
    until_expiry,
};
use super::sources::kind::{SourceKind, token_secret_ref_problem};
use super::sources::{Source, unavailable};
use super::types::{Condition, VirtualMachineExport, VirtualMachineExportStatus};
use crate::conditions::{remove_kubevirt, set_kubevirt_condition};
use crate::runtime::meta::controlled_by;

/// What a pass read, all from caches.
#[derive(Clone)]
pub struct Observed {
    pub export: VirtualMachineExport,
    pub kind: SourceKind,
    pub source: Source,
    /// The VirtualMachine a snapshot source was taken of.
    pub snapshot_vm: Option<String>,
    pub service: Option<ObjectMeta>,
    /// The default token Secret (used without spec.tokenSecretRef).
    pub token: Option<ObjectMeta>,
    pub cert: Option<ObjectMeta>,
    pub pod: Option<Pod>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlannedEvent {
    pub type_: EventType,
    pub reason: &'static str,
    pub action: &'static str,
    pub note: String,
}

/// The token Secret the pod mounts.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenStep {
    /// spec.tokenSecretRef: the user's Secret, never read nor written.
    Given(String),
    /// Ours, present.
    Present(String),
    Create(String),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CertStep {
    None,
    /// Before a new pod: valid for it (read, reissued if needed).
    Valid,
    /// While a pod runs: only a missing Secret is issued again.
    Present,
    /// While a pod runs, the certificate is due: reissued in place; the server reloads it and
    /// open connections keep the old one (docs/vmexport.md, "Certificates", rule 4).
    Renew,
}

#[derive(Clone, Debug, PartialEq)]
pub enum PodStep {
    /// No pod, and none to make.
    Absent,
    Create,
    Keep,
    /// Delete the observed pod (fenced on its uid), for this reason.
    Delete {
        uid: String,
        reason: &'static str,
    },
    /// A reason to delete it, but it is terminating already.
    Terminating,
}

#[derive(Clone, Debug)]
pub struct Decision {
    /// The TTL passed: delete the export, nothing else.
    pub expired: bool,
    pub events: Vec<PlannedEvent>,
    pub create_service: Option<Service>,
    pub restore_pvcs: Vec<PersistentVolumeClaim>,
    /// `None`: the token, manifest, certificate and pod steps are not reached.
    pub token: Option<TokenStep>,
    /// Ensure the manifest ConfigMap (VM and snapshot sources).
    pub manifest: bool,
    /// `--export-oci` and a source with an `oci` format (VM, snapshot, template): the Pod serves
    /// it and the status carries `OCIReady`.
    pub oci: bool,
    pub cert: CertStep,
    pub pod: PodStep,
    /// What already fails (a conflict); applying may add a failed create.
    pub failure: Option<Condition>,
    /// The status if applying adds no failure (links still to fill from `links_pod`).
    pub status: VirtualMachineExportStatus,
    /// The ready pod whose environment gives the links.
    pub links_pod: Option<Pod>,
    pub requeue: Duration,
    base: VirtualMachineExportStatus,
    pod_state: Option<PodState>,
    pod_name: String,
    source: Source,
    now: Time,
}

impl Decision {
    /// The status with `failure` in the Ready condition (or the pod's or the source's state).
    pub fn status_with(&self, failure: Option<&Condition>) -> VirtualMachineExportStatus {
        let mut status = self.base.clone();
        let (phase, ready) = match (failure, self.pod_state) {
            (Some(f), _) => (PHASE_PENDING, f.clone()),
            (None, Some(s)) => phase_from_pod(s, &self.pod_name),
            (None, None) => (self.source.phase_without_pod, self.source.ready.clone()),
        };
        let mut conds = status.conditions.take().unwrap_or_default();
        set_kubevirt_condition(&mut conds, ready, &self.now);
        match &self.source.extra {
            Some(c) => {
                set_kubevirt_condition(&mut conds, c.clone(), &self.now);
            }
            None => {
                remove_kubevirt(&mut conds, COND_PVC_READY);
            }
        }
        if self.oci {
            set_kubevirt_condition(&mut conds, self.oci_condition(failure.is_none()), &self.now);
        } else {
            remove_kubevirt(&mut conds, COND_OCI_READY);
        }
        status.conditions = Some(conds);
        status.phase = Some(phase.to_string());
        status.links = None;
        status
    }
}

impl Decision {
    /// `OCIReady`, as upstream: `True/DigestsComputed` once the export server is ready (it
    /// reports ready only after the digests), else `False/DigestsPending`. OURS: a ready Pod
    /// started without the format (its manifest could not be built, or the flag came later)
    /// says so instead of claiming digests it will never compute.
    fn oci_condition(&self, no_failure: bool) -> Condition {
        let Some(pod) = self.links_pod.as_ref().filter(|_| no_failure) else {
            return condition(COND_OCI_READY, false, REASON_DIGESTS_PENDING, "");
        };
        let serves = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.env.as_ref())
            .is_some_and(|e| e.iter().any(|v| v.name == "EXPORT_OCI_URI"));
        if serves {
            condition(COND_OCI_READY, true, REASON_DIGESTS_COMPUTED, "")
        } else {
            condition(
                COND_OCI_READY,
                false,
                REASON_DIGESTS_PENDING,
                format!(
                    "export server pod {} was started without the oci format; delete it to have it recreated with it",
                    self.pod_name
                ),
            )
        }
    }
}

/// A Warning event when the source is first found missing (`PVCNotFound`, `VMNotFound`,
/// `VMSnapshotNotFound`, `VMTemplateNotFound`): the user must create it or fix the name, and `kubectl describe` and
/// event-based alerting should say so. Once per transition: not while the old status already
/// carries that reason.
pub fn source_event(
    old: Option<&VirtualMachineExportStatus>,
    source: &super::sources::Source,
) -> Option<PlannedEvent> {
    const MISSING: [&str; 4] = [
        REASON_PVC_NOT_FOUND,
        REASON_VM_NOT_FOUND,
        REASON_VMSNAPSHOT_NOT_FOUND,
        REASON_VM_TEMPLATE_NOT_FOUND,
    ];
    if source.available {
        return None;
    }
    let cond = [Some(&source.ready), source.extra.as_ref()]
        .into_iter()
        .flatten()
        .find(|c| c.reason.as_deref().is_some_and(|r| MISSING.contains(&r)))?;
    let reason = MISSING
        .into_iter()
        .find(|r| cond.reason.as_deref() == Some(*r))?;
    let told = old
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.reason.as_deref() == Some(reason)));
    (!told).then(|| PlannedEvent {
        type_: EventType::Warning,
        reason,
        action: "Wait",
        note: cond.message.clone().unwrap_or_default(),
    })
}

/// The Warning event for the final failure, if any: a failed create each time, a conflict once
/// (when the condition first says so).
pub fn failure_event(
    old: Option<&VirtualMachineExportStatus>,
    f: &Condition,
) -> Option<PlannedEvent> {
    let reason = f.reason.as_deref()?;
    let reason: &'static str = if reason == REASON_OBJECT_CREATION_FAILED {
        REASON_OBJECT_CREATION_FAILED
    } else {
        Failed::CONFLICTS.iter().find(|c| **c == reason)?
    };
    let told = reason != REASON_OBJECT_CREATION_FAILED
        && old.and_then(|s| s.conditions.as_ref()).is_some_and(|cs| {
            cs.iter().any(|c| {
                c.type_ == COND_READY
                    && c.reason.as_deref() == Some(reason)
                    && c.message == f.message
            })
        });
    (!told).then(|| PlannedEvent {
        type_: EventType::Warning,
        reason,
        action: "Create",
        note: f.message.clone().unwrap_or_default(),
    })
}

pub fn decide(o: &Observed, cfg: &Settings, now_ts: jiff::Timestamp) -> Decision {
    let export = &o.export;
    let ns = export.namespace().unwrap_or_default();
    let name = export.name_any();
    let now = crate::conditions::time(now_ts);
    let created = export
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .unwrap_or(now_ts);
    let mut events = Vec::new();

    // Step 2: initialise.
    let (ttl, warn) = ttl_duration(&export.spec);
    let mut status = match &export.status {
        Some(s) if s.ttl_expiration_time.is_some() => s.clone(),
        other => {
            if let Some(w) = warn {
                events.push(PlannedEvent {
                    type_: EventType::Warning,
                    reason: "InvalidTTL",
                    action: "Initialize",
                    note: w,
                });
            }
            let mut s = initial_status(ttl_expiration(created, ttl), &now);
            if let Some(o) = other {
                s.token_secret_ref = o.token_secret_ref.clone();
            }
            s
        }
    };
    // What this pass computes replaces whatever the status says (another writer's values
    // included): the TTL from the creation time, and the one token name ucm uses.
    let expiry = ttl_expiration(created, ttl);
    status.ttl_expiration_time = Some(Time(expiry));
    if status.token_secret_ref.is_some() {
        status.token_secret_ref = Some(
            export
                .spec
                .token_secret_ref
                .clone()
                .unwrap_or_else(|| naming::token_secret_name(&name)),
        );
    }

    let mut plan = Decision {
        expired: false,
        events,
        create_service: None,
        restore_pvcs: Vec::new(),
        token: None,
        manifest: false,
        oci: cfg.oci
            && matches!(
                o.kind,
                SourceKind::VirtualMachine
                    | SourceKind::VirtualMachineSnapshot
                    | SourceKind::VirtualMachineTemplate
            ),
        cert: CertStep::None,
        pod: PodStep::Absent,
        failure: None,
        status: VirtualMachineExportStatus::default(),
        links_pod: None,
        requeue: Duration::ZERO,
        base: VirtualMachineExportStatus::default(),
        pod_state: None,
        pod_name: naming::pod_name(&name),
        source: unavailable(PHASE_PENDING, REASON_INITIALIZING, String::new()),
        now,
    };

    // Step 3: TTL, in any phase, whether or not a pod exists; a running export Pod may still
    // be serving downloads, which it finishes before it exits (bounded by the flag).
    let Some(until) = until_expiry(now_ts, expiry) else {
        match transfers_may_run(o, cfg, expiry, now_ts) {
            None => plan.expired = true,
            Some((left, until)) => {
                wait_for_transfers(&mut plan, &mut status, export.status.as_ref(), left, until);
            }
        }
        return plan;
    };
    plan.requeue = until.max(Duration::from_millis(1));

    // Step 5: the Service, even without a source.
    match &o.service {
        None => plan.create_service = Some(build_service(export)),
        Some(meta) => {
            let existing = Service {
                metadata: meta.clone(),
                ..Default::default()
            };
            if let Some(msg) = service_conflict(&existing, export) {
                plan.failure = Some(condition(
                    COND_READY,
                    false,
                    REASON_OBJECT_CREATION_FAILED,
                    msg,
                ));
            }
        }
    }
    status.service_name = Some(naming::service_name(&name));

    // Step 4: the source.
    let source = match token_secret_ref_problem(&export.spec) {
        Some(msg) => unavailable(PHASE_SKIPPED, REASON_INVALID_TOKEN_SECRET_REF, msg),
        None => o.source.clone(),
    };
    match o.kind {
        SourceKind::VirtualMachine => {
            status.virtual_machine_name = Some(export.spec.source.name.clone());
        }
        SourceKind::VirtualMachineSnapshot if o.snapshot_vm.is_some() => {
            status.virtual_machine_name = o.snapshot_vm.clone();
        }
        _ => {}
    }
    if let Some(t) = &export.spec.token_secret_ref {
        status.token_secret_ref = Some(t.clone());
    }
    plan.restore_pvcs = source.create_pvcs.clone();

    // Step 6: token, certificate, pod. A Pod of that name this export does not control is
    // neither used, nor deleted, nor reported as ours.
    let pod_name = naming::pod_name(&name);
    let mut pod = o.pod.clone();
    if let Some(f) = pod.as_ref().and_then(|p| {
        conflict(
            REASON_POD_CONFLICT,
            "Pod",
            &p.metadata,
            export,
            "Delete or rename it, or rename this export",
        )
    }) {
        pod = None;
        plan.failure.get_or_insert_with(|| f.condition());
    }
    if source.available && !source.volumes.is_empty() && plan.failure.is_none() {
        let token = match &export.spec.token_secret_ref {
            Some(t) => Some(TokenStep::Given(t.clone())),
            None => {
                let n = naming::token_secret_name(&name);
                status.token_secret_ref = Some(n.clone());
                match &o.token {
                    None => Some(TokenStep::Create(n)),
                    Some(meta) => {
                        match conflict(REASON_SECRET_CONFLICT, "Secret", meta, export, TOKEN_ADVICE)
                        {
                            Some(f) => {
                                plan.failure = Some(f.condition());
                                None
                            }
                            None => Some(TokenStep::Present(n)),
                        }
                    }
                }
            }
        };
        plan.manifest = matches!(
            o.kind,
            SourceKind::VirtualMachine
                | SourceKind::VirtualMachineSnapshot
                | SourceKind::VirtualMachineTemplate
        );
        let cert_conflict = o
            .cert
            .as_ref()
            .and_then(|m| conflict(REASON_SECRET_CONFLICT, "Secret", m, export, CERT_ADVICE));
        if token.is_some() && pod.is_none() && plan.failure.is_none() {
            match cert_conflict {
                Some(f) => plan.failure = Some(f.condition()),
                None => {
                    plan.cert = CertStep::Valid;
                    plan.pod = PodStep::Create;
                }
            }
        } else if pod.is_some() && plan.failure.is_none() {
            match cert_conflict {
                Some(f) => plan.failure = Some(f.condition()),
                None => {
                    plan.cert = match renew_in(o.cert.as_ref(), now_ts) {
                        Some(d) if d > Duration::ZERO => {
                            plan.requeue = plan.requeue.min(d);
                            CertStep::Present
                        }
                        _ if o.cert.is_some() => CertStep::Renew,
                        _ => CertStep::Present,
                    }
                }
            }
        }
        plan.token = token;
    }

    // Step 7: pause, completion, changed certificate parameters.
    if plan.pod == PodStep::Create {
        plan.pod_state = Some(PodState::Pending);
    }
    if let Some(p) = &pod {
        let state = pod_state(p);
        plan.pod_state = Some(state);
        plan.pod = PodStep::Keep;
        let phase = p.status.as_ref().and_then(|s| s.phase.clone());
        let delete = if !source.available {
            Some(("ExportPaused", source.pause_message.clone()))
        } else if matches!(phase.as_deref(), Some("Succeeded" | "Failed")) {
            Some((
                "ExporterPodFailedOrCompleted",
                format!(
                    "Exporter pod {ns}/{pod_name} is in phase {}",
                    phase.unwrap_or_default()
                ),
            ))
        } else if p.annotations().get(ANN_CERT_PARAMS) != Some(&cfg.pod.cert_params()) {
            Some((
                "CertificateParametersChanged",
                "Exporter TLS certificate parameters updated".to_string(),
            ))
        } else {
            None
        };
        if let Some((reason, note)) = delete {
            plan.pod = if p.metadata.deletion_timestamp.is_none() {
                plan.events.push(PlannedEvent {
                    type_: EventType::Warning,
                    reason,
                    action: "Delete",
                    note,
                });
                PodStep::Delete {
                    uid: p.uid().unwrap_or_default(),
                    reason,
                }
            } else {
                PodStep::Terminating
            };
            // A finished pod still shapes this pass's status (Terminated); others do not.
            if reason != "ExporterPodFailedOrCompleted" {
                plan.pod_state = None;
            }
        }
        if plan.pod_state == Some(PodState::Ready) {
            plan.links_pod = Some(p.clone());
        }
    }

    plan.base = status;
    plan.events
        .extend(source_event(export.status.as_ref(), &source));
    plan.source = source;
    plan.status = plan.status_with(plan.failure.as_ref());
    if plan.failure.is_some() {
        plan.links_pod = None;
    }
    plan
}

/// How long until the cached serving-certificate Secret is due for renewal (one minute before
/// its `ucm.io/renew-at`); `None` when it does not say (made by an older ucm: renewed now).
fn renew_in(cert: Option<&ObjectMeta>, now: jiff::Timestamp) -> Option<Duration> {
    let at: jiff::Timestamp = cert?
        .annotations
        .as_ref()?
        .get(ANN_CERT_RENEW_AT)?
        .parse()
        .ok()?;
    let due = at.checked_sub(jiff::SignedDuration::from_mins(1)).ok()?;
    Some(if due > now {
        Duration::try_from(due.duration_since(now)).unwrap_or(Duration::ZERO)
    } else {
        Duration::ZERO
    })
}

/// After the TTL: the time left for downloads in flight, and until when, while this export's
/// own Pod runs (the server stops taking requests at its DEADLINE, the TTL, and exits when the
/// last one ends; docs/vmexport.md, "TTL", rule 4). `None`: delete now.
fn transfers_may_run(
    o: &Observed,
    cfg: &Settings,
    expiry: jiff::Timestamp,
    now: jiff::Timestamp,
) -> Option<(Duration, jiff::Timestamp)> {
    let p = o.pod.as_ref()?;
    let running = p.metadata.deletion_timestamp.is_none()
        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        && controlled_by(&p.metadata, &o.export.uid().unwrap_or_default());
    let wait = jiff::SignedDuration::try_from(cfg.pod.ttl_transfer_wait).ok()?;
    let until = expiry.checked_add(wait).ok()?;
    (running && now < until).then(|| {
        (
            Duration::try_from(until.duration_since(now)).unwrap_or(Duration::ZERO),
            until,
        )
    })
}

/// The status while the deletion waits for downloads: `Terminated` (no new download starts),
/// `Ready=False/WaitingForTransfers` saying until when, no links; told once as an event.
fn wait_for_transfers(
    plan: &mut Decision,
    status: &mut VirtualMachineExportStatus,
    old: Option<&VirtualMachineExportStatus>,
    left: Duration,
    until: jiff::Timestamp,
) {
    let expiry = status
        .ttl_expiration_time
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    let msg = format!(
        "The TTL expired at {expiry}: no new downloads start, and the export is deleted once the downloads in flight finish, at {until} at the latest (--export-ttl-transfer-wait)"
    );
    let told = old.and_then(|s| s.conditions.as_ref()).is_some_and(|cs| {
        cs.iter().any(|c| {
            c.type_ == COND_READY && c.reason.as_deref() == Some(REASON_WAITING_FOR_TRANSFERS)
        })
    });
    if !told {
        plan.events.push(PlannedEvent {
            type_: EventType::Normal,
            reason: REASON_WAITING_FOR_TRANSFERS,
            action: "Delete",
            note: msg.clone(),
        });
    }
    let mut conds = status.conditions.take().unwrap_or_default();
    set_kubevirt_condition(
        &mut conds,
        condition(COND_READY, false, REASON_WAITING_FOR_TRANSFERS, msg),
        &plan.now,
    );
    status.conditions = Some(conds);
    status.phase = Some(PHASE_TERMINATED.to_string());
    status.links = None;
    plan.status = status.clone();
    plan.base = status.clone();
    plan.requeue = left.max(Duration::from_millis(1));
}

// ---- Conflicts ("Failures") ----

pub(super) const REASON_SECRET_CONFLICT: &str = "SecretConflict";
pub(super) const REASON_CONFIGMAP_CONFLICT: &str = "ConfigMapConflict";
pub(super) const REASON_POD_CONFLICT: &str = "PodConflict";

/// Why a child could not be made: `ObjectCreationFailed` (an API error), or a conflict: an object
/// of the child's name exists that this export does not control. ucm never writes such an object
/// (it may belong to someone else) and reports it until it is gone (docs/vmexport.md, "Failures").
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Failed {
    pub reason: &'static str,
    pub message: String,
}

impl From<String> for Failed {
    fn from(message: String) -> Failed {
        Failed {
            reason: REASON_OBJECT_CREATION_FAILED,
            message,
        }
    }
}

impl Failed {
    pub fn condition(self) -> Condition {
        condition(COND_READY, false, self.reason, self.message)
    }

    /// The reasons of a conflict (told once).
    pub const CONFLICTS: [&'static str; 3] = [
        REASON_SECRET_CONFLICT,
        REASON_CONFIGMAP_CONFLICT,
        REASON_POD_CONFLICT,
    ];
}

/// The conflict for an existing `kind` object this export does not control.
pub(super) fn conflict(
    reason: &'static str,
    kind: &str,
    meta: &ObjectMeta,
    export: &VirtualMachineExport,
    advice: &str,
) -> Option<Failed> {
    (!controlled_by(meta, &export.uid().unwrap_or_default())).then(|| Failed {
        reason,
        message: format!(
            "{kind} {}/{} already exists and is not controlled by this VirtualMachineExport; ucm leaves it untouched. {advice}",
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default(),
        ),
    })
}

pub(super) const TOKEN_ADVICE: &str =
    "Delete or rename it, or name a Secret of yours in spec.tokenSecretRef";
pub(super) const CERT_ADVICE: &str = "Delete or rename it, or rename this export";

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;

//! IO side of the VirtualMachineExport reconciler (vmexport.md §6): read the source and the
//! children, create what is missing, write the status once at the end of every pass (also when
//! a create failed, #19020), and requeue exactly at the TTL expiry.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::Ingress;
use kube::api::{DeleteParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Resource, ResourceExt};
use prometheus::{IntCounter, IntGaugeVec, Opts};

use super::build::*;
use super::certs::{self, Pem};
use super::children::{
    Failed, REASON_POD_CONFLICT, conflict, ensure_cert, ensure_cert_present, ensure_manifest,
    ensure_service, ensure_token,
};
use super::naming;
use super::optional::{self, Kind, Optional};
use super::podcache::{ClaimIndex, slim_pod};
use super::sources::*;
use super::types::{Condition, VirtualMachineExport, VirtualMachineExportStatus};
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
    fn own_metric_labels() -> &'static [&'static str] {
        &["ca"]
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
    /// Slim Pods (podcache.rs) and their claim index.
    pub pods: Store<Pod>,
    pub claims: Arc<ClaimIndex>,
    pub pvcs: Store<PersistentVolumeClaim>,
    /// Ingresses in the manager's namespace: the one routing to `ucm export-proxy` gives the
    /// external host when `--export-external-host` is not set.
    pub ingresses: Store<Ingress>,
    pub optional: Arc<Optional>,
    ca: tokio::sync::Mutex<Option<Pem>>,
    pub ttl_deletions: IntCounter,
    failures: Mutex<BTreeMap<String, u32>>,
}

pub(super) fn is_already_exists(e: &WriteError) -> bool {
    matches!(e, WriteError::Kube(kube::Error::Api(s)) if s.code == 409 && s.reason == "AlreadyExists")
}

pub(super) fn object_ref(e: &VirtualMachineExport) -> ObjectReference {
    e.object_ref(&())
}

impl Context {
    pub(super) fn client(&self) -> kube::Client {
        self.writer.client().clone()
    }

    /// The external host and the CA users should trust: `--export-external-host` with
    /// `--export-external-ca-file`, else the host of the Ingress that routes to the export proxy
    /// with the CA of its TLS Secret ("" without TLS), as KubeVirt finds its proxy's Ingress.
    pub(super) async fn external(&self) -> Option<(String, String)> {
        if let Some(h) = &self.cfg.external_host {
            return Some((h.clone(), self.cfg.external_ca.clone()));
        }
        let ings = self.ingresses.state();
        let (host, secret) =
            external_from_ingresses(ings.iter().map(|i| i.as_ref()), super::proxy::SERVICE)?;
        let cert = match secret {
            Some(name) => {
                let api: Api<Secret> = Api::namespaced(self.client(), &self.cfg.manager_namespace);
                match api.get_opt(&name).await {
                    Ok(Some(s)) => ingress_ca(&s),
                    Ok(None) => String::new(),
                    Err(e) => {
                        tracing::warn!(secret = %name, error = %e, "cannot read the proxy Ingress's TLS Secret");
                        String::new()
                    }
                }
            }
            None => String::new(),
        };
        Some((host, cert))
    }

    /// The CA: read; on NotFound create; on AlreadyExists (another leader won) read again.
    /// An existing CA is never overwritten (§7.4.1).
    pub(super) async fn ca(&self) -> Result<Pem, Error> {
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

pub async fn reconcile(
    export: Arc<VirtualMachineExport>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    if export.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    // Decisions need the pod and claim caches: before their initial list an empty cache would
    // read as "claim not found" and pause a running export.
    if !store_ready(&ctx.pods) || !ctx.claims.is_ready() || !store_ready(&ctx.pvcs) {
        return Ok(Action::requeue(Duration::from_millis(200)));
    }
    let ns = export.namespace().unwrap_or_default();
    let name = export.name_any();
    let now_ts = jiff::Timestamp::now();
    let now = crate::conditions::truncate(now_ts);
    let created = export
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .unwrap_or(now_ts);
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
            let mut s = initial_status(ttl_expiration(created, ttl), &now);
            if let Some(o) = other {
                s.token_secret_ref = o.token_secret_ref.clone();
            }
            s
        }
    };
    // What this pass computes replaces whatever the status says (another writer's values
    // included, issue 21): the TTL from the creation time, and the one token name ucm uses.
    status.ttl_expiration_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        ttl_expiration(created, ttl_duration(&export.spec).0),
    ));
    if status.token_secret_ref.is_some() {
        status.token_secret_ref = Some(
            export
                .spec
                .token_secret_ref
                .clone()
                .unwrap_or_else(|| naming::token_secret_name(&name)),
        );
    }
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
    let source = match token_secret_ref_problem(&export.spec) {
        Some(msg) => unavailable(PHASE_SKIPPED, REASON_INVALID_TOKEN_SECRET_REF, msg),
        None => source,
    };
    if let Some(t) = &export.spec.token_secret_ref {
        status.token_secret_ref = Some(t.clone());
    }

    // Step 6: token, certificate, pod.
    let pod_name = naming::pod_name(&name);
    let mut pod = pods.get_opt(&pod_name).await?;
    // A Pod of that name this export does not control is neither used, nor deleted, nor
    // reported as ours.
    if let Some(f) = pod.as_ref().and_then(|p| {
        conflict(
            REASON_POD_CONFLICT,
            "Pod",
            &p.metadata,
            &export,
            "Delete or rename it, or rename this export",
        )
    }) {
        pod = None;
        failure.get_or_insert_with(|| f.condition());
    }
    if source.available && !source.volumes.is_empty() && failure.is_none() {
        let token_name = match &export.spec.token_secret_ref {
            Some(t) => Some(t.clone()),
            None => {
                let n = naming::token_secret_name(&name);
                status.token_secret_ref = Some(n.clone());
                match ensure_token(&ctx, &export, &n).await {
                    Ok(()) => Some(n),
                    Err(f) => {
                        failure = Some(f.condition());
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
                Err(f) => failure = Some(f.condition()),
            }
        }
        if let (Some(token_name), None, None) = (token_name, &pod, &failure) {
            let ca = ctx.ca().await?;
            match ensure_cert(&ctx, &export, &ca).await {
                Err(f) => failure = Some(f.condition()),
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
        } else if pod.is_some() && failure.is_none() {
            // A running pod keeps its certificate; only a deleted Secret is issued again, so
            // that the next pod (and the kubelet's remount) finds one.
            let ca = ctx.ca().await?;
            if let Err(f) = ensure_cert_present(&ctx, &export, &ca).await {
                failure = Some(f.condition());
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

    if let Some(f) = &failure
        && let Some(reason) = f.reason.as_deref()
        && (reason == REASON_OBJECT_CREATION_FAILED || Failed::is_conflict(reason))
    {
        // A conflict is told once, when the condition first says so.
        let told = old_status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                Failed::is_conflict(reason)
                    && cs.iter().any(|c| {
                        c.type_ == COND_READY
                            && c.reason.as_deref() == Some(reason)
                            && c.message == f.message
                    })
            });
        if !told {
            ctx.writer
                .event(
                    &oref,
                    EventType::Warning,
                    reason,
                    "Create",
                    f.message.clone().unwrap_or_default(),
                )
                .await;
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
            let external = ctx.external().await;
            Some(links_from_pod(
                p,
                &LinkSettings {
                    namespace: ns.clone(),
                    export_name: name.clone(),
                    service_name: naming::service_name(&name),
                    internal_cert: ca.cert,
                    external_cert: external.as_ref().map(|e| e.1.clone()).unwrap_or_default(),
                    external_host: external.map(|e| e.0),
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
    // A merge patch of the difference, with nulls for what this pass no longer reports (a
    // forged `links`), so the whole computed status is what the object ends up with.
    let Some(patch) = crate::runtime::writer::status_merge_patch(export.status.as_ref(), status)
    else {
        return Ok(());
    };
    let rv = export.resource_version().unwrap_or_default();
    ctx.writer
        .merge_status_fenced(api, &export.name_any(), &rv, &patch)
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

    // Pods: slim copies (§4.2) and the claim index, both fed by one watch.
    let claims = Arc::new(ClaimIndex::default());
    let (pod_store, pod_writer) = reflector::store::<Pod>();
    let pods_synced = rt.track_synced("vmexport-pods");
    let ix = Arc::clone(&claims);
    let pod_events = watcher(rt.watched::<Pod>(), watcher::Config::default())
        .default_backoff()
        .modify(slim_pod)
        .inspect(move |ev| {
            if matches!(ev, Ok(watcher::Event::InitDone)) {
                pods_synced();
            }
        })
        .reflect(pod_writer)
        .inspect(move |ev| {
            if let Ok(ev) = ev {
                ix.apply(ev);
            }
        })
        .touched_objects();
    let (pvc_store, pvc_events) = rt.reflect::<PersistentVolumeClaim>(
        "vmexport-pvcs",
        rt.watched(),
        watcher::Config::default(),
    );
    // Only the manager's namespace: that is where the proxy and its Ingress live.
    let (ingress_store, ingress_events) = rt.reflect::<Ingress>(
        "vmexport-ingresses",
        Api::namespaced(rt.client.clone(), &cfg.manager_namespace),
        watcher::Config::default(),
    );
    let controller = rt.controller::<VirtualMachineExport>(
        CONTROLLER,
        rt.watched(),
        watcher::Config::default(),
        // A status another writer changed is corrected at once (issue 21); our own writes
        // trigger nothing.
        Trigger::SpecFinalizersAndForeignStatus,
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
    let s4 = store.clone();
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
        // The external host changes with the proxy's Ingress: every export's links may change.
        .watches_stream(ingress_events.boxed(), move |_: Ingress| {
            s4.state()
                .iter()
                .map(|e| ObjectRef::from_obj(e.as_ref()))
                .collect::<Vec<_>>()
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
        claims,
        pvcs: pvc_store,
        ingresses: ingress_store,
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

//! IO side of the VirtualMachineExport reconciler (docs/vmexport.md, "Pass steps"): observe the
//! export's source and children in the caches, `plan` (plan.rs, pure) and apply the plan: create
//! what is missing, delete what must go, write the status once at the end of every pass (also when
//! a create failed, #19020), and requeue exactly at the TTL expiry.
//!
//! A pass on an unchanged export sends no request: the Service, the Secrets (metadata), the
//! Pod and the source all come from the watches that trigger passes. Reads that remain: the
//! serving certificate's Secret before a pod is made (its certificate decides the reissue and
//! the pod's deadline), the manifest ConfigMap of VM and snapshot sources, the CA once per
//! process, and the proxy Ingress's TLS Secret for external links.

use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::Ingress;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, ResourceExt};
use prometheus::{IntCounter, IntGaugeVec, Opts};

use super::build::*;
use super::children::{create_service, create_token, ensure_cert, ensure_manifest};
pub use super::context::{Config, Context, Error, Stores};
use super::context::{Created, object_ref};
use super::naming;
use super::optional::{self, Kind, Optional};
use super::plan::{
    CertStep, Observed, Plan, PlannedEvent, PodStep, TokenStep, failure_event, plan,
};
use super::podcache::{ClaimIndex, SlimPod, slim_pod, unwrap_event};
use super::sources::*;
use super::types::{Condition, VirtualMachineExport, VirtualMachineExportStatus};
use crate::runtime::controller::{self as rtc, Guarded};
use crate::runtime::{Runtime, Trigger};

pub const CONTROLLER: &str = "vmexport";
/// OURS: the error backoff cap is lower than the runtime default (docs/vmexport.md, "Triggers").
const BACKOFF_CAP: Duration = Duration::from_secs(60);

fn store_ready<K: kube::runtime::reflector::Lookup + Clone + 'static>(store: &Store<K>) -> bool
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    use futures::FutureExt;
    matches!(store.wait_until_ready().now_or_never(), Some(Ok(())))
}

/// What the caches say about `export`: its source and its children. Sends no request.
pub(super) fn observe(ctx: &Context, export: &VirtualMachineExport) -> Observed {
    let st = &ctx.stores;
    let ns = export.namespace().unwrap_or_default();
    let name = export.name_any();
    let kind = classify_source(&export.spec);
    let (source, snapshot_vm) = match kind {
        SourceKind::Pvc => (resolve_pvc(st, export), None),
        SourceKind::Unsupported => (
            unavailable(
                PHASE_SKIPPED,
                REASON_UNSUPPORTED_SOURCE,
                unsupported_source_message(&export.spec),
            ),
            None,
        ),
        SourceKind::VirtualMachine => (resolve_vm(st, export), None),
        SourceKind::VirtualMachineSnapshot => resolve_snapshot(st, export),
    };
    let meta = |c: Created| match c {
        Created::Meta(m) => Some(*m),
        Created::Pod(_) => None,
    };
    let secret = |n: String| {
        let cached = st.secret(&ns, &n);
        ctx.recent.overlay("Secret", &ns, &n, cached, meta)
    };
    let svc = naming::service_name(&name);
    let pod = naming::pod_name(&name);
    Observed {
        export: export.clone(),
        kind,
        source,
        snapshot_vm,
        service: ctx
            .recent
            .overlay("Service", &ns, &svc, st.service(&ns, &svc), meta),
        token: secret(naming::token_secret_name(&name)),
        cert: secret(naming::cert_secret_name(&name)),
        pod: ctx
            .recent
            .overlay("Pod", &ns, &pod, st.pod(&ns, &pod), |c| match c {
                Created::Pod(p) => Some(*p),
                Created::Meta(_) => None,
            }),
    }
}

pub async fn reconcile(
    export: Arc<VirtualMachineExport>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    if export.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    // Decisions need the caches: before their initial list an empty cache would read as
    // "claim not found" and pause a running export, or as "no Service" and create one.
    let st = &ctx.stores;
    if !store_ready(&st.pods)
        || !st.claims.is_ready()
        || !store_ready(&st.pvcs)
        || !store_ready(&st.services)
        || !store_ready(&st.secrets)
    {
        return Ok(Action::requeue(Duration::from_millis(200)));
    }
    let now = jiff::Timestamp::now();
    let mut observed = observe(&ctx, &export);
    let mut plan = plan(&observed, &ctx.cfg, now);
    // Restore PVCs of a snapshot source come first: the source is what they make.
    if let Err(msg) = create_restore_pvcs(&ctx, &export, &plan.restore_pvcs).await {
        observed.source = restore_failed(msg);
        plan = super::plan::plan(&observed, &ctx.cfg, now);
    }
    apply(&ctx, &export, &observed, &plan).await
}

async fn create_restore_pvcs(
    ctx: &Context,
    export: &VirtualMachineExport,
    pvcs: &[PersistentVolumeClaim],
) -> Result<(), String> {
    let api: Api<PersistentVolumeClaim> =
        Api::namespaced(ctx.client.clone(), &export.namespace().unwrap_or_default());
    for pvc in pvcs {
        match ctx.writer.create(&api, pvc).await {
            Ok(_) => {}
            Err(e) if e.is_already_exists() => {}
            Err(e) => return Err(format!("PersistentVolumeClaim {}: {e}", pvc.name_any())),
        }
    }
    Ok(())
}

async fn emit(ctx: &Context, export: &VirtualMachineExport, ev: &PlannedEvent) {
    ctx.writer
        .event(
            &object_ref(export),
            ev.type_,
            ev.reason,
            ev.action,
            ev.note.clone(),
        )
        .await;
}

/// Applies `plan`: the children in order (a failure stops what depends on it), the pod, the
/// status, and the requeue.
async fn apply(
    ctx: &Context,
    export: &VirtualMachineExport,
    observed: &Observed,
    plan: &Plan,
) -> Result<Action, Error> {
    let ns = export.namespace().unwrap_or_default();
    let name = export.name_any();
    for ev in &plan.events {
        emit(ctx, export, ev).await;
    }
    if plan.expired {
        return delete_expired(ctx, export).await;
    }
    let mut failure: Option<Condition> = plan.failure.clone();
    let fail = |msg: String| condition(COND_READY, false, REASON_OBJECT_CREATION_FAILED, msg);

    if let Some(svc) = &plan.create_service
        && let Err(msg) = create_service(ctx, export, svc).await
    {
        failure = Some(fail(msg));
    }
    let pod_name = naming::pod_name(&name);
    let mut stale_pod = false;
    if let (Some(token), None) = (&plan.token, &failure) {
        let token_ok = match token {
            TokenStep::Given(_) | TokenStep::Present(_) => true,
            TokenStep::Create(n) => match create_token(ctx, export, n).await {
                Ok(()) => true,
                Err(f) => {
                    failure = Some(f.condition());
                    false
                }
            },
        };
        let mut vm_manifest = false;
        if plan.manifest {
            match ensure_manifest(ctx, export, observed.kind, &observed.source.volumes).await {
                Ok(ok) => vm_manifest = ok,
                Err(f) => failure = Some(f.condition()),
            }
        }
        let token_name = match token {
            TokenStep::Given(n) | TokenStep::Present(n) | TokenStep::Create(n) => n,
        };
        match plan.cert {
            CertStep::Valid if token_ok && failure.is_none() => {
                let ca = ctx.ca().await?;
                match ensure_cert(ctx, export, &ca, observed.cert.as_ref()).await {
                    Err(f) => failure = Some(f.condition()),
                    Ok(not_after) => {
                        let expiry = plan
                            .status
                            .ttl_expiration_time
                            .as_ref()
                            .map(|t| t.0)
                            .unwrap_or_default();
                        let volumes = dedup_volumes(observed.source.volumes.clone());
                        let input = PodInput {
                            export,
                            volumes: &volumes,
                            token_secret: token_name,
                            cert_secret: &naming::cert_secret_name(&name),
                            deadline: deadline(not_after, ctx.cfg.pod.cert_renew_before, expiry),
                            vm_manifest,
                        };
                        match create_pod(ctx, export, &build_pod(&input, &ctx.cfg.pod)).await {
                            Ok(true) => {}
                            Ok(false) => stale_pod = true,
                            Err(msg) => {
                                failure = Some(condition(
                                    COND_READY,
                                    false,
                                    REASON_POD_CREATION_FAILED,
                                    msg,
                                ))
                            }
                        }
                    }
                }
            }
            // A running pod keeps its certificate; only a deleted Secret is issued again, so
            // that the next pod (and the kubelet's remount) finds one. (The plan checked that
            // a cached one is ours.)
            CertStep::Present if failure.is_none() && observed.cert.is_none() => {
                let ca = ctx.ca().await?;
                if let Err(f) = ensure_cert(ctx, export, &ca, None).await {
                    failure = Some(f.condition());
                }
            }
            _ => {}
        }
    }

    if let PodStep::Delete { uid, .. } = &plan.pod {
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
        ctx.writer
            .delete(&pods, &pod_name, Some(uid))
            .await
            .map_err(|e| Error::DeletePod(pod_name.clone(), e))?;
    }
    if stale_pod {
        // The pod exists but the cache does not show it yet: its watch event brings the next
        // pass; the status waits for it.
        return Err(Error::Reported {
            until: plan.requeue,
        });
    }

    if let Some(f) = &failure
        && let Some(ev) = failure_event(export.status.as_ref(), f)
    {
        emit(ctx, export, &ev).await;
    }
    let mut status = if failure == plan.failure {
        plan.status.clone()
    } else {
        plan.status_with(failure.as_ref())
    };
    if let (Some(p), None) = (&plan.links_pod, &failure) {
        status.links = Some(links(ctx, export, observed.kind, p).await?);
    }
    if export.status.as_ref() != Some(&status) {
        write_status(ctx, export, &status).await?;
    }
    match failure {
        // The status says what failed; the runtime's backoff retries it, by the TTL at the
        // latest.
        Some(_) => Err(Error::Reported {
            until: plan.requeue,
        }),
        None => Ok(Action::requeue(plan.requeue)),
    }
}

/// Creates the export pod: `Ok(false)` when one exists that the cache does not show yet.
async fn create_pod(
    ctx: &Context,
    export: &VirtualMachineExport,
    pod: &Pod,
) -> Result<bool, String> {
    let ns = export.namespace().unwrap_or_default();
    let name = pod.name_any();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    match ctx.writer.create(&api, pod).await {
        Ok(mut p) => {
            slim_pod(&mut p);
            ctx.recent
                .remember("Pod", &ns, &name, Created::Pod(Box::new(p)));
            ctx.writer
                .event(
                    &object_ref(export),
                    kube::runtime::events::EventType::Normal,
                    "ExporterPodCreated",
                    "Create",
                    format!("Created exporter pod {ns}/{name}"),
                )
                .await;
            Ok(true)
        }
        Err(e) if e.is_already_exists() => Ok(false),
        Err(e) => {
            let msg = format!("Pod {name}: {e}");
            ctx.writer
                .event(
                    &object_ref(export),
                    kube::runtime::events::EventType::Warning,
                    REASON_POD_CREATION_FAILED,
                    "Create",
                    msg.clone(),
                )
                .await;
            Err(msg)
        }
    }
}

/// The links of the ready pod (docs/vmexport.md, "Links").
async fn links(
    ctx: &Context,
    export: &VirtualMachineExport,
    kind: SourceKind,
    pod: &Pod,
) -> Result<super::types::VirtualMachineExportLinks, Error> {
    let name = export.name_any();
    let ca = ctx.ca().await?;
    let external = ctx.external().await;
    Ok(links_from_pod(
        pod,
        &LinkSettings {
            namespace: export.namespace().unwrap_or_default(),
            export_name: name.clone(),
            service_name: naming::service_name(&name),
            internal_cert: ca.cert,
            external_cert: external.as_ref().map(|e| e.1.clone()).unwrap_or_default(),
            external_host: external.map(|e| e.0),
            strip_prefix: (kind == SourceKind::VirtualMachineSnapshot).then(|| name.clone()),
        },
    ))
}

/// The TTL passed: delete the export (this one: fenced on its uid).
async fn delete_expired(ctx: &Context, export: &VirtualMachineExport) -> Result<Action, Error> {
    let ns = export.namespace().unwrap_or_default();
    let name = export.name_any();
    let api: Api<VirtualMachineExport> = Api::namespaced(ctx.client.clone(), &ns);
    let deleted = ctx
        .writer
        .delete(&api, &name, export.uid().as_deref())
        .await
        .map_err(Error::DeleteExport)?;
    if deleted {
        ctx.ttl_deletions.inc();
        ctx.writer
            .event(
                &object_ref(export),
                kube::runtime::events::EventType::Normal,
                "TTLExpired",
                "Delete",
                format!("VirtualMachineExport {ns}/{name} reached its TTL and was deleted"),
            )
            .await;
    }
    Ok(Action::await_change())
}

async fn write_status(
    ctx: &Context,
    export: &VirtualMachineExport,
    status: &VirtualMachineExportStatus,
) -> Result<(), Error> {
    // A merge patch of the difference, with nulls for what this pass no longer reports (a
    // forged `links`), so the whole computed status is what the object ends up with.
    let Some(patch) = crate::runtime::writer::status_merge_patch(export.status.as_ref(), status)
    else {
        return Ok(());
    };
    let api: Api<VirtualMachineExport> =
        Api::namespaced(ctx.client.clone(), &export.namespace().unwrap_or_default());
    let rv = export.resource_version().unwrap_or_default();
    ctx.writer
        .merge_status_fenced(&api, &export.name_any(), &rv, &patch)
        .await
        .map_err(Error::WriteStatus)?;
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

    // Pods: slim copies (podcache.rs) and the claim index, both fed by one watch.
    let claims = Arc::new(ClaimIndex::default());
    let (pod_store, pod_writer) = reflector::store::<Pod>();
    let mut pods_synced = rt.track_synced("vmexport-pods");
    let ix = Arc::clone(&claims);
    let pod_events = watcher(rt.watched::<SlimPod>(), watcher::Config::default())
        .default_backoff()
        .map_ok(unwrap_event)
        .inspect(move |ev| pods_synced.observe(ev))
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
    // The children a pass reads, metadata only, from the watches that map them to their export.
    let children = || watcher::Config::default().labels(&format!("{APP_LABEL}={APP_LABEL_VALUE}"));
    // (an `Api<PartialObjectMeta<_>>` lists and watches metadata only).
    let (service_store, service_events) =
        rt.reflect::<PartialObjectMeta<Service>>("vmexport-services", rt.watched(), children());
    let (secret_store, secret_events) =
        rt.reflect::<PartialObjectMeta<Secret>>("vmexport-secrets", rt.watched(), children());
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
        // A status another writer changed is corrected at once (docs/vmexport.md, "Triggers"); our
        // own writes trigger nothing.
        Trigger::SpecFinalizersAndForeignStatus,
    );
    let store = controller.store();

    // Exports by phase, computed from the cache at scrape time: no timer.
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
        .owns_stream(service_events)
        .owns_stream(secret_events)
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
    let stores = Stores {
        pods: pod_store,
        claims,
        pvcs: pvc_store,
        services: service_store,
        secrets: secret_store,
        ingresses: ingress_store,
        optional: optional_state,
    };
    let ctx = Arc::new(Context::new(
        rt.writer(CONTROLLER),
        rt.client.clone(),
        cfg,
        stores,
        ttl_deletions,
    ));
    tokio::spawn(ensure_ca_when_leading(rt.clone(), Arc::clone(&ctx)));
    rtc::run(&rt, CONTROLLER, controller, ctx, BACKOFF_CAP, reconcile).await;
}

/// The export proxy waits for the CA before it serves: the leader creates it as it starts
/// leading rather than with the first export, so a fresh install is healthy before anyone
/// exports. Once read or created it is known for the life of the process.
async fn ensure_ca_when_leading(rt: Runtime, ctx: Arc<Context>) {
    let mut leading = std::pin::pin!(rt.leadership.acquisitions());
    loop {
        tokio::select! {
            _ = rt.shutdown.cancelled() => return,
            next = leading.next() => if next.is_none() { return },
        }
        match ctx.ca().await {
            Ok(_) => return,
            // Passes retry it with their own backoff; the next acquisition tries again.
            Err(e) => tracing::warn!(error = %rtc::error_chain(&e), "cannot ensure the export CA"),
        }
    }
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

//! The wiring of the VirtualMachineExport reconciler (docs/vmexport.md, "Triggers", "Pass
//! steps"): the watches and caches, what each event re-triggers, the controller, the export CA
//! at leadership, and one pass (`reconcile`): observe (observe.rs), plan (decide.rs, pure), apply
//! (apply.rs), requeued exactly at the TTL expiry.

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
use prometheus::IntCounter;

use super::api::*;
use super::apply::{apply, create_restore_pvcs};
use super::context::{Context, Error, Settings, Stores};
use super::decide::decide;
use super::observe::{observe, store_ready};
use super::optional::{self, Kind, Optional};
use super::podcache::{SlimPod, claim_index, unwrap_event};
use super::sources::kind::{SourceKind, classify_source};
use super::sources::restore_failed;
use super::status::PhaseCollector;
use super::types::VirtualMachineExport;
use crate::runtime::controller::{self as rtc, Guarded};
use crate::runtime::index::NameIndex;
use crate::runtime::{Runtime, Trigger};

pub const CONTROLLER: &str = "vmexport";

/// OURS: the error backoff cap is lower than the runtime default (docs/vmexport.md, "Triggers").
const BACKOFF_CAP: Duration = Duration::from_secs(60);

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
    let mut plan = decide(&observed, &ctx.settings, now);
    // Restore PVCs of a snapshot source come first: the source is what they make.
    if let Err(msg) = create_restore_pvcs(&ctx, &export, &plan.restore_pvcs).await {
        observed.source = restore_failed(msg);
        plan = super::decide::decide(&observed, &ctx.settings, now);
    }
    apply(&ctx, &export, &observed, &plan).await
}

/// Exports by source (docs/vmexport.md, "Triggers"): each export under its source kind and under
/// kind and name, so an event finds its exports without scanning every export.
pub type SourceIndex = NameIndex<Guarded<VirtualMachineExport>>;

fn source_keys(g: &Guarded<VirtualMachineExport>) -> Vec<String> {
    let Ok(e) = &g.0 else { return Vec::new() };
    let kind = classify_source(&e.spec);
    vec![
        kind_key(kind, None),
        kind_key(kind, Some(&e.spec.source.name)),
    ]
}

fn kind_key(kind: SourceKind, name: Option<&str>) -> String {
    match name {
        Some(n) => format!("{kind:?}/{n}"),
        None => format!("{kind:?}"),
    }
}

/// Exports whose source is the PVC `ns/claim`.
fn exports_of_claim(
    ix: &SourceIndex,
    ns: &str,
    claim: &str,
) -> Vec<ObjectRef<Guarded<VirtualMachineExport>>> {
    exports_of_kind(ix, ns, SourceKind::Pvc, Some(claim))
}

/// Exports in `ns` with a source of `kind` (and `name`, when given).
fn exports_of_kind(
    ix: &SourceIndex,
    ns: &str,
    kind: SourceKind,
    name: Option<&str>,
) -> Vec<ObjectRef<Guarded<VirtualMachineExport>>> {
    ix.names(ns, &kind_key(kind, name))
        .iter()
        .map(|n| ObjectRef::new(n).within(ns))
        .collect()
}

/// Exports to re-check for an optional-API event; `None` means the API just appeared.
fn exports_of_optional(
    store: &Store<Guarded<VirtualMachineExport>>,
    ix: &SourceIndex,
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
                        || k == SourceKind::VirtualMachineTemplate
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
            exports_of_kind(ix, &ns, SourceKind::VirtualMachine, Some(&name))
        }
        Kind::DataVolume => {
            let mut out = exports_of_claim(ix, &ns, &name);
            for k in [
                SourceKind::VirtualMachine,
                SourceKind::VirtualMachineTemplate,
            ] {
                out.extend(exports_of_kind(ix, &ns, k, None));
            }
            out
        }
        Kind::VirtualMachineTemplate => {
            exports_of_kind(ix, &ns, SourceKind::VirtualMachineTemplate, Some(&name))
        }
        Kind::VirtualMachineSnapshot => {
            exports_of_kind(ix, &ns, SourceKind::VirtualMachineSnapshot, Some(&name))
        }
        Kind::VirtualMachineSnapshotContent | Kind::VolumeSnapshot => {
            exports_of_kind(ix, &ns, SourceKind::VirtualMachineSnapshot, None)
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
pub async fn run(rt: Runtime, cfg: Settings) {
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
    let claims = Arc::new(claim_index());
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
    // The proxy's Ingress also gets the download time-outs (ingress.rs), from the leader.
    let (ing_tx, ing_rx) = tokio::sync::mpsc::unbounded_channel::<Ingress>();
    let ingress_events = ingress_events.inspect(move |ev| {
        if let Ok(ing) = ev {
            let _ = ing_tx.send(ing.clone());
        }
    });
    tokio::spawn(ingress_timeouts(rt.clone(), ingress_store.clone(), ing_rx));
    let sources = Arc::new(SourceIndex::new(source_keys));
    let controller = rt.controller::<VirtualMachineExport>(
        CONTROLLER,
        rt.watched(),
        watcher::Config::default(),
        // A status another writer changed is corrected at once (docs/vmexport.md, "Triggers"); our
        // own writes trigger nothing.
        Trigger::SpecFinalizersAndForeignStatus,
        Some(Arc::clone(&sources)),
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
    let (s3, ix3) = (store.clone(), Arc::clone(&sources));
    let optional_triggers =
        futures::stream::poll_fn(move |cx| opt_rx.poll_recv(cx)).flat_map(move |(kind, obj)| {
            futures::stream::iter(exports_of_optional(&s3, &ix3, kind, obj.as_ref()))
        });

    let ix1 = Arc::clone(&sources);
    let ix2 = Arc::clone(&sources);
    let s4 = store.clone();
    let controller = controller
        .reconcile_on(optional_triggers)
        .owns_stream(service_events)
        .owns_stream(secret_events)
        .watches_stream(pvc_events.boxed(), move |pvc: PersistentVolumeClaim| {
            let ns = pvc.namespace().unwrap_or_default();
            let mut out = exports_of_claim(&ix1, &ns, &pvc.name_any());
            // A VM's or template's claims (and a VM's backend PVC) are not indexed: VM and
            // template exports of the namespace are re-checked, which is cheap and idempotent.
            for k in [
                SourceKind::VirtualMachine,
                SourceKind::VirtualMachineTemplate,
            ] {
                out.extend(exports_of_kind(&ix1, &ns, k, None));
            }
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
                    out.extend(exports_of_claim(&ix2, &ns, &c.claim_name));
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

/// Sets the download time-outs on every Ingress to the proxy as it changes, and on all of them
/// when this replica starts leading (docs/vmexport.md, "Ingress time-outs").
async fn ingress_timeouts(
    rt: Runtime,
    store: kube::runtime::reflector::Store<Ingress>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Ingress>,
) {
    let mut leading = std::pin::pin!(rt.leadership.acquisitions());
    let service = crate::vmexport::proxy::SERVICE;
    loop {
        let batch: Vec<Ingress> = tokio::select! {
            _ = rt.shutdown.cancelled() => return,
            next = leading.next() => match next {
                None => return,
                Some(()) => store.state().iter().map(|i| i.as_ref().clone()).collect(),
            },
            ing = rx.recv() => match ing {
                None => return,
                Some(i) => vec![i],
            },
        };
        if !rt.leadership.is_leader() {
            continue;
        }
        for ing in &batch {
            if let Err(e) = super::ingress::ensure(&rt.client, ing, service).await {
                tracing::warn!(ingress = %ing.name_any(), error = %e, "cannot set the download time-outs on the Ingress");
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmexport::fixtures::export;

    fn guarded(name: &str, kind: &str, source: &str) -> Guarded<VirtualMachineExport> {
        let mut e = export(name);
        e.spec.source.kind = kind.into();
        e.spec.source.name = source.into();
        if kind == "VirtualMachine" {
            e.spec.source.api_group = Some("kubevirt.io".into());
        }
        Guarded(Ok(e))
    }

    fn names(refs: Vec<ObjectRef<Guarded<VirtualMachineExport>>>) -> Vec<String> {
        refs.into_iter().map(|r| r.name).collect()
    }

    #[test]
    fn the_source_index_finds_exports_by_claim_and_by_kind() {
        let ix = SourceIndex::new(source_keys);
        ix.apply(&watcher::Event::Init);
        for g in [
            guarded("a", "PersistentVolumeClaim", "disk"),
            guarded("b", "PersistentVolumeClaim", "disk"),
            guarded("c", "PersistentVolumeClaim", "other"),
            guarded("d", "VirtualMachine", "disk"),
        ] {
            ix.apply(&watcher::Event::InitApply(g));
        }
        ix.apply(&watcher::Event::InitDone);
        assert_eq!(names(exports_of_claim(&ix, "ns1", "disk")), ["a", "b"]);
        assert!(exports_of_claim(&ix, "ns2", "disk").is_empty());
        assert_eq!(
            names(exports_of_kind(
                &ix,
                "ns1",
                SourceKind::VirtualMachine,
                None
            )),
            ["d"]
        );
        assert_eq!(
            names(exports_of_kind(&ix, "ns1", SourceKind::Pvc, None)),
            ["a", "b", "c"]
        );
        // A changed source moves the export; a deleted one leaves.
        ix.apply(&watcher::Event::Apply(guarded(
            "b",
            "PersistentVolumeClaim",
            "other",
        )));
        assert_eq!(names(exports_of_claim(&ix, "ns1", "disk")), ["a"]);
        assert_eq!(names(exports_of_claim(&ix, "ns1", "other")), ["b", "c"]);
        ix.apply(&watcher::Event::Delete(guarded(
            "a",
            "PersistentVolumeClaim",
            "disk",
        )));
        assert!(exports_of_claim(&ix, "ns1", "disk").is_empty());
    }
}

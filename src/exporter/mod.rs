//! The `exporter` feature: Jumpstarter Exporter, Lease and Client reconcilers
//! (`jumpstarter.dev/v1alpha1`). See `../shared/spec/exporter.md`.
//!
//! Pure modules: `types` (CRDs), `token` (key and JWTs), `exporter_status`, `client_status`,
//! `lease_logic`, `selector`, `settings`, `config`. IO: `reconcile`, `signing`,
//! `startup`.

pub mod authn;
pub mod client_status;
pub mod config;
pub mod exporter_status;
pub mod grpc;
pub mod lease_hooks;
pub mod lease_logic;
pub mod login;
pub mod metrics;
pub mod oidc;
pub mod proto;
pub mod reconcile;
pub mod router;
pub mod router_token;
pub mod schema;
pub mod selector;
pub mod settings;
pub mod signing;
pub mod startup;
pub mod tls;
pub mod token;
pub mod types;

use std::sync::Arc;
use std::time::Duration;

use clap::{Args as _, FromArgMatches};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ObjectMeta, PartialObjectMeta};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{CustomResourceExt, Resource as _};

use crate::runtime::controller::{Guarded, run};
use crate::runtime::rbac::rule;
use crate::runtime::{Feature, Runtime, Trigger};
use types::{Client, Exporter, ExporterAccessPolicy, Lease};

/// The four CRDs this feature serves, in the form `ucm crds` writes to `crds/`.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        schema::fixup_crd(types::Client::crd()),
        schema::fixup_crd(types::ExporterAccessPolicy::crd()),
        schema::fixup_crd(types::Exporter::crd()),
        schema::fixup_crd(types::Lease::crd()),
    ]
}

/// Spec §9 RBAC (cluster-wide form). `exporters/finalizers` lets the controller ownerRefs on
/// Secrets and Leases set `blockOwnerDeletion`.
pub fn rbac() -> Vec<PolicyRule> {
    const ALL: &[&str] = &[
        "get", "list", "watch", "create", "update", "patch", "delete",
    ];
    vec![
        rule(
            &["jumpstarter.dev"],
            &["exporters", "leases", "clients"],
            ALL,
        ),
        rule(
            &["jumpstarter.dev"],
            &["exporters/status", "leases/status", "clients/status"],
            &["get", "update", "patch"],
        ),
        rule(&["jumpstarter.dev"], &["exporters/finalizers"], &["update"]),
        rule(
            &["jumpstarter.dev"],
            &["exporteraccesspolicies"],
            &["get", "list", "watch"],
        ),
        rule(&[""], &["secrets"], ALL),
        rule(&["events.k8s.io"], &["events"], &["create", "patch"]),
        // `authentication.k8s.enabled`: ServiceAccount tokens are checked with a TokenReview.
        rule(&["authentication.k8s.io"], &["tokenreviews"], &["create"]),
    ]
}

/// In the manager's namespace: the optional `jumpstarter-controller` ConfigMap (read by the
/// gRPC service). Its Secrets are covered by the cluster-wide Secret rule.
pub fn namespaced_rbac() -> Vec<PolicyRule> {
    vec![rule(&[""], &["configmaps"], &["get", "list", "watch"])]
}

pub static FEATURE: Feature = Feature {
    name: "exporter",
    about: "Jumpstarter Exporter, Lease and Client reconcilers (jumpstarter.dev/v1alpha1)",
    crds,
    rbac,
    namespaced_rbac,
    settings: settings::Args::augment_args,
    start: |rt, matches| Box::pin(start(rt, matches)),
    agents: &[router::AGENT],
};

const ERROR_BACKOFF_CAP: Duration = Duration::from_secs(300);

async fn start(rt: Runtime, matches: clap::ArgMatches) -> Result<(), String> {
    let args = settings::Args::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    let settings = settings::Settings::resolve(
        &args,
        std::env::var("GRPC_ENDPOINT").ok(),
        std::env::var("CONTROLLER_KEY").ok(),
    )?;
    // Read once at start, as upstream: a changed ConfigMap or key applies after a restart.
    let Some(loaded) = startup::load_config(&rt).await else {
        return Ok(()); // shutdown while the ConfigMap was invalid
    };
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    let settings = settings.with_config(loaded.config);
    let Some(key) = signing::load(&rt, &settings.key_source).await? else {
        return Ok(()); // shutdown before the key Secret was usable
    };

    let metrics = metrics::Metrics::new();
    metrics
        .register(&rt.metrics.registry)
        .map_err(|e| format!("cannot register exporter metrics: {e}"))?;

    // The active Leases (no ended label) the Exporter pass reads its held lease from. The same
    // watch triggers the Exporter passes, and a reflector stores an event before passing it on,
    // so a pass a Lease change triggers always reads that change.
    let (active_leases, lease_changes) = rt.reflect(
        "exporter-leases",
        rt.watched::<Guarded<Lease>>(),
        active_lease_watch(),
    );
    let ctx = Arc::new(reconcile::Ctx {
        writer: rt.writer("exporter"),
        client: rt.client.clone(),
        settings,
        key,
        metrics,
        active_leases,
        invalid_objects: rt.metrics.invalid_objects_total.clone(),
        stale_exporters: Default::default(),
    });

    // Exporter: its own changes (status included: the gRPC service writes conditions), except
    // heartbeats that move `lastSeen` alone (nothing derived changes, and the last pass's timer
    // still runs); owned Secrets; and Leases mapped by their controller owner or by
    // status.exporterRef (a lease that ends leaves the label-selected watch as a deletion).
    let exporter_ctl = rt
        .controller::<Exporter>(
            "exporter",
            rt.watched(),
            watcher::Config::default(),
            Trigger::AnyChangeExceptStatus(&["lastSeen"]),
        )
        .watches_stream(secret_changes(&rt), |s: PartialObjectMeta<Secret>| {
            credential_owners::<Exporter>(&s.metadata, "Exporter", "-exporter")
        })
        .watches_stream(lease_changes, |lease: Guarded<Lease>| {
            // An unreadable Lease names no exporter anyone can trust.
            let Ok(lease) = lease.0 else {
                return Vec::new();
            };
            let ns = lease.metadata.namespace.clone().unwrap_or_default();
            let by_status = lease
                .status
                .as_ref()
                .and_then(|s| s.exporter_ref_name())
                .map(str::to_string);
            let by_owner = lease
                .metadata
                .owner_references
                .iter()
                .flatten()
                .filter(|r| r.controller == Some(true) && r.kind == "Exporter")
                .map(|r| r.name.clone())
                .collect::<Vec<_>>();
            by_status
                .into_iter()
                .chain(by_owner)
                .map(move |name| ObjectRef::<Guarded<Exporter>>::new(&name).within(&ns))
                .collect()
        });
    rt.metrics
        .registry
        .register(Box::new(metrics::ExporterGauges::new(exporter_ctl.store())))
        .map_err(|e| format!("cannot register exporter gauges: {e}"))?;

    // Lease: every change of a lease without the ended label (rule 6.1.1: the label selector
    // drops ended leases from the watch and its cache, and admits an ended lease that lacks the
    // label, so the label is backfilled), plus pending leases that an Exporter change may satisfy.
    let lease_ctl = rt.controller::<Lease>(
        "lease",
        rt.watched(),
        active_lease_watch(),
        Trigger::AnyChange,
    );
    let lease_store = lease_ctl.store();
    let (policy_store, client_store) = (lease_store.clone(), lease_store.clone());
    // Exporter changes wake the pending leases they may satisfy; a heartbeat that moves only
    // `lastSeen` changes nothing a lease waits for and wakes none.
    let exporter_changes = watcher(
        rt.watched::<Guarded<Exporter>>(),
        watcher::Config::default(),
    )
    .default_backoff()
    .touched_objects()
    .predicate_filter(
        |e: &Guarded<Exporter>| crate::runtime::controller::hash_except_status(e, &["lastSeen"]),
        Default::default(),
    );
    let lease_ctl = lease_ctl
        .watches(
            rt.watched::<Guarded<ExporterAccessPolicy>>(),
            watcher::Config::default(),
            move |policy: Guarded<ExporterAccessPolicy>| {
                let ns = policy.meta().namespace.clone().unwrap_or_default();
                pending_leases(&policy_store, &ns, |_| true)
            },
        )
        .watches(
            rt.watched::<Guarded<Client>>(),
            watcher::Config::default(),
            move |client: Guarded<Client>| {
                let ns = client.meta().namespace.clone().unwrap_or_default();
                let name = client.meta().name.clone().unwrap_or_default();
                pending_leases(&client_store, &ns, |l| l.spec.client_ref.name == name)
            },
        );
    let lease_ctl =
        lease_ctl.watches_stream(exporter_changes, move |exporter: Guarded<Exporter>| {
            // An unreadable Exporter is no candidate; its own pass reports it.
            let Ok(exporter) = exporter.0 else {
                return Vec::new();
            };
            let ns = exporter.metadata.namespace.clone().unwrap_or_default();
            let name = exporter.metadata.name.clone().unwrap_or_default();
            let labels = exporter.metadata.labels.clone().unwrap_or_default();
            lease_store
                .state()
                .into_iter()
                .filter_map(|guard| guard.0.as_ref().ok().cloned())
                .filter(|lease| {
                    lease.metadata.namespace.as_deref() == Some(ns.as_str())
                        && lease_logic::is_active(lease)
                        && crate::conditions::is_true(
                            lease
                                .status
                                .as_ref()
                                .and_then(|s| s.conditions.as_deref())
                                .unwrap_or_default(),
                            lease_logic::PENDING,
                        )
                        && (lease.spec.exporter_ref_name() == Some(name.as_str())
                            || selector::matches(&lease.spec.selector, &labels).unwrap_or(false))
                })
                .map(|lease| {
                    ObjectRef::<Guarded<Lease>>::new(
                        &lease.metadata.name.clone().unwrap_or_default(),
                    )
                    .within(lease.metadata.namespace.as_deref().unwrap_or_default())
                })
                .collect::<Vec<_>>()
        });

    let client_ctl = rt
        .controller::<Client>(
            "client",
            rt.watched(),
            watcher::Config::default(),
            Trigger::SpecAndFinalizers,
        )
        .watches_stream(secret_changes(&rt), |s: PartialObjectMeta<Secret>| {
            credential_owners::<Client>(&s.metadata, "Client", "-client")
        });

    futures::join!(
        grpc::run(rt.clone(), ctx.clone()),
        login::run(rt.clone(), ctx.clone()),
        run(
            &rt,
            "exporter",
            exporter_ctl,
            ctx.clone(),
            ERROR_BACKOFF_CAP,
            reconcile::reconcile_exporter
        ),
        run(
            &rt,
            "lease",
            lease_ctl,
            ctx.clone(),
            ERROR_BACKOFF_CAP,
            reconcile::reconcile_lease
        ),
        run(
            &rt,
            "client",
            client_ctl,
            ctx.clone(),
            ERROR_BACKOFF_CAP,
            reconcile::reconcile_client
        ),
    );
    Ok(())
}

/// The pending leases of `ns` that `pick` selects, to wake on a change they may wait for.
fn pending_leases(
    store: &kube::runtime::reflector::Store<Guarded<Lease>>,
    ns: &str,
    pick: impl Fn(&Lease) -> bool,
) -> Vec<ObjectRef<Guarded<Lease>>> {
    store
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok())
        .filter(|l| {
            l.metadata.namespace.as_deref() == Some(ns)
                && lease_logic::is_active(l)
                && crate::conditions::is_true(
                    l.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_deref())
                        .unwrap_or_default(),
                    lease_logic::PENDING,
                )
                && pick(l)
        })
        .map(|l| {
            ObjectRef::<Guarded<Lease>>::new(l.metadata.name.as_deref().unwrap_or_default())
                .within(ns)
        })
        .collect()
}

/// Leases without the ended label: ended leases leave the watch and its cache (rule 6.1.1).
fn active_lease_watch() -> watcher::Config {
    watcher::Config::default().labels(&format!(
        "{}!={}",
        lease_logic::ENDED_LABEL,
        lease_logic::ENDED_VALUE
    ))
}

/// Changes to Secrets in the watched namespaces, metadata only (the reconcilers read the one
/// Secret they need; no Secret data is cached).
fn secret_changes(
    rt: &Runtime,
) -> impl futures::Stream<Item = Result<PartialObjectMeta<Secret>, watcher::Error>> + Send + 'static
{
    // An Api of PartialObjectMeta makes metadata-only list and watch requests.
    watcher(
        rt.watched::<PartialObjectMeta<Secret>>(),
        watcher::Config::default(),
    )
    .default_backoff()
    .touched_objects()
}

/// The objects whose credential Secret this is: its controller owner of `kind`, and the object
/// its name points to (`<name><suffix>`), so that a Secret that lost its ownerRef, or was
/// deleted, still triggers its owner's pass (which restores or recreates it).
fn credential_owners<K>(meta: &ObjectMeta, kind: &str, suffix: &str) -> Vec<ObjectRef<Guarded<K>>>
where
    K: kube::Resource<DynamicType = ()>,
{
    let ns = meta.namespace.clone().unwrap_or_default();
    let mut names: Vec<&str> = meta
        .owner_references
        .iter()
        .flatten()
        .filter(|r| r.controller == Some(true) && r.kind == kind)
        .map(|r| r.name.as_str())
        .collect();
    names.extend(
        meta.name
            .as_deref()
            .and_then(|n| n.strip_suffix(suffix))
            .filter(|n| !n.is_empty()),
    );
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .map(|n| ObjectRef::<Guarded<K>>::new(n).within(&ns))
        .collect()
}

#[cfg(test)]
mod crd_compat_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    #[test]
    fn credential_secrets_map_to_their_owner_by_ref_and_by_name() {
        let meta = |name: &str, owners: Vec<(&str, &str, bool)>| ObjectMeta {
            name: Some(name.into()),
            namespace: Some("lab".into()),
            owner_references: Some(
                owners
                    .into_iter()
                    .map(|(kind, name, controller)| OwnerReference {
                        kind: kind.into(),
                        name: name.into(),
                        controller: Some(controller),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        };
        let names = |m: &ObjectMeta, kind: &str, suffix: &str| {
            credential_owners::<Exporter>(m, kind, suffix)
                .into_iter()
                .map(|r| (r.name, r.namespace.unwrap()))
                .collect::<Vec<_>>()
        };
        let lab = |n: &str| (n.to_string(), "lab".to_string());
        // Owned and named: one pass, not two.
        let m = meta("e1-exporter", vec![("Exporter", "e1", true)]);
        assert_eq!(names(&m, "Exporter", "-exporter"), vec![lab("e1")]);
        // The ownerRef was removed: the name still leads to the owner.
        let m = meta("e1-exporter", vec![]);
        assert_eq!(names(&m, "Exporter", "-exporter"), vec![lab("e1")]);
        // Other kinds and non-controller refs are ignored; other Secrets map to nothing.
        let m = meta(
            "db-password",
            vec![("Deployment", "db", true), ("Exporter", "x", false)],
        );
        assert!(names(&m, "Exporter", "-exporter").is_empty());
        let m = meta("-client", vec![]);
        assert!(names(&m, "Client", "-client").is_empty());
        let m = meta("c1-client", vec![("Client", "c1", true)]);
        assert_eq!(names(&m, "Client", "-client"), vec![lab("c1")]);
    }
}

//! The `exporter` feature: Jumpstarter Exporter, Lease and Client reconcilers
//! (`jumpstarter.dev/v1alpha1`). See `../shared/spec/exporter.md`.
//!
//! Pure modules: `types` (CRDs), `token` (key and JWTs), `exporter_status`, `client_status`,
//! `lease_logic`, `selector`, `godur`, `settings`. IO: `reconcile`, `signing`.

pub mod client_status;
pub mod exporter_status;
pub mod godur;
pub mod grpc;
pub mod lease_hooks;
pub mod lease_logic;
pub mod metrics;
pub mod proto;
pub mod reconcile;
pub mod router;
pub mod router_token;
pub mod schema;
pub mod selector;
pub mod settings;
pub mod signing;
pub mod tls;
pub mod token;
pub mod types;

use std::sync::Arc;
use std::time::Duration;

use clap::{Args as _, FromArgMatches};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

use crate::runtime::controller::{Guarded, run};
use crate::runtime::rbac::rule;
use crate::runtime::{Feature, Runtime, Trigger};
use types::{Client, Exporter, Lease};

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
    let Some(key) = signing::load(&rt, &settings.key_source).await? else {
        return Ok(()); // shutdown before the generated key appeared
    };

    let metrics = metrics::Metrics::new();
    metrics
        .register(&rt.metrics.registry)
        .map_err(|e| format!("cannot register exporter metrics: {e}"))?;

    let ctx = Arc::new(reconcile::Ctx {
        writer: rt.writer("exporter"),
        client: rt.client.clone(),
        settings,
        key,
        metrics,
    });

    // Exporter: its own changes (status included: the gRPC service writes it), owned Secrets,
    // and Leases mapped by their controller owner or by status.exporterRef.
    let exporter_ctl = rt
        .controller::<Exporter>(
            "exporter",
            rt.watched(),
            watcher::Config::default(),
            Trigger::AnyChange,
        )
        .owns(rt.watched::<Secret>(), watcher::Config::default())
        .watches(
            rt.watched::<Lease>(),
            watcher::Config::default(),
            |lease: Lease| {
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
            },
        );
    rt.metrics
        .registry
        .register(Box::new(metrics::ExporterGauges::new(exporter_ctl.store())))
        .map_err(|e| format!("cannot register exporter gauges: {e}"))?;

    // Lease: every change (ended ones cost a read-only pass), plus pending leases that an
    // Exporter change may satisfy.
    let lease_ctl = rt.controller::<Lease>(
        "lease",
        rt.watched(),
        watcher::Config::default(),
        Trigger::AnyChange,
    );
    let lease_store = lease_ctl.store();
    let lease_ctl = lease_ctl.watches(
        rt.watched::<Exporter>(),
        watcher::Config::default(),
        move |exporter: Exporter| {
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
        },
    );

    let client_ctl = rt
        .controller::<Client>(
            "client",
            rt.watched(),
            watcher::Config::default(),
            Trigger::SpecAndFinalizers,
        )
        .owns(rt.watched::<Secret>(), watcher::Config::default());

    futures::join!(
        grpc::run(rt.clone(), ctx.clone()),
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

#[cfg(test)]
mod crd_compat_tests;

//! The feature's wiring (docs/exporter.md, "Objects", "Lease assignment"): one watch and cache
//! per kind, the three controllers and what triggers each, the [`Context`], and the servers
//! and passes run side by side.

use std::sync::Arc;
use std::time::Duration;

use clap::FromArgMatches;
use k8s_openapi::api::core::v1::Secret;
use kube::Resource as _;
use kube::api::{ObjectMeta, PartialObjectMeta};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};

use crate::exporter::context::{Caches, Context, Wakeups};
use crate::exporter::crd::{Client, Exporter, ExporterAccessPolicy, Lease};
use crate::exporter::decide::lease::queue;
use crate::exporter::{apply, grpc, metrics, own_writes, settings, startup};
use crate::runtime::controller::{Guarded, drop_managed_fields, run};
use crate::runtime::{Runtime, Trigger};

const ERROR_BACKOFF_CAP: Duration = Duration::from_secs(300);

pub async fn start(rt: Runtime, matches: clap::ArgMatches) -> Result<(), String> {
    let args = settings::Args::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    let settings = settings::Settings::resolve(
        &args,
        std::env::var("GRPC_ENDPOINT").ok(),
        std::env::var("CONTROLLER_KEY").ok(),
    )?;
    // The watches start before the ConfigMap and key reads below, which need none of them:
    // listing thousands of Exporters is the longest step of a start-up (README, "Benchmarks").
    // Readiness waits for those reads too.
    let settings_read = rt.track_synced("exporter-settings");
    // One watch and one cache per kind, each feeding every controller that maps it (lease
    // assignment reads only caches: docs/exporter.md, "Lease assignment"). A pass reads the cache
    // its trigger came through, and a reflector stores an event before passing it on, so a pass
    // always reads the change that triggered it.
    // Exporters: the Exporter controller's primary and the pending leases' wake-ups.
    let (exporters, exporter_events) = rt.reflect_fanout(
        "exporter",
        rt.watched::<Guarded<Exporter>>(),
        watcher::Config::default(),
        2,
        drop_managed_fields,
        None,
    );
    // Active Leases (no ended label; docs/exporter.md, "Objects": the selector drops ended leases
    // from the watch and its cache, and admits an ended lease that lacks the label, so it is
    // backfilled).
    let (leases, lease_events) = rt.reflect_fanout(
        "lease",
        rt.watched::<Guarded<Lease>>(),
        active_lease_watch(),
        2,
        drop_managed_fields,
        None,
    );
    let (clients, client_events) = rt.reflect_fanout(
        "client",
        rt.watched::<Guarded<Client>>(),
        watcher::Config::default(),
        2,
        drop_managed_fields,
        None,
    );
    // Credential Secrets, metadata only (no Secret data is cached): the cache tells a pass
    // that a Secret does not exist, and its changes trigger their owners.
    let (secrets, secret_events) = rt.reflect_fanout(
        "exporter-secrets",
        rt.watched::<PartialObjectMeta<Secret>>(),
        watcher::Config::default(),
        2,
        slim_secret,
        None,
    );
    let (policies, policy_changes) = rt.reflect(
        "exporter-policies",
        rt.watched::<Guarded<ExporterAccessPolicy>>(),
        watcher::Config::default(),
    );
    let [exporter_primary, exporter_wakes] = two(exporter_events);
    let [lease_primary, lease_wakes] = two(lease_events);
    let [client_primary, client_wakes] = two(client_events);
    let [exporter_secrets, client_secrets] = two(secret_events);

    // Read once at start, as upstream: a changed ConfigMap or key applies after a restart.
    let Some(loaded) = startup::load_config(&rt).await else {
        return Ok(()); // shutdown while the ConfigMap was invalid
    };
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    let settings = settings.with_config(loaded.config);
    let Some(key) = crate::exporter::auth::signing::load(&rt, &settings.key_source).await? else {
        return Ok(()); // shutdown before the key Secret was usable
    };

    let metrics = metrics::Metrics::new();
    if let Some(ns) = &rt.config.watch_namespace {
        metrics.preinit_namespace(ns);
    }
    metrics
        .register(&rt.metrics.registry)
        .map_err(|e| format!("cannot register exporter metrics: {e}"))?;
    settings_read.done();

    // Exporter: its own changes (status included: the gRPC service writes conditions), except
    // heartbeats that move `lastSeen` alone (nothing derived changes, and the last pass's timer
    // still runs); owned Secrets; and Leases mapped by their controller owner or by
    // status.exporterRef (a lease that ends leaves the label-selected watch as a deletion).
    let wakeups = Wakeups::default();
    let exporter_ctl = rt
        .controller_on::<Exporter>(
            "exporter",
            exporters.clone(),
            exporter_primary,
            Trigger::AnyChangeExceptStatus(&["lastSeen"]),
        )
        .watches_stream(
            exporter_secrets.touched_objects(),
            |s: PartialObjectMeta<Secret>| {
                credential_owners::<Exporter>(&s.metadata, "Exporter", "-exporter")
            },
        )
        .watches_stream(lease_wakes.touched_objects(), |lease: Guarded<Lease>| {
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
    let exporter_ctl = exporter_ctl.reconcile_on(wakeups.exporters.clone().fired());
    rt.metrics
        .registry
        .register(Box::new(metrics::ExporterGauges::new(exporters.clone())))
        .map_err(|e| format!("cannot register exporter gauges: {e}"))?;
    rt.metrics
        .registry
        .register(Box::new(metrics::LeaseQueueGauge::new(
            leases.clone(),
            rt.config.watch_namespace.clone(),
        )))
        .map_err(|e| format!("cannot register the lease queue gauge: {e}"))?;

    // Lease: every change of an active lease, plus the pending leases that a change of an
    // Exporter, a policy or a Client may satisfy.
    let (policy_leases, client_leases, exporter_leases) =
        (leases.clone(), leases.clone(), leases.clone());
    // The mapper is a `Fn`: its memory sits behind a lock only it takes.
    let exporter_signatures =
        std::sync::Mutex::new(crate::runtime::controller::ChangeMemory::default());
    let lease_ctl = rt
        .controller_on::<Lease>("lease", leases.clone(), lease_primary, Trigger::AnyChange)
        .reconcile_on(wakeups.leases.clone().fired())
        .watches_stream(
            policy_changes,
            move |policy: Guarded<ExporterAccessPolicy>| {
                let ns = policy.meta().namespace.clone().unwrap_or_default();
                pending_leases(&policy_leases, &ns, |_| true)
            },
        )
        .watches_stream(
            client_wakes.touched_objects(),
            move |client: Guarded<Client>| {
                let ns = client.meta().namespace.clone().unwrap_or_default();
                let name = client.meta().name.clone().unwrap_or_default();
                pending_leases(&client_leases, &ns, |l| l.spec.client_ref.name == name)
            },
        )
        // A heartbeat that moves only `lastSeen` changes nothing a lease waits for.
        .watches_stream(
            crate::runtime::controller::changed(
                exporter_wakes.touched_objects(),
                |e: &Guarded<Exporter>| {
                    crate::runtime::controller::hash_except_status(e, &["lastSeen"])
                },
            ),
            move |exporter: Guarded<Exporter>| {
                // An unreadable Exporter is no candidate; its own pass reports it.
                let Ok(exporter) = exporter.0 else {
                    return Vec::new();
                };
                let ns = exporter.metadata.namespace.clone().unwrap_or_default();
                let name = exporter.metadata.name.clone().unwrap_or_default();
                let labels = exporter.metadata.labels.clone().unwrap_or_default();
                // Only a change every waiting Lease reads wakes them all; one of who holds it
                // wakes the Leases near the head (docs/exporter.md, "Lease scheduling").
                let everyone = exporter.metadata.deletion_timestamp.is_some()
                    || exporter_signatures
                        .lock()
                        .expect("lock")
                        .changed(&exporter.metadata, queue::shared_signature(&exporter));
                pending_leases(&exporter_leases, &ns, |lease| {
                    (everyone || queue::near_head(lease))
                        && (lease.spec.exporter_ref_name() == Some(name.as_str())
                            || crate::exporter::lease::selector::matches(
                                &lease.spec.selector,
                                &labels,
                            )
                            .unwrap_or(false))
                })
            },
        );

    let client_ctl = rt
        .controller_on::<Client>(
            "client",
            clients.clone(),
            client_primary,
            Trigger::SpecAndFinalizers,
        )
        .reconcile_on(wakeups.clients.clone().fired())
        .watches_stream(
            client_secrets.touched_objects(),
            |s: PartialObjectMeta<Secret>| {
                credential_owners::<Client>(&s.metadata, "Client", "-client")
            },
        );

    let writer = rt.writer("exporter");
    let ctx = Arc::new(Context {
        calls: writer.any_replica(),
        writer,
        client: rt.client.clone(),
        settings,
        key,
        metrics,
        caches: Caches {
            synced: rt.synced(&[
                "exporter",
                "lease",
                "client",
                "exporter-secrets",
                "exporter-policies",
            ]),
            exporters,
            leases,
            clients,
            policies,
            secrets,
        },
        ledger: Default::default(),
        replaced: Default::default(),
        tokens: own_writes::Tokens::priming(),
        wakeups,
    });

    futures::join!(
        apply::credential::prime_tokens(rt.clone(), ctx.clone()),
        grpc::run(rt.clone(), ctx.clone()),
        crate::exporter::login::run(rt.clone(), ctx.clone()),
        run(
            &rt,
            "exporter",
            exporter_ctl,
            ctx.clone(),
            ERROR_BACKOFF_CAP,
            apply::exporter::reconcile_exporter
        ),
        run(
            &rt,
            "lease",
            lease_ctl,
            ctx.clone(),
            ERROR_BACKOFF_CAP,
            apply::lease::reconcile_lease
        ),
        run(
            &rt,
            "client",
            client_ctl,
            ctx.clone(),
            ERROR_BACKOFF_CAP,
            apply::client::reconcile_client
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
                && crate::exporter::decide::lease::expiry::is_active(l)
                && crate::conditions::is_true(
                    l.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_deref())
                        .unwrap_or_default(),
                    crate::exporter::decide::lease::PENDING,
                )
                && pick(l)
        })
        .map(|l| {
            ObjectRef::<Guarded<Lease>>::new(l.metadata.name.as_deref().unwrap_or_default())
                .within(ns)
        })
        .collect()
}

/// Leases without the ended label: ended leases leave the watch and its cache (docs/exporter.md,
/// "Objects").
fn active_lease_watch() -> watcher::Config {
    watcher::Config::default().labels(&format!(
        "{}!={}",
        crate::exporter::decide::lease::ENDED_LABEL,
        crate::exporter::decide::lease::ENDED_VALUE
    ))
}

fn two<T>(v: Vec<T>) -> [T; 2] {
    v.try_into().ok().expect("two streams")
}

/// What the credential passes read of a cached Secret: its name, version, owners and deletion.
/// The cache holds every Secret of the watched namespaces, so the rest (labels, annotations: a
/// client-side apply's annotation repeats the whole Secret, data included) is dropped.
fn slim_secret(s: &mut PartialObjectMeta<Secret>) {
    s.types = None;
    let m = std::mem::take(&mut s.metadata);
    s.metadata = ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        resource_version: m.resource_version,
        owner_references: m.owner_references,
        deletion_timestamp: m.deletion_timestamp,
        ..Default::default()
    };
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

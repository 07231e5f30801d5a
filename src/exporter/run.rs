//! The feature's wiring (docs/exporter.md, "Objects", "Lease assignment"): one watch and cache
//! per kind, the three controllers and what triggers each, the [`Context`], and the servers
//! and passes run side by side. Each trigger's mapper (which objects a change of another kind
//! concerns) is a named function beside the pass it triggers: `apply::exporter::of_lease`,
//! `apply::lease::of_exporter`, and so on.

use std::sync::Arc;
use std::time::Duration;

use clap::FromArgMatches;
use k8s_openapi::api::core::v1::Secret;
use kube::api::PartialObjectMeta;
use kube::runtime::reflector::Store;
use kube::runtime::{Controller, WatchStreamExt, watcher};

use crate::exporter::context::{Caches, Context, Wakeups};
use crate::exporter::crd::{Client, Exporter, ExporterAccessPolicy, Lease};
use crate::exporter::{apply, context, grpc, metrics, own_writes, startup};
use crate::runtime::controller::{FanoutStream, Guarded, drop_managed_fields, run};
use crate::runtime::{Runtime, Trigger};

const ERROR_BACKOFF_CAP: Duration = Duration::from_secs(300);

pub async fn start(rt: Runtime, matches: clap::ArgMatches) -> Result<(), String> {
    let args = context::Args::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    let settings = context::Settings::resolve(
        &args,
        std::env::var("GRPC_ENDPOINT").ok(),
        std::env::var("CONTROLLER_KEY").ok(),
    )?;
    // The watches start before the ConfigMap and key reads below, which need none of them: listing
    // thousands of Exporters is the longest step of a start-up (docs/benchmarks.md, "Start-up").
    // Readiness waits for those reads too.
    let settings_read = rt.track_synced("exporter-settings");
    let (watches, policy_changes) = Watches::start(&rt);

    // Read once at start, as upstream: a changed ConfigMap or key applies after a restart.
    let Some(loaded) = startup::load_config(&rt).await else {
        return Ok(()); // shutdown while the ConfigMap was invalid
    };
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    let settings = settings.with_config(loaded.config);
    let Some(key) = startup::load_key(&rt, &settings.key_source).await? else {
        return Ok(()); // shutdown before the key Secret was usable
    };
    let metrics = register_metrics(&rt, &watches)?;
    settings_read.done();

    let Watches {
        exporters,
        leases,
        clients,
        policies,
        secrets,
        exporter_events: [exporter_primary, exporter_wakes],
        lease_events: [lease_primary, lease_wakes],
        client_events: [client_primary, client_wakes],
        secret_events: [exporter_secrets, client_secrets],
    } = watches;
    let wakeups = Wakeups::default();
    let exporter_ctl = exporter_controller(
        &rt,
        &exporters,
        exporter_primary,
        exporter_secrets,
        lease_wakes,
        &wakeups,
    );
    let lease_ctl = lease_controller(
        &rt,
        &leases,
        lease_primary,
        policy_changes,
        client_wakes,
        exporter_wakes,
        &wakeups,
    );
    let client_ctl = client_controller(&rt, &clients, client_primary, client_secrets, &wakeups);

    let writer = rt.writer("exporter");
    let ctx = Arc::new(Context {
        calls: writer.any_replica(),
        writer,
        client: rt.client.clone(),
        settings,
        key,
        metrics,
        caches: Caches {
            synced: rt.synced(WATCHES),
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
    run_all(&rt, ctx, exporter_ctl, lease_ctl, client_ctl).await;
    Ok(())
}

/// The names of the feature's watches, whose first lists readiness waits for.
const WATCHES: &[&str] = &[
    "exporter",
    "lease",
    "client",
    "exporter-secrets",
    "exporter-policies",
];

/// One watch and one cache per kind, each feeding every controller that maps it (lease
/// assignment reads only caches: docs/exporter.md, "Lease assignment"). A pass reads the cache
/// its trigger came through, and a reflector stores an event before passing it on, so a pass
/// always reads the change that triggered it. Each `*_events` pair is the primary stream of the
/// kind's controller, then the wake-ups of another controller.
struct Watches {
    exporters: Store<Guarded<Exporter>>,
    leases: Store<Guarded<Lease>>,
    clients: Store<Guarded<Client>>,
    policies: Store<Guarded<ExporterAccessPolicy>>,
    secrets: Store<PartialObjectMeta<Secret>>,
    /// The Exporter controller's, the pending leases' wake-ups.
    exporter_events: [FanoutStream<Guarded<Exporter>>; 2],
    /// The Lease controller's, the Exporter controller's (the exporter a lease names).
    lease_events: [FanoutStream<Guarded<Lease>>; 2],
    /// The Client controller's, the pending leases' wake-ups.
    client_events: [FanoutStream<Guarded<Client>>; 2],
    /// The Exporter controller's and the Client controller's (their credential Secrets).
    secret_events: [FanoutStream<PartialObjectMeta<Secret>>; 2],
}

impl Watches {
    /// Starts the watches; the policy changes are returned beside them (the Lease controller's
    /// only stream of them).
    fn start(
        rt: &Runtime,
    ) -> (
        Watches,
        impl futures::Stream<Item = Result<Guarded<ExporterAccessPolicy>, watcher::Error>>
        + Send
        + 'static,
    ) {
        let (exporters, exporter_events) = rt.reflect_fanout(
            "exporter",
            rt.watched::<Guarded<Exporter>>(),
            watcher::Config::default(),
            2,
            drop_managed_fields,
            None,
        );
        // Active Leases (no ended label; docs/exporter.md, "Objects": the selector drops ended
        // leases from the watch and its cache, and admits an ended lease that lacks the label, so
        // it is backfilled).
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
            apply::credential::slim_secret,
            None,
        );
        let (policies, policy_changes) = rt.reflect(
            "exporter-policies",
            rt.watched::<Guarded<ExporterAccessPolicy>>(),
            watcher::Config::default(),
        );
        let watches = Watches {
            exporters,
            leases,
            clients,
            policies,
            secrets,
            exporter_events: two(exporter_events),
            lease_events: two(lease_events),
            client_events: two(client_events),
            secret_events: two(secret_events),
        };
        (watches, policy_changes)
    }
}

/// The feature's metrics and the gauges read from its caches.
fn register_metrics(rt: &Runtime, watches: &Watches) -> Result<metrics::Metrics, String> {
    let metrics = metrics::Metrics::new();
    metrics
        .register(&rt.metrics.registry)
        .map_err(|e| format!("cannot register exporter metrics: {e}"))?;
    rt.metrics
        .registry
        .register(Box::new(metrics::ExporterGauges::new(
            watches.exporters.clone(),
        )))
        .map_err(|e| format!("cannot register exporter gauges: {e}"))?;
    rt.metrics
        .registry
        .register(Box::new(metrics::LeaseQueueGauge::new(
            watches.leases.clone(),
            watches.exporters.clone(),
            &metrics,
            rt.config.watch_namespace.clone(),
        )))
        .map_err(|e| format!("cannot register the lease queue gauge: {e}"))?;
    Ok(metrics)
}

/// Exporter: its own changes (status included: the gRPC service writes conditions), except
/// heartbeats that move `lastSeen` alone (nothing derived changes, and the last pass's timer
/// still runs); owned Secrets; and Leases mapped by their controller owner or by
/// status.exporterRef (a lease that ends leaves the label-selected watch as a deletion).
fn exporter_controller(
    rt: &Runtime,
    exporters: &Store<Guarded<Exporter>>,
    primary: FanoutStream<Guarded<Exporter>>,
    secrets: FanoutStream<PartialObjectMeta<Secret>>,
    lease_wakes: FanoutStream<Guarded<Lease>>,
    wakeups: &Wakeups,
) -> Controller<Guarded<Exporter>> {
    rt.controller_on::<Exporter>(
        "exporter",
        exporters.clone(),
        primary,
        Trigger::AnyChangeExceptStatus(&["lastSeen"]),
    )
    .watches_stream(
        secrets.touched_objects(),
        apply::exporter::of_credential_secret,
    )
    .watches_stream(lease_wakes.touched_objects(), apply::exporter::of_lease)
    .reconcile_on(wakeups.exporters.clone().fired())
}

/// Client: its spec and finalizers, and its owned Secrets.
fn client_controller(
    rt: &Runtime,
    clients: &Store<Guarded<Client>>,
    primary: FanoutStream<Guarded<Client>>,
    secrets: FanoutStream<PartialObjectMeta<Secret>>,
    wakeups: &Wakeups,
) -> Controller<Guarded<Client>> {
    rt.controller_on::<Client>(
        "client",
        clients.clone(),
        primary,
        Trigger::SpecAndFinalizers,
    )
    .reconcile_on(wakeups.clients.clone().fired())
    .watches_stream(
        secrets.touched_objects(),
        apply::client::of_credential_secret,
    )
}

/// Lease: every change of an active lease, plus the pending leases that a change of an
/// Exporter, a policy or a Client may satisfy.
fn lease_controller(
    rt: &Runtime,
    leases: &Store<Guarded<Lease>>,
    primary: FanoutStream<Guarded<Lease>>,
    policy_changes: impl futures::Stream<Item = Result<Guarded<ExporterAccessPolicy>, watcher::Error>>
    + Send
    + 'static,
    client_wakes: FanoutStream<Guarded<Client>>,
    exporter_wakes: FanoutStream<Guarded<Exporter>>,
    wakeups: &Wakeups,
) -> Controller<Guarded<Lease>> {
    rt.controller_on::<Lease>("lease", leases.clone(), primary, Trigger::AnyChange)
        .reconcile_on(wakeups.leases.clone().fired())
        .watches_stream(policy_changes, apply::lease::of_policy(leases.clone()))
        .watches_stream(
            client_wakes.touched_objects(),
            apply::lease::of_client(leases.clone()),
        )
        // A heartbeat that moves only `lastSeen` changes nothing a lease waits for.
        .watches_stream(
            crate::runtime::controller::changed(
                exporter_wakes.touched_objects(),
                |e: &Guarded<Exporter>| {
                    crate::runtime::controller::hash_except_status(e, &["lastSeen"])
                },
            ),
            apply::lease::of_exporter(leases.clone()),
        )
}

/// The servers and the three controllers, side by side until shutdown.
async fn run_all(
    rt: &Runtime,
    ctx: Arc<Context>,
    exporter_ctl: Controller<Guarded<Exporter>>,
    lease_ctl: Controller<Guarded<Lease>>,
    client_ctl: Controller<Guarded<Client>>,
) {
    futures::join!(
        apply::credential::prime_tokens(rt.clone(), ctx.clone()),
        grpc::run(rt.clone(), ctx.clone()),
        crate::exporter::login::run(rt.clone(), ctx.clone()),
        run(
            rt,
            "exporter",
            exporter_ctl,
            ctx.clone(),
            ERROR_BACKOFF_CAP,
            apply::exporter::reconcile
        ),
        run(
            rt,
            "lease",
            lease_ctl,
            ctx.clone(),
            ERROR_BACKOFF_CAP,
            apply::lease::reconcile
        ),
        run(
            rt,
            "client",
            client_ctl,
            ctx.clone(),
            ERROR_BACKOFF_CAP,
            apply::client::reconcile
        ),
    );
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

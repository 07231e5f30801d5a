//! `ucm manager`: wires the shared pieces together and runs the enabled features until shutdown.
//!
//! Order (docs/runtime.md, "Shutdown"): signal → cancel the token (readiness fails) → controllers
//! drain, bounded by `--graceful-shutdown-timeout` → leader label removed and Lease released →
//! admin servers stop → exit 0 (1 if draining timed out or a task died).

use std::{sync::Arc, time::Duration};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{
    Api, Client, ResourceExt,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        conditions,
        wait::{Condition, await_condition},
    },
};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::{
    Runtime, RuntimeConfig,
    cli::{ManagerArgs, resolve_namespace},
    feature::Feature,
    health::Health,
    http,
    leader::{Election, ElectionConfig, Leadership, identity},
    metrics::Metrics,
    shutdown,
};

pub async fn client(kubeconfig: Option<&str>) -> anyhow::Result<Client> {
    let config = match kubeconfig.filter(|p| !p.is_empty()) {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("cannot read kubeconfig {path}: {e}"))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    // Field sets of managedFields are dropped before decoding (trim.rs).
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&super::trim::TrimLayer)
        .build())
}

/// Runs the manager; returns the process exit code.
pub async fn run(
    args: ManagerArgs,
    matches: clap::ArgMatches,
    features: Vec<&'static Feature>,
) -> anyhow::Result<i32> {
    let (namespace, fallback) = resolve_namespace(args.namespace.as_deref());
    if fallback {
        warn!("no --namespace, POD_NAMESPACE or service-account namespace file; using \"default\"");
    }
    let identity = identity();
    let names: Vec<_> = features.iter().map(|f| f.name).collect();
    info!(
        kubeconfig = args.kubeconfig.as_deref().unwrap_or("<inferred>"),
        namespace = %namespace,
        watch_namespace = %args.watch_namespace,
        features = ?names,
        leader_elect = args.leader_elect,
        lease_duration = %crate::godur::format(args.leader_elect_lease_duration),
        renew_deadline = %crate::godur::format(args.leader_elect_renew_deadline),
        retry_period = %crate::godur::format(args.leader_elect_retry_period),
        max_concurrent_reconciles = args.max_concurrent_reconciles,
        identity = %identity,
        "starting ucm manager"
    );

    let client = client(args.kubeconfig.as_deref()).await?;
    let metrics = Arc::new(Metrics::new());
    let health = Health::new();
    let token = CancellationToken::new();
    shutdown::install(token.clone());

    // Admin servers outlive the controllers so probes and scrapes answer while draining.
    let servers_stop = CancellationToken::new();
    let mut servers = JoinSet::new();
    if let Some(addr) = args.metrics_bind_address.addr() {
        let l = http::bind(addr, "--metrics-bind-address").await?;
        info!(address = %l.local_addr()?, "serving metrics");
        servers.spawn(http::serve_metrics(
            l,
            metrics.registry.clone(),
            servers_stop.clone(),
        ));
    }
    if let Some(addr) = args.health_probe_bind_address.addr() {
        let l = http::bind(addr, "--health-probe-bind-address").await?;
        info!(address = %l.local_addr()?, "serving health probes");
        servers.spawn(http::serve_health(l, health.clone(), servers_stop.clone()));
    }

    let pod_name = std::env::var("POD_NAME").ok().filter(|s| !s.is_empty());
    let (leadership, election) = if args.leader_elect {
        let cfg = ElectionConfig {
            namespace: args
                .leader_election_namespace
                .clone()
                .unwrap_or_else(|| namespace.clone()),
            name: args.leader_election_id.clone(),
            identity: identity.clone(),
            lease_duration: args.leader_elect_lease_duration,
            renew_deadline: args.leader_elect_renew_deadline,
            retry_period: args.leader_elect_retry_period,
            pod_name: pod_name.clone(),
            pod_namespace: namespace.clone(),
        };
        let (l, e) = Election::start(client.clone(), cfg, metrics.clone());
        (l, Some(e))
    } else {
        metrics
            .leader_election_master_status
            .with_label_values(&[&args.leader_election_id])
            .set(1);
        (Leadership::always(), None)
    };

    let rt = Runtime::new(
        client.clone(),
        leadership,
        metrics.clone(),
        health.clone(),
        token.clone(),
        RuntimeConfig {
            manager_namespace: namespace,
            watch_namespace: Some(args.watch_namespace.clone()).filter(|s| !s.is_empty()),
            max_concurrent_reconciles: args.max_concurrent_reconciles,
            pod_name,
            identity,
        },
    );
    rt.health.set("informers-synced", Ok(()));

    let mut tasks = JoinSet::new();
    for f in &features {
        // Registered before the task runs: /readyz must not answer 200 in between.
        rt.health.set(
            &f.check_name(),
            Err("starting: waiting for its CRDs".into()),
        );
        tasks.spawn(run_feature(f, rt.clone(), matches.clone()));
    }

    // Wait for a signal, or for something to die.
    let mut failed = false;
    tokio::select! {
        _ = token.cancelled() => {}
        Some(res) = servers.join_next() => {
            error!(result = ?res, "an admin server stopped unexpectedly; shutting down");
            failed = true;
        }
        Some(res) = tasks.join_next() => {
            if !token.is_cancelled() {
                error!(result = ?res.map(|_| ()), "a feature stopped unexpectedly; shutting down");
                failed = true;
            }
        }
    }
    token.cancel();
    health.set("shutdown", Err("shutting down".into()));

    let drained = tokio::time::timeout(args.graceful_shutdown_timeout, async {
        while tasks.join_next().await.is_some() {}
    })
    .await
    .is_ok();
    if !drained {
        error!(timeout = %crate::godur::format(args.graceful_shutdown_timeout), "in-flight reconciles did not finish in time");
        tasks.abort_all();
    }
    if let Some(e) = election {
        e.release().await;
    }
    servers_stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while servers.join_next().await.is_some() {}
    })
    .await;
    info!("stopped");
    Ok(if failed || !drained { 1 } else { 0 })
}

/// Waits for the feature's CRDs, then runs it. A missing CRD or invalid setting fails only this
/// feature's readiness check; the feature starts by itself once its CRDs appear.
async fn run_feature(f: &'static Feature, rt: Runtime, matches: clap::ArgMatches) {
    let check = f.check_name();
    let crds: Api<CustomResourceDefinition> = Api::all(rt.client.clone());
    rt.health.set(
        &check,
        Err("checking the feature's CustomResourceDefinitions".into()),
    );
    // All at once: one after the other they wait behind the other features' initial lists.
    // The readiness message names every CRD still missing.
    let names: Vec<String> = f.installed_crds().iter().map(|c| c.name_any()).collect();
    let problems = std::sync::Mutex::new(std::collections::BTreeMap::<String, String>::new());
    let publish = |name: &str, problem: Option<String>| {
        let mut p = problems.lock().expect("lock");
        match problem {
            Some(msg) => p.insert(name.to_string(), msg),
            None => p.remove(name),
        };
        if !p.is_empty() {
            let all: Vec<&str> = p.values().map(String::as_str).collect();
            rt.health.set(&check, Err(all.join("; ")));
        }
    };
    let waits = names.iter().map(|name| async {
        let up = wait_established(&crds, name, f.name, &rt.shutdown, |msg| {
            publish(name, Some(msg));
        })
        .await;
        if up {
            publish(name, None);
        }
        up
    });
    if !futures::future::join_all(waits)
        .await
        .into_iter()
        .all(|up| up)
    {
        return;
    }
    // Ready once the feature's controllers have their initial lists (see Runtime::track_synced).
    rt.health.set(
        &check,
        Err("starting: waiting for the feature's watches to list".into()),
    );
    info!(feature = f.name, "starting feature");
    let rt = rt.for_feature(f.name);
    match (f.start)(rt.clone(), matches).await {
        Err(msg) => {
            error!(feature = f.name, "feature not started: {msg}");
            rt.health.set(&check, Err(msg));
            rt.shutdown.cancelled().await;
        }
        Ok(()) if !rt.shutdown.is_cancelled() => {
            error!(feature = f.name, "feature stopped before shutdown");
        }
        Ok(()) => info!(feature = f.name, "feature drained"),
    }
}

/// Waits until the CRD `name` is Established; false when shutdown came first. API errors (an
/// unreachable or restarting API server) are retried with backoff, never fatal: the manager
/// must outlive an API outage, also at start. `status` receives the readiness message.
async fn wait_established(
    crds: &Api<CustomResourceDefinition>,
    name: &str,
    feature: &str,
    shutdown: &CancellationToken,
    status: impl Fn(String),
) -> bool {
    let missing = format!("CustomResourceDefinition {name} is not installed or not Established");
    let mut failures = 0u32;
    loop {
        match crds.get_opt(name).await {
            Ok(Some(c)) if conditions::is_crd_established().matches_object(Some(&c)) => {
                return true;
            }
            Ok(_) if failures == 0 => {
                status(missing.clone());
                error!(feature, crd = %name, "{missing}; the feature starts once it is applied (see `ucm crds`)");
            }
            Ok(_) => status(missing.clone()),
            Err(e) => {
                status(format!("cannot read CustomResourceDefinition {name}: {e}"));
                warn!(feature, crd = %name, error = %e, "cannot read CustomResourceDefinitions; retrying");
            }
        }
        let waited = tokio::select! {
            _ = shutdown.cancelled() => return false,
            r = await_condition(crds.clone(), name, conditions::is_crd_established()) => r,
        };
        match waited {
            Ok(_) => {
                info!(feature, crd = %name, "CRD established");
                return true;
            }
            Err(e) => {
                failures += 1;
                let wait = super::controller::backoff(failures, Duration::from_secs(30));
                warn!(feature, crd = %name, error = %e, retry_in = ?wait, "watching the CRD failed; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return false,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An API server that refuses connections keeps the wait going (no early return that would
    /// end the feature and the manager); only shutdown ends it.
    #[tokio::test]
    async fn crd_wait_outlives_an_unreachable_api_server() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cfg = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let crds: Api<CustomResourceDefinition> = Api::all(Client::try_from(cfg).unwrap());
        let shutdown = CancellationToken::new();
        let messages = std::sync::Mutex::new(Vec::new());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            stop.cancel();
        });
        let started = std::time::Instant::now();
        let established = wait_established(&crds, "widgets.example.com", "f", &shutdown, |m| {
            messages.lock().unwrap().push(m);
        })
        .await;
        assert!(!established);
        assert!(started.elapsed() >= Duration::from_millis(2400));
        let messages = messages.into_inner().unwrap();
        assert!(
            messages
                .iter()
                .any(|m| m.starts_with("cannot read CustomResourceDefinition widgets.example.com")),
            "{messages:?}"
        );
    }
}

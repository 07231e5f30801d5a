//! `ucm snapshot-agent` start-up and shutdown: caches, journal adoption, workers, heartbeat,
//! admin server; and the agent's registration with the feature ([`AGENT`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::runtime::Guarded;
use clap::FromArgMatches;
use futures::StreamExt;
use futures::future::BoxFuture;
use kube::{
    Api, Client, ResourceExt,
    runtime::{
        WatchStreamExt,
        events::{Recorder, Reporter},
        reflector::{self},
        watcher,
    },
};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::barrier::{Barrier, drbd::Drbd, fake::FakeBarrier};
use super::cmd::Runner;
use super::journal::Journal;
use super::pools;
use crate::runtime::{Agent, health::Health, http, logging, metrics::Metrics, shutdown};
use crate::snapshot::types::{MiroirSnapshot, MiroirVolume};

use super::args::{AgentArgs, BarrierKind, NAME, command};
use super::context::{Context, Memory, Settings};
use super::heartbeat::heartbeat;
use super::metrics::AgentMetrics;

pub(super) fn run_agent(m: clap::ArgMatches) -> BoxFuture<'static, anyhow::Result<()>> {
    Box::pin(async move {
        let args = AgentArgs::from_arg_matches(&m)?;
        main(args).await
    })
}

/// The agent as registered with the feature.
pub const AGENT: Agent = Agent {
    name: NAME,
    command,
    run: run_agent,
};

pub(super) async fn client(kubeconfig: Option<&str>) -> anyhow::Result<Client> {
    crate::runtime::manager::client(kubeconfig).await
}

pub async fn main(args: AgentArgs) -> anyhow::Result<()> {
    logging::init(args.log_level.as_deref(), args.log_format).map_err(|e| anyhow::anyhow!(e))?;
    if args.node_name.is_empty() {
        anyhow::bail!("--node-name (or NODE_NAME) is required");
    }
    if args.cut_guard >= args.deadline {
        anyhow::bail!("--snapshot-cut-guard must be shorter than --snapshot-deadline");
    }
    let node = args.node_name.clone();
    let barrier: Arc<dyn Barrier> = match args.barrier {
        BarrierKind::Drbd => Arc::new(Drbd::new(Runner::new(args.barrier_timeout))),
        BarrierKind::Fake => {
            let dir = args
                .fake_barrier_dir
                .clone()
                .ok_or_else(|| anyhow::anyhow!("--barrier=fake needs --fake-barrier-dir"))?;
            std::fs::create_dir_all(&dir)?;
            Arc::new(FakeBarrier::new(node.clone(), dir))
        }
    };
    let pools = match &args.pools {
        Some(p) => pools::build(
            &pools::load(p).map_err(|e| anyhow::anyhow!(e))?,
            args.backend_timeout,
            args.loopfile_full_copy,
        ),
        None => BTreeMap::new(),
    };
    for (name, b) in &pools {
        if let Err(e) = b.probe().await {
            warn!(pool = %name, error = %e, "pool probe failed; cuts in this pool will fail until it is fixed");
        }
    }
    let journal = Journal::open(&args.journal)
        .map_err(|e| anyhow::anyhow!("journal {}: {e}", args.journal.display()))?;
    let namespace = args
        .namespace
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".into());
    info!(node = %node, barrier = ?args.barrier, pools = ?pools.keys().collect::<Vec<_>>(), journal = %args.journal.display(), "starting ucm snapshot-agent");

    let client = client(args.kubeconfig.as_deref()).await?;
    let metrics = Arc::new(Metrics::new());
    let agent_metrics = AgentMetrics::register(&metrics.registry);
    // Every configured backend's histograms exist from the start (empty, not absent), so a
    // dashboard panel shows 0 before the first round, not "No data".
    for b in pools.values() {
        let kind = b.kind();
        agent_metrics
            .barrier_held_seconds
            .with_label_values(&[kind.as_str()]);
        agent_metrics
            .cut_seconds
            .with_label_values(&[kind.as_str()]);
    }
    let health = Health::new();
    let token = CancellationToken::new();
    shutdown::install(token.clone());
    let servers_stop = CancellationToken::new();
    let mut servers = tokio::task::JoinSet::new();
    if let Some(addr) = args.metrics_bind_address.addr() {
        let l = http::bind(addr, "--metrics-bind-address").await?;
        servers.spawn(http::serve_metrics(
            l,
            metrics.registry.clone(),
            servers_stop.clone(),
        ));
    }
    if let Some(addr) = args.health_probe_bind_address.addr() {
        let l = http::bind(addr, "--health-probe-bind-address").await?;
        servers.spawn(http::serve_health(l, health.clone(), servers_stop.clone()));
    }
    health.set(
        "informers-synced",
        Err("waiting for the initial list of snapshots and volumes".into()),
    );

    let (snap_reader, snap_writer) = reflector::store::<Guarded<MiroirSnapshot>>();
    let (vol_reader, vol_writer) = reflector::store::<Guarded<MiroirVolume>>();
    let ctx = Arc::new(Context {
        node: node.clone(),
        settings: Settings {
            deadline: args.deadline,
            cut_guard: args.cut_guard,
        },
        fail_limit: args.barrier_fail_limit.max(1),
        snapshots: Api::all(client.clone()),
        snap_store: snap_reader.clone(),
        vol_store: vol_reader.clone(),
        barrier,
        pools,
        journal: Mutex::new(journal),
        mem: Mutex::new(Memory::default()),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "ucm-snapshot-agent".into(),
                instance: Some(node.clone()),
            },
        ),
        metrics: agent_metrics,
        workers: Mutex::new(HashMap::new()),
        synced: tokio::sync::watch::channel((false, false)).0,
        volume_locks: Mutex::new(HashMap::new()),
        stopping: AtomicBool::new(false),
        beat_now: tokio::sync::Notify::new(),
    });

    // Sweep at start (before acting on anything), then every interval.
    ctx.sweep().await;
    ctx.update_gauge().await;

    let snap_events = watcher(
        Api::<Guarded<MiroirSnapshot>>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(snap_writer);
    let vol_events = watcher(
        Api::<Guarded<MiroirVolume>>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(vol_writer);
    let c1 = ctx.clone();
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(async move {
        let mut s = std::pin::pin!(snap_events);
        while let Some(ev) = s.next().await {
            match ev {
                Ok(
                    watcher::Event::Apply(g)
                    | watcher::Event::Delete(g)
                    | watcher::Event::InitApply(g),
                ) => {
                    if let Ok(snap) = &g.0 {
                        c1.notify(&snap.spec.volume_name);
                        // A round naming this node: renew the heartbeat now (a waiting beat
                        // only; the renewals during the round follow on their own timer).
                        if super::heartbeat::names_in_live_round(
                            snap,
                            &c1.node,
                            jiff::Timestamp::now(),
                            c1.settings.deadline,
                        ) {
                            c1.beat_now.notify_waiters();
                        }
                    }
                }
                // The store swaps in the new list at InitDone: look at every volume again.
                Ok(watcher::Event::InitDone) => {
                    c1.synced.send_modify(|s| s.0 = true);
                    c1.notify_all();
                }
                Ok(_) => {}
                Err(e) => warn!(error = %e, "snapshot watch error"),
            }
        }
    });
    let c2 = ctx.clone();
    tasks.spawn(async move {
        let mut s = std::pin::pin!(vol_events);
        while let Some(ev) = s.next().await {
            match ev {
                Ok(watcher::Event::Apply(g) | watcher::Event::Delete(g)) => {
                    let name = g.name_any();
                    let exists = c2
                        .workers
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .contains_key(&name);
                    if exists {
                        c2.notify(&name);
                    }
                }
                Ok(watcher::Event::InitDone) => {
                    c2.synced.send_modify(|s| s.1 = true);
                    c2.notify_all();
                }
                Ok(_) => {}
                Err(e) => warn!(error = %e, "volume watch error"),
            }
        }
    });
    // Journal entries from an earlier run: their workers start now, even before any event.
    let vols: Vec<String> = ctx
        .journal
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entries()
        .map(|e| e.volume.clone())
        .collect();
    for v in vols {
        ctx.notify(&v);
    }
    {
        let h = health.clone();
        let mut rx = ctx.synced.subscribe();
        tasks.spawn(async move {
            if rx.wait_for(|(a, b)| *a && *b).await.is_ok() {
                h.set("informers-synced", Ok(()));
            }
        });
    }
    tasks.spawn(heartbeat(
        client.clone(),
        namespace,
        ctx.clone(),
        args.heartbeat_interval,
        args.round_heartbeat_interval,
        token.clone(),
    ));
    let c3 = ctx.clone();
    let sweep_interval = args.sweep_interval;
    tasks.spawn(async move {
        loop {
            tokio::time::sleep(sweep_interval).await;
            c3.sweep().await;
            c3.prune_memory();
        }
    });
    let c4 = ctx.clone();
    tasks.spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(15)).await;
            c4.update_gauge().await;
        }
    });

    token.cancelled().await;
    health.set("shutdown", Err("shutting down".into()));
    // Stop (docs/snapshot.md, "Deadline, void and recovery"): report Error for held barriers of
    // live rounds, keep them until the round ends or the deadline passes, then lift and exit.
    ctx.stopping.store(true, Ordering::Relaxed);
    ctx.notify_all();
    let limit = Instant::now() + args.deadline + Duration::from_secs(5);
    while !ctx
        .journal
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_empty()
        && Instant::now() < limit
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ctx.sweep().await;
    tasks.abort_all();
    servers_stop.cancel();
    info!("stopped");
    Ok(())
}

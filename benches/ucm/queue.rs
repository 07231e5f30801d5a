//! Phase `queue` (docs/benchmarks.md, "The lease scheduler"; docs/exporter.md, "Lease
//! scheduling"): the lease scheduler under contention. Per run, on a fresh control plane and a
//! manager with the shipped defaults (as the `leases` phase):
//! 1. 5,000 Exporters in one namespace, every tenth made online and kept online (as in `leases`);
//!    50 of the online ones also carry `ucm-bench-board: scarce`;
//! 2. one ExporterAccessPolicy on those 50 giving priority 30, 20 or 10 by the Client's `tier`
//!    label, and three Clients per tier;
//! 3. 2,000 Leases of an hour selecting the scarce label, the tiers in turn, created 8 at a time;
//!    a watch releases each (`spec.release`, as `jmp` does) as soon as it has an exporter, until
//!    every Lease was assigned;
//! 4. checks that panic (every Lease assigned once, to a free scarce Exporter; none passed over
//!    for a later Lease of its priority), and the figures: lease passes (manager /metrics), their
//!    CPU, the manager's reads (audit log), status writes of waiting Leases (the watch).

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::Api;
use kube::api::PostParams;
use kube::runtime::watcher;
use serde_json::{Value, json};
use ucm::exporter::crd::{Client, Exporter, ExporterAccessPolicy, Lease};
use ucm::exporter::decide::lease::queue::QueueKey;

use crate::Ctx;
use crate::bulk::manager_args;
use crate::cluster::{Counts, Plane};
use crate::kube_util::{create_all, create_namespace, track};
use crate::leases::{
    self, ONLINE, POOL, client_done, exporter_name, is_online, keep_online, online_done,
    online_patches, patch_all,
};
use crate::procs::Proc;
use crate::report::{Figure, median};
use crate::steps::{LABEL, Samples, WAIT, bd_insert, exporter_done, manager_quiet, obj, timed};

mod watch;

use watch::{Churn, Row, SLACK, churn, fairness, wait_until};

const PHASE: &str = "queue";
const NS: &str = "bench";
/// The label of the exporters every Lease competes for.
const BOARD: &str = "ucm-bench-board";
const SCARCE: &str = "scarce";
/// Client `tier` label → policy priority.
const TIERS: [(&str, i64); 3] = [("high", 30), ("mid", 20), ("low", 10)];
const WAIT_KEYS: [&str; 3] = ["queue.wait.high", "queue.wait.mid", "queue.wait.low"];
/// Leases asking the same (selector, Client, duration) share one candidate computation
/// (docs/exporter.md, "Lease scheduling", Cost): a few Clients each holding many Leases, as a CI
/// system does. Nothing limits the active Leases of one Client, here or upstream.
const CLIENTS_PER_TIER: usize = 3;
/// Generous: each waiting Lease's pass queues behind the others' (an estimate, not yet measured:
/// 10–40 min on 2 cores), and a timeout loses the run.
const ALL_ASSIGNED: Duration = Duration::from_secs(60 * 60);
const RECONCILE: &str = "controller_runtime_reconcile_time_seconds";
const LEASE_CTL: &str = "controller=\"lease\"";

fn is_scarce(i: usize) -> bool {
    i.is_multiple_of(100)
}

fn exporter(i: usize, run: &str) -> Exporter {
    let mut e = leases::exporter(i, run);
    if is_scarce(i) {
        let labels = e.metadata.labels.get_or_insert_default();
        labels.insert(BOARD.into(), SCARCE.into());
    }
    e
}

fn client_name(tier: usize, j: usize) -> String {
    format!("client-{}-{j}", TIERS[tier].0)
}

fn client(tier: usize, j: usize, run: &str) -> Client {
    obj(json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Client",
        "metadata": {"name": client_name(tier, j), "labels": {LABEL: run, "tier": TIERS[tier].0}},
        "spec": {}
    }))
}

fn lease_name(i: usize) -> String {
    format!("q-{i:05}")
}

/// The priority of the Lease named `name`: tier `i % 3`.
fn priority(name: &str) -> i64 {
    TIERS[name[2..].parse::<usize>().unwrap_or(0) % TIERS.len()].1
}

/// Lease `i`: tier `i % 3`, so creation order interleaves the priorities.
fn lease(i: usize, run: &str) -> Lease {
    let client = client_name(i % TIERS.len(), (i / TIERS.len()) % CLIENTS_PER_TIER);
    obj(json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": lease_name(i), "labels": {LABEL: run}},
        "spec": {"clientRef": {"name": client}, "duration": "1h",
                 "selector": {"matchLabels": {BOARD: SCARCE}}}
    }))
}

fn policy(run: &str) -> ExporterAccessPolicy {
    let rules: Vec<Value> = TIERS
        .iter()
        .map(|(t, p)| {
            json!({"description": format!("tier {t}"), "priority": p,
                   "from": [{"clientSelector": {"matchLabels": {"tier": t}}}]})
        })
        .collect();
    obj(json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "ExporterAccessPolicy",
        "metadata": {"name": "tiers", "labels": {LABEL: run}},
        "spec": {"exporterSelector": {"matchLabels": {BOARD: SCARCE}}, "policies": rules}
    }))
}

fn lease_status_writes(c: &Counts) -> u64 {
    let n = |v: &str| {
        c.by_kind
            .get(&format!("{v} leases.jumpstarter.dev/status"))
            .copied()
    };
    n("patch").unwrap_or(0) + n("update").unwrap_or(0)
}

/// Exporters, the policy, the Clients, and the online Exporters (kept online by the task
/// returned).
async fn setup(p: &Plane, m: &Proc, n: usize, run: &str) -> tokio::task::JoinHandle<()> {
    let api: Api<Exporter> = Api::namespaced(p.admin.clone(), NS);
    let objs = (0..n).map(|i| exporter(i, run)).collect();
    timed(p, m, api.clone(), objs, exporter_done, run, "Exporters").await;
    // Before the Clients, whose credentials are awaited: a Lease decided before the policy is
    // cached would wait without its priority (docs/exporter.md, "Lease assignment").
    Api::<ExporterAccessPolicy>::namespaced(p.admin.clone(), NS)
        .create(&PostParams::default(), &policy(run))
        .await
        .unwrap();
    let clients: Vec<Client> = (0..TIERS.len())
        .flat_map(|t| (0..CLIENTS_PER_TIER).map(move |j| client(t, j, run)))
        .collect();
    let capi = Api::namespaced(p.admin.clone(), NS);
    timed(p, m, capi, clients, client_done, run, "Clients").await;
    let devices: Arc<Vec<(String, String)>> = Arc::new(
        (0..n)
            .filter(|i| is_online(*i))
            .map(|i| (exporter_name(i), uuid::Uuid::new_v4().to_string()))
            .collect(),
    );
    let cfg = watcher::Config::default().labels(&format!("{LABEL}={run},{POOL}={ONLINE}"));
    let tracker = track(api.clone(), cfg, devices.len(), online_done);
    let errors = patch_all(&api, online_patches(&devices), true).await;
    assert!(errors.is_empty(), "queue phase: online patch: {errors:?}");
    tracker.wait("Exporters online", WAIT).await;
    keep_online(api, devices)
}

/// Creates the Leases and runs the churn until every Lease was assigned and has ended; returns
/// the watch's records and the manager's counts over the churn.
async fn churn_step(p: &Plane, m: &Proc, n: usize, run: &str, scarce: &HashSet<String>) -> Run {
    let leases: Api<Lease> = Api::namespaced(p.admin.clone(), NS);
    let state = Arc::new(Mutex::new(Churn::new(scarce.clone())));
    let watch = churn(leases.clone(), run, state.clone());
    wait_until(&state, "Lease watch listed", WAIT, |c| c.listed).await;
    let (before, off0, cpu0) = (
        m.histogram(RECONCILE, LEASE_CTL).await,
        p.audit.offset(),
        m.cpu(),
    );
    let t0 = Instant::now();
    create_all(&leases, (0..n).map(|i| lease(i, run)).collect()).await;
    wait_until(&state, "every Lease assigned", ALL_ASSIGNED, |c| {
        c.assigned == n
    })
    .await;
    wait_until(&state, "every Lease ended", WAIT, |c| c.ended == n).await;
    manager_quiet(p).await;
    watch.abort();
    let passes = m.histogram(RECONCILE, LEASE_CTL).await.since(&before, 0.99);
    let counts = p.audit.count(off0, p.audit.offset()).remove("ucm-manager");
    let churn = std::mem::take(&mut *state.lock().unwrap());
    let rows = churn.recs.iter().map(|(name, r)| Row {
        key: QueueKey {
            priority: priority(name),
            created: r.created,
            name: name.clone(),
        },
        seen: r.seen.expect("seen"),
        assigned: r.assigned.expect("assigned"),
        ended: r.ended,
    });
    Run {
        t0,
        rows: rows.collect(),
        churn,
        passes,
        cpu: m.cpu() - cpu0,
        counts: counts.unwrap_or_default(),
    }
}

/// One run's observations.
struct Run {
    t0: Instant,
    rows: Vec<Row>,
    churn: Churn,
    /// Lease passes since the first create: number, mean and p99 (s).
    passes: (f64, f64, f64),
    cpu: f64,
    counts: Counts,
}

/// The fairness assertion, and the run's samples.
fn record(r: &Run, slots: usize, s: &mut Samples, bd: &mut BTreeMap<&'static str, String>) {
    let (c, nf) = (&r.churn, r.rows.len() as f64);
    let f = fairness(&r.rows, slots, r.t0);
    assert!(
        f.violations.is_empty(),
        "queue phase: {} Leases passed over earlier Leases of their priority: {:#?}",
        f.violations.len(),
        &f.violations[..f.violations.len().min(20)]
    );
    let last = r.rows.iter().map(|x| x.assigned).max().unwrap_or(r.t0);
    let (passes, mean, p99) = r.passes;
    s.push("queue.secs", (last - r.t0).as_secs_f64());
    s.push("queue.pass_ms", mean * 1000.0);
    s.push("queue.pass_p99_ms", p99 * 1000.0);
    s.push("queue.passes_per_assignment", passes / nf);
    s.push("queue.cpu_per_pass_ms", r.cpu * 1000.0 / passes);
    s.push(
        "queue.reads",
        r.counts.reads_besides_coordination_leases() as f64 / nf,
    );
    s.push(
        "queue.status_writes",
        lease_status_writes(&r.counts) as f64 / nf,
    );
    s.push("queue.pending_writes", c.writes as f64 / nf);
    s.push(
        "queue.writes_per_change",
        c.writes as f64 / c.changes as f64,
    );
    s.push("queue.lower_first", f.lower_first as f64 * 100.0 / nf);
    for (key, (_, prio)) in WAIT_KEYS.into_iter().zip(TIERS) {
        let tier = r.rows.iter().filter(|x| x.key.priority == prio);
        let waits: Vec<f64> = tier.map(|x| (x.assigned - x.seen).as_secs_f64()).collect();
        s.push(key, median(&waits));
    }
    let details = [
        (
            "passes",
            format!("{passes:.0} lease passes, manager CPU {:.1} s", r.cpu),
        ),
        (
            "writes",
            format!(
                "{} writes of waiting Leases; {} changed the position, {} the position or the Pending message",
                c.writes, c.positions, c.changes
            ),
        ),
        (
            "fairness",
            format!(
                "{} of {nf} assigned while a higher-priority Lease waited, {} of them with as many Leases ahead waiting as exporters free; {} assigned more than {SLACK:?} before an earlier Lease of their priority",
                f.lower_first, f.lower_beyond_free, f.out_of_order
            ),
        ),
        ("requests", r.counts.top(6)),
    ];
    for (k, v) in details {
        bd_insert(bd, k, v);
    }
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let n = ctx.scale.exporters;
    let n_leases = (n * 2 / 5).max(1);
    let scarce: HashSet<String> = (0..n)
        .filter(|i| is_scarce(*i))
        .map(exporter_name)
        .collect();
    let mut s = Samples::default();
    let mut bd = BTreeMap::new();
    for r in 0..ctx.runs {
        eprintln!("queue run {}/{}", r + 1, ctx.runs);
        let dir = ctx.work.join(format!("queue-{r}"));
        std::fs::create_dir_all(&dir).unwrap();
        let run = format!("q{r}");
        let p = Plane::start(&dir.join("cp")).await;
        create_namespace(&p.admin, NS).await;
        let mut m = Proc::manager(
            &p.manager_kubeconfig,
            dir.join("manager.log"),
            &manager_args(),
        );
        m.wait_ready(Duration::from_secs(120)).await;
        let refresher = setup(&p, &m, n, &run).await;
        record(
            &churn_step(&p, &m, n_leases, &run, &scarce).await,
            scarce.len(),
            &mut s,
            &mut bd,
        );
        assert!(
            !refresher.is_finished(),
            "queue phase: the keep-online task stopped"
        );
        refresher.abort();
        m.stop("TERM");
        drop(p);
        if std::env::var("UCM_BENCH_KEEP").as_deref() != Ok("1") {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    figures(n, n_leases, scarce.len(), &s, &bd)
}

fn figures(n: usize, l: usize, k: usize, s: &Samples, bd: &BTreeMap<&str, String>) -> Vec<Figure> {
    let bd = |key: &str| bd.get(key).cloned().unwrap_or_default();
    let med = |key: &str| s.median(key);
    let fig = |id: &str, title: String, unit: &str, key: &str| {
        Figure::new(PHASE, &format!("queue.{id}"), &title, unit, s.get(key))
    };
    let load = format!("{l} Leases for {k} of {n} Exporters, three priorities");
    let cost = format!(
        "docs/exporter.md, \"Lease scheduling\", Cost: O(Leases + Exporters × distinct requests) per pass; here {} distinct requests (one per Client)",
        CLIENTS_PER_TIER * TIERS.len()
    );
    vec![
        fig("seconds", format!("{load}: first create → every Lease assigned, each released once assigned"), "s", "queue.secs")
            .note(format!(
                "{CLIENTS_PER_TIER} Clients per tier (tier label → priority 30/20/10 in one ExporterAccessPolicy), Leases of an hour created 8 at a time with the tiers in turn; a watch releases each Lease (spec.release) as soon as it has an exporter. Median wait (seen → assigned): high {:.1} s, mid {:.1} s, low {:.1} s. Checked (the phase fails otherwise): every Lease assigned once, to a scarce Exporter no other active Lease held; no Lease assigned while as many earlier Leases of its priority surely waited as exporters were free (margins of {SLACK:?} around the watch instants)",
                med("queue.wait.high"), med("queue.wait.mid"), med("queue.wait.low")
            )),
        fig("pass_ms", format!("{load}: mean lease pass (reconcile time)"), "ms", "queue.pass_ms")
            .note(format!(
                "controller_runtime_reconcile_time_seconds{{controller=\"lease\"}} from the manager's /metrics, from the first create until the manager was quiet after the last release; includes the status writes. p99 bucket bound: {:.0} ms. Passes per assignment: {:.1} (each assignment and each release changes an Exporter's leaseRef, which wakes the waiting Leases selecting it that show a position; the Leases behind one leaving the queue are woken within 1 s). Last run: {}. {cost}",
                med("queue.pass_p99_ms"), med("queue.passes_per_assignment"), bd("passes")
            )),
        fig("cpu_per_pass_ms", format!("{load}: manager CPU per lease pass"), "ms", "queue.cpu_per_pass_ms")
            .note("all of the manager's CPU over the churn (its Exporter passes and watches too) / lease passes: an upper bound of one scheduling decision"),
        fig("reads_per_assignment", format!("{load}: manager API reads per assignment"), "reads", "queue.reads")
            .reference(0.0, "docs/exporter.md: the decision reads caches only", false)
            .note(format!("gets and lists by the manager's ServiceAccount in the audit log over the churn, its leader-election Lease apart. Top requests, last run: {}", bd("requests"))),
        fig("pending_writes_per_assignment", format!("{load}: status writes of waiting Leases per assignment"), "writes", "queue.pending_writes")
            .reference(202.0, "docs/exporter.md bound: a queue change writes at most min(N, 101) Leases, and each Lease enters and leaves once", false)
            .note(format!(
                "modifications of Leases without an exporter seen by the watch (only the manager writes them). All Lease status writes in the audit log: {:.2} per assignment",
                med("queue.status_writes")
            )),
        fig("writes_per_change", format!("{load}: status writes of waiting Leases per visible change"), "writes", "queue.writes_per_change")
            .reference(1.0, "each write changes status.queue.position or the Pending message", false)
            .note(format!("last run: {}", bd("writes"))),
        fig("lower_priority_first", format!("{load}: assignments made while a higher-priority Lease waited"), "%", "queue.lower_first")
            .note(format!(
                "reported, not asserted: allowed while more exporters are free than Leases wait ahead (docs/exporter.md, \"Lease scheduling\"). Last run: {}",
                bd("fairness")
            )),
    ]
}

//! Phase `leases` (docs/benchmarks.md): the exporter feature at issue 17's load, each figure next
//! to a bare client measured in the same run where one exists, or to issue 17's goal (the Go
//! controller in the same run is the `peer` phase's). Per run, on a fresh control plane and a
//! manager with the shipped defaults (every feature, leader election, the default worker count):
//! 1. idle RSS at /readyz + 20 s with the CRDs installed and no objects;
//! 2. 5,000 Exporters in one namespace, create → every final status; RSS 5 s later;
//! 3. 500 Clients, create → credential;
//! 4. every tenth Exporter made online by a status patch, patch → Online and Registered, then
//!    kept online by the same patch every 20 s, spread evenly over the period;
//! 5. 50 Leases (one per Client), create → assigned and Ready; released; then 500 Leases, one per
//!    Client, create → assigned and Ready; then the correctness check, which panics (no exporter
//!    with two active leases, every Lease on an online exporter, every credential Secret with a
//!    token and its owner as controller).
//!
//! The bare client runs on a control plane of its own, during the manager's idle 20 s.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use ucm::exporter::crd::{Client, Exporter, Lease};

use crate::Ctx;
use crate::bulk::manager_args;
use crate::cluster::Plane;
use crate::kube_util::{CONCURRENCY, create_namespace, track};
use crate::procs::Proc;
use crate::report::Figure;
use crate::steps::{
    LABEL, Samples, Step, WAIT, bd_insert, exporter_done, manager_quiet, now_str, obj, reference,
    timed, timed_with,
};

const PHASE: &str = "leases";
/// The reference of the figures a bare client measures in the same run.
const BARE: &str = "bare client";
/// Where the Go controller's figures are.
const PEER: &str = "The Go controller v0.9.0 in the same run: the `peer` phase.";
/// The reconcile histogram of the manager's /metrics: its count is the passes.
const RECONCILE: &str = "controller_runtime_reconcile_time_seconds";
pub const NS: &str = "bench";
/// The label only the online Exporters carry; every Lease selects it, so each Lease can take any
/// free online Exporter.
pub const POOL: &str = "ucm-bench-pool";
pub const ONLINE: &str = "online";
/// The reference's status patch interval; the offline threshold is 60 s.
const REFRESH: Duration = Duration::from_secs(20);
const IDLE: Duration = Duration::from_secs(20);

pub fn exporter_name(i: usize) -> String {
    format!("exp-{i:05}")
}

pub fn is_online(i: usize) -> bool {
    i.is_multiple_of(10)
}

pub fn exporter(i: usize, run: &str) -> Exporter {
    let mut labels = json!({ LABEL: run });
    if is_online(i) {
        labels[POOL] = json!(ONLINE);
    }
    obj(json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
        "metadata": {"name": exporter_name(i), "labels": labels}, "spec": {}
    }))
}

pub fn client_name(i: usize) -> String {
    format!("client-{i:04}")
}

pub fn client(i: usize, run: &str) -> Client {
    obj(json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Client",
        "metadata": {"name": client_name(i), "labels": {LABEL: run}}, "spec": {}
    }))
}

/// A Lease of Client `i`, an hour long, for any online Exporter; `step` is its `LABEL` value.
pub fn lease(prefix: &str, i: usize, step: &str) -> Lease {
    obj(json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": format!("lease-{prefix}-{i:04}"), "labels": {LABEL: step}},
        "spec": {
            "clientRef": {"name": client_name(i)},
            "duration": "1h",
            "selector": {"matchLabels": {POOL: ONLINE}},
        }
    }))
}

fn is_true(conds: Option<&Vec<Condition>>, t: &str) -> bool {
    conds
        .into_iter()
        .flatten()
        .any(|c| c.type_ == t && c.status == "True")
}

pub fn client_done(c: &Client) -> bool {
    c.status.as_ref().is_some_and(|s| s.credential.is_some())
}

pub fn online_done(e: &Exporter) -> bool {
    let conds = e.status.as_ref().and_then(|s| s.conditions.as_ref());
    is_true(conds, "Online") && is_true(conds, "Registered")
}

pub fn lease_done(l: &Lease) -> bool {
    l.status.as_ref().is_some_and(|s| {
        !s.ended && s.exporter_ref.is_some() && is_true(s.conditions.as_ref(), "Ready")
    })
}

pub fn lease_ended(l: &Lease) -> bool {
    l.status.as_ref().is_some_and(|s| s.ended)
}

/// What a running exporter's status holds (as in the Go controller's measurement: `lastSeen`,
/// `exporterStatus:
/// Available`, one device), written as one merge patch. Conditions are the manager's to derive
/// (Registered from `devices`, Online from a recent `lastSeen` and a status other than Offline),
/// as the reference left them to the Go controller; ucm's own gRPC path derives them in the
/// same write, which would leave the manager nothing to do in the timed step.
pub fn online_status(uuid: &str) -> Value {
    json!({"status": {
        "lastSeen": now_str(),
        "exporterStatus": "Available",
        "statusMessage": "Available",
        "devices": [{"uuid": uuid, "labels": {"jumpstarter.dev/client": "power"}}],
    }})
}

/// Merge-patches each object (its status when `status`), `CONCURRENCY` at a time; returns the
/// errors.
pub async fn patch_all<K>(api: &Api<K>, items: Vec<(String, Value)>, status: bool) -> Vec<String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    futures::stream::iter(items)
        .map(|(name, body)| async move {
            let pp = PatchParams::default();
            let r = if status {
                api.patch_status(&name, &pp, &Patch::Merge(body)).await
            } else {
                api.patch(&name, &pp, &Patch::Merge(body)).await
            };
            r.err().map(|e| format!("{name}: {e}"))
        })
        .buffer_unordered(CONCURRENCY)
        .filter_map(|e| async move { e })
        .collect()
        .await
}

pub fn online_patches(devices: &[(String, String)]) -> Vec<(String, Value)> {
    devices
        .iter()
        .map(|(name, uuid)| (name.clone(), online_status(uuid)))
        .collect()
}

/// The exporters' processes, as far as the API server sees them: the same status patch every
/// 20 s, each exporter on its own clock. The patches are spread evenly over the period (500
/// exporters: one every 40 ms), as independent exporters' would be, so a timed step meets the same
/// background load wherever it falls in the period; all 500 at once every 20 s made a step's time
/// depend on whether it overlapped that burst.
pub fn keep_online(
    api: Api<Exporter>,
    devices: Arc<Vec<(String, String)>>,
) -> tokio::task::JoinHandle<()> {
    keep_online_every(api, devices, REFRESH)
}

/// [`keep_online`] with each exporter's patch every `period`.
pub fn keep_online_every(
    api: Api<Exporter>,
    devices: Arc<Vec<(String, String)>>,
    period: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let gap = period / devices.len().max(1) as u32;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + gap, gap);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for (name, uuid) in devices.iter().cycle() {
            tick.tick().await;
            // Not awaited here: a slow answer must not hold back the next exporter's beat.
            let (api, name, body) = (api.clone(), name.clone(), online_status(uuid));
            tokio::spawn(async move {
                let pp = PatchParams::default();
                if let Err(e) = api.patch_status(&name, &pp, &Patch::Merge(body)).await {
                    eprintln!("  keep-online patch: {name}: {e}");
                }
            });
        }
    })
}

pub fn fail(what: &str, problems: &[String]) {
    if !problems.is_empty() {
        panic!(
            "{what}: {} problems, first {:?}",
            problems.len(),
            &problems[..problems.len().min(10)]
        );
    }
}

/// The correctness check (the Go controller's measurement: "every Secret present with a token and a
/// controller owner reference; no exporter held two leases"), plus: every active Lease is on an
/// online exporter. Panics with the first problems.
pub async fn check(c: &kube::Client, assigned: usize) {
    let problems = problems(c, assigned).await;
    fail("the correctness check", &problems);
}

/// What [`check`] finds wrong, each problem a line (an exporter with two active leases first).
pub async fn problems(c: &kube::Client, assigned: usize) -> Vec<String> {
    let mut problems = Vec::new();
    let lp = ListParams::default();
    let leases = Api::<Lease>::namespaced(c.clone(), NS)
        .list(&lp)
        .await
        .unwrap();
    let exporters = Api::<Exporter>::namespaced(c.clone(), NS)
        .list(&lp)
        .await
        .unwrap();
    let pool: HashMap<String, bool> = exporters
        .items
        .iter()
        .map(|e| {
            let online = e.labels().get(POOL).map(String::as_str) == Some(ONLINE);
            (e.name_any(), online)
        })
        .collect();
    let mut holders: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for l in leases.items.iter().filter(|l| lease_done(l)) {
        let e = l.status.as_ref().and_then(|s| s.exporter_ref.as_ref());
        holders
            .entry(e.map(|r| r.name.clone()).unwrap_or_default())
            .or_default()
            .push(l.name_any());
    }
    let twice: Vec<String> = holders
        .iter()
        .filter(|(_, ls)| ls.len() > 1)
        .map(|(e, ls)| format!("exporter {e} holds {ls:?}"))
        .collect();
    problems.extend(twice);
    let offline: Vec<String> = holders
        .iter()
        .filter(|(e, _)| pool.get(*e) != Some(&true))
        .map(|(e, ls)| format!("{ls:?} on {e}, not an online exporter of the selector"))
        .collect();
    problems.extend(offline);
    let active = holders.values().map(Vec::len).sum::<usize>();
    if active != assigned {
        problems.push(format!(
            "{active} active assigned leases, expected {assigned}"
        ));
    }

    let secrets: HashMap<String, Secret> = Api::<Secret>::namespaced(c.clone(), NS)
        .list(&lp)
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|s| (s.name_any(), s))
        .collect();
    let clients = Api::<Client>::namespaced(c.clone(), NS)
        .list(&lp)
        .await
        .unwrap();
    let owners = exporters
        .items
        .iter()
        .map(|e| (format!("{}-exporter", e.name_any()), e.uid()))
        .chain(
            clients
                .items
                .iter()
                .map(|c| (format!("{}-client", c.name_any()), c.uid())),
        );
    let mut bad = Vec::new();
    for (secret, uid) in owners {
        let Some(s) = secrets.get(&secret) else {
            bad.push(format!("{secret}: missing"));
            continue;
        };
        let token = s
            .data
            .as_ref()
            .and_then(|d| d.get("token"))
            .is_some_and(|t| !t.0.is_empty());
        let owned = s
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|r| r.controller == Some(true) && Some(&r.uid) == uid.as_ref());
        if !token || !owned {
            bad.push(format!("{secret}: token {token}, controller owner {owned}"));
        }
    }
    problems.extend(bad);
    if problems.is_empty() {
        eprintln!(
            "  check: {active} active leases on distinct online exporters; {} credential Secrets with a token and their owner as controller",
            exporters.items.len() + clients.items.len()
        );
    } else {
        eprintln!(
            "  check: {} problems, first {:?}",
            problems.len(),
            &problems[..problems.len().min(5)]
        );
    }
    problems
}

/// One run's lease steps, per assignment.
fn push_lease_counts(s: &mut Samples, steps: &[&Step], n: usize) {
    let n = n as f64;
    let sum = |f: &dyn Fn(&Step) -> u64| steps.iter().map(|st| f(st)).sum::<u64>() as f64 / n;
    s.push("leases.requests", sum(&|st| st.requests()));
    s.push("leases.writes", sum(&|st| st.writes()));
    s.push(
        "leases.conflicts",
        sum(&|st| st.manager.code_besides_coordination_leases(409)),
    );
}

/// What [`load`] measured: each timed step, the RSS 5 s after the Exporters' step, and the lease
/// passes of the second lease step (`controller_runtime_reconcile_time_seconds` count).
pub struct Load {
    pub exporters: Step,
    pub rss_after: f64,
    pub clients: Step,
    pub online: Step,
    pub first: Step,
    pub all: Step,
    pub lease_passes: f64,
    /// What the correctness check found (empty when strict: it panicked instead).
    pub problems: Vec<String>,
}

/// The exporter feature's load on a plane where the controller `m` runs (ucm, or in phase `peer`
/// the Go controller, under the same ServiceAccount so the audit log counts both alike): `n`
/// Exporters in namespace [`NS`], create → every final status; RSS 5 s later; `n / 10` Clients,
/// create → credential; every tenth Exporter made online by a status patch, patch → Online and
/// Registered, then kept online by the same patch every 20 s; `first` Leases (one per Client),
/// create → assigned and Ready, released; then `n / 10` Leases, one per Client, create → assigned
/// and Ready; then [`check`], which panics on a wrong result.
/// With `strict`, a failed check panics; else its problems are in [`Load::problems`].
pub async fn load(p: &Plane, m: &Proc, n: usize, first: usize, run: &str, strict: bool) -> Load {
    let c = p.admin.clone();
    let online: Vec<usize> = (0..n).filter(|i| is_online(*i)).collect();
    let m_clients = online.len();
    let exporters: Api<Exporter> = Api::namespaced(c.clone(), NS);
    let exporters_step = timed(
        p,
        m,
        exporters.clone(),
        (0..n).map(|i| exporter(i, run)).collect(),
        exporter_done,
        run,
        "Exporters",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let rss_after = m.rss() as f64;

    let clients = timed(
        p,
        m,
        Api::<Client>::namespaced(c.clone(), NS),
        (0..m_clients).map(|i| client(i, run)).collect(),
        client_done,
        run,
        "Clients",
    )
    .await;

    // One Exporter in ten online.
    let devices: Arc<Vec<(String, String)>> = Arc::new(
        online
            .iter()
            .map(|i| (exporter_name(*i), uuid::Uuid::new_v4().to_string()))
            .collect(),
    );
    let tracker = track(
        exporters.clone(),
        watcher::Config::default().labels(&format!("{LABEL}={run},{POOL}={ONLINE}")),
        online.len(),
        online_done,
    );
    let online_step = timed_with(p, m, tracker, "Exporters online", async {
        fail(
            "online status patch",
            &patch_all(&exporters, online_patches(&devices), true).await,
        );
    })
    .await;
    let refresher = keep_online(exporters.clone(), devices.clone());

    // Leases: `first`, released, then one per Client.
    let leases: Api<Lease> = Api::namespaced(c.clone(), NS);
    let step_a = format!("{run}-a");
    let a = timed(
        p,
        m,
        leases.clone(),
        (0..first).map(|i| lease("a", i, &step_a)).collect(),
        lease_done,
        &step_a,
        "Leases (first)",
    )
    .await;
    let ended = track(
        leases.clone(),
        watcher::Config::default().labels(&format!("{LABEL}={step_a}")),
        first,
        lease_ended,
    );
    let release: Vec<(String, Value)> = (0..first)
        .map(|i| {
            (
                format!("lease-a-{i:04}"),
                json!({"spec": {"release": true}}),
            )
        })
        .collect();
    let t0 = Instant::now();
    fail("lease release", &patch_all(&leases, release, false).await);
    ended.wait("first Leases released", WAIT).await;
    eprintln!(
        "  {first} Leases released and ended in {:.2}s",
        t0.elapsed().as_secs_f64()
    );
    manager_quiet(p).await;
    let step_b = format!("{run}-b");
    let passes0 = m.histogram(RECONCILE, "controller=\"lease\"").await;
    let b = timed(
        p,
        m,
        leases.clone(),
        (0..m_clients).map(|i| lease("b", i, &step_b)).collect(),
        lease_done,
        &step_b,
        "Leases",
    )
    .await;
    let passes = m.histogram(RECONCILE, "controller=\"lease\"").await;
    assert!(!refresher.is_finished(), "the keep-online task stopped");
    let problems = problems(&c, m_clients).await;
    if strict {
        fail("the correctness check", &problems);
    }
    refresher.abort();
    Load {
        exporters: exporters_step,
        rss_after,
        clients,
        online: online_step,
        first: a,
        all: b,
        lease_passes: passes.count - passes0.count,
        problems,
    }
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let n = ctx.scale.exporters;
    let online: Vec<usize> = (0..n).filter(|i| is_online(*i)).collect();
    // One Client and one Lease per ten Exporters, as the reference; the first lease step is a
    // tenth of that.
    let m_clients = online.len();
    let first = (m_clients / 10).max(1);
    let mut s = Samples::default();
    let mut bd: BTreeMap<&'static str, String> = BTreeMap::new();
    for r in 0..ctx.runs {
        eprintln!("leases run {}/{}", r + 1, ctx.runs);
        let dir = ctx.work.join(format!("leases-{r}"));
        std::fs::create_dir_all(&dir).unwrap();
        let run = format!("r{r}");

        let refp = Plane::start(&dir.join("cp-ref")).await;
        let p = Plane::start(&dir.join("cp")).await;
        let c = p.admin.clone();
        create_namespace(&c, NS).await;
        let mut m = Proc::manager(
            &p.manager_kubeconfig,
            dir.join("manager.log"),
            &manager_args(),
        );
        m.wait_ready(Duration::from_secs(120)).await;
        let ready = Instant::now();

        // The bare client on its own control plane while the manager idles.
        {
            let rc = refp.admin.clone();
            create_namespace(&rc, NS).await;
            let (t, cpu) = reference(
                &refp,
                Api::<Exporter>::namespaced(rc.clone(), NS),
                "exporter",
                (0..n).map(|i| exporter(i, &run)).collect(),
                exporter_done,
                &run,
            )
            .await;
            s.push("ref.exporters.rate", n as f64 / t);
            s.push("ref.exporters.api_cpu", cpu * 1000.0 / n as f64);
            let (t, _) = reference(
                &refp,
                Api::<Client>::namespaced(rc.clone(), NS),
                "client",
                (0..m_clients).map(|i| client(i, &run)).collect(),
                client_done,
                &run,
            )
            .await;
            s.push("ref.clients.secs", t);
            let (t, _) = reference(
                &refp,
                Api::<Lease>::namespaced(rc.clone(), NS),
                "lease",
                (0..m_clients).map(|i| lease("b", i, &run)).collect(),
                lease_done,
                &run,
            )
            .await;
            s.push("ref.leases.secs", t);
        }
        drop(refp);
        tokio::time::sleep(IDLE.saturating_sub(ready.elapsed())).await;
        let rss0 = m.rss() as f64;
        s.push("rss.zero", rss0 / f64::from(1 << 20));
        s.push("rss.zero_after", ready.elapsed().as_secs_f64());

        let l = load(&p, &m, n, first, &run, true).await;
        let st = &l.exporters;
        let per = |x: u64| x as f64 / n as f64;
        s.push("exporters.rate", n as f64 / st.secs);
        s.push("exporters.requests", per(st.requests()));
        s.push("exporters.writes", per(st.writes()));
        s.push(
            "exporters.leader_lease",
            st.manager.coordination_lease_requests() as f64,
        );
        s.push("exporters.api_cpu", st.apiserver_cpu * 1000.0 / n as f64);
        s.push("exporters.manager_cpu", st.manager_cpu * 1000.0 / n as f64);
        bd_insert(&mut bd, "exporters", st.manager.top(8));
        s.push("rss.after", l.rss_after / f64::from(1 << 20));
        s.push("rss.per_exporter", (l.rss_after - rss0) / n as f64 / 1024.0);
        s.push("clients.secs", l.clients.secs);
        s.push(
            "clients.requests",
            l.clients.requests() as f64 / m_clients as f64,
        );
        s.push(
            "clients.writes",
            l.clients.writes() as f64 / m_clients as f64,
        );
        bd_insert(&mut bd, "clients", l.clients.manager.top(6));
        s.push("online.secs", l.online.secs);
        s.push(
            "online.requests",
            l.online.requests() as f64 / online.len() as f64,
        );
        bd_insert(&mut bd, "online", l.online.manager.top(6));
        let (a, b) = (&l.first, &l.all);
        s.push("leases.all.passes", l.lease_passes / m_clients as f64);
        s.push(
            "leases.all.manager_cpu",
            b.manager_cpu * 1000.0 / m_clients as f64,
        );
        s.push(
            "leases.all.api_cpu",
            b.apiserver_cpu * 1000.0 / m_clients as f64,
        );
        s.push("leases.first.secs", a.secs);
        s.push("leases.all.secs", b.secs);
        s.push(
            "leases.flatness",
            (b.secs / m_clients as f64) / (a.secs / first as f64),
        );
        push_lease_counts(&mut s, &[a, b], first + m_clients);
        bd_insert(&mut bd, "leases", b.manager.top(8));
        let where_ = |st: &Step| match st.manager.top_code(409, 4) {
            t if t.is_empty() => "none".to_string(),
            t => t,
        };
        let conflicts = format!("{}; {}", where_(a), where_(b));
        bd_insert(&mut bd, "conflicts", conflicts);
        m.stop("TERM");
        drop(p);
        if std::env::var("UCM_BENCH_KEEP").as_deref() != Ok("1") {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    figures(n, m_clients, first, &s, &bd)
}

fn figures(
    n: usize,
    m: usize,
    first: usize,
    s: &Samples,
    bd: &BTreeMap<&str, String>,
) -> Vec<Figure> {
    let bd = |k: &str| bd.get(k).cloned().unwrap_or_default();
    let med = |k: &str| s.median(k);
    let fig = |id: &str, title: String, unit: &str, key: &str| {
        Figure::new(PHASE, &format!("leases.{id}"), &title, unit, s.get(key))
    };
    let shipped = "manager at the shipped defaults, as config/default deploys it: every feature on, all namespaces, --leader-elect, the default worker count";
    let counted = "non-watch requests by the manager's ServiceAccount in the API server's audit log, from the first create until the manager was quiet for 2 s; its leader-election Lease counted apart";
    vec![
        fig(
            "exporters.objects_per_s",
            format!("{n} Exporters in one namespace: create → every final status (credential and an Online condition)"),
            "objects/s",
            "exporters.rate",
        )
        .reference(med("ref.exporters.rate"), BARE, true)
        .higher_is_better()
        .note(format!(
            "{shipped}; bench creates 8 at a time, the bare client too (create + status patch of the same Exporters). {PEER}"
        )),
        fig(
            "exporters.requests_per_object",
            format!("{n} Exporters: manager API requests per Exporter"),
            "requests",
            "exporters.requests",
        )
        .reference(3.0, "issue 17 goal ≤ 3", false)
        .note(format!(
            "{counted} ({:.0} Lease requests in the step); top: {}",
            med("exporters.leader_lease"),
            bd("exporters")
        )),
        fig(
            "exporters.writes_per_object",
            format!("{n} Exporters: manager API writes per Exporter"),
            "writes",
            "exporters.writes",
        )
        .note(format!("creates, updates, patches and deletes of the requests above. {PEER}")),
        fig(
            "exporters.apiserver_cpu_per_object",
            format!("{n} Exporters: etcd + kube-apiserver CPU per Exporter"),
            "ms",
            "exporters.api_cpu",
        )
        .reference(med("ref.exporters.api_cpu"), BARE, true)
        .note(format!(
            "CPU of the kharness process (etcd and kube-apiserver) during the step, from /proc. The manager itself: {:.2} ms per Exporter. {PEER}",
            med("exporters.manager_cpu"),
        )),
        fig(
            "memory.bytes_per_exporter",
            format!("manager RSS per cached Exporter (with its Secret), {n} Exporters"),
            "KiB",
            "rss.per_exporter",
        )
        .reference(5.0, "issue 17 goal ≤ 5 KiB", false)
        .note(format!(
            "(RSS 5 s after the manager went quiet after the last final status − idle RSS) / Exporters; the caches hold each Exporter's credential Secret too, and the allocator keeps some of the bulk's garbage. RSS after the bulk: {:.1} MiB. {PEER}",
            med("rss.after")
        )),
        fig(
            "memory.rss_idle",
            "manager RSS 20 s after /readyz, CRDs installed, no objects".into(),
            "MiB",
            "rss.zero",
        )
        .note(format!(
            "{shipped}; read once the bare client's references were done, a median {:.1} s after /readyz. {PEER}",
            med("rss.zero_after")
        )),
        fig(
            "clients.seconds",
            format!("{m} Clients: create → status.credential set"),
            "s",
            "clients.secs",
        )
        .reference(med("ref.clients.secs"), BARE, true)
        .note(format!("the bare client creates each Client and patches its status. {PEER}")),
        fig(
            "clients.requests_per_object",
            format!("{m} Clients: manager API requests per Client"),
            "requests",
            "clients.requests",
        )
        .reference(2.0, "issue 17 goal ≤ 2 per Client", false)
        .note(format!(
            "{counted}; writes per Client: {:.2}; top: {}",
            med("clients.writes"),
            bd("clients")
        )),
        fig(
            "online.seconds",
            format!("{} Exporters (one in ten) made online: status patch → Online and Registered", n.div_ceil(10)),
            "s",
            "online.secs",
        )
        .note(format!(
            "one merge patch of each Exporter's status, 8 at a time, as an exporter reports itself: lastSeen (now), exporterStatus Available, statusMessage, one device; the conditions are left to the manager (Registered from devices, Online from lastSeen). {PEER} The same patch is repeated every 20 s while the lease steps run. Manager requests per Exporter in the step: {:.2}; top: {}",
            med("online.requests"),
            bd("online")
        )),
        fig(
            "leases.first_seconds",
            format!("{first} Leases among {n} Exporters: create → all assigned and Ready"),
            "s",
            "leases.first.secs",
        )
        .note(format!(
            "one Lease per Client, each an hour long, selector matchLabels {POOL}={ONLINE}: the label only the online Exporters carry, so each Lease can take any free online Exporter. Released (spec.release) and ended before the next step"
        )),
        fig(
            "leases.seconds",
            format!("{m} Leases among {n} Exporters: create → all assigned and Ready"),
            "s",
            "leases.all.secs",
        )
        .reference(med("ref.leases.secs"), BARE, true)
        .note(format!(
            "one Lease per Client, one per online Exporter, same selector; each online Exporter is patched every 20 s meanwhile (one patch every 40 ms, spread evenly), and the passes that triggers run in the same worker. The bare client creates the Leases and patches their status (issue 17's goal: ≤ 4 s). {PEER} Per Lease, until the manager was quiet: {:.1} lease passes (`controller_runtime_reconcile_time_seconds` count), {:.2} ms of manager CPU, {:.1} ms of etcd + kube-apiserver CPU. Checked after each run (the phase fails otherwise): no exporter holds two active leases, every Lease is on an online exporter, every Exporter's and Client's credential Secret has a token and its owner as controller",
            med("leases.all.passes"),
            med("leases.all.manager_cpu"),
            med("leases.all.api_cpu"),
        )),
        fig(
            "leases.per_lease_growth",
            format!("time per Lease at {m} Leases / time per Lease at {first}"),
            "ratio",
            "leases.flatness",
        )
        .reference(1.2, "issue 17 goal ≤ 1.2: flat in N", false)
        .note(format!(
            "per Lease: median {:.1} ms at {first}, {:.1} ms at {m}",
            med("leases.first.secs") * 1000.0 / first as f64,
            med("leases.all.secs") * 1000.0 / m as f64
        )),
        fig(
            "leases.conflicts_per_assignment",
            format!("409 conflicts per Lease assignment ({first} + {m} Leases)"),
            "conflicts",
            "leases.conflicts",
        )
        .reference(0.05, "issue 17 goal ≤ 0.05", false)
        .note(format!(
            "responses with code 409 to the manager's requests (audit log responseStatus.code) in both lease steps, its leader-election Lease apart. Where they were, last run (first step; second step): {}",
            bd("conflicts")
        )),
        fig(
            "leases.requests_per_assignment",
            format!("manager API requests per Lease assignment ({first} + {m} Leases)"),
            "requests",
            "leases.requests",
        )
        .reference(1.0, "issue 17 goal: assignment reads only caches, one write", false)
        .note(format!(
            "{counted}, both lease steps; includes the passes the 20 s online patches trigger. Top (second step): {}",
            bd("leases")
        )),
        fig(
            "leases.writes_per_assignment",
            format!("manager API writes per Lease assignment ({first} + {m} Leases)"),
            "writes",
            "leases.writes",
        )
        .reference(1.0, "issue 17 goal: one write per assignment", false)
        .note("creates, updates, patches and deletes of the requests above (Lease status, the Lease's owner reference, the Exporter's leaseRef, events)"),
    ]
}

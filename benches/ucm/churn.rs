//! Phase `churn` (issue 50, item 3): ucm and the Go controller v0.9.0 past the `peer` phase's
//! sizes, with the `peer` phase's machinery (a fresh control plane per run, each controller
//! spawned with its shipped defaults and leader election on, the same ServiceAccount, ConfigMap
//! and `CONTROLLER_KEY` seed).
//!
//! Load, the same for every run: N Exporters (default 10,000, `UCM_BENCH_CHURN_N`) created 8 at
//! a time, every tenth made online by one status patch and then patched again every 10 s,
//! upstream exporters' `lastSeen` cadence (docs/exporter.md, "Heartbeats"), spread evenly over
//! the period.
//!
//! 1. The bare client first, on its own control plane with ucm's CRDs and no controller: Lease
//!    churn at offered rates stepped up (default 10, 20, 40, 80, 160, 320 Leases/s, 20 s each) until
//!    a step is not sustained (achieved below 95 % of offered, or p99 create → assigned and
//!    Ready above 1 s). Per Lease the bench makes the writes a controller must (as the `peer` phase's bare
//!    client: status with exporterRef and Ready, the Exporter's `leaseRef`, the owner reference,
//!    8 Leases at a time, on an exporter from its own free list), holds it (default 2 s) and
//!    ends it itself (status `ended`, the Exporter's `leaseRef` cleared). R = the highest step
//!    sustained.
//! 2. Each controller, in the order Go, ucm, ucm, Go: the load (every Exporter final: credential
//!    and an Online condition; the online tenth Online and Registered), then churn at R/4, R/2
//!    and R for 30 s each (the bench creates the Leases, selecting any online Exporter, and sets
//!    `spec.release` after the hold; the controller assigns and ends them), measuring per Lease
//!    create → a watch sees exporterRef and Ready=True; meanwhile 100 offline Exporters report
//!    online (one status patch each, spread over the planned churn), measuring the patch → the
//!    watch sees Online=True. A controller falls behind when its unassigned backlog exceeds
//!    R × 5 s or a step's p99 exceeds 10 s; its churn stops there. Manager CPU over the churn,
//!    RSS at its end. Then every Lease must end, and the `peer` phase's check runs (credential
//!    Secrets, no active Lease left), plus: no Lease seen assigned to an Exporter whose earlier
//!    Lease the same watch had not yet seen ended. ucm failing fails the phase; the Go
//!    controller's problems are counted.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use serde_json::json;
use tokio::sync::{Semaphore, oneshot, watch};
use tokio::task::JoinHandle;
use ucm::exporter::crd::{Client, Exporter, Lease};

use crate::Ctx;
use crate::kube_util::{CONCURRENCY, applied, create_all, track};
use crate::leases::{self, NS, ONLINE, POOL};
use crate::peer::{self, Kind};
use crate::procs::{Proc, cpu_secs};
use crate::report::{Figure, fmt, median, percentile};
use crate::steps::{LABEL, Samples, WAIT, exporter_done, now_str, obj};

const PHASE: &str = "churn";
/// Upstream exporters write `lastSeen` every 10 s (docs/exporter.md, "Heartbeats").
const UPSTREAM_BEAT: Duration = Duration::from_secs(10);
/// The label of the offline Exporters that report online during the churn.
const REPORT: &str = "ucm-bench-report";
/// Clients the Leases name in turn (nothing limits a Client's active Leases).
const CLIENTS: usize = 10;
/// A controller falls behind when its unassigned backlog exceeds R × this.
const BACKLOG_SECS: f64 = 5.0;
/// ... or when a step's p99 exceeds this.
const BEHIND_P99: f64 = 10.0;
/// The bare client's step is sustained at ≥ 95 % of the offered rate and p99 ≤ 1 s.
const SUSTAINED: f64 = 0.95;
const SUSTAINED_P99: f64 = 1.0;
const ORDER: [Kind; 4] = [Kind::Go, Kind::Ucm, Kind::Ucm, Kind::Go];

struct Settings {
    n: usize,
    /// The bare client's offered rates, Leases/s.
    rates: Vec<f64>,
    /// Rates left out: more Leases held at once than the online Exporters could serve.
    capped: Vec<f64>,
    bare_step: Duration,
    step: Duration,
    hold: Duration,
    reports: usize,
}

fn key(kind: Kind, what: &str) -> &'static str {
    Box::leak(format!("{}.{what}", kind.name()).into_boxed_str())
}

/// The Exporters that report online during the churn: offline ones (index ≡ 5 mod 10).
fn report_set(n: usize, reports: usize) -> Vec<usize> {
    (0..n).filter(|i| i % 10 == 5).take(reports).collect()
}

fn exporter(i: usize, run: &str, reporting: bool) -> Exporter {
    let mut e = leases::exporter(i, run);
    if reporting {
        e.labels_mut().insert(REPORT.into(), "yes".into());
    }
    e
}

fn lease(name: &str, client: &str, run: &str) -> Lease {
    obj(json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": name, "labels": {LABEL: run}},
        "spec": {
            "clientRef": {"name": client},
            "duration": "1h",
            "selector": {"matchLabels": {POOL: ONLINE}},
        }
    }))
}

/// What the Lease watch has seen, in its (resourceVersion) order.
#[derive(Default)]
struct Seen {
    /// Lease → when the watch first saw it with exporterRef and Ready=True, not ended.
    done: HashMap<String, Instant>,
    waiters: HashMap<String, oneshot::Sender<Instant>>,
    /// Exporter → the Lease last seen assigned to it and not yet seen ended.
    holder: HashMap<String, String>,
    /// Lease → its Exporter, while assigned.
    on: HashMap<String, String>,
    /// Leases seen assigned to an Exporter whose earlier Lease was not yet seen ended.
    overlaps: Vec<String>,
}

fn watch_leases(api: Api<Lease>, run: &str) -> (Arc<Mutex<Seen>>, JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let cfg = watcher::Config::default().labels(&format!("{LABEL}={run}"));
    let s2 = seen.clone();
    let task = tokio::spawn(async move {
        let mut stream = applied(api, cfg, "churn lease").boxed();
        while let Some(l) = stream.next().await {
            let name = l.name_any();
            let mut s = s2.lock().unwrap();
            if leases::lease_ended(&l) {
                if let Some(e) = s.on.remove(&name)
                    && s.holder.get(&e) == Some(&name)
                {
                    s.holder.remove(&e);
                }
                continue;
            }
            if !leases::lease_done(&l) || s.done.contains_key(&name) {
                continue;
            }
            let now = Instant::now();
            s.done.insert(name.clone(), now);
            let e = l
                .status
                .as_ref()
                .and_then(|st| st.exporter_ref.as_ref())
                .map(|r| r.name.clone())
                .unwrap_or_default();
            if let Some(other) = s.holder.insert(e.clone(), name.clone())
                && other != name
            {
                s.overlaps.push(format!(
                    "{name} assigned {e} while {other} was not yet seen ended"
                ));
            }
            s.on.insert(name.clone(), e);
            if let Some(w) = s.waiters.remove(&name) {
                let _ = w.send(now);
            }
        }
    });
    (seen, task)
}

/// The first instant a watch saw each Exporter labelled [`REPORT`] with Online=True.
fn watch_online(
    api: Api<Exporter>,
    run: &str,
) -> (Arc<Mutex<HashMap<String, Instant>>>, JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(HashMap::new()));
    let cfg = watcher::Config::default().labels(&format!("{LABEL}={run},{REPORT}=yes"));
    let s2 = seen.clone();
    let task = tokio::spawn(async move {
        let mut stream = applied(api, cfg, "churn exporter").boxed();
        while let Some(e) = stream.next().await {
            let online = e
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .into_iter()
                .flatten()
                .any(|c| c.type_ == "Online" && c.status == "True");
            if online {
                s2.lock()
                    .unwrap()
                    .entry(e.name_any())
                    .or_insert_with(Instant::now);
            }
        }
    });
    (seen, task)
}

/// The bare client's controller part: its free exporters and its 8 requests at a time.
struct Bare {
    exporters: Api<Exporter>,
    free: Mutex<VecDeque<(String, String)>>,
    slots: Semaphore,
}

impl Bare {
    async fn take(&self) -> (String, String) {
        loop {
            let e = self.free.lock().unwrap().pop_front();
            if let Some(e) = e {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

struct Churn {
    leases: Api<Lease>,
    seen: Arc<Mutex<Seen>>,
    t0s: Mutex<HashMap<String, Instant>>,
    created: AtomicUsize,
    stop: watch::Sender<bool>,
    hold: Duration,
    run: String,
    bare: Option<Bare>,
    /// The Lease watch, ended with the run.
    _watch: AbortOnDrop,
}

impl Churn {
    fn waiter(&self, name: &str) -> oneshot::Receiver<Instant> {
        let (tx, rx) = oneshot::channel();
        let mut s = self.seen.lock().unwrap();
        match s.done.get(name) {
            Some(t) => {
                let _ = tx.send(*t);
            }
            None => {
                s.waiters.insert(name.to_string(), tx);
            }
        }
        rx
    }

    fn backlog(&self) -> usize {
        let done = self.seen.lock().unwrap().done.len();
        self.created.load(Ordering::SeqCst).saturating_sub(done)
    }

    /// Per Lease of `names`: create → assigned seconds (censored at now when not yet seen),
    /// how many were seen assigned, and the last of those instants.
    fn stats(&self, names: &[String]) -> (Vec<f64>, usize, Option<Instant>) {
        let now = Instant::now();
        let seen = self.seen.lock().unwrap();
        let t0s = self.t0s.lock().unwrap();
        let (mut lats, mut done, mut last) = (Vec::new(), 0, None::<Instant>);
        for n in names {
            let Some(t0) = t0s.get(n) else { continue };
            match seen.done.get(n) {
                Some(t) => {
                    lats.push((*t - *t0).as_secs_f64());
                    done += 1;
                    last = Some(last.map_or(*t, |l| l.max(*t)));
                }
                None => lats.push((now - *t0).as_secs_f64()),
            }
        }
        (lats, done, last)
    }
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

fn warn<T>(what: &str, r: Result<T, kube::Error>) {
    if let Err(e) = r {
        eprintln!("  churn: {what}: {e}");
    }
}

/// One Lease: created, assigned (by the controller, or by the bare client here), held, released
/// (controllers) or ended (the bare client). Returns create → seen assigned in seconds, censored
/// at the churn's stop when never seen, and whether it was seen.
async fn one_lease(ch: Arc<Churn>, name: String, client: String) -> (f64, bool) {
    let rx = ch.waiter(&name);
    let stop = ch.stop.subscribe();
    ch.created.fetch_add(1, Ordering::SeqCst);
    let t0 = Instant::now();
    ch.t0s.lock().unwrap().insert(name.clone(), t0);
    let mut made = None;
    for _ in 0..5 {
        match ch
            .leases
            .create(&PostParams::default(), &lease(&name, &client, &ch.run))
            .await
        {
            Ok(l) => {
                made = Some(l);
                break;
            }
            Err(e) => {
                eprintln!("  churn: create {name}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    if made.is_none() {
        return (t0.elapsed().as_secs_f64(), false);
    }
    let pp = PatchParams::default();
    let Some(b) = &ch.bare else {
        let (lat, seen) = tokio::select! {
            t = rx => match t {
                Ok(t) => ((t - t0).as_secs_f64(), true),
                Err(_) => (t0.elapsed().as_secs_f64(), false),
            },
            _ = stopped(stop) => (t0.elapsed().as_secs_f64(), false),
        };
        if seen {
            tokio::time::sleep(ch.hold).await;
        }
        let release = Patch::Merge(json!({"spec": {"release": true}}));
        warn(
            &format!("release {name}"),
            ch.leases.patch(&name, &pp, &release).await,
        );
        return (lat, seen);
    };
    // The bare client's controller part, in the controllers' causal order.
    let exporter = tokio::select! {
        e = b.take() => Some(e),
        _ = stopped(stop.clone()) => None,
    };
    let mut out = (t0.elapsed().as_secs_f64(), false);
    if let Some((e, uid)) = &exporter {
        {
            let _slot = b.slots.acquire().await.unwrap();
            let status = crate::steps::lease_assigned_status(e);
            warn(
                &format!("status of {name}"),
                ch.leases
                    .patch_status(&name, &pp, &Patch::Merge(status))
                    .await,
            );
            let lease_ref = json!({"status": {"leaseRef": {"name": name}}});
            warn(
                &format!("leaseRef of {e}"),
                b.exporters
                    .patch_status(e, &pp, &Patch::Merge(lease_ref))
                    .await,
            );
            let owners =
                json!({"metadata": {"ownerReferences": [peer::owner("Exporter", e, uid)]}});
            warn(
                &format!("owner of {name}"),
                ch.leases.patch(&name, &pp, &Patch::Merge(owners)).await,
            );
        }
        out = tokio::select! {
            t = rx => match t {
                Ok(t) => ((t - t0).as_secs_f64(), true),
                Err(_) => (t0.elapsed().as_secs_f64(), false),
            },
            _ = stopped(stop) => (t0.elapsed().as_secs_f64(), false),
        };
        if out.1 {
            tokio::time::sleep(ch.hold).await;
        }
    }
    let _slot = b.slots.acquire().await.unwrap();
    let end = json!({"status": {"ended": true, "endTime": now_str()}});
    warn(
        &format!("end {name}"),
        ch.leases.patch_status(&name, &pp, &Patch::Merge(end)).await,
    );
    if let Some((e, uid)) = exporter {
        let free = json!({"status": {"leaseRef": null}});
        warn(
            &format!("free {e}"),
            b.exporters.patch_status(&e, &pp, &Patch::Merge(free)).await,
        );
        b.free.lock().unwrap().push_back((e, uid));
    }
    out
}

struct Offered {
    rate: f64,
    names: Vec<String>,
    tasks: Vec<JoinHandle<(f64, bool)>>,
    start: Instant,
    /// The backlog exceeded the cap: the step stopped offering.
    behind: bool,
}

/// Offers `rate` Leases/s for `dur`, open loop (each Lease its own task, created on schedule
/// whatever the earlier ones' state), unless the unassigned backlog exceeds `cap`.
async fn offer(ch: &Arc<Churn>, step: usize, rate: f64, dur: Duration, cap: usize) -> Offered {
    let count = (rate * dur.as_secs_f64()).round() as usize;
    let start = tokio::time::Instant::now();
    let (mut names, mut tasks, mut behind) = (Vec::new(), Vec::new(), false);
    for i in 0..count {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
        if ch.backlog() > cap {
            behind = true;
            break;
        }
        let name = format!("churn-{step}-{i:05}");
        let client = leases::client_name(i % CLIENTS);
        tasks.push(tokio::spawn(one_lease(ch.clone(), name.clone(), client)));
        names.push(name);
    }
    Offered {
        rate,
        names,
        tasks,
        start: start.into_std(),
        behind,
    }
}

/// A fresh plane for `kind` with the load on it; returns the plane, the controller (none for the
/// bare client), the Exporter API, and the keep-online task.
async fn load(
    kind: Kind,
    dir: &Path,
    go: &Path,
    set: &Settings,
    run: &str,
) -> (
    crate::cluster::Plane,
    Option<Proc>,
    Api<Exporter>,
    JoinHandle<()>,
) {
    let p = peer::plane(kind, &dir.join("cp")).await;
    let c = p.admin.clone();
    let m = match kind {
        Kind::Bare => None,
        _ => {
            let (mut m, _) = peer::spawn(kind, &p, go, dir.join("controller.log"));
            m.wait_ready(Duration::from_secs(120)).await;
            Some(m)
        }
    };
    let n = set.n;
    let reporting = report_set(n, set.reports);
    let exporters: Api<Exporter> = Api::namespaced(c.clone(), NS);
    let t0 = Instant::now();
    let objs: Vec<Exporter> = (0..n)
        .map(|i| exporter(i, run, reporting.binary_search(&i).is_ok()))
        .collect();
    if m.is_some() {
        let clients: Api<Client> = Api::namespaced(c.clone(), NS);
        let tracker = track(
            clients.clone(),
            watcher::Config::default().labels(&format!("{LABEL}={run}")),
            CLIENTS,
            leases::client_done,
        );
        create_all(
            &clients,
            (0..CLIENTS).map(|i| leases::client(i, run)).collect(),
        )
        .await;
        tracker.wait("churn: Clients", WAIT).await;
        let tracker = track(
            exporters.clone(),
            watcher::Config::default().labels(&format!("{LABEL}={run}")),
            n,
            exporter_done,
        );
        create_all(&exporters, objs).await;
        tracker.wait("churn: Exporters final", WAIT * 2).await;
    } else {
        create_all(&exporters, objs).await;
    }
    eprintln!(
        "  {} Exporters{} in {:.1}s",
        n,
        if m.is_some() { " final" } else { " created" },
        t0.elapsed().as_secs_f64()
    );
    let online: Vec<usize> = (0..n).filter(|i| leases::is_online(*i)).collect();
    let devices: Arc<Vec<(String, String)>> = Arc::new(
        online
            .iter()
            .map(|i| (leases::exporter_name(*i), uuid::Uuid::new_v4().to_string()))
            .collect(),
    );
    let tracker = m.is_some().then(|| {
        track(
            exporters.clone(),
            watcher::Config::default().labels(&format!("{LABEL}={run},{POOL}={ONLINE}")),
            online.len(),
            leases::online_done,
        )
    });
    leases::fail(
        "churn: online status patch",
        &leases::patch_all(&exporters, leases::online_patches(&devices), true).await,
    );
    if let Some(t) = tracker {
        t.wait("churn: online Exporters Online and Registered", WAIT)
            .await;
    }
    let keep = leases::keep_online_every(exporters.clone(), devices, UPSTREAM_BEAT);
    (p, m, exporters, keep)
}

fn new_churn(c: &kube::Client, run: &str, hold: Duration, bare: Option<Bare>) -> Arc<Churn> {
    let leases: Api<Lease> = Api::namespaced(c.clone(), NS);
    let (seen, task) = watch_leases(leases.clone(), run);
    let (stop, _) = watch::channel(false);
    Arc::new(Churn {
        leases,
        seen,
        t0s: Mutex::new(HashMap::new()),
        created: AtomicUsize::new(0),
        stop,
        hold,
        run: run.to_string(),
        bare,
        _watch: AbortOnDrop(Some(task)),
    })
}

struct AbortOnDrop(Option<JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.abort();
        }
    }
}

/// The bare client's search for R; pushes `bare.*` samples and returns R.
async fn bare(
    dir: &Path,
    go: &Path,
    set: &Settings,
    s: &mut Samples,
    bd: &mut BTreeMap<String, String>,
) -> f64 {
    let run = "bare";
    let (p, _, exporters, keep) = load(Kind::Bare, dir, go, set, run).await;
    let free: VecDeque<(String, String)> = exporters
        .list(&ListParams::default().labels(&format!("{POOL}={ONLINE}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| (e.name_any(), e.uid().unwrap_or_default()))
        .collect();
    let b = Bare {
        exporters: exporters.clone(),
        free: Mutex::new(free),
        slots: Semaphore::new(CONCURRENCY),
    };
    let ch = new_churn(&p.admin, run, set.hold, Some(b));
    // The watch's initial list first.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut r = None;
    let mut tasks = Vec::new();
    let mut steps = Vec::new();
    for (j, &rate) in set.rates.iter().enumerate() {
        let o = offer(&ch, j, rate, set.bare_step, usize::MAX).await;
        let end = Instant::now() + Duration::from_secs(10);
        while ch.stats(&o.names).1 < o.names.len() && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (lats, done, last) = ch.stats(&o.names);
        let span = last
            .map_or(0.0, |l| (l - o.start).as_secs_f64())
            .max(set.bare_step.as_secs_f64());
        let achieved = done as f64 / span;
        let (p50, p99) = (percentile(&lats, 0.5), percentile(&lats, 0.99));
        eprintln!(
            "  bare: offered {rate}/s, achieved {achieved:.1}/s, p50 {p50:.3}s, p99 {p99:.3}s"
        );
        steps.push(format!(
            "{} → {:.1}/s, p99 {} s",
            fmt(rate),
            achieved,
            fmt(p99)
        ));
        tasks.extend(o.tasks);
        if achieved >= SUSTAINED * rate && p99 <= SUSTAINED_P99 {
            r = Some(rate);
        } else {
            break;
        }
    }
    ch.stop.send_replace(true);
    for t in tasks {
        let _ = t.await;
    }
    keep.abort();
    let overlaps = ch.seen.lock().unwrap().overlaps.len();
    assert_eq!(overlaps, 0, "bare client: an exporter leased twice");
    let r = match r {
        Some(r) => r,
        None => {
            bd.insert(
                "bare.none".into(),
                format!(
                    ". Not even the lowest step ({} Leases/s) was sustained; the controllers were stepped from it",
                    fmt(set.rates[0])
                ),
            );
            set.rates[0]
        }
    };
    s.push("bare.rate", r);
    bd.insert("bare.steps".into(), steps.join("; "));
    // The watch before its control plane.
    drop(ch);
    drop(p);
    r
}

/// One controller run: the load, then churn at R/4, R/2, R.
#[allow(clippy::too_many_arguments)]
async fn controller(
    kind: Kind,
    dir: &Path,
    go: &Path,
    set: &Settings,
    r: f64,
    run: &str,
    s: &mut Samples,
    bd: &mut BTreeMap<String, String>,
) {
    let (p, m, exporters, keep) = load(kind, dir, go, set, run).await;
    let mut m = m.expect("a controller");
    let c = p.admin.clone();
    let ch = new_churn(&c, run, set.hold, None);
    let (online_seen, online_task) = watch_online(exporters.clone(), run);
    let _online_task = AbortOnDrop(Some(online_task));
    tokio::time::sleep(Duration::from_secs(2)).await;

    let rates = [r / 4.0, r / 2.0, r];
    let cap = (r * BACKLOG_SECS).ceil() as usize;
    // The offline Exporters' reports, spread over the planned churn.
    let reporting: Vec<String> = report_set(set.n, set.reports)
        .into_iter()
        .map(leases::exporter_name)
        .collect();
    let planned = set.step * rates.len() as u32;
    let gap = planned / reporting.len().max(1) as u32;
    let reported: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let reporter = {
        let (exporters, reported, stop) =
            (exporters.clone(), reported.clone(), ch.stop.subscribe());
        tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            for (k, name) in reporting.into_iter().enumerate() {
                tokio::time::sleep_until(start + gap * k as u32).await;
                if *stop.borrow() {
                    break;
                }
                let body = leases::online_status(&uuid::Uuid::new_v4().to_string());
                reported
                    .lock()
                    .unwrap()
                    .push((name.clone(), Instant::now()));
                let exporters = exporters.clone();
                tokio::spawn(async move {
                    warn(
                        &format!("report of {name}"),
                        exporters
                            .patch_status(&name, &PatchParams::default(), &Patch::Merge(body))
                            .await,
                    );
                });
            }
        })
    };

    let (cpu0, api0, t0) = (m.cpu(), cpu_secs(p.apiserver_pid), Instant::now());
    let mut offered = Vec::new();
    let mut kept = 0.0;
    let mut behind_at = None;
    for (j, &rate) in rates.iter().enumerate() {
        let o = offer(&ch, j, rate, set.step, cap).await;
        let (lats, done, _) = ch.stats(&o.names);
        let p99 = percentile(&lats, 0.99);
        eprintln!(
            "  {}: offered {rate}/s: {done} of {} assigned by the step's end, p99 so far {p99:.3}s, backlog {}",
            kind.name(),
            o.names.len(),
            ch.backlog()
        );
        let behind = o.behind || p99 > BEHIND_P99;
        offered.push(o);
        if behind {
            behind_at = Some(rate);
            break;
        }
        kept = rate;
    }
    let churn_secs = t0.elapsed().as_secs_f64();
    let (cpu, api_cpu) = (m.cpu() - cpu0, cpu_secs(p.apiserver_pid) - api0);
    // The last Leases get up to 30 s to be assigned; then every waiting one is released.
    let end = Instant::now() + Duration::from_secs(30);
    while ch.backlog() > 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ch.stop.send_replace(true);
    let _ = reporter.await;
    let created = ch.created.load(Ordering::SeqCst);
    let mut results = Vec::new();
    for o in offered {
        let mut v = Vec::new();
        for t in o.tasks {
            v.push(t.await.expect("lease task"));
        }
        results.push((o.rate, v));
    }
    // The reports: up to 15 s more for the last ones to show Online.
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        let issued = reported.lock().unwrap().clone();
        let seen = online_seen.lock().unwrap().clone();
        let missing = issued.iter().filter(|(n, _)| !seen.contains_key(n)).count();
        if missing == 0 || Instant::now() > end {
            let now = Instant::now();
            let lats: Vec<f64> = issued
                .iter()
                .map(|(n, t0)| (seen.get(n).copied().unwrap_or(now) - *t0).as_secs_f64())
                .collect();
            s.push(key(kind, "report_p99"), percentile(&lats, 0.99));
            s.push(key(kind, "report_p50"), percentile(&lats, 0.5));
            if missing > 0 {
                bd.insert(
                    format!("{}.{run}.report_missing", kind.name()),
                    format!("{missing} of {} reports not seen Online", issued.len()),
                );
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    keep.abort();
    let rss = m.rss() as f64 / f64::from(1 << 20);

    // Every Lease ended, then the check.
    let end = Instant::now() + Duration::from_secs(120);
    let open = loop {
        let open = ch
            .leases
            .list(&ListParams::default().labels(&format!("{LABEL}={run}")))
            .await
            .unwrap()
            .items
            .iter()
            .filter(|l| !leases::lease_ended(l))
            .count();
        if open == 0 || Instant::now() > end {
            break open;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let mut problems = leases::problems(&c, 0).await;
    if open > 0 {
        problems.push(format!("{open} Leases not ended 120 s after their release"));
    }
    let overlaps = ch.seen.lock().unwrap().overlaps.clone();
    problems.extend(overlaps.iter().cloned());
    if kind == Kind::Ucm {
        leases::fail("churn: the correctness check", &problems);
    }
    s.push(key(kind, "problems"), problems.len() as f64);
    s.push(key(kind, "overlaps"), overlaps.len() as f64);
    if !problems.is_empty() {
        bd.insert(
            format!("{}.{run}.problems", kind.name()),
            format!(
                "{} problems ({} Leases seen assigned to an Exporter still held), e.g. {}",
                problems.len(),
                overlaps.len(),
                problems[..problems.len().min(3)].join("; ")
            ),
        );
    }

    // Per step, the final create → assigned times (censored at the stop for the Leases never
    // assigned).
    let mut line = Vec::new();
    for (j, (rate, v)) in results.iter().enumerate() {
        let lats: Vec<f64> = v.iter().map(|(l, _)| *l).collect();
        let assigned = v.iter().filter(|(_, a)| *a).count();
        let (p50, p99) = (percentile(&lats, 0.5), percentile(&lats, 0.99));
        let full = behind_at != Some(*rate);
        if full {
            s.push(key(kind, &format!("p50.{j}")), p50);
            s.push(key(kind, &format!("p99.{j}")), p99);
        }
        line.push(format!(
            "{}/s: p50 {} s, p99 {} s ({assigned} of {} assigned{})",
            fmt(*rate),
            fmt(p50),
            fmt(p99),
            v.len(),
            if full { "" } else { "; fell behind" }
        ));
    }
    bd.insert(format!("{}.{run}.steps", kind.name()), line.join("; "));
    s.push(key(kind, "kept"), kept);
    if let Some(b) = behind_at {
        s.push(key(kind, "behind"), b);
    }
    s.push(key(kind, "cpu_ms"), cpu * 1000.0 / created.max(1) as f64);
    s.push(key(kind, "cores"), cpu / churn_secs);
    s.push(
        key(kind, "api_ms"),
        api_cpu * 1000.0 / created.max(1) as f64,
    );
    s.push(key(kind, "rss"), rss);
    m.stop("TERM");
    // The watches before their control plane.
    drop((ch, _online_task));
    drop(p);
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let go = peer::go_bin();
    eprintln!("churn: Go controller {}", go.display());
    let n = ((crate::env_num("UCM_BENCH_CHURN_N", 10000usize) as f64 * ctx.scale_factor).round()
        as usize)
        .max(100);
    let hold = Duration::from_secs_f64(crate::env_num("UCM_BENCH_CHURN_HOLD_S", 2.0));
    let online = n.div_ceil(10) as f64;
    let all: Vec<f64> = std::env::var("UCM_BENCH_CHURN_RATES")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![10.0, 20.0, 40.0, 80.0, 160.0, 320.0]);
    // A rate whose Leases (held `hold`, plus half a second to be assigned and ended) would need
    // more than 85 % of the online Exporters at once measures the pool, not the controller.
    let fits = |r: &f64| r * (hold.as_secs_f64() + 0.5) <= 0.85 * online;
    let set = Settings {
        n,
        rates: all.iter().copied().filter(fits).collect(),
        capped: all.iter().copied().filter(|r| !fits(r)).collect(),
        bare_step: Duration::from_secs(crate::env_num("UCM_BENCH_CHURN_BARE_S", 20)),
        step: Duration::from_secs(crate::env_num("UCM_BENCH_CHURN_STEP_S", 30)),
        hold,
        reports: crate::env_num("UCM_BENCH_CHURN_REPORTS", 100),
    };
    assert!(
        !set.rates.is_empty(),
        "churn: no offered rate fits {online} online Exporters with a {hold:?} hold"
    );
    let mut s = Samples::default();
    let mut bd = BTreeMap::new();
    let dir = |what: String| {
        let d = ctx.work.join(what);
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let done = |d: PathBuf| {
        if std::env::var("UCM_BENCH_KEEP").as_deref() != Ok("1") {
            let _ = std::fs::remove_dir_all(d);
        }
    };
    eprintln!(
        "churn N={n}: the bare client, offered {:?} Leases/s",
        set.rates
    );
    let d = dir("churn-bare".into());
    let r = bare(&d, &go, &set, &mut s, &mut bd).await;
    done(d);
    eprintln!("churn: R = {r} Leases/s");
    for (i, kind) in ORDER.iter().enumerate() {
        eprintln!("churn N={n} {}/{}: {}", i + 1, ORDER.len(), kind.name());
        let d = dir(format!("churn-{i}-{}", kind.name()));
        controller(*kind, &d, &go, &set, r, &format!("r{i}"), &mut s, &mut bd).await;
        done(d);
    }
    figures(&s, &bd, &set, r)
}

fn figures(s: &Samples, bd: &BTreeMap<String, String>, set: &Settings, r: f64) -> Vec<Figure> {
    let n = set.n;
    let online = n.div_ceil(10);
    let runs = |kind: &str, what: &str| -> String {
        bd.iter()
            .filter(|(k, _)| k.starts_with(&format!("{kind}.")) && k.ends_with(&format!(".{what}")))
            .map(|(k, v)| format!("{} {v}", k.split('.').nth(1).unwrap_or("")))
            .collect::<Vec<_>>()
            .join(" | ")
    };
    let behind = |kind: &str| {
        let b = s.get(&format!("{kind}.behind"));
        if b.is_empty() {
            format!("{kind} kept up in every run")
        } else {
            format!(
                "{kind} fell behind in {} run(s), at {} Leases/s",
                b.len(),
                b.iter().map(|x| fmt(*x)).collect::<Vec<_>>().join(", ")
            )
        }
    };
    // A ucm figure against the Go controller's median in the same run; none without samples
    // (a NaN would not survive results.json).
    let fig = |id: &str, title: String, unit: &str, k: &str| -> Option<Figure> {
        let u = s.get(&format!("ucm.{k}"));
        if u.is_empty() {
            return None;
        }
        let go = s.get(&format!("go.{k}"));
        let f = Figure::new(PHASE, &format!("churn.{id}"), &title, unit, u);
        Some(if go.is_empty() {
            f
        } else {
            let runs: Vec<String> = go.iter().map(|v| fmt(*v)).collect();
            f.reference(
                median(&go),
                &format!("Go controller v0.9.0 (its runs: {})", runs.join(", ")),
                true,
            )
        })
    };
    let load = format!(
        "{n} Exporters, {online} of them online and patched every 10 s as upstream's exporters write lastSeen, Leases held {} s",
        set.hold.as_secs_f64()
    );
    let checked = |kind: &str| {
        let v = s.get(&format!("{kind}.problems"));
        let bad = v.iter().filter(|x| **x > 0.0).count();
        match bad {
            0 => format!("{kind}: passed in all {} runs", v.len()),
            _ => format!(
                "{kind}: failed in {bad} of {} runs ({})",
                v.len(),
                runs(kind, "problems")
            ),
        }
    };
    let capped = if set.capped.is_empty() {
        String::new()
    } else {
        format!(
            "; not offered: {} Leases/s (more Leases held at once than 85 % of the {online} online Exporters)",
            set.capped
                .iter()
                .map(|x| fmt(*x))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    let mut f = vec![
        Some(
            Figure::new(
                PHASE,
                "churn.bare_rate",
                &format!("bare client, no controller ({load}): highest Lease churn sustained (R)"),
                "Leases/s",
                s.get("bare.rate"),
            )
            .higher_is_better()
            .note(format!(
                "offered steps of {} s (offered → achieved, p99 create → assigned and Ready): {}{capped}. Sustained: achieved ≥ 95 % of offered and p99 ≤ 1 s. Per Lease the bench writes what a controller must (status with exporterRef and Ready, the Exporter's leaseRef, the owner reference; 8 at a time), and ends it itself after the hold{}",
                set.bare_step.as_secs(),
                bd.get("bare.steps").cloned().unwrap_or_default(),
                bd.get("bare.none").cloned().unwrap_or_default(),
            )),
        ),
        fig(
            "p99_at_r",
            format!("Lease churn at R = {} Leases/s ({load}): create → assigned and Ready, p99", fmt(r)),
            "s",
            "p99.2",
        )
        .map(|f| {
            f.note(format!(
                "issue 50 goal ≤ 1 s for ucm. Steps of {} s at R/4, R/2, R, one after the other; a watch on the Leases times each; the bench sets spec.release after the hold. A controller falls behind (its churn stops there) when its unassigned backlog exceeds R × 5 s or a step's p99 exceeds 10 s: {}; {}. Per run: ucm {}; Go {}",
                set.step.as_secs(),
                behind("ucm"),
                behind("go"),
                runs("ucm", "steps"),
                runs("go", "steps"),
            ))
        }),
        fig(
            "p50_at_r",
            format!("Lease churn at R = {} Leases/s: create → assigned and Ready, p50", fmt(r)),
            "s",
            "p50.2",
        ),
        fig(
            "p99_at_half_r",
            format!("Lease churn at R/2 = {} Leases/s: create → assigned and Ready, p99", fmt(r / 2.0)),
            "s",
            "p99.1",
        ),
        fig(
            "kept_up",
            "Lease churn: highest step kept up with (R/4, R/2, R)".into(),
            "Leases/s",
            "kept",
        )
        .map(|f| f.higher_is_better().note(format!("0 when a controller fell behind at R/4. {}; {}", behind("ucm"), behind("go")))),
        fig(
            "report_online_p99",
            format!("during the churn, {} offline Exporters report online (one status patch each, spread over the planned churn): patch → Online=True, p99", set.reports),
            "s",
            "report_p99",
        )
        .map(|f| {
            f.note(format!(
                "a watch on those Exporters; p50 ucm {} s, Go {} s. A report not seen Online 15 s after the churn counts with its time until then{}",
                fmt(s.median("ucm.report_p50")),
                fmt(s.median("go.report_p50")),
                {
                    let m = format!("{} {}", runs("ucm", "report_missing"), runs("go", "report_missing"));
                    if m.trim().is_empty() { String::new() } else { format!(": {m}") }
                }
            ))
        }),
        fig(
            "cpu_per_lease",
            "Lease churn: controller CPU per Lease (utime + stime over the churn, with the keep-online and report load)".into(),
            "ms",
            "cpu_ms",
        )
        .map(|f| {
            f.note(format!(
                "on average ucm {} cores, Go {} cores over the churn; etcd + kube-apiserver CPU per Lease: ucm {} ms, Go {} ms. Check after each run: every Lease ended after its release, every credential Secret with a token and its owner as controller, no Lease seen assigned to an Exporter whose earlier Lease the same watch had not yet seen ended ({}; {}; ucm failing fails the phase)",
                fmt(s.median("ucm.cores")),
                fmt(s.median("go.cores")),
                fmt(s.median("ucm.api_ms")),
                fmt(s.median("go.api_ms")),
                checked("ucm"),
                checked("go"),
            ))
        }),
        fig(
            "rss",
            format!("controller RSS at the churn's end ({n} Exporters and their Secrets cached, every churned Lease kept)"),
            "MiB",
            "rss",
        ),
    ];
    f.retain(Option::is_some);
    f.into_iter().flatten().collect()
}

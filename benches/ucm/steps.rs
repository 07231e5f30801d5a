//! The timed steps the phases with a control plane per run share (`bulk`, `leases`): the bare
//! client's reference (create + status patch), a manager step timed until a watch has seen every
//! object done (with the manager's audit-log counts and CPU), and the per-run samples.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use ucm::exporter::crd::Exporter;

use crate::cluster::{Counts, Plane};
use crate::kube_util::{CONCURRENCY, Tracker, create_all, track};
use crate::procs::{Proc, cpu_secs};

/// Every bench object carries `LABEL=<run or step>`, which the trackers select on.
pub const LABEL: &str = "ucm-bench";
/// How long a step may take before the bench gives up on it (and says how far it got).
pub const WAIT: Duration = Duration::from_secs(600);

/// What the steps create, patch and watch.
pub trait Obj:
    kube::Resource
    + Clone
    + serde::de::DeserializeOwned
    + serde::Serialize
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Obj for K where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}

pub fn obj<K: serde::de::DeserializeOwned>(v: Value) -> K {
    serde_json::from_value(v).expect("bench object")
}

pub fn now_str() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .unwrap()
        .to_string()
}

/// An Exporter's final status: its credential and an `Online` condition (as the Go controller's
/// measurement defines it).
pub fn exporter_done(e: &Exporter) -> bool {
    e.status.as_ref().is_some_and(|s| {
        s.credential.is_some() && s.conditions.iter().flatten().any(|c| c.type_ == "Online")
    })
}

/// A Lease's status as a controller's assignment to `exporter` writes it (exporterRef, Ready),
/// for the bare clients that stand in for a controller.
pub fn lease_assigned_status(exporter: &str) -> Value {
    let t = now_str();
    json!({"status": {
        "exporterRef": {"name": exporter},
        "beginTime": t,
        "ended": false,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Ready",
                        "message": "bench reference", "lastTransitionTime": t,
                        "observedGeneration": 1}],
    }})
}

/// A final status of each kind, as the bare client writes it in the reference.
pub fn reference_status(kind: &str, name: &str) -> Value {
    let t = now_str();
    let cond = |ty: &str, st: &str, reason: &str| {
        json!({"type": ty, "status": st, "reason": reason, "message": "bench reference",
               "lastTransitionTime": t, "observedGeneration": 1})
    };
    match kind {
        "exporter" => json!({"status": {
            "credential": {"name": format!("{name}-exporter")},
            "endpoint": "ucm-grpc.ucm-system.svc:8082",
            "tokenExpiresAt": t,
            "statusMessage": "Never seen",
            "conditions": [cond("Registered", "False", "Unregistered"), cond("Online", "False", "Seen")],
        }}),
        "client" => json!({"status": {
            "credential": {"name": format!("{name}-client")},
            "endpoint": "ucm-grpc.ucm-system.svc:8082",
            "tokenExpiresAt": t,
        }}),
        // The bare client names no real exporter: it writes what an assignment writes.
        "lease" => lease_assigned_status(&format!("exporter-of-{name}")),
        "vmexport" => json!({"status": {
            "phase": "Ready",
            "serviceName": format!("virt-export-{name}"),
            "tokenSecretRef": format!("export-token-{name}"),
            "conditions": [{"type": "Ready", "status": "True", "reason": "PodReady", "message": "",
                            "lastTransitionTime": t}],
        }}),
        _ => json!({"status": {
            "readyToUse": true, "ioSuspended": false, "sizeBytes": 16384, "sourceFormatted": false,
            "conditions": [cond("Ready", "True", "SnapshotReady")],
        }}),
    }
}

/// The bare client: create, then patch the status, `CONCURRENCY` objects at a time; returns the
/// seconds from the first create until a watch has seen every final status, and the API server's
/// CPU seconds meanwhile.
pub async fn reference<K>(
    p: &Plane,
    api: Api<K>,
    kind: &str,
    objs: Vec<K>,
    done: fn(&K) -> bool,
    run: &str,
) -> (f64, f64)
where
    K: Obj,
{
    let n = objs.len();
    let tracker = track(
        api.clone(),
        watcher::Config::default().labels(&format!("{LABEL}={run}")),
        n,
        done,
    );
    let t0 = Instant::now();
    let cpu0 = cpu_secs(p.apiserver_pid);
    futures::stream::iter(objs)
        .for_each_concurrent(CONCURRENCY, |o| {
            let api = api.clone();
            async move {
                let name = o.name_any();
                api.create(&Default::default(), &o).await.unwrap();
                api.patch_status(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(reference_status(kind, &name)),
                )
                .await
                .unwrap_or_else(|e| panic!("reference status patch of {kind} {name}: {e}"));
            }
        })
        .await;
    let t1 = tracker.wait(&format!("reference {kind}"), WAIT).await;
    ((t1 - t0).as_secs_f64(), cpu_secs(p.apiserver_pid) - cpu0)
}

pub struct Step {
    pub secs: f64,
    pub manager: Counts,
    pub agents: Counts,
    pub manager_cpu: f64,
    pub apiserver_cpu: f64,
}

impl Step {
    /// The manager's requests besides its leader-election Lease (counted apart).
    pub fn requests(&self) -> u64 {
        self.manager.requests() - self.manager.coordination_lease_requests()
    }

    /// The manager's writes besides its leader-election Lease.
    pub fn writes(&self) -> u64 {
        self.manager.writes - self.manager.coordination_lease_writes()
    }
}

/// One timed step: the clock runs from just before `act` (the bench's creates or patches) until
/// `tracker` has seen every object done; the counts run on until the manager has been quiet for
/// 2 s, so they include the passes the last writes triggered.
pub async fn timed_with(
    p: &Plane,
    m: &Proc,
    tracker: Tracker,
    what: &str,
    act: impl Future<Output = ()>,
) -> Step {
    let n = tracker.n();
    let off0 = p.audit.offset();
    let (mcpu0, acpu0) = (m.cpu(), cpu_secs(p.apiserver_pid));
    let t0 = Instant::now();
    act.await;
    let t1 = tracker.wait(what, WAIT).await;
    let settled = Instant::now();
    manager_quiet(p).await;
    let counts = p.audit.count(off0, p.audit.offset());
    let secs = (t1 - t0).as_secs_f64();
    eprintln!(
        "  {what}: {n} in {secs:.2}s ({:.0}/s; manager quiet {:.1}s later)",
        n as f64 / secs,
        settled.elapsed().as_secs_f64()
    );
    Step {
        secs,
        manager: counts.get("ucm-manager").cloned().unwrap_or_default(),
        agents: counts.get("ucm-agent").cloned().unwrap_or_default(),
        manager_cpu: m.cpu() - mcpu0,
        apiserver_cpu: cpu_secs(p.apiserver_pid) - acpu0,
    }
}

/// Waits until the manager has sent no request for 2 s (at most 30 s), so a step's counts
/// include the passes its last writes triggered and the next step starts from a quiet manager.
pub async fn manager_quiet(p: &Plane) {
    p.audit
        .settle(
            "ucm-manager",
            Duration::from_secs(2),
            Duration::from_secs(30),
        )
        .await;
}

/// A timed bulk create: `objs` (labelled `LABEL=run`) created `CONCURRENCY` at a time.
pub async fn timed<K>(
    p: &Plane,
    m: &Proc,
    api: Api<K>,
    objs: Vec<K>,
    done: fn(&K) -> bool,
    run: &str,
    what: &str,
) -> Step
where
    K: Obj,
{
    let tracker = track(
        api.clone(),
        watcher::Config::default().labels(&format!("{LABEL}={run}")),
        objs.len(),
        done,
    );
    timed_with(p, m, tracker, what, create_all(&api, objs)).await
}

pub fn bd_insert(b: &mut BTreeMap<&'static str, String>, k: &'static str, v: String) {
    eprintln!("  {k}: {v}");
    b.insert(k, v);
}

/// One sample per run of each key.
#[derive(Default)]
pub struct Samples(BTreeMap<&'static str, Vec<f64>>);

impl Samples {
    pub fn push(&mut self, k: &'static str, v: f64) {
        eprintln!("  {k} = {v:.3}");
        self.0.entry(k).or_default().push(v);
    }
    pub fn step(&mut self, key: &'static str, st: &Step, n: usize) {
        let k = |x: &str| -> &'static str { Box::leak(format!("{key}.{x}").into_boxed_str()) };
        let n = n as f64;
        self.push(k("rate"), n / st.secs);
        self.push(k("requests"), st.manager.requests() as f64 / n);
        self.push(k("writes"), st.manager.writes as f64 / n);
        self.push(k("manager_cpu"), st.manager_cpu * 1000.0 / n);
        self.push(k("api_cpu"), st.apiserver_cpu * 1000.0 / n);
    }
    pub fn get(&self, k: &str) -> Vec<f64> {
        self.0.get(k).cloned().unwrap_or_default()
    }
    pub fn median(&self, k: &str) -> f64 {
        crate::report::median(&self.get(k))
    }
}

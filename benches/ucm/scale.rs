//! Phase `scale` (issue 32, bench/results.md "Snapshots and exports at the API server's limit"):
//! MiroirSnapshots and VirtualMachineExports at two sizes (`UCM_BENCH_SCALE_NS`, default
//! `300,3000`), each against a bare client doing the minimal writes the feature must make per
//! object, on a fresh control plane of the same kind, at the same concurrency (8).
//!
//! Per size and run, each feature, reference and ucm alike, on a fresh control plane of its own
//! (so an export step never runs on the objects a snapshot step left); on an export plane,
//! `WARM` exports first, not timed:
//! 1. References, no ucm process: for each object, 8 objects at a time, the writes below in their
//!    causal order, timed until a watch has seen every final status.
//!    - MiroirSnapshot (10 requests): create; the manager's teardown finalizers, open and
//!      publish; each of three agents' `Suspended` and `Done` slot writes (the three agents'
//!      writes of one step in parallel). These are ucm's own fenced patch bodies
//!      (`ucm::snapshot::round`); the open is fenced by `resourceVersion`, since a first round
//!      needs no prior status write.
//!    - VirtualMachineExport (7 requests): create; its Service, token Secret, serving-certificate
//!      Secret and Pod; the kubelet's Pod status (the bench's kubelet does the same for ucm); one
//!      final status patch.
//! 2. ucm: the manager at the shipped defaults; for snapshots also three `ucm snapshot-agent`
//!    processes (fake barrier) and one volume per snapshot; the same objects created 8 at a time,
//!    timed until a watch has seen every final status.

use std::ops::Range;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret, Service};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use ucm::snapshot::round;
use ucm::snapshot::types::{MiroirSnapshot, MiroirVolume, SlotState, teardown_finalizer};
use ucm::vmexport::VirtualMachineExport;

use crate::Ctx;
use crate::bulk::{
    NODES, kubelet, manager_args, pvc, snap_done, snapshot, start_agents, vmexport, vmx_done,
};
use crate::cluster::Plane;
use crate::kube_util::{CONCURRENCY, create_all, create_namespace, track};
use crate::procs::{Proc, cpu_secs};
use crate::report::{Figure, median};
use crate::steps::{LABEL, Samples, Step, WAIT, bd_insert, obj, reference_status, timed};

const PHASE: &str = "scale";
/// Exports made on each export plane before the timed step, and not counted: a fresh plane's
/// first seconds cost more (its controllers start, its caches fill), and the N = 300 step lasts
/// only a few seconds, so without them the small size measured the plane's start-up.
const WARM: usize = 100;
const NS: &str = "bench";

fn sizes(ctx: &Ctx) -> Vec<usize> {
    std::env::var("UCM_BENCH_SCALE_NS")
        .ok()
        .map(|s| {
            s.split(',')
                .filter_map(|x| x.trim().parse::<f64>().ok())
                .map(|x| ((x * ctx.scale_factor).round() as usize).max(1))
                .collect()
        })
        .unwrap_or_else(|| {
            [300.0, 3000.0]
                .iter()
                .map(|x| ((x * ctx.scale_factor).round() as usize).max(1))
                .collect()
        })
}

/// A fresh control plane in `dir/cp-<what>` with the bench namespace and the manager at the
/// shipped defaults, ready.
async fn ucm_plane(dir: &std::path::Path, what: &str) -> (Plane, Proc) {
    let p = Plane::start(&dir.join(format!("cp-{what}"))).await;
    create_namespace(&p.admin, NS).await;
    let mut m = Proc::manager(
        &p.manager_kubeconfig,
        dir.join(format!("manager-{what}.log")),
        &manager_args(),
    );
    m.wait_ready(Duration::from_secs(120)).await;
    (p, m)
}

/// Runs `per_object` for every index, `CONCURRENCY` at a time; returns the seconds until a
/// watch (`tracker`) has seen every final status and the API server's CPU seconds meanwhile.
async fn reference_run<F, Fut>(
    p: &Plane,
    tracker: crate::kube_util::Tracker,
    n: usize,
    what: &str,
    per_object: F,
) -> (f64, f64)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let cpu0 = cpu_secs(p.apiserver_pid);
    let t0 = Instant::now();
    futures::stream::iter(0..n)
        .for_each_concurrent(CONCURRENCY, per_object)
        .await;
    let t1 = tracker.wait(what, WAIT).await;
    ((t1 - t0).as_secs_f64(), cpu_secs(p.apiserver_pid) - cpu0)
}

/// Reference exports of the PVCs numbered `ids`, labelled `run`: (seconds, API-server CPU
/// seconds) as [`reference_run`].
async fn reference_exports(p: &Plane, ids: Range<usize>, run: &str, what: &str) -> (f64, f64) {
    let c = &p.admin;
    let tracker = track(
        Api::<VirtualMachineExport>::namespaced(c.clone(), NS),
        watcher::Config::default().labels(&format!("{LABEL}={run}")),
        ids.len(),
        vmx_done,
    );
    reference_run(p, tracker, ids.len(), what, |i| {
        let (c, run) = (c.clone(), run.to_string());
        async move { reference_export(&c, ids.start + i, &run).await }
    })
    .await
}

/// ucm's exports of the PVCs numbered `ids`, labelled `run`, timed as [`timed`].
async fn ucm_exports(p: &Plane, m: &Proc, ids: Range<usize>, run: &str, what: &str) -> Step {
    let exports = ids
        .map(|i| vmexport(&format!("vmx-{i:05}"), &format!("pvc-{i:05}"), run))
        .collect();
    let api = Api::<VirtualMachineExport>::namespaced(p.admin.clone(), NS);
    timed(p, m, api, exports, vmx_done, run, what).await
}

fn json_patch(v: serde_json::Value) -> Patch<()> {
    Patch::Json(serde_json::from_value(v).expect("a JSON Patch"))
}

/// The minimal writes of one snapshot round: what ucm's manager and agents must write.
async fn reference_snapshot(c: &Client, name: String, run: &str) {
    let api: Api<MiroirSnapshot> = Api::all(c.clone());
    let pp = PatchParams::default();
    let s = api
        .create(&PostParams::default(), &snapshot(&name, "v", run))
        .await
        .unwrap();
    let uid = s.uid().unwrap();
    let fins: Vec<String> = NODES.iter().map(|n| teardown_finalizer(n)).collect();
    let s = api
        .patch(
            &name,
            &pp,
            &json_patch(round::finalizers_patch(
                &uid,
                &s.resource_version().unwrap(),
                &fins,
            )),
        )
        .await
        .unwrap();
    let diskful: Vec<String> = NODES.iter().map(|n| n.to_string()).collect();
    let stamp = round::format_stamp(jiff::Timestamp::now());
    // The first open: no status yet, so fenced by the resourceVersion alone.
    api.patch_status(
        &name,
        &pp,
        &Patch::Merge(json!({
            "metadata": {"resourceVersion": s.resource_version()},
            "status": {"readyToUse": false, "ioSuspended": true, "suspendedAt": stamp,
                "perNode": diskful.iter().map(|n| (n.clone(), "Pending")).collect::<std::collections::BTreeMap<_, _>>(),
                "conditions": [{"type": "Ready", "status": "False", "reason": "BarrierRaised",
                    "message": "bench reference", "lastTransitionTime": stamp}]},
        })),
    )
    .await
    .unwrap();
    for st in [SlotState::Suspended, SlotState::Done] {
        futures::future::join_all(NODES.iter().map(|n| {
            let (api, pp, name) = (api.clone(), pp.clone(), name.clone());
            let body = json_patch(round::agent_slot_patch(&uid, &stamp, n, st));
            async move { api.patch_status(&name, &pp, &body).await.unwrap() }
        }))
        .await;
    }
    let slots = diskful
        .iter()
        .map(|n| (n.clone(), SlotState::Done))
        .collect();
    api.patch_status(
        &name,
        &pp,
        &json_patch(round::publish_patch(
            &uid,
            Some(&stamp),
            "",
            16384,
            false,
            &slots,
            &[],
        )),
    )
    .await
    .unwrap();
}

/// The minimal writes of one export: the export, its children, the kubelet's Pod status and one
/// final status.
async fn reference_export(c: &Client, i: usize, run: &str) {
    let name = format!("vmx-{i:05}");
    let exports: Api<VirtualMachineExport> = Api::namespaced(c.clone(), NS);
    let e = exports
        .create(
            &PostParams::default(),
            &vmexport(&name, &format!("pvc-{i:05}"), run),
        )
        .await
        .unwrap();
    let owner = json!([{"apiVersion": "export.kubevirt.io/v1", "kind": "VirtualMachineExport",
        "name": name, "uid": e.uid(), "controller": true, "blockOwnerDeletion": true}]);
    let svc: Service = obj(json!({"metadata": {"name": format!("virt-export-{name}"),
        "labels": {"kubevirt.io": "virt-exporter"}, "ownerReferences": owner},
        "spec": {"ports": [{"name": "export", "port": 443, "targetPort": 8443}],
                 "selector": {"kubevirt.io.virt-export-service": name}}}));
    Api::<Service>::namespaced(c.clone(), NS)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(c.clone(), NS);
    let token: Secret = obj(json!({"metadata": {"name": format!("export-token-{name}"),
        "labels": {"kubevirt.io": "virt-exporter"}, "ownerReferences": owner},
        "stringData": {"token": "x".repeat(32)}}));
    secrets
        .create(&PostParams::default(), &token)
        .await
        .unwrap();
    // About the size of a real serving certificate and key (PEM).
    let cert: Secret = obj(json!({"metadata": {"name": format!("export-cert-{name}"),
        "labels": {"kubevirt.io": "virt-exporter"}, "ownerReferences": owner},
        "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": "c".repeat(1100), "tls.key": "k".repeat(250)}}));
    secrets.create(&PostParams::default(), &cert).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), NS);
    let pod: Pod = obj(json!({"metadata": {"name": format!("virt-export-{name}"),
        "labels": {"kubevirt.io.virt-export-service": name}, "ownerReferences": owner},
        "spec": {"containers": [{"name": "exporter", "image": "ucm",
            "volumeMounts": [{"name": "v", "mountPath": "/export-volumes/v"},
                             {"name": "cert", "mountPath": "/cert"},
                             {"name": "token", "mountPath": "/token"}]}],
            "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": format!("pvc-{i:05}")}},
                        {"name": "cert", "secret": {"secretName": format!("export-cert-{name}")}},
                        {"name": "token", "secret": {"secretName": format!("export-token-{name}")}}]}}));
    pods.create(&PostParams::default(), &pod).await.unwrap();
    pods.patch_status(
        &format!("virt-export-{name}"),
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}]}})),
    )
    .await
    .unwrap();
    exports
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(reference_status("vmexport", &name)),
        )
        .await
        .unwrap();
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let mut s = Samples::default();
    let mut notes: Vec<(&'static str, String)> = Vec::new();
    let ns_list = sizes(ctx);
    for r in 0..ctx.runs {
        for &n in &ns_list {
            eprintln!("scale run {}/{}, N = {n}", r + 1, ctx.runs);
            let dir = ctx.work.join(format!("scale-{r}-{n}"));
            std::fs::create_dir_all(&dir).unwrap();
            let run = format!("r{r}n{n}");
            let key = |k: &str| -> &'static str { Box::leak(format!("{k}.{n}").into_boxed_str()) };

            // 1. The references, each feature on a fresh control plane of its own.
            {
                let p = Plane::start(&dir.join("cp-ref-snap")).await;
                let c = p.admin.clone();
                create_namespace(&c, NS).await;
                let tracker = track(
                    Api::<MiroirSnapshot>::all(c.clone()),
                    watcher::Config::default().labels(&format!("{LABEL}={run}")),
                    n,
                    snap_done,
                );
                let (t, cpu) = reference_run(&p, tracker, n, "reference snapshots", |i| {
                    let (c, run) = (c.clone(), run.clone());
                    async move { reference_snapshot(&c, format!("s{i:05}"), &run).await }
                })
                .await;
                s.push(key("ref.snapshots.rate"), n as f64 / t);
                s.push(key("ref.snapshots.api_cpu"), cpu * 1000.0 / n as f64);
            }
            {
                let p = Plane::start(&dir.join("cp-ref-vmx")).await;
                let c = p.admin.clone();
                create_namespace(&c, NS).await;
                create_all(
                    &Api::<PersistentVolumeClaim>::namespaced(c.clone(), NS),
                    (0..n + WARM).map(|i| pvc(&format!("pvc-{i:05}"))).collect(),
                )
                .await;
                reference_exports(&p, n..n + WARM, &format!("{run}w"), "warm-up exports").await;
                let (t, cpu) = reference_exports(&p, 0..n, &run, "reference exports").await;
                s.push(key("ref.vmexports.rate"), n as f64 / t);
                s.push(key("ref.vmexports.api_cpu"), cpu * 1000.0 / n as f64);
            }

            // 2. ucm, each feature on a fresh control plane of its own as its reference is, so
            // that neither step runs on the objects the other left.
            let (p, mut m) = ucm_plane(&dir, "snap").await;
            let c = p.admin.clone();
            let agents = start_agents(&p, &dir, &run, n);
            crate::procs::wait_agent_leases(&c, &NODES).await;
            let volumes: Api<MiroirVolume> = Api::all(c.clone());
            create_all(
                &volumes,
                agents
                    .volumes
                    .iter()
                    .map(|v| obj(json!({
                        "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirVolume",
                        "metadata": {"name": v, "labels": {LABEL: run}},
                        "spec": {"sizeBytes": 16384, "replicas": NODES.iter().map(|n| json!({"node": n, "backend": "loopfile"})).collect::<Vec<_>>()},
                    })))
                    .collect(),
            )
            .await;
            crate::steps::manager_quiet(&p).await;
            let snaps: Vec<MiroirSnapshot> = agents
                .volumes
                .iter()
                .map(|v| snapshot(&format!("{v}-s"), v, &run))
                .collect();
            let st = timed(
                &p,
                &m,
                Api::all(c.clone()),
                snaps,
                snap_done,
                &run,
                "MiroirSnapshots",
            )
            .await;
            s.push(key("snapshots.rate"), n as f64 / st.secs);
            s.push(
                key("snapshots.requests"),
                (st.manager.requests()) as f64 / n as f64,
            );
            s.push(
                key("snapshots.agent_requests"),
                (st.agents.requests() - st.agents.coordination_lease_requests()) as f64 / n as f64,
            );
            s.push(
                key("snapshots.api_cpu"),
                st.apiserver_cpu * 1000.0 / n as f64,
            );
            s.push(
                key("snapshots.manager_cpu"),
                st.manager_cpu * 1000.0 / n as f64,
            );
            notes.push((key("snapshots.top"), st.manager.top(8)));
            bd_insert(&mut Default::default(), "snapshots", st.manager.top(8));
            drop(agents);
            m.stop("TERM");
            drop(p);

            let (p, mut m) = ucm_plane(&dir, "vmx").await;
            let c = p.admin.clone();
            create_all(
                &Api::<PersistentVolumeClaim>::namespaced(c.clone(), NS),
                (0..n + WARM).map(|i| pvc(&format!("pvc-{i:05}"))).collect(),
            )
            .await;
            crate::steps::manager_quiet(&p).await;
            let kubelet = kubelet(c.clone(), NS.to_string());
            let warm = format!("{run}w");
            ucm_exports(&p, &m, n..n + WARM, &warm, "warm-up VirtualMachineExports").await;
            crate::steps::manager_quiet(&p).await;
            let st = ucm_exports(&p, &m, 0..n, &run, "VirtualMachineExports").await;
            kubelet.abort();
            s.push(key("vmexports.rate"), n as f64 / st.secs);
            s.push(
                key("vmexports.requests"),
                st.manager.requests() as f64 / n as f64,
            );
            s.push(
                key("vmexports.api_cpu"),
                st.apiserver_cpu * 1000.0 / n as f64,
            );
            s.push(
                key("vmexports.manager_cpu"),
                st.manager_cpu * 1000.0 / n as f64,
            );
            let conflicts = st.manager.code_besides_coordination_leases(409);
            s.push(key("vmexports.conflicts"), conflicts as f64 / n as f64);
            notes.push((key("vmexports.top"), st.manager.top(8)));
            bd_insert(&mut Default::default(), "vmexports", st.manager.top(8));
            m.stop("TERM");
            drop(p);
            if std::env::var("UCM_BENCH_KEEP").as_deref() != Ok("1") {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    figures(&s, &ns_list, &notes)
}

fn figures(s: &Samples, ns: &[usize], notes: &[(&'static str, String)]) -> Vec<Figure> {
    let note = |k: String| {
        notes
            .iter()
            .rev()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let mut f = Vec::new();
    for (key, kind, minimal) in [
        (
            "snapshots",
            "MiroirSnapshots (one per three-replica volume, 3 snapshot agents, fake barrier)",
            "bare client: the minimal writes of a round, 10 requests: create; finalizers, open, publish (manager); Suspended and Done from each of 3 agents",
        ),
        (
            "vmexports",
            "VirtualMachineExports of PVCs (the bench marks export pods Ready as a kubelet would)",
            "bare client: the minimal writes of an export, 7 requests: create; Service, token and certificate Secrets, Pod; the kubelet's Pod status; one final status",
        ),
    ] {
        for &n in ns {
            let rate = s.get(&format!("{key}.rate.{n}"));
            let refr = median(&s.get(&format!("ref.{key}.rate.{n}")));
            f.push(
                Figure::new(
                    PHASE,
                    &format!("scale.{key}.{n}.objects_per_s"),
                    &format!("{n} {kind}: create to final status"),
                    "objects/s",
                    rate,
                )
                .reference(refr, &format!("{minimal}; same concurrency (8)"), true)
                .higher_is_better(),
            );
            f.push(
                Figure::new(
                    PHASE,
                    &format!("scale.{key}.{n}.apiserver_cpu_per_object"),
                    &format!("{n} {kind}: etcd + kube-apiserver CPU per object"),
                    "ms",
                    s.get(&format!("{key}.api_cpu.{n}")),
                )
                .reference(
                    median(&s.get(&format!("ref.{key}.api_cpu.{n}"))),
                    "the same minimal writes",
                    true,
                )
                .note(format!(
                    "the manager itself: {:.2} ms CPU per object",
                    median(&s.get(&format!("{key}.manager_cpu.{n}")))
                )),
            );
            let mut req = Figure::new(
                PHASE,
                &format!("scale.{key}.{n}.requests_per_object"),
                &format!("{n} {kind}: manager API requests per object"),
                "requests",
                s.get(&format!("{key}.requests.{n}")),
            )
            .note(format!(
                "audit log, manager's ServiceAccount, all Leases included (its leader-election renewals too); top: {}",
                note(format!("{key}.top.{n}"))
            ));
            if key == "snapshots" {
                req = req.reference(4.0, "the manager's share of the minimal writes: create is the user's; finalizers, open, publish and its round grant", false);
                req.note.push_str(&format!(
                    "; the three agents add {:.2} requests per snapshot besides heartbeats (minimal: 6)",
                    median(&s.get(&format!("snapshots.agent_requests.{n}")))
                ));
            } else {
                req = req.reference(5.0, "the manager's share of the minimal writes: Service, 2 Secrets, Pod, one status", false);
                req.note.push_str(&format!(
                    "; 409 conflicts per export: {:.2}",
                    median(&s.get(&format!("vmexports.conflicts.{n}")))
                ));
            }
            f.push(req);
        }
        if let [small, .., large] = ns {
            let per = |n: usize| -> Vec<f64> {
                s.get(&format!("{key}.rate.{n}"))
                    .iter()
                    .map(|r| 1000.0 / r)
                    .collect()
            };
            let (a, b) = (per(*small), per(*large));
            f.push(
                Figure::new(
                    PHASE,
                    &format!("scale.{key}.time_per_object_{large}"),
                    &format!("{kind}: time per object at N = {large}"),
                    "ms",
                    b,
                )
                .reference(
                    median(&a),
                    &format!("ucm at N = {small} (issue 32 goal: within 1.2×)"),
                    true,
                ),
            );
        }
    }
    f
}

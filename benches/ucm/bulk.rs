//! Phase `bulk` (docs/benchmarks.md). Per run:
//! 1. References with a bare client (the bench's admin client): create and status-patch the same
//!    number of Exporters, VirtualMachineExports and MiroirSnapshots, timed until a watch has
//!    seen every patched status; then delete them.
//! 2. A fresh manager (all features, all namespaces, shipped defaults but 8 concurrent reconciles
//!    per controller, the bare client's concurrency) on an empty cluster:
//!    time to /readyz and RSS at zero objects.
//! 3. 5,000 Exporters, then 1,000 VirtualMachineExports of 1,000 PVCs (the bench acts as the
//!    kubelet and marks each export pod Running and Ready), then 1,000 MiroirSnapshots on 100
//!    three-replica volumes with three `ucm snapshot-agent` processes (fake barrier, loopfile
//!    backend), each timed from the first create until a watch has seen every object's final
//!    status. The manager's API requests come from the API server's audit log.
//! 4. RSS with everything cached; manager writes during an idle window.
//! 5. Restart: a new manager's time to /readyz with every object present (reference: a bare
//!    client listing the same objects), its writes during start-up, and its RSS.
//!
//! Each run has two fresh control planes (one for the references, one for ucm), so every run
//! starts from an empty etcd and no run waits for deletions.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret, Service};
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use ucm::exporter::crd::Exporter;
use ucm::snapshot::agent::barrier::fake::{self, FakeCluster, FakeVolume};
use ucm::snapshot::types::{MiroirSnapshot, MiroirVolume};
use ucm::vmexport::VirtualMachineExport;

use crate::Ctx;
use crate::cluster::Plane;
use crate::kube_util::{CONCURRENCY, create_all, create_namespace, list_all};
use crate::procs::Proc;
use crate::report::{Figure, median};
use crate::steps::{LABEL, Samples, bd_insert, exporter_done, obj, reference, timed};

const PHASE: &str = "bulk";
pub(crate) const NODES: [&str; 3] = ["bench-a", "bench-b", "bench-c"];

#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub exporters: usize,
    pub vmexports: usize,
    pub snapshots: usize,
    pub volumes: usize,
    /// Simulated exporters of the `grpc` phase, and how many of them are killed.
    pub grpc_exporters: usize,
    pub kills: usize,
}

impl Scale {
    pub fn cached(&self) -> usize {
        self.exporters + self.vmexports + self.snapshots
    }
}

/// The shipped defaults, as `config/default` deploys the manager: leader election on (default
/// Lease name and durations) and the default reconcile concurrency. Every phase measures what
/// users run; the Lease's own renewals are counted apart in the idle figures.
pub fn manager_args() -> Vec<String> {
    let mut args = vec!["--leader-elect".to_string()];
    // `UCM_BENCH_MANAGER_ARGS` (space-separated) adds flags, e.g. to compare worker counts when
    // choosing the default; results.md records it, since figures are then not the defaults'.
    if let Ok(extra) = std::env::var("UCM_BENCH_MANAGER_ARGS") {
        args.extend(extra.split_whitespace().map(str::to_string));
    }
    args
}

pub(crate) fn vmx_done(e: &VirtualMachineExport) -> bool {
    e.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Ready")
}

pub(crate) fn snap_done(s: &MiroirSnapshot) -> bool {
    s.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
}

fn exporter(name: &str, run: &str) -> Exporter {
    obj(json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
        "metadata": {"name": name, "labels": {LABEL: run}}, "spec": {}
    }))
}

pub(crate) fn vmexport(name: &str, pvc: &str, run: &str) -> VirtualMachineExport {
    obj(json!({
        "apiVersion": "export.kubevirt.io/v1", "kind": "VirtualMachineExport",
        "metadata": {"name": name, "labels": {LABEL: run}},
        "spec": {"source": {"kind": "PersistentVolumeClaim", "name": pvc}}
    }))
}

pub(crate) fn pvc(name: &str) -> PersistentVolumeClaim {
    obj(json!({
        "metadata": {"name": name, "annotations": {"cdi.kubevirt.io/storage.contentType": "kubevirt"}},
        "spec": {
            "accessModes": ["ReadWriteOnce"], "volumeMode": "Filesystem",
            "resources": {"requests": {"storage": "1Gi"}}, "storageClassName": "none",
        }
    }))
}

pub(crate) fn snapshot(name: &str, volume: &str, run: &str) -> MiroirSnapshot {
    obj(json!({
        "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirSnapshot",
        "metadata": {"name": name, "labels": {LABEL: run}}, "spec": {"volumeName": volume}
    }))
}

/// The kubelet the local control plane lacks: marks each export pod Running and Ready once.
pub(crate) fn kubelet(client: Client, ns: String) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let pods: Api<Pod> = Api::namespaced(client, &ns);
        let mut marked = std::collections::HashSet::new();
        let stream = watcher(
            pods.clone(),
            watcher::Config::default().labels("kubevirt.io.virt-export-service"),
        );
        let mut stream = std::pin::pin!(stream);
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
        while let Some(ev) = stream.next().await {
            let Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = ev else {
                continue;
            };
            if !marked.insert(p.name_any()) {
                continue;
            }
            let (pods, permit) = (pods.clone(), sem.clone().acquire_owned().await.unwrap());
            tokio::spawn(async move {
                let body = json!({"status": {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "containerStatuses": [{"name": "exporter", "ready": true, "restartCount": 0, "image": "ucm", "imageID": "",
                        "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}],
                }});
                let _ = pods
                    .patch_status(&p.name_any(), &PatchParams::default(), &Patch::Merge(body))
                    .await;
                drop(permit);
            });
        }
    })
}

pub(crate) struct Agents {
    _procs: Vec<Proc>,
    pub(crate) volumes: Vec<String>,
}

/// Three `ucm snapshot-agent` processes (fake barrier, loopfile pools) and the fake DRBD view of
/// `n` three-replica volumes, each 16 KiB.
pub(crate) fn start_agents(p: &Plane, dir: &Path, prefix: &str, n: usize) -> Agents {
    let fake_dir = dir.join("fake");
    std::fs::create_dir_all(&fake_dir).unwrap();
    let volumes: Vec<String> = (0..n).map(|i| format!("{prefix}-v{i:04}")).collect();
    let cluster = FakeCluster {
        volumes: volumes
            .iter()
            .map(|v| {
                (
                    v.clone(),
                    FakeVolume {
                        primary: Some(NODES[0].into()),
                        legs: NODES
                            .iter()
                            .map(|n| (n.to_string(), "UpToDate".to_string()))
                            .collect(),
                    },
                )
            })
            .collect(),
        faults: Default::default(),
    };
    fake::write_cluster(&fake_dir, &cluster).unwrap();
    let mut procs = Vec::new();
    for node in NODES {
        let ndir = dir.join(node);
        let vdir = ndir.join("pool/volumes");
        std::fs::create_dir_all(&vdir).unwrap();
        for v in &volumes {
            std::fs::write(vdir.join(format!("{v}.img")), vec![7u8; 16 * 1024]).unwrap();
        }
        procs.push(Proc::snapshot_agent(
            &p.agent_kubeconfig,
            node,
            &ndir,
            &fake_dir,
            &[],
        ));
    }
    Agents {
        _procs: procs,
        volumes,
    }
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let sc = ctx.scale;
    let mut s = Samples::default();
    let mut breakdown: BTreeMap<&'static str, String> = BTreeMap::new();
    for r in 0..ctx.runs {
        eprintln!("bulk run {}/{}", r + 1, ctx.runs);
        let dir = ctx.work.join(format!("bulk-{r}"));
        std::fs::create_dir_all(&dir).unwrap();
        let run = format!("r{r}");
        let ns = "bench";

        // 1. References, on an empty control plane of their own.
        {
            let p = Plane::start(&dir.join("cp-ref")).await;
            let c = p.admin.clone();
            create_namespace(&c, ns).await;
            let (t, cpu) = reference(
                &p,
                Api::<Exporter>::namespaced(c.clone(), ns),
                "exporter",
                (0..sc.exporters)
                    .map(|i| exporter(&format!("exp-{i:05}"), &run))
                    .collect(),
                exporter_done,
                &run,
            )
            .await;
            s.push("ref.exporters", sc.exporters as f64 / t);
            s.push("ref.exporters.api_cpu", cpu * 1000.0 / sc.exporters as f64);
            let (t, cpu) = reference(
                &p,
                Api::<VirtualMachineExport>::namespaced(c.clone(), ns),
                "vmexport",
                (0..sc.vmexports)
                    .map(|i| vmexport(&format!("vmx-{i:04}"), &format!("pvc-{i:04}"), &run))
                    .collect(),
                vmx_done,
                &run,
            )
            .await;
            s.push("ref.vmexports", sc.vmexports as f64 / t);
            s.push("ref.vmexports.api_cpu", cpu * 1000.0 / sc.vmexports as f64);
            let (t, cpu) = reference(
                &p,
                Api::<MiroirSnapshot>::all(c.clone()),
                "snapshot",
                (0..sc.snapshots)
                    .map(|i| snapshot(&format!("s{i:04}"), "none", &run))
                    .collect(),
                snap_done,
                &run,
            )
            .await;
            s.push("ref.snapshots", sc.snapshots as f64 / t);
            s.push("ref.snapshots.api_cpu", cpu * 1000.0 / sc.snapshots as f64);
        }

        // 2. A fresh manager on another empty control plane.
        let p = Plane::start(&dir.join("cp")).await;
        let c = p.admin.clone();
        create_namespace(&c, ns).await;
        let mut m = Proc::manager(
            &p.manager_kubeconfig,
            dir.join("manager.log"),
            &manager_args(),
        );
        let ready = m.wait_ready(Duration::from_secs(120)).await;
        s.push("startup.empty", ready.as_secs_f64());
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss0 = m.rss() as f64;
        s.push("rss.zero", rss0 / f64::from(1 << 20));
        let agents = start_agents(&p, &dir, &run, sc.volumes);
        crate::procs::wait_agent_leases(&c, &NODES).await;

        // 3. Bulk: Exporters, VirtualMachineExports, MiroirSnapshots.
        let st = timed(
            &p,
            &m,
            Api::<Exporter>::namespaced(c.clone(), ns),
            (0..sc.exporters)
                .map(|i| exporter(&format!("exp-{i:05}"), &run))
                .collect(),
            exporter_done,
            &run,
            "Exporters",
        )
        .await;
        s.step("exporters", &st, sc.exporters);
        bd_insert(&mut breakdown, "exporters", st.manager.top(8));

        create_all(
            &Api::<PersistentVolumeClaim>::namespaced(c.clone(), ns),
            (0..sc.vmexports)
                .map(|i| pvc(&format!("pvc-{i:04}")))
                .collect(),
        )
        .await;
        let kubelet = kubelet(c.clone(), ns.to_string());
        let st = timed(
            &p,
            &m,
            Api::<VirtualMachineExport>::namespaced(c.clone(), ns),
            (0..sc.vmexports)
                .map(|i| vmexport(&format!("vmx-{i:04}"), &format!("pvc-{i:04}"), &run))
                .collect(),
            vmx_done,
            &run,
            "VirtualMachineExports",
        )
        .await;
        kubelet.abort();
        s.step("vmexports", &st, sc.vmexports);
        bd_insert(&mut breakdown, "vmexports", st.manager.top(8));

        let volumes: Api<MiroirVolume> = Api::all(c.clone());
        let vols: Vec<MiroirVolume> = agents
            .volumes
            .iter()
            .map(|v| obj(json!({
                "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirVolume",
                "metadata": {"name": v, "labels": {LABEL: run}},
                "spec": {"sizeBytes": 16384, "replicas": NODES.iter().map(|n| json!({"node": n, "backend": "loopfile"})).collect::<Vec<_>>()},
            })))
            .collect();
        create_all(&volumes, vols).await;
        let per_volume = sc.snapshots.div_ceil(sc.volumes);
        let snap_objs: Vec<MiroirSnapshot> = (0..sc.snapshots)
            .map(|i| {
                let v = &agents.volumes[i / per_volume];
                snapshot(&format!("{v}-s{:02}", i % per_volume), v, &run)
            })
            .collect();
        let st = timed(
            &p,
            &m,
            Api::all(c.clone()),
            snap_objs,
            snap_done,
            &run,
            "MiroirSnapshots",
        )
        .await;
        s.step("snapshots", &st, sc.snapshots);
        s.push(
            "snapshots.agent_requests",
            st.agents.requests() as f64 / sc.snapshots as f64,
        );
        bd_insert(&mut breakdown, "snapshots", st.manager.top(8));
        bd_insert(&mut breakdown, "snapshot agents", st.agents.top(6));

        // 4. Memory with everything cached, and the idle write rate.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let rss1 = m.rss() as f64;
        s.push("rss.cached", rss1 / f64::from(1 << 20));
        s.push(
            "rss.per_object",
            (rss1 - rss0) / sc.cached() as f64 / 1024.0,
        );
        let off0 = p.audit.offset();
        let w0 = Instant::now();
        tokio::time::sleep(ctx.idle_window).await;
        let counts = p.audit.count(off0, p.audit.offset());
        let idle = counts.get("ucm-manager").cloned().unwrap_or_default();
        let minutes = w0.elapsed().as_secs_f64() / 60.0;
        let (lease_writes, lease_requests) = (
            idle.coordination_lease_writes(),
            idle.coordination_lease_requests(),
        );
        s.push(
            "idle.writes_per_min",
            (idle.writes - lease_writes) as f64 / minutes,
        );
        s.push("idle.lease_writes_per_min", lease_writes as f64 / minutes);
        s.push(
            "idle.lease_requests_per_min",
            lease_requests as f64 / minutes,
        );
        s.push(
            "idle.requests_per_min",
            (idle.requests() - lease_requests) as f64 / minutes,
        );
        // The snapshot agents: nothing but their heartbeat Leases (a watch of their own status
        // writes must not wake them into another write).
        let agents_idle = counts.get("ucm-agent").cloned().unwrap_or_default();
        let beats = agents_idle.coordination_lease_writes();
        s.push(
            "idle.agent_writes_per_min",
            (agents_idle.writes - beats) as f64 / minutes,
        );
        s.push(
            "idle.agent_heartbeats_per_min",
            beats as f64 / minutes / NODES.len() as f64,
        );
        s.push(
            "idle.agent_requests_per_min",
            agents_idle.requests() as f64 / minutes / NODES.len() as f64,
        );
        if idle.requests() > 0 {
            bd_insert(&mut breakdown, "idle", idle.top(6));
        }

        // 5. Restart with every object present.
        m.stop("TERM");
        let t0 = Instant::now();
        let listed = list_reference(&c).await;
        s.push("startup.list_ref", t0.elapsed().as_secs_f64());
        eprintln!("  reference list: {listed} objects");
        let off0 = p.audit.offset();
        let mut m2 = Proc::manager(
            &p.manager_kubeconfig,
            dir.join("manager-restart.log"),
            &manager_args(),
        );
        let ready = m2.wait_ready(Duration::from_secs(300)).await;
        s.push("startup.full", ready.as_secs_f64());
        tokio::time::sleep(Duration::from_secs(5)).await;
        let counts = p.audit.count(off0, p.audit.offset());
        let st = counts.get("ucm-manager").cloned().unwrap_or_default();
        // Its leader-election Lease (acquisition and renewals in the window) is not a write an
        // unchanged object caused.
        s.push(
            "startup.writes",
            (st.writes - st.coordination_lease_writes()) as f64,
        );
        if st.writes > 0 {
            bd_insert(&mut breakdown, "start-up writes", st.top(6));
        }
        let rss2 = m2.rss() as f64;
        s.push("rss.restarted", rss2 / f64::from(1 << 20));
        s.push(
            "rss.restarted_per_object",
            (rss2 - rss0) / sc.cached() as f64 / 1024.0,
        );
        s.push("objects.listed", listed as f64);

        // More start-up samples: one restart per run is at the mercy of the host's mood, so
        // each run restarts STARTS_PER_RUN times, each right after a reference list so both
        // see the host alike.
        m2.stop("TERM");
        for i in 1..STARTS_PER_RUN {
            let t0 = Instant::now();
            list_reference(&c).await;
            s.push("startup.list_ref", t0.elapsed().as_secs_f64());
            let mut m3 = Proc::manager(
                &p.manager_kubeconfig,
                dir.join(format!("manager-restart-{i}.log")),
                &manager_args(),
            );
            let ready = m3.wait_ready(Duration::from_secs(300)).await;
            s.push("startup.full", ready.as_secs_f64());
            m3.stop("TERM");
        }

        // 6. Stop everything; the control plane and its data go with it.
        drop(agents);
        drop(p);
        if std::env::var("UCM_BENCH_KEEP").as_deref() != Ok("1") {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    figures(ctx, &s, &breakdown)
}

/// Manager start-ups with every object present, per run (see step 5).
const STARTS_PER_RUN: usize = 3;

/// The start-up reference: a bare client listing the kinds the manager caches, one after the
/// other (pages of 500, as the manager). Returns how many objects it listed.
async fn list_reference(c: &Client) -> usize {
    let mut listed = 0;
    listed += list_all(&Api::<Exporter>::all(c.clone())).await;
    listed += list_all(&Api::<VirtualMachineExport>::all(c.clone())).await;
    listed += list_all(&Api::<MiroirSnapshot>::all(c.clone())).await;
    listed += list_all(&Api::<MiroirVolume>::all(c.clone())).await;
    listed += list_all(&Api::<Secret>::all(c.clone())).await;
    listed += list_all(&Api::<Pod>::all(c.clone())).await;
    listed += list_all(&Api::<Service>::all(c.clone())).await;
    listed += list_all(&Api::<PersistentVolumeClaim>::all(c.clone())).await;
    listed += list_all(&Api::<ConfigMap>::all(c.clone())).await;
    listed
}

fn figures(ctx: &Ctx, s: &Samples, breakdown: &BTreeMap<&str, String>) -> Vec<Figure> {
    let sc = ctx.scale;
    let bd = |k: &str| breakdown.get(k).cloned().unwrap_or_default();
    let mut f = Vec::new();
    for (key, kind, n, extra) in [
        ("exporters", "Exporters", sc.exporters, ""),
        (
            "vmexports",
            "VirtualMachineExports (with PVCs; the bench marks export pods Ready as a kubelet would)",
            sc.vmexports,
            "",
        ),
        (
            "snapshots",
            "MiroirSnapshots (one per three-replica volume, 3 snapshot agents, fake barrier)",
            sc.snapshots,
            "",
        ),
    ] {
        let rate = s.get(&format!("{key}.rate"));
        let refr = median(&s.get(&format!("ref.{key}")));
        f.push(
            Figure::new(
                PHASE,
                &format!("bulk.{key}.objects_per_s"),
                &format!("{n} {kind}: create to final status"),
                "objects/s",
                rate,
            )
            .reference(
                refr,
                "bare client: create + status patch of the same objects, same concurrency (8)",
                true,
            )
            .higher_is_better()
            .note(format!(
                "final status: {}{extra}",
                match key {
                    "exporters" => "credential and the Online condition written",
                    "vmexports" => "phase Ready",
                    _ => "readyToUse true",
                }
            )),
        );
        let mut req = Figure::new(PHASE, &format!("bulk.{key}.requests_per_object"), &format!("{kind}: manager API requests per object"), "requests", s.get(&format!("{key}.requests")))
            .reference(2.0, "bare client: one create and one status patch", false)
            .note(format!(
                "non-watch requests by the manager's ServiceAccount in the apiserver audit log; writes per object: median {:.2}; top: {}",
                median(&s.get(&format!("{key}.writes"))),
                bd(key)
            ));
        f.push(
            Figure::new(PHASE, &format!("bulk.{key}.apiserver_cpu_per_object"), &format!("{kind}: etcd + kube-apiserver CPU per object"), "ms", s.get(&format!("{key}.api_cpu")))
                .reference(median(&s.get(&format!("ref.{key}.api_cpu"))), "bare client: create + status patch", true)
                .note(format!(
                    "CPU of the kharness process (etcd and kube-apiserver) during the step, from /proc; it does not depend on how busy the machine is. The manager itself used a median {:.2} ms of CPU per object",
                    median(&s.get(&format!("{key}.manager_cpu")))
                )),
        );
        if key == "snapshots" {
            req.note.push_str(&format!(
                "; the three agents add {:.2} requests per snapshot ({})",
                median(&s.get("snapshots.agent_requests")),
                bd("snapshot agents")
            ));
        }
        f.push(req);
    }
    f.push(
        Figure::new(
            PHASE,
            "memory.rss_zero",
            "manager RSS at start, no objects",
            "MiB",
            s.get("rss.zero"),
        )
        .reference(
            40.0,
            "typical controller-runtime manager at zero objects (issue 9)",
            false,
        ),
    );
    let listed = median(&s.get("objects.listed"));
    f.push(
        Figure::new(PHASE, "memory.bytes_per_object", &format!("manager RSS per cached object, after the bulk steps ({} primary objects)", sc.cached()), "KiB", s.get("rss.per_object"))
            .reference(16.0, "typical controller-runtime cache (issue 9)", false)
            .note(format!("(RSS 5 s after the last bulk step − RSS at zero) / primary objects (Exporters, VirtualMachineExports, MiroirSnapshots); the caches also hold their Secrets, Pods, Services, PVCs and MiroirVolumes: {listed:.0} objects of the cached kinds in all. Includes what the allocator kept from the bulk work")),
    );
    f.push(
        Figure::new(PHASE, "memory.bytes_per_object_restarted", &format!("manager RSS per cached object, restarted manager ({} primary objects)", sc.cached()), "KiB", s.get("rss.restarted_per_object"))
            .reference(16.0, "typical controller-runtime cache (issue 9)", false)
            .note("(RSS of a manager started with every object present, at /readyz + 5 s − RSS at zero) / primary objects: the caches without the bulk work's garbage"),
    );
    f.push(
        Figure::new(
            PHASE,
            "memory.rss_cached",
            "manager RSS with every object cached",
            "MiB",
            s.get("rss.cached"),
        )
        .reference(
            40.0 + sc.cached() as f64 * 16.0 / 1024.0,
            "controller-runtime estimate: 40 MiB + 16 KiB per object",
            false,
        ),
    );
    f.push(
        Figure::new(
            PHASE,
            "memory.rss_restarted",
            "RSS of a restarted manager with every object present",
            "MiB",
            s.get("rss.restarted"),
        )
        .reference(
            40.0 + sc.cached() as f64 * 16.0 / 1024.0,
            "controller-runtime estimate: 40 MiB + 16 KiB per object",
            false,
        ),
    );
    f.push(
        Figure::new(PHASE, "idle.writes_per_min", "idle leader: API writes per minute besides its Lease renewals, all objects settled", "writes/min", s.get("idle.writes_per_min"))
            .reference(0.0, "target", false)
            .note(format!(
                "audit log over a {} s window after the bulk steps; requests per minute besides the Lease: median {:.1}{}",
                ctx.idle_window.as_secs(),
                median(&s.get("idle.requests_per_min")),
                if bd("idle").is_empty() { String::new() } else { format!(" (all: {})", bd("idle")) }
            )),
    );
    f.push(
        Figure::new(PHASE, "idle.agent_writes_per_min", "idle snapshot agents: API writes per minute besides their heartbeat Leases, all snapshots settled", "writes/min", s.get("idle.agent_writes_per_min"))
            .reference(0.0, "target", false),
    );
    f.push(
        Figure::new(
            PHASE,
            "idle.agent_heartbeats_per_min",
            "idle snapshot agent: heartbeat Lease writes per minute (--heartbeat-interval 20 s)",
            "writes/min",
            s.get("idle.agent_heartbeats_per_min"),
        )
        .reference(3.0, "one per heartbeat interval", true)
        .note(format!(
            "all requests per agent per minute: median {:.1} (one patch per beat, no read)",
            median(&s.get("idle.agent_requests_per_min")),
        )),
    );
    f.push(
        Figure::new(PHASE, "idle.lease_writes_per_min", "idle leader: leader-election Lease writes per minute (retry period 2 s)", "writes/min", s.get("idle.lease_writes_per_min"))
            .reference(30.0, "client-go at the same settings: one update per retry period", true)
            .note(format!(
                "all Lease requests per minute (reads too): median {:.1}; client-go sends a GET before each update (60/min)",
                median(&s.get("idle.lease_requests_per_min")),
            )),
    );
    f.push(
        Figure::new(
            PHASE,
            "startup.ready_full",
            &format!("start-up to /readyz with {} objects present", sc.cached()),
            "s",
            s.get("startup.full"),
        )
        .reference(
            median(&s.get("startup.list_ref")),
            "bare client listing the same kinds one after the other (pages of 500, as the manager)",
            true,
        )
        .note(format!(
            "{STARTS_PER_RUN} start-ups per run, each right after a reference list; start-up with no objects: median {:.2} s",
            median(&s.get("startup.empty"))
        )),
    );
    f.push(
        Figure::new(
            PHASE,
            "startup.writes",
            "writes by a restarted manager besides its Lease (spawn to ready + 5 s)",
            "writes",
            s.get("startup.writes"),
        )
        .reference(0.0, "target: unchanged objects cost no write", false)
        .note(bd("start-up writes")),
    );
    f
}

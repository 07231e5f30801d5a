//! `make soak` (docs/testing.md, "Reliability"): one manager with every feature, behind a proxy
//! that drops its connections at random for the first minute, while objects of all three features
//! are created, updated and deleted at a steady rate for `SOAK_MINUTES` (default 10). At the end
//! every object must have reached its final state; the manager's resident memory and open file
//! descriptors must not have grown beyond noise, and no reconcile error may be left over. Prints
//! a summary docs/testing.md quotes. Not part of `make test` (`test = false` in Cargo.toml).

// The soak run uses only part of the fixture the e2e suite shares.
#[allow(dead_code)]
mod common;
#[allow(dead_code)]
mod rig;

use std::{
    collections::{BTreeMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use common::*;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use rig::{World, proxy::Proxy, *};
use serde_json::json;

const CYCLE: Duration = Duration::from_secs(3);
const CHAOS: Duration = Duration::from_secs(60);
const KEEP_EXPORTERS: usize = 6;
const KEEP_EXPORTS: usize = 4;
const KEEP_SNAPSHOTS: usize = 3;

#[derive(Default, Debug)]
struct Counts {
    exporters_created: u32,
    exporters_deleted: u32,
    exporter_updates: u32,
    leases_created: u32,
    leases_deleted: u32,
    snapshots_created: u32,
    snapshots_deleted: u32,
    /// Deleted snapshots that had been published before their deletion.
    snapshots_deleted_published: u32,
    exports_created: u32,
    exports_deleted: u32,
    export_updates: u32,
}

struct Sample {
    rss: f64,
    fds: f64,
    errors: f64,
}

async fn sample(m: &Manager) -> Sample {
    let text = m.metrics().await;
    let (rss, fds) = process_figures(&text);
    Sample {
        rss,
        fds,
        errors: metric(&text, "controller_runtime_reconcile_errors_total", &[]),
    }
}

fn mib(b: f64) -> f64 {
    b / (1 << 20) as f64
}

/// Plays kubelet for every export Pod of the namespace: marks it running and ready.
fn kubelet(w: &World, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    let pods = w.pods();
    tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            if let Ok(list) = pods.list(&ListParams::default()).await {
                let export_pods = list.items.into_iter().filter(|p| {
                    p.metadata
                        .owner_references
                        .iter()
                        .flatten()
                        .any(|r| r.kind == "VirtualMachineExport")
                });
                for p in export_pods {
                    let running =
                        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                    if !running && p.metadata.deletion_timestamp.is_none() {
                        let _ = mark_ready(&pods, &p.metadata.name.unwrap_or_default()).await;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: run by `make soak` (SOAK_MINUTES, default 10)"]
async fn soak() {
    let minutes: f64 = std::env::var("SOAK_MINUTES")
        .ok()
        .map(|s| {
            s.parse()
                .unwrap_or_else(|_| panic!("SOAK_MINUTES={s} is not a number"))
        })
        .unwrap_or(10.0);
    assert!(
        minutes >= 2.0,
        "SOAK_MINUTES must be at least 2 (one minute of dropped connections, then steady churn)"
    );
    let total = Duration::from_secs_f64(minutes * 60.0);

    let env = TestEnv::new("soak").await;
    let mut w = World::new(env.client.clone(), &env.kubeconfig, &env.ns, FAST);
    for n in ["a", "b", "c"] {
        w.start_agent(n);
    }
    let proxy = Proxy::start(server_port(&env.kubeconfig)).await;
    let via = shipped_identity_via(&w, &["exporter", "snapshot", "vmexport"], proxy.port);
    let m = Manager::start(
        w.manager_opts(&via, free_port(), Some(&unique("ucm-soak")))
            .kubeconfig_as_is(),
    );
    m.wait_ready().await;
    w.wait_agents_alive(&["a", "b", "c"]).await;
    let pid = m.pid();
    let at_ready = sample(&m).await;

    let vols = [unique("pvc"), unique("pvc")];
    let mut data = BTreeMap::new();
    for v in &vols {
        data.insert(v.clone(), w.volume(v, &["a", "b", "c"], 4 * MIB).await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let kubelet = kubelet(&w, stop.clone());

    // The churn: one cycle every 3 s. Chaos on the manager's connections for the first minute.
    let chaos = tokio::spawn({
        let proxy = Arc::new(proxy);
        let p = proxy.clone();
        async move { (p.chaos(CHAOS).await, proxy) }
    });
    let started = Instant::now();
    let mut counts = Counts::default();
    let mut exporters: VecDeque<String> = VecDeque::new();
    let mut leases: VecDeque<String> = VecDeque::new();
    let mut exports: VecDeque<String> = VecDeque::new();
    let mut snaps: VecDeque<(String, String)> = VecDeque::new();
    let mut gone: Vec<String> = vec![];
    let mut after_warmup: Option<Sample> = None;
    let mut i = 0u32;
    while started.elapsed() < total {
        let tick = Instant::now();
        i += 1;
        // exporter: a new exporter every other cycle, the oldest deleted beyond 6 (its Secret
        // and Leases are collected with it); a label update and a liveness report on another;
        // a 6-second lease by selector every cycle, deleted once ended.
        if i % 2 == 1 {
            let name = format!("e{i}");
            w.create_exporter(&name, json!({"pool": "soak"})).await;
            w.report_available(&name).await;
            exporters.push_back(name);
            counts.exporters_created += 1;
            if exporters.len() > KEEP_EXPORTERS {
                let old = exporters.pop_front().unwrap();
                w.exporters()
                    .delete(&old, &DeleteParams::default())
                    .await
                    .unwrap();
                gone.push(format!("Exporter {old}"));
                counts.exporters_deleted += 1;
            }
        }
        if let Some(e) = exporters.get(i as usize % exporters.len()) {
            w.exporters()
                .patch(
                    e,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"labels": {"gen": i.to_string()}}})),
                )
                .await
                .unwrap();
            w.report_available(e).await;
            counts.exporter_updates += 1;
        }
        let lease = format!("l{i}");
        w.create_lease(&lease, json!({"pool": "soak"}), "6s").await;
        leases.push_back(lease);
        counts.leases_created += 1;
        while let Some(l) = leases.front().cloned() {
            match w.lease(&l).await {
                Some(x) if x.status.as_ref().is_some_and(|s| s.ended) => {
                    // 404: collected with its exporter meanwhile.
                    match w.leases().delete(&l, &DeleteParams::default()).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(s)) if s.code == 404 => {}
                        Err(e) => panic!("delete Lease {l}: {e}"),
                    }
                    leases.pop_front();
                    counts.leases_deleted += 1;
                }
                None => {
                    // collected with its exporter
                    leases.pop_front();
                    counts.leases_deleted += 1;
                }
                Some(_) => break,
            }
        }

        // vmexport: a PVC and an export every cycle, a label update, the oldest deleted
        // beyond 4 (its children collected); the kubelet task marks the Pods ready.
        let x = format!("x{i}");
        w.create_pvc(&format!("p{i}")).await;
        w.create_export(&x, &format!("p{i}"), None).await;
        exports.push_back(x);
        counts.exports_created += 1;
        if let Some(e) = exports.front() {
            w.exports()
                .patch(
                    e,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"labels": {"gen": i.to_string()}}})),
                )
                .await
                .unwrap();
            counts.export_updates += 1;
        }
        if exports.len() > KEEP_EXPORTS {
            let old = exports.pop_front().unwrap();
            w.exports()
                .delete(&old, &DeleteParams::default())
                .await
                .unwrap();
            gone.push(format!("VirtualMachineExport {old}"));
            let pvc = format!("p{}", old.trim_start_matches('x'));
            let _ = kube::Api::<k8s_openapi::api::core::v1::PersistentVolumeClaim>::namespaced(
                w.client.clone(),
                &w.ns,
            )
            .delete(&pvc, &DeleteParams::default())
            .await;
            counts.exports_deleted += 1;
        }

        // snapshot: every fourth cycle a snapshot of one of two volumes (rounds on one volume
        // queue behind each other), the oldest deleted beyond 3 (agents tear down their legs).
        if i % 4 == 1 {
            let vol = vols[(i / 4) as usize % 2].clone();
            let s = unique("soak");
            w.create_snapshot(&s, &vol).await;
            snaps.push_back((s, vol));
            counts.snapshots_created += 1;
            if snaps.len() > KEEP_SNAPSHOTS {
                let (old, _) = snaps.pop_front().unwrap();
                if w.snapshot(&old).await.and_then(|x| x.status?.ready_to_use) == Some(true) {
                    counts.snapshots_deleted_published += 1;
                }
                w.snapshots()
                    .delete(&old, &DeleteParams::default())
                    .await
                    .unwrap();
                gone.push(format!("MiroirSnapshot {old}"));
                counts.snapshots_deleted += 1;
            }
        }

        if after_warmup.is_none() && started.elapsed() >= CHAOS + Duration::from_secs(30) {
            after_warmup = Some(sample(&m).await);
        }
        if let Some(left) = CYCLE.checked_sub(tick.elapsed()) {
            tokio::time::sleep(left).await;
        }
    }
    let churn = started.elapsed();
    let (chaos, _proxy) = chaos.await.unwrap();
    let after_warmup = after_warmup.expect("the soak outlasted the warm-up");

    // Convergence: every object left reaches its final state.
    let settle = Instant::now();
    for x in &exports {
        w.wait_export(x, "Ready", Duration::from_secs(120), |e| {
            export_phase(e) == ("Ready".into(), "PodReady".into())
        })
        .await;
        w.assert_export_children_unique(x).await;
    }
    for (s, vol) in &snaps {
        w.assert_snapshot_published(s, &["a", "b", "c"], &data[vol], Duration::from_secs(120))
            .await;
    }
    for l in &leases {
        // Ended, or collected with its deleted exporter.
        eventually(
            Duration::from_secs(120),
            &format!("lease {l} to end"),
            || async {
                w.lease(l)
                    .await
                    .is_none_or(|x| x.status.as_ref().is_some_and(|s| s.ended))
            },
        )
        .await;
    }
    for e in &exporters {
        eventually(
            Duration::from_secs(60),
            "no leaseRef on a free exporter",
            || async {
                w.exporters()
                    .get_opt(e)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|x| x.status.and_then(|s| s.lease_ref).is_none())
            },
        )
        .await;
    }
    // Deleted objects are gone, with what they own (agents removed their snapshot finalizers;
    // the garbage collector took Secrets, Leases, Pods and Services).
    for what in &gone {
        let (kind, name) = what.split_once(' ').unwrap();
        eventually(
            Duration::from_secs(120),
            &format!("{what} and its children to go"),
            || async {
                let exists = match kind {
                    "Exporter" => w.exporters().get_opt(name).await.ok().flatten().is_some(),
                    "VirtualMachineExport" => w.export(name).await.is_some(),
                    _ => w.snapshot(name).await.is_some(),
                };
                !exists && !owns_anything(&w, kind, name).await
            },
        )
        .await;
    }
    let settled = settle.elapsed();
    // Left over: nothing still failing and retrying once everything has settled.
    let converged = sample(&m).await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    let end = sample(&m).await;
    stop.store(true, Ordering::SeqCst);
    kubelet.await.unwrap();

    assert!(alive(pid) && m.pid() == pid, "the manager restarted");
    let text = m.metrics().await;
    let summary = format!(
        "SOAK SUMMARY: {minutes} min of churn ({:.0} s), one cycle every {}s, every feature in one manager\n\
         objects: exporters {} created / {} deleted / {} updated; leases {} created / {} deleted; \
         snapshots {} created / {} deleted ({} of those published before deletion) / {} left, all published; exports {} created / {} deleted / {} updated; \
         every deleted object gone with its children\n\
         faults (first {} s): proxy cut {} connections and refused {} (of {} accepted)\n\
         converged {:.1} s after the churn stopped\n\
         manager RSS: {:.1} MiB at ready, {:.1} MiB after warm-up, {:.1} MiB at the end\n\
         manager open fds: {} at ready, {} after warm-up, {} at the end\n\
         reconcile errors: {} in total ({} during the first {} s), {} left over (none in the final {} s)\n{}",
        churn.as_secs_f64(),
        CYCLE.as_secs(),
        counts.exporters_created,
        counts.exporters_deleted,
        counts.exporter_updates,
        counts.leases_created,
        counts.leases_deleted,
        counts.snapshots_created,
        counts.snapshots_deleted,
        counts.snapshots_deleted_published,
        snaps.len(),
        counts.exports_created,
        counts.exports_deleted,
        counts.export_updates,
        CHAOS.as_secs(),
        chaos.cuts,
        chaos.refused,
        chaos.accepted,
        settled.as_secs_f64(),
        mib(at_ready.rss),
        mib(after_warmup.rss),
        mib(end.rss),
        at_ready.fds,
        after_warmup.fds,
        end.fds,
        end.errors,
        after_warmup.errors,
        CHAOS.as_secs() + 30,
        end.errors - converged.errors,
        20,
        metric_lines(&text, "ucm_reconcile_errors_by_reason_total"),
    );
    eprintln!("{summary}");
    if let Ok(path) = std::env::var("SOAK_SUMMARY") {
        std::fs::write(&path, &summary).unwrap();
        // The logs next to it, for reading what happened during the run.
        std::fs::write(format!("{path}.manager.log"), m.logs()).unwrap();
        for a in &w.agents {
            std::fs::write(format!("{path}.agent-{}.log", a.node), a.logs()).unwrap();
        }
    }

    assert_eq!(
        end.errors, converged.errors,
        "reconcile errors keep coming after everything converged"
    );
    // Noise: the allocator keeps some freed memory; a leak grows with the number of objects
    // churned (thousands here), far beyond this bound.
    assert!(
        end.rss <= after_warmup.rss * 1.25 + 8.0 * (1 << 20) as f64,
        "RSS grew: {:.1} MiB → {:.1} MiB",
        mib(after_warmup.rss),
        mib(end.rss)
    );
    // Most descriptors are API connections, one per open watch: a watch in backoff right after
    // the chaos has none, so the higher of the two early samples is the baseline.
    let fds_baseline = at_ready.fds.max(after_warmup.fds);
    assert!(
        end.fds <= fds_baseline + 8.0,
        "open fds grew: {fds_baseline} → {}",
        end.fds
    );

    let names: Vec<&str> = snaps.iter().map(|(s, _)| s.as_str()).collect();
    let vols: Vec<&str> = vols.iter().map(String::as_str).collect();
    w.cleanup_snapshots(&names, &vols).await;
}

/// Whether any Secret, Lease or Pod in the namespace still names `name` (of `kind`) as owner.
async fn owns_anything(w: &World, kind: &str, name: &str) -> bool {
    use k8s_openapi::api::core::v1::{Pod, Secret};
    let owned =
        |refs: Option<&Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>>| {
            refs.into_iter()
                .flatten()
                .any(|r| r.kind == kind && r.name == name)
        };
    let lp = ListParams::default();
    let secrets = kube::Api::<Secret>::namespaced(w.client.clone(), &w.ns)
        .list(&lp)
        .await;
    let pods = kube::Api::<Pod>::namespaced(w.client.clone(), &w.ns)
        .list(&lp)
        .await;
    let leases = w.leases().list(&lp).await;
    match (secrets, pods, leases) {
        (Ok(s), Ok(p), Ok(l)) => {
            s.items
                .iter()
                .any(|x| owned(x.metadata.owner_references.as_ref()))
                || p.items
                    .iter()
                    .any(|x| owned(x.metadata.owner_references.as_ref()))
                || l.items
                    .iter()
                    .any(|x| owned(x.metadata.owner_references.as_ref()))
        }
        _ => true,
    }
}

/// Resident memory (bytes) and open file descriptors of a process, from its /metrics.
fn process_figures(metrics: &str) -> (f64, f64) {
    (
        metric(metrics, "process_resident_memory_bytes", &[]),
        metric(metrics, "process_open_fds", &[]),
    )
}

//! `make bench` (snapshot.md §14): the barrier-held time of a 3-replica round against a local
//! API server, with the manager and three `ucm snapshot-agent` processes using the fake barrier
//! and the loopfile backend. Per leg: from the start of the raise (freeze, else suspend) to the
//! end of the lift (thaw, else resume), minus that leg's cut time, as the fake barrier's event
//! log records them. Reports the median, p95 and max over `UCM_BENCH_ROUNDS` rounds (default
//! 20). It measures; it asserts nothing (goal: p95 under 200 ms).
//!
//! Uses `UCM_E2E_KUBECONFIG` when set, else starts its own control plane (needs `make cluster`).

#[path = "../e2e/tests/common/mod.rs"]
mod common;

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::*;
use kube::{
    Api,
    api::{DeleteParams, PostParams},
};
use serde_json::json;
use ucm::snapshot::{
    agent::barrier::fake::{self, FakeCluster, FakeVolume},
    types::{MiroirSnapshot, MiroirVolume},
};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        signal(self.0.id(), "TERM");
        let _ = self.0.wait();
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() {
    let rounds: usize = std::env::var("UCM_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let env = TestEnv::new("bench").await;
    let dir = tempfile::Builder::new()
        .prefix("ucm-bench-")
        .tempdir()
        .unwrap();
    let prefix = unique("bench");
    let nodes: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|n| format!("{prefix}-{n}"))
        .collect();
    let vol = unique("pvc-bench");
    let fake_dir = dir.path().join("fake");
    std::fs::create_dir_all(&fake_dir).unwrap();
    fake::write_cluster(
        &fake_dir,
        &FakeCluster {
            volumes: [(
                vol.clone(),
                FakeVolume {
                    primary: Some(nodes[0].clone()),
                    legs: nodes
                        .iter()
                        .map(|n| (n.clone(), "UpToDate".to_string()))
                        .collect(),
                },
            )]
            .into(),
            faults: Default::default(),
        },
    )
    .unwrap();

    let mut procs = Vec::new();
    for n in &nodes {
        let ndir = dir.path().join(n);
        let vfile = ndir.join("pool/volumes").join(format!("{vol}.img"));
        std::fs::create_dir_all(vfile.parent().unwrap()).unwrap();
        let f = std::fs::File::create(&vfile).unwrap();
        f.set_len(16 << 20).unwrap();
        let pools = ndir.join("pools.yaml");
        std::fs::write(
            &pools,
            format!(
                "pools:\n  default: {{backend: loopfile, base: {}}}\n",
                ndir.join("pool").display()
            ),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_ucm"))
            .arg("snapshot-agent")
            .arg(format!("--node-name={n}"))
            .arg(format!("--kubeconfig={}", env.kubeconfig.display()))
            .arg(format!("--namespace={}", env.ns))
            .arg("--heartbeat-interval=2s")
            .arg("--barrier=fake")
            .arg(format!("--fake-barrier-dir={}", fake_dir.display()))
            .arg(format!("--pools={}", pools.display()))
            .arg("--loopfile-full-copy")
            .arg(format!("--journal={}", ndir.join("journal.json").display()))
            .arg("--metrics-bind-address=0")
            .arg("--health-probe-bind-address=0")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(ndir.join("agent.log")).unwrap())
            .spawn()
            .expect("start ucm snapshot-agent");
        procs.push(Proc(child));
    }
    let manager = Manager::start(ManagerOpts::new(&env.kubeconfig, &env.ns).only("snapshot"));
    manager.wait_ready().await;

    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(env.client.clone(), &env.ns);
    for n in &nodes {
        let name = format!("ucm-snapshot-agent-{n}");
        eventually(TIMEOUT, "agent heartbeats", || async {
            leases.get_opt(&name).await.ok().flatten().is_some()
        })
        .await;
    }
    let volumes: Api<MiroirVolume> = Api::all(env.client.clone());
    let v: MiroirVolume = serde_json::from_value(json!({
        "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirVolume",
        "metadata": {"name": vol},
        "spec": {"sizeBytes": 16 << 20, "replicas": nodes.iter().map(|n| json!({"node": n, "backend": "loopfile"})).collect::<Vec<_>>()},
    }))
    .unwrap();
    volumes.create(&PostParams::default(), &v).await.unwrap();

    let snaps: Api<MiroirSnapshot> = Api::all(env.client.clone());
    let mut held_minus_cut = Vec::new();
    let mut round_times = Vec::new();
    let mut names = Vec::new();
    for i in 0..rounds {
        let name = format!("{vol}-{i}");
        let s: MiroirSnapshot = serde_json::from_value(json!({
            "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirSnapshot",
            "metadata": {"name": name}, "spec": {"volumeName": vol}
        }))
        .unwrap();
        let t0 = Instant::now();
        snaps.create(&PostParams::default(), &s).await.unwrap();
        eventually(Duration::from_secs(120), "the round to publish", || async {
            snaps
                .get_opt(&name)
                .await
                .ok()
                .flatten()
                .and_then(|s| s.status?.ready_to_use)
                == Some(true)
        })
        .await;
        round_times.push(t0.elapsed().as_secs_f64());
        names.push(name.clone());
        // Agents lift concurrently with the publish: wait until every node's kernel is clear.
        for n in &nodes {
            eventually(TIMEOUT, "the lifts", || async {
                let k = fake::read_kernel(&fake_dir, n);
                k.suspended.is_empty() && k.frozen.is_empty()
            })
            .await;
        }
        for n in &nodes {
            let evs = fake::read_events(&fake_dir, n);
            // This round's events on this node: from its raise to its lift, around its cut.
            let Some(cut_idx) = evs
                .iter()
                .position(|e| e.event == "cut" && e.snapshot.as_deref() == Some(name.as_str()))
            else {
                panic!("no cut of {name} on {n}");
            };
            let start = evs[..cut_idx]
                .iter()
                .rev()
                .take_while(|e| e.event == "freeze" || e.event == "suspend")
                .last()
                .map(|e| e.at_ns)
                .expect("raise before the cut");
            let end = evs[cut_idx + 1..]
                .iter()
                .take_while(|e| e.event == "resume" || e.event == "thaw")
                .last()
                .map(|e| e.at_ns)
                .expect("lift after the cut");
            let cut = evs[cut_idx].duration_ns.unwrap_or(0);
            held_minus_cut.push((end - start).saturating_sub(cut) as f64 / 1e9);
        }
    }
    held_minus_cut.sort_by(|a, b| a.partial_cmp(b).unwrap());
    round_times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let ms = |x: f64| x * 1000.0;
    println!(
        "snapshot barrier, 3 replicas, {rounds} rounds ({} legs): held time minus cut time: median {:.1} ms, p95 {:.1} ms, max {:.1} ms (goal: p95 < 200 ms)",
        held_minus_cut.len(),
        ms(percentile(&held_minus_cut, 0.5)),
        ms(percentile(&held_minus_cut, 0.95)),
        ms(*held_minus_cut.last().unwrap()),
    );
    println!(
        "create to readyToUse: median {:.1} ms, p95 {:.1} ms",
        ms(percentile(&round_times, 0.5)),
        ms(percentile(&round_times, 0.95)),
    );

    for name in &names {
        let _ = snaps.delete(name, &DeleteParams::default()).await;
    }
    eventually(
        Duration::from_secs(60),
        "the bench snapshots to go",
        || async {
            let mut gone = true;
            for name in &names {
                gone &= snaps.get_opt(name).await.ok().flatten().is_none();
            }
            gone
        },
    )
    .await;
    let _ = volumes.delete(&vol, &DeleteParams::default()).await;
    drop(manager);
    drop(procs);
}

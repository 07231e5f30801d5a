//! Phase `barrier` (docs/snapshot.md, "Testing": the performance goal): the barrier-held time of
//! 3-replica rounds against the local API server, with the manager and three `ucm snapshot-agent`
//! processes using the fake barrier and the loopfile backend. Per leg: from the start of the raise
//! (freeze, else suspend) to the end of the lift (thaw, else resume), minus that leg's cut time,
//! as the fake barrier's event log records them. Rounds run one after the other.

use std::time::{Duration, Instant};

use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use ucm::snapshot::agent::barrier::fake::{self, FakeCluster, FakeVolume};
use ucm::snapshot::types::{MiroirSnapshot, MiroirVolume};

use crate::Ctx;
use crate::procs::Proc;
use crate::report::{Figure, percentile};

const PHASE: &str = "barrier";

async fn until(what: &str, timeout: Duration, mut f: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Milliseconds from the start of this snapshot's raise (freeze, else suspend) to the end of its
/// lift (resume and thaw), minus its cut time; None until the log holds the whole leg.
fn held_minus_cut(evs: &[fake::FakeEvent], snapshot: &str) -> Option<f64> {
    let cut_idx = evs
        .iter()
        .position(|e| e.event == "cut" && e.snapshot.as_deref() == Some(snapshot))?;
    let start = evs[..cut_idx]
        .iter()
        .rev()
        .take_while(|e| e.event == "freeze" || e.event == "suspend")
        .last()?
        .at_ns;
    let end = evs[cut_idx + 1..]
        .iter()
        .take_while(|e| e.event == "resume" || e.event == "thaw")
        .last()?
        .at_ns;
    let cut = evs[cut_idx].duration_ns.unwrap_or(0);
    Some((end - start).saturating_sub(cut) as f64 / 1e6)
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let c = ctx.plane.admin.clone();
    let dir = ctx.work.join("barrier");
    let nodes: Vec<String> = ["x", "y", "z"]
        .iter()
        .map(|n| format!("barrier-{n}"))
        .collect();
    let vol = "barrier-vol".to_string();
    let fake_dir = dir.join("fake");
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
    let mut agents = Vec::new();
    for n in &nodes {
        let ndir = dir.join(n);
        let vfile = ndir.join("pool/volumes").join(format!("{vol}.img"));
        std::fs::create_dir_all(vfile.parent().unwrap()).unwrap();
        std::fs::File::create(&vfile)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        agents.push(Proc::snapshot_agent(
            &ctx.plane.agent_kubeconfig,
            n,
            &ndir,
            &fake_dir,
            &["--heartbeat-interval=2s"],
        ));
    }
    let mut m = Proc::manager(
        &ctx.plane.manager_kubeconfig,
        dir.join("manager.log"),
        // Shipped defaults (leader election on), the snapshot feature alone: the figure is the
        // agents' barrier, and the other features would only add noise to the same two cores.
        &[
            "--leader-elect".into(),
            "--enable-exporter=false".into(),
            "--enable-vmexport=false".into(),
        ],
    );
    m.wait_ready(Duration::from_secs(60)).await;
    let names: Vec<&str> = nodes.iter().map(String::as_str).collect();
    crate::procs::wait_agent_leases(&c, &names).await;
    let volumes: Api<MiroirVolume> = Api::all(c.clone());
    let v: MiroirVolume = serde_json::from_value(json!({
        "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirVolume",
        "metadata": {"name": vol},
        "spec": {"sizeBytes": 16 << 20, "replicas": nodes.iter().map(|n| json!({"node": n, "backend": "loopfile"})).collect::<Vec<_>>()},
    }))
    .unwrap();
    volumes.create(&PostParams::default(), &v).await.unwrap();

    let snaps: Api<MiroirSnapshot> = Api::all(c.clone());
    let mut run_medians = Vec::new();
    let mut run_p99 = Vec::new();
    let mut all_legs = Vec::new();
    let mut round_times = Vec::new();
    let mut names = Vec::new();
    for r in 0..ctx.runs {
        let mut legs = Vec::new();
        for i in 0..ctx.barrier_rounds {
            let name = format!("{vol}-{r}-{i}");
            let s: MiroirSnapshot = serde_json::from_value(json!({
                "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirSnapshot",
                "metadata": {"name": name}, "spec": {"volumeName": vol}
            }))
            .unwrap();
            let t0 = Instant::now();
            snaps.create(&PostParams::default(), &s).await.unwrap();
            until(
                "the round to publish",
                Duration::from_secs(120),
                async || {
                    snaps
                        .get_opt(&name)
                        .await
                        .ok()
                        .flatten()
                        .and_then(|s| s.status?.ready_to_use)
                        == Some(true)
                },
            )
            .await;
            round_times.push(t0.elapsed().as_secs_f64());
            names.push(name.clone());
            // Agents lift concurrently with the publish: wait until every node's kernel is clear.
            for n in &nodes {
                until("the lifts", Duration::from_secs(60), async || {
                    let k = fake::read_kernel(&fake_dir, n);
                    k.suspended.is_empty() && k.frozen.is_empty()
                })
                .await;
            }
            for n in &nodes {
                // The fake barrier writes the kernel state before it appends the event, so the
                // lift may reach the log a moment after the kernel looks clear.
                let mut leg = None;
                until(
                    "the lift in the event log",
                    Duration::from_secs(10),
                    async || {
                        leg = held_minus_cut(&fake::read_events(&fake_dir, n), &name);
                        leg.is_some()
                    },
                )
                .await;
                legs.push(leg.unwrap());
            }
        }
        eprintln!(
            "  run {r}: {} legs, median {:.1} ms, p99 {:.1} ms",
            legs.len(),
            crate::report::median(&legs),
            percentile(&legs, 0.99)
        );
        run_medians.push(crate::report::median(&legs));
        run_p99.push(percentile(&legs, 0.99));
        all_legs.extend(legs);
    }
    for name in &names {
        let _ = snaps.delete(name, &DeleteParams::default()).await;
    }
    until(
        "the bench snapshots to go",
        Duration::from_secs(120),
        async || {
            for name in &names {
                if snaps.get_opt(name).await.ok().flatten().is_some() {
                    return false;
                }
            }
            true
        },
    )
    .await;
    let _ = volumes.delete(&vol, &DeleteParams::default()).await;
    m.stop("TERM");
    drop(agents);
    let _ = std::fs::remove_dir_all(&dir);

    let rounds = ctx.barrier_rounds;
    vec![
        Figure::new(PHASE, "barrier.held_median", &format!("barrier held minus cut, 3-replica rounds: per-run median ({rounds} rounds × 3 legs per run)"), "ms", run_medians)
            .reference(200.0, "ucm goal: p95 under 200 ms (docs/snapshot.md, \"Testing\"); upstream agents poll every 1–2 s", false),
        Figure::new(PHASE, "barrier.held_p99", &format!("barrier held minus cut, 3-replica rounds: per-run p99 ({rounds} rounds × 3 legs per run)"), "ms", run_p99)
            .reference(200.0, "ucm goal: p95 under 200 ms (docs/snapshot.md, \"Testing\")", false)
            .note(format!(
                "over all {} legs: median {:.1} ms, p99 {:.1} ms, max {:.1} ms; create to readyToUse: median {:.0} ms",
                all_legs.len(),
                crate::report::median(&all_legs),
                percentile(&all_legs, 0.99),
                all_legs.iter().copied().fold(0.0, f64::max),
                crate::report::median(&round_times) * 1000.0
            )),
    ]
}

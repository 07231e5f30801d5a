//! Fault tests (docs/testing.md, "Reliability"): what clusters do to a controller manager, against
//! the real local control plane, with every feature mid-work when the fault hits.
//!
//! - The API server restarts (etcd data kept) on a control plane of the test's own.
//! - The leader is SIGKILLed with a warm standby; a monitor records any state a single leader
//!   would not produce.
//! - Agents fail: a snapshot agent killed holding its barrier, an exporter killed mid-hook, an
//!   export Pod deleted mid-download.
//! - A proxy between manager and API server drops connections at random.
//!
//! MiroirSnapshots are cluster-scoped, so tests that run the snapshot feature on the shared
//! cluster hold `sole_snapshot_coordinator()` (one coordinator at a time). Longer runs are in `soak.rs`.

use std::{
    collections::BTreeMap,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::common::*;
use crate::rig::{
    World,
    exporter_client::{ExporterClient, Report, next_status},
    proxy::Proxy,
    work::Monitor,
    *,
};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, Patch, PatchParams},
};
use serde_json::json;
use ucm::exporter::crd::HookPhase;
use ucm::snapshot::types::SlotState;

const SETTLE: Duration = Duration::from_secs(90);

async fn is_leader(m: &Manager) -> bool {
    m.metrics()
        .await
        .lines()
        .any(|l| l.starts_with("leader_election_master_status{") && l.ends_with(" 1"))
}

/// API server restart with etcd data kept, while every feature is mid-work: the manager keeps
/// running (same process), reconnects its watches, re-acquires leadership, serves gRPC again,
/// loses no work, and every object reaches its final state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "e2e: needs e2e/bin/kharness (make cluster)"]
async fn api_server_restart_mid_work_loses_nothing() {
    let dir = tempfile::Builder::new()
        .prefix("ucm-faults-restart-")
        .tempdir()
        .unwrap();
    let cdir = dir.path().join("cluster");
    let d = cdir.clone();
    let mut harness = tokio::task::spawn_blocking(move || Harness::start_in(&d, false))
        .await
        .unwrap();
    let kubeconfig = harness.kubeconfig.clone();
    let client = client_for(&kubeconfig).await;
    install_crds(&client).await;
    let ns = create_namespace(&client, "faults-restart").await;
    let mut w = World::new(client.clone(), &kubeconfig, &ns, crate::rig::FAST);
    for n in ["a", "b", "c"] {
        w.start_agent(n);
    }
    let grpc = free_port();
    let lease = unique("ucm-faults");
    // The shipped identity, checked by hand below: a restarted API server answers 403 for a
    // moment while its RBAC cache fills, which the fixture's check would take for a missing rule.
    let identity = {
        let (kc, ns, dir) = (kubeconfig.clone(), ns.clone(), w.dir.path().to_path_buf());
        tokio::task::spawn_blocking(move || {
            shipped_identity(&kc, &ns, &["exporter", "snapshot", "vmexport"], None, &dir)
        })
        .await
        .unwrap()
    };
    let m = Manager::start(
        w.manager_opts(&identity, grpc, Some(&lease))
            .kubeconfig_as_is(),
    );
    m.wait_ready().await;
    w.wait_agents_alive(&["a", "b", "c"]).await;
    let work = w.start_work(Duration::from_secs(12)).await;
    let pid = m.pid();
    let errors_before = metric(&m.metrics().await, "ucm_watch_errors_total", &[]);

    // The fault: the control plane process dies (etcd's data stays on disk) and comes back on
    // the same address after longer than the renew deadline, so leadership is lost too.
    let outage = Instant::now();
    let killed_at = jiff::Timestamp::now();
    assert!(
        !m.logs().contains("forbidden"),
        "the shipped roles refused a request before the fault"
    );
    harness.kill();
    let h = harness;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(alive(pid), "the manager died while the API server was down");
    drop(h);
    let d = cdir.clone();
    let h = tokio::task::spawn_blocking(move || Harness::start_in(&d, false))
        .await
        .unwrap();
    let back_at = jiff::Timestamp::now();
    eprintln!("API server down for {:.1}s", outage.elapsed().as_secs_f64());
    assert_eq!(h.kubeconfig, kubeconfig, "same address and credentials");

    w.finish_work(&work, SETTLE).await;

    // Same process throughout; it noticed the outage and recovered without a restart.
    assert!(alive(pid), "the manager exited");
    assert_eq!(m.pid(), pid);
    m.wait_ready().await;
    eventually(TIMEOUT, "leadership to be re-acquired", || is_leader(&m)).await;
    let text = m.metrics().await;
    assert!(
        metric(&text, "ucm_watch_errors_total", &[]) > errors_before,
        "no watch error counted across the outage:\n{}",
        metric_lines(&text, "ucm_watch_errors_total")
    );
    // The leader-only gRPC server came back with leadership: the exporter registers again.
    let ca = w.grpc_ca().await;
    let mut ex = ExporterClient::connect(grpc, &ca, &ns, "e1", &work.token, TIMEOUT).await;
    let (uid, _) = ex
        .register(false)
        .await
        .expect("Register after the restart");
    assert_eq!(Some(uid), w.exporters().get("e1").await.unwrap().uid());
    assert!(
        !m.logs().contains("stopped unexpectedly"),
        "a feature or server stopped"
    );
    // 403s only while the restarted API server's RBAC cache filled (its authorizer answers
    // "role not found" until then; up to ~25 s on a loaded 2-core machine).
    let grace = back_at + jiff::SignedDuration::from_secs(60);
    for line in m.logs().lines().filter(|l| l.contains("forbidden")) {
        let at: jiff::Timestamp = line
            .split_whitespace()
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("unparsable log line: {line}"));
        assert!(
            at >= killed_at && at <= grace,
            "a request was refused outside the restart (back at {back_at}):\n{line}"
        );
    }
    drop(ex);
    drop(m);
    w.agents.clear();
    drop(h);
}

/// Leader SIGKILL mid-work with a warm standby: the standby finishes every feature's work, and
/// nothing ends up in a state a single leader would not produce (two active leases on one
/// exporter, a leg state outside a live snapshot round, a second token for one exporter, a
/// duplicated export Pod or Secret).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn leader_sigkill_mid_work_standby_finishes() {
    let _serial = sole_snapshot_coordinator().await;
    let env = TestEnv::new("faults-leader").await;
    let mut w = World::new(
        env.client.clone(),
        &env.kubeconfig,
        &env.ns,
        crate::rig::FAST,
    );
    for n in ["a", "b", "c"] {
        w.start_agent(n);
    }
    let lease = unique("ucm-faults");
    let (pa, pb) = (free_port(), free_port());
    // Each replica has a Pod (never scheduled: only its leader label matters here).
    create_pod(&w, "mgr-a", false).await;
    create_pod(&w, "mgr-b", false).await;
    let mut leader = Manager::start(with_pod(
        w.manager_opts(&env.kubeconfig, pa, Some(&lease)),
        "mgr-a",
    ));
    eventually(TIMEOUT, "the first manager to lead", || is_leader(&leader)).await;
    eventually(TIMEOUT, "mgr-a to carry the leader label", || async {
        leader_label(&w, "mgr-a").await == Some(true)
    })
    .await;
    let standby = Manager::start(with_pod(
        w.manager_opts(&env.kubeconfig, pb, Some(&lease)),
        "mgr-b",
    ));
    standby.wait_ready().await;
    assert!(!is_leader(&standby).await);
    w.wait_agents_alive(&["a", "b", "c"]).await;
    let work = w.start_work(Duration::from_secs(10)).await;
    let monitor = Monitor::start(&w, &work);

    leader.signal("KILL");
    leader.wait_exit(Duration::from_secs(10));
    let killed = Instant::now();
    eventually(TIMEOUT, "the standby to take over", || is_leader(&standby)).await;
    eprintln!(
        "standby leads {:.1}s after the SIGKILL",
        killed.elapsed().as_secs_f64()
    );
    // Leader-only Services follow: the label moved to the standby's Pod and left the dead one.
    eventually(TIMEOUT, "the leader label to move to mgr-b", || async {
        leader_label(&w, "mgr-b").await == Some(true)
            && leader_label(&w, "mgr-a").await == Some(false)
    })
    .await;

    w.finish_work(&work, SETTLE).await;
    monitor.assert_clean().await;
    // The standby serves the exporters with the same certificate and accepts the same token.
    let ca = w.grpc_ca().await;
    let mut ex = ExporterClient::connect(pb, &ca, &env.ns, "e1", &work.token, TIMEOUT).await;
    ex.register(false).await.expect("Register with the standby");
    drop(ex);
    w.cleanup_snapshots(&[&work.snap], &[&work.vol]).await;
}

fn with_pod<'a>(mut o: ManagerOpts<'a>, pod: &str) -> ManagerOpts<'a> {
    o.env.push(("POD_NAME".into(), pod.into()));
    o
}

async fn create_pod(w: &World, name: &str, leader: bool) {
    let mut labels = serde_json::Map::new();
    if leader {
        labels.insert("ucm.io/leader".into(), json!("true"));
    }
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "ucm", "image": "ucm"}]}
    }))
    .unwrap();
    w.pods()
        .create(&Default::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("create Pod {name}: {e}"));
}

/// Whether the Pod carries `ucm.io/leader=true` (None: no such Pod).
async fn leader_label(w: &World, pod: &str) -> Option<bool> {
    let p = w.pods().get_opt(pod).await.ok().flatten()?;
    Some(p.labels().get("ucm.io/leader").map(String::as_str) == Some("true"))
}

/// The leader label write at acquisition fails (here: the manager's Pod does not exist yet,
/// as any transient API error would): it is retried after each renewal until the leader's Pod
/// carries the label and a stale leader's Pod no longer does, so the gRPC Service finds it.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn leader_label_is_written_even_when_the_first_write_fails() {
    let env = TestEnv::new("faults-label").await;
    let w = World::new(
        env.client.clone(),
        &env.kubeconfig,
        &env.ns,
        crate::rig::FAST,
    );
    let m = Manager::start(ManagerOpts {
        env: vec![("POD_NAME".into(), "mgr-late".into())],
        ..w.manager_opts(&env.kubeconfig, free_port(), Some(&unique("ucm-faults")))
            .only("exporter")
    });
    eventually(TIMEOUT, "leadership", || is_leader(&m)).await;
    eventually(TIMEOUT, "the failed label write", || async {
        m.logs()
            .contains("could not update the leader label on our Pod")
    })
    .await;
    create_pod(&w, "stale-leader", true).await;
    create_pod(&w, "mgr-late", false).await;
    eventually(
        TIMEOUT,
        "the label on mgr-late, off stale-leader",
        || async {
            leader_label(&w, "mgr-late").await == Some(true)
                && leader_label(&w, "stale-leader").await == Some(false)
        },
    )
    .await;
}

/// A snapshot agent SIGKILLed while it holds its barrier (another leg is away, so the round
/// cannot finish): the round is voided at the deadline naming the missing leg, the surviving
/// leg lifts by itself, the restarted agent lifts the barrier its journal recorded (the sweep
/// at start), and the next round publishes with every leg cut exactly once.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn snapshot_agent_killed_holding_its_barrier_recovers() {
    let _serial = sole_snapshot_coordinator().await;
    let env = TestEnv::new("faults-agent").await;
    let mut w = World::new(
        env.client.clone(),
        &env.kubeconfig,
        &env.ns,
        crate::rig::FAST,
    );
    for n in ["a", "b", "c"] {
        w.start_agent(n);
    }
    let m = Manager::start(
        w.manager_opts(&env.kubeconfig, free_port(), None)
            .only("snapshot"),
    );
    m.wait_ready().await;
    w.wait_agents_alive(&["a", "b", "c"]).await;
    let vol = unique("pvc");
    let snap = unique("snap");
    let data = w.volume(&vol, &["a", "b", "c"], 8 * MIB).await;
    w.agent("c").kill();
    w.create_snapshot(&snap, &vol).await;
    let (a, b) = (w.node("a"), w.node("b"));
    let s = wait_snapshot(&w, &snap, "a and b Suspended", TIMEOUT, |s| {
        let sl = slots(s);
        open_round(s).is_some()
            && sl.get(&a) == Some(&SlotState::Suspended)
            && sl.get(&b) == Some(&SlotState::Suspended)
    })
    .await;
    let first = open_round(&s).unwrap();
    w.agent("b").kill();
    assert!(!w.kernel_clear("b"), "b's barrier is up as it dies");

    // Voided at the deadline; a lifts by itself; b's flag stays while b is down.
    let voided = wait_snapshot(&w, &snap, "the void", TIMEOUT, |s| {
        s.status.as_ref().is_some_and(|st| {
            st.io_suspended == Some(false) && st.suspended_at.as_ref() != Some(&first)
        })
    })
    .await;
    let (st, reason, msg) =
        condition(Some(&voided.status.clone().unwrap().conditions), "Ready").unwrap();
    assert_eq!(
        (st.as_str(), reason.as_str()),
        ("False", "BarrierExpired"),
        "{msg}"
    );
    assert!(msg.contains(&w.node("c")), "{msg}");
    eventually(TIMEOUT, "a to lift at the deadline", || async {
        w.kernel_clear("a")
    })
    .await;
    assert!(!w.kernel_clear("b"), "nothing may lift b's barrier but b");

    w.start_agent("b");
    w.start_agent("c");
    eventually(
        TIMEOUT,
        "the restarted b to lift its stale barrier",
        || async { w.kernel_clear("b") },
    )
    .await;
    let published = w
        .assert_snapshot_published(&snap, &["a", "b", "c"], &data, SETTLE)
        .await;
    // No leg cut in the round that could not complete (I1, docs/snapshot.md, "Invariants"): every
    // cut follows the void, and each leg's last cut belongs to the published round.
    let ns_of = |t: &str| t.parse::<jiff::Timestamp>().unwrap().as_nanosecond() as u128;
    let void_ns = ns_of(
        voided
            .status
            .as_ref()
            .unwrap()
            .suspended_at
            .as_ref()
            .unwrap(),
    );
    let round_ns = ns_of(&published.status.unwrap().suspended_at.unwrap());
    for n in ["a", "b", "c"] {
        let cuts: Vec<u128> = w
            .events(n)
            .into_iter()
            .filter(|e| e.volume == vol && e.event == "cut")
            .map(|e| e.at_ns)
            .collect();
        assert!(
            !cuts.is_empty() && cuts.iter().all(|t| *t >= void_ns),
            "node {n}: cuts {cuts:?}, void at {void_ns}"
        );
        assert!(cuts.last().is_some_and(|t| *t >= round_ns), "node {n}");
    }
    let text = m.metrics().await;
    let rounds = |r: &str| metric(&text, "ucm_snapshot_rounds_total", &[("result", r)]);
    assert!(
        rounds("expired") >= 1.0 && rounds("success") == 1.0,
        "{}",
        metric_lines(&text, "ucm_snapshot_rounds_total")
    );
    w.cleanup_snapshots(&[&snap], &[&vol]).await;
}

async fn online(w: &World) -> Option<String> {
    let e = w.exporters().get("e1").await.ok()?;
    condition(e.status.as_ref()?.conditions.as_ref(), "Online").map(|c| c.0)
}

/// The lease-hooks record's state of `hook`: (phase, attempts).
async fn hook(w: &World, hook: &str) -> Option<(HookPhase, i64)> {
    let r = w.exporters().get("e1").await.ok()?.status?.lease_hooks?;
    let h = if hook == "beforeLease" {
        r.before_lease
    } else {
        r.after_lease
    }?;
    Some((h.phase, h.attempts.unwrap_or(0)))
}

async fn wait_hook(w: &World, name: &str, phase: HookPhase, attempts: i64) {
    eventually(
        TIMEOUT,
        &format!("{name} {phase:?} after {attempts} attempt(s)"),
        || async { hook(w, name).await == Some((phase, attempts)) },
    )
    .await;
}

/// An exporter killed mid-hook (docs/exporter.md, "Lease hooks: the record"; upstream #242),
/// speaking the protocol as a recording exporter does. Killed during beforeLease: it is marked
/// Offline within the threshold, its lease is not ended, and after a restart the record (Register's
/// headers) says the hook was cut off; the re-run counts as a second attempt. Killed during
/// afterLease: the next lease waits through the outage, the restart and the re-run, and is assigned
/// once the exporter reports it done.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn exporter_killed_mid_hook_recovers() {
    let env = TestEnv::new("faults-hook").await;
    let w = World::new(
        env.client.clone(),
        &env.kubeconfig,
        &env.ns,
        crate::rig::FAST,
    );
    let grpc = free_port();
    let m = Manager::start(
        w.manager_opts(&env.kubeconfig, grpc, None)
            .only("exporter")
            .args(["--exporter-offline-threshold=3s"]),
    );
    m.wait_ready().await;
    w.create_exporter("e1", json!({"board": "rpi"})).await;
    let token = w.wait_exporter_token("e1").await;
    let ca = w.grpc_ca().await;
    let connect = || ExporterClient::connect(grpc, &ca, &env.ns, "e1", &token, TIMEOUT);

    let mut ex = connect().await;
    let (uid, record) = ex.register(true).await.unwrap();
    assert!(record.is_none());
    let mut stream = ex.status().await.unwrap();
    ex.report(Report::Available, "ready").await.unwrap();
    eventually(TIMEOUT, "e1 Online", || async {
        online(&w).await.as_deref() == Some("True")
    })
    .await;
    w.create_lease("l1", json!({"board": "rpi"}), "1h").await;
    next_status(&mut stream, "leasing l1", TIMEOUT, |r| {
        r.leased && r.lease_name.as_deref() == Some("l1")
    })
    .await;

    // Killed during beforeLease.
    ex.report(Report::BeforeLeaseHook, "beforeLease running")
        .await
        .unwrap();
    wait_hook(&w, "beforeLease", HookPhase::Running, 1).await;
    drop(stream);
    drop(ex);
    let killed = Instant::now();
    eventually(
        Duration::from_secs(10),
        "e1 Offline after the kill",
        || async { online(&w).await.as_deref() == Some("False") },
    )
    .await;
    eprintln!(
        "Offline {:.1}s after the kill (threshold 3s)",
        killed.elapsed().as_secs_f64()
    );
    let st = w.lease("l1").await.unwrap().status.unwrap();
    assert!(!st.ended, "l1 ended because its exporter died");
    assert_eq!(st.exporter_ref_name(), Some("e1"));

    // Restarted: the record says beforeLease was cut off; the exporter runs it again.
    let mut ex = connect().await;
    let (uid2, record) = ex.register(true).await.unwrap();
    assert_eq!(uid2, uid);
    let record = record.expect("the record in Register's headers");
    assert_eq!(record.lease_ref.map(|r| r.name).as_deref(), Some("l1"));
    assert_eq!(
        record.before_lease.map(|h| h.phase),
        Some(HookPhase::Running)
    );
    let mut stream = ex.status().await.unwrap();
    next_status(&mut stream, "l1 announced again", TIMEOUT, |r| {
        r.leased && r.lease_name.as_deref() == Some("l1")
    })
    .await;
    ex.report(Report::BeforeLeaseHook, "beforeLease again")
        .await
        .unwrap();
    wait_hook(&w, "beforeLease", HookPhase::Running, 2).await;
    ex.report(Report::LeaseReady, "ready").await.unwrap();
    wait_hook(&w, "beforeLease", HookPhase::Succeeded, 2).await;
    eventually(TIMEOUT, "e1 Online again", || async {
        online(&w).await.as_deref() == Some("True")
    })
    .await;

    // Killed during afterLease: the next lease waits for the owed hook.
    w.leases()
        .patch(
            "l1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"release": true}})),
        )
        .await
        .unwrap();
    next_status(&mut stream, "l1 released", TIMEOUT, |r| !r.leased).await;
    ex.report(Report::AfterLeaseHook, "afterLease running")
        .await
        .unwrap();
    wait_hook(&w, "afterLease", HookPhase::Running, 1).await;
    w.create_lease("l2", json!({"board": "rpi"}), "1h").await;
    drop(stream);
    drop(ex);
    w.wait_lease("l2", "l2 Pending", TIMEOUT, |l| {
        condition(
            l.status.as_ref().and_then(|s| s.conditions.as_ref()),
            "Pending",
        )
        .is_some_and(|c| c.0 == "True")
    })
    .await;
    eventually(
        Duration::from_secs(10),
        "e1 Offline after the second kill",
        || async { online(&w).await.as_deref() == Some("False") },
    )
    .await;

    // Restarted: the record says afterLease is owed, for l1 and its client.
    let mut ex = connect().await;
    let (_, record) = ex.register(true).await.unwrap();
    let record = record.expect("the record in Register's headers");
    assert_eq!(record.lease_ref.map(|r| r.name).as_deref(), Some("l1"));
    assert_eq!(record.client_name.as_deref(), Some("c1"));
    assert_eq!(
        record.after_lease.map(|h| h.phase),
        Some(HookPhase::Running)
    );
    let _stream = ex.status().await.unwrap();
    ex.report(Report::AfterLeaseHook, "afterLease again")
        .await
        .unwrap();
    wait_hook(&w, "afterLease", HookPhase::Running, 2).await;
    // Online again but still running the hook: l2 must wait, saying why.
    w.wait_lease(
        "l2",
        "l2 Pending/NotReady naming the owed hook",
        TIMEOUT,
        |l| {
            condition(
                l.status.as_ref().and_then(|s| s.conditions.as_ref()),
                "Pending",
            )
            .is_some_and(|(s, r, m)| {
                s == "True" && r == "NotReady" && m.contains("afterLease hook owed")
            })
        },
    )
    .await;
    assert!(
        w.lease("l2")
            .await
            .unwrap()
            .status
            .unwrap()
            .exporter_ref
            .is_none()
    );
    ex.report(Report::Available, "afterLease done")
        .await
        .unwrap();
    w.wait_lease("l2", "l2 to hold e1", TIMEOUT, |l| {
        l.status.as_ref().and_then(|s| s.exporter_ref_name()) == Some("e1")
    })
    .await;
    let l1 = w.lease("l1").await.unwrap().status.unwrap();
    let ready = condition(l1.conditions.as_ref(), "Ready").unwrap();
    assert_eq!((l1.ended, ready.1.as_str()), (true, "Released"));
}

/// `ucm export-server` run as the Pod the manager rendered would run it (paths mapped into
/// `root`, the Pod's cert and token Secrets): the kubelet's part, for one Pod.
fn run_export_server(pod: &Pod, cert: &Secret, token: &str, root: &Path) -> (Child, u16) {
    let ctr = &pod.spec.as_ref().unwrap().containers[0];
    let map = |p: &str| {
        root.join(p.trim_start_matches('/'))
            .to_string_lossy()
            .into_owned()
    };
    let mut envs: BTreeMap<String, String> = BTreeMap::new();
    for e in ctr.env.clone().unwrap() {
        let Some(v) = e.value else { continue };
        let v = if e.name.ends_with("_EXPORT_PATH") || e.name.ends_with("_FILE") {
            map(&v)
        } else {
            v
        };
        envs.insert(e.name, v);
    }
    let data = |k: &str| cert.data.as_ref().unwrap()[k].0.clone();
    std::fs::create_dir_all(map("/cert")).unwrap();
    std::fs::create_dir_all(map("/token")).unwrap();
    std::fs::write(map("/cert/tls.crt"), data("tls.crt")).unwrap();
    std::fs::write(map("/cert/tls.key"), data("tls.key")).unwrap();
    std::fs::write(root.join("ca.crt"), data("ca.crt")).unwrap();
    std::fs::write(map("/token/token"), token).unwrap();
    let port = free_port();
    envs.insert("LISTEN_ADDR".into(), format!("127.0.0.1:{port}"));
    envs.insert("METRICS_ADDR".into(), format!("127.0.0.1:{}", free_port()));
    let child = Command::new(env!("CARGO_BIN_EXE_ucm"))
        .args(ctr.args.clone().unwrap())
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(&envs)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "export server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (child, port)
}

fn curl(root: &Path, url: &str, port: u16, token: &str, out: &Path, extra: &[&str]) -> Command {
    let host = url
        .trim_start_matches("https://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let mut c = Command::new("curl");
    c.args(["-sS", "--fail", "--cacert"])
        .arg(root.join("ca.crt"))
        .args(["--connect-to", &format!("{host}:443:127.0.0.1:{port}")])
        .args(["-H", &format!("x-kubevirt-export-token: {token}")])
        .args(extra)
        .arg("-o")
        .arg(out)
        .arg(url);
    c
}

/// An export Pod deleted mid-download: the download breaks, the manager creates a new Pod with
/// the same URLs, token and CA, and the client resumes where it stopped (`curl -C -`) to a
/// file identical to the volume.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn export_pod_deleted_mid_download_resumes() {
    let env = TestEnv::new("faults-pod").await;
    let w = World::new(
        env.client.clone(),
        &env.kubeconfig,
        &env.ns,
        crate::rig::FAST,
    );
    let m = Manager::start(ManagerOpts::new(&env.kubeconfig, &env.ns).only("vmexport"));
    m.wait_ready().await;
    w.create_pvc("disk").await;
    w.create_export("x", "disk", None).await;
    let ready = w.drive_export_ready("x", TIMEOUT).await;
    let links = ready.status.clone().unwrap().links;
    let raw = links.clone().unwrap().internal.unwrap().volumes.unwrap()[0]
        .formats
        .clone()
        .unwrap()
        .into_iter()
        .find(|f| f.format == "raw")
        .unwrap()
        .url;
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let token_secret = secrets.get("export-token-x").await.unwrap();
    let token = String::from_utf8(token_secret.data.clone().unwrap()["token"].0.clone()).unwrap();
    let cert = secrets.get("export-cert-x").await.unwrap();
    let pod_a = w.pods().get("virt-export-x").await.unwrap();

    // The volume both Pods mount: 24 MiB of non-repeating data.
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let vol_dir = root.join("export-volumes/v0-disk");
    std::fs::create_dir_all(&vol_dir).unwrap();
    let image: Vec<u8> = (0..24 * MIB as usize)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(vol_dir.join("disk.img"), &image).unwrap();

    let (mut server_a, port_a) = run_export_server(&pod_a, &cert, &token, root);
    let out = root.join("download.img");
    let download = curl(root, &raw, port_a, &token, &out, &["--limit-rate", "4M"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    eventually(TIMEOUT, "the download to be under way", || async {
        std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0) >= 4 * MIB
    })
    .await;
    // The fault: the Pod is deleted; its container dies with it.
    w.pods()
        .delete("virt-export-x", &DeleteParams::default())
        .await
        .unwrap();
    signal(server_a.id(), "KILL");
    let _ = server_a.wait();
    let broken = download.wait_with_output().unwrap();
    assert!(!broken.status.success(), "the download survived its server");
    let partial = std::fs::metadata(&out).unwrap().len();
    assert!(partial < image.len() as u64, "nothing left to resume");

    // The manager replaces the Pod; the export is Ready again with the same links.
    eventually(TIMEOUT, "a new export Pod", || async {
        w.pods()
            .get_opt("virt-export-x")
            .await
            .ok()
            .flatten()
            .is_some_and(|p| p.uid() != pod_a.uid())
    })
    .await;
    let again = w.drive_export_ready("x", TIMEOUT).await;
    assert_eq!(again.status.unwrap().links, links, "the URLs changed");
    let token_b = secrets.get("export-token-x").await.unwrap();
    assert_eq!(
        token_b.uid(),
        token_secret.uid(),
        "the token Secret was replaced"
    );
    let pod_b = w.pods().get("virt-export-x").await.unwrap();
    let cert_b = secrets.get("export-cert-x").await.unwrap();
    let (mut server_b, port_b) = run_export_server(&pod_b, &cert_b, &token, root);
    let resumed = curl(root, &raw, port_b, &token, &out, &["-C", "-"])
        .output()
        .unwrap();
    let _ = server_b.kill();
    let _ = server_b.wait();
    assert!(
        resumed.status.success(),
        "resume failed: {}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let got = std::fs::read(&out).unwrap();
    assert!(
        got == image,
        "the resumed file differs ({} bytes)",
        got.len()
    );
    eprintln!("resumed at byte {partial} of {}", image.len());
    w.assert_export_children_unique("x").await;
}

/// Watch disruption: a proxy between the manager and the API server drops connections at
/// random (cuts, bursts of refusals) while work of every feature goes on; afterwards everything
/// converges, with the same manager process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn watch_disruption_then_everything_converges() {
    let _serial = sole_snapshot_coordinator().await;
    let env = TestEnv::new("faults-proxy").await;
    let mut w = World::new(
        env.client.clone(),
        &env.kubeconfig,
        &env.ns,
        crate::rig::FAST,
    );
    for n in ["a", "b", "c"] {
        w.start_agent(n);
    }
    let proxy = Proxy::start(server_port(&env.kubeconfig)).await;
    let via = shipped_identity_via(&w, &["exporter", "snapshot", "vmexport"], proxy.port);
    let lease = unique("ucm-faults");
    let m = Manager::start(
        w.manager_opts(&via, free_port(), Some(&lease))
            .kubeconfig_as_is(),
    );
    m.wait_ready().await;
    w.wait_agents_alive(&["a", "b", "c"]).await;
    let work = w.start_work(Duration::from_secs(15)).await;
    let pid = m.pid();

    // Chaos, while more work arrives: a second snapshot, an exporter with a lease, an export,
    // and updates to objects already there.
    let chaos = proxy.chaos(Duration::from_secs(20));
    let more = async {
        let vol2 = unique("pvc");
        let data2 = w.volume(&vol2, &["a", "b", "c"], 4 * MIB).await;
        let snap2 = unique("snap");
        w.create_snapshot(&snap2, &vol2).await;
        w.create_exporter("e2", json!({"second": work.pool})).await;
        w.report_available("e2").await;
        w.create_lease("l3", json!({"second": work.pool}), "1h")
            .await;
        w.create_pvc("d4").await;
        w.create_export("x4", "d4", None).await;
        w.exporters()
            .patch(
                "e1",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
            )
            .await
            .unwrap();
        (vol2, snap2, data2)
    };
    let (report, (vol2, snap2, data2)) = tokio::join!(chaos, more);
    eprintln!(
        "chaos: {} connections cut, {} refused, {} accepted",
        report.cuts, report.refused, report.accepted
    );
    assert!(report.cuts > 0, "the proxy cut nothing");

    w.finish_work(&work, SETTLE).await;
    w.assert_snapshot_published(&snap2, &["a", "b", "c"], &data2, SETTLE)
        .await;
    w.wait_lease("l3", "l3 to hold e2", SETTLE, |l| {
        l.status.as_ref().and_then(|s| s.exporter_ref_name()) == Some("e2")
    })
    .await;
    w.drive_export_ready("x4", SETTLE).await;
    assert!(alive(pid) && m.pid() == pid, "the manager restarted");
    m.wait_ready().await;
    eventually(TIMEOUT, "leadership after the chaos", || is_leader(&m)).await;
    w.cleanup_snapshots(&[&work.snap, &snap2], &[&work.vol, &vol2])
        .await;
}

/// The API server is unreachable when the manager starts (a control plane restarting during a
/// rollout): the manager keeps running and waiting, and every feature starts once the API
/// answers, with the default (generated) exporter signing key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn manager_started_while_the_api_is_unreachable_starts_once_it_answers() {
    let env = TestEnv::new("faults-unreachable").await;
    let w = World::new(
        env.client.clone(),
        &env.kubeconfig,
        &env.ns,
        crate::rig::FAST,
    );
    let proxy = Proxy::start(server_port(&env.kubeconfig)).await;
    let via = shipped_identity_via(&w, &["exporter", "vmexport"], proxy.port);
    proxy.refuse(true);
    let mut m = Manager::start(
        ManagerOpts::new(&via, &env.ns)
            .kubeconfig_as_is()
            .lease(&unique("ucm-faults"))
            .args(["--enable-snapshot=false"]),
    );
    let pid = m.pid();
    // Long enough for every start-up path to have failed at least once.
    tokio::time::sleep(Duration::from_secs(6)).await;
    if !alive(pid) {
        let status = m.wait_exit(Duration::from_secs(1));
        panic!(
            "the manager exited ({status}) while the API server was unreachable:\n{}",
            m.logs()
        );
    }
    proxy.refuse(false);
    m.wait_ready().await;
    w.create_exporter("e1", json!({"board": "rpi"})).await;
    w.wait_exporter_token("e1").await;
    w.create_pvc("d1").await;
    w.create_export("x1", "d1", None).await;
    w.drive_export_ready("x1", TIMEOUT).await;
    assert!(alive(pid) && m.pid() == pid);
}

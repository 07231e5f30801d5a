//! The shared manager runtime as a real process: leader election with a warm standby, hand-over
//! on SIGTERM, readiness, metrics, missing CRDs, and flag errors.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use crate::common::*;
use k8s_openapi::{
    api::coordination::v1::Lease,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{Api, ResourceExt};

fn feature() -> &'static ucm::runtime::Feature {
    ucm::FEATURES
        .first()
        .expect("at least one feature is registered")
}

async fn holder(leases: &Api<Lease>, id: &str) -> Option<String> {
    leases
        .get_opt(id)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec?.holder_identity)
        .filter(|h| !h.is_empty())
}

fn is_leader(metrics: &str, id: &str) -> bool {
    metrics.contains(&format!("leader_election_master_status{{name=\"{id}\"}} 1"))
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn two_replicas_elect_one_leader_and_hand_over_on_sigterm() {
    // The first registered feature is snapshot (see common::snapshot_coordinator).
    let _coordinator = snapshot_coordinator().await;
    let env = TestEnv::new("leader").await;
    let id = unique("ucm-leader");
    let a = Manager::start(
        ManagerOpts::new(&env.kubeconfig, &env.ns)
            .lease(&id)
            .only(feature().name),
    );
    let b = Manager::start(
        ManagerOpts::new(&env.kubeconfig, &env.ns)
            .lease(&id)
            .only(feature().name),
    );
    // Readiness never depends on leadership: both replicas are ready.
    a.wait_ready().await;
    b.wait_ready().await;

    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    eventually(TIMEOUT, "one replica to hold the Lease", || async {
        holder(&leases, &id).await.is_some()
    })
    .await;
    eventually(
        TIMEOUT,
        "exactly one replica to report leadership",
        || async { is_leader(&a.metrics().await, &id) != is_leader(&b.metrics().await, &id) },
    )
    .await;
    let a_leads = is_leader(&a.metrics().await, &id);
    let first = holder(&leases, &id).await.unwrap();
    let (mut leader, standby) = if a_leads { (a, b) } else { (b, a) };
    assert!(
        leader.logs().contains(&first),
        "the Lease holder {first} is the leader's identity"
    );

    let t0 = Instant::now();
    leader.signal("TERM");
    eventually(
        Duration::from_secs(15),
        "the standby to take the Lease",
        || async { holder(&leases, &id).await.is_some_and(|h| h != first) },
    )
    .await;
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "hand-over took {took:?}, should be well inside one lease duration (15s)"
    );
    let status = leader.wait_exit(Duration::from_secs(40));
    assert_eq!(
        status.code(),
        Some(0),
        "graceful shutdown exits 0; logs:\n{}",
        leader.logs()
    );
    let second = holder(&leases, &id).await.unwrap();
    assert!(standby.logs().contains(&second));
    eventually(TIMEOUT, "the new leader's gauge", || async {
        is_leader(&standby.metrics().await, &id)
    })
    .await;
    let lease = leases.get(&id).await.unwrap();
    assert!(lease.spec.unwrap().lease_transitions.unwrap_or(0) >= 1);
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn metrics_and_probes_are_served() {
    // The first registered feature is snapshot (see common::snapshot_coordinator).
    let _coordinator = snapshot_coordinator().await;
    let env = TestEnv::new("metrics").await;
    let m = Manager::start(ManagerOpts::new(&env.kubeconfig, &env.ns).only(feature().name));
    m.wait_ready().await;
    let (code, body) = m.get(m.health_port, "/healthz").await.unwrap();
    assert_eq!((code, body.as_str()), (200, "ok"));
    let (code, body) = m.readyz().await.unwrap();
    assert_eq!(code, 200);
    for check in [
        "[+]ping ok",
        "[+]shutdown ok",
        "[+]informers-synced ok",
        &format!("[+]feature-{} ok", feature().name),
    ] {
        assert!(body.contains(check), "missing {check} in {body}");
    }
    let text = m.metrics().await;
    for family in [
        "controller_runtime_reconcile_total",
        "controller_runtime_reconcile_errors_total",
        "controller_runtime_reconcile_time_seconds_bucket",
        "controller_runtime_active_workers",
        "controller_runtime_max_concurrent_reconciles",
        "leader_election_master_status{name=\"ucm-controller-manager\"} 1",
        "ucm_build_info",
        "process_resident_memory_bytes",
        "process_open_fds",
    ] {
        assert!(text.contains(family), "missing {family} in /metrics");
    }
    // The binary names the commit it was built from (build.rs): on a clean checkout exactly
    // `git rev-parse --short HEAD`; with local changes, that and `-dirty`.
    let git = |args: &[&str]| {
        let out = Command::new("git")
            .args(args)
            .current_dir(repo_root())
            .output()
            .expect("git");
        assert!(out.status.success(), "git {args:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let head = git(&["rev-parse", "--short", "HEAD"]);
    let clean = git(&["status", "--porcelain", "--untracked-files=no"]).is_empty();
    let info = text
        .lines()
        .find(|l| l.starts_with("ucm_build_info{"))
        .expect("ucm_build_info");
    let exact = format!("revision=\"{head}\"");
    let dirty = format!("revision=\"{head}-dirty\"");
    assert!(
        info.contains(&exact) || (!clean && info.contains(&dirty)),
        "{info}: the build's revision is not HEAD {head}"
    );
    // No per-object label values: only the fixed label names appear.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            !line.contains(&env.ns),
            "namespace leaked into a metric label: {line}"
        );
    }
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn missing_crd_fails_readiness_naming_it_and_the_feature_starts_once_applied() {
    // A control plane of its own: the shared one has every CRD installed.
    let own = tokio::task::spawn_blocking(Harness::start_own)
        .await
        .unwrap();
    let client = client_for(&own.kubeconfig).await;
    let ns = create_namespace(&client, "nocrd").await;
    let f = feature();
    let crd = f
        .installed_crds()
        .into_iter()
        .next()
        .expect("the feature owns a CRD");
    let m = Manager::start(ManagerOpts::new(&own.kubeconfig, &ns).only(f.name));

    eventually(TIMEOUT, "/readyz to answer 503 naming the CRD", || async {
        matches!(m.readyz().await, Some((503, body)) if body.contains(&format!("[-]feature-{}", f.name)) && body.contains(&crd.name_any()))
    })
    .await;
    let (code, _) = m
        .get(m.health_port, &format!("/readyz/feature-{}", f.name))
        .await
        .unwrap();
    assert_eq!(code, 503);
    assert_eq!(
        m.get(m.health_port, "/healthz").await.unwrap().0,
        200,
        "liveness is unaffected"
    );
    // The log line and the readiness check are written apart: the line may land just after.
    eventually(
        TIMEOUT,
        "one clear error naming the CRD is logged",
        || async { m.logs().contains(&crd.name_any()) },
    )
    .await;

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in f.installed_crds() {
        apply_crd(&crds, &crd).await;
    }
    m.wait_ready().await;
    let (code, _) = m
        .get(m.health_port, &format!("/readyz/feature-{}", f.name))
        .await
        .unwrap();
    assert_eq!(code, 200);
}

#[test]
fn bad_flag_values_fail_at_start_with_one_line_naming_the_flag() {
    for (arg, flag) in [
        (
            "--leader-elect-lease-duration=abc",
            "--leader-elect-lease-duration",
        ),
        ("--metrics-bind-address=nowhere", "--metrics-bind-address"),
        ("--leader-elect=maybe", "--leader-elect"),
        (
            "--max-concurrent-reconciles=0",
            "--max-concurrent-reconciles",
        ),
        (
            "--leader-elect-renew-deadline=20s",
            "--leader-elect-renew-deadline",
        ),
        ("--log-format=xml", "--log-format"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ucm"))
            .args(["manager", arg])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{arg}: {err}");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{arg}: one line expected, got {err}"
        );
        assert!(
            err.contains(flag),
            "{arg}: the error must name {flag}: {err}"
        );
    }
}

#[test]
fn bare_ucm_prints_help_and_exits_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_ucm")).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Usage: ucm <COMMAND>") && text.contains("manager") && text.contains("crds")
    );
}

#[test]
fn every_feature_has_an_enable_flag_with_env() {
    let out = Command::new(env!("CARGO_BIN_EXE_ucm"))
        .args(["manager", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for f in ucm::FEATURES {
        assert!(help.contains(&format!("--enable-{}", f.name)), "{help}");
        assert!(
            help.contains(&format!("UCM_ENABLE_{}", f.name.to_uppercase())),
            "{help}"
        );
    }
    // Disabling every feature is refused at start.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ucm"));
    cmd.arg("manager");
    for f in ucm::FEATURES {
        cmd.env(format!("UCM_ENABLE_{}", f.name.to_uppercase()), "false");
    }
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no feature enabled"));
}

/// Idle cost at the shipped defaults (README, "Benchmarks"): a leader-elected manager with every
/// feature on and a warm standby, no objects, 20 s on a control plane of the test's own whose API
/// server audits every ServiceAccount request. The leader renews once per retry period (2 s), the
/// standby writes nothing, and neither burns CPU. With the elector of 369af94 the leader woke on
/// its own renewal and renewed again at once: thousands of Lease writes in the window.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn idle_leader_renews_once_per_retry_period_and_the_standby_writes_nothing() {
    let (own, audit) = Harness::start_audited();
    let client = client_for(&own.kubeconfig).await;
    install_crds(&client).await;
    let ns = create_namespace(&client, "idle").await;
    let id = unique("ucm-idle");
    let opts = |sa: &str| {
        ManagerOpts::new(&own.kubeconfig, &ns)
            .lease(&id)
            .service_account(sa)
            .args(["--leader-elect-retry-period=2s"])
    };
    let leader = Manager::start(opts("ucm-idle-leader"));
    leader.wait_ready().await;
    eventually(TIMEOUT, "the first manager to lead", || async {
        is_leader(&leader.metrics().await, &id)
    })
    .await;
    let standby = Manager::start(opts("ucm-idle-standby"));
    standby.wait_ready().await;
    // Start-up work (CRD discovery, initial lists, the leader's first passes) is not idle.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let changes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let watch = {
        use futures::StreamExt;
        let changes = changes.clone();
        let stream = kube::runtime::watcher(
            leases.clone(),
            kube::runtime::watcher::Config::default().fields(&format!("metadata.name={id}")),
        );
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(ev) = stream.next().await {
                if let Ok(kube::runtime::watcher::Event::Apply(_)) = ev {
                    changes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let offset = audit.offset();
    let cpu0 = (cpu_time(leader.pid()), cpu_time(standby.pid()));
    let window = Duration::from_secs(20);
    tokio::time::sleep(window).await;
    let cpu = (
        cpu_time(leader.pid()) - cpu0.0,
        cpu_time(standby.pid()) - cpu0.1,
    );
    watch.abort();
    let changes = changes.load(std::sync::atomic::Ordering::SeqCst);
    let requests = audit.since(offset);
    let by = |sa: &str| {
        let user = format!("system:serviceaccount:{ns}:{sa}");
        requests
            .iter()
            .filter(|r| r.user == user)
            .cloned()
            .collect::<Vec<_>>()
    };
    let (l, s) = (by("ucm-idle-leader"), by("ucm-idle-standby"));
    let summary = |rs: &[AuditedRequest]| {
        let mut m = std::collections::BTreeMap::<String, usize>::new();
        for r in rs {
            *m.entry(format!("{} {} {}", r.verb, r.resource, r.code))
                .or_default() += 1;
        }
        m
    };
    eprintln!(
        "idle {window:?}: Lease changes {changes}; leader {:?} (cpu {cpu_l:?}); standby {:?} (cpu {cpu_s:?})",
        summary(&l),
        summary(&s),
        cpu_l = cpu.0,
        cpu_s = cpu.1,
    );
    assert!(
        (1..=12).contains(&changes),
        "the Lease changed {changes} times in {window:?}: the holder renews once per retry \
         period (2 s), so at most 12 (and at least once: it must still renew)"
    );
    let leader_writes: Vec<_> = l.iter().filter(|r| r.is_write()).collect();
    assert!(
        leader_writes.len() <= 12
            && leader_writes
                .iter()
                .all(|r| r.resource == "leases" && r.name == id),
        "the idle leader wrote {:?}; only its Lease renewals, at most one per retry period",
        summary(&l)
    );
    let lease_requests = l.iter().filter(|r| r.resource == "leases").count();
    assert!(
        lease_requests <= 13,
        "the idle leader sent {lease_requests} Lease requests in {window:?}: {:?}",
        summary(&l)
    );
    assert!(
        s.iter().all(|r| !r.is_write()),
        "the standby wrote while idle: {:?}",
        summary(&s)
    );
    let budget = window / 50; // 2 % of one core
    assert!(
        cpu.0 < budget && cpu.1 < budget,
        "idle CPU over {window:?}: leader {:?}, standby {:?} (budget {budget:?}, 2 % of a core)",
        cpu.0,
        cpu.1
    );
}

/// A restarted manager learns its credential tokens from one list of Secrets (pages of 100),
/// not from one GET per Exporter: the Secret cache holds metadata only, and a restart of the
/// bench's 5,000 Exporters sent 4,725 GETs before this.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn a_restarted_manager_reads_credential_tokens_with_one_list_not_a_get_each() {
    use ucm::exporter::crd::Exporter;
    let (own, audit) = Harness::start_audited();
    let client = client_for(&own.kubeconfig).await;
    install_crds(&client).await;
    let ns = create_namespace(&client, "tokens").await;
    let opts = || {
        ManagerOpts {
            env: vec![("CONTROLLER_KEY".into(), "e2e-restart-key".into())],
            ..ManagerOpts::new(&own.kubeconfig, &ns)
        }
        .only("exporter")
        .service_account("ucm-tokens")
    };
    let m = Manager::start(opts());
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(client.clone(), &ns);
    const N: usize = 20;
    for i in 0..N {
        let e: Exporter = serde_json::from_value(serde_json::json!({
            "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
            "metadata": {"name": format!("e{i}")}, "spec": {}
        }))
        .unwrap();
        exporters
            .create(&kube::api::PostParams::default(), &e)
            .await
            .unwrap();
    }
    let credentialed = || async {
        exporters.list(&Default::default()).await.is_ok_and(|l| {
            l.items.len() == N
                && l.items.iter().all(|e| {
                    e.status
                        .as_ref()
                        .is_some_and(|s| s.token_expires_at.is_some())
                })
        })
    };
    eventually(TIMEOUT, "every Exporter's credential", credentialed).await;
    let versions = |l: kube::core::ObjectList<Exporter>| {
        l.items
            .into_iter()
            .map(|e| (e.name_any(), e.resource_version()))
            .collect::<Vec<_>>()
    };
    let before = versions(exporters.list(&Default::default()).await.unwrap());
    drop(m);

    let offset = audit.offset();
    let m2 = Manager::start(opts());
    m2.wait_ready().await;
    // Each Exporter's first pass after the restart runs in these seconds.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let user = format!("system:serviceaccount:{ns}:ucm-tokens");
    let secrets: Vec<_> = audit
        .since(offset)
        .into_iter()
        .filter(|r| r.user == user && r.resource == "secrets")
        .collect();
    // (Its own TLS and router-key Secrets are read once at start, as before.)
    let gets: Vec<_> = secrets
        .iter()
        .filter(|r| r.verb == "get" && r.name.ends_with("-exporter"))
        .collect();
    assert!(
        gets.is_empty(),
        "the restarted manager read {} credential Secrets one by one: {gets:?}",
        gets.len()
    );
    assert!(
        secrets.iter().all(|r| !r.is_write()),
        "the restarted manager wrote a Secret: {secrets:?}"
    );
    let after = versions(exporters.list(&Default::default()).await.unwrap());
    assert_eq!(after, before, "a restart pass wrote an Exporter");
    assert_eq!(
        metric(&m2.metrics().await, "ucm_exporter_status_writes_total", &[]),
        0.0
    );
}

/// A manager started with more objects than one list page (1,100 Exporters: three of kube's
/// pages of 500, each answer rewritten by the client's trim layer, src/runtime/trim.rs) asks
/// for each page exactly once, and every Exporter of every page reaches its cache: each gets
/// its credential, which only a pass on a cached Exporter writes. Every other e2e test lists
/// fewer objects than a page.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn a_manager_started_with_more_than_a_page_of_objects_lists_each_page_once_and_caches_all() {
    use futures::{StreamExt, TryStreamExt};
    use ucm::exporter::crd::Exporter;
    let (own, audit) = Harness::start_audited();
    let client = client_for(&own.kubeconfig).await;
    install_crds(&client).await;
    let ns = create_namespace(&client, "pages").await;
    let exporters: Api<Exporter> = Api::namespaced(client.clone(), &ns);
    const N: usize = 1_100;
    futures::stream::iter(0..N)
        .map(|i| {
            let exporters = exporters.clone();
            async move {
                let e: Exporter = serde_json::from_value(serde_json::json!({
                    "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
                    "metadata": {"name": format!("e{i:04}")}, "spec": {}
                }))
                .unwrap();
                exporters.create(&Default::default(), &e).await.map(|_| ())
            }
        })
        .buffer_unordered(8)
        .try_collect::<()>()
        .await
        .unwrap();

    let offset = audit.offset();
    let m = Manager::start(
        ManagerOpts {
            env: vec![("CONTROLLER_KEY".into(), "e2e-pages-key".into())],
            ..ManagerOpts::new(&own.kubeconfig, &ns)
        }
        .only("exporter")
        .service_account("ucm-pages"),
    );
    m.wait_ready().await;
    let credentialed = || async {
        exporters.list(&Default::default()).await.is_ok_and(|l| {
            l.items.len() == N
                && l.items
                    .iter()
                    .all(|e| e.status.as_ref().is_some_and(|s| s.credential.is_some()))
        })
    };
    eventually(
        // (about 20 s alone; the whole suite runs beside it in CI)
        Duration::from_secs(240),
        "a credential on each of the 1,100 Exporters",
        credentialed,
    )
    .await;

    let user = format!("system:serviceaccount:{ns}:ucm-pages");
    let lists: Vec<String> = audit
        .since(offset)
        .into_iter()
        .filter(|r| r.user == user && r.resource == "exporters" && r.verb == "list")
        .map(|r| r.uri)
        .collect();
    assert_eq!(
        lists.len(),
        3,
        "pages of 500, each asked for once: {lists:#?}"
    );
    assert!(!lists[0].contains("continue="), "{lists:#?}");
    let tokens: std::collections::BTreeSet<_> = lists[1..]
        .iter()
        .filter_map(|u| u.split("continue=").nth(1))
        .collect();
    assert_eq!(tokens.len(), 2, "two more pages, each its own: {lists:#?}");
}

/// Events as `kubectl describe` shows them: the same event again within six minutes is one
/// Event with a series count (a merge patch the API server must accept), another note is
/// another Event, and an Event that expired on the server is created anew.
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn a_repeated_event_is_one_event_with_a_series() {
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::events::v1::Event;
    use kube::runtime::events::EventType;
    use ucm::runtime::events::{Occurrence, Publisher};

    let client = client_for(&shared_kubeconfig()).await;
    let ns = create_namespace(&client, "events").await;
    let publisher = Publisher::new(client.clone(), "ucm-e2e".into(), "e2e-pod".into());
    let regarding = ObjectReference {
        api_version: Some("jumpstarter.dev/v1alpha1".into()),
        kind: Some("Exporter".into()),
        namespace: Some(ns.clone()),
        name: Some("e1".into()),
        uid: Some("0000-e1".into()),
        ..Default::default()
    };
    let occurrence = |note| Occurrence {
        type_: EventType::Warning,
        reason: "SecretConflict",
        action: "Reconcile",
        note,
    };
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    // (note, series count or 1) of each Event, oldest first.
    let seen = || async {
        let mut items = events.list(&Default::default()).await.unwrap().items;
        items.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
        items
            .into_iter()
            .map(|e| {
                assert_eq!(e.reporting_controller.as_deref(), Some("ucm-e2e"));
                assert_eq!(e.reporting_instance.as_deref(), Some("e2e-pod"));
                assert_eq!(e.regarding.as_ref(), Some(&regarding));
                (e.note.unwrap_or_default(), e.series.map_or(1, |s| s.count))
            })
            .collect::<Vec<_>>()
    };

    for _ in 0..3 {
        publisher
            .publish(&occurrence("taken"), &regarding)
            .await
            .unwrap();
    }
    publisher
        .publish(&occurrence("taken by another"), &regarding)
        .await
        .unwrap();
    assert_eq!(
        seen().await,
        [
            ("taken".to_string(), 3),
            ("taken by another".to_string(), 1)
        ]
    );

    // The API server dropped the first Event (its TTL): the next repeat creates one.
    events
        .delete_collection(&Default::default(), &Default::default())
        .await
        .unwrap();
    eventually(TIMEOUT, "the events deleted", || async {
        seen().await.is_empty()
    })
    .await;
    publisher
        .publish(&occurrence("taken"), &regarding)
        .await
        .unwrap();
    assert_eq!(seen().await, [("taken".to_string(), 1)]);
}

//! Taking over a lab the upstream controller built (docs/exporter.md, "Taking over from
//! upstream"; docs/operations.md, "Migrating from the upstream controller").
//!
//! The state is built as the upstream Go controller leaves it: credential Secrets holding tokens
//! that `e2e/tools/upstream-keys` mints with upstream's key derivation (the Go standard library
//! and `filippo.io/keygen`, independent of ucm), controller owner references, Exporter and
//! Client status, an active Lease and a pending one. Then ucm starts with the same
//! `CONTROLLER_KEY` and the real `jmp` 0.9.0 exporters and client, configured with upstream's
//! tokens, must work.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use ucm::exporter::crd::{Client, Exporter, Lease};

use super::*;

/// The Go reference program (`make e2e` builds it).
fn upstream_keys() -> PathBuf {
    let bin = repo_root().join("e2e/bin/upstream-keys");
    assert!(
        bin.exists(),
        "{} is missing: build it with `make e2e/bin/upstream-keys` (make e2e does)",
        bin.display()
    );
    bin
}

/// A token for `sub` as upstream mints it from `seed`.
fn upstream_token(seed: &str, sub: &str, iat: i64, exp: i64) -> String {
    let out = Command::new(upstream_keys())
        .args(["mint", seed, sub, &iat.to_string(), &exp.to_string()])
        .output()
        .expect("run upstream-keys");
    assert!(
        out.status.success(),
        "upstream-keys mint: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn rfc3339(secs: i64) -> String {
    jiff::Timestamp::from_second(secs).unwrap().to_string()
}

fn cond(t: &str, status: &str, reason: &str, at: i64) -> serde_json::Value {
    serde_json::json!({"type": t, "status": status, "reason": reason, "message": "",
                       "lastTransitionTime": rfc3339(at)})
}

/// The controller owner reference upstream's `SetControllerReference` writes.
fn owner(kind: &str, name: &str, uid: &str) -> serde_json::Value {
    serde_json::json!([{"apiVersion": "jumpstarter.dev/v1alpha1", "kind": kind, "name": name,
                        "uid": uid, "controller": true, "blockOwnerDeletion": true}])
}

async fn merge_status<K>(api: &Api<K>, name: &str, status: serde_json::Value)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": status })),
    )
    .await
    .unwrap_or_else(|e| panic!("status of {name}: {e}"));
}

/// What a credential Secret holds and its version: both must survive the switch.
async fn secret_state(secrets: &Api<Secret>, name: &str) -> (String, String) {
    let s = secrets.get(name).await.unwrap();
    let token = s.data.as_ref().unwrap()["token"].0.clone();
    (
        s.resource_version().unwrap(),
        String::from_utf8(token).unwrap(),
    )
}

/// A lab the upstream controller built, switched to ucm: every token upstream minted
/// authenticates the real `jmp` 0.9.0 exporters and client; no credential Secret is rewritten;
/// the Lease active at the switch keeps its exporter, serves `j power read` and ends on time; the
/// pending Lease is scheduled; Exporters come back Online as their exporters reconnect.
#[tokio::test]
#[ignore = "e2e: needs the local control plane, the pinned jumpstarter packages and upstream-keys"]
async fn a_lab_built_by_upstream_switches_to_ucm() {
    let venv = tokio::task::spawn_blocking(jumpstarter_venv).await.unwrap();
    let env = TestEnv::new("takeover").await;
    let ns = env.ns.clone();
    let seed = format!("the lab's CONTROLLER_KEY {}", unique("seed"));
    let router_key = unique("router-key");
    let dir = tempfile::Builder::new()
        .prefix("ucm-takeover-")
        .tempdir()
        .unwrap();
    let (grpc_port, router_port) = (free_port(), free_port());
    let endpoint = format!("localhost:{grpc_port}");
    let now = jiff::Timestamp::now().as_second();
    // Minted a month ago for upstream's fixed 365 days: not due for renewal by ucm's policy.
    let (iat, exp) = (now - 30 * 86_400, now - 30 * 86_400 + 365 * 86_400);

    // --- the state upstream leaves ---
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &ns);
    let clients: Api<Client> = Api::namespaced(env.client.clone(), &ns);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &ns);
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &ns);
    let mut tokens = std::collections::BTreeMap::new();
    for (board, status) in [("board-a", "LeaseReady"), ("board-b", "Available")] {
        let e: Exporter = serde_json::from_value(serde_json::json!({
            "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
            "metadata": {"name": board, "labels": {"board": board}}, "spec": {},
        }))
        .unwrap();
        let e = exporters.create(&PostParams::default(), &e).await.unwrap();
        let uid = e.uid().unwrap();
        let token = upstream_token(&seed, &format!("exporter:{ns}:{board}:{uid}"), iat, exp);
        let secret: Secret = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("{board}-exporter"),
                         "ownerReferences": owner("Exporter", board, &uid)},
            "type": "Opaque", "stringData": {"token": token},
        }))
        .unwrap();
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
        let mut st = serde_json::json!({
            "credential": {"name": format!("{board}-exporter")},
            "endpoint": endpoint,
            "conditions": [cond("Registered", "True", "Register", now - 3600),
                           cond("Online", "True", "Connect", now - 3600)],
            "exporterStatus": status,
            "lastSeen": rfc3339(now - 5),
            "devices": [{"uuid": "00000000-0000-0000-0000-000000000001",
                         "labels": {"jumpstarter.dev/client": "jumpstarter_driver_power.client.PowerClient",
                                    "jumpstarter.dev/name": "power"}}],
        });
        if board == "board-a" {
            st["leaseRef"] = serde_json::json!({"name": "held"});
        }
        merge_status(&exporters, board, st).await;
        tokens.insert(board, token);
    }
    let c: Client = serde_json::from_value(serde_json::json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Client",
        "metadata": {"name": "dev"}, "spec": {},
    }))
    .unwrap();
    let c = clients.create(&PostParams::default(), &c).await.unwrap();
    let client_uid = c.uid().unwrap();
    let client_token = upstream_token(&seed, &format!("client:{ns}:dev:{client_uid}"), iat, exp);
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "dev-client", "ownerReferences": owner("Client", "dev", &client_uid)},
        "type": "Opaque", "stringData": {"token": client_token},
    }))
    .unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    merge_status(
        &clients,
        "dev",
        serde_json::json!({"credential": {"name": "dev-client"}, "endpoint": endpoint}),
    )
    .await;

    // The active Lease: acquired 20 s ago for 75 s, owned by its exporter, as upstream writes it.
    let board_a_uid = exporters.get("board-a").await.unwrap().uid().unwrap();
    let held: Lease = serde_json::from_value(serde_json::json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": "held", "ownerReferences": owner("Exporter", "board-a", &board_a_uid)},
        "spec": {"clientRef": {"name": "dev"}, "selector": {"matchLabels": {"board": "board-a"}},
                 "duration": "1m15s"},
    }))
    .unwrap();
    leases.create(&PostParams::default(), &held).await.unwrap();
    let begin = now - 20;
    merge_status(
        &leases,
        "held",
        serde_json::json!({"exporterRef": {"name": "board-a"}, "beginTime": rfc3339(begin),
                           "ended": false, "priority": 0, "spotAccess": false,
                           "conditions": [cond("Ready", "True", "Ready", begin)]}),
    )
    .await;
    // The pending Lease: waiting for board-b, which was busy.
    let waiting: Lease = serde_json::from_value(serde_json::json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
        "metadata": {"name": "waiting"},
        "spec": {"clientRef": {"name": "dev"}, "selector": {"matchLabels": {"board": "board-b"}},
                 "duration": "10m"},
    }))
    .unwrap();
    leases
        .create(&PostParams::default(), &waiting)
        .await
        .unwrap();
    merge_status(
        &leases,
        "waiting",
        serde_json::json!({"ended": false,
                           "conditions": [cond("Pending", "True", "NotAvailable", now - 60)]}),
    )
    .await;
    let mut before = std::collections::BTreeMap::new();
    for s in ["board-a-exporter", "board-b-exporter", "dev-client"] {
        before.insert(s, secret_state(&secrets, s).await);
    }

    // --- ucm starts with the same CONTROLLER_KEY and ROUTER_KEY ---
    let mut opts = ManagerOpts::new(&env.kubeconfig, &ns)
        .only("exporter")
        .args([
            format!("--exporter-grpc-bind-address=127.0.0.1:{grpc_port}"),
            format!("--exporter-grpc-endpoint={endpoint}"),
            format!("--exporter-router-endpoint=localhost:{router_port}"),
            "--exporter-offline-threshold=20s".into(),
        ]);
    opts.env = vec![
        ("CONTROLLER_KEY".into(), seed.clone()),
        ("ROUTER_KEY".into(), router_key.clone()),
    ];
    let started = Instant::now();
    let mgr = Manager::start(opts);
    let cert = secret_data(&secrets, "ucm-exporter-grpc-tls", "tls.crt").await;
    let key = secret_data(&secrets, "ucm-exporter-grpc-tls", "tls.key").await;
    let _router = start_router(
        &env,
        dir.path(),
        router_port,
        &cert,
        &key,
        &[("ROUTER_KEY", &router_key)],
    );

    // Configs as the lab's hosts hold them: upstream's tokens, untouched.
    let write = |name: &str, doc: serde_json::Value| {
        let path = dir.path().join(name);
        std::fs::write(&path, serde_saphyr::to_string(&doc).unwrap()).unwrap();
        path
    };
    let client_cfg = write(
        "client.yaml",
        serde_json::json!({
            "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "ClientConfig",
            "metadata": {"namespace": ns, "name": "dev"},
            "endpoint": endpoint, "token": client_token,
            "tls": {"ca": base64::engine::general_purpose::STANDARD.encode(&cert), "insecure": false},
            "drivers": {"allow": [], "unsafe": true},
        }),
    );
    let jmp = |args: Vec<String>| {
        let mut cmd = py_cmd(&venv, dir.path(), "jmp");
        let at = args.iter().position(|a| a == "--").unwrap_or(args.len());
        let (opts, rest) = args.split_at(at);
        cmd.args(opts)
            .arg("--client-config")
            .arg(&client_cfg)
            .args(rest);
        async move {
            tokio::task::spawn_blocking(move || cmd.stdin(Stdio::null()).output().unwrap())
                .await
                .unwrap()
        }
    };
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();

    // The client's upstream token works before any exporter is back.
    let mut listed = None;
    for _ in 0..60 {
        let out = jmp(args(&["get", "exporters", "-o", "json"])).await;
        if out.status.success() {
            listed = Some(String::from_utf8_lossy(&out.stdout).into_owned());
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let listed = listed.expect("jmp get exporters with upstream's client token never succeeded");
    assert!(
        listed.contains("board-a") && listed.contains("board-b"),
        "{listed}"
    );
    eprintln!(
        "the client's upstream token accepted {:?} after the manager started",
        started.elapsed()
    );

    // The exporters reconnect with upstream's tokens and come back Online.
    let mut procs = Vec::new();
    for board in ["board-a", "board-b"] {
        let cfg = write(
            &format!("{board}.yaml"),
            serde_json::json!({
                "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "ExporterConfig",
                "metadata": {"namespace": ns, "name": board},
                "endpoint": endpoint, "token": tokens[board],
                "tls": {"ca": "", "insecure": true},
                "export": {"power": {"type": "jumpstarter_driver_power.driver.MockPower"}},
            }),
        );
        procs.push(jmp_run(&venv, dir.path(), &cfg, &format!("{board}.log")));
    }
    let reconnect = Instant::now();
    for board in ["board-a", "board-b"] {
        let start = Instant::now();
        loop {
            let e = exporters.get(board).await.unwrap();
            let seen = e
                .status
                .as_ref()
                .and_then(|s| s.last_seen.as_ref())
                .is_some_and(|t| t.0.as_second() > now);
            if seen && exporter_condition(&e, "Online").is_some_and(|c| c.0 == "True") {
                break;
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "{board} did not come back Online: {}",
                serde_json::to_string_pretty(&e.status).unwrap()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!(
            "{board} Online again {:?} after its exporter started",
            reconnect.elapsed()
        );
    }

    // The active Lease keeps its exporter and serves the client through the router.
    let out = jmp(args(&[
        "shell", "--lease", "held", "--", "j", "power", "read", "-n", "1",
    ]))
    .await;
    assert!(
        out.status.success(),
        "jmp shell on the Lease active at the switch failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The pending Lease gets the exporter that came back.
    eventually(
        TIMEOUT,
        "the pending Lease to be assigned board-b",
        || async {
            leases
                .get("waiting")
                .await
                .ok()
                .and_then(|l| l.status?.exporter_ref)
                .is_some_and(|r| r.name == "board-b")
        },
    )
    .await;

    // The active Lease ends on time (beginTime + 75 s), on its exporter.
    let due = begin + 75;
    let wait = Duration::from_secs(u64::try_from(due - now + 30).unwrap_or(30));
    let start = Instant::now();
    let ended = loop {
        let l = leases.get("held").await.unwrap();
        if l.status.as_ref().is_some_and(|s| s.ended) {
            break l;
        }
        assert!(
            start.elapsed() < wait,
            "the Lease active at the switch never ended"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let st = ended.status.unwrap();
    assert_eq!(st.exporter_ref.map(|r| r.name).as_deref(), Some("board-a"));
    assert_eq!(
        st.begin_time.map(|t| t.0.as_second()),
        Some(begin),
        "beginTime kept"
    );
    let end = st.end_time.expect("endTime").0.as_second();
    assert!(
        (due..=due + 3).contains(&end),
        "ended at {end}, due at {due} (beginTime {begin} + 75 s)"
    );

    // No credential Secret was rewritten: same version, same token as upstream left them.
    for (name, was) in &before {
        assert_eq!(
            &secret_state(&secrets, name).await,
            was,
            "credential Secret {name} was rewritten"
        );
    }
    let logs = mgr.logs();
    for t in tokens.values().chain([&client_token]) {
        let signature = t.rsplit('.').next().unwrap();
        assert!(
            !logs.contains(signature),
            "a token appears in the manager's log"
        );
    }
    drop(procs);
}

//! Every replica serves (docs/exporter.md, "Every replica serves", "Dial and Listen across
//! replicas"), with the real peers: two managers under one leader election, the jumpstarter 0.9.0
//! exporter connected to the standby, and `jmp` through either replica.

use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::ListParams;
use ucm::exporter::crd::ExporterStatusValue;
use ucm::exporter::grpc::dials::DIAL_LABEL;

use super::*;

/// The dials a manager delivered by `path` (its `ucm_exporter_dial_seconds` count).
fn delivered(metrics: &str, path: &str) -> f64 {
    metric(
        metrics,
        "ucm_exporter_dial_seconds_count",
        &[("path", path), ("result", "delivered")],
    )
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane and the pinned jumpstarter packages"]
async fn a_dial_through_one_replica_reaches_the_exporter_listening_on_the_other() {
    let id = unique("ucm-replicas");
    let lab = Lab::start_full(
        "jmp-replicas",
        "60s",
        None,
        &["--leader-elect", &format!("--leader-election-id={id}")],
    )
    .await;
    // The Lab's manager leads; a second one joins as the standby, serving gRPC on its own port
    // with the same stored certificate, router key and signing key.
    eventually(TIMEOUT, "the lab's manager to lead", || async {
        metric(
            &lab.mgr.metrics().await,
            "leader_election_master_status",
            &[],
        ) == 1.0
    })
    .await;
    let standby_port = free_port();
    let standby = Manager::start(
        ManagerOpts::new(&lab.env.kubeconfig, &lab.env.ns)
            .only("exporter")
            .lease(&id)
            .args([
                format!("--exporter-grpc-bind-address=127.0.0.1:{standby_port}"),
                format!("--exporter-grpc-endpoint=localhost:{}", lab.grpc_port),
                format!("--exporter-router-endpoint={}", lab.router_endpoint),
                format!("--exporter-login-bind-address=127.0.0.1:{}", free_port()),
                "--exporter-offline-threshold=60s".to_string(),
            ]),
    );
    eventually(TIMEOUT, "the standby to be ready, serving gRPC", || async {
        standby
            .readyz()
            .await
            .is_some_and(|(code, body)| code == 200 || body.contains("[+]exporter-grpc ok"))
    })
    .await;
    assert_eq!(
        metric(
            &standby.metrics().await,
            "leader_election_master_status",
            &[]
        ),
        0.0,
        "the second manager is a standby"
    );

    // The exporter talks to the standby only: Register, ReportStatus and the heartbeats are
    // written by a replica that does not lead.
    let exporter_cfg = lab.dir.path().join("exporter-standby.yaml");
    std::fs::copy(&lab.exporter_cfg, &exporter_cfg).unwrap();
    edit_yaml(&exporter_cfg, |v| {
        v["endpoint"] = format!("localhost:{standby_port}").into();
    });
    let _exporter = jmp_run(
        &lab.venv,
        lab.dir.path(),
        &exporter_cfg,
        "exporter-standby.log",
    );
    lab.wait_available("registered through the standby, online and available")
        .await;

    // A lease created through the leader; the leader assigns it.
    let lease = lab
        .create_lease_as(&lab.client_cfg, " (through the leader)")
        .await;
    lab.wait_exporter(TIMEOUT, "leased and ready", |e| {
        lease_ref(e).as_deref() == Some(lease.as_str())
            && exporter_status(e) == Some(ExporterStatusValue::LeaseReady)
    })
    .await;

    // Dial through the leader: the Listen is on the standby, so the token crosses replicas.
    let power_read = |cfg: std::path::PathBuf| {
        let lease = lease.clone();
        let lab = &lab;
        async move {
            let (ok, out, err) = lab
                .jmp_as(
                    &cfg,
                    &[
                        "shell", "--lease", &lease, "--", "j", "power", "read", "-n", "1",
                    ],
                )
                .await;
            assert!(
                ok && out.contains("voltage=5.0 V  current=2.0 A"),
                "jmp shell through {}:\nstdout:\n{out}\nstderr:\n{err}",
                cfg.display()
            );
        }
    };
    power_read(lab.client_cfg.clone()).await;
    let leader_metrics = lab.mgr.metrics().await;
    assert!(
        delivered(&leader_metrics, "remote") >= 1.0 && delivered(&leader_metrics, "local") == 0.0,
        "the leader delivered its Dial to the other replica:\n{}",
        leader_metrics
            .lines()
            .filter(|l| l.contains("ucm_exporter_dial_seconds_count"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // Dial through the standby, where the Listen is: delivered on the spot.
    let client_cfg = lab.dir.path().join("client-standby.yaml");
    std::fs::copy(&lab.client_cfg, &client_cfg).unwrap();
    edit_yaml(&client_cfg, |v| {
        v["endpoint"] = format!("localhost:{standby_port}").into();
    });
    power_read(client_cfg.clone()).await;
    assert!(
        delivered(&standby.metrics().await, "local") >= 1.0,
        "the standby delivered its Dial locally"
    );
    // Nothing is left behind: each pending dial was claimed (deleted).
    let pending: Api<ConfigMap> = Api::namespaced(lab.env.client.clone(), &lab.env.ns);
    let left = pending
        .list(&ListParams::default().labels(DIAL_LABEL))
        .await
        .unwrap();
    assert!(
        left.items.is_empty(),
        "pending dials left: {:?}",
        left.items
    );

    // Releasing through the standby (a write the call causes, on a replica that does not lead).
    let (ok, out, err) = lab.jmp_as(&client_cfg, &["delete", "leases", &lease]).await;
    assert!(ok, "jmp delete leases through the standby:\n{out}\n{err}");
    eventually(TIMEOUT, "the lease to end", || async {
        lab.leases()
            .get(&lease)
            .await
            .ok()
            .and_then(|l| l.status)
            .is_some_and(|s| s.ended)
    })
    .await;
    for log in [lab.mgr.logs(), standby.logs()] {
        assert!(
            !log.contains("not the leader; the write was refused"),
            "{log}"
        );
    }
}

/// A Dial for a lease whose exporter listens nowhere leaves a pending dial, gives up after the
/// wait with UNAVAILABLE (which jmp retries), and withdraws it.
#[tokio::test]
#[ignore = "e2e: needs the local control plane and the pinned jumpstarter packages"]
async fn a_dial_nobody_claims_is_withdrawn() {
    let lab = Lab::start("jmp-unclaimed", "60s").await;
    let mut exporter = lab.start_exporter(1);
    lab.wait_available("registered, online and available").await;
    let lease = lab.create_lease_as(&lab.client_cfg, "").await;
    lab.wait_exporter(TIMEOUT, "leased and ready", |e| {
        lease_ref(e).as_deref() == Some(lease.as_str())
            && exporter_status(e) == Some(ExporterStatusValue::LeaseReady)
    })
    .await;
    // SIGKILL: the status stays LeaseReady (60 s threshold), but no Listen is open anywhere.
    exporter.kill();
    let ch = channel(&lab).await;
    let mut c =
        ucm::exporter::proto::jumpstarter::v1::controller_service_client::ControllerServiceClient::new(ch);
    let started = std::time::Instant::now();
    let pending: Api<ConfigMap> = Api::namespaced(lab.env.client.clone(), &lab.env.ns);
    let watch_pending = async {
        eventually(TIMEOUT, "a pending dial while the Dial waits", || async {
            !pending
                .list(&ListParams::default().labels(DIAL_LABEL))
                .await
                .unwrap()
                .items
                .is_empty()
        })
        .await;
    };
    let dial = c.dial(authed(
        ucm::exporter::proto::jumpstarter::v1::DialRequest {
            lease_name: lease.clone(),
        },
        &lab.client_token,
        "Client",
        &lab.env.ns,
        CLIENT,
    ));
    let (res, ()) = tokio::join!(dial, watch_pending);
    let err = res.expect_err("no exporter listens");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        started.elapsed() >= Duration::from_secs(25),
        "the Dial waited for a Listen"
    );
    let left = pending
        .list(&ListParams::default().labels(DIAL_LABEL))
        .await
        .unwrap();
    assert!(left.items.is_empty(), "the pending dial was withdrawn");
    assert_eq!(
        metric(
            &lab.mgr.metrics().await,
            "ucm_exporter_dial_seconds_count",
            &[("result", "unanswered")]
        ),
        1.0
    );
}

//! Idle is free: a pass over unchanged objects sends no write.

use super::*;

// ---- A pass over unchanged objects sends no write (docs/exporter.md, "Status writes") ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn unchanged_objects_get_no_writes() {
    let env = TestEnv::new("exp-nowrite").await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let clients: Api<JClient> = Api::namespaced(env.client.clone(), &env.ns);
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let m = manager(&env, &["--exporter-offline-threshold=1h"]);
    m.wait_ready().await;
    create(
        &env.client,
        &env.ns,
        exporter_manifest("e1", json!({"board": "rpi"})),
    )
    .await;
    create(&env.client, &env.ns, client_manifest("c1", json!({}))).await;
    report_available(&exporters, "e1").await;
    let lease = |name: &str| {
        lease_manifest(
            name,
            json!({"clientRef": {"name": "c1"}, "duration": "1h", "exporterRef": {"name": "e1"}}),
        )
    };
    // One ended lease and one running lease.
    create(&env.client, &env.ns, lease("done")).await;
    eventually(TIMEOUT, "done to be acquired", || async {
        leases
            .get("done")
            .await
            .ok()
            .and_then(|l| l.status)
            .is_some_and(|s| s.begin_time.is_some())
    })
    .await;
    leases
        .patch(
            "done",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"release": true}})),
        )
        .await
        .unwrap();
    create(&env.client, &env.ns, lease("running")).await;
    eventually(TIMEOUT, "everything settled", || async {
        let done = leases
            .get("done")
            .await
            .ok()
            .is_some_and(|l| l.labels().contains_key("jumpstarter.dev/lease-ended"));
        let running = leases.get("running").await.ok().is_some_and(|l| {
            l.status.as_ref().is_some_and(|s| s.begin_time.is_some())
                && l.owner_references().iter().any(|r| r.name == "e1")
        });
        let exporter = exporters.get("e1").await.ok().is_some_and(|e| {
            e.status
                .as_ref()
                .and_then(|s| s.lease_ref.as_ref())
                .is_some_and(|r| r.name == "running")
                && exporter_condition(&e, "Online").is_some_and(|c| c.0 == "True")
        });
        let client = clients
            .get("c1")
            .await
            .ok()
            .and_then(|c| c.status)
            .is_some_and(|s| s.token_expires_at.is_some());
        done && running && exporter && client
    })
    .await;

    // Snapshot of every resourceVersion, compared after passes that have nothing to do.
    let snapshot = || async {
        vec![
            ("Exporter e1", rv(&exporters.get("e1").await.unwrap())),
            ("Lease done", rv(&leases.get("done").await.unwrap())),
            ("Lease running", rv(&leases.get("running").await.unwrap())),
            ("Client c1", rv(&clients.get("c1").await.unwrap())),
            (
                "Secret e1-exporter",
                rv(&secrets.get("e1-exporter").await.unwrap()),
            ),
            (
                "Secret c1-client",
                rv(&secrets.get("c1-client").await.unwrap()),
            ),
        ]
    };

    // 1. Live passes: touch what triggers each controller (our own write is the last change).
    let before = [
        reconciles(&m, "exporter").await,
        reconciles(&m, "lease").await,
        reconciles(&m, "client").await,
    ];
    // Expected: the versions before, except those our own touches return.
    let mut expected = snapshot().await;
    let touched = [
        ("Secret e1-exporter", touch(&secrets, "e1-exporter").await), // → exporter pass
        ("Lease running", touch(&leases, "running").await),           // → lease and exporter passes
        ("Secret c1-client", touch(&secrets, "c1-client").await),     // → client pass
    ];
    for (what, version) in touched {
        expected.iter_mut().find(|(w, _)| *w == what).unwrap().1 = version;
    }
    for (controller, n) in ["exporter", "lease", "client"].into_iter().zip(before) {
        wait_reconciles(&m, controller, n).await;
    }
    assert_eq!(snapshot().await, expected, "a live pass wrote something");
    let text = m.metrics().await;
    let status_writes = metric(&text, "ucm_exporter_status_writes_total", &[]);
    drop(m);

    // 2. A new process: its first pass over every object is a second pass, and writes nothing.
    let m2 = manager(&env, &["--exporter-offline-threshold=1h"]);
    m2.wait_ready().await;
    for controller in ["exporter", "lease", "client"] {
        wait_reconciles(&m2, controller, 0.0).await;
    }
    assert_eq!(snapshot().await, expected, "a restart pass wrote something");
    let text = m2.metrics().await;
    assert_eq!(metric(&text, "ucm_exporter_status_writes_total", &[]), 0.0);
    assert_eq!(
        metric(&text, "jumpstarter_lease_acquisitions_total", &[]),
        0.0
    );
    assert!(status_writes > 0.0, "the first process did write status");

    // A spec change bumps observedGeneration; unchanged conditions keep their
    // lastTransitionTime.
    let e = exporters.get("e1").await.unwrap();
    let online_since = find_condition(e.status.as_ref().unwrap().conditions.as_ref(), "Online")
        .unwrap()
        .last_transition_time;
    exporters
        .patch(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"username": "lab-user"}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "observedGeneration to follow", || async {
        exporters.get("e1").await.ok().is_some_and(|e| {
            let conds = e.status.as_ref().unwrap().conditions.clone().unwrap();
            conds.len() == 3
                && conds
                    .iter()
                    .all(|c| c.observed_generation == e.metadata.generation)
        })
    })
    .await;
    let e = exporters.get("e1").await.unwrap();
    assert_eq!(
        find_condition(e.status.as_ref().unwrap().conditions.as_ref(), "Online")
            .unwrap()
            .last_transition_time,
        online_since
    );
}

//! Bad input: what the schema refuses and the conditions of leases that cannot be served.

use super::*;

// ---- Schema rejection ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn schema_rejects_bad_values() {
    let env = TestEnv::new("exp-schema").await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    create(&env.client, &env.ns, exporter_manifest("e1", json!({}))).await;
    for bad in [
        json!({"status": {"exporterStatus": "Dancing"}}),
        json!({"status": {"leaseHooks": {"afterLease": {"phase": "Maybe", "attempts": 1}}}}),
        json!({"status": {"leaseHooks": {"beforeLease": {"phase": "Running", "onFailure": "panic"}}}}),
    ] {
        let err = exporters
            .patch_status("e1", &PatchParams::default(), &Patch::Merge(bad.clone()))
            .await
            .expect_err(&format!("{bad} must be rejected"));
        assert!(err.to_string().contains("Unsupported value"), "{err}");
    }
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let try_create = |name: &str, spec: serde_json::Value| {
        let leases = leases.clone();
        let lease: Lease = serde_json::from_value(lease_manifest(name, spec)).unwrap();
        async move { leases.create(&PostParams::default(), &lease).await }
    };
    // A Lease with neither selector nor exporterRef.
    let err = try_create("l0", json!({"clientRef": {"name": "c"}, "duration": "1h"}))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("one of selector or exporterRef.name is required"),
        "{err}"
    );
    let sel = json!({"matchLabels": {"a": "b"}});
    // Oversized maps: 11 tags, 9 context entries, a 33-character key, a 65-character value.
    let tags: serde_json::Map<_, _> = (0..11).map(|i| (format!("k{i}"), json!("v"))).collect();
    let ctx9: serde_json::Map<_, _> = (0..9).map(|i| (format!("k{i}"), json!("v"))).collect();
    for (spec, want) in [
        (
            json!({"clientRef": {"name": "c"}, "duration": "1h", "selector": sel, "tags": tags}),
            "must have at most 10 items",
        ),
        (
            json!({"clientRef": {"name": "c"}, "duration": "1h", "selector": sel, "context": ctx9}),
            "must have at most 8 items",
        ),
        (
            json!({"clientRef": {"name": "c"}, "duration": "1h", "selector": sel,
                   "context": {"k".repeat(33): "v"}}),
            "context keys max 32 chars, values max 64 chars",
        ),
        (
            json!({"clientRef": {"name": "c"}, "duration": "1h", "selector": sel,
                   "context": {"k": "v".repeat(65)}}),
            "context keys max 32 chars, values max 64 chars",
        ),
    ] {
        let err = try_create("l1", spec.clone())
            .await
            .expect_err(&format!("{spec} must be rejected"));
        assert!(err.to_string().contains(want), "{spec}: {err}");
    }
    // Edits to tags or context.
    create(
        &env.client,
        &env.ns,
        lease_manifest(
            "l2",
            json!({"clientRef": {"name": "c"}, "duration": "1h", "selector": sel,
                   "tags": {"a": "1"}, "context": {"build": "7"}}),
        ),
    )
    .await;
    for (edit, want) in [
        (
            json!({"spec": {"tags": {"a": "2"}}}),
            "tags are immutable after creation",
        ),
        (
            json!({"spec": {"context": {"build": "8"}}}),
            "context is immutable after creation",
        ),
    ] {
        let err = leases
            .patch("l2", &PatchParams::default(), &Patch::Merge(edit.clone()))
            .await
            .expect_err(&format!("{edit} must be rejected"));
        assert!(err.to_string().contains(want), "{edit}: {err}");
    }
}

// ---- Bad input: conditions for contradictory leases, and the manager keeps going ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn bad_leases_end_with_a_condition_and_others_keep_going() {
    let env = TestEnv::new("exp-bad").await;
    let m = manager(&env, &["--exporter-offline-threshold=1h"]);
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    create(
        &env.client,
        &env.ns,
        exporter_manifest("e1", json!({"board": "rpi"})),
    )
    .await;
    report_available(&exporters, "e1").await;
    let rpi = json!({"matchLabels": {"board": "rpi"}});
    let far = rfc3339(Timestamp::now() + SignedDuration::from_hours(24));
    let past = rfc3339(Timestamp::now() - SignedDuration::from_hours(1));
    for (name, spec) in [
        (
            "bad-duration",
            json!({"clientRef": {"name": "c"}, "duration": "forever", "selector": rpi}),
        ),
        (
            "bad-selector",
            json!({"clientRef": {"name": "c"}, "duration": "1h",
                   "selector": {"matchExpressions": [{"key": "board", "operator": "Bogus"}]}}),
        ),
        (
            "contradictory-pin",
            json!({"clientRef": {"name": "c"}, "duration": "1h",
                   "exporterRef": {"name": "e1"}, "selector": {"matchLabels": {"board": "qemu"}}}),
        ),
        (
            "released-before-start",
            json!({"clientRef": {"name": "c"}, "duration": "1h", "beginTime": far,
                   "selector": rpi}),
        ),
    ] {
        create(&env.client, &env.ns, lease_manifest(name, spec)).await;
    }
    for (name, type_, reason, message) in [
        (
            "bad-duration",
            "Invalid",
            "InvalidDuration",
            "spec.duration: invalid duration \"forever\"",
        ),
        (
            "bad-selector",
            "Invalid",
            "InvalidSelector",
            "The selector for the lease is invalid:",
        ),
        (
            "contradictory-pin",
            "Unsatisfiable",
            "SelectorMismatch",
            "Requested exporter e1 does not match selector board=qemu",
        ),
    ] {
        eventually(TIMEOUT, &format!("{name} to end with {reason}"), || async {
            leases.get(name).await.ok().is_some_and(|l| {
                l.status.as_ref().is_some_and(|s| s.ended)
                    && lease_cond(&l, type_)
                        .is_some_and(|c| c.reason == reason && c.message.starts_with(message))
            })
        })
        .await;
    }
    // A scheduled lease released before it starts ends without ever starting.
    leases
        .patch(
            "released-before-start",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"release": true}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "the early release", || async {
        leases
            .get("released-before-start")
            .await
            .ok()
            .is_some_and(|l| {
                l.status
                    .as_ref()
                    .is_some_and(|s| s.ended && s.begin_time.is_none())
                    && lease_cond(&l, "Ready").is_some_and(|c| c.reason == "Released")
            })
    })
    .await;

    // Other objects keep reconciling: a new Exporter gets its credential, a lease with a past
    // endTime starts and expires at once, a scheduled lease waits for beginTime and expires at
    // its endTime.
    create(&env.client, &env.ns, exporter_manifest("e2", json!({}))).await;
    eventually(TIMEOUT, "e2's Secret", || async {
        secrets
            .get_opt("e2-exporter")
            .await
            .ok()
            .flatten()
            .is_some()
    })
    .await;
    create(
        &env.client,
        &env.ns,
        lease_manifest(
            "past-end",
            json!({"clientRef": {"name": "c"}, "endTime": past, "exporterRef": {"name": "e1"}}),
        ),
    )
    .await;
    eventually(TIMEOUT, "a past endTime to expire at once", || async {
        leases.get("past-end").await.ok().is_some_and(|l| {
            l.status.as_ref().is_some_and(|s| s.ended)
                && lease_cond(&l, "Ready").is_some_and(|c| c.reason == "Expired")
        })
    })
    .await;
    // Whole seconds: metav1.Time stores no fraction.
    let begin = Timestamp::from_second(Timestamp::now().as_second() + 4).unwrap();
    let end = begin + SignedDuration::from_secs(4);
    let second_end = begin + SignedDuration::from_secs(8);
    for (name, from, to) in [
        ("scheduled", begin, end),
        // Overlaps the first on the one exporter: waits for it, then runs to its own end.
        (
            "scheduled-2",
            begin + SignedDuration::from_secs(2),
            second_end,
        ),
        // Deleted before it begins: its timer finds nothing to do.
        ("scheduled-deleted", begin, end),
    ] {
        create(
            &env.client,
            &env.ns,
            lease_manifest(
                name,
                json!({"clientRef": {"name": "c"}, "beginTime": rfc3339(from),
                       "endTime": rfc3339(to), "selector": rpi}),
            ),
        )
        .await;
    }
    leases
        .delete("scheduled-deleted", &DeleteParams::default())
        .await
        .unwrap();
    eventually(TIMEOUT, "the scheduled lease to start", || async {
        leases
            .get("scheduled")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.begin_time)
            .is_some()
    })
    .await;
    let started = leases
        .get("scheduled")
        .await
        .unwrap()
        .status
        .unwrap()
        .begin_time
        .unwrap()
        .0;
    assert!(started >= begin, "started at {started}, before {begin}");
    eventually(
        Duration::from_secs(30),
        "the scheduled lease to expire at endTime",
        || async {
            leases
                .get("scheduled")
                .await
                .ok()
                .is_some_and(|l| lease_cond(&l, "Ready").is_some_and(|c| c.reason == "Expired"))
        },
    )
    .await;
    let ended = leases
        .get("scheduled")
        .await
        .unwrap()
        .status
        .unwrap()
        .end_time
        .unwrap()
        .0;
    // Never early; late only by scheduling (the requeue is at endTime exactly).
    assert!(
        ended >= end && ended.duration_since(end) <= SignedDuration::from_secs(5),
        "ended at {ended}, endTime {end}"
    );
    // The overlapping one got the exporter once the first ended, and expired at its endTime.
    eventually(
        Duration::from_secs(30),
        "the second scheduled lease to expire at its endTime",
        || async {
            leases
                .get("scheduled-2")
                .await
                .ok()
                .is_some_and(|l| lease_cond(&l, "Ready").is_some_and(|c| c.reason == "Expired"))
        },
    )
    .await;
    let s2 = leases.get("scheduled-2").await.unwrap().status.unwrap();
    let (b2, e2) = (s2.begin_time.unwrap().0, s2.end_time.unwrap().0);
    assert!(
        b2 >= ended,
        "started at {b2}, while the first ran until {ended}"
    );
    assert!(
        e2 >= second_end && e2.duration_since(second_end) <= SignedDuration::from_secs(5),
        "ended at {e2}, endTime {second_end}"
    );
    assert_eq!(
        metric(
            &m.metrics().await,
            "controller_runtime_reconcile_errors_total",
            &[("controller", "lease")]
        ),
        0.0,
        "bad leases are conditions, not reconcile errors"
    );
    assert_eq!(
        m.readyz().await.map(|r| r.0),
        Some(200),
        "the manager is alive and ready"
    );
}

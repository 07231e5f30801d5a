//! Lease assignment, release, conditions and policies, and the lease-hooks record.

use super::*;

// ---- Lease (docs/exporter.md, "The Lease pass"): leaseRef, Offline, NotAvailable,
// ExporterNotFound, the ended label, the ownerRef, the acquisition metric, GC ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn lease_is_assigned_released_and_labelled() {
    let env = TestEnv::new("exp-lease").await;
    let m = manager(&env, &["--exporter-offline-threshold=1h"]);
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    create(
        &env.client,
        &env.ns,
        exporter_manifest("e1", json!({"board": "rpi"})),
    )
    .await;
    create(&env.client, &env.ns, client_manifest("c1", json!({}))).await;
    // Pending/Offline before the exporter reports in.
    create(
        &env.client,
        &env.ns,
        lease_manifest(
            "l1",
            json!({"clientRef": {"name": "c1"}, "duration": "1h",
                   "selector": {"matchLabels": {"board": "rpi"}}}),
        ),
    )
    .await;
    eventually(TIMEOUT, "Pending/Offline", || async {
        leases
            .get("l1")
            .await
            .ok()
            .and_then(|l| lease_cond(&l, "Pending"))
            .is_some_and(|c| {
                c.reason == "Offline"
                    && c.message
                        == "While there are 1 available exporters (i.e. e1), none of them are online"
            })
    })
    .await;

    // The exporter comes online: the pending lease is retried and acquired.
    report_available(&exporters, "e1").await;
    eventually(TIMEOUT, "the lease to be acquired", || async {
        leases
            .get("l1")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.exporter_ref)
            .is_some_and(|r| r.name == "e1")
    })
    .await;
    eventually(TIMEOUT, "the controller ownerRef and leaseRef", || async {
        let l = leases.get("l1").await.unwrap();
        let e = exporters.get("e1").await.unwrap();
        l.owner_references()
            .iter()
            .any(|r| r.name == "e1" && r.controller == Some(true))
            && e.status
                .and_then(|s| s.lease_ref)
                .is_some_and(|r| r.name == "l1")
    })
    .await;
    let l = leases.get("l1").await.unwrap();
    let ready = lease_cond(&l, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "Ready")
    );
    assert!(l.status.as_ref().unwrap().begin_time.is_some());
    let metrics = m.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "ucm_exporter_exporters",
            &[("status", "Available")]
        ),
        1.0
    );
    assert_eq!(
        metric(
            &metrics,
            "ucm_exporter_exporters_online",
            &[("online", "true")]
        ),
        1.0
    );

    // A second lease for the same exporter waits: NotAvailable.
    create(
        &env.client,
        &env.ns,
        lease_manifest(
            "l2",
            json!({"clientRef": {"name": "c1"}, "duration": "1h", "exporterRef": {"name": "e1"}}),
        ),
    )
    .await;
    eventually(TIMEOUT, "Pending/NotAvailable", || async {
        leases
            .get("l2")
            .await
            .ok()
            .and_then(|l| lease_cond(&l, "Pending"))
            .is_some_and(|c| c.reason == "NotAvailable")
    })
    .await;

    // Release: ended, Ready=False/Released, label, leaseRef cleared; l2 then gets the exporter.
    leases
        .patch(
            "l1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"release": true}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "the release", || async {
        let l = leases.get("l1").await.unwrap();
        l.status.as_ref().is_some_and(|s| s.ended)
            && l.labels()
                .get("jumpstarter.dev/lease-ended")
                .map(String::as_str)
                == Some("true")
    })
    .await;
    let l = leases.get("l1").await.unwrap();
    assert_eq!(lease_cond(&l, "Ready").unwrap().reason, "Released");
    assert!(l.status.as_ref().unwrap().end_time.is_some());
    assert_eq!(
        l.status.unwrap().exporter_ref.unwrap().name,
        "e1",
        "exporterRef is kept after the end"
    );
    eventually(TIMEOUT, "l2 to get the exporter", || async {
        leases
            .get("l2")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.exporter_ref)
            .is_some_and(|r| r.name == "e1")
    })
    .await;
    eventually(TIMEOUT, "leaseRef to follow", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .and_then(|s| s.lease_ref)
            .is_some_and(|r| r.name == "l2")
    })
    .await;

    // A missing ended label is backfilled.
    leases
        .patch(
            "l1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"jumpstarter.dev/lease-ended": null}}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "the ended label to be backfilled", || async {
        leases.get("l1").await.ok().is_some_and(|l| {
            l.labels()
                .get("jumpstarter.dev/lease-ended")
                .map(String::as_str)
                == Some("true")
        })
    })
    .await;
    // Labelled leases are outside the Lease watch: a change to one is not reconciled (if
    // it were, the reconciler would end this released lease again). The barrier is a later
    // lease the same controller must end.
    leases
        .patch_status(
            "l1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"ended": false}})),
        )
        .await
        .unwrap();

    // An unsatisfiable lease ends with the upstream condition and counts as a failure.
    create(
        &env.client,
        &env.ns,
        lease_manifest(
            "l3",
            json!({"clientRef": {"name": "c1"}, "duration": "1h", "exporterRef": {"name": "missing"}}),
        ),
    )
    .await;
    eventually(TIMEOUT, "ExporterNotFound", || async {
        leases.get("l3").await.ok().is_some_and(|l| {
            l.status.as_ref().is_some_and(|s| s.ended)
                && lease_cond(&l, "Unsatisfiable").is_some_and(|c| {
                    c.reason == "ExporterNotFound"
                        && c.message == "Requested exporter missing was not found"
                })
        })
    })
    .await;
    assert!(
        !leases.get("l1").await.unwrap().status.unwrap().ended,
        "an ended (labelled) lease is not reconciled"
    );
    let metrics = m.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "jumpstarter_lease_acquisitions_total",
            &[("result", "success")]
        ),
        2.0,
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "jumpstarter_lease_acquisitions_total",
            &[("result", "failure")]
        ),
        1.0,
        "{metrics}"
    );

    // Deleting the running lease hands the exporter to the waiting one at once (the cleared
    // leaseRef is an Exporter change the Lease controller maps to pending leases).
    create(
        &env.client,
        &env.ns,
        lease_manifest(
            "l4",
            json!({"clientRef": {"name": "c1"}, "duration": "1h", "exporterRef": {"name": "e1"}}),
        ),
    )
    .await;
    eventually(TIMEOUT, "l4: Pending/NotAvailable", || async {
        leases
            .get("l4")
            .await
            .ok()
            .and_then(|l| lease_cond(&l, "Pending"))
            .is_some_and(|c| c.reason == "NotAvailable")
    })
    .await;
    leases.delete("l2", &DeleteParams::default()).await.unwrap();
    eventually(TIMEOUT, "l4 to get the exporter and leaseRef", || async {
        let acquired = leases
            .get("l4")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.exporter_ref)
            .is_some_and(|r| r.name == "e1");
        acquired
            && exporters
                .get("e1")
                .await
                .ok()
                .and_then(|e| e.status)
                .and_then(|s| s.lease_ref)
                .is_some_and(|r| r.name == "l4")
    })
    .await;

    // Disabling the exporter keeps its active lease.
    let lease_passes = reconciles(&m, "lease").await;
    exporters
        .patch(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"enabled": false}})),
        )
        .await
        .unwrap();
    eventually(
        TIMEOUT,
        "the exporter pass for the new generation",
        || async {
            exporters.get("e1").await.ok().is_some_and(|e| {
                find_condition(e.status.as_ref().unwrap().conditions.as_ref(), "Online")
                    .is_some_and(|c| c.observed_generation == e.metadata.generation)
            })
        },
    )
    .await;
    wait_reconciles(&m, "lease", lease_passes).await;
    let l4 = leases.get("l4").await.unwrap();
    assert!(!l4.status.as_ref().unwrap().ended, "still active");
    assert_eq!(lease_cond(&l4, "Ready").unwrap().status, "True");

    // The lease ends, leaseRef is cleared.
    leases
        .patch(
            "l4",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"release": true}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "leaseRef to be cleared", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .is_some_and(|s| s.lease_ref.is_none())
    })
    .await;

    // Deleting the exporter garbage-collects its leases, ended or not.
    exporters
        .delete("e1", &DeleteParams::default())
        .await
        .unwrap();
    eventually(TIMEOUT, "leases to be garbage-collected", || async {
        leases.get_opt("l1").await.ok().flatten().is_none()
            && leases.get_opt("l4").await.ok().flatten().is_none()
    })
    .await;
}

// ---- spec.enabled and the remaining condition reasons (docs/exporter.md, "Lease assignment") ----

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn lease_condition_reasons_policies_and_enabled() {
    let env = TestEnv::new("exp-reasons").await;
    let m = manager(&env, &["--exporter-offline-threshold=1h"]);
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    for (name, pool) in [
        ("dis", "dis"),
        ("pol", "pol"),
        ("busy", "busy"),
        ("spot", "spot"),
    ] {
        create(
            &env.client,
            &env.ns,
            exporter_manifest(name, json!({"pool": pool})),
        )
        .await;
    }
    exporters
        .patch(
            "dis",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"enabled": false}})),
        )
        .await
        .unwrap();
    for name in ["dis", "pol", "spot"] {
        report_available(&exporters, name).await;
    }
    // Still cleaning up after a previous lease.
    report(
        &exporters,
        "busy",
        "AfterLeaseHook",
        "Running afterLease hook",
    )
    .await;
    create(
        &env.client,
        &env.ns,
        client_manifest("team-a", json!({"team": "a"})),
    )
    .await;
    create(
        &env.client,
        &env.ns,
        client_manifest("team-b", json!({"team": "b"})),
    )
    .await;
    let policy = |name: &str, exporter_selector: serde_json::Value, rules: serde_json::Value| {
        json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "ExporterAccessPolicy",
               "metadata": {"name": name},
               "spec": {"exporterSelector": exporter_selector, "policies": rules}})
    };
    create(
        &env.client,
        &env.ns,
        policy(
            "pol-team-a",
            json!({"matchLabels": {"pool": "pol"}}),
            json!([{"description": "only team a", "priority": 5,
                    "from": [{"clientSelector": {"matchLabels": {"team": "a"}}}]},
                   {"description": "only team a", "priority": 1,
                    "from": [{"clientSelector": {"matchLabels": {"team": "a"}}}]},
                   {"priority": 1, "from": [{"clientSelector": {"matchLabels": {"team": "c"}}}]}]),
        ),
    )
    .await;
    create(
        &env.client,
        &env.ns,
        policy(
            "everyone",
            json!({"matchExpressions": [{"key": "pool", "operator": "In", "values": ["dis", "busy"]}]}),
            json!([{"from": [{"clientSelector": {}}]}]),
        ),
    )
    .await;
    create(
        &env.client,
        &env.ns,
        policy(
            "spot-only",
            json!({"matchLabels": {"pool": "spot"}}),
            json!([{"spotAccess": true, "from": [{"clientSelector": {}}]}]),
        ),
    )
    .await;
    let spec = |client: &str, extra: serde_json::Value| {
        let mut s = json!({"clientRef": {"name": client}, "duration": "1h"});
        s.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        s
    };
    for (name, s) in [
        (
            "pinned-disabled",
            spec("team-a", json!({"exporterRef": {"name": "dis"}})),
        ),
        (
            "all-disabled",
            spec(
                "team-a",
                json!({"selector": {"matchLabels": {"pool": "dis"}}}),
            ),
        ),
        (
            "no-access",
            spec(
                "team-b",
                json!({"selector": {"matchLabels": {"pool": "pol"}}}),
            ),
        ),
        (
            "access",
            spec(
                "team-a",
                json!({"selector": {"matchLabels": {"pool": "pol"}}}),
            ),
        ),
        (
            "allow-disabled",
            spec(
                "team-a",
                json!({"exporterRef": {"name": "dis"}, "allowDisabled": true}),
            ),
        ),
        (
            "not-ready",
            spec(
                "team-a",
                json!({"selector": {"matchLabels": {"pool": "busy"}}}),
            ),
        ),
        (
            "spot",
            spec(
                "team-a",
                json!({"selector": {"matchLabels": {"pool": "spot"}}}),
            ),
        ),
    ] {
        create(&env.client, &env.ns, lease_manifest(name, s)).await;
    }

    let ends_with = |name: &'static str, reason: &'static str, message: String| {
        let leases = leases.clone();
        async move {
            eventually(
                TIMEOUT,
                &format!("{name}: Unsatisfiable/{reason}"),
                || async {
                    leases.get(name).await.ok().is_some_and(|l| {
                        l.status.as_ref().is_some_and(|s| s.ended)
                            && lease_cond(&l, "Unsatisfiable").is_some_and(|c| {
                                c.status == "True" && c.reason == reason && c.message == message
                            })
                    })
                },
            )
            .await;
        }
    };
    ends_with(
        "pinned-disabled",
        "ExporterDisabled",
        "Requested exporter dis is disabled. To lease a disabled exporter, set spec.allowDisabled: true on the Lease, or use --allow-disabled with jmp create lease or jmp shell".into(),
    )
    .await;
    ends_with(
        "all-disabled",
        "AllDisabled",
        "All 1 exporters matching the selector are disabled".into(),
    )
    .await;
    // Only non-empty descriptions, de-duplicated.
    ends_with(
        "no-access",
        "NoAccess",
        "While there are 1 exporters matching the selector, none of them are approved by any policy for your client. Matching policies: only team a".into(),
    )
    .await;
    let acquired = |name: &'static str, exporter: &'static str| {
        let leases = leases.clone();
        async move {
            eventually(TIMEOUT, &format!("{name} on {exporter}"), || async {
                leases
                    .get(name)
                    .await
                    .ok()
                    .and_then(|l| l.status)
                    .and_then(|s| s.exporter_ref)
                    .is_some_and(|r| r.name == exporter)
            })
            .await;
            leases.get(name).await.unwrap()
        }
    };
    // The approving rule's priority is recorded.
    let l = acquired("access", "pol").await;
    assert_eq!(l.status.as_ref().unwrap().priority, Some(5));
    assert_ne!(l.status.as_ref().unwrap().spot_access, Some(true));
    acquired("allow-disabled", "dis").await;
    // OURS: spot access is granted, as spot (upstream: Unsatisfiable/SpotAccess).
    let l = acquired("spot", "spot").await;
    assert_eq!(l.status.as_ref().unwrap().spot_access, Some(true));
    eventually(TIMEOUT, "not-ready: Pending/NotReady", || async {
        leases
            .get("not-ready")
            .await
            .ok()
            .and_then(|l| lease_cond(&l, "Pending"))
            .is_some_and(|c| {
                // Upstream's message, then (OURS) the place in the queue.
                c.reason == "NotReady"
                    && c.message
                        == "There are 1 online exporters, but none are ready (still cleaning up previous lease); position 1 in the queue, estimated start now"
            })
    })
    .await;
    // The hook ends: the waiting lease is retried at once (Exporter watch) and acquired.
    report_available(&exporters, "busy").await;
    acquired("not-ready", "busy").await;

    // Disabling an exporter never revokes its lease.
    exporters
        .patch(
            "pol",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"enabled": false}})),
        )
        .await
        .unwrap();
    let lease_passes = reconciles(&m, "lease").await;
    touch(&leases, "access").await;
    wait_reconciles(&m, "lease", lease_passes).await;
    let l = leases.get("access").await.unwrap();
    assert!(!l.status.as_ref().unwrap().ended);
    assert_eq!(lease_cond(&l, "Ready").unwrap().status, "True");
    let metrics = m.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "jumpstarter_lease_acquisitions_total",
            &[("result", "failure")]
        ),
        3.0
    );
    assert_eq!(
        metric(
            &metrics,
            "jumpstarter_lease_acquisitions_total",
            &[("result", "success")]
        ),
        4.0
    );
}

// ---- The lease-hooks record and its assignment gate (docs/exporter.md, "Lease hooks: the record",
// "Lease hooks: the assignment gate"; reconciler side) ----
#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn lease_hooks_record_and_gate() {
    let env = TestEnv::new("exp-hooks").await;
    let m = manager(&env, &["--exporter-offline-threshold=1h"]);
    m.wait_ready().await;
    let exporters: Api<Exporter> = Api::namespaced(env.client.clone(), &env.ns);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    create(
        &env.client,
        &env.ns,
        exporter_manifest("e1", json!({"board": "rpi"})),
    )
    .await;
    report_available(&exporters, "e1").await;
    // What a declaring Register writes.
    exporters
        .patch_status(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"recordsLeaseHooks": true}})),
        )
        .await
        .unwrap();
    let lease = |name: &str| {
        lease_manifest(
            name,
            json!({"clientRef": {"name": "c1"}, "duration": "1h",
                   "selector": {"matchLabels": {"board": "rpi"}}}),
        )
    };
    create(&env.client, &env.ns, lease("l1")).await;
    eventually(TIMEOUT, "the record for l1", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .and_then(|s| s.lease_hooks)
            .is_some_and(|r| {
                r.lease_ref.is_some_and(|l| l.name == "l1")
                    && r.client_name.as_deref() == Some("c1")
            })
    })
    .await;
    let l1_uid = leases.get("l1").await.unwrap().uid();
    let record = exporters
        .get("e1")
        .await
        .unwrap()
        .status
        .unwrap()
        .lease_hooks
        .unwrap();
    assert_eq!(record.lease_uid, l1_uid);
    assert!(record.before_lease.is_none() && record.after_lease.is_none());

    // The exporter starts afterLease (as ReportStatus records it), the lease ends, and the
    // exporter claims to be Available: the next lease must wait for the hook.
    exporters
        .patch_status(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"leaseHooks": {"afterLease": {"phase": "Running", "attempts": 1}}}})),
        )
        .await
        .unwrap();
    leases
        .patch(
            "l1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"release": true}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "leaseRef cleared, record kept", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .is_some_and(|s| {
                s.lease_ref.is_none()
                    && s.lease_hooks
                        .is_some_and(|r| r.lease_ref.is_some_and(|l| l.name == "l1"))
            })
    })
    .await;
    create(&env.client, &env.ns, lease("l2")).await;
    eventually(TIMEOUT, "Pending/NotReady naming the owed hook", || async {
        leases
            .get("l2")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.conditions)
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.type_ == "Pending"
                        && c.reason == "NotReady"
                        // Then (OURS) the place in the queue.
                        && c.message.ends_with(
                            "; afterLease hook owed for lease l1 by exporter e1; position 1 in the queue, estimated start now",
                        )
                })
            })
    })
    .await;
    // The hook finishes: l2 is assigned right away and gets a fresh record.
    exporters
        .patch_status(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"leaseHooks": {"afterLease": {"phase": "Succeeded", "attempts": 1}}}})),
        )
        .await
        .unwrap();
    eventually(TIMEOUT, "l2 to be acquired", || async {
        leases
            .get("l2")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.exporter_ref)
            .is_some_and(|r| r.name == "e1")
    })
    .await;
    let l2_uid = leases.get("l2").await.unwrap().uid();
    eventually(TIMEOUT, "the record to follow l2", || async {
        exporters
            .get("e1")
            .await
            .ok()
            .and_then(|e| e.status)
            .and_then(|s| s.lease_hooks)
            .is_some_and(|r| r.lease_uid == l2_uid && r.after_lease.is_none())
    })
    .await;

    // A plain Register (an exporter that does not record its hooks) drops the record in the
    // same write as devices; the reconciler does not recreate it while l2 is held.
    exporters
        .patch_status(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"recordsLeaseHooks": false, "leaseHooks": null,
                                            "devices": []}}),
            ),
        )
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    let passes = reconciles(&m, "exporter").await;
    touch(&secrets, "e1-exporter").await;
    wait_reconciles(&m, "exporter", passes).await;
    let s = exporters.get("e1").await.unwrap().status.unwrap();
    assert!(
        s.lease_hooks.is_none(),
        "no record for a non-recording exporter"
    );
    assert_eq!(s.lease_ref.map(|r| r.name).as_deref(), Some("l2"));

    // A non-recording exporter is not gated, whatever record it still carries.
    exporters
        .patch_status(
            "e1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"leaseHooks": {"leaseRef": {"name": "l2"},
                "afterLease": {"phase": "Running", "attempts": 1}}}})),
        )
        .await
        .unwrap();
    leases
        .patch(
            "l2",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"release": true}})),
        )
        .await
        .unwrap();
    create(&env.client, &env.ns, lease("l3")).await;
    eventually(TIMEOUT, "l3 to be acquired without the gate", || async {
        leases
            .get("l3")
            .await
            .ok()
            .and_then(|l| l.status)
            .and_then(|s| s.exporter_ref)
            .is_some_and(|r| r.name == "e1")
    })
    .await;
}

//! The export pod's lifecycle: pause, TTL, validation of unsupported and alpha fields, a refused
//! pod create still writing status.

use super::*;

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e9_ttl_deletes_without_pod_and_counts() {
    let env = TestEnv::new("vmx-e9").await;
    let m = manager(&env);
    m.wait_ready().await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    create_export(&c, &ns, "short", pvc_source("absent"), Some("10s"))
        .await
        .unwrap();
    create_export(
        &c,
        &ns,
        "skipped",
        json!({"kind": "Pod", "name": "x"}),
        Some("10s"),
    )
    .await
    .unwrap();
    let e = wait_phase(&c, &ns, "short", "Pending", "Initializing").await;
    let expiry = e.status.unwrap().ttl_expiration_time.unwrap().0;
    let created = e.metadata.creation_timestamp.unwrap().0;
    assert_eq!(
        expiry.duration_since(created),
        jiff::SignedDuration::from_secs(10)
    );
    wait_phase(&c, &ns, "skipped", "Skipped", "UnsupportedSource").await;
    loop {
        let a = export(&c, &ns, "short").await;
        let b = export(&c, &ns, "skipped").await;
        let now = jiff::Timestamp::now();
        if a.is_none() && b.is_none() {
            assert!(
                now.duration_since(expiry) < jiff::SignedDuration::from_millis(1500),
                "deleted {:?} after expiry",
                now.duration_since(expiry)
            );
            break;
        }
        assert!(
            now < expiry + jiff::SignedDuration::from_secs(2),
            "not deleted at expiry"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eventually(WAIT, "the TTL counter", || async {
        m.metrics()
            .await
            .contains("ucm_vmexport_ttl_deletions_total 2")
    })
    .await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e10_e12_e16_validation_unsupported_and_alpha() {
    let env = TestEnv::new("vmx-e10").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    let m = manager(&env);
    m.wait_ready().await;
    create_export(&c, &ns, "imm", pvc_source("a"), None)
        .await
        .unwrap();
    let api: Api<VirtualMachineExport> = Api::namespaced(c.clone(), &ns);
    let err = api
        .patch(
            "imm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"source": {"name": "b"}}})),
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("spec is immutable after creation"),
        "{err}"
    );
    api.patch(
        "imm",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
    )
    .await
    .unwrap();
    let err = create_export(&c, &ns, "neg", pvc_source("a"), Some("-1h"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("ttlDuration"), "{err}");
    let err = create_export(&c, &ns, "bad", pvc_source("a"), Some("soon"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("ttlDuration"), "{err}");
    assert!(
        create_export(
            &c,
            &ns,
            "blank",
            json!({"kind": "PersistentVolumeClaim", "name": ""}),
            None
        )
        .await
        .is_err()
    );

    create_export(&c, &ns, "pod", json!({"kind": "Pod", "name": "x"}), None)
        .await
        .unwrap();
    create_export(
        &c,
        &ns,
        "foo",
        json!({"kind": "VirtualMachine", "apiGroup": "foo.io", "name": "x"}),
        None,
    )
    .await
    .unwrap();
    for n in ["pod", "foo"] {
        let (_, _, msg) =
            ready_reason(&wait_phase(&c, &ns, n, "Skipped", "UnsupportedSource").await);
        assert!(msg.contains("supported sources are"), "{msg}");
    }

    // `dot.x` and `dot-x` map to one Service name: the second export must not borrow it
    create_export(&c, &ns, "dot.x", pvc_source("a"), None)
        .await
        .unwrap();
    eventually(WAIT, "the Service of dot.x", || async {
        Api::<Service>::namespaced(c.clone(), &ns)
            .get_opt("virt-export-dot-x")
            .await
            .unwrap()
            .is_some()
    })
    .await;
    create_export(&c, &ns, "dot-x", pvc_source("a"), None)
        .await
        .unwrap();
    let (_, _, msg) =
        ready_reason(&wait_phase(&c, &ns, "dot-x", "Pending", "ObjectCreationFailed").await);
    assert!(
        msg.contains("virt-export-dot-x") && msg.contains("dot.x"),
        "{msg}"
    );

    // v1alpha1 in, v1 (storage) out
    let ar = ApiResource {
        group: "export.kubevirt.io".into(),
        version: "v1alpha1".into(),
        api_version: "export.kubevirt.io/v1alpha1".into(),
        kind: "VirtualMachineExport".into(),
        plural: "virtualmachineexports".into(),
    };
    let alpha: Api<DynamicObject> = Api::namespaced_with(c.clone(), &ns, &ar);
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "export.kubevirt.io/v1alpha1", "kind": "VirtualMachineExport",
        "metadata": {"name": "alpha"},
        "spec": {"source": {"kind": "PersistentVolumeClaim", "name": "a"}, "ttlDuration": "90m", "tokenSecretRef": "mine"},
    })).unwrap();
    alpha.create(&PostParams::default(), &obj).await.unwrap();
    let beta = api.get("alpha").await.unwrap();
    assert_eq!(beta.spec.ttl_duration.as_deref(), Some("90m"));
    assert_eq!(beta.spec.token_secret_ref.as_deref(), Some("mine"));
    assert_eq!(beta.spec.source.name, "a");
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e13_pod_creation_refused_still_writes_status() {
    let env = TestEnv::new("vmx-e13").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    let lr: LimitRange = serde_json::from_value(json!({
        "metadata": {"name": "tiny"},
        "spec": {"limits": [{"type": "Container", "max": {"cpu": "50m"}}]},
    }))
    .unwrap();
    let lrs: Api<LimitRange> = Api::namespaced(c.clone(), &ns);
    lrs.create(&PostParams::default(), &lr).await.unwrap();
    let m = manager(&env);
    m.wait_ready().await;
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    create_export(&c, &ns, "lr", pvc_source("d"), None)
        .await
        .unwrap();
    let (_, _, msg) =
        ready_reason(&wait_phase(&c, &ns, "lr", "Pending", "PodCreationFailed").await);
    assert!(
        msg.contains("virt-export-lr") && msg.to_lowercase().contains("cpu"),
        "{msg}"
    );
    lrs.delete("tiny", &Default::default()).await.unwrap();
    // the error backoff (capped at 60 s) retries the create
    let start = Instant::now();
    loop {
        if Api::<Pod>::namespaced(c.clone(), &ns)
            .get_opt("virt-export-lr")
            .await
            .unwrap()
            .is_some()
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(75),
            "pod not created after the LimitRange went away"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e4_e8_e18_pause_pod_lifecycle_and_phase_metric() {
    let env = TestEnv::new("vmx-e4").await;
    let m = manager(&env);
    m.wait_ready().await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    create_export(&c, &ns, "p", pvc_source("d"), None)
        .await
        .unwrap();
    wait_phase(&c, &ns, "p", "Pending", "PodPending").await;
    mark_pod(&c, &ns, "virt-export-p", "Running", true).await;
    let ready = wait_phase(&c, &ns, "p", "Ready", "PodReady").await;
    let links = ready.status.unwrap().links;
    let start = Instant::now();
    loop {
        let text = m.metrics().await;
        if text.contains("ucm_vmexport_exports{phase=\"Ready\"} 1") {
            break;
        }
        assert!(
            start.elapsed() < WAIT,
            "no Ready export in the phase metric:\n{}",
            text.lines()
                .filter(|l| l.contains("vmexport"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A new user of the claim pauses the export: pod deleted, links gone
    user_pod(&c, &ns, "user", "d").await;
    let paused = wait_phase(&c, &ns, "p", "Pending", "InUse").await;
    assert!(paused.status.unwrap().links.is_none());
    eventually(WAIT, "the export pod to be deleted", || async {
        pod_uid(&c, &ns, "virt-export-p").await.is_none()
    })
    .await;
    eventually(WAIT, "an ExportPaused event", || async {
        has_event(&c, &ns, "ExportPaused").await
    })
    .await;
    Api::<Pod>::namespaced(c.clone(), &ns)
        .patch_status(
            "user",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Failed"}})),
        )
        .await
        .unwrap();
    wait_phase(&c, &ns, "p", "Pending", "PodPending").await;
    mark_pod(&c, &ns, "virt-export-p", "Running", true).await;
    let again = wait_phase(&c, &ns, "p", "Ready", "PodReady").await;
    assert_eq!(
        again.status.unwrap().links,
        links,
        "the URLs do not change across a pause"
    );

    // A failed pod is replaced
    let uid = pod_uid(&c, &ns, "virt-export-p").await.unwrap();
    mark_pod(&c, &ns, "virt-export-p", "Failed", false).await;
    eventually(WAIT, "a new export pod after Failed", || async {
        pod_uid(&c, &ns, "virt-export-p")
            .await
            .is_some_and(|u| u != uid)
    })
    .await;
    eventually(WAIT, "an ExporterPodFailedOrCompleted event", || async {
        has_event(&c, &ns, "ExporterPodFailedOrCompleted").await
    })
    .await;
    // ... and so is one that exited at DEADLINE
    let uid = pod_uid(&c, &ns, "virt-export-p").await.unwrap();
    mark_pod(&c, &ns, "virt-export-p", "Succeeded", false).await;
    eventually(WAIT, "a new export pod after Succeeded", || async {
        pod_uid(&c, &ns, "virt-export-p")
            .await
            .is_some_and(|u| u != uid)
    })
    .await;
    // a deleted token Secret is recreated with a new token
    let old = get_secret(&c, &ns, "export-token-p").await.unwrap();
    Api::<Secret>::namespaced(c.clone(), &ns)
        .delete("export-token-p", &Default::default())
        .await
        .unwrap();
    eventually(WAIT, "the token Secret to be recreated", || async {
        get_secret(&c, &ns, "export-token-p")
            .await
            .is_some_and(|s| s.metadata.uid != old.metadata.uid)
    })
    .await;
    // ... so are a deleted serving-certificate Secret and a deleted pod
    let old = get_secret(&c, &ns, "export-cert-p").await.unwrap();
    Api::<Secret>::namespaced(c.clone(), &ns)
        .delete("export-cert-p", &Default::default())
        .await
        .unwrap();
    eventually(WAIT, "the cert Secret to be recreated", || async {
        get_secret(&c, &ns, "export-cert-p")
            .await
            .is_some_and(|s| s.metadata.uid != old.metadata.uid && !data(&s, "tls.crt").is_empty())
    })
    .await;
    let uid = pod_uid(&c, &ns, "virt-export-p").await.unwrap();
    Api::<Pod>::namespaced(c.clone(), &ns)
        .delete("virt-export-p", &Default::default())
        .await
        .unwrap();
    eventually(WAIT, "a new export pod after deletion", || async {
        pod_uid(&c, &ns, "virt-export-p")
            .await
            .is_some_and(|u| u != uid)
    })
    .await;
}

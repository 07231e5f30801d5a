//! PVC sources: the export's objects, Ready and its links (through the bridge), a missing then
//! in-use PVC.

use super::*;

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e1_pvc_export_objects_ready_links_and_bridge() {
    let env = TestEnv::new("vmx-e1").await;
    let m = manager(&env);
    m.wait_ready().await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    create_pvc(&c, &ns, "disk", Some("kubevirt"), false).await;
    create_pvc(&c, &ns, "files", None, false).await;
    create_pvc(&c, &ns, "blk", None, true).await;
    create_export(&c, &ns, "e1", pvc_source("disk"), None)
        .await
        .unwrap();
    create_export(&c, &ns, "e2", pvc_source("files"), None)
        .await
        .unwrap();
    create_export(&c, &ns, "e3", pvc_source("blk"), None)
        .await
        .unwrap();

    for e in ["e1", "e2", "e3"] {
        wait_phase(&c, &ns, e, "Pending", "PodPending").await;
    }
    // the children, owned by the export
    let svc = Api::<Service>::namespaced(c.clone(), &ns)
        .get("virt-export-e1")
        .await
        .unwrap();
    let pod = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("virt-export-e1")
        .await
        .unwrap();
    let token = get_secret(&c, &ns, "export-token-e1")
        .await
        .expect("token Secret");
    let cert = get_secret(&c, &ns, "export-cert-e1")
        .await
        .expect("cert Secret");
    for owners in [
        svc.owner_references(),
        pod.owner_references(),
        token.owner_references(),
        cert.owner_references(),
    ] {
        let o = &owners[0];
        assert_eq!(
            (o.kind.as_str(), o.api_version.as_str(), o.name.as_str()),
            ("VirtualMachineExport", "export.kubevirt.io/v1", "e1")
        );
        assert_eq!(
            (o.controller, o.block_owner_deletion),
            (Some(true), Some(true))
        );
    }
    let tok = String::from_utf8(data(&token, "token")).unwrap();
    assert!(tok.len() >= 32 && tok.bytes().all(|b| b.is_ascii_alphanumeric()));

    for e in ["e1", "e2", "e3"] {
        mark_pod(&c, &ns, &format!("virt-export-{e}"), "Running", true).await;
    }
    let e1 = wait_phase(&c, &ns, "e1", "Ready", "PodReady").await;
    let st = e1.status.clone().unwrap();
    assert_eq!(st.token_secret_ref.as_deref(), Some("export-token-e1"));
    assert_eq!(st.service_name.as_deref(), Some("virt-export-e1"));
    let ca = get_secret(&c, &ns, "ucm-export-ca")
        .await
        .expect("CA Secret in the manager namespace");
    let int = st.links.clone().unwrap().internal.unwrap();
    assert_eq!(
        int.cert,
        String::from_utf8(data(&ca, "tls.crt")).unwrap().trim()
    );
    assert!(st.links.unwrap().external.is_none());
    let h = format!("https://virt-export-e1.{ns}.svc");
    let vols = serde_json::to_value(&int.volumes).unwrap();
    assert_eq!(
        vols,
        json!([{"name": "disk", "formats": [
        {"format": "raw", "url": format!("{h}/volumes/disk/disk.img")},
        {"format": "gzip", "url": format!("{h}/volumes/disk/disk.img.gz")}]}])
    );
    assert_eq!(
        serde_json::to_value(&int.manifests).unwrap(),
        json!([{"type": "auth-header-secret", "url": format!("{h}/internal/manifests/secret")}])
    );
    let e2 = wait_phase(&c, &ns, "e2", "Ready", "PodReady").await;
    let h2 = format!("https://virt-export-e2.{ns}.svc");
    assert_eq!(
        serde_json::to_value(
            e2.status
                .clone()
                .unwrap()
                .links
                .unwrap()
                .internal
                .unwrap()
                .volumes
        )
        .unwrap(),
        json!([{"name": "files", "formats": [
        {"format": "dir", "url": format!("{h2}/volumes/files/dir")},
        {"format": "tar.gz", "url": format!("{h2}/volumes/files/disk.tar.gz")}]}])
    );
    let e3 = wait_phase(&c, &ns, "e3", "Ready", "PodReady").await;
    let blk = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("virt-export-e3")
        .await
        .unwrap();
    assert!(
        blk.spec.unwrap().containers[0]
            .volume_devices
            .as_ref()
            .unwrap()[0]
            .device_path
            .starts_with("/dev/export-volumes/")
    );
    assert_eq!(
        e3.status
            .unwrap()
            .links
            .unwrap()
            .internal
            .unwrap()
            .volumes
            .unwrap()[0]
            .formats
            .as_ref()
            .unwrap()
            .len(),
        2
    );

    // a deleted child is recreated
    Api::<Service>::namespaced(c.clone(), &ns)
        .delete("virt-export-e1", &Default::default())
        .await
        .unwrap();
    eventually(WAIT, "the Service to be recreated", || async {
        Api::<Service>::namespaced(c.clone(), &ns)
            .get_opt("virt-export-e1")
            .await
            .unwrap()
            .is_some_and(|s| s.metadata.deletion_timestamp.is_none())
    })
    .await;

    // the pods the reconciler wrote run as they are: kubevirt and archive content
    bridge(&env, &pod, &tok, &int_urls(&e1)).await;
    let pod2 = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("virt-export-e2")
        .await
        .unwrap();
    let tok2 = String::from_utf8(data(
        &get_secret(&c, &ns, "export-token-e2").await.unwrap(),
        "token",
    ))
    .unwrap();
    bridge(&env, &pod2, &tok2, &int_urls(&e2)).await;
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e2_e3_missing_then_in_use_pvc() {
    let env = TestEnv::new("vmx-e3").await;
    let m = manager(&env);
    m.wait_ready().await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    create_export(&c, &ns, "late", pvc_source("d"), None)
        .await
        .unwrap();
    let e = wait_phase(&c, &ns, "late", "Pending", "Initializing").await;
    let pvc_cond = e
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "PVCReady")
        .unwrap();
    assert_eq!(pvc_cond.reason.as_deref(), Some("PVCNotFound"));
    assert_eq!(
        pvc_cond.message,
        Some(format!("PersistentVolumeClaim {ns}/d not found"))
    );
    // what the user must act on is also a Warning event (kubectl describe, event alerting)
    eventually(WAIT, "a PVCNotFound Warning event", || async {
        let evs: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(c.clone(), &ns);
        evs.list(&Default::default())
            .await
            .unwrap()
            .items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("PVCNotFound")
                    && e.type_.as_deref() == Some("Warning")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("late")
            })
    })
    .await;
    // a user pod appears before the claim: once the claim exists the export waits for the user
    user_pod(&c, &ns, "user", "d").await;
    mark_pod(&c, &ns, "user", "Running", true).await;
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    let (_, _, msg) = ready_reason(&wait_phase(&c, &ns, "late", "Pending", "InUse").await);
    assert_eq!(msg, format!("PersistentVolumeClaim {ns}/d is in use"));
    assert!(
        Api::<Pod>::namespaced(c.clone(), &ns)
            .get_opt("virt-export-late")
            .await
            .unwrap()
            .is_none()
    );
    // the user finishes: the export proceeds
    Api::<Pod>::namespaced(c.clone(), &ns)
        .patch_status(
            "user",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
        )
        .await
        .unwrap();
    wait_phase(&c, &ns, "late", "Pending", "PodPending").await;
}

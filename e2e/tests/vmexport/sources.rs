//! VirtualMachine and VirtualMachineSnapshot sources, and KubeVirt's CRDs (and virt-template's)
//! arriving after the manager.

use super::*;

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e5_e6_vm_source_stopped_running_missing_and_empty() {
    let env = TestEnv::new("vmx-e5").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    install_kubevirt_crds(&c).await;
    let m = manager(&env);
    m.wait_ready().await;
    create_pvc(&c, &ns, "rootdisk", Some("kubevirt"), false).await;
    create_pvc(&c, &ns, "data", None, false).await;
    create_pvc(&c, &ns, "dump", None, false).await;
    create_vm(
        &c,
        &ns,
        "vm1",
        json!([
            {"name": "root", "persistentVolumeClaim": {"claimName": "rootdisk"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
            {"name": "root-again", "persistentVolumeClaim": {"claimName": "rootdisk"}},
            {"name": "dump", "memoryDump": {"claimName": "dump"}},
            {"name": "cloudinit", "cloudInitNoCloud": {"userData": "x"}},
        ]),
    )
    .await;
    let vm_source =
        |n: &str| json!({"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": n});
    create_export(&c, &ns, "vmx", vm_source("vm1"), None)
        .await
        .unwrap();
    let e = wait_phase(&c, &ns, "vmx", "Pending", "PodPending").await;
    assert_eq!(
        e.status.unwrap().virtual_machine_name.as_deref(),
        Some("vm1")
    );
    let pod = Api::<Pod>::namespaced(c.clone(), &ns)
        .get("virt-export-vmx")
        .await
        .unwrap();
    let claims: Vec<String> = pod
        .spec
        .unwrap()
        .volumes
        .unwrap()
        .into_iter()
        .filter_map(|v| v.persistent_volume_claim.map(|p| p.claim_name))
        .collect();
    assert_eq!(claims, ["rootdisk", "data", "dump"], "each claim once");
    mark_pod(&c, &ns, "virt-export-vmx", "Running", true).await;
    let e = wait_phase(&c, &ns, "vmx", "Ready", "PodReady").await;
    let int = e.status.unwrap().links.unwrap().internal.unwrap();
    let manifests: Vec<(String, String)> = int
        .manifests
        .clone()
        .unwrap()
        .into_iter()
        .map(|m| (m.type_, m.url))
        .collect();
    let h = format!("https://virt-export-vmx.{ns}.svc");
    assert_eq!(
        manifests,
        [
            ("all".to_string(), format!("{h}/internal/manifests/all")),
            (
                "auth-header-secret".to_string(),
                format!("{h}/internal/manifests/secret")
            ),
        ]
    );
    let cm = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(c.clone(), &ns)
        .get("exporter-vm-manifest-vmx")
        .await
        .unwrap();
    let data = cm.data.unwrap();
    assert!(data["virtualmachine-manifest"].contains("\"vm1\""));
    assert!(data.contains_key("dv-rootdisk") && data.contains_key("dv-data"));
    assert_eq!(cm.metadata.owner_references.unwrap()[0].name, "vmx");
    let vols = int.volumes.unwrap();
    let shape: Vec<(String, Vec<String>)> = vols
        .into_iter()
        .map(|v| {
            (
                v.name,
                v.formats.unwrap().into_iter().map(|f| f.format).collect(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (
                "rootdisk".to_string(),
                vec!["raw".to_string(), "gzip".to_string()]
            ),
            (
                "data".to_string(),
                vec!["dir".to_string(), "tar.gz".to_string()]
            ),
            (
                "dump".to_string(),
                vec!["dir".to_string(), "tar.gz".to_string()]
            ),
        ]
    );

    // starting the VM pauses the export; a finished VMI lets it proceed
    let vmis = Api::<DynamicObject>::namespaced_with(
        c.clone(),
        &ns,
        &kv("VirtualMachineInstance", "virtualmachineinstances"),
    );
    let vmi: DynamicObject = serde_json::from_value(json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "vm1"}, "spec": {}})).unwrap();
    vmis.create(&PostParams::default(), &vmi).await.unwrap();
    let (_, _, msg) = ready_reason(&wait_phase(&c, &ns, "vmx", "Pending", "InUse").await);
    assert_eq!(msg, format!("Virtual Machine {ns}/vm1 is running"));
    eventually(WAIT, "an ExportPaused event", || async {
        has_event(&c, &ns, "ExportPaused").await
    })
    .await;
    vmis.patch_status(
        "vm1",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await
    .unwrap();
    wait_phase(&c, &ns, "vmx", "Pending", "PodPending").await;

    // missing VM: Skipped until it appears
    create_export(&c, &ns, "late", vm_source("vm2"), None)
        .await
        .unwrap();
    let (_, _, msg) = ready_reason(&wait_phase(&c, &ns, "late", "Skipped", "VMNotFound").await);
    assert_eq!(msg, format!("Virtual Machine {ns}/vm2 not found"));
    create_vm(
        &c,
        &ns,
        "vm2",
        json!([{"name": "root", "persistentVolumeClaim": {"claimName": "rootdisk"}}]),
    )
    .await;
    // VM sources have no per-claim in-use check: vmx's pod on rootdisk does not block it
    wait_phase(&c, &ns, "late", "Pending", "PodPending").await;

    // a claim that does not exist yet: not populated until it does
    create_vm(
        &c,
        &ns,
        "vm3",
        json!([{"name": "root", "dataVolume": {"name": "later"}}]),
    )
    .await;
    create_export(&c, &ns, "np", vm_source("vm3"), None)
        .await
        .unwrap();
    wait_phase(&c, &ns, "np", "Pending", "VolumesNotPopulated").await;
    create_pvc(&c, &ns, "later", Some("kubevirt"), false).await;
    wait_phase(&c, &ns, "np", "Pending", "PodPending").await;

    // no exportable volumes: Skipped, naming what was ignored
    create_vm(
        &c,
        &ns,
        "vm4",
        json!([{"name": "ci", "cloudInitNoCloud": {"userData": "x"}}]),
    )
    .await;
    create_export(&c, &ns, "empty", vm_source("vm4"), None)
        .await
        .unwrap();
    let (_, _, msg) = ready_reason(&wait_phase(&c, &ns, "empty", "Skipped", "VMNoVolumes").await);
    assert!(msg.contains("ci"), "{msg}");
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e7_snapshot_source_restore_pvcs() {
    let env = TestEnv::new("vmx-e7").await;
    let (c, ns) = (env.client.clone(), env.ns.clone());
    install_crd(
        &c,
        "snapshot.kubevirt.io",
        "v1beta1",
        "VirtualMachineSnapshot",
        "virtualmachinesnapshots",
    )
    .await;
    install_crd(
        &c,
        "snapshot.kubevirt.io",
        "v1beta1",
        "VirtualMachineSnapshotContent",
        "virtualmachinesnapshotcontents",
    )
    .await;
    install_crd(
        &c,
        "snapshot.storage.k8s.io",
        "v1",
        "VolumeSnapshot",
        "volumesnapshots",
    )
    .await;
    let m = manager(&env);
    m.wait_ready().await;
    let [snaps, contents, vss] = snapshot_apis(&c, &ns);
    let src = |n: &str| json!({"apiGroup": "snapshot.kubevirt.io", "kind": "VirtualMachineSnapshot", "name": n});

    // not found: Skipped with both conditions
    create_export(&c, &ns, "none", src("nope"), None)
        .await
        .unwrap();
    let e = wait_phase(&c, &ns, "none", "Skipped", "VMSnapshotNotFound").await;
    let conds = e.status.unwrap().conditions.unwrap();
    let vc = conds.iter().find(|c| c.type_ == "VolumesCreated").unwrap();
    assert_eq!(
        (vc.status.as_str(), vc.reason.as_deref()),
        ("False", Some("VMSnapshotNoVolumes"))
    );

    create_dyn(&snaps, json!({"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshot",
        "metadata": {"name": "snap1"}, "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm1"}},
        "status": {"readyToUse": false}})).await;
    create_export(&c, &ns, "sx", src("snap1"), None)
        .await
        .unwrap();
    let e = wait_phase(&c, &ns, "sx", "Pending", "NotAllPVCsCreated").await;
    assert_eq!(
        e.status.as_ref().unwrap().virtual_machine_name.as_deref(),
        Some("vm1")
    );

    create_dyn(&vss, json!({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": {"name": "vs-root"}, "spec": {"source": {"persistentVolumeClaimName": "rootdisk"}},
        "status": {"restoreSize": "2Gi", "readyToUse": true}})).await;
    create_dyn(&contents, json!({"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshotContent",
        "metadata": {"name": "content1"},
        "spec": {
            "source": {"virtualMachine": {"spec": {"template": {"spec": {"volumes": [{"name": "root", "dataVolume": {"name": "rootdisk"}}]}}}}},
            "volumeBackups": [{"volumeName": "root", "volumeSnapshotName": "vs-root", "persistentVolumeClaim": {
                "metadata": {"name": "rootdisk", "labels": {"app": "db"}, "annotations": {"restore.kubevirt.io/name": "old"}},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, "volumeMode": "Filesystem", "storageClassName": "none"}}}],
        },
        "status": {"volumeSnapshotStatus": [{"volumeSnapshotName": "vs-root"}]}})).await;
    snaps.patch_status("snap1", &PatchParams::default(), &Patch::Merge(json!({"status": {"readyToUse": true, "virtualMachineSnapshotContentName": "content1"}}))).await.unwrap();

    let e = wait_phase(&c, &ns, "sx", "Pending", "PodPending").await;
    let vc = e
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "VolumesCreated")
        .unwrap();
    assert_eq!(
        vc.reason.as_deref(),
        Some("NotAllPVCsReady"),
        "the restore PVC is not Bound (no provisioner)"
    );
    let pvc = Api::<PersistentVolumeClaim>::namespaced(c.clone(), &ns)
        .get("sx-rootdisk")
        .await
        .unwrap();
    let uid = pvc.metadata.uid.clone();
    let spec = pvc.spec.clone().unwrap();
    let ds = spec.data_source.unwrap();
    assert_eq!(
        (ds.kind.as_str(), ds.name.as_str(), ds.api_group.as_deref()),
        ("VolumeSnapshot", "vs-root", Some("snapshot.storage.k8s.io"))
    );
    assert_eq!(
        spec.resources.unwrap().requests.unwrap()["storage"].0,
        "2Gi"
    );
    assert_eq!(pvc.labels()["app"], "db");
    assert_eq!(
        pvc.annotations()
            .get("cdi.kubevirt.io/storage.contentType")
            .map(String::as_str),
        Some("kubevirt")
    );
    assert!(!pvc.annotations().contains_key("restore.kubevirt.io/name"));
    assert_eq!(pvc.owner_references()[0].name, "sx");

    mark_pod(&c, &ns, "virt-export-sx", "Running", true).await;
    let e = wait_phase(&c, &ns, "sx", "Ready", "PodReady").await;
    let v = &e
        .status
        .unwrap()
        .links
        .unwrap()
        .internal
        .unwrap()
        .volumes
        .unwrap()[0];
    assert_eq!(
        v.name, "rootdisk",
        "the export prefix is stripped from the name"
    );
    assert_eq!(
        v.formats.as_ref().unwrap()[0].url,
        format!("https://virt-export-sx.{ns}.svc/volumes/sx-rootdisk/disk.img")
    );
    // the restore PVC is not re-created
    assert_eq!(
        Api::<PersistentVolumeClaim>::namespaced(c.clone(), &ns)
            .get("sx-rootdisk")
            .await
            .unwrap()
            .metadata
            .uid,
        uid
    );
}

#[tokio::test]
#[ignore = "e2e: needs the local control plane (make e2e)"]
async fn e11_without_kubevirt_crds_then_installed() {
    // A control plane of its own: the shared one gets the KubeVirt test CRDs from other tests.
    let own = tokio::task::spawn_blocking(Harness::start_own)
        .await
        .unwrap();
    let c = client_for(&own.kubeconfig).await;
    install_crds(&c).await;
    let ns = create_namespace(&c, "vmx-e11").await;
    let m = Manager::start(ManagerOpts::new(&own.kubeconfig, &ns).only("vmexport"));
    m.wait_ready().await;
    create_pvc(&c, &ns, "d", Some("kubevirt"), false).await;
    create_export(
        &c,
        &ns,
        "vmx",
        json!({"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm1"}),
        None,
    )
    .await
    .unwrap();
    create_export(&c, &ns, "pvcx", pvc_source("d"), None)
        .await
        .unwrap();
    let (_, _, msg) =
        ready_reason(&wait_phase(&c, &ns, "vmx", "Pending", "SourceAPINotInstalled").await);
    assert!(
        msg.contains("kubevirt.io") && msg.contains("VirtualMachine"),
        "{msg}"
    );
    wait_phase(&c, &ns, "pvcx", "Pending", "PodPending").await;
    // so is a template source without virt-template's API
    create_pvc(&c, &ns, "t", Some("kubevirt"), false).await;
    create_export(
        &c,
        &ns,
        "tplx",
        super::templates::template_source("t1"),
        None,
    )
    .await
    .unwrap();
    let (_, _, msg) =
        ready_reason(&wait_phase(&c, &ns, "tplx", "Pending", "SourceAPINotInstalled").await);
    assert!(
        msg.contains("template.kubevirt.io") && msg.contains("VirtualMachineTemplate"),
        "{msg}"
    );
    assert_eq!(
        m.readyz().await.map(|r| r.0),
        Some(200),
        "the manager stays healthy"
    );

    // the API appears: discovery (every 60 s) starts the watch and re-checks the export
    install_kubevirt_crds(&c).await;
    super::templates::install_template_crd(&c).await;
    create_vm(
        &c,
        &ns,
        "vm1",
        json!([{"name": "root", "persistentVolumeClaim": {"claimName": "d"}}]),
    )
    .await;
    super::templates::create_template(&c, &ns, "t1", "t").await;
    let start = Instant::now();
    for name in ["vmx", "tplx"] {
        loop {
            let (p, r, _) = ready_reason(&export(&c, &ns, name).await.unwrap());
            if (p.as_str(), r.as_str()) == ("Pending", "PodPending") {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(75),
                "{name} still {p}/{r} after the API appeared"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

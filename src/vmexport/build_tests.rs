use super::*;
use crate::conditions::{remove_kubevirt, set_kubevirt_condition};
use crate::vmexport::types::TypedLocalObjectReference;
use k8s_openapi::api::core::v1::{
    ContainerStatus, PersistentVolumeClaimSpec, PersistentVolumeClaimStatus, PodStatus,
};

fn export(name: &str) -> VirtualMachineExport {
    let mut e = VirtualMachineExport::new(
        name,
        VirtualMachineExportSpec {
            source: TypedLocalObjectReference {
                api_group: None,
                kind: "PersistentVolumeClaim".into(),
                name: "disk".into(),
            },
            ..Default::default()
        },
    );
    e.metadata.namespace = Some("ns1".into());
    e.metadata.uid = Some("uid-1".into());
    e.metadata.labels = Some(BTreeMap::from([("team".to_string(), "a".to_string())]));
    e.metadata.annotations = Some(BTreeMap::from([("note".to_string(), "x".to_string())]));
    e
}

fn pvc(name: &str, block: bool, ann: Option<&str>, phase: &str) -> PersistentVolumeClaim {
    let mut p = PersistentVolumeClaim::default();
    p.metadata.name = Some(name.into());
    p.metadata.namespace = Some("ns1".into());
    if let Some(a) = ann {
        p.metadata.annotations = Some(BTreeMap::from([(
            ANN_CONTENT_TYPE.to_string(),
            a.to_string(),
        )]));
    }
    p.spec = Some(PersistentVolumeClaimSpec {
        volume_mode: Some(if block { "Block" } else { "Filesystem" }.into()),
        ..Default::default()
    });
    p.status = Some(PersistentVolumeClaimStatus {
        phase: Some(phase.into()),
        ..Default::default()
    });
    p
}

fn dv_owned(mut p: PersistentVolumeClaim) -> PersistentVolumeClaim {
    p.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "cdi.kubevirt.io/v1beta1".into(),
        kind: "DataVolume".into(),
        name: p.name_any(),
        uid: "dv".into(),
        controller: Some(true),
        block_owner_deletion: None,
    }]);
    p
}

fn user_pod(claim: &str, phase: &str, owner_uid: Option<&str>) -> Pod {
    let mut p = Pod::default();
    p.metadata.name = Some(format!("user-{phase}"));
    if let Some(uid) = owner_uid {
        p.metadata.owner_references = Some(vec![OwnerReference {
            api_version: OWNER_API_VERSION.into(),
            kind: KIND.into(),
            name: "x".into(),
            uid: uid.into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
    }
    p.spec = Some(PodSpec {
        volumes: Some(vec![Volume {
            name: "d".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.into(),
                read_only: None,
            }),
            ..Default::default()
        }]),
        ..Default::default()
    });
    p.status = Some(PodStatus {
        phase: Some(phase.into()),
        ..Default::default()
    });
    p
}

fn now() -> Time {
    Time("2026-01-01T00:00:00Z".parse().unwrap())
}

fn envs(pod: &Pod) -> BTreeMap<String, String> {
    pod.spec.as_ref().unwrap().containers[0]
        .env
        .as_ref()
        .unwrap()
        .iter()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect()
}

fn input<'a>(e: &'a VirtualMachineExport, vols: &'a [ExportVolume], vm: bool) -> PodInput<'a> {
    PodInput {
        export: e,
        volumes: vols,
        token_secret: "export-token-e1",
        cert_secret: "export-cert-e1",
        deadline: "2026-01-01T02:00:00Z".parse().unwrap(),
        vm_manifest: vm,
    }
}

#[test]
fn token_secret_refs_that_cannot_name_a_secret() {
    let mut spec = export("e").spec;
    assert_eq!(token_secret_ref_problem(&spec), None);
    for ok in ["secret-e1", "a.b-c", &"s".repeat(253)] {
        spec.token_secret_ref = Some(ok.into());
        assert_eq!(token_secret_ref_problem(&spec), None, "{ok}");
    }
    for bad in ["", "Bad_Name", "a/b", "-a", "a..b", &"s".repeat(254)] {
        spec.token_secret_ref = Some(bad.into());
        let m = token_secret_ref_problem(&spec).unwrap_or_else(|| panic!("{bad:?}"));
        assert!(m.contains("is not a valid Secret name"), "{m}");
        assert!(m.contains("delete this export"), "{m}");
    }
}

#[test]
fn classify_sources() {
    let mut spec = export("e").spec;
    assert_eq!(classify_source(&spec), SourceKind::Pvc);
    spec.source.api_group = Some(String::new());
    assert_eq!(classify_source(&spec), SourceKind::Pvc);
    spec.source.kind = "VirtualMachine".into();
    spec.source.api_group = Some("kubevirt.io".into());
    assert_eq!(classify_source(&spec), SourceKind::VirtualMachine);
    spec.source.api_group = Some("foo.io".into());
    assert_eq!(classify_source(&spec), SourceKind::Unsupported);
    spec.source.kind = "VirtualMachineSnapshot".into();
    spec.source.api_group = Some("snapshot.kubevirt.io".into());
    assert_eq!(classify_source(&spec), SourceKind::VirtualMachineSnapshot);
    spec.source.kind = "Pod".into();
    spec.source.api_group = None;
    assert_eq!(classify_source(&spec), SourceKind::Unsupported);
    let msg = unsupported_source_message(&spec);
    assert!(
        msg.contains("\"Pod\"") && msg.contains("core") && msg.contains("VirtualMachineSnapshot")
    );
}

#[test]
fn ttl_default_invalid_and_expiry() {
    let mut spec = export("e").spec;
    assert_eq!(ttl_duration(&spec), (DEFAULT_TTL, None));
    spec.ttl_duration = Some("90m".into());
    assert_eq!(ttl_duration(&spec).0, Duration::from_secs(5400));
    spec.ttl_duration = Some("banana".into());
    let (d, warn) = ttl_duration(&spec);
    assert_eq!(d, DEFAULT_TTL);
    assert!(warn.unwrap().contains("banana"));

    let created: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
    let exp = ttl_expiration(created, Duration::from_secs(10));
    assert_eq!(exp.to_string(), "2026-01-01T00:00:10Z");
    let t: jiff::Timestamp = "2026-01-01T00:00:04Z".parse().unwrap();
    assert_eq!(until_expiry(t, exp), Some(Duration::from_secs(6)));
    assert_eq!(until_expiry(exp, exp), None);
    assert_eq!(
        until_expiry("2026-01-02T00:00:00Z".parse().unwrap(), exp),
        None
    );
}

#[test]
fn condition_transition_time_moves_only_on_change() {
    let t0 = now();
    let t1 = Time("2026-01-01T00:05:00Z".parse().unwrap());
    let mut conds = Vec::new();
    assert!(set_kubevirt_condition(
        &mut conds,
        condition(COND_PVC_READY, false, REASON_PVC_PENDING, ""),
        &t0
    ));
    assert!(set_kubevirt_condition(
        &mut conds,
        condition(COND_READY, false, REASON_INITIALIZING, ""),
        &t0
    ));
    assert_eq!(conds[0].type_, COND_READY, "Ready comes first");
    // same content: no change, time kept
    assert!(!set_kubevirt_condition(
        &mut conds,
        condition(COND_READY, false, REASON_INITIALIZING, ""),
        &t1
    ));
    assert_eq!(conds[0].last_transition_time, Some(t0.clone()));
    // message change alone moves the time (KubeVirt mode)
    assert!(set_kubevirt_condition(
        &mut conds,
        condition(COND_READY, false, REASON_INITIALIZING, "m"),
        &t1
    ));
    assert_eq!(conds[0].last_transition_time, Some(t1.clone()));
    assert!(conds.iter().all(|c| c.last_probe_time.is_none()));
    assert!(remove_kubevirt(&mut conds, COND_PVC_READY));
    assert_eq!(conds.len(), 1);
}

#[test]
fn reasons_are_camel_case() {
    let re = |s: &str| {
        let b = s.as_bytes();
        !b.is_empty()
            && b[0].is_ascii_alphabetic()
            && b.iter().all(|c| c.is_ascii_alphanumeric())
            && s.len() <= 1024
    };
    for r in ALL_REASONS {
        assert!(re(r), "{r}");
    }
}

#[test]
fn content_type_detection() {
    // annotation decides
    assert!(is_kubevirt_content(
        &pvc("a", false, Some("kubevirt"), "Bound"),
        None
    ));
    assert!(is_kubevirt_content(
        &pvc("a", false, Some(""), "Bound"),
        None
    ));
    assert!(!is_kubevirt_content(
        &pvc("a", false, Some("archive"), "Bound"),
        Some("kubevirt")
    ));
    // no annotation: owning DataVolume's content type
    let owned = dv_owned(pvc("a", false, None, "Bound"));
    assert!(is_kubevirt_content(&owned, Some("kubevirt")));
    assert!(is_kubevirt_content(&owned, Some("")));
    assert!(!is_kubevirt_content(&owned, Some("archive")));
    // plain PVC: archive
    assert!(!is_kubevirt_content(&pvc("a", false, None, "Bound"), None));
}

#[test]
fn populated_rules() {
    assert!(is_populated(&pvc("a", false, None, "Pending"), None));
    let owned = dv_owned(pvc("a", false, None, "Bound"));
    assert!(is_populated(&owned, Some("Succeeded")));
    assert!(!is_populated(&owned, Some("ImportInProgress")));
    assert!(
        is_populated(&owned, None),
        "no DataVolume API: counts as populated"
    );
}

#[test]
fn pvc_ready_condition() {
    let c = pvc_condition("ns1", "d", Some(&pvc("d", false, None, "Bound")));
    assert_eq!(
        (c.status.as_str(), c.reason.as_deref()),
        ("True", Some(REASON_PVC_BOUND))
    );
    let c = pvc_condition("ns1", "d", Some(&pvc("d", false, None, "Pending")));
    assert_eq!(
        (c.status.as_str(), c.reason.as_deref()),
        ("False", Some(REASON_PVC_PENDING))
    );
    let c = pvc_condition("ns1", "d", Some(&pvc("d", false, None, "Lost")));
    assert_eq!(
        (c.status.as_str(), c.reason.as_deref()),
        ("False", Some(REASON_UNKNOWN))
    );
    let c = pvc_condition("ns1", "d", None);
    assert_eq!(c.reason.as_deref(), Some(REASON_PVC_NOT_FOUND));
    assert_eq!(
        c.message.as_deref(),
        Some("PersistentVolumeClaim ns1/d not found")
    );
}

#[test]
fn in_use_detection() {
    let running = user_pod("d", "Running", None);
    let pending = user_pod("d", "Pending", None);
    let succeeded = user_pod("d", "Succeeded", None);
    let failed = user_pod("d", "Failed", None);
    let own = user_pod("d", "Running", Some("uid-1"));
    let other_export = user_pod("d", "Running", Some("uid-2"));
    let other_claim = user_pod("other", "Running", None);
    assert!(pvc_in_use([&running], "d", "uid-1").is_some());
    assert!(pvc_in_use([&pending], "d", "uid-1").is_some());
    assert!(pvc_in_use([&succeeded, &failed, &own, &other_claim], "d", "uid-1").is_none());
    assert!(pvc_in_use([&other_export], "d", "uid-1").is_some());
}

#[test]
fn pod_states_map_to_phases() {
    let mut p = user_pod("d", "Pending", None);
    assert_eq!(phase_from_pod(pod_state(&p), "p").0, PHASE_PENDING);
    p.status.as_mut().unwrap().phase = Some("Running".into());
    p.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
        ready: false,
        ..Default::default()
    }]);
    let (phase, c) = phase_from_pod(pod_state(&p), "p");
    assert_eq!(
        (phase, c.reason.as_deref()),
        (PHASE_PENDING, Some(REASON_UNKNOWN))
    );
    assert!(c.message.unwrap().contains("/exportready"));
    p.status
        .as_mut()
        .unwrap()
        .container_statuses
        .as_mut()
        .unwrap()[0]
        .ready = true;
    let (phase, c) = phase_from_pod(pod_state(&p), "p");
    assert_eq!(
        (phase, c.status.as_str(), c.reason.as_deref()),
        (PHASE_READY, "True", Some(REASON_POD_READY))
    );
    p.status.as_mut().unwrap().phase = Some("Succeeded".into());
    assert_eq!(phase_from_pod(pod_state(&p), "p").0, PHASE_TERMINATED);
    p.status.as_mut().unwrap().phase = Some("Failed".into());
    assert_eq!(
        phase_from_pod(pod_state(&p), "p").1.reason.as_deref(),
        Some(REASON_UNKNOWN)
    );
}

#[test]
fn token_is_long_alphanumeric_and_random() {
    let a = generate_token(TOKEN_LENGTH);
    let b = generate_token(TOKEN_LENGTH);
    assert_eq!(a.len(), 32);
    assert!(a.bytes().all(|c| c.is_ascii_alphanumeric()));
    assert_ne!(a, b);
    let s = build_token_secret(&export("e1"), "export-token-e1", &a);
    assert_eq!(s.type_.as_deref(), Some("Opaque"));
    assert_eq!(s.data.unwrap()["token"].0, a.as_bytes());
    assert_eq!(
        s.metadata.owner_references.unwrap()[0].controller,
        Some(true)
    );
}

#[test]
fn service_render() {
    let svc = build_service(&export("my.exp"));
    assert_eq!(svc.metadata.name.as_deref(), Some("virt-export-my-exp"));
    let labels = svc.metadata.labels.unwrap();
    assert_eq!(labels["kubevirt.io"], "virt-exporter");
    assert_eq!(labels["team"], "a");
    assert_eq!(svc.metadata.annotations.unwrap()["note"], "x");
    let spec = svc.spec.unwrap();
    assert_eq!(spec.selector.unwrap()[EXPORT_SERVICE_LABEL], "my.exp");
    let port = &spec.ports.unwrap()[0];
    assert_eq!(
        (port.port, port.target_port.clone()),
        (443, Some(IntOrString::Int(8443)))
    );
    let owner = &svc.metadata.owner_references.unwrap()[0];
    assert_eq!(owner.api_version, "export.kubevirt.io/v1");
    assert_eq!(owner.block_owner_deletion, Some(true));
}

#[test]
fn pod_render_pvc_source() {
    let e = export("e1");
    let vols = vec![
        ExportVolume {
            pvc: "disk".into(),
            block: false,
            kubevirt_content: true,
        },
        ExportVolume {
            pvc: "blk".into(),
            block: true,
            kubevirt_content: true,
        },
        ExportVolume {
            pvc: "files".into(),
            block: false,
            kubevirt_content: false,
        },
    ];
    let pod = build_pod(&input(&e, &vols, false), &PodSettings::default());
    assert_eq!(pod.metadata.name.as_deref(), Some("virt-export-e1"));
    assert_eq!(
        pod.metadata.labels.as_ref().unwrap()[EXPORT_SERVICE_LABEL],
        "e1"
    );
    let ann = pod.metadata.annotations.as_ref().unwrap();
    assert_eq!(
        ann[ANN_CERT_PARAMS],
        "{\"Duration\":86400000000000,\"RenewBefore\":17280000000000}"
    );
    assert_eq!(ann["note"], "x");
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let psc = spec.security_context.as_ref().unwrap();
    assert_eq!(
        (psc.run_as_non_root, psc.run_as_user, psc.fs_group),
        (Some(true), Some(107), Some(107))
    );
    let c = &spec.containers[0];
    assert_eq!(c.name, "exporter");
    assert_eq!(c.command.as_deref(), Some(&["ucm".to_string()][..]));
    assert_eq!(c.args.as_deref(), Some(&["export-server".to_string()][..]));
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_string()][..])
    );
    let res = c.resources.as_ref().unwrap();
    assert_eq!(res.requests.as_ref().unwrap()["cpu"].0, "100m");
    assert_eq!(res.limits.as_ref().unwrap()["memory"].0, "1024Mi");
    let probe = c.readiness_probe.as_ref().unwrap();
    assert_eq!(
        probe.http_get.as_ref().unwrap().path.as_deref(),
        Some("/exportready")
    );
    assert_eq!(
        probe.http_get.as_ref().unwrap().scheme.as_deref(),
        Some("HTTPS")
    );
    assert!(c.liveness_probe.is_none());

    // volumes: block via volumeDevice, filesystem read-only mounts, cert and token read-only
    let devs = c.volume_devices.as_ref().unwrap();
    assert_eq!(devs[0].device_path, "/dev/export-volumes/v1-blk");
    let mounts = c.volume_mounts.as_ref().unwrap();
    assert!(mounts.iter().all(|m| m.read_only == Some(true)));
    assert!(
        mounts
            .iter()
            .any(|m| m.mount_path == "/export-volumes/v0-disk")
    );
    assert!(mounts.iter().any(|m| m.mount_path == "/cert"));
    assert!(mounts.iter().any(|m| m.mount_path == "/token"));
    let vnames: Vec<_> = spec
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .map(|v| v.name.clone())
        .collect();
    assert_eq!(
        vnames,
        ["v0-disk", "v1-blk", "v2-files", "certificates", "token"]
    );
    let token_vol = &spec.volumes.as_ref().unwrap()[4];
    assert_eq!(
        token_vol.secret.as_ref().unwrap().secret_name.as_deref(),
        Some("export-token-e1")
    );

    let env = envs(&pod);
    assert_eq!(env["VOLUME0_EXPORT_PATH"], "/export-volumes/v0-disk");
    assert_eq!(env["VOLUME0_EXPORT_RAW_URI"], "/volumes/disk/disk.img");
    assert_eq!(
        env["VOLUME0_EXPORT_RAW_GZIP_URI"],
        "/volumes/disk/disk.img.gz"
    );
    assert_eq!(env["VOLUME1_EXPORT_PATH"], "/dev/export-volumes/v1-blk");
    assert_eq!(
        env["VOLUME2_EXPORT_ARCHIVE_URI"],
        "/volumes/files/disk.tar.gz"
    );
    assert_eq!(env["VOLUME2_EXPORT_DIR_URI"], "/volumes/files/dir/");
    assert!(!env.contains_key("VOLUME2_EXPORT_RAW_URI"));
    assert_eq!(env["CERT_FILE"], "/cert/tls.crt");
    assert_eq!(env["KEY_FILE"], "/cert/tls.key");
    assert_eq!(env["TOKEN_FILE"], "/token/token");
    assert_eq!(env["DEADLINE"], "2026-01-01T02:00:00Z");
    assert_eq!(env["EXPORT_SECRET_DEF_URI"], "/manifests/secret");
    assert_eq!(env["EXPORT_NAME"], "e1");
    // No VM manifest for PVC sources, no TLS variables without flags
    assert!(!env.contains_key("EXPORT_VM_DEF_URI"));
    assert!(!env.contains_key("TLS_MIN_VERSION") && !env.contains_key("TLS_CIPHER_SUITES"));
    let pod_name_env = &spec.containers[0].env.as_ref().unwrap()[0];
    assert_eq!(pod_name_env.name, "POD_NAME");
    assert_eq!(
        pod_name_env
            .value_from
            .as_ref()
            .unwrap()
            .field_ref
            .as_ref()
            .unwrap()
            .field_path,
        "metadata.name"
    );
}

#[test]
fn pod_render_vm_source_and_tls_flags() {
    let e = export("e1");
    let vols = vec![ExportVolume {
        pvc: "disk".into(),
        block: false,
        kubevirt_content: true,
    }];
    let settings = PodSettings {
        tls_min_version: Some("772".into()),
        tls_cipher_suites: Some("[4865]".into()),
        ..Default::default()
    };
    let pod = build_pod(&input(&e, &vols, true), &settings);
    let env = envs(&pod);
    assert_eq!(env["EXPORT_VM_DEF_URI"], "/manifests/all");
    assert_eq!(env["TLS_MIN_VERSION"], "772");
    assert_eq!(env["TLS_CIPHER_SUITES"], "[4865]");
    let spec = pod.spec.unwrap();
    let cm = spec
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == "manifest-data")
        .unwrap();
    assert_eq!(cm.config_map.unwrap().name, "exporter-vm-manifest-e1");
}

#[test]
fn colliding_claim_names_get_unique_pod_volumes() {
    // kubevirt#19020: my.disk and my-disk sanitise alike; two disks on one claim appear once.
    let e = export("e1");
    let vols = dedup_volumes(vec![
        ExportVolume {
            pvc: "my.disk".into(),
            block: false,
            kubevirt_content: true,
        },
        ExportVolume {
            pvc: "my-disk".into(),
            block: false,
            kubevirt_content: true,
        },
        ExportVolume {
            pvc: "my.disk".into(),
            block: false,
            kubevirt_content: true,
        },
    ]);
    assert_eq!(vols.len(), 2);
    let pod = build_pod(&input(&e, &vols, true), &PodSettings::default());
    let names: Vec<_> = pod
        .spec
        .unwrap()
        .volumes
        .unwrap()
        .into_iter()
        .map(|v| v.name)
        .collect();
    let unique: std::collections::HashSet<_> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    assert!(names.iter().all(|n| n.len() <= 63));
}

fn ready_pod(vols: &[ExportVolume], vm: bool) -> Pod {
    let e = export("e1");
    let mut pod = build_pod(&input(&e, vols, vm), &PodSettings::default());
    pod.status = Some(PodStatus {
        phase: Some("Running".into()),
        container_statuses: Some(vec![ContainerStatus {
            ready: true,
            ..Default::default()
        }]),
        ..Default::default()
    });
    pod
}

fn link_settings() -> LinkSettings {
    LinkSettings {
        namespace: "ns1".into(),
        export_name: "e1".into(),
        service_name: "virt-export-e1".into(),
        internal_cert: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
        ..Default::default()
    }
}

#[test]
fn links_internal_shapes() {
    let vols = vec![
        ExportVolume {
            pvc: "disk.v1".into(),
            block: false,
            kubevirt_content: true,
        },
        ExportVolume {
            pvc: "files".into(),
            block: false,
            kubevirt_content: false,
        },
    ];
    let links = links_from_pod(&ready_pod(&vols, false), &link_settings());
    assert!(links.external.is_none());
    let int = links.internal.unwrap();
    assert_eq!(
        int.cert,
        "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
    );
    let v = int.volumes.unwrap();
    assert_eq!(v[0].name, "disk.v1");
    let f: Vec<_> = v[0]
        .formats
        .clone()
        .unwrap()
        .into_iter()
        .map(|f| (f.format, f.url))
        .collect();
    assert_eq!(
        f,
        [
            (
                "raw".to_string(),
                "https://virt-export-e1.ns1.svc/volumes/disk.v1/disk.img".to_string()
            ),
            (
                "gzip".to_string(),
                "https://virt-export-e1.ns1.svc/volumes/disk.v1/disk.img.gz".to_string()
            ),
        ]
    );
    let f: Vec<_> = v[1]
        .formats
        .clone()
        .unwrap()
        .into_iter()
        .map(|f| (f.format, f.url))
        .collect();
    assert_eq!(
        f,
        [
            (
                "dir".to_string(),
                "https://virt-export-e1.ns1.svc/volumes/files/dir".to_string()
            ),
            (
                "tar.gz".to_string(),
                "https://virt-export-e1.ns1.svc/volumes/files/disk.tar.gz".to_string()
            ),
        ]
    );
    let m = int.manifests.unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].type_, "auth-header-secret");
    assert_eq!(
        m[0].url,
        "https://virt-export-e1.ns1.svc/internal/manifests/secret"
    );
}

#[test]
fn links_external_and_snapshot_prefix() {
    let vols = vec![ExportVolume {
        pvc: "e1-rootdisk".into(),
        block: true,
        kubevirt_content: true,
    }];
    let mut s = link_settings();
    s.external_host = Some("proxy.example.com:8443".into());
    s.external_cert = "EXTCA\n".into();
    s.strip_prefix = Some("e1".into());
    let links = links_from_pod(&ready_pod(&vols, true), &s);
    let ext = links.external.unwrap();
    assert_eq!(ext.cert, "EXTCA");
    let v = &ext.volumes.as_ref().unwrap()[0];
    assert_eq!(v.name, "rootdisk");
    assert_eq!(
        v.formats.as_ref().unwrap()[0].url,
        "https://proxy.example.com:8443/api/export.kubevirt.io/v1/namespaces/ns1/virtualmachineexports/e1/volumes/e1-rootdisk/disk.img"
    );
    let m = ext.manifests.unwrap();
    assert_eq!(m[0].type_, "all");
    assert!(
        m[0].url
            .ends_with("/virtualmachineexports/e1/external/manifests/all")
    );
    assert!(m[1].url.ends_with("/external/manifests/secret"));
    let int = links.internal.unwrap();
    assert_eq!(
        int.manifests.unwrap()[0].url,
        "https://virt-export-e1.ns1.svc/internal/manifests/all"
    );
}

#[test]
fn links_follow_numeric_index_order() {
    let vols: Vec<_> = (0..12)
        .map(|i| ExportVolume {
            pvc: format!("d{i}"),
            block: false,
            kubevirt_content: true,
        })
        .collect();
    let links = links_from_pod(&ready_pod(&vols, false), &link_settings());
    let names: Vec<_> = links
        .internal
        .unwrap()
        .volumes
        .unwrap()
        .into_iter()
        .map(|v| v.name)
        .collect();
    let want: Vec<_> = (0..12).map(|i| format!("d{i}")).collect();
    assert_eq!(names, want);
}

#[test]
fn deadline_is_min_of_cert_and_ttl() {
    let na: jiff::Timestamp = "2026-01-02T00:00:00Z".parse().unwrap();
    let ttl: jiff::Timestamp = "2026-01-01T02:00:00Z".parse().unwrap();
    assert_eq!(deadline(na, Duration::from_secs(3600), ttl), ttl);
    let ttl_far: jiff::Timestamp = "2026-02-01T00:00:00Z".parse().unwrap();
    assert_eq!(
        deadline(na, Duration::from_secs(3600), ttl_far).to_string(),
        "2026-01-01T23:00:00Z"
    );
}

#[test]
fn initial_status_is_pending_initializing() {
    let st = initial_status("2026-01-01T02:00:00Z".parse().unwrap(), &now());
    assert_eq!(st.phase.as_deref(), Some(PHASE_PENDING));
    let c = &st.conditions.as_ref().unwrap()[0];
    assert_eq!(
        (c.type_.as_str(), c.reason.as_deref()),
        ("Ready", Some(REASON_INITIALIZING))
    );
    assert_eq!(
        st.ttl_expiration_time.unwrap().0.to_string(),
        "2026-01-01T02:00:00Z"
    );
    assert!(st.links.is_none());
}

#[test]
fn manifest_configmap_cleans_the_vm_and_adds_datavolumes() {
    let e = export("e1");
    let vm = serde_json::json!({
        "metadata": {"name": "vm1", "namespace": "ns1", "labels": {"a": "b"}, "managedFields": [{}], "resourceVersion": "7", "uid": "x"},
        "spec": {
            "dataVolumeTemplates": [{"metadata": {"name": "root"}, "spec": {"sourceRef": {"kind": "DataSource", "name": "fedora"}}}],
            "template": {"spec": {"volumes": [
                {"name": "r", "dataVolume": {"name": "root"}},
                {"name": "d", "persistentVolumeClaim": {"claimName": "data"}},
                {"name": "c", "cloudInitNoCloud": {}},
            ]}},
        },
        "status": {"ready": true},
    });
    let claims = BTreeMap::from([(
        "data".to_string(),
        serde_json::from_value(serde_json::json!({
            "accessModes": ["ReadWriteMany"], "volumeMode": "Block",
            "resources": {"requests": {"storage": "5Gi"}},
        }))
        .unwrap(),
    )]);
    let cm = build_manifest_configmap(&ManifestInput {
        export: &e,
        vm: &vm,
        claims: &claims,
        internal_cert: "CA\n",
        external_host: Some("proxy:443"),
        external_cert: "EXT",
        volume_prefix: None,
    })
    .unwrap();
    assert_eq!(cm.metadata.name.as_deref(), Some("exporter-vm-manifest-e1"));
    let d = cm.data.unwrap();
    assert_eq!(d["internal_host"], "https://virt-export-e1.ns1.svc");
    assert_eq!(d["internal_ca_cm"], "CA");
    assert_eq!(
        d["external_host"],
        "https://proxy:443/api/export.kubevirt.io/v1/namespaces/ns1/virtualmachineexports/e1"
    );
    assert_eq!(d["export-name"], "e1");
    let vmj: serde_json::Value = serde_json::from_str(&d["virtualmachine-manifest"]).unwrap();
    assert!(vmj.get("status").is_none());
    assert!(vmj["metadata"].get("managedFields").is_none() && vmj["metadata"].get("uid").is_none());
    assert_eq!(vmj["metadata"]["labels"]["a"], "b");
    assert!(
        !d.contains_key("dv-root"),
        "templates are not duplicated as DataVolumes"
    );
    let dv: serde_json::Value = serde_json::from_str(&d["dv-data"]).unwrap();
    // KubeVirt copies access modes, volume mode and size, and sets the namespace.
    assert_eq!(
        dv,
        serde_json::json!({
            "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
            "metadata": {"name": "data", "namespace": "ns1"},
            "spec": {"storage": {
                "accessModes": ["ReadWriteMany"], "volumeMode": "Block",
                "resources": {"requests": {"storage": "5Gi"}},
            }},
        })
    );
    // instancetypes must be expanded first
    let mut it = vm.clone();
    it["spec"]["instancetype"] = serde_json::json!({"name": "u1.small"});
    assert!(
        build_manifest_configmap(&ManifestInput {
            export: &e,
            vm: &it,
            claims: &claims,
            internal_cert: "",
            external_host: None,
            external_cert: "",
            volume_prefix: None
        })
        .is_err()
    );
}

#[test]
fn expand_spec_only_for_instancetypes_and_preferences() {
    let plain = serde_json::json!({"spec": {"template": {"spec": {}}}});
    assert!(!needs_expansion(&plain));
    let mut it = plain.clone();
    it["spec"]["instancetype"] = serde_json::json!({"name": "u1.small"});
    assert!(needs_expansion(&it));
    let mut pref = plain.clone();
    pref["spec"]["preference"] = serde_json::json!({"name": "fedora"});
    assert!(needs_expansion(&pref));
    let mut null = plain.clone();
    null["spec"]["instancetype"] = serde_json::Value::Null;
    assert!(!needs_expansion(&null));
}

#[test]
fn expand_request_by_name_for_vms_and_by_body_for_snapshots() {
    let vm = serde_json::json!({"metadata": {"name": "vm1"}, "spec": {"instancetype": {"name": "u1.small", "revisionName": "r1"}}});
    let r = expand_request("ns1", SourceKind::VirtualMachine, "vm1", &vm).unwrap();
    assert_eq!(r.method(), http::Method::GET);
    assert_eq!(
        r.uri().path(),
        "/apis/subresources.kubevirt.io/v1/namespaces/ns1/virtualmachines/vm1/expand-spec"
    );
    assert!(r.body().is_empty());
    // a snapshot's copy carries no apiVersion/kind; the endpoint needs a whole object
    let copy =
        serde_json::json!({"spec": {"instancetype": {"name": "u1.small", "revisionName": "r1"}}});
    let r = expand_request("ns1", SourceKind::VirtualMachineSnapshot, "vm1", &copy).unwrap();
    assert_eq!(r.method(), http::Method::PUT);
    assert_eq!(
        r.uri().path(),
        "/apis/subresources.kubevirt.io/v1/namespaces/ns1/expand-vm-spec"
    );
    let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
    assert_eq!(body["apiVersion"], "kubevirt.io/v1");
    assert_eq!(body["kind"], "VirtualMachine");
    assert_eq!(body["metadata"]["name"], "vm1");
    assert_eq!(body["metadata"]["namespace"], "ns1");
    assert_eq!(body["spec"], copy["spec"], "the spec is sent as captured");
}

#[test]
fn a_service_of_another_export_is_a_conflict() {
    // `a.b` and `a-b` map to the same Service name (upstream's naming).
    let mut first = export("a.b");
    first.metadata.uid = Some("uid-first".into());
    let mut second = export("a-b");
    second.metadata.uid = Some("uid-second".into());
    assert_eq!(
        crate::vmexport::naming::service_name("a.b"),
        crate::vmexport::naming::service_name("a-b")
    );
    let svc = build_service(&first);
    assert_eq!(service_conflict(&svc, &first), None);
    let msg = service_conflict(&svc, &second).unwrap();
    assert!(
        msg.contains("virt-export-a-b") && msg.contains("a.b"),
        "{msg}"
    );
    let mut orphan = svc.clone();
    orphan.metadata.owner_references = None;
    assert!(service_conflict(&orphan, &first).is_some());
}

#[test]
fn external_host_from_the_proxy_ingress() {
    use k8s_openapi::api::networking::v1::Ingress;
    let ing = |name: &str, spec: serde_json::Value| -> Ingress {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}, "spec": spec}))
            .unwrap()
    };
    let other = ing(
        "a-other",
        serde_json::json!({"rules": [{"host": "other.example", "http": {"paths": [{"path": "/", "pathType": "Prefix",
            "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}),
    );
    let by_path = ing(
        "b-proxy",
        serde_json::json!({
        "tls": [{"hosts": ["x.example"], "secretName": "x-tls"}, {"hosts": ["vmexport.example"], "secretName": "proxy-tls"}],
        "rules": [
            {"host": "web.example", "http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}},
            {"host": "vmexport.example", "http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "ucm-export-proxy", "port": {"number": 443}}}}]}},
        ]}),
    );
    let default_backend = ing(
        "c-default",
        serde_json::json!({"defaultBackend": {"service": {"name": "ucm-export-proxy", "port": {"number": 443}}},
            "rules": [{"host": "d.example"}]}),
    );
    assert_eq!(external_from_ingresses([&other], "ucm-export-proxy"), None);
    assert_eq!(
        external_from_ingresses([&other, &by_path], "ucm-export-proxy"),
        Some((
            "vmexport.example".to_string(),
            Some("proxy-tls".to_string())
        ))
    );
    assert_eq!(
        external_from_ingresses([&default_backend], "ucm-export-proxy"),
        Some(("d.example".to_string(), None))
    );
    // several: the first by name
    assert_eq!(
        external_from_ingresses([&default_backend, &by_path], "ucm-export-proxy")
            .unwrap()
            .0,
        "vmexport.example"
    );
    let secret = |data: serde_json::Value| -> k8s_openapi::api::core::v1::Secret {
        serde_json::from_value(serde_json::json!({"data": data})).unwrap()
    };
    use base64::Engine;
    let b = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let chain = "-----BEGIN CERTIFICATE-----\nLEAF\n-----END CERTIFICATE-----\n-----BEGIN CERTIFICATE-----\nISSUER\n-----END CERTIFICATE-----\n";
    assert_eq!(
        ingress_ca(&secret(serde_json::json!({"tls.crt": b(chain)}))),
        "-----BEGIN CERTIFICATE-----\nISSUER\n-----END CERTIFICATE-----"
    );
    assert_eq!(
        ingress_ca(&secret(
            serde_json::json!({"tls.crt": b(chain), "ca.crt": b("CA\n")})
        )),
        "CA"
    );
}

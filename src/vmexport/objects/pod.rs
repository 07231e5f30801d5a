//! The export pod (docs/vmexport.md, "Export pod", "Sources", "Certificates"): the volumes it
//! serves and their environment, the manager's settings that shape it, the pod itself and its
//! DEADLINE.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource,
    HTTPGetAction, ObjectFieldSelector, PersistentVolumeClaim, PersistentVolumeClaimVolumeSource,
    Pod, PodSecurityContext, PodSpec, Probe, ResourceRequirements, SeccompProfile,
    SecretVolumeSource, SecurityContext, Volume, VolumeDevice, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;

use crate::runtime::meta::controller_ref;
use crate::vmexport::api::*;
use crate::vmexport::naming;
use crate::vmexport::sources::pvc::{is_block, is_kubevirt_content};
use crate::vmexport::types::VirtualMachineExport;

/// One volume the pod serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportVolume {
    /// Claim mounted by the pod (for snapshot sources, the restore PVC).
    pub pvc: String,
    pub block: bool,
    pub kubevirt_content: bool,
}

impl ExportVolume {
    pub fn from_pvc(pvc: &PersistentVolumeClaim, dv_content_type: Option<&str>) -> Self {
        ExportVolume {
            pvc: pvc.name_any(),
            block: is_block(pvc),
            kubevirt_content: is_kubevirt_content(pvc, dv_content_type),
        }
    }
}

/// Deduplicates by claim name, keeping first occurrence order ("Names", rule 4).
pub fn dedup_volumes(vols: Vec<ExportVolume>) -> Vec<ExportVolume> {
    let mut seen = std::collections::HashSet::new();
    vols.into_iter()
        .filter(|v| seen.insert(v.pvc.clone()))
        .collect()
}

fn env(name: impl Into<String>, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    }
}

/// `VOLUME<i>_*` variables of one volume.
pub fn volume_env(i: usize, v: &ExportVolume) -> Vec<EnvVar> {
    let podvol = naming::pod_volume_name(i, &v.pvc);
    let path = if v.block {
        format!("{BLOCK_MOUNT_PATH}/{podvol}")
    } else {
        format!("{FS_MOUNT_PATH}/{podvol}")
    };
    let base = format!("/volumes/{}", v.pvc);
    let mut out = vec![env(format!("VOLUME{i}_EXPORT_PATH"), path)];
    if v.block || v.kubevirt_content {
        out.push(env(
            format!("VOLUME{i}_EXPORT_RAW_URI"),
            format!("{base}/disk.img"),
        ));
        out.push(env(
            format!("VOLUME{i}_EXPORT_RAW_GZIP_URI"),
            format!("{base}/disk.img.gz"),
        ));
    } else {
        out.push(env(
            format!("VOLUME{i}_EXPORT_ARCHIVE_URI"),
            format!("{base}/disk.tar.gz"),
        ));
        out.push(env(
            format!("VOLUME{i}_EXPORT_DIR_URI"),
            format!("{base}/dir/"),
        ));
    }
    out
}

/// Manager settings that shape the export pod ("Settings").
#[derive(Clone, Debug)]
pub struct PodSettings {
    pub image: String,
    pub pull_policy: String,
    pub cpu_request: String,
    pub memory_request: String,
    pub cpu_limit: String,
    pub memory_limit: String,
    pub tls_min_version: Option<String>,
    pub tls_cipher_suites: Option<String>,
    pub cert_duration: Duration,
    pub cert_renew_before: Duration,
    /// `--export-ttl-transfer-wait`: how long after the TTL downloads in flight may finish
    /// (the server's `DRAIN_SECONDS`).
    pub ttl_transfer_wait: Duration,
}

impl Default for PodSettings {
    fn default() -> Self {
        PodSettings {
            image: format!("ucm:{}", env!("CARGO_PKG_VERSION")),
            pull_policy: "IfNotPresent".into(),
            cpu_request: "100m".into(),
            memory_request: "200Mi".into(),
            cpu_limit: "1".into(),
            memory_limit: "1024Mi".into(),
            tls_min_version: None,
            tls_cipher_suites: None,
            cert_duration: Duration::from_secs(24 * 3600),
            cert_renew_before: Duration::from_secs(24 * 3600 / 5),
            ttl_transfer_wait: Duration::from_secs(24 * 3600),
        }
    }
}

impl PodSettings {
    /// The `kubevirt.io/export.certParameters` annotation: Go's JSON of `time.Duration` fields,
    /// nanoseconds. A change recreates the pod ("Pass steps", step 7).
    pub fn cert_params(&self) -> String {
        format!(
            "{{\"Duration\":{},\"RenewBefore\":{}}}",
            self.cert_duration.as_nanos(),
            self.cert_renew_before.as_nanos()
        )
    }
}

/// Everything the pod needs from the current pass.
#[derive(Clone, Debug)]
pub struct PodInput<'a> {
    pub export: &'a VirtualMachineExport,
    pub volumes: &'a [ExportVolume],
    pub token_secret: &'a str,
    pub cert_secret: &'a str,
    pub deadline: jiff::Timestamp,
    /// VM and snapshot sources with a manifest ConfigMap.
    pub vm_manifest: bool,
    /// `--export-oci` with a VM, snapshot or template source: `EXPORT_OCI_URI` (the server
    /// builds the archive from the manifest ConfigMap, so only with `vm_manifest`).
    pub oci: bool,
}

pub fn build_pod(input: &PodInput<'_>, s: &PodSettings) -> Pod {
    let export = input.export;
    let name = export.name_any();
    let mut labels = BTreeMap::from([(
        EXPORT_SERVICE_LABEL.to_string(),
        naming::selector_label_value(&name),
    )]);
    labels.extend(export.labels().clone());
    let mut annotations = export.annotations().clone();
    annotations.insert(ANN_CERT_PARAMS.into(), s.cert_params());

    let mut env_vars = vec![EnvVar {
        name: "POD_NAME".into(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: "metadata.name".into(),
                api_version: None,
            }),
            ..Default::default()
        }),
    }];
    let mut volumes = Vec::new();
    let mut mounts = Vec::new();
    let mut devices = Vec::new();
    for (i, v) in input.volumes.iter().enumerate() {
        let podvol = naming::pod_volume_name(i, &v.pvc);
        volumes.push(Volume {
            name: podvol.clone(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: v.pvc.clone(),
                read_only: None,
            }),
            ..Default::default()
        });
        if v.block {
            devices.push(VolumeDevice {
                name: podvol.clone(),
                device_path: format!("{BLOCK_MOUNT_PATH}/{podvol}"),
            });
        } else {
            mounts.push(VolumeMount {
                name: podvol.clone(),
                mount_path: format!("{FS_MOUNT_PATH}/{podvol}"),
                read_only: Some(true),
                ..Default::default()
            });
        }
        env_vars.extend(volume_env(i, v));
    }
    env_vars.extend([
        env("CERT_FILE", "/cert/tls.crt"),
        env("KEY_FILE", "/cert/tls.key"),
        env("TOKEN_FILE", "/token/token"),
        env(
            "DEADLINE",
            jiff::Timestamp::from_second(input.deadline.as_second())
                .unwrap_or(input.deadline)
                .to_string(),
        ),
    ]);
    if input.vm_manifest {
        env_vars.push(env("EXPORT_VM_DEF_URI", MANIFESTS_ALL_PATH));
    }
    env_vars.push(env("EXPORT_SECRET_DEF_URI", MANIFESTS_SECRET_PATH));
    if input.oci && input.vm_manifest {
        env_vars.push(env("EXPORT_OCI_URI", OCI_PATH));
    }
    env_vars.push(env("EXPORT_NAME", name.clone()));
    env_vars.push(env("METRICS_ADDR", format!(":{METRICS_PORT}")));
    env_vars.push(env(
        "DRAIN_SECONDS",
        s.ttl_transfer_wait.as_secs().to_string(),
    ));
    if let Some(v) = &s.tls_min_version {
        env_vars.push(env("TLS_MIN_VERSION", v.clone()));
    }
    if let Some(v) = &s.tls_cipher_suites {
        env_vars.push(env("TLS_CIPHER_SUITES", v.clone()));
    }

    volumes.push(Volume {
        name: "certificates".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(input.cert_secret.into()),
            ..Default::default()
        }),
        ..Default::default()
    });
    volumes.push(Volume {
        name: "token".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(input.token_secret.into()),
            ..Default::default()
        }),
        ..Default::default()
    });
    mounts.push(VolumeMount {
        name: "certificates".into(),
        mount_path: "/cert".into(),
        read_only: Some(true),
        ..Default::default()
    });
    mounts.push(VolumeMount {
        name: "token".into(),
        mount_path: "/token".into(),
        read_only: Some(true),
        ..Default::default()
    });
    if input.vm_manifest {
        volumes.push(Volume {
            name: "manifest-data".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: naming::manifest_configmap_name(&name),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: "manifest-data".into(),
            mount_path: "/manifest_data".into(),
            read_only: Some(true),
            ..Default::default()
        });
    }

    let q = |v: &str| Quantity(v.to_string());
    let container = Container {
        name: "exporter".into(),
        image: Some(s.image.clone()),
        image_pull_policy: Some(s.pull_policy.clone()),
        command: Some(vec!["ucm".into()]),
        args: Some(vec!["export-server".into()]),
        env: Some(env_vars),
        ports: Some(vec![
            ContainerPort {
                name: Some("export".into()),
                container_port: SERVER_PORT,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            ContainerPort {
                name: Some("metrics".into()),
                container_port: METRICS_PORT,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
        ]),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), q(&s.cpu_request)),
                ("memory".to_string(), q(&s.memory_request)),
            ])),
            limits: Some(BTreeMap::from([
                ("cpu".to_string(), q(&s.cpu_limit)),
                ("memory".to_string(), q(&s.memory_limit)),
            ])),
            ..Default::default()
        }),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some(READINESS_PATH.into()),
                port: IntOrString::Int(SERVER_PORT),
                scheme: Some("HTTPS".into()),
                ..Default::default()
            }),
            initial_delay_seconds: Some(5),
            period_seconds: Some(5),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                add: None,
            }),
            read_only_root_filesystem: Some(true),
            ..Default::default()
        }),
        volume_mounts: Some(mounts),
        volume_devices: (!devices.is_empty()).then_some(devices),
        ..Default::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(naming::pod_name(&name)),
            namespace: export.namespace(),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: controller_ref(export).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            automount_service_account_token: Some(false),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(KVM_ID),
                run_as_group: Some(KVM_ID),
                fs_group: Some(KVM_ID),
                fs_group_change_policy: Some("OnRootMismatch".into()),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    localhost_profile: None,
                }),
                ..Default::default()
            }),
            containers: vec![container],
            volumes: Some(volumes),
            ..Default::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmexport::fixtures::{export, input};

    fn envs(pod: &Pod) -> BTreeMap<String, String> {
        pod.spec.as_ref().unwrap().containers[0]
            .env
            .as_ref()
            .unwrap()
            .iter()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect()
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
        assert_eq!(env["DRAIN_SECONDS"], "86400");
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
}

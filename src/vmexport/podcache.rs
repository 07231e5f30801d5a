//! The Pod cache of the in-use check (docs/vmexport.md, "Optional APIs"): every Pod in the watched
//! namespaces is cached with only what the check and the event mapper read (identity, owner
//! references, deletion mark, its PVC volumes and `status.phase`), and indexed by namespace and
//! claim name. An export Pod (controlled by a VirtualMachineExport) also keeps what the reconciler
//! reads of it, so a pass reads it from this cache too: its annotations, its first container's
//! environment (the links) and its containers' readiness.
//!
//! The watch decodes Pods as [`SlimPod`], reading only those fields from the JSON.

use std::borrow::Cow;

use k8s_openapi::api::core::v1::{
    Container, ContainerStatus, EnvVar, PersistentVolumeClaimVolumeSource, Pod, PodSpec, PodStatus,
    Volume,
};
use kube::Resource;
use kube::api::ObjectMeta;
use kube::core::NamespaceResourceScope;
use kube::runtime::watcher;
use serde::{Deserialize, Deserializer};

use crate::runtime::index::NameIndex;

/// Reduces a Pod to what the vmexport reconciler reads from the cache. A Pod that mounts no
/// claim keeps no volumes, so the many Pods unrelated to exports cost little more than their
/// metadata.
pub fn slim_pod(pod: &mut Pod) {
    let m = std::mem::take(&mut pod.metadata);
    let export_pod = is_export_pod(&m);
    let env = export_pod
        .then(|| {
            pod.spec
                .as_mut()
                .and_then(|s| s.containers.first_mut())
                .and_then(|c| c.env.take())
        })
        .flatten();
    let ready = export_pod
        .then(|| {
            pod.status
                .as_mut()
                .and_then(|s| s.container_statuses.take())
        })
        .flatten()
        .map(|cs| {
            cs.into_iter()
                .map(|c| ContainerStatus {
                    name: c.name,
                    ready: c.ready,
                    ..Default::default()
                })
                .collect::<Vec<_>>()
        });
    pod.metadata = ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        annotations: if export_pod { m.annotations } else { None },
        owner_references: m.owner_references,
        deletion_timestamp: m.deletion_timestamp,
        ..Default::default()
    };
    let volumes: Vec<Volume> = pod
        .spec
        .take()
        .and_then(|s| s.volumes)
        .into_iter()
        .flatten()
        .filter_map(|v| {
            let claim = v.persistent_volume_claim?;
            Some(Volume {
                name: v.name,
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.claim_name,
                    read_only: None,
                }),
                ..Default::default()
            })
        })
        .collect();
    pod.spec = Some(PodSpec {
        containers: env
            .map(|env| {
                vec![Container {
                    env: Some(env),
                    ..Default::default()
                }]
            })
            .unwrap_or_default(),
        volumes: (!volumes.is_empty()).then_some(volumes),
        ..Default::default()
    });
    let phase = pod.status.take().and_then(|s| s.phase);
    pod.status = phase.map(|p| PodStatus {
        phase: Some(p),
        container_statuses: ready,
        ..Default::default()
    });
}

/// A Pod as the vmexport watch decodes it: only the fields [`slim_pod`] may keep are read from
/// the JSON (serde skips the rest without building it), so the many Pods of a cluster cost
/// their metadata and little more to decode, not a whole `PodSpec` each. The watch hands on
/// the `Pod` inside.
#[derive(Clone, Debug)]
pub struct SlimPod(pub Pod);

impl<'de> Deserialize<'de> for SlimPod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Wire {
            #[serde(default)]
            metadata: ObjectMeta,
            spec: Option<WireSpec>,
            status: Option<WireStatus>,
        }
        #[derive(Deserialize)]
        struct WireSpec {
            #[serde(default)]
            containers: Vec<WireContainer>,
            volumes: Option<Vec<WireVolume>>,
        }
        #[derive(Deserialize)]
        struct WireContainer {
            env: Option<Vec<EnvVar>>,
        }
        #[derive(Deserialize)]
        struct WireVolume {
            name: String,
            #[serde(rename = "persistentVolumeClaim")]
            claim: Option<PersistentVolumeClaimVolumeSource>,
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct WireStatus {
            phase: Option<String>,
            container_statuses: Option<Vec<WireReady>>,
        }
        #[derive(Deserialize)]
        struct WireReady {
            name: String,
            #[serde(default)]
            ready: bool,
        }
        let w = Wire::deserialize(d)?;
        let mut pod = Pod {
            metadata: w.metadata,
            spec: w.spec.map(|s| PodSpec {
                containers: s
                    .containers
                    .into_iter()
                    .take(1)
                    .map(|c| Container {
                        env: c.env,
                        ..Default::default()
                    })
                    .collect(),
                volumes: s.volumes.map(|vs| {
                    vs.into_iter()
                        .map(|v| Volume {
                            name: v.name,
                            persistent_volume_claim: v.claim,
                            ..Default::default()
                        })
                        .collect()
                }),
                ..Default::default()
            }),
            status: w.status.map(|s| PodStatus {
                phase: s.phase,
                container_statuses: s.container_statuses.map(|cs| {
                    cs.into_iter()
                        .map(|c| ContainerStatus {
                            name: c.name,
                            ready: c.ready,
                            ..Default::default()
                        })
                        .collect()
                }),
                ..Default::default()
            }),
        };
        slim_pod(&mut pod);
        Ok(SlimPod(pod))
    }
}

impl Resource for SlimPod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Pod::kind(&())
    }
    fn group(_: &()) -> Cow<'_, str> {
        Pod::group(&())
    }
    fn version(_: &()) -> Cow<'_, str> {
        Pod::version(&())
    }
    fn plural(_: &()) -> Cow<'_, str> {
        Pod::plural(&())
    }
    fn meta(&self) -> &ObjectMeta {
        &self.0.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.0.metadata
    }
}

/// The watch's events with the `Pod` of each [`SlimPod`].
pub fn unwrap_event(ev: watcher::Event<SlimPod>) -> watcher::Event<Pod> {
    use watcher::Event as E;
    match ev {
        E::Apply(p) => E::Apply(p.0),
        E::Delete(p) => E::Delete(p.0),
        E::Init => E::Init,
        E::InitApply(p) => E::InitApply(p.0),
        E::InitDone => E::InitDone,
    }
}

/// A Pod controlled by a VirtualMachineExport (the export Pods ucm makes).
fn is_export_pod(m: &ObjectMeta) -> bool {
    m.owner_references.iter().flatten().any(|o| {
        o.controller == Some(true)
            && o.kind == super::api::KIND
            && o.api_version
                .starts_with(&format!("{}/", super::api::GROUP))
    })
}

fn claims_of(pod: &Pod) -> Vec<String> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| {
            v.persistent_volume_claim
                .as_ref()
                .map(|c| c.claim_name.clone())
        })
        .collect()
}

/// Pods by (namespace, claim name), kept from the same watch events as the Pod store. It only
/// narrows the candidates: the in-use check reads each candidate from the store.
pub type ClaimIndex = NameIndex<Pod>;

pub fn claim_index() -> ClaimIndex {
    NameIndex::new(claims_of)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(ns: &str, name: &str, claims: &[&str]) -> Pod {
        owned_pod(ns, name, claims, "apps/v1", "ReplicaSet")
    }

    fn owned_pod(ns: &str, name: &str, claims: &[&str], api_version: &str, kind: &str) -> Pod {
        let mut vols: Vec<_> = claims
            .iter()
            .enumerate()
            .map(|(i, c)| json!({"name": format!("v{i}"), "persistentVolumeClaim": {"claimName": c, "readOnly": true}}))
            .collect();
        vols.push(json!({"name": "cm", "configMap": {"name": "x"}}));
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}"),
                "labels": {"app": "x"}, "annotations": {"big": "x".repeat(1000)},
                "managedFields": [{"manager": "kubectl"}],
                "ownerReferences": [{"apiVersion": api_version, "kind": kind, "name": "e", "uid": "u1", "controller": true}]},
            "spec": {"containers": [{"name": "c", "image": "busybox", "env": [{"name": "A", "value": "b"}]}],
                "volumes": vols},
            "status": {"phase": "Running", "podIP": "10.0.0.9", "containerStatuses": [{"name": "c", "ready": true, "restartCount": 0, "image": "b", "imageID": ""}]},
        }))
        .unwrap()
    }

    #[test]
    fn slim_pod_keeps_only_what_the_in_use_check_reads() {
        let full = pod("ns", "p", &["d"]);
        let mut slim = full.clone();
        slim_pod(&mut slim);
        assert_eq!(
            serde_json::to_value(&slim).unwrap(),
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "ns", "uid": "uid-p",
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "e", "uid": "u1", "controller": true}]},
                "spec": {"containers": [], "volumes": [{"name": "v0", "persistentVolumeClaim": {"claimName": "d"}}]},
                "status": {"phase": "Running"},
            })
        );
        // The decisions are the same on the slim copy.
        for uid in ["u1", "other"] {
            assert_eq!(
                crate::vmexport::sources::pvc::pvc_in_use([&full], "d", uid).is_some(),
                crate::vmexport::sources::pvc::pvc_in_use([&slim], "d", uid).is_some()
            );
        }
        let mut none = pod("ns", "q", &[]);
        slim_pod(&mut none);
        assert!(none.spec.unwrap().volumes.is_none());
    }

    /// An export Pod keeps what the reconciler reads (its state, cert-parameter annotation and
    /// the environment the links come from), so no pass reads it with a GET.
    #[test]
    fn slim_export_pod_keeps_what_the_status_reads() {
        use crate::vmexport::objects::status::{PodState, pod_state};
        let full = owned_pod(
            "ns",
            "virt-export-e",
            &["d"],
            "export.kubevirt.io/v1",
            "VirtualMachineExport",
        );
        let mut slim = full.clone();
        slim_pod(&mut slim);
        let v = serde_json::to_value(&slim).unwrap();
        assert_eq!(v["metadata"]["annotations"]["big"], "x".repeat(1000));
        assert!(v["metadata"].get("labels").is_none());
        assert!(v["metadata"].get("managedFields").is_none());
        assert_eq!(
            v["spec"]["containers"],
            json!([{"name": "", "env": [{"name": "A", "value": "b"}]}])
        );
        assert_eq!(
            v["status"],
            json!({"phase": "Running", "containerStatuses": [{"name": "c", "ready": true, "image": "", "imageID": "", "restartCount": 0}]})
        );
        assert_eq!(pod_state(&slim), PodState::Ready);
        assert_eq!(pod_state(&full), pod_state(&slim));
    }

    /// The watch decodes Pods as `SlimPod`: the same slim Pod as decoding it whole and slimming.
    #[test]
    fn decoding_a_slim_pod_gives_the_slimmed_pod() {
        for (api_version, kind) in [
            ("apps/v1", "ReplicaSet"),
            ("export.kubevirt.io/v1", "VirtualMachineExport"),
        ] {
            let full = owned_pod("ns", "p", &["d", "e"], api_version, kind);
            let mut want = full.clone();
            slim_pod(&mut want);
            let text = serde_json::to_string(&full).unwrap();
            let got: SlimPod = serde_json::from_str(&text).unwrap();
            assert_eq!(got.0, want, "{kind}");
        }
        let bare: SlimPod = serde_json::from_str(r#"{"metadata": {"name": "x"}}"#).unwrap();
        assert_eq!(bare.0.metadata.name.as_deref(), Some("x"));
        assert!(serde_json::from_str::<SlimPod>(r#"{"spec": {"volumes": 3}}"#).is_err());
    }
}

//! CRD types: MiroirSnapshot (upstream's CRD, word for word) and the MiroirVolume subset ucm reads
//! (docs/snapshot.md, "Objects").
//!
//! Descriptions of MiroirSnapshot fields are copied from upstream's CRD so `kubectl explain`
//! matches upstream; the condition item schema is written by hand because k8s-openapi's `Condition`
//! schema carries no patterns and joins its sentences differently.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// API group of both kinds.
pub const GROUP: &str = "miroir.home-operations.com";
/// Prefix of the per-node teardown finalizers (UPSTREAM name).
pub const FINALIZER_PREFIX: &str = "miroir.home-operations.com/teardown-";
/// The one condition type ucm maintains on a MiroirSnapshot.
pub const READY: &str = "Ready";
/// Message of the CEL rule on `spec.volumeName` (docs/snapshot.md, "Objects").
pub const VOLUME_NAME_IMMUTABLE: &str =
    "volumeName is immutable: the snapshot's backend data lives on the volume it was cut from";

/// The finalizer an agent on `node` owns.
pub fn teardown_finalizer(node: &str) -> String {
    format!("{FINALIZER_PREFIX}{node}")
}

/// MiroirSnapshotSpec is the desired state, created by the controller on
/// CSI CreateSnapshot.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "miroir.home-operations.com",
    version = "v1alpha1",
    kind = "MiroirSnapshot",
    plural = "miroirsnapshots",
    shortname = "mis",
    status = "MiroirSnapshotStatus",
    doc = "MiroirSnapshot is a crash-consistent copy-on-write snapshot of a MiroirVolume,\ncut on every replica under one IO barrier.",
    printcolumn = r#"{"name":"Volume","type":"string","jsonPath":".spec.volumeName"}"#,
    printcolumn = r#"{"name":"Ready","type":"boolean","jsonPath":".status.readyToUse"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    // OURS: the round coordinator reads a volume's snapshots uncached before opening a round;
    // a field selector keeps that read to one volume's snapshots instead of all of them.
    selectable = ".spec.volumeName"
)]
#[serde(rename_all = "camelCase")]
pub struct MiroirSnapshotSpec {
    /// VolumeName references the MiroirVolume this snapshot captures.
    /// Immutable: the backend CoW snapshots were cut on the source volume's
    /// replicas, so retargeting the reference would point restores and
    /// per-node teardown at a volume that never held them.
    // OURS: minLength 1. Upstream's CRD marks it required; an empty name references no volume and,
    // being immutable, could never be fixed.
    #[schemars(length(min = 1))]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self == oldSelf",
        "message": "volumeName is immutable: the snapshot's backend data lives on the volume it was cut from"
    }]))]
    pub volume_name: String,
}

// One node's progress in a round (`status.perNode` values); a plain comment so upstream's
// `perNode` description stays the only one `kubectl explain` shows.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum SlotState {
    Pending,
    Suspended,
    Done,
    Error,
}

impl SlotState {
    pub fn as_str(self) -> &'static str {
        match self {
            SlotState::Pending => "Pending",
            SlotState::Suspended => "Suspended",
            SlotState::Done => "Done",
            SlotState::Error => "Error",
        }
    }
}

impl std::fmt::Display for SlotState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// MiroirSnapshotStatus is the observed state aggregated from node agents.
/// The snapshot exists as a backend CoW snapshot on every replica of the
/// source volume.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MiroirSnapshotStatus {
    /// ReadyToUse is true once every replica holds the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,

    /// PerNode maps node name to that agent's snapshot progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_node: Option<BTreeMap<String, SlotState>>,

    /// SizeBytes is the virtual size of the snapshotted volume, used by
    /// the CSI layer to size restored volumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<i64>,

    /// SourceFormatted records the source volume's Formatted flag when
    /// the snapshot is cut. Restored volumes inherit it so their first
    /// stage never reformats a clone that should carry a filesystem.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_formatted: Option<bool>,

    /// IOSuspended is the replicated-snapshot write barrier: set by the
    /// coordinator after suspend-io, cleared on resume. Peers snapshot
    /// only while it holds.
    #[serde(
        default,
        rename = "ioSuspended",
        skip_serializing_if = "Option::is_none"
    )]
    pub io_suspended: Option<bool>,

    /// SuspendedAt bounds the barrier: the coordinator resumes IO at the
    /// deadline even if a peer never snapshots.
    ///
    /// Kept as the exact string the API server returned: agents echo it in their fenced
    /// patches and must never re-format it (docs/snapshot.md, "Objects").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        description = "SuspendedAt bounds the barrier: the coordinator resumes IO at the\ndeadline even if a peer never snapshots.",
        extend("format" = "date-time")
    )]
    pub suspended_at: Option<String>,

    /// Conditions follow the standard Kubernetes condition conventions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// Upstream's condition list, word for word (metav1.Condition as controller-gen emits it).
fn conditions_schema(_: &mut SchemaGenerator) -> Schema {
    let mut schema = crate::conditions::metav1_schema(
        "lastTransitionTime is the last time the condition transitioned from one status to another.\nThis should be when the underlying condition changed. If that is not known, then using the time when the API field changed is acceptable.",
    );
    schema.insert(
        "description".into(),
        "Conditions follow the standard Kubernetes condition conventions.".into(),
    );
    schema
}

/// Storage backend of a diskful replica.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Lvmthin,
    Zfs,
    Loopfile,
}

// Hand-written so the optional enum carries no `null` member (kube marks it nullable otherwise).
fn backend_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": "Backend stores a diskful leg's data; empty on tie-breakers.",
        "type": "string",
        "enum": ["lvmthin", "zfs", "loopfile"]
    })
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Lvmthin => "lvmthin",
            BackendKind::Zfs => "zfs",
            BackendKind::Loopfile => "loopfile",
        }
    }
}

// The subset of a MiroirVolume that ucm reads. Fields outside the subset are preserved by the
// API server (`x-kubernetes-preserve-unknown-fields`), so objects written by upstream's
// controllers stay intact. ucm never writes MiroirVolume.
/// MiroirVolumeSpec is the desired state of a replicated volume.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "miroir.home-operations.com",
    version = "v1alpha1",
    kind = "MiroirVolume",
    plural = "miroirvolumes",
    shortname = "miv",
    status = "MiroirVolumeStatus",
    doc = "MiroirVolume is a replicated block volume. ucm serves only the subset of fields\nits snapshot coordinator reads; every other field is preserved."
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct MiroirVolumeSpec {
    /// SizeBytes is the virtual size of the volume.
    #[schemars(range(min = 1))]
    pub size_bytes: i64,

    /// Replicas are the volume's legs: diskful replicas and diskless tie-breakers.
    /// The volume is replicated when it has more than one entry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(min = 1, max = 3))]
    pub replicas: Vec<Replica>,
}

/// One leg of the volume in `spec.replicas`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct Replica {
    /// Node is the Kubernetes node that holds this leg.
    pub node: String,

    /// Backend stores a diskful leg's data; empty on tie-breakers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "backend_schema")]
    pub backend: Option<BackendKind>,

    /// Pool names the storage pool on the node; empty means "default".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,

    /// Diskless marks a tie-breaker: it holds no data and is never cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diskless: Option<bool>,
}

impl Replica {
    pub fn is_diskful(&self) -> bool {
        !self.diskless.unwrap_or(false)
    }

    /// The pool name with the "empty means default" rule applied.
    pub fn pool_name(&self) -> &str {
        match self.pool.as_deref() {
            None | Some("") => "default",
            Some(p) => p,
        }
    }
}

/// MiroirVolumeStatus is the observed state of a replicated volume.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct MiroirVolumeStatus {
    /// Formatted is true once the volume carries a filesystem.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub formatted: Option<bool>,

    /// PerNode is the per-node state of the volume's legs.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub per_node: BTreeMap<String, VolumeNodeStatus>,
}

/// One node's view of the volume.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct VolumeNodeStatus {
    /// DeviceCreated is true once the leg's block device exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_created: Option<bool>,

    /// DiskState is the DRBD disk state of the leg (for example UpToDate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_state: Option<String>,

    /// SplitBrain is true while DRBD reports a split brain on this leg.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split_brain: Option<bool>,
}

impl MiroirVolume {
    /// A volume is replicated when it has more than one replica (UPSTREAM).
    pub fn is_replicated(&self) -> bool {
        self.spec.replicas.len() > 1
    }

    /// Nodes of the diskful replicas, in spec order, without duplicates.
    pub fn diskful_nodes(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in self.spec.replicas.iter().filter(|r| r.is_diskful()) {
            if !out.contains(&r.node) {
                out.push(r.node.clone());
            }
        }
        out
    }

    /// Nodes of every replica (diskful and tie-breakers), in spec order, without duplicates.
    pub fn replica_nodes(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in &self.spec.replicas {
            if !out.contains(&r.node) {
                out.push(r.node.clone());
            }
        }
        out
    }

    /// This node's replica entry, if any.
    pub fn replica_on(&self, node: &str) -> Option<&Replica> {
        self.spec.replicas.iter().find(|r| r.node == node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;
    use serde_json::{Value, json};

    fn snapshot_schema() -> Value {
        let crd = MiroirSnapshot::crd();
        serde_json::to_value(&crd.spec.versions[0].schema).unwrap()["openAPIV3Schema"].clone()
    }

    #[test]
    fn snapshot_crd_identity() {
        let crd = MiroirSnapshot::crd();
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some("miroirsnapshots.miroir.home-operations.com")
        );
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(crd.spec.names.kind, "MiroirSnapshot");
        assert_eq!(crd.spec.names.short_names, Some(vec!["mis".to_string()]));
        let v = &crd.spec.versions[0];
        assert_eq!(v.name, "v1alpha1");
        assert!(v.subresources.as_ref().unwrap().status.is_some());
        let cols: Vec<(String, String, String)> = v
            .additional_printer_columns
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| (c.name.clone(), c.type_.clone(), c.json_path.clone()))
            .collect();
        assert_eq!(
            cols,
            vec![
                ("Volume".into(), "string".into(), ".spec.volumeName".into()),
                (
                    "Ready".into(),
                    "boolean".into(),
                    ".status.readyToUse".into()
                ),
                (
                    "Age".into(),
                    "date".into(),
                    ".metadata.creationTimestamp".into()
                ),
            ]
        );
    }

    #[test]
    fn volume_name_is_immutable_with_the_spec_message() {
        let s = snapshot_schema();
        let spec = &s["properties"]["spec"];
        assert_eq!(spec["required"], json!(["volumeName"]));
        assert_eq!(
            spec["description"],
            "MiroirSnapshotSpec is the desired state, created by the controller on\nCSI CreateSnapshot."
        );
        let vn = &spec["properties"]["volumeName"];
        assert_eq!(
            vn["x-kubernetes-validations"],
            json!([{"rule": "self == oldSelf", "message": VOLUME_NAME_IMMUTABLE}])
        );
        assert!(vn["description"].as_str().unwrap().starts_with(
            "VolumeName references the MiroirVolume this snapshot captures.\nImmutable: the backend CoW"
        ));
    }

    #[test]
    fn status_fields_match_the_seed() {
        let s = snapshot_schema();
        let st = &s["properties"]["status"];
        assert_eq!(
            st["description"],
            "MiroirSnapshotStatus is the observed state aggregated from node agents.\nThe snapshot exists as a backend CoW snapshot on every replica of the\nsource volume."
        );
        let p = &st["properties"];
        assert_eq!(p["readyToUse"]["type"], "boolean");
        assert_eq!(p["ioSuspended"]["type"], "boolean");
        assert_eq!(p["sourceFormatted"]["type"], "boolean");
        assert_eq!(p["sizeBytes"]["type"], "integer");
        assert_eq!(p["sizeBytes"]["format"], "int64");
        assert_eq!(p["suspendedAt"]["type"], "string");
        assert_eq!(p["suspendedAt"]["format"], "date-time");
        assert_eq!(
            p["suspendedAt"]["description"],
            "SuspendedAt bounds the barrier: the coordinator resumes IO at the\ndeadline even if a peer never snapshots."
        );
        assert_eq!(p["perNode"]["type"], "object");
        assert_eq!(
            p["perNode"]["additionalProperties"]["enum"],
            json!(["Pending", "Suspended", "Done", "Error"])
        );
        assert_eq!(
            p["perNode"]["description"],
            "PerNode maps node name to that agent's snapshot progress."
        );
        assert_eq!(
            p["ioSuspended"]["description"],
            "IOSuspended is the replicated-snapshot write barrier: set by the\ncoordinator after suspend-io, cleared on resume. Peers snapshot\nonly while it holds."
        );
    }

    #[test]
    fn condition_schema_is_the_seeds() {
        let s = snapshot_schema();
        let c = &s["properties"]["status"]["properties"]["conditions"];
        assert_eq!(
            c["description"],
            "Conditions follow the standard Kubernetes condition conventions."
        );
        let item = &c["items"];
        assert_eq!(
            item["required"],
            json!(["lastTransitionTime", "message", "reason", "status", "type"])
        );
        let p = &item["properties"];
        assert_eq!(
            p["reason"]["pattern"],
            "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
        );
        assert_eq!(p["reason"]["minLength"], 1);
        assert_eq!(p["reason"]["maxLength"], 1024);
        assert_eq!(p["message"]["maxLength"], 32768);
        assert_eq!(p["status"]["enum"], json!(["True", "False", "Unknown"]));
        assert_eq!(p["type"]["maxLength"], 316);
        assert_eq!(
            p["type"]["pattern"],
            r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
        );
        assert_eq!(p["observedGeneration"]["minimum"], 0.0);
        assert_eq!(p["lastTransitionTime"]["format"], "date-time");
        // Nothing added beyond upstream's schema (docs/runtime.md, "Conditions").
        assert!(c.get("x-kubernetes-list-type").is_none());
    }

    #[test]
    fn volume_crd_preserves_unknown_fields() {
        let crd = MiroirVolume::crd();
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(crd.spec.names.plural, "miroirvolumes");
        assert_eq!(crd.spec.names.short_names, Some(vec!["miv".to_string()]));
        let s =
            serde_json::to_value(&crd.spec.versions[0].schema).unwrap()["openAPIV3Schema"].clone();
        let spec = &s["properties"]["spec"];
        assert_eq!(spec["x-kubernetes-preserve-unknown-fields"], true);
        assert_eq!(spec["required"], json!(["sizeBytes"]));
        assert_eq!(spec["properties"]["sizeBytes"]["minimum"], 1.0);
        let reps = &spec["properties"]["replicas"];
        assert_eq!(reps["minItems"], 1);
        assert_eq!(reps["maxItems"], 3);
        assert_eq!(reps["items"]["required"], json!(["node"]));
        assert_eq!(reps["items"]["x-kubernetes-preserve-unknown-fields"], true);
        assert_eq!(
            reps["items"]["properties"]["backend"]["enum"],
            json!(["lvmthin", "zfs", "loopfile"])
        );
        let st = &s["properties"]["status"];
        assert_eq!(st["x-kubernetes-preserve-unknown-fields"], true);
        let pn = &st["properties"]["perNode"]["additionalProperties"];
        assert_eq!(pn["x-kubernetes-preserve-unknown-fields"], true);
        assert_eq!(pn["properties"]["deviceCreated"]["type"], "boolean");
        assert_eq!(pn["properties"]["diskState"]["type"], "string");
        assert_eq!(pn["properties"]["splitBrain"]["type"], "boolean");
    }

    #[test]
    fn volume_helpers() {
        let v: MiroirVolume = serde_json::from_value(json!({
            "apiVersion": "miroir.home-operations.com/v1alpha1",
            "kind": "MiroirVolume",
            "metadata": {"name": "pvc-1"},
            "spec": {"sizeBytes": 1024, "drbd": {"port": 7000}, "replicas": [
                {"node": "a", "backend": "loopfile"},
                {"node": "b", "backend": "zfs", "pool": "fast"},
                {"node": "c", "diskless": true}
            ]}
        }))
        .unwrap();
        assert!(v.is_replicated());
        assert_eq!(v.diskful_nodes(), vec!["a", "b"]);
        assert_eq!(v.replica_nodes(), vec!["a", "b", "c"]);
        assert_eq!(v.replica_on("a").unwrap().pool_name(), "default");
        assert_eq!(v.replica_on("b").unwrap().pool_name(), "fast");
        assert!(!v.replica_on("c").unwrap().is_diskful());
    }
}

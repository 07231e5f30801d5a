//! The VirtualMachineExport API (export.kubevirt.io), field for field as upstream KubeVirt's CRD
//! (docs/vmexport.md, "API versions and validation"); doc comments are upstream's descriptions
//! because they become `kubectl explain` text.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// VirtualMachineExportSpec is the spec for a VirtualMachineExport resource
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "export.kubevirt.io",
    version = "v1",
    kind = "VirtualMachineExport",
    namespaced,
    status = "VirtualMachineExportStatus",
    derive = "PartialEq",
    derive = "Default",
    shortname = "vmexport",
    shortname = "vmexports",
    category = "all",
    doc = "VirtualMachineExport defines the operation of exporting a VM source",
    // JSON form: clippy's duplicated_attributes fires on repeated structured printcolumns.
    printcolumn = r#"{"name":"SourceKind", "type":"string", "jsonPath":".spec.source.kind"}"#,
    printcolumn = r#"{"name":"SourceName", "type":"string", "jsonPath":".spec.source.name"}"#,
    printcolumn = r#"{"name":"Phase", "type":"string", "jsonPath":".status.phase"}"#
)]
// OURS (docs/vmexport.md, "API versions and validation"): upstream needs a webhook for this.
#[x_kube(validation = Rule::new("self == oldSelf").message("spec is immutable after creation"))]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineExportSpec {
    /// TypedLocalObjectReference contains enough information to let you locate the typed referenced object inside the same namespace.
    pub source: TypedLocalObjectReference,
    /// TokenSecretRef is the name of the custom-defined secret that contains the token used by the export server pod
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<String>,
    /// ttlDuration limits the lifetime of an export If this field is set, after this duration has passed from counting from CreationTimestamp, the export is eligible to be automatically deleted. If this field is omitted, a reasonable default is applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("duration(self) >= duration('0s')").message("ttlDuration must be a non-negative duration such as 2h or 90m"))]
    pub ttl_duration: Option<String>,
}

/// TypedLocalObjectReference contains enough information to let you locate the typed referenced object inside the same namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TypedLocalObjectReference {
    /// APIGroup is the group for the resource being referenced. If APIGroup is not specified, the specified Kind must be in the core API group. For any other third-party types, APIGroup is required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_group: Option<String>,
    /// Kind is the type of resource being referenced
    #[schemars(length(min = 1))]
    pub kind: String,
    /// Name is the name of resource being referenced
    #[schemars(length(min = 1))]
    pub name: String,
}

/// VirtualMachineExportStatus is the status for a VirtualMachineExport resource
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineExportStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// VirtualMachineExportLinks contains the links that point the exported VM resources
    // Serialised even when None: links must disappear (null) when the pod stops being ready,
    // and a merge patch only removes a field that is sent as null.
    #[serde(default)]
    pub links: Option<VirtualMachineExportLinks>,
    /// VirtualMachineExportPhase is the current phase of the VirtualMachineExport
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// ServiceName is the name of the service created associated with the Virtual Machine export. It will be used to create the internal URLs for downloading the images
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    /// TokenSecretRef is the name of the secret that contains the token used by the export server pod
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<String>,
    /// The time at which the VM Export will be completely removed according to specified TTL Formula is CreationTimestamp + TTL
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_expiration_time: Option<Time>,
    /// VirtualMachineName shows the name of the source virtual machine if the source is either a VirtualMachine or a VirtualMachineSnapshot. This is mainly to easily identify the source VirtualMachine in case of a VirtualMachineSnapshot
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_name: Option<String>,
}

/// The condition type is the conditions library's KubeVirt shape (one setter for it, in
/// `crate::conditions`).
pub use crate::conditions::KubeVirtCondition as Condition;

/// VirtualMachineExportLinks contains the links that point the exported VM resources
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineExportLinks {
    /// VirtualMachineExportLink contains a list of volumes available for export, as well as the URLs to obtain these volumes
    // Serialised even when None, as `status.links`: external links go away (null in the merge
    // patch) when the external host does (the proxy's Ingress is deleted).
    #[serde(default)]
    pub external: Option<VirtualMachineExportLink>,
    /// VirtualMachineExportLink contains a list of volumes available for export, as well as the URLs to obtain these volumes
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub internal: Option<VirtualMachineExportLink>,
}

/// VirtualMachineExportLink contains a list of volumes available for export, as well as the URLs to obtain these volumes
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineExportLink {
    /// Cert is the public CA certificate base64 encoded
    pub cert: String,
    /// Manifests is a list of available manifests for the export
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub manifests: Option<Vec<VirtualMachineExportManifest>>,
    /// Volumes is a list of available volumes to export
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub volumes: Option<Vec<VirtualMachineExportVolume>>,
}

/// VirtualMachineExportManifest contains the type and URL of the exported manifest
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineExportManifest {
    /// Type is the type of manifest returned
    #[serde(rename = "type")]
    pub type_: String,
    /// Url is the url of the endpoint that returns the manifest
    pub url: String,
}

/// VirtualMachineExportVolume contains the name and available formats for the exported volume
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineExportVolume {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub formats: Option<Vec<VirtualMachineExportVolumeFormat>>,
    /// Name is the name of the exported volume
    pub name: String,
}

/// VirtualMachineExportVolumeFormat contains the format type and URL to get the volume in that format
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineExportVolumeFormat {
    /// Format is the format of the image at the specified URL
    pub format: String,
    /// Url is the url that contains the volume in the format specified
    pub url: String,
}

//! CRD types of `jumpstarter.dev/v1alpha1`: Exporter (the seed), Lease, Client and
//! ExporterAccessPolicy. Field names, casing, defaults and validation follow the upstream
//! controller-gen CRDs; the Exporter adds the seed's `leaseHooks`, `recordsLeaseHooks` and
//! `tokenExpiresAt` and validates its enums. Doc comments are the `kubectl explain` text.

pub mod schema;

#[cfg(test)]
mod compat_tests;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A reference to an object in the same namespace (`corev1.LocalObjectReference`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalObjectReference {
    #[serde(default)]
    pub name: String,
}

impl LocalObjectReference {
    pub fn new(name: impl Into<String>) -> Self {
        Self { name: name.into() }
    }
}

// ---------------------------------------------------------------------------------------------
// Exporter
// ---------------------------------------------------------------------------------------------

/// ExporterSpec defines the desired state of Exporter.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "jumpstarter.dev",
    version = "v1alpha1",
    kind = "Exporter",
    namespaced,
    status = "ExporterStatus",
    doc = "Exporter is the Schema for the exporters API",
    printcolumn = r#"{"jsonPath":".spec.enabled","name":"Enabled","type":"boolean"}"#,
    printcolumn = r#"{"jsonPath":".status.exporterStatus","name":"Status","type":"string"}"#,
    printcolumn = r#"{"jsonPath":".status.statusMessage","name":"Message","priority":1,"type":"string"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ExporterSpec {
    /// Enabled controls whether this exporter is eligible for lease assignment. When set to false, the controller will not assign new leases to this exporter. Useful for temporarily taking an exporter offline for maintenance without deleting it, or for graceful scale-down of virtual exporter pools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = true))]
    pub enabled: Option<bool>,
    /// Username is the identity of the exporter, used for authentication and authorization.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
}

impl ExporterSpec {
    /// Absent means enabled (the API server defaults it to true).
    pub fn is_enabled(&self) -> bool {
        self.enabled.unwrap_or(true)
    }
}

/// ExporterStatus defines the observed state of Exporter.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExporterStatus {
    /// Conditions represent the latest available observations of the exporter state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Option<Vec<Condition>>,
    /// Credential is a reference to the secret containing the exporter credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::local_object_reference")]
    pub credential: Option<LocalObjectReference>,
    /// Devices is the list of driver instances currently reported by the exporter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<Device>>,
    /// Endpoint is the gRPC endpoint URL where the exporter is reachable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// ExporterStatusValue is the current operational status reported by the exporter
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exporter_status: Option<ExporterStatusValue>,
    /// LastSeen is the timestamp of the last communication from the exporter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<Time>,
    /// LeaseHooks records how far the exporter got with the lifecycle hooks of its latest lease. It survives exporter restarts, so a restarted exporter neither repeats a finished beforeLease hook nor skips an owed afterLease hook. It is dropped when an exporter that does not record its lease hooks registers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_hooks: Option<LeaseHooks>,
    /// LeaseRef is a reference to the lease currently assigned to this exporter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::local_object_reference")]
    pub lease_ref: Option<LocalObjectReference>,
    /// RecordsLeaseHooks is set when the exporter process that last registered records its lease hooks. Such an exporter is not assigned a new lease while its record owes an afterLease hook, whatever status it reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub records_lease_hooks: Option<bool>,
    /// StatusMessage is an optional human-readable message describing the current state
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_message: Option<String>,
    /// TokenExpiresAt is the expiry time of the internal credential token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_expires_at: Option<Time>,
}

/// ExporterStatusValue is the current operational status reported by the exporter
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum ExporterStatusValue {
    Unspecified,
    Offline,
    Available,
    BeforeLeaseHook,
    LeaseReady,
    AfterLeaseHook,
    BeforeLeaseHookFailed,
    AfterLeaseHookFailed,
}

impl ExporterStatusValue {
    pub const ALL: [ExporterStatusValue; 8] = [
        Self::Unspecified,
        Self::Offline,
        Self::Available,
        Self::BeforeLeaseHook,
        Self::LeaseReady,
        Self::AfterLeaseHook,
        Self::BeforeLeaseHookFailed,
        Self::AfterLeaseHookFailed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unspecified => "Unspecified",
            Self::Offline => "Offline",
            Self::Available => "Available",
            Self::BeforeLeaseHook => "BeforeLeaseHook",
            Self::LeaseReady => "LeaseReady",
            Self::AfterLeaseHook => "AfterLeaseHook",
            Self::BeforeLeaseHookFailed => "BeforeLeaseHookFailed",
            Self::AfterLeaseHookFailed => "AfterLeaseHookFailed",
        }
    }
}

/// Device represents a driver instance reported by an exporter.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct Device {
    /// Labels are key-value pairs associated with the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// ParentUuid is the UUID of the parent device, if this is a child device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_uuid: Option<String>,
    /// Uuid is the unique identifier of the device within the exporter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

/// LeaseHooks records how far the exporter got with the lifecycle hooks of its latest lease. It survives exporter restarts, so a restarted exporter neither repeats a finished beforeLease hook nor skips an owed afterLease hook. It is dropped when an exporter that does not record its lease hooks registers.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeaseHooks {
    /// AfterLease is the afterLease hook's state; unset until it starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_lease: Option<HookState>,
    /// BeforeLease is the beforeLease hook's state; unset until it starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before_lease: Option<HookState>,
    /// ClientName is the client that held the lease. An afterLease hook that runs after the lease has ended (for example after an exporter restart) gets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_name: Option<String>,
    /// LeaseRef is the lease the hooks belong to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::local_object_reference")]
    pub lease_ref: Option<LocalObjectReference>,
    /// LeaseUID is the UID of that lease. A lease name can be reused once the lease is deleted, so the name alone does not identify it.
    #[serde(rename = "leaseUID", default, skip_serializing_if = "Option::is_none")]
    pub lease_uid: Option<String>,
}

/// The state of one lease hook.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HookState {
    /// Attempts counts the times the hook was started; more than one means it was re-run after an exporter restart cut it off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::integer")]
    pub attempts: Option<i64>,
    /// LastTransitionTime is when the hook entered its current phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
    /// Message is the failure or skip reason, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// OnFailure is the hook's configured failure action when it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_failure: Option<HookOnFailure>,
    /// Phase of the hook. Running also covers a hook cut off by an exporter restart.
    pub phase: HookPhase,
}

/// Phase of the hook. Running also covers a hook cut off by an exporter restart.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum HookPhase {
    Running,
    Succeeded,
    Failed,
    Skipped,
}

impl HookPhase {
    pub fn is_terminal(self) -> bool {
        !matches!(self, Self::Running)
    }
}

/// OnFailure is the hook's configured failure action when it ran.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum HookOnFailure {
    #[serde(rename = "warn")]
    Warn,
    #[serde(rename = "endLease")]
    EndLease,
    #[serde(rename = "exit")]
    Exit,
}

// ---------------------------------------------------------------------------------------------
// Lease
// ---------------------------------------------------------------------------------------------

/// LeaseSpec defines the desired state of Lease
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "jumpstarter.dev",
    version = "v1alpha1",
    kind = "Lease",
    namespaced,
    status = "LeaseStatus",
    doc = "Lease is the Schema for the leases API",
    printcolumn = r#"{"jsonPath":".status.ended","name":"Ended","type":"boolean"}"#,
    printcolumn = r#"{"jsonPath":".spec.clientRef.name","name":"Client","type":"string"}"#,
    printcolumn = r#"{"jsonPath":".status.exporterRef.name","name":"Exporter","type":"string"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = lease_spec_schema)]
pub struct LeaseSpec {
    /// AllowDisabled permits leasing a disabled exporter when used with ExporterRef.
    /// When true and ExporterRef is set, the controller will allow leasing an exporter
    /// even if its spec.enabled field is false. This is useful for investigating
    /// broken exporters that have been administratively disabled.
    /// Ignored for selector-based leases (disabled exporters are always filtered out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_disabled: Option<bool>,
    /// Requested start time. If omitted, lease starts when exporter is acquired.
    /// Immutable after lease starts (cannot change the past).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin_time: Option<Time>,
    /// The client that is requesting the lease
    #[serde(default)]
    #[schemars(schema_with = "schema::local_object_reference")]
    pub client_ref: LocalObjectReference,
    /// User-defined context metadata for the lease (e.g. build_id, image_digest, VCS ref).
    /// Immutable after creation. Maximum 8 entries; keys max 32 chars, values max 64 chars.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = 8))]
    pub context: Option<BTreeMap<String, String>>,
    /// Duration of the lease. Must be positive when provided.
    /// Can be omitted (nil) when both BeginTime and EndTime are provided,
    /// in which case it's calculated as EndTime - BeginTime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::duration")]
    pub duration: Option<String>,
    /// Requested end time. If specified with BeginTime, Duration is calculated.
    /// Can be updated to extend or shorten active leases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_time: Option<Time>,
    /// Optionally pin this lease to a specific exporter name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::local_object_reference")]
    pub exporter_ref: Option<LocalObjectReference>,
    /// The release flag requests the controller to end the lease now
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<bool>,
    /// The selector for the exporter to be used
    #[serde(default)]
    #[schemars(schema_with = "schema::label_selector")]
    pub selector: LabelSelector,
    /// User-defined tags for the lease. Immutable after creation.
    /// Maximum 10 entries. Keys must be simple names (no slashes) conforming to Kubernetes label rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxProperties" = 10))]
    pub tags: Option<BTreeMap<String, String>>,
}

/// Upstream's required list and CEL rules of LeaseSpec (kubebuilder markers upstream).
fn lease_spec_schema(schema: &mut schemars::Schema) {
    schema.insert(
        "required".into(),
        serde_json::json!(["clientRef", "selector"]),
    );
    if let Some(selector) = schema
        .get_mut("properties")
        .and_then(|p| p.get_mut("selector"))
        .and_then(|s| s.as_object_mut())
    {
        selector.insert("default".into(), serde_json::json!({}));
    }
    if let Some(client_ref) = schema
        .get_mut("properties")
        .and_then(|p| p.get_mut("clientRef"))
        .and_then(|s| s.as_object_mut())
    {
        client_ref.remove("default");
    }
    schema.insert(
        "x-kubernetes-validations".into(),
        serde_json::json!([
            {
                "message": "one of selector or exporterRef.name is required",
                "rule": "((has(self.selector.matchLabels) && size(self.selector.matchLabels) > 0) || (has(self.selector.matchExpressions) && size(self.selector.matchExpressions) > 0)) || (has(self.exporterRef) && has(self.exporterRef.name) && size(self.exporterRef.name) > 0)"
            },
            {
                "message": "tags are immutable after creation",
                "rule": "!has(oldSelf.tags) || self.tags == oldSelf.tags"
            },
            {
                "message": "context is immutable after creation",
                "rule": "!has(oldSelf.context) || self.context == oldSelf.context"
            },
            {
                "message": "context keys max 32 chars, values max 64 chars",
                "rule": "!has(self.context) || self.context.all(k, size(k) <= 32 && size(self.context[k]) <= 64)"
            }
        ]),
    );
}

impl LeaseSpec {
    pub fn exporter_ref_name(&self) -> Option<&str> {
        self.exporter_ref
            .as_ref()
            .map(|r| r.name.as_str())
            .filter(|n| !n.is_empty())
    }
}

/// LeaseStatus defines the observed state of Lease.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = lease_status_schema)]
pub struct LeaseStatus {
    /// BeginTime is the actual start time of the lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin_time: Option<Time>,
    /// Conditions represent the latest available observations of the lease state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Option<Vec<Condition>>,
    /// EndTime is the actual end time of the lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_time: Option<Time>,
    /// Ended indicates whether the lease has been terminated.
    #[serde(default)]
    pub ended: bool,
    /// ExporterRef is a reference to the exporter assigned to this lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::local_object_reference")]
    pub exporter_ref: Option<LocalObjectReference>,
    /// Priority is the effective priority of the lease from the access policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::integer")]
    pub priority: Option<i64>,
    /// Queue is where a waiting lease stands in the scheduler's queue: its position among the leases that compete for the same exporters and its estimated start. Set only while the lease waits for an exporter; the same facts are in the message of its Pending condition. An addition of ucm: upstream Jumpstarter does not write it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<LeaseQueue>,
    /// SpotAccess indicates whether this lease was granted with spot (preemptible) access.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spot_access: Option<bool>,
}

/// LeaseQueue is where a waiting lease stands. Waiting leases that can use the same exporters form a queue: higher ExporterAccessPolicy priority first, then the earlier creationTimestamp, then the name. A lease whose spec.beginTime is still in the future is not in any queue.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeaseQueue {
    /// EstimatedStartTime is when the lease is expected to get an exporter, from the end times of the leases that hold the exporters and the durations of the leases ahead. Unset when unknown: a lease ahead or a holding lease has no end, or more than 100 leases are ahead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_start_time: Option<Time>,
    /// Position is the lease's place in its queue: 1 is next. Unset when more than 100 leases are ahead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::integer")]
    pub position: Option<i64>,
    /// PreemptAt is when the lease named by preempting is ended (after the grace period of --exporter-preemption-grace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempt_at: Option<Time>,
    /// Preempting names the lease held under spot access that this lease preempts: it is ended at preemptAt and its exporter goes to this lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempting: Option<String>,
    /// Priority is the lease's priority in the queue: the highest priority of the ExporterAccessPolicy rules that approve it, 0 without policies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::integer")]
    pub priority: Option<i64>,
}

/// `ended` is required and has no default upstream.
fn lease_status_schema(schema: &mut schemars::Schema) {
    schema.insert("required".into(), serde_json::json!(["ended"]));
    if let Some(ended) = schema
        .get_mut("properties")
        .and_then(|p| p.get_mut("ended"))
        .and_then(|s| s.as_object_mut())
    {
        ended.remove("default");
    }
}

impl LeaseStatus {
    pub fn exporter_ref_name(&self) -> Option<&str> {
        self.exporter_ref
            .as_ref()
            .map(|r| r.name.as_str())
            .filter(|n| !n.is_empty())
    }
}

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

/// ClientSpec defines the desired state of Client.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "jumpstarter.dev",
    version = "v1alpha1",
    kind = "Client",
    namespaced,
    status = "ClientStatus",
    doc = "Client is the Schema for the clients API",
    printcolumn = r#"{"jsonPath":".status.tokenExpiresAt","name":"Token Expires","type":"string"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClientSpec {
    /// Username is the identity of the client, used for authentication and authorization.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
}

/// ClientStatus defines the observed state of Client.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClientStatus {
    /// Conditions represent the latest available observations of the client state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::conditions")]
    pub conditions: Option<Vec<Condition>>,
    /// Credential is a reference to the secret containing the client credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::local_object_reference")]
    pub credential: Option<LocalObjectReference>,
    /// Endpoint is the controller gRPC endpoint URL assigned to this client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// TokenExpiresAt is the expiry time of the internal credential token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_expires_at: Option<Time>,
}

// ---------------------------------------------------------------------------------------------
// ExporterAccessPolicy
// ---------------------------------------------------------------------------------------------

/// ExporterAccessPolicySpec defines the desired state of ExporterAccessPolicy.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "jumpstarter.dev",
    version = "v1alpha1",
    kind = "ExporterAccessPolicy",
    plural = "exporteraccesspolicies",
    namespaced,
    status = "ExporterAccessPolicyStatus",
    doc = "ExporterAccessPolicy is the Schema for the exporteraccesspolicies API.\nExporterAccessPolicies are used to define the access policies for the exporters.\nThey help organize, prioritize and restrict access to the exporters by clients."
)]
#[serde(rename_all = "camelCase")]
pub struct ExporterAccessPolicySpec {
    /// ExporterSelector is a label selector that matches the exporters this policy applies to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::label_selector")]
    pub exporter_selector: Option<LabelSelector>,
    /// Policies is the list of access policy rules to apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policies: Option<Vec<Policy>>,
}

/// Policy defines an access policy rule for exporter access.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Policy {
    /// Description is a human-readable explanation of this policy rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// From is the list of client selectors that this policy applies to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Vec<From>>,
    /// MaximumDuration is the maximum lease duration allowed by this policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::duration")]
    pub maximum_duration: Option<String>,
    /// Priority is the priority of this policy rule. Higher values indicate higher priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::integer")]
    pub priority: Option<i64>,
    /// SpotAccess indicates whether spot access (preemptible leases) is allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spot_access: Option<bool>,
}

/// From defines a source matcher for clients allowed access.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct From {
    /// ClientSelector is a label selector that matches clients this rule applies to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "schema::label_selector")]
    pub client_selector: Option<LabelSelector>,
}

/// ExporterAccessPolicyStatus defines the observed state of ExporterAccessPolicy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct ExporterAccessPolicyStatus {}

//! Every write a controller makes goes through a [`Writer`], which refuses it unless this process
//! holds the leader Lease with margin. A reconciler therefore cannot forget the leadership check,
//! and a standby never writes (docs/runtime.md, "Leader election").
//!
//! The one exception is a write a request causes: a server that runs on every replica (the
//! exporter's gRPC services) writes through [`Writer::any_replica`], because the caller is
//! connected to this replica and waits for the answer (docs/runtime.md, "Leader-only and
//! any-replica writes").

use std::fmt::Debug;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions},
    runtime::events::EventType,
};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Map, Value, json};
use tracing::warn;

use super::events::{Occurrence, Publisher};
use super::leader::Leadership;

/// Who may write through a [`Writer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Reconcilers: only while this replica leads.
    Leader,
    /// Request handlers on every replica: whoever serves the request.
    AnyReplica,
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("this replica is not the leader; the write was refused")]
    NotLeader,
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

pub use super::kube_errors::{is_already_exists, is_fenced_out, is_not_found};

impl WriteError {
    /// The object changed since it was read ([`is_fenced_out`]); the caller reconciles again
    /// from fresh state.
    pub fn is_conflict(&self) -> bool {
        matches!(self, WriteError::Kube(e) if is_fenced_out(e))
    }

    /// [`is_not_found`] of the API server's answer.
    pub fn is_not_found(&self) -> bool {
        matches!(self, WriteError::Kube(e) if is_not_found(e))
    }

    /// [`is_already_exists`] of the API server's answer.
    pub fn is_already_exists(&self) -> bool {
        matches!(self, WriteError::Kube(e) if is_already_exists(e))
    }

    pub fn is_forbidden(&self) -> bool {
        matches!(self, WriteError::Kube(kube::Error::Api(s)) if s.code == 403)
    }

    /// Every value [`WriteError::metric_label`] returns.
    pub const METRIC_LABELS: &'static [&'static str] = &[
        "not_leader",
        "forbidden",
        "not_found",
        "conflict",
        "invalid",
        "api",
        "kube",
    ];

    /// The API server's reason (CamelCase) or a fixed label, for metrics and conditions.
    pub fn metric_label(&self) -> &'static str {
        match self {
            WriteError::NotLeader => "not_leader",
            WriteError::Kube(e) => kube_metric_label(e),
        }
    }
}

/// The metric label of a failed API call, read or write: one of [`WriteError::METRIC_LABELS`].
pub fn kube_metric_label(e: &kube::Error) -> &'static str {
    match e {
        kube::Error::Api(s) => match s.code {
            403 => "forbidden",
            404 => "not_found",
            409 => "conflict",
            422 => "invalid",
            _ => "api",
        },
        _ => "kube",
    }
}

/// Leadership-gated writes under one field manager (`ucm-<controller>`), plus Events.
#[derive(Clone)]
pub struct Writer {
    leadership: Leadership,
    events: Arc<Publisher>,
    manager: String,
    gate: Gate,
}

impl Writer {
    pub fn new(
        client: Client,
        leadership: Leadership,
        controller: &str,
        instance: Option<String>,
    ) -> Self {
        let manager = format!("ucm-{controller}");
        let instance = instance.unwrap_or_else(|| manager.clone());
        Writer {
            leadership,
            events: Arc::new(Publisher::new(client, manager.clone(), instance)),
            manager,
            gate: Gate::Leader,
        }
    }

    /// The same writer (field manager, event source) for writes a request served by this
    /// replica causes: not gated by leadership.
    pub fn any_replica(&self) -> Writer {
        Writer {
            gate: Gate::AnyReplica,
            ..self.clone()
        }
    }

    pub fn gate(&self) -> Gate {
        self.gate
    }

    pub fn is_leader(&self) -> bool {
        self.leadership.is_leader()
    }

    fn may_write(&self) -> bool {
        self.gate == Gate::AnyReplica || self.leadership.is_leader()
    }

    fn check(&self) -> Result<(), WriteError> {
        if self.may_write() {
            Ok(())
        } else {
            Err(WriteError::NotLeader)
        }
    }

    fn apply_params(&self) -> PatchParams {
        PatchParams::apply(&self.manager).force()
    }

    /// Server-side apply of a whole child object (forced, our field manager).
    pub async fn apply<K>(&self, api: &Api<K>, obj: &K) -> Result<K, WriteError>
    where
        K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + Debug,
    {
        self.check()?;
        let mut body = serde_json::to_value(obj).map_err(kube::Error::SerdeError)?;
        body["apiVersion"] = json!(K::api_version(&()));
        body["kind"] = json!(K::kind(&()));
        Ok(api
            .patch(&obj.name_any(), &self.apply_params(), &Patch::Apply(body))
            .await?)
    }

    /// JSON merge patch of `status`, fenced by `resourceVersion`: the API server answers 409 when
    /// the object changed after we read it, so a stale decision is never written.
    pub async fn merge_status_fenced<K>(
        &self,
        api: &Api<K>,
        name: &str,
        resource_version: &str,
        status: &impl Serialize,
    ) -> Result<K, WriteError>
    where
        K: Resource + DeserializeOwned + Clone + Debug,
    {
        self.check()?;
        let body = json!({ "metadata": { "resourceVersion": resource_version }, "status": status });
        let pp = PatchParams {
            field_manager: Some(self.manager.clone()),
            ..Default::default()
        };
        Ok(api.patch_status(name, &pp, &Patch::Merge(body)).await?)
    }

    /// JSON Patch of the status subresource (use `test` operations to fence it).
    pub async fn json_patch_status<K>(
        &self,
        api: &Api<K>,
        name: &str,
        patch: json_patch::Patch,
    ) -> Result<K, WriteError>
    where
        K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug,
    {
        self.check()?;
        let pp = PatchParams {
            field_manager: Some(self.manager.clone()),
            ..Default::default()
        };
        Ok(api
            .patch_status(name, &pp, &Patch::<()>::Json(patch))
            .await?)
    }

    /// Any other patch of the main resource (merge, JSON, strategic).
    pub async fn patch<K, P>(
        &self,
        api: &Api<K>,
        name: &str,
        patch: &Patch<P>,
    ) -> Result<K, WriteError>
    where
        K: Resource + DeserializeOwned + Clone + Debug,
        P: Serialize + Debug,
    {
        self.check()?;
        let pp = PatchParams {
            field_manager: Some(self.manager.clone()),
            ..Default::default()
        };
        Ok(api.patch(name, &pp, patch).await?)
    }

    pub async fn create<K>(&self, api: &Api<K>, obj: &K) -> Result<K, WriteError>
    where
        K: Resource + Serialize + DeserializeOwned + Clone + Debug,
    {
        self.check()?;
        let pp = PostParams {
            field_manager: Some(self.manager.clone()),
            ..Default::default()
        };
        Ok(api.create(&pp, obj).await?)
    }

    /// Deletes the object `name`, only if its uid is `uid` (when given), so a decision taken on
    /// a stale copy never deletes its successor. `Ok(false)` when that object is already gone.
    pub async fn delete<K>(
        &self,
        api: &Api<K>,
        name: &str,
        uid: Option<&str>,
    ) -> Result<bool, WriteError>
    where
        K: Resource + DeserializeOwned + Clone + Debug,
    {
        self.check()?;
        let dp = DeleteParams {
            preconditions: uid.map(|u| Preconditions {
                uid: Some(u.to_string()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match api.delete(name, &dp).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
            // The uid precondition failed: the object of that name is another one.
            Err(kube::Error::Api(s)) if s.code == 409 && uid.is_some() => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Publishes an Event on `regarding` (leader only, unless [`Writer::any_replica`]). Failures
    /// are logged, never returned: an Event is a courtesy and must not fail a reconcile.
    pub async fn event(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: impl Into<String>,
    ) {
        if !self.may_write() {
            return;
        }
        let mut note: String = note.into();
        super::text::cut_at_char_boundary(&mut note, 1000);
        let ev = Occurrence {
            type_,
            reason,
            action,
            note: &note,
        };
        if let Err(e) = self.events.publish(&ev, regarding).await {
            warn!(reason, error = %e, "could not publish event");
        }
    }
}

/// An RFC 7386 merge patch turning `observed` into `desired` status: changed fields carry the
/// desired value, removed fields (at any depth) carry null, lists are replaced whole.
pub fn status_merge_patch<S: Serialize>(observed: Option<&S>, desired: &S) -> Option<Value> {
    let old = observed.map_or(Value::Object(Map::new()), |o| {
        serde_json::to_value(o).unwrap_or(Value::Null)
    });
    let new = serde_json::to_value(desired).unwrap_or(Value::Null);
    merge_diff(&old, &new)
}

fn merge_diff(old: &Value, new: &Value) -> Option<Value> {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut patch = Map::new();
            for (k, v) in n {
                match o.get(k) {
                    Some(ov) if ov == v => {}
                    Some(ov) => {
                        if let Some(d) = merge_diff(ov, v) {
                            patch.insert(k.clone(), d);
                        }
                    }
                    None => {
                        patch.insert(k.clone(), v.clone());
                    }
                }
            }
            for k in o.keys().filter(|k| !n.contains_key(*k)) {
                patch.insert(k.clone(), Value::Null);
            }
            (!patch.is_empty()).then_some(Value::Object(patch))
        }
        _ if old == new => None,
        _ => Some(new.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kube client whose API server answers every request with a ConfigMap and counts them.
    fn counting_client() -> (Client, Arc<std::sync::atomic::AtomicUsize>) {
        use http_body_util::Full;
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = seen.clone();
        let svc = tower::service_fn(move |_req: http::Request<kube::client::Body>| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let body = json!({"apiVersion": "v1", "kind": "ConfigMap",
                              "metadata": {"name": "c", "namespace": "ns", "resourceVersion": "2"}});
            async move {
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder()
                        .header("content-type", "application/json")
                        .body(Full::new(bytes::Bytes::from(body.to_string())))
                        .unwrap(),
                )
            }
        });
        (Client::new(svc, "ns"), seen)
    }

    #[tokio::test]
    async fn a_standby_refuses_reconciler_writes_and_makes_the_writes_a_request_causes() {
        use k8s_openapi::api::core::v1::ConfigMap;
        let (client, seen) = counting_client();
        let standby = Leadership::elected(std::time::Duration::from_secs(10));
        let reconciler = Writer::new(client.clone(), standby, "exporter", None);
        let api: Api<ConfigMap> = Api::namespaced(client, "ns");
        let status = json!({"x": 1});

        assert_eq!(reconciler.gate(), Gate::Leader);
        let refused = reconciler
            .merge_status_fenced(&api, "c", "1", &status)
            .await;
        assert!(matches!(refused, Err(WriteError::NotLeader)), "{refused:?}");
        let refused = reconciler
            .patch(
                &api,
                "c",
                &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
            )
            .await;
        assert!(matches!(refused, Err(WriteError::NotLeader)), "{refused:?}");
        assert_eq!(
            seen.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "nothing reached the API server"
        );

        let calls = reconciler.any_replica();
        assert_eq!(calls.gate(), Gate::AnyReplica);
        calls
            .merge_status_fenced(&api, "c", "1", &status)
            .await
            .unwrap();
        calls
            .patch(
                &api,
                "c",
                &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
            )
            .await
            .unwrap();
        calls.create(&api, &ConfigMap::default()).await.unwrap();
        assert_eq!(
            seen.load(std::sync::atomic::Ordering::SeqCst),
            3,
            "each write reached the API server"
        );
        // The reconciler's writer is still gated: any_replica is a copy, not a switch.
        assert!(reconciler.delete(&api, "c", None).await.is_err());
    }

    fn api_error(body: serde_json::Value) -> kube::Error {
        kube::Error::Api(Box::new(serde_json::from_value(body).unwrap()))
    }

    #[test]
    fn a_failed_json_patch_test_is_fenced_out_and_a_schema_rejection_is_not() {
        // The bodies the API server (v1.37) sends: a failed `test` op, and a schema rejection.
        let failed_test = api_error(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "the server rejected our request due to an error in our request",
            "reason": "Invalid", "details": {}, "code": 422
        }));
        let schema = api_error(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "MiroirSnapshot.miroir.home-operations.com \"s\" is invalid: status.perNode.a: Unsupported value",
            "reason": "Invalid", "code": 422,
            "details": {"name": "s", "causes": [{"reason": "FieldValueNotSupported", "message": "Unsupported value", "field": "status.perNode.a"}]}
        }));
        let conflict = api_error(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "the object has been modified", "reason": "Conflict", "code": 409
        }));
        assert!(is_fenced_out(&failed_test));
        assert!(is_fenced_out(&conflict));
        assert!(!is_fenced_out(&schema));
        assert!(WriteError::Kube(failed_test).is_conflict());
        assert!(!WriteError::Kube(schema).is_conflict());
    }
}

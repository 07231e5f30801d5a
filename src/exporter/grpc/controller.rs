//! `jumpstarter.v1.ControllerService` (docs/exporter.md: "ControllerService", "Heartbeats", "Dial
//! and Listen").

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::Patch;
use kube::runtime::events::EventType;
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{BinaryMetadataValue, MetadataValue};
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn};

use super::auth::{self, Caller, Kind};
use super::dials::{Dials, PendingDial};
use super::heartbeat::{self, Liveness};
use super::routers::Routers;
use crate::conditions;
use crate::exporter::auth::Authn;
use crate::exporter::context::Context;
use crate::exporter::crd::{Device, Exporter, ExporterStatus, ExporterStatusValue, Lease};
use crate::exporter::decide::exporter::{derive_conditions, is_derived, transition_events};
use crate::exporter::lease::hooks::{self, HOOK_ON_FAILURE_MD, HOOK_PHASE_MD};
use crate::exporter::proto::jumpstarter::v1 as pb;
use crate::exporter::router::token::{self as router_token, RouterKey};
use crate::runtime::writer::status_merge_patch;

pub const RECORDS_HOOKS_MD: &str = "jumpstarter-records-lease-hooks";
pub const LEASE_HOOKS_BIN_MD: &str = "jumpstarter-lease-hooks-bin";
const LABEL_PREFIX: &str = "jumpstarter.dev/";
const LISTEN_QUEUE: usize = 8;
/// How long a Dial waits for the exporter's Listen (docs/exporter.md, "Dial and Listen").
const LISTEN_WAIT: Duration = Duration::from_secs(30);

pub struct Controller {
    pub ctx: Arc<Context>,
    pub watched: Option<String>,
    pub router_key: RouterKey,
    pub routers: Arc<Routers>,
    pub authn: Arc<Authn>,
    /// This replica's Listen streams and the pending dials of every replica (docs/exporter.md,
    /// "Dial and Listen across replicas").
    pub dials: Arc<Dials>,
    /// Cancelled when this serving session ends (shutdown): ends every Status and Listen stream,
    /// so exporters reconnect to another replica and the server's graceful stop does not wait on
    /// them; Dials in flight get a short while longer ([`Dials::dial`]).
    pub stop: tokio_util::sync::CancellationToken,
    /// In-memory liveness of the exporters holding Status streams (docs/exporter.md, "Heartbeats").
    pub liveness: Liveness,
}

/// Counts an open stream in `ucm_exporter_grpc_streams` until dropped.
struct OpenStream(prometheus::IntGauge);

impl OpenStream {
    fn new(m: &crate::exporter::metrics::Metrics, stream: &str) -> Self {
        let g = m.streams.with_label_values(&[stream]);
        g.inc();
        OpenStream(g)
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.dec();
    }
}

pub fn status_value(v: i32) -> ExporterStatusValue {
    usize::try_from(v)
        .ok()
        .and_then(|i| ExporterStatusValue::ALL.get(i).copied())
        .unwrap_or(ExporterStatusValue::Unspecified)
}

fn internal(what: &str) -> Status {
    Status::unavailable(format!("cannot {what}; retry later"))
}

impl Controller {
    pub fn new(
        ctx: Arc<Context>,
        watched: Option<String>,
        router_key: RouterKey,
        routers: Arc<Routers>,
        authn: Arc<Authn>,
        dials: Arc<Dials>,
    ) -> Self {
        Controller {
            ctx,
            watched,
            router_key,
            routers,
            authn,
            dials,
            stop: tokio_util::sync::CancellationToken::new(),
            liveness: Liveness::default(),
        }
    }

    async fn auth<T>(&self, req: &Request<T>, kinds: &[Kind]) -> Result<Caller, Status> {
        auth::authorize(&self.ctx, &self.authn, self.watched.as_deref(), req, kinds).await
    }

    /// Ends every Listen stream (their senders are dropped).
    pub fn close_listeners(&self) {
        self.dials.close_listeners();
    }

    fn exporters(&self, ns: &str) -> Api<Exporter> {
        Api::namespaced(self.ctx.client.clone(), ns)
    }

    fn leases(&self, ns: &str) -> Api<Lease> {
        Api::namespaced(self.ctx.client.clone(), ns)
    }

    /// Read fresh, apply `f`, derive conditions, merge-patch fenced by resourceVersion; retried on
    /// conflict up to 5 times (docs/exporter.md, "Status writes").
    pub async fn write_status(
        &self,
        ns: &str,
        name: &str,
        source: &str,
        f: impl Fn(&mut ExporterStatus, &Exporter),
    ) -> Result<Exporter, Status> {
        let api = self.exporters(ns);
        for _ in 0..5 {
            let exp = api
                .get_opt(name)
                .await
                .map_err(|_| internal("read the exporter"))?
                .ok_or_else(|| Status::not_found("exporter not found"))?;
            let observed = exp.status.clone();
            let mut st = observed.clone().unwrap_or_default();
            f(&mut st, &exp);
            let mut conds = st.conditions.take().unwrap_or_default();
            derive_conditions(
                &mut st,
                &mut conds,
                exp.metadata.generation,
                self.ctx.settings.status.offline_threshold,
                Timestamp::now(),
            );
            st.conditions = Some(conds);
            let Some(mut patch) = status_merge_patch(observed.as_ref(), &st) else {
                return Ok(exp);
            };
            // Conditions are always sent whole.
            patch["conditions"] = serde_json::to_value(&st.conditions).unwrap_or_default();
            let rv = exp.resource_version().unwrap_or_default();
            match self
                .ctx
                .calls
                .merge_status_fenced(&api, name, &rv, &patch)
                .await
            {
                Ok(e) => {
                    self.ctx
                        .metrics
                        .status_writes
                        .with_label_values(&[source])
                        .inc();
                    if st.last_seen.is_some()
                        && st.last_seen != observed.as_ref().and_then(|o| o.last_seen.clone())
                    {
                        // Any write of lastSeen restarts the heartbeat clock ("Heartbeats").
                        self.liveness.wrote(ns, name, Timestamp::now());
                    }
                    self.emit_transitions(&e, observed.as_ref(), &st, source)
                        .await;
                    return Ok(e);
                }
                Err(e) if e.is_conflict() => continue,
                Err(e) => {
                    warn!(exporter = name, namespace = ns, error = %e, "exporter status write failed");
                    return Err(internal("update the exporter status"));
                }
            }
        }
        Err(Status::aborted("exporter status kept changing; retry"))
    }

    /// Events for the transitions this gRPC write persisted (docs/exporter.md, "Events").
    async fn emit_transitions(
        &self,
        persisted: &Exporter,
        old: Option<&ExporterStatus>,
        new: &ExporterStatus,
        source: &str,
    ) {
        let events = transition_events(
            &persisted.name_any(),
            old,
            new,
            self.ctx.settings.status.offline_threshold,
            Timestamp::now(),
        );
        if events.is_empty() {
            return;
        }
        let regarding = persisted.object_ref(&());
        let action = match source {
            "register" => "Register",
            "unregister" => "Unregister",
            "report" => "ReportStatus",
            _ => "Status",
        };
        for e in events {
            let t = if e.warning {
                EventType::Warning
            } else {
                EventType::Normal
            };
            self.ctx
                .calls
                .event(&regarding, t, e.reason, action, e.note)
                .await;
        }
    }

    fn now_time() -> Time {
        conditions::time(Timestamp::now())
    }

    /// The Status message for `exp` (from `leaseRef`; the client from the lease's `clientRef`).
    /// `cache` keeps the last lease's client so a heartbeat echo costs no Lease read.
    async fn status_response(
        &self,
        exp: &Exporter,
        cache: &mut Option<(String, Option<String>)>,
    ) -> pb::StatusResponse {
        let Some(lease) = exp
            .status
            .as_ref()
            .and_then(|s| s.lease_ref.as_ref())
            .map(|r| r.name.clone())
        else {
            return pb::StatusResponse::default();
        };
        let client = match cache {
            Some((name, client)) if *name == lease => client.clone(),
            _ => {
                let ns = exp.namespace().unwrap_or_default();
                let client = self
                    .leases(&ns)
                    .get_opt(&lease)
                    .await
                    .ok()
                    .flatten()
                    .map(|l| l.spec.client_ref.name);
                if client.is_some() {
                    *cache = Some((lease.clone(), client.clone()));
                }
                client
            }
        };
        pb::StatusResponse {
            leased: true,
            lease_name: Some(lease),
            client_name: client,
        }
    }

    /// A due heartbeat (docs/exporter.md, "Heartbeats"): `lastSeen` alone, unfenced, unless
    /// something derived from it changes, then a full fenced write. Returns the persisted Exporter.
    async fn heartbeat(&self, ns: &str, name: &str, latest: &Exporter) -> Result<Exporter, Status> {
        let now = Timestamp::now();
        let status = latest.status.clone().unwrap_or_default();
        let kind = heartbeat::write_kind(
            &status,
            latest.metadata.generation,
            self.ctx.settings.status.offline_threshold,
            now,
        );
        let seen = conditions::time(now);
        if kind == heartbeat::Write::LastSeenOnly {
            let patch: json_patch::Patch = serde_json::from_value(
                json!([{"op": "add", "path": "/status/lastSeen", "value": seen}]),
            )
            .expect("valid JSON patch");
            match self
                .ctx
                .calls
                .json_patch_status(&self.exporters(ns), name, patch)
                .await
            {
                Ok(e) => {
                    self.ctx
                        .metrics
                        .status_writes
                        .with_label_values(&["heartbeat"])
                        .inc();
                    self.liveness.wrote(ns, name, Timestamp::now());
                    return Ok(e);
                }
                Err(e) => {
                    debug!(exporter = name, error = %e, "lastSeen patch failed; trying a full write");
                }
            }
        }
        self.write_status(ns, name, "heartbeat", |s, _| {
            s.last_seen = Some(seen.clone());
            heartbeat::recover_from_stale(s);
        })
        .await
    }

    /// Status stream body: watch the own Exporter and send lease changes; persist `lastSeen`
    /// only when it is due; re-establish the watch when our own write does not come back on it
    /// within W (docs/exporter.md, "Heartbeats").
    async fn status_loop(
        self: Arc<Self>,
        ns: String,
        name: String,
        tx: mpsc::Sender<Result<pb::StatusResponse, Status>>,
        connected: Exporter,
    ) {
        self.liveness.open(&ns, &name);
        struct Close<'a>(&'a Liveness, &'a str, &'a str);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                self.0.close(self.1, self.2);
            }
        }
        let _close = Close(&self.liveness, &ns, &name);
        let _open = OpenStream::new(&self.ctx.metrics, "status");
        let api = self.exporters(&ns);
        let watch = || {
            let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
            watcher::watcher(api.clone(), cfg).boxed()
        };
        let mut events = watch();
        let w = self.ctx.settings.heartbeat_interval;
        let mut beat = heartbeat::spacing(w, rand::random::<f64>());
        let mut latest = connected;
        // (lastSeen we wrote, when it must have come back on the watch).
        let mut awaiting: Option<(Timestamp, tokio::time::Instant)> = None;
        // After a failed write, do not retry before this instant.
        let mut retry_at = tokio::time::Instant::now();
        let mut last: Option<pb::StatusResponse> = None;
        let mut lease_cache = None;
        loop {
            let stored = latest
                .status
                .as_ref()
                .and_then(|s| s.last_seen.as_ref())
                .map(|t| t.0);
            let due = heartbeat::next_due(stored, self.liveness.last_write(&ns, &name), beat);
            let until_due = Timestamp::now()
                .duration_until(due)
                .max(SignedDuration::ZERO)
                .unsigned_abs();
            let mut wake = (tokio::time::Instant::now() + until_due).max(retry_at);
            if let Some((_, deadline)) = awaiting {
                wake = wake.min(deadline);
            }
            tokio::select! {
                _ = tx.closed() => return,
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep_until(wake) => {
                    if awaiting.is_some_and(|(_, d)| tokio::time::Instant::now() >= d) {
                        warn!(exporter = %name, namespace = %ns, "own lastSeen write not seen on the watch; re-establishing it");
                        events = watch();
                        awaiting = None;
                        continue;
                    }
                    // Claimed against the shared clock, so another stream of this exporter or a
                    // report that landed meanwhile makes this beat unnecessary.
                    let now = Timestamp::now();
                    let Some(previous) = self.liveness.try_claim(&ns, &name, stored, beat, now) else {
                        continue;
                    };
                    match self.heartbeat(&ns, &name, &latest).await {
                        Ok(e) => {
                            let written = e.status.as_ref().and_then(|s| s.last_seen.as_ref()).map(|t| t.0);
                            if let Some(v) = written {
                                awaiting = Some((v, tokio::time::Instant::now() + w.unsigned_abs()));
                            }
                            latest = e;
                            beat = heartbeat::spacing(w, rand::random::<f64>());
                        }
                        Err(e) if e.code() == tonic::Code::NotFound => return,
                        Err(_) => {
                            self.liveness.unclaim(&ns, &name, now, previous);
                            debug!(exporter = %name, "heartbeat write failed; retrying shortly");
                            retry_at = tokio::time::Instant::now() + (w.unsigned_abs() / 4).max(Duration::from_secs(1));
                        }
                    }
                }
                ev = events.next() => {
                    let exp = match ev {
                        Some(Ok(watcher::Event::Apply(e) | watcher::Event::InitApply(e))) => e,
                        Some(Ok(watcher::Event::Delete(_))) => return,
                        Some(Ok(_)) => continue,
                        Some(Err(_)) => { tokio::time::sleep(Duration::from_secs(1)).await; continue; }
                        None => { events = watch(); continue; }
                    };
                    let seen = exp.status.as_ref().and_then(|s| s.last_seen.as_ref()).map(|t| t.0);
                    if awaiting.is_some_and(|(v, _)| seen >= Some(v)) {
                        awaiting = None;
                    }
                    let resp = self.status_response(&exp, &mut lease_cache).await;
                    latest = exp;
                    if last.as_ref() != Some(&resp) {
                        if tx.send(Ok(resp.clone())).await.is_err() { return; }
                        last = Some(resp);
                    }
                }
            }
        }
    }

    async fn lease_for_client(&self, caller: &Caller, lease: &str) -> Result<Lease, Status> {
        let l = self
            .leases(&caller.namespace)
            .get_opt(lease)
            .await
            .map_err(|_| internal("read the lease"))?
            .ok_or_else(|| Status::not_found("lease not found"))?;
        if l.spec.client_ref.name != caller.name {
            return Err(Status::permission_denied("permission denied"));
        }
        Ok(l)
    }

    async fn release(&self, ns: &str, lease: &str) -> Result<(), Status> {
        self.ctx
            .calls
            .patch(
                &self.leases(ns),
                lease,
                &Patch::Merge(json!({"spec": {"release": true}})),
            )
            .await
            .map(|_| ())
            .map_err(|_| internal("release the lease"))
    }

    /// Exporter status gate for Dial (docs/exporter.md, "Dial and Listen").
    async fn dial_gate(&self, ns: &str, exporter: &str) -> Result<Exporter, Status> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let mut backoff = Duration::from_millis(500);
        loop {
            let exp = self
                .exporters(ns)
                .get_opt(exporter)
                .await
                .map_err(|_| internal("read the exporter"))?
                .ok_or_else(|| Status::failed_precondition("exporter not found"))?;
            use ExporterStatusValue as S;
            // An exporter that does not report its status is never refused for it, as upstream
            // lets such exporters (an empty status) through (docs/exporter.md, "Exporters that
            // do not report a status").
            if exp.status.as_ref().is_some_and(is_derived) {
                return Ok(exp);
            }
            match exp.status.as_ref().and_then(|s| s.exporter_status) {
                None
                | Some(S::Unspecified | S::LeaseReady | S::BeforeLeaseHook | S::AfterLeaseHook) => {
                    return Ok(exp);
                }
                Some(S::Available) if tokio::time::Instant::now() + backoff < deadline => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(3));
                }
                Some(S::Available) => {
                    return Err(Status::failed_precondition(
                        "exporter is not ready for connections (still Available)",
                    ));
                }
                Some(S::Offline) => return Err(Status::failed_precondition("exporter is offline")),
                Some(S::BeforeLeaseHookFailed) => {
                    return Err(Status::failed_precondition("beforeLease hook failed"));
                }
                Some(S::AfterLeaseHookFailed) => {
                    return Err(Status::failed_precondition("afterLease hook failed"));
                }
            }
        }
    }
}

/// The optional ReportStatus hook metadata (docs/exporter.md, "Lease hooks: metadata"); non-UTF-8
/// values count as invalid.
fn hook_metadata<T>(req: &Request<T>) -> (hooks::HookMetadata, Vec<String>) {
    let mut invalid = Vec::new();
    let mut values = |key: &str| -> Vec<String> {
        req.metadata()
            .get_all(key)
            .iter()
            .filter_map(|v| match v.to_str() {
                Ok(s) => Some(s.to_string()),
                Err(_) => {
                    invalid.push(format!("non-text {key} value"));
                    None
                }
            })
            .collect()
    };
    let phases = values(HOOK_PHASE_MD);
    let actions = values(HOOK_ON_FAILURE_MD);
    let (md, mut problems) = hooks::parse_metadata(
        phases.iter().map(String::as_str),
        actions.iter().map(String::as_str),
    );
    invalid.append(&mut problems);
    (md, invalid)
}

fn hooks_header<T>(resp: &mut Response<T>, exp: &Exporter) {
    if let Some(h) = exp.status.as_ref().and_then(|s| s.lease_hooks.as_ref())
        && let Ok(json) = serde_json::to_vec(h)
    {
        resp.metadata_mut()
            .insert_bin(LEASE_HOOKS_BIN_MD, BinaryMetadataValue::from_bytes(&json));
    }
}

#[tonic::async_trait]
impl pb::controller_service_server::ControllerService for Arc<Controller> {
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let caller = self.auth(&req, &[Kind::Exporter]).await?;
        let declares = req
            .metadata()
            .get(RECORDS_HOOKS_MD)
            .is_some_and(|v| v.to_str().ok() == Some("v1"));
        let body = req.into_inner();
        let (ns, name) = (caller.namespace.as_str(), caller.name.as_str());
        // Labels: jumpstarter.dev/* are replaced by the request's; the user's stay.
        let exp = self
            .exporters(ns)
            .get(name)
            .await
            .map_err(|_| internal("read the exporter"))?;
        let mut labels = serde_json::Map::new();
        for k in exp.labels().keys().filter(|k| k.starts_with(LABEL_PREFIX)) {
            labels.insert(k.clone(), serde_json::Value::Null);
        }
        for (k, v) in body
            .labels
            .iter()
            .filter(|(k, _)| k.starts_with(LABEL_PREFIX))
        {
            labels.insert(k.clone(), json!(v));
        }
        labels.retain(|k, v| exp.labels().get(k).map(|o| json!(o)) != Some(v.clone()));
        if !labels.is_empty() {
            self.ctx
                .calls
                .patch(
                    &self.exporters(ns),
                    name,
                    &Patch::Merge(json!({"metadata": {"labels": labels}})),
                )
                .await
                .map_err(|_| internal("update the exporter labels"))?;
        }
        let devices: Vec<Device> = body
            .reports
            .iter()
            .map(|r| Device {
                uuid: Some(r.uuid.clone()),
                parent_uuid: r.parent_uuid.clone(),
                labels: (!r.labels.is_empty()).then(|| {
                    r.labels
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect()
                }),
            })
            .collect();
        let exp = self
            .write_status(ns, name, "register", |s, _| {
                s.devices = Some(devices.clone());
                s.records_lease_hooks = Some(declares);
                if declares {
                    s.exporter_status = Some(ExporterStatusValue::Unspecified);
                    s.status_message = Some("Exporter registered".into());
                } else {
                    s.lease_hooks = None;
                }
            })
            .await?;
        let mut resp = Response::new(pb::RegisterResponse {
            uuid: exp.uid().unwrap_or_default(),
        });
        if declares {
            resp.metadata_mut()
                .insert(RECORDS_HOOKS_MD, MetadataValue::from_static("v1"));
            hooks_header(&mut resp, &exp);
        }
        Ok(resp)
    }

    async fn unregister(
        &self,
        req: Request<pb::UnregisterRequest>,
    ) -> Result<Response<pb::UnregisterResponse>, Status> {
        let caller = self.auth(&req, &[Kind::Exporter]).await?;
        let reason = req.into_inner().reason;
        let msg = if reason.is_empty() {
            "Exporter unregistered".to_string()
        } else {
            reason
        };
        self.write_status(&caller.namespace, &caller.name, "unregister", |s, _| {
            s.devices = None;
            s.exporter_status = Some(ExporterStatusValue::Offline);
            s.status_message = Some(msg.clone());
        })
        .await?;
        Ok(Response::new(pb::UnregisterResponse {}))
    }

    async fn report_status(
        &self,
        req: Request<pb::ReportStatusRequest>,
    ) -> Result<Response<pb::ReportStatusResponse>, Status> {
        let caller = self.auth(&req, &[Kind::Exporter]).await?;
        let (hook_md, invalid) = hook_metadata(&req);
        for problem in &invalid {
            warn!(exporter = %caller.name, namespace = %caller.namespace, "ignoring lease hook metadata: {problem}");
        }
        let body = req.into_inner();
        let value = status_value(body.status);
        let now = Controller::now_time();
        let exp = self
            .write_status(&caller.namespace, &caller.name, "report", |s, _| {
                // The record sees the stored exporterStatus as `prev` (docs/exporter.md, "Lease
                // hooks: transitions").
                hooks::apply_report(
                    s,
                    &hooks::Report {
                        status: value,
                        message: body.message.as_deref(),
                        metadata: &hook_md,
                    },
                    &now,
                );
                s.exporter_status = Some(value);
                s.status_message = body.message.clone();
                s.last_seen = Some(now.clone());
            })
            .await?;
        if body.release_lease == Some(true)
            && let Some(lease) = exp.status.as_ref().and_then(|s| s.lease_ref.as_ref())
            && let Err(e) = self.release(&caller.namespace, &lease.name).await
        {
            warn!(exporter = %caller.name, code = ?e.code(), "release_lease from ReportStatus failed");
        }
        Ok(Response::new(pb::ReportStatusResponse {}))
    }

    async fn listen(
        &self,
        req: Request<pb::ListenRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<pb::ListenResponse>>, Status> {
        let caller = self.auth(&req, &[Kind::Exporter]).await?;
        let lease_name = req.into_inner().lease_name;
        let lease = self
            .leases(&caller.namespace)
            .get_opt(&lease_name)
            .await
            .map_err(|_| internal("read the lease"))?
            .ok_or_else(|| Status::not_found("lease not found"))?;
        if lease.status.as_ref().and_then(|s| s.exporter_ref_name()) != Some(caller.name.as_str()) {
            return Err(Status::permission_denied("permission denied"));
        }
        let (tx, rx) = mpsc::channel(LISTEN_QUEUE);
        // A new Listen supersedes the previous one on this replica: dropping its sender ends it.
        self.dials.listen((caller.namespace, lease_name), tx);
        let open = OpenStream::new(&self.ctx.metrics, "listen");
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(
            move |m| {
                let _ = &open;
                m
            },
        ))))
    }

    async fn status(
        &self,
        req: Request<pb::StatusRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<pb::StatusResponse>>, Status> {
        let caller = self.auth(&req, &[Kind::Exporter]).await?;
        let now = Controller::now_time();
        let exp = self
            .write_status(&caller.namespace, &caller.name, "connect", |s, _| {
                s.last_seen = Some(now.clone());
                if s.exporter_status == Some(ExporterStatusValue::Offline) {
                    s.exporter_status = None;
                    s.status_message = None;
                }
            })
            .await?;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(
            self.clone()
                .status_loop(caller.namespace, caller.name, tx, exp.clone()),
        );
        let mut resp: Response<tonic::codegen::BoxStream<pb::StatusResponse>> =
            Response::new(Box::pin(ReceiverStream::new(rx)));
        if exp.status.as_ref().and_then(|s| s.records_lease_hooks) == Some(true) {
            hooks_header(&mut resp, &exp);
        }
        Ok(resp)
    }

    async fn dial(
        &self,
        req: Request<pb::DialRequest>,
    ) -> Result<Response<pb::DialResponse>, Status> {
        let caller = self.auth(&req, &[Kind::Client]).await?;
        let lease_name = req.into_inner().lease_name;
        let lease = self.lease_for_client(&caller, &lease_name).await?;
        let exporter = lease
            .status
            .as_ref()
            .and_then(|s| s.exporter_ref_name())
            .ok_or_else(|| Status::failed_precondition("lease has no exporter yet"))?
            .to_string();
        let exp = self.dial_gate(&caller.namespace, &exporter).await?;
        let router_endpoint = self
            .routers
            .choose(&self.ctx.settings.config.routers, exp.labels())?;
        let claims = router_token::claims(Timestamp::now());
        let token = router_token::sign(&self.router_key, &claims);
        // An exporter opens Listen only once its Status stream shows the lease, so a Dial may
        // come first: wait for it a bounded time, on whichever replica it listens
        // (docs/exporter.md, "Dial and Listen", "Dial and Listen across replicas").
        let dial = PendingDial {
            key: (caller.namespace.clone(), lease_name.clone()),
            router_endpoint: router_endpoint.clone(),
            claims,
        };
        self.dials
            .dial(dial, tokio::time::Instant::now() + LISTEN_WAIT, &self.stop)
            .await?;
        // The one place ucm can name the router: jmp reports an unreachable one only as an
        // unreachable exporter (docs/operations.md, "Jumpstarter from the host (jmp)").
        info!(namespace = %caller.namespace, lease = %lease_name, client = %caller.name, %exporter,
            "dial: client and exporter meet at router {router_endpoint}; both must reach that address");
        Ok(Response::new(pb::DialResponse {
            router_endpoint,
            router_token: token,
        }))
    }

    async fn get_lease(
        &self,
        req: Request<pb::GetLeaseRequest>,
    ) -> Result<Response<pb::GetLeaseResponse>, Status> {
        let caller = self.auth(&req, &[Kind::Client]).await?;
        let l = self
            .lease_for_client(&caller, &req.into_inner().name)
            .await?;
        let ts = |t: &Option<Time>| {
            t.as_ref().map(|t| prost_types::Timestamp {
                seconds: t.0.as_second(),
                nanos: 0,
            })
        };
        let st = l.status.clone().unwrap_or_default();
        Ok(Response::new(pb::GetLeaseResponse {
            duration: l
                .spec
                .duration
                .as_deref()
                .and_then(|d| crate::godur::parse_signed(d).ok())
                .map(|d| prost_types::Duration {
                    seconds: d.as_secs(),
                    nanos: d.subsec_nanos(),
                }),
            selector: Some(pb::LabelSelector {
                match_expressions: vec![],
                match_labels: l
                    .spec
                    .selector
                    .match_labels
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .collect(),
            }),
            begin_time: ts(&st.begin_time),
            end_time: ts(&st.end_time),
            exporter_uuid: None,
            conditions: vec![],
        }))
    }

    /// Legacy lease creation (docs/exporter.md, "ControllerService"): a UUIDv7 name, the selector
    /// and the duration.
    async fn request_lease(
        &self,
        req: Request<pb::RequestLeaseRequest>,
    ) -> Result<Response<pb::RequestLeaseResponse>, Status> {
        let caller = self.auth(&req, &[Kind::Client]).await?;
        let name = super::client::lease_name("");
        let lease = super::lease_pb::lease_from_request(
            req.get_ref(),
            &caller.namespace,
            &name,
            &caller.name,
        )
        .map_err(Status::invalid_argument)?;
        let created = super::client::create_lease(&self.ctx, &lease).await?;
        Ok(Response::new(pb::RequestLeaseResponse {
            name: created.name_any(),
        }))
    }

    async fn release_lease(
        &self,
        req: Request<pb::ReleaseLeaseRequest>,
    ) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
        let caller = self.auth(&req, &[Kind::Exporter, Kind::Client]).await?;
        let name = req.into_inner().name;
        let lease = self
            .leases(&caller.namespace)
            .get_opt(&name)
            .await
            .map_err(|_| internal("read the lease"))?
            .ok_or_else(|| Status::not_found("lease not found"))?;
        let holder = match caller.kind {
            Kind::Client => lease.spec.client_ref.name == caller.name,
            Kind::Exporter => {
                lease.status.as_ref().and_then(|s| s.exporter_ref_name())
                    == Some(caller.name.as_str())
            }
        };
        if !holder {
            return Err(Status::permission_denied("permission denied"));
        }
        let done =
            lease.spec.release == Some(true) || lease.status.as_ref().is_some_and(|s| s.ended);
        if !done {
            self.release(&caller.namespace, &name).await?;
        }
        Ok(Response::new(pb::ReleaseLeaseResponse {}))
    }

    async fn list_leases(
        &self,
        req: Request<pb::ListLeasesRequest>,
    ) -> Result<Response<pb::ListLeasesResponse>, Status> {
        let caller = self.auth(&req, &[Kind::Client]).await?;
        let list = self
            .leases(&caller.namespace)
            .list(&Default::default())
            .await
            .map_err(|_| internal("list leases"))?;
        let names = list
            .items
            .into_iter()
            .filter(|l| l.spec.client_ref.name == caller.name)
            .filter(|l| !l.status.as_ref().is_some_and(|s| s.ended))
            .map(|l| l.name_any())
            .collect();
        Ok(Response::new(pb::ListLeasesResponse { names }))
    }
}

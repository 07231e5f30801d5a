//! `jumpstarter.client.v1.ClientService` (docs/exporter.md, "ClientService"), what `jmp` uses:
//! exporters and leases by resource name (`namespaces/<ns>/<kind>/<name>`), plus RotateToken.
//! Callers are Clients of the namespace the request names. Reads cover the namespace (as upstream:
//! `jmp get leases -A`); changes need the lease's owner. Errors carry a gRPC code and our own text,
//! never Kubernetes error text or token contents (docs/exporter.md, "Who may call").

use std::collections::BTreeMap;
use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ListParams, Patch};
use kube::{Api, ResourceExt};
use serde_json::json;
use tonic::{Request, Response, Status};
use tracing::{debug, info};

use super::auth::{self, Caller, Kind};
use super::lease_pb::{self, TimeFields};
use crate::exporter::auth::Authn;
use crate::exporter::auth::token;
use crate::exporter::context::Context;
use crate::exporter::crd::{Client, Exporter, Lease};
use crate::exporter::decide::lease::ENDED_LABEL;
use crate::exporter::proto::jumpstarter::client::v1 as cpb;
use crate::runtime::WriteError;
use crate::runtime::writer::status_merge_patch;

pub struct ClientApi {
    pub ctx: Arc<Context>,
    pub watched: Option<String>,
    pub authn: Arc<Authn>,
}

/// A read failure: NotFound keeps its meaning, anything else is retryable.
fn read_error(e: &kube::Error, what: &str) -> Status {
    match e {
        kube::Error::Api(s) if s.code == 404 => Status::not_found(format!("{what} not found")),
        kube::Error::Api(s) if s.code == 400 => {
            Status::invalid_argument(format!("invalid request for {what}"))
        }
        _ => Status::unavailable(format!("cannot read {what}; retry later")),
    }
}

/// A write failure, logged at debug with the API server's answer (no tokens are ever written
/// through here except RotateToken's Secret patch, whose error text carries no data).
fn write_error(e: &WriteError, what: &str) -> Status {
    debug!(error = %e, "{what} failed");
    match e {
        WriteError::NotLeader => Status::unavailable("this replica is not the leader; retry"),
        WriteError::Kube(kube::Error::Api(s)) => match s.code {
            404 => Status::not_found(format!("{what}: not found")),
            409 if s.reason == "AlreadyExists" => {
                Status::already_exists(format!("{what}: already exists"))
            }
            409 => Status::aborted(format!("{what}: the object changed; retry")),
            400 | 422 => Status::invalid_argument(format!(
                "{what}: rejected by validation (check names, tags and times)"
            )),
            _ => Status::unavailable(format!("{what} failed; retry later")),
        },
        WriteError::Kube(_) => Status::unavailable(format!("{what} failed; retry later")),
    }
}

fn page(page_size: i32, page_token: &str) -> Result<ListParams, Status> {
    let mut lp = ListParams::default();
    if page_size < 0 {
        return Err(Status::invalid_argument("page_size must not be negative"));
    }
    if page_size > 0 {
        lp = lp.limit(page_size as u32);
    }
    if !page_token.is_empty() {
        lp = lp.continue_token(page_token);
    }
    Ok(lp)
}

/// Creates a Lease made by a gRPC handler (ClientService.CreateLease, ControllerService.RequestLease).
pub async fn create_lease(ctx: &Context, lease: &Lease) -> Result<Lease, Status> {
    let api: Api<Lease> =
        Api::namespaced(ctx.client.clone(), &lease.namespace().unwrap_or_default());
    let created = ctx
        .calls
        .create(&api, lease)
        .await
        .map_err(|e| write_error(&e, "create lease"))?;
    info!(lease = %created.name_any(), namespace = %created.namespace().unwrap_or_default(),
          client = %created.spec.client_ref.name, "lease created over gRPC");
    Ok(created)
}

/// A new lease name: the request's `lease_id`, else a UUIDv7 (docs/exporter.md, "Lease time
/// fields").
pub fn lease_name(lease_id: &str) -> String {
    if lease_id.is_empty() {
        uuid::Uuid::now_v7().to_string()
    } else {
        lease_id.to_string()
    }
}

impl ClientApi {
    pub fn new(ctx: Arc<Context>, watched: Option<String>, authn: Arc<Authn>) -> Self {
        ClientApi {
            ctx,
            watched,
            authn,
        }
    }

    /// Authenticates a Client of `namespace` (the namespace named by the request).
    async fn caller<T>(&self, req: &Request<T>, namespace: &str) -> Result<Caller, Status> {
        let caller = auth::authorize(
            &self.ctx,
            &self.authn,
            self.watched.as_deref(),
            req,
            &[Kind::Client],
        )
        .await?;
        if caller.namespace != namespace {
            return Err(Status::permission_denied(format!(
                "Client {}/{} may not act in namespace {namespace}",
                caller.namespace, caller.name
            )));
        }
        Ok(caller)
    }

    fn leases(&self, ns: &str) -> Api<Lease> {
        Api::namespaced(self.ctx.client.clone(), ns)
    }

    fn exporters(&self, ns: &str) -> Api<Exporter> {
        Api::namespaced(self.ctx.client.clone(), ns)
    }

    async fn owned_lease(&self, caller: &Caller, name: &str, op: &str) -> Result<Lease, Status> {
        let lease = self
            .leases(&caller.namespace)
            .get(name)
            .await
            .map_err(|e| read_error(&e, "lease"))?;
        if lease.spec.client_ref.name != caller.name {
            return Err(Status::permission_denied(format!(
                "{op} permission denied: only the lease owner may do this"
            )));
        }
        Ok(lease)
    }
}

/// The UpdateLease decision, pure: new time fields and a transfer target applied to `lease`.
pub fn updated_spec(
    lease: &Lease,
    req: &cpb::Lease,
    new_client: Option<&str>,
) -> Result<crate::exporter::crd::LeaseSpec, Status> {
    let mut spec = lease.spec.clone();
    let st = lease.status.clone().unwrap_or_default();
    let given_begin = req
        .begin_time
        .as_ref()
        .map(lease_pb::ts_from_pb)
        .transpose()
        .map_err(Status::invalid_argument)?;
    let given_end = req
        .end_time
        .as_ref()
        .map(lease_pb::ts_from_pb)
        .transpose()
        .map_err(Status::invalid_argument)?;
    let given_duration = req.duration.as_ref().map(lease_pb::dur_from_pb);
    if given_begin.is_some() || given_end.is_some() || given_duration.is_some() {
        if st.ended {
            return Err(Status::failed_precondition(
                "cannot modify time fields: lease has already ended",
            ));
        }
        let old = lease_pb::spec_times(&spec);
        if let Some(b) = given_begin
            && st.exporter_ref_name().is_some()
            && old.begin.map(|o| o.as_second()) != Some(b.as_second())
        {
            return Err(Status::failed_precondition(
                "cannot update BeginTime: lease has already started",
            ));
        }
        let merged = TimeFields {
            begin: given_begin.or(old.begin),
            end: given_end.or(old.end),
            duration: given_duration.or(old.duration),
        };
        let times = lease_pb::reconcile_time_fields(merged).map_err(Status::invalid_argument)?;
        lease_pb::set_spec_times(&mut spec, times);
    }
    if let Some(target) = new_client {
        if st.exporter_ref_name().is_none() {
            return Err(Status::failed_precondition(
                "cannot transfer lease: lease has not started yet",
            ));
        }
        if st.ended {
            return Err(Status::failed_precondition(
                "cannot transfer lease: lease has already ended",
            ));
        }
        spec.client_ref.name = target.to_string();
    }
    Ok(spec)
}

#[tonic::async_trait]
impl cpb::client_service_server::ClientService for Arc<ClientApi> {
    async fn get_exporter(
        &self,
        req: Request<cpb::GetExporterRequest>,
    ) -> Result<Response<cpb::Exporter>, Status> {
        let (ns, name) = lease_pb::parse_object(&req.get_ref().name, "exporters")
            .map_err(Status::invalid_argument)?;
        self.caller(&req, &ns).await?;
        let e = self
            .exporters(&ns)
            .get(&name)
            .await
            .map_err(|e| read_error(&e, "exporter"))?;
        Ok(Response::new(lease_pb::exporter_to_pb(
            &e,
            &self.ctx.settings.config,
        )))
    }

    async fn list_exporters(
        &self,
        req: Request<cpb::ListExportersRequest>,
    ) -> Result<Response<cpb::ListExportersResponse>, Status> {
        let ns =
            lease_pb::parse_namespace(&req.get_ref().parent).map_err(Status::invalid_argument)?;
        self.caller(&req, &ns).await?;
        let body = req.into_inner();
        let mut lp = page(body.page_size, &body.page_token)?;
        if !body.filter.trim().is_empty() {
            lp = lp.labels(&body.filter);
        }
        let list = self
            .exporters(&ns)
            .list(&lp)
            .await
            .map_err(|e| read_error(&e, "exporters"))?;
        Ok(Response::new(cpb::ListExportersResponse {
            exporters: list
                .items
                .iter()
                .map(|e| lease_pb::exporter_to_pb(e, &self.ctx.settings.config))
                .collect(),
            next_page_token: list.metadata.continue_.unwrap_or_default(),
        }))
    }

    async fn get_lease(
        &self,
        req: Request<cpb::GetLeaseRequest>,
    ) -> Result<Response<cpb::Lease>, Status> {
        let (ns, name) = lease_pb::parse_object(&req.get_ref().name, "leases")
            .map_err(Status::invalid_argument)?;
        self.caller(&req, &ns).await?;
        let l = self
            .leases(&ns)
            .get(&name)
            .await
            .map_err(|e| read_error(&e, "lease"))?;
        Ok(Response::new(lease_pb::lease_to_pb(&l, Timestamp::now())))
    }

    async fn list_leases(
        &self,
        req: Request<cpb::ListLeasesRequest>,
    ) -> Result<Response<cpb::ListLeasesResponse>, Status> {
        let ns =
            lease_pb::parse_namespace(&req.get_ref().parent).map_err(Status::invalid_argument)?;
        self.caller(&req, &ns).await?;
        let body = req.into_inner();
        let mut parts: Vec<String> = vec![];
        if !body.filter.trim().is_empty() {
            parts.push(body.filter.clone());
        }
        if let Some(tags) = lease_pb::tag_filter_selector(&body.tag_filter)
            .map_err(|e| Status::invalid_argument(format!("invalid tag_filter: {e}")))?
        {
            parts.push(tags);
        }
        // Active only unless asked otherwise: the ended label is the cheap filter
        // (docs/exporter.md, "Objects").
        if body.only_active.unwrap_or(true) {
            parts.push(format!("!{ENDED_LABEL}"));
        }
        let mut lp = page(body.page_size, &body.page_token)?;
        if !parts.is_empty() {
            lp = lp.labels(&parts.join(","));
        }
        let list = self
            .leases(&ns)
            .list(&lp)
            .await
            .map_err(|e| read_error(&e, "leases"))?;
        let now = Timestamp::now();
        Ok(Response::new(cpb::ListLeasesResponse {
            leases: list
                .items
                .iter()
                .map(|l| lease_pb::lease_to_pb(l, now))
                .collect(),
            next_page_token: list.metadata.continue_.unwrap_or_default(),
        }))
    }

    async fn create_lease(
        &self,
        req: Request<cpb::CreateLeaseRequest>,
    ) -> Result<Response<cpb::Lease>, Status> {
        let ns =
            lease_pb::parse_namespace(&req.get_ref().parent).map_err(Status::invalid_argument)?;
        let caller = self.caller(&req, &ns).await?;
        let body = req.into_inner();
        let lease = body
            .lease
            .ok_or_else(|| Status::invalid_argument("lease is required"))?;
        let has_exporter = lease.exporter_name.as_ref().is_some_and(|n| !n.is_empty());
        if lease.selector.is_empty() && !has_exporter {
            return Err(Status::invalid_argument(
                "one of selector or exporter_name is required",
            ));
        }
        lease_pb::validate_tags(
            &lease.tags.clone().into_iter().collect(),
            self.ctx.settings.config.max_tags as usize,
        )
        .map_err(|e| Status::invalid_argument(format!("invalid lease tags: {e}")))?;
        let name = lease_name(&body.lease_id);
        let obj = lease_pb::lease_from_pb(&lease, &ns, &name, &caller.name)
            .map_err(Status::invalid_argument)?;
        let created = create_lease(&self.ctx, &obj).await?;
        Ok(Response::new(lease_pb::lease_to_pb(
            &created,
            Timestamp::now(),
        )))
    }

    async fn update_lease(
        &self,
        req: Request<cpb::UpdateLeaseRequest>,
    ) -> Result<Response<cpb::Lease>, Status> {
        let name_id = req
            .get_ref()
            .lease
            .as_ref()
            .map(|l| l.name.clone())
            .ok_or_else(|| Status::invalid_argument("lease is required"))?;
        let (ns, name) =
            lease_pb::parse_object(&name_id, "leases").map_err(Status::invalid_argument)?;
        let caller = self.caller(&req, &ns).await?;
        let body = req.into_inner().lease.unwrap_or_default();
        let lease = self.owned_lease(&caller, &name, "UpdateLease").await?;
        let target = match body.client.as_deref().filter(|c| !c.is_empty()) {
            None => None,
            Some(c) => {
                let (tns, tname) =
                    lease_pb::parse_object(c, "clients").map_err(Status::invalid_argument)?;
                if tns != ns {
                    return Err(Status::invalid_argument(
                        "cannot transfer lease to client in different namespace",
                    ));
                }
                let clients: Api<Client> = Api::namespaced(self.ctx.client.clone(), &ns);
                if clients
                    .get_opt(&tname)
                    .await
                    .map_err(|e| read_error(&e, "client"))?
                    .is_none()
                {
                    return Err(Status::invalid_argument(format!(
                        "target client {tname:?} not found"
                    )));
                }
                Some(tname)
            }
        };
        let spec = updated_spec(&lease, &body, target.as_deref())?;
        let Some(diff) = status_merge_patch(Some(&lease.spec), &spec) else {
            return Ok(Response::new(lease_pb::lease_to_pb(
                &lease,
                Timestamp::now(),
            )));
        };
        let patch = json!({
            "metadata": {"resourceVersion": lease.resource_version()},
            "spec": diff,
        });
        let updated = self
            .ctx
            .calls
            .patch(&self.leases(&ns), &name, &Patch::Merge(patch))
            .await
            .map_err(|e| write_error(&e, "update lease"))?;
        Ok(Response::new(lease_pb::lease_to_pb(
            &updated,
            Timestamp::now(),
        )))
    }

    async fn delete_lease(
        &self,
        req: Request<cpb::DeleteLeaseRequest>,
    ) -> Result<Response<()>, Status> {
        let (ns, name) = lease_pb::parse_object(&req.get_ref().name, "leases")
            .map_err(Status::invalid_argument)?;
        let caller = self.caller(&req, &ns).await?;
        let lease = self.owned_lease(&caller, &name, "DeleteLease").await?;
        if lease.spec.release == Some(true) {
            return Err(Status::failed_precondition(format!(
                "lease {name:?} has already been released"
            )));
        }
        // DeleteLease releases (docs/exporter.md, "The Lease pass"); the object stays for its
        // history.
        self.ctx
            .calls
            .patch(
                &self.leases(&ns),
                &name,
                &Patch::Merge(json!({"spec": {"release": true}})),
            )
            .await
            .map_err(|e| write_error(&e, "release lease"))?;
        Ok(Response::new(()))
    }

    async fn rotate_token(
        &self,
        req: Request<cpb::RotateTokenRequest>,
    ) -> Result<Response<cpb::RotateTokenResponse>, Status> {
        let ns =
            lease_pb::parse_namespace(&req.get_ref().parent).map_err(Status::invalid_argument)?;
        let caller = self.caller(&req, &ns).await?;
        let clients: Api<Client> = Api::namespaced(self.ctx.client.clone(), &ns);
        let client = clients
            .get(&caller.name)
            .await
            .map_err(|e| read_error(&e, "client"))?;
        let subject = token::subject(
            "client",
            &ns,
            &caller.name,
            client.uid().as_deref().unwrap_or_default(),
            client.metadata.annotations.as_ref(),
        );
        let holder = token::holder(
            "client",
            &ns,
            &caller.name,
            client.uid().as_deref().unwrap_or_default(),
        );
        let (tok, claims) = token::mint_for(
            &self.ctx.key,
            &subject,
            Some(&holder),
            Timestamp::now(),
            self.ctx.settings.token.lifetime,
        );
        let secrets: Api<Secret> = Api::namespaced(self.ctx.client.clone(), &ns);
        let data = BTreeMap::from([("token".to_string(), ByteString(tok.clone().into_bytes()))]);
        self.ctx
            .calls
            .patch(
                &secrets,
                &format!("{}-client", caller.name),
                &Patch::Merge(json!({ "data": data })),
            )
            .await
            .map_err(|e| {
                if e.is_not_found() {
                    Status::failed_precondition("the client has no credential yet; retry later")
                } else {
                    write_error(&e, "store the rotated token")
                }
            })?;
        info!(client = %caller.name, namespace = %ns, "client token rotated");
        Ok(Response::new(cpb::RotateTokenResponse {
            token: tok,
            expiry: Some(prost_types::Timestamp {
                seconds: claims.exp,
                nanos: 0,
            }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::crd::{LeaseStatus, LocalObjectReference};
    use jiff::SignedDuration;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn lease(started: bool, ended: bool) -> Lease {
        let mut l = lease_pb::lease_from_pb(
            &cpb::Lease {
                selector: "a=b".into(),
                duration: Some(lease_pb::dur_to_pb(SignedDuration::from_hours(1))),
                ..Default::default()
            },
            "lab",
            "l1",
            "alice",
        )
        .unwrap();
        l.status = Some(LeaseStatus {
            exporter_ref: started.then(|| LocalObjectReference::new("e1")),
            begin_time: started.then(|| Time("2030-01-01T00:00:00Z".parse().unwrap())),
            ended,
            ..Default::default()
        });
        l
    }

    fn req(d: Option<i64>, begin: Option<&str>) -> cpb::Lease {
        cpb::Lease {
            duration: d.map(|s| lease_pb::dur_to_pb(SignedDuration::from_secs(s))),
            begin_time: begin.map(|b| {
                let t: Timestamp = b.parse().unwrap();
                prost_types::Timestamp {
                    seconds: t.as_second(),
                    nanos: 0,
                }
            }),
            ..Default::default()
        }
    }

    #[test]
    fn update_rules() {
        // Extend an active lease.
        let s = updated_spec(&lease(true, false), &req(Some(7200), None), None).unwrap();
        assert_eq!(s.duration.as_deref(), Some("2h0m0s"));
        // No begin change once started; ended leases keep their times.
        let e = updated_spec(
            &lease(true, false),
            &req(None, Some("2031-01-01T00:00:00Z")),
            None,
        )
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        let e = updated_spec(&lease(true, true), &req(Some(60), None), None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        // A pending lease may be rescheduled.
        let s = updated_spec(
            &lease(false, false),
            &req(None, Some("2031-01-01T00:00:00Z")),
            None,
        )
        .unwrap();
        assert!(s.begin_time.is_some());
        // Transfer: only active leases.
        let s = updated_spec(&lease(true, false), &cpb::Lease::default(), Some("bob")).unwrap();
        assert_eq!(s.client_ref.name, "bob");
        for (started, ended) in [(false, false), (true, true)] {
            let e = updated_spec(&lease(started, ended), &cpb::Lease::default(), Some("bob"))
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        }
        // Invalid durations are InvalidArgument.
        let e = updated_spec(&lease(false, false), &req(Some(-5), None), None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn names() {
        let a = lease_name("");
        assert_eq!(uuid::Uuid::parse_str(&a).unwrap().get_version_num(), 7);
        assert_eq!(lease_name("mine"), "mine");
    }
}

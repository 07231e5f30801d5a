//! The controller gRPC server (docs/exporter.md, "The gRPC server"): one TLS listener on
//! `--exporter-grpc-bind-address` serving ControllerService, ClientService, gRPC health and
//! reflection, on every replica (docs/exporter.md, "Every replica serves").
//!
//! # Which replica writes what
//! Reconcilers write through `Context::writer`, which refuses unless this replica leads. What a
//! gRPC call causes is written through `Context::calls` by whichever replica serves the call,
//! because the caller waits on this replica for the answer. Each of those writes is safe from
//! any replica, concurrently with the leader's reconcilers:
//! - exporter status (Register, Unregister, ReportStatus, Status connect, heartbeats): a merge
//!   patch fenced by resourceVersion, re-read and retried on conflict, so a concurrent write by
//!   the leader or another replica is never overwritten (`Controller::write_status`); the
//!   heartbeat's unfenced patch sets `lastSeen` alone, a field only gRPC calls write.
//! - exporter labels on Register: only the `jumpstarter.dev/` keys, which only Register writes.
//! - lease release (ReleaseLease, DeleteLease, ReportStatus release): sets `spec.release`, which
//!   is idempotent and which the leader's Lease pass acts on.
//! - lease creation and update (CreateLease, RequestLease, UpdateLease): a create with a unique
//!   name; the update is fenced by resourceVersion. The leader assigns exporters, as before.
//! - a provisioned Client, the client token refresh: a create that loses cleanly to a concurrent
//!   one; a patch of the client's own Secret, which the leader's Client pass re-reads by
//!   resourceVersion.
//! - the certificate and router key Secrets: created once, whoever is first; the others read it.
//! - pending dials (`dials`): created by the dialer, deleted by the one claim that wins.
//!
//! Leader only, as before: everything the Exporter, Client and Lease passes write (derived
//! conditions, lease assignment and ending, credentials, Events of reconciles).

pub mod auth;
pub mod client;
pub mod controller;
pub mod dials;
pub mod heartbeat;
pub mod lease_pb;
pub mod routers;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::ObjectMeta;
use tracing::{error, info};

use crate::exporter::auth::Authn;
use crate::exporter::context::Context;
use crate::exporter::proto::jumpstarter::client::v1::client_service_server::ClientServiceServer;
use crate::exporter::proto::jumpstarter::v1::controller_service_server::ControllerServiceServer;
use crate::exporter::{proto, router, tls};
use crate::runtime::Runtime;
use client::ClientApi;
use controller::Controller;
use dials::Dials;

/// The self-signed certificate every replica serves (docs/exporter.md, "Certificates").
pub const TLS_SECRET: &str = "ucm-exporter-grpc-tls";
/// The readiness check that is failing until this replica serves gRPC.
pub const READY_CHECK: &str = "exporter-grpc";

/// Runs until shutdown, on every replica; restarts the server after a failure.
pub async fn run(rt: Runtime, ctx: Arc<Context>) {
    let Some(addr) = ctx.settings.grpc_bind_address.addr() else {
        info!("exporter gRPC server disabled (--exporter-grpc-bind-address=0)");
        return;
    };
    rt.health
        .set(READY_CHECK, Err("starting: waiting for the caches".into()));
    // Built once, so the issuers' key caches outlive a restart of the server.
    let authn = match Authn::new(ctx.key.clone(), &ctx.settings.config, &ctx.client) {
        Ok(a) => Arc::new(a),
        Err(e) => {
            error!(error = %e, "exporter gRPC server cannot start");
            return;
        }
    };
    // Calls answer from the caches: serve once they have listed.
    tokio::select! {
        _ = rt.shutdown.cancelled() => return,
        _ = ctx.caches.synced.wait() => {}
    }
    loop {
        if let Err(e) = serve(&rt, &ctx, &authn, addr).await {
            rt.health.set(READY_CHECK, Err(format!("gRPC server: {e}")));
            error!(error = %e, "exporter gRPC server failed; retrying in 5s");
            tokio::select! {
                _ = rt.shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
        }
        if rt.shutdown.is_cancelled() {
            return;
        }
    }
}

/// The configured certificate, else the stored self-signed one (created once, by the first
/// replica to need it).
async fn certificate(rt: &Runtime, ctx: &Context) -> Result<tls::CertPair, String> {
    if let Some(c) = tls::from_env()? {
        return Ok(c);
    }
    let api: Api<Secret> = rt.own_namespace();
    for _ in 0..5 {
        if let Some(s) = api
            .get_opt(TLS_SECRET)
            .await
            .map_err(|e| format!("cannot read Secret {TLS_SECRET}: {e}"))?
        {
            let get = |k: &str| {
                s.data
                    .as_ref()
                    .and_then(|d| d.get(k))
                    .and_then(|b| String::from_utf8(b.0.clone()).ok())
            };
            return tls::from_values(get("tls.crt"), get("tls.key"))?
                .ok_or_else(|| format!("Secret {TLS_SECRET} lacks tls.crt/tls.key"));
        }
        let pair = tls::self_signed(&ctx.settings.status.endpoint)?;
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(TLS_SECRET.into()),
                namespace: Some(rt.config.manager_namespace.clone()),
                ..Default::default()
            },
            type_: Some("kubernetes.io/tls".into()),
            data: Some(BTreeMap::from([
                (
                    "tls.crt".into(),
                    ByteString(pair.cert_pem.clone().into_bytes()),
                ),
                (
                    "tls.key".into(),
                    ByteString(pair.key_pem.clone().into_bytes()),
                ),
            ])),
            ..Default::default()
        };
        match ctx.calls.create(&api, &secret).await {
            Ok(_) => {
                info!(
                    secret = TLS_SECRET,
                    "created the self-signed gRPC certificate"
                );
                return Ok(pair);
            }
            Err(e) if e.is_conflict() => continue,
            Err(e) => return Err(format!("cannot create Secret {TLS_SECRET}: {e}")),
        }
    }
    Err(format!("cannot create or read Secret {TLS_SECRET}"))
}

async fn serve(
    rt: &Runtime,
    ctx: &Arc<Context>,
    authn: &Arc<Authn>,
    addr: std::net::SocketAddr,
) -> Result<(), String> {
    let certs = certificate(rt, ctx).await?;
    let router_key = router::ensure_key(
        std::env::var("ROUTER_KEY").ok().as_deref(),
        &rt.own_namespace(),
        &ctx.calls,
        &rt.config.manager_namespace,
    )
    .await?;
    let dials = Dials::new(
        ctx.client.clone(),
        &rt.config.manager_namespace,
        ctx.calls.clone(),
        router_key.clone(),
        ctx.metrics.clone(),
    );
    let routers = routers::Routers::new(
        ctx.client.clone(),
        &rt.config.manager_namespace,
        ctx.settings.router_endpoint.clone(),
        ctx.settings.router_service.clone(),
    );
    let svc = Arc::new(Controller::new(
        ctx.clone(),
        rt.config.watch_namespace.clone(),
        router_key,
        routers.clone(),
        authn.clone(),
        dials.clone(),
    ));
    let client_svc = Arc::new(ClientApi::new(
        ctx.clone(),
        rt.config.watch_namespace.clone(),
        authn.clone(),
    ));
    let (health, health_svc) = tonic_health::server::health_reporter();
    health
        .set_serving::<ControllerServiceServer<Arc<Controller>>>()
        .await;
    health
        .set_serving::<ClientServiceServer<Arc<ClientApi>>>()
        .await;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    info!(%addr, endpoint = %ctx.settings.status.endpoint, "exporter gRPC server listening");
    let watch_stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(dials.run(watch_stop.clone()));
    tokio::spawn(routers.run(watch_stop.clone()));
    let _watch_stop = watch_stop.drop_guard();
    rt.health.set(READY_CHECK, Ok(()));
    let stop = svc.stop.clone();
    let shutdown = rt.shutdown.clone();
    let session = svc.clone();
    // Graceful drain (docs/exporter.md, "Every replica serves"): on shutdown the server stops
    // accepting connections and sends GOAWAY; Status and Listen streams end, so exporters
    // reconnect to a replica that stays; Dials in flight finish (bounded by `dials`).
    let stopper = async move {
        shutdown.cancelled().await;
        info!("exporter gRPC server draining: exporters reconnect to another replica");
        stop.cancel();
        session.close_listeners();
    };
    let ka = &ctx.settings.config.keepalive;
    let std = |d: jiff::SignedDuration| d.unsigned_abs();
    // HTTP/2 pings: `grpc.keepalive` when set; else (OURS) one per heartbeat interval with gRPC's
    // 20 s timeout, so a Status stream cut by a partition (no FIN) ends well within the offline
    // threshold instead of after TCP's retransmission timeout.
    let mut server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(std(ka
            .interval_time
            .unwrap_or(ctx.settings.heartbeat_interval))))
        .http2_keepalive_timeout(Some(std(ka
            .timeout
            .unwrap_or(jiff::SignedDuration::from_secs(20)))));
    if let Some(age) = ka.max_connection_age {
        server = server.max_connection_age(std(age));
    }
    let result = server
        .tls_config(certs.server_tls())
        .map_err(|e| format!("gRPC TLS: {e}"))?
        .add_service(health_svc)
        .add_service(proto::reflection_v1())
        .add_service(proto::reflection_v1alpha())
        .add_service(ControllerServiceServer::new(svc))
        .add_service(ClientServiceServer::new(client_svc))
        // TCP_NODELAY, as tonic sets it on listeners it binds itself: a router token pushed
        // down a Listen stream must not wait for the exporter's delayed ACK.
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            stopper,
        )
        .await
        .map_err(|e| format!("gRPC server: {e}"));
    info!("exporter gRPC server stopped");
    result
}

//! The two admin servers, as in controller-runtime: metrics (`/metrics`) and health
//! (`/healthz`, `/readyz`, `/readyz/<check>`, `?verbose`).

use std::{collections::HashMap, net::SocketAddr};

use axum::{
    Router,
    extract::{Path, Query, State},
    http::StatusCode,
    response::IntoResponse,
    routing::get,
};
use tokio_util::sync::CancellationToken;

use prometheus::{Encoder, Registry, TextEncoder};

use super::health::Health;

/// The text exposition format served on /metrics.
pub fn encode(registry: &Registry) -> Vec<u8> {
    let mut buf = Vec::new();
    // Encoding gathered families into a Vec cannot fail.
    let _ = TextEncoder::new().encode(&registry.gather(), &mut buf);
    buf
}

pub async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot bind the {what} address {addr}: {e}"))
}

/// `/metrics` of `registry` in the text exposition format: the manager's, the agents' and the
/// export server's and proxy's.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    registry: Registry,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(r): State<Registry>| async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    encode(&r),
                )
            }),
        )
        .with_state(registry);
    axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
}

pub async fn serve_health(
    listener: tokio::net::TcpListener,
    health: Health,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        // Liveness never calls the API server: an outage must not restart ucm.
        .route("/healthz", get(|| async { "ok" }))
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/readyz/{check}", get(readyz_one))
        .with_state(health);
    axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
}

async fn readyz(
    State(h): State<Health>,
    Query(q): Query<HashMap<String, String>>,
) -> impl IntoResponse {
    let (ok, report) = h.report(None).expect("all checks");
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    // Like k8s healthz: the list is shown on failure or with ?verbose.
    let body = if ok && !q.contains_key("verbose") {
        "ok".to_string()
    } else {
        format!(
            "{report}readyz check {}\n",
            if ok { "passed" } else { "failed" }
        )
    };
    (code, body)
}

async fn readyz_one(State(h): State<Health>, Path(check): Path<String>) -> impl IntoResponse {
    match h.report(Some(&check)) {
        None => (StatusCode::NOT_FOUND, format!("no such check: {check}\n")),
        Some((true, text)) => (StatusCode::OK, text),
        Some((false, text)) => (StatusCode::SERVICE_UNAVAILABLE, text),
    }
}

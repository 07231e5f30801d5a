//! The login service (upstream's `service/login`; docs/exporter.md, "External issuers and the login
//! service"): `GET /v1/auth/config` tells `jmp login <endpoint>` the controller's gRPC endpoint,
//! the router endpoint, the namespace, the CA bundle to trust (base64 PEM, as the CLI decodes it)
//! and the OIDC issuers to sign in with; `GET /` is a landing page saying the same for people;
//! `/healthz`. Plain HTTP on `--exporter-login-bind-address` (upstream's `:8086`), on every
//! replica: it reads nothing that needs the lease, so it does not wait for leadership.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use base64::Engine;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use serde::Serialize;
use tracing::{error, info, warn};

use crate::exporter::context::Context;
use crate::exporter::grpc::TLS_SECRET;
use crate::runtime::Runtime;

#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OidcProvider {
    pub issuer: String,
    pub client_id: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub audiences: Vec<String>,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AuthConfig {
    pub grpc_endpoint: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub router_endpoint: String,
    pub namespace: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub ca_bundle: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub oidc: Vec<OidcProvider>,
}

struct Service {
    /// Everything but the CA bundle, which may appear later (the leader stores it).
    base: AuthConfig,
    /// `CA_BUNDLE_PEM` (upstream's variable), else `EXTERNAL_CERT_PEM` (text or file): fixed for
    /// the process.
    fixed_ca: Option<String>,
    secrets: Api<Secret>,
}

/// The response without a CA bundle (pure). One OIDC entry per issuer; the client id `jmp` uses
/// is the issuer's first audience (the CLI's default, `jumpstarter-cli`, when it is one).
pub fn base_config(ctx: &Context, namespace: String) -> AuthConfig {
    let s = &ctx.settings;
    AuthConfig {
        grpc_endpoint: s.status.endpoint.clone(),
        router_endpoint: s.router_endpoint.clone(),
        namespace,
        ca_bundle: String::new(),
        oidc: s
            .config
            .jwt
            .iter()
            .map(|j| OidcProvider {
                issuer: j.issuer.clone(),
                client_id: if j.audiences.iter().any(|a| a == "jumpstarter-cli") {
                    "jumpstarter-cli".into()
                } else {
                    j.audiences[0].clone()
                },
                audiences: j.audiences.clone(),
            })
            .collect(),
    }
}

impl Service {
    async fn config(&self) -> AuthConfig {
        let mut c = self.base.clone();
        let pem = match &self.fixed_ca {
            Some(p) => Some(p.clone()),
            // The self-signed certificate every leader serves (read per request: it appears when
            // the first leader starts, and a request is not idle work).
            None => self
                .secrets
                .get_opt(TLS_SECRET)
                .await
                .ok()
                .flatten()
                .and_then(|s| s.data?.remove("tls.crt"))
                .and_then(|b| String::from_utf8(b.0).ok()),
        };
        if let Some(pem) = pem {
            c.ca_bundle = base64::engine::general_purpose::STANDARD.encode(pem);
        }
        c
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn landing(c: &AuthConfig) -> String {
    let issuers: String = c
        .oidc
        .iter()
        .map(|o| {
            format!(
                "<li><code>{}</code> (client id <code>{}</code>)</li>",
                escape(&o.issuer),
                escape(&o.client_id)
            )
        })
        .collect();
    let issuers = if issuers.is_empty() {
        "<p>No OIDC issuer is configured; ask an administrator for a client configuration.</p>"
            .to_string()
    } else {
        format!("<p>Sign in with:</p><ul>{issuers}</ul>")
    };
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Jumpstarter login</title></head>\
         <body><h1>Jumpstarter</h1>\
         <p>Log in with <code>jmp login &lt;client-name&gt;@&lt;this host&gt;</code>.</p>\
         <table><tr><td>gRPC endpoint</td><td><code>{}</code></td></tr>\
         <tr><td>Router endpoint</td><td><code>{}</code></td></tr>\
         <tr><td>Namespace</td><td><code>{}</code></td></tr></table>{issuers}\
         <p>Configuration for the CLI: <a href=\"/v1/auth/config\">/v1/auth/config</a></p></body></html>",
        escape(&c.grpc_endpoint),
        escape(&c.router_endpoint),
        escape(&c.namespace),
    )
}

/// Serves until shutdown; a bind failure is logged and ends only this service.
pub async fn run(rt: Runtime, ctx: Arc<Context>) {
    let Some(addr) = ctx.settings.login_bind_address.addr() else {
        info!("login service disabled (--exporter-login-bind-address=0)");
        return;
    };
    let namespace = ctx
        .settings
        .login_namespace
        .clone()
        .or_else(|| rt.config.watch_namespace.clone())
        .unwrap_or_else(|| rt.config.manager_namespace.clone());
    // Each is PEM text or the path of a PEM file, as for the serving certificate.
    let fixed_ca = ["CA_BUNDLE_PEM", "EXTERNAL_CERT_PEM"]
        .into_iter()
        .find_map(|var| crate::exporter::tls::pem_or_file(var, std::env::var(var).ok()))
        .and_then(|read| {
            read.map_err(|e| warn!(error = %e, "login: serving the stored CA instead"))
                .ok()
        });
    let svc = Arc::new(Service {
        base: base_config(&ctx, namespace),
        fixed_ca,
        secrets: rt.own_namespace(),
    });
    let app = axum::Router::new()
        .route(
            "/v1/auth/config",
            get(|State(s): State<Arc<Service>>| async move {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    serde_json::to_string(&s.config().await).expect("serialises"),
                )
            }),
        )
        .route(
            "/",
            get(|State(s): State<Arc<Service>>| async move {
                Html(landing(&s.config().await)).into_response()
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .with_state(svc);
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            error!(%addr, error = %e, "cannot listen for the login service");
            return;
        }
    };
    info!(%addr, "login service listening");
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(rt.shutdown.clone().cancelled_owned())
        .await
    {
        error!(error = %e, "login service failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_response_has_upstream_field_names() {
        let c = AuthConfig {
            grpc_endpoint: "grpc.example:443".into(),
            router_endpoint: String::new(),
            namespace: "lab".into(),
            ca_bundle: String::new(),
            oidc: vec![OidcProvider {
                issuer: "https://kc/realms/lab".into(),
                client_id: "jumpstarter-cli".into(),
                audiences: vec!["jumpstarter-cli".into()],
            }],
        };
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "grpcEndpoint": "grpc.example:443",
                "namespace": "lab",
                "oidc": [{"issuer": "https://kc/realms/lab", "clientId": "jumpstarter-cli",
                          "audiences": ["jumpstarter-cli"]}],
            })
        );
        let page = landing(&c);
        assert!(page.contains("https://kc/realms/lab") && page.contains("<code>lab</code>"));
    }
}

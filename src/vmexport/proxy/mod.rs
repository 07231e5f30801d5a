//! `ucm export-proxy`: the external entry point of VirtualMachineExport downloads, KubeVirt's
//! `virt-exportproxy` URL scheme. It accepts
//! `/api/export.kubevirt.io/<v1|v1beta1|v1alpha1>/namespaces/<ns>/virtualmachineexports/<name>/<rest>`,
//! checks the export token as the export server does (header or query `x-kubevirt-export-token`,
//! constant time, against the Secret in `status.tokenSecretRef`), and forwards `/<rest>` to
//! `https://<status.serviceName>.<ns>.svc:443`, verifying the export server's certificate with
//! the ucm export CA.
//!
//! Bodies are streamed both ways and no timer limits a request once its headers are in: a
//! 100 GiB download is not cut by the proxy (upstream's route time-outs, kubevirt#18638). `Range`,
//! `If-Range` and every other end-to-end header pass through unchanged, so `curl -C -` resumes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clap::{Args, FromArgMatches};
use futures::future::BoxFuture;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use crate::runtime::{Agent, cli::LogFormat, logging};
use crate::vmexport::api::{PHASE_READY, TOKEN_HEADER};
use crate::vmexport::server::{auth, bind_listener, config::parse_addr, conn, tls};
use crate::vmexport::types::VirtualMachineExport;
use rustls::pki_types::pem::PemObject;

pub const NAME: &str = "export-proxy";
/// The proxy's Service in the shipped manifests; its self-issued certificate names it.
pub const SERVICE: &str = "ucm-export-proxy";
/// The versions of the external URL scheme the proxy accepts (KubeVirt's proxy accepts the
/// versions its CRD serves).
pub const VERSIONS: [&str; 3] = ["v1", "v1beta1", "v1alpha1"];
/// Validity of the certificate the proxy issues itself at start from the export CA.
const CERT_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);

// `ucm export-proxy` flags; a plain comment so the subcommand keeps its about.
#[derive(Args, Debug, Clone)]
pub struct ProxyArgs {
    /// HTTPS address of the proxy.
    #[arg(long, default_value = ":8443", value_name = "ADDR")]
    pub listen_address: String,

    /// Plain-HTTP address of /metrics; 0 disables.
    #[arg(long, default_value = ":8080", value_name = "ADDR")]
    pub metrics_bind_address: String,

    /// Path to a kubeconfig. Unset: KUBECONFIG, then ~/.kube/config, then in-cluster config.
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<String>,

    /// Namespace of the export CA Secret (the manager's namespace).
    #[arg(
        long,
        env = "POD_NAMESPACE",
        default_value = "default",
        value_name = "NS"
    )]
    pub namespace: String,

    /// The export CA Secret the manager keeps; it verifies the export servers and, without
    /// --tls-cert-file, signs the proxy's own certificate.
    #[arg(long, default_value = "ucm-export-ca", value_name = "NAME")]
    pub export_ca_secret: String,

    /// Serving certificate (PEM). Unset: one issued at start from the export CA for the Service
    /// names of --service-name.
    #[arg(long, requires = "tls_key_file", value_name = "PATH")]
    pub tls_cert_file: Option<PathBuf>,

    /// Private key of --tls-cert-file.
    #[arg(long, requires = "tls_cert_file", value_name = "PATH")]
    pub tls_key_file: Option<PathBuf>,

    /// The proxy's Service, named in the self-issued certificate.
    #[arg(long, default_value = SERVICE, value_name = "NAME")]
    pub service_name: String,

    /// Connect every upstream to this address instead of the export's Service (TLS still checks
    /// the Service name). For tests and benchmarks without cluster DNS.
    #[arg(long, hide = true, value_name = "HOST:PORT")]
    pub upstream_address: Option<String>,

    /// Transfers this proxy forwards at once; more requests wait up to --queue-timeout for a
    /// slot, then get 429 with Retry-After. 0: no limit.
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub max_transfers: usize,

    /// How long a request waits for a transfer slot before 429 (whole seconds).
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    pub queue_timeout: u64,

    /// After SIGTERM, how long transfers in flight may still finish (whole seconds); keep it
    /// below the Pod's terminationGracePeriodSeconds.
    #[arg(long, default_value_t = 25, value_name = "SECONDS")]
    pub drain_seconds: u64,

    /// Log filter directive. Default: RUST_LOG, else "info".
    #[arg(long, value_name = "DIRECTIVE")]
    pub log_level: Option<String>,

    /// Log output format.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

fn command() -> clap::Command {
    ProxyArgs::augment_args(clap::Command::new(NAME).about(
        "Forward KubeVirt's external export URLs (/api/export.kubevirt.io/...) to the export servers",
    ))
}

fn run(m: clap::ArgMatches) -> BoxFuture<'static, anyhow::Result<()>> {
    Box::pin(async move {
        let args = ProxyArgs::from_arg_matches(&m)?;
        logging::init(args.log_level.as_deref(), args.log_format)
            .map_err(|e| anyhow::anyhow!(e))?;
        serve(args).await
    })
}

pub const AGENT: Agent = Agent {
    name: NAME,
    command,
    run,
};

/// Where a request goes, parsed from KubeVirt's external path.
#[derive(Debug, PartialEq, Eq)]
pub struct Target<'a> {
    pub version: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    /// The export server's path, starting with `/`.
    pub rest: &'a str,
}

fn dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

/// Parses `/api/export.kubevirt.io/<version>/namespaces/<ns>/virtualmachineexports/<name>/<rest>`.
pub fn parse_path(path: &str) -> Option<Target<'_>> {
    let p = path.strip_prefix("/api/export.kubevirt.io/")?;
    let (version, p) = p.split_once('/')?;
    if !VERSIONS.contains(&version) {
        return None;
    }
    let p = p.strip_prefix("namespaces/")?;
    let (namespace, p) = p.split_once('/')?;
    let p = p.strip_prefix("virtualmachineexports/")?;
    let (name, rest) = match p.find('/') {
        Some(i) => (&p[..i], &p[i..]),
        None => return None,
    };
    (dns_name(namespace) && dns_name(name) && rest.len() > 1).then_some(Target {
        version,
        namespace,
        name,
        rest,
    })
}

/// Hop-by-hop headers (RFC 9110, section 7.6.1) are not forwarded; neither is the client's Host.
fn end_to_end(h: &HeaderMap) -> HeaderMap {
    let mut out = h.clone();
    let listed: Vec<String> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    for n in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(listed)
    {
        out.remove(n.as_str());
    }
    out
}

type Body = UnsyncBoxBody<Bytes, hyper::Error>;

fn text(status: StatusCode, msg: &str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(msg.to_string()))
            .map_err(|n| match n {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// The proxy's metrics (same names scheme as the export server's).
#[derive(Clone)]
pub struct Metrics {
    pub bytes: IntCounter,
    pub active: IntGauge,
    pub queued: IntGauge,
    pub requests: IntCounterVec,
}

impl Metrics {
    pub fn new(registry: &Registry) -> anyhow::Result<Metrics> {
        let bytes = IntCounter::new(
            "ucm_export_proxy_bytes_forwarded_total",
            "Response body bytes forwarded from export servers to clients",
        )?;
        let active = IntGauge::new(
            "ucm_export_proxy_active_downloads",
            "Responses whose bodies are being streamed to clients",
        )?;
        let requests = IntCounterVec::new(
            Opts::new(
                "ucm_export_proxy_requests_total",
                "Requests by response status code",
            ),
            &["code"],
        )?;
        let queued = IntGauge::new(
            "ucm_export_proxy_queued_requests",
            "Requests waiting for a transfer slot (--max-transfers)",
        )?;
        registry.register(Box::new(bytes.clone()))?;
        registry.register(Box::new(active.clone()))?;
        registry.register(Box::new(queued.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        Ok(Metrics {
            bytes,
            active,
            queued,
            requests,
        })
    }
}

struct State {
    lookups: Lookups,
    upstream_tls: tokio_rustls::TlsConnector,
    upstream_address: Option<String>,
    metrics: Metrics,
    admission: Admission,
}

/// The transfer slots of `--max-transfers` (docs/vmexport.md, "Export proxy").
pub struct Admission {
    slots: Option<Arc<tokio::sync::Semaphore>>,
    wait: Duration,
}

/// What a client is told when every slot stays taken for the whole wait.
pub const RETRY_AFTER_SECONDS: u64 = 10;

impl Admission {
    pub fn new(max: usize, wait: Duration) -> Admission {
        Admission {
            slots: (max > 0).then(|| Arc::new(tokio::sync::Semaphore::new(max))),
            wait,
        }
    }

    /// A slot, waiting up to the queue timeout; `Err(())` when none frees in time.
    pub async fn admit(
        &self,
        queued: &IntGauge,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, ()> {
        let Some(slots) = &self.slots else {
            return Ok(None);
        };
        if let Ok(p) = Arc::clone(slots).try_acquire_owned() {
            return Ok(Some(p));
        }
        queued.inc();
        let r = tokio::time::timeout(self.wait, Arc::clone(slots).acquire_owned()).await;
        queued.dec();
        match r {
            Ok(Ok(p)) => Ok(Some(p)),
            _ => Err(()),
        }
    }
}

fn too_many() -> Response<Body> {
    let mut r = text(
        StatusCode::TOO_MANY_REQUESTS,
        "the export proxy is at its transfer limit (--max-transfers); retry later\n",
    );
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
    r
}

/// Decrements the active-download gauge, and frees the transfer slot, when the response body
/// is dropped (done or cut).
struct Active {
    gauge: IntGauge,
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for Active {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let start = std::time::Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let resp = forward(&state, req).await;
    let code = resp.status().as_u16().to_string();
    state.metrics.requests.with_label_values(&[&code]).inc();
    // The query may hold the token: never logged.
    tracing::info!(%method, %path, status = resp.status().as_u16(), elapsed_ms = start.elapsed().as_millis() as u64, "request");
    resp
}

async fn forward(state: &Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let Some(t) = parse_path(&path) else {
        return text(StatusCode::NOT_FOUND, "404 page not found\n");
    };
    let (query_token, rest_query) = auth::take_query_token(req.uri().query());
    let presented = req
        .headers()
        .get(TOKEN_HEADER)
        .map(|v| v.as_bytes().to_vec())
        .or(query_token.map(String::into_bytes));
    let Some(presented) = presented else {
        return text(StatusCode::UNAUTHORIZED, "401 unauthorized\n");
    };

    let (service, expected) = match state.lookups.get(t.namespace, t.name).await {
        Lookup::Found { service, token } => (service, token),
        Lookup::NotFound => return text(StatusCode::NOT_FOUND, "404 page not found\n"),
        Lookup::NotReady => {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "the export is not ready; wait for status.phase Ready\n",
            );
        }
        Lookup::ExportUnreadable => {
            return text(StatusCode::BAD_GATEWAY, "cannot read the export\n");
        }
        Lookup::SecretUnreadable => {
            return text(StatusCode::INTERNAL_SERVER_ERROR, "internal error\n");
        }
    };
    if auth::check_token(&expected, Some(&presented)) != auth::AuthResult::Ok {
        return text(StatusCode::UNAUTHORIZED, "401 unauthorized\n");
    }

    // Admitted only now: a request that was refused anyway holds no slot.
    let Ok(slot) = state.admission.admit(&state.metrics.queued).await else {
        return too_many();
    };
    let host = format!("{service}.{}.svc", t.namespace);
    let addr = state
        .upstream_address
        .clone()
        .unwrap_or_else(|| format!("{host}:443"));
    let upstream = match connect(state, &host, &addr).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "cannot reach the export server");
            return text(StatusCode::BAD_GATEWAY, "cannot reach the export server\n");
        }
    };
    let pq = match rest_query {
        Some(q) => format!("{}?{q}", t.rest),
        None => t.rest.to_string(),
    };
    let (parts, body) = req.into_parts();
    let mut out = Request::builder().method(parts.method).uri(pq);
    if let Some(h) = out.headers_mut() {
        *h = end_to_end(&parts.headers);
        if let Ok(v) = HeaderValue::from_str(&host) {
            h.insert(header::HOST, v);
        }
        // The export server checks the token too; the query form was removed from the URI.
        if let Ok(v) = HeaderValue::from_bytes(&presented) {
            h.insert(TOKEN_HEADER, v);
        }
    }
    let Ok(out) = out.body(body) else {
        return text(StatusCode::BAD_REQUEST, "bad request\n");
    };
    let (mut sender, conn) = match hyper::client::conn::http1::Builder::new()
        .max_buf_size(UPSTREAM_READ_BUF)
        .handshake(TokioIo::new(upstream))
        .await
    {
        Ok(x) => x,
        Err(e) => {
            tracing::warn!(error = %e, "HTTP handshake with the export server failed");
            return text(StatusCode::BAD_GATEWAY, "cannot reach the export server\n");
        }
    };
    // The upstream connection is driven by whoever waits on it: here until the response
    // headers are in, then by the response body (`Relay`), in the client connection's task.
    let mut conn = Box::pin(conn);
    let send = sender.send_request(out);
    tokio::pin!(send);
    let (sent, conn) = tokio::select! {
        r = &mut send => (r, Some(conn)),
        // A connection that ended first fails the request too.
        r = conn.as_mut() => {
            upstream_ended(r);
            (send.await, None)
        }
    };
    let resp = match sent {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "the export server did not answer");
            return text(
                StatusCode::BAD_GATEWAY,
                "the export server did not answer\n",
            );
        }
    };
    let (mut parts, body) = resp.into_parts();
    parts.headers = end_to_end(&parts.headers);
    // The export server redirects with absolute paths (`dir` without its trailing slash): keep
    // the client under the external prefix.
    if let Some(loc) = parts
        .headers
        .get(header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .filter(|l| l.starts_with('/') && !l.starts_with("//"))
    {
        let prefix = &path[..path.len() - t.rest.len()];
        if let Ok(v) = HeaderValue::from_str(&format!("{prefix}{loc}")) {
            parts.headers.insert(header::LOCATION, v);
        }
    }
    state.metrics.active.inc();
    let active = Active {
        gauge: state.metrics.active.clone(),
        _slot: slot,
    };
    let bytes = state.metrics.bytes.clone();
    let relay = Relay { conn, body };
    // A core to spare: this transfer reads ahead in a task of its own (docs/vmexport.md,
    // "Export proxy").
    let spare = usize::try_from(state.metrics.active.get())
        .is_ok_and(|n| n <= tokio::runtime::Handle::current().metrics().num_workers());
    let body: Body = if spare {
        read_ahead(relay).boxed_unsync()
    } else {
        relay.boxed_unsync()
    };
    let body = body
        .map_frame(move |f| {
            let _hold = &active;
            if let Some(d) = f.data_ref() {
                bytes.inc_by(d.len() as u64);
            }
            f
        })
        .boxed_unsync();
    Response::from_parts(parts, body)
}

/// What a request needs from the API server: the export's Service and the token it expects.
#[derive(Clone)]
enum Lookup {
    Found { service: String, token: Vec<u8> },
    NotFound,
    NotReady,
    ExportUnreadable,
    SecretUnreadable,
}

type Pending = futures::future::Shared<BoxFuture<'static, Lookup>>;

/// Reads an export and its token Secret, once for all the requests that ask at the same time
/// (docs/vmexport.md, "Export proxy"): 50 clients starting ranges of one export cost two GETs,
/// not 100. Nothing is kept once the reads return, so a deleted export or a changed token
/// applies to the next request; a request that joins a read in flight gets an answer at most
/// one round trip older than itself.
struct Lookups {
    client: kube::Client,
    pending: std::sync::Mutex<std::collections::HashMap<(String, String), Pending>>,
}

impl Lookups {
    fn new(client: kube::Client) -> Lookups {
        Lookups {
            client,
            pending: Default::default(),
        }
    }

    async fn get(&self, ns: &str, name: &str) -> Lookup {
        let key = (ns.to_string(), name.to_string());
        let pending = {
            let mut m = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            m.entry(key.clone())
                .or_insert_with(|| {
                    let (client, ns, name) =
                        (self.client.clone(), ns.to_string(), name.to_string());
                    futures::FutureExt::shared(Box::pin(
                        async move { lookup(&client, &ns, &name).await },
                    ) as BoxFuture<'static, Lookup>)
                })
                .clone()
        };
        let out = pending.clone().await;
        // The first to finish forgets it (unless a newer read already took the slot).
        let mut m = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if m.get(&key).is_some_and(|p| p.ptr_eq(&pending)) {
            m.remove(&key);
        }
        out
    }
}

async fn lookup(client: &kube::Client, ns: &str, name: &str) -> Lookup {
    let exports: Api<VirtualMachineExport> = Api::namespaced(client.clone(), ns);
    let export = match exports.get_opt(name).await {
        Ok(Some(e)) => e,
        Ok(None) => return Lookup::NotFound,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the export");
            return Lookup::ExportUnreadable;
        }
    };
    let st = export.status.unwrap_or_default();
    let (Some(service), Some(secret), Some(PHASE_READY)) =
        (st.service_name, st.token_secret_ref, st.phase.as_deref())
    else {
        return Lookup::NotReady;
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    match secrets.get_opt(&secret).await {
        Ok(s) => Lookup::Found {
            service,
            token: s
                .and_then(|s| s.data)
                .and_then(|d| d.get("token").map(|b| b.0.clone()))
                .unwrap_or_default(),
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the export's token Secret");
            Lookup::SecretUnreadable
        }
    }
}

type Upstream = hyper::client::conn::http1::Connection<
    TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    Incoming,
>;

/// A response body that also drives its upstream connection: each time the client's connection
/// asks for the next frame, the export server's socket is read, in the same task
/// (docs/vmexport.md, "Export proxy"). No task of its own for the upstream connection and no
/// hand-off between tasks per frame: with many transfers at once the two TLS hops of one
/// transfer cost about what nginx's event loop pays; the sockets' kernel buffers keep the two
/// hops overlapping. When the upstream connection fails, hyper ends the body with an error, so
/// a cut download never looks complete; a client that goes away drops the body and with it the
/// upstream connection.
struct Relay {
    conn: Option<std::pin::Pin<Box<Upstream>>>,
    body: Incoming,
}

impl hyper::body::Body for Relay {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        if let Some(c) = self.conn.as_mut()
            && let std::task::Poll::Ready(r) = c.as_mut().poll(cx)
        {
            upstream_ended(r);
            self.conn = None;
        }
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

fn upstream_ended(r: hyper::Result<()>) {
    if let Err(e) = r {
        tracing::debug!(error = %e, "upstream connection ended with an error");
    }
}

/// A transfer that starts while the proxy has a core to spare (no more transfers than worker
/// threads) reads the export server in a task of its own, up to [`READ_AHEAD`] frames ahead of
/// the client: the two TLS hops of that transfer then run on two cores at once, which a single
/// download needs to keep up with nginx. Under load every core is busy anyway and the hand-off
/// per frame would only cost CPU, so later transfers are driven in the client's task. An
/// upstream error is passed on as an error frame; a client that goes away stops the reading.
fn read_ahead(
    mut relay: Relay,
) -> http_body_util::StreamBody<
    tokio_stream::wrappers::ReceiverStream<Result<hyper::body::Frame<Bytes>, hyper::Error>>,
> {
    let (tx, rx) = tokio::sync::mpsc::channel(READ_AHEAD);
    tokio::spawn(async move {
        while let Some(f) = relay.frame().await {
            let end = f.is_err();
            if tx.send(f).await.is_err() || end {
                break;
            }
        }
    });
    http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx))
}

const READ_AHEAD: usize = 8;
const UPSTREAM_READ_BUF: usize = 32 * 1024;

async fn connect(
    state: &State,
    host: &str,
    addr: &str,
) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(addr),
    )
    .await??;
    let _ = tcp.set_nodelay(true);
    let name = rustls::pki_types::ServerName::try_from(host.to_string())?;
    Ok(state.upstream_tls.connect(name, tcp).await?)
}

/// Reads the export CA (tls.crt, tls.key) the manager keeps, waiting for the manager to create it.
async fn read_ca(client: &kube::Client, ns: &str, name: &str) -> crate::vmexport::certs::Pem {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let mut logged = false;
    loop {
        match api.get_opt(name).await {
            Ok(Some(s)) => {
                let d = s.data.unwrap_or_default();
                let get = |k: &str| d.get(k).map(|b| String::from_utf8_lossy(&b.0).into_owned());
                if let (Some(cert), Some(key)) = (get("tls.crt"), get("tls.key")) {
                    return crate::vmexport::certs::Pem { cert, key };
                }
                tracing::warn!(secret = %name, "the export CA Secret has no tls.crt/tls.key yet");
            }
            Ok(None) if !logged => {
                tracing::info!(namespace = %ns, secret = %name, "waiting for the manager to create the export CA Secret");
                logged = true;
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "cannot read the export CA Secret"),
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

/// TLS to the export servers: HTTP/1.1, trusting only the export CA (`ca_pem`).
fn upstream_tls(ca_pem: &str) -> anyhow::Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c?)?;
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg)))
}

pub async fn serve(args: ProxyArgs) -> anyhow::Result<()> {
    // Metrics first: the liveness probe watches this port while the proxy waits for the CA,
    // which the manager creates with its first export.
    let registry = Registry::new();
    let metrics = Metrics::new(&registry)?;
    if args.metrics_bind_address != "0" {
        let addr: SocketAddr =
            parse_addr(&args.metrics_bind_address).map_err(anyhow::Error::msg)?;
        let l = bind_listener(addr)?;
        crate::vmexport::server::spawn_metrics(l, registry.clone());
    }
    let client = crate::runtime::manager::client(args.kubeconfig.as_deref()).await?;
    let ca = read_ca(&client, &args.namespace, &args.export_ca_secret).await;

    let server_cfg = match (&args.tls_cert_file, &args.tls_key_file) {
        (Some(c), Some(k)) => {
            // Reloaded when the mounted Secret changes (cert-manager renewals): open
            // connections keep theirs.
            let (cfg, files) = tls::server_config(c, k, None, None)?;
            files.spawn_reloader();
            cfg
        }
        _ => {
            let pem = crate::vmexport::certs::issue_serving(
                &ca,
                &args.service_name,
                &args.namespace,
                jiff::Timestamp::now(),
                CERT_VALIDITY,
            )?;
            tls::server_config_pem(&pem.cert, &pem.key)?
        }
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(server_cfg);

    let state = Arc::new(State {
        lookups: Lookups::new(client),
        upstream_tls: upstream_tls(&ca.cert)?,
        upstream_address: args.upstream_address.clone(),
        metrics,
        admission: Admission::new(args.max_transfers, Duration::from_secs(args.queue_timeout)),
    });
    let addr = parse_addr(&args.listen_address).map_err(anyhow::Error::msg)?;
    let listener = bind_listener(addr)?;
    tracing::info!(addr = %listener.local_addr()?, max_transfers = args.max_transfers, "export proxy listening");
    let shutdown = async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {},
            _ = tokio::signal::ctrl_c() => {},
        }
        tracing::info!("shutting down; transfers in flight may finish");
    };
    let handler = move |req, _peer| handle(Arc::clone(&state), req);
    let timeouts = conn::Timeouts {
        idle: conn::IDLE_TIMEOUT,
        drain: Duration::from_secs(args.drain_seconds),
    };
    if !conn::serve(listener, acceptor, handler, timeouts, shutdown).await {
        tracing::warn!("transfers still running after --drain-seconds; exiting");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn external_paths_of_every_version() {
        for v in VERSIONS {
            let p = format!(
                "/api/export.kubevirt.io/{v}/namespaces/ns1/virtualmachineexports/e.1/volumes/d/disk.img"
            );
            assert_eq!(
                parse_path(&p),
                Some(Target {
                    version: v,
                    namespace: "ns1",
                    name: "e.1",
                    rest: "/volumes/d/disk.img"
                })
            );
        }
        let m = "/api/export.kubevirt.io/v1/namespaces/ns1/virtualmachineexports/e/external/manifests/all";
        assert_eq!(parse_path(m).unwrap().rest, "/external/manifests/all");
        for bad in [
            "/api/export.kubevirt.io/v2/namespaces/ns1/virtualmachineexports/e/volumes/d/disk.img",
            "/api/export.kubevirt.io/v1/namespaces/ns1/virtualmachineexports/e",
            "/api/export.kubevirt.io/v1/namespaces/ns1/virtualmachineexports/e/",
            "/api/export.kubevirt.io/v1/namespaces/NS/virtualmachineexports/e/x",
            "/api/export.kubevirt.io/v1/namespaces/a%2Fb/virtualmachineexports/e/x",
            "/api/export.kubevirt.io/v1/namespaces//virtualmachineexports/e/x",
            "/volumes/d/disk.img",
        ] {
            assert_eq!(parse_path(bad), None, "{bad}");
        }
    }

    /// An API server that holds every answer 50 ms (so requests overlap), counts the requests,
    /// and serves a Ready export and its token Secret holding `token`.
    fn api_server(
        token: Arc<std::sync::Mutex<&'static str>>,
    ) -> (kube::Client, Arc<std::sync::atomic::AtomicUsize>) {
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = seen.clone();
        let svc = tower::service_fn(move |req: Request<kube::client::Body>| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let body = if req.uri().path().contains("/secrets/") {
                use base64::Engine;
                let t = *token.lock().unwrap();
                serde_json::json!({"apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": "tok", "namespace": "ns1"},
                    "data": {"token": base64::engine::general_purpose::STANDARD.encode(t)}})
            } else {
                serde_json::json!({"apiVersion": "export.kubevirt.io/v1", "kind": "VirtualMachineExport",
                    "metadata": {"name": "e", "namespace": "ns1"},
                    "spec": {"source": {"kind": "PersistentVolumeClaim", "name": "d"}},
                    "status": {"phase": "Ready", "serviceName": "virt-export-e", "tokenSecretRef": "tok"}})
            };
            async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok::<_, std::convert::Infallible>(
                    Response::builder()
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(body.to_string())))
                        .unwrap(),
                )
            }
        });
        (kube::Client::new(svc, "ns1"), seen)
    }

    #[tokio::test]
    async fn requests_at_the_same_time_share_one_read_and_the_next_reads_again() {
        let token = Arc::new(std::sync::Mutex::new("first"));
        let (client, seen) = api_server(Arc::clone(&token));
        let lookups = Lookups::new(client);
        let got = futures::future::join_all((0..50).map(|_| lookups.get("ns1", "e"))).await;
        assert_eq!(
            seen.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "one GET of the export, one of the Secret"
        );
        for g in got {
            assert!(
                matches!(g, Lookup::Found { ref service, ref token } if service == "virt-export-e" && token == b"first")
            );
        }
        // Nothing is kept: a changed token is what the next request is checked against.
        *token.lock().unwrap() = "second";
        let next = lookups.get("ns1", "e").await;
        assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 4);
        assert!(matches!(next, Lookup::Found { ref token, .. } if token == b"second"));
        assert!(lookups.pending.lock().unwrap().is_empty());
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("keep-alive, x-drop"));
        h.insert("x-drop", HeaderValue::from_static("1"));
        h.insert("range", HeaderValue::from_static("bytes=10-"));
        h.insert("if-range", HeaderValue::from_static("x"));
        h.insert("host", HeaderValue::from_static("proxy"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        let out = end_to_end(&h);
        let mut names: Vec<_> = out.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["if-range", "range"]);
    }

    /// The relay passes on what the export server does: a body it cuts short reaches the client
    /// as an error (never as a complete download), a whole one arrives whole.
    #[tokio::test]
    async fn a_download_the_export_server_cuts_short_fails_for_the_client() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let now = jiff::Timestamp::now();
        let hour = Duration::from_secs(3600);
        let ca = crate::vmexport::certs::new_ca(now).unwrap();
        let up =
            crate::vmexport::certs::issue_serving(&ca, "virt-export-e", "ns1", now, hour).unwrap();
        let own = crate::vmexport::certs::issue_serving(&ca, SERVICE, "ns1", now, hour).unwrap();

        // The export server promises 1,000 bytes; for `/cut` it sends 500 and closes, for
        // `/hold` it sends 500 and waits.
        let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream_addr = upstream.local_addr().unwrap().to_string();
        let up_tls =
            tokio_rustls::TlsAcceptor::from(tls::server_config_pem(&up.cert, &up.key).unwrap());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = upstream.accept().await {
                let up_tls = up_tls.clone();
                tokio::spawn(async move {
                    let mut s = up_tls.accept(tcp).await.unwrap();
                    let (mut req, mut buf) = (Vec::new(), [0u8; 1024]);
                    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                        let n = s.read(&mut buf).await.unwrap();
                        assert!(n > 0, "the proxy closed before its request was whole");
                        req.extend_from_slice(&buf[..n]);
                    }
                    let cut = req.starts_with(b"GET /cut ");
                    s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
                        .await
                        .unwrap();
                    s.write_all(&[7; 500]).await.unwrap();
                    if req.starts_with(b"GET /hold ") {
                        // Stays in flight until the test is over.
                        std::future::pending::<()>().await;
                    }
                    if !cut {
                        s.write_all(&[7; 500]).await.unwrap();
                    }
                    s.shutdown().await.ok();
                });
            }
        });

        let (client, _) = api_server(Arc::new(std::sync::Mutex::new("t0ken")));
        let metrics = Metrics::new(&Registry::new()).unwrap();
        let state = Arc::new(State {
            lookups: Lookups::new(client),
            upstream_tls: upstream_tls(&ca.cert).unwrap(),
            upstream_address: Some(upstream_addr),
            metrics: metrics.clone(),
            admission: Admission::new(0, Duration::from_secs(1)),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy_addr = listener.local_addr().unwrap();
        let acceptor =
            tokio_rustls::TlsAcceptor::from(tls::server_config_pem(&own.cert, &own.key).unwrap());
        let handler = move |req, _peer| handle(Arc::clone(&state), req);
        let t = conn::Timeouts {
            idle: conn::IDLE_TIMEOUT,
            drain: Duration::from_secs(1),
        };
        tokio::spawn(conn::serve(
            listener,
            acceptor,
            handler,
            t,
            std::future::pending(),
        ));

        let client_tls = upstream_tls(&ca.cert).unwrap();
        let open = |rest: &'static str| {
            let client_tls = client_tls.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(proxy_addr).await.unwrap();
                let name =
                    rustls::pki_types::ServerName::try_from(format!("{SERVICE}.ns1.svc")).unwrap();
                let tls = client_tls.connect(name, tcp).await.unwrap();
                let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                    .await
                    .unwrap();
                tokio::spawn(conn);
                let req = Request::get(format!(
                    "/api/export.kubevirt.io/v1/namespaces/ns1/virtualmachineexports/e{rest}"
                ))
                .header(TOKEN_HEADER, "t0ken")
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap();
                send.send_request(req).await
            }
        };
        let get = |rest: &'static str| async move {
            // A cut may come before or after the response headers reach the client.
            let resp = open(rest).await?;
            assert_eq!(resp.status(), StatusCode::OK);
            resp.into_body().collect().await.map(|b| b.to_bytes().len())
        };
        // Nothing else in flight: each transfer reads ahead in a task of its own.
        assert_eq!(get("/whole").await.unwrap(), 1000);
        assert!(get("/cut").await.is_err(), "a cut download looked complete");
        // One transfer held open fills this runtime's one worker: the next ones are relayed in
        // their client connection's task.
        let held = open("/hold").await.unwrap();
        assert_eq!(held.status(), StatusCode::OK);
        assert_eq!(get("/whole").await.unwrap(), 1000);
        assert!(get("/cut").await.is_err(), "a cut download looked complete");
        drop(held);
        // None is still counted as a transfer in flight (nor holds a slot).
        for _ in 0..250 {
            if metrics.active.get() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(metrics.active.get(), 0, "transfers left in flight");
    }
}

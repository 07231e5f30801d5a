//! `ucm router` (docs/exporter.md, "The router"): `jumpstarter.v1.RouterService.Stream` pairs the
//! two streams that carry a router token with the same subject and forwards frames unchanged both
//! ways. On SIGTERM it drains (docs/exporter.md, "Routers that drain").

pub mod certs;
pub mod token;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::{Args as _, FromArgMatches};
use futures::future::BoxFuture;
use jiff::Timestamp;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::ObjectMeta;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use crate::exporter::proto::jumpstarter::v1::router_service_server::{
    RouterService, RouterServiceServer,
};
use crate::exporter::proto::jumpstarter::v1::{StreamRequest, StreamResponse};
use crate::exporter::tls;
use crate::runtime::cli::{BindAddress, LogFormat, parse_bind_address};
use crate::runtime::health::Health;
use crate::runtime::{Agent, Writer, http, logging, shutdown};
use token::RouterKey;

pub const NAME: &str = "router";
/// The generated router key, in the manager's namespace, data key `key`.
pub const KEY_SECRET: &str = "ucm-router-key";
pub const KEY_DATA: &str = "key";
/// The readiness check: ok while the router takes new pairs.
const READY_CHECK: &str = "router";

type Outbound = mpsc::Sender<Result<StreamResponse, Status>>;

enum Slot {
    Waiting {
        id: u64,
        inbound: Box<Streaming<StreamRequest>>,
        tx: Outbound,
    },
    Paired,
}

/// A draining router still takes the streams of tokens minted up to this long after its drain
/// began: the manager named it before it saw the router leave, and the pair must meet here.
pub const HANDOFF_SECS: i64 = 10;
/// A stream still unpaired this long into a drain is ended (`UNAVAILABLE`): its peer is not
/// coming, and it must not hold the drain for the rest of its token's life.
pub const UNPAIRED_GRACE: Duration = Duration::from_secs(60);

/// The pairing service. Cheap to clone.
#[derive(Clone)]
pub struct Router {
    key: RouterKey,
    slots: Arc<Mutex<HashMap<String, Slot>>>,
    next_id: Arc<std::sync::atomic::AtomicU64>,
    /// When the drain began (Unix seconds); unset while serving.
    draining: Arc<std::sync::OnceLock<i64>>,
}

impl Router {
    pub fn new(key: RouterKey) -> Self {
        Router {
            key,
            slots: Default::default(),
            next_id: Default::default(),
            draining: Default::default(),
        }
    }

    /// Streams waiting for their peer and pairs being carried.
    pub fn carried(&self) -> (usize, usize) {
        let slots = self.slots.lock().expect("router slots");
        let waiting = slots
            .values()
            .filter(|s| matches!(s, Slot::Waiting { .. }))
            .count();
        (waiting, slots.len() - waiting)
    }

    /// Drains (docs/exporter.md, "Routers that drain"): from now on only the streams of tokens
    /// minted before the drain began (plus [`HANDOFF_SECS`]) are taken; after [`UNPAIRED_GRACE`]
    /// streams still waiting for a peer are ended; returns once nothing is carried, or at
    /// `limit` with the number of pairs it leaves to be cut.
    pub async fn drain(&self, limit: Duration) -> usize {
        let _ = self.draining.set(Timestamp::now().as_second());
        let t0 = tokio::time::Instant::now();
        let mut unpaired_ended = false;
        loop {
            let (waiting, paired) = self.carried();
            if waiting + paired == 0 {
                return 0;
            }
            if !unpaired_ended && t0.elapsed() >= UNPAIRED_GRACE.min(limit) {
                unpaired_ended = true;
                self.slots
                    .lock()
                    .expect("router slots")
                    .retain(|_, s| match s {
                        Slot::Waiting { tx, .. } => {
                            let _ = tx.try_send(Err(Status::unavailable(
                                "router draining: no peer came; dial again",
                            )));
                            false
                        }
                        Slot::Paired => true,
                    });
                continue;
            }
            if t0.elapsed() >= limit {
                return paired;
            }
            tokio::time::sleep(Duration::from_millis(200).min(limit)).await;
        }
    }

    pub fn server(self) -> RouterServiceServer<Router> {
        RouterServiceServer::new(self)
    }
}

/// The bearer token of a request; never echoed in errors.
pub fn bearer<T>(req: &Request<T>) -> Result<&str, Status> {
    let mut values = req.metadata().get_all("authorization").iter();
    let (Some(v), None) = (values.next(), values.next()) else {
        return Err(Status::unauthenticated(
            "expected exactly one authorization header",
        ));
    };
    let v = v
        .to_str()
        .map_err(|_| Status::invalid_argument("malformed authorization header"))?;
    match v.split_once(' ') {
        Some((scheme, tok)) if scheme.eq_ignore_ascii_case("bearer") && !tok.is_empty() => {
            Ok(tok.trim())
        }
        _ => Err(Status::invalid_argument(
            "malformed authorization header: expected a bearer token",
        )),
    }
}

async fn forward(mut inbound: Streaming<StreamRequest>, tx: Outbound) {
    loop {
        match inbound.message().await {
            Ok(Some(f)) => {
                let out = StreamResponse {
                    payload: f.payload,
                    frame_type: f.frame_type,
                };
                if tx.send(Ok(out)).await.is_err() {
                    return;
                }
            }
            Ok(None) | Err(_) => return,
        }
    }
}

#[tonic::async_trait]
impl RouterService for Router {
    async fn stream(
        &self,
        req: Request<Streaming<StreamRequest>>,
    ) -> Result<Response<tonic::codegen::BoxStream<StreamResponse>>, Status> {
        let claims = token::verify(&self.key, bearer(&req)?, Timestamp::now())
            .map_err(|e| Status::unauthenticated(format!("invalid router token: {e}")))?;
        let sub = claims.sub;
        if let Some(since) = self.draining.get()
            && claims.iat > since + HANDOFF_SECS
        {
            // jmp retries a Dial on UNAVAILABLE, and the manager names ready routers only.
            return Err(Status::unavailable("router draining: dial again"));
        }
        let inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let mut slots = self.slots.lock().expect("router slots");
        match slots.remove(&sub) {
            None => {
                let id = self
                    .next_id
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                slots.insert(
                    sub.clone(),
                    Slot::Waiting {
                        id,
                        inbound: Box::new(inbound),
                        tx,
                    },
                );
                debug!(stream = %sub, "router: first stream waiting for its peer");
                // An unpaired stream ends when its token expires.
                let wait =
                    Duration::from_secs((claims.exp - Timestamp::now().as_second()).max(0) as u64);
                let slots = self.slots.clone();
                // The timer holds no sender of its own (it uses the slot's): once paired, the
                // stream ends with its pair, not when the token would have expired.
                tokio::spawn(async move {
                    tokio::time::sleep(wait).await;
                    let mut slots = slots.lock().expect("router slots");
                    if matches!(slots.get(&sub), Some(Slot::Waiting { id: i, .. }) if *i == id)
                        && let Some(Slot::Waiting { tx, .. }) = slots.remove(&sub)
                    {
                        let _ = tx.try_send(Err(Status::deadline_exceeded(
                            "no peer connected before the router token expired",
                        )));
                    }
                });
            }
            Some(Slot::Waiting {
                inbound: first_in,
                tx: first_tx,
                ..
            }) => {
                slots.insert(sub.clone(), Slot::Paired);
                debug!(stream = %sub, "router: streams paired");
                let slots = self.slots.clone();
                tokio::spawn(async move {
                    // Whichever side ends first ends the other: dropping both senders closes
                    // both response streams.
                    tokio::select! {
                        _ = forward(*first_in, tx) => {}
                        _ = forward(inbound, first_tx) => {}
                    }
                    slots.lock().expect("router slots").remove(&sub);
                    debug!(stream = %sub, "router: pair ended");
                });
            }
            Some(Slot::Paired) => {
                slots.insert(sub, Slot::Paired);
                return Err(Status::already_exists("stream already paired"));
            }
        }
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// `ucm router` flags. `ROUTER_KEY`, `EXTERNAL_CERT_PEM` and `EXTERNAL_KEY_PEM` are read from the
/// environment only, so they never show in `--help` or process listings.
#[derive(clap::Args, Debug, Clone)]
pub struct RouterArgs {
    /// Listen address of the RouterService (TLS).
    #[arg(long, default_value = ":8083", value_name = "ADDR")]
    pub bind_address: String,
    /// The endpoint clients and exporters dial; the self-signed certificate is issued for its host.
    #[arg(long, env = "GRPC_ROUTER_ENDPOINT", default_value = "localhost:8083")]
    pub endpoint: String,
    /// Namespace holding the generated key Secret `ucm-router-key` (used without ROUTER_KEY).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// This replica's Pod address (the manager hands it out); added to the self-signed
    /// certificate.
    #[arg(long, env = "POD_IP", value_name = "IP")]
    pub pod_ip: Option<String>,
    /// Address of /healthz and /readyz (not ready while draining): ":8081", "host:port", or "0".
    #[arg(long, default_value = ":8081", value_parser = parse_bind_address, value_name = "ADDR")]
    pub health_probe_bind_address: BindAddress,
    /// On SIGTERM, how long paired streams are carried before the router exits anyway; match the
    /// Pod's terminationGracePeriodSeconds.
    #[arg(long, default_value = "2h", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub drain_limit: Duration,
    /// Log filter directive. Default: RUST_LOG, else "info".
    #[arg(long, value_name = "DIRECTIVE")]
    pub log_level: Option<String>,
    /// Log output format.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

fn command() -> clap::Command {
    RouterArgs::augment_args(clap::Command::new(NAME).about(
        "Run the Jumpstarter router: pairs client and exporter streams (env ROUTER_KEY, \
         EXTERNAL_CERT_PEM, EXTERNAL_KEY_PEM)",
    ))
}

fn run_agent(m: clap::ArgMatches) -> BoxFuture<'static, anyhow::Result<()>> {
    Box::pin(async move { main(RouterArgs::from_arg_matches(&m)?).await })
}

pub const AGENT: Agent = Agent {
    name: NAME,
    command,
    run: run_agent,
};

/// Reads the generated key Secret, waiting until the manager's leader has created it.
pub async fn wait_for_key(
    api: &Api<Secret>,
    stop: &CancellationToken,
) -> anyhow::Result<RouterKey> {
    let mut logged = false;
    loop {
        if let Some(s) = api.get_opt(KEY_SECRET).await? {
            return key_from_secret(&s).ok_or_else(|| {
                anyhow::anyhow!("Secret {KEY_SECRET} has no non-empty `{KEY_DATA}` entry")
            });
        }
        if !logged {
            info!(
                secret = KEY_SECRET,
                "waiting for the manager to create the router key"
            );
            logged = true;
        }
        tokio::select! {
            _ = stop.cancelled() => anyhow::bail!("stopped while waiting for the router key"),
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

fn key_from_secret(s: &Secret) -> Option<RouterKey> {
    RouterKey::new(s.data.as_ref()?.get(KEY_DATA)?.0.clone())
}

/// The manager side (leader): the router key from `ROUTER_KEY`, else the Secret, created once
/// when missing and never overwritten.
pub async fn ensure_key(
    env_key: Option<&str>,
    api: &Api<Secret>,
    writer: &Writer,
    namespace: &str,
) -> Result<RouterKey, String> {
    if let Some(k) = env_key {
        return RouterKey::new(k.as_bytes().to_vec()).ok_or_else(|| "ROUTER_KEY is empty".into());
    }
    for _ in 0..5 {
        if let Some(s) = api
            .get_opt(KEY_SECRET)
            .await
            .map_err(|e| format!("cannot read Secret {KEY_SECRET}: {e}"))?
        {
            return key_from_secret(&s)
                .ok_or_else(|| format!("Secret {KEY_SECRET} has no `{KEY_DATA}` entry"));
        }
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(KEY_SECRET.into()),
                namespace: Some(namespace.into()),
                ..Default::default()
            },
            type_: Some("Opaque".into()),
            data: Some(BTreeMap::from([(
                KEY_DATA.to_string(),
                ByteString(RouterKey::generate_text().into_bytes()),
            )])),
            ..Default::default()
        };
        match writer.create(api, &secret).await {
            Ok(s) => {
                info!(secret = KEY_SECRET, "generated the router key");
                return key_from_secret(&s).ok_or_else(|| "router key Secret lost its key".into());
            }
            Err(e) if e.is_conflict() => continue,
            Err(e) => return Err(format!("cannot create Secret {KEY_SECRET}: {e}")),
        }
    }
    Err(format!("cannot create or read Secret {KEY_SECRET}"))
}

pub async fn main(args: RouterArgs) -> anyhow::Result<()> {
    logging::init(args.log_level.as_deref(), args.log_format).map_err(|e| anyhow::anyhow!(e))?;
    let addr: SocketAddr = parse_bind_address(&args.bind_address)
        .map_err(|e| anyhow::anyhow!("--bind-address: {e}"))?
        .addr()
        .ok_or_else(|| anyhow::anyhow!("--bind-address cannot be 0"))?;
    let stop = CancellationToken::new();
    shutdown::install(stop.clone());
    let health = Health::new();
    health.set(READY_CHECK, Err("starting".into()));
    let servers_stop = CancellationToken::new();
    if let Some(a) = args.health_probe_bind_address.addr() {
        let l = http::bind(a, "--health-probe-bind-address").await?;
        tokio::spawn(http::serve_health(l, health.clone(), servers_stop.clone()));
    }
    let key = match std::env::var("ROUTER_KEY").ok() {
        Some(k) => RouterKey::new(k.into_bytes())
            .ok_or_else(|| anyhow::anyhow!("ROUTER_KEY is set but empty"))?,
        None => {
            let client = kube::Client::try_default().await?;
            wait_for_key(&Api::namespaced(client, &args.namespace), &stop).await?
        }
    };
    let external = tls::from_env().map_err(|e| anyhow::anyhow!(e))?;
    let reload = external.is_some();
    let pair = match external {
        Some(c) => c,
        None => {
            let more: Vec<&str> = args.pod_ip.iter().map(String::as_str).collect();
            tls::self_signed_with(&args.endpoint, &more).map_err(|e| anyhow::anyhow!(e))?
        }
    };
    let certs = certs::Reloading::new(pair).map_err(|e| anyhow::anyhow!(e))?;
    if reload {
        tokio::spawn(certs.clone().watch(tls::from_env, servers_stop.clone()));
    }
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(
        certs.server_config().map_err(|e| anyhow::anyhow!(e))?,
    ));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    info!(%addr, endpoint = %args.endpoint, "router listening");
    let router = Router::new(key);
    // The listener stays open while draining: a late stream gets a clear UNAVAILABLE rather
    // than a refused connection.
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(router.clone().server())
            .serve_with_incoming(certs::incoming(listener, acceptor, servers_stop.clone())),
    );
    health.set(READY_CHECK, Ok(()));
    tokio::select! {
        _ = stop.cancelled() => {}
        r = server => {
            servers_stop.cancel();
            r??;
            anyhow::bail!("router server stopped");
        }
    }
    // Routers that drain (docs/exporter.md): not ready, so no manager hands this router out;
    // every pair carried until it ends or the limit passes.
    health.set(READY_CHECK, Err("draining".into()));
    let (waiting, paired) = router.carried();
    info!(paired, waiting, limit = ?args.drain_limit, "router draining");
    let cut = router.drain(args.drain_limit).await;
    if cut > 0 {
        warn!(
            cut,
            "router drain limit passed: the pairs still carried are cut"
        );
    }
    servers_stop.cancel();
    info!("router stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::proto::jumpstarter::v1::router_service_client::RouterServiceClient;
    use tokio_stream::wrappers::TcpListenerStream;
    use tonic::transport::Channel;

    async fn serve(key: RouterKey) -> Channel {
        serve_router(Router::new(key)).await
    }

    async fn serve_router(router: Router) -> Channel {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(router.server())
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    fn open(
        ch: &Channel,
        token: &str,
    ) -> (
        mpsc::Sender<StreamRequest>,
        impl std::future::Future<Output = Result<Response<Streaming<StreamResponse>>, Status>>,
    ) {
        let (tx, rx) = mpsc::channel(4);
        let mut req = Request::new(ReceiverStream::new(rx));
        req.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        let mut c = RouterServiceClient::new(ch.clone());
        (tx, async move { c.stream(req).await })
    }

    fn frame(p: &[u8], t: i32) -> StreamRequest {
        StreamRequest {
            payload: p.to_vec(),
            frame_type: t,
        }
    }

    /// Pairing by `sub`, frames both ways unchanged, bad tokens and a third stream refused,
    /// and one side ending ends the other.
    #[tokio::test]
    async fn pairs_forwards_and_rejects() {
        let key = RouterKey::new(b"test-router-key".to_vec()).unwrap();
        let ch = serve(key.clone()).await;
        let (tok, _, _) = token::mint(&key, Timestamp::now());

        let (a_tx, a) = open(&ch, &tok);
        let mut a = a.await.unwrap().into_inner();
        let (b_tx, b) = open(&ch, &tok);
        let mut b = b.await.unwrap().into_inner();

        a_tx.send(frame(b"hello", 0)).await.unwrap();
        let got = b.message().await.unwrap().unwrap();
        assert_eq!((got.payload.as_slice(), got.frame_type), (&b"hello"[..], 0));
        b_tx.send(frame(b"ping", 6)).await.unwrap();
        let got = a.message().await.unwrap().unwrap();
        assert_eq!((got.payload.as_slice(), got.frame_type), (&b"ping"[..], 6));

        let (_c_tx, c) = open(&ch, &tok);
        let err = match c.await {
            Err(e) => e,
            Ok(mut s) => s.get_mut().message().await.unwrap_err(),
        };
        assert_eq!(err.code(), tonic::Code::AlreadyExists);

        let other = RouterKey::new(b"other".to_vec()).unwrap();
        let (bad, _, _) = token::mint(&other, Timestamp::now());
        let (_d_tx, d) = open(&ch, &bad);
        let err = match d.await {
            Err(e) => e,
            Ok(mut s) => s.get_mut().message().await.unwrap_err(),
        };
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(!err.message().contains(&bad), "token echoed");

        drop(a_tx);
        assert!(b.message().await.unwrap().is_none(), "peer not ended");
    }

    async fn refused(ch: &Channel, token: &str) -> tonic::Code {
        let (_tx, s) = open(ch, token);
        match s.await {
            Err(e) => e.code(),
            Ok(mut s) => s.get_mut().message().await.unwrap_err().code(),
        }
    }

    /// A draining router (docs/exporter.md, "Routers that drain") carries the pair it has until
    /// it ends, pairs the streams of tokens minted before the drain (the manager named it then),
    /// refuses later ones with UNAVAILABLE, ends a stream whose peer never comes, and returns
    /// once nothing is carried; at the limit it returns the pairs it cuts.
    #[tokio::test]
    async fn drains_carried_pairs_and_refuses_new_ones() {
        let key = RouterKey::new(b"test-router-key".to_vec()).unwrap();
        let router = Router::new(key.clone());
        let ch = serve_router(router.clone()).await;
        let now = Timestamp::now();
        let (carried, _, _) = token::mint(&key, now);
        let (a_tx, a) = open(&ch, &carried);
        let mut a = a.await.unwrap().into_inner();
        let (b_tx, b) = open(&ch, &carried);
        let mut b = b.await.unwrap().into_inner();
        a_tx.send(frame(b"before", 0)).await.unwrap();
        assert_eq!(b.message().await.unwrap().unwrap().payload, b"before");

        let drain = tokio::spawn({
            let r = router.clone();
            async move { r.drain(Duration::from_secs(3600)).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!drain.is_finished(), "a carried pair holds the drain");

        // Minted after the handoff: the manager no longer names this router.
        let late = now + jiff::SignedDuration::from_secs(HANDOFF_SECS + 2);
        let (late, _, _) = token::mint(&key, late);
        assert_eq!(refused(&ch, &late).await, tonic::Code::Unavailable);

        // Minted before the drain: both sides are paired here.
        let (early, _, _) = token::mint(&key, now);
        let (c_tx, c) = open(&ch, &early);
        let mut c = c.await.unwrap().into_inner();
        let (_d_tx, d) = open(&ch, &early);
        let mut d = d.await.unwrap().into_inner();
        c_tx.send(frame(b"paired while draining", 0)).await.unwrap();
        assert_eq!(
            d.message().await.unwrap().unwrap().payload,
            b"paired while draining"
        );
        assert_eq!(router.carried(), (0, 2));

        // The first pair still carries frames both ways.
        b_tx.send(frame(b"during", 0)).await.unwrap();
        assert_eq!(a.message().await.unwrap().unwrap().payload, b"during");
        drop((a_tx, b_tx, c_tx));
        assert!(a.message().await.unwrap().is_none());
        assert!(c.message().await.unwrap().is_none());
        let cut = tokio::time::timeout(Duration::from_secs(5), drain)
            .await
            .expect("the drain ends with its last pair")
            .unwrap();
        assert_eq!(cut, 0);

        // An unpaired stream is ended at the grace; a pair past the limit is counted as cut.
        let r = Router::new(key.clone());
        let ch = serve_router(r.clone()).await;
        let (lonely, _, _) = token::mint(&key, Timestamp::now());
        let (_l_tx, l) = open(&ch, &lonely);
        let mut l = l.await.unwrap().into_inner();
        let (kept, _, _) = token::mint(&key, Timestamp::now());
        let (_k1, k1) = open(&ch, &kept);
        let _k1 = k1.await.unwrap();
        let (_k2, k2) = open(&ch, &kept);
        let _k2 = k2.await.unwrap();
        assert_eq!(r.carried(), (1, 1));
        assert_eq!(r.drain(Duration::from_millis(300)).await, 1);
        let err = l.message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
    }
}

//! Phase `grpc`, second part (docs/exporter.md, "Every replica serves"): the gRPC plane on one
//! and on two replicas. Simulated exporters (as in `grpc`, plus Listen: each leased one reports
//! LeaseReady and opens Listen, as the real exporter does) connect to the replicas the way a
//! Service spreads them: all to one replica, then alternately to two. Measured:
//! - memory per connected exporter per replica (RSS growth / streams on that replica);
//! - how the streams split between the replicas;
//! - Dial → the exporter receives the router token, through the replica holding the exporter's
//!   Listen (same) and through the other one (cross);
//! - after a SIGKILL of one replica, the time until every one of its exporters holds a Status
//!   stream on the survivor again (each reconnects at once to the next endpoint, as through a
//!   Service whose endpoint went), and until a Dial for one of them succeeds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::ListParams;
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use serde_json::json;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use ucm::exporter::crd::{Client, Exporter, Lease};
use ucm::exporter::proto::jumpstarter::v1 as pb;
use ucm::exporter::proto::jumpstarter::v1::controller_service_client::ControllerServiceClient;

use crate::Ctx;
use crate::kube_util::{create_all, create_namespace, delete_namespace, track};
use crate::procs::Proc;
use crate::report::{Figure, median, percentile};

const PHASE: &str = "grpc";
const NS: &str = "bench-grpc-ha";
const LEASE_ID: &str = "ucm-bench-grpc-ha";
/// Exporters with a Lease each, for the Dial latencies.
const LEASED: usize = 20;
/// Dials per leased exporter and path.
const DIALS: usize = 10;

/// When each router token reached its exporter's Listen stream.
type Receipts = Arc<Mutex<HashMap<String, Instant>>>;

fn request<T>(msg: T, kind: &str, name: &str, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    let md = r.metadata_mut();
    md.insert("authorization", format!("Bearer {token}").parse().unwrap());
    md.insert("jumpstarter-namespace", NS.parse().unwrap());
    md.insert("jumpstarter-kind", kind.parse().unwrap());
    md.insert("jumpstarter-name", name.parse().unwrap());
    r
}

async fn connect(endpoints: &[String], tls: &ClientTlsConfig) -> Channel {
    let start = Instant::now();
    loop {
        for e in endpoints {
            if let Ok(c) = Channel::from_shared(e.clone())
                .unwrap()
                .tls_config(tls.clone())
                .unwrap()
                .connect_timeout(Duration::from_millis(500))
                .connect()
                .await
            {
                return c;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no replica of {endpoints:?} accepts connections"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// ReportStatus, as the real exporter sends it (a failure shows in the phase's waits).
async fn report(
    c: &mut ControllerServiceClient<Channel>,
    status: pb::ExporterStatus,
    name: &str,
    token: &str,
) {
    let msg = pb::ReportStatusRequest {
        status: status as i32,
        message: None,
        release_lease: None,
    };
    let _ = c.report_status(request(msg, "Exporter", name, token)).await;
}

/// One simulated exporter: its first reachable endpoint in `endpoints` order; Register once,
/// then a Status stream (reconnecting at once when it ends), LeaseReady and Listen when leased.
fn exporter(
    endpoints: Vec<String>,
    tls: ClientTlsConfig,
    name: String,
    token: String,
    receipts: Receipts,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut registered = false;
        loop {
            let mut c = ControllerServiceClient::new(connect(&endpoints, &tls).await);
            if !registered {
                let reg = pb::RegisterRequest {
                    labels: [("jumpstarter.dev/board".to_string(), "bench".to_string())].into(),
                    reports: vec![],
                };
                if c.register(request(reg, "Exporter", &name, &token))
                    .await
                    .is_err()
                {
                    continue;
                }
                report(&mut c, pb::ExporterStatus::Available, &name, &token).await;
                registered = true;
            }
            let Ok(stream) = c
                .status(request(pb::StatusRequest {}, "Exporter", &name, &token))
                .await
            else {
                continue;
            };
            let mut stream = stream.into_inner();
            let mut listening: Option<tokio::task::JoinHandle<()>> = None;
            while let Some(Ok(st)) = stream.next().await {
                let Some(lease) = st.lease_name.filter(|_| st.leased) else {
                    continue;
                };
                if listening.is_some() {
                    continue;
                }
                report(&mut c, pb::ExporterStatus::LeaseReady, &name, &token).await;
                let mut lc = c.clone();
                let (name, token, receipts) = (name.clone(), token.clone(), receipts.clone());
                listening = Some(tokio::spawn(async move {
                    let Ok(s) = lc
                        .listen(request(
                            pb::ListenRequest { lease_name: lease },
                            "Exporter",
                            &name,
                            &token,
                        ))
                        .await
                    else {
                        return;
                    };
                    let mut s = s.into_inner();
                    while let Some(Ok(m)) = s.next().await {
                        receipts
                            .lock()
                            .unwrap()
                            .insert(m.router_token, Instant::now());
                    }
                }));
            }
            if let Some(l) = listening {
                l.abort();
            }
        }
    })
}

/// Dials `lease` through `ch`; the time until its exporter received the token.
async fn dial(ch: &Channel, lease: &str, token: &str, receipts: &Receipts) -> Option<f64> {
    let t0 = Instant::now();
    let resp = ControllerServiceClient::new(ch.clone())
        .dial(request(
            pb::DialRequest {
                lease_name: lease.into(),
            },
            "Client",
            "dialer",
            token,
        ))
        .await
        .ok()?
        .into_inner();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(at) = receipts.lock().unwrap().get(&resp.router_token) {
            return Some((*at - t0).as_secs_f64() * 1000.0);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn start(ctx: &Ctx, i: usize) -> Proc {
    let mut args = crate::bulk::manager_args();
    args.push(format!("--leader-election-id={LEASE_ID}"));
    args.push(format!("--watch-namespace={NS}"));
    Proc::manager(
        &ctx.plane.manager_kubeconfig,
        ctx.work.join(format!("grpc-replica-{i}.log")),
        &args,
    )
}

async fn streams(m: &Proc, stream: &str) -> usize {
    m.metric(&format!("ucm_exporter_grpc_streams{{stream=\"{stream}\"}}"))
        .await as usize
}

async fn wait_streams(ms: &[&Proc], status: usize, listen: usize, what: &str) -> Duration {
    let start = Instant::now();
    loop {
        let (mut s, mut l) = (0, 0);
        for m in ms {
            s += streams(m, "status").await;
            l += streams(m, "listen").await;
        }
        if s >= status && l >= listen {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "{what}: {s} of {status} Status and {l} of {listen} Listen streams after 300 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let n = ctx.scale.grpc_exporters;
    let c = ctx.plane.admin.clone();
    create_namespace(&c, NS).await;
    let exporters: Api<Exporter> = Api::namespaced(c.clone(), NS);
    let names: Vec<String> = (0..n).map(|i| format!("sim-{i:04}")).collect();
    // The leased exporters alternate in parity, so half sit on each replica below (the
    // exporters alternate between the two replicas by index).
    let leased: Vec<usize> = (0..LEASED)
        .map(|k| (k * (n / LEASED).max(2) + k % 2).min(n - 1))
        .collect();
    let creds = track(exporters.clone(), watcher::Config::default(), n, |e| {
        e.status.as_ref().is_some_and(|s| s.credential.is_some())
    });
    create_all(
        &exporters,
        names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let mut labels = json!({});
                if let Some(k) = leased.iter().position(|x| *x == i) {
                    labels["bench-dial"] = json!(k.to_string());
                }
                serde_json::from_value(json!({
                    "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
                    "metadata": {"name": name, "labels": labels}, "spec": {}
                }))
                .unwrap()
            })
            .collect(),
    )
    .await;
    let clients: Api<Client> = Api::namespaced(c.clone(), NS);
    create_all(
        &clients,
        vec![
            serde_json::from_value(json!({
                "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Client",
                "metadata": {"name": "dialer"}, "spec": {}
            }))
            .unwrap(),
        ],
    )
    .await;

    let mut a = start(ctx, 0);
    a.wait_ready(Duration::from_secs(120)).await;
    creds
        .wait("exporter credentials", Duration::from_secs(600))
        .await;
    let secrets: Api<Secret> = Api::namespaced(c.clone(), NS);
    let (tokens, client_token) = loop {
        let mut tokens: HashMap<String, String> = HashMap::new();
        let mut client_token = None;
        for s in secrets.list(&ListParams::default()).await.unwrap().items {
            let name = s.name_any();
            let Some(t) = s
                .data
                .as_ref()
                .and_then(|d| d.get("token"))
                .and_then(|t| String::from_utf8(t.0.clone()).ok())
            else {
                continue;
            };
            if let Some(e) = name.strip_suffix("-exporter") {
                tokens.insert(e.to_string(), t);
            } else if name == "dialer-client" {
                client_token = Some(t);
            }
        }
        if let Some(ct) = client_token
            && tokens.len() == n
        {
            break (tokens, ct);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let sys: Api<Secret> = Api::namespaced(c.clone(), crate::cluster::SYSTEM_NS);
    let ca = sys
        .get("ucm-exporter-grpc-tls")
        .await
        .unwrap()
        .data
        .unwrap()["tls.crt"]
        .0
        .clone();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    let url = |m: &Proc| format!("https://localhost:{}", m.grpc_port);
    let receipts: Receipts = Default::default();
    let spawn_all = |route: &dyn Fn(usize) -> Vec<String>| -> Vec<tokio::task::JoinHandle<()>> {
        names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                exporter(
                    route(i),
                    tls.clone(),
                    name.clone(),
                    tokens[name].clone(),
                    receipts.clone(),
                )
            })
            .collect()
    };

    // 1. One replica: every exporter on it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss_a0 = a.rss();
    let sims = spawn_all(&|_| vec![url(&a)]);
    wait_streams(&[&a], n, 0, "one replica").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let per_one = (a.rss().saturating_sub(rss_a0)) as f64 / n as f64 / 1024.0;
    let leases: Api<Lease> = Api::namespaced(c.clone(), NS);
    let assigned = track(leases.clone(), watcher::Config::default(), LEASED, |l| {
        l.status.as_ref().is_some_and(|s| s.exporter_ref.is_some())
    });
    create_all(
        &leases,
        (0..LEASED)
            .map(|k| {
                serde_json::from_value(json!({
                    "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
                    "metadata": {"name": format!("dial-{k}")},
                    "spec": {"clientRef": {"name": "dialer"}, "duration": "1h",
                             "selector": {"matchLabels": {"bench-dial": k.to_string()}}}
                }))
                .unwrap()
            })
            .collect(),
    )
    .await;
    assigned
        .wait("dial leases assigned", Duration::from_secs(120))
        .await;
    wait_streams(&[&a], n, LEASED, "one replica, Listen").await;
    let ch_a = connect(&[url(&a)], &tls).await;
    let mut one = Vec::new();
    for _ in 0..DIALS {
        for k in 0..LEASED {
            one.extend(dial(&ch_a, &format!("dial-{k}"), &client_token, &receipts).await);
        }
    }
    for s in &sims {
        s.abort();
    }

    // 2. Two replicas, the exporters alternating between them as a Service spreads them.
    let mut b = start(ctx, 1);
    b.wait_ready(Duration::from_secs(120)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss_b0 = b.rss();
    let (ua, ub) = (url(&a), url(&b));
    let sims = spawn_all(&|i| {
        if i % 2 == 0 {
            vec![ua.clone(), ub.clone()]
        } else {
            vec![ub.clone(), ua.clone()]
        }
    });
    wait_streams(&[&a, &b], n, LEASED, "two replicas").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (on_a, on_b) = (streams(&a, "status").await, streams(&b, "status").await);
    let per_two = (b.rss().saturating_sub(rss_b0)) as f64 / on_b.max(1) as f64 / 1024.0;
    let ch_b = connect(&[url(&b)], &tls).await;
    let (mut same, mut cross) = (Vec::new(), Vec::new());
    for _ in 0..DIALS {
        for (k, i) in leased.iter().enumerate() {
            let lease = format!("dial-{k}");
            let (home, other) = if i % 2 == 0 {
                (&ch_a, &ch_b)
            } else {
                (&ch_b, &ch_a)
            };
            same.extend(dial(home, &lease, &client_token, &receipts).await);
            cross.extend(dial(other, &lease, &client_token, &receipts).await);
        }
    }

    // 3. SIGKILL of the second replica: its exporters reconnect to the survivor.
    let on_b_leased = leased
        .iter()
        .position(|i| i % 2 == 1)
        .expect("a lease on B");
    let killed = Instant::now();
    b.stop("KILL");
    wait_streams(&[&a], n, LEASED, "re-homed after the kill").await;
    let rehome = killed.elapsed().as_secs_f64();
    let mut first_dial = None;
    while first_dial.is_none() && killed.elapsed() < Duration::from_secs(120) {
        if dial(
            &ch_a,
            &format!("dial-{on_b_leased}"),
            &client_token,
            &receipts,
        )
        .await
        .is_some()
        {
            first_dial = Some(killed.elapsed().as_secs_f64());
        }
    }
    for s in &sims {
        s.abort();
    }
    a.stop("TERM");
    delete_namespace(&c, NS, Duration::from_secs(300)).await;

    let p99 = |v: &[f64]| percentile(v, 0.99);
    let lat = |v: &[f64]| {
        format!(
            "{} Dials ({LEASED} leased exporters × {DIALS}); median {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            v.len(),
            median(v),
            p99(v),
            v.iter().copied().fold(0.0, f64::max)
        )
    };
    let split = format!("streams split {on_a} / {on_b} between the two replicas");
    vec![
        Figure::new(PHASE, "grpc.replicas.memory_one", &format!("memory per connected exporter, one replica holding all {n}"), "KiB", vec![per_one])
            .note("RSS growth of the replica from before the exporters connected to 3 s after every Status stream was open, divided by its streams; each simulated exporter holds one TLS connection with a Status stream (and the 20 leased ones a Listen stream)"),
        Figure::new(PHASE, "grpc.replicas.memory_two", &format!("memory per connected exporter per replica, two replicas sharing {n}"), "KiB", vec![per_two])
            .reference(per_one, "one replica holding all of them", true)
            .note(format!("the second replica's RSS growth over its own streams ({split}); the first replica's is not comparable after stage one. A lab of 50,000 exporters on two replicas: about {:.0} MiB per replica for the streams", per_two * 25_000.0 / 1024.0)),
        Figure::new(PHASE, "grpc.replicas.dial_same", "Dial → exporter receives the router token, through the replica holding its Listen (p99)", "ms", vec![p99(&same)])
            .reference(100.0, "issue 30's bound: p99 ≤ 100 ms", false)
            .note(format!("two replicas; {}", lat(&same))),
        Figure::new(PHASE, "grpc.replicas.dial_cross", "Dial → exporter receives the router token, through the other replica (p99)", "ms", vec![p99(&cross)])
            .reference(100.0, "issue 30's bound: p99 ≤ 100 ms", false)
            .note(format!("two replicas, the token handed over through a pending-dial ConfigMap (docs/exporter.md, \"Dial and Listen across replicas\"); {}; one replica, for comparison: {}", lat(&cross), lat(&one))),
        Figure::new(PHASE, "grpc.replicas.rehome", &format!("SIGKILL of one of two replicas → every exporter holds a Status stream (and the leased ones Listen) on the survivor ({on_b} exporters re-homed)"), "s", vec![rehome])
            .note(format!("each simulated exporter reconnects at once to the next replica's address when its stream ends, as the published exporter does through the headless `ucm-grpc` Service (it resolves every replica's address, and the killed one refuses the connection); then Register is not repeated (as upstream's exporter); a Dial for an exporter of the killed replica succeeded {} after the kill", first_dial.map_or("never (120 s)".to_string(), |s| format!("{s:.2} s")))),
    ]
}

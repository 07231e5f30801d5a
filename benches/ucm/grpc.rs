//! Phase `grpc` (docs/benchmarks.md):
//! 1,000 simulated exporters — a Rust client over the compiled jumpstarter.v1 stubs, each with
//! its own TLS connection and the token ucm minted into its credential Secret — Register, open a
//! Status stream and report Available, as the real exporter does. With every stream held, the
//! manager's API writes are counted from the audit log over whole-minute windows. Then some
//! exporters are killed (connection dropped without Unregister) and the time until their Exporter
//! shows Online=False is measured. Then the same plane on one and two replicas
//! (`grpc_replicas`), and the router (`grpc_router`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::ListParams;
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use serde_json::json;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use ucm::exporter::crd::Exporter;
use ucm::exporter::proto::jumpstarter::v1 as pb;
use ucm::exporter::proto::jumpstarter::v1::controller_service_client::ControllerServiceClient;

use crate::Ctx;
use crate::kube_util::{create_all, delete_namespace, track};
use crate::report::Figure;

const PHASE: &str = "grpc";
const NS: &str = "bench-grpc";

fn online(e: &Exporter) -> Option<bool> {
    e.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Online")
        .map(|c| c.status == "True")
}

fn request<T>(msg: T, name: &str, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    let md = r.metadata_mut();
    md.insert("authorization", format!("Bearer {token}").parse().unwrap());
    md.insert("jumpstarter-namespace", NS.parse().unwrap());
    md.insert("jumpstarter-kind", "Exporter".parse().unwrap());
    md.insert("jumpstarter-name", name.parse().unwrap());
    r
}

/// One simulated exporter: Register, Status stream (read until the connection dies), ReportStatus
/// Available. Returns once the stream is open; the task holding it is the exporter's "process".
async fn exporter(
    endpoint: String,
    tls: ClientTlsConfig,
    name: String,
    token: String,
) -> tokio::task::JoinHandle<()> {
    let mut tries = 0;
    let channel = loop {
        let r = Channel::from_shared(endpoint.clone())
            .unwrap()
            .tls_config(tls.clone())
            .unwrap()
            .connect()
            .await;
        match r {
            Ok(c) => break c,
            Err(e) if tries < 100 => {
                tries += 1;
                if tries % 20 == 0 {
                    eprintln!("  {name}: connect: {e}; retrying");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{name}: cannot connect to {endpoint}: {e}"),
        }
    };
    let mut c = ControllerServiceClient::new(channel);
    let mut labels = HashMap::new();
    labels.insert("jumpstarter.dev/board".to_string(), "bench".to_string());
    let reg = pb::RegisterRequest {
        labels,
        reports: vec![pb::DriverInstanceReport {
            uuid: uuid::Uuid::new_v4().to_string(),
            labels: [("jumpstarter.dev/client".to_string(), "power".to_string())].into(),
            ..Default::default()
        }],
    };
    c.register(request(reg, &name, &token))
        .await
        .unwrap_or_else(|e| panic!("{name}: Register: {e}"));
    let mut stream = c
        .status(request(pb::StatusRequest {}, &name, &token))
        .await
        .unwrap_or_else(|e| panic!("{name}: Status: {e}"))
        .into_inner();
    c.report_status(request(
        pb::ReportStatusRequest {
            status: pb::ExporterStatus::Available as i32,
            message: Some("Available".into()),
            release_lease: None,
        },
        &name,
        &token,
    ))
    .await
    .unwrap_or_else(|e| panic!("{name}: ReportStatus: {e}"));
    tokio::spawn(async move {
        // The client lives as long as the stream: aborting this task drops both, closing the
        // TCP connection as a killed exporter process would.
        let _client = c;
        while let Some(Ok(_)) = stream.next().await {}
    })
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let n = ctx.scale.grpc_exporters;
    let (c, mut m) = ctx.phase_manager("grpc", NS).await;

    let exporters: Api<Exporter> = Api::namespaced(c.clone(), NS);
    let names: Vec<String> = (0..n).map(|i| format!("sim-{i:04}")).collect();
    let tracker = track(
        exporters.clone(),
        watcher::Config::default(),
        n,
        |e: &Exporter| e.status.as_ref().is_some_and(|s| s.credential.is_some()),
    );
    create_all(
        &exporters,
        names
            .iter()
            .map(|name| {
                serde_json::from_value(json!({
                    "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
                    "metadata": {"name": name}, "spec": {}
                }))
                .unwrap()
            })
            .collect(),
    )
    .await;
    tracker
        .wait("exporter credentials", Duration::from_secs(600))
        .await;

    let secrets: Api<Secret> = Api::namespaced(c.clone(), NS);
    let tokens: HashMap<String, String> = secrets
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|s| {
            let name = s.name_any().strip_suffix("-exporter")?.to_string();
            let t = String::from_utf8(s.data?.get("token")?.0.clone()).ok()?;
            Some((name, t))
        })
        .collect();
    let sys: Api<Secret> = Api::namespaced(c.clone(), crate::cluster::SYSTEM_NS);
    let start = Instant::now();
    let ca = loop {
        if let Some(s) = sys.get_opt("ucm-exporter-grpc-tls").await.unwrap() {
            break s.data.unwrap()["tls.crt"].0.clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no gRPC certificate Secret"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    let endpoint = format!("https://localhost:{}", m.grpc_port);

    let t0 = Instant::now();
    let mut held: HashMap<String, tokio::task::JoinHandle<()>> =
        futures::stream::iter(names.clone())
            .map(|name| {
                let token = tokens
                    .get(&name)
                    .unwrap_or_else(|| panic!("no token for {name}"))
                    .clone();
                let (endpoint, tls) = (endpoint.clone(), tls.clone());
                async move { (name.clone(), exporter(endpoint, tls, name, token).await) }
            })
            .buffer_unordered(32)
            .collect()
            .await;
    eprintln!(
        "  {n} exporters connected in {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    let tracker = track(
        exporters.clone(),
        watcher::Config::default(),
        n,
        |e: &Exporter| online(e) == Some(true),
    );
    tracker
        .wait("every simulated exporter Online", Duration::from_secs(120))
        .await;

    // Kill some exporters (connection dropped, no Unregister) and time until each shows
    // Online=False, while the others are measured at steady state over whole windows
    // (W = T/3 = 20 s, so a 40 s window holds two heartbeat periods). The killed exporters'
    // objects are left out of the write counts.
    let victims: Vec<String> = names
        .iter()
        .step_by((n / ctx.scale.kills).max(1))
        .take(ctx.scale.kills)
        .cloned()
        .collect();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let watch_task = {
        let (exporters, victims) = (exporters.clone(), victims.clone());
        tokio::spawn(async move {
            let mut stream = watcher(exporters, watcher::Config::default()).boxed();
            while let Some(Ok(ev)) = stream.next().await {
                if let watcher::Event::Apply(e) = ev
                    && victims.contains(&e.name_any())
                    && online(&e) == Some(false)
                {
                    let _ = tx.send((e.name_any(), Instant::now()));
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed_at = Instant::now();
    for v in &victims {
        held.remove(v).unwrap().abort();
    }
    let online_n = (n - victims.len()) as f64;
    let mut per_exporter = Vec::new();
    let mut metric_per_exporter = Vec::new();
    let mut top = String::new();
    for w in 0..ctx.grpc_windows {
        let off0 = ctx.plane.audit.offset();
        let m0 = m.metric("ucm_exporter_status_writes_total").await;
        let w0 = Instant::now();
        tokio::time::sleep(ctx.grpc_window).await;
        let minutes = w0.elapsed().as_secs_f64() / 60.0;
        let counts = ctx
            .plane
            .audit
            .count_excluding(off0, ctx.plane.audit.offset(), &victims);
        let mc = counts.get("ucm-manager").cloned().unwrap_or_default();
        let m1 = m.metric("ucm_exporter_status_writes_total").await;
        let v = mc.writes as f64 / online_n / minutes;
        eprintln!(
            "  window {w}: {} writes ({}), {v:.2} per exporter per minute",
            mc.writes,
            mc.top(4)
        );
        per_exporter.push(v);
        metric_per_exporter.push((m1 - m0) / n as f64 / minutes);
        top = mc.top(4);
    }
    // A sample still Online at the deadline counts as the deadline (and is named in the note).
    const DEADLINE: Duration = Duration::from_secs(240);
    let mut latencies: HashMap<String, f64> = HashMap::new();
    let deadline = killed_at + DEADLINE;
    while latencies.len() < victims.len() && Instant::now() < deadline {
        while let Ok((name, at)) = rx.try_recv() {
            latencies
                .entry(name)
                .or_insert((at - killed_at).as_secs_f64());
        }
        if latencies.len() < victims.len() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    watch_task.abort();
    let late: Vec<&String> = victims
        .iter()
        .filter(|v| !latencies.contains_key(*v))
        .collect();
    let censored = late.len();
    for v in &late {
        eprintln!("  {v} still Online {} s after its kill", DEADLINE.as_secs());
        latencies.insert((*v).clone(), DEADLINE.as_secs_f64());
    }

    for (_, h) in held.drain() {
        h.abort();
    }
    m.stop("TERM");
    delete_namespace(&c, NS, Duration::from_secs(300)).await;
    let replicas = crate::grpc_replicas::run(ctx).await;
    let router = crate::grpc_router::run(ctx).await;

    let mut figures = vec![
        Figure::new(PHASE, "grpc.writes_per_exporter_minute", &format!("API writes per online exporter per minute, {n} simulated exporters holding Status streams"), "writes/min", per_exporter)
            .reference(6.0, "upstream Jumpstarter controller: a lastSeen write every 10 s", false)
            .note(format!(
                "manager writes in the apiserver audit log over {} windows of {} s with every stream held; ucm_exporter_status_writes_total (which also counts the killed exporters' last writes, over all exporters): median {:.2}; top: {top}",
                ctx.grpc_windows,
                ctx.grpc_window.as_secs(),
                crate::report::median(&metric_per_exporter)
            )),
        Figure::new(PHASE, "grpc.offline_detection", &format!("offline detection: exporter killed → Online=False ({} exporters killed at once)", victims.len()), "s", latencies.values().copied().collect())
            .reference(70.0, "upstream, expected: lastSeen every 10 s, 1 min threshold, 30 s requeue → 50–90 s after the kill (computed, not run)", false)
            .note(format!(
                "default threshold T = 60 s; ucm marks an exporter Offline at its stored lastSeen + T (+ ≤ 1 s), so between T − W and T after the kill (W = 20 s){}",
                if censored > 0 {
                    format!("; {censored} of {} were still Online {} s after the kill and count as {} s", victims.len(), DEADLINE.as_secs(), DEADLINE.as_secs())
                } else {
                    String::new()
                }
            )),
    ];
    figures.extend(replicas);
    figures.extend(router);
    figures
}

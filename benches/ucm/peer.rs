//! Phase `peer` (README, "Benchmarks"; issue 50): ucm against the controller it replaces, the
//! upstream Jumpstarter Go controller v0.9.0 built from `../shared/reference` by
//! `hack/bench/peer.sh` (cached under `~/.cache/ucm/peer`, keyed by its source), in the same run,
//! with the same load generator, one controller after the other in the order Go, ucm, ucm, Go, each
//! on a fresh control plane, both with leader election on and their shipped defaults. Both run
//! under the same ServiceAccount (`ucm-system/ucm-manager`), so the audit log counts their
//! requests alike, and with the same `CONTROLLER_KEY` seed and `jumpstarter-controller` ConfigMap
//! (in the Go controller's namespace `bench`; in ucm's `ucm-system`). The Go controller gets the
//! upstream CRDs of its release, ucm its own.
//!
//! Scenarios, each interleaved Go, ucm, ucm, Go before the next:
//! 1. start-up with N Exporters present (created while no controller runs): spawn → /readyz,
//!    spawn → leader Lease held (its `acquireTime`), spawn → the first Exporter status written,
//!    spawn → every Exporter's final status; then every credential Secret is checked;
//! 2. per size N (1,000 and 5,000): on an empty cluster spawn → /readyz and → Lease held, RSS at
//!    /readyz + 3 s; then [`leases::load`]: N Exporters (rate, requests and writes per object from
//!    the audit log, API-server and controller CPU per object, RSS per object), N/10 Clients,
//!    N/10 Exporters online, N/50 then N/10 Leases, and the check (every Secret with a token and
//!    its owner as controller, no exporter leased twice, every Lease on an online exporter).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;

use k8s_openapi::api::coordination::v1::Lease as CoordinationLease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client as KubeClient, ResourceExt};
use serde_json::json;
use ucm::exporter::crd::{Client, Exporter, Lease};
use ucm_testkit::free_port;

use crate::Ctx;
use crate::bulk::manager_args;
use crate::cluster::{Plane, SYSTEM_NS};
use crate::kube_util::{CONCURRENCY, create_all, create_namespace, track};
use crate::leases::{self, NS};
use crate::procs::Proc;
use crate::procs::cpu_secs;
use crate::report::{Figure, fmt, median};
use crate::steps::{LABEL, Samples, WAIT, exporter_done, obj, reference_status};

const PHASE: &str = "peer";
/// The same signing-key seed for both: a lab moving from the Go controller keeps its
/// `CONTROLLER_KEY`, so the tokens it issued stay valid.
const SEED: &str = "ucm-bench-peer-controller-key";
/// The endpoint both advertise in Exporter and Client status.
const ENDPOINT: &str = "ucm-grpc.ucm-system.svc:8082";
/// The Go controller's leader-election Lease (its `LeaderElectionID`, in its namespace).
const GO_LEASE: &str = "a38b78e7.jumpstarter.dev";
/// ucm's default `--leader-election-id`, in `--namespace`.
const UCM_LEASE: &str = "ucm-controller-manager";
/// Ports the Go controller binds whatever its flags say (gRPC, dashboard, OIDC, login).
const GO_FIXED_PORTS: [u16; 4] = [8082, 8084, 8085, 8086];
/// The upstream CRDs of the Go controller's release, under its source.
const GO_CRDS: [&str; 4] = [
    "jumpstarter.dev_clients.yaml",
    "jumpstarter.dev_exporteraccesspolicies.yaml",
    "jumpstarter.dev_exporters.yaml",
    "jumpstarter.dev_leases.yaml",
];
/// Interleaved so a drift of the host's speed during the phase hits both alike.
const ORDER: [Kind; 4] = [Kind::Go, Kind::Ucm, Kind::Ucm, Kind::Go];

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Go,
    Ucm,
    /// The bench's own writes, no controller ([`bare`]).
    Bare,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Go => "go",
            Kind::Ucm => "ucm",
            Kind::Bare => "bare",
        }
    }
}

fn key(kind: Kind, what: &str) -> &'static str {
    Box::leak(format!("{}.{what}", kind.name()).into_boxed_str())
}

/// `../shared/reference/jumpstarter-controller-v0.9.0`, or `UCM_BENCH_PEER_SRC`.
fn peer_src() -> PathBuf {
    std::env::var_os("UCM_BENCH_PEER_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../shared/reference/jumpstarter-controller-v0.9.0")
        })
}

/// Builds (or finds in the cache) the Go controller; panics with the script's error.
pub(crate) fn go_bin() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("hack/bench/peer.sh");
    let out = Command::new(&script)
        .env("UCM_BENCH_PEER_SRC", peer_src())
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed ({}): the peer phase needs the Go controller",
        script.display(),
        out.status
    );
    let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(bin.is_file(), "peer.sh printed no binary: {bin:?}");
    bin
}

/// The `jumpstarter-controller` ConfigMap both read at start: internal tokens only, the router
/// the controller hands out (the Go controller refuses to start without one).
fn configmap(ns: &str) -> ConfigMap {
    obj(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "jumpstarter-controller", "namespace": ns},
        "data": {
            "config": "authentication:\n  internal:\n    prefix: \"internal:\"\n  jwt: []\nprovisioning:\n  enabled: false\n",
            "router": "default:\n  endpoint: ucm-router.ucm-system.svc:8083\n",
        }
    }))
}

/// Replaces ucm's Jumpstarter CRDs with the Go controller's own, waits until each is
/// Established and lists each kind once (the API server's first request to a CRD builds its
/// storage, which start-up figures should not include; see cluster.rs).
async fn install_go_crds(c: &KubeClient) {
    let dir = peer_src().join("controller/deploy/operator/config/crd/bases");
    let api: Api<CustomResourceDefinition> = Api::all(c.clone());
    let mut kinds = Vec::new();
    for f in GO_CRDS {
        let path = dir.join(f);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let mut crd: CustomResourceDefinition = serde_saphyr::from_str(&text)
            .unwrap_or_else(|e| panic!("parse {}: {e}", path.display()));
        let name = crd.metadata.name.clone().expect("CRD name");
        match api.get_opt(&name).await.unwrap() {
            Some(old) => {
                crd.metadata.resource_version = old.metadata.resource_version;
                api.replace(&name, &PostParams::default(), &crd).await
            }
            None => api.create(&PostParams::default(), &crd).await,
        }
        .unwrap_or_else(|e| panic!("install {name}: {e}"));
        let start = Instant::now();
        while !api
            .get(&name)
            .await
            .unwrap()
            .status
            .and_then(|s| s.conditions)
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Established" && c.status == "True")
        {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{name} not Established"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let v = crd
            .spec
            .versions
            .iter()
            .find(|v| v.storage)
            .expect("storage version");
        let ar = ApiResource {
            group: crd.spec.group.clone(),
            version: v.name.clone(),
            api_version: format!("{}/{}", crd.spec.group, v.name),
            kind: crd.spec.names.kind.clone(),
            plural: crd.spec.names.plural.clone(),
        };
        kinds.push(ar);
    }
    // The API server swaps a replaced CRD's handler when its watch of CRDs delivers the change.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for ar in kinds {
        Api::<DynamicObject>::all_with(c.clone(), &ar)
            .list(&ListParams::default().limit(1))
            .await
            .unwrap_or_else(|e| panic!("list {}: {e}", ar.plural));
    }
}

/// A fresh control plane ready for `kind`: namespace, ConfigMap, CRDs.
pub(crate) async fn plane(kind: Kind, dir: &Path) -> Plane {
    let p = Plane::start(dir).await;
    let c = p.admin.clone();
    create_namespace(&c, NS).await;
    let cm_ns = match kind {
        Kind::Go => {
            install_go_crds(&c).await;
            NS
        }
        Kind::Ucm | Kind::Bare => SYSTEM_NS,
    };
    Api::<ConfigMap>::namespaced(c.clone(), cm_ns)
        .create(&PostParams::default(), &configmap(cm_ns))
        .await
        .unwrap();
    p
}

/// Spawns the controller with its shipped defaults; returns it and the wall-clock time of the
/// spawn (Lease `acquireTime`s are wall-clock).
pub(crate) fn spawn(kind: Kind, p: &Plane, go: &Path, log: PathBuf) -> (Proc, SystemTime) {
    match kind {
        Kind::Ucm => {
            let wall = SystemTime::now();
            let m = Proc::manager_env(
                &p.manager_kubeconfig,
                log,
                &manager_args(),
                &[("CONTROLLER_KEY", SEED)],
            );
            (m, wall)
        }
        Kind::Bare => unreachable!("the bare client runs no controller"),
        Kind::Go => {
            for port in GO_FIXED_PORTS {
                assert!(
                    std::net::TcpListener::bind(("0.0.0.0", port)).is_ok(),
                    "port {port} is in use: the Go controller binds it whatever its flags say"
                );
            }
            let (health, metrics) = (free_port(), free_port());
            let mut cmd = Command::new(go);
            // As its operator deploys it (deploy/operator: --leader-elect, probes on 8081,
            // metrics on 8080), on free local ports.
            cmd.arg("--leader-elect")
                .arg(format!("--health-probe-bind-address=127.0.0.1:{health}"))
                .arg(format!("-metrics-bind-address=127.0.0.1:{metrics}"))
                .env("KUBECONFIG", &p.manager_kubeconfig)
                .env("NAMESPACE", NS)
                .env("CONTROLLER_KEY", SEED)
                .env("GRPC_ENDPOINT", ENDPOINT)
                .env_remove("POD_NAMESPACE")
                .env_remove("POD_NAME");
            let wall = SystemTime::now();
            let mut m = Proc::spawn(cmd, log);
            m.health_port = health;
            m.metrics_port = metrics;
            (m, wall)
        }
    }
}

/// Seconds from the spawn to the `acquireTime` of the controller's leader-election Lease.
async fn lease_held(kind: Kind, c: &KubeClient, spawned: SystemTime) -> f64 {
    let (ns, name) = match kind {
        Kind::Go => (NS, GO_LEASE),
        Kind::Ucm => (SYSTEM_NS, UCM_LEASE),
        Kind::Bare => unreachable!("the bare client runs no controller"),
    };
    let api: Api<CoordinationLease> = Api::namespaced(c.clone(), ns);
    let start = Instant::now();
    loop {
        let spec = api.get_opt(name).await.ok().flatten().and_then(|l| l.spec);
        if let Some(at) = spec
            .filter(|s| s.holder_identity.as_deref().is_some_and(|h| !h.is_empty()))
            .and_then(|s| s.acquire_time)
        {
            let at = SystemTime::UNIX_EPOCH + Duration::from_nanos(at.0.as_nanosecond() as u64);
            return at
                .duration_since(spawned)
                .unwrap_or_else(|_| panic!("Lease {ns}/{name} acquired before the spawn"))
                .as_secs_f64();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no holder of Lease {ns}/{name} after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn has_credential(e: &Exporter) -> bool {
    e.status.as_ref().is_some_and(|s| s.credential.is_some())
}

/// Scenario 1: start-up with `n` Exporters present.
async fn start_up(kind: Kind, dir: &Path, go: &Path, n: usize, run: &str, s: &mut Samples) {
    let p = plane(kind, &dir.join("cp")).await;
    let c = p.admin.clone();
    let api: Api<Exporter> = Api::namespaced(c.clone(), NS);
    create_all(&api, (0..n).map(|i| leases::exporter(i, run)).collect()).await;
    let cfg = || watcher::Config::default().labels(&format!("{LABEL}={run}"));
    let first = track(api.clone(), cfg(), 1, has_credential);
    let all = track(api.clone(), cfg(), n, exporter_done);
    // The trackers' initial lists first, so they see the first write when it comes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (mut m, wall) = spawn(kind, &p, go, dir.join("controller-start.log"));
    let ready = m.wait_ready(Duration::from_secs(120)).await;
    s.push(key(kind, "start.ready"), ready.as_secs_f64());
    s.push(key(kind, "start.lease"), lease_held(kind, &c, wall).await);
    let t = first.wait("first Exporter status", WAIT).await;
    s.push(key(kind, "start.first"), (t - m.spawned).as_secs_f64());
    let t = all.wait("every Exporter's final status", WAIT).await;
    s.push(key(kind, "start.all"), (t - m.spawned).as_secs_f64());
    leases::check(&c, 0).await;
    m.stop("TERM");
}

/// Scenario 2: an empty cluster, then [`leases::load`] at size `n`.
#[allow(clippy::too_many_arguments)]
async fn load(
    kind: Kind,
    dir: &Path,
    go: &Path,
    n: usize,
    run: &str,
    s: &mut Samples,
    bd: &mut BTreeMap<String, String>,
) {
    let p = plane(kind, &dir.join("cp")).await;
    let c = p.admin.clone();
    let (mut m, wall) = spawn(kind, &p, go, dir.join("controller.log"));
    let ready = m.wait_ready(Duration::from_secs(120)).await;
    s.push(key(kind, "empty.ready"), ready.as_secs_f64());
    s.push(key(kind, "empty.lease"), lease_held(kind, &c, wall).await);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss0 = m.rss() as f64;
    let k = |w: &str| key(kind, &format!("n{n}.{w}"));
    s.push(k("rss_idle"), rss0 / f64::from(1 << 20));
    let (first, m_clients) = ((n / 50).max(1), n.div_ceil(10));
    // ucm's check fails the phase; the Go controller's problems are counted and shown.
    let l = leases::load(&p, &m, n, first, run, kind == Kind::Ucm).await;
    s.push(k("problems"), l.problems.len() as f64);
    if !l.problems.is_empty() {
        let twice = l.problems.iter().filter(|p| p.contains(" holds [")).count();
        s.push(k("leased_twice"), twice as f64);
        bd.insert(
            format!("{}.n{n}.problems", kind.name()),
            format!(
                "{} problems ({twice} exporters holding two active Leases), e.g. {}",
                l.problems.len(),
                l.problems[..l.problems.len().min(3)].join("; ")
            ),
        );
    }
    let st = &l.exporters;
    let per = |x: f64| x / n as f64;
    s.push(k("rate"), n as f64 / st.secs);
    s.push(k("requests"), per(st.requests() as f64));
    s.push(k("writes"), per(st.writes() as f64));
    s.push(k("api_cpu"), per(st.apiserver_cpu * 1000.0));
    s.push(k("ctl_cpu"), per(st.manager_cpu * 1000.0));
    s.push(k("rss_per"), per((l.rss_after - rss0) / 1024.0));
    s.push(k("clients"), l.clients.secs);
    s.push(k("online"), l.online.secs);
    s.push(k("leases_first"), l.first.secs);
    s.push(k("leases_all"), l.all.secs);
    s.push(
        k("flatness"),
        (l.all.secs / m_clients as f64) / (l.first.secs / first as f64),
    );
    let assignments = (first + m_clients) as f64;
    s.push(
        k("lease_requests"),
        (l.first.requests() + l.all.requests()) as f64 / assignments,
    );
    s.push(
        k("lease_api_cpu"),
        l.all.apiserver_cpu * 1000.0 / m_clients as f64,
    );
    for (what, step) in [
        ("exporters", &l.exporters),
        ("clients", &l.clients),
        ("online", &l.online),
        ("leases", &l.all),
    ] {
        let v = step.manager.top(6);
        eprintln!("  {} n{n} {what}: {v}", kind.name());
        bd.insert(format!("{}.n{n}.{what}", kind.name()), v);
    }
    m.stop("TERM");
}

/// The bare client (issue 50: where the API server is the bound, show it in the same run): on a
/// fresh control plane with ucm's CRDs and no controller, the bench itself makes the writes a
/// controller must make for the Clients and Leases of [`leases::load`], in their causal order,
/// `CONCURRENCY` objects at a time, with the same background load for the Leases (the online
/// Exporters kept online by the same patches every 20 s). Only the online tenth of the
/// Exporters exists here (the Leases' targets), without credential Secrets. A Client: created, its credential Secret created,
/// its status patched (the controllers add a `CredentialCreated` event, off the clock). A Lease:
/// created, its status patched (exporterRef, Ready), its Exporter's `leaseRef` patched, its
/// owner reference set; the first step's Leases are then ended and their Exporters freed. Timed
/// by the same watches as the controllers' steps.
async fn bare(dir: &Path, n: usize, run: &str, s: &mut Samples) {
    let p = plane(Kind::Ucm, &dir.join("cp")).await;
    let c = p.admin.clone();
    let (first, m) = ((n / 50).max(1), n.div_ceil(10));
    let k = |w: &str| key(Kind::Bare, &format!("n{n}.{w}"));
    let exporters: Api<Exporter> = Api::namespaced(c.clone(), NS);
    let online: Vec<usize> = (0..n).filter(|i| leases::is_online(*i)).collect();
    let made = create_all_made(
        &exporters,
        online.iter().map(|i| leases::exporter(*i, run)).collect(),
    )
    .await;
    let devices: Arc<Vec<(String, String)>> = Arc::new(
        online
            .iter()
            .map(|i| (leases::exporter_name(*i), uuid::Uuid::new_v4().to_string()))
            .collect(),
    );
    leases::fail(
        "online status patch",
        &leases::patch_all(&exporters, leases::online_patches(&devices), true).await,
    );
    let pp = PatchParams::default();

    // Clients: create, credential Secret, status.
    let clients: Api<Client> = Api::namespaced(c.clone(), NS);
    let secrets: Api<Secret> = Api::namespaced(c.clone(), NS);
    let tracker = track(
        clients.clone(),
        watcher::Config::default().labels(&format!("{LABEL}={run}")),
        m,
        leases::client_done,
    );
    let t0 = Instant::now();
    futures::stream::iter(0..m)
        .for_each_concurrent(CONCURRENCY, |i| {
            let (clients, secrets, pp) = (clients.clone(), secrets.clone(), pp.clone());
            async move {
                let made = clients
                    .create(&PostParams::default(), &leases::client(i, run))
                    .await
                    .unwrap_or_else(|e| panic!("bare client: create Client {i}: {e}"));
                let name = made.name_any();
                let secret: Secret = obj(json!({
                    "apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": format!("{name}-client"), "namespace": NS,
                                 "ownerReferences": [owner("Client", &name, &made.uid().unwrap_or_default())]},
                    "type": "Opaque",
                    // About the size of a minted token.
                    "stringData": {"token": "t".repeat(480)},
                }));
                secrets
                    .create(&PostParams::default(), &secret)
                    .await
                    .unwrap_or_else(|e| panic!("bare client: create Secret of {name}: {e}"));
                clients
                    .patch_status(&name, &pp, &Patch::Merge(reference_status("client", &name)))
                    .await
                    .unwrap_or_else(|e| panic!("bare client: Client {name} status: {e}"));
            }
        })
        .await;
    let t1 = tracker.wait("bare client: Clients", WAIT).await;
    s.push(k("clients"), (t1 - t0).as_secs_f64());
    // Kept online from here on, as in the controllers' load.
    let refresher = leases::keep_online(exporters.clone(), devices.clone());

    // Leases: `first`, ended, then `m`, each on the online Exporter of its index.
    let leases_api: Api<Lease> = Api::namespaced(c.clone(), NS);
    let uids: Arc<BTreeMap<String, String>> = Arc::new(made);
    let api_pid = p.apiserver_pid;
    let step = |prefix: &'static str, count: usize| {
        let (leases_api, exporters, devices, uids, pp) = (
            leases_api.clone(),
            exporters.clone(),
            devices.clone(),
            uids.clone(),
            pp.clone(),
        );
        let step = format!("{run}-{prefix}");
        async move {
            let tracker = track(
                leases_api.clone(),
                watcher::Config::default().labels(&format!("{LABEL}={step}")),
                count,
                leases::lease_done,
            );
            let cpu0 = cpu_secs(api_pid);
            let t0 = Instant::now();
            futures::stream::iter(0..count)
                .for_each_concurrent(CONCURRENCY, |i| {
                    let (leases_api, exporters, pp) =
                        (leases_api.clone(), exporters.clone(), pp.clone());
                    let exporter = devices[i % devices.len()].0.clone();
                    let uid = uids.get(&exporter).cloned().unwrap_or_default();
                    let lease = leases::lease(prefix, i, &step);
                    async move {
                        let name = lease.name_any();
                        leases_api
                            .create(&PostParams::default(), &lease)
                            .await
                            .unwrap_or_else(|e| panic!("bare client: create Lease {name}: {e}"));
                        let status = crate::steps::lease_assigned_status(&exporter);
                        leases_api
                            .patch_status(&name, &pp, &Patch::Merge(status))
                            .await
                            .unwrap_or_else(|e| panic!("bare client: Lease {name} status: {e}"));
                        exporters
                            .patch_status(
                                &exporter,
                                &pp,
                                &Patch::Merge(json!({"status": {"leaseRef": {"name": name}}})),
                            )
                            .await
                            .unwrap_or_else(|e| panic!("bare client: leaseRef of {exporter}: {e}"));
                        leases_api
                            .patch(
                                &name,
                                &pp,
                                &Patch::Merge(json!({"metadata": {"ownerReferences": [owner("Exporter", &exporter, &uid)]}})),
                            )
                            .await
                            .unwrap_or_else(|e| panic!("bare client: owner of {name}: {e}"));
                    }
                })
                .await;
            let t1 = tracker.wait("bare client: Leases", WAIT).await;
            ((t1 - t0).as_secs_f64(), cpu_secs(api_pid) - cpu0)
        }
    };
    let (t_first, _) = step("a", first).await;
    let ended: Vec<(String, serde_json::Value)> = (0..first)
        .map(|i| {
            (
                format!("lease-a-{i:04}"),
                json!({"status": {"ended": true}}),
            )
        })
        .collect();
    leases::fail(
        "bare client: end the first Leases",
        &leases::patch_all(&leases_api, ended, true).await,
    );
    let freed: Vec<(String, serde_json::Value)> = (0..first)
        .map(|i| {
            (
                devices[i % devices.len()].0.clone(),
                json!({"status": {"leaseRef": null}}),
            )
        })
        .collect();
    leases::fail(
        "bare client: free the Exporters",
        &leases::patch_all(&exporters, freed, true).await,
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (t_all, cpu_all) = step("b", m).await;
    refresher.abort();
    s.push(k("leases_first"), t_first);
    s.push(k("leases_all"), t_all);
    s.push(k("flatness"), (t_all / m as f64) / (t_first / first as f64));
    s.push(k("lease_api_cpu"), cpu_all * 1000.0 / m as f64);
}

/// A controller owner reference.
pub(crate) fn owner(kind: &str, name: &str, uid: &str) -> serde_json::Value {
    json!({"apiVersion": "jumpstarter.dev/v1alpha1", "kind": kind, "name": name, "uid": uid,
           "controller": true, "blockOwnerDeletion": true})
}

/// [`create_all`], returning each object's uid by name.
async fn create_all_made(api: &Api<Exporter>, objs: Vec<Exporter>) -> BTreeMap<String, String> {
    futures::stream::iter(objs)
        .map(|o| {
            let api = api.clone();
            async move {
                let made = api
                    .create(&PostParams::default(), &o)
                    .await
                    .unwrap_or_else(|e| panic!("bare client: create Exporter: {e}"));
                (made.name_any(), made.uid().unwrap_or_default())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let go = go_bin();
    eprintln!("peer: Go controller {}", go.display());
    let f = ctx.scale_factor;
    let scaled = |x: usize| ((x as f64 * f).round() as usize).max(10);
    let sizes: Vec<usize> = std::env::var("UCM_BENCH_PEER_SIZES")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1000, 5000])
        .into_iter()
        .map(scaled)
        .collect();
    let start_n = scaled(crate::env_num("UCM_BENCH_PEER_START_N", 1000));
    let mut s = Samples::default();
    let mut bd = BTreeMap::new();
    let dir = |what: &str, i: usize, kind: Kind| {
        let d = ctx.work.join(format!("peer-{what}-{i}-{}", kind.name()));
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let done = |d: PathBuf| {
        if std::env::var("UCM_BENCH_KEEP").as_deref() != Ok("1") {
            let _ = std::fs::remove_dir_all(d);
        }
    };
    for (i, kind) in ORDER.iter().enumerate() {
        eprintln!("peer start-up {}/{}: {}", i + 1, ORDER.len(), kind.name());
        let d = dir("start", i, *kind);
        start_up(*kind, &d, &go, start_n, &format!("s{i}"), &mut s).await;
        done(d);
    }
    for &n in &sizes {
        for (i, kind) in ORDER.iter().enumerate() {
            eprintln!("peer N={n} {}/{}: {}", i + 1, ORDER.len(), kind.name());
            let d = dir(&format!("n{n}"), i, *kind);
            load(*kind, &d, &go, n, &format!("r{i}"), &mut s, &mut bd).await;
            done(d);
            // The bare client once per size, between the two ucm runs.
            if i == 1 {
                eprintln!("peer N={n}: the bare client");
                let d = dir(&format!("n{n}"), 0, Kind::Bare);
                bare(&d, n, "bare", &mut s).await;
                done(d);
            }
        }
    }
    figures(&s, &bd, start_n, &sizes)
}

fn figures(
    s: &Samples,
    bd: &BTreeMap<String, String>,
    start_n: usize,
    sizes: &[usize],
) -> Vec<Figure> {
    let bd = |k: &str| bd.get(k).cloned().unwrap_or_default();
    // A ucm figure against the Go controller's median in the same run.
    let fig = |id: &str, title: String, unit: &str, k: &str| {
        let go = s.get(&format!("go.{k}"));
        let runs: Vec<String> = go.iter().map(|v| fmt(*v)).collect();
        Figure::new(
            PHASE,
            &format!("peer.{id}"),
            &title,
            unit,
            s.get(&format!("ucm.{k}")),
        )
        .reference(
            median(&go),
            &format!("Go controller v0.9.0 (its runs: {})", runs.join(", ")),
            true,
        )
    };
    let mut f = vec![
        fig(
            "start.ready",
            format!("start-up with {start_n} Exporters present: spawn → /readyz"),
            "s",
            "start.ready",
        )
        .note("ucm's /readyz answers once its caches are synced and its settings read; the Go controller's readiness is a ping (healthz.Ping), answered before its caches are synced: compare ucm's figure with the Go controller's spawn → first status write, the next row"),
        fig(
            "start.first_status",
            format!("start-up with {start_n} Exporters present (no status yet): spawn → the first Exporter status written"),
            "s",
            "start.first",
        )
        .note("a watch started before the spawn sees the first Exporter with status.credential set: the controller's first reconcile that wrote, after its caches synced and its leader election"),
        fig(
            "start.lease",
            format!("start-up with {start_n} Exporters present: spawn → leader-election Lease held"),
            "s",
            "start.lease",
        )
        .note("the Lease's acquireTime (written by the controller, same host clock) − the spawn; a fresh control plane, so no earlier holder to wait for. Go: Lease a38b78e7.jumpstarter.dev in its namespace; ucm: ucm-system/ucm-controller-manager"),
        fig(
            "start.all",
            format!("start-up with {start_n} Exporters present: spawn → every Exporter's final status"),
            "s",
            "start.all",
        )
        .note("credential and an Online condition on each, seen by the watch; then every credential Secret checked (token, owner as controller)"),
        fig(
            "empty.ready",
            "start-up, empty cluster: spawn → /readyz".into(),
            "s",
            "empty.ready",
        )
        .note("one sample per size's run; the Go controller's readiness is a ping"),
        fig(
            "empty.lease",
            "start-up, empty cluster: spawn → leader-election Lease held".into(),
            "s",
            "empty.lease",
        ),
    ];
    for &n in sizes {
        let k = |w: &str| format!("n{n}.{w}");
        let (first, m) = ((n / 50).max(1), n.div_ceil(10));
        let top = |w: &str| {
            format!(
                "top, ucm: {}; Go: {}",
                bd(&format!("ucm.n{n}.{w}")),
                bd(&format!("go.n{n}.{w}"))
            )
        };
        // The correctness check's problems per controller run.
        let checked = || {
            let runs = |kind: &str| {
                let v = s.get(&format!("{kind}.n{n}.problems"));
                let bad = v.iter().filter(|x| **x > 0.0).count();
                let twice: f64 = s.get(&format!("{kind}.n{n}.leased_twice")).iter().sum();
                match bad {
                    0 => format!("{kind}: passed in all {} runs", v.len()),
                    _ => format!(
                        "{kind}: failed in {bad} of {} runs ({twice} exporters holding two active Leases in all; {})",
                        v.len(),
                        bd(&format!("{kind}.n{n}.problems"))
                    ),
                }
            };
            format!("Check: {}; {}. ", runs("ucm"), runs("go"))
        };
        // The bare client's figure of the same step, same run ([`bare`]), and ucm's against it.
        let bare = |w: &str, what: &str| {
            let b = s.get(&format!("bare.n{n}.{w}"));
            let u = median(&s.get(&format!("ucm.n{n}.{w}")));
            match b.first() {
                Some(b) => format!(
                    "; the bare client (no controller: {what}, 8 at a time, the same keep-online load), same run: {} (ucm {:.2}× that)",
                    fmt(*b),
                    u / b
                ),
                None => String::new(),
            }
        };
        f.extend([
            fig(
                &k("objects_per_s"),
                format!("{n} Exporters: create → every final status (credential and an Online condition)"),
                "objects/s",
                &k("rate"),
            )
            .higher_is_better()
            .note("bench creates 8 at a time on an empty cluster; issue 50 goal ≥ 2× Go"),
            fig(
                &k("requests_per_object"),
                format!("{n} Exporters: controller API requests per Exporter"),
                "requests",
                &k("requests"),
            )
            .note(format!(
                "non-watch requests by the controller's ServiceAccount in the API server's audit log, from the first create until it was quiet for 2 s (at most 30 s), its leader-election Lease apart; {}",
                top("exporters")
            )),
            fig(
                &k("writes_per_object"),
                format!("{n} Exporters: controller API writes per Exporter"),
                "writes",
                &k("writes"),
            ),
            fig(
                &k("apiserver_cpu"),
                format!("{n} Exporters: etcd + kube-apiserver CPU per Exporter"),
                "ms",
                &k("api_cpu"),
            )
            .note("issue 50 goal ≤ 0.5× Go"),
            fig(
                &k("controller_cpu"),
                format!("{n} Exporters: controller CPU per Exporter"),
                "ms",
                &k("ctl_cpu"),
            ),
            fig(
                &k("rss_per_object"),
                format!("{n} Exporters: controller RSS per Exporter (with its Secret)"),
                "KiB",
                &k("rss_per"),
            )
            .note("(RSS 5 s after the Exporters' step − RSS at /readyz + 3 s) / N; issue 50 goal ≤ 0.5× Go"),
            fig(
                &k("rss_idle"),
                "controller RSS at /readyz + 3 s, empty cluster".to_string(),
                "MiB",
                &k("rss_idle"),
            ),
            fig(
                &k("clients"),
                format!("{m} Clients among {n} Exporters: create → credential"),
                "s",
                &k("clients"),
            )
            .note(format!(
                "issue 50 goal ≤ 0.5× Go; {}{}",
                top("clients"),
                bare("clients", "create, the credential Secret, the status patch: the writes on the path to a credential; in s")
            )),
            fig(
                &k("online"),
                format!("{m} of {n} Exporters made online (status patch) → Online and Registered"),
                "s",
                &k("online"),
            )
            .note(format!("one merge patch of each Exporter's status (lastSeen, exporterStatus Available, one device), 8 at a time; the conditions are the controller's to derive. Issue 50 goal ≤ 0.5× Go; {}", top("online"))),
            fig(
                &k("leases_first"),
                format!("{first} Leases among {n} Exporters: create → all assigned and Ready"),
                "s",
                &k("leases_first"),
            )
            .note(format!(
                "one Lease per Client, an hour, selecting any online Exporter; released and ended before the next step. Issue 50 goal ≤ 0.5× Go{}",
                bare("leases_first", "create, status with exporterRef and Ready, the Exporter's leaseRef, the owner reference; in s")
            )),
            fig(
                &k("leases_all"),
                format!("{m} Leases among {n} Exporters: create → all assigned and Ready"),
                "s",
                &k("leases_all"),
            )
            .note(format!("the online Exporters patched every 20 s meanwhile (spread over the period). Checked after each run, for both controllers: no exporter holds two active Leases, every Lease is on an online Exporter, every Exporter's and Client's credential Secret has a token and its owner as controller (ucm failing it fails the phase; the Go controller's problems are counted here). {}Issue 50 goal ≤ 0.5× Go; {}{}", checked(), top("leases"), bare("leases_all", "the same four writes per Lease; in s"))),
            fig(
                &k("per_lease_growth"),
                format!("time per Lease at {m} Leases / at {first}"),
                "ratio",
                &k("flatness"),
            )
            .note(format!(
                "issue 50 goal ≤ 1.2 for ucm{}",
                bare("flatness", "the same ratio of its own two Lease steps")
            )),
            fig(
                &k("lease_requests"),
                format!("controller API requests per Lease assignment ({first} + {m} Leases)"),
                "requests",
                &k("lease_requests"),
            )
            .note("counted until the controller was quiet for 2 s, at most 30 s: the Go controller answers every keep-online patch with a reconcile, so it is never quiet and its count runs the full 30 s after each Lease step"),
            fig(
                &k("lease_apiserver_cpu"),
                format!("{m} Leases: etcd + kube-apiserver CPU per Lease"),
                "ms",
                &k("lease_api_cpu"),
            )
            ,
        ]);
    }
    f
}

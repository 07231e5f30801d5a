//! `make bench` (docs/benchmarks.md): the ucm benchmark driver. Cargo builds it with the `bench`
//! profile (release settings), so `CARGO_BIN_EXE_ucm` is the optimised binary every phase runs.
//!
//! It starts its own control plane (with an API server audit log), runs the phases named by
//! `UCM_BENCH_ONLY` (comma-separated; default: all), and merges the figures into
//! `bench/results.json` and `bench/results.md`. It measures and asserts nothing about speed.
//!
//! Environment: `UCM_BENCH_RUNS` (runs per figure, default 3), `UCM_BENCH_SCALE` (object
//! counts × this factor, default 1; anything else is marked in the results),
//! `UCM_BENCH_OUT` (default `bench/`), `UCM_BENCH_EXPORT_MIB` (default 2048).

// The fixtures shared with the e2e suite (control plane, CRDs, processes) are the ucm-testkit
// crate's.

mod barrier;
mod bulk;
mod child;
mod churn;
mod cluster;
mod export;
mod failover;
mod grpc;
mod grpc_replicas;
mod grpc_router;
mod kube_util;
mod leases;
mod objects;
mod peer;
mod procs;
mod queue;
mod report;
mod scale;
mod steps;

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub struct Ctx {
    /// The control plane of every phase but `bulk`, `leases` and `queue`, whose runs start their
    /// own.
    pub plane: cluster::Plane,
    pub work: PathBuf,
    pub runs: usize,
    pub scale: bulk::Scale,
    /// `UCM_BENCH_SCALE`: object counts × this factor.
    pub scale_factor: f64,
    pub idle_window: Duration,
    pub grpc_window: Duration,
    pub grpc_windows: usize,
    pub barrier_rounds: usize,
    pub failover_runs: usize,
    pub export_bytes: u64,
}

impl Ctx {
    /// A phase's namespace on the shared control plane, and a ready manager (the bulk settings)
    /// logging to the phase's work directory.
    pub async fn phase_manager(&self, phase: &str, ns: &str) -> (kube::Client, procs::Proc) {
        let c = self.plane.admin.clone();
        kube_util::create_namespace(&c, ns).await;
        let dir = self.work.join(phase);
        std::fs::create_dir_all(&dir).unwrap();
        let mut m = procs::Proc::manager(
            &self.plane.manager_kubeconfig,
            dir.join("manager.log"),
            &bulk::manager_args(),
        );
        m.wait_ready(Duration::from_secs(120)).await;
        (c, m)
    }
}

const PHASES: &[&str] = &[
    "export", "barrier", "objects", "bulk", "scale", "leases", "peer", "churn", "queue", "grpc",
    "failover",
];

fn env_num<T: std::str::FromStr>(k: &str, default: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const METHODS: &str = "\
- **Where**: one local control plane (etcd, kube-apiserver and kube-controller-manager v1.37.2 from `e2e/bin/kharness`, no kubelet) and every ucm process on the same machine as the bench driver; nothing is mocked on the API path.
- **Binary**: `target/release/ucm` built by `cargo bench` with the `bench` profile (release settings).
- **API requests** are counted by the kube-apiserver's own audit log (`--audit-policy-file`, level Metadata for the group `system:serviceaccounts:ucm-system`, one count per request: at ResponseComplete, or ResponseStarted for watches). The manager runs with the ServiceAccount token `ucm-system/ucm-manager`, the snapshot agents with `ucm-system/ucm-agent`, both bound to cluster-admin; the bench's own client (creates, the simulated kubelet, references) is the admin user and is not counted. kube-rs sends no User-Agent, and `apiserver_request_total` has no client label, so the identity is what separates ucm's requests from the bench's. \"Requests\" are gets, lists and writes; watches are not included.
- **Bulk**: objects are created by the bench with 8 concurrent requests; the timer runs from the first create until a watch has seen every object's final status. The reference is the same bench client creating the same objects and then patching a final status onto each (8 at a time), timed the same way, in the same run, on the same control plane. The manager runs with the shipped defaults, as `config/default` deploys it: every feature, all namespaces, `--leader-elect` with the default Lease settings (15 s / 10 s / 2 s) and the default `--max-concurrent-reconciles` (8, chosen with the `leases` phase; controller-runtime's is 1). The bare client sends up to 8 requests at a time. The API server's CPU per object (from `/proc` of the etcd + kube-apiserver process) does not depend on concurrency or on how busy the machine is.
- **RSS** is VmRSS from `/proc/<pid>/status`: at zero after /readyz plus 3 s on an empty cluster, and 5 s after the last bulk step. Bytes per object divides the growth by the number of primary objects (Exporters, VirtualMachineExports, MiroirSnapshots); their Secrets, Pods, Services, PVCs and volumes are cached too.
- **Exporter feature at issue 17's load** (phase `leases`): each run on a fresh control plane with the manager at the shipped defaults (every feature, `--leader-elect`, the default worker count). Idle RSS at /readyz + 20 s (CRDs installed, no objects). 5,000 Exporters in one namespace created 8 at a time, timed until a watch has seen every credential and an `Online` condition; RSS 5 s later. 500 Clients, until every `status.credential`. Every tenth Exporter made online by one status merge patch (`lastSeen`, `exporterStatus: Available`, one device; the manager derives `Registered` and `Online`), timed until a watch has seen both True on each, then each patched again every 20 s, the patches spread evenly over the period (one every 40 ms) as independent exporters' would be (through 7f06ce8 all 500 at once every 20 s, so a timed step's result depended on whether it overlapped that burst). 50 Leases (one per Client, one hour, `matchLabels` on a label only the online Exporters carry), until each has `status.exporterRef` and `Ready=True`; released and ended; then 500 Leases, one per Client, timed the same way. Conflicts are responses with code 409 in the audit log. After each run the phase fails unless no exporter holds two active Leases, every Lease is on an online Exporter, and every credential Secret has a token and its owner as controller. References: a bare client creating and status-patching the same objects on a control plane of its own in the same run (during the manager's idle 20 s) where it measures the figure, else issue 17's goal; the Go controller v0.9.0 at the same load in the same run is the `peer` phase.
- **Against the Go controller** (phase `peer`, issue 50): the upstream Jumpstarter controller v0.9.0 (`controller/` at a0844121), built by `hack/bench/peer.sh` from `../shared/reference/jumpstarter-controller-v0.9.0` into `~/.cache/ucm/peer/<hash of its source and the Go version>/`, and ucm, one after the other in the order Go, ucm, ucm, Go for each scenario, each on a fresh control plane, with the same load generator (the `leases` phase's, steps.rs and leases.rs). Both with leader election on and their shipped defaults: the Go controller as its operator deploys it (`--leader-elect`, probes and metrics on, `NAMESPACE=bench`: it watches one namespace since 0.8.0), with its release's CRDs; ucm as `config/default` deploys it, with its own CRDs, watching all namespaces. Both run under the ServiceAccount `ucm-system/ucm-manager` (so the audit log counts their requests alike), with the same `CONTROLLER_KEY` seed and the same `jumpstarter-controller` ConfigMap (internal tokens, a router entry; the Go controller does not start without one). The Go controller binds ports 8082, 8084, 8085 and 8086 whatever its flags say; the phase fails if one is taken. Start-up: N Exporters (default 1,000, `UCM_BENCH_PEER_START_N`) created while no controller runs, then spawn → /readyz (polled every 10 ms), spawn → the leader-election Lease's `acquireTime` (wall clock, same host), spawn → a watch sees the first Exporter with `status.credential`, spawn → every Exporter final; the credential Secrets are checked after. Load, per size (1,000 and 5,000, `UCM_BENCH_PEER_SIZES`): an empty cluster, spawn → /readyz and → Lease held, RSS at /readyz + 3 s, then N Exporters created 8 at a time until every credential and Online condition; N/10 Clients; every tenth Exporter made online by a status patch and kept online every 20 s; N/50 Leases, released; N/10 Leases; then the `leases` phase's check (no exporter leased twice, every Lease on an online Exporter, every credential Secret with a token and its owner as controller), which fails the phase for either controller. Once per size, between the two ucm runs, the bare client on a fresh control plane with ucm's CRDs and no controller: only the online tenth of the Exporters (the Leases' targets, without Secrets), then the bench itself makes, 8 objects at a time and in their causal order, the writes a controller must make: per Client its create, its credential Secret and its status (the controllers also write an event, off the clock); per Lease its create, its status (exporterRef, Ready), its Exporter's `leaseRef` and its owner reference, with the same keep-online patches running; timed by the same watches; its figures are in the notes of the Clients and Lease rows, with ucm's ratio to them. Each ucm figure's reference is the Go controller's median in the same run, its runs listed.
- **Lease churn at scale** (phase `churn`, issue 50 item 3): the `peer` phase's machinery (a fresh control plane per run, the Go controller v0.9.0 or ucm spawned with its shipped defaults and leader election on, the same ServiceAccount, ConfigMap and `CONTROLLER_KEY` seed). The load of every run: N Exporters (10,000, `UCM_BENCH_CHURN_N`) created 8 at a time (with a controller: until every credential and Online condition), 10 Clients, every tenth Exporter made online by one status patch and then patched again every 10 s, upstream exporters' `lastSeen` cadence (docs/exporter.md, \"Heartbeats\"), the patches spread evenly over the period (100 per second). First the bare client, on its own control plane with ucm's CRDs and no controller (Exporters without Secrets): Lease churn offered open loop (each Lease created on schedule whatever the earlier ones' state) at 10, 20, 40, 80, 160, 320 Leases/s (`UCM_BENCH_CHURN_RATES`; a rate is not offered when its Leases, held 2 s plus half a second, would need more than 85 % of the online Exporters), 20 s a step (`UCM_BENCH_CHURN_BARE_S`), until a step is not sustained: achieved (Leases seen assigned / max(step, last assignment − step start)) below 95 % of offered, or p99 create → assigned and Ready above 1 s. Per Lease the bench takes an exporter from its own free list and writes, 8 Leases at a time, what a controller must (as the `peer` phase's bare client: status with exporterRef and Ready, the Exporter's `leaseRef`, the owner reference), holds it 2 s (`UCM_BENCH_CHURN_HOLD_S`) after the watch saw it assigned, and ends it itself (status `ended`, `leaseRef` cleared). R is the highest step sustained. Then per controller, in the order Go, ucm, ucm, Go: the load, then Lease churn at R/4, R/2 and R, 30 s each (`UCM_BENCH_CHURN_STEP_S`): Leases of an hour selecting any online Exporter, each created on schedule, released (`spec.release`) 2 s after a watch saw it assigned; per Lease create → the watch sees `status.exporterRef` and Ready=True, p50 and p99 per step (Leases never assigned count with their time until the churn stopped). A controller falls behind when its unassigned backlog exceeds R × 5 s or a step's p99 exceeds 10 s; its churn stops there and the rate is reported. Meanwhile 100 offline Exporters (`UCM_BENCH_CHURN_REPORTS`) report online, one status patch each, spread over the planned churn; patch → a watch sees Online=True, p99. Controller CPU (utime + stime from /proc) over the churn per Lease created, etcd + kube-apiserver CPU likewise, RSS at the churn's end. Afterwards the last Leases get 30 s to be assigned, every waiting one is released, and every Lease must end within 120 s; then the `peer` phase's check (every credential Secret with a token and its owner as controller, no active Lease left) and: no Lease seen assigned to an Exporter whose earlier Lease the same watch (one stream, so in the API server's order) had not yet seen ended. ucm failing fails the phase; the Go controller's problems are counted. Each ucm figure's reference is the Go controller's median in the same run.
- **Lease scheduler** (phase `queue`, docs/exporter.md \"Lease scheduling\"): each run on a fresh control plane with the manager at the shipped defaults. 5,000 Exporters in one namespace, every tenth made online and kept online as in `leases`; 50 of the online ones (every hundredth Exporter) also carry `ucm-bench-board: scarce`. One ExporterAccessPolicy on that label gives priority 30, 20 or 10 by the Client label `tier` (high, mid, low), with three Clients per tier (nothing limits a Client's active Leases, here or upstream; few Clients keep the distinct requests, and so the candidate computations per pass, at 9). A watch on the Leases is listed first; then 2,000 Leases of an hour selecting the scarce label, the tiers in turn, are created 8 at a time, and the watch merge-patches `spec.release: true` onto each Lease as soon as it shows `status.exporterRef`, until every Lease was assigned (at most 60 min). The clock runs from the first create to the last assignment seen. Lease passes and their time are the deltas of `controller_runtime_reconcile_time_seconds{controller=\"lease\"}` (count, sum, buckets) from the manager's /metrics, read before the first create and after the manager was quiet for 2 s after the last release; manager CPU from `/proc`; reads (gets and lists besides its leader-election Lease) and Lease status writes from the audit log over the same span. Writes of waiting Leases are the watch's modifications of Leases with no exporter (only the manager writes those), and a visible change is one that changed `status.queue.position` or the `Pending` message. Checked after each run, failing the phase: every Lease assigned once, to a scarce Exporter that no other Lease held unended in the watch's order, and ended after its release; and fairness: a Lease is never assigned while as many earlier Leases of its priority (creationTimestamp, then name) surely waited as exporters could be free. The scheduler lets the first `free` Leases of a queue take in whatever order their passes run, so assignment order alone is not the test; with 2 s margins for the skew between a decision, its write and the watch, a Lease counts as waiting when seen 4 s before and assigned 2 s after, and an exporter as held when its Lease was assigned 2 s before and ended 2 s after. How often a lower-priority Lease was assigned while a higher one waited is reported, not asserted.
- **Snapshots and exports at the API server's limit** (phase `scale`, issue 32): at two sizes, N = 300 and 3,000 unless `UCM_BENCH_SCALE_NS` names others, per size and feature a fresh control plane for the reference and another for ucm (an export step never runs on the objects a snapshot step left), and on each export plane 100 exports made and finished before the clock starts (a fresh plane's first seconds cost more, and the N = 300 step lasts only seconds). The reference is the bench's admin client doing, per object, the minimal writes the feature must make, in their causal order, 8 objects at a time: a MiroirSnapshot round is 10 requests (create; the manager's teardown finalizers, open and publish; each of the three agents' `Suspended` and `Done` slot writes, the three in parallel), with ucm's own fenced patch bodies (the open fenced by `resourceVersion`, since a first round needs no earlier status write); a VirtualMachineExport is 7 (create; its Service, token Secret, serving-certificate Secret and Pod; the kubelet's Pod status; one final status). ucm: the manager at the shipped defaults, three snapshot agents (fake barrier), one three-replica volume per snapshot; the bench's kubelet marks export pods Ready. Both timed from the first create until a watch has seen every final status; API-server CPU from /proc as in `bulk`; the manager's requests from the audit log, its coordination Leases included (round grants, and leader-election renewals, about one per 2 s).
- **Idle**: the leader's requests in the audit log over a window with everything settled, its leader-election Lease requests (`leases.coordination.k8s.io`) counted apart; a restarted manager's writes from spawn to /readyz + 5 s.
- **Start-up**: spawn to the first 200 from /readyz, polled every 10 ms; the reference is the bench listing the same kinds one after the other (pages of 500, as the manager lists).
- **Simulated exporters**: a Rust client over the jumpstarter.v1 stubs compiled from the jumpstarter-protocol 0.9.0 descriptors, one TLS connection per exporter trusting the certificate the leader stored, the token from the exporter's credential Secret. Each Registers, holds a Status stream and reports Available; a kill drops the connection without Unregister. The manager runs with the shipped defaults here too, like the bulk phase.
- **Router** (phase `grpc`, issue 49): `ucm router` processes started with a ROUTER_KEY and a certificate from files (no cluster), `--drain-limit=10m`; each session is a client's and its exporter's stream of one router token, each on its own TLS connection, over the compiled jumpstarter.v1 stubs. Rollout: 200 sessions through router A, each sending 1 KiB every 20 ms for 15 s from the client side, counted on the exporter side; once every one streams, A gets SIGTERM (as a Pod deletion sends it) and 50 new sessions start on router B meanwhile (the manager names ready routers only); a session is cut unless every byte it sent arrived and both ends saw a clean end. Throughput: one session carries 1 GiB in 32 KiB frames, timed from the first frame sent to the last received, the router's CPU (utime + stime) from /proc; the reference is a plain TCP relay of the same bytes (`tokio::io::copy` on one thread of the bench process, no TLS, no framing), its thread's CPU from /proc. Memory: 500 idle sessions (1,000 TLS connections) on a fresh router, its RSS growth divided by the sessions.
- **Failover**: two managers with `--leader-elect` and default durations; the takeover time is the new holder's `acquireTime` (same host clock) minus the signal time; the first reconcile write is observed by the bench polling every 20 ms.
- **Export**: `ucm export-server` with a serving certificate from the manager's own CA code; nginx 1.22 from Debian (`sendfile on`) and pigz from Debian; curl writes to /dev/null and does not decompress; the file is read from the page cache (warmed once); the single raw downloads (straight, through each proxy, from nginx) run in five interleaved rounds per run, gzip and pigz once per run. `ucm export-proxy` and a second nginx instance as TLS reverse proxy (`proxy_pass https://`, HTTP/1.1 upstream, `proxy_buffers 16 256k`, never spooled to disk) serve the same certificate in front of the same export server; for the 50-concurrent figures each of 50 curls fetches a 1/50 range of the file (206, size checked), timed from the first spawn to the last exit, in five interleaved rounds per run (one round lasts about 3 s); a proxy's CPU is the utime+stime delta of its processes (nginx: master and workers) over those runs.
- **Time to objects**: PVC exports created one at a time against a warm manager (each PVC patched to `Bound`); a watch on Services, Secrets and Pods records when each child first appears; per run, the p95 and median over 50 exports.
- **Snapshot barrier**: the fake barrier's per-node event log (freeze/suspend, cut with its duration, resume/thaw), one round at a time.
";

fn meta(runs: usize, scale: f64) -> serde_json::Map<String, serde_json::Value> {
    let sh = |c: &str| {
        std::process::Command::new("sh")
            .args(["-c", c])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let mut m = serde_json::Map::new();
    let date = jiff::Timestamp::now().round(jiff::Unit::Second).unwrap();
    m.insert("date".into(), date.to_string().into());
    m.insert(
        "machine".into(),
        format!(
            "{} CPUs ({}), {} memory, {}",
            sh("nproc"),
            sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs"),
            sh("free -h | awk '/Mem:/{print $2}'"),
            sh("uname -sr")
        )
        .into(),
    );
    m.insert(
        "load average at the end".into(),
        sh("cut -d' ' -f1-3 /proc/loadavg").into(),
    );
    m.insert(
        "commit".into(),
        sh("git rev-parse --short HEAD 2>/dev/null").into(),
    );
    m.insert("runs per figure".into(), runs.into());
    if let Ok(extra) = std::env::var("UCM_BENCH_MANAGER_ARGS") {
        m.insert(
            "MANAGER ARGS".into(),
            format!("extra manager flags {extra:?}: not the shipped defaults").into(),
        );
    }
    if scale != 1.0 {
        m.insert(
            "SCALE".into(),
            format!("object counts × {scale}: not the issue's figures").into(),
        );
    }
    m
}

#[tokio::main]
async fn main() {
    // `UCM_BENCH_RENDER_ONLY=1`: rewrite results.md from results.json and the methods text (after
    // a merge of two partial runs), running nothing.
    if std::env::var("UCM_BENCH_RENDER_ONLY").as_deref() == Ok("1") {
        let out = std::env::var("UCM_BENCH_OUT").unwrap_or_else(|_| "bench".into());
        report::write(
            std::path::Path::new(&out),
            report::Results::default(),
            METHODS,
        )
        .unwrap();
        return;
    }
    // `cargo bench` passes `--bench`; nothing else is accepted.
    let started = Instant::now();
    let only: Vec<String> = std::env::var("UCM_BENCH_ONLY")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.split(',').map(|p| p.trim().to_string()).collect())
        .unwrap_or_else(|| PHASES.iter().map(|p| p.to_string()).collect());
    // A phase without a section title would be measured but left out of results.md.
    for p in PHASES {
        assert!(
            report::PHASE_TITLES.iter().any(|(q, _)| q == p),
            "phase {p} has no section in report::PHASE_TITLES"
        );
    }
    for p in &only {
        assert!(
            PHASES.contains(&p.as_str()),
            "unknown phase {p}; phases: {PHASES:?}"
        );
    }
    let runs: usize = env_num("UCM_BENCH_RUNS", 3);
    let f: f64 = env_num("UCM_BENCH_SCALE", 1.0);
    let n = |x: f64| ((x * f).round() as usize).max(1);
    let scale = bulk::Scale {
        exporters: n(5000.0),
        vmexports: n(1000.0),
        snapshots: n(1000.0),
        volumes: n(1000.0),
        grpc_exporters: n(1000.0),
        kills: 10usize.min(n(1000.0)),
    };
    let out = PathBuf::from(
        std::env::var("UCM_BENCH_OUT")
            .unwrap_or_else(|_| format!("{}/bench", env!("CARGO_MANIFEST_DIR"))),
    );
    let tmp = tempfile::Builder::new()
        .prefix("ucm-bench-")
        .tempdir()
        .unwrap();
    let work = tmp.path().to_path_buf();
    // UCM_BENCH_KEEP=1 keeps the work directory (logs of every process) for a look afterwards.
    let _tmp = if std::env::var("UCM_BENCH_KEEP").as_deref() == Ok("1") {
        let _ = tmp.keep();
        None
    } else {
        Some(tmp)
    };
    eprintln!(
        "ucm bench: phases {only:?}, {runs} runs, scale {f}, work dir {}",
        work.display()
    );

    let ctx = Ctx {
        plane: cluster::Plane::start(&work.join("cp")).await,
        work: work.clone(),
        runs,
        scale,
        scale_factor: f,
        idle_window: Duration::from_secs(env_num("UCM_BENCH_IDLE_S", 30)),
        grpc_window: Duration::from_secs(env_num("UCM_BENCH_GRPC_WINDOW_S", 40)),
        grpc_windows: runs,
        barrier_rounds: env_num("UCM_BENCH_BARRIER_ROUNDS", 50),
        failover_runs: runs,
        export_bytes: env_num::<u64>("UCM_BENCH_EXPORT_MIB", 2048) << 20,
    };

    let mut figures = Vec::new();
    let mut timings = serde_json::Map::new();
    for phase in PHASES.iter().filter(|p| only.iter().any(|o| o == *p)) {
        eprintln!("== phase {phase}");
        let t0 = Instant::now();
        let fig = match *phase {
            "export" => export::run(&ctx).await,
            "barrier" => barrier::run(&ctx).await,
            "objects" => objects::run(&ctx).await,
            "bulk" => bulk::run(&ctx).await,
            "scale" => scale::run(&ctx).await,
            "leases" => leases::run(&ctx).await,
            "peer" => peer::run(&ctx).await,
            "churn" => churn::run(&ctx).await,
            "queue" => queue::run(&ctx).await,
            "grpc" => grpc::run(&ctx).await,
            "failover" => failover::run(&ctx).await,
            _ => unreachable!(),
        };
        let secs = t0.elapsed().as_secs();
        eprintln!("== phase {phase} done in {}m{:02}s", secs / 60, secs % 60);
        timings.insert(
            format!("phase {phase} wall time"),
            format!("{}m{:02}s", secs / 60, secs % 60).into(),
        );
        for f in &fig {
            eprintln!(
                "  {}: {} {} (min {}, max {})",
                f.title,
                report::fmt(f.median),
                f.unit,
                report::fmt(f.min),
                report::fmt(f.max)
            );
        }
        figures.extend(fig);
    }
    let mut m = meta(runs, f);
    m.extend(timings);
    let secs = started.elapsed().as_secs();
    m.insert(
        "driver wall time (without the build)".into(),
        format!("{}m{:02}s", secs / 60, secs % 60).into(),
    );
    if let Ok(b) = std::env::var("UCM_BENCH_BUILD_TIME") {
        m.insert("build time (cargo bench --no-run)".into(), b.into());
    }
    // A partial rerun names the phases its commit, date and times belong to, next to the full
    // run's (report::Results::merge).
    if PHASES.iter().any(|p| !only.iter().any(|o| o == p)) {
        let tag = only.join(", ");
        m = m
            .into_iter()
            .map(|(k, v)| {
                if k.starts_with("phase ") || k == "machine" {
                    (k, v)
                } else {
                    (format!("{k} (rerun of {tag})"), v)
                }
            })
            .collect();
    }
    let fresh = report::Results { meta: m, figures };
    report::write(&out, fresh, METHODS).unwrap();
    eprintln!("wrote {}/results.md and results.json", out.display());
    drop(ctx);
}

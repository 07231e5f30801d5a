//! Real peers (docs/exporter.md): `ucm manager` (exporter feature), `ucm router`, the
//! `jumpstarter` 0.9.0 exporter (`jmp run` with a MockPower driver) and the `jmp` 0.9.0 client,
//! all as local processes against the local control plane; `jmp admin` creates the Exporter and
//! the Client and writes their configs from what ucm minted. The pinned packages come from PyPI
//! through `hack/jumpstarter/venv.sh` (cached in ~/.cache/ucm); a missing prerequisite fails.
//!
//! The exporter trusts ucm's certificate with `tls.insecure` (it pins what the server presents);
//! the client trusts it through `tls.ca`, and the router serves the same stored certificate, so
//! both ways upstream configs trust a controller are covered.

mod keycloak;
mod replicas;
mod takeover;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use ucm::exporter::crd::{Exporter, ExporterStatusValue, Lease};

use crate::common::*;

/// `ucm router` as a subprocess; SIGTERM on drop.
struct Router {
    child: Option<Child>,
    log: PathBuf,
}

impl Router {
    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(c.id(), "TERM");
            if wait_child(&mut c, Duration::from_secs(10)).is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if std::thread::panicking() {
            eprintln!("---- router log ----\n{}", tail(&self.log, 60));
        }
    }
}

/// `jmp run`: a parent process that forks the serving child into its own session (setsid) and
/// forwards signals to it. Dropping it SIGKILLs both. (Also the node area's exporter.)
pub(crate) struct ExporterProc {
    pub(crate) child: Option<Child>,
    pub(crate) log: PathBuf,
}

impl ExporterProc {
    /// The serving children (their pids are also their process-group ids).
    fn children(&self) -> Vec<u32> {
        let Some(c) = &self.child else { return vec![] };
        let pid = c.id();
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// SIGTERM to the parent, which forwards it; waits for the parent to exit.
    pub(crate) fn terminate(&mut self) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        signal(c.id(), "TERM");
        let status = wait_child(&mut c, Duration::from_secs(30));
        if status.is_none() {
            let _ = c.kill();
            let _ = c.wait();
        }
        status
    }

    /// SIGKILL to the serving child's whole process group, then the parent: no goodbye.
    fn kill(&mut self) {
        for pid in self.children() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{pid}")])
                .status();
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ExporterProc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "---- exporter log ({}) ----\n{}",
                self.log.display(),
                tail(&self.log, 60)
            );
        }
    }
}

/// `ucm router` on 127.0.0.1:`port` for `env`'s namespace, serving `cert`/`key`; `envs` adds
/// variables (e.g. ROUTER_KEY; without it the router reads the Secret the manager created).
fn start_router(
    env: &TestEnv,
    dir: &Path,
    port: u16,
    cert: &[u8],
    key: &[u8],
    envs: &[(&str, &str)],
) -> Router {
    let log_path = dir.join("router.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ucm"));
    cmd.args([
        "router".to_string(),
        format!("--bind-address=127.0.0.1:{port}"),
        format!("--endpoint=localhost:{port}"),
        format!("--namespace={}", env.ns),
        // No probe server: tests run several routers and managers side by side.
        "--health-probe-bind-address=0".into(),
        "--log-level=info,ucm=debug".into(),
    ])
    .env("KUBECONFIG", &env.kubeconfig)
    .env(
        "EXTERNAL_CERT_PEM",
        String::from_utf8(cert.to_vec()).unwrap(),
    )
    .env("EXTERNAL_KEY_PEM", String::from_utf8(key.to_vec()).unwrap())
    .env_remove("ROUTER_KEY")
    .env_remove("RUST_LOG");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start ucm router");
    Router {
        child: Some(child),
        log: log_path,
    }
}

/// `jmp run --exporter-config <cfg>`, its output in `<dir>/<log>`.
fn jmp_run(venv: &Path, dir: &Path, cfg: &Path, log: &str) -> ExporterProc {
    let log_path = dir.join(log);
    let out = std::fs::File::create(&log_path).unwrap();
    let child = py_cmd(venv, dir, "jmp")
        .arg("run")
        .arg("--exporter-config")
        .arg(cfg)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("start jmp run");
    ExporterProc {
        child: Some(child),
        log: log_path,
    }
}

/// A jumpstarter command with a private HOME (no user config leaks in) and no JMP_* variables.
fn py_cmd(venv: &Path, dir: &Path, bin: &str) -> Command {
    let mut cmd = Command::new(venv.join("bin").join(bin));
    py_env(&mut cmd, venv, dir);
    cmd
}

/// [`py_cmd`]'s environment, for a command that starts the jumpstarter program itself (the node
/// area wraps it to run in the node's network namespace).
pub(crate) fn py_env(cmd: &mut Command, venv: &Path, dir: &Path) {
    let home = dir.join("home");
    std::fs::create_dir_all(&home).unwrap();
    for (k, _) in std::env::vars() {
        if k.starts_with("JMP_") || k.starts_with("JUMPSTARTER_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("HOME", &home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("NONINTERACTIVE", "true")
        .env(
            "PATH",
            format!("{}:/usr/bin:/bin", venv.join("bin").display()),
        );
}

/// Runs a command to completion off the async runtime; panics with its output on failure.
async fn run_ok(mut cmd: Command, what: &str) -> String {
    let what = what.to_string();
    tokio::task::spawn_blocking(move || {
        let out = cmd.stdin(Stdio::null()).output().expect(&what);
        assert!(
            out.status.success(),
            "{what} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    })
    .await
    .unwrap()
}

fn edit_yaml(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_saphyr::to_string(&v).unwrap()).unwrap();
}

const EXPORTER: &str = "bench-1";
const CLIENT: &str = "dev";
const BOARD: &str = "mock-board";

/// One namespace with a manager, a router, an Exporter and a Client, and the peers' configs.
struct Lab {
    venv: PathBuf,
    env: TestEnv,
    mgr: Manager,
    router: Router,
    dir: tempfile::TempDir,
    exporter_cfg: PathBuf,
    client_cfg: PathBuf,
    grpc_port: u16,
    login_port: u16,
    router_endpoint: String,
    cert: Vec<u8>,
    exporter_token: String,
    client_token: String,
}

fn lease_ref(e: &Exporter) -> Option<String> {
    e.status
        .as_ref()?
        .lease_ref
        .as_ref()
        .map(|r| r.name.clone())
}

impl Lab {
    async fn start(test: &str, offline_threshold: &str) -> Lab {
        Lab::start_with(test, offline_threshold, None).await
    }

    /// With the `jumpstarter-controller` ConfigMap's key `config` set to `config`.
    async fn start_with(test: &str, offline_threshold: &str, config: Option<&str>) -> Lab {
        Lab::start_full(test, offline_threshold, config, &[]).await
    }

    /// Also with `extra` manager flags.
    async fn start_full(
        test: &str,
        offline_threshold: &str,
        config: Option<&str>,
        extra: &[&str],
    ) -> Lab {
        let venv = tokio::task::spawn_blocking(jumpstarter_venv).await.unwrap();
        let env = TestEnv::new(test).await;
        if let Some(config) = config {
            let cms: Api<k8s_openapi::api::core::v1::ConfigMap> =
                Api::namespaced(env.client.clone(), &env.ns);
            let cm: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(
                serde_json::json!({"metadata": {"name": "jumpstarter-controller"},
                                   "data": {"config": config}}),
            )
            .unwrap();
            cms.create(&Default::default(), &cm).await.unwrap();
        }
        let dir = tempfile::Builder::new()
            .prefix("ucm-jumpstarter-")
            .tempdir()
            .unwrap();
        let (grpc_port, router_port, login_port) = (free_port(), free_port(), free_port());
        let grpc_endpoint = format!("localhost:{grpc_port}");
        let router_endpoint = format!("localhost:{router_port}");
        let mgr = Manager::start(
            ManagerOpts::new(&env.kubeconfig, &env.ns)
                .only("exporter")
                .args([
                    format!("--exporter-grpc-bind-address=127.0.0.1:{grpc_port}"),
                    format!("--exporter-grpc-endpoint={grpc_endpoint}"),
                    format!("--exporter-router-endpoint={router_endpoint}"),
                    format!("--exporter-offline-threshold={offline_threshold}"),
                    format!("--exporter-login-bind-address=127.0.0.1:{login_port}"),
                ])
                .args(extra.iter().map(|a| a.to_string())),
        );
        // Exporter and Client as an admin makes them: `jmp admin` creates the objects, waits for
        // ucm's credential and endpoint, and writes the peers' configs (tokens included).
        let exporter_cfg = dir.path().join("exporter.yaml");
        let client_cfg = dir.path().join("client.yaml");
        let admin = |args: &[&str], out: &Path| {
            let mut cmd = py_cmd(&venv, dir.path(), "jmp");
            cmd.args(["admin", "create"])
                .args(args)
                .args(["-n", &env.ns, "--save", "--nointeractive", "--insecure-tls"])
                .arg("--kubeconfig")
                .arg(&env.kubeconfig)
                .arg("--out")
                .arg(out);
            cmd
        };
        let label = format!("board={BOARD}");
        tokio::join!(
            run_ok(
                admin(&["exporter", EXPORTER, "-l", &label], &exporter_cfg),
                "jmp admin create exporter"
            ),
            run_ok(
                admin(&["client", CLIENT, "--unsafe"], &client_cfg),
                "jmp admin create client"
            ),
        );
        let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
        let exporter_token = String::from_utf8(
            secret_data(&secrets, &format!("{EXPORTER}-exporter"), "token").await,
        )
        .unwrap();
        let client_token =
            String::from_utf8(secret_data(&secrets, &format!("{CLIENT}-client"), "token").await)
                .unwrap();
        // The leader stores its self-signed certificate when the gRPC server starts.
        let cert = secret_data(&secrets, "ucm-exporter-grpc-tls", "tls.crt").await;
        let key = secret_data(&secrets, "ucm-exporter-grpc-tls", "tls.key").await;

        // The router reads its key from the Secret the manager created (no ROUTER_KEY) and serves
        // the controller's certificate, so one CA covers both endpoints.
        let router = start_router(&env, dir.path(), router_port, &cert, &key, &[]);

        // The exporter keeps `tls.insecure` from `jmp admin -k`; the client trusts the CA.
        edit_yaml(&exporter_cfg, |v| {
            assert_eq!(v["endpoint"], grpc_endpoint.as_str(), "status.endpoint");
            assert_eq!(v["token"], exporter_token.as_str(), "the minted token");
            v["export"] = serde_json::json!({
                "power": {"type": "jumpstarter_driver_power.driver.MockPower"}
            });
        });
        edit_yaml(&client_cfg, |v| {
            assert_eq!(v["endpoint"], grpc_endpoint.as_str(), "status.endpoint");
            assert_eq!(v["token"], client_token.as_str(), "the minted token");
            v["tls"] = serde_json::json!({
                "ca": base64::engine::general_purpose::STANDARD.encode(&cert),
                "insecure": false,
            });
        });
        Lab {
            venv,
            env,
            mgr,
            router,
            dir,
            exporter_cfg,
            client_cfg,
            grpc_port,
            login_port,
            router_endpoint,
            cert,
            exporter_token,
            client_token,
        }
    }

    fn py_cmd(&self, bin: &str) -> Command {
        py_cmd(&self.venv, self.dir.path(), bin)
    }

    fn start_exporter(&self, n: usize) -> ExporterProc {
        jmp_run(
            &self.venv,
            self.dir.path(),
            &self.exporter_cfg,
            &format!("exporter-{n}.log"),
        )
    }

    /// Runs `jmp <args> --client-config <cfg>`; returns (success, stdout, stderr).
    async fn jmp(&self, args: &[&str]) -> (bool, String, String) {
        self.jmp_as(&self.client_cfg, args).await
    }

    /// `jmp create lease -l board=<BOARD> --duration 10m -o name` with `cfg`, which must succeed
    /// (`who` names the caller in the failure); the printed lease name.
    async fn create_lease_as(&self, cfg: &Path, who: &str) -> String {
        let selector = format!("board={BOARD}");
        let args = [
            "create",
            "lease",
            "-l",
            &selector,
            "--duration",
            "10m",
            "-o",
            "name",
        ];
        let (ok, out, err) = self.jmp_as(cfg, &args).await;
        assert!(ok, "jmp create lease{who} failed:\n{out}\n{err}");
        out.trim().to_string()
    }

    /// [`Lab::jmp`] with another client config.
    async fn jmp_as(&self, cfg: &Path, args: &[&str]) -> (bool, String, String) {
        let mut full: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        // Options go before a `--` separator (the shell's command).
        let at = full.iter().position(|a| a == "--").unwrap_or(full.len());
        full.insert(at, "--client-config".into());
        full.insert(at + 1, cfg.display().to_string());
        self.jmp_raw(&full, &[]).await
    }

    /// `jmp <args>` exactly as given, with extra environment variables.
    async fn jmp_raw(&self, full: &[String], envs: &[(&str, &Path)]) -> (bool, String, String) {
        let args = full.to_vec();
        let mut cmd = self.py_cmd("jmp");
        cmd.args(&args);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let out = tokio::task::spawn_blocking(move || {
            let child = cmd
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run jmp");
            child.wait_with_output().unwrap()
        });
        let out = tokio::time::timeout(Duration::from_secs(120), out)
            .await
            .unwrap_or_else(|_| panic!("jmp {args:?} did not finish in 120s"))
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn exporters(&self) -> Api<Exporter> {
        Api::namespaced(self.env.client.clone(), &self.env.ns)
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.env.client.clone(), &self.env.ns)
    }

    /// Polls the Exporter until `pred` holds; returns it and when it was first seen.
    async fn wait_exporter(
        &self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&Exporter) -> bool,
    ) -> (Exporter, Instant) {
        let api = self.exporters();
        let start = Instant::now();
        loop {
            if let Ok(e) = api.get(EXPORTER).await
                && pred(&e)
            {
                return (e, Instant::now());
            }
            if start.elapsed() > timeout {
                let e = api.get(EXPORTER).await.ok();
                panic!(
                    "timed out after {timeout:?} waiting for the exporter to be {what}; status: {}",
                    serde_json::to_string_pretty(&e.and_then(|e| e.status)).unwrap()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_available(&self, what: &str) -> Exporter {
        self.wait_exporter(TIMEOUT, what, exporter_available)
            .await
            .0
    }
}

/// The lease queue with the real peers (docs/exporter.md, "Lease scheduling"): `jmp get leases`
/// shows where a pending lease stands (its Pending condition), and a lease `jmp` holds under
/// spot access is preempted (grace 0) by a priority lease, whose the real exporter then serves.
#[tokio::test]
#[ignore = "e2e: needs the local control plane and the pinned jumpstarter packages"]
async fn jmp_shows_queue_positions_and_a_spot_lease_is_preempted() {
    let lab = Lab::start_full(
        "jmp-queue",
        "60s",
        None,
        &["--exporter-preemption-grace=0s"],
    )
    .await;
    let _exporter = lab.start_exporter(1);
    lab.wait_available("registered, online and available").await;
    // The lab's client may use the board under spot access only; Clients labelled team=ci
    // without it, at priority 10.
    let policies: Api<ucm::exporter::crd::ExporterAccessPolicy> =
        Api::namespaced(lab.env.client.clone(), &lab.env.ns);
    let policy = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "board"},
        "spec": {"exporterSelector": {"matchLabels": {"board": BOARD}},
                 "policies": [
                     {"priority": 10, "from": [{"clientSelector": {"matchLabels": {"team": "ci"}}}]},
                     {"spotAccess": true, "from": [{"clientSelector": {}}]}]}
    }))
    .unwrap();
    policies.create(&Default::default(), &policy).await.unwrap();
    let clients: Api<ucm::exporter::crd::Client> =
        Api::namespaced(lab.env.client.clone(), &lab.env.ns);
    let ci = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "ci", "labels": {"team": "ci"}}, "spec": {}
    }))
    .unwrap();
    clients.create(&Default::default(), &ci).await.unwrap();

    let create = || lab.create_lease_as(&lab.client_cfg, "");
    let spot = create().await;
    let (e, _) = lab
        .wait_exporter(TIMEOUT, "leased under spot access", |e| {
            lease_ref(e).as_deref() == Some(spot.as_str())
                && exporter_status(e) == Some(ExporterStatusValue::LeaseReady)
        })
        .await;
    drop(e);
    let spot_status = lab.leases().get(&spot).await.unwrap().status.unwrap();
    assert_eq!(spot_status.spot_access, Some(true));
    let (w1, w2) = (create().await, create().await);

    // What `jmp get leases` shows of a pending lease: its Pending condition, with its place.
    let pending_message = |out: &str, name: &str| -> Option<String> {
        let listed: serde_json::Value = serde_json::from_str(out).ok()?;
        let lease = listed["leases"]
            .as_array()?
            .iter()
            .find(|l| l["name"] == name)?
            .clone();
        lease["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Pending" && c["status"] == "True")
            .and_then(|c| c["message"].as_str().map(str::to_string))
    };
    let shows = |name: String, place: &'static str| {
        let lab = &lab;
        async move {
            let deadline = Instant::now() + TIMEOUT;
            loop {
                let (ok, out, err) = lab.jmp(&["get", "leases", "-o", "json"]).await;
                assert!(ok, "jmp get leases failed:\n{out}\n{err}");
                let message = pending_message(&out, &name);
                if message.as_deref().is_some_and(|m| m.contains(place)) {
                    return message.unwrap();
                }
                assert!(
                    Instant::now() < deadline,
                    "jmp get leases never showed {name} at {place:?}; last: {message:?}\n{out}"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    let m1 = shows(w1.clone(), "position 1 in the queue").await;
    let m2 = shows(w2.clone(), "position 2 in the queue").await;
    eprintln!("jmp get leases: {w1}: {m1}\n{w2}: {m2}");
    // The holder has 10m: the estimate is a time, not "unknown".
    assert!(m2.contains("estimated start 20"), "{m2}");

    // A priority lease for the ci Client: it heads the queue, the spot lease is preempted at
    // once and the real exporter goes to it.
    let urgent: Lease = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "urgent"},
        "spec": {"clientRef": {"name": "ci"}, "duration": "10m",
                 "selector": {"matchLabels": {"board": BOARD}}}
    }))
    .unwrap();
    lab.leases()
        .create(&Default::default(), &urgent)
        .await
        .unwrap();
    lab.wait_exporter(TIMEOUT, "leased to the priority lease", |e| {
        lease_ref(e).as_deref() == Some("urgent")
            && exporter_status(e) == Some(ExporterStatusValue::LeaseReady)
    })
    .await;
    let preempted = lab.leases().get(&spot).await.unwrap();
    let st = preempted.status.unwrap();
    assert!(st.ended, "the spot lease did not end");
    let ended = st
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Ended")
        .expect("an Ended condition");
    assert_eq!(
        (ended.status.as_str(), ended.reason.as_str()),
        ("True", "Preempted")
    );
    assert!(ended.message.contains("lease urgent"), "{}", ended.message);
    // The spot leases still waiting keep their order behind it.
    shows(w1, "position 1 in the queue").await;
    shows(w2, "position 2 in the queue").await;
    let metrics = lab.mgr.metrics().await;
    assert!(
        metrics.contains(&format!(
            "ucm_exporter_lease_preemptions_total{{namespace=\"{}\"}} 1",
            lab.env.ns
        )),
        "preemptions: {}",
        metrics
            .lines()
            .filter(|l| l.contains("preemptions"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The real exporter registers (Registered, Online, Available, devices listed); `jmp`
/// lists it, creates a lease by selector and gets it; `j power read` runs client → `ucm router`
/// → exporter and back; releasing the lease returns the exporter to Available without a
/// leaseRef; SIGTERM makes the exporter unregister, which marks it Offline at once.
#[tokio::test]
#[ignore = "e2e: needs the local control plane and the pinned jumpstarter packages"]
async fn real_exporter_and_jmp_lease_round_trip() {
    // A long threshold: Offline after SIGTERM can then only come from the exporter's goodbye.
    let lab = Lab::start("jmp-lease", "60s").await;
    let mut exporter = lab.start_exporter(1);

    let e = lab.wait_available("registered, online and available").await;
    let devices = e.status.clone().unwrap().devices.unwrap_or_default();
    assert!(
        devices.iter().any(|d| d
            .labels
            .as_ref()
            .and_then(|l| l.get("jumpstarter.dev/name"))
            .map(String::as_str)
            == Some("power")),
        "the MockPower device is not listed: {devices:?}"
    );
    assert!(lease_ref(&e).is_none());

    // ClientService.ListExporters through the real CLI.
    let (ok, out, err) = lab
        .jmp(&["get", "exporters", "--with", "online,status", "-o", "json"])
        .await;
    assert!(ok, "jmp get exporters failed:\n{out}\n{err}");
    let listed: serde_json::Value = serde_json::from_str(&out).expect(&out);
    let row = &listed["exporters"][0];
    assert_eq!(row["name"], EXPORTER, "{out}");
    assert_eq!(row["labels"]["board"], BOARD, "{out}");
    assert_eq!(row["online"], true, "{out}");

    // ClientService.CreateLease by selector, then the lease is acquired.
    let lease_name = lab.create_lease_as(&lab.client_cfg, "").await;
    assert!(!lease_name.is_empty(), "no lease name printed");
    let lease = lab.leases().get(&lease_name).await.unwrap();
    assert_eq!(lease.spec.client_ref.name, CLIENT);
    assert_eq!(
        lease.spec.duration.as_deref(),
        Some("10m0s"),
        "duration written as metav1.Duration"
    );
    let (e, _) = lab
        .wait_exporter(TIMEOUT, "leased and ready", |e| {
            lease_ref(e).as_deref() == Some(lease_name.as_str())
                && exporter_status(e) == Some(ExporterStatusValue::LeaseReady)
        })
        .await;
    assert_eq!(
        exporter_condition(&e, "Online").map(|c| c.0).as_deref(),
        Some("True")
    );
    let (ok, out, err) = lab.jmp(&["get", "leases", "-o", "json"]).await;
    assert!(ok, "jmp get leases failed:\n{out}\n{err}");
    let leases: serde_json::Value = serde_json::from_str(&out).expect(&out);
    let got = leases["leases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == lease_name.as_str())
        .unwrap_or_else(|| panic!("lease {lease_name} not listed: {out}"));
    assert_eq!(got["exporter"], EXPORTER, "{out}");
    assert_eq!(got["client"], CLIENT, "{out}");
    assert_eq!(got["selector"], format!("board={BOARD}"), "{out}");

    // A driver call through the lease: jmp Dials, both peers meet in `ucm router`.
    let (ok, out, err) = lab
        .jmp(&[
            "shell",
            "--lease",
            &lease_name,
            "--",
            "j",
            "power",
            "read",
            "-n",
            "1",
        ])
        .await;
    assert!(ok, "jmp shell failed:\nstdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains("voltage=5.0 V  current=2.0 A"),
        "the MockPower reading did not come back:\nstdout:\n{out}\nstderr:\n{err}"
    );
    let router_log = lab.router.logs();
    assert!(
        router_log.contains("streams paired"),
        "the call did not go through ucm router:\n{router_log}"
    );

    // Release (DeleteLease): the lease ends, the exporter is Available with no leaseRef.
    let (ok, out, err) = lab.jmp(&["delete", "leases", &lease_name]).await;
    assert!(ok, "jmp delete leases failed:\n{out}\n{err}");
    eventually(TIMEOUT, "the lease to end", || async {
        lab.leases()
            .get(&lease_name)
            .await
            .ok()
            .and_then(|l| l.status)
            .is_some_and(|s| s.ended)
    })
    .await;
    lab.wait_exporter(TIMEOUT, "available again without a leaseRef", |e| {
        lease_ref(e).is_none() && exporter_status(e) == Some(ExporterStatusValue::Available)
    })
    .await;
    let metrics = lab.mgr.metrics().await;
    assert!(
        metrics.contains("jumpstarter_lease_acquisitions_total{result=\"success\"} 1"),
        "acquisition counter: {}",
        metrics
            .lines()
            .filter(|l| l.contains("jumpstarter_lease_acquisitions_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // Graceful stop: the exporter reports Offline and unregisters before it exits.
    let stopped = Instant::now();
    let exit = exporter.terminate();
    assert!(exit.is_some(), "jmp run did not exit on SIGTERM");
    let (e, seen) = lab
        .wait_exporter(Duration::from_secs(20), "offline after SIGTERM", |e| {
            exporter_status(e) == Some(ExporterStatusValue::Offline)
                && exporter_condition(e, "Online").is_some_and(|c| c.0 == "False")
        })
        .await;
    eprintln!("SIGTERM: Offline after {:?}", seen - stopped);
    assert!(
        seen - stopped < Duration::from_secs(20),
        "Offline must come from the goodbye, not the 60s threshold"
    );
    assert_eq!(
        exporter_condition(&e, "Registered").map(|c| c.0).as_deref(),
        Some("False")
    );
    let secrets: Api<Secret> = Api::namespaced(lab.env.client.clone(), &lab.env.ns);
    for s in [format!("{EXPORTER}-exporter"), format!("{CLIENT}-client")] {
        let token = String::from_utf8(secret_data(&secrets, &s, "token").await).unwrap();
        assert!(
            !lab.mgr.logs().contains(&token),
            "a token appears in the manager log"
        );
        assert!(
            !lab.router.logs().contains(&token),
            "a token appears in the router log"
        );
    }
}

/// A SIGKILLed exporter says nothing; it is marked Offline by the threshold (here 5 s) about
/// one second after it is due, and comes back Online when it restarts.
#[tokio::test]
#[ignore = "e2e: needs the local control plane and the pinned jumpstarter packages"]
async fn killed_exporter_goes_offline_at_the_threshold_and_returns() {
    const T: Duration = Duration::from_secs(5);
    let lab = Lab::start("jmp-kill", "5s").await;
    let mut exporter = lab.start_exporter(1);
    lab.wait_available("registered, online and available").await;
    // Let a heartbeat or two pass so the stored lastSeen is the spaced one, not the connect's.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !exporter.children().is_empty(),
        "jmp run has no serving child:\n{}",
        exporter.logs()
    );

    let killed = Instant::now();
    let killed_at = jiff::Timestamp::now();
    exporter.kill();
    let (e, seen) = lab
        .wait_exporter(T + Duration::from_secs(30), "offline after SIGKILL", |e| {
            exporter_status(e) == Some(ExporterStatusValue::Offline)
                && exporter_condition(e, "Online").is_some_and(|c| c.0 == "False")
        })
        .await;
    let st = e.status.clone().unwrap();
    assert_eq!(
        st.status_message.as_deref(),
        Some("Connection lost - last seen more than 5 seconds ago"),
        "Offline must come from the threshold (the exporter never said goodbye)"
    );
    let last_seen = st.last_seen.expect("lastSeen").0;
    // lastSeen is stored at whole seconds; a beat racing the kill may still land in that second.
    assert!(
        last_seen <= killed_at + jiff::SignedDuration::from_secs(1),
        "lastSeen {last_seen} written well after the kill at {killed_at}: heartbeats went on"
    );
    // Due at lastSeen + T; ucm marks it about 1 s later. Generous slack: this is about
    // correctness (threshold-driven, no polling period), not timing precision.
    let due =
        Duration::from_millis((last_seen + T).duration_since(killed_at).as_millis().max(0) as u64);
    let took = seen - killed;
    eprintln!("SIGKILL: Offline after {took:?}, due {due:?} after the kill (threshold {T:?})");
    assert!(
        took <= due + Duration::from_secs(5),
        "Offline {took:?} after the kill; due {due:?} after it (threshold {T:?})"
    );
    assert!(
        took + Duration::from_secs(1) >= due,
        "Offline {took:?} after the kill, before it was due ({due:?})"
    );

    // A restarted exporter comes back.
    let _exporter = lab.start_exporter(2);
    lab.wait_available("online again after a restart").await;
}

/// The controller's gRPC API as `jmp`'s own stubs call it, over TLS with the stored certificate.
async fn channel(lab: &Lab) -> tonic::transport::Channel {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    Endpoint::from_shared(format!("https://localhost:{}", lab.grpc_port))
        .unwrap()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&lab.cert))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
        .expect("connect to the controller gRPC port")
}

fn authed<T>(body: T, token: &str, kind: &str, ns: &str, name: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(body);
    let md = r.metadata_mut();
    md.insert("authorization", format!("Bearer {token}").parse().unwrap());
    md.insert("jumpstarter-kind", kind.parse().unwrap());
    md.insert("jumpstarter-namespace", ns.parse().unwrap());
    md.insert("jumpstarter-name", name.parse().unwrap());
    r
}

/// ClientService under the controller's auth rules (Clients of the named namespace only), the
/// legacy ControllerService.RequestLease, UpdateLease, DeleteLease (release, then
/// FailedPrecondition) and RotateToken (the new token is stored and authenticates).
#[tokio::test]
#[ignore = "e2e: needs the local control plane and the pinned jumpstarter packages"]
async fn client_service_rules_request_lease_and_rotate_token() {
    use cpb::client_service_client::ClientServiceClient;
    use pb::controller_service_client::ControllerServiceClient;
    use tonic::Code;
    use ucm::exporter::proto::jumpstarter::client::v1 as cpb;
    use ucm::exporter::proto::jumpstarter::v1 as pb;

    let lab = Lab::start("jmp-api", "60s").await;
    let ns = lab.env.ns.clone();
    let ch = channel(&lab).await;
    let mut svc = ClientServiceClient::new(ch.clone());
    let mut ctl = ControllerServiceClient::new(ch);
    macro_rules! client {
        ($body:expr) => {
            authed($body, &lab.client_token, "Client", &ns, CLIENT)
        };
    }
    let parent = format!("namespaces/{ns}");

    // Another namespace, or an exporter's credential: refused.
    let e = svc
        .list_leases(client!(cpb::ListLeasesRequest {
            parent: "namespaces/elsewhere".into(),
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = svc
        .list_exporters(authed(
            cpb::ListExportersRequest {
                parent: parent.clone(),
                ..Default::default()
            },
            &lab.exporter_token,
            "Exporter",
            &ns,
            EXPORTER,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = svc
        .create_lease(client!(cpb::CreateLeaseRequest {
            parent: parent.clone(),
            lease: Some(cpb::Lease::default()),
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    // Legacy RequestLease, then read, extend and release it through ClientService.
    let name = ctl
        .request_lease(client!(pb::RequestLeaseRequest {
            duration: Some(prost_types::Duration {
                seconds: 300,
                nanos: 0,
            }),
            selector: Some(pb::LabelSelector {
                match_labels: [("board".to_string(), BOARD.to_string())].into(),
                match_expressions: vec![],
            }),
        }))
        .await
        .expect("RequestLease")
        .into_inner()
        .name;
    assert_eq!(uuid::Uuid::parse_str(&name).unwrap().get_version_num(), 7);
    let lease = lab.leases().get(&name).await.unwrap();
    assert_eq!(lease.spec.client_ref.name, CLIENT);
    assert_eq!(lease.spec.duration.as_deref(), Some("5m0s"));
    assert_eq!(
        lease
            .metadata
            .labels
            .unwrap_or_default()
            .get("board")
            .map(String::as_str),
        Some(BOARD)
    );
    let id = format!("namespaces/{ns}/leases/{name}");
    let got = svc
        .get_lease(client!(cpb::GetLeaseRequest { name: id.clone() }))
        .await
        .expect("GetLease")
        .into_inner();
    assert_eq!(got.selector, format!("board={BOARD}"));
    assert_eq!(
        got.client.as_deref(),
        Some(format!("namespaces/{ns}/clients/{CLIENT}").as_str())
    );
    let updated = svc
        .update_lease(client!(cpb::UpdateLeaseRequest {
            lease: Some(cpb::Lease {
                name: id.clone(),
                duration: Some(prost_types::Duration {
                    seconds: 600,
                    nanos: 0,
                }),
                ..Default::default()
            }),
            update_mask: Some(prost_types::FieldMask {
                paths: vec!["duration".into()],
            }),
        }))
        .await
        .expect("UpdateLease")
        .into_inner();
    assert_eq!(updated.duration.map(|d| d.seconds), Some(600));
    assert_eq!(
        lab.leases()
            .get(&name)
            .await
            .unwrap()
            .spec
            .duration
            .as_deref(),
        Some("10m0s")
    );
    svc.delete_lease(client!(cpb::DeleteLeaseRequest { name: id.clone() }))
        .await
        .expect("DeleteLease");
    assert_eq!(
        lab.leases().get(&name).await.unwrap().spec.release,
        Some(true)
    );
    let e = svc
        .delete_lease(client!(cpb::DeleteLeaseRequest { name: id }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");

    // RotateToken: a new token, stored in the Client's Secret, that authenticates.
    let rotated = svc
        .rotate_token(client!(cpb::RotateTokenRequest {
            parent: parent.clone(),
        }))
        .await
        .expect("RotateToken")
        .into_inner();
    assert!(!rotated.token.is_empty() && rotated.token != lab.client_token);
    assert!(
        rotated
            .expiry
            .is_some_and(|t| t.seconds > jiff::Timestamp::now().as_second())
    );
    let secrets: Api<Secret> = Api::namespaced(lab.env.client.clone(), &ns);
    let stored = secret_data(&secrets, &format!("{CLIENT}-client"), "token").await;
    assert_eq!(String::from_utf8(stored).unwrap(), rotated.token);
    let listed = svc
        .list_exporters(authed(
            cpb::ListExportersRequest {
                parent,
                ..Default::default()
            },
            &rotated.token,
            "Client",
            &ns,
            CLIENT,
        ))
        .await
        .expect("ListExporters with the rotated token")
        .into_inner();
    assert_eq!(
        listed
            .exporters
            .iter()
            .map(|e| e.name.as_str())
            .collect::<Vec<_>>(),
        [format!("namespaces/{ns}/exporters/{EXPORTER}")]
    );
    for t in [&lab.client_token, &rotated.token, &lab.exporter_token] {
        assert!(
            !lab.mgr.logs().contains(t.as_str()),
            "a token appears in the manager log"
        );
    }
}

// ---- OIDC, ServiceAccount tokens, provisioning and `jmp login` ----

/// The ConfigMap's `config` trusting `realm` (usernames `kc:<preferred_username>`, Keycloak's CA
/// as `certificateAuthority`).
fn oidc_config(
    kc: &keycloak::Keycloak,
    realm: &keycloak::Realm,
    k8s: bool,
    provision: bool,
) -> String {
    serde_saphyr::to_string(&serde_json::json!({
        "authentication": {
            "k8s": {"enabled": k8s},
            "jwt": [{
                "issuer": {"url": realm.issuer, "audiences": ["jumpstarter-cli"],
                           "certificateAuthority": kc.ca_pem},
                "claimMappings": {"username": {"claim": "preferred_username", "prefix": "kc:"}},
            }],
        },
        "provisioning": {"enabled": provision},
    }))
    .unwrap()
}

/// A Client whose `spec.username` is `username`.
async fn create_client(lab: &Lab, name: &str, username: &str) {
    let api: Api<ucm::exporter::crd::Client> = Api::namespaced(lab.env.client.clone(), &lab.env.ns);
    let c = serde_json::from_value(serde_json::json!({
        "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Client",
        "metadata": {"name": name}, "spec": {"username": username},
    }))
    .unwrap();
    api.create(&Default::default(), &c).await.unwrap();
}

/// ClientService.ListExporters as the Client `name` with `token`: the exporter names. On a
/// runtime of its own that ends with the call, so its connection is closed at once (a connection
/// left open would hold up the manager's graceful stop when the lab is dropped).
async fn list_as(lab: &Lab, token: &str, name: &str) -> Result<Vec<String>, tonic::Status> {
    use ucm::exporter::proto::jumpstarter::client::v1 as cpb;
    let (port, cert, ns) = (lab.grpc_port, lab.cert.clone(), lab.env.ns.clone());
    let (token, name) = (token.to_string(), name.to_string());
    tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
            let ch = Endpoint::from_shared(format!("https://localhost:{port}"))
                .unwrap()
                .tls_config(
                    ClientTlsConfig::new()
                        .ca_certificate(Certificate::from_pem(&cert))
                        .domain_name("localhost"),
                )
                .unwrap()
                .connect()
                .await
                .expect("connect to the controller gRPC port");
            let mut svc = cpb::client_service_client::ClientServiceClient::new(ch);
            let req = cpb::ListExportersRequest {
                parent: format!("namespaces/{ns}"),
                ..Default::default()
            };
            svc.list_exporters(authed(req, &token, "Client", &ns, &name))
                .await
                .map(|r| {
                    r.into_inner()
                        .exporters
                        .into_iter()
                        .map(|e| e.name.rsplit('/').next().unwrap_or_default().to_string())
                        .collect()
                })
        })
    })
    .await
    .unwrap()
}

/// A ServiceAccount in the lab's namespace and a token the API server issued for it.
fn service_account_token(lab: &Lab, sa: &str) -> String {
    let (ok, out) = kubectl(
        &lab.env.kubeconfig,
        &["create", "serviceaccount", sa, "-n", &lab.env.ns],
        None,
    );
    assert!(ok, "create serviceaccount: {out}");
    let (ok, out) = kubectl(
        &lab.env.kubeconfig,
        &["create", "token", sa, "-n", &lab.env.ns, "--duration=1h"],
        None,
    );
    assert!(ok, "create token: {out}");
    out.trim().to_string()
}

fn refused(r: Result<Vec<String>, tonic::Status>, code: tonic::Code, reason: &str, what: &str) {
    let e = r.expect_err(what);
    assert_eq!(e.code(), code, "{what}: {e:?}");
    assert!(e.message().contains(reason), "{what}: {e:?}");
}

/// The login service tells `jmp login` where to go; the real `jmp` 0.9.0 signs in to
/// Keycloak with the password grant and then lists exporters, leases one and runs `j power read`
/// through `ucm router` as that user. Tokens from another realm (issuer), for another audience,
/// expired, with a forged signature, or of a user with no Client, and a ServiceAccount token while
/// `k8s` is off, are refused with the gRPC code and reason; Keycloak's key rotation is picked up
/// without a restart; no token or password reaches the manager's log.
#[tokio::test]
#[ignore = "e2e: needs the local control plane, the pinned jumpstarter packages and Keycloak"]
async fn oidc_jmp_login_lease_and_refusals() {
    use tonic::Code;
    let kc = tokio::task::spawn_blocking(keycloak::shared).await.unwrap();
    let (realm, other) = tokio::task::spawn_blocking(|| {
        let kc = keycloak::shared();
        (
            kc.realm(&unique("lab"), &["alice", "bob"]),
            kc.realm(&unique("other"), &["alice"]),
        )
    })
    .await
    .unwrap();
    let lab = Lab::start_with(
        "oidc-login",
        "60s",
        Some(&oidc_config(kc, &realm, false, false)),
    )
    .await;
    create_client(&lab, "alice", "kc:alice").await;
    let _exporter = lab.start_exporter(1);
    lab.wait_available("registered, online and available").await;

    // The login service: upstream's fields, the CA the gRPC server presents, the issuer.
    let (code, body) = http_get(lab.login_port, "/v1/auth/config")
        .await
        .expect("login service");
    assert_eq!(code, 200, "{body}");
    let cfg: serde_json::Value = serde_json::from_str(&body).expect(&body);
    assert_eq!(
        cfg["grpcEndpoint"],
        format!("localhost:{}", lab.grpc_port),
        "{body}"
    );
    assert_eq!(cfg["namespace"], lab.env.ns.as_str(), "{body}");
    assert_eq!(
        cfg["caBundle"],
        base64::engine::general_purpose::STANDARD.encode(&lab.cert),
        "{body}"
    );
    assert_eq!(cfg["oidc"][0]["issuer"], realm.issuer.as_str(), "{body}");
    assert_eq!(cfg["oidc"][0]["clientId"], "jumpstarter-cli", "{body}");
    let (code, page) = http_get(lab.login_port, "/").await.unwrap();
    assert!(code == 200 && page.contains(&realm.issuer), "{page}");

    // `jmp login alice@<login service>` with the password grant, as a user runs it.
    let (ok, out, err) = lab
        .jmp_raw(
            &[
                "login".into(),
                format!("alice@http://127.0.0.1:{}", lab.login_port),
                "--username".into(),
                "alice".into(),
                "--password".into(),
                "pw-alice".into(),
                "--unsafe".into(),
                "--nointeractive".into(),
                "--insecure-tls".into(),
            ],
            &[
                ("SSL_CERT_FILE", &kc.ca_file),
                ("REQUESTS_CA_BUNDLE", &kc.ca_file),
            ],
        )
        .await;
    assert!(ok, "jmp login failed:\n{out}\n{err}");
    let alice_cfg = lab
        .dir
        .path()
        .join("home/.config/jumpstarter/clients/alice.yaml");
    let saved: serde_json::Value = serde_saphyr::from_str(
        &std::fs::read_to_string(&alice_cfg).expect("jmp login saved no config"),
    )
    .unwrap();
    assert_eq!(saved["endpoint"], format!("localhost:{}", lab.grpc_port));
    assert_eq!(saved["metadata"]["name"], "alice");
    assert_eq!(saved["metadata"]["namespace"], lab.env.ns.as_str());
    let alice = saved["token"].as_str().unwrap().to_string();
    assert_eq!(keycloak_claim(&alice, "iss"), realm.issuer);

    let (ok, out, err) = lab
        .jmp_as(&alice_cfg, &["get", "exporters", "-o", "json"])
        .await;
    assert!(ok, "jmp get exporters as alice failed:\n{out}\n{err}");
    assert!(out.contains(EXPORTER), "{out}");
    let lease_name = lab.create_lease_as(&alice_cfg, " as alice").await;
    assert_eq!(
        lab.leases()
            .get(&lease_name)
            .await
            .unwrap()
            .spec
            .client_ref
            .name,
        "alice"
    );
    lab.wait_exporter(TIMEOUT, "leased and ready", |e| {
        lease_ref(e).as_deref() == Some(lease_name.as_str())
            && exporter_status(e) == Some(ExporterStatusValue::LeaseReady)
    })
    .await;
    let (ok, out, err) = lab
        .jmp_as(
            &alice_cfg,
            &[
                "shell",
                "--lease",
                &lease_name,
                "--",
                "j",
                "power",
                "read",
                "-n",
                "1",
            ],
        )
        .await;
    assert!(
        ok,
        "jmp shell as alice failed:\nstdout:\n{out}\nstderr:\n{err}"
    );
    assert!(out.contains("voltage=5.0 V  current=2.0 A"), "{out}\n{err}");
    assert!(
        lab.router.logs().contains("streams paired"),
        "not through ucm router"
    );
    let (ok, out, err) = lab
        .jmp_as(&alice_cfg, &["delete", "leases", &lease_name])
        .await;
    assert!(ok, "jmp delete leases as alice failed:\n{out}\n{err}");

    // Refusals. The 1 s token is taken first so it has expired (beyond the skew) by its turn.
    let (short, bob, foreign, wrong_aud) = tokio::task::spawn_blocking({
        let (r, o) = (realm.issuer.clone(), other.issuer.clone());
        move || {
            let kc = keycloak::shared();
            let realm = |i: &str| keycloak::Realm {
                name: i.rsplit('/').next().unwrap().into(),
                issuer: i.into(),
            };
            (
                kc.token(&realm(&r), "short-cli", "alice"),
                kc.token(&realm(&r), "jumpstarter-cli", "bob"),
                kc.token(&realm(&o), "jumpstarter-cli", "alice"),
                kc.token(&realm(&r), "other-cli", "alice"),
            )
        }
    })
    .await
    .unwrap();
    let taken = Instant::now();
    assert_eq!(
        list_as(&lab, &alice, "alice").await.unwrap(),
        vec![EXPORTER.to_string()]
    );
    refused(
        list_as(&lab, &foreign, "alice").await,
        Code::Unauthenticated,
        "issuer is not trusted",
        "another realm",
    );
    refused(
        list_as(&lab, &wrong_aud, "alice").await,
        Code::Unauthenticated,
        "audience is wrong",
        "another audience",
    );
    let forged = format!(
        "{}.{}",
        alice.rsplit_once('.').unwrap().0,
        bob.rsplit_once('.').unwrap().1
    );
    refused(
        list_as(&lab, &forged, "alice").await,
        Code::Unauthenticated,
        "signature does not verify",
        "a forged signature",
    );
    // An external identity names the object its username stands for, or leaves the name empty
    // for it to be derived (upstream v0.9.0); any other name is refused.
    assert_eq!(
        list_as(&lab, &alice, "").await.unwrap(),
        vec![EXPORTER.to_string()]
    );
    refused(
        list_as(&lab, &alice, "alice-dev").await,
        Code::InvalidArgument,
        "resource name mismatch",
        "alice naming another object",
    );
    refused(
        list_as(&lab, &bob, "alice").await,
        Code::InvalidArgument,
        "resource name mismatch",
        "bob as alice's Client",
    );
    refused(
        list_as(&lab, &bob, "bob").await,
        Code::PermissionDenied,
        "not authorized",
        "bob with no Client",
    );
    let sa = service_account_token(&lab, "ci");
    refused(
        list_as(&lab, &sa, "alice").await,
        Code::Unauthenticated,
        "issuer is not trusted",
        "a ServiceAccount token, k8s off",
    );
    let due =
        Duration::from_secs(1) + ucm::exporter::auth::oidc::CLOCK_SKEW + Duration::from_secs(1);
    tokio::time::sleep(due.saturating_sub(taken.elapsed())).await;
    refused(
        list_as(&lab, &short, "alice").await,
        Code::Unauthenticated,
        "expired",
        "an expired token",
    );

    // Rotation: new tokens carry the new key's kid and work without a restart (after at most
    // the refresh interval); the removed key's tokens stop working.
    let fresh = tokio::task::spawn_blocking({
        let r = realm.issuer.clone();
        let name = realm.name.clone();
        move || {
            let kc = keycloak::shared();
            let realm = keycloak::Realm { name, issuer: r };
            kc.rotate_key(&realm);
            kc.token(&realm, "jumpstarter-cli", "alice")
        }
    })
    .await
    .unwrap();
    assert_ne!(
        keycloak::kid(&fresh),
        keycloak::kid(&alice),
        "the key did not rotate"
    );
    let rotated = Instant::now();
    eventually(
        TIMEOUT,
        "a token signed with the rotated key to be accepted",
        || async { list_as(&lab, &fresh, "alice").await.is_ok() },
    )
    .await;
    eprintln!("rotated key accepted after {:?}", rotated.elapsed());
    refused(
        list_as(&lab, &alice, "alice").await,
        Code::Unauthenticated,
        "unknown key",
        "the removed key",
    );

    let logs = lab.mgr.logs();
    for (what, secret) in [
        ("alice's token", alice.as_str()),
        ("bob's token", &bob),
        ("the SA token", &sa),
        ("the forged token", &forged),
        ("a password", "pw-alice"),
    ] {
        let sig = secret.rsplit('.').next().unwrap();
        assert!(!logs.contains(sig), "{what} appears in the manager log");
    }
    eprintln!("Keycloak start-up took {:?}", kc.startup);
    let stopping = Instant::now();
    drop(lab);
    eprintln!("lab stopped in {:?}", stopping.elapsed());
}

/// With `provisioning.enabled`, a signed-in user naming a Client that does not exist
/// gets one (spec.username = their username, credentials minted as for any Client); with
/// `authentication.k8s.enabled`, a ServiceAccount token is accepted through a TokenReview for the
/// Client whose username is the ServiceAccount's, and a token the API server rejects is refused.
#[tokio::test]
#[ignore = "e2e: needs the local control plane, the pinned jumpstarter packages and Keycloak"]
async fn oidc_provisioning_and_service_account_tokens() {
    use tonic::Code;
    let kc = tokio::task::spawn_blocking(keycloak::shared).await.unwrap();
    let realm =
        tokio::task::spawn_blocking(|| keycloak::shared().realm(&unique("prov"), &["carol"]))
            .await
            .unwrap();
    let lab = Lab::start_with(
        "oidc-prov",
        "60s",
        Some(&oidc_config(kc, &realm, true, true)),
    )
    .await;
    let carol = tokio::task::spawn_blocking({
        let (name, issuer) = (realm.name.clone(), realm.issuer.clone());
        move || {
            keycloak::shared().token(
                &keycloak::Realm { name, issuer },
                "jumpstarter-cli",
                "carol",
            )
        }
    })
    .await
    .unwrap();
    let clients: Api<ucm::exporter::crd::Client> =
        Api::namespaced(lab.env.client.clone(), &lab.env.ns);
    assert!(clients.get_opt("carol").await.unwrap().is_none());
    // `jmp login --name ""` sends an empty name: it is derived from the username kc:carol.
    assert_eq!(
        list_as(&lab, &carol, "").await.unwrap(),
        vec![EXPORTER.to_string()]
    );
    let made = clients
        .get("carol")
        .await
        .expect("the Client was not provisioned");
    assert_eq!(made.spec.username.as_deref(), Some("kc:carol"));
    // A provisioned Client is an ordinary one: the reconciler mints its credential.
    let secrets: Api<Secret> = Api::namespaced(lab.env.client.clone(), &lab.env.ns);
    secret_data(&secrets, "carol-client", "token").await;
    // The internal Client "dev" is someone else's: carol cannot take it over.
    refused(
        list_as(&lab, &carol, CLIENT).await,
        Code::InvalidArgument,
        "resource name mismatch",
        "carol as dev",
    );

    let sa = service_account_token(&lab, "ci");
    create_client(
        &lab,
        "ci-runner",
        &format!("system:serviceaccount:{}:ci", lab.env.ns),
    )
    .await;
    assert_eq!(
        list_as(&lab, &sa, "ci-runner").await.unwrap(),
        vec![EXPORTER.to_string()]
    );
    refused(
        list_as(&lab, &sa, CLIENT).await,
        Code::PermissionDenied,
        "not authorized",
        "the SA as dev",
    );
    refused(
        list_as(&lab, "not-a-token", "ci-runner").await,
        Code::Unauthenticated,
        "did not accept",
        "garbage under k8s",
    );
    assert!(
        !lab.mgr.logs().contains(sa.rsplit('.').next().unwrap()),
        "the SA token appears in the manager log"
    );
    let stopping = Instant::now();
    drop(lab);
    eprintln!("lab stopped in {:?}", stopping.elapsed());
}

/// One claim of a JWT (test-side decoding, no verification).
fn keycloak_claim(token: &str, claim: &str) -> String {
    let p = token.split('.').nth(1).unwrap();
    let v: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(p)
            .unwrap(),
    )
    .unwrap();
    v[claim].as_str().unwrap_or_default().to_string()
}

/// Invalid authentication configurations: each keeps the exporter feature unready with a
/// readiness message naming the field (the manager keeps running and re-reads the ConfigMap),
/// and a fixed ConfigMap makes it ready. One manager walks through every form.
#[tokio::test]
#[ignore = "e2e: needs the local control plane"]
async fn oidc_config_invalid_forms_are_reported() {
    let env = TestEnv::new("oidc-bad-config").await;
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(env.client.clone(), &env.ns);
    let jwt = |entry: &str| format!("authentication:\n  jwt:\n  - {entry}\n");
    let user = "claimMappings: {username: {claim: sub, prefix: 'kc:'}}";
    let cases: Vec<(String, &str)> = vec![
        (
            jwt("issuer: {audiences: [x]}"),
            "authentication.jwt[0].issuer.url is required",
        ),
        (
            jwt(&format!(
                "issuer: {{url: http://kc.example, audiences: [x]}}\n    {user}"
            )),
            "authentication.jwt[0].issuer.url \"http://kc.example\" must be an https:// URL",
        ),
        (
            jwt(&format!("issuer: {{url: https://kc.example}}\n    {user}")),
            "authentication.jwt[0].issuer.audiences must list at least one non-empty audience",
        ),
        (
            jwt(&format!(
                "issuer: {{url: https://kc.example, audiences: [a, b]}}\n    {user}"
            )),
            "authentication.jwt[0].issuer.audienceMatchPolicy must be MatchAny",
        ),
        (
            jwt(&format!(
                "issuer: {{url: https://kc.example, audiences: [x], clientID: y}}\n    {user}"
            )),
            "unknown field `clientID`",
        ),
        (
            jwt(&format!(
                "issuer: {{url: https://kc.example, audiences: [x], certificateAuthority: \"-----BEGIN CERTIFICATE-----\\nbm90IGEgY2VydA==\\n-----END CERTIFICATE-----\\n\"}}\n    {user}"
            )),
            "authentication.jwt[0].issuer.certificateAuthority: not a usable certificate",
        ),
        (
            jwt(
                "issuer: {url: https://kc.example, audiences: [x]}\n    claimMappings: {username: {claim: sub}}",
            ),
            "authentication.jwt[0].claimMappings.username.prefix is required",
        ),
        (
            jwt("issuer: {url: https://kc.example, audiences: [x]}"),
            "authentication.jwt[0].claimMappings.username.claim (or expression) is required",
        ),
        (
            jwt(
                "issuer: {url: https://kc.example, audiences: [x]}\n    claimMappings: {username: {expression: 'claims.email + \"@x\"'}}",
            ),
            "authentication.jwt[0].claimMappings.username.expression",
        ),
        (
            jwt(
                "issuer: {url: https://kc.example, audiences: [x]}\n    claimMappings: {username: {claim: sub, prefix: 'internal:'}}",
            ),
            "authentication.jwt[0].claimMappings.username.prefix \"internal:\" overlaps the internal prefix",
        ),
        (
            jwt(&format!(
                "issuer: {{url: https://kc.example, audiences: [x]}}\n    {user}\n    claimValidationRules: [{{expression: 'claims.hd == \"x\"'}}]"
            )),
            "authentication.jwt[0].claimValidationRules[0].expression",
        ),
        (
            jwt(&format!(
                "issuer: {{url: https://kc.example, audiences: [x]}}\n    {user}\n    userValidationRules: [{{expression: 'true'}}]"
            )),
            "authentication.jwt[0].userValidationRules (CEL) is not supported",
        ),
        (
            jwt(
                "issuer: {url: https://kc.example, audiences: [x]}\n    claimMappings: {username: {claim: sub, prefix: ''}, extra: [{key: a, valueExpression: 'claims.a'}]}",
            ),
            "authentication.jwt[0].claimMappings.extra is not supported",
        ),
        (
            format!(
                "{}  - issuer: {{url: https://kc.example, audiences: [y]}}\n    {user}\n",
                jwt(&format!(
                    "issuer: {{url: https://kc.example, audiences: [x]}}\n    {user}"
                ))
            ),
            "authentication.jwt[1].issuer.url \"https://kc.example\" is configured twice",
        ),
        (
            "authentication:\n  k8s:\n    enabled: sometimes\n".into(),
            "authentication.k8s.enabled: invalid boolean",
        ),
        (
            "provisioning:\n  enabled: 1\n".into(),
            "provisioning.enabled: invalid boolean",
        ),
    ];
    let cm = |config: &str| -> k8s_openapi::api::core::v1::ConfigMap {
        serde_json::from_value(
            serde_json::json!({"metadata": {"name": "jumpstarter-controller"},
                                                   "data": {"config": config}}),
        )
        .unwrap()
    };
    cms.create(&Default::default(), &cm(&cases[0].0))
        .await
        .unwrap();
    let m = Manager::start(
        ManagerOpts::new(&env.kubeconfig, &env.ns)
            .only("exporter")
            .args([
                format!("--exporter-grpc-bind-address=127.0.0.1:{}", free_port()),
                format!("--exporter-login-bind-address=127.0.0.1:{}", free_port()),
            ]),
    );
    for (config, want) in &cases {
        cms.replace("jumpstarter-controller", &Default::default(), &cm(config))
            .await
            .unwrap();
        let start = Instant::now();
        loop {
            let r = m.readyz().await;
            if let Some((503, body)) = &r
                && body.contains(
                    "[-]feature-exporter failed: ConfigMap jumpstarter-controller, key config:",
                )
                && body.contains(want)
            {
                break;
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "{config}: want {want:?}; last /readyz: {r:?}\n{}",
                m.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let fixed = jwt(
        "issuer: {url: https://kc.example, audiences: [x]}\n    claimMappings: {username: {expression: claims.email}}",
    );
    cms.replace("jumpstarter-controller", &Default::default(), &cm(&fixed))
        .await
        .unwrap();
    m.wait_ready().await;
    assert!(!m.logs().contains("panicked"), "{}", m.logs());
}

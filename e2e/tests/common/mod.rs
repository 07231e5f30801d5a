//! The e2e fixture (docs/architecture.md, "Tests, benchmarks and fuzzing"): one real control plane
//! per test process (or the one named by `UCM_E2E_KUBECONFIG`), a fresh namespace per test, ucm's
//! CRDs installed once, the manager as a real subprocess, and control planes of a test's own for
//! tests that restart or strip the API. A missing prerequisite fails loudly; nothing is skipped.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{
        core::v1::{Namespace, ServiceAccount},
        rbac::v1::ClusterRoleBinding,
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    apimachinery::pkg::apis::meta::v1::Condition,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{conditions, wait::await_condition},
};
use ucm::exporter::crd::{Exporter, ExporterStatusValue};

pub const TIMEOUT: Duration = Duration::from_secs(60);

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn kharness_bin() -> PathBuf {
    let p = repo_root().join("e2e/bin/kharness");
    assert!(
        p.exists(),
        "{} is missing: run `make cluster` (needs Go) before the e2e tests",
        p.display()
    );
    p
}

pub fn kubectl_bin() -> PathBuf {
    let p = repo_root().join("e2e/bin/kubectl");
    assert!(p.exists(), "{} is missing: run `make cluster`", p.display());
    p
}

/// A running `kharness serve`. Dropping it (or the test process dying, which closes the stdin
/// pipe) stops the control plane.
pub struct Harness {
    pub kubeconfig: PathBuf,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    _tmp: Option<tempfile::TempDir>,
}

impl Harness {
    /// Starts a control plane (always with kube-controller-manager) in `dir`. With `keep`, the
    /// directory survives for a restart on the same data and ports.
    pub fn start_in(dir: &Path, rm_dir: bool) -> Harness {
        Harness::start_with(dir, rm_dir, &[])
    }

    /// As [`Harness::start_in`], with extra kube-apiserver flags (e.g. an audit log).
    pub fn start_with(dir: &Path, rm_dir: bool, apiserver_args: &[String]) -> Harness {
        std::fs::create_dir_all(dir.parent().unwrap_or(dir)).unwrap();
        let log_path = dir.with_extension("log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap();
        let mut args = vec![
            "serve".to_string(),
            "--dir".into(),
            dir.display().to_string(),
            "--with-kcm".into(),
            "--exit-on-stdin-eof".into(),
        ];
        if rm_dir {
            args.push("--rm-dir".into());
        }
        if !apiserver_args.is_empty() {
            args.push("--".into());
            args.extend(apiserver_args.iter().cloned());
        }
        let mut child = Command::new(kharness_bin())
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start kharness: {e}"));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next();
            let _ = tx.send(first);
            for _ in lines {}
        });
        let line = match rx.recv_timeout(Duration::from_secs(180)) {
            Ok(Some(Ok(l))) => l,
            other => {
                let _ = child.kill();
                let logs = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: String = logs
                    .lines()
                    .rev()
                    .take(40)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                panic!(
                    "kharness did not print READY ({other:?}); last log lines from {}:\n{tail}",
                    log_path.display()
                );
            }
        };
        let kubeconfig = PathBuf::from(
            line.strip_prefix("READY ")
                .unwrap_or_else(|| panic!("unexpected kharness output: {line}")),
        );
        let stdin = child.stdin.take();
        Harness {
            kubeconfig,
            child: Some(child),
            stdin,
            _tmp: None,
        }
    }

    /// A control plane of the test's own, in a temporary directory.
    pub fn start_own() -> Harness {
        let tmp = tempfile::Builder::new()
            .prefix("ucm-e2e-own-")
            .tempdir()
            .unwrap();
        let mut h = Harness::start_in(&tmp.path().join("cluster"), false);
        h._tmp = Some(tmp);
        h
    }

    /// A control plane of the test's own whose API server writes an audit log (JSON, metadata
    /// level) of every request made by a ServiceAccount: the API server's own count of what the
    /// manager sent, independent of anything the manager reports.
    pub fn start_audited() -> (Harness, Audit) {
        let tmp = tempfile::Builder::new()
            .prefix("ucm-e2e-audit-")
            .tempdir()
            .unwrap();
        let policy = tmp.path().join("audit-policy.yaml");
        let log = tmp.path().join("audit.log");
        std::fs::write(
            &policy,
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [\"RequestReceived\"]\nrules:\n\
             - level: Metadata\n  userGroups: [\"system:serviceaccounts\"]\n- level: None\n",
        )
        .unwrap();
        let args = [
            format!("--audit-policy-file={}", policy.display()),
            format!("--audit-log-path={}", log.display()),
            "--audit-log-format=json".into(),
            "--audit-log-maxsize=0".into(),
            "--audit-log-mode=blocking".into(),
        ];
        let mut h = Harness::start_with(&tmp.path().join("cluster"), false, &args);
        h._tmp = Some(tmp);
        (h, Audit { path: log })
    }

    /// SIGTERM and wait: every child stops, ports are freed.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        signal(child.id(), "TERM");
        let status = wait_timeout(&mut child, Duration::from_secs(60));
        self.stdin.take();
        status
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop();
    }
}

/// An API server audit log (see [`Harness::start_audited`]).
pub struct Audit {
    pub path: PathBuf,
}

/// One request as the API server audited it.
#[derive(Debug, Clone)]
pub struct AuditedRequest {
    pub user: String,
    pub verb: String,
    pub resource: String,
    pub name: String,
    pub code: u16,
    /// Path and query, e.g. a list's `limit` and `continue`.
    pub uri: String,
}

impl AuditedRequest {
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }
}

impl Audit {
    /// The log's current length: requests after it are [`Audit::since`] it.
    pub fn offset(&self) -> u64 {
        std::fs::metadata(&self.path).map(|m| m.len()).unwrap_or(0)
    }

    /// Every completed request logged after `offset`.
    pub fn since(&self, offset: u64) -> Vec<AuditedRequest> {
        let text = std::fs::read(&self.path).unwrap_or_default();
        let tail = &text[(offset as usize).min(text.len())..];
        String::from_utf8_lossy(tail)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["stage"] == "ResponseComplete")
            .map(|e| AuditedRequest {
                user: e["user"]["username"].as_str().unwrap_or("").into(),
                verb: e["verb"].as_str().unwrap_or("").into(),
                resource: e["objectRef"]["resource"].as_str().unwrap_or("").into(),
                name: e["objectRef"]["name"].as_str().unwrap_or("").into(),
                code: e["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
                uri: e["requestURI"].as_str().unwrap_or("").into(),
            })
            .collect()
    }
}

/// CPU time (user + system) a process has used so far, from /proc/<pid>/stat.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/stat: {e}"));
    // Fields after the command name (which may hold spaces), from field 3 on.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // USER_HZ is 100 on every Linux this runs on.
    Duration::from_millis(ticks * 10)
}

/// The shared control plane's kubeconfig, once [`shared_kubeconfig`] has been asked for it.
static SHARED: OnceLock<PathBuf> = OnceLock::new();

/// The shared control plane of the test process: `UCM_E2E_KUBECONFIG`, else one started here and
/// kept alive (stdin pipe) until the process exits.
pub fn shared_kubeconfig() -> PathBuf {
    static KEEP: Mutex<Option<Harness>> = Mutex::new(None);
    SHARED
        .get_or_init(|| {
            if let Ok(kc) = std::env::var("UCM_E2E_KUBECONFIG").map(|s| s.trim().to_string())
                && !kc.is_empty()
            {
                return PathBuf::from(kc);
            }
            let tmp = tempfile::Builder::new()
                .prefix("ucm-e2e-")
                .tempdir()
                .unwrap()
                .keep();
            let h = Harness::start_in(&tmp.join("cluster"), true);
            let kc = h.kubeconfig.clone();
            *KEEP.lock().unwrap() = Some(h);
            // Statics are never dropped: the harness ends when our stdin pipe closes at exit.
            std::mem::forget(KEEP.lock().unwrap().take());
            kc
        })
        .clone()
}

pub async fn client_for(kubeconfig: &Path) -> Client {
    let kc = Kubeconfig::read_from(kubeconfig)
        .unwrap_or_else(|e| panic!("kubeconfig {}: {e}", kubeconfig.display()));
    let cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(cfg).unwrap()
}

/// MiroirSnapshot and MiroirVolume are cluster-scoped, so `--watch-namespace` cannot keep one
/// manager's snapshot coordinator away from another test's snapshots (docs/snapshot.md, "Testing":
/// one coordinator at a time on the shared cluster). Every test that runs the snapshot feature on
/// the shared cluster holds this lock: exclusively ([`sole_snapshot_coordinator`]) when it drives
/// snapshot rounds and checks them, shared ([`snapshot_coordinator`]) when the feature only runs
/// beside what it tests. [`Manager::start`] refuses such a manager while nobody holds it.
static SNAPSHOT_COORDINATORS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// For a test that must be the only snapshot coordinator on the shared cluster.
pub async fn sole_snapshot_coordinator() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    SNAPSHOT_COORDINATORS.write().await
}

/// For a test whose managers run the snapshot feature on the shared cluster beside other such
/// tests, never beside a [`sole_snapshot_coordinator`].
pub async fn snapshot_coordinator() -> tokio::sync::RwLockReadGuard<'static, ()> {
    SNAPSHOT_COORDINATORS.read().await
}

/// Installs every ucm CRD with SSA (field manager `ucm-e2e`) and waits until Established.
pub async fn install_crds(client: &Client) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crds: Vec<_> = ucm::FEATURES
        .iter()
        .flat_map(|f| f.installed_crds())
        .collect();
    for crd in &crds {
        apply_crd(&api, crd).await;
    }
    for crd in &crds {
        wait_established(&api, &crd.name_any()).await;
    }
}

pub async fn apply_crd(api: &Api<CustomResourceDefinition>, crd: &CustomResourceDefinition) {
    let mut body = serde_json::to_value(crd).unwrap();
    body["apiVersion"] = "apiextensions.k8s.io/v1".into();
    body["kind"] = "CustomResourceDefinition".into();
    api.patch(
        &crd.name_any(),
        &PatchParams::apply("ucm-e2e").force(),
        &Patch::Apply(body),
    )
    .await
    .unwrap_or_else(|e| panic!("the API server refused CRD {}: {e}", crd.name_any()));
}

pub async fn wait_established(api: &Api<CustomResourceDefinition>, name: &str) {
    tokio::time::timeout(
        TIMEOUT,
        await_condition(api.clone(), name, conditions::is_crd_established()),
    )
    .await
    .unwrap_or_else(|_| panic!("CRD {name} not Established within {TIMEOUT:?}"))
    .unwrap();
}

/// The shared cluster with ucm's CRDs installed, plus a fresh namespace whose `default`
/// ServiceAccount exists. The namespace is deleted (best effort) when the guard drops.
pub struct TestEnv {
    pub client: Client,
    pub kubeconfig: PathBuf,
    pub ns: String,
}

impl TestEnv {
    pub async fn new(test: &str) -> TestEnv {
        let kubeconfig = tokio::task::spawn_blocking(shared_kubeconfig)
            .await
            .unwrap();
        let client = client_for(&kubeconfig).await;
        static CRDS: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        // Each test has its own tokio runtime; the install is idempotent, so a second install
        // in another runtime is harmless, but one per process is enough.
        CRDS.get_or_init(|| async { install_crds(&client).await })
            .await;
        let ns = create_namespace(&client, test).await;
        TestEnv {
            client,
            kubeconfig,
            ns,
        }
    }

    pub fn user_kubeconfig(&self) -> PathBuf {
        self.kubeconfig.with_file_name("kubeconfig-user")
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let client = self.client.clone();
        let ns = self.ns.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = Api::<Namespace>::all(client.clone())
                    .delete(&ns, &DeleteParams::default())
                    .await;
                // The shipped identity's ClusterRoleBindings are cluster-scoped: no namespace GC.
                let _ = Api::<ClusterRoleBinding>::all(client)
                    .delete_collection(
                        &DeleteParams::default(),
                        &ListParams::default().labels(&format!("{E2E_NS_LABEL}={ns}")),
                    )
                    .await;
            });
        }
    }
}

pub fn unique(prefix: &str) -> String {
    let short: String = prefix
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(30)
        .collect::<String>()
        .to_lowercase();
    format!("{short}-{:06x}", rand::random::<u32>() & 0xffffff)
}

pub async fn create_namespace(client: &Client, test: &str) -> String {
    let name = unique(&format!("ucm-e2e-{test}"));
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
    eventually(
        TIMEOUT,
        "the namespace's default ServiceAccount",
        || async { sas.get_opt("default").await.ok().flatten().is_some() },
    )
    .await;
    name
}

/// Polls `check` until true; panics naming `what` after `timeout`. Assertions only: never a
/// substitute for synchronisation inside the product.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return;
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A port for a server a test starts: free when asked, never handed out twice in this process,
/// and below the kernel's ephemeral range. A port from that range (what binding port 0 gives)
/// can meanwhile become the local port of any outgoing connection, so the server's bind fails,
/// and a connect to it before the server listens can connect to itself.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    const LOW: u32 = 10_000;
    let span = ephemeral_low.saturating_sub(LOW);
    assert!(
        span >= 1_000,
        "the ephemeral port range starts at {ephemeral_low}: no room below it for test servers"
    );
    // Processes started together (the suite, a bench) begin at different offsets.
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let port = (LOW + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{ephemeral_low}");
}

pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

/// Waits up to `timeout` for `child` to exit; None (still running) after that.
pub fn wait_child(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if start.elapsed() > timeout {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// [`wait_child`], killing the child when it does not exit in time.
fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    wait_child(child, timeout).or_else(|| {
        let _ = child.kill();
        child.wait().ok()
    })
}

/// Sends `sig` and waits up to `timeout` for the exit, then kills: how every spawned process
/// (manager, agents, servers) is stopped.
pub fn stop_child(child: &mut Child, sig: &str, timeout: Duration) {
    signal(child.id(), sig);
    wait_timeout(child, timeout);
}

/// The last `lines` lines of a log file (empty when unreadable), for failure messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<_> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `key` of Secret `name`, once the Secret has it.
pub async fn secret_data(
    api: &Api<k8s_openapi::api::core::v1::Secret>,
    name: &str,
    key: &str,
) -> Vec<u8> {
    eventually(TIMEOUT, &format!("Secret {name}"), || async {
        api.get_opt(name)
            .await
            .ok()
            .flatten()
            .is_some_and(|s| s.data.is_some_and(|d| d.contains_key(key)))
    })
    .await;
    api.get(name).await.unwrap().data.unwrap()[key].0.clone()
}

/// `ucm manager` as a real subprocess. Dropping it sends SIGTERM and waits.
pub struct Manager {
    child: Option<Child>,
    pub metrics_port: u16,
    pub health_port: u16,
    pub log_path: PathBuf,
    shipped_identity: bool,
    _tmp: tempfile::TempDir,
}

pub struct ManagerOpts<'a> {
    pub kubeconfig: &'a Path,
    /// The manager's namespace (and, unless `watch_all`, the only watched one).
    pub namespace: &'a str,
    pub watch_all: bool,
    /// `--leader-elect --leader-election-id <id>` when set.
    pub lease: Option<&'a str>,
    pub extra: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Authenticate as the shipped identity (the default) or use `kubeconfig` as it is.
    pub shipped_identity: bool,
    /// The shipped identity's ServiceAccount name (default: one per feature set).
    pub service_account: Option<String>,
}

impl<'a> ManagerOpts<'a> {
    pub fn new(kubeconfig: &'a Path, namespace: &'a str) -> Self {
        ManagerOpts {
            kubeconfig,
            namespace,
            watch_all: false,
            lease: None,
            extra: vec![],
            env: vec![],
            shipped_identity: true,
            service_account: None,
        }
    }

    /// Run as the shipped identity under a ServiceAccount of this name, so the API server's
    /// audit log tells this manager's requests from another's.
    pub fn service_account(mut self, name: &str) -> Self {
        self.service_account = Some(name.into());
        self
    }

    /// Run with `kubeconfig`'s own credentials instead of the shipped identity (for tests that
    /// bring an identity of their own).
    pub fn kubeconfig_as_is(mut self) -> Self {
        self.shipped_identity = false;
        self
    }

    /// The features this manager runs: registered ones not switched off by an `--enable-<f>=false`.
    fn enabled_features(&self) -> Vec<&'static str> {
        ucm::FEATURES
            .iter()
            .map(|f| f.name)
            .filter(|name| {
                let flag = format!("--enable-{name}=");
                let last = self.extra.iter().rev().find_map(|a| a.strip_prefix(&flag));
                last != Some("false")
            })
            .collect()
    }

    pub fn lease(mut self, id: &'a str) -> Self {
        self.lease = Some(id);
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: Into<String>>(mut self, args: I) -> Self {
        self.extra.extend(args.into_iter().map(Into::into));
        self
    }

    /// Only `feature` enabled, every other feature off (through the registry).
    pub fn only(self, feature: &str) -> Self {
        let flags: Vec<String> = ucm::FEATURES
            .iter()
            .map(|f| format!("--enable-{}={}", f.name, f.name == feature))
            .collect();
        self.args(flags)
    }
}

impl Manager {
    pub fn start(opts: ManagerOpts<'_>) -> Manager {
        let tmp = tempfile::Builder::new()
            .prefix("ucm-manager-")
            .tempdir()
            .unwrap();
        let log_path = tmp.path().join("manager.log");
        if opts.enabled_features().contains(&"snapshot")
            && SHARED.get().is_some_and(|kc| kc == opts.kubeconfig)
        {
            assert!(
                SNAPSHOT_COORDINATORS.try_write().is_err(),
                "a manager running the snapshot feature on the shared cluster needs \
                 common::snapshot_coordinator() or common::sole_snapshot_coordinator() held \
                 for the test"
            );
        }
        let kubeconfig = if opts.shipped_identity {
            shipped_identity(
                opts.kubeconfig,
                opts.namespace,
                &opts.enabled_features(),
                opts.service_account.as_deref(),
                tmp.path(),
            )
        } else {
            opts.kubeconfig.to_path_buf()
        };
        let metrics_port = free_port();
        let health_port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ucm"));
        cmd.arg("manager")
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--namespace={}", opts.namespace))
            .arg(format!("--metrics-bind-address=127.0.0.1:{metrics_port}"))
            .arg(format!(
                "--health-probe-bind-address=127.0.0.1:{health_port}"
            ))
            .env_remove("RUST_LOG")
            .env_remove("POD_NAMESPACE")
            .env_remove("WATCH_NAMESPACE");
        // Parallel managers must not fight over the exporter's default gRPC (:8082) and login
        // (:8086) ports. The advertised endpoint keeps its default unless a test sets it.
        if ucm::FEATURES.iter().any(|f| f.name == "exporter") {
            for flag in [
                "--exporter-grpc-bind-address",
                "--exporter-login-bind-address",
            ] {
                if !opts.extra.iter().any(|a| a.starts_with(flag)) {
                    cmd.arg(format!("{flag}=127.0.0.1:{}", free_port()));
                }
            }
        }
        // A test may ask for another level (e.g. trace, to check what the logs never contain).
        if !opts.extra.iter().any(|a| a.starts_with("--log-level")) {
            cmd.arg("--log-level=info,ucm=debug");
        }
        if !opts.watch_all {
            cmd.arg(format!("--watch-namespace={}", opts.namespace));
        }
        if let Some(id) = opts.lease {
            cmd.arg("--leader-elect")
                .arg(format!("--leader-election-id={id}"));
        }
        cmd.args(&opts.extra);
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let log = std::fs::File::create(&log_path).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start ucm manager");
        Manager {
            child: Some(child),
            metrics_port,
            health_port,
            log_path,
            shipped_identity: opts.shipped_identity,
            _tmp: tmp,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub async fn get(&self, port: u16, path: &str) -> Option<(u16, String)> {
        http_get(port, path).await
    }

    pub async fn readyz(&self) -> Option<(u16, String)> {
        http_get(self.health_port, "/readyz?verbose").await
    }

    pub async fn metrics(&self) -> String {
        http_get(self.metrics_port, "/metrics")
            .await
            .map(|r| r.1)
            .unwrap_or_default()
    }

    pub async fn wait_ready(&self) {
        let start = Instant::now();
        loop {
            if let Some((200, _)) = self.readyz().await {
                return;
            }
            if start.elapsed() > TIMEOUT {
                panic!(
                    "manager not ready within {TIMEOUT:?}: {:?}\nlogs:\n{}",
                    self.readyz().await,
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn signal(&self, sig: &str) {
        signal(self.pid(), sig);
    }

    /// Waits for exit (after a signal) and returns the exit status.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        wait_timeout(&mut child, timeout).expect("exit status")
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, "TERM", Duration::from_secs(40));
        }
        if std::thread::panicking() {
            eprintln!(
                "---- manager log ({}) ----\n{}",
                self.log_path.display(),
                self.logs()
            );
        } else if self.shipped_identity {
            // Every e2e test doubles as the RBAC proof: a request the shipped roles refuse fails it.
            let logs = self.logs();
            if let Some(line) = logs.lines().find(|l| l.contains("forbidden")) {
                panic!("the shipped roles refused the manager a request:\n{line}");
            }
        }
    }
}

/// A minimal HTTP/1.1 GET over loopback (the admin endpoints are plain HTTP).
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    Some((code, dechunk(&body)))
}

fn dechunk(body: &str) -> String {
    // axum answers small bodies with Content-Length; chunked bodies are rare here but handled.
    let mut out = String::new();
    let mut rest = body;
    loop {
        let Some((size_line, after)) = rest.split_once("\r\n") else {
            return body.to_string();
        };
        let Ok(size) = usize::from_str_radix(size_line.trim(), 16) else {
            return body.to_string();
        };
        if size == 0 {
            return out;
        }
        if after.len() < size {
            return body.to_string();
        }
        out.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
}

/// Runs the e2e kubectl against a kubeconfig; returns (success, stdout+stderr).
pub fn kubectl(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> (bool, String) {
    let mut child = Command::new(kubectl_bin())
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl");
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let mut text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut err = String::new();
    let _ = (&out.stderr[..]).read_to_string(&mut err);
    text.push_str(&err);
    (out.status.success(), text)
}

/// Labels the shipped identity's cluster-scoped bindings with the test namespace they serve.
const E2E_NS_LABEL: &str = "ucm.io/e2e-namespace";

/// A kubeconfig for the cluster of `admin`, authenticated (TokenRequest token) as a
/// ServiceAccount in `ns` bound only to the roles `ucm rbac` ships for `features` and leader
/// election, so every e2e test proves the shipped RBAC is enough (docs/runtime.md, "RBAC"). The
/// ClusterRoles are
/// installed under an `ucm-e2e-` prefix (identical for every test of a run); the Roles and the
/// ServiceAccount live in `ns`. Blocking: kubectl does the work.
pub fn shipped_identity(
    admin: &Path,
    ns: &str,
    features: &[&str],
    service_account: Option<&str>,
    dir: &Path,
) -> PathBuf {
    let out = Command::new(env!("CARGO_BIN_EXE_ucm"))
        .arg("rbac")
        .output()
        .expect("ucm rbac");
    assert!(out.status.success(), "ucm rbac failed");
    let text = String::from_utf8(out.stdout).unwrap();
    let sa = service_account
        .map(String::from)
        .unwrap_or_else(|| format!("ucm-manager-{}", features.join("-")));
    let mut docs = vec![serde_json::json!({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": sa, "namespace": ns},
    })];
    let subject = serde_json::json!([{"kind": "ServiceAccount", "name": sa, "namespace": ns}]);
    for mut role in yaml_docs(&text) {
        let name = role["metadata"]["name"].as_str().unwrap().to_string();
        let wanted =
            name == "ucm-leader-election" || features.iter().any(|f| name == format!("ucm-{f}"));
        if !wanted {
            continue;
        }
        match role["kind"].as_str().unwrap() {
            "ClusterRole" => {
                let shared = format!("ucm-e2e-{name}");
                role["metadata"] = serde_json::json!({"name": shared});
                docs.push(role);
                docs.push(serde_json::json!({
                    "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                    "metadata": {"name": format!("ucm-e2e-{ns}-{sa}-{name}"),
                                 "labels": {E2E_NS_LABEL: ns}},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": shared},
                    "subjects": subject,
                }));
            }
            "Role" => {
                role["metadata"] = serde_json::json!({"name": name, "namespace": ns});
                docs.push(role);
                docs.push(serde_json::json!({
                    "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                    "metadata": {"name": format!("{sa}-{name}"), "namespace": ns},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                    "subjects": subject,
                }));
            }
            other => panic!("ucm rbac printed a {other}"),
        }
    }
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": docs});
    let (ok, out) = kubectl(
        admin,
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=ucm-e2e",
            "-f",
            "-",
        ],
        Some(&list.to_string()),
    );
    assert!(ok, "installing the shipped identity failed:\n{out}");
    let token = Command::new(kubectl_bin())
        .arg(format!("--kubeconfig={}", admin.display()))
        .args(["create", "token", &sa, "-n", ns, "--duration=24h"])
        .output()
        .expect("kubectl create token");
    assert!(
        token.status.success(),
        "kubectl create token failed: {}",
        String::from_utf8_lossy(&token.stderr)
    );
    let token = String::from_utf8(token.stdout).unwrap();
    let mut kc: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(admin).unwrap()).unwrap();
    kc["users"] = serde_json::json!([{"name": sa, "user": {"token": token.trim()}}]);
    for ctx in kc["contexts"].as_array_mut().unwrap() {
        ctx["context"]["user"] = sa.clone().into();
    }
    let path = dir.join("kubeconfig-shipped-identity");
    std::fs::write(&path, serde_saphyr::to_string(&kc).unwrap()).unwrap();
    path
}

/// The pinned Jumpstarter 0.9.0 virtualenv (`hack/jumpstarter-venv.sh`, created on first use and
/// cached in ~/.cache/ucm). Panics with the script's output when it cannot be made.
pub fn jumpstarter_venv() -> PathBuf {
    let out = Command::new("bash")
        .arg(repo_root().join("hack/jumpstarter-venv.sh"))
        .output()
        .expect("run hack/jumpstarter-venv.sh");
    assert!(
        out.status.success(),
        "hack/jumpstarter-venv.sh failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

impl Harness {
    /// SIGKILL, as a crashed control plane: etcd's data stays in `dir` for a restart with
    /// [`Harness::start_in`] (kube-controller-manager dies with it through its parent-death
    /// signal). A graceful stop waits for open watches to drain, up to ~40 s.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.stdin.take();
    }
}

/// Condition `t` of a status's condition list.
pub fn find_condition(conds: Option<&Vec<Condition>>, t: &str) -> Option<Condition> {
    conds?.iter().find(|c| c.type_ == t).cloned()
}

/// Condition `t` of a status's condition list as (status, reason, message).
pub fn condition(conds: Option<&Vec<Condition>>, t: &str) -> Option<(String, String, String)> {
    find_condition(conds, t).map(|c| (c.status, c.reason, c.message))
}

/// [`condition`] of an Exporter.
pub fn exporter_condition(e: &Exporter, t: &str) -> Option<(String, String, String)> {
    condition(e.status.as_ref()?.conditions.as_ref(), t)
}

/// An Exporter's `status.exporterStatus`.
pub fn exporter_status(e: &Exporter) -> Option<ExporterStatusValue> {
    e.status.as_ref().and_then(|s| s.exporter_status)
}

/// What `jmp` and a user see as serving: Available, Online and Registered.
pub fn exporter_available(e: &Exporter) -> bool {
    exporter_status(e) == Some(ExporterStatusValue::Available)
        && exporter_condition(e, "Online").is_some_and(|c| c.0 == "True")
        && exporter_condition(e, "Registered").is_some_and(|c| c.0 == "True")
}

pub fn now_rfc3339() -> String {
    jiff::fmt::strtime::format("%Y-%m-%dT%H:%M:%SZ", jiff::Timestamp::now()).unwrap()
}

/// The status an exporter reports (`lastSeen` now), as the gRPC service writes it.
pub async fn report(exporters: &Api<Exporter>, name: &str, status: &str, message: &str) {
    let patch = serde_json::json!({"status": {"lastSeen": now_rfc3339(), "devices": [],
                                  "exporterStatus": status, "statusMessage": message}});
    exporters
        .patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
}

/// What the gRPC service writes on Register + ReportStatus(AVAILABLE).
pub async fn report_available(exporters: &Api<Exporter>, name: &str) {
    report(exporters, name, "Available", "Available").await;
}

/// The sum of the samples of metric `family` whose labels include every `want` pair.
pub fn metric(text: &str, family: &str, want: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (head, value) = l.rsplit_once(' ')?;
            let (name, labels) = match head.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (head, ""),
            };
            let matches = name == family
                && want
                    .iter()
                    .all(|(k, v)| labels.split(',').any(|pair| pair == format!("{k}=\"{v}\"")));
            matches.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// Completed reconciles of one controller (every result).
pub async fn reconciles(m: &Manager, controller: &str) -> f64 {
    metric(
        &m.metrics().await,
        "controller_runtime_reconcile_total",
        &[("controller", controller)],
    )
}

/// Every YAML document of a multi-document stream, as JSON values (empty documents dropped).
pub fn yaml_docs(text: &str) -> Vec<serde_json::Value> {
    serde_saphyr::from_str_multiple::<serde_json::Value, Vec<_>>(text)
        .unwrap_or_else(|e| panic!("bad YAML: {e}\n{text}"))
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

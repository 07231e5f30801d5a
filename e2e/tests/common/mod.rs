//! The e2e fixture (docs/architecture.md, "Tests, benchmarks and fuzzing"): the `ucm-testkit`
//! crate (shared with the benchmarks: the control plane, a fresh namespace per test, ucm's CRDs
//! installed once, the processes' lifecycle, what tests read back), re-exported here, and the
//! manager as a real subprocess under the shipped identity, which needs the `ucm` binary Cargo
//! builds for this crate's tests. A missing prerequisite fails loudly; nothing is skipped.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

pub use ucm_testkit::*;

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
            && shared_kubeconfig_started().is_some_and(|kc| kc == opts.kubeconfig)
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

/// The pinned Jumpstarter 0.9.0 virtualenv (`hack/jumpstarter/venv.sh`, created on first use and
/// cached in ~/.cache/ucm). Panics with the script's output when it cannot be made.
pub fn jumpstarter_venv() -> PathBuf {
    let out = Command::new("bash")
        .arg(repo_root().join("hack/jumpstarter/venv.sh"))
        .output()
        .expect("run hack/jumpstarter/venv.sh");
    assert!(
        out.status.success(),
        "hack/jumpstarter/venv.sh failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Completed reconciles of one controller (every result).
pub async fn reconciles(m: &Manager, controller: &str) -> f64 {
    metric(
        &m.metrics().await,
        "controller_runtime_reconcile_total",
        &[("controller", controller)],
    )
}

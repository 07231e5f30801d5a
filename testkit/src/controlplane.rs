//! The local control plane (`e2e/bin/kharness serve`): the shared one, ones of a test's own (also
//! with an API server audit log), a client for it, ucm's CRDs, and the e2e kubectl.

use std::{
    io::{BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::{Mutex, OnceLock},
    time::Duration,
};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{conditions, wait::await_condition},
};

use crate::{TIMEOUT, signal, wait_timeout};

/// The ucm repository (this crate lives in its `testkit/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit/ has a parent")
        .to_path_buf()
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

/// The shared control plane's kubeconfig, once [`shared_kubeconfig`] has been asked for it.
static SHARED: OnceLock<PathBuf> = OnceLock::new();

/// The shared control plane's kubeconfig if [`shared_kubeconfig`] has been asked for it already.
pub fn shared_kubeconfig_started() -> Option<&'static PathBuf> {
    SHARED.get()
}

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

//! The bench's own control plane: `kharness serve` (as in the e2e fixture) plus an audit log, so
//! API requests are counted by the kube-apiserver itself, per user. ucm's processes run with
//! ServiceAccount tokens of their own (`system:serviceaccount:ucm-system:<name>`); the bench's
//! own client is the admin user, which the audit policy leaves out.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Patch, PatchParams, PostParams};
use kube::config::Kubeconfig;
use kube::{Api, Client};
use serde_json::json;

/// The manager's namespace (leader Lease, generated Secrets, agent heartbeat Leases).
pub const SYSTEM_NS: &str = "ucm-system";

/// A control plane with ucm's CRDs, the extra service range, and the two ServiceAccount
/// identities ucm's processes use.
pub struct Plane {
    pub admin: Client,
    pub manager_kubeconfig: PathBuf,
    pub agent_kubeconfig: PathBuf,
    pub audit: Audit,
    /// etcd + kube-apiserver process, for CPU accounting.
    pub apiserver_pid: u32,
    _cp: ControlPlane,
}

impl Plane {
    pub async fn start(dir: &Path) -> Plane {
        let cp = ControlPlane::start(dir);
        let admin = ucm_testkit::client_for(&cp.kubeconfig).await;
        ucm_testkit::install_crds(&admin).await;
        serve_each_crd_once(&admin).await;
        more_service_ips(&admin).await;
        let manager_kubeconfig = identity(&admin, &cp.kubeconfig, "ucm-manager", dir).await;
        let agent_kubeconfig = identity(&admin, &cp.kubeconfig, "ucm-agent", dir).await;
        Plane {
            admin,
            manager_kubeconfig,
            agent_kubeconfig,
            audit: cp.audit(),
            apiserver_pid: cp.pid(),
            _cp: cp,
        }
    }
}

pub struct ControlPlane {
    pub kubeconfig: PathBuf,
    pub audit_log: PathBuf,
    child: Option<Child>,
    _stdin: Option<ChildStdin>,
}

const AUDIT_POLICY: &str = r#"apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  userGroups: ["system:serviceaccounts:ucm-system"]
- level: None
"#;

impl ControlPlane {
    /// Starts etcd, kube-apiserver (with the audit log) and kube-controller-manager in `dir`.
    pub fn start(dir: &Path) -> ControlPlane {
        let policy = dir.join("audit-policy.yaml");
        let audit_log = dir.join("audit.log");
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(&policy, AUDIT_POLICY).unwrap();
        let log = std::fs::File::create(dir.join("kharness.log")).unwrap();
        let mut cmd = Command::new(ucm_testkit::kharness_bin());
        crate::child::die_with_parent(&mut cmd);
        let mut child = cmd
            .arg("serve")
            .arg("--dir")
            .arg(dir.join("cluster"))
            .args(["--with-kcm", "--rm-dir", "--exit-on-stdin-eof", "--"])
            .arg(format!("--audit-policy-file={}", policy.display()))
            .arg(format!("--audit-log-path={}", audit_log.display()))
            .args([
                "--audit-log-format=json",
                "--audit-log-maxsize=0",
                "--audit-log-mode=blocking",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("start e2e/bin/kharness");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let kubeconfig = PathBuf::from(line.trim().strip_prefix("READY ").unwrap_or_else(|| {
            panic!(
                "kharness did not print READY; see {}",
                dir.join("kharness.log").display()
            )
        }));
        let stdin = child.stdin.take();
        ControlPlane {
            kubeconfig,
            audit_log,
            child: Some(child),
            _stdin: stdin,
        }
    }

    /// The `kharness serve` process: etcd and kube-apiserver run in it (KCM is a child).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn audit(&self) -> Audit {
        Audit {
            path: self.audit_log.clone(),
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            ucm_testkit::signal(c.id(), "TERM");
            let _ = c.wait();
        }
        if std::env::var("UCM_BENCH_KEEP").as_deref() != Ok("1") {
            let _ = std::fs::remove_file(&self.audit_log);
        }
    }
}

/// The API server builds a CRD's storage and watch cache on the first request for it: about a
/// second for ucm's seven kinds on this machine, which a manager started right after the
/// install paid in its start-up figure (1.17 s to /readyz, then 0.18 s on the next start).
/// In a user's cluster the CRDs were served long before; the bench's admin client lists each
/// kind once so the start-up figures measure ucm, not the API server's first request.
async fn serve_each_crd_once(admin: &Client) {
    use kube::api::{ApiResource, DynamicObject, ListParams};
    for f in ucm::FEATURES {
        for crd in f.installed_crds() {
            let group = crd.spec.group.clone();
            let version = crd
                .spec
                .versions
                .iter()
                .find(|v| v.storage)
                .map(|v| v.name.clone())
                .unwrap_or_default();
            let ar = ApiResource {
                group: group.clone(),
                version: version.clone(),
                api_version: format!("{group}/{version}"),
                kind: crd.spec.names.kind.clone(),
                plural: crd.spec.names.plural.clone(),
            };
            let api: Api<DynamicObject> = Api::all_with(admin.clone(), &ar);
            api.list(&ListParams::default().limit(1))
                .await
                .unwrap_or_else(|e| panic!("list {}: {e}", ar.plural));
        }
    }
}

/// 1,000 export Services need more ClusterIPs than the harness's /24 service range holds: a
/// second ServiceCIDR adds a /16. The harness runs no service-CIDR controller, so the bench marks
/// it Ready as that controller would (the allocator only uses Ready ServiceCIDRs).
pub async fn more_service_ips(admin: &Client) {
    use k8s_openapi::api::networking::v1::ServiceCIDR;
    let cidr: ServiceCIDR = serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": "ucm-bench"}, "spec": {"cidrs": ["10.96.0.0/16"]}
    }))
    .unwrap();
    let api: Api<ServiceCIDR> = Api::all(admin.clone());
    api.patch(
        "ucm-bench",
        &PatchParams::apply("ucm-bench").force(),
        &Patch::Apply(cidr),
    )
    .await
    .unwrap();
    let now = jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .unwrap()
        .to_string();
    let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "UcmBench",
        "message": "marked Ready by the ucm bench", "lastTransitionTime": now}]}});
    api.patch_status("ucm-bench", &PatchParams::default(), &Patch::Merge(ready))
        .await
        .unwrap();
}

/// Creates `ucm-system`, binds its ServiceAccounts to cluster-admin, and returns a kubeconfig for
/// the ServiceAccount `name` (a bound token from the TokenRequest API).
pub async fn identity(admin: &Client, admin_kubeconfig: &Path, name: &str, out: &Path) -> PathBuf {
    let ssa = PatchParams::apply("ucm-bench").force();
    let ns: Namespace = serde_json::from_value(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SYSTEM_NS}}),
    )
    .unwrap();
    Api::<Namespace>::all(admin.clone())
        .patch(SYSTEM_NS, &ssa, &Patch::Apply(ns))
        .await
        .unwrap();
    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "ucm-bench"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": format!("system:serviceaccounts:{SYSTEM_NS}")}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .patch("ucm-bench", &ssa, &Patch::Apply(crb))
        .await
        .unwrap();
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), SYSTEM_NS);
    let sa: ServiceAccount = serde_json::from_value(
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}),
    )
    .unwrap();
    sas.patch(name, &ssa, &Patch::Apply(sa)).await.unwrap();
    let tr: TokenRequest = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 6 * 3600}
    }))
    .unwrap();
    let tr: TokenRequest = sas
        .create_subresource("token", name, &PostParams::default(), &tr)
        .await
        .unwrap();
    let token = tr.status.expect("token").token;
    let kc = Kubeconfig::read_from(admin_kubeconfig).unwrap();
    let cluster = kc.clusters[0].cluster.clone().unwrap();
    let doc = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "bench", "cluster": {
            "server": cluster.server,
            "certificate-authority": cluster.certificate_authority,
        }}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": name}}],
        "current-context": "bench",
    });
    let path = out.join(format!("kubeconfig-{name}"));
    std::fs::write(&path, serde_saphyr::to_string(&doc).unwrap()).unwrap();
    path
}

/// Request counts of one ServiceAccount, from the audit log.
#[derive(Debug, Default, Clone)]
pub struct Counts {
    /// create, update, patch, delete, deletecollection
    pub writes: u64,
    /// get, list
    pub reads: u64,
    /// watch requests started
    pub watches: u64,
    /// "verb resource[.group][/subresource]" → count
    pub by_kind: BTreeMap<String, u64>,
    /// (response code, "verb resource…") → count, for every request but watches.
    pub by_code: BTreeMap<(u16, String), u64>,
}

impl Counts {
    /// Writes of coordination.k8s.io Leases: the manager's leader election, an agent's heartbeat.
    pub fn coordination_lease_writes(&self) -> u64 {
        self.lease_requests(is_write)
    }

    /// Requests of any verb but watch on coordination.k8s.io Leases.
    pub fn coordination_lease_requests(&self) -> u64 {
        self.lease_requests(|v| v != "watch")
    }

    fn lease_requests(&self, verb: impl Fn(&str) -> bool) -> u64 {
        self.by_kind
            .iter()
            .filter_map(|(k, n)| {
                let (v, res) = k.split_once(' ')?;
                (res == "leases.coordination.k8s.io" && verb(v)).then_some(*n)
            })
            .sum()
    }

    /// Gets and lists besides those of coordination.k8s.io Leases.
    pub fn reads_besides_coordination_leases(&self) -> u64 {
        self.reads - self.lease_requests(|v| matches!(v, "get" | "list"))
    }

    /// Responses with `code` (409: a conflict), leaving out coordination.k8s.io Leases (leader
    /// election, heartbeats), which every figure counts apart.
    pub fn code_besides_coordination_leases(&self, code: u16) -> u64 {
        self.by_code
            .iter()
            .filter(|((c, k), _)| *c == code && !k.ends_with(" leases.coordination.k8s.io"))
            .map(|(_, n)| n)
            .sum()
    }

    /// The kinds of request that got `code`, most first.
    pub fn top_code(&self, code: u16, n: usize) -> String {
        let mut v: Vec<_> = self
            .by_code
            .iter()
            .filter(|((c, _), _)| *c == code)
            .collect();
        v.sort_by(|a, b| b.1.cmp(a.1));
        v.iter()
            .take(n)
            .map(|((_, k), c)| format!("{k} {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Requests that are not long-running: what a reconcile costs the API server.
    pub fn requests(&self) -> u64 {
        self.writes + self.reads
    }

    pub fn top(&self, n: usize) -> String {
        let mut v: Vec<_> = self.by_kind.iter().collect();
        v.sort_by(|a, b| b.1.cmp(a.1));
        v.iter()
            .take(n)
            .map(|(k, c)| format!("{k} {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[derive(Clone)]
pub struct Audit {
    path: PathBuf,
}

pub fn is_write(verb: &str) -> bool {
    matches!(
        verb,
        "create" | "update" | "patch" | "delete" | "deletecollection"
    )
}

impl Audit {
    /// The current end of the log: counts are taken between two offsets.
    pub fn offset(&self) -> u64 {
        std::fs::metadata(&self.path).map(|m| m.len()).unwrap_or(0)
    }

    /// Counts per ServiceAccount name (`ucm-manager`, `ucm-agent`, …) between two offsets.
    /// Each request counts once: at ResponseComplete, or at ResponseStarted for a watch.
    pub fn count(&self, from: u64, to: u64) -> BTreeMap<String, Counts> {
        self.count_excluding(from, to, &[])
    }

    /// As [`Audit::count`], leaving out requests on objects with one of the `names`.
    pub fn count_excluding(
        &self,
        from: u64,
        to: u64,
        names: &[String],
    ) -> BTreeMap<String, Counts> {
        let mut f = std::fs::File::open(&self.path).unwrap();
        f.seek(SeekFrom::Start(from)).unwrap();
        let mut buf = Vec::new();
        f.take(to.saturating_sub(from))
            .read_to_end(&mut buf)
            .unwrap();
        let mut out: BTreeMap<String, Counts> = BTreeMap::new();
        for line in buf.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let Ok(ev) = serde_json::from_slice::<AuditEvent>(line) else {
                continue;
            };
            let counted = match ev.stage.as_str() {
                "ResponseStarted" => ev.verb == "watch",
                "ResponseComplete" => ev.verb != "watch",
                _ => false,
            };
            if !counted {
                continue;
            }
            let excluded = ev
                .object_ref
                .as_ref()
                .and_then(|r| r.name.as_ref())
                .is_some_and(|n| names.contains(n));
            if excluded {
                continue;
            }
            let user = ev
                .user
                .username
                .rsplit(':')
                .next()
                .unwrap_or_default()
                .to_string();
            let c = out.entry(user).or_default();
            if ev.verb == "watch" {
                c.watches += 1;
            } else if is_write(&ev.verb) {
                c.writes += 1;
            } else {
                c.reads += 1;
            }
            let r = ev.object_ref.unwrap_or_default();
            let mut res = r.resource;
            if let Some(g) = r.api_group.filter(|g| !g.is_empty()) {
                res = format!("{res}.{g}");
            }
            if let Some(s) = r.subresource {
                res = format!("{res}/{s}");
            }
            let kind = format!("{} {res}", ev.verb);
            if ev.verb != "watch"
                && let Some(code) = ev.response_status.and_then(|r| r.code)
            {
                *c.by_code.entry((code, kind.clone())).or_default() += 1;
            }
            *c.by_kind.entry(kind).or_default() += 1;
        }
        out
    }

    /// Waits until `user` has sent no request for `quiet` (bounded by `max`), so the counts of a
    /// phase include the reconciles its last status write triggered. Leader-election and
    /// heartbeat Leases do not count: renewed every 2 s, they would keep a 2 s window from ever
    /// being quiet.
    pub async fn settle(&self, user: &str, quiet: Duration, max: Duration) {
        let start = std::time::Instant::now();
        let mut last = self.offset();
        let mut since = std::time::Instant::now();
        while start.elapsed() < max {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let now = self.offset();
            if now != last
                && self
                    .count(last, now)
                    .get(user)
                    .is_some_and(|c| c.requests() + c.watches > c.coordination_lease_requests())
            {
                since = std::time::Instant::now();
            }
            last = now;
            if since.elapsed() >= quiet {
                return;
            }
        }
    }
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct AuditEvent {
    stage: String,
    verb: String,
    user: AuditUser,
    #[serde(default)]
    object_ref: Option<ObjectRef>,
    #[serde(default)]
    response_status: Option<ResponseStatus>,
}

#[derive(serde::Deserialize)]
struct ResponseStatus {
    #[serde(default)]
    code: Option<u16>,
}

#[derive(serde::Deserialize)]
struct AuditUser {
    #[serde(default)]
    username: String,
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ObjectRef {
    #[serde(default)]
    resource: String,
    #[serde(default)]
    api_group: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    subresource: Option<String>,
}

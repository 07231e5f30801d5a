//! The fault tests' rig (faults.rs, soak.rs): one namespace with work of every feature in
//! flight — Exporters with Leases, MiroirSnapshot rounds with real `ucm snapshot-agent`s (fake
//! barrier, loopfile backend), VirtualMachineExports whose Pods the test marks ready as a
//! kubelet would — plus the actors a fault hits: the managers, the agents, an exporter speaking
//! gRPC, an export-server process, and a TCP proxy that drops connections. Also the world of
//! the snapshot tests (snapshot.rs).

pub mod exporter_client;
pub mod proxy;
pub mod work;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::common::*;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use ucm::exporter::crd::{Exporter, Lease};
use ucm::snapshot::{
    agent::barrier::fake::{self, FakeCluster, FakeEvent, FakeVolume},
    types::{MiroirSnapshot, MiroirVolume, SlotState},
};
use ucm::vmexport::VirtualMachineExport;

pub const MIB: u64 = 1 << 20;
/// The exporter signing seed every manager of a rig shares (a standby must verify the leader's
/// tokens and must never re-mint them).
pub const SEED: &str = "e2e-faults-controller-key";

/// Snapshot timings short enough for fault tests; managers and agents agree on them.
#[derive(Clone, Copy)]
pub struct Timing {
    pub deadline: &'static str,
    pub cut_guard: &'static str,
    pub backoff: &'static str,
    pub stale_after: &'static str,
}

pub const FAST: Timing = Timing {
    deadline: "8s",
    cut_guard: "2s",
    backoff: "3s",
    stale_after: "20s",
};

/// A `ucm snapshot-agent` subprocess for one fake node. Dropping it sends SIGTERM and waits.
pub struct AgentProc {
    pub node: String,
    /// A test that stops the agent its own way takes it.
    pub child: Option<Child>,
    log: PathBuf,
}

impl AgentProc {
    /// Both streams (tracing writes to stderr).
    pub fn logs(&self) -> String {
        let mut out = std::fs::read_to_string(&self.log).unwrap_or_default();
        out.push_str(&std::fs::read_to_string(self.log.with_extension("err")).unwrap_or_default());
        out
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(c.id(), "KILL");
            let _ = c.wait();
        }
    }

    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c, "TERM", Duration::from_secs(20));
        }
        if std::thread::panicking() {
            eprintln!("---- agent {} log ----\n{}", self.node, self.logs());
        }
    }
}

/// One namespace of one cluster, with the snapshot nodes' files and agents.
pub struct World {
    pub client: Client,
    /// Admin kubeconfig of the cluster (agents and the test use it directly).
    pub kubeconfig: PathBuf,
    pub ns: String,
    pub dir: tempfile::TempDir,
    /// Fake node names are `<prefix>-a`, `-b`, `-c`: unique per test on a shared cluster.
    pub prefix: String,
    pub timing: Timing,
    pub agents: Vec<AgentProc>,
}

impl World {
    pub fn new(client: Client, kubeconfig: &Path, ns: &str, timing: Timing) -> World {
        World {
            client,
            kubeconfig: kubeconfig.to_path_buf(),
            ns: ns.to_string(),
            dir: tempfile::Builder::new()
                .prefix("ucm-faults-")
                .tempdir()
                .unwrap(),
            prefix: unique("n"),
            timing,
            agents: vec![],
        }
    }

    /// Manager flags for every feature: snapshot timings, the exporter's gRPC port and
    /// advertised endpoint, leader election on `lease` with short timings when given.
    pub fn manager_opts<'a>(
        &'a self,
        kubeconfig: &'a Path,
        grpc_port: u16,
        lease: Option<&'a str>,
    ) -> ManagerOpts<'a> {
        let mut o = ManagerOpts {
            env: vec![("CONTROLLER_KEY".into(), SEED.into())],
            ..ManagerOpts::new(kubeconfig, &self.ns)
        }
        .args([
            format!("--snapshot-deadline={}", self.timing.deadline),
            format!("--snapshot-void-backoff={}", self.timing.backoff),
            format!("--snapshot-agent-stale-after={}", self.timing.stale_after),
            format!("--exporter-grpc-bind-address=127.0.0.1:{grpc_port}"),
            format!("--exporter-grpc-endpoint=localhost:{grpc_port}"),
        ]);
        if let Some(id) = lease {
            o = o.lease(id).args([
                "--leader-elect-lease-duration=4s",
                "--leader-elect-renew-deadline=3s",
                "--leader-elect-retry-period=1s",
            ]);
        }
        o
    }

    // ---- snapshot ----

    pub fn node(&self, n: &str) -> String {
        format!("{}-{n}", self.prefix)
    }

    pub fn fake_dir(&self) -> PathBuf {
        self.dir.path().join("fake")
    }

    pub fn pool_dir(&self, node: &str) -> PathBuf {
        self.dir.path().join("nodes").join(node).join("pool")
    }

    pub fn snapshots(&self) -> Api<MiroirSnapshot> {
        Api::all(self.client.clone())
    }

    pub fn volumes(&self) -> Api<MiroirVolume> {
        Api::all(self.client.clone())
    }

    pub fn start_agent(&mut self, short: &str) {
        let node = self.node(short);
        let ndir = self.dir.path().join("nodes").join(&node);
        std::fs::create_dir_all(&ndir).unwrap();
        let pools = ndir.join("pools.yaml");
        std::fs::write(
            &pools,
            format!(
                "pools:\n  default: {{backend: loopfile, base: {}}}\n",
                self.pool_dir(&node).display()
            ),
        )
        .unwrap();
        std::fs::create_dir_all(self.fake_dir()).unwrap();
        let log = ndir.join(format!("agent-{}.log", rand::random::<u32>()));
        let child = Command::new(env!("CARGO_BIN_EXE_ucm"))
            .arg("snapshot-agent")
            .arg(format!("--node-name={node}"))
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .arg(format!("--namespace={}", self.ns))
            .arg(format!("--snapshot-deadline={}", self.timing.deadline))
            .arg(format!("--snapshot-cut-guard={}", self.timing.cut_guard))
            .arg("--heartbeat-interval=1s")
            .arg("--barrier=fake")
            .arg(format!("--fake-barrier-dir={}", self.fake_dir().display()))
            .arg(format!("--pools={}", pools.display()))
            .arg("--loopfile-full-copy=true")
            .arg(format!("--journal={}", ndir.join("journal.json").display()))
            .arg("--metrics-bind-address=0")
            .arg("--health-probe-bind-address=0")
            .arg("--log-level=info,ucm=debug")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(log.with_extension("err")).unwrap())
            .spawn()
            .expect("start ucm snapshot-agent");
        self.agents.push(AgentProc {
            node,
            child: Some(child),
            log,
        });
    }

    pub fn agent(&mut self, short: &str) -> &mut AgentProc {
        let node = self.node(short);
        self.agents
            .iter_mut()
            .rev()
            .find(|a| a.node == node)
            .expect("agent started")
    }

    /// A sparse volume file with data at three places, identical on `nodes`; returns its bytes.
    pub fn write_volume_files(&self, vol: &str, nodes: &[&str], size: u64) -> Vec<u8> {
        for n in nodes {
            let p = self.volume_file(n, vol);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            let f = std::fs::File::create(&p).unwrap();
            f.set_len(size).unwrap();
            use std::os::unix::fs::FileExt;
            f.write_all_at(format!("ucm faults volume {vol}").as_bytes(), 0)
                .unwrap();
            f.write_all_at(&[0x5a; 4096], size / 2).unwrap();
            f.write_all_at(b"tail", size - 4).unwrap();
        }
        std::fs::read(self.volume_file(nodes[0], vol)).unwrap()
    }

    pub fn volume_file(&self, n: &str, vol: &str) -> PathBuf {
        self.pool_dir(&self.node(n))
            .join("volumes")
            .join(format!("{vol}.img"))
    }

    pub fn snapshot_file(&self, n: &str, snap: &str) -> PathBuf {
        self.pool_dir(&self.node(n))
            .join("snapshots")
            .join(format!("{snap}.img"))
    }

    /// The fake kernel's view of `vol`: Primary (mounted) on `primary`, legs in these disk states.
    pub fn set_fake_volume(&self, vol: &str, primary: &str, legs: &[(&str, &str)]) {
        std::fs::create_dir_all(self.fake_dir()).unwrap();
        let mut c: FakeCluster = std::fs::read(fake::cluster_path(&self.fake_dir()))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        c.volumes.insert(
            vol.to_string(),
            FakeVolume {
                primary: Some(self.node(primary)),
                legs: legs
                    .iter()
                    .map(|(n, d)| (self.node(n), d.to_string()))
                    .collect(),
            },
        );
        fake::write_cluster(&self.fake_dir(), &c).unwrap();
    }

    /// Files, fake kernel state and the MiroirVolume (with healthy per-node status) of a
    /// volume replicated on `nodes`; returns the volume's bytes.
    pub async fn volume(&self, vol: &str, nodes: &[&str], size: u64) -> Vec<u8> {
        let data = self.write_volume_files(vol, nodes, size);
        let legs: Vec<_> = nodes.iter().map(|n| (*n, "UpToDate")).collect();
        self.set_fake_volume(vol, nodes[0], &legs);
        let replicas: Vec<_> = nodes
            .iter()
            .map(|n| json!({"node": self.node(n), "backend": "loopfile"}))
            .collect();
        let per_node: serde_json::Map<String, serde_json::Value> = nodes
            .iter()
            .map(|n| {
                (
                    self.node(n),
                    json!({"deviceCreated": true, "diskState": "UpToDate", "splitBrain": false}),
                )
            })
            .collect();
        let v: MiroirVolume = serde_json::from_value(json!({
            "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirVolume",
            "metadata": {"name": vol},
            "spec": {"sizeBytes": size, "replicas": replicas},
        }))
        .unwrap();
        self.volumes()
            .create(&PostParams::default(), &v)
            .await
            .unwrap();
        self.volumes()
            .patch_status(
                vol,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"formatted": true, "perNode": per_node}})),
            )
            .await
            .unwrap();
        data
    }

    pub async fn create_snapshot(&self, name: &str, vol: &str) {
        let s: MiroirSnapshot = serde_json::from_value(json!({
            "apiVersion": "miroir.home-operations.com/v1alpha1", "kind": "MiroirSnapshot",
            "metadata": {"name": name}, "spec": {"volumeName": vol}
        }))
        .unwrap();
        self.snapshots()
            .create(&PostParams::default(), &s)
            .await
            .unwrap();
    }

    pub async fn snapshot(&self, name: &str) -> Option<MiroirSnapshot> {
        self.snapshots().get_opt(name).await.ok().flatten()
    }

    pub async fn wait_agents_alive(&self, nodes: &[&str]) {
        let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
            Api::namespaced(self.client.clone(), &self.ns);
        for n in nodes {
            let name = format!("ucm-snapshot-agent-{}", self.node(n));
            eventually(TIMEOUT, &format!("heartbeat Lease {name}"), || async {
                leases.get_opt(&name).await.ok().flatten().is_some()
            })
            .await;
        }
    }

    pub fn events(&self, n: &str) -> Vec<FakeEvent> {
        fake::read_events(&self.fake_dir(), &self.node(n))
    }

    pub fn kernel_clear(&self, n: &str) -> bool {
        let k = fake::read_kernel(&self.fake_dir(), &self.node(n));
        k.suspended.is_empty() && k.frozen.is_empty()
    }

    pub fn journal_empty(&self, n: &str) -> bool {
        let p = self
            .dir
            .path()
            .join("nodes")
            .join(self.node(n))
            .join("journal.json");
        ucm::snapshot::agent::journal::Journal::open(&p)
            .map(|j| j.is_empty())
            .unwrap_or(false)
    }

    /// Waits until the snapshot is published and checks what a single correct coordinator
    /// leaves behind: every leg Done, Ready True, the snapshot file of every node equal to the
    /// volume, and (after the agents lift) no barrier or journal entry on any node.
    pub async fn assert_snapshot_published(
        &self,
        snap: &str,
        nodes: &[&str],
        data: &[u8],
        timeout: Duration,
    ) -> MiroirSnapshot {
        let s = wait_snapshot(self, snap, "readyToUse", timeout, |s| {
            s.status.as_ref().and_then(|st| st.ready_to_use) == Some(true)
        })
        .await;
        let st = s.status.clone().unwrap();
        assert_eq!(st.io_suspended, Some(false), "{st:?}");
        for n in nodes {
            assert_eq!(
                st.per_node.as_ref().and_then(|p| p.get(&self.node(n))),
                Some(&SlotState::Done),
                "{st:?}"
            );
            let f = self.snapshot_file(n, snap);
            let got = std::fs::read(&f).unwrap_or_default();
            assert!(got == data, "{} differs from the volume", f.display());
        }
        let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("True", "SnapshotReady")
        );
        for n in nodes {
            eventually(
                TIMEOUT,
                &format!("node {n} to lift its barrier"),
                || async { self.kernel_clear(n) },
            )
            .await;
            eventually(TIMEOUT, &format!("node {n}'s journal to empty"), || async {
                self.journal_empty(n)
            })
            .await;
        }
        s
    }

    /// Deletes snapshots (waiting for the agents' finalizers) and volumes; never leaves a
    /// finalizer behind on a shared cluster.
    pub async fn cleanup_snapshots(&self, snaps: &[&str], vols: &[&str]) {
        for s in snaps {
            let _ = self.snapshots().delete(s, &DeleteParams::default()).await;
        }
        for s in snaps {
            let start = Instant::now();
            while self.snapshot(s).await.is_some() && start.elapsed() < Duration::from_secs(30) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if self.snapshot(s).await.is_some() {
                let _ = self
                    .snapshots()
                    .patch(
                        s,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                    )
                    .await;
            }
        }
        for v in vols {
            let _ = self.volumes().delete(v, &DeleteParams::default()).await;
        }
    }

    // ---- exporter ----

    pub fn exporters(&self) -> Api<Exporter> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub async fn create_exporter(&self, name: &str, labels: serde_json::Value) {
        let e: Exporter = serde_json::from_value(json!({
            "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
            "metadata": {"name": name, "labels": labels}, "spec": {}}))
        .unwrap();
        self.exporters()
            .create(&PostParams::default(), &e)
            .await
            .unwrap_or_else(|e| panic!("create Exporter {name}: {e}"));
    }

    /// What the gRPC service writes on Register + ReportStatus(AVAILABLE): the exporter is
    /// registered and seen now.
    pub async fn report_available(&self, name: &str) {
        report_available(&self.exporters(), name).await;
    }

    pub async fn create_lease(&self, name: &str, selector: serde_json::Value, duration: &str) {
        let l: Lease = serde_json::from_value(json!({
            "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease", "metadata": {"name": name},
            "spec": {"clientRef": {"name": "c1"}, "duration": duration,
                     "selector": {"matchLabels": selector}}}))
        .unwrap();
        self.leases()
            .create(&PostParams::default(), &l)
            .await
            .unwrap_or_else(|e| panic!("create Lease {name}: {e}"));
    }

    pub async fn lease(&self, name: &str) -> Option<Lease> {
        self.leases().get_opt(name).await.ok().flatten()
    }

    pub async fn wait_lease<F: Fn(&Lease) -> bool>(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        check: F,
    ) -> Lease {
        let start = Instant::now();
        loop {
            let l = self.lease(name).await;
            if let Some(l) = &l
                && check(l)
            {
                return l.clone();
            }
            if start.elapsed() > timeout {
                panic!(
                    "lease {name}: timed out after {timeout:?} waiting for {what}: {:#?}",
                    l.and_then(|l| l.status)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn exporter_token(&self, name: &str) -> Option<String> {
        let s = Api::<Secret>::namespaced(self.client.clone(), &self.ns)
            .get_opt(&format!("{name}-exporter"))
            .await
            .ok()
            .flatten()?;
        String::from_utf8(s.data?.get("token")?.0.clone()).ok()
    }

    pub async fn wait_exporter_token(&self, name: &str) -> String {
        let start = Instant::now();
        loop {
            if let Some(t) = self.exporter_token(name).await {
                return t;
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "no credential Secret for exporter {name}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The CA of the stored self-signed gRPC certificate (created by the first leader).
    pub async fn grpc_ca(&self) -> Vec<u8> {
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.ns);
        let start = Instant::now();
        loop {
            if let Some(s) = secrets
                .get_opt("ucm-exporter-grpc-tls")
                .await
                .ok()
                .flatten()
            {
                return s.data.unwrap()["tls.crt"].0.clone();
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "no stored gRPC certificate within {TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // ---- vmexport ----

    pub fn exports(&self) -> Api<VirtualMachineExport> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub async fn create_pvc(&self, name: &str) {
        let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": name,
                         "annotations": {"cdi.kubevirt.io/storage.contentType": "kubevirt"}},
            "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Filesystem",
                     "resources": {"requests": {"storage": "1Gi"}}, "storageClassName": "none"}
        }))
        .unwrap();
        Api::<PersistentVolumeClaim>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &pvc)
            .await
            .unwrap_or_else(|e| panic!("create PVC {name}: {e}"));
    }

    pub async fn create_export(&self, name: &str, pvc: &str, ttl: Option<&str>) {
        let mut spec = json!({"source": {"kind": "PersistentVolumeClaim", "name": pvc}});
        if let Some(t) = ttl {
            spec["ttlDuration"] = json!(t);
        }
        let e: VirtualMachineExport = serde_json::from_value(json!({
            "apiVersion": "export.kubevirt.io/v1", "kind": "VirtualMachineExport",
            "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap();
        self.exports()
            .create(&PostParams::default(), &e)
            .await
            .unwrap_or_else(|e| panic!("create export {name}: {e}"));
    }

    pub async fn export(&self, name: &str) -> Option<VirtualMachineExport> {
        self.exports().get_opt(name).await.ok().flatten()
    }

    /// What the kubelet would write for a running, ready export server.
    pub async fn mark_pod_ready(&self, pod: &str) -> kube::Result<Pod> {
        mark_ready(&self.pods(), pod).await
    }

    /// Plays kubelet until the export is Ready: marks its Pod ready whenever one exists and is
    /// not yet, so a Pod the manager recreates is handled too.
    pub async fn drive_export_ready(&self, name: &str, timeout: Duration) -> VirtualMachineExport {
        let pod = format!("virt-export-{name}");
        let start = Instant::now();
        loop {
            let e = self.export(name).await;
            if let Some(e) = &e
                && export_phase(e) == ("Ready".into(), "PodReady".into())
            {
                return e.clone();
            }
            if let Ok(Some(p)) = self.pods().get_opt(&pod).await
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running")
                && p.metadata.deletion_timestamp.is_none()
            {
                let _ = self.mark_pod_ready(&pod).await;
            }
            if start.elapsed() > timeout {
                panic!(
                    "export {name} not Ready within {timeout:?}: {:#?}",
                    e.and_then(|e| e.status)
                );
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
    }

    pub async fn wait_export<F: Fn(&VirtualMachineExport) -> bool>(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        check: F,
    ) -> VirtualMachineExport {
        let start = Instant::now();
        loop {
            let e = self.export(name).await;
            if let Some(e) = &e
                && check(e)
            {
                return e.clone();
            }
            if start.elapsed() > timeout {
                panic!(
                    "export {name}: timed out after {timeout:?} waiting for {what}: {:#?}",
                    e.and_then(|e| e.status)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One Pod, one token Secret and one cert Secret per export, each owned by it: what a
    /// single leader creates (a second writer racing it would leave extra objects or UIDs).
    pub async fn assert_export_children_unique(&self, name: &str) {
        let pods = self.pods().list(&ListParams::default()).await.unwrap();
        let owned_pods: Vec<_> = pods
            .items
            .iter()
            .filter(|p| owned_by(p.owner_references(), name))
            .collect();
        assert_eq!(owned_pods.len(), 1, "export {name} owns {owned_pods:#?}");
        let secrets = Api::<Secret>::namespaced(self.client.clone(), &self.ns)
            .list(&ListParams::default())
            .await
            .unwrap();
        let owned: Vec<String> = secrets
            .items
            .iter()
            .filter(|s| owned_by(s.owner_references(), name))
            .map(|s| s.name_any())
            .collect();
        let mut want = vec![
            format!("export-cert-{name}"),
            format!("export-token-{name}"),
        ];
        want.sort();
        let mut got = owned.clone();
        got.sort();
        assert_eq!(got, want, "Secrets owned by export {name}");
    }
}

fn owned_by(
    refs: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference],
    name: &str,
) -> bool {
    refs.iter()
        .any(|r| r.kind == "VirtualMachineExport" && r.name == name)
}

pub fn export_phase(e: &VirtualMachineExport) -> (String, String) {
    let st = e.status.clone().unwrap_or_default();
    let reason = st
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .and_then(|c| c.reason)
        .unwrap_or_default();
    (st.phase.unwrap_or_default(), reason)
}

pub fn slots(s: &MiroirSnapshot) -> BTreeMap<String, SlotState> {
    s.status
        .as_ref()
        .and_then(|st| st.per_node.clone())
        .unwrap_or_default()
}

pub fn open_round(s: &MiroirSnapshot) -> Option<String> {
    let st = s.status.as_ref()?;
    (st.io_suspended == Some(true))
        .then(|| st.suspended_at.clone())
        .flatten()
}

pub async fn wait_snapshot<F: Fn(&MiroirSnapshot) -> bool>(
    w: &World,
    name: &str,
    what: &str,
    timeout: Duration,
    check: F,
) -> MiroirSnapshot {
    let start = Instant::now();
    loop {
        let s = w.snapshot(name).await;
        if let Some(s) = &s
            && check(s)
        {
            return s.clone();
        }
        if start.elapsed() > timeout {
            panic!(
                "snapshot {name}: timed out after {timeout:?} waiting for {what}: {:#?}",
                s.and_then(|s| s.status)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The lines of a family, for messages.
pub fn metric_lines(text: &str, family: &str) -> String {
    text.lines()
        .filter(|l| l.starts_with(family))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A copy of `kubeconfig` whose server is `https://127.0.0.1:<port>` (the proxy); the API
/// server's certificate names 127.0.0.1, so TLS still verifies through the proxy.
pub fn kubeconfig_via(kubeconfig: &Path, port: u16, out: &Path) -> u16 {
    let text = std::fs::read_to_string(kubeconfig).unwrap();
    let mut kc: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    let mut upstream = 0;
    for c in kc["clusters"].as_array_mut().unwrap() {
        let server = c["cluster"]["server"].as_str().unwrap().to_string();
        upstream = server
            .rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .expect("server port");
        c["cluster"]["server"] = format!("https://127.0.0.1:{port}").into();
    }
    std::fs::write(out, serde_saphyr::to_string(&kc).unwrap()).unwrap();
    upstream
}

/// The API server port of a kubeconfig.
pub fn server_port(kubeconfig: &Path) -> u16 {
    let text = std::fs::read_to_string(kubeconfig).unwrap();
    let kc: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    kc["clusters"][0]["cluster"]["server"]
        .as_str()
        .unwrap()
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .expect("server port")
}

/// What the kubelet would write for a running, ready export server.
pub async fn mark_ready(pods: &Api<Pod>, pod: &str) -> kube::Result<Pod> {
    let body = json!({"status": {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [{
            "name": "exporter", "ready": true, "restartCount": 0, "image": "ucm", "imageID": "",
            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        }],
    }});
    pods.patch_status(pod, &PatchParams::default(), &Patch::Merge(body))
        .await
}

/// Whether a process is alive (and not a zombie).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().map(|r| r.trim().to_string()))
        .is_some_and(|r| !r.starts_with('Z'))
}

/// A kubeconfig for the identity `ucm rbac` ships for `features` (as every e2e manager runs
/// with), pointed at the proxy on `proxy_port`. Created through the direct address, so it
/// works while the proxy refuses connections.
pub fn shipped_identity_via(w: &World, features: &[&str], proxy_port: u16) -> PathBuf {
    let identity = shipped_identity(&w.kubeconfig, &w.ns, features, None, w.dir.path());
    let via = w.dir.path().join("kubeconfig-via-proxy");
    kubeconfig_via(&identity, proxy_port, &via);
    via
}

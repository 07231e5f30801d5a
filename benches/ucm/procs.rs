//! ucm processes as the bench runs them: the release-profile binary cargo built for this bench
//! target, info-level logs to a file, RSS read from /proc, readiness timed from spawn.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ucm_testkit::{free_port, http_get, signal, stop_child};

use crate::child::die_with_parent;

pub fn ucm_bin() -> &'static str {
    env!("CARGO_BIN_EXE_ucm")
}

/// User + system CPU seconds of a process, from /proc/<pid>/stat (fields 14 and 15).
pub fn cpu_secs(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces; the fields after it are plain numbers.
    let rest = s.rsplit_once(')').map(|x| x.1).unwrap_or_default();
    let f: Vec<f64> = rest
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    // rest starts at field 3 (state, not a number, skipped by the filter): utime is field 14.
    f.get(10)
        .zip(f.get(11))
        .map(|(u, s)| (u + s) / tck)
        .unwrap_or(0.0)
}

pub struct Proc {
    child: Option<Child>,
    pub spawned: Instant,
    pub log: PathBuf,
    pub metrics_port: u16,
    pub health_port: u16,
    pub grpc_port: u16,
}

impl Proc {
    /// `ucm manager` with the default settings of the shipped Deployment (leader election only
    /// when asked), its own ports, and `--namespace=ucm-system`.
    pub fn manager(kubeconfig: &Path, log: PathBuf, extra: &[String]) -> Proc {
        Proc::manager_env(kubeconfig, log, extra, &[])
    }

    /// [`Proc::manager`] with environment variables (e.g. `CONTROLLER_KEY`).
    pub fn manager_env(
        kubeconfig: &Path,
        log: PathBuf,
        extra: &[String],
        env: &[(&str, &str)],
    ) -> Proc {
        let (metrics_port, health_port, grpc_port) = (free_port(), free_port(), free_port());
        let mut cmd = Command::new(ucm_bin());
        cmd.arg("manager")
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--namespace={}", crate::cluster::SYSTEM_NS))
            .arg(format!("--metrics-bind-address=127.0.0.1:{metrics_port}"))
            .arg(format!(
                "--health-probe-bind-address=127.0.0.1:{health_port}"
            ))
            .arg(format!(
                "--exporter-grpc-bind-address=127.0.0.1:{grpc_port}"
            ))
            // One advertised endpoint for every manager, as replicas behind a Service have: a
            // restarted manager advertising another port would rightly rewrite every Exporter.
            .arg("--exporter-grpc-endpoint=ucm-grpc.ucm-system.svc:8082")
            .arg("--log-level=info")
            .args(extra)
            .env_remove("RUST_LOG")
            .env_remove("POD_NAMESPACE")
            .env_remove("POD_NAME")
            .env_remove("WATCH_NAMESPACE")
            .envs(env.iter().copied());
        let mut p = Proc::spawn(cmd, log);
        p.metrics_port = metrics_port;
        p.health_port = health_port;
        p.grpc_port = grpc_port;
        p
    }

    /// `ucm snapshot-agent` for `node` with the fake barrier in `fake_dir`, a loopfile pool
    /// under `ndir/pool` and its journal and log in `ndir`.
    pub fn snapshot_agent(
        kubeconfig: &Path,
        node: &str,
        ndir: &Path,
        fake_dir: &Path,
        extra: &[&str],
    ) -> Proc {
        let pools = ndir.join("pools.yaml");
        std::fs::write(
            &pools,
            format!(
                "pools:\n  default: {{backend: loopfile, base: {}}}\n",
                ndir.join("pool").display()
            ),
        )
        .unwrap();
        let mut cmd = Command::new(ucm_bin());
        cmd.arg("snapshot-agent")
            .arg(format!("--node-name={node}"))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--namespace={}", crate::cluster::SYSTEM_NS))
            .args(extra)
            .arg("--barrier=fake")
            .arg(format!("--fake-barrier-dir={}", fake_dir.display()))
            .arg(format!("--pools={}", pools.display()))
            .arg("--loopfile-full-copy")
            .arg(format!("--journal={}", ndir.join("journal.json").display()))
            .arg("--metrics-bind-address=0")
            .arg("--health-probe-bind-address=0")
            .arg("--log-level=warn")
            .env_remove("RUST_LOG");
        Proc::spawn(cmd, ndir.join("agent.log"))
    }

    pub fn spawn(mut cmd: Command, log: PathBuf) -> Proc {
        die_with_parent(&mut cmd);
        let f = std::fs::File::create(&log).unwrap();
        let spawned = Instant::now();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd.get_program()));
        Proc {
            child: Some(child),
            spawned,
            log,
            metrics_port: 0,
            health_port: 0,
            grpc_port: 0,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Resident set size (VmRSS) in bytes.
    pub fn rss(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or_else(|| panic!("no VmRSS for pid {}", self.pid()))
    }

    /// User + system CPU seconds used so far.
    pub fn cpu(&self) -> f64 {
        cpu_secs(self.pid())
    }

    /// Polls /readyz every 10 ms; returns the time since spawn at the first 200.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Duration {
        loop {
            if let Some((200, _)) = http_get(self.health_port, "/readyz").await {
                return self.spawned.elapsed();
            }
            if let Some(Ok(Some(st))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("{} exited ({st}) before ready:\n{}", ucm_bin(), self.tail());
            }
            if self.spawned.elapsed() > timeout {
                panic!("not ready within {timeout:?}:\n{}", self.tail());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub async fn metric(&self, name_and_labels: &str) -> f64 {
        let text = http_get(self.metrics_port, "/metrics")
            .await
            .map(|r| r.1)
            .unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with(name_and_labels))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// The histogram `name` of the series with `label` (e.g. `controller="lease"`).
    pub async fn histogram(&self, name: &str, label: &str) -> Histogram {
        let text = http_get(self.metrics_port, "/metrics")
            .await
            .map(|r| r.1)
            .unwrap_or_default();
        let mut h = Histogram::default();
        for line in text
            .lines()
            .filter(|l| l.starts_with(name) && l.contains(label))
        {
            let Some((series, v)) = line.rsplit_once(' ') else {
                continue;
            };
            let v: f64 = v.parse().unwrap_or(0.0);
            match &series[name.len()..] {
                s if s.starts_with("_sum") => h.sum = v,
                s if s.starts_with("_count") => h.count = v,
                s => {
                    let le = s.split("le=\"").nth(1).and_then(|x| x.split('"').next());
                    let le = le.and_then(|x| x.parse().ok()).unwrap_or(f64::INFINITY);
                    h.buckets.push((le, v));
                }
            }
        }
        h
    }

    pub fn tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    pub fn signal(&self, sig: &str) {
        signal(self.pid(), sig);
    }

    /// SIGTERM (or SIGKILL) and wait for the exit.
    pub fn stop(&mut self, sig: &str) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c, sig, Duration::from_secs(60));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop("TERM");
    }
}

/// Waits until every node's snapshot agent has written its heartbeat Lease.
pub async fn wait_agent_leases(client: &kube::Client, nodes: &[&str]) {
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(client.clone(), crate::cluster::SYSTEM_NS);
    for n in nodes {
        let name = format!("ucm-snapshot-agent-{n}");
        let start = Instant::now();
        while leases.get_opt(&name).await.ok().flatten().is_none() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no heartbeat Lease {name}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A Prometheus histogram as scraped: count, sum, and the cumulative buckets (bound, count).
#[derive(Debug, Default, Clone)]
pub struct Histogram {
    pub count: f64,
    pub sum: f64,
    pub buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// The observations since `before`: their number, mean, and `q`-quantile as the upper bound
    /// of its bucket.
    pub fn since(&self, before: &Histogram, q: f64) -> (f64, f64, f64) {
        let n = self.count - before.count;
        let quantile = self
            .buckets
            .iter()
            .zip(&before.buckets)
            .find(|((_, c1), (_, c0))| c1 - c0 >= q * n)
            .map_or(f64::NAN, |((le, _), _)| *le);
        (n, (self.sum - before.sum) / n, quantile)
    }
}

//! Phase `failover` (docs/benchmarks.md): two managers with `--leader-elect` and the default
//! lease settings (15 s / 10 s / 2 s). The leader gets SIGTERM or SIGKILL; measured from the signal
//! to the standby's first write, which is its Lease takeover (the `acquireTime` it writes, on the
//! same host clock), and to its first reconcile write: an Exporter created right after the signal
//! gets its status from the new leader. The signalled manager is replaced by a new standby before
//! the next sample.

use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use serde_json::json;
use ucm::exporter::crd::Exporter;

use crate::Ctx;
use crate::cluster::SYSTEM_NS;
use crate::kube_util::{create_namespace, delete_namespace};
use crate::procs::Proc;
use crate::report::Figure;

const PHASE: &str = "failover";
const NS: &str = "bench-failover";
const LEASE: &str = "ucm-bench-failover";

fn start(ctx: &Ctx, i: usize) -> Proc {
    Proc::manager(
        &ctx.plane.manager_kubeconfig,
        ctx.work.join(format!("failover-manager-{i}.log")),
        &[
            "--leader-elect".into(),
            format!("--leader-election-id={LEASE}"),
            format!("--watch-namespace={NS}"),
        ],
    )
}

async fn holder(leases: &Api<Lease>) -> Option<(String, SystemTime)> {
    let spec = leases.get_opt(LEASE).await.ok()??.spec?;
    let h = spec.holder_identity.filter(|h| !h.is_empty())?;
    let at = spec.acquire_time?.0;
    Some((
        h,
        SystemTime::UNIX_EPOCH + Duration::from_nanos(at.as_nanosecond() as u64),
    ))
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let c = ctx.plane.admin.clone();
    create_namespace(&c, NS).await;
    let leases: Api<Lease> = Api::namespaced(c.clone(), SYSTEM_NS);
    let exporters: Api<Exporter> = Api::namespaced(c.clone(), NS);
    let mut started = 0;
    let mut leader = start(ctx, started);
    started += 1;
    leader.wait_ready(Duration::from_secs(60)).await;
    let mut standby = start(ctx, started);
    started += 1;
    standby.wait_ready(Duration::from_secs(60)).await;

    let mut takeover: [Vec<f64>; 2] = Default::default();
    let mut first_write: [Vec<f64>; 2] = Default::default();
    for i in 0..2 * ctx.failover_runs {
        let (k, sig) = if i % 2 == 0 { (0, "TERM") } else { (1, "KILL") };
        // The oldest surviving manager leads: wait until it says so and the Lease names it.
        let start_wait = Instant::now();
        let old = loop {
            if std::fs::read_to_string(&leader.log)
                .unwrap_or_default()
                .contains("acquired leadership")
                && let Some((h, _)) = holder(&leases).await
            {
                break h;
            }
            assert!(
                start_wait.elapsed() < Duration::from_secs(60),
                "the leader did not take {LEASE}:\n{}",
                leader.tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // Let the standby settle (a renewal or two) so each sample starts from steady state.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let name = format!("fo-{i}");
        let sent = SystemTime::now();
        let t0 = Instant::now();
        leader.signal(sig);
        exporters
            .create(
                &Default::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Exporter",
                    "metadata": {"name": name}, "spec": {}
                }))
                .unwrap(),
            )
            .await
            .unwrap();
        let mut took = None;
        let mut wrote = None;
        while took.is_none() || wrote.is_none() {
            if took.is_none()
                && let Some((h, at)) = holder(&leases).await
                && h != old
            {
                took = Some(at.duration_since(sent).unwrap_or_default().as_secs_f64());
            }
            if wrote.is_none()
                && exporters
                    .get_opt(&name)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|e| e.status)
                    .is_some_and(|s| s.credential.is_some())
            {
                wrote = Some(t0.elapsed().as_secs_f64());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(90),
                "no takeover within 90 s after SIG{sig}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        eprintln!(
            "  SIG{sig}: takeover {:.2}s, first reconcile write {:.2}s",
            took.unwrap(),
            wrote.unwrap()
        );
        takeover[k].push(took.unwrap());
        first_write[k].push(wrote.unwrap());
        leader.stop("KILL");
        leader = std::mem::replace(&mut standby, start(ctx, started));
        started += 1;
        standby.wait_ready(Duration::from_secs(60)).await;
    }
    leader.stop("TERM");
    standby.stop("TERM");
    delete_namespace(&c, NS, Duration::from_secs(120)).await;

    let [tt, tk] = takeover;
    let [wt, wk] = first_write;
    let note = "default lease settings (lease 15 s, renew deadline 10 s, retry 2 s); the standby watches the Lease";
    vec![
        Figure::new(PHASE, "failover.sigterm_takeover", "SIGTERM of the leader → standby's first write (Lease takeover)", "s", tt)
            .reference(2.0, "client-go/controller-runtime standby with release-on-cancel: polls every retry period (2 s), worst case (computed)", false)
            .note(format!("{note}; the leader drains, then releases the Lease")),
        Figure::new(PHASE, "failover.sigterm_first_reconcile", "SIGTERM → first reconcile write by the new leader", "s", wt)
            .reference(2.0, "same bound as the takeover (computed)", false)
            .note("an Exporter created right after the signal; time until its status (credential) is observed"),
        Figure::new(PHASE, "failover.sigkill_takeover", "SIGKILL of the leader → standby's first write (Lease takeover)", "s", tk)
            .reference(16.0, "client-go: lease duration 15 s after the last renewal observed, + up to 2 s retry, − up to 2 s renew age (computed mean)", false)
            .note(note),
        Figure::new(PHASE, "failover.sigkill_first_reconcile", "SIGKILL → first reconcile write by the new leader", "s", wk)
            .reference(16.0, "same as the takeover (computed)", false),
    ]
}

//! The `queue` phase's churn watch and its checks: a watch on the run's Leases that records
//! each Lease's instants and what a waiting Lease shows, releases each Lease once it is assigned,
//! and checks assignments as they come; then the fairness check over the records.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use serde_json::json;
use ucm::exporter::crd::{Lease, LeaseStatus};
use ucm::exporter::decide::lease::queue::QueueKey;

use crate::steps::LABEL;

/// The fairness check's margin around the watch instants: a pass decides before its write, and
/// the manager's cache and the bench's watch see each event at slightly different times (more
/// on a loaded 2-core machine). A Lease counts as surely waiting at a decision only when it was
/// seen 2 × SLACK before the assignment and assigned more than SLACK after it.
pub(super) const SLACK: Duration = Duration::from_secs(2);

/// One Lease as the churn watch saw it.
#[derive(Default)]
pub(super) struct Rec {
    pub(super) created: Option<Timestamp>,
    pub(super) seen: Option<Instant>,
    pub(super) assigned: Option<Instant>,
    exporter: Option<String>,
    pub(super) ended: Option<Instant>,
    rv: String,
    /// What a waiting Lease shows: `status.queue.position` and the Pending message.
    shown: (Option<i64>, Option<String>),
}

/// The churn watch's state.
#[derive(Default)]
pub(super) struct Churn {
    pub(super) recs: HashMap<String, Rec>,
    scarce: HashSet<String>,
    /// Exporter → the Lease the watch last saw assigned to it and not yet ended.
    holder: HashMap<String, String>,
    pub(super) listed: bool,
    relisting: bool,
    pub(super) assigned: usize,
    pub(super) ended: usize,
    /// Modifications of waiting Leases; those that changed the position; those that changed
    /// what it shows.
    pub(super) writes: u64,
    pub(super) positions: u64,
    pub(super) changes: u64,
    problems: Vec<String>,
}

fn shown(st: &LeaseStatus) -> (Option<i64>, Option<String>) {
    let pending = st
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Pending");
    let message = pending.map(|c| c.message.clone());
    (st.queue.as_ref().and_then(|q| q.position), message)
}

impl Churn {
    pub(super) fn new(scarce: HashSet<String>) -> Churn {
        Churn {
            scarce,
            ..Default::default()
        }
    }

    /// Records one version of a Lease; returns its name when it was just assigned (to release).
    pub(super) fn observe(&mut self, l: &Lease, now: Instant) -> Option<String> {
        let name = l.name_any();
        let r = self.recs.entry(name.clone()).or_default();
        let rv = l.resource_version().unwrap_or_default();
        if r.rv == rv {
            return None; // a relist repeating a version already seen
        }
        let first = std::mem::replace(&mut r.rv, rv).is_empty();
        r.seen.get_or_insert(now);
        r.created = l.metadata.creation_timestamp.as_ref().map(|t| t.0);
        let st = l.status.clone().unwrap_or_default();
        let exporter = st.exporter_ref_name().map(str::to_string);
        if exporter.is_none() && !st.ended {
            // Only the manager writes a waiting Lease.
            let now_shown = shown(&st);
            if !first {
                self.writes += 1;
                self.positions += u64::from(now_shown.0 != r.shown.0);
                self.changes += u64::from(now_shown != r.shown);
            }
            r.shown = now_shown;
        }
        let problems = &mut self.problems;
        let mut release = None;
        match (exporter, &r.exporter) {
            (Some(e), Some(old)) if e != *old => problems.push(format!("{name}: {old} → {e}")),
            (Some(e), None) => {
                if !self.scarce.contains(&e) {
                    problems.push(format!("{name} got {e}, not a scarce exporter"));
                }
                // A relist shows the Leases in name order, not in the order they were written.
                if let Some(other) = self.holder.insert(e.clone(), name.clone())
                    && !self.relisting
                {
                    problems.push(format!("{name} got {e} while {other} still held it"));
                }
                (r.exporter, r.assigned, release) = (Some(e), Some(now), Some(name.clone()));
                self.assigned += 1;
            }
            _ => {}
        }
        if st.ended && r.ended.is_none() {
            r.ended = Some(now);
            self.ended += 1;
            match &r.exporter {
                Some(e) if self.holder.get(e) == Some(&name) => drop(self.holder.remove(e)),
                Some(_) => {}
                None => problems.push(format!("{name} ended unassigned: {:?}", st.conditions)),
            }
        }
        release
    }
}

/// Watches the run's Leases into `state`, releasing each as soon as it is assigned.
pub(super) fn churn(
    api: Api<Lease>,
    run: &str,
    state: Arc<Mutex<Churn>>,
) -> tokio::task::JoinHandle<()> {
    let cfg = watcher::Config::default().labels(&format!("{LABEL}={run}"));
    tokio::spawn(async move {
        let mut stream = watcher(api.clone(), cfg).boxed();
        while let Some(ev) = stream.next().await {
            let l = match ev {
                Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l)) => l,
                Ok(watcher::Event::Init) => {
                    state.lock().unwrap().relisting = true;
                    continue;
                }
                Ok(watcher::Event::InitDone) => {
                    let mut c = state.lock().unwrap();
                    (c.listed, c.relisting) = (true, false);
                    continue;
                }
                Ok(_) => continue,
                Err(e) => {
                    eprintln!("churn watch: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            let Some(name) = state.lock().unwrap().observe(&l, Instant::now()) else {
                continue;
            };
            let (api, state) = (api.clone(), state.clone());
            tokio::spawn(async move {
                let body = Patch::Merge(json!({"spec": {"release": true}}));
                if let Err(e) = api.patch(&name, &PatchParams::default(), &body).await {
                    let problem = format!("release {name}: {e}");
                    state.lock().unwrap().problems.push(problem);
                }
            });
        }
    })
}

/// Polls `state` until `done`; panics on the first problems or after `timeout`.
pub(super) async fn wait_until(
    state: &Mutex<Churn>,
    what: &str,
    timeout: Duration,
    done: impl Fn(&Churn) -> bool,
) {
    let start = Instant::now();
    loop {
        {
            let c = state.lock().unwrap();
            let (n, first) = (c.problems.len(), &c.problems[..c.problems.len().min(10)]);
            assert!(n == 0, "queue phase: {n} problems, first {first:?}");
            if done(&c) {
                return;
            }
            let (a, e) = (c.assigned, c.ended);
            assert!(
                start.elapsed() < timeout,
                "queue phase: {what}: not within {timeout:?} ({a} assigned, {e} ended)"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// One Lease after the churn, for the fairness check.
pub(super) struct Row {
    pub(super) key: QueueKey,
    pub(super) seen: Instant,
    pub(super) assigned: Instant,
    pub(super) ended: Option<Instant>,
}

#[derive(Default)]
pub(super) struct Fairness {
    pub(super) violations: Vec<String>,
    pub(super) lower_first: usize,
    pub(super) lower_beyond_free: usize,
    pub(super) out_of_order: usize,
}

/// docs/exporter.md, "Lease scheduling": a Lease takes an exporter only when fewer competing
/// Leases wait ahead of it than exporters are free, so several heads may take in any order, but
/// never one with as many earlier Leases of its priority waiting as there were free exporters.
/// The free exporters are counted generously (held: assigned SLACK before, ended SLACK after).
pub(super) fn fairness(rows: &[Row], scarce: usize, t0: Instant) -> Fairness {
    let mut f = Fairness::default();
    for b in rows {
        let tb = b.assigned;
        let held = rows
            .iter()
            .filter(|x| x.key.name != b.key.name && x.assigned + SLACK <= tb)
            .filter(|x| x.ended.is_none_or(|e| e > tb + SLACK))
            .count();
        let free = scarce.saturating_sub(held);
        let waiting = |a: &&Row| a.seen + SLACK * 2 <= tb && a.assigned > tb + SLACK;
        let prio = b.key.priority;
        let earlier = |a: &&Row| a.key.priority == prio && a.key < b.key;
        let same = rows.iter().filter(earlier).filter(waiting).count();
        let higher = rows
            .iter()
            .filter(|a| a.key.priority > prio)
            .filter(waiting)
            .count();
        if same > 0 && same >= free {
            f.violations.push(format!(
                "{} (priority {prio}) assigned {:.1} s in while {same} earlier Leases of its priority waited, at most {free} exporters free",
                b.key.name,
                (tb - t0).as_secs_f64()
            ));
        }
        if higher > 0 {
            f.lower_first += 1;
            f.lower_beyond_free += usize::from(higher + same >= free);
        }
        let passed = |a: &Row| earlier(&a) && a.assigned > tb + SLACK;
        f.out_of_order += usize::from(rows.iter().any(passed));
    }
    f
}

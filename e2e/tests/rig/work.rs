//! Work of every feature left in flight when a fault hits, and the final state a single
//! correct leader must reach afterwards; plus a monitor that watches for states no single
//! leader would produce while the fault plays out.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::{
    Api,
    runtime::{WatchStreamExt, reflector, watcher},
};
use serde_json::json;
use ucm::exporter::crd::Lease;
use ucm::snapshot::types::{MiroirSnapshot, SlotState};

use super::*;

/// What `World::start_work` left in flight. Names: exporter `e1`; lease `l1` (short, expires
/// after the fault) and `l2` (waits for e1); export `x1` (Pod created, not ready) and `x2` (no
/// PVC, deleted at its TTL).
pub struct Work {
    pub vol: String,
    pub snap: String,
    pub data: Vec<u8>,
    /// Labels selecting this work's exporter (unique, so leases of other tests never match).
    pub pool: String,
    pub token: String,
}

impl World {
    /// Starts work of every feature and returns once each is mid-way: l1 holds e1 and l2
    /// waits for it; x1's Pod exists but is not ready and x2 waits for its TTL; a snapshot
    /// round is open with legs a and b holding their barriers and agent c down (so the round
    /// cannot finish before the fault).
    pub async fn start_work(&mut self, l1_duration: Duration) -> Work {
        let pool = unique("pool");
        // vmexport first: its TTL clock starts at creation.
        self.create_pvc("d1").await;
        self.create_export("x1", "d1", None).await;
        self.create_export("x2", "missing", Some("25s")).await;

        self.create_exporter("e1", json!({"pool": pool})).await;
        self.report_available("e1").await;
        let token = self.wait_exporter_token("e1").await;
        self.create_lease(
            "l1",
            json!({"pool": pool}),
            &format!("{}s", l1_duration.as_secs()),
        )
        .await;
        self.wait_lease("l1", "l1 to hold e1", TIMEOUT, |l| {
            l.status.as_ref().and_then(|s| s.exporter_ref_name()) == Some("e1")
        })
        .await;
        self.create_lease("l2", json!({"pool": pool}), "1h").await;
        self.wait_lease("l2", "l2 Pending/NotAvailable", TIMEOUT, |l| {
            condition(
                l.status.as_ref().and_then(|s| s.conditions.as_ref()),
                "Pending",
            )
            .is_some_and(|(s, r, _)| s == "True" && r == "NotAvailable")
        })
        .await;

        self.wait_export("x1", "x1's Pod", TIMEOUT, |e| {
            export_phase(e) == ("Pending".into(), "PodPending".into())
        })
        .await;
        self.wait_export("x2", "x2 waiting for its PVC", TIMEOUT, |e| {
            e.status
                .as_ref()
                .is_some_and(|s| s.ttl_expiration_time.is_some())
        })
        .await;

        let vol = unique("pvc");
        let snap = unique("snap");
        let data = self.volume(&vol, &["a", "b", "c"], 8 * MIB).await;
        self.agent("c").kill();
        self.create_snapshot(&snap, &vol).await;
        let (a, b) = (self.node("a"), self.node("b"));
        wait_snapshot(
            self,
            &snap,
            "a round open with a and b Suspended",
            TIMEOUT,
            |s| {
                let sl = slots(s);
                open_round(s).is_some()
                    && sl.get(&a) == Some(&SlotState::Suspended)
                    && sl.get(&b) == Some(&SlotState::Suspended)
            },
        )
        .await;
        Work {
            vol,
            snap,
            data,
            pool,
            token,
        }
    }

    /// Brings back what the fault test stopped (agent c) and checks that every object reached
    /// the state a single leader would have produced without the fault.
    pub async fn finish_work(&mut self, work: &Work, timeout: Duration) {
        if !self.agent("c").alive() {
            self.start_agent("c");
        }
        // vmexport: x1 becomes Ready (a recreated Pod is marked too), x2 is deleted at its TTL,
        // and a new export made after the fault is served (the watches are alive).
        self.create_pvc("d3").await;
        self.create_export("x3", "d3", None).await;
        let x1 = self.drive_export_ready("x1", timeout).await;
        self.drive_export_ready("x3", timeout).await;
        eventually(timeout, "x2 to be deleted at its TTL", || async {
            self.export("x2").await.is_none()
        })
        .await;
        self.assert_export_children_unique("x1").await;
        self.assert_export_children_unique("x3").await;
        assert!(x1.status.unwrap().links.is_some());

        // exporter: l1 expired, l2 holds e1, e1 points at l2, the token was never re-minted.
        let l1 = self
            .wait_lease("l1", "l1 to expire", timeout, |l| {
                l.status.as_ref().is_some_and(|s| s.ended)
            })
            .await;
        let ready = condition(
            l1.status.as_ref().and_then(|s| s.conditions.as_ref()),
            "Ready",
        );
        assert_eq!(
            ready.as_ref().map(|(s, r, _)| (s.as_str(), r.as_str())),
            Some(("False", "Expired")),
            "l1 {:?}",
            l1.status
        );
        self.wait_lease("l2", "l2 to hold e1", timeout, |l| {
            l.status.as_ref().and_then(|s| s.exporter_ref_name()) == Some("e1")
                && !l.status.as_ref().is_some_and(|s| s.ended)
        })
        .await;
        eventually(timeout, "e1.status.leaseRef = l2", || async {
            self.exporters()
                .get_opt("e1")
                .await
                .ok()
                .flatten()
                .and_then(|e| e.status?.lease_ref)
                .is_some_and(|r| r.name == "l2")
        })
        .await;
        assert_eq!(
            self.exporter_token("e1").await.as_deref(),
            Some(work.token.as_str()),
            "e1's token was re-minted"
        );

        // snapshot: published with every leg cut once, under the published round.
        let s = self
            .assert_snapshot_published(&work.snap, &["a", "b", "c"], &work.data, timeout)
            .await;
        let stamp = s.status.unwrap().suspended_at.unwrap();
        let opened_ns = stamp
            .parse::<jiff::Timestamp>()
            .unwrap_or_else(|e| panic!("suspendedAt {stamp}: {e}"))
            .as_nanosecond() as u128;
        for n in ["a", "b", "c"] {
            let cuts: Vec<u128> = self
                .events(n)
                .into_iter()
                .filter(|e| e.volume == work.vol && e.event == "cut")
                .map(|e| e.at_ns)
                .collect();
            assert!(
                cuts.last().is_some_and(|t| *t >= opened_ns),
                "node {n}: no cut under the published round {stamp}: {cuts:?}"
            );
        }
    }
}

/// Watches the work's objects while a fault plays out and records every state that no single
/// leader would produce: two active Leases holding one Exporter; a MiroirSnapshot with a
/// non-Pending slot outside a live round (a leg's Done written under a voided round), or a
/// published one that changes; a second token for one Exporter.
pub struct Monitor {
    violations: Arc<Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Monitor {
    pub fn start(w: &World, work: &Work) -> Monitor {
        let violations: Arc<Mutex<Vec<String>>> = Default::default();
        let mut tasks = vec![];

        // Leases: at most one active lease per exporter, in every state the server went through.
        let (reader, writer) = reflector::store::<Lease>();
        let leases = watcher(w.leases(), watcher::Config::default())
            .default_backoff()
            .reflect(writer);
        let v = violations.clone();
        tasks.push(tokio::spawn(async move {
            let mut leases = std::pin::pin!(leases);
            let mut listing = false;
            while let Some(ev) = leases.next().await {
                match ev {
                    Ok(watcher::Event::Init) => listing = true,
                    Ok(watcher::Event::InitDone) => listing = false,
                    _ => {}
                }
                if listing {
                    continue;
                }
                let mut holders: BTreeMap<String, Vec<String>> = BTreeMap::new();
                for l in reader.state() {
                    let Some(st) = l.status.as_ref() else {
                        continue;
                    };
                    if st.ended {
                        continue;
                    }
                    if let Some(e) = st.exporter_ref_name() {
                        holders
                            .entry(e.to_string())
                            .or_default()
                            .push(l.metadata.name.clone().unwrap_or_default());
                    }
                }
                for (e, ls) in holders.into_iter().filter(|(_, ls)| ls.len() > 1) {
                    v.lock()
                        .unwrap()
                        .push(format!("exporter {e} held by active leases {ls:?}"));
                }
            }
        }));

        // The snapshot: slots are non-Pending only inside a live round or when published, and a
        // published status never changes (I13, docs/snapshot.md, "Invariants").
        let snaps: Api<MiroirSnapshot> = w.snapshots();
        let cfg = watcher::Config::default().fields(&format!("metadata.name={}", work.snap));
        let v = violations.clone();
        tasks.push(tokio::spawn(async move {
            let mut published: Option<String> = None;
            let mut events = std::pin::pin!(watcher(snaps, cfg).default_backoff());
            while let Some(ev) = events.next().await {
                let Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s)) = ev else {
                    continue;
                };
                let Some(st) = s.status.as_ref() else {
                    continue;
                };
                let text = serde_json::to_string(st).unwrap_or_default();
                if let Some(p) = &published {
                    if *p != text {
                        v.lock()
                            .unwrap()
                            .push(format!("published snapshot changed: {p} -> {text}"));
                    }
                    continue;
                }
                if st.ready_to_use == Some(true) {
                    if st.io_suspended != Some(false)
                        || st
                            .per_node
                            .iter()
                            .flatten()
                            .any(|(_, s)| *s != SlotState::Done)
                    {
                        v.lock()
                            .unwrap()
                            .push(format!("published with an unfinished leg: {text}"));
                    }
                    published = Some(text);
                } else if st.io_suspended != Some(true)
                    && st
                        .per_node
                        .iter()
                        .flatten()
                        .any(|(_, s)| *s != SlotState::Pending)
                {
                    v.lock()
                        .unwrap()
                        .push(format!("leg state outside a live round: {text}"));
                }
            }
        }));

        // The exporter's credential: one token for its whole life here.
        let secrets: Api<Secret> = Api::namespaced(w.client.clone(), &w.ns);
        let cfg = watcher::Config::default().fields("metadata.name=e1-exporter");
        let v = violations.clone();
        let first = work.token.clone();
        tasks.push(tokio::spawn(async move {
            let mut seen = BTreeSet::from([first]);
            let mut events = std::pin::pin!(watcher(secrets, cfg).default_backoff());
            while let Some(ev) = events.next().await {
                if let Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s)) = ev
                    && let Some(t) = s
                        .data
                        .as_ref()
                        .and_then(|d| d.get("token"))
                        .and_then(|b| String::from_utf8(b.0.clone()).ok())
                    && seen.insert(t)
                {
                    v.lock()
                        .unwrap()
                        .push(format!("e1 got a token #{}", seen.len()));
                }
            }
        }));
        Monitor { violations, tasks }
    }

    /// Lets the watches deliver what is in flight, then fails on any recorded violation.
    pub async fn assert_clean(&self) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let v = self.violations.lock().unwrap().clone();
        assert!(
            v.is_empty(),
            "states no single leader would produce:\n{}",
            v.join("\n")
        );
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

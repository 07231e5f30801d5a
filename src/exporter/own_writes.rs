//! What this replica wrote that its caches may not show yet, each kept in the runtime's
//! [`OwnWrites`] (docs/runtime.md, "Own writes"): lease assignments ([`Ledger`]), status writes
//! whose echo has not arrived ([`Replacements`]), and the tokens in credential Secrets, whose data
//! the metadata-only Secret cache does not hold ([`Tokens`]).
//!
//! Lease assignment decides from caches (docs/exporter.md, "Lease assignment"): the Exporters,
//! active Leases, policies and Clients that the watches keep, with no request. The one thing those
//! caches can miss that matters is our own latest assignment: between the status write that gives
//! exporter E to lease L and the watch event that brings it back, another pending lease would see E
//! free. The [`Ledger`] holds each assignment from the moment it is decided until the Lease cache
//! shows it (or shows L gone or ended), and the decision counts its entries as active leases.
//! Deciding and reserving happen under one lock, so concurrent workers never pick the same
//! exporter. The ledger is per replica, which is enough: only the leader writes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::exporter::auth::token;
use crate::exporter::crd::{Lease, LeaseStatus};
use crate::exporter::decide::lease::Assignment;
use crate::exporter::decide::lease::expiry::{is_active, is_ended_label};
use crate::runtime::controller::Guarded;
use crate::runtime::own_writes::{OwnWrites, Replaced};

/// In-flight assignments: (namespace, lease) → (exporter, spot access).
#[derive(Default)]
pub struct Ledger {
    assignments: OwnWrites<(String, bool)>,
}

impl Ledger {
    /// Runs `decide` with the namespace's cached Leases plus the in-flight assignments the cache
    /// does not show yet, and reserves the exporter it assigns. `snapshot` reads every Lease of
    /// the namespace from the Lease cache (ended ones leave it); it is read under the ledger's
    /// lock, so it is never older than the snapshot an entry was reserved against: a lease
    /// missing from it has really ended or gone, not just not reached an older copy.
    pub fn decide(
        &self,
        namespace: &str,
        lease: &str,
        snapshot: impl FnOnce() -> Vec<Arc<Guarded<Lease>>>,
        decide: impl FnOnce(&[&Lease]) -> Assignment,
    ) -> Assignment {
        let mut inner = self.assignments.lock();
        let guards = snapshot();
        let cached: Vec<&Lease> = guards.iter().filter_map(|g| g.0.as_ref().ok()).collect();
        // An entry is done once the cache shows its lease assigned, ended or gone.
        inner.retain(|(ns, l), _| {
            ns != namespace
                || cached.iter().any(|c| {
                    c.metadata.name.as_deref() == Some(l.as_str())
                        && c.status
                            .as_ref()
                            .is_none_or(|s| !s.ended && s.exporter_ref_name().is_none())
                })
        });
        let in_flight: Vec<Lease> = inner
            .iter()
            .filter(|((ns, l), _)| ns == namespace && l != lease)
            .map(|((_, l), (exporter, spot))| assigned(l, exporter, *spot))
            .collect();
        // A Lease this replica has not written yet (no status) waits in the queue too: leaving
        // it out let later Leases pass earlier ones still owed their first pass. One in flight
        // is its stand-in only: its cached copy (still unassigned) counted it a second time, as
        // a Lease waiting ahead, while its stand-in held the exporter, so in a burst later Leases
        // saw more Leases ahead than free exporters and queued behind assignments already made.
        let flying: std::collections::HashSet<&str> = in_flight
            .iter()
            .filter_map(|l| l.metadata.name.as_deref())
            .collect();
        let mut active: Vec<&Lease> = cached
            .iter()
            .copied()
            .filter(|l| !flying.contains(l.metadata.name.as_deref().unwrap_or_default()))
            .filter(|l| is_active(l) || (l.status.is_none() && !is_ended_label(l)))
            .collect();
        active.extend(in_flight.iter());
        let decision = decide(&active);
        if let Assignment::Assign {
            exporter,
            spot_access,
            ..
        } = &decision
        {
            inner.insert(namespace, lease, (exporter.clone(), *spot_access));
        }
        decision
    }

    /// The assignment of `lease` was not written (an error or a conflict): its exporter is free.
    pub fn release(&self, namespace: &str, lease: &str) {
        self.assignments.forget(namespace, lease);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.assignments.lock().len()
    }
}

/// A stand-in for an assigned lease, as the leased filter reads it.
fn assigned(name: &str, exporter: &str, spot: bool) -> Lease {
    let mut lease = Lease::new(name, Default::default());
    let status: LeaseStatus = serde_json::from_value(serde_json::json!({
        "ended": false,
        "exporterRef": {"name": exporter},
        "spotAccess": spot,
    }))
    .expect("a valid lease status");
    lease.status = Some(status);
    lease
}

/// Status writes per kind (see [`Replaced`]).
#[derive(Default)]
pub struct Replacements {
    pub exporters: Replaced,
    pub clients: Replaced,
    pub leases: Replaced,
}

/// (namespace, Secret) → (resourceVersion, token): what the token a credential Secret held at
/// that version is, as this replica wrote or read it. While the Secret cache shows the same
/// version, the token is known without a GET (Secrets are cached as metadata only, so no other
/// Secret data is held). Only credentials of this feature's objects are kept, each as read once
/// ([`token::Read`]: subject, holder and times, not the JWT).
pub struct Tokens {
    known: OwnWrites<(String, token::Read)>,
    /// The size at which entries of deleted Secrets are dropped next (doubles each time).
    prune_at: AtomicUsize,
    /// False while a starting manager reads every credential Secret once
    /// (`apply::credential::prime_tokens`): a pass waits for that rather than GET its own Secret.
    primed: tokio::sync::watch::Sender<bool>,
}

impl Default for Tokens {
    fn default() -> Self {
        Tokens {
            known: Default::default(),
            prune_at: AtomicUsize::new(0),
            primed: tokio::sync::watch::Sender::new(true),
        }
    }
}

impl Tokens {
    /// Tokens that passes wait for until [`Tokens::primed`] is called.
    pub fn priming() -> Self {
        Tokens {
            primed: tokio::sync::watch::Sender::new(false),
            ..Default::default()
        }
    }

    pub fn primed(&self) {
        self.primed.send_replace(true);
    }

    pub async fn wait_primed(&self) {
        let mut rx = self.primed.subscribe();
        let _ = rx.wait_for(|p| *p).await;
    }

    pub fn get(&self, namespace: &str, name: &str, rv: &str) -> Option<token::Read> {
        match self.known.get(namespace, name) {
            Some((at, token)) if at == rv => Some(token),
            _ => None,
        }
    }

    /// Remembers the token at `rv`. Entries whose Secret `exists` no longer are dropped now and
    /// then (amortised: when the map has doubled since the last time).
    pub fn put(
        &self,
        namespace: &str,
        name: &str,
        rv: &str,
        token: token::Read,
        exists: impl Fn(&str, &str) -> bool,
    ) {
        let mut known = self.known.lock();
        known.insert(namespace, name, (rv.to_string(), token));
        if known.len() >= self.prune_at.load(Ordering::Relaxed).max(1024) {
            known.retain(|(ns, n), _| exists(ns, n));
            self.prune_at.store(known.len() * 2, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use crate::exporter::decide::lease::{ENDED_LABEL, ENDED_VALUE};

    fn pending(name: &str) -> Lease {
        let mut l = Lease::new(name, Default::default());
        l.status = Some(serde_json::from_value(serde_json::json!({"ended": false})).unwrap());
        l
    }

    /// A cache snapshot of these leases.
    fn cache(leases: &[&Lease]) -> impl FnOnce() -> Vec<Arc<Guarded<Lease>>> {
        let guards: Vec<_> = leases
            .iter()
            .map(|l| Arc::new(crate::runtime::Guarded(Ok((*l).clone()))))
            .collect();
        move || guards
    }

    fn assign(exporter: &str) -> Assignment {
        Assignment::Assign {
            exporter: exporter.into(),
            priority: 0,
            spot_access: false,
        }
    }

    /// The exporters the decision saw as leased.
    fn leased(active: &[&Lease]) -> Vec<String> {
        let mut v: Vec<String> = active
            .iter()
            .filter_map(|l| l.status.as_ref()?.exporter_ref_name().map(str::to_string))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_lease_not_yet_written_is_in_the_decision_and_an_ended_one_is_not() {
        let ledger = Ledger::default();
        // Created in a burst: the manager has written none of these yet.
        let (fresh, me) = (Lease::new("l0", Default::default()), pending("l1"));
        let mut ended = Lease::new("l9", Default::default());
        ended.metadata.labels = Some([(ENDED_LABEL.to_string(), ENDED_VALUE.to_string())].into());
        ledger.decide("lab", "l1", cache(&[&fresh, &me, &ended]), |active| {
            let mut names: Vec<&str> = active
                .iter()
                .map(|l| l.metadata.name.as_deref().unwrap())
                .collect();
            names.sort();
            assert_eq!(
                names,
                ["l0", "l1"],
                "l0 waits ahead of l1 before its first pass"
            );
            Assignment::Scheduled(Default::default())
        });
    }

    #[test]
    fn an_assignment_counts_as_leased_until_the_cache_shows_it() {
        let ledger = Ledger::default();
        let (l1, l2) = (pending("l1"), pending("l2"));
        let cached = [&l1, &l2];
        // l1 takes e1; the cache still shows l1 pending.
        ledger.decide("lab", "l1", cache(&cached), |active| {
            assert!(leased(active).is_empty());
            assign("e1")
        });
        // l2's pass sees e1 leased although no cached lease says so.
        ledger.decide("lab", "l2", cache(&cached), |active| {
            assert_eq!(leased(active), vec!["e1"]);
            assign("e2")
        });
        // Another namespace is not affected.
        ledger.decide("other", "l9", cache(&[]), |active| {
            assert!(leased(active).is_empty());
            Assignment::Scheduled(Default::default())
        });
        // The cache catches up with l1 (assigned): its entry goes, the cached lease counts.
        let mut l1_seen = pending("l1");
        l1_seen.status = Some(
            serde_json::from_value(
                serde_json::json!({"ended": false, "exporterRef": {"name": "e1"}}),
            )
            .unwrap(),
        );
        let l3 = pending("l3");
        ledger.decide("lab", "l3", cache(&[&l1_seen, &l2, &l3]), |active| {
            assert_eq!(leased(active), vec!["e1", "e2"]);
            Assignment::Pending {
                reason: "NotAvailable",
                message: String::new(),
            }
        });
        assert_eq!(ledger.len(), 1, "only l2's assignment is still in flight");
        // l2 ended or was deleted (it left the cache): its exporter is free again.
        ledger.decide("lab", "l3", cache(&[&l1_seen, &l3]), |active| {
            assert_eq!(leased(active), vec!["e1"]);
            Assignment::Scheduled(Default::default())
        });
        assert_eq!(ledger.len(), 0);
    }

    #[test]
    fn a_lease_in_flight_counts_once_as_assigned_not_also_as_waiting() {
        let ledger = Ledger::default();
        // A burst: l1 and l2 created, neither written yet; l1 takes e1.
        let (l1, l2) = (Lease::new("l1", Default::default()), pending("l2"));
        ledger.decide("lab", "l1", cache(&[&l1, &l2]), |_| assign("e1"));
        // l2's pass, before the cache shows l1 assigned: l1 holds e1 and waits nowhere.
        ledger.decide("lab", "l2", cache(&[&l1, &l2]), |active| {
            let l1s: Vec<&&Lease> = active
                .iter()
                .filter(|l| l.metadata.name.as_deref() == Some("l1"))
                .collect();
            assert_eq!(l1s.len(), 1, "l1 once: {active:?}");
            assert_eq!(
                l1s[0].status.as_ref().and_then(|s| s.exporter_ref_name()),
                Some("e1")
            );
            assign("e2")
        });
    }

    #[test]
    fn a_failed_write_frees_the_exporter_and_a_lease_never_blocks_itself() {
        let ledger = Ledger::default();
        let (l1, l2) = (pending("l1"), pending("l2"));
        ledger.decide("lab", "l1", cache(&[&l1, &l2]), |_| assign("e1"));
        // A second pass of l1 itself (its cache still stale) does not see its own entry.
        ledger.decide("lab", "l1", cache(&[&l1, &l2]), |active| {
            assert!(leased(active).is_empty());
            assign("e1")
        });
        ledger.release("lab", "l1");
        ledger.decide("lab", "l2", cache(&[&l1, &l2]), |active| {
            assert!(leased(active).is_empty(), "the released exporter is free");
            Assignment::Scheduled(Default::default())
        });
    }

    #[test]
    fn concurrent_decisions_never_assign_one_exporter_twice() {
        // Leases reach the cache while others are decided, as in a bulk create: each worker
        // adds its lease to the shared cache, then decides. A snapshot read outside the lock
        // could predate another lease's entry and drop it as gone (the bench caught that).
        let ledger = Arc::new(Ledger::default());
        let store: Arc<Mutex<Vec<Arc<Guarded<Lease>>>>> = Default::default();
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let (ledger, store) = (ledger.clone(), store.clone());
                std::thread::spawn(move || {
                    (0..8)
                        .filter_map(|i| {
                            let name = format!("l{}", t * 8 + i);
                            let guard = crate::runtime::Guarded(Ok(pending(&name)));
                            store.lock().unwrap().push(Arc::new(guard));
                            let snapshot = || store.lock().unwrap().clone();
                            // The first of 64 exporters that nothing holds.
                            match ledger.decide("lab", &name, snapshot, |active| {
                                let taken = leased(active);
                                (0..64)
                                    .map(|e| format!("e{e:02}"))
                                    .find(|e| !taken.contains(e))
                                    .map(|e| assign(&e))
                                    .unwrap_or(Assignment::Scheduled(Default::default()))
                            }) {
                                Assignment::Assign { exporter, .. } => Some(exporter),
                                _ => None,
                            }
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<String> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        assert_eq!(all.len(), 64);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 64, "every exporter went to exactly one lease");
    }

    #[test]
    fn a_token_is_known_only_at_the_version_it_was_seen() {
        let t = Tokens::default();
        let read: token::Read = Err(token::Invalid::Subject);
        t.put("lab", "e-exporter", "5", read.clone(), |_, _| true);
        assert_eq!(t.get("lab", "e-exporter", "5"), Some(read));
        // Someone else wrote the Secret since: read it again.
        assert_eq!(t.get("lab", "e-exporter", "6"), None);
        assert_eq!(t.get("other", "e-exporter", "5"), None);
    }

    #[test]
    fn tokens_of_deleted_secrets_are_dropped_as_the_map_grows() {
        let t = Tokens::default();
        // Every even Secret was deleted since.
        let exists = |_: &str, n: &str| n.trim_start_matches('s').parse::<u32>().unwrap() % 2 == 1;
        for i in 0..1024 {
            t.put(
                "lab",
                &format!("s{i}"),
                "1",
                Err(token::Invalid::NotUtf8),
                exists,
            );
        }
        let known = t.known.lock();
        assert_eq!(known.len(), 512);
        assert!(known.iter().all(|((_, n), _)| exists("lab", n)));
        assert_eq!(t.prune_at.load(Ordering::Relaxed), 1024);
    }
}

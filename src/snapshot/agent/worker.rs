//! Deciding and acting per volume: [`Context::handle`] runs one snapshot until it has to wait,
//! a pass runs every snapshot of a volume, one worker per volume serialises them (one action per
//! DRBD resource at a time), and the sweep catches what no event announced.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use jiff::Timestamp;
use kube::{ResourceExt, api::ListParams};
use tokio::sync::Notify;
use tracing::{error, info, warn};

use super::decide::{self, Held, Step};
use super::journal::Entry;
use crate::runtime::time::after;
use crate::snapshot::round::{RoundView, elapsed, parse_stamp};
use crate::snapshot::types::{MiroirSnapshot, SlotState};

use super::context::{Context, Next, RoundKey, event, merge_seen};

impl Context {
    /// Decides and acts for one snapshot until it has to wait; returns the next timer.
    pub(super) async fn handle(&self, mut s: MiroirSnapshot) -> Option<Timestamp> {
        let volume_name = s.spec.volume_name.clone();
        for _ in 0..8 {
            let vol = self.volume(&volume_name);
            let key = Context::round_key(&s);
            if let Some(k) = &key {
                merge_seen(
                    &mut s,
                    self.mem
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .seen
                        .entry(k.clone())
                        .or_default(),
                );
                self.check_skew(&s, k).await;
            }
            let entry = s.uid().and_then(|u| self.journal_get(&u));
            let since = entry.as_ref().map(|e| self.since_raise(e));
            let held = entry.as_ref().zip(since).map(|(e, d)| Held {
                suspended_at: e.suspended_at.as_str(),
                since_raise: d,
            });
            let local_primary = match &vol {
                Some(v) => self.local_primary(&s, v).await,
                None => false,
            };
            let d = decide::decide(
                &decide::Observed {
                    node: &self.node,
                    snapshot: Some(&s),
                    volume: vol.as_ref(),
                    held,
                    local_primary,
                    now: Timestamp::now(),
                },
                &self.settings,
            );
            // Stop (docs/snapshot.md, "Deadline, void and recovery"): a held barrier of a live
            // round reports Error once, then waits.
            if self.stopping.load(Ordering::Relaxed)
                && let (Some(k), Some(_)) = (&key, &entry)
                && matches!(d.step, Step::Wait | Step::Cut)
                && RoundView::of(&s).io_suspended
            {
                let first = self
                    .mem
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .noted
                    .insert((k.clone(), "stop"), ())
                    .is_none();
                if first {
                    info!(snapshot = %s.name_any(), "stopping: reporting Error so the round is voided");
                    match self.write_slot(&s, SlotState::Error).await {
                        Next::Again(o) => {
                            s = *o;
                            continue;
                        }
                        _ => return d.wake_at,
                    }
                }
                return d.wake_at;
            }
            let next = match d.step {
                Step::Wait => return d.wake_at,
                Step::Lift { teardown } => {
                    let e = entry?;
                    if self.lift(&e, Some(&s)).await.is_err() {
                        return Some(after(Timestamp::now(), Duration::from_secs(5)));
                    }
                    if teardown {
                        Next::Again(Box::new(s.clone()))
                    } else {
                        Next::Until(None)
                    }
                }
                Step::Teardown { delete_backends } => self.teardown(&s, delete_backends).await,
                Step::WriteSlot(st) => self.write_slot(&s, st).await,
                Step::Raise => match &vol {
                    Some(v) => self.raise(&s, v).await,
                    None => Next::Until(None),
                },
                Step::CutUnreplicated => match &vol {
                    Some(v) => self.cut(&s, v, false).await,
                    None => Next::Until(None),
                },
                Step::Cut => match &vol {
                    Some(v) => self.cut(&s, v, true).await,
                    None => Next::Until(None),
                },
            };
            match next {
                Next::Again(o) => s = *o,
                Next::Reread => match self.snapshots.get_opt(&s.name_any()).await {
                    Ok(Some(o)) => s = o,
                    Ok(None) => return None,
                    Err(e) => {
                        warn!(error = %e, "re-read failed");
                        return Some(after(Timestamp::now(), Duration::from_secs(1)));
                    }
                },
                Next::Until(t) => {
                    // Whatever the action, a held barrier keeps its deadline timer.
                    let lift = s.uid().and_then(|u| self.journal_get(&u)).map(|e| {
                        decide::lift_at(
                            &Held {
                                suspended_at: &e.suspended_at,
                                since_raise: self.since_raise(&e),
                            },
                            Timestamp::now(),
                            &self.settings,
                        )
                    });
                    return [t, lift].into_iter().flatten().min();
                }
            }
        }
        Some(after(Timestamp::now(), Duration::from_millis(200)))
    }

    pub(super) async fn check_skew(&self, s: &MiroirSnapshot, key: &RoundKey) {
        let Some(t) = parse_stamp(&key.1) else { return };
        if t > after(Timestamp::now(), self.settings.cut_guard) {
            let first = self
                .mem
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .noted
                .insert((key.clone(), "skew"), ())
                .is_none();
            if first {
                let msg = format!(
                    "suspendedAt {} is more than {}s in this node's future; check NTP",
                    key.1,
                    self.settings.cut_guard.as_secs()
                );
                warn!(snapshot = %s.name_any(), "{msg}");
                self.event(s, true, event::CLOCK_SKEW, "Raise", msg).await;
            }
        }
    }

    /// One pass over a volume: every snapshot of it, then journal entries whose object is gone.
    pub(super) async fn pass(&self, volume: &str) -> Option<Timestamp> {
        let lock = self.volume_lock(volume);
        let _g = lock.lock().await;
        let snaps = self.snapshots_of(volume);
        let mut wake: Option<Timestamp> = None;
        for s in &snaps {
            if let Some(t) = self.handle(s.clone()).await {
                wake = Some(wake.map_or(t, |w| w.min(t)));
            }
        }
        let present: Vec<String> = snaps.iter().filter_map(|s| s.uid()).collect();
        for e in self.journal_for_volume(volume) {
            if !present.contains(&e.uid) && self.lift(&e, None).await.is_err() {
                let t = after(Timestamp::now(), Duration::from_secs(5));
                wake = Some(wake.map_or(t, |w| w.min(t)));
            }
        }
        wake
    }

    /// Lifts this volume's journal entries whose deadline passed, without any API call.
    pub(super) async fn lift_expired(&self, volume: &str) {
        let lock = self.volume_lock(volume);
        let _g = lock.lock().await;
        for e in self.journal_for_volume(volume) {
            let held = Held {
                suspended_at: &e.suspended_at,
                since_raise: self.since_raise(&e),
            };
            if Timestamp::now() >= decide::lift_at(&held, Timestamp::now(), &self.settings) {
                warn!(volume = %e.volume, snapshot = %e.snapshot, "deadline passed without the API; lifting");
                let _ = self.lift(&e, None).await;
            }
        }
    }

    /// Forgets in-memory round state of snapshots that left the cache (bounded memory).
    pub(super) fn prune_memory(&self) {
        let present: std::collections::HashSet<String> = self
            .snap_store
            .state()
            .iter()
            .filter_map(|g| g.0.as_ref().ok().and_then(|s| s.uid()))
            .collect();
        let journal: std::collections::HashSet<String> = self
            .journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entries()
            .map(|e| e.uid.clone())
            .collect();
        let keep = |uid: &String| present.contains(uid) || journal.contains(uid);
        let mut m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        m.raised.retain(|u, _| keep(u));
        m.seen.retain(|(u, _), _| keep(u));
        m.failures.retain(|(u, _), _| keep(u));
        m.held_back.retain(|(u, _), _| keep(u));
        m.primary.retain(|(u, _), _| keep(u));
        m.noted.retain(|((u, _), _), _| keep(u));
        m.stuck.retain(|u, _| keep(u));
    }

    /// The stale-barrier sweep (docs/snapshot.md, "Deadline, void and recovery"): kernel flags and
    /// journal entries without a live round are lifted; live rounds are kept (and adopted through
    /// the journal).
    pub(super) async fn sweep(self: &Arc<Self>) {
        let live: Option<Vec<(String, String, String)>> = match self
            .snapshots
            .list(&ListParams::default())
            .await
        {
            Ok(l) => {
                let now = Timestamp::now();
                Some(
                    l.items
                        .iter()
                        .filter_map(|s| {
                            let r = RoundView::of(s);
                            let at = r.suspended_at?;
                            let live = r.io_suspended
                                && !r.ready
                                && parse_stamp(at)
                                    .is_some_and(|t| now < after(t, self.settings.deadline));
                            live.then(|| {
                                (
                                    s.spec.volume_name.clone(),
                                    s.uid().unwrap_or_default(),
                                    at.to_string(),
                                )
                            })
                        })
                        .collect(),
                )
            }
            Err(e) => {
                warn!(error = %e, "sweep: cannot list snapshots; only expired journal entries are lifted");
                None
            }
        };
        let entries: Vec<Entry> = self
            .journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entries()
            .cloned()
            .collect();
        for e in &entries {
            let is_live = match &live {
                Some(l) => l
                    .iter()
                    .any(|(_, u, at)| *u == e.uid && *at == e.suspended_at),
                // Without the API, only the deadline decides.
                None => {
                    Timestamp::now()
                        < decide::lift_at(
                            &Held {
                                suspended_at: &e.suspended_at,
                                since_raise: self.since_raise(e),
                            },
                            Timestamp::now(),
                            &self.settings,
                        )
                }
            };
            if !is_live {
                let lock = self.volume_lock(&e.volume);
                let _g = lock.lock().await;
                warn!(volume = %e.volume, snapshot = %e.snapshot, "lifting stale IO barrier");
                let _ = self.lift(e, None).await;
            } else {
                // Adopted: the volume's worker continues the round from the journal.
                self.notify(&e.volume);
            }
        }
        let (Some(live), Ok(flags)) = (&live, self.barrier.suspended().await) else {
            return;
        };
        for v in flags {
            if live.iter().any(|(vol, _, _)| *vol == v) {
                continue;
            }
            let lock = self.volume_lock(&v);
            let _g = lock.lock().await;
            if !self.journal_for_volume(&v).is_empty() {
                continue;
            }
            warn!(volume = %v, "lifting stale IO barrier");
            if let Err(e) = self.barrier.resume(&v).await {
                error!(volume = %v, error = %e, "sweep: resume-io failed");
                continue;
            }
            if let Ok(Some(mp)) = self.barrier.mountpoint(&v).await
                && let Err(e) = self.barrier.thaw(&v, &mp).await
            {
                warn!(volume = %v, error = %e, "sweep: thaw failed");
            }
        }
        self.update_gauge().await;
    }

    pub(super) fn notify(self: &Arc<Self>, volume: &str) {
        let n = {
            let mut w = self.workers.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = w.get(volume) {
                n.notify_one();
                return;
            }
            let n = Arc::new(Notify::new());
            w.insert(volume.to_string(), n.clone());
            n
        };
        tokio::spawn(volume_worker(self.clone(), volume.to_string(), n));
    }

    pub(super) fn notify_all(self: &Arc<Self>) {
        for n in self
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            n.notify_one();
        }
    }
}

pub(super) async fn volume_worker(ctx: Arc<Context>, volume: String, notify: Arc<Notify>) {
    // Never act on a partial cache: a journal entry whose snapshot is merely not listed yet
    // must not look like a deleted snapshot. Held barriers still lift at the deadline.
    let mut synced = ctx.synced.subscribe();
    let ready = synced.wait_for(|(a, b)| *a && *b);
    let deadline = ctx
        .journal_for_volume(&volume)
        .iter()
        .map(|e| {
            let at = decide::lift_at(
                &Held {
                    suspended_at: &e.suspended_at,
                    since_raise: ctx.since_raise(e),
                },
                Timestamp::now(),
                &ctx.settings,
            );
            elapsed(Timestamp::now(), at)
        })
        .min();
    match deadline {
        Some(d) => {
            if tokio::time::timeout(d, ready).await.is_err() {
                // No API, no list: lift what expired, with no API call.
                ctx.lift_expired(&volume).await;
                let _ = synced.wait_for(|(a, b)| *a && *b).await;
            }
        }
        None => {
            let _ = ready.await;
        }
    }
    loop {
        let wake = ctx.pass(&volume).await;
        let sleep = wake.map(|t| elapsed(Timestamp::now(), t).max(Duration::from_millis(10)));
        match sleep {
            Some(d) => {
                tokio::select! {
                    _ = notify.notified() => {}
                    _ = tokio::time::sleep(d) => {}
                }
            }
            None => notify.notified().await,
        }
    }
}

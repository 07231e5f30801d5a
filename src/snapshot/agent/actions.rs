//! The agent's actions on one leg (docs/snapshot.md, "Raise and cut"): the fenced slot write,
//! raise (barrier up), cut, lift (barrier down) and teardown of a deleted snapshot's backends.
//! I1–I13: docs/snapshot.md, "Invariants".

use std::time::{Duration, Instant};

use jiff::Timestamp;
use kube::{
    ResourceExt,
    api::{Patch, PatchParams},
};
use tracing::{debug, error, info, warn};

use super::barrier;
use super::decide::{self};
use super::journal::Entry;
use crate::runtime::time::after;
use crate::snapshot::round::{self, RoundView};
use crate::snapshot::types::{MiroirSnapshot, MiroirVolume, SlotState, teardown_finalizer};

use super::context::{Context, Next, RoundKey, event, soon};
use crate::runtime::writer::is_not_found;

impl Context {
    /// The fenced slot write (docs/snapshot.md, "Slot writes").
    pub(super) async fn write_slot(&self, s: &MiroirSnapshot, state: SlotState) -> Next {
        let (Some(uid), Some(at)) = (s.uid(), RoundView::of(s).suspended_at.map(str::to_string))
        else {
            return Next::Until(None);
        };
        let patch = round::agent_slot_patch(&uid, &at, &self.node, state);
        let patch: json_patch::Patch = match serde_json::from_value(patch) {
            Ok(p) => p,
            Err(e) => {
                error!(error = %e, "cannot encode slot patch");
                return Next::Until(None);
            }
        };
        match self
            .snapshots
            .patch_status(
                &s.name_any(),
                &PatchParams::default(),
                &Patch::<()>::Json(patch),
            )
            .await
        {
            Ok(obj) => {
                self.mem
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .seen
                    .entry((uid, at))
                    .or_default()
                    .insert(self.node.clone(), state);
                debug!(snapshot = %s.name_any(), slot = %state, "slot written");
                Next::Again(Box::new(obj))
            }
            Err(e) if crate::runtime::writer::is_fenced_out(&e) => {
                debug!(snapshot = %s.name_any(), "slot write fenced out: the round moved on");
                Next::Reread
            }
            Err(e) if is_not_found(&e) => Next::Until(None),
            Err(e) => {
                // Fail closed: the barrier stays; resend while the round is live (docs/snapshot.md,
                // "Slot writes").
                warn!(snapshot = %s.name_any(), error = %e, "slot write failed; retrying");
                soon(Duration::from_secs(1))
            }
        }
    }

    pub(super) fn count_failure(&self, key: &RoundKey) -> u32 {
        let mut m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.failures.entry(key.clone()).or_insert(0);
        *n += 1;
        *n
    }

    pub(super) fn clear_failures(&self, key: &RoundKey) {
        self.mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .failures
            .remove(key);
    }

    /// Failure handling shared by raise and cut: retry 1 s apart until the limit or the cutoff,
    /// then write Error with a Warning event.
    pub(super) async fn failed(
        &self,
        s: &MiroirSnapshot,
        key: &RoundKey,
        reason: &'static str,
        msg: String,
    ) -> Next {
        let n = self.count_failure(key);
        let in_time = decide::before_cutoff(&key.1, None, Timestamp::now(), &self.settings);
        warn!(snapshot = %s.name_any(), attempt = n, error = %msg, "{reason}");
        if n >= self.fail_limit || !in_time {
            self.event(s, true, reason, "Snapshot", format!("{msg} ({n} attempts)"))
                .await;
            return self.write_slot(s, SlotState::Error).await;
        }
        soon(Duration::from_secs(1))
    }

    pub(super) async fn refuse(&self, s: &MiroirSnapshot, msg: String) -> Next {
        warn!(snapshot = %s.name_any(), "{msg}");
        self.event(s, true, event::RAISE_REFUSED, "Raise", msg)
            .await;
        self.write_slot(s, SlotState::Error).await
    }

    pub(super) async fn raise(&self, s: &MiroirSnapshot, vol: &MiroirVolume) -> Next {
        let Some(key) = Context::round_key(s) else {
            return Next::Until(None);
        };
        let (uid, at) = key.clone();
        let v = vol.name_any();
        let diskful = vol.diskful_nodes().contains(&self.node);
        // This process already raised for this round: only the slot write is missing.
        let ours = self.journal_get(&uid).is_some_and(|e| e.suspended_at == at)
            && self
                .mem
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .raised
                .contains_key(&uid);
        if ours {
            return self.write_slot(s, SlotState::Suspended).await;
        }
        if diskful && let Err(msg) = self.backend_for(vol) {
            return self.refuse(s, msg).await;
        }
        let others: Vec<String> = vol
            .replica_nodes()
            .into_iter()
            .filter(|n| *n != self.node)
            .collect();
        let status = match self.barrier.status(&v).await {
            Ok(Some(st)) => st.name_peer(&others),
            Ok(None) => {
                return self
                    .refuse(
                        s,
                        format!("DRBD resource {v} is not configured on node {}", self.node),
                    )
                    .await;
            }
            Err(e) => return self.failed(s, &key, event::BARRIER_STUCK, e.0).await,
        };
        let peers: Vec<String> = vol
            .diskful_nodes()
            .into_iter()
            .filter(|n| *n != self.node)
            .collect();
        if let Err(msg) = barrier::healthy(&status, diskful, &peers) {
            return self
                .refuse(s, format!("cannot raise the barrier on {v}: {msg}"))
                .await;
        }
        let holds = self.journal_get(&uid).is_some_and(|e| e.suspended_at == at);
        if let Err(msg) = barrier::flag_free(&status, &v, holds) {
            return self.refuse(s, msg).await;
        }
        let started = Instant::now();
        let mut entry = Entry {
            volume: v.clone(),
            snapshot: s.name_any(),
            uid: uid.clone(),
            suspended_at: at.clone(),
            mountpoint: None,
            raised_at: Timestamp::now().to_string(),
        };
        if let Err(e) = self.journal_put(entry.clone()) {
            return self
                .failed(s, &key, event::BARRIER_STUCK, format!("journal: {e}"))
                .await;
        }
        self.mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .raised
            .entry(uid.clone())
            .or_insert(started);
        // Freeze before suspend, so flushed pages still replicate (I11).
        let mountpoint = match self.barrier.mountpoint(&v).await {
            Ok(mp) => mp,
            Err(e) => return self.raise_failed(s, &key, &entry, e.0).await,
        };
        if let Some(mp) = &mountpoint {
            entry.mountpoint = Some(mp.clone());
            if let Err(e) = self.journal_put(entry.clone()) {
                return self
                    .raise_failed(s, &key, &entry, format!("journal: {e}"))
                    .await;
            }
        }
        // The writers' IO pause starts here (docs/snapshot.md, "Metrics and alert").
        let paused_at = Timestamp::now();
        let pause = Instant::now();
        self.mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .paused
            .entry(uid.clone())
            .or_insert(pause);
        if let Some(mp) = &mountpoint
            && let Err(e) = self.barrier.freeze(&v, mp).await
        {
            return self.raise_failed(s, &key, &entry, e.0).await;
        }
        let frozen = pause.elapsed();
        if let Err(e) = self.barrier.suspend(&v).await {
            return self.raise_failed(s, &key, &entry, e.0).await;
        }
        info!(
            volume = %v, snapshot = %s.name_any(), %paused_at,
            freeze_ms = ms(frozen), suspend_ms = ms(pause.elapsed() - frozen),
            "barrier raised"
        );
        self.clear_failures(&key);
        let next = self.write_slot(s, SlotState::Suspended).await;
        self.update_gauge().await;
        next
    }

    /// A failed freeze or suspend: thaw, clear the flag the call may have set unless another
    /// live round holds the volume (#382), forget the entry, then count the failure.
    pub(super) async fn raise_failed(
        &self,
        s: &MiroirSnapshot,
        key: &RoundKey,
        entry: &Entry,
        msg: String,
    ) -> Next {
        if let Some(mp) = &entry.mountpoint
            && let Err(e) = self.barrier.thaw(&entry.volume, mp).await
        {
            warn!(volume = %entry.volume, error = %e, "thaw after a failed raise failed");
        }
        if !self.other_live_round(&entry.volume, &entry.uid)
            && let Err(e) = self.barrier.resume(&entry.volume).await
        {
            warn!(volume = %entry.volume, error = %e, "resume-io after a failed raise failed");
        }
        let _ = self.journal_remove(&entry.uid);
        {
            let mut m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
            m.raised.remove(&entry.uid);
            m.paused.remove(&entry.uid);
        }
        self.update_gauge().await;
        self.failed(
            s,
            key,
            event::BARRIER_STUCK,
            format!("raise on {}: {msg}", entry.volume),
        )
        .await
    }

    pub(super) async fn cut(
        &self,
        s: &MiroirSnapshot,
        vol: &MiroirVolume,
        replicated: bool,
    ) -> Next {
        let Some(key) = Context::round_key(s) else {
            return Next::Until(None);
        };
        let v = vol.name_any();
        let name = s.name_any();
        let (backend, _pool) = match self.backend_for(vol) {
            Ok(b) => b,
            Err(msg) => return self.refuse(s, msg).await,
        };
        let since_raise = self.journal_get(&key.0).map(|e| self.since_raise(&e));
        if replicated {
            // The kernel view (precondition 3 of "Raise and cut") and I2, read once before the cut.
            let others: Vec<String> = vol
                .replica_nodes()
                .into_iter()
                .filter(|n| *n != self.node)
                .collect();
            let status = match self.barrier.status(&v).await {
                Ok(Some(st)) => st.name_peer(&others),
                Ok(None) => {
                    return self
                        .failed(
                            s,
                            &key,
                            event::CUT_FAILED,
                            format!("DRBD resource {v} vanished"),
                        )
                        .await;
                }
                Err(e) => return self.failed(s, &key, event::CUT_FAILED, e.0).await,
            };
            let peers: Vec<String> = vol
                .diskful_nodes()
                .into_iter()
                .filter(|n| *n != self.node)
                .collect();
            if let Err(msg) = barrier::healthy(&status, true, &peers) {
                return self.failed(s, &key, event::CUT_FAILED, msg).await;
            }
            let primaries = status.primary_peers();
            if let Some(p) = decide::primary_holding_back(&primaries, s) {
                let (since, sent) = *self
                    .mem
                    .lock()
                    .unwrap_or_else(|x| x.into_inner())
                    .held_back
                    .entry(key.clone())
                    .or_insert((Instant::now(), false));
                if since.elapsed() >= Duration::from_secs(5) && !sent {
                    self.mem
                        .lock()
                        .unwrap_or_else(|x| x.into_inner())
                        .held_back
                        .insert(key.clone(), (since, true));
                    let msg =
                        format!("the Primary {p} has not raised its barrier; the cut waits for it");
                    self.event(s, true, event::WAITING_FOR_PRIMARY, "Cut", msg)
                        .await;
                }
                // Its slot change wakes us; the timer only drives the event.
                return if sent {
                    Next::Until(None)
                } else {
                    Next::Until(Some(after(
                        Timestamp::now(),
                        Duration::from_secs(5).saturating_sub(since.elapsed()),
                    )))
                };
            }
            // Re-assert suspend-io before every cut (I10).
            if let Err(e) = self.barrier.suspend(&v).await {
                return self.failed(s, &key, event::BARRIER_STUCK, e.0).await;
            }
        }
        if !decide::before_cutoff(&key.1, since_raise, Timestamp::now(), &self.settings) {
            return Next::Until(None);
        }
        let started_at = Timestamp::now();
        let t0 = Instant::now();
        let res = async {
            backend.sync(&v).await?;
            // Delete then cut (I9): a leftover from a voided round never passes as this one.
            backend.delete(&name).await?;
            backend.cut(&v, &name).await
        }
        .await;
        let took = t0.elapsed();
        self.metrics
            .cut_seconds
            .with_label_values(&[backend.kind().as_str()])
            .observe(took.as_secs_f64());
        if let Err(e) = res {
            return self.failed(s, &key, event::CUT_FAILED, e.to_string()).await;
        }
        info!(
            volume = %v, snapshot = %name, backend = backend.kind().as_str(), %started_at,
            cut_ms = ms(took), "cut"
        );
        self.barrier.note_cut(&v, &name, took).await;
        self.clear_failures(&key);
        // I7: a cut that finished after the cutoff is not reported.
        let since_raise = self.journal_get(&key.0).map(|e| self.since_raise(&e));
        if !decide::before_cutoff(&key.1, since_raise, Timestamp::now(), &self.settings) {
            warn!(snapshot = %name, "cut finished after the cutoff; not reporting it (the round will be voided and recut)");
            return Next::Until(None);
        }
        self.write_slot(s, SlotState::Done).await
    }

    /// resume-io, then thaw, then drop the entry: only what the journal holds.
    pub(super) async fn lift(&self, e: &Entry, s: Option<&MiroirSnapshot>) -> Result<(), ()> {
        let stuck = |msg: String| async move {
            let first = self
                .mem
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .stuck
                .insert(e.uid.clone(), ())
                .is_none();
            error!(volume = %e.volume, snapshot = %e.snapshot, error = %msg, "lifting the barrier failed; retrying in 5s");
            if first && let Some(s) = s {
                self.event(s, true, event::BARRIER_STUCK, "Lift", msg).await;
            }
        };
        let t0 = Instant::now();
        if let Err(err) = self.barrier.resume(&e.volume).await {
            stuck(format!("resume-io {}: {}", e.volume, err.0)).await;
            return Err(());
        }
        let resumed = t0.elapsed();
        if let Some(mp) = &e.mountpoint
            && let Err(err) = self.barrier.thaw(&e.volume, mp).await
        {
            stuck(format!("thaw {}: {}", mp.display(), err.0)).await;
            return Err(());
        }
        let thawed = t0.elapsed() - resumed;
        let _ = self.journal_remove(&e.uid);
        let (raised, paused) = {
            let mut m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
            m.stuck.remove(&e.uid);
            (m.raised.remove(&e.uid), m.paused.remove(&e.uid))
        };
        let backend = self
            .volume(&e.volume)
            .and_then(|v| self.backend_for(&v).ok())
            .map(|(b, _)| b.kind().as_str())
            .unwrap_or("none");
        if let Some(t) = raised {
            self.metrics
                .barrier_held_seconds
                .with_label_values(&[backend])
                .observe(t.elapsed().as_secs_f64());
        }
        let pause = paused.map(|t| t.elapsed());
        if let Some(p) = pause {
            self.metrics
                .io_pause_seconds
                .with_label_values(&[backend])
                .observe(p.as_secs_f64());
        }
        self.update_gauge().await;
        // The breakdown of the pause (docs/snapshot.md, "Metrics and alert"): the raise logged
        // freeze and suspend, the cut its own time; the rest is waiting for the other legs.
        info!(
            volume = %e.volume, snapshot = %e.snapshot, lifted_at = %Timestamp::now(),
            io_pause_ms = pause.map(ms), resume_ms = ms(resumed), thaw_ms = ms(thawed),
            "barrier lifted"
        );
        Ok(())
    }

    /// Deletes the backend snapshot in every pool (unless a tie-breaker), then removes only
    /// this node's finalizer.
    pub(super) async fn teardown(&self, s: &MiroirSnapshot, delete_backends: bool) -> Next {
        let name = s.name_any();
        if delete_backends {
            for (pool, b) in &self.pools {
                match b.delete(&name).await {
                    Ok(()) => {}
                    Err(super::backend::BackendError::Busy(msg)) => {
                        info!(snapshot = %name, pool = %pool, "backend snapshot busy; retrying in 30s: {msg}");
                        return soon(Duration::from_secs(30));
                    }
                    Err(e) => {
                        warn!(snapshot = %name, pool = %pool, error = %e, "deleting the backend snapshot failed; retrying in 30s");
                        self.event(
                            s,
                            true,
                            event::CUT_FAILED,
                            "Teardown",
                            format!("pool {pool}: {e}"),
                        )
                        .await;
                        return soon(Duration::from_secs(30));
                    }
                }
            }
        }
        let mine = teardown_finalizer(&self.node);
        let keep: Vec<String> = s
            .finalizers()
            .iter()
            .filter(|f| **f != mine)
            .cloned()
            .collect();
        let patch = round::finalizers_patch(
            &s.uid().unwrap_or_default(),
            &s.resource_version().unwrap_or_default(),
            &keep,
        );
        let patch: json_patch::Patch = serde_json::from_value(patch).expect("valid patch");
        match self
            .snapshots
            .patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => {
                info!(snapshot = %name, "teardown done; finalizer removed");
                Next::Until(None)
            }
            Err(e) if is_not_found(&e) => Next::Until(None),
            Err(e) if crate::runtime::writer::is_fenced_out(&e) => Next::Reread,
            Err(e) => {
                warn!(snapshot = %name, error = %e, "removing the finalizer failed; retrying");
                soon(Duration::from_secs(1))
            }
        }
    }

    /// Whether the volume is Primary on this node, asked once per round (client legs and
    /// tie-breakers only).
    pub(super) async fn local_primary(&self, s: &MiroirSnapshot, vol: &MiroirVolume) -> bool {
        let Some(key) = Context::round_key(s) else {
            return false;
        };
        if vol.diskful_nodes().contains(&self.node) || !vol.is_replicated() {
            return false;
        }
        let r = RoundView::of(s);
        if !r.io_suspended || r.ready || r.slot(&self.node).is_some() {
            return false;
        }
        if let Some(p) = self
            .mem
            .lock()
            .unwrap_or_else(|x| x.into_inner())
            .primary
            .get(&key)
        {
            return *p;
        }
        let p =
            matches!(self.barrier.status(&vol.name_any()).await, Ok(Some(st)) if st.is_primary());
        self.mem
            .lock()
            .unwrap_or_else(|x| x.into_inner())
            .primary
            .insert(key, p);
        p
    }
}

/// Milliseconds with microsecond precision, for the timing fields of the logs.
fn ms(d: Duration) -> f64 {
    (d.as_micros() as f64) / 1000.0
}

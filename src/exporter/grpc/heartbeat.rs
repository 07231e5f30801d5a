//! Heartbeat persistence (docs/exporter.md, "Heartbeats"; OURS). While a Status stream is open the
//! exporter is alive (that is the in-memory liveness); `lastSeen` is written only when the
//! persisted value has become older than the spacing `W` (default T/3), so an idle online exporter
//! costs about 60/W·(1/1.05) ≈ 2.9 writes per minute with T = 60 s instead of upstream's six.
//!
//! The clock restarts at every write that sets `lastSeen`, whoever made it (connect,
//! ReportStatus, a heartbeat of another stream of the same exporter): the decision uses the newer
//! of the stored value and this process's own last write.

use std::collections::HashMap;
use std::sync::Mutex;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use crate::exporter::crd::{ExporterStatus, ExporterStatusValue};
use crate::exporter::decide::exporter::derive_conditions;

/// Jitter is one-sided (+0–10%): the mean spacing stays at or above `W`, so the budget of at
/// most 3 writes per minute with T = 60 s holds; a symmetric ±10% would average exactly
/// 60/W and exceed it about half the time. Offline safety needs only `1.1·W + 1 s < T`, which
/// `W ≤ T/2` guarantees.
pub const JITTER: f64 = 0.1;

/// The spacing for one beat: `W·(1 + JITTER·u)` for `u` in `[0, 1)`.
pub fn spacing(w: SignedDuration, u: f64) -> SignedDuration {
    w.mul_f64(1.0 + JITTER * u.clamp(0.0, 1.0))
}

/// When `lastSeen` must next be persisted: `spacing` after the newer of the stored value (whole
/// seconds) and this process's own last write of it (exact). `None` stored and no own write
/// means it is due now.
pub fn next_due(
    stored: Option<Timestamp>,
    own_write: Option<Timestamp>,
    spacing: SignedDuration,
) -> Timestamp {
    match stored.max(own_write) {
        Some(last) => last + spacing,
        None => Timestamp::UNIX_EPOCH,
    }
}

/// How a due heartbeat is written ("Heartbeats", rule 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Patch `lastSeen` alone, unfenced: nothing derived from it changes.
    LastSeenOnly,
    /// The derived conditions or status change with the new `lastSeen` (e.g. Online again after
    /// being marked offline): a fenced full write (docs/exporter.md, "Status writes") so the
    /// reconciler has nothing left.
    Full,
}

/// Decides between a `lastSeen`-only patch and a full write by deriving the status with the new
/// `lastSeen` and comparing everything but `lastSeen` itself.
pub fn write_kind(
    status: &ExporterStatus,
    generation: Option<i64>,
    threshold: SignedDuration,
    now: Timestamp,
) -> Write {
    let mut next = status.clone();
    next.last_seen = Some(crate::conditions::time(now));
    let mut conds: Vec<Condition> = next.conditions.take().unwrap_or_default();
    derive_conditions(&mut next, &mut conds, generation, threshold, now);
    next.conditions = Some(conds);
    next.last_seen = status.last_seen.clone();
    let mut old = status.clone();
    old.conditions = Some(old.conditions.take().unwrap_or_default());
    if next == old {
        Write::LastSeenOnly
    } else {
        Write::Full
    }
}

/// OURS (docs/exporter.md, "Heartbeats", rule 4): an exporter that the staleness rule marked
/// Offline ("Connection lost - …", for example while heartbeat writes failed during an API
/// outage) but whose Status stream is alive is cleared the way a reconnect clears it (upstream
/// #230), rather than staying Offline until the exporter reconnects or reports.
pub fn recover_from_stale(status: &mut ExporterStatus) {
    if status.exporter_status == Some(ExporterStatusValue::Offline)
        && status
            .status_message
            .as_deref()
            .is_some_and(|m| m.starts_with(CONNECTION_LOST))
    {
        status.exporter_status = None;
        status.status_message = None;
    }
}

const CONNECTION_LOST: &str = "Connection lost - ";

/// Per-exporter liveness shared by every Status stream of this process: the exact instant of
/// the last `lastSeen` write and the number of open streams (the entry goes with the last one).
#[derive(Default)]
pub struct Liveness {
    entries: Mutex<HashMap<(String, String), Entry>>,
}

/// (open Status streams, exact instant of the last `lastSeen` write).
type Entry = (usize, Option<Timestamp>);

impl Liveness {
    pub fn open(&self, ns: &str, name: &str) {
        let mut m = self.entries.lock().expect("liveness");
        m.entry((ns.into(), name.into())).or_default().0 += 1;
    }

    pub fn close(&self, ns: &str, name: &str) {
        let mut m = self.entries.lock().expect("liveness");
        let key = (ns.to_string(), name.to_string());
        if let Some(e) = m.get_mut(&key) {
            e.0 = e.0.saturating_sub(1);
            if e.0 == 0 {
                m.remove(&key);
            }
        }
    }

    /// Claims the heartbeat that is due at `now` for this exporter, so that of several streams
    /// of one exporter only one writes. Returns the previous clock (for [`Liveness::unclaim`])
    /// or None when nothing is due yet.
    pub fn try_claim(
        &self,
        ns: &str,
        name: &str,
        stored: Option<Timestamp>,
        spacing: SignedDuration,
        now: Timestamp,
    ) -> Option<Option<Timestamp>> {
        let mut m = self.entries.lock().expect("liveness");
        let e = m.entry((ns.to_string(), name.to_string())).or_default();
        if now < next_due(stored, e.1, spacing) {
            return None;
        }
        Some(e.1.replace(now))
    }

    /// Gives a claim back after the write failed, unless a newer write moved the clock.
    pub fn unclaim(&self, ns: &str, name: &str, claimed: Timestamp, previous: Option<Timestamp>) {
        let mut m = self.entries.lock().expect("liveness");
        if let Some(e) = m.get_mut(&(ns.to_string(), name.to_string()))
            && e.1 == Some(claimed)
        {
            e.1 = previous;
        }
    }

    /// Records a persisted `lastSeen` write made at `at` (any source).
    pub fn wrote(&self, ns: &str, name: &str, at: Timestamp) {
        let mut m = self.entries.lock().expect("liveness");
        if let Some(e) = m.get_mut(&(ns.to_string(), name.to_string())) {
            e.1 = e.1.max(Some(at));
        }
    }

    pub fn last_write(&self, ns: &str, name: &str) -> Option<Timestamp> {
        let m = self.entries.lock().expect("liveness");
        m.get(&(ns.to_string(), name.to_string())).and_then(|e| e.1)
    }

    pub fn streams(&self, ns: &str, name: &str) -> usize {
        let m = self.entries.lock().expect("liveness");
        m.get(&(ns.to_string(), name.to_string()))
            .map_or(0, |e| e.0)
    }
}

/// Steady-state writes per minute for an idle exporter under this rule: one write per mean
/// spacing `W·(1 + JITTER/2)`.
pub fn writes_per_minute(w: SignedDuration) -> f64 {
    60.0 / (w.as_secs_f64() * (1.0 + JITTER / 2.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::decide::exporter::ONLINE;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    const NOW: i64 = 1_800_000_000;
    const T: SignedDuration = SignedDuration::from_secs(60);
    const W: SignedDuration = SignedDuration::from_secs(20);

    fn ts(s: f64) -> Timestamp {
        Timestamp::from_millisecond((s * 1000.0) as i64).unwrap()
    }

    fn converged(last_seen: i64, st: Option<ExporterStatusValue>) -> ExporterStatus {
        let mut s = ExporterStatus {
            last_seen: Some(Time(Timestamp::from_second(last_seen).unwrap())),
            exporter_status: st,
            devices: Some(vec![]),
            ..Default::default()
        };
        let mut c = vec![];
        derive_conditions(&mut s, &mut c, Some(1), T, ts(last_seen as f64));
        s.conditions = Some(c);
        s
    }

    #[test]
    fn spacing_is_w_plus_up_to_ten_percent() {
        assert_eq!(spacing(W, 0.0), W);
        assert_eq!(spacing(W, 0.5), SignedDuration::from_secs(21));
        assert!(spacing(W, 0.999) < SignedDuration::from_secs(22));
        assert_eq!(spacing(W, 7.0), SignedDuration::from_secs(22));
    }

    #[test]
    fn due_after_the_newer_of_stored_and_own_write() {
        let n = NOW as f64;
        // Never persisted: due at once.
        assert!(next_due(None, None, W) <= ts(n));
        // Stored 5 s ago: due in 15 s.
        assert_eq!(next_due(Some(ts(n - 5.0)), None, W), ts(n + 15.0));
        // Our own exact write is newer than the truncated stored value: it wins, so truncation
        // never shortens the spacing.
        assert_eq!(
            next_due(Some(ts(n - 5.0)), Some(ts(n - 4.4)), W),
            ts(n + 15.6)
        );
        // A newer stored value (ReportStatus, another stream) restarts the clock.
        assert_eq!(
            next_due(Some(ts(n - 1.0)), Some(ts(n - 10.0)), W),
            ts(n + 19.0)
        );
    }

    #[test]
    fn idle_exporter_writes_at_most_three_per_minute_with_t_60() {
        // Simulate 1 hour: every beat writes at the due instant (+40 ms latency); the stored
        // value is whole seconds; the own-write clock is exact.
        let (mut stored, mut own, mut now) = (None::<Timestamp>, None::<Timestamp>, ts(NOW as f64));
        let end = now + SignedDuration::from_hours(1);
        let mut writes = 0;
        let mut worst_age = SignedDuration::ZERO;
        let mut u = 0.0_f64;
        while now < end {
            u = (u + 0.618_034) % 1.0;
            let due = next_due(stored, own, spacing(W, u)).max(now);
            if let Some(s) = stored {
                worst_age = worst_age.max(due.duration_since(s));
            }
            now = due + SignedDuration::from_millis(40);
            stored = Some(crate::conditions::time(now).0);
            own = Some(now);
            writes += 1;
        }
        let per_minute = f64::from(writes) / 60.0;
        assert!(per_minute <= 3.0, "{per_minute} writes per minute");
        assert!(per_minute > 2.7, "{per_minute} writes per minute");
        assert!((per_minute - writes_per_minute(W)).abs() < 0.05);
        // Never close to the offline threshold: an alive exporter is never marked Offline.
        assert!(worst_age < SignedDuration::from_secs(24), "{worst_age:?}");
        assert!(worst_age < T);
    }

    #[test]
    fn last_seen_only_while_nothing_derived_changes() {
        // Online and Available, last seen 20 s ago: only lastSeen moves.
        let s = converged(NOW - 20, Some(ExporterStatusValue::Available));
        assert_eq!(
            write_kind(&s, Some(1), T, ts(NOW as f64)),
            Write::LastSeenOnly
        );
        // Marked offline by the reconciler (connection lost) while the stream survived: the
        // heartbeat must bring Online back, so it is a full write.
        let mut s = converged(NOW - 90, Some(ExporterStatusValue::Available));
        let mut c = s.conditions.take().unwrap();
        derive_conditions(&mut s, &mut c, Some(1), T, ts(NOW as f64));
        s.conditions = Some(c);
        assert_eq!(
            s.exporter_status,
            Some(ExporterStatusValue::Offline),
            "precondition: marked Offline"
        );
        // Offline + recent lastSeen keeps Online=False/Offline, but the message changes.
        assert_eq!(write_kind(&s, Some(1), T, ts(NOW as f64)), Write::Full);
        // Never seen before: Online becomes True.
        let mut never = ExporterStatus::default();
        let mut c = vec![];
        derive_conditions(&mut never, &mut c, Some(1), T, ts(NOW as f64));
        never.conditions = Some(c);
        assert!(!crate::conditions::is_true(
            never.conditions.as_deref().unwrap(),
            ONLINE
        ));
        assert_eq!(write_kind(&never, Some(1), T, ts(NOW as f64)), Write::Full);
        // A generation bump refreshes observedGeneration: full write.
        let s = converged(NOW - 20, Some(ExporterStatusValue::Available));
        assert_eq!(write_kind(&s, Some(2), T, ts(NOW as f64)), Write::Full);
    }

    #[test]
    fn a_live_stream_clears_connection_lost_only() {
        let mut s = converged(NOW - 90, Some(ExporterStatusValue::Available));
        let mut c = s.conditions.take().unwrap();
        derive_conditions(&mut s, &mut c, Some(1), T, ts(NOW as f64));
        s.conditions = Some(c);
        recover_from_stale(&mut s);
        assert_eq!(
            (s.exporter_status, s.status_message.as_deref()),
            (None, None)
        );
        // The exporter's own Offline (Unregister, shutdown report) stays.
        let mut s = converged(NOW - 5, Some(ExporterStatusValue::Offline));
        s.status_message = Some("Exporter shutting down".into());
        recover_from_stale(&mut s);
        assert_eq!(s.exporter_status, Some(ExporterStatusValue::Offline));
    }

    #[test]
    fn liveness_is_shared_by_streams_and_dropped_with_the_last() {
        let l = Liveness::default();
        l.wrote("ns", "e", ts(1.0));
        assert_eq!(l.last_write("ns", "e"), None, "no stream, no entry");
        l.open("ns", "e");
        l.open("ns", "e");
        l.wrote("ns", "e", ts(5.0));
        l.wrote("ns", "e", ts(3.0));
        assert_eq!(l.last_write("ns", "e"), Some(ts(5.0)));
        assert_eq!(l.streams("ns", "e"), 2);
        l.close("ns", "e");
        assert_eq!(l.last_write("ns", "e"), Some(ts(5.0)));
        l.close("ns", "e");
        assert_eq!(l.streams("ns", "e"), 0);
        assert_eq!(l.last_write("ns", "e"), None);
    }

    #[test]
    fn one_claim_per_due_beat_across_streams() {
        let l = Liveness::default();
        l.open("ns", "e");
        l.open("ns", "e");
        let n = NOW as f64;
        let stored = Some(ts(n - 30.0));
        // Both streams wake at the same instant: only the first claims.
        let first = l.try_claim("ns", "e", stored, W, ts(n));
        assert_eq!(first, Some(None));
        assert_eq!(l.try_claim("ns", "e", stored, W, ts(n)), None);
        assert_eq!(l.try_claim("ns", "e", stored, W, ts(n + 19.9)), None);
        // The write failed: the claim is given back and the next try may write.
        l.unclaim("ns", "e", ts(n), None);
        assert_eq!(l.try_claim("ns", "e", stored, W, ts(n + 0.5)), Some(None));
        // A newer write (ReportStatus) is not undone by a stale unclaim.
        l.wrote("ns", "e", ts(n + 1.0));
        l.unclaim("ns", "e", ts(n + 0.5), None);
        assert_eq!(l.last_write("ns", "e"), Some(ts(n + 1.0)));
        assert_eq!(
            l.try_claim("ns", "e", stored, W, ts(n + 21.0)),
            Some(Some(ts(n + 1.0)))
        );
    }
}

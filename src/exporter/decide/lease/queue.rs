//! The lease queue (docs/exporter.md, "Lease scheduling"): pure functions over the cached
//! Leases, Exporters and policies, no I/O.
//!
//! - **Order.** Waiting Leases that can use the same exporters form a queue: higher policy
//!   priority first, then the earlier creation time, then the name ([`QueueKey`]). A Lease whose
//!   `spec.beginTime` is still in the future is a booking, not a waiting Lease.
//! - **Who may take an exporter.** A Lease with `ahead` Leases before it may take one of `free`
//!   ready exporters when `ahead < free` ([`Standing::may_take`]).
//! - **Position and estimated start** ([`estimate_start`]): the leases ahead take the exporters
//!   as they come free, in order.
//! - **Preemption**: `super::preempt`.
//! - **Free windows** ([`longest_free_window`]): where a requested duration does not fit before a
//!   booking.
//!
//! Cost: [`waiting`] is O(Leases + Exporters × distinct lease selectors) per call: the exporters
//! Leases with the same selector (and pinned exporter) select are scanned for once, and the
//! candidates of Leases that ask the same thing (that, and client and duration) are approved
//! once. [`standing`] is O(waiting Leases × candidates).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::access::{approved_candidates, matching};
use super::expiry::is_ended_label;
use super::{INVALID, UNSATISFIABLE};
use crate::conditions;
use crate::exporter::crd::{Client, Exporter, ExporterAccessPolicy, Lease, LeaseQueue};
use crate::exporter::decide::exporter::{ONLINE, REGISTERED};
use crate::exporter::lease::selector;

/// Positions (and estimated starts) are exact up to this many leases ahead; a lease further
/// back shows "more than 100 leases ahead". This bounds the status writes one change of a queue
/// causes: only the leases up to this position see theirs change (docs/exporter.md).
pub const POSITION_CAP: usize = 100;

/// A waiting lease's place: priority first (higher first), then creation time, then name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueKey {
    pub priority: i64,
    pub created: Option<Timestamp>,
    pub name: String,
}

impl Ord for QueueKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .priority
            .cmp(&self.priority)
            .then(self.created.cmp(&other.created))
            .then(self.name.cmp(&other.name))
    }
}

impl PartialOrd for QueueKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl QueueKey {
    pub fn of(lease: &Lease, priority: i64) -> QueueKey {
        QueueKey {
            priority,
            created: lease.metadata.creation_timestamp.as_ref().map(|t| t.0),
            name: lease.metadata.name.clone().unwrap_or_default(),
        }
    }
}

/// A waiting lease as the other leases' passes see it.
#[derive(Debug, Clone)]
pub struct Contender<'a> {
    pub lease: &'a Lease,
    pub key: QueueKey,
    /// The exporters it may be given (matching, enabled, approved), online or not.
    pub candidates: Arc<BTreeSet<String>>,
    /// Its requested duration; None when it has none (it holds its exporter with no end).
    pub duration: Option<SignedDuration>,
}

/// A lease scheduled for later (`spec.beginTime` in the future): it holds no queue, but a lease
/// that would still hold its exporter at that time does not fit before it.
#[derive(Debug, Clone)]
pub struct Booking {
    pub name: String,
    pub begin: Timestamp,
    pub candidates: Arc<BTreeSet<String>>,
}

/// The waiting leases and bookings of a namespace.
#[derive(Debug, Clone, Default)]
pub struct Field<'a> {
    pub waiting: Vec<Contender<'a>>,
    pub bookings: Vec<Booking>,
    /// The exporters each distinct selection picks ([`matching`]), by [`select_key`]:
    /// the decision of a lease in the field reuses its scan of every exporter.
    selected: HashMap<String, Option<Vec<&'a Exporter>>>,
}

impl<'a> Field<'a> {
    /// [`matching`] of `lease` as this field computed it; None when the lease is not in
    /// the field (not waiting) or selects nothing it can use.
    pub fn matching(&self, lease: &Lease) -> Option<&[&'a Exporter]> {
        self.selected.get(&select_key(lease))?.as_deref()
    }
}

/// Whether `lease` waits for an exporter now: not ended, not released, not assigned, not
/// invalid or unsatisfiable, and not scheduled for later.
pub fn is_waiting(lease: &Lease, now: Timestamp) -> bool {
    is_open(lease) && lease.spec.begin_time.as_ref().is_none_or(|b| b.0 <= now)
}

/// What every waiting Lease reads of an exporter, besides who holds it and its
/// `exporterStatus`: its labels, spec, deletion, and whether it is registered and online. A change
/// of these may change any waiting Lease's candidates or reason, so it wakes every waiting Lease
/// selecting the exporter; a change of the rest (a lease taking or leaving it, the status it
/// reports) wakes only the Leases near the head of a queue ([`near_head`]; docs/exporter.md,
/// "Lease scheduling", Wake-ups).
pub fn shared_signature(exporter: &Exporter) -> u64 {
    use std::hash::{Hash, Hasher};
    let conds = exporter
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    exporter.metadata.labels.hash(&mut h);
    exporter.metadata.deletion_timestamp.is_some().hash(&mut h);
    serde_json::to_string(&exporter.spec)
        .unwrap_or_default()
        .hash(&mut h);
    for c in [REGISTERED, ONLINE] {
        conditions::is_true(conds, c).hash(&mut h);
    }
    h.finish()
}

/// A waiting Lease that shows its position ([`POSITION_CAP`] or fewer ahead): the only ones a
/// change of who holds an exporter must wake. The heads among them may take it; the rest see
/// their position or estimate move. A Lease further back is woken when a Lease ahead of it
/// leaves the queue and it comes within the cap ([`Standing::behind`]).
pub fn near_head(lease: &Lease) -> bool {
    lease
        .status
        .as_ref()
        .and_then(|s| s.queue.as_ref())
        .is_some_and(|q| q.position.is_some())
}

/// Not ended, released, assigned, invalid or unsatisfiable (waiting, or booked for later).
fn is_open(lease: &Lease) -> bool {
    if is_ended_label(lease) || lease.spec.release == Some(true) {
        return false;
    }
    match &lease.status {
        None => true,
        Some(s) => {
            let conds = s.conditions.as_deref().unwrap_or_default();
            !s.ended
                && s.exporter_ref_name().is_none()
                && !conditions::is_true(conds, INVALID)
                && !conditions::is_true(conds, UNSATISFIABLE)
        }
    }
}

/// The requested duration of a lease (`spec.duration`, else `endTime − beginTime`).
pub fn duration_of(lease: &Lease) -> Option<SignedDuration> {
    if let Some(d) = lease.spec.duration.as_deref() {
        return crate::godur::parse_signed(d)
            .ok()
            .filter(|d| *d > SignedDuration::ZERO);
    }
    match (&lease.spec.begin_time, &lease.spec.end_time) {
        (Some(b), Some(e)) => Some(e.0.duration_since(b.0)).filter(|d| *d > SignedDuration::ZERO),
        _ => None,
    }
}

/// The waiting leases and bookings among `leases` (the namespace's active leases), each with
/// its priority and candidates. `client` looks a Client up by name (only read with policies).
pub fn waiting<'a, 'c>(
    exporters: &[&'a Exporter],
    leases: &[&'a Lease],
    policies: &[&ExporterAccessPolicy],
    client: &dyn Fn(&str) -> Option<&'c Client>,
    now: Timestamp,
) -> Field<'a> {
    let mut memo: HashMap<String, Option<Asked>> = HashMap::new();
    // Leases that select the same share the scan of every exporter, whatever their Client.
    let mut selected: HashMap<String, Option<Vec<&'a Exporter>>> = HashMap::new();
    let mut field = Field::default();
    for lease in leases.iter().copied() {
        if !is_open(lease) {
            continue;
        }
        let (select, ask) = ask_key(lease, !policies.is_empty());
        let entry = memo.entry(ask).or_insert_with(|| {
            let client = if policies.is_empty() {
                None
            } else {
                client(&lease.spec.client_ref.name)
            };
            let matching = selected
                .entry(select)
                .or_insert_with(|| matching(lease, exporters))
                .as_deref()?;
            approved_candidates(lease, matching, policies, client)
                .map(|(p, names)| (p, Arc::new(names)))
        });
        let Some((priority, candidates)) = entry.clone() else {
            continue;
        };
        match &lease.spec.begin_time {
            Some(b) if b.0 > now => field.bookings.push(Booking {
                name: lease.metadata.name.clone().unwrap_or_default(),
                begin: b.0,
                candidates,
            }),
            _ => field.waiting.push(Contender {
                lease,
                key: QueueKey::of(lease, priority),
                candidates,
                duration: duration_of(lease),
            }),
        }
    }
    field.waiting.sort_by(|a, b| a.key.cmp(&b.key));
    field.selected = selected;
    field
}

/// A lease's priority and candidates, shared by the leases that ask the same.
type Asked = (i64, Arc<BTreeSet<String>>);

/// What decides the exporters a lease selects, and what decides its candidates: leases that ask
/// the same share them.
fn ask_key(lease: &Lease, policies: bool) -> (String, String) {
    let select = select_key(lease);
    let mut key = select.clone();
    if policies {
        key.push('\u{0}');
        key.push_str(&lease.spec.client_ref.name);
        key.push('\u{0}');
        key.push_str(lease.spec.duration.as_deref().unwrap_or_default());
        if let (Some(b), Some(e)) = (&lease.spec.begin_time, &lease.spec.end_time) {
            key.push_str(&format!("\u{0}{}\u{0}{}", b.0, e.0));
        }
    }
    (select, key)
}

/// What decides the exporters a lease selects ([`matching`]).
fn select_key(lease: &Lease) -> String {
    format!(
        "{}\u{0}{}\u{0}{}",
        lease.spec.exporter_ref_name().unwrap_or_default(),
        selector::format(&lease.spec.selector),
        lease.spec.allow_disabled == Some(true),
    )
}

/// Where one lease stands in its queue.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Standing {
    /// Waiting leases before it that compete for one of its exporters.
    pub ahead: usize,
    /// The durations of the leases ahead, in queue order (the first [`POSITION_CAP`]).
    pub ahead_durations: Vec<Option<SignedDuration>>,
    /// The waiting leases after it that compete for one of its exporters, in queue order (the
    /// first [`POSITION_CAP`] + 1: those whose shown position its arrival or departure changes).
    pub behind: Vec<String>,
}

impl Standing {
    /// 1 is next.
    pub fn position(&self) -> usize {
        self.ahead + 1
    }

    /// Whether the position is shown (at most [`POSITION_CAP`] ahead).
    pub fn shown(&self) -> bool {
        self.ahead <= POSITION_CAP
    }

    /// Only the heads of a queue take an exporter: as many as there are free ones.
    pub fn may_take(&self, free: usize) -> bool {
        self.ahead < free
    }
}

/// Where the lease keyed `me` with candidates `mine` stands among `waiting` (itself excluded).
pub fn standing(me: &QueueKey, mine: &BTreeSet<&str>, waiting: &[Contender<'_>]) -> Standing {
    let mut out = Standing::default();
    // Leases that ask the same share one candidate set: intersect each set once.
    let mut seen: HashMap<*const BTreeSet<String>, bool> = HashMap::new();
    for c in waiting {
        if c.key.name == me.name {
            continue;
        }
        let competes = *seen
            .entry(Arc::as_ptr(&c.candidates))
            .or_insert_with(|| c.candidates.iter().any(|n| mine.contains(n.as_str())));
        if !competes {
            continue;
        }
        if c.key < *me {
            out.ahead += 1;
            if out.ahead_durations.len() < POSITION_CAP {
                out.ahead_durations.push(c.duration);
            }
        } else if out.behind.len() <= POSITION_CAP {
            out.behind.push(c.key.name.clone());
        }
    }
    out
}

/// The estimated start of a lease: the leases ahead take the exporters in order, each as soon
/// as one comes free, and hold it for their duration. `free_at` is each candidate exporter's
/// free time (now when free; None when its holder has no end). None when unknown.
pub fn estimate_start(
    free_at: &[Option<Timestamp>],
    ahead: &[Option<SignedDuration>],
) -> Option<Timestamp> {
    let mut slots: Vec<Option<Timestamp>> = free_at.to_vec();
    let earliest = |slots: &[Option<Timestamp>]| -> Option<usize> {
        slots
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.map(|t| (t, i)))
            .min()
            .map(|(_, i)| i)
    };
    for d in ahead {
        let i = earliest(&slots)?;
        slots[i] = match (slots[i], d) {
            (Some(t), Some(d)) => t.checked_add(*d).ok(),
            _ => None,
        };
    }
    earliest(&slots).and_then(|i| slots[i])
}

/// What a waiting lease shows of where it stands (docs/exporter.md, "Lease scheduling"): the
/// place for its `Pending` message (position, estimated start, and the longest free window when
/// its duration fits before no booking) and its `status.queue`. `free_at` is when each of its
/// exporters comes free; `previous` its last `status.queue`.
pub fn place(
    lease: &Lease,
    standing: &Standing,
    free_at: &[(&str, Option<Timestamp>)],
    field: &Field<'_>,
    previous: Option<&LeaseQueue>,
    priority: i64,
    now: Timestamp,
) -> (String, LeaseQueue) {
    let mut estimate = standing
        .shown()
        .then(|| {
            estimate_start(
                &free_at.iter().map(|(_, t)| *t).collect::<Vec<_>>(),
                &standing.ahead_durations,
            )
        })
        .flatten()
        .map(|t| conditions::time(t).0);
    // An estimate that moved less than a minute, or that says "now" again, keeps its last
    // value: no write for jitter.
    if let (Some(new), Some(old)) = (
        estimate,
        previous.and_then(|q| q.estimated_start_time.as_ref()),
    ) && (new.duration_since(old.0).abs() < SignedDuration::from_secs(60)
        || (new <= now && old.0 <= now))
    {
        estimate = Some(old.0);
    }
    let mut place = if standing.shown() {
        format!("position {} in the queue", standing.position())
    } else {
        format!("more than {POSITION_CAP} leases ahead in the queue")
    };
    match estimate {
        Some(t) if t <= now => place.push_str(", estimated start now"),
        Some(t) => place.push_str(&format!(", estimated start {t}")),
        None if standing.shown() => place.push_str(", estimated start unknown"),
        None => {}
    }
    if let (Some(d), false) = (duration_of(lease), field.bookings.is_empty())
        && let Some((window, exporter, booking)) = longest_free_window(free_at, d, &field.bookings)
    {
        place.push_str(&format!(
            "; the requested {} does not fit before the next booking on any matching exporter: the longest free window is {} on exporter {exporter}, before lease {} at {}",
            human(d),
            human(window),
            booking.name,
            booking.begin
        ));
    }
    let status = LeaseQueue {
        estimated_start_time: estimate.map(Time),
        position: standing
            .shown()
            .then(|| i64::try_from(standing.position()).unwrap_or(i64::MAX)),
        priority: (priority != 0).then_some(priority),
        ..Default::default()
    };
    (place, status)
}

/// The longest window a lease could have on one of its exporters before that exporter's next
/// booking, when `duration` fits on none of them: (window, exporter, booking). `free_at` is each
/// candidate's free time (None: no end). None when it fits somewhere or nothing is booked.
pub fn longest_free_window<'b>(
    free_at: &[(&str, Option<Timestamp>)],
    duration: SignedDuration,
    bookings: &'b [Booking],
) -> Option<(SignedDuration, String, &'b Booking)> {
    let mut best: Option<(SignedDuration, String, &Booking)> = None;
    for (exporter, start) in free_at {
        let Some(start) = start else { continue };
        let next = bookings
            .iter()
            .filter(|b| b.begin > *start && b.candidates.contains(*exporter))
            .min_by_key(|b| b.begin);
        let Some(next) = next else {
            return None; // free with no booking after: it fits
        };
        let window = start.duration_until(next.begin);
        if window >= duration {
            return None;
        }
        if best.as_ref().is_none_or(|(w, _, _)| window > *w) {
            best = Some((window, exporter.to_string(), next));
        }
    }
    best
}

/// `1h30m`, `45m`, `20s`: a duration as users read it.
pub fn human(d: SignedDuration) -> String {
    let secs = d.as_secs().max(0);
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if s > 0 || out.is_empty() {
        out.push_str(&format!("{s}s"));
    }
    out
}

#[cfg(test)]
#[path = "queue_tests.rs"]
mod tests;

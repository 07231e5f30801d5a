//! One leader election for the whole process (coordination.k8s.io/v1 Lease), warm standby.
//!
//! Why our own loop and not kube-lease-manager 0.13: that crate takes durations in whole seconds,
//! keeps reporting leadership while renewals fail (no renew deadline), and standbys poll instead of
//! watching the Lease, so a released Lease is only taken over after a retry period. This loop is
//! client-go's algorithm: a candidate takes the Lease when it is free or when its record has not
//! changed for a lease duration *as observed locally* (no cross-node clock comparison); the holder
//! renews every retry period with a resourceVersion precondition and gives up after the renew
//! deadline without a successful renewal; standbys watch the Lease so a release is taken over at once.
//!
//! Idle cost: the holder sends one request per retry period (a replace carrying the
//! resourceVersion of its own last write; a GET only after a conflict) and a standby sends none
//! (it decides from what its watch shows, and steps at once when the Lease is released). The
//! holder is woken by no watch event: they echo its own writes, and stepping on them renewed
//! again at once.

use std::{
    sync::{Arc, Mutex, atomic::Ordering},
    time::{Duration, Instant},
};

use futures::{Stream, StreamExt};
use k8s_openapi::{
    api::{
        coordination::v1::{Lease, LeaseSpec},
        core::v1::Pod,
    },
    apimachinery::pkg::apis::meta::v1::MicroTime,
};
use kube::{
    Api, Client,
    api::{ListParams, ObjectMeta, Patch, PatchParams, PostParams},
    runtime::{WatchStreamExt, watcher},
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::metrics::Metrics;

/// The Pod label a leader carries so leader-only Services route to it.
pub const LEADER_LABEL: &str = "ucm.io/leader";
const FIELD_MANAGER: &str = "ucm-leader-election";

/// Shared view of "are we the leader", cheap to clone into every controller and server.
#[derive(Clone)]
pub struct Leadership {
    inner: Arc<Inner>,
}

struct Inner {
    elected: bool,
    state: watch::Sender<bool>,
    /// Counts acquisitions, so a quick loss and re-acquisition still re-enqueues everything.
    acquired: watch::Sender<u64>,
    renewed_at: Mutex<Option<Instant>>,
    renew_deadline: Duration,
}

impl Leadership {
    /// Without `--leader-elect` the process leads from the start.
    pub fn always() -> Self {
        let (state, _) = watch::channel(true);
        let (acquired, _) = watch::channel(1);
        Leadership {
            inner: Arc::new(Inner {
                elected: false,
                state,
                acquired,
                renewed_at: Mutex::new(None),
                renew_deadline: Duration::MAX,
            }),
        }
    }

    /// Elected, not (yet) leading: the standby's view until it acquires the Lease.
    pub(crate) fn elected(renew_deadline: Duration) -> Self {
        let (state, _) = watch::channel(false);
        let (acquired, _) = watch::channel(0);
        Leadership {
            inner: Arc::new(Inner {
                elected: true,
                state,
                acquired,
                renewed_at: Mutex::new(None),
                renew_deadline,
            }),
        }
    }

    /// True while we hold the Lease with margin: the last successful renewal is younger than the
    /// renew deadline. Every write checks this, so a leader cut off from the API server stops
    /// writing even before its loop notices.
    pub fn is_leader(&self) -> bool {
        if !self.inner.elected {
            return true;
        }
        if !*self.inner.state.borrow() {
            return false;
        }
        let renewed_at = *self.inner.renewed_at.lock().expect("lock");
        renewed_at.is_some_and(|t| t.elapsed() < self.inner.renew_deadline)
    }

    /// Leadership changes; the current value is `true` while leading.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.inner.state.subscribe()
    }

    /// Yields once at every acquisition (and once at start when already leading): wired into
    /// `Controller::reconcile_all_on`, so a new leader reconciles everything from warm caches.
    pub fn acquisitions(&self) -> impl Stream<Item = ()> + Send + 'static {
        let rx = self.inner.acquired.subscribe();
        futures::stream::unfold((rx, 0u64), |(mut rx, seen)| async move {
            loop {
                let count = *rx.borrow_and_update();
                if count > seen {
                    return Some(((), (rx, count)));
                }
                rx.changed().await.ok()?;
            }
        })
    }

    fn set(&self, leading: bool) {
        if leading {
            *self.inner.renewed_at.lock().expect("lock") = Some(Instant::now());
        }
        let rose = self
            .inner
            .state
            .send_if_modified(|s| std::mem::replace(s, leading) != leading)
            && leading;
        if rose {
            self.inner.acquired.send_modify(|n| *n += 1);
        }
    }

    /// A successful renewal. If the margin had lapsed (no renewal within the renew deadline,
    /// while the elector had not yet declared the loss), reconciles in that gap saw "not
    /// leader" and were dropped without a requeue, and writes were refused: count it as a new
    /// acquisition so every object is reconciled again. Returns whether it had lapsed.
    fn renewed(&self) -> bool {
        let now = Instant::now();
        let previous = self.inner.renewed_at.lock().expect("lock").replace(now);
        let lapsed = previous.is_some_and(|t| now.duration_since(t) >= self.inner.renew_deadline);
        if lapsed {
            self.inner.acquired.send_modify(|n| *n += 1);
        }
        lapsed
    }

    fn last_renewal(&self) -> Option<Instant> {
        *self.inner.renewed_at.lock().expect("lock")
    }
}

/// What a candidate should do with the Lease as it last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nobody holds it, or the holder stopped renewing: take it.
    Acquire,
    /// We hold it: renew.
    Renew,
    /// Someone else holds it; look again after at most this long.
    Wait(Duration),
}

/// The part of a Lease record whose change proves the holder is alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub holder: Option<String>,
    pub renew_time: Option<String>,
    pub lease_duration: Duration,
}

impl Record {
    fn of(lease: &Lease) -> Self {
        let spec = lease.spec.as_ref();
        Record {
            holder: spec
                .and_then(|s| s.holder_identity.clone())
                .filter(|h| !h.is_empty()),
            renew_time: spec
                .and_then(|s| s.renew_time.as_ref())
                .map(|t| t.0.to_string()),
            lease_duration: Duration::from_secs(
                spec.and_then(|s| s.lease_duration_seconds)
                    .unwrap_or(15)
                    .max(1) as u64,
            ),
        }
    }
}

/// Pure decision (client-go `tryAcquireOrRenew`): `observed_at` is when this process last saw
/// the record change, so expiry never compares clocks of two machines.
pub fn evaluate(record: &Record, observed_at: Instant, identity: &str, now: Instant) -> Decision {
    match record.holder.as_deref() {
        None => Decision::Acquire,
        Some(h) if h == identity => Decision::Renew,
        Some(_) => {
            let expires = observed_at + record.lease_duration;
            if now >= expires {
                Decision::Acquire
            } else {
                Decision::Wait(expires - now)
            }
        }
    }
}

pub struct ElectionConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
    /// `POD_NAME`: when set, the leader labels its own Pod.
    pub pod_name: Option<String>,
    /// The namespace of the manager's Pod.
    pub pod_namespace: String,
}

/// A running election; `release` ends it and gives the Lease up.
pub struct Election {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Election {
    /// Starts campaigning. The returned [`Leadership`] turns true once the Lease is ours.
    pub fn start(
        client: Client,
        cfg: ElectionConfig,
        metrics: Arc<Metrics>,
    ) -> (Leadership, Election) {
        let leadership = Leadership::elected(cfg.renew_deadline);
        let stop = CancellationToken::new();
        let elector = Elector {
            leases: Api::namespaced(client.clone(), &cfg.namespace),
            pods: Api::namespaced(client, &cfg.pod_namespace),
            leadership: leadership.clone(),
            metrics,
            cfg,
            label_pending: Default::default(),
        };
        let task = tokio::spawn(elector.run(stop.clone()));
        (leadership, Election { stop, task })
    }

    /// Stops campaigning; if leading, removes the Pod label and releases the Lease so a standby
    /// takes over without waiting a lease duration. Call only after controllers have drained.
    pub async fn release(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// What one try-acquire-or-renew did.
enum Attempt {
    /// Someone else holds the Lease: look again after at most this long.
    Wait(Duration),
    /// We created or wrote the Lease (or failed to).
    Written(kube::Result<()>),
}

/// What the elector knows of the Lease between attempts.
#[derive(Default)]
struct State {
    /// The Lease as we last knew it: the response to our own last write, or (for a standby)
    /// what the watch showed since. `None` after an error or a conflict: read it again.
    known: Option<Lease>,
    /// The last record seen and when it was first seen (expiry is judged on our own clock).
    observed: Option<(Record, Instant)>,
}

impl State {
    /// Something showed us this Lease (`None`: it does not exist) at `at`.
    fn note(&mut self, lease: Option<Lease>, at: Instant) {
        if let Some(l) = &lease {
            let record = Record::of(l);
            self.observed_at(&record, at);
        }
        self.known = lease;
    }

    /// When `record` was first seen, remembering `now` for a record not seen before.
    fn observed_at(&mut self, record: &Record, now: Instant) -> Instant {
        match &self.observed {
            Some((r, at)) if r == record => *at,
            _ => {
                self.observed = Some((record.clone(), now));
                now
            }
        }
    }
}

/// What a watch event of the Lease means to the elector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// Nothing to do. The holder ignores its watch: its events are echoes of its own
    /// renewals (stepping on them renewed again at once, hundreds of times a second) or stale
    /// (the initial list can predate our first write). Nobody else can take the Lease before
    /// it expires, and by then the renew deadline has already stopped our writes; a deleted or
    /// edited Lease shows up as an error or conflict at the next renewal.
    Ignore,
    /// Remember it (a standby's view of the holder's renewals), decide at the next step.
    Note,
    /// Decide now: the Lease is free or gone.
    Step,
}

fn wake(shown: Option<&Lease>, leading: bool) -> Wake {
    if leading {
        return Wake::Ignore;
    }
    match shown.map(|l| Record::of(l).holder) {
        None | Some(None) => Wake::Step,
        Some(Some(_)) => Wake::Note,
    }
}

struct Elector {
    leases: Api<Lease>,
    pods: Api<Pod>,
    leadership: Leadership,
    metrics: Arc<Metrics>,
    cfg: ElectionConfig,
    /// The leader label is not (yet) known to be on our Pod and off every other: retried
    /// after each renewal until it is, since one failed write at acquisition would otherwise
    /// leave leader-only Services without an endpoint until the next acquisition.
    label_pending: std::sync::atomic::AtomicBool,
}

impl Elector {
    async fn run(self, stop: CancellationToken) {
        let gauge = self
            .metrics
            .leader_election_master_status
            .with_label_values(&[&self.cfg.name]);
        gauge.set(0);
        info!(lease = %format!("{}/{}", self.cfg.namespace, self.cfg.name), identity = %self.cfg.identity, "campaigning for leadership");

        // Standbys react to a released or changed Lease at once instead of after a retry period.
        // The watch publishes what it shows: `None` until its first list, `Some(None)` while
        // the Lease does not exist.
        let (seen_tx, mut seen) = watch::channel::<Option<Option<Lease>>>(None);
        let watch_task = {
            let stream = watcher(
                self.leases.clone(),
                watcher::Config::default().fields(&format!("metadata.name={}", self.cfg.name)),
            )
            .default_backoff();
            tokio::spawn(async move {
                let mut stream = std::pin::pin!(stream);
                let mut listed = None;
                while let Some(event) = stream.next().await {
                    let shown = match event {
                        Ok(watcher::Event::Init) => {
                            listed = None;
                            continue;
                        }
                        Ok(watcher::Event::InitApply(l)) => {
                            listed = Some(l);
                            continue;
                        }
                        Ok(watcher::Event::InitDone) => listed.take(),
                        Ok(watcher::Event::Apply(l)) => Some(l),
                        Ok(watcher::Event::Delete(_)) => None,
                        Err(_) => continue,
                    };
                    seen_tx.send_replace(Some(shown));
                }
            })
        };

        let mut state = State::default();
        'campaign: loop {
            let wait = self.step(&mut state).await;
            if self.leadership.is_leader() {
                gauge.set(1);
            } else {
                gauge.set(0);
            }
            let due = tokio::time::Instant::now() + wait;
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break 'campaign,
                    _ = tokio::time::sleep_until(due) => break,
                    changed = seen.changed() => {
                        if changed.is_err() {
                            // The watch task ended (aborted only below): go on with the timer.
                            tokio::time::sleep_until(due).await;
                            break;
                        }
                        let Some(shown) = seen.borrow_and_update().clone() else { continue };
                        let leading = *self.leadership.inner.state.borrow();
                        match wake(shown.as_ref(), leading) {
                            Wake::Ignore => {}
                            Wake::Note => state.note(shown, Instant::now()),
                            Wake::Step => {
                                state.note(shown, Instant::now());
                                break;
                            }
                        }
                    }
                }
            }
        }
        watch_task.abort();
        if *self.leadership.inner.state.borrow() {
            // Bounded: shutdown must not hang on an API server that does not answer.
            let bound = self.cfg.renew_deadline;
            let _ = tokio::time::timeout(bound, self.set_pod_label(false)).await;
            if tokio::time::timeout(bound, self.release()).await.is_err() {
                warn!("could not release the Lease in time; a standby takes over after it expires");
            }
        }
        self.leadership.set(false);
        gauge.set(0);
    }

    /// One round of try-acquire-or-renew; returns how long to wait before the next.
    async fn step(&self, state: &mut State) -> Duration {
        let retry = self.cfg.retry_period;
        // client-go bounds every attempt by the renew deadline: a request that hangs (an API
        // server that accepted the connection but never answers) must not stall the elector,
        // which would neither renew nor declare the loss nor campaign again.
        let attempt = tokio::time::timeout(self.cfg.renew_deadline, self.attempt(state));
        let result = match attempt.await {
            Ok(Attempt::Wait(d)) => return d.min(retry),
            Ok(Attempt::Written(r)) => r.map_err(Some),
            Err(_) => Err(None),
        };
        if result.is_err() {
            // Whatever we knew may be stale: the next attempt reads the Lease afresh.
            state.known = None;
        }
        match result {
            Ok(()) => {
                let was = *self.leadership.inner.state.borrow();
                if was {
                    if self.leadership.renewed() {
                        warn!(
                            "leadership renewed after lapsing past the renew deadline; reconciling everything again"
                        );
                    }
                } else {
                    self.leadership.set(true);
                    info!(identity = %self.cfg.identity, "acquired leadership");
                    self.label_pending.store(true, Ordering::SeqCst);
                }
                if self.label_pending.load(Ordering::SeqCst) {
                    let labelled = tokio::time::timeout(retry, self.set_pod_label(true)).await;
                    if labelled == Ok(true) {
                        self.label_pending.store(false, Ordering::SeqCst);
                    }
                }
            }
            Err(Some(kube::Error::Api(s))) if s.code == 409 => {
                debug!("lease changed under us; re-reading");
                self.check_deadline();
                return Duration::from_millis(50);
            }
            Err(Some(e)) => {
                warn!(error = %e, "leader election: could not read or write the Lease");
                self.check_deadline();
            }
            Err(None) => {
                warn!(timeout = ?self.cfg.renew_deadline, "leader election: the Lease request did not answer within the renew deadline");
                self.check_deadline();
            }
        }
        retry
    }

    /// Takes, renews or leaves the Lease, as we last knew it (our own last write, or what the
    /// watch showed a standby); reads it only when we know nothing trustworthy.
    async fn attempt(&self, state: &mut State) -> Attempt {
        let now = Instant::now();
        let lease = match state.known.clone() {
            Some(lease) => lease,
            None => match self.leases.get_opt(&self.cfg.name).await {
                Err(e) => return Attempt::Written(Err(e)),
                Ok(None) => {
                    let created = self.create().await;
                    return Attempt::Written(created.map(|l| state.known = Some(l)));
                }
                Ok(Some(lease)) => {
                    state.note(Some(lease.clone()), now);
                    lease
                }
            },
        };
        let record = Record::of(&lease);
        let observed_at = state.observed_at(&record, now);
        let acquire = match evaluate(&record, observed_at, &self.cfg.identity, now) {
            Decision::Wait(d) => {
                self.lose_if_leading(&format!(
                    "the Lease is now held by {}",
                    record.holder.as_deref().unwrap_or("nobody")
                ));
                return Attempt::Wait(d);
            }
            Decision::Renew => false,
            Decision::Acquire => true,
        };
        let written = self.write(lease, acquire).await;
        Attempt::Written(written.map(|l| {
            state.observed = Some((Record::of(&l), Instant::now()));
            state.known = Some(l);
        }))
    }

    fn check_deadline(&self) {
        if let Some(t) = self.leadership.last_renewal()
            && *self.leadership.inner.state.borrow()
            && t.elapsed() >= self.cfg.renew_deadline
        {
            self.lose_if_leading("no successful renewal within the renew deadline");
        }
    }

    fn lose_if_leading(&self, why: &str) {
        if *self.leadership.inner.state.borrow() {
            error!(
                reason = why,
                "lost leadership; stopping all writes and campaigning again"
            );
            self.leadership.set(false);
        }
    }

    fn spec(&self, acquire_time: Option<MicroTime>, transitions: i32) -> LeaseSpec {
        let now = MicroTime(jiff::Timestamp::now());
        LeaseSpec {
            holder_identity: Some(self.cfg.identity.clone()),
            lease_duration_seconds: Some(self.cfg.lease_duration.as_secs().max(1) as i32),
            acquire_time: Some(acquire_time.unwrap_or_else(|| now.clone())),
            renew_time: Some(now),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    async fn create(&self) -> kube::Result<Lease> {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.cfg.name.clone()),
                ..Default::default()
            },
            spec: Some(self.spec(None, 0)),
        };
        self.leases
            .create(
                &PostParams {
                    field_manager: Some(FIELD_MANAGER.into()),
                    ..Default::default()
                },
                &lease,
            )
            .await
    }

    /// Replace with the read resourceVersion: if anyone wrote in between, the API server answers
    /// 409 and we decide again from the fresh record.
    async fn write(&self, mut lease: Lease, acquire: bool) -> kube::Result<Lease> {
        let old = lease.spec.take().unwrap_or_default();
        let transitions = old.lease_transitions.unwrap_or(0);
        // client-go counts a transition whenever the previous holder was not us (released too).
        lease.spec = Some(if acquire {
            self.spec(None, transitions + 1)
        } else {
            self.spec(old.acquire_time, transitions)
        });
        lease.metadata.managed_fields = None;
        self.leases
            .replace(
                &self.cfg.name,
                &PostParams {
                    field_manager: Some(FIELD_MANAGER.into()),
                    ..Default::default()
                },
                &lease,
            )
            .await
    }

    /// client-go `release`: empty holder and a one-second duration, so standbys take over at once.
    async fn release(&self) {
        let Ok(Some(mut lease)) = self.leases.get_opt(&self.cfg.name).await else {
            return;
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
            return;
        }
        let now = MicroTime(jiff::Timestamp::now());
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(now.clone());
        spec.acquire_time = Some(now);
        lease.metadata.managed_fields = None;
        match self
            .leases
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => info!("released leadership"),
            Err(e) => {
                warn!(error = %e, "could not release the Lease; a standby takes over after it expires");
            }
        }
    }

    /// Labels our Pod as leader (and unlabels any former leader that lost without releasing), or
    /// removes our label on release. Without POD_NAME (outside a cluster) there is no Pod.
    /// Returns whether every write succeeded.
    async fn set_pod_label(&self, leading: bool) -> bool {
        let Some(pod) = &self.cfg.pod_name else {
            return true;
        };
        let mut ok = true;
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..Default::default()
        };
        let patch = |v: serde_json::Value| {
            Patch::Merge(serde_json::json!({"metadata": {"labels": {LEADER_LABEL: v}}}))
        };
        let others = if leading {
            self.pods
                .list(&ListParams::default().labels(&format!("{LEADER_LABEL}=true")))
                .await
                .inspect_err(|e| warn!(error = %e, "could not list Pods carrying the leader label"))
                .ok()
        } else {
            None
        };
        ok &= !leading || others.is_some();
        if let Some(list) = others {
            for other in list
                .items
                .iter()
                .filter_map(|p| p.metadata.name.as_deref())
                .filter(|n| *n != pod)
            {
                if let Err(e) = self
                    .pods
                    .patch(other, &pp, &patch(serde_json::Value::Null))
                    .await
                {
                    warn!(pod = other, error = %e, "could not remove the leader label from a former leader");
                    ok = false;
                }
            }
        }
        let value = if leading {
            serde_json::json!("true")
        } else {
            serde_json::Value::Null
        };
        if let Err(e) = self.pods.patch(pod, &pp, &patch(value)).await {
            warn!(pod = %pod, error = %e, "could not update the leader label on our Pod");
            ok = false;
        }
        ok
    }
}

/// controller-runtime's identity format: `<hostname>_<uuid-ish suffix>`.
pub fn identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "ucm".into());
    let suffix: u128 = rand::random();
    let hex = format!("{suffix:032x}");
    format!(
        "{host}_{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(holder: Option<&str>) -> Record {
        Record {
            holder: holder.map(String::from),
            renew_time: None,
            lease_duration: Duration::from_secs(15),
        }
    }

    #[test]
    fn free_lease_is_acquired() {
        let now = Instant::now();
        assert_eq!(evaluate(&rec(None), now, "me", now), Decision::Acquire);
    }

    #[test]
    fn own_lease_is_renewed() {
        let now = Instant::now();
        assert_eq!(evaluate(&rec(Some("me")), now, "me", now), Decision::Renew);
    }

    #[test]
    fn foreign_lease_waits_until_expiry_as_observed_locally() {
        let seen = Instant::now();
        let d = evaluate(
            &rec(Some("other")),
            seen,
            "me",
            seen + Duration::from_secs(5),
        );
        assert_eq!(d, Decision::Wait(Duration::from_secs(10)));
        assert_eq!(
            evaluate(
                &rec(Some("other")),
                seen,
                "me",
                seen + Duration::from_secs(15)
            ),
            Decision::Acquire
        );
    }

    fn lease(holder: Option<&str>) -> Lease {
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: holder.map(String::from),
                ..Default::default()
            }),
        }
    }

    /// The idle-cost bug of 369af94: the holder woke on the watch event of its own renewal and
    /// renewed again at once, hundreds of times a second. Nothing the watch shows wakes it:
    /// not its echoes, nor a stale initial list showing the Lease free.
    #[test]
    fn the_holder_is_woken_by_no_watch_event() {
        for shown in [
            Some(lease(Some("me"))),
            Some(lease(Some("other"))),
            Some(lease(None)),
            None,
        ] {
            assert_eq!(wake(shown.as_ref(), true), Wake::Ignore, "{shown:?}");
        }
    }

    /// A standby only remembers the holder's renewals (no request, no write); a released or
    /// deleted Lease is taken over at once, which keeps SIGTERM failover fast.
    #[test]
    fn a_standby_steps_only_when_the_lease_is_free() {
        assert_eq!(wake(Some(&lease(Some("other"))), false), Wake::Note);
        assert_eq!(wake(Some(&lease(None)), false), Wake::Step);
        assert_eq!(wake(Some(&lease(Some(""))), false), Wake::Step);
        assert_eq!(wake(None, false), Wake::Step);
    }

    /// A renewal seen again does not restart the expiry clock; a changed record does.
    #[test]
    fn expiry_is_timed_from_the_first_sight_of_a_record() {
        let t0 = Instant::now();
        let mut state = State::default();
        let mut l = lease(Some("other"));
        state.note(Some(l.clone()), t0);
        state.note(Some(l.clone()), t0 + Duration::from_secs(5));
        let record = Record::of(&l);
        assert_eq!(state.observed_at(&record, t0 + Duration::from_secs(9)), t0);
        l.spec.as_mut().unwrap().renew_time = Some(MicroTime(jiff::Timestamp::now()));
        state.note(Some(l.clone()), t0 + Duration::from_secs(10));
        assert_eq!(
            state.observed_at(&Record::of(&l), t0 + Duration::from_secs(11)),
            t0 + Duration::from_secs(10)
        );
    }

    #[test]
    fn acquisitions_fire_on_each_rising_edge() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let l = Leadership::elected(Duration::from_secs(10));
            let mut acq = Box::pin(l.acquisitions());
            l.set(true);
            assert!(l.is_leader());
            acq.next().await.unwrap();
            l.set(false);
            assert!(!l.is_leader());
            tokio::task::yield_now().await;
            l.set(true);
            tokio::time::timeout(Duration::from_secs(1), acq.next())
                .await
                .unwrap()
                .unwrap();
        });
    }

    #[test]
    fn leadership_lapses_without_renewal() {
        let l = Leadership::elected(Duration::from_millis(20));
        l.set(true);
        assert!(l.is_leader());
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            !l.is_leader(),
            "a leader that has not renewed within the deadline must not write"
        );
        assert!(Leadership::always().is_leader());
    }

    /// Reconciles that ran while the margin had lapsed returned without a requeue; a renewal
    /// that ends the lapse (without the elector declaring a loss in between) must re-enqueue
    /// everything, like an acquisition. A timely renewal must not.
    #[test]
    fn a_renewal_after_a_lapse_counts_as_an_acquisition() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let l = Leadership::elected(Duration::from_millis(50));
            let mut acq = Box::pin(l.acquisitions());
            l.set(true);
            acq.next().await.unwrap();
            assert!(!l.renewed(), "a timely renewal is not a lapse");
            let next = tokio::time::timeout(Duration::from_millis(20), acq.next()).await;
            assert!(next.is_err(), "a timely renewal re-enqueued everything");
            tokio::time::sleep(Duration::from_millis(60)).await;
            assert!(!l.is_leader(), "lapsed");
            assert!(l.renewed());
            assert!(l.is_leader());
            tokio::time::timeout(Duration::from_secs(1), acq.next())
                .await
                .expect("the renewal after the lapse re-enqueues everything")
                .unwrap();
        });
    }

    /// An API server that accepts connections and never answers: each attempt gives up at the
    /// renew deadline, so the elector keeps its rhythm (and can declare the loss) instead of
    /// stalling for the client's read timeout (minutes).
    #[tokio::test]
    async fn an_api_server_that_never_answers_does_not_stall_the_elector() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let mut held = vec![];
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let cfg = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let client = Client::try_from(cfg).unwrap();
        let elector = Elector {
            leases: Api::namespaced(client.clone(), "ns"),
            pods: Api::namespaced(client, "ns"),
            leadership: Leadership::elected(Duration::from_millis(300)),
            metrics: Arc::new(Metrics::new()),
            cfg: ElectionConfig {
                namespace: "ns".into(),
                name: "lease".into(),
                identity: "me".into(),
                lease_duration: Duration::from_secs(1),
                renew_deadline: Duration::from_millis(300),
                retry_period: Duration::from_millis(100),
                pod_name: None,
                pod_namespace: "ns".into(),
            },
            label_pending: Default::default(),
        };
        let started = Instant::now();
        let wait =
            tokio::time::timeout(Duration::from_secs(5), elector.step(&mut State::default()))
                .await
                .expect("the attempt hung past the renew deadline");
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(wait, Duration::from_millis(100));
    }

    #[test]
    fn identities_are_unique_and_shaped_like_controller_runtime() {
        let a = identity();
        let b = identity();
        assert_ne!(a, b);
        assert!(a.contains('_'));
    }
}

//! Dial and Listen across replicas (docs/exporter.md, "Dial and Listen across replicas").
//!
//! Every replica serves gRPC, so a client's Dial and the exporter's Listen may reach different
//! replicas. A Dial that finds the lease's Listen on its own replica pushes the router endpoint
//! and token there at once. Otherwise it leaves a pending dial, a ConfigMap labelled
//! [`DIAL_LABEL`] in the manager's namespace, and waits. Every replica watches those (one
//! label-selected watch); the replica holding the lease's Listen claims the pending dial by
//! deleting it with a uid precondition, so exactly one claim wins, pushes the token to its
//! exporter, and the dialer answers once it sees the object gone. A dialer that gives up deletes
//! its object the same way: if that delete finds it gone, a claim won first and the Dial succeeds.
//!
//! Kubernetes is the medium, not a replica-to-replica connection: the replicas already share the
//! API server and hold watches on it, so there is nothing new to discover, secure or keep alive,
//! and a replica that dies leaves nothing half-sent (its pending dials are abandoned objects any
//! replica sweeps).
//!
//! The object carries the token's claims, never the token: the claiming replica signs them with
//! the router key every replica shares, and HS256 is deterministic, so the exporter receives the
//! very token the dialer returned while the key and the signed token stay in memory.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::{debug, warn};

use crate::exporter::metrics::Metrics;
use crate::exporter::proto::jumpstarter::v1 as pb;
use crate::exporter::router::token::{self as router_token, Claims, RouterKey};
use crate::runtime::Writer;

/// The label of pending dials; the watch selects it.
pub const DIAL_LABEL: &str = "ucm.io/pending-dial";
const NAME_PREFIX: &str = "ucm-dial-";
/// A pending dial this old was abandoned (its dialer gave up or died without deleting it).
const ABANDONED: Duration = Duration::from_secs(60);
/// How often the leader sweeps abandoned pending dials.
const SWEEP: Duration = Duration::from_secs(30);
/// While waiting, a dialer also reads its object this often: a watch that re-lists reports no
/// deletion, and a claim must not wait for the deadline to be noticed.
const RECHECK: Duration = Duration::from_secs(2);
/// How long a Dial on a replica that is shutting down still waits for a claim before it answers
/// UNAVAILABLE (jmp retries a Dial on UNAVAILABLE, on a new connection: another replica).
const DRAIN_WAIT: Duration = Duration::from_secs(5);

pub type ListenTx = mpsc::Sender<Result<pb::ListenResponse, Status>>;
/// (namespace, lease).
pub type Key = (String, String);

/// Where a Dial's token went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// The lease's Listen is on this replica.
    Local,
    /// Another replica (or this one, later) claimed the pending dial.
    Remote,
}

impl Path {
    pub fn label(self) -> &'static str {
        match self {
            Path::Local => "local",
            Path::Remote => "remote",
        }
    }
}

/// A pending dial as its ConfigMap holds it (pure, for tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingDial {
    pub key: Key,
    pub router_endpoint: String,
    pub claims: Claims,
}

impl PendingDial {
    /// The ConfigMap in `namespace` (its name from the token's unique `jti`).
    pub fn to_config_map(&self, namespace: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("{NAME_PREFIX}{}", self.claims.jti)),
                namespace: Some(namespace.into()),
                labels: Some(BTreeMap::from([(DIAL_LABEL.into(), "true".into())])),
                ..Default::default()
            },
            data: Some(BTreeMap::from([
                ("namespace".into(), self.key.0.clone()),
                ("lease".into(), self.key.1.clone()),
                ("routerEndpoint".into(), self.router_endpoint.clone()),
                (
                    "claims".into(),
                    serde_json::to_string(&self.claims).expect("claims serialize"),
                ),
            ])),
            ..Default::default()
        }
    }

    /// None for an object that is not a well-formed pending dial (left alone).
    pub fn from_config_map(cm: &ConfigMap) -> Option<PendingDial> {
        let data = cm.data.as_ref()?;
        let get = |k: &str| data.get(k).cloned();
        Some(PendingDial {
            key: (get("namespace")?, get("lease")?),
            router_endpoint: get("routerEndpoint")?,
            claims: serde_json::from_str(data.get("claims")?).ok()?,
        })
    }

    fn response(&self, key: &RouterKey) -> pb::ListenResponse {
        pb::ListenResponse {
            router_endpoint: self.router_endpoint.clone(),
            router_token: router_token::sign(key, &self.claims),
        }
    }
}

/// The Listen streams this replica holds, and the pending dials every replica leaves.
pub struct Dials {
    api: Api<ConfigMap>,
    namespace: String,
    /// The any-replica writer (`Context::calls`).
    writer: Writer,
    router_key: RouterKey,
    metrics: Metrics,
    /// (namespace, lease) → the queue of the current Listen stream on this replica.
    listeners: Mutex<HashMap<Key, ListenTx>>,
    /// Pending dials, every replica's, from the watch.
    pending: Store<ConfigMap>,
    writer_side: Mutex<Option<reflector::store::Writer<ConfigMap>>>,
    /// Pending dial name → the Dial on this replica waiting for its claim.
    waiters: Mutex<HashMap<String, oneshot::Sender<()>>>,
}

impl Dials {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        writer: Writer,
        router_key: RouterKey,
        metrics: Metrics,
    ) -> Arc<Dials> {
        let (pending, writer_side) = reflector::store();
        Arc::new(Dials {
            api: Api::namespaced(client, namespace),
            namespace: namespace.into(),
            writer,
            router_key,
            metrics,
            listeners: Default::default(),
            pending,
            writer_side: Mutex::new(Some(writer_side)),
            waiters: Default::default(),
        })
    }

    /// The watch of pending dials: claims those whose Listen is here, wakes the Dials waiting on
    /// those that went, and (leader only) sweeps abandoned ones. Runs until `stop`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let Some(writer_side) = self.writer_side.lock().expect("dials").take() else {
            return;
        };
        let cfg = watcher::Config::default().labels(&format!("{DIAL_LABEL}=true"));
        let events = watcher::watcher(self.api.clone(), cfg)
            .default_backoff()
            .reflect(writer_side);
        tokio::pin!(events);
        let mut sweep = tokio::time::interval(SWEEP);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = sweep.tick() => self.sweep(),
                ev = events.next() => match ev {
                    Some(Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm))) => {
                        self.offer(&cm);
                    }
                    Some(Ok(watcher::Event::Delete(cm))) => {
                        if let Some(w) = self.waiters.lock().expect("dials").remove(&cm.name_any()) {
                            let _ = w.send(());
                        }
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => debug!(error = %e, "pending dial watch: retrying"),
                    None => return,
                },
            }
        }
    }

    /// Registers this replica's Listen for `key`; it supersedes the previous one here, which
    /// ends. Claims the pending dials already waiting for it.
    pub fn listen(self: &Arc<Self>, key: Key, tx: ListenTx) {
        {
            let mut listeners = self.listeners.lock().expect("dials");
            // Entries of streams that ended are pruned here, so the map holds at most one
            // entry per live Listen.
            listeners.retain(|_, tx| !tx.is_closed());
            listeners.insert(key.clone(), tx);
        }
        for cm in self.pending.state() {
            if PendingDial::from_config_map(&cm).is_some_and(|p| p.key == key) {
                self.offer(&cm);
            }
        }
    }

    /// Ends every Listen stream here (their senders are dropped): the exporters reconnect, to
    /// another replica when this one is going away.
    pub fn close_listeners(&self) {
        self.listeners.lock().expect("dials").clear();
    }

    fn listener(&self, key: &Key) -> Option<ListenTx> {
        self.listeners
            .lock()
            .expect("dials")
            .get(key)
            .filter(|tx| !tx.is_closed())
            .cloned()
    }

    /// A pending dial this replica may claim: its Listen is here.
    fn offer(self: &Arc<Self>, cm: &ConfigMap) {
        let Some(dial) = PendingDial::from_config_map(cm) else {
            return;
        };
        let Some(tx) = self.listener(&dial.key) else {
            return;
        };
        let (name, uid) = (cm.name_any(), cm.uid());
        let this = self.clone();
        tokio::spawn(async move { this.claim(name, uid, dial, tx).await });
    }

    /// Claims the pending dial `name` for the Listen `tx`: a place on its queue first (so a
    /// claim is never won for a stream that cannot take it), then the delete that only one
    /// claimant wins, then the push.
    async fn claim(&self, name: String, uid: Option<String>, dial: PendingDial, tx: ListenTx) {
        let Ok(permit) = tx.try_reserve() else {
            return;
        };
        match self.writer.delete(&self.api, &name, uid.as_deref()).await {
            Ok(true) => {
                permit.send(Ok(dial.response(&self.router_key)));
                debug!(lease = %dial.key.1, namespace = %dial.key.0, "claimed a pending dial");
            }
            Ok(false) => {}
            Err(e) => warn!(dial = %name, error = %e, "cannot claim a pending dial"),
        }
    }

    /// Deletes pending dials older than [`ABANDONED`] (leader only: one sweeper is enough).
    fn sweep(&self) {
        if !self.writer.is_leader() {
            return;
        }
        let now = Timestamp::now();
        for cm in self.pending.state() {
            let old = cm
                .creation_timestamp()
                .is_some_and(|t| now.duration_since(t.0).unsigned_abs() > ABANDONED);
            if old {
                let (api, writer) = (self.api.clone(), self.writer.clone());
                tokio::spawn(async move {
                    let _ = writer
                        .delete(&api, &cm.name_any(), cm.uid().as_deref())
                        .await;
                });
            }
        }
    }

    /// Hands `dial` to the lease's Listen, here or on another replica, within `deadline`.
    /// `draining`: this replica is shutting down; wait at most [`DRAIN_WAIT`] more.
    pub async fn dial(
        &self,
        dial: PendingDial,
        deadline: tokio::time::Instant,
        draining: &CancellationToken,
    ) -> Result<Path, Status> {
        let started = Instant::now();
        let result = self.deliver(&dial, deadline, draining).await;
        let (path, outcome) = match &result {
            Ok(p) => (p.label(), "delivered"),
            Err(_) => ("remote", "unanswered"),
        };
        self.metrics
            .dials
            .with_label_values(&[path, outcome])
            .observe(started.elapsed().as_secs_f64());
        result
    }

    async fn deliver(
        &self,
        dial: &PendingDial,
        mut deadline: tokio::time::Instant,
        draining: &CancellationToken,
    ) -> Result<Path, Status> {
        if let Some(tx) = self.listener(&dial.key) {
            match tx.try_send(Ok(dial.response(&self.router_key))) {
                Ok(()) => return Ok(Path::Local),
                Err(mpsc::error::TrySendError::Full(_)) => {
                    return Err(Status::resource_exhausted("too many pending connections"));
                }
                // The stream ended meanwhile: its exporter reconnects, here or elsewhere.
                Err(mpsc::error::TrySendError::Closed(_)) => {}
            }
        }
        let cm = dial.to_config_map(&self.namespace);
        let name = cm.name_any();
        let (woken_tx, mut woken) = oneshot::channel();
        self.waiters
            .lock()
            .expect("dials")
            .insert(name.clone(), woken_tx);
        struct Forget<'a>(&'a Dials, &'a str);
        impl Drop for Forget<'_> {
            fn drop(&mut self) {
                self.0.waiters.lock().expect("dials").remove(self.1);
            }
        }
        let _forget = Forget(self, &name);
        let created = match self.writer.create(&self.api, &cm).await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "cannot leave a pending dial");
                return Err(Status::unavailable(
                    "cannot reach the exporter's controller replica; retry",
                ));
            }
        };
        let uid = created.uid();
        let mut recheck = tokio::time::interval_at(tokio::time::Instant::now() + RECHECK, RECHECK);
        let mut drained = false;
        loop {
            tokio::select! {
                _ = &mut woken => return Ok(Path::Remote),
                _ = recheck.tick() => match self.api.get_opt(&name).await {
                    Ok(None) => return Ok(Path::Remote),
                    Ok(Some(cm)) if cm.uid() != uid => return Ok(Path::Remote),
                    _ => {}
                },
                _ = tokio::time::sleep_until(deadline) => break,
                _ = draining.cancelled(), if !drained => {
                    drained = true;
                    deadline = deadline.min(tokio::time::Instant::now() + DRAIN_WAIT);
                }
            }
        }
        // Give up: the delete decides whether a claim won first.
        match self.writer.delete(&self.api, &name, uid.as_deref()).await {
            Ok(false) => Ok(Path::Remote),
            Ok(true) if drained => Err(Status::unavailable(
                "this controller replica is shutting down; retry",
            )),
            Ok(true) => Err(Status::unavailable(
                "exporter is not listening on this lease",
            )),
            Err(e) => {
                warn!(dial = %name, error = %e, "cannot withdraw a pending dial");
                Err(Status::unavailable(
                    "exporter is not listening on this lease",
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dial() -> PendingDial {
        let key = RouterKey::new(b"k".to_vec()).unwrap();
        let _ = key;
        let claims = router_token::claims(Timestamp::from_second(1_800_000_000).unwrap());
        PendingDial {
            key: ("lab".into(), "lease-1".into()),
            router_endpoint: "router.example:443".into(),
            claims,
        }
    }

    #[test]
    fn a_pending_dial_round_trips_through_its_config_map_and_carries_no_token() {
        let d = dial();
        let cm = d.to_config_map("ucm-system");
        assert_eq!(cm.metadata.namespace.as_deref(), Some("ucm-system"));
        assert!(cm.name_any().starts_with(NAME_PREFIX));
        assert_eq!(
            cm.labels().get(DIAL_LABEL).map(String::as_str),
            Some("true")
        );
        assert_eq!(PendingDial::from_config_map(&cm), Some(d.clone()));
        // The claims only: nothing in the object is a token the router accepts.
        let key = RouterKey::new(b"k".to_vec()).unwrap();
        let token = d.response(&key).router_token;
        let text = serde_json::to_string(&cm).unwrap();
        assert!(!text.contains(&token));
        assert!(
            !text.contains(token.rsplit('.').next().unwrap()),
            "no signature"
        );
    }

    #[test]
    fn the_claiming_replica_signs_the_token_the_dialer_returned() {
        // Two replicas share the router key: what the claimant pushes to the exporter is what
        // the dialer answered the client.
        let d = dial();
        let key = RouterKey::new(b"k".to_vec()).unwrap();
        let dialer = router_token::sign(&key, &d.claims);
        let cm = d.to_config_map("ucm-system");
        let claimed = PendingDial::from_config_map(&cm).unwrap().response(&key);
        assert_eq!(claimed.router_token, dialer);
        assert_eq!(claimed.router_endpoint, "router.example:443");
        router_token::verify(
            &key,
            &claimed.router_token,
            Timestamp::from_second(1_800_000_010).unwrap(),
        )
        .unwrap();
    }

    #[test]
    fn a_malformed_pending_dial_is_left_alone() {
        let mut cm = dial().to_config_map("ucm-system");
        cm.data
            .as_mut()
            .unwrap()
            .insert("claims".into(), "{".into());
        assert_eq!(PendingDial::from_config_map(&cm), None);
        cm.data = None;
        assert_eq!(PendingDial::from_config_map(&cm), None);
    }
}

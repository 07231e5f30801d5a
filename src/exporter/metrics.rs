//! The exporter feature's metrics (docs/exporter.md, "Metrics"). No metric carries a per-object
//! label; every label value is pre-initialised, so a dashboard reads 0, not "No data", from the
//! first scrape. The lease-queue metrics (docs/exporter.md, "Lease scheduling") carry the
//! namespace: theirs are the namespaces that hold an Exporter or a Lease, and the watched one
//! ([`LeaseQueueGauge`] reads them from the caches at each scrape).

use kube::runtime::reflector::Store;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::conditions;
use crate::exporter::crd::{Exporter, ExporterStatusValue, Lease};
use crate::exporter::decide::exporter::ONLINE;
use crate::runtime::controller::Guarded;

pub const WRITE_SOURCES: [&str; 6] = [
    "heartbeat",
    "connect",
    "report",
    "register",
    "unregister",
    "reconcile",
];

#[derive(Clone)]
pub struct Metrics {
    /// `jumpstarter_lease_acquisitions_total{result}`.
    pub acquisitions: IntCounterVec,
    /// `ucm_exporter_status_writes_total{source}`.
    pub status_writes: IntCounterVec,
    /// `ucm_exporter_lease_wait_seconds{namespace}`: from a lease's creation (or its
    /// beginTime, when later) to its exporter.
    pub lease_wait: HistogramVec,
    /// `ucm_exporter_lease_preemptions_total{namespace}`.
    pub preemptions: IntCounterVec,
    /// `ucm_exporter_dial_seconds{path, result}`: from a Dial's token to its push onto the
    /// exporter's Listen stream, on this replica (`local`) or another (`remote`), or to giving up
    /// (docs/exporter.md, "Dial and Listen across replicas").
    pub dials: HistogramVec,
    /// `ucm_exporter_grpc_streams{stream}`: open Status and Listen streams on this replica.
    pub streams: IntGaugeVec,
}

/// The `path` of a delivered Dial.
pub const DIAL_PATHS: [&str; 2] = ["local", "remote"];

impl Metrics {
    pub fn new() -> Self {
        let acquisitions = IntCounterVec::new(
            Opts::new(
                "jumpstarter_lease_acquisitions_total",
                "Lease acquisitions by result: success when an exporter is assigned, failure when a lease becomes Unsatisfiable",
            ),
            &["result"],
        )
        .expect("valid metric");
        for result in ["success", "failure"] {
            acquisitions.with_label_values(&[result]);
        }
        let status_writes = IntCounterVec::new(
            Opts::new(
                "ucm_exporter_status_writes_total",
                "Exporter status writes sent, by source",
            ),
            &["source"],
        )
        .expect("valid metric");
        for source in WRITE_SOURCES {
            status_writes.with_label_values(&[source]);
        }
        let lease_wait = HistogramVec::new(
            HistogramOpts::new(
                "ucm_exporter_lease_wait_seconds",
                "How long leases waited for an exporter: from creation (or beginTime, when later) to assignment",
            )
            .buckets(vec![
                1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0,
                86400.0,
            ]),
            &["namespace"],
        )
        .expect("valid metric");
        let preemptions = IntCounterVec::new(
            Opts::new(
                "ucm_exporter_lease_preemptions_total",
                "Leases held under spot access that a lease with priority over them ended",
            ),
            &["namespace"],
        )
        .expect("valid metric");
        let dials = HistogramVec::new(
            HistogramOpts::new(
                "ucm_exporter_dial_seconds",
                "Dials: from the token to its push onto the exporter's Listen stream, through this replica (local) or another (remote); result=unanswered when no Listen took it",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
            &["path", "result"],
        )
        .expect("valid metric");
        for path in DIAL_PATHS {
            dials.with_label_values(&[path, "delivered"]);
        }
        dials.with_label_values(&["remote", "unanswered"]);
        let streams = IntGaugeVec::new(
            Opts::new(
                "ucm_exporter_grpc_streams",
                "Exporters' Status and Listen streams open on this replica",
            ),
            &["stream"],
        )
        .expect("valid metric");
        for stream in ["status", "listen"] {
            streams.with_label_values(&[stream]);
        }
        Metrics {
            acquisitions,
            status_writes,
            lease_wait,
            preemptions,
            dials,
            streams,
        }
    }

    /// The lease-queue series of a namespace, at 0 until their first event.
    fn preinit_namespace(&self, namespace: &str) {
        self.lease_wait.with_label_values(&[namespace]);
        self.preemptions.with_label_values(&[namespace]);
    }

    pub fn register(&self, registry: &Registry) -> Result<(), prometheus::Error> {
        // lease_wait and preemptions are collected by the LeaseQueueGauge, which shows the
        // series of every namespace that holds an Exporter or a Lease.
        registry.register(Box::new(self.acquisitions.clone()))?;
        registry.register(Box::new(self.dials.clone()))?;
        registry.register(Box::new(self.streams.clone()))?;
        registry.register(Box::new(self.status_writes.clone()))
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Gauges computed from the Exporter cache at scrape time.
pub struct ExporterGauges {
    store: Store<Guarded<Exporter>>,
    by_status: IntGaugeVec,
    online: IntGaugeVec,
}

impl ExporterGauges {
    pub fn new(store: Store<Guarded<Exporter>>) -> Self {
        ExporterGauges {
            store,
            by_status: IntGaugeVec::new(
                Opts::new(
                    "ucm_exporter_exporters",
                    "Exporters per reported status (absent counts as Unspecified)",
                ),
                &["status"],
            )
            .expect("valid metric"),
            online: IntGaugeVec::new(
                Opts::new(
                    "ucm_exporter_exporters_online",
                    "Exporters with Online=True versus the rest",
                ),
                &["online"],
            )
            .expect("valid metric"),
        }
    }
}

/// Counts per status value and per online state (pure, for tests).
pub fn count<'a>(exporters: impl Iterator<Item = &'a Exporter>) -> ([i64; 8], [i64; 2]) {
    let mut by_status = [0i64; 8];
    let mut online = [0i64; 2];
    for e in exporters {
        let status = e
            .status
            .as_ref()
            .and_then(|s| s.exporter_status)
            .unwrap_or(ExporterStatusValue::Unspecified);
        let idx = ExporterStatusValue::ALL
            .iter()
            .position(|v| *v == status)
            .unwrap_or(0);
        by_status[idx] += 1;
        let is_online = conditions::is_true(
            e.status
                .as_ref()
                .and_then(|s| s.conditions.as_deref())
                .unwrap_or_default(),
            ONLINE,
        );
        online[usize::from(is_online)] += 1;
    }
    (by_status, online)
}

impl Collector for ExporterGauges {
    fn desc(&self) -> Vec<&Desc> {
        let mut d = self.by_status.desc();
        d.extend(self.online.desc());
        d
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let state = self.store.state();
        let (by_status, online) = count(state.iter().filter_map(|g| g.0.as_ref().ok()));
        for (value, n) in ExporterStatusValue::ALL.iter().zip(by_status) {
            self.by_status.with_label_values(&[value.as_str()]).set(n);
        }
        self.online.with_label_values(&["false"]).set(online[0]);
        self.online.with_label_values(&["true"]).set(online[1]);
        let mut out = self.by_status.collect();
        out.extend(self.online.collect());
        out
    }
}

/// The lease-queue metrics: `ucm_exporter_lease_queue_length{namespace}` (the leases waiting for
/// an exporter, from the Lease cache at scrape time), and the [`Metrics`]'
/// `ucm_exporter_lease_wait_seconds` and `ucm_exporter_lease_preemptions_total`, whose series
/// of every namespace that holds an Exporter or a Lease (and the watched one) are shown, at 0
/// before their first event.
pub struct LeaseQueueGauge {
    store: Store<Guarded<Lease>>,
    exporters: Store<Guarded<Exporter>>,
    length: IntGaugeVec,
    metrics: Metrics,
    /// The watched namespace (`--watch-namespace`): shown at 0 when it holds nothing yet.
    known: Option<String>,
}

impl LeaseQueueGauge {
    pub fn new(
        store: Store<Guarded<Lease>>,
        exporters: Store<Guarded<Exporter>>,
        metrics: &Metrics,
        known: Option<String>,
    ) -> Self {
        LeaseQueueGauge {
            store,
            exporters,
            metrics: metrics.clone(),
            known,
            length: IntGaugeVec::new(
                Opts::new(
                    "ucm_exporter_lease_queue_length",
                    "Leases waiting for an exporter (not scheduled for later), per namespace",
                ),
                &["namespace"],
            )
            .expect("valid metric"),
        }
    }
}

/// Waiting leases per namespace (pure, for tests).
pub fn queue_lengths<'a>(
    leases: impl Iterator<Item = &'a Lease>,
    now: jiff::Timestamp,
) -> std::collections::BTreeMap<String, i64> {
    let mut out = std::collections::BTreeMap::new();
    for l in leases {
        let ns = l.metadata.namespace.clone().unwrap_or_default();
        let n = out.entry(ns).or_insert(0);
        if crate::exporter::decide::lease::queue::is_waiting(l, now) {
            *n += 1;
        }
    }
    out
}

impl Collector for LeaseQueueGauge {
    fn desc(&self) -> Vec<&Desc> {
        let mut d = self.length.desc();
        d.extend(self.metrics.lease_wait.desc());
        d.extend(self.metrics.preemptions.desc());
        d
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let state = self.store.state();
        let mut lengths = queue_lengths(
            state.iter().filter_map(|g| g.0.as_ref().ok()),
            jiff::Timestamp::now(),
        );
        let exporters = self.exporters.state();
        let namespaces = exporters
            .iter()
            .filter_map(|e| e.0.as_ref().ok()?.metadata.namespace.clone())
            .chain(self.known.clone());
        for ns in namespaces {
            lengths.entry(ns).or_insert(0);
        }
        // A namespace whose leases and exporters are all gone drops out of the gauge; the
        // counters keep what they counted.
        self.length.reset();
        for (ns, n) in &lengths {
            self.length.with_label_values(&[ns]).set(*n);
            self.metrics.preinit_namespace(ns);
        }
        let mut out = self.length.collect();
        out.extend(self.metrics.lease_wait.collect());
        out.extend(self.metrics.preemptions.collect());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exporter::crd::{ExporterSpec, ExporterStatus};
    use jiff::Timestamp;

    fn exporter(status: Option<ExporterStatusValue>, online: bool) -> Exporter {
        let mut conds = Vec::new();
        conditions::set(
            &mut conds,
            conditions::Desired::new(ONLINE, online, "Seen", ""),
            None,
            &conditions::time(Timestamp::UNIX_EPOCH),
        );
        Exporter {
            metadata: Default::default(),
            spec: ExporterSpec::default(),
            status: Some(ExporterStatus {
                exporter_status: status,
                conditions: Some(conds),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn counts_match_objects() {
        let list = [
            exporter(None, false),
            exporter(Some(ExporterStatusValue::Available), true),
            exporter(Some(ExporterStatusValue::Available), true),
            exporter(Some(ExporterStatusValue::Offline), false),
        ];
        let (by_status, online) = count(list.iter());
        assert_eq!(by_status, [1, 1, 2, 0, 0, 0, 0, 0]);
        assert_eq!(online, [2, 2]);
    }

    #[test]
    fn families_are_preinitialised() {
        let m = Metrics::new();
        let registry = Registry::new();
        m.register(&registry).unwrap();
        let (_, store_writer) = kube::runtime::reflector::store::<Guarded<Exporter>>();
        let store = store_writer.as_reader();
        registry
            .register(Box::new(ExporterGauges::new(store)))
            .unwrap();
        let families = registry.gather();
        let series = |name: &str| {
            families
                .iter()
                .find(|f| f.name() == name)
                .map_or(0, |f| f.get_metric().len())
        };
        assert_eq!(series("jumpstarter_lease_acquisitions_total"), 2);
        assert_eq!(series("ucm_exporter_status_writes_total"), 6);
        assert_eq!(series("ucm_exporter_exporters"), 8);
        assert_eq!(series("ucm_exporter_exporters_online"), 2);
    }

    /// The lease-queue series of a namespace with an Exporter and no Lease yet, and of the
    /// watched namespace, are in the first scrape at 0 (a dashboard shows 0, not "No data").
    #[test]
    fn lease_queue_series_are_shown_before_the_first_lease() {
        use kube::runtime::watcher::Event;
        let m = Metrics::new();
        let registry = Registry::new();
        m.register(&registry).unwrap();
        let (leases, _lease_writer) = kube::runtime::reflector::store::<Guarded<Lease>>();
        let (exporters, mut exporter_writer) =
            kube::runtime::reflector::store::<Guarded<Exporter>>();
        let mut e = exporter(None, true);
        e.metadata.name = Some("e1".into());
        e.metadata.namespace = Some("lab".into());
        exporter_writer.apply_watcher_event(&Event::Apply(Guarded(Ok(e))));
        registry
            .register(Box::new(LeaseQueueGauge::new(
                leases,
                exporters,
                &m,
                Some("watched".into()),
            )))
            .unwrap();
        let families = registry.gather();
        let namespaces = |name: &str| {
            let mut v: Vec<String> = families
                .iter()
                .filter(|f| f.name() == name)
                .flat_map(|f| f.get_metric())
                .flat_map(|m| m.get_label())
                .filter(|l| l.name() == "namespace")
                .map(|l| l.value().to_string())
                .collect();
            v.sort();
            v
        };
        for name in [
            "ucm_exporter_lease_queue_length",
            "ucm_exporter_lease_wait_seconds",
            "ucm_exporter_lease_preemptions_total",
        ] {
            assert_eq!(namespaces(name), ["lab", "watched"], "{name}");
        }
    }

    #[test]
    fn queue_length_counts_waiting_leases_per_namespace() {
        use crate::exporter::crd::{LeaseSpec, LeaseStatus, LocalObjectReference};
        let lease = |ns: &str, assigned: bool| Lease {
            metadata: kube::api::ObjectMeta {
                name: Some("l".into()),
                namespace: Some(ns.into()),
                ..Default::default()
            },
            spec: LeaseSpec::default(),
            status: assigned.then(|| LeaseStatus {
                exporter_ref: Some(LocalObjectReference::new("e")),
                ..Default::default()
            }),
        };
        let list = [
            lease("a", false),
            lease("a", false),
            lease("a", true),
            lease("b", true),
        ];
        let got = queue_lengths(list.iter(), Timestamp::UNIX_EPOCH);
        assert_eq!(got.get("a"), Some(&2));
        assert_eq!(got.get("b"), Some(&0));
    }
}

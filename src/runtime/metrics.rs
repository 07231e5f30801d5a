//! The one Prometheus registry and every shared metric family, under controller-runtime's names
//! so existing dashboards and alerts work. Label values come only from fixed sets (controller
//! names, results, error reasons, the Lease name): never object names.

use std::time::Instant;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

/// controller-runtime's reconcile-time buckets (0.005 s to 60 s).
const RECONCILE_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9,
    1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0,
    25.0, 30.0, 40.0, 50.0, 60.0,
];

pub struct Metrics {
    pub registry: Registry,
    pub reconcile_total: IntCounterVec,
    pub reconcile_errors_total: IntCounterVec,
    pub reconcile_time_seconds: HistogramVec,
    pub active_workers: IntGaugeVec,
    pub max_concurrent_reconciles: IntGaugeVec,
    pub leader_election_master_status: IntGaugeVec,
    pub workqueue_retries_total: IntCounterVec,
    pub reconcile_errors_by_reason_total: IntCounterVec,
    pub watch_errors_total: IntCounterVec,
    pub invalid_objects_total: IntCounterVec,
}

impl Metrics {
    /// Builds the shared families in a fresh registry (never the crate's global default one).
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let reconcile_time_seconds = HistogramVec::new(
            HistogramOpts::new(
                "controller_runtime_reconcile_time_seconds",
                "Length of time per reconciliation per controller",
            )
            .buckets(RECONCILE_BUCKETS.to_vec()),
            &["controller"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(reconcile_time_seconds.clone()))
            .expect("unique metric");

        let registry = &registry;
        let m = Metrics {
            reconcile_total: counter(
                "controller_runtime_reconcile_total",
                "Total number of reconciliations per controller",
                &["controller", "result"],
            ),
            reconcile_errors_total: counter(
                "controller_runtime_reconcile_errors_total",
                "Total number of reconciliation errors per controller",
                &["controller"],
            ),
            reconcile_time_seconds,
            active_workers: gauge(
                "controller_runtime_active_workers",
                "Number of currently used workers per controller",
                &["controller"],
            ),
            max_concurrent_reconciles: gauge(
                "controller_runtime_max_concurrent_reconciles",
                "Maximum number of concurrent reconciles per controller",
                &["controller"],
            ),
            leader_election_master_status: gauge(
                "leader_election_master_status",
                "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master. 'name' is the string used to identify the lease.",
                &["name"],
            ),
            workqueue_retries_total: counter(
                "workqueue_retries_total",
                "Total number of retries handled by workqueue",
                &["name", "controller"],
            ),
            reconcile_errors_by_reason_total: counter(
                "ucm_reconcile_errors_by_reason_total",
                "Reconcile errors per controller by error kind",
                &["controller", "reason"],
            ),
            watch_errors_total: counter(
                "ucm_watch_errors_total",
                "Watch (queue) errors per controller",
                &["controller"],
            ),
            invalid_objects_total: counter(
                "ucm_invalid_objects_total",
                "Objects that could not be deserialised, per controller",
                &["controller"],
            ),
            registry: registry.clone(),
        };
        let build_info = IntGaugeVec::new(
            Opts::new("ucm_build_info", "Build metadata of the running ucm binary"),
            &["version", "revision"],
        )
        .expect("valid metric");
        m.registry
            .register(Box::new(build_info.clone()))
            .expect("unique metric");
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), env!("UCM_GIT_REVISION")])
            .set(1);
        #[cfg(target_os = "linux")]
        m.registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("unique process collector");
        m
    }

    /// Handles pre-labelled for one controller.
    pub fn controller(&self, name: &'static str, concurrency: u16) -> ControllerMetrics {
        self.max_concurrent_reconciles
            .with_label_values(&[name])
            .set(i64::from(concurrency));
        // Touch the counters so every family shows up at zero from the start.
        for result in ["success", "requeue_after", "error"] {
            self.reconcile_total.with_label_values(&[name, result]);
        }
        self.reconcile_errors_total.with_label_values(&[name]);
        self.watch_errors_total.with_label_values(&[name]);
        self.invalid_objects_total.with_label_values(&[name]);
        self.active_workers.with_label_values(&[name]);
        self.reconcile_time_seconds.with_label_values(&[name]);
        // controller-runtime's queue metrics carry the queue name; ours equals the controller's.
        self.workqueue_retries_total
            .with_label_values(&[name, name]);
        ControllerMetrics {
            name,
            reconcile_total: self.reconcile_total.clone(),
            reconcile_errors_total: self.reconcile_errors_total.clone(),
            reconcile_time_seconds: self.reconcile_time_seconds.clone(),
            active_workers: self.active_workers.clone(),
            workqueue_retries_total: self.workqueue_retries_total.clone(),
            reconcile_errors_by_reason_total: self.reconcile_errors_by_reason_total.clone(),
            watch_errors_total: self.watch_errors_total.clone(),
            invalid_objects_total: self.invalid_objects_total.clone(),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Clone)]
pub struct ControllerMetrics {
    pub name: &'static str,
    reconcile_total: IntCounterVec,
    reconcile_errors_total: IntCounterVec,
    reconcile_time_seconds: HistogramVec,
    active_workers: IntGaugeVec,
    workqueue_retries_total: IntCounterVec,
    reconcile_errors_by_reason_total: IntCounterVec,
    watch_errors_total: IntCounterVec,
    invalid_objects_total: IntCounterVec,
}

/// How a reconcile ended, as controller-runtime's `result` label spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReconcileResult {
    Success,
    RequeueAfter,
    Error,
}

impl ReconcileResult {
    fn label(self) -> &'static str {
        match self {
            ReconcileResult::Success => "success",
            ReconcileResult::RequeueAfter => "requeue_after",
            ReconcileResult::Error => "error",
        }
    }
}

impl ControllerMetrics {
    /// Starts measuring one reconcile; the guard records duration and in-flight count on every
    /// exit path, early returns included.
    pub fn measure(&self) -> ReconcileMeasurer {
        self.active_workers.with_label_values(&[self.name]).inc();
        ReconcileMeasurer {
            metrics: self.clone(),
            start: Instant::now(),
            result: ReconcileResult::Success,
        }
    }

    /// Shows every error reason the controller can report at 0 from the start, so a dashboard
    /// reads "0", not "No data", before the first error (as controller-runtime does).
    pub fn init_reasons(&self, reasons: &[&'static str]) {
        for r in reasons {
            self.reconcile_errors_by_reason_total
                .with_label_values(&[self.name, r]);
        }
    }

    pub fn error(&self, reason: &'static str) {
        self.reconcile_errors_total
            .with_label_values(&[self.name])
            .inc();
        self.reconcile_errors_by_reason_total
            .with_label_values(&[self.name, reason])
            .inc();
    }

    pub fn retry(&self) {
        self.workqueue_retries_total
            .with_label_values(&[self.name, self.name])
            .inc();
    }

    pub fn watch_error(&self) {
        self.watch_errors_total
            .with_label_values(&[self.name])
            .inc();
    }

    pub fn invalid_object(&self) {
        self.invalid_objects_total
            .with_label_values(&[self.name])
            .inc();
    }
}

pub struct ReconcileMeasurer {
    metrics: ControllerMetrics,
    start: Instant,
    result: ReconcileResult,
}

impl ReconcileMeasurer {
    pub fn set_result(&mut self, result: ReconcileResult) {
        self.result = result;
    }
}

impl Drop for ReconcileMeasurer {
    fn drop(&mut self) {
        let m = &self.metrics;
        m.active_workers.with_label_values(&[m.name]).dec();
        m.reconcile_time_seconds
            .with_label_values(&[m.name])
            .observe(self.start.elapsed().as_secs_f64());
        m.reconcile_total
            .with_label_values(&[m.name, self.result.label()])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_and_labels_are_the_controller_runtime_ones() {
        let m = Metrics::new();
        let c = m.controller("exporter", 3);
        {
            let mut g = c.measure();
            g.set_result(ReconcileResult::RequeueAfter);
        }
        c.error("kube");
        c.retry();
        m.leader_election_master_status
            .with_label_values(&["ucm-controller-manager"])
            .set(1);
        let text = String::from_utf8(crate::runtime::http::encode(&m.registry)).unwrap();
        for line in [
            "controller_runtime_reconcile_total{controller=\"exporter\",result=\"requeue_after\"} 1",
            "controller_runtime_reconcile_total{controller=\"exporter\",result=\"success\"} 0",
            "controller_runtime_reconcile_errors_total{controller=\"exporter\"} 1",
            "controller_runtime_reconcile_time_seconds_count{controller=\"exporter\"} 1",
            "controller_runtime_active_workers{controller=\"exporter\"} 0",
            "controller_runtime_max_concurrent_reconciles{controller=\"exporter\"} 3",
            "leader_election_master_status{name=\"ucm-controller-manager\"} 1",
            "workqueue_retries_total{controller=\"exporter\",name=\"exporter\"} 1",
            "ucm_reconcile_errors_by_reason_total{controller=\"exporter\",reason=\"kube\"} 1",
            "ucm_watch_errors_total{controller=\"exporter\"} 0",
            "ucm_invalid_objects_total{controller=\"exporter\"} 0",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
        assert!(text.contains(
            "controller_runtime_reconcile_time_seconds_bucket{controller=\"exporter\",le=\"0.005\"}"
        ));
        assert!(text.contains(
            "controller_runtime_reconcile_time_seconds_bucket{controller=\"exporter\",le=\"60\"}"
        ));
        assert!(text.contains("ucm_build_info{revision="));
        #[cfg(target_os = "linux")]
        assert!(text.contains("process_resident_memory_bytes"));
    }

    #[test]
    fn label_sets_are_fixed() {
        // Every family's label names: no per-object label may sneak in.
        let m = Metrics::new();
        m.controller("snapshot", 1);
        for family in m.registry.gather() {
            for metric in family.get_metric() {
                for label in metric.get_label() {
                    assert!(
                        [
                            "controller",
                            "result",
                            "name",
                            "reason",
                            "version",
                            "revision",
                            "le"
                        ]
                        .contains(&label.name()),
                        "unexpected label {} on {}",
                        label.name(),
                        family.name()
                    );
                }
            }
        }
    }
}

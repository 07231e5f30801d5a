//! Agent metrics (docs/snapshot.md, "Metrics and alert").

use prometheus::{HistogramOpts, HistogramVec, IntGauge};

/// Agent metrics (docs/snapshot.md, "Metrics and alert").
#[derive(Clone)]
pub struct AgentMetrics {
    pub barrier_held_seconds: HistogramVec,
    pub cut_seconds: HistogramVec,
    pub io_pause_seconds: HistogramVec,
    pub suspended: IntGauge,
}

impl AgentMetrics {
    pub fn register(registry: &prometheus::Registry) -> Self {
        let buckets = vec![
            0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0,
        ];
        let held = HistogramVec::new(
            HistogramOpts::new(
                "ucm_snapshot_barrier_held_seconds",
                "Per leg: from the start of the raise to the end of resume and thaw",
            )
            .buckets(buckets.clone()),
            &["backend"],
        )
        .expect("valid metric");
        let cut = HistogramVec::new(
            HistogramOpts::new(
                "ucm_snapshot_cut_seconds",
                "Sync, delete and cut of one leg",
            )
            .buckets(buckets.clone()),
            &["backend"],
        )
        .expect("valid metric");
        let pause = HistogramVec::new(
            HistogramOpts::new(
                "ucm_snapshot_io_pause_seconds",
                "Per leg: writers' IO pause, from the freeze (or suspend-io) to the end of resume-io and thaw",
            )
            .buckets(buckets),
            &["backend"],
        )
        .expect("valid metric");
        let suspended = IntGauge::new(
            "miroir_volume_suspended",
            "DRBD resources on this node with the user-suspend flag set",
        )
        .expect("valid metric");
        let _ = registry.register(Box::new(held.clone()));
        let _ = registry.register(Box::new(cut.clone()));
        let _ = registry.register(Box::new(pause.clone()));
        // Every series from the start, so the shipped alert reads a live series on an idle node
        // ("none": a leg whose volume is gone from the cache when it lifts).
        for b in ["lvmthin", "zfs", "loopfile", "none"] {
            pause.with_label_values(&[b]);
        }
        let _ = registry.register(Box::new(suspended.clone()));
        AgentMetrics {
            barrier_held_seconds: held,
            cut_seconds: cut,
            io_pause_seconds: pause,
            suspended,
        }
    }
}

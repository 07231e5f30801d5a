//! The Lease's pure decisions (docs/exporter.md, "Lease assignment", "Lease scheduling", "The
//! Lease pass"), by what they decide: which exporters a lease may have (`access`), its place in
//! the queue (`queue`), the assignment itself (`assign`, the entry), which spot lease it
//! preempts (`preempt`), when it ends (`expiry`) and the status it shows (`status`). The
//! reconciler gathers the inputs (IO) and writes the result (`crate::exporter::apply::lease`).
//! Arrows run one way: `assign` → `queue`, `preempt` → `access` → `expiry` → this file, and
//! `status` → `expiry`.

use std::time::Duration;

use jiff::Timestamp;

use crate::exporter::crd::LeaseQueue;

pub mod access;
pub mod assign;
pub mod expiry;
pub mod preempt;
pub mod queue;
pub mod status;

pub const PENDING: &str = "Pending";
pub const READY: &str = "Ready";
pub const UNSATISFIABLE: &str = "Unsatisfiable";
pub const INVALID: &str = "Invalid";
/// OURS: set on a lease a higher-priority lease preempted (docs/exporter.md, "Lease scheduling").
pub const ENDED: &str = "Ended";
pub const PREEMPTED: &str = "Preempted";

/// Label that marks ended leases (the cheap filter for active ones).
pub const ENDED_LABEL: &str = "jumpstarter.dev/lease-ended";
pub const ENDED_VALUE: &str = "true";

/// What the assignment step decided (docs/exporter.md, "Lease assignment").
#[derive(Debug, Clone, PartialEq)]
pub enum Assignment {
    /// Row 3: scheduled for later; no condition.
    Scheduled(Duration),
    Invalid {
        reason: &'static str,
        message: String,
    },
    Unsatisfiable {
        reason: &'static str,
        message: String,
    },
    Pending {
        reason: &'static str,
        message: String,
    },
    Assign {
        exporter: String,
        priority: i64,
        spot_access: bool,
    },
    /// OURS: waiting in the queue (a `Pending` condition), with its place in it.
    Queued {
        reason: &'static str,
        message: String,
        queue: LeaseQueue,
        preempt: Option<Preempt>,
    },
}

/// A lease held under spot access that a waiting lease preempts.
#[derive(Debug, Clone, PartialEq)]
pub struct Preempt {
    pub lease: String,
    pub exporter: String,
    pub at: Timestamp,
    /// The grace period is over: end it now.
    pub due: bool,
}

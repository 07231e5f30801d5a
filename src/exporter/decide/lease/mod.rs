//! The Lease's pure decisions (docs/exporter.md, "Lease assignment", "Lease scheduling", "The
//! Lease pass"): the assignment (`assign`) and the queue (`queue`).

pub mod assign;
pub mod queue;

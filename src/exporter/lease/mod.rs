//! Lease assignment: the pure decision (`assign`), the label selectors it matches with, and
//! the lease-hooks record an exporter keeps (`hooks`).

pub mod assign;
pub mod hooks;
pub mod queue;
pub mod selector;

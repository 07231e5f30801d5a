//! What of the Lease is not decision: the label selectors it matches with (`selector`) and the
//! lease-hooks record an exporter keeps (`hooks`). The decision is in
//! `crate::exporter::decide::lease`.

pub mod hooks;
pub mod selector;

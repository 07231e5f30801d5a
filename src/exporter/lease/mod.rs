//! What of the Lease is not decision: the label selectors it matches with (`selector`) and the
//! lease-hooks record an exporter keeps (`hooks`). The decision is in
//! `crate::exporter::decide::lease`.

pub mod hooks;
pub mod selector;

/// The old paths of two names, for code on other branches (grpc/, benches/) until they are
/// merged; new code imports from `crate::exporter::decide::lease`.
pub mod assign {
    pub use crate::exporter::decide::lease::ENDED_LABEL;
}
/// See [`assign`].
pub mod queue {
    pub use crate::exporter::decide::lease::queue::QueueKey;
}

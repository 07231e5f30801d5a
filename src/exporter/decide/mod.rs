//! The pure decisions of the Exporter, Client and Lease passes, by subject (docs/exporter.md,
//! "The Exporter pass", "The Client pass", "The Lease pass", "Events"): what the status should
//! be, when the next pass is due and which events the transition brings; for a Lease also which
//! exporter it gets and where it waits (`lease`).

pub mod client;
pub mod credential;
pub mod events;
pub mod exporter;
pub mod lease;
pub mod time;

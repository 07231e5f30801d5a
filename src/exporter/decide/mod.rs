//! The pure status decisions of the Exporter and Client passes, by subject (docs/exporter.md,
//! "The Exporter pass", "The Client pass", "Events"): what the status should be, when the next
//! pass is due and which events the transition brings. The Lease's decision is in
//! `crate::exporter::lease` (`assign`, `queue`).

pub mod client;
pub mod credential;
pub mod events;
pub mod exporter;
pub mod time;

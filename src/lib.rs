//! ucm: the Unified Controller Manager.

pub mod vmexport;

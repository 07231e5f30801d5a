//! ucm: the Unified Controller Manager.

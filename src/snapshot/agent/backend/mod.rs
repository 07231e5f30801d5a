//! Storage backends (docs/snapshot.md, "Backends and barrier"): one per configured pool. Every
//! operation is idempotent and every external command is bounded by `--backend-timeout`.

pub mod loopfile;
pub mod lvmthin;
pub mod zfs;

use futures::future::BoxFuture;

use super::cmd::CmdError;
use crate::snapshot::types::BackendKind;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// Try again later (e.g. an LV still open).
    #[error("busy: {0}")]
    Busy(String),
    /// The pool cannot do this at all (e.g. no reflink without full copies allowed).
    #[error("{0}")]
    Unsupported(String),
    /// The command failed; its (bounded) output.
    #[error("{0}")]
    Failed(String),
}

impl From<CmdError> for BackendError {
    fn from(e: CmdError) -> Self {
        BackendError::Failed(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// One pool's backend. `snap` is the MiroirSnapshot name; each backend derives its own object
/// name from it (`miroir-<snap>`, `@<snap>`, `<snap>.img`).
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;

    /// Checks the pool at start (loopfile: reflink support).
    fn probe(&self) -> BoxFuture<'_, Result<()>>;

    /// Flushes the volume's data to the pool before a cut. Never a global sync(2): that
    /// deadlocks against a filesystem frozen above a suspended DRBD device.
    fn sync<'a>(&'a self, volume: &'a str) -> BoxFuture<'a, Result<()>>;

    /// Cuts the snapshot `snap` of `volume`. An existing snapshot of that name counts as
    /// success, which is why the agent always deletes first (I9, docs/snapshot.md, "Invariants").
    fn cut<'a>(&'a self, volume: &'a str, snap: &'a str) -> BoxFuture<'a, Result<()>>;

    /// Deletes the snapshot `snap`, wherever it is in the pool; missing counts as success.
    fn delete<'a>(&'a self, snap: &'a str) -> BoxFuture<'a, Result<()>>;

    /// Creates volume `new_volume` from snapshot `snap` of `source_volume`.
    fn restore<'a>(
        &'a self,
        source_volume: &'a str,
        snap: &'a str,
        new_volume: &'a str,
    ) -> BoxFuture<'a, Result<()>>;

    /// Whether the snapshot `snap` exists in the pool.
    fn exists<'a>(&'a self, snap: &'a str) -> BoxFuture<'a, Result<bool>>;
}

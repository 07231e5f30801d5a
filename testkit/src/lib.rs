//! The fixtures the e2e suite (`e2e/tests/`) and the benchmark driver (`benches/ucm/`) share
//! (docs/architecture.md, "Tests, benchmarks and fuzzing"): the local control plane (`kharness
//! serve`, one per process or the one named by `UCM_E2E_KUBECONFIG`, or one of a test's own),
//! ucm's CRDs installed once, a fresh namespace per test, the spawned processes' lifecycle, and
//! what tests read back (conditions, metrics, HTTP, YAML). A missing prerequisite fails loudly;
//! nothing is skipped. Dev-only (`publish = false`): a dev-dependency of ucm, which it depends on.
//!
//! The manager fixture (`Manager`, the shipped identity) needs the `ucm` binary Cargo builds for
//! ucm's own tests, so it lives in `e2e/tests/common`.

mod checks;
mod controlplane;
mod env;
mod process;

pub use checks::*;
pub use controlplane::*;
pub use env::*;
pub use process::*;

use std::time::Duration;

pub const TIMEOUT: Duration = Duration::from_secs(60);

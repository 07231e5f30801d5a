//! ucm, the Unified Controller Manager: one process hosting the Jumpstarter exporter, Miroir
//! snapshot and KubeVirt VM-export reconcilers, each behind its own `--enable-<feature>` flag.

pub mod cli;
pub mod conditions;
#[cfg(test)]
mod docs_paths;
pub mod exporter;
pub mod godur;
pub mod k8s_names;
pub mod runtime;
pub mod snapshot;
pub mod vmexport;
pub mod yaml;

use runtime::Feature;

/// The feature registry: one line per feature. Everything else (flags, CRDs, RBAC, readiness,
/// agent subcommands) is derived from it.
pub static FEATURES: &[&Feature] = &[&snapshot::FEATURE, &exporter::FEATURE, &vmexport::FEATURE];

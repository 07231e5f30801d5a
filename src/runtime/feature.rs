//! The feature registry's element. A feature is one folder under `src/` exposing a
//! `pub static FEATURE: Feature`; adding it to [`crate::FEATURES`] is the one line that enables
//! it everywhere: `--enable-<name>` (env `UCM_ENABLE_<NAME>`), its settings flags, `ucm crds`,
//! `ucm rbac`, readiness, and its agents' subcommands.

use futures::future::BoxFuture;
use k8s_openapi::{
    api::rbac::v1::PolicyRule,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};

use super::Runtime;

pub struct Feature {
    /// Lower-case name: `exporter`, `snapshot`, `vmexport`.
    pub name: &'static str,
    /// One line for `--help`.
    pub about: &'static str,
    /// The CRDs this feature owns. Every one must be Established before `start` runs; until then
    /// the `feature-<name>` readiness check fails naming the missing CRD.
    pub crds: fn() -> Vec<CustomResourceDefinition>,
    /// Cluster-wide rules the manager needs for this feature (least privilege; `ucm rbac` adds
    /// read access to the feature's own CRDs).
    pub rbac: fn() -> Vec<PolicyRule>,
    /// Rules needed only in the manager's own namespace (a Role there), e.g. agent Leases.
    pub namespaced_rbac: fn() -> Vec<PolicyRule>,
    /// Adds this feature's own manager flags (e.g. `<Settings as clap::Args>::augment_args`).
    pub settings: fn(clap::Command) -> clap::Command,
    /// Starts the feature's controllers (and leader-only servers) on the shared runtime and runs
    /// until `rt.shutdown` is cancelled and they have drained. `Err` means a setting is present
    /// but invalid: the feature stays off, its readiness check reports the message, and the other
    /// features run. Returning `Ok` before shutdown is treated as a crash.
    pub start: fn(Runtime, clap::ArgMatches) -> BoxFuture<'static, Result<(), String>>,
    /// The feature's data-path programs, each a `ucm <name>` subcommand.
    pub agents: &'static [Agent],
}

impl Feature {
    /// The CRDs as installed: the feature's own, with the bounds every ucm CRD shares
    /// ([`super::crd_bounds`]).
    pub fn installed_crds(&self) -> Vec<CustomResourceDefinition> {
        (self.crds)()
            .into_iter()
            .map(super::crd_bounds::bound_timestamps)
            .collect()
    }
}

pub struct Agent {
    pub name: &'static str,
    /// The subcommand with its flags (`<Args as clap::Args>::augment_args(Command::new(name))`).
    pub command: fn() -> clap::Command,
    pub run: fn(clap::ArgMatches) -> BoxFuture<'static, anyhow::Result<()>>,
}

impl Feature {
    pub fn check_name(&self) -> String {
        format!("feature-{}", self.name)
    }

    pub fn enable_flag(&self) -> String {
        format!("enable-{}", self.name)
    }

    pub fn enable_env(&self) -> String {
        format!("UCM_ENABLE_{}", self.name.to_uppercase())
    }
}

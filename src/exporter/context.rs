//! The feature's shared state (docs/exporter.md, "Objects", "Lease assignment"): the
//! [`Context`] every pass and server reads, the caches and timed wake-ups it holds, and the
//! passes' [`Error`].

use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use kube::api::PartialObjectMeta;
use kube::runtime::reflector::Store;

use crate::exporter::auth::token::SigningKey;
use crate::exporter::crd::{Client, Exporter, ExporterAccessPolicy, Lease};
use crate::exporter::own_writes::{Ledger, Replacements, Tokens};
use crate::exporter::settings::Settings;
use crate::runtime::controller::Guarded;
use crate::runtime::timers::Timers;
use crate::runtime::writer::kube_metric_label;
use crate::runtime::{ReconcileError, Synced, WriteError, Writer};

/// What the Exporter, Client and Lease passes, the gRPC services and the login endpoint share.
pub struct Context {
    /// The reconcilers' writes: leader only.
    pub writer: Writer,
    /// The writes a gRPC call causes, made by whichever replica serves the call
    /// (`crate::exporter::grpc`, "Which replica writes what").
    pub calls: Writer,
    pub client: kube::Client,
    pub settings: Settings,
    pub key: SigningKey,
    pub metrics: crate::exporter::metrics::Metrics,
    pub caches: Caches,
    /// Our lease assignments the Lease cache may not show yet.
    pub ledger: Ledger,
    /// Our status writes whose watch event has not arrived.
    pub replaced: Replacements,
    /// The tokens our credential Secrets hold, per resourceVersion.
    pub tokens: Tokens,
    /// Each controller's timed wake-ups.
    pub wakeups: Wakeups,
}

/// The next timed pass of every Exporter, Client and Lease that has one (a token threshold, an
/// exporter going offline, a lease's begin or end), fed back to its controller as a trigger.
#[derive(Default)]
pub struct Wakeups {
    pub exporters: Arc<Timers<Guarded<Exporter>>>,
    pub clients: Arc<Timers<Guarded<Client>>>,
    pub leases: Arc<Timers<Guarded<Lease>>>,
}

/// The feature's caches, one per kind, each fed by the watch that also triggers the passes
/// that read it (see `crate::exporter::run::start`). Guarded: an unreadable object is skipped by every
/// decision that reads the cache, and reported by its own controller's pass.
pub struct Caches {
    /// Open once every cache below has listed.
    pub synced: Synced,
    pub exporters: Store<Guarded<Exporter>>,
    /// Active Leases: without the ended label.
    pub leases: Store<Guarded<Lease>>,
    pub clients: Store<Guarded<Client>>,
    pub policies: Store<Guarded<ExporterAccessPolicy>>,
    /// Metadata only.
    pub secrets: Store<PartialObjectMeta<Secret>>,
}

/// A failed step of a pass. Each variant names the step; the cause is its `source`, so the
/// runtime's `error_chain` prints it once.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A write of the pass (status, child, finalizer); the cause is the source.
    #[error("write")]
    Write(#[from] WriteError),
    /// A credential Secret the metadata cache knows, read for its token.
    #[error("read Secret {0}")]
    ReadSecret(String, #[source] kube::Error),
    /// The exporter a lease is about to get, read fresh (docs/exporter.md, "Lease hooks: the
    /// assignment gate").
    #[error("read Exporter {0}")]
    ReadExporter(String, #[source] kube::Error),
    /// The fresh reads an Unsatisfiable end is decided on.
    #[error("confirm that Lease {0} is unsatisfiable")]
    ConfirmUnsatisfiable(String, #[source] kube::Error),
}

impl ReconcileError for Error {
    fn metric_label(&self) -> &'static str {
        match self {
            Error::Write(e) => e.metric_label(),
            Error::ReadSecret(_, e)
            | Error::ReadExporter(_, e)
            | Error::ConfirmUnsatisfiable(_, e) => kube_metric_label(e),
        }
    }
    fn is_conflict(&self) -> bool {
        match self {
            Error::Write(e) => e.is_conflict(),
            // Reads never conflict.
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_errors_name_their_step_and_print_the_cause_once() {
        let forbidden = || {
            kube::Error::Api(Box::new(kube::core::Status {
                code: 403,
                message: "secrets \"e1-exporter\" is forbidden".into(),
                ..Default::default()
            }))
        };
        let e = Error::ReadSecret("e1-exporter".into(), forbidden());
        // The step's own message holds no cause: the chain adds it once, after it.
        assert_eq!(e.to_string(), "read Secret e1-exporter");
        let chain = crate::runtime::controller::error_chain(&e);
        assert!(chain.starts_with("read Secret e1-exporter: "), "{chain}");
        assert_eq!(chain.matches("is forbidden: ").count(), 1, "{chain}");
        assert_eq!(e.metric_label(), "forbidden");
        let e = Error::Write(WriteError::Kube(forbidden()));
        assert_eq!(e.to_string(), "write");
        let chain = crate::runtime::controller::error_chain(&e);
        assert!(chain.starts_with("write: ApiError: "), "{chain}");
        assert_eq!(chain.matches("is forbidden: ").count(), 1, "{chain}");
        let e = Error::ConfirmUnsatisfiable("l1".into(), forbidden());
        assert!(e.to_string().contains("Lease l1"), "{e}");
        assert!(!e.is_conflict());
    }
}

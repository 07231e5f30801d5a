//! The feature's shared state (docs/exporter.md, "Objects", "Lease assignment"): the
//! [`Context`] every pass and server reads, the caches and timed wake-ups it holds, the
//! passes' [`Error`], and the [`Settings`] (flags: [`Args`]).

use std::sync::Arc;

use jiff::SignedDuration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::PartialObjectMeta;
use kube::runtime::reflector::Store;

use crate::exporter::auth::signing::KeySource;
use crate::exporter::auth::token::{SigningKey, TokenPolicy};
use crate::exporter::config::ControllerConfig;
use crate::exporter::crd::{Client, Exporter, ExporterAccessPolicy, Lease};
use crate::exporter::decide::exporter::StatusSettings;
use crate::exporter::own_writes::{Ledger, Replacements, Tokens};
use crate::godur;
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

// ---- Settings (docs/exporter.md, "Settings and RBAC"): flags are plain strings so that a
// present but invalid value fails this feature only (docs/runtime.md, "Feature settings"),
// validated in `Settings::resolve`. ----

pub const DEFAULT_ENDPOINT: &str = "localhost:8082";

#[derive(clap::Args, Debug, Clone, Default)]
pub struct Args {
    /// The advertised gRPC endpoint, written to `status.endpoint` (env GRPC_ENDPOINT as fallback;
    /// default localhost:8082).
    #[arg(long = "exporter-grpc-endpoint")]
    pub grpc_endpoint: Option<String>,
    /// Secret in the manager's namespace holding the PKCS#8 P-256 signing key under `key.pem`
    /// (exclusive with CONTROLLER_KEY).
    #[arg(long = "exporter-signing-key-secret")]
    pub signing_key_secret: Option<String>,
    /// Exporters not seen for this long are Offline (Go duration).
    #[arg(long = "exporter-offline-threshold", default_value = "60s")]
    pub offline_threshold: String,
    /// Renew an exporter token when at most this much lifetime remains; 0 disables renewal.
    #[arg(long = "exporter-token-renew-before", default_value = "720h")]
    pub token_renew_before: String,
    /// Renew when at most this fraction of the lifetime remains (the smaller margin wins).
    #[arg(long = "exporter-token-renew-fraction", default_value = "0.3333")]
    pub token_renew_fraction: String,
    /// Upper bound of any timed requeue (guard against wall-clock jumps).
    #[arg(long = "exporter-max-requeue", default_value = "24h")]
    pub max_requeue: String,
    /// Listen address of the controller gRPC service (validated here; served by the gRPC
    /// server of the protocol issue).
    #[arg(long = "exporter-grpc-bind-address", default_value = ":8082")]
    pub grpc_bind_address: String,
    /// Router endpoint handed to clients and exporters when the ConfigMap names none (gRPC
    /// service; validated here).
    #[arg(long = "exporter-router-endpoint", default_value = "localhost:8083")]
    pub router_endpoint: String,
    /// Service (in the manager's namespace) of the router Pods: a Dial names one that is ready,
    /// by its Pod address, and never one that drains (docs/exporter.md, "Routers that drain").
    /// The ConfigMap's `router` entries still win.
    #[arg(long = "exporter-router-service", value_name = "NAME")]
    pub router_service: Option<String>,
    /// Minimum spacing of heartbeat `lastSeen` writes (default T/3, at most T/2; gRPC service).
    #[arg(long = "exporter-heartbeat-interval")]
    pub heartbeat_interval: Option<String>,
    /// Listen address of the login service (`/v1/auth/config` for `jmp login`, served by every
    /// replica); "0" disables it.
    #[arg(long = "exporter-login-bind-address", default_value = ":8086")]
    pub login_bind_address: String,
    /// Namespace the login service tells `jmp login` to use (default: the watched namespace, else
    /// the manager's).
    #[arg(long = "exporter-login-namespace")]
    pub login_namespace: Option<String>,
    /// How long a lease held under spot access keeps its exporter once a lease with priority
    /// over it preempts it (Go duration; 0 ends it at once). See docs/exporter.md, "Lease
    /// scheduling".
    #[arg(long = "exporter-preemption-grace", default_value = "30s")]
    pub preemption_grace: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub status: StatusSettings,
    pub token: TokenPolicy,
    pub key_source: KeySource,
    /// For the gRPC service: where it listens, the default router, the heartbeat spacing.
    pub grpc_bind_address: crate::runtime::cli::BindAddress,
    pub router_endpoint: String,
    pub router_service: Option<String>,
    pub heartbeat_interval: SignedDuration,
    /// The login service: where it listens and the namespace it advertises.
    pub login_bind_address: crate::runtime::cli::BindAddress,
    pub login_namespace: Option<String>,
    /// How long a preempted spot lease keeps its exporter.
    pub preemption_grace: SignedDuration,
    /// The `jumpstarter-controller` ConfigMap (defaults until [`Settings::with_config`]).
    pub config: ControllerConfig,
}

impl Settings {
    /// Applies the ConfigMap: its token lifetime becomes the lifetime of minted tokens.
    pub fn with_config(mut self, config: ControllerConfig) -> Settings {
        self.token.lifetime = config.token_lifetime;
        self.config = config;
        self
    }

    /// Validates the flags plus the environment (`GRPC_ENDPOINT`, `CONTROLLER_KEY`).
    pub fn resolve(
        args: &Args,
        env_endpoint: Option<String>,
        env_controller_key: Option<String>,
    ) -> Result<Settings, String> {
        let dur =
            |flag: &str, v: &str| godur::parse_signed(v).map_err(|e| format!("--{flag}: {e}"));
        let offline_threshold = dur("exporter-offline-threshold", &args.offline_threshold)?;
        if offline_threshold <= SignedDuration::ZERO {
            return Err("--exporter-offline-threshold must be positive".into());
        }
        let renew_before = dur("exporter-token-renew-before", &args.token_renew_before)?;
        if renew_before < SignedDuration::ZERO {
            return Err("--exporter-token-renew-before must not be negative".into());
        }
        let renew_fraction: f64 = args
            .token_renew_fraction
            .parse()
            .ok()
            .filter(|f: &f64| (0.0..1.0).contains(f))
            .ok_or("--exporter-token-renew-fraction must be a number in [0, 1)")?;
        let max_requeue = dur("exporter-max-requeue", &args.max_requeue)?;
        if max_requeue <= SignedDuration::ZERO {
            return Err("--exporter-max-requeue must be positive".into());
        }
        let endpoint = args
            .grpc_endpoint
            .clone()
            .filter(|e| !e.is_empty())
            .or(env_endpoint.filter(|e| !e.is_empty()))
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let key_source = key_source(env_controller_key, args.signing_key_secret.as_ref())?;
        let grpc_bind_address = crate::runtime::cli::parse_bind_address(&args.grpc_bind_address)
            .map_err(|e| format!("--exporter-grpc-bind-address: {e}"))?;
        if args.router_endpoint.is_empty() {
            return Err("--exporter-router-endpoint is empty".into());
        }
        let heartbeat_interval = match &args.heartbeat_interval {
            None => offline_threshold / 3,
            Some(v) => dur("exporter-heartbeat-interval", v)?,
        };
        if heartbeat_interval <= SignedDuration::ZERO || heartbeat_interval > offline_threshold / 2
        {
            return Err("--exporter-heartbeat-interval must be positive and at most half the offline threshold".into());
        }
        let login_bind_address = crate::runtime::cli::parse_bind_address(&args.login_bind_address)
            .map_err(|e| format!("--exporter-login-bind-address: {e}"))?;
        let preemption_grace = match args.preemption_grace.as_str() {
            "" => SignedDuration::from_secs(30),
            v => dur("exporter-preemption-grace", v)?,
        };
        if preemption_grace < SignedDuration::ZERO {
            return Err("--exporter-preemption-grace must not be negative".into());
        }
        Ok(Settings {
            preemption_grace,
            login_bind_address,
            login_namespace: args.login_namespace.clone().filter(|n| !n.is_empty()),
            grpc_bind_address,
            router_endpoint: args.router_endpoint.clone(),
            router_service: args.router_service.clone().filter(|s| !s.is_empty()),
            heartbeat_interval,
            config: ControllerConfig::default(),
            status: StatusSettings {
                offline_threshold,
                endpoint,
                max_requeue,
            },
            token: TokenPolicy {
                renew_before,
                renew_fraction,
                ..TokenPolicy::default()
            },
            key_source,
        })
    }
}

/// Where the signing key comes from: the `CONTROLLER_KEY` seed or the named Secret (not both),
/// else the generated one.
fn key_source(
    env_controller_key: Option<String>,
    secret: Option<&String>,
) -> Result<KeySource, String> {
    match (env_controller_key, secret) {
        (Some(_), Some(_)) => {
            Err("CONTROLLER_KEY and --exporter-signing-key-secret are both set; choose one".into())
        }
        (Some(seed), None) if seed.is_empty() => Err("CONTROLLER_KEY is set but empty".into()),
        (Some(seed), None) => Ok(KeySource::Seed(seed)),
        (None, Some(name)) if name.is_empty() => {
            Err("--exporter-signing-key-secret is empty".into())
        }
        (None, Some(name)) => Ok(KeySource::Secret(name.clone())),
        (None, None) => Ok(KeySource::Generated),
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

#[cfg(test)]
mod settings_tests {
    use super::*;
    use clap::{Args as _, Command, FromArgMatches};

    fn parse(argv: &[&str]) -> Args {
        let cmd = Args::augment_args(Command::new("t"));
        let m = cmd
            .try_get_matches_from(std::iter::once("t").chain(argv.iter().copied()))
            .unwrap();
        Args::from_arg_matches(&m).unwrap()
    }

    #[test]
    fn defaults() {
        let s = Settings::resolve(&parse(&[]), None, None).unwrap();
        assert_eq!(s.status.endpoint, "localhost:8082");
        assert_eq!(s.status.offline_threshold, SignedDuration::from_secs(60));
        assert_eq!(s.status.max_requeue, SignedDuration::from_hours(24));
        assert_eq!(s.token, TokenPolicy::default());
        assert_eq!(s.key_source, KeySource::Generated);
        assert_eq!(s.heartbeat_interval, SignedDuration::from_secs(20));
        assert_eq!(s.router_endpoint, "localhost:8083");
        assert_eq!(s.preemption_grace, SignedDuration::from_secs(30));
        let zero = Settings::resolve(&parse(&["--exporter-preemption-grace=0s"]), None, None);
        assert_eq!(zero.unwrap().preemption_grace, SignedDuration::ZERO);
        assert!(
            Settings::resolve(&parse(&["--exporter-preemption-grace=-1s"]), None, None).is_err()
        );
        assert_eq!(
            s.grpc_bind_address,
            crate::runtime::cli::parse_bind_address(":8082").unwrap()
        );
        assert_eq!(
            s.login_bind_address,
            crate::runtime::cli::parse_bind_address(":8086").unwrap()
        );
    }

    #[test]
    fn endpoint_precedence() {
        let s = Settings::resolve(&parse(&[]), Some("env:1".into()), None).unwrap();
        assert_eq!(s.status.endpoint, "env:1");
        let s = Settings::resolve(
            &parse(&["--exporter-grpc-endpoint", "flag:2"]),
            Some("env:1".into()),
            None,
        )
        .unwrap();
        assert_eq!(s.status.endpoint, "flag:2");
    }

    #[test]
    fn key_sources_and_conflicts() {
        let s = Settings::resolve(&parse(&[]), None, Some("seed".into())).unwrap();
        assert_eq!(s.key_source, KeySource::Seed("seed".into()));
        let s =
            Settings::resolve(&parse(&["--exporter-signing-key-secret", "k"]), None, None).unwrap();
        assert_eq!(s.key_source, KeySource::Secret("k".into()));
        assert!(
            Settings::resolve(
                &parse(&["--exporter-signing-key-secret", "k"]),
                None,
                Some("s".into())
            )
            .is_err()
        );
        assert!(Settings::resolve(&parse(&[]), None, Some(String::new())).is_err());
    }

    #[test]
    fn invalid_values_are_reported() {
        for argv in [
            &["--exporter-offline-threshold", "soon"][..],
            &["--exporter-offline-threshold", "0s"],
            &["--exporter-token-renew-fraction", "2"],
            &["--exporter-max-requeue=-1h"],
            &["--exporter-token-renew-before=-1h"],
            &["--exporter-heartbeat-interval", "31s"],
            &["--exporter-grpc-bind-address", "nowhere"],
        ] {
            assert!(
                Settings::resolve(&parse(argv), None, None).is_err(),
                "{argv:?}"
            );
        }
        let s =
            Settings::resolve(&parse(&["--exporter-token-renew-before", "0"]), None, None).unwrap();
        assert!(s.token.renew_before.is_zero());
    }

    #[test]
    fn config_map_lifetime_applies_to_minted_tokens() {
        let s = Settings::resolve(&parse(&[]), None, None).unwrap();
        assert_eq!(s.token.lifetime, SignedDuration::from_hours(365 * 24));
        let config = ControllerConfig {
            token_lifetime: SignedDuration::from_hours(2),
            ..ControllerConfig::default()
        };
        let s = s.with_config(config.clone());
        assert_eq!(s.token.lifetime, SignedDuration::from_hours(2));
        assert_eq!(s.token.renew_before, SignedDuration::from_hours(720));
        assert_eq!(s.config, config);
    }
}

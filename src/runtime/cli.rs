//! Command-line flags of `ucm manager`, with controller-runtime names and defaults, and the Go
//! value forms operators already type (`--leader-elect`, `:8080`, `1m30s`).

use std::{net::SocketAddr, time::Duration};

use clap::{ArgAction, Args, ValueEnum};

/// The shared manager flags. Per-feature switches (`--enable-<name>`) and feature settings are
/// added from the feature registry (see [`crate::runtime::feature`]).
#[derive(Args, Debug, Clone)]
pub struct ManagerArgs {
    /// Path to a kubeconfig. Unset: KUBECONFIG, then ~/.kube/config, then in-cluster config.
    #[arg(long, env = "KUBECONFIG", value_name = "PATH")]
    pub kubeconfig: Option<String>,

    /// Address the metrics endpoint (/metrics) binds to: ":8080", "host:port", or "0" to disable.
    #[arg(long, default_value = ":8080", value_parser = parse_bind_address, value_name = "ADDR")]
    pub metrics_bind_address: BindAddress,

    /// Address the health probes (/healthz, /readyz) bind to: ":8081", "host:port", or "0" to disable.
    #[arg(long, default_value = ":8081", value_parser = parse_bind_address, value_name = "ADDR")]
    pub health_probe_bind_address: BindAddress,

    /// Enable leader election (one active writer; other replicas are warm standbys).
    #[arg(long, default_value = "false", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", action = ArgAction::Set, value_parser = parse_go_bool,
          value_name = "BOOL")]
    pub leader_elect: bool,

    /// Name of the coordination.k8s.io Lease used for leader election.
    #[arg(long, default_value = "ucm-controller-manager", value_name = "NAME")]
    pub leader_election_id: String,

    /// Namespace of the leader-election Lease. Default: the manager's namespace (--namespace).
    #[arg(long, value_name = "NAMESPACE")]
    pub leader_election_namespace: Option<String>,

    /// How long a non-leader waits after the last observed renewal before taking over.
    #[arg(long, default_value = "15s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub leader_elect_lease_duration: Duration,

    /// How long the leader keeps retrying a renewal before it gives up leadership.
    #[arg(long, default_value = "10s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub leader_elect_renew_deadline: Duration,

    /// How often candidates retry acquiring and the leader renews.
    #[arg(long, default_value = "2s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub leader_elect_retry_period: Duration,

    /// Restrict every namespaced watch to this namespace (empty: all namespaces). Cluster-scoped
    /// kinds are always watched cluster-wide.
    #[arg(
        long,
        env = "WATCH_NAMESPACE",
        default_value = "",
        value_name = "NAMESPACE"
    )]
    pub watch_namespace: String,

    /// Reconciles each controller runs at once. 8, chosen by measurement (docs/benchmarks.md,
    /// "Workers: why 8"): kube-runtime never runs two passes of one object at once, and the
    /// reconcilers guard what objects share (the lease ledger, the per-volume snapshot lock).
    #[arg(long, default_value = "8", value_parser = clap::value_parser!(u16).range(1..), value_name = "N")]
    pub max_concurrent_reconciles: u16,

    /// How long shutdown waits for in-flight reconciles before giving up.
    #[arg(long, default_value = "30s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub graceful_shutdown_timeout: Duration,

    /// The manager's own namespace (leader Lease, generated keys and certificates). Default:
    /// POD_NAMESPACE, else the service-account namespace file, else "default" with a warning.
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pub namespace: Option<String>,

    /// Log filter directive, e.g. "info,kube=warn". Default: RUST_LOG, else "info".
    #[arg(long, value_name = "DIRECTIVE")]
    pub log_level: Option<String>,

    /// Log output format.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// A listen address in Go form: `:8080` (all interfaces), `host:port`, or `0` (off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindAddress {
    Disabled,
    Addr(SocketAddr),
}

impl BindAddress {
    pub fn addr(self) -> Option<SocketAddr> {
        match self {
            BindAddress::Disabled => None,
            BindAddress::Addr(a) => Some(a),
        }
    }
}

pub fn parse_bind_address(s: &str) -> Result<BindAddress, String> {
    if s == "0" {
        return Ok(BindAddress::Disabled);
    }
    let full = match s.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => s.replace("localhost:", "127.0.0.1:"),
    };
    full.parse::<SocketAddr>()
        .map(BindAddress::Addr)
        .map_err(|_| format!("expected \":PORT\", \"HOST:PORT\" or \"0\", got {s:?}"))
}

/// Go `strconv.ParseBool`, which `flag` uses for boolean flags.
pub fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(format!("expected true or false, got {s:?}")),
    }
}

impl ManagerArgs {
    /// Cross-flag rules that clap cannot express (docs/runtime.md, "Flags").
    pub fn validate(&self) -> Result<(), String> {
        if self.leader_elect_renew_deadline >= self.leader_elect_lease_duration {
            return Err(format!(
                "invalid value for '--leader-elect-renew-deadline': {} must be less than --leader-elect-lease-duration ({})",
                crate::godur::format(self.leader_elect_renew_deadline),
                crate::godur::format(self.leader_elect_lease_duration)
            ));
        }
        if self.leader_elect_retry_period >= self.leader_elect_renew_deadline {
            return Err(format!(
                "invalid value for '--leader-elect-retry-period': {} must be less than --leader-elect-renew-deadline ({})",
                crate::godur::format(self.leader_elect_retry_period),
                crate::godur::format(self.leader_elect_renew_deadline)
            ));
        }
        Ok(())
    }
}

const SA_NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// The manager's namespace: the flag (or POD_NAMESPACE), else the service-account file, else
/// `default`. The bool tells whether the fallback was used, so the caller can warn once logging is up.
pub fn resolve_namespace(flag: Option<&str>) -> (String, bool) {
    if let Some(ns) = flag.filter(|s| !s.is_empty()) {
        return (ns.to_string(), false);
    }
    if let Ok(ns) = std::fs::read_to_string(SA_NAMESPACE_FILE) {
        let ns = ns.trim();
        if !ns.is_empty() {
            return (ns.to_string(), false);
        }
    }
    ("default".to_string(), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_bools() {
        assert!(parse_go_bool("true").unwrap());
        assert!(parse_go_bool("1").unwrap());
        assert!(!parse_go_bool("False").unwrap());
        assert!(parse_go_bool("yes").is_err());
    }

    #[test]
    fn bind_addresses() {
        assert_eq!(parse_bind_address("0").unwrap(), BindAddress::Disabled);
        assert_eq!(
            parse_bind_address(":8080").unwrap().addr().unwrap(),
            "0.0.0.0:8080".parse().unwrap()
        );
        assert_eq!(
            parse_bind_address("127.0.0.1:9").unwrap().addr().unwrap(),
            "127.0.0.1:9".parse().unwrap()
        );
        assert_eq!(
            parse_bind_address("localhost:9").unwrap().addr().unwrap(),
            "127.0.0.1:9".parse().unwrap()
        );
        assert!(parse_bind_address("8080").is_err());
        assert!(parse_bind_address(":http").is_err());
    }

    #[test]
    fn namespace_flag_wins() {
        assert_eq!(resolve_namespace(Some("ops")), ("ops".to_string(), false));
    }
}

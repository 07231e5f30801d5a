//! `ucm snapshot-agent` flags (docs/snapshot.md, "Settings and RBAC") and its clap command; the
//! agent's registration with the feature is in `main.rs`, beside the `main` it runs.

use std::path::PathBuf;
use std::time::Duration;

use crate::runtime::cli::{BindAddress, LogFormat, parse_bind_address, parse_go_bool};
use clap::{Args, ValueEnum};

pub const NAME: &str = "snapshot-agent";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BarrierKind {
    /// DRBD suspend-io/resume-io and FIFREEZE/FITHAW.
    Drbd,
    /// The recording test double: no kernel or DRBD state is touched.
    Fake,
}

// `ucm snapshot-agent` flags (docs/snapshot.md, "Settings and RBAC"); a plain comment so the
// subcommand keeps its about.
#[derive(Args, Debug, Clone)]
pub struct AgentArgs {
    /// This node's name (the DaemonSet sets it from the downward API).
    #[arg(long, env = "NODE_NAME", value_name = "NODE")]
    pub node_name: String,

    /// Path to a kubeconfig. Unset: KUBECONFIG, then ~/.kube/config, then in-cluster config.
    #[arg(long, env = "KUBECONFIG", value_name = "PATH")]
    pub kubeconfig: Option<String>,

    /// Namespace of this agent's heartbeat Lease. Default: POD_NAMESPACE, else "default".
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pub namespace: Option<String>,

    /// D: every barrier is lifted this long after the round opened (keep equal to the manager's).
    #[arg(long = "snapshot-deadline", default_value = "60s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub deadline: Duration,

    /// G: no cut starts and no Done is written this close to the deadline; must exceed clock skew.
    #[arg(long = "snapshot-cut-guard", default_value = "5s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub cut_guard: Duration,

    /// How often the heartbeat Lease is renewed.
    #[arg(long, default_value = "20s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub heartbeat_interval: Duration,

    /// How often the heartbeat Lease is renewed while a live round names this node (the
    /// manager voids a round early when a leg falls silent for its --snapshot-round-stale-after).
    #[arg(long, default_value = "2s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub round_heartbeat_interval: Duration,

    /// IO barrier implementation.
    #[arg(long, value_enum, default_value = "drbd")]
    pub barrier: BarrierKind,

    /// State and event-log directory of the fake barrier (with --barrier=fake).
    #[arg(long, value_name = "DIR")]
    pub fake_barrier_dir: Option<PathBuf>,

    /// Bound on each DRBD call and on a freeze.
    #[arg(long, default_value = "30s", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub barrier_timeout: Duration,

    /// Bound on each backend command.
    #[arg(long, default_value = "2m", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub backend_timeout: Duration,

    /// Consecutive barrier or cut failures before the leg reports Error.
    #[arg(long, default_value = "5", value_name = "N")]
    pub barrier_fail_limit: u32,

    /// Interval of the stale-barrier sweep (also run at start and stop).
    #[arg(long, default_value = "5m", value_parser = crate::godur::parse, value_name = "DURATION")]
    pub sweep_interval: Duration,

    /// Pool configuration file (pool name → backend). Unset: diskless legs only.
    #[arg(long, value_name = "PATH")]
    pub pools: Option<PathBuf>,

    /// Allow sparse full copies where the loopfile pool's filesystem has no reflink.
    #[arg(long, default_value = "false", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", action = clap::ArgAction::Set, value_parser = parse_go_bool,
          value_name = "BOOL")]
    pub loopfile_full_copy: bool,

    /// The barrier journal; keep it on a node-local tmpfs so a reboot clears it.
    #[arg(
        long,
        default_value = "/run/ucm-snapshot-agent/journal.json",
        value_name = "PATH"
    )]
    pub journal: PathBuf,

    /// Address of /metrics: ":8080", "host:port", or "0" to disable.
    #[arg(long, default_value = ":8080", value_parser = parse_bind_address, value_name = "ADDR")]
    pub metrics_bind_address: BindAddress,

    /// Address of /healthz and /readyz: ":8081", "host:port", or "0" to disable.
    #[arg(long, default_value = ":8081", value_parser = parse_bind_address, value_name = "ADDR")]
    pub health_probe_bind_address: BindAddress,

    /// Log filter directive. Default: RUST_LOG, else "info".
    #[arg(long, value_name = "DIRECTIVE")]
    pub log_level: Option<String>,

    /// Log output format.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

pub(super) fn command() -> clap::Command {
    AgentArgs::augment_args(
        clap::Command::new(NAME)
            .about("Run the per-node snapshot agent (barrier and cut of each leg)"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::FromArgMatches;

    #[test]
    fn agent_flags_parse_with_defaults() {
        let m = command()
            .try_get_matches_from(["snapshot-agent", "--node-name", "n1"])
            .unwrap();
        let a = AgentArgs::from_arg_matches(&m).unwrap();
        assert_eq!(a.deadline, Duration::from_secs(60));
        assert_eq!(a.cut_guard, Duration::from_secs(5));
        assert_eq!(a.heartbeat_interval, Duration::from_secs(20));
        assert_eq!(a.round_heartbeat_interval, Duration::from_secs(2));
        assert_eq!(a.barrier, BarrierKind::Drbd);
        assert_eq!(a.barrier_timeout, Duration::from_secs(30));
        assert_eq!(a.backend_timeout, Duration::from_secs(120));
        assert_eq!(a.barrier_fail_limit, 5);
        assert_eq!(a.sweep_interval, Duration::from_secs(300));
        assert!(!a.loopfile_full_copy);
        for (arg, want) in [
            ("--loopfile-full-copy", true),
            ("--loopfile-full-copy=true", true),
            ("--loopfile-full-copy=false", false),
        ] {
            let m = command()
                .try_get_matches_from(["snapshot-agent", "--node-name", "n1", arg])
                .unwrap();
            assert_eq!(
                AgentArgs::from_arg_matches(&m).unwrap().loopfile_full_copy,
                want,
                "{arg}"
            );
        }
    }
}

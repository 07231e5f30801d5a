//! `ucm export-server` flags and its registration as the vmexport feature's agent. Its
//! configuration is the environment the export pod sets (docs/vmexport.md, "Export pod"); the
//! flags only shape logging.

use clap::{Args, FromArgMatches};
use futures::future::BoxFuture;

use crate::runtime::{Agent, cli::LogFormat, logging};

pub const NAME: &str = "export-server";

// `ucm export-server` flags; a plain comment so the subcommand keeps its about.
#[derive(Args, Debug, Clone)]
pub struct AgentArgs {
    /// Log filter directive. Default: RUST_LOG, else "info".
    #[arg(long, value_name = "DIRECTIVE")]
    pub log_level: Option<String>,

    /// Log output format.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

fn command() -> clap::Command {
    AgentArgs::augment_args(clap::Command::new(NAME).about(
        "Serve the volumes of a VirtualMachineExport over HTTPS (configured by the export pod's environment)",
    ))
}

fn run(m: clap::ArgMatches) -> BoxFuture<'static, anyhow::Result<()>> {
    Box::pin(async move {
        let args = AgentArgs::from_arg_matches(&m)?;
        logging::init(args.log_level.as_deref(), args.log_format)
            .map_err(|e| anyhow::anyhow!(e))?;
        let cfg = super::config::from_env(std::env::vars())
            .map_err(|e| anyhow::anyhow!("invalid export-server configuration: {e}"))?;
        super::run(cfg).await
    })
}

pub const AGENT: Agent = Agent {
    name: NAME,
    command,
    run,
};

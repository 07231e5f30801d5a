//! The `ucm` binary's subcommands: `manager`, `crds`, `rbac`, and every feature's agents.

use std::{io::Write, path::PathBuf};

use clap::{Arg, ArgAction, ArgMatches, Args, Command, FromArgMatches};

use crate::{
    FEATURES,
    runtime::{cli::ManagerArgs, cli::parse_go_bool, logging, manager},
};

#[derive(Args, Debug)]
pub struct CrdsArgs {
    /// Write one `<name>.yaml` per CRD into this directory instead of printing a YAML stream.
    #[arg(long, value_name = "DIR")]
    pub output_dir: Option<PathBuf>,
}

pub fn command() -> Command {
    let mut manager = ManagerArgs::augment_args(Command::new("manager"))
        .about("Run the controller manager with the enabled features");
    for f in FEATURES {
        manager = manager.arg(
            Arg::new(f.enable_flag())
                .long(f.enable_flag())
                .env(f.enable_env())
                .help(format!("Run the {} feature: {}", f.name, f.about))
                .value_name("BOOL")
                .num_args(0..=1)
                .require_equals(true)
                .default_value("true")
                .default_missing_value("true")
                .action(ArgAction::Set)
                .value_parser(parse_go_bool),
        );
        manager = (f.settings)(manager);
    }
    let mut cmd = Command::new("ucm")
        .about("Unified Controller Manager: Jumpstarter exporters, Miroir snapshots and KubeVirt VM exports in one process")
        .version(concat!(env!("CARGO_PKG_VERSION"), " (", env!("UCM_GIT_REVISION"), ")"))
        .subcommand_required(true)
        .arg_required_else_help(true)
        .subcommand(manager)
        .subcommand(CrdsArgs::augment_args(Command::new("crds").about("Print (or write) the CRDs of every feature as YAML")))
        .subcommand(Command::new("rbac").about("Print the ClusterRole each feature needs, as YAML"));
    for f in FEATURES {
        for a in f.agents {
            cmd = cmd.subcommand((a.command)());
        }
    }
    cmd
}

/// A one-line error naming the flag, then exit 2 (clap's usage code), as operators expect from
/// a bad flag at start-up.
fn usage_error(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(2);
}

pub fn main() {
    let matches = match command().try_get_matches() {
        Ok(m) => m,
        Err(e) => {
            use clap::error::ErrorKind::*;
            match e.kind() {
                DisplayHelp | DisplayVersion | DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
                _ => {
                    let text = e.render().to_string();
                    usage_error(
                        text.lines()
                            .next()
                            .unwrap_or("invalid arguments")
                            .trim_start_matches("error: "),
                    )
                }
            }
        }
    };
    let code = match matches.subcommand() {
        Some(("manager", m)) => run_manager(m),
        Some(("crds", m)) => {
            let args = CrdsArgs::from_arg_matches(m).unwrap_or_else(|e| e.exit());
            print_crds(args)
        }
        Some(("rbac", _)) => print_rbac(),
        Some((name, m)) => {
            let agent = FEATURES
                .iter()
                .flat_map(|f| f.agents.iter())
                .find(|a| a.name == name)
                .expect("registered agent");
            runtime_block_on(async { (agent.run)(m.clone()).await.map(|_| 0) })
        }
        None => unreachable!("subcommand_required"),
    };
    std::process::exit(code);
}

fn runtime_block_on(fut: impl Future<Output = anyhow::Result<i32>>) -> i32 {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(fut) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

fn run_manager(m: &ArgMatches) -> i32 {
    let args = ManagerArgs::from_arg_matches(m).unwrap_or_else(|e| e.exit());
    if let Err(msg) = args.validate() {
        usage_error(&msg);
    }
    let enabled: Vec<_> = FEATURES
        .iter()
        .copied()
        .filter(|f| m.get_one::<bool>(&f.enable_flag()).copied().unwrap_or(true))
        .collect();
    if enabled.is_empty() {
        usage_error("no feature enabled: set at least one of the --enable-<feature> flags to true");
    }
    if let Err(msg) = logging::init(args.log_level.as_deref(), args.log_format) {
        usage_error(&msg);
    }
    runtime_block_on(manager::run(args, m.clone(), enabled))
}

fn print_crds(args: CrdsArgs) -> i32 {
    let crds: Vec<_> = FEATURES.iter().flat_map(|f| f.installed_crds()).collect();
    let result: anyhow::Result<()> = (|| {
        match &args.output_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                for crd in &crds {
                    let name = crd.metadata.name.as_deref().unwrap_or("crd");
                    std::fs::write(
                        dir.join(format!("{name}.yaml")),
                        serde_saphyr::to_string(crd)?,
                    )?;
                }
            }
            None => {
                let mut out = std::io::stdout().lock();
                for crd in &crds {
                    writeln!(out, "---\n{}", serde_saphyr::to_string(crd)?.trim_end())?;
                }
            }
        }
        Ok(())
    })();
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

fn print_rbac() -> i32 {
    let mut out = std::io::stdout().lock();
    for (kind, name, rules) in crate::runtime::rbac::roles(FEATURES) {
        let role = serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": kind,
            "metadata": { "name": name },
            "rules": rules,
        });
        let _ = writeln!(
            out,
            "---\n{}",
            serde_saphyr::to_string(&role).expect("yaml").trim_end()
        );
    }
    0
}

#[cfg(test)]
mod tests {
    /// clap's own consistency checks over the whole command tree: duplicate flags or argument
    /// groups between features (e.g. two settings structs both named `Settings`) fail here
    /// instead of crashing `ucm manager` at start.
    #[test]
    fn command_tree_is_consistent() {
        super::command().debug_assert();
    }
}

//! tracing-subscriber setup: `--log-level` (an EnvFilter directive), else RUST_LOG, else `info`;
//! text or JSON on stderr.

use tracing_subscriber::EnvFilter;

use super::cli::LogFormat;

pub fn init(level: Option<&str>, format: LogFormat) -> Result<(), String> {
    let directive = level
        .map(str::to_string)
        .or_else(|| std::env::var("RUST_LOG").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "info".to_string());
    let filter = EnvFilter::try_new(&directive)
        .map_err(|e| format!("invalid value for '--log-level': {e}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.with_ansi(false).try_init(),
    };
    Ok(())
}

//! Signal fan-out: the first SIGTERM/SIGINT cancels the one shutdown token every task holds; a
//! second one exits 130 at once (kubert and kube-runtime treat a second signal as forceful).

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub fn install(token: CancellationToken) {
    tokio::spawn(async move {
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            warn!("cannot install signal handlers");
            return;
        };
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        info!("shutdown signal received; draining");
        token.cancel();
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        warn!("second signal: exiting at once");
        std::process::exit(130);
    });
}

//! `ucm export-server`: the HTTPS data path of a VirtualMachineExport (docs/vmexport.md, "Export
//! server").

pub mod args;
pub mod auth;
pub mod config;
pub mod conn;
pub mod dir;
pub mod handler;
pub mod manifest;
pub mod oci;
pub mod pgzip;
pub mod range;
pub mod ready;
pub mod tar;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{IntCounterVec, Opts, Registry};
use tokio::net::{TcpListener, TcpSocket};

use self::config::Config;
use self::handler::State;
use self::ready::Readiness;

async fn shutdown_signal(deadline: Option<jiff::Timestamp>) {
    let until_deadline = async {
        match deadline {
            Some(d) => {
                let now = jiff::Timestamp::now();
                let wait = if d > now {
                    Duration::try_from(d.duration_since(now)).unwrap_or(Duration::ZERO)
                } else {
                    Duration::ZERO
                };
                tokio::time::sleep(wait).await;
                tracing::info!("DEADLINE reached, shutting down");
            }
            None => std::future::pending::<()>().await,
        }
    };
    let sigterm = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
                tracing::info!("SIGTERM received, shutting down");
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = until_deadline => {},
        _ = sigterm => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}

/// Binds `addr`; the unspecified IPv6 address listens on both families (IPV6_V6ONLY off,
/// whatever the host's `bindv6only` default), falling back to IPv4 on a host without IPv6.
pub fn bind_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    fn bind(addr: SocketAddr, dual: bool) -> std::io::Result<TcpListener> {
        let sock = match addr {
            SocketAddr::V4(_) => TcpSocket::new_v4()?,
            SocketAddr::V6(_) => TcpSocket::new_v6()?,
        };
        if dual {
            use std::os::fd::AsRawFd;
            let off: libc::c_int = 0;
            // SAFETY: a valid socket fd and a c_int option value of the size passed.
            let rc = unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::IPPROTO_IPV6,
                    libc::IPV6_V6ONLY,
                    (&off as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        sock.set_reuseaddr(true)?;
        sock.bind(addr)?;
        sock.listen(1024)
    }
    match addr {
        SocketAddr::V6(v6) if v6.ip().is_unspecified() => match bind(addr, true) {
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL)
                ) =>
            {
                tracing::info!(error = %e, "no IPv6 on this host; listening on IPv4 only");
                bind(
                    SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, addr.port())),
                    false,
                )
            }
            other => other,
        },
        _ => bind(addr, false),
    }
}

/// `/metrics` on `listener` until the process exits.
pub fn spawn_metrics(listener: TcpListener, registry: Registry) {
    tokio::spawn(async move {
        let stop = tokio_util::sync::CancellationToken::new();
        if let Err(e) = crate::runtime::http::serve_metrics(listener, registry, stop).await {
            tracing::warn!(error = %e, "the metrics server stopped");
        }
    });
}

/// The TLS handshake of an accepted connection, bounded to 30 s (only the handshake is timed:
/// a download may take hours). `None` when it fails (logged at debug).
pub async fn tls_accept(
    acceptor: &tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
) -> Option<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> {
    match tokio::time::timeout(Duration::from_secs(30), acceptor.accept(tcp)).await {
        Ok(Ok(s)) => Some(s),
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "TLS handshake failed");
            None
        }
        Err(_) => None,
    }
}

pub async fn run(cfg: Config) -> anyhow::Result<()> {
    let (tls, cert_files) = tls::server_config(
        &cfg.cert_file,
        &cfg.key_file,
        cfg.tls_min_version,
        cfg.tls_cipher_suites.as_deref(),
    )?;
    // The manager renews the certificate Secret in place; the kubelet updates the files.
    cert_files.spawn_reloader();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);

    let registry = Registry::new();
    let bytes_served = IntCounterVec::new(
        Opts::new(
            "ucm_export_server_bytes_served_total",
            "Response body bytes written by format (compressed bytes for the gz formats, before TLS)",
        ),
        &["format"],
    )?;
    registry.register(Box::new(bytes_served.clone()))?;
    for f in ["raw", "gzip", "dir", "tar.gz", "oci"] {
        bytes_served.with_label_values(&[f]);
    }

    let volumes = cfg.volumes.clone();
    let ready = tokio::task::spawn_blocking(move || Readiness::new(volumes)).await?;
    let listener = bind_listener(cfg.listen)?;
    tracing::info!(addr = %listener.local_addr()?, volumes = cfg.volumes.len(), "export server listening");
    if let Some(addr) = cfg.metrics_addr {
        match bind_listener(addr) {
            Ok(l) => {
                spawn_metrics(l, registry.clone());
            }
            Err(e) => tracing::warn!(%addr, error = %e, "cannot serve metrics"),
        }
    }
    let deadline = cfg.deadline;
    let timeouts = conn::Timeouts {
        idle: cfg.idle_timeout,
        drain: cfg.drain,
    };
    // Pass 1 of the `oci` format reads every disk; the server listens meanwhile and reports
    // it on /exportready.
    let oci = cfg
        .oci_uri
        .as_ref()
        .map(|_| oci::Oci::start(cfg.volumes.clone(), cfg.manifest_data_dir.clone()));
    let state = Arc::new(State {
        cfg,
        ready,
        oci,
        bytes_served,
    });
    let handler = move |req, _peer| handler::handle(Arc::clone(&state), req);
    let finished = conn::serve(
        listener,
        acceptor,
        handler,
        timeouts,
        shutdown_signal(deadline),
    )
    .await;
    if finished {
        tracing::info!("no request in flight; exiting");
    } else {
        tracing::warn!(drain = ?timeouts.drain, "requests still running after the drain period; exiting");
    }
    Ok(())
}

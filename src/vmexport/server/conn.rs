//! Serving HTTPS connections so that ucm never cuts a transfer in flight (docs/vmexport.md,
//! "Export server", "Connections"), shared by `ucm export-server` and `ucm export-proxy`:
//!
//! - a connection with no request in flight for `idle` is closed (gracefully: HTTP/1 closes,
//!   HTTP/2 sends GOAWAY), one with a request in flight never is, however long its body takes;
//!   a request is in flight from its headers until the last byte of its response body;
//! - TCP keepalive finds peers that vanished without a word;
//! - at shutdown the listener closes, idle connections close at once, and requests in flight get
//!   up to `drain` to finish;
//! - a connection counts as open until the peer has acknowledged every byte written to it: the
//!   end of a response can sit in the kernel's buffers long after its last write (hundreds of KiB
//!   for a slow client), and a server that exited then, its Pod deleted with its network, would
//!   leave that client waiting for bytes that never come.

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// How long a connection may carry no request before it is closed (OURS; nginx's keepalive is
/// 75 s). Only connections between requests: a response body being sent is never timed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Requests in flight on one connection.
#[derive(Default)]
pub struct Activity {
    in_flight: AtomicUsize,
    changed: Notify,
}

impl Activity {
    fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_waiters();
        InFlight(Arc::clone(self))
    }

    /// Returns once no request has been in flight for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.in_flight.load(Ordering::Acquire) == 0 {
                tokio::select! {
                    _ = tokio::time::sleep(idle) => return,
                    _ = changed => {}
                }
            } else {
                changed.await;
            }
        }
    }
}

/// One request in flight; dropped with the response body (sent, or cut by the peer).
pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }
}

/// A response body that holds its request's [`InFlight`] until it is done.
pub struct Tracked<B> {
    inner: B,
    _in_flight: InFlight,
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// TCP keepalive after 60 s of silence, then every 10 s, 6 probes: a peer that is gone is
/// noticed within two minutes, a slow one is not touched.
fn keepalive(tcp: &TcpStream) {
    let fd = tcp.as_raw_fd();
    for (level, opt, val) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 60),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 6),
    ] {
        let v: libc::c_int = val;
        // SAFETY: a valid socket fd and a c_int option value of the size passed.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

/// How connections are served.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub idle: Duration,
    pub drain: Duration,
}

/// Accepts TLS connections on `listener` and answers each request with `handler`, until
/// `shutdown` completes; then drains ([module docs](self)). Returns whether every request in
/// flight finished within the drain period.
pub async fn serve<H, F, B>(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    handler: H,
    t: Timeouts,
    shutdown: impl Future<Output = ()>,
) -> bool
where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stop = tokio_util::sync::CancellationToken::new();
    // Every connection task holds a sender; the receiver sees the end once all are gone.
    let (open_tx, mut open_rx) = tokio::sync::mpsc::channel::<()>(1);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let Ok((tcp, peer)) = accepted else { continue };
                let _ = tcp.set_nodelay(true);
                keepalive(&tcp);
                let acceptor = acceptor.clone();
                let handler = handler.clone();
                let stop = stop.clone();
                let open = open_tx.clone();
                tokio::spawn(async move {
                    let _open = open;
                    let Some(tls) = super::tls_accept(&acceptor, tcp, peer).await else { return };
                    serve_one(tls, peer, handler, t.idle, stop).await;
                });
            }
        }
    }
    drop(listener);
    stop.cancel();
    drop(open_tx);
    tokio::select! {
        _ = open_rx.recv() => true,
        _ = tokio::time::sleep(t.drain) => false,
    }
}

async fn serve_one<H, F, B>(
    tls: tokio_rustls::server::TlsStream<TcpStream>,
    peer: SocketAddr,
    handler: H,
    idle: Duration,
    stop: tokio_util::sync::CancellationToken,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let activity = Arc::new(Activity::default());
    let act = Arc::clone(&activity);
    let svc = service_fn(move |req| {
        let in_flight = act.begin();
        let resp = handler(req, peer);
        async move {
            let (parts, body) = resp.await.into_parts();
            Ok::<_, std::convert::Infallible>(Response::from_parts(
                parts,
                Tracked {
                    inner: body,
                    _in_flight: in_flight,
                },
            ))
        }
    });
    // A second handle on the socket, so it outlives hyper's and can be asked what is unacknowledged.
    let socket = tls.get_ref().0.as_fd().try_clone_to_owned().ok();
    let builder = auto::Builder::new(TokioExecutor::new());
    let conn = builder.serve_connection(TokioIo::new(tls), svc);
    tokio::pin!(conn);
    let why = tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            None
        }
        _ = activity.idle_for(idle) => Some("idle"),
        _ = stop.cancelled() => Some("shutdown"),
    };
    if let Some(why) = why {
        tracing::debug!(%peer, why, "closing the connection gracefully");
        conn.as_mut().graceful_shutdown();
        if let Err(e) = conn.as_mut().await {
            tracing::debug!(%peer, error = %e, "connection ended with an error");
        }
    }
    if let Some(socket) = socket {
        delivered(socket.as_raw_fd(), idle).await;
    }
}

/// Bytes written to a TCP socket that its peer has not acknowledged yet (Linux `SIOCOUTQ`, which
/// is `TIOCOUTQ`: unsent plus unacknowledged, tcp(7)). `None` once the socket cannot say.
fn unacknowledged(fd: RawFd) -> Option<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: a socket fd this process holds open and a c_int out-parameter, as tcp(7) says.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) };
    (r == 0).then(|| usize::try_from(n).unwrap_or(0))
}

/// Returns once the peer has acknowledged everything written to `fd`, or once the queue has not
/// shrunk for `stall` (a peer that stopped reading, or vanished, does not hold the process).
async fn delivered(fd: RawFd, stall: Duration) {
    let mut last = usize::MAX;
    let mut progress = tokio::time::Instant::now();
    while let Some(n) = unacknowledged(fd).filter(|n| *n > 0) {
        if n < last {
            last = n;
            progress = tokio::time::Instant::now();
        } else if progress.elapsed() >= stall {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A server's socket with more written than its peer has read: `delivered` waits for the
    /// peer to take it all, and gives up on a peer that stops reading.
    #[tokio::test]
    async fn a_connection_lasts_until_the_peer_has_every_byte() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        let chunk = vec![7u8; 64 << 10];
        let mut written = 0;
        // Until the peer's receive window and our send buffer are both full.
        loop {
            match server.try_write(&chunk) {
                Ok(n) => written += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        let fd = server.as_raw_fd();
        assert!(unacknowledged(fd).unwrap() > 0, "{written} bytes written");

        // The peer reads nothing: given up after the stall period, not before.
        let t0 = tokio::time::Instant::now();
        delivered(fd, Duration::from_millis(300)).await;
        assert!(t0.elapsed() >= Duration::from_millis(300));

        let waiter = tokio::spawn(delivered(fd, Duration::from_secs(30)));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiter.is_finished(), "the peer has not read yet");
        let mut buf = vec![0u8; 1 << 20];
        let mut read = 0;
        while read < written {
            read += client.read(&mut buf).await.unwrap();
        }
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("done once the peer has every byte")
            .unwrap();
        assert_eq!(unacknowledged(fd), Some(0));
        drop(server);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_only_counts_time_without_requests() {
        let a = Arc::new(Activity::default());
        let t0 = tokio::time::Instant::now();
        let r = a.begin();
        let waiter = {
            let a = Arc::clone(&a);
            tokio::spawn(async move { a.idle_for(Duration::from_secs(5)).await })
        };
        // An hour with a request in flight is not idle.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!waiter.is_finished());
        drop(r);
        waiter.await.unwrap();
        assert_eq!(t0.elapsed(), Duration::from_secs(3605));
        // A request starting within the idle period restarts it.
        let t1 = tokio::time::Instant::now();
        let waiter = {
            let a = Arc::clone(&a);
            tokio::spawn(async move { a.idle_for(Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_secs(4)).await;
        let r = a.begin();
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(r);
        waiter.await.unwrap();
        assert_eq!(t1.elapsed(), Duration::from_secs(10));
    }
}

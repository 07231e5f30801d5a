//! Phase `grpc`, the router (docs/exporter.md, "Routers that drain"): `ucm router` processes
//! (ROUTER_KEY, a certificate from files; no cluster needed), clients over the compiled
//! jumpstarter.v1 stubs, each session two streams with one router token on two TLS connections,
//! as a client and its exporter open them.
//! - a rollout: sessions streaming through router A, A gets SIGTERM (as a Pod deletion sends it),
//!   new sessions go to B (as the manager names only ready routers), every session of A runs to
//!   its end: cut sessions / total;
//! - throughput: bytes through one session per second and the router's CPU per GiB, next to a
//!   plain TCP relay of the same bytes in this process (one thread; the limit of any relay);
//! - memory: a fresh router's RSS growth per idle carried session.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use ucm::exporter::proto::jumpstarter::v1::router_service_client::RouterServiceClient;
use ucm::exporter::proto::jumpstarter::v1::{StreamRequest, StreamResponse};
use ucm::exporter::router::token::{self, RouterKey};

use crate::Ctx;
use crate::procs::{Proc, ucm_bin};
use crate::report::Figure;

const PHASE: &str = "grpc";
const KEY: &[u8] = b"bench-router-key";
const FRAME: usize = 32 * 1024;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Router {
    proc: Proc,
    port: u16,
}

async fn start(ctx: &Ctx, name: &str, cert: &std::path::Path, key: &std::path::Path) -> Router {
    let (port, health) = (free_port(), free_port());
    let mut cmd = std::process::Command::new(ucm_bin());
    cmd.arg("router")
        .arg(format!("--bind-address=127.0.0.1:{port}"))
        .arg(format!("--health-probe-bind-address=127.0.0.1:{health}"))
        .arg(format!("--endpoint=localhost:{port}"))
        .arg("--drain-limit=10m")
        .arg("--log-level=info")
        .env("ROUTER_KEY", String::from_utf8_lossy(KEY).as_ref())
        .env("EXTERNAL_CERT_PEM", cert)
        .env("EXTERNAL_KEY_PEM", key)
        .env_remove("RUST_LOG");
    let mut proc = Proc::spawn(cmd, ctx.work.join(format!("router-{name}.log")));
    proc.health_port = health;
    proc.wait_ready(Duration::from_secs(30)).await;
    Router { proc, port }
}

async fn channel(port: u16, ca: &str) -> Channel {
    Endpoint::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(ca))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// One side of a session on its own TLS connection to the router at `port` (a jmp client and an
/// exporter each connect on their own): its sender, the stream of what the peer sent, and the
/// connection, which lives as long as the caller holds it.
async fn side(
    port: u16,
    ca: &str,
    tok: &str,
) -> (
    mpsc::Sender<StreamRequest>,
    tonic::Streaming<StreamResponse>,
    Channel,
) {
    let ch = channel(port, ca).await;
    let (tx, rx) = mpsc::channel(8);
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {tok}").parse().unwrap());
    let fut = tokio::spawn({
        let mut c = RouterServiceClient::new(ch.clone())
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        async move { c.stream(req).await }
    });
    // The stream starts once its first frame goes out (HTTP/2 sends headers with it).
    tx.send(StreamRequest {
        payload: Vec::new(),
        frame_type: 6,
    })
    .await
    .unwrap();
    (tx, fut.await.unwrap().unwrap().into_inner(), ch)
}

/// A session: both sides on the router at `port`, each on its own connection, the client side
/// sending `frames` frames of `size` bytes `every` apart, the exporter side counting them.
/// Ok(bytes) when all came and both ends closed cleanly, else Err (cut). `streaming` counts the
/// sessions whose first bytes reached the exporter side.
async fn session(
    port: u16,
    ca: String,
    frames: usize,
    size: usize,
    every: Duration,
    streaming: Arc<AtomicUsize>,
) -> Result<u64, String> {
    let key = RouterKey::new(KEY.to_vec()).unwrap();
    let (tok, _, _) = token::mint(&key, jiff::Timestamp::now());
    let (a_tx, mut a_rx, _a) = side(port, &ca, &tok).await;
    let (b_tx, mut b_rx, _b) = side(port, &ca, &tok).await;
    let send = async move {
        let payload = vec![0x5a_u8; size];
        for _ in 0..frames {
            a_tx.send(StreamRequest {
                payload: payload.clone(),
                frame_type: 0,
            })
            .await
            .map_err(|_| "the client side closed".to_string())?;
            if !every.is_zero() {
                tokio::time::sleep(every).await;
            }
        }
        Ok::<_, String>(a_tx)
    };
    let recv = async {
        let want = (frames * size) as u64;
        let mut got = 0u64;
        while got < want {
            match b_rx.message().await {
                Ok(Some(m)) => {
                    if got == 0 && !m.payload.is_empty() {
                        streaming.fetch_add(1, Ordering::SeqCst);
                    }
                    got += m.payload.len() as u64;
                }
                Ok(None) => return Err(format!("cut after {got} of {want} bytes")),
                Err(e) => return Err(format!("cut after {got} of {want} bytes: {e}")),
            }
        }
        Ok(got)
    };
    let (a_tx, got) = tokio::try_join!(send, recv)?;
    // The client ends the session; the exporter side sees a clean end.
    drop((a_tx, b_tx));
    while let Ok(Some(_)) = a_rx.message().await {}
    match tokio::time::timeout(Duration::from_secs(30), b_rx.message()).await {
        Ok(Ok(None)) => Ok(got),
        other => Err(format!("no clean end: {other:?}")),
    }
}

/// A plain TCP relay on one thread of its own: its address, a reader of that thread's CPU
/// seconds, and the sender whose drop lets the thread exit (it waits for that after the copy, so
/// its CPU is still readable when the last byte has arrived).
fn tcp_relay() -> (
    std::net::SocketAddr,
    impl Fn() -> f64,
    std::sync::mpsc::Sender<()>,
) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let tid = Arc::new(AtomicU64::new(0));
    let t = tid.clone();
    let (release, released) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        t.store(unsafe { libc::gettid() } as u64, Ordering::SeqCst);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            l.set_nonblocking(true).unwrap();
            let l = tokio::net::TcpListener::from_std(l).unwrap();
            // The first connection is the source, the second the sink; bytes go source → sink.
            let (mut a, _) = l.accept().await.unwrap();
            let (mut b, _) = l.accept().await.unwrap();
            let _ = tokio::io::copy(&mut a, &mut b).await;
        });
        let _ = released.recv();
    });
    while tid.load(Ordering::SeqCst) == 0 {
        std::thread::yield_now();
    }
    let tid = tid.load(Ordering::SeqCst);
    let cpu = move || {
        let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"))
            .unwrap_or_else(|e| panic!("the relay thread's CPU: {e}"));
        let f: Vec<&str> = s
            .rsplit_once(')')
            .map(|x| x.1)
            .unwrap_or("")
            .split_whitespace()
            .collect();
        // SAFETY: sysconf has no preconditions.
        let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        match (f.get(11), f.get(12)) {
            (Some(u), Some(s)) => {
                (u.parse::<f64>().unwrap_or(0.0) + s.parse::<f64>().unwrap_or(0.0)) / tck
            }
            _ => 0.0,
        }
    };
    (addr, cpu, release)
}

/// Whether the process has exited (gone, or a zombie not yet reaped).
fn exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| s.contains(") Z "))
}

pub async fn run(ctx: &Ctx) -> Vec<Figure> {
    let dir = ctx.work.join("router-certs");
    std::fs::create_dir_all(&dir).unwrap();
    let pair = ucm::exporter::tls::self_signed("localhost:8083").unwrap();
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&cert, &pair.cert_pem).unwrap();
    std::fs::write(&key, &pair.key_pem).unwrap();
    let ca = pair.cert_pem.clone();

    // 1. A rollout: sessions streaming through A; once every one streams, A gets SIGTERM (as a
    //    Pod deletion sends it) and new sessions start on B (the manager names ready routers
    //    only); every session must run to its end.
    let sessions = ctx.scale.grpc_exporters.clamp(20, 200);
    let a = start(ctx, "a", &cert, &key).await;
    let b = start(ctx, "b", &cert, &key).await;
    let streaming = Arc::new(AtomicUsize::new(0));
    // Each session streams 1 KiB every 20 ms for about 15 s, across the SIGTERM.
    let t_start = Instant::now();
    let running: Vec<_> = (0..sessions)
        .map(|_| {
            tokio::spawn(session(
                a.port,
                ca.clone(),
                750,
                1024,
                Duration::from_millis(20),
                streaming.clone(),
            ))
        })
        .collect();
    while streaming.load(Ordering::SeqCst) < sessions {
        assert!(
            t_start.elapsed() < Duration::from_secs(120),
            "router rollout: {} of {sessions} sessions streaming after 120 s",
            streaming.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let opened = t_start.elapsed();
    let t_term = Instant::now();
    a.proc.signal("TERM");
    let during: Vec<_> = (0..sessions / 4)
        .map(|_| {
            tokio::spawn(session(
                b.port,
                ca.clone(),
                250,
                1024,
                Duration::from_millis(10),
                Arc::new(AtomicUsize::new(0)),
            ))
        })
        .collect();
    let mut cut = Vec::new();
    let mut carried_bytes = 0u64;
    for h in running.into_iter().chain(during) {
        match h.await.unwrap() {
            Ok(n) => carried_bytes += n,
            Err(e) => cut.push(e),
        }
    }
    let last_end = t_term.elapsed();
    let total = sessions + sessions / 4;
    // A exits once its last session ended.
    let mut exited_at = None;
    while t_term.elapsed() < last_end + Duration::from_secs(60) {
        if exited(a.proc.pid()) {
            exited_at = Some(t_term.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for e in cut.iter().take(3) {
        eprintln!("  router rollout: cut session: {e}");
    }
    let exited_at =
        exited_at.expect("the draining router did not exit within 60 s of its last session");
    eprintln!(
        "  router rollout: {} of {total} sessions cut; {sessions} streaming on A after {:.1} s; the last ended {:.1} s after SIGTERM, A exited at {:.1} s",
        cut.len(),
        opened.as_secs_f64(),
        last_end.as_secs_f64(),
        exited_at.as_secs_f64()
    );

    // 2. Throughput of one session, and CPU per GiB, next to a plain TCP relay.
    let bytes: usize = 1 << 30;
    let frames = bytes / FRAME;
    let mut router_rates = Vec::new();
    let mut router_cpu = Vec::new();
    let mut relay_rates = Vec::new();
    let mut relay_cpu = Vec::new();
    for _ in 0..ctx.runs.max(1) {
        let cpu0 = b.proc.cpu();
        let t0 = Instant::now();
        session(
            b.port,
            ca.clone(),
            frames,
            FRAME,
            Duration::ZERO,
            Arc::new(AtomicUsize::new(0)),
        )
        .await
        .expect("a throughput session");
        let secs = t0.elapsed().as_secs_f64();
        router_rates.push(bytes as f64 / secs / 1_048_576.0);
        router_cpu.push(b.proc.cpu() - cpu0);

        let (addr, cpu, release) = tcp_relay();
        let mut src = tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut dst = tokio::net::TcpStream::connect(addr).await.unwrap();
        let c0 = cpu();
        let t0 = Instant::now();
        let writer = tokio::spawn(async move {
            let buf = vec![0x5a_u8; FRAME];
            for _ in 0..frames {
                src.write_all(&buf).await.unwrap();
            }
            src.shutdown().await.unwrap();
        });
        let mut buf = vec![0u8; FRAME];
        let mut got = 0usize;
        while got < bytes {
            let n = dst.read(&mut buf).await.unwrap();
            assert!(n > 0, "the relay ended after {got} bytes");
            got += n;
        }
        writer.await.unwrap();
        let secs = t0.elapsed().as_secs_f64();
        relay_rates.push(bytes as f64 / secs / 1_048_576.0);
        relay_cpu.push(cpu() - c0);
        drop(release);
    }
    let mut b = b;
    b.proc.stop("TERM");
    drop(a);

    // 3. Memory per carried session: idle pairs on a fresh router C (B's allocator still holds
    //    the throughput runs' buffers), each side on its own connection.
    let c = start(ctx, "c", &cert, &key).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle: u32 = 500;
    let rss0 = c.proc.rss();
    let key_ = RouterKey::new(KEY.to_vec()).unwrap();
    let mut held = Vec::new();
    for _ in 0..idle {
        let (tok, _, _) = token::mint(&key_, jiff::Timestamp::now());
        held.push(side(c.port, &ca, &tok).await);
        held.push(side(c.port, &ca, &tok).await);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_session = (c.proc.rss().saturating_sub(rss0)) as f64 / f64::from(idle) / 1024.0;
    drop(held);
    drop(c);

    vec![
        Figure::new(PHASE, "grpc.router.rollout_cut", &format!("sessions cut by a router rollout ({total} sessions: {sessions} streaming through the router that got SIGTERM, {} started on the other during its drain)", sessions / 4), "sessions", vec![cut.len() as f64])
            .reference(sessions as f64, "upstream: a router restart cuts every session it carries (#28)", false)
            .note(format!(
                "each session is two streams with one router token, each on its own TLS connection (as a jmp client's and its exporter's), 1 KiB every 20 ms for 15 s from the client side, counted on the exporter side; SIGTERM once all {sessions} were streaming ({:.1} s after the first was started); a session counts as cut unless every byte it sent arrived and both ends saw a clean end ({:.1} MiB carried by the {total} in all); the last ended {:.1} s after SIGTERM, and the draining router exited {:.1} s after SIGTERM",
                opened.as_secs_f64(),
                carried_bytes as f64 / 1_048_576.0,
                last_end.as_secs_f64(),
                exited_at.as_secs_f64()
            )),
        Figure::new(PHASE, "grpc.router.throughput", "bytes through one router session (32 KiB frames, 1 GiB)", "MiB/s", router_rates)
            .reference(crate::report::median(&relay_rates), "a plain TCP relay of the same bytes in the bench process (one thread, no TLS): the limit", true)
            .higher_is_better()
            .note("client and exporter side in the bench process, each on its own TLS connection to the router; the router decrypts, decodes the protobuf frame, and re-encodes and encrypts it; all of it shares the machine's 2 cores with the bench's own TLS ends"),
        Figure::new(PHASE, "grpc.router.cpu_per_gib", "router CPU per GiB carried (TLS both ways, HTTP/2, protobuf frames)", "CPU s/GiB", router_cpu)
            .reference(crate::report::median(&relay_cpu), "the plain TCP relay's CPU for the same GiB", true),
        Figure::new(PHASE, "grpc.router.memory_per_session", &format!("router memory per carried session ({idle} idle sessions, two streams on two TLS connections each)"), "KiB", vec![per_session])
            .note("RSS growth of a fresh router from before the first connection to 2 s after the last pair formed, divided by the sessions"),
    ]
}

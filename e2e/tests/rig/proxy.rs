//! A TCP proxy between a manager and the API server that can drop connections: every
//! connection is a task piping bytes both ways, and cutting it drops both sockets (the manager
//! sees its watches and requests fail mid-stream, as behind a flaky load balancer).

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use rand::Rng;
use tokio::{
    net::{TcpListener, TcpStream},
    task::{AbortHandle, JoinHandle},
};

#[derive(Default)]
struct State {
    conns: Mutex<HashMap<u64, AbortHandle>>,
    next: AtomicU64,
    refuse: AtomicBool,
    accepted: AtomicU64,
    cut: AtomicU64,
    refused: AtomicU64,
}

pub struct Proxy {
    pub port: u16,
    state: Arc<State>,
    accept: JoinHandle<()>,
}

/// What a chaos period did.
#[derive(Debug, Default, Clone, Copy)]
pub struct ChaosReport {
    pub cuts: u64,
    pub refused: u64,
    pub accepted: u64,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:<upstream>`.
    pub async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State::default());
        let st = state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                if st.refuse.load(Ordering::SeqCst) {
                    st.refused.fetch_add(1, Ordering::SeqCst);
                    drop(client);
                    continue;
                }
                st.accepted.fetch_add(1, Ordering::SeqCst);
                let id = st.next.fetch_add(1, Ordering::SeqCst);
                let st2 = st.clone();
                let task = tokio::spawn(async move {
                    let _ = pipe(client, upstream).await;
                    st2.conns.lock().unwrap().remove(&id);
                });
                st.conns.lock().unwrap().insert(id, task.abort_handle());
            }
        });
        Proxy {
            port,
            state,
            accept,
        }
    }

    /// Cuts every connection for which `pick` returns true; returns how many.
    fn cut_where(&self, mut pick: impl FnMut() -> bool) -> u64 {
        let mut conns = self.state.conns.lock().unwrap();
        let ids: Vec<u64> = conns.keys().copied().filter(|_| pick()).collect();
        for id in &ids {
            if let Some(h) = conns.remove(id) {
                h.abort();
            }
        }
        self.state.cut.fetch_add(ids.len() as u64, Ordering::SeqCst);
        ids.len() as u64
    }

    pub fn cut_all(&self) -> u64 {
        self.cut_where(|| true)
    }

    /// While set, new connections are accepted and closed at once (an unreachable server).
    pub fn refuse(&self, on: bool) {
        self.state.refuse.store(on, Ordering::SeqCst);
    }

    fn report(&self) -> ChaosReport {
        ChaosReport {
            cuts: self.state.cut.load(Ordering::SeqCst),
            refused: self.state.refused.load(Ordering::SeqCst),
            accepted: self.state.accepted.load(Ordering::SeqCst),
        }
    }

    /// Drops connections at random for `period`: every 0.1–1.5 s it cuts each open connection
    /// with probability 1/2, or all of them, or refuses new ones for 0.5–3 s. Returns what it
    /// did; the proxy passes traffic normally afterwards.
    pub async fn chaos(&self, period: Duration) -> ChaosReport {
        let before = self.report();
        let end = tokio::time::Instant::now() + period;
        while tokio::time::Instant::now() < end {
            let (pause, action) = {
                let mut r = rand::rng();
                (
                    Duration::from_millis(r.random_range(100..1500)),
                    r.random_range(0..10u8),
                )
            };
            tokio::time::sleep(pause).await;
            match action {
                0..=6 => {
                    self.cut_where(|| rand::rng().random_bool(0.5));
                }
                7 | 8 => {
                    self.cut_all();
                }
                _ => {
                    let outage = Duration::from_millis(rand::rng().random_range(500..3000));
                    self.refuse(true);
                    self.cut_all();
                    let left = end.saturating_duration_since(tokio::time::Instant::now());
                    tokio::time::sleep(outage.min(left)).await;
                    self.refuse(false);
                }
            }
        }
        self.refuse(false);
        let after = self.report();
        ChaosReport {
            cuts: after.cuts - before.cuts,
            refused: after.refused - before.refused,
            accepted: after.accepted - before.accepted,
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut_all();
    }
}

async fn pipe(mut client: TcpStream, upstream: u16) -> std::io::Result<()> {
    let mut server = TcpStream::connect(("127.0.0.1", upstream)).await?;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    tokio::io::copy_bidirectional(&mut client, &mut server).await?;
    Ok(())
}

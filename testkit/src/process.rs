//! The processes tests and benchmarks spawn: ports for their servers, signals, bounded waits.

use std::{
    net::TcpListener,
    path::Path,
    process::{Child, Command, ExitStatus},
    time::{Duration, Instant},
};

/// CPU time (user + system) a process has used so far, from /proc/<pid>/stat.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/stat: {e}"));
    // Fields after the command name (which may hold spaces), from field 3 on.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // USER_HZ is 100 on every Linux this runs on.
    Duration::from_millis(ticks * 10)
}

/// A port for a server a test starts: free when asked, never handed out twice in this process,
/// and below the kernel's ephemeral range. A port from that range (what binding port 0 gives)
/// can meanwhile become the local port of any outgoing connection, so the server's bind fails,
/// and a connect to it before the server listens can connect to itself.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    const LOW: u32 = 10_000;
    let span = ephemeral_low.saturating_sub(LOW);
    assert!(
        span >= 1_000,
        "the ephemeral port range starts at {ephemeral_low}: no room below it for test servers"
    );
    // Processes started together (the suite, a bench) begin at different offsets.
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let port = (LOW + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{ephemeral_low}");
}

pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

/// Waits up to `timeout` for `child` to exit; None (still running) after that.
pub fn wait_child(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if start.elapsed() > timeout {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// [`wait_child`], killing the child when it does not exit in time.
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    wait_child(child, timeout).or_else(|| {
        let _ = child.kill();
        child.wait().ok()
    })
}

/// Sends `sig` and waits up to `timeout` for the exit, then kills: how every spawned process
/// (manager, agents, servers) is stopped.
pub fn stop_child(child: &mut Child, sig: &str, timeout: Duration) {
    signal(child.id(), sig);
    wait_timeout(child, timeout);
}

/// The last `lines` lines of a log file (empty when unreadable), for failure messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<_> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

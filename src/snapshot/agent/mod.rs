//! `ucm snapshot-agent`: the per-node half of a snapshot round (docs/snapshot.md, "Agent
//! states"). The decision table is
//! pure (`decide`); backends and barriers sit behind traits so the round logic runs against
//! fakes in tests. The IO around it: `args` (flags), `main` (registration, start-up, caches,
//! journal adoption, shutdown), `worker` (one worker per volume: handle, pass, sweep), `actions`
//! (fenced slot write, raise, cut, lift, teardown), `heartbeat` (the node's Lease), `metrics`,
//! and `context` (the settings and the state they share).
//!
//! Why not a kube-runtime `Controller`: a Controller queues and serialises work per object and
//! runs it on watch events, while the agent must serialise per DRBD resource (every snapshot of
//! a volume, in one worker, volumes in parallel), decide from two caches at once (the volume and
//! all its snapshots), and lift a barrier it holds at the deadline on its own timer with no API
//! call at all, also while the API server is unreachable. It still acts only on watch events and
//! exact timers (cutoff, deadline, retries), never on a poll loop; every agent acts (no leader).

mod actions;
pub mod args;
pub mod backend;
pub mod barrier;
pub mod cmd;
mod context;
pub mod decide;
mod heartbeat;
pub mod journal;
mod main;
mod metrics;
pub mod pools;
mod worker;

pub use args::{AgentArgs, BarrierKind, NAME};
pub use context::{Settings, event, merge_seen};
pub use main::{AGENT, main};
pub use metrics::AgentMetrics;

//! `ucm snapshot-agent`: the per-node half of a snapshot round (spec §6). The decision table is
//! pure (`decide`); backends and barriers sit behind traits so the round logic runs against
//! fakes in tests.

pub mod backend;
pub mod barrier;
pub mod cmd;
pub mod decide;
pub mod journal;
pub mod pools;
pub mod run;

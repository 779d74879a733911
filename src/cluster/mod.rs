//! Cluster mode: the lock table replicated with Raft (raft-rs 0.7).
//!
//! * [`command`]: the replicated commands and their encoding.
//! * [`state`]: the deterministic state machine (engine + ledger + dedup).

pub mod command;
pub mod state;

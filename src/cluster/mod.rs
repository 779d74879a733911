//! Cluster mode: the lock table replicated with Raft (raft-rs 0.7).
//!
//! * [`command`]: the replicated commands and their encoding: a client's
//!   acquire, acquire with a limit (protocol 1.2, PROTOCOL §6: semaphores
//!   and shared/exclusive locks, each permit a grant with its own token,
//!   lease and `Expire`), release and extend; the leader's `Expire` and
//!   `WaitTimeout`; a closed connection's `CancelWaiters`.
//! * [`state`]: the deterministic state machine (the engine, tagged with
//!   requests, + dedup).
//! * [`members`]: peer addresses and removed ids, replicated with conf changes.
//! * [`log`]: raft's in-memory log and the write-ahead log under it.
//! * [`node`]: one node, sans-IO: Ready handling, proposals, leader timers.
//! * [`transport`]: peer connections in the mio loop.
//! * [`tls`]: mutual TLS between peers.
//! * [`certs`]: `ticket certs init`, the CA and node certificates.
//! * [`service`]: [`service::ClusterService`], the server loop's view.
//! * [`cli`]: `ticketd --cluster` flags and daemon.
//! * `rng` (internal, `crate::rng`): the seeded PRNG of the election timeouts.
//!
//! The deterministic simulation of a whole cluster in one process is
//! `ticketd_testkit::cluster_sim`, beside the crate; it runs [`node::Node`]s
//! on `log::MemDisk`s, which exist only with the `testkit` feature.
//!
//! `docs/CLUSTER.md` describes the design.

pub mod certs;
pub mod cli;
pub mod command;
pub mod members;
pub mod node;
pub(crate) use crate::rng;
pub mod log;
pub mod service;
pub mod state;
pub mod tls;
pub mod transport;

//! Cluster mode (feature `cluster`): one node over a real data directory,
//! three real `ticketd --cluster` processes on loopback, peer security and
//! mutual TLS, grants bound to identities, and the deterministic 3- and
//! 5-node simulations.
//!
//! One test binary; `cargo test --test cluster MODULE::` runs one file.
//! Helpers come from `ticketd_testkit`.

mod bind;
mod close;
mod members;
mod node;
mod permits;
mod process;
mod security;
mod sim;
mod tls;

//! The official blocking client (`ticketd::client`) against the real
//! `ticketd`: PROTOCOL §3's rules, contention through one shared client,
//! keep-alive at scale, what a client guards against, and TLS on the
//! client port.
//!
//! One test binary; `cargo test --test client MODULE::` runs one file. The
//! thread and descriptor leak test is a binary of its own
//! (`tests/client_leaks.rs`): it counts the whole process's threads and open
//! files, so nothing else may run beside it. Helpers come from
//! `ticketd_testkit`.

mod contention;
mod failure;
mod keepalive;
mod languages;
mod rules;
mod security;
#[cfg(feature = "tls")]
mod tls;

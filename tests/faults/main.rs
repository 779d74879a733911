//! Real-process fault tests (docs/RELIABILITY.md): single-mode ticketd
//! killed, stopped, clock-jumped, out of descriptors or disk, abused by its
//! clients ([`single`]); network partitions between real cluster nodes
//! ([`cluster`], feature `cluster`, as root).
//!
//! One test binary; `cargo test --test faults MODULE::` runs one file.
//! Helpers come from `ticketd_testkit`.

mod cluster;
mod single;

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Timings are measured one test at a time: a single-mode fault test holds
/// this exclusively ([`alone`]), so neither another one nor a partition test
/// loads the machine while it measures; the partition tests share it
/// ([`shared`]) and run beside each other.
static TIMED: RwLock<()> = RwLock::new(());

/// For a test that measures timings: nothing else in this binary runs
/// while the guard lives.
fn alone() -> RwLockWriteGuard<'static, ()> {
    TIMED.write().unwrap_or_else(PoisonError::into_inner)
}

/// For a test that may run beside others of its kind, but never beside one
/// that holds [`alone`].
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
fn shared() -> RwLockReadGuard<'static, ()> {
    TIMED.read().unwrap_or_else(PoisonError::into_inner)
}

//! Raft's log storage: the in-memory [`LogStore`] raft reads from, and the
//! write-ahead log ([`Wal`]) that makes it durable on a [`Disk`].
//!
//! raft-rs reads its log through the [`raft::Storage`] trait right after each
//! `advance`, so the log is served from memory; durability is the WAL's job.
//! Each loop turn stages its records (entries, hard state, snapshot) and
//! writes them with **one** write and at most one fsync ([`Wal::flush`]),
//! whatever the number of proposals in the turn: that is the group commit.
//!
//! # Record format
//!
//! `[len: u32 BE][crc32: u32 BE][kind: u8][payload]`, where `len` counts kind
//! and payload and the CRC covers them. Payloads are protobuf (raft's own
//! types) or big-endian integers. Recovery replays records in order and stops
//! at the first short or corrupt one: that is a torn tail from a crash in the
//! middle of a write, never acknowledged (acknowledgements wait for the
//! fsync), so it is cut off.
//!
//! # Background fsync
//!
//! A cluster node does not wait for its fsync: [`Wal::start_sync`] begins
//! one ([`FileDisk`] hands `fdatasync` to a thread of its own, which wakes
//! the loop when done) and [`Wal::poll_sync`] reports when it finished.
//! Meanwhile the loop goes on writing replies, reading requests and
//! stepping raft; what must wait for durability (raft's persisted
//! messages, its notion of what is persisted) waits for that report.
//!
//! # Compaction
//!
//! After a snapshot the whole log is rewritten ([`Disk::replace`]: a
//! temporary file, fsync, rename, fsync of the directory) as: epoch,
//! snapshot (with the state machine's bytes), conf state, hard state, and the
//! entries after the snapshot.

mod disk;
#[cfg(any(test, feature = "testkit"))]
mod mem;
mod storage;
#[cfg(test)]
mod tests;
mod wal;

pub use disk::{FileDisk, PREALLOC_BYTES};
#[cfg(any(test, feature = "testkit"))]
pub use mem::MemDisk;
pub use storage::LogStore;
pub use wal::{Identity, Recovered, Wal};

use std::io;

/// Where the WAL's bytes live. The file implementation is [`FileDisk`]; the
/// simulator's models a disk that loses what was not synced.
pub trait Disk {
    /// Appends `bytes` with one write; when `sync`, makes everything written
    /// so far durable before returning.
    fn append(&mut self, bytes: &[u8], sync: bool) -> io::Result<()>;
    /// Everything the log holds, for recovery.
    fn read_all(&mut self) -> io::Result<Vec<u8>>;
    /// Makes everything appended so far durable (after waiting for a sync
    /// [`Disk::start_sync`] began).
    fn sync(&mut self) -> io::Result<()>;
    /// Begins making everything appended so far durable without waiting;
    /// [`Disk::poll_sync`] reports the outcome. The default syncs at once.
    fn start_sync(&mut self) -> io::Result<()> {
        self.sync()
    }
    /// The outcome of the sync [`Disk::start_sync`] began, once it is over
    /// (`None` while it runs).
    fn poll_sync(&mut self) -> Option<io::Result<()>> {
        Some(Ok(()))
    }
    /// Cuts the log to `len` bytes (a torn tail) and makes that durable.
    fn truncate(&mut self, len: u64) -> io::Result<()>;
    /// Atomically and durably replaces the whole log with `bytes`.
    fn replace(&mut self, bytes: &[u8]) -> io::Result<()>;
}

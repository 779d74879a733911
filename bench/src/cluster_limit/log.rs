//! A node's log: a file of zeros written ahead of time, batches written
//! round within it, and the sync thread that makes them durable one
//! `fdatasync` at a time and wakes the node's loop when one is done.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use mio::Waker;

/// The log file and its sync thread.
pub(super) struct Log {
    file: Arc<File>,
    /// The file's size: writes wrap round within it.
    bytes: u64,
    /// Where the next batch goes.
    at: u64,
    shared: Arc<(Mutex<SyncState>, Condvar)>,
    thread: Option<std::thread::JoinHandle<(u64, Duration)>>,
}

/// How long the sync thread waits before each `fdatasync`: zero, but tests
/// slow the disk down with it to see what waits for a sync.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SyncDelay(pub(super) Duration);

/// What the loop and the sync thread share, under one mutex.
#[derive(Default)]
struct SyncState {
    /// Highest batch written to the file.
    written: u64,
    /// Highest batch a finished `fdatasync` covers.
    durable: u64,
    /// An `fdatasync` failed: the node stops.
    failed: Option<String>,
    /// The node is done: the sync thread ends.
    stop: bool,
}

impl Log {
    /// Creates (or truncates) `path`, fills it with `bytes` of zeros (at
    /// least 4 KiB), syncs it, and starts the sync thread, which wakes
    /// `waker`.
    pub(super) fn create(
        path: &std::path::Path,
        bytes: u64,
        waker: Arc<Waker>,
        delay: SyncDelay,
    ) -> io::Result<Self> {
        let bytes = bytes.max(4096);
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(path)?;
        let zeros = vec![0u8; 1 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(zeros.len() as u64);
            f.write_all(&zeros[..n as usize])?;
            left -= n;
        }
        f.sync_all()?;
        let file = Arc::new(f);
        let shared = Arc::new((Mutex::new(SyncState::default()), Condvar::new()));
        let (f2, s2) = (Arc::clone(&file), Arc::clone(&shared));
        let thread = std::thread::Builder::new()
            .name("cluster-limit-sync".into())
            .spawn(move || sync_thread(&f2, &s2, &waker, delay))?;
        Ok(Log {
            file,
            bytes,
            at: 0,
            shared,
            thread: Some(thread),
        })
    }

    /// Writes batch `seq`'s bytes and lets the sync thread know.
    pub(super) fn append(&mut self, seq: u64, bytes: &[u8]) -> io::Result<()> {
        let mut rest = bytes;
        while !rest.is_empty() {
            if self.at == self.bytes {
                self.at = 0;
            }
            let room = usize::try_from(self.bytes - self.at).unwrap_or(usize::MAX);
            let n = rest.len().min(room);
            self.file.write_all_at(&rest[..n], self.at)?;
            self.at += n as u64;
            rest = &rest[n..];
        }
        let (lock, cv) = &*self.shared;
        let mut s = lock
            .lock()
            .map_err(|_| io::Error::other("sync thread died"))?;
        s.written = seq;
        cv.notify_one();
        Ok(())
    }

    /// The highest durable batch, or the sync thread's failure.
    pub(super) fn durable(&self) -> io::Result<u64> {
        let s = self
            .shared
            .0
            .lock()
            .map_err(|_| io::Error::other("sync thread died"))?;
        match &s.failed {
            Some(e) => Err(io::Error::other(e.clone())),
            None => Ok(s.durable),
        }
    }

    /// Syncs the file in the caller's thread (a follower's last sync).
    pub(super) fn sync_now(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// Stops the sync thread; returns how many `fdatasync` calls it made
    /// and how long they took.
    pub(super) fn finish(mut self) -> (u64, Duration) {
        if let Ok(mut s) = self.shared.0.lock() {
            s.stop = true;
        }
        self.shared.1.notify_one();
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

/// The sync thread: one `fdatasync` at a time, each covering every batch
/// written before it began; wakes the loop through `waker` after each.
/// Returns how many it made and how long they took.
fn sync_thread(
    file: &File,
    shared: &(Mutex<SyncState>, Condvar),
    waker: &Waker,
    delay: SyncDelay,
) -> (u64, Duration) {
    let (lock, cv) = shared;
    let mut syncs = (0, Duration::ZERO);
    let Ok(mut s) = lock.lock() else { return syncs };
    loop {
        while s.written == s.durable && !s.stop {
            s = match cv.wait(s) {
                Ok(g) => g,
                Err(_) => return syncs,
            };
        }
        if s.stop {
            return syncs;
        }
        // Every batch up to `target` is written: the sync covers them.
        let target = s.written;
        drop(s);
        if !delay.0.is_zero() {
            std::thread::sleep(delay.0);
        }
        let began = Instant::now();
        let r = file.sync_data();
        syncs.0 += 1;
        syncs.1 += began.elapsed();
        s = match lock.lock() {
            Ok(g) => g,
            Err(_) => return syncs,
        };
        match r {
            Ok(()) => s.durable = target,
            Err(e) => {
                s.failed = Some(format!("fdatasync: {e}"));
                s.stop = true;
            }
        }
        let _ = waker.wake();
    }
}

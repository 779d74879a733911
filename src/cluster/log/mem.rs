//! [`MemDisk`]: an in-memory disk that can lose what was not synced.

use super::Disk;
use std::io;

/// An in-memory disk that remembers how much was synced: [`MemDisk::crash`]
/// keeps the synced bytes plus a prefix of the rest, as a power cut would.
/// Cloning shares the same disk, so a test keeps it across a node's crash.
/// A test double (feature `testkit`, never in production).
#[derive(Clone, Debug, Default)]
pub struct MemDisk {
    pub(super) inner: std::rc::Rc<std::cell::RefCell<MemDiskInner>>,
}

#[derive(Debug, Default)]
pub(super) struct MemDiskInner {
    pub(super) data: Vec<u8>,
    pub(super) synced: usize,
    fail_next_sync: bool,
    syncs: u64,
    appends: u64,
    /// Length a started sync will make durable once polled.
    sync_target: Option<usize>,
    /// Started syncs stay unfinished while set (a slow disk).
    hold_syncs: bool,
}

impl MemDisk {
    /// An empty disk.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A power cut: what was not synced is lost, except the first
    /// `keep_unsynced` bytes of it (a torn write).
    pub fn crash(&self, keep_unsynced: usize) {
        let mut d = self.inner.borrow_mut();
        let keep = d.synced + keep_unsynced.min(d.data.len() - d.synced);
        d.data.truncate(keep);
        d.synced = keep;
        d.fail_next_sync = false;
        d.sync_target = None;
    }

    /// Bytes written but not synced.
    #[must_use]
    pub fn unsynced(&self) -> usize {
        let d = self.inner.borrow();
        d.data.len() - d.synced
    }

    /// The next synced append writes its bytes but fails before the sync
    /// completes: the node dies at that fsync point.
    pub fn fail_next_sync(&self) {
        self.inner.borrow_mut().fail_next_sync = true;
    }

    /// While `hold`, a started sync does not finish ([`Disk::poll_sync`]
    /// answers `None`): a slow disk.
    pub fn hold_syncs(&self, hold: bool) {
        self.inner.borrow_mut().hold_syncs = hold;
    }

    /// Cancels a pending [`MemDisk::fail_next_sync`].
    pub fn disarm(&self) {
        self.inner.borrow_mut().fail_next_sync = false;
    }

    /// Number of syncs so far.
    #[must_use]
    pub fn syncs(&self) -> u64 {
        self.inner.borrow().syncs
    }

    /// Number of appends (write calls) so far.
    #[must_use]
    pub fn appends(&self) -> u64 {
        self.inner.borrow().appends
    }

    /// Flips one byte at `pos` (for corruption tests).
    pub fn corrupt_byte(&self, pos: usize) {
        let mut d = self.inner.borrow_mut();
        if let Some(b) = d.data.get_mut(pos) {
            *b ^= 0x5a;
        }
    }

    /// Bytes held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.borrow().data.len()
    }

    /// True when empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Disk for MemDisk {
    fn append(&mut self, bytes: &[u8], sync: bool) -> io::Result<()> {
        let mut d = self.inner.borrow_mut();
        d.appends += 1;
        d.data.extend_from_slice(bytes);
        if sync {
            if d.fail_next_sync {
                return Err(io::Error::other("simulated power cut"));
            }
            d.synced = d.data.len();
            d.syncs += 1;
        }
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        let mut d = self.inner.borrow_mut();
        if d.fail_next_sync {
            return Err(io::Error::other("simulated power cut"));
        }
        d.synced = d.data.len();
        d.syncs += 1;
        d.sync_target = None;
        Ok(())
    }

    /// Records what the sync will cover; it completes when polled, so a
    /// crash in between loses it, as a power cut during `fdatasync` would.
    fn start_sync(&mut self) -> io::Result<()> {
        let mut d = self.inner.borrow_mut();
        d.sync_target = Some(d.data.len());
        Ok(())
    }

    fn poll_sync(&mut self) -> Option<io::Result<()>> {
        let mut d = self.inner.borrow_mut();
        if d.hold_syncs && d.sync_target.is_some() {
            return None;
        }
        let Some(target) = d.sync_target.take() else {
            return Some(Ok(()));
        };
        if d.fail_next_sync {
            return Some(Err(io::Error::other("simulated power cut")));
        }
        d.synced = d.synced.max(target.min(d.data.len()));
        d.syncs += 1;
        Some(Ok(()))
    }

    fn read_all(&mut self) -> io::Result<Vec<u8>> {
        Ok(self.inner.borrow().data.clone())
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        let mut d = self.inner.borrow_mut();
        let len = usize::try_from(len).unwrap_or(usize::MAX).min(d.data.len());
        d.data.truncate(len);
        d.synced = len;
        d.sync_target = None;
        Ok(())
    }

    fn replace(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mut d = self.inner.borrow_mut();
        if d.fail_next_sync {
            return Err(io::Error::other("simulated power cut"));
        }
        d.data = bytes.to_vec();
        d.synced = d.data.len();
        d.syncs += 1;
        d.sync_target = None;
        Ok(())
    }
}

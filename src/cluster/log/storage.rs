//! [`LogStore`]: the in-memory log raft reads through [`raft::Storage`].

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, StorageError};

/// The in-memory raft log: a snapshot's metadata (and data) plus the entries
/// after it, the hard state and the conf state.
#[derive(Clone, Debug, Default)]
pub struct LogStore {
    hs: HardState,
    cs: ConfState,
    snapshot: Snapshot,
    /// `entries[i].index == snap_index() + 1 + i`.
    entries: Vec<Entry>,
    /// While no snapshot has been taken (the log begins at index 1): the
    /// configuration it begins with, the first one recorded (a static
    /// cluster's `--peers`). See [`LogStore::begins_without`].
    origin: Option<ConfState>,
}

impl LogStore {
    /// An empty log.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    pub(super) fn snap_index(&self) -> u64 {
        self.snapshot.get_metadata().index
    }

    fn snap_term(&self) -> u64 {
        self.snapshot.get_metadata().term
    }

    /// The hard state.
    #[must_use]
    pub fn hard_state(&self) -> &HardState {
        &self.hs
    }

    /// The conf state.
    #[must_use]
    pub fn conf_state(&self) -> &ConfState {
        &self.cs
    }

    /// The latest snapshot (empty data and index 0 when there is none).
    #[must_use]
    pub fn latest_snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// Index of the last entry (or of the snapshot).
    #[must_use]
    pub fn last(&self) -> u64 {
        self.entries.last().map_or(self.snap_index(), |e| e.index)
    }

    /// Number of entries held after the snapshot.
    #[must_use]
    pub fn entry_count(&self) -> usize {
        self.entries.len()
    }

    /// Sets the hard state.
    pub fn set_hard_state(&mut self, hs: HardState) {
        self.hs = hs;
    }

    /// Raises the stored commit index.
    pub fn set_commit(&mut self, commit: u64) {
        self.hs.commit = self.hs.commit.max(commit);
    }

    /// Sets the conf state.
    pub fn set_conf_state(&mut self, cs: ConfState) {
        if self.snap_index() == 0 && self.origin.is_none() {
            self.origin = Some(cs.clone());
        }
        self.cs = cs;
    }

    /// Whether the log still begins at index 1 (no snapshot yet) and `id`
    /// is in none of the configuration it begins with. Such a peer (a node
    /// added later, with an empty log) has no configuration to apply the
    /// log's entries on: each conf change in them would be refused against
    /// its empty one, and it would never learn the cluster's members. It
    /// must be sent a snapshot instead of the entries from index 1.
    #[must_use]
    pub fn begins_without(&self, id: u64) -> bool {
        if self.snap_index() != 0 {
            return false;
        }
        self.origin.as_ref().is_none_or(|cs| {
            !cs.voters.contains(&id)
                && !cs.voters_outgoing.contains(&id)
                && !cs.learners.contains(&id)
                && !cs.learners_next.contains(&id)
        })
    }

    /// Appends entries; an entry at index `i` replaces stored entries `>= i`.
    /// Entries at or below the snapshot are ignored (already compacted).
    pub fn append(&mut self, ents: &[Entry]) -> Result<(), &'static str> {
        let first_new = self.snap_index() + 1;
        let ents: Vec<&Entry> = ents.iter().filter(|e| e.index >= first_new).collect();
        let Some(head) = ents.first() else {
            return Ok(());
        };
        if head.index > self.last() + 1 {
            return Err("gap in the log");
        }
        if ents.windows(2).any(|w| w[1].index != w[0].index + 1) {
            return Err("entries not consecutive");
        }
        let keep = usize::try_from(head.index - first_new).map_err(|_| "index overflow")?;
        self.entries.truncate(keep);
        self.entries.extend(ents.into_iter().cloned());
        // `entry` and `term` index `entries` from the snapshot's index.
        debug_assert!(self.entries.first().is_none_or(|e| e.index == first_new));
        Ok(())
    }

    /// Installs a snapshot: every entry is dropped (the snapshot covers the
    /// log up to its index) and the commit index is raised to it.
    pub fn apply_snapshot(&mut self, snap: Snapshot) {
        let meta = snap.get_metadata();
        self.hs.term = self.hs.term.max(meta.term);
        self.hs.commit = self.hs.commit.max(meta.index);
        self.cs = meta.get_conf_state().clone();
        self.entries.clear();
        self.snapshot = snap;
    }

    /// Replaces the snapshot with one taken locally at `index` (which must
    /// be applied and stored) and drops the entries it covers.
    pub fn compact_to(&mut self, index: u64, data: Vec<u8>) -> Result<(), &'static str> {
        if index <= self.snap_index() || index > self.last() {
            return Err("compaction index out of range");
        }
        let term = self.term_of(index).ok_or("no term for compaction index")?;
        let mut meta = SnapshotMetadata {
            index,
            term,
            ..SnapshotMetadata::default()
        };
        meta.set_conf_state(self.cs.clone());
        let mut snap = Snapshot::default();
        snap.set_metadata(meta);
        snap.data = data.into();
        let drop = usize::try_from(index - self.snap_index()).map_err(|_| "index overflow")?;
        self.entries.drain(..drop);
        self.snapshot = snap;
        Ok(())
    }

    fn term_of(&self, idx: u64) -> Option<u64> {
        if idx == self.snap_index() {
            return Some(self.snap_term());
        }
        if idx < self.snap_index() || idx > self.last() {
            return None;
        }
        let off = usize::try_from(idx - self.snap_index() - 1).ok()?;
        self.entries.get(off).map(|e| e.term)
    }

    /// The stored entries in `[low, high)`.
    #[must_use]
    pub fn entries_between(&self, low: u64, high: u64) -> Vec<Entry> {
        let base = self.snap_index() + 1;
        if low < base || high <= low {
            return Vec::new();
        }
        let lo = usize::try_from(low - base).unwrap_or(usize::MAX);
        let hi = usize::try_from(high - base).unwrap_or(usize::MAX);
        self.entries
            .get(lo..hi.min(self.entries.len()))
            .map(<[Entry]>::to_vec)
            .unwrap_or_default()
    }
}

impl raft::Storage for LogStore {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(self.hs.clone(), self.cs.clone()))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low <= self.snap_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last() + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let mut ents = self.entries_between(low, high);
        let max = max_size.into().unwrap_or(u64::MAX);
        // Always return at least one entry (the Storage contract).
        let mut size = 0u64;
        let mut keep = 0;
        for e in &ents {
            size += u64::from(e.compute_size());
            if keep > 0 && size > max {
                break;
            }
            keep += 1;
        }
        ents.truncate(keep);
        Ok(ents)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx < self.snap_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        self.term_of(idx)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.snap_index() + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        if self.snap_index() < request_index {
            // The next local snapshot will cover it.
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        Ok(self.snapshot.clone())
    }
}

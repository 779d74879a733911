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

use crate::metrics::{Histogram, FSYNC_BOUNDS_US};
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
}

impl LogStore {
    /// An empty log.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn snap_index(&self) -> u64 {
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
        self.cs = cs;
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

const KIND_ENTRIES: u8 = 1;
const KIND_HARD_STATE: u8 = 2;
const KIND_CONF_STATE: u8 = 3;
const KIND_SNAPSHOT: u8 = 4;
const KIND_EPOCH: u8 = 5;
const KIND_COMMIT: u8 = 6;
const KIND_SELF: u8 = 7;
const KIND_PEER: u8 = 8;

/// Who this data directory belongs to, and which data directories its peers
/// had when first seen: a random id is drawn when a data directory is
/// created, so a node whose directory was wiped comes back with a new one
/// and its peers can tell.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    /// This data directory's id (0 until drawn).
    pub uuid: u64,
    /// Peer node id -> the data directory id it had when first seen.
    pub peers: std::collections::BTreeMap<u64, u64>,
}

/// What recovery found on disk.
#[derive(Debug)]
pub struct Recovered {
    /// The log.
    pub store: LogStore,
    /// The highest boot epoch recorded (0 on a fresh disk).
    pub epoch: u64,
    /// True when the disk held no record at all.
    pub fresh: bool,
    /// Bytes of torn tail cut off (zeros after it, space written ahead of
    /// the log, are not counted).
    pub torn_bytes: u64,
    /// Bytes of valid log.
    pub log_bytes: u64,
    /// The data directory's identity.
    pub identity: Identity,
}

/// The write-ahead log over a [`Disk`]: records are staged during a turn and
/// written together by [`Wal::flush`].
#[derive(Debug)]
pub struct Wal<D: Disk> {
    disk: D,
    staged: Vec<u8>,
    must_sync: bool,
    /// Written records wait for a sync.
    sync_owed: bool,
    /// An fsync begun by `start_sync` is not reported yet.
    syncing: bool,
    log_bytes: u64,
    identity: Identity,
}

fn push_record(buf: &mut Vec<u8>, kind: u8, payload: &[u8]) {
    let len = u32::try_from(payload.len() + 1).expect("records are bounded");
    let mut h = crc32fast::Hasher::new();
    h.update(&[kind]);
    h.update(payload);
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(&h.finalize().to_be_bytes());
    buf.push(kind);
    buf.extend_from_slice(payload);
}

/// Appends one entries record to `buf`: each entry as its length (u32, big
/// endian) and its protobuf bytes, encoded in place.
fn push_entries_record(buf: &mut Vec<u8>, ents: &[Entry]) {
    let start = buf.len();
    // Length and checksum, filled in once the payload is there.
    buf.extend_from_slice(&[0; 8]);
    buf.push(KIND_ENTRIES);
    for e in ents {
        let size = e.compute_size();
        buf.extend_from_slice(&size.to_be_bytes());
        let mut os = protobuf::CodedOutputStream::vec(buf);
        e.write_to_with_cached_sizes(&mut os)
            .and_then(|()| os.flush())
            .expect("raft entries always encode");
    }
    let len = u32::try_from(buf.len() - start - 8).expect("records are bounded");
    let crc = crc32fast::hash(&buf[start + 8..]);
    buf[start..start + 4].copy_from_slice(&len.to_be_bytes());
    buf[start + 4..start + 8].copy_from_slice(&crc.to_be_bytes());
}

fn pb_bytes<M: protobuf::Message>(m: &M) -> Vec<u8> {
    m.write_to_bytes().expect("raft messages always encode")
}

fn corrupt(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("WAL: {what}"))
}

impl<D: Disk> Wal<D> {
    /// Reads and replays the log on `disk`, cutting a torn tail.
    pub fn open(mut disk: D) -> io::Result<(Self, Recovered)> {
        let bytes = disk.read_all()?;
        let mut store = LogStore::new();
        let mut epoch = 0;
        let mut pos = 0usize;
        let mut fresh = true;
        let mut identity = Identity::default();
        while bytes.len() - pos >= 9 {
            let len = u32::from_be_bytes(bytes[pos..pos + 4].try_into().expect("4 bytes")) as usize;
            let crc = u32::from_be_bytes(bytes[pos + 4..pos + 8].try_into().expect("4 bytes"));
            // Any length the u32 field says is taken: snapshots travel
            // inline, so a big table makes a big record, and cutting one
            // as torn would lose the hard state written after it. The
            // file is already in memory, so a length costs nothing of its
            // own: a record is a tear only when it does not fit in the
            // file or fails its checksum.
            if len == 0 || bytes.len() - pos - 8 < len {
                break;
            }
            let body = &bytes[pos + 8..pos + 8 + len];
            if crc32fast::hash(body) != crc || body[0] == 0 {
                break;
            }
            let (kind, payload) = (body[0], &body[1..]);
            apply_record(&mut store, &mut epoch, &mut identity, kind, payload)?;
            fresh = false;
            pos += 8 + len;
        }
        // Zeros past the last record are space written ahead, not a tear.
        let tail = &bytes[pos..];
        let torn = tail
            .iter()
            .rposition(|b| *b != 0)
            .map_or(0, |i| i as u64 + 1);
        if !tail.is_empty() {
            disk.truncate(pos as u64)?;
        }
        let hs = store.hard_state();
        if hs.commit > store.last() || hs.commit < store.snap_index() {
            return Err(corrupt("commit index outside the stored log"));
        }
        let wal = Wal {
            disk,
            staged: Vec::new(),
            must_sync: false,
            sync_owed: false,
            syncing: false,
            log_bytes: pos as u64,
            identity: identity.clone(),
        };
        Ok((
            wal,
            Recovered {
                store,
                epoch,
                fresh,
                torn_bytes: torn,
                log_bytes: pos as u64,
                identity,
            },
        ))
    }

    /// Stages entries.
    pub fn stage_entries(&mut self, ents: &[Entry]) {
        if ents.is_empty() {
            return;
        }
        push_entries_record(&mut self.staged, ents);
        self.must_sync = true;
    }

    /// Stages a hard state.
    pub fn stage_hard_state(&mut self, hs: &HardState) {
        push_record(&mut self.staged, KIND_HARD_STATE, &pb_bytes(hs));
    }

    /// Stages a commit index (needs no fsync of its own: it may lag).
    pub fn stage_commit(&mut self, commit: u64) {
        push_record(&mut self.staged, KIND_COMMIT, &commit.to_be_bytes());
    }

    /// Stages a conf state.
    pub fn stage_conf_state(&mut self, cs: &ConfState) {
        push_record(&mut self.staged, KIND_CONF_STATE, &pb_bytes(cs));
        self.must_sync = true;
    }

    /// Stages a snapshot (metadata and data).
    pub fn stage_snapshot(&mut self, snap: &Snapshot) {
        push_record(&mut self.staged, KIND_SNAPSHOT, &pb_bytes(snap));
        self.must_sync = true;
    }

    /// Stages a boot epoch.
    pub fn stage_epoch(&mut self, epoch: u64) {
        push_record(&mut self.staged, KIND_EPOCH, &epoch.to_be_bytes());
        self.must_sync = true;
    }

    /// Stages this data directory's id.
    pub fn stage_self(&mut self, uuid: u64) {
        self.identity.uuid = uuid;
        push_record(&mut self.staged, KIND_SELF, &uuid.to_be_bytes());
        self.must_sync = true;
    }

    /// Stages the data directory id first seen for peer `id`.
    pub fn stage_peer(&mut self, id: u64, uuid: u64) {
        self.identity.peers.insert(id, uuid);
        let mut p = id.to_be_bytes().to_vec();
        p.extend_from_slice(&uuid.to_be_bytes());
        push_record(&mut self.staged, KIND_PEER, &p);
        self.must_sync = true;
    }

    /// The identity recorded so far (staged records included).
    #[must_use]
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Writes everything staged with one write, and fsyncs when `sync` or
    /// when a staged record needs it.
    pub fn flush(&mut self, sync: bool) -> io::Result<()> {
        let sync = sync || self.must_sync;
        if self.staged.is_empty() {
            return Ok(());
        }
        self.disk.append(&self.staged, sync)?;
        self.log_bytes += self.staged.len() as u64;
        self.staged.clear();
        self.must_sync = false;
        Ok(())
    }

    /// Writes everything staged with one write and no fsync; records that
    /// need one (or `sync`) leave a sync owed for [`Wal::sync`].
    pub fn write(&mut self, sync: bool) -> io::Result<()> {
        self.sync_owed |= sync || self.must_sync;
        self.must_sync = false;
        if self.staged.is_empty() {
            return Ok(());
        }
        self.disk.append(&self.staged, false)?;
        self.log_bytes += self.staged.len() as u64;
        self.staged.clear();
        Ok(())
    }

    /// True when written records wait for [`Wal::sync`].
    #[must_use]
    pub fn sync_owed(&self) -> bool {
        self.sync_owed
    }

    /// The fsync owed by [`Wal::write`] (nothing when none is owed).
    pub fn sync(&mut self) -> io::Result<()> {
        if self.sync_owed || self.syncing {
            self.syncing = false;
            self.disk.sync()?;
            self.sync_owed = false;
        }
        Ok(())
    }

    /// Begins the fsync owed by [`Wal::write`] without waiting for it; it
    /// covers everything written so far. [`Wal::poll_sync`] reports it.
    pub fn start_sync(&mut self) -> io::Result<()> {
        if !self.sync_owed || self.syncing {
            return Ok(());
        }
        self.sync_owed = false;
        self.syncing = true;
        self.disk.start_sync()
    }

    /// The outcome of the fsync [`Wal::start_sync`] began: `None` while it
    /// runs (or when none was begun).
    pub fn poll_sync(&mut self) -> Option<io::Result<()>> {
        if !self.syncing {
            return None;
        }
        let r = self.disk.poll_sync()?;
        self.syncing = false;
        Some(r)
    }

    /// Rewrites the log as the compacted `store` plus `epoch`, atomically.
    pub fn rewrite(&mut self, store: &LogStore, epoch: u64) -> io::Result<()> {
        let mut buf = Vec::new();
        push_record(&mut buf, KIND_EPOCH, &epoch.to_be_bytes());
        if self.identity.uuid != 0 {
            push_record(&mut buf, KIND_SELF, &self.identity.uuid.to_be_bytes());
        }
        for (id, uuid) in &self.identity.peers {
            let mut p = id.to_be_bytes().to_vec();
            p.extend_from_slice(&uuid.to_be_bytes());
            push_record(&mut buf, KIND_PEER, &p);
        }
        if store.snap_index() > 0 {
            push_record(&mut buf, KIND_SNAPSHOT, &pb_bytes(store.latest_snapshot()));
        }
        push_record(&mut buf, KIND_CONF_STATE, &pb_bytes(store.conf_state()));
        let all = store.entries_between(store.snap_index() + 1, store.last() + 1);
        if !all.is_empty() {
            push_entries_record(&mut buf, &all);
        }
        push_record(&mut buf, KIND_HARD_STATE, &pb_bytes(store.hard_state()));
        // The replacement is durable and holds everything written: a sync in
        // flight is waited for by `replace` and owes nothing more.
        self.disk.replace(&buf)?;
        self.log_bytes = buf.len() as u64;
        self.staged.clear();
        self.must_sync = false;
        self.sync_owed = false;
        self.syncing = false;
        Ok(())
    }

    /// Bytes in the log.
    #[must_use]
    pub fn log_bytes(&self) -> u64 {
        self.log_bytes
    }

    /// The disk.
    pub fn disk_mut(&mut self) -> &mut D {
        &mut self.disk
    }

    /// The disk, for inspection.
    pub fn disk(&self) -> &D {
        &self.disk
    }
}

fn apply_record(
    store: &mut LogStore,
    epoch: &mut u64,
    identity: &mut Identity,
    kind: u8,
    p: &[u8],
) -> io::Result<()> {
    let bad = |e: protobuf::ProtobufError| corrupt(&format!("bad record: {e}"));
    match kind {
        KIND_ENTRIES => {
            let mut ents = Vec::new();
            let mut pos = 0;
            while pos < p.len() {
                if p.len() - pos < 4 {
                    return Err(corrupt("truncated entry"));
                }
                let n = u32::from_be_bytes(p[pos..pos + 4].try_into().expect("4 bytes")) as usize;
                pos += 4;
                if p.len() - pos < n {
                    return Err(corrupt("truncated entry"));
                }
                ents.push(Entry::parse_from_bytes(&p[pos..pos + n]).map_err(bad)?);
                pos += n;
            }
            store.append(&ents).map_err(corrupt)?;
        }
        KIND_HARD_STATE => store.set_hard_state(HardState::parse_from_bytes(p).map_err(bad)?),
        KIND_COMMIT => {
            let c = u64::from_be_bytes(p.try_into().map_err(|_| corrupt("commit record"))?);
            store.set_commit(c);
        }
        KIND_CONF_STATE => store.set_conf_state(ConfState::parse_from_bytes(p).map_err(bad)?),
        KIND_SNAPSHOT => store.apply_snapshot(Snapshot::parse_from_bytes(p).map_err(bad)?),
        KIND_EPOCH => {
            let e = u64::from_be_bytes(p.try_into().map_err(|_| corrupt("epoch record"))?);
            *epoch = (*epoch).max(e);
        }
        KIND_SELF => {
            identity.uuid = u64::from_be_bytes(p.try_into().map_err(|_| corrupt("self record"))?);
        }
        KIND_PEER => {
            if p.len() != 16 {
                return Err(corrupt("peer record"));
            }
            let id = u64::from_be_bytes(p[..8].try_into().expect("8 bytes"));
            let uuid = u64::from_be_bytes(p[8..].try_into().expect("8 bytes"));
            identity.peers.insert(id, uuid);
        }
        k => return Err(corrupt(&format!("unknown record kind {k}"))),
    }
    Ok(())
}

/// Zeros written ahead of the log's end at a time (see [`FileDisk`]).
pub const PREALLOC_BYTES: u64 = 1 << 20;

/// The WAL as one file, `DIR/wal`, written with `pwrite` + `fdatasync`. A
/// started sync runs on a thread of its own (see the module docs).
///
/// The file is kept up to [`PREALLOC_BYTES`] longer than the log, the
/// excess written as zeros: a record then overwrites blocks that already
/// belong to the file, so its `fdatasync` flushes data only, with no file
/// size or block allocation to commit to the filesystem's journal (on ext4
/// that makes each fsync cheaper and quicker). Recovery stops at the zeros
/// (no record has length 0 or kind 0) and does not count them as a
/// torn tail. Failing to write the zeros (a full disk) only loses that
/// saving.
#[derive(Debug)]
pub struct FileDisk {
    dir: PathBuf,
    /// Shared with the sync thread, which syncs the file it is handed.
    file: Arc<File>,
    /// Where the next record goes: the log's end.
    end: u64,
    /// The file's length; `[end, len)` holds zeros.
    len: u64,
    syncer: Option<Syncer>,
    waker: Option<Arc<mio::Waker>>,
    /// A sync was handed to the syncer and its result not yet taken.
    in_flight: bool,
    /// Bytes were appended after the in-flight sync began, so a blocking
    /// [`Disk::sync`] must not rely on it alone.
    appended_since_start: bool,
    /// How long each `fdatasync` took, in microseconds.
    fsync_us: Histogram,
}

/// `fdatasync` of `file`, and how long it took in microseconds.
fn timed_sync(file: &File) -> (io::Result<()>, u64) {
    let start = std::time::Instant::now();
    let r = file.sync_data();
    (
        r,
        u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
    )
}

/// The thread that runs `fdatasync` for [`FileDisk::start_sync`]. Each
/// request carries a handle on the WAL file it is for (compaction replaces
/// the file) and the waker to call when done; the thread sends back the
/// result and exits when the disk is dropped.
#[derive(Debug)]
struct Syncer {
    requests: std::sync::mpsc::Sender<(Arc<File>, Option<Arc<mio::Waker>>)>,
    /// Each sync's result and how long it took, in microseconds.
    results: std::sync::mpsc::Receiver<(io::Result<()>, u64)>,
}

impl Syncer {
    fn spawn() -> io::Result<Self> {
        let (requests, rx) = std::sync::mpsc::channel::<(Arc<File>, Option<Arc<mio::Waker>>)>();
        let (tx, results) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("ticketd-fsync".into())
            .spawn(move || {
                for (file, waker) in rx {
                    if tx.send(timed_sync(&file)).is_err() {
                        break;
                    }
                    if let Some(w) = waker {
                        // A failed wake only delays the report to the
                        // loop's next turn.
                        let _ = w.wake();
                    }
                }
            })?;
        Ok(Syncer { requests, results })
    }
}

impl FileDisk {
    /// Opens (creating if needed) the log in `dir`.
    pub fn open(dir: &Path) -> io::Result<Self> {
        // Private (0700 / 0600 whatever the umask), never through a
        // symlink, and every error names its path.
        crate::datadir::create_private_dir(dir)?;
        let path = dir.join("wal");
        let file = crate::datadir::open_private(&path)?;
        // Until recovery cuts it (`truncate`) the whole file counts as log.
        let len = file
            .metadata()
            .map_err(|e| crate::datadir::at(&path, &e))?
            .len();
        Ok(FileDisk {
            dir: dir.to_path_buf(),
            file: Arc::new(file),
            end: len,
            len,
            syncer: None,
            waker: None,
            in_flight: false,
            appended_since_start: false,
            fsync_us: Histogram::new(FSYNC_BOUNDS_US),
        })
    }

    /// How long each `fdatasync` of the log took, in microseconds.
    #[must_use]
    pub fn fsync_histogram(&self) -> &Histogram {
        &self.fsync_us
    }

    fn sync_now(&mut self) -> io::Result<()> {
        let (r, us) = timed_sync(&self.file);
        self.fsync_us.observe(us);
        r
    }

    /// Has the sync thread wake the loop's poll when a sync it runs is
    /// over. Without a waker, started syncs run inline (as a blocking
    /// [`Disk::sync`]): nothing would tell the loop they finished.
    pub fn set_waker(&mut self, waker: Arc<mio::Waker>) {
        self.waker = Some(waker);
    }

    /// Writes zeros from the file's end to [`PREALLOC_BYTES`] past the
    /// log's. Errors are ignored: the zeros only make later fsyncs cheaper.
    fn preallocate(&mut self) {
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        let target = self.end + PREALLOC_BYTES;
        while self.len < target {
            let n = (target - self.len).min(ZEROS.len() as u64) as usize;
            if let Err(e) = self.file.write_all_at(&ZEROS[..n], self.len) {
                log::debug!("WAL: no space written ahead: {e}");
                return;
            }
            self.len += n as u64;
        }
    }

    /// Bytes of zeros written ahead of the log's end.
    #[must_use]
    pub fn preallocated(&self) -> u64 {
        self.len - self.end
    }

    /// Waits for the in-flight sync, if any, and returns its result.
    fn wait_in_flight(&mut self) -> io::Result<()> {
        if !self.in_flight {
            return Ok(());
        }
        self.in_flight = false;
        match self.syncer.as_ref().map(|s| s.results.recv()) {
            Some(Ok((result, us))) => {
                self.fsync_us.observe(us);
                result
            }
            // The thread is gone: sync here instead.
            _ => {
                self.syncer = None;
                self.sync_now()
            }
        }
    }
}

impl Drop for FileDisk {
    fn drop(&mut self) {
        // Let a running fdatasync finish before the descriptor goes away.
        let _ = self.wait_in_flight();
    }
}

impl Disk for FileDisk {
    fn append(&mut self, bytes: &[u8], sync: bool) -> io::Result<()> {
        self.appended_since_start |= self.in_flight;
        self.file.write_all_at(bytes, self.end)?;
        self.end += bytes.len() as u64;
        if self.end > self.len {
            self.len = self.end;
            self.preallocate();
        }
        if sync {
            self.sync()?;
        }
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        let started = self.in_flight;
        self.wait_in_flight()?;
        if !started || std::mem::take(&mut self.appended_since_start) {
            self.sync_now()?;
        }
        Ok(())
    }

    fn start_sync(&mut self) -> io::Result<()> {
        if self.in_flight {
            // One at a time: the caller polls this one first (`append`
            // notes what it will not cover).
            return Ok(());
        }
        if self.waker.is_none() {
            return self.sync_now();
        }
        if self.syncer.is_none() {
            // Without a thread (none could be started), sync inline.
            self.syncer = Syncer::spawn().ok();
        }
        let Some(syncer) = &self.syncer else {
            return self.sync_now();
        };
        let dup = Arc::clone(&self.file);
        if syncer.requests.send((dup, self.waker.clone())).is_err() {
            self.syncer = None;
            return self.sync_now();
        }
        self.in_flight = true;
        self.appended_since_start = false;
        Ok(())
    }

    fn poll_sync(&mut self) -> Option<io::Result<()>> {
        if !self.in_flight {
            return Some(Ok(()));
        }
        let r = match self.syncer.as_ref().map(|s| s.results.try_recv()) {
            Some(Ok((r, us))) => {
                self.fsync_us.observe(us);
                r
            }
            Some(Err(std::sync::mpsc::TryRecvError::Empty)) => return None,
            // The thread is gone: sync here instead.
            _ => {
                self.syncer = None;
                self.sync_now()
            }
        };
        self.in_flight = false;
        Some(r)
    }

    fn read_all(&mut self) -> io::Result<Vec<u8>> {
        let path = self.dir.join("wal");
        let mut f = File::open(&path).map_err(|e| crate::datadir::at(&path, &e))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf)
            .map_err(|e| crate::datadir::at(&path, &e))?;
        Ok(buf)
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.wait_in_flight()?;
        self.file.set_len(len)?;
        self.end = len;
        self.len = len;
        self.file.sync_all()
    }

    fn replace(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.wait_in_flight()?;
        // `wal.tmp` is created exclusively and never through a symlink.
        let path = self.dir.join("wal");
        crate::datadir::replace_file(&path, bytes)?;
        self.file = Arc::new(crate::datadir::open_private(&path)?);
        self.end = bytes.len() as u64;
        self.len = self.end;
        Ok(())
    }
}

/// An in-memory disk that remembers how much was synced: [`MemDisk::crash`]
/// keeps the synced bytes plus a prefix of the rest, as a power cut would.
/// Cloning shares the same disk, so a test keeps it across a node's crash.
/// A test double (feature `testkit`, never in production).
#[cfg(any(test, feature = "testkit"))]
#[derive(Clone, Debug, Default)]
pub struct MemDisk {
    inner: std::rc::Rc<std::cell::RefCell<MemDiskInner>>,
}

#[cfg(any(test, feature = "testkit"))]
#[derive(Debug, Default)]
struct MemDiskInner {
    data: Vec<u8>,
    synced: usize,
    fail_next_sync: bool,
    syncs: u64,
    /// Length a started sync will make durable once polled.
    sync_target: Option<usize>,
    /// Started syncs stay unfinished while set (a slow disk).
    hold_syncs: bool,
}

#[cfg(any(test, feature = "testkit"))]
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

#[cfg(any(test, feature = "testkit"))]
impl Disk for MemDisk {
    fn append(&mut self, bytes: &[u8], sync: bool) -> io::Result<()> {
        let mut d = self.inner.borrow_mut();
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

#[cfg(test)]
mod tests {
    use super::*;
    use raft::Storage as _;
    use std::fs::{self, OpenOptions};

    #[test]
    fn an_entries_record_is_each_entry_length_prefixed_under_one_checksum() {
        let ents: Vec<Entry> = (1..=3u64)
            .map(|i| Entry {
                index: i,
                term: 2,
                data: vec![i as u8; 40 * i as usize].into(),
                ..Default::default()
            })
            .collect();
        // The record spelled out: each entry's length and bytes, then the
        // usual record header over them.
        let mut payload = Vec::new();
        for e in &ents {
            let b = pb_bytes(e);
            payload.extend_from_slice(&(b.len() as u32).to_be_bytes());
            payload.extend_from_slice(&b);
        }
        let mut expected = b"before".to_vec();
        push_record(&mut expected, KIND_ENTRIES, &payload);
        let mut got = b"before".to_vec();
        push_entries_record(&mut got, &ents);
        assert_eq!(got, expected);
    }

    #[test]
    fn a_started_sync_counts_only_once_polled() {
        let mut d = MemDisk::new();
        let probe = d.clone();
        d.append(b"abc", false).unwrap();
        d.start_sync().unwrap();
        probe.crash(0);
        assert!(
            probe.is_empty(),
            "a power cut before the sync ended lost the bytes"
        );
        d.append(b"abc", false).unwrap();
        d.start_sync().unwrap();
        probe.hold_syncs(true);
        assert!(d.poll_sync().is_none(), "a held sync is still running");
        probe.hold_syncs(false);
        assert!(matches!(d.poll_sync(), Some(Ok(()))));
        d.append(b"de", false).unwrap();
        probe.crash(0);
        assert_eq!(
            d.read_all().unwrap(),
            b"abc",
            "the polled sync kept its bytes only"
        );
    }

    #[test]
    fn a_file_disk_syncs_in_the_background_and_wakes_the_poll() {
        let dir = std::env::temp_dir().join(format!("ticketd-bgsync-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut poll = mio::Poll::new().unwrap();
        let waker = Arc::new(mio::Waker::new(poll.registry(), mio::Token(7)).unwrap());
        let mut d = FileDisk::open(&dir).unwrap();
        d.set_waker(waker);
        d.append(b"first", false).unwrap();
        d.start_sync().unwrap();
        // Written while that sync runs: a blocking sync must still cover it.
        d.append(b"second", false).unwrap();
        // The waker fires once the result is ready.
        let mut events = mio::Events::with_capacity(4);
        poll.poll(&mut events, Some(std::time::Duration::from_secs(10)))
            .unwrap();
        assert!(
            events.iter().any(|e| e.token() == mio::Token(7)),
            "the sync thread woke the poll"
        );
        assert!(
            matches!(d.poll_sync(), Some(Ok(()))),
            "and its result is in"
        );
        d.start_sync().unwrap();
        d.sync().unwrap();
        assert!(
            matches!(d.poll_sync(), Some(Ok(()))),
            "nothing left running"
        );
        // Replacing the file while a sync runs waits for it first.
        d.append(b"third", false).unwrap();
        d.start_sync().unwrap();
        d.replace(b"whole").unwrap();
        d.append(b"+", false).unwrap();
        let all = d.read_all().unwrap();
        assert_eq!(&all[..6], b"whole+");
        assert!(all[6..].iter().all(|b| *b == 0), "then zeros written ahead");
        assert_eq!(d.preallocated(), PREALLOC_BYTES);
        drop(d);
        let _ = fs::remove_dir_all(&dir);
    }

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        Entry {
            index,
            term,
            data: data.to_vec().into(),
            ..Entry::default()
        }
    }

    fn hs(term: u64, vote: u64, commit: u64) -> HardState {
        HardState {
            term,
            vote,
            commit,
            ..HardState::default()
        }
    }

    #[test]
    fn log_store_appends_replaces_and_compacts() {
        let mut s = LogStore::new();
        s.append(&[entry(1, 1, b"a"), entry(2, 1, b"b"), entry(3, 1, b"c")])
            .unwrap();
        s.append(&[entry(2, 2, b"x")]).unwrap();
        assert_eq!(s.last_index().unwrap(), 2);
        assert_eq!(s.term(2).unwrap(), 2);
        assert!(s.append(&[entry(9, 2, b"gap")]).is_err());
        s.set_hard_state(hs(2, 1, 2));
        s.compact_to(1, b"snap".to_vec()).unwrap();
        assert_eq!(s.first_index().unwrap(), 2);
        assert_eq!(s.term(1).unwrap(), 1);
        assert!(s.term(0).is_err());
        assert_eq!(
            s.entries(2, 3, None, GetEntriesContext::empty(false))
                .unwrap()[0]
                .data[..],
            b"x"[..]
        );
        assert!(s
            .entries(1, 3, None, GetEntriesContext::empty(false))
            .is_err());
        assert_eq!(s.snapshot(1, 0).unwrap().data[..], b"snap"[..]);
        assert!(s.snapshot(2, 0).is_err());
    }

    #[test]
    fn wal_recovers_what_was_synced_and_cuts_a_torn_tail() {
        let disk = MemDisk::new();
        let (mut wal, rec) = Wal::open(disk.clone()).unwrap();
        assert!(rec.fresh);
        wal.stage_epoch(1);
        wal.stage_entries(&[entry(1, 1, b"a"), entry(2, 1, b"b")]);
        wal.stage_hard_state(&hs(1, 1, 1));
        wal.flush(false).unwrap();
        // A commit-only batch is not synced.
        wal.stage_commit(2);
        wal.flush(false).unwrap();
        assert!(disk.unsynced() > 0);
        for keep in 0..disk.unsynced() {
            let d = MemDisk::new();
            d.inner.borrow_mut().data = disk.inner.borrow().data.clone();
            d.inner.borrow_mut().synced = disk.inner.borrow().synced;
            d.crash(keep);
            let (_, rec) = Wal::open(d.clone()).unwrap();
            assert_eq!(rec.store.last(), 2);
            assert_eq!(rec.store.hard_state().commit, 1, "keep {keep}");
            let data = disk.inner.borrow().data.clone();
            let synced = disk.inner.borrow().synced;
            let tail = &data[synced..synced + keep];
            let nonzero = tail.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
            assert_eq!(rec.torn_bytes as usize, nonzero, "keep {keep}");
            assert_eq!(rec.epoch, 1);
            // The torn bytes are gone from the disk too.
            let (_, again) = Wal::open(d).unwrap();
            assert_eq!(again.torn_bytes, 0);
        }
        // A flipped byte in the last record cuts it; everything before stays.
        let len = disk.len();
        disk.corrupt_byte(len - 1);
        let (_, rec) = Wal::open(disk.clone()).unwrap();
        assert_eq!(rec.store.hard_state().commit, 1);
        assert_eq!(rec.store.last(), 2);
    }

    #[test]
    fn rewrite_keeps_snapshot_and_tail() {
        let disk = MemDisk::new();
        let (mut wal, _) = Wal::open(disk.clone()).unwrap();
        let mut s = LogStore::new();
        let cs = ConfState {
            voters: vec![1, 2, 3],
            ..ConfState::default()
        };
        s.set_conf_state(cs.clone());
        let ents: Vec<Entry> = (1..=5).map(|i| entry(i, 1, b"e")).collect();
        s.append(&ents).unwrap();
        s.set_hard_state(hs(1, 2, 4));
        wal.stage_entries(&ents);
        wal.flush(true).unwrap();
        wal.stage_self(77);
        wal.stage_peer(2, 88);
        wal.flush(false).unwrap();
        s.compact_to(3, b"table".to_vec()).unwrap();
        wal.rewrite(&s, 7).unwrap();
        let (_, rec) = Wal::open(disk).unwrap();
        assert_eq!(rec.epoch, 7);
        assert_eq!(rec.identity.uuid, 77);
        assert_eq!(rec.identity.peers.get(&2), Some(&88));
        assert_eq!(rec.store.first_index().unwrap(), 4);
        assert_eq!(rec.store.last(), 5);
        assert_eq!(rec.store.latest_snapshot().data[..], b"table"[..]);
        assert_eq!(rec.store.conf_state().voters, vec![1, 2, 3]);
        assert_eq!(rec.store.hard_state().commit, 4);
    }

    #[test]
    fn a_snapshot_bigger_than_256_mib_survives_compaction_and_restart() {
        // A full table of long keys makes a snapshot this big. Recovery once
        // cut records over 256 MiB as torn, and with it the conf state,
        // entries and hard state the compacted log writes after it.
        let disk = MemDisk::new();
        let (mut wal, _) = Wal::open(disk.clone()).unwrap();
        let mut s = LogStore::new();
        s.set_conf_state(ConfState {
            voters: vec![1, 2, 3],
            ..ConfState::default()
        });
        let ents: Vec<Entry> = (1..=4).map(|i| entry(i, 3, b"e")).collect();
        s.append(&ents).unwrap();
        s.set_hard_state(hs(3, 2, 3));
        let table = vec![0x5a; (256 << 20) + 1];
        s.compact_to(3, table).unwrap();
        wal.rewrite(&s, 9).unwrap();
        drop(wal);
        drop(s);
        let (_, rec) = Wal::open(disk).unwrap();
        assert_eq!(rec.torn_bytes, 0);
        assert_eq!(rec.store.latest_snapshot().data.len(), (256 << 20) + 1);
        assert_eq!(rec.store.conf_state().voters, vec![1, 2, 3]);
        assert_eq!(rec.store.last(), 4);
        let h = rec.store.hard_state();
        assert_eq!((h.term, h.vote, h.commit), (3, 2, 3));
    }

    #[test]
    fn a_checked_record_of_kind_zero_is_a_torn_tail_not_corruption() {
        let disk = MemDisk::new();
        let (mut wal, _) = Wal::open(disk.clone()).unwrap();
        wal.stage_epoch(2);
        wal.flush(true).unwrap();
        let log_bytes = wal.log_bytes();
        // Kind 0 is never written: a length that reached the disk over
        // zeros, whose checksum happens to match.
        let mut bad = Vec::new();
        push_record(&mut bad, 0, &[0, 0, 0]);
        disk.clone().append(&bad, true).unwrap();
        let (_, rec) = Wal::open(disk.clone()).unwrap();
        assert_eq!(rec.epoch, 2);
        assert_eq!(rec.log_bytes, log_bytes);
        assert_eq!(disk.len() as u64, log_bytes, "cut off");
    }

    #[test]
    fn file_disk_roundtrips_and_truncates() {
        let dir = std::env::temp_dir().join(format!("ticketd-wal-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let log_bytes = {
            let (mut wal, rec) = Wal::open(FileDisk::open(&dir).unwrap()).unwrap();
            assert!(rec.fresh);
            wal.stage_epoch(3);
            wal.stage_entries(&[entry(1, 1, b"a")]);
            wal.flush(true).unwrap();
            wal.log_bytes()
        };
        let wal_len = fs::metadata(dir.join("wal")).unwrap().len();
        assert!(wal_len >= log_bytes + PREALLOC_BYTES, "zeros written ahead");
        // A crash tore the next record inside the zeros: its length and
        // part of its body reached the disk, its checksum did not.
        let f = OpenOptions::new()
            .write(true)
            .open(dir.join("wal"))
            .unwrap();
        f.write_all_at(&[0, 0, 0, 50], log_bytes).unwrap();
        f.write_all_at(&[1, 2], log_bytes + 8).unwrap();
        drop(f);
        let (_, rec) = Wal::open(FileDisk::open(&dir).unwrap()).unwrap();
        assert_eq!(rec.log_bytes, log_bytes);
        assert_eq!(rec.torn_bytes, 10, "from its length to its last byte");
        assert_eq!(
            fs::metadata(dir.join("wal")).unwrap().len(),
            log_bytes,
            "cut at the log's end, zeros and all"
        );
        assert_eq!(rec.epoch, 3);
        assert_eq!(rec.store.last(), 1);
        let (_, rec) = Wal::open(FileDisk::open(&dir).unwrap()).unwrap();
        assert_eq!(rec.torn_bytes, 0);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The log and its replacement are private and never written through
    /// a planted `wal.tmp` symlink.
    #[test]
    fn file_disk_files_are_private_and_a_planted_temp_link_is_not_followed() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("ticketd-wal-mode-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let dir = base.join("node");
        let mut disk = FileDisk::open(&dir).unwrap();
        let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("wal")), 0o600);
        let victim = base.join("victim");
        fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("wal.tmp")).unwrap();
        disk.replace(b"compacted").unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "keep");
        assert_eq!(fs::read(dir.join("wal")).unwrap(), b"compacted");
        assert_eq!(mode(&dir.join("wal")), 0o600);
        drop(disk);
        fs::remove_dir_all(&base).unwrap();
    }
}

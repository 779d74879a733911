//! The WAL: its record format, staging, flushing and recovery.

use super::{Disk, LogStore};
use std::io;

use protobuf::Message as _;
use protobuf::ProtobufEnum as _;
use raft::eraftpb::{ConfState, Entry, EntryType, HardState, Snapshot};

pub(super) const KIND_ENTRIES: u8 = 1;
pub(super) const KIND_HARD_STATE: u8 = 2;
pub(super) const KIND_CONF_STATE: u8 = 3;
pub(super) const KIND_SNAPSHOT: u8 = 4;
pub(super) const KIND_EPOCH: u8 = 5;
pub(super) const KIND_COMMIT: u8 = 6;
pub(super) const KIND_SELF: u8 = 7;
pub(super) const KIND_PEER: u8 = 8;
pub(super) const KIND_ENTRIES_RAW: u8 = 9;
/// Fixed bytes of each entry in a [`KIND_ENTRIES_RAW`] record: index, term,
/// type, and the lengths of data and context.
const RAW_ENTRY_FIXED: usize = 8 + 8 + 1 + 4 + 4;

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
    /// A staged record (of a batch [`Wal::end_batch`] closed) needs an
    /// fsync: the next [`Wal::write`] cannot leave it staged.
    staged_sync: bool,
    /// Records written or staged wait for a sync.
    sync_owed: bool,
    /// An fsync begun by `start_sync` is not reported yet.
    syncing: bool,
    log_bytes: u64,
    identity: Identity,
}

pub(super) fn push_record(buf: &mut Vec<u8>, kind: u8, payload: &[u8]) {
    let len = u32::try_from(payload.len() + 1).expect("records are bounded");
    let mut h = crc32fast::Hasher::new();
    h.update(&[kind]);
    h.update(payload);
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(&h.finalize().to_be_bytes());
    buf.push(kind);
    buf.extend_from_slice(payload);
}

/// Appends one entries record to `buf` in the WAL's own layout, with no
/// protobuf sizing or encoding: for each entry its index and term (u64),
/// its type (u8), then its data and its context, each a length (u32) and
/// the bytes; big endian. An entry with a field this layout does not carry
/// (`sync_log`, fields unknown to this version) makes the record the
/// protobuf one ([`push_pb_entries_record`]).
pub(super) fn push_entries_record(buf: &mut Vec<u8>, ents: &[Entry]) {
    if ents
        .iter()
        .any(|e| e.sync_log || e.get_unknown_fields().iter().next().is_some())
    {
        push_pb_entries_record(buf, ents);
        return;
    }
    let start = buf.len();
    let body: usize = ents
        .iter()
        .map(|e| RAW_ENTRY_FIXED + e.data.len() + e.context.len())
        .sum();
    buf.reserve(9 + body);
    // Length and checksum, filled in once the payload is there.
    buf.extend_from_slice(&[0; 8]);
    buf.push(KIND_ENTRIES_RAW);
    for e in ents {
        buf.extend_from_slice(&e.index.to_be_bytes());
        buf.extend_from_slice(&e.term.to_be_bytes());
        buf.push(u8::try_from(e.get_entry_type().value()).expect("entry types are small"));
        for part in [&e.data[..], &e.context[..]] {
            let n = u32::try_from(part.len()).expect("records are bounded");
            buf.extend_from_slice(&n.to_be_bytes());
            buf.extend_from_slice(part);
        }
    }
    let len = u32::try_from(buf.len() - start - 8).expect("records are bounded");
    let crc = crc32fast::hash(&buf[start + 8..]);
    buf[start..start + 4].copy_from_slice(&len.to_be_bytes());
    buf[start + 4..start + 8].copy_from_slice(&crc.to_be_bytes());
}

/// Decodes a [`KIND_ENTRIES_RAW`] payload; any malformed input is an error.
fn parse_raw_entries(p: &[u8]) -> io::Result<Vec<Entry>> {
    let truncated = || corrupt("truncated entry");
    let mut ents = Vec::new();
    let mut r = p;
    while !r.is_empty() {
        if r.len() < RAW_ENTRY_FIXED - 8 {
            return Err(truncated());
        }
        let index = u64::from_be_bytes(r[..8].try_into().expect("8 bytes"));
        let term = u64::from_be_bytes(r[8..16].try_into().expect("8 bytes"));
        let entry_type = EntryType::from_i32(i32::from(r[16]))
            .ok_or_else(|| corrupt(&format!("unknown entry type {}", r[16])))?;
        r = &r[17..];
        let mut parts = [Vec::new(), Vec::new()];
        for part in &mut parts {
            if r.len() < 4 {
                return Err(truncated());
            }
            let n = u32::from_be_bytes(r[..4].try_into().expect("4 bytes")) as usize;
            if r.len() - 4 < n {
                return Err(truncated());
            }
            *part = r[4..4 + n].to_vec();
            r = &r[4 + n..];
        }
        let [data, context] = parts;
        ents.push(Entry {
            entry_type,
            term,
            index,
            data: data.into(),
            context: context.into(),
            ..Entry::default()
        });
    }
    Ok(ents)
}

/// Appends one entries record to `buf` in the protobuf layout (the one
/// WALs written before [`KIND_ENTRIES_RAW`] hold): each entry as its length
/// (u32, big endian) and its protobuf bytes, encoded in place.
pub(super) fn push_pb_entries_record(buf: &mut Vec<u8>, ents: &[Entry]) {
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

pub(super) fn pb_bytes<M: protobuf::Message>(m: &M) -> Vec<u8> {
    m.write_to_bytes().expect("raft messages always encode")
}

/// True when each entry's index is one more than the previous one's and its
/// term is not lower.
fn contiguous(ents: &[Entry]) -> bool {
    ents.windows(2)
        .all(|w| w[1].index == w[0].index + 1 && w[1].term >= w[0].term)
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
            debug_assert!(!body.is_empty() && pos + 8 + len <= bytes.len());
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
            staged_sync: false,
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
        // Recovery appends each record's entries as one run: raft hands
        // them over contiguous, each term at least the one before.
        debug_assert!(
            contiguous(ents),
            "entries staged for the WAL are contiguous with monotonic terms"
        );
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
        let sync = sync || self.must_sync || self.staged_sync;
        if self.staged.is_empty() {
            return Ok(());
        }
        self.disk.append(&self.staged, sync)?;
        self.log_bytes += self.staged.len() as u64;
        self.staged.clear();
        self.must_sync = false;
        self.staged_sync = false;
        Ok(())
    }

    /// Closes one batch of staged records (one raft Ready) without writing
    /// it: the turn's batches go to the disk together, with one write, at
    /// [`Wal::write`]. `sync` (or a staged record that needs one) owes an
    /// fsync, as [`Wal::write`] would.
    pub fn end_batch(&mut self, sync: bool) {
        let sync = sync || self.must_sync;
        self.staged_sync |= sync;
        self.sync_owed |= sync;
        self.must_sync = false;
    }

    /// Writes everything staged with one write and no fsync; records that
    /// need one (or `sync`) leave a sync owed for [`Wal::sync`].
    ///
    /// Records that need no fsync (a commit index or a hard state whose
    /// commit alone moved: it may lag) are left staged while nothing else
    /// is: they ride the next write that must happen, instead of costing a
    /// write of their own. While an fsync started by [`Wal::start_sync`]
    /// runs, nothing is written either: it would not cover the records,
    /// and the next one writes them first, so each fsync costs one write.
    pub fn write(&mut self, sync: bool) -> io::Result<()> {
        self.end_batch(sync);
        if self.staged.is_empty() || !self.staged_sync || self.syncing {
            return Ok(());
        }
        self.write_staged()
    }

    fn write_staged(&mut self) -> io::Result<()> {
        if self.staged.is_empty() {
            return Ok(());
        }
        self.disk.append(&self.staged, false)?;
        self.log_bytes += self.staged.len() as u64;
        self.staged.clear();
        self.staged_sync = false;
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
            self.write_staged()?;
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
        // What the sync covers is on the disk first.
        self.write_staged()?;
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
        self.staged_sync = false;
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
            // Every length prefix was checked against what is left: the
            // payload decodes exactly, with nothing read past it.
            debug_assert_eq!(pos, p.len(), "an entries record decodes to its end");
            store.append(&ents).map_err(corrupt)?;
        }
        KIND_ENTRIES_RAW => store.append(&parse_raw_entries(p)?).map_err(corrupt)?,
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

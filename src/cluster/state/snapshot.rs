//! The state machine's snapshot: its canonical byte form, the bound on
//! its size, and restoring a table from it.

use std::collections::{BTreeMap, BTreeSet};

use super::{DedupRec, ReqTag, StateMachine, NO_CONN};
use crate::cluster::command::{DecodeError, ReadFields, Rid, Writer, MAX_COMMAND_KEY_BYTES};
use crate::cluster::members::Members;
use crate::codec::ByteReader;
use crate::engine::{Engine, ImageError, Outbox, TagCodec};
use crate::limits::EngineLimits;

/// Writes [`ReqTag`]s in the snapshot layout of `version`: a grant as its
/// lease, lease generation (version 3) and request id (version 2), a
/// waiter as its request id and origin connection.
pub(super) struct ReqCodec {
    pub(super) version: u8,
}

fn rid_of(r: &mut ByteReader<'_>) -> Result<Rid, ImageError> {
    Ok(Rid {
        node: r.u64()?,
        epoch: r.u64()?,
        seq: r.u64()?,
    })
}

fn put_rid(buf: &mut Vec<u8>, rid: Rid) {
    for x in [rid.node, rid.epoch, rid.seq] {
        buf.extend_from_slice(&x.to_be_bytes());
    }
}

impl TagCodec<ReqTag> for ReqCodec {
    fn write_grant(&self, tag: &ReqTag, buf: &mut Vec<u8>) {
        debug_assert!(
            self.version >= SNAPSHOT_VERSION_WITHOUT_PERMITS,
            "only the current layouts are written"
        );
        buf.push(tag.lease_s);
        buf.extend_from_slice(&tag.generation.to_be_bytes());
        put_rid(buf, tag.rid);
    }

    fn write_waiter(&self, tag: &ReqTag, buf: &mut Vec<u8>) {
        put_rid(buf, tag.rid);
        buf.extend_from_slice(&tag.conn.to_be_bytes());
    }

    fn read_grant(&self, r: &mut ByteReader<'_>) -> Result<ReqTag, ImageError> {
        let lease_s = r.u8()?;
        let generation = if self.version >= 3 { r.u64()? } else { 0 };
        let rid = if self.version >= 2 {
            rid_of(r)?
        } else {
            Rid::default()
        };
        if lease_s == 0 {
            return Err(ImageError::Invalid("holder"));
        }
        Ok(ReqTag {
            rid,
            conn: 0,
            lease_s,
            generation,
        })
    }

    fn read_waiter(&self, r: &mut ByteReader<'_>) -> Result<ReqTag, ImageError> {
        Ok(ReqTag {
            rid: rid_of(r)?,
            conn: r.u64()?,
            // Set from the waiter's own lease once it is read.
            lease_s: 0,
            generation: 0,
        })
    }

    fn min_grant_bytes(&self) -> usize {
        1
    }

    fn min_waiter_bytes(&self) -> usize {
        24 + 8
    }

    fn holders(&self) -> bool {
        self.version >= 5
    }

    fn permits(&self) -> bool {
        self.version >= 6
    }
}

impl From<ImageError> for DecodeError {
    fn from(e: ImageError) -> Self {
        match e {
            ImageError::Truncated => DecodeError::Truncated,
            ImageError::BadKey => DecodeError::BadKey,
            ImageError::Invalid(what) => DecodeError::Invalid(what),
        }
    }
}

/// Version 2 added each holder's request id, version 3 each grant's lease
/// generation, version 4 the members (peer addresses and removed ids,
/// [`Members`]), version 5 each grant's and waiter's holder number
/// ([`Caller::holder`], in the engine's image), version 6 the keys
/// registered with a limit (protocol 1.2, PROTOCOL §6: their grants and
/// their waiters with their modes, in the engine's image); versions 1 to 5
/// are still read (generation 0, no members, holder 0: the token alone
/// decides; no permit key).
///
/// [`Caller::holder`]: crate::engine::Caller::holder
const SNAPSHOT_VERSION: u8 = 6;

/// The version a table without permit keys is written in: the layout
/// before [`SNAPSHOT_VERSION`] holds it whole, so its bytes stay those of
/// the release before protocol 1.2, which can still install them, until
/// a key is registered with a limit.
const SNAPSHOT_VERSION_WITHOUT_PERMITS: u8 = 5;

/// The room [`StateMachine::snapshot_bound`] leaves for the request ledger
/// and the connection map (and a raft message's own fields around it).
pub const SNAPSHOT_LEDGER_SLACK_BYTES: u64 = 64 << 20;

impl StateMachine {
    /// An upper bound on the length of [`StateMachine::snapshot`] for a
    /// table within `limits` whose keys are at most `max_key_bytes` long:
    /// every key registered with the longest key, every waiter queued, and
    /// [`SNAPSHOT_LEDGER_SLACK_BYTES`] for the request ledger and the
    /// connection map. Those two hold a few entries per node and per client
    /// connection with requests in flight; the limits do not bound them,
    /// but the slack covers two million connections or eight million
    /// request ids.
    ///
    /// A key registered with a limit (PROTOCOL §6) writes its limit and
    /// counts, and each grant and waiter its mode: a key of one grant
    /// takes up to 7 bytes more than a mutex's, a key of more grants less
    /// than their mutexes would (each grant takes one of `max_keys`), and
    /// a waiter 1 byte more. That extra (at most `7 × max_keys +
    /// max_waiters + 4` bytes, under 8 MiB at the default limits) comes
    /// out of the slack, so that the bound of a table of mutexes stays
    /// tight.
    #[must_use]
    pub fn snapshot_bound(limits: &EngineLimits, max_key_bytes: usize) -> u64 {
        // Header: version, next token, next engine connection and the
        // three counts.
        const HEADER: u64 = 1 + 8 + 8 + 4 + 4 + 4;
        // Key length prefix, token, holder number, lease, generation,
        // holder's request id, waiter count.
        const PER_KEY: u64 = 4 + 8 + 8 + 1 + 8 + 24 + 4;
        // Request id, connection, holder number, owner, wait, lease.
        const PER_WAITER: u64 = 24 + 8 + 8 + 8 + 1 + 1;
        let key = PER_KEY.saturating_add(max_key_bytes as u64);
        HEADER
            .saturating_add((limits.max_keys as u64).saturating_mul(key))
            .saturating_add((limits.max_waiters as u64).saturating_mul(PER_WAITER))
            .saturating_add(SNAPSHOT_LEDGER_SLACK_BYTES)
    }

    /// Checks that a node whose allocations hold at most `max_alloc` bytes
    /// ([`crate::limits::MAX_ALLOC_BYTES`] for this build) can make the
    /// snapshot of the fullest table `limits` allow: the snapshot is one
    /// buffer grown by doubling, so its bound must be within half of one
    /// allocation. Only a 32-bit build meets this (at 1,024 MiB, below the
    /// 1,100 MiB of the default limits); it must refuse such limits at
    /// start-up rather than fail when the table fills. Returns the bound.
    ///
    /// # Errors
    /// A message naming the flags and the largest `--max-keys` that fits.
    pub fn check_snapshot_fits(
        limits: &EngineLimits,
        max_key_bytes: usize,
        max_alloc: u64,
    ) -> Result<u64, crate::config::ConfigError> {
        let bound = Self::snapshot_bound(limits, max_key_bytes);
        let room = max_alloc / 2;
        if bound <= room {
            return Ok(bound);
        }
        // Largest key count whose bound fits, the rest kept as given.
        let with_keys = |max_keys| {
            let l = EngineLimits {
                max_keys,
                ..limits.clone()
            };
            Self::snapshot_bound(&l, max_key_bytes)
        };
        let without_keys = with_keys(0);
        let one_key = with_keys(1) - without_keys;
        let hint = match room.checked_sub(without_keys) {
            Some(left) if left >= one_key => format!("--max-keys {} or less", left / one_key),
            _ => "a smaller --max-waiters".to_owned(),
        };
        Err(crate::config::ConfigError::Invalid(format!(
            "--max-keys {}, --max-key-bytes {max_key_bytes} and --max-waiters {} allow a lock \
             table whose snapshot (up to {} MiB) is more than this {}-bit build can hold in \
             memory at once ({} MiB); use {hint}",
            limits.max_keys,
            limits.max_waiters,
            bound.div_ceil(1 << 20),
            usize::BITS,
            room >> 20,
        )))
    }

    /// The table in a canonical byte form: equal states give equal bytes.
    /// The lock table is the engine's image ([`Engine::write_image`]); the
    /// request ledger and the connection map follow it. A table with a
    /// key registered with a limit is written in version 6, one without
    /// in version 5.
    #[must_use]
    pub fn snapshot(&self) -> Vec<u8> {
        let version = if self.engine.permit_key_count() == 0 {
            SNAPSHOT_VERSION_WITHOUT_PERMITS
        } else {
            SNAPSHOT_VERSION
        };
        let mut w = Writer::default();
        w.u8(version);
        w.u64(self.engine.next_token());
        w.u64(self.next_engine_conn);
        let codec = ReqCodec { version };
        self.engine.write_image(&codec, &mut w.buf);
        w.u32(len32(self.dedup.len()));
        for (node, d) in &self.dedup {
            w.u64(*node);
            w.u64(d.epoch);
            w.u64(d.floor);
            w.u32(len32(d.seen.len()));
            for s in &d.seen {
                w.u64(*s);
            }
        }
        w.u32(len32(self.conns.len()));
        for (origin, c) in &self.conns {
            w.origin(*origin);
            w.u64(*c);
        }
        self.members.encode(&mut w);
        w.buf
    }

    /// Rebuilds a table from [`StateMachine::snapshot`] bytes (versions 1
    /// to 6): the engine restores its image ([`Engine::restore`]), each
    /// waiter on the engine connection the connection map names.
    pub fn restore(limits: EngineLimits, bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = ByteReader::new(bytes);
        let version = r.u8()?;
        if !(1..=SNAPSHOT_VERSION).contains(&version) {
            return Err(DecodeError::BadTag(version));
        }
        let next_token = r.u64()?;
        let next_engine_conn = r.u64()?;
        let codec = ReqCodec { version };
        let mut image = Engine::read_image(&mut r, &codec, MAX_COMMAND_KEY_BYTES)?;
        if version == SNAPSHOT_VERSION && image.permits.is_empty() {
            // A table without permit keys has one encoding only: version 5.
            return Err(DecodeError::Invalid("version 6 without permit keys"));
        }
        let mutex_queues = image.keys.iter_mut().map(|k| &mut k.waiters);
        let permit_queues = image.permits.iter_mut().map(|k| &mut k.waiters);
        for w in mutex_queues.chain(permit_queues).flatten() {
            w.tag.lease_s = w.lease_s;
        }
        let mut dedup = BTreeMap::new();
        let n = r.count(8 + 8 + 8 + 4)?;
        for _ in 0..n {
            let node = r.u64()?;
            let epoch = r.u64()?;
            let floor = r.u64()?;
            let ns = r.count(8)?;
            let mut seen = BTreeSet::new();
            for _ in 0..ns {
                seen.insert(r.u64()?);
            }
            dedup.insert(node, DedupRec { epoch, floor, seen });
        }
        let mut conns = BTreeMap::new();
        let mut used = BTreeSet::new();
        let n = r.count(24 + 8)?;
        for _ in 0..n {
            let origin = r.origin()?;
            let engine_conn = r.u64()?;
            if engine_conn == NO_CONN
                || engine_conn >= next_engine_conn
                || !used.insert(engine_conn)
            {
                return Err(DecodeError::Invalid("connection id"));
            }
            conns.insert(origin, engine_conn);
        }
        let members = if version >= 4 {
            Members::decode(&mut r)?
        } else {
            Members::default()
        };
        r.finish()?;
        let engine = Engine::restore(limits, next_token, &image, |t| {
            conns.get(&t.rid.origin(t.conn)).copied()
        })?;
        if conns.values().any(|c| !engine.has_waiters(*c)) {
            return Err(DecodeError::Invalid("connection without waiters"));
        }
        Ok(StateMachine {
            engine,
            out: Outbox::default(),
            dedup,
            conns,
            next_engine_conn,
            members,
        })
    }
}

fn len32(n: usize) -> u32 {
    u32::try_from(n).expect("table sizes are bounded by the limits")
}

//! The replicated state machine: the lock engine in replicated mode and
//! the request dedup table.
//!
//! Every node applies the same committed commands in the same order and gets
//! the same state and the same answers. Applying reads only the state, the
//! entry index and the command: no clock, no randomness, no hash-order
//! iteration (the engine reports what happened in the order it happened,
//! and its snapshot image is sorted by key).
//!
//! The [`Engine`] is the one lock table and decides every answer (PROTOCOL §2).
//! Each grant and waiter carries a [`ReqTag`] (the request, its origin
//! connection, the lease and its generation); applying a command turns the
//! engine's typed events ([`crate::engine::Event`]) into answers for the
//! requests' origins and effects for the leader's timers. A snapshot is
//! the engine's image ([`Engine::write_image`]) with the request ledger and
//! the map of origin connections that have waiters; a new leader rebuilds
//! its timers from [`StateMachine::holders`] and [`StateMachine::waiters`].
//!
//! Fencing tokens are entry indices with random low bits: before applying
//! entry `i` the engine's next token is raised to `(i << 16) | r`, where `r`
//! is 16 random bits the proposing node drew from the OS generator and put
//! in the entry ([`Command::encode_entry`], [`crate::token`]), and one entry
//! grants at most one key, so the token of a grant is made of the index of
//! the entry that granted it. Indices never repeat, so tokens increase
//! across leader changes, snapshots and restarts; every node applies the
//! same bits, so they agree on every token. An entry written before tokens
//! had random bits grants the bare index, below every later entry's token.

use std::collections::{BTreeMap, BTreeSet};

use crate::cluster::command::{
    Command, DecodeError, Origin, Reader, Rid, Writer, MAX_COMMAND_KEY_BYTES,
};
use crate::cluster::members::Members;
use crate::engine::{
    Acquire, AcquireOutcome, Caller, ConnId, Engine, Event, ImageError, ImageReader, Outbox,
    TagCodec,
};
use crate::limits::EngineLimits;
use crate::proto::Reply;
use crate::time::Millis;
use crate::token;

/// The kind of an answer to a client request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerKind {
    /// Acquired, with the token.
    Acquired(u64),
    /// Timeout.
    Timeout,
    /// Busy.
    Busy,
    /// Released, with the token.
    Released(u64),
    /// NotReleased, with the token.
    NotReleased(u64),
    /// Extended, with the token.
    Extended(u64),
    /// NotExtended, with the token.
    NotExtended(u64),
}

/// One answer produced by applying a command, for the request `rid`. Only the
/// origin node (`rid.node`, in boot epoch `rid.epoch`) delivers it, to `conn`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The request answered.
    pub rid: Rid,
    /// The client connection on the origin node.
    pub conn: u64,
    /// The acquire's owner (0 for releases and extends).
    pub owner: u64,
    /// The lock name, in the [`Applied`] it came with.
    pub key: KeyAt,
    /// What the answer says.
    pub kind: AnswerKind,
}

/// Where the key of an [`Answer`] or an [`Effect`] lies in its
/// [`Applied`]: the keys of one entry's answers and effects share one
/// buffer, kept from entry to entry, instead of a `String` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyAt {
    start: usize,
    end: usize,
}

impl Applied {
    /// The key at `at`.
    #[must_use]
    pub fn key(&self, at: KeyAt) -> &str {
        &self.keys[at.start..at.end]
    }

    /// The wire reply of answer `a`.
    #[must_use]
    pub fn reply(&self, a: &Answer) -> Reply<'_> {
        let key = self.key(a.key);
        let owner = a.owner;
        match a.kind {
            AnswerKind::Acquired(token) => Reply::Acquired { token, owner, key },
            AnswerKind::Timeout => Reply::Timeout { owner, key },
            AnswerKind::Busy => Reply::Busy { owner, key },
            AnswerKind::Released(token) => Reply::Released { token, key },
            AnswerKind::NotReleased(token) => Reply::NotReleased { token, key },
            AnswerKind::Extended(token) => Reply::Extended { token, key },
            AnswerKind::NotExtended(token) => Reply::NotExtended { token, key },
        }
    }
}

/// What applying one entry did, beyond answers: the leader schedules timers
/// from these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// `key` was granted with `token` for `lease_s` seconds.
    Granted {
        /// The lock name, in the [`Applied`] it came with.
        key: KeyAt,
        /// The new token.
        token: u64,
        /// The lease.
        lease_s: u8,
    },
    /// The grant `token` of `key` was extended: it is now in lease
    /// generation `generation`, for `lease_s` seconds from this apply.
    Extended {
        /// The lock name, in the [`Applied`] it came with.
        key: KeyAt,
        /// The grant's token (unchanged).
        token: u64,
        /// Its new lease generation.
        generation: u64,
        /// The new lease.
        lease_s: u8,
    },
    /// An acquire queued on `key` for at most `wait_s` seconds.
    Queued {
        /// The lock name, in the [`Applied`] it came with.
        key: KeyAt,
        /// The queued request.
        waiter: Rid,
        /// Its wait.
        wait_s: u8,
    },
}

/// The result of applying one entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Answers to deliver at the requests' origins.
    pub answers: Vec<Answer>,
    /// Grants and queued acquires, for the leader's timers.
    pub effects: Vec<Effect>,
    /// The command was a client request already applied (or forgotten):
    /// it changed nothing.
    pub duplicate: bool,
    /// The answers' and effects' keys, one after the other.
    keys: String,
}

impl Applied {
    /// Empties it for the next entry, keeping its buffers.
    pub fn clear(&mut self) {
        self.answers.clear();
        self.effects.clear();
        self.duplicate = false;
        self.keys.clear();
    }

    fn push_key(&mut self, key: &str) -> KeyAt {
        let start = self.keys.len();
        self.keys.push_str(key);
        KeyAt {
            start,
            end: self.keys.len(),
        }
    }
}

/// What the engine carries for each grant and queued acquire in cluster
/// mode: the request, its origin connection, and the lease and its
/// generation (a waiter's become its grant's when it is handed the key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReqTag {
    /// The request. All zero for a grant whose request is unknown (one
    /// restored from a version-1 snapshot).
    rid: Rid,
    /// Its client connection on the origin node.
    conn: u64,
    /// The latest lease: the grant's own, or its latest extension's.
    lease_s: u8,
    /// Extensions that took effect on this grant (PROTOCOL §5.2): an `Expire`
    /// set for an earlier generation does nothing.
    generation: u64,
}

/// Writes [`ReqTag`]s in the snapshot layout of `version`: a grant as its
/// lease, lease generation (version 3) and request id (version 2), a
/// waiter as its request id and origin connection.
struct ReqCodec {
    version: u8,
}

fn rid_of(r: &mut ImageReader<'_>) -> Result<Rid, ImageError> {
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
        debug_assert_eq!(
            self.version, SNAPSHOT_VERSION,
            "only the current layout is written"
        );
        buf.push(tag.lease_s);
        buf.extend_from_slice(&tag.generation.to_be_bytes());
        put_rid(buf, tag.rid);
    }

    fn write_waiter(&self, tag: &ReqTag, buf: &mut Vec<u8>) {
        put_rid(buf, tag.rid);
        buf.extend_from_slice(&tag.conn.to_be_bytes());
    }

    fn read_grant(&self, r: &mut ImageReader<'_>) -> Result<ReqTag, ImageError> {
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

    fn read_waiter(&self, r: &mut ImageReader<'_>) -> Result<ReqTag, ImageError> {
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

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct DedupRec {
    epoch: u64,
    floor: u64,
    seen: BTreeSet<u64>,
}

/// The engine connection id used for holders and immediate answers; never
/// allocated to an origin.
const NO_CONN: u64 = 0;

/// Version 2 added each holder's request id, version 3 each grant's lease
/// generation, version 4 the members (peer addresses and removed ids,
/// [`Members`]), version 5 each grant's and waiter's holder number
/// ([`Caller::holder`], in the engine's image); versions 1 to 4 are still
/// read (generation 0, no members, holder 0: the token alone decides).
const SNAPSHOT_VERSION: u8 = 5;

/// The room [`StateMachine::snapshot_bound`] leaves for the request ledger
/// and the connection map (and a raft message's own fields around it).
pub const SNAPSHOT_LEDGER_SLACK_BYTES: u64 = 64 << 20;

/// The replicated lock table. See the module documentation.
#[derive(Debug)]
pub struct StateMachine {
    engine: Engine<ReqTag>,
    out: Outbox<ReqTag>,
    dedup: BTreeMap<u64, DedupRec>,
    /// The engine connection of each origin connection that has waiters.
    conns: BTreeMap<Origin, u64>,
    next_engine_conn: u64,
    members: Members,
}

impl StateMachine {
    /// An empty table enforcing `limits`. Every node of a cluster must use
    /// the same limits, because they decide answers.
    #[must_use]
    pub fn new(limits: EngineLimits) -> Self {
        StateMachine {
            engine: Engine::replicated_tagged(limits, 1),
            out: Outbox::default(),
            dedup: BTreeMap::new(),
            conns: BTreeMap::new(),
            next_engine_conn: NO_CONN + 1,
            members: Members::default(),
        }
    }

    /// The cluster's members: peer addresses and removed ids.
    #[must_use]
    pub fn members(&self) -> &Members {
        &self.members
    }

    /// The members, to apply a conf change or fill in addresses.
    pub fn members_mut(&mut self) -> &mut Members {
        &mut self.members
    }

    /// The token the next grant would carry (at least).
    #[must_use]
    pub fn next_token(&self) -> u64 {
        self.engine.next_token()
    }

    /// The token currently held on `key`.
    #[must_use]
    pub fn holder(&self, key: &str) -> Option<u64> {
        self.engine.grant(key).map(|(token, _)| token)
    }

    /// The grant currently held on `key` as (token, lease generation).
    #[must_use]
    pub fn lease_of(&self, key: &str) -> Option<(u64, u64)> {
        self.engine
            .grant(key)
            .map(|(token, tag)| (token, tag.generation))
    }

    /// The token of `key` when it is held by the grant of request `rid`.
    /// A request whose granting entry this node never applied itself (it
    /// came inside a snapshot) can still be answered with it.
    #[must_use]
    pub fn granted_to(&self, key: &str, rid: Rid) -> Option<u64> {
        self.engine
            .grant(key)
            .filter(|(_, tag)| tag.rid == rid)
            .map(|(token, _)| token)
    }

    /// True when request `rid` has applied, or can no longer apply (below
    /// its origin's floor, or from an older boot of its origin).
    #[must_use]
    pub fn has_applied(&self, rid: Rid) -> bool {
        self.dedup.get(&rid.node).is_some_and(|d| {
            rid.epoch < d.epoch
                || (rid.epoch == d.epoch && (rid.seq < d.floor || d.seen.contains(&rid.seq)))
        })
    }

    /// True when `waiter` is queued on `key`.
    #[must_use]
    pub fn is_waiting(&self, key: &str, waiter: Rid) -> bool {
        self.engine.find_waiter(key, |t| t.rid == waiter).is_some()
    }

    /// The lock engine (replicated mode), for inspection.
    #[must_use]
    pub fn engine(&self) -> &Engine<ReqTag> {
        &self.engine
    }

    /// Number of held keys.
    #[must_use]
    pub fn key_count(&self) -> usize {
        self.engine.key_count()
    }

    /// Every holder as (key, token, latest lease_s, lease generation),
    /// sorted by key.
    pub fn holders(&self) -> impl Iterator<Item = (&str, u64, u8, u64)> + '_ {
        self.engine.sorted_keys().into_iter().filter_map(|k| {
            let (token, tag) = self.engine.grant(k)?;
            Some((k, token, tag.lease_s, tag.generation))
        })
    }

    /// Every waiter as (key, rid, wait_s), sorted by key then queue order.
    pub fn waiters(&self) -> impl Iterator<Item = (&str, Rid, u8)> + '_ {
        self.engine
            .sorted_queued_keys()
            .into_iter()
            .flat_map(move |k| self.engine.queue(k).map(move |w| (k, w.tag.rid, w.wait_s)))
    }

    /// Applies the committed entry `index` holding `cmd`, written before
    /// tokens had random bits: a grant's token is the bare index.
    pub fn apply(&mut self, index: u64, cmd: &Command) -> Applied {
        self.apply_entry(index, None, cmd)
    }

    /// Applies the committed entry `index` holding `cmd` and its proposer's
    /// random token bits: a grant's token is `(index << 16) | bits`
    /// ([`token::for_entry`]), or the bare index without bits (an entry
    /// written before tokens had them; such entries all come first).
    pub fn apply_entry(&mut self, index: u64, bits: Option<u16>, cmd: &Command) -> Applied {
        self.apply_entry_as(index, bits, Caller::default(), cmd)
    }

    /// [`StateMachine::apply_entry`] of a client request sent by `caller`
    /// (the entry's caller prefix, [`Command::decode_entry`]): a grant
    /// records its holder number, and a release or extend of a grant it
    /// may not act on ([`Caller::may_act_on`]) is answered N or X.
    pub fn apply_entry_as(
        &mut self,
        index: u64,
        bits: Option<u16>,
        caller: Caller,
        cmd: &Command,
    ) -> Applied {
        let mut res = Applied::default();
        self.apply_entry_into(index, bits, caller, cmd, &mut res);
        res
    }

    /// [`StateMachine::apply_entry_as`] into `res` (cleared first), whose
    /// buffers the caller keeps from entry to entry.
    pub fn apply_entry_into(
        &mut self,
        index: u64,
        bits: Option<u16>,
        caller: Caller,
        cmd: &Command,
        res: &mut Applied,
    ) {
        res.clear();
        let floor = match bits {
            None => index,
            // Past 2^48 entries (never reached) the tokens go on by one.
            Some(b) => token::for_entry(index, b).unwrap_or(index),
        };
        self.engine.raise_next_token(floor);
        if !self.admit(cmd) {
            res.duplicate = true;
            return;
        }
        let now = Millis::ZERO;
        let out = &mut self.out;
        // Only a client request has a caller other than the default
        // (`Command::decode_entry`); the engine forgets it after this
        // command.
        self.engine.set_caller(caller);
        match cmd {
            Command::Acquire { .. } => self.apply_acquire(cmd, res),
            Command::Release { key, token, .. } => {
                self.engine.release(now, NO_CONN, *token, key, out);
            }
            Command::Extend {
                key,
                token,
                lease_s,
                ..
            } => {
                self.engine.extend(now, NO_CONN, key, *token, *lease_s, out);
            }
            Command::Expire {
                key,
                token,
                generation,
            } => {
                // An Extend applied after this timer was set moved the
                // grant to a later generation: the lease did not end.
                let current = self.engine.grant(key).map(|(t, tag)| (t, tag.generation));
                if current == Some((*token, *generation)) {
                    self.engine.expire(now, key, *token, out);
                }
            }
            Command::WaitTimeout { key, waiter } => {
                if let Some(id) = self.engine.find_waiter(key, |t| t.rid == *waiter) {
                    self.engine.wait_timeout(now, key, id, out);
                }
            }
            Command::CancelWaiters { origin } => self.cancel(*origin),
        }
        self.engine.set_caller(Caller::default());
        let (rid, conn) = match cmd {
            Command::Release { rid, conn, .. } | Command::Extend { rid, conn, .. } => (*rid, *conn),
            _ => (Rid::default(), 0),
        };
        self.take_events(rid, conn, res);
    }

    /// True when `cmd` is not a client request this table applied (or
    /// forgot) already. A request from a later boot of its origin first
    /// cancels the queued acquires of the earlier boots' connections, which
    /// are gone, rather than letting their waits run out.
    fn admit(&mut self, cmd: &Command) -> bool {
        let Some(rid) = cmd.rid() else {
            return true;
        };
        let floor = match cmd {
            Command::Acquire { floor, .. }
            | Command::Release { floor, .. }
            | Command::Extend { floor, .. } => *floor,
            _ => 0,
        };
        if !self.first_time(rid, floor) {
            return false;
        }
        let stale: Vec<Origin> = self
            .conns
            .keys()
            .filter(|o| o.node == rid.node && o.epoch < rid.epoch)
            .copied()
            .collect();
        for o in stale {
            self.cancel(o);
        }
        true
    }

    /// Applies an acquire; if it queued, adds the effect that says so (the
    /// leader's wait timer) to `res`.
    fn apply_acquire(&mut self, cmd: &Command, res: &mut Applied) {
        let Command::Acquire {
            rid,
            conn,
            key,
            owner,
            wait_s,
            lease_s,
            ..
        } = cmd
        else {
            return;
        };
        let origin = rid.origin(*conn);
        let engine_conn = self
            .conns
            .get(&origin)
            .copied()
            .unwrap_or(self.next_engine_conn);
        let tag = ReqTag {
            rid: *rid,
            conn: *conn,
            lease_s: *lease_s,
            generation: 0,
        };
        let req = Acquire {
            key,
            owner: *owner,
            wait_s: *wait_s,
            lease_s: *lease_s,
        };
        if let AcquireOutcome::Queued(_) =
            self.engine
                .acquire_tagged(Millis::ZERO, engine_conn, req, tag, &mut self.out)
        {
            if engine_conn == self.next_engine_conn {
                self.next_engine_conn += 1;
                self.conns.insert(origin, engine_conn);
            }
            let key = res.push_key(key);
            res.effects.push(Effect::Queued {
                key,
                waiter: *rid,
                wait_s: *wait_s,
            });
        }
    }

    /// Turns what the engine reported for one command into answers and
    /// effects, and forgets the origin connections left without waiters.
    /// A release's or an extend's own answer goes to `rid` on `conn`;
    /// every other answer goes to the request its event's tag names.
    // Long because it is one match over the kinds of event the engine reports.
    fn take_events(&mut self, rid: Rid, conn: u64, res: &mut Applied) {
        for ev in self.out.events() {
            let (tag, kind, key) = match ev {
                Event::Granted {
                    key,
                    token,
                    lease_s,
                    tag,
                    ..
                } => {
                    let at = res.push_key(key);
                    res.effects.push(Effect::Granted {
                        key: at,
                        token,
                        lease_s,
                    });
                    (tag, AnswerKind::Acquired(token), key)
                }
                Event::TimedOut { key, tag, .. } => (tag, AnswerKind::Timeout, key),
                Event::Busy { key, tag, .. } => (tag, AnswerKind::Busy, key),
                Event::Released { key, token, .. } => (
                    Self::answer_tag(rid, conn),
                    AnswerKind::Released(token),
                    key,
                ),
                Event::NotReleased { key, token, .. } => (
                    Self::answer_tag(rid, conn),
                    AnswerKind::NotReleased(token),
                    key,
                ),
                Event::Extended {
                    key,
                    token,
                    lease_s,
                    ..
                } => {
                    let at = res.push_key(key);
                    res.effects
                        .push(new_generation(&mut self.engine, key, at, token, lease_s));
                    (
                        Self::answer_tag(rid, conn),
                        AnswerKind::Extended(token),
                        key,
                    )
                }
                Event::NotExtended { key, token, .. } => (
                    Self::answer_tag(rid, conn),
                    AnswerKind::NotExtended(token),
                    key,
                ),
                Event::Expired { .. } => continue,
            };
            let owner = match ev {
                Event::Granted { owner, .. }
                | Event::TimedOut { owner, .. }
                | Event::Busy { owner, .. } => owner,
                _ => 0,
            };
            // A grant's key is in already, for its effect.
            let at = match res.effects.last() {
                Some(Effect::Granted { key: at, .. } | Effect::Extended { key: at, .. })
                    if matches!(kind, AnswerKind::Acquired(_) | AnswerKind::Extended(_))
                        && res.key(*at) == key =>
                {
                    *at
                }
                _ => res.push_key(key),
            };
            res.answers.push(Answer {
                rid: tag.rid,
                conn: tag.conn,
                owner,
                key: at,
                kind,
            });
            // A waiter granted or timed out may have been its
            // connection's last.
            if let Event::Granted { conn, .. } | Event::TimedOut { conn, .. } = ev {
                forget_if_idle(
                    &mut self.conns,
                    &self.engine,
                    tag.rid.origin(tag.conn),
                    conn,
                );
            }
        }
        self.out.clear();
    }

    fn answer_tag(rid: Rid, conn: u64) -> ReqTag {
        ReqTag {
            rid,
            conn,
            ..ReqTag::default()
        }
    }

    /// Records `rid` as applied; false when it was applied before, is below
    /// its origin's floor, or comes from an older boot of its origin.
    fn first_time(&mut self, rid: Rid, floor: u64) -> bool {
        let rec = self.dedup.entry(rid.node).or_default();
        if rid.epoch < rec.epoch {
            return false;
        }
        if rid.epoch > rec.epoch {
            *rec = DedupRec {
                epoch: rid.epoch,
                floor: 0,
                seen: BTreeSet::new(),
            };
        }
        if rid.seq < rec.floor || !rec.seen.insert(rid.seq) {
            return false;
        }
        if floor > rec.floor {
            rec.floor = floor;
            rec.seen = rec.seen.split_off(&floor);
        }
        true
    }

    fn cancel(&mut self, origin: Origin) {
        if let Some(c) = self.conns.remove(&origin) {
            self.engine.disconnect(Millis::ZERO, c, &mut self.out);
            self.out.clear();
        }
    }

    /// An upper bound on the length of [`StateMachine::snapshot`] for a
    /// table within `limits` whose keys are at most `max_key_bytes` long:
    /// every key registered with the longest key, every waiter queued, and
    /// [`SNAPSHOT_LEDGER_SLACK_BYTES`] for the request ledger and the
    /// connection map. Those two hold a few entries per node and per client
    /// connection with requests in flight; the limits do not bound them,
    /// but the slack covers two million connections or eight million
    /// request ids.
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
    /// request ledger and the connection map follow it.
    #[must_use]
    pub fn snapshot(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u8(SNAPSHOT_VERSION);
        w.u64(self.engine.next_token());
        w.u64(self.next_engine_conn);
        let codec = ReqCodec {
            version: SNAPSHOT_VERSION,
        };
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
    /// to 5): the engine restores its image ([`Engine::restore`]), each
    /// waiter on the engine connection the connection map names.
    pub fn restore(limits: EngineLimits, bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes);
        let version = r.u8()?;
        if !(1..=SNAPSHOT_VERSION).contains(&version) {
            return Err(DecodeError::BadTag(version));
        }
        let next_token = r.u64()?;
        let next_engine_conn = r.u64()?;
        let mut ir = ImageReader::new(r.rest());
        let codec = ReqCodec { version };
        let mut image = Engine::read_image(&mut ir, &codec, MAX_COMMAND_KEY_BYTES)?;
        for k in &mut image.keys {
            for w in &mut k.waiters {
                w.tag.lease_s = w.lease_s;
            }
        }
        let mut r = Reader::new(ir.rest());
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

    /// Panics unless the engine's invariants hold and the connection map
    /// names exactly the engine connections that have waiters, each
    /// waiter's origin mapped to its own. For tests; O(keys + waiters).
    pub fn check(&self) {
        self.engine.check_invariants();
        assert_eq!(
            self.engine.waiting_conn_count(),
            self.conns.len(),
            "connections with waiters"
        );
        for c in self.conns.values() {
            assert!(self.engine.has_waiters(*c), "mapped connection {c} idle");
        }
        for key in self.engine.sorted_queued_keys() {
            for w in self.engine.queue(key) {
                let origin = w.tag.rid.origin(w.tag.conn);
                assert_eq!(
                    self.conns.get(&origin),
                    Some(&w.conn),
                    "waiter on {key:?} of {origin:?}"
                );
                assert_eq!(w.tag.lease_s, w.lease_s, "waiter lease on {key:?}");
            }
        }
    }
}

fn len32(n: usize) -> u32 {
    u32::try_from(n).expect("table sizes are bounded by the limits")
}

/// An extend took effect: the grant of `key` starts a new lease
/// generation, which the leader's next timer for it names. (Free of
/// `self`: the caller is iterating over the outbox's events.)
fn new_generation(
    engine: &mut Engine<ReqTag>,
    key: &str,
    at: KeyAt,
    token: u64,
    lease_s: u8,
) -> Effect {
    let t = engine.grant_tag_mut(key).expect("an extended key is held");
    t.generation += 1;
    t.lease_s = lease_s;
    Effect::Extended {
        key: at,
        token,
        generation: t.generation,
        lease_s,
    }
}

/// Forgets the engine connection `conn` of `origin` once it has no waiter.
fn forget_if_idle(
    conns: &mut BTreeMap<Origin, ConnId>,
    engine: &Engine<ReqTag>,
    origin: Origin,
    conn: ConnId,
) {
    if conns.get(&origin) == Some(&conn) && !engine.has_waiters(conn) {
        conns.remove(&origin);
    }
}

#[cfg(test)]
mod bind_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn rid(node: u64, seq: u64) -> Rid {
        Rid {
            node,
            epoch: 1,
            seq,
        }
    }

    fn acq(r: Rid, conn: u64, key: &str, owner: u64, wait_s: u8) -> Command<'_> {
        Command::Acquire {
            rid: r,
            floor: 0,
            conn,
            key: key.into(),
            owner,
            wait_s,
            lease_s: 10,
        }
    }

    fn rel(r: Rid, key: &str, token: u64) -> Command<'_> {
        Command::Release {
            rid: r,
            floor: 0,
            conn: 1,
            key: key.into(),
            token,
        }
    }

    fn kinds(a: &Applied) -> Vec<(Rid, AnswerKind)> {
        a.answers.iter().map(|x| (x.rid, x.kind)).collect()
    }

    #[test]
    fn a_table_full_to_its_limits_snapshots_within_the_bound() {
        let limits = EngineLimits {
            max_keys: 40,
            max_waiters: 80,
            max_waiters_per_key: 2,
            ..EngineLimits::default()
        };
        let max_key_bytes = 300;
        let mut sm = StateMachine::new(limits.clone());
        let mut index = 0;
        let mut seq = 0;
        let mut next = |node: u64| {
            index += 1;
            seq += 1;
            (index, rid(node, seq))
        };
        // Every key registered with the longest key, every waiter queued,
        // each from its own client connection.
        for k in 0..limits.max_keys {
            let key = format!("{k:0>300}");
            let (i, r) = next(1);
            let granted = sm.apply(i, &acq(r, 1_000 + k as u64, &key, 1, 0));
            assert!(matches!(granted.answers[0].kind, AnswerKind::Acquired(_)));
            for w in 0..limits.max_waiters_per_key {
                let (i, r) = next(2);
                let conn = 10_000 + (k * 10 + w) as u64;
                assert!(sm.apply(i, &acq(r, conn, &key, 2, 9)).answers.is_empty());
            }
        }
        assert_eq!(sm.key_count(), limits.max_keys);
        assert_eq!(sm.engine.waiter_count(), limits.max_waiters);
        sm.check();
        let bytes = sm.snapshot().len() as u64;
        let bound = StateMachine::snapshot_bound(&limits, max_key_bytes);
        assert!(bytes <= bound, "{bytes} bytes over the bound {bound}");
        // Without its slack the bound is tight: the keys and waiters alone
        // fill it (the ledger and the connection map come on top).
        let table = bound - SNAPSHOT_LEDGER_SLACK_BYTES;
        assert!(bytes >= table, "{bytes} bytes, table bound {table}");
        // Restored, it gives the same bytes.
        let back = StateMachine::restore(limits, &sm.snapshot()).unwrap();
        assert_eq!(back.snapshot().len() as u64, bytes);
    }

    #[test]
    fn a_32_bit_build_refuses_limits_whose_snapshot_it_could_not_hold() {
        let defaults = EngineLimits::default();
        let key_bytes = crate::limits::DEFAULT_MAX_KEY_BYTES;
        let bound = StateMachine::snapshot_bound(&defaults, key_bytes);
        assert_eq!(bound.div_ceil(1 << 20), 1100);
        // 64-bit: the default table fits, and so does a much larger one.
        let wide = i64::MAX as u64;
        assert_eq!(
            StateMachine::check_snapshot_fits(&defaults, key_bytes, wide),
            Ok(bound)
        );
        let big = EngineLimits {
            max_keys: 100_000_000,
            ..defaults.clone()
        };
        assert!(StateMachine::check_snapshot_fits(&big, key_bytes, wide).is_ok());
        // 32-bit: the default table does not; the message names the flags
        // and the largest --max-keys that does, which is exact.
        let narrow = i32::MAX as u64;
        let err = StateMachine::check_snapshot_fits(&defaults, key_bytes, narrow)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--max-keys 1000000") && err.contains("1100 MiB"),
            "{err}"
        );
        assert!(err.contains(&format!("{}-bit", usize::BITS)), "{err}");
        let fit: usize = err
            .split("use --max-keys ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no --max-keys hint in {err}"));
        assert_eq!(fit, 926_579, "the figure docs/CLUSTER.md gives");
        let at = |max_keys| EngineLimits {
            max_keys,
            ..defaults.clone()
        };
        let ok = StateMachine::check_snapshot_fits(&at(fit), key_bytes, narrow).unwrap();
        assert!(ok <= narrow / 2);
        assert!(StateMachine::check_snapshot_fits(&at(fit + 1), key_bytes, narrow).is_err());
        // Waiters alone over the room: the hint says so.
        let waiters = EngineLimits {
            max_waiters: 30_000_000,
            ..defaults
        };
        let err = StateMachine::check_snapshot_fits(&waiters, key_bytes, narrow)
            .unwrap_err()
            .to_string();
        assert!(err.contains("a smaller --max-waiters"), "{err}");
    }

    #[test]
    fn answers_and_effects_name_their_keys_in_a_reused_applied() {
        let mut sm = StateMachine::new(EngineLimits::default());
        let mut res = Applied::default();
        let replies = |res: &Applied| -> Vec<String> {
            res.answers
                .iter()
                .map(|a| format!("{:?}", res.reply(a)))
                .collect()
        };
        let effects = |res: &Applied| -> Vec<(String, u64)> {
            res.effects
                .iter()
                .map(|e| match *e {
                    Effect::Granted { key, token, .. } | Effect::Extended { key, token, .. } => {
                        (res.key(key).to_owned(), token)
                    }
                    Effect::Queued { key, waiter, .. } => (res.key(key).to_owned(), waiter.seq),
                })
                .collect()
        };
        sm.apply_entry_into(
            5,
            None,
            Caller::default(),
            &acq(rid(1, 1), 7, "a-longer-key", 100, 0),
            &mut res,
        );
        assert_eq!(
            replies(&res),
            [format!(
                "{:?}",
                Reply::Acquired {
                    token: 5,
                    owner: 100,
                    key: "a-longer-key"
                }
            )]
        );
        assert_eq!(effects(&res), [("a-longer-key".to_owned(), 5)]);
        // A shorter key next: nothing of the previous entry's is left.
        sm.apply_entry_into(
            6,
            None,
            Caller::default(),
            &acq(rid(2, 1), 8, "b", 200, 0),
            &mut res,
        );
        sm.apply_entry_into(
            7,
            None,
            Caller::default(),
            &acq(rid(3, 1), 9, "b", 300, 9),
            &mut res,
        );
        assert!(res.answers.is_empty());
        assert_eq!(effects(&res), [("b".to_owned(), 1)]);
        sm.apply_entry_into(
            8,
            None,
            Caller::default(),
            &rel(rid(2, 2), "b", 6),
            &mut res,
        );
        assert_eq!(
            replies(&res),
            [
                format!("{:?}", Reply::Released { token: 6, key: "b" }),
                format!(
                    "{:?}",
                    Reply::Acquired {
                        token: 8,
                        owner: 300,
                        key: "b"
                    }
                ),
            ]
        );
        assert_eq!(effects(&res), [("b".to_owned(), 8)]);
        // A duplicate: cleared, nothing in it.
        sm.apply_entry_into(
            9,
            None,
            Caller::default(),
            &rel(rid(2, 2), "b", 6),
            &mut res,
        );
        assert!(res.duplicate && res.answers.is_empty() && res.effects.is_empty());
        sm.check();
    }

    #[test]
    fn tokens_are_entry_indices_and_release_hands_over_fifo() {
        let mut sm = StateMachine::new(EngineLimits::default());
        let a = sm.apply(5, &acq(rid(1, 1), 7, "k", 100, 0));
        assert_eq!(kinds(&a), vec![(rid(1, 1), AnswerKind::Acquired(5))]);
        assert!(sm
            .apply(6, &acq(rid(2, 1), 8, "k", 200, 9))
            .answers
            .is_empty());
        assert!(sm
            .apply(7, &acq(rid(3, 1), 9, "k", 300, 9))
            .answers
            .is_empty());
        let a = sm.apply(8, &acq(rid(1, 2), 7, "k", 101, 0));
        assert_eq!(kinds(&a), vec![(rid(1, 2), AnswerKind::Timeout)]);
        sm.check();
        let a = sm.apply(12, &rel(rid(1, 3), "k", 5));
        assert_eq!(
            kinds(&a),
            vec![
                (rid(1, 3), AnswerKind::Released(5)),
                (rid(2, 1), AnswerKind::Acquired(12))
            ]
        );
        assert_eq!(a.answers[1].conn, 8);
        sm.check();
        let a = sm.apply(13, &rel(rid(1, 4), "k", 5));
        assert_eq!(kinds(&a), vec![(rid(1, 4), AnswerKind::NotReleased(5))]);
        // A stale expire does nothing; the current one hands over.
        assert_eq!(
            sm.apply(
                14,
                &Command::Expire {
                    key: "k".into(),
                    token: 5,
                    generation: 0,
                }
            ),
            Applied::default()
        );
        let a = sm.apply(
            15,
            &Command::Expire {
                key: "k".into(),
                token: 12,
                generation: 0,
            },
        );
        assert_eq!(kinds(&a), vec![(rid(3, 1), AnswerKind::Acquired(15))]);
        let a = sm.apply(
            16,
            &Command::Expire {
                key: "k".into(),
                token: 15,
                generation: 0,
            },
        );
        assert!(a.answers.is_empty());
        assert_eq!(sm.key_count(), 0);
        sm.check();
    }

    #[test]
    fn duplicates_apply_once_and_floors_forget() {
        let mut sm = StateMachine::new(EngineLimits::default());
        let c = acq(rid(1, 1), 7, "k", 100, 0);
        assert_eq!(sm.apply(1, &c).answers.len(), 1);
        let again = sm.apply(2, &c);
        assert!(again.duplicate && again.answers.is_empty());
        // floor 5 forgets seqs below 5: seq 3 is then treated as applied.
        let c2 = Command::Acquire {
            rid: rid(1, 6),
            floor: 5,
            conn: 7,
            key: "j".into(),
            owner: 1,
            wait_s: 0,
            lease_s: 1,
        };
        assert!(!sm.apply(3, &c2).duplicate);
        assert!(sm.apply(4, &acq(rid(1, 3), 7, "x", 5, 0)).duplicate);
        assert!(!sm.apply(5, &acq(rid(1, 7), 7, "x", 5, 0)).duplicate);
        // A newer boot of node 1 starts afresh; the older boot is then stale.
        let newer = Rid {
            node: 1,
            epoch: 2,
            seq: 1,
        };
        assert!(!sm.apply(6, &acq(newer, 7, "y", 5, 0)).duplicate);
        assert!(sm.apply(7, &acq(rid(1, 8), 7, "z", 5, 0)).duplicate);
        sm.check();
    }

    #[test]
    fn wait_timeout_and_cancel_are_validated() {
        let mut sm = StateMachine::new(EngineLimits::default());
        sm.apply(1, &acq(rid(1, 1), 7, "k", 100, 0));
        sm.apply(2, &acq(rid(2, 1), 8, "k", 200, 9));
        sm.apply(3, &acq(rid(2, 2), 8, "k", 201, 9));
        sm.apply(4, &acq(rid(3, 1), 9, "k", 300, 9));
        let a = sm.apply(
            5,
            &Command::WaitTimeout {
                key: "k".into(),
                waiter: rid(2, 1),
            },
        );
        assert_eq!(kinds(&a), vec![(rid(2, 1), AnswerKind::Timeout)]);
        let a = sm.apply(
            6,
            &Command::WaitTimeout {
                key: "k".into(),
                waiter: rid(2, 1),
            },
        );
        assert!(a.answers.is_empty());
        sm.apply(
            7,
            &Command::CancelWaiters {
                origin: rid(2, 0).origin(8),
            },
        );
        sm.check();
        // Node 4 queues, restarts (epoch 2): its old waiter is dropped by the
        // first command of the new boot.
        sm.apply(8, &acq(rid(4, 1), 5, "k", 400, 9));
        assert!(sm.is_waiting("k", rid(4, 1)));
        let newer = Rid {
            node: 4,
            epoch: 2,
            seq: 1,
        };
        sm.apply(9, &acq(newer, 5, "other", 401, 0));
        assert!(!sm.is_waiting("k", rid(4, 1)));
        sm.check();
        let a = sm.apply(10, &rel(rid(1, 2), "k", 1));
        assert_eq!(
            kinds(&a),
            vec![
                (rid(1, 2), AnswerKind::Released(1)),
                (rid(3, 1), AnswerKind::Acquired(10))
            ]
        );
        sm.check();
    }

    #[test]
    fn the_holders_request_survives_a_snapshot() {
        let mut a = StateMachine::new(EngineLimits::default());
        a.apply(1, &acq(rid(1, 1), 7, "k", 100, 0));
        a.apply(2, &acq(rid(2, 1), 8, "k", 200, 9));
        assert_eq!(a.granted_to("k", rid(1, 1)), Some(1));
        assert_eq!(a.granted_to("k", rid(2, 1)), None, "queued, not granted");
        assert!(a.has_applied(rid(1, 1)) && a.has_applied(rid(2, 1)));
        assert!(!a.has_applied(rid(1, 2)) && !a.has_applied(rid(3, 1)));
        // Handed over on release: the waiter's request holds it now.
        a.apply(3, &rel(rid(1, 2), "k", 1));
        assert_eq!(a.granted_to("k", rid(1, 1)), None);
        assert_eq!(a.granted_to("k", rid(2, 1)), Some(3));
        let b = StateMachine::restore(EngineLimits::default(), &a.snapshot()).unwrap();
        assert_eq!(b.granted_to("k", rid(2, 1)), Some(3));
        assert!(b.has_applied(rid(1, 2)) && !b.has_applied(rid(1, 3)));
        // A version-1 snapshot (no holder requests) still restores, with
        // the holder's request unknown.
        let mut w = Writer::default();
        w.u8(1);
        w.u64(4);
        w.u64(1);
        w.u32(1);
        w.key("k");
        w.u64(3);
        w.u8(10);
        w.u32(0);
        w.u32(0);
        w.u32(0);
        let old = StateMachine::restore(EngineLimits::default(), &w.buf).unwrap();
        old.check();
        assert_eq!(old.holder("k"), Some(3));
        assert_eq!(old.granted_to("k", rid(2, 1)), None);
    }

    #[test]
    fn snapshot_restores_an_identical_machine() {
        let mut a = StateMachine::new(EngineLimits::default());
        let cmds = [
            acq(rid(1, 1), 7, "b", 1, 0),
            acq(rid(1, 2), 7, "a", 2, 0),
            acq(rid(2, 1), 8, "b", 3, 9),
            acq(rid(3, 1), 9, "b", 4, 9),
            acq(rid(2, 2), 8, "a", 5, 9),
            rel(rid(1, 3), "b", 1),
        ];
        for (i, c) in cmds.iter().enumerate() {
            a.apply(i as u64 + 1, c);
        }
        let bytes = a.snapshot();
        let mut b = StateMachine::restore(EngineLimits::default(), &bytes).unwrap();
        b.check();
        assert_eq!(b.snapshot(), bytes);
        // Both continue identically.
        let more = [
            rel(rid(1, 4), "a", 2),
            Command::Expire {
                key: "b".into(),
                token: 6,
                generation: 0,
            },
            acq(rid(1, 5), 7, "c", 6, 0),
            Command::CancelWaiters {
                origin: rid(3, 0).origin(9),
            },
        ];
        for (i, c) in more.iter().enumerate() {
            let idx = 20 + i as u64;
            assert_eq!(a.apply(idx, c), b.apply(idx, c));
        }
        a.check();
        b.check();
        assert_eq!(a.snapshot(), b.snapshot());
        // Truncated or corrupt snapshots are errors, not panics.
        for cut in 0..bytes.len() {
            assert!(StateMachine::restore(EngineLimits::default(), &bytes[..cut]).is_err());
        }
    }
}

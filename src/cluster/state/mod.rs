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
//! in the entry ([`Command::encode_entry`], [`crate::token`]), so the token
//! of a grant is made of the index of the entry that granted it. An entry
//! that grants several permits (a release handing its places to several
//! shared waiters, PROTOCOL §6) gives them that token and the ones just
//! above it, and the next entry's floor never goes below a token already
//! issued. Indices never repeat, so tokens increase across leader changes,
//! snapshots and restarts; every node applies the same bits, so they agree
//! on every token. An entry written before tokens had random bits grants
//! the bare index, below every later entry's token.
//!
//! # Permits (protocol 1.2)
//!
//! [`Command::AcquireWithLimit`] applies as [`Command::Acquire`] does
//! (dedup by rid, the caller, the quotas), through
//! [`Engine::acquire_with_limit`] with the request's tag; a key of another
//! limit answers [`AnswerKind::LimitMismatch`]. Each permit is a grant of
//! its own: its [`Effect::Granted`] sets the leader's `Expire` for its
//! token, an `Expire` or an extend names it by token, and
//! [`StateMachine::holders`] lists every permit, so a new leader times
//! each one.
//!
//! The parts: `applied` (the answers and effects applying an entry
//! produces) and `snapshot` (the canonical bytes, their bound, restoring).

use std::collections::{BTreeMap, BTreeSet};

use crate::cluster::command::{Command, Origin, Rid};
use crate::cluster::members::Members;
use crate::engine::{Acquire, AcquireOutcome, Caller, ConnId, Engine, Event, Outbox, Places};
use crate::limits::EngineLimits;
use crate::time::Millis;
use crate::token;

mod applied;
mod snapshot;

pub use applied::{Answer, AnswerKind, Applied, Effect, KeyAt};
pub use snapshot::SNAPSHOT_LEDGER_SLACK_BYTES;

/// What the engine carries for each grant and queued acquire in cluster
/// mode: the request, its origin connection, and the lease and its
/// generation (a waiter's become its grant's when it is handed the key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReqTag {
    /// The request. All zero for a grant whose request is unknown (one
    /// restored from a version-1 snapshot).
    pub(super) rid: Rid,
    /// Its client connection on the origin node.
    pub(super) conn: u64,
    /// The latest lease: the grant's own, or its latest extension's.
    pub(super) lease_s: u8,
    /// Extensions that took effect on this grant (PROTOCOL §5.2): an `Expire`
    /// set for an earlier generation does nothing.
    pub(super) generation: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct DedupRec {
    pub(super) epoch: u64,
    pub(super) floor: u64,
    pub(super) seen: BTreeSet<u64>,
}

/// The engine connection id used for holders and immediate answers; never
/// allocated to an origin.
pub(super) const NO_CONN: u64 = 0;

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

    /// The lease generation of the grant `token` of `key` (a mutex's or
    /// a permit's) while it stands.
    #[must_use]
    pub fn generation_of(&self, key: &str, token: u64) -> Option<u64> {
        self.engine.grant_of(key, token).map(|tag| tag.generation)
    }

    /// True while the grant `token` of `key` (a mutex's or a permit's)
    /// stands.
    #[must_use]
    pub fn holds_grant(&self, key: &str, token: u64) -> bool {
        self.engine.grant_of(key, token).is_some()
    }

    /// The token of `key` when it is held by the grant of request `rid`
    /// (the mutex's grant, or one of its permits). A request whose
    /// granting entry this node never applied itself (it came inside a
    /// snapshot) can still be answered with it.
    #[must_use]
    pub fn granted_to(&self, key: &str, rid: Rid) -> Option<u64> {
        self.engine
            .grants(key)
            .find(|g| g.tag.rid == rid)
            .map(|g| g.token)
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

    /// Every grant as (key, token, latest lease_s, lease generation),
    /// sorted by key: a mutex's grant, and each permit of a key registered
    /// with a limit (oldest first within its key).
    pub fn holders(&self) -> impl Iterator<Item = (&str, u64, u8, u64)> + '_ {
        self.engine
            .sorted_held_keys()
            .into_iter()
            .flat_map(move |k| {
                self.engine
                    .grants(k)
                    .map(move |g| (k, g.token, g.tag.lease_s, g.tag.generation))
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
            Command::Acquire { .. } | Command::AcquireWithLimit { .. } => {
                self.apply_acquire(cmd, res);
            }
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
                let current = self.engine.grant_of(key, *token).map(|t| t.generation);
                if current == Some(*generation) {
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
            | Command::AcquireWithLimit { floor, .. }
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

    /// Applies an acquire, with a limit or not; if it queued, adds the
    /// effect that says so (the leader's wait timer) to `res`.
    fn apply_acquire(&mut self, cmd: &Command, res: &mut Applied) {
        let (rid, conn, key, owner, wait_s, lease_s, places) = match cmd {
            Command::Acquire {
                rid,
                conn,
                key,
                owner,
                wait_s,
                lease_s,
                ..
            } => (rid, conn, key, owner, wait_s, lease_s, None),
            Command::AcquireWithLimit {
                rid,
                conn,
                key,
                owner,
                wait_s,
                lease_s,
                limit,
                mode,
                ..
            } => {
                let places = Places {
                    limit: *limit,
                    mode: *mode,
                };
                (rid, conn, key, owner, wait_s, lease_s, Some(places))
            }
            _ => return,
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
        let (now, out) = (Millis::ZERO, &mut self.out);
        let outcome = match places {
            None => self.engine.acquire_tagged(now, engine_conn, req, tag, out),
            Some(places) => self
                .engine
                .acquire_with_limit(now, engine_conn, req, places, tag, out),
        };
        if let AcquireOutcome::Queued(_) = outcome {
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
                Event::LimitMismatch {
                    key, limit, tag, ..
                } => (tag, AnswerKind::LimitMismatch(limit), key),
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
            let key = answer_key(res, kind, key);
            res.answers.push(Answer {
                rid: tag.rid,
                conn: tag.conn,
                owner: owner_of(&ev),
                key,
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

    /// Cancels every waiter of `origin`'s connection. On a key of limit 2
    /// or more a cancelled head may have kept the waiters behind it from a
    /// place: the engine grants them here, and their events stay in the
    /// outbox for `take_events` to answer and time, like any other grant.
    fn cancel(&mut self, origin: Origin) {
        if let Some(c) = self.conns.remove(&origin) {
            self.engine.disconnect(Millis::ZERO, c, &mut self.out);
        }
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

/// An extend took effect: the grant `token` of `key` (a mutex's or a
/// permit's) starts a new lease generation, which the leader's next timer
/// for it names. (Free of `self`: the caller is iterating over the
/// outbox's events.)
fn new_generation(
    engine: &mut Engine<ReqTag>,
    key: &str,
    at: KeyAt,
    token: u64,
    lease_s: u8,
) -> Effect {
    let t = engine
        .grant_of_mut(key, token)
        .expect("an extended grant stands");
    t.generation += 1;
    t.lease_s = lease_s;
    Effect::Extended {
        key: at,
        token,
        generation: t.generation,
        lease_s,
    }
}

/// The owner an event's answer names: an acquire's (0 for a release's or
/// an extend's).
fn owner_of(ev: &Event<'_, ReqTag>) -> u64 {
    match *ev {
        Event::Granted { owner, .. }
        | Event::TimedOut { owner, .. }
        | Event::Busy { owner, .. }
        | Event::LimitMismatch { owner, .. } => owner,
        _ => 0,
    }
}

/// Where the key of an answer of `kind` on `key` lies in `res`: a grant's
/// or an extend's is in already, for its effect; any other is added.
fn answer_key(res: &mut Applied, kind: AnswerKind, key: &str) -> KeyAt {
    match res.effects.last() {
        Some(Effect::Granted { key: at, .. } | Effect::Extended { key: at, .. })
            if matches!(kind, AnswerKind::Acquired(_) | AnswerKind::Extended(_))
                && res.key(*at) == key =>
        {
            *at
        }
        _ => res.push_key(key),
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
mod permit_tests;

#[cfg(test)]
mod tests;

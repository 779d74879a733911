//! The lock engine: keys, holders, FIFO wait queues, fencing tokens, capacity
//! limits and the deadline index (SPEC §2). Sans-IO: it never touches a socket
//! and never reads a clock.
//!
//! Every operation takes `now` from its caller and appends the replies it
//! produces, addressed to connections, to an [`Outbox`]. Given the same calls
//! with the same arguments it produces the same replies in the same order.
//!
//! # Two time policies
//!
//! * [`Engine::new`] (single mode) is *clocked*: leases and waits are deadlines
//!   on the caller's timeline. An acquire takes over an expired key on the spot
//!   (ahead of any queue); [`Engine::tick`] hands an expired key to its head
//!   waiter, answers waits that ran out with Timeout, and sweeps expired keys
//!   without waiters every `sweep_interval_ms`.
//! * [`Engine::replicated`] (cluster mode) never looks at `now`: nothing
//!   expires by itself. Time enters only through the explicit, validated
//!   operations [`Engine::expire`] and [`Engine::wait_timeout`], which a leader
//!   proposes and every node applies; a stale one is a no-op.
//!
//! # The deadline index
//!
//! `BTreeMap<(deadline, seq), key>` holds one live entry per key that has
//! waiters: the earliest moment anything can happen to that key (its lease
//! running out or one of its waiters giving up). The live entry is the one
//! whose deadline equals the queue's `timer_at`; older entries are stale and
//! skipped when they come due, so nothing is ever searched for and removed.
//!
//! # Memory
//!
//! A held key costs one hash-table entry (the boxed key plus 24 bytes) and the
//! key's own allocation; a queue is allocated only for a key that has waiters.
//! A waiter is 40 bytes in its key's `VecDeque`.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use crate::limits::EngineLimits;
use crate::proto::{Reply, Request};
use crate::time::Millis;

/// Identifies a client connection to the engine. The caller chooses them; in
/// the server they are never reused while the process lives.
pub type ConnId = u64;

/// Identifies one queued acquire, for [`Engine::wait_timeout`].
pub type WaiterId = u64;

/// The arguments of one acquire (SPEC §1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acquire<'a> {
    /// The lock name.
    pub key: &'a str,
    /// Correlation id echoed in the reply.
    pub owner: u64,
    /// Seconds the caller is willing to queue; 0 never queues.
    pub wait_s: u8,
    /// Seconds the grant lives.
    pub lease_s: u8,
}

/// What an acquire did at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireOutcome {
    /// Granted now with this fencing token (an `A` is in the outbox).
    Granted(u64),
    /// Queued; the reply comes later (`A` on grant, `T` when the wait runs out).
    Queued(WaiterId),
    /// Held and `wait = 0`: a `T` is in the outbox.
    Timeout,
    /// A capacity limit: a `B` is in the outbox.
    Busy,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Acquired,
    Timeout,
    Busy,
    Released,
    NotReleased,
}

#[derive(Clone, Copy, Debug)]
struct OutMsg {
    conn: ConnId,
    kind: Kind,
    token: u64,
    owner: u64,
    lease_s: u8,
    key_start: usize,
    key_end: usize,
}

/// One reply addressed to a connection, as read back from an [`Outbox`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addressed<'a> {
    /// The connection the reply goes to.
    pub conn: ConnId,
    /// The reply.
    pub reply: Reply<'a>,
    /// For an `Acquired` reply, the lease of the grant in seconds (cluster
    /// leaders use it to schedule the Expire); 0 for every other reply.
    pub lease_s: u8,
}

/// Replies produced by the engine, in the order produced.
///
/// Keys are copied into one reusable string, so a long-lived outbox that is
/// cleared after each loop turn stops allocating once it has warmed up.
#[derive(Default, Debug)]
pub struct Outbox {
    msgs: Vec<OutMsg>,
    keys: String,
}

impl Outbox {
    /// An empty outbox.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of replies held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.msgs.len()
    }

    /// True when no reply is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    /// Forgets every reply, keeping the allocations.
    pub fn clear(&mut self) {
        self.msgs.clear();
        self.keys.clear();
    }

    /// The replies in the order they were produced.
    pub fn iter(&self) -> impl Iterator<Item = Addressed<'_>> + '_ {
        self.msgs.iter().map(move |m| {
            let key = &self.keys[m.key_start..m.key_end];
            let reply = match m.kind {
                Kind::Acquired => Reply::Acquired {
                    token: m.token,
                    owner: m.owner,
                    key,
                },
                Kind::Timeout => Reply::Timeout {
                    owner: m.owner,
                    key,
                },
                Kind::Busy => Reply::Busy {
                    owner: m.owner,
                    key,
                },
                Kind::Released => Reply::Released {
                    token: m.token,
                    key,
                },
                Kind::NotReleased => Reply::NotReleased {
                    token: m.token,
                    key,
                },
            };
            Addressed {
                conn: m.conn,
                reply,
                lease_s: m.lease_s,
            }
        })
    }

    /// Appends a reply addressed to `conn`. Used by the engine, and by
    /// services (cluster mode) that answer without it.
    pub fn push(&mut self, conn: ConnId, reply: Reply<'_>, lease_s: u8) {
        let (kind, token, owner) = match reply {
            Reply::Acquired { token, owner, .. } => (Kind::Acquired, token, owner),
            Reply::Timeout { owner, .. } => (Kind::Timeout, 0, owner),
            Reply::Busy { owner, .. } => (Kind::Busy, 0, owner),
            Reply::Released { token, .. } => (Kind::Released, token, 0),
            Reply::NotReleased { token, .. } => (Kind::NotReleased, token, 0),
        };
        let key_start = self.keys.len();
        self.keys.push_str(reply.key());
        self.msgs.push(OutMsg {
            conn,
            kind,
            token,
            owner,
            lease_s,
            key_start,
            key_end: self.keys.len(),
        });
    }
}

#[derive(Debug)]
struct Waiter {
    id: WaiterId,
    owner: u64,
    conn: ConnId,
    wait_deadline: Millis,
    lease_s: u8,
}

#[derive(Debug)]
struct Queue {
    waiters: VecDeque<Waiter>,
    /// Deadline of this key's live entry in the deadline index, or NEVER.
    timer_at: Millis,
}

#[derive(Debug)]
struct Slot {
    token: u64,
    expires_at: Millis,
    queue: Option<Box<Queue>>,
}

/// The lock table. See the module documentation.
#[derive(Debug)]
pub struct Engine {
    limits: EngineLimits,
    clocked: bool,
    keys: HashMap<Box<str>, Slot>,
    /// Keys that have a queue, so a disconnect need not scan every key.
    contended: HashSet<Box<str>>,
    timers: BTreeMap<(Millis, u64), Box<str>>,
    timer_seq: u64,
    next_token: u64,
    /// Tokens at or above this are not issued (not yet durable).
    token_ceiling: u64,
    next_waiter: WaiterId,
    waiters_total: usize,
    waiters_by_conn: HashMap<ConnId, u32>,
    next_sweep: Millis,
    /// Reused by `tick` for the keys due in one call.
    due_scratch: Vec<Box<str>>,
}

impl Engine {
    /// A single-mode engine (clocked, lazy expiry). Tokens start at
    /// `first_token` (0 is taken as 1): the server passes a value above every
    /// token issued before a restart.
    #[must_use]
    pub fn new(limits: EngineLimits, first_token: u64) -> Self {
        let next_sweep = Millis::ZERO.add_ms(limits.sweep_interval_ms);
        Engine {
            limits,
            clocked: true,
            keys: HashMap::new(),
            contended: HashSet::new(),
            timers: BTreeMap::new(),
            timer_seq: 0,
            next_token: first_token.max(1),
            token_ceiling: u64::MAX,
            next_waiter: 1,
            waiters_total: 0,
            waiters_by_conn: HashMap::new(),
            next_sweep,
            due_scratch: Vec::new(),
        }
    }

    /// A cluster-mode engine: `now` arguments are ignored, nothing expires or
    /// times out except through [`Engine::expire`] and [`Engine::wait_timeout`].
    #[must_use]
    pub fn replicated(limits: EngineLimits, first_token: u64) -> Self {
        Engine {
            clocked: false,
            next_sweep: Millis::NEVER,
            ..Engine::new(limits, first_token)
        }
    }

    /// The limits this engine enforces.
    #[must_use]
    pub fn limits(&self) -> &EngineLimits {
        &self.limits
    }

    /// Registered keys (held, or expired and not yet swept).
    #[must_use]
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// Queued acquires over all keys.
    #[must_use]
    pub fn waiter_count(&self) -> usize {
        self.waiters_total
    }

    /// The token the next grant will carry. Every token issued so far is lower.
    #[must_use]
    pub fn next_token(&self) -> u64 {
        self.next_token
    }

    /// Makes the next token at least `floor` (cluster mode: the index of the
    /// entry being applied). Never lowers it.
    pub fn raise_next_token(&mut self, floor: u64) {
        self.next_token = self.next_token.max(floor);
    }

    /// The token currently held on `key`, and whether its lease has run out
    /// at `now` (always false in replicated mode).
    #[must_use]
    pub fn holder(&self, now: Millis, key: &str) -> Option<(u64, bool)> {
        self.keys
            .get(key)
            .map(|s| (s.token, self.is_expired(s, now)))
    }

    /// The owners queued on `key`, head first.
    #[must_use]
    pub fn queued_owners(&self, key: &str) -> Vec<u64> {
        self.keys
            .get(key)
            .and_then(|s| s.queue.as_ref())
            .map(|q| q.waiters.iter().map(|w| w.owner).collect())
            .unwrap_or_default()
    }

    /// Tokens at or above `ceiling` will not be issued. The server sets it to
    /// one above its durable high-water mark, so no token reaches a client
    /// before a restart is sure to resume above it. While no token can be
    /// issued, an acquire that would be granted is answered Busy, and a key
    /// whose grant ends is deleted with its waiters answered Timeout.
    pub fn set_token_ceiling(&mut self, ceiling: u64) {
        self.token_ceiling = ceiling;
    }

    /// True when a grant now would exceed the token ceiling.
    #[must_use]
    pub fn tokens_exhausted(&self) -> bool {
        self.next_token >= self.token_ceiling
    }

    fn is_expired(&self, slot: &Slot, now: Millis) -> bool {
        self.clocked && slot.expires_at <= now
    }

    fn issue_token(&mut self) -> u64 {
        let t = self.next_token;
        assert!(t < u64::MAX, "fencing tokens exhausted");
        self.next_token = t + 1;
        t
    }

    fn deadline(&self, now: Millis, secs: u8) -> Millis {
        if self.clocked {
            now.add_secs(u64::from(secs))
        } else {
            Millis::NEVER
        }
    }

    /// Handles one decoded request: [`Engine::acquire`] or [`Engine::release`].
    pub fn handle(&mut self, now: Millis, conn: ConnId, req: Request<'_>, out: &mut Outbox) {
        match req {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            } => {
                self.acquire(
                    now,
                    conn,
                    Acquire {
                        key,
                        owner,
                        wait_s,
                        lease_s,
                    },
                    out,
                );
            }
            Request::Release { token, key } => {
                self.release(now, conn, token, key, out);
            }
        }
    }

    /// SPEC §2.1. `lease_s = 0` (rejected by the codec) is treated as 1.
    pub fn acquire(
        &mut self,
        now: Millis,
        conn: ConnId,
        req: Acquire<'_>,
        out: &mut Outbox,
    ) -> AcquireOutcome {
        let Acquire {
            key,
            owner,
            wait_s,
            lease_s,
        } = req;
        let lease_s = lease_s.max(1);
        let expires_at = self.deadline(now, lease_s);
        let Some(slot) = self.keys.get(key) else {
            if self.keys.len() >= self.limits.max_keys || self.tokens_exhausted() {
                out.push(conn, Reply::Busy { owner, key }, 0);
                return AcquireOutcome::Busy;
            }
            let token = self.issue_token();
            self.keys.insert(
                key.into(),
                Slot {
                    token,
                    expires_at,
                    queue: None,
                },
            );
            out.push(conn, Reply::Acquired { token, owner, key }, lease_s);
            return AcquireOutcome::Granted(token);
        };
        let expired = self.is_expired(slot, now);
        if expired && self.tokens_exhausted() {
            out.push(conn, Reply::Busy { owner, key }, 0);
            return AcquireOutcome::Busy;
        }
        if expired {
            // Lazy takeover: the non-FIFO expiry path, ahead of any queue.
            let token = self.issue_token();
            let slot = self.keys.get_mut(key).expect("slot checked above");
            slot.token = token;
            slot.expires_at = expires_at;
            out.push(conn, Reply::Acquired { token, owner, key }, lease_s);
            return AcquireOutcome::Granted(token);
        }
        if wait_s == 0 {
            out.push(conn, Reply::Timeout { owner, key }, 0);
            return AcquireOutcome::Timeout;
        }
        let queued = slot.queue.as_ref().map_or(0, |q| q.waiters.len());
        if queued >= self.limits.max_waiters_per_key
            || self.waiters_total >= self.limits.max_waiters
        {
            out.push(conn, Reply::Busy { owner, key }, 0);
            return AcquireOutcome::Busy;
        }
        let id = self.next_waiter;
        self.next_waiter += 1;
        let wait_deadline = self.deadline(now, wait_s);
        let holder_expiry = slot.expires_at;
        let waiter = Waiter {
            id,
            owner,
            conn,
            wait_deadline,
            lease_s,
        };
        let slot = self.keys.get_mut(key).expect("slot checked above");
        let queue = slot.queue.get_or_insert_with(|| {
            Box::new(Queue {
                waiters: VecDeque::new(),
                timer_at: Millis::NEVER,
            })
        });
        let fresh_queue = queue.waiters.is_empty();
        queue.waiters.push_back(waiter);
        let due = wait_deadline.min(holder_expiry);
        let reschedule = due < queue.timer_at;
        if reschedule {
            queue.timer_at = due;
        }
        if fresh_queue {
            self.contended.insert(key.into());
        }
        if reschedule {
            self.schedule(due, key);
        }
        self.waiters_total += 1;
        *self.waiters_by_conn.entry(conn).or_insert(0) += 1;
        AcquireOutcome::Queued(id)
    }

    fn schedule(&mut self, at: Millis, key: &str) {
        if at == Millis::NEVER {
            return;
        }
        self.timer_seq += 1;
        self.timers.insert((at, self.timer_seq), key.into());
    }

    /// SPEC §2.2. Returns true when the release took effect (`R`).
    pub fn release(
        &mut self,
        now: Millis,
        conn: ConnId,
        token: u64,
        key: &str,
        out: &mut Outbox,
    ) -> bool {
        match self.keys.get(key) {
            Some(slot) if slot.token == token => {
                out.push(conn, Reply::Released { token, key }, 0);
                self.hand_over_or_delete(now, key, out);
                true
            }
            _ => {
                out.push(conn, Reply::NotReleased { token, key }, 0);
                false
            }
        }
    }

    /// Ends the current grant of `key` if its token is `token`: the head
    /// waiter gets the key, or the key is deleted. This is the committed
    /// `Expire{key, token}` of cluster mode; a stale one (the token moved on,
    /// or the key is gone) does nothing and returns false. No reply goes to
    /// the old holder.
    pub fn expire(&mut self, now: Millis, key: &str, token: u64, out: &mut Outbox) -> bool {
        match self.keys.get(key) {
            Some(slot) if slot.token == token => {
                self.hand_over_or_delete(now, key, out);
                true
            }
            _ => false,
        }
    }

    /// Answers the queued acquire `waiter` on `key` with Timeout and removes
    /// it. A stale one (already granted, timed out or cancelled) does nothing
    /// and returns false.
    pub fn wait_timeout(
        &mut self,
        now: Millis,
        key: &str,
        waiter: WaiterId,
        out: &mut Outbox,
    ) -> bool {
        let _ = now;
        let Some(queue) = self.keys.get_mut(key).and_then(|s| s.queue.as_mut()) else {
            return false;
        };
        let Some(pos) = queue.waiters.iter().position(|w| w.id == waiter) else {
            return false;
        };
        let w = queue.waiters.remove(pos).expect("position is in range");
        out.push(
            w.conn,
            Reply::Timeout {
                owner: w.owner,
                key,
            },
            0,
        );
        self.forget_waiter(w.conn);
        self.drop_queue_if_empty(key);
        true
    }

    /// Cancels every acquire `conn` has queued, with no reply (the connection
    /// is gone). What `conn` holds stays held until released or expired.
    pub fn disconnect(&mut self, now: Millis, conn: ConnId, out: &mut Outbox) {
        let _ = (now, out);
        if !self.waiters_by_conn.contains_key(&conn) {
            return;
        }
        let mut emptied = Vec::new();
        for key in &self.contended {
            let Some(queue) = self.keys.get_mut(key).and_then(|s| s.queue.as_mut()) else {
                continue;
            };
            let before = queue.waiters.len();
            queue.waiters.retain(|w| w.conn != conn);
            self.waiters_total -= before - queue.waiters.len();
            if queue.waiters.is_empty() {
                emptied.push(key.clone());
            }
        }
        self.waiters_by_conn.remove(&conn);
        for key in emptied {
            self.drop_queue_if_empty(&key);
        }
    }

    fn forget_waiter(&mut self, conn: ConnId) {
        self.waiters_total -= 1;
        if let Some(n) = self.waiters_by_conn.get_mut(&conn) {
            *n -= 1;
            if *n == 0 {
                self.waiters_by_conn.remove(&conn);
            }
        }
    }

    fn drop_queue_if_empty(&mut self, key: &str) {
        if let Some(slot) = self.keys.get_mut(key) {
            if slot.queue.as_ref().is_some_and(|q| q.waiters.is_empty()) {
                slot.queue = None;
                self.contended.remove(key);
            }
        }
    }

    /// Answers with Timeout every waiter of `key` whose wait ran out by `now`.
    fn time_out_waiters(&mut self, now: Millis, key: &str, out: &mut Outbox) {
        if !self.clocked {
            return;
        }
        let Some(queue) = self.keys.get_mut(key).and_then(|s| s.queue.as_mut()) else {
            return;
        };
        let mut gone = Vec::new();
        queue.waiters.retain(|w| {
            let expired = w.wait_deadline <= now;
            if expired {
                gone.push((w.conn, w.owner));
            }
            !expired
        });
        for (conn, owner) in gone {
            out.push(conn, Reply::Timeout { owner, key }, 0);
            self.forget_waiter(conn);
        }
    }

    /// Answers every waiter of `key` with Timeout (no token can be issued).
    fn time_out_all_waiters(&mut self, key: &str, out: &mut Outbox) {
        let Some(queue) = self.keys.get_mut(key).and_then(|s| s.queue.as_mut()) else {
            return;
        };
        let gone: Vec<Waiter> = queue.waiters.drain(..).collect();
        for w in gone {
            out.push(
                w.conn,
                Reply::Timeout {
                    owner: w.owner,
                    key,
                },
                0,
            );
            self.forget_waiter(w.conn);
        }
    }

    /// The current grant of `key` ends: grant the head waiter whose wait has
    /// not run out (FIFO, a new token, its own lease from `now`), or delete
    /// the key when nobody is waiting.
    fn hand_over_or_delete(&mut self, now: Millis, key: &str, out: &mut Outbox) {
        // A waiter whose wait ran out gets T even if its timer has not fired.
        self.time_out_waiters(now, key, out);
        if self.tokens_exhausted() {
            self.time_out_all_waiters(key, out);
        }
        let head = self
            .keys
            .get_mut(key)
            .and_then(|s| s.queue.as_mut())
            .and_then(|q| q.waiters.pop_front());
        let Some(w) = head else {
            if let Some(slot) = self.keys.remove(key) {
                if slot.queue.is_some() {
                    self.contended.remove(key);
                }
            }
            return;
        };
        self.forget_waiter(w.conn);
        let token = self.issue_token();
        let expires_at = self.deadline(now, w.lease_s);
        let slot = self.keys.get_mut(key).expect("key has a queue");
        slot.token = token;
        slot.expires_at = expires_at;
        out.push(
            w.conn,
            Reply::Acquired {
                token,
                owner: w.owner,
                key,
            },
            w.lease_s,
        );
        self.drop_queue_if_empty(key);
        self.reschedule(key);
    }

    /// Points the key's live timer at the earliest of its holder's expiry and
    /// its waiters' deadlines.
    fn reschedule(&mut self, key: &str) {
        if !self.clocked {
            return;
        }
        let Some(slot) = self.keys.get_mut(key) else {
            return;
        };
        let holder_expiry = slot.expires_at;
        let Some(queue) = slot.queue.as_mut() else {
            return;
        };
        let due = queue
            .waiters
            .iter()
            .map(|w| w.wait_deadline)
            .min()
            .unwrap_or(Millis::NEVER)
            .min(holder_expiry);
        if due != queue.timer_at {
            queue.timer_at = due;
            self.schedule(due, key);
        }
    }

    /// Processes everything due by `now` (single mode): waits that ran out get
    /// T, an expired key with waiters goes to its head waiter, and every
    /// `sweep_interval_ms` expired keys without waiters are deleted. Does
    /// nothing in replicated mode.
    pub fn tick(&mut self, now: Millis, out: &mut Outbox) {
        if !self.clocked {
            return;
        }
        // Collect the keys that are due, then process them in key order: the
        // order of replies and tokens within one tick then depends only on
        // the lock state, not on the history of the timer index (entries can
        // be early: see `reschedule`). Keys do not interact, so any order is
        // correct; a canonical one is checkable against a model.
        let mut due = std::mem::take(&mut self.due_scratch);
        while let Some(entry) = self.timers.first_entry() {
            let (at, _) = *entry.key();
            if at > now {
                break;
            }
            let key = entry.remove();
            if let Some(q) = self.keys.get_mut(&*key).and_then(|s| s.queue.as_mut()) {
                // Only the entry matching `timer_at` is live; older ones are
                // stale (the key moved on since they were made).
                if q.timer_at == at {
                    q.timer_at = Millis::NEVER;
                    due.push(key);
                }
            }
        }
        due.sort_unstable();
        for key in due.drain(..) {
            self.time_out_waiters(now, &key, out);
            let expired = self.keys.get(&*key).is_some_and(|s| s.expires_at <= now);
            let waiting = self
                .keys
                .get(&*key)
                .and_then(|s| s.queue.as_ref())
                .is_some_and(|q| !q.waiters.is_empty());
            if expired && waiting {
                self.hand_over_or_delete(now, &key, out);
            } else {
                self.drop_queue_if_empty(&key);
                self.reschedule(&key);
            }
        }
        self.due_scratch = due;
        if now >= self.next_sweep {
            self.keys
                .retain(|_, s| !(s.expires_at <= now && s.queue.is_none()));
            self.next_sweep = now.add_ms(self.limits.sweep_interval_ms.max(1));
        }
    }

    /// The next moment [`Engine::tick`] has work, for the poll timeout.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Millis> {
        if !self.clocked {
            return None;
        }
        let timer = self.timers.first_key_value().map(|(&(at, _), _)| at);
        let sweep = (!self.keys.is_empty()).then_some(self.next_sweep);
        match (timer, sweep) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Checks the engine's internal invariants, panicking with a message on
    /// the first one broken. For tests and fuzzing; O(keys + waiters).
    pub fn check_invariants(&self) {
        let mut total = 0usize;
        let mut by_conn: HashMap<ConnId, u32> = HashMap::new();
        for (key, slot) in &self.keys {
            assert!(
                slot.token < self.next_token,
                "token {} of {key:?} not below next {}",
                slot.token,
                self.next_token
            );
            assert!(slot.token > 0, "token 0 on {key:?}");
            match &slot.queue {
                None => assert!(
                    !self.contended.contains(key),
                    "{key:?} contended without a queue"
                ),
                Some(q) => {
                    assert!(!q.waiters.is_empty(), "{key:?} has an empty queue");
                    assert!(
                        self.contended.contains(key),
                        "{key:?} queued but not contended"
                    );
                    assert!(
                        q.waiters.len() <= self.limits.max_waiters_per_key,
                        "{key:?} over max_waiters_per_key"
                    );
                    if self.clocked {
                        assert!(
                            self.timers
                                .iter()
                                .any(|(&(at, _), k)| at == q.timer_at && **k == **key),
                            "{key:?} has waiters but no live timer"
                        );
                    }
                    for w in &q.waiters {
                        total += 1;
                        *by_conn.entry(w.conn).or_insert(0) += 1;
                    }
                }
            }
        }
        assert_eq!(total, self.waiters_total, "waiter count drifted");
        assert_eq!(
            by_conn, self.waiters_by_conn,
            "per-connection waiter counts drifted"
        );
        assert!(
            self.waiters_total <= self.limits.max_waiters,
            "over max_waiters"
        );
        assert!(self.keys.len() <= self.limits.max_keys, "over max_keys");
        assert_eq!(
            self.contended.len(),
            self.keys.values().filter(|s| s.queue.is_some()).count(),
            "contended set drifted"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acq(key: &str, owner: u64, wait_s: u8, lease_s: u8) -> Acquire<'_> {
        Acquire {
            key,
            owner,
            wait_s,
            lease_s,
        }
    }

    fn replies(out: &mut Outbox) -> Vec<(ConnId, String)> {
        let v = out
            .iter()
            .map(|a| (a.conn, format!("{:?}", a.reply)))
            .collect();
        out.clear();
        v
    }

    #[test]
    fn release_hands_over_fifo_and_expiry_hands_over_on_tick() {
        let mut e = Engine::new(EngineLimits::default(), 1);
        let mut out = Outbox::new();
        let t0 = Millis(1000);
        assert_eq!(
            e.acquire(t0, 1, acq("k", 10, 0, 5), &mut out),
            AcquireOutcome::Granted(1)
        );
        assert!(matches!(
            e.acquire(t0, 2, acq("k", 20, 9, 3), &mut out),
            AcquireOutcome::Queued(_)
        ));
        assert!(matches!(
            e.acquire(t0, 3, acq("k", 30, 60, 3), &mut out),
            AcquireOutcome::Queued(_)
        ));
        e.check_invariants();
        replies(&mut out);
        assert!(e.release(t0, 1, 1, "k", &mut out));
        let r = replies(&mut out);
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].0, 2, "head waiter gets the key");
        e.check_invariants();
        // owner 20 holds with a 3 s lease from t0; owner 30 waits until t0+60s.
        assert_eq!(e.next_deadline(), Some(t0.add_secs(3)));
        e.tick(t0.add_secs(3), &mut out);
        let r = replies(&mut out);
        assert_eq!(
            r,
            vec![(
                3,
                "Acquired { token: 3, owner: 30, key: \"k\" }".to_string()
            )]
        );
        e.check_invariants();
    }

    #[test]
    fn a_waiter_whose_wait_ran_out_is_never_granted() {
        let mut e = Engine::new(EngineLimits::default(), 7);
        let mut out = Outbox::new();
        e.acquire(Millis(0), 1, acq("k", 1, 0, 30), &mut out);
        e.acquire(Millis(0), 2, acq("k", 2, 1, 30), &mut out);
        out.clear();
        // The release comes after the wait ran out but before any tick.
        assert!(e.release(Millis(1000), 1, 7, "k", &mut out));
        let r = replies(&mut out);
        assert_eq!(r[1], (2, "Timeout { owner: 2, key: \"k\" }".to_string()));
        assert_eq!(e.key_count(), 0);
        e.check_invariants();
    }
}

//! Acquire (PROTOCOL §2.1): a fresh grant, a takeover, a Busy or Timeout
//! answer, or a queued waiter.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::sync::Arc;

use super::conns::WAITERS_CEILING;
use super::tokens::try_take_token;
use super::waiters::{Queue, Waiter, SHARED_BIT, WAITER_ID_LIMIT};
use super::{quota, Acquire, AcquireOutcome, ConnId, Engine, Grant, Kind, Outbox, Slot, WaiterId};
use crate::hash::{KeyStr, StrEntry};
use crate::proto::Reply;
use crate::time::Millis;

/// What an acquire of a mutex did at once: an [`AcquireOutcome`] other
/// than `LimitMismatch`, which only an acquire with a limit is answered.
///
/// Every payload is a `u64`, so a call returns it in two registers; the
/// `u16` of `LimitMismatch` makes an `AcquireOutcome` an aggregate that a
/// call returns through memory (a pointer in the first argument register,
/// one register fewer for the acquire's own work). The mutex path returns
/// this up to [`Engine::acquire_tagged`], which widens it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MutexOutcome {
    /// [`AcquireOutcome::Granted`].
    Granted(u64),
    /// [`AcquireOutcome::Queued`].
    Queued(WaiterId),
    /// [`AcquireOutcome::Timeout`].
    Timeout,
    /// [`AcquireOutcome::Busy`].
    Busy,
}

impl From<MutexOutcome> for AcquireOutcome {
    #[inline(always)]
    fn from(outcome: MutexOutcome) -> AcquireOutcome {
        match outcome {
            MutexOutcome::Granted(token) => AcquireOutcome::Granted(token),
            MutexOutcome::Queued(id) => AcquireOutcome::Queued(id),
            MutexOutcome::Timeout => AcquireOutcome::Timeout,
            MutexOutcome::Busy => AcquireOutcome::Busy,
        }
    }
}

/// Answers an acquire Busy (a limit, a quota or the memory budget). Cold
/// and out of line: refusals are rare, and one copy of the reply's
/// encoding keeps [`Engine::acquire_mutex`] small enough for the
/// compiler to inline what its hot path calls.
#[cold]
#[inline(never)]
pub(super) fn busy<T: Copy + Default>(
    out: &mut Outbox<T>,
    conn: ConnId,
    owner: u64,
    key: &str,
    tag: T,
) -> MutexOutcome {
    out.push_event(conn, Reply::Busy { owner, key }, 0, Grant::Fresh, tag);
    MutexOutcome::Busy
}

/// One acquire on its way through [`Engine::acquire_mutex`]: the request
/// with its lease made at least 1 s, its tag, and what the engine made of
/// it once, up front. Passed by reference to steps that are inlined, so it
/// costs no copy.
#[derive(Clone, Copy)]
pub(super) struct Ask<'a, T> {
    pub(super) now: Millis,
    pub(super) conn: ConnId,
    pub(super) key: &'a str,
    pub(super) owner: u64,
    pub(super) wait_s: u8,
    pub(super) lease_s: u8,
    pub(super) tag: T,
    /// When a grant made now ends ([`Engine::lease_end`]).
    pub(super) expires_at: Millis,
    /// Who asks ([`Caller::holder`](super::Caller::holder)).
    pub(super) holder: u64,
    /// Bytes of the memory budget left before this acquire.
    pub(super) mem_room: u64,
    /// A shared acquire of a key of limit 2 or more (PROTOCOL §6): its
    /// waiter records the mode.
    pub(super) shared: bool,
}

impl<T: Copy + Default> Ask<'_, T> {
    /// Answers this acquire Busy.
    #[inline(always)]
    fn busy(&self, out: &mut Outbox<T>) -> MutexOutcome {
        busy(out, self.conn, self.owner, self.key, self.tag)
    }

    /// The slot of this acquire's grant of `token`.
    #[inline(always)]
    fn slot(&self, token: u64) -> Slot<T> {
        Slot {
            token,
            holder: self.holder,
            expires_at: self.expires_at,
            granted_at: self.now,
            tag: self.tag,
        }
    }
}

impl<T: Copy + Default> Engine<T> {
    /// PROTOCOL §2.1. `lease_s = 0` (rejected by the codec) is treated as 1.
    /// The grant or the queued acquire carries the default tag.
    #[inline]
    pub fn acquire(
        &mut self,
        now: Millis,
        conn: ConnId,
        req: Acquire<'_>,
        out: &mut Outbox<T>,
    ) -> AcquireOutcome {
        self.acquire_tagged(now, conn, req, T::default(), out)
    }

    /// [`Engine::acquire`] with the request's `tag`: the grant carries it
    /// ([`Engine::grant`]), and so does the waiter until it is granted;
    /// every event that answers this acquire reports it.
    #[inline]
    pub fn acquire_tagged(
        &mut self,
        now: Millis,
        conn: ConnId,
        req: Acquire<'_>,
        tag: T,
        out: &mut Outbox<T>,
    ) -> AcquireOutcome {
        self.acquire_mutex(now, conn, req, tag, out).into()
    }

    /// [`Engine::acquire_tagged`]'s work, answered as a [`MutexOutcome`].
    ///
    /// One hash of the key decides among a fresh grant, a takeover and a
    /// key held by someone else (`grant_or_find`); the last is answered
    /// Timeout (`wait = 0`) or queued (`enqueue`).
    #[cfg_attr(ticketd_profile, inline(never))]
    fn acquire_mutex(
        &mut self,
        now: Millis,
        conn: ConnId,
        req: Acquire<'_>,
        tag: T,
        out: &mut Outbox<T>,
    ) -> MutexOutcome {
        let Acquire {
            key,
            owner,
            wait_s,
            lease_s,
        } = req;
        let lease_s = lease_s.max(1);
        if lease_s > self.max_lease_s {
            return busy(out, conn, owner, key, tag);
        }
        let ask = Ask {
            now,
            conn,
            key,
            owner,
            wait_s,
            lease_s,
            tag,
            expires_at: self.lease_end(now, lease_s),
            holder: self.caller.holder,
            mem_room: self.mem_limit.saturating_sub(self.memory_bytes()),
            shared: false,
        };
        let holder_expiry = match self.grant_or_find(&ask, out) {
            ControlFlow::Break(answered) => return answered,
            ControlFlow::Continue(holder_expiry) => holder_expiry,
        };
        if wait_s == 0 {
            out.push_event(conn, Reply::Timeout { owner, key }, 0, Grant::Fresh, tag);
            return MutexOutcome::Timeout;
        }
        self.enqueue(&ask, holder_expiry, out)
    }

    /// Looks the key up once and grants it if it can: a key nobody holds
    /// afresh, an expired one by takeover (each answered here: `Break`).
    /// A key held by someone else (or, in a restart grace, registered now
    /// to the grace's unknown holder) is `Continue` with the moment its
    /// lease ends. A new key beyond `max_keys` or the memory budget, a
    /// holder's key quota or the token ceiling is answered Busy.
    #[inline(always)]
    fn grant_or_find(
        &mut self,
        ask: &Ask<'_, T>,
        out: &mut Outbox<T>,
    ) -> ControlFlow<MutexOutcome, Millis> {
        let full = self.no_room_for_mutex(ask.key);
        let in_grace = self.clocked && ask.now < self.grace_until;
        let key_cost = quota::key_cost(ask.key.len());
        let key_quota = self.limits.max_keys_per_holder;
        // One hash of the key for the whole decision (the entry borrows
        // only the `keys` field, so the token is issued by field).
        let slot = match self.keys.entry(ask.key) {
            StrEntry::Vacant(_) if full || key_cost > ask.mem_room => {
                self.stats.quotas.memory += u64::from(!full);
                return ControlFlow::Break(ask.busy(out));
            }
            StrEntry::Vacant(v) if in_grace => {
                // Restart grace: the key's holder is unknown; its lease
                // ends with the grace. Token 0 is never a client's.
                v.insert(
                    KeyStr::new(ask.key),
                    Slot {
                        token: 0,
                        holder: 0,
                        expires_at: self.grace_until,
                        granted_at: ask.now,
                        tag: T::default(),
                    },
                );
                self.registered_in_grace(key_cost);
                return ControlFlow::Continue(self.grace_until);
            }
            StrEntry::Vacant(v) => {
                if !self.holders.try_add_key(ask.holder, key_quota) {
                    self.refused_for_quota(ask.holder, false);
                    return ControlFlow::Break(ask.busy(out));
                }
                let Some(token) = try_take_token(
                    &mut self.next_token,
                    self.token_rng.as_mut(),
                    self.token_ceiling,
                ) else {
                    self.holders.remove_key(ask.holder);
                    return ControlFlow::Break(ask.busy(out));
                };
                v.insert(KeyStr::new(ask.key), ask.slot(token));
                return ControlFlow::Break(self.granted_fresh(ask, token, key_cost, out));
            }
            StrEntry::Occupied(o) => o.into_mut(),
        };
        if !(self.clocked && slot.expires_at <= ask.now) {
            return ControlFlow::Continue(slot.expires_at);
        }
        let taker = ask.holder;
        if taker != slot.holder && taker != 0 && self.holders.get(taker).keys >= key_quota {
            self.refused_for_quota(taker, false);
            return ControlFlow::Break(ask.busy(out));
        }
        let Some(token) = try_take_token(
            &mut self.next_token,
            self.token_rng.as_mut(),
            self.token_ceiling,
        ) else {
            return ControlFlow::Break(ask.busy(out));
        };
        let old = std::mem::replace(slot, ask.slot(token));
        ControlFlow::Break(self.taken_over(ask, old, token, out))
    }

    /// Whether `key` may not be registered as a mutex: `max_keys` is
    /// reached (every permit of a key of limit 2 or more counts as a key),
    /// or `key` has such a limit, which an Acquire (limit 1) is answered
    /// Busy for (PROTOCOL §6.2).
    ///
    /// While no key has a limit of 2 or more (so no permit is held either)
    /// it is the one comparison it was before protocol 1.2; the rest is
    /// out of line.
    #[inline(always)]
    fn no_room_for_mutex(&self, key: &str) -> bool {
        if self.permits.is_empty() {
            return self.keys.len() >= self.limits.max_keys;
        }
        self.no_room_beside_permits(key)
    }

    /// [`Engine::no_room_for_mutex`] while the permit table holds keys.
    #[cold]
    #[inline(never)]
    fn no_room_beside_permits(&self, key: &str) -> bool {
        self.keys.len() + self.permit_grants >= self.limits.max_keys
            || self.permits.contains_key(key)
    }

    /// Counts a key just registered to a restart grace's unknown holder
    /// (holder 0, token 0, its lease ending with the grace).
    #[inline]
    fn registered_in_grace(&mut self, key_cost: u64) {
        let grace_until = self.grace_until;
        self.key_bytes += key_cost;
        self.holders.add_key(0);
        self.expiry_floor = self.expiry_floor.min(grace_until);
        if let Some(pass) = &mut self.sweep {
            pass.inserted = true;
            pass.floor = pass.floor.min(grace_until);
        }
    }

    /// Counts and answers a fresh grant of `token`, just inserted: the
    /// uncontended acquire's path, where the key costs `key_cost` bytes.
    #[inline(always)]
    fn granted_fresh(
        &mut self,
        ask: &Ask<'_, T>,
        token: u64,
        key_cost: u64,
        out: &mut Outbox<T>,
    ) -> MutexOutcome {
        self.key_bytes += key_cost;
        if let Some(pass) = &mut self.sweep {
            pass.inserted = true;
        }
        self.note_lease_end(ask.expires_at);
        self.stats.grants_fresh += 1;
        if self.clocked {
            self.stats.wait_ms.observe(0);
            self.holds.start(ask.now);
        }
        out.push_reply(
            ask.conn,
            Kind::Acquired(Grant::Fresh),
            token,
            ask.owner,
            ask.key,
            ask.lease_s,
            ask.tag,
        );
        MutexOutcome::Granted(token)
    }

    /// Counts and answers a lazy takeover: the grant `old`, whose lease
    /// ran out, was replaced by `token`'s (the non-FIFO expiry path, ahead
    /// of any queue). The key's timer (if it has waiters) is at or before
    /// the old expiry, so it is early now, never late.
    #[inline]
    fn taken_over(
        &mut self,
        ask: &Ask<'_, T>,
        old: Slot<T>,
        token: u64,
        out: &mut Outbox<T>,
    ) -> MutexOutcome {
        let key = ask.key;
        if old.token != 0 {
            out.push_expired(key, old.token);
            self.stats.lease_expiries += 1;
            self.stats
                .hold_ms
                .observe(old.expires_at.since(old.granted_at));
            self.holds.end(old.granted_at);
        }
        self.holders.move_key(old.holder, ask.holder);
        self.holds.start(ask.now);
        self.note_lease_end(ask.expires_at);
        self.stats.grants_takeover += 1;
        self.stats.wait_ms.observe(0);
        let owner = ask.owner;
        let reply = Reply::Acquired { token, owner, key };
        out.push_event(ask.conn, reply, ask.lease_s, Grant::Takeover, ask.tag);
        MutexOutcome::Granted(token)
    }

    /// Queues the acquire behind the grant that ends at `holder_expiry`,
    /// unless the waiter limits, the holder's waiter quota or the memory
    /// budget refuse it (Busy).
    #[inline]
    pub(super) fn enqueue(
        &mut self,
        ask: &Ask<'_, T>,
        holder_expiry: Millis,
        out: &mut Outbox<T>,
    ) -> MutexOutcome {
        let key = ask.key;
        let queued = self.queues.get(key).map_or(0, |q| q.waiters.len());
        if queued >= self.limits.max_waiters_per_key
            || self.waiters_total >= self.limits.max_waiters
            || self.waiters_total >= WAITERS_CEILING
        {
            return ask.busy(out);
        }
        if self.waiter_refused(ask.holder, queued == 0, key.len(), ask.mem_room) {
            return ask.busy(out);
        }
        let id = self.next_waiter;
        self.next_waiter = if id + 1 >= WAITER_ID_LIMIT { 1 } else { id + 1 };
        let wait_deadline = self.deadline(ask.now, ask.wait_s);
        let name = self.queue_name(key);
        let (conn_idx, slot) = self.conn_table.add(ask.conn, ask.holder, name);
        self.holders
            .add_waiter(self.conn_table.conns[conn_idx as usize].holder);
        let waiter = Waiter {
            owner: ask.owner,
            wait_deadline,
            id_lease: if ask.shared { SHARED_BIT } else { 0 }
                | id << 16
                | u64::from(ask.wait_s) << 8
                | u64::from(ask.lease_s),
            conn: conn_idx,
            slot,
            tag: ask.tag,
        };
        let queue = self.queues.get_mut(key).expect("queue inserted above");
        queue.waiters.push_back(waiter);
        let due = wait_deadline.min(holder_expiry);
        if due < queue.timer_at {
            self.set_timer(key, due);
        }
        self.waiters_total += 1;
        MutexOutcome::Queued(id)
    }

    /// The queue's shared copy of `key`, its queue made (empty, without a
    /// timer) if the key has none yet.
    fn queue_name(&mut self, key: &str) -> Arc<str> {
        if !self.queues.contains_key(key) {
            self.queue_bytes += quota::queue_cost(key.len());
            self.queues.insert_new(
                Arc::from(key),
                Queue {
                    waiters: VecDeque::new(),
                    timer_at: Millis::NEVER,
                    timer_seq: 0,
                },
            );
        }
        let (name, _) = self
            .queues
            .get_key_value(key)
            .expect("queue inserted above");
        Arc::clone(name)
    }
}

//! Acquire (PROTOCOL §2.1): a fresh grant, a takeover, a Busy or Timeout
//! answer, or a queued waiter.

use std::collections::VecDeque;
use std::sync::Arc;

use super::conns::WAITERS_CEILING;
use super::tokens::try_take_token;
use super::waiters::{Queue, Waiter, WAITER_ID_LIMIT};
use super::{quota, Acquire, AcquireOutcome, ConnId, Engine, Grant, Kind, Outbox, Slot};
use crate::hash::{KeyStr, StrEntry};
use crate::proto::Reply;
use crate::time::Millis;

/// Answers an acquire Busy (a limit, a quota or the memory budget). Cold
/// and out of line: refusals are rare, and one copy of the reply's
/// encoding keeps [`Engine::acquire_tagged`] small enough for the
/// compiler to inline what its hot path calls.
#[cold]
#[inline(never)]
fn busy<T: Copy + Default>(
    out: &mut Outbox<T>,
    conn: ConnId,
    owner: u64,
    key: &str,
    tag: T,
) -> AcquireOutcome {
    out.push_event(conn, Reply::Busy { owner, key }, 0, Grant::Fresh, tag);
    AcquireOutcome::Busy
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
    // Long because it is the per-request acquire, kept in one piece for
    // speed: one hash of the key and one entry decide among a fresh grant,
    // a takeover, a busy or timeout answer and a queued waiter; split, each
    // step would hash the key again or carry the entry and half the tables.
    #[cfg_attr(ticketd_profile, inline(never))]
    pub fn acquire_tagged(
        &mut self,
        now: Millis,
        conn: ConnId,
        req: Acquire<'_>,
        tag: T,
        out: &mut Outbox<T>,
    ) -> AcquireOutcome {
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
        let expires_at = self.lease_end(now, lease_s);
        let full = self.keys.len() >= self.limits.max_keys;
        let in_grace = self.clocked && now < self.grace_until;
        let mem_room = self.mem_limit.saturating_sub(self.memory_bytes());
        let key_cost = quota::key_cost(key.len());
        let holder = self.caller.holder;
        let key_quota = self.limits.max_keys_per_holder;
        // One hash of the key for the whole decision (the entry borrows
        // only the `keys` field, so the token is issued by field).
        let slot = match self.keys.entry(key) {
            StrEntry::Vacant(_) if full || key_cost > mem_room => {
                self.stats.quotas.memory += u64::from(!full);
                return busy(out, conn, owner, key, tag);
            }
            StrEntry::Vacant(v) if in_grace => {
                // Restart grace: the key's holder is unknown; its lease
                // ends with the grace. Token 0 is never a client's.
                let grace_until = self.grace_until;
                self.key_bytes += key_cost;
                self.holders.add_key(0);
                self.expiry_floor = self.expiry_floor.min(grace_until);
                if let Some(pass) = &mut self.sweep {
                    pass.inserted = true;
                    pass.floor = pass.floor.min(grace_until);
                }
                v.insert(
                    KeyStr::new(key),
                    Slot {
                        token: 0,
                        holder: 0,
                        expires_at: grace_until,
                        granted_at: now,
                        tag: T::default(),
                    },
                )
            }
            StrEntry::Vacant(v) => {
                if !self.holders.try_add_key(holder, key_quota) {
                    self.refused_for_quota(holder, false);
                    return busy(out, conn, owner, key, tag);
                }
                let Some(token) = try_take_token(
                    &mut self.next_token,
                    self.token_rng.as_mut(),
                    self.token_ceiling,
                ) else {
                    self.holders.remove_key(holder);
                    return busy(out, conn, owner, key, tag);
                };
                v.insert(
                    KeyStr::new(key),
                    Slot {
                        token,
                        holder,
                        expires_at,
                        granted_at: now,
                        tag,
                    },
                );
                self.key_bytes += key_cost;
                if let Some(pass) = &mut self.sweep {
                    pass.inserted = true;
                }
                self.note_lease_end(expires_at);
                self.stats.grants_fresh += 1;
                if self.clocked {
                    self.stats.wait_ms.observe(0);
                    self.holds.start(now);
                }
                out.push_reply(
                    conn,
                    Kind::Acquired(Grant::Fresh),
                    token,
                    owner,
                    key,
                    lease_s,
                    tag,
                );
                return AcquireOutcome::Granted(token);
            }
            StrEntry::Occupied(o) => o.into_mut(),
        };
        let holder_expiry = slot.expires_at;
        if self.clocked && slot.expires_at <= now {
            if holder != slot.holder && holder != 0 && self.holders.get(holder).keys >= key_quota {
                self.refused_for_quota(holder, false);
                return busy(out, conn, owner, key, tag);
            }
            let Some(token) = try_take_token(
                &mut self.next_token,
                self.token_rng.as_mut(),
                self.token_ceiling,
            ) else {
                return busy(out, conn, owner, key, tag);
            };
            // Lazy takeover: the non-FIFO expiry path, ahead of any queue.
            // The key's timer (if it has waiters) is at or before the old
            // expiry, so it is early now, never late.
            if slot.token != 0 {
                out.push_expired(key, slot.token);
                self.stats.lease_expiries += 1;
                self.stats
                    .hold_ms
                    .observe(slot.expires_at.since(slot.granted_at));
                self.holds.end(slot.granted_at);
            }
            self.holders.move_key(slot.holder, holder);
            slot.token = token;
            slot.holder = holder;
            slot.expires_at = expires_at;
            slot.granted_at = now;
            slot.tag = tag;
            self.holds.start(now);
            self.note_lease_end(expires_at);
            self.stats.grants_takeover += 1;
            self.stats.wait_ms.observe(0);
            out.push_event(
                conn,
                Reply::Acquired { token, owner, key },
                lease_s,
                Grant::Takeover,
                tag,
            );
            return AcquireOutcome::Granted(token);
        }
        if wait_s == 0 {
            out.push_event(conn, Reply::Timeout { owner, key }, 0, Grant::Fresh, tag);
            return AcquireOutcome::Timeout;
        }
        let queued = self.queues.get(key).map_or(0, |q| q.waiters.len());
        if queued >= self.limits.max_waiters_per_key
            || self.waiters_total >= self.limits.max_waiters
            || self.waiters_total >= WAITERS_CEILING
        {
            return busy(out, conn, owner, key, tag);
        }
        if self.waiter_refused(holder, queued == 0, key.len(), mem_room) {
            return busy(out, conn, owner, key, tag);
        }
        let id = self.next_waiter;
        self.next_waiter = if id + 1 >= WAITER_ID_LIMIT { 1 } else { id + 1 };
        let wait_deadline = self.deadline(now, wait_s);
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
        let (conn_idx, slot) = self.conn_table.add(conn, holder, Arc::clone(name));
        self.holders
            .add_waiter(self.conn_table.conns[conn_idx as usize].holder);
        let waiter = Waiter {
            owner,
            wait_deadline,
            id_lease: id << 16 | u64::from(wait_s) << 8 | u64::from(lease_s),
            conn: conn_idx,
            slot,
            tag,
        };
        let queue = self.queues.get_mut(key).expect("queue inserted above");
        queue.waiters.push_back(waiter);
        let due = wait_deadline.min(holder_expiry);
        if due < queue.timer_at {
            self.set_timer(key, due);
        }
        self.waiters_total += 1;
        AcquireOutcome::Queued(id)
    }
}

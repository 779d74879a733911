//! Queued acquires: the wait queue of a key, its waiters, and what ends a
//! wait without a grant (a timeout, a disconnect).

use std::collections::VecDeque;
use std::sync::Arc;

use super::conns::{ConnSlot, ConnWaiters};
use super::{ConnId, Engine, Grant, Outbox, WaiterId};
use crate::proto::Reply;
use crate::time::Millis;

/// Waiter ids fit in 47 bits; the low 16 bits of `Waiter::id_lease` hold the
/// wait and the lease and its top bit the mode ([`SHARED_BIT`]), so a
/// waiter is 32 bytes. 2^47 ids last four years at a million queued
/// acquires a second; past that the counter wraps to 1 (a waiter lives at
/// most 255 s in single mode, so a wrapped id never meets a live one
/// there).
pub(super) const WAITER_ID_LIMIT: u64 = 1 << 47;

/// The bit of `Waiter::id_lease` set for a shared acquire (PROTOCOL §6).
pub(super) const SHARED_BIT: u64 = 1 << 63;

/// One queued acquire: 32 bytes.
#[derive(Debug)]
pub(super) struct Waiter<T = ()> {
    pub(super) owner: u64,
    pub(super) wait_deadline: Millis,
    /// `shared << 63 | id << 16 | wait_s << 8 | lease_s`.
    pub(super) id_lease: u64,
    /// Index of its connection in
    /// [`ConnTable::conns`](super::conns::ConnTable::conns).
    pub(super) conn: u32,
    /// Index of its entry in that connection's [`ConnWaiters::slots`].
    pub(super) slot: u32,
    /// The acquire's tag; the grant's once it is granted.
    pub(super) tag: T,
}

impl<T> Waiter<T> {
    pub(super) fn id(&self) -> WaiterId {
        (self.id_lease & !SHARED_BIT) >> 16
    }

    /// Whether it asked for a shared place (PROTOCOL §6; a mutex's
    /// waiters are exclusive).
    pub(super) fn shared(&self) -> bool {
        self.id_lease & SHARED_BIT != 0
    }

    /// When it was queued (clocked mode): its wait deadline less its wait.
    pub(super) fn queued_at(&self) -> Millis {
        let wait_s = (self.id_lease >> 8) & 0xFF;
        Millis(self.wait_deadline.0.saturating_sub(wait_s * 1000))
    }

    pub(super) fn lease_s(&self) -> u8 {
        (self.id_lease & 0xFF) as u8
    }

    pub(super) fn wait_s(&self) -> u8 {
        ((self.id_lease >> 8) & 0xFF) as u8
    }
}

/// The wait queue of a key that has waiters. A key without waiters has none.
#[derive(Debug)]
pub(super) struct Queue<T> {
    pub(super) waiters: VecDeque<Waiter<T>>,
    /// Deadline of this key's entry in the deadline index, or NEVER while
    /// it has none (`tick` is processing it, or replicated mode). Never later
    /// than the first moment something is due for the key (its holder's
    /// expiry, a waiter's deadline); it may be earlier, and then the entry
    /// fires early and `tick` reschedules it.
    pub(super) timer_at: Millis,
    /// Sequence number of that entry: with `timer_at`, its index key.
    pub(super) timer_seq: u64,
}

impl<T: Copy + Default> Engine<T> {
    /// Answers the queued acquire `waiter` on `key` with Timeout and removes
    /// it. A stale one (already granted, timed out or cancelled) does nothing
    /// and returns false.
    pub fn wait_timeout(
        &mut self,
        now: Millis,
        key: &str,
        waiter: WaiterId,
        out: &mut Outbox<T>,
    ) -> bool {
        let Some(queue) = self.queues.get_mut(key) else {
            return false;
        };
        let Some(pos) = queue.waiters.iter().position(|w| w.id() == waiter) else {
            return false;
        };
        let w = queue.waiters.remove(pos).expect("position is in range");
        let emptied = queue.waiters.is_empty();
        let conn = self.forget_waiter(&w);
        out.push_event(
            conn,
            Reply::Timeout {
                owner: w.owner,
                key,
            },
            0,
            Grant::Fresh,
            w.tag,
        );
        if emptied {
            self.drop_queue(key);
        }
        if !self.permits.is_empty() && self.permits.contains_key(key) {
            // The head may have been what kept the next from a place.
            self.settle_permits(now, key, out);
        }
        true
    }

    /// Cancels every acquire `conn` has queued, with no reply (the connection
    /// is gone). What `conn` holds stays held until released or expired.
    ///
    /// O(1) when `conn` has no waiters; otherwise it visits only the queues
    /// `conn` is in: O(its waiters + the length of those queues).
    pub fn disconnect(&mut self, now: Millis, conn: ConnId, out: &mut Outbox<T>) {
        let Some(idx) = self.conn_table.index.remove(&conn) else {
            return;
        };
        let ConnWaiters {
            slots: mut keys,
            count,
            holder,
            ..
        } = self.conn_table.conns.remove(idx as usize);
        // Several waiters on one key share the queue's copy of the key:
        // visit each queue once.
        keys.retain(|s| matches!(s, ConnSlot::Queued(_)));
        keys.sort_unstable_by_key(|s| match s {
            ConnSlot::Queued(k) => Arc::as_ptr(k).cast::<u8>() as usize,
            ConnSlot::Free(_) => 0,
        });
        keys.dedup_by(|a, b| match (a, b) {
            (ConnSlot::Queued(a), ConnSlot::Queued(b)) => Arc::ptr_eq(a, b),
            _ => false,
        });
        let mut removed = 0usize;
        let mut settle = Vec::new();
        for entry in keys.drain(..) {
            let ConnSlot::Queued(key) = entry else {
                continue;
            };
            let Some(q) = self.queues.get_mut(&key) else {
                continue;
            };
            let before = q.waiters.len();
            // The index is this connection's until the table reuses it,
            // which it cannot before this call returns.
            q.waiters.retain(|w| w.conn != idx);
            removed += before - q.waiters.len();
            if q.waiters.is_empty() {
                self.drop_queue(&key);
            }
            if !self.permits.is_empty() && self.permits.contains_key(&key) {
                settle.push(key);
            }
        }
        debug_assert_eq!(removed, count as usize, "per-connection count drifted");
        self.waiters_total -= removed;
        self.holders.remove_waiters(holder, removed);
        self.conn_table.recycle(keys);
        // A waiter gone from the head of a permit key's queue may have
        // kept the next from a place. In key order, so that the tokens
        // issued depend only on the lock state (replicated engines agree).
        settle.sort_unstable();
        for key in settle {
            self.settle_permits(now, &key, out);
        }
    }

    /// Forgets a waiter taken out of its queue; returns its connection.
    pub(super) fn forget_waiter(&mut self, w: &Waiter<T>) -> ConnId {
        self.waiters_total -= 1;
        let holder = self.conn_table.conns[w.conn as usize].holder;
        self.holders.remove_waiters(holder, 1);
        self.conn_table.remove(w.conn, w.slot)
    }

    /// Answers with Timeout every waiter of `key` whose wait ran out by `now`
    /// (all of them with `all`), in queue order. Leaves an empty queue in
    /// place; callers drop it.
    pub(super) fn time_out_waiters(
        &mut self,
        now: Millis,
        key: &str,
        all: bool,
        out: &mut Outbox<T>,
    ) {
        let Some(queue) = self.queues.get_mut(key) else {
            return;
        };
        let mut gone = 0usize;
        let conns = &mut self.conn_table;
        let holders = &mut self.holders;
        queue.waiters.retain(|w| {
            let leaving = all || w.wait_deadline <= now;
            if leaving {
                gone += 1;
                holders.remove_waiters(conns.conns[w.conn as usize].holder, 1);
                let conn = conns.remove(w.conn, w.slot);
                out.push_event(
                    conn,
                    Reply::Timeout {
                        owner: w.owner,
                        key,
                    },
                    0,
                    Grant::Fresh,
                    w.tag,
                );
            }
            !leaving
        });
        self.waiters_total -= gone;
    }
}

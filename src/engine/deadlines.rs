//! The deadline index: one timer per key with waiters, and the tick that
//! processes the keys that are due.

use std::sync::Arc;

use super::{quota, Engine, Outbox};
use crate::time::Millis;

impl<T: Copy + Default> Engine<T> {
    /// Moves the timer entry of `key`'s queue to `at` (NEVER: removes it).
    /// The entry shares the queue's copy of the key.
    pub(super) fn set_timer(&mut self, key: &str, at: Millis) {
        let Some((name, q)) = self.queues.get_key_value(key) else {
            return;
        };
        let old = (q.timer_at, q.timer_seq);
        let name = Arc::clone(name);
        if old.0 != Millis::NEVER {
            self.timers.remove(&old);
        }
        let mut seq = 0;
        if at != Millis::NEVER {
            self.timer_seq += 1;
            seq = self.timer_seq;
            self.timers.insert((at, seq), name);
        }
        if let Some(q) = self.queues.get_mut(key) {
            q.timer_at = at;
            q.timer_seq = seq;
        }
    }

    /// Drops `key`'s queue and its timer entry.
    pub(super) fn drop_queue(&mut self, key: &str) {
        if let Some(q) = self.queues.remove(key) {
            self.queue_bytes -= quota::queue_cost(key.len());
            if q.timer_at != Millis::NEVER {
                self.timers.remove(&(q.timer_at, q.timer_seq));
            }
        }
    }

    /// After a change of holder or a tick: drops an empty queue, or points
    /// the key's timer at or before the first thing due. Keeps an existing
    /// early entry (O(1)); computes the exact moment (O(waiters)) only when
    /// the key has no entry, that is inside `tick`.
    pub(super) fn reschedule(&mut self, key: &str) {
        let Some(queue) = self.queues.get(key) else {
            return;
        };
        if queue.waiters.is_empty() {
            self.drop_queue(key);
            return;
        }
        if !self.clocked {
            return;
        }
        let holder_expiry = self.first_grant_end(key);
        let due = if queue.timer_at == Millis::NEVER {
            queue
                .waiters
                .iter()
                .map(|w| w.wait_deadline)
                .min()
                .unwrap_or(Millis::NEVER)
                .min(holder_expiry)
        } else {
            queue.timer_at.min(holder_expiry)
        };
        if due != queue.timer_at {
            self.set_timer(key, due);
        }
    }

    /// Processes everything due by `now` (single mode): waits that ran out get
    /// T, an expired key with waiters goes to its head waiter, and every
    /// `sweep_interval_ms` expired keys without waiters are deleted. Does
    /// nothing in replicated mode.
    pub fn tick(&mut self, now: Millis, out: &mut Outbox<T>) {
        if !self.clocked {
            return;
        }
        // Collect the keys that are due, then process them in key order: the
        // order of replies and tokens within one tick then depends only on
        // the lock state, not on the history of the timer index (entries can
        // be early: see `Queue::timer_at`). Keys do not interact, so any
        // order is correct; a canonical one is checkable against a model.
        let mut due = std::mem::take(&mut self.due_scratch);
        while let Some(entry) = self.timers.first_entry() {
            let (at, seq) = *entry.key();
            if at > now {
                break;
            }
            let key = entry.remove();
            if let Some(q) = self.queues.get_mut(&key) {
                // Entries are removed when they move, so this is the
                // queue's own; checked anyway rather than trusted.
                if (q.timer_at, q.timer_seq) == (at, seq) {
                    q.timer_at = Millis::NEVER;
                    due.push(key);
                }
            }
        }
        due.sort_unstable();
        for key in due.drain(..) {
            self.time_out_waiters(now, &key, false, out);
            if !self.permits.is_empty() && self.permits.contains_key(&key) {
                self.settle_permits(now, &key, out);
                continue;
            }
            let expired = self.keys.get(&key).is_some_and(|s| s.expires_at <= now);
            let waiting = self.queues.get(&key).is_some_and(|q| !q.waiters.is_empty());
            if expired && waiting {
                if let Some(s) = self.keys.get(&key).filter(|s| s.token != 0) {
                    out.push_expired(&key, s.token);
                    self.stats.lease_expiries += 1;
                    self.stats.hold_ms.observe(s.expires_at.since(s.granted_at));
                    self.holds.end(s.granted_at);
                }
                self.hand_over_or_delete(now, &key, out);
            } else {
                self.reschedule(&key);
            }
        }
        self.due_scratch = due;
        self.sweep_step(now, out);
    }

    /// The next moment [`Engine::tick`] has work, for the poll timeout.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Millis> {
        if !self.clocked {
            return None;
        }
        let timer = self.timers.first_key_value().map(|(&(at, _), _)| at);
        // The sweep has work once it is due and some lease may have ended,
        // and at once while a pass is under way.
        let sweep = if self.sweep.is_some() {
            Some(Millis::ZERO)
        } else {
            (!self.keys.is_empty() || !self.permits.is_empty())
                .then_some(self.next_sweep.max(self.expiry_floor))
        };
        match (timer, sweep) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

//! Release (PROTOCOL §2.2), a committed expiry, and the handover of a key
//! whose grant ended to its head waiter.

use super::{quota, ConnId, Engine, Grant, Kind, Outbox};
use crate::proto::Reply;
use crate::time::Millis;

impl<T: Copy + Default> Engine<T> {
    /// PROTOCOL §2.2. Returns true when the release took effect (`R`).
    #[cfg_attr(ticketd_profile, inline(never))]
    pub fn release(
        &mut self,
        now: Millis,
        conn: ConnId,
        token: u64,
        key: &str,
        out: &mut Outbox<T>,
    ) -> bool {
        // No client holds token 0: it marks the unknown holder of a key
        // during a restart grace.
        if token == 0 {
            out.push(conn, Reply::NotReleased { token, key }, 0);
            return false;
        }
        // One lookup of the key in the mutex table answers every case: a
        // miss goes on to the permits, or is answered N.
        let Some(o) = self.keys.find_entry(key) else {
            if !self.permits.is_empty() {
                if let Some(done) = self.release_permit(now, conn, token, key, out) {
                    return done;
                }
            }
            out.push(conn, Reply::NotReleased { token, key }, 0);
            return false;
        };
        let slot = o.get();
        if slot.token != token || !self.caller.may_act_on(slot.holder) {
            out.push(conn, Reply::NotReleased { token, key }, 0);
            return false;
        }
        let granted_at = slot.granted_at;
        if self.clocked {
            self.stats.hold_ms.observe(now.since(granted_at));
            self.holds.end(granted_at);
        }
        if !self.queues.contains_key(key) {
            // The common case, a key nobody waits for, costs one hash of
            // the key (none for the queue map while no key has waiters).
            let (_, slot) = o.remove();
            self.forget_key(key, slot.holder);
            out.push_reply(conn, Kind::Released, token, 0, key, 0, T::default());
            return true;
        }
        out.push(conn, Reply::Released { token, key }, 0);
        self.hand_over_or_delete(now, key, out);
        true
    }

    /// Ends the current grant of `key` if its token is `token`: the head
    /// waiter gets the key, or the key is deleted. This is the committed
    /// `Expire{key, token}` of cluster mode; a stale one (the token moved on,
    /// or the key is gone) does nothing and returns false. No reply goes to
    /// the old holder.
    pub fn expire(&mut self, now: Millis, key: &str, token: u64, out: &mut Outbox<T>) -> bool {
        match self.keys.get(key) {
            Some(slot) if slot.token == token => {
                self.stats.lease_expiries += 1;
                out.push_expired(key, token);
                if self.clocked && token != 0 {
                    self.holds.end(slot.granted_at);
                }
                self.hand_over_or_delete(now, key, out);
                true
            }
            Some(_) => false,
            None => !self.permits.is_empty() && self.expire_permit(now, key, token, out),
        }
    }

    /// Deletes the registration of `key`, whatever it holds.
    pub(super) fn delete_key(&mut self, key: &str) {
        if let Some(slot) = self.keys.remove(key) {
            self.forget_key(key, slot.holder);
        }
    }

    /// Uncounts a registered key named `key`, taken by `holder`, that was
    /// just deleted.
    #[inline]
    pub(super) fn forget_key(&mut self, key: &str, holder: u64) {
        self.holders.remove_key(holder);
        self.key_bytes -= quota::key_cost(key.len());
    }

    /// The current grant of `key` ends: grant the head waiter whose wait has
    /// not run out (FIFO, a new token, its own lease from `now`), or delete
    /// the key when nobody is waiting.
    pub(super) fn hand_over_or_delete(&mut self, now: Millis, key: &str, out: &mut Outbox<T>) {
        // Most keys never get a waiter: one queue lookup (no hashing at all
        // while no key has waiters) settles the common case, then one more
        // hash deletes the key. Every lookup hashes the whole key with the
        // table's keyed hasher, which dominates an uncontended cycle.
        let Some(q) = self.queues.get(key) else {
            self.delete_key(key);
            return;
        };
        // A waiter whose wait ran out gets T even if its timer has not
        // fired. `timer_at` is never later than the first waiter deadline,
        // so when it is still ahead nobody ran out (and inside `tick`,
        // NEVER, the caller just did this).
        if self.tokens_exhausted() {
            self.time_out_waiters(now, key, true, out);
        } else if self.clocked && q.timer_at <= now {
            self.time_out_waiters(now, key, false, out);
        }
        let head = self.queues.get_mut(key).and_then(|q| q.waiters.pop_front());
        let Some(w) = head else {
            self.drop_queue(key);
            self.delete_key(key);
            return;
        };
        let holder = self.conn_table.conns[w.conn as usize].holder;
        let conn = self.forget_waiter(&w);
        let token = self.issue_token();
        self.stats.grants_handover += 1;
        if self.clocked {
            self.stats.wait_ms.observe(now.since(w.queued_at()));
            self.holds.start(now);
        }
        let lease_s = w.lease_s();
        let expires_at = self.lease_end(now, lease_s);
        let slot = self
            .keys
            .get_mut(key)
            .expect("a key with a queue is registered");
        self.holders.move_key(slot.holder, holder);
        slot.token = token;
        slot.holder = holder;
        slot.expires_at = expires_at;
        slot.granted_at = now;
        slot.tag = w.tag;
        self.note_lease_end(expires_at);
        out.push_event(
            conn,
            Reply::Acquired {
                token,
                owner: w.owner,
                key,
            },
            lease_s,
            Grant::Handover,
            w.tag,
        );
        self.reschedule(key);
    }
}

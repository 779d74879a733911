//! Keys of a limit of 2 or more (PROTOCOL §6): counting semaphores and
//! shared/exclusive locks.
//!
//! Every grant of such a key is a permit with a token and a lease of its
//! own, released and extended by token like a mutex's grant. The key's
//! waiters use the wait queues, the deadline index and the connection
//! table of a mutex; only the waiter's mode bit is new. A key of limit 1
//! is a mutex, whatever the mode asked, and lives in the key table; a key
//! is registered in one of the two tables, never both.
//!
//! A set whose grants all ended stays while waiters remain; the last end
//! with nobody waiting deletes it. There is no takeover: an acquire gets a
//! place only when it fits and nobody is queued before it, so the queue
//! stays FIFO through expiry. In single mode the grants past their lease
//! are ended when the key's timer fires (a key with waiters), when an
//! acquire or release of the key finds them, or by the sweep.
//!
//! Costs: a set is one table entry (the key, the limit and its grants:
//! the first in place, more in a vector of 40 bytes a grant). Release and
//! extend find a grant by token in O(grants of the key), which is at most
//! the key's limit.

use super::acquire::{busy, Ask};
pub(super) use super::permit_set::{Grants, Permit, PermitSet};
use super::sweep::record_lapse;
use super::tokens::try_take_token;
use super::{quota, Acquire, AcquireOutcome, ConnId, Engine, Grant, Kind, Outbox, Slot};
use crate::hash::{KeyStr, Probe};
use crate::proto::{Mode, Places, Reply};
use crate::time::Millis;

/// Where an acquire with a limit stands on its key ([`Engine::place_for`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Found {
    /// The key has no permits: registering it grants the acquire.
    Absent,
    /// A place is free and nobody waits before it.
    Fits,
    /// No place for it now: Timeout or queued.
    Full,
}

impl<T: Copy + Default> Engine<T> {
    /// PROTOCOL §6.2: an acquire of one of `places.limit` places of `key`,
    /// in `places.mode`. With limit 1 it is [`Engine::acquire_tagged`] (a mutex),
    /// unless the key has a greater limit. A key registered with another
    /// limit answers LimitMismatch; otherwise the acquire is granted when
    /// it fits and nobody waits before it, or answered Timeout (`wait =
    /// 0`) or queued, as a mutex's. `limit = 0` (rejected by the codec) is
    /// taken as 1.
    // Long because it is the table of PROTOCOL §6.2, one row after another.
    #[inline(never)]
    pub fn acquire_with_limit(
        &mut self,
        now: Millis,
        conn: ConnId,
        req: Acquire<'_>,
        places: Places,
        tag: T,
        out: &mut Outbox<T>,
    ) -> AcquireOutcome {
        let Places { limit, mode } = places;
        let Acquire {
            key,
            owner,
            wait_s,
            lease_s,
        } = req;
        if limit <= 1 {
            if let Some(set) = self.permits.get(key) {
                return self.limit_mismatch(out, conn, owner, set.limit, key, tag);
            }
            return self.acquire_tagged(now, conn, req, tag, out);
        }
        if self.keys.contains_key(key) {
            return self.limit_mismatch(out, conn, owner, 1, key, tag);
        }
        let lease_s = lease_s.max(1);
        if lease_s > self.max_lease_s {
            return busy(out, conn, owner, key, tag).into();
        }
        let exclusive = mode == Mode::Exclusive;
        // One look at the key decides, unless something of it is due
        // (a lapsed permit, a wait run out): then it is settled first,
        // and looked up again.
        let mut probe = self.permits.probe(key);
        let set = probe.bucket().and_then(|b| self.permits.get_bucket(b));
        let found = match set {
            Some(set) if set.limit != limit => {
                return self.limit_mismatch(out, conn, owner, set.limit, key, tag);
            }
            Some(set) => self.place_for(now, key, set, exclusive),
            None => Some(Found::Absent),
        };
        let mut found = match found {
            Some(found) => found,
            None => {
                let found = self.settled_place(now, key, exclusive, out);
                probe = self.permits.probe(key);
                found
            }
        };
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
            shared: !exclusive,
        };
        if found == Found::Absent && self.clocked && now < self.grace_until {
            self.register_permits_in_grace(now, key, limit);
            found = Found::Full;
        }
        if found != Found::Full {
            return self.grant_permit(&ask, (limit, probe), exclusive, out);
        }
        self.wait_for_place(&ask, out)
    }

    /// No place for `ask` now: Timeout with no wait, else queued, timed by
    /// the earliest lease end of the key's grants. The key is looked up
    /// again: a restart grace may have registered it since the acquire's
    /// probe.
    fn wait_for_place(&mut self, ask: &Ask<'_, T>, out: &mut Outbox<T>) -> AcquireOutcome {
        let (owner, key) = (ask.owner, ask.key);
        if ask.wait_s == 0 {
            let reply = Reply::Timeout { owner, key };
            out.push_event(ask.conn, reply, 0, Grant::Fresh, ask.tag);
            return AcquireOutcome::Timeout;
        }
        let first_end = self
            .permits
            .get(key)
            .map_or(Millis::NEVER, PermitSet::earliest_end);
        self.enqueue(ask, first_end, out).into()
    }

    /// Where an acquire in this mode stands on `key`'s permits `set`, or
    /// `None` when something of the key is due at `now` (a permit past
    /// its lease, a wait run out, the tokens exhausted) and it must be
    /// settled first. Nothing else can change what the queue's head is
    /// owed, so without it the set is as the last change left it.
    fn place_for(
        &self,
        now: Millis,
        key: &str,
        set: &PermitSet<T>,
        exclusive: bool,
    ) -> Option<Found> {
        let queue = self.queues.get(key);
        let overdue = queue.is_some_and(|q| q.timer_at <= now);
        let due = self.clocked && (overdue || set.earliest_end() <= now);
        if due || self.tokens_exhausted() {
            return None;
        }
        Some(if queue.is_none() && set.fits(exclusive) {
            Found::Fits
        } else {
            Found::Full
        })
    }

    /// Settles `key` ([`Engine::settle_permits`]) and says where an
    /// acquire in this mode stands on it then.
    fn settled_place(
        &mut self,
        now: Millis,
        key: &str,
        exclusive: bool,
        out: &mut Outbox<T>,
    ) -> Found {
        self.settle_permits(now, key, out);
        self.permits.get(key).map_or(Found::Absent, |set| {
            if set.fits(exclusive) && !self.queues.contains_key(key) {
                Found::Fits
            } else {
                Found::Full
            }
        })
    }

    /// Answers an acquire LimitMismatch with the key's `limit`, counted.
    #[cold]
    #[inline(never)]
    fn limit_mismatch(
        &mut self,
        out: &mut Outbox<T>,
        conn: ConnId,
        owner: u64,
        limit: u16,
        key: &str,
        tag: T,
    ) -> AcquireOutcome {
        self.stats.limit_mismatches += 1;
        out.push_event(
            conn,
            Reply::LimitMismatch { owner, limit, key },
            0,
            Grant::Fresh,
            tag,
        );
        AcquireOutcome::LimitMismatch(limit)
    }

    /// Counts a grant of a key of limit 2 or more by its mode.
    fn count_permit_grant(&mut self, exclusive: bool) {
        if exclusive {
            self.stats.permit_grants_exclusive += 1;
        } else {
            self.stats.permit_grants_shared += 1;
        }
    }

    /// Restart grace: registers `key` with `limit` and one exclusive grant
    /// of the grace's unknown holder (token 0), whose lease ends with the
    /// grace, as a mutex key is in the grace.
    fn register_permits_in_grace(&mut self, now: Millis, key: &str, limit: u16) {
        let grace_until = self.grace_until;
        let slot = Slot {
            token: 0,
            holder: 0,
            expires_at: grace_until,
            granted_at: now,
            tag: T::default(),
        };
        self.permits.insert_new(
            KeyStr::new(key),
            PermitSet {
                limit,
                grants: Grants::one(Permit {
                    slot,
                    exclusive: true,
                }),
            },
        );
        self.permit_grants += 1;
        self.key_bytes += quota::key_cost(key.len());
        self.holders.add_key(0);
        self.note_lease_end(grace_until);
    }

    /// Grants `ask` a new permit of its key (registered now with `limit`
    /// when `probe` found it absent), unless `max_keys`, the memory
    /// budget, the holder's key quota or the token ceiling refuse it
    /// (Busy).
    fn grant_permit(
        &mut self,
        ask: &Ask<'_, T>,
        (limit, probe): (u16, Probe),
        exclusive: bool,
        out: &mut Outbox<T>,
    ) -> AcquireOutcome {
        let full = self.keys.len() + self.permit_grants >= self.limits.max_keys;
        let key_cost = quota::key_cost(ask.key.len());
        if full || key_cost > ask.mem_room {
            self.stats.quotas.memory += u64::from(!full);
            return busy(out, ask.conn, ask.owner, ask.key, ask.tag).into();
        }
        if !self
            .holders
            .try_add_key(ask.holder, self.limits.max_keys_per_holder)
        {
            self.refused_for_quota(ask.holder, false);
            return busy(out, ask.conn, ask.owner, ask.key, ask.tag).into();
        }
        let Some(token) = try_take_token(
            &mut self.next_token,
            self.token_rng.as_mut(),
            self.token_ceiling,
        ) else {
            self.holders.remove_key(ask.holder);
            return busy(out, ask.conn, ask.owner, ask.key, ask.tag).into();
        };
        let permit = Permit {
            slot: Slot {
                token,
                holder: ask.holder,
                expires_at: ask.expires_at,
                granted_at: ask.now,
                tag: ask.tag,
            },
            exclusive,
        };
        match probe.bucket().and_then(|b| self.permits.get_bucket_mut(b)) {
            Some(set) => set.grants.push(permit, &mut self.spare_grants),
            None => {
                let grants = Grants::one(permit);
                let set = PermitSet { limit, grants };
                self.permits.insert_probed(probe, KeyStr::new(ask.key), set);
            }
        }
        self.permit_grants += 1;
        self.key_bytes += key_cost;
        self.note_lease_end(ask.expires_at);
        self.stats.grants_fresh += 1;
        self.count_permit_grant(exclusive);
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
        AcquireOutcome::Granted(token)
    }

    /// Brings the permits of `key` up to date at `now`: in single mode,
    /// ends the grants whose lease ran out and answers the waits that ran
    /// out; then grants the head of the queue, and the next, for as long
    /// as the head fits (PROTOCOL §6.2); then deletes the key if nothing
    /// is left of it, or points its timer at the next thing due.
    pub(super) fn settle_permits(&mut self, now: Millis, key: &str, out: &mut Outbox<T>) {
        if self.clocked {
            self.end_expired_permits(now, key, out);
            let overdue = self.queues.get(key).is_some_and(|q| q.timer_at <= now);
            if overdue {
                self.time_out_waiters(now, key, false, out);
            }
        }
        if self.tokens_exhausted() {
            self.time_out_waiters(now, key, true, out);
        }
        while self.hand_permit_to_head(now, key, out) {}
        self.reschedule(key);
        let emptied = self.permits.get(key).is_some_and(|s| s.grants.is_empty());
        if emptied && !self.queues.contains_key(key) {
            self.delete_permits(key);
        }
    }

    /// Ends every grant of `key` whose lease ran out by `now`, as a lease
    /// that ran out (no reply).
    fn end_expired_permits(&mut self, now: Millis, key: &str, out: &mut Outbox<T>) {
        let Some(set) = self.permits.get_mut(key) else {
            return;
        };
        let (stats, holds, holders) = (&mut self.stats, &mut self.holds, &mut self.holders);
        let mut ended = 0usize;
        set.grants.retain(|g| {
            let s = &g.slot;
            if s.expires_at > now {
                return true;
            }
            ended += 1;
            holders.remove_key(s.holder);
            record_lapse(key, s, stats, holds, out);
            false
        });
        self.permit_grants -= ended;
        self.key_bytes -= ended as u64 * quota::key_cost(key.len());
    }

    /// Grants the head waiter of `key` a permit if it fits; returns whether
    /// it did.
    fn hand_permit_to_head(&mut self, now: Millis, key: &str, out: &mut Outbox<T>) -> bool {
        let Some(head) = self.queues.get(key).and_then(|q| q.waiters.front()) else {
            return false;
        };
        let exclusive = !head.shared();
        if !self.permits.get(key).is_some_and(|s| s.fits(exclusive)) {
            return false;
        }
        let Some(w) = self.queues.get_mut(key).and_then(|q| q.waiters.pop_front()) else {
            return false;
        };
        let holder = self.conn_table.conns[w.conn as usize].holder;
        let conn = self.forget_waiter(&w);
        let token = self.issue_token();
        self.stats.grants_handover += 1;
        self.count_permit_grant(exclusive);
        if self.clocked {
            self.stats.wait_ms.observe(now.since(w.queued_at()));
            self.holds.start(now);
        }
        let lease_s = w.lease_s();
        let expires_at = self.lease_end(now, lease_s);
        self.holders.add_key(holder);
        self.permit_grants += 1;
        self.key_bytes += quota::key_cost(key.len());
        if let Some(set) = self.permits.get_mut(key) {
            let slot = Slot {
                token,
                holder,
                expires_at,
                granted_at: now,
                tag: w.tag,
            };
            set.grants
                .push(Permit { slot, exclusive }, &mut self.spare_grants);
        }
        self.note_lease_end(expires_at);
        let reply = Reply::Acquired {
            token,
            owner: w.owner,
            key,
        };
        out.push_event(conn, reply, lease_s, Grant::Handover, w.tag);
        true
    }

    /// Release (PROTOCOL §2.2, §6.2) of the permit `token` of `key`:
    /// `None` when `key` has no permits (the caller answers as for a
    /// mutex), else whether it took effect (`R`, and the place goes to the
    /// queue) or not (`N`).
    pub(super) fn release_permit(
        &mut self,
        now: Millis,
        conn: ConnId,
        token: u64,
        key: &str,
        out: &mut Outbox<T>,
    ) -> Option<bool> {
        let caller = self.caller;
        // One lookup, as for a mutex: the entry is removed through it when
        // the key is left empty with nobody waiting.
        let mut o = self.permits.find_entry(key)?;
        let set = o.get_mut();
        let found = set
            .grants
            .iter()
            .position(|g| g.slot.token == token && caller.may_act_on(g.slot.holder));
        let Some(pos) = found else {
            out.push(conn, Reply::NotReleased { token, key }, 0);
            return Some(false);
        };
        let Permit { slot, .. } = set.grants.remove(pos);
        let emptied = set.grants.is_empty();
        let lapsed = !emptied && self.clocked && set.earliest_end() <= now;
        self.permit_grants -= 1;
        self.key_bytes -= quota::key_cost(key.len());
        self.holders.remove_key(slot.holder);
        if self.clocked {
            self.stats.hold_ms.observe(now.since(slot.granted_at));
            self.holds.end(slot.granted_at);
        }
        out.push_reply(conn, Kind::Released, token, 0, key, 0, T::default());
        if lapsed || self.queues.contains_key(key) {
            // The freed place may be owed to the queue, or a lapsed permit
            // ends now.
            self.settle_permits(now, key, out);
        } else if emptied {
            let (_, set) = o.remove();
            set.grants.recycle(&mut self.spare_grants);
        }
        Some(true)
    }

    /// Deletes `key`'s permits (none is left, nobody waits), keeping the
    /// grant vector for the next key of limit 2 or more.
    fn delete_permits(&mut self, key: &str) {
        if let Some(set) = self.permits.remove(key) {
            set.grants.recycle(&mut self.spare_grants);
        }
    }

    /// The committed `Expire{key, token}` of a permit (cluster mode): ends
    /// that grant and hands its place to the queue. A stale one does
    /// nothing and returns false.
    pub(super) fn expire_permit(
        &mut self,
        now: Millis,
        key: &str,
        token: u64,
        out: &mut Outbox<T>,
    ) -> bool {
        let Some(set) = self.permits.get_mut(key) else {
            return false;
        };
        let Some(pos) = set.grants.iter().position(|g| g.slot.token == token) else {
            return false;
        };
        let Permit { slot, .. } = set.grants.remove(pos);
        self.permit_grants -= 1;
        self.key_bytes -= quota::key_cost(key.len());
        self.holders.remove_key(slot.holder);
        self.stats.lease_expiries += 1;
        out.push_expired(key, token);
        if self.clocked && token != 0 {
            self.holds.end(slot.granted_at);
        }
        self.settle_permits(now, key, out);
        true
    }

    /// The grant `token` of `key` among its permits, for an extend.
    pub(super) fn permit_slot_mut(&mut self, key: &str, token: u64) -> Option<&mut Slot<T>> {
        self.permits
            .get_mut(key)?
            .grants
            .iter_mut()
            .find(|g| g.slot.token == token)
            .map(|g| &mut g.slot)
    }

    /// The earliest lease end among the grants of `key` (a mutex's or its
    /// permits'); NEVER when nothing holds it.
    pub(super) fn first_grant_end(&self, key: &str) -> Millis {
        if let Some(slot) = self.keys.get(key) {
            return slot.expires_at;
        }
        self.permits
            .get(key)
            .map_or(Millis::NEVER, PermitSet::earliest_end)
    }

    /// The sweep's pass over the permits (single mode): ends the grants
    /// past their lease of keys without waiters and deletes the keys left
    /// empty. Returns the earliest lease end kept. O(permit grants).
    pub(super) fn sweep_permits(&mut self, now: Millis, out: &mut Outbox<T>) -> Millis {
        let mut floor = Millis::NEVER;
        let mut ended = 0usize;
        let mut freed = 0u64;
        let (queues, stats, holds, holders) = (
            &self.queues,
            &mut self.stats,
            &mut self.holds,
            &mut self.holders,
        );
        self.permits.retain(|key, set| {
            let key: &str = key.as_str();
            if queues.contains_key(key) {
                floor = floor.min(set.earliest_end());
                return true;
            }
            set.grants.retain(|g| {
                let s = &g.slot;
                if s.expires_at > now {
                    floor = floor.min(s.expires_at);
                    return true;
                }
                ended += 1;
                freed += quota::key_cost(key.len());
                holders.remove_key(s.holder);
                record_lapse(key, s, stats, holds, out);
                false
            });
            !set.grants.is_empty()
        });
        self.permit_grants -= ended;
        self.key_bytes -= freed;
        floor
    }
}

//! What each holder has in the engine (keys held, acquires queued), for
//! the quotas per identity, and the engine's estimate of its own memory,
//! for the memory budget (see the module documentation of `engine`,
//! "Quotas and the memory budget").
//!
//! Holder 0 (a grant or waiter whose taker is not known: a restart
//! grace, cluster mode) is never limited and never shown.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// Estimated bytes of one registered key beside its own bytes: its
/// hash-table bucket (a 32-byte [`crate::hash::KeyStr`], a 32-byte slot
/// and a control byte) in a table kept at most 7/8 full that doubles as it
/// grows (so 65 to 149 bytes per key; `make engine-memory` measured 119.5
/// at a million keys, just past a doubling).
pub const KEY_BYTES: u64 = 128;
/// Estimated bytes of one queued acquire: 32 in its key's queue and 16 in
/// its connection's list, in vectors that double as they grow.
pub const WAITER_BYTES: u64 = 64;
/// Estimated bytes of the queue of a key that has waiters, beside the
/// shared copy of the key: its map entry and its deadline-index entry.
pub const QUEUE_BYTES: u64 = 128;
/// Estimated bytes of a connection that has waiters: its index and table
/// entries and its list (`make engine-memory`: ~95).
pub const WAITING_CONN_BYTES: u64 = 128;

/// Keys up to this long are stored in the table's bucket; a longer one is
/// boxed ([`crate::hash::KeyStr`]).
const INLINE_KEY_BYTES: usize = 30;

/// Bytes of a heap allocation of `len` bytes with malloc's header,
/// rounded to its 16-byte granule.
#[inline]
fn heap_bytes(len: usize) -> u64 {
    (len as u64 + 8).next_multiple_of(16).max(32)
}

/// Estimated bytes of a registered key named `len` bytes long.
#[inline]
#[must_use]
pub fn key_cost(len: usize) -> u64 {
    if len > INLINE_KEY_BYTES {
        KEY_BYTES + heap_bytes(len)
    } else {
        KEY_BYTES
    }
}

/// Estimated bytes of the queue of a key named `len` bytes long: with the
/// queue's shared copy of the key (`Arc<str>`: two counters and the bytes).
#[inline]
#[must_use]
pub fn queue_cost(len: usize) -> u64 {
    QUEUE_BYTES + heap_bytes(16 + len)
}

/// What one holder has in the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HolderUse {
    /// Registered keys it took (held, or expired and not yet swept).
    pub keys: usize,
    /// Acquires its connections have queued.
    pub waiters: usize,
}

/// Hashes a holder number with a random key: the numbers are hashes of
/// identity names already, under a key that is no secret, so a random
/// multiply keeps an outsider from choosing names that collide here.
#[derive(Clone, Copy, Debug)]
struct MixState(u64);

impl Default for MixState {
    fn default() -> Self {
        MixState(crate::hash::SipKey::random().hash(b"holders") | 1)
    }
}

impl BuildHasher for MixState {
    type Hasher = Mix;
    fn build_hasher(&self) -> Mix {
        Mix(self.0, 0)
    }
}

/// See [`MixState`].
#[derive(Debug)]
struct Mix(u64, u64);

impl Hasher for Mix {
    fn finish(&self) -> u64 {
        self.1
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.1 = (self.1 ^ n).wrapping_mul(self.0).rotate_left(29);
    }
}

/// [`HolderUse`] by holder number, for the holders that have anything.
/// The holder last counted is kept apart, beside the map, so that a run of
/// requests from one identity costs a comparison and an addition each:
/// no hashing, no lookup.
#[derive(Debug, Default)]
pub(super) struct Holders {
    /// The holder last counted (0: none) and what it has; not in `map`.
    hot_holder: u64,
    hot: HolderUse,
    /// Every other holder that has anything.
    map: HashMap<u64, HolderUse, MixState>,
}

impl Holders {
    /// What `holder` has (nothing for holder 0, which is counted only to
    /// keep the hot path free of a test for it).
    #[inline]
    pub(super) fn get(&self, holder: u64) -> HolderUse {
        if holder == 0 {
            return HolderUse::default();
        }
        if holder == self.hot_holder {
            return self.hot;
        }
        self.map.get(&holder).copied().unwrap_or_default()
    }

    /// Holders that have anything.
    pub(super) fn len(&self) -> usize {
        self.iter().count()
    }

    /// Every holder that has anything, with what it has, in no particular
    /// order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, HolderUse)> + '_ {
        let hot = (self.hot != HolderUse::default()).then_some((self.hot_holder, self.hot));
        self.map
            .iter()
            .map(|(&h, &u)| (h, u))
            .chain(hot)
            .filter(|&(h, _)| h != 0)
    }

    /// What `holder` has, to change: it becomes the hot holder.
    #[inline]
    fn entry(&mut self, holder: u64) -> &mut HolderUse {
        if holder != self.hot_holder {
            self.switch(holder);
        }
        &mut self.hot
    }

    /// Puts the hot holder back in the map (if it has anything) and takes
    /// `holder` out of it.
    #[cold]
    fn switch(&mut self, holder: u64) {
        if self.hot != HolderUse::default() {
            self.map.insert(self.hot_holder, self.hot);
        }
        self.hot = self.map.remove(&holder).unwrap_or_default();
        self.hot_holder = holder;
    }

    /// `holder` took a key.
    #[inline]
    pub(super) fn add_key(&mut self, holder: u64) {
        self.entry(holder).keys += 1;
    }

    /// `holder` takes a key, unless it has `max` already (then false, and
    /// nothing changes). Holder 0 always may, uncounted.
    #[inline]
    pub(super) fn try_add_key(&mut self, holder: u64, max: usize) -> bool {
        let u = self.entry(holder);
        if u.keys >= max && holder != 0 {
            return false;
        }
        u.keys += 1;
        true
    }

    /// A key `holder` took is no longer registered, or went to someone else.
    #[inline]
    pub(super) fn remove_key(&mut self, holder: u64) {
        let u = self.entry(holder);
        debug_assert!(u.keys > 0, "holder {holder} key count drifted");
        u.keys = u.keys.wrapping_sub(1);
    }

    /// A key's grant moves from `from` to `to` (a takeover, a hand-over).
    #[inline]
    pub(super) fn move_key(&mut self, from: u64, to: u64) {
        if from != to {
            self.add_key(to);
            self.remove_key(from);
        }
    }

    /// `holder` queued an acquire.
    pub(super) fn add_waiter(&mut self, holder: u64) {
        self.entry(holder).waiters += 1;
    }

    /// `n` acquires `holder` queued left their queues.
    pub(super) fn remove_waiters(&mut self, holder: u64, n: usize) {
        if n > 0 {
            let u = self.entry(holder);
            debug_assert!(u.waiters >= n, "holder {holder} waiter count drifted");
            u.waiters = u.waiters.saturating_sub(n);
        }
    }
}

/// The quota refusals an engine counted ([`super::EngineStats::quotas`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuotaRefusals {
    /// Acquires answered Busy: the holder has its key quota.
    pub keys: u64,
    /// Acquires answered Busy: the holder has its waiter quota.
    pub waiters: u64,
    /// Acquires answered Busy: a new key or waiter would pass the memory
    /// budget.
    pub memory: u64,
    /// The holder of the last acquire refused for a quota (keys or waiters).
    pub last_holder: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_come_and_go_with_their_holder() {
        let mut h = Holders::default();
        h.add_key(0);
        h.add_waiter(0);
        assert_eq!(h.len(), 0, "holder 0 is never shown");
        assert_eq!(h.get(0), HolderUse::default());
        assert!(h.try_add_key(0, 0), "nor limited");
        h.remove_key(0);
        h.remove_key(0);
        h.remove_waiters(0, 1);
        h.add_key(7);
        h.add_key(7);
        h.add_waiter(9);
        assert_eq!(
            h.get(7),
            HolderUse {
                keys: 2,
                waiters: 0
            }
        );
        assert_eq!(h.get(9).waiters, 1);
        h.move_key(7, 9);
        assert_eq!(h.get(7).keys, 1);
        assert_eq!(
            h.get(9),
            HolderUse {
                keys: 1,
                waiters: 1
            }
        );
        h.remove_waiters(9, 1);
        h.remove_key(9);
        assert_eq!(h.get(9), HolderUse::default());
        assert_eq!(h.len(), 1, "an idle holder is not counted");
        h.remove_key(7);
        assert_eq!(h.len(), 0);
        assert_eq!(h.get(7), HolderUse::default());
        assert!(h.map.is_empty(), "no idle holder is kept in the map");
        assert!(!h.try_add_key(7, 0), "at its quota");
        assert!(h.try_add_key(7, 1));
    }

    use super::super::{Caller, Engine, Outbox};
    use crate::limits::EngineLimits;
    use crate::proto::Request;
    use crate::time::Millis;

    const ALICE: u64 = 2;
    const BOB: u64 = 4;

    fn engine(keys: usize, waiters: usize) -> Engine {
        let limits = EngineLimits {
            max_keys_per_holder: keys,
            max_waiters_per_holder: waiters,
            sweep_interval_ms: 1000,
            ..EngineLimits::default()
        };
        Engine::new(limits, 1)
    }

    /// An acquire as `holder` on connection `conn`: the reply's op byte
    /// and, for a grant, its token.
    fn acquire(e: &mut Engine, at: u64, conn: u64, holder: u64, key: &str, wait_s: u8) -> u8 {
        let mut out = Outbox::new();
        let who = Caller {
            holder,
            admin: false,
        };
        let req = Request::Acquire {
            wait_s,
            lease_s: 1,
            owner: 0,
            key,
        };
        e.handle_as(Millis(at), conn, who, req, &mut out);
        e.check_invariants();
        let op = out.frames().next().map_or(0, |(_, f)| f[0]);
        op
    }

    fn release(e: &mut Engine, holder: u64, key: &str) {
        let token = e.holder(Millis::ZERO, key).expect("held").0;
        let mut out = Outbox::new();
        let who = Caller {
            holder,
            admin: false,
        };
        e.handle_as(
            Millis::ZERO,
            1,
            who,
            Request::Release { token, key },
            &mut out,
        );
        e.check_invariants();
    }

    fn uses(keys: usize, waiters: usize) -> HolderUse {
        HolderUse { keys, waiters }
    }

    #[test]
    fn a_holder_over_its_key_quota_gets_busy_and_others_do_not() {
        let mut e = engine(2, 10);
        assert_eq!(acquire(&mut e, 0, 1, ALICE, "a1", 0), b'A');
        assert_eq!(acquire(&mut e, 0, 1, ALICE, "a2", 0), b'A');
        assert_eq!(acquire(&mut e, 0, 1, ALICE, "a3", 0), b'B');
        assert_eq!(acquire(&mut e, 0, 2, BOB, "b1", 0), b'A');
        assert_eq!(acquire(&mut e, 0, 3, 0, "unknown", 0), b'A');
        assert_eq!(e.holder_use(ALICE), uses(2, 0));
        assert_eq!(e.stats().quotas.keys, 1);
        assert_eq!(e.stats().quotas.last_holder, ALICE);
        // Released: room again; a takeover of Alice's expired key by Bob
        // moves the count; the sweep of expired keys returns it to zero.
        release(&mut e, ALICE, "a1");
        assert_eq!(e.holder_use(ALICE), uses(1, 0));
        assert_eq!(acquire(&mut e, 0, 1, ALICE, "a3", 0), b'A');
        assert_eq!(acquire(&mut e, 2000, 2, BOB, "a2", 0), b'A');
        assert_eq!(e.holder_use(ALICE), uses(1, 0));
        assert_eq!(e.holder_use(BOB), uses(2, 0));
        // Bob at his quota cannot take Alice's expired key over either.
        assert_eq!(acquire(&mut e, 2000, 2, BOB, "a3", 0), b'B');
        let mut out = Outbox::new();
        e.tick(Millis(10_000), &mut out);
        e.check_invariants();
        assert_eq!(e.key_count(), 0, "{:?}", e.sorted_keys());
        assert_eq!(e.holder_count(), 0);
        assert_eq!(e.memory_bytes(), 0);
    }

    #[test]
    fn waiter_quotas_count_until_handover_timeout_or_disconnect() {
        let mut e = engine(10, 2);
        assert_eq!(acquire(&mut e, 0, 1, ALICE, "k", 0), b'A');
        assert_eq!(acquire(&mut e, 0, 2, BOB, "k", 5), 0, "queued");
        assert_eq!(acquire(&mut e, 0, 3, BOB, "k", 5), 0, "queued");
        assert_eq!(acquire(&mut e, 0, 3, BOB, "k", 5), b'B');
        assert_eq!(
            acquire(&mut e, 0, 1, ALICE, "k", 5),
            0,
            "Alice still queues"
        );
        assert_eq!(e.stats().quotas.waiters, 1);
        assert_eq!(e.holder_use(BOB), uses(0, 2));
        // A hand-over moves the key to Bob's first waiter.
        release(&mut e, ALICE, "k");
        assert_eq!(e.holder_use(BOB), uses(1, 1));
        assert_eq!(e.holder_use(ALICE), uses(0, 1));
        let mut out = Outbox::new();
        e.disconnect(Millis::ZERO, 3, &mut out);
        e.check_invariants();
        assert_eq!(e.holder_use(BOB), uses(1, 0));
        // Alice's wait runs out, and the sweep deletes Bob's expired key.
        e.tick(Millis(6_000), &mut out);
        e.check_invariants();
        assert_eq!(e.key_count(), 0);
        assert_eq!(e.holder_count(), 0);
        assert_eq!(e.memory_bytes(), 0);
    }

    #[test]
    fn the_memory_budget_refuses_new_keys_and_waiters_past_it() {
        let key = |i: usize| format!("{i:0>1000}");
        let limits = EngineLimits {
            max_memory: 100 * key_cost(1000),
            ..EngineLimits::default()
        };
        let mut e = Engine::new(limits, 1);
        let mut granted = 0;
        while acquire(&mut e, 0, 1, 0, &key(granted), 0) == b'A' {
            granted += 1;
        }
        assert_eq!(granted, 100);
        assert_eq!(e.stats().quotas.memory, 1);
        assert_eq!(e.memory_bytes(), 100 * key_cost(1000));
        // A held key still answers T, and short keys find no room either.
        assert_eq!(acquire(&mut e, 0, 2, 0, &key(0), 0), b'T');
        assert_eq!(acquire(&mut e, 0, 2, 0, "short", 0), b'B');
        assert_eq!(
            acquire(&mut e, 0, 2, 0, &key(0), 5),
            b'B',
            "no room to queue"
        );
        // Memory counted outside the engine leaves it less room.
        release(&mut e, 0, &key(0));
        release(&mut e, 0, &key(1));
        e.set_outside_memory(key_cost(1000));
        assert_eq!(acquire(&mut e, 0, 1, 0, &key(0), 0), b'A');
        assert_eq!(acquire(&mut e, 0, 1, 0, &key(1), 0), b'B');
        e.set_outside_memory(0);
        assert_eq!(acquire(&mut e, 0, 1, 0, &key(1), 0), b'A');
        assert_eq!(e.stats().quotas.memory, 4);
    }

    #[test]
    fn costs_grow_with_long_keys_only() {
        assert_eq!(key_cost(1), KEY_BYTES);
        assert_eq!(key_cost(30), KEY_BYTES);
        assert_eq!(key_cost(31), KEY_BYTES + 48);
        assert_eq!(key_cost(1024), KEY_BYTES + 1040);
        assert!(queue_cost(1) >= QUEUE_BYTES + 32);
    }
}

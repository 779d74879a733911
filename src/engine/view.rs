//! What the engine shows of its table: counts, a key's grant and queue,
//! a permit key's grants (PROTOCOL §6), sorted listings, and the admin
//! port's [`LockTable`].

use super::waiters::Waiter;
use super::{ConnId, Engine, EngineStats, HolderUse, WaiterId};
use std::collections::VecDeque;

use crate::limits::EngineLimits;
use crate::time::Millis;

/// One queued acquire, as [`Engine::queue`] shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Queued<'a, T> {
    /// Its id, for [`Engine::wait_timeout`].
    pub id: WaiterId,
    /// Its connection.
    pub conn: ConnId,
    /// Its owner.
    pub owner: u64,
    /// Its wait, in seconds.
    pub wait_s: u8,
    /// The lease it asks for, in seconds.
    pub lease_s: u8,
    /// Its connection's holder number
    /// ([`Caller::holder`](super::Caller::holder)): its grant's.
    pub holder: u64,
    /// It asked for a shared place of a permit key (PROTOCOL §6); false
    /// for an exclusive one and for every waiter of a mutex.
    pub shared: bool,
    /// Its tag.
    pub tag: &'a T,
}

/// One grant of a key, as [`Engine::grants`] shows it: a mutex's only
/// grant, or one permit of a key registered with a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldGrant<'a, T> {
    /// Its fencing token.
    pub token: u64,
    /// Who took it ([`Caller::holder`](super::Caller::holder); 0:
    /// unknown).
    pub holder: u64,
    /// Taken in exclusive mode: a mutex's grant always is.
    pub exclusive: bool,
    /// The tag of the request granted.
    pub tag: &'a T,
}

/// A registered key as `GET /v1/locks/KEY` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockInfo {
    /// The fencing token of the current grant (0: the unknown holder of a
    /// restart grace).
    pub token: u64,
    /// Milliseconds until the lease runs out, 0 once it has; `None` in
    /// cluster mode, whose replicated engine has no clock.
    pub expires_in_ms: Option<u64>,
    /// Queued acquires.
    pub waiters: usize,
    /// Milliseconds since the grant; `None` in cluster mode.
    pub held_for_ms: Option<u64>,
    /// Who took the grant ([`Caller::holder`](super::Caller::holder);
    /// 0: unknown).
    pub holder: u64,
    /// A key of limit 2 or more (PROTOCOL §6): its limit, grants and
    /// waiters by mode. The fields above are then 0 and `None` (there is
    /// no one grant) but for `waiters`, which counts every waiter.
    pub permits: Option<PermitsInfo>,
}

/// The grants and waiters of a key of limit 2 or more, in [`LockInfo`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PermitsInfo {
    /// The key's limit.
    pub limit: u16,
    /// Every grant standing, oldest first.
    pub grants: Vec<PermitInfo>,
    /// Queued shared acquires; the rest of [`LockInfo::waiters`] are
    /// exclusive.
    pub waiters_shared: usize,
}

/// One grant of a key of limit 2 or more, in [`PermitsInfo`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PermitInfo {
    /// Its fencing token (0: the unknown holder of a restart grace).
    pub token: u64,
    /// Shared or exclusive.
    pub mode: crate::proto::Mode,
    /// Who took it (0: unknown).
    pub holder: u64,
    /// As [`LockInfo::expires_in_ms`].
    pub expires_in_ms: Option<u64>,
    /// As [`LockInfo::held_for_ms`].
    pub held_for_ms: Option<u64>,
}

/// What the admin port reads of a lock table, whatever its tags: an
/// [`Engine`] of any tag type behind one object type.
pub trait LockTable {
    /// See [`Engine::lock_info`].
    fn lock_info(&self, now: Millis, key: &str) -> Option<LockInfo>;
    /// See [`Engine::key_buckets`].
    fn key_buckets(&self) -> usize;
    /// See [`Engine::scan_keys`].
    fn scan_keys(&self, from: usize, to: usize, visit: &mut dyn FnMut(&str)) -> usize;
    /// See [`Engine::stats`].
    fn stats(&self) -> &EngineStats;
    /// See [`Engine::key_count`].
    fn key_count(&self) -> usize;
    /// See [`Engine::waiter_count`].
    fn waiter_count(&self) -> usize;
    /// See [`Engine::oldest_hold_ms`].
    fn oldest_hold_ms(&self, now: Millis) -> Option<u64>;
    /// See [`Engine::memory_bytes`].
    fn memory_bytes(&self) -> u64;
    /// See [`Engine::holder_use`].
    fn holder_use(&self, holder: u64) -> HolderUse;
}

impl<T: Copy + Default> LockTable for Engine<T> {
    fn lock_info(&self, now: Millis, key: &str) -> Option<LockInfo> {
        Engine::lock_info(self, now, key)
    }
    fn key_buckets(&self) -> usize {
        Engine::key_buckets(self)
    }
    fn scan_keys(&self, from: usize, to: usize, visit: &mut dyn FnMut(&str)) -> usize {
        Engine::scan_keys(self, from, to, visit)
    }
    fn stats(&self) -> &EngineStats {
        Engine::stats(self)
    }
    fn key_count(&self) -> usize {
        Engine::key_count(self)
    }
    fn oldest_hold_ms(&self, now: Millis) -> Option<u64> {
        Engine::oldest_hold_ms(self, now)
    }
    fn waiter_count(&self) -> usize {
        Engine::waiter_count(self)
    }
    fn memory_bytes(&self) -> u64 {
        Engine::memory_bytes(self)
    }
    fn holder_use(&self, holder: u64) -> HolderUse {
        Engine::holder_use(self, holder)
    }
}

impl<T: Copy + Default> Engine<T> {
    /// The limits this engine enforces.
    #[must_use]
    pub fn limits(&self) -> &EngineLimits {
        &self.limits
    }

    /// What the engine counted since it started.
    #[must_use]
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Clocked mode: how long the longest-held current grant has been held
    /// at `now`, extensions included, to the second it began (so up to
    /// 1 s long); `None` when nothing is held, and in replicated mode.
    /// O(1). A grant whose lease ran out counts until a takeover, a
    /// hand-over or the sweep ends it (at most about one sweep interval
    /// later); a restart grace's unknown holders do not count.
    #[must_use]
    pub fn oldest_hold_ms(&self, now: Millis) -> Option<u64> {
        self.holds.oldest().map(|at| now.since(at))
    }

    /// `key` as the admin port shows it, or `None` when it is not
    /// registered. Two lookups; no allocation.
    #[must_use]
    pub fn lock_info(&self, now: Millis, key: &str) -> Option<LockInfo> {
        let Some(slot) = self.keys.get(key) else {
            return self.permits_info(now, key);
        };
        let waiters = self.queues.get(key).map_or(0, |q| q.waiters.len());
        let clocked = self.clocked;
        Some(LockInfo {
            token: slot.token,
            expires_in_ms: clocked.then(|| slot.expires_at.since(now)),
            waiters,
            held_for_ms: clocked.then(|| now.since(slot.granted_at)),
            holder: slot.holder,
            permits: None,
        })
    }

    /// [`Engine::lock_info`] of a key of limit 2 or more.
    fn permits_info(&self, now: Millis, key: &str) -> Option<LockInfo> {
        let set = self.permits.get(key)?;
        let clocked = self.clocked;
        let grants = set
            .grants
            .iter()
            .map(|g| PermitInfo {
                token: g.slot.token,
                mode: if g.exclusive {
                    crate::proto::Mode::Exclusive
                } else {
                    crate::proto::Mode::Shared
                },
                holder: g.slot.holder,
                expires_in_ms: clocked.then(|| g.slot.expires_at.since(now)),
                held_for_ms: clocked.then(|| now.since(g.slot.granted_at)),
            })
            .collect();
        let queue = self.queues.get(key).map(|q| &q.waiters);
        Some(LockInfo {
            token: 0,
            expires_in_ms: None,
            waiters: queue.map_or(0, VecDeque::len),
            held_for_ms: None,
            holder: 0,
            permits: Some(PermitsInfo {
                limit: set.limit,
                grants,
                waiters_shared: queue.map_or(0, |q| q.iter().filter(|w| w.shared()).count()),
            }),
        })
    }

    /// Buckets of the key table: the range of [`Engine::scan_keys`]. It
    /// changes when the table grows, which reorders the keys.
    #[must_use]
    pub fn key_buckets(&self) -> usize {
        self.keys.num_buckets().max(1)
    }

    /// Calls `visit` with every registered key in buckets `from..to` of
    /// the key table and returns the first bucket not visited, so that a
    /// listing of a large table runs in steps over several loop turns. The
    /// step that reaches the last bucket also visits every key of limit 2
    /// or more (PROTOCOL §6), in one go.
    pub fn scan_keys(&self, from: usize, to: usize, mut visit: impl FnMut(&str)) -> usize {
        let reached = self.keys.visit_buckets(from, to, |k, _| visit(k));
        let end = self.key_buckets();
        if from < end && to >= end {
            for (k, _) in self.permits.iter() {
                visit(k.as_str());
            }
            return end.max(reached);
        }
        reached
    }

    /// Registered keys (held, or expired and not yet swept), mutexes and
    /// keys of limit 2 or more.
    #[must_use]
    pub fn key_count(&self) -> usize {
        self.keys.len() + self.permits.len()
    }

    /// Queued acquires over all keys.
    #[must_use]
    pub fn waiter_count(&self) -> usize {
        self.waiters_total
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
        self.queues
            .get(key)
            .map(|q| q.waiters.iter().map(|w| w.owner).collect())
            .unwrap_or_default()
    }

    /// The grant on `key`: its token and the tag of the request granted.
    #[must_use]
    pub fn grant(&self, key: &str) -> Option<(u64, &T)> {
        self.keys.get(key).map(|s| (s.token, &s.tag))
    }

    /// The tag of the grant on `key`, to change (cluster mode records a
    /// lease generation in it when an extend takes effect).
    pub fn grant_tag_mut(&mut self, key: &str) -> Option<&mut T> {
        self.keys.get_mut(key).map(|s| &mut s.tag)
    }

    /// The acquires queued on `key`, head first.
    pub fn queue(&self, key: &str) -> impl Iterator<Item = Queued<'_, T>> + '_ {
        let conns = &self.conn_table.conns;
        self.queues
            .get(key)
            .into_iter()
            .flat_map(|q| q.waiters.iter())
            .map(move |w| Queued {
                id: w.id(),
                conn: conns[w.conn as usize].id,
                holder: conns[w.conn as usize].holder,
                owner: w.owner,
                wait_s: w.wait_s(),
                lease_s: w.lease_s(),
                shared: w.shared(),
                tag: &w.tag,
            })
    }

    /// The first waiter on `key` whose tag satisfies `pred`.
    pub fn find_waiter(&self, key: &str, mut pred: impl FnMut(&T) -> bool) -> Option<WaiterId> {
        self.queues
            .get(key)?
            .waiters
            .iter()
            .find(|w| pred(&w.tag))
            .map(Waiter::id)
    }

    /// True while `conn` has a queued acquire.
    #[must_use]
    pub fn has_waiters(&self, conn: ConnId) -> bool {
        self.conn_table.index.contains_key(&conn)
    }

    /// Connections that have queued acquires.
    #[must_use]
    pub fn waiting_conn_count(&self) -> usize {
        self.conn_table.index.len()
    }

    /// Every registered key, sorted: a deterministic order, whatever the
    /// hash key. O(keys log keys).
    #[must_use]
    pub fn sorted_keys(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.keys.iter().map(|(k, _)| k.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// Every key that has waiters, sorted. O(such keys log such keys).
    #[must_use]
    pub fn sorted_queued_keys(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.queues.iter().map(|(k, _)| &**k).collect();
        v.sort_unstable();
        v
    }

    /// The holder number ([`Caller::holder`](super::Caller::holder)) of
    /// the grant on `key`.
    #[must_use]
    pub fn grant_holder(&self, key: &str) -> Option<u64> {
        self.keys.get(key).map(|s| s.holder)
    }

    /// Every grant of `key`, oldest first: the grant of a mutex, or each
    /// permit of a key registered with a limit (PROTOCOL §6), each with
    /// its own token. Nothing when `key` is not held.
    pub fn grants(&self, key: &str) -> impl Iterator<Item = HeldGrant<'_, T>> + '_ {
        let mutex = self.keys.get(key).map(|s| HeldGrant {
            token: s.token,
            holder: s.holder,
            exclusive: true,
            tag: &s.tag,
        });
        let permits = self
            .permits
            .get(key)
            .into_iter()
            .flat_map(|set| set.grants.iter())
            .map(|g| HeldGrant {
                token: g.slot.token,
                holder: g.slot.holder,
                exclusive: g.exclusive,
                tag: &g.slot.tag,
            });
        mutex.into_iter().chain(permits)
    }

    /// The tag of the grant `token` of `key`, a mutex's or a permit's.
    #[must_use]
    pub fn grant_of(&self, key: &str, token: u64) -> Option<&T> {
        if let Some(s) = self.keys.get(key) {
            return (s.token == token).then_some(&s.tag);
        }
        self.permits
            .get(key)?
            .grants
            .iter()
            .find(|g| g.slot.token == token)
            .map(|g| &g.slot.tag)
    }

    /// The tag of the grant `token` of `key`, a mutex's or a permit's, to
    /// change (cluster mode records a lease generation in it when an
    /// extend takes effect).
    pub fn grant_of_mut(&mut self, key: &str, token: u64) -> Option<&mut T> {
        if self.keys.contains_key(key) {
            return self
                .keys
                .get_mut(key)
                .filter(|s| s.token == token)
                .map(|s| &mut s.tag);
        }
        self.permit_slot_mut(key, token).map(|s| &mut s.tag)
    }

    /// The limit `key` is registered with when it is a permit key
    /// (PROTOCOL §6: 2 or more); `None` for a mutex or a key not
    /// registered.
    #[must_use]
    pub fn permit_limit(&self, key: &str) -> Option<u16> {
        self.permits.get(key).map(|set| set.limit)
    }

    /// Keys registered with a limit of 2 or more (PROTOCOL §6).
    #[must_use]
    pub fn permit_key_count(&self) -> usize {
        self.permits.len()
    }

    /// Every key registered with a limit of 2 or more, sorted. O(such
    /// keys log such keys).
    #[must_use]
    pub fn sorted_permit_keys(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.permits.iter().map(|(k, _)| k.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// Every registered key, mutexes and permit keys together, sorted.
    /// O(keys log keys).
    #[must_use]
    pub fn sorted_held_keys(&self) -> Vec<&str> {
        let mut v = self.sorted_keys();
        v.extend(self.permits.iter().map(|(k, _)| k.as_str()));
        v.sort_unstable();
        v
    }
}

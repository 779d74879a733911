//! The quotas per holder and the memory budget, as the engine applies them.

use super::{quota, Engine, HolderUse};

impl<T: Copy + Default> Engine<T> {
    /// The engine's estimate of the bytes its keys and waiters take (see
    /// "Quotas and the memory budget" in the module documentation).
    #[inline]
    #[must_use]
    pub fn memory_bytes(&self) -> u64 {
        self.key_bytes + self.waiter_bytes()
    }

    /// The waiters' part of [`Engine::memory_bytes`]: nothing while no
    /// key has waiters (then there is no queue and no waiting connection).
    #[inline]
    pub(super) fn waiter_bytes(&self) -> u64 {
        if self.waiters_total == 0 {
            return 0;
        }
        self.waiters_total as u64 * quota::WAITER_BYTES
            + self.queue_bytes
            + self.conn_table.index.len() as u64 * quota::WAITING_CONN_BYTES
    }

    /// What holder `holder` ([`Caller::holder`](super::Caller::holder))
    /// has: keys it took and acquires it queued. Nothing for holder 0
    /// (unknown), which is never limited nor shown.
    #[must_use]
    pub fn holder_use(&self, holder: u64) -> HolderUse {
        self.holders.get(holder)
    }

    /// Holders that have keys or waiters (holder 0 aside).
    #[must_use]
    pub fn holder_count(&self) -> usize {
        self.holders.len()
    }

    /// Tells the engine that `bytes` of the memory budget
    /// (`EngineLimits::max_memory`) are taken outside it (single mode: the
    /// connections' buffers): a new key or waiter is refused once the
    /// engine's own estimate would pass the rest. Cluster mode never calls
    /// it, so that every node refuses alike.
    pub fn set_outside_memory(&mut self, bytes: u64) {
        self.mem_limit = self.limits.max_memory.saturating_sub(bytes);
    }

    /// Counts a Busy answer for a holder's quota (`waiters`: its waiter
    /// quota, else its key quota).
    pub(super) fn refused_for_quota(&mut self, holder: u64, waiters: bool) {
        let q = &mut self.stats.quotas;
        if waiters {
            q.waiters += 1;
        } else {
            q.keys += 1;
        }
        q.last_holder = holder;
    }

    /// Whether an acquire of `holder` that would queue on a key named
    /// `key_len` bytes long (its first waiter: `new_queue`) is refused for
    /// the holder's waiter quota or the memory budget (`mem_room` bytes
    /// left); counted if so.
    pub(super) fn waiter_refused(
        &mut self,
        holder: u64,
        new_queue: bool,
        key_len: usize,
        room: u64,
    ) -> bool {
        if holder != 0 && self.holders.get(holder).waiters >= self.limits.max_waiters_per_holder {
            self.refused_for_quota(holder, true);
            return true;
        }
        let queue = if new_queue {
            quota::queue_cost(key_len)
        } else {
            0
        };
        if quota::WAITER_BYTES + queue > room {
            self.stats.quotas.memory += 1;
            return true;
        }
        false
    }
}

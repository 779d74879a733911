//! The sweep of expired keys without waiters, in steps over the key table.

use super::{quota, Engine, EngineStats, Outbox, Slot};
use crate::metrics::GrantAges;
use crate::time::Millis;

/// Buckets of the key table one `tick` visits while a sweep is under way,
/// and the most keys it deletes: each step costs well under a millisecond
/// (`make engine-memory` prints the longest), so no loop turn stalls on
/// the sweep however large the table.
pub const SWEEP_STEP_BUCKETS: usize = 16 * 1024;
/// See [`SWEEP_STEP_BUCKETS`].
pub const SWEEP_STEP_DELETES: usize = 1024;

/// Records that the grant `s` of `key` ended with its lease (no reply):
/// its event, the count, its hold time. The unknown holder of a restart
/// grace (token 0) is no client's grant and records nothing.
pub(super) fn record_lapse<T: Copy + Default>(
    key: &str,
    s: &Slot<T>,
    stats: &mut EngineStats,
    holds: &mut GrantAges,
    out: &mut Outbox<T>,
) {
    if s.token != 0 {
        out.push_expired(key, s.token);
        stats.lease_expiries += 1;
        stats.hold_ms.observe(s.expires_at.since(s.granted_at));
        holds.end(s.granted_at);
    }
}

/// A sweep that has visited the key table's buckets below `cursor`.
#[derive(Debug, Clone, Copy)]
pub(super) struct SweepPass {
    pub(super) cursor: usize,
    /// A key was inserted while the pass ran: an insertion may grow or
    /// rehash the table, which reorders its buckets, so the pass may have
    /// missed keys and must not raise the floor.
    pub(super) inserted: bool,
    /// The earliest lease end among the keys the pass kept, and among the
    /// grants and extensions made while it ran.
    pub(super) floor: Millis,
}

impl<T: Copy + Default> Engine<T> {
    /// One step of the sweep of expired keys without waiters: it starts
    /// every `sweep_interval_ms` once some lease may have ended, and then
    /// visits [`SWEEP_STEP_BUCKETS`] buckets of the key table per call (or
    /// fewer, once [`SWEEP_STEP_DELETES`] keys are deleted), so
    /// a table of any size is swept over several loop turns instead of
    /// stalling one. Deleting never moves other entries; an insertion
    /// during a pass may reorder the buckets, so that pass may miss keys
    /// (they go in the next one) and does not raise the floor.
    pub(super) fn sweep_step(&mut self, now: Millis, out: &mut Outbox<T>) {
        let mut pass = match self.sweep {
            Some(pass) => pass,
            // When no lease can have ended, a pass would delete nothing.
            None if now >= self.next_sweep && self.expiry_floor <= now => SweepPass {
                cursor: 0,
                inserted: false,
                floor: Millis::NEVER,
            },
            None => {
                if now >= self.next_sweep {
                    self.next_sweep = now.add_ms(self.limits.sweep_interval_ms.max(1));
                }
                return;
            }
        };
        let end = pass.cursor.saturating_add(SWEEP_STEP_BUCKETS);
        let queues = &self.queues;
        let stats = &mut self.stats;
        let holds = &mut self.holds;
        let holders = &mut self.holders;
        let mut freed = 0u64;
        let mut floor = pass.floor;
        // Keep a key unless it expired and nobody waits for it.
        let reached = self
            .keys
            .retain_buckets(pass.cursor, end, SWEEP_STEP_DELETES, |k, s| {
                let keep = s.expires_at > now || queues.contains_key(k);
                if keep {
                    floor = floor.min(s.expires_at);
                    return true;
                }
                holders.remove_key(s.holder);
                freed += quota::key_cost(k.len());
                record_lapse(k, s, stats, holds, out);
                false
            });
        self.key_bytes -= freed;
        pass.floor = floor;
        pass.cursor = reached;
        if pass.cursor < self.keys.num_buckets() {
            self.sweep = Some(pass);
            return;
        }
        self.sweep = None;
        if !self.permits.is_empty() {
            pass.floor = pass.floor.min(self.sweep_permits(now, out));
        }
        self.expiry_floor = if pass.inserted {
            pass.floor.min(self.expiry_floor)
        } else {
            pass.floor
        };
        self.next_sweep = now.add_ms(self.limits.sweep_interval_ms.max(1));
    }
}

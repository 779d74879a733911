//! The invariant checker: the engine's tables against each other and
//! against a recount, for tests and fuzzing.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::conns::{ConnSlot, NO_SLOT};
use super::waiters::Queue;
use super::{quota, Engine, HolderUse};
use crate::time::Millis;

impl<T: Copy + Default> Engine<T> {
    /// Checks the engine's internal invariants, panicking with a message on
    /// the first one broken. For tests and fuzzing; O(keys + waiters × timers).
    /// A checklist read top to bottom: the keys, the queues and their
    /// waiters, the connection table, then the counts against a recount.
    pub fn check_invariants(&self) {
        self.check_keys();
        self.check_permits();
        let by_conn = self.check_queues();
        self.check_conns(&by_conn);
        assert!(
            self.waiters_total <= self.limits.max_waiters,
            "over max_waiters"
        );
        assert!(self.keys.len() <= self.limits.max_keys, "over max_keys");
        let grants: usize = self.permits.iter().map(|(_, s)| s.grants.len()).sum();
        assert_eq!(grants, self.permit_grants, "permit grant count drifted");
        self.check_accounting();
    }

    /// Every registered key: its token below the next, token 0 only in the
    /// restart grace, its lease end not below the expiry floor; and the
    /// grant ages counting every client grant.
    fn check_keys(&self) {
        let mut granted = 0usize;
        let mut first_grant = None::<Millis>;
        let permits = self
            .permits
            .iter()
            .flat_map(|(key, set)| set.grants.iter().map(move |g| (key.as_str(), &g.slot)));
        for (key, slot) in self
            .keys
            .iter()
            .map(|(k, s)| (k.as_str(), s))
            .chain(permits)
        {
            if self.clocked && slot.token != 0 {
                granted += 1;
                first_grant = Some(first_grant.map_or(slot.granted_at, |g| g.min(slot.granted_at)));
            }
            assert!(
                slot.token < self.next_token,
                "token {} of {key:?} not below next {}",
                slot.token,
                self.next_token
            );
            assert!(
                slot.token > 0 || slot.expires_at <= self.grace_until,
                "token 0 on {key:?} outside the restart grace"
            );
            assert!(
                self.expiry_floor <= slot.expires_at,
                "expiry floor {} above the lease end {} of {key:?}",
                self.expiry_floor,
                slot.expires_at
            );
        }
        if self.clocked {
            assert_eq!(
                self.holds.len(),
                granted,
                "the grant ages do not count every grant"
            );
            assert_eq!(
                self.holds.oldest(),
                first_grant.map(|g| Millis(g.0 / 1000 * 1000)),
                "the grant ages' oldest second is not the table's"
            );
        }
    }

    /// Every key of limit 2 or more (PROTOCOL §6): not also a mutex, its
    /// limit at least 2, no more grants than its limit, an exclusive grant
    /// alone, tokens distinct, and something in it (a grant or a waiter).
    fn check_permits(&self) {
        for (key, set) in self.permits.iter() {
            let key = key.as_str();
            assert!(
                !self.keys.contains_key(key),
                "{key:?} is a mutex and has permits"
            );
            assert!(set.limit >= 2, "{key:?} has permits of limit {}", set.limit);
            assert!(
                set.grants.len() <= usize::from(set.limit),
                "{key:?} has {} grants, limit {}",
                set.grants.len(),
                set.limit
            );
            assert!(
                set.grants.len() == 1 || set.grants.iter().all(|g| !g.exclusive),
                "{key:?} has an exclusive grant beside another"
            );
            let mut tokens: Vec<u64> = set.grants.iter().map(|g| g.slot.token).collect();
            tokens.sort_unstable();
            tokens.dedup();
            assert_eq!(tokens.len(), set.grants.len(), "{key:?} has a token twice");
            assert!(
                !set.grants.is_empty() || self.queues.contains_key(key),
                "{key:?} has neither grants nor waiters"
            );
            if let Some(head) = self.queues.get(key).and_then(|q| q.waiters.front()) {
                // Whenever a place frees, the heads that fit are granted.
                assert!(
                    !set.fits(!head.shared()),
                    "{key:?}: its head waiter fits but waits"
                );
            }
        }
    }

    /// Every queue: its key registered, not empty, within its limit, its
    /// one timer entry no later than anything due; then its waiters.
    /// Returns the waiters counted by connection index.
    fn check_queues(&self) -> HashMap<u32, u32> {
        let mut by_conn: HashMap<u32, u32> = HashMap::new();
        let mut seen_slots = HashSet::new();
        for (key, q) in self.queues.iter() {
            assert!(
                self.keys.contains_key(key) || self.permits.contains_key(key),
                "{key:?} has a queue but is not registered"
            );
            let first_end = self.first_grant_end(key);
            assert!(!q.waiters.is_empty(), "{key:?} has an empty queue");
            assert!(
                q.waiters.len() <= self.limits.max_waiters_per_key,
                "{key:?} over max_waiters_per_key"
            );
            if self.clocked {
                assert!(
                    self.timers
                        .get(&(q.timer_at, q.timer_seq))
                        .is_some_and(|k| Arc::ptr_eq(k, key)),
                    "{key:?} has waiters but no timer"
                );
                let first_due = q
                    .waiters
                    .iter()
                    .map(|w| w.wait_deadline)
                    .min()
                    .unwrap_or(Millis::NEVER)
                    .min(first_end);
                assert!(
                    q.timer_at <= first_due,
                    "{key:?} timer at {} is later than {first_due}",
                    q.timer_at
                );
            }
            self.check_waiters(key, q, &mut by_conn, &mut seen_slots);
        }
        let total: usize = by_conn.values().map(|&n| n as usize).sum();
        assert_eq!(total, self.waiters_total, "waiter count drifted");
        let queues_with_timers = if self.clocked { self.queues.len() } else { 0 };
        assert_eq!(
            self.timers.len(),
            queues_with_timers,
            "timer entries of keys without waiters, or two for one key"
        );
        by_conn
    }

    /// The waiters of `key`'s queue `q`: a lease, a connection slot of
    /// their own that names this queue's key. Counts them into `by_conn`.
    fn check_waiters(
        &self,
        key: &Arc<str>,
        q: &Queue<T>,
        by_conn: &mut HashMap<u32, u32>,
        seen_slots: &mut HashSet<(u32, u32)>,
    ) {
        for w in &q.waiters {
            *by_conn.entry(w.conn).or_insert(0) += 1;
            assert!(w.lease_s() > 0, "waiter on {key:?} with lease 0");
            assert!(
                seen_slots.insert((w.conn, w.slot)),
                "two waiters share connection slot {}/{}",
                w.conn,
                w.slot
            );
            let cw = self
                .conn_table
                .conns
                .get(w.conn as usize)
                .unwrap_or_else(|| panic!("waiter on {key:?} names no connection"));
            match cw.slots.get(w.slot as usize) {
                Some(ConnSlot::Queued(k)) if Arc::ptr_eq(k, key) => {}
                other => panic!("waiter on {key:?} recorded as {other:?}"),
            }
        }
    }

    /// The connection table: indexed both ways, each entry with waiters,
    /// as many as the queues hold of it (`by_conn`), its slots either
    /// queued or on a free list that does not loop.
    fn check_conns(&self, by_conn: &HashMap<u32, u32>) {
        assert_eq!(
            self.conn_table.index.len(),
            self.conn_table.conns.len(),
            "connection index and table differ"
        );
        for (i, cw) in &self.conn_table.conns {
            let i = u32::try_from(i).expect("index fits");
            assert_eq!(
                self.conn_table.index.get(&cw.id),
                Some(&i),
                "connection {} not indexed",
                cw.id
            );
            assert!(cw.count > 0, "connection {} kept without waiters", cw.id);
            assert_eq!(
                by_conn.get(&i).copied().unwrap_or(0),
                cw.count,
                "per-connection waiter count of {} drifted",
                cw.id
            );
            let queued = cw
                .slots
                .iter()
                .filter(|s| matches!(s, ConnSlot::Queued(_)))
                .count();
            assert_eq!(queued, cw.count as usize, "slots of {} drifted", cw.id);
            let mut free = 0usize;
            let mut at = cw.free;
            while at != NO_SLOT {
                free += 1;
                assert!(free <= cw.slots.len(), "free list of {} loops", cw.id);
                match cw.slots.get(at as usize) {
                    Some(ConnSlot::Free(next)) => at = *next,
                    other => panic!("free list of {} reaches {other:?}", cw.id),
                }
            }
            assert_eq!(free + queued, cw.slots.len(), "lost slots in {}", cw.id);
        }
    }

    /// The holders' counts and the memory estimate against a recount of
    /// the tables.
    fn check_accounting(&self) {
        let mut uses: HashMap<u64, HolderUse> = HashMap::new();
        let mut key_bytes = 0;
        let permits = self
            .permits
            .iter()
            .flat_map(|(key, set)| set.grants.iter().map(move |g| (key.as_str(), &g.slot)));
        for (key, slot) in self
            .keys
            .iter()
            .map(|(k, s)| (k.as_str(), s))
            .chain(permits)
        {
            key_bytes += quota::key_cost(key.len());
            if slot.holder != 0 {
                uses.entry(slot.holder).or_default().keys += 1;
            }
        }
        for (_, cw) in &self.conn_table.conns {
            if cw.holder != 0 {
                uses.entry(cw.holder).or_default().waiters += cw.count as usize;
            }
        }
        let queue_bytes: u64 = self
            .queues
            .iter()
            .map(|(k, _)| quota::queue_cost(k.len()))
            .sum();
        assert_eq!(self.key_bytes, key_bytes, "key bytes drifted");
        assert_eq!(self.queue_bytes, queue_bytes, "queue bytes drifted");
        let counted: HashMap<u64, HolderUse> = self.holders.iter().collect();
        assert_eq!(counted, uses, "holder counts drifted");
        assert_eq!(counted.len(), self.holders.len(), "a holder counted twice");
        for (h, u) in &counted {
            assert_eq!(self.holder_use(*h), *u, "holder {h} found wrong");
        }
    }
}

//! The grant times behind `ticketd_wait_seconds` and
//! `ticketd_hold_seconds` in cluster mode.

use crate::cluster::log::Disk;
use crate::metrics::Histogram;
use crate::time::Millis;

use super::Node;

impl<D: Disk> Node<D> {
    /// Grant `token` ended (released, or its lease expired) as this node
    /// applied it at `now`.
    pub(super) fn hold_ended(&mut self, now: Millis, token: u64) {
        if let Some(began) = self.holds.end(token) {
            if self.is_leader() {
                self.hold_ms.observe(now.since(began));
            }
        }
    }

    /// The grants of the table as it is now, all begun at `at`: the
    /// table keeps no clock, so for a table restored from a snapshot
    /// the restore is the earliest moment this node knows of.
    pub(super) fn reseed_holds(&mut self, at: Millis) {
        self.holds.clear();
        let mut tokens: Vec<u64> = self.sm.holders().map(|(_, t, _, _)| t).collect();
        tokens.sort_unstable();
        for t in tokens {
            self.holds.start(t, at);
        }
    }

    /// `ticketd_wait_seconds` and `ticketd_hold_seconds` in cluster mode.
    ///
    /// A wait is counted by the node its client is connected to, from the
    /// request's arrival to the grant's answer. A hold is counted once in
    /// the cluster, by the node that is leader when its end applies, from
    /// when that node applied the grant to when it applied the release or
    /// the expiry: every node keeps the grant times, so a new leader
    /// measures holds that began under the old one. Summed over the
    /// cluster's nodes, both count each grant once.
    #[must_use]
    pub fn lock_histograms(&self) -> (&Histogram, &Histogram) {
        (&self.wait_ms, &self.hold_ms)
    }

    /// When the longest-held current grant began, as this node applied it.
    #[must_use]
    pub fn oldest_hold(&self) -> Option<Millis> {
        self.holds.oldest()
    }
}

//! What a generator thread counts ([`Stats`]), the grants the FIFO check
//! reads ([`GrantRecord`]), and the check itself ([`fifo_violations`]).

use crate::hist::Histogram;

/// One grant as the FIFO check needs it. Times are the generator's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantRecord {
    /// Index of the hot key.
    pub key: u32,
    /// The grant's fencing token: the server's grant order.
    pub token: u64,
    /// No later than the moment the acquire was written to the socket.
    pub sent_ns: u64,
    /// A moment by which the server had certainly processed the acquire:
    /// when the reply to the probe sent right behind it on the same
    /// connection (or the grant itself) had been read.
    pub queued_ns: u64,
}

/// What one worker measured (after the warm-up).
#[derive(Debug, Default)]
pub struct Stats {
    /// Replies received (= requests answered).
    pub replies: u64,
    /// Acquires granted.
    pub grants: u64,
    /// Acquires not granted (T, or a Redis nil that was not retried).
    pub not_granted: u64,
    /// Acquires refused for capacity (B).
    pub busy: u64,
    /// Releases that took effect.
    pub released: u64,
    /// Releases that changed nothing: with the generator's own tokens this
    /// only happens if a lease ran out first.
    pub not_released: u64,
    /// Redis polls (`SET NX` repeated by a waiting slot).
    pub polls: u64,
    /// FIFO probes answered (contended ticketd runs; not counted as requests).
    pub probes: u64,
    /// Extends answered `E` (extend modes).
    pub extended: u64,
    /// Extends answered `X`: the generator only extends grants it holds
    /// within their lease, so any of these is a failure.
    pub not_extended: u64,
    /// Request to reply, nanoseconds.
    pub latency: Histogram,
    /// First attempt of an acquire to its grant, nanoseconds (contended).
    pub wait_to_grant: Histogram,
    /// Every grant of a hot key (contended, ticketd), warm-up included.
    pub grant_log: Vec<GrantRecord>,
}

impl Stats {
    /// Adds `other` into `self`.
    pub fn merge(&mut self, mut other: Stats) {
        self.replies += other.replies;
        self.grants += other.grants;
        self.not_granted += other.not_granted;
        self.busy += other.busy;
        self.released += other.released;
        self.not_released += other.not_released;
        self.polls += other.polls;
        self.probes += other.probes;
        self.extended += other.extended;
        self.not_extended += other.not_extended;
        self.latency.merge(&other.latency);
        self.wait_to_grant.merge(&other.wait_to_grant);
        self.grant_log.append(&mut other.grant_log);
    }

    /// Starts the measured window: every count from zero, the grant log
    /// (warm-up included) kept.
    pub(super) fn reset_measured(&mut self) {
        let log = std::mem::take(&mut self.grant_log);
        *self = Stats {
            grant_log: log,
            ..Stats::default()
        };
    }
}

/// The FIFO check over a grant log.
///
/// Acquires that reach the server in the same loop turn have no order the
/// client can see, so the check only uses order it can prove: if acquire J
/// was certainly processed (queued) before acquire I was even sent
/// (`J.queued_ns < I.sent_ns`), FIFO hand-over must grant J before I, i.e.
/// give J the smaller token. Expired leases (the non-FIFO path) cannot occur
/// when every holder releases at once within its lease.
///
/// Returns (grants checked, grants that overtook an acquire queued before
/// they were sent).
#[must_use]
pub fn fifo_violations(log: &mut [GrantRecord]) -> (u64, u64) {
    log.sort_unstable_by_key(|g| (g.key, g.token));
    let mut bad = 0;
    // Walk each key's grants from the last token to the first, keeping the
    // earliest proven-queued time among the later grants.
    let mut later_min_queued = u64::MAX;
    for i in (0..log.len()).rev() {
        if i + 1 < log.len() && log[i + 1].key != log[i].key {
            later_min_queued = u64::MAX;
        }
        if log[i].sent_ns > later_min_queued {
            bad += 1;
        }
        later_min_queued = later_min_queued.min(log[i].queued_ns);
    }
    (log.len() as u64, bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_check_counts_only_overtakes_it_can_prove() {
        let g = |key, token, sent_ns, queued_ns| GrantRecord {
            key,
            token,
            sent_ns,
            queued_ns,
        };
        // Key 0: acquires sent at 10 and 11 reached the server together; the
        // later one won: no order was proven, no violation.
        // Key 1: the acquire granted token 5 was sent at 40, after the one
        // granted token 9 was proven queued at 30: a violation.
        let mut log = vec![
            g(0, 2, 11, 15),
            g(0, 3, 10, 15),
            g(1, 9, 20, 30),
            g(1, 5, 40, 45),
            g(1, 12, 50, 55),
        ];
        assert_eq!(fifo_violations(&mut log), (5, 1));
        // The same on different keys proves nothing.
        let mut other_keys = vec![g(2, 9, 20, 30), g(3, 5, 40, 45)];
        assert_eq!(fifo_violations(&mut other_keys), (2, 0));
    }
}

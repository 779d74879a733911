//! [`Observe`]: what the admin port reads of a service (the lock table,
//! metrics, readiness, the cluster's status), apart from the request path.

use crate::engine::LockTable;
use crate::metrics::{Exposition, Histogram};
use crate::time::Millis;

/// Why a service cannot grant now: `GET /readyz` answers 503 with it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NotReady {
    /// Single mode's restart grace holds every key for this much longer.
    RestartGrace {
        /// Milliseconds until the leases of the earlier run have ended.
        left_ms: u64,
    },
    /// Single mode: the token high-water mark or the lease bound is not on
    /// disk yet.
    TokensNotDurable,
    /// Cluster mode: the node stopped after a fatal error.
    Stopped(String),
    /// Cluster mode: no leader is known.
    NoLeader {
        /// This node's term.
        term: u64,
    },
    /// Cluster mode: a leader is known, but no entry of its term is
    /// applied here yet, so the table may lack earlier grants.
    CatchingUp {
        /// The leader's id.
        leader: u64,
        /// The term.
        term: u64,
        /// The last entry applied here.
        applied: u64,
        /// The last entry known committed.
        committed: u64,
    },
}

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotReady::RestartGrace { left_ms } => write!(
                f,
                "restart grace: every key is held for {left_ms} ms more, until leases of the \
                 earlier run have ended"
            ),
            NotReady::TokensNotDurable => f.write_str(
                "the token high-water mark or the lease bound is not durable yet (see the log)",
            ),
            NotReady::Stopped(why) => write!(f, "the node stopped: {why}"),
            NotReady::NoLeader { term } => write!(f, "no leader known (term {term})"),
            NotReady::CatchingUp {
                leader,
                term,
                applied,
                committed,
            } => write!(
                f,
                "leader {leader} known, but no entry of term {term} applied here yet (applied \
                 {applied}, commit {committed})"
            ),
        }
    }
}

impl std::error::Error for NotReady {}

/// What a service shows the admin port and the loop's logs; reached
/// through [`super::Service::observe`]. Every method has a default: a
/// service shows what it has.
pub trait Observe {
    /// The lock table, for the admin port's metrics and lock listings.
    fn lock_table(&self) -> Option<&dyn LockTable> {
        None
    }

    /// `ticketd_wait_seconds` and `ticketd_hold_seconds` when the service
    /// keeps them itself (cluster mode: the replicated table has no
    /// clock); `None`: the engine's own.
    fn lock_histograms(&self) -> Option<(&Histogram, &Histogram)> {
        None
    }

    /// How long the longest-held current grant has been held at `now`, for
    /// `ticketd_oldest_hold_seconds`; `None` when nothing is held. O(1):
    /// a scrape never walks the table.
    fn oldest_hold_ms(&self, now: Millis) -> Option<u64> {
        self.lock_table().and_then(|e| e.oldest_hold_ms(now))
    }

    /// Whether the service can grant now, for the admin port's
    /// `GET /readyz`: the reason when it cannot.
    ///
    /// # Errors
    /// Not ready, and why.
    fn readiness(&self, now: Millis) -> Result<(), NotReady> {
        let _ = now;
        Ok(())
    }

    /// Metrics of the service's own (cluster mode: Raft, the WAL), added
    /// to a scrape of `GET /metrics`.
    fn write_metrics(&self, now: Millis, out: &mut Exposition) {
        let _ = (now, out);
    }

    /// The JSON object of `GET /v1/cluster`, in cluster mode.
    fn cluster_json(&self, now: Millis) -> Option<String> {
        let _ = now;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::NotReady;

    #[test]
    fn not_ready_says_why_in_a_sentence() {
        assert_eq!(
            NotReady::RestartGrace { left_ms: 1500 }.to_string(),
            "restart grace: every key is held for 1500 ms more, until leases of the earlier \
             run have ended"
        );
        assert_eq!(
            NotReady::NoLeader { term: 3 }.to_string(),
            "no leader known (term 3)"
        );
        assert_eq!(
            NotReady::CatchingUp {
                leader: 2,
                term: 3,
                applied: 7,
                committed: 9
            }
            .to_string(),
            "leader 2 known, but no entry of term 3 applied here yet (applied 7, commit 9)"
        );
        assert_eq!(
            NotReady::Stopped("disk full".into()).to_string(),
            "the node stopped: disk full"
        );
    }
}

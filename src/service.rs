//! The boundary between the mio shell and whatever answers requests.
//!
//! The server loop ([`crate::server`]) owns sockets, buffers and the clock; a
//! [`Service`] owns the lock state. Single mode's service is the engine plus
//! restart-safe tokens; cluster mode's service proposes every request to Raft
//! and answers after commit, and brings its own peer sockets, which it
//! registers in the same `mio::Poll`.

use std::io;

use mio::event::Event;
use mio::Registry;

use crate::engine::{ConnId, LockTable, Outbox};
use crate::metrics::Exposition;
use crate::proto::Request;
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

pub use crate::engine::Caller;

/// What the server loop drives. Every method gets `now`, read once per loop
/// turn; replies go into `out`, addressed by connection.
pub trait Service {
    /// One well-formed request from client connection `conn`.
    fn request(&mut self, now: Millis, conn: ConnId, req: Request<'_>, out: &mut Outbox);

    /// [`Service::request`] from a connection of a known identity: a
    /// service that binds grants to identities records `who` with a grant
    /// and refuses releases and extends that `who` may not make. The loop
    /// calls this one; the default ignores `who`.
    fn request_as(
        &mut self,
        now: Millis,
        conn: ConnId,
        who: Caller,
        req: Request<'_>,
        out: &mut Outbox,
    ) {
        let _ = who;
        self.request(now, conn, req, out);
    }

    /// The loop's connections take `bytes` of the memory budget
    /// (`--max-memory`) now: called once per turn, before its requests. A
    /// service whose engine refuses new keys and waiters past the budget
    /// leaves them the rest (single mode); the default ignores it (cluster
    /// mode, whose nodes must refuse alike).
    fn set_connection_memory(&mut self, bytes: u64) {
        let _ = bytes;
    }

    /// Whether every `N` and `X` answer to a release or extend is in the
    /// outbox when [`Service::request_as`] returns (single mode): the loop
    /// then charges each to its identity's guess budget as it is made.
    /// Otherwise (cluster mode: answers come after Raft commits) the loop
    /// counts every release and extend read in a turn as a possible wrong
    /// answer until the turn's answers are in.
    fn answers_in_the_call(&self) -> bool {
        false
    }

    /// `conn` is gone (closed by the peer, or closed for malformed input):
    /// cancel its queued acquires. What it holds stays held.
    fn disconnect(&mut self, now: Millis, conn: ConnId, out: &mut Outbox);

    /// Process whatever is due by `now`.
    fn tick(&mut self, now: Millis, out: &mut Outbox);

    /// The next moment [`Service::tick`] has work, for the poll timeout.
    fn next_deadline(&self) -> Option<Millis>;

    /// Called once per loop turn after the turn's requests and ticks and
    /// before any reply of the turn is written to a socket. Single mode makes
    /// its token high-water mark durable here; cluster mode handles Raft's
    /// Ready (persist, then send).
    fn end_turn(&mut self, now: Millis, out: &mut Outbox) -> io::Result<()> {
        let _ = (now, out);
        Ok(())
    }

    /// Connections the service wants closed, moved into `out`: asked after
    /// each turn's replies are delivered, so each is closed after what was
    /// already answered on it is flushed (its pending requests are then
    /// dropped through [`Service::disconnect`]). Cluster mode closes a
    /// connection whose request applied where this node cannot tell its
    /// answer (inside a snapshot it installed), so that the client learns
    /// at once that the outcome is unknown. The default closes none.
    fn take_closes(&mut self, out: &mut Vec<ConnId>) {
        let _ = out;
    }

    /// Whether the server may have the replies to a connection's requests
    /// encoded straight into that connection's write buffer while it handles
    /// them ([`Outbox::begin_direct`]): they are then not read back from the
    /// outbox ([`Outbox::iter`], [`Outbox::events`]), though
    /// [`Outbox::retain_leases`] still withholds them. Single mode says yes;
    /// the default, no.
    fn replies_direct(&self) -> bool {
        false
    }

    /// Whether [`Service::end_turn`] may withhold the turn's grants and
    /// extensions ([`Outbox::retain_leases`]). When not, the server has the
    /// outbox skip the marks it keeps of the grants written straight into
    /// write buffers ([`Outbox::set_direct_grant_marks`]). Asked once, when
    /// the server is made; the default, yes.
    fn withholds_grants(&self) -> bool {
        true
    }

    /// Why the server must stop at once, if it must: asked after an
    /// [`Service::end_turn`] that failed. The loop then writes none of the
    /// turn's replies and [`crate::server::Server::run`] returns the reason
    /// as its error (cluster mode, when the daemon asked for it, after the
    /// node's disk failed). `None`, the default, keeps the loop running.
    fn must_stop(&self) -> Option<String> {
        None
    }

    /// The server is stopping cleanly (SIGTERM, SIGINT, a shutdown
    /// handle): every connection is closed and no request follows. Single
    /// mode records here which leases are still outstanding, so that the
    /// next start holds keys only as long as it must.
    fn stop(&mut self, now: Millis) {
        let _ = now;
    }

    /// Registers the service's own event sources (cluster peers) with mio
    /// tokens at or above `token_base`. The server never uses those tokens.
    fn register(&mut self, registry: &Registry, token_base: usize) -> io::Result<()> {
        let _ = (registry, token_base);
        Ok(())
    }

    /// Hands the service the loop's waker, for work of its own that ends off
    /// the loop's thread (cluster mode's background fsync): a wake makes the
    /// loop run a turn, whose [`Service::tick`] takes the result in. The
    /// default ignores it.
    fn set_waker(&mut self, waker: std::sync::Arc<mio::Waker>) {
        let _ = waker;
    }

    /// An event for one of the service's own tokens (at or above `token_base`).
    fn event(&mut self, now: Millis, registry: &Registry, event: &Event, out: &mut Outbox) {
        let _ = (now, registry, event, out);
    }

    /// One line describing the service for the start-up log.
    fn describe(&self) -> String {
        String::new()
    }

    /// Whether the service serves, for systemd's `READY=1`: at once in
    /// single mode; cluster mode once a leader is known.
    fn serving(&self) -> bool {
        true
    }

    /// The lock table, for the admin port's metrics and lock listings.
    fn engine(&self) -> Option<&dyn LockTable> {
        None
    }

    /// `ticketd_wait_seconds` and `ticketd_hold_seconds` when the service
    /// keeps them itself (cluster mode: the replicated table has no
    /// clock); `None`: the engine's own.
    fn lock_histograms(&self) -> Option<(&crate::metrics::Histogram, &crate::metrics::Histogram)> {
        None
    }

    /// How long the longest-held current grant has been held at `now`, for
    /// `ticketd_oldest_hold_seconds`; `None` when nothing is held. O(1):
    /// a scrape never walks the table.
    fn oldest_hold_ms(&self, now: Millis) -> Option<u64> {
        self.engine().and_then(|e| e.oldest_hold_ms(now))
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

    /// A membership change asked for on the admin port
    /// (`POST`/`DELETE /v1/cluster/members/...`): the HTTP status and the
    /// body. The default: not a cluster node.
    fn member_change(&mut self, now: Millis, change: MemberChange) -> (u16, String) {
        let _ = (now, change);
        (404, "not a cluster node\n".to_owned())
    }
}

/// A membership change as the admin port parses it (see
/// `docs/OPERATIONS.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberChange {
    /// `POST /v1/cluster/members/ID?address=HOST:PORT`: add a learner.
    Add {
        /// The new node's id.
        id: u64,
        /// Its peer address.
        address: std::net::SocketAddr,
    },
    /// `POST /v1/cluster/members/ID/promote`: make a learner a voter.
    Promote {
        /// The learner's id.
        id: u64,
    },
    /// `DELETE /v1/cluster/members/ID[?force=true]`: remove a member.
    Remove {
        /// The member's id.
        id: u64,
        /// Skip the check that a majority of the voters stays reachable.
        force: bool,
    },
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

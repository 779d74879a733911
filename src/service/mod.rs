//! The boundary between the mio shell and whatever answers requests.
//!
//! The server loop ([`crate::server`]) owns sockets, buffers and the clock; a
//! [`Service`] owns the lock state. Single mode's service is the engine plus
//! restart-safe tokens; cluster mode's service proposes every request to Raft
//! and answers after commit, and brings its own peer sockets, which it
//! registers in the same `mio::Poll`.
//!
//! [`Service`] is the request path and the loop's hooks around it;
//! what the admin port reads ([`Observe`]) and cluster mode's membership
//! changes ([`Membership`]) are traits of their own, reached through
//! [`Service::observe`] and [`Service::membership`].

use std::io;

use mio::event::Event;
use mio::Registry;

use crate::engine::{ConnId, Outbox};
use crate::proto::Request;
use crate::time::Millis;

mod membership;
mod observe;

pub use crate::engine::Caller;
pub use membership::{MemberChange, Membership, Refusal, RefusalKind};
pub use observe::{NotReady, Observe};

/// What the server loop drives: the requests, the turn's hooks around
/// them (ticks, the end of the turn, closes, the stop), how replies may be
/// written, and the service's own event sources. Every method gets `now`,
/// read once per loop turn; replies go into `out`, addressed by
/// connection.
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

    /// What the admin port (metrics, readiness, lock listings, cluster
    /// status) and the loop's quota logs read of the service; `None`, the
    /// default: nothing beyond the loop's own counters.
    fn observe(&self) -> Option<&dyn Observe> {
        None
    }

    /// Where the admin port's membership changes go; `None`, the default:
    /// not a cluster node.
    fn membership(&mut self) -> Option<&mut dyn Membership> {
        None
    }
}

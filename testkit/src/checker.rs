//! A safety checker for recorded client histories.
//!
//! Tests that drive ticketd (the deterministic simulation, the real-process
//! fault tests, cluster tests) record what every client did and saw as a
//! [`History`]: when each acquire was invoked and how it completed, when each
//! release was invoked, when sessions were closed. [`History::check`] then
//! verifies, from the clients' point of view, the guarantees of PROTOCOL §2–§3:
//!
//! * **Mutual exclusion** ([`Property::MutualExclusion`]): per key of
//!   limit 1 (a mutex), no two grant intervals overlap. A grant's interval runs from the moment the
//!   client received it to the earlier of its release (the moment the release
//!   was invoked) and the client's conservative lease end (the moment the
//!   acquire was invoked plus the lease, as the grant's extensions moved it:
//!   lowered to an extension's invocation plus its lease the moment it is
//!   invoked, if that is earlier, and set to it when its `E` comes back in
//!   time; PROTOCOL §5.3). A client never uses a grant outside that interval, so
//!   an overlap means two clients could act on one lock.
//! * **Permits** (PROTOCOL §6.2), for keys acquired with a limit N of 2 or
//!   more ([`History::acquire_with`]): at no instant more than N grant
//!   intervals of the key overlap ([`Property::PermitCount`]); an exclusive
//!   interval overlaps no other interval of its key, while shared ones may
//!   overlap each other ([`Property::ExclusiveAlone`]); and a key has one
//!   limit while it has grants: overlapping intervals were granted with the
//!   same limit, and a LimitMismatch answer names the limit of a grant that
//!   stood throughout the request, in a history without restarts
//!   ([`Property::KeyLimit`]). A plain acquire
//!   ([`History::acquire`]) is limit 1, exclusive.
//! * **Token order** ([`Property::TokenOrder`]): fencing tokens are unique,
//!   never 0, and if one grant was received before another acquire was even
//!   invoked, the earlier grant's token is the smaller. This holds across
//!   keys, server restarts and leader changes.
//! * **FIFO hand-over** ([`Property::Fifo`]): among acquires the server
//!   queued on a key (a [`History::queued`] event, recorded where the test
//!   knows it, as the simulation does), a later one is never granted while an
//!   earlier one is still waiting: session open, wait not run out, and later
//!   answered Timeout or granted a larger token. (An earlier acquire whose
//!   answer never arrived may have been granted first, so it proves nothing.)
//!   On a key of limit 2 or more there is no takeover (PROTOCOL §6.2: an
//!   acquire fits only with nobody queued before it, and the queue's heads
//!   are granted in order), so there an acquire granted without queueing,
//!   invoked at least a millisecond (the server clock's resolution) after an
//!   earlier one was queued, must not be granted while that one still waits
//!   either.
//! * **Answered once** ([`Property::AnsweredOnce`]): every acquire and
//!   release is answered exactly once, or its session was closed after it was
//!   invoked; nothing is answered on a closed session.
//!
//! A single-mode server keeps its locks in memory only. Without a restart
//! grace, after a crash or a restart every key is free, and what protects a
//! resource from the holder of a grant made before the restart is the
//! fencing token (PROTOCOL §2.3). A history says so with
//! [`History::server_restart`], naming the first token of the new
//! incarnation (the server prints it at start-up). Mutual exclusion is then
//! checked among grants of one incarnation, and token order gains a check:
//! every grant received before the restart has a token below the new
//! incarnation's first. A restart with a grace (the new incarnation holds
//! every key until every lease of the earlier ones has ended) is recorded
//! with [`History::server_restart_with_grace`]: mutual exclusion is then
//! checked *across* it, as if the server had never stopped.
//!
//! Every timestamp is in microseconds on one monotonic timeline shared by
//! all clients: the simulation's virtual clock, or one [`RealClock`] in a test
//! process. The checks are conservative where client-side times can only bound
//! server-side ones, so a correct server never fails them; a failure message
//! names the property, the key, the clients and the times involved.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Instant;

pub use ticketd::proto::{Mode, Places};

mod exclusion;
mod gather;
mod properties;

use exclusion::{check_exclusion, check_limit_answers};
use properties::{check_answered, check_fifo, check_restarts, check_tokens};

/// What a plain acquire (`A`) asks for: the key's one place (PROTOCOL §6.2:
/// the same as `P` with limit 1).
pub const MUTEX: Places = Places {
    limit: 1,
    mode: Mode::Exclusive,
};

/// Identifies one operation (an acquire or a release) in a history.
pub type OpId = u64;
/// Identifies one client (a process or thread using one lock at a time).
pub type ClientId = u64;
/// Identifies one session (a connection) of a client.
pub type SessionId = u64;

/// How an acquire completed, as its client saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Granted in time: the client holds the lock with this token.
    Granted {
        /// The fencing token.
        token: u64,
    },
    /// A grant that reached the client too late to use (after its deadline):
    /// the client does not enter, and releases it. It still counts for token
    /// order, but it has no interval.
    LateGrant {
        /// The fencing token.
        token: u64,
    },
    /// Not granted: `T`.
    Timeout,
    /// Not granted: `B`.
    Busy,
    /// Not granted: `L`, the key is registered with this other limit
    /// (PROTOCOL §6.2).
    LimitMismatch {
        /// The limit the answer carries.
        limit: u16,
    },
    /// The client gave up without an answer (PROTOCOL §3): it does not enter.
    Indeterminate,
}

/// How an extension completed, as its client saw it (PROTOCOL §5.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtendOutcome {
    /// `E`: the grant's lease was extended.
    Extended,
    /// `X`: the grant is gone; the client stops using it.
    NotExtended,
    /// No answer before the client's lease end: the ticket is lost.
    Lost,
}

/// How a release completed, as its client saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// `R`: the release took effect.
    Released,
    /// `N`: nothing changed.
    NotReleased,
    /// No answer; the client gave up.
    Indeterminate,
}

/// One recorded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// An acquire was invoked (at or before its first byte was written).
    Acquire {
        /// The operation.
        op: OpId,
        /// Who asked.
        client: ClientId,
        /// On which session (connection).
        session: SessionId,
        /// The lock name.
        key: String,
        /// The owner sent on the wire.
        owner: u64,
        /// The wait sent on the wire, in seconds.
        wait_s: u8,
        /// The lease sent on the wire, in seconds.
        lease_s: u8,
        /// The limit and mode asked for ([`MUTEX`] for a plain acquire).
        places: Places,
        /// When, in microseconds.
        at_us: u64,
    },
    /// The server put the acquire in its key's queue (known to tests that
    /// see the server side, like the simulation).
    Queued {
        /// The acquire.
        op: OpId,
        /// When, in microseconds.
        at_us: u64,
    },
    /// An acquire completed.
    Acquired {
        /// The acquire.
        op: OpId,
        /// How.
        outcome: Outcome,
        /// When, in microseconds.
        at_us: u64,
    },
    /// A release was invoked.
    Release {
        /// The operation.
        op: OpId,
        /// Who asked.
        client: ClientId,
        /// On which session.
        session: SessionId,
        /// The lock name.
        key: String,
        /// The token being released.
        token: u64,
        /// When, in microseconds.
        at_us: u64,
    },
    /// An extension was invoked (at or before its first byte was written).
    Extend {
        /// The operation.
        op: OpId,
        /// Who asked.
        client: ClientId,
        /// On which session.
        session: SessionId,
        /// The lock name.
        key: String,
        /// The token being extended.
        token: u64,
        /// The lease sent on the wire, in seconds.
        lease_s: u8,
        /// When, in microseconds.
        at_us: u64,
    },
    /// An extension completed.
    Extended {
        /// The extension.
        op: OpId,
        /// How.
        outcome: ExtendOutcome,
        /// When, in microseconds.
        at_us: u64,
    },
    /// A release completed.
    Released {
        /// The release.
        op: OpId,
        /// How.
        outcome: ReleaseOutcome,
        /// When, in microseconds.
        at_us: u64,
    },
    /// The server lost its lock state (a single-mode crash or restart): by
    /// `at_us` the old process was gone, and the new one issues tokens from
    /// `first_token` on.
    ServerRestart {
        /// When the old process was known to be gone, in microseconds.
        at_us: u64,
        /// The first token the new incarnation can issue.
        first_token: u64,
        /// The new incarnation held every key until the leases of the
        /// earlier ones had ended: exclusion holds across the restart.
        graced: bool,
    },
    /// A session was closed (by its client, by a crash, or by the network).
    /// Its unanswered operations need no answer.
    SessionClosed {
        /// The session.
        session: SessionId,
        /// When, in microseconds.
        at_us: u64,
    },
}

/// The property a history broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Property {
    /// Two grant intervals on one key of limit 1 overlap.
    MutualExclusion,
    /// More grant intervals overlap on a key than its limit.
    PermitCount,
    /// An exclusive grant interval overlaps another of its key.
    ExclusiveAlone,
    /// Grants of different limits overlap on one key, or a LimitMismatch
    /// answer names another limit than the grant standing on its key.
    KeyLimit,
    /// Tokens are not unique, are 0, or are out of real-time order.
    TokenOrder,
    /// A queued acquire was passed over on the release path.
    Fifo,
    /// An operation was answered twice, never, or on a closed session.
    AnsweredOnce,
    /// The history itself is inconsistent (an answer to an unknown
    /// operation, an answer before its invocation).
    Malformed,
}

impl fmt::Display for Property {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Property::MutualExclusion => "mutual exclusion",
            Property::PermitCount => "permit count",
            Property::ExclusiveAlone => "exclusive grant alone",
            Property::KeyLimit => "one limit per key",
            Property::TokenOrder => "token order",
            Property::Fifo => "FIFO hand-over",
            Property::AnsweredOnce => "answered exactly once",
            Property::Malformed => "well-formed history",
        })
    }
}

/// The first broken property found, with a message naming what broke it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Which property.
    pub property: Property,
    /// The keys, clients, tokens and times involved.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} violated: {}", self.property, self.message)
    }
}

impl std::error::Error for Violation {}

/// What a history that passed contained.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Acquires invoked.
    pub acquires: usize,
    /// Acquires granted in time (with an interval).
    pub grants: usize,
    /// Grants that arrived too late to use.
    pub late_grants: usize,
    /// Acquires answered Timeout.
    pub timeouts: usize,
    /// Acquires answered Busy.
    pub busy: usize,
    /// Acquires answered LimitMismatch.
    pub limit_mismatches: usize,
    /// Acquires with a limit of 2 or more (semaphores, read/write locks).
    pub permit_acquires: usize,
    /// Acquires that ended Indeterminate or unanswered on a closed session.
    pub indeterminate: usize,
    /// Releases invoked.
    pub releases: usize,
    /// Distinct keys.
    pub keys: usize,
    /// Acquires the server queued (with a [`Event::Queued`]).
    pub queued: usize,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} acquires on {} keys ({} with a limit): {} granted, {} late, {} timeout, \
             {} busy, {} limit mismatch, {} indeterminate ({} queued); {} releases",
            self.acquires,
            self.keys,
            self.permit_acquires,
            self.grants,
            self.late_grants,
            self.timeouts,
            self.busy,
            self.limit_mismatches,
            self.indeterminate,
            self.queued,
            self.releases
        )
    }
}

/// Microseconds on one monotonic timeline, for histories recorded by real
/// processes: every thread of a test reads the same `RealClock`.
#[derive(Clone, Copy, Debug)]
pub struct RealClock {
    origin: Instant,
}

impl RealClock {
    /// A clock whose zero is now.
    #[must_use]
    pub fn new() -> Self {
        RealClock {
            origin: Instant::now(),
        }
    }

    /// Microseconds since the clock was created.
    #[must_use]
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

impl Default for RealClock {
    fn default() -> Self {
        Self::new()
    }
}

/// A recorded history: events in any order (each carries its own time).
#[derive(Clone, Debug, Default)]
pub struct History {
    events: Vec<Event>,
    next_op: OpId,
}

/// An acquire with everything the checks need, gathered from its events.
#[derive(Clone, Debug)]
struct AcqRec {
    op: OpId,
    client: ClientId,
    session: SessionId,
    key: String,
    wait_s: u8,
    lease_s: u8,
    places: Places,
    invoked_us: u64,
    queued_us: Option<u64>,
    answer: Option<(Outcome, u64)>,
}

impl AcqRec {
    fn token(&self) -> Option<u64> {
        match self.answer {
            Some((Outcome::Granted { token } | Outcome::LateGrant { token }, _)) => Some(token),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        format!(
            "acquire op {} by client {} (session {}, invoked at {}us)",
            self.op, self.client, self.session, self.invoked_us
        )
    }
}

fn violation(property: Property, message: String) -> Violation {
    Violation { property, message }
}

impl History {
    /// An empty history.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The events recorded so far, in recording order.
    #[must_use]
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Appends an event as it is (its `op` must be unique for invocations).
    pub fn push(&mut self, event: Event) {
        if let Event::Acquire { op, .. } | Event::Release { op, .. } | Event::Extend { op, .. } =
            event
        {
            self.next_op = self.next_op.max(op + 1);
        }
        self.events.push(event);
    }

    /// Appends the events of another history recorded on the same timeline
    /// (another thread's); its operation ids are renumbered to stay unique.
    pub fn merge(&mut self, other: History) {
        let base = self.next_op;
        for mut e in other.events {
            match &mut e {
                Event::Acquire { op, .. }
                | Event::Queued { op, .. }
                | Event::Acquired { op, .. }
                | Event::Release { op, .. }
                | Event::Released { op, .. }
                | Event::Extend { op, .. }
                | Event::Extended { op, .. } => *op += base,
                Event::SessionClosed { .. } | Event::ServerRestart { .. } => {}
            }
            self.push(e);
        }
        self.next_op = self.next_op.max(base + other.next_op);
    }

    /// Records an acquire invocation (a plain `A`, a mutex) and returns
    /// its operation id.
    #[allow(clippy::too_many_arguments)]
    pub fn acquire(
        &mut self,
        client: ClientId,
        session: SessionId,
        key: &str,
        owner: u64,
        wait_s: u8,
        lease_s: u8,
        at_us: u64,
    ) -> OpId {
        self.acquire_with(client, session, key, owner, wait_s, lease_s, MUTEX, at_us)
    }

    /// Records the invocation of an acquire with a limit (`P`, PROTOCOL §6)
    /// asking for `places`, and returns its operation id.
    #[allow(clippy::too_many_arguments)]
    pub fn acquire_with(
        &mut self,
        client: ClientId,
        session: SessionId,
        key: &str,
        owner: u64,
        wait_s: u8,
        lease_s: u8,
        places: Places,
        at_us: u64,
    ) -> OpId {
        let op = self.next_op;
        self.push(Event::Acquire {
            op,
            client,
            session,
            key: key.to_string(),
            owner,
            wait_s,
            lease_s,
            places,
            at_us,
        });
        op
    }

    /// Records that the server queued acquire `op` at `at_us`.
    pub fn queued(&mut self, op: OpId, at_us: u64) {
        self.push(Event::Queued { op, at_us });
    }

    /// Records how acquire `op` completed.
    pub fn acquired(&mut self, op: OpId, outcome: Outcome, at_us: u64) {
        self.push(Event::Acquired { op, outcome, at_us });
    }

    /// Records a release invocation and returns its operation id.
    pub fn release(
        &mut self,
        client: ClientId,
        session: SessionId,
        key: &str,
        token: u64,
        at_us: u64,
    ) -> OpId {
        let op = self.next_op;
        self.push(Event::Release {
            op,
            client,
            session,
            key: key.to_string(),
            token,
            at_us,
        });
        op
    }

    /// Records how release `op` completed.
    pub fn released(&mut self, op: OpId, outcome: ReleaseOutcome, at_us: u64) {
        self.push(Event::Released { op, outcome, at_us });
    }

    /// Records an extension invocation and returns its operation id.
    pub fn extend(
        &mut self,
        client: ClientId,
        session: SessionId,
        key: &str,
        token: u64,
        lease_s: u8,
        at_us: u64,
    ) -> OpId {
        let op = self.next_op;
        self.push(Event::Extend {
            op,
            client,
            session,
            key: key.to_string(),
            token,
            lease_s,
            at_us,
        });
        op
    }

    /// Records how extension `op` completed.
    pub fn extended(&mut self, op: OpId, outcome: ExtendOutcome, at_us: u64) {
        self.push(Event::Extended { op, outcome, at_us });
    }

    /// Records that the server lost its lock state by `at_us` and that its
    /// new incarnation issues tokens from `first_token` on.
    pub fn server_restart(&mut self, at_us: u64, first_token: u64) {
        self.push(Event::ServerRestart {
            at_us,
            first_token,
            graced: false,
        });
    }

    /// Like [`History::server_restart`], for a restart with a grace: the
    /// new incarnation grants nothing while a lease of an earlier one may
    /// still run, so mutual exclusion is checked across the restart.
    pub fn server_restart_with_grace(&mut self, at_us: u64, first_token: u64) {
        self.push(Event::ServerRestart {
            at_us,
            first_token,
            graced: true,
        });
    }

    /// Records that `session` was closed at `at_us`.
    pub fn session_closed(&mut self, session: SessionId, at_us: u64) {
        self.push(Event::SessionClosed { session, at_us });
    }

    /// Checks every property; the first violation found is returned.
    ///
    /// # Errors
    ///
    /// A [`Violation`] naming the property and what broke it.
    pub fn check(&self) -> Result<Report, Violation> {
        self.check_with_lease_margin(0)
    }

    /// Like [`History::check`], for clients that stop using a grant
    /// `margin_us` before their conservative lease end (a safety margin such
    /// as lock clients keep against clock drift): each interval ends that much
    /// earlier.
    ///
    /// # Errors
    ///
    /// A [`Violation`] naming the property and what broke it.
    pub fn check_with_lease_margin(&self, margin_us: u64) -> Result<Report, Violation> {
        let (acqs, releases, closed) = self.gather()?;
        let restarts = self.restarts()?;
        let extensions = self.extensions()?;
        check_answered(&acqs, &releases, &closed)?;
        check_tokens(&acqs)?;
        check_restarts(&acqs, &restarts)?;
        check_exclusion(&acqs, &releases, &extensions, &restarts, margin_us)?;
        check_limit_answers(&acqs, &releases, &extensions, &restarts, margin_us)?;
        check_fifo(&acqs, &closed)?;
        let mut report = Report {
            acquires: acqs.len(),
            releases: releases.len(),
            ..Report::default()
        };
        let mut keys: Vec<&str> = acqs.values().map(|a| a.key.as_str()).collect();
        keys.sort_unstable();
        keys.dedup();
        report.keys = keys.len();
        for a in acqs.values() {
            report.queued += usize::from(a.queued_us.is_some());
            report.permit_acquires += usize::from(a.places.limit > 1);
            match a.answer {
                Some((Outcome::Granted { .. }, _)) => report.grants += 1,
                Some((Outcome::LateGrant { .. }, _)) => report.late_grants += 1,
                Some((Outcome::Timeout, _)) => report.timeouts += 1,
                Some((Outcome::Busy, _)) => report.busy += 1,
                Some((Outcome::LimitMismatch { .. }, _)) => report.limit_mismatches += 1,
                Some((Outcome::Indeterminate, _)) | None => report.indeterminate += 1,
            }
        }
        Ok(report)
    }
}

/// A release with its answers.
#[derive(Clone, Debug)]
struct RelRec {
    op: OpId,
    client: ClientId,
    session: SessionId,
    key: String,
    token: u64,
    invoked_us: u64,
    answers: Vec<(ReleaseOutcome, u64)>,
}

/// One extension of a grant.
#[derive(Clone, Copy, Debug)]
struct ExtRec {
    invoked_us: u64,
    lease_s: u8,
    answer: Option<(ExtendOutcome, u64)>,
}

impl ExtRec {
    /// When its lease would end if the server applied it at once.
    fn ends_us(&self) -> u64 {
        self.invoked_us
            .saturating_add(u64::from(self.lease_s.max(1)) * 1_000_000)
    }

    /// It may have moved the server's lease: not refused with X.
    fn may_apply(&self) -> bool {
        !matches!(self.answer, Some((ExtendOutcome::NotExtended, _)))
    }
}

/// Every extension per (key, token), in invocation order.
type Extensions<'a> = HashMap<(&'a str, u64), Vec<ExtRec>>;

#[cfg(test)]
mod permit_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_history_passes() {
        assert_eq!(History::new().check(), Ok(Report::default()));
    }

    #[test]
    fn merge_keeps_operation_ids_unique() {
        let mut a = History::new();
        let op = a.acquire(1, 1, "k", 1, 0, 5, 0);
        a.acquired(op, Outcome::Granted { token: 1 }, 10);
        let mut b = History::new();
        let op = b.acquire(2, 2, "j", 2, 0, 5, 0);
        b.acquired(op, Outcome::Granted { token: 2 }, 10);
        a.merge(b);
        let report = a.check().expect("two independent grants");
        assert_eq!(report.grants, 2);
        assert_eq!(report.keys, 2);
    }
}

//! A safety checker for recorded client histories.
//!
//! Tests that drive ticketd (the deterministic simulation, the real-process
//! fault tests, cluster tests) record what every client did and saw as a
//! [`History`]: when each acquire was invoked and how it completed, when each
//! release was invoked, when sessions were closed. [`History::check`] then
//! verifies, from the clients' point of view, the guarantees of PROTOCOL §2–§3:
//!
//! * **Mutual exclusion** ([`Property::MutualExclusion`]): per key, no two
//!   grant intervals overlap. A grant's interval runs from the moment the
//!   client received it to the earlier of its release (the moment the release
//!   was invoked) and the client's conservative lease end (the moment the
//!   acquire was invoked plus the lease, as the grant's extensions moved it:
//!   lowered to an extension's invocation plus its lease the moment it is
//!   invoked, if that is earlier, and set to it when its `E` comes back in
//!   time; PROTOCOL §5.3). A client never uses a grant outside that interval, so
//!   an overlap means two clients could act on one lock.
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
    /// Two grant intervals on one key overlap.
    MutualExclusion,
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
            "{} acquires on {} keys: {} granted, {} late, {} timeout, {} busy, \
             {} indeterminate ({} queued); {} releases",
            self.acquires,
            self.keys,
            self.grants,
            self.late_grants,
            self.timeouts,
            self.busy,
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

    /// Records an acquire invocation and returns its operation id.
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
        let op = self.next_op;
        self.push(Event::Acquire {
            op,
            client,
            session,
            key: key.to_string(),
            owner,
            wait_s,
            lease_s,
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
            match a.answer {
                Some((Outcome::Granted { .. }, _)) => report.grants += 1,
                Some((Outcome::LateGrant { .. }, _)) => report.late_grants += 1,
                Some((Outcome::Timeout, _)) => report.timeouts += 1,
                Some((Outcome::Busy, _)) => report.busy += 1,
                Some((Outcome::Indeterminate, _)) | None => report.indeterminate += 1,
            }
        }
        Ok(report)
    }

    /// Every extension per (key, token), in invocation order; checks each is
    /// answered at most once, after it was invoked.
    fn extensions(&self) -> Result<Extensions<'_>, Violation> {
        let mut invoked: HashMap<OpId, (&str, u64, u8, u64)> = HashMap::new();
        for e in &self.events {
            if let Event::Extend {
                op,
                key,
                token,
                lease_s,
                at_us,
                ..
            } = e
            {
                if invoked
                    .insert(*op, (key.as_str(), *token, *lease_s, *at_us))
                    .is_some()
                {
                    return Err(violation(
                        Property::Malformed,
                        format!("extension op {op} invoked twice"),
                    ));
                }
            }
        }
        let mut answered: HashMap<OpId, (ExtendOutcome, u64)> = HashMap::new();
        for e in &self.events {
            let Event::Extended { op, outcome, at_us } = e else {
                continue;
            };
            let Some(&(key, token, _, inv)) = invoked.get(op) else {
                return Err(violation(
                    Property::Malformed,
                    format!("answer {outcome:?} to unknown extension op {op}"),
                ));
            };
            if *at_us < inv {
                return Err(violation(
                    Property::Malformed,
                    format!("extension op {op} answered at {at_us}us, before it was invoked"),
                ));
            }
            if answered.insert(*op, (*outcome, *at_us)).is_some() {
                return Err(violation(
                    Property::AnsweredOnce,
                    format!("extension op {op} of {key:?} token {token} answered twice"),
                ));
            }
        }
        let mut out: Extensions<'_> = HashMap::new();
        for (op, &(key, token, lease_s, inv)) in &invoked {
            out.entry((key, token)).or_default().push(ExtRec {
                invoked_us: inv,
                lease_s,
                answer: answered.get(op).copied(),
            });
        }
        for v in out.values_mut() {
            v.sort_unstable_by_key(|x| (x.invoked_us, x.lease_s));
        }
        Ok(out)
    }

    /// The restarts as (time, first token, graced), in time order; time
    /// and token must both grow.
    fn restarts(&self) -> Result<Vec<(u64, u64, bool)>, Violation> {
        let mut r: Vec<(u64, u64, bool)> = self
            .events
            .iter()
            .filter_map(|e| match e {
                Event::ServerRestart {
                    at_us,
                    first_token,
                    graced,
                } => Some((*at_us, *first_token, *graced)),
                _ => None,
            })
            .collect();
        r.sort_unstable();
        for w in r.windows(2) {
            if w[1].1 < w[0].1 {
                return Err(violation(
                    Property::TokenOrder,
                    format!(
                        "the restart at {}us resumed at token {}, below the restart at {}us \
                         (token {})",
                        w[1].0, w[1].1, w[0].0, w[0].1
                    ),
                ));
            }
        }
        Ok(r)
    }

    /// Builds per-operation records and checks the history is well formed.
    #[allow(clippy::type_complexity)]
    fn gather(
        &self,
    ) -> Result<
        (
            BTreeMap<OpId, AcqRec>,
            BTreeMap<OpId, RelRec>,
            HashMap<SessionId, u64>,
        ),
        Violation,
    > {
        let mut acqs = BTreeMap::new();
        let mut rels = BTreeMap::new();
        let mut closed: HashMap<SessionId, u64> = HashMap::new();
        for e in &self.events {
            match e {
                Event::Acquire {
                    op,
                    client,
                    session,
                    key,
                    wait_s,
                    lease_s,
                    at_us,
                    ..
                } => {
                    let rec = AcqRec {
                        op: *op,
                        client: *client,
                        session: *session,
                        key: key.clone(),
                        wait_s: *wait_s,
                        lease_s: *lease_s,
                        invoked_us: *at_us,
                        queued_us: None,
                        answer: None,
                    };
                    if acqs.insert(*op, rec).is_some() || rels.contains_key(op) {
                        return Err(violation(
                            Property::Malformed,
                            format!("operation id {op} invoked twice"),
                        ));
                    }
                }
                Event::Release {
                    op,
                    client,
                    session,
                    key,
                    token,
                    at_us,
                } => {
                    let rec = RelRec {
                        op: *op,
                        client: *client,
                        session: *session,
                        key: key.clone(),
                        token: *token,
                        invoked_us: *at_us,
                        answers: Vec::new(),
                    };
                    if rels.insert(*op, rec).is_some() || acqs.contains_key(op) {
                        return Err(violation(
                            Property::Malformed,
                            format!("operation id {op} invoked twice"),
                        ));
                    }
                }
                Event::SessionClosed { session, at_us } => {
                    let t = closed.entry(*session).or_insert(*at_us);
                    *t = (*t).min(*at_us);
                }
                Event::Queued { .. }
                | Event::Acquired { .. }
                | Event::Released { .. }
                | Event::ServerRestart { .. }
                | Event::Extend { .. }
                | Event::Extended { .. } => {}
            }
        }
        for e in &self.events {
            match e {
                Event::Queued { op, at_us } => {
                    let Some(a) = acqs.get_mut(op) else {
                        return Err(violation(
                            Property::Malformed,
                            format!("queued event for unknown acquire op {op}"),
                        ));
                    };
                    a.queued_us = Some(*at_us);
                }
                Event::Acquired { op, outcome, at_us } => {
                    let Some(a) = acqs.get_mut(op) else {
                        return Err(violation(
                            Property::Malformed,
                            format!("answer {outcome:?} to unknown acquire op {op}"),
                        ));
                    };
                    if *at_us < a.invoked_us {
                        return Err(violation(
                            Property::Malformed,
                            format!(
                                "{} answered at {at_us}us, before it was invoked",
                                a.describe()
                            ),
                        ));
                    }
                    if let Some((first, first_us)) = a.answer {
                        return Err(violation(
                            Property::AnsweredOnce,
                            format!(
                                "{} on key {:?} answered twice: {first:?} at {first_us}us \
                                 and {outcome:?} at {at_us}us",
                                a.describe(),
                                a.key
                            ),
                        ));
                    }
                    a.answer = Some((*outcome, *at_us));
                }
                Event::Released { op, outcome, at_us } => {
                    let Some(r) = rels.get_mut(op) else {
                        return Err(violation(
                            Property::Malformed,
                            format!("answer {outcome:?} to unknown release op {op}"),
                        ));
                    };
                    if *at_us < r.invoked_us {
                        return Err(violation(
                            Property::Malformed,
                            format!("release op {op} answered before it was invoked"),
                        ));
                    }
                    r.answers.push((*outcome, *at_us));
                }
                _ => {}
            }
        }
        Ok((acqs, rels, closed))
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

/// Every operation answered exactly once, or its session closed after it was
/// invoked; no answer on a session after it closed.
fn check_answered(
    acqs: &BTreeMap<OpId, AcqRec>,
    rels: &BTreeMap<OpId, RelRec>,
    closed: &HashMap<SessionId, u64>,
) -> Result<(), Violation> {
    for a in acqs.values() {
        let closed_us = closed.get(&a.session).copied();
        match (a.answer, closed_us) {
            (None, None) => {
                return Err(violation(
                    Property::AnsweredOnce,
                    format!(
                        "{} on key {:?} was never answered and its session stayed open",
                        a.describe(),
                        a.key
                    ),
                ))
            }
            (None, Some(c)) if c < a.invoked_us => {
                return Err(violation(
                    Property::AnsweredOnce,
                    format!(
                        "{} on key {:?} was invoked on session {} after it closed at {c}us",
                        a.describe(),
                        a.key,
                        a.session
                    ),
                ))
            }
            // Indeterminate is how a client reports closing the session itself.
            (Some((outcome, at)), Some(c)) if at > c && outcome != Outcome::Indeterminate => {
                return Err(violation(
                    Property::AnsweredOnce,
                    format!(
                        "{} on key {:?} answered {outcome:?} at {at}us, after its session \
                         closed at {c}us",
                        a.describe(),
                        a.key
                    ),
                ))
            }
            _ => {}
        }
    }
    for r in rels.values() {
        let closed_us = closed.get(&r.session).copied();
        if r.answers.len() > 1 {
            return Err(violation(
                Property::AnsweredOnce,
                format!(
                    "release op {} of token {} on key {:?} by client {} answered {} times: {:?}",
                    r.op,
                    r.token,
                    r.key,
                    r.client,
                    r.answers.len(),
                    r.answers
                ),
            ));
        }
        if r.answers.is_empty() && closed_us.is_none() {
            return Err(violation(
                Property::AnsweredOnce,
                format!(
                    "release op {} of token {} on key {:?} by client {} was never answered \
                     and its session stayed open",
                    r.op, r.token, r.key, r.client
                ),
            ));
        }
    }
    Ok(())
}

/// Tokens unique, non-zero, and in real-time order across all grants.
fn check_tokens(acqs: &BTreeMap<OpId, AcqRec>) -> Result<(), Violation> {
    let grants: Vec<(&AcqRec, u64, u64)> = acqs
        .values()
        .filter_map(|a| Some((a, a.token()?, a.answer?.1)))
        .collect();
    let mut by_token: HashMap<u64, &AcqRec> = HashMap::new();
    for &(a, token, _) in &grants {
        if token == 0 {
            return Err(violation(
                Property::TokenOrder,
                format!("{} on key {:?} was granted token 0", a.describe(), a.key),
            ));
        }
        if let Some(other) = by_token.insert(token, a) {
            return Err(violation(
                Property::TokenOrder,
                format!(
                    "token {token} granted twice: to {} on key {:?} and to {} on key {:?}",
                    other.describe(),
                    other.key,
                    a.describe(),
                    a.key
                ),
            ));
        }
    }
    // Sweep acquires in invocation order; every grant received strictly
    // before an acquire was invoked must carry a smaller token than it.
    let mut by_received: Vec<&(&AcqRec, u64, u64)> = grants.iter().collect();
    by_received.sort_by_key(|g| g.2);
    let mut by_invoked: Vec<&(&AcqRec, u64, u64)> = grants.iter().collect();
    by_invoked.sort_by_key(|g| g.0.invoked_us);
    let mut highest: Option<&(&AcqRec, u64, u64)> = None;
    let mut i = 0;
    for g in by_invoked {
        while i < by_received.len() && by_received[i].2 < g.0.invoked_us {
            if highest.is_none_or(|h| by_received[i].1 > h.1) {
                highest = Some(by_received[i]);
            }
            i += 1;
        }
        if let Some(h) = highest {
            if h.1 >= g.1 {
                return Err(violation(
                    Property::TokenOrder,
                    format!(
                        "token {} (to {} on key {:?}, received at {}us) is not below token {} \
                         (to {} on key {:?}), which was invoked later",
                        h.1,
                        h.0.describe(),
                        h.0.key,
                        h.2,
                        g.1,
                        g.0.describe(),
                        g.0.key
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Every grant received before a restart carries a token below the first
/// token of the incarnation that restart began.
fn check_restarts(
    acqs: &BTreeMap<OpId, AcqRec>,
    restarts: &[(u64, u64, bool)],
) -> Result<(), Violation> {
    for a in acqs.values() {
        let (Some(token), Some((_, received_us))) = (a.token(), a.answer) else {
            continue;
        };
        for &(at_us, first_token, _) in restarts {
            if received_us <= at_us && token >= first_token {
                return Err(violation(
                    Property::TokenOrder,
                    format!(
                        "token {token} (to {} on key {:?}, received at {received_us}us) is not \
                         below the first token {first_token} of the restart at {at_us}us",
                        a.describe(),
                        a.key
                    ),
                ));
            }
        }
    }
    Ok(())
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

/// The conservative lease end of a grant invoked at `invoked_us` for
/// `lease_s`, as its extensions move it (PROTOCOL §5.3), walked in time order:
///
/// * an extension invoked before the end lowers it at once to its own
///   invocation plus its lease if that is earlier: a shorter lease may take
///   effect on the server before any answer comes back;
/// * an `E` answered before the end sets it to that extension's invocation
///   plus its lease, but no later than the same bound of every other
///   extension that may still apply after it (invoked before that answer,
///   and not answered before this one was invoked, nor refused);
/// * a late `E`, an `X` or no answer moves nothing else.
fn lease_end_us(invoked_us: u64, lease_s: u8, exts: &[ExtRec]) -> u64 {
    let mut end = invoked_us.saturating_add(u64::from(lease_s.max(1)) * 1_000_000);
    // (time, is an answer, index): invocations before answers at one time.
    let mut steps: Vec<(u64, bool, usize)> = Vec::new();
    for (i, x) in exts.iter().enumerate() {
        steps.push((x.invoked_us, false, i));
        if let Some((ExtendOutcome::Extended, at)) = x.answer {
            steps.push((at, true, i));
        }
    }
    steps.sort_unstable();
    for (at, is_answer, i) in steps {
        if at >= end {
            continue;
        }
        let x = &exts[i];
        if !is_answer {
            end = end.min(x.ends_us());
            continue;
        }
        let mut new_end = x.ends_us();
        for (j, y) in exts.iter().enumerate() {
            let settled_before = y.answer.is_some_and(|(_, ans)| ans < x.invoked_us);
            if j != i && y.invoked_us <= at && !settled_before && y.may_apply() {
                new_end = new_end.min(y.ends_us());
            }
        }
        end = new_end;
    }
    end
}

/// The interval during which a client may act on a grant: from receipt to
/// the earlier of its first release and its conservative lease end as its
/// extensions moved it ([`lease_end_us`]).
fn interval(
    a: &AcqRec,
    rels: &HashMap<(&str, u64), u64>,
    exts: &Extensions<'_>,
    margin_us: u64,
) -> Option<(u64, u64, u64)> {
    let (Outcome::Granted { token }, received_us) = a.answer? else {
        return None;
    };
    let grant_exts = exts
        .get(&(a.key.as_str(), token))
        .map_or(&[][..], Vec::as_slice);
    let lease_end = lease_end_us(a.invoked_us, a.lease_s, grant_exts).saturating_sub(margin_us);
    let end = rels
        .get(&(a.key.as_str(), token))
        .map_or(lease_end, |&r| r.min(lease_end));
    Some((received_us, end, token))
}

/// A grant's interval: start, end (exclusive), token, and its acquire.
type Interval<'a> = (u64, u64, u64, &'a AcqRec);

/// Per key and server incarnation, no two grant intervals overlap.
fn check_exclusion(
    acqs: &BTreeMap<OpId, AcqRec>,
    releases: &BTreeMap<OpId, RelRec>,
    exts: &Extensions<'_>,
    restarts: &[(u64, u64, bool)],
    margin_us: u64,
) -> Result<(), Violation> {
    // Which incarnation issued a token: tokens only grow across restarts
    // (checked by check_restarts), so it is the number of restarts whose
    // first token is at or below it. A restart with a grace does not begin
    // a new one for this check: it kept exclusion across it.
    let incarnation = |token: u64| restarts.iter().filter(|r| !r.2 && r.1 <= token).count();
    // The earliest release of each (key, token), whoever sent it.
    let mut first_release: HashMap<(&str, u64), u64> = HashMap::new();
    for r in releases.values() {
        let t = first_release
            .entry((r.key.as_str(), r.token))
            .or_insert(r.invoked_us);
        *t = (*t).min(r.invoked_us);
    }
    let mut per_key: HashMap<(&str, usize), Vec<Interval<'_>>> = HashMap::new();
    for a in acqs.values() {
        if let Some((start, end, token)) = interval(a, &first_release, exts, margin_us) {
            if start < end {
                per_key
                    .entry((a.key.as_str(), incarnation(token)))
                    .or_default()
                    .push((start, end, token, a));
            }
        }
    }
    let mut keys: Vec<_> = per_key.into_iter().collect();
    keys.sort_by(|x, y| x.0.cmp(&y.0));
    for ((key, _), mut ivs) in keys {
        ivs.sort_by_key(|iv| (iv.0, iv.1));
        let mut widest: Option<&Interval<'_>> = None;
        for iv in &ivs {
            if let Some(w) = widest {
                if iv.0 < w.1 {
                    return Err(violation(
                        Property::MutualExclusion,
                        format!(
                            "key {key:?}: token {} held by client {} during [{}us, {}us) \
                             overlaps token {} held by client {} during [{}us, {}us)",
                            w.2, w.3.client, w.0, w.1, iv.2, iv.3.client, iv.0, iv.1
                        ),
                    ));
                }
            }
            if widest.is_none_or(|w| iv.1 > w.1) {
                widest = Some(iv);
            }
        }
    }
    Ok(())
}

/// Among acquires queued on one key, a later one is never granted while an
/// earlier one is still waiting.
fn check_fifo(
    acqs: &BTreeMap<OpId, AcqRec>,
    closed: &HashMap<SessionId, u64>,
) -> Result<(), Violation> {
    let mut per_key: HashMap<&str, Vec<&AcqRec>> = HashMap::new();
    for a in acqs.values().filter(|a| a.queued_us.is_some()) {
        per_key.entry(a.key.as_str()).or_default().push(a);
    }
    let mut keys: Vec<_> = per_key.into_iter().collect();
    keys.sort_by(|x, y| x.0.cmp(y.0));
    for (key, mut queue) in keys {
        queue.sort_by_key(|a| (a.queued_us, a.op));
        for (j, later) in queue.iter().enumerate() {
            let (Some(later_token), Some((_, granted_us))) = (later.token(), later.answer) else {
                continue;
            };
            let later_q = later.queued_us.unwrap_or(0);
            for earlier in &queue[..j] {
                let q = earlier.queued_us.unwrap_or(0);
                if q >= later_q {
                    continue; // queued at the same moment: no order to keep
                }
                let wait_end = q.saturating_add(u64::from(earlier.wait_s) * 1_000_000);
                // Only an earlier acquire known not to have been served first
                // counts: one that never saw its answer may have been granted
                // (its client paused or gone) and lost the grant to its lease.
                let passed_over = match earlier.answer {
                    Some((Outcome::Timeout | Outcome::Busy, at)) => at > granted_us,
                    Some((Outcome::Granted { token } | Outcome::LateGrant { token }, _)) => {
                        token > later_token
                    }
                    Some((Outcome::Indeterminate, _)) | None => false,
                };
                let still_waiting = passed_over
                    && wait_end > granted_us
                    && closed.get(&earlier.session).is_none_or(|&c| c > granted_us);
                if still_waiting {
                    return Err(violation(
                        Property::Fifo,
                        format!(
                            "key {key:?}: {} (queued at {}us) was granted token {later_token} at \
                             {granted_us}us while {} (queued at {q}us, waiting until \
                             {wait_end}us) was still waiting; it got {:?}",
                            later.describe(),
                            later_q,
                            earlier.describe(),
                            earlier.answer.map(|(o, _)| o)
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

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

//! One call of a [`super::Machine`]: what it asks the server, its deadlines,
//! and, once decided, its outcome. A call not yet handed out to be written
//! is an [`Unsent`]: it can move from one machine to another (one
//! connection to the next) with its owner and its deadlines unchanged.

use std::time::Duration;

use super::{AcquireOutcome, CallId, ExtendOutcome, Held, Outcome};
use crate::client::deadline::{self, Moment, Plan, TRANSPORT_DEADLINE};
use crate::client::{Error, Release};
use crate::proto::Places;
use crate::time::Millis;

/// What a call asks the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind<T> {
    /// An acquire; the wait byte is computed when it is written.
    Acquire {
        /// Fresh correlation id of this call (PROTOCOL §3).
        owner: u64,
        /// Lease byte, already checked.
        lease_s: u8,
        /// Protocol 1.2: the places asked for (sent as `P`); `None`, a
        /// mutex acquire sent as `A`.
        places: Option<Places>,
    },
    /// A release of `token`.
    Release {
        /// The token being released.
        token: u64,
    },
    /// An extend of `token` (PROTOCOL §5.3), sent again after a lost
    /// session while `until` (the grant's conservative expiry, or the
    /// caller's own limit) has not passed.
    Extend {
        /// The token being extended.
        token: u64,
        /// Lease byte, already checked.
        lease_s: u8,
        /// No attempt runs past it; an `E` at or after it counts for nothing.
        until: T,
    },
}

/// A call whose bytes were never handed out: not one byte of it can have
/// reached a socket. [`super::Machine::take_unsent`] takes such calls out of
/// a machine whose connection is gone for good, and
/// [`super::Machine::adopt`] queues them on another: same owner, same
/// deadlines (PROTOCOL §3: a request is tried again only while it has
/// definitely not been sent).
#[derive(Debug)]
pub struct Unsent<T: Moment = Millis> {
    pub(crate) kind: Kind<T>,
    pub(crate) key: String,
    pub(crate) plan: Plan<T>,
    /// A compensating release nobody waits for: its outcome is not reported.
    pub(crate) silent: bool,
}

impl<T: Moment> Unsent<T> {
    /// An acquire of `key` started at `now`: the arguments checked, then a
    /// fresh owner from `owner` and one deadline `D = now + wait` (wait
    /// clamped to 255 s), or the 5 s transport deadline for `wait = 0`.
    /// With `places` (protocol 1.2) it is sent as an Acquire With Limit.
    pub(crate) fn acquire(
        now: T,
        key: &str,
        (wait, lease): (Duration, Duration),
        places: Option<Places>,
        max_key_bytes: usize,
        owner: impl FnOnce() -> u64,
    ) -> Result<Unsent<T>, Error> {
        deadline::check_key(key, max_key_bytes)?;
        let lease_s = deadline::lease_s(lease)?;
        if places.is_some_and(|p| p.limit == 0) {
            return Err(Error::ZeroLimit);
        }
        Ok(Unsent::new(
            Kind::Acquire {
                owner: owner(),
                lease_s,
                places,
            },
            key,
            Plan::acquire(now, wait),
        ))
    }

    /// A release of `token` on `key` started at `now`, under the 5 s
    /// transport deadline.
    pub(crate) fn release(
        now: T,
        key: &str,
        token: u64,
        max_key_bytes: usize,
    ) -> Result<Unsent<T>, Error> {
        deadline::check_key(key, max_key_bytes)?;
        Ok(Unsent::new(
            Kind::Release { token },
            key,
            Plan::transport(now),
        ))
    }

    /// A release nobody waits for: a grant given back.
    pub(crate) fn give_back(now: T, key: &str, token: u64) -> Unsent<T> {
        let mut call = Unsent::new(Kind::Release { token }, key, Plan::transport(now));
        call.silent = true;
        call
    }

    /// An extend of a grant whose conservative expiry is `expires_at`, to
    /// live `lease` from `now`. The lease may be shorter than the time left
    /// and take effect before its answer: no attempt runs past
    /// `min(expires_at, now + lease)`.
    pub(crate) fn extend(
        now: T,
        key: &str,
        token: u64,
        lease: Duration,
        expires_at: T,
    ) -> Result<Unsent<T>, Error> {
        let lease_s = deadline::lease_s(lease)?;
        Ok(Unsent::extend_until(
            now,
            key,
            token,
            lease_s,
            expires_at.min(now.plus(lease)),
        ))
    }

    /// An extend by token with no grant to bound it: it runs under the 5 s
    /// transport deadline.
    pub(crate) fn extend_token(
        now: T,
        key: &str,
        token: u64,
        lease: Duration,
        max_key_bytes: usize,
    ) -> Result<Unsent<T>, Error> {
        deadline::check_key(key, max_key_bytes)?;
        let lease_s = deadline::lease_s(lease)?;
        Ok(Unsent::extend_until(
            now,
            key,
            token,
            lease_s,
            now.plus(TRANSPORT_DEADLINE),
        ))
    }

    fn extend_until(now: T, key: &str, token: u64, lease_s: u8, until: T) -> Unsent<T> {
        // Queued, it may wait for a connection until `until`; each attempt
        // gets its transport deadline when it is written.
        let mut plan = Plan::until(now, until);
        plan.send_deadline = until;
        plan.give_up = until;
        Unsent::new(
            Kind::Extend {
                token,
                lease_s,
                until,
            },
            key,
            plan,
        )
    }

    fn new(kind: Kind<T>, key: &str, plan: Plan<T>) -> Unsent<T> {
        Unsent {
            kind,
            key: key.to_owned(),
            plan,
            silent: false,
        }
    }

    /// The key the call is about.
    #[must_use]
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The moment the call is given up unsent: Timeout for an acquire,
    /// NotSent for a release, Lost for an extend.
    #[must_use]
    pub fn send_deadline(&self) -> T {
        self.plan.send_deadline
    }

    /// The outcome of the call dropped unsent.
    pub(crate) fn not_sent(&self) -> Outcome<T> {
        match self.kind {
            Kind::Acquire { .. } => Outcome::Acquire(AcquireOutcome::Timeout),
            Kind::Release { .. } => Outcome::Release(Release::NotSent),
            Kind::Extend { .. } => Outcome::Extend(ExtendOutcome::Lost),
        }
    }

    /// The outcome of the call that may have been sent and can get no reply.
    pub(crate) fn lost(&self) -> Outcome<T> {
        match self.kind {
            Kind::Acquire { .. } => Outcome::Acquire(AcquireOutcome::Indeterminate),
            Kind::Release { .. } => Outcome::Release(Release::Indeterminate),
            Kind::Extend { .. } => Outcome::Extend(ExtendOutcome::Lost),
        }
    }

    /// The grant a reply handed over, counted from `written` (the write,
    /// never the reply). The key moves into it: the call is done.
    pub(crate) fn take_held(&mut self, token: u64, written: T) -> Held<T> {
        let lease_s = match self.kind {
            Kind::Acquire { lease_s, .. } | Kind::Extend { lease_s, .. } => lease_s,
            Kind::Release { .. } => 0,
        };
        let lease = Duration::from_secs(u64::from(lease_s));
        Held {
            key: std::mem::take(&mut self.key),
            token,
            lease,
            expires_at: written.plus(lease),
        }
    }
}

/// A call in a machine: queued, or handed out at `written_at`.
#[derive(Debug)]
pub(crate) struct Call<T: Moment> {
    pub(crate) id: CallId,
    pub(crate) req: Unsent<T>,
    pub(crate) written_at: Option<T>,
}

/// A call's outcome as the machine decided it, with what a blocking caller
/// needs besides.
#[derive(Debug)]
pub(crate) struct Decided<T: Moment> {
    pub(crate) id: CallId,
    pub(crate) outcome: Outcome<T>,
    /// An `X` answered the extend: the grant is gone (rather than no
    /// answer in time, or an `E` too late).
    pub(crate) refused: bool,
    /// The handover gate of an acquire: its `D`.
    pub(crate) gate: T,
}

impl<T: Moment> Decided<T> {
    /// The outcome as it reaches its caller at `now`. A grant that reaches
    /// the caller after `D` is not handed over (PROTOCOL §3): `Err` with
    /// the grant, which the caller gives back
    /// ([`super::Machine::give_back`]); the call is Indeterminate.
    pub(crate) fn hand_over(self, now: T) -> Result<Outcome<T>, Held<T>> {
        match self.outcome {
            Outcome::Acquire(AcquireOutcome::Acquired(held)) if now > self.gate => Err(held),
            outcome => Ok(outcome),
        }
    }
}

/// Why a machine gave up on its connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CloseCause {
    /// A request that may have been sent had no reply by its give-up moment.
    NoReply,
    /// Bytes that can never become a reply; `head` is where they start.
    Malformed { reason: String, head: Vec<u8> },
    /// A reply to an acquire's owner that names another key.
    WrongKey,
}

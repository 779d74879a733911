//! The official client's rules (PROTOCOL §3) as a sans-IO state machine: the
//! caller moves the bytes and the clock, the machine decides what to send,
//! when to give up and what each call's outcome is.
//!
//! It is for programs that drive their own I/O, and for deterministic tests
//! (with the `harness` feature's in-memory server): no thread, no socket, no
//! OS clock. The blocking [`super::Client`] keeps its own threads; both make
//! their deadlines with the same plan (`deadline.rs`) and the same wire
//! wait rounding.
//!
//! One machine is one session (one connection at a time):
//!
//! 1. [`Machine::acquire`] / [`Machine::release`] check their arguments
//!    (`Err`: nothing queued) and queue a call with a fresh owner and one
//!    deadline `D = now + wait` (wait clamped to 255 s), or the 5 s
//!    transport deadline for `wait = 0` and releases.
//! 2. [`Machine::transmit`] hands out the bytes to write, computing each
//!    acquire's wire wait from the time left until `D`, rounded up. A call
//!    still queued at its send deadline is not sent: Timeout (NotSent for a
//!    release). From the moment its bytes are handed out a request *may have
//!    been sent*: it is never sent again.
//! 3. [`Machine::receive`] feeds the bytes read; replies are matched by owner
//!    (A/T/B) and by token and key (R/N). T and B are definitive. An A
//!    matched after `D` is not handed over: a release of that exact token is
//!    queued and the call is Indeterminate.
//! 4. [`Machine::handle_timeout`]: a request that may have been sent and has
//!    no reply by `D + 1 s` (or the transport deadline) makes the machine ask
//!    for its session to be closed ([`Machine::wants_close`]): every call
//!    that may have been sent on it is Indeterminate.
//! 5. [`Machine::connection_lost`]: the connection died. What may have been
//!    sent is Indeterminate; what was definitely not sent stays queued and
//!    goes out on the next connection, with the same owner and the same `D`.
//!
//! [`Machine::extend`] renews a grant (PROTOCOL §5.3): refused without sending
//! once the grant's conservative expiry has passed; sent again on the next
//! connection when an attempt got no reply, never past the expiry; an `E`
//! moves the expiry to the time the answered attempt was written plus the
//! new lease, an `X` (or the expiry) means the grant is lost.
//!
//! Outcomes come out of [`Machine::poll_outcome`], in the order they were
//! decided. Owners come from the seed given to [`Machine::new`], so the same
//! seed and the same calls give the same bytes.

use std::collections::VecDeque;
use std::time::Duration;

use super::deadline::{self, Plan};
use super::owner::mix;
use super::{Error, Release};
use crate::proto::{self, Decoded, Reply, Request};
use crate::readbuf::ReadBuf;
use crate::time::Millis;

/// One call made on a [`Machine`], to match it with its outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CallId(pub u64);

/// A grant handed to the caller: the key, the fencing token and a
/// conservative expiry (the time the request was handed out to be written,
/// plus the lease: the server's lease always ends later).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// The key.
    pub key: String,
    /// The fencing token: pass it to the resource you guard.
    pub token: u64,
    /// The lease asked for.
    pub lease: Duration,
    /// Leave the critical section before this moment.
    pub expires_at: Millis,
}

impl Held {
    /// The conservative expiry has been reached: the holder must stop
    /// using the token.
    #[must_use]
    pub fn is_expired(&self, now: Millis) -> bool {
        now >= self.expires_at
    }
}

/// What an acquire came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcquireOutcome {
    /// Granted, and handed over by `D`.
    Acquired(Held),
    /// Definitely not acquired: the wait ran out on the server, the key was
    /// held (`wait = 0`), or the request was never sent before `D`.
    Timeout,
    /// Definitely not acquired and not queued: a server capacity limit.
    Busy,
    /// Unknown. Do not enter the critical section; a grant that may exist is
    /// taken back by its lease at the latest.
    Indeterminate,
}

/// What an extend came to (PROTOCOL §5.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtendOutcome {
    /// `E` before the grant's conservative expiry: the grant as it is now,
    /// its expiry the time the answered attempt was written plus the new
    /// lease. Replace the old [`Held`] with it.
    Extended(Held),
    /// `X` (the grant is gone or capped), or the conservative expiry came
    /// with no `E`: stop using the token.
    Lost,
}

/// The outcome of one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Of [`Machine::acquire`].
    Acquire(AcquireOutcome),
    /// Of [`Machine::release`].
    Release(Release),
    /// Of [`Machine::extend`].
    Extend(ExtendOutcome),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Acquire {
        owner: u64,
        lease_s: u8,
    },
    Release {
        token: u64,
    },
    /// Sent again after a lost session while `until` (the grant's
    /// conservative expiry) has not passed.
    Extend {
        token: u64,
        lease_s: u8,
        until: Millis,
    },
}

#[derive(Debug)]
struct Call {
    id: CallId,
    kind: Kind,
    key: String,
    plan: Plan<Millis>,
    /// When its bytes were handed out: from then on it may have been sent.
    written_at: Option<Millis>,
    /// A compensating release nobody waits for: its outcome is not reported.
    silent: bool,
}

/// The client state machine. See the module documentation.
#[derive(Debug)]
pub struct Machine {
    seed: u64,
    owners: u64,
    next_id: u64,
    max_key_bytes: usize,
    /// Not yet handed out, in call order.
    queued: VecDeque<Call>,
    /// Handed out, waiting for a reply, in the order written.
    in_flight: Vec<Call>,
    /// Received bytes of a reply not yet complete.
    rbuf: ReadBuf,
    outcomes: VecDeque<(CallId, Outcome)>,
    wants_close: bool,
}

impl Machine {
    /// A machine whose owners are drawn from `seed` (distinct machines in
    /// one test should have distinct seeds), for keys of at most the
    /// server's default 1024 bytes.
    #[must_use]
    pub fn new(seed: u64) -> Machine {
        Machine::with_max_key_bytes(seed, crate::limits::DEFAULT_MAX_KEY_BYTES)
    }

    /// [`Machine::new`] for a server with another `--max-key-bytes`.
    #[must_use]
    pub fn with_max_key_bytes(seed: u64, max_key_bytes: usize) -> Machine {
        Machine {
            seed: mix(seed),
            owners: 0,
            next_id: 1,
            max_key_bytes,
            queued: VecDeque::new(),
            in_flight: Vec::new(),
            rbuf: ReadBuf::new(0),
            outcomes: VecDeque::new(),
            wants_close: false,
        }
    }

    fn next_owner(&mut self) -> u64 {
        self.owners += 1;
        mix(self.seed.wrapping_add(self.owners))
    }

    fn push(&mut self, kind: Kind, key: &str, plan: Plan<Millis>, silent: bool) -> CallId {
        let id = CallId(self.next_id);
        self.next_id += 1;
        self.queued.push_back(Call {
            id,
            kind,
            key: key.to_owned(),
            plan,
            written_at: None,
            silent,
        });
        id
    }

    /// Asks for `key` at `now`, waiting up to `wait` (clamped to 255 s) in
    /// the server's queue, for a lease of `lease` (whole seconds, 1..=255).
    ///
    /// # Errors
    /// A bad key or lease; nothing is queued.
    pub fn acquire(
        &mut self,
        now: Millis,
        key: &str,
        wait: Duration,
        lease: Duration,
    ) -> Result<CallId, Error> {
        deadline::check_key(key, self.max_key_bytes)?;
        let lease_s = deadline::lease_s(lease)?;
        let owner = self.next_owner();
        Ok(self.push(
            Kind::Acquire { owner, lease_s },
            key,
            Plan::acquire(now, wait),
            false,
        ))
    }

    /// Releases `token` on `key` at `now`, under the 5 s transport deadline.
    ///
    /// # Errors
    /// A bad key; nothing is queued.
    pub fn release(&mut self, now: Millis, key: &str, token: u64) -> Result<CallId, Error> {
        deadline::check_key(key, self.max_key_bytes)?;
        Ok(self.push(Kind::Release { token }, key, Plan::transport(now), false))
    }

    /// Extends `held` at `now` to live `lease` from then (PROTOCOL §5.3). A
    /// grant whose conservative expiry has passed is lost for good: the
    /// outcome is [`ExtendOutcome::Lost`] and nothing is sent. An attempt
    /// that gets no reply is sent again on the next connection, never past
    /// the expiry; until an `E` is matched the old expiry stands. A lease
    /// shorter than the time left may take effect before its answer, so
    /// the call treats the expiry as `min(held.expires_at, now + lease)`
    /// from `now` on, and so must the caller while it is in flight.
    ///
    /// # Errors
    /// A bad lease; nothing is queued.
    pub fn extend(&mut self, now: Millis, held: &Held, lease: Duration) -> Result<CallId, Error> {
        let lease_s = deadline::lease_s(lease)?;
        let until = held
            .expires_at
            .min(now.add_ms(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX)));
        let kind = Kind::Extend {
            token: held.token,
            lease_s,
            until,
        };
        // Queued, it may wait for a connection until the expiry; each
        // attempt gets its transport deadline when it is written.
        let mut plan = Plan::until(now, until);
        plan.send_deadline = until;
        plan.give_up = until;
        let id = self.push(kind, &held.key, plan, false);
        if held.is_expired(now) {
            if let Some(call) = self.queued.pop_back() {
                self.report(&call, Outcome::Extend(ExtendOutcome::Lost));
            }
        }
        Ok(id)
    }

    /// Appends to `out` the bytes of every queued request that may still be
    /// sent at `now`, and returns how many bytes. Write all of them: from
    /// this call on they may have been sent. Requests past their send
    /// deadline are dropped unsent (their outcome is Timeout, or NotSent for
    /// a release). Nothing is handed out while a close is pending.
    pub fn transmit(&mut self, now: Millis, out: &mut Vec<u8>) -> usize {
        if self.wants_close {
            return 0;
        }
        let start = out.len();
        while let Some(mut call) = self.queued.pop_front() {
            let Some(wait_s) = call.plan.wire_wait_at(now) else {
                self.not_sent(call);
                continue;
            };
            let req = match call.kind {
                Kind::Acquire { owner, lease_s } => Request::Acquire {
                    wait_s,
                    lease_s,
                    owner,
                    key: &call.key,
                },
                Kind::Release { token } => Request::Release {
                    token,
                    key: &call.key,
                },
                Kind::Extend {
                    token,
                    lease_s,
                    until,
                } => {
                    // Each attempt has its own transport deadline, never
                    // past the grant's expiry.
                    call.plan = Plan::until(now, until);
                    Request::Extend {
                        lease_s,
                        token,
                        key: &call.key,
                    }
                }
            };
            proto::encode_request(&req, out);
            call.written_at = Some(now);
            self.in_flight.push(call);
        }
        out.len() - start
    }

    fn not_sent(&mut self, call: Call) {
        let outcome = match call.kind {
            Kind::Acquire { .. } => Outcome::Acquire(AcquireOutcome::Timeout),
            Kind::Release { .. } => Outcome::Release(Release::NotSent),
            Kind::Extend { .. } => Outcome::Extend(ExtendOutcome::Lost),
        };
        self.report(&call, outcome);
    }

    fn report(&mut self, call: &Call, outcome: Outcome) {
        if !call.silent {
            self.outcomes.push_back((call.id, outcome));
        }
    }

    /// Feeds bytes read from the connection at `now`. A reply that matches
    /// no call is ignored; a malformed one makes the machine ask for the
    /// session to be closed (every call in flight is then Indeterminate).
    pub fn receive(&mut self, now: Millis, bytes: &[u8]) {
        if self.wants_close {
            return;
        }
        // Complete replies are handled at once: what stays is at most one
        // incomplete reply, which the decoder bounds.
        self.rbuf.append(bytes);
        loop {
            let (reply, used) = match proto::decode_reply(self.rbuf.data(), self.max_key_bytes) {
                Decoded::Frame { frame, used } => (owned(&frame), used),
                Decoded::Incomplete => break,
                Decoded::Malformed(_) => {
                    self.close_session();
                    return;
                }
            };
            self.rbuf.consume(used);
            self.matched(now, reply);
        }
    }

    // Long because each reply kind is matched to its call and judged against
    // the call's deadline in one place (PROTOCOL §3).
    fn matched(&mut self, now: Millis, reply: OwnedReply) {
        let found = self.in_flight.iter().position(|c| match (&reply, c.kind) {
            (OwnedReply::Acquire { owner, key, .. }, Kind::Acquire { owner: o, .. }) => {
                *owner == o && *key == c.key
            }
            (OwnedReply::Release { token, key, .. }, Kind::Release { token: t }) => {
                *token == t && *key == c.key
            }
            (OwnedReply::Extend { token, key, .. }, Kind::Extend { token: t, .. }) => {
                *token == t && *key == c.key
            }
            _ => false,
        });
        let Some(i) = found else {
            // Nothing of ours. A grant nobody waits for (a correct server
            // never sends one) is given back at once; anything else is
            // ignored.
            if let OwnedReply::Acquire {
                token: Some(token),
                key,
                ..
            } = reply
            {
                self.push(Kind::Release { token }, &key, Plan::transport(now), true);
            }
            return;
        };
        let call = self.in_flight.remove(i);
        // Found by kind above: a reply to an acquire is matched to an acquire.
        let lease_s = match call.kind {
            Kind::Acquire { lease_s, .. } | Kind::Extend { lease_s, .. } => lease_s,
            Kind::Release { .. } => 0,
        };
        let outcome = match reply {
            OwnedReply::Acquire {
                token: Some(token), ..
            } => {
                if now > call.plan.gate {
                    // Seen after D: not handed over; give it back.
                    self.push(
                        Kind::Release { token },
                        &call.key,
                        Plan::transport(now),
                        true,
                    );
                    AcquireOutcome::Indeterminate
                } else {
                    let lease = Duration::from_secs(u64::from(lease_s));
                    let written = call.written_at.unwrap_or(now);
                    AcquireOutcome::Acquired(Held {
                        key: call.key.clone(),
                        token,
                        lease,
                        expires_at: deadline::Moment::plus(written, lease),
                    })
                }
            }
            OwnedReply::Acquire { busy: true, .. } => AcquireOutcome::Busy,
            OwnedReply::Acquire { .. } => AcquireOutcome::Timeout,
            OwnedReply::Release { released, .. } => {
                let r = if released {
                    Release::Released
                } else {
                    Release::NotHeld
                };
                self.report(&call, Outcome::Release(r));
                return;
            }
            OwnedReply::Extend { extended, .. } => {
                let outcome = extend_outcome(&call, now, extended, lease_s);
                self.report(&call, Outcome::Extend(outcome));
                return;
            }
        };
        self.report(&call, Outcome::Acquire(outcome));
    }

    /// Decides what is due at `now`: queued calls past their send deadline
    /// are dropped unsent; a call that may have been sent and has no reply
    /// by its give-up moment closes the session.
    pub fn handle_timeout(&mut self, now: Millis) {
        let mut i = 0;
        while i < self.queued.len() {
            if now >= self.queued[i].plan.send_deadline {
                if let Some(call) = self.queued.remove(i) {
                    self.not_sent(call);
                }
            } else {
                i += 1;
            }
        }
        if self.in_flight.iter().any(|c| now >= c.plan.give_up) {
            self.close_session();
        }
    }

    /// The next moment [`Machine::handle_timeout`] has something to decide.
    #[must_use]
    pub fn next_timeout(&self) -> Option<Millis> {
        let queued = self.queued.iter().map(|c| c.plan.send_deadline);
        let flying = self.in_flight.iter().map(|c| c.plan.give_up);
        queued.chain(flying).min()
    }

    fn close_session(&mut self) {
        self.wants_close = true;
        let mut again = Vec::new();
        for mut call in std::mem::take(&mut self.in_flight) {
            let outcome = match call.kind {
                Kind::Acquire { .. } => Outcome::Acquire(AcquireOutcome::Indeterminate),
                Kind::Release { .. } => Outcome::Release(Release::Indeterminate),
                Kind::Extend { until, .. } => {
                    // Applying an extend twice only moves the caller's own
                    // expiry: it goes out again, until the expiry.
                    call.written_at = None;
                    call.plan.send_deadline = until;
                    call.plan.give_up = until;
                    again.push(call);
                    continue;
                }
            };
            self.report(&call, outcome);
        }
        for call in again.into_iter().rev() {
            self.queued.push_front(call);
        }
        self.rbuf.clear();
    }

    /// The machine gave up on its session: close the connection, then call
    /// [`Machine::connection_lost`] (and open a new one for what is queued).
    #[must_use]
    pub fn wants_close(&self) -> bool {
        self.wants_close
    }

    /// The connection is gone (closed by the peer, by an error, or because
    /// [`Machine::wants_close`] asked). Calls that may have been sent are
    /// Indeterminate; queued calls wait for the next connection, with their
    /// owners and deadlines unchanged.
    pub fn connection_lost(&mut self) {
        self.close_session();
        self.wants_close = false;
    }

    /// The next decided outcome, in the order decided.
    pub fn poll_outcome(&mut self) -> Option<(CallId, Outcome)> {
        self.outcomes.pop_front()
    }

    /// Calls not yet decided (queued or in flight, compensating releases
    /// included).
    #[must_use]
    pub fn pending(&self) -> usize {
        self.queued.len() + self.in_flight.len()
    }
}

/// What an extend's reply means: `E` before the grant's expiry is a new
/// lease from when the extend was written; `X`, or an `E` after the expiry
/// (whoever watched the expiry has been told the grant is lost), is lost.
fn extend_outcome(call: &Call, now: Millis, extended: bool, lease_s: u8) -> ExtendOutcome {
    let (token, until) = match call.kind {
        Kind::Extend { token, until, .. } => (token, until),
        _ => (0, now),
    };
    if !(extended && now < until) {
        return ExtendOutcome::Lost;
    }
    let lease = Duration::from_secs(u64::from(lease_s));
    let written = call.written_at.unwrap_or(now);
    ExtendOutcome::Extended(Held {
        key: call.key.clone(),
        token,
        lease,
        expires_at: deadline::Moment::plus(written, lease),
    })
}

/// A reply, owned, reduced to what matching needs.
enum OwnedReply {
    Acquire {
        owner: u64,
        key: String,
        token: Option<u64>,
        busy: bool,
    },
    Release {
        token: u64,
        key: String,
        released: bool,
    },
    Extend {
        token: u64,
        key: String,
        extended: bool,
    },
}

fn owned(r: &Reply<'_>) -> OwnedReply {
    match *r {
        Reply::Acquired { token, owner, key } => OwnedReply::Acquire {
            owner,
            key: key.to_owned(),
            token: Some(token),
            busy: false,
        },
        Reply::Timeout { owner, key } => OwnedReply::Acquire {
            owner,
            key: key.to_owned(),
            token: None,
            busy: false,
        },
        Reply::Busy { owner, key } => OwnedReply::Acquire {
            owner,
            key: key.to_owned(),
            token: None,
            busy: true,
        },
        Reply::Released { token, key } => OwnedReply::Release {
            token,
            key: key.to_owned(),
            released: true,
        },
        Reply::NotReleased { token, key } => OwnedReply::Release {
            token,
            key: key.to_owned(),
            released: false,
        },
        Reply::Extended { token, key } => OwnedReply::Extend {
            token,
            key: key.to_owned(),
            extended: true,
        },
        Reply::NotExtended { token, key } => OwnedReply::Extend {
            token,
            key: key.to_owned(),
            extended: false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn reply(r: &Reply<'_>) -> Vec<u8> {
        let mut v = Vec::new();
        proto::encode_reply(r, &mut v);
        v
    }

    /// The one request in `bytes`: (wait_s, lease_s, owner) or a release.
    fn acquire_sent(bytes: &[u8]) -> (u8, u8, u64) {
        match proto::decode_request(bytes, 1024) {
            Decoded::Frame {
                frame:
                    Request::Acquire {
                        wait_s,
                        lease_s,
                        owner,
                        ..
                    },
                used,
            } => {
                assert_eq!(used, bytes.len(), "one frame");
                (wait_s, lease_s, owner)
            }
            other => panic!("not one acquire: {other:?}"),
        }
    }

    fn sent(m: &mut Machine, now: Millis) -> Vec<u8> {
        let mut v = Vec::new();
        m.transmit(now, &mut v);
        v
    }

    #[test]
    fn the_wire_wait_is_the_time_left_when_written_rounded_up() {
        let mut m = Machine::new(1);
        let id = m.acquire(Millis(0), "db", 10 * S, 5 * S).unwrap();
        let (wait_s, lease_s, owner) = acquire_sent(&sent(&mut m, Millis(2_500)));
        assert_eq!((wait_s, lease_s), (8, 5), "7.5 s left, rounded up");
        m.receive(
            Millis(3_000),
            &reply(&Reply::Acquired {
                token: 9,
                owner,
                key: "db",
            }),
        );
        let Some((got, Outcome::Acquire(AcquireOutcome::Acquired(held)))) = m.poll_outcome() else {
            panic!("not acquired");
        };
        assert_eq!(got, id);
        assert_eq!(held.token, 9);
        assert_eq!(
            held.expires_at,
            Millis(7_500),
            "written + lease, not replied + lease"
        );
        assert!(!held.is_expired(Millis(7_499)) && held.is_expired(Millis(7_500)));
    }

    #[test]
    fn a_request_still_queued_at_d_is_never_sent_and_times_out() {
        let mut m = Machine::new(1);
        let id = m.acquire(Millis(0), "db", 2 * S, 5 * S).unwrap();
        assert_eq!(m.next_timeout(), Some(Millis(2_000)));
        assert!(sent(&mut m, Millis(2_000)).is_empty());
        assert_eq!(
            m.poll_outcome(),
            Some((id, Outcome::Acquire(AcquireOutcome::Timeout)))
        );
        // The same by the clock alone.
        let id = m.acquire(Millis(0), "db", 2 * S, 5 * S).unwrap();
        m.handle_timeout(Millis(2_000));
        assert_eq!(
            m.poll_outcome(),
            Some((id, Outcome::Acquire(AcquireOutcome::Timeout)))
        );
        assert_eq!(m.pending(), 0);
    }

    #[test]
    fn no_reply_by_d_plus_the_grace_closes_the_session_as_indeterminate() {
        let mut m = Machine::new(1);
        let a = m.acquire(Millis(0), "db", 2 * S, 5 * S).unwrap();
        let r = m.release(Millis(0), "other", 4).unwrap();
        assert!(!sent(&mut m, Millis(0)).is_empty());
        m.handle_timeout(Millis(2_999));
        assert!(!m.wants_close() && m.poll_outcome().is_none());
        m.handle_timeout(Millis(3_000));
        assert!(m.wants_close());
        // Closing the session loses every reply on it.
        assert_eq!(
            m.poll_outcome(),
            Some((a, Outcome::Acquire(AcquireOutcome::Indeterminate)))
        );
        assert_eq!(
            m.poll_outcome(),
            Some((r, Outcome::Release(Release::Indeterminate)))
        );
        // Nothing more goes out on a session being closed.
        let later = m.acquire(Millis(3_000), "db", 2 * S, 5 * S).unwrap();
        assert!(sent(&mut m, Millis(3_000)).is_empty());
        m.connection_lost();
        assert!(m.poll_outcome().is_none(), "the unsent call waits");
        let (wait_s, ..) = acquire_sent(&sent(&mut m, Millis(3_500)));
        assert_eq!(wait_s, 2, "same D on the next connection: 1.5 s left");
        let _ = later;
    }

    #[test]
    fn a_grant_seen_after_d_is_given_back_and_indeterminate() {
        let mut m = Machine::new(1);
        let id = m.acquire(Millis(0), "db", 2 * S, 5 * S).unwrap();
        let (_, _, owner) = acquire_sent(&sent(&mut m, Millis(0)));
        m.receive(
            Millis(2_001),
            &reply(&Reply::Acquired {
                token: 7,
                owner,
                key: "db",
            }),
        );
        assert_eq!(
            m.poll_outcome(),
            Some((id, Outcome::Acquire(AcquireOutcome::Indeterminate)))
        );
        let mut want = Vec::new();
        proto::encode_request(
            &Request::Release {
                token: 7,
                key: "db",
            },
            &mut want,
        );
        assert_eq!(
            sent(&mut m, Millis(2_001)),
            want,
            "the compensating release"
        );
        m.receive(
            Millis(2_002),
            &reply(&Reply::Released {
                token: 7,
                key: "db",
            }),
        );
        assert_eq!(m.poll_outcome(), None, "nobody waits for it");
        assert_eq!(m.pending(), 0);
        // A grant for an owner nobody waits for is given back too.
        m.receive(
            Millis(2_003),
            &reply(&Reply::Acquired {
                token: 8,
                owner: 12_345,
                key: "db",
            }),
        );
        let mut want = Vec::new();
        proto::encode_request(
            &Request::Release {
                token: 8,
                key: "db",
            },
            &mut want,
        );
        assert_eq!(sent(&mut m, Millis(2_003)), want);
    }

    #[test]
    fn t_and_b_are_definitive_and_replies_match_by_owner_in_any_order() {
        let mut m = Machine::new(1);
        let a = m.acquire(Millis(0), "db", Duration::ZERO, 5 * S).unwrap();
        let b = m.acquire(Millis(0), "db", Duration::ZERO, 5 * S).unwrap();
        let bytes = sent(&mut m, Millis(0));
        let (wait_a, _, owner_a) = acquire_sent(&bytes[..14]);
        let (wait_b, _, owner_b) = acquire_sent(&bytes[14..]);
        assert_eq!((wait_a, wait_b), (0, 0), "wait 0 stays one direct attempt");
        assert_ne!(owner_a, owner_b, "a fresh owner per call");
        let mut r = reply(&Reply::Busy {
            owner: owner_b,
            key: "db",
        });
        r.extend(reply(&Reply::Timeout {
            owner: owner_a,
            key: "db",
        }));
        // Split anywhere: bytes arrive as they come.
        m.receive(Millis(1), &r[..5]);
        m.receive(Millis(1), &r[5..]);
        assert_eq!(
            m.poll_outcome(),
            Some((b, Outcome::Acquire(AcquireOutcome::Busy)))
        );
        assert_eq!(
            m.poll_outcome(),
            Some((a, Outcome::Acquire(AcquireOutcome::Timeout)))
        );
    }

    #[test]
    fn wait_zero_and_releases_run_under_the_transport_deadline() {
        let mut m = Machine::new(1);
        let a = m.acquire(Millis(0), "db", Duration::ZERO, 5 * S).unwrap();
        let r = m.release(Millis(0), "db", 3).unwrap();
        m.handle_timeout(Millis(4_999));
        assert_eq!(m.poll_outcome(), None);
        m.handle_timeout(Millis(5_000));
        assert_eq!(
            m.poll_outcome(),
            Some((a, Outcome::Acquire(AcquireOutcome::Timeout)))
        );
        assert_eq!(
            m.poll_outcome(),
            Some((r, Outcome::Release(Release::NotSent)))
        );
    }

    #[test]
    fn a_lost_connection_makes_sent_calls_indeterminate_and_keeps_unsent_ones() {
        let mut m = Machine::new(1);
        let sent_one = m.acquire(Millis(0), "a", 10 * S, 5 * S).unwrap();
        let first = sent(&mut m, Millis(0));
        let (_, _, owner_before) = acquire_sent(&first);
        let unsent = m.acquire(Millis(0), "b", 10 * S, 5 * S).unwrap();
        m.connection_lost();
        assert_eq!(
            m.poll_outcome(),
            Some((sent_one, Outcome::Acquire(AcquireOutcome::Indeterminate)))
        );
        assert_eq!(m.poll_outcome(), None);
        let (wait_s, _, owner) = acquire_sent(&sent(&mut m, Millis(4_000)));
        assert_eq!(wait_s, 6);
        assert_ne!(owner, owner_before);
        // The retried call keeps its owner: the reply to it matches.
        m.receive(Millis(4_000), &reply(&Reply::Timeout { owner, key: "b" }));
        assert_eq!(
            m.poll_outcome(),
            Some((unsent, Outcome::Acquire(AcquireOutcome::Timeout)))
        );
    }

    #[test]
    fn bad_arguments_queue_nothing_and_a_malformed_reply_closes_the_session() {
        let mut m = Machine::new(1);
        assert!(m.acquire(Millis(0), "", S, S).is_err());
        assert!(m.acquire(Millis(0), "a\nb", S, S).is_err());
        assert!(m.acquire(Millis(0), "a", S, Duration::ZERO).is_err());
        assert!(m.acquire(Millis(0), "a", S, 256 * S).is_err());
        assert_eq!(m.pending(), 0);
        let id = m.acquire(Millis(0), "a", S, S).unwrap();
        let _ = sent(&mut m, Millis(0));
        m.receive(Millis(1), b"Z\n");
        assert!(m.wants_close());
        assert_eq!(
            m.poll_outcome(),
            Some((id, Outcome::Acquire(AcquireOutcome::Indeterminate)))
        );
    }

    fn held(m: &mut Machine, now: Millis, lease: Duration) -> Held {
        m.acquire(now, "db", Duration::ZERO, lease).unwrap();
        let (_, _, owner) = acquire_sent(&sent(m, now));
        m.receive(
            now,
            &reply(&Reply::Acquired {
                token: 5,
                owner,
                key: "db",
            }),
        );
        match m.poll_outcome() {
            Some((_, Outcome::Acquire(AcquireOutcome::Acquired(h)))) => h,
            other => panic!("not acquired: {other:?}"),
        }
    }

    #[test]
    fn an_extend_moves_the_expiry_to_its_write_time_plus_the_lease() {
        let mut m = Machine::new(1);
        let h = held(&mut m, Millis(0), 10 * S);
        assert_eq!(h.expires_at, Millis(10_000));
        let id = m.extend(Millis(3_000), &h, 20 * S).unwrap();
        let mut want = Vec::new();
        proto::encode_request(
            &Request::Extend {
                lease_s: 20,
                token: 5,
                key: "db",
            },
            &mut want,
        );
        assert_eq!(sent(&mut m, Millis(4_000)), want);
        m.receive(
            Millis(4_500),
            &reply(&Reply::Extended {
                token: 5,
                key: "db",
            }),
        );
        let Some((got, Outcome::Extend(ExtendOutcome::Extended(h2)))) = m.poll_outcome() else {
            panic!("not extended");
        };
        assert_eq!(got, id);
        assert_eq!(
            (h2.token, h2.expires_at),
            (5, Millis(24_000)),
            "written + lease"
        );
        // X is definitive.
        m.extend(Millis(5_000), &h2, 20 * S).unwrap();
        let _ = sent(&mut m, Millis(5_000));
        m.receive(
            Millis(5_001),
            &reply(&Reply::NotExtended {
                token: 5,
                key: "db",
            }),
        );
        assert_eq!(
            m.poll_outcome().map(|(_, o)| o),
            Some(Outcome::Extend(ExtendOutcome::Lost))
        );
    }

    #[test]
    fn an_expired_grant_is_not_extended_and_a_late_e_revives_nothing() {
        let mut m = Machine::new(1);
        let h = held(&mut m, Millis(0), 2 * S);
        m.extend(Millis(2_000), &h, 5 * S).unwrap();
        assert_eq!(
            m.poll_outcome().map(|(_, o)| o),
            Some(Outcome::Extend(ExtendOutcome::Lost))
        );
        assert!(sent(&mut m, Millis(2_000)).is_empty(), "nothing sent");
        m.extend(Millis(1_000), &h, 5 * S).unwrap();
        let _ = sent(&mut m, Millis(1_000));
        m.receive(
            Millis(2_000),
            &reply(&Reply::Extended {
                token: 5,
                key: "db",
            }),
        );
        assert_eq!(
            m.poll_outcome().map(|(_, o)| o),
            Some(Outcome::Extend(ExtendOutcome::Lost)),
            "an E at the expiry counts for nothing"
        );
    }

    #[test]
    fn an_unanswered_extend_is_sent_again_on_the_next_connection_until_the_expiry() {
        let mut m = Machine::new(1);
        let h = held(&mut m, Millis(0), 30 * S);
        let id = m.extend(Millis(1_000), &h, 30 * S).unwrap();
        let first = sent(&mut m, Millis(1_000));
        // No reply within the 5 s transport deadline: the session is given
        // up, the extend is not.
        m.handle_timeout(Millis(6_000));
        assert!(m.wants_close());
        assert_eq!(m.poll_outcome(), None);
        m.connection_lost();
        assert_eq!(sent(&mut m, Millis(6_100)), first, "the same extend again");
        m.receive(
            Millis(6_200),
            &reply(&Reply::Extended {
                token: 5,
                key: "db",
            }),
        );
        let Some((got, Outcome::Extend(ExtendOutcome::Extended(h2)))) = m.poll_outcome() else {
            panic!("not extended");
        };
        assert_eq!((got, h2.expires_at), (id, Millis(36_100)));
        // Never past the expiry: a connection that stays down loses it.
        let id = m.extend(Millis(7_000), &h2, 30 * S).unwrap();
        let _ = sent(&mut m, Millis(7_000));
        m.connection_lost();
        m.handle_timeout(Millis(36_099));
        assert_eq!(m.poll_outcome(), None);
        m.handle_timeout(Millis(36_100));
        assert_eq!(
            m.poll_outcome(),
            Some((id, Outcome::Extend(ExtendOutcome::Lost)))
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_owners() {
        let run = |seed| {
            let mut m = Machine::new(seed);
            m.acquire(Millis(0), "a", S, S).unwrap();
            m.acquire(Millis(0), "a", S, S).unwrap();
            sent(&mut m, Millis(0))
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }
}

//! The official client's rules (PROTOCOL §3) as a sans-IO state machine: the
//! caller moves the bytes and the clock, the machine decides what to send,
//! when to give up and what each call's outcome is.
//!
//! It is for programs that drive their own I/O, and for deterministic tests
//! (with the `harness` feature's in-memory server): no thread, no socket, no
//! OS clock. The blocking [`super::Client`] is built on it too: each of its
//! connections is a machine on the monotonic clock ([`std::time::Instant`]),
//! driven by the connection's writer and reader threads and by the callers
//! waiting for their outcomes.
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
//!    queued and the call is Indeterminate. An A/T/B for the owner of a call
//!    that names another key is not trusted: the session is given up.
//! 4. [`Machine::handle_timeout`]: a request that may have been sent and has
//!    no reply by `D + 1 s` (or the transport deadline) makes the machine ask
//!    for its session to be closed ([`Machine::wants_close`]): every call
//!    that may have been sent on it is Indeterminate.
//! 5. [`Machine::connection_lost`]: the connection died. What may have been
//!    sent is Indeterminate; what was definitely not sent stays queued and
//!    goes out on the next connection, with the same owner and the same `D`.
//!    A program with several connections can instead move it to another
//!    machine: [`Machine::take_unsent`], then [`Machine::adopt`].
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

mod call;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

pub use call::Unsent;
pub(crate) use call::{CloseCause, Decided, Kind};

use super::deadline;
pub use super::deadline::Moment;
use super::owner::mix;
use super::{Error, Release};
use crate::proto::{self, Decoded, Places, Reply, Request};
use crate::readbuf::ReadBuf;
use crate::time::Millis;
use call::Call;

/// The read buffer a machine keeps between replies; grown past it (for a
/// long reply), it is given back once empty.
const KEEP_READ_BYTES: usize = 16 * 1024;

/// One call made on a [`Machine`], to match it with its outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CallId(pub u64);

/// A grant handed to the caller: the key, the fencing token and a
/// conservative expiry (the time the request was handed out to be written,
/// plus the lease: the server's lease always ends later).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held<T = Millis> {
    /// The key.
    pub key: String,
    /// The fencing token: pass it to the resource you guard.
    pub token: u64,
    /// The lease asked for.
    pub lease: Duration,
    /// Leave the critical section before this moment.
    pub expires_at: T,
}

impl<T: Moment> Held<T> {
    /// The conservative expiry has been reached: the holder must stop
    /// using the token.
    #[must_use]
    pub fn is_expired(&self, now: T) -> bool {
        now >= self.expires_at
    }
}

/// What an acquire came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcquireOutcome<T = Millis> {
    /// Granted, and handed over by `D`.
    Acquired(Held<T>),
    /// Definitely not acquired: the wait ran out on the server, the key was
    /// held (`wait = 0`), or the request was never sent before `D`.
    Timeout,
    /// Definitely not acquired and not queued: a server capacity limit.
    Busy,
    /// Definitely not acquired and not queued (protocol 1.2): the key is
    /// registered with another limit, this one. Only an acquire with
    /// places comes to it; the caller decides what to do.
    LimitMismatch(u16),
    /// Unknown. Do not enter the critical section; a grant that may exist is
    /// taken back by its lease at the latest.
    Indeterminate,
}

/// What an extend came to (PROTOCOL §5.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtendOutcome<T = Millis> {
    /// `E` before the grant's conservative expiry: the grant as it is now,
    /// its expiry the time the answered attempt was written plus the new
    /// lease. Replace the old [`Held`] with it.
    Extended(Held<T>),
    /// `X` (the grant is gone or capped), or the conservative expiry came
    /// with no `E`: stop using the token.
    Lost,
}

/// The outcome of one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome<T = Millis> {
    /// Of [`Machine::acquire`].
    Acquire(AcquireOutcome<T>),
    /// Of [`Machine::release`].
    Release(Release),
    /// Of [`Machine::extend`].
    Extend(ExtendOutcome<T>),
}

/// The client state machine, on the clock `T` ([`Millis`] of a clock the
/// caller keeps, by default). See the module documentation.
#[derive(Debug)]
pub struct Machine<T: Moment = Millis> {
    seed: u64,
    owners: u64,
    next_id: u64,
    max_key_bytes: usize,
    /// Not yet handed out, in call order.
    queued: VecDeque<Call<T>>,
    /// Handed out, waiting for a reply.
    sent: BTreeMap<CallId, Call<T>>,
    /// The acquires of `sent` by owner.
    by_owner: HashMap<u64, CallId>,
    /// The releases and extends of `sent` by token.
    by_token: BTreeSet<(u64, CallId)>,
    /// Received bytes of a reply not yet complete.
    rbuf: ReadBuf,
    outcomes: VecDeque<Decided<T>>,
    wants_close: bool,
    cause: Option<CloseCause>,
    /// Requests handed out so far.
    handed_out: u64,
}

impl Machine<Millis> {
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
        Machine::on_clock(seed, max_key_bytes)
    }
}

impl<T: Moment> Machine<T> {
    /// [`Machine::with_max_key_bytes`] on another clock.
    #[must_use]
    pub fn on_clock(seed: u64, max_key_bytes: usize) -> Machine<T> {
        Machine {
            seed: mix(seed),
            owners: 0,
            next_id: 1,
            max_key_bytes,
            queued: VecDeque::new(),
            sent: BTreeMap::new(),
            by_owner: HashMap::new(),
            by_token: BTreeSet::new(),
            rbuf: ReadBuf::new(0),
            outcomes: VecDeque::new(),
            wants_close: false,
            cause: None,
            handed_out: 0,
        }
    }

    fn next_owner(&mut self) -> u64 {
        self.owners += 1;
        mix(self.seed.wrapping_add(self.owners))
    }

    fn next_id(&mut self) -> CallId {
        let id = CallId(self.next_id);
        self.next_id += 1;
        id
    }

    /// Asks for `key` at `now`, waiting up to `wait` (clamped to 255 s) in
    /// the server's queue, for a lease of `lease` (whole seconds, 1..=255).
    ///
    /// # Errors
    /// A bad key or lease; nothing is queued.
    pub fn acquire(
        &mut self,
        now: T,
        key: &str,
        wait: Duration,
        lease: Duration,
    ) -> Result<CallId, Error> {
        self.acquire_with(now, key, None, wait, lease)
    }

    /// [`Machine::acquire`] of one of `places.limit` places of `key` in
    /// `places.mode` (protocol 1.2, PROTOCOL §6), sent as an Acquire With
    /// Limit; `None` is [`Machine::acquire`]. Besides the outcomes of an
    /// acquire it may come to [`AcquireOutcome::LimitMismatch`].
    ///
    /// # Errors
    /// A bad key or lease, or a limit of 0; nothing is queued.
    pub fn acquire_with(
        &mut self,
        now: T,
        key: &str,
        places: Option<Places>,
        wait: Duration,
        lease: Duration,
    ) -> Result<CallId, Error> {
        let max = self.max_key_bytes;
        let call = Unsent::acquire(now, key, (wait, lease), places, max, || self.next_owner())?;
        Ok(self.adopt(call))
    }

    /// Releases `token` on `key` at `now`, under the 5 s transport deadline.
    ///
    /// # Errors
    /// A bad key; nothing is queued.
    pub fn release(&mut self, now: T, key: &str, token: u64) -> Result<CallId, Error> {
        let call = Unsent::release(now, key, token, self.max_key_bytes)?;
        Ok(self.adopt(call))
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
    pub fn extend(&mut self, now: T, held: &Held<T>, lease: Duration) -> Result<CallId, Error> {
        let call = Unsent::extend(now, &held.key, held.token, lease, held.expires_at)?;
        if held.is_expired(now) {
            let id = self.next_id();
            self.decide(id, &call, call.not_sent(), false);
            return Ok(id);
        }
        Ok(self.adopt(call))
    }

    /// Queues `call`, taken out of another machine by
    /// [`Machine::take_unsent`] (or made by the blocking client), behind
    /// every call already queued. Its outcome comes out of this machine,
    /// under the returned id.
    pub fn adopt(&mut self, call: Unsent<T>) -> CallId {
        let id = self.next_id();
        self.queued.push_back(Call {
            id,
            req: call,
            written_at: None,
        });
        id
    }

    /// Takes every call still queued out of the machine, in call order:
    /// none of them was ever handed out, so each may go to another machine
    /// ([`Machine::adopt`]) with its owner and deadlines unchanged. For a
    /// program that gives up this machine's connection for good instead of
    /// calling [`Machine::connection_lost`] and reconnecting.
    pub fn take_unsent(&mut self) -> Vec<(CallId, Unsent<T>)> {
        self.queued.drain(..).map(|c| (c.id, c.req)).collect()
    }

    /// Appends to `out` the bytes of every queued request that may still be
    /// sent at `now`, and returns how many bytes. Write all of them: from
    /// this call on they may have been sent. Requests past their send
    /// deadline are dropped unsent (their outcome is Timeout, or NotSent for
    /// a release). Nothing is handed out while a close is pending.
    pub fn transmit(&mut self, now: T, out: &mut Vec<u8>) -> usize {
        self.transmit_at_most(now, out, usize::MAX)
    }

    /// [`Machine::transmit`], stopping once `max_bytes` have been handed
    /// out (at least one request goes out if one is due): what stays
    /// queued has definitely not been sent and can still move elsewhere.
    pub fn transmit_at_most(&mut self, now: T, out: &mut Vec<u8>, max_bytes: usize) -> usize {
        if self.wants_close {
            return 0;
        }
        let start = out.len();
        while out.len() - start < max_bytes {
            let Some(mut call) = self.queued.pop_front() else {
                break;
            };
            let Some(wait_s) = call.req.plan.wire_wait_at(now) else {
                self.decide(call.id, &call.req, call.req.not_sent(), false);
                continue;
            };
            let key = &call.req.key;
            let req = match call.req.kind {
                Kind::Acquire {
                    owner,
                    lease_s,
                    places,
                } => {
                    self.by_owner.insert(owner, call.id);
                    match places {
                        None => Request::Acquire {
                            wait_s,
                            lease_s,
                            owner,
                            key,
                        },
                        Some(Places { limit, mode }) => Request::AcquireWithLimit {
                            wait_s,
                            lease_s,
                            owner,
                            limit,
                            mode,
                            key,
                        },
                    }
                }
                Kind::Release { token } => {
                    self.by_token.insert((token, call.id));
                    Request::Release { token, key }
                }
                Kind::Extend {
                    token,
                    lease_s,
                    until,
                } => {
                    // Each attempt has its own transport deadline, never
                    // past `until`.
                    call.req.plan = deadline::Plan::until(now, until);
                    self.by_token.insert((token, call.id));
                    Request::Extend {
                        lease_s,
                        token,
                        key,
                    }
                }
            };
            proto::encode_request(&req, out);
            call.written_at = Some(now);
            self.handed_out += 1;
            self.sent.insert(call.id, call);
        }
        out.len() - start
    }

    fn decide(&mut self, id: CallId, req: &Unsent<T>, outcome: Outcome<T>, refused: bool) {
        if !req.silent {
            self.outcomes.push_back(Decided {
                id,
                outcome,
                refused,
                gate: req.plan.gate,
            });
        }
    }

    /// Feeds bytes read from the connection at `now`. A reply that matches
    /// no call is ignored; a malformed one makes the machine ask for the
    /// session to be closed (every call in flight is then Indeterminate).
    pub fn receive(&mut self, now: T, bytes: &[u8]) {
        if self.wants_close {
            return;
        }
        // Complete replies are handled at once: what stays is at most one
        // incomplete reply, which the decoder bounds.
        self.rbuf.append(bytes);
        let mut buf = std::mem::replace(&mut self.rbuf, ReadBuf::new(0));
        loop {
            match proto::decode_reply(buf.data(), self.max_key_bytes) {
                Decoded::Frame { frame, used } => {
                    if !self.matched(now, &frame) {
                        self.cause = Some(CloseCause::WrongKey);
                        self.close_session();
                        return;
                    }
                    buf.consume(used);
                }
                Decoded::Incomplete => break,
                Decoded::Malformed(m) => {
                    let head = buf.data()[..buf.len().min(64)].to_vec();
                    self.cause = Some(CloseCause::Malformed {
                        reason: m.to_string(),
                        head,
                    });
                    self.close_session();
                    return;
                }
            }
        }
        if buf.capacity() > KEEP_READ_BYTES {
            // A long reply grew it: the memory goes back once it is handled.
            buf.shrink_if_empty();
        }
        self.rbuf = buf;
    }

    /// Matches one reply to its call and decides the call; `false` if the
    /// reply cannot be trusted (an acquire's owner with another key).
    fn matched(&mut self, now: T, reply: &Reply<'_>) -> bool {
        match *reply {
            Reply::Acquired { owner, key, .. }
            | Reply::Timeout { owner, key }
            | Reply::Busy { owner, key }
            | Reply::LimitMismatch { owner, key, .. } => {
                let Some(id) = self.by_owner.remove(&owner) else {
                    // Nothing of ours. A grant nobody waits for (a correct
                    // server never sends one) is given back at once.
                    if let Reply::Acquired { token, key, .. } = *reply {
                        self.adopt(Unsent::give_back(now, key, token));
                    }
                    return true;
                };
                let Some(call) = self.sent.remove(&id) else {
                    return true;
                };
                // An `L` answers only an Acquire With Limit.
                let mutex = matches!(call.req.kind, Kind::Acquire { places: None, .. });
                let stray = matches!(reply, Reply::LimitMismatch { .. }) && mutex;
                if call.req.key != key || stray {
                    self.decide(call.id, &call.req, call.req.lost(), false);
                    return false;
                }
                self.acquire_answered(now, call, reply);
            }
            Reply::Released { token, key } | Reply::NotReleased { token, key } => {
                if let Some(call) = self.take_by_token(token, key, false) {
                    let r = if matches!(reply, Reply::Released { .. }) {
                        Release::Released
                    } else {
                        Release::NotHeld
                    };
                    self.decide(call.id, &call.req, Outcome::Release(r), false);
                }
            }
            Reply::Extended { token, key } | Reply::NotExtended { token, key } => {
                if let Some(mut call) = self.take_by_token(token, key, true) {
                    let extended = matches!(reply, Reply::Extended { .. });
                    let outcome = extend_outcome(&mut call, now, extended);
                    self.decide(call.id, &call.req, Outcome::Extend(outcome), !extended);
                }
            }
        }
        true
    }

    /// Decides an acquire answered A, T or B at `now`.
    fn acquire_answered(&mut self, now: T, mut call: Call<T>, reply: &Reply<'_>) {
        let outcome = match *reply {
            Reply::Acquired { token, .. } if now > call.req.plan.gate => {
                // Seen after D: not handed over; give it back.
                self.adopt(Unsent::give_back(now, &call.req.key, token));
                AcquireOutcome::Indeterminate
            }
            Reply::Acquired { token, .. } => {
                let written = call.written_at.unwrap_or(now);
                AcquireOutcome::Acquired(call.req.take_held(token, written))
            }
            Reply::Busy { .. } => AcquireOutcome::Busy,
            Reply::LimitMismatch { limit, .. } => AcquireOutcome::LimitMismatch(limit),
            _ => AcquireOutcome::Timeout,
        };
        self.decide(call.id, &call.req, Outcome::Acquire(outcome), false);
    }

    /// Takes the oldest release (or extend) in flight of `token` on `key`.
    fn take_by_token(&mut self, token: u64, key: &str, extend: bool) -> Option<Call<T>> {
        let found = self
            .by_token
            .range((token, CallId(0))..=(token, CallId(u64::MAX)))
            .map(|&(_, id)| id)
            .find(|id| {
                self.sent.get(id).is_some_and(|c| {
                    c.req.key == key && matches!(c.req.kind, Kind::Extend { .. }) == extend
                })
            })?;
        self.by_token.remove(&(token, found));
        self.sent.remove(&found)
    }

    /// Decides what is due at `now`: queued calls past their send deadline
    /// are dropped unsent; a call that may have been sent and has no reply
    /// by its give-up moment closes the session.
    pub fn handle_timeout(&mut self, now: T) {
        let mut i = 0;
        while i < self.queued.len() {
            if now >= self.queued[i].req.plan.send_deadline {
                if let Some(call) = self.queued.remove(i) {
                    self.decide(call.id, &call.req, call.req.not_sent(), false);
                }
            } else {
                i += 1;
            }
        }
        if self.sent.values().any(|c| now >= c.req.plan.give_up) {
            self.cause = Some(CloseCause::NoReply);
            self.close_session();
        }
    }

    /// The next moment [`Machine::handle_timeout`] has something to decide.
    #[must_use]
    pub fn next_timeout(&self) -> Option<T> {
        let queued = self.queued.iter().map(|c| c.req.plan.send_deadline);
        let flying = self.sent.values().map(|c| c.req.plan.give_up);
        queued.chain(flying).min()
    }

    /// The next moment [`Machine::handle_timeout`] has something to decide
    /// about call `id`: its send deadline while it is queued, its give-up
    /// moment once handed out; `None` once it is decided (or moved out).
    #[must_use]
    pub fn deadline_of(&self, id: CallId) -> Option<T> {
        if let Some(c) = self.sent.get(&id) {
            return Some(c.req.plan.give_up);
        }
        self.queued
            .iter()
            .find(|c| c.id == id)
            .map(|c| c.req.plan.send_deadline)
    }

    fn close_session(&mut self) {
        self.wants_close = true;
        self.by_owner.clear();
        self.by_token.clear();
        let mut again = Vec::new();
        for (id, mut call) in std::mem::take(&mut self.sent) {
            if let Kind::Extend { until, .. } = call.req.kind {
                // Applying an extend twice only moves the caller's own
                // expiry: it goes out again, until `until`.
                call.written_at = None;
                call.req.plan.send_deadline = until;
                call.req.plan.give_up = until;
                again.push(call);
                continue;
            }
            self.decide(id, &call.req, call.req.lost(), false);
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
    pub fn poll_outcome(&mut self) -> Option<(CallId, Outcome<T>)> {
        self.outcomes.pop_front().map(|d| (d.id, d.outcome))
    }

    /// [`Machine::poll_outcome`] with what the blocking client needs besides.
    pub(crate) fn poll_decided(&mut self) -> Option<Decided<T>> {
        self.outcomes.pop_front()
    }

    /// Why the machine asked for its session to be closed, once.
    pub(crate) fn take_close_cause(&mut self) -> Option<CloseCause> {
        self.cause.take()
    }

    /// The received bytes not yet a whole reply.
    pub(crate) fn unparsed(&self) -> &[u8] {
        self.rbuf.data()
    }

    /// Gives `held` back at `now`: a release nobody waits for, for a grant
    /// that reached its caller too late ([`Decided::hand_over`]).
    pub(crate) fn give_back(&mut self, now: T, held: &Held<T>) {
        self.adopt(Unsent::give_back(now, &held.key, held.token));
    }

    /// Requests handed out so far.
    #[cfg(test)]
    pub(crate) fn handed_out(&self) -> u64 {
        self.handed_out
    }

    /// Owners of the acquires still queued (unsent).
    #[cfg(test)]
    pub(crate) fn queued_owners(&self) -> Vec<u64> {
        self.queued
            .iter()
            .filter_map(|c| match c.req.kind {
                Kind::Acquire { owner, .. } => Some(owner),
                Kind::Release { .. } | Kind::Extend { .. } => None,
            })
            .collect()
    }

    /// Calls not yet decided (queued or in flight, compensating releases
    /// included).
    #[must_use]
    pub fn pending(&self) -> usize {
        self.queued.len() + self.sent.len()
    }

    /// Calls queued, not yet handed out.
    #[must_use]
    pub fn queued(&self) -> usize {
        self.queued.len()
    }
}

/// What an extend's reply means: `E` before `until` is a new lease from
/// when the extend was written; `X`, or an `E` at or after `until` (whoever
/// watched the expiry has been told the grant is lost), is lost.
fn extend_outcome<T: Moment>(call: &mut Call<T>, now: T, extended: bool) -> ExtendOutcome<T> {
    let (token, until) = match call.req.kind {
        Kind::Extend { token, until, .. } => (token, until),
        Kind::Acquire { .. } | Kind::Release { .. } => return ExtendOutcome::Lost,
    };
    if !(extended && now < until) {
        return ExtendOutcome::Lost;
    }
    let written = call.written_at.unwrap_or(now);
    ExtendOutcome::Extended(call.req.take_held(token, written))
}

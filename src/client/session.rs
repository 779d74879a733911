//! One connection to a server: a writer thread, a reader thread, and the
//! table that matches pipelined replies to the calls waiting for them.
//!
//! A call is [`Phase::Queued`] while it sits in the session's queue: not one
//! byte of it has been handed to the socket, so it can still be withdrawn and
//! retried elsewhere. The writer moves it to [`Phase::Sent`] *before* its
//! bytes go to a `write` call, which is the conservative reading of "may have
//! been sent": from then on it is never sent again. The reader matches A/T/B
//! by owner and R/N by token and key, in any order.
//!
//! Lock order: the session's `state`, then a call's `phase`. Every move of a
//! call between phases happens under `state`, so "is it still queued?" has
//! one answer for the writer, the reader and the waiting caller.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::net::Shutdown;

use crate::client::transport::ClientStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use super::deadline::Plan;
use super::failure::{classify_io, classify_reply, Failure, FailureKind};
use crate::limits::max_reply_frame;
use crate::proto::{decode_reply, encode_request, Decoded, Reply, Request};
use crate::readbuf::ReadBuf;

/// Most bytes the writer hands to one `write_all`. Bounds how many queued
/// requests one stalled write turns from "unsent" into "may have been sent".
const BATCH_BYTES: usize = 16 * 1024;
/// Bytes the reader asks for per `read`.
const READ_CHUNK: usize = 8 * 1024;

static NEXT_SESSION_ID: AtomicU64 = AtomicU64::new(1);

/// Locks a mutex, ignoring poisoning: every critical section here leaves its
/// data consistent before anything that could panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a call asks the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// An acquire; the wait byte is computed when it is written.
    Acquire {
        /// Fresh correlation id of this call.
        owner: u64,
        /// Lease byte, already checked.
        lease_s: u8,
    },
    /// A release of `token`.
    Release {
        /// The token being released.
        token: u64,
    },
    /// An extend of `token` (PROTOCOL §5).
    Extend {
        /// The token being extended.
        token: u64,
        /// Lease byte, already checked.
        lease_s: u8,
    },
}

/// A matched reply, without its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    Acquired { token: u64 },
    Timeout,
    Busy,
    Released,
    NotReleased,
    Extended,
    NotExtended,
}

/// How a call ended, as seen by the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A reply matched; `written_at` is when its bytes were handed to a write.
    Answered { answer: Answer, written_at: Instant },
    /// Withdrawn before any byte of it reached a socket: safe to retry.
    NotSent,
    /// It may have been sent and no reply can come any more.
    Lost,
}

#[derive(Clone, Copy, Debug)]
enum Phase {
    Queued,
    Sent { written_at: Instant },
    Done(Outcome),
}

/// What a waiting caller learns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waited {
    Answered {
        answer: Answer,
        written_at: Instant,
    },
    /// Never sent: retry on another session if time is left.
    NotSent,
    /// May have been sent, no reply will be matched: Indeterminate.
    Indeterminate,
}

impl From<Outcome> for Waited {
    fn from(o: Outcome) -> Waited {
        match o {
            Outcome::Answered { answer, written_at } => Waited::Answered { answer, written_at },
            Outcome::NotSent => Waited::NotSent,
            Outcome::Lost => Waited::Indeterminate,
        }
    }
}

/// Told once, when a call ends, by whichever thread ends it (the reader,
/// the writer, a closing session): lets one thread watch many calls
/// without a thread waiting on each. It runs with the session's lock held,
/// so it must only hand the news on (a channel send), never block.
pub(crate) type OnDone = Box<dyn Fn() + Send + Sync>;

/// One request and the caller (if any) waiting for it.
pub(crate) struct Call {
    pub(crate) kind: Kind,
    pub(crate) key: Arc<str>,
    pub(crate) plan: Plan,
    phase: Mutex<Phase>,
    cv: Condvar,
    on_done: Option<OnDone>,
}

impl Call {
    pub(crate) fn new(kind: Kind, key: Arc<str>, plan: Plan) -> Arc<Call> {
        Call::build(kind, key, plan, None)
    }

    /// A call that runs `on_done` the moment it ends.
    pub(crate) fn watched(kind: Kind, key: Arc<str>, plan: Plan, on_done: OnDone) -> Arc<Call> {
        Call::build(kind, key, plan, Some(on_done))
    }

    fn build(kind: Kind, key: Arc<str>, plan: Plan, on_done: Option<OnDone>) -> Arc<Call> {
        Arc::new(Call {
            kind,
            key,
            plan,
            phase: Mutex::new(Phase::Queued),
            cv: Condvar::new(),
            on_done,
        })
    }

    /// How the call ended, once it has.
    pub(crate) fn outcome(&self) -> Option<Waited> {
        match *lock(&self.phase) {
            Phase::Done(o) => Some(o.into()),
            Phase::Queued | Phase::Sent { .. } => None,
        }
    }

    fn finish(&self, outcome: Outcome) {
        let mut ph = lock(&self.phase);
        if !matches!(*ph, Phase::Done(_)) {
            *ph = Phase::Done(outcome);
            self.cv.notify_all();
            drop(ph);
            self.done();
        }
    }

    fn answer(&self, answer: Answer) {
        let mut ph = lock(&self.phase);
        if let Phase::Sent { written_at } = *ph {
            *ph = Phase::Done(Outcome::Answered { answer, written_at });
            self.cv.notify_all();
            drop(ph);
            self.done();
        }
    }

    /// Runs the watcher, after the phase lock is let go.
    fn done(&self) {
        if let Some(f) = &self.on_done {
            f();
        }
    }

    fn set_sent(&self, written_at: Instant) {
        *lock(&self.phase) = Phase::Sent { written_at };
    }
}

struct State {
    dead: bool,
    why: Option<String>,
    /// Why the connection failed, when it ended by no doing of the client.
    failure: Option<Failure>,
    queue: VecDeque<Arc<Call>>,
    acquires: HashMap<u64, Arc<Call>>,
    /// By token; the list holds one entry per pending release of that token,
    /// usually one, checked against the key of the reply.
    releases: HashMap<u64, Vec<Arc<Call>>>,
    /// Pending extends, matched by E/X as releases are by R/N.
    extends: HashMap<u64, Vec<Arc<Call>>>,
    /// Tests hold the writer to observe queued calls.
    writer_paused: bool,
    /// Frames handed to `write`, for tests and diagnostics.
    frames_written: u64,
    /// `write_all` calls that carried them.
    writes: u64,
}

/// A connection with its two threads.
pub(crate) struct Session {
    id: u64,
    /// The server address, for [`Failure`]s.
    peer: String,
    stream: ClientStream,
    max_key_bytes: usize,
    state: Mutex<State>,
    writer_cv: Condvar,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// Encodes one call into the batch and files it where its reply will be
/// matched: by owner (acquire) or by token (release, extend).
fn encode_call(st: &mut State, call: &Arc<Call>, wait_s: u8, buf: &mut Vec<u8>) {
    match call.kind {
        Kind::Acquire { owner, lease_s } => {
            encode_request(
                &Request::Acquire {
                    wait_s,
                    lease_s,
                    owner,
                    key: &call.key,
                },
                buf,
            );
            if let Some(old) = st.acquires.insert(owner, Arc::clone(call)) {
                // Owners are fresh per call and a call is
                // queued on one session at a time; should it
                // ever happen, the older call cannot be told
                // apart any more.
                old.finish(Outcome::Lost);
            }
        }
        Kind::Release { token } => {
            encode_request(
                &Request::Release {
                    token,
                    key: &call.key,
                },
                buf,
            );
            st.releases.entry(token).or_default().push(Arc::clone(call));
        }
        Kind::Extend { token, lease_s } => {
            encode_request(
                &Request::Extend {
                    lease_s,
                    token,
                    key: &call.key,
                },
                buf,
            );
            st.extends.entry(token).or_default().push(Arc::clone(call));
        }
    }
}

impl Session {
    /// Starts the reader and writer threads of a connected stream.
    pub(crate) fn start(
        stream: ClientStream,
        max_key_bytes: usize,
        peer: String,
    ) -> io::Result<Arc<Session>> {
        let read_half = stream.try_clone()?;
        let session = Arc::new(Session {
            id: NEXT_SESSION_ID.fetch_add(1, Ordering::Relaxed),
            peer,
            stream,
            max_key_bytes,
            state: Mutex::new(State {
                dead: false,
                why: None,
                failure: None,
                queue: VecDeque::new(),
                acquires: HashMap::new(),
                releases: HashMap::new(),
                extends: HashMap::new(),
                writer_paused: false,
                frames_written: 0,
                writes: 0,
            }),
            writer_cv: Condvar::new(),
            threads: Mutex::new(Vec::with_capacity(2)),
        });
        let w = Arc::clone(&session);
        let writer = std::thread::Builder::new()
            .name(format!("ticket-w{}", session.id))
            .spawn(move || w.writer_loop());
        match writer {
            Ok(h) => lock(&session.threads).push(h),
            Err(e) => {
                session.close("cannot start the writer thread");
                return Err(e);
            }
        }
        let r = Arc::clone(&session);
        let reader = std::thread::Builder::new()
            .name(format!("ticket-r{}", session.id))
            .spawn(move || r.reader_loop(read_half));
        match reader {
            Ok(h) => lock(&session.threads).push(h),
            Err(e) => {
                session.close("cannot start the reader thread");
                session.join();
                return Err(e);
            }
        }
        Ok(session)
    }

    pub(crate) fn is_dead(&self) -> bool {
        lock(&self.state).dead
    }

    /// Why the connection failed, if it ended by no doing of the client.
    pub(crate) fn failure(&self) -> Option<Failure> {
        lock(&self.state).failure.clone()
    }

    /// Why the session closed, once it has.
    #[cfg(test)]
    pub(crate) fn close_reason(&self) -> Option<String> {
        lock(&self.state).why.clone()
    }

    /// Frames handed to `write` so far.
    #[cfg(test)]
    pub(crate) fn frames_written(&self) -> u64 {
        lock(&self.state).frames_written
    }

    /// `write_all` calls so far.
    #[cfg(test)]
    pub(crate) fn writes(&self) -> u64 {
        lock(&self.state).writes
    }

    /// Threads not yet joined.
    #[cfg(test)]
    pub(crate) fn unjoined_threads(&self) -> usize {
        lock(&self.threads).len()
    }

    /// Owners of the acquires still queued (unsent) here.
    #[cfg(test)]
    pub(crate) fn queued_owners(&self) -> Vec<u64> {
        lock(&self.state)
            .queue
            .iter()
            .filter_map(|c| match c.kind {
                Kind::Acquire { owner, .. } => Some(owner),
                Kind::Release { .. } | Kind::Extend { .. } => None,
            })
            .collect()
    }

    #[cfg(test)]
    pub(crate) fn pause_writer(&self, paused: bool) {
        lock(&self.state).writer_paused = paused;
        self.writer_cv.notify_all();
    }

    /// Queues `call` for the writer; `false` if the session is already dead
    /// (the call is untouched and can go elsewhere).
    pub(crate) fn enqueue(&self, call: Arc<Call>) -> bool {
        let mut st = lock(&self.state);
        if st.dead {
            return false;
        }
        st.queue.push_back(call);
        drop(st);
        self.writer_cv.notify_one();
        true
    }

    /// Queues every call of `calls` at once, so the writer puts them in
    /// one write (as many as fit in one batch of its); `false` if the
    /// session is already dead (the calls are untouched).
    pub(crate) fn enqueue_all(&self, calls: &[Arc<Call>]) -> bool {
        let mut st = lock(&self.state);
        if st.dead {
            return false;
        }
        st.queue.extend(calls.iter().cloned());
        drop(st);
        self.writer_cv.notify_one();
        true
    }

    /// Waits for `call` (queued here) to end, enforcing its plan: withdrawn
    /// unsent at `send_deadline`, given up with this session closed at
    /// `give_up` if it may have been sent and has no reply.
    pub(crate) fn await_call(&self, call: &Arc<Call>) -> Waited {
        loop {
            let now = Instant::now();
            {
                let ph = lock(&call.phase);
                let limit = match *ph {
                    Phase::Done(o) => return o.into(),
                    Phase::Queued => call.plan.send_deadline,
                    Phase::Sent { .. } => call.plan.give_up,
                };
                if now < limit {
                    let (ph, _) = call
                        .cv
                        .wait_timeout(ph, limit - now)
                        .unwrap_or_else(PoisonError::into_inner);
                    if let Phase::Done(o) = *ph {
                        return o.into();
                    }
                    continue;
                }
            }
            if let Some(w) = self.enforce(call, now) {
                return w;
            }
        }
    }

    /// Applies `call`'s plan at `now`, a moment at or past one of its
    /// limits: a call still queued at its send deadline is withdrawn
    /// (NotSent); one that may have been sent and has no reply at its
    /// give-up closes this session (Indeterminate). `None` if it is still
    /// running (written just before its send deadline).
    pub(crate) fn enforce(&self, call: &Arc<Call>, now: Instant) -> Option<Waited> {
        // Decided under the session lock, so the writer cannot move the
        // call between "queued" and "sent" meanwhile.
        let mut st = lock(&self.state);
        let phase = *lock(&call.phase);
        match phase {
            Phase::Done(o) => Some(o.into()),
            Phase::Queued if now >= call.plan.send_deadline => {
                st.queue.retain(|c| !Arc::ptr_eq(c, call));
                call.finish(Outcome::NotSent);
                Some(Waited::NotSent)
            }
            Phase::Sent { .. } if now >= call.plan.give_up => {
                // Close exactly this session: the reply can no longer be
                // told apart from a late one, and the server must not
                // keep a queued acquire for a caller that has gone.
                if !st.dead {
                    st.failure = Some(Failure::new(
                        self.peer.clone(),
                        FailureKind::NoReply,
                        "no reply within the wait plus 1 s".into(),
                    ));
                }
                self.close_locked(&mut st, "no reply by the deadline plus grace");
                drop(st);
                self.shutdown();
                let outcome = match *lock(&call.phase) {
                    Phase::Done(o) => o,
                    _ => Outcome::Lost,
                };
                Some(outcome.into())
            }
            Phase::Queued | Phase::Sent { .. } => None,
        }
    }

    /// Closes the session: queued calls become [`Outcome::NotSent`], calls
    /// that may have been sent become [`Outcome::Lost`], both threads end.
    pub(crate) fn close(&self, why: &str) {
        let mut st = lock(&self.state);
        if st.dead {
            return;
        }
        self.close_locked(&mut st, why);
        drop(st);
        self.shutdown();
    }

    /// Closes the session because the connection failed: `kind` and
    /// `detail` become its [`Failure`].
    fn close_failed(&self, why: &str, (kind, detail): (FailureKind, String)) {
        let mut st = lock(&self.state);
        if st.dead {
            return;
        }
        st.failure = Some(Failure::new(self.peer.clone(), kind, detail));
        self.close_locked(&mut st, why);
        drop(st);
        self.shutdown();
    }

    fn close_locked(&self, st: &mut State, why: &str) {
        if st.dead {
            return;
        }
        st.dead = true;
        st.why = Some(why.to_owned());
        for call in st.queue.drain(..) {
            call.finish(Outcome::NotSent);
        }
        for (_, call) in st.acquires.drain() {
            call.finish(Outcome::Lost);
        }
        for (_, calls) in st.releases.drain().chain(st.extends.drain()) {
            for call in calls {
                call.finish(Outcome::Lost);
            }
        }
        self.writer_cv.notify_all();
    }

    fn shutdown(&self) {
        // Wakes the reader (read returns 0) and a writer blocked in write
        // (EPIPE); every dup of the socket sees it.
        let _ = self.stream.shutdown(Shutdown::Both);
        self.writer_cv.notify_all();
    }

    /// Joins both threads; call only after [`Session::close`].
    pub(crate) fn join(&self) {
        let handles: Vec<_> = lock(&self.threads).drain(..).collect();
        let me = std::thread::current().id();
        for h in handles {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
    }

    fn writer_loop(&self) {
        let mut buf = Vec::with_capacity(BATCH_BYTES);
        loop {
            {
                let mut st = lock(&self.state);
                loop {
                    if st.dead {
                        return;
                    }
                    if !st.queue.is_empty() && !st.writer_paused {
                        break;
                    }
                    st = self
                        .writer_cv
                        .wait(st)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                // The wire wait is computed here, just before the write.
                let now = Instant::now();
                buf.clear();
                while buf.len() < BATCH_BYTES {
                    let Some(call) = st.queue.pop_front() else {
                        break;
                    };
                    let Some(wait_s) = call.plan.wire_wait_at(now) else {
                        // Reached its deadline unsent: never sent at all.
                        call.finish(Outcome::NotSent);
                        continue;
                    };
                    encode_call(&mut st, &call, wait_s, &mut buf);
                    call.set_sent(now);
                    st.frames_written += 1;
                }
                st.writes += u64::from(!buf.is_empty());
            }
            if buf.is_empty() {
                continue;
            }
            if let Err(e) = (&self.stream).write_all(&buf) {
                self.close_failed(&format!("write failed: {e}"), classify_io(&e));
                return;
            }
        }
    }

    fn reader_loop(&self, mut stream: ClientStream) {
        // Every read is offered at least `READ_CHUNK` bytes; what the
        // buffer holds beyond them is at most one incomplete reply, which
        // the decoder bounds.
        let cap = 2 * READ_CHUNK + max_reply_frame(self.max_key_bytes);
        let mut buf = ReadBuf::new(READ_CHUNK);
        loop {
            if !buf.make_room(READ_CHUNK, cap) {
                let why = "a reply longer than the longest the protocol allows";
                self.close_failed(why, (FailureKind::NotTicketd, why.into()));
                return;
            }
            match buf.read_from(&mut stream) {
                Ok(0) => {
                    let why = "connection closed by the server";
                    let cause = classify_reply(buf.data()).unwrap_or((
                        FailureKind::Closed,
                        "the server closed the connection".into(),
                    ));
                    self.close_failed(why, cause);
                    return;
                }
                Ok(_) => {}
                Err(e) => {
                    let cause = classify_reply(buf.data()).unwrap_or_else(|| classify_io(&e));
                    self.close_failed(&format!("read failed: {e}"), cause);
                    return;
                }
            }
            loop {
                match decode_reply(buf.data(), self.max_key_bytes) {
                    Decoded::Incomplete => break,
                    Decoded::Frame { frame, used } => {
                        if let Err(why) = self.deliver(frame) {
                            self.close_failed(why, (FailureKind::NotTicketd, why.into()));
                            return;
                        }
                        buf.consume(used);
                    }
                    Decoded::Malformed(m) => {
                        let why = format!("malformed reply from the server: {m}");
                        let cause = classify_reply(buf.data()).unwrap_or_else(|| {
                            (
                                FailureKind::NotTicketd,
                                format!("it answered bytes that are no ticketd reply ({m})"),
                            )
                        });
                        self.close_failed(&why, cause);
                        return;
                    }
                }
            }
        }
    }

    /// Hands a reply to the call it answers.
    fn deliver(&self, reply: Reply<'_>) -> Result<(), &'static str> {
        let mut st = lock(&self.state);
        match reply {
            Reply::Acquired { owner, key, .. }
            | Reply::Timeout { owner, key }
            | Reply::Busy { owner, key } => {
                let Some(call) = st.acquires.remove(&owner) else {
                    if let Reply::Acquired { token, key, .. } = reply {
                        // A grant nobody waits for: give it back at once
                        // rather than leaving the key held for a lease.
                        let call = Call::new(
                            Kind::Release { token },
                            Arc::from(key),
                            Plan::transport(Instant::now()),
                        );
                        st.queue.push_back(call);
                        self.writer_cv.notify_one();
                    }
                    return Ok(());
                };
                if *call.key != *key {
                    call.finish(Outcome::Lost);
                    return Err("reply key does not match the request");
                }
                call.answer(match reply {
                    Reply::Acquired { token, .. } => Answer::Acquired { token },
                    Reply::Timeout { .. } => Answer::Timeout,
                    _ => Answer::Busy,
                });
            }
            Reply::Released { token, key } | Reply::NotReleased { token, key } => {
                if let Some(call) = take_by_token(&mut st.releases, token, key) {
                    call.answer(if matches!(reply, Reply::Released { .. }) {
                        Answer::Released
                    } else {
                        Answer::NotReleased
                    });
                }
            }
            Reply::Extended { token, key } | Reply::NotExtended { token, key } => {
                if let Some(call) = take_by_token(&mut st.extends, token, key) {
                    call.answer(if matches!(reply, Reply::Extended { .. }) {
                        Answer::Extended
                    } else {
                        Answer::NotExtended
                    });
                }
            }
        }
        Ok(())
    }
}

/// Takes the oldest pending call of `token` on `key` out of `pending`, if
/// any; a reply nobody waits for (its call gave up) matches nothing.
fn take_by_token(
    pending: &mut HashMap<u64, Vec<Arc<Call>>>,
    token: u64,
    key: &str,
) -> Option<Arc<Call>> {
    let calls = pending.get_mut(&token)?;
    let i = calls.iter().position(|c| *c.key == *key)?;
    let call = calls.remove(i);
    if calls.is_empty() {
        pending.remove(&token);
    }
    Some(call)
}

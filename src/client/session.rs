//! One connection to a server: a [`Machine`] on the monotonic clock, which
//! decides everything PROTOCOL §3 asks (matching, deadlines, outcomes), and
//! the threads and waits that drive it: a writer thread hands the bytes the
//! machine gives out to the socket, a reader thread feeds it the replies,
//! and each caller waits for its own call's outcome, asking the machine to
//! decide ([`Session::tick`]) when the call's deadline comes.
//!
//! A call is queued in the machine until the writer takes it, under the
//! session's lock and *before* its bytes go to `write`: the conservative
//! reading of "may have been sent". When the session dies, the calls still
//! queued were never sent: they go back to their callers
//! ([`Waited::Moved`]), who try them on another session with the same owner
//! and the same deadlines.
//!
//! Every outcome the machine decides is taken for its caller's [`Waiter`]
//! under the session's lock, so "is it still queued?" has one answer for
//! the writer, the reader and the waiting caller; the waiter is woken once
//! the lock is let go.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use super::deadline::TRANSPORT_DEADLINE;
use super::failure::{classify_io, classify_reply, Failure, FailureKind};
use super::machine::{CallId, CloseCause, Decided, Held, Machine, Unsent};
use crate::client::transport::ClientStream;

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

/// What a waiting caller learns.
#[derive(Debug)]
pub(crate) enum Waited {
    /// The machine decided the call.
    Decided(Decided<Instant>),
    /// Never sent, and its session is gone: try it on another.
    Moved(Unsent<Instant>),
}

/// Told once, when a call ends, by whichever thread ends it (the reader,
/// the writer, a closing session): lets one thread watch many calls
/// without a thread waiting on each. It runs with the session's lock held,
/// so it must only hand the news on (a channel send), never block.
pub(crate) type OnDone = Box<dyn Fn() + Send + Sync>;

/// A call queued on a session: its id there, and where its outcome comes.
pub(crate) type Submitted = (CallId, Arc<Waiter>);

/// An outcome decided, for the waiter it goes to.
type Finished = (Arc<Waiter>, Waited);

/// Where a call's outcome is left for whoever waits for it.
pub(crate) struct Waiter {
    slot: Mutex<Option<Waited>>,
    cv: Condvar,
    on_done: Option<OnDone>,
}

impl Waiter {
    fn new(on_done: Option<OnDone>) -> Arc<Waiter> {
        Arc::new(Waiter {
            slot: Mutex::new(None),
            cv: Condvar::new(),
            on_done,
        })
    }

    fn finish(&self, w: Waited) {
        *lock(&self.slot) = Some(w);
        self.cv.notify_all();
        if let Some(f) = &self.on_done {
            f();
        }
    }

    /// The outcome, once it is in (taken: it is handed out once).
    pub(crate) fn take(&self) -> Option<Waited> {
        lock(&self.slot).take()
    }

    /// Waits for the outcome until `until`.
    fn wait_until(&self, until: Instant) -> Option<Waited> {
        let mut slot = lock(&self.slot);
        loop {
            if let Some(w) = slot.take() {
                return Some(w);
            }
            let now = Instant::now();
            if now >= until {
                return None;
            }
            slot = self
                .cv
                .wait_timeout(slot, until - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

struct State {
    machine: Machine<Instant>,
    /// The caller of each undecided call.
    waiters: HashMap<CallId, Arc<Waiter>>,
    /// Outcomes decided under the lock, handed to their waiters once it is
    /// let go ([`unlock`]): a waiter woken does not wait for the lock.
    done: Vec<Finished>,
    dead: bool,
    why: Option<String>,
    /// Why the connection failed, when it ended by no doing of the client.
    failure: Option<Failure>,
    /// Tests hold the writer to observe queued calls.
    writer_paused: bool,
    /// `write_all` calls so far.
    writes: u64,
}

/// A connection with its two threads.
pub(crate) struct Session {
    id: u64,
    /// The server address, for [`Failure`]s.
    peer: String,
    stream: ClientStream,
    state: Mutex<State>,
    writer_cv: Condvar,
    threads: Mutex<Vec<JoinHandle<()>>>,
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
            state: Mutex::new(State {
                // Owners come with the calls (the process's own), so the
                // machine's seed is never drawn from.
                machine: Machine::on_clock(0, max_key_bytes),
                waiters: HashMap::new(),
                done: Vec::new(),
                dead: false,
                why: None,
                failure: None,
                writer_paused: false,
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
        lock(&self.state).machine.handed_out()
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
        lock(&self.state).machine.queued_owners()
    }

    #[cfg(test)]
    pub(crate) fn pause_writer(&self, paused: bool) {
        lock(&self.state).writer_paused = paused;
        self.writer_cv.notify_all();
    }

    /// Queues `call` here, and waits for its outcome.
    pub(crate) fn run(&self, call: Unsent<Instant>) -> Waited {
        let first = call.send_deadline();
        match self.submit(call) {
            Ok((id, waiter)) => self.await_call(id, &waiter, first),
            Err(call) => Waited::Moved(*call),
        }
    }

    /// Queues `call` for the writer. `Err` with the call, untouched, if the
    /// session is already dead.
    fn submit(&self, call: Unsent<Instant>) -> Result<Submitted, Box<Unsent<Instant>>> {
        let mut st = lock(&self.state);
        if st.dead {
            return Err(Box::new(call));
        }
        let id = st.machine.adopt(call);
        let waiter = Waiter::new(None);
        st.waiters.insert(id, Arc::clone(&waiter));
        drop(st);
        self.writer_cv.notify_one();
        Ok((id, waiter))
    }

    /// Queues every call of `calls` at once, so the writer puts them in one
    /// write (as many as fit in one batch of its); each one's hook runs when
    /// it ends. `None`, the calls dropped, if the session is already dead.
    pub(crate) fn submit_all(
        &self,
        calls: Vec<(Unsent<Instant>, OnDone)>,
    ) -> Option<Vec<Submitted>> {
        let mut st = lock(&self.state);
        if st.dead {
            return None;
        }
        let mut ids = Vec::with_capacity(calls.len());
        for (call, on_done) in calls {
            let id = st.machine.adopt(call);
            let waiter = Waiter::new(Some(on_done));
            st.waiters.insert(id, Arc::clone(&waiter));
            ids.push((id, waiter));
        }
        drop(st);
        self.writer_cv.notify_one();
        Some(ids)
    }

    /// Waits for call `id` to end. Its first deadline is `first`; whenever
    /// a deadline of the call comes, the machine decides what is due
    /// ([`Session::tick`]) and says the next.
    fn await_call(&self, id: CallId, waiter: &Waiter, first: Instant) -> Waited {
        let mut next = Some(first);
        loop {
            // A call handed out after the wait began has deadlines of its
            // own, never sooner than the transport deadline from its write.
            let now = Instant::now();
            let limit = next.map_or(now, |t| t.min(now + TRANSPORT_DEADLINE));
            if let Some(w) = waiter.wait_until(limit) {
                return w;
            }
            next = self.tick(Instant::now(), id);
            if next.is_none() {
                if let Some(w) = waiter.take() {
                    return w;
                }
                // Decided meanwhile by another thread, which is handing
                // the outcome over.
                next = Some(Instant::now() + TRANSPORT_DEADLINE);
            }
        }
    }

    /// Lets the machine decide what is due at `now` (a call still queued at
    /// its send deadline is not sent; one that may have been sent and has
    /// no reply by its give-up closes this session), and returns the next
    /// deadline of call `id`, `None` once it has ended.
    pub(crate) fn tick(&self, now: Instant, id: CallId) -> Option<Instant> {
        let mut st = lock(&self.state);
        st.machine.handle_timeout(now);
        self.after_machine(&mut st, usize::MAX);
        let next = st.machine.deadline_of(id);
        unlock(st, &mut Vec::new());
        next
    }

    /// Gives `held` back: a release of that exact token on this session,
    /// nobody waiting for it. `false` if the session is dead.
    pub(crate) fn give_back(&self, held: &Held<Instant>) -> bool {
        let mut st = lock(&self.state);
        if st.dead {
            return false;
        }
        st.machine.give_back(Instant::now(), held);
        drop(st);
        self.writer_cv.notify_one();
        true
    }

    /// Hands every outcome the machine decided to its caller, and closes the
    /// session if the machine gave up on it; wakes the writer if more than
    /// `queued` calls wait for it now.
    fn after_machine(&self, st: &mut State, queued: usize) {
        dispatch(st);
        if st.machine.wants_close() {
            let (why, kind, detail) = match st.machine.take_close_cause() {
                Some(CloseCause::Malformed { reason, head }) => {
                    let (kind, detail) = classify_reply(&head).unwrap_or_else(|| {
                        (
                            FailureKind::NotTicketd,
                            format!("it answered bytes that are no ticketd reply ({reason})"),
                        )
                    });
                    (
                        format!("malformed reply from the server: {reason}"),
                        kind,
                        detail,
                    )
                }
                Some(CloseCause::WrongKey) => {
                    let why = "reply key does not match the request";
                    (why.to_owned(), FailureKind::NotTicketd, why.to_owned())
                }
                Some(CloseCause::NoReply) | None => (
                    "no reply by the deadline plus grace".to_owned(),
                    FailureKind::NoReply,
                    "no reply within the wait plus 1 s".to_owned(),
                ),
            };
            self.close_locked(st, &why, Some((kind, detail)));
        } else if st.machine.queued() > queued {
            // A grant given back.
            self.writer_cv.notify_one();
        }
    }

    /// Closes the session: calls that may have been sent are decided
    /// (Indeterminate; extends go back to their callers like the calls
    /// never sent), both threads end.
    pub(crate) fn close(&self, why: &str) {
        let mut st = lock(&self.state);
        self.close_locked(&mut st, why, None);
        unlock(st, &mut Vec::new());
    }

    /// Closes the session because the connection failed: `kind` and
    /// `detail` become its [`Failure`].
    fn close_failed(&self, why: &str, cause: (FailureKind, String)) {
        let mut st = lock(&self.state);
        self.close_locked(&mut st, why, Some(cause));
        unlock(st, &mut Vec::new());
    }

    fn close_locked(&self, st: &mut State, why: &str, cause: Option<(FailureKind, String)>) {
        if st.dead {
            return;
        }
        st.dead = true;
        st.why = Some(why.to_owned());
        if let Some((kind, detail)) = cause {
            st.failure = Some(Failure::new(self.peer.clone(), kind, detail));
        }
        st.machine.connection_lost();
        dispatch(st);
        for (id, call) in st.machine.take_unsent() {
            if let Some(w) = st.waiters.remove(&id) {
                st.done.push((w, Waited::Moved(call)));
            }
        }
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
        let mut spare = Vec::new();
        loop {
            {
                let mut st = lock(&self.state);
                loop {
                    if st.dead {
                        return;
                    }
                    if st.machine.queued() > 0 && !st.writer_paused {
                        break;
                    }
                    st = self
                        .writer_cv
                        .wait(st)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                // The wire wait is computed here, just before the write.
                buf.clear();
                st.machine
                    .transmit_at_most(Instant::now(), &mut buf, BATCH_BYTES);
                // Calls past their send deadline were dropped unsent.
                dispatch(&mut st);
                st.writes += u64::from(!buf.is_empty());
                unlock(st, &mut spare);
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
        let mut chunk = vec![0u8; READ_CHUNK];
        let mut spare = Vec::new();
        loop {
            let n = match stream.read(&mut chunk) {
                Ok(0) => {
                    let mut st = lock(&self.state);
                    let cause = classify_reply(st.machine.unparsed()).unwrap_or((
                        FailureKind::Closed,
                        "the server closed the connection".into(),
                    ));
                    self.close_locked(&mut st, "connection closed by the server", Some(cause));
                    unlock(st, &mut spare);
                    return;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let mut st = lock(&self.state);
                    let cause =
                        classify_reply(st.machine.unparsed()).unwrap_or_else(|| classify_io(&e));
                    self.close_locked(&mut st, &format!("read failed: {e}"), Some(cause));
                    unlock(st, &mut spare);
                    return;
                }
            };
            let mut st = lock(&self.state);
            let queued = st.machine.queued();
            st.machine.receive(Instant::now(), &chunk[..n]);
            self.after_machine(&mut st, queued);
            let dead = st.dead;
            unlock(st, &mut spare);
            if dead {
                return;
            }
        }
    }
}

/// Takes every outcome the machine decided, for its caller.
fn dispatch(st: &mut State) {
    while let Some(d) = st.machine.poll_decided() {
        if let Some(w) = st.waiters.remove(&d.id) {
            st.done.push((w, Waited::Decided(d)));
        }
    }
}

/// Lets the session's lock go, then hands the outcomes decided under it to
/// their waiters. `spare` is an empty list kept by the caller, swapped
/// with the session's so that neither allocates again.
fn unlock(mut st: MutexGuard<'_, State>, spare: &mut Vec<Finished>) {
    std::mem::swap(&mut st.done, spare);
    drop(st);
    for (w, outcome) in spare.drain(..) {
        w.finish(outcome);
    }
}

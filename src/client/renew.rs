//! The renewer: one thread per [`Client`] that keeps all its kept tickets
//! alive, coalescing their renewals (PROTOCOL §5.3).
//!
//! A kept ticket is due for renewal a third of its lease after the write
//! of the extend (or acquire) that its latest `E` answered. When the
//! earliest kept ticket is due, every kept ticket of the client that is due
//! within a sixth of its own lease is renewed with it: their `E` frames go
//! to one session in one go, so the writer hands them to the socket in as
//! few writes as its batch size allows, and the server reads, handles and
//! answers them in one loop turn. A ticket so renewed early is renewed
//! between a sixth and a third of its lease after its previous extend, never
//! later; tickets kept alive together soon share one renewal round, which is
//! what makes 100,000 kept tickets cheap for the server.
//!
//! Each extend is its own call of a session's machine, as a single
//! [`Client::extend_call`] attempt is, matched by token and key as any other,
//! and every rule of a single extend holds for each ticket of a batch: the
//! expiry moves only on a matched `E` (to that attempt's write time plus the
//! lease), an attempt that gets no answer within the transport deadline
//! closes its session and is sent again on another, never past the ticket's
//! renewal deadline (a tenth of the lease before its conservative expiry);
//! `X`, or that deadline passing, marks the ticket lost at once.
//!
//! The thread waits on a channel: kept tickets arriving, holders stopping
//! theirs, and calls ending (each call runs a hook that sends its ticket's
//! id). It starts with the first kept ticket and ends when the last one is
//! gone, so a client with nothing kept alive has no renewer.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::deadline::TRANSPORT_DEADLINE;
use super::machine::{CallId, ExtendOutcome, Outcome, Unsent};
use super::session::{lock, OnDone, Session, Waited, Waiter};
use super::Client;

/// First pause before a failed attempt is sent again; doubles up to
/// [`MAX_RETRY_PAUSE`] (the same pacing as a single extend's retries).
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(10);
const MAX_RETRY_PAUSE: Duration = Duration::from_millis(500);

static NEXT_KEPT_ID: AtomicU64 = AtomicU64::new(1);

/// When a ticket renewed at `written_at` with `lease` is due again.
#[must_use]
pub fn renew_at(written_at: Instant, lease: Duration) -> Instant {
    written_at + lease / 3
}

/// The coalescing slack: a ticket due by `now + slack(lease)` is renewed
/// with one that is due at `now`.
#[must_use]
pub fn slack(lease: Duration) -> Duration {
    lease / 6
}

/// The renewal deadline of a ticket whose conservative expiry is
/// `expires_at`: with no `E` by then it is reported lost, while a tenth of
/// its lease still runs.
#[must_use]
pub fn renewal_deadline(expires_at: Instant, lease: Duration) -> Instant {
    expires_at - lease / 10
}

/// What the renewer and a holder share about one kept ticket.
#[derive(Debug)]
pub(crate) struct KeptState {
    pub(crate) expires_at: Instant,
    pub(crate) lease: Duration,
    pub(crate) lost: bool,
    /// Set by release or drop: no attempt is started after this one.
    pub(crate) stop: bool,
    /// Set by drop: the renewer releases the lock as it lets the ticket go.
    pub(crate) release_on_stop: bool,
    /// The renewer has let the ticket go (or never took it); set under the
    /// lock, so drop knows whether the renewer will release or it must.
    pub(crate) exited: bool,
}

/// A kept ticket's state and the condition its holder waits on.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) state: Mutex<KeptState>,
    pub(crate) cv: Condvar,
}

/// One kept ticket, as handed to the renewer.
pub(crate) struct Kept {
    pub(crate) id: u64,
    pub(crate) key: Arc<str>,
    pub(crate) token: u64,
    pub(crate) shared: Arc<Shared>,
}

impl Kept {
    pub(crate) fn new(key: Arc<str>, token: u64, shared: Arc<Shared>) -> Kept {
        Kept {
            id: NEXT_KEPT_ID.fetch_add(1, Ordering::Relaxed),
            key,
            token,
            shared,
        }
    }
}

/// What the renewer thread is told.
pub(crate) enum Msg {
    /// Keep this ticket alive.
    Add(Kept),
    /// The holder of this ticket set `stop`.
    Stop(u64),
    /// The call in flight for this ticket ended.
    Done(u64),
}

/// The client's handle on its renewer thread.
#[derive(Default)]
pub(crate) struct Renewer {
    /// The thread's channel while it runs. Sent to under this lock, and the
    /// thread clears it under this lock once it has nothing left, so no
    /// message is ever sent to a thread that is ending.
    tx: Mutex<Option<Sender<Msg>>>,
}

impl Renewer {
    /// Hands `kept` to the renewer, starting its thread if none runs.
    /// `false` if no thread could be started (nothing renews the ticket).
    pub(crate) fn add(&self, client: &Client, kept: Kept) -> bool {
        let mut tx = lock(&self.tx);
        let kept = match tx.as_ref() {
            None => kept,
            Some(t) => match t.send(Msg::Add(kept)) {
                Ok(()) => return true,
                // A thread that died (never expected): start another.
                Err(mpsc::SendError(Msg::Add(k))) => k,
                Err(_) => return false,
            },
        };
        let (t, rx) = mpsc::channel();
        let _ = t.send(Msg::Add(kept));
        let c = client.clone();
        let me = t.clone();
        let spawned = std::thread::Builder::new()
            .name("ticket-renewer".into())
            .spawn(move || Loop::new(c, rx, me).run());
        *tx = spawned.is_ok().then_some(t);
        spawned.is_ok()
    }

    /// Whether the renewer thread runs.
    #[cfg(test)]
    pub(crate) fn running(&self) -> bool {
        lock(&self.tx).is_some()
    }

    /// Tells the renewer that the holder of ticket `id` stopped it.
    pub(crate) fn stop(&self, id: u64) {
        if let Some(t) = lock(&self.tx).as_ref() {
            let _ = t.send(Msg::Stop(id));
        }
    }
}

/// One kept ticket inside the renewer.
struct Entry {
    key: Arc<str>,
    token: u64,
    shared: Arc<Shared>,
    lease: Duration,
    /// The current round's renewal deadline.
    until: Instant,
    /// When it is due (renewal or retry), while idle: its key in `due`.
    next_at: Option<Instant>,
    /// The attempt in flight: its session, its call there, and its key in
    /// `timers`.
    attempt: Option<Attempt>,
    /// Pause before the next retry of this round.
    retry_pause: Duration,
}

/// One extend of a kept ticket, queued on a session.
struct Attempt {
    session: Arc<Session>,
    id: CallId,
    waiter: Arc<Waiter>,
    /// When to look at it next: its deadline, or the transport deadline.
    timer: Instant,
}

/// How one attempt ended.
enum Ended {
    /// `E`: the grant now expires at this time.
    Extended(Instant),
    /// `X`: the grant is gone.
    Refused,
    /// No answer in time, or not sent at all.
    NoAnswer,
}

impl From<Waited> for Ended {
    fn from(w: Waited) -> Ended {
        match w {
            Waited::Decided(d) => match d.outcome {
                Outcome::Extend(ExtendOutcome::Extended(held)) => Ended::Extended(held.expires_at),
                _ if d.refused => Ended::Refused,
                _ => Ended::NoAnswer,
            },
            Waited::Moved(_) => Ended::NoAnswer,
        }
    }
}

/// The renewer thread's state.
struct Loop {
    client: Client,
    rx: Receiver<Msg>,
    /// Cloned into every call's hook.
    me: Sender<Msg>,
    entries: HashMap<u64, Entry>,
    /// Idle entries by the time they are due.
    due: BTreeSet<(Instant, u64)>,
    /// Entries in flight by their attempt's give-up time.
    timers: BTreeSet<(Instant, u64)>,
}

impl Loop {
    fn new(client: Client, rx: Receiver<Msg>, me: Sender<Msg>) -> Loop {
        Loop {
            client,
            rx,
            me,
            entries: HashMap::new(),
            due: BTreeSet::new(),
            timers: BTreeSet::new(),
        }
    }

    fn run(mut self) {
        loop {
            let msg = match self.next_wake() {
                Some(at) => match self
                    .rx
                    .recv_timeout(at.saturating_duration_since(Instant::now()))
                {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                },
                None if self.entries.is_empty() => match self.quit_or_next() {
                    Some(m) => Some(m),
                    None => return,
                },
                None => match self.rx.recv() {
                    Ok(m) => Some(m),
                    Err(_) => return,
                },
            };
            if let Some(m) = msg {
                self.handle(m);
            }
            // Everything already waiting, before acting on the clock: the
            // answers of a batch come in bursts.
            while let Ok(m) = self.rx.try_recv() {
                self.handle(m);
            }
            let now = Instant::now();
            self.expire_attempts(now);
            self.send_due(now);
        }
    }

    fn next_wake(&self) -> Option<Instant> {
        let due = self.due.first().map(|&(t, _)| t);
        let timer = self.timers.first().map(|&(t, _)| t);
        match (due, timer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// With nothing kept: ends the thread (`None`), unless a message came
    /// meanwhile. Decided under the client's lock on the channel.
    fn quit_or_next(&self) -> Option<Msg> {
        let renewer = &self.client.inner.renewer;
        let mut tx = lock(&renewer.tx);
        match self.rx.try_recv() {
            Ok(m) => Some(m),
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => {
                *tx = None;
                None
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Add(k) => self.add(k),
            Msg::Stop(id) => {
                if self.entries.get(&id).is_some_and(|e| e.attempt.is_none()) {
                    self.let_go(id, false);
                }
            }
            Msg::Done(id) => {
                let outcome = self
                    .entries
                    .get(&id)
                    .and_then(|e| e.attempt.as_ref())
                    .and_then(|a| a.waiter.take());
                if let Some(w) = outcome {
                    self.settle(id, w.into());
                }
            }
        }
    }

    fn add(&mut self, k: Kept) {
        let (expires_at, lease, stop) = {
            let st = lock(&k.shared.state);
            (st.expires_at, st.lease, st.stop)
        };
        let entry = Entry {
            key: k.key,
            token: k.token,
            shared: k.shared,
            lease,
            until: renewal_deadline(expires_at, lease),
            next_at: None,
            attempt: None,
            retry_pause: Duration::ZERO,
        };
        self.entries.insert(k.id, entry);
        if stop {
            self.let_go(k.id, false);
        } else {
            self.schedule(k.id, renew_at(expires_at - lease, lease));
        }
    }

    fn schedule(&mut self, id: u64, at: Instant) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.next_at = Some(at);
            self.due.insert((at, id));
        }
    }

    /// Ends `id`'s attempt in flight with `w`.
    fn settle(&mut self, id: u64, w: Ended) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        let Some(a) = e.attempt.take() else {
            return;
        };
        self.timers.remove(&(a.timer, id));
        self.conclude(id, w);
    }

    /// What an attempt's end `w` means for ticket `id`: its expiry moves
    /// on an `E`; `X` or its deadline passing loses it; otherwise it is
    /// sent again (after a pause) unless its holder stopped it.
    fn conclude(&mut self, id: u64, w: Ended) {
        let now = Instant::now();
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        let (lease, until) = (e.lease, e.until);
        match w {
            // An E matched at or after the deadline counted for nothing (the
            // machine's rule): the holder may already have been told the
            // ticket is lost.
            Ended::Extended(expires_at) => {
                let written_at = expires_at - lease;
                let stop = {
                    let mut st = lock(&e.shared.state);
                    st.expires_at = expires_at;
                    st.stop
                };
                e.shared.cv.notify_all();
                e.until = renewal_deadline(expires_at, lease);
                e.retry_pause = Duration::ZERO;
                if stop {
                    self.let_go(id, false);
                } else {
                    self.schedule(id, renew_at(written_at, lease));
                }
            }
            Ended::Refused => self.let_go(id, true),
            // No answer in time: sent again, before the deadline, unless
            // the holder stopped it meanwhile.
            Ended::NoAnswer => {
                let stop = lock(&e.shared.state).stop;
                if now >= until {
                    self.let_go(id, true);
                } else if stop {
                    self.let_go(id, false);
                } else {
                    let at = (now + e.retry_pause).min(until);
                    e.retry_pause = (e.retry_pause * 2).clamp(FIRST_RETRY_PAUSE, MAX_RETRY_PAUSE);
                    self.schedule(id, at);
                }
            }
        }
    }

    /// Lets ticket `id` go: lost or not, it is renewed no more. Releases
    /// the lock if its holder dropped it.
    fn let_go(&mut self, id: u64, lost: bool) {
        let Some(e) = self.entries.remove(&id) else {
            return;
        };
        if let Some(at) = e.next_at {
            self.due.remove(&(at, id));
        }
        if let Some(a) = e.attempt {
            self.timers.remove(&(a.timer, id));
        }
        let release = {
            let mut st = lock(&e.shared.state);
            st.lost |= lost;
            st.exited = true;
            st.stop && st.release_on_stop
        };
        e.shared.cv.notify_all();
        if release {
            self.client
                .release_in_background(e.key.to_string(), e.token);
        }
    }

    /// Attempts whose deadline came: the machine decides what is due (an
    /// extend still queued at the ticket's deadline is not sent; one sent
    /// with no answer by its transport deadline closes its session).
    fn expire_attempts(&mut self, now: Instant) {
        while let Some(&(t, id)) = self.timers.first() {
            if t > now {
                return;
            }
            self.timers.remove(&(t, id));
            let Some(a) = self.entries.get_mut(&id).and_then(|e| e.attempt.as_mut()) else {
                continue;
            };
            let next = match a.waiter.take() {
                Some(w) => Err(w),
                None => match a.session.tick(now, a.id) {
                    Some(next) => Ok(next.min(now + TRANSPORT_DEADLINE)),
                    None => match a.waiter.take() {
                        Some(w) => Err(w),
                        None => Ok(now + TRANSPORT_DEADLINE),
                    },
                },
            };
            match next {
                Err(w) => {
                    a.timer = now;
                    self.settle(id, w.into());
                }
                // Not decided yet: look again at its next deadline.
                Ok(later) => {
                    a.timer = later;
                    self.timers.insert((later, id));
                }
            }
        }
    }

    /// If a ticket is due, sends it with every ticket due within its slack,
    /// in one go on one session.
    fn send_due(&mut self, now: Instant) {
        match self.due.first() {
            Some(&(t, _)) if t <= now => {}
            _ => return,
        }
        let horizon = now + slack(super::deadline::MAX_LEASE);
        let batch: Vec<u64> = self
            .due
            .range(..(horizon, u64::MAX))
            .filter(|&&(t, id)| {
                self.entries
                    .get(&id)
                    .is_some_and(|e| t <= now + slack(e.lease))
            })
            .map(|&(_, id)| id)
            .collect();
        let mut calls: Vec<(Unsent<Instant>, OnDone)> = Vec::with_capacity(batch.len());
        let mut ids = Vec::with_capacity(batch.len());
        let mut send_by = horizon;
        for &id in &batch {
            let Some(e) = self.entries.get_mut(&id) else {
                continue;
            };
            if let Some(at) = e.next_at.take() {
                self.due.remove(&(at, id));
            }
            let Ok(call) = Unsent::extend(now, &e.key, e.token, e.lease, e.until) else {
                // A lease that was granted is a valid one: never here.
                self.let_go(id, true);
                continue;
            };
            send_by = send_by.min((now + TRANSPORT_DEADLINE).min(call.send_deadline()));
            let me = self.me.clone();
            let hook: OnDone = Box::new(move || {
                let _ = me.send(Msg::Done(id));
            });
            calls.push((call, hook));
            ids.push(id);
        }
        // Never blocked past an attempt already in flight running out.
        if let Some(&(t, _)) = self.timers.first() {
            send_by = send_by.min(t);
        }
        let session = self.client.inner.pool.get(send_by);
        let queued = session.as_ref().and_then(|s| s.submit_all(calls));
        let (Some(session), Some(queued)) = (session, queued) else {
            // Not queued anywhere: retried like an unsent call.
            for id in ids {
                self.conclude(id, Ended::NoAnswer);
            }
            return;
        };
        for (id, (call, waiter)) in ids.into_iter().zip(queued) {
            let Some(e) = self.entries.get_mut(&id) else {
                continue;
            };
            let timer = (now + TRANSPORT_DEADLINE).min(e.until);
            e.attempt = Some(Attempt {
                session: Arc::clone(&session),
                id: call,
                waiter,
                timer,
            });
            self.timers.insert((timer, id));
        }
    }
}

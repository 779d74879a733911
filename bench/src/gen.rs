//! The load generator: one `mio` loop per thread drives many connections.
//!
//! Each connection carries `depth` independent *slots*; a slot is one lock
//! user with at most one request in flight, so `depth` is the pipeline depth.
//! A slot's life depends on the mode:
//!
//! * `acquire`: acquire a key, forget it, acquire the next.
//! * `cycle`: acquire a key, release it as soon as it is granted, repeat.
//! * `contended`: like `cycle` on a few hot keys with a wait > 0. ticketd
//!   queues the waiter and answers when it is granted; Redis has no queue,
//!   so the slot polls (`SET NX` again every `poll_ms`) until its wait runs out.
//! * `extend` (ticketd only): a slot is one held lock. It acquires its own
//!   key once, then extends it every `lease / 3` (the client's keep-alive
//!   pace), the first extend at a random point of that interval so that the
//!   locks' renewals are spread evenly, as independent clients' are. A
//!   connection carries `locks / connections` slots. Each connection renews
//!   its locks as one official client renews its kept tickets
//!   (`ticketd::client::KeptTicket`): when one is due, every lock of the
//!   connection due within `lease / 6` is extended with it, in the same
//!   write, so a lock is renewed between `lease / 6` and `lease / 3` after
//!   its previous extend. `Renew::Single` instead extends each lock on its
//!   own when it is due (one round trip per extend, as a client with a
//!   renewal thread per lock did).
//! * `extend-flood` (ticketd only): acquire a key once, then extend it again
//!   as soon as each extend is answered, `depth` slots per connection.
//!
//! Requests are written once per loop turn per connection (pipelined), and
//! time is read once per loop turn: latencies have the resolution of a turn,
//! which is what a pipelining client observes anyway.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token};

use super::backend::{Backend, Outcome};
use super::{READ_BUFFER_CAP_BYTES, READ_CHUNK_BYTES};
use ticketd::readbuf::ReadBuf;

mod keys;
mod stats;

pub use keys::{fresh_key, hot_key};
use keys::{next_rand, run_nonce, set_key};
pub use stats::{fifo_violations, GrantRecord, Stats};

/// Every key the generator makes is this long (the 24-byte keys).
pub const KEY_BYTES: usize = 24;

/// What the slots do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Acquire and never release.
    Acquire,
    /// Acquire, then release at once.
    Cycle,
    /// Acquire with a wait on hot keys, release, repeat.
    Contended,
    /// Hold one key per slot and extend it every `lease / 3`.
    Extend,
    /// Hold one key per slot and extend it back to back.
    ExtendFlood,
}

impl Mode {
    /// True for the modes that hold their keys and extend them.
    #[must_use]
    pub fn extends(self) -> bool {
        matches!(self, Mode::Extend | Mode::ExtendFlood)
    }
}

/// How `extend` mode paces the renewals of one connection's locks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renew {
    /// As the official client: with the one that is due, every lock due
    /// within `lease / 6`.
    Coalesced,
    /// Each lock on its own, when it is due.
    Single,
}

/// Which keys the slots use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keys {
    /// A fresh key for every acquire: no two requests ever meet.
    Uncontended,
    /// `n` hot keys. In `contended` mode connection `i` always uses key
    /// `i % n` (a steady number of waiters per key); otherwise every acquire
    /// picks one at random.
    Hot(u32),
}

/// Everything a run needs.
#[derive(Clone, Debug)]
pub struct Config {
    /// The servers: connection `i` goes to `addrs[i % addrs.len()]` (one
    /// address for a single server, every node's for a cluster). Never
    /// empty unless `unix` is set.
    pub addrs: Vec<SocketAddr>,
    /// Dial this Unix-domain stream socket instead of `addrs` (`--server
    /// unix:/path`; ticketd and Redis, no TLS).
    pub unix: Option<std::path::PathBuf>,
    /// Connections, over all threads.
    pub connections: usize,
    /// Slots (requests in flight) per connection; in `extend` mode each
    /// connection has its share of `locks` instead.
    pub depth: usize,
    /// Held locks in `extend` mode, spread evenly over the connections.
    pub locks: usize,
    /// Key space.
    pub keys: Keys,
    /// What slots do.
    pub mode: Mode,
    /// Wait sent with each acquire (ticketd), or polled for (Redis).
    pub wait_s: u8,
    /// Lease of each grant.
    pub lease_s: u8,
    /// Between two polls of a Redis waiter.
    pub poll_ms: u64,
    /// Generator threads, each with its own loop and share of connections.
    pub threads: usize,
    /// Stop starting acquires once this many requests were sent, and end the
    /// run when every request has its reply.
    pub requests: Option<u64>,
    /// How `extend` mode paces its renewals.
    pub renew: Renew,
    /// Speak TLS (`--tls-ca`).
    pub tls: Option<crate::tls::Tls>,
}

/// State shared between the worker threads and the thread that times the run.
#[derive(Debug)]
pub struct Shared {
    /// Set when the warm-up ends: workers reset their statistics.
    pub measuring: AtomicBool,
    /// Set when the run ends.
    pub stop: AtomicBool,
    /// Requests sent so far (for the progress line).
    pub sent: AtomicU64,
    /// Grants received so far (for the progress line).
    pub grants: AtomicU64,
    /// Requests still allowed when the run is bounded by a count.
    pub budget: AtomicI64,
    /// Workers that have finished.
    pub done: AtomicU64,
}

impl Shared {
    /// Fresh shared state for a run bounded by `requests` if given.
    #[must_use]
    pub fn new(requests: Option<u64>) -> Shared {
        Shared {
            measuring: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sent: AtomicU64::new(0),
            grants: AtomicU64::new(0),
            budget: AtomicI64::new(requests.map_or(i64::MAX, |r| r.min(i64::MAX as u64) as i64)),
            done: AtomicU64::new(0),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    /// Wants to send an acquire (`retry`: of the same key, same first try).
    NeedAcquire { retry: bool },
    /// Acquire in flight.
    Acquiring,
    /// Wants to send a release of `token`.
    NeedRelease,
    /// Release in flight.
    Releasing,
    /// Wants to send an extend of `token`.
    NeedExtend,
    /// Extend in flight.
    Extending,
    /// Waiting for the timer heap (a Redis poll, or the next extend).
    Sleeping,
    /// Out of request budget.
    Idle,
}

#[derive(Clone, Debug)]
struct Slot {
    state: SlotState,
    key: String,
    key_index: u32,
    owner: u64,
    token: u64,
    first_try_ns: u64,
    sent_ns: u64,
    /// When the FIFO probe behind the current acquire was answered.
    queued_ns: u64,
    /// While sleeping: when it wakes (a heap entry that does not match is
    /// stale: the slot was woken early, with a batch).
    due_ns: u64,
}

/// What a request in flight asked for, and so which replies answer it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Acquire,
    Release,
    Extend,
}

impl Kind {
    fn of(outcome: &Outcome) -> Kind {
        match outcome {
            Outcome::Granted { .. } | Outcome::NotGranted { .. } | Outcome::Busy { .. } => {
                Kind::Acquire
            }
            Outcome::Released { .. } | Outcome::NotReleased { .. } => Kind::Release,
            Outcome::Extended { .. } | Outcome::NotExtended { .. } => Kind::Extend,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    slot: u16,
    kind: Kind,
    /// Owner of an acquire (and of the acquire a probe follows), token of
    /// a release or an extend: what the reply names.
    id: u64,
    sent_ns: u64,
    /// A FIFO probe: a release of token 0, which never matches (tokens are
    /// never 0), sent right behind an acquire; its `N` proves the acquire
    /// was processed.
    probe: bool,
}

struct Conn {
    stream: crate::tls::Stream,
    id: u64,
    /// Received and not yet decoded.
    input: ReadBuf,
    wbuf: Vec<u8>,
    wpos: usize,
    want_write: bool,
    outstanding: VecDeque<Pending>,
    slots: Vec<Slot>,
    ready: Vec<u16>,
    owner_seq: u64,
    key_seq: u64,
}

struct Worker<'a, B: Backend> {
    b: &'a B,
    cfg: &'a Config,
    shared: &'a Shared,
    base: Instant,
    conns: Vec<Conn>,
    sleepers: BinaryHeap<Reverse<(u64, u32, u16)>>,
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
    stats: Stats,
    measuring: bool,
    rng: u64,
    outstanding: usize,
    sent_unpublished: u64,
    grants_unpublished: u64,
}

impl<B: Backend> Worker<'_, B> {
    fn now_ns(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    fn mark(&mut self, c: usize) {
        if !self.is_dirty[c] {
            self.is_dirty[c] = true;
            self.dirty.push(c as u32);
        }
    }

    /// Encodes whatever the connection's ready slots want to send.
    // Long because it is one request per slot state, in one loop.
    fn fill(&mut self, c: usize, now: u64) {
        let b = self.b;
        let cfg = self.cfg;
        let conn = &mut self.conns[c];
        while let Some(s) = conn.ready.pop() {
            let slot = &mut conn.slots[s as usize];
            match slot.state {
                SlotState::NeedAcquire { retry } => {
                    if self.shared.budget.fetch_sub(1, Ordering::Relaxed) <= 0 {
                        slot.state = SlotState::Idle;
                        continue;
                    }
                    if !retry {
                        slot.first_try_ns = now;
                        next_key(cfg, conn.id, &mut conn.key_seq, &mut self.rng, slot);
                    } else {
                        self.stats.polls += u64::from(self.measuring);
                    }
                    conn.owner_seq += 1;
                    slot.owner = (conn.id << 40) | (conn.owner_seq & ((1 << 40) - 1));
                    slot.sent_ns = now;
                    slot.queued_ns = u64::MAX;
                    let wait_s = if b.queues_waiters() { cfg.wait_s } else { 0 };
                    b.encode_acquire(&mut conn.wbuf, &slot.key, slot.owner, wait_s, cfg.lease_s);
                    slot.state = SlotState::Acquiring;
                    conn.outstanding.push_back(Pending {
                        slot: s,
                        kind: Kind::Acquire,
                        id: slot.owner,
                        sent_ns: now,
                        probe: false,
                    });
                    if cfg.mode == Mode::Contended && b.fifo_probe() {
                        b.encode_release(&mut conn.wbuf, &slot.key, 0);
                        conn.outstanding.push_back(Pending {
                            slot: s,
                            kind: Kind::Release,
                            id: slot.owner,
                            sent_ns: now,
                            probe: true,
                        });
                        self.outstanding += 1;
                    }
                }
                SlotState::NeedRelease => {
                    // A release is always sent (never leave a lock behind),
                    // but it counts against the budget like any request.
                    self.shared.budget.fetch_sub(1, Ordering::Relaxed);
                    b.encode_release(&mut conn.wbuf, &slot.key, slot.token);
                    slot.state = SlotState::Releasing;
                    conn.outstanding.push_back(Pending {
                        slot: s,
                        kind: Kind::Release,
                        id: slot.token,
                        sent_ns: now,
                        probe: false,
                    });
                }
                SlotState::NeedExtend => {
                    if self.shared.budget.fetch_sub(1, Ordering::Relaxed) <= 0 {
                        slot.state = SlotState::Idle;
                        continue;
                    }
                    b.encode_extend(&mut conn.wbuf, &slot.key, slot.token, cfg.lease_s);
                    slot.state = SlotState::Extending;
                    slot.sent_ns = now;
                    conn.outstanding.push_back(Pending {
                        slot: s,
                        kind: Kind::Extend,
                        id: slot.token,
                        sent_ns: now,
                        probe: false,
                    });
                }
                _ => continue,
            }
            self.outstanding += 1;
            self.sent_unpublished += 1;
        }
    }

    /// Writes until the buffer is empty or the socket is full.
    fn flush(&mut self, c: usize, poll: &Poll) -> io::Result<()> {
        let conn = &mut self.conns[c];
        while conn.wpos < conn.wbuf.len() {
            match conn.stream.write(&conn.wbuf[conn.wpos..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => conn.wpos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let leftover = conn.wpos < conn.wbuf.len();
        if !leftover {
            conn.wbuf.clear();
            conn.wpos = 0;
        }
        super::set_write_interest(
            poll.registry(),
            conn.stream.socket(),
            Token(c),
            &mut conn.want_write,
            leftover,
        )
    }

    /// Reads until the socket is empty and handles every complete reply.
    ///
    /// A short read means the socket's receive queue was emptied, and with
    /// edge-triggered epoll (Linux) any byte that arrives later raises a new
    /// edge, so the read that would only say `WouldBlock` is skipped: one
    /// system call less per reply, for every backend alike. `drain` (the
    /// event reported a close or an error, whose edge will not come again)
    /// reads on until `WouldBlock` or the end of the stream.
    fn read(&mut self, c: usize, now: u64, drain: bool) -> Result<(), String> {
        loop {
            let conn = &mut self.conns[c];
            if !conn
                .input
                .make_room(READ_CHUNK_BYTES, READ_BUFFER_CAP_BYTES)
            {
                return Err(format!(
                    "the server sent a reply over {READ_BUFFER_CAP_BYTES} bytes"
                ));
            }
            let offered = conn.input.spare_len();
            let r = conn.stream.read(conn.input.spare());
            match r {
                Ok(0) => {
                    // ticketd closes a connection whose request it cannot
                    // answer (a cluster node that caught up by snapshot
                    // past it): those requests' outcomes are unknown.
                    let n = conn.outstanding.len();
                    return Err(format!(
                        "the server closed a connection with {n} request(s) unanswered \
                         (their outcome is unknown)"
                    ));
                }
                Ok(n) => {
                    conn.input.filled(n);
                    // Read the clock after the read: every byte it returned
                    // was produced by the server before this moment, which
                    // the FIFO check relies on.
                    let now = self.now_ns().max(now);
                    self.handle_replies(c, now)?;
                    if n < offered && !drain {
                        return Ok(());
                    }
                }
                Err(e) => match e.kind() {
                    io::ErrorKind::WouldBlock => return Ok(()),
                    io::ErrorKind::Interrupted => {}
                    _ => return Err(format!("reading from the server: {e}")),
                },
            }
        }
    }

    fn handle_replies(&mut self, c: usize, now: u64) -> Result<(), String> {
        loop {
            let conn = &mut self.conns[c];
            let Some((outcome, used)) = self.b.decode(conn.input.data())? else {
                break;
            };
            conn.input.consume(used);
            self.on_reply(c, outcome, now)?;
        }
        Ok(())
    }

    fn take_pending(&mut self, c: usize, outcome: &Outcome) -> Result<Pending, String> {
        let conn = &mut self.conns[c];
        let kind = Kind::of(outcome);
        let id = match *outcome {
            Outcome::Granted { owner, .. }
            | Outcome::NotGranted { owner }
            | Outcome::Busy { owner } => owner,
            Outcome::Released { token }
            | Outcome::NotReleased { token }
            | Outcome::Extended { token }
            | Outcome::NotExtended { token } => token,
        };
        let pos = match id {
            // Ordered backends name nothing: the oldest request is answered.
            None => (!conn.outstanding.is_empty()).then_some(0),
            // Probes are all alike and answered at once, so in order.
            Some(0) if kind == Kind::Release => conn.outstanding.iter().position(|p| p.probe),
            Some(id) => conn
                .outstanding
                .iter()
                .position(|p| p.kind == kind && !p.probe && p.id == id),
        };
        let Some(p) = pos.and_then(|i| conn.outstanding.remove(i)) else {
            return Err(format!("a reply matches no request in flight: {outcome:?}"));
        };
        if p.kind != kind {
            return Err(format!("reply {outcome:?} to the wrong kind of request"));
        }
        self.outstanding -= 1;
        Ok(p)
    }

    /// Handles one reply: its request leaves the in-flight list, the reply
    /// is counted, and its slot moves on, to the ready list or, asleep, to
    /// the timer heap.
    fn on_reply(&mut self, c: usize, outcome: Outcome, now: u64) -> Result<(), String> {
        let p = self.take_pending(c, &outcome)?;
        if p.probe {
            self.on_probe(c, &p, now);
            return Ok(());
        }
        let m = self.measuring;
        if m {
            self.stats.replies += 1;
            // An extend run reports the latency of its extends only: its
            // acquires are a one-off set-up.
            if !self.cfg.mode.extends() || p.kind == Kind::Extend {
                self.stats.latency.record(now.saturating_sub(p.sent_ns));
            }
        }
        let (state, sleep_until) = match outcome {
            Outcome::Granted { token, .. } => self.on_granted(c, p.slot, token, now),
            Outcome::NotGranted { .. } => self.on_not_granted(c, p.slot, now),
            Outcome::Busy { .. } => {
                if m {
                    self.stats.busy += 1;
                }
                (SlotState::NeedAcquire { retry: false }, None)
            }
            Outcome::Released { .. } | Outcome::NotReleased { .. } => {
                if m {
                    if matches!(outcome, Outcome::Released { .. }) {
                        self.stats.released += 1;
                    } else {
                        self.stats.not_released += 1;
                    }
                }
                (SlotState::NeedAcquire { retry: false }, None)
            }
            Outcome::Extended { .. } => {
                if m {
                    self.stats.extended += 1;
                }
                if self.cfg.mode == Mode::Extend {
                    // Paced like the client's keep-alive: lease / 3 after the
                    // previous extend was written.
                    let due = p.sent_ns + extend_interval_ns(self.cfg.lease_s);
                    (SlotState::Sleeping, Some(due))
                } else {
                    (SlotState::NeedExtend, None)
                }
            }
            Outcome::NotExtended { .. } => {
                // The lock is gone (counted as a failure): take a fresh one.
                if m {
                    self.stats.not_extended += 1;
                }
                (SlotState::NeedAcquire { retry: false }, None)
            }
        };
        self.conns[c].slots[p.slot as usize].state = state;
        self.schedule(c, p.slot, sleep_until);
        Ok(())
    }

    /// A FIFO probe's answer: the acquire it followed was processed by now.
    fn on_probe(&mut self, c: usize, p: &Pending, now: u64) {
        let slot = &mut self.conns[c].slots[p.slot as usize];
        if slot.owner == p.id && slot.queued_ns == u64::MAX {
            slot.queued_ns = now;
        }
        self.stats.probes += u64::from(self.measuring);
    }

    /// Slot `s` of connection `c` was granted its lock (`token`, or its
    /// owner for a backend without tokens): counted, logged for the FIFO
    /// check when contended, and the slot's next state by the mode (with
    /// when it wakes, if it sleeps).
    fn on_granted(
        &mut self,
        c: usize,
        s: u16,
        token: Option<u64>,
        now: u64,
    ) -> (SlotState, Option<u64>) {
        let m = self.measuring;
        let cfg = self.cfg;
        let slot = &mut self.conns[c].slots[s as usize];
        self.grants_unpublished += 1;
        slot.token = token.unwrap_or(slot.owner);
        if m {
            self.stats.grants += 1;
        }
        if cfg.mode == Mode::Contended {
            if m {
                self.stats
                    .wait_to_grant
                    .record(now.saturating_sub(slot.first_try_ns));
            }
            if self.b.fifo_probe() {
                self.stats.grant_log.push(GrantRecord {
                    key: slot.key_index,
                    token: slot.token,
                    sent_ns: slot.sent_ns,
                    // The grant itself proves the acquire was processed.
                    queued_ns: slot.queued_ns.min(now),
                });
            }
        }
        match cfg.mode {
            Mode::Acquire => (SlotState::NeedAcquire { retry: false }, None),
            Mode::Cycle | Mode::Contended => (SlotState::NeedRelease, None),
            Mode::ExtendFlood => (SlotState::NeedExtend, None),
            Mode::Extend => {
                // The first extend at a random point of the first
                // interval, so the renewals of locks acquired together
                // spread out evenly instead of arriving as one burst.
                let interval = extend_interval_ns(cfg.lease_s);
                let due = now + next_rand(&mut self.rng) % interval;
                (SlotState::Sleeping, Some(due))
            }
        }
    }

    /// Slot `s` of connection `c` was not granted its lock: a Redis waiter
    /// polls again later (same key, same start) while its wait lasts;
    /// anyone else counts it and acquires anew.
    fn on_not_granted(&mut self, c: usize, s: u16, now: u64) -> (SlotState, Option<u64>) {
        let cfg = self.cfg;
        let first_try_ns = self.conns[c].slots[s as usize].first_try_ns;
        let wait_ns = u64::from(cfg.wait_s) * 1_000_000_000;
        if !self.b.queues_waiters() && cfg.mode == Mode::Contended && now < first_try_ns + wait_ns {
            // Redis has no queue: poll again later, same key, same start.
            return (SlotState::Sleeping, Some(now + cfg.poll_ms * 1_000_000));
        }
        if self.measuring {
            self.stats.not_granted += 1;
        }
        (SlotState::NeedAcquire { retry: false }, None)
    }

    /// Slot `s` of connection `c` goes to sleep until `sleep_until` (on the
    /// timer heap), or, with `None`, joins its connection's ready slots.
    fn schedule(&mut self, c: usize, s: u16, sleep_until: Option<u64>) {
        match sleep_until {
            Some(t) => {
                self.conns[c].slots[s as usize].due_ns = t;
                self.sleepers.push(Reverse((t, c as u32, s)));
            }
            None => {
                self.conns[c].ready.push(s);
                self.mark(c);
            }
        }
    }

    /// One of connection `c`'s locks is due: it and every lock of `c` due
    /// within `lease / 6` are extended now, together (their heap entries
    /// become stale).
    fn wake_batch(&mut self, c: usize, now: u64) {
        let horizon = now + extend_interval_ns(self.cfg.lease_s) / 2;
        let conn = &mut self.conns[c];
        for (i, slot) in conn.slots.iter_mut().enumerate() {
            if slot.state == SlotState::Sleeping && slot.due_ns <= horizon {
                slot.state = SlotState::NeedExtend;
                conn.ready.push(i as u16);
            }
        }
        self.mark(c);
    }

    fn publish(&mut self) {
        if self.sent_unpublished > 0 {
            self.shared
                .sent
                .fetch_add(self.sent_unpublished, Ordering::Relaxed);
            self.sent_unpublished = 0;
        }
        if self.grants_unpublished > 0 {
            self.shared
                .grants
                .fetch_add(self.grants_unpublished, Ordering::Relaxed);
            self.grants_unpublished = 0;
        }
    }

    fn run(&mut self, poll: &mut Poll) -> Result<(), String> {
        let mut events = Events::with_capacity(1024);
        for c in 0..self.conns.len() {
            self.mark(c);
        }
        let mut now = self.now_ns();
        loop {
            if self.shared.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            if !self.measuring && self.shared.measuring.load(Ordering::Relaxed) {
                self.measuring = true;
                self.stats.reset_measured();
            }
            while let Some(&Reverse((due, c, s))) = self.sleepers.peek() {
                if due > now {
                    break;
                }
                self.sleepers.pop();
                let slot = &mut self.conns[c as usize].slots[s as usize];
                if slot.state != SlotState::Sleeping || slot.due_ns != due {
                    continue;
                }
                if self.cfg.mode == Mode::Extend && self.cfg.renew == Renew::Coalesced {
                    self.wake_batch(c as usize, now);
                    continue;
                }
                slot.state = if self.cfg.mode.extends() {
                    SlotState::NeedExtend
                } else {
                    SlotState::NeedAcquire { retry: true }
                };
                self.conns[c as usize].ready.push(s);
                self.mark(c as usize);
            }
            while let Some(c) = self.dirty.pop() {
                let c = c as usize;
                self.is_dirty[c] = false;
                self.fill(c, now);
                self.flush(c, poll)
                    .map_err(|e| format!("writing to the server: {e}"))?;
            }
            self.publish();
            if self.outstanding == 0 && self.sleepers.is_empty() {
                // Nothing in flight and nothing to send: the budget is spent.
                return Ok(());
            }
            let mut timeout = Duration::from_millis(20);
            if let Some(&Reverse((due, _, _))) = self.sleepers.peek() {
                timeout = timeout.min(Duration::from_nanos(due.saturating_sub(now)));
            }
            match poll.poll(&mut events, Some(timeout)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("poll: {e}")),
            }
            now = self.now_ns();
            for ev in &events {
                let c = ev.token().0;
                if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                    self.read(c, now, ev.is_read_closed() || ev.is_error())?;
                }
                if ev.is_writable() {
                    self.flush(c, poll)
                        .map_err(|e| format!("writing to the server: {e}"))?;
                }
            }
        }
    }
}

/// The pace of `extend` mode: a third of the lease, as the client's
/// keep-alive renews.
fn extend_interval_ns(lease_s: u8) -> u64 {
    (u64::from(lease_s) * 1_000_000_000 / 3).max(1)
}

/// Slots of connection `id` of `connections`: `depth`, or in `extend` mode
/// its share of `locks` (the first `locks % connections` connections carry
/// one more).
#[must_use]
pub fn slots_of(cfg: &Config, id: u64) -> usize {
    if cfg.mode == Mode::Extend {
        let n = cfg.connections.max(1);
        cfg.locks / n + usize::from((id as usize) < cfg.locks % n)
    } else {
        cfg.depth
    }
}

/// Points `slot` at the key of its next acquire: a fresh one, or one of
/// the hot keys (the connection's own one when contended, else any).
fn next_key(cfg: &Config, conn_id: u64, key_seq: &mut u64, rng: &mut u64, slot: &mut Slot) {
    match cfg.keys {
        Keys::Uncontended => {
            *key_seq += 1;
            set_key(&mut slot.key, &fresh_key(conn_id, *key_seq));
        }
        Keys::Hot(n) => {
            let i = if cfg.mode == Mode::Contended {
                (conn_id % u64::from(n)) as u32
            } else {
                (next_rand(rng) % u64::from(n)) as u32
            };
            slot.key_index = i;
            set_key(&mut slot.key, &hot_key(i));
        }
    }
}

/// Opens connection `id` (the worker's `i`-th) to its address and
/// registers it with `poll`, its slots ready to acquire.
fn open_conn<B: Backend>(
    b: &B,
    cfg: &Config,
    poll: &Poll,
    i: usize,
    id: u64,
    key_seq: u64,
) -> Result<Conn, String> {
    let mut stream = match &cfg.unix {
        Some(path) => crate::tls::Stream::open_unix(path)
            .map_err(|e| format!("connecting to unix:{} ({}): {e}", path.display(), b.name()))?,
        None => {
            let addr = cfg.addrs[id as usize % cfg.addrs.len()];
            let s = b
                .connect(addr)
                .map_err(|e| format!("connecting to {addr} ({}): {e}", b.name()))?;
            crate::tls::Stream::open(s, addr, cfg.tls.as_ref())
                .map_err(|e| format!("connecting to {addr} ({}): {e}", b.name()))?
        }
    };
    poll.registry()
        .register(stream.socket(), Token(i), Interest::READABLE)
        .map_err(|e| e.to_string())?;
    let slot = Slot {
        state: SlotState::NeedAcquire { retry: false },
        key: String::with_capacity(KEY_BYTES),
        key_index: 0,
        owner: 0,
        token: 0,
        first_try_ns: 0,
        sent_ns: 0,
        queued_ns: u64::MAX,
        due_ns: 0,
    };
    let slots = slots_of(cfg, id);
    Ok(Conn {
        stream,
        id,
        input: ReadBuf::new(4 * READ_CHUNK_BYTES),
        wbuf: Vec::with_capacity(16 * 1024),
        wpos: 0,
        want_write: false,
        outstanding: VecDeque::with_capacity(slots * 2),
        slots: vec![slot; slots],
        ready: (0..slots as u16).rev().collect(),
        owner_seq: 0,
        key_seq,
    })
}

/// Opens connections `ids` and drives them until `shared.stop`, or until
/// the request budget is spent and answered. Returns what it measured.
pub fn run_worker<B: Backend>(
    b: &B,
    cfg: &Config,
    ids: &[u64],
    shared: &Shared,
    base: Instant,
) -> Result<Stats, String> {
    let poll = Poll::new().map_err(|e| format!("poll: {e}"));
    let result = poll.and_then(|mut poll| {
        // Runs in one process share the nonce: each takes its own block of
        // the sequence, so a run never meets keys an earlier run of the same
        // process still holds (extend runs leave theirs held).
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let key_seq = run_nonce() + RUNS.fetch_add(1, Ordering::Relaxed) * 1_000_000_000;
        let mut conns = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            conns.push(open_conn(b, cfg, &poll, i, id, key_seq)?);
        }
        let n = conns.len();
        let mut w = Worker {
            b,
            cfg,
            shared,
            base,
            conns,
            sleepers: BinaryHeap::new(),
            dirty: Vec::with_capacity(n),
            is_dirty: vec![false; n],
            stats: Stats::default(),
            measuring: false,
            rng: 0x9E37_79B9_7F4A_7C15 ^ ids.first().copied().unwrap_or(0).wrapping_add(1),
            outstanding: 0,
            sent_unpublished: 0,
            grants_unpublished: 0,
        };
        w.run(&mut poll)?;
        w.publish();
        Ok(w.stats)
    });
    shared.done.fetch_add(1, Ordering::Relaxed);
    result
}

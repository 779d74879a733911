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
use super::hist::Histogram;
use super::{READ_BUFFER_CAP_BYTES, READ_CHUNK_BYTES};
use ticketd::readbuf::ReadBuf;

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

/// One grant as the FIFO check needs it. Times are the generator's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantRecord {
    /// Index of the hot key.
    pub key: u32,
    /// The grant's fencing token: the server's grant order.
    pub token: u64,
    /// No later than the moment the acquire was written to the socket.
    pub sent_ns: u64,
    /// A moment by which the server had certainly processed the acquire:
    /// when the reply to the probe sent right behind it on the same
    /// connection (or the grant itself) had been read.
    pub queued_ns: u64,
}

/// What one worker measured (after the warm-up).
#[derive(Debug, Default)]
pub struct Stats {
    /// Replies received (= requests answered).
    pub replies: u64,
    /// Acquires granted.
    pub grants: u64,
    /// Acquires not granted (T, or a Redis nil that was not retried).
    pub not_granted: u64,
    /// Acquires refused for capacity (B).
    pub busy: u64,
    /// Releases that took effect.
    pub released: u64,
    /// Releases that changed nothing: with the generator's own tokens this
    /// only happens if a lease ran out first.
    pub not_released: u64,
    /// Redis polls (`SET NX` repeated by a waiting slot).
    pub polls: u64,
    /// FIFO probes answered (contended ticketd runs; not counted as requests).
    pub probes: u64,
    /// Extends answered `E` (extend modes).
    pub extended: u64,
    /// Extends answered `X`: the generator only extends grants it holds
    /// within their lease, so any of these is a failure.
    pub not_extended: u64,
    /// Request to reply, nanoseconds.
    pub latency: Histogram,
    /// First attempt of an acquire to its grant, nanoseconds (contended).
    pub wait_to_grant: Histogram,
    /// Every grant of a hot key (contended, ticketd), warm-up included.
    pub grant_log: Vec<GrantRecord>,
}

impl Stats {
    /// Adds `other` into `self`.
    pub fn merge(&mut self, mut other: Stats) {
        self.replies += other.replies;
        self.grants += other.grants;
        self.not_granted += other.not_granted;
        self.busy += other.busy;
        self.released += other.released;
        self.not_released += other.not_released;
        self.polls += other.polls;
        self.probes += other.probes;
        self.extended += other.extended;
        self.not_extended += other.not_extended;
        self.latency.merge(&other.latency);
        self.wait_to_grant.merge(&other.wait_to_grant);
        self.grant_log.append(&mut other.grant_log);
    }

    fn reset_measured(&mut self) {
        let log = std::mem::take(&mut self.grant_log);
        *self = Stats {
            grant_log: log,
            ..Stats::default()
        };
    }
}

/// The FIFO check over a grant log.
///
/// Acquires that reach the server in the same loop turn have no order the
/// client can see, so the check only uses order it can prove: if acquire J
/// was certainly processed (queued) before acquire I was even sent
/// (`J.queued_ns < I.sent_ns`), FIFO hand-over must grant J before I, i.e.
/// give J the smaller token. Expired leases (the non-FIFO path) cannot occur
/// when every holder releases at once within its lease.
///
/// Returns (grants checked, grants that overtook an acquire queued before
/// they were sent).
#[must_use]
pub fn fifo_violations(log: &mut [GrantRecord]) -> (u64, u64) {
    log.sort_unstable_by_key(|g| (g.key, g.token));
    let mut bad = 0;
    // Walk each key's grants from the last token to the first, keeping the
    // earliest proven-queued time among the later grants.
    let mut later_min_queued = u64::MAX;
    for i in (0..log.len()).rev() {
        if i + 1 < log.len() && log[i + 1].key != log[i].key {
            later_min_queued = u64::MAX;
        }
        if log[i].sent_ns > later_min_queued {
            bad += 1;
        }
        later_min_queued = later_min_queued.min(log[i].queued_ns);
    }
    (log.len() as u64, bad)
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

/// Writes `n` in decimal into `out`, right-aligned and zero-padded.
fn put_digits(out: &mut [u8], mut n: u64) {
    for d in out.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

/// The `i`-th hot key: `hot`, 7 digits that differ between runs (so a run
/// never queues behind waiters an earlier run left in the server), and 14
/// digits of `i`.
#[must_use]
pub fn hot_key(i: u32) -> [u8; KEY_BYTES] {
    let mut k = [0u8; KEY_BYTES];
    k[..3].copy_from_slice(b"hot");
    put_digits(&mut k[3..10], run_nonce() / 1_000_000_000_000);
    put_digits(&mut k[10..], u64::from(i));
    k
}

/// A key no other request of the run uses: connection (5 digits), then a
/// per-connection sequence (19 digits).
#[must_use]
pub fn fresh_key(conn: u64, seq: u64) -> [u8; KEY_BYTES] {
    let mut k = [0u8; KEY_BYTES];
    put_digits(&mut k[..5], conn);
    put_digits(&mut k[5..], seq);
    k
}

/// Replaces `out` with the ASCII key `k` without a UTF-8 check per request.
fn set_key(out: &mut String, k: &[u8; KEY_BYTES]) {
    out.clear();
    out.extend(k.iter().map(|&b| char::from(b)));
}

/// Where a run's fresh-key sequence starts: different for every run, so a
/// run never meets keys an earlier run left held (replies still in flight
/// when it stopped), without the server being restarted between runs.
fn run_nonce() -> u64 {
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        // 19 digits of sequence: the nonce takes the top 7, a run the rest.
        (t ^ u64::from(std::process::id()).rotate_left(32)) % 10_000_000 * 1_000_000_000_000
    })
}

/// xorshift64*: cheap, deterministic per connection, good enough to spread
/// acquires over hot keys.
fn next_rand(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
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

    fn on_reply(&mut self, c: usize, outcome: Outcome, now: u64) -> Result<(), String> {
        let p = self.take_pending(c, &outcome)?;
        if p.probe {
            let slot = &mut self.conns[c].slots[p.slot as usize];
            if slot.owner == p.id && slot.queued_ns == u64::MAX {
                slot.queued_ns = now;
            }
            self.stats.probes += u64::from(self.measuring);
            return Ok(());
        }
        let m = self.measuring;
        let cfg = self.cfg;
        let queues = self.b.queues_waiters();
        if m {
            self.stats.replies += 1;
            // An extend run reports the latency of its extends only: its
            // acquires are a one-off set-up.
            if !cfg.mode.extends() || p.kind == Kind::Extend {
                self.stats.latency.record(now.saturating_sub(p.sent_ns));
            }
        }
        let slot = &mut self.conns[c].slots[p.slot as usize];
        let mut sleep_until = None;
        match outcome {
            Outcome::Granted { token, .. } => {
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
                slot.state = match cfg.mode {
                    Mode::Acquire => SlotState::NeedAcquire { retry: false },
                    Mode::Cycle | Mode::Contended => SlotState::NeedRelease,
                    Mode::ExtendFlood => SlotState::NeedExtend,
                    Mode::Extend => {
                        // The first extend at a random point of the first
                        // interval, so the renewals of locks acquired together
                        // spread out evenly instead of arriving as one burst.
                        let interval = extend_interval_ns(cfg.lease_s);
                        sleep_until = Some(now + next_rand(&mut self.rng) % interval);
                        SlotState::Sleeping
                    }
                };
            }
            Outcome::NotGranted { .. } => {
                let wait_ns = u64::from(cfg.wait_s) * 1_000_000_000;
                if !queues && cfg.mode == Mode::Contended && now < slot.first_try_ns + wait_ns {
                    // Redis has no queue: poll again later, same key, same start.
                    slot.state = SlotState::Sleeping;
                    sleep_until = Some(now + cfg.poll_ms * 1_000_000);
                } else {
                    if m {
                        self.stats.not_granted += 1;
                    }
                    slot.state = SlotState::NeedAcquire { retry: false };
                }
            }
            Outcome::Busy { .. } => {
                if m {
                    self.stats.busy += 1;
                }
                slot.state = SlotState::NeedAcquire { retry: false };
            }
            Outcome::Released { .. } | Outcome::NotReleased { .. } => {
                if m {
                    if matches!(outcome, Outcome::Released { .. }) {
                        self.stats.released += 1;
                    } else {
                        self.stats.not_released += 1;
                    }
                }
                slot.state = SlotState::NeedAcquire { retry: false };
            }
            Outcome::Extended { .. } => {
                if m {
                    self.stats.extended += 1;
                }
                if cfg.mode == Mode::Extend {
                    // Paced like the client's keep-alive: lease / 3 after the
                    // previous extend was written.
                    slot.state = SlotState::Sleeping;
                    sleep_until = Some(p.sent_ns + extend_interval_ns(cfg.lease_s));
                } else {
                    slot.state = SlotState::NeedExtend;
                }
            }
            Outcome::NotExtended { .. } => {
                // The lock is gone (counted as a failure): take a fresh one.
                if m {
                    self.stats.not_extended += 1;
                }
                slot.state = SlotState::NeedAcquire { retry: false };
            }
        }
        match sleep_until {
            Some(t) => {
                self.conns[c].slots[p.slot as usize].due_ns = t;
                self.sleepers.push(Reverse((t, c as u32, p.slot)));
            }
            None => {
                self.conns[c].ready.push(p.slot);
                self.mark(c);
            }
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_24_bytes_and_distinct() {
        let hot = hot_key(7);
        assert!(hot.starts_with(b"hot") && hot.ends_with(b"00000000000007"));
        assert_eq!(hot[3..10], hot_key(8)[3..10], "one run, one prefix");
        assert_eq!(&fresh_key(3, 12), b"000030000000000000000012");
        assert_ne!(fresh_key(1, 23), fresh_key(12, 3));
    }

    #[test]
    fn fifo_check_counts_only_overtakes_it_can_prove() {
        let g = |key, token, sent_ns, queued_ns| GrantRecord {
            key,
            token,
            sent_ns,
            queued_ns,
        };
        // Key 0: acquires sent at 10 and 11 reached the server together; the
        // later one won: no order was proven, no violation.
        // Key 1: the acquire granted token 5 was sent at 40, after the one
        // granted token 9 was proven queued at 30: a violation.
        let mut log = vec![
            g(0, 2, 11, 15),
            g(0, 3, 10, 15),
            g(1, 9, 20, 30),
            g(1, 5, 40, 45),
            g(1, 12, 50, 55),
        ];
        assert_eq!(fifo_violations(&mut log), (5, 1));
        // The same on different keys proves nothing.
        let mut other_keys = vec![g(2, 9, 20, 30), g(3, 5, 40, 45)];
        assert_eq!(fifo_violations(&mut other_keys), (2, 0));
    }
}

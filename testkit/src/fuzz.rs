//! Bodies of the ticketd fuzz targets, with the properties they check.
//!
//! Each function takes the fuzzer's bytes and panics (with a message naming
//! the broken property) on the first violation. The cargo-fuzz targets
//! (`fuzz/fuzz_targets/`) call them, and so does
//! `tests/engine/fuzz_regressions.rs`: every crash the fuzzer finds is
//! replayed by `cargo test` without cargo-fuzz, and CI runs the bodies over a
//! seeded stream of random inputs.
//!
//! * [`decode_request`], [`decode_reply`]: arbitrary bytes and an arbitrary
//!   `max_key_bytes` through the codec. A frame never claims more bytes than
//!   it was given or than one maximal frame, its key is valid, it re-encodes
//!   to exactly the bytes it was decoded from, every strict prefix of it is
//!   `Incomplete`, and a malformed verdict never changes when more bytes
//!   arrive.
//! * [`engine_ops`]: an arbitrary sequence of acquires, releases, time steps,
//!   ticks, disconnects, token ceilings (and, in replicated mode, explicit
//!   expiries and wait timeouts) against the engine, checked after every
//!   operation against a reference model of PROTOCOL §2: `check_invariants()`,
//!   tokens strictly increasing and below the ceiling, at most one valid
//!   holder per key (no lease ends before `grant + lease`), no grant to a
//!   waiter past its wait deadline (give or take one clock tick, see
//!   `SLACK_MS`), no Timeout before it, FIFO hand-over to queued waiters,
//!   every acquire answered exactly once (or cancelled by its disconnect),
//!   nothing due left undone after a tick, and nothing happening before
//!   `next_deadline()`.

//!
//! The cluster targets' bodies ([`cluster`]: peer messages, replicated
//! commands, WAL recovery) are built with the `cluster` feature.

use std::collections::{BTreeMap, HashMap};

#[cfg(feature = "cluster")]
pub mod cluster;

use ticketd::engine::{Acquire, AcquireOutcome, ConnId, Engine, Outbox, WaiterId};
use ticketd::limits::EngineLimits;
use ticketd::proto::{
    decode_reply as dec_reply, decode_request as dec_request, encode_reply, encode_request,
    reply_header_len, request_header_len, Decoded, Malformed, Reply,
};
use ticketd::time::Millis;

/// `max_key_bytes` from the first input byte: mostly tiny, so short inputs
/// reach the key-length limit, sometimes the default.
fn max_key_from(b: u8) -> usize {
    match b {
        0..=239 => usize::from(b % 40) + 1,
        240..=251 => ticketd::limits::DEFAULT_MAX_KEY_BYTES,
        _ => usize::from(b) * 4,
    }
}

/// A decoded frame reduced to what the checks compare: its key and its
/// re-encoding (owned, so verdicts on different buffers can be compared).
type Owned = (String, Vec<u8>);

/// Checks shared by both decoders on one verdict.
fn check_verdict(
    what: &str,
    data: &[u8],
    max_key_bytes: usize,
    header_len: Option<usize>,
    decode: &dyn Fn(&[u8]) -> Decoded<Owned>,
) {
    let verdict = decode(data);
    match &verdict {
        &Decoded::Frame {
            frame: (ref key, ref encoded),
            used,
        } => {
            let header = header_len.expect("a frame has a known op");
            assert!(
                used <= data.len(),
                "{what}: used {used} > len {}",
                data.len()
            );
            assert!(
                used <= header + max_key_bytes + 1,
                "{what}: used {used} exceeds one maximal frame"
            );
            assert!(!key.is_empty(), "{what}: empty key accepted");
            assert!(
                key.len() <= max_key_bytes,
                "{what}: key of {} bytes over max {max_key_bytes}",
                key.len()
            );
            assert!(!key.contains('\n'), "{what}: key contains a newline");
            assert_eq!(used, header + key.len() + 1, "{what}: used != frame size");
            assert_eq!(
                &encoded[..],
                &data[..used],
                "{what}: re-encoding differs from the input"
            );
            // The verdict depends on the frame's own bytes only.
            assert_eq!(decode(&data[..used]), verdict, "{what}: needs lookahead");
            // Every strict prefix of a valid frame is incomplete, never malformed.
            let step = if used <= 96 { 1 } else { used / 32 };
            for cut in (0..used).step_by(step).chain([used - 1]) {
                assert_eq!(
                    decode(&data[..cut]),
                    Decoded::Incomplete,
                    "{what}: prefix of {cut} bytes of a valid frame"
                );
            }
        }
        Decoded::Incomplete => {
            if let Some(header) = header_len {
                // A full window without a newline is malformed, not incomplete.
                assert!(
                    data.len() < header + max_key_bytes + 1,
                    "{what}: incomplete with a full frame window ({} bytes)",
                    data.len()
                );
                if data.len() > header {
                    assert!(
                        !data[header..].contains(&b'\n'),
                        "{what}: incomplete although a newline follows the header"
                    );
                }
            } else {
                assert!(data.is_empty(), "{what}: unknown op reported incomplete");
            }
        }
        &Decoded::Malformed(m) => {
            match m {
                Malformed::UnknownOp(op) => {
                    assert_eq!(Some(&op), data.first(), "{what}: wrong op reported");
                    assert!(header_len.is_none(), "{what}: known op reported unknown");
                }
                Malformed::ZeroLease => {
                    // The lease byte: third in an Acquire, second in an Extend.
                    let zero_at = |at: usize| data.len() > at && data[at] == 0;
                    assert!(
                        (matches!(data.first(), Some(&b'A' | &b'P')) && zero_at(2))
                            || (data.first() == Some(&b'E') && zero_at(1)),
                        "{what}: zero lease without one"
                    );
                }
                Malformed::ZeroLimit => {
                    // The limit: bytes 11 and 12 of an Acquire With Limit.
                    assert!(
                        data.first() == Some(&b'P') && data.get(11..13) == Some(&[0, 0][..]),
                        "{what}: zero limit without one"
                    );
                }
                Malformed::UnknownMode(b) => {
                    assert!(
                        data.first() == Some(&b'P')
                            && data.get(13) == Some(&b)
                            && b != b'S'
                            && b != b'X',
                        "{what}: unknown mode without one"
                    );
                }
                Malformed::EmptyKey => {
                    let header = header_len.expect("a known op");
                    assert_eq!(data.get(header), Some(&b'\n'), "{what}: key not empty");
                }
                Malformed::InvalidUtf8 | Malformed::KeyTooLong => {
                    assert!(header_len.is_some(), "{what}: {m} on an unknown op");
                }
            }
            // Malformed is final: more bytes never make it a frame.
            let mut longer = data.to_vec();
            longer.extend_from_slice(b"k\n");
            assert_eq!(
                decode(&longer),
                verdict,
                "{what}: malformed verdict changed with more bytes"
            );
        }
    }
}

/// Decodes a stream the way the server's read loop does: frame after frame
/// until the rest is incomplete or malformed. Each frame must make progress.
fn decode_stream(data: &[u8], decode: &dyn Fn(&[u8]) -> Decoded<Owned>) {
    let mut rest = data;
    while let Decoded::Frame { used, .. } = decode(rest) {
        assert!(used > 0 && used <= rest.len(), "stream: no progress");
        rest = &rest[used..];
    }
}

/// Fuzz body: the request decoder on arbitrary bytes.
pub fn decode_request(data: &[u8]) {
    let Some((&first, data)) = data.split_first() else {
        return;
    };
    let max = max_key_from(first);
    let header = data.first().and_then(|&op| request_header_len(op));
    let decode = |b: &[u8]| -> Decoded<Owned> {
        match dec_request(b, max) {
            Decoded::Frame { frame, used } => {
                let mut v = Vec::new();
                encode_request(&frame, &mut v);
                Decoded::Frame {
                    frame: (frame.key().to_string(), v),
                    used,
                }
            }
            Decoded::Incomplete => Decoded::Incomplete,
            Decoded::Malformed(m) => Decoded::Malformed(m),
        }
    };
    check_verdict("decode_request", data, max, header, &decode);
    decode_stream(data, &decode);
}

/// Fuzz body: the reply decoder on arbitrary bytes.
pub fn decode_reply(data: &[u8]) {
    let Some((&first, data)) = data.split_first() else {
        return;
    };
    let max = max_key_from(first);
    let header = data.first().and_then(|&op| reply_header_len(op));
    let decode = |b: &[u8]| -> Decoded<Owned> {
        match dec_reply(b, max) {
            Decoded::Frame { frame, used } => {
                let mut v = Vec::new();
                encode_reply(&frame, &mut v);
                Decoded::Frame {
                    frame: (frame.key().to_string(), v),
                    used,
                }
            }
            Decoded::Incomplete => Decoded::Incomplete,
            Decoded::Malformed(m) => Decoded::Malformed(m),
        }
    };
    check_verdict("decode_reply", data, max, header, &decode);
    decode_stream(data, &decode);
}

/// Reads the fuzzer's bytes as small numbers; zeros once they run out.
struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.u8(), self.u8()])
    }

    fn below(&mut self, n: u8) -> u8 {
        self.u8() % n
    }

    fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

const KEYS: [&str; 3] = ["a", "b", "c"];

/// How much later than `now + lease` (or `now + wait`) the engine may end a
/// lease (or a wait). Safety checks use the exact bound: a lease never ends
/// before it, a grant never goes to a waiter past it. Liveness checks (when
/// something must have happened) allow this much more, so that an engine
/// rounding its deadlines up by a clock tick, which makes leases safe
/// against a millisecond clock, still passes.
const SLACK_MS: u64 = 1;
const CONNS: u8 = 4;

/// A grant as the model sees it.
#[derive(Clone, Copy, Debug)]
struct Holder {
    token: u64,
    expires_at: Millis,
    granted_at: Millis,
}

/// A queued acquire the model expects an answer for.
#[derive(Clone, Copy, Debug)]
struct Waiting {
    key: usize,
    conn: ConnId,
    wait_deadline: Millis,
    lease_s: u8,
    id: WaiterId,
}

/// The reference model of PROTOCOL §2 the engine is checked against.
struct Model {
    clocked: bool,
    now: Millis,
    last_token: u64,
    ceiling: u64,
    limits: EngineLimits,
    holders: [Option<Holder>; KEYS.len()],
    /// Queued owners per key, oldest first.
    queues: [Vec<u64>; KEYS.len()],
    waiting: BTreeMap<u64, Waiting>,
    /// How many replies each owner has received.
    answers: HashMap<u64, u32>,
    next_owner: u64,
    log: Vec<String>,
}

/// What the operation being checked was, for validating its replies.
#[derive(Clone, Copy, Debug)]
enum Op {
    Acquire {
        key: usize,
        conn: ConnId,
        owner: u64,
        wait_s: u8,
        lease_s: u8,
        /// Engine state before the call, for judging Busy.
        keys_before: usize,
        waiters_before: usize,
        queue_before: usize,
        exhausted_before: bool,
    },
    Release {
        key: usize,
        conn: ConnId,
        token: u64,
    },
    Extend {
        key: usize,
        conn: ConnId,
        token: u64,
        lease_s: u8,
    },
    Expire,
    WaitTimeout {
        owner: Option<u64>,
    },
    Tick,
    Other,
}

impl Model {
    fn fail(&self, msg: String) -> ! {
        let tail = self.log.len().saturating_sub(40);
        panic!(
            "engine_ops: {msg}\n  last operations:\n    {}",
            self.log[tail..].join("\n    ")
        );
    }

    /// A holder whose lease has certainly not ended (safety checks).
    fn valid_holder(&self, key: usize) -> Option<Holder> {
        self.holders[key].filter(|h| !self.clocked || h.expires_at > self.now)
    }

    /// A holder whose lease has not certainly ended: the engine may end a
    /// lease up to [`SLACK_MS`] after `grant + lease` (liveness checks).
    fn live_holder(&self, key: usize) -> Option<Holder> {
        self.holders[key].filter(|h| !self.clocked || h.expires_at.add_ms(SLACK_MS) > self.now)
    }

    fn answered(&mut self, owner: u64) {
        let n = self.answers.entry(owner).or_insert(0);
        *n += 1;
        if *n > 1 {
            let msg = format!("owner {owner} answered {n} times");
            self.fail(msg);
        }
    }

    fn grant(&mut self, key: usize, token: u64, lease_s: u8) {
        if token <= self.last_token {
            let msg = format!(
                "token {token} not above every earlier token ({})",
                self.last_token
            );
            self.fail(msg);
        }
        if token >= self.ceiling {
            let msg = format!("token {token} at or above the ceiling {}", self.ceiling);
            self.fail(msg);
        }
        if let Some(h) = self.valid_holder(key) {
            let msg = format!(
                "two holders on {:?}: token {} (valid until {}) and new token {token} at {}",
                KEYS[key], h.token, h.expires_at, self.now
            );
            self.fail(msg);
        }
        self.last_token = token;
        let expires_at = if self.clocked {
            self.now.add_secs(u64::from(lease_s))
        } else {
            Millis::NEVER
        };
        self.holders[key] = Some(Holder {
            token,
            expires_at,
            granted_at: self.now,
        });
    }

    /// A reply to a queued acquire: it must be queued, on this key and
    /// connection, and (for a grant) the oldest still waiting.
    fn take_waiter(&mut self, owner: u64, key: usize, conn: ConnId, grant: bool) -> Waiting {
        let Some(w) = self.waiting.remove(&owner) else {
            let msg = format!("reply for owner {owner}, which is not waiting");
            self.fail(msg);
        };
        if w.key != key || w.conn != conn {
            let msg = format!("reply for owner {owner} on the wrong key or connection");
            self.fail(msg);
        }
        let pos = self.queues[key]
            .iter()
            .position(|&o| o == owner)
            .expect("a waiting owner is queued");
        if grant && pos != 0 {
            let msg = format!(
                "FIFO: owner {owner} granted {:?} ahead of {:?}",
                KEYS[key],
                &self.queues[key][..pos]
            );
            self.fail(msg);
        }
        self.queues[key].remove(pos);
        w
    }

    fn check_replies(&mut self, engine: &Engine, op: Op, out: &Outbox) {
        let replies: Vec<_> = out.iter().collect();
        let mut immediate = 0;
        for a in replies {
            self.log
                .push(format!("  -> conn {}: {:?}", a.conn, a.reply));
            let key = KEYS
                .iter()
                .position(|k| *k == a.reply.key())
                .unwrap_or_else(|| self.fail(format!("reply on unknown key {:?}", a.reply)));
            let reply_owner = match a.reply {
                Reply::Acquired { owner, .. }
                | Reply::Timeout { owner, .. }
                | Reply::Busy { owner, .. } => Some(owner),
                _ => None,
            };
            match (a.reply, op) {
                (
                    _,
                    Op::Acquire {
                        owner,
                        key: k,
                        conn,
                        wait_s,
                        lease_s,
                        keys_before,
                        waiters_before,
                        queue_before,
                        exhausted_before,
                    },
                ) if reply_owner == Some(owner) => {
                    immediate += 1;
                    self.answered(owner);
                    if k != key || a.conn != conn {
                        self.fail("immediate reply on the wrong key or connection".into());
                    }
                    match a.reply {
                        Reply::Acquired { token, .. } => {
                            if a.lease_s != lease_s.max(1) {
                                self.fail(format!("grant reports lease {}", a.lease_s));
                            }
                            self.grant(key, token, lease_s.max(1));
                        }
                        Reply::Timeout { .. } => {
                            if wait_s != 0 || self.live_holder(key).is_none() {
                                self.fail(format!(
                                    "immediate Timeout with wait {wait_s} and holder {:?}",
                                    self.holders[key]
                                ));
                            }
                        }
                        _ => {
                            let l = &self.limits;
                            let justified = exhausted_before
                                || keys_before >= l.max_keys
                                || waiters_before >= l.max_waiters
                                || queue_before >= l.max_waiters_per_key;
                            if !justified {
                                self.fail("Busy with no limit reached".into());
                            }
                        }
                    }
                }
                (Reply::Acquired { token, owner, .. }, _) => {
                    self.answered(owner);
                    let w = self.take_waiter(owner, key, a.conn, true);
                    if self.clocked && w.wait_deadline.add_ms(SLACK_MS) <= self.now {
                        let msg = format!(
                            "owner {owner} granted at {} after its wait deadline {}",
                            self.now, w.wait_deadline
                        );
                        self.fail(msg);
                    }
                    if a.lease_s != w.lease_s {
                        self.fail(format!("hand-over reports lease {}", a.lease_s));
                    }
                    self.grant(key, token, w.lease_s);
                }
                (Reply::Timeout { owner, .. }, _) => {
                    self.answered(owner);
                    let w = self.take_waiter(owner, key, a.conn, false);
                    let explicit = matches!(op, Op::WaitTimeout { owner: Some(o) } if o == owner);
                    let due = self.clocked && w.wait_deadline <= self.now;
                    let exhausted = engine.tokens_exhausted();
                    if !(explicit || due || exhausted) {
                        let msg = format!(
                            "owner {owner} timed out at {} before its deadline {}",
                            self.now, w.wait_deadline
                        );
                        self.fail(msg);
                    }
                }
                (Reply::Busy { owner, .. }, _) => {
                    self.fail(format!("Busy for owner {owner} that was not just asked"));
                }
                (
                    Reply::Released { token, .. } | Reply::NotReleased { token, .. },
                    Op::Release {
                        key: k,
                        conn,
                        token: t,
                    },
                ) => {
                    immediate += 1;
                    if k != key || t != token || a.conn != conn {
                        self.fail("release reply does not match the release".into());
                    }
                    let current = self.holders[key].filter(|h| h.token == token);
                    if matches!(a.reply, Reply::Released { .. }) {
                        if current.is_none() {
                            self.fail(format!("token {token} released but not held"));
                        }
                        self.holders[key] = None;
                    } else if current.is_some() && self.valid_holder(key).is_some() {
                        self.fail(format!("valid holder token {token} not released"));
                    }
                }
                (
                    Reply::Extended { token, .. } | Reply::NotExtended { token, .. },
                    Op::Extend {
                        key: k,
                        conn,
                        token: t,
                        lease_s,
                    },
                ) => {
                    immediate += 1;
                    if k != key || t != token || a.conn != conn {
                        self.fail("extend reply does not match the extend".into());
                    }
                    let lease_s = lease_s.max(1);
                    let current = self.holders[key].filter(|h| h.token == token);
                    let cap = self.limits.max_hold_ms;
                    let capped = |h: Holder, now: Millis| {
                        self.clocked
                            && cap > 0
                            && h.granted_at.add_ms(cap) < now.add_secs(u64::from(lease_s))
                    };
                    if matches!(a.reply, Reply::Extended { .. }) {
                        let Some(h) = current else {
                            self.fail(format!("token {token} extended but not held"));
                        };
                        if self.live_holder(key).is_none() {
                            self.fail(format!("ended lease of token {token} revived"));
                        }
                        if capped(h, self.now) {
                            self.fail(format!("token {token} extended past the max hold"));
                        }
                        if a.lease_s != lease_s {
                            self.fail(format!("extend reports lease {}", a.lease_s));
                        }
                        if self.clocked {
                            let expires_at = self.now.add_secs(u64::from(lease_s));
                            self.holders[key] = Some(Holder { expires_at, ..h });
                        }
                    } else if let Some(h) = self.valid_holder(key).filter(|h| h.token == token) {
                        if !capped(h, self.now) {
                            self.fail(format!("valid holder token {token} not extended"));
                        }
                    }
                }
                (r, _) => self.fail(format!("unexpected reply {r:?} to {op:?}")),
            }
        }
        let expected = match op {
            Op::Acquire { .. } => {
                let queued = match op {
                    Op::Acquire { owner, .. } => self.waiting.contains_key(&owner),
                    _ => false,
                };
                usize::from(!queued)
            }
            Op::Release { .. } | Op::Extend { .. } => 1,
            _ => 0,
        };
        if immediate != expected {
            let msg = format!("{immediate} immediate replies to {op:?}, expected {expected}");
            self.fail(msg);
        }
    }

    /// Properties that hold between operations.
    fn check_state(&mut self, engine: &Engine) {
        engine.check_invariants();
        if engine.next_token() <= self.last_token {
            self.fail("next token not above the last issued".into());
        }
        if engine.waiter_count() != self.waiting.len() {
            let msg = format!(
                "engine has {} waiters, model {}",
                engine.waiter_count(),
                self.waiting.len()
            );
            self.fail(msg);
        }
        for (key, queue) in self.queues.iter().enumerate() {
            if engine.queued_owners(KEYS[key]) != *queue {
                let msg = format!("queue of {:?} differs from the model", KEYS[key]);
                self.fail(msg);
            }
        }
        if !self.clocked {
            return;
        }
        // The poll timeout must wake the server no later than anything is due.
        let next = engine.next_deadline().unwrap_or(Millis::NEVER);
        for w in self.waiting.values() {
            let holder_end = self.holders[w.key].map_or(Millis::ZERO, |h| h.expires_at);
            let due = w.wait_deadline.min(holder_end).add_ms(SLACK_MS);
            if next > due {
                let msg = format!("next_deadline {next} later than a due event at {due}");
                self.fail(msg);
            }
        }
    }

    /// After a tick at `now`, nothing due by `now` may remain undone.
    fn check_tick_done(&mut self) {
        if !self.clocked {
            return;
        }
        for (owner, w) in &self.waiting {
            if w.wait_deadline.add_ms(SLACK_MS) <= self.now {
                let msg = format!("owner {owner} still waiting past its deadline after tick");
                self.fail(msg);
            }
        }
        for (key, queue) in self.queues.iter().enumerate() {
            let free = self.live_holder(key).is_none();
            if free && !queue.is_empty() {
                let msg = format!("{:?} free after tick with waiters {queue:?}", KEYS[key]);
                self.fail(msg);
            }
        }
    }
}

/// Fuzz body: arbitrary operation sequences against the engine.
pub fn engine_ops(data: &[u8]) {
    let mut b = Bytes { data };
    let mode = b.u8();
    let clocked = mode & 1 == 0;
    let limits = EngineLimits {
        max_keys: usize::from(b.below(4)) + 1,
        max_waiters: usize::from(b.below(8)) + 1,
        max_waiters_per_key: usize::from(b.below(4)) + 1,
        sweep_interval_ms: u64::from(b.u16() % 8000) + 1,
        max_hold_ms: match b.below(4) {
            0 => u64::from(b.u16() % 20_000),
            _ => 0,
        },
        ..EngineLimits::default()
    };
    let first_token = match b.below(4) {
        0 => 0,
        1 => 1,
        2 => u64::MAX - u64::from(b.below(8)),
        _ => u64::from(b.u16()) << 20,
    };
    let mut engine = if clocked {
        Engine::new(limits.clone(), first_token)
    } else {
        Engine::replicated(limits.clone(), first_token)
    };
    let mut m = Model {
        clocked,
        now: Millis(u64::from(b.u16())),
        last_token: first_token.max(1) - 1,
        ceiling: u64::MAX,
        limits,
        holders: [None; KEYS.len()],
        queues: Default::default(),
        waiting: BTreeMap::new(),
        answers: HashMap::new(),
        next_owner: 1,
        log: vec![format!("mode clocked={clocked} first_token={first_token}")],
    };
    let mut out = Outbox::new();
    let mut ops = 0;
    while !b.is_empty() && ops < 2000 {
        ops += 1;
        out.clear();
        let op = match b.below(8) {
            0 | 1 => {
                let key = usize::from(b.below(KEYS.len() as u8));
                let conn = ConnId::from(b.below(CONNS));
                let wait_s = match b.below(4) {
                    0 => 0,
                    3 => b.u8(),
                    _ => b.below(4),
                };
                let lease_s = match b.below(4) {
                    0 => b.u8(),
                    _ => b.below(5), // 0 is treated as 1
                };
                let owner = m.next_owner;
                m.next_owner += 1;
                let op = Op::Acquire {
                    key,
                    conn,
                    owner,
                    wait_s,
                    lease_s,
                    keys_before: engine.key_count(),
                    waiters_before: engine.waiter_count(),
                    queue_before: engine.queued_owners(KEYS[key]).len(),
                    exhausted_before: engine.tokens_exhausted(),
                };
                m.log.push(format!("{} {op:?}", m.now));
                let req = Acquire {
                    key: KEYS[key],
                    owner,
                    wait_s,
                    lease_s,
                };
                let outcome = engine.acquire(m.now, conn, req, &mut out);
                if let AcquireOutcome::Queued(id) = outcome {
                    let wait_deadline = if clocked {
                        m.now.add_secs(u64::from(wait_s))
                    } else {
                        Millis::NEVER
                    };
                    m.waiting.insert(
                        owner,
                        Waiting {
                            key,
                            conn,
                            wait_deadline,
                            lease_s: lease_s.max(1),
                            id,
                        },
                    );
                    m.queues[key].push(owner);
                }
                let immediate_kind = out
                    .iter()
                    .find(|a| matches!(a.reply, Reply::Acquired { owner: o, .. } | Reply::Timeout { owner: o, .. } | Reply::Busy { owner: o, .. } if o == owner))
                    .map(|a| a.reply);
                let consistent = match (outcome, immediate_kind) {
                    (AcquireOutcome::Granted(t), Some(Reply::Acquired { token, .. })) => t == token,
                    (AcquireOutcome::Timeout, Some(Reply::Timeout { .. }))
                    | (AcquireOutcome::Busy, Some(Reply::Busy { .. }))
                    | (AcquireOutcome::Queued(_), None) => true,
                    _ => false,
                };
                if !consistent {
                    m.fail(format!("outcome {outcome:?} but reply {immediate_kind:?}"));
                }
                op
            }
            2 => {
                let key = usize::from(b.below(KEYS.len() as u8));
                let conn = ConnId::from(b.below(CONNS));
                let token = match b.below(4) {
                    0 | 1 => m.holders[key].map_or(m.last_token, |h| h.token),
                    2 => m.last_token.saturating_sub(u64::from(b.below(4))),
                    _ => u64::from(b.u16()),
                };
                if b.below(3) == 0 {
                    let lease_s = match b.below(4) {
                        0 => b.u8(),
                        _ => b.below(5), // 0 is treated as 1
                    };
                    let op = Op::Extend {
                        key,
                        conn,
                        token,
                        lease_s,
                    };
                    m.log.push(format!("{} {op:?}", m.now));
                    let took = engine.extend(m.now, conn, KEYS[key], token, lease_s, &mut out);
                    let said_e = out
                        .iter()
                        .any(|a| matches!(a.reply, Reply::Extended { .. }));
                    if took != said_e {
                        m.fail(format!("extend returned {took} but replied otherwise"));
                    }
                    op
                } else {
                    let op = Op::Release { key, conn, token };
                    m.log.push(format!("{} {op:?}", m.now));
                    let took = engine.release(m.now, conn, token, KEYS[key], &mut out);
                    let said_r = out
                        .iter()
                        .any(|a| matches!(a.reply, Reply::Released { .. }));
                    if took != said_r {
                        m.fail(format!("release returned {took} but replied otherwise"));
                    }
                    op
                }
            }
            3 => {
                let step_ms = match b.below(4) {
                    0 => 1000 * u64::from(b.below(8)),
                    1 => u64::from(b.u16()),
                    _ => u64::from(b.below(200)) * 10,
                };
                m.now = m.now.add_ms(step_ms);
                m.log.push(format!("advance {step_ms}ms to {}", m.now));
                Op::Other
            }
            4 => {
                // Nothing may happen before the deadline the engine reported.
                let quiet = !matches!(engine.next_deadline(), Some(d) if d <= m.now);
                m.log.push(format!("{} tick", m.now));
                engine.tick(m.now, &mut out);
                if quiet && clocked && !out.is_empty() {
                    m.fail("tick before next_deadline produced replies".into());
                }
                Op::Tick
            }
            5 => {
                let conn = ConnId::from(b.below(CONNS));
                m.log.push(format!("{} disconnect conn {conn}", m.now));
                engine.disconnect(m.now, conn, &mut out);
                let gone: Vec<u64> = m
                    .waiting
                    .iter()
                    .filter(|(_, w)| w.conn == conn)
                    .map(|(&o, _)| o)
                    .collect();
                for owner in gone {
                    let w = m.waiting.remove(&owner).expect("listed above");
                    m.queues[w.key].retain(|&o| o != owner);
                }
                Op::Other
            }
            6 => {
                let ceiling = match b.below(4) {
                    0 => u64::MAX,
                    _ => engine.next_token().saturating_add(u64::from(b.below(3))),
                };
                m.log.push(format!("{} token ceiling {ceiling}", m.now));
                engine.set_token_ceiling(ceiling);
                m.ceiling = ceiling;
                if !clocked && b.below(2) == 0 {
                    // Cluster mode raises the next token to the applied index.
                    let floor = engine.next_token().saturating_add(u64::from(b.below(100)));
                    m.log.push(format!("raise next token to {floor}"));
                    engine.raise_next_token(floor);
                }
                Op::Other
            }
            _ => {
                if b.below(2) == 0 {
                    // A committed Expire{key, token}, current or stale.
                    let key = usize::from(b.below(KEYS.len() as u8));
                    let token = match b.below(3) {
                        0 | 1 => m.holders[key].map_or(0, |h| h.token),
                        _ => m.last_token.saturating_sub(u64::from(b.below(3))),
                    };
                    m.log
                        .push(format!("{} expire {:?} token {token}", m.now, KEYS[key]));
                    // In clocked mode a sweep may have deleted an expired
                    // grant already, so only a valid one must be found.
                    let current = m.holders[key].is_some_and(|h| h.token == token);
                    let valid = m.valid_holder(key).is_some_and(|h| h.token == token);
                    let took = engine.expire(m.now, KEYS[key], token, &mut out);
                    if took && !current || !took && valid {
                        m.fail(format!("expire returned {took}, model holder {current}"));
                    }
                    if took {
                        m.holders[key] = None;
                    }
                    Op::Expire
                } else {
                    // A committed wait timeout, for a live waiter or a stale id.
                    let pick = usize::from(b.u8());
                    let live: Vec<(u64, Waiting)> =
                        m.waiting.iter().map(|(&o, &w)| (o, w)).collect();
                    let (owner, key, id) = match live.get(pick % (live.len() + 1)) {
                        Some(&(o, w)) => (Some(o), w.key, w.id),
                        None => (None, usize::from(b.below(3)), u64::from(b.u16())),
                    };
                    let live_id = m.waiting.values().any(|w| w.id == id && w.key == key);
                    m.log
                        .push(format!("{} wait_timeout {:?} id {id}", m.now, KEYS[key]));
                    let took = engine.wait_timeout(m.now, KEYS[key], id, &mut out);
                    if took != live_id {
                        m.fail(format!(
                            "wait_timeout returned {took}, model says {live_id}"
                        ));
                    }
                    let owner = owner.or_else(|| {
                        m.waiting
                            .iter()
                            .find(|(_, w)| w.id == id && w.key == key)
                            .map(|(&o, _)| o)
                    });
                    Op::WaitTimeout { owner }
                }
            }
        };
        m.check_replies(&engine, op, &out);
        if matches!(op, Op::Tick) {
            m.check_tick_done();
        }
        m.check_state(&engine);
    }
    if clocked {
        // Past every wait: each queued acquire has had its one answer.
        out.clear();
        m.now = m.now.add_secs(300);
        m.log.push(format!("{} final tick", m.now));
        engine.tick(m.now, &mut out);
        m.check_replies(&engine, Op::Tick, &out);
        m.check_tick_done();
        m.check_state(&engine);
        if !m.waiting.is_empty() {
            let msg = format!("never answered: {:?}", m.waiting.keys());
            m.fail(msg);
        }
    }
}

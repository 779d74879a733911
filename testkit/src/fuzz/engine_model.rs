//! The reference model of PROTOCOL §2 that the engine fuzz body
//! ([`super::engine_ops`]) checks the engine against: who holds each key,
//! who waits, the tokens issued, and the checks of every reply and of the
//! state between operations.

use std::collections::{BTreeMap, HashMap};

use ticketd::engine::{Addressed, ConnId, Engine, Outbox, WaiterId};
use ticketd::limits::EngineLimits;
use ticketd::proto::Reply;
use ticketd::time::Millis;

/// Reads the fuzzer's bytes as small numbers; zeros once they run out.
pub(super) struct Bytes<'a> {
    pub(super) data: &'a [u8],
}

impl Bytes<'_> {
    pub(super) fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub(super) fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.u8(), self.u8()])
    }

    pub(super) fn below(&mut self, n: u8) -> u8 {
        self.u8() % n
    }

    pub(super) fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

pub(super) const KEYS: [&str; 3] = ["a", "b", "c"];

/// How much later than `now + lease` (or `now + wait`) the engine may end a
/// lease (or a wait). Safety checks use the exact bound: a lease never ends
/// before it, a grant never goes to a waiter past it. Liveness checks (when
/// something must have happened) allow this much more, so that an engine
/// rounding its deadlines up by a clock tick, which makes leases safe
/// against a millisecond clock, still passes.
const SLACK_MS: u64 = 1;
pub(super) const CONNS: u8 = 4;

/// A grant as the model sees it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Holder {
    pub(super) token: u64,
    pub(super) expires_at: Millis,
    pub(super) granted_at: Millis,
}

/// A queued acquire the model expects an answer for.
#[derive(Clone, Copy, Debug)]
pub(super) struct Waiting {
    pub(super) key: usize,
    pub(super) conn: ConnId,
    pub(super) wait_deadline: Millis,
    pub(super) lease_s: u8,
    pub(super) id: WaiterId,
}

/// The reference model of PROTOCOL §2 the engine is checked against.
pub(super) struct Model {
    pub(super) clocked: bool,
    pub(super) now: Millis,
    pub(super) last_token: u64,
    pub(super) ceiling: u64,
    pub(super) limits: EngineLimits,
    pub(super) holders: [Option<Holder>; KEYS.len()],
    /// Queued owners per key, oldest first.
    pub(super) queues: [Vec<u64>; KEYS.len()],
    pub(super) waiting: BTreeMap<u64, Waiting>,
    /// How many replies each owner has received.
    pub(super) answers: HashMap<u64, u32>,
    pub(super) next_owner: u64,
    pub(super) log: Vec<String>,
}

/// What the operation being checked was, for validating its replies.
#[derive(Clone, Copy, Debug)]
pub(super) enum Op {
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
    pub(super) fn fail(&self, msg: String) -> ! {
        let tail = self.log.len().saturating_sub(40);
        panic!(
            "engine_ops: {msg}\n  last operations:\n    {}",
            self.log[tail..].join("\n    ")
        );
    }

    /// A holder whose lease has certainly not ended (safety checks).
    pub(super) fn valid_holder(&self, key: usize) -> Option<Holder> {
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

    /// Checks the replies `out` the engine gave to `op` against the model,
    /// and updates the model with them.
    pub(super) fn check_replies(&mut self, engine: &Engine, op: Op, out: &Outbox) {
        let replies: Vec<_> = out.iter().collect();
        let mut immediate = 0;
        for a in replies {
            self.log
                .push(format!("  -> conn {}: {:?}", a.conn, a.reply));
            if self.check_reply(engine, op, &a) {
                immediate += 1;
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

    /// Checks one reply `a` to `op`; whether it is the immediate answer to
    /// `op` itself (not a hand-over or a timeout of a queued acquire).
    fn check_reply(&mut self, engine: &Engine, op: Op, a: &Addressed<'_>) -> bool {
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
            (_, Op::Acquire { owner, .. }) if reply_owner == Some(owner) => {
                self.check_immediate_acquire(op, key, a);
                true
            }
            (Reply::Acquired { token, owner, .. }, _) => {
                self.check_handover(key, token, owner, a);
                false
            }
            (Reply::Timeout { owner, .. }, _) => {
                self.check_queued_timeout(engine, op, key, owner, a.conn);
                false
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
                if k != key || t != token || a.conn != conn {
                    self.fail("release reply does not match the release".into());
                }
                self.check_release_reply(key, token, a);
                true
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
                if k != key || t != token || a.conn != conn {
                    self.fail("extend reply does not match the extend".into());
                }
                self.check_extend_reply(key, token, lease_s.max(1), a);
                true
            }
            (r, _) => self.fail(format!("unexpected reply {r:?} to {op:?}")),
        }
    }

    /// The immediate answer `a` (on `key`) to the acquire `op`: a grant
    /// of the asked lease, a Timeout only with no wait while the key is
    /// held, Busy only with a limit reached.
    fn check_immediate_acquire(&mut self, op: Op, key: usize, a: &Addressed<'_>) {
        let Op::Acquire {
            owner,
            key: k,
            conn,
            wait_s,
            lease_s,
            keys_before,
            waiters_before,
            queue_before,
            exhausted_before,
        } = op
        else {
            unreachable!("called for an acquire only");
        };
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

    /// A grant `a` of `key` with `token` handed over to the queued `owner`:
    /// the oldest waiter, within its wait, with the lease it asked for.
    fn check_handover(&mut self, key: usize, token: u64, owner: u64, a: &Addressed<'_>) {
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

    /// A Timeout to the queued `owner` on `key`, on `conn`: only when asked
    /// explicitly (`op`), at its deadline, or with the tokens exhausted.
    fn check_queued_timeout(
        &mut self,
        engine: &Engine,
        op: Op,
        key: usize,
        owner: u64,
        conn: ConnId,
    ) {
        self.answered(owner);
        let w = self.take_waiter(owner, key, conn, false);
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

    /// The answer `a` to a release of `token` on `key`: released only when
    /// held, refused never while its lease lasts.
    fn check_release_reply(&mut self, key: usize, token: u64, a: &Addressed<'_>) {
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

    /// The answer `a` to an extend of `token` on `key` to `lease_s`:
    /// extended only while held and within the max hold, refused never to
    /// a valid holder within it.
    fn check_extend_reply(&mut self, key: usize, token: u64, lease_s: u8, a: &Addressed<'_>) {
        let current = self.holders[key].filter(|h| h.token == token);
        let cap = self.limits.max_hold_ms;
        let capped = |h: Holder, now: Millis| {
            self.clocked && cap > 0 && h.granted_at.add_ms(cap) < now.add_secs(u64::from(lease_s))
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

    /// Properties that hold between operations.
    pub(super) fn check_state(&mut self, engine: &Engine) {
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
    pub(super) fn check_tick_done(&mut self) {
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

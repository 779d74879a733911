//! The lock engine against a small reference model, on random operation
//! sequences (proptest).
//!
//! The model below is the PROTOCOL §2 tables written as naively as possible:
//! keys in a `Vec`, queues in `Vec`s, every rule a linear scan, no timers
//! (tick simply looks at every key). Each random step (acquire, release with
//! a right or wrong token, disconnect, a time step, a tick) is applied to
//! both; every reply must be identical in content and order, and the
//! observable state (holder, queue, counts) must match.
//!
//! Independently of the model, the replies themselves are checked against
//! the guarantees a client relies on: at most one valid holder per key,
//! tokens strictly increasing in grant order and never 0, every request
//! answered exactly once unless its connection closed first, and no grant
//! to a waiter after its wait ran out. `check_invariants()` runs after every
//! step.

use std::collections::HashMap;

use proptest::prelude::*;
use ticketd::engine::{Acquire, AcquireOutcome, ConnId, Engine, Outbox};
use ticketd::limits::EngineLimits;
use ticketd::proto::Reply;
use ticketd::time::Millis;

/// Few keys, so that contention, queues and capacity limits are common.
/// Sorted: the engine's tick processes due keys in key order.
const KEYS: [&str; 4] = ["a", "b", "c", "d"];
const CONN_SLOTS: usize = 3;
const SWEEP_MS: u64 = 2_000;

fn limits() -> EngineLimits {
    EngineLimits {
        max_keys: 3,
        max_waiters: 5,
        max_waiters_per_key: 3,
        sweep_interval_ms: SWEEP_MS,
        max_hold_ms: 0,
        ..EngineLimits::default()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Rep {
    /// token, owner, key, and the grant's lease (`Addressed::lease_s`).
    A(u64, u64, String, u8),
    T(u64, String),
    B(u64, String),
    R(u64, String),
    N(u64, String),
    E(u64, String),
    X(u64, String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Granted(u64),
    Queued(u64),
    Timeout,
    Busy,
}

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        key: usize,
        conn: usize,
        wait_s: u8,
        lease_s: u8,
    },
    /// `pick`: 0-1 the key's current token, 2 the last token issued on any
    /// key, 3 an arbitrary token below the next one (`any`), 4 zero.
    Release {
        key: usize,
        conn: usize,
        pick: u8,
        any: u64,
    },
    /// An extend (PROTOCOL §5.2); `pick` as for `Release`.
    Extend {
        key: usize,
        conn: usize,
        pick: u8,
        any: u64,
        lease_s: u8,
    },
    Disconnect {
        conn: usize,
    },
    Step {
        ms: u64,
    },
    Tick,
    /// The committed `Expire{key, token}` of cluster mode; `pick` as for
    /// `Release`.
    Expire {
        key: usize,
        pick: u8,
        any: u64,
    },
    /// The committed wait timeout of cluster mode: `which` < 3 names a
    /// waiter queued on the key (if any), otherwise it is taken as a raw,
    /// probably stale, waiter id.
    WaitTimeout {
        key: usize,
        which: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..KEYS.len(), 0..CONN_SLOTS, 0..=3u8, 1..=3u8).prop_map(
            |(key, conn, wait_s, lease_s)| Op::Acquire { key, conn, wait_s, lease_s }
        ),
        3 => (0..KEYS.len(), 0..CONN_SLOTS, 0..=4u8, any::<u64>())
            .prop_map(|(key, conn, pick, any)| Op::Release { key, conn, pick, any }),
        2 => (0..KEYS.len(), 0..CONN_SLOTS, 0..=4u8, any::<u64>(), 1..=3u8).prop_map(
            |(key, conn, pick, any, lease_s)| Op::Extend { key, conn, pick, any, lease_s }
        ),
        1 => (0..CONN_SLOTS).prop_map(|conn| Op::Disconnect { conn }),
        4 => prop_oneof![0..1_200u64, Just(1_000u64), 0..4_000u64]
            .prop_map(|ms| Op::Step { ms }),
        2 => Just(Op::Tick),
        1 => (0..KEYS.len(), 0..=4u8, any::<u64>())
            .prop_map(|(key, pick, any)| Op::Expire { key, pick, any }),
        1 => (0..KEYS.len(), 0..6u8).prop_map(|(key, which)| Op::WaitTimeout { key, which }),
    ]
}

// ------------------------------------------------------------------ the model

#[derive(Clone, Debug)]
struct MWaiter {
    /// Waiter ids count from 1 in the order acquires are queued.
    id: u64,
    conn: ConnId,
    owner: u64,
    wait_deadline_ms: u64,
    lease_s: u8,
}

#[derive(Clone, Debug)]
struct MKey {
    name: String,
    token: u64,
    expires_at_ms: u64,
    queue: Vec<MWaiter>,
}

/// PROTOCOL §2 written out plainly: single mode, or (`replicated`) cluster
/// mode's state machine, where time never expires anything by itself.
struct Model {
    replicated: bool,
    next_waiter: u64,
    now_ms: u64,
    keys: Vec<MKey>,
    next_token: u64,
    next_sweep_ms: u64,
    limits: EngineLimits,
}

impl Model {
    fn new(limits: EngineLimits, first_token: u64, replicated: bool) -> Self {
        Model {
            replicated,
            next_waiter: 1,
            now_ms: 0,
            keys: Vec::new(),
            next_token: first_token,
            next_sweep_ms: limits.sweep_interval_ms,
            limits,
        }
    }

    fn find(&self, key: &str) -> Option<usize> {
        self.keys.iter().position(|k| k.name == key)
    }

    fn waiters(&self) -> usize {
        self.keys.iter().map(|k| k.queue.len()).sum()
    }

    fn token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    fn acquire(
        &mut self,
        conn: ConnId,
        key: &str,
        owner: u64,
        wait_s: u8,
        lease_s: u8,
        out: &mut Vec<(ConnId, Rep)>,
    ) -> Outcome {
        let now = self.now_ms;
        let lease_ms = u64::from(lease_s) * 1000;
        match self.find(key) {
            None => {
                if self.keys.len() >= self.limits.max_keys {
                    out.push((conn, Rep::B(owner, key.into())));
                    return Outcome::Busy;
                }
                let token = self.token();
                self.keys.push(MKey {
                    name: key.into(),
                    token,
                    expires_at_ms: now + lease_ms,
                    queue: Vec::new(),
                });
                out.push((conn, Rep::A(token, owner, key.into(), lease_s)));
                Outcome::Granted(token)
            }
            Some(i) if !self.replicated && self.keys[i].expires_at_ms < now => {
                // Lazy takeover, ahead of any queue.
                let token = self.token();
                self.keys[i].token = token;
                self.keys[i].expires_at_ms = now + lease_ms;
                out.push((conn, Rep::A(token, owner, key.into(), lease_s)));
                Outcome::Granted(token)
            }
            Some(_) if wait_s == 0 => {
                out.push((conn, Rep::T(owner, key.into())));
                Outcome::Timeout
            }
            Some(i) => {
                if self.keys[i].queue.len() >= self.limits.max_waiters_per_key
                    || self.waiters() >= self.limits.max_waiters
                {
                    out.push((conn, Rep::B(owner, key.into())));
                    return Outcome::Busy;
                }
                let id = self.next_waiter;
                self.next_waiter += 1;
                self.keys[i].queue.push(MWaiter {
                    id,
                    conn,
                    owner,
                    wait_deadline_ms: now + u64::from(wait_s) * 1000,
                    lease_s,
                });
                Outcome::Queued(id)
            }
        }
    }

    fn release(&mut self, conn: ConnId, key: &str, token: u64, out: &mut Vec<(ConnId, Rep)>) {
        match self.find(key) {
            Some(i) if self.keys[i].token == token => {
                out.push((conn, Rep::R(token, key.into())));
                self.end_grant(i, out);
            }
            _ => out.push((conn, Rep::N(token, key.into()))),
        }
    }

    /// PROTOCOL §5.2: a grant whose lease has not ended lives `lease_s` from
    /// now, keeping its token and its queue; anything else is X.
    fn extend(
        &mut self,
        conn: ConnId,
        key: &str,
        token: u64,
        lease_s: u8,
        out: &mut Vec<(ConnId, Rep)>,
    ) {
        let now = self.now_ms;
        match self.find(key) {
            Some(i)
                if self.keys[i].token == token
                    && (self.replicated || self.keys[i].expires_at_ms >= now) =>
            {
                self.keys[i].expires_at_ms = now + u64::from(lease_s) * 1000;
                out.push((conn, Rep::E(token, key.into())));
            }
            _ => out.push((conn, Rep::X(token, key.into()))),
        }
    }

    /// Waiters whose wait ran out get T (in queue order), never the key.
    fn time_out_waiters(&mut self, i: usize, out: &mut Vec<(ConnId, Rep)>) {
        if self.replicated {
            return;
        }
        let now = self.now_ms;
        let name = self.keys[i].name.clone();
        let mut kept = Vec::new();
        for w in self.keys[i].queue.drain(..) {
            if w.wait_deadline_ms <= now {
                out.push((w.conn, Rep::T(w.owner, name.clone())));
            } else {
                kept.push(w);
            }
        }
        self.keys[i].queue = kept;
    }

    fn hand_to_head(&mut self, i: usize, out: &mut Vec<(ConnId, Rep)>) {
        let w = self.keys[i].queue.remove(0);
        let token = self.token();
        self.keys[i].token = token;
        self.keys[i].expires_at_ms = self.now_ms + u64::from(w.lease_s) * 1000;
        out.push((
            w.conn,
            Rep::A(token, w.owner, self.keys[i].name.clone(), w.lease_s),
        ));
    }

    /// The grant of key `i` ends (release or expiry).
    fn end_grant(&mut self, i: usize, out: &mut Vec<(ConnId, Rep)>) {
        self.time_out_waiters(i, out);
        if self.keys[i].queue.is_empty() {
            self.keys.remove(i);
        } else {
            self.hand_to_head(i, out);
        }
    }

    fn expire(&mut self, key: &str, token: u64, out: &mut Vec<(ConnId, Rep)>) -> bool {
        match self.find(key) {
            Some(i) if self.keys[i].token == token => {
                self.end_grant(i, out);
                true
            }
            _ => false,
        }
    }

    fn wait_timeout(&mut self, key: &str, id: u64, out: &mut Vec<(ConnId, Rep)>) -> bool {
        let Some(i) = self.find(key) else {
            return false;
        };
        let Some(pos) = self.keys[i].queue.iter().position(|w| w.id == id) else {
            return false;
        };
        let w = self.keys[i].queue.remove(pos);
        out.push((w.conn, Rep::T(w.owner, key.into())));
        true
    }

    fn disconnect(&mut self, conn: ConnId) {
        for k in &mut self.keys {
            k.queue.retain(|w| w.conn != conn);
        }
    }

    fn tick(&mut self, out: &mut Vec<(ConnId, Rep)>) {
        if self.replicated {
            return;
        }
        let mut order: Vec<usize> = (0..self.keys.len()).collect();
        order.sort_by(|&x, &y| self.keys[x].name.cmp(&self.keys[y].name));
        for i in order {
            if self.keys[i].queue.is_empty() {
                continue;
            }
            self.time_out_waiters(i, out);
            if !self.keys[i].queue.is_empty() && self.keys[i].expires_at_ms < self.now_ms {
                self.hand_to_head(i, out);
            }
        }
        if self.now_ms >= self.next_sweep_ms {
            let now = self.now_ms;
            self.keys
                .retain(|k| !(k.expires_at_ms < now && k.queue.is_empty()));
            self.next_sweep_ms = now + self.limits.sweep_interval_ms;
        }
    }

    /// The first moment something is due: a wait running out or a lease
    /// running out on a key with waiters, or the sweep finding an expired
    /// key.
    fn next_event_ms(&self) -> Option<u64> {
        if self.replicated {
            return None;
        }
        let mut next = None::<u64>;
        for k in &self.keys {
            for w in &k.queue {
                next = Some(next.map_or(w.wait_deadline_ms, |n| n.min(w.wait_deadline_ms)));
            }
            if !k.queue.is_empty() {
                // A lease is over once its expiry is past.
                let over = k.expires_at_ms + 1;
                next = Some(next.map_or(over, |n| n.min(over)));
            }
        }
        // The sweep has work once it is due and some lease has ended.
        if let Some(first_end) = self.keys.iter().map(|k| k.expires_at_ms + 1).min() {
            let sweep = self.next_sweep_ms.max(first_end);
            next = Some(next.map_or(sweep, |n| n.min(sweep)));
        }
        next
    }
}

// ------------------------------------------------------------------ the checker

/// What a client can observe, checked from the replies alone.
#[derive(Default)]
struct Checker {
    /// Acquires not answered yet: owner -> (conn, wait deadline if queued, lease).
    pending: HashMap<u64, (ConnId, Option<u64>, u8)>,
    /// The last grant seen per key and when its lease ends, until released.
    live_grant: HashMap<String, (u64, u64)>,
    last_token: u64,
    /// Leases never run out by themselves (cluster mode's state machine).
    replicated: bool,
    /// The lease of the extend in flight, by token.
    extend_lease: HashMap<u64, u8>,
}

impl Checker {
    // Long because it checks every kind of reply in one match, side by side.
    fn observe(&mut self, now_ms: u64, replies: &[(ConnId, Rep)]) {
        for (conn, rep) in replies {
            match rep {
                Rep::A(token, owner, key, granted_lease_s) => {
                    assert!(*token > self.last_token, "token {token} not increasing");
                    self.last_token = *token;
                    let (c, deadline, lease_s) = self.pending.remove(owner).unwrap_or_else(|| {
                        panic!("A for owner {owner} answered twice or never asked")
                    });
                    assert_eq!(c, *conn, "A for owner {owner} sent to the wrong connection");
                    assert_eq!(
                        lease_s, *granted_lease_s,
                        "A for owner {owner} with the wrong lease"
                    );
                    if let Some(d) = deadline {
                        assert!(
                            now_ms < d,
                            "owner {owner} granted at {now_ms}, its wait ran out at {d}"
                        );
                    }
                    if let Some(&(old, exp)) = self.live_grant.get(key) {
                        assert!(
                            exp <= now_ms,
                            "{key:?} granted to {owner} at {now_ms} while token {old} is valid until {exp}"
                        );
                    }
                    let lease_end_ms = if self.replicated {
                        u64::MAX
                    } else {
                        now_ms + u64::from(lease_s) * 1000
                    };
                    self.live_grant.insert(key.clone(), (*token, lease_end_ms));
                }
                Rep::T(owner, _) | Rep::B(owner, _) => {
                    let (c, _, _) = self
                        .pending
                        .remove(owner)
                        .unwrap_or_else(|| panic!("owner {owner} answered twice or never asked"));
                    assert_eq!(c, *conn);
                }
                Rep::R(token, key) => {
                    let live = self.live_grant.remove(key);
                    assert_eq!(live.map(|l| l.0), Some(*token), "R of a token not held");
                }
                Rep::N(token, key) => {
                    if let Some(&(held, exp)) = self.live_grant.get(key) {
                        assert!(
                            held != *token || exp <= now_ms,
                            "N for the valid holder's token {token} on {key:?}"
                        );
                    }
                }
                Rep::E(token, key) => {
                    let live = self.live_grant.get_mut(key);
                    let Some((held, exp)) = live else {
                        panic!("E of {token} on {key:?}, which nobody holds");
                    };
                    assert_eq!(*held, *token, "E of a token not held");
                    assert!(now_ms <= *exp, "E revived {token}, ended at {exp}");
                    if !self.replicated {
                        let lease_s = self.extend_lease.remove(token).unwrap_or(0);
                        *exp = now_ms + u64::from(lease_s) * 1000;
                    }
                }
                Rep::X(token, key) => {
                    if let Some(&(held, exp)) = self.live_grant.get(key) {
                        assert!(
                            held != *token || exp < now_ms,
                            "X for the valid holder's token {token} on {key:?}"
                        );
                    }
                }
            }
        }
    }
}

fn owned(out: &mut Outbox) -> Vec<(ConnId, Rep)> {
    let v = out
        .iter()
        .map(|x| {
            let r = match x.reply {
                Reply::Acquired { token, owner, key } => {
                    Rep::A(token, owner, key.into(), x.lease_s)
                }
                Reply::Timeout { owner, key } => Rep::T(owner, key.into()),
                Reply::Busy { owner, key } => Rep::B(owner, key.into()),
                Reply::Released { token, key } => Rep::R(token, key.into()),
                Reply::NotReleased { token, key } => Rep::N(token, key.into()),
                Reply::Extended { token, key } => Rep::E(token, key.into()),
                Reply::NotExtended { token, key } => Rep::X(token, key.into()),
                other @ Reply::LimitMismatch { .. } => {
                    panic!("the model sends no 1.2 frame: {other:?}")
                }
            };
            (x.conn, r)
        })
        .collect();
    out.clear();
    v
}

fn compare_state(e: &Engine, m: &Model) {
    let now = Millis(m.now_ms);
    assert_eq!(e.key_count(), m.keys.len(), "key count");
    assert_eq!(e.waiter_count(), m.waiters(), "waiter count");
    for key in KEYS {
        let mk = m.find(key).map(|i| &m.keys[i]);
        assert_eq!(
            e.holder(now, key),
            mk.map(|k| (k.token, !m.replicated && k.expires_at_ms < m.now_ms)),
            "holder of {key:?}"
        );
        assert_eq!(
            e.queued_owners(key),
            mk.map(|k| k.queue.iter().map(|w| w.owner).collect::<Vec<_>>())
                .unwrap_or_default(),
            "queue of {key:?}"
        );
    }
    if m.replicated {
        assert_eq!(e.next_deadline(), None, "a replicated engine has no timers");
    }
    // The poll timeout is never later than the first thing due.
    if let Some(due) = m.next_event_ms() {
        let next = e.next_deadline().expect("something is due, so a deadline");
        assert!(next.0 <= due, "next_deadline {next} later than {due}");
    }
}

/// The token a release or expire carries: `pick` 0-1 the key's current
/// token, 2 the last token issued, 3 any token issued so far, 4 zero.
fn pick_token(m: &Model, key: usize, pick: u8, any: u64) -> u64 {
    let last = m.next_token - 1;
    match pick {
        0 | 1 => m.find(KEYS[key]).map_or(last, |i| m.keys[i].token),
        2 => last,
        3 => any % m.next_token,
        _ => 0,
    }
}

fn run(ops: &[Op], replicated: bool) {
    let mut r = Run::new(replicated);
    for op in ops {
        r.step(op);
    }
    r.finish();
}

/// One run of the engine beside its model: what it keeps between
/// operations.
struct Run {
    e: Engine,
    m: Model,
    out: Outbox,
    check: Checker,
    /// How many times each connection slot was reconnected: the server
    /// never reuses a connection id.
    generation: [u64; CONN_SLOTS],
    next_owner: u64,
    replicated: bool,
}

impl Run {
    fn new(replicated: bool) -> Run {
        const FIRST_TOKEN: u64 = 1;
        let e = if replicated {
            Engine::replicated(limits(), FIRST_TOKEN)
        } else {
            Engine::new(limits(), FIRST_TOKEN)
        };
        Run {
            e,
            m: Model::new(limits(), FIRST_TOKEN, replicated),
            out: Outbox::new(),
            check: Checker {
                replicated,
                ..Checker::default()
            },
            generation: [0u64; CONN_SLOTS],
            next_owner: 1_000u64,
            replicated,
        }
    }

    /// The connection id of connection slot `slot` now.
    fn conn_id(&self, slot: usize) -> ConnId {
        slot as u64 + 10 * self.generation[slot]
    }

    /// Applies `op` to the engine and the model, then checks the replies
    /// are the same and the states agree.
    fn step(&mut self, op: &Op) {
        let now = Millis(self.m.now_ms);
        let mut expect = Vec::new();
        self.apply(op, now, &mut expect);
        let (e, m, check) = (&mut self.e, &self.m, &mut self.check);
        let got = owned(&mut self.out);
        assert_eq!(got, expect, "replies of {op:?} at {now}");
        check.observe(m.now_ms, &got);
        if let Op::Tick = op {
            assert!(
                e.next_deadline().is_none_or(|d| d > now),
                "after tick({now}) next_deadline is not in the future: {:?}",
                e.next_deadline()
            );
        }
        e.check_invariants();
        compare_state(e, m);
        // Every unanswered acquire is one queued in the engine.
        assert_eq!(
            check.pending.len(),
            e.waiter_count(),
            "answered exactly once"
        );
    }

    /// Applies `op` at `now` to the engine (its replies in `self.out`) and
    /// to the model (its replies in `expect`).
    fn apply(&mut self, op: &Op, now: Millis, expect: &mut Vec<(ConnId, Rep)>) {
        match *op {
            Op::Acquire { .. } => self.acquire(op, now, expect),
            Op::Release {
                key,
                conn,
                pick,
                any,
            } => {
                let conn = self.conn_id(conn);
                let token = pick_token(&self.m, key, pick, any);
                let took = self.e.release(now, conn, token, KEYS[key], &mut self.out);
                self.m.release(conn, KEYS[key], token, expect);
                assert_eq!(took, matches!(expect[0].1, Rep::R(..)));
            }
            Op::Extend {
                key,
                conn,
                pick,
                any,
                lease_s,
            } => {
                let conn = self.conn_id(conn);
                let token = pick_token(&self.m, key, pick, any);
                self.check.extend_lease.insert(token, lease_s);
                let took = self
                    .e
                    .extend(now, conn, KEYS[key], token, lease_s, &mut self.out);
                self.m.extend(conn, KEYS[key], token, lease_s, expect);
                assert_eq!(took, matches!(expect[0].1, Rep::E(..)));
            }
            Op::Disconnect { conn: slot } => {
                let conn = self.conn_id(slot);
                self.e.disconnect(now, conn, &mut self.out);
                self.m.disconnect(conn);
                // The connection is gone: its pending acquires must never be
                // answered. The server never reuses a connection id.
                self.check.pending.retain(|_, p| p.0 != conn);
                self.generation[slot] += 1;
            }
            Op::Step { ms } => self.m.now_ms += ms,
            Op::Tick => {
                self.e.tick(now, &mut self.out);
                self.m.tick(expect);
            }
            Op::Expire { key, pick, any } => {
                let token = pick_token(&self.m, key, pick, any);
                let took = self.e.expire(now, KEYS[key], token, &mut self.out);
                assert_eq!(took, self.m.expire(KEYS[key], token, expect));
                if took {
                    // The grant was ended on purpose (cluster mode decides
                    // expiry by consensus): the next grant is legitimate.
                    self.check.live_grant.remove(KEYS[key]);
                }
            }
            Op::WaitTimeout { key, which } => {
                let queued = self.m.find(KEYS[key]).map(|i| &self.m.keys[i].queue);
                let id = match queued {
                    Some(q) if which < 3 && !q.is_empty() => q[usize::from(which) % q.len()].id,
                    _ => u64::from(which),
                };
                let took = self.e.wait_timeout(now, KEYS[key], id, &mut self.out);
                assert_eq!(took, self.m.wait_timeout(KEYS[key], id, expect));
            }
        }
    }

    /// The acquire `op` by a new owner: the engine's outcome is the
    /// model's, and the checker expects its answer.
    fn acquire(&mut self, op: &Op, now: Millis, expect: &mut Vec<(ConnId, Rep)>) {
        let Op::Acquire {
            key,
            conn: slot,
            wait_s,
            lease_s,
        } = *op
        else {
            unreachable!("called for an acquire only");
        };
        let conn = self.conn_id(slot);
        let owner = self.next_owner;
        self.next_owner += 1;
        let req = Acquire {
            key: KEYS[key],
            owner,
            wait_s,
            lease_s,
        };
        let got = match self.e.acquire(now, conn, req, &mut self.out) {
            AcquireOutcome::Granted(t) => Outcome::Granted(t),
            AcquireOutcome::Queued(id) => Outcome::Queued(id),
            AcquireOutcome::Timeout => Outcome::Timeout,
            AcquireOutcome::Busy => Outcome::Busy,
            AcquireOutcome::LimitMismatch(n) => panic!("a mutex acquire met limit {n}"),
        };
        let want = self
            .m
            .acquire(conn, KEYS[key], owner, wait_s, lease_s, expect);
        assert_eq!(got, want, "outcome of {op:?}");
        let queued = matches!(got, Outcome::Queued(_));
        let deadline =
            (queued && !self.replicated).then(|| self.m.now_ms + u64::from(wait_s) * 1000);
        self.check.pending.insert(owner, (conn, deadline, lease_s));
    }

    /// Runs time out (or, replicated, commits a wait timeout for every
    /// queued acquire): every queued acquire is answered.
    fn finish(mut self) {
        let (e, m, out) = (&mut self.e, &mut self.m, &mut self.out);
        m.now_ms += 300_000;
        let mut expect = Vec::new();
        if self.replicated {
            let all: Vec<(usize, u64)> = (0..KEYS.len())
                .flat_map(|k| {
                    let q = m.find(KEYS[k]).map(|i| m.keys[i].queue.clone());
                    q.unwrap_or_default().into_iter().map(move |w| (k, w.id))
                })
                .collect();
            for (k, id) in all {
                assert!(e.wait_timeout(Millis(m.now_ms), KEYS[k], id, out));
                assert!(m.wait_timeout(KEYS[k], id, &mut expect));
            }
        } else {
            e.tick(Millis(m.now_ms), out);
            m.tick(&mut expect);
        }
        let got = owned(out);
        assert_eq!(got, expect, "replies of the final step");
        self.check.observe(m.now_ms, &got);
        assert!(
            self.check.pending.is_empty(),
            "unanswered: {:?}",
            self.check.pending
        );
        e.check_invariants();
        compare_state(e, m);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1_200,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn engine_matches_the_reference_model(ops in prop::collection::vec(op(), 1..120)) {
        run(&ops, false);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Cluster mode's state machine: time steps and ticks change nothing;
    /// only committed expires and wait timeouts do.
    #[test]
    fn replicated_engine_matches_the_reference_model(ops in prop::collection::vec(op(), 1..120)) {
        run(&ops, true);
    }
}

/// A fixed sequence through the same harness, so a broken harness (not just
/// a broken engine) shows up even if the generator changes.
#[test]
fn the_harness_sees_grants_queues_timeouts_and_the_sweep() {
    let ops = [
        Op::Acquire {
            key: 0,
            conn: 0,
            wait_s: 0,
            lease_s: 1,
        },
        Op::Acquire {
            key: 0,
            conn: 1,
            wait_s: 3,
            lease_s: 2,
        },
        Op::Acquire {
            key: 1,
            conn: 2,
            wait_s: 0,
            lease_s: 1,
        },
        Op::Step { ms: 1_000 },
        Op::Tick,
        Op::Release {
            key: 0,
            conn: 1,
            pick: 0,
            any: 0,
        },
        Op::Step { ms: 1_000 },
        Op::Tick,
        Op::Disconnect { conn: 0 },
        Op::Acquire {
            key: 2,
            conn: 0,
            wait_s: 2,
            lease_s: 3,
        },
    ];
    run(&ops, false);
    run(&ops, true);
}

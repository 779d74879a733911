//! The engine's permits (PROTOCOL §6) against a reference model written
//! from §6.2 alone (the `engine_permits` fuzz target's body). The input's
//! bytes are a sequence of acquires in both modes (sometimes with another
//! limit), releases, extends, disconnects and time steps, some with a tick
//! and some without (single mode; the sweep is off, so a lapsed permit
//! ends only when its key is next touched or its timer fires). Every
//! outcome, every grant (owner and token, in order) and every timeout must
//! agree, and the engine's invariants hold after every step: never more
//! grants than the limit, never a shared grant beside an exclusive one,
//! tokens strictly increasing, FIFO.

use std::collections::{BTreeMap, VecDeque};

use ticketd::engine::{Acquire, AcquireOutcome, Engine, Outbox, Places};
use ticketd::limits::EngineLimits;
use ticketd::proto::{Mode, Reply};
use ticketd::time::Millis;

const KEYS: [&str; 2] = ["pool", "rw"];
/// The limit each key is asked with, unless the step asks with one more.
const LIMITS: [u16; 2] = [3, 2];

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        conn: u64,
        key: usize,
        exclusive: bool,
        other_limit: bool,
        wait_s: u8,
        lease_s: u8,
    },
    Release {
        key: usize,
        pick: usize,
    },
    Extend {
        key: usize,
        pick: usize,
        lease_s: u8,
    },
    Disconnect {
        conn: u64,
    },
    /// Time passes; with `tick`, the engine's timers are processed (else
    /// only the next request of a key finds what lapsed).
    Advance {
        ms: u64,
        tick: bool,
    },
}

struct MGrant {
    token: u64,
    exclusive: bool,
    /// The first millisecond the lease is over.
    ends: u64,
}

struct MWaiter {
    owner: u64,
    conn: u64,
    exclusive: bool,
    deadline: u64,
    lease_s: u8,
}

struct MKey {
    limit: u16,
    grants: Vec<MGrant>,
    queue: VecDeque<MWaiter>,
}

impl MKey {
    fn fits(&self, exclusive: bool) -> bool {
        if exclusive {
            self.grants.is_empty()
        } else {
            self.grants.len() < usize::from(self.limit) && !self.grants.iter().any(|g| g.exclusive)
        }
    }
}

/// What the model expects to be answered, in order.
#[derive(Debug, PartialEq, Eq)]
enum Said {
    Granted { owner: u64, token: u64 },
    TimedOut { owner: u64 },
}

#[derive(Default)]
struct Model {
    now: u64,
    next_token: u64,
    keys: BTreeMap<&'static str, MKey>,
    said: Vec<Said>,
}

impl Model {
    /// §6.2: lapsed grants end, waits that ran out end, then the heads
    /// that fit are granted in order; a key left with nothing is deleted.
    fn settle(&mut self, key: &'static str) {
        let now = self.now;
        let Some(k) = self.keys.get_mut(key) else {
            return;
        };
        k.grants.retain(|g| g.ends > now);
        let said = &mut self.said;
        k.queue.retain(|w| {
            let out = w.deadline <= now;
            if out {
                said.push(Said::TimedOut { owner: w.owner });
            }
            !out
        });
        while let Some(head) = k.queue.front() {
            if !k.fits(head.exclusive) {
                break;
            }
            let w = k.queue.pop_front().expect("a head");
            let token = self.next_token;
            self.next_token += 1;
            k.grants.push(MGrant {
                token,
                exclusive: w.exclusive,
                ends: now + u64::from(w.lease_s) * 1000 + 1,
            });
            self.said.push(Said::Granted {
                owner: w.owner,
                token,
            });
        }
        if k.grants.is_empty() && k.queue.is_empty() {
            self.keys.remove(key);
        }
    }

    // Eight because it is the request's fields.
    #[allow(clippy::too_many_arguments)]
    fn acquire(
        &mut self,
        conn: u64,
        key: &'static str,
        limit: u16,
        exclusive: bool,
        owner: u64,
        wait_s: u8,
        lease_s: u8,
    ) -> AcquireOutcome {
        if let Some(k) = self.keys.get(key) {
            if k.limit != limit {
                return AcquireOutcome::LimitMismatch(k.limit);
            }
        }
        self.settle(key);
        let now = self.now;
        let k = self.keys.entry(key).or_insert_with(|| MKey {
            limit,
            grants: Vec::new(),
            queue: VecDeque::new(),
        });
        if k.queue.is_empty() && k.fits(exclusive) {
            let token = self.next_token;
            self.next_token += 1;
            k.grants.push(MGrant {
                token,
                exclusive,
                ends: now + u64::from(lease_s) * 1000 + 1,
            });
            self.said.push(Said::Granted { owner, token });
            return AcquireOutcome::Granted(token);
        }
        if wait_s == 0 {
            self.said.push(Said::TimedOut { owner });
            return AcquireOutcome::Timeout;
        }
        k.queue.push_back(MWaiter {
            owner,
            conn,
            exclusive,
            deadline: now + u64::from(wait_s) * 1000,
            lease_s,
        });
        AcquireOutcome::Queued(0)
    }

    /// The token of the `pick`th grant of `key` (a bogus one past them).
    fn token(&self, key: &str, pick: usize) -> u64 {
        self.keys
            .get(key)
            .and_then(|k| k.grants.get(pick))
            .map_or(1_000_000 + pick as u64, |g| g.token)
    }

    fn release(&mut self, key: &'static str, token: u64) -> bool {
        let Some(k) = self.keys.get_mut(key) else {
            return false;
        };
        let Some(pos) = k.grants.iter().position(|g| g.token == token) else {
            return false;
        };
        k.grants.remove(pos);
        self.settle(key);
        true
    }

    fn extend(&mut self, key: &str, token: u64, lease_s: u8) -> bool {
        let now = self.now;
        let grant = self
            .keys
            .get_mut(key)
            .and_then(|k| k.grants.iter_mut().find(|g| g.token == token));
        match grant {
            Some(g) if g.ends > now => {
                g.ends = now + u64::from(lease_s) * 1000 + 1;
                true
            }
            _ => false,
        }
    }

    fn disconnect(&mut self, conn: u64) {
        let mut touched = Vec::new();
        for (key, k) in &mut self.keys {
            let before = k.queue.len();
            k.queue.retain(|w| w.conn != conn);
            if k.queue.len() != before {
                touched.push(*key);
            }
        }
        for key in touched {
            self.settle(key);
        }
    }

    /// A tick: the keys with waiters, in key order.
    fn tick(&mut self) {
        let waiting: Vec<&'static str> = self
            .keys
            .iter()
            .filter(|(_, k)| !k.queue.is_empty())
            .map(|(key, _)| *key)
            .collect();
        for key in waiting {
            self.settle(key);
        }
    }
}

/// What the engine answered, as the model says it.
fn said(out: &Outbox) -> Vec<Said> {
    out.iter()
        .filter_map(|a| match a.reply {
            Reply::Acquired { token, owner, .. } => Some(Said::Granted { owner, token }),
            Reply::Timeout { owner, .. } => Some(Said::TimedOut { owner }),
            _ => None,
        })
        .collect()
}

// Long because it is one match over the operations, engine beside model.
fn run(ops: &[Op]) {
    let limits = EngineLimits {
        sweep_interval_ms: 1 << 40,
        ..EngineLimits::default()
    };
    let mut e = Engine::new(limits, 1);
    let mut m = Model {
        next_token: 1,
        ..Model::default()
    };
    let mut out = Outbox::new();
    for (owner, op) in (1u64..).zip(ops) {
        out.clear();
        m.said.clear();
        let now = Millis(m.now);
        match *op {
            Op::Acquire {
                conn,
                key,
                exclusive,
                other_limit,
                wait_s,
                lease_s,
            } => {
                let limit = LIMITS[key] + u16::from(other_limit);
                let mode = if exclusive {
                    Mode::Exclusive
                } else {
                    Mode::Shared
                };
                let req = Acquire {
                    key: KEYS[key],
                    owner,
                    wait_s,
                    lease_s,
                };
                let got =
                    e.acquire_with_limit(now, conn, req, Places { limit, mode }, (), &mut out);
                let want = m.acquire(conn, KEYS[key], limit, exclusive, owner, wait_s, lease_s);
                match (got, want) {
                    (AcquireOutcome::Queued(_), AcquireOutcome::Queued(_)) => {}
                    (AcquireOutcome::LimitMismatch(_), AcquireOutcome::LimitMismatch(n)) => {
                        assert_eq!(got, AcquireOutcome::LimitMismatch(n), "{op:?}");
                        assert!(
                            matches!(out.iter().next().map(|a| a.reply), Some(Reply::LimitMismatch { limit, .. }) if limit == n)
                        );
                    }
                    _ => assert_eq!(got, want, "{op:?}"),
                }
            }
            Op::Release { key, pick } => {
                let token = m.token(KEYS[key], pick);
                let took = e.release(now, 0, token, KEYS[key], &mut out);
                assert_eq!(took, m.release(KEYS[key], token), "{op:?}");
            }
            Op::Extend { key, pick, lease_s } => {
                let token = m.token(KEYS[key], pick);
                let took = e.extend(now, 0, KEYS[key], token, lease_s, &mut out);
                assert_eq!(took, m.extend(KEYS[key], token, lease_s), "{op:?}");
            }
            Op::Disconnect { conn } => {
                e.disconnect(now, conn, &mut out);
                m.disconnect(conn);
            }
            Op::Advance { ms, tick } => {
                m.now += ms;
                if tick {
                    e.tick(Millis(m.now), &mut out);
                    m.tick();
                }
            }
        }
        e.check_invariants();
        assert_eq!(said(&out), m.said, "answers after {op:?}");
    }
}

/// Most steps one input runs.
const MAX_STEPS: usize = 200;

/// The steps `data` spells: each takes one byte for its kind and one to
/// three for its arguments; a step cut short ends the input.
fn ops_from(data: &[u8]) -> Vec<Op> {
    let mut ops = Vec::new();
    let mut it = data.iter().copied();
    while ops.len() < MAX_STEPS {
        let Some(kind) = it.next() else { break };
        let Some(a) = it.next() else { break };
        let op = match kind % 10 {
            0..=3 => {
                let Some(b) = it.next() else { break };
                Op::Acquire {
                    conn: u64::from(a % 4),
                    key: usize::from(a >> 2 & 1),
                    exclusive: a & 8 != 0,
                    other_limit: a >> 4 == 0xF,
                    wait_s: b % 3,
                    lease_s: 1 + b / 3 % 3,
                }
            }
            4 | 5 => Op::Release {
                key: usize::from(a & 1),
                pick: usize::from(a >> 1) % 5,
            },
            6 => Op::Extend {
                key: usize::from(a & 1),
                pick: usize::from(a >> 1) % 5,
                lease_s: 1 + (a >> 5) % 3,
            },
            7 => Op::Disconnect {
                conn: u64::from(a % 4),
            },
            _ => {
                let Some(b) = it.next() else { break };
                Op::Advance {
                    ms: u64::from(u16::from_be_bytes([a, b]) % 1_500),
                    tick: a & 1 == 0,
                }
            }
        };
        ops.push(op);
    }
    ops
}

/// The `engine_permits` fuzz target: runs the steps `data` spells on the
/// engine and on the model, and panics where they disagree or an
/// invariant breaks.
pub fn engine_permits(data: &[u8]) {
    run(&ops_from(data));
}

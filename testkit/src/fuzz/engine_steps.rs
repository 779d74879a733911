//! The engine fuzz body: operations decoded from the fuzzer's bytes, run
//! against the engine and the reference model ([`super::engine_model`]),
//! checked after each one.

use std::collections::{BTreeMap, HashMap};

use super::engine_model::{Bytes, Model, Op, Waiting, CONNS, KEYS};
use ticketd::engine::{Acquire, AcquireOutcome, ConnId, Engine, Outbox};
use ticketd::limits::EngineLimits;
use ticketd::proto::Reply;
use ticketd::time::Millis;

/// Fuzz body: arbitrary operation sequences against the engine.
pub fn engine_ops(data: &[u8]) {
    let mut b = Bytes { data };
    let (mut engine, mut m) = engine_and_model(&mut b);
    let clocked = m.clocked;
    let mut out = Outbox::new();
    let mut ops = 0;
    while !b.is_empty() && ops < 2000 {
        ops += 1;
        out.clear();
        let op = match b.below(8) {
            0 | 1 => acquire_step(&mut b, &mut engine, &mut m, &mut out),
            2 => release_or_extend_step(&mut b, &mut engine, &mut m, &mut out),
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
            5 => disconnect_step(&mut b, &mut engine, &mut m, &mut out),
            6 => ceiling_step(&mut b, &mut engine, &mut m),
            _ => {
                if b.below(2) == 0 {
                    expire_step(&mut b, &mut engine, &mut m, &mut out)
                } else {
                    wait_timeout_step(&mut b, &mut engine, &mut m, &mut out)
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
        final_tick(&mut engine, &mut m, &mut out);
    }
}

/// The engine (clocked, or replicated) and its model, with the limits, the
/// first token and the start time read from the input.
fn engine_and_model(b: &mut Bytes) -> (Engine, Model) {
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
    let engine = if clocked {
        Engine::new(limits.clone(), first_token)
    } else {
        Engine::replicated(limits.clone(), first_token)
    };
    let m = Model {
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
    (engine, m)
}

/// An acquire by a new owner, with a wait and lease from the input; a
/// queued one joins the model's waiters, and the outcome the engine
/// returns must match its immediate reply.
fn acquire_step(b: &mut Bytes, engine: &mut Engine, m: &mut Model, out: &mut Outbox) -> Op {
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
    let outcome = engine.acquire(m.now, conn, req, out);
    if let AcquireOutcome::Queued(id) = outcome {
        let wait_deadline = if m.clocked {
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
    check_acquire_outcome(m, outcome, owner, out);
    op
}

/// The outcome `engine.acquire` returned for `owner` matches the immediate
/// reply in `out` (none when queued).
fn check_acquire_outcome(m: &Model, outcome: AcquireOutcome, owner: u64, out: &Outbox) {
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
}

/// A release, or (one time in three) an extend, of the current, a recent
/// or an arbitrary token; what the engine returns must match its reply.
fn release_or_extend_step(
    b: &mut Bytes,
    engine: &mut Engine,
    m: &mut Model,
    out: &mut Outbox,
) -> Op {
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
        let took = engine.extend(m.now, conn, KEYS[key], token, lease_s, out);
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
        let took = engine.release(m.now, conn, token, KEYS[key], out);
        let said_r = out
            .iter()
            .any(|a| matches!(a.reply, Reply::Released { .. }));
        if took != said_r {
            m.fail(format!("release returned {took} but replied otherwise"));
        }
        op
    }
}

/// A connection closes: its queued acquires leave the model's queues.
fn disconnect_step(b: &mut Bytes, engine: &mut Engine, m: &mut Model, out: &mut Outbox) -> Op {
    let conn = ConnId::from(b.below(CONNS));
    m.log.push(format!("{} disconnect conn {conn}", m.now));
    engine.disconnect(m.now, conn, out);
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

/// A token ceiling (none, or just above the next token); in replicated
/// mode, sometimes the next token raised as cluster mode does.
fn ceiling_step(b: &mut Bytes, engine: &mut Engine, m: &mut Model) -> Op {
    let ceiling = match b.below(4) {
        0 => u64::MAX,
        _ => engine.next_token().saturating_add(u64::from(b.below(3))),
    };
    m.log.push(format!("{} token ceiling {ceiling}", m.now));
    engine.set_token_ceiling(ceiling);
    m.ceiling = ceiling;
    if !m.clocked && b.below(2) == 0 {
        // Cluster mode raises the next token to the applied index.
        let floor = engine.next_token().saturating_add(u64::from(b.below(100)));
        m.log.push(format!("raise next token to {floor}"));
        engine.raise_next_token(floor);
    }
    Op::Other
}

/// A committed Expire{key, token}, current or stale.
fn expire_step(b: &mut Bytes, engine: &mut Engine, m: &mut Model, out: &mut Outbox) -> Op {
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
    let took = engine.expire(m.now, KEYS[key], token, out);
    if took && !current || !took && valid {
        m.fail(format!("expire returned {took}, model holder {current}"));
    }
    if took {
        m.holders[key] = None;
    }
    Op::Expire
}

/// A committed wait timeout, for a live waiter or a stale id.
fn wait_timeout_step(b: &mut Bytes, engine: &mut Engine, m: &mut Model, out: &mut Outbox) -> Op {
    let pick = usize::from(b.u8());
    let live: Vec<(u64, Waiting)> = m.waiting.iter().map(|(&o, &w)| (o, w)).collect();
    let (owner, key, id) = match live.get(pick % (live.len() + 1)) {
        Some(&(o, w)) => (Some(o), w.key, w.id),
        None => (None, usize::from(b.below(3)), u64::from(b.u16())),
    };
    let live_id = m.waiting.values().any(|w| w.id == id && w.key == key);
    m.log
        .push(format!("{} wait_timeout {:?} id {id}", m.now, KEYS[key]));
    let took = engine.wait_timeout(m.now, KEYS[key], id, out);
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

/// Past every wait (clocked mode): each queued acquire has had its one
/// answer.
fn final_tick(engine: &mut Engine, m: &mut Model, out: &mut Outbox) {
    out.clear();
    m.now = m.now.add_secs(300);
    m.log.push(format!("{} final tick", m.now));
    engine.tick(m.now, out);
    m.check_replies(engine, Op::Tick, out);
    m.check_tick_done();
    m.check_state(engine);
    if !m.waiting.is_empty() {
        let msg = format!("never answered: {:?}", m.waiting.keys());
        m.fail(msg);
    }
}

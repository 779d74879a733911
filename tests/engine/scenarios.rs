//! Scenarios of the lock engine that span several operations and time steps:
//! expiry (lazy takeover, handover at lease expiry, sweep timing, R vs N
//! around the sweep), FIFO order, capacity limits, disconnect, fencing
//! tokens, the stale-waiter rule, replicated mode, the token ceiling,
//! extensions (PROTOCOL §5.2) and the sweep in steps.
//!
//! Every scenario drives the sans-IO engine with explicit `now` values, so
//! each one is exact to the millisecond and runs in microseconds.

use ticketd::engine::{Acquire, AcquireOutcome, ConnId, Engine, Outbox};
use ticketd::limits::EngineLimits;
use ticketd::proto::Reply;
use ticketd::time::Millis;

/// An owned copy of one reply, so tests can compare whole outboxes.
#[derive(Clone, Debug, PartialEq, Eq)]
enum R {
    A { token: u64, owner: u64, key: String },
    T { owner: u64, key: String },
    B { owner: u64, key: String },
    Rel { token: u64, key: String },
    N { token: u64, key: String },
    E { token: u64, key: String },
    X { token: u64, key: String },
}

fn ext(token: u64, key: &str) -> R {
    R::E {
        token,
        key: key.into(),
    }
}
fn not_ext(token: u64, key: &str) -> R {
    R::X {
        token,
        key: key.into(),
    }
}

fn a(token: u64, owner: u64, key: &str) -> R {
    R::A {
        token,
        owner,
        key: key.into(),
    }
}
fn t(owner: u64, key: &str) -> R {
    R::T {
        owner,
        key: key.into(),
    }
}
fn b(owner: u64, key: &str) -> R {
    R::B {
        owner,
        key: key.into(),
    }
}
fn rel(token: u64, key: &str) -> R {
    R::Rel {
        token,
        key: key.into(),
    }
}
fn n(token: u64, key: &str) -> R {
    R::N {
        token,
        key: key.into(),
    }
}

fn drain(out: &mut Outbox) -> Vec<(ConnId, R)> {
    let v = out
        .iter()
        .map(|x| {
            let r = match x.reply {
                Reply::Acquired { token, owner, key } => a(token, owner, key),
                Reply::Timeout { owner, key } => t(owner, key),
                Reply::Busy { owner, key } => b(owner, key),
                Reply::Released { token, key } => rel(token, key),
                Reply::NotReleased { token, key } => n(token, key),
                Reply::Extended { token, key } => ext(token, key),
                Reply::NotExtended { token, key } => not_ext(token, key),
                other @ Reply::LimitMismatch { .. } => panic!("no 1.2 frame here: {other:?}"),
            };
            (x.conn, r)
        })
        .collect();
    out.clear();
    v
}

fn acq(key: &str, owner: u64, wait_s: u8, lease_s: u8) -> Acquire<'_> {
    Acquire {
        key,
        owner,
        wait_s,
        lease_s,
    }
}

fn secs(s: u64) -> Millis {
    Millis(s * 1000)
}

fn granted(o: AcquireOutcome) -> u64 {
    match o {
        AcquireOutcome::Granted(t) => t,
        other => panic!("expected a grant, got {other:?}"),
    }
}

// ------------------------------------------------------------------ expiry

/// PROTOCOL §2.4: the expiry path is not FIFO. An acquire that finds the lease
/// run out takes the key on the spot, even though someone queued earlier
/// and no tick has handed the key over yet.
#[test]
fn an_acquire_takes_over_an_expired_key_ahead_of_the_queue() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("k", 1, 0, 2), &mut out);
    e.acquire(secs(0), 2, acq("k", 2, 60, 5), &mut out);
    out.clear();

    // Just past the 2 s lease (a lease is over once its expiry is past).
    let past = secs(2).add_ms(1);
    let t2 = granted(e.acquire(past, 3, acq("k", 3, 0, 4), &mut out));
    assert_eq!(drain(&mut out), vec![(3, a(2, 3, "k"))]);
    assert_eq!(e.queued_owners("k"), vec![2], "the waiter is still queued");

    // The timer set for the old lease finds a valid holder: nothing happens.
    e.tick(past, &mut out);
    assert!(drain(&mut out).is_empty());
    assert_eq!(e.holder(past, "k"), Some((t2, false)));
    e.check_invariants();

    // The waiter gets the key when the new lease runs out.
    let new_lease_over = past.add_secs(4).add_ms(1);
    assert!(e.next_deadline() <= Some(new_lease_over));
    e.tick(new_lease_over, &mut out);
    assert_eq!(drain(&mut out), vec![(2, a(3, 2, "k"))]);
    e.check_invariants();
}

/// The head waiter gets an expired key when the deadline index reaches the
/// lease's end: `next_deadline` names that moment, `tick` there grants.
#[test]
fn lease_expiry_hands_the_key_to_the_head_waiter_at_next_deadline() {
    let limits = EngineLimits {
        sweep_interval_ms: 3_600_000, // keep the sweep out of next_deadline
        ..EngineLimits::default()
    };
    let mut e = Engine::new(limits, 1);
    let mut out = Outbox::new();
    e.acquire(Millis(500), 1, acq("k", 1, 0, 3), &mut out);
    e.acquire(Millis(700), 2, acq("k", 2, 10, 2), &mut out);
    e.acquire(Millis(900), 3, acq("k", 3, 10, 2), &mut out);
    out.clear();

    // Expiry at 500 + 3 s; the lease is over once that is past.
    assert_eq!(e.next_deadline(), Some(Millis(3501)));
    e.tick(Millis(3500), &mut out);
    assert!(drain(&mut out).is_empty());
    e.tick(Millis(3501), &mut out);
    assert_eq!(drain(&mut out), vec![(2, a(2, 2, "k"))]);
    // The new holder's own lease starts at the grant: 3501 + 2 s, over 1 ms later.
    assert_eq!(e.next_deadline(), Some(Millis(5502)));
    e.tick(Millis(5502), &mut out);
    assert_eq!(drain(&mut out), vec![(3, a(3, 3, "k"))]);
    assert_eq!(e.waiter_count(), 0);
    e.check_invariants();
}

/// Expired keys with nobody waiting are deleted only by the sweep, which
/// runs every `sweep_interval_ms`, not at the moment they expire.
#[test]
fn the_sweep_deletes_expired_keys_without_waiters_every_sweep_interval() {
    let limits = EngineLimits {
        sweep_interval_ms: 5000,
        ..EngineLimits::default()
    };
    let mut e = Engine::new(limits, 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("short", 1, 0, 1), &mut out);
    e.acquire(secs(0), 1, acq("long", 2, 0, 30), &mut out);
    assert_eq!(e.next_deadline(), Some(secs(5)), "first sweep at 5 s");

    e.tick(Millis(4999), &mut out);
    assert_eq!(e.key_count(), 2, "expired at 1 s but not swept yet");
    e.tick(secs(5), &mut out);
    assert_eq!(e.key_count(), 1, "swept at 5 s");
    assert_eq!(e.holder(secs(5), "short"), None);
    assert_eq!(e.holder(secs(5), "long"), Some((2, false)));

    e.acquire(secs(5), 1, acq("again", 3, 0, 1), &mut out);
    assert_eq!(e.next_deadline(), Some(secs(10)), "next sweep 5 s later");
    e.tick(Millis(9999), &mut out);
    assert_eq!(e.key_count(), 2);
    e.tick(secs(10), &mut out);
    assert_eq!(e.key_count(), 1);
    assert!(drain(&mut out)
        .iter()
        .all(|(_, r)| matches!(r, R::A { .. })));
    e.check_invariants();
}

/// An engine whose keys all hold long leases has nothing to sweep until
/// the first lease ends, so it does not ask the loop to wake before then,
/// and a sweep that comes due earlier skips its scan.
#[test]
fn the_sweep_waits_for_the_first_lease_that_can_have_ended() {
    let limits = EngineLimits {
        sweep_interval_ms: 5000,
        ..EngineLimits::default()
    };
    let mut e = Engine::new(limits, 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("a", 1, 0, 60), &mut out);
    e.acquire(secs(10), 1, acq("b", 2, 0, 60), &mut out);
    // a's lease is over once 60 s is past.
    assert_eq!(e.next_deadline(), Some(secs(60).add_ms(1)));
    e.tick(secs(5), &mut out); // a tick for another reason
    assert_eq!(e.key_count(), 2);
    assert_eq!(e.next_deadline(), Some(secs(60).add_ms(1)));
    e.tick(secs(60).add_ms(1), &mut out);
    assert_eq!(e.key_count(), 1, "a swept at its end");
    assert_eq!(
        e.next_deadline(),
        Some(secs(70).add_ms(1)),
        "b ends at 70 s"
    );
    e.tick(secs(70).add_ms(1), &mut out);
    assert_eq!(e.key_count(), 0);
    assert_eq!(e.next_deadline(), None);
    e.check_invariants();
}

/// PROTOCOL §2.4: a release of a key whose lease ran out but which has not been
/// swept still finds the key and its token: R. After the sweep it is N.
#[test]
fn release_of_an_expired_key_is_r_before_the_sweep_and_n_after_it() {
    let limits = EngineLimits {
        sweep_interval_ms: 5000,
        ..EngineLimits::default()
    };
    let mut e = Engine::new(limits, 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("a", 1, 0, 1), &mut out);
    e.acquire(secs(0), 1, acq("b", 2, 0, 1), &mut out);
    out.clear();

    e.tick(secs(4), &mut out);
    assert!(e.release(secs(4), 1, 1, "a", &mut out));
    assert_eq!(drain(&mut out), vec![(1, rel(1, "a"))]);

    e.tick(secs(5), &mut out);
    assert!(!e.release(secs(5), 1, 2, "b", &mut out));
    assert_eq!(drain(&mut out), vec![(1, n(2, "b"))]);
    assert_eq!(e.key_count(), 0);
    e.check_invariants();
}

// ------------------------------------------------------------------ FIFO

/// A hundred waiters on one key are served strictly in arrival order, each
/// with a new, larger token, whatever connection they came from.
#[test]
fn a_hundred_waiters_are_granted_in_arrival_order() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    let mut token = granted(e.acquire(secs(0), 0, acq("k", 1000, 0, 60), &mut out));
    for i in 0..100u64 {
        let conn = (i * 37) % 11; // interleaved connections
        assert!(matches!(
            e.acquire(secs(1), conn, acq("k", i, 200, 60), &mut out),
            AcquireOutcome::Queued(_)
        ));
    }
    assert_eq!(e.queued_owners("k"), (0..100).collect::<Vec<_>>());
    out.clear();
    for i in 0..100u64 {
        assert!(e.release(secs(2), 0, token, "k", &mut out));
        let r = drain(&mut out);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], (0, rel(token, "k")));
        let (
            conn,
            R::A {
                token: next, owner, ..
            },
        ) = r[1].clone()
        else {
            panic!("expected a grant, got {:?}", r[1]);
        };
        assert_eq!((conn, owner), ((i * 37) % 11, i));
        assert!(next > token);
        token = next;
    }
    assert!(e.release(secs(2), 0, token, "k", &mut out));
    assert_eq!(e.key_count(), 0);
    e.check_invariants();
}

// ------------------------------------------------------------------ capacity

/// `wait = 0` on a held key needs no queue slot, so it is T even when every
/// capacity is exhausted; what needs a slot is B.
#[test]
fn wait_0_on_a_held_key_is_timeout_never_busy_even_when_every_limit_is_reached() {
    let limits = EngineLimits {
        max_keys: 1,
        max_waiters: 1,
        max_waiters_per_key: 1,
        ..EngineLimits::default()
    };
    let mut e = Engine::new(limits, 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("k", 1, 0, 30), &mut out);
    e.acquire(secs(0), 2, acq("k", 2, 5, 30), &mut out);
    out.clear();
    e.acquire(secs(1), 3, acq("k", 3, 0, 30), &mut out);
    e.acquire(secs(1), 3, acq("k", 4, 5, 30), &mut out);
    e.acquire(secs(1), 3, acq("other", 5, 0, 30), &mut out);
    e.acquire(secs(1), 3, acq("other", 6, 5, 30), &mut out);
    assert_eq!(
        drain(&mut out),
        vec![
            (3, t(3, "k")),
            (3, b(4, "k")),
            (3, b(5, "other")),
            (3, b(6, "other"))
        ]
    );
    e.check_invariants();
}

/// A slot freed by a timed-out, granted or cancelled waiter is usable again:
/// the limits count what is queued now, not what was ever queued.
#[test]
fn capacity_freed_by_a_leaving_waiter_is_reused() {
    let limits = EngineLimits {
        max_waiters: 1,
        ..EngineLimits::default()
    };
    let mut e = Engine::new(limits, 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("k", 1, 0, 30), &mut out);
    e.acquire(secs(0), 2, acq("k", 2, 1, 30), &mut out);
    assert_eq!(
        e.acquire(secs(0), 3, acq("k", 3, 1, 30), &mut out),
        AcquireOutcome::Busy
    );
    e.tick(secs(1), &mut out); // owner 2 times out
    assert!(matches!(
        e.acquire(secs(1), 3, acq("k", 4, 1, 30), &mut out),
        AcquireOutcome::Queued(_)
    ));
    e.disconnect(secs(1), 3, &mut out); // owner 4 cancelled
    assert!(matches!(
        e.acquire(secs(1), 4, acq("k", 5, 9, 30), &mut out),
        AcquireOutcome::Queued(_)
    ));
    assert_eq!(e.waiter_count(), 1);
    e.check_invariants();
}

// ------------------------------------------------------------------ disconnect

/// PROTOCOL §2.5: closing a connection cancels its queued acquires (no reply, it
/// is gone) and keeps what it holds; other connections' waiters keep their
/// place in line.
#[test]
fn disconnect_cancels_that_connections_waiters_and_keeps_its_locks() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    let held = granted(e.acquire(secs(0), 1, acq("mine", 1, 0, 30), &mut out));
    let other = granted(e.acquire(secs(0), 2, acq("theirs", 2, 0, 30), &mut out));
    e.acquire(secs(0), 1, acq("theirs", 3, 9, 30), &mut out);
    e.acquire(secs(0), 3, acq("theirs", 4, 9, 30), &mut out);
    e.acquire(secs(0), 1, acq("theirs", 5, 9, 30), &mut out);
    e.acquire(secs(0), 3, acq("mine", 6, 9, 30), &mut out);
    out.clear();

    e.disconnect(secs(1), 1, &mut out);
    assert!(
        drain(&mut out).is_empty(),
        "no reply to a closed connection"
    );
    assert_eq!(e.queued_owners("theirs"), vec![4]);
    assert_eq!(e.queued_owners("mine"), vec![6]);
    assert_eq!(e.holder(secs(1), "mine"), Some((held, false)));
    assert_eq!(e.waiter_count(), 2);
    e.check_invariants();

    // Releasing "theirs" now goes to connection 3's waiter, not to 1's.
    e.release(secs(2), 2, other, "theirs", &mut out);
    assert_eq!(
        drain(&mut out),
        vec![(2, rel(other, "theirs")), (3, a(3, 4, "theirs"))]
    );
    // A disconnect of a connection with no waiters changes nothing.
    e.disconnect(secs(2), 42, &mut out);
    assert_eq!(e.waiter_count(), 1);
    e.check_invariants();
}

/// A disconnect finds exactly that connection's waiters however they came
/// and went: several on one key, some granted or timed out before, its
/// bookkeeping reused by another connection after it once had none, and
/// thousands of other connections' waiters left in place.
#[test]
fn disconnect_cancels_exactly_that_connections_waiters_after_any_history() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    let k1 = granted(e.acquire(secs(0), 100, acq("k1", 1, 0, 30), &mut out));
    granted(e.acquire(secs(0), 100, acq("k2", 2, 0, 30), &mut out));
    out.clear();
    // Connection 1 queues on k1 (owner 10, short wait) then has no waiter
    // left once it times out; connection 2 then queues and may reuse
    // whatever 1 used.
    e.acquire(secs(0), 1, acq("k1", 10, 1, 30), &mut out);
    e.tick(secs(1), &mut out);
    assert_eq!(drain(&mut out), vec![(1, t(10, "k1"))]);
    e.acquire(secs(1), 2, acq("k1", 20, 9, 30), &mut out);
    // Connection 1 comes back with three waiters on k1 and two on k2,
    // around connection 2's and others'.
    e.acquire(secs(1), 1, acq("k1", 11, 9, 30), &mut out);
    e.acquire(secs(1), 1, acq("k2", 12, 9, 30), &mut out);
    e.acquire(secs(1), 3, acq("k1", 30, 9, 30), &mut out);
    e.acquire(secs(1), 1, acq("k1", 13, 9, 30), &mut out);
    e.acquire(secs(1), 1, acq("k2", 14, 2, 30), &mut out);
    e.acquire(secs(1), 1, acq("k1", 15, 9, 30), &mut out);
    for c in 1_000..3_000u64 {
        let key = if c % 2 == 0 { "k1" } else { "k2" };
        if e.queued_owners(key).len() >= 900 {
            continue;
        }
        e.acquire(secs(1), c, acq(key, c, 9, 30), &mut out);
    }
    assert!(drain(&mut out).is_empty(), "everyone queued");
    e.check_invariants();
    // Owner 20 (connection 2) is granted k1; owner 14 times out.
    e.release(secs(2), 100, k1, "k1", &mut out);
    e.tick(secs(3), &mut out);
    let r = drain(&mut out);
    assert_eq!(r[1], (2, a(3, 20, "k1")));
    assert!(r.contains(&(1, t(14, "k2"))));
    e.check_invariants();
    let before = e.waiter_count();

    e.disconnect(secs(3), 1, &mut out);
    assert!(drain(&mut out).is_empty());
    assert_eq!(e.waiter_count(), before - 4, "owners 11, 12, 13 and 15");
    for key in ["k1", "k2"] {
        let owners = e.queued_owners(key);
        assert!(owners.iter().all(|o| !(10..20).contains(o)), "{key}");
    }
    assert_eq!(e.queued_owners("k1")[0], 30, "connection 3 keeps its place");
    e.check_invariants();
    // Disconnecting again, or a connection that never queued, changes
    // nothing.
    e.disconnect(secs(3), 1, &mut out);
    e.disconnect(secs(3), 7, &mut out);
    assert_eq!(e.waiter_count(), before - 4);
    // Every other connection goes too: nothing is left queued.
    for c in (1_000..3_000u64).chain([2, 3]) {
        e.disconnect(secs(3), c, &mut out);
    }
    assert_eq!(e.waiter_count(), 0);
    assert!(drain(&mut out).is_empty());
    e.check_invariants();
}

// ------------------------------------------------------------------ tokens

/// Fencing tokens: the first comes from the caller (0 is never issued),
/// and every grant (fresh, takeover, handover on release, handover on
/// expiry) gets a larger one.
#[test]
fn tokens_start_where_the_caller_says_and_strictly_increase_over_every_kind_of_grant() {
    let e0 = Engine::new(EngineLimits::default(), 0);
    assert_eq!(e0.next_token(), 1, "0 is never a token");

    let mut e = Engine::new(EngineLimits::default(), 5_000);
    let mut out = Outbox::new();
    let fresh = granted(e.acquire(secs(0), 1, acq("k", 1, 0, 1), &mut out));
    let takeover = granted(e.acquire(secs(1).add_ms(1), 1, acq("k", 2, 0, 2), &mut out));
    e.acquire(secs(1), 2, acq("k", 3, 9, 1), &mut out);
    e.acquire(secs(1), 2, acq("k", 4, 9, 1), &mut out);
    out.clear();
    e.release(secs(2), 1, takeover, "k", &mut out);
    let on_release = match drain(&mut out)[1].1 {
        R::A { token, .. } => token,
        ref other => panic!("{other:?}"),
    };
    e.tick(secs(3).add_ms(1), &mut out);
    let on_expiry = match drain(&mut out)[0].1 {
        R::A { token, .. } => token,
        ref other => panic!("{other:?}"),
    };
    assert_eq!(
        [fresh, takeover, on_release, on_expiry],
        [5_000, 5_001, 5_002, 5_003]
    );
    assert_eq!(e.next_token(), 5_004);
}

/// `raise_next_token` moves the next token up (cluster mode uses the log
/// index) and never down.
#[test]
fn raise_next_token_only_ever_raises() {
    let mut e = Engine::replicated(EngineLimits::default(), 10);
    e.raise_next_token(50);
    assert_eq!(e.next_token(), 50);
    e.raise_next_token(20);
    assert_eq!(e.next_token(), 50);
    let mut out = Outbox::new();
    assert_eq!(
        e.acquire(secs(0), 1, acq("k", 1, 0, 1), &mut out),
        AcquireOutcome::Granted(50)
    );
}

// ------------------------------------------------------------------ stale waiters

/// A waiter whose wait ran out is never granted, even when the release (or
/// the lease expiry) is processed before its own timer: it gets T and the
/// next live waiter (or nobody) gets the key. This is the bug that let etcd
/// grant locks to clients that had given up (etcd-io/etcd#11456).
#[test]
fn a_waiter_whose_wait_ran_out_gets_timeout_not_the_key_even_before_tick() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("k", 1, 0, 30), &mut out);
    e.acquire(secs(0), 2, acq("k", 2, 1, 30), &mut out); // gives up at 1 s
    e.acquire(secs(0), 3, acq("k", 3, 9, 30), &mut out); // gives up at 9 s
    out.clear();
    // Release exactly at owner 2's deadline, with no tick in between.
    e.release(secs(1), 1, 1, "k", &mut out);
    assert_eq!(
        drain(&mut out),
        vec![(1, rel(1, "k")), (2, t(2, "k")), (3, a(2, 3, "k"))]
    );
    e.check_invariants();
}

/// The same rule on the expiry path: a tick that runs late (after both the
/// lease and the waiter's wait ran out) answers T, never a late grant.
#[test]
fn a_late_tick_never_grants_to_a_waiter_whose_wait_ran_out() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("k", 1, 0, 2), &mut out);
    e.acquire(secs(0), 2, acq("k", 2, 4, 30), &mut out);
    out.clear();
    e.tick(secs(4), &mut out); // the loop stalled past 2 s and 4 s
    assert_eq!(drain(&mut out), vec![(2, t(2, "k"))]);
    assert_eq!(e.holder(secs(4), "k"), Some((1, true)));
    e.check_invariants();
}

/// And on the explicit path: `expire` at a time when the head waiter's wait
/// ran out skips it.
#[test]
fn an_explicit_expire_skips_waiters_whose_wait_ran_out() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("k", 1, 0, 60), &mut out);
    e.acquire(secs(0), 2, acq("k", 2, 1, 30), &mut out);
    out.clear();
    assert!(e.expire(secs(2), "k", 1, &mut out));
    assert_eq!(drain(&mut out), vec![(2, t(2, "k"))]);
    assert_eq!(e.key_count(), 0);
    e.check_invariants();
}

// ------------------------------------------------------------------ replicated mode

/// Cluster mode: the state machine never reads time. However far `now`
/// moves, no lease expires and no wait runs out; only committed `expire` and
/// `wait_timeout` operations change anything, and stale ones are no-ops.
#[test]
fn in_replicated_mode_nothing_expires_without_an_explicit_operation() {
    let mut e = Engine::replicated(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("k", 1, 0, 1), &mut out);
    let w2 = match e.acquire(secs(0), 2, acq("k", 2, 1, 7), &mut out) {
        AcquireOutcome::Queued(w) => w,
        other => panic!("{other:?}"),
    };
    let w3 = match e.acquire(secs(0), 3, acq("k", 3, 1, 8), &mut out) {
        AcquireOutcome::Queued(w) => w,
        other => panic!("{other:?}"),
    };
    out.clear();
    let far = secs(1_000_000);
    assert_eq!(e.next_deadline(), None);
    e.tick(far, &mut out);
    assert!(drain(&mut out).is_empty());
    assert_eq!(e.holder(far, "k"), Some((1, false)));
    // A takeover does not happen either: the lease is not "expired".
    assert_eq!(
        e.acquire(far, 4, acq("k", 4, 0, 1), &mut out),
        AcquireOutcome::Timeout
    );
    out.clear();

    // Stale operations: wrong token, unknown key, unknown waiter.
    assert!(!e.expire(far, "k", 99, &mut out));
    assert!(!e.expire(far, "nope", 1, &mut out));
    assert!(!e.wait_timeout(far, "k", 12345, &mut out));
    assert!(!e.wait_timeout(far, "nope", w2, &mut out));
    assert!(drain(&mut out).is_empty());

    // The committed expire hands over to the head waiter (lease ignored).
    assert!(e.expire(far, "k", 1, &mut out));
    assert_eq!(drain(&mut out), vec![(2, a(2, 2, "k"))]);
    assert!(
        !e.expire(far, "k", 1, &mut out),
        "the same expire again is stale"
    );
    assert!(!e.wait_timeout(far, "k", w2, &mut out), "already granted");
    assert_eq!(e.holder(far, "k"), Some((2, false)));
    e.check_invariants();

    // A committed wait timeout answers T once.
    assert!(e.wait_timeout(far, "k", w3, &mut out));
    assert_eq!(drain(&mut out), vec![(3, t(3, "k"))]);
    assert!(!e.wait_timeout(far, "k", w3, &mut out));
    assert!(drain(&mut out).is_empty());
    // Expire with no waiters deletes the key.
    assert!(e.expire(far, "k", 2, &mut out));
    assert!(drain(&mut out).is_empty());
    assert_eq!(e.key_count(), 0);
    e.check_invariants();
}

// ------------------------------------------------------------------ token ceiling

/// With no token below the ceiling left, nothing is granted: a new key or a
/// takeover is B, a grant that ends deletes the key and answers its waiters
/// T (a grant would need a token). Raising the ceiling resumes grants.
#[test]
fn at_the_token_ceiling_nothing_is_granted_until_it_is_raised() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("k", 1, 0, 1), &mut out);
    e.acquire(secs(0), 1, acq("held", 2, 0, 30), &mut out);
    e.acquire(secs(0), 2, acq("held", 3, 9, 30), &mut out);
    out.clear();
    e.set_token_ceiling(3);
    assert!(e.tokens_exhausted());
    assert_eq!(
        e.acquire(secs(0), 3, acq("new", 4, 0, 1), &mut out),
        AcquireOutcome::Busy
    );
    assert_eq!(
        e.acquire(secs(1).add_ms(1), 3, acq("k", 5, 0, 1), &mut out),
        AcquireOutcome::Busy,
        "takeover needs a token too"
    );
    assert!(e.release(secs(1), 1, 2, "held", &mut out));
    assert_eq!(
        drain(&mut out),
        vec![
            (3, b(4, "new")),
            (3, b(5, "k")),
            (1, rel(2, "held")),
            (2, t(3, "held"))
        ]
    );
    assert_eq!(e.holder(secs(1), "held"), None);
    e.check_invariants();

    e.set_token_ceiling(100);
    assert!(!e.tokens_exhausted());
    assert_eq!(
        e.acquire(secs(1).add_ms(1), 3, acq("k", 6, 0, 1), &mut out),
        AcquireOutcome::Granted(3)
    );
}

// ------------------------------------------------------------------ owners

/// PROTOCOL §2.3: an owner equal to the holder's owner is just another client:
/// it does not get the active token back and does not renew the lease.
#[test]
fn an_owner_equal_to_the_holders_owner_gets_no_special_treatment() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    e.acquire(secs(0), 1, acq("k", 77, 0, 5), &mut out);
    out.clear();
    assert_eq!(
        e.acquire(secs(1), 1, acq("k", 77, 0, 30), &mut out),
        AcquireOutcome::Timeout
    );
    assert!(matches!(
        e.acquire(secs(1), 1, acq("k", 77, 9, 30), &mut out),
        AcquireOutcome::Queued(_)
    ));
    assert_eq!(drain(&mut out), vec![(1, t(77, "k"))]);
    // The lease was not renewed: the key expires at 5 s and goes to the
    // queued acquire (same owner) with a new token.
    assert_eq!(e.holder(secs(5).add_ms(1), "k"), Some((1, true)));
    e.tick(secs(5).add_ms(1), &mut out);
    assert_eq!(drain(&mut out), vec![(1, a(2, 77, "k"))]);
    e.check_invariants();
}

/// PROTOCOL §5.2, first row: an extension of a live grant keeps the token and
/// the waiters' places and moves the expiry, so the waiter is handed the
/// key at the new end, not the old one.
#[test]
fn an_extension_moves_the_expiry_and_keeps_token_and_queue() {
    let mut eng = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    let t0 = Millis(10_000);
    assert_eq!(
        eng.acquire(t0, 1, acq("k", 1, 0, 5), &mut out),
        AcquireOutcome::Granted(1)
    );
    assert!(matches!(
        eng.acquire(t0, 2, acq("k", 2, 60, 7), &mut out),
        AcquireOutcome::Queued(_)
    ));
    drain(&mut out);
    // At t0 + 4 s, extend by 10 s: the lease now ends once t0 + 14 s is past.
    let t1 = t0.add_secs(4);
    assert!(eng.extend(t1, 1, "k", 1, 10, &mut out));
    assert_eq!(drain(&mut out), vec![(1, ext(1, "k"))]);
    assert_eq!(eng.queued_owners("k"), vec![2]);
    eng.check_invariants();
    // The old expiry passes: nothing happens.
    eng.tick(t0.add_secs(5).add_ms(1), &mut out);
    assert_eq!(drain(&mut out), vec![]);
    assert_eq!(eng.holder(t0.add_secs(6), "k"), Some((1, false)));
    eng.tick(t1.add_secs(10), &mut out);
    assert_eq!(drain(&mut out), vec![], "not yet past t1 + 10 s");
    eng.tick(t1.add_secs(10).add_ms(1), &mut out);
    assert_eq!(drain(&mut out), vec![(2, a(2, 2, "k"))]);
    eng.check_invariants();
}

/// An extension may shorten the lease; a waiter then gets the key at the
/// shorter end (the key's timer is moved up, never left late).
#[test]
fn a_shorter_extension_hands_over_at_the_shorter_end() {
    let mut eng = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    let t0 = Millis(0);
    eng.acquire(t0, 1, acq("k", 1, 0, 60), &mut out);
    eng.acquire(t0, 2, acq("k", 2, 100, 5), &mut out);
    drain(&mut out);
    assert!(eng.extend(t0.add_secs(1), 1, "k", 1, 2, &mut out));
    drain(&mut out);
    let end = t0.add_secs(3).add_ms(1);
    assert_eq!(eng.next_deadline(), Some(end));
    eng.tick(end, &mut out);
    assert_eq!(drain(&mut out), vec![(2, a(2, 2, "k"))]);
    eng.check_invariants();
}

/// The other rows of PROTOCOL §5.2: an ended lease is never revived (even
/// before the sweep or a takeover), a wrong token or an unknown key
/// changes nothing, and each gets X.
#[test]
fn ended_leases_wrong_tokens_and_unknown_keys_get_x() {
    let mut eng = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    eng.acquire(Millis(0), 1, acq("k", 1, 0, 2), &mut out);
    drain(&mut out);
    assert!(!eng.extend(Millis(100), 1, "k", 9, 30, &mut out));
    assert!(!eng.extend(Millis(100), 1, "nope", 1, 30, &mut out));
    assert_eq!(
        drain(&mut out),
        vec![(1, not_ext(9, "k")), (1, not_ext(1, "nope"))]
    );
    // Still exactly the 2 s lease: ends once 2000 ms are past.
    assert_eq!(eng.holder(Millis(2000), "k"), Some((1, false)));
    assert_eq!(eng.holder(Millis(2001), "k"), Some((1, true)));
    // Ended, registered, not swept: X, and the key stays ended.
    assert!(!eng.extend(Millis(2001), 1, "k", 1, 30, &mut out));
    assert_eq!(drain(&mut out), vec![(1, not_ext(1, "k"))]);
    assert_eq!(
        eng.acquire(Millis(2002), 2, acq("k", 2, 0, 5), &mut out),
        AcquireOutcome::Granted(2),
        "the ended lease is taken over"
    );
    eng.check_invariants();
}

/// `--max-hold`: an extension that would carry the grant past grant time
/// + max hold is refused with X and leaves the current lease as it was.
#[test]
fn max_hold_caps_extensions_from_the_grant() {
    let limits = EngineLimits {
        max_hold_ms: 20_000,
        ..EngineLimits::default()
    };
    let mut eng = Engine::new(limits, 1);
    let mut out = Outbox::new();
    eng.acquire(Millis(0), 1, acq("k", 1, 0, 10), &mut out);
    drain(&mut out);
    // 5 s + 15 s = 20 s: exactly the cap, allowed.
    assert!(eng.extend(Millis(5000), 1, "k", 1, 15, &mut out));
    // 6 s + 15 s passes it.
    assert!(!eng.extend(Millis(6000), 1, "k", 1, 15, &mut out));
    assert_eq!(
        drain(&mut out),
        vec![(1, ext(1, "k")), (1, not_ext(1, "k"))]
    );
    // The lease from the accepted extension stands.
    assert_eq!(eng.holder(Millis(20_000), "k"), Some((1, false)));
    assert_eq!(eng.holder(Millis(20_001), "k"), Some((1, true)));
    // A new grant starts a new hold.
    eng.acquire(Millis(30_000), 2, acq("k", 2, 0, 10), &mut out);
    assert!(eng.extend(Millis(35_000), 2, "k", 2, 15, &mut out));
    eng.check_invariants();
}

/// A holder that extends every second for an hour, with a waiter queued,
/// leaves the deadline index at one entry for the key throughout.
#[test]
fn an_hour_of_extensions_leaves_one_timer_entry() {
    let mut eng = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    eng.acquire(Millis(0), 1, acq("k", 1, 0, 3), &mut out);
    eng.acquire(Millis(0), 2, acq("k", 2, 255, 3), &mut out);
    let mut now = Millis(0);
    for _ in 0..3600 {
        now = now.add_secs(1);
        assert!(eng.extend(now, 1, "k", 1, 3, &mut out));
        eng.tick(now, &mut out);
        out.clear();
    }
    // check_invariants asserts exactly one timer entry per key with waiters.
    eng.check_invariants();
    assert_eq!(eng.holder(now, "k"), Some((1, false)));
    // The waiter's 255 s ran out long ago: it got T at its deadline.
    assert_eq!(eng.waiter_count(), 0);
}

/// The sweep visits the table in steps: each tick deletes a bounded part
/// of a large set of expired keys, next_deadline asks for the next step at
/// once, and after enough ticks every expired key is gone while live ones
/// stay.
#[test]
fn the_sweep_runs_in_steps() {
    let limits = EngineLimits {
        sweep_interval_ms: 1000,
        ..EngineLimits::default()
    };
    let mut eng = Engine::new(limits, 1);
    let mut out = Outbox::new();
    let n = 200_000;
    for i in 0..n {
        let key = format!("k{i}");
        let lease = if i % 10 == 0 { 100 } else { 1 };
        eng.acquire(Millis(0), 1, acq(&key, 1, 0, lease), &mut out);
        out.clear();
    }
    let now = Millis(5000);
    eng.tick(now, &mut out);
    let after_one = eng.key_count();
    assert!(after_one > n / 10, "one step swept {} keys", n - after_one);
    assert!(after_one < n, "the first step deleted nothing");
    assert_eq!(
        eng.next_deadline(),
        Some(Millis::ZERO),
        "more steps are due"
    );
    let mut steps = 1;
    while eng.next_deadline() == Some(Millis::ZERO) {
        eng.tick(now, &mut out);
        steps += 1;
        assert!(steps < 1000, "the sweep never ends");
    }
    assert!(steps > 2, "{steps} steps for {n} keys");
    assert_eq!(eng.key_count(), n / 10);
    eng.check_invariants();
    // The floor now lets the sweep sleep until the live leases end.
    assert_eq!(eng.next_deadline(), Some(Millis(100_001)));
}

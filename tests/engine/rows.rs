//! One test per row of the PROTOCOL §2.1 (acquire) and §2.2 (release) tables.
//!
//! Each test is named after its row, drives the engine exactly as the row
//! describes, and asserts the exact reply bytes on the wire (built here by
//! hand from PROTOCOL §1, not with the codec under test) plus the state the row
//! leaves behind: holder, token, queue, key count.

use ticketd::engine::{Acquire, AcquireOutcome, ConnId, Engine, Outbox};
use ticketd::limits::EngineLimits;
use ticketd::proto::encode_reply;
use ticketd::time::Millis;

const T0: Millis = Millis(10_000);

/// Sweeps are far apart here so `next_deadline` names the row's own timers.
fn limits() -> EngineLimits {
    EngineLimits {
        sweep_interval_ms: 3_600_000,
        ..EngineLimits::default()
    }
}

fn engine() -> Engine {
    Engine::new(limits(), 100)
}

fn acq(key: &str, owner: u64, wait_s: u8, lease_s: u8) -> Acquire<'_> {
    Acquire {
        key,
        owner,
        wait_s,
        lease_s,
    }
}

/// The replies in the outbox as (connection, wire bytes, lease), then empty it.
fn drain(out: &mut Outbox) -> Vec<(ConnId, Vec<u8>, u8)> {
    let v = out
        .iter()
        .map(|a| {
            let mut bytes = Vec::new();
            encode_reply(&a.reply, &mut bytes);
            (a.conn, bytes, a.lease_s)
        })
        .collect();
    out.clear();
    v
}

fn frame(op: u8, a: u64, b: Option<u64>, key: &str) -> Vec<u8> {
    let mut v = vec![op];
    v.extend_from_slice(&a.to_be_bytes());
    if let Some(b) = b {
        v.extend_from_slice(&b.to_be_bytes());
    }
    v.extend_from_slice(key.as_bytes());
    v.push(b'\n');
    v
}

fn wire_a(token: u64, owner: u64, key: &str) -> Vec<u8> {
    frame(b'A', token, Some(owner), key)
}
fn wire_t(owner: u64, key: &str) -> Vec<u8> {
    frame(b'T', owner, None, key)
}
fn wire_b(owner: u64, key: &str) -> Vec<u8> {
    frame(b'B', owner, None, key)
}
fn wire_r(token: u64, key: &str) -> Vec<u8> {
    frame(b'R', token, None, key)
}
fn wire_n(token: u64, key: &str) -> Vec<u8> {
    frame(b'N', token, None, key)
}

// ---------------------------------------------------------------- §2.1 Acquire

#[test]
fn acquire_not_registered_registers_and_grants_a_new_token() {
    let mut e = engine();
    let mut out = Outbox::new();
    let got = e.acquire(T0, 1, acq("db", 0x0A0B, 5, 30), &mut out);
    assert_eq!(got, AcquireOutcome::Granted(100));
    assert_eq!(drain(&mut out), vec![(1, wire_a(100, 0x0A0B, "db"), 30)]);
    assert_eq!(e.key_count(), 1);
    assert_eq!(e.holder(T0, "db"), Some((100, false)));
    // expiry = now + lease: still valid at it, over once it is past.
    assert_eq!(e.holder(T0.add_secs(30), "db"), Some((100, false)));
    assert_eq!(e.holder(T0.add_secs(30).add_ms(1), "db"), Some((100, true)));
    assert_eq!(e.next_token(), 101);
    e.check_invariants();
}

#[test]
fn acquire_registered_lease_expired_takes_over_with_a_new_token() {
    let mut e = engine();
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("db", 1, 0, 2), &mut out);
    out.clear();
    let later = T0.add_secs(2).add_ms(1); // just past expiry; no tick has run
    let got = e.acquire(later, 2, acq("db", 2, 0, 7), &mut out);
    assert_eq!(got, AcquireOutcome::Granted(101));
    assert_eq!(drain(&mut out), vec![(2, wire_a(101, 2, "db"), 7)]);
    assert_eq!(e.key_count(), 1);
    // expiry = now + the new lease
    assert_eq!(e.holder(later.add_secs(7), "db"), Some((101, false)));
    assert_eq!(
        e.holder(later.add_secs(7).add_ms(1), "db"),
        Some((101, true))
    );
    // The old holder's token no longer releases anything.
    e.release(later, 1, 100, "db", &mut out);
    assert_eq!(drain(&mut out), vec![(1, wire_n(100, "db"), 0)]);
    assert_eq!(e.holder(later, "db"), Some((101, false)));
    e.check_invariants();
}

#[test]
fn acquire_registered_valid_holder_wait_0_answers_timeout_and_does_not_queue() {
    let mut e = engine();
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("db", 1, 0, 30), &mut out);
    out.clear();
    let got = e.acquire(T0.add_ms(29_999), 2, acq("db", 2, 0, 30), &mut out);
    assert_eq!(got, AcquireOutcome::Timeout);
    assert_eq!(drain(&mut out), vec![(2, wire_t(2, "db"), 0)]);
    assert_eq!(e.waiter_count(), 0);
    assert!(e.queued_owners("db").is_empty());
    assert_eq!(e.holder(T0, "db"), Some((100, false)));
    assert_eq!(e.next_token(), 101, "no token spent on a T");
    e.check_invariants();
}

#[test]
fn acquire_registered_valid_holder_wait_positive_queues_and_is_granted_on_release() {
    let mut e = engine();
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("db", 1, 0, 30), &mut out);
    out.clear();
    let got = e.acquire(T0, 2, acq("db", 2, 5, 9), &mut out);
    assert!(matches!(got, AcquireOutcome::Queued(_)));
    assert!(drain(&mut out).is_empty(), "a queued acquire answers later");
    assert_eq!(e.queued_owners("db"), vec![2]);
    assert_eq!(e.waiter_count(), 1);
    e.check_invariants();
    let at = T0.add_ms(4_999);
    assert!(e.release(at, 1, 100, "db", &mut out));
    assert_eq!(
        drain(&mut out),
        vec![(1, wire_r(100, "db"), 0), (2, wire_a(101, 2, "db"), 9)]
    );
    assert_eq!(e.waiter_count(), 0);
    assert_eq!(e.holder(at.add_secs(9), "db"), Some((101, false)));
    assert_eq!(e.holder(at.add_secs(9).add_ms(1), "db"), Some((101, true)));
    e.check_invariants();
}

#[test]
fn acquire_registered_valid_holder_wait_positive_queues_and_is_granted_on_expiry() {
    let mut e = engine();
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("db", 1, 0, 3), &mut out);
    e.acquire(T0, 2, acq("db", 2, 10, 4), &mut out);
    out.clear();
    // The lease is over once now + lease is past: 1 ms after it.
    let expiry = T0.add_secs(3).add_ms(1);
    assert_eq!(e.next_deadline(), Some(expiry));
    e.tick(T0, &mut out); // nothing due yet
    assert!(drain(&mut out).is_empty());
    e.tick(Millis(expiry.0 - 1), &mut out);
    assert!(drain(&mut out).is_empty(), "not before the lease runs out");
    e.tick(expiry, &mut out);
    assert_eq!(drain(&mut out), vec![(2, wire_a(101, 2, "db"), 4)]);
    assert_eq!(e.holder(expiry, "db"), Some((101, false)));
    assert_eq!(e.waiter_count(), 0);
    e.check_invariants();
}

#[test]
fn acquire_registered_valid_holder_wait_positive_queues_and_times_out_when_wait_runs_out() {
    let mut e = engine();
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("db", 1, 0, 30), &mut out);
    e.acquire(T0, 2, acq("db", 2, 5, 9), &mut out);
    out.clear();
    let runs_out = T0.add_secs(5);
    assert_eq!(e.next_deadline(), Some(runs_out));
    e.tick(Millis(runs_out.0 - 1), &mut out);
    assert!(drain(&mut out).is_empty());
    e.tick(runs_out, &mut out);
    assert_eq!(drain(&mut out), vec![(2, wire_t(2, "db"), 0)]);
    assert_eq!(e.waiter_count(), 0);
    assert_eq!(e.holder(runs_out, "db"), Some((100, false)));
    e.check_invariants();
}

#[test]
fn acquire_queue_or_capacity_at_limit_answers_busy_for_max_keys() {
    let limits = EngineLimits {
        max_keys: 2,
        ..limits()
    };
    let mut e = Engine::new(limits, 1);
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("a", 1, 0, 30), &mut out);
    e.acquire(T0, 1, acq("b", 2, 0, 30), &mut out);
    out.clear();
    let got = e.acquire(T0, 3, acq("c", 3, 5, 30), &mut out);
    assert_eq!(got, AcquireOutcome::Busy);
    assert_eq!(drain(&mut out), vec![(3, wire_b(3, "c"), 0)]);
    assert_eq!(e.key_count(), 2);
    assert_eq!(e.holder(T0, "c"), None);
    assert_eq!(e.next_token(), 3, "no token spent on a B");
    e.check_invariants();
}

#[test]
fn acquire_queue_or_capacity_at_limit_answers_busy_for_max_waiters_per_key() {
    let limits = EngineLimits {
        max_waiters_per_key: 2,
        ..limits()
    };
    let mut e = Engine::new(limits, 1);
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("a", 1, 0, 30), &mut out);
    e.acquire(T0, 2, acq("a", 2, 5, 30), &mut out);
    e.acquire(T0, 3, acq("a", 3, 5, 30), &mut out);
    out.clear();
    let got = e.acquire(T0, 4, acq("a", 4, 5, 30), &mut out);
    assert_eq!(got, AcquireOutcome::Busy);
    assert_eq!(drain(&mut out), vec![(4, wire_b(4, "a"), 0)]);
    assert_eq!(e.queued_owners("a"), vec![2, 3]);
    // Another key still has room.
    e.acquire(T0, 1, acq("b", 5, 0, 30), &mut out);
    out.clear();
    assert!(matches!(
        e.acquire(T0, 4, acq("b", 6, 5, 30), &mut out),
        AcquireOutcome::Queued(_)
    ));
    e.check_invariants();
}

#[test]
fn acquire_queue_or_capacity_at_limit_answers_busy_for_max_waiters() {
    let limits = EngineLimits {
        max_waiters: 2,
        ..limits()
    };
    let mut e = Engine::new(limits, 1);
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("a", 1, 0, 30), &mut out);
    e.acquire(T0, 1, acq("b", 2, 0, 30), &mut out);
    e.acquire(T0, 2, acq("a", 3, 5, 30), &mut out);
    e.acquire(T0, 2, acq("b", 4, 5, 30), &mut out);
    out.clear();
    let got = e.acquire(T0, 3, acq("b", 5, 5, 30), &mut out);
    assert_eq!(got, AcquireOutcome::Busy);
    assert_eq!(drain(&mut out), vec![(3, wire_b(5, "b"), 0)]);
    assert_eq!(e.waiter_count(), 2);
    assert_eq!(e.queued_owners("b"), vec![4]);
    e.check_invariants();
}

// ---------------------------------------------------------------- §2.2 Release

#[test]
fn release_token_matches_waiters_queued_hands_over_to_head_with_new_token() {
    let mut e = engine();
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("db", 1, 0, 30), &mut out);
    e.acquire(T0, 2, acq("db", 2, 9, 4), &mut out);
    e.acquire(T0, 3, acq("db", 3, 9, 6), &mut out);
    out.clear();
    let at = T0.add_secs(1);
    assert!(e.release(at, 1, 100, "db", &mut out));
    assert_eq!(
        drain(&mut out),
        vec![(1, wire_r(100, "db"), 0), (2, wire_a(101, 2, "db"), 4)]
    );
    // expiry = now + that waiter's lease
    assert_eq!(e.holder(at.add_secs(4), "db"), Some((101, false)));
    assert_eq!(e.holder(at.add_secs(4).add_ms(1), "db"), Some((101, true)));
    assert_eq!(e.queued_owners("db"), vec![3]);
    assert_eq!(e.key_count(), 1);
    e.check_invariants();
}

#[test]
fn release_token_matches_no_waiters_deletes_the_key() {
    let mut e = engine();
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("db", 1, 0, 30), &mut out);
    out.clear();
    assert!(e.release(T0, 7, 100, "db", &mut out));
    assert_eq!(drain(&mut out), vec![(7, wire_r(100, "db"), 0)]);
    assert_eq!(e.key_count(), 0);
    assert_eq!(e.holder(T0, "db"), None);
    // Deleted: a second release of the same token is N.
    assert!(!e.release(T0, 7, 100, "db", &mut out));
    assert_eq!(drain(&mut out), vec![(7, wire_n(100, "db"), 0)]);
    e.check_invariants();
}

#[test]
fn release_token_does_not_match_leaves_the_lock() {
    let mut e = engine();
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("db", 1, 0, 30), &mut out);
    e.acquire(T0, 2, acq("db", 2, 9, 30), &mut out);
    out.clear();
    for wrong in [0, 99, 101, u64::MAX] {
        assert!(!e.release(T0, 3, wrong, "db", &mut out));
        assert_eq!(drain(&mut out), vec![(3, wire_n(wrong, "db"), 0)]);
    }
    assert_eq!(e.holder(T0, "db"), Some((100, false)));
    assert_eq!(e.queued_owners("db"), vec![2]);
    assert_eq!(e.next_token(), 101);
    e.check_invariants();
}

#[test]
fn release_not_registered_answers_not_released() {
    let mut e = engine();
    let mut out = Outbox::new();
    e.acquire(T0, 1, acq("db", 1, 0, 30), &mut out);
    out.clear();
    assert!(!e.release(T0, 1, 100, "other", &mut out));
    assert_eq!(drain(&mut out), vec![(1, wire_n(100, "other"), 0)]);
    assert_eq!(e.key_count(), 1);
    assert_eq!(e.holder(T0, "other"), None);
    e.check_invariants();
}

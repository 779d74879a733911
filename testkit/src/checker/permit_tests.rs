//! The checks of keys with a limit (PROTOCOL §6): each new property fails
//! on a history built to break it and passes on the legal one beside it.

use super::*;

const S: u64 = 1_000_000;

/// Client `client` (on session `client`) acquires `key` with `places` at
/// `at_us`, lease 10 s, and is granted `token` 100us later.
fn granted(h: &mut History, client: u64, key: &str, places: Places, at_us: u64, token: u64) {
    let op = h.acquire_with(client, client, key, client, 0, 10, places, at_us);
    h.acquired(op, Outcome::Granted { token }, at_us + 100);
}

/// Client `client` releases `token` of `key` at `at_us`.
fn released(h: &mut History, client: u64, key: &str, token: u64, at_us: u64) {
    let op = h.release(client, client, key, token, at_us);
    h.released(op, ReleaseOutcome::Released, at_us + 50);
}

/// `n` clients holding permits of a semaphore of `limit` on "pool" at once.
fn holders(limit: u16, n: u64) -> History {
    let mut h = History::new();
    for c in 1..=n {
        granted(&mut h, c, "pool", Places::semaphore(limit), c * S, c);
    }
    h
}

fn fails(h: &History, property: Property, words: &[&str]) {
    let v = h.check().expect_err("the broken history must fail");
    assert_eq!(v.property, property, "wrong property: {v}");
    let text = v.to_string();
    for w in words {
        assert!(text.contains(w), "message {text:?} does not mention {w:?}");
    }
}

#[test]
fn as_many_holders_as_the_limit_pass() {
    let r = holders(3, 3)
        .check()
        .expect("3 holders of a semaphore of 3");
    assert_eq!((r.grants, r.permit_acquires), (3, 3));
}

#[test]
fn one_holder_more_than_the_limit_fails_the_permit_count() {
    fails(
        &holders(3, 4),
        Property::PermitCount,
        &[
            "key \"pool\" (limit 3)",
            "4 grants at once",
            "token 1 held by client 1",
            "token 4 held by client 4",
        ],
    );
}

#[test]
fn a_place_freed_by_a_release_may_be_taken_again() {
    let mut h = holders(3, 3);
    released(&mut h, 2, "pool", 2, 4 * S);
    granted(&mut h, 4, "pool", Places::semaphore(3), 4 * S + 10, 4);
    assert_eq!(h.check().expect("a freed place").grants, 4);
    // Taken before the release was even sent: four at once.
    let mut h = holders(3, 3);
    released(&mut h, 2, "pool", 2, 5 * S);
    granted(&mut h, 4, "pool", Places::semaphore(3), 4 * S + 10, 4);
    fails(
        &h,
        Property::PermitCount,
        &["4 grants at once at 4000110us"],
    );
}

#[test]
fn shared_holders_of_a_read_write_lock_may_overlap() {
    let mut h = History::new();
    for c in 1..=5 {
        granted(&mut h, c, "rw", Places::shared(), c * S, c);
    }
    assert_eq!(h.check().expect("five readers").grants, 5);
}

#[test]
fn a_shared_holder_beside_an_exclusive_one_fails() {
    let mut h = History::new();
    granted(&mut h, 1, "rw", Places::shared(), 0, 1);
    granted(&mut h, 2, "rw", Places::exclusive(), S, 2);
    fails(
        &h,
        Property::ExclusiveAlone,
        &[
            "key \"rw\"",
            "shared token 1 held by client 1",
            "exclusive token 2 held by client 2",
        ],
    );
    // The other way round: a reader let in beside the writer.
    let mut h = History::new();
    granted(&mut h, 1, "rw", Places::exclusive(), 0, 1);
    granted(&mut h, 2, "rw", Places::shared(), S, 2);
    fails(&h, Property::ExclusiveAlone, &["exclusive token 1"]);
}

#[test]
fn two_exclusive_holders_fail_and_one_after_the_other_pass() {
    let mut h = History::new();
    granted(&mut h, 1, "rw", Places::exclusive(), 0, 1);
    granted(&mut h, 2, "rw", Places::exclusive(), S, 2);
    fails(&h, Property::ExclusiveAlone, &["token 1", "token 2"]);
    let mut h = History::new();
    granted(&mut h, 1, "rw", Places::exclusive(), 0, 1);
    released(&mut h, 1, "rw", 1, S);
    granted(&mut h, 2, "rw", Places::exclusive(), S, 2);
    granted(&mut h, 3, "rw", Places::shared(), 30 * S, 3);
    assert!(h.check().is_ok());
}

#[test]
fn grants_of_two_limits_at_once_fail_and_a_mutex_beside_a_permit_too() {
    let mut h = History::new();
    granted(&mut h, 1, "pool", Places::semaphore(3), 0, 1);
    granted(&mut h, 2, "pool", Places::semaphore(2), S, 2);
    fails(
        &h,
        Property::KeyLimit,
        &["granted with limit 3", "granted with limit 2"],
    );
    // A plain acquire is limit 1: beside a permit it is two holders of a mutex.
    let mut h = History::new();
    granted(&mut h, 1, "pool", Places::semaphore(3), 0, 1);
    let op = h.acquire(2, 2, "pool", 2, 0, 10, S);
    h.acquired(op, Outcome::Granted { token: 2 }, S + 100);
    fails(&h, Property::MutualExclusion, &["token 1", "token 2"]);
    // Once every grant of the key ended, it may come back with another limit.
    let mut h = History::new();
    granted(&mut h, 1, "pool", Places::semaphore(3), 0, 1);
    released(&mut h, 1, "pool", 1, S);
    granted(&mut h, 2, "pool", Places::semaphore(2), 2 * S, 2);
    assert!(h.check().is_ok());
}

#[test]
fn a_limit_mismatch_must_name_the_limit_standing() {
    let mismatch = |named: u16, asked: u16| {
        let mut h = holders(3, 2);
        let op = h.acquire_with(9, 9, "pool", 9, 0, 10, Places::semaphore(asked), 3 * S);
        h.acquired(op, Outcome::LimitMismatch { limit: named }, 3 * S + 100);
        h
    };
    let r = mismatch(3, 2).check().expect("L names the key's limit");
    assert_eq!((r.limit_mismatches, r.grants), (1, 2));
    fails(
        &mismatch(4, 2),
        Property::KeyLimit,
        &["LimitMismatch with limit 4", "granted with limit 3 stood"],
    );
    fails(&mismatch(2, 2), Property::KeyLimit, &["its own limit"]);
    // A restarted server forgot the limit, even while a grace holds the
    // key: another limit may have registered it since.
    let mut h = mismatch(4, 2);
    h.server_restart_with_grace(2 * S + 500, 100);
    assert!(h.check().is_ok());
}

/// A semaphore of 2 on "pool" held by clients 1 and 2; client 3 queues at
/// 3 s (wait 20 s) and gets `third` at `third_at`; client 1 releases at
/// 4 s; client 4 acquires just after with `fourth`, queued or not, and is
/// granted token 4 at 5 s.
fn passing(third: Outcome, third_at: u64, fourth: Places, fourth_queued: bool) -> History {
    let mut h = holders(2, 2);
    let w3 = h.acquire_with(3, 3, "pool", 3, 20, 10, Places::semaphore(2), 3 * S);
    h.queued(w3, 3 * S + 50);
    released(&mut h, 1, "pool", 1, 4 * S);
    let a4 = h.acquire_with(4, 4, "pool", 4, 20, 10, fourth, 4 * S + 200);
    if fourth_queued {
        h.queued(a4, 4 * S + 250);
    }
    h.acquired(a4, Outcome::Granted { token: 4 }, 5 * S);
    h.acquired(w3, third, third_at);
    h
}

#[test]
fn a_permit_granted_past_a_waiter_fails_fifo_queued_or_not() {
    // The freed place went to client 4 while client 3 waited before it.
    for queued in [false, true] {
        let h = passing(Outcome::Timeout, 23 * S + 100, Places::semaphore(2), queued);
        let what = if queued { "queued at" } else { "not queued" };
        fails(
            &h,
            Property::Fifo,
            &["client 4", what, "client 3", "Timeout"],
        );
    }
    // Client 3 was served first (smaller token): legal.
    let mut h = passing(
        Outcome::Granted { token: 3 },
        5 * S + 10,
        Places::semaphore(2),
        false,
    );
    released(&mut h, 2, "pool", 2, 4 * S + 100);
    assert!(h.check().is_ok());
}

#[test]
fn a_waiter_whose_wait_ran_out_first_may_be_passed() {
    let mut h = holders(2, 2);
    let w3 = h.acquire_with(3, 3, "pool", 3, 1, 10, Places::semaphore(2), 3 * S);
    h.queued(w3, 3 * S + 50);
    released(&mut h, 1, "pool", 1, 4 * S);
    let a4 = h.acquire_with(4, 4, "pool", 4, 0, 10, Places::semaphore(2), 4 * S + 200);
    h.acquired(a4, Outcome::Granted { token: 4 }, 4 * S + 300);
    // Its Timeout travelled slowly, but the wait ended at 4.00005 s.
    h.acquired(w3, Outcome::Timeout, 5 * S);
    assert!(h.check().is_ok());
}

#[test]
fn a_mutex_taken_over_past_a_waiter_is_not_a_permit_violation() {
    // On a mutex the expiry path is not FIFO (PROTOCOL §2.4): a fresh
    // acquire of a key past its expiry takes it over, waiters or not.
    let mut h = History::new();
    let a = h.acquire(1, 1, "m", 1, 0, 2, 0);
    h.acquired(a, Outcome::Granted { token: 1 }, 100);
    let w = h.acquire(2, 2, "m", 2, 20, 10, S);
    h.queued(w, S + 50);
    let b = h.acquire(3, 3, "m", 3, 0, 10, 3 * S);
    h.acquired(b, Outcome::Granted { token: 2 }, 3 * S + 100);
    h.acquired(w, Outcome::Timeout, 21 * S);
    assert!(h.check().is_ok());
}

//! Every row of PROTOCOL §2 end to end, against the real binary over TCP.

use ticketd_testkit::process as common;

use std::time::Duration;

use common::{Reply, Ticketd};

fn acquired(r: &Reply, owner: u64, key: &str) -> u64 {
    match r {
        Reply::Acquired {
            token,
            owner: o,
            key: k,
        } if *o == owner && k == key => *token,
        other => panic!("expected Acquired for owner {owner} on {key:?}, got {other:?}"),
    }
}

#[test]
fn acquire_of_an_unregistered_key_is_granted_at_once_with_a_nonzero_token() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let token = acquired(&c.acquire_reply("db", 0x0A0B, 5, 30), 0x0A0B, "db");
    assert!(token > 0);
}

#[test]
fn acquire_of_an_expired_key_takes_it_over_with_a_new_token() {
    // A long sweep interval keeps the expired key registered.
    let server = Ticketd::start(&["--sweep-interval", "60"]);
    let mut c = server.connect();
    let t1 = acquired(&c.acquire_reply("k", 1, 0, 1), 1, "k");
    std::thread::sleep(Duration::from_millis(1100));
    let t2 = acquired(&c.acquire_reply("k", 2, 0, 30), 2, "k");
    assert!(t2 > t1);
    // The old holder's token no longer releases it.
    assert_eq!(
        c.release_reply("k", t1),
        Reply::NotReleased {
            token: t1,
            key: "k".into()
        }
    );
}

#[test]
fn acquire_with_wait_0_on_a_held_key_times_out_at_once() {
    let server = Ticketd::start(&[]);
    let mut a = server.connect();
    let mut b = server.connect();
    acquired(&a.acquire_reply("k", 1, 0, 30), 1, "k");
    assert_eq!(
        b.acquire_reply("k", 2, 0, 30),
        Reply::Timeout {
            owner: 2,
            key: "k".into()
        }
    );
}

#[test]
fn a_queued_acquire_is_granted_when_the_holder_releases() {
    let server = Ticketd::start(&[]);
    let mut a = server.connect();
    let mut b = server.connect();
    let t1 = acquired(&a.acquire_reply("k", 1, 0, 30), 1, "k");
    b.acquire("k", 2, 10, 30);
    assert!(b.try_recv(Duration::from_millis(200)).is_err(), "queued");
    assert_eq!(
        a.release_reply("k", t1),
        Reply::Released {
            token: t1,
            key: "k".into()
        }
    );
    let t2 = acquired(&b.recv(), 2, "k");
    assert!(t2 > t1);
}

#[test]
fn a_queued_acquire_times_out_when_its_wait_runs_out() {
    let server = Ticketd::start(&[]);
    let mut a = server.connect();
    let mut b = server.connect();
    acquired(&a.acquire_reply("k", 1, 0, 30), 1, "k");
    b.acquire("k", 2, 1, 30);
    assert!(b.try_recv(Duration::from_millis(700)).is_err());
    assert_eq!(
        b.try_recv(Duration::from_secs(2)),
        Ok(Reply::Timeout {
            owner: 2,
            key: "k".into()
        })
    );
}

#[test]
fn a_queued_acquire_is_granted_when_the_holders_lease_expires() {
    let server = Ticketd::start(&[]);
    let mut a = server.connect();
    let mut b = server.connect();
    let t1 = acquired(&a.acquire_reply("k", 1, 0, 1), 1, "k");
    b.acquire("k", 2, 10, 30);
    let r = b
        .try_recv(Duration::from_secs(3))
        .expect("granted at expiry");
    assert!(acquired(&r, 2, "k") > t1);
}

#[test]
fn a_full_queue_answers_busy_but_wait_0_still_answers_timeout() {
    let server = Ticketd::start(&["--max-waiters-per-key", "1"]);
    let mut a = server.connect();
    acquired(&a.acquire_reply("k", 1, 0, 30), 1, "k");
    a.acquire("k", 2, 30, 30); // takes the only queue slot
    assert_eq!(
        a.acquire_reply("k", 3, 30, 30),
        Reply::Busy {
            owner: 3,
            key: "k".into()
        }
    );
    assert_eq!(
        a.acquire_reply("k", 4, 0, 30),
        Reply::Timeout {
            owner: 4,
            key: "k".into()
        }
    );
}

#[test]
fn the_total_waiter_limit_answers_busy_across_keys() {
    let server = Ticketd::start(&["--max-waiters", "1"]);
    let mut a = server.connect();
    acquired(&a.acquire_reply("x", 1, 0, 30), 1, "x");
    acquired(&a.acquire_reply("y", 2, 0, 30), 2, "y");
    a.acquire("x", 3, 30, 30);
    assert_eq!(
        a.acquire_reply("y", 4, 30, 30),
        Reply::Busy {
            owner: 4,
            key: "y".into()
        }
    );
}

#[test]
fn a_new_key_beyond_max_keys_is_busy() {
    let server = Ticketd::start(&["--max-keys", "2"]);
    let mut a = server.connect();
    acquired(&a.acquire_reply("a", 1, 0, 30), 1, "a");
    acquired(&a.acquire_reply("b", 2, 0, 30), 2, "b");
    assert_eq!(
        a.acquire_reply("c", 3, 0, 30),
        Reply::Busy {
            owner: 3,
            key: "c".into()
        }
    );
}

#[test]
fn release_with_waiters_hands_the_key_to_the_head_of_the_queue_fifo() {
    let server = Ticketd::start(&[]);
    let mut holder = server.connect();
    let mut first = server.connect();
    let mut second = server.connect();
    let t1 = acquired(&holder.acquire_reply("k", 1, 0, 30), 1, "k");
    first.acquire("k", 2, 30, 30);
    // Make sure the first waiter is queued before the second.
    assert!(first.try_recv(Duration::from_millis(100)).is_err());
    second.acquire("k", 3, 30, 30);
    assert!(second.try_recv(Duration::from_millis(100)).is_err());
    holder.release("k", t1);
    assert_eq!(
        holder.recv(),
        Reply::Released {
            token: t1,
            key: "k".into()
        }
    );
    let t2 = acquired(&first.recv(), 2, "k");
    assert!(t2 > t1);
    assert!(
        second.try_recv(Duration::from_millis(200)).is_err(),
        "the second waiter still waits"
    );
    first.release("k", t2);
    assert!(matches!(first.recv(), Reply::Released { .. }));
    assert!(acquired(&second.recv(), 3, "k") > t2);
}

#[test]
fn release_without_waiters_deletes_the_key() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let t1 = acquired(&c.acquire_reply("k", 1, 0, 30), 1, "k");
    assert!(matches!(c.release_reply("k", t1), Reply::Released { .. }));
    // Deleted: a second release is N, a new acquire is granted at once.
    assert_eq!(
        c.release_reply("k", t1),
        Reply::NotReleased {
            token: t1,
            key: "k".into()
        }
    );
    assert!(acquired(&c.acquire_reply("k", 2, 0, 30), 2, "k") > t1);
}

#[test]
fn release_with_a_wrong_token_changes_nothing() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let t1 = acquired(&c.acquire_reply("k", 1, 0, 30), 1, "k");
    assert_eq!(
        c.release_reply("k", t1 + 1),
        Reply::NotReleased {
            token: t1 + 1,
            key: "k".into()
        }
    );
    assert!(matches!(
        c.acquire_reply("k", 2, 0, 30),
        Reply::Timeout { .. }
    ));
    assert!(matches!(c.release_reply("k", t1), Reply::Released { .. }));
}

#[test]
fn release_of_an_unregistered_key_is_not_released() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    assert_eq!(
        c.release_reply("nobody", 42),
        Reply::NotReleased {
            token: 42,
            key: "nobody".into()
        }
    );
}

#[test]
fn the_holders_own_owner_gets_no_special_treatment() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    acquired(&c.acquire_reply("k", 7, 0, 30), 7, "k");
    assert_eq!(
        c.acquire_reply("k", 7, 0, 30),
        Reply::Timeout {
            owner: 7,
            key: "k".into()
        }
    );
}

#[test]
fn every_grant_gets_a_strictly_greater_token() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let mut last = 0;
    for i in 0..50u64 {
        let t = acquired(&c.acquire_reply("k", i, 0, 30), i, "k");
        assert!(t > last, "token {t} after {last}");
        last = t;
        assert!(matches!(c.release_reply("k", t), Reply::Released { .. }));
    }
}

#[test]
fn an_expired_key_without_waiters_is_swept_and_its_release_gets_n() {
    let server = Ticketd::start(&["--sweep-interval", "1"]);
    let mut c = server.connect();
    let t = acquired(&c.acquire_reply("k", 1, 0, 1), 1, "k");
    // Expiry after 1 s, a sweep at most 1 s later.
    std::thread::sleep(Duration::from_millis(2300));
    assert_eq!(
        c.release_reply("k", t),
        Reply::NotReleased {
            token: t,
            key: "k".into()
        },
        "swept"
    );
}

#[test]
fn an_expired_key_is_released_with_r_while_the_sweep_has_not_run() {
    let server = Ticketd::start(&["--sweep-interval", "60"]);
    let mut c = server.connect();
    let t = acquired(&c.acquire_reply("k", 1, 0, 1), 1, "k");
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(
        c.release_reply("k", t),
        Reply::Released {
            token: t,
            key: "k".into()
        }
    );
}

#[test]
fn closing_a_connection_cancels_its_waiters_but_keeps_its_locks() {
    let server = Ticketd::start(&[]);
    let mut a = server.connect();
    let mut b = server.connect();
    let mut c = server.connect();
    let ta = acquired(&a.acquire_reply("held", 1, 0, 30), 1, "held");
    let tc = acquired(&c.acquire_reply("other", 3, 0, 30), 3, "other");
    // a waits on "other" and c waits on "held"... then a goes away.
    a.acquire("other", 2, 30, 30);
    assert!(a.try_recv(Duration::from_millis(100)).is_err());
    b.acquire("other", 4, 30, 30);
    assert!(b.try_recv(Duration::from_millis(100)).is_err());
    drop(a);
    std::thread::sleep(Duration::from_millis(100));
    // The lock a held is still held: wait 0 times out.
    assert!(matches!(
        c.acquire_reply("held", 5, 0, 30),
        Reply::Timeout { .. }
    ));
    // a's waiter was cancelled: the release hands "other" to b, not to a.
    assert!(matches!(
        c.release_reply("other", tc),
        Reply::Released { .. }
    ));
    assert!(acquired(&b.recv(), 4, "other") > tc);
    // And a's token still releases "held" from another connection.
    assert!(matches!(
        c.release_reply("held", ta),
        Reply::Released { .. }
    ));
}

/// PROTOCOL §5.2 over TCP: an extension keeps the token and moves the expiry,
/// so the key stays held past its first lease and a waiter gets it only at
/// the new end; an ended lease, a wrong token and an unknown key get X.
#[test]
fn extend_keeps_the_grant_past_its_first_lease() {
    let server = Ticketd::start(&["--sweep-interval", "60"]);
    let mut c = server.connect();
    let mut other = server.connect();
    let t = acquired(&c.acquire_reply("k", 1, 0, 1), 1, "k");
    assert_eq!(
        c.extend_reply("k", t, 3),
        Reply::Extended {
            token: t,
            key: "k".into()
        }
    );
    std::thread::sleep(Duration::from_millis(1500));
    // Past the first lease, inside the extension.
    assert_eq!(
        other.acquire_reply("k", 2, 0, 5),
        Reply::Timeout {
            owner: 2,
            key: "k".into()
        }
    );
    assert_eq!(
        c.extend_reply("k", t + 1, 3),
        Reply::NotExtended {
            token: t + 1,
            key: "k".into()
        }
    );
    assert_eq!(
        c.extend_reply("nobody", t, 3),
        Reply::NotExtended {
            token: t,
            key: "nobody".into()
        }
    );
    std::thread::sleep(Duration::from_millis(2000));
    // Ended (not swept: the sweep interval is long): never revived.
    assert_eq!(
        c.extend_reply("k", t, 30),
        Reply::NotExtended {
            token: t,
            key: "k".into()
        }
    );
    let t2 = acquired(&other.acquire_reply("k", 3, 0, 5), 3, "k");
    assert!(t2 > t);
}

/// `--max-hold`: an extension past grant time + max hold is X, and the
/// lease it would have replaced stands.
#[test]
fn max_hold_refuses_extensions_past_the_cap() {
    let server = Ticketd::start(&["--max-hold", "4"]);
    let mut c = server.connect();
    let t = acquired(&c.acquire_reply("k", 1, 0, 2), 1, "k");
    assert_eq!(
        c.extend_reply("k", t, 3),
        Reply::Extended {
            token: t,
            key: "k".into()
        }
    );
    assert_eq!(
        c.extend_reply("k", t, 10),
        Reply::NotExtended {
            token: t,
            key: "k".into()
        }
    );
    assert_eq!(
        c.acquire_reply("k", 2, 0, 5),
        Reply::Timeout {
            owner: 2,
            key: "k".into()
        }
    );
}

/// An Extend with lease 0 is malformed: the replies before it are flushed,
/// then the connection closes, and nothing else changes.
#[test]
fn an_extend_with_lease_zero_closes_the_connection_after_earlier_replies() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let mut bytes = common::acquire_frame("k", 1, 0, 30);
    bytes.extend_from_slice(&common::extend_frame("k", 1, 0));
    c.send(&bytes);
    let t = acquired(&c.recv(), 1, "k");
    assert!(c.closed_within(Duration::from_secs(5)));
    // The grant made before the bad frame still stands.
    let mut d = server.connect();
    assert_eq!(
        d.extend_reply("k", t, 30),
        Reply::Extended {
            token: t,
            key: "k".into()
        }
    );
}

/// Writes `frame` on a new connection and closes it at once, reading
/// nothing.
fn send_and_close(server: &Ticketd, frame: &[u8]) {
    let mut c = server.connect();
    c.send(frame);
    let _ = c.stream.shutdown(std::net::Shutdown::Both);
}

/// PROTOCOL §2.5: a close cancels only queued acquires. A release the server
/// read takes effect though its connection closed right after it.
#[test]
fn a_release_on_a_connection_closed_at_once_takes_effect() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let keys: Vec<String> = (0..20).map(|n| format!("k{n}")).collect();
    let tokens: Vec<u64> = keys
        .iter()
        .map(|k| acquired(&c.acquire_reply(k, 1, 0, 60), 1, k))
        .collect();
    for (k, t) in keys.iter().zip(&tokens) {
        send_and_close(&server, &common::release_frame(k, *t));
    }
    std::thread::sleep(Duration::from_millis(300));
    let lost: Vec<&String> = keys
        .iter()
        .filter(|k| !matches!(c.acquire_reply(k, 2, 0, 30), Reply::Acquired { .. }))
        .collect();
    assert!(lost.is_empty(), "releases lost: {lost:?}");
}

/// An extend the server read takes effect though its connection closed
/// right after it: the 1 s leases outlive their first second.
#[test]
fn an_extend_on_a_connection_closed_at_once_takes_effect() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let keys: Vec<String> = (0..20).map(|n| format!("k{n}")).collect();
    for k in &keys {
        let t = acquired(&c.acquire_reply(k, 1, 0, 1), 1, k);
        send_and_close(&server, &common::extend_frame(k, t, 60));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let free: Vec<&String> = keys
        .iter()
        .filter(|k| !matches!(c.acquire_reply(k, 2, 0, 30), Reply::Timeout { .. }))
        .collect();
    assert!(
        free.is_empty(),
        "extends lost (their 1 s leases ended): {free:?}"
    );
}

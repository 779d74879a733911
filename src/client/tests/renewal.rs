//! Renewal (PROTOCOL §5.3): extends and kept tickets against the scripted
//! fake server of the parent module.

use std::thread;
use std::time::{Duration, Instant};

use super::*;

/// Acquires `key` through the fake server with `lease`, answering with
/// `token`; returns the ticket and the connection.
fn ticket_from(
    fake: &Fake,
    c: &Client,
    key: &'static str,
    lease: Duration,
    token: u64,
) -> (Ticket, Conn) {
    let c2 = c.clone();
    let h = thread::spawn(move || c2.acquire(key, S, lease).unwrap());
    let mut conn = fake.accept(5 * S).unwrap();
    let seen = conn.read(5 * S).unwrap();
    conn.reply(Reply::Acquired {
        token,
        owner: owner_of(&seen),
        key,
    });
    (h.join().unwrap().ticket().expect("acquired"), conn)
}

/// PROTOCOL §5.3: on E the expiry becomes the time the extend was written plus
/// the new lease, not the time the reply came; until then the old expiry
/// stands. The token does not change.
#[test]
fn an_extension_counts_from_its_write_not_its_reply() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let (mut t, mut conn) = ticket_from(&fake, &c, "k", 10 * S, 5);
    let before = t.expires_at();
    let sent = Instant::now();
    let h = thread::spawn(move || {
        let r = t.extend(20 * S).unwrap();
        (r, t)
    });
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Extend {
            lease_s: 20,
            token: 5,
            key: "k".into()
        })
    );
    thread::sleep(Duration::from_millis(300));
    conn.reply(Reply::Extended { token: 5, key: "k" });
    let (r, t) = h.join().unwrap();
    assert_eq!(r, Extend::Extended);
    assert_eq!(t.token(), 5);
    assert!(t.expires_at() > before + 9 * S, "moved by about 10 s");
    assert!(
        t.expires_at() < Instant::now() + 20 * S - Duration::from_millis(250),
        "counted from the write, before the 300 ms the reply took"
    );
    assert!(t.expires_at() >= sent + 20 * S);
    let _ = t.detach();
}

/// X is definitive: the ticket is lost, and no later extend is sent.
#[test]
fn x_loses_the_ticket_for_good() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let (mut t, mut conn) = ticket_from(&fake, &c, "k", 10 * S, 6);
    let h = thread::spawn(move || {
        let r = t.extend(10 * S).unwrap();
        (r, t)
    });
    assert!(matches!(
        conn.read(5 * S),
        Some(Seen::Extend { token: 6, .. })
    ));
    conn.reply(Reply::NotExtended { token: 6, key: "k" });
    let (r, mut t) = h.join().unwrap();
    assert_eq!(r, Extend::Lost);
    assert!(t.is_lost());
    assert_eq!(t.extend(10 * S).unwrap(), Extend::Lost);
    assert_eq!(conn.read(Duration::from_millis(300)), None, "nothing sent");
    let _ = t.detach();
}

/// An expired ticket is not extended, and nothing is sent; a late E for
/// an extend that was still in flight at the expiry revives nothing.
#[test]
fn an_expired_ticket_stays_lost_even_if_a_late_e_arrives() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let (mut t, mut conn) = ticket_from(&fake, &c, "k", S, 7);
    let h = thread::spawn(move || {
        let r = t.extend(30 * S).unwrap();
        (r, t)
    });
    assert!(matches!(
        conn.read(5 * S),
        Some(Seen::Extend { token: 7, .. })
    ));
    // Answer only after the 1 s lease is over.
    thread::sleep(Duration::from_millis(1200));
    conn.reply(Reply::Extended { token: 7, key: "k" });
    let (r, mut t) = h.join().unwrap();
    assert_eq!(r, Extend::Lost);
    assert!(t.is_expired());
    assert_eq!(t.extend(30 * S).unwrap(), Extend::Lost);
    let _ = t.detach();
}

/// An extend may be sent again after no reply: a stalled attempt is given
/// up after the transport deadline (its connection closed) and the same
/// extend goes out on a new connection, before the expiry.
#[test]
fn an_unanswered_extend_is_sent_again_on_another_connection() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let (mut t, mut conn) = ticket_from(&fake, &c, "k", 12 * S, 8);
    let h = thread::spawn(move || {
        let r = t.extend(12 * S).unwrap();
        (r, t)
    });
    let first = conn.read(5 * S);
    assert!(matches!(first, Some(Seen::Extend { token: 8, .. })));
    // No answer: within the transport deadline plus a little, the client
    // closes this connection and connects again.
    assert!(conn.closed_within(7 * S));
    let mut again = fake.accept(5 * S).expect("a second connection");
    assert_eq!(again.read(5 * S), first);
    again.reply(Reply::Extended { token: 8, key: "k" });
    let (r, t) = h.join().unwrap();
    assert_eq!(r, Extend::Extended);
    let _ = t.detach();
}

/// Keep-alive: renews at a third of the lease; reports lost at once on X,
/// and its thread ends; dropping it afterwards releases the lock.
#[test]
fn keep_alive_renews_and_reports_x_as_lost() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let (t, mut conn) = ticket_from(&fake, &c, "k", 3 * S, 9);
    let start = Instant::now();
    let kept = t.keep_alive();
    assert_eq!((kept.key(), kept.token()), ("k", 9));
    for _ in 0..2 {
        let seen = conn.read(5 * S);
        assert_eq!(
            seen,
            Some(Seen::Extend {
                lease_s: 3,
                token: 9,
                key: "k".into()
            })
        );
        conn.reply(Reply::Extended { token: 9, key: "k" });
    }
    let renewed = start.elapsed();
    assert!(
        renewed >= Duration::from_millis(1900),
        "two renewals at a third of the lease: {renewed:?}"
    );
    assert!(!kept.is_lost());
    // The second E is being matched as this runs: give it a moment.
    let moved_by = Instant::now() + S;
    while kept.expires_at() <= start + 4 * S && Instant::now() < moved_by {
        thread::sleep(Duration::from_millis(5));
    }
    assert!(kept.expires_at() > start + 4 * S, "the expiry moved");
    assert!(matches!(
        conn.read(5 * S),
        Some(Seen::Extend { token: 9, .. })
    ));
    conn.reply(Reply::NotExtended { token: 9, key: "k" });
    assert!(kept.wait_lost(2 * S));
    assert!(kept.is_lost());
    assert!(!kept.is_renewing(), "the thread ends once lost");
    drop(kept);
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Release {
            token: 9,
            key: "k".into()
        })
    );
}

/// Keep-alive with a silent server: lost before the conservative expiry.
#[test]
fn keep_alive_reports_a_silent_server_before_the_expiry() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let (t, mut conn) = ticket_from(&fake, &c, "k", 3 * S, 10);
    let kept = t.keep_alive();
    let expiry = kept.expires_at();
    assert!(matches!(
        conn.read(5 * S),
        Some(Seen::Extend { token: 10, .. })
    ));
    assert!(kept.wait_lost(5 * S));
    assert!(Instant::now() < expiry, "lost reported before the expiry");
    assert!(kept.expires_at() == expiry, "no E, no move");
    drop(kept);
}

/// Releasing a kept ticket stops its renewals and releases by token.
#[test]
fn releasing_a_kept_ticket_stops_renewing() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let (t, mut conn) = ticket_from(&fake, &c, "k", 30 * S, 11);
    let kept = t.keep_alive();
    assert!(kept.is_renewing());
    let h = thread::spawn(move || kept.release().unwrap());
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Release {
            token: 11,
            key: "k".into()
        })
    );
    conn.reply(Reply::Released {
        token: 11,
        key: "k",
    });
    assert_eq!(h.join().unwrap(), Release::Released);
    assert_eq!(conn.read(Duration::from_millis(300)), None);
}

/// Acquires `keys` one after another on the fake's connection `conn` (the
/// client's only session), answering with tokens from `first_token` on.
fn tickets_on(
    conn: &mut Conn,
    c: &Client,
    keys: &[String],
    lease: Duration,
    first_token: u64,
) -> Vec<Ticket> {
    let (c2, k2) = (c.clone(), keys.to_vec());
    let h = thread::spawn(move || {
        k2.iter()
            .map(|k| c2.acquire(k, S, lease).unwrap().ticket().expect("acquired"))
            .collect::<Vec<_>>()
    });
    for (i, key) in keys.iter().enumerate() {
        let seen = conn.read(5 * S).expect("an acquire");
        conn.reply(Reply::Acquired {
            token: first_token + i as u64,
            owner: owner_of(&seen),
            key,
        });
    }
    h.join().unwrap()
}

/// Reads `n` requests, expecting extends, and answers each with `E`;
/// returns their tokens in arrival order.
fn answer_extends(conn: &mut Conn, n: usize) -> Vec<u64> {
    (0..n)
        .map(|_| match conn.read(5 * S) {
            Some(Seen::Extend { token, key, .. }) => {
                conn.reply(Reply::Extended { token, key: &key });
                token
            }
            other => panic!("expected an extend, got {other:?}"),
        })
        .collect()
}

fn wait_for(within: Duration, cond: impl Fn() -> bool) -> bool {
    let end = Instant::now() + within;
    while !cond() {
        if Instant::now() >= end {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
    true
}

/// Kept tickets due within a sixth of their lease of each other are
/// renewed together, in one write; tickets further apart are not pulled
/// in, until renewing the earlier ones early brings them into one round.
#[test]
fn kept_tickets_due_together_are_renewed_in_one_write() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    // Lease 9 s: due 3 s after each extend, slack 1.5 s.
    let lease = 9 * S;
    let h = acquire_in_thread(&c, "first", Duration::ZERO);
    let mut conn = fake.accept(5 * S).unwrap();
    let seen = conn.read(5 * S).unwrap();
    conn.reply(Reply::Busy {
        owner: owner_of(&seen),
        key: "first",
    });
    assert!(matches!(h.join().unwrap().0, Acquire::Busy));
    let session = c.inner.pool.live().pop().unwrap();
    let early: Vec<String> = (0..50).map(|i| format!("early{i}")).collect();
    let late: Vec<String> = (0..50).map(|i| format!("late{i}")).collect();
    let mut kept: Vec<KeptTicket> = tickets_on(&mut conn, &c, &early, lease, 100)
        .into_iter()
        .map(Ticket::keep_alive)
        .collect();
    // 2 s later: due 2 s after the early ones, outside their 1.5 s slack
    // (and acquired before the early ones are due, with 1 s to spare).
    thread::sleep(2 * S);
    kept.extend(
        tickets_on(&mut conn, &c, &late, lease, 200)
            .into_iter()
            .map(Ticket::keep_alive),
    );
    let writes = session.writes();
    let mut tokens = answer_extends(&mut conn, 50);
    tokens.sort_unstable();
    assert_eq!(
        tokens,
        (100..150).collect::<Vec<_>>(),
        "the early ones alone"
    );
    assert_eq!(session.writes(), writes + 1, "50 extends in one write");
    // The late ones are due 2 s after the early ones, which are then due
    // again 1 s later, within the slack: they go along, early.
    let all: Vec<u64> = (100..150).chain(200..250).collect();
    let mut tokens = answer_extends(&mut conn, 100);
    tokens.sort_unstable();
    assert_eq!(tokens, all, "the late ones, and the early ones with them");
    assert_eq!(session.writes(), writes + 2, "100 extends in one write");
    // From now on, one round.
    let mut tokens = answer_extends(&mut conn, 100);
    tokens.sort_unstable();
    assert_eq!(tokens, all, "every ticket in the next round");
    assert_eq!(session.writes(), writes + 3, "100 extends in one write");
    assert!(kept.iter().all(|k| !k.is_lost()));
    drop(kept);
    assert!(wait_for(5 * S, || !c.inner.renewer.running()));
}

/// In one batch: a ticket dropped while its extend is in flight is
/// released once its answer is in, and renewed no more; one answered X is
/// lost; the others renew on. Then the renewer thread ends with the last
/// kept ticket.
// Long because it is one scenario across a batch, step by step.
#[test]
fn a_ticket_dropped_or_lost_while_its_batch_is_in_flight() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let h = acquire_in_thread(&c, "first", Duration::ZERO);
    let mut conn = fake.accept(5 * S).unwrap();
    let seen = conn.read(5 * S).unwrap();
    conn.reply(Reply::Busy {
        owner: owner_of(&seen),
        key: "first",
    });
    assert!(matches!(h.join().unwrap().0, Acquire::Busy));
    let keys: Vec<String> = ["a", "b", "c"].iter().map(|k| (*k).to_owned()).collect();
    let mut tickets = tickets_on(&mut conn, &c, &keys, 3 * S, 1).into_iter();
    let (ka, kb, kc) = (
        tickets.next().unwrap().keep_alive(),
        tickets.next().unwrap().keep_alive(),
        tickets.next().unwrap().keep_alive(),
    );
    assert!(c.inner.renewer.running());
    let mut in_flight: Vec<Seen> = (0..3).filter_map(|_| conn.read(5 * S)).collect();
    in_flight.sort_by_key(|s| match s {
        Seen::Extend { token, .. } => *token,
        _ => 0,
    });
    let ext = |token: u64, key: &str| Seen::Extend {
        lease_s: 3,
        token,
        key: key.into(),
    };
    assert_eq!(in_flight, vec![ext(1, "a"), ext(2, "b"), ext(3, "c")]);
    let before = kc.expires_at();
    let t = Instant::now();
    drop(ka);
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "a drop never waits"
    );
    conn.reply(Reply::Extended { token: 1, key: "a" });
    conn.reply(Reply::NotExtended { token: 2, key: "b" });
    conn.reply(Reply::Extended { token: 3, key: "c" });
    assert!(kb.wait_lost(2 * S), "X loses b");
    assert!(!kb.is_renewing());
    assert!(wait_for(2 * S, || kc.expires_at() > before), "c renewed");
    assert!(!kc.is_lost());
    // a: released once its extend was answered; then only c renews.
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Release {
            token: 1,
            key: "a".into()
        })
    );
    conn.reply(Reply::Released { token: 1, key: "a" });
    assert_eq!(conn.read(5 * S), Some(ext(3, "c")));
    conn.reply(Reply::Extended { token: 3, key: "c" });
    drop(kb);
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Release {
            token: 2,
            key: "b".into()
        })
    );
    conn.reply(Reply::NotReleased { token: 2, key: "b" });
    assert!(c.inner.renewer.running(), "c is still kept");
    drop(kc);
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Release {
            token: 3,
            key: "c".into()
        })
    );
    assert!(
        wait_for(2 * S, || !c.inner.renewer.running()),
        "the renewer ends with the last kept ticket"
    );
}

/// A batch that gets no answer: every ticket in it is reported lost before
/// its conservative expiry, the silent session is closed, nothing moves.
#[test]
fn a_silent_batch_loses_every_ticket_in_it_before_the_expiry() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let h = acquire_in_thread(&c, "first", Duration::ZERO);
    let mut conn = fake.accept(5 * S).unwrap();
    let seen = conn.read(5 * S).unwrap();
    conn.reply(Reply::Busy {
        owner: owner_of(&seen),
        key: "first",
    });
    assert!(matches!(h.join().unwrap().0, Acquire::Busy));
    let keys: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
    let kept: Vec<KeptTicket> = tickets_on(&mut conn, &c, &keys, 6 * S, 1)
        .into_iter()
        .map(Ticket::keep_alive)
        .collect();
    let first_expiry = kept.iter().map(KeptTicket::expires_at).min().unwrap();
    for _ in 0..10 {
        assert!(matches!(conn.read(5 * S), Some(Seen::Extend { .. })));
    }
    // Lost at the renewal deadline, 5.4 s after the grants: 0.6 s early.
    for k in &kept {
        assert!(k.wait_lost(8 * S));
    }
    assert!(Instant::now() < first_expiry, "lost before the expiry");
    assert!(conn.closed_within(S), "the silent session was closed");
    assert!(kept.iter().all(|k| !k.is_renewing()));
    drop(kept);
    assert!(wait_for(2 * S, || !c.inner.renewer.running()));
}

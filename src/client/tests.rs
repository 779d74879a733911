//! Unit-level rules of the client against a scripted fake server: a loopback
//! listener whose connections the test drives byte by byte. End-to-end rules
//! against the real server live in `tests/client_*.rs`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use super::*;
use crate::proto::{decode_request, encode_reply, Decoded, Reply, Request};

mod renewal;

const S: Duration = Duration::from_secs(1);

/// A request as the fake server saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Acquire {
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: String,
    },
    Release {
        token: u64,
        key: String,
    },
    Extend {
        lease_s: u8,
        token: u64,
        key: String,
    },
}

struct Fake {
    listener: TcpListener,
}

impl Fake {
    fn new() -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        Fake { listener }
    }

    fn addr(&self) -> String {
        self.listener.local_addr().unwrap().to_string()
    }

    fn accept(&self, within: Duration) -> Option<Conn> {
        let end = Instant::now() + within;
        loop {
            match self.listener.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).unwrap();
                    return Some(Conn { s, buf: Vec::new() });
                }
                Err(_) if Instant::now() < end => thread::sleep(Duration::from_millis(5)),
                Err(_) => return None,
            }
        }
    }
}

struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    /// The next request, or `None` on EOF or when nothing comes `within`.
    fn read(&mut self, within: Duration) -> Option<Seen> {
        let end = Instant::now() + within;
        loop {
            if let Decoded::Frame { frame, used } = decode_request(&self.buf, 1024) {
                let seen = match frame {
                    Request::Acquire {
                        wait_s,
                        lease_s,
                        owner,
                        key,
                    } => Seen::Acquire {
                        wait_s,
                        lease_s,
                        owner,
                        key: key.to_owned(),
                    },
                    Request::Release { token, key } => Seen::Release {
                        token,
                        key: key.to_owned(),
                    },
                    Request::Extend {
                        lease_s,
                        token,
                        key,
                    } => Seen::Extend {
                        lease_s,
                        token,
                        key: key.to_owned(),
                    },
                    Request::AcquireWithLimit { key, .. } => {
                        panic!("the blocking client sent a protocol 1.2 acquire for {key}")
                    }
                };
                self.buf.drain(..used);
                return Some(seen);
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            self.s.set_read_timeout(Some(left)).unwrap();
            let mut chunk = [0u8; 512];
            match self.s.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Whether the client closed this connection (EOF) within `within`.
    fn closed_within(&mut self, within: Duration) -> bool {
        self.s.set_read_timeout(Some(within)).unwrap();
        let mut b = [0u8; 64];
        matches!(self.s.read(&mut b), Ok(0))
    }

    fn reply(&mut self, r: Reply<'_>) {
        let mut v = Vec::new();
        encode_reply(&r, &mut v);
        self.s.write_all(&v).unwrap();
    }
}

fn client(addr: &str) -> Client {
    Client::builder()
        .address(addr)
        .pool_size(1)
        .build()
        .unwrap()
}

fn acquire_in_thread(
    c: &Client,
    key: &'static str,
    wait: Duration,
) -> thread::JoinHandle<(Acquire, Duration)> {
    let c = c.clone();
    thread::spawn(move || {
        let t = Instant::now();
        let r = c.acquire(key, wait, 10 * S).unwrap();
        (r, t.elapsed())
    })
}

fn owner_of(seen: &Seen) -> u64 {
    match seen {
        Seen::Acquire { owner, .. } => *owner,
        _ => panic!("expected an acquire, got {seen:?}"),
    }
}

#[test]
fn arguments_are_refused_before_anything_is_sent() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let long = "k".repeat(1025);
    let cases: Vec<(&str, Duration, Error)> = vec![
        ("", 10 * S, Error::EmptyKey),
        ("a\nb", 10 * S, Error::KeyContainsNewline),
        (
            &long,
            10 * S,
            Error::KeyTooLong {
                len: 1025,
                max: 1024,
            },
        ),
        ("k", Duration::ZERO, Error::ZeroLease),
        ("k", 256 * S, Error::LeaseTooLong { lease: 256 * S }),
    ];
    for (key, lease, want) in cases {
        assert_eq!(c.acquire(key, S, lease).unwrap_err(), want);
    }
    assert_eq!(c.release("", 1).unwrap_err(), Error::EmptyKey);
    // Nothing was even connected.
    assert!(fake.accept(Duration::from_millis(100)).is_none());
    assert_eq!(Client::builder().build().unwrap_err(), Error::NoAddress);
    assert!(matches!(
        Client::builder()
            .address("127.0.0.1:1")
            .pool_size(0)
            .build(),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        Client::connect("no-port-here"),
        Err(Error::Resolve { .. })
    ));
}

#[test]
fn replies_are_matched_by_owner_and_by_token_and_key_in_any_order() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let a = acquire_in_thread(&c, "a", 5 * S);
    let mut conn = fake.accept(5 * S).unwrap();
    let sa = conn.read(5 * S).unwrap();
    let b = acquire_in_thread(&c, "b", 5 * S);
    let sb = conn.read(5 * S).unwrap();
    assert_ne!(owner_of(&sa), owner_of(&sb), "owners are fresh per call");
    // Answer the later request first.
    conn.reply(Reply::Busy {
        owner: owner_of(&sb),
        key: "b",
    });
    conn.reply(Reply::Acquired {
        token: 41,
        owner: owner_of(&sa),
        key: "a",
    });
    let (rb, _) = b.join().unwrap();
    assert!(matches!(rb, Acquire::Busy));
    let ticket = a.join().unwrap().0.ticket().expect("a acquired");
    assert_eq!((ticket.key(), ticket.token()), ("a", 41));
    assert!(!ticket.is_expired());
    assert!(ticket.remaining() <= 10 * S);

    // Two releases in flight, answered in reverse order, matched by token+key.
    let (c1, c2) = (c.clone(), c.clone());
    let r1 = thread::spawn(move || c1.release("x", 7).unwrap());
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Release {
            token: 7,
            key: "x".into()
        })
    );
    let r2 = thread::spawn(move || c2.release("y", 7).unwrap());
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Release {
            token: 7,
            key: "y".into()
        })
    );
    conn.reply(Reply::NotReleased { token: 7, key: "y" });
    conn.reply(Reply::Released { token: 7, key: "x" });
    assert_eq!(r1.join().unwrap(), Release::Released);
    assert_eq!(r2.join().unwrap(), Release::NotHeld);

    // Dropping the ticket releases it in the background, exactly once.
    drop(ticket);
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Release {
            token: 41,
            key: "a".into()
        })
    );
    conn.reply(Reply::Released {
        token: 41,
        key: "a",
    });
    assert_eq!(conn.read(Duration::from_millis(300)), None);
}

#[test]
fn the_wire_wait_is_computed_when_written_and_rounded_up() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    // Open the session first, then hold its writer.
    let warm = acquire_in_thread(&c, "warm", Duration::ZERO);
    let mut conn = fake.accept(5 * S).unwrap();
    let w = conn.read(5 * S).unwrap();
    conn.reply(Reply::Timeout {
        owner: owner_of(&w),
        key: "warm",
    });
    assert!(matches!(warm.join().unwrap().0, Acquire::Timeout));

    let session = c.inner.pool.live().pop().unwrap();
    session.pause_writer(true);
    let h = acquire_in_thread(&c, "k", 3 * S);
    thread::sleep(Duration::from_millis(1500));
    session.pause_writer(false);
    let seen = conn.read(5 * S).unwrap();
    // 1.5 s left, rounded up: 2, not a fresh 3.
    assert!(
        matches!(
            seen,
            Seen::Acquire {
                wait_s: 2,
                lease_s: 10,
                ..
            }
        ),
        "{seen:?}"
    );
    conn.reply(Reply::Timeout {
        owner: owner_of(&seen),
        key: "k",
    });
    assert!(matches!(h.join().unwrap().0, Acquire::Timeout));
}

#[test]
fn a_request_still_queued_at_its_deadline_is_never_sent() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let warm = acquire_in_thread(&c, "warm", Duration::ZERO);
    let mut conn = fake.accept(5 * S).unwrap();
    let w = conn.read(5 * S).unwrap();
    conn.reply(Reply::Timeout {
        owner: owner_of(&w),
        key: "warm",
    });
    let _ = warm.join().unwrap();
    let session = c.inner.pool.live().pop().unwrap();
    session.pause_writer(true);
    let (r, took) = acquire_in_thread(&c, "k", S).join().unwrap();
    assert!(matches!(r, Acquire::Timeout), "{r:?}");
    assert!(
        took >= S && took < S + Duration::from_millis(500),
        "{took:?}"
    );
    session.pause_writer(false);
    // Withdrawn, not written late.
    assert_eq!(conn.read(Duration::from_millis(300)), None);
    assert_eq!(session.frames_written(), 1);
    assert!(
        !session.is_dead(),
        "a Timeout before sending keeps the session"
    );
}

#[test]
fn a_request_queued_on_a_dying_session_moves_to_another_with_the_same_owner() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let warm = acquire_in_thread(&c, "warm", Duration::ZERO);
    let mut first = fake.accept(5 * S).unwrap();
    let w = first.read(5 * S).unwrap();
    first.reply(Reply::Timeout {
        owner: owner_of(&w),
        key: "warm",
    });
    let _ = warm.join().unwrap();
    let session = c.inner.pool.live().pop().unwrap();
    session.pause_writer(true);
    let h = acquire_in_thread(&c, "k", 5 * S);
    thread::sleep(Duration::from_millis(1200));
    let queued = session.queued_owners();
    assert_eq!(queued.len(), 1);
    // The server goes away while the request is still queued, unsent.
    drop(first);
    // Same deadline: 3.8 s left, rounded up to 4, not a fresh 5.
    let mut second = fake.accept(5 * S).expect("a retry on a new connection");
    let seen = second.read(5 * S).unwrap();
    assert!(
        matches!(&seen, Seen::Acquire { wait_s: 4, key, .. } if key == "k"),
        "{seen:?}"
    );
    assert_eq!(session.frames_written(), 1, "never written on the dead one");
    assert_eq!(owner_of(&seen), queued[0], "the retry keeps its owner");
    second.reply(Reply::Acquired {
        token: 9,
        owner: owner_of(&seen),
        key: "k",
    });
    let t = h.join().unwrap().0.ticket().expect("acquired on the retry");
    assert_eq!(t.token(), 9);
    let (_, token) = t.detach();
    assert_eq!(token, 9);
    assert_eq!(
        second.read(Duration::from_millis(200)),
        None,
        "detach does not release"
    );
}

#[test]
fn a_request_that_may_have_been_sent_is_never_sent_again() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let h = acquire_in_thread(&c, "k", 5 * S);
    let mut conn = fake.accept(5 * S).unwrap();
    assert!(conn.read(5 * S).is_some());
    // The connection dies after the request went out.
    drop(conn);
    let (r, took) = h.join().unwrap();
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    assert!(
        took < S,
        "known lost at once, not at the deadline: {took:?}"
    );
    // No other connection ever carries it.
    assert!(fake.accept(Duration::from_millis(300)).is_none());
}

#[test]
fn no_reply_by_the_deadline_plus_grace_closes_exactly_that_session() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let h = acquire_in_thread(&c, "k", S);
    let mut conn = fake.accept(5 * S).unwrap();
    let seen = conn.read(5 * S).unwrap();
    assert!(matches!(seen, Seen::Acquire { wait_s: 1, .. }));
    let session = c.inner.pool.live().pop().unwrap();
    let (r, took) = h.join().unwrap();
    assert_eq!(
        session.close_reason().as_deref(),
        Some("no reply by the deadline plus grace")
    );
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    assert!(
        took >= 2 * S && took < 2 * S + Duration::from_millis(500),
        "{took:?}"
    );
    assert!(
        conn.closed_within(S),
        "the client closed the stalled session"
    );
}

#[test]
fn a_grant_that_reaches_the_caller_after_the_deadline_is_released_at_once() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let h = acquire_in_thread(&c, "k", S);
    let mut conn = fake.accept(5 * S).unwrap();
    let seen = conn.read(5 * S).unwrap();
    thread::sleep(Duration::from_millis(1300));
    conn.reply(Reply::Acquired {
        token: 77,
        owner: owner_of(&seen),
        key: "k",
    });
    let (r, _) = h.join().unwrap();
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    // Same connection: the session is kept; exactly that token is released.
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Release {
            token: 77,
            key: "k".into()
        })
    );
    conn.reply(Reply::Released {
        token: 77,
        key: "k",
    });
}

#[test]
fn an_unmatched_grant_is_given_back() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let warm = acquire_in_thread(&c, "warm", Duration::ZERO);
    let mut conn = fake.accept(5 * S).unwrap();
    let w = conn.read(5 * S).unwrap();
    conn.reply(Reply::Acquired {
        token: 5,
        owner: owner_of(&w) ^ 1,
        key: "stray",
    });
    assert_eq!(
        conn.read(5 * S),
        Some(Seen::Release {
            token: 5,
            key: "stray".into()
        })
    );
    conn.reply(Reply::Timeout {
        owner: owner_of(&w),
        key: "warm",
    });
    assert!(matches!(warm.join().unwrap().0, Acquire::Timeout));
}

#[test]
fn a_malformed_reply_closes_the_session_and_leaves_calls_indeterminate() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let h = acquire_in_thread(&c, "k", 5 * S);
    let mut conn = fake.accept(5 * S).unwrap();
    conn.read(5 * S).unwrap();
    conn.s.write_all(b"Zgarbage\n").unwrap();
    let (r, took) = h.join().unwrap();
    assert!(matches!(r, Acquire::Indeterminate));
    assert!(took < S);
    assert!(conn.closed_within(S));
}

#[test]
fn a_reply_naming_another_key_is_not_trusted() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let h = acquire_in_thread(&c, "k", 5 * S);
    let mut conn = fake.accept(5 * S).unwrap();
    let seen = conn.read(5 * S).unwrap();
    conn.reply(Reply::Acquired {
        token: 3,
        owner: owner_of(&seen),
        key: "other",
    });
    assert!(matches!(h.join().unwrap().0, Acquire::Indeterminate));
}

#[test]
fn wait_zero_is_a_single_attempt_with_a_zero_wire_wait() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let h = acquire_in_thread(&c, "k", Duration::ZERO);
    let mut conn = fake.accept(5 * S).unwrap();
    let seen = conn.read(5 * S).unwrap();
    assert!(matches!(seen, Seen::Acquire { wait_s: 0, .. }), "{seen:?}");
    conn.reply(Reply::Timeout {
        owner: owner_of(&seen),
        key: "k",
    });
    assert!(matches!(h.join().unwrap().0, Acquire::Timeout));
    assert_eq!(
        conn.read(Duration::from_millis(200)),
        None,
        "no second attempt"
    );
}

#[test]
fn waits_over_255_seconds_are_clamped_on_the_wire() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let h = acquire_in_thread(&c, "k", 10_000 * S);
    let mut conn = fake.accept(5 * S).unwrap();
    let seen = conn.read(5 * S).unwrap();
    assert!(
        matches!(seen, Seen::Acquire { wait_s: 255, .. }),
        "{seen:?}"
    );
    conn.reply(Reply::Busy {
        owner: owner_of(&seen),
        key: "k",
    });
    assert!(matches!(h.join().unwrap().0, Acquire::Busy));
}

#[test]
fn with_no_server_at_all_the_call_ends_at_its_deadline_unsent() {
    // A port with nothing listening: bind, note it, close.
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let c = client(&addr);
    let t = Instant::now();
    assert!(matches!(c.acquire("k", S, S).unwrap(), Acquire::Timeout));
    let took = t.elapsed();
    assert!(
        took >= S && took < S + Duration::from_millis(600),
        "{took:?}"
    );
    assert!(c.last_connect_error().is_some());
    let t = Instant::now();
    assert_eq!(c.release("k", 1).unwrap(), Release::NotSent);
    assert!(t.elapsed() >= TRANSPORT_DEADLINE);
}

#[test]
fn sessions_and_threads_end_when_the_client_is_dropped() {
    let fake = Fake::new();
    let c = client(&fake.addr());
    let h = acquire_in_thread(&c, "k", Duration::ZERO);
    let mut conn = fake.accept(5 * S).unwrap();
    let seen = conn.read(5 * S).unwrap();
    conn.reply(Reply::Busy {
        owner: owner_of(&seen),
        key: "k",
    });
    assert!(matches!(h.join().unwrap().0, Acquire::Busy));
    let session: Arc<session::Session> = c.inner.pool.live().pop().unwrap();
    assert_eq!(c.connected_sessions(), 1);
    drop(c);
    assert!(session.is_dead());
    assert_eq!(session.unjoined_threads(), 0, "threads joined");
    assert!(conn.closed_within(S));
}

#[test]
fn clients_and_tickets_can_move_between_threads() {
    fn shared<T: Send + Sync + Clone>() {}
    fn movable<T: Send + Sync>() {}
    shared::<Client>();
    movable::<Ticket>();
    movable::<Acquire>();
}

#[test]
fn releases_of_dropped_tickets_with_no_server_are_given_up_together() {
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let c = client(&addr);
    let start = Instant::now();
    for token in 1..=50 {
        drop(Ticket::new(
            c.clone(),
            "k".into(),
            token,
            S,
            Instant::now() + S,
        ));
    }
    assert!(c.background_busy());
    while c.background_busy() {
        assert!(
            start.elapsed() < TRANSPORT_DEADLINE + 2 * S,
            "one transport deadline for the whole backlog, not one each"
        );
        thread::sleep(Duration::from_millis(20));
    }
    assert!(start.elapsed() >= TRANSPORT_DEADLINE - Duration::from_millis(100));
}

//! PROTOCOL §3 end to end: the official client against the real `ticketd`, with
//! the fault-injecting proxy in between where a rule needs a fault. The
//! proxy's log shows what the server could have seen; a raw connection
//! straight to the server shows what the server actually holds.

use ticketd_testkit::process as common;
use ticketd_testkit::proxy;

use std::net::TcpListener;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::Ticketd;
use proxy::{Blackhole, Fault, Proxy, Req};
use ticketd::client::{Acquire, Client, Release};

const S: Duration = Duration::from_secs(1);

fn client_via(addr: &str, pool: usize) -> Client {
    Client::builder()
        .address(addr)
        .pool_size(pool)
        .build()
        .unwrap()
}

/// Whether the server holds `key` now: a raw wait-0 acquire is answered T.
fn held(server: &Ticketd, key: &str) -> bool {
    let mut raw = server.connect();
    raw.acquire(key, 0xfeed, 0, 1);
    match raw.recv() {
        common::Reply::Timeout { .. } => true,
        r @ common::Reply::Acquired { .. } => {
            raw.release(key, r.token());
            let _ = raw.recv();
            false
        }
        other => panic!("unexpected {other:?}"),
    }
}

fn owners(seen: &[proxy::Seen]) -> Vec<u64> {
    seen.iter()
        .filter_map(|s| match s.req {
            Req::Acquire { owner, .. } | Req::AcquireWithLimit { owner, .. } => Some(owner),
            Req::Release { .. } | Req::Extend { .. } => None,
        })
        .collect()
}

#[test]
fn acquire_and_release_against_the_real_server() {
    let server = Ticketd::start(&[]);
    let c = Client::connect(server.addr().to_string()).unwrap();
    let t = c
        .acquire("k", 5 * S, 30 * S)
        .unwrap()
        .ticket()
        .expect("acquired");
    assert_eq!(t.key(), "k");
    assert!(t.token() > 0);
    assert!(!t.is_expired());
    assert!(t.expires_at() <= Instant::now() + 30 * S);
    assert!(t.remaining() > 29 * S);
    // Held: a wait-0 attempt is a definitive Timeout, at once.
    let start = Instant::now();
    assert!(matches!(
        c.acquire("k", Duration::ZERO, S).unwrap(),
        Acquire::Timeout
    ));
    assert!(start.elapsed() < S);
    let token = t.token();
    assert_eq!(t.release().unwrap(), Release::Released);
    assert_eq!(c.release("k", token).unwrap(), Release::NotHeld);
    // The next grant has a larger token.
    let t2 = c.acquire("k", S, S).unwrap().ticket().expect("free again");
    assert!(t2.token() > token);
}

#[test]
fn timeout_is_definitive_and_comes_at_the_deadline() {
    let server = Ticketd::start(&[]);
    let c = Client::connect(server.addr().to_string()).unwrap();
    let _holder = c.acquire("k", S, 30 * S).unwrap().ticket().unwrap();
    let start = Instant::now();
    let r = c.acquire("k", 2 * S, S).unwrap();
    let took = start.elapsed();
    assert!(matches!(r, Acquire::Timeout), "{r:?}");
    assert!(took >= 2 * S - Duration::from_millis(50), "{took:?}");
    assert!(took < 3 * S, "within D + grace: {took:?}");
}

#[test]
fn busy_is_definitive_and_immediate() {
    let server = Ticketd::start(&["--max-waiters-per-key", "1"]);
    let c = Client::connect(server.addr().to_string()).unwrap();
    let holder = c.acquire("k", S, 30 * S).unwrap().ticket().unwrap();
    let c2 = c.clone();
    let waiter = thread::spawn(move || c2.acquire("k", 10 * S, 5 * S).unwrap());
    // Let the waiter take the one queue slot.
    thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    let r = c.acquire("k", 10 * S, S).unwrap();
    assert!(matches!(r, Acquire::Busy), "{r:?}");
    assert!(start.elapsed() < S);
    // The queued waiter gets the key, FIFO, when the holder releases.
    let first = holder.token();
    assert_eq!(holder.release().unwrap(), Release::Released);
    let t = waiter.join().unwrap().ticket().expect("handed over");
    assert!(t.token() > first);
}

#[test]
fn an_acquire_cut_after_it_was_forwarded_is_indeterminate_and_never_sent_again() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    let key = "cut-after";
    // Exactly one acquire frame gets through, then the connection dies.
    px.set_fault_for(0, Fault::CutAfter(12 + key.len()));
    let c = client_via(&px.addr(), 2);
    let start = Instant::now();
    let r = c.acquire(key, 5 * S, 30 * S).unwrap();
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    assert!(
        start.elapsed() < 2 * S,
        "known lost when the connection died"
    );
    // The server granted it: Indeterminate, not Timeout, was the truth.
    assert!(held(&server, key));
    // Later traffic goes through new connections; the cut acquire is never
    // forwarded again.
    let t = c
        .acquire("other", S, S)
        .unwrap()
        .ticket()
        .expect("other key");
    drop(t);
    thread::sleep(Duration::from_millis(300));
    let fwd = px.forwarded_for(key);
    assert_eq!(fwd.len(), 1, "{fwd:?}");
    assert_eq!(px.received_for(key).len(), 1);
    assert_eq!(owners(&fwd).len(), 1);
}

#[test]
fn an_acquire_cut_inside_its_frame_is_indeterminate_and_nothing_is_held() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    px.set_fault_for(0, Fault::CutAfter(5));
    let c = client_via(&px.addr(), 1);
    let r = c.acquire("half", 5 * S, 30 * S).unwrap();
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    assert!(px.forwarded_for("half").is_empty());
    assert_eq!(px.received_for("half").len(), 1);
    assert!(!held(&server, "half"));
}

#[test]
fn an_acquire_dropped_before_forwarding_is_indeterminate_and_not_retried() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    px.set_fault_for(0, Fault::DropAndClose);
    let c = client_via(&px.addr(), 1);
    let r = c.acquire("dropped", 5 * S, 30 * S).unwrap();
    // The client cannot know the proxy dropped it: its bytes went out.
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    thread::sleep(Duration::from_millis(300));
    assert_eq!(px.received_for("dropped").len(), 1, "never resent");
    assert!(px.forwarded_for("dropped").is_empty());
    assert!(!held(&server, "dropped"));
}

#[test]
fn an_unsent_acquire_moves_to_the_next_address_with_its_deadline() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    let refused = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let c = Client::builder()
        .addresses([refused, px.addr()])
        .pool_size(1)
        .build()
        .unwrap();
    let t = c
        .acquire("k", 5 * S, 10 * S)
        .unwrap()
        .ticket()
        .expect("via the second address");
    let fwd = px.forwarded_for("k");
    assert_eq!(fwd.len(), 1);
    assert!(matches!(fwd[0].req, Req::Acquire { wait_s: 5, .. }));
    assert!(c.last_connect_error().unwrap().contains("refused"));
    drop(t);
}

#[test]
fn a_connect_delayed_two_seconds_shows_a_wire_wait_two_seconds_shorter() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    let hole = Blackhole::new();
    // The first address swallows the connect for the whole connect timeout.
    let c = Client::builder()
        .addresses([hole.addr(), px.addr()])
        .pool_size(1)
        .connect_timeout(2 * S)
        .build()
        .unwrap();
    let start = Instant::now();
    let t = c
        .acquire("slow", 5 * S, 10 * S)
        .unwrap()
        .ticket()
        .expect("acquired");
    assert!(start.elapsed() >= 2 * S);
    let fwd = px.forwarded_for("slow");
    assert_eq!(fwd.len(), 1);
    let Req::Acquire { wait_s, .. } = fwd[0].req else {
        panic!("{fwd:?}")
    };
    assert_eq!(wait_s, 3, "5 s wait, 2 s spent connecting, rounded up");
    // Direct, the same call carries the full wait.
    let direct = client_via(&px.addr(), 1);
    let _ = direct
        .acquire("fast", 5 * S, 10 * S)
        .unwrap()
        .ticket()
        .unwrap();
    assert!(matches!(
        px.forwarded_for("fast")[0].req,
        Req::Acquire { wait_s: 5, .. }
    ));
    drop(t);
}

#[test]
fn stalled_replies_past_the_deadline_plus_grace_close_exactly_that_session() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    px.set_fault_for(0, Fault::StallReplies);
    let c = client_via(&px.addr(), 2);
    let c1 = c.clone();
    let stalled = thread::spawn(move || {
        let start = Instant::now();
        (c1.acquire("stalled", S, 30 * S).unwrap(), start.elapsed())
    });
    assert!(px.wait_until(5 * S, |p| !p.forwarded_for("stalled").is_empty()));
    // The second session (connection 1) works meanwhile.
    let t = c
        .acquire("fine", S, 5 * S)
        .unwrap()
        .ticket()
        .expect("second session");
    let (r, took) = stalled.join().unwrap();
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    assert!(took >= 2 * S - Duration::from_millis(50), "{took:?}");
    assert!(took < 2 * S + Duration::from_millis(700), "{took:?}");
    assert!(px.wait_until(S, |p| p.closed_by_client() == vec![0]));
    // The other session is still open and serving.
    assert_eq!(t.release().unwrap(), Release::Released);
    assert_eq!(px.closed_by_client(), vec![0]);
    // The server did grant it: entering on a guess would have been wrong.
    assert!(held(&server, "stalled"));
}

#[test]
fn a_late_grant_is_released_at_once_not_at_the_end_of_its_lease() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    // Requests reach the server 1.5 s late, so its queue outlives D.
    px.set_fault_for(0, Fault::DelayForward(Duration::from_millis(1500)));
    let direct = Client::connect(server.addr().to_string()).unwrap();
    let holder = direct.acquire("late", S, 30 * S).unwrap().ticket().unwrap();
    let c = client_via(&px.addr(), 1);
    let start = Instant::now();
    let c1 = c.clone();
    let waiter = thread::spawn(move || c1.acquire("late", 2 * S, 30 * S).unwrap());
    // Hand the key over after D (start + 2 s) but before D + 1 s.
    thread::sleep(Duration::from_millis(2300));
    let _ = holder.release().unwrap();
    let r = waiter.join().unwrap();
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    let fwd = px.forwarded_for("late");
    let granted_owner = owners(&fwd)[0];
    assert_eq!(owners(&fwd), vec![granted_owner]);
    // The grant's exact token is released, long before its 30 s lease.
    let t = direct
        .acquire("late", 5 * S, S)
        .unwrap()
        .ticket()
        .expect("free again soon");
    assert!(start.elapsed() < 8 * S, "{:?}", start.elapsed());
    let releases = |p: &Proxy| -> Vec<u64> {
        p.forwarded_for("late")
            .iter()
            .filter_map(|s| match s.req {
                Req::Release { token, .. } => Some(token),
                Req::Acquire { .. } | Req::AcquireWithLimit { .. } | Req::Extend { .. } => None,
            })
            .collect()
    };
    // The proxy logs a frame just after forwarding it: give it a moment.
    assert!(px.wait_until(S, |p| !releases(p).is_empty()));
    let releases = releases(&px);
    assert_eq!(releases.len(), 1, "one compensating release");
    assert!(releases[0] < t.token());
}

#[test]
fn wait_zero_is_one_attempt_with_a_zero_wire_wait() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    let c = client_via(&px.addr(), 1);
    let _holder = c.acquire("z", S, 30 * S).unwrap().ticket().unwrap();
    let start = Instant::now();
    assert!(matches!(
        c.acquire("z", Duration::ZERO, S).unwrap(),
        Acquire::Timeout
    ));
    assert!(start.elapsed() < S);
    let fwd = px.forwarded_for("z");
    assert_eq!(fwd.len(), 2);
    assert!(matches!(fwd[1].req, Req::Acquire { wait_s: 0, .. }));
}

#[test]
fn a_stalled_wait_zero_gives_up_at_the_transport_deadline() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    px.set_fault(Fault::StallReplies);
    let c = client_via(&px.addr(), 1);
    let start = Instant::now();
    let r = c.acquire("z", Duration::ZERO, S).unwrap();
    let took = start.elapsed();
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    assert!(
        took >= 5 * S - Duration::from_millis(50) && took < 6 * S,
        "{took:?}"
    );
    assert_eq!(px.forwarded_for("z").len(), 1);
}

#[test]
fn a_server_that_is_down_costs_the_caller_its_wait_and_no_more() {
    let mut server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let c = Client::connect(addr).unwrap();
    let _ = c.acquire("k", S, S).unwrap().ticket().unwrap().detach();
    server.terminate();
    // Once the client has seen the connection close, nothing can be sent.
    let seen = Instant::now();
    while c.connected_sessions() > 0 {
        assert!(
            seen.elapsed() < 5 * S,
            "the closed connection went unnoticed"
        );
        thread::sleep(Duration::from_millis(5));
    }
    let start = Instant::now();
    let r = c.acquire("k", S, S).unwrap();
    let took = start.elapsed();
    assert!(matches!(r, Acquire::Timeout), "never sent: {r:?}");
    assert!(took < S + Duration::from_millis(600), "{took:?}");
}

#[test]
fn many_threads_share_one_client_over_a_few_connections() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    let c = Arc::new(client_via(&px.addr(), 2));
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                for j in 0..20 {
                    let key = format!("k{i}-{j}");
                    let t = c
                        .acquire(&key, S, 5 * S)
                        .unwrap()
                        .ticket()
                        .expect("free key");
                    assert_eq!(t.release().unwrap(), Release::Released);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(
        px.accepted() <= 2,
        "pipelined over the pool: {}",
        px.accepted()
    );
    assert_eq!(px.forwarded().len(), 8 * 20 * 2);
    // A fresh owner for every acquire call.
    let mut all = owners(&px.forwarded());
    assert_eq!(all.len(), 8 * 20);
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 8 * 20, "an owner was reused");
}

#[test]
fn a_server_over_its_connection_limit_never_hangs_the_caller_or_storms_it() {
    let server = Ticketd::start(&["--max-conns", "1"]);
    let _occupant = server.connect();
    let px = Proxy::start(server.addr());
    let c = client_via(&px.addr(), 1);
    let start = Instant::now();
    let r = c.acquire("k", S, S).unwrap();
    let took = start.elapsed();
    // Accepted and closed at once: either never sent, or sent into a
    // connection that died, but never a grant and never a hang.
    assert!(
        matches!(r, Acquire::Timeout | Acquire::Indeterminate),
        "{r:?}"
    );
    assert!(took < 2 * S + Duration::from_millis(500), "{took:?}");
    assert!(
        px.accepted() < 40,
        "{} connections in {took:?}",
        px.accepted()
    );
    assert!(px.forwarded_for("k").len() <= 1, "never sent twice");
}

#[test]
fn the_local_expiry_is_conservative_and_a_dropped_ticket_is_released() {
    let server = Ticketd::start(&[]);
    let c = Client::connect(server.addr().to_string()).unwrap();
    let t = c.acquire("lease", S, 2 * S).unwrap().ticket().unwrap();
    // Just before the local expiry the server still holds the key: the
    // local clock started before the server's did.
    // Ask the server first, then the ticket: if the server had already let
    // the key go, the ticket must say so too (a slow machine may oversleep
    // past both; then the order of the two checks still holds).
    thread::sleep(t.remaining().saturating_sub(Duration::from_millis(150)));
    let server_holds = held(&server, "lease");
    assert!(
        server_holds || t.is_expired(),
        "local expiry later than the server's"
    );
    let (_, token) = t.detach();
    thread::sleep(Duration::from_millis(400));
    // Past the server's lease the key can be taken over.
    let t2 = c
        .acquire("lease", 2 * S, S)
        .unwrap()
        .ticket()
        .expect("taken over");
    assert!(t2.token() > token);
    // Dropping a ticket releases it, without waiting for its lease.
    drop(t2);
    let t3 = c
        .acquire("lease", 2 * S, 30 * S)
        .unwrap()
        .ticket()
        .expect("released on drop");
    let start = Instant::now();
    drop(t3);
    let mut raw_free = false;
    while start.elapsed() < S {
        if !held(&server, "lease") {
            raw_free = true;
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    assert!(raw_free, "a dropped 30 s ticket is released at once");
}

#[test]
fn a_server_that_dies_under_a_queued_acquire_makes_it_indeterminate_at_once() {
    let mut server = Ticketd::start(&[]);
    let direct = Client::connect(server.addr().to_string()).unwrap();
    let _holder = direct.acquire("k", S, 30 * S).unwrap().ticket().unwrap();
    let c = Client::connect(server.addr().to_string()).unwrap();
    let c1 = c.clone();
    let waiter = thread::spawn(move || {
        let r = c1.acquire("k", 20 * S, S).unwrap();
        (r, Instant::now())
    });
    thread::sleep(Duration::from_millis(300));
    server.signal(libc::SIGKILL);
    let killed = Instant::now();
    let (r, when) = waiter.join().unwrap();
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    assert!(when.duration_since(killed) < S, "not held until D + grace");
    let _ = server.wait_exit(5 * S);
}

#[test]
fn a_release_without_a_reply_is_indeterminate_after_the_transport_deadline() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    px.set_fault_for(1, Fault::StallReplies);
    let c = client_via(&px.addr(), 2);
    let t = c.acquire("r", S, 30 * S).unwrap().ticket().unwrap();
    let start = Instant::now();
    // The second connection forwards the release but swallows its reply.
    assert_eq!(t.release().unwrap(), Release::Indeterminate);
    let took = start.elapsed();
    assert!(
        took >= 5 * S - Duration::from_millis(50) && took < 6 * S,
        "{took:?}"
    );
    assert_eq!(px.forwarded_for("r").len(), 2, "sent once, never again");
    // It did take effect: Indeterminate was the honest answer.
    assert!(!held(&server, "r"));
}

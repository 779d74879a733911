//! The quotas per identity and the memory budget, against the real binary:
//! one source address (127.0.0.2) at its key, waiter or connection quota,
//! or holding half-open TLS handshakes, while another (127.0.0.1) is
//! served; long keys against a small `--max-memory`, with the server's
//! resident memory measured.

use std::io::{ErrorKind, Read};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use ticketd_testkit::process as common;

use common::{Client, NoReply, Reply, Ticketd};

fn attacker_ip() -> IpAddr {
    "127.0.0.2".parse().unwrap()
}

fn from_attacker(server: &Ticketd) -> Client {
    Client::connect_from(attacker_ip(), server.addr()).expect("connect from 127.0.0.2")
}

/// The sample of `name{label="value"}` on the admin port at `admin`.
fn labelled(admin: SocketAddr, name: &str, label: &str, value: &str) -> f64 {
    let (status, body) = common::http(admin, "GET", "/metrics").expect("a scrape");
    assert_eq!(status, 200);
    let sample = format!("{name}{{{label}=\"{value}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&sample))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {sample}in:\n{body}"))
}

fn quota_refusals(admin: SocketAddr, quota: &str) -> f64 {
    labelled(admin, "ticketd_quota_refusals_total", "quota", quota)
}

/// Sends `n` acquires at once and reads their replies.
fn acquire_many(c: &mut Client, keys: impl Iterator<Item = String>, wait_s: u8) -> Vec<Reply> {
    let mut frames = Vec::new();
    let mut n = 0;
    for (i, k) in keys.enumerate() {
        frames.extend_from_slice(&common::acquire_frame(&k, i as u64, wait_s, 60));
        n += 1;
    }
    c.send(&frames);
    c.recv_n(n)
}

/// Whether the server closes `s` within `timeout` (EOF or reset; an alert
/// record before it is read and dropped).
fn closed_within(s: &TcpStream, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 64];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match (&*s).read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn an_identity_at_its_key_quota_gets_busy_while_another_acquires() {
    let server = Ticketd::start(&[
        "--max-keys-per-identity",
        "100",
        "--admin-listen",
        "127.0.0.1:0",
    ]);
    let admin = server.admin_addr().unwrap();
    let mut attacker = from_attacker(&server);
    let replies = acquire_many(&mut attacker, (0..150).map(|i| format!("a{i}")), 0);
    let granted: Vec<&Reply> = replies
        .iter()
        .filter(|r| matches!(r, Reply::Acquired { .. }))
        .collect();
    let busy = replies
        .iter()
        .filter(|r| matches!(r, Reply::Busy { .. }))
        .count();
    assert_eq!((granted.len(), busy), (100, 50), "{replies:?}");
    // Another identity is not held back: it gets its own quota.
    let mut other = server.connect();
    let replies = acquire_many(&mut other, (0..100).map(|i| format!("b{i}")), 0);
    assert!(
        replies.iter().all(|r| matches!(r, Reply::Acquired { .. })),
        "{replies:?}"
    );
    // A release makes room for one more.
    let Reply::Acquired { token, key, .. } = granted[0] else {
        unreachable!()
    };
    let released = attacker.release_reply(key, *token);
    assert!(matches!(released, Reply::Released { .. }), "{released:?}");
    assert!(matches!(
        attacker.acquire_reply("a-again", 1, 0, 60),
        Reply::Acquired { .. }
    ));
    assert!(matches!(
        attacker.acquire_reply("a-over", 1, 0, 60),
        Reply::Busy { .. }
    ));
    assert_eq!(quota_refusals(admin, "keys"), 51.0);
    assert!(
        server.wait_for_log("--max-keys-per-identity 100", Duration::from_secs(5)),
        "{}",
        server.log()
    );
    let log = server.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("--max-keys-per-identity 100"))
        .collect();
    assert_eq!(lines.len(), 1, "one line per 10 s: {log}");
    assert!(lines[0].contains("ip:127.0.0.2"), "{log}");
}

#[test]
fn an_identity_at_its_waiter_quota_gets_busy_while_another_queues() {
    let server = Ticketd::start(&["--max-waiters-per-identity", "5"]);
    let mut holder = server.connect();
    let token = holder.acquire_reply("hot", 1, 0, 60).token();
    let mut attacker = from_attacker(&server);
    let mut frames = Vec::new();
    for i in 0..8 {
        frames.extend_from_slice(&common::acquire_frame("hot", i, 30, 60));
    }
    attacker.send(&frames);
    // The three over the quota are answered at once; five wait.
    for _ in 0..3 {
        assert!(matches!(attacker.recv(), Reply::Busy { .. }));
    }
    assert!(matches!(
        attacker.try_recv(Duration::from_millis(300)),
        Err(NoReply::TimedOut)
    ));
    // Another identity still queues, and is served in its turn.
    let mut other = server.connect();
    other.acquire("hot", 99, 30, 60);
    assert!(matches!(
        other.try_recv(Duration::from_millis(300)),
        Err(NoReply::TimedOut)
    ));
    drop(attacker);
    std::thread::sleep(Duration::from_millis(200));
    holder.release_reply("hot", token);
    assert!(matches!(other.recv(), Reply::Acquired { owner: 99, .. }));
    assert!(
        server.wait_for_log(
            "ip:127.0.0.2 has its --max-waiters-per-identity 5",
            Duration::from_secs(5)
        ),
        "{}",
        server.log()
    );
}

#[test]
fn connections_over_an_identitys_quota_are_refused_and_others_accepted() {
    let server = Ticketd::start(&[
        "--max-conns-per-identity",
        "3",
        "--admin-listen",
        "127.0.0.1:0",
    ]);
    let admin = server.admin_addr().unwrap();
    let mut held: Vec<Client> = (0..3)
        .map(|i| {
            let mut c = from_attacker(&server);
            let r = c.acquire_reply(&format!("c{i}"), 1, 0, 60);
            assert!(matches!(r, Reply::Acquired { .. }), "{r:?}");
            c
        })
        .collect();
    let mut fourth = from_attacker(&server);
    fourth.acquire("c3", 1, 0, 60);
    assert!(fourth.closed_within(Duration::from_secs(5)), "not refused");
    let mut others: Vec<Client> = (0..3).map(|_| server.connect()).collect();
    for (i, c) in others.iter_mut().enumerate() {
        let r = c.acquire_reply(&format!("o{i}"), 1, 0, 60);
        assert!(matches!(r, Reply::Acquired { .. }), "{r:?}");
    }
    assert_eq!(
        labelled(
            admin,
            "ticketd_connections_refused_total",
            "reason",
            "identity"
        ),
        1.0
    );
    assert_eq!(quota_refusals(admin, "connections"), 1.0);
    // A connection closed makes room for another.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut c = from_attacker(&server);
        c.acquire("c4", 1, 0, 60);
        match c.try_recv(Duration::from_secs(2)) {
            Ok(r) => {
                assert!(matches!(r, Reply::Acquired { .. }), "{r:?}");
                break;
            }
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("no room after a close: {e:?}"),
        }
    }
    assert!(server.log().contains("--max-conns-per-identity"));
}

/// With `--tls-client-ca`, 127.0.0.2 opens connections that never send a
/// ClientHello: beyond `--max-handshakes-per-identity` they are refused at
/// once, the rest are closed after `--handshake-timeout`, and a client
/// with a certificate on 127.0.0.1 is served meanwhile although the
/// half-open ones alone could fill `--max-conns`.
#[test]
fn half_open_tls_handshakes_are_bounded_per_address_and_time_out() {
    use ticketd::client::{Acquire, Client as TlsClient};
    use ticketd_testkit::certs::Certs;
    let certs = Certs::make("half-open");
    let mut args = certs.server_args();
    args.extend(
        [
            "--tls-client-ca",
            &certs.path("ca.pem"),
            "--max-conns",
            "10",
            "--max-handshakes-per-identity",
            "4",
            "--handshake-timeout",
            "2",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Ticketd::start(&args);
    let start = Instant::now();
    let mut half_open: Vec<TcpStream> = (0..10).map(|_| from_attacker(&server).stream).collect();
    let tls = TlsClient::builder()
        .address(server.addr().to_string())
        .tls_ca(certs.path("ca.pem"))
        .tls_client_cert(certs.path("client.pem"), certs.path("client-key.pem"))
        .connect_timeout(Duration::from_secs(3))
        .build()
        .expect("client builds");
    let r = tls
        .acquire("k", Duration::ZERO, Duration::from_secs(5))
        .expect("a TLS client on another address is served");
    assert!(matches!(r, Acquire::Acquired(_)), "{r:?}");
    // Six half-open connections were refused at once; the other four are
    // closed at the handshake timeout.
    let (refused, mut kept): (Vec<TcpStream>, Vec<TcpStream>) = half_open
        .drain(..)
        .partition(|s| closed_within(s, Duration::from_millis(300)));
    assert_eq!((refused.len(), kept.len()), (6, 4));
    assert!(start.elapsed() < Duration::from_millis(1500));
    for s in &mut kept {
        assert!(closed_within(s, Duration::from_secs(8)), "not closed");
        let at = start.elapsed();
        assert!(
            at >= Duration::from_secs(2) && at < Duration::from_secs(6),
            "closed after {at:?}"
        );
    }
    let log = server.log();
    assert!(log.contains("--max-handshakes-per-identity"), "{log}");
    assert!(
        server.wait_for_log("--handshake-timeout", Duration::from_secs(5)),
        "{log}"
    );
}

/// Keys of 60,000 bytes against `--max-memory 4M`: acquires are answered
/// B once the budget is reached, the server's resident memory grows by a
/// few MiB (without the budget the 600 keys asked for take some 40 MiB),
/// and releases, T answers and, once there is room, new keys still work.
#[test]
fn the_memory_budget_bounds_long_keys_and_the_server_stays_small() {
    let server = Ticketd::start(&[
        "--max-memory",
        "4M",
        "--max-key-bytes",
        "65536",
        "--admin-listen",
        "127.0.0.1:0",
    ]);
    let admin = server.admin_addr().unwrap();
    let before = server.rss_kib();
    let key = |i: usize| format!("{i:0>60000}");
    let mut c = server.connect();
    let mut granted = Vec::new();
    let mut busy = 0;
    for batch in 0..60 {
        for r in acquire_many(&mut c, (batch * 10..batch * 10 + 10).map(key), 0) {
            match r {
                Reply::Acquired { token, key, .. } => granted.push((key, token)),
                Reply::Busy { .. } => busy += 1,
                other => panic!("{other:?}"),
            }
        }
    }
    let after = server.rss_kib();
    eprintln!(
        "{} keys granted, {busy} busy; RSS {before} KiB -> {after} KiB",
        granted.len()
    );
    assert!(
        (40..=80).contains(&granted.len()),
        "{} granted",
        granted.len()
    );
    assert_eq!(granted.len() + busy, 600);
    assert!(
        after < before + 12 * 1024,
        "RSS grew from {before} to {after} KiB"
    );
    assert_eq!(quota_refusals(admin, "memory"), busy as f64);
    let locks = labelled(admin, "ticketd_memory_bytes", "part", "locks");
    assert!(locks > 2_000_000.0 && locks <= 4.0 * 1048576.0, "{locks}");
    // Held keys still answer T; short keys find no room until releases
    // (of more than the T reply's buffer took).
    let mut other = server.connect();
    assert!(matches!(
        other.acquire_reply(&granted[0].0, 1, 0, 60),
        Reply::Timeout { .. }
    ));
    assert!(matches!(
        other.acquire_reply("short", 1, 0, 60),
        Reply::Busy { .. }
    ));
    for (held, token) in granted.drain(..3) {
        assert!(matches!(
            c.release_reply(&held, token),
            Reply::Released { .. }
        ));
    }
    assert!(matches!(
        other.acquire_reply("short", 1, 0, 60),
        Reply::Acquired { .. }
    ));
    assert!(
        server.wait_for_log("--max-memory 4194304", Duration::from_secs(5)),
        "{}",
        server.log()
    );
}

#[test]
fn the_quota_flags_are_listed_and_checked() {
    let out = common::run_ticketd(&["--help"]);
    let text = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--max-keys-per-identity",
        "--max-waiters-per-identity",
        "--max-conns-per-identity",
        "--max-handshakes-per-identity",
        "--handshake-timeout",
        "--max-memory",
    ] {
        assert!(text.contains(flag), "--help does not mention {flag}");
    }
    for (args, needle) in [
        (&["--max-memory", "12"][..], "--max-memory"),
        (&["--max-memory", "1.5G"][..], "--max-memory"),
        (
            &["--max-keys-per-identity", "0"][..],
            "--max-keys-per-identity",
        ),
        (&["--handshake-timeout", "x"][..], "--handshake-timeout"),
    ] {
        let out = common::run_ticketd(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

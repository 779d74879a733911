//! What a client that merely reaches the port can do to others, against the
//! real binary: guessing tokens from many reconnecting connections, and
//! releasing or extending the grants of another authenticated identity.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ticketd::token::{GUESS_ALLOWANCE, GUESS_SUSTAINED_PER_SEC, RANDOM_MASK};
use ticketd_testkit::process as common;

use common::{socket_dir, ticket_as, Reply, Ticketd};

/// `ticketd_guess_misses_total` on the admin port at `admin`.
fn misses(admin: std::net::SocketAddr) -> f64 {
    let (status, body) = common::http(admin, "GET", "/metrics").expect("a scrape");
    assert_eq!(status, 200);
    common::metric(&body, "ticketd_guess_misses_total").expect("the guess metric")
}

/// The guess budget is per identity, not per connection: an attacker on
/// its own source address (127.0.0.2) that knows the victim's sequence
/// guesses from 40 connections at once for 20 s, dropping each connection
/// as soon as it stalls and opening a new one. The server answers at most
/// GUESS_ALLOWANCE + 20 s x GUESS_SUSTAINED_PER_SEC of its guesses in all
/// (under a per-connection throttle: about 100,000 a second), the victim
/// keeps its grant, and a bystander on another address (127.0.0.1)
/// releases and extends its own grants without delay meanwhile.
#[test]
fn reconnecting_guessers_share_one_budget_per_identity() {
    const SECS: u64 = 20;
    const CONNS: usize = 40;
    let server = Ticketd::start(&["--admin-listen", "127.0.0.1:0"]);
    let admin = server.admin_addr().expect("admin port");
    let addr = server.addr();
    let attacker_ip: IpAddr = "127.0.0.2".parse().unwrap();
    let mut victim = server.connect();
    let held = victim.acquire_reply("victim", 1, 0, 120).token();
    // Wrong tokens of the victim's step (the true one left out: a blind
    // guess finds it with probability 2^-16, which the budget makes take
    // about an hour on average).
    let step = held & !RANDOM_MASK;
    let wrong: Arc<Vec<u64>> = Arc::new(
        (0..=RANDOM_MASK)
            .map(|low| step | low)
            .filter(|&t| t != held)
            .collect(),
    );
    let start = Instant::now();
    let stop = start + Duration::from_secs(SECS);
    let received = Arc::new(AtomicU64::new(0));
    let connections = Arc::new(AtomicU64::new(0));
    let attackers = spawn_guessers(
        CONNS,
        attacker_ip,
        addr,
        stop,
        wrong,
        received.clone(),
        connections.clone(),
    );
    // The bystander, meanwhile: its own grants, extended and released at once.
    let (slowest, cycles) = bystander_cycles(&server, stop);
    let answered = misses(admin) as u64;
    let elapsed = start.elapsed().as_secs() + 1;
    for a in attackers {
        a.join().expect("attacker");
    }
    let received = received.load(Ordering::Relaxed);
    let connections = connections.load(Ordering::Relaxed);
    // One loop turn of slack: what was read before the answers were counted.
    let bound = u64::from(GUESS_ALLOWANCE) + elapsed * u64::from(GUESS_SUSTAINED_PER_SEC) + 50;
    eprintln!(
        "{answered} wrong answers ({received} read by the attacker) over {connections} \
         connections in {elapsed} s, bound {bound}; the bystander's slowest cycle of \
         {cycles}: {slowest:?}"
    );
    assert!(answered <= bound, "{answered} wrong answers > {bound}");
    assert!(
        answered >= u64::from(GUESS_ALLOWANCE),
        "the attack never got going: {answered}"
    );
    assert!(received <= answered);
    assert!(
        connections > 2 * CONNS as u64,
        "the attackers hardly reconnected"
    );
    assert!(
        slowest < Duration::from_millis(500),
        "the bystander waited {slowest:?}"
    );
    let released = victim.release_reply("victim", held);
    assert!(matches!(released, Reply::Released { .. }), "{released:?}");
    let log = server.log();
    assert!(log.contains("slowing down ip:127.0.0.2"), "{log}");
    assert_eq!(log.matches("slowing down").count(), 1, "{log}");
}

/// `conns` threads guessing wrong tokens of `victim` from `attacker_ip`
/// until `stop`, 100 releases pipelined a connection, each dropping its
/// connection once it stalls and opening a new one; they count the
/// answers read and the connections opened.
fn spawn_guessers(
    conns: usize,
    attacker_ip: IpAddr,
    addr: std::net::SocketAddr,
    stop: Instant,
    wrong: Arc<Vec<u64>>,
    received: Arc<AtomicU64>,
    connections: Arc<AtomicU64>,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..conns)
        .map(|i| {
            let (wrong, received, connections) =
                (wrong.clone(), received.clone(), connections.clone());
            std::thread::spawn(move || {
                let mut next = i * 997;
                while Instant::now() < stop {
                    let Some(mut c) = common::Client::connect_from(attacker_ip, addr) else {
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    };
                    connections.fetch_add(1, Ordering::Relaxed);
                    let mut frames = Vec::new();
                    for _ in 0..100 {
                        let t = wrong[next % wrong.len()];
                        frames.extend_from_slice(&common::release_frame("victim", t));
                        next += 1;
                    }
                    c.send(&frames);
                    // Read until the server stalls this connection, then
                    // drop it and come back on a fresh one.
                    while let Ok(r) = c.try_recv(Duration::from_millis(200)) {
                        assert!(matches!(r, Reply::NotReleased { .. }), "a guess got {r:?}");
                        received.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect()
}

/// The bystander until `stop`: its own grants, acquired, extended and
/// released at once; the slowest cycle and how many there were.
fn bystander_cycles(server: &Ticketd, stop: Instant) -> (Duration, u64) {
    let mut bystander = server.connect();
    let mut slowest = Duration::ZERO;
    let mut cycles = 0u64;
    while Instant::now() < stop {
        let t0 = Instant::now();
        let t = bystander.acquire_reply("other", cycles, 0, 5).token();
        let extended = bystander.extend_reply("other", t, 5);
        assert!(matches!(extended, Reply::Extended { .. }), "{extended:?}");
        let released = bystander.release_reply("other", t);
        assert!(matches!(released, Reply::Released { .. }), "{released:?}");
        slowest = slowest.max(t0.elapsed());
        cycles += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    (slowest, cycles)
}

fn must_be_root() {
    // setpriv needs root to switch uid; CI runs the tests as root.
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test runs as root (it runs clients under other uids)"
    );
}

/// A grant taken by an authenticated identity (here a Unix uid) can be
/// released and extended by that identity only, whatever the token: root
/// on the same socket and a TCP client both get "not held" for the right
/// token, the holder's own release works. The admin port names the holder
/// and shows the sequence, not the token, to a reader that is not
/// `--admin-identity`.
#[test]
fn grants_of_an_authenticated_identity_are_released_by_it_alone() {
    must_be_root();
    let dir = socket_dir("bound");
    let sock = format!("unix:{}", dir.join("t.sock").display());
    let server = Ticketd::start(&[
        "--listen",
        &sock,
        "--socket-mode",
        "0666",
        "--admin-listen",
        "127.0.0.1:0",
    ]);
    let tcp = server.addr().to_string();
    let nobody = 65534;
    let out = ticket_as(
        nobody,
        &["acquire", "k", "--lease", "60", "--server", &sock],
    );
    assert!(out.status.success(), "{out:?}");
    let token: u64 = String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let t = token.to_string();
    for server_addr in [sock.as_str(), tcp.as_str()] {
        for op in ["release", "extend"] {
            let out = ticket_as(0, &[op, "k", &t, "--server", server_addr]);
            assert_eq!(
                out.status.code(),
                Some(123),
                "root {op} on {server_addr}: {out:?}"
            );
        }
    }
    // Another uid is refused too.
    let out = ticket_as(1000, &["release", "k", &t, "--server", &sock]);
    assert_eq!(out.status.code(), Some(123), "{out:?}");
    // The admin port names the holder; the token is not shown.
    let admin = server.admin_addr().unwrap();
    let (status, body) = common::http(admin, "GET", "/v1/locks/k").unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("\"token\":null"), "{body}");
    assert!(
        body.contains(&format!("\"sequence\":{}", token >> 16)),
        "{body}"
    );
    assert!(body.contains("\"holder\":\"uid:65534\""), "{body}");
    // The holder extends and releases it.
    let out = ticket_as(
        nobody,
        &["extend", "k", &t, "--lease", "30", "--server", &sock],
    );
    assert!(out.status.success(), "{out:?}");
    let out = ticket_as(nobody, &["release", "k", &t, "--server", &sock]);
    assert!(out.status.success(), "{out:?}");
    // Between two unauthenticated TCP clients the token alone decides, as
    // in protocol 1.0.
    let mut a = server.connect();
    let mut b = server.connect();
    let tok = a.acquire_reply("shared", 1, 0, 30).token();
    assert!(matches!(
        b.release_reply("shared", tok),
        Reply::Released { .. }
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--admin-identity uid:0` may release another identity's grant by its
/// token, and reads full tokens on the admin port (here a Unix socket);
/// `--admin-identity` must name an authenticated identity.
#[test]
fn the_admin_identity_releases_any_grant_and_reads_tokens() {
    must_be_root();
    let out = common::run_ticketd(&["--admin-identity", "ip:127.0.0.1"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("authenticated identity"));
    let dir = socket_dir("admin-id");
    let sock = format!("unix:{}", dir.join("t.sock").display());
    let admin_sock = format!("unix:{}", dir.join("admin.sock").display());
    let server = Ticketd::start(&[
        "--listen",
        &sock,
        "--socket-mode",
        "0666",
        "--admin-listen",
        &admin_sock,
        "--admin-identity",
        "uid:0",
    ]);
    let out = ticket_as(65534, &["acquire", "k", "--lease", "60", "--server", &sock]);
    assert!(out.status.success(), "{out:?}");
    let token = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let out = ticket_as(0, &["status", "k", "--json", "--admin", &admin_sock]);
    assert!(out.status.success(), "{out:?}");
    let json = String::from_utf8(out.stdout).unwrap();
    assert!(json.contains(&format!("\"token\":{token}")), "{json}");
    // Root over TCP is an address, not the admin identity: refused.
    let out = ticket_as(
        0,
        &[
            "release",
            "k",
            &token,
            "--server",
            &server.addr().to_string(),
        ],
    );
    assert_eq!(out.status.code(), Some(123), "{out:?}");
    let out = ticket_as(0, &["release", "k", &token, "--server", &sock]);
    assert!(out.status.success(), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

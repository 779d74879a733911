//! Real-process fault tests of single-mode ticketd: the real binary on
//! loopback, hurt the way production hurts it.
//!
//! * SIGKILL and restart in a loop under load, with and without `--data-dir`:
//!   every client history passes the checker (tokens after each restart
//!   exceed all earlier ones; exclusion within each incarnation, and with
//!   `--data-dir` across restarts too, thanks to the restart grace).
//! * SIGSTOP past every lease and wait, then SIGCONT: no double grant, no
//!   grant to a waiter whose wait ran out during the stop.
//! * Wall-clock jumps forward and back under libfaketime (monotonic clock
//!   left alone): leases and waits keep their length; a restart with the
//!   clock set back still resumes tokens above the data dir's mark.
//! * Descriptor exhaustion: connections already open keep being served.
//! * Slow and idle abuse at once: half-sent frames closed by the frame
//!   timeout, a thousand idle connections, a client that never reads; a
//!   well-behaved client's latency stays low and memory stays bounded.
//! * Disk full on the data directory (a 64 KiB tmpfs): a clear error at
//!   start-up, no corrupt mark, and tokens above the old mark once there is
//!   room again.
//!
//! See docs/RELIABILITY.md for what each shows and the guarantees.

use ticketd_testkit::process as common;

use std::io::{ErrorKind, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{raise_own_fd_limit, Client, NoReply, Reply, Ticketd};
use ticketd_testkit::checker::{History, Outcome, RealClock, ReleaseOutcome, Report};

// The tests here measure timings and load the machine; they run one at a
// time, and alone in the binary, so that no other test's load shows up in
// their figures.
use crate::alone as serial;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ticketd-fault-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The lowest token of this incarnation: a grant (after any restart
/// grace) on a key no test uses, released at once, before any load.
fn next_token_of(server: &Ticketd) -> u64 {
    let mut c = server.connect();
    c.acquire("first-token-probe", 1, 120, 1);
    let token = c
        .try_recv(Duration::from_secs(120))
        .expect("the probe is granted once any restart grace is over")
        .token();
    assert!(matches!(
        c.release_reply("first-token-probe", token),
        Reply::Released { .. }
    ));
    token
}

/// Session ids unique across the whole test process.
fn new_session() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One client thread's loop: acquire a key, hold it briefly, release it,
/// recording everything; stops when the server goes away or at `until`.
fn load_client(
    server_addr: std::net::SocketAddr,
    client_id: u64,
    keys: &[&str],
    clock: RealClock,
    until: Instant,
    grants: &AtomicU64,
) -> History {
    let mut h = History::new();
    let session = new_session();
    let mut c = Client::connect(server_addr);
    let mut owner = client_id << 32;
    let mut i = 0;
    while Instant::now() < until {
        i += 1;
        owner += 1;
        let key = keys[i % keys.len()];
        let op = h.acquire(client_id, session, key, owner, 1, 2, clock.now_us());
        c.acquire(key, owner, 1, 2);
        let token = match c.try_recv(Duration::from_secs(3)) {
            Ok(Reply::Acquired {
                token, owner: o, ..
            }) => {
                assert_eq!(o, owner);
                h.acquired(op, Outcome::Granted { token }, clock.now_us());
                grants.fetch_add(1, Ordering::Relaxed);
                token
            }
            Ok(Reply::Timeout { .. }) => {
                h.acquired(op, Outcome::Timeout, clock.now_us());
                continue;
            }
            Ok(Reply::Busy { .. }) => {
                h.acquired(op, Outcome::Busy, clock.now_us());
                continue;
            }
            Ok(other) => panic!("unexpected reply {other:?}"),
            Err(_) => {
                h.acquired(op, Outcome::Indeterminate, clock.now_us());
                h.session_closed(session, clock.now_us());
                return h;
            }
        };
        std::thread::sleep(Duration::from_millis(client_id % 3));
        let rel = h.release(client_id, session, key, token, clock.now_us());
        c.release(key, token);
        match c.try_recv(Duration::from_secs(3)) {
            Ok(Reply::Released { .. }) => h.released(rel, ReleaseOutcome::Released, clock.now_us()),
            Ok(Reply::NotReleased { .. }) => {
                h.released(rel, ReleaseOutcome::NotReleased, clock.now_us());
            }
            Ok(other) => panic!("unexpected reply {other:?}"),
            Err(_) => {
                h.released(rel, ReleaseOutcome::Indeterminate, clock.now_us());
                h.session_closed(session, clock.now_us());
                return h;
            }
        }
    }
    h.session_closed(session, clock.now_us());
    h
}

/// The restart grace the start-up line reports, in milliseconds (0: none).
fn grace_in_force_ms(log: &str) -> u64 {
    log.split_once("restart_grace=in-force for ")
        .and_then(|(_, rest)| rest.split(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// Four rounds of: start, load from four clients on two keys, SIGKILL.
fn kill_and_restart_under_load(data_dir: Option<&Path>) -> Report {
    let clock = RealClock::new();
    let mut history = History::new();
    let mut highest = 0u64;
    for round in 0..4 {
        let mut server = start_on_loopback(data_dir);
        let first = next_token_of(&server);
        if round > 0 {
            assert!(
                first > highest,
                "round {round}: restarted at token {first}, not above {highest}"
            );
            if data_dir.is_some() {
                // The restart grace holds every key until the leases of
                // the killed server have ended: exclusion holds across it.
                history.server_restart_with_grace(clock.now_us(), first);
            } else {
                history.server_restart(clock.now_us(), first);
            }
        }
        let addr = server.addr();
        // The clients run until the kill ends their connections; `until`
        // only bounds a round whose kill never comes.
        let until = Instant::now() + Duration::from_secs(60);
        let grants = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4u64)
            .map(|id| {
                let grants = Arc::clone(&grants);
                std::thread::spawn(move || {
                    load_client(addr, round * 10 + id, &["a", "b"], clock, until, &grants)
                })
            })
            .collect();
        // With a data dir, the restart grace holds every key for what is
        // left of the killed server's leases: load past it before the kill,
        // and kill only once this round has granted (on a loaded machine
        // the first grant after the grace can take a while).
        let grace_ms = grace_in_force_ms(&server.log());
        std::thread::sleep(Duration::from_millis(400 + grace_ms));
        let deadline = Instant::now() + Duration::from_secs(30);
        while grants.load(Ordering::Relaxed) < 20 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        server.signal(libc::SIGKILL);
        server
            .wait_exit(Duration::from_secs(5))
            .expect("SIGKILL ends the server");
        assert!(!server.log().contains("panicked"), "{}", server.log());
        for t in threads {
            history.merge(t.join().expect("client thread"));
        }
        if let Err(v) = history.check() {
            panic!("round {round}: {v}");
        }
        let before = highest;
        highest = highest_granted(&history).unwrap_or(highest);
        assert!(highest > before, "round {round} granted nothing");
    }
    let report = history.check().unwrap_or_else(|v| panic!("{v}"));
    assert!(
        report.grants >= 40,
        "too little load to mean anything: {report}"
    );
    println!("kill/restart: {report}");
    report
}

/// The server on a free loopback port, with `data_dir` when given.
fn start_on_loopback(data_dir: Option<&Path>) -> Ticketd {
    let dir = data_dir.map(|d| d.to_str().expect("utf-8 path").to_string());
    let mut args = vec!["--listen", "127.0.0.1:0"];
    if let Some(d) = &dir {
        args.extend_from_slice(&["--data-dir", d]);
    }
    Ticketd::start_raw(&[], &args)
}

/// The highest token granted in `history`, if any.
fn highest_granted(history: &History) -> Option<u64> {
    history
        .events()
        .iter()
        .filter_map(|e| match e {
            ticketd_testkit::checker::Event::Acquired {
                outcome: Outcome::Granted { token },
                ..
            } => Some(*token),
            _ => None,
        })
        .max()
}

#[test]
fn sigkill_and_restart_under_load_with_a_data_dir_keeps_tokens_growing() {
    let _serial = serial();
    let dir = temp_dir("kill");
    kill_and_restart_under_load(Some(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigkill_and_restart_under_load_without_a_data_dir_keeps_tokens_growing() {
    let _serial = serial();
    kill_and_restart_under_load(None);
}

// Long because it is one scenario, step by step.
/// SIGSTOP for longer than the holder's lease and the first waiter's wait,
/// then SIGCONT. The first turn after the stop sees the lease and the wait
/// run out: the waiter whose wait ran out gets Timeout, never the key; the
/// next waiter gets the key with a new token; the old holder's release is
/// answered NotReleased.
#[test]
fn sigstop_past_the_leases_then_sigcont_grants_no_one_twice() {
    let _serial = serial();
    let server = Ticketd::start(&[]);
    let clock = RealClock::new();
    let mut h = History::new();
    let (s_holder, s_short, s_long) = (new_session(), new_session(), new_session());

    let mut holder = server.connect();
    let op = h.acquire(1, s_holder, "k", 1, 0, 1, clock.now_us());
    holder.acquire("k", 1, 0, 1);
    let t1 = holder.recv().token();
    h.acquired(op, Outcome::Granted { token: t1 }, clock.now_us());

    let mut short = server.connect();
    let op_short = h.acquire(2, s_short, "k", 2, 1, 5, clock.now_us());
    short.acquire("k", 2, 1, 5);
    let mut long = server.connect();
    let op_long = h.acquire(3, s_long, "k", 3, 30, 5, clock.now_us());
    long.acquire("k", 3, 30, 5);
    // Both are queued: nothing comes back yet.
    assert_eq!(
        short.try_recv(Duration::from_millis(200)),
        Err(NoReply::TimedOut)
    );

    server.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(2500));
    // A request written while the server is stopped waits in the kernel.
    let s_late = new_session();
    let mut late = server.connect();
    let op_late = h.acquire(4, s_late, "k", 4, 0, 5, clock.now_us());
    late.acquire("k", 4, 0, 5);
    server.signal(libc::SIGCONT);

    let outcome_of = |reply: &Reply| match reply {
        Reply::Acquired { token, .. } => Outcome::Granted { token: *token },
        Reply::Timeout { .. } => Outcome::Timeout,
        other => panic!("unexpected {other:?}"),
    };
    // The waiter whose 1 s wait ran out during the stop is never granted.
    let r_short = short.recv();
    h.acquired(op_short, outcome_of(&r_short), clock.now_us());
    assert!(matches!(r_short, Reply::Timeout { .. }), "{r_short:?}");
    // The key goes either to the head waiter (the deadline index reached
    // the expiry first) or to the request buffered during the stop (it took
    // the expired key over on arrival, PROTOCOL §2.4): never to both.
    let r_late = late.recv();
    h.acquired(op_late, outcome_of(&r_late), clock.now_us());
    let granted = match r_late {
        Reply::Acquired { token, .. } => {
            // The head waiter stays queued behind the new 5 s lease.
            assert_eq!(
                long.try_recv(Duration::from_secs(1)),
                Err(NoReply::TimedOut)
            );
            token
        }
        _ => {
            let r_long = long.recv();
            h.acquired(op_long, outcome_of(&r_long), clock.now_us());
            r_long.token()
        }
    };
    assert!(granted > t1);
    let rel = h.release(1, s_holder, "k", t1, clock.now_us());
    holder.release("k", t1);
    assert_eq!(
        holder.recv(),
        Reply::NotReleased {
            token: t1,
            key: "k".into()
        }
    );
    h.released(rel, ReleaseOutcome::NotReleased, clock.now_us());
    for s in [s_holder, s_short, s_long, s_late] {
        h.session_closed(s, clock.now_us());
    }
    h.check().unwrap_or_else(|v| panic!("{v}"));
}

const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// The date `days` from now, as the server's log prints it (YYYY-MM-DD).
fn date_in_days(days: i32) -> String {
    let out = Command::new("date")
        .args(["-u", "-d", &format!("{days} days"), "+%Y-%m-%d"])
        .output()
        .expect("run date");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Waits for one reply and returns it with the time it took.
fn timed_recv(c: &mut Client, timeout: Duration) -> (Reply, Duration) {
    let start = Instant::now();
    let r = c.try_recv(timeout).expect("a reply");
    (r, start.elapsed())
}

// Long because it is one scenario, step by step.
/// The wall clock jumps ten days forward, then twenty back, under a server
/// whose monotonic clock is left alone (`DONT_FAKE_MONOTONIC=1`): that is
/// what an NTP step or an operator's `date -s` does. Leases and waits keep
/// their length; only the log's timestamps move.
#[test]
fn wall_clock_jumps_change_no_lease_and_no_wait() {
    let _serial = serial();
    assert!(
        Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} missing: apt-get install libfaketime (.ci/run does)"
    );
    let dir = temp_dir("faketime");
    std::fs::create_dir_all(&dir).unwrap();
    let offset_file = dir.join("offset");
    std::fs::write(&offset_file, "+0\n").unwrap();
    let preload = format!("LD_PRELOAD={LIBFAKETIME}");
    let ts_file = format!("FAKETIME_TIMESTAMP_FILE={}", offset_file.display());
    let server = Ticketd::start_raw(
        &[
            "env",
            &preload,
            &ts_file,
            "FAKETIME_NO_CACHE=1",
            "DONT_FAKE_MONOTONIC=1",
        ],
        &["--listen", "127.0.0.1:0", "--log-level", "debug"],
    );
    let mut holder = server.connect();
    let mut other = server.connect();
    let mut waiter = server.connect();

    // Forward jump while a 2 s lease runs.
    let t1 = holder.acquire_reply("k", 1, 0, 2).token();
    let granted_at = Instant::now();
    std::fs::write(&offset_file, "+10d\n").unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let r = other.acquire_reply("k", 2, 0, 2);
    assert!(matches!(r, Reply::Timeout { .. }), "lease cut short: {r:?}");
    assert!(
        server.wait_for_log(&date_in_days(10), Duration::from_secs(2)),
        "the server's wall clock did not jump (faketime inactive?):\n{}",
        server.log()
    );
    waiter.acquire("k", 3, 10, 1);
    let (r, _) = timed_recv(&mut waiter, Duration::from_secs(5));
    let held_for = granted_at.elapsed();
    assert!(
        matches!(r, Reply::Acquired { token, .. } if token > t1),
        "{r:?}"
    );
    assert!(
        held_for >= Duration::from_millis(1900) && held_for < Duration::from_millis(3500),
        "a 2 s lease lasted {held_for:?} across a forward jump"
    );

    // Backward jump while the waiter's 1 s lease runs and another waits 1 s.
    std::fs::write(&offset_file, "-10d\n").unwrap();
    let (r, waited) = {
        other.acquire("k", 4, 1, 1);
        timed_recv(&mut other, Duration::from_secs(5))
    };
    // The 1 s lease and the 1 s wait end together: either answer is right,
    // but it comes after about a second, neither at once nor never.
    assert!(
        matches!(r, Reply::Timeout { .. } | Reply::Acquired { .. }),
        "{r:?}"
    );
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_millis(2500),
        "a 1 s wait took {waited:?} across a backward jump"
    );
    assert!(
        server.wait_for_log(&date_in_days(-10), Duration::from_secs(2)),
        "the server's wall clock did not jump back:\n{}",
        server.log()
    );
    assert!(!server.log().contains("panicked"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// While the server is out of descriptors (new connections wait in the
/// backlog), the connections it already has keep being served: releases,
/// hand-overs to queued waiters and new acquires go on at normal speed.
#[test]
fn out_of_descriptors_open_connections_keep_working() {
    let _serial = serial();
    raise_own_fd_limit();
    let server = Ticketd::start_raw(
        &["prlimit", "--nofile=40:40"],
        &["--listen", "127.0.0.1:0", "--max-conns", "1000"],
    );
    let mut holder = server.connect();
    let mut waiter = server.connect();
    let t = holder.acquire_reply("x", 1, 0, 30).token();
    waiter.acquire("x", 2, 20, 30);
    // Exhaust the server's descriptors with connections that each ask once.
    let mut extra: Vec<Client> = (0..60).map(|_| server.connect()).collect();
    for (i, c) in extra.iter_mut().enumerate() {
        c.acquire(&format!("e{i}"), 100 + i as u64, 0, 30);
    }
    assert!(
        server.wait_for_log("out of file descriptors", Duration::from_secs(3)),
        "{}",
        server.log()
    );
    // Saturated: the open connections still get prompt answers.
    let start = Instant::now();
    assert!(matches!(
        holder.release_reply("x", t),
        Reply::Released { .. }
    ));
    let (r, _) = timed_recv(&mut waiter, Duration::from_secs(2));
    assert!(matches!(r, Reply::Acquired { owner: 2, .. }), "{r:?}");
    for i in 0..50u64 {
        let t = holder.acquire_reply("y", 10 + i, 0, 5).token();
        assert!(matches!(
            holder.release_reply("y", t),
            Reply::Released { .. }
        ));
    }
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "51 round trips took {took:?}"
    );
    let cpu_before = server.cpu_ticks();
    std::thread::sleep(Duration::from_secs(1));
    let cpu = server.cpu_ticks() - cpu_before;
    assert!(
        cpu < 30,
        "{cpu} ticks of CPU in 1 s while out of descriptors"
    );
    // Descriptors come back: every waiting connection is served.
    drop(holder);
    for (i, c) in extra.iter_mut().enumerate() {
        match c.try_recv(Duration::from_secs(5)) {
            Ok(Reply::Acquired { .. }) => {}
            other => panic!("connection {i} after descriptors freed: {other:?}"),
        }
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// All the slow and idle abuse at once: a thousand idle connections, fifty
/// connections holding half a frame, one client that pipelines and never
/// reads. The half frames are closed by `--frame-timeout`, the non-reader by
/// its unread replies making no progress; meanwhile a well-behaved client's
/// round trips stay fast and the server's memory stays small.
#[test]
fn slow_and_idle_abuse_leaves_other_clients_fast_and_memory_bounded() {
    let _serial = serial();
    raise_own_fd_limit();
    let server = Ticketd::start(&["--frame-timeout", "1"]);
    let rss_start = server.rss_kib();
    let idle: Vec<TcpStream> = (0..1000)
        .map(|_| TcpStream::connect(server.addr()).expect("idle connection"))
        .collect();
    let mut partial: Vec<Client> = (0..50).map(|_| server.connect()).collect();
    for c in &mut partial {
        c.send(&common::acquire_frame("half", 7, 0, 5)[..6]);
    }
    // The non-reader: acquires on a held key with wait 0 (each answered T)
    // until its socket stops taking bytes.
    let mut hold = server.connect();
    let _held = hold.acquire_reply("held", 1, 0, 60).token();
    let mut sink = TcpStream::connect(server.addr()).unwrap();
    sink.set_nonblocking(true).unwrap();
    let frame = common::acquire_frame("held", 9, 0, 5);
    let mut burst = Vec::new();
    for _ in 0..4096 {
        burst.extend_from_slice(&frame);
    }
    // Write until the socket stays blocked for 1.5 s: the kernel buffers on
    // both sides are full and the server has stopped reading this client.
    let (written, closed_early) = flood_until_blocked(&mut sink, &burst);
    // A well-behaved client meanwhile.
    let p99 = round_trips_stay_fast(&server);
    // The half frames are closed within a few frame timeouts.
    for (i, c) in partial.iter_mut().enumerate() {
        match c.try_recv(Duration::from_secs(4)) {
            Err(NoReply::Closed) => {}
            other => panic!("half-frame connection {i} not closed: {other:?}"),
        }
    }
    // The non-reader is closed too once its replies stop draining. Reading
    // them would be progress, so first wait (without reading) for more than
    // the frame timeout, then drain what is left to see the close.
    std::thread::sleep(Duration::from_millis(2500));
    let closed = closed_once_drained(&mut sink, closed_early);
    let rss = server.rss_kib();
    println!(
        "abuse: {} idle, {} half frames, {written} bytes unread; p99 {p99:?}; RSS {rss_start} -> {rss} KiB",
        idle.len(),
        partial.len()
    );
    assert!(closed, "the client that never reads was never closed");
    assert!(
        rss < rss_start + 64 * 1024,
        "server RSS grew from {rss_start} KiB to {rss} KiB"
    );
    // The idle connections are still served (idle is not abuse).
    an_idle_connection_is_served(idle);
}

/// Writes `burst` to `sink` until the socket stays blocked for 1.5 s (at
/// most 10 s): the bytes written, and whether the server closed it first.
fn flood_until_blocked(sink: &mut TcpStream, burst: &[u8]) -> (usize, bool) {
    let mut written = 0usize;
    let mut closed_early = false;
    let mut blocked_since: Option<Instant> = None;
    let flood_until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < flood_until {
        match sink.write(burst) {
            Ok(n) => {
                written += n;
                blocked_since = None;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let since = *blocked_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_millis(1500) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(_) => {
                closed_early = true; // closed by the server already
                break;
            }
        }
    }
    (written, closed_early)
}

/// A well-behaved client's 200 acquire-release round trips: the 99th
/// percentile stays fast. Returns it.
fn round_trips_stay_fast(server: &Ticketd) -> Duration {
    let mut good = server.connect();
    let mut rtts = Vec::new();
    for i in 0..200u64 {
        let start = Instant::now();
        let t = good.acquire_reply("good", 100 + i, 0, 5).token();
        good.release_reply("good", t);
        rtts.push(start.elapsed());
    }
    rtts.sort();
    let p99 = rtts[rtts.len() * 99 / 100];
    // Unhurt, a round trip takes a few milliseconds; a server stalled by
    // the abuse (a blocking write, a busy loop) would take a second or more.
    // The bound leaves room for a loaded CI machine.
    assert!(
        p99 < Duration::from_millis(250),
        "p99 round trip {p99:?} under abuse (max {:?})",
        rtts.last()
    );
    p99
}

/// Whether the non-reader `sink` is closed (or was already,
/// `closed_early`): drains what is left, up to 5 s, to see the close.
fn closed_once_drained(sink: &mut TcpStream, closed_early: bool) -> bool {
    let mut closed = closed_early;
    let until = Instant::now() + Duration::from_secs(5);
    sink.set_nonblocking(false).unwrap();
    sink.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = vec![0u8; 1 << 20];
    while !closed && Instant::now() < until {
        match std::io::Read::read(sink, &mut buf) {
            Ok(0) => {
                closed = true;
                break;
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                closed = true;
                break;
            }
            _ => {}
        }
    }
    closed
}

/// The idle connections are still served (idle is not abuse): one of
/// `idle` acquires and gets its A.
fn an_idle_connection_is_served(idle: Vec<TcpStream>) {
    let mut one = idle.into_iter().next().unwrap();
    one.write_all(&common::acquire_frame("idle", 5, 0, 5))
        .unwrap();
    one.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut reply = [0u8; 64];
    let n = std::io::Read::read(&mut one, &mut reply).expect("reply on an idle connection");
    assert!(
        matches!(
            ticketd::proto::decode_reply(&reply[..n], 64),
            ticketd::proto::Decoded::Frame {
                frame: ticketd::proto::Reply::Acquired { owner: 5, .. },
                ..
            }
        ),
        "{:?}",
        &reply[..n]
    );
}

/// Without the rights to mount a tmpfs (root), a disk-full test fails with
/// the reason, unless `TICKETD_SKIP_DISKFULL=1` asks to skip it on purpose.
fn skip_or_fail(why: &str) {
    if std::env::var_os("TICKETD_SKIP_DISKFULL").is_some_and(|v| v == "1") {
        println!("skipped on request (TICKETD_SKIP_DISKFULL=1): {why}");
        return;
    }
    panic!(
        "cannot mount a tmpfs for the disk-full test ({why}); run as root, \
         or set TICKETD_SKIP_DISKFULL=1 to skip it"
    );
}

/// A tiny tmpfs mounted for one test, unmounted (and removed) on drop.
struct TinyFs {
    dir: PathBuf,
}

impl TinyFs {
    /// Mounts a tmpfs of `size` at a fresh directory, or says why not.
    fn mount(name: &str, size: &str) -> Result<TinyFs, String> {
        let dir = temp_dir(name);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            let _ = std::fs::remove_dir(&dir);
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(TinyFs { dir })
    }

    /// Fills the file system with one file; returns its path.
    fn fill(&self) -> PathBuf {
        let path = self.dir.join("filler");
        let mut f = std::fs::File::create(&path).expect("create filler");
        let block = vec![0u8; 4096];
        loop {
            match f.write_all(&block) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("filling the tmpfs: {e}"),
            }
        }
        let _ = f.sync_all();
        path
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The data directory's file system is full when the server starts (it must
/// reserve a new block of tokens before serving): it refuses to start with
/// a message naming the directory and the error, the old mark is intact, and
/// once there is room the server resumes above every token issued before.
#[test]
fn a_full_data_dir_stops_start_up_cleanly_and_loses_nothing() {
    let _serial = serial();
    let fs = match TinyFs::mount("diskfull", "64k") {
        Ok(fs) => fs,
        Err(why) => return skip_or_fail(&why),
    };
    let data = fs.dir.join("data");
    let data_s = data.to_str().unwrap().to_string();
    // The keys stay held across the kill; without a restart grace the
    // restarted server grants them again at once (this test is about the
    // mark; tests/server/restart_grace.rs is about the grace).
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        &data_s,
        "--restart-grace",
        "off",
    ];
    let mut server = Ticketd::start_raw(&[], &args);
    let mut c = server.connect();
    let mut issued = Vec::new();
    for i in 0..20u64 {
        let t = c.acquire_reply(&format!("k{i}"), i, 0, 30).token();
        issued.push(t);
    }
    server.signal(libc::SIGKILL);
    server.wait_exit(Duration::from_secs(5)).expect("killed");
    let mark_path = data.join("token-mark");
    let mark_before = std::fs::read(&mark_path).expect("mark written");

    let filler = fs.fill();
    let out = common::bin_command(common::ticketd_bin())
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run ticketd");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "start on a full disk: {stderr}");
    assert!(
        stderr.contains(&data_s) && stderr.to_lowercase().contains("no space"),
        "the error names neither the directory nor the cause: {stderr}"
    );
    assert_eq!(
        std::fs::read(&mark_path).expect("mark still there"),
        mark_before,
        "a failed start changed the mark"
    );

    std::fs::remove_file(filler).unwrap();
    let server = Ticketd::start_raw(&[], &args);
    let first = next_token_of(&server);
    let highest = *issued.iter().max().unwrap();
    assert!(first > highest, "resumed at {first}, not above {highest}");
    let t = server.connect().acquire_reply("k0", 99, 0, 30).token();
    assert!(t > highest);
}

/// Grants and releases `pairs` times on one connection, pipelined in
/// batches on distinct keys, and checks every grant takes the next sequence
/// step after the one of `after` (no one else uses the server). Returns the
/// last token.
fn grant_release_burst(server: &Ticketd, after: u64, pairs: u64) -> u64 {
    use ticketd::token::RANDOM_BITS;
    let mut c = server.connect();
    let mut expected_step = (after >> RANDOM_BITS) + 1;
    let mut last = after;
    let mut done = 0u64;
    let mut batch = Vec::new();
    while done < pairs {
        let n = (pairs - done).min(1024);
        batch.clear();
        for i in 0..n {
            batch.extend_from_slice(&common::acquire_frame(&format!("burst{i}"), i, 0, 30));
        }
        c.send(&batch);
        let tokens: Vec<u64> = c.recv_n(n as usize).iter().map(Reply::token).collect();
        batch.clear();
        for (i, t) in tokens.iter().enumerate() {
            assert_eq!(
                t >> RANDOM_BITS,
                expected_step,
                "a grant was lost or reordered"
            );
            expected_step += 1;
            batch.extend_from_slice(&common::release_frame(&format!("burst{i}"), *t));
        }
        c.send(&batch);
        for (reply, t) in c.recv_n(n as usize).iter().zip(&tokens) {
            assert!(
                matches!(reply, Reply::Released { token, .. } if token == t),
                "{reply:?}"
            );
        }
        last = *tokens.last().expect("n > 0");
        done += n;
    }
    last
}

/// The data directory fills up while the server runs and needs to reserve
/// its next block of tokens: it logs a clear error, keeps granting under the
/// mark it has (no grant lost, no token reused), writes the mark once there
/// is room again, and a restart after SIGKILL resumes above every token.
#[test]
fn a_data_dir_that_fills_up_while_serving_loses_no_grant() {
    let _serial = serial();
    let fs = match TinyFs::mount("diskfull-run", "64k") {
        Ok(fs) => fs,
        Err(why) => return skip_or_fail(&why),
    };
    let data = fs.dir.join("data");
    let data_s = data.to_str().unwrap().to_string();
    let args = ["--listen", "127.0.0.1:0", "--data-dir", &data_s];
    let mut server = Ticketd::start_raw(&[], &args);
    let first = next_token_of(&server);
    let filler = fs.fill();
    // Half a block of grants makes the server reserve the next block.
    let start = Instant::now();
    let half_block = ticketd::single::TOKEN_BLOCK / 2;
    let last = grant_release_burst(&server, first, half_block / ticketd::token::STEP + 10);
    println!(
        "{} grants in {:?}",
        half_block / ticketd::token::STEP + 10,
        start.elapsed()
    );
    assert!(
        server.wait_for_log(
            "cannot persist the token high-water mark",
            Duration::from_secs(5)
        ),
        "no error logged for a full data dir:\n{}",
        server.log()
    );
    let log = server.log();
    assert!(
        log.contains(&data_s),
        "the error does not name the directory"
    );
    // Room again: serving goes on and the next mark is written.
    std::fs::remove_file(filler).unwrap();
    let last = grant_release_burst(&server, last, 100);
    let mark = std::fs::read_to_string(data.join("token-mark")).expect("mark");
    let mark_value: u64 = mark
        .lines()
        .find_map(|l| l.strip_prefix("mark ")?.trim().parse().ok())
        .unwrap_or_else(|| panic!("mark unreadable: {mark:?}"));
    assert!(
        mark_value >= last,
        "mark {mark_value} below issued token {last}"
    );
    server.signal(libc::SIGKILL);
    server.wait_exit(Duration::from_secs(5)).expect("killed");
    // No grace: the probe grant need not wait out the killed run's leases.
    let mut no_grace = args.to_vec();
    no_grace.extend_from_slice(&["--restart-grace", "off"]);
    let server = Ticketd::start_raw(&[], &no_grace);
    let resumed = next_token_of(&server);
    assert!(resumed > last, "resumed at {resumed}, not above {last}");
}

/// A restart with the wall clock set ten days back: with `--data-dir` the
/// tokens still resume above every earlier one (the mark, not the clock,
/// decides). Without a data dir the first token comes from the wall clock,
/// which is why docs/OPERATIONS.md asks for `--data-dir` where the clock may go back.
#[test]
fn with_a_data_dir_a_clock_set_back_across_a_restart_keeps_tokens_growing() {
    let _serial = serial();
    let dir = temp_dir("faketime-restart");
    std::fs::create_dir_all(&dir).unwrap();
    let offset_file = dir.join("offset");
    let data = dir.join("data");
    let data_s = data.to_str().unwrap().to_string();
    let preload = format!("LD_PRELOAD={LIBFAKETIME}");
    let ts_file = format!("FAKETIME_TIMESTAMP_FILE={}", offset_file.display());
    let wrapper = [
        "env",
        preload.as_str(),
        ts_file.as_str(),
        "FAKETIME_NO_CACHE=1",
        "DONT_FAKE_MONOTONIC=1",
    ];
    // "k" stays held across the kill: no restart grace, so that the
    // restarted server grants it at once (the tokens are what is checked).
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data_s.as_str(),
        "--restart-grace",
        "off",
    ];
    std::fs::write(&offset_file, "+0\n").unwrap();
    let mut server = Ticketd::start_raw(&wrapper, &args);
    let before = server.connect().acquire_reply("k", 1, 0, 30).token();
    server.signal(libc::SIGKILL);
    server.wait_exit(Duration::from_secs(5)).expect("killed");
    std::fs::write(&offset_file, "-10d\n").unwrap();
    let server = Ticketd::start_raw(&wrapper, &args);
    assert!(
        server.wait_for_log(&date_in_days(-10), Duration::from_secs(2)),
        "the restarted server's clock is not ten days back:\n{}",
        server.log()
    );
    let after = server.connect().acquire_reply("k", 2, 0, 30).token();
    assert!(
        after > before,
        "token {after} after the restart, {before} before"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

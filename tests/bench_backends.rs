//! `ticket bench` against real servers: an in-process ticketd (the FIFO
//! check must pass on real hand-overs) and a real `redis-server` started on a
//! free loopback port (the RESP backend must lock and release for real).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use ticketd::bench::{self, gen::Mode, BackendKind, Report};
use ticketd::config::Config;
use ticketd::server::Server;
use ticketd::single::SingleService;

fn run(args: &[&str]) -> Report {
    let parsed = bench::parse_args(args.iter().map(|s| (*s).to_string()).collect())
        .unwrap_or_else(|e| panic!("bad test flags {args:?}: {e}"));
    bench::run(&parsed).unwrap_or_else(|e| panic!("bench {args:?} failed: {e}"))
}

/// An in-process ticketd on a free port, shut down on drop.
struct InProcess {
    addr: SocketAddr,
    stop: Option<ticketd::server::ShutdownHandle>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl InProcess {
    fn start() -> InProcess {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let config = Config {
                listen: "127.0.0.1:0".parse().unwrap(),
                ..Config::default()
            };
            let service = SingleService::with_first_token(config.engine.clone(), 1);
            let mut server = Server::bind(config, service).unwrap();
            tx.send((server.local_addr(), server.shutdown_handle()))
                .unwrap();
            server.run().unwrap();
        });
        let (addr, stop) = rx.recv().unwrap();
        InProcess {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            s.shutdown();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn ticketd_hands_contended_keys_over_in_fifo_order() {
    let server = InProcess::start();
    let addr = server.addr.to_string();
    let r = run(&[
        "--server",
        &addr,
        "--mode",
        "contended",
        "--connections",
        "24",
        "--keys",
        "hot:3",
        "--wait",
        "5",
        "--duration",
        "1",
        "--warmup",
        "0",
        "--quiet",
    ]);
    let (checked, bad) = r.fifo.expect("contended ticketd runs are FIFO-checked");
    // 8 waiters per key: most grants are hand-overs on the release path.
    assert!(checked > 100, "too few grants to check: {checked}");
    assert_eq!(bad, 0, "grants out of queue order");
    assert_eq!(r.stats.not_granted + r.stats.busy + r.stats.not_released, 0);
    // Every acquire was followed by a probe, which must have been answered N.
    assert!(r.stats.probes + 24 >= r.stats.grants, "{:?}", r.stats);
    assert!(r.stats.wait_to_grant.count() > 0);
}

#[test]
fn ticketd_cycle_run_releases_every_grant() {
    let server = InProcess::start();
    let addr = server.addr.to_string();
    let r = run(&[
        "--server",
        &addr,
        "--connections",
        "8",
        "--depth",
        "16",
        "--requests",
        "20000",
        "--quiet",
    ]);
    assert_eq!(r.args.cfg.mode, Mode::Cycle);
    assert!(r.stats.replies >= 20000);
    assert_eq!(r.stats.grants, r.stats.released);
    assert_eq!(r.stats.not_granted + r.stats.busy + r.stats.not_released, 0);
}

/// A `redis-server` on a free loopback port, persistence off, killed on drop.
struct Redis {
    child: Child,
    addr: SocketAddr,
}

impl Redis {
    fn start() -> Redis {
        let port = common::free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--dir", &std::env::temp_dir().to_string_lossy()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (apt-get install redis-server)");
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let r = Redis { child, addr };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        r
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn redis_backend_locks_releases_and_polls_for_real() {
    let redis = Redis::start();
    let addr = redis.addr.to_string();
    let r = run(&[
        "--backend",
        "redis",
        "--server",
        &addr,
        "--connections",
        "4",
        "--depth",
        "8",
        "--requests",
        "4000",
        "--quiet",
    ]);
    assert_eq!(r.args.backend, BackendKind::Redis);
    // Fresh keys: every SET NX succeeds and every script release deletes.
    assert!(r.stats.replies >= 4000);
    assert_eq!(r.stats.grants, r.stats.released);
    assert_eq!(r.stats.not_granted + r.stats.not_released, 0);

    // Two keys, eight clients: the losers get nil and poll until they win.
    let c = run(&[
        "--backend",
        "redis",
        "--server",
        &addr,
        "--mode",
        "contended",
        "--connections",
        "8",
        "--keys",
        "hot:2",
        "--poll-ms",
        "1",
        "--duration",
        "1",
        "--warmup",
        "0",
        "--quiet",
    ]);
    assert!(c.stats.grants > 0);
    assert!(
        c.stats.polls > 0,
        "nobody ever found a key held: {:?}",
        c.stats
    );
    assert_eq!(c.stats.not_released, 0);
    assert!(c.fifo.is_none(), "Redis has no queue to check");
}

/// Forwards one connection to `upstream`; after the first reply it closes
/// its sending side, in the same segment as the reply, and goes on taking
/// what the client sends (so the client's next request draws no reset: the
/// close is the only sign, and it came with the reply's readiness event).
fn closing_proxy(upstream: SocketAddr) -> SocketAddr {
    use std::io::{Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let Ok((mut client, _)) = listener.accept() else {
            return;
        };
        let mut server = TcpStream::connect(upstream).unwrap();
        let mut from_client = client.try_clone().unwrap();
        let mut to_server = server.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = from_client.read(&mut buf) {
                if n == 0 || to_server.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        });
        let mut buf = [0u8; 4096];
        // Corked, the reply and the close leave in one segment, so the
        // client sees them in one readiness event.
        let _ = socket2::SockRef::from(&client).set_cork(true);
        if let Ok(n) = server.read(&mut buf) {
            let _ = client.write_all(&buf[..n]);
        }
        // A shutdown, not a drop: the forwarding thread's clone keeps the
        // socket open, and its reading side stays open.
        let _ = client.shutdown(std::net::Shutdown::Write);
    });
    addr
}

#[test]
fn a_server_that_closes_after_a_reply_ends_the_run_with_an_error() {
    let server = InProcess::start();
    let proxy = closing_proxy(server.addr).to_string();
    let started = Instant::now();
    let parsed = bench::parse_args(
        [
            "--server",
            &proxy,
            "--connections",
            "1",
            "--duration",
            "30",
            "--warmup",
            "0",
            "--quiet",
        ]
        .iter()
        .map(|s| (*s).to_string())
        .collect(),
    )
    .unwrap();
    let err = bench::run(&parsed).expect_err("the close must fail the run");
    assert!(err.contains("closed"), "unexpected error: {err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the close was noticed only after {:?}",
        started.elapsed()
    );
}

#[test]
fn extend_mode_keeps_real_ticketd_locks_alive_at_lease_over_three() {
    let server = common::Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let pid = server.pid().to_string();
    // 2 s leases, extended every 0.67 s: over 1.5 s every lock is extended
    // at least once (its first extend is due within 0.67 s) and, paced, at
    // most three times.
    let locks = 120;
    let r = run(&[
        "--server",
        &addr,
        "--server-pid",
        &pid,
        "--mode",
        "extend",
        "--locks",
        &locks.to_string(),
        "--connections",
        "4",
        "--lease",
        "2",
        "--duration",
        "1.5",
        "--warmup",
        "0",
        "--quiet",
    ]);
    assert_eq!(r.args.cfg.mode, Mode::Extend);
    assert_eq!(r.stats.grants, locks, "{:?}", r.stats);
    assert_eq!(r.stats.not_extended, 0, "{:?}", r.stats);
    assert!(r.stats.extended >= locks, "{:?}", r.stats);
    assert!(r.stats.extended <= locks * 4, "not paced: {:?}", r.stats);
    assert_eq!(r.stats.latency.count(), r.stats.extended);
    assert!(r.server_cpu_us_per_extend().is_some());
    let j = r.to_json();
    assert!(j.contains("\"mode\":\"extend\"") && j.contains("\"not_extended\":0"));
    assert!(j.contains("\"server_cpu_core_pct\":"), "{j}");
}

#[test]
fn extend_flood_extends_back_to_back_and_counts_every_x_as_a_failure() {
    let server = common::Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let flood = |addr: &str| {
        [
            "--server",
            addr,
            "--mode",
            "extend-flood",
            "--connections",
            "4",
            "--depth",
            "8",
            "--lease",
            "2",
            "--duration",
            "1",
            "--warmup",
            "0",
            "--quiet",
        ]
        .iter()
        .map(|s| (*s).to_string())
        .collect::<Vec<_>>()
    };
    let r = bench::run(&bench::parse_args(flood(&addr)).unwrap()).unwrap();
    assert_eq!(r.stats.grants, 32, "{:?}", r.stats);
    assert_eq!(r.stats.not_extended, 0, "{:?}", r.stats);
    // Back to back, far more than one extend per lock and second.
    assert!(r.stats.extended > 32 * 10, "{:?}", r.stats);
    assert_eq!(bench::main(flood(&addr)), 0);

    // Bounded by a count (as callgrind runs it): the 32 acquires and then
    // extends until the budget is spent, every one answered.
    let mut bounded = flood(&addr);
    let at = bounded.iter().position(|a| a == "--duration").unwrap();
    bounded.splice(at..at + 4, ["--requests".to_string(), "3000".to_string()]);
    let r = bench::run(&bench::parse_args(bounded).unwrap()).unwrap();
    assert_eq!(r.stats.grants, 32, "{:?}", r.stats);
    assert_eq!(r.stats.replies, 3000, "{:?}", r.stats);
    assert_eq!(r.stats.extended, 3000 - 32, "{:?}", r.stats);
    // Fresh keys of its own, though earlier runs of this process on this
    // server still hold theirs.
    assert_eq!(r.stats.not_granted + r.stats.busy, 0, "{:?}", r.stats);

    // A server that caps a hold at 1 s answers every extend of a 2 s lease
    // with X: the run counts them and fails.
    let capped = common::Ticketd::start(&["--max-hold", "1"]);
    let capped_addr = capped.addr().to_string();
    let r = bench::run(&bench::parse_args(flood(&capped_addr)).unwrap()).unwrap();
    assert!(r.stats.not_extended > 0, "{:?}", r.stats);
    assert_eq!(r.stats.extended, 0, "{:?}", r.stats);
    assert_eq!(bench::main(flood(&capped_addr)), 1);
}

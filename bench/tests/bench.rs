//! The load generator against real servers: an in-process ticketd (the
//! FIFO check must pass on real hand-overs), the real `ticketd` binary, and a
//! real `redis-server` started on a free loopback port (the RESP backend must
//! lock and release for real); and the member's programs (`ticket-bench`,
//! `limit-server`, `cluster-bench` with `cluster-limit-server`) run as real
//! processes.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod procs;

use procs::Ticketd;
use ticketd::config::Config;
use ticketd::server::Server;
use ticketd::single::SingleService;
use ticketd_bench::{self as bench, gen::Mode, BackendKind, Report};

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

#[test]
fn ticketd_cycles_semaphore_and_shared_places_and_releases_every_grant() {
    let server = InProcess::start();
    let addr = server.addr.to_string();
    for places in ["semaphore:8", "shared", "exclusive"] {
        let r = run(&[
            "--server",
            &addr,
            "--connections",
            "8",
            "--depth",
            "16",
            "--requests",
            "5000",
            "--places",
            places,
            "--quiet",
        ]);
        assert!(r.args.places.is_some(), "{places}");
        assert!(r.stats.replies >= 5000, "{places}: {:?}", r.stats);
        assert_eq!(r.stats.grants, r.stats.released, "{places}");
        assert_eq!(
            r.stats.not_granted + r.stats.busy + r.stats.not_released,
            0,
            "{places}: {:?}",
            r.stats
        );
    }
    for bad in ["semaphore:0", "semaphore:x", "many"] {
        let args = ["--server", &addr, "--places", bad]
            .map(String::from)
            .to_vec();
        let e = bench::parse_args(args).unwrap_err();
        assert!(e.contains("--places"), "{e}");
    }
    let args = ["--backend", "redis", "--places", "shared"]
        .map(String::from)
        .to_vec();
    assert!(bench::parse_args(args)
        .unwrap_err()
        .contains("ticketd only"));
}

/// A `redis-server` on a free loopback port, persistence off, killed on drop.
struct Redis {
    child: Child,
    addr: SocketAddr,
}

impl Redis {
    fn start() -> Redis {
        let port = bench::free_loopback_port().expect("a free loopback port");
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
    let server = Ticketd::start(&[]);
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
    let server = Ticketd::start(&[]);
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
    let capped = Ticketd::start(&["--max-hold", "1"]);
    let capped_addr = capped.addr().to_string();
    let r = bench::run(&bench::parse_args(flood(&capped_addr)).unwrap()).unwrap();
    assert!(r.stats.not_extended > 0, "{:?}", r.stats);
    assert_eq!(r.stats.extended, 0, "{:?}", r.stats);
    assert_eq!(bench::main(flood(&capped_addr)), 1);
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `ticket-bench` runs a short cycle load against a real server and reports
/// what it measured, and rejects bad flags with the usage status.
#[test]
fn ticket_bench_measures_a_real_server_and_rejects_bad_flags() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let bin = env!("CARGO_BIN_EXE_ticket-bench");
    let limit = Duration::from_secs(60);
    let o = procs::run(
        bin,
        &[
            "--server",
            &addr,
            "--mode",
            "cycle",
            "--connections",
            "2",
            "--depth",
            "4",
            "--duration",
            "0.5",
            "--warmup",
            "0",
            "--json",
        ],
        &[],
        limit,
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let json = text(&o.stdout);
    assert!(json.contains("\"backend\":\"ticketd\""), "{json}");
    assert!(json.contains("\"mode\":\"cycle\""), "{json}");
    // Grants really happened, and every one was released (cycle mode).
    assert!(procs::number_after(&json, "\"grants\":") > 0, "{json}");
    assert_eq!(procs::number_after(&json, "\"not_released\":"), 0, "{json}");

    // A fixed number of requests: at least that many answered.
    let o = procs::run(
        bin,
        &[
            "--server",
            &addr,
            "--connections",
            "2",
            "--requests",
            "400",
            "--json",
            "--quiet",
        ],
        &[],
        limit,
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(procs::number_after(&text(&o.stdout), "\"requests\":") >= 400);

    let o = procs::run(bin, &["--backend", "zk"], &[], limit);
    assert_eq!(o.status.code(), Some(64));
    assert!(
        text(&o.stderr).contains("unknown backend"),
        "{}",
        text(&o.stderr)
    );
    let o = procs::run(bin, &["--help"], &[], limit);
    assert_eq!(o.status.code(), Some(0));
    assert!(text(&o.stdout).contains("--backend"));
}

/// `limit-server` answers an acquire with a grant for the same owner, and
/// on SIGTERM stops and prints what it served.
#[test]
fn limit_server_answers_every_acquire_and_counts_on_sigterm() {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut child = Command::new(env!("CARGO_BIN_EXE_limit-server"))
        .arg("127.0.0.1:0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start limit-server");
    let mut out = BufReader::new(child.stdout.take().expect("piped stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("first line");
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("limit-server listening on ")
        .unwrap_or_else(|| panic!("no listening line: {line:?}"))
        .parse()
        .expect("an address");

    let mut conn = TcpStream::connect(addr).expect("connect to limit-server");
    let mut frame = Vec::new();
    ticketd::proto::encode_request(
        &ticketd::proto::Request::Acquire {
            wait_s: 0,
            lease_s: 5,
            owner: 7,
            key: "k",
        },
        &mut frame,
    );
    conn.write_all(&frame).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = Vec::new();
    let owner = loop {
        let mut chunk = [0u8; 256];
        let n = conn.read(&mut chunk).expect("a reply");
        assert!(n > 0, "limit-server closed the connection");
        buf.extend_from_slice(&chunk[..n]);
        match ticketd::proto::decode_reply(&buf, 1024) {
            ticketd::proto::Decoded::Incomplete => continue,
            ticketd::proto::Decoded::Frame {
                frame: ticketd::proto::Reply::Acquired { owner, .. },
                ..
            } => break owner,
            other => panic!("unexpected reply {other:?}"),
        }
    };
    assert_eq!(owner, 7);

    let pid = i32::try_from(child.id()).expect("a pid fits in i32");
    // SAFETY: kill(2) on our own child, not yet waited for.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let mut rest = String::new();
    out.read_to_string(&mut rest).expect("the rest of stdout");
    let status = procs::finish(child, Duration::from_secs(30)).status;
    assert!(status.success(), "{status}");
    assert!(
        rest.contains("limit-server: 1 requests on 1 connections"),
        "{rest}"
    );
}

/// `cluster-bench` drives a 3-node cluster, a single-mode server and the
/// cluster limit (`cluster-limit-server`), all real processes.
#[cfg(feature = "cluster")]
#[test]
fn cluster_bench_runs_the_cluster_single_mode_and_the_cluster_limit() {
    let o = procs::run(
        env!("CARGO_BIN_EXE_cluster-bench"),
        &["--clients", "2", "--seconds", "1"],
        &[
            ("CB_BIN", procs::ticketd_bin().display().to_string()),
            (
                "CB_LIMIT",
                env!("CARGO_BIN_EXE_cluster-limit-server").to_string(),
            ),
        ],
        Duration::from_secs(180),
    );
    let out = text(&o.stdout);
    assert!(
        o.status.success(),
        "cluster-bench failed: {}\nstdout:\n{out}\nstderr:\n{}",
        o.status,
        text(&o.stderr)
    );
    let mut from = 0;
    for needle in [
        "ticketd 3-node cluster:",
        "single-mode ticketd:",
        "cluster limit:",
        "ratio: cluster / single-mode ticketd = ",
    ] {
        match out[from..].find(needle) {
            Some(i) => from += i + needle.len(),
            None => panic!("{needle:?} missing (or out of order) in:\n{out}"),
        }
    }
    assert!(
        procs::number_after(&out, "ticketd 3-node cluster:   ") > 0,
        "{out}"
    );
    assert!(
        procs::number_after(&out, "cluster limit:            ") > 0,
        "{out}"
    );
    // The cluster limit's leader and followers report their syncs.
    assert!(out.contains("fdatasync calls"), "{out}");
}

/// `ticket-bench --server unix:/path` drives a real ticketd over its Unix
/// socket (`--listen unix:`, the bench given no TCP address) through the
/// same pipelined cycle as TCP, and a socket that is not there fails the
/// run with a clear error.
#[test]
fn ticket_bench_cycles_over_a_unix_socket() {
    let dir = std::env::temp_dir().join(format!("ticket-bench-unix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("t.sock");
    let listen = format!("unix:{}", sock.display());
    let server = Ticketd::start(&["--listen", &listen]);
    let pid = server.pid().to_string();
    let bin = env!("CARGO_BIN_EXE_ticket-bench");
    let limit = Duration::from_secs(60);
    let o = procs::run(
        bin,
        &[
            "--server",
            &listen,
            "--server-pid",
            &pid,
            "--mode",
            "cycle",
            "--connections",
            "4",
            "--depth",
            "16",
            "--duration",
            "0.5",
            "--warmup",
            "0",
            "--json",
            "--quiet",
        ],
        &[],
        limit,
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let json = text(&o.stdout);
    assert!(json.contains("\"backend\":\"ticketd\""), "{json}");
    // Completed cycles: acquires granted and released, none refused.
    let grants = procs::number_after(&json, "\"grants\":");
    assert!(grants > 0, "{json}");
    assert!(procs::number_after(&json, "\"released\":") > 0, "{json}");
    assert_eq!(procs::number_after(&json, "\"not_released\":"), 0, "{json}");
    assert!(
        procs::number_after(&json, "\"requests\":") >= grants,
        "{json}"
    );
    assert!(json.contains("\"server_cpu_us_per_request\":"), "{json}");

    let missing = format!("unix:{}", dir.join("nothing.sock").display());
    let o = procs::run(
        bin,
        &["--server", &missing, "--duration", "0.5"],
        &[],
        limit,
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("nothing.sock"),
        "{}",
        text(&o.stderr)
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

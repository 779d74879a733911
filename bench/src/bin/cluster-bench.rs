//! Lock cycles per second of a 3-node ticketd cluster (fsync on), and of a
//! single etcd node under the same lock workload, same number of lockers.
//!
//! Both are driven by the same load generator, the one behind `ticket
//! bench` (`ticketd_bench`): one `mio` loop, one connection per locker,
//! each locker locking a fresh key and unlocking it, in a loop, one request
//! at a time. ticketd: `A` then `R`, the lockers spread over the three
//! nodes; etcd: `/v3/lock/lock` with a lease then `/v3/lock/unlock` (the
//! lock API etcd users call, through etcd's JSON gateway). Prints cycles/s,
//! request latency percentiles and the servers' CPU time per request.
//!
//! With `--etcd-native DRIVER`, a fresh etcd is also driven through its own
//! gRPC client (`bench/etcd-native`, a separate project: tokio, tonic and
//! protoc stay out of ticketd): the same lock API, one client, connection
//! and lease per locker, as etcd users lock. Its ratio is the one to quote.
//!
//! Right after its cycles, the plaintext cluster also measures lease
//! renewal: the same lockers each hold one lock and extend it again as
//! soon as each extend is answered (`extend-flood`, depth 1; every extend
//! is a replicated command). Printed as extends/s beside cycles/s, with
//! the servers' CPU per extend; `--no-extend` skips it.
//!
//! The cluster runs twice per round, with peer TLS (mutual TLS 1.3,
//! certificates from `ticketd::cluster::certs`) and plaintext, side by
//! side; `--no-peer-tls` skips the TLS run. A third cluster run keeps
//! `--depth N` (default 4; 1 skips it) requests in flight per locker
//! (`ticket-bench --depth`), to show group commit at work.
//!
//! The summary gives each system's median cycles/s and server CPU per
//! request, and the ratios of both, each taken within its round.
//!
//! The same lockers then run against two ceilings (skip them with
//! `--no-single` and `--no-cluster-limit`):
//!
//! * one single-mode ticketd (no replication, no disk): no cluster can beat
//!   that on the same machine;
//! * the cluster limit (`bench/src/bin/cluster-limit-server.rs`): three
//!   processes that answer ticketd's protocol only once two of them hold
//!   each request on disk, with no consensus and no lock table behind it,
//!   every locker on its fixed leader. It is the most a three-node,
//!   fsync-on service built like ticketd's cluster does here, so its ratio
//!   to etcd bounds what such a cluster can show against etcd on this
//!   machine. It runs a second time with the lockers spread over its three
//!   processes as they are over the cluster's nodes (`--no-spread-limit`
//!   skips it): its followers forward their lockers' requests to the
//!   leader each turn and pass back the answers the leader sends once the
//!   batch is committed, the two messages a ticketd follower's client
//!   costs. Its ratio to the first run is what that layout costs any such
//!   service.
//!
//! Build and run:
//!
//! ```text
//! cargo build --release --bin ticketd --bin cluster-bench \
//!     --bin cluster-limit-server
//! target/release/cluster-bench \
//!     [--clients 50] [--seconds 10] [--rounds 1] [--etcd]
//!     [--etcd-native bench/etcd-native/target/release/etcd-native-bench]
//!     [--no-single] [--no-cluster-limit] [--no-spread-limit] [--no-peer-tls]
//!     [--no-extend] [--depth 4]
//! ```
//!
//! Needs the release `ticketd` binary (target/release/ticketd, or the path
//! in `$CB_BIN`, to compare two builds), `cluster-limit-server` (next to
//! this program, or the path in `$CB_LIMIT`) unless `--no-cluster-limit`
//! and, with `--etcd`, `etcd` on
//! the PATH. Data directories go under the system temporary directory
//! (`$TMPDIR`). Everything runs on loopback; the processes it starts are
//! killed when it ends.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ticketd::proto::{self, Decoded, Reply, Request};
use ticketd_bench as bench;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    bench::free_loopback_port().expect("a free loopback port")
}

fn temp_dir(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("ticketd-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

/// One run's figures: lock cycles per second and, when the servers' pids
/// were known, their CPU time per request (all processes summed).
#[derive(Clone, Copy)]
struct Run {
    rate: f64,
    cpu_us: Option<f64>,
}

/// One run of the load generator: `backend` at `servers`, `clients`
/// lockers with `depth` requests in flight each, `seconds` measured after
/// a one-second warm-up. Prints one line.
fn drive(
    name: &str,
    backend: &str,
    servers: &[SocketAddr],
    pids: &[u32],
    clients: usize,
    depth: usize,
    seconds: u64,
) -> Run {
    let list = |v: Vec<String>| v.join(",");
    let mut args = vec![
        "--backend".to_string(),
        backend.to_string(),
        "--server".to_string(),
        list(servers.iter().map(ToString::to_string).collect()),
        "--connections".to_string(),
        clients.to_string(),
        "--mode".to_string(),
        "cycle".to_string(),
        "--lease".to_string(),
        "30".to_string(),
        "--duration".to_string(),
        seconds.to_string(),
        "--quiet".to_string(),
    ];
    if depth > 1 {
        args.push("--depth".to_string());
        args.push(depth.to_string());
    }
    if !pids.is_empty() {
        args.push("--server-pid".to_string());
        args.push(list(pids.iter().map(ToString::to_string).collect()));
    }
    let report = bench::parse_args(args)
        .and_then(|a| bench::run(&a))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let s = &report.stats;
    let rate = report.grants_per_s();
    let cpu_us = report.server_cpu_us_per_request();
    let cpu = cpu_us.map_or(String::new(), |us| {
        format!(", server CPU {us:.1} us/request")
    });
    println!(
        "{name}: {clients} lockers{}, {} lock cycles in {:.1} s = {rate:.0} cycles/s; \
         request latency p50 {:.0} us, p99 {:.0} us{cpu}",
        if depth > 1 {
            format!(" x {depth} in flight")
        } else {
            String::new()
        },
        s.grants,
        report.elapsed_s,
        s.latency.quantile(0.5) as f64 / 1000.0,
        s.latency.quantile(0.99) as f64 / 1000.0,
    );
    if s.busy + s.not_granted + s.not_released > 0 {
        println!(
            "  ({} busy, {} not granted, {} releases that found no lock)",
            s.busy, s.not_granted, s.not_released
        );
    }
    Run { rate, cpu_us }
}

/// Lease renewal on the same servers: `clients` lockers, each holding one
/// lock and extending it again as soon as each extend is answered
/// (`extend-flood`, depth 1), `seconds` measured after a one-second
/// warm-up (which covers the acquires). Prints one line and returns
/// (extends per second, server CPU us per extend).
fn drive_extend(
    name: &str,
    servers: &[SocketAddr],
    pids: &[u32],
    clients: usize,
    seconds: u64,
) -> (f64, Option<f64>) {
    let list = |v: Vec<String>| v.join(",");
    let mut args = vec![
        "--server".to_string(),
        list(servers.iter().map(ToString::to_string).collect()),
        "--connections".to_string(),
        clients.to_string(),
        "--mode".to_string(),
        "extend-flood".to_string(),
        "--lease".to_string(),
        "30".to_string(),
        "--duration".to_string(),
        seconds.to_string(),
        "--quiet".to_string(),
    ];
    if !pids.is_empty() {
        args.push("--server-pid".to_string());
        args.push(list(pids.iter().map(ToString::to_string).collect()));
    }
    let report = bench::parse_args(args)
        .and_then(|a| bench::run(&a))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let s = &report.stats;
    let rate = report.extends_per_s();
    let us = report.server_cpu_us_per_extend();
    let cpu = us.map_or(String::new(), |us| {
        format!(", server CPU {us:.1} us/extend")
    });
    println!(
        "{name}: {clients} lockers, {} extends in {:.1} s = {rate:.0} extends/s; \
         latency p50 {:.0} us, p99 {:.0} us{cpu}",
        s.extended,
        report.elapsed_s,
        s.latency.quantile(0.5) as f64 / 1000.0,
        s.latency.quantile(0.99) as f64 / 1000.0,
    );
    if s.not_extended > 0 {
        println!("  ({} extends answered X)", s.not_extended);
    }
    (rate, us)
}

// ---- ticketd ------------------------------------------------------------

struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
}

/// Whether `e` says the server closed the connection.
fn closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
    )
}

impl Conn {
    /// Sends `req` and returns its reply's kind and token, or `None` if the
    /// server closed the connection.
    fn call(&mut self, req: Request<'_>) -> Option<(u8, u64)> {
        let mut out = Vec::new();
        proto::encode_request(&req, &mut out);
        match self.s.write_all(&out) {
            Ok(()) => {}
            Err(e) if closed(&e) => return None,
            Err(e) => panic!("send: {e}"),
        }
        loop {
            if let Decoded::Frame { frame, used } = proto::decode_reply(&self.buf, 65536) {
                let r = match frame {
                    Reply::Acquired { token, .. } => (b'A', token),
                    Reply::Timeout { .. } => (b'T', 0),
                    Reply::Busy { .. } => (b'B', 0),
                    Reply::Released { token, .. } => (b'R', token),
                    Reply::NotReleased { token, .. } => (b'N', token),
                    Reply::Extended { token, .. } => (b'E', token),
                    Reply::NotExtended { token, .. } => (b'X', token),
                    Reply::LimitMismatch { limit, .. } => (b'L', u64::from(limit)),
                };
                self.buf.drain(..used);
                return Some(r);
            }
            let mut chunk = [0u8; 4096];
            let n = match self.s.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => n,
                Err(e) if closed(&e) => return None,
                Err(e) => panic!("recv: {e}"),
            };
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// Starts `ticketd` with `args` and returns it with the client address it
/// reports on stderr.
fn start_ticketd(bin: &Path, args: &[String]) -> (Proc, SocketAddr) {
    let child = Command::new(bin)
        .args(args)
        .args(["--listen", "127.0.0.1:0", "--log-level", "info"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ticketd (build it with cargo build --release)");
    let mut child = Proc(child);
    let mut r = BufReader::new(child.0.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "ticketd exited");
        if let Some(rest) = line.split("listening on ").nth(1) {
            let addr = rest.split_whitespace().next().unwrap().parse().unwrap();
            std::thread::spawn(move || {
                let mut sink = String::new();
                while r.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
                    if sink.contains("leader is") {
                        eprint!("{sink}");
                    }
                    sink.clear();
                }
            });
            return (child, addr);
        }
    }
}

/// Waits until a lock can be taken through `addr` (a cluster has elected
/// a leader and applied its first entry). A node closes a connection whose
/// request it cannot answer (a proposal lost to an election that is still
/// settling); the wait then reconnects and asks again.
fn wait_ready(addr: SocketAddr) {
    let t0 = Instant::now();
    let limit = Duration::from_secs(20);
    loop {
        let s = loop {
            match TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(t0.elapsed() < limit, "{addr}: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        s.set_read_timeout(Some(limit)).expect("set a read timeout");
        let mut c = Conn { s, buf: Vec::new() };
        while let Some((k, t)) = c.call(Request::Acquire {
            wait_s: 0,
            lease_s: 1,
            owner: 1,
            key: "warmup",
        }) {
            if k == b'A' {
                // Its outcome does not matter: the lease ends in 1 s.
                let _ = c.call(Request::Release {
                    token: t,
                    key: "warmup",
                });
                return;
            }
            assert!(t0.elapsed() < limit, "{addr}: no leader after {limit:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            t0.elapsed() < limit,
            "{addr}: the node kept closing connections for {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The CA and three node certificates in `dir`, as `ticket certs init`
/// makes them.
#[cfg(feature = "cluster")]
fn make_certs(dir: &Path) {
    ticketd::cluster::certs::init(&ticketd::cluster::certs::InitOptions {
        dir: dir.to_path_buf(),
        cluster_name: "ticketd".into(),
        nodes: 3,
    })
    .expect("make peer certificates");
}

#[cfg(not(feature = "cluster"))]
fn make_certs(_dir: &Path) {
    panic!("peer TLS needs ticketd built with the `cluster` feature (pass --no-peer-tls)");
}

/// A 3-node cluster with fsync on; clients spread over the nodes, each
/// with `depth` acquires or releases in flight. With `tls`, its peers
/// speak mutual TLS with certificates made there. When `extend`, the
/// extends per second and server CPU us per extend of the same lockers on
/// the same cluster right after.
// Long because it is one run, step by step: start, drive, tear down.
fn bench_cluster(
    bin: &Path,
    clients: usize,
    depth: usize,
    seconds: u64,
    tls: bool,
    extend: bool,
) -> (Run, Option<(f64, Option<f64>)>) {
    let peers: Vec<String> = (1..=3)
        .map(|i| format!("{i}=127.0.0.1:{}", free_port()))
        .collect();
    let peers = peers.join(",");
    let dirs: Vec<PathBuf> = (1..=3).map(|i| temp_dir(&format!("node{i}"))).collect();
    let certs = temp_dir("certs");
    if tls {
        make_certs(&certs);
    }
    let nodes: Vec<(Proc, SocketAddr)> = (0..3)
        .map(|i| {
            let mut args = vec![
                "--cluster".to_string(),
                "--id".to_string(),
                (i + 1).to_string(),
                "--peers".to_string(),
                peers.clone(),
                "--data-dir".to_string(),
                dirs[i].display().to_string(),
            ];
            if tls {
                let f = |n: String| certs.join(n).display().to_string();
                args.extend([
                    "--peer-tls-cert".to_string(),
                    f(format!("node{}.pem", i + 1)),
                    "--peer-tls-key".to_string(),
                    f(format!("node{}-key.pem", i + 1)),
                    "--peer-tls-ca".to_string(),
                    f("ca.pem".to_string()),
                ]);
            }
            start_ticketd(bin, &args)
        })
        .collect();
    wait_ready(nodes[0].1);
    let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.1).collect();
    let pids: Vec<u32> = nodes.iter().map(|n| n.0 .0.id()).collect();
    let rate = drive(
        if tls {
            "ticketd 3-node cluster (fsync on, peer TLS)"
        } else {
            "ticketd 3-node cluster (fsync on)"
        },
        "ticketd",
        &addrs,
        &pids,
        clients,
        depth,
        seconds,
    );
    let extends = extend.then(|| {
        drive_extend(
            "ticketd 3-node cluster (fsync on), extends",
            &addrs,
            &pids,
            clients,
            seconds,
        )
    });
    drop(nodes);
    for d in dirs {
        let _ = std::fs::remove_dir_all(d);
    }
    let _ = std::fs::remove_dir_all(certs);
    (rate, extends)
}

/// One single-mode ticketd (no replication, no disk) under the same
/// clients: the most any cluster could reach with them on this machine.
fn bench_single(bin: &Path, clients: usize, seconds: u64) -> Run {
    let node = start_ticketd(bin, &[]);
    wait_ready(node.1);
    drive(
        "ticketd single mode (ceiling: no replication, no disk)",
        "ticketd",
        &[node.1],
        &[node.0 .0.id()],
        clients,
        1,
        seconds,
    )
}

/// The cluster limit: two followers and a leader of
/// `cluster-limit-server` (the binary at `limit`), every locker on the
/// leader, or with `spread` the lockers spread over the three processes as
/// over the cluster's nodes (the followers forward their lockers' requests
/// to the leader and pass its answers back). Afterwards the leader is
/// stopped with SIGTERM (the followers end with its connection) and each
/// node's `fdatasync` count and mean time are printed.
// Long because it is one run, step by step: start, drive, tear down.
fn bench_cluster_limit(limit: &Path, clients: usize, seconds: u64, spread: bool) -> Run {
    let dir = temp_dir("cluster-limit");
    if let Err(e) = std::fs::create_dir_all(&dir) {
        panic!("create {}: {e}", dir.display());
    }
    let spawn = |args: &[String]| {
        Proc(
            Command::new(limit)
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap_or_else(|e| panic!("run {}: {e}", limit.display())),
        )
    };
    let log = |name: &str| dir.join(name).display().to_string();
    let f: Vec<String> = (0..2)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let served: Vec<SocketAddr> = (0..2)
        .map(|_| format!("127.0.0.1:{}", free_port()).parse().unwrap())
        .collect();
    let mut followers: Vec<Proc> = (0..2)
        .map(|i| {
            let mut args = vec!["follower".into(), f[i].clone(), log(&format!("f{i}.log"))];
            if spread {
                args.push(served[i].to_string());
            }
            spawn(&args)
        })
        .collect();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut leader = spawn(&[
        "leader".into(),
        addr.to_string(),
        log("leader.log"),
        f.join(","),
    ]);
    wait_ready(addr);
    let mut addrs = vec![addr];
    if spread {
        addrs.extend(&served);
        for a in &served {
            wait_ready(*a);
        }
    }
    let pids = [leader.0.id(), followers[0].0.id(), followers[1].0.id()];
    let rate = drive(
        if spread {
            "cluster limit, lockers spread (3 processes, fsync on, no consensus, no lock table)"
        } else {
            "cluster limit (3 processes, fsync on, no consensus, no lock table)"
        },
        "ticketd",
        &addrs,
        &pids,
        clients,
        1,
        seconds,
    );
    let pid = i32::try_from(leader.0.id()).expect("a pid fits in i32");
    // SAFETY: kill(2) on a child's pid, which it cannot outlive unwaited.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    for p in std::iter::once(&mut leader).chain(followers.iter_mut()) {
        let mut out = String::new();
        if let Some(mut o) = p.0.stdout.take() {
            let _ = o.read_to_string(&mut out);
        }
        let _ = p.0.wait();
        if let Some(line) = out.lines().find(|l| l.contains("fdatasync")) {
            println!("  {line}");
        }
    }
    drop(leader);
    drop(followers);
    let _ = std::fs::remove_dir_all(dir);
    rate
}

// ---- etcd ---------------------------------------------------------------

/// A fresh single etcd node on free loopback ports, fsync on (its
/// default), and its data directory.
fn start_etcd() -> (Proc, SocketAddr, PathBuf) {
    let dir = temp_dir("etcd");
    let cport = free_port();
    let pport = free_port();
    let curl = format!("http://127.0.0.1:{cport}");
    let purl = format!("http://127.0.0.1:{pport}");
    let etcd = Proc(
        Command::new("etcd")
            .args([
                "--data-dir",
                &dir.display().to_string(),
                "--listen-client-urls",
                &curl,
                "--advertise-client-urls",
                &curl,
                "--listen-peer-urls",
                &purl,
                "--initial-advertise-peer-urls",
                &purl,
                "--initial-cluster",
                &format!("default={purl}"),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn etcd"),
    );
    let addr: SocketAddr = format!("127.0.0.1:{cport}").parse().unwrap();
    let t0 = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(20), "etcd did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    (etcd, addr, dir)
}

/// etcd's lock API through its JSON gateway, driven by the shared load
/// generator.
fn bench_etcd(clients: usize, seconds: u64) -> Run {
    let (etcd, addr, dir) = start_etcd();
    let pids = [etcd.0.id()];
    let rate = drive(
        "etcd single node (lock API, JSON gateway)",
        "etcd",
        &[addr],
        &pids,
        clients,
        1,
        seconds,
    );
    drop(etcd);
    let _ = std::fs::remove_dir_all(dir);
    rate
}

/// A number field of the one-line JSON object `json`.
fn json_number(json: &str, field: &str) -> Option<f64> {
    let at = json.find(&format!("\"{field}\":"))? + field.len() + 3;
    let rest = &json[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim().parse().ok()
}

/// etcd's lock API through etcd's own gRPC client (`bench/etcd-native`,
/// the binary at `driver`): one client, one connection and one lease per
/// locker, as etcd users lock.
fn bench_etcd_native(driver: &Path, clients: usize, seconds: u64) -> Run {
    let (etcd, addr, dir) = start_etcd();
    let out = Command::new(driver)
        .args(["--server", &addr.to_string()])
        .args(["--lockers", &clients.to_string()])
        .args(["--seconds", &seconds.to_string(), "--warmup", "1"])
        .args(["--server-pid", &etcd.0.id().to_string()])
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", driver.display()));
    drop(etcd);
    let _ = std::fs::remove_dir_all(dir);
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{} failed ({}): {json}",
        driver.display(),
        out.status
    );
    let field = |f: &str| {
        json_number(&json, f).unwrap_or_else(|| panic!("no {f} in the driver's output: {json}"))
    };
    let rate = field("cycles_per_s");
    let cpu_us = json_number(&json, "server_cpu_us_per_request");
    let cpu = cpu_us.map_or(String::new(), |us| {
        format!(", server CPU {us:.1} us/request")
    });
    println!(
        "etcd single node (lock API, native gRPC client): {clients} lockers, {:.0} lock \
         cycles in {seconds} s = {rate:.0} cycles/s; request latency p50 {:.0} us, \
         p99 {:.0} us{cpu}",
        field("cycles"),
        field("p50_us"),
        field("p99_us"),
    );
    Run { rate, cpu_us }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The load generator's limit on connections.
const MAX_CLIENTS: usize = 10_000;

const USAGE: &str = "usage: cluster-bench [--clients N] [--seconds N] [--rounds N] [--etcd] \
                     [--etcd-native DRIVER] [--no-single] [--no-cluster-limit] [--no-spread-limit] \
                     [--no-peer-tls] [--no-extend] [--depth N]";

/// A positive number flag, or exit 2 with a clear message.
fn number(args: &mut pico_args::Arguments, flag: &'static str, default: u64) -> u64 {
    match args.opt_value_from_str::<_, u64>(flag) {
        Ok(Some(0)) => {
            eprintln!("cluster-bench: {flag} must be at least 1\n{USAGE}");
            std::process::exit(2);
        }
        Ok(v) => v.unwrap_or(default),
        Err(e) => {
            eprintln!("cluster-bench: {e}\n{USAGE}");
            std::process::exit(2);
        }
    }
}

fn main() {
    let mut args = pico_args::Arguments::from_env();
    let clients = number(&mut args, "--clients", 50) as usize;
    if clients > MAX_CLIENTS {
        eprintln!("cluster-bench: --clients must be at most {MAX_CLIENTS}\n{USAGE}");
        std::process::exit(2);
    }
    let seconds = number(&mut args, "--seconds", 10);
    let rounds = number(&mut args, "--rounds", 1) as usize;
    // The extra cluster row with several requests in flight per locker
    // (group commit at work); 1 leaves it out.
    let depth = number(&mut args, "--depth", 4) as usize;
    if depth > 256 {
        eprintln!("cluster-bench: --depth must be at most 256\n{USAGE}");
        std::process::exit(2);
    }
    let etcd = args.contains("--etcd");
    let native: Option<PathBuf> = match args.opt_value_from_str("--etcd-native") {
        Ok(v) => v,
        Err(e) => {
            eprintln!("cluster-bench: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Some(d) = &native {
        if !d.is_file() {
            eprintln!(
                "cluster-bench: --etcd-native {}: no such file (build it with \
                 cargo build --release --manifest-path bench/etcd-native/Cargo.toml)",
                d.display()
            );
            std::process::exit(2);
        }
    }
    let single = !args.contains("--no-single");
    let no_limit = args.contains("--no-cluster-limit");
    let spread_limit = !args.contains("--no-spread-limit");
    let peer_tls = !args.contains("--no-peer-tls");
    let extend = !args.contains("--no-extend");
    let rest = args.finish();
    if !rest.is_empty() {
        eprintln!("cluster-bench: unexpected {rest:?}\n{USAGE}");
        std::process::exit(2);
    }
    // The cluster limit's server: `$CB_LIMIT`, or the one built next to
    // this program.
    let limit = if no_limit {
        None
    } else {
        let p = std::env::var_os("CB_LIMIT").map(PathBuf::from).or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(|d| d.join("cluster-limit-server")))
        });
        match p {
            Some(p) if p.is_file() => Some(p),
            p => {
                eprintln!(
                    "cluster-bench: no cluster limit server at {} (cargo build --release \
                     --bin cluster-limit-server, or set CB_LIMIT, or pass \
                     --no-cluster-limit)",
                    p.map_or("?".into(), |p| p.display().to_string())
                );
                std::process::exit(2);
            }
        }
    };
    let bin = PathBuf::from(std::env::var("CB_BIN").unwrap_or("target/release/ticketd".into()));
    // Rounds interleave the systems, so that a machine whose load drifts
    // weighs on each of them alike; each ratio is taken within its round.
    let mut rows: Vec<Row> = Vec::new();
    let mut row = |name: &str| -> usize {
        rows.push(Row {
            name: name.to_string(),
            runs: Vec::new(),
        });
        rows.len() - 1
    };
    let r_cluster = row("ticketd 3-node cluster:");
    let r_tls = peer_tls.then(|| row("  same, peer TLS:"));
    let r_deep = (depth > 1).then(|| row(&format!("  same, {depth} in flight each:")));
    let r_single = single.then(|| row("single-mode ticketd:"));
    let r_limit = limit.is_some().then(|| row("cluster limit:"));
    let r_spread = (limit.is_some() && spread_limit).then(|| row("  same, lockers spread:"));
    let r_etcd = etcd.then(|| row("etcd, JSON gateway:"));
    let r_native = native.is_some().then(|| row("etcd, native gRPC client:"));
    let (mut extends, mut extend_vs_cycle, mut extend_us) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        if rounds > 1 {
            println!("-- round {round} of {rounds}");
        }
        let (o, x) = bench_cluster(&bin, clients, 1, seconds, false, extend);
        if let Some((rate, us)) = x {
            extends.push(rate);
            extend_vs_cycle.push(rate / o.rate);
            if let Some(us) = us {
                extend_us.push(us);
            }
        }
        rows[r_cluster].runs.push(o);
        if let Some(r) = r_tls {
            rows[r]
                .runs
                .push(bench_cluster(&bin, clients, 1, seconds, true, false).0);
        }
        if let Some(r) = r_deep {
            rows[r]
                .runs
                .push(bench_cluster(&bin, clients, depth, seconds, false, false).0);
        }
        if let Some(r) = r_single {
            rows[r].runs.push(bench_single(&bin, clients, seconds));
        }
        if let (Some(r), Some(p)) = (r_limit, &limit) {
            rows[r]
                .runs
                .push(bench_cluster_limit(p, clients, seconds, false));
        }
        if let (Some(r), Some(p)) = (r_spread, &limit) {
            rows[r]
                .runs
                .push(bench_cluster_limit(p, clients, seconds, true));
        }
        if let Some(r) = r_etcd {
            rows[r].runs.push(bench_etcd(clients, seconds));
        }
        if let (Some(r), Some(d)) = (r_native, &native) {
            rows[r].runs.push(bench_etcd_native(d, clients, seconds));
        }
    }
    let what = if rounds > 1 {
        format!("median of {rounds} rounds")
    } else {
        "one round".to_string()
    };
    println!("-- {what}, {clients} clients, {seconds} s per run");
    for r in &rows {
        let rate = median(r.runs.iter().map(|x| x.rate).collect());
        let cpu: Vec<f64> = r.runs.iter().filter_map(|x| x.cpu_us).collect();
        let cpu = if cpu.is_empty() {
            String::new()
        } else {
            format!(", server CPU {:.1} us/request", median(cpu))
        };
        println!("{:<26}{rate:.0} cycles/s{cpu}", r.name);
    }
    if extend {
        println!(
            "  same lockers, extends:   {:.0} extends/s ({:.2}x cycles/s), server CPU {} us/extend",
            median(extends),
            median(extend_vs_cycle),
            if extend_us.is_empty() {
                "?".to_string()
            } else {
                format!("{:.1}", median(extend_us))
            }
        );
    }
    // Each ratio within its round, then the median over the rounds.
    let ratio = |a: usize, b: usize, f: fn(&Run) -> Option<f64>| {
        median(
            rows[a]
                .runs
                .iter()
                .zip(&rows[b].runs)
                .filter_map(|(x, y)| Some(f(x)? / f(y)?))
                .collect(),
        )
    };
    let rate = |x: &Run| Some(x.rate);
    let cpu = |x: &Run| x.cpu_us;
    if let Some(t) = r_tls {
        println!(
            "ratio: cluster with peer TLS / plaintext = {:.2}x",
            ratio(t, r_cluster, rate)
        );
    }
    if let Some(d) = r_deep {
        println!(
            "ratio: cluster at depth {depth} / depth 1 = {:.2}x",
            ratio(d, r_cluster, rate)
        );
    }
    if let Some(c) = r_single {
        println!(
            "ratio: cluster / single-mode ticketd = {:.2}x",
            ratio(r_cluster, c, rate)
        );
    }
    if let Some(l) = r_limit {
        println!(
            "ratio: cluster / cluster limit = {:.2}x",
            ratio(r_cluster, l, rate)
        );
        println!(
            "ratio: cluster CPU per request / cluster limit's = {:.2}x",
            ratio(r_cluster, l, cpu)
        );
    }
    if let (Some(l), Some(sp)) = (r_limit, r_spread) {
        println!(
            "ratio: cluster limit, lockers spread / every locker on its leader = {:.2}x",
            ratio(sp, l, rate)
        );
        println!(
            "ratio: cluster / cluster limit with lockers spread = {:.2}x",
            ratio(r_cluster, sp, rate)
        );
        println!(
            "ratio: cluster CPU per request / cluster limit's with lockers spread = {:.2}x",
            ratio(r_cluster, sp, cpu)
        );
    }
    if let Some(n) = r_native {
        println!(
            "ratio: cluster / etcd (native gRPC client) = {:.1}x",
            ratio(r_cluster, n, rate)
        );
        if let Some(l) = r_limit {
            println!(
                "ratio: cluster limit / etcd (native gRPC client) = {:.1}x",
                ratio(l, n, rate)
            );
        }
    }
    if let Some(e) = r_etcd {
        println!(
            "ratio: cluster / etcd (JSON gateway) = {:.1}x",
            ratio(r_cluster, e, rate)
        );
        if let Some(l) = r_limit {
            println!(
                "ratio: cluster limit / etcd (JSON gateway) = {:.1}x",
                ratio(l, e, rate)
            );
        }
        if let Some(c) = r_single {
            println!(
                "ratio: single-mode ticketd / etcd = {:.1}x",
                ratio(c, e, rate)
            );
        }
    }
}

/// One system's runs, one per round.
struct Row {
    name: String,
    runs: Vec<Run>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A node that closes the first connection after reading its acquire
    /// (a proposal lost to an election) and grants on the second:
    /// `wait_ready` reconnects instead of failing the run.
    #[test]
    fn wait_ready_reconnects_when_a_node_closes_the_connection() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("local address");
        let node = std::thread::spawn(move || {
            let read_one = |s: &mut TcpStream| {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 256];
                loop {
                    if let Decoded::Frame { frame, used } = proto::decode_request(&buf, 64) {
                        let r = match frame {
                            Request::Acquire { .. } => b'A',
                            Request::Release { .. } => b'R',
                            _ => b'?',
                        };
                        buf.drain(..used);
                        return r;
                    }
                    let n = s.read(&mut chunk).expect("read");
                    assert!(n > 0, "the client closed first");
                    buf.extend_from_slice(&chunk[..n]);
                }
            };
            let (mut first, _) = l.accept().expect("accept 1");
            assert_eq!(read_one(&mut first), b'A');
            drop(first);
            let (mut second, _) = l.accept().expect("accept 2");
            assert_eq!(read_one(&mut second), b'A');
            let mut out = Vec::new();
            proto::encode_reply(
                &Reply::Acquired {
                    token: 7,
                    owner: 1,
                    key: "warmup",
                },
                &mut out,
            );
            second.write_all(&out).expect("grant");
            assert_eq!(read_one(&mut second), b'R');
            out.clear();
            proto::encode_reply(
                &Reply::Released {
                    token: 7,
                    key: "warmup",
                },
                &mut out,
            );
            second.write_all(&out).expect("release");
        });
        wait_ready(addr);
        node.join().expect("the node's side saw two connections");
    }
}

//! The runs `cluster-bench` measures: one drive of the shared load
//! generator ([`drive`], [`drive_extend`]), and each system set up, driven
//! and torn down (the cluster, single mode, the cluster limit, etcd through
//! its JSON gateway and through its own gRPC client).

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::procs::{free_port, make_certs, start_etcd, start_ticketd, temp_dir, wait_ready, Proc};
use ticketd_bench as bench;

/// One run's figures: lock cycles per second and, when the servers' pids
/// were known, their CPU time per request (all processes summed).
#[derive(Clone, Copy)]
pub(crate) struct Run {
    /// Lock cycles per second.
    pub(crate) rate: f64,
    /// Server CPU microseconds per request, all processes summed.
    pub(crate) cpu_us: Option<f64>,
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

/// A 3-node cluster with fsync on; clients spread over the nodes, each
/// with `depth` acquires or releases in flight. With `tls`, its peers
/// speak mutual TLS with certificates made there. When `extend`, the
/// extends per second and server CPU us per extend of the same lockers on
/// the same cluster right after.
// Long because it is one run, step by step: start, drive, tear down.
pub(crate) fn bench_cluster(
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
pub(crate) fn bench_single(bin: &Path, clients: usize, seconds: u64) -> Run {
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
pub(crate) fn bench_cluster_limit(limit: &Path, clients: usize, seconds: u64, spread: bool) -> Run {
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

/// etcd's lock API through its JSON gateway, driven by the shared load
/// generator.
pub(crate) fn bench_etcd(clients: usize, seconds: u64) -> Run {
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
pub(crate) fn bench_etcd_native(driver: &Path, clients: usize, seconds: u64) -> Run {
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

//! Lock cycles against etcd through its native gRPC API, the way etcd users
//! lock: one client (one connection) and one lease per locker, then
//! `Lock(name, lease)` and `Unlock(key)` on etcd's lock service, over and
//! over, each locker on its own name (no contention: every cycle measures
//! the two replicated writes, as ticketd's uncontended cycle does).
//!
//! Prints one JSON object: cycles/s, requests/s, request latency
//! percentiles, the lock keys left behind (counted before the leases are
//! revoked, which would delete them: anything but 0 is an unlock that did
//! not happen) and, with `--server-pid`, etcd's CPU time per request over
//! the measured window.
//!
//!     etcd-native-bench [--server 127.0.0.1:2379] [--lockers 50]
//!                       [--seconds 10] [--warmup 1] [--server-pid PID]
//!     etcd-native-bench [--server 127.0.0.1:2379] --count-keys
//!
//! `--count-keys` prints how many keys etcd holds (a check that every lock
//! was given back) and exits.

use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, LockOptions};

/// The parsed command line.
struct Args {
    server: String,
    lockers: usize,
    seconds: u64,
    warmup: u64,
    server_pid: Option<u32>,
    count_keys: bool,
}

const USAGE: &str = "usage: etcd-native-bench [--server HOST:PORT] [--lockers N] \
                     [--seconds S] [--warmup S] [--server-pid PID] | [--count-keys]";

/// Reads the command line; the error is what to print (the usage for
/// `--help`).
fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        server: "127.0.0.1:2379".into(),
        lockers: 50,
        seconds: 10,
        warmup: 1,
        server_pid: None,
        count_keys: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |v: String, flag: &str| -> Result<u64, String> {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: {v:?} is not a whole number"))
        };
        match flag.as_str() {
            "--server" => a.server = value()?,
            "--lockers" => a.lockers = number(value()?, "--lockers")? as usize,
            "--seconds" => a.seconds = number(value()?, "--seconds")?,
            "--warmup" => a.warmup = number(value()?, "--warmup")?,
            "--server-pid" => a.server_pid = Some(number(value()?, "--server-pid")? as u32),
            "--count-keys" => a.count_keys = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if a.lockers == 0 || a.lockers > 10_000 {
        return Err("--lockers must be 1..=10000".into());
    }
    if a.seconds == 0 || a.seconds > 3_600 {
        return Err("--seconds must be 1..=3600".into());
    }
    Ok(a)
}

/// utime + stime of `pid`, in seconds.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which ends at the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// What lockers measured: cycles, request latencies, and a locker's lease.
struct Tally {
    cycles: u64,
    latencies_us: Vec<u32>,
    lease: i64,
}

/// One locker: its own client, lease and lock name; locks and unlocks
/// until `end`, counting the cycles wholly within the measured window.
async fn locker(
    server: String,
    id: usize,
    measure_from: Instant,
    end: Instant,
) -> Result<Tally, String> {
    let mut client = Client::connect([server.as_str()], None)
        .await
        .map_err(|e| format!("locker {id}: connect: {e}"))?;
    let lease = client
        .lease_grant(600, None)
        .await
        .map_err(|e| format!("locker {id}: lease grant: {e}"))?
        .id();
    let name = format!("bench/{id:06}");
    let mut tally = Tally {
        cycles: 0,
        latencies_us: Vec::new(),
        lease,
    };
    while Instant::now() < end {
        let t0 = Instant::now();
        let held = client
            .lock(name.as_str(), Some(LockOptions::new().with_lease(lease)))
            .await
            .map_err(|e| format!("locker {id}: lock: {e}"))?;
        let t1 = Instant::now();
        client
            .unlock(held.key())
            .await
            .map_err(|e| format!("locker {id}: unlock: {e}"))?;
        let t2 = Instant::now();
        if t0 >= measure_from && t2 <= end {
            tally.cycles += 1;
            tally.latencies_us.push((t1 - t0).as_micros() as u32);
            tally.latencies_us.push((t2 - t1).as_micros() as u32);
        }
    }
    Ok(tally)
}

/// The `p` quantile of `sorted` (0 when empty).
fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if args.count_keys {
        count_keys(&rt, &args.server);
        return;
    }
    let (mut total, cpu, keys_left) = match rt.block_on(run(&args)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("etcd-native-bench: {e}");
            std::process::exit(1);
        }
    };
    if total.cycles == 0 {
        eprintln!("etcd-native-bench: no lock cycle completed");
        std::process::exit(1);
    }
    total.latencies_us.sort_unstable();
    print_report(&args, &total, cpu, keys_left);
}

/// `--count-keys`: prints how many keys etcd holds, or exits 1.
fn count_keys(rt: &tokio::runtime::Runtime, server: &str) {
    let counted = rt.block_on(async {
        let mut client = Client::connect([server], None).await?;
        let opts = GetOptions::new().with_all_keys().with_count_only();
        Ok::<_, etcd_client::Error>(client.get("", Some(opts)).await?.count())
    });
    match counted {
        Ok(n) => println!("{n}"),
        Err(e) => {
            eprintln!("etcd-native-bench: counting keys: {e}");
            std::process::exit(1);
        }
    }
}

/// The run: every locker for the warm-up and the measured window, etcd's
/// CPU time read at both ends of the window; returns the lockers' tally
/// (summed), that CPU time, and the lock keys left behind (counted before
/// the leases are revoked).
async fn run(args: &Args) -> Result<(Tally, Option<f64>, i64), String> {
    let start = Instant::now();
    let measure_from = start + Duration::from_secs(args.warmup) + Duration::from_millis(500);
    let end = measure_from + Duration::from_secs(args.seconds);
    let tasks: Vec<_> = (0..args.lockers)
        .map(|id| tokio::spawn(locker(args.server.clone(), id, measure_from, end)))
        .collect();
    // etcd's CPU time at both ends of the measured window.
    let pid = args.server_pid;
    let cpu_at = |at: Instant| {
        tokio::spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            pid.and_then(cpu_seconds)
        })
    };
    let (cpu0, cpu1) = (cpu_at(measure_from), cpu_at(end));
    let mut total = Tally {
        cycles: 0,
        latencies_us: Vec::new(),
        lease: 0,
    };
    let mut leases = Vec::new();
    for t in tasks {
        let t = t.await.map_err(|e| format!("a locker failed: {e}"))??;
        total.cycles += t.cycles;
        total.latencies_us.extend(t.latencies_us);
        leases.push(t.lease);
    }
    let joined = |r: Result<Option<f64>, _>| r.ok().flatten();
    let cpu = joined(cpu0.await)
        .zip(joined(cpu1.await))
        .map(|(a, b)| b - a);
    let left = keys_left_then_revoke(&args.server, leases).await?;
    Ok((total, cpu, left))
}

/// The lock keys still in etcd, counted before `leases` are revoked
/// (which would delete them).
async fn keys_left_then_revoke(server: &str, leases: Vec<i64>) -> Result<i64, String> {
    let mut client = Client::connect([server], None)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let opts = GetOptions::new().with_prefix().with_count_only();
    let left = client
        .get("bench/", Some(opts))
        .await
        .map_err(|e| format!("counting lock keys: {e}"))?
        .count();
    for lease in leases {
        let _ = client.lease_revoke(lease).await;
    }
    Ok(left)
}

/// The one JSON object of a run; `total.latencies_us` sorted.
fn print_report(args: &Args, total: &Tally, cpu: Option<f64>, keys_left: i64) {
    let secs = args.seconds as f64;
    let requests = 2 * total.cycles;
    let cpu_us = cpu.map_or("null".to_string(), |c| {
        format!("{:.1}", c * 1e6 / requests as f64)
    });
    println!(
        "{{\"lockers\":{},\"seconds\":{},\"cycles\":{},\"cycles_per_s\":{:.1},\
         \"requests_per_s\":{:.1},\"p50_us\":{},\"p99_us\":{},\"p999_us\":{},\
         \"keys_left\":{},\"server_cpu_us_per_request\":{}}}",
        args.lockers,
        args.seconds,
        total.cycles,
        total.cycles as f64 / secs,
        requests as f64 / secs,
        percentile(&total.latencies_us, 0.5),
        percentile(&total.latencies_us, 0.99),
        percentile(&total.latencies_us, 0.999),
        keys_left,
        cpu_us
    );
}

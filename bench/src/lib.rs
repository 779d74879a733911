//! `ticket-bench`: a load generator for ticketd and, for comparison, Redis.
//!
//! Like `redis-benchmark`: many connections, a pipeline depth, a key space and
//! a workload, for a fixed time or a fixed number of requests. It prints
//! requests/s, grants/s and latency percentiles; for the contended workload
//! also the time from asking to being granted, and a FIFO check of ticketd's
//! hand-over order. The same code drives every service: only the
//! [`backend::Backend`] differs. `docs/BENCHMARKS.md` describes the method.
//!
//! The generator is synchronous: one `mio` loop per thread (one thread by
//! default), so it can drive hundreds of pipelined connections from one core
//! and leave the other core to the server under test.

mod args;
pub mod backend;
pub mod cluster_limit;
mod conn;
pub mod etcd;
pub mod gen;
pub mod hist;
pub mod limit;
mod report;
pub mod resp;
mod runner;
pub mod tls;

use std::sync::atomic::Ordering;

pub use args::{parse_args, Args, BackendKind};
pub use report::Report;
pub use runner::{process_cpu_s, run};

/// A loopback port that is free now, for a server a benchmark or a test is
/// about to start, taken below the kernel's ephemeral range (32768 and up
/// on Linux): a port the kernel hands out could be given to an outgoing
/// connection between this pick and the server's bind (which then fails
/// with "Address already in use"); these never are. A counter keeps one
/// process's picks apart, and the process id spreads concurrent processes.
pub fn free_loopback_port() -> std::io::Result<u16> {
    use std::sync::atomic::AtomicU32;
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let offset = (std::process::id() % 600) * 20;
    for _ in 0..SPAN {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = u16::try_from(FIRST + (offset + n) % SPAN).unwrap_or(u16::MAX);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free loopback port in {FIRST}..{}", FIRST + SPAN),
    ))
}

/// Bytes offered to one `read` of the generator and of the limit server.
pub(crate) const READ_CHUNK_BYTES: usize = 16 * 1024;

/// The most a load generator's read buffer holds: far beyond any reply
/// of any backend, so only a broken server reaches it.
pub(crate) const READ_BUFFER_CAP_BYTES: usize = 64 << 20;

/// Asks for writable events on `stream` only while it has unsent bytes
/// (`want`); `registered` remembers what is asked now, so an unchanged
/// interest costs no system call.
pub(crate) fn set_write_interest(
    registry: &mio::Registry,
    stream: &mut (impl mio::event::Source + ?Sized),
    token: mio::Token,
    registered: &mut bool,
    want: bool,
) -> std::io::Result<()> {
    if want == *registered {
        return Ok(());
    }
    *registered = want;
    let interest = if want {
        mio::Interest::READABLE | mio::Interest::WRITABLE
    } else {
        mio::Interest::READABLE
    };
    registry.reregister(stream, token, interest)
}

/// Entry point of `ticket-bench ARGS` (without the program name). Returns
/// the process exit code: 0 on success, 1 if the run failed, the FIFO check
/// found a grant out of order or an extend was answered `X`, 64 for bad
/// flags (the usage status of `ticket`).
#[must_use]
pub fn main(args: Vec<String>) -> i32 {
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            print!("{}", args::USAGE);
            return 0;
        }
        Err(e) => {
            eprintln!("ticket-bench: {e}");
            eprintln!("try 'ticket-bench --help'");
            return 64;
        }
    };
    match run(&args) {
        Ok(r) => {
            if args.json {
                println!("{}", r.to_json());
            } else {
                print!("{}", r.to_text());
            }
            match r.fifo {
                Some((_, bad)) if bad > 0 => 1,
                _ if r.stats.not_extended > 0 => 1,
                _ => 0,
            }
        }
        Err(e) => {
            eprintln!("ticket-bench: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gen::{Keys, Renew};
    use std::net::SocketAddr;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn args(list: &[&str]) -> Result<Args, String> {
        parse_args(list.iter().map(|s| (*s).to_string()).collect())
    }

    /// A limit server on a free loopback port, serving until `stop`.
    fn limit_server(
        stop: &Arc<AtomicBool>,
    ) -> (
        String,
        std::thread::JoinHandle<std::io::Result<limit::LimitStats>>,
    ) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = Arc::clone(stop);
        (
            addr,
            std::thread::spawn(move || limit::serve(listener, &stop)),
        )
    }

    #[test]
    fn bad_flags_are_named_and_exit_64() {
        for (bad, needle) in [
            (&["--depth", "0"][..], "--depth"),
            (&["--depth", "x"][..], "not a number"),
            (&["--mode", "fast"][..], "unknown mode"),
            (&["--backend", "zk"][..], "unknown backend"),
            (&["--keys", "hot:0"][..], "--keys"),
            (
                &["--mode", "contended", "--keys", "uncontended"][..],
                "hot:N",
            ),
            (&["--mode", "contended", "--wait", "0"][..], "--wait"),
            (&["--lease", "0"][..], "--lease"),
            (
                &["--mode", "extend", "--backend", "redis"][..],
                "ticketd only",
            ),
            (
                &["--mode", "extend-flood", "--backend", "etcd"][..],
                "ticketd only",
            ),
            (&["--mode", "extend", "--depth", "4"][..], "extend-flood"),
            (
                &["--mode", "extend", "--keys", "hot:3"][..],
                "uncontended only",
            ),
            (&["--mode", "extend", "--requests", "9"][..], "--duration"),
            (&["--mode", "extend", "--locks", "0"][..], "--locks"),
            (&["--locks", "10"][..], "only for --mode extend"),
            (&["--renew", "single"][..], "only for --mode extend"),
            (&["--mode", "extend", "--renew", "each"][..], "--renew"),
            (
                &[
                    "--mode",
                    "extend",
                    "--locks",
                    "1000000",
                    "--connections",
                    "2",
                ][..],
                "per connection",
            ),
            (&["--backend", "etcd", "--depth", "2"][..], "depth is 1"),
            (&["--frobnicate"][..], "unexpected argument"),
        ] {
            let e = args(bad).unwrap_err();
            assert!(e.contains(needle), "{bad:?} gave {e:?}");
        }
        assert_eq!(main(vec!["--depth".into(), "999".into()]), 64);
    }

    #[test]
    fn defaults_follow_the_mode() {
        let a = args(&["--mode", "contended"]).unwrap();
        assert_eq!(a.cfg.keys, Keys::Hot(10));
        assert_eq!(a.cfg.wait_s, 5);
        assert_eq!(a.cfg.connections, 50);
        let b = args(&["--backend", "redis", "--requests", "5"]).unwrap();
        assert_eq!(b.cfg.addrs.len(), 1);
        assert_eq!(b.cfg.addrs[0].port(), 6379);
        assert!(b.warmup.is_zero());
    }

    #[test]
    fn extend_spreads_its_locks_over_the_connections() {
        let a = args(&["--mode", "extend", "--locks", "10", "--connections", "4"]).unwrap();
        let slots: Vec<usize> = (0..4).map(|i| gen::slots_of(&a.cfg, i)).collect();
        assert_eq!(slots, [3, 3, 2, 2]);
        // Fewer locks than connections: one lock per connection.
        let b = args(&["--mode", "extend", "--locks", "3"]).unwrap();
        assert_eq!(b.cfg.connections, 3);
        assert_eq!(gen::slots_of(&b.cfg, 2), 1);
        let f = args(&["--mode", "extend-flood", "--depth", "16"]).unwrap();
        assert_eq!(gen::slots_of(&f.cfg, 0), 16);
        // Renewals are coalesced as the client's unless asked otherwise.
        assert_eq!(a.cfg.renew, Renew::Coalesced);
        let s = args(&["--mode", "extend", "--renew", "single"]).unwrap();
        assert_eq!(s.cfg.renew, Renew::Single);
    }

    #[test]
    fn a_unix_server_is_a_path_for_ticketd_and_redis_without_tls() {
        let a = args(&["--server", "unix:/run/t.sock"]).unwrap();
        assert_eq!(
            a.cfg.unix.as_deref(),
            Some(std::path::Path::new("/run/t.sock"))
        );
        assert!(a.cfg.addrs.is_empty());
        let r = args(&["--backend", "redis", "--server", "unix:/run/r.sock"]).unwrap();
        assert!(r.cfg.unix.is_some());
        assert!(args(&["--server", "127.0.0.1:1"])
            .unwrap()
            .cfg
            .unix
            .is_none());
        for bad in [
            vec!["--server", "unix:"],
            vec!["--backend", "etcd", "--server", "unix:/run/e.sock"],
        ] {
            assert!(args(&bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_cluster_is_several_servers_and_several_pids() {
        let a = args(&[
            "--server",
            "127.0.0.1:1,127.0.0.1:2, 127.0.0.1:3",
            "--server-pid",
            "10,11,12",
        ])
        .unwrap();
        let ports: Vec<u16> = a.cfg.addrs.iter().map(SocketAddr::port).collect();
        assert_eq!(ports, [1, 2, 3]);
        assert_eq!(a.server_pids, [10, 11, 12]);
        for bad in [
            vec!["--server", "127.0.0.1:1,"],
            vec!["--server", "127.0.0.1:1,nowhere"],
            vec!["--backend", "etcd", "--server", "127.0.0.1:1,127.0.0.1:2"],
            vec!["--server-pid", "10,,12"],
            vec!["--server-pid", "0"],
        ] {
            assert!(args(&bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn connections_are_spread_over_a_clusters_nodes() {
        // Three limit servers stand in for three nodes: each must get some
        // of the connections' requests.
        let stop = Arc::new(AtomicBool::new(false));
        let servers: Vec<_> = (0..3).map(|_| limit_server(&stop)).collect();
        let list: Vec<&str> = servers.iter().map(|(a, _)| a.as_str()).collect();
        let a = args(&[
            "--server",
            &list.join(","),
            "--connections",
            "6",
            "--requests",
            "600",
            "--quiet",
        ])
        .unwrap();
        let r = run(&a).unwrap();
        stop.store(true, Ordering::Relaxed);
        let served: Vec<u64> = servers
            .into_iter()
            .map(|(_, h)| h.join().unwrap().unwrap().requests)
            .collect();
        assert_eq!(served.iter().sum::<u64>(), r.stats.replies);
        assert!(served.iter().all(|&n| n > 0), "{served:?}");
    }

    #[test]
    fn cpu_time_of_this_process_is_readable() {
        let cpu = process_cpu_s(std::process::id());
        assert!(cpu.is_some_and(|c| c >= 0.0));
    }

    #[test]
    fn a_count_bounded_cycle_run_against_the_limit_server_answers_every_request() {
        let stop = Arc::new(AtomicBool::new(false));
        let (addr, server) = limit_server(&stop);
        let a = args(&[
            "--server",
            &addr,
            "--connections",
            "4",
            "--depth",
            "8",
            "--requests",
            "2000",
            "--quiet",
            "--threads",
            "2",
        ])
        .unwrap();
        let r = run(&a).unwrap();
        stop.store(true, Ordering::Relaxed);
        let served = server.join().unwrap().unwrap();
        // Acquires stop at the budget; every grant is then released, so the
        // run ends with as many releases as grants and nothing in flight.
        assert!(
            (2000..=2000 + 32).contains(&r.stats.replies),
            "{:?}",
            r.stats
        );
        assert_eq!(r.stats.grants, r.stats.released);
        assert_eq!(r.stats.replies, r.stats.grants * 2);
        assert_eq!(served.requests, r.stats.replies);
        assert_eq!(r.stats.latency.count(), r.stats.replies);
        let j = r.to_json();
        assert!(j.contains("\"mode\":\"cycle\"") && j.contains("\"requests\":"));
    }
}

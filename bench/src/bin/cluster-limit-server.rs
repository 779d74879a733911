//! The cluster limit: ticketd's protocol answered only once two of three
//! nodes hold each request on disk, with nothing else behind it (no
//! consensus, no lock table). It shows the most a three-node, fsync-on
//! service can do on a machine; `make bench-cluster` compares ticketd's
//! cluster with it. Start the followers, then the leader:
//!
//!     cluster-limit-server follower 127.0.0.1:7582 /tmp/f1.log
//!     cluster-limit-server follower 127.0.0.1:7583 /tmp/f2.log
//!     cluster-limit-server leader 127.0.0.1:7480 /tmp/l.log 127.0.0.1:7582,127.0.0.1:7583
//!
//! Clients talk to the leader; a follower given a third address serves
//! clients there too, forwarding their requests to the leader:
//!
//!     cluster-limit-server follower 127.0.0.1:7582 /tmp/f1.log 127.0.0.1:7481
//! Each node writes 64 MiB of zeros to its log
//! file before it serves, and writes round within them (a benchmark keeps
//! no history). The leader stops cleanly on SIGINT or SIGTERM, a follower
//! also when the leader's connection ends; each prints what it did and
//! the mean time of its `fdatasync` calls.
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use ticketd_bench::cluster_limit;

const USAGE: &str = "usage: cluster-limit-server follower LISTEN LOG [CLIENTS]\n       \
                     cluster-limit-server leader LISTEN LOG FOLLOWER,FOLLOWER";

fn fail(code: i32, msg: &str) -> ! {
    eprintln!("cluster-limit-server: {msg}");
    std::process::exit(code);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (role, listen, log) = match args.as_slice() {
        [role, listen, log, ..] => (role.as_str(), listen, Path::new(log)),
        _ => fail(2, USAGE),
    };
    let mut clients = None;
    let followers: Vec<SocketAddr> = match (role, args.get(3)) {
        ("follower", None) => Vec::new(),
        ("follower", Some(addr)) if args.len() == 4 => {
            clients = Some(
                TcpListener::bind(addr)
                    .unwrap_or_else(|e| fail(2, &format!("cannot listen on {addr}: {e}"))),
            );
            Vec::new()
        }
        ("leader", Some(list)) if args.len() == 4 => list
            .split(',')
            .map(|a| {
                a.parse()
                    .unwrap_or_else(|_| fail(2, &format!("{a:?}: not a socket address")))
            })
            .collect(),
        _ => fail(2, USAGE),
    };
    if role == "leader" && followers.len() != 2 {
        fail(2, "the leader takes exactly two followers");
    }
    let listener = TcpListener::bind(listen)
        .unwrap_or_else(|e| fail(2, &format!("cannot listen on {listen}: {e}")));
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        if let Err(e) = signal_hook::flag::register(sig, Arc::clone(&stop)) {
            fail(1, &format!("cannot handle signal {sig}: {e}"));
        }
    }
    let result = if role == "leader" {
        cluster_limit::serve_leader(listener, &followers, log, cluster_limit::LOG_BYTES, &stop)
    } else {
        cluster_limit::serve_follower(listener, clients, log, cluster_limit::LOG_BYTES, &stop)
    };
    match result {
        Ok(s) => {
            let requests = if role == "leader" {
                format!("{} requests, ", s.requests)
            } else {
                String::new()
            };
            println!(
                "cluster-limit-server {role}: {requests}{} batches, {} fdatasync calls \
                 ({:.3} ms on average)",
                s.batches,
                s.syncs,
                s.sync_time.as_secs_f64() * 1e3 / s.syncs.max(1) as f64
            );
        }
        Err(e) => fail(1, &e.to_string()),
    }
}

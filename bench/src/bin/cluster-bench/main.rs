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

mod args;
mod drivers;
mod procs;
mod report;

use args::Options;
use drivers::{bench_cluster, bench_cluster_limit, bench_etcd, bench_etcd_native, bench_single};
use report::Table;

fn main() {
    let o = Options::from_env();
    // Rounds interleave the systems, so that a machine whose load drifts
    // weighs on each of them alike; each ratio is taken within its round.
    let mut table = Table::new(&o);
    for round in 1..=o.rounds {
        if o.rounds > 1 {
            println!("-- round {round} of {}", o.rounds);
        }
        run_round(&o, &mut table);
    }
    table.print_medians(&o);
    // Each ratio within its round, then the median over the rounds.
    table.print_ticketd_ratios(o.depth);
    table.print_etcd_ratios();
}

/// One round: every system `o` asks for, once each, in the table's order.
fn run_round(o: &Options, t: &mut Table) {
    let (bin, clients, seconds) = (&o.bin, o.clients, o.seconds);
    let (cycles, extends) = bench_cluster(bin, clients, 1, seconds, false, o.extend);
    if let Some((rate, us)) = extends {
        t.extends.push(rate);
        t.extend_vs_cycle.push(rate / cycles.rate);
        if let Some(us) = us {
            t.extend_us.push(us);
        }
    }
    t.rows[t.cluster].runs.push(cycles);
    if let Some(r) = t.tls {
        let run = bench_cluster(bin, clients, 1, seconds, true, false).0;
        t.rows[r].runs.push(run);
    }
    if let Some(r) = t.deep {
        let run = bench_cluster(bin, clients, o.depth, seconds, false, false).0;
        t.rows[r].runs.push(run);
    }
    if let Some(r) = t.single {
        t.rows[r].runs.push(bench_single(bin, clients, seconds));
    }
    if let (Some(r), Some(p)) = (t.limit, &o.limit) {
        t.rows[r]
            .runs
            .push(bench_cluster_limit(p, clients, seconds, false));
    }
    if let (Some(r), Some(p)) = (t.spread, &o.limit) {
        t.rows[r]
            .runs
            .push(bench_cluster_limit(p, clients, seconds, true));
    }
    if let Some(r) = t.etcd {
        t.rows[r].runs.push(bench_etcd(clients, seconds));
    }
    if let (Some(r), Some(d)) = (t.native, &o.native) {
        t.rows[r].runs.push(bench_etcd_native(d, clients, seconds));
    }
}

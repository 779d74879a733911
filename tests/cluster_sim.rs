//! Deterministic simulations of 3- and 5-node clusters (see
//! `src/cluster/sim.rs` for what is simulated and checked).
//!
//! `cargo test` runs a few fixed seeds. For long runs:
//! `make sim SEEDS=200` (or `SIM_SEEDS=200 SIM_FIRST=1000 cargo test
//! --release --test cluster_sim many_seeds -- --nocapture`); a failure
//! prints its seed, and `SIM_FIRST=<seed> SIM_SEEDS=1` replays it.
#![cfg(feature = "cluster")]

use ticketd::cluster::sim::{run, SimConfig};

fn check(cfg: SimConfig) -> ticketd::cluster::sim::SimReport {
    let seed = cfg.seed;
    let nodes = cfg.nodes;
    // A panic inside raft (e.g. a log it finds inconsistent) must name the
    // seed too.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(cfg))) {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => panic!("simulation failed (seed {seed}, {nodes} nodes): {e}"),
        Err(_) => panic!("simulation panicked (seed {seed}, {nodes} nodes); see above"),
    }
}

#[test]
fn three_nodes_fixed_seeds() {
    for seed in [1, 2, 3] {
        let r = check(SimConfig::new(seed, 3));
        // The run did real work through the faults.
        assert!(r.grants > 20, "seed {seed}: {r:?}");
        assert!(r.releases > 5, "seed {seed}: {r:?}");
        assert!(r.crashes > 0, "seed {seed}: {r:?}");
    }
}

#[test]
fn five_nodes_fixed_seeds() {
    for seed in [11, 12] {
        let r = check(SimConfig::new(seed, 5));
        assert!(r.grants > 20, "seed {seed}: {r:?}");
    }
}

#[test]
fn a_seed_replays_exactly() {
    let a = check(SimConfig::new(42, 3));
    let b = check(SimConfig::new(42, 3));
    assert_eq!(a, b);
}

#[test]
fn expiry_and_snapshots_happen_under_faults() {
    // Across a few seeds, leases run out by committed Expire entries and
    // lagging or restarted nodes catch up by snapshot.
    let mut timers = 0;
    let mut installs = 0;
    for seed in [5, 6] {
        let mut cfg = SimConfig::new(seed, 3);
        cfg.snapshot_every = 16;
        let r = check(cfg);
        timers += r.timer_proposals;
        installs += r.snapshot_installs;
    }
    assert!(timers > 0, "no Expire/WaitTimeout was proposed");
    assert!(installs > 0, "no snapshot was installed");
}

#[test]
fn many_seeds() {
    let n: u64 = std::env::var("SIM_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let first: u64 = std::env::var("SIM_FIRST")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    for seed in first..first + n {
        let nodes = if seed % 2 == 0 { 3 } else { 5 };
        let r = check(SimConfig::new(seed, nodes));
        if n > 2 {
            println!("seed {seed} ({nodes} nodes): {r:?}");
        }
    }
}

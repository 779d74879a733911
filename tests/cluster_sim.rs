//! Deterministic simulations of 3- and 5-node clusters (see
//! `src/cluster/sim.rs` for what is simulated and checked).
//!
//! `cargo test` runs a few fixed seeds. For long runs:
//! `make sim SEEDS=200` (or `SIM_SEEDS=200 SIM_FIRST=1000 cargo test
//! --release --test cluster_sim many_seeds -- --nocapture`); a failure
//! prints its seed, and `SIM_FIRST=<seed> SIM_SEEDS=1` replays it.
#![cfg(feature = "cluster")]

use ticketd::checker::{Event, History, Outcome, Property};
use ticketd::cluster::sim::{run, run_with_history, SimConfig};

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

fn check_with_history(cfg: SimConfig) -> (ticketd::cluster::sim::SimReport, History) {
    let seed = cfg.seed;
    run_with_history(cfg).unwrap_or_else(|e| panic!("simulation failed (seed {seed}): {e}"))
}

#[test]
fn three_nodes_fixed_seeds() {
    for seed in [1, 2, 3] {
        let r = check(SimConfig::new(seed, 3));
        // The run did real work through the faults.
        assert!(r.grants > 20, "seed {seed}: {r:?}");
        assert!(r.releases > 5, "seed {seed}: {r:?}");
        assert!(r.crashes > 0, "seed {seed}: {r:?}");
        // The history checker ran on what the clients saw and passed.
        assert_eq!(
            r.checked.grants as u64 + r.checked.late_grants as u64,
            r.grants
        );
        assert!(r.checked.indeterminate > 0, "seed {seed}: {r:?}");
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

/// A granted acquire of a history: key, client, token, received, end of its
/// interval (the earlier of its release and its invocation plus the lease).
struct Grant {
    op: u64,
    key: String,
    token: u64,
    received_us: u64,
    end_us: u64,
}

fn grants(h: &History) -> Vec<Grant> {
    let mut acq = std::collections::HashMap::new();
    let mut rel = std::collections::HashMap::new();
    for e in h.events() {
        match e {
            Event::Acquire {
                op,
                key,
                lease_s,
                at_us,
                ..
            } => {
                acq.insert(*op, (key.clone(), *at_us + u64::from(*lease_s) * 1_000_000));
            }
            Event::Release {
                key, token, at_us, ..
            } => {
                let t = rel.entry((key.clone(), *token)).or_insert(*at_us);
                *t = (*t).min(*at_us);
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for e in h.events() {
        if let Event::Acquired {
            op,
            outcome: Outcome::Granted { token },
            at_us,
        } = e
        {
            let (key, lease_end) = acq[op].clone();
            let end_us = rel
                .get(&(key.clone(), *token))
                .map_or(lease_end, |&r: &u64| r.min(lease_end));
            out.push(Grant {
                op: *op,
                key,
                token: *token,
                received_us: *at_us,
                end_us,
            });
        }
    }
    out
}

/// A copy of `h` with `f` applied to every event.
fn rewrite(h: &History, f: impl Fn(&Event) -> Event) -> History {
    let mut out = History::new();
    for e in h.events() {
        out.push(f(e));
    }
    out
}

#[test]
fn the_checker_fails_on_a_corrupted_cluster_history() {
    let (_, h) = check_with_history(SimConfig::new(1, 3));
    assert!(h.check().is_ok());
    let gs = grants(&h);
    assert!(gs.len() > 20);

    // 1. A grant on another key that overlaps a grant in time, moved onto
    //    the first grant's key: tokens stay unique and in order, so only
    //    mutual exclusion can catch it.
    let (a, b) = gs
        .iter()
        .flat_map(|a| gs.iter().map(move |b| (a, b)))
        .find(|(a, b)| {
            a.key != b.key
                && b.received_us >= a.received_us
                && b.received_us < a.end_us
                && b.received_us < b.end_us
        })
        .expect("two overlapping grants on different keys");
    let moved = rewrite(&h, |e| match e {
        Event::Acquire { op, .. } if *op == b.op => {
            let mut e = e.clone();
            if let Event::Acquire { key, .. } = &mut e {
                key.clone_from(&a.key);
            }
            e
        }
        e => e.clone(),
    });
    let v = moved.check().expect_err("an overlap must fail the check");
    assert_eq!(v.property, Property::MutualExclusion, "{v}");

    // 2. The same grant (same token, same time) also handed to a second
    //    client on its own session.
    let mut dup = rewrite(&h, Clone::clone);
    let (invoked_us, lease_s) = h
        .events()
        .iter()
        .find_map(|e| match e {
            Event::Acquire {
                op, at_us, lease_s, ..
            } if *op == a.op => Some((*at_us, *lease_s)),
            _ => None,
        })
        .expect("the acquire of the grant");
    let op = dup.acquire(9_999, 9_999_999, &a.key, 77, 0, lease_s, invoked_us);
    dup.acquired(op, Outcome::Granted { token: a.token }, a.received_us);
    let v = dup
        .check()
        .expect_err("a duplicated grant must fail the check");
    assert_eq!(v.property, Property::TokenOrder, "{v}");
    assert!(v.message.contains("granted twice"), "{v}");
}

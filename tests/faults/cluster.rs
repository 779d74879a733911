//! Network partitions between real `ticketd --cluster` processes.
//!
//! Three nodes, each its own process on its own loopback address, in a
//! private network namespace; links are cut one way or both ways with
//! nftables (see `tests/netns/mod.rs` for how). Two official clients per
//! node acquire and release three shared keys (wait 1 s, lease 2 s) through
//! every fault, each recording a history on one clock; the history checker
//! runs on every test. The tests:
//!
//! * the leader cut off from both followers both ways: the majority elects
//!   a new leader and serves, the old leader grants nothing, tokens keep
//!   increasing, and after the heal the old leader's clients are served;
//! * one-way partitions: first the leader's messages to both followers are
//!   dropped (it still hears them), then the followers' messages to the
//!   leader (it is still heard); the cluster stays safe and recovers;
//! * a follower cut off: the majority keeps serving, the follower grants
//!   nothing, and it catches up after the heal;
//! * a seeded random schedule of faults (isolations, one-way cuts, random
//!   sets of cut links), each lasting 1.5 s: safe throughout, and every
//!   node grants again after the final heal.
//!
//! Each test prints its figures (grants during the partition, time to a new
//! leader, time to recover) with `--nocapture`. They need root and nftables
//! (installed by `.ci/run`); `TICKETD_SKIP_NETFAULTS=1` skips them.
#![cfg(feature = "cluster")]

use ticketd_testkit::netns;

use std::time::Duration;

use netns::{
    acquire_recorded, check_history, client_for, enter_private_netns, grants_by_node, ms, outcomes,
    release_recorded, skip_requested, Attempt, Cluster, Firewall, Load, LEASE, WAIT,
};
use ticketd::client::Acquire;
use ticketd_testkit::checker::{History, RealClock};
use ticketd_testkit::rng::SplitMix64;

/// Nodes in every test.
const N: usize = 3;
/// Official clients per node.
const PER_NODE: usize = 2;
/// Load before the first fault.
const BEFORE_FAULT: Duration = Duration::from_millis(1500);
/// How long each partition lasts.
const PARTITION: Duration = Duration::from_secs(5);
/// Faults in the random schedule, and how long each lasts.
const STEPS: u64 = 6;
const STEP: Duration = Duration::from_millis(1500);
/// Longest wait for a new leader or for a node to grant again.
const RECOVERY: Duration = Duration::from_secs(20);

/// A cluster in a namespace of its own, a firewall, and the load.
struct Setup {
    name: &'static str,
    cluster: Cluster,
    fw: Firewall,
    clock: RealClock,
    load: Option<Load>,
    /// What the test thread itself did.
    main: History,
}

impl Setup {
    /// None when the tests are skipped on purpose.
    fn start(name: &'static str) -> Option<Setup> {
        if skip_requested(name) {
            return None;
        }
        enter_private_netns();
        let cluster = Cluster::start(name, N);
        let fw = Firewall::new();
        let _ = cluster.warm_up(RECOVERY);
        let clock = RealClock::new();
        let load = Some(Load::start(clock, N, PER_NODE));
        std::thread::sleep(BEFORE_FAULT);
        Some(Setup {
            name,
            cluster,
            fw,
            clock,
            load,
            main: History::new(),
        })
    }

    fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    fn load(&self) -> &Load {
        self.load.as_ref().expect("load running")
    }

    fn leader(&self) -> (usize, u64) {
        self.cluster
            .leader()
            .unwrap_or_else(|| panic!("no leader known:\n{}", self.cluster.logs()))
    }

    /// Sleeps until `PARTITION` after `cut_us`.
    fn hold_partition(&self, cut_us: u64) {
        let end_us = cut_us + u64::try_from(PARTITION.as_micros()).unwrap();
        let now = self.now_us();
        if end_us > now {
            std::thread::sleep(Duration::from_micros(end_us - now));
        }
    }

    /// Waits until a client of `node` gets a grant for an acquire invoked
    /// at or after `from_us`; returns how long that took, in ms.
    fn wait_node_grants(&self, node: usize, from_us: u64, what: &str) -> u64 {
        match self.load().wait_grant(node, from_us, RECOVERY) {
            Some(at_us) => ms(from_us, at_us),
            None => panic!(
                "{}: node {node} granted nothing within {RECOVERY:?} {what}\n{}",
                self.name,
                self.cluster.logs()
            ),
        }
    }

    /// Stops the load, runs the checker, returns every attempt.
    fn finish(&mut self) -> Vec<Attempt> {
        let mut rec = self
            .load
            .take()
            .expect("load running")
            .finish()
            .unwrap_or_else(|e| panic!("{}: {e}\n{}", self.name, self.cluster.logs()));
        rec.history.merge(std::mem::take(&mut self.main));
        check_history(self.name, &rec.history, &self.cluster);
        rec.attempts
    }
}

/// Panics if a client of `node` was granted an acquire it invoked in
/// `[from_us, to_us)` and received before `to_us`.
fn assert_no_grant(s: &Setup, attempts: &[Attempt], node: usize, from_us: u64, to_us: u64) {
    let bad: Vec<&Attempt> = attempts
        .iter()
        .filter(|a| {
            a.node == node && a.token.is_some() && a.invoked_us >= from_us && a.done_us < to_us
        })
        .collect();
    assert!(
        bad.is_empty(),
        "{}: node {node} granted while cut off (from {from_us}us to {to_us}us): {bad:?}\n{}",
        s.name,
        s.cluster.logs()
    );
}

/// Panics unless every grant for an acquire invoked at or after `after_us`
/// carries a token above every token received before `before_us`.
fn assert_tokens_rise(s: &Setup, attempts: &[Attempt], before_us: u64, after_us: u64) {
    let old = attempts
        .iter()
        .filter(|a| a.done_us < before_us)
        .filter_map(|a| a.token)
        .max();
    let new = attempts
        .iter()
        .filter(|a| a.invoked_us >= after_us)
        .filter_map(|a| a.token)
        .min();
    if let (Some(old), Some(new)) = (old, new) {
        assert!(
            new > old,
            "{}: token {new} granted after the change is not above {old} granted before",
            s.name
        );
    }
    assert!(
        old.is_some() && new.is_some(),
        "{}: no grants to compare",
        s.name
    );
}

#[test]
fn isolated_leader_grants_nothing_and_the_majority_elects_a_new_one() {
    // Never beside a single-mode fault test measuring its timings.
    let _timed = crate::shared();
    let Some(mut s) = Setup::start("isolate") else {
        return;
    };
    let (old, old_term) = s.leader();
    // A grant by the leader about to be cut off, never released: only the
    // new leader's committed Expire can end it, and not before its lease.
    let orphan_from_us = s.now_us();
    let (r, _) = acquire_recorded(
        &mut s.main,
        s.clock,
        1000,
        &client_for(old),
        "orphan",
        WAIT,
        LEASE,
    );
    let Acquire::Acquired(orphan) = r else {
        panic!("the leader did not grant: {r:?}\n{}", s.cluster.logs());
    };
    let (_, orphan_token) = orphan.detach();
    s.fw.isolate(old, N);
    let cut_us = s.now_us();
    let Some((new, _)) = s.cluster.wait_leader_above(old_term, RECOVERY) else {
        panic!("no new leader after isolating {old}:\n{}", s.cluster.logs());
    };
    let elected_us = s.now_us();
    assert_ne!(new, old, "the isolated node became leader again");
    let majority: Vec<usize> = (1..=N).filter(|&i| i != old).collect();
    let first_majority_grant_ms = majority
        .iter()
        .map(|&i| s.wait_node_grants(i, cut_us, "after the leader was cut off"))
        .min()
        .unwrap();
    let taken_us = the_new_leader_ends_the_orphan(&mut s, new, orphan_token, orphan_from_us);
    s.hold_partition(cut_us);
    s.fw.heal();
    let heal_us = s.now_us();
    let old_back_ms = s.wait_node_grants(old, heal_us, "after the heal");
    let attempts = s.finish();

    let during = grants_by_node(&attempts, cut_us, heal_us);
    let isolated_any = attempts
        .iter()
        .filter(|a| a.node == old && a.token.is_some() && a.done_us > cut_us && a.done_us < heal_us)
        .count();
    println!(
        "isolate: leader {old} cut off for {} ms; node {new} leader after {} ms, first \
         majority grant after {first_majority_grant_ms} ms; grants during the partition by \
         node: {during:?}; grants received by node {old}'s clients while cut off: \
         {isolated_any}, their acquires invoked then: {}; node {old} granting again \
         {old_back_ms} ms after the heal; the old leader's unreleased {}-s grant taken over \
         {} ms after the cut",
        ms(cut_us, heal_us),
        ms(cut_us, elected_us),
        outcomes(&attempts, old, cut_us, heal_us),
        LEASE.as_secs(),
        ms(cut_us, taken_us),
    );
    // The old leader cannot commit anything while cut off.
    assert_no_grant(&s, &attempts, old, cut_us, heal_us);
    let served: usize = majority.iter().map(|i| during.get(i).unwrap_or(&0)).sum();
    assert!(served > 0, "the majority granted nothing: {during:?}");
    // Tokens after the leader change are above every token before it.
    assert_tokens_rise(&s, &attempts, cut_us, elected_us);
}

/// The new leader (node `new`) ends the orphaned grant (`orphan_token`,
/// asked for at `orphan_from_us`) with its committed Expire, not before its
/// lease: the key goes to another client with a higher token, which
/// releases it. Returns when it was taken.
fn the_new_leader_ends_the_orphan(
    s: &mut Setup,
    new: usize,
    orphan_token: u64,
    orphan_from_us: u64,
) -> u64 {
    let (r, taken_us) = acquire_recorded(
        &mut s.main,
        s.clock,
        1001,
        &client_for(new),
        "orphan",
        Duration::from_secs(4),
        LEASE,
    );
    let Acquire::Acquired(taken) = r else {
        panic!(
            "the new leader did not end the orphaned grant: {r:?}\n{}",
            s.cluster.logs()
        );
    };
    assert!(
        taken.token() > orphan_token,
        "{} after {orphan_token}",
        taken.token()
    );
    let lease_us = u64::try_from(LEASE.as_micros()).unwrap();
    assert!(
        taken_us >= orphan_from_us + lease_us,
        "the orphaned grant ended before its lease: taken {} ms after it was asked for",
        ms(orphan_from_us, taken_us)
    );
    release_recorded(&mut s.main, s.clock, 1001, taken);
    taken_us
}

// Long because it is one scenario, step by step.
#[test]
fn one_way_partitions_are_safe_and_heal() {
    // Never beside a single-mode fault test measuring its timings.
    let _timed = crate::shared();
    let Some(mut s) = Setup::start("oneway") else {
        return;
    };
    // Phase 1: the leader's messages to both followers are dropped; it
    // still hears them. The followers elect a leader among themselves.
    let (l1, term1) = s.leader();
    let followers: Vec<usize> = (1..=N).filter(|&i| i != l1).collect();
    s.fw.cut_all(&followers.iter().map(|&f| (l1, f)).collect::<Vec<_>>());
    let cut1_us = s.now_us();
    let Some((l2, term2)) = s.cluster.wait_leader_above(term1, RECOVERY) else {
        panic!(
            "no new leader when {l1} went unheard:\n{}",
            s.cluster.logs()
        );
    };
    let elected1_us = s.now_us();
    assert_ne!(l2, l1, "an unheard node became leader");
    s.hold_partition(cut1_us);
    s.fw.heal();
    let heal1_us = s.now_us();
    let back1_ms: Vec<u64> = (1..=N)
        .map(|i| s.wait_node_grants(i, heal1_us, "after the first heal"))
        .collect();

    // Phase 2: the followers' messages to the current leader are dropped;
    // it is still heard. check_quorum makes it step down, and the others
    // elect a leader.
    let (l3, term3) = s.leader();
    s.fw.cut_all(
        &(1..=N)
            .filter(|&i| i != l3)
            .map(|f| (f, l3))
            .collect::<Vec<_>>(),
    );
    let cut2_us = s.now_us();
    let Some((l4, _)) = s.cluster.wait_leader_above(term3, RECOVERY) else {
        panic!("no new leader when {l3} went deaf:\n{}", s.cluster.logs());
    };
    let elected2_us = s.now_us();
    assert_ne!(l4, l3, "a deaf node became leader");
    s.hold_partition(cut2_us);
    s.fw.heal();
    let heal2_us = s.now_us();
    let back2_ms: Vec<u64> = (1..=N)
        .map(|i| s.wait_node_grants(i, heal2_us, "after the second heal"))
        .collect();
    let attempts = s.finish();

    let during1 = grants_by_node(&attempts, cut1_us, heal1_us);
    let during2 = grants_by_node(&attempts, cut2_us, heal2_us);
    println!(
        "oneway: phase 1, leader {l1} unheard (term {term1}): node {l2} leader (term {term2}) \
         after {} ms, grants by node {during1:?}, every node granting again {back1_ms:?} ms \
         after the heal; phase 2, leader {l3} deaf: node {l4} leader after {} ms, grants by \
         node {during2:?}, every node granting again {back2_ms:?} ms after the heal",
        ms(cut1_us, elected1_us),
        ms(cut2_us, elected2_us),
    );
    // Nothing the cut-off node proposes can commit before the heal (its
    // messages go nowhere), and it learns of no commit in phase 2 (it hears
    // nothing).
    assert_no_grant(&s, &attempts, l1, cut1_us, heal1_us);
    assert_no_grant(&s, &attempts, l3, cut2_us, heal2_us);
    for (during, cut_off) in [(&during1, l1), (&during2, l3)] {
        let served: usize = (1..=N)
            .filter(|&i| i != cut_off)
            .map(|i| during.get(&i).unwrap_or(&0))
            .sum();
        assert!(served > 0, "the majority granted nothing: {during:?}");
    }
    assert_tokens_rise(&s, &attempts, cut1_us, elected1_us);
    assert_tokens_rise(&s, &attempts, cut2_us, elected2_us);
}

#[test]
fn a_cut_off_follower_grants_nothing_and_catches_up() {
    // Never beside a single-mode fault test measuring its timings.
    let _timed = crate::shared();
    let Some(mut s) = Setup::start("minority") else {
        return;
    };
    let (leader, term) = s.leader();
    let f = (1..=N).find(|&i| i != leader).unwrap();
    s.fw.isolate(f, N);
    let cut_us = s.now_us();
    s.hold_partition(cut_us);
    let (leader_after, term_after) = s.leader();
    s.fw.heal();
    let heal_us = s.now_us();
    let back_ms = s.wait_node_grants(f, heal_us, "after the heal");
    // Load a little longer so the caught-up follower serves some more.
    std::thread::sleep(Duration::from_millis(500));
    let (leader_end, term_end) = s.leader();
    let attempts = s.finish();

    let during = grants_by_node(&attempts, cut_us, heal_us);
    let after = grants_by_node(&attempts, heal_us, u64::MAX);
    println!(
        "minority: follower {f} cut off for {} ms; leader {leader} (term {term}) before, \
         {leader_after} (term {term_after}) during, {leader_end} (term {term_end}) after; \
         grants during the partition by node: {during:?}; node {f} granting again \
         {back_ms} ms after the heal; grants after the heal by node: {after:?}; node {f}'s \
         acquires invoked while cut off: {}",
        ms(cut_us, heal_us),
        outcomes(&attempts, f, cut_us, heal_us),
    );
    assert_no_grant(&s, &attempts, f, cut_us, heal_us);
    // Both nodes of the majority kept serving.
    for i in (1..=N).filter(|&i| i != f) {
        assert!(
            during.get(&i).copied().unwrap_or(0) > 0,
            "node {i} of the majority granted nothing during the partition: {during:?}\n{}",
            s.cluster.logs()
        );
    }
    // The follower's grants after the heal come after everything the
    // majority granted without it.
    assert_tokens_rise(&s, &attempts, heal_us, heal_us);
}

/// Draws a fault and puts it in place (replacing the previous one in one
/// transaction); returns what it is.
fn random_fault(s: &mut Setup, rng: &mut SplitMix64) -> String {
    let node = |rng: &mut SplitMix64| usize::try_from(rng.range(1, N as u64 + 1)).unwrap();
    let (cuts, what) = match rng.range(0, 5) {
        0 => (Vec::new(), "healed".to_owned()),
        1 => {
            let i = node(rng);
            (Firewall::isolation(i, N), format!("node {i} isolated"))
        }
        2 => {
            let (l, _) = s.leader();
            (Firewall::isolation(l, N), format!("leader {l} isolated"))
        }
        3 => {
            let from = node(rng);
            let to = (1..=N)
                .filter(|&j| j != from)
                .nth(usize::from(rng.chance(0.5)))
                .unwrap();
            (vec![(from, to)], format!("{from} -> {to} cut"))
        }
        _ => {
            let mut cuts = Vec::new();
            for from in 1..=N {
                for to in (1..=N).filter(|&j| j != from) {
                    if rng.chance(0.4) {
                        cuts.push((from, to));
                    }
                }
            }
            let names: Vec<String> = cuts.iter().map(|(f, t)| format!("{f}->{t}")).collect();
            (cuts, format!("links cut: [{}]", names.join(" ")))
        }
    };
    s.fw.set(cuts);
    what
}

#[test]
fn random_partitions_from_a_seed_stay_safe() {
    // Never beside a single-mode fault test measuring its timings.
    let _timed = crate::shared();
    // The seed fixes the schedule of faults (not the timing of the
    // processes): TICKETD_NEMESIS_SEED=<n> runs another one, and
    // TICKETD_NEMESIS_STEPS=<n> a longer one.
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let seed = env("TICKETD_NEMESIS_SEED", 7);
    let steps = env("TICKETD_NEMESIS_STEPS", STEPS);
    let Some(mut s) = Setup::start("nemesis") else {
        return;
    };
    let mut rng = SplitMix64::new(seed);
    let mut schedule = Vec::new();
    let start_us = s.now_us();
    for _ in 0..steps {
        let (leader, term) = s.leader();
        let fault = format!(
            "{} (leader before: {leader}, term {term})",
            random_fault(&mut s, &mut rng)
        );
        let at_us = s.now_us();
        schedule.push((at_us, fault));
        std::thread::sleep(STEP);
    }
    s.fw.heal();
    let heal_us = s.now_us();
    let back_ms: Vec<u64> = (1..=N)
        .map(|i| s.wait_node_grants(i, heal_us, &format!("after the final heal (seed {seed})")))
        .collect();
    let attempts = s.finish();
    let mut lines = Vec::new();
    for (k, (at_us, fault)) in schedule.iter().enumerate() {
        let end_us = schedule.get(k + 1).map_or(heal_us, |(t, _)| *t);
        lines.push(format!(
            "  +{} ms {fault}: grants by node {:?}",
            ms(start_us, *at_us),
            grants_by_node(&attempts, *at_us, end_us)
        ));
    }
    println!(
        "nemesis (seed {seed}):\n{}\n  healed: every node granting again {back_ms:?} ms later",
        lines.join("\n")
    );
}

//! Protocol 1.2 through the nodes: acquires with a limit proposed from a
//! follower and the leader and answered A, T or L; the leader's timer of
//! each permit firing at its own lease; a new leader timing every permit
//! it finds; a follower caught up by a snapshot answering its permit from
//! the table.

use super::*;
use crate::proto::Mode;

/// An acquire with a limit of `limit` places of `key` by `owner`, in
/// `mode`, waiting `wait_s` and leasing `lease_s`.
fn acquire_places(
    owner: u64,
    key: &str,
    limit: u16,
    mode: Mode,
    (wait_s, lease_s): (u8, u8),
) -> Request<'_> {
    Request::AcquireWithLimit {
        wait_s,
        lease_s,
        owner,
        limit,
        mode,
        key,
    }
}

/// Runs rounds of 100 ms (messages to and from `cut` dropped) until `done`
/// holds or `rounds` pass; whether it held.
fn run_until(
    e: &mut Elected,
    cut: Option<usize>,
    rounds: usize,
    done: impl Fn(&[Node<MemDisk>]) -> bool,
) -> bool {
    for _ in 0..rounds {
        if done(&e.nodes) {
            return true;
        }
        e.now = e.now.add_ms(100);
        settle_cut(&mut e.nodes, cut, e.now, &mut e.out);
    }
    done(&e.nodes)
}

/// The tokens of the grants of `key` on `node`.
fn permits(node: &Node<MemDisk>, key: &str) -> Vec<u64> {
    node.state_machine()
        .engine()
        .grants(key)
        .map(|g| g.token)
        .collect()
}

#[test]
fn a_semaphore_is_served_from_a_follower_and_the_leader() {
    let mut e = elected_three();
    let (l, f) = (e.leader, (e.leader + 1) % 3);
    e.out.clear();
    let lease = (0, 30);
    e.nodes[f].request(
        e.now,
        1,
        acquire_places(1, "sem", 3, Mode::Shared, lease),
        &mut e.out,
    );
    e.nodes[l].request(
        e.now,
        2,
        acquire_places(2, "sem", 3, Mode::Shared, lease),
        &mut e.out,
    );
    e.nodes[f].request(
        e.now,
        3,
        acquire_places(3, "sem", 3, Mode::Shared, lease),
        &mut e.out,
    );
    run_until(&mut e, None, 20, |n| {
        n.iter().all(|n| permits(n, "sem").len() == 3)
    });
    for conn in 1..=3 {
        let r = replies_to(&e.out, conn);
        assert!(
            r.len() == 1 && r[0].starts_with("Acquired"),
            "{conn}: {r:?}"
        );
    }
    // Full: a fourth with wait 0 gets T; another limit gets L, naming 3.
    e.nodes[f].request(
        e.now,
        4,
        acquire_places(4, "sem", 3, Mode::Shared, lease),
        &mut e.out,
    );
    e.nodes[l].request(
        e.now,
        5,
        acquire_places(5, "sem", 2, Mode::Shared, lease),
        &mut e.out,
    );
    run_until(&mut e, None, 20, |_| false);
    assert_eq!(
        replies_to(&e.out, 4),
        [format!(
            "{:?}",
            Reply::Timeout {
                owner: 4,
                key: "sem"
            }
        )]
    );
    let mismatch = Reply::LimitMismatch {
        owner: 5,
        limit: 3,
        key: "sem",
    };
    assert_eq!(replies_to(&e.out, 5), [format!("{mismatch:?}")]);
    let tokens = permits(&e.nodes[l], "sem");
    for n in &e.nodes {
        assert_eq!(permits(n, "sem"), tokens, "node {}", n.id());
        n.state_machine().check();
    }
}

// Long because it is one scenario, step by step, on the clock.
#[test]
fn the_leader_expires_each_permit_at_its_own_lease() {
    let mut e = elected_three();
    let l = e.leader;
    e.out.clear();
    let start = e.now;
    let short = acquire_places(1, "rw", 4, Mode::Shared, (0, 2));
    e.nodes[l].request(e.now, 1, short, &mut e.out);
    run_until(&mut e, None, 1, |_| false);
    let long = acquire_places(2, "rw", 4, Mode::Shared, (0, 5));
    e.nodes[l].request(e.now, 2, long, &mut e.out);
    run_until(&mut e, None, 1, |_| false);
    let writer = acquire_places(3, "rw", 4, Mode::Exclusive, (30, 10));
    e.nodes[l].request(e.now, 3, writer, &mut e.out);
    run_until(&mut e, None, 1, |_| false);
    let tokens = permits(&e.nodes[l], "rw");
    assert_eq!(tokens.len(), 2, "both shared grants stand");
    assert!(replies_to(&e.out, 3).is_empty(), "the writer waits");
    // Past the short lease only: its permit alone ends.
    run_until(&mut e, None, 30, |n| {
        n.iter().all(|n| permits(n, "rw") == tokens[1..])
    });
    assert!(e.now < start.add_secs(5), "before the long lease ends");
    for n in &e.nodes {
        assert_eq!(permits(n, "rw"), tokens[1..], "node {}", n.id());
    }
    assert!(
        replies_to(&e.out, 3).is_empty(),
        "one reader still holds it"
    );
    // Past the long lease: the writer gets the key whole.
    assert!(run_until(&mut e, None, 40, |n| n.iter().all(|n| permits(
        n, "rw"
    )
    .len()
        == 1
        && !permits(n, "rw").contains(&tokens[1]))));
    assert!(e.now >= start.add_secs(5));
    let r = replies_to(&e.out, 3);
    assert!(r.len() == 1 && r[0].starts_with("Acquired"), "{r:?}");
    let stats = e.nodes[l].stats();
    assert!(stats.timer_proposals >= 2, "an Expire per permit");
}

#[test]
fn a_new_leader_times_every_permit_it_finds() {
    let mut e = elected_three();
    let old = e.leader;
    e.out.clear();
    for owner in 1..=3 {
        let req = acquire_places(owner, "sem", 3, Mode::Shared, (0, 3));
        e.nodes[old].request(e.now, owner, req, &mut e.out);
    }
    run_until(&mut e, None, 5, |n| {
        n.iter().all(|n| permits(n, "sem").len() == 3)
    });
    // The old leader is cut off at once: its timers never fire where the
    // others hear them.
    let others =
        move |n: &[Node<MemDisk>]| -> Vec<usize> { (0..n.len()).filter(|&i| i != old).collect() };
    assert!(run_until(&mut e, Some(old), 100, |n| others(n)
        .into_iter()
        .any(|i| n[i].is_leader() && n[i].timers_ready())));
    let elected_at = e.now;
    let new = e
        .nodes
        .iter()
        .position(|n| n.is_leader() && n.id() != e.nodes[old].id());
    let new = new.expect("a new leader");
    assert_eq!(permits(&e.nodes[new], "sem").len(), 3, "found every permit");
    // Each permit expires a full lease after the new leader took over.
    assert!(run_until(&mut e, Some(old), 60, |n| others(n)
        .into_iter()
        .all(|i| permits(&n[i], "sem").is_empty())));
    assert!(
        e.now > elected_at.add_secs(3),
        "not before its lease in full"
    );
    assert!(e.nodes[new].stats().timer_proposals >= 3);
    for i in others(&e.nodes) {
        let n = &e.nodes[i];
        n.state_machine().check();
        assert_eq!(n.state_machine().engine().permit_key_count(), 0);
    }
}

#[test]
fn a_follower_caught_up_by_a_snapshot_answers_its_permit_from_the_table() {
    let Elected {
        mut out,
        mut now,
        leader,
        mut nodes,
        ..
    } = elected_three();
    let follower = (leader + 1) % 3;
    nodes[leader].cfg.leader_sync_ms = 0;
    nodes[leader].request(now, 1, acquire(1, "first"), &mut out);
    settle_net(&mut nodes, now, &mut out);
    out.clear();
    let req = acquire_places(7, "sem", 2, Mode::Shared, (0, 200));
    nodes[follower].request(now, 7, req, &mut out);
    nodes[follower].end_turn(now, &mut out).unwrap();
    // The forward reaches the leader; the follower then hears nothing
    // until the leader has compacted past it.
    for m in nodes[follower].take_messages() {
        let to = usize::try_from(m.to).unwrap() - 1;
        nodes[to].step(m);
    }
    settle_cut(&mut nodes, Some(follower), now, &mut out);
    nodes[leader].snapshot_now = true;
    nodes[leader].request(now, 2, acquire(2, "other"), &mut out);
    settle_cut(&mut nodes, Some(follower), now, &mut out);
    assert!(
        nodes[leader].snapshot_index() > nodes[follower].applied(),
        "{} {} {}",
        nodes[leader].snapshot_index(),
        nodes[follower].applied(),
        nodes[leader].applied()
    );
    for _ in 0..50 {
        now = now.add_ms(100);
        settle_net(&mut nodes, now, &mut out);
        if nodes[follower].pending_requests() == 0 {
            break;
        }
    }
    assert!(nodes[follower].stats().snapshots_installed >= 1);
    let r = replies_to(&out, 7);
    assert!(r.len() == 1 && r[0].starts_with("Acquired"), "{r:?}");
    assert_eq!(
        permits(&nodes[follower], "sem"),
        permits(&nodes[leader], "sem")
    );
    assert_eq!(
        nodes[follower].state_machine().engine().permit_limit("sem"),
        Some(2)
    );
}

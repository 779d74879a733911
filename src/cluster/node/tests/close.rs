//! Requests whose connection closes before their answer (PROTOCOL §2.5): a
//! release or an extend read from it takes effect, proposed again if its
//! proposal is lost; a grant applied for an acquire whose connection is
//! gone is released at once, whether it was fresh or a queued waiter's
//! handover that came before the cancellation.

use super::*;

/// A node index other than the leader's.
fn follower_of(e: &Elected) -> usize {
    (e.leader + 1) % 3
}

/// Grants `key` (30 s) to connection 1 of the leader: the token.
fn grant(e: &mut Elected, key: &str) -> u64 {
    let l = e.leader;
    e.nodes[l].request(e.now, 1, acquire(1, key), &mut e.out);
    assert!(settle_until(e, 20, |n| n
        .state_machine()
        .holder(key)
        .is_some()));
    let token = e.nodes[l].state_machine().holder(key).expect("granted");
    e.out.clear();
    token
}

/// Runs turns, the clock moving 100 ms a round, until `done` holds on
/// every node (at most `rounds` rounds); whether it did.
fn settle_until(e: &mut Elected, rounds: usize, done: impl Fn(&Node<MemDisk>) -> bool) -> bool {
    for _ in 0..rounds {
        if e.nodes.iter().all(&done) {
            return true;
        }
        e.now = e.now.add_ms(100);
        settle_net(&mut e.nodes, e.now, &mut e.out);
    }
    e.nodes.iter().all(done)
}

#[test]
fn a_release_or_extend_whose_connection_closes_in_its_turn_takes_effect() {
    let mut e = elected_three();
    let f = follower_of(&e);
    for (n, at) in [f, e.leader].into_iter().enumerate() {
        let (rel, ext) = (format!("rel{n}"), format!("ext{n}"));
        let t_rel = grant(&mut e, &rel);
        let t_ext = grant(&mut e, &ext);
        let conn = 50 + n as ConnId;
        let release = Request::Release {
            token: t_rel,
            key: &rel,
        };
        let extend = Request::Extend {
            lease_s: 200,
            token: t_ext,
            key: &ext,
        };
        e.nodes[at].request(e.now, conn, release, &mut e.out);
        e.nodes[at].request(e.now, conn, extend, &mut e.out);
        // Read, then the connection closes before the turn ends.
        e.nodes[at].disconnect(conn);
        settle_until(&mut e, 20, |n| {
            n.state_machine().lease_of(&ext) != Some((t_ext, 0))
        });
        for node in &e.nodes {
            let sm = node.state_machine();
            assert_eq!(sm.holder(&rel), None, "released on node {}", node.id());
            assert_eq!(sm.lease_of(&ext), Some((t_ext, 1)), "extended");
        }
        assert!(replies_to(&e.out, conn).is_empty(), "nobody to answer");
        assert_eq!(e.nodes[at].pending_requests(), 0, "nothing left waiting");
    }
}

#[test]
fn a_closed_connections_release_whose_forward_is_lost_is_proposed_again() {
    let mut e = elected_three();
    let f = follower_of(&e);
    let token = grant(&mut e, "k");
    e.nodes[f].request(e.now, 50, Request::Release { token, key: "k" }, &mut e.out);
    e.nodes[f].end_turn(e.now, &mut e.out).unwrap();
    let forward = e.nodes[f].take_messages();
    assert!(forward
        .iter()
        .any(|m| m.msg_type == MessageType::MsgPropose));
    // The forward is lost, and the connection closes.
    drop(forward);
    e.nodes[f].disconnect(50);
    let released = settle_until(&mut e, 100, |n| n.state_machine().holder("k").is_none());
    assert!(released, "the release was proposed again and applied");
    assert!(e.nodes[f].stats().reproposed >= 1);
    assert_eq!(e.nodes[f].pending_requests(), 0);
    assert!(replies_to(&e.out, 50).is_empty());
}

#[test]
fn a_grant_for_an_acquire_whose_connection_closed_is_released() {
    let mut e = elected_three();
    let f = follower_of(&e);
    // Proposed (forwarded), then the connection closes before it applies.
    e.nodes[f].request(e.now, 60, acquire(6, "fresh"), &mut e.out);
    e.nodes[f].end_turn(e.now, &mut e.out).unwrap();
    e.nodes[f].disconnect(60);
    for _ in 0..20 {
        if e.nodes[f].stats().unseen_released == 1 {
            break;
        }
        e.now = e.now.add_ms(100);
        settle_net(&mut e.nodes, e.now, &mut e.out);
    }
    assert_eq!(
        e.nodes[f].stats().unseen_released,
        1,
        "granted, then released"
    );
    let free = settle_until(&mut e, 20, |n| n.state_machine().holder("fresh").is_none());
    assert!(free, "the unseen grant was released");
    assert!(replies_to(&e.out, 60).is_empty());
    assert_eq!(e.nodes[f].pending_requests(), 0);
}

#[test]
fn a_handover_to_a_closed_waiter_before_its_cancel_is_released() {
    let mut e = elected_three();
    let (f, l) = (follower_of(&e), e.leader);
    let token = grant(&mut e, "q");
    let wait = Request::Acquire {
        wait_s: 30,
        lease_s: 30,
        owner: 7,
        key: "q",
    };
    e.nodes[f].request(e.now, 61, wait, &mut e.out);
    settle_until(&mut e, 20, |n| n.state_machine().waiters().count() == 1);
    assert_eq!(e.nodes[l].state_machine().waiters().count(), 1, "queued");
    // The holder's release is in the log before the waiter's
    // cancellation is even proposed: the key is handed to the waiter.
    e.nodes[l].request(e.now, 1, Request::Release { token, key: "q" }, &mut e.out);
    e.nodes[l].end_turn(e.now, &mut e.out).unwrap();
    e.nodes[f].disconnect(61);
    let free = settle_until(&mut e, 20, |n| {
        n.state_machine().holder("q").is_none() && n.state_machine().waiters().count() == 0
    });
    assert!(free, "the handover nobody saw was released");
    assert_eq!(e.nodes[f].stats().unseen_released, 1);
    assert!(replies_to(&e.out, 61).is_empty());
}

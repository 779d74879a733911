//! Grants bound to their takers' identities across nodes: the caller in
//! the entry, kept by a re-proposal, and the node's own release of a grant
//! nobody saw.

use super::*;

use crate::engine::Caller;

const ALICE: Caller = Caller {
    holder: 0x0A11_CE00_0000_0001,
    admin: false,
};
const BOB: Caller = Caller {
    holder: 0x0B0B_0000_0000_0003,
    admin: false,
};

/// Runs turns, the clock moving 100 ms a round, until `done` holds on
/// every node (at most 100 rounds); whether it did.
fn settle_until(e: &mut Elected, done: impl Fn(&Node<MemDisk>) -> bool) -> bool {
    for _ in 0..100 {
        if e.nodes.iter().all(&done) {
            return true;
        }
        e.now = e.now.add_ms(100);
        settle_net(&mut e.nodes, e.now, &mut e.out);
    }
    e.nodes.iter().all(done)
}

fn holder_of(n: &Node<MemDisk>, key: &str) -> Option<u64> {
    n.state_machine().engine().grant_holder(key)
}

#[test]
fn a_lost_forward_is_proposed_again_with_its_caller_and_binds_on_every_node() {
    let mut e = elected_three();
    let f = (e.leader + 1) % 3;
    e.nodes[f].request_as(e.now, 5, ALICE, acquire(5, "k"), &mut e.out);
    e.nodes[f].end_turn(e.now, &mut e.out).unwrap();
    let forward = e.nodes[f].take_messages();
    assert!(forward
        .iter()
        .any(|m| m.msg_type == MessageType::MsgPropose));
    drop(forward);
    assert!(settle_until(&mut e, |n| holder_of(n, "k").is_some()));
    assert!(e.nodes[f].stats().reproposed >= 1);
    for n in &e.nodes {
        assert_eq!(holder_of(n, "k"), Some(ALICE.holder), "node {}", n.id());
    }
    let token = e.nodes[f].state_machine().holder("k").unwrap();
    // BOB, with the token, on the leader: N; ALICE on the follower: R.
    let l = e.leader;
    e.out.clear();
    e.nodes[l].request_as(
        e.now,
        6,
        BOB,
        Request::Release { token, key: "k" },
        &mut e.out,
    );
    settle_until(&mut e, |n| n.pending_requests() == 0);
    assert_eq!(
        replies_to(&e.out, 6),
        [format!("NotReleased {{ token: {token}, key: \"k\" }}")]
    );
    e.nodes[f].request_as(
        e.now,
        5,
        ALICE,
        Request::Release { token, key: "k" },
        &mut e.out,
    );
    assert!(settle_until(&mut e, |n| n
        .state_machine()
        .holder("k")
        .is_none()));
    assert_eq!(
        replies_to(&e.out, 5).last(),
        Some(&format!("Released {{ token: {token}, key: \"k\" }}"))
    );
}

#[test]
fn a_bound_grant_for_an_acquire_whose_connection_closed_is_released() {
    let mut e = elected_three();
    let f = (e.leader + 1) % 3;
    e.nodes[f].request_as(e.now, 60, ALICE, acquire(6, "fresh"), &mut e.out);
    e.nodes[f].end_turn(e.now, &mut e.out).unwrap();
    e.nodes[f].disconnect(60);
    // Granted (bound to ALICE), then released by the node as the admin
    // identity: nobody has its token.
    for _ in 0..20 {
        if e.nodes[f].stats().unseen_released == 1 {
            break;
        }
        e.now = e.now.add_ms(100);
        settle_net(&mut e.nodes, e.now, &mut e.out);
    }
    assert_eq!(e.nodes[f].stats().unseen_released, 1, "granted");
    let free = settle_until(&mut e, |n| n.state_machine().holder("fresh").is_none());
    assert!(free, "the unseen grant was released");
    assert!(replies_to(&e.out, 60).is_empty());
}

//! Peer messages raft-rs would panic on (or trust wrongly) are dropped
//! before it sees them, and the node serves on. Each panic case is first
//! stepped into raft directly, to show that it is one.

use std::panic::AssertUnwindSafe;

use super::*;
use raft::eraftpb::{ConfState, Snapshot};

/// Builds, for an elected trio, a message and the index of the node it
/// goes to.
type Forge = fn(&Elected) -> (usize, Message);

/// A message of kind `t` from the leader of `e` to the node after it, at
/// the leader's term.
fn to_follower(e: &Elected, t: MessageType) -> (usize, Message) {
    let to = (e.leader + 1) % 3;
    let m = Message {
        msg_type: t,
        from: e.leader as u64 + 1,
        to: to as u64 + 1,
        term: e.nodes[e.leader].term(),
        ..Default::default()
    };
    (to, m)
}

/// A message of kind `t` to the leader of `e` from the node after it, at
/// the leader's term.
fn to_leader(e: &Elected, t: MessageType) -> (usize, Message) {
    let from = (e.leader + 1) % 3;
    let m = Message {
        msg_type: t,
        from: from as u64 + 1,
        to: e.leader as u64 + 1,
        term: e.nodes[e.leader].term(),
        ..Default::default()
    };
    (e.leader, m)
}

fn last_index(e: &Elected, i: usize) -> u64 {
    e.nodes[i].rn.raft.raft_log.last_index()
}

/// A snapshot past the end of node `i`'s log, of the leader's table and
/// configuration: one a correct leader could send.
fn snapshot_past(e: &Elected, i: usize) -> Snapshot {
    let mut s = Snapshot {
        data: e.nodes[e.leader].sm.snapshot().into(),
        ..Default::default()
    };
    let meta = s.mut_metadata();
    meta.index = last_index(e, i) + 10;
    meta.term = e.nodes[e.leader].term();
    meta.set_conf_state(ConfState {
        voters: vec![1, 2, 3],
        ..Default::default()
    });
    s
}

fn heartbeat_committing_past_the_log(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_follower(e, MessageType::MsgHeartbeat);
    m.commit = 1_000_000_000;
    (to, m)
}

fn heartbeat_of_a_new_term_to_the_leader(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_leader(e, MessageType::MsgHeartbeat);
    m.term += 1;
    m.commit = 1_000_000_000;
    (to, m)
}

fn append_past_the_log_with_term_0(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_follower(e, MessageType::MsgAppend);
    m.index = 1_000_000_000;
    m.commit = 1_000_000_000;
    (to, m)
}

fn append_with_a_gap(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_follower(e, MessageType::MsgAppend);
    let last = last_index(e, to);
    m.index = last;
    m.log_term = e.nodes[to].rn.raft.raft_log.term(last).unwrap();
    m.entries = vec![Entry {
        index: last + 5,
        term: m.term,
        ..Default::default()
    }]
    .into();
    (to, m)
}

fn snapshot_with_a_voter_also_learner(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_follower(e, MessageType::MsgSnapshot);
    let mut s = snapshot_past(e, to);
    s.mut_metadata().mut_conf_state().learners = vec![2];
    m.set_snapshot(s);
    (to, m)
}

fn proposal_without_entries(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_leader(e, MessageType::MsgPropose);
    m.term = 0;
    (to, m)
}

fn read_request_without_entries(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_leader(e, MessageType::MsgReadIndex);
    m.term = 0;
    (to, m)
}

/// Messages raft-rs 0.7 panics on.
const PANICS: [(&str, Forge); 7] = [
    ("heartbeat commit", heartbeat_committing_past_the_log),
    ("heartbeat, new term", heartbeat_of_a_new_term_to_the_leader),
    ("append past the log", append_past_the_log_with_term_0),
    ("append with a gap", append_with_a_gap),
    ("snapshot conf", snapshot_with_a_voter_also_learner),
    ("empty proposal", proposal_without_entries),
    ("empty read", read_request_without_entries),
];

fn snapshot_of_garbage(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_follower(e, MessageType::MsgSnapshot);
    let mut s = snapshot_past(e, to);
    s.data = vec![0xff; 40].into();
    m.set_snapshot(s);
    (to, m)
}

fn snapshot_at_index_0(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_follower(e, MessageType::MsgSnapshot);
    let mut s = snapshot_past(e, to);
    s.mut_metadata().index = 0;
    m.set_snapshot(s);
    (to, m)
}

fn ack_past_the_log(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_leader(e, MessageType::MsgAppendResponse);
    m.index = 1_000_000_000;
    (to, m)
}

fn heartbeat_ack_past_the_log(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_leader(e, MessageType::MsgHeartbeatResponse);
    m.commit = 1_000_000_000;
    (to, m)
}

fn heartbeat_without_a_term(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_follower(e, MessageType::MsgHeartbeat);
    m.term = 0;
    (to, m)
}

fn vote_at_a_term_past_2_62(e: &Elected) -> (usize, Message) {
    let (to, mut m) = to_follower(e, MessageType::MsgRequestVote);
    m.term = u64::MAX;
    m.index = u64::MAX;
    m.log_term = u64::MAX;
    (to, m)
}

fn append_with_a_term_going_down(e: &Elected) -> (usize, Message) {
    let (to, mut m) = append_with_a_gap(e);
    m.entries[0].index = m.index + 1;
    m.entries[0].term = m.log_term.saturating_sub(1);
    (to, m)
}

/// Messages no correct peer sends that raft would not panic on at once,
/// but would act on: a table that does not decode stops the node on
/// install; a leader would count an acknowledgement past its log.
const REFUSED: [(&str, Forge); 7] = [
    ("garbage snapshot", snapshot_of_garbage),
    ("snapshot at 0", snapshot_at_index_0),
    ("ack past the log", ack_past_the_log),
    ("heartbeat ack past the log", heartbeat_ack_past_the_log),
    ("no term", heartbeat_without_a_term),
    ("huge term", vote_at_a_term_past_2_62),
    ("falling term", append_with_a_term_going_down),
];

/// Whether raft panics on the message, stepped straight into it.
fn raft_panics_on(forge: Forge) -> bool {
    let mut e = elected_three();
    let (i, m) = forge(&e);
    let rn = &mut e.nodes[i].rn;
    std::panic::catch_unwind(AssertUnwindSafe(|| {
        let _ = rn.step(m);
    }))
    .is_err()
}

/// Steps the message into its node through the guard: dropped and
/// counted, and every node serves on with nothing else refused.
fn assert_refused_and_serving(what: &str, forge: Forge) {
    let mut e = elected_three();
    let (i, m) = forge(&e);
    let term = e.nodes[e.leader].term();
    e.nodes[i].step(m);
    assert_eq!(e.nodes[i].stats().refused_messages, 1, "{what}: refused");
    settle_net(&mut e.nodes, e.now, &mut e.out);
    assert!(e.nodes[e.leader].is_leader(), "{what}: still leads");
    assert_eq!(e.nodes[e.leader].term(), term, "{what}: same term");
    e.out.clear();
    for (conn, n) in [(7, e.leader), (8, (e.leader + 1) % 3)] {
        let key = format!("after-{conn}");
        e.nodes[n].request(e.now, conn, acquire(conn, &key), &mut e.out);
        for _ in 0..20 {
            e.now = e.now.add_ms(100);
            settle_net(&mut e.nodes, e.now, &mut e.out);
            if !replies_to(&e.out, conn).is_empty() {
                break;
            }
        }
        let got = replies_to(&e.out, conn);
        assert!(
            got.len() == 1 && got[0].starts_with("Acquired"),
            "{what}: node {} grants: {got:?}",
            n + 1
        );
    }
    let refused: Vec<u64> = e.nodes.iter().map(|n| n.stats().refused_messages).collect();
    assert_eq!(refused.iter().sum::<u64>(), 1, "{what}: {refused:?}");
}

#[test]
fn messages_raft_panics_on_are_dropped_and_the_nodes_serve_on() {
    for (what, forge) in PANICS {
        assert!(raft_panics_on(forge), "{what}: raft panics on it unguarded");
        assert_refused_and_serving(what, forge);
    }
}

#[test]
fn messages_no_correct_peer_sends_are_dropped_and_the_nodes_serve_on() {
    for (what, forge) in REFUSED {
        assert_refused_and_serving(what, forge);
    }
}

#[test]
fn a_garbage_snapshot_stepped_unguarded_stops_the_node() {
    let mut e = elected_three();
    let (i, m) = snapshot_of_garbage(&e);
    e.nodes[i].rn.step(m).unwrap();
    let (now, out) = (e.now, &mut e.out);
    assert!(e.nodes[i].end_turn(now, out).is_err(), "the install fails");
}

#[test]
fn a_snapshot_a_correct_leader_could_send_is_taken_and_installed() {
    let mut e = elected_three();
    let (to, mut m) = to_follower(&e, MessageType::MsgSnapshot);
    let s = snapshot_past(&e, to);
    let index = s.get_metadata().index;
    m.set_snapshot(s);
    e.nodes[to].step(m);
    assert_eq!(e.nodes[to].stats().refused_messages, 0);
    assert!(e.nodes[to].checked_snapshot.is_some(), "decoded once, kept");
    let (now, out) = (e.now, &mut e.out);
    e.nodes[to].end_turn(now, out).unwrap();
    assert!(
        e.nodes[to].checked_snapshot.is_none(),
        "used by the install"
    );
    assert_eq!(e.nodes[to].stats().snapshots_installed, 1);
    assert_eq!(e.nodes[to].applied(), index);
}

#[test]
fn a_checked_snapshot_raft_ignores_is_let_go() {
    let mut e = elected_three();
    let (to, mut m) = to_follower(&e, MessageType::MsgSnapshot);
    let mut s = snapshot_past(&e, to);
    // raft keeps a snapshot only for a node its configuration names.
    s.mut_metadata().mut_conf_state().voters = vec![1, 2, 3, 4];
    s.mut_metadata()
        .mut_conf_state()
        .voters
        .retain(|v| *v != to as u64 + 1);
    m.set_snapshot(s);
    e.nodes[to].step(m);
    assert_eq!(e.nodes[to].stats().refused_messages, 0);
    assert!(e.nodes[to].checked_snapshot.is_none());
}

#[test]
fn joint_configurations_restore_and_broken_ones_do_not() {
    let cs =
        |voters: &[u64], learners: &[u64], outgoing: &[u64], next: &[u64], auto: bool| ConfState {
            voters: voters.to_vec(),
            learners: learners.to_vec(),
            voters_outgoing: outgoing.to_vec(),
            learners_next: next.to_vec(),
            auto_leave: auto,
            ..Default::default()
        };
    for ok in [
        cs(&[1, 2, 3], &[], &[], &[], false),
        cs(&[1, 2], &[4], &[], &[], false),
        cs(&[1, 2, 4], &[], &[1, 2, 3], &[], false),
        cs(&[1, 2], &[], &[1, 2, 3], &[3], true),
    ] {
        assert!(super::super::guard::restores(&ok), "{ok:?}");
    }
    for bad in [
        cs(&[1, 2, 3], &[2], &[], &[], false),
        cs(&[1, 1, 2], &[], &[], &[], false),
        cs(&[1, 2], &[], &[], &[3], false),
        cs(&[1, 2], &[], &[], &[], true),
        cs(&[1, 2], &[], &[1, 2, 3], &[4], false),
        cs(&(1..=300).collect::<Vec<_>>(), &[], &[], &[], false),
    ] {
        assert!(!super::super::guard::restores(&bad), "{bad:?}");
    }
}

use super::*;
use crate::cluster::log::MemDisk;
use crate::cluster::members::Change;
use crate::engine::Outbox;
use crate::proto::{Reply, Request};
use raft::eraftpb::{ConfChangeSingle, ConfChangeType, ConfChangeV2, Entry, MessageType};

/// Runs turns at `now` (the clock does not move) until `out` holds a
/// reply or `turns` pass.
fn turns(node: &mut Node<MemDisk>, now: Millis, out: &mut Outbox, turns: usize) {
    for _ in 0..turns {
        node.tick(now, out);
        node.end_turn(now, out).unwrap();
    }
}

#[test]
fn lease_deadline_is_one_millisecond_after_the_lease() {
    assert_eq!(lease_deadline(Millis(1000), 5), Millis(6001));
    assert_eq!(lease_deadline(Millis(0), 255), Millis(255_001));
}

#[test]
fn a_grant_applied_in_the_request_millisecond_expires_only_after_written_plus_lease() {
    let mut node =
        Node::open(NodeConfig::new(1, vec![1]), MemDisk::new(), &quiet_logger()).expect("opens");
    let mut out = Outbox::new();
    let mut now = Millis(0);
    for _ in 0..100 {
        now = now.add_ms(100);
        turns(&mut node, now, &mut out, 1);
        if node.is_leader() && node.timers_ready() {
            break;
        }
    }
    assert!(node.is_leader() && node.timers_ready(), "leads");
    // The client writes the request at `now` (its truncated clock may
    // read up to 1 ms later); the leader grants it in this same ms.
    let written = now;
    node.request(
        written,
        9,
        Request::Acquire {
            wait_s: 0,
            lease_s: 2,
            owner: 1,
            key: "k",
        },
        &mut out,
    );
    turns(&mut node, written, &mut out, 10);
    let reply = out.iter().next().map(|a| format!("{:?}", a.reply));
    assert!(
        reply.as_deref().is_some_and(|r| r.starts_with("Acquired")),
        "granted in the request's millisecond: {reply:?}"
    );
    let token = node.state_machine().holder("k").expect("held");
    // At written + lease the client's conservative expiry may not have
    // passed yet: no Expire.
    let lease_end = written.add_secs(2);
    turns(&mut node, lease_end, &mut out, 10);
    assert_eq!(
        node.state_machine().holder("k"),
        Some(token),
        "expired at written + lease, up to 1 ms before the client's expiry"
    );
    turns(&mut node, lease_end.add_ms(1), &mut out, 10);
    assert_eq!(node.state_machine().holder("k"), None, "expired 1 ms later");
}

/// Delivers every message between `nodes` (ids 1..) until none is left,
/// running a turn on each receiver.
fn settle_net(nodes: &mut [Node<MemDisk>], now: Millis, out: &mut Outbox) {
    settle_cut(nodes, None, now, out);
}

/// [`settle_net`], except that messages to or from node index `cut` are
/// dropped and `cut` runs no turn.
fn settle_cut(nodes: &mut [Node<MemDisk>], cut: Option<usize>, now: Millis, out: &mut Outbox) {
    for _ in 0..50 {
        let mut any = false;
        for i in 0..nodes.len() {
            for m in nodes[i].take_messages() {
                let to = usize::try_from(m.to).unwrap() - 1;
                if cut == Some(i) || cut == Some(to) {
                    continue;
                }
                any = true;
                nodes[to].step(m);
            }
        }
        for (i, n) in nodes.iter_mut().enumerate() {
            if cut != Some(i) {
                n.tick(now, out);
                n.end_turn(now, out).unwrap();
            }
        }
        if !any {
            return;
        }
    }
}

/// Three fresh nodes on memory disks, one of them elected leader.
struct Elected {
    disks: Vec<MemDisk>,
    out: Outbox,
    now: Millis,
    nodes: Vec<Node<MemDisk>>,
    leader: usize,
}

fn elected_three() -> Elected {
    let disks: Vec<MemDisk> = (0..3).map(|_| MemDisk::new()).collect();
    let mut out = Outbox::new();
    let mut now = Millis(0);
    let nodes = elected(&disks, &mut now, &mut out);
    let leader = nodes.iter().position(Node::is_leader).expect("a leader");
    Elected {
        disks,
        out,
        now,
        nodes,
        leader,
    }
}

/// Three nodes on `disks`, settled until one leads with its timers
/// rebuilt.
fn elected(disks: &[MemDisk], now: &mut Millis, out: &mut Outbox) -> Vec<Node<MemDisk>> {
    let mut nodes: Vec<Node<MemDisk>> = (1..=3)
        .map(|id| {
            Node::open(
                NodeConfig::new(id, vec![1, 2, 3]),
                disks[id as usize - 1].clone(),
                &quiet_logger(),
            )
            .expect("opens")
        })
        .collect();
    for _ in 0..200 {
        *now = now.add_ms(100);
        settle_net(&mut nodes, *now, out);
        if nodes.iter().any(|n| n.is_leader() && n.timers_ready()) {
            break;
        }
    }
    nodes
}

/// An elected 3-node group whose `follower`'s fsyncs do not finish
/// until its disk lets them.
struct Trio {
    disks: Vec<MemDisk>,
    out: Outbox,
    now: Millis,
    nodes: Vec<Node<MemDisk>>,
    leader: usize,
    follower: usize,
}

fn trio_with_a_slow_follower() -> Trio {
    let Elected {
        disks,
        out,
        now,
        leader,
        mut nodes,
    } = elected_three();
    let follower = (leader + 1) % 3;
    disks[follower].hold_syncs(true);
    // The leader syncs every batch, so that it and one follower commit.
    nodes[leader].cfg.leader_sync_ms = 0;
    Trio {
        disks,
        out,
        now,
        nodes,
        leader,
        follower,
    }
}

#[test]
fn one_fsync_releases_one_ack_for_all_the_appends_it_covers() {
    let Trio {
        disks,
        mut out,
        now,
        mut nodes,
        leader,
        follower,
    } = trio_with_a_slow_follower();
    // Three appends, each from its own leader turn, reach the follower
    // while its fsync is held.
    for (owner, key) in [(1, "a"), (2, "b"), (3, "c")] {
        let req = Request::Acquire {
            wait_s: 0,
            lease_s: 5,
            owner,
            key,
        };
        nodes[leader].request(now, 9, req, &mut out);
        nodes[leader].end_turn(now, &mut out).unwrap();
        for m in nodes[leader].take_messages() {
            if m.to == follower as u64 + 1 {
                nodes[follower].step(m);
            }
        }
        nodes[follower].tick(now, &mut out);
        nodes[follower].end_turn(now, &mut out).unwrap();
    }
    let last = nodes[leader].rn.raft.raft_log.last_index();
    disks[follower].hold_syncs(false);
    nodes[follower].tick(now, &mut out);
    nodes[follower].end_turn(now, &mut out).unwrap();
    let acks: Vec<Message> = nodes[follower]
        .take_messages()
        .into_iter()
        .filter(|m| m.msg_type == MessageType::MsgAppendResponse)
        .collect();
    assert_eq!(acks.len(), 1, "one ack for three appends: {acks:?}");
    assert_eq!(acks[0].index, last, "and it acknowledges the last entry");
    for m in acks {
        nodes[leader].step(m);
    }
    for _ in 0..5 {
        nodes[leader].tick(now, &mut out);
        nodes[leader].end_turn(now, &mut out).unwrap();
    }
    let granted = out
        .iter()
        .filter(|a| format!("{:?}", a.reply).starts_with("Acquired"))
        .count();
    assert_eq!(granted, 3, "that ack committed all three");
}

#[test]
fn acks_are_coalesced_per_peer_and_term_and_rejections_kept() {
    let ack = |to: u64, term: u64, index: u64, reject: bool| {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgAppendResponse);
        m.to = to;
        m.term = term;
        m.index = index;
        m.reject = reject;
        m
    };
    let mut msgs = vec![
        ack(1, 2, 10, false),
        ack(1, 2, 9, true),
        ack(3, 2, 11, false),
        ack(1, 2, 12, false),
        ack(1, 3, 5, false),
        ack(1, 2, 11, false),
    ];
    coalesce_acks(&mut msgs);
    let left: Vec<(u64, u64, u64, bool)> = msgs
        .iter()
        .map(|m| (m.to, m.term, m.index, m.reject))
        .collect();
    assert_eq!(
        left,
        vec![
            (1, 2, 9, true),
            (3, 2, 11, false),
            (1, 2, 12, false),
            (1, 3, 5, false)
        ]
    );
}

#[test]
fn a_follower_acknowledges_entries_only_after_its_fsync_ends() {
    let Trio {
        disks,
        mut out,
        now,
        mut nodes,
        leader,
        follower,
    } = trio_with_a_slow_follower();
    nodes[leader].request(
        now,
        9,
        Request::Acquire {
            wait_s: 0,
            lease_s: 5,
            owner: 1,
            key: "k",
        },
        &mut out,
    );
    nodes[leader].end_turn(now, &mut out).unwrap();
    let appends: Vec<Message> = nodes[leader]
        .take_messages()
        .into_iter()
        .filter(|m| m.msg_type == MessageType::MsgAppend && m.to == follower as u64 + 1)
        .collect();
    assert!(!appends.is_empty(), "the leader replicates at once");
    for m in appends {
        nodes[follower].step(m);
    }
    for _ in 0..3 {
        nodes[follower].tick(now, &mut out);
        nodes[follower].end_turn(now, &mut out).unwrap();
    }
    let acks = |msgs: &[Message]| {
        msgs.iter()
            .filter(|m| m.msg_type == MessageType::MsgAppendResponse)
            .count()
    };
    let early = nodes[follower].take_messages();
    assert_eq!(acks(&early), 0, "no ack while the fsync runs: {early:?}");
    assert!(
        disks[follower].unsynced() > 0,
        "the entries are written, not durable"
    );
    disks[follower].hold_syncs(false);
    nodes[follower].tick(now, &mut out);
    nodes[follower].end_turn(now, &mut out).unwrap();
    let late = nodes[follower].take_messages();
    assert!(acks(&late) > 0, "the ack goes once the fsync ended");
    assert_eq!(disks[follower].unsynced(), 0);
    // The third node never heard of it; this ack commits the grant.
    for m in late {
        nodes[leader].step(m);
    }
    nodes[leader].end_turn(now, &mut out).unwrap();
    for _ in 0..5 {
        nodes[leader].tick(now, &mut out);
        nodes[leader].end_turn(now, &mut out).unwrap();
    }
    assert!(
        out.iter()
            .any(|a| format!("{:?}", a.reply).starts_with("Acquired")),
        "granted after a quorum made it durable"
    );
}

#[test]
fn a_turns_requests_travel_in_one_forward_and_one_append_per_follower() {
    let Elected {
        disks: _,
        mut out,
        now,
        leader,
        mut nodes,
    } = elected_three();
    let follower = (leader + 1) % 3;
    let keys: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
    out.clear();
    // Five acquires in one turn of a follower: one forward.
    for (i, key) in keys.iter().enumerate() {
        let req = Request::Acquire {
            wait_s: 0,
            lease_s: 30,
            owner: i as u64,
            key,
        };
        nodes[follower].request(now, i as ConnId, req, &mut out);
    }
    nodes[follower].end_turn(now, &mut out).unwrap();
    let sent = nodes[follower].take_messages();
    let forwards: Vec<&Message> = sent
        .iter()
        .filter(|m| m.msg_type == MessageType::MsgPropose)
        .collect();
    assert_eq!(forwards.len(), 1, "one forward: {sent:?}");
    assert_eq!(forwards[0].entries.len(), 5);
    for m in sent {
        let to = usize::try_from(m.to).unwrap() - 1;
        nodes[to].step(m);
    }
    // The leader appends them together: one append per follower.
    nodes[leader].end_turn(now, &mut out).unwrap();
    let sent = nodes[leader].take_messages();
    for f in (0..3).filter(|&f| f != leader) {
        let appends: Vec<&Message> = sent
            .iter()
            .filter(|m| m.msg_type == MessageType::MsgAppend && m.to == f as u64 + 1)
            .collect();
        assert_eq!(appends.len(), 1, "one append to node {}: {sent:?}", f + 1);
        assert_eq!(appends[0].entries.len(), 5);
    }
    for m in sent {
        let to = usize::try_from(m.to).unwrap() - 1;
        nodes[to].step(m);
    }
    for _ in 0..5 {
        settle_net(&mut nodes, now, &mut out);
    }
    // Each request applied once and is answered once, in order.
    let granted: Vec<u64> = out
        .iter()
        .filter_map(|a| match a.reply {
            Reply::Acquired { owner, .. } => Some(owner),
            _ => None,
        })
        .collect();
    assert_eq!(granted, vec![0, 1, 2, 3, 4]);
}

#[test]
fn a_batch_raft_drops_is_answered_busy_and_not_released() {
    let Elected {
        disks: _,
        mut out,
        now,
        leader,
        mut nodes,
    } = elected_three();
    let follower = (leader + 1) % 3;
    out.clear();
    nodes[follower].request(
        now,
        7,
        Request::Acquire {
            wait_s: 0,
            lease_s: 30,
            owner: 9,
            key: "a",
        },
        &mut out,
    );
    nodes[follower].request(now, 8, Request::Release { token: 3, key: "b" }, &mut out);
    assert!(out.is_empty(), "nothing is answered before the turn ends");
    // The follower loses its leader within the turn (a newer term,
    // no leader known yet): raft drops the proposal.
    let term = nodes[follower].term() + 1;
    nodes[follower].rn.raft.become_follower(term, 0);
    nodes[follower].end_turn(now, &mut out).unwrap();
    let replies: Vec<String> = out.iter().map(|a| format!("{:?}", a.reply)).collect();
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert!(replies[0].starts_with("Busy"), "{replies:?}");
    assert!(replies[1].starts_with("NotReleased"), "{replies:?}");
    assert_eq!(nodes[follower].pending_requests(), 0, "forgotten");
    assert!(!nodes[follower]
        .take_messages()
        .iter()
        .any(|m| m.msg_type == MessageType::MsgPropose));
}

/// Three clients of `follower`: an acquire that is granted, an acquire of
/// a key that is held (wait 0: not granted) and a release of a token that
/// is not held; they commit and apply while the follower is cut off.
fn follower_requests_commit_without_it(
    nodes: &mut [Node<MemDisk>],
    leader: usize,
    follower: usize,
    now: Millis,
    out: &mut Outbox,
) {
    nodes[leader].request(now, 1, acquire(1, "held"), out);
    settle_net(nodes, now, out);
    out.clear();
    nodes[follower].request(now, 7, acquire(2, "free"), out);
    nodes[follower].request(now, 8, acquire(2, "held"), out);
    nodes[follower].request(now, 9, Request::Release { token: 1, key: "b" }, out);
    nodes[follower].end_turn(now, out).unwrap();
    // The forward reaches the leader, then the follower stops hearing
    // from it: the three requests commit and apply without it.
    let forward: Vec<Message> = nodes[follower].take_messages();
    assert!(forward
        .iter()
        .any(|m| m.msg_type == MessageType::MsgPropose));
    for m in forward {
        let to = usize::try_from(m.to).unwrap() - 1;
        nodes[to].step(m);
    }
    settle_cut(nodes, Some(follower), now, out);
    assert!(
        !out.iter().any(|a| (7..=9).contains(&a.conn)),
        "only the follower answers its clients"
    );
    assert_eq!(nodes[follower].pending_requests(), 3);
}

// Long because it is one scenario, step by step.
#[test]
fn requests_applied_inside_an_installed_snapshot_are_answered_or_their_connection_closed() {
    let Elected {
        disks: _,
        mut out,
        mut now,
        leader,
        mut nodes,
    } = elected_three();
    let follower = (leader + 1) % 3;
    // The leader syncs every batch, so that it and the third node commit
    // at once while the follower is cut off.
    nodes[leader].cfg.leader_sync_ms = 0;
    out.clear();
    follower_requests_commit_without_it(&mut nodes, leader, follower, now, &mut out);
    // The leader compacts its log through them: the follower can only
    // catch up from a snapshot that covers its own requests.
    nodes[leader].snapshot_now = true;
    nodes[leader].request(now, 2, acquire(2, "other"), &mut out);
    settle_cut(&mut nodes, Some(follower), now, &mut out);
    assert!(nodes[leader].snapshot_index() > nodes[follower].applied());
    out.clear();
    for _ in 0..50 {
        now = now.add_ms(100);
        settle_net(&mut nodes, now, &mut out);
        if nodes[follower].pending_requests() == 0 {
            break;
        }
    }
    assert!(
        nodes[follower].stats().snapshots_installed >= 1,
        "caught up by snapshot"
    );
    assert_eq!(
        nodes[follower].pending_requests(),
        0,
        "nothing left waiting"
    );
    let replies: Vec<(ConnId, String)> = out
        .iter()
        .map(|a| (a.conn, format!("{:?}", a.reply)))
        .filter(|(c, _)| (7..=9).contains(c))
        .collect();
    let mut closes = Vec::new();
    nodes[follower].take_closes(&mut closes);
    closes.sort_unstable();
    // The grant is still current: it is the answer. The other two
    // answers went with the entries: their connections are closed.
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].0, 7, "{replies:?}");
    assert!(replies[0].1.starts_with("Acquired"), "{replies:?}");
    assert_eq!(
        closes,
        vec![8, 9],
        "every other request's connection is closed"
    );
    assert_eq!(nodes[follower].stats().unanswerable, 2);
}

/// `leader` (node `me`) left through a joint configuration, stepped down,
/// and the other two elected a new leader and forgot its address.
fn assert_left_and_forgotten(nodes: &[Node<MemDisk>], leader: usize, me: u64) {
    assert!(!nodes[leader].is_leader(), "stepped down after the leave");
    assert!(nodes[leader].removed());
    let hist = nodes[leader].conf_history();
    assert_eq!(hist.len(), 2, "enter, then leave: {hist:?}");
    assert!(hist[0].voters_outgoing.contains(&me) && !hist[0].voters.contains(&me));
    assert!(hist[1].voters_outgoing.is_empty() && !hist[1].voters.contains(&me));
    let new_leader = nodes
        .iter()
        .position(Node::is_leader)
        .expect("a new leader");
    assert_ne!(new_leader, leader);
    for (i, n) in nodes.iter().enumerate().filter(|(i, _)| *i != leader) {
        assert_eq!(
            n.rn.raft.prs().conf().to_conf_state().voters.len(),
            2,
            "node {}",
            i + 1
        );
        assert!(
            n.replicated_members().addr(me).is_none(),
            "address forgotten"
        );
    }
}

// Long because it is one scenario, step by step.
#[test]
fn a_leader_removes_itself_through_a_joint_configuration_that_survives_a_restart() {
    let Elected {
        disks,
        mut out,
        mut now,
        leader,
        mut nodes,
    } = elected_three();
    let me = leader as u64 + 1;
    let all: BTreeSet<u64> = [1, 2, 3].into();
    nodes[leader]
        .change_members(Change::Remove(me, false), &all)
        .expect("proposed");
    let (mut led_while_joint, mut refused, mut restarted) = (false, false, false);
    for _ in 0..400 {
        let mut any = false;
        for i in 0..nodes.len() {
            for m in nodes[i].take_messages() {
                any = true;
                let to = usize::try_from(m.to).unwrap() - 1;
                nodes[to].step(m);
            }
        }
        if !any {
            now = now.add_ms(100);
        }
        for n in nodes.iter_mut() {
            n.tick(now, &mut out);
            n.end_turn(now, &mut out).unwrap();
        }
        if nodes[leader].is_leader() && !nodes[leader].voters_outgoing().is_empty() {
            led_while_joint = true;
            // A second change waits for the leave (409, see members).
            refused = nodes[leader].conf_change_pending();
            assert!(refused, "a change is in progress until the leave applies");
        }
        // A follower that restarts while joint reads the joint
        // configuration back (outgoing voters, auto leave).
        let f = (leader + 1) % 3;
        if !restarted && !nodes[f].voters_outgoing().is_empty() {
            let cs = nodes[f].rn.raft.prs().conf().to_conf_state();
            nodes[f] = Node::open(
                NodeConfig::new(f as u64 + 1, vec![1, 2, 3]),
                disks[f].clone(),
                &quiet_logger(),
            )
            .expect("reopens");
            assert_eq!(nodes[f].rn.raft.prs().conf().to_conf_state(), cs);
            assert!(cs.auto_leave && cs.voters_outgoing.contains(&me), "{cs:?}");
            restarted = true;
        }
        let done = nodes.iter().enumerate().all(|(i, n)| {
            i == leader
                || n.voters_outgoing().is_empty() && !n.rn.raft.prs().conf().voters().contains(me)
        });
        if done && nodes.iter().any(Node::is_leader) && restarted {
            break;
        }
    }
    assert!(
        led_while_joint && refused && restarted,
        "saw the joint configuration"
    );
    assert_left_and_forgotten(&nodes, leader, me);
}

#[test]
fn the_wal_check_refuses_a_gap_and_a_falling_term() {
    use super::ready::entries_follow_on;
    let e = |index, term| Entry {
        index,
        term,
        ..Entry::default()
    };
    assert!(entries_follow_on(&[]));
    assert!(entries_follow_on(&[e(7, 2)]));
    assert!(entries_follow_on(&[e(7, 2), e(8, 2), e(9, 3)]));
    assert!(!entries_follow_on(&[e(7, 2), e(9, 2)]), "a gap");
    assert!(!entries_follow_on(&[e(7, 2), e(7, 2)]), "a repeated index");
    assert!(!entries_follow_on(&[e(7, 3), e(8, 2)]), "a falling term");
}

#[test]
fn applied_conf_changes_keep_raft_and_the_members_in_agreement() {
    let Elected { nodes, .. } = elected_three();
    for n in &nodes {
        assert!(n.conf_agrees_with_members());
    }
    // A removed id that is still an incoming voter is what the check
    // refuses.
    let mut n = nodes.into_iter().next().expect("a node");
    let mut cc = ConfChangeV2::default();
    let mut single = ConfChangeSingle::default();
    single.set_change_type(ConfChangeType::RemoveNode);
    single.node_id = 2;
    cc.changes.push(single);
    n.sm.members_mut().apply(&cc);
    assert!(!n.conf_agrees_with_members());
}

/// An acquire of `key` for 30 s by `owner`, waiting 0.
fn acquire(owner: u64, key: &str) -> Request<'_> {
    Request::Acquire {
        wait_s: 0,
        lease_s: 30,
        owner,
        key,
    }
}

/// The replies `out` holds for connection `conn`, as text.
fn replies_to(out: &Outbox, conn: ConnId) -> Vec<String> {
    out.iter()
        .filter(|a| a.conn == conn)
        .map(|a| format!("{:?}", a.reply))
        .collect()
}

#[test]
fn a_leader_whose_followers_commit_without_it_answers_before_its_own_fsync() {
    let Elected {
        disks,
        mut out,
        now,
        mut nodes,
        leader,
    } = elected_three();
    nodes[leader].cfg.leader_sync_ms = 1000;
    disks[leader].hold_syncs(true);
    let syncs = nodes[leader].stats().syncs;
    out.clear();
    nodes[leader].request(now, 9, acquire(1, "k"), &mut out);
    nodes[leader].end_turn(now, &mut out).unwrap();
    settle_net(&mut nodes, now, &mut out);
    let r = replies_to(&out, 9);
    assert!(r.len() == 1 && r[0].starts_with("Acquired"), "{r:?}");
    // Both followers hold the entry durably; the leader neither synced nor
    // counted itself, and raft has not handed it the entry.
    assert_eq!(nodes[leader].stats().syncs, syncs, "no fsync of its own");
    let (persisted, raft_applied) = {
        let log = &nodes[leader].rn.raft.raft_log;
        (log.persisted, log.applied)
    };
    assert!(
        persisted < nodes[leader].applied(),
        "applied past its durable log"
    );
    assert!(raft_applied < nodes[leader].applied());
    let token = nodes[leader].state_machine().holder("k").expect("held");
    for n in &nodes {
        assert_eq!(n.state_machine().holder("k"), Some(token));
    }
    // Its interval over, it syncs; raft hands the entry out again, which
    // changes nothing, and its applied index catches up.
    disks[leader].hold_syncs(false);
    let later = now.add_ms(1000);
    assert!(
        nodes[leader].next_deadline() <= later,
        "it wakes for the fsync"
    );
    turns(&mut nodes[leader], later, &mut out, 3);
    assert_eq!(nodes[leader].stats().syncs, syncs + 1);
    assert_eq!(disks[leader].unsynced(), 0);
    let log = &nodes[leader].rn.raft.raft_log;
    assert_eq!(log.applied, nodes[leader].applied());
    assert_eq!(nodes[leader].state_machine().holder("k"), Some(token));
    assert_eq!(replies_to(&out, 9).len(), 1, "answered once");
}

#[test]
fn a_leader_syncs_at_once_when_its_followers_alone_are_no_majority() {
    let Elected {
        disks: _,
        mut out,
        mut now,
        mut nodes,
        leader,
    } = elected_three();
    nodes[leader].cfg.leader_sync_ms = 60_000;
    let gone = (leader + 1) % 3;
    // Long enough for raft's quorum check to count the silent follower
    // out (an election timeout is 10 ticks).
    for _ in 0..25 {
        now = now.add_ms(100);
        settle_cut(&mut nodes, Some(gone), now, &mut out);
    }
    assert!(nodes[leader].is_leader());
    let syncs = nodes[leader].stats().syncs;
    out.clear();
    nodes[leader].request(now, 9, acquire(1, "k"), &mut out);
    nodes[leader].end_turn(now, &mut out).unwrap();
    settle_cut(&mut nodes, Some(gone), now, &mut out);
    let r = replies_to(&out, 9);
    assert!(r.len() == 1 && r[0].starts_with("Acquired"), "{r:?}");
    assert!(
        nodes[leader].stats().syncs > syncs,
        "its own fsync made the majority"
    );
}

#[test]
fn a_leader_that_applied_ahead_and_lost_its_unsynced_log_catches_up() {
    let Elected {
        disks,
        mut out,
        mut now,
        mut nodes,
        leader,
    } = elected_three();
    nodes[leader].cfg.leader_sync_ms = 60_000;
    disks[leader].hold_syncs(true);
    out.clear();
    for (i, key) in ["a", "b", "c"].into_iter().enumerate() {
        nodes[leader].request(now, 9, acquire(i as u64 + 1, key), &mut out);
        nodes[leader].end_turn(now, &mut out).unwrap();
        settle_net(&mut nodes, now, &mut out);
    }
    assert_eq!(replies_to(&out, 9).len(), 3);
    let applied = nodes[leader].applied();
    assert!(nodes[leader].rn.raft.raft_log.persisted < applied);
    // Power cut: the leader's unsynced tail is gone; its disk is back to
    // normal speed after the restart.
    disks[leader].crash(0);
    disks[leader].hold_syncs(false);
    let id = leader as u64 + 1;
    nodes[leader] = Node::open(
        NodeConfig::new(id, vec![1, 2, 3]),
        disks[leader].clone(),
        &quiet_logger(),
    )
    .expect("reopens");
    assert!(
        nodes[leader].rn.raft.raft_log.last_index() < applied,
        "lost"
    );
    for _ in 0..100 {
        now = now.add_ms(100);
        settle_net(&mut nodes, now, &mut out);
        if nodes.iter().all(|n| n.applied() >= applied) {
            break;
        }
    }
    for key in ["a", "b", "c"] {
        let holders: Vec<Option<u64>> = nodes
            .iter()
            .map(|n| n.state_machine().holder(key))
            .collect();
        assert!(
            holders[0].is_some() && holders.iter().all(|h| *h == holders[0]),
            "{key}: {holders:?}"
        );
    }
}

/// raft's count of uncommitted bytes on a leader that deferred its fsync
/// and compacted its log through entries raft had not handed out yet.
fn uncommitted_bytes_after_compactions(leader_sync_ms: u64) -> (usize, u64) {
    let Elected {
        disks: _,
        mut out,
        mut now,
        mut nodes,
        leader,
    } = elected_three();
    nodes[leader].cfg.leader_sync_ms = leader_sync_ms;
    nodes[leader].cfg.snapshot_every = 5;
    out.clear();
    let keys: Vec<String> = (0..200).map(|i| format!("key-{i:04}")).collect();
    for (i, key) in keys.iter().enumerate() {
        nodes[leader].request(now, 9, acquire(i as u64 + 1, key), &mut out);
        nodes[leader].end_turn(now, &mut out).unwrap();
        settle_net(&mut nodes, now, &mut out);
        now = now.add_ms(1);
    }
    // Time passes: every entry is synced, committed and handed out.
    for _ in 0..30 {
        now = now.add_ms(100);
        settle_net(&mut nodes, now, &mut out);
    }
    assert!(nodes[leader].is_leader());
    assert_eq!(replies_to(&out, 9).len(), 200);
    let n = &nodes[leader];
    (n.rn.raft.uncommitted_size(), n.stats().snapshots_taken)
}

#[test]
fn compacting_past_entries_raft_has_not_handed_out_leaves_no_uncommitted_bytes() {
    for ms in [0, 5] {
        let (bytes, snapshots) = uncommitted_bytes_after_compactions(ms);
        assert!(
            snapshots > 10,
            "--leader-sync-ms {ms}: {snapshots} snapshots"
        );
        assert_eq!(bytes, 0, "--leader-sync-ms {ms}: uncommitted bytes left");
    }
}

mod bind;
mod close;
mod guard;
mod permits;

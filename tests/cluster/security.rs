//! Peer security with real processes: every attack on a plaintext loopback
//! cluster described in docs/SECURITY.md (forged hellos, a stolen first
//! contact, a burst of forged first contacts while the nodes start, forged
//! Raft messages, messages raft would panic on from an impostor that knows
//! a dead node's ids, a flood of idle connections) leaves every node
//! running, the real peers connected and the cluster granting.
#![cfg(feature = "cluster")]

use ticketd_testkit::cluster;

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster::{assert_serves, Cluster};
use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};
use ticketd::cluster::transport::{hash64, Hello, MEMBERSHIP_MARK};

/// The hello a node of `c` would send, with the given fields.
fn hello(c: &Cluster, from: u64, from_uuid: u64, to: u64, to_uuid: u64) -> Vec<u8> {
    Hello {
        cluster: hash64(&[c.name.as_bytes()]),
        voters: MEMBERSHIP_MARK,
        from,
        from_uuid,
        to,
        to_uuid,
    }
    .encode()
}

fn frame(m: &Message) -> Vec<u8> {
    let b = m.write_to_bytes().unwrap();
    let mut v = u32::try_from(b.len()).unwrap().to_be_bytes().to_vec();
    v.extend_from_slice(&b);
    v
}

fn wait_for(what: &str, c: &Cluster, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}:\n{}", c.logs());
}

#[test]
fn a_forged_hello_with_a_made_up_to_uuid_stops_no_node() {
    let mut c = Cluster::new("forged", 3);
    c.start_all();
    assert_serves(&c, 0, "before");
    for i in 0..3 {
        let to = i as u64 + 1;
        let from = to % 3 + 1;
        let mut s = TcpStream::connect(c.peer_addr(i)).unwrap();
        s.write_all(&hello(&c, from, 0x1234, to, 0xdead_beef))
            .unwrap();
    }
    wait_for("the refusals", &c, || {
        c.logs().matches("refusing it").count() >= 3
    });
    c.assert_all_running();
    for i in 0..3 {
        assert_serves(&c, i, &format!("after{i}"));
    }
    c.assert_all_running();
}

#[test]
fn a_stolen_first_contact_does_not_lock_the_real_node_out() {
    let mut c = Cluster::new("theft", 3);
    // Node 2 starts alone; a stranger claims to be node 1 before node 1
    // ever connects, with and without a guess of node 2's directory id.
    c.start_node(1);
    let mut s = TcpStream::connect(c.peer_addr(1)).unwrap();
    s.write_all(&hello(&c, 1, 0x5151, 2, 0)).unwrap();
    let mut s2 = TcpStream::connect(c.peer_addr(1)).unwrap();
    s2.write_all(&hello(&c, 1, 0x5151, 2, 0x9999)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // The real node 1 joins: nodes 1 and 2 are a majority.
    c.start_node(0);
    assert_serves(&c, 0, "theft");
    wait_for("node 2 pinning the real node 1", &c, || {
        c.node(1).log().contains("peer 1 authenticated")
    });
    // Node 1 restarts and is still welcome; nobody stopped.
    c.kill(0);
    c.start_node(0);
    assert_serves(&c, 0, "theft-again");
    c.assert_all_running();
    assert!(!c.node(0).log().contains("refusing it"), "{}", c.logs());
}

#[test]
fn forged_raft_messages_from_an_unauthenticated_connection_are_dropped() {
    let mut c = Cluster::new("heartbeat", 3);
    // Nodes 1 and 2 run; node 3 never started, so nothing is pinned for
    // it and a stranger can present a hello in its name.
    c.start_node(0);
    c.start_node(1);
    assert_serves(&c, 0, "hb");
    let (term, _) = c.leader_term().expect("a leader");
    for i in 0..2 {
        let to = i as u64 + 1;
        let mut s = TcpStream::connect(c.peer_addr(i)).unwrap();
        s.write_all(&hello(&c, 3, 0x3333, to, 0)).unwrap();
        for t in [
            MessageType::MsgHeartbeat,
            MessageType::MsgAppend,
            MessageType::MsgRequestVote,
        ] {
            let m = Message {
                msg_type: t,
                from: 3,
                to,
                term: 1000,
                ..Default::default()
            };
            s.write_all(&frame(&m)).unwrap();
        }
        // And a message in another node's name on the same connection.
        let m = Message {
            msg_type: MessageType::MsgHeartbeat,
            from: 2,
            to,
            term: 1000,
            ..Default::default()
        };
        s.write_all(&frame(&m)).unwrap();
    }
    wait_for("the drops", &c, || {
        c.logs().matches("peer message dropped").count() >= 2
    });
    assert_serves(&c, 1, "hb-after");
    let (after, _) = c.leader_term().expect("a leader");
    assert_eq!(after, term, "no new term:\n{}", c.logs());
    assert!(!c.logs().contains("term 100"), "{}", c.logs());
    c.assert_all_running();
}

#[test]
fn a_hundred_idle_peer_connections_do_not_stop_an_election() {
    let mut c = Cluster::new("flood", 3);
    c.start_all();
    assert_serves(&c, 0, "flood");
    let mut idle = Vec::new();
    for i in 0..3 {
        for _ in 0..100 {
            idle.push(TcpStream::connect(c.peer_addr(i)).unwrap());
        }
    }
    let (term, leader) = c.leader_term().expect("a leader");
    c.kill(leader);
    // Keep the flood up while the others elect, and the killed node
    // comes back into full slots.
    wait_for("a new leader", &c, || {
        c.leader_term().is_some_and(|(t, _)| t > term)
    });
    let other = (leader + 1) % 3;
    assert_serves(&c, other, "flood-after");
    c.start_node(leader);
    for _ in 0..100 {
        idle.push(TcpStream::connect(c.peer_addr(other)).unwrap());
    }
    assert_serves(&c, leader, "flood-back");
    c.assert_all_running();
    drop(idle);
}

/// Sends forged first-contact hellos to every node of `c` for `burst`: each
/// in the name of another member, with a made-up data directory id and no
/// (or a made-up) id for the receiver, each on a connection of its own,
/// until `stop` is set.
fn forge_first_contacts(
    c: &Cluster,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> std::thread::JoinHandle<u64> {
    let n = c.nodes.len();
    let addrs: Vec<_> = (0..n).map(|i| c.peer_addr(i)).collect();
    let cluster = hash64(&[c.name.as_bytes()]);
    std::thread::spawn(move || {
        let mut rng = ticketd_testkit::rng::SplitMix64::new(seed);
        let mut sent = 0;
        while !stop.load(Ordering::Relaxed) {
            for (i, addr) in addrs.iter().enumerate() {
                let to = i as u64 + 1;
                let from = (to + rng.below(n as u64 - 1)) % n as u64 + 1;
                let to_uuid = if rng.chance(0.5) { 0 } else { rng.next_u64() };
                let h = Hello {
                    cluster,
                    voters: MEMBERSHIP_MARK,
                    from,
                    from_uuid: rng.next_u64(),
                    to,
                    to_uuid,
                }
                .encode();
                // A node not started yet refuses: that is part of the burst.
                if let Ok(mut s) = TcpStream::connect(addr) {
                    let _ = s.write_all(&h);
                    sent += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        sent
    })
}

#[test]
fn a_burst_of_forged_first_contacts_does_not_keep_a_fresh_cluster_from_forming() {
    let mut c = Cluster::new("burst", 3);
    let stop = Arc::new(AtomicBool::new(false));
    let burst = forge_first_contacts(&c, stop.clone(), 0x5eed);
    // The burst runs while the nodes start, and 0.4 s on.
    c.start_all();
    std::thread::sleep(Duration::from_millis(400));
    stop.store(true, Ordering::Relaxed);
    let sent = burst.join().unwrap();
    assert!(sent > 0, "the burst reached no node");
    // Bounded: an election or two once the burst is over.
    let deadline = Instant::now() + Duration::from_secs(15);
    while c.leader().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        c.leader().is_some(),
        "no leader {sent} hellos later:\n{}",
        c.logs()
    );
    for i in 0..3 {
        assert_serves(&c, i, &format!("burst{i}"));
    }
    c.assert_all_running();
}

/// The data directory id of node `i` of `c` (stopped), and the ids it has
/// pinned for its peers: what the files of a node give whoever can read
/// them.
fn identity(c: &Cluster, i: usize) -> ticketd::cluster::log::Identity {
    let disk = ticketd::cluster::log::FileDisk::open(&c.dirs[i].0).unwrap();
    let (wal, _) = ticketd::cluster::log::Wal::open(disk).unwrap();
    wal.identity().clone()
}

#[test]
fn an_authenticated_impostor_of_a_dead_node_cannot_crash_the_leader() {
    let mut c = Cluster::new("impostor", 3);
    c.start_all();
    assert_serves(&c, 0, "before");
    let leader = c.wait_leader();
    let dead = (leader + 1) % 3;
    wait_for("the dead-to-be node pinning the leader", &c, || {
        c.node(dead)
            .log()
            .contains(&format!("peer {} authenticated", leader + 1))
    });
    let (term, _) = c.leader_term().unwrap();
    c.kill(dead);
    // A local process takes the dead node's peer port and speaks for it
    // with the ids from its data directory: the leader authenticates it.
    let id = identity(&c, dead);
    let _port = std::net::TcpListener::bind(c.peer_addr(dead)).unwrap();
    let (me, to) = (dead as u64 + 1, leader as u64 + 1);
    let mut s = TcpStream::connect(c.peer_addr(leader)).unwrap();
    s.write_all(&hello(&c, me, id.uuid, to, id.peers[&to]))
        .unwrap();
    let forged = |t: MessageType, term: u64| Message {
        msg_type: t,
        from: me,
        to,
        term,
        ..Default::default()
    };
    // A heartbeat of a newer term committing far past the leader's log
    // (raft-rs panics in `commit_to`), an append past its log with
    // previous term 0, and a proposal and a read request without entries.
    for m in [
        Message {
            commit: 1_000_000_000,
            ..forged(MessageType::MsgHeartbeat, term + 1)
        },
        Message {
            index: 1_000_000_000,
            commit: 1_000_000_000,
            ..forged(MessageType::MsgAppend, term + 1)
        },
        forged(MessageType::MsgPropose, 0),
        forged(MessageType::MsgReadIndex, 0),
    ] {
        s.write_all(&frame(&m)).unwrap();
    }
    wait_for("the drops", &c, || {
        c.node(leader).log().contains("(4 refused so far")
    });
    let log = c.node(leader).log();
    for kind in ["MsgHeartbeat", "MsgAppend", "MsgPropose", "MsgReadIndex"] {
        assert!(log.contains(&format!("dropped {kind} from {me}")), "{log}");
    }
    c.assert_all_running();
    assert_serves(&c, leader, "after");
    let (after, now_leader) = c.leader_term().unwrap();
    assert_eq!((after, now_leader), (term, leader), "{}", c.logs());
}

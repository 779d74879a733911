//! First contact in plaintext: what forged hellos can and cannot do to what
//! a node remembers of its peers (docs/SECURITY.md, "Plaintext peers").

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use super::{Hello, LocalInfo, Transport};
use crate::time::Millis;

/// Node `id` with data directory id `uuid`, peers not yet known.
fn node(id: u64, uuid: u64, peers: &[(u64, SocketAddr)]) -> Transport {
    let local = LocalInfo {
        id,
        cluster: 1,
        voters: 1,
        uuid,
        known: BTreeMap::new(),
    };
    let peers: BTreeMap<u64, SocketAddr> = peers.iter().copied().collect();
    Transport::bind(local, "127.0.0.1:0".parse().unwrap(), &peers).unwrap()
}

fn hello(from: u64, from_uuid: u64, to: u64, to_uuid: u64) -> Vec<u8> {
    Hello {
        cluster: 1,
        voters: 1,
        from,
        from_uuid,
        to,
        to_uuid,
    }
    .encode()
}

/// Runs both nodes' loops for up to `turns` turns of 10 ms (their clock),
/// until `done` holds; whether it did. Without `connect` nobody connects
/// out: the nodes only read.
fn run(
    nodes: &mut [(mio::Poll, Transport); 2],
    turns: u64,
    connect: bool,
    mut done: impl FnMut(&[(mio::Poll, Transport); 2]) -> bool,
) -> bool {
    let mut events = mio::Events::with_capacity(64);
    for turn in 0..turns {
        let now = Millis(turn * 10);
        for (poll, t) in nodes.iter_mut() {
            if connect {
                t.tick(now, poll.registry());
                t.flush(now, poll.registry());
            }
            poll.poll(&mut events, Some(Duration::from_millis(1)))
                .unwrap();
            for e in &events {
                t.event(now, poll.registry(), e);
            }
            let _ = t.take_events();
        }
        if done(nodes) {
            return true;
        }
    }
    false
}

/// Nodes 1 (data directory id 11) and 2 (id 22), each pointing at the
/// other's listener, registered, not yet connected.
fn pair() -> [(mio::Poll, Transport); 2] {
    let mut t2 = node(2, 22, &[(1, "127.0.0.1:9".parse().unwrap())]);
    let t1 = node(1, 11, &[(2, t2.local_addr().unwrap())]);
    let to1 = [(1, t1.local_addr().unwrap())].into_iter().collect();
    assert!(t2.set_peers(&to1, Millis(0), None));
    let mut nodes = [
        (mio::Poll::new().unwrap(), t1),
        (mio::Poll::new().unwrap(), t2),
    ];
    for (poll, t) in &mut nodes {
        t.register(poll.registry(), 0).unwrap();
    }
    nodes
}

#[test]
fn forged_first_contacts_on_both_sides_do_not_keep_two_peers_apart() {
    let mut nodes = pair();
    // Before the real peers ever connect, a stranger introduces each to
    // the other with a made-up data directory id. Each node echoes it in
    // its hello to the other, which is then not authenticated: the real
    // id in that hello must still get through.
    let a1 = nodes[0].1.local_addr().unwrap();
    let a2 = nodes[1].1.local_addr().unwrap();
    let mut s1 = std::net::TcpStream::connect(a1).unwrap();
    s1.write_all(&hello(2, 0xbad2, 1, 0)).unwrap();
    let mut s2 = std::net::TcpStream::connect(a2).unwrap();
    s2.write_all(&hello(1, 0xbad1, 2, 0)).unwrap();
    let poisoned = run(&mut nodes, 50, false, |n| {
        n[0].1.unconfirmed.get(&2) == Some(&0xbad2) && n[1].1.unconfirmed.get(&1) == Some(&0xbad1)
    });
    assert!(poisoned, "the forged hellos were read");
    let met = run(&mut nodes, 500, true, |n| {
        n[0].1.local.known.get(&2) == Some(&22)
            && n[1].1.local.known.get(&1) == Some(&11)
            && n.iter().all(|(_, t)| t.authenticated_inbound() == 1)
    });
    assert!(
        met,
        "node 1 knows {:?} (hint {:?}), node 2 knows {:?} (hint {:?})",
        nodes[0].1.local.known,
        nodes[0].1.unconfirmed,
        nodes[1].1.local.known,
        nodes[1].1.unconfirmed
    );
    assert!(nodes.iter().all(|(_, t)| t.unconfirmed.is_empty()));
}

#[test]
fn a_refused_hello_changes_nothing_a_node_remembers() {
    let [(mut poll, mut t), _] = pair();
    t.set_known(2, 22);
    let at = t.local_addr().unwrap();
    for bad in [
        hello(2, 0xbad, 1, 11), // not the pinned id
        hello(2, 0xbad, 1, 0),  // the same, no knowledge of us
        hello(3, 0xbad, 1, 11), // not a member
        hello(2, 22, 3, 11),    // not for this node
        Hello {
            cluster: 9,
            ..Hello::decode(&hello(2, 22, 1, 11)[4..]).unwrap()
        }
        .encode(),
    ] {
        let mut s = std::net::TcpStream::connect(at).unwrap();
        s.write_all(&bad).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut events = mio::Events::with_capacity(16);
        for _ in 0..5 {
            poll.poll(&mut events, Some(Duration::from_millis(20)))
                .unwrap();
            for e in &events {
                t.event(Millis(0), poll.registry(), e);
            }
        }
        let mut b = [0u8; 1];
        assert_eq!(s.read(&mut b).unwrap(), 0, "refused: closed");
        assert_eq!(t.local.known, [(2, 22)].into_iter().collect());
        assert!(t.unconfirmed.is_empty(), "{:?}", t.unconfirmed);
        assert_eq!(t.authenticated_inbound(), 0);
        assert!(t.take_events().is_empty());
    }
}

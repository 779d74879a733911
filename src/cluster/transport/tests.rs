//! Transport tests: hellos, framing, connects and timeouts, shipping
//! messages between two transports over loopback.

use std::io::{Read, Write};

use protobuf::Message as _;
use raft::eraftpb::MessageType;

use super::encode::{decode_message, encode_entries, SHARED_DECODE_BYTES};
use super::frame::HELLO_LEN;
use super::outbound::BACKOFF_MIN_MS;
use super::*;

#[test]
fn hello_roundtrips_and_rejects_garbage() {
    let h = Hello {
        cluster: 1,
        voters: 2,
        from: 3,
        from_uuid: 4,
        to: 5,
        to_uuid: 6,
    };
    let b = h.encode();
    assert_eq!(b.len(), 4 + HELLO_LEN);
    assert_eq!(Hello::decode(&b[4..]), Ok(h));
    assert!(Hello::decode(&b[4..b.len() - 1]).is_err());
    let mut bad = b[4..].to_vec();
    bad[0] = b'X';
    assert!(Hello::decode(&bad).is_err());
    bad[0] = b'T';
    bad[4] = 9;
    assert!(Hello::decode(&bad).is_err());
}

/// A listener whose accept queue is full: the kernel drops further
/// SYNs, so a connect to it stays in progress.
fn blackhole() -> (socket2::Socket, std::net::TcpStream, SocketAddr) {
    use socket2::{Domain, Socket, Type};
    let l = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    l.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    l.listen(0).unwrap();
    let addr = l.local_addr().unwrap().as_socket().unwrap();
    // Never accepted: with a backlog of 0 this one fills the queue.
    let filler = std::net::TcpStream::connect(addr).unwrap();
    (l, filler, addr)
}

fn msg(t: MessageType) -> Message {
    Message {
        msg_type: t,
        from: 1,
        to: 2,
        ..Default::default()
    }
}

#[test]
fn a_connect_nobody_answers_reports_the_peer_unreachable_and_retries() {
    let (_l, _filler, dead) = blackhole();
    let mut poll = mio::Poll::new().unwrap();
    let local = LocalInfo {
        id: 1,
        cluster: 1,
        voters: 1,
        uuid: 1,
        known: BTreeMap::new(),
    };
    let peers: BTreeMap<u64, SocketAddr> = [(1, "127.0.0.1:0".parse().unwrap()), (2, dead)]
        .into_iter()
        .collect();
    let mut t = Transport::bind(local, "127.0.0.1:0".parse().unwrap(), &peers).unwrap();
    t.set_election_timeout_ms(300);
    t.register(poll.registry(), 0).unwrap();
    let mut events = mio::Events::with_capacity(16);
    let mut now = Millis(0);
    for attempt in 0..2 {
        t.tick(now, poll.registry());
        assert!(
            t.peers[&2].stream.is_some(),
            "attempt {attempt}: connecting"
        );
        t.send(&msg(MessageType::MsgAppend));
        t.send(&msg(MessageType::MsgSnapshot));
        // Let the kernel answer if it would: it does not.
        for _ in 0..5 {
            poll.poll(&mut events, Some(std::time::Duration::from_millis(40)))
                .unwrap();
            for e in &events {
                t.event(now, poll.registry(), e);
            }
            t.flush(now, poll.registry());
        }
        assert!(!t.peers[&2].connected, "the SYN is never answered");
        assert!(t.take_events().is_empty(), "nothing to report yet");
        let by = t
            .next_deadline()
            .expect("the connect timeout is a deadline");
        assert_eq!(by, now.add_ms(300));
        now = by;
        t.tick(now, poll.registry());
        let ev = t.take_events();
        assert!(
            matches!(
                ev.as_slice(),
                [PeerEvent::Snapshot(2, false), PeerEvent::Unreachable(2)]
            ),
            "attempt {attempt}: {ev:?}"
        );
        assert!(t.peers[&2].stream.is_none(), "the attempt was dropped");
        assert_eq!(t.peers[&2].buf.len(), 0, "queued messages dropped");
        // It retries after the backoff, which grows.
        let retry = t.next_deadline().expect("a retry is planned");
        assert_eq!(retry, now.add_ms(BACKOFF_MIN_MS << attempt));
        now = retry;
    }
}

fn node1(peers: &[(u64, SocketAddr)]) -> Transport {
    let local = LocalInfo {
        id: 1,
        cluster: 1,
        voters: 1,
        uuid: 1,
        known: BTreeMap::new(),
    };
    let peers: BTreeMap<u64, SocketAddr> = peers.iter().copied().collect();
    Transport::bind(local, "127.0.0.1:0".parse().unwrap(), &peers).unwrap()
}

/// Peer 2's hello frame to `node1` (data directory id 7).
fn hello_from_2() -> Vec<u8> {
    Hello {
        cluster: 1,
        voters: 1,
        from: 2,
        from_uuid: 7,
        to: 1,
        to_uuid: 1,
    }
    .encode()
}

fn pump(t: &mut Transport, poll: &mut mio::Poll, rounds: usize) {
    let mut events = mio::Events::with_capacity(16);
    for _ in 0..rounds {
        poll.poll(&mut events, Some(std::time::Duration::from_millis(20)))
            .unwrap();
        for e in &events {
            t.event(Millis(0), poll.registry(), e);
        }
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
#[test]
fn outbound_sockets_give_up_on_unacknowledged_data_after_three_election_timeouts() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let poll = mio::Poll::new().unwrap();
    let mut t = node1(&[(2, l.local_addr().unwrap())]);
    t.set_election_timeout_ms(300);
    t.register(poll.registry(), 0).unwrap();
    t.tick(Millis(0), poll.registry());
    let s = t.peers[&2].stream.as_ref().expect("connecting");
    let got = socket2::SockRef::from(s).tcp_user_timeout().unwrap();
    assert_eq!(got, Some(std::time::Duration::from_millis(900)));
}

#[test]
fn a_new_hello_from_a_peer_closes_its_older_inbound_connections() {
    let mut poll = mio::Poll::new().unwrap();
    let mut t = node1(&[(2, "127.0.0.1:9".parse().unwrap())]);
    t.register(poll.registry(), 0).unwrap();
    let at = t.local_addr().unwrap();
    let hello = hello_from_2();
    let mut old = std::net::TcpStream::connect(at).unwrap();
    old.write_all(&hello).unwrap();
    pump(&mut t, &mut poll, 5);
    assert_eq!(t.inbound.len(), 1);
    assert!(t.inbound.iter().all(|(_, c)| c.peer == Some(2)));
    // Peer 2 gave that connection up (its end was lost) and opened
    // another: the old one is closed, the new one kept.
    let mut new = std::net::TcpStream::connect(at).unwrap();
    new.write_all(&hello).unwrap();
    pump(&mut t, &mut poll, 5);
    assert_eq!(t.inbound.len(), 1, "only the newest connection stays");
    old.set_read_timeout(Some(std::time::Duration::from_secs(2)))
        .unwrap();
    let mut b = [0u8; 1];
    assert_eq!(old.read(&mut b).unwrap(), 0, "the old one was closed");
    // The new one still carries messages.
    let m = msg(MessageType::MsgHeartbeat);
    let m = Message {
        from: 2,
        to: 1,
        ..m
    };
    let bytes = m.write_to_bytes().unwrap();
    new.write_all(&u32::try_from(bytes.len()).unwrap().to_be_bytes())
        .unwrap();
    new.write_all(&bytes).unwrap();
    pump(&mut t, &mut poll, 5);
    let ev = t.take_events();
    assert!(
        ev.iter()
            .any(|e| matches!(e, PeerEvent::Message(m) if m.from == 2)),
        "{ev:?}"
    );
}

/// Node 2, listening, knowing node 1 (whose outbound side it never uses).
fn node2() -> Transport {
    let local = LocalInfo {
        id: 2,
        cluster: 1,
        voters: 1,
        uuid: 7,
        known: BTreeMap::new(),
    };
    let peers: BTreeMap<u64, SocketAddr> =
        [(1, "127.0.0.1:9".parse().unwrap())].into_iter().collect();
    Transport::bind(local, "127.0.0.1:0".parse().unwrap(), &peers).unwrap()
}

fn snapshot_msg(data_bytes: usize) -> Message {
    let mut snap = raft::eraftpb::Snapshot {
        data: vec![0x5a; data_bytes].into(),
        ..Default::default()
    };
    snap.mut_metadata().index = 9;
    Message {
        snapshot: Some(snap).into(),
        ..msg(MessageType::MsgSnapshot)
    }
}

/// Sends `m` from a fresh node 1 to a fresh node 2, both with the frame
/// limit `limit` (None: the default), and pumps both until node 1
/// reports the snapshot's fate; returns that and what node 2 received.
/// A fresh node 2 and a fresh node 1 that knows it, each registered
/// with its own poll: `(poll1, t1, poll2, t2)`.
fn linked_pair() -> (mio::Poll, Transport, mio::Poll, Transport) {
    let poll1 = mio::Poll::new().unwrap();
    let poll2 = mio::Poll::new().unwrap();
    let mut t2 = node2();
    t2.register(poll2.registry(), 0).unwrap();
    let mut t1 = node1(&[(2, t2.local_addr().unwrap())]);
    // Node 1 has seen node 2 before: its hello authenticates it.
    t1.set_known(2, 7);
    t1.register(poll1.registry(), 0).unwrap();
    (poll1, t1, poll2, t2)
}

fn ship(m: &Message, limit: Option<u64>) -> (Vec<PeerEvent>, Vec<PeerEvent>) {
    let (mut poll1, mut t1, mut poll2, mut t2) = linked_pair();
    if let Some(l) = limit {
        t1.set_max_frame_bytes(l);
        t2.set_max_frame_bytes(l);
    }
    t1.tick(Millis(0), poll1.registry());
    t1.send(m);
    let (mut ev1, mut ev2) = (Vec::new(), Vec::new());
    let mut events = mio::Events::with_capacity(64);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        t1.flush(Millis(0), poll1.registry());
        poll1
            .poll(&mut events, Some(std::time::Duration::from_millis(1)))
            .unwrap();
        for e in &events {
            t1.event(Millis(0), poll1.registry(), e);
        }
        poll2
            .poll(&mut events, Some(std::time::Duration::from_millis(1)))
            .unwrap();
        for e in &events {
            t2.event(Millis(0), poll2.registry(), e);
        }
        ev1.extend(t1.take_events());
        ev2.extend(t2.take_events());
        let refused = ev1
            .iter()
            .any(|e| matches!(e, PeerEvent::Snapshot(2, false)));
        let written = ev1
            .iter()
            .any(|e| matches!(e, PeerEvent::Snapshot(2, true)));
        let arrived = ev2.iter().any(|e| matches!(e, PeerEvent::Message(_)));
        if refused || (written && arrived) {
            // Neither end keeps a snapshot-sized buffer once it is
            // through.
            assert!(t1.peers[&2].buf.capacity() <= KEEP_BUFFER_BYTES);
            for (_, c) in &t2.inbound {
                assert!(c.rbuf.capacity() <= KEEP_BUFFER_BYTES);
            }
            break;
        }
    }
    (ev1, ev2)
}

/// `encode_entries` writes field 7 byte for byte as protobuf writes a
/// message that has only entries: every entry type, zero and large
/// terms and indexes, data and context empty and with one- to
/// three-byte lengths, `sync_log`, and an entry with unknown fields.
#[test]
fn encoded_entries_are_protobufs_bytes() {
    use raft::eraftpb::{Entry, EntryType};
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || crate::hash::xorshift(&mut seed);
    let mut entries = Vec::new();
    for i in 0..400u64 {
        let big = |r: u64| match r % 4 {
            0 => 0,
            1 => r % 128,
            2 => r % 100_000,
            _ => r,
        };
        let data_len = [0, 1, 127, 128, 300, 20_000][(next() % 6) as usize];
        let context_len = [0, 5, 200][(next() % 3) as usize];
        let mut e = Entry {
            entry_type: match i % 3 {
                0 => EntryType::EntryNormal,
                1 => EntryType::EntryConfChange,
                _ => EntryType::EntryConfChangeV2,
            },
            term: big(next()),
            index: big(next()),
            data: (0..data_len)
                .map(|_| next() as u8)
                .collect::<Vec<u8>>()
                .into(),
            context: (0..context_len)
                .map(|_| next() as u8)
                .collect::<Vec<u8>>()
                .into(),
            sync_log: next() % 2 == 0,
            ..Entry::default()
        };
        if i == 7 {
            e.mut_unknown_fields().add_varint(15, 99);
        }
        entries.push(e);
    }
    for range in [0..0, 0..1, 5..9, 0..entries.len()] {
        let es = &entries[range];
        let mut m = Message::default();
        m.set_entries(es.to_vec().into());
        let want = m.write_to_bytes().unwrap();
        assert_eq!(encode_entries(es, usize::MAX), Some(want.clone()));
        assert_eq!(encode_entries(es, want.len()), Some(want.clone()));
        if !want.is_empty() {
            assert_eq!(encode_entries(es, want.len() - 1), None);
        }
        let back = Message::parse_from_bytes(&want).unwrap();
        assert_eq!(back.get_entries(), es);
    }
}

/// Sends `msgs` from node 1 to node 2 with [`Transport::send_all`] and
/// returns what node 2 decodes, once all have arrived (or after 20 s).
fn ship_all(msgs: Vec<Message>) -> Vec<Message> {
    let (mut poll1, mut t1, mut poll2, mut t2) = linked_pair();
    t1.tick(Millis(0), poll1.registry());
    let want = msgs.len();
    t1.send_all(msgs);
    let mut got = Vec::new();
    let mut events = mio::Events::with_capacity(64);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while got.len() < want && std::time::Instant::now() < deadline {
        t1.flush(Millis(0), poll1.registry());
        for (poll, t) in [(&mut poll1, &mut t1), (&mut poll2, &mut t2)] {
            poll.poll(&mut events, Some(std::time::Duration::from_millis(1)))
                .unwrap();
            for e in &events {
                t.event(Millis(0), poll.registry(), e);
            }
        }
        for e in t2.take_events() {
            if let PeerEvent::Message(m) = e {
                got.push(m);
            }
        }
    }
    got
}

#[test]
fn a_long_frame_decodes_to_entries_that_share_one_buffer() {
    let entries: Vec<raft::eraftpb::Entry> = (1..4)
        .map(|i| raft::eraftpb::Entry {
            index: i,
            term: 1,
            data: vec![i as u8; 60].into(),
            ..Default::default()
        })
        .collect();
    let m = Message {
        entries: entries.into(),
        ..msg(MessageType::MsgAppend)
    };
    let bytes = m.write_to_bytes().unwrap();
    assert!(bytes.len() >= SHARED_DECODE_BYTES);
    let got = decode_message(&bytes).unwrap();
    assert_eq!(got, m);
    // Each entry is a slice of one copy of the frame: the data lie as
    // far apart as in the frame.
    let at = |i: usize| got.entries[i].data.as_ptr() as usize;
    let frame_step = bytes.windows(60).position(|w| w == [2u8; 60]).unwrap()
        - bytes.windows(60).position(|w| w == [1u8; 60]).unwrap();
    assert_eq!(at(1) - at(0), frame_step);
    assert_eq!(at(2) - at(1), frame_step);
    // A short frame (no entries) decodes the same way, in place.
    let ack = Message {
        index: 9,
        ..msg(MessageType::MsgAppendResponse)
    };
    let bytes = ack.write_to_bytes().unwrap();
    assert!(bytes.len() < SHARED_DECODE_BYTES);
    assert_eq!(decode_message(&bytes).unwrap(), ack);
    // Garbage is an error either way.
    assert!(decode_message(&[0xFF; 200]).is_err());
    assert!(decode_message(&[0xFF; 3]).is_err());
}

#[test]
fn appends_sharing_their_entries_arrive_as_sent() {
    let entry = |index: u64, term: u64, data: Vec<u8>| raft::eraftpb::Entry {
        index,
        term,
        data: data.into(),
        ..Default::default()
    };
    let log: Vec<raft::eraftpb::Entry> = (5..9)
        .map(|i| entry(i, 2, vec![i as u8; 100 + i as usize]))
        .collect();
    let append = |index: u64, commit: u64, ents: &[raft::eraftpb::Entry]| Message {
        msg_type: MessageType::MsgAppend,
        to: 2,
        from: 1,
        term: 2,
        log_term: 2,
        index,
        commit,
        entries: ents.to_vec().into(),
        ..Default::default()
    };
    let msgs = vec![
        // The same entries (clones of the same `Bytes`) twice, with
        // different headers: encoded once, sent twice.
        append(4, 3, &log),
        append(4, 4, &log),
        // Not an append: sent whole between them.
        Message {
            commit: 7,
            ..msg(MessageType::MsgHeartbeat)
        },
        // A different slice of the log: encoded on its own.
        append(6, 4, &log[2..]),
        // Equal indices and terms but other data (not from the same
        // log): not taken for the entries above.
        append(
            6,
            4,
            &[entry(7, 2, vec![1u8; 3]), entry(8, 2, vec![2u8; 9])],
        ),
        // An append without entries.
        append(8, 8, &[]),
    ];
    let got = ship_all(msgs.clone());
    assert_eq!(got, msgs);
}

#[test]
fn a_snapshot_over_the_default_frame_limit_travels_once_the_limit_is_raised() {
    // Refused by its data's length alone, whatever else it holds.
    let mut t = node2();
    t.send(&Message {
        to: 1,
        ..snapshot_msg(MAX_FRAME_BYTES + 1)
    });
    assert!(matches!(
        t.take_events().as_slice(),
        [PeerEvent::Snapshot(1, false)]
    ));
    let big = snapshot_msg(MAX_FRAME_BYTES + (1 << 20));
    // Under the default limit it is refused at once, before any byte.
    let (ev1, ev2) = ship(&big, None);
    assert!(
        matches!(ev1.as_slice(), [PeerEvent::Snapshot(2, false)]),
        "{ev1:?}"
    );
    assert!(ev2.iter().all(|e| !matches!(e, PeerEvent::Message(_))));
    // Sized for a table that big, both ends take it whole.
    let (ev1, ev2) = ship(&big, Some(96 << 20));
    assert!(
        ev1.iter()
            .any(|e| matches!(e, PeerEvent::Snapshot(2, true))),
        "{ev1:?}"
    );
    let got = ev2
        .iter()
        .find_map(|e| match e {
            PeerEvent::Message(m) => Some(m),
            _ => None,
        })
        .expect("node 2 received the snapshot");
    assert_eq!(got.get_snapshot().get_metadata().index, 9);
    assert_eq!(got.get_snapshot().data.len(), MAX_FRAME_BYTES + (1 << 20));
    assert!(got.get_snapshot().data.iter().all(|b| *b == 0x5a));
}

#[test]
fn the_frame_ceiling_is_the_length_prefix_on_64_bit_and_fits_a_32_bit_allocation() {
    // 64-bit: the u32 length prefix is the bound.
    assert_eq!(frame_ceiling(i64::MAX as u64), u64::from(u32::MAX));
    // 32-bit: both buffers of a peer, grown by doubling, stay within
    // one allocation of at most i32::MAX bytes.
    let max_alloc = i32::MAX as u64;
    let c = frame_ceiling(max_alloc);
    assert_eq!(c / (1 << 20), 1007, "{c}");
    let outbound = c + PEER_BUFFER_SLACK_BYTES as u64;
    let inbound = c + 4 + READ_CHUNK as u64;
    assert!(2 * outbound <= max_alloc && 2 * inbound <= max_alloc);
    let around = (PEER_BUFFER_SLACK_BYTES + READ_CHUNK + 4) as u64;
    assert!(
        2 * (c + 1 + around) > max_alloc,
        "not the largest that fits"
    );
    // The limit for the default table (1,100 MiB) is capped on 32-bit,
    // kept on 64-bit; small tables get the floor on both.
    let default_bound = 1100 << 20;
    assert_eq!(frame_limit(default_bound, max_alloc), c);
    assert_eq!(frame_limit(default_bound, i64::MAX as u64), default_bound);
    assert_eq!(frame_limit(1, max_alloc), MAX_FRAME_BYTES as u64);
    assert_eq!(frame_limit(u64::MAX, max_alloc), c);
    // The running build's limit is its own ceiling at most.
    let mut t = node2();
    t.set_max_frame_bytes(u64::MAX);
    assert!(t.max_frame_bytes() as u64 <= frame_ceiling(MAX_ALLOC_BYTES));
    assert!(2 * (t.max_frame_bytes() as u64 + PEER_BUFFER_SLACK_BYTES as u64) <= MAX_ALLOC_BYTES);
}

#[test]
fn the_frame_limit_stays_within_its_floor_and_the_length_prefix() {
    let mut t = node2();
    t.set_max_frame_bytes(1);
    assert_eq!(t.max_frame_bytes(), MAX_FRAME_BYTES);
    t.set_max_frame_bytes(u64::MAX);
    assert_eq!(t.max_frame_bytes() as u64, frame_ceiling(MAX_ALLOC_BYTES));
    t.set_max_frame_bytes(200 << 20);
    assert_eq!(t.max_frame_bytes(), 200 << 20);
    // Frames over the limit close the connection; the hello rule holds.
    let mut frame = (100u32 << 20).to_be_bytes().to_vec();
    frame.push(0);
    assert_eq!(
        frame_len(&frame, false, MAX_FRAME_BYTES),
        Err(FrameError::TooLarge {
            len: 100 << 20,
            max: MAX_FRAME_BYTES
        })
    );
    assert_eq!(frame_len(&frame, false, 200 << 20), Ok(None));
    assert_eq!(
        frame_len(&frame, true, 200 << 20),
        Err(FrameError::NotHello)
    );
}

#[test]
fn a_connection_closed_right_after_a_partial_frame_is_released() {
    let mut poll = mio::Poll::new().unwrap();
    let mut t = node1(&[(2, "127.0.0.1:9".parse().unwrap())]);
    t.register(poll.registry(), 0).unwrap();
    let at = t.local_addr().unwrap();
    for _ in 0..3 {
        // Half a hello and the close reach the node in one event.
        let mut s = std::net::TcpStream::connect(at).unwrap();
        s.write_all(&hello_from_2()[..10]).unwrap();
        drop(s);
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    pump(&mut t, &mut poll, 5);
    assert_eq!(
        t.inbound.len(),
        0,
        "each short read was followed to its end of file"
    );
}

#[test]
fn a_hello_from_a_peer_we_cannot_reach_restarts_our_connect_at_once() {
    let (_l, _filler, dead) = blackhole();
    let mut poll = mio::Poll::new().unwrap();
    let mut t = node1(&[(2, dead)]);
    t.register(poll.registry(), 0).unwrap();
    // Our connect to 2 is stuck behind a lost SYN; it failed once, so
    // the next attempt waits for the backoff.
    t.tick(Millis(0), poll.registry());
    t.tick(Millis(5000), poll.registry());
    t.tick(Millis(5100), poll.registry());
    assert!(t.peers[&2].stream.is_some(), "connecting again");
    assert!(t.peers[&2].backoff_ms > BACKOFF_MIN_MS);
    let _ = t.take_events();
    // Peer 2 reaches us: the link is back.
    let mut c = std::net::TcpStream::connect(t.local_addr().unwrap()).unwrap();
    c.write_all(&hello_from_2()).unwrap();
    pump(&mut t, &mut poll, 5);
    assert!(
        t.peers[&2].stream.is_none(),
        "the stuck attempt was dropped"
    );
    assert_eq!(t.peers[&2].backoff_ms, BACKOFF_MIN_MS);
    assert_eq!(t.next_deadline(), Some(Millis(0)), "retry at once");
    let ev = t.take_events();
    assert!(
        ev.iter().any(|e| matches!(e, PeerEvent::Unreachable(2))),
        "{ev:?}"
    );
}

#[test]
fn unauthenticated_connections_close_at_the_deadline_and_make_room() {
    let mut poll = mio::Poll::new().unwrap();
    let mut t = node1(&[(2, "127.0.0.1:9".parse().unwrap())]);
    t.register(poll.registry(), 0).unwrap();
    let at = t.local_addr().unwrap();
    // Idle strangers fill every slot...
    let idle: Vec<_> = (0..MAX_INBOUND + 5)
        .map(|_| std::net::TcpStream::connect(at).unwrap())
        .collect();
    pump(&mut t, &mut poll, 5);
    assert_eq!(t.inbound.len(), MAX_INBOUND);
    // ...and the real peer still gets in, evicting the oldest.
    let mut real = std::net::TcpStream::connect(at).unwrap();
    real.write_all(&hello_from_2()).unwrap();
    pump(&mut t, &mut poll, 5);
    assert_eq!(t.authenticated_inbound(), 1);
    t.tick(Millis(AUTH_DEADLINE_MS - 1), poll.registry());
    assert_eq!(t.inbound.len(), MAX_INBOUND, "not yet at the deadline");
    // A hello with no knowledge of us is not enough: its messages drop.
    let mut unknown = std::net::TcpStream::connect(at).unwrap();
    let h = Hello {
        to_uuid: 0,
        ..Hello::decode(&hello_from_2()[4..]).unwrap()
    };
    unknown.write_all(&h.encode()).unwrap();
    let m = Message {
        from: 2,
        to: 1,
        ..msg(MessageType::MsgHeartbeat)
    };
    let b = m.write_to_bytes().unwrap();
    unknown
        .write_all(&u32::try_from(b.len()).unwrap().to_be_bytes())
        .unwrap();
    unknown.write_all(&b).unwrap();
    pump(&mut t, &mut poll, 5);
    assert_eq!(t.dropped_messages(), 1);
    assert!(t
        .take_events()
        .iter()
        .all(|e| !matches!(e, PeerEvent::Message(_))));
    // At the deadline every connection but the real peer's closes.
    t.tick(Millis(AUTH_DEADLINE_MS), poll.registry());
    assert_eq!(t.inbound.len(), 1);
    assert_eq!(t.authenticated_inbound(), 1);
    drop(idle);
}

#[test]
fn hashes_separate_parts() {
    assert_ne!(hash64(&[b"ab", b"c"]), hash64(&[b"a", b"bc"]));
    assert_eq!(hash64(&[b"x"]), hash64(&[b"x"]));
}

//! Bodies of the cluster fuzz targets (built with the `cluster` feature).
//!
//! * [`peer_decode`]: what a node decodes from bytes a peer (or a stranger)
//!   sends. Mode by the first byte: the length-prefixed peer framing over a
//!   byte stream (optionally opened by a well-formed hello built from the
//!   input, so the fuzzer reaches the raft `Message` frames behind it), or
//!   the replicated command decoder on one log entry's bytes. A frame never
//!   claims more bytes than it was given or than [`MAX_FRAME_BYTES`], only a
//!   hello-sized frame is accepted first, every strict prefix of a frame is
//!   incomplete, a decoded hello re-encodes to exactly its bytes, and a
//!   decoded raft `Message` or `Command` re-encodes to a value that decodes
//!   equal to it.
//! * [`wal_recovery`]: `Wal::open` over a `MemDisk`. Mode by the first byte:
//!   the rest of the input is the whole log file, or it drives a writer
//!   (entries, hard states, commits, conf states, snapshots, epochs,
//!   identities, records with a valid CRC and arbitrary kind and payload,
//!   raw junk, flipped bytes, power cuts) whose bytes are then recovered.
//!   Recovery either fails with `InvalidData` or yields a consistent log
//!   (entries contiguous after the snapshot, commit within
//!   `[snapshot, last]`); re-opening the recovered disk yields the same
//!   state with no torn tail, and so does rewriting it (compaction) and
//!   opening that.

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState, Message, Snapshot};
use ticketd::cluster::command::Command;
use ticketd::cluster::log::{Disk, LogStore, MemDisk, Recovered, Wal};
use ticketd::cluster::transport::{frame_len, Hello, MAX_FRAME_BYTES};

/// Size of a hello payload (magic, version, six u64).
const HELLO_PAYLOAD_BYTES: usize = 4 + 1 + 8 * 6;

/// A big-endian u64 from up to 8 bytes of `b` at `at` (missing bytes 0).
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    for (i, x) in v.iter_mut().enumerate() {
        *x = b.get(at + i).copied().unwrap_or(0);
    }
    u64::from_be_bytes(v)
}

/// Peer framing, hello, raft messages and replicated commands.
pub fn peer_decode(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => peer_stream(rest),
        1 => {
            // A well-formed hello first, from the input's first 48 bytes.
            let hello = Hello {
                cluster: u64_at(rest, 0),
                voters: u64_at(rest, 8),
                from: u64_at(rest, 16),
                from_uuid: u64_at(rest, 24),
                to: u64_at(rest, 32),
                to_uuid: u64_at(rest, 40),
            };
            let mut stream = hello.encode();
            stream.extend_from_slice(rest.get(48..).unwrap_or_default());
            peer_stream(&stream);
        }
        _ => command(rest),
    }
}

fn peer_stream(mut buf: &[u8]) {
    let mut before_hello = true;
    loop {
        let len = match frame_len(buf, before_hello, MAX_FRAME_BYTES) {
            Err(_) => return,
            Ok(None) => {
                if buf.len() >= 4 {
                    let claimed = u64_at(&buf[..4], 0) >> 32;
                    assert!(
                        claimed as usize > buf.len() - 4,
                        "a complete frame of {claimed} bytes called incomplete"
                    );
                }
                return;
            }
            Ok(Some(len)) => len,
        };
        assert!(4 + len <= buf.len(), "frame of {len} beyond the buffer");
        assert!(len <= MAX_FRAME_BYTES, "frame of {len} over the limit");
        assert!(
            !before_hello || len == HELLO_PAYLOAD_BYTES,
            "first frame of {len} bytes is not hello-sized"
        );
        assert_eq!(
            frame_len(&buf[..4 + len - 1], before_hello, MAX_FRAME_BYTES),
            Ok(None),
            "a strict prefix of a frame is not incomplete"
        );
        let payload = &buf[4..4 + len];
        if before_hello {
            let Ok(h) = Hello::decode(payload) else {
                return;
            };
            assert_eq!(&h.encode()[4..], payload, "hello does not re-encode");
            before_hello = false;
        } else if let Ok(m) = Message::parse_from_bytes(payload) {
            let again = m.write_to_bytes().expect("a parsed message encodes");
            let m2 = Message::parse_from_bytes(&again).expect("a re-encoded message parses");
            // Compared by what raft reads: protobuf 2's `==` also sees
            // unknown fields and field presence, and it writes unknown fields
            // in hash order, so neither values nor bytes compare exactly.
            assert_eq!(
                format!("{m:?}"),
                format!("{m2:?}"),
                "message changes through re-encoding"
            );
        } else {
            return;
        }
        buf = &buf[4 + len..];
    }
}

fn command(data: &[u8]) {
    if let Ok(c) = Command::decode(data) {
        let bytes = c.encode();
        let c2 = Command::decode(&bytes).expect("a re-encoded command decodes");
        assert_eq!(c, c2, "command changes through re-encoding");
        assert_eq!(c2.encode(), bytes, "re-encoding is not stable");
    }
}

/// CRC-32 (IEEE), as the WAL's records carry; bitwise, the inputs are small.
fn crc32(parts: &[&[u8]]) -> u32 {
    let mut c = !0u32;
    for b in parts.iter().flat_map(|p| p.iter()) {
        c ^= u32::from(*b);
        for _ in 0..8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// Reads the fuzzer's bytes one at a time, 0 when they run out.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        b
    }
    /// A length byte (below `max`), then that many bytes.
    fn chunk(&mut self, max: u8) -> Vec<u8> {
        let n = usize::from(self.u8() % max).min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a.to_vec()
    }
}

/// WAL recovery over arbitrary or fuzzer-written log bytes.
pub fn wal_recovery(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let disk = MemDisk::new();
    if mode % 4 == 0 {
        disk.clone().append(rest, true).expect("memory append");
    } else {
        write_log(&disk, rest);
    }
    // The same bytes followed by zeros, as the file disk writes ahead of
    // its log. After a whole log they change nothing. After a torn record
    // they may complete it: a write whose lost suffix was zeros anyway left
    // exactly the record on disk, and recovering it is right.
    let padded = MemDisk::new();
    let mut bytes = disk.clone().read_all().expect("a memory disk reads");
    bytes.resize(bytes.len() + 1 + usize::from(mode / 4) * 64, 0);
    padded.clone().append(&bytes, true).expect("memory append");
    let plain = check_recovery(&disk);
    let ahead = check_recovery(&padded);
    let torn = plain.as_ref().is_some_and(|p| p.2 > 0);
    match (&plain, &ahead) {
        (Some(p), Some(a)) if a.1 == p.1 => {
            assert_eq!(plain, ahead, "zeros after the log change what recovers");
        }
        (Some(p), Some(a)) => {
            assert!(a.1 > p.1, "zeros after the log lose records");
            assert!(torn, "zeros completed a record where none was torn");
        }
        (None, None) => {}
        (Some(_), None) => assert!(torn, "zeros after a whole log make it refused"),
        (None, Some(_)) => panic!("zeros after a refused log make it accepted"),
    }
}

fn write_log(disk: &MemDisk, data: &[u8]) {
    let mut inp = Input(data);
    let (mut wal, rec) = Wal::open(disk.clone()).expect("an empty disk opens");
    let mut last = rec.store.last();
    let mut ops = 0;
    while !inp.0.is_empty() && ops < 64 {
        ops += 1;
        match inp.u8() % 12 {
            0 => stage_entries_near_end(&mut wal, &mut inp, &mut last),
            1 => {
                let hs = HardState {
                    term: u64::from(inp.u8() % 4),
                    vote: u64::from(inp.u8() % 4),
                    commit: u64::from(inp.u8() % 16),
                    ..HardState::default()
                };
                wal.stage_hard_state(&hs);
            }
            2 => wal.stage_commit(u64::from(inp.u8() % 16)),
            3 => {
                let cs = ConfState {
                    voters: (0..inp.u8() % 4).map(u64::from).collect(),
                    ..ConfState::default()
                };
                wal.stage_conf_state(&cs);
            }
            4 => {
                let mut snap = Snapshot::default();
                let meta = snap.mut_metadata();
                meta.index = u64::from(inp.u8() % 16);
                meta.term = u64::from(inp.u8() % 4);
                snap.data = inp.chunk(8).into();
                last = snap.get_metadata().index;
                wal.stage_snapshot(&snap);
            }
            5 => wal.stage_epoch(u64::from(inp.u8())),
            6 => wal.stage_self(u64::from(inp.u8())),
            7 => wal.stage_peer(u64::from(inp.u8() % 4), u64::from(inp.u8())),
            8 => append_valid_crc_record(disk, &mut wal, &mut inp),
            9 => {
                let _ = wal.flush(true);
                let junk = inp.chunk(16);
                disk.clone()
                    .append(&junk, inp.u8() % 2 == 0)
                    .expect("memory append");
            }
            10 => {
                let _ = wal.flush(true);
                let at = usize::from(inp.u8()) * 4 + usize::from(inp.u8() % 4);
                disk.corrupt_byte(at % disk.len().max(1));
            }
            _ => {
                let _ = wal.flush(inp.u8() % 2 == 0);
                disk.crash(usize::from(inp.u8()));
            }
        }
    }
    let _ = wal.flush(true);
}

/// Stages entries from near the end of the log (`last`): an overwrite, an
/// append or a gap, as the input says; `last` follows the last one staged.
fn stage_entries_near_end(wal: &mut Wal<MemDisk>, inp: &mut Input, last: &mut u64) {
    let n = u64::from(inp.u8() % 5);
    let back = u64::from(inp.u8() % 4);
    let term = u64::from(inp.u8() % 4);
    let first = (*last + 1).saturating_sub(back) + u64::from(inp.u8() % 2);
    let ents: Vec<Entry> = (0..n)
        .map(|i| Entry {
            index: first + i,
            term,
            data: inp.chunk(8).into(),
            ..Entry::default()
        })
        .collect();
    if let Some(e) = ents.last() {
        *last = e.index;
    }
    wal.stage_entries(&ents);
}

/// Flushes `wal`, then appends to `disk` a record with a valid CRC and an
/// arbitrary kind and payload taken from the input.
fn append_valid_crc_record(disk: &MemDisk, wal: &mut Wal<MemDisk>, inp: &mut Input) {
    let kind = inp.u8() % 10;
    let payload = inp.chunk(24);
    let mut rec = Vec::new();
    rec.extend_from_slice(&u32::try_from(payload.len() + 1).unwrap_or(0).to_be_bytes());
    rec.extend_from_slice(&crc32(&[&[kind], &payload]).to_be_bytes());
    rec.push(kind);
    rec.extend_from_slice(&payload);
    let _ = wal.flush(true);
    disk.clone().append(&rec, true).expect("memory append");
}

/// What the checks compare of a recovered log.
#[derive(Debug, PartialEq)]
struct State {
    hs: HardState,
    cs: ConfState,
    snapshot: Snapshot,
    entries: Vec<Entry>,
    epoch: u64,
    identity: ticketd::cluster::log::Identity,
}

fn state_of(r: &Recovered) -> State {
    let s: &LogStore = &r.store;
    let snap = s.latest_snapshot().get_metadata().index;
    State {
        hs: s.hard_state().clone(),
        cs: s.conf_state().clone(),
        snapshot: s.latest_snapshot().clone(),
        entries: s.entries_between(snap + 1, s.last().saturating_add(1)),
        epoch: r.epoch,
        identity: r.identity.clone(),
    }
}

fn check_consistent(r: &Recovered) {
    let s = &r.store;
    let snap = s.latest_snapshot().get_metadata().index;
    let last = s.last();
    assert!(last >= snap, "last {last} below the snapshot {snap}");
    assert_eq!(
        s.entry_count() as u64,
        last - snap,
        "entry count does not match the index range"
    );
    let ents = s.entries_between(snap + 1, last.saturating_add(1));
    assert_eq!(ents.len(), s.entry_count(), "entries not all served");
    for (i, e) in ents.iter().enumerate() {
        assert_eq!(e.index, snap + 1 + i as u64, "entries not contiguous");
    }
    let commit = s.hard_state().commit;
    assert!(
        commit >= snap && commit <= last,
        "commit {commit} outside [{snap}, {last}]"
    );
}

/// Recovers `disk` and checks the result; returns what recovered (the
/// state, valid bytes and torn bytes), or `None` for a log refused as bad
/// data.
fn check_recovery(disk: &MemDisk) -> Option<(State, u64, u64)> {
    let total = disk.len() as u64;
    let first = match Wal::open(disk.clone()) {
        Err(e) => {
            assert_eq!(
                e.kind(),
                std::io::ErrorKind::InvalidData,
                "recovery failed other than on bad data: {e}"
            );
            return None;
        }
        Ok((_, r)) => r,
    };
    check_consistent(&first);
    assert!(
        first.log_bytes + first.torn_bytes <= total,
        "more bytes counted than the disk held"
    );
    assert_eq!(disk.len() as u64, first.log_bytes, "torn tail not cut");
    let recovered = (state_of(&first), first.log_bytes, first.torn_bytes);
    let want = state_of(&first);

    let (mut wal, again) = Wal::open(disk.clone()).expect("a recovered log re-opens");
    assert_eq!(again.torn_bytes, 0, "a recovered log has a torn tail");
    assert_eq!(again.log_bytes, first.log_bytes);
    assert_eq!(state_of(&again), want, "re-opening changes the state");

    // Compaction rewrites the log from the recovered store.
    wal.rewrite(&again.store, again.epoch)
        .expect("memory rewrite");
    let (_, rewritten) = Wal::open(disk.clone()).expect("a rewritten log opens");
    let got = state_of(&rewritten);
    assert_eq!(got.hs, want.hs, "rewrite changes the hard state");
    assert_eq!(got.cs, want.cs, "rewrite changes the conf state");
    // A snapshot at index 0 covers nothing: compaction drops it, and the
    // hard and conf states it carried are kept by their own records.
    let (gm, wm) = (got.snapshot.get_metadata(), want.snapshot.get_metadata());
    if wm.index > 0 {
        assert_eq!(
            (gm.index, gm.term, gm.get_conf_state(), &got.snapshot.data),
            (wm.index, wm.term, wm.get_conf_state(), &want.snapshot.data),
            "rewrite changes the snapshot"
        );
    } else {
        assert_eq!(gm.index, 0, "rewrite invents a snapshot");
    }
    assert_eq!(got.entries, want.entries, "rewrite changes the entries");
    assert_eq!(got.epoch, want.epoch, "rewrite changes the epoch");
    Some(recovered)
}

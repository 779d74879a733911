use super::wal::{
    pb_bytes, push_entries_record, push_pb_entries_record, push_record, KIND_ENTRIES,
    KIND_ENTRIES_RAW,
};
use super::*;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use raft::eraftpb::{ConfState, Entry, HardState};
use raft::GetEntriesContext;

use raft::Storage as _;
use std::fs::{self, OpenOptions};

#[test]
fn an_entries_record_is_each_entry_length_prefixed_under_one_checksum() {
    let ents: Vec<Entry> = (1..=3u64)
        .map(|i| Entry {
            index: i,
            term: 2,
            data: vec![i as u8; 40 * i as usize].into(),
            ..Default::default()
        })
        .collect();
    // The record spelled out: each entry's length and bytes, then the
    // usual record header over them.
    let mut payload = Vec::new();
    for e in &ents {
        let b = pb_bytes(e);
        payload.extend_from_slice(&(b.len() as u32).to_be_bytes());
        payload.extend_from_slice(&b);
    }
    let mut expected = b"before".to_vec();
    push_record(&mut expected, KIND_ENTRIES, &payload);
    let mut got = b"before".to_vec();
    push_pb_entries_record(&mut got, &ents);
    assert_eq!(got, expected);
}

#[test]
fn a_raw_entries_record_is_each_entry_spelled_out_and_old_records_still_read() {
    let mut conf = entry(2, 1, b"cc");
    conf.set_entry_type(raft::eraftpb::EntryType::EntryConfChange);
    conf.context = b"ctx".to_vec().into();
    let ents = vec![entry(1, 1, b"abc"), conf, entry(3, 2, b"")];
    let mut payload = Vec::new();
    for e in &ents {
        payload.extend_from_slice(&e.index.to_be_bytes());
        payload.extend_from_slice(&e.term.to_be_bytes());
        payload.push(e.get_entry_type() as u8);
        payload.extend_from_slice(&(e.data.len() as u32).to_be_bytes());
        payload.extend_from_slice(&e.data);
        payload.extend_from_slice(&(e.context.len() as u32).to_be_bytes());
        payload.extend_from_slice(&e.context);
    }
    let mut expected = Vec::new();
    push_record(&mut expected, KIND_ENTRIES_RAW, &payload);
    let mut got = Vec::new();
    push_entries_record(&mut got, &ents);
    assert_eq!(got, expected);
    // A log whose first entries an older version wrote in the protobuf
    // layout, and the rest in the raw one, recovers both, field for field.
    let disk = MemDisk::new();
    let mut all = Vec::new();
    push_pb_entries_record(&mut all, &ents[..1]);
    all.extend_from_slice(&got[..]);
    {
        let mut d = disk.clone();
        d.append(&all, true).unwrap();
    }
    let (_, rec) = Wal::open(disk).unwrap();
    assert_eq!(rec.torn_bytes, 0);
    let back = rec.store.entries_between(1, 4);
    assert_eq!(back, ents);
    // An entry with a field the raw layout lacks is written as protobuf.
    let mut odd = entry(1, 1, b"x");
    odd.sync_log = true;
    let mut rec_bytes = Vec::new();
    push_entries_record(&mut rec_bytes, std::slice::from_ref(&odd));
    assert_eq!(rec_bytes[8], KIND_ENTRIES);
}

#[test]
fn a_malformed_raw_entries_record_is_refused() {
    let mut good = Vec::new();
    good.extend_from_slice(&1u64.to_be_bytes());
    good.extend_from_slice(&1u64.to_be_bytes());
    good.push(0);
    good.extend_from_slice(&2u32.to_be_bytes());
    good.extend_from_slice(b"ab");
    good.extend_from_slice(&0u32.to_be_bytes());
    let mut bad_type = good.clone();
    bad_type[16] = 7;
    let mut long_data = good.clone();
    long_data[17..21].copy_from_slice(&u32::MAX.to_be_bytes());
    for (payload, why) in [
        (good[..good.len() - 1].to_vec(), "truncated entry"),
        (good[..10].to_vec(), "truncated entry"),
        (long_data, "truncated entry"),
        (bad_type, "unknown entry type 7"),
    ] {
        let disk = MemDisk::new();
        let mut rec = Vec::new();
        push_record(&mut rec, KIND_ENTRIES_RAW, &payload);
        disk.clone().append(&rec, true).unwrap();
        let e = Wal::open(disk).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains(why), "{e}");
    }
}

#[test]
fn a_started_sync_counts_only_once_polled() {
    let mut d = MemDisk::new();
    let probe = d.clone();
    d.append(b"abc", false).unwrap();
    d.start_sync().unwrap();
    probe.crash(0);
    assert!(
        probe.is_empty(),
        "a power cut before the sync ended lost the bytes"
    );
    d.append(b"abc", false).unwrap();
    d.start_sync().unwrap();
    probe.hold_syncs(true);
    assert!(d.poll_sync().is_none(), "a held sync is still running");
    probe.hold_syncs(false);
    assert!(matches!(d.poll_sync(), Some(Ok(()))));
    d.append(b"de", false).unwrap();
    probe.crash(0);
    assert_eq!(
        d.read_all().unwrap(),
        b"abc",
        "the polled sync kept its bytes only"
    );
}

#[test]
fn a_file_disk_syncs_in_the_background_and_wakes_the_poll() {
    let dir = std::env::temp_dir().join(format!("ticketd-bgsync-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    let mut poll = mio::Poll::new().unwrap();
    let waker = Arc::new(mio::Waker::new(poll.registry(), mio::Token(7)).unwrap());
    let mut d = FileDisk::open(&dir).unwrap();
    d.set_waker(waker);
    d.append(b"first", false).unwrap();
    d.start_sync().unwrap();
    // Written while that sync runs: a blocking sync must still cover it.
    d.append(b"second", false).unwrap();
    // The waker fires once the result is ready.
    let mut events = mio::Events::with_capacity(4);
    poll.poll(&mut events, Some(std::time::Duration::from_secs(10)))
        .unwrap();
    assert!(
        events.iter().any(|e| e.token() == mio::Token(7)),
        "the sync thread woke the poll"
    );
    assert!(
        matches!(d.poll_sync(), Some(Ok(()))),
        "and its result is in"
    );
    d.start_sync().unwrap();
    d.sync().unwrap();
    assert!(
        matches!(d.poll_sync(), Some(Ok(()))),
        "nothing left running"
    );
    // Replacing the file while a sync runs waits for it first.
    d.append(b"third", false).unwrap();
    d.start_sync().unwrap();
    d.replace(b"whole").unwrap();
    d.append(b"+", false).unwrap();
    let all = d.read_all().unwrap();
    assert_eq!(&all[..6], b"whole+");
    assert!(all[6..].iter().all(|b| *b == 0), "then zeros written ahead");
    assert_eq!(d.preallocated(), PREALLOC_BYTES);
    drop(d);
    let _ = fs::remove_dir_all(&dir);
}

fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
    Entry {
        index,
        term,
        data: data.to_vec().into(),
        ..Entry::default()
    }
}

fn hs(term: u64, vote: u64, commit: u64) -> HardState {
    HardState {
        term,
        vote,
        commit,
        ..HardState::default()
    }
}

#[test]
fn log_store_appends_replaces_and_compacts() {
    let mut s = LogStore::new();
    s.append(&[entry(1, 1, b"a"), entry(2, 1, b"b"), entry(3, 1, b"c")])
        .unwrap();
    s.append(&[entry(2, 2, b"x")]).unwrap();
    assert_eq!(s.last_index().unwrap(), 2);
    assert_eq!(s.term(2).unwrap(), 2);
    assert!(s.append(&[entry(9, 2, b"gap")]).is_err());
    s.set_hard_state(hs(2, 1, 2));
    s.compact_to(1, b"snap".to_vec()).unwrap();
    assert_eq!(s.first_index().unwrap(), 2);
    assert_eq!(s.term(1).unwrap(), 1);
    assert!(s.term(0).is_err());
    assert_eq!(
        s.entries(2, 3, None, GetEntriesContext::empty(false))
            .unwrap()[0]
            .data[..],
        b"x"[..]
    );
    assert!(s
        .entries(1, 3, None, GetEntriesContext::empty(false))
        .is_err());
    assert_eq!(s.snapshot(1, 0).unwrap().data[..], b"snap"[..]);
    assert!(s.snapshot(2, 0).is_err());
}

#[test]
fn a_log_from_index_1_is_only_for_the_members_it_began_with() {
    let conf = |voters: &[u64], learners: &[u64]| ConfState {
        voters: voters.to_vec(),
        learners: learners.to_vec(),
        ..ConfState::default()
    };
    // A joining node's empty log begins with no configuration at all.
    let mut s = LogStore::new();
    assert!(s.begins_without(1));
    // The first configuration recorded is the one the log begins with;
    // later ones (a learner added) do not change that.
    s.set_conf_state(conf(&[1, 2, 3], &[]));
    s.set_conf_state(conf(&[1, 2, 3], &[4]));
    s.append(&[entry(1, 1, b"a"), entry(2, 1, b"b")]).unwrap();
    assert!(!s.begins_without(2));
    assert!(s.begins_without(4));
    // Once compacted, the log begins with a snapshot that carries its
    // configuration: anyone may be sent what follows it.
    s.compact_to(1, b"snap".to_vec()).unwrap();
    assert!(!s.begins_without(4));
    assert_eq!(
        s.snapshot(1, 4).unwrap().get_metadata().get_conf_state(),
        &conf(&[1, 2, 3], &[4])
    );
}

#[test]
fn wal_recovers_what_was_synced_and_cuts_a_torn_tail() {
    let disk = MemDisk::new();
    let (mut wal, rec) = Wal::open(disk.clone()).unwrap();
    assert!(rec.fresh);
    wal.stage_epoch(1);
    wal.stage_entries(&[entry(1, 1, b"a"), entry(2, 1, b"b")]);
    wal.stage_hard_state(&hs(1, 1, 1));
    wal.flush(false).unwrap();
    // A commit-only batch is not synced.
    wal.stage_commit(2);
    wal.flush(false).unwrap();
    assert!(disk.unsynced() > 0);
    for keep in 0..disk.unsynced() {
        let d = MemDisk::new();
        d.inner.borrow_mut().data = disk.inner.borrow().data.clone();
        d.inner.borrow_mut().synced = disk.inner.borrow().synced;
        d.crash(keep);
        let (_, rec) = Wal::open(d.clone()).unwrap();
        assert_eq!(rec.store.last(), 2);
        assert_eq!(rec.store.hard_state().commit, 1, "keep {keep}");
        let data = disk.inner.borrow().data.clone();
        let synced = disk.inner.borrow().synced;
        let tail = &data[synced..synced + keep];
        let nonzero = tail.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
        assert_eq!(rec.torn_bytes as usize, nonzero, "keep {keep}");
        assert_eq!(rec.epoch, 1);
        // The torn bytes are gone from the disk too.
        let (_, again) = Wal::open(d).unwrap();
        assert_eq!(again.torn_bytes, 0);
    }
    // A flipped byte in the last record cuts it; everything before stays.
    let len = disk.len();
    disk.corrupt_byte(len - 1);
    let (_, rec) = Wal::open(disk.clone()).unwrap();
    assert_eq!(rec.store.hard_state().commit, 1);
    assert_eq!(rec.store.last(), 2);
}

#[test]
fn a_turns_batches_are_one_write_and_a_lone_commit_rides_the_next() {
    let disk = MemDisk::new();
    let (mut wal, _) = Wal::open(disk.clone()).unwrap();
    // Three Readys in one turn: entries, a commit-only hard state, more
    // entries. Nothing reaches the disk until the turn's write.
    wal.stage_entries(&[entry(1, 1, b"a")]);
    wal.stage_hard_state(&hs(1, 1, 0));
    wal.end_batch(true);
    wal.stage_hard_state(&hs(1, 1, 1));
    wal.end_batch(false);
    wal.stage_entries(&[entry(2, 1, b"b")]);
    wal.end_batch(true);
    assert_eq!(disk.appends(), 0);
    assert!(wal.sync_owed());
    wal.write(false).unwrap();
    assert_eq!(disk.appends(), 1, "one write for the turn");
    wal.sync().unwrap();
    assert_eq!(disk.syncs(), 1);
    // A turn whose only record is a commit index writes nothing ...
    wal.stage_hard_state(&hs(1, 1, 2));
    wal.end_batch(false);
    wal.write(false).unwrap();
    assert_eq!(disk.appends(), 1);
    assert!(!wal.sync_owed(), "a lagging commit needs no fsync");
    // ... and rides the next write that must happen, in order.
    wal.stage_entries(&[entry(3, 1, b"c")]);
    wal.end_batch(true);
    wal.write(false).unwrap();
    assert_eq!(disk.appends(), 2);
    wal.start_sync().unwrap();
    // While that fsync runs, a turn's records wait: the next fsync writes
    // them, with one write, before it starts.
    disk.hold_syncs(true);
    wal.stage_entries(&[entry(4, 1, b"d")]);
    wal.end_batch(true);
    wal.write(false).unwrap();
    assert_eq!(disk.appends(), 2);
    assert!(wal.poll_sync().is_none());
    disk.hold_syncs(false);
    assert!(matches!(wal.poll_sync(), Some(Ok(()))));
    wal.start_sync().unwrap();
    assert_eq!(disk.appends(), 3);
    assert!(matches!(wal.poll_sync(), Some(Ok(()))));
    let (_, rec) = Wal::open(disk.clone()).unwrap();
    assert_eq!(rec.store.last(), 4);
    assert_eq!(rec.store.hard_state().commit, 2);
    // A sync owed by staged records writes them first: it never covers
    // less than what raft was told is on the way.
    wal.stage_entries(&[entry(5, 1, b"e")]);
    wal.end_batch(true);
    wal.sync().unwrap();
    assert_eq!(disk.appends(), 4);
    disk.crash(0);
    let (_, rec) = Wal::open(disk).unwrap();
    assert_eq!(rec.store.last(), 5, "the synced entry survives a power cut");
}

#[test]
fn rewrite_keeps_snapshot_and_tail() {
    let disk = MemDisk::new();
    let (mut wal, _) = Wal::open(disk.clone()).unwrap();
    let mut s = LogStore::new();
    let cs = ConfState {
        voters: vec![1, 2, 3],
        ..ConfState::default()
    };
    s.set_conf_state(cs.clone());
    let ents: Vec<Entry> = (1..=5).map(|i| entry(i, 1, b"e")).collect();
    s.append(&ents).unwrap();
    s.set_hard_state(hs(1, 2, 4));
    wal.stage_entries(&ents);
    wal.flush(true).unwrap();
    wal.stage_self(77);
    wal.stage_peer(2, 88);
    wal.flush(false).unwrap();
    s.compact_to(3, b"table".to_vec()).unwrap();
    wal.rewrite(&s, 7).unwrap();
    let (_, rec) = Wal::open(disk).unwrap();
    assert_eq!(rec.epoch, 7);
    assert_eq!(rec.identity.uuid, 77);
    assert_eq!(rec.identity.peers.get(&2), Some(&88));
    assert_eq!(rec.store.first_index().unwrap(), 4);
    assert_eq!(rec.store.last(), 5);
    assert_eq!(rec.store.latest_snapshot().data[..], b"table"[..]);
    assert_eq!(rec.store.conf_state().voters, vec![1, 2, 3]);
    assert_eq!(rec.store.hard_state().commit, 4);
}

#[test]
fn a_snapshot_bigger_than_256_mib_survives_compaction_and_restart() {
    // A full table of long keys makes a snapshot this big. Recovery once
    // cut records over 256 MiB as torn, and with it the conf state,
    // entries and hard state the compacted log writes after it.
    let disk = MemDisk::new();
    let (mut wal, _) = Wal::open(disk.clone()).unwrap();
    let mut s = LogStore::new();
    s.set_conf_state(ConfState {
        voters: vec![1, 2, 3],
        ..ConfState::default()
    });
    let ents: Vec<Entry> = (1..=4).map(|i| entry(i, 3, b"e")).collect();
    s.append(&ents).unwrap();
    s.set_hard_state(hs(3, 2, 3));
    let table = vec![0x5a; (256 << 20) + 1];
    s.compact_to(3, table).unwrap();
    wal.rewrite(&s, 9).unwrap();
    drop(wal);
    drop(s);
    let (_, rec) = Wal::open(disk).unwrap();
    assert_eq!(rec.torn_bytes, 0);
    assert_eq!(rec.store.latest_snapshot().data.len(), (256 << 20) + 1);
    assert_eq!(rec.store.conf_state().voters, vec![1, 2, 3]);
    assert_eq!(rec.store.last(), 4);
    let h = rec.store.hard_state();
    assert_eq!((h.term, h.vote, h.commit), (3, 2, 3));
}

#[test]
fn a_checked_record_of_kind_zero_is_a_torn_tail_not_corruption() {
    let disk = MemDisk::new();
    let (mut wal, _) = Wal::open(disk.clone()).unwrap();
    wal.stage_epoch(2);
    wal.flush(true).unwrap();
    let log_bytes = wal.log_bytes();
    // Kind 0 is never written: a length that reached the disk over
    // zeros, whose checksum happens to match.
    let mut bad = Vec::new();
    push_record(&mut bad, 0, &[0, 0, 0]);
    disk.clone().append(&bad, true).unwrap();
    let (_, rec) = Wal::open(disk.clone()).unwrap();
    assert_eq!(rec.epoch, 2);
    assert_eq!(rec.log_bytes, log_bytes);
    assert_eq!(disk.len() as u64, log_bytes, "cut off");
}

#[test]
fn file_disk_roundtrips_and_truncates() {
    let dir = std::env::temp_dir().join(format!("ticketd-wal-test-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    let log_bytes = {
        let (mut wal, rec) = Wal::open(FileDisk::open(&dir).unwrap()).unwrap();
        assert!(rec.fresh);
        wal.stage_epoch(3);
        wal.stage_entries(&[entry(1, 1, b"a")]);
        wal.flush(true).unwrap();
        wal.log_bytes()
    };
    let wal_len = fs::metadata(dir.join("wal")).unwrap().len();
    assert!(wal_len >= log_bytes + PREALLOC_BYTES, "zeros written ahead");
    // A crash tore the next record inside the zeros: its length and
    // part of its body reached the disk, its checksum did not.
    let f = OpenOptions::new()
        .write(true)
        .open(dir.join("wal"))
        .unwrap();
    f.write_all_at(&[0, 0, 0, 50], log_bytes).unwrap();
    f.write_all_at(&[1, 2], log_bytes + 8).unwrap();
    drop(f);
    let (_, rec) = Wal::open(FileDisk::open(&dir).unwrap()).unwrap();
    assert_eq!(rec.log_bytes, log_bytes);
    assert_eq!(rec.torn_bytes, 10, "from its length to its last byte");
    assert_eq!(
        fs::metadata(dir.join("wal")).unwrap().len(),
        log_bytes,
        "cut at the log's end, zeros and all"
    );
    assert_eq!(rec.epoch, 3);
    assert_eq!(rec.store.last(), 1);
    let (_, rec) = Wal::open(FileDisk::open(&dir).unwrap()).unwrap();
    assert_eq!(rec.torn_bytes, 0);
    fs::remove_dir_all(&dir).unwrap();
}

/// The log and its replacement are private and never written through
/// a planted `wal.tmp` symlink.
#[test]
fn file_disk_files_are_private_and_a_planted_temp_link_is_not_followed() {
    use std::os::unix::fs::PermissionsExt;
    let base = std::env::temp_dir().join(format!("ticketd-wal-mode-{}", std::process::id()));
    let _ = fs::remove_dir_all(&base);
    let dir = base.join("node");
    let mut disk = FileDisk::open(&dir).unwrap();
    let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("wal")), 0o600);
    let victim = base.join("victim");
    fs::write(&victim, "keep").unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("wal.tmp")).unwrap();
    disk.replace(b"compacted").unwrap();
    assert_eq!(fs::read_to_string(&victim).unwrap(), "keep");
    assert_eq!(fs::read(dir.join("wal")).unwrap(), b"compacted");
    assert_eq!(mode(&dir.join("wal")), 0o600);
    drop(disk);
    fs::remove_dir_all(&base).unwrap();
}

//! Single mode's service and its files on disk, against real temporary
//! directories.

use super::bound::BOUND_HEADER;
use super::mark::read_mark;
use super::*;
use crate::proto::Reply;
use std::fs;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ticketd-single-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    d
}

fn grant(s: &mut SingleService, key: &str, out: &mut Outbox) -> Option<u64> {
    out.clear();
    s.request(
        Millis(0),
        1,
        Request::Acquire {
            wait_s: 0,
            lease_s: 1,
            owner: 1,
            key,
        },
        out,
    );
    let r = out.iter().next().map(|a| a.reply);
    match r {
        Some(Reply::Acquired { token, .. }) => Some(token),
        _ => None,
    }
}

#[test]
fn a_reopened_data_dir_resumes_above_every_token_issued_before() {
    let dir = temp_dir("reopen");
    let mut out = Outbox::new();
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    let t1 = grant(&mut s, "a", &mut out).unwrap();
    assert_eq!(t1 >> token::RANDOM_BITS, 1, "{t1}: the first sequence step");
    let first_mark = s.durable_mark().unwrap();
    assert!(first_mark >= t1 + TOKEN_BLOCK - token::STEP);
    drop(s);
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    let t2 = grant(&mut s, "b", &mut out).unwrap();
    assert!(t2 > first_mark, "{t2} must be above the whole first block");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn only_a_service_with_a_data_dir_withholds_grants() {
    let s = SingleService::with_wall_clock_seed(EngineLimits::default());
    assert!(
        !s.withholds_grants(),
        "no data dir: end_turn never withholds"
    );
    let dir = temp_dir("withholds");
    let s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    assert!(
        s.withholds_grants(),
        "a failed bound write withholds grants"
    );
    drop(s);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn end_turn_moves_the_mark_before_the_block_runs_out() {
    let dir = temp_dir("advance");
    let mut out = Outbox::new();
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    let first_mark = s.durable_mark().unwrap();
    // Pretend most of the block was used.
    s.engine.raise_next_token(first_mark - TOKEN_BLOCK / 4);
    s.end_turn(Millis(0), &mut out).unwrap();
    let mark = s.durable_mark().unwrap();
    assert!(mark > first_mark);
    assert_eq!(read_mark(&dir, &[]).unwrap().mark, mark);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn no_token_above_the_durable_mark_when_persisting_fails() {
    let dir = temp_dir("fail");
    let mut out = Outbox::new();
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    let mark = s.durable_mark().unwrap();
    // The mark ends a sequence step: the last step below it is durable.
    assert_eq!(mark & token::RANDOM_MASK, token::RANDOM_MASK);
    let last_step = mark - token::RANDOM_MASK;
    s.engine.raise_next_token(last_step);
    // The directory disappears: the next write fails.
    fs::remove_dir_all(&dir).unwrap();
    s.end_turn(Millis(0), &mut out).unwrap();
    assert_eq!(s.durable_mark(), Some(mark));
    let x = grant(&mut s, "x", &mut out).expect("the last durable step");
    assert!(
        (last_step..=mark).contains(&x),
        "{x} in the last durable step"
    );
    assert_eq!(grant(&mut s, "y", &mut out), None, "above the mark: Busy");
    // The disk comes back: the next attempt persists and grants resume.
    fs::create_dir_all(&dir).unwrap();
    s.end_turn(Millis(MARK_RETRY_MS), &mut out).unwrap();
    assert!(s.durable_mark().unwrap() > mark);
    let y = grant(&mut s, "y", &mut out).unwrap();
    assert_eq!(
        y >> token::RANDOM_BITS,
        (mark >> token::RANDOM_BITS) + 1,
        "{y}"
    );
    fs::remove_dir_all(&dir).unwrap();
}

/// A failing disk is tried again after a pause, not on every loop turn
/// (an attempt can block in fsync for as long as the disk takes).
#[test]
fn a_failed_mark_write_is_retried_after_a_pause_not_every_turn() {
    let dir = temp_dir("retry");
    let mut out = Outbox::new();
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    let mark = s.durable_mark().unwrap();
    s.engine.raise_next_token(mark - 10);
    fs::remove_dir_all(&dir).unwrap();
    s.end_turn(Millis(1_000), &mut out).unwrap();
    assert_eq!(s.durable_mark(), Some(mark));
    // The loop wakes for the retry.
    assert_eq!(s.next_deadline(), Some(Millis(1_000 + MARK_RETRY_MS)));
    fs::create_dir_all(&dir).unwrap();
    // Turns within the pause do not touch the disk.
    for now in [1_000, 1_001, 1_000 + MARK_RETRY_MS - 1] {
        s.end_turn(Millis(now), &mut out).unwrap();
        assert_eq!(s.durable_mark(), Some(mark), "at {now} ms");
        assert!(!dir.join(MARK_FILE).exists(), "at {now} ms");
    }
    s.end_turn(Millis(1_000 + MARK_RETRY_MS), &mut out).unwrap();
    assert!(s.durable_mark().unwrap() > mark);
    assert_eq!(
        read_mark(&dir, &[]).unwrap().mark,
        s.durable_mark().unwrap()
    );
    assert_eq!(s.next_deadline(), None, "nothing left to retry");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_data_dir_serves_one_process_at_a_time() {
    let dir = temp_dir("locked");
    let first = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    let e = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
    drop(first);
    SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_corrupt_mark_refuses_to_start() {
    let dir = temp_dir("corrupt");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(MARK_FILE), "garbage\n").unwrap();
    let e = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_wall_clock_seed_counts_steps_of_four_microseconds_from_2026() {
    let epoch = UNIX_EPOCH + std::time::Duration::from_secs(WALL_SEED_EPOCH_S);
    let at = |us: u64| wall_clock_seed(epoch + std::time::Duration::from_micros(us));
    assert_eq!(wall_clock_seed(UNIX_EPOCH), token::STEP, "before the epoch");
    assert_eq!(at(4_000), 1_000 * token::STEP);
    assert_eq!(at(4_003), 1_000 * token::STEP);
    assert_eq!(at(4_004), 1_001 * token::STEP);
    // Above every token an older ticketd seeded (microseconds since 1970).
    let now = SingleService::with_wall_clock_seed(EngineLimits::default());
    let old_seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros();
    assert!(u128::from(now.engine().next_token()) > old_seed * 100);
    // The 48-bit sequence lasts until 2061.
    let year_2061 = UNIX_EPOCH + std::time::Duration::from_secs(2_871_763_200);
    assert!(wall_clock_seed(year_2061) < u64::MAX - token::RANDOM_MASK);
}

fn acquire(s: &mut SingleService, now: u64, key: &str, lease_s: u8, out: &mut Outbox) -> String {
    out.clear();
    s.request(
        Millis(now),
        1,
        Request::Acquire {
            wait_s: 0,
            lease_s,
            owner: 1,
            key,
        },
        out,
    );
    s.end_turn(Millis(now), out).unwrap();
    format!("{:?}", out.iter().next().map(|a| a.reply))
}

fn host(boot: &str, boottime_ms: u64, wall_ms: u64) -> HostTime {
    HostTime {
        boot_id: Some(boot.into()),
        boottime_ms: Some(boottime_ms),
        wall_ms,
    }
}

#[test]
fn the_grace_is_measured_on_the_clock_that_survived_the_restart() {
    let written = host("boot-a", 10_000, 1_000_000);
    let record = LeaseRecord::at(Millis(5_000), Millis(0), &written, 30);
    assert_eq!(LeaseRecord::parse(&record.line()), Some(record.clone()));
    // Same boot, 2 s later on CLOCK_BOOTTIME (whatever the wall clock says).
    assert_eq!(
        grace_for(&LeaseRecord::Damaged, &written).0,
        255_000 + LEASE_BOUND_STEP_MS
    );
    let (ms, why) = grace_for(&record, &host("boot-a", 12_000, 0));
    assert_eq!((ms, why), (3_000, "same boot: CLOCK_BOOTTIME"));
    assert_eq!(grace_for(&record, &host("boot-a", 20_000, 0)).0, 0);
    // Rebooted, the wall clock 1 s later than the writing.
    let (ms, why) = grace_for(&record, &host("boot-b", 50, 1_001_000));
    assert_eq!((ms, why), (4_000, "after a reboot: the wall clock"));
    // Rebooted with a wall clock before the writing: the full longest
    // lease of the writer.
    let (ms, _) = grace_for(&record, &host("boot-b", 50, 999_999));
    assert_eq!(ms, 30_000 + LEASE_BOUND_STEP_MS);
    // No real-time clock: the host boots at the epoch.
    let (ms, why) = grace_for(&record, &host("boot-b", 50, 0));
    assert_eq!(ms, 30_000 + LEASE_BOUND_STEP_MS, "{why}");
    // No boot id or boot time readable now: the wall clock decides.
    let blind = HostTime {
        boot_id: None,
        boottime_ms: None,
        wall_ms: 1_002_000,
    };
    assert_eq!(grace_for(&record, &blind).0, 3_000);
    assert_eq!(grace_for(&LeaseRecord::Nothing, &written).0, 0);
    assert_eq!(grace_for(&LeaseRecord::Unknown, &written).0, 0);
    assert_eq!(
        LeaseRecord::at(Millis(5), Millis(5), &written, 30),
        LeaseRecord::Nothing
    );
}

#[test]
fn a_crash_with_a_lease_out_holds_every_key_after_the_restart() {
    let dir = temp_dir("grace-crash");
    let mut out = Outbox::new();
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    assert_eq!(s.engine().restart_grace(Millis(0)), None);
    assert!(acquire(&mut s, 0, "a", 5, &mut out).contains("Acquired"));
    let bound = s.durable_lease_bound().unwrap();
    assert!(bound >= Millis(5_001), "the grant moved the bound: {bound}");
    // A shorter lease within the bound writes nothing more.
    assert!(acquire(&mut s, 10, "b", 2, &mut out).contains("Acquired"));
    assert_eq!(s.durable_lease_bound(), Some(bound));
    let text = fs::read_to_string(dir.join(BOUND_FILE)).unwrap();
    assert!(text.contains("leases until boot_id="), "{text}");
    drop(s); // a crash: no stop
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    let until = s.engine().restart_grace(Millis(0)).expect("a grace");
    assert!(until >= Millis(4_000) && until <= Millis(6_001), "{until}");
    assert!(
        s.describe().contains("restart_grace=in-force"),
        "{}",
        s.describe()
    );
    for key in ["a", "other"] {
        assert!(
            acquire(&mut s, 0, key, 5, &mut out).contains("Timeout"),
            "{key}"
        );
    }
    let after = until.0;
    assert!(acquire(&mut s, after, "a", 5, &mut out).contains("Acquired"));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_clean_stop_records_what_is_outstanding() {
    let dir = temp_dir("grace-stop");
    let mut out = Outbox::new();
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    assert!(acquire(&mut s, 0, "a", 30, &mut out).contains("Acquired"));
    // Stopped with the key held: the next start holds keys.
    s.stop(Millis(0));
    drop(s);
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    assert!(s.engine().restart_grace(Millis(0)).is_some());
    // Stopped with nothing held (the grace is over, nothing granted).
    let over = s.engine().restart_grace(Millis(0)).unwrap();
    s.stop(over);
    drop(s);
    let text = fs::read_to_string(dir.join(BOUND_FILE)).unwrap();
    assert!(text.contains("leases none"), "{text}");
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    assert_eq!(s.engine().restart_grace(Millis(0)), None);
    assert!(
        s.describe().contains("restart_grace=none"),
        "{}",
        s.describe()
    );
    assert!(acquire(&mut s, 0, "a", 30, &mut out).contains("Acquired"));
    // Off: no grace, but the bound is still kept for a later `auto`.
    drop(s);
    let mut s = SingleService::with_data_dir_grace(
        EngineLimits::default(),
        &dir,
        RestartGrace::Off,
        DEFAULT_MAX_LEASE_S,
    )
    .unwrap();
    assert_eq!(s.engine().restart_grace(Millis(0)), None);
    assert!(
        s.describe().contains("restart_grace=off"),
        "{}",
        s.describe()
    );
    assert!(acquire(&mut s, 0, "a", 30, &mut out).contains("Acquired"));
    drop(s);
    let s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    assert!(s.engine().restart_grace(Millis(0)).is_some());
    drop(s);
    fs::remove_dir_all(&dir).unwrap();
}

/// A lease bound that is damaged or was removed holds every key for the
/// protocol's longest lease: the start cannot know less.
#[test]
fn a_damaged_or_removed_lease_bound_holds_keys_for_the_longest_lease() {
    let dir = temp_dir("grace-damaged");
    drop(SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap());
    let longest = Millis(255_000 + LEASE_BOUND_STEP_MS);
    let path = dir.join(BOUND_FILE);
    let mut bytes = fs::read(&path).unwrap();
    bytes[3] ^= 1;
    fs::write(&path, &bytes).unwrap();
    let s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    assert_eq!(s.engine().restart_grace(Millis(0)), Some(longest));
    drop(s);
    fs::remove_file(&path).unwrap();
    let s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    assert_eq!(s.engine().restart_grace(Millis(0)), Some(longest));
    drop(s);
    fs::remove_dir_all(&dir).unwrap();
}

/// Grants and extends within the durable bound write nothing; the first
/// one whose lease passes it moves the bound (one write, before the
/// reply goes out), an extend like a grant.
#[test]
fn the_bound_moves_in_steps_not_per_grant_and_extends_move_it_too() {
    let dir = temp_dir("grace-steps");
    let mut out = Outbox::new();
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    assert_eq!(s.lease_bound_writes(), Some(1), "the start's own write");
    assert!(acquire(&mut s, 0, "k0", 5, &mut out).contains("Acquired"));
    assert_eq!(s.lease_bound_writes(), Some(2));
    let bound = s.durable_lease_bound().unwrap();
    assert_eq!(bound, Millis(5_001 + LEASE_BOUND_STEP_MS));
    // 500 grants in the step's first 900 ms: no further write.
    for i in 1..=500_u64 {
        let key = format!("k{i}");
        assert!(acquire(&mut s, i * 9 / 5, &key, 5, &mut out).contains("Acquired"));
    }
    assert_eq!(s.lease_bound_writes(), Some(2), "no write per grant");
    // An extend that carries a lease past the bound moves it first.
    let token = s.engine().holder(Millis(900), "k0").unwrap().0;
    out.clear();
    s.request(
        Millis(900),
        1,
        Request::Extend {
            lease_s: 10,
            token,
            key: "k0",
        },
        &mut out,
    );
    s.end_turn(Millis(900), &mut out).unwrap();
    assert!(
        format!("{:?}", out.iter().next().map(|a| a.reply)).contains("Extended"),
        "the extend is answered"
    );
    assert_eq!(s.lease_bound_writes(), Some(3));
    assert_eq!(
        s.durable_lease_bound(),
        Some(Millis(10_901 + LEASE_BOUND_STEP_MS))
    );
    // What is on disk is that bound: a crash now holds keys until it.
    drop(s);
    let s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    let until = s.engine().restart_grace(Millis(0)).expect("a grace");
    assert!(until > Millis(10_000) && until <= Millis(11_901), "{until}");
    drop(s);
    fs::remove_dir_all(&dir).unwrap();
}

/// Writes a sealed lease bound record by hand, as an earlier run (on
/// this boot or another) would have left it.
fn plant_bound(dir: &Path, line: &str) {
    let body = format!("{BOUND_HEADER}\n{line}\n");
    fs::write(dir.join(BOUND_FILE), datadir::seal(&body)).unwrap();
}

/// The real start path, with the real clocks, on bounds an earlier run
/// on this boot or before a reboot (another boot id) left: each case of
/// the module documentation picks its clock and says so.
// Long because it is one table of cases, each a few lines.
#[test]
fn a_start_measures_the_bound_on_the_clock_its_case_calls_for() {
    let dir = temp_dir("grace-clocks");
    drop(SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap());
    let now = HostTime::read();
    let boot = now.boot_id.clone().unwrap();
    let boottime = now.boottime_ms.unwrap();
    let wall = now.wall_ms;
    let start = |dir: &Path| {
        let s = SingleService::with_data_dir(EngineLimits::default(), dir).unwrap();
        let left = s.engine().restart_grace(Millis(0)).map_or(0, |u| u.0);
        (left, s.describe())
    };
    // Same boot: CLOCK_BOOTTIME, whatever the wall clock record says.
    plant_bound(
        &dir,
        &format!(
            "leases until boot_id={boot} boottime_ms={} wall_ms=1 written_wall_ms=1 \
             max_lease_s=30",
            boottime + 4_000
        ),
    );
    let (left, line) = start(&dir);
    assert!((3_000..=4_000).contains(&left), "{left} ms: {line}");
    assert!(line.contains("same boot: CLOCK_BOOTTIME"), "{line}");
    assert!(
        line.contains("until 20"),
        "the start-up line says until when: {line}"
    );
    // Another boot: the wall clock (CLOCK_BOOTTIME of that boot means
    // nothing here).
    plant_bound(
        &dir,
        &format!(
            "leases until boot_id=another-boot boottime_ms={} wall_ms={} \
             written_wall_ms={} max_lease_s=30",
            boottime + 100_000,
            wall + 4_000,
            wall - 1_000
        ),
    );
    let (left, line) = start(&dir);
    assert!((3_000..=4_000).contains(&left), "{left} ms: {line}");
    assert!(line.contains("after a reboot: the wall clock"), "{line}");
    // Another boot, the wall clock before the record's writing (set
    // back, or no real-time clock): the writer's full longest lease.
    plant_bound(
        &dir,
        &format!(
            "leases until boot_id=another-boot boottime_ms=5 wall_ms={} \
             written_wall_ms={} max_lease_s=30",
            wall + 86_400_000 + 1_000,
            wall + 86_400_000
        ),
    );
    let (left, line) = start(&dir);
    assert_eq!(left, 30_000 + LEASE_BOUND_STEP_MS, "{line}");
    assert!(line.contains("the full longest lease"), "{line}");
    // A record that claims more than its own longest lease is held to it.
    plant_bound(
        &dir,
        &format!(
            "leases until boot_id=another-boot boottime_ms=5 wall_ms={} \
             written_wall_ms=0 max_lease_s=3",
            wall + 86_400_000
        ),
    );
    assert_eq!(start(&dir).0, 3_000 + LEASE_BOUND_STEP_MS);
    // An over-long file is not read whole: damaged, the longest lease.
    fs::write(dir.join(BOUND_FILE), vec![b'x'; 1 << 20]).unwrap();
    assert_eq!(start(&dir).0, 255_000 + LEASE_BOUND_STEP_MS);
    fs::remove_dir_all(&dir).unwrap();
}

/// A grant past the durable bound whose write fails stops every grant
/// until the bound is on disk.
#[test]
fn no_grant_while_the_lease_bound_cannot_be_written() {
    let dir = temp_dir("grace-fail");
    let mut out = Outbox::new();
    let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
    // A descriptor that refuses writes stands in for a failing disk.
    let good = std::mem::replace(
        &mut s.store.as_mut().unwrap().bound_file,
        File::open("/dev/null").unwrap(),
    );
    // The grant of the failing turn is withheld: no reply at all.
    assert_eq!(acquire(&mut s, 0, "a", 5, &mut out), "None");
    assert!(s.engine().holder(Millis(0), "a").is_some());
    assert!(acquire(&mut s, 1, "b", 5, &mut out).contains("Busy"));
    s.store.as_mut().unwrap().bound_file = good;
    assert!(acquire(&mut s, MARK_RETRY_MS - 1, "b", 5, &mut out).contains("Busy"));
    assert!(acquire(&mut s, MARK_RETRY_MS, "b", 5, &mut out).contains("Busy"));
    assert!(s.durable_lease_bound().unwrap() >= Millis(5_001));
    assert!(acquire(&mut s, MARK_RETRY_MS + 1, "b", 5, &mut out).contains("Acquired"));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn open_names_the_data_directory_it_cannot_use() {
    let file = temp_dir("open-file");
    fs::write(&file, "not a directory").unwrap();
    let config = Config {
        data_dir: Some(file.clone()),
        ..Config::default()
    };
    match SingleService::open(&config) {
        Err(OpenError::DataDir { dir, source }) => {
            assert_eq!(dir, file);
            assert!(
                source.to_string().contains(&*file.to_string_lossy()),
                "{source}"
            );
        }
        other => panic!("not a data directory error: {other:?}"),
    }
    fs::remove_file(&file).unwrap();
}

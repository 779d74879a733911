//! Restart grace, with the real binary and a data directory: a restart
//! while a lease of the earlier run may still run holds every key until it
//! has ended (acquires get T or queue, releases N), and a clean stop with
//! nothing held lets the next start grant at once. `--max-lease` caps the
//! lease an acquire may ask for (B beyond it).

use ticketd_testkit::process as common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{NoReply, Reply, Ticketd};

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ticketd-grace-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

const LEASE_S: u8 = 5;
/// How long past the lease the grace may last: the bound is written a step
/// ahead ([`ticketd::single::LEASE_BOUND_STEP_MS`]), plus room for a loaded
/// machine.
const LATE: Duration = Duration::from_millis(ticketd::single::LEASE_BOUND_STEP_MS + 2_500);

fn start(dir: &Path, extra: &[&str]) -> Ticketd {
    let mut args = vec!["--data-dir", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    Ticketd::start(&args)
}

/// Holds "held" with a 5 s lease; returns the time just before the acquire
/// was written (the client's lease is counted from then, at the latest).
fn hold(server: &Ticketd) -> Instant {
    let mut c = server.connect();
    let written = Instant::now();
    assert!(matches!(
        c.acquire_reply("held", 1, 0, LEASE_S),
        Reply::Acquired { .. }
    ));
    written
}

// Long because it is one scenario, step by step.
/// After a restart within the lease written at `written`: every key gets T
/// while the lease may run, a waiter queued in the grace is granted at its
/// end, one whose wait runs out first gets T, a release gets N; then A.
fn every_key_waits_for_the_lease(server: &Ticketd, written: Instant) {
    let lease_end = written + Duration::from_secs(u64::from(LEASE_S));
    assert!(
        server.log().contains("restart_grace=in-force for ")
            && server.log().contains(" ms, until 20"),
        "the start-up line names the grace and until when:\n{}",
        server.log()
    );
    let mut waiter = server.connect();
    waiter.acquire("held", 10, 30, LEASE_S);
    // A 1 s wait that surely runs out inside the grace (on a machine so
    // loaded that the restart took most of the lease, this part is skipped).
    let room = Instant::now() + Duration::from_millis(2_500) < lease_end;
    let mut short = server.connect();
    if room {
        short.acquire("other", 11, 1, LEASE_S);
    }
    let mut c = server.connect();
    assert!(matches!(
        c.release_reply("held", 1),
        Reply::NotReleased { .. }
    ));
    // Nobody can extend the unknown holder's lease, whatever the token.
    for token in [0, 1] {
        c.extend("held", token, LEASE_S);
        assert!(
            matches!(c.recv(), Reply::NotExtended { .. }),
            "token {token}"
        );
    }
    // A short wait runs out inside the grace: T, never the key.
    if room {
        match short.try_recv(Duration::from_secs(3)) {
            Ok(Reply::Timeout { .. }) => assert!(Instant::now() < lease_end, "T came late"),
            other => panic!("the short waiter got {other:?}"),
        }
    } else {
        eprintln!("the restart took most of the lease: the short wait is not checked");
    }
    // wait = 0 on the held key and on any other key: T until the lease
    // has passed, then A.
    let mut owner = 100;
    let mut keys_granted = Vec::new();
    for key in ["held-too", "any-other-key"] {
        loop {
            owner += 1;
            let asked = Instant::now();
            match c.acquire_reply(key, owner, 0, LEASE_S) {
                Reply::Timeout { .. } => {
                    assert!(
                        asked < lease_end + LATE,
                        "{key}: still T long after the lease"
                    );
                }
                Reply::Acquired { .. } => {
                    assert!(
                        Instant::now() >= lease_end,
                        "{key}: granted inside the lease"
                    );
                    keys_granted.push(key);
                    break;
                }
                other => panic!("{key}: {other:?}"),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    assert_eq!(keys_granted.len(), 2);
    // The waiter on the held key was granted at the end of the grace.
    match waiter.try_recv(Duration::from_secs(5)) {
        Ok(Reply::Acquired { .. }) => assert!(Instant::now() >= lease_end),
        other => panic!("the queued waiter got {other:?}"),
    }
}

#[test]
fn after_sigkill_with_a_lease_held_every_key_waits_for_the_lease() {
    let dir = temp_dir("kill");
    let mut server = start(&dir, &[]);
    let written = hold(&server);
    server.signal(libc::SIGKILL);
    server.wait_exit(Duration::from_secs(5)).expect("killed");
    let server = start(&dir, &[]);
    every_key_waits_for_the_lease(&server, written);
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn after_sigterm_with_a_lease_held_every_key_waits_for_the_lease() {
    let dir = temp_dir("term-held");
    let mut server = start(&dir, &[]);
    let written = hold(&server);
    assert_eq!(server.terminate().code(), Some(0));
    assert!(
        server.wait_for_log("leases outstanding", Duration::from_secs(5)),
        "{}",
        server.log()
    );
    let server = start(&dir, &[]);
    every_key_waits_for_the_lease(&server, written);
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn after_sigterm_with_nothing_held_the_next_start_grants_at_once() {
    let dir = temp_dir("term-empty");
    let mut server = start(&dir, &[]);
    let mut c = server.connect();
    let t = c.acquire_reply("k", 1, 0, 200).token();
    assert!(matches!(c.release_reply("k", t), Reply::Released { .. }));
    // A lease that ended before the stop is not outstanding either.
    assert!(c.acquire_reply("short", 2, 0, 1).token() > 0);
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(server.terminate().code(), Some(0));
    assert!(
        server.wait_for_log("no lease outstanding", Duration::from_secs(5)),
        "{}",
        server.log()
    );
    let server = start(&dir, &[]);
    assert!(
        server.log().contains("restart_grace=none"),
        "{}",
        server.log()
    );
    let mut c = server.connect();
    for key in ["k", "short", "new"] {
        assert!(
            matches!(c.acquire_reply(key, 3, 0, 30), Reply::Acquired { .. }),
            "{key}"
        );
    }
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn with_restart_grace_off_a_restart_grants_at_once() {
    let dir = temp_dir("off");
    let mut server = start(&dir, &[]);
    hold(&server);
    server.signal(libc::SIGKILL);
    server.wait_exit(Duration::from_secs(5)).expect("killed");
    let server = start(&dir, &["--restart-grace", "off"]);
    assert!(
        server.log().contains("restart_grace=off"),
        "{}",
        server.log()
    );
    assert!(matches!(
        server.connect().acquire_reply("held", 2, 0, 30),
        Reply::Acquired { .. }
    ));
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_lease_above_max_lease_is_busy() {
    let server = Ticketd::start(&["--max-lease", "10"]);
    assert!(server.log().contains("max_lease_s=10"), "{}", server.log());
    let mut c = server.connect();
    assert!(matches!(c.acquire_reply("k", 1, 0, 11), Reply::Busy { .. }));
    assert!(matches!(
        c.acquire_reply("k", 2, 5, 255),
        Reply::Busy { .. }
    ));
    assert!(matches!(
        c.acquire_reply("k", 3, 0, 10),
        Reply::Acquired { .. }
    ));
    // A Busy acquire never queued: nothing more arrives.
    assert_eq!(
        c.try_recv(Duration::from_millis(200)),
        Err(NoReply::TimedOut)
    );
    // An extend past the maximum is X; within it, E.
    let token = match c.acquire_reply("e", 4, 0, 10) {
        Reply::Acquired { token, .. } => token,
        other => panic!("{other:?}"),
    };
    c.extend("e", token, 11);
    assert!(matches!(c.recv(), Reply::NotExtended { .. }));
    c.extend("e", token, 10);
    assert!(matches!(c.recv(), Reply::Extended { .. }));
}

/// `ticket` says why when a lease above `--max-lease` gets B.
#[test]
fn ticket_names_max_lease_when_a_long_lease_is_busy() {
    let server = Ticketd::start(&["--max-lease", "10"]);
    let addr = server.addr().to_string();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ticket"))
        .args([
            "acquire", "k", "--lease", "30", "--wait", "0", "--server", &addr,
        ])
        .output()
        .expect("run ticket");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(121), "busy: {err}");
    assert!(err.contains("--max-lease"), "{err}");
}

/// `ticket extend` says why when a lease above `--max-lease` gets X, and
/// the grant keeps its lease.
#[test]
fn ticket_names_max_lease_when_a_long_extend_is_refused() {
    let server = Ticketd::start(&["--max-lease", "10"]);
    let addr = server.addr().to_string();
    let mut c = server.connect();
    let token = c.acquire_reply("k", 1, 0, 10).token();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ticket"))
        .args([
            "extend",
            "k",
            &token.to_string(),
            "--lease",
            "30",
            "--server",
            &addr,
        ])
        .output()
        .expect("run ticket");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(123), "not held: {err}");
    assert!(err.contains("--max-lease"), "{err}");
    // Still held under the same token: the refused extend changed nothing.
    c.extend("k", token, 10);
    assert!(matches!(c.recv(), Reply::Extended { .. }));
}

/// A damaged `lease-bound` (one byte changed: its checksum fails) is not
/// trusted and not fatal: the start names the file, holds every key for
/// the protocol's longest lease and says so; `--restart-grace off` (the
/// operator's word that nothing of the earlier run is in use) grants at
/// once and leaves a good bound for the next start. The token mark is
/// untouched by either: tokens go on above the earlier ones.
#[test]
fn a_damaged_lease_bound_holds_every_key_for_the_longest_lease_and_says_so() {
    let dir = temp_dir("damaged");
    let mut server = start(&dir, &[]);
    let before = server.connect().acquire_reply("k", 1, 0, 1).token();
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(server.terminate().code(), Some(0));
    let path = dir.join("lease-bound");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[0] ^= 0x20;
    std::fs::write(&path, &bytes).unwrap();
    let mut server = start(&dir, &[]);
    let log = server.log();
    assert!(
        log.contains(&format!("{} is damaged", path.display()))
            && log.contains("--restart-grace off"),
        "the warning names the file and the way out:\n{log}"
    );
    let ms: u64 = log
        .split("restart_grace=in-force for ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no grace on the start-up line:\n{log}"));
    assert!((255_000..=256_000).contains(&ms), "{ms} ms");
    let mut c = server.connect();
    assert!(matches!(
        c.acquire_reply("k", 2, 0, 5),
        Reply::Timeout { .. }
    ));
    assert!(matches!(
        c.acquire_reply("new", 3, 0, 5),
        Reply::Timeout { .. }
    ));
    // A SIGKILL in that grace leaves it in force for the next start.
    server.signal(libc::SIGKILL);
    server.wait_exit(Duration::from_secs(5)).expect("killed");
    let server = start(&dir, &["--restart-grace", "off"]);
    assert!(
        server.log().contains("restart_grace=off"),
        "{}",
        server.log()
    );
    let after = server.connect().acquire_reply("k", 4, 0, 1).token();
    assert!(after > before, "{after} above {before}");
    drop(server);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("ticketd lease bound v1\n"), "{text:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Without `--data-dir` there is nothing to remember: `--help` and the
/// start-up line say so, and a restart after SIGKILL grants a key that
/// was held at once (only leases and tokens protect its holder).
#[test]
fn without_a_data_dir_there_is_no_grace_and_help_says_why() {
    let help = common::run_ticketd(&["--help"]);
    let text = String::from_utf8_lossy(&help.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        text.contains("Without --data-dir there is nothing to remember and no grace"),
        "{text}"
    );
    let mut server = Ticketd::start(&[]);
    assert!(
        server
            .log()
            .contains("restart_grace=none (no data directory: nothing to remember)"),
        "{}",
        server.log()
    );
    assert!(server.connect().acquire_reply("k", 1, 0, 30).token() > 0);
    server.signal(libc::SIGKILL);
    server.wait_exit(Duration::from_secs(5)).expect("killed");
    let server = Ticketd::start(&[]);
    assert!(matches!(
        server.connect().acquire_reply("k", 2, 0, 30),
        Reply::Acquired { .. }
    ));
}

//! The `ticket` binary against the real server: tokens printed, releases by
//! token from another process, `run` with its environment, its exit status
//! and the termination before the lease ends, and every documented status.

use ticketd_testkit::process as common;
use ticketd_testkit::proxy;

use std::net::TcpListener;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::Ticketd;
use proxy::{Fault, Proxy};

const USAGE: i32 = 64;
const TIMEOUT: i32 = 120;
const BUSY: i32 = 121;
const INDETERMINATE: i32 = 122;
const NOT_HELD: i32 = 123;
const LEASE_ENDED: i32 = 124;
const NOT_FOUND: i32 = 127;

fn ticket(args: &[&str]) -> Output {
    common::bin_command(env!("CARGO_BIN_EXE_ticket"))
        .args(args)
        .output()
        .expect("run ticket")
}

fn status(o: &Output) -> i32 {
    o.status.code().expect("exited normally")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn acquire_prints_a_token_and_another_process_releases_it() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let o = ticket(&["acquire", "job", "--lease", "30", "--server", &addr]);
    assert_eq!(status(&o), 0, "{}", stderr(&o));
    let token: u64 = stdout(&o).trim().parse().expect("a decimal token");
    assert!(token > 0);
    // The lock outlived the process that took it.
    let o = ticket(&["acquire", "job", "--wait", "0", "--server", &addr]);
    assert_eq!(status(&o), TIMEOUT, "{}", stderr(&o));
    assert!(stdout(&o).is_empty());
    let wrong = (token + 1).to_string();
    let o = ticket(&["release", "job", &wrong, "--server", &addr]);
    assert_eq!(status(&o), NOT_HELD, "{}", stderr(&o));
    let t = token.to_string();
    assert_eq!(
        status(&ticket(&["release", "job", &t, "--server", &addr])),
        0
    );
    assert_eq!(
        status(&ticket(&["release", "job", &t, "--server", &addr])),
        NOT_HELD
    );
    let o = ticket(&["acquire", "job", "--wait", "0", "--server", &addr]);
    assert_eq!(status(&o), 0);
    let next: u64 = stdout(&o).trim().parse().unwrap();
    assert!(next > token);
}

#[test]
fn run_exports_the_ticket_and_exits_with_the_commands_status() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let before = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let o = ticket(&[
        "run",
        "report",
        "--lease",
        "20",
        "--server",
        &addr,
        "--",
        "sh",
        "-c",
        "echo \"$TICKET_KEY $TICKET_TOKEN $TICKET_EXPIRES_AT\"; exit 3",
    ]);
    assert_eq!(status(&o), 3, "{}", stderr(&o));
    let out = stdout(&o);
    let fields: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(fields.len(), 3, "{out:?}");
    assert_eq!(fields[0], "report");
    assert!(fields[1].parse::<u64>().unwrap() > 0);
    let expires: u64 = fields[2].parse().unwrap();
    assert!(
        expires >= before + 18 && expires <= before + 21,
        "expiry {expires} for a 20 s lease taken at {before}"
    );
    // Released when the command exited.
    assert_eq!(
        status(&ticket(&[
            "acquire", "report", "--wait", "0", "--server", &addr
        ])),
        0
    );
}

#[test]
fn run_stops_a_command_that_outlives_its_lease_and_frees_the_key() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let start = Instant::now();
    // SIGTERM is ignored (and inherited by sleep): only SIGKILL stops it.
    let o = ticket(&[
        "run",
        "slow",
        "--no-renew",
        "--lease",
        "3",
        "--kill-grace",
        "1",
        "--server",
        &addr,
        "--",
        "sh",
        "-c",
        "trap '' TERM; sleep 30",
    ]);
    let took = start.elapsed();
    assert_eq!(status(&o), LEASE_ENDED, "{}", stderr(&o));
    assert!(stderr(&o).contains("lease"), "{}", stderr(&o));
    assert!(
        took < Duration::from_secs(3),
        "stopped before the lease: {took:?}"
    );
    assert!(took >= Duration::from_millis(1400), "{took:?}");
    // Released, not left to expire.
    assert_eq!(
        status(&ticket(&[
            "acquire", "slow", "--wait", "0", "--server", &addr
        ])),
        0
    );
}

#[test]
fn run_terminates_politely_first() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let o = ticket(&[
        "run",
        "polite",
        "--no-renew",
        "--lease",
        "3",
        "--kill-grace",
        "1",
        "--server",
        &addr,
        "--",
        "sh",
        "-c",
        "trap 'echo got-term; exit 0' TERM; while :; do sleep 0.05; done",
    ]);
    assert_eq!(status(&o), LEASE_ENDED, "{}", stderr(&o));
    assert!(stdout(&o).contains("got-term"), "{}", stdout(&o));
}

#[test]
fn run_does_not_start_the_command_without_the_lock() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let o = ticket(&["acquire", "busy-key", "--server", &addr]);
    assert_eq!(status(&o), 0);
    let o = ticket(&[
        "run", "busy-key", "--wait", "0.3", "--server", &addr, "--", "echo", "ran",
    ]);
    assert_eq!(status(&o), TIMEOUT);
    assert!(!stdout(&o).contains("ran"));
    let o = ticket(&[
        "run",
        "free-key",
        "--server",
        &addr,
        "--",
        "/nonexistent/command",
    ]);
    assert_eq!(status(&o), NOT_FOUND, "{}", stderr(&o));
    assert_eq!(
        status(&ticket(&[
            "acquire", "free-key", "--wait", "0", "--server", &addr
        ])),
        0,
        "released after the failed start"
    );
}

#[test]
fn busy_timeout_and_indeterminate_have_their_own_statuses() {
    let server = Ticketd::start(&["--max-keys", "1"]);
    let addr = server.addr().to_string();
    assert_eq!(status(&ticket(&["acquire", "one", "--server", &addr])), 0);
    let o = ticket(&["acquire", "two", "--server", &addr]);
    assert_eq!(status(&o), BUSY, "{}", stderr(&o));

    let refused = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let o = ticket(&["acquire", "k", "--wait", "0.3", "--server", &refused]);
    assert_eq!(status(&o), TIMEOUT);
    assert!(stderr(&o).contains("no server reachable"), "{}", stderr(&o));
    let o = ticket(&["release", "k", "5", "--server", &refused]);
    assert_eq!(status(&o), TIMEOUT);

    let px = Proxy::start(server.addr());
    px.set_fault(Fault::StallReplies);
    let start = Instant::now();
    let o = ticket(&["acquire", "one", "--wait", "1", "--server", &px.addr()]);
    assert_eq!(status(&o), INDETERMINATE, "{}", stderr(&o));
    assert!(start.elapsed() < Duration::from_secs(3));
}

#[test]
fn usage_errors_and_help() {
    for args in [
        &[][..],
        &["acquire"],
        &["acquire", "k", "--lease", "0"],
        &["acquire", "k", "--lease", "256"],
        &["acquire", "k", "--wait", "-1"],
        &["acquire", "a\nb"],
        &["release", "k", "not-a-number"],
        &["run", "k"],
        &["nonsense"],
    ] {
        let o = ticket(args);
        assert_eq!(status(&o), USAGE, "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).is_empty());
    }
    for args in [
        &["--help"][..],
        &["help"],
        &["acquire", "--help"],
        &["release", "--help"],
        &["run", "--help"],
        &["help", "run"],
    ] {
        let o = ticket(args);
        assert_eq!(status(&o), 0, "{args:?}");
        assert!(stdout(&o).contains("USAGE"), "{args:?}");
    }
    assert!(stdout(&ticket(&["--help"])).contains("124"));
    assert!(stdout(&ticket(&["run", "--help"])).contains("TICKET_EXPIRES_AT"));
}

fn signal(child: &std::process::Child, sig: i32) {
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) on our own child; no memory involved.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

fn wait_with_deadline(
    child: &mut std::process::Child,
    within: Duration,
) -> std::process::ExitStatus {
    let end = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!("ticket did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn run_passes_sigterm_to_the_command_then_releases() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let marker = std::env::temp_dir().join(format!("ticket-cli-test-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let mut child = common::bin_command(env!("CARGO_BIN_EXE_ticket"))
        .args([
            "run",
            "svc",
            "--server",
            &addr,
            "--",
            "sh",
            "-c",
            "trap 'exit 7' TERM; echo \"$TICKET_TOKEN\" > \"$MARKER\"; while :; do sleep 0.05; done",
        ])
        .env("MARKER", &marker)
        .spawn()
        .unwrap();
    // Wait until the command runs under the lock.
    let end = Instant::now() + Duration::from_secs(5);
    while !std::fs::read_to_string(&marker).is_ok_and(|s| s.ends_with('\n')) {
        assert!(Instant::now() < end, "the command never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_file(&marker);
    assert_eq!(
        status(&ticket(&[
            "acquire", "svc", "--wait", "0", "--server", &addr
        ])),
        TIMEOUT,
        "held while the command runs"
    );
    signal(&child, libc::SIGTERM);
    let st = wait_with_deadline(&mut child, Duration::from_secs(5));
    assert_eq!(st.code(), Some(7), "the command's own status");
    assert_eq!(
        status(&ticket(&[
            "acquire", "svc", "--wait", "0", "--server", &addr
        ])),
        0,
        "released after the command exited"
    );
}

#[test]
fn ctrl_c_while_waiting_for_the_lock_ends_ticket_at_once() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    assert_eq!(status(&ticket(&["acquire", "held", "--server", &addr])), 0);
    let mut cmd = common::bin_command(env!("CARGO_BIN_EXE_ticket"));
    cmd.args([
        "run", "held", "--wait", "30", "--server", &addr, "--", "true",
    ]);
    // A shell without job control starts background jobs with SIGINT
    // ignored, and an ignored signal stays ignored across exec: give
    // `ticket` the default disposition a terminal's Ctrl-C meets, however
    // the tests were started.
    // SAFETY: signal(2) is async-signal-safe, as pre_exec requires.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    signal(&child, libc::SIGINT);
    let st = wait_with_deadline(&mut child, Duration::from_secs(5));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGINT));
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[test]
fn a_token_that_cannot_be_printed_is_released_again() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    // A stdout pipe nobody reads: writing the token fails with EPIPE.
    let mut fds = [0 as libc::c_int; 2];
    // Close-on-exec, so that a process another test starts meanwhile does
    // not inherit the read end and keep the pipe open (the spawn below
    // gives `ticket` the write end as its stdout, without the flag).
    // SAFETY: pipe2(2) fills the two-element array we pass.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors were just created and are owned only here.
    let (read_end, write_end) = unsafe {
        use std::os::fd::{FromRawFd, OwnedFd};
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    drop(read_end);
    let o = common::bin_command(env!("CARGO_BIN_EXE_ticket"))
        .args(["acquire", "unprinted", "--server", &addr])
        .stdout(write_end)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
        .wait_with_output()
        .unwrap();
    assert_eq!(status(&o), 125, "{}", stderr(&o));
    assert!(stderr(&o).contains("released"), "{}", stderr(&o));
    assert_eq!(
        status(&ticket(&[
            "acquire",
            "unprinted",
            "--wait",
            "0",
            "--server",
            &addr
        ])),
        0
    );
}

/// `ticket run` renews by default: a command that runs for several leases
/// keeps the lock the whole time, exits 0, and the key is free afterwards.
///
/// Driven by conditions, not by a fixed schedule (a loaded machine may take
/// seconds to start `ticket`): the command marks when it starts (so the
/// lock is held from then on), the key is checked well past the first
/// 3 s lease, and only then is the command told to finish.
#[test]
fn run_renews_the_lock_for_as_long_as_the_command_runs() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let dir = std::env::temp_dir().join(format!("ticket-renews-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (started, finish) = (dir.join("started"), dir.join("finish"));
    let script = format!(
        "touch '{}'; while [ ! -e '{}' ]; do sleep 0.05; done",
        started.display(),
        finish.display()
    );
    let child = common::bin_command(env!("CARGO_BIN_EXE_ticket"))
        .args([
            "run",
            "long",
            "--lease",
            "3",
            "--kill-grace",
            "0.2",
            "--server",
            &addr,
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let wait_start = Instant::now();
    while !started.exists() {
        assert!(
            wait_start.elapsed() < Duration::from_secs(30),
            "the command never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The lock was granted before the command started: a lease and a half
    // later, only renewals can have kept it.
    std::thread::sleep(Duration::from_millis(4500));
    let o = ticket(&["acquire", "long", "--wait", "0", "--server", &addr]);
    assert_eq!(status(&o), 120, "held past its first lease: {}", stderr(&o));
    std::fs::write(&finish, b"").unwrap();
    let out = child.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        status(&ticket(&[
            "acquire", "long", "--wait", "0", "--server", &addr
        ])),
        0,
        "released when the command exited"
    );
}

/// `--max-hold`: renewals stop after S seconds, and the command is then
/// stopped before the last lease ends (exit 124).
#[test]
fn run_max_hold_stops_renewing_then_terminates() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let start = Instant::now();
    let o = ticket(&[
        "run",
        "capped",
        "--lease",
        "2",
        "--kill-grace",
        "0.2",
        "--max-hold",
        "2",
        "--server",
        &addr,
        "--",
        "sleep",
        "30",
    ]);
    let took = start.elapsed();
    assert_eq!(status(&o), LEASE_ENDED, "{}", stderr(&o));
    assert!(
        took >= Duration::from_secs(2),
        "renewed until the max hold: {took:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "stopped within the last lease: {took:?}"
    );
}

/// The server dies while `ticket run` holds a renewed lock: the renewal
/// fails and the command is stopped before the conservative expiry; the
/// final release finds the port refused and `ticket` says so in words, at
/// once.
#[test]
fn run_stops_the_command_before_the_expiry_when_the_server_is_gone() {
    let mut server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let dir = std::env::temp_dir().join(format!("ticket-doomed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pidfile = dir.join("pid");
    let script = format!("echo $$ > {}; exec sleep 30", pidfile.display());
    let start = Instant::now();
    let child = common::bin_command(env!("CARGO_BIN_EXE_ticket"))
        .args([
            "run",
            "doomed",
            "--lease",
            "3",
            "--kill-grace",
            "0.3",
            "--server",
            &addr,
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = loop {
        if let Ok(p) = std::fs::read_to_string(&pidfile) {
            if let Ok(p) = p.trim().parse::<u32>() {
                break p;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the command never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    std::thread::sleep(Duration::from_millis(300));
    server.signal(libc::SIGKILL);
    let _ = server.wait_exit(Duration::from_secs(5));
    let proc_dir = std::path::PathBuf::from(format!("/proc/{pid}"));
    while proc_dir.exists() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let stopped = start.elapsed();
    let out = child.wait_with_output().unwrap();
    let exited = start.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(LEASE_ENDED), "{err}");
    assert!(err.contains("terminated"), "{err}");
    assert!(
        stopped < Duration::from_secs(3),
        "stopped before the 3 s expiry: {stopped:?}"
    );
    assert!(
        exited < stopped + Duration::from_secs(1),
        "the release did not wait for a server that is gone: {exited:?}"
    );
    assert!(err.contains("not released"), "{err}");
    assert!(err.contains("refused"), "{err}");
    assert!(!err.contains("NotSent"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ticket extend KEY TOKEN`: 0 when extended, 123 for a token not held.
#[test]
fn extend_moves_a_lease_by_token() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let o = ticket(&["acquire", "ext", "--lease", "2", "--server", &addr]);
    assert_eq!(status(&o), 0);
    let token = stdout(&o).trim().to_owned();
    let o = ticket(&["extend", "ext", &token, "--lease", "6", "--server", &addr]);
    assert_eq!(status(&o), 0, "{}", stderr(&o));
    std::thread::sleep(Duration::from_millis(2500));
    // Past the first lease, still held.
    assert_eq!(
        status(&ticket(&[
            "acquire", "ext", "--wait", "0", "--server", &addr
        ])),
        120
    );
    let wrong = (token.parse::<u64>().unwrap() + 1).to_string();
    let o = ticket(&["extend", "ext", &wrong, "--server", &addr]);
    assert_eq!(status(&o), 123, "{}", stderr(&o));
    assert!(stderr(&o).contains("not held"), "{}", stderr(&o));
}

/// The processes whose parent is `pid`, from /proc.
fn children_of(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if proc_stat(child).is_some_and(|(_, ppid, _)| ppid == pid) {
            found.push(child);
        }
    }
    found
}

/// State, parent and process group of `pid` from /proc/PID/stat; `None`
/// once it is gone.
fn proc_stat(pid: u32) -> Option<(char, u32, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (in parentheses) may hold spaces: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    let pgid = f.next()?.parse().ok()?;
    Some((state, ppid, pgid))
}

/// Gone, or a zombie nobody reaped yet: either way it runs no more.
fn is_dead(pid: u32) -> bool {
    proc_stat(pid).is_none_or(|(state, _, _)| state == 'Z' || state == 'X')
}

/// Waits until `file` holds a pid.
fn read_pid(file: &std::path::Path, within: Duration) -> u32 {
    let end = Instant::now() + within;
    loop {
        if let Some(p) = std::fs::read_to_string(file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return p;
        }
        assert!(Instant::now() < end, "no pid in {}", file.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `ticket run` SIGKILLed: PR_SET_PDEATHSIG kills only the command, but the
/// guardian kills its whole process group at once, so a grandchild (a
/// shell's background job) does not run on while the lease lapses and
/// another client takes the key.
#[test]
fn a_killed_ticket_run_takes_the_commands_whole_group_with_it() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let dir = std::env::temp_dir().join(format!("ticket-guarded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let grandchild_file = dir.join("grandchild");
    let script = format!(
        "sleep 300 & echo $! > '{}'; wait",
        grandchild_file.display()
    );
    let mut child = common::bin_command(env!("CARGO_BIN_EXE_ticket"))
        .args(["run", "guarded", "--lease", "2", "--server", &addr])
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let grandchild = read_pid(&grandchild_file, Duration::from_secs(10));
    let ticket_pid = child.id();
    let (_, sh, group) = proc_stat(grandchild).expect("the grandchild runs");
    assert_eq!(proc_stat(sh).map(|s| s.1), Some(ticket_pid));
    // Two children: the command and the guardian, outside its group.
    let kids = children_of(ticket_pid);
    assert_eq!(kids.len(), 2, "{kids:?}");
    let guardian = kids.into_iter().find(|&k| k != sh).unwrap();
    assert_ne!(proc_stat(guardian).unwrap().2, group);

    signal(&child, libc::SIGKILL);
    let _ = child.wait();
    let killed = Instant::now();
    while !is_dead(grandchild) {
        assert!(
            killed.elapsed() < Duration::from_secs(1),
            "the grandchild {grandchild} outlived ticket"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    while !is_dead(guardian) {
        assert!(
            killed.elapsed() < Duration::from_secs(2),
            "the guardian stayed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(is_dead(sh));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A normal `ticket run` with its guardian: the guardian holds none of
/// `ticket`'s connections (no socket; it holds no lock), and it is gone
/// when `ticket` exits, leaving the command's own background job alone.
#[test]
fn a_normal_run_leaves_no_guardian_behind() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let dir = std::env::temp_dir().join(format!("ticket-stands-down-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (sh_file, finish) = (dir.join("sh"), dir.join("finish"));
    let script = format!(
        "echo $$ > '{}'; while [ ! -e '{}' ]; do sleep 0.02; done",
        sh_file.display(),
        finish.display()
    );
    let child = common::bin_command(env!("CARGO_BIN_EXE_ticket"))
        .args(["run", "calm", "--server", &addr, "--", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let sh = read_pid(&sh_file, Duration::from_secs(10));
    let kids = children_of(child.id());
    assert_eq!(kids.len(), 2, "{kids:?}");
    let guardian = kids.into_iter().find(|&k| k != sh).unwrap();
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{guardian}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    assert_eq!(fds.len(), 1, "only its pipe: {fds:?}");
    assert!(fds[0].starts_with("pipe:"), "{fds:?}");
    std::fs::write(&finish, b"").unwrap();
    // Its stdout and stderr reach end of file: the guardian kept no copy.
    let out = common::finish(child, Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
    assert!(proc_stat(guardian).is_none(), "the guardian was reaped");
    assert_eq!(
        status(&ticket(&[
            "acquire", "calm", "--wait", "0", "--server", &addr
        ])),
        0
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A lease under 7 s is valid with the default `--kill-grace`: it shrinks
/// to fit (0.75 s for 3 s), so renewal keeps the lock past the lease.
#[test]
fn run_with_a_short_lease_needs_no_kill_grace() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let start = Instant::now();
    let o = ticket(&[
        "run", "short", "--lease", "3", "--server", &addr, "--", "sleep", "3.5",
    ]);
    assert_eq!(status(&o), 0, "{}", stderr(&o));
    assert!(start.elapsed() >= Duration::from_millis(3500));
    let o = ticket(&[
        "run", "short", "--lease", "1", "--server", &addr, "--", "true",
    ]);
    assert_eq!(status(&o), 0, "{}", stderr(&o));
    let o = ticket(&["run", "--help"]);
    assert!(
        stdout(&o).contains("0.5 s after the grant"),
        "{}",
        stdout(&o)
    );
}

/// Nothing listens: `acquire`, `release` and `run` end at once with the
/// address and the refusal, not after the whole default 10 s `--wait`.
#[test]
fn a_refused_connection_ends_ticket_at_once() {
    let refused = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    for args in [
        &["acquire", "k", "--server", &refused][..],
        &["release", "k", "5", "--server", &refused],
        &["run", "k", "--server", &refused, "--", "true"],
    ] {
        let start = Instant::now();
        let o = ticket(args);
        assert_eq!(status(&o), TIMEOUT, "{args:?}: {}", stderr(&o));
        assert!(start.elapsed() < Duration::from_secs(2), "{args:?}");
        let err = stderr(&o);
        assert!(err.contains(&refused), "{err}");
        assert!(err.contains("refused"), "{err}");
    }
}

/// The admin port (HTTP) given as `--server`: still 122, as nothing can
/// be sure, but the message says what answered and which port to give.
#[test]
fn the_admin_port_as_server_is_named_in_words() {
    let server = Ticketd::start(&["--admin-listen", "127.0.0.1:0"]);
    let log = server.log();
    let at = log
        .find("admin port (HTTP) on ")
        .expect("admin start-up line")
        + "admin port (HTTP) on ".len();
    let admin = log[at..].split_whitespace().next().unwrap().to_owned();
    let start = Instant::now();
    let o = ticket(&["acquire", "db", "--server", &admin]);
    assert_eq!(status(&o), INDETERMINATE, "{}", stderr(&o));
    assert!(start.elapsed() < Duration::from_secs(3));
    let err = stderr(&o);
    assert!(err.contains("must be treated as not held"), "{err}");
    assert!(err.contains("answered HTTP"), "{err}");
    assert!(err.contains("ticketd --listen"), "{err}");
}

/// A `ticket run` command without its `--`: the usage error shows the
/// command line with it.
#[test]
fn a_command_without_its_separator_gets_a_suggestion() {
    let o = ticket(&["run", "k", "sleep", "1"]);
    assert_eq!(status(&o), USAGE);
    assert!(
        stderr(&o).contains("ticket run k -- sleep 1"),
        "{}",
        stderr(&o)
    );
}

/// Plaintext `ticket` on a TLS port, and `ticket` without the client
/// certificate a server requires: 122, with the cause and the flags.
#[cfg(feature = "tls")]
#[test]
fn tls_mistakes_are_named_in_words() {
    use ticketd_testkit::certs::Certs;
    let certs = Certs::make("cli-words");
    let mut args = certs.server_args();
    args.extend(["--tls-client-ca".into(), certs.path("ca.pem")]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Ticketd::start(&args);
    let addr = server.addr().to_string();
    let start = Instant::now();
    let o = ticket(&["acquire", "db", "--server", &addr]);
    assert_eq!(status(&o), INDETERMINATE, "{}", stderr(&o));
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(
        stderr(&o).contains("expects a TLS client"),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("--tls-ca"), "{}", stderr(&o));

    let ca = certs.path("ca.pem");
    let start = Instant::now();
    let o = ticket(&["acquire", "db", "--server", &addr, "--tls-ca", &ca]);
    assert_eq!(status(&o), INDETERMINATE, "{}", stderr(&o));
    assert!(start.elapsed() < Duration::from_secs(3));
    let err = stderr(&o);
    assert!(err.contains("requires a client certificate"), "{err}");
    assert!(err.contains("--tls-cert"), "{err}");

    let (cert, key) = (certs.path("client.pem"), certs.path("client-key.pem"));
    let o = ticket(&[
        "acquire",
        "db",
        "--server",
        &addr,
        "--tls-ca",
        &ca,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
    ]);
    assert_eq!(status(&o), 0, "{}", stderr(&o));
}

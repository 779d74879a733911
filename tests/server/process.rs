//! The daemon as a process: command line, exit codes, signals, and fencing
//! tokens that keep increasing across restarts.

use ticketd_testkit::process as common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{run_ticketd, NoReply, Reply, Ticketd};

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ticketd-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn grant(server: &Ticketd, key: &str) -> u64 {
    server.connect().acquire_reply(key, 1, 0, 30).token()
}

#[test]
fn help_lists_every_flag_and_exits_0() {
    let out = run_ticketd(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--listen",
        "--max-conns",
        "--max-keys",
        "--max-waiters",
        "--max-waiters-per-key",
        "--max-key-bytes",
        "--sweep-interval",
        "--data-dir",
        "--log-level",
        "--frame-timeout",
        "--out-soft-limit",
        "--out-hard-limit",
        "--max-frames-per-turn",
        "--restart-grace",
        "--max-lease",
        "--version",
    ] {
        assert!(text.contains(flag), "--help does not mention {flag}");
    }
}

#[test]
fn version_prints_the_crate_version_and_exits_0() {
    let out = run_ticketd(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        format!("ticketd {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn bad_flags_exit_2_with_a_message_naming_the_flag() {
    for (args, needle) in [
        (&["--no-such-flag"][..], "--no-such-flag"),
        (&["--max-conns", "many"][..], "--max-conns"),
        (&["--max-keys", "0"][..], "--max-keys"),
        (&["--listen", "not an address"][..], "--listen"),
        (&["--sweep-interval"][..], "--sweep-interval"),
        (&["--log-level", "chatty"][..], "--log-level"),
        (&["--max-key-bytes", "100000"][..], "--max-key-bytes"),
        (
            &["--out-hard-limit", "2000", "--out-soft-limit", "4000"][..],
            "--out-hard-limit",
        ),
        (
            &["--max-conns", "5", "--max-conns", "6"][..],
            "--max-conns is given more than once",
        ),
        (&["--data-dir", ""][..], "--data-dir"),
        (&["--max-conns=5"][..], "--max-conns 5"),
        (&["--max-conns", "2000000"][..], "--max-conns"),
        (&["--max-lease", "256"][..], "--max-lease"),
        (&["--restart-grace", "on"][..], "--restart-grace"),
    ] {
        let out = run_ticketd(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(out.stdout.is_empty());
    }
}

/// The help allows keys up to 65,536 bytes: the longest starts with the
/// default output limits and is served end to end.
#[test]
fn the_longest_key_the_help_allows_is_served_with_default_limits() {
    let server = Ticketd::start(&["--max-key-bytes", "65536"]);
    let mut c = server.connect();
    let key = "k".repeat(65_536);
    match c.acquire_reply(&key, 1, 0, 30) {
        Reply::Acquired { key: k, .. } => assert_eq!(k, key),
        other => panic!("{other:?}"),
    }
    // One byte more is malformed: only that connection closes.
    let mut bad = server.connect();
    bad.acquire(&"k".repeat(65_537), 2, 0, 30);
    assert!(bad.closed_within(Duration::from_secs(5)));
    assert!(matches!(
        c.acquire_reply("other", 3, 0, 30),
        Reply::Acquired { .. }
    ));
}

/// `--listen` takes IPv6 literals and host names, and reports the address
/// it bound.
#[test]
fn ipv6_loopback_and_a_host_name_can_be_listened_on() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("no IPv6 loopback on this machine; checking the host name only");
    } else {
        let server = Ticketd::start_raw(&[], &["--listen", "[::1]:0"]);
        assert!(server.addr().is_ipv6() && server.addr().port() != 0);
        assert!(matches!(
            server.connect().acquire_reply("v6", 1, 0, 30),
            Reply::Acquired { .. }
        ));
    }
    let server = Ticketd::start_raw(&[], &["--listen", "localhost:0"]);
    assert!(server.addr().ip().is_loopback() && server.addr().port() != 0);
    assert!(matches!(
        server.connect().acquire_reply("name", 1, 0, 30),
        Reply::Acquired { .. }
    ));
}

#[test]
fn an_unusable_data_dir_exits_1_with_a_message() {
    let file = temp_dir("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let out = run_ticketd(&[
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        file.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("data directory"), "{err}");
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn an_address_in_use_exits_1_with_a_message() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let out = run_ticketd(&["--listen", &addr]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("cannot listen on"), "{err}");
}

#[test]
fn the_startup_line_has_version_address_and_limits() {
    let server = Ticketd::start(&["--max-conns", "77"]);
    let log = server.log();
    let line = log.lines().find(|l| l.contains("listening on")).unwrap();
    assert!(line.contains(env!("CARGO_PKG_VERSION")), "{line}");
    assert!(line.contains(&server.addr().to_string()), "{line}");
    assert!(line.contains("max_conns=77"), "{line}");
    assert!(line.contains("max_key_bytes=1024"), "{line}");
    // The next token is nobody's business: it would help a guesser.
    assert!(!line.contains("next_token"), "{line}");
    assert_ne!(server.addr().port(), 0);
}

/// The start-up line is the first line, with the admin port in it, and
/// nothing the server logs while it starts serving comes before it.
#[test]
fn the_startup_line_is_the_first_line_and_names_the_admin_port() {
    let server = Ticketd::start(&["--admin-listen", "127.0.0.1:0", "--max-conns", "77"]);
    // A served request: start-up is over.
    let token = grant(&server, "k");
    assert!(token > 0);
    let log = server.log();
    let first = log.lines().next().unwrap_or_default();
    assert!(first.contains("listening on"), "first line:\n{log}");
    assert!(first.contains("max_conns=77"), "{first}");
    let at = first
        .find("admin port (HTTP) on ")
        .unwrap_or_else(|| panic!("no admin port in the start-up line: {first}"))
        + "admin port (HTTP) on ".len();
    let admin: std::net::SocketAddr = first[at..].trim().parse().expect("admin address");
    assert_ne!(admin.port(), 0);
    std::net::TcpStream::connect(admin).expect("the admin port listens");
    assert!(
        !log.lines().skip(1).any(|l| l.contains("admin port")),
        "the admin port is said once, in the start-up line:\n{log}"
    );
}

#[test]
fn sigterm_exits_0_after_flushing() {
    let mut server = Ticketd::start(&[]);
    let mut holder = server.connect();
    let mut waiter = server.connect();
    holder.acquire_reply("k", 1, 0, 30);
    waiter.acquire("k", 2, 30, 30);
    assert!(waiter.try_recv(Duration::from_millis(100)).is_err());
    let start = Instant::now();
    let status = server.terminate();
    assert_eq!(status.code(), Some(0), "{}", server.log());
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(server.wait_for_log("stopped", Duration::from_secs(5)));
    assert_eq!(
        waiter.try_recv(Duration::from_secs(2)),
        Err(NoReply::Closed)
    );
}

#[test]
fn sigint_exits_0() {
    let mut server = Ticketd::start(&[]);
    let _idle = server.connect();
    server.signal(libc::SIGINT);
    let status = server.wait_exit(Duration::from_secs(5)).expect("exits");
    assert_eq!(status.code(), Some(0));
}

#[test]
fn tokens_after_a_restart_exceed_those_before_it_with_a_data_dir() {
    let dir = temp_dir("restart");
    let d = dir.to_str().unwrap();
    // The keys stay held across each restart: without a restart grace the
    // next start grants them at once (tests/server/restart_grace.rs has the grace).
    let args = ["--data-dir", d, "--restart-grace", "off"];
    let mut server = Ticketd::start(&args);
    let before = grant(&server, "a");
    assert_eq!(server.terminate().code(), Some(0));
    let server = Ticketd::start(&args);
    let after = grant(&server, "a");
    assert!(after > before, "{after} after {before}");
    // A crash (SIGKILL, no clean shutdown) is no different: the mark was
    // durable before the grant was sent.
    let last = grant(&server, "b");
    drop(server); // SIGKILL
    let server = Ticketd::start(&args);
    let again = grant(&server, "a");
    assert!(again > last, "{again} after {last}");
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tokens_after_a_restart_exceed_those_before_it_without_a_data_dir() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    // Several grants, so the second run must beat more than the seed.
    let mut before = 0;
    for i in 0..100 {
        before = c.acquire_reply("k", i, 0, 30).token();
        assert!(matches!(
            c.release_reply("k", before),
            Reply::Released { .. }
        ));
    }
    drop(c);
    drop(server);
    let server = Ticketd::start(&[]);
    let after = grant(&server, "k");
    assert!(after > before, "{after} after {before}");
}

#[test]
fn sigterm_exits_0_within_the_flush_bound_even_if_a_client_never_reads() {
    use std::io::Write;
    let mut server = Ticketd::start(&[]);
    let mut holder = server.connect();
    holder.acquire_reply("k", 1, 0, 30);
    // A client that pipelines and never reads: the server holds unsent
    // replies for it when the signal comes.
    let mut stuck = std::net::TcpStream::connect(server.addr()).unwrap();
    stuck
        .set_write_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let frame = common::acquire_frame("k", 2, 0, 30);
    let batch: Vec<u8> = frame
        .iter()
        .copied()
        .cycle()
        .take(frame.len() * 5000)
        .collect();
    while stuck.write(&batch).is_ok() {}
    let start = Instant::now();
    assert_eq!(server.terminate().code(), Some(0));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(3), "shutdown took {took:?}");
}

#[test]
fn debug_logging_shows_each_request_and_reply() {
    let server = Ticketd::start(&["--log-level", "debug"]);
    let mut c = server.connect();
    c.acquire_reply("dbg-key", 77, 0, 30);
    assert!(server.wait_for_log("owner: 77, key: \"dbg-key\"", Duration::from_secs(2)));
    // The server logs the reply before it writes it, but its stderr is
    // collected by a thread of the test's own: the client can hold the
    // reply before that thread has the line, so it is waited for too.
    let replied = server.wait_for_log("Acquired {", Duration::from_secs(2));
    let log = server.log();
    assert!(log.contains("Acquire {"), "{log}");
    assert!(replied, "{log}");
}

#[test]
fn info_logging_has_no_line_per_request() {
    let mut server = Ticketd::start(&[]);
    let mut c = server.connect();
    for i in 0..20 {
        c.acquire_reply("quiet", i, 0, 30);
    }
    server.terminate();
    assert!(!server.log().contains("quiet"), "{}", server.log());
}

#[test]
fn a_closed_stderr_does_not_take_the_server_down() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = common::bin_command(common::ticketd_bin())
        .args(["--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let addr = common::parse_listen_line(&line).expect("start-up line");
    drop(stderr); // nobody reads the log any more
                  // Malformed frames make the server log warnings into the closed pipe.
    for _ in 0..3 {
        let mut bad = common::Client::connect(addr);
        bad.send(b"X\n");
        assert!(bad.closed_within(Duration::from_secs(3)));
    }
    let mut c = common::Client::connect(addr);
    assert!(matches!(
        c.acquire_reply("k", 1, 0, 30),
        Reply::Acquired { .. }
    ));
    // SIGTERM logs too, and still exits 0.
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}

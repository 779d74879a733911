//! Client security against the real binary: tokens a client cannot guess,
//! and the guess budget that slows down an identity that keeps guessing.

use ticketd_testkit::process as common;

use std::time::{Duration, Instant};

use common::{Reply, Ticketd};
use ticketd::token::{GUESS_BURST, GUESS_PER_SEC, RANDOM_BITS, RANDOM_MASK};

/// The attack that worked when tokens went up by one: acquire keys of your
/// own around the victim's grant and release "one above" and "one below".
/// Each guess is the victim's token with probability 2^-16 only, and is
/// answered `N`.
#[test]
fn neighbouring_tokens_release_nothing() {
    let server = Ticketd::start(&[]);
    let mut attacker = server.connect();
    let mut victim = server.connect();
    let before = attacker.acquire_reply("mine-1", 1, 0, 60).token();
    let held = victim.acquire_reply("victim", 2, 0, 60).token();
    let after = attacker.acquire_reply("mine-2", 3, 0, 60).token();
    assert!(before < held && held < after, "{before} {held} {after}");
    assert_eq!(held >> RANDOM_BITS, (before >> RANDOM_BITS) + 1);
    assert_eq!(after >> RANDOM_BITS, (held >> RANDOM_BITS) + 1);
    for guess in [before + 1, after - 1] {
        if guess != held {
            assert!(matches!(
                attacker.release_reply("victim", guess),
                Reply::NotReleased { .. }
            ));
        }
    }
    assert!(matches!(
        victim.release_reply("victim", held),
        Reply::Released { .. }
    ));
}

/// A release of token 0 is no guess (no grant has token 0): a connection
/// may send any number as barriers and is never slowed down, while the
/// same number of releases of a wrong non-zero token on another
/// connection is.
#[test]
fn releases_of_token_0_are_barriers_not_guesses() {
    let server = Ticketd::start(&[]);
    let held = server.connect().acquire_reply("k", 1, 0, 60).token();
    let n = (GUESS_BURST + 3 * GUESS_PER_SEC) as usize;
    let run = |token: u64| {
        let mut c = server.connect();
        let mut frames = Vec::new();
        for _ in 0..n {
            frames.extend_from_slice(&common::release_frame("k", token));
        }
        let start = Instant::now();
        c.send(&frames);
        for _ in 0..n {
            match c.try_recv(Duration::from_secs(60)) {
                Ok(Reply::NotReleased { token: t, .. }) => assert_eq!(t, token),
                other => panic!("release of token {token} got {other:?}"),
            }
        }
        start.elapsed()
    };
    let barriers = run(0);
    assert!(
        barriers < Duration::from_secs(1),
        "{n} releases of token 0 took {barriers:?}"
    );
    assert!(!server.log().contains("slowing down"), "{}", server.log());
    let guesses = run(held ^ 1);
    assert!(
        guesses >= Duration::from_secs(2),
        "{n} wrong-token releases took only {guesses:?}"
    );
    assert!(server.log().contains("slowing down"), "{}", server.log());
}

/// Tokens differ in their low bits from grant to grant (they are drawn,
/// not counted), and still increase.
#[test]
fn tokens_carry_random_low_bits_and_still_increase() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let mut tokens = Vec::new();
    for i in 0..200 {
        let t = c.acquire_reply("k", i, 0, 5).token();
        assert!(matches!(c.release_reply("k", t), Reply::Released { .. }));
        tokens.push(t);
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
    assert!(tokens
        .windows(2)
        .all(|w| w[1] >> RANDOM_BITS == (w[0] >> RANDOM_BITS) + 1));
    let low: std::collections::BTreeSet<u64> = tokens.iter().map(|t| t & RANDOM_MASK).collect();
    // 200 draws of 16 bits: more than 10 repeats is astronomically unlikely.
    assert!(low.len() > 190, "{} distinct low parts", low.len());
}

/// Protected mode: plaintext on an address that is not loopback is refused
/// (exit 2, saying why and what to do) unless `--insecure` is given, and
/// then the start-up warns.
#[test]
fn protected_mode_refuses_a_listener_off_loopback_without_insecure() {
    for addr in ["0.0.0.0:0", "[::]:0"] {
        let out = common::run_ticketd(&["--listen", addr]);
        assert_eq!(out.status.code(), Some(2), "{addr}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("is not a loopback address") && err.contains("--insecure"),
            "{addr}: {err}"
        );
    }
    let server = Ticketd::start_raw(&[], &["--listen", "0.0.0.0:0", "--insecure"]);
    assert!(
        server.wait_for_log(
            "--insecure: clients speak plaintext",
            Duration::from_secs(5)
        ),
        "{}",
        server.log()
    );
    // It serves (reached over loopback here).
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], server.addr().port()));
    let mut c = common::Client::connect(addr);
    assert!(matches!(
        c.acquire_reply("k", 1, 0, 5),
        Reply::Acquired { .. }
    ));
}

/// A Unix socket beside loopback TCP: a stale socket file is replaced, the
/// file gets `--socket-mode`, an allowed uid acquires through the client
/// library and the `ticket` command, another uid (run with `setpriv`) is
/// closed and logged, a second server does not take the live socket, and
/// the file is gone after a clean stop.
#[test]
fn a_unix_socket_serves_allowed_uids_and_refuses_others() {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        // setpriv needs root to switch uid; CI runs the tests as root.
        panic!("this test runs as root (it runs a client under another uid)");
    }
    let dir = std::env::temp_dir().join(format!("ticketd-unix-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = dir.join("ticketd.sock");
    let sock_s = sock.to_str().unwrap().to_string();
    // A crash left its socket file behind.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let listen = format!("unix:{sock_s}");
    let mut server = Ticketd::start(&[
        "--listen",
        &listen,
        "--socket-mode",
        "0666",
        "--allow-uid",
        "0",
    ]);
    let log = server.log();
    assert!(log.contains("replacing a stale socket file"), "{log}");
    assert!(
        log.contains(&format!("listening on {} unix:{sock_s}", server.addr())),
        "{log}"
    );
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o666);

    the_allowed_uid_acquires(&listen);

    another_uid_is_refused(&server, &listen);

    // A second server does not replace the live socket.
    let second = common::run_ticketd(&["--listen", &listen]);
    assert_eq!(second.status.code(), Some(1));
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("a server that is running"), "{err}");
    assert!(sock.exists());

    assert_eq!(server.terminate().code(), Some(0));
    assert!(!sock.exists(), "the socket file is removed at a clean stop");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Allowed (uid 0): the official client and the `ticket` command acquire
/// over the socket `listen`.
fn the_allowed_uid_acquires(listen: &str) {
    // Allowed (uid 0): the official client over the socket.
    let client = ticketd::client::Client::connect(listen).unwrap();
    let got = client
        .acquire("k", Duration::ZERO, Duration::from_secs(5))
        .unwrap();
    let ticketd::client::Acquire::Acquired(ticket) = got else {
        panic!("{got:?}");
    };
    assert!(matches!(
        ticket.release().unwrap(),
        ticketd::client::Release::Released
    ));
    // And the command line.
    let ticket_bin = env!("CARGO_BIN_EXE_ticket");
    let ok = std::process::Command::new(ticket_bin)
        .args([
            "acquire", "cli", "--wait", "0", "--lease", "5", "--server", listen,
        ])
        .output()
        .unwrap();
    assert_eq!(ok.status.code(), Some(0), "{ok:?}");
}

/// `ticket acquire` as uid/gid 65534 on the socket `listen` is closed and
/// logged, and granted nothing.
fn another_uid_is_refused(server: &Ticketd, listen: &str) {
    let ticket_bin = env!("CARGO_BIN_EXE_ticket");
    // Refused: the same command as uid/gid 65534.
    let refused = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            ticket_bin,
        ])
        .args([
            "acquire", "other", "--wait", "0", "--lease", "5", "--server", listen,
        ])
        .output()
        .unwrap();
    assert_ne!(refused.status.code(), Some(0), "{refused:?}");
    assert!(
        server.wait_for_log("refused unix(uid=65534", Duration::from_secs(5)),
        "{}",
        server.log()
    );
    let mut c = server.connect();
    assert!(
        matches!(c.acquire_reply("other", 9, 0, 5), Reply::Acquired { .. }),
        "the refused client was granted nothing"
    );
}

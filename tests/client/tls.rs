//! TLS on the client port with real processes and certificates made by
//! `openssl` at test time: `openssl s_client` (a TLS client no one here
//! wrote) gets lock replies over TLS 1.3 and TLS 1.2; plaintext bytes on a
//! TLS port are closed and change nothing; with `--tls-client-ca`, no
//! certificate or one from another CA is refused and a good one works; the
//! Rust client and `ticket` over TLS; a stalled handshake is closed by
//! `--frame-timeout`; a client that never reads is closed with the
//! server's memory bounded; bad certificate files stop the start-up.

use ticketd_testkit::process as common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Ticketd;
use ticketd::client::{Acquire, Client, Release};
use ticketd_testkit::certs::{s_client, Certs};

/// A Rust client for `addr` trusting `ca.pem`, with the client
/// certificate `leaf` when given.
fn client(certs: &Certs, addr: &str, leaf: Option<&str>) -> Client {
    let mut b = Client::builder()
        .address(addr)
        .tls_ca(certs.path("ca.pem"))
        .connect_timeout(Duration::from_secs(3));
    if let Some(leaf) = leaf {
        b = b.tls_client_cert(
            certs.path(&format!("{leaf}.pem")),
            certs.path(&format!("{leaf}-key.pem")),
        );
    }
    b.build().expect("client builds")
}

fn start(args: &[String]) -> Ticketd {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Ticketd::start(&args)
}

/// The token of an `A` reply frame for `key`, if `bytes` is one.
fn acquired_token(bytes: &[u8], key: &str) -> Option<u64> {
    let want = 1 + 8 + 8 + key.len() + 1;
    if bytes.len() != want || bytes[0] != b'A' || &bytes[17..want - 1] != key.as_bytes() {
        return None;
    }
    Some(u64::from_be_bytes(bytes[1..9].try_into().unwrap()))
}

#[test]
fn openssl_s_client_gets_a_lock_over_tls13_and_tls12() {
    let certs = Certs::make("sclient");
    let server = start(&certs.server_args());
    let addr = server.addr().to_string();
    let ca = certs.path("ca.pem");
    for (flag, version, key) in [("-tls1_3", "TLSv1.3", "k13"), ("-tls1_2", "TLSv1.2", "k12")] {
        let frame = common::acquire_frame(key, 7, 0, 30);
        let (got, err) = s_client(
            &addr,
            &[flag, "-CAfile", &ca, "-verify_return_error"],
            &frame,
            18 + key.len(),
        );
        assert!(
            err.contains(&format!("Protocol version: {version}")),
            "{flag}: {err}"
        );
        let token = acquired_token(&got, key)
            .unwrap_or_else(|| panic!("{flag}: no A reply, got {got:?}; stderr {err}"));
        assert_ne!(token, 0);
    }
    // The grants are real: the Rust client over TLS finds both keys held.
    let c = client(&certs, &addr, None);
    for key in ["k13", "k12"] {
        let r = c
            .acquire(key, Duration::ZERO, Duration::from_secs(5))
            .unwrap();
        assert!(matches!(r, Acquire::Timeout), "{key}: {r:?}");
    }
}

/// Protected mode: TLS is enough to listen off loopback; without
/// `--tls-client-ca` the start-up warns that clients are not
/// authenticated, and with it there is no warning.
#[test]
fn tls_off_loopback_starts_and_warns_without_a_client_ca() {
    let certs = Certs::make("offloop");
    let mut args = vec!["--listen".to_string(), "0.0.0.0:0".into()];
    args.extend(certs.server_args());
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Ticketd::start_raw(&[], &a);
    assert!(
        server.wait_for_log(
            "clients speak TLS without client certificates",
            Duration::from_secs(5)
        ),
        "{}",
        server.log()
    );
    // It serves TLS (reached over loopback here).
    let addr = format!("127.0.0.1:{}", server.addr().port());
    let frame = common::acquire_frame("off", 7, 0, 30);
    let (got, err) = s_client(&addr, &["-CAfile", &certs.path("ca.pem")], &frame, 21);
    assert!(acquired_token(&got, "off").is_some(), "{got:?} {err}");

    args.extend(["--tls-client-ca".into(), certs.path("ca.pem")]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Ticketd::start_raw(&[], &a);
    assert!(
        !server.log().contains("without client certificates"),
        "{}",
        server.log()
    );
}

#[test]
fn plaintext_on_a_tls_port_is_closed_and_changes_nothing() {
    let certs = Certs::make("plain");
    let server = start(&certs.server_args());
    let mut raw = TcpStream::connect(server.addr()).unwrap();
    raw.write_all(&common::acquire_frame("k", 1, 0, 30))
        .unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let closed = loop {
        let mut buf = [0u8; 256];
        match raw.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break true,
            Err(_) => break false,
        }
    };
    assert!(closed, "not closed; got {got:?}");
    // At most a TLS alert record (content type 21), never a reply.
    assert!(got.is_empty() || got[0] == 0x15, "{got:?}");
    let c = client(&certs, &server.addr().to_string(), None);
    let r = c
        .acquire("k", Duration::ZERO, Duration::from_secs(5))
        .unwrap();
    let Acquire::Acquired(t) = r else {
        panic!("the plaintext acquire took the key: {r:?}");
    };
    assert_eq!(c.release("k", t.token()).unwrap(), Release::Released);
}

#[test]
fn client_certificates_are_required_with_tls_client_ca() {
    let certs = Certs::make("mtls");
    let mut args = certs.server_args();
    args.extend(["--tls-client-ca".into(), certs.path("ca.pem")]);
    let server = start(&args);
    let addr = server.addr().to_string();
    for leaf in [None, Some("stranger")] {
        let c = client(&certs, &addr, leaf);
        let r = c
            .acquire("k", Duration::ZERO, Duration::from_secs(30))
            .unwrap();
        assert!(
            !matches!(r, Acquire::Acquired(_)),
            "{leaf:?} was granted: {r:?}"
        );
    }
    // openssl without a certificate is refused too.
    let ca = certs.path("ca.pem");
    let (got, _) = s_client(
        &addr,
        &["-CAfile", &ca],
        &common::acquire_frame("k", 3, 0, 30),
        19,
    );
    assert!(acquired_token(&got, "k").is_none(), "{got:?}");
    // None of them holds the key: a client with a good certificate gets it.
    let c = client(&certs, &addr, Some("client"));
    let r = c
        .acquire("k", Duration::ZERO, Duration::from_secs(5))
        .unwrap();
    let Acquire::Acquired(t) = r else {
        panic!("the good certificate was refused: {r:?}");
    };
    assert_eq!(c.release("k", t.token()).unwrap(), Release::Released);
    // And so does openssl with it.
    let (got, err) = s_client(
        &addr,
        &[
            "-CAfile",
            &ca,
            "-cert",
            &certs.path("client.pem"),
            "-key",
            &certs.path("client-key.pem"),
        ],
        &common::acquire_frame("k", 4, 0, 30),
        19,
    );
    assert!(acquired_token(&got, "k").is_some(), "{got:?} {err}");
}

/// With client certificates every connection is its certificate's
/// identity: a grant taken by `client` cannot be released or extended by
/// `client2` (another certificate of the same CA) even with its token, and
/// the admin port names its holder by the certificate's common name.
#[test]
fn a_grant_is_bound_to_the_certificate_that_took_it() {
    let certs = Certs::make("bound");
    let mut args = certs.server_args();
    args.extend([
        "--tls-client-ca".into(),
        certs.path("ca.pem"),
        "--admin-listen".into(),
        "127.0.0.1:0".into(),
    ]);
    let server = start(&args);
    let addr = server.addr().to_string();
    let owner = client(&certs, &addr, Some("client"));
    let other = client(&certs, &addr, Some("client2"));
    let Acquire::Acquired(t) = owner
        .acquire("k", Duration::ZERO, Duration::from_secs(30))
        .unwrap()
    else {
        panic!("not granted");
    };
    let token = t.token();
    assert_eq!(other.release("k", token).unwrap(), Release::NotHeld);
    assert_eq!(
        other.extend("k", token, Duration::from_secs(30)).unwrap(),
        ticketd::client::ExtendToken::NotHeld
    );
    let admin = server.admin_addr().unwrap();
    let (status, body) = common::http(admin, "GET", "/v1/locks/k").unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("\"holder\":\"cert:client\""), "{body}");
    assert_eq!(owner.release("k", token).unwrap(), Release::Released);
}

#[test]
fn ticket_acquires_and_releases_over_tls() {
    let certs = Certs::make("cli");
    let mut args = certs.server_args();
    args.extend(["--tls-client-ca".into(), certs.path("ca.pem")]);
    let server = start(&args);
    // Flags, with the server named by host name (the certificate's DNS name).
    let server_addr = format!("localhost:{}", server.addr().port());
    let out = Command::new(common::ticket_bin())
        .args(["acquire", "job", "--wait", "0", "--server", &server_addr])
        .args(["--tls-ca", &certs.path("ca.pem")])
        .args(["--tls-cert", &certs.path("client.pem")])
        .args(["--tls-key", &certs.path("client-key.pem")])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(token.parse::<u64>().is_ok(), "{token:?}");
    // The environment, with the server named by address.
    let release = |token: &str| {
        Command::new(common::ticket_bin())
            .args([
                "release",
                "job",
                token,
                "--server",
                &server.addr().to_string(),
            ])
            .env("TICKET_TLS_CA", certs.path("ca.pem"))
            .env("TICKET_TLS_CERT", certs.path("client.pem"))
            .env("TICKET_TLS_KEY", certs.path("client-key.pem"))
            .output()
            .unwrap()
    };
    let out = release(&token);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Released for real: a second release finds nothing (exit 123).
    assert_eq!(release(&token).status.code(), Some(123));
    // Without TLS settings, `ticket` speaks plaintext and gets nothing.
    let out = Command::new(common::ticket_bin())
        .args(["acquire", "job", "--wait", "0.5", "--server", &server_addr])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn a_stalled_handshake_is_closed_by_the_frame_timeout() {
    let certs = Certs::make("stall");
    let mut args = certs.server_args();
    args.extend(["--frame-timeout".into(), "1".into()]);
    let server = start(&args);
    // Silent, and half a record header: neither finishes a handshake.
    let mut silent = TcpStream::connect(server.addr()).unwrap();
    let mut half = TcpStream::connect(server.addr()).unwrap();
    half.write_all(&[0x16, 0x03, 0x01]).unwrap();
    let start = Instant::now();
    for s in [&mut silent, &mut half] {
        s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
        let mut got = Vec::new();
        loop {
            let mut buf = [0u8; 64];
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
                other => panic!("not closed: {other:?}"),
            }
        }
        // At most an alert record (content type 21) before the close.
        assert!(got.is_empty() || got[0] == 0x15, "{got:?}");
    }
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "closed after {took:?}, before the frame timeout"
    );
    assert!(
        server.wait_for_log("TLS handshake", Duration::from_secs(5)),
        "{}",
        server.log()
    );
    // A client that does finish its handshake is served.
    let c = client(&certs, &server.addr().to_string(), None);
    let r = c
        .acquire("k", Duration::ZERO, Duration::from_secs(5))
        .unwrap();
    assert!(matches!(r, Acquire::Acquired(_)), "{r:?}");
}

#[test]
fn a_tls_client_that_never_reads_is_closed_and_memory_stays_bounded() {
    let certs = Certs::make("noread");
    let mut args = certs.server_args();
    args.extend(["--frame-timeout".into(), "1".into()]);
    let server = start(&args);
    let addr = server.addr().to_string();
    let holder = client(&certs, &addr, None);
    let Acquire::Acquired(_held) = holder
        .acquire("held", Duration::ZERO, Duration::from_secs(60))
        .unwrap()
    else {
        panic!("no grant");
    };
    let rss_start = server.rss_kib();
    // openssl s_client whose stdout is never read: once that pipe is full
    // it stops reading the socket, and the server's replies (T, for a held
    // key with wait 0) pile up in the socket buffers and in ticketd.
    let mut child = Command::new("openssl")
        .args(["s_client", "-connect", &addr, "-quiet"])
        .args(["-CAfile", &certs.path("ca.pem")])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("openssl s_client");
    let mut stdin = child.stdin.take().unwrap();
    let _stdout = child.stdout.take().unwrap(); // held open, never read
    let frame = common::acquire_frame("held", 9, 0, 5);
    let burst: Vec<u8> = frame
        .iter()
        .copied()
        .cycle()
        .take(frame.len() * 4096)
        .collect();
    let writer = std::thread::spawn(move || {
        let until = Instant::now() + Duration::from_secs(30);
        let mut written = 0usize;
        while Instant::now() < until {
            if stdin.write_all(&burst).is_err() {
                break; // s_client exited: the server closed the connection
            }
            written += burst.len();
        }
        written
    });
    assert!(
        server.wait_for_log(
            "unread replies for --frame-timeout",
            Duration::from_secs(30)
        ),
        "the non-reader was not closed:\n{}",
        server.log()
    );
    let rss = server.rss_kib();
    let _ = child.kill();
    let _ = child.wait();
    let written = writer.join().unwrap();
    println!("never-reading TLS client: {written} bytes sent; RSS {rss_start} -> {rss} KiB");
    assert!(
        rss < rss_start + 32 * 1024,
        "server RSS grew from {rss_start} KiB to {rss} KiB"
    );
    // The server still serves.
    let r = holder
        .acquire("other", Duration::ZERO, Duration::from_secs(5))
        .unwrap();
    assert!(matches!(r, Acquire::Acquired(_)), "{r:?}");
}

#[test]
fn bad_certificate_files_stop_the_start_up() {
    let certs = Certs::make("bad");
    let cases: [(&str, &str, &str); 3] = [
        ("server.pem", "ca-key.pem", "does not go with"),
        ("missing.pem", "server-key.pem", "missing.pem"),
        ("server-key.pem", "server-key.pem", "no PEM certificate"),
    ];
    for (cert, key, says) in cases {
        let out = common::run_ticketd(&[
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            &certs.path(cert),
            "--tls-key",
            &certs.path(key),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{cert} {key}: {err}");
        assert!(err.contains(says), "{cert} {key}: {err}");
    }
    // A client CA file that holds no certificate.
    let out = common::run_ticketd(&[
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        &certs.path("server.pem"),
        "--tls-key",
        &certs.path("server-key.pem"),
        "--tls-client-ca",
        &certs.path("ca-key.pem"),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--tls-client-ca"), "{err}");
}

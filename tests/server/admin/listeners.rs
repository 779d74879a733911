//! Where the admin port listens: a Unix socket with its mode and peer
//! checks, HTTPS with client certificates, and off loopback only with HTTPS
//! or `--insecure`.

use super::*;

/// One HTTP/1.1 exchange on a Unix socket: status and body; `None` when
/// the server closed the connection without an answer.
fn unix_get(path: &Path, target: &str) -> Option<(u16, String)> {
    let mut s = std::os::unix::net::UnixStream::connect(path).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A refused peer may see the socket closed under this write.
    let _ = write!(s, "GET {target} HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    if raw.is_empty() {
        return None;
    }
    let text = String::from_utf8(raw).expect("UTF-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    Some((status, body.to_string()))
}

#[test]
fn the_admin_port_on_a_unix_socket_has_its_mode_and_checks_peers() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tmp_dir("unix");
    let sock = dir.join("admin.sock");
    let client_sock = format!("unix:{}", dir.join("client.sock").display());
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() }.to_string();
    assert_eq!(
        me, "0",
        "this test runs as root (it runs peers under another uid)"
    );
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let t = Ticketd::start(&[
        "--admin-listen",
        &format!("unix:{}", sock.display()),
        "--listen",
        &client_sock,
        "--socket-mode",
        "0666",
        "--allow-uid",
        &me,
    ]);
    assert!(
        t.log()
            .contains(&format!("admin port (HTTP) on unix:{}", sock.display())),
        "{}",
        t.log()
    );
    assert_eq!(
        std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777,
        0o666
    );
    let mut c = t.connect();
    let tok = token(&c.acquire_reply("u/1", 1, 0, 255));
    the_admin_socket_answers(&sock, tok);

    // The CLI reads it with --admin unix:/path.
    let a = format!("unix:{}", sock.display());
    the_cli_reads_the_admin_socket(&a, &dir, tok);

    // A peer whose uid is not listed can open either socket (mode 0666) and
    // is closed at once; each refusal is counted under its own reason.
    unlisted_peers_are_refused(&t, &sock, &client_sock, &a);
    assert!(
        matches!(c.acquire_reply("n/1", 2, 0, 5), Reply::Acquired { .. }),
        "the refused peer was granted nothing"
    );

    // Stopped: the socket file goes with the server.
    drop(c);
    let mut t = t;
    assert!(t.terminate().success());
    assert!(!sock.exists(), "the socket file is removed at the end");

    an_unlisted_uid_gets_no_answer(&sock, &a);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The admin socket `sock` answers the lock endpoint (the sequence of
/// `tok`) and the metrics, with no admin peer refused yet.
fn the_admin_socket_answers(sock: &Path, tok: u64) {
    let (status, body) = unix_get(sock, "/v1/locks/u%2F1").expect("an answer");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        py(&body, "(j['key'], j['sequence'])"),
        format!("('u/1', {})", tok >> 16)
    );
    let (status, m) = unix_get(sock, "/metrics").expect("an answer");
    assert_eq!(status, 200);
    assert_eq!(sample(&m, "ticketd_keys"), 1.0);
    assert_eq!(
        sample(
            &m,
            "ticketd_connections_refused_total{reason=\"admin_peer_not_allowed\"}"
        ),
        0.0
    );
}

/// `ticket` reads the admin socket with `--admin a`: the lock
/// (sequence of `tok`), the table, no cluster; a missing socket fails.
fn the_cli_reads_the_admin_socket(a: &str, dir: &Path, tok: u64) {
    let (code, out, err) = ticket(&["status", "u/1", "--admin", a, "--json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(py(&out, "j['sequence']"), (tok >> 16).to_string());
    let (code, out, err) = ticket(&["locks", "u/", "--admin", a]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().nth(1).unwrap().split("  ").next(), Some("u/1"));
    let (code, _, err) = ticket(&["cluster", "status", "--admin", a]);
    assert_eq!(code, 125, "{err}");
    assert!(err.contains("not a cluster node"), "{err}");
    let gone = format!("unix:{}", dir.join("nobody.sock").display());
    let (code, _, err) = ticket(&["status", "u/1", "--admin", &gone]);
    assert_eq!(code, 125, "{err}");
    assert!(err.contains("connect"), "{err}");
}

/// Runs `ticket ARGS` as uid and gid 65534 (nobody), through setpriv.
fn ticket_as_nobody(args: &[&str]) -> std::process::Output {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(common::ticket_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run setpriv")
}

/// A peer whose uid is not listed (nobody) is closed at once on the
/// client socket `client_sock` and on the admin socket `sock` (`a` for
/// `--admin`), and each refusal is counted under its own reason.
fn unlisted_peers_are_refused(t: &Ticketd, sock: &Path, client_sock: &str, a: &str) {
    let out = ticket_as_nobody(&[
        "acquire",
        "n/1",
        "--wait",
        "0",
        "--lease",
        "5",
        "--server",
        client_sock,
    ]);
    assert_ne!(out.status.code(), Some(0), "{out:?}");
    let out = ticket_as_nobody(&["status", "u/1", "--admin", a]);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    // Both were closed by the server (counted before the close), so the
    // counters are in.
    assert!(
        t.wait_for_log("refused unix(uid=65534", Duration::from_secs(10)),
        "{}",
        t.log()
    );
    let (_, m) = unix_get(sock, "/metrics").expect("an answer");
    // (`ticket` retries a request the server closed unsent: at least one
    // refusal each.)
    let refused = |reason: &str| {
        sample(
            &m,
            &format!("ticketd_connections_refused_total{{reason=\"{reason}\"}}"),
        )
    };
    assert!(refused("peer_not_allowed") >= 1.0, "{m}");
    assert!(refused("admin_peer_not_allowed") >= 1.0, "{m}");
    assert_eq!(refused("max_conns"), 0.0, "{m}");
}

/// Restarted allowing only another uid: this one is closed without an
/// answer on the admin socket `sock` (`a` for `--admin`).
fn an_unlisted_uid_gets_no_answer(sock: &Path, a: &str) {
    // A peer whose uid is not listed is closed without an answer.
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let other = (unsafe { libc::geteuid() } + 1).to_string();
    let t = Ticketd::start(&[
        "--admin-listen",
        &format!("unix:{}", sock.display()),
        "--allow-uid",
        &other,
        "--log-level",
        "debug",
    ]);
    assert_eq!(unix_get(sock, "/livez"), None);
    assert!(
        t.wait_for_log("admin: refused uid=", Duration::from_secs(10)),
        "{}",
        t.log()
    );
    let (code, _, err) = ticket(&["status", "u/1", "--admin", a]);
    assert_eq!(code, 125, "{err}");
    drop(t);
}

/// `--admin-tls-cert` and `--admin-tls-key`: HTTPS on the admin port,
/// with `--admin-tls-client-ca` only for holders of a client certificate.
/// `openssl s_client` (a TLS client no one here wrote) and `ticket --admin
/// https://...` read it; plain HTTP on it gets no answer; a certificate from
/// another CA is refused.
#[cfg(feature = "tls")]
#[test]
fn the_admin_port_speaks_https_and_checks_client_certificates() {
    use ticketd_testkit::certs::{s_client, Certs};
    let certs = Certs::make("admin");
    let args = [
        "--admin-listen".to_string(),
        "127.0.0.1:0".into(),
        "--admin-tls-cert".into(),
        certs.path("server.pem"),
        "--admin-tls-key".into(),
        certs.path("server-key.pem"),
        "--admin-tls-client-ca".into(),
        certs.path("ca.pem"),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let t = Ticketd::start(&args);
    let log = t.log();
    let at = log
        .find("admin port (HTTPS) on ")
        .expect("the start-up line says HTTPS")
        + "admin port (HTTPS) on ".len();
    let admin: SocketAddr = log[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let mut c = t.connect();
    let tok = token(&c.acquire_reply("tls/key", 1, 0, 255));

    // openssl s_client with the client certificate: a real HTTPS exchange.
    let request = b"GET /v1/locks/tls%2Fkey HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
    let (out, err) = s_client(
        &admin.to_string(),
        &[
            "-CAfile",
            &certs.path("ca.pem"),
            "-cert",
            &certs.path("client.pem"),
            "-key",
            &certs.path("client-key.pem"),
        ],
        request,
        usize::MAX,
    );
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}\n{err}");
    let body = text.split_once("\r\n\r\n").expect("a body").1;
    assert_eq!(py(body, "j['sequence']"), (tok >> 16).to_string(), "{body}");

    // Without a client certificate, or with one from another CA: no answer.
    no_answer_without_a_good_certificate(&certs, admin, request);

    // Plain HTTP on the HTTPS port: closed without an HTTP answer.
    assert!(
        try_http(admin, "GET", "/livez").is_none(),
        "plain HTTP answered on the HTTPS admin port"
    );

    ticket_reads_the_https_admin_port(&certs, admin, tok);
}

/// Without a client certificate, or with one from another CA, the HTTPS
/// admin port at `admin` answers nothing to `request`.
#[cfg(feature = "tls")]
fn no_answer_without_a_good_certificate(
    certs: &ticketd_testkit::certs::Certs,
    admin: SocketAddr,
    request: &[u8],
) {
    use ticketd_testkit::certs::s_client;
    for extra in [
        vec!["-CAfile", &certs.path("ca.pem")],
        vec![
            "-CAfile",
            &certs.path("ca.pem"),
            "-cert",
            &certs.path("stranger.pem"),
            "-key",
            &certs.path("stranger-key.pem"),
        ],
    ] {
        let extra: Vec<&str> = extra.iter().map(|s| s.as_ref()).collect();
        let (out, _) = s_client(&admin.to_string(), &extra, request, usize::MAX);
        let text = String::from_utf8_lossy(&out);
        assert!(
            !text.contains("HTTP/1.1"),
            "answered without a good certificate: {text}"
        );
    }
}

/// `ticket` reads the HTTPS admin port at `admin` with its client
/// certificate from flags and from the environment (the lock's sequence
/// of `tok`); without a CA, or without a certificate, it fails.
#[cfg(feature = "tls")]
fn ticket_reads_the_https_admin_port(
    certs: &ticketd_testkit::certs::Certs,
    admin: SocketAddr,
    tok: u64,
) {
    // ticket over HTTPS, with its client certificate from flags and from
    // the environment; without a CA it says what is missing.
    let url = format!("https://{admin}");
    let (code, out, err) = ticket(&[
        "status",
        "tls/key",
        "--json",
        "--admin",
        &url,
        "--tls-ca",
        &certs.path("ca.pem"),
        "--tls-cert",
        &certs.path("client.pem"),
        "--tls-key",
        &certs.path("client-key.pem"),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(py(&out, "j['sequence']"), (tok >> 16).to_string(), "{out}");
    let out = common::bin_command(common::ticket_bin())
        .args(["locks", "tls/", "--json", "--admin", &url])
        .env("TICKET_TLS_CA", certs.path("ca.pem"))
        .env("TICKET_TLS_CERT", certs.path("client.pem"))
        .env("TICKET_TLS_KEY", certs.path("client-key.pem"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("tls/key"), "{text}");
    let (code, _, err) = ticket(&["status", "tls/key", "--admin", &url]);
    assert_ne!(code, 0);
    assert!(err.contains("--tls-ca"), "{err}");
    let (code, _, err) = ticket(&[
        "status",
        "tls/key",
        "--admin",
        &url,
        "--tls-ca",
        &certs.path("ca.pem"),
    ]);
    assert_eq!(code, 125, "refused without a client certificate: {err}");
}

/// A TCP admin port off loopback needs HTTPS (`--admin-tls-cert`) or
/// `--insecure` (protected mode), like the client port.
#[test]
fn an_admin_port_off_loopback_needs_https_or_insecure() {
    let out = common::run_ticketd(&["--admin-listen", "0.0.0.0:0"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--admin-listen 0.0.0.0:0") && err.contains("--insecure"),
        "{err}"
    );
}

//! What a failed connection says about the server
//! (`Client::last_failure`), and `ClientBuilder::fail_fast`, against real
//! servers: nothing listening, a TLS port spoken to in plaintext, a client
//! certificate required and missing or refused, the admin port given as a
//! client port, and a peer that answers bytes that are no reply.

use ticketd_testkit::process as common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::Ticketd;
use ticketd::client::{Acquire, Client, FailureKind, Release};

const S: Duration = Duration::from_secs(1);

/// An address where nothing listens.
fn refused_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

#[test]
fn fail_fast_gives_up_at_once_when_nothing_listens() {
    let addr = refused_addr();
    let c = Client::builder()
        .address(addr.as_str())
        .fail_fast(true)
        .build()
        .unwrap();
    let t = Instant::now();
    let r = c.acquire("k", 10 * S, 10 * S).unwrap();
    assert!(matches!(r, Acquire::Timeout), "{r:?}");
    assert!(t.elapsed() < S, "{:?}", t.elapsed());
    let f = c.last_failure().expect("a failure");
    assert_eq!(f.kind(), FailureKind::Refused);
    assert_eq!(f.address(), addr);
    assert!(f.to_string().starts_with(&addr), "{f}");
    let t = Instant::now();
    assert_eq!(c.release("k", 1).unwrap(), Release::NotSent);
    assert!(t.elapsed() < S, "{:?}", t.elapsed());

    // Without it, the call keeps trying until its deadline.
    let c = Client::connect(addr.as_str()).unwrap();
    let t = Instant::now();
    let r = c.acquire("k", S, S).unwrap();
    assert!(matches!(r, Acquire::Timeout), "{r:?}");
    assert!(t.elapsed() >= S, "{:?}", t.elapsed());
    assert_eq!(
        c.last_failure().map(|f| f.kind()),
        Some(FailureKind::Refused)
    );
}

#[test]
fn fail_fast_still_reaches_the_address_that_answers() {
    let server = Ticketd::start(&[]);
    let c = Client::builder()
        .addresses([refused_addr(), server.addr().to_string()])
        .pool_size(1)
        .fail_fast(true)
        .build()
        .unwrap();
    for _ in 0..3 {
        let t = c
            .acquire("k", S, 5 * S)
            .unwrap()
            .ticket()
            .expect("acquired through the second address");
        assert_eq!(t.release().unwrap(), Release::Released);
    }
}

/// Starts `ticketd` with an admin port; the admin address.
fn start_with_admin() -> (Ticketd, String) {
    let t = Ticketd::start(&["--admin-listen", "127.0.0.1:0"]);
    let log = t.log();
    let at = log
        .find("admin port (HTTP) on ")
        .expect("admin start-up line")
        + "admin port (HTTP) on ".len();
    let addr = log[at..].split_whitespace().next().unwrap().to_owned();
    (t, addr)
}

#[test]
fn the_admin_port_is_named_an_http_port() {
    let (server, admin) = start_with_admin();
    let c = Client::connect(admin.as_str()).unwrap();
    let t = Instant::now();
    let r = c.acquire("k", 5 * S, 5 * S).unwrap();
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    assert!(t.elapsed() < 2 * S, "at once: {:?}", t.elapsed());
    let f = c.last_failure().expect("a failure");
    assert_eq!(f.kind(), FailureKind::Http, "{f}");
    assert_eq!(f.address(), admin);
    // Nothing was taken on the client port.
    let ok = Client::connect(server.addr().to_string()).unwrap();
    let t = ok.acquire("k", S, 5 * S).unwrap().ticket().expect("free");
    assert_eq!(t.release().unwrap(), Release::Released);
}

#[test]
fn bytes_that_are_no_reply_are_named_so() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = [0u8; 64];
        let _ = s.read(&mut buf);
        let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n");
        std::thread::sleep(Duration::from_millis(200));
    });
    let c = Client::connect(addr.as_str()).unwrap();
    let r = c.acquire("k", 5 * S, 5 * S).unwrap();
    assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
    let f = c.last_failure().expect("a failure");
    assert_eq!(f.kind(), FailureKind::NotTicketd, "{f}");
    peer.join().unwrap();
}

#[cfg(feature = "tls")]
mod tls {
    use super::*;
    use ticketd_testkit::certs::Certs;

    fn start(certs: &Certs, client_ca: bool) -> Ticketd {
        let mut args = certs.server_args();
        if client_ca {
            args.extend(["--tls-client-ca".into(), certs.path("ca.pem")]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Ticketd::start(&args)
    }

    #[test]
    fn plaintext_on_a_tls_port_is_named_tls_expected() {
        let certs = Certs::make("failure-plain");
        let server = start(&certs, false);
        let c = Client::connect(server.addr().to_string()).unwrap();
        let t = Instant::now();
        let r = c.acquire("k", 5 * S, 5 * S).unwrap();
        assert!(matches!(r, Acquire::Indeterminate), "{r:?}");
        assert!(t.elapsed() < 2 * S, "at once: {:?}", t.elapsed());
        let f = c.last_failure().expect("a failure");
        assert_eq!(f.kind(), FailureKind::TlsExpected, "{f}");
    }

    #[test]
    fn a_missing_or_refused_client_certificate_is_named() {
        let certs = Certs::make("failure-mtls");
        let server = start(&certs, true);
        let addr = server.addr().to_string();
        for (leaf, want) in [
            (None, FailureKind::CertificateRequired),
            (Some("stranger"), FailureKind::CertificateRefused),
        ] {
            let mut b = Client::builder()
                .address(addr.as_str())
                .tls_ca(certs.path("ca.pem"))
                .fail_fast(true);
            if let Some(leaf) = leaf {
                b = b.tls_client_cert(
                    certs.path(&format!("{leaf}.pem")),
                    certs.path(&format!("{leaf}-key.pem")),
                );
            }
            let c = b.build().unwrap();
            let t = Instant::now();
            let r = c.acquire("k", 5 * S, 5 * S).unwrap();
            assert!(!matches!(r, Acquire::Acquired(_)), "{leaf:?}: {r:?}");
            assert!(t.elapsed() < 2 * S, "{leaf:?}: {:?}", t.elapsed());
            let f = c.last_failure().expect("a failure");
            assert_eq!(f.kind(), want, "{leaf:?}: {f}");
        }
    }

    #[test]
    fn an_untrusted_server_fails_fast_as_tls() {
        let certs = Certs::make("failure-trust");
        let server = start(&certs, false);
        // Trusting the other CA: the server's certificate does not chain to it.
        let c = Client::builder()
            .address(server.addr().to_string())
            .tls_ca(certs.path("other.pem"))
            .fail_fast(true)
            .build()
            .unwrap();
        let t = Instant::now();
        let r = c.acquire("k", 10 * S, 5 * S).unwrap();
        assert!(matches!(r, Acquire::Timeout), "{r:?}");
        assert!(t.elapsed() < 2 * S, "{:?}", t.elapsed());
        assert_eq!(c.last_failure().map(|f| f.kind()), Some(FailureKind::Tls));
    }
}

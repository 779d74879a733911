//! Mutual TLS between cluster peers with real processes and real
//! certificates (made by `ticket certs init`, and once by `openssl`): a TLS
//! cluster grants and survives a leader kill; a certificate from another
//! CA never joins; a valid certificate used to claim another node's id is
//! refused, whether it connects or listens; plaintext bytes and a forged
//! hello on a TLS peer port change nothing; a wiped node exits on an
//! authenticated peer's word.
#![cfg(feature = "cluster")]

use ticketd_testkit::certs::openssl;
use ticketd_testkit::cluster;
use ticketd_testkit::process as common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster::{assert_serves, certs_init, temp_dir, tls_args, Cluster};
use common::Reply;
use ticketd::cluster::transport::{hash64, Hello, MEMBERSHIP_MARK};

fn wait_for(what: &str, c: &Cluster, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}:\n{}", c.logs());
}

/// Node `i` answers Busy: it has no leader it can reach.
fn assert_grants_nothing(c: &Cluster, i: usize) {
    let mut cl = c.client(i);
    cl.acquire("nothing", 5, 0, 5);
    match cl.try_recv(Duration::from_secs(3)) {
        Ok(Reply::Busy { .. }) | Err(_) => {}
        Ok(other) => panic!("node {} answered {other:?}:\n{}", i + 1, c.logs()),
    }
}

#[test]
fn a_tls_cluster_grants_and_survives_a_leader_kill() {
    let certs = temp_dir("tls-basic-certs");
    certs_init(&certs.0, "tlsbasic", 3);
    let mut c = Cluster::new("tlsbasic", 3);
    c.use_tls(&certs.0);
    c.start_all();
    assert!(c.node(0).log().contains("mutual TLS"), "{}", c.logs());
    assert_serves(&c, 0, "k");
    let (term, leader) = c.leader_term().expect("a leader");
    let mut held = c.client((leader + 1) % 3);
    let token = match cluster::acquire_retrying(&mut held, "held", 1, 30) {
        Some(Reply::Acquired { token, .. }) => token,
        other => panic!("{other:?}"),
    };
    c.kill(leader);
    wait_for("a new leader", &c, || {
        c.leader_term().is_some_and(|(t, _)| t > term)
    });
    let other = (leader + 2) % 3;
    assert_serves(&c, other, "after-kill");
    // The grant made before the kill still holds: the new leader has it.
    let mut cl = c.client(other);
    cl.acquire("held", 2, 0, 5);
    assert!(matches!(cl.recv(), Reply::Timeout { .. }));
    assert!(matches!(
        held.release_reply("held", token),
        Reply::Released { .. }
    ));
    // The killed node comes back over TLS.
    c.start_node(leader);
    assert_serves(&c, leader, "back");
    c.assert_all_running();
}

#[test]
fn a_certificate_from_another_ca_never_joins() {
    let certs = temp_dir("tls-ca-certs");
    let rogue = temp_dir("tls-ca-rogue");
    certs_init(&certs.0, "tlsca", 3);
    certs_init(&rogue.0, "tlsca", 3);
    let mut c = Cluster::new("tlsca", 3);
    c.use_tls(&certs.0);
    // Node 3 has a good-looking certificate for node3.tlsca, from another CA.
    c.extra[2] = tls_args(&rogue.0, 3);
    c.start_all();
    assert_serves(&c, 0, "ca");
    wait_for("the refusals", &c, || {
        c.node(0).log().contains("TLS") && c.node(2).log().contains("TLS")
    });
    assert_grants_nothing(&c, 2);
    // Nodes 1 and 2 never pinned node 3.
    for i in 0..2 {
        assert!(
            !c.node(i).log().contains("peer 3 authenticated"),
            "{}",
            c.logs()
        );
    }
    assert_serves(&c, 1, "ca2");
    c.assert_all_running();
}

/// A TLS client of a peer port, with the given certificate and key files.
fn tls_client(ca: &Path, cert: &Path, key: &Path, server: &str) -> rustls::ClientConnection {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let chain: Vec<_> = CertificateDer::pem_file_iter(cert)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(key).unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    rustls::ClientConnection::new(
        Arc::new(cfg),
        ServerName::try_from(server.to_owned()).unwrap(),
    )
    .unwrap()
}

fn hello(name: &str, from: u64, to: u64, to_uuid: u64) -> Vec<u8> {
    Hello {
        cluster: hash64(&[name.as_bytes()]),
        voters: MEMBERSHIP_MARK,
        from,
        from_uuid: 0x2222,
        to,
        to_uuid,
    }
    .encode()
}

#[test]
fn node_3s_certificate_cannot_claim_id_2() {
    let certs = temp_dir("tls-claim-certs");
    certs_init(&certs.0, "tlsclaim", 3);
    let mut c = Cluster::new("tlsclaim", 3);
    c.use_tls(&certs.0);
    // Nodes 1 and 3 run; node 2's address is the impostor's, listening
    // with node 3's (valid) certificate.
    let impostor = std::net::TcpListener::bind(c.peer_addr(1)).unwrap();
    c.start_node(0);
    c.start_node(2);
    assert_serves(&c, 0, "claim");
    // Node 1 connects to "node 2" and checks the name: refused.
    impostor.set_nonblocking(false).unwrap();
    let (mut s, _) = impostor.accept().unwrap();
    let srv = node3_server_config(&certs.0);
    let mut conn = rustls::ServerConnection::new(srv).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut failed = false;
    for _ in 0..20 {
        if conn.complete_io(&mut s).is_err() {
            failed = true;
            break;
        }
        if !conn.is_handshaking() {
            break;
        }
    }
    assert!(
        failed || conn.is_handshaking(),
        "node 1 accepted node 3's certificate as node 2"
    );
    drop(s);
    wait_for("node 1's refusal", &c, || {
        c.node(0).log().contains("peer 2 at")
    });
    // And node 3's certificate connecting to node 1 with a hello as node 2.
    let mut cl = tls_client(
        &certs.0.join("ca.pem"),
        &certs.0.join("node3.pem"),
        &certs.0.join("node3-key.pem"),
        "node1.tlsclaim",
    );
    let mut s = TcpStream::connect(c.peer_addr(0)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    while cl.is_handshaking() {
        cl.complete_io(&mut s).unwrap();
    }
    cl.writer().write_all(&hello("tlsclaim", 2, 1, 0)).unwrap();
    let _ = cl.complete_io(&mut s);
    wait_for("the refusal of the false claim", &c, || {
        c.node(0).log().contains("does not name node 2")
    });
    // The connection is closed.
    assert!(connection_closed(&mut cl, &mut s));
    assert!(
        !c.node(0).log().contains("peer 2 authenticated"),
        "{}",
        c.logs()
    );
    assert_serves(&c, 2, "claim-after");
    c.assert_all_running();
}

/// A TLS server configuration with node 3's (valid) certificate from the
/// certificates directory `dir`.
fn node3_server_config(dir: &Path) -> Arc<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<_> = CertificateDer::pem_file_iter(dir.join("node3.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(dir.join("node3-key.pem")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    Arc::new(cfg)
}

/// Whether the node closed the TLS connection `cl` over `s`: reads until
/// the end of the stream or an error.
fn connection_closed(cl: &mut rustls::ClientConnection, s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match cl.complete_io(s) {
            Ok((0, 0)) => match cl.reader().read(&mut b) {
                Ok(0) => break true,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if s.read(&mut b).map_or(true, |n| n == 0) {
                        break true;
                    }
                }
                Err(_) => break true,
            },
            Ok(_) => {}
            Err(_) => break true,
        }
    }
}

#[test]
fn plaintext_and_a_forged_hello_on_a_tls_port_change_nothing() {
    let certs = temp_dir("tls-plain-certs");
    certs_init(&certs.0, "tlsplain", 3);
    let mut c = Cluster::new("tlsplain", 3);
    c.use_tls(&certs.0);
    c.start_all();
    assert_serves(&c, 0, "plain");
    let (term, _) = c.leader_term().unwrap();
    for i in 0..3 {
        for bytes in [
            hello("tlsplain", (i as u64 + 1) % 3 + 1, i as u64 + 1, 0xbad),
            b"GET / HTTP/1.0\r\n\r\n".to_vec(),
            vec![0x16, 0x03, 0x01, 0xff, 0xff],
        ] {
            let mut s = TcpStream::connect(c.peer_addr(i)).unwrap();
            s.write_all(&bytes).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let mut b = [0u8; 256];
            // Closed by the node, at once or at the 2 s deadline.
            let t0 = Instant::now();
            while let Ok(n) = s.read(&mut b) {
                if n == 0 {
                    break;
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(3), "not closed in time");
        }
    }
    assert_serves(&c, 1, "plain-after");
    assert_eq!(c.leader_term().unwrap().0, term, "{}", c.logs());
    c.assert_all_running();
}

#[test]
fn a_wiped_node_stops_on_an_authenticated_peers_word() {
    let certs = temp_dir("tls-wipe-certs");
    certs_init(&certs.0, "tlswipe", 3);
    let mut c = Cluster::new("tlswipe", 3);
    c.use_tls(&certs.0);
    c.start_all();
    assert_serves(&c, 0, "wipe");
    wait_for("every node pinned", &c, || {
        c.node(2).log().matches("authenticated; its data").count() >= 2
            && (0..2).all(|i| c.node(i).log().contains("peer 3 authenticated"))
    });
    c.kill(2);
    std::fs::remove_dir_all(&c.dirs[2].0).unwrap();
    c.start_node(2);
    let mut node = c.nodes[2].take().unwrap();
    let status = node.wait_exit(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.code() == Some(1)),
        "a wiped node kept running:\n{}\nthe others:\n{}",
        node.log(),
        c.logs()
    );
    assert!(node.log().contains("wiped"), "{}", node.log());
    assert_serves(&c, 0, "wipe-after");
}

#[test]
fn certificates_made_by_openssl_are_accepted() {
    let d = temp_dir("tls-openssl");
    let dir = &d.0;
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca.pem",
            "-days",
            "30",
            "-subj",
            "/CN=openssl test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
    for i in 1..=3 {
        openssl_node_certificate(dir, i);
    }
    let mut c = Cluster::new("tlsossl", 3);
    c.use_tls(dir);
    c.start_all();
    assert_serves(&c, 0, "ossl");
    assert_serves(&c, 2, "ossl2");
    wait_for("every node pinned", &c, || {
        (0..3).all(|i| c.node(i).log().matches("authenticated; its data").count() >= 2)
    });
    c.assert_all_running();
}

/// Node `i`'s EC P-256 certificate for `node{i}.tlsossl`, for server and
/// client use, made by `openssl` in `dir` and signed by its `ca.pem`.
fn openssl_node_certificate(dir: &Path, i: usize) {
    let key = format!("node{i}-key.pem");
    let csr = format!("node{i}.csr");
    let ext = format!("node{i}.ext");
    std::fs::write(
        dir.join(&ext),
        format!(
            "subjectAltName=DNS:node{i}.tlsossl\n\
                 extendedKeyUsage=serverAuth,clientAuth\n\
                 keyUsage=critical,digitalSignature,keyEncipherment\n"
        ),
    )
    .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN=node{i}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            &format!("node{i}.pem"),
            "-days",
            "30",
            "-extfile",
            &ext,
        ],
    );
}

#[test]
fn peers_off_loopback_need_tls_or_insecure_peers_and_help_lists_the_flags() {
    let data = temp_dir("tls-protected");
    let port = common::free_port();
    let peers = format!("1=127.0.0.1:{port},2=192.0.2.1:7001,3=192.0.2.2:7001");
    let dir = data.0.join("d").display().to_string();
    let base = [
        "--cluster",
        "--id",
        "1",
        "--peers",
        &peers,
        "--data-dir",
        &dir,
        "--listen",
        "127.0.0.1:0",
    ];
    let out = common::run_ticketd(&base);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ticket certs init") && err.contains("--insecure-peers"),
        "{err}"
    );
    assert!(
        !data.0.join("d").exists(),
        "refused before the data directory"
    );
    let mut args = base.to_vec();
    args.push("--insecure-peers");
    let node = common::Ticketd::start_raw(&[], &args);
    assert!(
        node.wait_for_log(
            "--insecure-peers: peers speak plaintext",
            Duration::from_secs(5)
        ),
        "{}",
        node.log()
    );
    drop(node);
    for help in [&["--help"][..], &["--cluster", "--help"][..]] {
        let out = common::run_ticketd(help);
        let text = String::from_utf8_lossy(&out.stdout);
        for flag in [
            "--peer-tls-cert",
            "--peer-tls-key",
            "--peer-tls-ca",
            "--insecure-peers",
        ] {
            assert!(text.contains(flag), "{help:?} lacks {flag}:\n{text}");
        }
    }
}

//! The processes `cluster-bench` starts and waits for: ticketd nodes
//! (read until they report their address, then until a lock can be
//! taken), the cluster's peer certificates, and fresh etcd nodes; each
//! killed when its [`Proc`] is dropped.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ticketd::proto::{self, Decoded, Reply, Request};
use ticketd_bench as bench;

/// A child process, killed and reaped when dropped.
pub(crate) struct Proc(pub(crate) Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port that is free now.
pub(crate) fn free_port() -> u16 {
    bench::free_loopback_port().expect("a free loopback port")
}

/// A fresh path under the system temporary directory for `name`, nothing
/// left in it from an earlier run.
pub(crate) fn temp_dir(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("ticketd-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

/// A blocking connection to a ticketd node, for [`wait_ready`].
struct Conn {
    s: TcpStream,
    /// Received and not yet decoded.
    buf: Vec<u8>,
}

/// Whether `e` says the server closed the connection.
fn closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
    )
}

impl Conn {
    /// Sends `req` and returns its reply's kind and token, or `None` if the
    /// server closed the connection.
    fn call(&mut self, req: Request<'_>) -> Option<(u8, u64)> {
        let mut out = Vec::new();
        proto::encode_request(&req, &mut out);
        match self.s.write_all(&out) {
            Ok(()) => {}
            Err(e) if closed(&e) => return None,
            Err(e) => panic!("send: {e}"),
        }
        loop {
            if let Decoded::Frame { frame, used } = proto::decode_reply(&self.buf, 65536) {
                let r = match frame {
                    Reply::Acquired { token, .. } => (b'A', token),
                    Reply::Timeout { .. } => (b'T', 0),
                    Reply::Busy { .. } => (b'B', 0),
                    Reply::Released { token, .. } => (b'R', token),
                    Reply::NotReleased { token, .. } => (b'N', token),
                    Reply::Extended { token, .. } => (b'E', token),
                    Reply::NotExtended { token, .. } => (b'X', token),
                    Reply::LimitMismatch { limit, .. } => (b'L', u64::from(limit)),
                };
                self.buf.drain(..used);
                return Some(r);
            }
            let mut chunk = [0u8; 4096];
            let n = match self.s.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => n,
                Err(e) if closed(&e) => return None,
                Err(e) => panic!("recv: {e}"),
            };
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// Starts `ticketd` with `args` and returns it with the client address it
/// reports on stderr.
pub(crate) fn start_ticketd(bin: &Path, args: &[String]) -> (Proc, SocketAddr) {
    let child = Command::new(bin)
        .args(args)
        .args(["--listen", "127.0.0.1:0", "--log-level", "info"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ticketd (build it with cargo build --release)");
    let mut child = Proc(child);
    let mut r = BufReader::new(child.0.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "ticketd exited");
        if let Some(rest) = line.split("listening on ").nth(1) {
            let addr = rest.split_whitespace().next().unwrap().parse().unwrap();
            std::thread::spawn(move || {
                let mut sink = String::new();
                while r.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
                    if sink.contains("leader is") {
                        eprint!("{sink}");
                    }
                    sink.clear();
                }
            });
            return (child, addr);
        }
    }
}

/// Waits until a lock can be taken through `addr` (a cluster has elected
/// a leader and applied its first entry). A node closes a connection whose
/// request it cannot answer (a proposal lost to an election that is still
/// settling); the wait then reconnects and asks again.
pub(crate) fn wait_ready(addr: SocketAddr) {
    let t0 = Instant::now();
    let limit = Duration::from_secs(20);
    loop {
        let s = loop {
            match TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(t0.elapsed() < limit, "{addr}: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        s.set_read_timeout(Some(limit)).expect("set a read timeout");
        let mut c = Conn { s, buf: Vec::new() };
        while let Some((k, t)) = c.call(Request::Acquire {
            wait_s: 0,
            lease_s: 1,
            owner: 1,
            key: "warmup",
        }) {
            if k == b'A' {
                // Its outcome does not matter: the lease ends in 1 s.
                let _ = c.call(Request::Release {
                    token: t,
                    key: "warmup",
                });
                return;
            }
            assert!(t0.elapsed() < limit, "{addr}: no leader after {limit:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            t0.elapsed() < limit,
            "{addr}: the node kept closing connections for {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The CA and three node certificates in `dir`, as `ticket certs init`
/// makes them.
#[cfg(feature = "cluster")]
pub(crate) fn make_certs(dir: &Path) {
    ticketd::cluster::certs::init(&ticketd::cluster::certs::InitOptions {
        dir: dir.to_path_buf(),
        cluster_name: "ticketd".into(),
        nodes: 3,
    })
    .expect("make peer certificates");
}

#[cfg(not(feature = "cluster"))]
pub(crate) fn make_certs(_dir: &Path) {
    panic!("peer TLS needs ticketd built with the `cluster` feature (pass --no-peer-tls)");
}

/// A fresh single etcd node on free loopback ports, fsync on (its
/// default), and its data directory.
pub(crate) fn start_etcd() -> (Proc, SocketAddr, PathBuf) {
    let dir = temp_dir("etcd");
    let cport = free_port();
    let pport = free_port();
    let curl = format!("http://127.0.0.1:{cport}");
    let purl = format!("http://127.0.0.1:{pport}");
    let etcd = Proc(
        Command::new("etcd")
            .args([
                "--data-dir",
                &dir.display().to_string(),
                "--listen-client-urls",
                &curl,
                "--advertise-client-urls",
                &curl,
                "--listen-peer-urls",
                &purl,
                "--initial-advertise-peer-urls",
                &purl,
                "--initial-cluster",
                &format!("default={purl}"),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn etcd"),
    );
    let addr: SocketAddr = format!("127.0.0.1:{cport}").parse().unwrap();
    let t0 = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(20), "etcd did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    (etcd, addr, dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A node that closes the first connection after reading its acquire
    /// (a proposal lost to an election) and grants on the second:
    /// `wait_ready` reconnects instead of failing the run.
    #[test]
    fn wait_ready_reconnects_when_a_node_closes_the_connection() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("local address");
        let node = std::thread::spawn(move || {
            let read_one = |s: &mut TcpStream| {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 256];
                loop {
                    if let Decoded::Frame { frame, used } = proto::decode_request(&buf, 64) {
                        let r = match frame {
                            Request::Acquire { .. } => b'A',
                            Request::Release { .. } => b'R',
                            _ => b'?',
                        };
                        buf.drain(..used);
                        return r;
                    }
                    let n = s.read(&mut chunk).expect("read");
                    assert!(n > 0, "the client closed first");
                    buf.extend_from_slice(&chunk[..n]);
                }
            };
            let (mut first, _) = l.accept().expect("accept 1");
            assert_eq!(read_one(&mut first), b'A');
            drop(first);
            let (mut second, _) = l.accept().expect("accept 2");
            assert_eq!(read_one(&mut second), b'A');
            let mut out = Vec::new();
            proto::encode_reply(
                &Reply::Acquired {
                    token: 7,
                    owner: 1,
                    key: "warmup",
                },
                &mut out,
            );
            second.write_all(&out).expect("grant");
            assert_eq!(read_one(&mut second), b'R');
            out.clear();
            proto::encode_reply(
                &Reply::Released {
                    token: 7,
                    key: "warmup",
                },
                &mut out,
            );
            second.write_all(&out).expect("release");
        });
        wait_ready(addr);
        node.join().expect("the node's side saw two connections");
    }
}

//! Lock cycles per second of a 3-node ticketd cluster (fsync on), and of a
//! single etcd node under the same lock workload, same number of clients.
//!
//! Each client locks its own key and unlocks it, in a loop, one request at a
//! time: ticketd `A wait=5 lease=30` then `R`; etcd `/v3/lock/lock` with a
//! 30 s lease then `/v3/lock/unlock` (the lock API etcd users call, through
//! etcd's JSON gateway). Prints cycles/s and latency percentiles.
//!
//!     cargo build --release && cargo run --release --example cluster_bench -- \
//!         [--clients 50] [--seconds 10] [--etcd]
//!
//! Needs the release `ticketd` binary (target/release/ticketd) and, with
//! `--etcd`, `etcd` on the PATH. Everything runs on loopback; the processes
//! it starts are killed when it ends.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ticketd::proto::{self, Decoded, Reply, Request};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn temp_dir(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("ticketd-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

struct Stats {
    cycles: u64,
    lat_us: Vec<u64>,
}

fn report(name: &str, clients: usize, elapsed: Duration, all: Vec<Stats>) -> f64 {
    let cycles: u64 = all.iter().map(|s| s.cycles).sum();
    let mut lat: Vec<u64> = all.into_iter().flat_map(|s| s.lat_us).collect();
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let rate = cycles as f64 / elapsed.as_secs_f64();
    println!(
        "{name}: {clients} clients, {cycles} lock cycles in {:.1} s = {rate:.0} cycles/s; \
         cycle latency p50 {} us, p99 {} us",
        elapsed.as_secs_f64(),
        pct(0.5),
        pct(0.99)
    );
    rate
}

// ---- ticketd ------------------------------------------------------------

struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    fn call(&mut self, req: Request<'_>) -> (u8, u64) {
        let mut out = Vec::new();
        proto::encode_request(&req, &mut out);
        self.s.write_all(&out).expect("send");
        loop {
            if let Decoded::Frame { frame, used } = proto::decode_reply(&self.buf, 65536) {
                let r = match frame {
                    Reply::Acquired { token, .. } => (b'A', token),
                    Reply::Timeout { .. } => (b'T', 0),
                    Reply::Busy { .. } => (b'B', 0),
                    Reply::Released { token, .. } => (b'R', token),
                    Reply::NotReleased { token, .. } => (b'N', token),
                };
                self.buf.drain(..used);
                return r;
            }
            let mut chunk = [0u8; 4096];
            let n = self.s.read(&mut chunk).expect("recv");
            assert!(n > 0, "server closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

fn start_ticketd(bin: &Path, id: usize, peers: &str, dir: &Path) -> (Proc, SocketAddr) {
    let child = Command::new(bin)
        .args([
            "--cluster",
            "--id",
            &id.to_string(),
            "--peers",
            peers,
            "--data-dir",
            &dir.display().to_string(),
            "--listen",
            "127.0.0.1:0",
            "--log-level",
            "info",
        ])
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
                    sink.clear();
                }
            });
            return (child, addr);
        }
    }
}

fn bench_ticketd(clients: usize, seconds: u64) -> f64 {
    let bin = PathBuf::from("target/release/ticketd");
    let peers: Vec<String> = (1..=3)
        .map(|i| format!("{i}=127.0.0.1:{}", free_port()))
        .collect();
    let peers = peers.join(",");
    let dirs: Vec<PathBuf> = (1..=3).map(|i| temp_dir(&format!("node{i}"))).collect();
    let nodes: Vec<(Proc, SocketAddr)> = (0..3)
        .map(|i| start_ticketd(&bin, i + 1, &peers, &dirs[i]))
        .collect();
    // Wait for a leader.
    let mut c = Conn {
        s: TcpStream::connect(nodes[0].1).unwrap(),
        buf: Vec::new(),
    };
    let t0 = Instant::now();
    loop {
        let (k, t) = c.call(Request::Acquire {
            wait_s: 0,
            lease_s: 1,
            owner: 1,
            key: "warmup",
        });
        if k == b'A' {
            c.call(Request::Release {
                token: t,
                key: "warmup",
            });
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no leader");
        std::thread::sleep(Duration::from_millis(50));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let addr = nodes[i % 3].1;
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let s = TcpStream::connect(addr).unwrap();
                s.set_nodelay(true).unwrap();
                let mut c = Conn { s, buf: Vec::new() };
                let key = format!("bench-{i}");
                let mut st = Stats {
                    cycles: 0,
                    lat_us: Vec::new(),
                };
                let mut owner = (i as u64) << 40;
                while !stop.load(Ordering::Relaxed) {
                    owner += 1;
                    let t = Instant::now();
                    let (k, token) = c.call(Request::Acquire {
                        wait_s: 5,
                        lease_s: 30,
                        owner,
                        key: &key,
                    });
                    if k != b'A' {
                        continue;
                    }
                    let (k, _) = c.call(Request::Release { token, key: &key });
                    assert_eq!(k, b'R');
                    st.cycles += 1;
                    st.lat_us.push(t.elapsed().as_micros() as u64);
                }
                st
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(seconds));
    stop.store(true, Ordering::Relaxed);
    let all: Vec<Stats> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let rate = report(
        "ticketd 3-node cluster (fsync on)",
        clients,
        start.elapsed(),
        all,
    );
    drop(nodes);
    for d in dirs {
        let _ = std::fs::remove_dir_all(d);
    }
    rate
}

// ---- etcd ---------------------------------------------------------------

struct Http {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Http {
    fn post(&mut self, path: &str, body: &str) -> String {
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.s.write_all(req.as_bytes()).unwrap();
        loop {
            if let Some(end) = find(&self.buf, b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buf[..end]).to_lowercase();
                let body_start = end + 4;
                if let Some(cl) = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                {
                    if self.buf.len() >= body_start + cl {
                        let body = String::from_utf8_lossy(&self.buf[body_start..body_start + cl])
                            .into_owned();
                        self.buf.drain(..body_start + cl);
                        return body;
                    }
                } else if head.contains("transfer-encoding: chunked") {
                    if let Some(done) = find(&self.buf[body_start..], b"0\r\n\r\n") {
                        let body =
                            String::from_utf8_lossy(&self.buf[body_start..body_start + done])
                                .into_owned();
                        self.buf.drain(..body_start + done + 5);
                        return body;
                    }
                }
            }
            let mut chunk = [0u8; 8192];
            let n = self.s.read(&mut chunk).unwrap();
            assert!(n > 0, "etcd closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

fn json_str(body: &str, field: &str) -> String {
    let pat = format!("\"{field}\":\"");
    let rest = &body[body
        .find(&pat)
        .unwrap_or_else(|| panic!("{field} in {body}"))
        + pat.len()..];
    rest[..rest.find('"').unwrap()].to_owned()
}

fn b64(s: &str) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let b = s.as_bytes();
    let mut o = String::new();
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                o.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                o.push('=');
            }
        }
    }
    o
}

fn bench_etcd(clients: usize, seconds: u64) -> f64 {
    let dir = temp_dir("etcd");
    let cport = free_port();
    let pport = free_port();
    let curl = format!("http://127.0.0.1:{cport}");
    let purl = format!("http://127.0.0.1:{pport}");
    let _etcd = Proc(
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
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let s = TcpStream::connect(addr).unwrap();
                s.set_nodelay(true).unwrap();
                let mut h = Http { s, buf: Vec::new() };
                let lease = h.post("/v3/lease/grant", "{\"TTL\":30}");
                let id = json_str(&lease, "ID");
                let name = b64(&format!("bench-{i}"));
                let mut st = Stats {
                    cycles: 0,
                    lat_us: Vec::new(),
                };
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let r = h.post(
                        "/v3/lock/lock",
                        &format!("{{\"name\":\"{name}\",\"lease\":\"{id}\"}}"),
                    );
                    let key = json_str(&r, "key");
                    h.post("/v3/lock/unlock", &format!("{{\"key\":\"{key}\"}}"));
                    st.cycles += 1;
                    st.lat_us.push(t.elapsed().as_micros() as u64);
                }
                st
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(seconds));
    stop.store(true, Ordering::Relaxed);
    let all: Vec<Stats> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let rate = report("etcd single node (lock API)", clients, start.elapsed(), all);
    let _ = std::fs::remove_dir_all(dir);
    rate
}

fn main() {
    let mut args = pico_args::Arguments::from_env();
    let clients: usize = args.opt_value_from_str("--clients").unwrap().unwrap_or(50);
    let seconds: u64 = args.opt_value_from_str("--seconds").unwrap().unwrap_or(10);
    let etcd = args.contains("--etcd");
    let ours = bench_ticketd(clients, seconds);
    if etcd {
        let theirs = bench_etcd(clients, seconds);
        println!("ratio: ticketd cluster / etcd = {:.1}x", ours / theirs);
    }
}

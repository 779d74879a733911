//! The admin port (`--admin-listen`) of the real `ticketd` binary, read by
//! real clients: `promtool check metrics` on a scrape, a real Prometheus
//! server scraping it, every JSON body parsed by Python's `json` module and
//! compared with what the test did, health endpoints across a restart
//! grace, and abusive admin clients that must not delay a lock reply.

use ticketd_testkit::process as common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, Client, Reply, Ticketd};
use ticketd::client::admin::{self, AdminError, Json};

/// Starts `ticketd` with the admin port on a free port; returns it and the
/// admin address (from its start-up log).
fn start(args: &[&str]) -> (Ticketd, SocketAddr) {
    let mut all = vec!["--admin-listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let t = Ticketd::start(&all);
    let addr = t.admin_addr().expect("admin start-up line");
    (t, addr)
}

/// One HTTP/1.1 exchange: status and body.
fn http(addr: SocketAddr, method: &str, target: &str) -> (u16, String) {
    try_http(addr, method, target).expect("an HTTP response")
}

/// One HTTP/1.1 exchange; `None` when the connection is refused or reset.
fn try_http(addr: SocketAddr, method: &str, target: &str) -> Option<(u16, String)> {
    common::http(addr, method, target)
}

fn get(addr: SocketAddr, target: &str) -> (u16, String) {
    http(addr, "GET", target)
}

/// Parses `json` with Python's `json` module and prints `expr` of it
/// (`j` is the parsed value): a real JSON parser, not ours.
fn py(json: &str, expr: &str) -> String {
    let mut child = Command::new("python3")
        .args([
            "-c",
            &format!("import json,sys\nj=json.load(sys.stdin)\nprint({expr})"),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 must be installed");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(json.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python3 could not parse {json:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The value of the sample `name` (with its labels, as written) in a scrape.
fn sample(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {name} in:\n{scrape}"))
        .parse()
        .unwrap()
}

fn token(r: &Reply) -> u64 {
    match r {
        Reply::Acquired { token, .. } => *token,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ticketd-admin-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn metrics_count_what_clients_did_and_pass_promtool() {
    let (t, admin) = start(&[]);
    let mut c = t.connect();
    let k1 = token(&c.acquire_reply("k1", 1, 0, 30));
    let k2 = token(&c.acquire_reply("k2", 2, 0, 30));
    assert!(matches!(
        c.acquire_reply("k1", 3, 0, 30),
        Reply::Timeout { .. }
    ));
    assert!(matches!(c.release_reply("k2", k2), Reply::Released { .. }));
    assert!(matches!(
        c.release_reply("k1", k1 + 100),
        Reply::NotReleased { .. }
    ));
    // One waiter on k1, handed the key on release.
    let mut w = t.connect();
    w.acquire("k1", 4, 10, 30);
    let waiting = Instant::now() + Duration::from_secs(5);
    while !get(admin, "/metrics").1.contains("\nticketd_waiters 1\n") {
        assert!(Instant::now() < waiting, "the waiter never showed");
    }
    assert!(matches!(c.release_reply("k1", k1), Reply::Released { .. }));
    assert!(matches!(w.recv(), Reply::Acquired { owner: 4, .. }));

    let (status, m) = get(admin, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(sample(&m, "ticketd_keys"), 1.0);
    assert_eq!(sample(&m, "ticketd_waiters"), 0.0);
    assert_eq!(sample(&m, "ticketd_connections"), 2.0);
    assert_eq!(sample(&m, "ticketd_requests_total{op=\"acquire\"}"), 4.0);
    assert_eq!(sample(&m, "ticketd_requests_total{op=\"release\"}"), 3.0);
    assert_eq!(sample(&m, "ticketd_replies_total{reply=\"acquired\"}"), 3.0);
    assert_eq!(sample(&m, "ticketd_replies_total{reply=\"timeout\"}"), 1.0);
    assert_eq!(sample(&m, "ticketd_replies_total{reply=\"released\"}"), 2.0);
    assert_eq!(
        sample(&m, "ticketd_replies_total{reply=\"not_released\"}"),
        1.0
    );
    assert_eq!(sample(&m, "ticketd_grants_total{path=\"fresh\"}"), 2.0);
    assert_eq!(sample(&m, "ticketd_grants_total{path=\"handover\"}"), 1.0);
    assert_eq!(sample(&m, "ticketd_wait_seconds_count"), 3.0);
    assert_eq!(sample(&m, "ticketd_hold_seconds_count"), 2.0);
    assert_eq!(sample(&m, "ticketd_wait_seconds_bucket{le=\"+Inf\"}"), 3.0);
    assert!(m.contains(&format!(
        "ticketd_build_info{{version=\"{}\"}} 1\n",
        env!("CARGO_PKG_VERSION")
    )));
    assert!(
        !m.contains("ticketd_raft_"),
        "no cluster metrics in single mode"
    );

    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool must be installed (apt-get install prometheus)");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(m.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}\n{m}"
    );
}

/// A Prometheus server on a free port, scraping `target` every 200 ms;
/// killed on drop.
struct Prometheus {
    child: std::process::Child,
    addr: SocketAddr,
    dir: PathBuf,
}

impl Prometheus {
    fn start(target: SocketAddr, dir: &Path) -> Prometheus {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 200ms\n  scrape_timeout: 200ms\n\
                 scrape_configs:\n  - job_name: ticketd\n    static_configs:\n      \
                 - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
            .spawn()
            .expect("prometheus must be installed (apt-get install prometheus)");
        Prometheus {
            child,
            addr,
            dir: dir.to_path_buf(),
        }
    }

    /// The value of the instant query `q`, once Prometheus has one.
    fn query(&self, q: &str) -> Option<String> {
        let mut s = TcpStream::connect(self.addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(
            s,
            "GET /api/v1/query?query={q} HTTP/1.1\r\nHost: prometheus\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut raw = String::new();
        s.read_to_string(&mut raw).ok()?;
        let body = raw.split_once("\r\n\r\n")?.1;
        // Chunked or not, the JSON object is the part between the braces.
        let json = &body[body.find('{')?..=body.rfind('}')?];
        let v = py(
            json,
            "j['data']['result'][0]['value'][1] if j['data']['result'] else ''",
        );
        (!v.is_empty()).then_some(v)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_real_prometheus_scrapes_the_admin_port() {
    let (t, admin) = start(&[]);
    let mut c = t.connect();
    for (i, k) in ["p1", "p2", "p3"].iter().enumerate() {
        token(&c.acquire_reply(k, i as u64, 0, 60));
    }
    let dir = tmp_dir("prometheus");
    let p = Prometheus::start(admin, &dir);
    let deadline = Instant::now() + Duration::from_secs(60);
    let want = |q: &str, v: &str| loop {
        if p.query(q).as_deref() == Some(v) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus never saw {q} = {v} (last: {:?})\n{}",
            p.query(q),
            p.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    want("up", "1");
    want("ticketd_keys", "3");
    // A change made now shows in a later scrape.
    let t4 = token(&c.acquire_reply("p4", 9, 0, 60));
    want("ticketd_keys", "4");
    assert!(matches!(c.release_reply("p4", t4), Reply::Released { .. }));
    want("ticketd_keys", "3");
    want("ticketd_requests_total%7Bop%3D%22release%22%7D", "1");
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lock_endpoints_answer_json_that_matches_the_table() {
    let (t, admin) = start(&[]);
    let mut c = t.connect();
    // Long leases and waits: a loaded machine must not end them mid-test.
    let held = token(&c.acquire_reply("a/1", 1, 0, 255));
    let mut w = t.connect();
    w.acquire("a/1", 2, 255, 30);
    w.acquire("a/1", 3, 255, 30);
    let space = token(&c.acquire_reply("a b\"\u{e9}", 4, 0, 255));
    // 2,500 keys more, pipelined, to page through.
    let mut bulk = Client::connect(t.addr());
    let mut frames = Vec::new();
    for i in 0..2_500u64 {
        frames.extend_from_slice(&common::acquire_frame(&format!("bulk/{i:05}"), i, 0, 255));
    }
    bulk.send(&frames);
    for _ in 0..2_500 {
        token(&bulk.recv());
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, body) = get(admin, "/v1/locks/a%2F1");
        if py(&body, "j['waiters']") == "2" {
            break;
        }
        assert!(Instant::now() < deadline, "waiters never queued: {body}");
    }

    let (status, body) = get(admin, "/v1/locks/a%2F1");
    assert_eq!(status, 200, "{body}");
    assert_eq!(py(&body, "j['key']"), "a/1");
    // A reader that is not --admin-identity sees the sequence, not the
    // token (which would release the grant).
    assert_eq!(py(&body, "j['token']"), "None");
    assert_eq!(py(&body, "j['sequence']"), (held >> 16).to_string());
    assert_eq!(py(&body, "j['holder']"), "ip:127.0.0.1");
    let expires: u64 = py(&body, "j['expires_in_ms']").parse().unwrap();
    let held_for: u64 = py(&body, "j['held_for_ms']").parse().unwrap();
    assert!(expires <= 255_001 && expires > 155_000, "{body}");
    assert!(
        held_for < 100_000 && held_for + expires <= 255_001,
        "{body}"
    );
    assert_eq!(
        py(&body, "sorted(j.keys())"),
        "['expires_in_ms', 'held_for_ms', 'holder', 'key', 'sequence', 'token', 'waiters']"
    );
    let (status, body) = get(admin, "/v1/locks/a%20b%22%C3%A9");
    assert_eq!(status, 200, "{body}");
    assert_eq!(py(&body, "j['key'] == 'a b\"\\u00e9'"), "True", "{body}");
    assert_eq!(py(&body, "j['sequence']"), (space >> 16).to_string());
    let (status, body) = get(admin, "/v1/locks/nobody");
    assert_eq!(status, 404);
    assert_eq!(py(&body, "j['error']"), "not registered");

    // Paging: every bulk key once, in order, 1,000 at most per page.
    let mut seen = Vec::new();
    let mut after = String::new();
    loop {
        let target = format!("/v1/locks?prefix=bulk%2F&limit=1000{after}");
        let (status, body) = get(admin, &target);
        assert_eq!(status, 200, "{body}");
        let n: usize = py(&body, "len(j['locks'])").parse().unwrap();
        assert!(n <= 1000);
        let keys = py(&body, "'\\n'.join(l['key'] for l in j['locks'])");
        seen.extend(keys.lines().map(str::to_string));
        let next = py(&body, "j['next'] or ''");
        if next.is_empty() {
            break;
        }
        after = format!("&after={}", next.replace('/', "%2F"));
    }
    let want: Vec<String> = (0..2_500).map(|i| format!("bulk/{i:05}")).collect();
    assert_eq!(seen, want);
    let (_, body) = get(admin, "/v1/locks?prefix=a");
    assert_eq!(
        py(&body, "[l['key'] for l in j['locks']]"),
        "['a b\"é', 'a/1']"
    );
    assert_eq!(py(&body, "j['locks'][1]['waiters']"), "2");
    assert_eq!(py(&body, "j['next']"), "None");

    // Bad requests change nothing and say why.
    for (target, status) in [
        ("/v1/locks?limit=1001", 400),
        ("/v1/locks?limit=0", 400),
        ("/v1/locks?limit=+5", 400),
        ("/v1/locks?limit=%205", 400),
        ("/v1/locks?colour=red", 400),
        ("/v1/locks/%zz", 400),
        ("/v1/locks/%FF", 400),
        ("/v1/locks/a%0Ab", 400),
        ("/v1/nothing", 404),
        ("/v1/cluster", 404),
    ] {
        let (got, body) = get(admin, target);
        assert_eq!(got, status, "{target}: {body}");
    }
    let (status, _) = http(admin, "POST", "/metrics");
    assert_eq!(status, 405);
    let (status, _) = http(admin, "DELETE", "/v1/locks/a%2F1");
    assert_eq!(status, 405);
    assert_eq!(get(admin, "/livez"), (200, "ok\n".to_string()));
    // A client that shuts its side after the request still gets the answer.
    let mut s = TcpStream::connect(admin).unwrap();
    s.write_all(b"GET /livez HTTP/1.1\r\n\r\n").unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    assert!(
        raw.starts_with("HTTP/1.1 200 OK\r\n") && raw.ends_with("\r\n\r\nok\n"),
        "{raw}"
    );
    let (_, m) = get(admin, "/metrics");
    assert_eq!(sample(&m, "ticketd_keys"), 2_502.0);
}

#[test]
fn readyz_is_503_during_a_restart_grace_and_200_after() {
    let dir = tmp_dir("grace");
    let d = dir.to_str().unwrap();
    let (mut t, admin) = start(&["--data-dir", d]);
    assert_eq!(get(admin, "/readyz"), (200, "ok\n".to_string()));
    let mut c = t.connect();
    token(&c.acquire_reply("g", 1, 0, 2));
    t.signal(libc::SIGTERM);
    t.wait_exit(Duration::from_secs(10))
        .expect("stops on SIGTERM");
    // The lease of the first run may still run: every key is held.
    let (t2, admin) = start(&["--data-dir", d]);
    let (status, body) = get(admin, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("restart grace"), "{body}");
    assert_eq!(get(admin, "/livez").0, 200);
    // The scrape says so too: seconds left (at most the 2 s lease and the
    // 1 s step), and the bound's writes so far (this start's own).
    let (_, m) = get(admin, "/metrics");
    let left = sample(&m, "ticketd_restart_grace_seconds");
    assert!(left > 0.0 && left <= 3.0, "{left}\n{m}");
    assert_eq!(sample(&m, "ticketd_lease_bound_writes_total"), 1.0, "{m}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(admin, "/readyz").0 != 200 {
        assert!(Instant::now() < deadline, "still not ready after the grace");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, m) = get(admin, "/metrics");
    assert_eq!(sample(&m, "ticketd_restart_grace_seconds"), 0.0, "{m}");
    let mut c = t2.connect();
    token(&c.acquire_reply("g", 2, 0, 2));
    // That grant passed the bound: one more write.
    let (_, m) = get(admin, "/metrics");
    assert_eq!(sample(&m, "ticketd_lease_bound_writes_total"), 2.0, "{m}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Lock round trips (acquire + release of a fresh key) on `c`, in µs.
fn round_trips(c: &mut Client, n: usize, tag: &str) -> Vec<u128> {
    let mut us = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("rt-{tag}-{i}");
        let start = Instant::now();
        let tok = token(&c.acquire_reply(&key, i as u64, 0, 30));
        assert!(matches!(c.release_reply(&key, tok), Reply::Released { .. }));
        us.push(start.elapsed().as_micros());
    }
    us.sort_unstable();
    us
}

#[test]
fn slow_huge_and_many_admin_clients_never_delay_a_lock_reply() {
    let (t, admin) = start(&[]);
    let mut c = t.connect();
    let before = round_trips(&mut c, 200, "before");
    // Partial requests that never finish.
    let mut held = Vec::new();
    for _ in 0..20 {
        let mut s = TcpStream::connect(admin).unwrap();
        s.write_all(b"GET /metr").unwrap();
        held.push(s);
    }
    // A huge header: 431, and the connection is closed.
    let mut huge = TcpStream::connect(admin).unwrap();
    huge.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut req = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
    req.resize(req.len() + 64 * 1024, b'x');
    let _ = huge.write_all(&req);
    // Clients that ask for a listing and never read it.
    for _ in 0..10 {
        let mut s = TcpStream::connect(admin).unwrap();
        s.write_all(b"GET /v1/locks?limit=1000 HTTP/1.1\r\n\r\n")
            .unwrap();
        held.push(s);
    }
    // Thousands of connections: beyond the admin limit they are refused.
    for _ in 0..2_000 {
        if let Ok(s) = TcpStream::connect(admin) {
            held.push(s);
        }
        if held.len() > 300 {
            held.truncate(40);
        }
    }
    let during = round_trips(&mut c, 200, "during");
    let mut head = [0u8; 12];
    let got = huge.read(&mut head).unwrap_or(0);
    assert!(
        got == 0 || head.starts_with(b"HTTP/1.1 431"),
        "huge header: {:?}",
        String::from_utf8_lossy(&head[..got])
    );
    drop(held);
    let p = |v: &[u128], q: usize| v[(v.len() * q / 100).min(v.len() - 1)];
    println!(
        "lock round trip, µs: before p50 {} p99 {} max {}; with abusive admin clients p50 {} \
         p99 {} max {}",
        p(&before, 50),
        p(&before, 99),
        before[before.len() - 1],
        p(&during, 50),
        p(&during, 99),
        during[during.len() - 1]
    );
    // Under a loaded test machine a round trip can take milliseconds; an
    // admin client that delayed the loop would cost seconds (the timeout).
    assert!(p(&during, 99) < 200_000, "p99 {} µs", p(&during, 99));
    // The port still answers, and counted the refusals.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some((status, m)) = try_http(admin, "GET", "/metrics") {
            assert_eq!(status, 200);
            if sample(
                &m,
                "ticketd_connections_refused_total{reason=\"admin_max_conns\"}",
            ) > 0.0
            {
                break;
            }
        }
        assert!(Instant::now() < deadline, "no admin refusal counted");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A three-node cluster on loopback, each node with its admin port.
#[cfg(feature = "cluster")]
struct Cluster {
    nodes: Vec<(Ticketd, SocketAddr)>,
    peers: Vec<SocketAddr>,
    dirs: Vec<PathBuf>,
}

#[cfg(feature = "cluster")]
impl Cluster {
    fn start(name: &str) -> Cluster {
        let peers: Vec<SocketAddr> = (0..3)
            .map(|_| format!("127.0.0.1:{}", free_port()).parse().unwrap())
            .collect();
        let spec: Vec<String> = peers
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{}={a}", i + 1))
            .collect();
        let spec = spec.join(",");
        let dirs: Vec<PathBuf> = (1..=3).map(|i| tmp_dir(&format!("{name}-{i}"))).collect();
        let nodes = (0..3)
            .map(|i| {
                let id = (i + 1).to_string();
                let dir = dirs[i].display().to_string();
                start(&[
                    "--cluster",
                    "--id",
                    &id,
                    "--peers",
                    &spec,
                    "--data-dir",
                    &dir,
                    "--tick-ms",
                    "50",
                    "--cluster-name",
                    name,
                ])
            })
            .collect();
        Cluster { nodes, peers, dirs }
    }

    fn admin(&self, i: usize) -> SocketAddr {
        self.nodes[i].1
    }

    /// Waits until `/readyz` of node `i` answers `status`.
    fn wait_ready(&self, i: usize, status: u16, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let (got, body) = get(self.admin(i), "/readyz");
            if got == status {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "node {} /readyz stayed {got} ({body}), wanted {status}",
                i + 1
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[cfg(feature = "cluster")]
impl Drop for Cluster {
    fn drop(&mut self) {
        for (t, _) in &self.nodes {
            t.signal(libc::SIGCONT);
        }
        self.nodes.clear();
        for d in &self.dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[cfg(feature = "cluster")]
#[test]
fn cluster_status_metrics_and_readyz_follow_the_majority() {
    let c = Cluster::start("admin-cluster");
    for i in 0..3 {
        c.wait_ready(i, 200, Duration::from_secs(30));
    }
    // Every node names the same leader and the three voters. (Under load
    // an election can follow start-up: wait until the three agree.)
    let agreed = Instant::now() + Duration::from_secs(30);
    let (leader, bodies) = loop {
        let bodies: Vec<(u16, String)> = (0..3).map(|i| get(c.admin(i), "/v1/cluster")).collect();
        let named: Vec<String> = bodies.iter().map(|(_, b)| py(b, "j['leader']")).collect();
        let leader = named[0].parse::<usize>().unwrap_or(0);
        if (1..=3).contains(&leader) && named.iter().all(|n| *n == named[0]) {
            break (leader, bodies);
        }
        assert!(Instant::now() < agreed, "no agreed leader: {bodies:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    for (i, (status, body)) in bodies.iter().enumerate() {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(py(body, "j['id']"), (i + 1).to_string());
        let want: Vec<String> = c.peers.iter().map(ToString::to_string).collect();
        assert_eq!(
            py(
                body,
                "','.join(str(v['id']) + '=' + v['address'] for v in j['voters'])"
            ),
            format!("1={},2={},3={}", want[0], want[1], want[2])
        );
        assert_eq!(py(body, "j['learners']"), "[]");
        let applied: u64 = py(body, "j['applied']").parse().unwrap();
        let commit: u64 = py(body, "j['commit']").parse().unwrap();
        assert!(applied >= 1 && applied <= commit, "{body}");
        let on_leader = i + 1 == leader;
        assert_eq!(
            py(
                body,
                "all('match' in v and 'reachable' in v for v in j['voters'])"
            ),
            if on_leader { "True" } else { "False" },
            "{body}"
        );
    }
    // A grant shows on every node, with the same token.
    let l = leader - 1;
    let mut client = c.nodes[l].0.connect();
    let tok = token(&client.acquire_reply("ck", 1, 0, 60));
    for i in 0..3 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (status, body) = get(c.admin(i), "/v1/locks/ck");
            if status == 200 {
                assert_eq!(py(&body, "j['sequence']"), (tok >> 16).to_string());
                assert_eq!(py(&body, "j['expires_in_ms']"), "None");
                break;
            }
            assert!(Instant::now() < deadline, "node {} never applied ck", i + 1);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let reachable = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = get(c.admin(l), "/v1/cluster");
        if py(&body, "all(v['reachable'] for v in j['voters'])") == "True" {
            break;
        }
        assert!(
            Instant::now() < reachable,
            "a voter stays unreachable: {body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, m) = get(c.admin(l), "/metrics");
    assert_eq!(sample(&m, "ticketd_raft_is_leader"), 1.0);
    assert_eq!(sample(&m, "ticketd_raft_leader_id"), leader as f64);
    assert_eq!(sample(&m, "ticketd_keys"), 1.0);
    assert!(sample(&m, "ticketd_raft_term") >= 1.0);
    assert!(sample(&m, "ticketd_raft_leader_changes_total") >= 1.0);
    assert!(sample(&m, "ticketd_wal_fsync_seconds_count") >= 1.0);
    assert_eq!(sample(&m, "ticketd_snapshots_sent_total"), 0.0);
    // Correct peers send nothing the node refuses.
    assert_eq!(sample(&m, "ticketd_raft_messages_refused_total"), 0.0);
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool must be installed (apt-get install prometheus)");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(m.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // `ticket cluster status`, for a person and as JSON.
    let a = c.admin(l).to_string();
    let (code, out, err) = ticket(&["cluster", "status", "--admin", &a]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with(&format!("node {leader}: leader {leader}, term ")),
        "{out}"
    );
    let rows: Vec<Vec<&str>> = out
        .lines()
        .skip(3)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 3, "{out}");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r[0], (i + 1).to_string());
        assert_eq!(r[1], c.peers[i].to_string());
        assert_eq!(r[2], if i == l { "leader" } else { "voter" });
        assert_eq!(r[4], "yes");
    }
    let (code, out, _) = ticket(&["cluster", "status", "--admin", &a, "--json"]);
    assert_eq!(code, 0);
    assert_eq!(
        py(&out, "(j['id'], j['leader'])"),
        format!("({leader}, {leader})")
    );

    // The majority stopped: the leader, alone, steps down and is not ready.
    let others: Vec<usize> = (0..3).filter(|&i| i != l).collect();
    for &i in &others {
        c.nodes[i].0.signal(libc::SIGSTOP);
    }
    let body = c.wait_ready(l, 503, Duration::from_secs(30));
    assert!(
        body.contains("no leader") || body.contains("applied"),
        "{body}"
    );
    assert_eq!(get(c.admin(l), "/livez").0, 200);
    let (_, m) = get(c.admin(l), "/metrics");
    assert_eq!(sample(&m, "ticketd_raft_is_leader"), 0.0);
    // And back.
    for &i in &others {
        c.nodes[i].0.signal(libc::SIGCONT);
    }
    for i in 0..3 {
        c.wait_ready(i, 200, Duration::from_secs(30));
    }
}

/// `name` of node `i`'s scrape, waiting up to 10 s for `until` to hold.
#[cfg(feature = "cluster")]
fn cluster_sample(c: &Cluster, i: usize, name: &str, until: impl Fn(f64) -> bool) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = sample(&get(c.admin(i), "/metrics").1, name);
        if until(v) || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(feature = "cluster")]
#[test]
fn cluster_wait_and_hold_histograms_count_what_clients_did() {
    let c = Cluster::start("admin-hist");
    for i in 0..3 {
        c.wait_ready(i, 200, Duration::from_secs(30));
    }
    let (_, body) = get(c.admin(0), "/v1/cluster");
    let l: usize = py(&body, "j['leader']").parse::<usize>().unwrap() - 1;
    // The clients talk to a follower: it answers them and counts waits;
    // the leader counts holds.
    let f = (l + 1) % 3;
    let mut a = c.nodes[f].0.connect();
    let mut b = c.nodes[f].0.connect();
    // Under load a leader change right after start-up can answer the
    // first request busy: try again, briefly.
    let settled = Instant::now() + Duration::from_secs(20);
    let k1 = loop {
        match a.acquire_reply("h1", 1, 0, 60) {
            Reply::Busy { .. } if Instant::now() < settled => {
                std::thread::sleep(Duration::from_millis(100));
            }
            r => break token(&r),
        }
    };
    let k2 = token(&a.acquire_reply("h2", 2, 0, 60));
    // A waiter on h1, handed it after at least 300 ms.
    b.acquire("h1", 3, 30, 60);
    let queued = Instant::now() + Duration::from_secs(10);
    while py(&get(c.admin(f), "/v1/locks/h1").1, "j['waiters']") != "1" {
        assert!(Instant::now() < queued, "the waiter never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    // Every node knows how long h1 (the oldest grant) has been held.
    for i in 0..3 {
        let m = get(c.admin(i), "/metrics").1;
        let oldest = sample(&m, "ticketd_oldest_hold_seconds");
        assert!((0.3..60.0).contains(&oldest), "node {}: {oldest}", i + 1);
    }
    assert!(matches!(a.release_reply("h1", k1), Reply::Released { .. }));
    let k1b = token(&b.recv());
    assert!(matches!(a.release_reply("h2", k2), Reply::Released { .. }));
    assert!(matches!(b.release_reply("h1", k1b), Reply::Released { .. }));
    // A grant left to expire: held for its whole 1 s lease.
    token(&a.acquire_reply("h3", 4, 0, 1));
    // Not counted: a release with the wrong token, a busy answer.
    assert!(matches!(
        a.release_reply("h2", k2),
        Reply::NotReleased { .. }
    ));

    let waits = cluster_sample(&c, f, "ticketd_wait_seconds_count", |v| v >= 4.0);
    assert_eq!(waits, 4.0, "four grants answered by node {}", f + 1);
    let m = get(c.admin(f), "/metrics").1;
    assert!(
        sample(&m, "ticketd_wait_seconds_bucket{le=\"0.1\"}") <= 3.0,
        "{m}"
    );
    assert!(sample(&m, "ticketd_wait_seconds_sum") >= 0.3, "{m}");
    for i in (0..3).filter(|&i| i != f) {
        let m = get(c.admin(i), "/metrics").1;
        assert_eq!(
            sample(&m, "ticketd_wait_seconds_count"),
            0.0,
            "node {}",
            i + 1
        );
    }

    let holds = cluster_sample(&c, l, "ticketd_hold_seconds_count", |v| v >= 4.0);
    let m = get(c.admin(l), "/metrics").1;
    assert_eq!(sample(&m, "ticketd_raft_leader_id"), (l + 1) as f64, "{m}");
    assert_eq!(holds, 4.0, "three releases and an expiry: {m}");
    // h1 first held >= 300 ms, h3 >= 1 s.
    assert!(
        sample(&m, "ticketd_hold_seconds_bucket{le=\"0.1\"}") <= 2.0,
        "{m}"
    );
    assert!(sample(&m, "ticketd_hold_seconds_sum") >= 1.3, "{m}");
    for i in (0..3).filter(|&i| i != l) {
        let m = get(c.admin(i), "/metrics").1;
        assert_eq!(
            sample(&m, "ticketd_hold_seconds_count"),
            0.0,
            "node {}",
            i + 1
        );
    }
    // Nothing is held any more, on any node.
    for i in 0..3 {
        let oldest = cluster_sample(&c, i, "ticketd_oldest_hold_seconds", |v| v == 0.0);
        assert_eq!(oldest, 0.0, "node {}", i + 1);
    }
}

#[test]
fn the_oldest_hold_gauge_follows_the_longest_current_grant() {
    let (t, admin) = start(&[]);
    let oldest = || sample(&get(admin, "/metrics").1, "ticketd_oldest_hold_seconds");
    assert_eq!(oldest(), 0.0, "nothing held");
    let mut c = t.connect();
    let k1 = token(&c.acquire_reply("o1", 1, 0, 255));
    std::thread::sleep(Duration::from_millis(400));
    let k2_at = Instant::now();
    let k2 = token(&c.acquire_reply("o2", 2, 0, 255));
    // Extending keeps the grant's start.
    assert!(matches!(
        c.extend_reply("o1", k1, 255),
        Reply::Extended { .. }
    ));
    let v = oldest();
    assert!((0.4..60.0).contains(&v), "o1 held for {v} s");
    assert!(matches!(c.release_reply("o1", k1), Reply::Released { .. }));
    // To the second o2 began in: at most 1 s more than its hold.
    let v = oldest();
    let bound = k2_at.elapsed().as_secs_f64() + 1.0;
    assert!(v <= bound, "o2 is the oldest now: {v} s, at most {bound} s");
    assert!(matches!(c.release_reply("o2", k2), Reply::Released { .. }));
    assert_eq!(oldest(), 0.0, "nothing held");
}

/// Runs `ticket ARGS...`: exit status, stdout, stderr.
fn ticket(args: &[&str]) -> (i32, String, String) {
    let out = common::bin_command(common::ticket_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run ticket");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn ticket_status_and_locks_read_the_admin_port() {
    let (t, admin) = start(&[]);
    let a = admin.to_string();
    let mut c = t.connect();
    let db = token(&c.acquire_reply("db/main", 1, 0, 255));
    let q = token(&c.acquire_reply("db/queue x", 2, 0, 255));
    token(&c.acquire_reply("other", 3, 0, 255));
    let mut w = t.connect();
    w.acquire("db/main", 4, 255, 60);
    let deadline = Instant::now() + Duration::from_secs(5);
    while py(&get(admin, "/v1/locks/db%2Fmain").1, "j['waiters']") != "1" {
        assert!(Instant::now() < deadline, "the waiter never queued");
    }

    let (code, out, err) = ticket(&["status", "db/main", "--admin", &a, "--json"]);
    assert_eq!(code, 0, "{err}");
    let (_, direct) = get(admin, "/v1/locks/db%2Fmain");
    assert_eq!(
        py(&out, "sorted(j.keys())"),
        py(&direct, "sorted(j.keys())")
    );
    assert_eq!(
        py(&out, "(j['key'], j['sequence'], j['waiters'])"),
        format!("('db/main', {}, 1)", db >> 16)
    );

    let (code, out, err) = ticket(&["status", "db/main", "--admin", &a]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        header,
        [
            "KEY",
            "TOKEN",
            "HOLDER",
            "EXPIRES_IN",
            "WAITERS",
            "HELD_FOR"
        ]
    );
    let row: Vec<&str> = lines[1].split_whitespace().collect();
    let seq = format!("#{}", db >> 16);
    assert_eq!(&row[..3], ["db/main", &seq, "ip:127.0.0.1"]);
    assert_eq!(row[4], "1");
    // Aligned: every column starts where its header does.
    assert_eq!(lines[0].find("TOKEN"), lines[1].find(&seq));

    let (code, _, err) = ticket(&["status", "nobody", "--admin", &a]);
    assert_eq!(code, 123, "{err}");
    assert!(err.contains("not registered"), "{err}");
    // The public reader: the same object, and a 404 as its status.
    let t5 = Duration::from_secs(5);
    let v = admin::get_json(&a, "/v1/locks/db%2Fmain", t5).expect("get_json");
    assert_eq!(v.get("key").and_then(Json::as_str), Some("db/main"));
    assert_eq!(v.get("sequence").and_then(Json::as_u64), Some(db >> 16));
    match admin::get_json(&a, "/v1/locks/nobody", t5) {
        Err(AdminError::Status { status: 404, .. }) => {}
        other => panic!("{other:?}"),
    }

    let (code, out, err) = ticket(&["locks", "db/", "--admin", &a, "--json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        py(&out, "[(l['key'], l['sequence']) for l in j['locks']]"),
        format!("[('db/main', {}), ('db/queue x', {})]", db >> 16, q >> 16)
    );
    let (code, out, err) = ticket(&["locks", "--admin", &a]);
    assert_eq!(code, 0, "{err}");
    let keys: Vec<&str> = out
        .lines()
        .skip(1)
        .map(|l| l.split("  ").next().unwrap())
        .collect();
    assert_eq!(keys, ["db/main", "db/queue x", "other"], "{out}");

    let (code, _, err) = ticket(&["cluster", "status", "--admin", &a]);
    assert_eq!(code, 125, "{err}");
    assert!(err.contains("not a cluster node"), "{err}");
    let closed = format!("127.0.0.1:{}", free_port());
    let (code, _, err) = ticket(&["locks", "--admin", &closed]);
    assert_eq!(code, 125, "{err}");
}

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
    let (status, body) = unix_get(&sock, "/v1/locks/u%2F1").expect("an answer");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        py(&body, "(j['key'], j['sequence'])"),
        format!("('u/1', {})", tok >> 16)
    );
    let (status, m) = unix_get(&sock, "/metrics").expect("an answer");
    assert_eq!(status, 200);
    assert_eq!(sample(&m, "ticketd_keys"), 1.0);
    assert_eq!(
        sample(
            &m,
            "ticketd_connections_refused_total{reason=\"admin_peer_not_allowed\"}"
        ),
        0.0
    );

    // The CLI reads it with --admin unix:/path.
    let a = format!("unix:{}", sock.display());
    let (code, out, err) = ticket(&["status", "u/1", "--admin", &a, "--json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(py(&out, "j['sequence']"), (tok >> 16).to_string());
    let (code, out, err) = ticket(&["locks", "u/", "--admin", &a]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().nth(1).unwrap().split("  ").next(), Some("u/1"));
    let (code, _, err) = ticket(&["cluster", "status", "--admin", &a]);
    assert_eq!(code, 125, "{err}");
    assert!(err.contains("not a cluster node"), "{err}");
    let gone = format!("unix:{}", dir.join("nobody.sock").display());
    let (code, _, err) = ticket(&["status", "u/1", "--admin", &gone]);
    assert_eq!(code, 125, "{err}");
    assert!(err.contains("connect"), "{err}");

    // A peer whose uid is not listed can open either socket (mode 0666) and
    // is closed at once; each refusal is counted under its own reason.
    let as_nobody = |args: &[&str]| {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(common::ticket_bin())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run setpriv")
    };
    let out = as_nobody(&[
        "acquire",
        "n/1",
        "--wait",
        "0",
        "--lease",
        "5",
        "--server",
        &client_sock,
    ]);
    assert_ne!(out.status.code(), Some(0), "{out:?}");
    let out = as_nobody(&["status", "u/1", "--admin", &a]);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    // Both were closed by the server (counted before the close), so the
    // counters are in.
    assert!(
        t.wait_for_log("refused unix(uid=65534", Duration::from_secs(10)),
        "{}",
        t.log()
    );
    let (_, m) = unix_get(&sock, "/metrics").expect("an answer");
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
    assert!(
        matches!(c.acquire_reply("n/1", 2, 0, 5), Reply::Acquired { .. }),
        "the refused peer was granted nothing"
    );

    // Stopped: the socket file goes with the server.
    drop(c);
    let mut t = t;
    assert!(t.terminate().success());
    assert!(!sock.exists(), "the socket file is removed at the end");

    // A peer whose uid is not listed is closed without an answer.
    let other = (unsafe { libc::geteuid() } + 1).to_string();
    let t = Ticketd::start(&[
        "--admin-listen",
        &format!("unix:{}", sock.display()),
        "--allow-uid",
        &other,
        "--log-level",
        "debug",
    ]);
    assert_eq!(unix_get(&sock, "/livez"), None);
    assert!(
        t.wait_for_log("admin: refused uid=", Duration::from_secs(10)),
        "{}",
        t.log()
    );
    let (code, _, err) = ticket(&["status", "u/1", "--admin", &a]);
    assert_eq!(code, 125, "{err}");
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_sample_alert_rules_in_the_docs_pass_promtool() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/OPERATIONS.md"))
        .unwrap();
    // The rules are the yaml block that starts with `groups:` (another one
    // shows a scrape configuration).
    let yaml = doc
        .split("```yaml\n")
        .skip(1)
        .map(|b| &b[..b.find("```").expect("a closed yaml block")])
        .find(|b| b.starts_with("groups:"))
        .expect("a yaml block of alert rules");
    let dir = tmp_dir("rules");
    let file = dir.join("rules.yml");
    std::fs::write(&file, yaml).unwrap();
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .expect("promtool must be installed (apt-get install prometheus)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The held-too-long alert fires on a lock held past 15 minutes and not
    // before: a gauge that grows by 60 s a minute, then drops to 0.
    let tests = dir.join("tests.yml");
    std::fs::write(
        &tests,
        "rule_files: [rules.yml]\n\
         evaluation_interval: 1m\n\
         tests:\n\
         \x20 - interval: 1m\n\
         \x20   input_series:\n\
         \x20     - series: 'ticketd_oldest_hold_seconds{instance=\"a\",job=\"ticketd\"}'\n\
         \x20       values: '0+60x20 0x5'\n\
         \x20   alert_rule_test:\n\
         \x20     - {eval_time: 14m, alertname: TicketdLockHeldTooLong, exp_alerts: []}\n\
         \x20     - {eval_time: 23m, alertname: TicketdLockHeldTooLong, exp_alerts: []}\n\
         \x20     - eval_time: 16m\n\
         \x20       alertname: TicketdLockHeldTooLong\n\
         \x20       exp_alerts:\n\
         \x20         - exp_labels: {severity: warning, instance: a, job: ticketd}\n\
         \x20           exp_annotations:\n\
         \x20             summary: 'a lock on a has been held for 16m 0s'\n",
    )
    .unwrap();
    let out = Command::new("promtool")
        .args(["test", "rules"])
        .arg(&tests)
        .output()
        .expect("promtool must be installed (apt-get install prometheus)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
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

    // Plain HTTP on the HTTPS port: closed without an HTTP answer.
    assert!(
        try_http(admin, "GET", "/livez").is_none(),
        "plain HTTP answered on the HTTPS admin port"
    );

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

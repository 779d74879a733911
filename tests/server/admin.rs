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

#[cfg(feature = "cluster")]
mod cluster;
mod listeners;
mod prometheus;

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

    paging_lists_every_key_once(admin);

    bad_requests_change_nothing_and_say_why(admin);
}

/// Paging through the 2,500 `bulk/` keys: every key once, in order, 1,000
/// at most per page; the `a` prefix lists its two keys on one page.
fn paging_lists_every_key_once(admin: SocketAddr) {
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
}

/// Bad requests on the admin port at `admin` get 400, 404 or 405 and
/// change nothing (the 2,502 keys stay); a client that shuts its side
/// after the request still gets the answer.
fn bad_requests_change_nothing_and_say_why(admin: SocketAddr) {
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

// Long because it is one scenario, step by step.
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

    ticket_status_prints_an_aligned_table(&a, db);

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

/// `ticket status db/main` for a person: a header and one row (the
/// sequence of `db`, the holder, one waiter), its columns aligned.
fn ticket_status_prints_an_aligned_table(a: &str, db: u64) {
    let (code, out, err) = ticket(&["status", "db/main", "--admin", a]);
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
}

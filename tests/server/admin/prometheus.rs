//! The metrics as Prometheus reads them: `promtool check metrics` on a
//! scrape, a real Prometheus server scraping the port, the docs' alert rules.

use super::*;

// Long because it is one scenario, step by step.
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

//! The admin port of cluster nodes: status, metrics and readiness following
//! the majority, and the wait and hold histograms.

use super::*;

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
    check_cluster_status_bodies(&c, leader, &bodies);
    // A grant shows on every node, with the same token.
    let l = leader - 1;
    let mut client = c.nodes[l].0.connect();
    let tok = token(&client.acquire_reply("ck", 1, 0, 60));
    every_node_shows_the_grant(&c, tok);
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
    the_leader_metrics_pass_promtool(&c, leader);
    the_cli_shows_the_cluster_status(&c, leader);

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

/// Every node applies the grant of `ck` (token `tok`), held with no
/// expiry shown.
#[cfg(feature = "cluster")]
fn every_node_shows_the_grant(c: &Cluster, tok: u64) {
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
}

/// Each node's `/v1/cluster` body (`bodies`, by node): its id, the three
/// voters with their addresses, no learners, applied within commit, and
/// only the leader (node `leader`, 1-based) sees match and reachability.
#[cfg(feature = "cluster")]
fn check_cluster_status_bodies(c: &Cluster, leader: usize, bodies: &[(u16, String)]) {
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
}

/// The metrics of the leader (node `leader`, 1-based) with one key held:
/// the raft gauges and counters, and promtool finds the scrape valid.
#[cfg(feature = "cluster")]
fn the_leader_metrics_pass_promtool(c: &Cluster, leader: usize) {
    let l = leader - 1;
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
}

/// `ticket cluster status` on the leader (node `leader`, 1-based), for a
/// person and as JSON: the three voters, the leader marked.
#[cfg(feature = "cluster")]
fn the_cli_shows_the_cluster_status(c: &Cluster, leader: usize) {
    let l = leader - 1;
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

    the_follower_counted_the_waits(&c, f);

    the_leader_counted_the_holds(&c, l);
}

/// Only the follower the clients used (node `f`, 0-based) counted
/// waits: the four grants it answered, one after >= 300 ms.
#[cfg(feature = "cluster")]
fn the_follower_counted_the_waits(c: &Cluster, f: usize) {
    let waits = cluster_sample(c, f, "ticketd_wait_seconds_count", |v| v >= 4.0);
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
}

/// Only the leader (node `l`, 0-based) counted holds: four (three
/// releases and an expiry), h1 held >= 300 ms and h3 >= 1 s; at the end
/// nothing is held on any node.
#[cfg(feature = "cluster")]
fn the_leader_counted_the_holds(c: &Cluster, l: usize) {
    let holds = cluster_sample(c, l, "ticketd_hold_seconds_count", |v| v >= 4.0);
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
        let oldest = cluster_sample(c, i, "ticketd_oldest_hold_seconds", |v| v == 0.0);
        assert_eq!(oldest, 0.0, "node {}", i + 1);
    }
}

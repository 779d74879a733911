//! Membership changes on real `ticketd --cluster` processes, driven by the
//! real `ticket cluster add / promote / remove` CLI over the admin port:
//! growing 3 → 5 → 3 under load (the history checker passes, tokens keep
//! rising), removing the leader, a removed node that is restarted and does
//! not disturb the cluster, replacing a node whose data directory was
//! deleted (the runbook in docs/CLUSTER.md), and a stopped learner that is
//! never promoted.
#![cfg(all(feature = "cluster", unix))]

use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ticketd::client::admin::{self, Json};
use ticketd::client::{Acquire, Client};
use ticketd_testkit::checker::{History, RealClock};
use ticketd_testkit::cluster::{acquire_retrying, assert_serves, Cluster};
use ticketd_testkit::netns::{acquire_recorded, release_recorded};
use ticketd_testkit::process::{free_port, ticket_bin, Reply, Ticketd};

/// `n` nodes with admin ports; the first `voters` form the initial
/// cluster (their --peers lists only them), the others start with --join.
struct Members {
    c: Cluster,
    admin: Vec<String>,
    voters: usize,
}

impl Members {
    fn new(name: &str, n: usize, voters: usize) -> Members {
        let mut c = Cluster::new(name, n);
        let admin: Vec<String> = (0..n)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        for (i, a) in admin.iter().enumerate() {
            c.extra[i] = vec!["--admin-listen".into(), a.clone()];
        }
        Members { c, admin, voters }
    }

    fn args(&self, i: usize) -> Vec<String> {
        let mut a = self.c.args(i);
        if i < self.voters {
            let pos = a.iter().position(|x| x == "--peers").unwrap();
            a[pos + 1] = self
                .c
                .peers
                .split(',')
                .take(self.voters)
                .collect::<Vec<_>>()
                .join(",");
        } else {
            a.push("--join".into());
        }
        a
    }

    fn start(&mut self, i: usize) {
        let args = self.args(i);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.c.nodes[i] = Some(Ticketd::start_raw(&[], &args));
    }

    /// `ticket cluster ARGS --admin A...` with every running node's admin port.
    fn ticket(&self, args: &[&str]) -> Output {
        let mut cmd = std::process::Command::new(ticket_bin());
        cmd.arg("cluster").args(args);
        for (i, a) in self.admin.iter().enumerate() {
            if self.c.nodes[i].is_some() {
                cmd.args(["--admin", a]);
            }
        }
        cmd.output().expect("run ticket")
    }

    fn ticket_ok(&self, args: &[&str]) -> String {
        let out = self.ticket(args);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            out.status.success(),
            "ticket cluster {args:?}: {err}\n{}",
            self.c.logs()
        );
        err
    }

    fn status(&self, i: usize) -> Option<Json> {
        let (code, body) =
            admin::get(&self.admin[i], "/v1/cluster", Duration::from_secs(2)).ok()?;
        (code == 200).then(|| Json::parse(&body).ok()).flatten()
    }

    /// The leader's index as a live node reports it, and its term.
    fn leader(&self, timeout: Duration) -> (usize, u64) {
        let deadline = Instant::now() + timeout;
        loop {
            for i in 0..self.admin.len() {
                if self.c.nodes[i].is_none() {
                    continue;
                }
                if let Some(v) = self.status(i) {
                    let id = v.get("id").and_then(Json::as_u64).unwrap_or(0);
                    let leader = v.get("leader").and_then(Json::as_u64).unwrap_or(0);
                    if leader == id && id != 0 && !removed(&v) {
                        return ((id - 1) as usize, num(&v, "term"));
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "no leader within {timeout:?}\n{}",
                self.c.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn ids(&self, i: usize, list: &str) -> Vec<u64> {
        self.status(i).map(|v| ids(&v, list)).unwrap_or_default()
    }

    fn peer(&self, i: usize) -> String {
        format!("{}={}", i + 1, self.c.peer_addr(i))
    }
}

fn num(v: &Json, name: &str) -> u64 {
    v.get(name).and_then(Json::as_u64).unwrap_or(0)
}

fn removed(v: &Json) -> bool {
    matches!(v.get("this_node_removed"), Some(Json::Bool(true)))
}

fn ids(v: &Json, list: &str) -> Vec<u64> {
    v.get(list)
        .map(Json::items)
        .unwrap_or(&[])
        .iter()
        .filter_map(|m| m.get("id").and_then(Json::as_u64))
        .collect()
}

/// Lock cycles on two contended keys through every node, recorded for the
/// history checker, until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    workers: Vec<std::thread::JoinHandle<(History, Vec<u64>)>>,
}

impl Load {
    fn start(clock: RealClock, addrs: &[std::net::SocketAddr], workers: u64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let workers = (0..workers)
            .map(|w| {
                let stop = stop.clone();
                let addrs: Vec<String> = addrs.iter().map(ToString::to_string).collect();
                std::thread::spawn(move || {
                    let client = Client::builder()
                        .addresses(addrs)
                        .pool_size(1)
                        .connect_timeout(Duration::from_millis(500))
                        .build()
                        .expect("client configuration");
                    let mut h = History::new();
                    let mut tokens = Vec::new();
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let key = if (w + n) % 2 == 0 { "k0" } else { "k1" };
                        n += 1;
                        let (r, _) = acquire_recorded(
                            &mut h,
                            clock,
                            w + 1,
                            &client,
                            key,
                            Duration::from_secs(1),
                            Duration::from_secs(3),
                        );
                        match r {
                            Acquire::Acquired(t) => {
                                tokens.push(t.token());
                                release_recorded(&mut h, clock, w + 1, t);
                            }
                            _ => std::thread::sleep(Duration::from_millis(20)),
                        }
                    }
                    (h, tokens)
                })
            })
            .collect();
        Load { stop, workers }
    }

    fn finish(self) -> (History, Vec<Vec<u64>>) {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = History::new();
        let mut tokens = Vec::new();
        for w in self.workers {
            let (h, t) = w.join().expect("load worker");
            all.merge(h);
            tokens.push(t);
        }
        (all, tokens)
    }
}

#[test]
fn grow_three_to_five_and_back_under_load_removing_the_leader() {
    let mut m = Members::new("grow", 5, 3);
    for i in 0..5 {
        m.start(i);
    }
    assert_serves(&m.c, 0, "warm");
    let clock = RealClock::new();
    let addrs: Vec<_> = (0..5).map(|i| m.c.node(i).addr()).collect();
    let load = Load::start(clock, &addrs, 3);
    std::thread::sleep(Duration::from_millis(500));

    let t0 = Instant::now();
    let said = m.ticket_ok(&["add", &m.peer(3)]);
    let add_ms = t0.elapsed().as_millis();
    assert!(
        said.contains("caught up") && said.contains("promoted"),
        "{said}"
    );
    m.ticket_ok(&["add", &m.peer(4)]);
    let (l, _) = m.leader(Duration::from_secs(10));
    assert_eq!(m.ids(l, "voters"), vec![1, 2, 3, 4, 5]);
    assert!(m.ids(l, "learners").is_empty());
    // The new nodes learnt every address from the log or a snapshot.
    knows_every_address(&m, 3);
    // A second add of a member is refused, with a reason.
    let out = m.ticket(&["add", &m.peer(3)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already a member"));

    // Remove the leader: it steps down, another node leads.
    let (old, old_term) = m.leader(Duration::from_secs(10));
    m.ticket_ok(&["remove", &(old + 1).to_string()]);
    let (new, _) = m.leader(Duration::from_secs(15));
    assert_ne!(new, old, "the removed leader still leads\n{}", m.c.logs());
    m.c.assert_all_running();
    removed_node_answers_busy(&m, old);
    // Remove one more (not the new leader): back to three voters.
    let second = (0..5).find(|&i| i != old && i != new).unwrap();
    m.ticket_ok(&["remove", &(second + 1).to_string()]);
    let (l, term) = m.leader(Duration::from_secs(15));
    let mut voters = m.ids(l, "voters");
    voters.sort_unstable();
    assert_eq!(voters.len(), 3, "{voters:?}");
    assert!(!voters.contains(&(old as u64 + 1)) && !voters.contains(&(second as u64 + 1)));
    assert_removed(&m, l, &[old, second]);
    assert!(term >= old_term);
    // A removed id is refused for ever.
    let out = m.ticket(&["add", &m.peer(old)]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("never reused"), "{err}");
    assert_serves(&m.c, l, "after-shrink");

    // A removed node restarted does not disturb the cluster: no new term.
    m.c.kill(second);
    m.start(second);
    std::thread::sleep(Duration::from_secs(3));
    let (l2, term2) = m.leader(Duration::from_secs(5));
    assert_eq!(
        (l2, term2),
        (l, term),
        "the restarted removed node moved the term\n{}",
        m.c.logs()
    );

    let (history, tokens) = load.finish();
    check_the_load(&m, &history, &tokens, add_ms);
    m.c.assert_all_running();
}

/// Node `i`, added later, learnt every voter's address from the log or
/// a snapshot.
fn knows_every_address(m: &Members, i: usize) {
    let v = m.status(i).unwrap();
    let addrs3: Vec<String> = v
        .get("voters")
        .map(Json::items)
        .unwrap_or(&[])
        .iter()
        .filter_map(|x| x.get("address").and_then(Json::as_str).map(str::to_owned))
        .collect();
    assert_eq!(addrs3.len(), 5, "{v:?}");
}

/// The removed leader (node `old`) applied its removal: its clients get B.
fn removed_node_answers_busy(m: &Members, old: usize) {
    let mut cl = m.c.client(old);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match cl.acquire_reply("after-removal", 9, 0, 5) {
            Reply::Busy { .. } => break,
            other => assert!(
                Instant::now() < deadline,
                "a removed node answered {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The leader's (node `l`) status lists the removed nodes (`nodes`,
/// 0-based) as a JSON array of their ids.
fn assert_removed(m: &Members, l: usize, nodes: &[usize]) {
    let status = m.status(l).expect("the leader's status");
    let mut removed: Vec<u64> = status
        .get("removed")
        .map(Json::items)
        .unwrap_or(&[])
        .iter()
        .filter_map(Json::as_u64)
        .collect();
    removed.sort_unstable();
    let mut want: Vec<u64> = nodes.iter().map(|&i| i as u64 + 1).collect();
    want.sort_unstable();
    assert_eq!(removed, want, "{status:?}");
}

/// What the load saw while the cluster grew and shrank: a history that
/// passes the checker, each worker's tokens rising, some lock cycles.
fn check_the_load(m: &Members, history: &History, tokens: &[Vec<u64>], add_ms: u128) {
    match history.check() {
        Ok(report) => println!("grow: history checker passed: {report}"),
        Err(v) => panic!("history checker FAILED: {v}\n{}", m.c.logs()),
    }
    for t in tokens {
        assert!(
            t.windows(2).all(|w| w[0] < w[1]),
            "tokens of one worker fell: {t:?}"
        );
    }
    let cycles: usize = tokens.iter().map(Vec::len).sum();
    println!("grow: first add (catch-up and promote) took {add_ms} ms; {cycles} lock cycles");
    assert!(cycles > 0);
}

#[test]
fn replace_a_node_whose_data_dir_was_deleted() {
    // The runbook of docs/CLUSTER.md: node 3's disk died.
    let mut m = Members::new("replace", 4, 3);
    for i in 0..3 {
        m.start(i);
    }
    assert_serves(&m.c, 0, "before");
    m.c.kill(2);
    std::fs::remove_dir_all(&m.c.dirs[2].0).unwrap();
    // Node 4 joins with an empty data dir; it grants nothing until added.
    m.start(3);
    let mut c4 = m.c.client(3);
    assert!(matches!(
        c4.acquire_reply("early", 1, 0, 5),
        Reply::Busy { .. }
    ));
    m.ticket_ok(&["add", &m.peer(3)]);
    // Node 3 is dead: removing it leaves 3 of 4 voters reachable.
    m.ticket_ok(&["remove", "3"]);
    let (l, _) = m.leader(Duration::from_secs(10));
    let mut voters = m.ids(l, "voters");
    voters.sort_unstable();
    assert_eq!(voters, vec![1, 2, 4]);
    match acquire_retrying(&mut c4, "after", 2, 5) {
        Some(Reply::Acquired { .. }) => {}
        other => panic!("node 4 does not grant: {other:?}\n{}", m.c.logs()),
    }
    // With node 1 down too, removing node 2 would leave 1 of 3 reachable.
    m.c.kill(0);
    std::thread::sleep(Duration::from_secs(2));
    let out = m.ticket(&["remove", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && (err.contains("--force") || err.contains("leader")),
        "{err}\n{}",
        m.c.logs()
    );
}

#[test]
fn a_stopped_learner_is_never_promoted_and_add_says_why() {
    let mut m = Members::new("stopped", 4, 3);
    for i in 0..4 {
        m.start(i);
    }
    assert_serves(&m.c, 0, "warm");
    m.c.node(3).signal(libc::SIGSTOP);
    let out = m.ticket(&["add", &m.peer(3), "--catch-up-timeout", "3"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    m.c.node(3).signal(libc::SIGCONT);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("did not catch up") && err.contains("stays a learner"),
        "{err}"
    );
    let (l, _) = m.leader(Duration::from_secs(10));
    assert_eq!(m.ids(l, "learners"), vec![4]);
    assert!(!m.ids(l, "voters").contains(&4));
    // Running again, it catches up and can be promoted.
    m.ticket_ok(&["promote", "4"]);
    let (l, _) = m.leader(Duration::from_secs(10));
    assert!(m.ids(l, "voters").contains(&4));
}

//! Cluster mode with real processes on loopback: three `ticketd --cluster`
//! nodes, clients on any node, a leader killed with SIGKILL under load, a
//! lease ended by a committed Expire, a restarted node catching up, a
//! minority down (the majority serves) and a majority down (no grant), and
//! lease renewal: a grant extended past its first lease through a follower
//! and the leader, ended late (never early) by a new leader, and a node
//! without a quorum that never answers an Extend with X.
#![cfg(feature = "cluster")]

use ticketd_testkit::process as common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{free_port, run_ticketd, Client, NoReply, Reply, Ticketd};
use ticketd_testkit::cluster::{self, Cluster, Dir};

/// Acquires (no wait) with retries while the cluster answers Busy: the
/// reply, which must come.
fn acquire(c: &mut Client, key: &str, owner: u64, lease_s: u8) -> Reply {
    cluster::acquire_retrying(c, key, owner, lease_s)
        .unwrap_or_else(|| panic!("no reply to acquire {key}, or Busy for 20 s"))
}

#[test]
fn clients_on_any_node_and_a_lease_ends_by_committed_expire() {
    let cluster = Cluster::start("basic", 3);
    cluster.wait_all_know_leader();
    let mut a = cluster.client(0);
    let mut b = cluster.client(1);
    let mut c = cluster.client(2);
    // A grant on node 1, seen as held from node 2, released from node 3.
    let t1 = acquire(&mut a, "db", 1, 30).token();
    assert!(matches!(
        acquire(&mut b, "db", 2, 30),
        Reply::Timeout { owner: 2, .. }
    ));
    assert_eq!(
        c.release_reply("db", t1),
        Reply::Released {
            token: t1,
            key: "db".into()
        }
    );
    // A 1 s lease nobody releases: a waiter on another node gets the key
    // when the leader's committed Expire ends it, with a higher token.
    let t2 = acquire(&mut a, "lease", 3, 1).token();
    let start = Instant::now();
    b.acquire("lease", 4, 10, 5);
    let r = b.recv_timeout(Duration::from_secs(12));
    let t3 = r.token();
    assert!(t3 > t2 && t2 > t1, "{t1} {t2} {t3}");
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(900),
        "granted before the lease ran out: {waited:?}"
    );
    // The old holder's release is refused: its grant ended.
    assert!(matches!(
        a.release_reply("lease", t2),
        Reply::NotReleased { .. }
    ));
}

trait RecvTimeout {
    fn recv_timeout(&mut self, t: Duration) -> Reply;
}

impl RecvTimeout for Client {
    fn recv_timeout(&mut self, t: Duration) -> Reply {
        match self.try_recv(t) {
            Ok(r) => r,
            Err(e) => panic!("no reply: {e:?}"),
        }
    }
}

#[test]
fn leader_killed_under_load_loses_no_grant() {
    let mut cluster = Cluster::start("failover", 3);
    cluster.wait_all_know_leader();
    let leader = cluster.wait_leader();
    let followers: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    let addrs: Vec<_> = followers.iter().map(|&i| cluster.node(i).addr()).collect();

    // Workers on the followers: acquire, check nobody else is inside, hold
    // briefly, release (which must be R: the grant was committed).
    let stop = Arc::new(AtomicBool::new(false));
    let grants = Arc::new(AtomicU64::new(0));
    let inside: Arc<Vec<AtomicBool>> = Arc::new((0..3).map(|_| AtomicBool::new(false)).collect());
    let tokens: Arc<Mutex<BTreeMap<usize, Vec<u64>>>> = Arc::default();
    let mut handles = Vec::new();
    for w in 0..6usize {
        let addr = addrs[w % addrs.len()];
        let (stop, grants, inside, tokens) = (
            Arc::clone(&stop),
            Arc::clone(&grants),
            Arc::clone(&inside),
            Arc::clone(&tokens),
        );
        handles.push(std::thread::spawn(move || -> Result<(), String> {
            failover_worker(w, addr, &stop, &grants, &inside, &tokens)
        }));
    }
    let wait_grants = |n: u64| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while grants.load(Ordering::SeqCst) < n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        grants.load(Ordering::SeqCst) >= n
    };
    assert!(
        wait_grants(30),
        "no load before the kill:\n{}",
        cluster.logs()
    );
    let before = grants.load(Ordering::SeqCst);
    cluster.kill(leader);
    assert!(
        wait_grants(before + 30),
        "the survivors did not go on granting:\n{}",
        cluster.logs()
    );
    stop.store(true, Ordering::SeqCst);
    for h in handles {
        if let Err(e) = h.join().unwrap() {
            panic!("{e}\n{}", cluster.logs());
        }
    }
    let all = tokens.lock().unwrap();
    tokens_rise_and_carry_random_bits(&all);
}

/// Worker `w` of the failover load on the node at `addr`, until `stop`:
/// acquire, check nobody else is `inside`, record the token and count the
/// grant, hold briefly, release (which must be R: the grant was
/// committed).
fn failover_worker(
    w: usize,
    addr: std::net::SocketAddr,
    stop: &AtomicBool,
    grants: &AtomicU64,
    inside: &[AtomicBool],
    tokens: &Mutex<BTreeMap<usize, Vec<u64>>>,
) -> Result<(), String> {
    let mut c = Client::connect(addr);
    let mut owner = (w as u64) << 32;
    while !stop.load(Ordering::SeqCst) {
        let k = owner as usize % 3;
        let key = format!("k{k}");
        owner += 1;
        c.acquire(&key, owner, 5, 30);
        let r = match c.try_recv(Duration::from_secs(20)) {
            Ok(r) => r,
            Err(NoReply::TimedOut) => return Err(format!("worker {w}: no answer")),
            Err(e) => return Err(format!("worker {w}: {e:?}")),
        };
        let token = match r {
            Reply::Acquired { token, .. } => token,
            Reply::Busy { .. } | Reply::Timeout { .. } => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            other => return Err(format!("worker {w}: {other:?}")),
        };
        if inside[k].swap(true, Ordering::SeqCst) {
            return Err(format!("two holders of {key}"));
        }
        tokens.lock().unwrap().entry(k).or_default().push(token);
        grants.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(5));
        inside[k].store(false, Ordering::SeqCst);
        c.release(&key, token);
        match c.try_recv(Duration::from_secs(20)) {
            Ok(Reply::Released { .. }) => {}
            other => return Err(format!("worker {w}: release of {token}: {other:?}")),
        }
    }
    Ok(())
}

/// Each key's tokens (`all`, by key number) rise, and carry the
/// proposer's random low bits.
fn tokens_rise_and_carry_random_bits(all: &BTreeMap<usize, Vec<u64>>) {
    for (k, ts) in all.iter() {
        assert!(
            ts.windows(2).all(|w| w[0] < w[1]),
            "tokens of k{k} do not increase: {ts:?}"
        );
    }
    // Every token carries the proposer's random low bits: among this many
    // grants, 16-bit draws repeat rarely (and never all come out equal).
    let low: std::collections::BTreeSet<u64> = all
        .values()
        .flatten()
        .map(|t| t & ticketd::token::RANDOM_MASK)
        .collect();
    let n = all.values().map(Vec::len).sum::<usize>();
    assert!(
        n >= 30 && low.len() * 10 >= n * 9,
        "{} distinct low bits in {n} tokens",
        low.len()
    );
}

#[test]
fn a_restarted_node_catches_up_and_a_minority_down_does_not_stop_the_rest() {
    let mut cluster = Cluster::start("restart", 3);
    let t0 = acquire(&mut cluster.client(0), "held", 1, 60).token();
    cluster.kill(2);
    // Minority down: the other two still grant and release.
    let mut a = cluster.client(0);
    let mut last = t0;
    for i in 0..20u64 {
        let t = acquire(&mut a, "busy", 100 + i, 30).token();
        assert!(t > last);
        last = t;
        assert!(matches!(a.release_reply("busy", t), Reply::Released { .. }));
    }
    // Node 3 comes back from its data dir and answers from the caught-up
    // table: "held" is still held, and its own grants carry higher tokens.
    cluster.start_node(2);
    let mut c = cluster.client(2);
    assert!(matches!(
        acquire(&mut c, "held", 2, 30),
        Reply::Timeout { .. }
    ));
    let t = acquire(&mut c, "fresh", 3, 30).token();
    assert!(t > last, "{t} after {last}");
}

#[test]
fn a_majority_down_grants_nothing() {
    let mut cluster = Cluster::start("majority", 3);
    let _ = acquire(&mut cluster.client(0), "warmup", 1, 1);
    cluster.kill(1);
    cluster.kill(2);
    let mut a = cluster.client(0);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut owner = 10;
    while Instant::now() < deadline {
        owner += 1;
        a.acquire(&format!("m{owner}"), owner, 1, 30);
        match a.try_recv(Duration::from_secs(3)) {
            Ok(Reply::Acquired { .. }) => panic!("granted without a majority"),
            Ok(Reply::Busy { .. }) | Err(NoReply::TimedOut) => {}
            Ok(other) => panic!("unexpected {other:?}"),
            Err(e) => panic!("{e:?}"),
        }
    }
}

#[test]
fn wiped_data_dir_and_wrong_voters_are_refused() {
    let mut cluster = Cluster::start("wipe", 3);
    let _ = acquire(&mut cluster.client(0), "warmup", 1, 1);
    // Every node has seen every other by now.
    std::thread::sleep(Duration::from_millis(500));
    cluster.kill(2);
    // Another voter set on an existing data dir: refused at start.
    let mut args = cluster.args(2);
    let pos = args.iter().position(|a| a == "--peers").unwrap();
    args[pos + 1] = cluster.peers.rsplit_once(',').unwrap().0.to_owned() + ",4=127.0.0.1:1";
    args[2] = "4".into();
    let out = run_ticketd(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("voters"), "{err}");
    // A wiped data dir under the old id: the peers know better and refuse
    // it. Over plaintext no peer's word stops a node (docs/SECURITY.md;
    // with peer TLS it stops), so it runs on, alone, granting nothing.
    std::fs::remove_dir_all(&cluster.dirs[2].0).unwrap();
    cluster.start_node(2);
    let node = cluster.nodes[2].as_ref().unwrap();
    assert!(
        node.wait_for_log("with another data directory", Duration::from_secs(15)),
        "{}",
        node.log()
    );
    assert!(
        cluster
            .node(0)
            .wait_for_log("refusing it", Duration::from_secs(15)),
        "{}",
        cluster.node(0).log()
    );
    let mut c = cluster.client(2);
    c.acquire("wiped", 9, 0, 5);
    assert!(
        matches!(
            c.try_recv(Duration::from_secs(3)),
            Ok(Reply::Busy { .. }) | Err(_)
        ),
        "the wiped node granted alone"
    );
    let _ = acquire(&mut cluster.client(0), "after-wipe", 1, 1);
}

#[test]
fn garbage_on_the_peer_port_changes_nothing() {
    let cluster = Cluster::start("garbage", 3);
    let mut a = cluster.client(0);
    let t1 = acquire(&mut a, "g", 1, 30).token();
    let peer1: std::net::SocketAddr = cluster.peers.split(',').next().unwrap()[2..]
        .parse()
        .unwrap();
    let hello_of_another_cluster = {
        let mut h = Vec::new();
        h.extend_from_slice(&53u32.to_be_bytes());
        h.extend_from_slice(b"TKTD\x01");
        for v in [1u64, 2, 2, 9, 1, 0] {
            h.extend_from_slice(&v.to_be_bytes());
        }
        h
    };
    let attempts: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.0\r\n\r\n".to_vec(),
        vec![0xff; 64],
        u32::MAX.to_be_bytes().to_vec(),
        hello_of_another_cluster,
        vec![0, 0, 0, 53],
    ];
    for bytes in attempts {
        let mut s = std::net::TcpStream::connect(peer1).unwrap();
        use std::io::{Read, Write};
        s.write_all(&bytes).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut b = [0u8; 16];
        // Closed by the node (EOF or reset), or left waiting for more of
        // an incomplete hello; never a crash.
        let _ = s.read(&mut b);
    }
    // The node is still up and the cluster still serves.
    let mut b = cluster.client(1);
    assert!(matches!(acquire(&mut b, "g", 2, 30), Reply::Timeout { .. }));
    assert!(matches!(a.release_reply("g", t1), Reply::Released { .. }));
    assert!(cluster.node(0).log().contains("peer connection from"));
}

#[test]
fn the_peer_frame_limit_follows_the_lock_table_limits() {
    // (extra flags, what the start-up log must say)
    let cases: [(&[&str], &str); 3] = [
        (&[], "peer frames up to 1100 MiB"),
        (
            &["--max-keys", "1000", "--max-key-bytes", "64"],
            "peer frames up to 69 MiB",
        ),
        // Over what the u32 frame length carries: capped, and said so.
        (&["--max-keys", "5000000"], "peer frame can carry"),
    ];
    for (i, (extra, expect)) in cases.into_iter().enumerate() {
        let dir =
            Dir(std::env::temp_dir()
                .join(format!("ticketd-cluster-frames-{}-{i}", std::process::id())));
        let _ = std::fs::remove_dir_all(&dir.0);
        let peers = format!(
            "1=127.0.0.1:{},2=127.0.0.1:{},3=127.0.0.1:{}",
            free_port(),
            free_port(),
            free_port()
        );
        let data_dir = dir.0.display().to_string();
        let mut args = vec!["--cluster", "--id", "1", "--peers", &peers];
        args.extend(["--data-dir", &data_dir, "--listen", "127.0.0.1:0"]);
        args.extend(extra);
        let node = Ticketd::start_raw(&[], &args);
        assert!(
            node.wait_for_log(expect, Duration::from_secs(10)),
            "{extra:?}: no {expect:?} in:\n{}",
            node.log()
        );
    }
}

/// Probes `key` with wait-0 acquires from `c` every 100 ms until one is
/// granted, and returns when that answer arrived. Every probe answered
/// before `held_until` must be `T` (the extended grant still holds); a
/// grant must come within `within` of `held_until`. `B` (no leader yet)
/// and silence (a node between leaders) are retried.
fn probe_until_granted(
    c: &mut Client,
    key: &str,
    owner: u64,
    held_until: Instant,
    within: Duration,
    logs: &dyn Fn() -> String,
) -> (Instant, u64) {
    let give_up = held_until + within;
    let mut timeouts = 0;
    loop {
        assert!(
            Instant::now() < give_up,
            "{key}: not granted within {within:?} of the lease end ({timeouts} T):\n{}",
            logs()
        );
        c.acquire(key, owner, 0, 3);
        match c.try_recv(Duration::from_secs(10)) {
            Ok(Reply::Timeout { .. }) => timeouts += 1,
            Ok(Reply::Busy { .. }) | Err(NoReply::TimedOut) => {}
            Ok(Reply::Acquired { token, .. }) => {
                let at = Instant::now();
                assert!(
                    at >= held_until,
                    "{key}: granted {:?} before the extended lease ended:\n{}",
                    held_until - at,
                    logs()
                );
                return (at, token);
            }
            other => panic!("{key}: probe got {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Extends `token` of `key` on `c` as the client library does (PROTOCOL
/// §5.3): an attempt without an answer in 2 s (a node that knows no leader
/// leaves an Extend unanswered) is sent again on a new connection to the
/// same node, until `within` has passed. Returns when the answered attempt
/// was written, and its answer.
fn extend_once(c: &mut Client, key: &str, token: u64, lease_s: u8) -> (Instant, Reply) {
    extend_within(
        c,
        key,
        token,
        lease_s,
        Duration::from_secs(u64::from(lease_s)),
    )
}

fn extend_within(
    c: &mut Client,
    key: &str,
    token: u64,
    lease_s: u8,
    within: Duration,
) -> (Instant, Reply) {
    let addr = c.stream.peer_addr().expect("connected");
    let give_up = Instant::now() + within;
    loop {
        let sent = Instant::now();
        c.extend(key, token, lease_s);
        let left = give_up.saturating_duration_since(sent);
        match c.try_recv(left.min(Duration::from_secs(2))) {
            Ok(r) => return (sent, r),
            Err(e) if Instant::now() >= give_up => {
                panic!("no answer to the extend of {key}/{token} in {within:?}: {e:?}")
            }
            Err(_) => *c = Client::connect(addr),
        }
    }
}

#[test]
fn an_extended_lease_outlives_its_first_and_a_leader_change_ends_it_late_never_early() {
    let mut cluster = Cluster::start("extend", 3);
    cluster.wait_all_know_leader();
    let leader = cluster.wait_leader();
    let f = (leader + 1) % 3;
    let other = (leader + 2) % 3;
    let mut holder = cluster.client(f);
    let mut via_leader = cluster.client(leader);
    let mut rival = cluster.client(other);
    let logs = || cluster.logs();

    extends_keep_the_grant_past_its_first_lease(&mut holder, &mut via_leader, &mut rival, &logs);

    // 2. A 3 s grant extended through the leader to 6 s; the leader is
    //    killed right after its E. The new leader ends the grant no
    //    earlier than 6 s after that extend was written (it rebuilds the
    //    deadline with the full latest lease: late, never early).
    let t3 = acquire(&mut holder, "fail", 40, 3).token();
    let (at, r) = extend_once(&mut via_leader, "fail", t3, 6);
    assert_eq!(
        r,
        Reply::Extended {
            token: t3,
            key: "fail".into()
        }
    );
    let latest_end = at + Duration::from_secs(6);
    cluster.kill(leader);
    let logs = || cluster.logs();
    let (granted_at, t4) = probe_until_granted(
        &mut rival,
        "fail",
        50,
        latest_end,
        Duration::from_secs(15),
        &logs,
    );
    assert!(t4 > t3, "{t4} after {t3}");
    assert!(granted_at >= latest_end);

    a_node_without_a_quorum_never_answers_x(&mut cluster, leader);
}

/// Phase 1 of the extend test: a 3 s grant extended every second,
/// alternately through the follower it was granted on (`holder`) and
/// through the leader (`via_leader`), until well past its first lease; a
/// `rival`'s wait-0 acquire gets T throughout, and the key only once the
/// extends stop and the last extended lease ends.
fn extends_keep_the_grant_past_its_first_lease(
    holder: &mut Client,
    via_leader: &mut Client,
    rival: &mut Client,
    logs: &dyn Fn() -> String,
) {
    // 1. A 3 s grant extended every second, alternately through the
    //    follower it was granted on and through the leader, until well
    //    past its first lease; a rival's wait-0 acquire gets T throughout.
    let sent = Instant::now();
    let t = acquire(holder, "job", 10, 3).token();
    let first_end = sent + Duration::from_secs(3);
    let mut held_until = first_end;
    for round in 0..6 {
        std::thread::sleep(Duration::from_millis(1000));
        let c = if round % 2 == 0 {
            &mut *holder
        } else {
            &mut *via_leader
        };
        let (at, r) = extend_once(c, "job", t, 3);
        assert_eq!(
            r,
            Reply::Extended {
                token: t,
                key: "job".into()
            },
            "round {round}"
        );
        assert!(Instant::now() < held_until, "E after the expiry");
        held_until = at + Duration::from_secs(3);
        let probe_at = Instant::now();
        let r = rival.acquire_reply("job", 20 + round, 0, 3);
        assert!(
            matches!(r, Reply::Timeout { .. }),
            "round {round}: {r:?} while held ({:?} past the first lease)",
            probe_at.saturating_duration_since(first_end)
        );
    }
    assert!(
        Instant::now() > first_end + Duration::from_secs(2),
        "the extends did not take the grant past its first lease"
    );
    // A wrong token is refused with X, through either node, and changes
    // nothing.
    for c in [&mut *holder, &mut *via_leader] {
        let (_, r) = extend_once(c, "job", t + 1000, 3);
        assert_eq!(
            r,
            Reply::NotExtended {
                token: t + 1000,
                key: "job".into()
            }
        );
    }
    // No more extends: the rival gets T until the last extended lease
    // ends, then the key, with a higher token; the old grant is gone.
    let (_, t2) = probe_until_granted(rival, "job", 30, held_until, Duration::from_secs(5), logs);
    assert!(t2 > t, "{t2} after {t}");
    let (_, r) = extend_once(holder, "job", t, 3);
    assert!(
        matches!(r, Reply::NotExtended { token, .. } if token == t),
        "{r:?}"
    );
}

/// Phase 3 of the extend test (the old leader, node `leader`, is down):
/// a node without a quorum never answers an Extend with X, even for a
/// token it has never heard of: it cannot know the grant is gone. Once a
/// quorum is back, the live grant's extend is E or nothing.
fn a_node_without_a_quorum_never_answers_x(cluster: &mut Cluster, leader: usize) {
    // 3. A node without a quorum never answers an Extend with X, even for
    //    a token it has never heard of: it cannot know the grant is gone.
    //    Once a quorum is back, the live grant's extend is E or nothing.
    let new_leader = cluster.wait_leader();
    let lone = (0..3)
        .find(|&i| i != leader && i != new_leader)
        .expect("a third node");
    let mut on_lone = cluster.client(lone);
    let t5 = acquire(&mut on_lone, "solo", 60, 30).token();
    cluster.kill(new_leader);
    on_lone.extend("solo", t5, 30);
    on_lone.extend("solo", t5 + 1000, 30);
    for _ in 0..2 {
        match on_lone.try_recv(Duration::from_secs(3)) {
            Err(NoReply::TimedOut) => {}
            other => panic!("a node without a quorum answered an extend: {other:?}"),
        }
    }
    cluster.start_node(leader);
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        match on_lone.try_recv(Duration::from_millis(500)) {
            Err(NoReply::TimedOut) => {}
            Ok(Reply::Extended { token, .. }) if token == t5 => {}
            // The unknown token: X is right once a leader decides it.
            Ok(Reply::NotExtended { token, .. }) if token == t5 + 1000 => {}
            other => panic!(
                "extend of the live grant answered {other:?}:\n{}",
                cluster.logs()
            ),
        }
    }
    // The grant is still held: the quorum serves it, and only its holder.
    let (_, r) = extend_within(&mut on_lone, "solo", t5, 30, Duration::from_secs(20));
    assert_eq!(
        r,
        Reply::Extended {
            token: t5,
            key: "solo".into()
        },
        "{}",
        cluster.logs()
    );
}

/// Each node's first line is the start-up line (with its admin port);
/// raft's routine messages (votes, campaigns, becoming follower) are at
/// debug, and the node says whom it follows, or that it became leader,
/// in its own words.
#[test]
fn the_startup_line_comes_first_and_raft_chatter_is_debug() {
    let mut cluster = Cluster::new("startline", 3);
    for extra in &mut cluster.extra {
        extra.extend(["--admin-listen".to_string(), "127.0.0.1:0".to_string()]);
    }
    cluster.start_all();
    cluster.wait_all_know_leader();
    let leader = cluster.wait_leader();
    for i in 0..3 {
        let log = cluster.node(i).log();
        let first = log.lines().next().unwrap_or_default();
        assert!(
            first.contains("listening on")
                && first.contains(&format!("cluster node {}", i + 1))
                && first.contains("admin port (HTTP) on "),
            "node {}'s first line is not the start-up line:\n{log}",
            i + 1
        );
        let chatter: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("[raft]") && !l.contains(" WARN ") && !l.contains(" ERROR "))
            .collect();
        assert!(chatter.is_empty(), "raft's chatter at info:\n{log}");
        let own = if i == leader {
            "became leader at term ".to_string()
        } else {
            format!("leader is node {}", leader + 1)
        };
        assert!(log.contains(&own), "node {} logs {own:?}:\n{log}", i + 1);
    }
}

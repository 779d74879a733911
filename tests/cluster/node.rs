//! One cluster node over a real data directory: it elects itself (a
//! one-voter cluster), answers after commit, survives restarts with its
//! table and fencing tokens intact, compacts its log, and refuses a data
//! directory that belongs to another node.
#![cfg(feature = "cluster")]

use std::path::PathBuf;

use ticketd::cluster::log::FileDisk;
use ticketd::cluster::node::{quiet_logger, Node, NodeConfig, NodeError};
use ticketd::engine::Outbox;
use ticketd::proto::Request;
use ticketd::time::Millis;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("ticketd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn open(dir: &TempDir, voters: Vec<u64>, snapshot_every: u64) -> Result<Node<FileDisk>, NodeError> {
    let mut cfg = NodeConfig::new(1, voters);
    cfg.snapshot_every = snapshot_every;
    Node::open(cfg, FileDisk::open(&dir.0).unwrap(), &quiet_logger())
}

/// Runs the node until it leads and has applied its term's first entry.
fn settle(node: &mut Node<FileDisk>, now: &mut Millis) {
    let mut out = Outbox::new();
    for _ in 0..100 {
        *now = now.add_ms(100);
        node.tick(*now, &mut out);
        node.end_turn(*now, &mut out).unwrap();
        if node.is_leader() && node.timers_ready() {
            return;
        }
    }
    panic!("a one-voter node did not become leader");
}

/// Sends one request and runs turns until it is answered.
fn ask(node: &mut Node<FileDisk>, now: &mut Millis, req: Request<'_>) -> String {
    let mut out = Outbox::new();
    node.request(*now, 9, req, &mut out);
    for _ in 0..50 {
        if let Some(a) = out.iter().next() {
            return format!("{:?}", a.reply);
        }
        node.end_turn(*now, &mut out).unwrap();
        *now = now.add_ms(10);
        node.tick(*now, &mut out);
    }
    panic!("no answer");
}

fn token_of(reply: &str) -> u64 {
    let rest = reply.split("token: ").nth(1).expect("a token");
    rest.split(',').next().unwrap().parse().unwrap()
}

#[test]
fn restart_keeps_grants_and_tokens_keep_rising() {
    let dir = TempDir::new("node-restart");
    let mut now = Millis(0);
    let mut node = open(&dir, vec![1], 1000).unwrap();
    settle(&mut node, &mut now);
    let a = ask(
        &mut node,
        &mut now,
        Request::Acquire {
            wait_s: 0,
            lease_s: 60,
            owner: 1,
            key: "db",
        },
    );
    assert!(a.starts_with("Acquired"), "{a}");
    let t1 = token_of(&a);
    let epoch = node.epoch();
    drop(node);

    let mut node = open(&dir, vec![1], 1000).unwrap();
    assert_eq!(node.epoch(), epoch + 1, "the boot epoch rises");
    settle(&mut node, &mut now);
    assert_eq!(
        node.state_machine().holder("db"),
        Some(t1),
        "the grant survived"
    );
    let t = ask(
        &mut node,
        &mut now,
        Request::Acquire {
            wait_s: 0,
            lease_s: 60,
            owner: 2,
            key: "db",
        },
    );
    assert!(t.starts_with("Timeout"), "still held: {t}");
    let r = ask(
        &mut node,
        &mut now,
        Request::Release {
            token: t1,
            key: "db",
        },
    );
    assert!(r.starts_with("Released"), "{r}");
    let a2 = ask(
        &mut node,
        &mut now,
        Request::Acquire {
            wait_s: 0,
            lease_s: 60,
            owner: 3,
            key: "db",
        },
    );
    assert!(token_of(&a2) > t1, "{a2} after {t1}");
}

#[test]
fn compaction_snapshots_and_recovers_from_the_snapshot() {
    let dir = TempDir::new("node-compact");
    let mut now = Millis(0);
    let mut node = open(&dir, vec![1], 10).unwrap();
    settle(&mut node, &mut now);
    let mut last = 0;
    for i in 0..40u64 {
        let key = format!("k{}", i % 5);
        let a = ask(
            &mut node,
            &mut now,
            Request::Acquire {
                wait_s: 0,
                lease_s: 60,
                owner: i,
                key: &key,
            },
        );
        if a.starts_with("Acquired") {
            let t = token_of(&a);
            assert!(t > last);
            last = t;
            let r = ask(
                &mut node,
                &mut now,
                Request::Release {
                    token: t,
                    key: &key,
                },
            );
            assert!(r.starts_with("Released"), "{r}");
        }
    }
    let held = ask(
        &mut node,
        &mut now,
        Request::Acquire {
            wait_s: 0,
            lease_s: 60,
            owner: 99,
            key: "kept",
        },
    );
    let kept = token_of(&held);
    assert!(node.stats().snapshots_taken > 0, "no snapshot taken");
    let snap = node.snapshot_index();
    assert!(snap > 0);
    let wal = node.wal_bytes();
    drop(node);
    let mut node = open(&dir, vec![1], 10).unwrap();
    assert_eq!(node.snapshot_index(), snap);
    assert!(node.wal_bytes() <= wal + 64);
    settle(&mut node, &mut now);
    assert_eq!(node.state_machine().holder("kept"), Some(kept));
    node.state_machine().check();
}

#[test]
fn a_full_backlog_is_answered_busy_at_once() {
    let dir = TempDir::new("node-backlog");
    let mut now = Millis(0);
    let mut cfg = NodeConfig::new(1, vec![1]);
    cfg.max_pending = 3;
    let mut node = Node::open(cfg, FileDisk::open(&dir.0).unwrap(), &quiet_logger()).unwrap();
    settle(&mut node, &mut now);
    let mut out = Outbox::new();
    for owner in 0..5 {
        let key = format!("k{owner}");
        node.request(
            now,
            9,
            Request::Acquire {
                wait_s: 0,
                lease_s: 5,
                owner,
                key: &key,
            },
            &mut out,
        );
    }
    // Three proposed (answered after commit), two refused now.
    let now_answers: Vec<String> = out.iter().map(|a| format!("{:?}", a.reply)).collect();
    assert_eq!(now_answers.len(), 2, "{now_answers:?}");
    assert!(
        now_answers.iter().all(|r| r.starts_with("Busy")),
        "{now_answers:?}"
    );
    out.clear();
    node.end_turn(now, &mut out).unwrap();
    node.tick(now, &mut out);
    node.end_turn(now, &mut out).unwrap();
    let later: Vec<String> = out.iter().map(|a| format!("{:?}", a.reply)).collect();
    assert_eq!(later.len(), 3, "{later:?}");
    assert!(later.iter().all(|r| r.starts_with("Acquired")), "{later:?}");
    assert_eq!(node.stats().refused, 2);
}

#[test]
fn the_recorded_configuration_wins_and_another_nodes_data_dir_is_refused() {
    let dir = TempDir::new("node-voters");
    drop(open(&dir, vec![1], 1000).unwrap());
    // Other --peers on a later start: the recorded voters are kept.
    let mut node = open(&dir, vec![1, 2, 3], 1000).unwrap();
    let ids: Vec<u64> = node.members().iter().map(|m| m.id).collect();
    assert_eq!(ids, vec![1]);
    let mut now = Millis::ZERO;
    settle(&mut node, &mut now);
    drop(node);
    // Node 2 on node 1's data directory: not in its configuration.
    let mut cfg = NodeConfig::new(2, vec![1, 2]);
    cfg.snapshot_every = 1000;
    match Node::open(cfg, FileDisk::open(&dir.0).unwrap(), &quiet_logger()) {
        Err(NodeError::VoterMismatch { stored, given }) => {
            assert_eq!(stored, vec![1]);
            assert_eq!(given, vec![2]);
        }
        other => panic!("expected a voter mismatch, got {other:?}"),
    }
}

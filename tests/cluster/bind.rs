//! Grants bound to authenticated identities in cluster mode, with real
//! processes: three nodes, each also on a Unix socket (the peer's uid is
//! the identity). A grant taken by uid 65534 on one node is refused to
//! root on another, whatever the token, before and after the leader that
//! granted it is killed; its holder releases it.
#![cfg(feature = "cluster")]

use ticketd_testkit::process as common;

use common::{socket_dir, ticket_as};

use ticketd_testkit::cluster::Cluster;

/// `ticket acquire KEY` as `uid` on `server`: the token.
fn acquire_as(uid: u32, key: &str, server: &str) -> u64 {
    let out = ticket_as(uid, &["acquire", key, "--lease", "60", "--server", server]);
    assert!(out.status.success(), "uid {uid} acquire {key}: {out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Root releases and extends `key` with the right token on `server`: both
/// "not held" (123). Root first takes and releases a key of its own
/// there, so the refusal is the binding's, not a node without a leader.
fn root_is_refused(key: &str, token: u64, server: &str) {
    let own = acquire_as(0, "root-own", server);
    let out = ticket_as(
        0,
        &["release", "root-own", &own.to_string(), "--server", server],
    );
    assert!(out.status.success(), "root's own release: {out:?}");
    let t = token.to_string();
    for op in ["release", "extend"] {
        let out = ticket_as(0, &[op, key, &t, "--server", server]);
        assert_eq!(
            out.status.code(),
            Some(123),
            "root {op} on {server}: {out:?}"
        );
    }
}

#[test]
fn a_grant_of_an_authenticated_identity_stays_bound_across_nodes_and_failover() {
    // setpriv needs root to switch uid; CI runs the tests as root.
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test runs as root (it runs clients under other uids)"
    );
    let dir = socket_dir("cluster-bound");
    let socks: Vec<String> = (1..=3)
        .map(|i| format!("unix:{}", dir.join(format!("n{i}.sock")).display()))
        .collect();
    let mut c = Cluster::new("bound", 3);
    for (i, sock) in socks.iter().enumerate() {
        c.extra[i] = vec![
            "--listen".into(),
            sock.clone(),
            "--socket-mode".into(),
            "0666".into(),
        ];
    }
    c.start_all();
    let leader = c.wait_leader();
    c.wait_all_know_leader();
    // uid 65534 takes "k" through the leader.
    let nobody = 65534;
    let token = acquire_as(nobody, "k", &socks[leader]);
    // Root, on each other node, with the right token: refused.
    let others: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    for &i in &others {
        root_is_refused("k", token, &socks[i]);
    }
    // The leader that granted it dies; the new one refuses root too.
    c.kill(leader);
    let new_leader = c.wait_leader();
    assert_ne!(new_leader, leader);
    c.wait_all_know_leader();
    for &i in &others {
        root_is_refused("k", token, &socks[i]);
    }
    // The holder extends and releases it, through a follower.
    let follower = others.into_iter().find(|&i| i != new_leader).unwrap();
    let t = token.to_string();
    let out = ticket_as(
        nobody,
        &[
            "extend",
            "k",
            &t,
            "--lease",
            "30",
            "--server",
            &socks[follower],
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let out = ticket_as(nobody, &["release", "k", &t, "--server", &socks[follower]]);
    assert!(out.status.success(), "{out:?}");
    // Released: root may take it now.
    acquire_as(0, "k", &socks[new_leader]);
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

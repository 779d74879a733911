//! Requests whose connection closes right after they are written, with
//! three real `ticketd --cluster` processes (PROTOCOL §2.5): a release or an
//! extend the server has read takes effect, on a follower and on the
//! leader; an acquire whose connection is gone leaves no grant behind
//! (neither a fresh one nor a queued one handed over later).
#![cfg(feature = "cluster")]

use ticketd_testkit::process as common;

use std::net::Shutdown;
use std::time::Duration;

use common::{Client, Reply};
use ticketd_testkit::cluster::{self, Cluster};

const KEYS: usize = 20;

/// Writes `frame` on a new connection to node `i` and closes it at once,
/// without reading anything.
fn send_and_close(c: &Cluster, i: usize, frame: &[u8]) {
    let mut cl = c.client(i);
    cl.send(frame);
    let _ = cl.stream.shutdown(Shutdown::Both);
}

/// Grants `key` through `cl` (lease `lease_s`), retrying while the cluster
/// answers Busy: its token.
fn grant(c: &Cluster, cl: &mut Client, key: &str, lease_s: u8) -> u64 {
    match cluster::acquire_retrying(cl, key, 1, lease_s) {
        Some(Reply::Acquired { token, .. }) => token,
        other => panic!("{key} not granted: {other:?}\n{}", c.logs()),
    }
}

/// The keys of `keys` a `wait=0` acquire through `cl` does not get.
fn still_held(cl: &mut Client, keys: &[String]) -> Vec<String> {
    let mut held = Vec::new();
    for (n, key) in keys.iter().enumerate() {
        match cl.acquire_reply(key, 100 + n as u64, 0, 30) {
            Reply::Acquired { token, .. } => {
                assert!(matches!(
                    cl.release_reply(key, token),
                    Reply::Released { .. }
                ));
            }
            _ => held.push(key.clone()),
        }
    }
    held
}

/// A node other than the leader `l`.
fn follower(c: &Cluster, l: usize) -> usize {
    (0..c.nodes.len()).find(|&i| i != l).unwrap()
}

#[test]
fn a_release_on_a_connection_closed_at_once_takes_effect() {
    let c = Cluster::start("closerel", 3);
    c.wait_all_know_leader();
    let l = c.wait_leader();
    for (name, target) in [("follower", follower(&c, l)), ("leader", l)] {
        let mut holder = c.client(l);
        let keys: Vec<String> = (0..KEYS).map(|n| format!("{name}-{n}")).collect();
        let tokens: Vec<u64> = keys.iter().map(|k| grant(&c, &mut holder, k, 60)).collect();
        for (key, token) in keys.iter().zip(&tokens) {
            send_and_close(&c, target, &common::release_frame(key, *token));
        }
        std::thread::sleep(Duration::from_millis(400));
        let lost = still_held(&mut c.client(target), &keys);
        assert!(
            lost.is_empty(),
            "releases sent to the {name} and closed at once were lost: {lost:?}\n{}",
            c.logs()
        );
    }
}

#[test]
fn an_extend_on_a_connection_closed_at_once_takes_effect() {
    let c = Cluster::start("closeext", 3);
    c.wait_all_know_leader();
    let l = c.wait_leader();
    let f = follower(&c, l);
    let mut holder = c.client(l);
    let keys: Vec<String> = (0..KEYS).map(|n| format!("ext-{n}")).collect();
    // Two-second leases, extended to 60 s through a follower (even keys)
    // and the leader (odd keys) on connections closed at once.
    for (n, key) in keys.iter().enumerate() {
        let token = grant(&c, &mut holder, key, 2);
        let target = if n % 2 == 0 { f } else { l };
        send_and_close(&c, target, &common::extend_frame(key, token, 60));
    }
    std::thread::sleep(Duration::from_millis(3500));
    let mut probe = c.client(f);
    let free: Vec<&String> = keys
        .iter()
        .enumerate()
        .filter(|(n, k)| {
            !matches!(
                probe.acquire_reply(k, 200 + *n as u64, 0, 30),
                Reply::Timeout { .. }
            )
        })
        .map(|(_, k)| k)
        .collect();
    assert!(
        free.is_empty(),
        "extends on connections closed at once were lost (their 2 s leases ended): \
         {free:?}\n{}",
        c.logs()
    );
}

#[test]
fn an_acquire_whose_connection_closed_leaves_no_grant_behind() {
    let c = Cluster::start("closeacq", 3);
    c.wait_all_know_leader();
    let l = c.wait_leader();
    let f = follower(&c, l);
    // Free keys: acquires written and closed at once, on either node.
    let fresh: Vec<String> = (0..KEYS).map(|n| format!("fresh-{n}")).collect();
    for (n, key) in fresh.iter().enumerate() {
        let target = if n % 2 == 0 { f } else { l };
        send_and_close(
            &c,
            target,
            &common::acquire_frame(key, 300 + n as u64, 0, 60),
        );
    }
    // Held keys: a waiter queued on a connection that closes, then the
    // holder's release (the handover races the waiter's cancellation).
    let mut holder = c.client(l);
    let held: Vec<String> = (0..KEYS).map(|n| format!("queued-{n}")).collect();
    for (n, key) in held.iter().enumerate() {
        let token = grant(&c, &mut holder, key, 60);
        let target = if n % 2 == 0 { f } else { l };
        let mut waiter = c.client(target);
        waiter.acquire(key, 400 + n as u64, 30, 60);
        if n % 4 < 2 {
            // Queued for sure before it goes.
            std::thread::sleep(Duration::from_millis(50));
        }
        drop(waiter);
        assert!(matches!(
            holder.release_reply(key, token),
            Reply::Released { .. }
        ));
    }
    std::thread::sleep(Duration::from_millis(500));
    let mut probe = c.client(l);
    let mut lost = still_held(&mut probe, &fresh);
    lost.extend(still_held(&mut probe, &held));
    assert!(
        lost.is_empty(),
        "grants to connections closed before their answer stayed held: {lost:?}\n{}",
        c.logs()
    );
}

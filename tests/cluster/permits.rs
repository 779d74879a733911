//! Protocol 1.2 in cluster mode with real processes (PROTOCOL §6): a
//! semaphore's places held and queued through the followers while the
//! leader is killed with SIGKILL. No place is lost or doubled: the new
//! leader keeps every committed grant and the queue, a release through a
//! survivor hands its place to the head waiter with a greater token, and
//! a committed Expire ends each permit on its own.
#![cfg(feature = "cluster")]

use std::time::{Duration, Instant};

use ticketd::proto::Places;
use ticketd_testkit::cluster::Cluster;
use ticketd_testkit::process::{permit_frame, Client, Reply};

fn permit(c: &mut Client, key: &str, owner: u64, wait_s: u8, lease_s: u8) {
    c.send(&permit_frame(
        key,
        owner,
        Places::semaphore(3),
        wait_s,
        lease_s,
    ));
}

/// A `P` with no wait, sent again while the cluster answers Busy (no
/// leader yet): the reply, which must come within 20 s.
fn permit_now(c: &mut Client, key: &str, owner: u64, lease_s: u8) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        permit(c, key, owner, 0, lease_s);
        match c.try_recv(Duration::from_secs(5)) {
            Ok(Reply::Busy { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Ok(r) => return r,
            Err(e) => panic!("no reply to P {key}: {e:?}"),
        }
    }
}

#[test]
fn permits_held_and_queued_survive_the_leaders_death() {
    let mut cluster = Cluster::start("permits", 3);
    cluster.wait_all_know_leader();
    let leader = cluster.wait_leader();
    let f: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    let mut a = cluster.client(f[0]);
    let mut b = cluster.client(f[1]);
    // Three places: two held through one follower, one through the other.
    let t1 = permit_now(&mut a, "pool", 1, 60).token();
    let t2 = permit_now(&mut a, "pool", 2, 60).token();
    let t3 = permit_now(&mut b, "pool", 3, 2).token();
    assert!(t1 < t2 && t2 < t3, "{t1} {t2} {t3}");
    full_then_another_limit(&mut b);
    // A waiter queued through the other follower, then the leader dies.
    permit(&mut b, "pool", 6, 30, 60);
    std::thread::sleep(Duration::from_millis(300));
    cluster.kill(leader);
    // The 2 s permit ends by a committed Expire of the new leader (a lease
    // ends late, never early), and its place goes to the queued permit.
    let r = b
        .try_recv(Duration::from_secs(25))
        .unwrap_or_else(|e| panic!("the waiter got nothing: {e:?}\n{}", cluster.logs()));
    let t4 = r.token();
    assert!(t4 > t3, "{t3} {t4}");
    // Every place is taken: the two long permits and the waiter's.
    assert!(matches!(
        permit_now(&mut b, "pool", 7, 30),
        Reply::Timeout { owner: 7, .. }
    ));
    // The permits granted before the kill are still held, each released
    // once by its own token; their places go to new acquires.
    for t in [t1, t2] {
        assert_eq!(
            a.release_reply("pool", t),
            Reply::Released {
                token: t,
                key: "pool".into()
            }
        );
    }
    assert!(matches!(
        a.release_reply("pool", t3),
        Reply::NotReleased { .. }
    ));
    let t5 = permit_now(&mut a, "pool", 8, 30).token();
    assert!(t5 > t4, "{t4} {t5}");
}

/// On a full `pool` (limit 3): a `P` with no wait times out, and one with
/// another limit is answered with the key's.
fn full_then_another_limit(b: &mut Client) {
    permit(b, "pool", 4, 0, 30);
    b.send(&permit_frame("pool", 5, Places::semaphore(7), 0, 30));
    assert_eq!(
        b.recv_n(2),
        [
            Reply::Timeout {
                owner: 4,
                key: "pool".into()
            },
            Reply::LimitMismatch {
                owner: 5,
                limit: 3,
                key: "pool".into()
            }
        ]
    );
}

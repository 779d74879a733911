//! A client that meets a stalled server, a cut connection, a refused
//! address and dropped tickets leaves no thread and no open file behind once
//! it is dropped. One test in this file, so the process is quiet while it
//! counts /proc/self/task and /proc/self/fd.

use ticketd_testkit::process as common;
use ticketd_testkit::proxy;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::Ticketd;
use proxy::{Fault, Proxy};
use ticketd::client::{Acquire, Client};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Waits until both counts come back to `base`; returns the last counts.
fn settle(base: (usize, usize)) -> (usize, usize) {
    let end = Instant::now() + Duration::from_secs(8);
    loop {
        let now = (threads(), fds());
        if now == base || Instant::now() > end {
            return now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn no_thread_or_connection_outlives_the_client() {
    let server = Ticketd::start(&[]);
    let refused = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let base = (threads(), fds());
    {
        let px = Proxy::start(server.addr());
        px.set_fault_for(0, Fault::StallReplies);
        px.set_fault_for(1, Fault::CutAfter(3));
        let c = Client::builder()
            .addresses([px.addr(), refused])
            .pool_size(2)
            .build()
            .unwrap();
        let s = Duration::from_secs(1);
        // Stalled: given up at D + 1 s, its session closed.
        assert!(matches!(
            c.acquire("a", s, s).unwrap(),
            Acquire::Indeterminate
        ));
        // Cut mid-frame: lost at once.
        assert!(matches!(
            c.acquire("b", s, s).unwrap(),
            Acquire::Indeterminate
        ));
        // Healthy connections now; tickets dropped, released in the background.
        for i in 0..20 {
            let t = c
                .acquire(&format!("k{i}"), s, s)
                .unwrap()
                .ticket()
                .expect("acquired");
            drop(t);
        }
        let started = Instant::now();
        while c.background_busy() && started.elapsed() < Duration::from_secs(6) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(c.connected_sessions() <= 2);
        // The counts are live: the client's session threads show up.
        assert!(
            threads() > base.0 + 2,
            "{} threads vs {}",
            threads(),
            base.0
        );
        drop(c);
        drop(px);
    }
    let after = settle(base);
    assert_eq!(after, base, "(threads, fds) before vs after");
}

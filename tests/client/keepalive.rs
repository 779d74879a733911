//! Keep-alive at scale against the real `ticketd`: the kept tickets of one
//! client are renewed together, in a few writes, not one round trip each.
//! The proxy in between counts the chunks the client's bytes came in.

use ticketd_testkit::process as common;
use ticketd_testkit::proxy;

use std::time::{Duration, Instant};

use common::Ticketd;
use proxy::{Proxy, Req};
use ticketd::client::{Client, KeptTicket};

const S: Duration = Duration::from_secs(1);

/// 1,000 tickets kept alive by one client, lease 3 s: each renewal round
/// goes out in a handful of chunks, and every ticket stays held.
#[test]
fn a_thousand_kept_tickets_are_renewed_in_a_few_writes() {
    let server = Ticketd::start(&[]);
    let px = Proxy::start(server.addr());
    let c = Client::builder()
        .address(px.addr())
        .pool_size(1)
        .build()
        .unwrap();
    let kept: Vec<KeptTicket> = (0..1000)
        .map(|i| {
            c.acquire(&format!("kept{i:04}"), S, 3 * S)
                .unwrap()
                .ticket()
                .expect("acquired")
                .keep_alive()
        })
        .collect();
    let extends = |px: &Proxy| {
        px.received()
            .into_iter()
            .filter(|s| matches!(s.req, Req::Extend { .. }))
            .collect::<Vec<_>>()
    };
    // At least two renewals of every ticket.
    assert!(
        px.wait_until(20 * S, |px| extends(px).len() >= 2000),
        "renewals: {}",
        extends(&px).len()
    );
    let seen = extends(&px);
    let mut chunks: Vec<u64> = seen.iter().map(|s| s.chunk).collect();
    chunks.dedup();
    assert!(
        chunks.len() * 20 <= seen.len(),
        "{} extends came in {} chunks",
        seen.len(),
        chunks.len()
    );
    eprintln!("{} extends came in {} chunks", seen.len(), chunks.len());
    let end = Instant::now() + 2 * S;
    while Instant::now() < end {
        assert!(kept.iter().all(|k| !k.is_lost()), "a kept ticket was lost");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(kept);
}

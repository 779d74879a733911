//! A deterministic test of code that uses ticketd, to copy into your own
//! tests: two workers contend for a key, the holder crashes, its lease hands
//! the key over to the other, and the fencing token rises. No sockets, no
//! threads, no sleeps: the server is the real ticketd loop on in-memory
//! connections (feature `harness`, for tests only), the workers follow the
//! official client's rules ([`ticketd::client::machine`]), and the clock
//! moves only when the test says so. It runs in milliseconds, and the same
//! way every time: the scenario runs twice and the transcripts are compared.
//!
//! Run it with `cargo run --example deterministic_test --features harness`.
//! In your own crate, enable the feature for tests only:
//!
//! ```toml
//! [dev-dependencies]
//! ticketd = { version = "0.1", features = ["harness"] }
//! ```

use std::time::{Duration, Instant};

use ticketd::client::machine::{AcquireOutcome, Outcome};
use ticketd::client::Release;
use ticketd::config::Config;
use ticketd::harness::{Harness, HarnessClient};

const S: Duration = Duration::from_secs(1);

/// The scenario; returns its transcript, one line per event.
fn scenario() -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let mut log = Vec::new();
    let mut h = Harness::new(Config::default())?;
    // Distinct seeds: distinct owners, the same ones every run.
    let mut alice = HarnessClient::new(1);
    let mut bob = HarnessClient::new(2);

    // Alice takes "db" with a 5 s lease.
    alice.acquire(&h, "db", 10 * S, 5 * S)?;
    h.settle(&mut [&mut alice, &mut bob]);
    let Some((_, Outcome::Acquire(AcquireOutcome::Acquired(held)))) = alice.poll_outcome() else {
        return Err("alice did not get the key".into());
    };
    let alice_token = held.token;
    log.push(format!(
        "{} alice acquired db, token {alice_token}",
        h.now()
    ));

    // Bob asks too, willing to wait 30 s; he is queued. His lease is 30 s:
    // a ticket's local expiry counts from when the request was written, so
    // after waiting 5 s he still has 25 s.
    bob.acquire(&h, "db", 30 * S, 30 * S)?;
    h.settle(&mut [&mut alice, &mut bob]);
    assert!(bob.poll_outcome().is_none(), "bob waits");
    log.push(format!("{} bob queued for db", h.now()));

    // Alice's process dies while holding the lock: nothing is released.
    alice.crash();
    log.push(format!("{} alice crashed holding db", h.now()));

    // 5,000 ms on, the lease is not over: it ends one millisecond past
    // grant + lease (the server's clock is read in whole milliseconds, so
    // the lease must not end before the holder's own expiry).
    h.advance(5 * S);
    h.settle(&mut [&mut bob]);
    assert!(bob.poll_outcome().is_none(), "the lease is not over yet");
    log.push(format!("{} bob still waiting", h.now()));

    // One millisecond later the lease is over and Bob is handed the key.
    h.advance(Duration::from_millis(1));
    h.settle(&mut [&mut bob]);
    let Some((_, Outcome::Acquire(AcquireOutcome::Acquired(held)))) = bob.poll_outcome() else {
        return Err("bob was not handed the key".into());
    };
    assert!(held.token > alice_token, "the fencing token rises");
    log.push(format!(
        "{} bob acquired db, token {} (> {alice_token}), expires at {}",
        h.now(),
        held.token,
        held.expires_at
    ));

    // A resource fenced by tokens now refuses Alice's token.
    let refused = alice_token < held.token;
    log.push(format!(
        "{} a write fenced with alice's token {alice_token} is refused: {refused}",
        h.now()
    ));

    bob.release(&h, "db", held.token)?;
    h.settle(&mut [&mut bob]);
    let Some((_, Outcome::Release(Release::Released))) = bob.poll_outcome() else {
        return Err("bob's release did not take effect".into());
    };
    log.push(format!("{} bob released db", h.now()));
    Ok(log)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let first = scenario()?;
    let second = scenario()?;
    let took = started.elapsed();
    for line in &first {
        println!("{line}");
    }
    if first != second {
        return Err(format!("two runs differ:\n{first:?}\n{second:?}").into());
    }
    println!("two runs, identical transcripts");
    println!("(both runs took {} us)", took.as_micros());
    Ok(())
}

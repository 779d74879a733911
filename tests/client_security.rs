//! Client security against the real binary: tokens a client cannot guess,
//! and the throttle that slows down a connection that keeps guessing.

mod common;

use std::time::{Duration, Instant};

use common::{Reply, Ticketd};
use ticketd::token::{GUESS_BURST, GUESS_PER_SEC, RANDOM_BITS, RANDOM_MASK};

/// The attack that worked when tokens went up by one: acquire keys of your
/// own around the victim's grant and release "one above" and "one below".
/// Then 10,000 more guesses in the victim's sequence step, on ten
/// connections: nothing is released, every guess is answered `N`, and each
/// connection took at least the throttle's time.
#[test]
fn guessed_releases_release_nothing_and_are_throttled() {
    let server = Ticketd::start(&[]);
    let mut attacker = server.connect();
    let mut victim = server.connect();
    let before = attacker.acquire_reply("mine-1", 1, 0, 60).token();
    let held = victim.acquire_reply("victim", 2, 0, 60).token();
    let after = attacker.acquire_reply("mine-2", 3, 0, 60).token();
    assert!(before < held && held < after, "{before} {held} {after}");
    assert_eq!(held >> RANDOM_BITS, (before >> RANDOM_BITS) + 1);
    assert_eq!(after >> RANDOM_BITS, (held >> RANDOM_BITS) + 1);
    for guess in [before + 1, after - 1] {
        // Each is the victim's token with probability 2^-16 only.
        if guess != held {
            assert!(matches!(
                attacker.release_reply("victim", guess),
                Reply::NotReleased { .. }
            ));
        }
    }

    // 10,000 wrong tokens of the victim's step: the ones nearest to it
    // (the true token is left out: a blind guess finds it with
    // probability 2^-16, which is what the random bits are for).
    let step = held & !RANDOM_MASK;
    let mut guesses: Vec<u64> = (0..=RANDOM_MASK)
        .map(|low| step | low)
        .filter(|&t| t != held)
        .collect();
    guesses.sort_by_key(|&t| t.abs_diff(held));
    guesses.truncate(10_000);
    const CONNS: usize = 10;
    let per_conn = guesses.len() / CONNS;
    let start = Instant::now();
    let workers: Vec<_> = guesses
        .chunks(per_conn)
        .map(|chunk| {
            let chunk = chunk.to_vec();
            let addr = server.addr();
            std::thread::spawn(move || {
                let mut c = common::Client::connect(addr);
                let mut frames = Vec::new();
                for t in &chunk {
                    frames.extend_from_slice(&common::release_frame("victim", *t));
                }
                c.send(&frames);
                let mut n = 0;
                for _ in &chunk {
                    match c.try_recv(Duration::from_secs(60)) {
                        Ok(Reply::NotReleased { .. }) => n += 1,
                        other => panic!("a guess got {other:?}"),
                    }
                }
                (n, Instant::now())
            })
        })
        .collect();
    let mut answered = 0;
    let mut slowest = Duration::ZERO;
    for w in workers {
        let (n, done) = w.join().expect("guesser");
        answered += n;
        slowest = slowest.max(done - start);
    }
    assert_eq!(answered, guesses.len());
    // Each connection: a burst, then at most GUESS_PER_SEC a second.
    let floor = Duration::from_millis(
        (per_conn as u64 - u64::from(GUESS_BURST)) * 1000 / u64::from(GUESS_PER_SEC),
    );
    assert!(
        slowest >= floor,
        "{answered} guesses answered in {slowest:?}, under the throttle's {floor:?}"
    );
    // The victim still holds its grant.
    assert!(matches!(
        victim.release_reply("victim", held),
        Reply::Released { .. }
    ));
    // One line says so, not one per connection or per guess.
    let log = server.log();
    let lines = log.matches("slowing down").count();
    assert!(lines == 1, "{lines} throttle lines:\n{log}");
    // A connection that guesses nothing is not slowed down meanwhile.
    let mut bystander = server.connect();
    let t = bystander.acquire_reply("other", 4, 0, 5).token();
    assert!(matches!(
        bystander.release_reply("other", t),
        Reply::Released { .. }
    ));
}

/// Tokens differ in their low bits from grant to grant (they are drawn,
/// not counted), and still increase.
#[test]
fn tokens_carry_random_low_bits_and_still_increase() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let mut tokens = Vec::new();
    for i in 0..200 {
        let t = c.acquire_reply("k", i, 0, 5).token();
        assert!(matches!(c.release_reply("k", t), Reply::Released { .. }));
        tokens.push(t);
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
    assert!(tokens
        .windows(2)
        .all(|w| w[1] >> RANDOM_BITS == (w[0] >> RANDOM_BITS) + 1));
    let low: std::collections::BTreeSet<u64> = tokens.iter().map(|t| t & RANDOM_MASK).collect();
    // 200 draws of 16 bits: more than 10 repeats is astronomically unlikely.
    assert!(low.len() > 190, "{} distinct low parts", low.len());
}

/// Protected mode: plaintext on an address that is not loopback is refused
/// (exit 2, saying why and what to do) unless `--insecure` is given, and
/// then the start-up warns.
#[test]
fn protected_mode_refuses_a_listener_off_loopback_without_insecure() {
    for addr in ["0.0.0.0:0", "[::]:0"] {
        let out = common::run_ticketd(&["--listen", addr]);
        assert_eq!(out.status.code(), Some(2), "{addr}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("is not a loopback address") && err.contains("--insecure"),
            "{addr}: {err}"
        );
    }
    let server = Ticketd::start_raw(&[], &["--listen", "0.0.0.0:0", "--insecure"]);
    assert!(
        server.wait_for_log(
            "--insecure: clients speak plaintext",
            Duration::from_secs(5)
        ),
        "{}",
        server.log()
    );
    // It serves (reached over loopback here).
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], server.addr().port()));
    let mut c = common::Client::connect(addr);
    assert!(matches!(
        c.acquire_reply("k", 1, 0, 5),
        Reply::Acquired { .. }
    ));
}

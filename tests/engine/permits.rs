//! Keys of a limit of 2 or more (PROTOCOL §6): counting semaphores and
//! shared/exclusive locks in the engine, row by row of §6.2, in both time
//! policies, with the invariant checker after every step.

use ticketd::engine::{Acquire, AcquireOutcome, ConnId, Engine, Event, Outbox, Places};
use ticketd::limits::EngineLimits;
use ticketd::proto::{Mode, Reply};
use ticketd::time::Millis;

const S: Mode = Mode::Shared;
const X: Mode = Mode::Exclusive;

/// An engine under test with its outbox and a running owner counter.
struct Bench {
    e: Engine,
    out: Outbox,
    owner: u64,
}

impl Bench {
    fn single() -> Bench {
        Bench::with(Engine::new(EngineLimits::default(), 1))
    }

    fn replicated() -> Bench {
        Bench::with(Engine::replicated(EngineLimits::default(), 1))
    }

    fn with(e: Engine) -> Bench {
        Bench {
            e,
            out: Outbox::new(),
            owner: 0,
        }
    }

    /// A `P` on `conn` at `now_ms`; returns the outcome and its owner.
    fn p(
        &mut self,
        now_ms: u64,
        conn: ConnId,
        key: &str,
        (limit, mode): (u16, Mode),
        wait_s: u8,
        lease_s: u8,
    ) -> (AcquireOutcome, u64) {
        self.owner += 1;
        let req = Acquire {
            key,
            owner: self.owner,
            wait_s,
            lease_s,
        };
        self.out.clear();
        let got = self.e.acquire_with_limit(
            Millis(now_ms),
            conn,
            req,
            Places { limit, mode },
            (),
            &mut self.out,
        );
        self.e.check_invariants();
        (got, self.owner)
    }

    /// A `P` that must be granted at once; returns its token.
    fn grant(&mut self, now_ms: u64, key: &str, limit: u16, mode: Mode, lease_s: u8) -> u64 {
        match self.p(now_ms, 1, key, (limit, mode), 0, lease_s).0 {
            AcquireOutcome::Granted(t) => t,
            other => panic!("{key} {limit} {mode}: {other:?}"),
        }
    }

    /// A `P` that must queue; returns its owner.
    fn queue(&mut self, now_ms: u64, conn: ConnId, key: &str, limit: u16, mode: Mode) -> u64 {
        let (got, owner) = self.p(now_ms, conn, key, (limit, mode), 10, 30);
        assert!(
            matches!(got, AcquireOutcome::Queued(_)),
            "{key} {mode}: {got:?}"
        );
        owner
    }

    fn release(&mut self, now_ms: u64, token: u64, key: &str) -> bool {
        self.out.clear();
        let took = self.e.release(Millis(now_ms), 9, token, key, &mut self.out);
        self.e.check_invariants();
        took
    }

    fn tick(&mut self, now_ms: u64) {
        self.out.clear();
        self.e.tick(Millis(now_ms), &mut self.out);
        self.e.check_invariants();
    }

    /// The grants in the outbox, as (owner, token), in order.
    fn granted(&self) -> Vec<(u64, u64)> {
        self.out
            .iter()
            .filter_map(|a| match a.reply {
                Reply::Acquired { token, owner, .. } => Some((owner, token)),
                _ => None,
            })
            .collect()
    }

    /// The tokens whose lease ran out, in the outbox.
    fn expired(&self) -> Vec<u64> {
        self.out
            .events()
            .filter_map(|e| match e {
                Event::Expired { token, .. } => Some(token),
                _ => None,
            })
            .collect()
    }
}

#[test]
fn a_semaphore_grants_its_limit_then_queues_in_order() {
    let mut b = Bench::single();
    let tokens: Vec<u64> = (0..3).map(|_| b.grant(0, "pool", 3, S, 30)).collect();
    assert_eq!(
        tokens,
        [1, 2, 3],
        "one token per permit, strictly increasing"
    );
    assert_eq!(b.p(0, 2, "pool", (3, S), 0, 30).0, AcquireOutcome::Timeout);
    let first = b.queue(0, 2, "pool", 3, S);
    let second = b.queue(0, 3, "pool", 3, S);
    assert!(b.release(100, 2, "pool"));
    assert_eq!(b.granted(), [(first, 4)], "the head takes the freed place");
    assert!(!b.release(100, 2, "pool"), "a permit is released once");
    assert!(b.release(200, 1, "pool"));
    assert_eq!(b.granted(), [(second, 5)]);
    for t in [3, 4, 5] {
        assert!(b.release(300, t, "pool"));
    }
    // Nothing is left of the key: another limit registers it afresh.
    assert_eq!(b.grant(400, "pool", 7, S, 30), 6);
}

#[test]
fn a_different_limit_is_answered_with_the_keys_own() {
    let mut b = Bench::single();
    b.grant(0, "pool", 4, S, 30);
    let (got, owner) = b.p(0, 2, "pool", (8, S), 5, 30);
    assert_eq!(got, AcquireOutcome::LimitMismatch(4));
    let want = Reply::LimitMismatch {
        owner,
        limit: 4,
        key: "pool",
    };
    assert_eq!(b.out.iter().map(|a| a.reply).collect::<Vec<_>>(), [want]);
    assert_eq!(
        b.p(0, 2, "pool", (1, X), 5, 30).0,
        AcquireOutcome::LimitMismatch(4)
    );
    // A 1.0 Acquire cannot read L: it gets B.
    b.out.clear();
    let req = Acquire {
        key: "pool",
        owner: 99,
        wait_s: 5,
        lease_s: 30,
    };
    assert_eq!(
        b.e.acquire(Millis(0), 2, req, &mut b.out),
        AcquireOutcome::Busy
    );
    // A mutex is a key of limit 1, whatever the mode.
    let m = b.grant(0, "mutex", 1, S, 30);
    assert_eq!(
        b.p(0, 2, "mutex", (2, S), 5, 30).0,
        AcquireOutcome::LimitMismatch(1)
    );
    assert_eq!(b.p(0, 2, "mutex", (1, S), 0, 30).0, AcquireOutcome::Timeout);
    assert!(b.release(0, m, "mutex"));
    b.e.check_invariants();
}

#[test]
fn a_queued_writer_blocks_later_readers_and_the_readers_after_it_go_together() {
    let mut b = Bench::single();
    let r1 = b.grant(0, "rw", 100, S, 30);
    let r2 = b.grant(0, "rw", 100, S, 30);
    let writer = b.queue(0, 2, "rw", 100, X);
    // Places are free, but a writer waits before it: no overtaking.
    assert_eq!(b.p(0, 3, "rw", (100, S), 0, 30).0, AcquireOutcome::Timeout);
    let r3 = b.queue(0, 3, "rw", 100, S);
    let r4 = b.queue(0, 4, "rw", 100, S);
    let w2 = b.queue(0, 5, "rw", 100, X);
    assert!(b.release(10, r1, "rw"));
    assert_eq!(b.granted(), [], "a reader still holds");
    assert!(b.release(20, r2, "rw"));
    assert_eq!(b.granted(), [(writer, 3)]);
    assert!(b.release(30, 3, "rw"));
    assert_eq!(
        b.granted(),
        [(r3, 4), (r4, 5)],
        "the run of readers at the head"
    );
    assert!(b.release(40, 4, "rw"));
    assert!(b.release(40, 5, "rw"));
    assert_eq!(b.granted(), [(w2, 6)]);
}

#[test]
fn expiry_ends_one_permit_and_hands_its_place_on_without_takeover() {
    let mut b = Bench::single();
    let short = b.grant(0, "pool", 2, S, 1);
    let long = b.grant(0, "pool", 2, S, 30);
    let waiter = b.queue(0, 2, "pool", 2, S);
    // Past the short lease, before the tick: a new acquire queues behind
    // the waiter rather than taking the lapsed place over.
    let (got, late) = b.p(1_500, 3, "pool", (2, S), 10, 30);
    assert!(matches!(got, AcquireOutcome::Queued(_)), "{got:?}");
    assert_eq!(b.expired(), [short], "the acquire found the lapsed permit");
    assert_eq!(b.granted(), [(waiter, 3)], "and the head took its place");
    assert!(!b.release(1_500, short, "pool"), "an ended permit is gone");
    assert!(b.release(1_600, long, "pool"));
    assert_eq!(b.granted(), [(late, 4)]);
}

#[test]
fn the_timer_hands_a_lapsed_permit_to_the_head_waiter() {
    let mut b = Bench::single();
    let t = b.grant(0, "pool", 2, X, 2);
    let first = b.queue(500, 2, "pool", 2, S);
    let second = b.queue(500, 3, "pool", 2, S);
    let deadline = b.e.next_deadline().expect("a timer");
    assert!(deadline <= Millis(2_001), "{deadline:?}");
    b.tick(2_001);
    assert_eq!(b.expired(), [t]);
    assert_eq!(b.granted(), [(first, 2), (second, 3)]);
}

#[test]
fn a_wait_that_runs_out_at_the_head_lets_the_readers_behind_it_in() {
    let mut b = Bench::single();
    let r = b.grant(0, "rw", 10, S, 60);
    let (got, writer) = b.p(0, 2, "rw", (10, X), 1, 60);
    assert!(matches!(got, AcquireOutcome::Queued(_)));
    let reader = b.queue(0, 3, "rw", 10, S);
    b.tick(1_000);
    let replies: Vec<Reply<'_>> = b.out.iter().map(|a| a.reply).collect();
    assert_eq!(
        replies,
        [
            Reply::Timeout {
                owner: writer,
                key: "rw"
            },
            Reply::Acquired {
                token: 2,
                owner: reader,
                key: "rw"
            }
        ]
    );
    assert!(b.release(1_000, r, "rw"));
}

#[test]
fn a_disconnect_of_the_head_writer_lets_the_readers_behind_it_in() {
    let mut b = Bench::single();
    b.grant(0, "rw", 10, S, 60);
    b.queue(0, 2, "rw", 10, X);
    let reader = b.queue(0, 3, "rw", 10, S);
    b.out.clear();
    b.e.disconnect(Millis(10), 2, &mut b.out);
    b.e.check_invariants();
    assert_eq!(b.granted(), [(reader, 2)]);
}

#[test]
fn a_permit_is_extended_by_its_own_token_only() {
    let mut b = Bench::single();
    let t1 = b.grant(0, "pool", 2, S, 2);
    let t2 = b.grant(0, "pool", 2, S, 2);
    b.out.clear();
    assert!(b.e.extend(Millis(1_000), 1, "pool", t1, 10, &mut b.out));
    assert!(!b.e.extend(Millis(1_000), 1, "pool", 77, 10, &mut b.out));
    b.e.check_invariants();
    // At 5 s the unextended permit is over and the extended one is not.
    let (got, _) = b.p(5_000, 2, "pool", (2, S), 0, 30);
    assert_eq!(got, AcquireOutcome::Granted(3));
    assert_eq!(b.expired(), [t2]);
    assert_eq!(
        b.p(5_000, 2, "pool", (2, S), 0, 30).0,
        AcquireOutcome::Timeout
    );
    assert!(b.release(5_000, t1, "pool"));
}

#[test]
fn the_sweep_deletes_lapsed_permits_nobody_waits_for() {
    let limits = EngineLimits {
        sweep_interval_ms: 1_000,
        ..EngineLimits::default()
    };
    let mut b = Bench::with(Engine::new(limits, 1));
    let t1 = b.grant(0, "pool", 2, S, 1);
    let t2 = b.grant(0, "pool", 2, S, 1);
    assert_eq!(b.e.outstanding_until(Millis(0)), Some(Millis(1_001)));
    for now in (0..=5_000).step_by(250) {
        b.tick(now);
        if !b.expired().is_empty() {
            let mut ended = b.expired();
            ended.sort_unstable();
            assert_eq!(ended, [t1, t2]);
            assert_eq!(b.e.outstanding_until(Millis(now)), None);
            assert_eq!(b.grant(now, "pool", 5, X, 1), 3, "the key was deleted");
            return;
        }
    }
    panic!("the sweep never ended the permits");
}

#[test]
fn the_restart_grace_holds_a_new_permit_key_exclusively_until_it_ends() {
    let mut b = Bench::single();
    b.e.set_restart_grace(Millis(5_000));
    assert_eq!(b.p(0, 1, "pool", (4, S), 0, 30).0, AcquireOutcome::Timeout);
    let first = b.queue(100, 2, "pool", 4, S);
    let second = b.queue(100, 3, "pool", 4, S);
    assert!(!b.release(200, 0, "pool"), "token 0 is nobody's");
    b.tick(5_000);
    assert_eq!(b.granted(), [(first, 1), (second, 2)]);
}

/// The first acquire of a key in a restart grace, with a wait, registers
/// the key to the grace and queues: its timer is the grace's end, where
/// it is granted, well before its own 10 s wait runs out.
#[test]
fn a_waiting_first_acquire_in_the_restart_grace_is_granted_when_it_ends() {
    let mut b = Bench::single();
    b.e.set_restart_grace(Millis(5_000));
    let first = b.queue(0, 1, "pool", 4, S);
    assert_eq!(b.e.next_deadline(), Some(Millis(5_000)));
    b.tick(4_999);
    assert_eq!(b.granted(), []);
    b.tick(5_000);
    assert_eq!(b.granted(), [(first, 1)]);
}

#[test]
fn replicated_expiry_and_wait_timeout_are_explicit() {
    let mut b = Bench::replicated();
    let w = b.grant(0, "rw", 5, X, 1);
    let (got, writer) = b.p(0, 2, "rw", (5, X), 1, 30);
    let AcquireOutcome::Queued(writer_id) = got else {
        panic!("{got:?}")
    };
    let reader = b.queue(0, 3, "rw", 5, S);
    // Nothing happens by the clock in cluster mode.
    b.tick(1_000_000);
    assert_eq!(b.granted(), []);
    b.out.clear();
    assert!(b.e.expire(Millis(0), "rw", w, &mut b.out));
    assert!(
        !b.e.expire(Millis(0), "rw", w, &mut b.out),
        "a stale expire"
    );
    b.e.check_invariants();
    assert_eq!(b.granted(), [(writer, 2)]);
    // The writer holds; the reader waits. Its grant expires, the reader
    // goes in.
    b.out.clear();
    assert!(
        !b.e.wait_timeout(Millis(0), "rw", writer_id, &mut b.out),
        "granted already"
    );
    assert!(b.e.expire(Millis(0), "rw", 2, &mut b.out));
    b.e.check_invariants();
    assert_eq!(b.granted(), [(reader, 3)]);
}

#[test]
fn every_permit_counts_as_a_key_toward_max_keys() {
    let limits = EngineLimits {
        max_keys: 3,
        ..EngineLimits::default()
    };
    let mut b = Bench::with(Engine::new(limits, 1));
    b.grant(0, "pool", 8, S, 30);
    b.grant(0, "pool", 8, S, 30);
    b.grant(0, "m", 1, X, 30);
    assert_eq!(b.p(0, 1, "pool", (8, S), 0, 30).0, AcquireOutcome::Busy);
    assert_eq!(b.p(0, 1, "other", (1, X), 0, 30).0, AcquireOutcome::Busy);
}

//! Stepping the harness: its clock and deadlines, the official client's rules
//! on it, and replies withheld at the end of a turn.

use super::*;

#[test]
fn run_until_idle_stops_when_nothing_is_due_and_advance_wakes_the_deadlines() {
    let mut h = sequential_harness(Config::default()).unwrap();
    let mut a = h.connect();
    let mut b = h.connect();
    a.write(&acquire("db", 1, 0, 1));
    h.run_until_idle();
    b.write(&acquire("db", 2, 3, 1));
    h.run_until_idle();
    assert_eq!(h.run_until_idle(), 0, "idle: nothing to do at this time");
    assert!(b.take().is_empty(), "queued");
    h.advance(Duration::from_millis(1000));
    h.run_until_idle();
    assert!(b.take().is_empty(), "the lease ends 1 ms past 1 s");
    h.advance(Duration::from_millis(1));
    let turns = h.run_until_idle();
    assert!(turns >= 1);
    let got = b.take();
    assert_eq!(
        replies(&got),
        vec!["Acquired { token: 2, owner: 2, key: \"db\" }".to_string()]
    );
    assert_eq!(h.now(), Millis(1001));
}

#[test]
fn official_client_rules_on_the_harness_clock_hand_over_time_out_and_release() {
    const S: Duration = Duration::from_secs(1);
    let mut h = sequential_harness(Config::default()).unwrap();
    let (mut holder, mut waiter, mut late) = (
        HarnessClient::new(1),
        HarnessClient::new(2),
        HarnessClient::new(3),
    );
    let held = holder.acquire(&h, "db", Duration::ZERO, 30 * S).unwrap();
    h.settle(&mut [&mut holder]);
    let Some((id, Outcome::Acquire(AcquireOutcome::Acquired(t1)))) = holder.poll_outcome() else {
        panic!("not acquired");
    };
    assert_eq!((id, t1.token, t1.expires_at), (held, 1, Millis(30_000)));
    waiter.acquire(&h, "db", 10 * S, 5 * S).unwrap();
    late.acquire(&h, "db", S, 5 * S).unwrap();
    h.settle(&mut [&mut holder, &mut waiter, &mut late]);
    assert!(waiter.poll_outcome().is_none() && late.poll_outcome().is_none());
    // The late one's 1 s wait runs out on the server: a definitive Timeout.
    h.advance(S);
    h.settle(&mut [&mut holder, &mut waiter, &mut late]);
    assert_eq!(
        late.poll_outcome(),
        Some((
            ticketd::client::machine::CallId(1),
            Outcome::Acquire(AcquireOutcome::Timeout)
        ))
    );
    // The release hands the key to the head waiter at once, FIFO.
    holder.release(&h, "db", t1.token).unwrap();
    h.settle(&mut [&mut holder, &mut waiter, &mut late]);
    assert_eq!(
        holder.poll_outcome().map(|(_, o)| o),
        Some(Outcome::Release(Release::Released))
    );
    let Some((_, Outcome::Acquire(AcquireOutcome::Acquired(t2)))) = waiter.poll_outcome() else {
        panic!("not handed over");
    };
    assert_eq!(t2.token, 2);
    // Released twice: the second is definitive NotHeld.
    holder.release(&h, "db", t1.token).unwrap();
    h.settle(&mut [&mut holder]);
    assert_eq!(
        holder.poll_outcome().map(|(_, o)| o),
        Some(Outcome::Release(Release::NotHeld))
    );
    assert_eq!(
        h.now(),
        Millis(1_000),
        "no time passed but what the test moved"
    );
}

/// Protocol 1.2 through the harness's official client: two readers share
/// a read/write lock, a writer queues behind them and is handed the key
/// when the second reader releases, a reader that comes after the writer
/// queues behind it (no starvation), and an acquire with another limit is
/// answered with the key's.
#[test]
fn readers_share_and_a_writer_queues_through_the_harness_client() {
    const S: Duration = Duration::from_secs(1);
    let mut h = sequential_harness(Config::default()).unwrap();
    let mut c: Vec<HarnessClient> = (1..=5).map(HarnessClient::new).collect();
    let granted = |c: &mut HarnessClient| match c.poll_outcome() {
        Some((_, Outcome::Acquire(AcquireOutcome::Acquired(t)))) => Some(t.token),
        _ => None,
    };
    for reader in &mut c[..2] {
        reader
            .acquire_with(&h, "rw", Places::shared(), Duration::ZERO, 30 * S)
            .unwrap();
    }
    c[2].acquire_with(&h, "rw", Places::exclusive(), 10 * S, 30 * S)
        .unwrap();
    h.settle(&mut c.iter_mut().collect::<Vec<_>>());
    let (r1, r2) = (granted(&mut c[0]).unwrap(), granted(&mut c[1]).unwrap());
    assert!(c[2].poll_outcome().is_none(), "the writer waits for both");
    c[3].acquire_with(&h, "rw", Places::shared(), 10 * S, 30 * S)
        .unwrap();
    c[4].acquire_with(&h, "rw", Places::semaphore(3), Duration::ZERO, 30 * S)
        .unwrap();
    h.settle(&mut c.iter_mut().collect::<Vec<_>>());
    assert!(
        c[3].poll_outcome().is_none(),
        "a reader after a writer queues"
    );
    assert_eq!(
        c[4].poll_outcome().map(|(_, o)| o),
        Some(Outcome::Acquire(AcquireOutcome::LimitMismatch(
            Places::shared().limit
        )))
    );
    c[0].release(&h, "rw", r1).unwrap();
    h.settle(&mut c.iter_mut().collect::<Vec<_>>());
    assert!(c[2].poll_outcome().is_none(), "one reader still holds");
    c[1].release(&h, "rw", r2).unwrap();
    h.settle(&mut c.iter_mut().collect::<Vec<_>>());
    let w = granted(&mut c[2]).expect("the writer is handed the key");
    assert!(w > r2 && w > r1);
    assert!(
        c[3].poll_outcome().is_none(),
        "the reader waits for the writer"
    );
    c[2].release(&h, "rw", w).unwrap();
    h.settle(&mut c.iter_mut().collect::<Vec<_>>());
    assert!(granted(&mut c[3]).is_some_and(|t| t > w));
}

#[test]
fn a_call_that_was_never_sent_waits_for_a_connection_and_keeps_its_deadline() {
    const S: Duration = Duration::from_secs(1);
    let config = Config {
        max_conns: 1,
        ..Config::default()
    };
    let mut h = sequential_harness(config).unwrap();
    let other = h.connect(); // takes the only connection slot
    let mut me = HarnessClient::new(1);
    me.acquire(&h, "db", 3 * S, 5 * S).unwrap();
    h.settle(&mut [&mut me]);
    assert!(
        me.poll_outcome().is_none(),
        "refused connections sent nothing"
    );
    assert_eq!(me.bytes_moved(), (0, 0));
    assert!(h.stats().refused >= 1);
    // A slot frees up 2.5 s later: the same call goes out then, with the
    // wait left until its deadline (0.5 s, rounded up to 1 s on the wire).
    drop(other);
    h.advance(Duration::from_millis(2500));
    h.settle(&mut [&mut me]);
    let Some((_, Outcome::Acquire(AcquireOutcome::Acquired(held)))) = me.poll_outcome() else {
        panic!("not acquired once a connection was accepted");
    };
    assert_eq!(held.expires_at, Millis(7_500), "written at 2.5 s + 5 s");
    // Refused until the deadline: Timeout, and the server never saw it.
    let mut h = sequential_harness(Config {
        max_conns: 1,
        ..Config::default()
    })
    .unwrap();
    let _other = h.connect();
    let mut me = HarnessClient::new(2);
    me.acquire(&h, "db", 3 * S, 5 * S).unwrap();
    h.settle(&mut [&mut me]);
    h.advance(3 * S);
    h.settle(&mut [&mut me]);
    assert_eq!(
        me.poll_outcome().map(|(_, o)| o),
        Some(Outcome::Acquire(AcquireOutcome::Timeout))
    );
    assert_eq!(h.service().engine().key_count(), 0);
}

#[test]
fn an_extend_through_the_harness_keeps_the_key_past_the_first_lease() {
    const S: Duration = Duration::from_secs(1);
    let mut h = sequential_harness(Config::default()).unwrap();
    let (mut holder, mut waiter) = (HarnessClient::new(1), HarnessClient::new(2));
    holder.acquire(&h, "db", Duration::ZERO, 5 * S).unwrap();
    h.settle(&mut [&mut holder]);
    let Some((_, Outcome::Acquire(AcquireOutcome::Acquired(t)))) = holder.poll_outcome() else {
        panic!("not acquired");
    };
    waiter.acquire(&h, "db", 30 * S, 5 * S).unwrap();
    h.advance(4 * S);
    holder.extend(&h, &t, 10 * S).unwrap();
    h.settle(&mut [&mut holder, &mut waiter]);
    let Some((_, Outcome::Extend(ExtendOutcome::Extended(t2)))) = holder.poll_outcome() else {
        panic!("not extended");
    };
    assert_eq!((t2.token, t2.expires_at), (t.token, Millis(14_000)));
    // Past the first lease, the key is still the holder's.
    h.advance(2 * S);
    h.settle(&mut [&mut holder, &mut waiter]);
    assert!(waiter.poll_outcome().is_none(), "still held after 6 s");
    // The holder stops renewing: one millisecond past 4 s + 10 s it is over.
    h.advance(8 * S + Duration::from_millis(1));
    h.settle(&mut [&mut holder, &mut waiter]);
    let Some((_, Outcome::Acquire(AcquireOutcome::Acquired(w)))) = waiter.poll_outcome() else {
        panic!("not handed over");
    };
    assert!(w.token > t.token);
    // Past its conservative expiry the ticket is lost for good: Lost,
    // nothing sent.
    holder.extend(&h, &t2, 10 * S).unwrap();
    h.settle(&mut [&mut holder, &mut waiter]);
    assert_eq!(
        holder.poll_outcome().map(|(_, o)| o),
        Some(Outcome::Extend(ExtendOutcome::Lost))
    );
}

/// Single mode, except that `end_turn` withholds every grant and extension
/// of the turn whose lease is longer than `withhold_over` seconds, as
/// single mode does when the lease bound cannot be written.
struct Withholding {
    inner: SingleService,
    withhold_over: Option<u8>,
    withheld: usize,
}

impl ticketd::service::Service for Withholding {
    fn request(
        &mut self,
        now: Millis,
        conn: u64,
        req: Request<'_>,
        out: &mut ticketd::engine::Outbox,
    ) {
        self.inner.request(now, conn, req, out);
    }
    fn disconnect(&mut self, now: Millis, conn: u64, out: &mut ticketd::engine::Outbox) {
        self.inner.disconnect(now, conn, out);
    }
    fn tick(&mut self, now: Millis, out: &mut ticketd::engine::Outbox) {
        self.inner.tick(now, out);
    }
    fn next_deadline(&self) -> Option<Millis> {
        self.inner.next_deadline()
    }
    fn replies_direct(&self) -> bool {
        self.inner.replies_direct()
    }
    fn end_turn(&mut self, now: Millis, out: &mut ticketd::engine::Outbox) -> std::io::Result<()> {
        if let Some(over) = self.withhold_over {
            self.withheld += out.retain_leases(|lease_s| lease_s <= over);
        }
        self.inner.end_turn(now, out)
    }
}

/// A pipelined batch answered straight into the connection's write buffer
/// loses exactly the withheld grants and extension, the replies around them
/// intact and in order; a waiter's grant made by another connection's
/// release is withheld the same way, and reaches its connection before the
/// replies to that connection's own later requests of the same turn.
#[test]
fn withheld_grants_are_cut_out_of_replies_encoded_into_the_write_buffer() {
    let service = Withholding {
        inner: SingleService::with_first_token(Config::default().engine.clone(), 1)
            .with_sequential_tokens(),
        withhold_over: Some(10),
        withheld: 0,
    };
    let mut h = Harness::with_service(Config::default(), service).expect("harness");
    let mut a = h.connect();
    let mut batch = Vec::new();
    batch.extend(acquire("k1", 1, 0, 5));
    batch.extend(acquire("k2", 1, 0, 30)); // withheld
    batch.extend(release("k9", 4)); // N
    batch.extend(acquire("k3", 1, 0, 10));
    batch.extend(extend("k1", 1, 60)); // withheld
    batch.extend(extend("k3", 3, 7));
    a.write(&batch);
    h.run_until_idle();
    assert_eq!(
        replies(&a.take()),
        [
            "Acquired { token: 1, owner: 1, key: \"k1\" }",
            "NotReleased { token: 4, key: \"k9\" }",
            "Acquired { token: 3, owner: 1, key: \"k3\" }",
            "Extended { token: 3, key: \"k3\" }",
        ]
    );
    assert_eq!(h.service().withheld, 2);
    // The withheld grant still holds its key until its lease ends.
    a.write(&acquire("k2", 2, 0, 5));
    h.run_until_idle();
    assert_eq!(replies(&a.take()), ["Timeout { owner: 2, key: \"k2\" }"]);
    let stats = h.stats();
    assert_eq!(stats.replies[0], 2, "grants counted, less the withheld");
    assert_eq!(stats.replies[5], 1, "extensions counted, less the withheld");

    a_waiters_withheld_grant_is_cut_out_of_its_turn(&mut h);
}

/// A waiter's grant, withheld or not, in a turn where its connection also
/// asks for another key (`h` has handed out tokens 1 to 3).
fn a_waiters_withheld_grant_is_cut_out_of_its_turn(h: &mut Harness<Withholding>) {
    // A waiter's grant, made while another connection is handled.
    let (mut b, mut c) = (h.connect(), h.connect());
    b.write(&acquire("w", 5, 0, 5));
    c.write(&acquire("v", 6, 0, 5));
    h.run_until_idle();
    assert_eq!(
        replies(&b.take()),
        ["Acquired { token: 4, owner: 5, key: \"w\" }"]
    );
    assert_eq!(
        replies(&c.take()),
        ["Acquired { token: 5, owner: 6, key: \"v\" }"]
    );
    c.write(&acquire("w", 7, 10, 30)); // queued behind b; withheld when granted
    h.run_until_idle();
    assert!(c.take().is_empty());
    // b's release hands "w" to c's waiter (30 s: withheld, the waiter is
    // gone), in the same turn c asks for another key.
    b.write(&release("w", 4));
    c.write(&acquire("u", 9, 0, 5));
    h.run_until_idle();
    assert_eq!(replies(&b.take()), ["Released { token: 4, key: \"w\" }"]);
    assert_eq!(
        replies(&c.take()),
        ["Acquired { token: 7, owner: 9, key: \"u\" }"]
    );
    assert_eq!(h.service().withheld, 3);
    // Nothing withheld: the waiter's grant comes first, then the reply to
    // c's own request of the same turn.
    h.service_mut().withhold_over = None;
    h.advance(Duration::from_secs(31));
    b.write(&acquire("w", 10, 0, 5));
    h.run_until_idle();
    assert_eq!(
        replies(&b.take()),
        ["Acquired { token: 8, owner: 10, key: \"w\" }"]
    );
    c.write(&acquire("w", 11, 10, 5));
    h.run_until_idle();
    assert!(c.take().is_empty());
    b.write(&release("w", 8));
    c.write(&acquire("t", 12, 0, 5));
    h.run_until_idle();
    assert_eq!(replies(&b.take()), ["Released { token: 8, key: \"w\" }"]);
    assert_eq!(
        replies(&c.take()),
        [
            "Acquired { token: 9, owner: 11, key: \"w\" }",
            "Acquired { token: 10, owner: 12, key: \"t\" }",
        ]
    );
}

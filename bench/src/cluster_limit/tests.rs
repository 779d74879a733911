//! The cluster limit's tests: a leader and followers in threads, or a
//! leader with stand-in followers the test plays itself.

use super::follower::follow;
use super::leader::{committed, lead};
use super::log::SyncDelay;
use super::*;

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use ticketd::limits::DEFAULT_MAX_KEY_BYTES;
use ticketd::proto::{self, Decoded, Reply, Request};

type Running = std::thread::JoinHandle<io::Result<ClusterLimitStats>>;
const LOG: u64 = 1 << 20;

fn log_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "ticketd-cluster-limit-{name}-{}.log",
        std::process::id()
    ))
}

fn start_leader(
    followers: Vec<SocketAddr>,
    log: &str,
    delay: Duration,
) -> (SocketAddr, Arc<AtomicBool>, Running) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let path = log_path(log);
    let t = std::thread::spawn(move || {
        let r = lead(listener, &followers, &path, LOG, SyncDelay(delay), &stop2);
        let _ = std::fs::remove_file(&path);
        r
    });
    (addr, stop, t)
}

type Follower = std::thread::JoinHandle<io::Result<(ClusterLimitStats, Vec<u8>)>>;

/// A follower in a thread; it ends when the leader's connection does
/// (or after 30 s), with its stats and its log file's bytes.
fn start_follower(name: &str, delay: Duration) -> (SocketAddr, Follower) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let path = log_path(name);
    let t = std::thread::spawn(move || {
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(30));
            stop2.store(true, Ordering::Relaxed);
        });
        let r = follow(l, None, &path, LOG, SyncDelay(delay), &stop)
            .map(|s| (s, std::fs::read(&path).unwrap()));
        let _ = std::fs::remove_file(&path);
        r
    });
    (addr, t)
}

/// A follower serving clients of its own, in a thread: its address for
/// the leader, its address for clients, and its thread.
fn start_serving_follower(name: &str) -> (SocketAddr, SocketAddr, Follower) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpListener::bind("127.0.0.1:0").unwrap();
    let (addr, caddr) = (l.local_addr().unwrap(), c.local_addr().unwrap());
    let path = log_path(name);
    let t = std::thread::spawn(move || {
        let stop = AtomicBool::new(false);
        let r = follow(l, Some(c), &path, LOG, SyncDelay::default(), &stop)
            .map(|s| (s, std::fs::read(&path).unwrap()));
        let _ = std::fs::remove_file(&path);
        r
    });
    (addr, caddr, t)
}

/// A stand-in follower: the test reads the leader's batches and sends
/// the acknowledgements itself.
fn fake_follower() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

fn accept_leader(l: &TcpListener) -> TcpStream {
    let (s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// A leader whose two followers are stand-ins: its address, stop flag
/// and thread, and the test's ends of its links to followers a and b.
fn leader_with_fake_followers(
    log: &str,
    delay: Duration,
) -> (SocketAddr, Arc<AtomicBool>, Running, TcpStream, TcpStream) {
    let (fa, a_addr) = fake_follower();
    let (fb, b_addr) = fake_follower();
    let (addr, stop, leader) = start_leader(vec![a_addr, b_addr], log, delay);
    let a = accept_leader(&fa);
    let b = accept_leader(&fb);
    (addr, stop, leader, a, b)
}

fn acquire(key: &str) -> Vec<u8> {
    let mut out = Vec::new();
    proto::encode_request(
        &Request::Acquire {
            wait_s: 0,
            lease_s: 30,
            owner: 7,
            key,
        },
        &mut out,
    );
    out
}

fn acquired(token: u64, key: &str) -> Vec<u8> {
    let mut out = Vec::new();
    proto::encode_reply(
        &Reply::Acquired {
            token,
            owner: 7,
            key,
        },
        &mut out,
    );
    out
}

/// Reads one whole frame from a follower's side of the leader's link:
/// its batch number and payload.
fn read_batch(s: &mut TcpStream) -> (u64, Vec<u8>) {
    let mut h = [0u8; FRAME_HEADER_BYTES];
    s.read_exact(&mut h).unwrap();
    let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    let mut seq = [0u8; 8];
    seq.copy_from_slice(&h[4..]);
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).unwrap();
    (u64::from_le_bytes(seq), payload)
}

/// Sends one batch to a follower, as the leader does.
fn send_batch(s: &mut TcpStream, seq: u64, payload: &[u8]) {
    let mut f = (payload.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&seq.to_le_bytes());
    f.extend_from_slice(payload);
    s.write_all(&f).unwrap();
}

fn read_ack(s: &mut TcpStream) -> u64 {
    let mut b = [0u8; 8];
    s.read_exact(&mut b).unwrap();
    u64::from_le_bytes(b)
}

/// Waits for one reply frame on `s`.
fn read_reply(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 256];
    loop {
        if let Decoded::Frame { used, .. } = proto::decode_reply(&got, 1024) {
            assert_eq!(used, got.len(), "one reply expected");
            return got;
        }
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "the leader closed the client's connection");
        got.extend_from_slice(&chunk[..n]);
    }
}

/// Asserts that nothing arrives on `s` within `for_ms`.
fn assert_silent(s: &mut TcpStream, for_ms: u64) {
    s.set_read_timeout(Some(Duration::from_millis(for_ms)))
        .unwrap();
    let mut byte = [0u8; 1];
    match s.read(&mut byte) {
        Ok(n) => panic!("{n} bytes arrived: {byte:?}"),
        Err(e) => assert!(
            matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{e}"
        ),
    }
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
}

#[test]
fn a_batch_commits_once_two_of_the_three_marks_reach_it() {
    assert_eq!(committed([0, 0, 0]), 0);
    assert_eq!(committed([5, 0, 0]), 0, "the leader alone is no majority");
    assert_eq!(committed([0, 5, 0]), 0, "nor is one follower");
    assert_eq!(committed([0, 5, 3]), 3, "two followers are");
    assert_eq!(committed([4, 0, 9]), 4);
    assert_eq!(committed([4, 9, 7]), 7);
}

/// The leader answers only once a majority holds the batch: its own
/// `fdatasync` is not enough, one follower's acknowledgement is.
#[test]
fn a_request_is_answered_only_once_two_of_three_nodes_hold_it() {
    let (addr, stop, leader, mut a, mut b) = leader_with_fake_followers("majority", Duration::ZERO);

    let mut client = TcpStream::connect(addr).unwrap();
    let req = acquire("k");
    client.write_all(&req).unwrap();
    // Both followers get batch 1: exactly the client's request.
    assert_eq!(read_batch(&mut a), (1, req.clone()));
    assert_eq!(read_batch(&mut b), (1, req));
    // No follower has acknowledged: no answer, however long the
    // leader's own fdatasync has been done.
    assert_silent(&mut client, 300);
    // Follower a holds it: answered.
    a.write_all(&1u64.to_le_bytes()).unwrap();
    assert_eq!(read_reply(&mut client), acquired(1, "k"));

    // Batch 2 on follower b alone is enough too.
    let mut rel = Vec::new();
    proto::encode_request(&Request::Release { token: 1, key: "k" }, &mut rel);
    client.write_all(&rel).unwrap();
    assert_eq!(read_batch(&mut a), (2, rel.clone()));
    assert_eq!(read_batch(&mut b), (2, rel));
    b.write_all(&2u64.to_le_bytes()).unwrap();
    let mut want = Vec::new();
    proto::encode_reply(&Reply::Released { token: 1, key: "k" }, &mut want);
    assert_eq!(read_reply(&mut client), want);

    stop.store(true, Ordering::Relaxed);
    let stats = leader.join().unwrap().unwrap();
    assert_eq!((stats.requests, stats.batches), (2, 2));
    assert!(stats.syncs >= 1);
}

/// The leader counts itself only once its `fdatasync` is over: with one
/// follower holding the batch and a slow leader disk, the answer waits
/// for the leader's sync.
#[test]
fn the_leader_counts_itself_only_once_its_own_sync_is_done() {
    let delay = Duration::from_millis(400);
    let (addr, stop, leader, mut a, mut b) = leader_with_fake_followers("slowleader", delay);
    let mut client = TcpStream::connect(addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let sent = Instant::now();
    client.write_all(&acquire("k")).unwrap();
    assert_eq!(read_batch(&mut a).0, 1);
    assert_eq!(read_batch(&mut b).0, 1);
    a.write_all(&1u64.to_le_bytes()).unwrap();
    assert_eq!(read_reply(&mut client), acquired(1, "k"));
    assert!(
        sent.elapsed() >= Duration::from_millis(380),
        "answered after {:?}, before the leader's sync was over",
        sent.elapsed()
    );
    stop.store(true, Ordering::Relaxed);
    leader.join().unwrap().unwrap();
}

/// A follower acknowledges a batch only once an `fdatasync` that began
/// after the batch was written is over.
#[test]
fn a_follower_acknowledges_only_what_a_finished_sync_covered() {
    let delay = Duration::from_millis(600);
    let (addr, follower) = start_follower("slowfollower", delay);
    let mut leader = TcpStream::connect(addr).unwrap();
    leader
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    send_batch(&mut leader, 1, b"first");
    // Once batch 1 is in the file, its sync is asked for; batch 2
    // arrives while that sync is under way.
    let path = log_path("slowfollower");
    let t0 = Instant::now();
    while !std::fs::read(&path).is_ok_and(|d| d.starts_with(b"first")) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "batch 1 never written"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let written = Instant::now();
    std::thread::sleep(Duration::from_millis(200));
    send_batch(&mut leader, 2, b"second");
    assert_eq!(
        read_ack(&mut leader),
        1,
        "the first sync covers batch 1 only"
    );
    assert!(
        written.elapsed() >= Duration::from_millis(550),
        "acknowledged {:?} after the write, before its sync was over",
        written.elapsed()
    );
    assert_eq!(read_ack(&mut leader), 2);
    drop(leader);
    let (stats, log) = follower.join().unwrap().unwrap();
    assert_eq!(stats.batches, 2);
    assert_eq!(&log[..11], b"firstsecond");
}

/// A follower refuses batch numbers that do not increase.
#[test]
fn a_follower_refuses_a_batch_number_that_goes_back() {
    let (addr, follower) = start_follower("backwards", Duration::ZERO);
    let mut leader = TcpStream::connect(addr).unwrap();
    send_batch(&mut leader, 3, b"x");
    send_batch(&mut leader, 2, b"y");
    let e = follower.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("batch 2 came after batch 3"), "{e}");
}

/// A closed client's answer is dropped, never written to the next
/// connection that takes its slot.
#[test]
fn an_answer_for_a_closed_client_never_reaches_the_next_in_its_slot() {
    let (addr, stop, leader, mut a, mut b) = leader_with_fake_followers("reuse", Duration::ZERO);
    let mut first = TcpStream::connect(addr).unwrap();
    first.write_all(&acquire("one")).unwrap();
    assert_eq!(read_batch(&mut a).0, 1);
    assert_eq!(read_batch(&mut b).0, 1);
    drop(first);
    std::thread::sleep(Duration::from_millis(200));
    let mut second = TcpStream::connect(addr).unwrap();
    second
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    second.write_all(&acquire("two")).unwrap();
    assert_eq!(read_batch(&mut a).0, 2);
    assert_eq!(read_batch(&mut b).0, 2);
    a.write_all(&2u64.to_le_bytes()).unwrap();
    b.write_all(&2u64.to_le_bytes()).unwrap();
    assert_eq!(read_reply(&mut second), acquired(2, "two"));
    assert_silent(&mut second, 200);
    stop.store(true, Ordering::Relaxed);
    leader.join().unwrap().unwrap();
}

/// A follower that acknowledges a batch never sent stops the leader.
#[test]
fn an_acknowledgement_beyond_the_last_batch_is_an_error() {
    let (_addr, _stop, leader, mut a, _b) = leader_with_fake_followers("bogusack", Duration::ZERO);
    a.write_all(&5u64.to_le_bytes()).unwrap();
    let e = leader.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("only 0 were sent"), "{e}");
}

/// A forwarded frame over the limit stops the leader before it reads
/// the frame.
#[test]
fn a_forwarded_frame_over_the_limit_is_an_error() {
    let (_addr, _stop, leader, mut a, _b) =
        leader_with_fake_followers("bigforward", Duration::ZERO);
    let word = FORWARD_FLAG | (MAX_FORWARD_BYTES as u64 + 1);
    a.write_all(&word.to_le_bytes()).unwrap();
    let e = leader.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("over the limit"), "{e}");
}

/// Requests a follower forwards join the leader's batch; their answers
/// go back to that follower alone, in one frame, once two nodes hold
/// the batch, and not before.
#[test]
fn forwarded_requests_are_answered_to_their_follower_once_committed() {
    let (_addr, stop, leader, mut a, mut b) =
        leader_with_fake_followers("forwarded", Duration::from_millis(300));
    let mut reqs = acquire("f1");
    reqs.extend(acquire("f2"));
    let mut frame = (FORWARD_FLAG | reqs.len() as u64).to_le_bytes().to_vec();
    frame.extend_from_slice(&reqs);
    a.write_all(&frame).unwrap();
    assert_eq!(read_batch(&mut a), (1, reqs.clone()));
    assert_eq!(read_batch(&mut b), (1, reqs.clone()));
    // One follower's acknowledgement while the leader's own sync is
    // still under way (300 ms) is one node: nothing yet.
    b.write_all(&1u64.to_le_bytes()).unwrap();
    assert_silent(&mut a, 100);
    // The second follower makes two.
    a.write_all(&1u64.to_le_bytes()).unwrap();
    let mut want = acquired(1, "f1");
    want.extend(acquired(2, "f2"));
    assert_eq!(read_batch(&mut a), (RELAY_SEQ, want));
    assert_silent(&mut b, 200);
    stop.store(true, Ordering::Relaxed);
    assert_eq!(leader.join().unwrap().unwrap().requests, 2);
}

/// A follower with clients: it forwards their requests in one frame,
/// answers nobody until the leader's answers come, then passes each
/// answer to the client whose request it was.
#[test]
fn a_follower_forwards_its_clients_requests_and_passes_the_answers_on() {
    let (addr, caddr, follower) = start_serving_follower("serving");
    let mut leader = TcpStream::connect(addr).unwrap();
    leader
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let connect = || {
        let c = TcpStream::connect(caddr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c
    };
    let (mut one, mut two) = (connect(), connect());
    one.write_all(&acquire("one")).unwrap();
    let mut word = [0u8; 8];
    leader.read_exact(&mut word).unwrap();
    let word = u64::from_le_bytes(word);
    assert_eq!(word & FORWARD_FLAG, FORWARD_FLAG, "{word:#x}");
    let mut got = vec![0u8; (word & !FORWARD_FLAG) as usize];
    leader.read_exact(&mut got).unwrap();
    assert_eq!(got, acquire("one"));
    two.write_all(&acquire("two")).unwrap();
    leader.read_exact(&mut [0u8; 8]).unwrap();
    let mut got = vec![0u8; acquire("two").len()];
    leader.read_exact(&mut got).unwrap();
    assert_eq!(got, acquire("two"));
    assert_silent(&mut one, 100);
    // The batch holding both, acknowledged once synced; then the
    // answers, in the order forwarded.
    let mut both = acquire("one");
    both.extend(acquire("two"));
    send_batch(&mut leader, 1, &both);
    assert_eq!(read_ack(&mut leader), 1);
    assert_silent(&mut two, 100);
    let mut answers = acquired(8, "one");
    answers.extend(acquired(9, "two"));
    send_batch(&mut leader, RELAY_SEQ, &answers);
    assert_eq!(read_reply(&mut one), acquired(8, "one"));
    assert_eq!(read_reply(&mut two), acquired(9, "two"));
    // An answer nobody's request asked for is an error.
    send_batch(&mut leader, RELAY_SEQ, &acquired(10, "three"));
    let e = follower.join().unwrap().unwrap_err();
    assert!(e.to_string().contains("more answers than requests"), "{e}");
}

/// Three real nodes, several clients pipelining more than one batch
/// may hold: every request is answered, in order, each client's own,
/// and both followers' logs hold exactly the batches, back to back.
#[test]
fn three_nodes_answer_every_request_in_order_in_batches_within_the_limit() {
    three_nodes_answer_every_request(false);
}

/// The same with the clients spread over the three nodes: the
/// followers' own clients are answered too, each its own answers in
/// order, and every log holds every request.
#[test]
fn three_nodes_answer_every_request_with_clients_on_every_node() {
    three_nodes_answer_every_request(true);
}

fn three_nodes_answer_every_request(spread: bool) {
    let (fa, fb, a, b, served) = if spread {
        let (fa, fca, a) = start_serving_follower("s0");
        let (fb, fcb, b) = start_serving_follower("s1");
        (fa, fb, a, b, vec![fca, fcb])
    } else {
        let (fa, a) = start_follower("f0", Duration::ZERO);
        let (fb, b) = start_follower("f1", Duration::ZERO);
        (fa, fb, a, b, Vec::new())
    };
    let name = if spread { "leader3s" } else { "leader3" };
    let (addr, stop, leader) = start_leader(vec![fa, fb], name, Duration::ZERO);
    let mut targets = vec![addr];
    targets.extend(served);
    const CLIENTS: usize = 6;
    const EACH: usize = 2700;
    let mut clients: Vec<TcpStream> = (0..CLIENTS)
        .map(|i| {
            let c = TcpStream::connect(targets[i % targets.len()]).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            c
        })
        .collect();
    // Each client's requests at once: 6 × about 47 KiB, more than a
    // batch may hold (64 KiB in tests), less than a log (1 MiB).
    let sent: Vec<Vec<u8>> = (0..CLIENTS)
        .map(|c| {
            (0..EACH)
                .flat_map(|i| acquire(&format!("c{c}k{i}")))
                .collect()
        })
        .collect();
    for (c, bytes) in clients.iter_mut().zip(&sent) {
        c.write_all(bytes).unwrap();
    }
    let mut tokens = Vec::new();
    for (c, conn) in clients.iter_mut().enumerate() {
        tokens.extend(read_grants(c, conn, EACH));
    }
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), CLIENTS * EACH, "every token once");
    stop.store(true, Ordering::Relaxed);
    let stats = leader.join().unwrap().unwrap();
    assert_eq!(stats.requests, (CLIENTS * EACH) as u64);
    let total: usize = sent.iter().map(Vec::len).sum();
    assert!(
        stats.batches as usize >= total.div_ceil(MAX_BATCH_BYTES),
        "{stats:?}"
    );
    for f in [a, b] {
        // The leader is gone: the follower writes and syncs what it
        // read, then ends.
        let (fs, log) = f.join().unwrap().unwrap();
        assert_eq!(fs.batches, stats.batches, "{fs:?}");
        assert!(fs.syncs >= 1);
        check_log(&log, total, CLIENTS, EACH);
    }
}

/// Reads the `each` answers of client `c`, every one a grant of its
/// next key with a greater token than the last: the tokens.
fn read_grants(c: usize, conn: &mut TcpStream, each: usize) -> Vec<u64> {
    let mut tokens = Vec::new();
    let mut got = Vec::new();
    let mut chunk = [0u8; 65536];
    let mut answered = 0;
    let mut last = 0;
    while answered < each {
        let n = conn.read(&mut chunk).unwrap();
        assert!(n > 0, "the leader closed client {c}");
        got.extend_from_slice(&chunk[..n]);
        let mut at = 0;
        while let Decoded::Frame { frame, used } = proto::decode_reply(&got[at..], 1024) {
            let Reply::Acquired { token, key, .. } = frame else {
                panic!("{frame:?}")
            };
            assert_eq!(key, format!("c{c}k{answered}"));
            assert!(token > last, "tokens increase per client");
            last = token;
            tokens.push(token);
            answered += 1;
            at += used;
        }
        got.drain(..at);
    }
    tokens
}

/// Every request of `clients` clients sending `each`, each client's in
/// the order sent, back to back from the log's start; zeros after them.
fn check_log(log: &[u8], total: usize, clients: usize, each: usize) {
    let mut at = 0;
    let mut next = vec![0usize; clients];
    while let Decoded::Frame { frame, used } =
        proto::decode_request(&log[at..], DEFAULT_MAX_KEY_BYTES)
    {
        let Request::Acquire { key, .. } = frame else {
            panic!("{frame:?}")
        };
        let (c, i) = key[1..].split_once('k').unwrap();
        let c: usize = c.parse().unwrap();
        assert_eq!(i.parse::<usize>().unwrap(), next[c], "client {c}'s order");
        next[c] += 1;
        at += used;
    }
    assert_eq!(at, total);
    assert_eq!(next, vec![each; clients]);
    assert!(log[at..].iter().all(|&z| z == 0));
}

/// A client that reads its answers late still gets every one: answers
/// held back by its full socket go out as it drains.
#[test]
fn a_client_that_reads_late_gets_every_answer() {
    let (fa, a) = start_follower("late0", Duration::ZERO);
    let (fb, b) = start_follower("late1", Duration::ZERO);
    let (addr, stop, leader) = start_leader(vec![fa, fb], "late", Duration::ZERO);
    const N: usize = 150_000;
    let mut client = TcpStream::connect(addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut w = client.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        // About 9 MB of answers: more than the leader holds for one
        // client (4 MiB) plus what the sockets buffer.
        let all: Vec<u8> = (0..N)
            .flat_map(|i| acquire(&format!("late-key-{i:032}")))
            .collect();
        w.write_all(&all).unwrap();
    });
    std::thread::sleep(Duration::from_secs(1));
    let mut got = Vec::new();
    let mut chunk = [0u8; 65536];
    let mut answered = 0;
    while answered < N {
        let n = client.read(&mut chunk).unwrap();
        assert!(n > 0, "the leader closed the client");
        got.extend_from_slice(&chunk[..n]);
        let mut at = 0;
        while let Decoded::Frame { used, .. } = proto::decode_reply(&got[at..], 1024) {
            answered += 1;
            at += used;
        }
        got.drain(..at);
    }
    writer.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    assert_eq!(leader.join().unwrap().unwrap().requests, N as u64);
    a.join().unwrap().unwrap();
    b.join().unwrap().unwrap();
}

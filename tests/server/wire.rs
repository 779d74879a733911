//! The wire protocol as the server sees it (PROTOCOL §1): pipelining, framing
//! across reads, binary headers with 0x0A, out-of-order replies, and every
//! malformed case closing only its own connection.

use ticketd_testkit::process as common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::{acquire_frame, release_frame, Client, NoReply, Reply, Ticketd};

#[test]
fn the_spec_example_frame_is_answered_with_its_owner() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    c.send(&[
        0x41, 0x05, 0x1E, 0, 0, 0, 0, 0, 0, 0x0A, 0x0B, 0x64, 0x62, 0x0A,
    ]);
    match c.recv() {
        Reply::Acquired { owner, key, .. } => assert_eq!((owner, key.as_str()), (0x0A0B, "db")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn headers_full_of_0x0a_bytes_are_read_by_length_not_by_newline() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    // wait = lease = 10 = 0x0A, owner all 0x0A bytes.
    let owner = 0x0A0A_0A0A_0A0A_0A0A;
    let token = match c.acquire_reply("\u{a0}k", owner, 0x0A, 0x0A) {
        Reply::Acquired {
            token,
            owner: o,
            key,
        } => {
            assert_eq!((o, key.as_str()), (owner, "\u{a0}k"));
            token
        }
        other => panic!("{other:?}"),
    };
    // A release whose token is all 0x0A bytes, on a key nobody holds.
    assert_eq!(
        c.release_reply("x", owner),
        Reply::NotReleased {
            token: owner,
            key: "x".into()
        }
    );
    assert!(matches!(
        c.release_reply("\u{a0}k", token),
        Reply::Released { .. }
    ));
}

#[test]
fn a_queued_acquire_is_answered_after_a_later_release_on_the_same_connection() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let t1 = c.acquire_reply("k", 1, 0, 30).token();
    // Acquire (queued) then release, pipelined: the release's reply comes
    // first, the acquire's reply after it.
    let mut both = acquire_frame("k", 2, 10, 30);
    both.extend_from_slice(&release_frame("k", t1));
    c.send(&both);
    assert_eq!(
        c.recv(),
        Reply::Released {
            token: t1,
            key: "k".into()
        }
    );
    match c.recv() {
        Reply::Acquired {
            owner: 2, token, ..
        } => assert!(token > t1),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_thousand_frames_pipelined_in_one_write_get_a_thousand_replies_in_order() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let mut batch = Vec::new();
    for i in 0..1000u64 {
        batch.extend_from_slice(&acquire_frame(&format!("key-{i}"), i, 0, 30));
    }
    c.send(&batch);
    let mut last = 0;
    for i in 0..1000u64 {
        match c.recv() {
            Reply::Acquired { token, owner, key } => {
                assert_eq!((owner, key), (i, format!("key-{i}")));
                assert!(token > last);
                last = token;
            }
            other => panic!("frame {i}: {other:?}"),
        }
    }
}

#[test]
fn a_frame_sent_one_byte_at_a_time_is_assembled() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let mut frames = acquire_frame("slow", 0x0A, 0, 30);
    frames.extend_from_slice(&acquire_frame("slow", 0x0B, 0, 30));
    for b in &frames {
        c.stream.write_all(std::slice::from_ref(b)).unwrap();
        c.stream.flush().unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(matches!(c.recv(), Reply::Acquired { owner: 0x0A, .. }));
    assert!(matches!(c.recv(), Reply::Timeout { owner: 0x0B, .. }));
}

/// A malformed frame after a good one, in the same write: the good reply
/// arrives, then the connection closes; the log names the peer and reason;
/// the connection's queued acquire is cancelled; other connections go on.
fn malformed_case(bad: &[u8], reason: &str, extra_args: &[&str]) {
    let server = Ticketd::start(extra_args);
    let mut other = server.connect();
    let held = other.acquire_reply("held", 1, 0, 30).token();

    let mut bad_conn = server.connect();
    let peer = bad_conn.stream.local_addr().unwrap();
    // Queue on "held", get a grant on "mine", then the malformed frame.
    let mut bytes = acquire_frame("held", 2, 30, 30);
    bytes.extend_from_slice(&acquire_frame("mine", 3, 0, 30));
    bytes.extend_from_slice(bad);
    bytes.extend_from_slice(&acquire_frame("after", 4, 0, 30));
    bad_conn.send(&bytes);
    let mine = match bad_conn.recv() {
        Reply::Acquired {
            owner: 3, token, ..
        } => token,
        other => panic!("the reply before the malformed frame must be flushed: {other:?}"),
    };
    assert_eq!(
        bad_conn.try_recv(Duration::from_secs(3)),
        Err(NoReply::Closed),
        "closed after the flush, nothing after the malformed frame answered"
    );
    assert!(
        server.wait_for_log(
            &format!("closing {peer}: malformed frame: {reason}"),
            Duration::from_secs(2)
        ),
        "one log line with peer and reason:\n{}",
        server.log()
    );
    // The queued acquire was cancelled: releasing "held" hands it to nobody.
    assert!(matches!(
        other.release_reply("held", held),
        Reply::Released { .. }
    ));
    assert!(matches!(
        other.acquire_reply("held", 5, 0, 30),
        Reply::Acquired { .. }
    ));
    // The grant "mine" made before the bad frame still holds (locks are kept).
    assert!(matches!(
        other.acquire_reply("mine", 6, 0, 30),
        Reply::Timeout { .. }
    ));
    assert!(matches!(
        other.release_reply("mine", mine),
        Reply::Released { .. }
    ));
    // The frame after the malformed one was never handled.
    assert!(matches!(
        other.acquire_reply("after", 7, 0, 30),
        Reply::Acquired { .. }
    ));
    // And new connections are served.
    let mut fresh = server.connect();
    assert!(matches!(
        fresh.acquire_reply("z", 8, 0, 30),
        Reply::Acquired { .. }
    ));
}

#[test]
fn an_unknown_op_closes_only_that_connection() {
    malformed_case(b"X123\n", "unknown op byte 0x58", &[]);
}

#[test]
fn a_zero_lease_closes_only_that_connection() {
    let mut f = acquire_frame("k", 9, 1, 1);
    f[2] = 0;
    malformed_case(&f, "lease of 0 seconds", &[]);
}

#[test]
fn an_empty_key_closes_only_that_connection() {
    let mut f = release_frame("k", 9);
    f.remove(9);
    malformed_case(&f, "empty key", &[]);
}

#[test]
fn a_key_that_is_not_utf8_closes_only_that_connection() {
    let mut f = release_frame("kk", 9);
    f[9] = 0xFF;
    malformed_case(&f, "key is not valid UTF-8", &[]);
}

#[test]
fn a_key_longer_than_max_key_bytes_closes_only_that_connection() {
    let f = release_frame("123456789", 9);
    malformed_case(
        &f,
        "no newline within max_key_bytes",
        &["--max-key-bytes", "8"],
    );
}

#[test]
fn a_key_of_exactly_max_key_bytes_is_served() {
    let server = Ticketd::start(&["--max-key-bytes", "8"]);
    let mut c = server.connect();
    assert!(matches!(
        c.acquire_reply("12345678", 1, 0, 30),
        Reply::Acquired { .. }
    ));
}

#[test]
fn a_long_key_at_the_default_limit_is_served() {
    let server = Ticketd::start(&[]);
    let mut c = server.connect();
    let key = "k".repeat(1024);
    match c.acquire_reply(&key, 1, 0, 30) {
        Reply::Acquired { key: k, .. } => assert_eq!(k, key),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_half_sent_frame_is_closed_after_the_frame_timeout() {
    let server = Ticketd::start(&["--frame-timeout", "1"]);
    let mut idle = server.connect();
    let mut stuck = server.connect();
    let mut f = acquire_frame("k", 1, 0, 30);
    f.truncate(5);
    stuck.send(&f);
    let start = Instant::now();
    assert_eq!(stuck.try_recv(Duration::from_secs(4)), Err(NoReply::Closed));
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "closed too early: {took:?}"
    );
    // The log line is read from the server's stderr by another thread.
    assert!(
        server.wait_for_log("a frame half-sent", Duration::from_secs(5)),
        "{}",
        server.log()
    );
    // A connection with nothing half-sent is not a victim of the timeout.
    assert!(matches!(
        idle.acquire_reply("k", 2, 0, 30),
        Reply::Acquired { .. }
    ));
}

#[test]
fn a_connection_closed_by_the_peer_still_gets_the_replies_it_asked_for() {
    let server = Ticketd::start(&[]);
    let mut c = Client::connect(server.addr());
    c.acquire("k", 1, 0, 30);
    c.stream.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(matches!(c.recv(), Reply::Acquired { owner: 1, .. }));
    assert_eq!(c.try_recv(Duration::from_secs(2)), Err(NoReply::Closed));
}

#[test]
fn a_close_right_after_a_frame_on_a_busy_connection_is_noticed() {
    // The server stops reading after a short read and relies on the next
    // edge; a frame and the close arriving together are one edge, so the
    // close must still be read after the frame.
    let server = Ticketd::start(&[]);
    let mut c = Client::connect(server.addr());
    for i in 0..20u64 {
        c.acquire("k", i, 0, 30);
        let token = c.recv().token();
        c.release("k", token);
        assert!(matches!(c.recv(), Reply::Released { .. }));
    }
    c.acquire("k", 99, 0, 30);
    c.stream.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(matches!(c.recv(), Reply::Acquired { owner: 99, .. }));
    assert_eq!(c.try_recv(Duration::from_secs(2)), Err(NoReply::Closed));
}

/// A small deterministic generator, so a failure reproduces.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn random_bytes_on_many_connections_never_hurt_the_server() {
    let server = Ticketd::start(&["--max-key-bytes", "16"]);
    let mut good = server.connect();
    let held = good.acquire_reply("held", 1, 0, 60).token();
    let mut rng = XorShift(0x5EED_F00D_71C4_E7D1);
    let mut conns = Vec::new();
    for i in 0..200 {
        let mut c = server.connect();
        let len = (rng.next() % 600) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        // Half of them start with a valid frame, so some junk is parsed deep.
        if i % 2 == 0 {
            // wait 0: nothing queues, so nothing outlives the connection.
            let mut f = acquire_frame("held", 100 + i, 0, 1);
            f.extend_from_slice(&bytes);
            bytes = f;
        }
        c.send(&bytes);
        conns.push(c);
    }
    // Every connection ends up closed or idle; none gets a reply it did not
    // ask for in a form that does not decode (Client::recv would panic).
    for c in &mut conns {
        while let Ok(r) = c.try_recv(Duration::from_millis(20)) {
            assert!(matches!(
                r,
                Reply::Acquired { .. }
                    | Reply::Timeout { .. }
                    | Reply::Busy { .. }
                    | Reply::Released { .. }
                    | Reply::NotReleased { .. }
            ));
        }
    }
    drop(conns);
    // The good connection and the lock it holds are untouched.
    assert!(matches!(
        good.acquire_reply("held", 2, 0, 30),
        Reply::Timeout { .. }
    ));
    assert!(matches!(
        good.release_reply("held", held),
        Reply::Released { .. }
    ));
    let mut fresh = server.connect();
    assert!(matches!(
        fresh.acquire_reply("held", 3, 0, 30),
        Reply::Acquired { .. }
    ));
    assert!(!server.log().contains("panicked"), "{}", server.log());
}

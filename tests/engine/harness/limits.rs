//! Limits on in-memory connections: output limits, `--max-conns`, the frame
//! timeout, and a command line's limits applied as the binary applies them.

use super::*;

#[test]
fn a_client_that_does_not_read_is_paused_at_the_soft_limit_and_closed_at_the_hard_limit() {
    a_client_that_does_not_read_is_paused_and_resumes();
    a_client_that_never_reads_is_closed_at_the_hard_limit();
}

/// The soft limit: a client that does not read is paused while others are
/// served, and resumes once it reads.
fn a_client_that_does_not_read_is_paused_and_resumes() {
    let config = Config {
        max_key_bytes: 32,
        out_soft_limit_bytes: 1024,
        out_hard_limit_bytes: 4096,
        ..Config::default()
    };
    let mut h = sequential_harness(config).unwrap();
    h.set_pipe_capacity(512);
    let mut reader = h.connect();
    let mut sink = h.connect();
    // 400 acquires of fresh keys: far more replies than the pipe and the
    // soft limit hold together.
    let mut frames = Vec::new();
    for i in 0..400u64 {
        frames.extend(acquire(&format!("key-{i:03}"), i + 1, 0, 30));
    }
    let mut sent = 0;
    for _ in 0..50 {
        sent += sink.write(&frames[sent..]);
        h.run_until_idle();
    }
    // Paused: the server stopped reading with replies unsent, so the
    // client's bytes back up in the pipe (the kernel's push-back on TCP).
    assert!(sent < frames.len(), "the server stopped taking requests");
    assert!(sink.unread_by_server() > 0);
    assert_eq!(h.stats().limit_closes, 0, "paused, not closed");
    let granted = h.service().engine().key_count();
    assert!(granted < 400, "{granted} keys granted before the pause");
    // The other connection is served meanwhile.
    reader.write(&acquire("db", 1000, 0, 5));
    h.run_until_idle();
    assert_eq!(reader.take()[0], b'A');
    // Reading drains the backlog; the server resumes and handles the rest.
    let mut got = Vec::new();
    for _ in 0..200 {
        sink.read(&mut got);
        sent += sink.write(&frames[sent..]);
        h.run_until_idle();
    }
    sink.read(&mut got);
    assert_eq!(sent, frames.len());
    assert_eq!(replies(&got).len(), 400, "every request answered once");
    assert_eq!(h.stats().limit_closes, 0);
    drop(sink);
}

/// The hard limit, past the soft one: a client that never reads is closed.
fn a_client_that_never_reads_is_closed_at_the_hard_limit() {
    // The hard limit: replies the client did not ask for in this turn (its
    // queued acquires timing out together) push the unsent bytes past it,
    // and a client that never reads is closed, its unsent replies dropped.
    let config = Config {
        max_key_bytes: 32,
        out_soft_limit_bytes: 1024,
        out_hard_limit_bytes: 1100,
        ..Config::default()
    };
    let mut h = sequential_harness(config).unwrap();
    let mut holder = h.connect();
    h.set_pipe_capacity(256);
    let mut sink = h.connect();
    let mut held = Vec::new();
    let mut queued = Vec::new();
    for i in 0..200u64 {
        held.extend(acquire(&format!("key-{i:03}"), i + 1, 0, 30));
        queued.extend(acquire(&format!("key-{i:03}"), 1000 + i, 1, 30));
    }
    assert_eq!(holder.write(&held), held.len());
    h.run_until_idle();
    let mut sent = 0;
    for _ in 0..50 {
        let _ = holder.take();
        sent += sink.write(&queued[sent..]);
        h.run_until_idle();
    }
    assert_eq!(sent, queued.len());
    assert_eq!(h.service().engine().waiter_count(), 200);
    assert_eq!(h.stats().limit_closes, 0);
    h.advance(Duration::from_millis(1000));
    h.run_until_idle();
    assert_eq!(h.stats().limit_closes, 1, "closed at the hard limit");
    assert!(sink.is_gone());
    assert_eq!(h.connection_count(), 1, "the holder stays");
    assert_eq!(
        h.service().engine().key_count(),
        200,
        "a close releases nothing"
    );
}

#[test]
fn connections_over_max_conns_are_closed_at_once() {
    let config = Config {
        max_conns: 2,
        ..Config::default()
    };
    let mut h = sequential_harness(config).unwrap();
    let (_a, a) = h.connect_with_id();
    let (_b, b) = h.connect_with_id();
    let (c, none) = h.connect_with_id();
    assert!(a.is_some() && b.is_some() && a != b);
    assert_eq!(none, None);
    assert!(c.is_closed_by_server());
    assert_eq!((h.stats().accepted, h.stats().refused), (2, 1));
}

#[test]
fn a_frame_half_sent_for_the_frame_timeout_closes_the_connection_on_the_manual_clock() {
    let config = Config {
        frame_timeout: Some(Duration::from_secs(2)),
        ..Config::default()
    };
    let mut h = sequential_harness(config).unwrap();
    let mut c = h.connect();
    let frame = acquire("db", 1, 0, 5);
    c.write(&frame[..6]);
    h.run_until_idle();
    h.advance(Duration::from_millis(1999));
    h.run_until_idle();
    assert!(!c.is_closed_by_server(), "not yet");
    assert_eq!(h.stats().limit_closes, 0);
    // The scan runs once a second: by 3 s it has seen 2 s of a half frame.
    h.advance(Duration::from_millis(1001));
    h.run_until_idle();
    assert!(c.is_closed_by_server(), "closed for the half-sent frame");
    assert_eq!(h.stats().limit_closes, 1);
    assert_eq!(h.service().engine().key_count(), 0, "never handled");
}

/// The kind of each reply in `bytes` (`A`, `T`, `B`, `R`, `N`, `E`, `X`)
/// and, for `A`, its token: what two servers with different token bases
/// must agree on.
fn kinds(bytes: &[u8]) -> (String, Vec<u64>) {
    let mut kinds = String::new();
    let mut tokens = Vec::new();
    let mut at = 0;
    while let Decoded::Frame { frame, used } = proto::decode_reply(&bytes[at..], 1024) {
        let (k, token) = match frame {
            Reply::Acquired { token, .. } => ('A', Some(token)),
            Reply::Timeout { .. } => ('T', None),
            Reply::Busy { .. } => ('B', None),
            Reply::Released { .. } => ('R', None),
            Reply::NotReleased { .. } => ('N', None),
            Reply::Extended { .. } => ('E', None),
            Reply::NotExtended { .. } => ('X', None),
            Reply::LimitMismatch { .. } => ('L', None),
        };
        kinds.push(k);
        tokens.extend(token);
        at += used;
    }
    assert_eq!(at, bytes.len(), "whole replies only: {bytes:?}");
    (kinds, tokens)
}

/// Writes frames expecting this many replies; returns the bytes read back
/// and whether the server closed the connection.
type Send<'a> = dyn FnMut(&[u8], usize) -> (Vec<u8>, bool) + 'a;

/// The steps both play: each sends its frames on one connection and
/// returns what came back; the extends use the token the first acquire got.
fn limits_script(send: &mut Send<'_>) -> Vec<String> {
    let mut got = Vec::new();
    // A lease of 3 s is granted, 4 s is over --max-lease: Busy.
    let (b, _) = send(
        &[acquire("db", 1, 0, 3), acquire("queue", 2, 0, 4)].concat(),
        2,
    );
    let (k, tokens) = kinds(&b);
    got.push(k);
    let t = tokens[0];
    // Extend (protocol 1.1) by 3 s: E; by 4 s, over the cap: X; the
    // refused extend leaves the key held (a second acquire: T).
    let (b, _) = send(
        &[
            extend("db", t, 3),
            extend("db", t, 4),
            acquire("db", 3, 0, 3),
            release("db", t),
        ]
        .concat(),
        4,
    );
    got.push(kinds(&b).0);
    // A 17-byte key is over --max-key-bytes: malformed, the connection
    // is closed after the replies before it.
    let (b, closed) = send(
        &[
            acquire("cache", 4, 0, 1),
            acquire("k".repeat(17).as_str(), 5, 0, 1),
        ]
        .concat(),
        2,
    );
    got.push(format!("{} closed={closed}", kinds(&b).0));
    got
}

#[test]
fn the_harness_applies_a_command_lines_limits_as_the_ticketd_binary_does() {
    // One command line for both: the longest lease, the key limit.
    let args = ["--max-lease", "3", "--max-key-bytes", "16"];
    let ticketd::config::Parsed::Run(config) =
        ticketd::config::parse_args(args.iter().map(Into::into).collect()).expect("parses")
    else {
        panic!("not a run");
    };
    let mut h = Harness::new(config).expect("harness");
    let mut conn = h.connect();
    let mem = limits_script(&mut |frames: &[u8], _| {
        assert_eq!(conn.write(frames), frames.len());
        h.run_until_idle();
        (conn.take(), conn.is_closed_by_server())
    });

    let server = ticketd_testkit::process::Ticketd::start(&args);
    let mut s = TcpStream::connect(server.addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let real = limits_script(&mut |frames: &[u8], want: usize| {
        s.write_all(frames).expect("write");
        // A reply to each frame, or EOF (the malformed-frame close).
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        let mut closed = false;
        while replies(&got)
            .iter()
            .filter(|r| !r.starts_with("incomplete"))
            .count()
            < want
        {
            match s.read(&mut chunk) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => got.extend_from_slice(&chunk[..n]),
                Err(e) => panic!("read: {e}"),
            }
        }
        (got, closed)
    });
    assert_eq!(
        mem,
        vec!["AB", "EXTR", "A closed=true"],
        "the harness: {mem:?}"
    );
    assert_eq!(mem, real, "the harness and ticketd differ");
}

//! The server's limits, each against the real binary: connections, file
//! descriptors, output buffers (soft: backpressure, hard: close), fairness.

use ticketd_testkit::process as common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{acquire_frame, Client, NoReply, Reply, Ticketd};

/// Lets this test process open a few thousand sockets.
fn raise_own_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read or write only the struct passed.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max.min(8192);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
}

#[test]
fn a_thousand_simultaneous_connections_are_all_served() {
    raise_own_fd_limit();
    let server = Ticketd::start(&[]);
    let mut conns: Vec<Client> = (0..1000).map(|_| server.connect()).collect();
    for (i, c) in conns.iter_mut().enumerate() {
        c.acquire(&format!("k{i}"), i as u64, 0, 30);
    }
    for (i, c) in conns.iter_mut().enumerate() {
        match c.recv() {
            Reply::Acquired { owner, .. } => assert_eq!(owner, i as u64),
            other => panic!("connection {i}: {other:?}"),
        }
    }
    // Still all open: one more round on each.
    for (i, c) in conns.iter_mut().enumerate() {
        assert!(matches!(
            c.acquire_reply(&format!("k{i}"), 0, 0, 30),
            Reply::Timeout { .. }
        ));
    }
}

#[test]
fn over_max_conns_a_connection_is_closed_at_once_and_logged() {
    let server = Ticketd::start(&["--max-conns", "3"]);
    let mut kept: Vec<Client> = (0..3).map(|_| server.connect()).collect();
    for (i, c) in kept.iter_mut().enumerate() {
        assert!(matches!(
            c.acquire_reply(&format!("k{i}"), 1, 0, 30),
            Reply::Acquired { .. }
        ));
    }
    let mut extra = server.connect();
    extra.acquire("x", 9, 0, 30);
    assert_eq!(extra.try_recv(Duration::from_secs(3)), Err(NoReply::Closed));
    assert!(server.wait_for_log("--max-conns", Duration::from_secs(2)));
    // Room again after one closes.
    drop(kept.pop());
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let mut c = server.connect();
        c.acquire("x", 10, 0, 30);
        match c.try_recv(Duration::from_secs(1)) {
            Ok(r) => {
                assert!(matches!(r, Reply::Acquired { owner: 10, .. }));
                break;
            }
            Err(_) => assert!(Instant::now() < deadline, "never served after a slot freed"),
        }
    }
}

#[test]
fn out_of_file_descriptors_accepting_pauses_without_spinning_and_resumes() {
    raise_own_fd_limit();
    // prlimit execs ticketd with at most 32 descriptors, far below --max-conns.
    let server = Ticketd::start_raw(
        &["prlimit", "--nofile=32:32"],
        &["--listen", "127.0.0.1:0", "--max-conns", "1000"],
    );
    let mut conns: Vec<Client> = (0..60).map(|_| server.connect()).collect();
    for (i, c) in conns.iter_mut().enumerate() {
        c.acquire(&format!("k{i}"), i as u64, 0, 30);
    }
    let mut served = Vec::new();
    for (i, c) in conns.iter_mut().enumerate() {
        if let Ok(r) = c.try_recv(Duration::from_millis(if i == 0 { 2000 } else { 100 })) {
            assert!(matches!(r, Reply::Acquired { .. }));
            served.push(i);
        }
    }
    assert!(
        !served.is_empty() && served.len() < 60,
        "served {}",
        served.len()
    );
    assert!(
        server.wait_for_log("out of file descriptors", Duration::from_secs(2)),
        "{}",
        server.log()
    );
    // Pending connections wait in the backlog; the loop must not spin on them.
    let cpu_before = server.cpu_ticks();
    std::thread::sleep(Duration::from_secs(1));
    let cpu_used = server.cpu_ticks() - cpu_before;
    assert!(
        cpu_used < 30,
        "{cpu_used} ticks of CPU in 1 s while out of descriptors"
    );
    // Free the descriptors of the served connections: the rest get served.
    let mut waiting: Vec<(usize, Client)> = conns
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !served.contains(i))
        .collect();
    for (i, c) in &mut waiting {
        match c.try_recv(Duration::from_secs(5)) {
            Ok(Reply::Acquired { owner, .. }) => assert_eq!(owner, *i as u64),
            other => panic!("connection {i} after descriptors freed: {other:?}"),
        }
        // Keep freeing: each one served may take another descriptor.
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Writes acquires on a held key, never reading, until the socket stays
/// blocked for a while. Returns the bytes written.
fn flood_without_reading(stream: &mut TcpStream, max_bytes: usize) -> usize {
    let frame = acquire_frame("held", 7, 0, 30);
    let batch: Vec<u8> = frame
        .iter()
        .copied()
        .cycle()
        .take(frame.len() * 5000)
        .collect();
    stream
        .set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut sent = 0;
    while sent < max_bytes {
        match stream.write(&batch) {
            Ok(n) => sent += n,
            // A signal reached this process before anything was written (a
            // socket with a send timeout is never restarted): write again.
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
            // The server closed it (a test with a short --frame-timeout on a
            // slow machine): the flood is over too; the caller checks why.
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
                break
            }
            Err(e) => panic!("flood write failed: {e}"),
        }
    }
    sent
}

#[test]
fn a_client_that_pipelines_without_reading_does_not_grow_server_memory() {
    let server = Ticketd::start(&[]);
    let mut holder = server.connect();
    holder.acquire_reply("held", 1, 0, 60);
    // Warm up the allocator and buffers a little.
    for i in 0..100 {
        holder.acquire_reply("held", i, 0, 60);
    }
    let rss_before = server.rss_kib();
    let mut flooder = TcpStream::connect(server.addr()).unwrap();
    let sent = flood_without_reading(&mut flooder, 200 << 20);
    std::thread::sleep(Duration::from_millis(300));
    let rss_after = server.rss_kib();
    // The server read only until its output for this client reached the soft
    // limit (64 KiB); the rest of the flood waits in kernel buffers.
    assert!(sent > 1 << 20, "the flood stopped early: {sent} bytes");
    let grown = rss_after.saturating_sub(rss_before);
    eprintln!("flood {sent} bytes; server RSS {rss_before} KiB -> {rss_after} KiB");
    assert!(
        grown < 2048,
        "server grew {grown} KiB under a {sent}-byte flood"
    );
    // The server still answers others at once.
    let start = Instant::now();
    assert!(matches!(
        holder.acquire_reply("other", 2, 0, 30),
        Reply::Acquired { .. }
    ));
    assert!(start.elapsed() < Duration::from_secs(1));
    // Once the flooder reads, the server resumes it: replies keep coming.
    let mut buf = vec![0u8; 1 << 16];
    flooder
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut got = 0usize;
    while got < 1 << 20 {
        let n = flooder.read(&mut buf).expect("replies keep coming");
        assert!(n > 0);
        got += n;
    }
}

#[test]
fn unread_replies_over_the_hard_limit_close_the_connection() {
    let server = Ticketd::start(&[
        "--out-soft-limit",
        "2048",
        "--out-hard-limit",
        "8192",
        "--max-waiters-per-key",
        "5000",
    ]);
    let mut holder = server.connect();
    holder.acquire_reply("held", 1, 0, 60);
    let mut tokens = Vec::new();
    for i in 0..2000u64 {
        tokens.push(holder.acquire_reply(&format!("k{i}"), i, 0, 60).token());
    }
    let mut flooder = TcpStream::connect(server.addr()).unwrap();
    // 2000 acquires queued behind the holder...
    let queued: Vec<u8> = (0..2000u64)
        .flat_map(|i| acquire_frame(&format!("k{i}"), 100 + i, 60, 30))
        .collect();
    flooder.write_all(&queued).unwrap();
    // ...then fill every buffer with replies the client never reads.
    let sent = flood_without_reading(&mut flooder, 200 << 20);
    assert!(sent > 1 << 20);
    assert!(!server.log().contains("over --out-hard-limit"));
    // 2000 grants land on a full output buffer: over the hard limit.
    let releases: Vec<u8> = tokens
        .iter()
        .enumerate()
        .flat_map(|(i, &t)| common::release_frame(&format!("k{i}"), t))
        .collect();
    holder.send(&releases);
    for r in holder.recv_n(2000) {
        assert!(matches!(r, Reply::Released { .. }), "{r:?}");
    }
    assert!(
        server.wait_for_log("over --out-hard-limit", Duration::from_secs(5)),
        "{}",
        server.log()
    );
    // Only that connection: the server serves others.
    assert!(matches!(
        holder.acquire_reply("other", 2, 0, 30),
        Reply::Acquired { .. }
    ));
}

#[test]
fn one_pipelining_connection_does_not_starve_another() {
    let server = Ticketd::start(&["--max-frames-per-turn", "1"]);
    let mut flooder = server.connect();
    flooder.acquire_reply("held", 1, 0, 60);
    let frames = 20_000usize;
    let batch: Vec<u8> = (0..frames)
        .flat_map(|_| acquire_frame("held", 2, 0, 30))
        .collect();
    let mut writer = flooder.stream.try_clone().unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let read_bytes = Arc::new(AtomicU64::new(0));
    let (d, r) = (Arc::clone(&done), Arc::clone(&read_bytes));
    let mut reader = flooder.stream.try_clone().unwrap();
    let reader_thread = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        reader
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        while !d.load(Ordering::SeqCst) {
            if let Ok(n) = reader.read(&mut buf) {
                r.fetch_add(n as u64, Ordering::SeqCst);
            }
        }
    });
    writer.write_all(&batch).unwrap();
    let mut other = server.connect();
    other.acquire_reply("mine", 3, 0, 30);
    // One frame per turn for the flooder: the other connection's reply comes
    // long before the flood is through.
    let flood_replies = read_bytes.load(Ordering::SeqCst) / 11;
    done.store(true, Ordering::SeqCst);
    reader_thread.join().unwrap();
    assert!(
        (flood_replies as usize) < frames / 2,
        "{flood_replies} of {frames} flood replies were sent before the other client's one"
    );
}

#[test]
fn replies_left_unread_for_the_frame_timeout_close_the_connection() {
    let server = Ticketd::start(&["--frame-timeout", "1"]);
    let mut holder = server.connect();
    holder.acquire_reply("held", 1, 0, 60);
    let mut flooder = TcpStream::connect(server.addr()).unwrap();
    let sent = flood_without_reading(&mut flooder, 200 << 20);
    assert!(sent > 1 << 20);
    assert!(
        server.wait_for_log("unread replies for --frame-timeout", Duration::from_secs(4)),
        "{}",
        server.log()
    );
    // The reader that does read is not affected.
    assert!(matches!(
        holder.acquire_reply("other", 2, 0, 30),
        Reply::Acquired { .. }
    ));
}

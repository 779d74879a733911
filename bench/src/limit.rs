//! The limit server: the ceiling of ticketd's protocol on this machine.
//!
//! It is ticketd's shape without the lock: one thread, one `mio` loop, a slab
//! of connections with read and write buffers, frames decoded with
//! [`ticketd::proto`]. Every Acquire is answered `A` with a new token at once
//! and every Release `R`, without looking anything up. Its throughput is the
//! most any server of this protocol can do here, so ticketd's distance to it
//! is what the lock engine costs.

use std::io;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};

use mio::{Events, Interest, Poll, Token};
use slab::Slab;

use super::conn::BufferedConn;
use ticketd::limits::DEFAULT_MAX_KEY_BYTES;
use ticketd::proto::{self, Decoded, Reply, Request};

const LISTENER: Token = Token(usize::MAX - 1);
/// Stop reading a connection while this many reply bytes wait to be sent.
const MAX_PENDING_REPLY_BYTES: usize = 4 << 20;
/// Read at most this much from one connection per turn, for fairness.
const READ_PER_TURN_BYTES: usize = 256 * 1024;
/// Counts what the limit server answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitStats {
    /// Requests answered.
    pub requests: u64,
    /// Connections accepted.
    pub connections: u64,
}

enum Step {
    Open,
    Close,
}

/// Reads and answers what `conn` has sent (see [`BufferedConn::fill`] for
/// when it stops reading).
fn read_and_answer(conn: &mut BufferedConn, next_token: &mut u64, stats: &mut LimitStats) -> Step {
    match conn.fill(READ_PER_TURN_BYTES, MAX_PENDING_REPLY_BYTES) {
        Ok(true) => {}
        Ok(false) | Err(_) => return Step::Close,
    }
    let mut at = 0;
    loop {
        match proto::decode_request(&conn.input.data()[at..], DEFAULT_MAX_KEY_BYTES) {
            Decoded::Incomplete => break,
            Decoded::Malformed(_) => return Step::Close,
            Decoded::Frame { frame, used } => {
                at += used;
                stats.requests += 1;
                answer(frame, next_token, &mut conn.wbuf);
            }
        }
    }
    conn.consumed(at);
    Step::Open
}

/// The limit's answer to `req`, looked up nowhere: `A` with the next
/// token, `R`, `E`. The cluster limit answers the same way.
pub(crate) fn answer(req: Request<'_>, next_token: &mut u64, out: &mut Vec<u8>) {
    let reply = match req {
        Request::Acquire { owner, key, .. } | Request::AcquireWithLimit { owner, key, .. } => {
            *next_token += 1;
            Reply::Acquired {
                token: *next_token,
                owner,
                key,
            }
        }
        Request::Release { token, key } => Reply::Released { token, key },
        Request::Extend { token, key, .. } => Reply::Extended { token, key },
    };
    proto::encode_reply(&reply, out);
}

/// Serves `listener` until `stop` is set (checked at least every 100 ms, and
/// at once when a signal interrupts the poll). Returns what it answered.
pub fn serve(listener: TcpListener, stop: &AtomicBool) -> io::Result<LimitStats> {
    listener.set_nonblocking(true)?;
    let mut listener = mio::net::TcpListener::from_std(listener);
    let mut poll = Poll::new()?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let mut conns: Slab<BufferedConn> = Slab::new();
    let mut events = Events::with_capacity(1024);
    let mut stats = LimitStats::default();
    let mut next_token = 0u64;
    let mut touched: Vec<usize> = Vec::new();
    let mut to_close: Vec<usize> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let backlog = conns.iter().any(|(_, c)| c.more_to_read);
        if !super::conn::wait(&mut poll, &mut events, backlog)? {
            continue;
        }
        touched.clear();
        for ev in &events {
            if ev.token() == LISTENER {
                loop {
                    match listener.accept() {
                        Ok((mut stream, _)) => {
                            let _ = stream.set_nodelay(true);
                            let entry = conns.vacant_entry();
                            let key = entry.key();
                            poll.registry().register(
                                &mut stream,
                                Token(key),
                                Interest::READABLE,
                            )?;
                            entry.insert(BufferedConn::new(stream));
                            stats.connections += 1;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        // Out of descriptors and the like: try again next turn.
                        Err(_) => break,
                    }
                }
            } else if let Some(c) = conns.get_mut(ev.token().0) {
                c.note_event(ev);
                touched.push(ev.token().0);
            }
        }
        for (k, c) in conns.iter() {
            if c.more_to_read {
                touched.push(k);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for &k in &touched {
            let conn = &mut conns[k];
            if let Step::Close = read_and_answer(conn, &mut next_token, &mut stats) {
                to_close.push(k);
                continue;
            }
            if conn.flush(poll.registry(), Token(k)).is_err() {
                to_close.push(k);
            }
        }
        for k in to_close.drain(..) {
            let mut c = conns.remove(k);
            let _ = poll.registry().deregister(&mut c.stream);
        }
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::Arc;
    use std::time::Duration;

    type Running = std::thread::JoinHandle<io::Result<LimitStats>>;

    /// Serves on a free loopback port in a thread; set the flag to stop it.
    fn start() -> (std::net::SocketAddr, Arc<AtomicBool>, Running) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let server = std::thread::spawn(move || serve(listener, &stop2));
        (addr, stop, server)
    }

    #[test]
    fn answers_pipelined_frames_with_same_shaped_replies() {
        let (addr, stop, server) = start();

        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut out = Vec::new();
        proto::encode_request(
            &Request::Acquire {
                wait_s: 5,
                lease_s: 30,
                owner: 0x0A0B,
                key: "db",
            },
            &mut out,
        );
        proto::encode_request(
            &Request::Release {
                token: 77,
                key: "db",
            },
            &mut out,
        );
        s.write_all(&out).unwrap();
        let mut got = Vec::new();
        let mut chunk = [0u8; 256];
        let want_len = 18 + 2 + 10 + 2;
        while got.len() < want_len {
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0, "limit server closed early");
            got.extend_from_slice(&chunk[..n]);
        }
        let Decoded::Frame { frame, used } = proto::decode_reply(&got, 1024) else {
            panic!("no reply frame in {got:?}");
        };
        assert_eq!(
            frame,
            Reply::Acquired {
                token: 1,
                owner: 0x0A0B,
                key: "db"
            }
        );
        assert_eq!(
            proto::decode_reply(&got[used..], 1024),
            Decoded::Frame {
                frame: Reply::Released {
                    token: 77,
                    key: "db"
                },
                used: 12
            }
        );

        // A malformed frame closes that connection and nothing else.
        let mut bad = std::net::TcpStream::connect(addr).unwrap();
        bad.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        bad.write_all(b"Xjunk\n").unwrap();
        assert_eq!(bad.read(&mut chunk).unwrap(), 0);
        s.write_all(&out[..14]).unwrap();
        let n = s.read(&mut chunk).unwrap();
        assert_eq!(chunk[0], b'A');
        assert!(n >= 20);

        stop.store(true, Ordering::Relaxed);
        let stats = server.join().unwrap().unwrap();
        assert_eq!(stats.requests, 3);
        assert_eq!(stats.connections, 2);
    }

    /// After a short read the server stops reading until the next edge:
    /// bytes that trickle in later, one write at a time, must still each
    /// raise one, so a frame sent a byte at a time is answered.
    #[test]
    fn a_frame_sent_byte_by_byte_is_answered() {
        let (addr, stop, server) = start();

        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut out = Vec::new();
        for token in [5, 6] {
            proto::encode_request(&Request::Release { token, key: "k" }, &mut out);
        }
        for b in &out {
            s.write_all(std::slice::from_ref(b)).unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut got = Vec::new();
        let mut chunk = [0u8; 64];
        while got.len() < 22 {
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0, "limit server closed early");
            got.extend_from_slice(&chunk[..n]);
        }
        let mut want = Vec::new();
        for token in [5, 6] {
            proto::encode_reply(&Reply::Released { token, key: "k" }, &mut want);
        }
        assert_eq!(got, want);

        stop.store(true, Ordering::Relaxed);
        let stats = server.join().unwrap().unwrap();
        assert_eq!(stats.requests, 2);
    }
}

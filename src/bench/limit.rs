//! The limit server: the ceiling of ticketd's protocol on this machine.
//!
//! It is ticketd's shape without the lock: one thread, one `mio` loop, a slab
//! of connections with read and write buffers, frames decoded with
//! [`crate::proto`]. Every Acquire is answered `A` with a new token at once
//! and every Release `R`, without looking anything up. Its throughput is the
//! most any server of this protocol can do here, so ticketd's distance to it
//! is what the lock engine costs.

use std::io::{self, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use mio::{Events, Interest, Poll, Token};
use slab::Slab;

use super::{make_read_room, set_write_interest};
use crate::limits::DEFAULT_MAX_KEY_BYTES;
use crate::proto::{self, Decoded, Reply, Request};

const LISTENER: Token = Token(usize::MAX - 1);
/// Stop reading a connection while this many reply bytes wait to be sent.
const MAX_PENDING_REPLY_BYTES: usize = 4 << 20;
/// Read at most this much from one connection per turn, for fairness.
const READ_PER_TURN_BYTES: usize = 256 * 1024;
struct Conn {
    stream: mio::net::TcpStream,
    /// Read buffer, zeroed once when it grows; `rstart..rend` is unparsed.
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    wbuf: Vec<u8>,
    wpos: usize,
    want_write: bool,
    /// Unread input may remain in the socket (fairness cap or back-pressure).
    more_to_read: bool,
    /// A readiness event said there is input (or a close) not yet read.
    readable: bool,
    /// Read until `WouldBlock` even after a short read: set on accept and
    /// when an event reported the peer's close or an error, whose edge has
    /// then been consumed and will not come again (ticketd's rule).
    drain: bool,
}

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

/// Reads and answers what `conn` has sent. Like ticketd, it stops after a
/// short read: with edge-triggered epoll any byte that arrives later raises
/// a new edge, so the read that would only say `WouldBlock` is skipped (one
/// system call less per request at pipeline depth 1), unless `drain` says
/// a close or error was reported whose edge will not come again.
fn read_and_answer(conn: &mut Conn, next_token: &mut u64, stats: &mut LimitStats) -> Step {
    let mut read_bytes = 0;
    conn.more_to_read = false;
    loop {
        if !conn.readable {
            return Step::Open;
        }
        if conn.wbuf.len() - conn.wpos > MAX_PENDING_REPLY_BYTES
            || read_bytes >= READ_PER_TURN_BYTES
        {
            conn.more_to_read = true;
            return Step::Open;
        }
        make_read_room(&mut conn.rbuf, &mut conn.rstart, &mut conn.rend);
        let rend = conn.rend;
        let offered = conn.rbuf.len() - rend;
        match conn.stream.read(&mut conn.rbuf[rend..]) {
            Ok(0) => return Step::Close,
            Ok(n) => {
                if n < offered && !conn.drain {
                    conn.readable = false;
                }
                read_bytes += n;
                conn.rend += n;
                let mut at = conn.rstart;
                loop {
                    match proto::decode_request(&conn.rbuf[at..conn.rend], DEFAULT_MAX_KEY_BYTES) {
                        Decoded::Incomplete => break,
                        Decoded::Malformed(_) => return Step::Close,
                        Decoded::Frame { frame, used } => {
                            at += used;
                            stats.requests += 1;
                            let reply = match frame {
                                Request::Acquire { owner, key, .. } => {
                                    *next_token += 1;
                                    Reply::Acquired {
                                        token: *next_token,
                                        owner,
                                        key,
                                    }
                                }
                                Request::Release { token, key } => Reply::Released { token, key },
                            };
                            proto::encode_reply(&reply, &mut conn.wbuf);
                        }
                    }
                }
                conn.rstart = at;
                if conn.rstart == conn.rend {
                    conn.rstart = 0;
                    conn.rend = 0;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                conn.readable = false;
                conn.drain = false;
                return Step::Open;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Step::Close,
        }
    }
}

fn flush(conn: &mut Conn) -> io::Result<()> {
    while conn.wpos < conn.wbuf.len() {
        match conn.stream.write(&conn.wbuf[conn.wpos..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => conn.wpos += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    conn.wbuf.clear();
    conn.wpos = 0;
    Ok(())
}

/// Serves `listener` until `stop` is set (checked at least every 100 ms, and
/// at once when a signal interrupts the poll). Returns what it answered.
pub fn serve(listener: TcpListener, stop: &AtomicBool) -> io::Result<LimitStats> {
    listener.set_nonblocking(true)?;
    let mut listener = mio::net::TcpListener::from_std(listener);
    let mut poll = Poll::new()?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let mut conns: Slab<Conn> = Slab::new();
    let mut events = Events::with_capacity(1024);
    let mut stats = LimitStats::default();
    let mut next_token = 0u64;
    let mut touched: Vec<usize> = Vec::new();
    let mut to_close: Vec<usize> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        // A connection held back by the fairness cap is served again without
        // waiting for a new edge.
        let backlog = conns.iter().any(|(_, c)| c.more_to_read);
        let timeout = if backlog {
            Duration::ZERO
        } else {
            Duration::from_millis(100)
        };
        match poll.poll(&mut events, Some(timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
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
                            entry.insert(Conn {
                                stream,
                                rbuf: Vec::new(),
                                rstart: 0,
                                rend: 0,
                                wbuf: Vec::new(),
                                wpos: 0,
                                want_write: false,
                                more_to_read: false,
                                readable: false,
                                drain: true,
                            });
                            stats.connections += 1;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        // Out of descriptors and the like: try again next turn.
                        Err(_) => break,
                    }
                }
            } else if let Some(c) = conns.get_mut(ev.token().0) {
                if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                    c.readable = true;
                    if ev.is_read_closed() || ev.is_error() {
                        c.drain = true;
                    }
                }
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
            if flush(conn).is_err() {
                to_close.push(k);
                continue;
            }
            let want = conn.wpos < conn.wbuf.len();
            set_write_interest(
                poll.registry(),
                &mut conn.stream,
                Token(k),
                &mut conn.want_write,
                want,
            )?;
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
    use std::sync::Arc;

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

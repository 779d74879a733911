//! A fault-injecting TCP proxy between the client under test and a real
//! `ticketd`, plus a black-hole listener whose connects never complete.
//!
//! The proxy parses the client's byte stream with `ticketd::proto` and keeps
//! a log of every request it *received* from a client and every request it
//! *forwarded* to the server (with the wait byte as forwarded), so a test
//! can prove what the server could have seen: "this acquire reached the
//! server exactly once", "its wait byte was 3". Faults are chosen per
//! connection, in accept order.
//!
//! A delayed *connect* cannot be made by a proxy that has already accepted:
//! the kernel completes the handshake before any `accept`. [`Blackhole`]
//! does it instead: listed as a client's first address, it holds each
//! connect attempt for the client's whole connect timeout.
//!
//! Tests reach it as `ticketd_testkit::proxy`.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ticketd::proto::{decode_request, Decoded, Request};

/// What the proxy does to one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Pass everything through.
    Forward,
    /// Read the client's requests and forward none of them; the
    /// connection stays open (the server never hears of them).
    DropRequests,
    /// Read the client's first bytes, forward nothing, close the connection:
    /// the client may have sent a request the server never saw.
    DropAndClose,
    /// Forward exactly this many client bytes, then close both sides; no
    /// reply gets back to the client (the cut loses what was in flight).
    CutAfter(usize),
    /// Hold every client chunk this long before forwarding it.
    DelayForward(Duration),
    /// Forward requests; swallow every reply (the client hears nothing).
    StallReplies,
}

/// A request as the proxy saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Req {
    /// An acquire, with the wait byte as it was on the wire.
    Acquire {
        /// Wait byte.
        wait_s: u8,
        /// Lease byte.
        lease_s: u8,
        /// Owner.
        owner: u64,
        /// Key.
        key: String,
    },
    /// An acquire with a limit and a mode (protocol 1.2).
    AcquireWithLimit {
        /// Wait byte.
        wait_s: u8,
        /// Lease byte.
        lease_s: u8,
        /// Owner.
        owner: u64,
        /// The key's limit.
        limit: u16,
        /// Shared or exclusive.
        mode: ticketd::proto::Mode,
        /// Key.
        key: String,
    },
    /// A release.
    Release {
        /// Token.
        token: u64,
        /// Key.
        key: String,
    },
    /// An extend.
    Extend {
        /// Lease byte.
        lease_s: u8,
        /// Token.
        token: u64,
        /// Key.
        key: String,
    },
}

impl Req {
    /// The key of the request.
    pub fn key(&self) -> &str {
        match self {
            Req::Acquire { key, .. }
            | Req::AcquireWithLimit { key, .. }
            | Req::Release { key, .. }
            | Req::Extend { key, .. } => key,
        }
    }
}

/// One logged request: which connection, when, what.
#[derive(Clone, Debug)]
pub struct Seen {
    /// Accept index of the connection (0 = first).
    pub conn: usize,
    /// When the proxy saw it.
    pub at: Instant,
    /// Which read of the client's bytes completed it (counted over the
    /// proxy's life): frames that share one came in one chunk.
    pub chunk: u64,
    /// The request.
    pub req: Req,
}

#[derive(Default)]
struct Log {
    received: Vec<Seen>,
    forwarded: Vec<Seen>,
    chunks: u64,
    accepted: usize,
    closed_by_client: Vec<usize>,
}

struct Shared {
    upstream: SocketAddr,
    default_fault: Mutex<Fault>,
    per_conn: Mutex<HashMap<usize, Fault>>,
    log: Mutex<Log>,
    stop: AtomicBool,
    streams: Mutex<Vec<TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The proxy; stops, closes every connection and joins its threads on drop.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl Proxy {
    /// A proxy on a fresh loopback port forwarding to `upstream`.
    pub fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            upstream,
            default_fault: Mutex::new(Fault::Forward),
            per_conn: Mutex::new(HashMap::new()),
            log: Mutex::new(Log::default()),
            stop: AtomicBool::new(false),
            streams: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
        });
        let s = Arc::clone(&shared);
        let acceptor = std::thread::spawn(move || accept_loop(&listener, &s));
        Proxy {
            addr,
            shared,
            acceptor: Some(acceptor),
        }
    }

    /// `host:port` of the proxy.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// The fault for connections with no fault of their own.
    pub fn set_fault(&self, f: Fault) {
        *self.shared.default_fault.lock().unwrap() = f;
    }

    /// The fault for the connection accepted `conn`-th (0 = first).
    pub fn set_fault_for(&self, conn: usize, f: Fault) {
        self.shared.per_conn.lock().unwrap().insert(conn, f);
    }

    /// Every request received from clients, in order.
    pub fn received(&self) -> Vec<Seen> {
        self.shared.log.lock().unwrap().received.clone()
    }

    /// Every complete request handed to the server's socket, in order
    /// (logged just before the write, so never behind the server's reply).
    pub fn forwarded(&self) -> Vec<Seen> {
        self.shared.log.lock().unwrap().forwarded.clone()
    }

    /// Received requests for `key`.
    pub fn received_for(&self, key: &str) -> Vec<Seen> {
        self.received()
            .into_iter()
            .filter(|s| s.req.key() == key)
            .collect()
    }

    /// Forwarded requests for `key`.
    pub fn forwarded_for(&self, key: &str) -> Vec<Seen> {
        self.forwarded()
            .into_iter()
            .filter(|s| s.req.key() == key)
            .collect()
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.shared.log.lock().unwrap().accepted
    }

    /// Accept indexes of connections the client closed (EOF from its side).
    pub fn closed_by_client(&self) -> Vec<usize> {
        self.shared.log.lock().unwrap().closed_by_client.clone()
    }

    /// Waits until `cond` holds on the proxy, up to `within`.
    pub fn wait_until(&self, within: Duration, cond: impl Fn(&Proxy) -> bool) -> bool {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if cond(self) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        cond(self)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        for s in self.shared.streams.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        let threads: Vec<_> = self.shared.threads.lock().unwrap().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(_) => continue,
        };
        client.set_nonblocking(false).unwrap();
        let conn = {
            let mut log = shared.log.lock().unwrap();
            log.accepted += 1;
            log.accepted - 1
        };
        let fault = shared
            .per_conn
            .lock()
            .unwrap()
            .get(&conn)
            .copied()
            .unwrap_or(*shared.default_fault.lock().unwrap());
        let Ok(server) = TcpStream::connect(shared.upstream) else {
            continue;
        };
        let _ = server.set_nodelay(true);
        let _ = client.set_nodelay(true);
        {
            let mut streams = shared.streams.lock().unwrap();
            streams.push(client.try_clone().unwrap());
            streams.push(server.try_clone().unwrap());
        }
        let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let sh = Arc::clone(shared);
        let up = std::thread::spawn(move || client_to_server(conn, fault, client, server, &sh));
        let down = std::thread::spawn(move || server_to_client(fault, s2, c2));
        let mut threads = shared.threads.lock().unwrap();
        threads.push(up);
        threads.push(down);
    }
}

fn to_req(r: Request<'_>) -> Req {
    match r {
        Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
        } => Req::Acquire {
            wait_s,
            lease_s,
            owner,
            key: key.to_owned(),
        },
        Request::AcquireWithLimit {
            wait_s,
            lease_s,
            owner,
            limit,
            mode,
            key,
        } => Req::AcquireWithLimit {
            wait_s,
            lease_s,
            owner,
            limit,
            mode,
            key: key.to_owned(),
        },
        Request::Release { token, key } => Req::Release {
            token,
            key: key.to_owned(),
        },
        Request::Extend {
            lease_s,
            token,
            key,
        } => Req::Extend {
            lease_s,
            token,
            key: key.to_owned(),
        },
    }
}

/// Takes every complete frame off the front of `buf`.
fn frames(buf: &mut Vec<u8>) -> Vec<Req> {
    let mut out = Vec::new();
    loop {
        match decode_request(buf, 64 * 1024) {
            Decoded::Frame { frame, used } => {
                out.push(to_req(frame));
                buf.drain(..used);
            }
            Decoded::Incomplete => return out,
            // Not a client of ours: stop parsing, keep forwarding bytes.
            Decoded::Malformed(_) => {
                buf.clear();
                return out;
            }
        }
    }
}

/// Counts a chunk read from client connection `conn` and logs as received
/// the whole requests now in `received_buf` (taken out of it); returns the
/// chunk's number.
fn log_received(shared: &Shared, conn: usize, received_buf: &mut Vec<u8>) -> u64 {
    let now = Instant::now();
    let mut log = shared.log.lock().unwrap();
    log.chunks += 1;
    let chunk = log.chunks;
    for req in frames(received_buf) {
        log.received.push(Seen {
            conn,
            at: now,
            chunk,
            req,
        });
    }
    chunk
}

/// Logs as forwarded the whole requests now in `forwarded_buf` (taken out
/// of it), of chunk `chunk` of client connection `conn`.
fn log_forwarded(shared: &Shared, conn: usize, chunk: u64, forwarded_buf: &mut Vec<u8>) {
    let now = Instant::now();
    let mut log = shared.log.lock().unwrap();
    for req in frames(forwarded_buf) {
        log.forwarded.push(Seen {
            conn,
            at: now,
            chunk,
            req,
        });
    }
}

fn client_to_server(
    conn: usize,
    fault: Fault,
    mut client: TcpStream,
    mut server: TcpStream,
    shared: &Shared,
) {
    let mut received_buf = Vec::new();
    let mut forwarded_buf = Vec::new();
    let mut forwarded_bytes = 0usize;
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = match client.read(&mut chunk) {
            Ok(0) => {
                if !shared.stop.load(Ordering::SeqCst) {
                    shared.log.lock().unwrap().closed_by_client.push(conn);
                }
                let _ = server.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => {
                let _ = server.shutdown(Shutdown::Both);
                return;
            }
        };
        let data = &chunk[..n];
        received_buf.extend_from_slice(data);
        let chunk = log_received(shared, conn, &mut received_buf);
        let pass: &[u8] = match fault {
            Fault::DropRequests => continue,
            Fault::DropAndClose => {
                let _ = client.shutdown(Shutdown::Both);
                let _ = server.shutdown(Shutdown::Both);
                return;
            }
            Fault::CutAfter(limit) => &data[..n.min(limit.saturating_sub(forwarded_bytes))],
            Fault::DelayForward(d) => {
                std::thread::sleep(d);
                data
            }
            Fault::Forward | Fault::StallReplies => data,
        };
        // Logged before the write, so the log is never behind a reply the
        // server sends for it.
        forwarded_bytes += pass.len();
        forwarded_buf.extend_from_slice(pass);
        log_forwarded(shared, conn, chunk, &mut forwarded_buf);
        if server.write_all(pass).is_err() {
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
        if let Fault::CutAfter(limit) = fault {
            if forwarded_bytes >= limit {
                // Let the forwarded bytes reach the server before the cut.
                std::thread::sleep(Duration::from_millis(50));
                let _ = client.shutdown(Shutdown::Both);
                let _ = server.shutdown(Shutdown::Both);
                return;
            }
        }
    }
}

fn server_to_client(fault: Fault, mut server: TcpStream, mut client: TcpStream) {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = match server.read(&mut chunk) {
            Ok(0) => {
                let _ = client.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => {
                let _ = client.shutdown(Shutdown::Both);
                return;
            }
        };
        if matches!(fault, Fault::StallReplies | Fault::CutAfter(_)) {
            continue;
        }
        if client.write_all(&chunk[..n]).is_err() {
            let _ = server.shutdown(Shutdown::Both);
            return;
        }
    }
}

/// A listener whose accept queue is full, so new connects to it hang (the
/// kernel drops their SYNs) until the client's connect timeout.
pub struct Blackhole {
    /// Held open for the black hole's lifetime; never accepted from.
    _listener: socket2::Socket,
    addr: SocketAddr,
    _fillers: Vec<TcpStream>,
}

impl Blackhole {
    /// Binds a loopback port with a backlog of 0 and fills its queue.
    #[allow(clippy::new_without_default)] // acts on the system; no default value
    pub fn new() -> Blackhole {
        use socket2::{Domain, Socket, Type};
        let listener = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        listener.bind(&any.into()).unwrap();
        listener.listen(0).unwrap();
        let addr = listener.local_addr().unwrap().as_socket().unwrap();
        let mut fillers = Vec::new();
        // Connect until one hangs: from then on the queue stays full.
        for _ in 0..8 {
            match TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
                Ok(s) => fillers.push(s),
                Err(_) => break,
            }
        }
        Blackhole {
            _listener: listener,
            addr,
            _fillers: fillers,
        }
    }

    /// `host:port` of the black hole.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }
}

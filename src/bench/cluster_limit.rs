//! The cluster limit: the ceiling of a three-node, fsync-on service of
//! ticketd's protocol on this machine.
//!
//! It is the replicated counterpart of [`super::limit`]: the least work any
//! server must do to answer a request only once a majority of three nodes
//! holds it on disk, and nothing more. No consensus, no elections, no lock
//! table, no snapshots, no checksums: node 1 is the leader for good, and the
//! clients all talk to it (the cheapest layout; a follower's client would
//! cost two more messages).
//!
//! Each loop turn the leader reads its clients' requests, prepares their
//! answers without looking anything up (as the limit server does: `A` with a
//! new token, `R`), and makes the turn's requests one batch. The batch goes
//! to both followers at once, then into the leader's own log file. Each
//! node's log is a file of zeros written ahead of time, so a write
//! overwrites blocks the file already has; a sync thread runs `fdatasync`,
//! one at a time, each covering every batch written before it began, and
//! wakes the loop through a `mio` waker, exactly as ticketd's cluster node
//! does. A follower acknowledges the highest batch its last `fdatasync`
//! covered. A batch is committed once two of the three nodes hold it
//! durably; then its answers are sent.
//!
//! ticketd's cluster does all of this and more, so its distance to this
//! ceiling is what Raft, the lock table and the rest cost; and if this
//! ceiling is short of a target, no three-node service with fsync on
//! reaches it on this machine by the same route (one fsync at a time per
//! node, group commit, loopback TCP).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;

use super::{make_read_room, set_write_interest};
use crate::limits::DEFAULT_MAX_KEY_BYTES;
use crate::proto::{self, Decoded, Reply, Request};

const LISTENER: Token = Token(usize::MAX - 1);
const WAKER: Token = Token(usize::MAX - 2);
/// Tokens of the leader's connections to its followers: `PEER_BASE + i`.
const PEER_BASE: usize = usize::MAX - 16;
/// Bytes of zeros each log file is given by default before the run; writes
/// wrap round within them, so every write lands on blocks the file already
/// has (as ticketd's WAL keeps zeros written ahead of its end).
pub const LOG_BYTES: u64 = 64 << 20;
/// Frame header between leader and follower: payload length (u32) and batch
/// number (u64), little-endian. An acknowledgement is a batch number alone.
const FRAME_HEADER_BYTES: usize = 12;
/// The largest batch a follower accepts.
const MAX_BATCH_BYTES: usize = 16 << 20;
/// Read at most this much from one client per turn, for fairness.
const READ_PER_TURN_BYTES: usize = 256 * 1024;
/// Stop reading a client while this many answer bytes wait to be sent.
const MAX_PENDING_REPLY_BYTES: usize = 4 << 20;

/// What one node of the cluster limit did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterLimitStats {
    /// Requests answered (leader) or 0 (follower).
    pub requests: u64,
    /// Batches written to this node's log.
    pub batches: u64,
    /// `fdatasync` calls this node's sync thread made.
    pub syncs: u64,
    /// Time those calls took, in total.
    pub sync_time: Duration,
}

/// The log file and its sync thread.
struct Log {
    file: Arc<File>,
    /// The file's size: writes wrap round within it.
    bytes: u64,
    /// Where the next batch goes.
    at: u64,
    shared: Arc<(Mutex<SyncState>, Condvar)>,
    thread: Option<std::thread::JoinHandle<(u64, Duration)>>,
}

#[derive(Default)]
struct SyncState {
    /// Highest batch written to the file.
    written: u64,
    /// Highest batch a finished `fdatasync` covers.
    durable: u64,
    /// An `fdatasync` failed: the node stops.
    failed: Option<String>,
    stop: bool,
}

impl Log {
    /// Creates (or truncates) `path`, fills it with `bytes` of zeros (at
    /// least 4 KiB), syncs it, and starts the sync thread, which wakes
    /// `waker`.
    fn create(path: &std::path::Path, bytes: u64, waker: Arc<Waker>) -> io::Result<Self> {
        let bytes = bytes.max(4096);
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(path)?;
        let zeros = vec![0u8; 1 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(zeros.len() as u64);
            f.write_all(&zeros[..n as usize])?;
            left -= n;
        }
        f.sync_all()?;
        let file = Arc::new(f);
        let shared = Arc::new((Mutex::new(SyncState::default()), Condvar::new()));
        let (f2, s2) = (Arc::clone(&file), Arc::clone(&shared));
        let thread = std::thread::Builder::new()
            .name("cluster-limit-sync".into())
            .spawn(move || sync_thread(&f2, &s2, &waker))?;
        Ok(Log {
            file,
            bytes,
            at: 0,
            shared,
            thread: Some(thread),
        })
    }

    /// Writes batch `seq`'s bytes and lets the sync thread know.
    fn append(&mut self, seq: u64, bytes: &[u8]) -> io::Result<()> {
        let mut rest = bytes;
        while !rest.is_empty() {
            if self.at == self.bytes {
                self.at = 0;
            }
            let room = usize::try_from(self.bytes - self.at).unwrap_or(usize::MAX);
            let n = rest.len().min(room);
            self.file.write_all_at(&rest[..n], self.at)?;
            self.at += n as u64;
            rest = &rest[n..];
        }
        let (lock, cv) = &*self.shared;
        let mut s = lock
            .lock()
            .map_err(|_| io::Error::other("sync thread died"))?;
        s.written = seq;
        cv.notify_one();
        Ok(())
    }

    /// The highest durable batch, or the sync thread's failure.
    fn durable(&self) -> io::Result<u64> {
        let s = self
            .shared
            .0
            .lock()
            .map_err(|_| io::Error::other("sync thread died"))?;
        match &s.failed {
            Some(e) => Err(io::Error::other(e.clone())),
            None => Ok(s.durable),
        }
    }

    /// Stops the sync thread; returns how many `fdatasync` calls it made
    /// and how long they took.
    fn finish(mut self) -> (u64, Duration) {
        if let Ok(mut s) = self.shared.0.lock() {
            s.stop = true;
        }
        self.shared.1.notify_one();
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

fn sync_thread(
    file: &File,
    shared: &(Mutex<SyncState>, Condvar),
    waker: &Waker,
) -> (u64, Duration) {
    let (lock, cv) = shared;
    let mut syncs = (0, Duration::ZERO);
    let Ok(mut s) = lock.lock() else { return syncs };
    loop {
        while s.written == s.durable && !s.stop {
            s = match cv.wait(s) {
                Ok(g) => g,
                Err(_) => return syncs,
            };
        }
        if s.stop {
            return syncs;
        }
        let target = s.written;
        drop(s);
        let began = Instant::now();
        let r = file.sync_data();
        syncs.0 += 1;
        syncs.1 += began.elapsed();
        s = match lock.lock() {
            Ok(g) => g,
            Err(_) => return syncs,
        };
        match r {
            Ok(()) => s.durable = target,
            Err(e) => {
                s.failed = Some(format!("fdatasync: {e}"));
                s.stop = true;
            }
        }
        let _ = waker.wake();
    }
}

/// A byte stream with explicit buffers, for clients and peers alike.
struct Conn {
    stream: mio::net::TcpStream,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    wbuf: Vec<u8>,
    wpos: usize,
    want_write: bool,
    /// A readiness event said there is input (or a close) not yet read.
    readable: bool,
    /// Read until `WouldBlock` even after a short read (see the limit server).
    drain: bool,
    /// Unread input may remain (fairness cap or back-pressure).
    more_to_read: bool,
    /// Tells apart the connections that reuse one slab slot.
    generation: u64,
}

impl Conn {
    fn new(stream: mio::net::TcpStream, generation: u64) -> Self {
        Conn {
            stream,
            rbuf: Vec::new(),
            rstart: 0,
            rend: 0,
            wbuf: Vec::new(),
            wpos: 0,
            want_write: false,
            readable: false,
            drain: true,
            more_to_read: false,
            generation,
        }
    }

    /// Reads what has arrived, up to `cap` bytes, into `rbuf[rstart..rend]`.
    /// `Ok(false)` means the peer closed.
    fn fill(&mut self, cap: usize) -> io::Result<bool> {
        let mut got = 0;
        self.more_to_read = false;
        while self.readable {
            if got >= cap || self.wbuf.len() - self.wpos > MAX_PENDING_REPLY_BYTES {
                self.more_to_read = true;
                break;
            }
            make_read_room(&mut self.rbuf, &mut self.rstart, &mut self.rend);
            let offered = self.rbuf.len() - self.rend;
            match self.stream.read(&mut self.rbuf[self.rend..]) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    if n < offered && !self.drain {
                        self.readable = false;
                    }
                    got += n;
                    self.rend += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.readable = false;
                    self.drain = false;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    fn consumed(&mut self, used: usize) {
        self.rstart += used;
        if self.rstart == self.rend {
            self.rstart = 0;
            self.rend = 0;
        }
    }

    fn flush(&mut self, registry: &mio::Registry, token: Token) -> io::Result<()> {
        while self.wpos < self.wbuf.len() {
            match self.stream.write(&self.wbuf[self.wpos..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.wpos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.wpos == self.wbuf.len() {
            self.wbuf.clear();
            self.wpos = 0;
        }
        let want = self.wpos < self.wbuf.len();
        set_write_interest(
            registry,
            &mut self.stream,
            token,
            &mut self.want_write,
            want,
        )
    }

    fn note_event(&mut self, ev: &mio::event::Event) {
        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
            self.readable = true;
            if ev.is_read_closed() || ev.is_error() {
                self.drain = true;
            }
        }
    }
}

/// A batch sent but not yet committed: the answers it owes.
struct Pending {
    seq: u64,
    /// Answer bytes, back to back.
    replies: Vec<u8>,
    /// Client slot, its generation, and the end of its answer in `replies`.
    spans: Vec<(usize, u64, usize)>,
}

/// Runs the leader: clients on `listener`, its two followers at
/// `followers` (it connects to them, retrying for up to 10 s), its log at
/// `log_path`, `log_bytes` long. Stops when `stop` is set (checked at least
/// every 100 ms); fails if a follower closes its connection or a write or
/// `fdatasync` fails.
pub fn serve_leader(
    listener: TcpListener,
    followers: &[SocketAddr],
    log_path: &std::path::Path,
    log_bytes: u64,
    stop: &AtomicBool,
) -> io::Result<ClusterLimitStats> {
    if followers.len() != 2 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the cluster limit's leader takes exactly two followers",
        ));
    }
    listener.set_nonblocking(true)?;
    let mut listener = mio::net::TcpListener::from_std(listener);
    let mut poll = Poll::new()?;
    let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
    let mut log = Log::create(log_path, log_bytes, waker)?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let mut peers = Vec::new();
    for (i, addr) in followers.iter().enumerate() {
        let s = connect_retrying(*addr, Duration::from_secs(10))?;
        s.set_nodelay(true)?;
        s.set_nonblocking(true)?;
        let mut stream = mio::net::TcpStream::from_std(s);
        poll.registry()
            .register(&mut stream, Token(PEER_BASE + i), Interest::READABLE)?;
        peers.push((Conn::new(stream, 0), 0u64));
    }

    let mut clients: Slab<Conn> = Slab::new();
    let mut generation = 0u64;
    let mut events = Events::with_capacity(1024);
    let mut stats = ClusterLimitStats::default();
    let mut next_token = 0u64;
    let mut seq = 0u64;
    let mut batch: Vec<u8> = Vec::new();
    let mut open = Pending {
        seq: 0,
        replies: Vec::new(),
        spans: Vec::new(),
    };
    let mut inflight: VecDeque<Pending> = VecDeque::new();
    let mut local_durable = 0u64;
    let mut touched: Vec<usize> = Vec::new();
    let mut to_close: Vec<usize> = Vec::new();

    while !stop.load(Ordering::Relaxed) {
        let backlog = clients.iter().any(|(_, c)| c.more_to_read);
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
            let t = ev.token();
            if t == LISTENER {
                accept_all(&listener, &mut clients, &mut generation, poll.registry())?;
            } else if t == WAKER {
                local_durable = log.durable()?;
            } else if t.0 >= PEER_BASE {
                let (peer, acked) = &mut peers[t.0 - PEER_BASE];
                peer.note_event(ev);
                if !peer.fill(usize::MAX)? {
                    return Err(io::Error::other("a follower closed its connection"));
                }
                while peer.rend - peer.rstart >= 8 {
                    let at = peer.rstart;
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&peer.rbuf[at..at + 8]);
                    *acked = (*acked).max(u64::from_le_bytes(b));
                    peer.consumed(8);
                }
                if ev.is_writable() {
                    peer.flush(poll.registry(), t)?;
                }
            } else if let Some(c) = clients.get_mut(t.0) {
                c.note_event(ev);
                touched.push(t.0);
            }
        }
        for (k, c) in clients.iter() {
            if c.more_to_read {
                touched.push(k);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        // Read every client; their requests make this turn's batch.
        for &k in &touched {
            let c = &mut clients[k];
            match c.fill(READ_PER_TURN_BYTES) {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    to_close.push(k);
                    continue;
                }
            }
            let mut at = c.rstart;
            loop {
                match proto::decode_request(&c.rbuf[at..c.rend], DEFAULT_MAX_KEY_BYTES) {
                    Decoded::Incomplete => break,
                    Decoded::Malformed(_) => {
                        to_close.push(k);
                        break;
                    }
                    Decoded::Frame { frame, used } => {
                        batch.extend_from_slice(&c.rbuf[at..at + used]);
                        at += used;
                        stats.requests += 1;
                        let reply = match frame {
                            Request::Acquire { owner, key, .. } => {
                                next_token += 1;
                                Reply::Acquired {
                                    token: next_token,
                                    owner,
                                    key,
                                }
                            }
                            Request::Release { token, key } => Reply::Released { token, key },
                        };
                        proto::encode_reply(&reply, &mut open.replies);
                        open.spans.push((k, c.generation, open.replies.len()));
                    }
                }
            }
            let used = at - c.rstart;
            c.consumed(used);
        }
        for k in to_close.drain(..) {
            if clients.contains(k) {
                let mut c = clients.remove(k);
                let _ = poll.registry().deregister(&mut c.stream);
            }
        }
        // Send the batch to both followers, then write it locally.
        if !batch.is_empty() {
            seq += 1;
            stats.batches += 1;
            let len = u32::try_from(batch.len()).map_err(|_| io::Error::other("batch too big"))?;
            for (i, (peer, _)) in peers.iter_mut().enumerate() {
                peer.wbuf.extend_from_slice(&len.to_le_bytes());
                peer.wbuf.extend_from_slice(&seq.to_le_bytes());
                peer.wbuf.extend_from_slice(&batch);
                peer.flush(poll.registry(), Token(PEER_BASE + i))?;
            }
            log.append(seq, &batch)?;
            batch.clear();
            open.seq = seq;
            let next = Pending {
                seq: 0,
                replies: Vec::with_capacity(open.replies.capacity()),
                spans: Vec::with_capacity(open.spans.capacity()),
            };
            inflight.push_back(std::mem::replace(&mut open, next));
        }
        // Commit: the middle of the three durable marks.
        let mut marks = [local_durable, peers[0].1, peers[1].1];
        marks.sort_unstable();
        let committed = marks[1];
        touched.clear();
        while inflight.front().is_some_and(|p| p.seq <= committed) {
            let Some(p) = inflight.pop_front() else { break };
            let mut from = 0;
            for &(k, generation, end) in &p.spans {
                if let Some(c) = clients.get_mut(k) {
                    if c.generation == generation {
                        c.wbuf.extend_from_slice(&p.replies[from..end]);
                        touched.push(k);
                    }
                }
                from = end;
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for &k in &touched {
            if clients[k].flush(poll.registry(), Token(k)).is_err() {
                to_close.push(k);
            }
        }
        for k in to_close.drain(..) {
            let mut c = clients.remove(k);
            let _ = poll.registry().deregister(&mut c.stream);
        }
    }
    (stats.syncs, stats.sync_time) = log.finish();
    Ok(stats)
}

fn accept_all(
    listener: &mio::net::TcpListener,
    clients: &mut Slab<Conn>,
    generation: &mut u64,
    registry: &mio::Registry,
) -> io::Result<()> {
    loop {
        match listener.accept() {
            Ok((mut stream, _)) => {
                let _ = stream.set_nodelay(true);
                let entry = clients.vacant_entry();
                registry.register(&mut stream, Token(entry.key()), Interest::READABLE)?;
                *generation += 1;
                entry.insert(Conn::new(stream, *generation));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Ok(()),
        }
    }
}

fn connect_retrying(addr: SocketAddr, within: Duration) -> io::Result<std::net::TcpStream> {
    let end = Instant::now() + within;
    loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= end => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Runs a follower: waits on `listener` for the leader, writes every batch
/// to its log at `log_path` (`log_bytes` long) and acknowledges what each
/// `fdatasync` covered. Ends when `stop` is set or the leader's connection
/// ends; fails on a frame over 16 MiB or a failed write or `fdatasync`.
pub fn serve_follower(
    listener: TcpListener,
    log_path: &std::path::Path,
    log_bytes: u64,
    stop: &AtomicBool,
) -> io::Result<ClusterLimitStats> {
    let mut poll = Poll::new()?;
    let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
    let mut log = Log::create(log_path, log_bytes, waker)?;
    listener.set_nonblocking(true)?;
    let mut listener = mio::net::TcpListener::from_std(listener);
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let mut events = Events::with_capacity(64);
    let mut stats = ClusterLimitStats::default();
    let mut leader: Option<Conn> = None;
    let lt = Token(0);
    let mut received = 0u64;
    let mut written = 0u64;
    let mut acked = 0u64;
    let mut batch: Vec<u8> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match poll.poll(&mut events, Some(Duration::from_millis(100))) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        let mut durable_changed = false;
        for ev in &events {
            match ev.token() {
                // The first connection is the leader's; any later one is
                // closed at once.
                LISTENER => {
                    while let Ok((mut s, _)) = listener.accept() {
                        if leader.is_none() {
                            let _ = s.set_nodelay(true);
                            poll.registry().register(&mut s, lt, Interest::READABLE)?;
                            leader = Some(Conn::new(s, 0));
                        }
                    }
                }
                WAKER => durable_changed = true,
                _ => {
                    if let Some(c) = leader.as_mut() {
                        c.note_event(ev);
                        if ev.is_writable() {
                            c.flush(poll.registry(), lt)?;
                        }
                    }
                }
            }
        }
        let Some(c) = leader.as_mut() else { continue };
        match c.fill(usize::MAX) {
            Ok(true) => {}
            // The leader is gone (closed, or killed: a reset).
            Ok(false) => break,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => break,
            Err(e) => return Err(e),
        }
        while c.rend - c.rstart >= FRAME_HEADER_BYTES {
            let h = &c.rbuf[c.rstart..c.rstart + FRAME_HEADER_BYTES];
            let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
            if len > MAX_BATCH_BYTES {
                return Err(io::Error::other("batch over the limit"));
            }
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[4..12]);
            if c.rend - c.rstart < FRAME_HEADER_BYTES + len {
                break;
            }
            let at = c.rstart + FRAME_HEADER_BYTES;
            batch.extend_from_slice(&c.rbuf[at..at + len]);
            received = u64::from_le_bytes(b);
            c.consumed(FRAME_HEADER_BYTES + len);
        }
        if received > written {
            log.append(received, &batch)?;
            batch.clear();
            written = received;
            stats.batches += 1;
        }
        if durable_changed {
            let d = log.durable()?;
            if d > acked {
                acked = d;
                c.wbuf.extend_from_slice(&d.to_le_bytes());
                c.flush(poll.registry(), lt)?;
            }
        }
    }
    (stats.syncs, stats.sync_time) = log.finish();
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;
    use std::net::TcpStream;

    type Running = std::thread::JoinHandle<io::Result<ClusterLimitStats>>;

    fn log_path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!(
            "ticketd-cluster-limit-{name}-{}.log",
            std::process::id()
        ))
    }

    fn start_leader(
        followers: Vec<SocketAddr>,
        log: &str,
    ) -> (SocketAddr, Arc<AtomicBool>, Running) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let path = log_path(log);
        let t = std::thread::spawn(move || {
            let r = serve_leader(listener, &followers, &path, 64 << 10, &stop2);
            let _ = std::fs::remove_file(&path);
            r
        });
        (addr, stop, t)
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

    /// The leader answers only once a majority holds the batch: its own
    /// `fdatasync` is not enough, one follower's acknowledgement is.
    #[test]
    fn a_request_is_answered_only_once_two_of_three_nodes_hold_it() {
        let fa = TcpListener::bind("127.0.0.1:0").unwrap();
        let fb = TcpListener::bind("127.0.0.1:0").unwrap();
        let followers = vec![fa.local_addr().unwrap(), fb.local_addr().unwrap()];
        let (addr, stop, leader) = start_leader(followers, "majority");
        let (mut a, _) = fa.accept().unwrap();
        let (mut b, _) = fb.accept().unwrap();

        let mut client = TcpStream::connect(addr).unwrap();
        let req = acquire("k");
        client.write_all(&req).unwrap();
        // Both followers get batch 1: exactly the client's request.
        assert_eq!(read_batch(&mut a), (1, req.clone()));
        assert_eq!(read_batch(&mut b), (1, req));
        // No follower has acknowledged: no answer, however long the
        // leader's own fdatasync has been done.
        client
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut byte = [0u8; 1];
        let e = client.read(&mut byte).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{e}"
        );
        // Follower a holds it: answered.
        a.write_all(&1u64.to_le_bytes()).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut want = Vec::new();
        proto::encode_reply(
            &Reply::Acquired {
                token: 1,
                owner: 7,
                key: "k",
            },
            &mut want,
        );
        assert_eq!(read_reply(&mut client), want);

        // Batch 2 on follower b alone is enough too.
        let mut rel = Vec::new();
        proto::encode_request(&Request::Release { token: 1, key: "k" }, &mut rel);
        client.write_all(&rel).unwrap();
        assert_eq!(read_batch(&mut a), (2, rel.clone()));
        assert_eq!(read_batch(&mut b), (2, rel));
        b.write_all(&2u64.to_le_bytes()).unwrap();
        want.clear();
        proto::encode_reply(&Reply::Released { token: 1, key: "k" }, &mut want);
        assert_eq!(read_reply(&mut client), want);

        stop.store(true, Ordering::Relaxed);
        let stats = leader.join().unwrap().unwrap();
        assert_eq!((stats.requests, stats.batches), (2, 2));
        assert!(stats.syncs >= 1);
    }

    /// Three real nodes: pipelined requests are all answered in order, and
    /// every batch is on each follower's disk.
    #[test]
    fn three_nodes_answer_in_order_and_each_log_holds_the_batches() {
        let mut followers = Vec::new();
        let mut addrs = Vec::new();
        let stop = Arc::new(AtomicBool::new(false));
        for i in 0..2 {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            addrs.push(l.local_addr().unwrap());
            let path = log_path(&format!("follower{i}"));
            let stop2 = Arc::clone(&stop);
            followers.push(std::thread::spawn(move || {
                let r = serve_follower(l, &path, 64 << 10, &stop2)
                    .map(|s| (s, std::fs::read(&path).unwrap()));
                let _ = std::fs::remove_file(&path);
                r
            }));
        }
        let (addr, stop_leader, leader) = start_leader(addrs, "leader3");
        let mut client = TcpStream::connect(addr).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut sent = Vec::new();
        for i in 0..20 {
            sent.extend_from_slice(&acquire(&format!("key{i}")));
        }
        client.write_all(&sent).unwrap();
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        let mut answered = 0u64;
        while answered < 20 {
            let n = client.read(&mut chunk).unwrap();
            assert!(n > 0, "the leader closed the client's connection");
            got.extend_from_slice(&chunk[..n]);
            while let Decoded::Frame { frame, used } = proto::decode_reply(&got, 1024) {
                answered += 1;
                let key = format!("key{}", answered - 1);
                assert_eq!(
                    frame,
                    Reply::Acquired {
                        token: answered,
                        owner: 7,
                        key: &key
                    }
                );
                got.drain(..used);
            }
        }
        stop_leader.store(true, Ordering::Relaxed);
        let stats = leader.join().unwrap().unwrap();
        assert_eq!(stats.requests, 20);
        stop.store(true, Ordering::Relaxed);
        for f in followers {
            let (stats, log) = f.join().unwrap().unwrap();
            assert!(stats.batches >= 1 && stats.syncs >= 1, "{stats:?}");
            // The batches were written back to back from the start.
            assert_eq!(&log[..sent.len()], &sent[..]);
            assert!(log.len() >= 64 << 10);
        }
    }
}

//! The cluster limit: the ceiling of a three-node, fsync-on service of
//! ticketd's protocol on this machine, built the way ticketd's cluster is.
//!
//! It is the replicated counterpart of [`super::limit`]: the least work a
//! server must do to answer a request only once a majority of three nodes
//! holds it on disk, and nothing more. No consensus, no elections, no lock
//! table, no snapshots, no checksums: node 1 is the leader for good, and the
//! clients all talk to it (the cheapest layout), or, when the followers are
//! given an address for clients, also to them (the layout ticketd's
//! cluster is benchmarked in: each node serves clients). A follower reads
//! its clients' requests each turn and forwards them to the leader in one
//! frame; they join the leader's batch like its own clients' requests, and
//! once the batch is committed the leader sends their answers back to that
//! follower in one frame, which passes each on. Those are the two messages
//! a ticketd follower's client costs (its proposals forwarded, the commit
//! notice back), and no more: nothing is applied on the follower, and only
//! a follower that forwarded something hears of the commit.
//!
//! Each loop turn the leader reads its clients' requests, prepares their
//! answers without looking anything up (as the limit server does: `A` with a
//! new token, `R`), and makes the turn's requests one batch (up to 16 MiB;
//! the rest waits for the next turn). The batch goes to both followers at
//! once, then into the leader's own log file. Each node's log is a file of
//! zeros written ahead of time, so a write overwrites blocks the file
//! already has (the log writes round within it: a benchmark keeps no
//! history). A sync thread runs `fdatasync`, one at a time, each covering
//! every batch written before it began, and wakes the loop through a `mio`
//! waker, like ticketd's cluster node (which starts each sync from its
//! loop; this thread starts the next one itself, which favours the limit).
//! A follower acknowledges the highest batch its last `fdatasync` covered.
//! A batch is committed once two of the three nodes hold it durably; then
//! its answers are sent.
//!
//! ticketd's cluster does all of this and more, so its distance to this
//! ceiling is what Raft, the lock table and the rest cost; and if this
//! ceiling is short of a target, no three-node service built the same way
//! (one `fdatasync` at a time per node, group commit per loop turn,
//! loopback TCP, the three logs on one disk) reaches it on the machine.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;

use super::conn::BufferedConn;
use super::limit::answer;
use ticketd::limits::DEFAULT_MAX_KEY_BYTES;
use ticketd::proto::{self, Decoded};

const LISTENER: Token = Token(usize::MAX - 1);
const WAKER: Token = Token(usize::MAX - 2);
/// A follower's listener for clients of its own.
const CLIENT_LISTENER: Token = Token(usize::MAX - 3);
/// A follower's connection from the leader.
const LEADER: Token = Token(usize::MAX - 4);
/// Tokens of the leader's connections to its followers: `PEER_BASE + i`.
const PEER_BASE: usize = usize::MAX - 16;
/// Bytes of zeros each log file is given by default before the run; writes
/// wrap round within them, so every write lands on blocks the file already
/// has (as ticketd's WAL keeps zeros written ahead of its end).
pub const LOG_BYTES: u64 = 64 << 20;
/// Frame header between leader and follower: payload length (u32) and batch
/// number (u64), little-endian. An acknowledgement is a batch number alone.
const FRAME_HEADER_BYTES: usize = 12;
/// The largest batch: the leader leaves what would pass it for the next
/// turn, a follower refuses a bigger one.
const MAX_BATCH_BYTES: usize = if cfg!(test) { 64 << 10 } else { 16 << 20 };
/// A follower's words to the leader are 8 bytes, little-endian: a batch
/// number it acknowledges (always below 2^63), or, with this bit set, the
/// header of requests it forwards from its own clients, their length in the
/// low bits, the requests following back to back.
const FORWARD_FLAG: u64 = 1 << 63;
/// The most a follower forwards in one frame: half a batch, so that a frame
/// always fits the batch of the turn after one it did not fit.
const MAX_FORWARD_BYTES: usize = MAX_BATCH_BYTES / 2;
/// The batch number of a leader's frame that carries answers for a
/// follower's clients instead of a batch: their answers back to back, in
/// the order the follower forwarded the requests.
const RELAY_SEQ: u64 = u64::MAX;
/// The largest frame of answers a follower accepts: a batch's requests
/// may each be answered with a few more bytes than they took.
const MAX_RELAY_BYTES: usize = 2 * MAX_BATCH_BYTES;
/// Read at most this much from one client per turn, for fairness.
const READ_PER_TURN_BYTES: usize = 256 * 1024;
/// Stop reading a client while this many answer bytes wait to be sent.
const MAX_PENDING_REPLY_BYTES: usize = 4 << 20;

/// What one node of the cluster limit did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterLimitStats {
    /// Requests read from clients (leader) or 0 (follower).
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

/// How long the sync thread waits before each `fdatasync`: zero, but tests
/// slow the disk down with it to see what waits for a sync.
#[derive(Clone, Copy, Debug, Default)]
struct SyncDelay(Duration);

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
    fn create(
        path: &std::path::Path,
        bytes: u64,
        waker: Arc<Waker>,
        delay: SyncDelay,
    ) -> io::Result<Self> {
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
            .spawn(move || sync_thread(&f2, &s2, &waker, delay))?;
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

    /// Syncs the file in the caller's thread (a follower's last sync).
    fn sync_now(&self) -> io::Result<()> {
        self.file.sync_data()
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
    delay: SyncDelay,
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
        // Every batch up to `target` is written: the sync covers them.
        let target = s.written;
        drop(s);
        if !delay.0.is_zero() {
            std::thread::sleep(delay.0);
        }
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

/// A client connection; `generation` tells apart the connections that
/// reuse one slab slot.
struct Client {
    conn: BufferedConn,
    generation: u64,
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
    lead(
        listener,
        followers,
        log_path,
        log_bytes,
        SyncDelay::default(),
        stop,
    )
}

/// A batch is committed once two of the three nodes hold it: the middle of
/// the three durable marks (the leader's own and each follower's).
fn committed(mut marks: [u64; 3]) -> u64 {
    marks.sort_unstable();
    marks[1]
}

fn lead(
    listener: TcpListener,
    followers: &[SocketAddr],
    log_path: &std::path::Path,
    log_bytes: u64,
    delay: SyncDelay,
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
    let mut log = Log::create(log_path, log_bytes, waker, delay)?;
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
        peers.push((BufferedConn::new(stream), 0u64));
    }

    let mut clients: Slab<Client> = Slab::new();
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
    // Forwarded requests that did not fit this turn's batch wait in a
    // follower's input: the next turn must not sleep.
    let mut peer_backlog = false;
    let mut relay: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
    let mut relayed = [false; 2];

    while !stop.load(Ordering::Relaxed) {
        let backlog = peer_backlog || clients.iter().any(|(_, c)| c.conn.more_to_read);
        if !super::conn::wait(&mut poll, &mut events, backlog)? {
            continue;
        }
        touched.clear();
        for ev in &events {
            let t = ev.token();
            if t == LISTENER {
                accept_all(&listener, &mut clients, &mut generation, poll.registry())?;
            } else if t == WAKER {
                local_durable = log.durable()?;
            } else if t.0 >= PEER_BASE {
                let (peer, _) = &mut peers[t.0 - PEER_BASE];
                peer.note_event(ev);
                if !peer.fill(usize::MAX, usize::MAX)? {
                    return Err(io::Error::other("a follower closed its connection"));
                }
                if ev.is_writable() {
                    peer.flush(poll.registry(), t)?;
                }
            } else if let Some(c) = clients.get_mut(t.0) {
                c.conn.note_event(ev);
                // Answers held back by a full socket go out as it drains.
                if ev.is_writable() && c.conn.flush(poll.registry(), t).is_err() {
                    to_close.push(t.0);
                    continue;
                }
                touched.push(t.0);
            }
        }
        for (k, c) in clients.iter() {
            if c.conn.more_to_read {
                touched.push(k);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        // The followers' acknowledgements, and the requests they forwarded
        // from their own clients: those join this turn's batch, each frame
        // whole (one that does not fit waits for the next turn's batch).
        peer_backlog = false;
        for (i, (peer, acked)) in peers.iter_mut().enumerate() {
            loop {
                let data = peer.input.data();
                let Some(word) = data.get(..8) else { break };
                let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
                if word & FORWARD_FLAG == 0 {
                    if word > seq {
                        return Err(io::Error::other(format!(
                            "a follower acknowledged batch {word}, but only {seq} were sent"
                        )));
                    }
                    *acked = (*acked).max(word);
                    peer.consumed(8);
                    continue;
                }
                let len = usize::try_from(word & !FORWARD_FLAG).unwrap_or(usize::MAX);
                if len > MAX_FORWARD_BYTES {
                    return Err(io::Error::other(format!(
                        "a follower forwarded {len} bytes, over the limit of {MAX_FORWARD_BYTES}"
                    )));
                }
                let Some(frame) = data.get(8..8 + len) else {
                    break;
                };
                if batch.len() + len > MAX_BATCH_BYTES {
                    peer_backlog = true;
                    break;
                }
                let mut at = 0;
                while at < len {
                    match proto::decode_request(&frame[at..], DEFAULT_MAX_KEY_BYTES) {
                        Decoded::Frame { frame: req, used } => {
                            batch.extend_from_slice(&frame[at..at + used]);
                            at += used;
                            stats.requests += 1;
                            answer(req, &mut next_token, &mut open.replies);
                            open.spans.push((PEER_BASE + i, 0, open.replies.len()));
                        }
                        _ => {
                            return Err(io::Error::other(
                                "a follower forwarded a malformed or partial request",
                            ))
                        }
                    }
                }
                peer.consumed(8 + len);
            }
        }
        // Read every client; their requests make this turn's batch, up to
        // its limit (what is left waits for the next turn).
        for &k in &touched {
            if to_close.contains(&k) {
                continue;
            }
            let Client {
                conn: c,
                generation,
            } = &mut clients[k];
            match c.fill(READ_PER_TURN_BYTES, MAX_PENDING_REPLY_BYTES) {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    to_close.push(k);
                    continue;
                }
            }
            let mut at = 0;
            loop {
                match proto::decode_request(&c.input.data()[at..], DEFAULT_MAX_KEY_BYTES) {
                    Decoded::Incomplete => break,
                    Decoded::Malformed(_) => {
                        to_close.push(k);
                        break;
                    }
                    Decoded::Frame { frame, used } => {
                        if batch.len() + used > MAX_BATCH_BYTES {
                            c.more_to_read = true;
                            break;
                        }
                        batch.extend_from_slice(&c.input.data()[at..at + used]);
                        at += used;
                        stats.requests += 1;
                        answer(frame, &mut next_token, &mut open.replies);
                        open.spans.push((k, *generation, open.replies.len()));
                    }
                }
            }
            c.consumed(at);
        }
        for k in to_close.drain(..) {
            if clients.contains(k) {
                let mut c = clients.remove(k);
                let _ = poll.registry().deregister(&mut c.conn.stream);
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
        let done = committed([local_durable, peers[0].1, peers[1].1]);
        touched.clear();
        while inflight.front().is_some_and(|p| p.seq <= done) {
            let Some(p) = inflight.pop_front() else { break };
            let mut from = 0;
            for &(k, generation, end) in &p.spans {
                if k >= PEER_BASE {
                    relay[k - PEER_BASE].extend_from_slice(&p.replies[from..end]);
                } else if let Some(c) = clients.get_mut(k) {
                    if c.generation == generation {
                        c.conn.wbuf.extend_from_slice(&p.replies[from..end]);
                        touched.push(k);
                    }
                }
                from = end;
            }
            // The answers a follower's clients are owed, in the order it
            // forwarded their requests, one frame per committed batch.
            for (i, r) in relay.iter_mut().enumerate() {
                if !r.is_empty() {
                    let (peer, _) = &mut peers[i];
                    let len =
                        u32::try_from(r.len()).map_err(|_| io::Error::other("answers too big"))?;
                    peer.wbuf.extend_from_slice(&len.to_le_bytes());
                    peer.wbuf.extend_from_slice(&RELAY_SEQ.to_le_bytes());
                    peer.wbuf.extend_from_slice(r);
                    r.clear();
                    relayed[i] = true;
                }
            }
        }
        for (i, sent) in relayed.iter_mut().enumerate() {
            if std::mem::take(sent) {
                peers[i].0.flush(poll.registry(), Token(PEER_BASE + i))?;
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for &k in &touched {
            if clients[k].conn.flush(poll.registry(), Token(k)).is_err() {
                to_close.push(k);
            }
        }
        for k in to_close.drain(..) {
            let mut c = clients.remove(k);
            let _ = poll.registry().deregister(&mut c.conn.stream);
        }
    }
    (stats.syncs, stats.sync_time) = log.finish();
    Ok(stats)
}

fn accept_all(
    listener: &mio::net::TcpListener,
    clients: &mut Slab<Client>,
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
                entry.insert(Client {
                    conn: BufferedConn::new(stream),
                    generation: *generation,
                });
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
/// `fdatasync` covered. With `clients`, it also serves clients of its own
/// once the leader has connected: it forwards their requests to the leader
/// each turn and passes on the answers the leader sends back once the
/// batch that holds them is committed (a ticketd follower forwards its
/// clients' proposals and answers them once the commit reaches it: the
/// same two messages). Ends when `stop` is set or the leader's connection
/// ends; fails on a frame over the limits or a failed write or `fdatasync`.
pub fn serve_follower(
    listener: TcpListener,
    clients: Option<TcpListener>,
    log_path: &std::path::Path,
    log_bytes: u64,
    stop: &AtomicBool,
) -> io::Result<ClusterLimitStats> {
    follow(
        listener,
        clients,
        log_path,
        log_bytes,
        SyncDelay::default(),
        stop,
    )
}

fn follow(
    listener: TcpListener,
    client_listener: Option<TcpListener>,
    log_path: &std::path::Path,
    log_bytes: u64,
    delay: SyncDelay,
    stop: &AtomicBool,
) -> io::Result<ClusterLimitStats> {
    let mut poll = Poll::new()?;
    let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
    let mut log = Log::create(log_path, log_bytes, waker, delay)?;
    listener.set_nonblocking(true)?;
    let mut listener = mio::net::TcpListener::from_std(listener);
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let mut client_listener = match client_listener {
        Some(l) => {
            l.set_nonblocking(true)?;
            Some(mio::net::TcpListener::from_std(l))
        }
        None => None,
    };
    let mut events = Events::with_capacity(1024);
    let mut stats = ClusterLimitStats::default();
    let mut leader: Option<BufferedConn> = None;
    let lt = LEADER;
    let mut received = 0u64;
    let mut written = 0u64;
    let mut acked = 0u64;
    let mut batch: Vec<u8> = Vec::new();
    let mut clients: Slab<Client> = Slab::new();
    let mut generation = 0u64;
    // The clients whose forwarded requests await their answers, in the
    // order forwarded: slot and generation.
    let mut waiting: VecDeque<(usize, u64)> = VecDeque::new();
    let mut forward: Vec<u8> = Vec::new();
    let mut touched: Vec<usize> = Vec::new();
    let mut to_close: Vec<usize> = Vec::new();
    let mut answered: Vec<usize> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let backlog = clients.iter().any(|(_, c)| c.conn.more_to_read);
        if !super::conn::wait(&mut poll, &mut events, backlog)? {
            continue;
        }
        let mut durable_changed = false;
        let mut gone = false;
        touched.clear();
        for ev in &events {
            match ev.token() {
                // The first connection is the leader's; any later one is
                // closed at once. Clients are taken only once it is there.
                LISTENER => loop {
                    match listener.accept() {
                        Ok((mut s, _)) if leader.is_none() => {
                            let _ = s.set_nodelay(true);
                            poll.registry().register(&mut s, lt, Interest::READABLE)?;
                            leader = Some(BufferedConn::new(s));
                            if let Some(l) = client_listener.as_mut() {
                                poll.registry()
                                    .register(l, CLIENT_LISTENER, Interest::READABLE)?;
                            }
                        }
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                },
                CLIENT_LISTENER => {
                    if let Some(l) = client_listener.as_ref() {
                        accept_all(l, &mut clients, &mut generation, poll.registry())?;
                    }
                }
                WAKER => durable_changed = true,
                LEADER => {
                    if let Some(c) = leader.as_mut() {
                        c.note_event(ev);
                        if ev.is_writable() {
                            gone |= leader_gone(c.flush(poll.registry(), lt))?;
                        }
                    }
                }
                t => {
                    if let Some(c) = clients.get_mut(t.0) {
                        c.conn.note_event(ev);
                        if ev.is_writable() && c.conn.flush(poll.registry(), t).is_err() {
                            to_close.push(t.0);
                            continue;
                        }
                        touched.push(t.0);
                    }
                }
            }
        }
        let Some(c) = leader.as_mut() else { continue };
        gone |= match c.fill(usize::MAX, usize::MAX) {
            Ok(open) => !open,
            Err(e) => leader_gone(Err(e))?,
        };
        // Every whole frame read is written, even when the leader is gone;
        // answers for this node's clients go to them.
        answered.clear();
        while c.input.len() >= FRAME_HEADER_BYTES {
            let h = &c.input.data()[..FRAME_HEADER_BYTES];
            let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[4..12]);
            let seq = u64::from_le_bytes(b);
            let most = if seq == RELAY_SEQ {
                MAX_RELAY_BYTES
            } else {
                MAX_BATCH_BYTES
            };
            if len > most {
                return Err(io::Error::other(format!(
                    "a frame of {len} bytes, over the limit of {most}"
                )));
            }
            if seq != RELAY_SEQ && seq <= received {
                return Err(io::Error::other(format!(
                    "batch {seq} came after batch {received}"
                )));
            }
            if c.input.len() < FRAME_HEADER_BYTES + len {
                break;
            }
            let at = FRAME_HEADER_BYTES;
            let payload = &c.input.data()[at..at + len];
            if seq == RELAY_SEQ {
                let mut from = 0;
                while from < len {
                    let Decoded::Frame { used, .. } =
                        proto::decode_reply(&payload[from..], DEFAULT_MAX_KEY_BYTES)
                    else {
                        return Err(io::Error::other("the leader sent a malformed answer"));
                    };
                    let Some((k, g)) = waiting.pop_front() else {
                        return Err(io::Error::other(
                            "the leader sent more answers than requests were forwarded",
                        ));
                    };
                    if let Some(client) = clients.get_mut(k) {
                        if client.generation == g {
                            client
                                .conn
                                .wbuf
                                .extend_from_slice(&payload[from..from + used]);
                            answered.push(k);
                        }
                    }
                    from += used;
                }
            } else {
                batch.extend_from_slice(payload);
                received = seq;
                stats.batches += 1;
            }
            c.consumed(FRAME_HEADER_BYTES + len);
        }
        // The turn's batches in one write.
        if received > written {
            log.append(received, &batch)?;
            batch.clear();
            written = received;
        }
        if gone {
            // No one to tell; make what was written durable all the same.
            if written > acked {
                log.sync_now()?;
                stats.syncs += 1;
            }
            break;
        }
        if durable_changed {
            let d = log.durable()?;
            if d > acked {
                acked = d;
                c.wbuf.extend_from_slice(&d.to_le_bytes());
            }
        }
        // This node's clients: their requests go to the leader together.
        for (k, cl) in clients.iter() {
            if cl.conn.more_to_read {
                touched.push(k);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for &k in &touched {
            if to_close.contains(&k) {
                continue;
            }
            let Client {
                conn: cc,
                generation,
            } = &mut clients[k];
            match cc.fill(READ_PER_TURN_BYTES, MAX_PENDING_REPLY_BYTES) {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    to_close.push(k);
                    continue;
                }
            }
            let mut at = 0;
            loop {
                match proto::decode_request(&cc.input.data()[at..], DEFAULT_MAX_KEY_BYTES) {
                    Decoded::Incomplete => break,
                    Decoded::Malformed(_) => {
                        to_close.push(k);
                        break;
                    }
                    Decoded::Frame { used, .. } => {
                        if forward.len() + used > MAX_FORWARD_BYTES {
                            cc.more_to_read = true;
                            break;
                        }
                        forward.extend_from_slice(&cc.input.data()[at..at + used]);
                        waiting.push_back((k, *generation));
                        at += used;
                    }
                }
            }
            cc.consumed(at);
        }
        if !forward.is_empty() {
            let word = FORWARD_FLAG | forward.len() as u64;
            c.wbuf.extend_from_slice(&word.to_le_bytes());
            c.wbuf.extend_from_slice(&forward);
            forward.clear();
        }
        if !c.wbuf.is_empty() && leader_gone(c.flush(poll.registry(), lt))? {
            break;
        }
        answered.sort_unstable();
        answered.dedup();
        for &k in &answered {
            if clients.contains(k) && clients[k].conn.flush(poll.registry(), Token(k)).is_err() {
                to_close.push(k);
            }
        }
        for k in to_close.drain(..) {
            if clients.contains(k) {
                let mut cl = clients.remove(k);
                let _ = poll.registry().deregister(&mut cl.conn.stream);
            }
        }
    }
    let (syncs, time) = log.finish();
    stats.syncs += syncs;
    stats.sync_time = time;
    Ok(stats)
}

/// Whether an I/O result on the leader's connection says the leader is gone
/// (a reset or a broken pipe: killed or closed); other errors are errors.
fn leader_gone(r: io::Result<()>) -> io::Result<bool> {
    match r {
        Ok(()) => Ok(false),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            ) =>
        {
            Ok(true)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{ErrorKind, Read, Write};
    use std::net::TcpStream;
    use ticketd::proto::{Reply, Request};

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
        let (addr, stop, leader, mut a, mut b) =
            leader_with_fake_followers("majority", Duration::ZERO);

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
        let (addr, stop, leader, mut a, mut b) =
            leader_with_fake_followers("reuse", Duration::ZERO);
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
        let (_addr, _stop, leader, mut a, _b) =
            leader_with_fake_followers("bogusack", Duration::ZERO);
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
}

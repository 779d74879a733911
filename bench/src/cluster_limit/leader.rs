//! The cluster limit's leader: it reads its clients' requests and the
//! requests its followers forward, makes each turn's requests one batch,
//! sends it to both followers and writes it to its own log, and sends the
//! answers once two of the three nodes hold the batch durably.

use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mio::event::Event;
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;

use super::log::{Log, SyncDelay};
use super::{
    accept_all, connect_retrying, Client, ClusterLimitStats, FORWARD_FLAG, LISTENER,
    MAX_BATCH_BYTES, MAX_FORWARD_BYTES, MAX_PENDING_REPLY_BYTES, PEER_BASE, READ_PER_TURN_BYTES,
    RELAY_SEQ, WAKER,
};
use crate::conn::BufferedConn;
use crate::limit::answer;
use ticketd::limits::DEFAULT_MAX_KEY_BYTES;
use ticketd::proto::{self, Decoded};

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
pub(super) fn committed(mut marks: [u64; 3]) -> u64 {
    marks.sort_unstable();
    marks[1]
}

/// The leader's state between turns.
struct Leader {
    poll: Poll,
    listener: mio::net::TcpListener,
    log: Log,
    /// The connections to the two followers, each with the highest batch
    /// it acknowledged.
    peers: Vec<(BufferedConn, u64)>,
    clients: Slab<Client>,
    /// The generation of the newest client.
    generation: u64,
    stats: ClusterLimitStats,
    /// The token the next `A` answer carries.
    next_token: u64,
    /// The number of the last batch sent.
    seq: u64,
    /// This turn's requests, back to back.
    batch: Vec<u8>,
    /// The answers this turn's batch owes.
    open: Pending,
    /// Batches sent and not yet committed, oldest first.
    inflight: VecDeque<Pending>,
    /// The highest batch the leader's own log holds durably.
    local_durable: u64,
    /// Clients to read (then to flush) this turn.
    touched: Vec<usize>,
    /// Clients to close.
    to_close: Vec<usize>,
    /// Forwarded requests that did not fit this turn's batch wait in a
    /// follower's input: the next turn must not sleep.
    peer_backlog: bool,
    /// Answers owed to each follower's clients, not yet framed.
    relay: [Vec<u8>; 2],
    /// Which followers were sent answers this turn.
    relayed: [bool; 2],
}

pub(super) fn lead(
    listener: TcpListener,
    followers: &[SocketAddr],
    log_path: &std::path::Path,
    log_bytes: u64,
    delay: SyncDelay,
    stop: &AtomicBool,
) -> io::Result<ClusterLimitStats> {
    let mut leader = Leader::start(listener, followers, log_path, log_bytes, delay)?;
    let mut events = Events::with_capacity(1024);
    while !stop.load(Ordering::Relaxed) {
        let backlog =
            leader.peer_backlog || leader.clients.iter().any(|(_, c)| c.conn.more_to_read);
        if !crate::conn::wait(&mut leader.poll, &mut events, backlog)? {
            continue;
        }
        leader.turn(&events)?;
    }
    let mut stats = leader.stats;
    (stats.syncs, stats.sync_time) = leader.log.finish();
    Ok(stats)
}

impl Leader {
    /// Listens for clients, creates the log and connects to both followers.
    fn start(
        listener: TcpListener,
        followers: &[SocketAddr],
        log_path: &std::path::Path,
        log_bytes: u64,
        delay: SyncDelay,
    ) -> io::Result<Leader> {
        if followers.len() != 2 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the cluster limit's leader takes exactly two followers",
            ));
        }
        listener.set_nonblocking(true)?;
        let mut listener = mio::net::TcpListener::from_std(listener);
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let log = Log::create(log_path, log_bytes, waker, delay)?;
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
        Ok(Leader {
            poll,
            listener,
            log,
            peers,
            clients: Slab::new(),
            generation: 0,
            stats: ClusterLimitStats::default(),
            next_token: 0,
            seq: 0,
            batch: Vec::new(),
            open: Pending {
                seq: 0,
                replies: Vec::new(),
                spans: Vec::new(),
            },
            inflight: VecDeque::new(),
            local_durable: 0,
            touched: Vec::new(),
            to_close: Vec::new(),
            peer_backlog: false,
            relay: [Vec::new(), Vec::new()],
            relayed: [false; 2],
        })
    }

    /// One loop turn after `events`: read, batch, send, answer.
    fn turn(&mut self, events: &Events) -> io::Result<()> {
        self.touched.clear();
        for ev in events {
            self.on_event(ev)?;
        }
        for (k, c) in self.clients.iter() {
            if c.conn.more_to_read {
                self.touched.push(k);
            }
        }
        self.touched.sort_unstable();
        self.touched.dedup();
        // The followers' acknowledgements, and the requests they forwarded
        // from their own clients: those join this turn's batch, each frame
        // whole (one that does not fit waits for the next turn's batch).
        self.peer_backlog = false;
        for i in 0..self.peers.len() {
            self.take_from_follower(i)?;
        }
        self.read_clients();
        for k in self.to_close.drain(..) {
            if self.clients.contains(k) {
                let mut c = self.clients.remove(k);
                let _ = self.poll.registry().deregister(&mut c.conn.stream);
            }
        }
        self.send_batch()?;
        self.answer_committed()?;
        self.touched.sort_unstable();
        self.touched.dedup();
        for &k in &self.touched {
            if self.clients[k]
                .conn
                .flush(self.poll.registry(), Token(k))
                .is_err()
            {
                self.to_close.push(k);
            }
        }
        for k in self.to_close.drain(..) {
            let mut c = self.clients.remove(k);
            let _ = self.poll.registry().deregister(&mut c.conn.stream);
        }
        Ok(())
    }

    /// One event: a client to accept, a sync done, a follower's bytes, or a
    /// client to read.
    fn on_event(&mut self, ev: &Event) -> io::Result<()> {
        let t = ev.token();
        if t == LISTENER {
            accept_all(
                &self.listener,
                &mut self.clients,
                &mut self.generation,
                self.poll.registry(),
            )?;
        } else if t == WAKER {
            self.local_durable = self.log.durable()?;
        } else if t.0 >= PEER_BASE {
            let (peer, _) = &mut self.peers[t.0 - PEER_BASE];
            peer.note_event(ev);
            if !peer.fill(usize::MAX, usize::MAX)? {
                return Err(io::Error::other("a follower closed its connection"));
            }
            if ev.is_writable() {
                peer.flush(self.poll.registry(), t)?;
            }
        } else if let Some(c) = self.clients.get_mut(t.0) {
            c.conn.note_event(ev);
            // Answers held back by a full socket go out as it drains.
            if ev.is_writable() && c.conn.flush(self.poll.registry(), t).is_err() {
                self.to_close.push(t.0);
                return Ok(());
            }
            self.touched.push(t.0);
        }
        Ok(())
    }

    /// Follower `i`'s acknowledgements, and the frames of requests it
    /// forwarded, each whole, while they fit this turn's batch.
    fn take_from_follower(&mut self, i: usize) -> io::Result<()> {
        let (peer, acked) = &mut self.peers[i];
        loop {
            let data = peer.input.data();
            let Some(word) = data.get(..8) else { break };
            let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            if word & FORWARD_FLAG == 0 {
                if word > self.seq {
                    return Err(io::Error::other(format!(
                        "a follower acknowledged batch {word}, but only {} were sent",
                        self.seq
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
            if self.batch.len() + len > MAX_BATCH_BYTES {
                self.peer_backlog = true;
                break;
            }
            let mut at = 0;
            while at < len {
                match proto::decode_request(&frame[at..], DEFAULT_MAX_KEY_BYTES) {
                    Decoded::Frame { frame: req, used } => {
                        self.batch.extend_from_slice(&frame[at..at + used]);
                        at += used;
                        self.stats.requests += 1;
                        answer(req, &mut self.next_token, &mut self.open.replies);
                        let end = self.open.replies.len();
                        self.open.spans.push((PEER_BASE + i, 0, end));
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
        Ok(())
    }

    /// Reads every touched client; their requests make this turn's batch,
    /// up to its limit (what is left waits for the next turn).
    fn read_clients(&mut self) {
        for &k in &self.touched {
            if self.to_close.contains(&k) {
                continue;
            }
            let Client {
                conn: c,
                generation,
            } = &mut self.clients[k];
            match c.fill(READ_PER_TURN_BYTES, MAX_PENDING_REPLY_BYTES) {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    self.to_close.push(k);
                    continue;
                }
            }
            let mut at = 0;
            loop {
                match proto::decode_request(&c.input.data()[at..], DEFAULT_MAX_KEY_BYTES) {
                    Decoded::Incomplete => break,
                    Decoded::Malformed(_) => {
                        self.to_close.push(k);
                        break;
                    }
                    Decoded::Frame { frame, used } => {
                        if self.batch.len() + used > MAX_BATCH_BYTES {
                            c.more_to_read = true;
                            break;
                        }
                        self.batch.extend_from_slice(&c.input.data()[at..at + used]);
                        at += used;
                        self.stats.requests += 1;
                        answer(frame, &mut self.next_token, &mut self.open.replies);
                        let end = self.open.replies.len();
                        self.open.spans.push((k, *generation, end));
                    }
                }
            }
            c.consumed(at);
        }
    }

    /// Sends the turn's batch to both followers, then writes it locally;
    /// its answers wait in flight for the commit.
    fn send_batch(&mut self) -> io::Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        self.seq += 1;
        self.stats.batches += 1;
        let len = u32::try_from(self.batch.len()).map_err(|_| io::Error::other("batch too big"))?;
        for (i, (peer, _)) in self.peers.iter_mut().enumerate() {
            peer.wbuf.extend_from_slice(&len.to_le_bytes());
            peer.wbuf.extend_from_slice(&self.seq.to_le_bytes());
            peer.wbuf.extend_from_slice(&self.batch);
            peer.flush(self.poll.registry(), Token(PEER_BASE + i))?;
        }
        self.log.append(self.seq, &self.batch)?;
        self.batch.clear();
        self.open.seq = self.seq;
        let next = Pending {
            seq: 0,
            replies: Vec::with_capacity(self.open.replies.capacity()),
            spans: Vec::with_capacity(self.open.spans.capacity()),
        };
        self.inflight
            .push_back(std::mem::replace(&mut self.open, next));
        Ok(())
    }

    /// The answers of every committed batch: into their clients' buffers
    /// (the clients to flush become `touched`), or framed for the follower
    /// whose client asked.
    fn answer_committed(&mut self) -> io::Result<()> {
        let done = committed([self.local_durable, self.peers[0].1, self.peers[1].1]);
        self.touched.clear();
        while self.inflight.front().is_some_and(|p| p.seq <= done) {
            let Some(p) = self.inflight.pop_front() else {
                break;
            };
            let mut from = 0;
            for &(k, generation, end) in &p.spans {
                if k >= PEER_BASE {
                    self.relay[k - PEER_BASE].extend_from_slice(&p.replies[from..end]);
                } else if let Some(c) = self.clients.get_mut(k) {
                    if c.generation == generation {
                        c.conn.wbuf.extend_from_slice(&p.replies[from..end]);
                        self.touched.push(k);
                    }
                }
                from = end;
            }
            self.frame_relays()?;
        }
        for (i, sent) in self.relayed.iter_mut().enumerate() {
            if std::mem::take(sent) {
                self.peers[i]
                    .0
                    .flush(self.poll.registry(), Token(PEER_BASE + i))?;
            }
        }
        Ok(())
    }

    /// The answers a follower's clients are owed, in the order it
    /// forwarded their requests, one frame per committed batch.
    fn frame_relays(&mut self) -> io::Result<()> {
        for (i, r) in self.relay.iter_mut().enumerate() {
            if !r.is_empty() {
                let (peer, _) = &mut self.peers[i];
                let len =
                    u32::try_from(r.len()).map_err(|_| io::Error::other("answers too big"))?;
                peer.wbuf.extend_from_slice(&len.to_le_bytes());
                peer.wbuf.extend_from_slice(&RELAY_SEQ.to_le_bytes());
                peer.wbuf.extend_from_slice(r);
                r.clear();
                self.relayed[i] = true;
            }
        }
        Ok(())
    }
}

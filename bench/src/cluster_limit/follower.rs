//! The cluster limit's follower: it writes every batch the leader sends to
//! its log and acknowledges what each `fdatasync` covered; with clients of
//! its own, it forwards their requests to the leader each turn and passes
//! on the answers the leader sends back once their batch is committed.

use std::collections::VecDeque;
use std::io;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mio::event::Event;
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;

use super::log::{Log, SyncDelay};
use super::{
    accept_all, leader_gone, Client, ClusterLimitStats, CLIENT_LISTENER, FORWARD_FLAG,
    FRAME_HEADER_BYTES, LEADER, LISTENER, MAX_BATCH_BYTES, MAX_FORWARD_BYTES,
    MAX_PENDING_REPLY_BYTES, MAX_RELAY_BYTES, READ_PER_TURN_BYTES, RELAY_SEQ, WAKER,
};
use crate::conn::BufferedConn;
use ticketd::limits::DEFAULT_MAX_KEY_BYTES;
use ticketd::proto::{self, Decoded};

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

/// The follower's state between turns.
struct Follower {
    poll: Poll,
    log: Log,
    /// Where the leader connects.
    listener: mio::net::TcpListener,
    /// Where this node's own clients connect (registered once the leader
    /// is there).
    client_listener: Option<mio::net::TcpListener>,
    stats: ClusterLimitStats,
    /// The leader's connection, once it has come.
    leader: Option<BufferedConn>,
    /// The last batch received.
    received: u64,
    /// The last batch written to the log.
    written: u64,
    /// The last batch acknowledged.
    acked: u64,
    /// Batches received this turn, back to back.
    batch: Vec<u8>,
    clients: Slab<Client>,
    /// The generation of the newest client.
    generation: u64,
    /// The clients whose forwarded requests await their answers, in the
    /// order forwarded: slot and generation.
    waiting: VecDeque<(usize, u64)>,
    /// This turn's requests for the leader, back to back.
    forward: Vec<u8>,
    /// Clients to read this turn.
    touched: Vec<usize>,
    /// Clients to close.
    to_close: Vec<usize>,
    /// Clients given answers this turn, to flush.
    answered: Vec<usize>,
}

pub(super) fn follow(
    listener: TcpListener,
    client_listener: Option<TcpListener>,
    log_path: &std::path::Path,
    log_bytes: u64,
    delay: SyncDelay,
    stop: &AtomicBool,
) -> io::Result<ClusterLimitStats> {
    let mut follower = Follower::start(listener, client_listener, log_path, log_bytes, delay)?;
    let mut events = Events::with_capacity(1024);
    while !stop.load(Ordering::Relaxed) {
        let backlog = follower.clients.iter().any(|(_, c)| c.conn.more_to_read);
        if !crate::conn::wait(&mut follower.poll, &mut events, backlog)? {
            continue;
        }
        if !follower.turn(&events)? {
            break;
        }
    }
    let mut stats = follower.stats;
    let (syncs, time) = follower.log.finish();
    stats.syncs += syncs;
    stats.sync_time = time;
    Ok(stats)
}

impl Follower {
    /// Creates the log and listens for the leader (and, with
    /// `client_listener`, for clients once the leader is there).
    fn start(
        listener: TcpListener,
        client_listener: Option<TcpListener>,
        log_path: &std::path::Path,
        log_bytes: u64,
        delay: SyncDelay,
    ) -> io::Result<Follower> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let log = Log::create(log_path, log_bytes, waker, delay)?;
        listener.set_nonblocking(true)?;
        let mut listener = mio::net::TcpListener::from_std(listener);
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let client_listener = match client_listener {
            Some(l) => {
                l.set_nonblocking(true)?;
                Some(mio::net::TcpListener::from_std(l))
            }
            None => None,
        };
        Ok(Follower {
            poll,
            log,
            listener,
            client_listener,
            stats: ClusterLimitStats::default(),
            leader: None,
            received: 0,
            written: 0,
            acked: 0,
            batch: Vec::new(),
            clients: Slab::new(),
            generation: 0,
            waiting: VecDeque::new(),
            forward: Vec::new(),
            touched: Vec::new(),
            to_close: Vec::new(),
            answered: Vec::new(),
        })
    }

    /// One loop turn after `events`; `false` when the follower is done
    /// (the leader is gone).
    fn turn(&mut self, events: &Events) -> io::Result<bool> {
        let mut durable_changed = false;
        let mut gone = false;
        self.touched.clear();
        for ev in events {
            self.on_event(ev, &mut durable_changed, &mut gone)?;
        }
        let Some(c) = self.leader.as_mut() else {
            return Ok(true);
        };
        gone |= match c.fill(usize::MAX, usize::MAX) {
            Ok(open) => !open,
            Err(e) => leader_gone(Err(e))?,
        };
        // Every whole frame read is written, even when the leader is gone;
        // answers for this node's clients go to them.
        self.answered.clear();
        self.take_frames()?;
        // The turn's batches in one write.
        if self.received > self.written {
            self.log.append(self.received, &self.batch)?;
            self.batch.clear();
            self.written = self.received;
        }
        if gone {
            // No one to tell; make what was written durable all the same.
            if self.written > self.acked {
                self.log.sync_now()?;
                self.stats.syncs += 1;
            }
            return Ok(false);
        }
        if durable_changed {
            self.acknowledge()?;
        }
        self.read_clients();
        if self.send_to_leader()? {
            return Ok(false);
        }
        self.answered.sort_unstable();
        self.answered.dedup();
        for &k in &self.answered {
            if self.clients.contains(k)
                && self.clients[k]
                    .conn
                    .flush(self.poll.registry(), Token(k))
                    .is_err()
            {
                self.to_close.push(k);
            }
        }
        for k in self.to_close.drain(..) {
            if self.clients.contains(k) {
                let mut cl = self.clients.remove(k);
                let _ = self.poll.registry().deregister(&mut cl.conn.stream);
            }
        }
        Ok(true)
    }

    /// One event: the leader (or another connection) to accept, a client to
    /// accept, a sync done (`durable_changed`), the leader's connection
    /// writable (`gone` if it is closed), or a client to read.
    fn on_event(
        &mut self,
        ev: &Event,
        durable_changed: &mut bool,
        gone: &mut bool,
    ) -> io::Result<()> {
        match ev.token() {
            LISTENER => self.accept_leader()?,
            CLIENT_LISTENER => {
                if let Some(l) = self.client_listener.as_ref() {
                    accept_all(
                        l,
                        &mut self.clients,
                        &mut self.generation,
                        self.poll.registry(),
                    )?;
                }
            }
            WAKER => *durable_changed = true,
            LEADER => {
                if let Some(c) = self.leader.as_mut() {
                    c.note_event(ev);
                    if ev.is_writable() {
                        *gone |= leader_gone(c.flush(self.poll.registry(), LEADER))?;
                    }
                }
            }
            t => {
                if let Some(c) = self.clients.get_mut(t.0) {
                    c.conn.note_event(ev);
                    if ev.is_writable() && c.conn.flush(self.poll.registry(), t).is_err() {
                        self.to_close.push(t.0);
                        return Ok(());
                    }
                    self.touched.push(t.0);
                }
            }
        }
        Ok(())
    }

    /// The first connection is the leader's; any later one is closed at
    /// once. Clients are taken only once it is there.
    fn accept_leader(&mut self) -> io::Result<()> {
        loop {
            match self.listener.accept() {
                Ok((mut s, _)) if self.leader.is_none() => {
                    let _ = s.set_nodelay(true);
                    self.poll
                        .registry()
                        .register(&mut s, LEADER, Interest::READABLE)?;
                    self.leader = Some(BufferedConn::new(s));
                    if let Some(l) = self.client_listener.as_mut() {
                        self.poll
                            .registry()
                            .register(l, CLIENT_LISTENER, Interest::READABLE)?;
                    }
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Ok(()),
            }
        }
    }

    /// Every whole frame the leader sent: a batch (kept for the log) or the
    /// answers owed to this node's clients (passed on).
    fn take_frames(&mut self) -> io::Result<()> {
        let Some(c) = self.leader.as_mut() else {
            return Ok(());
        };
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
            if seq != RELAY_SEQ && seq <= self.received {
                return Err(io::Error::other(format!(
                    "batch {seq} came after batch {}",
                    self.received
                )));
            }
            if c.input.len() < FRAME_HEADER_BYTES + len {
                break;
            }
            let at = FRAME_HEADER_BYTES;
            let payload = &c.input.data()[at..at + len];
            if seq == RELAY_SEQ {
                pass_answers(
                    payload,
                    &mut self.waiting,
                    &mut self.clients,
                    &mut self.answered,
                )?;
            } else {
                self.batch.extend_from_slice(payload);
                self.received = seq;
                self.stats.batches += 1;
            }
            c.consumed(FRAME_HEADER_BYTES + len);
        }
        Ok(())
    }

    /// Acknowledges the highest durable batch, if it moved.
    fn acknowledge(&mut self) -> io::Result<()> {
        let d = self.log.durable()?;
        if d > self.acked {
            self.acked = d;
            if let Some(c) = self.leader.as_mut() {
                c.wbuf.extend_from_slice(&d.to_le_bytes());
            }
        }
        Ok(())
    }

    /// This node's clients: their requests go to the leader together, up
    /// to a frame's limit (what is left waits for the next turn).
    fn read_clients(&mut self) {
        for (k, cl) in self.clients.iter() {
            if cl.conn.more_to_read {
                self.touched.push(k);
            }
        }
        self.touched.sort_unstable();
        self.touched.dedup();
        for &k in &self.touched {
            if self.to_close.contains(&k) {
                continue;
            }
            let Client {
                conn: cc,
                generation,
            } = &mut self.clients[k];
            match cc.fill(READ_PER_TURN_BYTES, MAX_PENDING_REPLY_BYTES) {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    self.to_close.push(k);
                    continue;
                }
            }
            let mut at = 0;
            loop {
                match proto::decode_request(&cc.input.data()[at..], DEFAULT_MAX_KEY_BYTES) {
                    Decoded::Incomplete => break,
                    Decoded::Malformed(_) => {
                        self.to_close.push(k);
                        break;
                    }
                    Decoded::Frame { used, .. } => {
                        if self.forward.len() + used > MAX_FORWARD_BYTES {
                            cc.more_to_read = true;
                            break;
                        }
                        self.forward
                            .extend_from_slice(&cc.input.data()[at..at + used]);
                        self.waiting.push_back((k, *generation));
                        at += used;
                    }
                }
            }
            cc.consumed(at);
        }
    }

    /// Frames the turn's forwarded requests and sends what the leader is
    /// owed; `true` if the leader turned out to be gone.
    fn send_to_leader(&mut self) -> io::Result<bool> {
        let Some(c) = self.leader.as_mut() else {
            return Ok(false);
        };
        if !self.forward.is_empty() {
            let word = FORWARD_FLAG | self.forward.len() as u64;
            c.wbuf.extend_from_slice(&word.to_le_bytes());
            c.wbuf.extend_from_slice(&self.forward);
            self.forward.clear();
        }
        Ok(!c.wbuf.is_empty() && leader_gone(c.flush(self.poll.registry(), LEADER))?)
    }
}

/// A frame of answers from the leader: each goes to the client that sent
/// the request it answers (the oldest in `waiting`), unless that client
/// has gone since; the clients given one join `answered`.
fn pass_answers(
    payload: &[u8],
    waiting: &mut VecDeque<(usize, u64)>,
    clients: &mut Slab<Client>,
    answered: &mut Vec<usize>,
) -> io::Result<()> {
    let mut from = 0;
    while from < payload.len() {
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
    Ok(())
}

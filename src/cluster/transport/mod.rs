//! Peer transport: Raft messages between nodes over TCP, in the server's own
//! mio poll loop.
//!
//! * **Framing**: a u32 big-endian length, then the protobuf bytes of one
//!   raft `Message`. Frames above the frame limit close the connection. A
//!   snapshot travels inline in one frame, so the service sets the limit
//!   from the lock table's capacity ([`Transport::set_max_frame_bytes`]);
//!   it is never below [`MAX_FRAME_BYTES`]. A frame's buffer grows only
//!   with the bytes that arrive, never from the length a peer announces.
//!   Appends with the same entries share one encoding of them
//!   ([`Transport::send_all`]).
//! * **Connections**: one outbound connection per peer, written only; the
//!   connections peers open to us are read only. The first frame on every
//!   connection is a [`Hello`] naming the cluster, the voter set, the sender
//!   and its data directory id, and the data directory id the sender has on
//!   record for the receiver; a mismatch closes the connection (or, when an
//!   authenticated peer says the receiver's own directory was wiped, stops
//!   the node). In plaintext a receiver id that is not ours leaves the
//!   connection unauthenticated instead: it may be a stranger's made-up id
//!   that the real peer echoes, and that peer's own id must still reach us
//!   (see [`Transport`]'s `unconfirmed`).
//! * **Authentication** (docs/SECURITY.md): with peer TLS
//!   ([`Transport::set_tls`]) a connection is authenticated by a
//!   certificate from the cluster CA naming the node its hello claims; in
//!   plaintext, by a fully checked hello that also carries the receiver's
//!   own data directory id. Until then nothing the connection says is kept
//!   or acted on (its messages are dropped and counted); a connection not
//!   authenticated within [`AUTH_DEADLINE_MS`] is closed, and when the
//!   [`MAX_INBOUND`] slots are full the oldest unauthenticated one makes
//!   room. Every message's `from` and `to` must be the connection's peer
//!   and this node. Refusal warnings are rate-limited.
//! * **Failures**: each peer has a bounded outbound buffer. When a message
//!   does not fit, or the connection fails, queued messages are dropped and
//!   the service reports the peer unreachable to raft (and each dropped
//!   snapshot as failed; a snapshot fully written is reported finished).
//!   A connection attempt still in progress after the connect timeout
//!   (one election timeout, [`Transport::set_election_timeout_ms`]) fails
//!   the same way: a peer that never answers a SYN is reported unreachable
//!   like one that refuses. Reconnects back off from 100 ms to 1 s, and
//!   start at once when the peer's hello reaches us: a link that carries
//!   its connection likely carries ours again.
//! * **Silent links**: outbound sockets carry `TCP_USER_TIMEOUT` of three
//!   election timeouts, so a connection whose data goes unacknowledged (a
//!   partition) fails and is reconnected with backoff, rather than waiting,
//!   after the link heals, for the kernel's next retransmission (its interval
//!   doubles up to two minutes). A new hello from a peer closes that peer's
//!   older inbound connections: it gave them up, and their end may never
//!   reach us.
//!
//! The parts: `frame` (the framing, its limits and the hello), `outbound`
//! (connecting, backoff, writing), `inbound` (accepting, authenticating,
//! reading) and `encode` (raft messages as frame payloads).

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;

use mio::net::TcpListener;
use mio::{Interest, Registry, Token};
use raft::eraftpb::Message;

use crate::cluster::tls::PeerTls;
use crate::limits::MAX_ALLOC_BYTES;
use crate::server::ratelimit::LogLimit;
use crate::time::Millis;

mod encode;
mod frame;
mod inbound;
mod outbound;

pub use frame::{
    frame_ceiling, frame_len, frame_limit, hash64, FrameError, Hello, MAX_FRAME_BYTES,
    MEMBERSHIP_MARK, PEER_BUFFER_SLACK_BYTES,
};
use inbound::Inbound;
use outbound::Peer;

/// A buffer emptied with more capacity than this gives it back, so that
/// one snapshot does not pin its size for the life of the process.
pub(super) const KEEP_BUFFER_BYTES: usize = 4 << 20;

/// Connections from peers accepted at once. When all are taken, the oldest
/// connection not yet authenticated makes room for a new one.
pub const MAX_INBOUND: usize = 64;
/// How long a connection a peer opened has to authenticate (a complete,
/// fully checked hello; with TLS, the handshake too) before it is closed.
pub const AUTH_DEADLINE_MS: u64 = 2000;
/// Refusal warnings: at most this many per window.
const REFUSAL_LOG_BURST: u32 = 5;
const REFUSAL_LOG_WINDOW_MS: u64 = 10_000;

/// Peers one transport connects to (the tokens between the listener's and
/// the inbound connections').
const MAX_PEERS: usize = 64;
pub(super) const READ_CHUNK: usize = 64 * 1024;
/// The election timeout assumed until the service sets it (raft's default:
/// 10 ticks of 100 ms).
const DEFAULT_ELECTION_TIMEOUT_MS: u64 = 1000;

/// Empties `buf`, giving its memory back when a large frame grew it.
pub(super) fn reset_buffer(buf: &mut Vec<u8>) {
    if buf.capacity() > KEEP_BUFFER_BYTES {
        *buf = Vec::new();
    } else {
        buf.clear();
    }
}

/// Why a peer connection closes: what the socket or TLS said, or what the
/// peer sent.
#[derive(Debug)]
pub(super) enum Closed {
    /// The socket failed.
    Io(io::Error),
    /// The peer closed the connection.
    ByPeer,
    /// A write made no progress: the connection is gone.
    Gone,
    /// TLS failed (a certificate refused, a bad record).
    Tls(rustls::Error),
    /// TLS failed reading records or plaintext.
    TlsIo(io::Error),
    /// The peer wrote on our outbound connection, which it only reads.
    WroteOnOutbound,
    /// A frame is refused.
    Frame(FrameError),
    /// A message that is not raft's protobuf.
    Undecodable(protobuf::ProtobufError),
    /// The hello is refused: why.
    Hello(String),
}

impl Closed {
    /// A TLS failure: a certificate refused, either way, is worth a warning.
    pub(super) fn is_tls(&self) -> bool {
        matches!(self, Closed::Tls(_) | Closed::TlsIo(_))
    }
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Closed::Io(e) => write!(f, "{e}"),
            Closed::ByPeer => f.write_str("closed by peer"),
            Closed::Gone => f.write_str("connection closed"),
            Closed::Tls(e) => write!(f, "TLS: {e}"),
            Closed::TlsIo(e) => write!(f, "TLS: {e}"),
            Closed::WroteOnOutbound => f.write_str("the peer wrote on a connection it only reads"),
            Closed::Frame(e) => write!(f, "{e}"),
            Closed::Undecodable(e) => write!(f, "undecodable message: {e}"),
            Closed::Hello(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for Closed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Closed::Io(e) | Closed::TlsIo(e) => Some(e),
            Closed::Tls(e) => Some(e),
            Closed::Frame(e) => Some(e),
            Closed::Undecodable(e) => Some(e),
            Closed::ByPeer | Closed::Gone | Closed::WroteOnOutbound | Closed::Hello(_) => None,
        }
    }
}

/// What the transport tells the service.
#[derive(Debug)]
pub enum PeerEvent {
    /// A raft message from a peer.
    Message(Message),
    /// Messages to this peer were dropped.
    Unreachable(u64),
    /// A snapshot to this peer was fully written (true) or dropped (false).
    Snapshot(u64, bool),
    /// A peer's data directory id, seen for the first time.
    PeerSeen(u64, u64),
    /// This node must stop (its data directory was wiped).
    Fatal(String),
}

/// Who we are, for hellos.
#[derive(Clone, Debug)]
pub struct LocalInfo {
    /// This node's id.
    pub id: u64,
    /// Hash of the cluster name.
    pub cluster: u64,
    /// [`MEMBERSHIP_MARK`].
    pub voters: u64,
    /// This data directory's id.
    pub uuid: u64,
    /// Peer id -> data directory id first seen.
    pub known: BTreeMap<u64, u64>,
}

/// The peer listener and connections. See the module documentation.
#[derive(Debug)]
pub struct Transport {
    local: LocalInfo,
    listener: TcpListener,
    base: usize,
    peers: BTreeMap<u64, Peer>,
    inbound: slab::Slab<Inbound>,
    /// Inbound connections superseded by a newer hello from the same peer.
    stale_inbound: Vec<usize>,
    /// Peers whose hello just arrived.
    heard: Vec<u64>,
    events: Vec<PeerEvent>,
    connect_timeout_ms: u64,
    user_timeout_ms: u64,
    /// Where inbound reads land before their connection's buffer.
    scratch: Box<[u8]>,
    /// Largest frame accepted or sent.
    max_frame: usize,
    /// Outbound bytes buffered per peer before messages are dropped.
    max_peer_buffer: usize,
    /// Plaintext: the data directory id in the latest checked hello of a
    /// peer not yet pinned, echoed in our hello to it (never persisted,
    /// never acted on). A hint, one per peer: the next checked hello
    /// replaces it, whatever id it names for us, so the real peer's
    /// overrides a stranger's. A refused hello never touches it.
    unconfirmed: BTreeMap<u64, u64>,
    /// Raft messages dropped: not from an authenticated connection, or not
    /// from its peer to this node.
    dropped: u64,
    /// Refusal warnings, rate-limited.
    refusals: LogLimit,
    /// Dropped-message warnings, rate-limited.
    drops: LogLimit,
    /// Peer TLS, when configured.
    tls: Option<PeerTls>,
}

impl Transport {
    /// Binds the peer listener on `listen` (this node's peer address).
    pub fn bind(
        local: LocalInfo,
        listen: SocketAddr,
        peers: &BTreeMap<u64, SocketAddr>,
    ) -> io::Result<Self> {
        let listener = TcpListener::bind(listen)?;
        let peers = peers
            .iter()
            .filter(|(id, _)| **id != local.id)
            .take(MAX_PEERS)
            .map(|(id, addr)| (*id, Peer::new(*addr)))
            .collect();
        Ok(Transport {
            local,
            listener,
            base: 0,
            peers,
            inbound: slab::Slab::new(),
            stale_inbound: Vec::new(),
            heard: Vec::new(),
            events: Vec::new(),
            connect_timeout_ms: DEFAULT_ELECTION_TIMEOUT_MS,
            user_timeout_ms: 3 * DEFAULT_ELECTION_TIMEOUT_MS,
            scratch: vec![0; READ_CHUNK].into_boxed_slice(),
            max_frame: MAX_FRAME_BYTES,
            max_peer_buffer: MAX_FRAME_BYTES + PEER_BUFFER_SLACK_BYTES,
            unconfirmed: BTreeMap::new(),
            dropped: 0,
            refusals: LogLimit::new(REFUSAL_LOG_BURST, REFUSAL_LOG_WINDOW_MS),
            drops: LogLimit::new(1, REFUSAL_LOG_WINDOW_MS),
            tls: None,
        })
    }

    /// Speaks mutual TLS with every peer from now on (before the first
    /// connection). See [`crate::cluster::tls`].
    pub fn set_tls(&mut self, tls: PeerTls) {
        self.tls = Some(tls);
    }

    /// Sets the election timeout the peer timeouts derive from: a connect
    /// attempt is given up after one election timeout, a connection whose
    /// data goes unacknowledged after three.
    pub fn set_election_timeout_ms(&mut self, ms: u64) {
        self.connect_timeout_ms = ms.max(1);
        self.user_timeout_ms = ms.max(1).saturating_mul(3);
    }

    /// Sets the largest frame sent or accepted to `bytes`, kept within
    /// [`MAX_FRAME_BYTES`] and [`frame_ceiling`] (what the u32 length
    /// prefix carries and this build's address space allows), and the
    /// per-peer outbound buffer to that plus [`PEER_BUFFER_SLACK_BYTES`].
    /// The service passes the size of the largest snapshot its lock table
    /// can have, so any snapshot it makes can be shipped and any a peer
    /// with the same limits ships is taken.
    pub fn set_max_frame_bytes(&mut self, bytes: u64) {
        let limit = frame_limit(bytes, MAX_ALLOC_BYTES);
        // Within the length prefix and half of one allocation: a usize.
        self.max_frame = usize::try_from(limit).expect("frame limit fits the address space");
        self.max_peer_buffer = self.max_frame.saturating_add(PEER_BUFFER_SLACK_BYTES);
    }

    /// The largest frame sent or accepted.
    #[must_use]
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame
    }

    /// The address the peer listener is bound to.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Tokens used: `base` .. `base + 1 + 64 + MAX_INBOUND`.
    pub fn register(&mut self, registry: &Registry, base: usize) -> io::Result<()> {
        self.base = base;
        registry.register(&mut self.listener, Token(base), Interest::READABLE)
    }

    /// Changes the peers to `peers` (this node's own id left out): after a
    /// membership change, with the addresses of the replicated
    /// configuration. Peer tokens follow the order of the ids, so when the
    /// set or an address changes every outbound connection is reopened
    /// (queued messages are reported dropped, as on any lost connection);
    /// inbound connections of peers no longer listed are closed. Returns
    /// whether anything changed.
    pub fn set_peers(
        &mut self,
        peers: &BTreeMap<u64, SocketAddr>,
        now: Millis,
        registry: Option<&Registry>,
    ) -> bool {
        let wanted: BTreeMap<u64, SocketAddr> = peers
            .iter()
            .filter(|(id, _)| **id != self.local.id)
            .take(MAX_PEERS)
            .map(|(id, a)| (*id, *a))
            .collect();
        let same = wanted.len() == self.peers.len()
            && wanted
                .iter()
                .all(|(id, a)| self.peers.get(id).is_some_and(|p| p.addr == *a));
        if same {
            return false;
        }
        log::info!(
            "peers now {:?}",
            wanted
                .iter()
                .map(|(id, a)| format!("{id}={a}"))
                .collect::<Vec<_>>()
        );
        let ids: Vec<u64> = self.peers.keys().copied().collect();
        for id in ids {
            if let Some(r) = registry {
                self.fail_peer(id, now, r, "the peer set changed");
            }
        }
        let old = std::mem::take(&mut self.peers);
        for (id, addr) in wanted {
            let mut p = Peer::new(addr);
            if let Some(o) = old.get(&id) {
                p.hello_to_uuid = o.hello_to_uuid;
            }
            self.peers.insert(id, p);
        }
        if let Some(r) = registry {
            let gone: Vec<usize> = self
                .inbound
                .iter()
                .filter(|(_, c)| c.peer.is_some_and(|id| !self.peers.contains_key(&id)))
                .map(|(k, _)| k)
                .collect();
            for key in gone {
                self.close_inbound(key, now, r, "no longer a member");
            }
        }
        true
    }

    pub(super) fn peer_token(&self, id: u64) -> Token {
        let idx = self.peers.keys().position(|k| *k == id).unwrap_or(0);
        Token(self.base + 1 + idx)
    }

    pub(super) fn inbound_base(&self) -> usize {
        self.base + 1 + 64
    }

    /// True when `token` belongs to the transport.
    #[must_use]
    pub fn owns(&self, token: Token) -> bool {
        token.0 >= self.base && token.0 < self.inbound_base() + MAX_INBOUND
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<PeerEvent> {
        std::mem::take(&mut self.events)
    }

    /// Records a peer's data directory id (after the service persisted it).
    pub fn set_known(&mut self, id: u64, uuid: u64) {
        self.local.known.insert(id, uuid);
    }

    /// Raft messages dropped so far: they came on a connection not (yet)
    /// authenticated, or named another sender or receiver than it.
    #[must_use]
    pub fn dropped_messages(&self) -> u64 {
        self.dropped
    }

    /// Connections peers opened to us that are authenticated.
    #[must_use]
    pub fn authenticated_inbound(&self) -> usize {
        self.inbound.iter().filter(|(_, c)| c.trusted).count()
    }

    /// What we know of peer `id`'s data directory id (0: nothing).
    pub(super) fn knowledge(&self, id: u64) -> u64 {
        self.local
            .known
            .get(&id)
            .or_else(|| self.unconfirmed.get(&id))
            .copied()
            .unwrap_or(0)
    }

    /// A rate-limited refusal warning.
    pub(super) fn refusal(&mut self, now: Millis, what: std::fmt::Arguments<'_>) {
        if let Some(n) = self.refusals.allow(now) {
            if n > 0 {
                log::warn!("{what} ({n} similar refusals not logged)");
            } else {
                log::warn!("{what}");
            }
        }
    }

    /// Gives up connection attempts past their timeout and opens
    /// connections whose backoff has passed.
    pub fn tick(&mut self, now: Millis, registry: &Registry) {
        let late: Vec<usize> = self
            .inbound
            .iter()
            .filter(|(_, c)| !c.trusted && c.opened.add_ms(AUTH_DEADLINE_MS) <= now)
            .map(|(k, _)| k)
            .collect();
        for key in late {
            self.close_inbound(key, now, registry, "not authenticated in time");
        }
        let ids: Vec<u64> = self.peers.keys().copied().collect();
        for &id in &ids {
            let stuck = self.peers.get(&id).is_some_and(|p| {
                p.stream.is_some()
                    && ((!p.connected && p.connect_by <= now)
                        || p.auth_by.is_some_and(|by| by <= now))
            });
            if stuck {
                // A SYN nobody answers (a dropped link, a full backlog)
                // would keep messages queued here with raft none the wiser.
                self.fail_peer(id, now, registry, "connect timed out");
            }
        }
        for id in ids {
            let due = self
                .peers
                .get(&id)
                .is_some_and(|p| p.stream.is_none() && p.retry_at <= now);
            if due {
                self.connect(id, now, registry);
            }
        }
    }

    /// The next reconnect attempt or connect timeout.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Millis> {
        let auth = self
            .inbound
            .iter()
            .filter(|(_, c)| !c.trusted)
            .map(|(_, c)| c.opened.add_ms(AUTH_DEADLINE_MS))
            .min();
        self.peers
            .values()
            .filter_map(|p| match (&p.stream, p.connected) {
                (None, _) => Some(p.retry_at),
                (Some(_), false) => Some(p.connect_by),
                (Some(_), true) => p.auth_by,
            })
            .chain(auth)
            .min()
    }

    /// Handles a readiness event for one of the transport's tokens.
    pub fn event(&mut self, now: Millis, registry: &Registry, event: &mio::event::Event) {
        let t = event.token().0;
        if t == self.base {
            self.accept(now, registry);
        } else if t < self.inbound_base() {
            let idx = t - self.base - 1;
            let Some(id) = self.peers.keys().nth(idx).copied() else {
                return;
            };
            self.outbound_event(id, now, registry, event);
        } else {
            // A close or error the event reports has no edge to come: read
            // on to the EOF even after a short read.
            let drain = event.is_read_closed() || event.is_error();
            self.inbound_event(t - self.inbound_base(), now, registry, drain);
        }
    }
}

#[cfg(test)]
mod first_contact;

#[cfg(test)]
mod tests;

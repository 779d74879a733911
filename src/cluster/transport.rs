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

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::SocketAddr;

use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Registry, Token};
use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};

use crate::cluster::tls::PeerTls;
use crate::limits::MAX_ALLOC_BYTES;
use crate::server::ratelimit::LogLimit;
use crate::time::Millis;

/// The frame limit until [`Transport::set_max_frame_bytes`] raises it, and
/// the least it can be.
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// Outbound bytes buffered per peer beyond one largest frame, before
/// messages are dropped (so appends can queue behind a snapshot).
pub const PEER_BUFFER_SLACK_BYTES: usize = 16 << 20;
/// The largest frame length the u32 prefix can carry.
const FRAME_LEN_CEILING: u64 = u32::MAX as u64;
/// A buffer emptied with more capacity than this gives it back, so that
/// one snapshot does not pin its size for the life of the process.
const KEEP_BUFFER_BYTES: usize = 4 << 20;

/// The largest frame limit a build whose allocations hold at most
/// `max_alloc` bytes can serve: what the u32 length prefix carries, and no
/// more than lets a peer's outbound buffer (one frame plus
/// [`PEER_BUFFER_SLACK_BYTES`]) and a connection's receive buffer (one
/// frame plus a read) grow by doubling within one allocation. On a 64-bit
/// build that is the length prefix's 4 GiB; on a 32-bit one, 1,007 MiB.
#[must_use]
pub const fn frame_ceiling(max_alloc: u64) -> u64 {
    let around = PEER_BUFFER_SLACK_BYTES as u64 + READ_CHUNK as u64 + 4;
    let fits = (max_alloc / 2).saturating_sub(around);
    if fits < FRAME_LEN_CEILING {
        fits
    } else {
        FRAME_LEN_CEILING
    }
}

/// The frame limit for a lock table whose snapshot is at most `wanted`
/// bytes: `wanted`, raised to [`MAX_FRAME_BYTES`] and capped to
/// [`frame_ceiling`]`(max_alloc)`.
#[must_use]
pub fn frame_limit(wanted: u64, max_alloc: u64) -> u64 {
    wanted
        .max(MAX_FRAME_BYTES as u64)
        .min(frame_ceiling(max_alloc))
}

/// Connections from peers accepted at once. When all are taken, the oldest
/// connection not yet authenticated makes room for a new one.
pub const MAX_INBOUND: usize = 64;
/// How long a connection a peer opened has to authenticate (a complete,
/// fully checked hello; with TLS, the handshake too) before it is closed.
pub const AUTH_DEADLINE_MS: u64 = 2000;
/// The largest frame taken on a connection that is not authenticated (its
/// messages are dropped anyway): a stranger cannot make us buffer much.
const UNTRUSTED_FRAME_BYTES: usize = 64 * 1024;
/// Plaintext buffered inside a TLS connection before it takes no more; the
/// per-peer output limit counts it as always full.
const TLS_BUFFER_BYTES: usize = 256 * 1024;
/// Refusal warnings: at most this many per window.
const REFUSAL_LOG_BURST: u32 = 5;
const REFUSAL_LOG_WINDOW_MS: u64 = 10_000;

const HELLO_MAGIC: &[u8; 4] = b"TKTD";
/// The `voters` field of hellos: fixed, since members change at run time.
pub const MEMBERSHIP_MARK: u64 = 0x6d65_6d62_6572_7321;
/// Peers one transport connects to (the tokens between the listener's and
/// the inbound connections').
const MAX_PEERS: usize = 64;
const HELLO_VERSION: u8 = 1;
const HELLO_LEN: usize = 4 + 1 + 8 * 6;
const BACKOFF_MIN_MS: u64 = 100;
const BACKOFF_MAX_MS: u64 = 1000;
const READ_CHUNK: usize = 64 * 1024;
/// The election timeout assumed until the service sets it (raft's default:
/// 10 ticks of 100 ms).
const DEFAULT_ELECTION_TIMEOUT_MS: u64 = 1000;

/// Empties `buf`, giving its memory back when a large frame grew it.
fn reset_buffer(buf: &mut Vec<u8>) {
    if buf.capacity() > KEEP_BUFFER_BYTES {
        *buf = Vec::new();
    } else {
        buf.clear();
    }
}

/// The first frame on a peer connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Hash of the cluster name.
    pub cluster: u64,
    /// The peer hello's membership marker: [`MEMBERSHIP_MARK`] (it was a
    /// hash of the voter ids while membership was static; the set changes
    /// now, and every node learns it from the log).
    pub voters: u64,
    /// The sender's node id.
    pub from: u64,
    /// The sender's data directory id.
    pub from_uuid: u64,
    /// The receiver's node id.
    pub to: u64,
    /// The receiver's data directory id as the sender first saw it (0: never).
    pub to_uuid: u64,
}

impl Hello {
    /// The frame (length prefix included).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(4 + HELLO_LEN);
        b.extend_from_slice(&(HELLO_LEN as u32).to_be_bytes());
        b.extend_from_slice(HELLO_MAGIC);
        b.push(HELLO_VERSION);
        for v in [
            self.cluster,
            self.voters,
            self.from,
            self.from_uuid,
            self.to,
            self.to_uuid,
        ] {
            b.extend_from_slice(&v.to_be_bytes());
        }
        b
    }

    /// Decodes a hello payload (without the length prefix).
    pub fn decode(p: &[u8]) -> Result<Hello, &'static str> {
        if p.len() != HELLO_LEN || &p[..4] != HELLO_MAGIC {
            return Err("not a ticketd peer hello");
        }
        if p[4] != HELLO_VERSION {
            return Err("unsupported peer protocol version");
        }
        let f = |i: usize| {
            let o = 5 + 8 * i;
            u64::from_be_bytes(p[o..o + 8].try_into().expect("8 bytes"))
        };
        Ok(Hello {
            cluster: f(0),
            voters: f(1),
            from: f(2),
            from_uuid: f(3),
            to: f(4),
            to_uuid: f(5),
        })
    }
}

/// The peer framing: the payload length of the first frame in `buf` once
/// all of it has arrived (the frame is `buf[4..4 + len]`), `None` while it is
/// incomplete, or why the connection must close (a frame over `max`). Before
/// the hello (`before_hello`) only a hello-sized frame is accepted, so a
/// stranger on the peer port cannot make us buffer a large frame. Public for
/// the fuzz targets.
#[doc(hidden)]
pub fn frame_len(buf: &[u8], before_hello: bool, max: usize) -> Result<Option<usize>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    if before_hello && len != HELLO_LEN {
        return Err(FrameError::NotHello);
    }
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    if buf.len() - 4 < len {
        return Ok(None);
    }
    Ok(Some(len))
}

/// Why [`frame_len`] refuses a frame (and the connection closes).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Before the hello, a frame that is not hello-sized.
    NotHello,
    /// A frame over the limit.
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::NotHello => f.write_str("the first frame is not a hello"),
            FrameError::TooLarge { len, max } => {
                write!(f, "frame of {len} bytes is over the limit of {max}")
            }
        }
    }
}

impl std::error::Error for FrameError {}

/// Why a peer connection closes: what the socket or TLS said, or what the
/// peer sent.
#[derive(Debug)]
enum Closed {
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
    fn is_tls(&self) -> bool {
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

/// FNV-1a, for the cluster name and voter set hashes.
#[must_use]
pub fn hash64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
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

#[derive(Debug)]
struct Peer {
    addr: SocketAddr,
    stream: Option<TcpStream>,
    connected: bool,
    buf: Vec<u8>,
    cursor: usize,
    /// End offsets (in `buf`) of queued snapshot frames.
    snaps: Vec<usize>,
    retry_at: Millis,
    backoff_ms: u64,
    /// While connecting: when the attempt is given up.
    connect_by: Millis,
    /// The receiver's data directory id our current hello to it carries.
    hello_to_uuid: u64,
    /// Peer TLS: the session over `stream`.
    tls: Option<Box<rustls::ClientConnection>>,
    /// Peer TLS: when a handshake not done by then is given up.
    auth_by: Option<Millis>,
}

impl Peer {
    fn new(addr: SocketAddr) -> Self {
        Peer {
            addr,
            stream: None,
            connected: false,
            buf: Vec::new(),
            cursor: 0,
            snaps: Vec::new(),
            retry_at: Millis::ZERO,
            backoff_ms: BACKOFF_MIN_MS,
            connect_by: Millis::ZERO,
            hello_to_uuid: 0,
            tls: None,
            auth_by: None,
        }
    }
}

#[derive(Debug)]
struct Inbound {
    stream: TcpStream,
    rbuf: Vec<u8>,
    /// The sender of a hello that passed every check.
    peer: Option<u64>,
    /// The peer is authenticated: its messages are taken.
    trusted: bool,
    addr: SocketAddr,
    /// When it was accepted (for [`AUTH_DEADLINE_MS`] and eviction).
    opened: Millis,
    /// Peer TLS: the session over `stream`.
    tls: Option<Box<rustls::ServerConnection>>,
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

    fn peer_token(&self, id: u64) -> Token {
        let idx = self.peers.keys().position(|k| *k == id).unwrap_or(0);
        Token(self.base + 1 + idx)
    }

    fn inbound_base(&self) -> usize {
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
    fn knowledge(&self, id: u64) -> u64 {
        self.local
            .known
            .get(&id)
            .or_else(|| self.unconfirmed.get(&id))
            .copied()
            .unwrap_or(0)
    }

    /// A rate-limited refusal warning.
    fn refusal(&mut self, now: Millis, what: std::fmt::Arguments<'_>) {
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

    /// Opens a connection to peer `id` and queues its hello; on failure
    /// the next attempt waits for the backoff.
    fn connect(&mut self, id: u64, now: Millis, registry: &Registry) {
        let token = self.peer_token(id);
        let to_uuid = self.knowledge(id);
        let hello = Hello {
            cluster: self.local.cluster,
            voters: self.local.voters,
            from: self.local.id,
            from_uuid: self.local.uuid,
            to: id,
            to_uuid,
        }
        .encode();
        let tls = match self.tls.as_ref().map(|t| t.client(id)) {
            None => None,
            Some(Ok(c)) => Some(Box::new(c)),
            Some(Err(e)) => {
                self.refusal(now, format_args!("peer {id}: TLS: {e}"));
                let p = self.peers.get_mut(&id).expect("listed");
                p.retry_at = now.add_ms(BACKOFF_MAX_MS);
                return;
            }
        };
        let p = self.peers.get_mut(&id).expect("listed");
        match TcpStream::connect(p.addr) {
            Ok(mut s) => {
                set_user_timeout(&s, self.user_timeout_ms);
                if registry
                    .register(&mut s, token, Interest::READABLE | Interest::WRITABLE)
                    .is_ok()
                {
                    p.stream = Some(s);
                    p.tls = tls.map(|mut c| {
                        c.set_buffer_limit(Some(TLS_BUFFER_BYTES));
                        c
                    });
                    p.auth_by = None;
                    p.connected = false;
                    p.connect_by = now.add_ms(self.connect_timeout_ms);
                    p.buf = hello;
                    p.hello_to_uuid = to_uuid;
                    p.cursor = 0;
                    p.snaps.clear();
                } else {
                    p.retry_at = now.add_ms(p.backoff_ms);
                }
            }
            Err(_) => {
                p.retry_at = now.add_ms(p.backoff_ms);
                p.backoff_ms = (p.backoff_ms * 2).min(BACKOFF_MAX_MS);
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

    fn fail_peer(&mut self, id: u64, now: Millis, registry: &Registry, why: &str) {
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        if let Some(mut s) = p.stream.take() {
            let _ = registry.deregister(&mut s);
            log::debug!("peer {id} at {}: connection lost: {why}", p.addr);
        }
        for _ in p.snaps.drain(..) {
            self.events.push(PeerEvent::Snapshot(id, false));
        }
        reset_buffer(&mut p.buf);
        p.cursor = 0;
        p.connected = false;
        p.tls = None;
        p.auth_by = None;
        p.retry_at = now.add_ms(p.backoff_ms);
        p.backoff_ms = (p.backoff_ms * 2).min(BACKOFF_MAX_MS);
        self.events.push(PeerEvent::Unreachable(id));
    }

    /// Queues a message for its peer (written by [`Transport::flush`]).
    pub fn send(&mut self, m: &Message) {
        self.queue(m, &[]);
    }

    /// Queues a turn's messages, each for its peer. The entries of an
    /// append are encoded once for every follower they go to: raft gives
    /// each follower's append the same entries from its log (the same
    /// `Bytes`) when their progress is the same, and only the header
    /// (recipient, previous index and term, commit) differs. Such a frame
    /// carries the header's fields first and the entries (field 7) after
    /// them; protobuf reads fields in any order, so it decodes to the same
    /// message.
    pub fn send_all(&mut self, msgs: Vec<Message>) {
        let mut shared: Option<(EntriesKey, Vec<u8>)> = None;
        for mut m in msgs {
            let Some(key) = EntriesKey::of(&m) else {
                self.queue(&m, &[]);
                continue;
            };
            let entries = std::mem::take(&mut m.entries);
            if shared.as_ref().is_none_or(|(k, _)| *k != key) {
                match encode_entries(&entries, self.max_frame) {
                    Some(block) => shared = Some((key, block)),
                    None => {
                        // Over the frame limit: `queue` refuses it.
                        m.entries = entries;
                        self.queue(&m, &[]);
                        continue;
                    }
                }
            }
            let block = shared.as_ref().map_or(&[][..], |(_, b)| b.as_slice());
            self.queue(&m, block);
        }
    }

    /// Queues `m` followed by `tail`, protobuf fields already encoded that
    /// `m` leaves out (see [`Transport::send_all`]).
    fn queue(&mut self, m: &Message, tail: &[u8]) {
        let id = m.to;
        let snapshot = m.msg_type == MessageType::MsgSnapshot;
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        // protobuf 2 counts sizes in a u32: a snapshot whose data alone is
        // over the limit is refused before it could wrap that count.
        let too_big = m.get_snapshot().get_data().len() > self.max_frame;
        let size = if too_big {
            usize::MAX
        } else {
            (m.compute_size() as usize).saturating_add(tail.len())
        };
        if size > self.max_frame {
            if snapshot {
                self.events.push(PeerEvent::Snapshot(id, false));
            }
            return;
        }
        let in_tls = if p.tls.is_some() { TLS_BUFFER_BYTES } else { 0 };
        let queued = (p.buf.len() - p.cursor)
            .saturating_add(in_tls)
            .saturating_add(size)
            .saturating_add(4);
        if p.stream.is_none() || queued > self.max_peer_buffer {
            if snapshot {
                self.events.push(PeerEvent::Snapshot(id, false));
            }
            self.events.push(PeerEvent::Unreachable(id));
            return;
        }
        // Reclaim written bytes before growing.
        if p.cursor > 0 && p.cursor == p.buf.len() {
            reset_buffer(&mut p.buf);
            p.cursor = 0;
            p.snaps.clear();
        }
        // Room first, without the abort a failed allocation would be: on a
        // 32-bit build a buffer near a snapshot's size can be more than
        // the address space gives. The message is dropped as if the
        // buffer were full.
        if p.buf.try_reserve(size + 4).is_err() {
            if snapshot {
                self.events.push(PeerEvent::Snapshot(id, false));
            }
            self.events.push(PeerEvent::Unreachable(id));
            return;
        }
        // Encoded in place: sizes were computed (and cached) just above.
        let start = p.buf.len();
        p.buf
            .extend_from_slice(&u32::try_from(size).expect("bounded").to_be_bytes());
        let written = {
            let mut os = protobuf::CodedOutputStream::vec(&mut p.buf);
            m.write_to_with_cached_sizes(&mut os)
                .and_then(|()| os.write_raw_bytes(tail))
                .and_then(|()| os.flush())
        };
        if written.is_err() || p.buf.len() != start + 4 + size {
            p.buf.truncate(start);
            if snapshot {
                self.events.push(PeerEvent::Snapshot(id, false));
            }
            return;
        }
        if snapshot {
            p.snaps.push(p.buf.len());
        }
    }

    /// Writes what is queued, as far as the sockets take it.
    pub fn flush(&mut self, now: Millis, registry: &Registry) {
        let ids: Vec<u64> = self.peers.keys().copied().collect();
        for id in ids {
            if let Err(e) = self.write_peer(id) {
                self.fail_peer(id, now, registry, &e.to_string());
            }
        }
    }

    fn write_peer(&mut self, id: u64) -> io::Result<()> {
        let p = self.peers.get_mut(&id).expect("listed");
        let Some(s) = p.stream.as_mut() else {
            return Ok(());
        };
        if !p.connected {
            return Ok(()); // wait for WRITABLE
        }
        if let Some(tls) = p.tls.as_mut() {
            // Frames go into the session as far as its buffer takes them,
            // records out to the socket as far as it takes them.
            loop {
                let mut moved = 0;
                if p.cursor < p.buf.len() {
                    moved = tls.writer().write(&p.buf[p.cursor..])?;
                    p.cursor += moved;
                }
                let mut blocked = false;
                while tls.wants_write() {
                    match tls.write_tls(s) {
                        Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            blocked = true;
                            break;
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                if blocked || moved == 0 || p.cursor == p.buf.len() {
                    break;
                }
            }
        } else {
            while p.cursor < p.buf.len() {
                match s.write(&p.buf[p.cursor..]) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(n) => p.cursor += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        while p.snaps.first().is_some_and(|end| *end <= p.cursor) {
            p.snaps.remove(0);
            self.events.push(PeerEvent::Snapshot(id, true));
        }
        if p.cursor == p.buf.len() {
            reset_buffer(&mut p.buf);
            p.cursor = 0;
        } else if p.cursor > (1 << 20) && p.cursor * 2 > p.buf.len() {
            p.buf.drain(..p.cursor);
            for end in &mut p.snaps {
                *end -= p.cursor;
            }
            p.cursor = 0;
        }
        Ok(())
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

    fn accept(&mut self, now: Millis, registry: &Registry) {
        loop {
            match self.listener.accept() {
                Ok((mut s, addr)) => {
                    if self.inbound.len() >= MAX_INBOUND {
                        // The oldest connection not authenticated makes
                        // room: idle strangers cannot hold every slot.
                        let oldest = self
                            .inbound
                            .iter()
                            .filter(|(_, c)| !c.trusted)
                            .min_by_key(|(_, c)| c.opened)
                            .map(|(k, _)| k);
                        let Some(old) = oldest else {
                            self.refusal(
                                now,
                                format_args!("peer connection from {addr} refused: too many"),
                            );
                            continue;
                        };
                        self.close_inbound(
                            old,
                            now,
                            registry,
                            "closed to make room: not authenticated",
                        );
                    }
                    let _ = s.set_nodelay(true);
                    let tls = match self.tls.as_ref().map(PeerTls::server) {
                        None => None,
                        Some(Ok(c)) => Some(Box::new(c)),
                        Some(Err(e)) => {
                            self.refusal(
                                now,
                                format_args!("peer connection from {addr}: TLS: {e}"),
                            );
                            continue;
                        }
                    };
                    // A TLS session writes its handshake back.
                    let interest = if tls.is_some() {
                        Interest::READABLE | Interest::WRITABLE
                    } else {
                        Interest::READABLE
                    };
                    let entry = self.inbound.vacant_entry();
                    let token = Token(self.base + 1 + 64 + entry.key());
                    if registry.register(&mut s, token, interest).is_ok() {
                        entry.insert(Inbound {
                            stream: s,
                            rbuf: Vec::new(),
                            peer: None,
                            trusted: false,
                            addr,
                            opened: now,
                            tls,
                        });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.refusal(now, format_args!("peer listener: {e}"));
                    return;
                }
            }
        }
    }

    fn outbound_event(
        &mut self,
        id: u64,
        now: Millis,
        registry: &Registry,
        event: &mio::event::Event,
    ) {
        let p = self.peers.get_mut(&id).expect("listed");
        let Some(s) = p.stream.as_mut() else {
            return;
        };
        if !p.connected && (event.is_writable() || event.is_error()) {
            match s.take_error() {
                Ok(None) => {}
                Ok(Some(e)) | Err(e) => {
                    self.fail_peer(id, now, registry, &e.to_string());
                    return;
                }
            }
            match s.peer_addr() {
                Ok(_) => {
                    p.connected = true;
                    p.backoff_ms = BACKOFF_MIN_MS;
                    let _ = s.set_nodelay(true);
                    if p.tls.is_some() {
                        p.auth_by = Some(now.add_ms(AUTH_DEADLINE_MS));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::NotConnected => return,
                Err(e) => {
                    self.fail_peer(id, now, registry, &e.to_string());
                    return;
                }
            }
        }
        if p.tls.is_some() && (event.is_readable() || event.is_read_closed()) {
            if let Err(why) = Self::read_outbound_tls(p) {
                if why.is_tls() {
                    // A certificate refused, either way: worth a warning.
                    let addr = p.addr;
                    self.refusal(now, format_args!("peer {id} at {addr}: {why}"));
                }
                self.fail_peer(id, now, registry, &why.to_string());
                return;
            }
        } else if event.is_readable() || event.is_read_closed() {
            // Peers never write on our outbound connection: data or EOF
            // here means the connection is over.
            let mut b = [0u8; 64];
            match s.read(&mut b) {
                Ok(_) => {
                    self.fail_peer(id, now, registry, "closed by peer");
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    self.fail_peer(id, now, registry, &e.to_string());
                    return;
                }
            }
        }
        if let Err(e) = self.write_peer(id) {
            self.fail_peer(id, now, registry, &e.to_string());
        }
    }

    /// Reads the handshake (and nothing else) a peer sends on our TLS
    /// connection to it.
    fn read_outbound_tls(p: &mut Peer) -> Result<(), Closed> {
        let (Some(s), Some(tls)) = (p.stream.as_mut(), p.tls.as_mut()) else {
            return Ok(());
        };
        loop {
            match tls.read_tls(s) {
                Ok(0) => return Err(Closed::ByPeer),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Closed::Io(e)),
            }
            let state = tls.process_new_packets().map_err(Closed::Tls)?;
            if state.plaintext_bytes_to_read() > 0 || state.peer_has_closed() {
                return Err(Closed::WroteOnOutbound);
            }
        }
        if !tls.is_handshaking() {
            p.auth_by = None;
        }
        Ok(())
    }

    /// The peer reached us: if our connection to it is not up, (re)start
    /// it now rather than after the backoff, or behind a SYN lost before
    /// the link healed.
    fn reconnect_now(&mut self, id: u64, now: Millis, registry: &Registry) {
        let Some(p) = self.peers.get(&id) else {
            return;
        };
        if p.connected {
            return;
        }
        if p.stream.is_some() {
            self.fail_peer(
                id,
                now,
                registry,
                "restarting the connect: the peer reached us",
            );
        }
        if let Some(p) = self.peers.get_mut(&id) {
            p.retry_at = now;
            p.backoff_ms = BACKOFF_MIN_MS;
        }
    }

    fn close_inbound(&mut self, key: usize, now: Millis, registry: &Registry, why: &str) {
        if let Some(mut c) = self.inbound.try_remove(key) {
            let _ = registry.deregister(&mut c.stream);
            if !why.is_empty() {
                self.refusal(now, format_args!("peer connection from {}: {why}", c.addr));
            }
        }
    }

    fn inbound_event(&mut self, key: usize, now: Millis, registry: &Registry, drain: bool) {
        if self.inbound.get(key).is_some_and(|c| c.tls.is_some()) {
            if let Err(why) = self.inbound_tls(key, now, registry) {
                self.close_inbound(key, now, registry, &why.to_string());
            }
            return;
        }
        loop {
            let Some(c) = self.inbound.get_mut(key) else {
                return;
            };
            match c.stream.read(&mut self.scratch) {
                Ok(0) => {
                    self.close_inbound(key, now, registry, "");
                    return;
                }
                Ok(n) => {
                    // Fallible: a frame near the limit on a 32-bit build
                    // may find no room, which closes this connection only.
                    if c.rbuf.try_reserve(n).is_err() {
                        let why = format!("no memory to buffer a {} byte frame", c.rbuf.len());
                        self.close_inbound(key, now, registry, &why);
                        return;
                    }
                    c.rbuf.extend_from_slice(&self.scratch[..n]);
                    let parsed = self.parse_frames(key, now);
                    // Hellos parsed before an error still count: act on them
                    // now, while the slab keys they name are still theirs.
                    for old in std::mem::take(&mut self.stale_inbound) {
                        log::debug!("peer connection {old} superseded by a newer one");
                        self.close_inbound(old, now, registry, "");
                    }
                    for id in std::mem::take(&mut self.heard) {
                        self.reconnect_now(id, now, registry);
                    }
                    self.refresh_outbound(now, registry);
                    if let Err(why) = parsed {
                        self.close_inbound(key, now, registry, &why.to_string());
                        return;
                    }
                    if n < self.scratch.len() && !drain {
                        // A short read emptied the socket: with edge-triggered
                        // epoll the next byte to arrive raises a new event.
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.close_inbound(key, now, registry, &e.to_string());
                    return;
                }
            }
        }
    }

    /// Reads TLS records from a peer's connection to the end of what the
    /// socket has, parses the frames they carry, and writes the session's
    /// own records (the handshake) back. `Ok` with the connection gone
    /// means it ended.
    fn inbound_tls(&mut self, key: usize, now: Millis, registry: &Registry) -> Result<(), Closed> {
        loop {
            let Some(c) = self.inbound.get_mut(key) else {
                return Ok(());
            };
            // One read of up to a chunk from the socket (rustls's own reads
            // take 4 KiB each), then the session takes it from memory.
            let n = match c.stream.read(&mut self.scratch) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    Self::write_inbound_tls(c)?;
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Closed::Io(e)),
            };
            let mut input = &self.scratch[..n];
            while !input.is_empty() {
                let tls = c.tls.as_mut().expect("caller checked");
                tls.read_tls(&mut input).map_err(Closed::TlsIo)?;
                let state = match tls.process_new_packets() {
                    Ok(state) => state,
                    Err(e) => {
                        // Tell the peer why (a bad certificate, say), if it listens.
                        let _ = Self::write_inbound_tls(c);
                        return Err(Closed::Tls(e));
                    }
                };
                // Room for exactly the plaintext the session holds (what
                // the bytes just read decrypted to): the buffer is zeroed
                // only where the reader will write.
                let mut left = state.plaintext_bytes_to_read();
                while left > 0 {
                    let start = c.rbuf.len();
                    c.rbuf.resize(start + left, 0);
                    let got = tls.reader().read(&mut c.rbuf[start..]);
                    let got = match got {
                        Ok(k) => k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                        Err(e) => {
                            c.rbuf.truncate(start);
                            return Err(Closed::TlsIo(e));
                        }
                    };
                    c.rbuf.truncate(start + got);
                    if got == 0 {
                        break;
                    }
                    left -= got.min(left);
                }
            }
            Self::write_inbound_tls(c)?;
            if !c.rbuf.is_empty() {
                let parsed = self.parse_frames(key, now);
                for old in std::mem::take(&mut self.stale_inbound) {
                    log::debug!("peer connection {old} superseded by a newer one");
                    self.close_inbound(old, now, registry, "");
                }
                for id in std::mem::take(&mut self.heard) {
                    self.reconnect_now(id, now, registry);
                }
                parsed?;
            }
            if n == 0 {
                self.close_inbound(key, now, registry, "");
                return Ok(());
            }
        }
    }

    fn write_inbound_tls(c: &mut Inbound) -> Result<(), Closed> {
        let Some(tls) = c.tls.as_mut() else {
            return Ok(());
        };
        while tls.wants_write() {
            match tls.write_tls(&mut c.stream) {
                Ok(0) => return Err(Closed::Gone),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Closed::Io(e)),
            }
        }
        Ok(())
    }

    fn parse_frames(&mut self, key: usize, now: Millis) -> Result<(), Closed> {
        let mut used = 0;
        let result = loop {
            let c = self.inbound.get(key).expect("caller checked");
            let rest = &c.rbuf[used..];
            if rest.len() < 4 {
                break Ok(());
            }
            let max = if c.trusted {
                self.max_frame
            } else {
                UNTRUSTED_FRAME_BYTES
            };
            let len = match frame_len(rest, c.peer.is_none(), max) {
                Err(e) => break Err(Closed::Frame(e)),
                Ok(None) => break Ok(()),
                Ok(Some(len)) => len,
            };
            let payload = &rest[4..4 + len];
            used += 4 + len;
            match (c.peer, c.trusted) {
                (None, _) => {
                    let hello = Hello::decode(payload);
                    if let Err(e) = self.hello(key, hello, now) {
                        break Err(e);
                    }
                }
                (Some(from), true) => match decode_message(payload) {
                    Ok(m) if m.from == from && m.to == self.local.id => {
                        self.events.push(PeerEvent::Message(m));
                    }
                    Ok(m) => {
                        let why = format!(
                            "message from {} to {} on the connection of peer {from}",
                            m.from, m.to
                        );
                        self.drop_message(now, &why);
                    }
                    Err(e) => break Err(Closed::Undecodable(e)),
                },
                (Some(from), false) => {
                    let why =
                        format!("message on a connection of peer {from} that is not authenticated");
                    self.drop_message(now, &why);
                }
            }
        };
        if let Some(c) = self.inbound.get_mut(key) {
            c.rbuf.drain(..used);
            if c.rbuf.is_empty() {
                reset_buffer(&mut c.rbuf);
            }
        }
        result
    }

    fn drop_message(&mut self, now: Millis, why: &str) {
        self.dropped += 1;
        if self.drops.allow(now).is_some() {
            log::warn!(
                "peer message dropped: {why} ({} dropped so far)",
                self.dropped
            );
        }
    }

    /// Checks a hello in full before anything it says is kept. See
    /// docs/SECURITY.md for what authenticates a peer.
    // Long because the checks run in one order, each with its own refusal.
    fn hello(&mut self, key: usize, hello: Result<Hello, &str>, now: Millis) -> Result<(), Closed> {
        let refused = |why: String| Err(Closed::Hello(why));
        let h = hello.map_err(|why| Closed::Hello(why.to_owned()))?;
        if h.cluster != self.local.cluster {
            return refused(format!("node {} belongs to another cluster", h.from));
        }
        if h.voters != self.local.voters {
            return refused(format!(
                "node {} speaks another version of the peer hello (voter-set hash {:#x}; \
                 this version sends {:#x})",
                h.from, h.voters, self.local.voters
            ));
        }
        if h.to != self.local.id || !self.peers.contains_key(&h.from) {
            return refused(format!(
                "hello from {} to {} is not for this node",
                h.from, h.to
            ));
        }
        // Peer TLS: the certificate (verified against the CA in the
        // handshake) must name the node the hello claims to be.
        let by_cert = match &self.tls {
            None => false,
            Some(tls) => {
                let cert = self
                    .inbound
                    .get(key)
                    .and_then(|c| c.tls.as_ref())
                    .and_then(|t| t.peer_certificates())
                    .and_then(|c| c.first());
                if !cert.is_some_and(|c| tls.names_node(c, h.from)) {
                    return refused(format!(
                        "the peer's certificate does not name node {} (its hello claims to be it)",
                        h.from
                    ));
                }
                true
            }
        };
        let pinned = self.local.known.get(&h.from).copied();
        if pinned.is_some_and(|u| u != h.from_uuid) {
            return refused(format!(
                "node {} came back with a wiped or replaced data directory (or someone \
                 else claims to be it); refusing it",
                h.from
            ));
        }
        if h.to_uuid != 0 && h.to_uuid != self.local.uuid {
            self.knows_us_otherwise(h.from, by_cert, now)?;
        }
        // Plaintext: the sender shows it has seen our data directory id,
        // which only our own hellos to the address --peers gives for it
        // carry (and our files). Until then its messages are not taken.
        let trusted = by_cert || h.to_uuid == self.local.uuid;
        let Some(c) = self.inbound.get_mut(key) else {
            return Ok(());
        };
        c.peer = Some(h.from);
        if !trusted {
            if pinned.is_none() {
                self.unconfirmed.insert(h.from, h.from_uuid);
            }
            return Ok(());
        }
        c.trusted = true;
        if pinned.is_none() {
            self.unconfirmed.remove(&h.from);
            self.local.known.insert(h.from, h.from_uuid);
            self.events.push(PeerEvent::PeerSeen(h.from, h.from_uuid));
        }
        self.stale_inbound.extend(
            self.inbound
                .iter()
                .filter(|(k, c)| *k != key && c.peer == Some(h.from))
                .map(|(k, _)| k),
        );
        self.heard.push(h.from);
        Ok(())
    }

    /// A checked hello names another data directory id for this node than
    /// its own. From a peer its certificate authenticates, that means this
    /// node's directory was wiped or replaced: the node stops. In
    /// plaintext it may equally be a stranger's made-up id that the real
    /// peer echoes, so the connection is only left unauthenticated: not
    /// refused, so that the sender's own id still reaches us and our next
    /// hello can carry it (refusing would let forged first contacts leave
    /// two real peers refusing each other for good).
    fn knows_us_otherwise(&mut self, from: u64, by_cert: bool, now: Millis) -> Result<(), Closed> {
        let me = self.local.id;
        if by_cert {
            self.events.push(PeerEvent::Fatal(format!(
                "node {from} (authenticated by its certificate) knows node {me} with another \
                 data directory: this node's data directory was wiped or replaced, and a node \
                 cannot rejoin under its old id with an empty log; give it a new id \
                 (membership change) or restore its data directory"
            )));
            return Err(Closed::Hello(
                "this node's data directory was replaced".into(),
            ));
        }
        self.refusal(
            now,
            format_args!(
                "node {from} knows node {me} with another data directory: if this node's data \
                 directory was wiped or replaced, it cannot rejoin under its old id with an \
                 empty log (give it a new id or restore its data directory); a plaintext \
                 peer's word is not enough to stop this node, and its messages are not taken"
            ),
        );
        Ok(())
    }

    /// Restarts outbound connections whose hello carried less than we now
    /// know of the receiver, so that it can authenticate us.
    fn refresh_outbound(&mut self, now: Millis, registry: &Registry) {
        if self.tls.is_some() {
            return; // certificates authenticate; hellos need not
        }
        let outdated: Vec<u64> = self
            .peers
            .iter()
            .filter(|(id, p)| p.stream.is_some() && p.hello_to_uuid != self.knowledge(**id))
            .map(|(id, _)| *id)
            .collect();
        for id in outdated {
            self.fail_peer(
                id,
                now,
                registry,
                "restarting with what we now know of the peer",
            );
            if let Some(p) = self.peers.get_mut(&id) {
                p.retry_at = now;
                p.backoff_ms = BACKOFF_MIN_MS;
            }
        }
    }
}

/// Bounds how long data may go unacknowledged on `s` before the kernel
/// fails the connection (Linux; elsewhere the default applies).
/// Frames at least this long are decoded from a `Bytes` copy of their own.
const SHARED_DECODE_BYTES: usize = 128;

/// Decodes one frame's message. A frame long enough to carry entries is
/// first copied into a `Bytes` of its own and decoded from that: each
/// entry's data is then a slice of it, where decoding from the read buffer
/// allocates one buffer per entry (and raft's clone of each into its log
/// one more). Short frames (acknowledgements, heartbeats, votes) carry no
/// data and are decoded in place.
fn decode_message(payload: &[u8]) -> protobuf::ProtobufResult<Message> {
    if payload.len() >= SHARED_DECODE_BYTES {
        let mut v = Vec::new();
        if v.try_reserve_exact(payload.len()).is_ok() {
            v.extend_from_slice(payload);
            return Message::parse_from_carllerche_bytes(&bytes::Bytes::from(v));
        }
    }
    Message::parse_from_bytes(payload)
}

/// What identifies an append's entries within one turn: the first and the
/// last entry's index, term and data. Entries with the same index and term
/// are the same entry (Raft's log matching), and raft hands each follower
/// clones of its log's `Bytes`, so equal keys mean equal entries. `None`
/// for any other message, or an append without entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct EntriesKey {
    count: usize,
    first: (u64, u64, usize, usize),
    last: (u64, u64, usize, usize),
}

impl EntriesKey {
    fn of(m: &Message) -> Option<EntriesKey> {
        if m.msg_type != MessageType::MsgAppend || m.has_snapshot() {
            return None;
        }
        let id =
            |e: &raft::eraftpb::Entry| (e.index, e.term, e.data.as_ptr() as usize, e.data.len());
        Some(EntriesKey {
            count: m.entries.len(),
            first: id(m.entries.first()?),
            last: id(m.entries.last()?),
        })
    }
}

/// The entries as a message's field 7 (tag, length, entry, for each),
/// byte for byte as protobuf writes them; `None` if they are over `max`
/// bytes. Written here rather than with protobuf's `CodedOutputStream`,
/// whose checks per field cost more than the bytes: an entry is its
/// fields in protobuf's order (type, term, index, data, context, then the
/// deprecated `sync_log`), each left out when it has its default value. An
/// entry with unknown fields (none of raft's have them) is written by
/// protobuf.
fn encode_entries(entries: &[raft::eraftpb::Entry], max: usize) -> Option<Vec<u8>> {
    let mut total = 0usize;
    for e in entries {
        let n = entry_size(e)?;
        total = total
            .saturating_add(n)
            .saturating_add(1 + varint_len_u64(n as u64));
    }
    if total > max {
        return None;
    }
    let mut block = Vec::new();
    block.try_reserve_exact(total).ok()?;
    for e in entries {
        if protobuf::rt::unknown_fields_size(e.get_unknown_fields()) != 0 {
            let written = {
                let mut os = protobuf::CodedOutputStream::vec(&mut block);
                os.write_tag(7, protobuf::wire_format::WireTypeLengthDelimited)
                    .and_then(|()| os.write_raw_varint32(e.compute_size()))
                    .and_then(|()| e.write_to_with_cached_sizes(&mut os))
                    .and_then(|()| os.flush())
            };
            written.ok()?;
            continue;
        }
        block.push(0x3a); // field 7, length-delimited
        put_varint(&mut block, entry_size(e)? as u64);
        let kind = protobuf::ProtobufEnum::value(&e.entry_type);
        if kind != 0 {
            block.push(0x08); // field 1, varint: an int32, sign-extended
            put_varint(&mut block, i64::from(kind) as u64);
        }
        if e.term != 0 {
            block.push(0x10);
            put_varint(&mut block, e.term);
        }
        if e.index != 0 {
            block.push(0x18);
            put_varint(&mut block, e.index);
        }
        if !e.data.is_empty() {
            block.push(0x22);
            put_varint(&mut block, e.data.len() as u64);
            block.extend_from_slice(&e.data);
        }
        if !e.context.is_empty() {
            block.push(0x32);
            put_varint(&mut block, e.context.len() as u64);
            block.extend_from_slice(&e.context);
        }
        if e.sync_log {
            block.extend_from_slice(&[0x28, 1]);
        }
    }
    (block.len() == total).then_some(block)
}

/// The encoded size of one entry (without its field 7 tag and length), as
/// protobuf's `compute_size` counts it; `None` past protobuf's u32 sizes.
fn entry_size(e: &raft::eraftpb::Entry) -> Option<usize> {
    let unknown = protobuf::rt::unknown_fields_size(e.get_unknown_fields());
    if unknown != 0 {
        return Some(e.compute_size() as usize);
    }
    let field = |n: u64| 1 + varint_len_u64(n);
    let bytes = |n: usize| 1 + varint_len_u64(n as u64) + n;
    let kind = protobuf::ProtobufEnum::value(&e.entry_type);
    let mut n = 0usize;
    if kind != 0 {
        n += field(i64::from(kind) as u64);
    }
    if e.term != 0 {
        n += field(e.term);
    }
    if e.index != 0 {
        n += field(e.index);
    }
    if !e.data.is_empty() {
        n += bytes(e.data.len());
    }
    if !e.context.is_empty() {
        n += bytes(e.context.len());
    }
    if e.sync_log {
        n += 2;
    }
    u32::try_from(n).ok().map(|_| n)
}

/// Appends `v` as a protobuf varint.
fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Bytes of `n` as a protobuf varint.
fn varint_len_u64(n: u64) -> usize {
    (64 - n.leading_zeros() as usize).max(1).div_ceil(7)
}

fn set_user_timeout(s: &TcpStream, ms: u64) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let t = std::time::Duration::from_millis(ms);
        if let Err(e) = socket2::SockRef::from(s).set_tcp_user_timeout(Some(t)) {
            log::debug!("TCP_USER_TIMEOUT on a peer socket: {e}");
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = (s, ms);
}

#[cfg(test)]
mod first_contact;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_roundtrips_and_rejects_garbage() {
        let h = Hello {
            cluster: 1,
            voters: 2,
            from: 3,
            from_uuid: 4,
            to: 5,
            to_uuid: 6,
        };
        let b = h.encode();
        assert_eq!(b.len(), 4 + HELLO_LEN);
        assert_eq!(Hello::decode(&b[4..]), Ok(h));
        assert!(Hello::decode(&b[4..b.len() - 1]).is_err());
        let mut bad = b[4..].to_vec();
        bad[0] = b'X';
        assert!(Hello::decode(&bad).is_err());
        bad[0] = b'T';
        bad[4] = 9;
        assert!(Hello::decode(&bad).is_err());
    }

    /// A listener whose accept queue is full: the kernel drops further
    /// SYNs, so a connect to it stays in progress.
    fn blackhole() -> (socket2::Socket, std::net::TcpStream, SocketAddr) {
        use socket2::{Domain, Socket, Type};
        let l = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        l.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        l.listen(0).unwrap();
        let addr = l.local_addr().unwrap().as_socket().unwrap();
        // Never accepted: with a backlog of 0 this one fills the queue.
        let filler = std::net::TcpStream::connect(addr).unwrap();
        (l, filler, addr)
    }

    fn msg(t: MessageType) -> Message {
        Message {
            msg_type: t,
            from: 1,
            to: 2,
            ..Default::default()
        }
    }

    #[test]
    fn a_connect_nobody_answers_reports_the_peer_unreachable_and_retries() {
        let (_l, _filler, dead) = blackhole();
        let mut poll = mio::Poll::new().unwrap();
        let local = LocalInfo {
            id: 1,
            cluster: 1,
            voters: 1,
            uuid: 1,
            known: BTreeMap::new(),
        };
        let peers: BTreeMap<u64, SocketAddr> = [(1, "127.0.0.1:0".parse().unwrap()), (2, dead)]
            .into_iter()
            .collect();
        let mut t = Transport::bind(local, "127.0.0.1:0".parse().unwrap(), &peers).unwrap();
        t.set_election_timeout_ms(300);
        t.register(poll.registry(), 0).unwrap();
        let mut events = mio::Events::with_capacity(16);
        let mut now = Millis(0);
        for attempt in 0..2 {
            t.tick(now, poll.registry());
            assert!(
                t.peers[&2].stream.is_some(),
                "attempt {attempt}: connecting"
            );
            t.send(&msg(MessageType::MsgAppend));
            t.send(&msg(MessageType::MsgSnapshot));
            // Let the kernel answer if it would: it does not.
            for _ in 0..5 {
                poll.poll(&mut events, Some(std::time::Duration::from_millis(40)))
                    .unwrap();
                for e in &events {
                    t.event(now, poll.registry(), e);
                }
                t.flush(now, poll.registry());
            }
            assert!(!t.peers[&2].connected, "the SYN is never answered");
            assert!(t.take_events().is_empty(), "nothing to report yet");
            let by = t
                .next_deadline()
                .expect("the connect timeout is a deadline");
            assert_eq!(by, now.add_ms(300));
            now = by;
            t.tick(now, poll.registry());
            let ev = t.take_events();
            assert!(
                matches!(
                    ev.as_slice(),
                    [PeerEvent::Snapshot(2, false), PeerEvent::Unreachable(2)]
                ),
                "attempt {attempt}: {ev:?}"
            );
            assert!(t.peers[&2].stream.is_none(), "the attempt was dropped");
            assert_eq!(t.peers[&2].buf.len(), 0, "queued messages dropped");
            // It retries after the backoff, which grows.
            let retry = t.next_deadline().expect("a retry is planned");
            assert_eq!(retry, now.add_ms(BACKOFF_MIN_MS << attempt));
            now = retry;
        }
    }

    fn node1(peers: &[(u64, SocketAddr)]) -> Transport {
        let local = LocalInfo {
            id: 1,
            cluster: 1,
            voters: 1,
            uuid: 1,
            known: BTreeMap::new(),
        };
        let peers: BTreeMap<u64, SocketAddr> = peers.iter().copied().collect();
        Transport::bind(local, "127.0.0.1:0".parse().unwrap(), &peers).unwrap()
    }

    /// Peer 2's hello frame to `node1` (data directory id 7).
    fn hello_from_2() -> Vec<u8> {
        Hello {
            cluster: 1,
            voters: 1,
            from: 2,
            from_uuid: 7,
            to: 1,
            to_uuid: 1,
        }
        .encode()
    }

    fn pump(t: &mut Transport, poll: &mut mio::Poll, rounds: usize) {
        let mut events = mio::Events::with_capacity(16);
        for _ in 0..rounds {
            poll.poll(&mut events, Some(std::time::Duration::from_millis(20)))
                .unwrap();
            for e in &events {
                t.event(Millis(0), poll.registry(), e);
            }
        }
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[test]
    fn outbound_sockets_give_up_on_unacknowledged_data_after_three_election_timeouts() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let poll = mio::Poll::new().unwrap();
        let mut t = node1(&[(2, l.local_addr().unwrap())]);
        t.set_election_timeout_ms(300);
        t.register(poll.registry(), 0).unwrap();
        t.tick(Millis(0), poll.registry());
        let s = t.peers[&2].stream.as_ref().expect("connecting");
        let got = socket2::SockRef::from(s).tcp_user_timeout().unwrap();
        assert_eq!(got, Some(std::time::Duration::from_millis(900)));
    }

    #[test]
    fn a_new_hello_from_a_peer_closes_its_older_inbound_connections() {
        let mut poll = mio::Poll::new().unwrap();
        let mut t = node1(&[(2, "127.0.0.1:9".parse().unwrap())]);
        t.register(poll.registry(), 0).unwrap();
        let at = t.local_addr().unwrap();
        let hello = hello_from_2();
        let mut old = std::net::TcpStream::connect(at).unwrap();
        old.write_all(&hello).unwrap();
        pump(&mut t, &mut poll, 5);
        assert_eq!(t.inbound.len(), 1);
        assert!(t.inbound.iter().all(|(_, c)| c.peer == Some(2)));
        // Peer 2 gave that connection up (its end was lost) and opened
        // another: the old one is closed, the new one kept.
        let mut new = std::net::TcpStream::connect(at).unwrap();
        new.write_all(&hello).unwrap();
        pump(&mut t, &mut poll, 5);
        assert_eq!(t.inbound.len(), 1, "only the newest connection stays");
        old.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let mut b = [0u8; 1];
        assert_eq!(old.read(&mut b).unwrap(), 0, "the old one was closed");
        // The new one still carries messages.
        let m = msg(MessageType::MsgHeartbeat);
        let m = Message {
            from: 2,
            to: 1,
            ..m
        };
        let bytes = m.write_to_bytes().unwrap();
        new.write_all(&u32::try_from(bytes.len()).unwrap().to_be_bytes())
            .unwrap();
        new.write_all(&bytes).unwrap();
        pump(&mut t, &mut poll, 5);
        let ev = t.take_events();
        assert!(
            ev.iter()
                .any(|e| matches!(e, PeerEvent::Message(m) if m.from == 2)),
            "{ev:?}"
        );
    }

    /// Node 2, listening, knowing node 1 (whose outbound side it never uses).
    fn node2() -> Transport {
        let local = LocalInfo {
            id: 2,
            cluster: 1,
            voters: 1,
            uuid: 7,
            known: BTreeMap::new(),
        };
        let peers: BTreeMap<u64, SocketAddr> =
            [(1, "127.0.0.1:9".parse().unwrap())].into_iter().collect();
        Transport::bind(local, "127.0.0.1:0".parse().unwrap(), &peers).unwrap()
    }

    fn snapshot_msg(data_bytes: usize) -> Message {
        let mut snap = raft::eraftpb::Snapshot {
            data: vec![0x5a; data_bytes].into(),
            ..Default::default()
        };
        snap.mut_metadata().index = 9;
        Message {
            snapshot: Some(snap).into(),
            ..msg(MessageType::MsgSnapshot)
        }
    }

    /// Sends `m` from a fresh node 1 to a fresh node 2, both with the frame
    /// limit `limit` (None: the default), and pumps both until node 1
    /// reports the snapshot's fate; returns that and what node 2 received.
    /// A fresh node 2 and a fresh node 1 that knows it, each registered
    /// with its own poll: `(poll1, t1, poll2, t2)`.
    fn linked_pair() -> (mio::Poll, Transport, mio::Poll, Transport) {
        let poll1 = mio::Poll::new().unwrap();
        let poll2 = mio::Poll::new().unwrap();
        let mut t2 = node2();
        t2.register(poll2.registry(), 0).unwrap();
        let mut t1 = node1(&[(2, t2.local_addr().unwrap())]);
        // Node 1 has seen node 2 before: its hello authenticates it.
        t1.set_known(2, 7);
        t1.register(poll1.registry(), 0).unwrap();
        (poll1, t1, poll2, t2)
    }

    fn ship(m: &Message, limit: Option<u64>) -> (Vec<PeerEvent>, Vec<PeerEvent>) {
        let (mut poll1, mut t1, mut poll2, mut t2) = linked_pair();
        if let Some(l) = limit {
            t1.set_max_frame_bytes(l);
            t2.set_max_frame_bytes(l);
        }
        t1.tick(Millis(0), poll1.registry());
        t1.send(m);
        let (mut ev1, mut ev2) = (Vec::new(), Vec::new());
        let mut events = mio::Events::with_capacity(64);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            t1.flush(Millis(0), poll1.registry());
            poll1
                .poll(&mut events, Some(std::time::Duration::from_millis(1)))
                .unwrap();
            for e in &events {
                t1.event(Millis(0), poll1.registry(), e);
            }
            poll2
                .poll(&mut events, Some(std::time::Duration::from_millis(1)))
                .unwrap();
            for e in &events {
                t2.event(Millis(0), poll2.registry(), e);
            }
            ev1.extend(t1.take_events());
            ev2.extend(t2.take_events());
            let refused = ev1
                .iter()
                .any(|e| matches!(e, PeerEvent::Snapshot(2, false)));
            let written = ev1
                .iter()
                .any(|e| matches!(e, PeerEvent::Snapshot(2, true)));
            let arrived = ev2.iter().any(|e| matches!(e, PeerEvent::Message(_)));
            if refused || (written && arrived) {
                // Neither end keeps a snapshot-sized buffer once it is
                // through.
                assert!(t1.peers[&2].buf.capacity() <= KEEP_BUFFER_BYTES);
                for (_, c) in &t2.inbound {
                    assert!(c.rbuf.capacity() <= KEEP_BUFFER_BYTES);
                }
                break;
            }
        }
        (ev1, ev2)
    }

    /// `encode_entries` writes field 7 byte for byte as protobuf writes a
    /// message that has only entries: every entry type, zero and large
    /// terms and indexes, data and context empty and with one- to
    /// three-byte lengths, `sync_log`, and an entry with unknown fields.
    #[test]
    fn encoded_entries_are_protobufs_bytes() {
        use raft::eraftpb::{Entry, EntryType};
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || crate::hash::xorshift(&mut seed);
        let mut entries = Vec::new();
        for i in 0..400u64 {
            let big = |r: u64| match r % 4 {
                0 => 0,
                1 => r % 128,
                2 => r % 100_000,
                _ => r,
            };
            let data_len = [0, 1, 127, 128, 300, 20_000][(next() % 6) as usize];
            let context_len = [0, 5, 200][(next() % 3) as usize];
            let mut e = Entry {
                entry_type: match i % 3 {
                    0 => EntryType::EntryNormal,
                    1 => EntryType::EntryConfChange,
                    _ => EntryType::EntryConfChangeV2,
                },
                term: big(next()),
                index: big(next()),
                data: (0..data_len)
                    .map(|_| next() as u8)
                    .collect::<Vec<u8>>()
                    .into(),
                context: (0..context_len)
                    .map(|_| next() as u8)
                    .collect::<Vec<u8>>()
                    .into(),
                sync_log: next() % 2 == 0,
                ..Entry::default()
            };
            if i == 7 {
                e.mut_unknown_fields().add_varint(15, 99);
            }
            entries.push(e);
        }
        for range in [0..0, 0..1, 5..9, 0..entries.len()] {
            let es = &entries[range];
            let mut m = Message::default();
            m.set_entries(es.to_vec().into());
            let want = m.write_to_bytes().unwrap();
            assert_eq!(encode_entries(es, usize::MAX), Some(want.clone()));
            assert_eq!(encode_entries(es, want.len()), Some(want.clone()));
            if !want.is_empty() {
                assert_eq!(encode_entries(es, want.len() - 1), None);
            }
            let back = Message::parse_from_bytes(&want).unwrap();
            assert_eq!(back.get_entries(), es);
        }
    }

    /// Sends `msgs` from node 1 to node 2 with [`Transport::send_all`] and
    /// returns what node 2 decodes, once all have arrived (or after 20 s).
    fn ship_all(msgs: Vec<Message>) -> Vec<Message> {
        let (mut poll1, mut t1, mut poll2, mut t2) = linked_pair();
        t1.tick(Millis(0), poll1.registry());
        let want = msgs.len();
        t1.send_all(msgs);
        let mut got = Vec::new();
        let mut events = mio::Events::with_capacity(64);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while got.len() < want && std::time::Instant::now() < deadline {
            t1.flush(Millis(0), poll1.registry());
            for (poll, t) in [(&mut poll1, &mut t1), (&mut poll2, &mut t2)] {
                poll.poll(&mut events, Some(std::time::Duration::from_millis(1)))
                    .unwrap();
                for e in &events {
                    t.event(Millis(0), poll.registry(), e);
                }
            }
            for e in t2.take_events() {
                if let PeerEvent::Message(m) = e {
                    got.push(m);
                }
            }
        }
        got
    }

    #[test]
    fn a_long_frame_decodes_to_entries_that_share_one_buffer() {
        let entries: Vec<raft::eraftpb::Entry> = (1..4)
            .map(|i| raft::eraftpb::Entry {
                index: i,
                term: 1,
                data: vec![i as u8; 60].into(),
                ..Default::default()
            })
            .collect();
        let m = Message {
            entries: entries.into(),
            ..msg(MessageType::MsgAppend)
        };
        let bytes = m.write_to_bytes().unwrap();
        assert!(bytes.len() >= SHARED_DECODE_BYTES);
        let got = decode_message(&bytes).unwrap();
        assert_eq!(got, m);
        // Each entry is a slice of one copy of the frame: the data lie as
        // far apart as in the frame.
        let at = |i: usize| got.entries[i].data.as_ptr() as usize;
        let frame_step = bytes.windows(60).position(|w| w == [2u8; 60]).unwrap()
            - bytes.windows(60).position(|w| w == [1u8; 60]).unwrap();
        assert_eq!(at(1) - at(0), frame_step);
        assert_eq!(at(2) - at(1), frame_step);
        // A short frame (no entries) decodes the same way, in place.
        let ack = Message {
            index: 9,
            ..msg(MessageType::MsgAppendResponse)
        };
        let bytes = ack.write_to_bytes().unwrap();
        assert!(bytes.len() < SHARED_DECODE_BYTES);
        assert_eq!(decode_message(&bytes).unwrap(), ack);
        // Garbage is an error either way.
        assert!(decode_message(&[0xFF; 200]).is_err());
        assert!(decode_message(&[0xFF; 3]).is_err());
    }

    #[test]
    fn appends_sharing_their_entries_arrive_as_sent() {
        let entry = |index: u64, term: u64, data: Vec<u8>| raft::eraftpb::Entry {
            index,
            term,
            data: data.into(),
            ..Default::default()
        };
        let log: Vec<raft::eraftpb::Entry> = (5..9)
            .map(|i| entry(i, 2, vec![i as u8; 100 + i as usize]))
            .collect();
        let append = |index: u64, commit: u64, ents: &[raft::eraftpb::Entry]| Message {
            msg_type: MessageType::MsgAppend,
            to: 2,
            from: 1,
            term: 2,
            log_term: 2,
            index,
            commit,
            entries: ents.to_vec().into(),
            ..Default::default()
        };
        let msgs = vec![
            // The same entries (clones of the same `Bytes`) twice, with
            // different headers: encoded once, sent twice.
            append(4, 3, &log),
            append(4, 4, &log),
            // Not an append: sent whole between them.
            Message {
                commit: 7,
                ..msg(MessageType::MsgHeartbeat)
            },
            // A different slice of the log: encoded on its own.
            append(6, 4, &log[2..]),
            // Equal indices and terms but other data (not from the same
            // log): not taken for the entries above.
            append(
                6,
                4,
                &[entry(7, 2, vec![1u8; 3]), entry(8, 2, vec![2u8; 9])],
            ),
            // An append without entries.
            append(8, 8, &[]),
        ];
        let got = ship_all(msgs.clone());
        assert_eq!(got, msgs);
    }

    #[test]
    fn a_snapshot_over_the_default_frame_limit_travels_once_the_limit_is_raised() {
        // Refused by its data's length alone, whatever else it holds.
        let mut t = node2();
        t.send(&Message {
            to: 1,
            ..snapshot_msg(MAX_FRAME_BYTES + 1)
        });
        assert!(matches!(
            t.take_events().as_slice(),
            [PeerEvent::Snapshot(1, false)]
        ));
        let big = snapshot_msg(MAX_FRAME_BYTES + (1 << 20));
        // Under the default limit it is refused at once, before any byte.
        let (ev1, ev2) = ship(&big, None);
        assert!(
            matches!(ev1.as_slice(), [PeerEvent::Snapshot(2, false)]),
            "{ev1:?}"
        );
        assert!(ev2.iter().all(|e| !matches!(e, PeerEvent::Message(_))));
        // Sized for a table that big, both ends take it whole.
        let (ev1, ev2) = ship(&big, Some(96 << 20));
        assert!(
            ev1.iter()
                .any(|e| matches!(e, PeerEvent::Snapshot(2, true))),
            "{ev1:?}"
        );
        let got = ev2
            .iter()
            .find_map(|e| match e {
                PeerEvent::Message(m) => Some(m),
                _ => None,
            })
            .expect("node 2 received the snapshot");
        assert_eq!(got.get_snapshot().get_metadata().index, 9);
        assert_eq!(got.get_snapshot().data.len(), MAX_FRAME_BYTES + (1 << 20));
        assert!(got.get_snapshot().data.iter().all(|b| *b == 0x5a));
    }

    #[test]
    fn the_frame_ceiling_is_the_length_prefix_on_64_bit_and_fits_a_32_bit_allocation() {
        // 64-bit: the u32 length prefix is the bound.
        assert_eq!(frame_ceiling(i64::MAX as u64), u64::from(u32::MAX));
        // 32-bit: both buffers of a peer, grown by doubling, stay within
        // one allocation of at most i32::MAX bytes.
        let max_alloc = i32::MAX as u64;
        let c = frame_ceiling(max_alloc);
        assert_eq!(c / (1 << 20), 1007, "{c}");
        let outbound = c + PEER_BUFFER_SLACK_BYTES as u64;
        let inbound = c + 4 + READ_CHUNK as u64;
        assert!(2 * outbound <= max_alloc && 2 * inbound <= max_alloc);
        let around = (PEER_BUFFER_SLACK_BYTES + READ_CHUNK + 4) as u64;
        assert!(
            2 * (c + 1 + around) > max_alloc,
            "not the largest that fits"
        );
        // The limit for the default table (1,100 MiB) is capped on 32-bit,
        // kept on 64-bit; small tables get the floor on both.
        let default_bound = 1100 << 20;
        assert_eq!(frame_limit(default_bound, max_alloc), c);
        assert_eq!(frame_limit(default_bound, i64::MAX as u64), default_bound);
        assert_eq!(frame_limit(1, max_alloc), MAX_FRAME_BYTES as u64);
        assert_eq!(frame_limit(u64::MAX, max_alloc), c);
        // The running build's limit is its own ceiling at most.
        let mut t = node2();
        t.set_max_frame_bytes(u64::MAX);
        assert!(t.max_frame_bytes() as u64 <= frame_ceiling(MAX_ALLOC_BYTES));
        assert!(
            2 * (t.max_frame_bytes() as u64 + PEER_BUFFER_SLACK_BYTES as u64) <= MAX_ALLOC_BYTES
        );
    }

    #[test]
    fn the_frame_limit_stays_within_its_floor_and_the_length_prefix() {
        let mut t = node2();
        t.set_max_frame_bytes(1);
        assert_eq!(t.max_frame_bytes(), MAX_FRAME_BYTES);
        t.set_max_frame_bytes(u64::MAX);
        assert_eq!(t.max_frame_bytes() as u64, frame_ceiling(MAX_ALLOC_BYTES));
        t.set_max_frame_bytes(200 << 20);
        assert_eq!(t.max_frame_bytes(), 200 << 20);
        // Frames over the limit close the connection; the hello rule holds.
        let mut frame = (100u32 << 20).to_be_bytes().to_vec();
        frame.push(0);
        assert_eq!(
            frame_len(&frame, false, MAX_FRAME_BYTES),
            Err(FrameError::TooLarge {
                len: 100 << 20,
                max: MAX_FRAME_BYTES
            })
        );
        assert_eq!(frame_len(&frame, false, 200 << 20), Ok(None));
        assert_eq!(
            frame_len(&frame, true, 200 << 20),
            Err(FrameError::NotHello)
        );
    }

    #[test]
    fn a_connection_closed_right_after_a_partial_frame_is_released() {
        let mut poll = mio::Poll::new().unwrap();
        let mut t = node1(&[(2, "127.0.0.1:9".parse().unwrap())]);
        t.register(poll.registry(), 0).unwrap();
        let at = t.local_addr().unwrap();
        for _ in 0..3 {
            // Half a hello and the close reach the node in one event.
            let mut s = std::net::TcpStream::connect(at).unwrap();
            s.write_all(&hello_from_2()[..10]).unwrap();
            drop(s);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        pump(&mut t, &mut poll, 5);
        assert_eq!(
            t.inbound.len(),
            0,
            "each short read was followed to its end of file"
        );
    }

    #[test]
    fn a_hello_from_a_peer_we_cannot_reach_restarts_our_connect_at_once() {
        let (_l, _filler, dead) = blackhole();
        let mut poll = mio::Poll::new().unwrap();
        let mut t = node1(&[(2, dead)]);
        t.register(poll.registry(), 0).unwrap();
        // Our connect to 2 is stuck behind a lost SYN; it failed once, so
        // the next attempt waits for the backoff.
        t.tick(Millis(0), poll.registry());
        t.tick(Millis(5000), poll.registry());
        t.tick(Millis(5100), poll.registry());
        assert!(t.peers[&2].stream.is_some(), "connecting again");
        assert!(t.peers[&2].backoff_ms > BACKOFF_MIN_MS);
        let _ = t.take_events();
        // Peer 2 reaches us: the link is back.
        let mut c = std::net::TcpStream::connect(t.local_addr().unwrap()).unwrap();
        c.write_all(&hello_from_2()).unwrap();
        pump(&mut t, &mut poll, 5);
        assert!(
            t.peers[&2].stream.is_none(),
            "the stuck attempt was dropped"
        );
        assert_eq!(t.peers[&2].backoff_ms, BACKOFF_MIN_MS);
        assert_eq!(t.next_deadline(), Some(Millis(0)), "retry at once");
        let ev = t.take_events();
        assert!(
            ev.iter().any(|e| matches!(e, PeerEvent::Unreachable(2))),
            "{ev:?}"
        );
    }

    #[test]
    fn unauthenticated_connections_close_at_the_deadline_and_make_room() {
        let mut poll = mio::Poll::new().unwrap();
        let mut t = node1(&[(2, "127.0.0.1:9".parse().unwrap())]);
        t.register(poll.registry(), 0).unwrap();
        let at = t.local_addr().unwrap();
        // Idle strangers fill every slot...
        let idle: Vec<_> = (0..MAX_INBOUND + 5)
            .map(|_| std::net::TcpStream::connect(at).unwrap())
            .collect();
        pump(&mut t, &mut poll, 5);
        assert_eq!(t.inbound.len(), MAX_INBOUND);
        // ...and the real peer still gets in, evicting the oldest.
        let mut real = std::net::TcpStream::connect(at).unwrap();
        real.write_all(&hello_from_2()).unwrap();
        pump(&mut t, &mut poll, 5);
        assert_eq!(t.authenticated_inbound(), 1);
        t.tick(Millis(AUTH_DEADLINE_MS - 1), poll.registry());
        assert_eq!(t.inbound.len(), MAX_INBOUND, "not yet at the deadline");
        // A hello with no knowledge of us is not enough: its messages drop.
        let mut unknown = std::net::TcpStream::connect(at).unwrap();
        let h = Hello {
            to_uuid: 0,
            ..Hello::decode(&hello_from_2()[4..]).unwrap()
        };
        unknown.write_all(&h.encode()).unwrap();
        let m = Message {
            from: 2,
            to: 1,
            ..msg(MessageType::MsgHeartbeat)
        };
        let b = m.write_to_bytes().unwrap();
        unknown
            .write_all(&u32::try_from(b.len()).unwrap().to_be_bytes())
            .unwrap();
        unknown.write_all(&b).unwrap();
        pump(&mut t, &mut poll, 5);
        assert_eq!(t.dropped_messages(), 1);
        assert!(t
            .take_events()
            .iter()
            .all(|e| !matches!(e, PeerEvent::Message(_))));
        // At the deadline every connection but the real peer's closes.
        t.tick(Millis(AUTH_DEADLINE_MS), poll.registry());
        assert_eq!(t.inbound.len(), 1);
        assert_eq!(t.authenticated_inbound(), 1);
        drop(idle);
    }

    #[test]
    fn hashes_separate_parts() {
        assert_ne!(hash64(&[b"ab", b"c"]), hash64(&[b"a", b"bc"]));
        assert_eq!(hash64(&[b"x"]), hash64(&[b"x"]));
    }
}

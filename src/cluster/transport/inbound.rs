//! Inbound connections: accepting, authenticating (hellos, peer TLS), and
//! reading frames.

use std::io::{self, Read};
use std::net::SocketAddr;

use mio::net::TcpStream;
use mio::{Interest, Registry, Token};

use super::encode::decode_message;
use super::frame::{frame_len, Hello};
use super::{reset_buffer, Closed, PeerEvent, Transport, MAX_INBOUND};
use crate::cluster::tls::PeerTls;
use crate::time::Millis;

/// The largest frame taken on a connection that is not authenticated (its
/// messages are dropped anyway): a stranger cannot make us buffer much.
const UNTRUSTED_FRAME_BYTES: usize = 64 * 1024;

#[derive(Debug)]
pub(super) struct Inbound {
    pub(super) stream: TcpStream,
    pub(super) rbuf: Vec<u8>,
    /// The sender of a hello that passed every check.
    pub(super) peer: Option<u64>,
    /// The peer is authenticated: its messages are taken.
    pub(super) trusted: bool,
    pub(super) addr: SocketAddr,
    /// When it was accepted (for [`AUTH_DEADLINE_MS`](super::AUTH_DEADLINE_MS) and eviction).
    pub(super) opened: Millis,
    /// Peer TLS: the session over `stream`.
    pub(super) tls: Option<Box<rustls::ServerConnection>>,
}

impl Transport {
    pub(super) fn accept(&mut self, now: Millis, registry: &Registry) {
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

    pub(super) fn close_inbound(
        &mut self,
        key: usize,
        now: Millis,
        registry: &Registry,
        why: &str,
    ) {
        if let Some(mut c) = self.inbound.try_remove(key) {
            let _ = registry.deregister(&mut c.stream);
            if !why.is_empty() {
                self.refusal(now, format_args!("peer connection from {}: {why}", c.addr));
            }
        }
    }

    pub(super) fn inbound_event(
        &mut self,
        key: usize,
        now: Millis,
        registry: &Registry,
        drain: bool,
    ) {
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
                    self.after_hellos(now, registry);
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

    /// Acts on the hellos just parsed: closes the connections they
    /// superseded and reconnects at once to the peers they came from.
    fn after_hellos(&mut self, now: Millis, registry: &Registry) {
        for old in std::mem::take(&mut self.stale_inbound) {
            log::debug!("peer connection {old} superseded by a newer one");
            self.close_inbound(old, now, registry, "");
        }
        for id in std::mem::take(&mut self.heard) {
            self.reconnect_now(id, now, registry);
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
                self.after_hellos(now, registry);
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
}

//! Outbound connections: dialing, backoff, and writing queued frames.

use std::io::{self, Read, Write};
use std::net::SocketAddr;

use mio::net::TcpStream;
use mio::{Interest, Registry};
use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};

use super::encode::{encode_entries, EntriesKey};
use super::frame::Hello;
use super::{reset_buffer, Closed, PeerEvent, Transport, AUTH_DEADLINE_MS};
use crate::time::Millis;

/// Plaintext buffered inside a TLS connection before it takes no more; the
/// per-peer output limit counts it as always full.
pub(super) const TLS_BUFFER_BYTES: usize = 256 * 1024;
pub(super) const BACKOFF_MIN_MS: u64 = 100;
pub(super) const BACKOFF_MAX_MS: u64 = 1000;

#[derive(Debug)]
pub(super) struct Peer {
    pub(super) addr: SocketAddr,
    pub(super) stream: Option<TcpStream>,
    pub(super) connected: bool,
    pub(super) buf: Vec<u8>,
    pub(super) cursor: usize,
    /// End offsets (in `buf`) of queued snapshot frames.
    pub(super) snaps: Vec<usize>,
    pub(super) retry_at: Millis,
    pub(super) backoff_ms: u64,
    /// While connecting: when the attempt is given up.
    pub(super) connect_by: Millis,
    /// The receiver's data directory id our current hello to it carries.
    pub(super) hello_to_uuid: u64,
    /// Peer TLS: the session over `stream`.
    pub(super) tls: Option<Box<rustls::ClientConnection>>,
    /// Peer TLS: when a handshake not done by then is given up.
    pub(super) auth_by: Option<Millis>,
}

impl Peer {
    pub(super) fn new(addr: SocketAddr) -> Self {
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

impl Transport {
    /// Opens a connection to peer `id` and queues its hello; on failure
    /// the next attempt waits for the backoff.
    pub(super) fn connect(&mut self, id: u64, now: Millis, registry: &Registry) {
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

    pub(super) fn fail_peer(&mut self, id: u64, now: Millis, registry: &Registry, why: &str) {
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

    pub(super) fn write_peer(&mut self, id: u64) -> io::Result<()> {
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

    pub(super) fn outbound_event(
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
    pub(super) fn reconnect_now(&mut self, id: u64, now: Millis, registry: &Registry) {
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

    /// Restarts outbound connections whose hello carried less than we now
    /// know of the receiver, so that it can authenticate us.
    pub(super) fn refresh_outbound(&mut self, now: Millis, registry: &Registry) {
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

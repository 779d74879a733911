//! One client connection: its byte stream and identity, its input (an
//! explicit read buffer and what the socket may still hold), its output (a
//! write buffer with a cursor for partial writes, and its limits), its
//! timers, and its closing state.
//!
//! The stream is a [`Stream`] (`super::transport`): a mio TCP or Unix
//! socket, or (feature `harness`, for tests) the server end of an in-memory
//! pipe. Everything else about the connection (buffers, limits, closing) is
//! the same code for all.
//!
//! The fields are private: the loop in `super` asks a [`Conn`] for what it
//! needs (`frame_bytes`, `consume`, `read_more`, `queue_replies`, `flush`,
//! ...) and keeps only its own lists of which connections have work.

use std::io::{self, Write};

use mio::Interest;

pub(crate) use super::transport::{PeerAddr, Stream};

use crate::engine::ConnId;
use crate::readbuf::ReadBuf;
use crate::server::identity::IdentKey;
use crate::time::Millis;

/// Initial read buffer size; grown only for a frame that does not fit.
pub(crate) const RBUF_INITIAL: usize = 4096;

/// Discarding reads per turn on a lingering close.
const DISCARD_READS_PER_TURN: usize = 16;

/// Estimated bytes of a connection beside its buffers: the [`Conn`], its
/// slab entry and the socket's poll registration.
pub(crate) const CONN_BYTES: usize = 512;

/// Why and how a connection is being closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Closing {
    /// Still open.
    No,
    /// Flush the unsent replies (bounded by `deadline`), then close. With
    /// `linger`, after the flush the write side is shut and input is read and
    /// discarded until the peer closes or the deadline passes, so unread input
    /// does not turn the close into a reset that could destroy the flushed
    /// replies before the peer reads them.
    Drain {
        /// Close at this moment whatever is left.
        deadline: Millis,
        /// Shut the write side and wait for the peer's close after the flush.
        linger: bool,
    },
    /// Close at the end of this turn, unsent replies are dropped.
    Now,
}

/// What one [`Conn::read_more`] did.
#[derive(Debug)]
pub(crate) enum Fill {
    /// Bytes arrived; they are now at the end of [`Conn::frame_bytes`].
    Bytes,
    /// The peer closed its side ([`Conn::peer_closed`] is now true).
    Eof,
    /// The socket is empty for now; a new edge will say when it is not.
    WouldBlock,
    /// No room: the buffer holds complete frames not yet handled.
    Full,
}

/// Received bytes and what the socket may still hold.
#[derive(Debug)]
struct Input {
    /// Received bytes not yet handled.
    buf: ReadBuf,
    /// The socket may have more to read (an edge was seen and not yet drained).
    readable: bool,
    /// Read until `WouldBlock` even after a short read: set when a readiness
    /// event reported the peer's close or an error (and on accept), whose
    /// edge has then been consumed and will not come again.
    drain: bool,
    /// The peer closed its side.
    eof: bool,
    /// Not read because its unsent replies reached the soft limit.
    paused: bool,
    /// When the incomplete frame at the front of `buf` started to arrive.
    partial_since: Option<Millis>,
}

/// Unsent replies and how the socket takes them.
#[derive(Debug)]
struct Output {
    /// Unsent replies live in `buf[cursor..]`.
    buf: Vec<u8>,
    cursor: usize,
    /// Since when unsent replies have made no progress.
    stalled_since: Option<Millis>,
    /// The interest currently registered with the poll.
    interest: Interest,
    /// The write side was shut (lingering close).
    shut_write: bool,
}

/// A client connection.
#[derive(Debug)]
pub(crate) struct Conn {
    stream: Stream,
    peer: PeerAddr,
    /// Never reused while the process lives.
    id: ConnId,
    input: Input,
    output: Output,
    /// Queued in the loop's list of connections with input to handle.
    active: bool,
    /// Queued in the loop's list of connections with output to write.
    dirty: bool,
    closing: Closing,
    /// Its identity's entry in the loop's `Identities`.
    ident: IdentKey,
    /// The identity may still change: a TLS session whose client
    /// certificate has not been looked at yet.
    ident_open: bool,
    /// Waiting in its identity's queue of connections the guess budget
    /// paused.
    guess_paused: bool,
    /// Its bytes as last counted in the loop's total of connection memory
    /// ([`Conn::recount_memory`]).
    counted_bytes: usize,
}

impl Conn {
    /// A new connection, readable at once (a client may have sent its first
    /// frames before its socket was registered) but not yet queued: the
    /// caller queues it with [`Conn::mark_active`].
    pub(crate) fn new(
        stream: Stream,
        peer: impl Into<PeerAddr>,
        id: ConnId,
        ident: IdentKey,
    ) -> Self {
        let ident_open = stream.may_present_certificate();
        Conn {
            stream,
            peer: peer.into(),
            id,
            input: Input {
                buf: ReadBuf::new(RBUF_INITIAL),
                readable: true,
                drain: true,
                eof: false,
                paused: false,
                partial_since: None,
            },
            output: Output {
                buf: Vec::new(),
                cursor: 0,
                stalled_since: None,
                interest: Interest::READABLE,
                shut_write: false,
            },
            active: false,
            dirty: false,
            closing: Closing::No,
            ident,
            ident_open,
            guess_paused: false,
            counted_bytes: 0,
        }
    }

    // ------------------------------------------------------------ identity

    /// Its id: never reused while the process lives.
    #[inline]
    pub(crate) fn id(&self) -> ConnId {
        self.id
    }

    /// Who is at the other end.
    #[inline]
    pub(crate) fn peer(&self) -> PeerAddr {
        self.peer
    }

    /// The poll source of its socket (`None` for an in-memory pipe).
    pub(crate) fn source(&mut self) -> Option<&mut dyn mio::event::Source> {
        self.stream.source()
    }

    /// The server end of its in-memory pipe, if it is one.
    #[cfg(feature = "harness")]
    pub(crate) fn pipe(&mut self) -> Option<&mut crate::harness::pipe::ServerEnd> {
        match &mut self.stream {
            Stream::Mem(end) => Some(end),
            _ => None,
        }
    }

    /// The read side of an in-memory pipe has an edge not yet taken.
    #[cfg(feature = "harness")]
    pub(crate) fn pipe_has_edges(&self) -> bool {
        match &self.stream {
            Stream::Mem(end) => end.has_edges(),
            _ => false,
        }
    }

    /// Its identity's key in the loop's `Identities`.
    #[inline]
    pub(crate) fn ident(&self) -> IdentKey {
        self.ident
    }

    /// Whether its TLS handshake is under way (not yet found done by
    /// [`Conn::take_handshake`]): it counts as half-open.
    pub(crate) fn handshaking(&self) -> bool {
        self.ident_open
    }

    /// Its TLS handshake is done and not yet taken ([`Conn::take_handshake`]):
    /// what it sent since must wait until it has moved to its
    /// certificate's identity.
    #[inline]
    pub(crate) fn handshake_untaken(&self) -> bool {
        self.ident_open && !self.stream.handshaking()
    }

    /// `Some` once, for a TLS session, when its handshake is found done:
    /// with the identity its client certificate names, if it presented one.
    /// The caller moves the connection to that identity
    /// ([`Conn::set_ident`]) before handling any of its requests.
    pub(crate) fn take_handshake(&mut self) -> Option<Option<crate::server::identity::Identity>> {
        if !self.ident_open {
            return None;
        }
        let (done, identity) = self.stream.certificate_identity();
        if !done {
            return None;
        }
        self.ident_open = false;
        Some(identity)
    }

    /// Recounts the bytes it takes (its buffers' capacities, what the
    /// stream holds, [`CONN_BYTES`]): `(before, now)`, for the loop's
    /// running total.
    #[inline]
    pub(crate) fn recount_memory(&mut self) -> (usize, usize) {
        let now = CONN_BYTES
            + self.input.buf.capacity()
            + self.output.buf.capacity()
            + self.stream.memory();
        (std::mem::replace(&mut self.counted_bytes, now), now)
    }

    /// Its bytes as last counted ([`Conn::recount_memory`]).
    pub(crate) fn counted_bytes(&self) -> usize {
        self.counted_bytes
    }

    /// Marks it paused by the guess budget; true when it was not yet, and
    /// so must be queued with its identity.
    pub(crate) fn pause_for_guesses(&mut self) -> bool {
        !std::mem::replace(&mut self.guess_paused, true)
    }

    /// Its identity's guess budget lets it be read again.
    pub(crate) fn unpause_for_guesses(&mut self) {
        self.guess_paused = false;
    }

    /// Moves it to another identity (its certificate's).
    pub(crate) fn set_ident(&mut self, ident: IdentKey) {
        self.ident = ident;
    }

    // ------------------------------------------------- the loop's work lists

    /// Marks it as having input to handle; true when it was not yet, and so
    /// must be pushed on the loop's list of active connections.
    #[inline]
    pub(crate) fn mark_active(&mut self) -> bool {
        !std::mem::replace(&mut self.active, true)
    }

    /// Takes it off the loop's list of active connections (its input is
    /// being handled).
    #[inline]
    pub(crate) fn clear_active(&mut self) {
        self.active = false;
    }

    /// Marks it as having output to write; true when it was not yet, and so
    /// must be pushed on the loop's list of dirty connections.
    #[inline]
    pub(crate) fn mark_dirty(&mut self) -> bool {
        !std::mem::replace(&mut self.dirty, true)
    }

    /// Takes it off the loop's list of dirty connections.
    #[inline]
    pub(crate) fn clear_dirty(&mut self) {
        self.dirty = false;
    }

    // --------------------------------------------------------------- input

    /// A readiness event said the socket has input; `closed` when it also
    /// reported the peer's close or an error, whose edge will not come again.
    #[inline]
    pub(crate) fn note_readable(&mut self, closed: bool) {
        self.input.readable = true;
        self.input.drain |= closed;
    }

    /// The received bytes not yet handled: complete frames first, perhaps
    /// an incomplete one at the end.
    /// The received bytes not yet handled: complete frames first, perhaps
    /// an incomplete one at the end.
    #[inline]
    pub(crate) fn frame_bytes(&self) -> &[u8] {
        self.input.buf.data()
    }

    /// The first `used` bytes of [`Conn::frame_bytes`] were one frame, now
    /// handled.
    #[inline]
    pub(crate) fn consume(&mut self, used: usize) {
        self.input.buf.consume(used);
        self.input.partial_since = None;
    }

    /// Unhandled received bytes.
    pub(crate) fn pending_in(&self) -> usize {
        self.input.buf.len()
    }

    /// The peer closed its side.
    #[inline]
    pub(crate) fn peer_closed(&self) -> bool {
        self.input.eof
    }

    /// The socket may have more to read.
    #[inline]
    pub(crate) fn may_read(&self) -> bool {
        self.input.readable
    }

    /// One read from the socket into the free end of the buffer, after
    /// making room for it (the buffer grows up to `max_frame` bytes only for
    /// one incomplete frame). Keeps track of whether the socket may hold more.
    #[inline]
    pub(crate) fn read_more(&mut self, max_frame: usize) -> io::Result<Fill> {
        if !self.input.buf.make_room(1, max_frame) {
            return Ok(Fill::Full);
        }
        let offered = self.input.buf.spare_len();
        match self.input.buf.read_from(&mut self.stream) {
            Ok(0) => {
                self.input.eof = true;
                Ok(Fill::Eof)
            }
            Ok(n) => {
                // A short read emptied the socket's receive queue. With
                // edge-triggered epoll (Linux) any byte that arrives later
                // raises a new edge, so the read that would only say
                // `WouldBlock` is skipped: one syscall less per request at
                // pipeline depth 1. A close or error already reported by
                // the event has no edge to come, hence `drain`.
                if n < offered && !self.input.drain {
                    self.input.readable = false;
                }
                Ok(Fill::Bytes)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // Empty, and no close pending (a close reads as EOF, not
                // `WouldBlock`): anything later raises a new edge.
                self.input.readable = false;
                self.input.drain = false;
                Ok(Fill::WouldBlock)
            }
            Err(e) => Err(e),
        }
    }

    /// Not read any more until its unsent replies drop below the soft limit.
    pub(crate) fn pause_input(&mut self) {
        self.input.paused = true;
    }

    /// Reads again if it was paused and its unsent replies are below `soft`
    /// now; true when it was resumed (and must be queued as active).
    pub(crate) fn resume_input_below(&mut self, soft: usize) -> bool {
        if self.input.paused && self.unsent() < soft {
            self.input.paused = false;
            return true;
        }
        false
    }

    /// The end of a turn's input handling: starts or stops the clock of the
    /// incomplete frame (not while the server itself chose not to read:
    /// `held` by the guess throttle or paused by the soft limit), and gives
    /// back a grown buffer once it is empty.
    #[inline]
    pub(crate) fn end_input_turn(&mut self, now: Millis, held: bool, out_soft_limit: usize) {
        if held || self.input.paused {
            // Not reading is the server's choice here; the output stall
            // timeout covers a peer that never reads.
            self.input.partial_since = None;
        } else if self.pending_in() > 0 {
            self.input.partial_since.get_or_insert(now);
        } else {
            self.shrink_idle_buffers(out_soft_limit);
        }
    }

    /// Returns a grown read buffer to its initial size once it is empty, so a
    /// connection that once sent a long key does not keep the memory.
    fn shrink_idle_buffers(&mut self, out_soft_limit: usize) {
        self.input.buf.shrink_if_empty();
        let o = &mut self.output;
        if o.cursor == o.buf.len() && o.buf.capacity() > out_soft_limit {
            o.buf = Vec::new();
            o.cursor = 0;
        }
    }

    // -------------------------------------------------------------- output

    /// Unsent reply bytes, with those the stream holds (TLS records).
    #[inline]
    pub(crate) fn unsent(&self) -> usize {
        self.unsent_lent(self.output.buf.len())
    }

    /// [`Conn::unsent`] while the write buffer is lent out
    /// ([`Conn::lend_output`]) and holds `buf_len` bytes.
    #[inline]
    pub(crate) fn unsent_lent(&self, buf_len: usize) -> usize {
        buf_len - self.output.cursor + self.stream.buffered()
    }

    /// Lends the write buffer out (to the outbox, which encodes replies
    /// into it): until [`Conn::return_output`], nothing else may touch the
    /// output. Its cursor stays.
    #[inline]
    pub(crate) fn lend_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.output.buf)
    }

    /// Takes the lent write buffer back; true when it grew.
    #[inline]
    pub(crate) fn return_output(&mut self, buf: Vec<u8>, lent_len: usize) -> bool {
        debug_assert!(self.output.buf.is_empty() && buf.len() >= lent_len);
        self.output.buf = buf;
        self.output.buf.len() > lent_len
    }

    /// Cuts the unsent bytes `start..end` out (replies withheld after they
    /// were encoded into the buffer); a range not wholly unsent is left.
    pub(crate) fn withdraw(&mut self, start: usize, end: usize) {
        let o = &mut self.output;
        if o.cursor <= start && start <= end && end <= o.buf.len() {
            o.buf.drain(start..end);
        }
    }

    /// Cuts the write buffer back to `len` bytes (none of a turn's replies
    /// may leave), never below what was already sent.
    pub(crate) fn cut_back(&mut self, len: usize) {
        let o = &mut self.output;
        o.buf.truncate(len.max(o.cursor));
    }

    /// The stream holds bytes of its own to write (TLS handshake records).
    pub(crate) fn stream_has_output(&self) -> bool {
        self.stream.buffered() > 0
    }

    /// Appends encoded replies to the unsent ones.
    #[inline]
    pub(crate) fn queue_replies(&mut self, frames: &[u8]) {
        self.output.buf.extend_from_slice(frames);
    }

    /// At most one `write` of the unsent replies, keeping the clock of the
    /// output stall: stopped once everything is sent, restarted by progress
    /// or at the first write that makes none. `WouldBlock` is no error.
    #[inline]
    pub(crate) fn flush(&mut self, now: Millis) -> io::Result<()> {
        if self.unsent() == 0 {
            return Ok(());
        }
        match self.write_once() {
            Ok(_) if self.unsent() == 0 => self.output.stalled_since = None,
            Ok(n) => {
                if n > 0 || self.output.stalled_since.is_none() {
                    self.output.stalled_since = Some(now);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.output.stalled_since.get_or_insert(now);
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// The poll interest it needs now, when that is not the one registered:
    /// writable too while replies are unsent. Record it with
    /// [`Conn::set_interest`] once registered.
    #[inline]
    pub(crate) fn interest_change(&self) -> Option<Interest> {
        let want = if self.unsent() > 0 {
            Interest::READABLE | Interest::WRITABLE
        } else {
            Interest::READABLE
        };
        (want != self.output.interest).then_some(want)
    }

    /// The interest now registered with the poll.
    pub(crate) fn set_interest(&mut self, interest: Interest) {
        self.output.interest = interest;
    }

    /// One `write` of the unsent replies, retrying `Interrupted`. Advances the
    /// cursor; clears the buffer once everything is sent.
    fn write_once(&mut self) -> io::Result<usize> {
        let o = &mut self.output;
        let n = loop {
            match self.stream.write(&o.buf[o.cursor..]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        o.cursor += n;
        if o.cursor == o.buf.len() {
            o.buf.clear();
            o.cursor = 0;
        }
        Ok(n)
    }

    // -------------------------------------------------------------- timers

    /// An incomplete frame has been arriving for `limit_ms` or more.
    pub(crate) fn partial_expired(&self, now: Millis, limit_ms: u64) -> bool {
        self.input
            .partial_since
            .is_some_and(|t| now.since(t) >= limit_ms)
    }

    /// The TLS handshake has not finished in `limit_ms`.
    pub(crate) fn handshake_expired(&self, now: Millis, limit_ms: u64) -> bool {
        self.stream.handshake_expired(now, limit_ms)
    }

    /// Unsent replies have made no progress for `limit_ms` or more.
    pub(crate) fn output_stalled(&self, now: Millis, limit_ms: u64) -> bool {
        self.unsent() > 0
            && self
                .output
                .stalled_since
                .is_some_and(|t| now.since(t) >= limit_ms)
    }

    // ------------------------------------------------------------- closing

    /// Not closing.
    #[inline]
    pub(crate) fn is_open(&self) -> bool {
        self.closing == Closing::No
    }

    /// Closing at the end of this turn: its replies are dropped.
    #[inline]
    pub(crate) fn closing_now(&self) -> bool {
        self.closing == Closing::Now
    }

    /// Starts a close after a flush of the unsent replies, bounded by
    /// `deadline`; unhandled input is dropped. False when it was closing
    /// already (nothing changes then).
    pub(crate) fn begin_drain(&mut self, deadline: Millis, linger: bool) -> bool {
        if !self.is_open() {
            return false;
        }
        self.closing = Closing::Drain { deadline, linger };
        self.input.buf.clear();
        true
    }

    /// Closes it at the end of this turn, unsent replies dropped. True when
    /// it was open until now.
    pub(crate) fn close_now(&mut self) -> bool {
        std::mem::replace(&mut self.closing, Closing::Now) == Closing::No
    }

    /// A close is due at `now`: closing now, or a drain whose deadline passed.
    #[cfg(feature = "harness")]
    pub(crate) fn close_due(&self, now: Millis) -> bool {
        match self.closing {
            Closing::No => false,
            Closing::Now => true,
            Closing::Drain { deadline, .. } => now >= deadline,
        }
    }

    /// Moves a close along; true when it is done and the connection can go.
    /// `Now` is done at once; `Drain` once flushed (and, lingering, once the
    /// write side is shut and the peer closed too), or at its deadline.
    pub(crate) fn close_progress(&mut self, now: Millis) -> bool {
        let (deadline, linger) = match self.closing {
            Closing::No => return false,
            Closing::Now => return true,
            Closing::Drain { deadline, linger } => (deadline, linger),
        };
        if now >= deadline {
            return true;
        }
        if self.unsent() > 0 {
            return false;
        }
        if !linger {
            return true;
        }
        if !self.output.shut_write {
            self.output.shut_write = true;
            if self.stream.shutdown_write().is_err() {
                return true;
            }
        }
        // Read and drop what the peer still sends until it closes, so the
        // close is not a reset that could destroy the replies just flushed.
        for _ in 0..DISCARD_READS_PER_TURN {
            self.input.buf.clear();
            match self.input.buf.read_from(&mut self.stream) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected pair on loopback: the server's `Conn` and the peer.
    fn pair() -> (Conn, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let c = std::net::TcpStream::connect(addr).unwrap();
        let (s, _) = l.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        (
            Conn::new(Stream::Tcp(mio::net::TcpStream::from_std(s)), addr, 1, 0),
            c,
        )
    }

    /// Reads until `want` bytes are unhandled (the peer wrote them already).
    fn read_until(c: &mut Conn, want: usize, max_frame: usize) -> Fill {
        loop {
            c.note_readable(true);
            match c.read_more(max_frame).unwrap() {
                Fill::Bytes if c.pending_in() < want => {}
                Fill::WouldBlock => std::thread::yield_now(),
                f => return f,
            }
        }
    }

    #[test]
    fn input_grows_only_for_one_big_frame_and_shrinks_once_handled() {
        let (mut c, mut peer) = pair();
        let big = vec![b'x'; 3 * RBUF_INITIAL];
        peer.write_all(&big).unwrap();
        assert!(matches!(read_until(&mut c, big.len(), 20_000), Fill::Bytes));
        assert_eq!(c.frame_bytes(), &big[..]);
        // Three buffers' worth is no full frame yet; at the largest frame
        // there is no more room.
        peer.write_all(&vec![b'y'; 20_000 - big.len() + 10])
            .unwrap();
        assert!(matches!(read_until(&mut c, 20_001, 20_000), Fill::Full));
        assert_eq!(c.pending_in(), 20_000);
        c.consume(20_000);
        c.end_input_turn(Millis::ZERO, false, 1024);
        assert_eq!(c.input.buf.capacity(), RBUF_INITIAL);
    }

    #[test]
    fn the_peers_close_reads_as_eof_and_a_drain_drops_unhandled_input() {
        let (mut c, mut peer) = pair();
        peer.write_all(b"A 1 k").unwrap();
        drop(peer);
        let mut f = read_until(&mut c, 5, 1000);
        while !matches!(f, Fill::Eof) {
            f = read_until(&mut c, 6, 1000);
        }
        assert!(c.peer_closed());
        assert_eq!(c.frame_bytes(), b"A 1 k");
        assert!(c.begin_drain(Millis::ZERO.add_ms(10), false));
        assert_eq!(c.pending_in(), 0, "a closing connection's input is dropped");
        assert!(!c.begin_drain(Millis::ZERO.add_ms(10), false));
        assert!(c.close_progress(Millis::ZERO), "nothing unsent, no linger");
    }
}

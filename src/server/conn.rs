//! One client connection: its byte stream, an explicit read buffer, a write
//! buffer with a cursor for partial writes, and its closing state.
//!
//! The stream is a [`Stream`] (`super::transport`): a mio TCP or Unix
//! socket, or (feature `harness`, for tests) the server end of an in-memory
//! pipe. Everything else about the connection (buffers, limits, closing) is
//! the same code for all.

use std::io::{self, Read, Write};

use mio::Interest;

pub(crate) use super::transport::{PeerAddr, Stream};

use crate::engine::ConnId;
use crate::server::throttle::GuessThrottle;
use crate::time::Millis;

/// Initial read buffer size; grown only for a frame that does not fit.
pub(crate) const RBUF_INITIAL: usize = 4096;

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

/// A client connection. Fields are the loop's to manage.
#[derive(Debug)]
pub(crate) struct Conn {
    pub stream: Stream,
    pub peer: PeerAddr,
    /// Never reused while the process lives.
    pub id: ConnId,
    /// Received bytes live in `rbuf[rstart..rend]`; `rbuf.len()` is the capacity.
    pub rbuf: Vec<u8>,
    pub rstart: usize,
    pub rend: usize,
    /// Unsent replies live in `wbuf[cursor..]`.
    pub wbuf: Vec<u8>,
    pub cursor: usize,
    /// The socket may have more to read (an edge was seen and not yet drained).
    pub readable: bool,
    /// Read until `WouldBlock` even after a short read: set when a readiness
    /// event reported the peer's close or an error (and on accept), whose
    /// edge has then been consumed and will not come again.
    pub drain: bool,
    /// The peer closed its side.
    pub eof: bool,
    /// Queued in the loop's list of connections with input to handle.
    pub active: bool,
    /// Queued in the loop's list of connections with output to write.
    pub dirty: bool,
    /// Not read because its unsent replies reached the soft limit.
    pub paused: bool,
    pub closing: Closing,
    /// The write side was shut (lingering close).
    pub shut_write: bool,
    /// The interest currently registered with the poll.
    pub interest: Interest,
    /// When the incomplete frame at the front of `rbuf` started to arrive.
    pub partial_since: Option<Millis>,
    /// Since when unsent replies have made no progress.
    pub stalled_since: Option<Millis>,
    /// The wrong-token answers (`N`, `X`) this connection collected.
    pub guesses: GuessThrottle,
}

impl Conn {
    pub(crate) fn new(stream: Stream, peer: impl Into<PeerAddr>, id: ConnId) -> Self {
        let peer = peer.into();
        Conn {
            stream,
            peer,
            id,
            rbuf: vec![0; RBUF_INITIAL],
            rstart: 0,
            rend: 0,
            wbuf: Vec::new(),
            cursor: 0,
            readable: false,
            drain: true,
            eof: false,
            active: false,
            dirty: false,
            paused: false,
            closing: Closing::No,
            shut_write: false,
            interest: Interest::READABLE,
            partial_since: None,
            stalled_since: None,
            guesses: GuessThrottle::default(),
        }
    }

    /// Unsent reply bytes, with those the stream holds (TLS records).
    #[inline]
    pub(crate) fn pending_out(&self) -> usize {
        self.wbuf.len() - self.cursor + self.stream.buffered()
    }

    /// Unhandled received bytes.
    pub(crate) fn pending_in(&self) -> usize {
        self.rend - self.rstart
    }

    /// Makes room at the end of `rbuf` for a read: moves the unhandled bytes
    /// to the front, and grows the buffer (up to `max_frame` bytes) only when
    /// it is full of one incomplete frame. Returns false when there is no room
    /// (the buffer holds complete frames not yet handled).
    pub(crate) fn make_room(&mut self, max_frame: usize) -> bool {
        if self.rstart == self.rend {
            self.rstart = 0;
            self.rend = 0;
        } else if self.rend == self.rbuf.len() && self.rstart > 0 {
            self.rbuf.copy_within(self.rstart..self.rend, 0);
            self.rend -= self.rstart;
            self.rstart = 0;
        }
        if self.rend < self.rbuf.len() {
            return true;
        }
        if self.rbuf.len() < max_frame {
            let grown = (self.rbuf.len() * 2).min(max_frame);
            self.rbuf.resize(grown, 0);
            return self.rend < self.rbuf.len();
        }
        false
    }

    /// Returns a grown read buffer to its initial size once it is empty, so a
    /// connection that once sent a long key does not keep the memory.
    pub(crate) fn shrink_idle_buffers(&mut self, out_soft_limit: usize) {
        if self.rstart == self.rend && self.rbuf.len() > RBUF_INITIAL {
            self.rbuf = vec![0; RBUF_INITIAL];
            self.rstart = 0;
            self.rend = 0;
        }
        if self.cursor == self.wbuf.len() && self.wbuf.capacity() > out_soft_limit {
            self.wbuf = Vec::new();
            self.cursor = 0;
        }
    }

    /// One `read` into the free end of `rbuf`, retrying `Interrupted`.
    pub(crate) fn read_once(&mut self) -> io::Result<usize> {
        loop {
            match self.stream.read(&mut self.rbuf[self.rend..]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => return r,
            }
        }
    }

    /// One `write` of the unsent replies, retrying `Interrupted`. Advances the
    /// cursor; clears the buffer once everything is sent.
    pub(crate) fn write_once(&mut self) -> io::Result<usize> {
        let n = loop {
            match self.stream.write(&self.wbuf[self.cursor..]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        self.cursor += n;
        if self.cursor == self.wbuf.len() {
            self.wbuf.clear();
            self.cursor = 0;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> Conn {
        // A connected pair on loopback, so the Conn has a real socket.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let c = std::net::TcpStream::connect(addr).unwrap();
        let (s, _) = l.accept().unwrap();
        std::mem::forget(c);
        s.set_nonblocking(true).unwrap();
        Conn::new(Stream::Tcp(mio::net::TcpStream::from_std(s)), addr, 1)
    }

    #[test]
    fn make_room_compacts_then_grows_only_for_one_big_frame() {
        let mut c = conn();
        c.rstart = 100;
        c.rend = RBUF_INITIAL;
        assert!(c.make_room(20_000));
        assert_eq!((c.rstart, c.rend), (0, RBUF_INITIAL - 100));
        c.rend = RBUF_INITIAL;
        assert!(c.make_room(20_000), "a full buffer of one frame grows");
        assert!(c.rbuf.len() > RBUF_INITIAL && c.rbuf.len() <= 32_768);
        while c.rbuf.len() < 20_000 {
            c.rend = c.rbuf.len();
            assert!(c.make_room(20_000));
        }
        c.rend = c.rbuf.len();
        assert!(!c.make_room(20_000), "never beyond the largest frame");
        c.rstart = c.rend;
        c.shrink_idle_buffers(1024);
        assert_eq!(c.rbuf.len(), RBUF_INITIAL);
    }
}

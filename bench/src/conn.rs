//! A buffered, non-blocking TCP connection for the benchmark's servers
//! (the limit server and the cluster limit), with ticketd's read rules.

use std::io::{self, Read, Write};

use std::time::Duration;

use mio::{Events, Poll, Token};

use super::{set_write_interest, READ_CHUNK_BYTES};
use ticketd::readbuf::ReadBuf;

/// A stream with explicit read and write buffers.
pub(crate) struct BufferedConn {
    pub(crate) stream: mio::net::TcpStream,
    /// Received and not yet parsed. Its size is bounded by the read budget
    /// a caller gives [`BufferedConn::fill`] on top of what it left unparsed.
    pub(crate) input: ReadBuf,
    pub(crate) wbuf: Vec<u8>,
    pub(crate) wpos: usize,
    want_write: bool,
    /// Unread input may remain in the socket (fairness cap or back-pressure).
    pub(crate) more_to_read: bool,
    /// A readiness event said there is input (or a close) not yet read.
    readable: bool,
    /// Read until `WouldBlock` even after a short read: set on accept and
    /// when an event reported the peer's close or an error, whose edge has
    /// then been consumed and will not come again (ticketd's rule).
    drain: bool,
}

impl BufferedConn {
    pub(crate) fn new(stream: mio::net::TcpStream) -> Self {
        BufferedConn {
            stream,
            input: ReadBuf::new(READ_CHUNK_BYTES),
            wbuf: Vec::new(),
            wpos: 0,
            want_write: false,
            more_to_read: false,
            readable: false,
            drain: true,
        }
    }

    /// Notes what a readiness event for this stream said.
    pub(crate) fn note_event(&mut self, ev: &mio::event::Event) {
        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
            self.readable = true;
            if ev.is_read_closed() || ev.is_error() {
                self.drain = true;
            }
        }
    }

    /// Reads what has arrived into `input`: at most about `cap`
    /// bytes, and nothing while more than `max_pending` bytes wait to be
    /// sent (`more_to_read` then says input may remain). Like ticketd, it
    /// stops after a short read: with edge-triggered epoll any byte that
    /// arrives later raises a new edge, so the read that would only say
    /// `WouldBlock` is skipped, unless `drain` says a close or error was
    /// reported whose edge will not come again. `Ok(false)`: the peer
    /// closed.
    pub(crate) fn fill(&mut self, cap: usize, max_pending: usize) -> io::Result<bool> {
        let mut got = 0;
        self.more_to_read = false;
        while self.readable {
            if got >= cap || self.wbuf.len() - self.wpos > max_pending {
                self.more_to_read = true;
                break;
            }
            self.input.make_room(READ_CHUNK_BYTES, usize::MAX);
            let offered = self.input.spare_len();
            match self.stream.read(self.input.spare()) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    if n < offered && !self.drain {
                        self.readable = false;
                    }
                    got += n;
                    self.input.filled(n);
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

    /// Marks the first `used` unparsed bytes as parsed.
    pub(crate) fn consumed(&mut self, used: usize) {
        self.input.consume(used);
    }

    /// Writes what it can of `wbuf` and asks for writable events only while
    /// bytes remain.
    pub(crate) fn flush(&mut self, registry: &mio::Registry, token: Token) -> io::Result<()> {
        flush_buffer(
            registry,
            &mut self.stream,
            token,
            &mut self.wbuf,
            &mut self.wpos,
            &mut self.want_write,
        )
    }
}

/// Writes `wbuf[wpos..]` to `stream` until it is all sent or the socket is
/// full, empties the buffer once all is sent, and asks for writable events
/// only while bytes remain (`want_write` remembers what is asked now).
pub(crate) fn flush_buffer(
    registry: &mio::Registry,
    stream: &mut mio::net::TcpStream,
    token: Token,
    wbuf: &mut Vec<u8>,
    wpos: &mut usize,
    want_write: &mut bool,
) -> io::Result<()> {
    while *wpos < wbuf.len() {
        match stream.write(&wbuf[*wpos..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => *wpos += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let leftover = *wpos < wbuf.len();
    if !leftover {
        wbuf.clear();
        *wpos = 0;
    }
    set_write_interest(registry, stream, token, want_write, leftover)
}

/// Waits for events: at most 100 ms (so a stop flag is seen), or not at all
/// when `backlog` says a connection held back by the fairness cap is to be
/// served again without waiting for a new edge. `Ok(false)`: a signal
/// interrupted the wait, and `events` holds nothing to handle.
pub(crate) fn wait(poll: &mut Poll, events: &mut Events, backlog: bool) -> io::Result<bool> {
    let timeout = if backlog {
        Duration::ZERO
    } else {
        Duration::from_millis(100)
    };
    match poll.poll(events, Some(timeout)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
        Err(e) => Err(e),
    }
}

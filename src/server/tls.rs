//! TLS on the client port: a rustls server session over a non-blocking
//! mio TCP socket, driven from the loop like the socket itself (no thread).
//!
//! [`TlsStream`] reads and writes plaintext with the socket's own
//! non-blocking semantics, so the connection code above it does not
//! change:
//!
//! * `read` fills the buffer with as much plaintext as the socket's queued
//!   records give, and returns short only when the socket said
//!   `WouldBlock` (or the peer closed), exactly like a socket: the loop's
//!   "a short read drained the socket" shortcut stays true. Handshake
//!   records the session has to answer are written as they come. Bytes
//!   that are not TLS (or a failed handshake: a client certificate that
//!   does not chain to `--tls-client-ca`, say) fail the read, and the loop
//!   closes the connection without handling anything.
//! * `write` hands plaintext to the session a record's worth at a time and
//!   writes the records to the socket; what the socket does not take is
//!   kept here, counted by [`TlsStream::buffered`], and nothing more is
//!   taken until it is sent. The loop adds that count to the connection's
//!   unsent bytes, so `--out-soft-limit`, `--out-hard-limit` and the
//!   stalled-output timeout see every byte the connection holds.
//! * The handshake must be done within `--handshake-timeout` (or
//!   `--frame-timeout`, if shorter) of the accept
//!   ([`TlsStream::handshake_expired`]); a source address may have
//!   `--max-handshakes-per-identity` under way at once (`super::quota`).

use std::io::{self, Read, Write};
use std::sync::Arc;

use mio::net::TcpStream;

use crate::time::Millis;

/// Plaintext handed to the session per record: rustls's largest.
const RECORD_PLAINTEXT: usize = 16 * 1024;

/// Estimated bytes of a rustls server session beside the records
/// [`TlsStream`] holds: its state and its buffers for a received record
/// and for received plaintext (up to a record each).
pub(crate) const SESSION_BYTES: usize = 40 * 1024;

/// A client connection's TLS session and its socket.
pub(crate) struct TlsStream {
    pub(crate) sock: TcpStream,
    tls: rustls::ServerConnection,
    /// Records the socket did not take yet: `out[cursor..]`.
    out: Vec<u8>,
    cursor: usize,
    /// When the connection was accepted (for the handshake deadline).
    accepted: Millis,
    /// The socket reached end of file.
    eof: bool,
}

impl std::fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream")
            .field("sock", &self.sock)
            .field("handshaking", &self.tls.is_handshaking())
            .field("buffered", &self.buffered())
            .finish_non_exhaustive()
    }
}

impl TlsStream {
    /// A server session over an accepted socket.
    pub(crate) fn new(
        sock: TcpStream,
        config: &Arc<rustls::ServerConfig>,
        accepted: Millis,
    ) -> io::Result<TlsStream> {
        let tls = rustls::ServerConnection::new(Arc::clone(config)).map_err(io::Error::other)?;
        Ok(TlsStream {
            sock,
            tls,
            out: Vec::new(),
            cursor: 0,
            accepted,
            eof: false,
        })
    }

    /// Record bytes held for the socket.
    pub(crate) fn buffered(&self) -> usize {
        self.out.len() - self.cursor
    }

    /// The capacity of its buffer of records for the socket.
    pub(crate) fn held_capacity(&self) -> usize {
        self.out.capacity()
    }

    /// The handshake is not done.
    pub(crate) fn handshaking(&self) -> bool {
        self.tls.is_handshaking()
    }

    /// The handshake is not done `limit_ms` after the accept.
    pub(crate) fn handshake_expired(&self, now: Millis, limit_ms: u64) -> bool {
        self.tls.is_handshaking() && now.since(self.accepted) >= limit_ms
    }

    /// Whether the handshake is done, and the identity named by the client
    /// certificate it verified, if any.
    pub(crate) fn certificate_identity(&self) -> (bool, Option<super::identity::Identity>) {
        if self.tls.is_handshaking() {
            return (false, None);
        }
        let identity = self
            .tls
            .peer_certificates()
            .and_then(|certs| certs.first())
            .and_then(|der| super::identity::Identity::of_cert(der));
        (true, identity)
    }

    /// Sends the held records and then the session's, as far as the socket
    /// takes them; keeps the rest in `out`. `Ok(true)` when nothing is left.
    fn flush_records(&mut self) -> io::Result<bool> {
        while self.cursor < self.out.len() {
            match self.sock.write(&self.out[self.cursor..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.cursor += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        if self.cursor == self.out.len() {
            self.out.clear();
            self.cursor = 0;
            while self.tls.wants_write() {
                match self.tls.write_tls(&mut self.sock) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e),
                }
            }
        }
        // Whatever the session still holds moves here, where it is counted.
        while self.tls.wants_write() {
            self.tls.write_tls(&mut self.out)?;
        }
        Ok(self.cursor == self.out.len())
    }

    /// Feeds the socket's bytes to the session until it has plaintext,
    /// the socket is empty (`WouldBlock`) or closed (`Ok(false)`).
    fn fill(&mut self) -> io::Result<bool> {
        loop {
            let n = match self.tls.read_tls(&mut self.sock) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    if e.kind() == io::ErrorKind::WouldBlock {
                        self.flush_records()?;
                    }
                    return Err(e);
                }
            };
            if n == 0 {
                self.eof = true;
                return Ok(false);
            }
            let state = match self.tls.process_new_packets() {
                Ok(state) => state,
                Err(e) => {
                    // Tell the peer why (an alert), if it listens.
                    let _ = self.flush_records();
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("TLS: {e}"),
                    ));
                }
            };
            let plaintext = state.plaintext_bytes_to_read() > 0;
            let closed = state.peer_has_closed();
            self.flush_records()?;
            if plaintext {
                return Ok(true);
            }
            if closed {
                self.eof = true;
                return Ok(false);
            }
        }
    }

    /// Sends close_notify and shuts the socket's write side.
    pub(crate) fn shutdown_write(&mut self) -> io::Result<()> {
        self.tls.send_close_notify();
        let _ = self.flush_records();
        self.sock.shutdown(std::net::Shutdown::Write)
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut got = 0;
        while got < buf.len() {
            match self.tls.reader().read(&mut buf[got..]) {
                Ok(0) => return Ok(got), // close_notify
                Ok(n) => {
                    got += n;
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(got),
                Err(e) => return Err(e),
            }
            if self.eof {
                return Ok(got);
            }
            match self.fill() {
                Ok(true) => {}
                Ok(false) => return Ok(got),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && got > 0 => return Ok(got),
                Err(e) => return Err(e),
            }
        }
        Ok(got)
    }
}

impl Write for TlsStream {
    /// Takes plaintext only when no records wait for the socket; an empty
    /// `buf` only flushes. `WouldBlock` when nothing could move.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut taken = 0;
        loop {
            if !self.flush_records()? {
                break;
            }
            if taken == buf.len() {
                return Ok(taken);
            }
            let end = buf.len().min(taken + RECORD_PLAINTEXT);
            let n = self.tls.writer().write(&buf[taken..end])?;
            if n == 0 {
                break;
            }
            taken += n;
        }
        if taken == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        if buf.is_empty() && self.buffered() > 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(taken)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

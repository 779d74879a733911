//! The byte streams under client connections, and who is at the other end.
//!
//! The loop sees one small interface: [`Stream`] reads, writes, shuts its
//! write side and offers the poll something to register
//! ([`Stream::source`]). Under it: a TCP socket, a Unix-domain socket
//! (with the peer's credentials checked at accept, `super::unix`), a TLS
//! session over TCP (feature `tls`, `super::tls`), or
//! (feature `harness`) the server end of an in-memory pipe.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::SocketAddr;

use mio::net::{TcpStream, UnixStream};

/// Who a connection is from, for the logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PeerAddr {
    /// A TCP peer.
    Tcp(SocketAddr),
    /// A Unix-socket peer, by its credentials at connect time.
    Unix {
        /// The peer's user id.
        uid: u32,
        /// The peer's group id.
        gid: u32,
        /// The peer's process id.
        pid: i32,
    },
}

impl From<SocketAddr> for PeerAddr {
    fn from(a: SocketAddr) -> Self {
        PeerAddr::Tcp(a)
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerAddr::Tcp(a) => write!(f, "{a}"),
            PeerAddr::Unix { uid, gid, pid } => write!(f, "unix(uid={uid} gid={gid} pid={pid})"),
        }
    }
}

/// The byte stream under a connection.
#[derive(Debug)]
pub(crate) enum Stream {
    /// A TCP socket registered with the loop's poll.
    Tcp(TcpStream),
    /// A Unix-domain socket registered with the loop's poll.
    Unix(UnixStream),
    /// A TLS session over a TCP socket registered with the loop's poll
    /// (`--tls-cert`, `super::tls`).
    #[cfg(feature = "tls")]
    Tls(Box<super::tls::TlsStream>),
    /// The server end of an in-memory pipe (see [`crate::harness`]); no
    /// poll registration, readiness comes from the pipe.
    #[cfg(feature = "harness")]
    Mem(crate::harness::pipe::ServerEnd),
}

impl Stream {
    /// The socket, when there is one to register with the poll.
    pub(crate) fn source(&mut self) -> Option<&mut dyn mio::event::Source> {
        match self {
            Stream::Tcp(s) => Some(s),
            Stream::Unix(s) => Some(s),
            #[cfg(feature = "tls")]
            Stream::Tls(s) => Some(&mut s.sock),
            #[cfg(feature = "harness")]
            Stream::Mem(_) => None,
        }
    }

    /// Bytes written to the stream that it holds for the socket (TLS
    /// records): part of the connection's unsent output.
    #[inline]
    pub(crate) fn buffered(&self) -> usize {
        match self {
            #[cfg(feature = "tls")]
            Stream::Tls(s) => s.buffered(),
            _ => 0,
        }
    }

    /// Estimated bytes the stream itself takes (a TLS session's state and
    /// the records it holds), beside the connection's buffers.
    #[inline]
    pub(crate) fn memory(&self) -> usize {
        match self {
            #[cfg(feature = "tls")]
            Stream::Tls(s) => super::tls::SESSION_BYTES + s.held_capacity(),
            _ => 0,
        }
    }

    /// A TLS handshake still not done `limit_ms` after the accept.
    pub(crate) fn handshake_expired(&self, now: crate::time::Millis, limit_ms: u64) -> bool {
        match self {
            #[cfg(feature = "tls")]
            Stream::Tls(s) => s.handshake_expired(now, limit_ms),
            _ => {
                let _ = (now, limit_ms);
                false
            }
        }
    }

    /// A TLS session whose handshake is not done.
    #[inline]
    pub(crate) fn handshaking(&self) -> bool {
        match self {
            #[cfg(feature = "tls")]
            Stream::Tls(s) => s.handshaking(),
            _ => false,
        }
    }

    /// A TLS session, whose client may present a certificate.
    pub(crate) fn may_present_certificate(&self) -> bool {
        match self {
            #[cfg(feature = "tls")]
            Stream::Tls(_) => true,
            _ => false,
        }
    }

    /// Whether the TLS handshake is done, and the identity its verified
    /// client certificate names if there is one.
    pub(crate) fn certificate_identity(&self) -> (bool, Option<super::identity::Identity>) {
        match self {
            #[cfg(feature = "tls")]
            Stream::Tls(s) => s.certificate_identity(),
            _ => (true, None),
        }
    }

    /// Shuts the write side: the peer reads EOF after what was sent.
    pub(crate) fn shutdown_write(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Write),
            #[cfg(feature = "tls")]
            Stream::Tls(s) => s.shutdown_write(),
            #[cfg(feature = "harness")]
            Stream::Mem(p) => {
                p.shutdown_write();
                Ok(())
            }
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
            #[cfg(feature = "tls")]
            Stream::Tls(s) => s.read(buf),
            #[cfg(feature = "harness")]
            Stream::Mem(p) => p.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
            #[cfg(feature = "tls")]
            Stream::Tls(s) => s.write(buf),
            #[cfg(feature = "harness")]
            Stream::Mem(p) => p.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

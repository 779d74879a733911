//! `--tls-ca FILE`: the generator's connections speak TLS (1.3 or 1.2,
//! ticketd's own client configuration: rustls, ring), for the TLS rows of
//! `make bench` (ticketd `--tls-cert` against `redis-server --tls-port`).
//!
//! The handshake runs blocking at connect; then the TLS stream reads and
//! writes plaintext over the non-blocking socket with the socket's own
//! semantics (a short read means the socket is empty), so the loop's read
//! rule holds. A write whose records the socket does not take at once
//! waits for it (a bench connection's batch is a few hundred bytes).

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{TcpStream, UnixStream};

/// What the generator dials TLS with.
#[derive(Clone)]
pub struct Tls {
    /// The client configuration (trusting `--tls-ca`).
    pub config: Arc<rustls::ClientConfig>,
    /// The name the server's certificate must carry (`--tls-name`, else
    /// the address's IP).
    pub name: Option<String>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Tls {
    /// Loads `ca` (PEM).
    ///
    /// # Errors
    /// The file is missing or holds no usable CA certificate.
    pub fn load(ca: &std::path::Path, name: Option<String>) -> Result<Tls, String> {
        Ok(Tls {
            config: ticketd::tls::client_config(ca, None).map_err(|e| e.to_string())?,
            name,
        })
    }
}

/// A generator connection's byte stream.
pub(crate) enum Stream {
    Plain(TcpStream),
    /// `--server unix:/path`: a Unix-domain stream socket (no TLS).
    Unix(UnixStream),
    Tls(Box<TlsConn>),
}

pub(crate) struct TlsConn {
    sock: TcpStream,
    tls: rustls::ClientConnection,
}

/// A blocking TLS connection (Redis's `SCRIPT LOAD` before the run).
pub(crate) fn blocking(
    s: std::net::TcpStream,
    addr: SocketAddr,
    t: &Tls,
) -> io::Result<rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>> {
    let (tls, s) = handshake(s, addr, t)?;
    Ok(rustls::StreamOwned::new(tls, s))
}

fn handshake(
    mut s: std::net::TcpStream,
    addr: SocketAddr,
    t: &Tls,
) -> io::Result<(rustls::ClientConnection, std::net::TcpStream)> {
    let name = match &t.name {
        Some(n) => rustls::pki_types::ServerName::try_from(n.clone())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
        None => rustls::pki_types::ServerName::IpAddress(addr.ip().into()),
    };
    let mut tls =
        rustls::ClientConnection::new(Arc::clone(&t.config), name).map_err(io::Error::other)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    while tls.is_handshaking() {
        tls.complete_io(&mut s)?;
    }
    while tls.wants_write() {
        tls.write_tls(&mut s)?;
    }
    Ok((tls, s))
}

impl Stream {
    /// A connected blocking socket, after the handshake when `tls` is set,
    /// made non-blocking.
    pub(crate) fn open(
        s: std::net::TcpStream,
        addr: SocketAddr,
        tls: Option<&Tls>,
    ) -> io::Result<Stream> {
        let Some(t) = tls else {
            s.set_nonblocking(true)?;
            return Ok(Stream::Plain(TcpStream::from_std(s)));
        };
        let (tls, s) = handshake(s, addr, t)?;
        s.set_read_timeout(None)?;
        s.set_nonblocking(true)?;
        Ok(Stream::Tls(Box::new(TlsConn {
            sock: TcpStream::from_std(s),
            tls,
        })))
    }

    /// A connected Unix-domain stream socket at `path`, non-blocking.
    pub(crate) fn open_unix(path: &std::path::Path) -> io::Result<Stream> {
        let s = std::os::unix::net::UnixStream::connect(path)?;
        s.set_nonblocking(true)?;
        Ok(Stream::Unix(UnixStream::from_std(s)))
    }

    /// The socket, to register with the poll.
    pub(crate) fn socket(&mut self) -> &mut dyn mio::event::Source {
        match self {
            Stream::Plain(s) => s,
            Stream::Unix(s) => s,
            Stream::Tls(t) => &mut t.sock,
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let t = match self {
            Stream::Plain(s) => return s.read(buf),
            Stream::Unix(s) => return s.read(buf),
            Stream::Tls(t) => t,
        };
        // Fill `buf` as far as the socket's records go: short only when
        // the socket said WouldBlock or closed, like a socket.
        let mut got = 0;
        while got < buf.len() {
            match t.tls.reader().read(&mut buf[got..]) {
                Ok(0) => return Ok(got),
                Ok(n) => {
                    got += n;
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(got),
                Err(e) => return Err(e),
            }
            match t.tls.read_tls(&mut t.sock) {
                Ok(0) => return Ok(got),
                Ok(_) => {
                    t.tls
                        .process_new_packets()
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && got > 0 => return Ok(got),
                Err(e) => return Err(e),
            }
        }
        Ok(got)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let t = match self {
            Stream::Plain(s) => return s.write(buf),
            Stream::Unix(s) => return s.write(buf),
            Stream::Tls(t) => t,
        };
        let n = t.tls.writer().write(buf)?;
        let give_up = Instant::now() + Duration::from_secs(5);
        while t.tls.wants_write() {
            match t.tls.write_tls(&mut t.sock) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() > give_up {
                        return Err(io::ErrorKind::TimedOut.into());
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if n == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

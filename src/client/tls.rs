//! TLS under a client session (feature `tls`): a rustls client session
//! over a blocking TCP socket, shared by the session's reader and writer
//! threads.
//!
//! The session sits behind a mutex that is never held across a socket
//! call: the writer encrypts under the lock and writes the records after
//! it; the reader reads records from the socket without it and decrypts
//! under it. So a writer blocked on a full socket never stops the reader
//! from draining the replies that would let the server read again. The
//! handshake runs at connect, bounded by the connect timeout, before the
//! threads start.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustls::pki_types::ServerName;

/// Record bytes read from the socket before the session is asked for
/// plaintext: below rustls's 16 KiB bound on received plaintext.
const NET_CHUNK: usize = 8 * 1024;

/// What the client dials TLS with: the configuration and, when set, the
/// name every server's certificate must carry.
#[derive(Clone)]
pub(crate) struct TlsDial {
    pub(crate) config: Arc<rustls::ClientConfig>,
    /// Overrides the host part of each address.
    pub(crate) server_name: Option<ServerName<'static>>,
}

impl std::fmt::Debug for TlsDial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsDial")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

/// The name to check a server's certificate against, from an address as
/// given to the builder (`host:port`, `[v6]:port`).
pub(crate) fn name_of(addr: &str) -> Result<ServerName<'static>, NotAServerName> {
    let host = match addr.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => addr,
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ServerName::try_from(host.to_owned()).map_err(NotAServerName)
}

/// An address whose host is no name a certificate can be checked against.
#[derive(Debug)]
pub(crate) struct NotAServerName(rustls::pki_types::InvalidDnsNameError);

impl std::fmt::Display for NotAServerName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "not a TLS server name: {}", self.0)
    }
}

impl std::error::Error for NotAServerName {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

fn closed_in_handshake() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the server closed the connection during the TLS handshake (a plaintext port?)",
    )
}

/// A TLS session and its socket.
#[derive(Debug)]
pub(crate) struct TlsSocket {
    sock: TcpStream,
    tls: Mutex<rustls::ClientConnection>,
}

fn lock(m: &Mutex<rustls::ClientConnection>) -> MutexGuard<'_, rustls::ClientConnection> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A TLS error under an [`io::Error`], kept whole so that
/// `super::failure` can tell its kind.
#[derive(Debug)]
pub(crate) struct TlsError(pub(crate) rustls::Error);

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TLS: {}", self.0)
    }
}

impl std::error::Error for TlsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

pub(crate) fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, TlsError(e))
}

impl TlsSocket {
    /// Runs the handshake over a connected socket within `timeout`.
    pub(crate) fn handshake(
        mut sock: TcpStream,
        dial: &TlsDial,
        name: ServerName<'static>,
        timeout: Duration,
    ) -> io::Result<TlsSocket> {
        let name = dial.server_name.clone().unwrap_or(name);
        let mut tls =
            rustls::ClientConnection::new(Arc::clone(&dial.config), name).map_err(tls_error)?;
        sock.set_read_timeout(Some(timeout))?;
        sock.set_write_timeout(Some(timeout))?;
        while tls.is_handshaking() {
            match tls.complete_io(&mut sock) {
                Ok((0, 0)) => return Err(closed_in_handshake()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "TLS: the handshake timed out",
                    ))
                }
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    return Err(closed_in_handshake())
                }
                Err(e) => return Err(e),
            }
        }
        // TLS 1.2 ends with the client's Finished; make sure it is out.
        while tls.wants_write() {
            tls.write_tls(&mut sock)?;
        }
        sock.set_read_timeout(None)?;
        sock.set_write_timeout(None)?;
        Ok(TlsSocket {
            sock,
            tls: Mutex::new(tls),
        })
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.sock.shutdown(how)
    }

    /// Blocking read of plaintext; `Ok(0)` at the end of the stream.
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut net = [0u8; NET_CHUNK];
        loop {
            match lock(&self.tls).reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(e) => return Err(e),
            }
            let n = (&self.sock).read(&mut net)?;
            if n == 0 {
                return Ok(0);
            }
            let mut tls = lock(&self.tls);
            let mut rest = &net[..n];
            while !rest.is_empty() {
                tls.read_tls(&mut rest)?;
                tls.process_new_packets().map_err(tls_error)?;
            }
        }
    }

    /// Blocking write of all of `buf`: the session takes what its buffer
    /// holds, the records go out, and so on.
    pub(crate) fn write_all(&self, buf: &[u8]) -> io::Result<()> {
        let mut out = Vec::with_capacity(buf.len().min(1 << 16) + 64);
        let mut done = 0;
        loop {
            {
                let mut tls = lock(&self.tls);
                done += tls.writer().write(&buf[done..])?;
                while tls.wants_write() {
                    tls.write_tls(&mut out)?;
                }
            }
            if out.is_empty() && done < buf.len() {
                return Err(io::ErrorKind::WriteZero.into());
            }
            (&self.sock).write_all(&out)?;
            out.clear();
            if done == buf.len() {
                return Ok(());
            }
        }
    }
}

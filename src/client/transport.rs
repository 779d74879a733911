//! The byte streams under the client's sessions: TCP, or a Unix-domain
//! socket (an address `unix:/path`), or TLS over TCP (feature `tls`,
//! `super::tls`).

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// Where the client connects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Tcp(a) => write!(f, "{a}"),
            Target::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// How to speak to a TCP target: plaintext, or TLS with the name its
/// certificate must carry.
#[derive(Clone, Debug, Default)]
pub(crate) enum Security {
    #[default]
    Plain,
    #[cfg(feature = "tls")]
    Tls(super::tls::TlsDial, rustls::pki_types::ServerName<'static>),
}

/// A connected stream.
#[derive(Debug)]
pub(crate) enum ClientStream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// TLS over TCP; the reader and the writer share the session.
    #[cfg(feature = "tls")]
    Tls(std::sync::Arc<super::tls::TlsSocket>),
}

impl ClientStream {
    /// Connects to `target` within `timeout` (a Unix connect does not wait),
    /// and with TLS, runs the handshake within the same `timeout`.
    pub(crate) fn connect(
        target: &Target,
        security: &Security,
        timeout: Duration,
    ) -> io::Result<ClientStream> {
        match target {
            Target::Tcp(a) => {
                let start = std::time::Instant::now();
                let s = TcpStream::connect_timeout(a, timeout)?;
                // Requests are written whole; Nagle would only add delay.
                s.set_nodelay(true)?;
                match security {
                    Security::Plain => {
                        let _ = start;
                        Ok(ClientStream::Tcp(s))
                    }
                    #[cfg(feature = "tls")]
                    Security::Tls(dial, name) => {
                        let left = timeout
                            .saturating_sub(start.elapsed())
                            .max(Duration::from_millis(1));
                        let t = super::tls::TlsSocket::handshake(s, dial, name.clone(), left)?;
                        Ok(ClientStream::Tls(std::sync::Arc::new(t)))
                    }
                }
            }
            Target::Unix(p) => Ok(ClientStream::Unix(UnixStream::connect(p)?)),
        }
    }

    pub(crate) fn try_clone(&self) -> io::Result<ClientStream> {
        match self {
            ClientStream::Tcp(s) => s.try_clone().map(ClientStream::Tcp),
            ClientStream::Unix(s) => s.try_clone().map(ClientStream::Unix),
            #[cfg(feature = "tls")]
            ClientStream::Tls(s) => Ok(ClientStream::Tls(std::sync::Arc::clone(s))),
        }
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            ClientStream::Tcp(s) => s.shutdown(how),
            ClientStream::Unix(s) => s.shutdown(how),
            #[cfg(feature = "tls")]
            ClientStream::Tls(s) => s.shutdown(how),
        }
    }
}

impl Read for ClientStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            ClientStream::Tcp(s) => s.read(buf),
            ClientStream::Unix(s) => s.read(buf),
            #[cfg(feature = "tls")]
            ClientStream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for &ClientStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            ClientStream::Tcp(s) => (&*s).write(buf),
            ClientStream::Unix(s) => (&*s).write(buf),
            #[cfg(feature = "tls")]
            ClientStream::Tls(s) => s.write_all(buf).map(|()| buf.len()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

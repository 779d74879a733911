//! The byte streams under the client's sessions: TCP, or a Unix-domain
//! socket (an address `unix:/path`).

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

/// A connected stream.
#[derive(Debug)]
pub(crate) enum ClientStream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl ClientStream {
    /// Connects to `target` within `timeout` (a Unix connect does not wait).
    pub(crate) fn connect(target: &Target, timeout: Duration) -> io::Result<ClientStream> {
        match target {
            Target::Tcp(a) => {
                let s = TcpStream::connect_timeout(a, timeout)?;
                // Requests are written whole; Nagle would only add delay.
                s.set_nodelay(true)?;
                Ok(ClientStream::Tcp(s))
            }
            Target::Unix(p) => Ok(ClientStream::Unix(UnixStream::connect(p)?)),
        }
    }

    pub(crate) fn try_clone(&self) -> io::Result<ClientStream> {
        match self {
            ClientStream::Tcp(s) => s.try_clone().map(ClientStream::Tcp),
            ClientStream::Unix(s) => s.try_clone().map(ClientStream::Unix),
        }
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            ClientStream::Tcp(s) => s.shutdown(how),
            ClientStream::Unix(s) => s.shutdown(how),
        }
    }
}

impl Read for ClientStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            ClientStream::Tcp(s) => s.read(buf),
            ClientStream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for &ClientStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            ClientStream::Tcp(s) => (&*s).write(buf),
            ClientStream::Unix(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

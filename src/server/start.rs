//! [`StartError`]: why [`super::Server::bind`] cannot start a server.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::config::{AdminListen, ConfigError};

/// Why a server cannot start, by what failed. Its `Display` is the
/// reason for a person; the `ticketd` binary puts it after "cannot start"
/// (the configuration, TLS files, an inherited socket) or "cannot listen
/// on ADDR" (the listeners and the poll).
#[derive(Debug)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration is refused ([`crate::config::Config::validate`]).
    Config(ConfigError),
    /// A certificate, key or CA file of `--tls-*` or `--admin-tls-*`
    /// cannot be used.
    #[cfg(feature = "tls")]
    Tls(crate::tls::TlsError),
    /// The descriptor passed by socket activation (`LISTEN_FDS`) is not a
    /// TCP stream socket.
    SocketActivation {
        /// The descriptor.
        fd: std::os::fd::RawFd,
        /// Why it cannot be used.
        source: io::Error,
    },
    /// The TCP client listener cannot be bound (`--listen`).
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// The error.
        source: io::Error,
    },
    /// A Unix-socket client listener cannot be made (`--listen unix:`).
    Unix {
        /// The socket file.
        path: PathBuf,
        /// The error, naming the file.
        source: io::Error,
    },
    /// The admin port cannot be bound (`--admin-listen`).
    Admin {
        /// Where it was to listen.
        at: AdminListen,
        /// The error.
        source: io::Error,
    },
    /// The poll, its waker or the service's own event sources cannot be
    /// set up.
    Setup(io::Error),
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartError::Config(e) => write!(f, "{e}"),
            #[cfg(feature = "tls")]
            StartError::Tls(e) => write!(f, "{e}"),
            StartError::SocketActivation { source, .. }
            | StartError::Listen { source, .. }
            | StartError::Unix { source, .. }
            | StartError::Setup(source) => write!(f, "{source}"),
            StartError::Admin { at, source } => {
                write!(f, "cannot listen on {at} (--admin-listen): {source}")
            }
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StartError::Config(e) => Some(e),
            #[cfg(feature = "tls")]
            StartError::Tls(e) => Some(e),
            StartError::SocketActivation { source, .. }
            | StartError::Listen { source, .. }
            | StartError::Unix { source, .. }
            | StartError::Admin { source, .. }
            | StartError::Setup(source) => Some(source),
        }
    }
}

/// For callers that handle every start-up failure as an `io::Error`: the
/// configuration and TLS files are `InvalidInput`, the rest keeps the
/// kind of the error underneath; the message is the `Display`.
impl From<StartError> for io::Error {
    fn from(e: StartError) -> io::Error {
        let kind = match &e {
            StartError::Config(_) => io::ErrorKind::InvalidInput,
            #[cfg(feature = "tls")]
            StartError::Tls(_) => io::ErrorKind::InvalidInput,
            StartError::SocketActivation { source, .. }
            | StartError::Listen { source, .. }
            | StartError::Unix { source, .. }
            | StartError::Admin { source, .. }
            | StartError::Setup(source) => source.kind(),
        };
        io::Error::new(kind, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::server::Server;
    use crate::single::SingleService;

    fn service(config: &Config) -> SingleService {
        SingleService::with_first_token(config.engine.clone(), 1)
    }

    #[test]
    fn an_address_in_use_is_a_listen_error_naming_it() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let config = Config {
            listen: addr,
            ..Config::default()
        };
        let Err(e) = Server::bind(config.clone(), service(&config)) else {
            panic!("bound an address in use");
        };
        match &e {
            StartError::Listen { addr: a, source } => {
                assert_eq!(*a, addr);
                assert_eq!(source.kind(), io::ErrorKind::AddrInUse, "{e}");
            }
            other => panic!("not a listen error: {other:?}"),
        }
        assert_eq!(io::Error::from(e).kind(), io::ErrorKind::AddrInUse);
    }

    #[test]
    fn a_refused_configuration_is_a_config_error() {
        let config = Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            max_conns: 0,
            ..Config::default()
        };
        let Err(e) = Server::bind(config.clone(), service(&config)) else {
            panic!("started with --max-conns 0");
        };
        assert!(matches!(e, StartError::Config(_)), "{e:?}");
        assert!(e.to_string().contains("--max-conns"), "{e}");
        assert_eq!(io::Error::from(e).kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn an_admin_port_in_use_is_an_admin_error() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = AdminListen::Tcp(taken.local_addr().unwrap());
        let config = Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            admin_listen: Some(at.clone()),
            ..Config::default()
        };
        let Err(e) = Server::bind(config.clone(), service(&config)) else {
            panic!("bound an admin port in use");
        };
        assert!(
            matches!(&e, StartError::Admin { at: a, .. } if *a == at),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .starts_with(&format!("cannot listen on {at} (--admin-listen): ")),
            "{e}"
        );
    }
}

//! Starting a server: [`Server::bind`] binds the listeners described by the
//! configuration (TCP, or inherited by socket activation; Unix sockets; the
//! admin port), lets the service register its own sources, and logs the
//! start-up line and any exposure warnings.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use mio::net::TcpListener;
use mio::{Interest, Poll, Token, Waker};
use socket2::{Domain, Protocol, Socket, Type};

use crate::config::Config;
use crate::service::Service;
use crate::time::MonotonicClock;

use super::clock::Clock;
use super::{
    admin, systemd, unix, Server, StartError, ADMIN_CONN_BASE, LISTENER, SERVICE_TOKEN_BASE,
    UNIX_BASE, WAKER,
};

impl<S: Service> Server<S> {
    /// Binds the listener described by `config` (port 0 picks a free port),
    /// lets `service` register its own event sources, and logs the start-up
    /// line: version, bound address, service and limits.
    ///
    /// # Errors
    /// An invalid `config`, a TLS file that cannot be used, or an address
    /// that cannot be bound: [`StartError`] says which.
    pub fn bind(config: Config, mut service: S) -> Result<Self, StartError> {
        config.validate().map_err(StartError::Config)?;
        #[cfg(feature = "tls")]
        let tls = match &config.tls {
            Some(t) => Some(
                crate::tls::server_config(&t.cert, &t.key, t.client_ca.as_deref(), "--tls")
                    .map_err(StartError::Tls)?,
            ),
            None => None,
        };
        let poll = Poll::new().map_err(StartError::Setup)?;
        let (listener, local_addr) = bind_tcp(&config, &poll)?;
        let unix_listeners = bind_unix(&config, &poll)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER).map_err(StartError::Setup)?);
        let admin = bind_admin(&config, &poll)?;
        service
            .register(poll.registry(), SERVICE_TOKEN_BASE)
            .map_err(StartError::Setup)?;
        service.set_waker(Arc::clone(&waker));
        log_start(
            &config,
            listener.is_some().then_some(local_addr),
            admin.as_ref(),
            &service,
        );
        warn_if_exposed(&config, local_addr);
        let mut server = Server::assemble(
            config,
            service,
            poll,
            waker,
            listener,
            local_addr,
            Clock::Monotonic(MonotonicClock::new()),
        );
        server.unix = unix_listeners;
        #[cfg(feature = "tls")]
        {
            server.tls = tls;
        }
        server.admin = admin;
        server.notify = systemd::Notifier::from_env();
        Ok(server)
    }
}

/// The TCP client listener (`--listen`, or the one inherited by
/// `--listen-fd`), registered with `poll`; none when clients come only over
/// Unix sockets, with an unspecified address in its place.
fn bind_tcp(config: &Config, poll: &Poll) -> Result<(Option<TcpListener>, SocketAddr), StartError> {
    if !config.listen_tcp && config.listen_fd.is_none() {
        return Ok((None, SocketAddr::from(([0, 0, 0, 0], 0))));
    }
    let listen = |source| StartError::Listen {
        addr: config.listen,
        source,
    };
    let socket = match config.listen_fd {
        Some(fd) => inherited_listener(fd).map_err(|source| {
            if source.kind() == io::ErrorKind::InvalidInput {
                StartError::SocketActivation { fd, source }
            } else {
                listen(source)
            }
        })?,
        None => {
            let socket = Socket::new(
                Domain::for_address(config.listen),
                Type::STREAM,
                Some(Protocol::TCP),
            )
            .map_err(listen)?;
            // Restarting on the same port must not wait for TIME_WAIT to
            // clear.
            socket.set_reuse_address(true).map_err(listen)?;
            socket.bind(&config.listen.into()).map_err(listen)?;
            socket
                .listen(i32::try_from(config.backlog).unwrap_or(i32::MAX))
                .map_err(listen)?;
            socket
        }
    };
    socket.set_nonblocking(true).map_err(listen)?;
    let mut listener = TcpListener::from_std(socket.into());
    let local_addr = listener.local_addr().map_err(listen)?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)
        .map_err(listen)?;
    Ok((Some(listener), local_addr))
}

/// The Unix-socket client listeners (`--unix-listen`), registered with
/// `poll`, each marked as maybe having connections ready.
fn bind_unix(config: &Config, poll: &Poll) -> Result<Vec<(unix::UnixListen, bool)>, StartError> {
    let mut listeners = Vec::with_capacity(config.unix_listen.len());
    for (i, path) in config.unix_listen.iter().enumerate() {
        let unix = |source| StartError::Unix {
            path: path.clone(),
            source,
        };
        let mut l = unix::bind(path, config.socket_mode).map_err(unix)?;
        poll.registry()
            .register(&mut l.listener, Token(UNIX_BASE + i), Interest::READABLE)
            .map_err(unix)?;
        listeners.push((l, true));
    }
    Ok(listeners)
}

/// The admin port (`--admin-listen`), registered with `poll`, with its TLS
/// (`--admin-tls`) when built with it.
fn bind_admin(config: &Config, poll: &Poll) -> Result<Option<admin::Admin>, StartError> {
    let Some(addr) = &config.admin_listen else {
        return Ok(None);
    };
    #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
    let mut admin =
        admin::Admin::bind(addr, config, poll.registry(), ADMIN_CONN_BASE).map_err(|source| {
            StartError::Admin {
                at: addr.clone(),
                source,
            }
        })?;
    #[cfg(feature = "tls")]
    if let Some(t) = &config.admin_tls {
        let tls = crate::tls::server_config(&t.cert, &t.key, t.client_ca.as_deref(), "--admin-tls")
            .map_err(StartError::Tls)?;
        admin.set_tls(tls);
    }
    Ok(Some(admin))
}

/// The start-up line, the first the server logs: version, the addresses
/// clients connect to (`tcp`, when listening on TCP), service, limits and,
/// last, the admin port.
fn log_start<S: Service>(
    config: &Config,
    tcp: Option<SocketAddr>,
    admin: Option<&admin::Admin>,
    service: &S,
) {
    let mut addrs: Vec<String> = tcp.iter().map(ToString::to_string).collect();
    addrs.extend(
        config
            .unix_listen
            .iter()
            .map(|p| format!("unix:{}", p.display())),
    );
    let admin = admin.map_or_else(String::new, |a| {
        let https = cfg!(feature = "tls") && config.admin_tls.is_some();
        let scheme = if https { "HTTPS" } else { "HTTP" };
        format!(", admin port ({scheme}) on {}", a.describe())
    });
    log::info!(
        "ticketd {} listening on {} {} {}{admin}",
        env!("CARGO_PKG_VERSION"),
        addrs.join(" "),
        service.describe(),
        config.describe_limits()
    );
}

/// Warns at start-up when clients or the admin port can be reached off
/// loopback by anyone, unauthenticated (docs/SECURITY.md).
fn warn_if_exposed(config: &Config, local_addr: SocketAddr) {
    if config.insecure && config.plaintext_off_loopback() {
        log::warn!(
            "--insecure: clients speak plaintext on {local_addr}, which is not loopback: \
             anyone who can reach it can take, hold and release any lock \
             (docs/SECURITY.md)"
        );
    } else if config.unauthenticated_tls_off_loopback() {
        log::warn!(
            "clients speak TLS without client certificates on {local_addr}, which is not \
             loopback: anyone who can reach it can take and hold any key (tokens stay \
             private); --tls-client-ca admits only holders of a certificate \
             (docs/SECURITY.md)"
        );
    }
    if let Some(crate::config::AdminListen::Tcp(a)) = &config.admin_listen {
        if config.admin_unauthenticated_off_loopback() {
            let how = if config.admin_tls.is_some() {
                "speaks HTTPS without client certificates"
            } else {
                "speaks plaintext (--insecure)"
            };
            log::warn!(
                "the admin port on {a} {how}, and it is not loopback: anyone who can \
                 reach it can list every key and holder (and, in cluster mode, change the \
                 members); --admin-tls-client-ca admits only holders of a certificate \
                 (docs/SECURITY.md)"
            );
        }
    }
}

/// The listening socket systemd passed as descriptor `fd` (socket
/// activation), checked to be a TCP stream socket. The server owns it from
/// here on.
fn inherited_listener(fd: std::os::fd::RawFd) -> io::Result<Socket> {
    use std::os::fd::FromRawFd;
    // SAFETY: `fd` is the descriptor systemd passed this process for its
    // listener (LISTEN_FDS/LISTEN_PID, see `systemd::listen_fd`); nothing
    // else in the process owns or closes it.
    let socket = unsafe { Socket::from_raw_fd(fd) };
    let inet = socket
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .is_some();
    if !inet || socket.r#type()? != Type::STREAM {
        // Not ours to close: leave the descriptor as it was.
        std::mem::forget(socket);
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket activation: descriptor {fd} is not a TCP stream socket"),
        ));
    }
    Ok(socket)
}

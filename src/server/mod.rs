//! The mio shell: one thread, one hand-written poll loop, the only code in
//! ticketd that touches sockets.
//!
//! The [`Server`] owns the listener, a slab of connections (each with an
//! explicit read buffer, and a write buffer with a cursor for partial
//! writes), the clock and the signal source. What answers requests is a
//! [`Service`]: single mode's [`crate::single::SingleService`], or cluster
//! mode's, which registers its own peer sockets in the same poll with tokens
//! at or above [`SERVICE_TOKEN_BASE`].
//!
//! # One loop turn ([`Server::poll_once`])
//!
//! 1. Poll, with a timeout from the service's next deadline (zero when work
//!    is left over from the previous turn); then read the clock once.
//! 2. Note readiness; accept new connections (up to a bound per turn).
//! 3. Handle input: for each connection with input, decode frames straight
//!    from its read buffer and hand them to the service, at most
//!    `max_frames_per_turn` per connection (fairness); read until
//!    `WouldBlock` or a short read (see `Conn::drain`).
//! 4. `tick` the service, check timeouts, then `end_turn` (single mode makes
//!    its token mark durable there), and only then encode the turn's replies
//!    into the write buffers.
//! 5. One `write` per connection with output; `WRITABLE` interest is held
//!    only while bytes remain.
//! 6. Reap the connections marked closing during the turn.
//!
//! # Connections over sockets or pipes
//!
//! A connection's state machine (buffers, decoding, limits, closing) works
//! on a byte stream (`conn::Stream`): a mio socket, or, with the `harness`
//! feature (tests only), the server end of an in-memory pipe. The loop turn
//! is the same code for both; only readiness differs (epoll events for a
//! socket, the pipe's own edges for a pipe: `ticketd::harness`).
//!
//! # Limits
//!
//! Over `max_conns`, a new connection is accepted and closed at once, and
//! so is one over its identity's quotas (`quota`). A
//! connection whose unsent replies reach the soft limit is not read until
//! they drain (the kernel then pushes back on the client); at the hard limit
//! it is closed. A frame half-sent for `frame_timeout`, or replies that make
//! no progress for as long, close the connection. When `accept` fails for
//! lack of file descriptors, accepting pauses briefly instead of spinning and
//! resumes by itself.

pub mod admin;
mod conn;
pub mod identity;
#[cfg(feature = "harness")]
mod mem;
mod quota;
pub(crate) mod ratelimit;
mod start;
pub mod systemd;
pub(crate) mod throttle;
#[cfg(feature = "tls")]
mod tls;
mod transport;
mod unix;

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mio::event::Event;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;
use slab::Slab;
use socket2::{Domain, Protocol, Socket, Type};

use crate::config::{Config, MAX_CONNS_CEILING};
use crate::engine::{ConnId, Outbox};
use crate::limits::{max_reply_frame, max_request_frame};
use crate::proto::{decode_request, Decoded, Malformed, Request};
use crate::service::Service;
use crate::time::{Millis, MonotonicClock};

use conn::{Conn, Fill, PeerAddr, Stream};
use identity::{Identities, Identity};
use ratelimit::LogLimit;
pub use start::StartError;

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
const WAKER: Token = Token(2);
// Token(3) is the admin listener (`admin::LISTENER`).
/// Unix listener `i` has token `UNIX_BASE + i`.
const UNIX_BASE: usize = 4;
const _: () = assert!(admin::LISTENER.0 == 3 && admin::LISTENER.0 < UNIX_BASE);
const _: () = assert!(UNIX_BASE + crate::config::MAX_UNIX_LISTENERS <= CONN_BASE);
/// Connection `k` of the slab has token `CONN_BASE + k`.
const CONN_BASE: usize = 16;
/// Admin connection `k` has token `ADMIN_CONN_BASE + k`.
const ADMIN_CONN_BASE: usize = CONN_BASE + MAX_CONNS_CEILING;
/// The first mio token that belongs to the service (cluster peers). The
/// server's own tokens are all below it.
pub const SERVICE_TOKEN_BASE: usize = ADMIN_CONN_BASE + admin::CONNS_CEILING;
/// A [`crate::engine::ConnId`] is `(sequence << CONN_KEY_BITS) | slab key`: unique for the
/// life of the process (the sequence never repeats), yet it finds its slot
/// without a map.
const CONN_KEY_BITS: u32 = 21;
const CONN_KEY_MASK: u64 = (1 << CONN_KEY_BITS) - 1;
const _: () = assert!(MAX_CONNS_CEILING as u64 <= CONN_KEY_MASK);

/// Connections accepted per turn before the loop serves the others.
const ACCEPTS_PER_TURN: usize = 256;
/// How long accepting pauses after `EMFILE`/`ENFILE`.
const ACCEPT_PAUSE_MS: u64 = 100;
/// How often connections are checked for timeouts.
const SCAN_INTERVAL_MS: u64 = 1000;
/// How often closing connections are looked at while some are lingering.
const CLOSING_RECHECK_MS: u64 = 50;

/// Whether the server goes on after a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Serving.
    Running,
    /// Shut down: every connection is closed; further turns do nothing.
    Stopped,
}

/// Asks a running server to shut down, from any thread.
#[derive(Clone, Debug)]
pub struct ShutdownHandle {
    flag: Arc<AtomicBool>,
    waker: Arc<Waker>,
}

impl ShutdownHandle {
    /// Starts a graceful shutdown: stop accepting, flush within the flush
    /// timeout, close. The loop notices on its next turn.
    pub fn shutdown(&self) {
        self.flag.store(true, Ordering::SeqCst);
        if let Err(e) = self.waker.wake() {
            log::error!("cannot wake the server loop for shutdown: {e}");
        }
    }
}

/// A clock the caller moves by hand, for deterministic tests; see
/// [`Server::use_manual_clock`].
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// Sets the time. Moving it backwards is ignored.
    pub fn set(&self, now: Millis) {
        self.0.fetch_max(now.0, Ordering::SeqCst);
    }

    /// Moves the time forward by `ms`.
    pub fn advance_ms(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }

    /// The current time.
    #[must_use]
    pub fn now(&self) -> Millis {
        Millis(self.0.load(Ordering::SeqCst))
    }
}

#[derive(Debug)]
enum Clock {
    Monotonic(MonotonicClock),
    Manual(ManualClock),
}

impl Clock {
    fn now(&self) -> Millis {
        match self {
            Clock::Monotonic(c) => c.now(),
            Clock::Manual(c) => c.now(),
        }
    }
}

/// Counters for tests, examples and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections accepted and served.
    pub accepted: u64,
    /// Connections accepted and closed at once because of `max_conns`.
    pub refused: u64,
    /// Unix-socket client connections closed at once: the peer's uid and
    /// gid are not in `--allow-uid` / `--allow-gid`.
    pub refused_peer: u64,
    /// Connections closed for malformed input.
    pub malformed: u64,
    /// Connections closed at the output hard limit or for a timeout.
    pub limit_closes: u64,
    /// Times accepting paused for lack of file descriptors.
    pub accept_pauses: u64,
    /// Loop turns.
    pub turns: u64,
    /// Identities whose guess budget paused reads (too many `N` and
    /// `X` answers).
    pub throttled: u64,
    /// Wrong-token answers (`N`, `X`) charged to identities' guess budgets.
    pub guesses: u64,
    /// Connections accepted and closed at once because their identity had
    /// `--max-conns-per-identity` open (or, for a client certificate's
    /// identity, closed when their handshake was done).
    pub refused_identity: u64,
    /// TLS connections accepted and closed at once because their source
    /// address had `--max-handshakes-per-identity` handshakes under way.
    pub refused_handshakes: u64,
    /// Connections accepted and closed at once because the connections'
    /// buffers alone filled `--max-memory`.
    pub refused_memory: u64,
    /// Admin connections accepted and closed at once (too many open).
    pub admin_refused: u64,
    /// Unix-socket admin connections closed at once: the peer's uid and
    /// gid are not in `--allow-uid` / `--allow-gid`.
    pub admin_refused_peer: u64,
    /// Well-formed requests handled: acquire, release, extend.
    pub requests: [u64; 3],
    /// Replies sent: acquired, timeout, busy, released, not released,
    /// extended, not extended.
    pub replies: [u64; 7],
}

struct Logs {
    refused: LogLimit,
    malformed: LogLimit,
    limits: LogLimit,
    accept: LogLimit,
    service: LogLimit,
    guesses: LogLimit,
    unix_refused: LogLimit,
}

/// The single-threaded server. See the module documentation.
pub struct Server<S: Service> {
    config: Config,
    poll: Poll,
    events: Option<Events>,
    listener: Option<TcpListener>,
    local_addr: SocketAddr,
    /// Unix-domain listeners, and whether each may have connections ready.
    unix: Vec<(unix::UnixListen, bool)>,
    signals: Option<Signals>,
    waker: Arc<Waker>,
    stop_flag: Arc<AtomicBool>,
    service: S,
    clock: Clock,
    conns: Slab<Conn>,
    next_conn_seq: u64,
    /// Connections with input to handle this turn, and the next turn.
    active: Vec<usize>,
    active_next: Vec<usize>,
    /// Connections with output to write this turn.
    dirty: Vec<usize>,
    /// Connections marked closing, reaped when done.
    closing: Vec<usize>,
    /// Reused buffer for [`Service::take_closes`].
    close_ids: Vec<ConnId>,
    /// Identities with connections the guess budget paused (each listed
    /// once; its entry holds the connections).
    paused_idents: Vec<identity::IdentKey>,
    /// The identities of the open connections, and what each is charged.
    identities: Identities,
    /// `--admin-identity`, as a grant holder ([`Identity::holder`]).
    admin_holder: Option<u64>,
    /// Bytes of the open connections, as last counted
    /// ([`conn::Conn::recount_memory`]): the connections' part of
    /// `--max-memory`.
    conn_bytes: u64,
    /// The quotas' log lines.
    quota_logs: quota::QuotaLogs,
    out: Outbox,
    accept_ready: bool,
    accept_paused_until: Option<Millis>,
    shutdown_deadline: Option<Millis>,
    stopped: bool,
    /// Why the service needs the loop to stop now ([`Service::must_stop`]):
    /// `poll_once` returns it as its error.
    fatal: Option<String>,
    next_scan: Millis,
    stats: Stats,
    logs: Logs,
    admin: Option<admin::Admin>,
    notify: Option<systemd::Notifier>,
    /// TLS on the TCP client listener (`--tls-cert`).
    #[cfg(feature = "tls")]
    tls: Option<Arc<rustls::ServerConfig>>,
}

/// Charges one wrong-token answer to identity `e` (last from `peer`),
/// logging (rate-limited) the first time it is slowed down.
fn charge_guess(
    e: &mut identity::Entry,
    stats: &mut Stats,
    logs: &mut Logs,
    now: Millis,
    peer: PeerAddr,
) {
    stats.guesses += 1;
    if !e.guesses.charge(now) {
        return;
    }
    stats.throttled += 1;
    if let Some(n) = logs.guesses.allow(now) {
        log::warn!(
            "slowing down {} (last from {peer}): {} releases or extends with a token it does \
             not hold; its releases and extends are held to {} such answers a second, then \
             {} ({n} similar not logged)",
            e.identity,
            e.guesses.misses,
            throttle::GUESS_PER_SEC,
            throttle::GUESS_SUSTAINED_PER_SEC,
        );
    }
}

fn is_fd_exhaustion(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
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

fn conn_token(key: usize) -> Token {
    Token(CONN_BASE + key)
}

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

    /// The server around its parts; nothing is polled yet.
    fn assemble(
        config: Config,
        service: S,
        poll: Poll,
        waker: Arc<Waker>,
        listener: Option<TcpListener>,
        local_addr: SocketAddr,
        clock: Clock,
    ) -> Self {
        let mut out = Outbox::new();
        out.set_direct_grant_marks(service.withholds_grants());
        Server {
            poll,
            events: Some(Events::with_capacity(1024)),
            listener,
            local_addr,
            unix: Vec::new(),
            signals: None,
            waker,
            stop_flag: Arc::new(AtomicBool::new(false)),
            service,
            clock,
            conns: Slab::new(),
            next_conn_seq: 1,
            active: Vec::new(),
            active_next: Vec::new(),
            dirty: Vec::new(),
            closing: Vec::new(),
            close_ids: Vec::new(),
            paused_idents: Vec::new(),
            identities: Identities::default(),
            admin_holder: config.admin_identity.as_ref().map(Identity::holder),
            conn_bytes: 0,
            quota_logs: quota::QuotaLogs::default(),
            out,
            accept_ready: true,
            accept_paused_until: None,
            shutdown_deadline: None,
            stopped: false,
            fatal: None,
            next_scan: Millis::ZERO.add_ms(SCAN_INTERVAL_MS),
            stats: Stats::default(),
            logs: Logs {
                refused: LogLimit::new(1, 10_000),
                malformed: LogLimit::new(10, 10_000),
                limits: LogLimit::new(10, 10_000),
                accept: LogLimit::new(1, 10_000),
                service: LogLimit::new(1, 10_000),
                guesses: LogLimit::new(1, 10_000),
                unix_refused: LogLimit::new(1, 10_000),
            },
            admin: None,
            notify: None,
            #[cfg(feature = "tls")]
            tls: None,
            config,
        }
    }

    /// The address actually bound (the real port when 0 was asked).
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The TCP address of the admin port, when `--admin-listen` gives one
    /// (`None` for `unix:/path`, and without the flag).
    #[must_use]
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(admin::Admin::local_addr)
    }

    /// The configuration the server runs with.
    #[must_use]
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The service, for inspection.
    #[must_use]
    pub fn service(&self) -> &S {
        &self.service
    }

    /// The service, mutably (between turns).
    pub fn service_mut(&mut self) -> &mut S {
        &mut self.service
    }

    /// Counters since start.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Open client connections (including those being closed).
    #[must_use]
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// A handle that shuts the server down from any thread.
    #[must_use]
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            flag: Arc::clone(&self.stop_flag),
            waker: Arc::clone(&self.waker),
        }
    }

    /// Shuts down on SIGTERM and SIGINT (the daemon does this; an embedding
    /// program may prefer its own handling).
    ///
    /// # Errors
    /// The signal handlers cannot be installed.
    pub fn handle_signals(&mut self) -> io::Result<()> {
        let mut signals = Signals::new([SIGTERM, SIGINT])?;
        self.poll
            .registry()
            .register(&mut signals, SIGNALS, Interest::READABLE)?;
        self.signals = Some(signals);
        Ok(())
    }

    /// Replaces the OS monotonic clock with one the caller moves, starting at
    /// the current time, so leases and waits can be stepped through
    /// deterministically. Poll timeouts still follow the deadlines; pass a
    /// `max_wait` to [`Server::poll_once`] to keep turns short.
    pub fn use_manual_clock(&mut self) -> ManualClock {
        let clock = ManualClock::default();
        clock.set(self.clock.now());
        self.clock = Clock::Manual(clock.clone());
        clock
    }

    /// Runs turns until shut down (signal or [`ShutdownHandle`]).
    ///
    /// # Errors
    /// The poll itself fails (not a connection error: those close the
    /// connection), or the service must stop ([`Service::must_stop`]).
    pub fn run(&mut self) -> io::Result<()> {
        while self.poll_once(None)? == Status::Running {}
        Ok(())
    }

    /// One loop turn: waits for readiness at most `max_wait` (`None`: until
    /// the next deadline or event), then handles everything ready.
    ///
    /// # Errors
    /// The poll itself fails, or the service must stop
    /// ([`Service::must_stop`]; later calls then return
    /// [`Status::Stopped`]).
    pub fn poll_once(&mut self, max_wait: Option<Duration>) -> io::Result<Status> {
        if self.stopped {
            return Ok(Status::Stopped);
        }
        let before = self.clock.now();
        let timeout = self.poll_timeout(before, max_wait);
        let mut events = self
            .events
            .take()
            .unwrap_or_else(|| Events::with_capacity(1024));
        let polled = self.poll.poll(&mut events, timeout);
        let now = self.clock.now();
        match polled {
            Ok(()) => {
                for event in &events {
                    self.note_event(now, event);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                self.events = Some(events);
                return Err(e);
            }
        }
        self.events = Some(events);
        self.turn(now);
        if let Some(why) = self.fatal.take() {
            self.stopped = true;
            return Err(io::Error::other(why));
        }
        Ok(if self.stopped {
            Status::Stopped
        } else {
            Status::Running
        })
    }

    fn poll_timeout(&self, now: Millis, max_wait: Option<Duration>) -> Option<Duration> {
        let accept_pending = self.accept_paused_until.is_none()
            && ((self.accept_ready && self.listener.is_some())
                || self.unix.iter().any(|(_, ready)| *ready));
        if !self.active.is_empty() || !self.dirty.is_empty() || accept_pending {
            return Some(Duration::ZERO);
        }
        let mut at = self.service.next_deadline().unwrap_or(Millis::NEVER);
        if !self.conns.is_empty() {
            at = at.min(self.next_scan);
        }
        if !self.closing.is_empty() {
            at = at.min(now.add_ms(CLOSING_RECHECK_MS));
        }
        if let Some(t) = self.accept_paused_until {
            at = at.min(t);
        }
        for &ik in &self.paused_idents {
            if let Some(e) = self.identities.get(ik) {
                at = at.min(e.guesses.resume_at());
            }
        }
        if let Some(t) = self.shutdown_deadline {
            at = at.min(t);
        }
        if let Some(t) = self.admin.as_ref().and_then(|a| a.next_deadline(now)) {
            at = at.min(t);
        }
        if let Some(t) = self
            .notify
            .as_ref()
            .and_then(systemd::Notifier::next_deadline)
        {
            at = at.min(t);
        }
        let until = (at != Millis::NEVER).then(|| now.until(at));
        match (until, max_wait) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn note_event(&mut self, now: Millis, event: &Event) {
        match event.token() {
            LISTENER => self.accept_ready = true,
            Token(t) if (UNIX_BASE..UNIX_BASE + self.unix.len()).contains(&t) => {
                self.unix[t - UNIX_BASE].1 = true;
            }
            WAKER => {}
            t if self.admin.as_ref().is_some_and(|a| a.owns(t)) => {
                if let Some(a) = self.admin.as_mut() {
                    a.note_event(event);
                }
            }
            SIGNALS => {
                let mut stop = false;
                if let Some(signals) = self.signals.as_mut() {
                    for sig in signals.pending() {
                        log::info!("received signal {sig}, shutting down");
                        stop = true;
                    }
                }
                if stop {
                    self.stop_flag.store(true, Ordering::SeqCst);
                }
            }
            Token(t) if t >= SERVICE_TOKEN_BASE => {
                self.service
                    .event(now, self.poll.registry(), event, &mut self.out);
            }
            Token(t) if t >= CONN_BASE => {
                let key = t - CONN_BASE;
                let Some(c) = self.conns.get_mut(key) else {
                    return;
                };
                if event.is_readable() || event.is_read_closed() || event.is_error() {
                    c.note_readable(event.is_read_closed() || event.is_error());
                    if c.mark_active() {
                        self.active.push(key);
                    }
                }
                if (event.is_writable() || event.is_write_closed() || event.is_error())
                    && c.mark_dirty()
                {
                    self.dirty.push(key);
                }
            }
            Token(_) => {}
        }
    }

    fn turn(&mut self, now: Millis) {
        self.stats.turns += 1;
        if self.stop_flag.load(Ordering::SeqCst) && self.shutdown_deadline.is_none() {
            self.begin_shutdown(now);
        }
        if self.shutdown_deadline.is_none() {
            self.accept(now);
        }
        self.resume_throttled(now);
        self.service.set_connection_memory(self.conn_bytes);
        // Reading takes time: handling input moves `now` to the clock reading
        // after the last read, so the rest of the turn never runs behind it.
        let now = self.handle_input(now);
        self.note_quota_refusals(now);
        self.service.tick(now, &mut self.out);
        if now >= self.next_scan {
            self.scan(now);
        }
        if let Err(e) = self.service.end_turn(now, &mut self.out) {
            if let Some(why) = self.service.must_stop() {
                // None of this turn's replies leaves: the node that made
                // them cannot vouch for them (those already encoded into
                // write buffers are cut out again).
                self.cut_back_direct();
                self.fatal = Some(why);
                return;
            }
            if let Some(n) = self.logs.service.allow(now) {
                log::error!("service failed to end the turn: {e} ({n} similar errors suppressed)");
            }
        }
        self.deliver(now);
        self.close_asked(now);
        self.write(now);
        // After the lock replies are written: the admin port never delays one.
        self.admin_turn(now);
        self.reap(now);
        if let Some(n) = self.notify.as_mut() {
            n.ready(self.shutdown_deadline.is_none() && self.service.serving());
            n.watchdog(now);
        }
        if let Some(deadline) = self.shutdown_deadline {
            if self.conns.is_empty() || now >= deadline {
                self.finish_shutdown(now);
            }
        }
    }

    fn admin_turn(&mut self, now: Millis) {
        let Some(admin) = self.admin.as_mut() else {
            return;
        };
        let view = admin::View {
            observed: self.service.observe(),
            stats: &self.stats,
            connections: self.conns.len(),
            max_key_bytes: self.config.max_key_bytes,
            stopping: self.shutdown_deadline.is_some(),
            identities: &self.identities,
            admin_identity: self.config.admin_identity.as_ref(),
            connection_bytes: self.conn_bytes,
            max_memory: self.config.engine.max_memory,
        };
        admin.turn(now, self.poll.registry(), &view);
        self.stats.admin_refused = admin.refused;
        self.stats.admin_refused_peer = admin.refused_peer;
        for (key, change) in admin.take_changes() {
            let outcome = self
                .service
                .membership()
                .map(|m| m.member_change(now, change));
            admin.answer(key, outcome);
        }
    }

    fn accept(&mut self, now: Millis) {
        if let Some(until) = self.accept_paused_until {
            if now < until {
                return;
            }
            // Connections may be waiting in the backlog with no new edge to
            // announce them: try regardless of readiness.
            self.accept_paused_until = None;
            self.accept_ready = true;
            for (_, ready) in &mut self.unix {
                *ready = true;
            }
        }
        for i in 0..self.unix.len() {
            if self.unix[i].1 && self.accept_paused_until.is_none() {
                self.accept_unix(now, i);
            }
        }
        if self.accept_ready && self.accept_paused_until.is_none() {
            self.accept_tcp(now);
        }
    }

    /// Accepts what the TCP listener has.
    fn accept_tcp(&mut self, now: Millis) {
        for _ in 0..ACCEPTS_PER_TURN {
            let Some(listener) = self.listener.as_ref() else {
                return;
            };
            match listener.accept() {
                Ok((stream, peer)) => {
                    let tls = self.tls_listener();
                    if self.refused_at_max_conns(now, &peer)
                        || self.refused_by_quota(now, &peer, &Identity::of_addr(peer), tls)
                    {
                        drop(stream);
                        continue;
                    }
                    self.add_conn(now, stream, peer);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.accept_ready = false;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                    ) => {}
                Err(e) => {
                    // EMFILE, ENFILE, ENOBUFS, ENOMEM: the pending connection
                    // stays in the backlog and the listener stays readable, so
                    // retrying now would spin. Pause, and retry on a timer.
                    if let Some(n) = self.pause_accepts(now) {
                        let why = if is_fd_exhaustion(&e) {
                            "out of file descriptors"
                        } else {
                            "accept failed"
                        };
                        log::warn!(
                            "{why} ({e}); pausing accepts for {ACCEPT_PAUSE_MS} ms with {} \
                             connections open ({n} similar pauses not logged)",
                            self.conns.len()
                        );
                    }
                    return;
                }
            }
        }
    }

    /// Accepts what Unix listener `i` has, checking each peer's credentials.
    fn accept_unix(&mut self, now: Millis, i: usize) {
        for _ in 0..ACCEPTS_PER_TURN {
            let (l, ready) = &mut self.unix[i];
            match l.listener.accept() {
                Ok((mut stream, _)) => {
                    let (uid, gid, pid) = match unix::peer_cred(&stream) {
                        Ok(c) => c,
                        Err(e) => {
                            log::debug!("{}: no peer credentials: {e}", l.path.display());
                            continue;
                        }
                    };
                    let peer = PeerAddr::Unix { uid, gid, pid };
                    if !unix::allowed(uid, gid, &self.config.allow_uids, &self.config.allow_gids) {
                        self.stats.refused_peer += 1;
                        if let Some(n) = self.logs.unix_refused.allow(now) {
                            log::warn!(
                                "refused {peer} on {}: its uid and gid are not in --allow-uid \
                                 / --allow-gid ({n} similar refusals not logged)",
                                l.path.display()
                            );
                        }
                        continue;
                    }
                    if self.refused_at_max_conns(now, &peer)
                        || self.refused_by_quota(now, &peer, &Identity::Uid(uid), false)
                    {
                        continue;
                    }
                    let key = self.conns.vacant_key();
                    if let Err(e) = self.poll.registry().register(
                        &mut stream,
                        conn_token(key),
                        Interest::READABLE,
                    ) {
                        log::warn!("{peer}: cannot register the connection: {e}");
                        continue;
                    }
                    self.insert_conn(Stream::Unix(stream), peer);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    *ready = false;
                    return;
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted
                            | io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                    ) => {}
                Err(e) => {
                    // As for TCP: the connection stays in the backlog; pause.
                    if let Some(n) = self.pause_accepts(now) {
                        log::warn!(
                            "accept on {} failed ({e}); pausing accepts for {ACCEPT_PAUSE_MS} \
                             ms ({n} similar pauses not logged)",
                            self.unix[i].0.path.display()
                        );
                    }
                    return;
                }
            }
        }
    }

    /// Whether a connection from `peer` is refused for `--max-conns`: if
    /// so, counted and (rate-limited) logged; the caller drops it.
    fn refused_at_max_conns(&mut self, now: Millis, peer: &dyn std::fmt::Display) -> bool {
        if self.conns.len() < self.config.max_conns {
            return false;
        }
        self.stats.refused += 1;
        if let Some(n) = self.logs.refused.allow(now) {
            log::warn!(
                "refused {peer}: {} connections open, the --max-conns limit \
                 ({n} similar refusals suppressed)",
                self.conns.len()
            );
        }
        true
    }

    /// Pauses every accept for `ACCEPT_PAUSE_MS` after a failure that
    /// leaves the connection in the backlog (retrying now would spin), and
    /// counts it; `Some(similar pauses not logged)` when this one may be.
    fn pause_accepts(&mut self, now: Millis) -> Option<u64> {
        self.accept_paused_until = Some(now.add_ms(ACCEPT_PAUSE_MS));
        self.stats.accept_pauses += 1;
        self.logs.accept.allow(now)
    }

    fn add_conn(&mut self, now: Millis, mut stream: TcpStream, peer: SocketAddr) {
        // Replies are written once per turn already; Nagle would only add delay.
        if let Err(e) = stream.set_nodelay(true) {
            log::debug!("{peer}: cannot set TCP_NODELAY: {e}");
        }
        let key = self.conns.vacant_key();
        if let Err(e) =
            self.poll
                .registry()
                .register(&mut stream, conn_token(key), Interest::READABLE)
        {
            log::warn!("{peer}: cannot register the connection: {e}");
            return;
        }
        #[cfg(feature = "tls")]
        if let Some(config) = &self.tls {
            match tls::TlsStream::new(stream, config, now) {
                Ok(t) => {
                    self.insert_conn(Stream::Tls(Box::new(t)), peer);
                }
                Err(e) => log::warn!("{peer}: cannot start a TLS session: {e}"),
            }
            return;
        }
        let _ = now;
        self.insert_conn(Stream::Tcp(stream), peer);
    }

    /// Adds an accepted (and, for a socket, registered) connection to the
    /// slab, ready to be read on this turn.
    fn insert_conn(&mut self, stream: Stream, peer: impl Into<PeerAddr>) -> ConnId {
        let peer = peer.into();
        let identity = match peer {
            PeerAddr::Tcp(addr) => Identity::of_addr(addr),
            PeerAddr::Unix { uid, .. } => Identity::Uid(uid),
        };
        let ident = self.identities.attach(identity);
        let entry = self.conns.vacant_entry();
        let key = entry.key();
        let id = (self.next_conn_seq << CONN_KEY_BITS) | key as u64;
        self.next_conn_seq += 1;
        self.stats.accepted += 1;
        log::debug!("{peer}: connected as {id}");
        // A client may have sent its first frames before registration: a
        // new connection is readable, and read on this turn.
        let mut c = Conn::new(stream, peer, id, ident);
        c.mark_active();
        quota::count_new(&mut self.identities, &c);
        self.conn_bytes += c.recount_memory().1 as u64;
        entry.insert(c);
        self.active.push(key);
        id
    }

    /// Reads again from connections the guess budget paused, as many of
    /// each identity's (oldest first) as its budget has room for now.
    fn resume_throttled(&mut self, now: Millis) {
        let turn = self.stats.turns;
        let (conns, active, identities) = (&mut self.conns, &mut self.active, &mut self.identities);
        self.paused_idents.retain(|&ik| {
            let Some(e) = identities.get_mut(ik) else {
                return false;
            };
            // `Some(k)`: k + 1 more releases or extends may be read.
            let Some(room) = e.guesses.room(now, turn) else {
                return true;
            };
            let mut woken = 0;
            while woken <= room {
                let Some((key, id)) = e.paused.pop_front() else {
                    break;
                };
                let Some(c) = conns.get_mut(key).filter(|c| c.id() == id) else {
                    continue;
                };
                c.unpause_for_guesses();
                if c.mark_active() {
                    active.push(key);
                }
                woken += 1;
            }
            !e.paused.is_empty()
        });
    }

    /// Handles the input of every active connection; returns `now` as it
    /// stands after the last read of the turn.
    #[cfg_attr(ticketd_profile, inline(never))]
    fn handle_input(&mut self, mut now: Millis) -> Millis {
        let mut list = std::mem::take(&mut self.active);
        for &key in &list {
            self.handle_conn_input(&mut now, key);
        }
        list.clear();
        // Whatever was queued during the turn (leftover budget, resumed
        // connections) is for the next turn; keep the allocation.
        self.active = std::mem::replace(&mut self.active_next, list);
        now
    }

    /// Decodes and handles what `key` has sent, reading until `WouldBlock`
    /// or a bound. `now` moves forward after every read that brought bytes:
    /// a request must never be handled with a clock reading from before it
    /// was written, or its lease would be counted from before the client's
    /// own start and could end before the client's conservative expiry
    /// (PROTOCOL §3: written + lease).
    // Long because it is the per-request loop (read, decode, handle, until
    // the connection is drained), kept in one piece for speed: the
    // connection and its frame bytes stay borrowed from the table while the
    // service, the outbox and the stats are used beside them, which no
    // method on `self` could do, and the outcome is settled once after it.
    #[cfg_attr(ticketd_profile, inline(never))]
    fn handle_conn_input(&mut self, now_ref: &mut Millis, key: usize) {
        let mut now = *now_ref;
        enum End {
            Idle,
            Again,
            Malformed(Malformed),
            PeerClosed,
            Failed(io::Error),
        }
        let max_key_bytes = self.config.max_key_bytes;
        let max_frame = max_request_frame(max_key_bytes);
        let soft = self.config.out_soft_limit_bytes;
        let debug = log::log_enabled!(log::Level::Debug);
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        c.clear_active();
        if !c.is_open() {
            return; // reads of a closing connection are the reaper's
        }
        if let Some(cert) = c.take_handshake() {
            let max = self.config.max_conns_per_identity;
            let quotas = (
                &mut self.identities,
                &mut self.stats,
                &mut self.quota_logs,
                max,
            );
            if !quota::handshake_done(quotas, c, cert, now) {
                self.close_now(now, key);
                return;
            }
        }
        let (id, peer) = (c.id(), c.peer());
        let turn = self.stats.turns;
        // The service answers releases and extends in the call that hands
        // them over: each wrong answer is charged as it is made, so an
        // identity's pipelined releases of its own grants never count as
        // possible guesses (see `throttle`).
        let at_once = self.service.answers_in_the_call();
        let mut budget = self.config.max_frames_per_turn;
        // Unsent bytes plus the largest replies the turn's requests can still
        // add: decoding stops when that reaches the soft limit, so a client
        // that does not read overshoots it by at most one reply.
        let mut projected_out = c.unsent();
        let mut throttled = false;
        // The replies to this connection's requests are encoded straight
        // into its write buffer, lent to the outbox for the loop (not while
        // debug logging reads them back from the outbox, nor while the
        // outbox holds a reply to it that must go first).
        let lent = (self.service.replies_direct() && !debug && self.out.may_lend(id)).then(|| {
            let buf = c.lend_output();
            let len = buf.len();
            self.out.begin_direct(id, buf);
            len
        });
        let end = loop {
            let unsent = match lent {
                Some(_) => c.unsent_lent(self.out.direct_len()),
                None => c.unsent(),
            };
            if unsent >= soft {
                c.pause_input();
                break End::Idle;
            }
            let Some(ident) = self.identities.get_mut(c.ident()) else {
                break End::Idle; // never: an open connection has its identity
            };
            let who = crate::engine::Caller {
                holder: ident.holder,
                admin: self.admin_holder == Some(ident.holder),
            };
            let mut bad = None;
            // What the identity's budget would say before every release or
            // extend, counted down: `now` only moves with a read.
            let mut room = ident.guesses.room(now, turn);
            while budget > 0 && projected_out < soft {
                match decode_request(c.frame_bytes(), max_key_bytes) {
                    Decoded::Frame { frame, used } => {
                        if !frame.is_acquire() {
                            let Some(left) = room else {
                                throttled = true;
                                break;
                            };
                            if !at_once {
                                ident.guesses.note_request(turn);
                                room = left.checked_sub(1);
                            }
                        }
                        if debug {
                            log::debug!("{peer} ({id}): {frame:?}");
                        }
                        projected_out += max_reply_frame(frame.key().len());
                        self.stats.requests[match frame {
                            Request::Acquire { .. } => 0,
                            Request::Release { .. } => 1,
                            Request::Extend { .. } => 2,
                            Request::AcquireWithLimit { .. } => 0,
                        }] += 1;
                        let wrong_before = self.out.wrong_token_count();
                        let guess = frame.guessed_token();
                        self.service.request_as(now, id, who, frame, &mut self.out);
                        if at_once && guess && self.out.wrong_token_count() > wrong_before {
                            // Answered N or X at once: charged now, and the
                            // room left is what the budget says after it.
                            charge_guess(ident, &mut self.stats, &mut self.logs, now, peer);
                            room = ident.guesses.room(now, turn);
                        }
                        c.consume(used);
                        budget -= 1;
                    }
                    Decoded::Incomplete => break,
                    Decoded::Malformed(m) => {
                        bad = Some(m);
                        break;
                    }
                }
            }
            if let Some(m) = bad {
                break End::Malformed(m);
            }
            if throttled {
                break End::Idle;
            }
            if budget == 0 || projected_out >= soft {
                // Next turn: the replies will be counted for real by then.
                break End::Again;
            }
            if c.peer_closed() {
                break End::PeerClosed;
            }
            if !c.may_read() {
                break End::Idle;
            }
            match c.read_more(max_frame) {
                Ok(Fill::Bytes) => {
                    now = now.max(self.clock.now());
                    *now_ref = now;
                    if c.handshake_untaken() {
                        // The read finished a TLS handshake and brought
                        // requests: they are handled next turn, as the
                        // identity its certificate names.
                        break End::Again;
                    }
                }
                Ok(Fill::Eof | Fill::WouldBlock) => {}
                Ok(Fill::Full) => break End::Again,
                Err(e) => break End::Failed(e),
            }
        };
        if let Some(len) = lent {
            if c.return_output(self.out.end_direct(), len) && c.mark_dirty() {
                self.dirty.push(key);
            }
        }
        if throttled && c.pause_for_guesses() {
            // Reads resume when the budget says so (see `resume_throttled`).
            if let Some(e) = self.identities.get_mut(c.ident()) {
                if e.paused.is_empty() {
                    self.paused_idents.push(c.ident());
                }
                e.paused.push_back((key, c.id()));
            }
        }
        c.end_input_turn(now, throttled, soft);
        let (was, is) = c.recount_memory();
        self.conn_bytes = self.conn_bytes + is as u64 - was as u64;
        if c.stream_has_output() && c.mark_dirty() {
            // TLS handshake records the socket did not take: write them.
            self.dirty.push(key);
        }
        match end {
            End::Idle => {}
            End::Again => {
                c.mark_active();
                self.active_next.push(key);
            }
            End::Malformed(m) => {
                self.stats.malformed += 1;
                if let Some(n) = self.logs.malformed.allow(now) {
                    log::warn!(
                        "closing {}: malformed frame: {m} ({n} similar closes not logged)",
                        c.peer()
                    );
                }
                self.start_close(now, key, true);
            }
            End::PeerClosed => {
                log::debug!("{}: closed by the peer", c.peer());
                self.start_close(now, key, false);
            }
            End::Failed(e) => {
                log::debug!("{}: read failed: {e}", c.peer());
                self.close_now(now, key);
            }
        }
    }

    /// Closes, after a flush of what they were answered, the connections the
    /// service asked to close ([`Service::take_closes`]).
    fn close_asked(&mut self, now: Millis) {
        let mut ids = std::mem::take(&mut self.close_ids);
        self.service.take_closes(&mut ids);
        for &conn in &ids {
            let key = usize::try_from(conn & CONN_KEY_MASK).unwrap_or(usize::MAX);
            if self.conns.get(key).is_some_and(|c| c.id() == conn) {
                log::debug!("closing connection {conn}: the service cannot answer it");
                self.start_close(now, key, true);
            }
        }
        ids.clear();
        self.close_ids = ids;
    }

    /// Marks `key` closing after a flush of its unsent replies (bounded by the
    /// flush timeout) and cancels its queued acquires at once.
    fn start_close(&mut self, now: Millis, key: usize, linger: bool) {
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        if !c.begin_drain(now.add_ms(millis(self.config.flush_timeout)), linger) {
            return;
        }
        let id = c.id();
        if c.mark_dirty() {
            self.dirty.push(key);
        }
        self.closing.push(key);
        self.service.disconnect(now, id, &mut self.out);
    }

    /// Marks `key` to be closed at the end of the turn, unsent replies dropped.
    fn close_now(&mut self, now: Millis, key: usize) {
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        let id = c.id();
        if c.close_now() {
            self.closing.push(key);
            self.service.disconnect(now, id, &mut self.out);
        }
    }

    /// Timeouts: TLS handshakes, half-sent frames and replies that make
    /// no progress.
    fn scan(&mut self, now: Millis) {
        self.next_scan = now.add_ms(SCAN_INTERVAL_MS);
        self.identities.sweep(now);
        let frame_limit = self.config.frame_timeout.map(millis);
        let handshake_limit = millis(self.config.handshake_limit());
        let mut expired = Vec::new();
        for (key, c) in &self.conns {
            if !c.is_open() {
                continue;
            }
            let handshake = c.handshake_expired(now, handshake_limit);
            let (partial, stalled) = frame_limit.map_or((false, false), |limit| {
                (c.partial_expired(now, limit), c.output_stalled(now, limit))
            });
            if handshake || partial || stalled {
                expired.push((key, partial || handshake, handshake));
            }
        }
        for (key, partial, handshake) in expired {
            self.stats.limit_closes += 1;
            if let Some(n) = self.logs.limits.allow(now) {
                let peer = self.conns[key].peer();
                let what = if handshake {
                    "a TLS handshake unfinished for --handshake-timeout"
                } else if partial {
                    "a frame half-sent for --frame-timeout"
                } else {
                    "unread replies for --frame-timeout"
                };
                log::warn!("closing {peer}: {what} ({n} similar closes not logged)");
            }
            if partial {
                self.start_close(now, key, true);
            } else {
                self.close_now(now, key);
            }
        }
    }

    /// Cuts out of the write buffers what the service withheld of the
    /// replies encoded straight into them while their requests were
    /// handled, and copies the turn's other replies (encoded once, in the
    /// outbox: those to a connection not being handled, such as a waiter's
    /// grant) into their connections' write buffers, a run of replies to
    /// one connection in one copy. Counts the wrong-token answers (`N`,
    /// `X`) against each connection's guess throttle.
    #[cfg_attr(ticketd_profile, inline(never))]
    fn deliver(&mut self, now: Millis) {
        // Grants encoded straight into write buffers that the service then
        // withheld (`Outbox::retain_leases`) are cut out, last first so
        // that each range is still where it was written.
        for &(conn, start, end) in self.out.direct_withdrawn().iter().rev() {
            let key = usize::try_from(conn & CONN_KEY_MASK).unwrap_or(usize::MAX);
            if let Some(c) = self.conns.get_mut(key).filter(|c| c.id() == conn) {
                c.withdraw(start, end);
            }
        }
        self.out.tally(&mut self.stats.replies);
        if log::log_enabled!(log::Level::Debug) {
            for a in self.out.iter() {
                let key = usize::try_from(a.conn & CONN_KEY_MASK).unwrap_or(usize::MAX);
                match self.conns.get(key) {
                    Some(c) if c.id() == a.conn && !c.closing_now() => {
                        log::debug!("{} ({}) <- {:?}", c.peer(), c.id(), a.reply);
                    }
                    _ => log::debug!("dropped a reply to closed connection {}", a.conn),
                }
            }
        }
        // Wrong-token answers (N, X) count against their connection's
        // identity's guess budget (those of a service that answers in the
        // call were charged as they were made).
        let charged = self.service.answers_in_the_call();
        for conn in self.out.wrong_token_answers().filter(|_| !charged) {
            let key = usize::try_from(conn & CONN_KEY_MASK).unwrap_or(usize::MAX);
            let Some(c) = self.conns.get(key).filter(|c| c.id() == conn) else {
                continue;
            };
            let Some(e) = self.identities.get_mut(c.ident()) else {
                continue;
            };
            charge_guess(e, &mut self.stats, &mut self.logs, now, c.peer());
        }
        for (conn, frames) in self.out.frames() {
            let key = usize::try_from(conn & CONN_KEY_MASK).unwrap_or(usize::MAX);
            let Some(c) = self.conns.get_mut(key) else {
                continue;
            };
            if c.id() != conn || c.closing_now() {
                continue; // the connection is gone: nobody is left to read it
            }
            c.queue_replies(frames);
            if c.mark_dirty() {
                self.dirty.push(key);
            }
        }
        self.out.clear();
    }

    /// Cuts every write buffer lent to the outbox this turn back to its
    /// length when lent: none of the turn's replies leaves.
    fn cut_back_direct(&mut self) {
        for &(conn, len) in self.out.direct_lent() {
            let key = usize::try_from(conn & CONN_KEY_MASK).unwrap_or(usize::MAX);
            if let Some(c) = self.conns.get_mut(key).filter(|c| c.id() == conn) {
                c.cut_back(len);
            }
        }
    }

    /// At most one `write` per connection with output.
    #[cfg_attr(ticketd_profile, inline(never))]
    fn write(&mut self, now: Millis) {
        let soft = self.config.out_soft_limit_bytes;
        let hard = self.config.out_hard_limit_bytes;
        let mut list = std::mem::take(&mut self.dirty);
        for &key in &list {
            let Some(c) = self.conns.get_mut(key) else {
                continue;
            };
            c.clear_dirty();
            if c.closing_now() {
                continue;
            }
            let flushed = c.flush(now);
            let (was, is) = c.recount_memory();
            self.conn_bytes = self.conn_bytes + is as u64 - was as u64;
            if let Err(e) = flushed {
                log::debug!("{}: write failed: {e}", c.peer());
                self.close_now(now, key);
                continue;
            }
            if c.unsent() > hard {
                let (peer, pending) = (c.peer(), c.unsent());
                self.stats.limit_closes += 1;
                if let Some(n) = self.logs.limits.allow(now) {
                    log::warn!(
                        "closing {peer}: {pending} bytes of unread replies, over --out-hard-limit \
                         ({n} similar closes not logged)"
                    );
                }
                self.close_now(now, key);
                continue;
            }
            if c.resume_input_below(soft) && c.mark_active() {
                self.active.push(key);
            }
            if let Some(want) = c.interest_change() {
                let registered = match c.source() {
                    Some(tcp) => self.poll.registry().reregister(tcp, conn_token(key), want),
                    // A pipe needs no registration: the harness reads its
                    // readiness from the pipe itself.
                    None => Ok(()),
                };
                match registered {
                    Ok(()) => c.set_interest(want),
                    Err(e) => {
                        log::debug!("{}: reregister failed: {e}", c.peer());
                        self.close_now(now, key);
                    }
                }
            }
        }
        list.clear();
        // Nothing is marked dirty while writing; keep the allocation.
        debug_assert!(self.dirty.is_empty(), "write phase marks nothing dirty");
        self.dirty = list;
    }

    /// Closes what is done closing: `Now` at once; `Drain` once flushed (and,
    /// lingering, once the peer closed too), or at its deadline.
    fn reap(&mut self, now: Millis) {
        let mut i = 0;
        while i < self.closing.len() {
            let key = self.closing[i];
            if self.closing_done(now, key) {
                self.closing.swap_remove(i);
                if let Some(mut c) = self.conns.try_remove(key) {
                    quota::uncount(&mut self.identities, &c);
                    self.conn_bytes -= c.counted_bytes() as u64;
                    self.identities.detach(c.ident(), now);
                    if let Some(tcp) = c.source() {
                        if let Err(e) = self.poll.registry().deregister(tcp) {
                            log::debug!("{}: deregister failed: {e}", c.peer());
                        }
                    }
                    log::debug!("{}: closed", c.peer());
                }
            } else {
                i += 1;
            }
        }
    }

    fn closing_done(&mut self, now: Millis, key: usize) -> bool {
        self.conns
            .get_mut(key)
            .is_none_or(|c| c.close_progress(now))
    }

    fn begin_shutdown(&mut self, now: Millis) {
        log::info!(
            "shutting down: {} connections to flush within {} ms",
            self.conns.len(),
            millis(self.config.flush_timeout)
        );
        if let Some(n) = self.notify.as_mut() {
            n.send("STOPPING=1");
        }
        if let Some(mut l) = self.listener.take() {
            let _ = self.poll.registry().deregister(&mut l);
        }
        for (mut l, _) in self.unix.drain(..) {
            let _ = self.poll.registry().deregister(&mut l.listener);
        }
        self.shutdown_deadline = Some(now.add_ms(millis(self.config.flush_timeout)));
        let keys: Vec<usize> = self.conns.iter().map(|(k, _)| k).collect();
        for key in keys {
            self.start_close(now, key, false);
        }
    }

    fn finish_shutdown(&mut self, now: Millis) {
        for mut c in self.conns.drain() {
            if let Some(tcp) = c.source() {
                let _ = self.poll.registry().deregister(tcp);
            }
        }
        self.conn_bytes = 0;
        self.service.stop(now);
        // The admin port goes with the loop: its listener and connections close.
        self.admin = None;
        self.closing.clear();
        self.active.clear();
        self.active_next.clear();
        self.dirty.clear();
        self.stopped = true;
        log::info!("stopped");
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

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Raises the soft limit on open files (`RLIMIT_NOFILE`) towards `wanted`,
/// as far as the hard limit allows, and returns the soft limit in force
/// afterwards. Never lowers it. A server with `max_conns` connections wants
/// `max_conns` plus a few descriptors for itself.
///
/// # Errors
/// The limit cannot be read.
// rlim_t is u64 on some targets and not on others.
#[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
pub fn raise_open_file_limit(wanted: u64) -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass and nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let soft = u64::from(lim.rlim_cur);
    let hard = u64::from(lim.rlim_max);
    if soft >= wanted {
        return Ok(soft);
    }
    let target = wanted.min(hard);
    let new = libc::rlimit {
        rlim_cur: target as libc::rlim_t,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit reads the struct we pass and nothing else.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } == 0 {
        Ok(target)
    } else {
        Ok(soft)
    }
}

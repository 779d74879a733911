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
//!
//! # Where the parts are
//!
//! * `bind`: [`Server::bind`], the listeners and the start-up lines.
//! * `turn`: the poll's timeout and events, and the phases of a turn in
//!   order, each in its own file: `accept`, `input` (one pass over a
//!   connection's input is an `input::Dispatch`), `output` (delivering and
//!   writing replies), `close` (closing and reaping), `timeouts` and
//!   `shutdown`.
//! * `conn` and `transport`: a connection's state machine and its stream;
//!   `quota`, `identity`, `throttle` and `guess_pause`: the limits per
//!   identity; `clock`, `stats` and `rlimit`: what they say.

mod accept;
pub mod admin;
mod bind;
mod clock;
mod close;
mod conn;
mod guess_pause;
pub mod identity;
mod input;
#[cfg(feature = "harness")]
mod mem;
mod output;
mod quota;
pub(crate) mod ratelimit;
mod rlimit;
mod shutdown;
mod start;
mod stats;
pub mod systemd;
pub(crate) mod throttle;
mod timeouts;
#[cfg(feature = "tls")]
mod tls;
mod transport;
mod turn;
mod unix;

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use mio::net::TcpListener;
use mio::{Events, Poll, Token, Waker};
use signal_hook_mio::v1_0::Signals;
use slab::Slab;

use crate::config::{Config, MAX_CONNS_CEILING};
use crate::engine::{ConnId, Outbox};
use crate::service::Service;
use crate::time::Millis;

use clock::Clock;
use conn::Conn;
use identity::{Identities, Identity};
use ratelimit::LogLimit;
use timeouts::SCAN_INTERVAL_MS;

pub use clock::ManualClock;
pub use rlimit::raise_open_file_limit;
pub use shutdown::ShutdownHandle;
pub use start::StartError;
pub use stats::Stats;

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

/// Whether the server goes on after a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Serving.
    Running,
    /// Shut down: every connection is closed; further turns do nothing.
    Stopped,
}

/// The rate limits of the server's own log lines, one per kind.
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

/// The mio token of connection `key` of the slab.
fn conn_token(key: usize) -> Token {
    Token(CONN_BASE + key)
}

/// The slab key of connection `conn` (its low bits; see `CONN_KEY_BITS`).
/// The slot may since hold another connection: compare ids.
#[inline]
fn conn_key(conn: ConnId) -> usize {
    usize::try_from(conn & CONN_KEY_MASK).unwrap_or(usize::MAX)
}

/// A duration in whole milliseconds (saturating).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl<S: Service> Server<S> {
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
}

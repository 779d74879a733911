//! The official blocking client (PROTOCOL §3).
//!
//! ```no_run
//! use std::time::Duration;
//! use ticketd::client::{Acquire, Client, Release};
//!
//! let client = Client::connect("127.0.0.1:7470")?;
//! match client.acquire("db-migration", Duration::from_secs(10), Duration::from_secs(30))? {
//!     Acquire::Acquired(ticket) => {
//!         // Critical section: pass ticket.token() to the resource as a fence,
//!         // and leave before ticket.expires_at().
//!         let _r: Release = ticket.release()?;
//!     }
//!     Acquire::Timeout | Acquire::Busy | Acquire::LimitMismatch(_) => { /* definitive: not acquired */ }
//!     Acquire::Indeterminate => { /* must not enter; the lease reclaims any grant */ }
//! }
//! # Ok::<(), ticketd::client::Error>(())
//! ```
//!
//! # How a call runs
//!
//! A [`Client`] is a handle on a small pool of connections ("sessions"); it
//! is `Clone + Send + Sync` and every clone shares the pool. Each session has
//! a writer thread and a reader thread; requests from all threads are
//! pipelined on it and replies are matched by owner (A/T/B) or by token and
//! key (R/N), in any order. Each acquire:
//!
//! 1. checks its arguments (an `Err` means nothing was sent);
//! 2. takes a fresh owner and one monotonic deadline `D = now + wait`
//!    (wait clamped to 255 s);
//! 3. queues the request on a session. The writer computes the wire wait
//!    from the time left to `D`, rounded up, just before writing it; a
//!    request still queued at `D` is never written and the call returns
//!    [`Acquire::Timeout`]. If the session dies while the request is still
//!    queued, it moves to another session with the same owner and the same
//!    `D`: that is the only retry there is;
//! 4. once a request may have reached a socket, it is never sent again. If
//!    no reply matches it by `D + 1 s`, the client closes that one session
//!    and returns [`Acquire::Indeterminate`]; if its session dies first, it
//!    returns Indeterminate at once;
//! 5. an `A` that reaches the caller after `D` is not handed over: the client
//!    releases that exact token in the background and returns Indeterminate.
//!    `T` and `B` are definitive.
//!
//! `wait = 0` is one direct attempt (wire wait 0) under a separate 5 s
//! transport deadline, and so is every release.
//!
//! **Indeterminate** means the caller must not enter the critical section; a
//! grant that may exist is taken back by its lease at the latest.
//!
//! Kept tickets ([`Ticket::keep_alive`]) are renewed by one thread per
//! client, which sends the renewals of every kept ticket due within a
//! sixth of its lease together, in one write (see [`KeptTicket`]).
//!
//! The rules themselves are a sans-IO state machine, [`machine`] (bytes in,
//! bytes out, the clock passed in): every session is a
//! [`machine::Machine`] on the monotonic clock, and its threads only move
//! the bytes and wake the callers. Programs with their own event loop, and
//! deterministic tests, drive a machine directly.

pub mod admin;
mod deadline;
mod error;
mod extend;
mod failure;
pub mod machine;
mod owner;
mod pool;
mod renew;
mod session;
mod ticket;
#[cfg(feature = "tls")]
mod tls;
mod transport;

#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use deadline::{MAX_LEASE, MAX_WAIT, RESPONSE_GRACE, TRANSPORT_DEADLINE};
pub use error::Error;
pub use extend::{Extend, ExtendToken, KeptTicket};
pub use failure::{Failure, FailureKind};
pub use ticket::Ticket;

pub use crate::proto::{Mode, Places};

use machine::{AcquireOutcome, Decided, Outcome, Unsent};
use pool::Pool;
use session::{lock, Session, Waited};
use transport::{Security, Target};

/// The server address the CLI and examples use when given none.
pub const DEFAULT_ADDRESS: &str = "127.0.0.1:7470";
/// Default number of connections a client keeps.
pub const DEFAULT_POOL_SIZE: usize = 2;
/// Default cap on one connection attempt.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Largest pool a builder accepts.
pub const MAX_POOL_SIZE: usize = 64;

/// Pauses between retries of a request whose session died before it was
/// written: the first retry is immediate, later ones back off, so a server
/// that accepts and drops connections (over its connection limit) does not
/// turn the retry loop into a connect storm. Never sleeps past the deadline.
struct RetryPause {
    next: Duration,
    until: Instant,
}

impl RetryPause {
    fn new(until: Instant) -> RetryPause {
        RetryPause {
            next: Duration::ZERO,
            until,
        }
    }

    fn pause(&mut self) {
        let left = self.until.saturating_duration_since(Instant::now());
        std::thread::sleep(self.next.min(left));
        self.next = (self.next * 2)
            .max(Duration::from_millis(10))
            .min(Duration::from_millis(500));
    }
}

/// The outcome of [`Client::acquire`].
#[derive(Debug)]
#[must_use = "an acquire can fail; only Acquired may enter the critical section"]
pub enum Acquire {
    /// Granted. The lock is held until the ticket is released or dropped, or
    /// its lease runs out.
    Acquired(Ticket),
    /// Definitely not acquired: the key stayed held for the whole wait, or the
    /// request was never sent before the deadline.
    Timeout,
    /// Definitely not acquired and not queued: a server limit. A queue or
    /// the key table is full, or the lease asked for is longer than the
    /// server's `--max-lease` (the protocol cannot carry a shorter lease
    /// back, so the server refuses it): asking again with the same lease
    /// gets Busy again.
    Busy,
    /// Definitely not acquired and not queued (protocol 1.2): the key is
    /// registered with another limit, this one (an acquire with places
    /// only; the caller decides, the client never retries with it).
    LimitMismatch(u16),
    /// Unknown. Do not enter the critical section; a grant that may exist is
    /// released by the client if it arrives late, and by its lease anyway.
    Indeterminate,
}

impl Acquire {
    /// The ticket, if acquired.
    #[must_use]
    pub fn ticket(self) -> Option<Ticket> {
        match self {
            Acquire::Acquired(t) => Some(t),
            _ => None,
        }
    }
}

/// The outcome of a release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// The release took effect.
    Released,
    /// Nothing changed: the key is not held under that token (the lease ran
    /// out, or the token was never granted or already released).
    NotHeld,
    /// The release may or may not have taken effect; the lease ends the lock
    /// at the latest.
    Indeterminate,
    /// No server could be reached within the transport deadline; nothing was
    /// sent, so the lock stays held until its lease runs out.
    NotSent,
}

/// Builds a [`Client`] with several addresses or non-default settings.
#[derive(Clone, Debug)]
pub struct ClientBuilder {
    addrs: Vec<String>,
    pool_size: usize,
    connect_timeout: Duration,
    max_key_bytes: usize,
    fail_fast: bool,
    #[cfg(feature = "tls")]
    tls: Option<TlsSettings>,
}

/// The client's TLS settings (feature `tls`).
#[cfg(feature = "tls")]
#[derive(Clone, Debug)]
struct TlsSettings {
    ca: std::path::PathBuf,
    cert_key: Option<(std::path::PathBuf, std::path::PathBuf)>,
    server_name: Option<String>,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        ClientBuilder {
            addrs: Vec::new(),
            pool_size: DEFAULT_POOL_SIZE,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_key_bytes: crate::limits::DEFAULT_MAX_KEY_BYTES,
            fail_fast: false,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }
}

impl ClientBuilder {
    /// Adds one server address: `host:port`, or `unix:/path` for a Unix-domain
    /// socket (`ticketd --listen unix:/path`).
    #[must_use]
    pub fn address(mut self, addr: impl Into<String>) -> Self {
        self.addrs.push(addr.into());
        self
    }

    /// Adds server addresses; connections rotate over them and skip the ones
    /// that do not answer.
    #[must_use]
    pub fn addresses<I, S>(mut self, addrs: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.addrs.extend(addrs.into_iter().map(Into::into));
        self
    }

    /// Connections to keep, 1..=64 (default 2). Requests are pipelined, so a
    /// few connections serve many threads.
    #[must_use]
    pub fn pool_size(mut self, n: usize) -> Self {
        self.pool_size = n;
        self
    }

    /// Cap on one connection attempt (default 1 s); an address that takes
    /// longer is skipped for the next one. Never longer than a call's deadline.
    #[must_use]
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// The longest key accepted (default 1024 bytes, the server's default).
    /// Set it to the server's `--max-key-bytes` if that differs.
    #[must_use]
    pub fn max_key_bytes(mut self, n: usize) -> Self {
        self.max_key_bytes = n;
        self
    }

    /// Give up at once when every address fails for good: the connection
    /// is refused (nothing listens there) or its TLS handshake is refused.
    /// An acquire or a release then returns without waiting out its
    /// deadline (Timeout, NotSent; nothing sent either way), and
    /// [`Client::last_failure`] says why. Extends and renewals still try
    /// again until theirs. Off by default, so that a server that restarts
    /// within a call's wait is still reached; meant for command-line tools,
    /// where an immediate answer helps more.
    #[must_use]
    pub fn fail_fast(mut self, on: bool) -> Self {
        self.fail_fast = on;
        self
    }

    /// Speak TLS (1.3 or 1.2) to every TCP address, trusting the servers
    /// whose certificate chains to the CA certificates in `ca_file` (PEM)
    /// and names the address's host (or [`Self::tls_server_name`]). Unix
    /// socket addresses stay plaintext. Feature `tls`.
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn tls_ca(mut self, ca_file: impl Into<std::path::PathBuf>) -> Self {
        self.tls_settings().ca = ca_file.into();
        self
    }

    /// With TLS, present this client certificate (PEM chain) and key (PEM)
    /// to servers that ask for one (`ticketd --tls-client-ca`).
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn tls_client_cert(
        mut self,
        cert_file: impl Into<std::path::PathBuf>,
        key_file: impl Into<std::path::PathBuf>,
    ) -> Self {
        self.tls_settings().cert_key = Some((cert_file.into(), key_file.into()));
        self
    }

    /// With TLS, check every server's certificate against this name
    /// instead of each address's host.
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn tls_server_name(mut self, name: impl Into<String>) -> Self {
        self.tls_settings().server_name = Some(name.into());
        self
    }

    #[cfg(feature = "tls")]
    fn tls_settings(&mut self) -> &mut TlsSettings {
        self.tls.get_or_insert_with(|| TlsSettings {
            ca: std::path::PathBuf::new(),
            cert_key: None,
            server_name: None,
        })
    }

    /// The TLS dial settings, with the files read now.
    #[cfg(feature = "tls")]
    fn tls_dial(&self) -> Result<Option<tls::TlsDial>, Error> {
        let Some(t) = &self.tls else {
            return Ok(None);
        };
        if t.ca.as_os_str().is_empty() {
            return Err(Error::Tls {
                reason: "a client certificate or a server name without a CA file (tls_ca)".into(),
            });
        }
        let config = crate::tls::client_config(
            &t.ca,
            t.cert_key.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
        )
        .map_err(|e| Error::Tls {
            reason: e.to_string(),
        })?;
        let server_name = match &t.server_name {
            Some(n) => Some(
                rustls::pki_types::ServerName::try_from(n.clone()).map_err(|e| Error::Tls {
                    reason: format!("server name {n:?}: {e}"),
                })?,
            ),
            None => None,
        };
        Ok(Some(tls::TlsDial {
            config,
            server_name,
        }))
    }

    /// The settings against their ranges.
    fn check_settings(&self) -> Result<(), Error> {
        if self.addrs.is_empty() {
            return Err(Error::NoAddress);
        }
        if self.pool_size == 0 || self.pool_size > MAX_POOL_SIZE {
            return Err(Error::InvalidConfig {
                reason: "pool_size must be within 1..=64",
            });
        }
        if self.connect_timeout.is_zero() {
            return Err(Error::InvalidConfig {
                reason: "connect_timeout must be above zero",
            });
        }
        if self.max_key_bytes == 0 || self.max_key_bytes > crate::limits::MAX_KEY_BYTES_CEILING {
            return Err(Error::InvalidConfig {
                reason: "max_key_bytes must be within 1..=65536",
            });
        }
        Ok(())
    }

    /// Resolves the addresses and makes the client. Connections open lazily,
    /// on the first call that needs one.
    pub fn build(self) -> Result<Client, Error> {
        self.check_settings()?;
        #[cfg(feature = "tls")]
        let dial = self.tls_dial()?;
        let mut resolved: Vec<Target> = Vec::new();
        let mut security: Vec<Security> = Vec::new();
        for a in &self.addrs {
            if let Some(path) = a.strip_prefix("unix:") {
                if path.is_empty() {
                    return Err(Error::Resolve {
                        addr: a.clone(),
                        reason: "unix: needs a path".into(),
                    });
                }
                resolved.push(Target::Unix(path.into()));
                security.push(Security::Plain);
                continue;
            }
            let found = a.to_socket_addrs().map_err(|e| Error::Resolve {
                addr: a.clone(),
                reason: e.to_string(),
            })?;
            let before = resolved.len();
            resolved.extend(found.map(Target::Tcp));
            if resolved.len() == before {
                return Err(Error::Resolve {
                    addr: a.clone(),
                    reason: "no address found".into(),
                });
            }
            #[cfg(feature = "tls")]
            let how = match &dial {
                Some(d) => {
                    let name = match &d.server_name {
                        Some(n) => n.clone(),
                        None => tls::name_of(a).map_err(|e| Error::Resolve {
                            addr: a.clone(),
                            reason: e.to_string(),
                        })?,
                    };
                    Security::Tls(d.clone(), name)
                }
                None => Security::Plain,
            };
            #[cfg(not(feature = "tls"))]
            let how = Security::Plain;
            security.resize(resolved.len(), how);
        }
        Ok(Client {
            inner: Arc::new(Inner {
                pool: Pool::new(
                    resolved,
                    security,
                    self.pool_size,
                    self.connect_timeout,
                    self.max_key_bytes,
                    self.fail_fast,
                ),
                max_key_bytes: self.max_key_bytes,
                background: Mutex::new(Background {
                    queue: VecDeque::new(),
                    running: false,
                }),
                renewer: renew::Renewer::default(),
            }),
        })
    }
}

/// A handle on a pool of connections to a ticketd server (or to the nodes of
/// a cluster). Cheap to clone; every clone shares the pool; usable from any
/// number of threads at once.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    max_key_bytes: usize,
    background: Mutex<Background>,
    /// The one thread that renews every kept ticket of this client.
    renewer: renew::Renewer,
}

/// Releases nobody waits for (dropped tickets, late grants), done one after
/// another by a thread that exists only while there are some.
struct Background {
    /// The releases, each with the deadline it was given when asked for.
    queue: VecDeque<Unsent<Instant>>,
    running: bool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.pool.close();
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("addresses", &self.inner.pool.addresses())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client for one server address (`host:port`) with default settings.
    pub fn connect(addr: impl Into<String>) -> Result<Client, Error> {
        Client::builder().address(addr).build()
    }

    /// A builder for several addresses or other settings.
    #[must_use]
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// The resolved TCP server addresses (Unix sockets are not listed).
    #[must_use]
    pub fn addresses(&self) -> &[SocketAddr] {
        self.inner.pool.addresses()
    }

    /// The last connection failure, if any: helps explain a Timeout that
    /// came from an unreachable server rather than from a held key.
    #[must_use]
    pub fn last_connect_error(&self) -> Option<String> {
        self.inner.pool.last_error()
    }

    /// Why the last connection that failed did: one that could not be made,
    /// or one that ended under a call that then returned Indeterminate.
    /// Names the cause where the client can tell it from what came back
    /// ([`FailureKind`]): a TLS port spoken to in plaintext, a client
    /// certificate the server requires, an address that is no ticketd
    /// client port. The outcome stays what it was.
    #[must_use]
    pub fn last_failure(&self) -> Option<Failure> {
        self.inner.pool.last_failure()
    }

    /// Asks for `key`, waiting up to `wait` (clamped to 255 s) in the
    /// server's queue, for a grant that lives `lease` (whole seconds,
    /// 1..=255). Returns within `wait` + 1 s (or 5 s for `wait = 0`); `Err`
    /// only for bad arguments, before anything is sent.
    pub fn acquire(&self, key: &str, wait: Duration, lease: Duration) -> Result<Acquire, Error> {
        self.acquire_with(key, None, wait, lease)
    }

    /// One permit of `key` as a counting semaphore of `limit` places
    /// (protocol 1.2, PROTOCOL §6): at most `limit` holders at once, each
    /// with a ticket of its own. [`Acquire::LimitMismatch`] when the key
    /// is registered with another limit. As [`Client::acquire`] otherwise.
    pub fn acquire_permit(
        &self,
        key: &str,
        limit: u16,
        wait: Duration,
        lease: Duration,
    ) -> Result<Acquire, Error> {
        self.acquire_with(key, Some(Places::semaphore(limit)), wait, lease)
    }

    /// A reader's place in the read/write lock `key` (protocol 1.2): held
    /// beside other readers, never beside a writer, and not before a
    /// writer that queued first. As [`Client::acquire`] otherwise.
    pub fn acquire_shared(
        &self,
        key: &str,
        wait: Duration,
        lease: Duration,
    ) -> Result<Acquire, Error> {
        self.acquire_with(key, Some(Places::shared()), wait, lease)
    }

    /// A writer's hold of the read/write lock `key` (protocol 1.2): alone,
    /// after every reader and writer that queued first. As
    /// [`Client::acquire`] otherwise.
    pub fn acquire_exclusive(
        &self,
        key: &str,
        wait: Duration,
        lease: Duration,
    ) -> Result<Acquire, Error> {
        self.acquire_with(key, Some(Places::exclusive()), wait, lease)
    }

    /// The general acquire: with `places`, one of `places.limit` places in
    /// `places.mode`, sent as an Acquire With Limit (protocol 1.2); with
    /// `None`, a mutex ([`Client::acquire`]). A server older than 1.2
    /// closes the connection on an Acquire With Limit, so the outcome
    /// there is Indeterminate.
    ///
    /// # Errors
    /// A bad key or lease, or a limit of 0, before anything is sent.
    pub fn acquire_with(
        &self,
        key: &str,
        places: Option<Places>,
        wait: Duration,
        lease: Duration,
    ) -> Result<Acquire, Error> {
        let max = self.inner.max_key_bytes;
        let now = Instant::now();
        let call = Unsent::acquire(now, key, (wait, lease), places, max, owner::next_owner)?;
        let Some((session, decided)) = self.run(call, false) else {
            return Ok(Acquire::Timeout);
        };
        // The handover gate: a grant that reaches this thread after D is
        // not handed to a caller who was promised an answer by D.
        Ok(match decided.hand_over(Instant::now()) {
            Ok(Outcome::Acquire(AcquireOutcome::Acquired(held))) => Acquire::Acquired(Ticket::new(
                self.clone(),
                held.key,
                held.token,
                held.lease,
                held.expires_at,
            )),
            Ok(Outcome::Acquire(AcquireOutcome::Timeout)) => Acquire::Timeout,
            Ok(Outcome::Acquire(AcquireOutcome::Busy)) => Acquire::Busy,
            Ok(Outcome::Acquire(AcquireOutcome::LimitMismatch(n))) => Acquire::LimitMismatch(n),
            Err(late) => {
                if !session.give_back(&late) {
                    self.release_in_background(late.key, late.token);
                }
                Acquire::Indeterminate
            }
            Ok(_) => {
                self.inner.pool.note_failure(&session);
                Acquire::Indeterminate
            }
        })
    }

    /// Runs `call` on a session of the pool until its machine decides it:
    /// a call that was never sent when its session died is tried again on
    /// another, with the same owner and deadlines (after a pause, never
    /// past its send deadline). `None` if no session could be had by then
    /// (at once with `fail_fast` and every address refusing). A
    /// `persistent` call (an extend) keeps trying until its deadline even
    /// then, and keeps the failure of every session it lost.
    pub(crate) fn run(
        &self,
        mut call: Unsent<Instant>,
        persistent: bool,
    ) -> Option<(Arc<Session>, Decided<Instant>)> {
        let send_deadline = call.send_deadline();
        let mut backoff = RetryPause::new(send_deadline);
        loop {
            let Some(session) = self.inner.pool.get(send_deadline) else {
                if !persistent || Instant::now() >= send_deadline {
                    return None;
                }
                backoff.pause();
                continue;
            };
            match session.run(call) {
                Waited::Decided(d) => return Some((session, d)),
                Waited::Moved(c) => {
                    if persistent {
                        self.inner.pool.note_failure(&session);
                    }
                    call = c;
                    backoff.pause();
                }
            }
        }
    }

    /// Releases `token` on `key`, from any process: locks belong to tokens,
    /// not to connections. Waits at most the 5 s transport deadline.
    pub fn release(&self, key: &str, token: u64) -> Result<Release, Error> {
        let call = Unsent::release(Instant::now(), key, token, self.inner.max_key_bytes)?;
        Ok(self.release_checked(call))
    }

    fn release_checked(&self, call: Unsent<Instant>) -> Release {
        let Some((session, decided)) = self.run(call, false) else {
            return Release::NotSent;
        };
        match decided.outcome {
            Outcome::Release(r @ (Release::Released | Release::NotHeld | Release::NotSent)) => r,
            Outcome::Release(Release::Indeterminate) | Outcome::Acquire(_) | Outcome::Extend(_) => {
                self.inner.pool.note_failure(&session);
                Release::Indeterminate
            }
        }
    }

    /// Queues a release nobody waits for; a short-lived thread works the
    /// queue and ends when it is empty.
    pub(crate) fn release_in_background(&self, key: String, token: u64) {
        // The transport deadline runs from now, not from when the worker
        // gets to it: with the server unreachable, a backlog of dropped
        // tickets is given up within 5 s instead of 5 s each (their leases
        // end them). The key was checked when the lock was acquired.
        let Ok(call) = Unsent::release(Instant::now(), &key, token, usize::MAX) else {
            return;
        };
        let mut bg = lock(&self.inner.background);
        bg.queue.push_back(call);
        if bg.running {
            return;
        }
        bg.running = true;
        drop(bg);
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ticket-release".into())
            .spawn(move || me.background_loop());
        if spawned.is_err() {
            // No thread to spare: the lease reclaims these locks instead.
            let mut bg = lock(&self.inner.background);
            bg.running = false;
            bg.queue.clear();
        }
    }

    fn background_loop(self) {
        loop {
            let next = {
                let mut bg = lock(&self.inner.background);
                let next = bg.queue.pop_front();
                if next.is_none() {
                    bg.running = false;
                }
                next
            };
            let Some(call) = next else {
                return;
            };
            let _ = self.release_checked(call);
        }
    }

    /// Whether background releases are still being worked on.
    #[doc(hidden)]
    #[must_use]
    pub fn background_busy(&self) -> bool {
        lock(&self.inner.background).running
    }

    /// Sessions currently connected, for diagnostics.
    #[must_use]
    pub fn connected_sessions(&self) -> usize {
        self.inner.pool.live().len()
    }
}

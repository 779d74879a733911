//! The admin port (`--admin-listen`): a small HTTP/1.1 server for health,
//! metrics and lock introspection, served by the same loop and thread as
//! the lock protocol.
//!
//! It never blocks the loop and never takes it over:
//!
//! * **Bounded:** at most [`ADMIN_MAX_CONNS`] connections (one more is
//!   accepted and closed at once, and counted), a request head of at most
//!   [`MAX_REQUEST_BYTES`] (431 beyond), and [`ADMIN_TIMEOUT_MS`] for the
//!   whole exchange, after which the connection is dropped.
//! * **One request per connection:** every response says
//!   `Connection: close`; the socket is closed once the response is sent,
//!   so there is no keep-alive state to bound.
//! * **Incremental:** a response is written with at most one `write` per
//!   loop turn, when the socket is writable, like a lock reply; a reader
//!   that does not read only fills its own buffer until the timeout.
//! * **Never a whole-table scan in one turn:** `GET /v1/locks` visits
//!   [`SCAN_STEP_BUCKETS`] buckets of the key table per loop turn and keeps
//!   at most `limit + 1` candidate keys (`limit` ≤ [`MAX_PAGE`]); the reply
//!   goes out when the pass is done. The listing is of the keys present
//!   while the pass ran: a key added or removed during it may or may not
//!   appear. A pass restarts when the table grows (which reorders it).
//!
//! It listens on TCP or on a Unix socket (`unix:/path`); a Unix socket is
//! made like the client ones (`--socket-mode`, a stale file replaced) and
//! its peers are checked against `--allow-uid` / `--allow-gid` at accept:
//! the admin port names every key and holder count, so a host that limits
//! who may take locks limits who may list them the same way.
//!
//! Requests are parsed with `httparse`. Only `GET` is served (405 for
//! other methods), except the membership changes of cluster mode
//! (`POST`/`DELETE /v1/cluster/members/...`, `docs/OPERATIONS.md`), which
//! the loop hands to the service after the turn; unknown paths are 404; a
//! bad query or key is 400 with the reason in the body.

mod decode;
mod http;
mod json;
mod listing;
mod metrics;
mod routes;

use std::io;
use std::net::SocketAddr;

use mio::event::Event;
use mio::net::TcpListener;
use mio::{Interest, Registry, Token};
use slab::Slab;

use crate::config::{AdminListen, Config};
use crate::engine::{LockInfo, LockTable};
use crate::service::{MemberChange, NotReady, Observe, Refusal};
use crate::time::Millis;

use super::transport::{PeerAddr, Stream};
use super::unix::{self, UnixListen};
use super::Stats;

pub use json::json_str;

use http::{read_request, respond, write_some};
use json::lock_json;
use listing::{step_listing, Listing};
use routes::change_answer;

/// The most admin connections open at once.
pub const ADMIN_MAX_CONNS: usize = 64;
/// The longest request head (request line and headers) in bytes.
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// How long one admin exchange may take, from accept to the last byte
/// of the response.
pub const ADMIN_TIMEOUT_MS: u64 = 10_000;
/// The most keys `GET /v1/locks` returns at once.
pub const MAX_PAGE: usize = 1_000;
/// Keys per page when `limit` is not given.
pub const DEFAULT_PAGE: usize = 100;
/// Buckets of the key table a listing visits per loop turn.
pub const SCAN_STEP_BUCKETS: usize = 16 * 1024;
/// Connections accepted per turn.
const ACCEPTS_PER_TURN: usize = 16;
/// How often connections are checked for the timeout.
const CHECK_INTERVAL_MS: u64 = 250;

/// Token of the admin listener: below the server's Unix listeners'
/// (`UNIX_BASE` in the server loop checks it at compile time).
pub(crate) const LISTENER: Token = Token(3);
/// Admin connection `k` has token `conn_base + k`; tokens from `conn_base`
/// up to `conn_base + ADMIN_MAX_CONNS` are the admin port's.
pub(crate) const CONNS_CEILING: usize = ADMIN_MAX_CONNS;

/// What a request is waiting for.
#[derive(Debug)]
enum State {
    /// The request head is not complete yet.
    Reading,
    /// `GET /v1/locks`: a pass over the key table in steps.
    Listing(Box<Listing>),
    /// A membership change, waiting for the loop to hand it to the service.
    Change(MemberChange),
    /// The response is in `wbuf`.
    Writing,
}

#[derive(Debug)]
struct AdminConn {
    stream: Stream,
    peer: PeerAddr,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    cursor: usize,
    state: State,
    deadline: Millis,
    readable: bool,
    writable: bool,
    /// Queued in `Admin::active`.
    queued: bool,
    interest: Interest,
    done: bool,
}

/// The socket the admin port accepts on.
#[derive(Debug)]
enum Listener {
    Tcp(TcpListener, SocketAddr),
    Unix {
        listen: UnixListen,
        allow_uids: Vec<u32>,
        allow_gids: Vec<u32>,
    },
}

/// The admin listener and its connections. See the module documentation.
#[derive(Debug)]
pub(crate) struct Admin {
    listener: Listener,
    conn_base: usize,
    conns: Slab<AdminConn>,
    accept_ready: bool,
    /// Connections with something to do this turn.
    active: Vec<usize>,
    /// Connections with a listing under way.
    listings: usize,
    next_check: Millis,
    /// Admin connections refused at [`ADMIN_MAX_CONNS`].
    pub refused: u64,
    /// Unix-socket admin connections refused by `--allow-uid` / `--allow-gid`.
    pub refused_peer: u64,
    /// HTTPS on a TCP admin port (`--admin-tls-cert`).
    #[cfg(feature = "tls")]
    tls: Option<std::sync::Arc<rustls::ServerConfig>>,
}

/// What the admin port reads to answer: the loop's own state.
pub(crate) struct View<'a> {
    /// What the service shows ([`crate::service::Service::observe`]).
    pub observed: Option<&'a dyn Observe>,
    pub stats: &'a Stats,
    pub connections: usize,
    pub max_key_bytes: usize,
    /// A shutdown has begun: not ready, whatever the service says.
    pub stopping: bool,
    /// The client connections' identities, to name grant holders.
    pub identities: &'a super::identity::Identities,
    /// `--admin-identity`: the only reader shown full tokens.
    pub admin_identity: Option<&'a super::identity::Identity>,
    /// The connections' part of the memory budget, in bytes.
    pub connection_bytes: u64,
    /// `--max-memory`.
    pub max_memory: u64,
}

impl View<'_> {
    /// Whether the reader on `c` is `--admin-identity`, and so sees full
    /// tokens (a token releases its grant); everyone else sees sequences.
    fn shows_tokens(&self, c: &AdminConn) -> bool {
        let Some(admin) = self.admin_identity else {
            return false;
        };
        let reader = match c.peer {
            PeerAddr::Unix { uid, .. } => Some(super::identity::Identity::Uid(uid)),
            PeerAddr::Tcp(_) => c.stream.certificate_identity().1,
        };
        reader.as_ref() == Some(admin)
    }

    /// A lock as JSON for the reader on `c` ([`lock_json`]).
    fn lock_json(&self, out: &mut String, key: &str, info: &LockInfo, full: bool) {
        let name_of = |holder: u64| {
            (holder != 0)
                .then(|| self.identities.name_of(holder))
                .flatten()
        };
        lock_json(out, key, info, full, &name_of);
    }

    /// The service's lock table, when it shows one.
    fn lock_table(&self) -> Option<&dyn LockTable> {
        self.observed.and_then(|o| o.lock_table())
    }

    /// Whether the service can grant now (`GET /readyz`); one that shows
    /// nothing is ready.
    fn readiness(&self, now: Millis) -> Result<(), NotReady> {
        self.observed.map_or(Ok(()), |o| o.readiness(now))
    }
}

impl Admin {
    /// The membership changes read this turn, taken for the loop to hand
    /// to the service; each gets its answer through [`Admin::answer`].
    pub(crate) fn take_changes(&mut self) -> Vec<(usize, MemberChange)> {
        let mut out = Vec::new();
        for (key, c) in &mut self.conns {
            if let State::Change(change) = c.state {
                if !c.done {
                    out.push((key, change));
                    c.state = State::Reading;
                    c.readable = false;
                }
            }
        }
        out
    }

    /// Answers a membership change taken with [`Admin::take_changes`]
    /// with its `outcome`: what was proposed, why it was refused, or
    /// `None` when the service takes no membership changes.
    pub(crate) fn answer(&mut self, key: usize, outcome: Option<Result<String, Refusal>>) {
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        let (status, body) = change_answer(outcome);
        let ct = if status == 200 {
            "application/json"
        } else {
            "text/plain"
        };
        respond(c, status, ct, &body);
        if !c.queued {
            c.queued = true;
            self.active.push(key);
        }
    }

    /// Binds `at` (a Unix socket with `config`'s mode and allow lists) and
    /// registers the listener.
    pub(crate) fn bind(
        at: &AdminListen,
        config: &Config,
        registry: &Registry,
        conn_base: usize,
    ) -> io::Result<Self> {
        let listener = match at {
            AdminListen::Tcp(addr) => {
                let mut l = bind_tcp(*addr)?;
                let local = l.local_addr()?;
                registry.register(&mut l, LISTENER, Interest::READABLE)?;
                Listener::Tcp(l, local)
            }
            AdminListen::Unix(path) => {
                let mut listen = unix::bind(path, config.socket_mode)?;
                registry.register(&mut listen.listener, LISTENER, Interest::READABLE)?;
                Listener::Unix {
                    listen,
                    allow_uids: config.allow_uids.clone(),
                    allow_gids: config.allow_gids.clone(),
                }
            }
        };
        Ok(Admin {
            listener,
            conn_base,
            conns: Slab::new(),
            accept_ready: true,
            active: Vec::new(),
            listings: 0,
            next_check: Millis::ZERO,
            refused: 0,
            refused_peer: 0,
            #[cfg(feature = "tls")]
            tls: None,
        })
    }

    /// Serves HTTPS with `config` on a TCP admin port: every connection
    /// accepted from now on is a TLS server session.
    #[cfg(feature = "tls")]
    pub(crate) fn set_tls(&mut self, config: std::sync::Arc<rustls::ServerConfig>) {
        self.tls = Some(config);
    }

    /// The TCP address bound; `None` on a Unix socket.
    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        match &self.listener {
            Listener::Tcp(_, a) => Some(*a),
            Listener::Unix { .. } => None,
        }
    }

    /// Where the port listens, for the logs: `ADDR` or `unix:/path`.
    pub(crate) fn describe(&self) -> String {
        match &self.listener {
            Listener::Tcp(_, a) => a.to_string(),
            Listener::Unix { listen, .. } => format!("unix:{}", listen.path.display()),
        }
    }

    /// One pending connection, with its peer; `Ok(None)` when one was
    /// taken from the backlog and dropped (no credentials, not allowed).
    fn accept_one(&mut self, now: Millis) -> io::Result<Option<(Stream, PeerAddr)>> {
        match &mut self.listener {
            Listener::Tcp(l, _) => {
                let (s, peer) = l.accept()?;
                #[cfg(feature = "tls")]
                if let Some(config) = &self.tls {
                    // The handshake runs inside the exchange's own timeout.
                    return Ok(match super::tls::TlsStream::new(s, config, now) {
                        Ok(t) => Some((Stream::Tls(Box::new(t)), PeerAddr::Tcp(peer))),
                        Err(e) => {
                            log::debug!("admin {peer}: no TLS session: {e}");
                            None
                        }
                    });
                }
                let _ = now;
                Ok(Some((Stream::Tcp(s), PeerAddr::Tcp(peer))))
            }
            Listener::Unix {
                listen,
                allow_uids,
                allow_gids,
            } => {
                let (s, _) = listen.listener.accept()?;
                let Ok((uid, gid, pid)) = unix::peer_cred(&s) else {
                    return Ok(None);
                };
                if !unix::allowed(uid, gid, allow_uids, allow_gids) {
                    log::debug!(
                        "admin: refused uid={uid} gid={gid} pid={pid}: not in --allow-uid / \
                         --allow-gid"
                    );
                    self.refused_peer += 1;
                    return Ok(None);
                }
                Ok(Some((Stream::Unix(s), PeerAddr::Unix { uid, gid, pid })))
            }
        }
    }

    /// True when `token` is one of the admin port's.
    pub(crate) fn owns(&self, token: Token) -> bool {
        token == LISTENER || (self.conn_base..self.conn_base + CONNS_CEILING).contains(&token.0)
    }

    /// Notes readiness for one of the admin port's tokens.
    pub(crate) fn note_event(&mut self, event: &Event) {
        if event.token() == LISTENER {
            self.accept_ready = true;
            return;
        }
        let key = event.token().0 - self.conn_base;
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        if event.is_readable() || event.is_read_closed() || event.is_error() {
            c.readable = true;
        }
        if event.is_writable() || event.is_write_closed() || event.is_error() {
            c.writable = true;
        }
        if !c.queued {
            c.queued = true;
            self.active.push(key);
        }
    }

    /// The next moment the admin port has work without a new event.
    pub(crate) fn next_deadline(&self, now: Millis) -> Option<Millis> {
        if self.listings > 0 || !self.active.is_empty() {
            return Some(now);
        }
        (!self.conns.is_empty()).then_some(self.next_check)
    }

    /// One turn: accept, read and answer, step listings, write, time out.
    pub(crate) fn turn(&mut self, now: Millis, registry: &Registry, view: &View<'_>) {
        self.accept(now, registry);
        if self.listings > 0 {
            for (key, c) in &mut self.conns {
                if matches!(c.state, State::Listing(_)) && !c.queued {
                    c.queued = true;
                    self.active.push(key);
                }
            }
        }
        let active = std::mem::take(&mut self.active);
        for &key in &active {
            self.step(now, registry, key, view);
        }
        let mut active = active;
        active.clear();
        if self.active.is_empty() {
            self.active = active;
        }
        if now >= self.next_check {
            self.next_check = now.add_ms(CHECK_INTERVAL_MS);
            for (_, c) in &mut self.conns {
                if now >= c.deadline {
                    log::debug!("admin {}: timed out", c.peer);
                    c.done = true;
                }
            }
        }
        self.reap(registry);
    }

    fn accept(&mut self, now: Millis, registry: &Registry) {
        if !self.accept_ready {
            return;
        }
        for _ in 0..ACCEPTS_PER_TURN {
            match self.accept_one(now) {
                Ok(None) => {}
                Ok(Some((mut stream, peer))) => {
                    if self.conns.len() >= ADMIN_MAX_CONNS {
                        self.refused += 1;
                        continue;
                    }
                    let key = self.conns.vacant_key();
                    let token = Token(self.conn_base + key);
                    let Some(source) = stream.source() else {
                        continue;
                    };
                    if let Err(e) = registry.register(source, token, Interest::READABLE) {
                        log::warn!("admin {peer}: cannot register the connection: {e}");
                        continue;
                    }
                    self.conns.insert(AdminConn {
                        stream,
                        peer,
                        rbuf: Vec::new(),
                        wbuf: Vec::new(),
                        cursor: 0,
                        state: State::Reading,
                        deadline: now.add_ms(ADMIN_TIMEOUT_MS),
                        readable: true,
                        writable: false,
                        queued: true,
                        interest: Interest::READABLE,
                        done: false,
                    });
                    self.active.push(key);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.accept_ready = false;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors and the like: the client listener
                    // has the pause logic; here, try again on the next edge
                    // or check, never in a loop.
                    log::debug!("admin accept failed: {e}");
                    self.accept_ready = false;
                    return;
                }
            }
        }
    }

    fn step(&mut self, now: Millis, registry: &Registry, key: usize, view: &View<'_>) {
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        c.queued = false;
        if c.done {
            return;
        }
        if matches!(c.state, State::Reading) && c.readable {
            read_request(c, now, view);
            match c.state {
                State::Listing(_) => self.listings += 1,
                // More input may be waiting: read on next turn.
                State::Reading if c.readable && !c.done => {
                    c.queued = true;
                    self.active.push(key);
                    return;
                }
                _ => {}
            }
        }
        if let State::Listing(listing) = &mut c.state {
            if let Some(body) = step_listing(listing, now, view) {
                respond(c, 200, "application/json", &body);
                self.listings -= 1;
            }
        }
        if matches!(c.state, State::Writing) {
            write_some(c);
            let want = if c.done {
                c.interest
            } else {
                Interest::READABLE | Interest::WRITABLE
            };
            if want != c.interest {
                let token = Token(self.conn_base + key);
                let ok = c
                    .stream
                    .source()
                    .is_some_and(|s| registry.reregister(s, token, want).is_ok());
                if !ok {
                    c.done = true;
                }
                c.interest = want;
            }
        }
        if c.done && !c.queued {
            // Reaped at the end of the turn.
            c.queued = true;
            self.active.push(key);
        }
    }

    fn reap(&mut self, registry: &Registry) {
        let done: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| c.done)
            .map(|(k, _)| k)
            .collect();
        for key in done {
            let mut c = self.conns.remove(key);
            if matches!(c.state, State::Listing(_)) {
                self.listings -= 1;
            }
            if let Some(s) = c.stream.source() {
                let _ = registry.deregister(s);
            }
        }
        self.active.retain(|&k| self.conns.contains(k));
    }
}

/// A non-blocking TCP listener on `addr`.
fn bind_tcp(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(128)?;
    Ok(TcpListener::from_std(socket.into()))
}

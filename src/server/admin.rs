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

use std::collections::BTreeSet;
use std::fmt::{self, Write as _};
use std::io::{self, Read, Write};
use std::net::SocketAddr;

use mio::event::Event;
use mio::net::TcpListener;
use mio::{Interest, Registry, Token};
use slab::Slab;

use crate::config::{AdminListen, Config};
use crate::engine::{LockInfo, LockTable};
use crate::metrics::{self, Exposition};
use crate::service::{MemberChange, Service};
use crate::time::Millis;

use super::transport::{PeerAddr, Stream};
use super::unix::{self, UnixListen};
use super::Stats;

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
/// Times a listing restarts because the table grew before it answers with
/// what the last pass found.
const SCAN_RESTARTS: u8 = 3;
/// Connections accepted per turn.
const ACCEPTS_PER_TURN: usize = 16;
/// Reads of one connection per turn.
const READS_PER_TURN: usize = 4;
/// How often connections are checked for the timeout.
const CHECK_INTERVAL_MS: u64 = 250;
/// The most headers a request may have.
const MAX_HEADERS: usize = 32;

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
struct Listing {
    /// Full tokens for this reader (see [`View::shows_tokens`]).
    full_tokens: bool,
    prefix: String,
    after: Option<String>,
    limit: usize,
    cursor: usize,
    buckets: usize,
    restarts: u8,
    /// The smallest `limit + 1` matching keys seen so far.
    found: BTreeSet<Box<str>>,
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
pub(crate) struct View<'a, S: Service> {
    pub service: &'a S,
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

impl<S: Service> View<'_, S> {
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
        let name = (info.holder != 0)
            .then(|| self.identities.name_of(info.holder))
            .flatten();
        lock_json(out, key, info, full, name.as_deref());
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

    /// Answers a membership change taken with [`Admin::take_changes`].
    pub(crate) fn answer(&mut self, key: usize, status: u16, body: &str) {
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        let ct = if status == 200 {
            "application/json"
        } else {
            "text/plain"
        };
        respond(c, status, ct, body);
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
    pub(crate) fn turn<S: Service>(
        &mut self,
        now: Millis,
        registry: &Registry,
        view: &View<'_, S>,
    ) {
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

    fn step<S: Service>(
        &mut self,
        now: Millis,
        registry: &Registry,
        key: usize,
        view: &View<'_, S>,
    ) {
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

/// Reads what has arrived and, once the head is complete, routes it.
fn read_request<S: Service>(c: &mut AdminConn, now: Millis, view: &View<'_, S>) {
    let mut chunk = [0u8; 2048];
    let mut eof = false;
    for _ in 0..READS_PER_TURN {
        let room = MAX_REQUEST_BYTES + 1 - c.rbuf.len();
        let want = room.min(chunk.len());
        match c.stream.read(&mut chunk[..want]) {
            Ok(0) => {
                // The peer shut its side: what it sent is all there is.
                eof = true;
                c.readable = false;
                break;
            }
            Ok(n) => {
                c.rbuf.extend_from_slice(&chunk[..n]);
                if c.rbuf.len() > MAX_REQUEST_BYTES {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                c.readable = false;
                break;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                c.done = true;
                return;
            }
        }
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(&c.rbuf) {
        Ok(httparse::Status::Complete(_)) => {
            let method = req.method.unwrap_or("");
            let path = req.path.unwrap_or("");
            let path = path.to_owned();
            let method = method.to_owned();
            route(c, now, &method, &path, view);
        }
        Ok(httparse::Status::Partial) if c.rbuf.len() > MAX_REQUEST_BYTES => {
            respond(
                c,
                431,
                "text/plain",
                &format!("request head over {MAX_REQUEST_BYTES} bytes\n"),
            );
        }
        // Closed before the head was complete: nobody to answer.
        Ok(httparse::Status::Partial) if eof => c.done = true,
        Ok(httparse::Status::Partial) => {}
        Err(httparse::Error::TooManyHeaders) => {
            respond(
                c,
                431,
                "text/plain",
                &format!("more than {MAX_HEADERS} headers\n"),
            );
        }
        Err(e) => respond(c, 400, "text/plain", &format!("bad request: {e}\n")),
    }
}

/// Answers one request line: the member-change paths, then the GET paths.
/// Long because it is one match over the admin API's paths, read as its
/// table of contents; each arm is a few lines.
fn route<S: Service>(
    c: &mut AdminConn,
    now: Millis,
    method: &str,
    target: &str,
    view: &View<'_, S>,
) {
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    if let Some(rest) = path.strip_prefix("/v1/cluster/members/") {
        return match parse_member_change(method, rest, query.unwrap_or("")) {
            Ok(change) => c.state = State::Change(change),
            Err((status, why)) => respond(c, status, "text/plain", &format!("{why}\n")),
        };
    }
    let known = matches!(
        path,
        "/livez" | "/readyz" | "/metrics" | "/v1/locks" | "/v1/cluster"
    ) || path.starts_with("/v1/locks/");
    if !known {
        return respond(c, 404, "text/plain", &format!("no such path: {path}\n"));
    }
    if method != "GET" {
        return respond(c, 405, "text/plain", "only GET is served\n");
    }
    match path {
        "/livez" => respond(c, 200, "text/plain", "ok\n"),
        "/readyz" if view.stopping => respond(c, 503, "text/plain", "not ready: shutting down\n"),
        "/readyz" => match view.service.readiness(now) {
            Ok(()) => respond(c, 200, "text/plain", "ok\n"),
            Err(why) => respond(c, 503, "text/plain", &format!("not ready: {why}\n")),
        },
        "/metrics" => {
            let text = render_metrics(now, view);
            respond(c, 200, metrics::CONTENT_TYPE, &text);
        }
        "/v1/cluster" => match view.service.cluster_json(now) {
            Some(json) => respond(c, 200, "application/json", &json),
            None => respond(c, 404, "text/plain", "not a cluster node\n"),
        },
        "/v1/locks" => match parse_listing(query.unwrap_or(""), view.max_key_bytes) {
            Ok(mut listing) => {
                listing.full_tokens = view.shows_tokens(c);
                if view.service.engine().is_none() {
                    return respond(c, 503, "text/plain", "no lock table\n");
                }
                c.state = State::Listing(Box::new(listing));
            }
            Err(why) => respond(c, 400, "text/plain", &format!("{why}\n")),
        },
        _ => {
            let raw = &path["/v1/locks/".len()..];
            let key = match decode_key(raw, view.max_key_bytes) {
                Ok(k) => k,
                Err(why) => return respond(c, 400, "text/plain", &format!("{why}\n")),
            };
            if query.is_some() {
                return respond(c, 400, "text/plain", "/v1/locks/KEY takes no query\n");
            }
            let Some(engine) = view.service.engine() else {
                return respond(c, 503, "text/plain", "no lock table\n");
            };
            match engine.lock_info(now, &key) {
                Some(info) => {
                    let mut json = String::new();
                    view.lock_json(&mut json, &key, &info, view.shows_tokens(c));
                    json.push('\n');
                    respond(c, 200, "application/json", &json);
                }
                None => {
                    let mut json = String::from("{\"error\":\"not registered\",\"key\":");
                    json_str(&mut json, &key);
                    json.push_str("}\n");
                    respond(c, 404, "application/json", &json);
                }
            }
        }
    }
}

/// `POST /v1/cluster/members/ID?address=HOST:PORT` (add a learner),
/// `POST /v1/cluster/members/ID/promote`, `DELETE
/// /v1/cluster/members/ID[?force=true]`.
fn parse_member_change(
    method: &str,
    rest: &str,
    query: &str,
) -> Result<MemberChange, (u16, String)> {
    let (id, action) = match rest.split_once('/') {
        Some((id, action)) => (id, Some(action)),
        None => (rest, None),
    };
    let id: u64 = decimal(id)
        .filter(|id| *id > 0)
        .ok_or_else(|| (400, format!("bad node id {id:?}: a number from 1")))?;
    let mut address = None;
    let mut force = false;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value).map_err(|e| (400, e.to_string()))?;
        match name {
            "address" => {
                address = Some(value.parse::<SocketAddr>().map_err(|_| {
                    (
                        400,
                        format!("address={value:?}: not an IP:PORT peer address"),
                    )
                })?);
            }
            "force" => {
                force = match value.as_str() {
                    "true" | "1" | "" => true,
                    "false" | "0" => false,
                    _ => return Err((400, format!("force={value:?}: true or false"))),
                };
            }
            _ => return Err((400, format!("unknown parameter {name:?}"))),
        }
    }
    match (method, action) {
        ("POST", None) => match address {
            Some(address) if !force => Ok(MemberChange::Add { id, address }),
            Some(_) => Err((400, "force applies to DELETE only".into())),
            None => Err((400, "adding a node needs ?address=IP:PORT".into())),
        },
        ("POST", Some("promote")) if address.is_none() && !force => {
            Ok(MemberChange::Promote { id })
        }
        ("POST", Some("promote")) => Err((400, "promote takes no parameters".into())),
        ("DELETE", None) if address.is_none() => Ok(MemberChange::Remove { id, force }),
        ("DELETE", None) => Err((400, "remove takes only ?force=true".into())),
        (_, Some(a)) if a != "promote" => Err((404, format!("no such action {a:?}"))),
        _ => Err((
            405,
            "members take POST (add, promote) and DELETE (remove)".into(),
        )),
    }
}

/// Advances a listing by one step; the JSON body once it is done.
fn step_listing<S: Service>(l: &mut Listing, now: Millis, view: &View<'_, S>) -> Option<String> {
    let engine: &dyn LockTable = view.service.engine()?;
    if l.buckets != engine.key_buckets() {
        // The table grew (or this is the first step): the order of its
        // buckets changed, so start the pass again.
        if l.buckets != 0 {
            l.restarts += 1;
        }
        if l.restarts > SCAN_RESTARTS {
            // Answer with what was found rather than chase a growing table.
            l.cursor = usize::MAX;
        } else {
            l.buckets = engine.key_buckets();
            l.cursor = 0;
            l.found.clear();
        }
    }
    if l.cursor < l.buckets {
        let keep = l.limit + 1;
        let (prefix, after, found) = (&l.prefix, l.after.as_deref(), &mut l.found);
        l.cursor = engine.scan_keys(l.cursor, l.cursor + SCAN_STEP_BUCKETS, &mut |k| {
            if !k.starts_with(prefix.as_str()) || after.is_some_and(|a| k <= a) {
                return;
            }
            if found.len() < keep {
                found.insert(k.into());
            } else if found.last().is_some_and(|last| k < &**last) {
                found.insert(k.into());
                found.pop_last();
            }
        });
        if l.cursor < l.buckets {
            return None;
        }
    }
    let mut json = String::from("{\"locks\":[");
    let mut listed = 0;
    let mut last: Option<&str> = None;
    for key in l.found.iter().take(l.limit) {
        let Some(info) = engine.lock_info(now, key) else {
            continue;
        };
        if listed > 0 {
            json.push(',');
        }
        view.lock_json(&mut json, key, &info, l.full_tokens);
        listed += 1;
        last = Some(key);
    }
    json.push_str("],\"next\":");
    match last {
        Some(k) if l.found.len() > l.limit => json_str(&mut json, k),
        _ => json.push_str("null"),
    }
    json.push_str("}\n");
    Some(json)
}

/// Why a path or a query is answered 400.
#[derive(Debug, PartialEq, Eq)]
enum BadRequest {
    /// A `%` not followed by two hex digits, at this byte.
    PercentEncoding(usize),
    /// Not UTF-8 once percent-decoded.
    NotUtf8,
    /// `/v1/locks/` with no key.
    EmptyKey,
    /// A key over `--max-key-bytes`.
    KeyTooLong(usize),
    /// A key with a newline.
    KeyNewline,
    /// A query parameter `/v1/locks` does not take.
    UnknownParameter(String),
    /// A query parameter given twice.
    Repeated(String),
    /// `limit` out of range.
    Limit(String),
    /// `prefix` or `after` longer than any key can be.
    LongerThanKeys(&'static str, usize),
}

impl fmt::Display for BadRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadRequest::PercentEncoding(i) => write!(f, "bad percent-encoding at byte {i}"),
            BadRequest::NotUtf8 => f.write_str("not UTF-8 once percent-decoded"),
            BadRequest::EmptyKey => f.write_str("empty key"),
            BadRequest::KeyTooLong(max) => write!(f, "key longer than {max} bytes"),
            BadRequest::KeyNewline => f.write_str("a key cannot contain a newline"),
            BadRequest::UnknownParameter(name) => write!(
                f,
                "unknown query parameter {name:?}: expected prefix, limit, after"
            ),
            BadRequest::Repeated(name) => write!(f, "query parameter {name} given twice"),
            BadRequest::Limit(v) => write!(f, "limit must be 1..={MAX_PAGE}, not {v:?}"),
            BadRequest::LongerThanKeys(what, max) => {
                write!(f, "{what} longer than the longest key ({max} bytes)")
            }
        }
    }
}

fn parse_listing(query: &str, max_key_bytes: usize) -> Result<Listing, BadRequest> {
    let mut prefix = None;
    let mut after = None;
    let mut limit = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value)?;
        let slot = match name {
            "prefix" => &mut prefix,
            "after" => &mut after,
            "limit" => &mut limit,
            _ => return Err(BadRequest::UnknownParameter(name.to_owned())),
        };
        if slot.is_some() {
            return Err(BadRequest::Repeated(name.to_owned()));
        }
        *slot = Some(value);
    }
    let limit = match limit {
        None => DEFAULT_PAGE,
        Some(v) => match decimal(&v).and_then(|n| usize::try_from(n).ok()) {
            Some(n) if (1..=MAX_PAGE).contains(&n) => n,
            _ => return Err(BadRequest::Limit(v)),
        },
    };
    let prefix = prefix.unwrap_or_default();
    if prefix.len() > max_key_bytes {
        return Err(BadRequest::LongerThanKeys("prefix", max_key_bytes));
    }
    if after.as_ref().is_some_and(|a| a.len() > max_key_bytes) {
        return Err(BadRequest::LongerThanKeys("after", max_key_bytes));
    }
    Ok(Listing {
        full_tokens: false,
        prefix,
        after,
        limit,
        cursor: 0,
        buckets: 0,
        restarts: 0,
        found: BTreeSet::new(),
    })
}

/// A key from a request path: percent-decoded, UTF-8, 1..=`max` bytes,
/// no newline (PROTOCOL §1).
fn decode_key(raw: &str, max: usize) -> Result<String, BadRequest> {
    let key = percent_decode(raw)?;
    if key.is_empty() {
        return Err(BadRequest::EmptyKey);
    }
    if key.len() > max {
        return Err(BadRequest::KeyTooLong(max));
    }
    if key.contains('\n') {
        return Err(BadRequest::KeyNewline);
    }
    Ok(key)
}

/// A number written in decimal digits only: no sign, no space, no empty
/// string (Rust's integer parsing would take `+5` for 5).
fn decimal(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `%XX` escapes decoded; the result must be UTF-8. `+` stays `+`.
fn percent_decode(s: &str) -> Result<String, BadRequest> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    // Exactly two hex digits (RFC 3986 `pct-encoded`): `from_str_radix`
    // would also take a sign, decoding `%+1` as 0x01.
    let digit = |j: usize| b.get(j).and_then(|&c| char::from(c).to_digit(16));
    while i < b.len() {
        if b[i] == b'%' {
            match (digit(i + 1), digit(i + 2)) {
                // Two hex digits make at most 0xff.
                (Some(hi), Some(lo)) => out.push(u8::try_from(hi << 4 | lo).unwrap_or(u8::MAX)),
                _ => return Err(BadRequest::PercentEncoding(i)),
            }
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| BadRequest::NotUtf8)
}

/// `{"key":..,"token":..,"sequence":..,"holder":..,"expires_in_ms":..,
/// "waiters":..,"held_for_ms":..}`. The token is `null` unless `full`: a
/// token releases its grant, so only `--admin-identity` reads it; anyone
/// reads its sequence (the token without its random bits), which orders
/// grants as tokens do. `holder` names the identity that took the grant
/// when it is known.
pub(crate) fn lock_json(
    out: &mut String,
    key: &str,
    info: &LockInfo,
    full: bool,
    holder: Option<&str>,
) {
    out.push_str("{\"key\":");
    json_str(out, key);
    out.push_str(",\"token\":");
    json_opt(out, full.then_some(info.token));
    let _ = write!(
        out,
        ",\"sequence\":{},\"holder\":",
        info.token >> crate::token::RANDOM_BITS
    );
    match holder {
        Some(h) => json_str(out, h),
        None => out.push_str("null"),
    }
    out.push_str(",\"expires_in_ms\":");
    json_opt(out, info.expires_in_ms);
    let _ = write!(out, ",\"waiters\":{},\"held_for_ms\":", info.waiters);
    json_opt(out, info.held_for_ms);
    out.push('}');
}

fn json_opt(out: &mut String, v: Option<u64>) {
    match v {
        Some(v) => {
            let _ = write!(out, "{v}");
        }
        None => out.push_str("null"),
    }
}

/// A JSON string: `"`, `\` and control characters escaped.
pub fn json_str(out: &mut String, s: &str) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn respond(c: &mut AdminConn, status: u16, content_type: &str, body: &str) {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        421 => "Misdirected Request",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    c.wbuf.clear();
    let _ = write!(
        c.wbuf,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nConnection: close\r\n",
        body.len()
    );
    if status == 405 {
        c.wbuf.extend_from_slice(b"Allow: GET\r\n");
    }
    c.wbuf.extend_from_slice(b"\r\n");
    c.wbuf.extend_from_slice(body.as_bytes());
    c.cursor = 0;
    c.writable = true;
    c.state = State::Writing;
}

/// One `write`; the connection is done once everything is sent.
fn write_some(c: &mut AdminConn) {
    if !c.writable {
        return;
    }
    // With TLS, the session may hold records after the last byte is
    // taken: an empty write sends them, and the exchange ends when none is
    // left (`buffered() == 0`).
    match c.stream.write(&c.wbuf[c.cursor..]) {
        Ok(n) => {
            c.cursor += n;
            if c.cursor >= c.wbuf.len() && c.stream.buffered() == 0 {
                let _ = c.stream.shutdown_write();
                c.done = true;
            }
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => c.writable = false,
        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
        Err(_) => c.done = true,
    }
}

/// The scrape: the server's counters, the engine's, then the service's own.
fn render_metrics<S: Service>(now: Millis, view: &View<'_, S>) -> String {
    let mut e = Exposition::new();
    connection_metrics(&mut e, view);
    request_metrics(&mut e, view.stats);
    if let Some(engine) = view.service.engine() {
        lock_metrics(&mut e, now, engine, view.service);
    }
    quota_metrics(&mut e, view);
    view.service.write_metrics(now, &mut e);
    e.finish()
}

/// The build, and the client connections: open, refused, malformed.
fn connection_metrics<S: Service>(e: &mut Exposition, view: &View<'_, S>) {
    let s = view.stats;
    e.info(
        "ticketd_build_info",
        "Always 1; the version of this ticketd.",
        &[("version", env!("CARGO_PKG_VERSION"))],
    );
    e.gauge(
        "ticketd_connections",
        "Open client connections.",
        view.connections as u64,
    );
    e.labelled_counter(
        "ticketd_connections_refused_total",
        "Connections accepted and closed at once, by the limit reached.",
        "reason",
        &[
            ("max_conns", s.refused),
            ("peer_not_allowed", s.refused_peer),
            ("admin_max_conns", s.admin_refused),
            ("admin_peer_not_allowed", s.admin_refused_peer),
            ("identity", s.refused_identity),
            ("handshakes", s.refused_handshakes),
            ("memory", s.refused_memory),
        ],
    );
    e.counter(
        "ticketd_malformed_total",
        "Client connections closed for a malformed frame.",
        s.malformed,
    );
    e.gauge(
        "ticketd_identities",
        "Client identities remembered: with open connections, or owing guess budget.",
        view.identities.len() as u64,
    );
    e.counter(
        "ticketd_guess_misses_total",
        "N and X answers charged to the guess budgets of client identities.",
        s.guesses,
    );
    e.counter(
        "ticketd_guess_slowdowns_total",
        "Times an identity's guess budget first held back its releases and extends.",
        s.throttled,
    );
}

/// The quotas per identity and the memory budget: refusals and bytes.
fn quota_metrics<S: Service>(e: &mut Exposition, view: &View<'_, S>) {
    let s = view.stats;
    let engine = view.service.engine();
    let q = engine.map(|e| e.stats().quotas).unwrap_or_default();
    e.labelled_counter(
        "ticketd_quota_refusals_total",
        "Acquires answered B and connections refused, by the quota or budget reached.",
        "quota",
        &[
            ("keys", q.keys),
            ("waiters", q.waiters),
            ("connections", s.refused_identity),
            ("handshakes", s.refused_handshakes),
            ("memory", q.memory + s.refused_memory),
        ],
    );
    e.labelled_gauge(
        "ticketd_memory_bytes",
        "The memory budget's estimate of the bytes in use, by part.",
        "part",
        &[
            ("locks", engine.map_or(0, LockTable::memory_bytes)),
            ("connections", view.connection_bytes),
        ],
    );
    e.gauge(
        "ticketd_memory_limit_bytes",
        "The memory budget (--max-memory).",
        view.max_memory,
    );
}

/// The requests handled and the replies produced, by kind.
fn request_metrics(e: &mut Exposition, s: &Stats) {
    e.labelled_counter(
        "ticketd_requests_total",
        "Well-formed requests handled, by operation.",
        "op",
        &[
            ("acquire", s.requests[0]),
            ("release", s.requests[1]),
            ("extend", s.requests[2]),
        ],
    );
    let r = &s.replies;
    e.labelled_counter(
        "ticketd_replies_total",
        "Replies produced, by kind (one to a connection that closed meanwhile is dropped).",
        "reply",
        &[
            ("acquired", r[0]),
            ("timeout", r[1]),
            ("busy", r[2]),
            ("released", r[3]),
            ("not_released", r[4]),
            ("extended", r[5]),
            ("not_extended", r[6]),
        ],
    );
}

/// The lock table: keys, waiters, grants, expiries, wait and hold times.
fn lock_metrics<S: Service>(e: &mut Exposition, now: Millis, engine: &dyn LockTable, service: &S) {
    let es = engine.stats();
    e.gauge(
        "ticketd_keys",
        "Registered keys.",
        engine.key_count() as u64,
    );
    e.gauge(
        "ticketd_waiters",
        "Queued acquires over all keys.",
        engine.waiter_count() as u64,
    );
    e.labelled_counter(
        "ticketd_grants_total",
        "Grants, by path: a free key, an expired one taken over, a hand-over to the head waiter.",
        "path",
        &[
            ("fresh", es.grants_fresh),
            ("takeover", es.grants_takeover),
            ("handover", es.grants_handover),
        ],
    );
    e.counter(
        "ticketd_lease_expiries_total",
        "Grants whose lease ran out before a release.",
        es.lease_expiries,
    );
    let (wait, hold) = service
        .lock_histograms()
        .unwrap_or((&es.wait_ms, &es.hold_ms));
    e.histogram(
        "ticketd_wait_seconds",
        "Request to grant, for every grant.",
        wait,
        1000,
    );
    e.histogram(
        "ticketd_hold_seconds",
        "Grant to release or expiry.",
        hold,
        1000,
    );
    e.gauge_seconds(
        "ticketd_oldest_hold_seconds",
        "How long the longest-held current lock has been held; 0 when none is.",
        service.oldest_hold_ms(now).unwrap_or(0),
        1000,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding_takes_escapes_and_refuses_bad_ones() {
        assert_eq!(percent_decode("a%2Fb%20c+d").unwrap(), "a/b c+d");
        assert_eq!(percent_decode("%e2%82%ac").unwrap(), "\u{20ac}");
        assert_eq!(percent_decode("a%2"), Err(BadRequest::PercentEncoding(1)));
        assert_eq!(percent_decode("a%zz"), Err(BadRequest::PercentEncoding(1)));
        // A sign is no hex digit.
        assert_eq!(percent_decode("a%+1"), Err(BadRequest::PercentEncoding(1)));
        assert_eq!(percent_decode("%-1"), Err(BadRequest::PercentEncoding(0)));
        assert_eq!(percent_decode("%4"), Err(BadRequest::PercentEncoding(0)));
        assert_eq!(percent_decode("%41%4a%4A"), Ok("AJJ".to_owned()));
        assert_eq!(percent_decode("%ff"), Err(BadRequest::NotUtf8));
    }

    proptest::proptest! {
        /// Every string survives being percent-encoded byte by byte (upper
        /// or lower case hex) and decoded.
        #[test]
        fn percent_decoding_inverts_encoding(s in ".{0,16}", upper: bool) {
            let encoded: String = s
                .bytes()
                .map(|b| if upper { format!("%{b:02X}") } else { format!("%{b:02x}") })
                .collect();
            proptest::prop_assert_eq!(percent_decode(&encoded), Ok(s));
        }

        /// Any input decodes to at most its own length or is refused; a
        /// refusal names a `%` at or after which the escape is bad.
        #[test]
        fn percent_decoding_never_panics(s in "[%0-9a-fA-F+\\-z\u{e9}]{0,12}") {
            match percent_decode(&s) {
                Ok(d) => proptest::prop_assert!(d.len() <= s.len()),
                Err(BadRequest::PercentEncoding(i)) => {
                    proptest::prop_assert_eq!(s.as_bytes()[i], b'%');
                }
                Err(e) => proptest::prop_assert_eq!(e, BadRequest::NotUtf8),
            }
        }
    }

    #[test]
    fn a_key_is_checked_like_one_on_the_wire() {
        assert_eq!(decode_key("db%2F1", 10).unwrap(), "db/1");
        assert_eq!(decode_key("", 10), Err(BadRequest::EmptyKey));
        assert_eq!(decode_key("a%0Ab", 10), Err(BadRequest::KeyNewline));
        assert_eq!(
            decode_key("abcdefghijk", 10),
            Err(BadRequest::KeyTooLong(10))
        );
        assert_eq!(
            decode_key("abcdefghijk", 10).unwrap_err().to_string(),
            "key longer than 10 bytes"
        );
    }

    #[test]
    fn listing_queries_are_checked() {
        let l = parse_listing("prefix=a%2F&limit=5&after=a%2F1", 64).unwrap();
        assert_eq!((l.prefix.as_str(), l.limit), ("a/", 5));
        assert_eq!(l.after.as_deref(), Some("a/1"));
        assert_eq!(parse_listing("", 64).unwrap().limit, DEFAULT_PAGE);
        for bad in [
            "limit=0",
            "limit=1001",
            "limit=x",
            "foo=1",
            "limit=1&limit=2",
            "prefix=%",
            "limit=+5",
            "limit=%2B5",
            "limit=-1",
            "limit=%205",
            "limit=",
        ] {
            assert!(parse_listing(bad, 64).is_err(), "{bad}");
        }
    }

    #[test]
    fn numbers_are_decimal_digits_only() {
        assert_eq!(decimal("0"), Some(0));
        assert_eq!(decimal("0042"), Some(42));
        assert_eq!(decimal("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "+2",
            "-2",
            " 2",
            "2 ",
            "0x2",
            "18446744073709551616",
            "\u{663}",
        ] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn member_changes_take_a_decimal_node_id() {
        assert!(parse_member_change("DELETE", "2", "").is_ok());
        for bad in ["+2", "0", "", "2x", "-2"] {
            let err = parse_member_change("DELETE", bad, "").err();
            assert_eq!(err.map(|(status, _)| status), Some(400), "{bad:?}");
        }
    }

    #[test]
    fn json_strings_escape_quotes_and_controls() {
        let mut s = String::new();
        json_str(&mut s, "a\"b\\c\u{1}\u{e9}");
        assert_eq!(s, "\"a\\\"b\\\\c\\u0001\u{e9}\"");
    }
}

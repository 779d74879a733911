//! Accepting connections: from the TCP listener (in TLS when configured)
//! and the Unix listeners (peer credentials checked), up to a bound per
//! turn, refused at `--max-conns` or an identity's quotas, and paused
//! briefly when `accept` fails for lack of file descriptors.

use std::io;
use std::net::SocketAddr;

use mio::net::TcpStream;
use mio::Interest;

use crate::engine::ConnId;
use crate::service::Service;
use crate::time::Millis;

use super::conn::{Conn, PeerAddr, Stream};
use super::identity::Identity;
#[cfg(feature = "tls")]
use super::tls;
use super::{conn_token, quota, unix, Server, CONN_KEY_BITS};

/// Connections accepted per turn before the loop serves the others.
const ACCEPTS_PER_TURN: usize = 256;
/// How long accepting pauses after `EMFILE`/`ENFILE`.
const ACCEPT_PAUSE_MS: u64 = 100;

/// Whether `accept` failed for lack of file descriptors (`EMFILE`, `ENFILE`).
fn is_fd_exhaustion(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

impl<S: Service> Server<S> {
    /// Accepts what the listeners have, unless accepting is paused (it
    /// resumes here when the pause is over).
    pub(super) fn accept(&mut self, now: Millis) {
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
    pub(super) fn refused_at_max_conns(
        &mut self,
        now: Millis,
        peer: &dyn std::fmt::Display,
    ) -> bool {
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

    /// Registers an accepted TCP connection and adds it (in a TLS session
    /// when the listener speaks TLS).
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
    pub(super) fn insert_conn(&mut self, stream: Stream, peer: impl Into<PeerAddr>) -> ConnId {
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
}

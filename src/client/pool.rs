//! A small pool of sessions shared by every clone of a client.
//!
//! Slots fill lazily, one connection each, round-robin over the server
//! addresses; a dead session is reaped the next time anyone looks for a
//! session, so the pool never holds more than `size` connections. Finding a
//! session never blocks past the caller's send deadline: connecting is capped
//! by it, and with nothing reachable the caller backs off and tries again
//! until the deadline passes.

use std::io;
use std::net::SocketAddr;

use crate::client::transport::{ClientStream, Security, Target};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::failure::{classify_io, Failure, FailureKind};
use super::session::{lock, Session};

/// First pause after every address refused; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

enum Slot {
    Empty,
    Connecting,
    Live(Arc<Session>),
}

struct PoolState {
    slots: Vec<Slot>,
    rr: usize,
    next_addr: usize,
    last_error: Option<String>,
    last_failure: Option<Failure>,
    closed: bool,
}

pub(crate) struct Pool {
    addrs: Vec<Target>,
    /// How to speak to each of `addrs` (plaintext or TLS).
    security: Vec<Security>,
    /// The TCP ones among `addrs`.
    tcp: Vec<SocketAddr>,
    connect_timeout: Duration,
    max_key_bytes: usize,
    /// Give up at once when every address failed for good
    /// ([`super::ClientBuilder::fail_fast`]).
    fail_fast: bool,
    state: Mutex<PoolState>,
    cv: Condvar,
}

impl Pool {
    pub(crate) fn new(
        addrs: Vec<Target>,
        security: Vec<Security>,
        size: usize,
        connect_timeout: Duration,
        max_key_bytes: usize,
        fail_fast: bool,
    ) -> Pool {
        let tcp = addrs
            .iter()
            .filter_map(|t| match t {
                Target::Tcp(a) => Some(*a),
                Target::Unix(_) => None,
            })
            .collect();
        debug_assert_eq!(addrs.len(), security.len());
        Pool {
            addrs,
            security,
            tcp,
            connect_timeout,
            max_key_bytes,
            fail_fast,
            state: Mutex::new(PoolState {
                slots: (0..size).map(|_| Slot::Empty).collect(),
                rr: 0,
                next_addr: 0,
                last_error: None,
                last_failure: None,
                closed: false,
            }),
            cv: Condvar::new(),
        }
    }

    pub(crate) fn addresses(&self) -> &[SocketAddr] {
        &self.tcp
    }

    pub(crate) fn last_error(&self) -> Option<String> {
        lock(&self.state).last_error.clone()
    }

    pub(crate) fn last_failure(&self) -> Option<Failure> {
        lock(&self.state).last_failure.clone()
    }

    /// Keeps why `session` failed, if it did, as the last failure.
    pub(crate) fn note_failure(&self, session: &Session) {
        if let Some(f) = session.failure() {
            lock(&self.state).last_failure = Some(f);
        }
    }

    /// Live sessions now in the pool.
    pub(crate) fn live(&self) -> Vec<Arc<Session>> {
        let st = lock(&self.state);
        st.slots
            .iter()
            .filter_map(|s| match s {
                Slot::Live(s) if !s.is_dead() => Some(Arc::clone(s)),
                _ => None,
            })
            .collect()
    }

    /// A live session, connecting one if the next slot is empty; `None` once
    /// `send_deadline` passes with no session found (or the pool is closed).
    // Long because it is one retry loop over what a slot can hold.
    pub(crate) fn get(&self, send_deadline: Instant) -> Option<Arc<Session>> {
        let mut backoff = FIRST_BACKOFF;
        loop {
            let now = Instant::now();
            if now >= send_deadline {
                return None;
            }
            let mut st = lock(&self.state);
            if st.closed {
                return None;
            }
            let dead = reap(&mut st);
            if !dead.is_empty() {
                drop(st);
                join_all(dead);
                continue;
            }
            let i = st.rr % st.slots.len();
            st.rr = st.rr.wrapping_add(1);
            match &st.slots[i] {
                Slot::Live(s) => return Some(Arc::clone(s)),
                Slot::Connecting => {
                    if let Some(s) = any_live(&st) {
                        return Some(s);
                    }
                    // Someone is connecting and nothing else is up: wait for
                    // them rather than opening a connection per caller.
                    let left = send_deadline.saturating_duration_since(now);
                    let (st, _) = self
                        .cv
                        .wait_timeout(st, left.min(MAX_BACKOFF))
                        .unwrap_or_else(PoisonError::into_inner);
                    drop(st);
                    continue;
                }
                Slot::Empty => {
                    st.slots[i] = Slot::Connecting;
                    drop(st);
                    let result = self.connect(send_deadline);
                    let mut st = lock(&self.state);
                    match result {
                        Ok(s) if !st.closed => {
                            st.slots[i] = Slot::Live(Arc::clone(&s));
                            self.cv.notify_all();
                            return Some(s);
                        }
                        Ok(s) => {
                            st.slots[i] = Slot::Empty;
                            drop(st);
                            s.close("client closed");
                            s.join();
                            return None;
                        }
                        Err((e, definite)) => {
                            st.slots[i] = Slot::Empty;
                            st.last_error = Some(e.to_string());
                            self.cv.notify_all();
                            if let Some(s) = any_live(&st) {
                                return Some(s);
                            }
                            if definite && self.fail_fast {
                                return None;
                            }
                        }
                    }
                }
            }
            // Nothing reachable: pause, never past the deadline.
            let left = send_deadline.saturating_duration_since(Instant::now());
            std::thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// Tries every address once, starting from the next in rotation, each
    /// connect capped by the connect timeout and by the send deadline.
    /// The error says, besides, whether every address failed for good
    /// ([`FailureKind::is_definite`]).
    fn connect(&self, send_deadline: Instant) -> Result<Arc<Session>, (ConnectError, bool)> {
        let first = {
            let mut st = lock(&self.state);
            let a = st.next_addr;
            st.next_addr = st.next_addr.wrapping_add(1);
            a
        };
        let mut last = ConnectError::DeadlinePassed;
        let mut definite = true;
        for k in 0..self.addrs.len() {
            let i = (first + k) % self.addrs.len();
            let addr = &self.addrs[i];
            let left = send_deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                definite = false;
                break;
            }
            let security = self.security.get(i).unwrap_or(&Security::Plain);
            let failure =
                match ClientStream::connect(addr, security, self.connect_timeout.min(left)) {
                    Ok(stream) => {
                        match Session::start(stream, self.max_key_bytes, addr.to_string()) {
                            Ok(s) => return Ok(s),
                            Err(source) => {
                                let f = Failure::new(
                                    addr.to_string(),
                                    FailureKind::Connect,
                                    source.to_string(),
                                );
                                last = ConnectError::Session {
                                    addr: addr.to_string(),
                                    source,
                                };
                                f
                            }
                        }
                    }
                    Err(source) => {
                        let (kind, detail) = classify_io(&source);
                        last = ConnectError::Connect {
                            addr: addr.to_string(),
                            source,
                        };
                        Failure::new(addr.to_string(), kind, detail)
                    }
                };
            definite &= failure.kind().is_definite();
            // Kept even if a later address answers: it explains a slow call.
            let mut st = lock(&self.state);
            st.last_error = Some(last.to_string());
            st.last_failure = Some(failure);
        }
        Err((last, definite))
    }

    /// Closes every session and joins its threads; later `get`s return `None`.
    pub(crate) fn close(&self) {
        let sessions: Vec<_> = {
            let mut st = lock(&self.state);
            st.closed = true;
            self.cv.notify_all();
            st.slots
                .iter_mut()
                .filter_map(|s| match std::mem::replace(s, Slot::Empty) {
                    Slot::Live(s) => Some(s),
                    _ => None,
                })
                .collect()
        };
        for s in &sessions {
            s.close("client closed");
        }
        join_all(sessions);
    }
}

/// Why no address gave a session, kept as [`Pool::last_error`].
#[derive(Debug)]
enum ConnectError {
    /// The send deadline passed before any address was tried.
    DeadlinePassed,
    /// The connect (or the TLS handshake) failed.
    Connect { addr: String, source: io::Error },
    /// Connected, but the session's threads could not start.
    Session { addr: String, source: io::Error },
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::DeadlinePassed => f.write_str("deadline passed before connecting"),
            ConnectError::Connect { addr, source } => write!(f, "{addr}: {source}"),
            ConnectError::Session { addr, source } => {
                write!(f, "{addr}: cannot start session: {source}")
            }
        }
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConnectError::DeadlinePassed => None,
            ConnectError::Connect { source, .. } | ConnectError::Session { source, .. } => {
                Some(source)
            }
        }
    }
}

fn any_live(st: &PoolState) -> Option<Arc<Session>> {
    st.slots.iter().find_map(|s| match s {
        Slot::Live(s) if !s.is_dead() => Some(Arc::clone(s)),
        _ => None,
    })
}

/// Empties the slots of dead sessions and returns them for joining.
fn reap(st: &mut PoolState) -> Vec<Arc<Session>> {
    let mut dead = Vec::new();
    for slot in &mut st.slots {
        if matches!(slot, Slot::Live(s) if s.is_dead()) {
            if let Slot::Live(s) = std::mem::replace(slot, Slot::Empty) {
                dead.push(s);
            }
        }
    }
    dead
}

/// Joins dead sessions' threads. They end promptly: a dead session's socket
/// is shut down, which wakes both a blocked read and a blocked write.
fn join_all(sessions: Vec<Arc<Session>>) {
    for s in sessions {
        s.join();
    }
}

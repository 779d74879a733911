//! The server fed by in-memory connections (feature `harness`): the same
//! connection handling, limits, closes and outbox as over sockets, with
//! readiness taken from the pipes instead of a poll. [`crate::harness`]
//! drives it; nothing here waits or reads the OS clock.

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use mio::{Poll, Waker};

use crate::config::Config;
use crate::harness::pipe::ServerEnd;
use crate::service::Service;
use crate::time::Millis;

use super::conn::Stream;
use super::{Clock, ConnId, ManualClock, Server, Status, SERVICE_TOKEN_BASE, WAKER};

impl<S: Service> Server<S> {
    /// A server with no listener, on `clock`, whose connections are added
    /// with [`Server::connect_mem`]. The poll is still created (one epoll
    /// descriptor, no socket): the service's waker lives in it.
    pub(crate) fn in_memory(
        config: Config,
        mut service: S,
        clock: ManualClock,
    ) -> io::Result<Self> {
        config
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        service.register(poll.registry(), SERVICE_TOKEN_BASE)?;
        service.set_waker(Arc::clone(&waker));
        let local_addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0));
        Ok(Server::assemble(
            config,
            service,
            poll,
            waker,
            None,
            local_addr,
            Clock::Manual(clock),
        ))
    }

    /// Accepts an in-memory connection, as `accept` does a socket: over
    /// `max_conns` it is closed at once (the end is dropped, the peer reads
    /// EOF). `peer` names it in the logs.
    pub(crate) fn connect_mem(&mut self, end: ServerEnd, peer: SocketAddr) -> Option<ConnId> {
        // Once shutting down there is no listener to accept on: closed, as
        // the socket listeners' peers are refused by the kernel.
        if self.shutdown_deadline.is_some() {
            return None;
        }
        let now = self.clock.now();
        if self.refused_at_max_conns(now, &peer) {
            return None;
        }
        Some(self.insert_conn(Stream::Mem(end), peer))
    }

    /// One loop turn over the in-memory connections: the pipes' edges
    /// become readiness, as a poll's events would, then the same turn as
    /// over sockets runs at the manual clock's time.
    pub(crate) fn step_mem(&mut self) -> Status {
        if self.stopped {
            return Status::Stopped;
        }
        let now = self.clock.now();
        for (key, c) in &mut self.conns {
            let Some(end) = c.pipe() else {
                continue;
            };
            let (read_edge, write_edge) = end.take_edges();
            if read_edge {
                c.note_readable(true);
                if c.mark_active() {
                    self.active.push(key);
                }
            }
            if write_edge && c.mark_dirty() {
                self.dirty.push(key);
            }
        }
        self.turn(now);
        if self.stopped {
            Status::Stopped
        } else {
            Status::Running
        }
    }

    /// A turn at the clock's current time would do something: input or
    /// output is pending, a deadline is due, or a close or shutdown is
    /// waiting for this moment.
    pub(crate) fn has_work_mem(&self) -> bool {
        if self.stopped {
            return false;
        }
        let now = self.clock.now();
        if !self.active.is_empty() || !self.dirty.is_empty() {
            return true;
        }
        if self.stop_flag.load(std::sync::atomic::Ordering::SeqCst)
            && self.shutdown_deadline.is_none()
        {
            return true;
        }
        if self
            .shutdown_deadline
            .is_some_and(|t| now >= t || self.conns.is_empty())
        {
            return true;
        }
        if self.service.next_deadline().is_some_and(|t| t <= now) {
            return true;
        }
        if !self.conns.is_empty() && now >= self.next_scan {
            return true;
        }
        self.conns
            .iter()
            .any(|(_, c)| c.pipe_has_edges() || c.close_due(now))
    }

    /// The time on the server's clock.
    pub(crate) fn now(&self) -> Millis {
        self.clock.now()
    }
}

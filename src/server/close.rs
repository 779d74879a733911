//! Closing connections: after a flush of their replies (a malformed frame,
//! the peer's close, the service's request), or at once (a failed read or
//! write, a limit), and reaping those done closing at the end of a turn.

use crate::service::Service;
use crate::time::Millis;

use super::{conn_key, millis, quota, Server};

/// How often closing connections are looked at while some are lingering.
pub(super) const CLOSING_RECHECK_MS: u64 = 50;

impl<S: Service> Server<S> {
    /// Closes, after a flush of what they were answered, the connections the
    /// service asked to close ([`Service::take_closes`]).
    pub(super) fn close_asked(&mut self, now: Millis) {
        let mut ids = std::mem::take(&mut self.close_ids);
        self.service.take_closes(&mut ids);
        for &conn in &ids {
            let key = conn_key(conn);
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
    pub(super) fn start_close(&mut self, now: Millis, key: usize, linger: bool) {
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
    pub(super) fn close_now(&mut self, now: Millis, key: usize) {
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        let id = c.id();
        if c.close_now() {
            self.closing.push(key);
            self.service.disconnect(now, id, &mut self.out);
        }
    }

    /// Closes what is done closing: `Now` at once; `Drain` once flushed (and,
    /// lingering, once the peer closed too), or at its deadline.
    pub(super) fn reap(&mut self, now: Millis) {
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

    /// Whether `key` is gone or done closing (see [`Conn::close_progress`](super::conn::Conn::close_progress)).
    fn closing_done(&mut self, now: Millis, key: usize) -> bool {
        self.conns
            .get_mut(key)
            .is_none_or(|c| c.close_progress(now))
    }
}

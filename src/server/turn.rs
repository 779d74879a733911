//! One turn of the loop after the poll: how long the poll may wait, what its
//! events mark ready, and the phases of the turn in their order (see the
//! module documentation of `super`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use mio::event::Event;
use mio::Token;

use crate::service::Service;
use crate::time::Millis;

use super::close::CLOSING_RECHECK_MS;
use super::{
    admin, systemd, Server, CONN_BASE, LISTENER, SERVICE_TOKEN_BASE, SIGNALS, UNIX_BASE, WAKER,
};

impl<S: Service> Server<S> {
    /// How long the poll may wait at `now`: not at all while work is left
    /// over, else until the earliest deadline (at most `max_wait`).
    pub(super) fn poll_timeout(&self, now: Millis, max_wait: Option<Duration>) -> Option<Duration> {
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

    /// Notes what `event` makes ready: a listener, a connection's input or
    /// output, a signal, the admin port, or one of the service's sources.
    pub(super) fn note_event(&mut self, now: Millis, event: &Event) {
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

    /// The turn's phases at `now`, in order (see the module documentation).
    pub(super) fn turn(&mut self, now: Millis) {
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

    /// Serves the admin port, after the turn's lock replies are written.
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
}

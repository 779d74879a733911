//! The output side of a turn: the turn's replies into the connections'
//! write buffers (or cut back out of them), then at most one `write` per
//! connection with output.

use crate::service::Service;
use crate::time::Millis;

use super::guess_pause::charge_guess;
use super::{conn_key, conn_token, Server};

impl<S: Service> Server<S> {
    /// Cuts out of the write buffers what the service withheld of the
    /// replies encoded straight into them while their requests were
    /// handled, and copies the turn's other replies (encoded once, in the
    /// outbox: those to a connection not being handled, such as a waiter's
    /// grant) into their connections' write buffers, a run of replies to
    /// one connection in one copy. Counts the wrong-token answers (`N`,
    /// `X`) against each connection's guess throttle.
    #[cfg_attr(ticketd_profile, inline(never))]
    pub(super) fn deliver(&mut self, now: Millis) {
        // Grants encoded straight into write buffers that the service then
        // withheld (`Outbox::retain_leases`) are cut out, last first so
        // that each range is still where it was written.
        for &(conn, start, end) in self.out.direct_withdrawn().iter().rev() {
            let key = conn_key(conn);
            if let Some(c) = self.conns.get_mut(key).filter(|c| c.id() == conn) {
                c.withdraw(start, end);
            }
        }
        self.out.tally(&mut self.stats.replies);
        if log::log_enabled!(log::Level::Debug) {
            for a in self.out.iter() {
                let key = conn_key(a.conn);
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
            let key = conn_key(conn);
            let Some(c) = self.conns.get(key).filter(|c| c.id() == conn) else {
                continue;
            };
            let Some(e) = self.identities.get_mut(c.ident()) else {
                continue;
            };
            charge_guess(e, &mut self.stats, &mut self.logs, now, c.peer());
        }
        for (conn, frames) in self.out.frames() {
            let key = conn_key(conn);
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
    pub(super) fn cut_back_direct(&mut self) {
        for &(conn, len) in self.out.direct_lent() {
            let key = conn_key(conn);
            if let Some(c) = self.conns.get_mut(key).filter(|c| c.id() == conn) {
                c.cut_back(len);
            }
        }
    }

    /// At most one `write` per connection with output.
    #[cfg_attr(ticketd_profile, inline(never))]
    pub(super) fn write(&mut self, now: Millis) {
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
}

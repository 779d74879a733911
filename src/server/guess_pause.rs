//! The loop's side of the guess budget (`super::throttle`): wrong-token
//! answers charged to identities, connections paused at a release or extend
//! while their identity is over budget, and read again when it has room.

use crate::service::Service;
use crate::time::Millis;

use super::conn::{Conn, PeerAddr};
use super::identity::{self, IdentKey, Identities};
use super::{throttle, Logs, Server, Stats};

/// Charges one wrong-token answer to identity `e` (last from `peer`),
/// logging (rate-limited) the first time it is slowed down.
pub(super) fn charge_guess(
    e: &mut identity::Entry,
    stats: &mut Stats,
    logs: &mut Logs,
    now: Millis,
    peer: PeerAddr,
) {
    stats.guesses += 1;
    if !e.guesses.charge(now) {
        return;
    }
    stats.throttled += 1;
    if let Some(n) = logs.guesses.allow(now) {
        log::warn!(
            "slowing down {} (last from {peer}): {} releases or extends with a token it does \
             not hold; its releases and extends are held to {} such answers a second, then \
             {} ({n} similar not logged)",
            e.identity,
            e.guesses.misses,
            throttle::GUESS_PER_SEC,
            throttle::GUESS_SUSTAINED_PER_SEC,
        );
    }
}

/// Lists connection `key` among the connections its identity's guess budget
/// paused (and the identity among those with paused connections, once);
/// reads resume when the budget says so (see `Server::resume_throttled`).
pub(super) fn note_paused(
    identities: &mut Identities,
    paused_idents: &mut Vec<IdentKey>,
    c: &Conn,
    key: usize,
) {
    if let Some(e) = identities.get_mut(c.ident()) {
        if e.paused.is_empty() {
            paused_idents.push(c.ident());
        }
        e.paused.push_back((key, c.id()));
    }
}

impl<S: Service> Server<S> {
    /// Reads again from connections the guess budget paused, as many of
    /// each identity's (oldest first) as its budget has room for now.
    pub(super) fn resume_throttled(&mut self, now: Millis) {
        let turn = self.stats.turns;
        let (conns, active, identities) = (&mut self.conns, &mut self.active, &mut self.identities);
        self.paused_idents.retain(|&ik| {
            let Some(e) = identities.get_mut(ik) else {
                return false;
            };
            // `Some(k)`: k + 1 more releases or extends may be read.
            let Some(room) = e.guesses.room(now, turn) else {
                return true;
            };
            let mut woken = 0;
            while woken <= room {
                let Some((key, id)) = e.paused.pop_front() else {
                    break;
                };
                let Some(c) = conns.get_mut(key).filter(|c| c.id() == id) else {
                    continue;
                };
                c.unpause_for_guesses();
                if c.mark_active() {
                    active.push(key);
                }
                woken += 1;
            }
            !e.paused.is_empty()
        });
    }
}

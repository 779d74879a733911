//! Lease ends: deadlines on the caller's clock, the longest lease, the
//! restart grace and the latest lease end granted.

use super::{Engine, Slot};
use crate::time::Millis;

impl<T: Copy + Default> Engine<T> {
    /// Restart grace (single mode): until `until`, every key is treated as
    /// held by an unknown holder whose lease ends at `until`. An acquire
    /// with `wait = 0` gets Timeout, one with `wait > 0` queues FIFO and is
    /// granted at `until` (or gets Timeout when its wait runs out first), a
    /// release gets NotReleased, an extend NotExtended. The unknown holder
    /// of a key is registered
    /// (token 0, which no client ever holds) when the key is first asked
    /// for; a key nobody asks for stays unregistered. Does nothing in
    /// replicated mode.
    pub fn set_restart_grace(&mut self, until: Millis) {
        if self.clocked {
            self.grace_until = until;
        }
    }

    /// The end of the restart grace, while it is in force at `now`.
    #[must_use]
    pub fn restart_grace(&self, now: Millis) -> Option<Millis> {
        (self.grace_until > now).then_some(self.grace_until)
    }

    /// The latest lease end of every grant made so far (single mode): no
    /// lease this engine granted runs past it.
    #[must_use]
    pub fn granted_until(&self) -> Millis {
        self.granted_until
    }

    /// The latest moment at which a lease may still run, as seen at `now`:
    /// of the registered keys and of the restart grace. `None` when no
    /// lease can run past `now` (nothing is outstanding). O(keys).
    #[must_use]
    pub fn outstanding_until(&self, now: Millis) -> Option<Millis> {
        let permits = self.permits.iter().flat_map(|(_, set)| &set.grants);
        let keys = (self.keys.iter().map(|(_, s)| s.expires_at))
            .chain(permits.map(|g| g.slot.expires_at))
            .max();
        let latest = keys.unwrap_or(Millis::ZERO).max(self.grace_until);
        (self.clocked && latest > now).then_some(latest)
    }

    /// The longest lease an acquire or extend may ask for (`--max-lease`):
    /// an acquire asking for more is answered Busy and an extend
    /// NotExtended (the protocol cannot carry a shorter lease back). 255,
    /// the protocol's own maximum, by default.
    pub fn set_max_lease(&mut self, max_lease_s: u8) {
        self.max_lease_s = max_lease_s.max(1);
    }

    /// See [`Engine::set_max_lease`].
    #[must_use]
    pub fn max_lease_s(&self) -> u8 {
        self.max_lease_s
    }

    pub(super) fn is_expired(&self, slot: &Slot<T>, now: Millis) -> bool {
        self.clocked && slot.expires_at <= now
    }

    pub(super) fn deadline(&self, now: Millis, secs: u8) -> Millis {
        if self.clocked {
            now.add_secs(u64::from(secs))
        } else {
            Millis::NEVER
        }
    }

    /// The first millisecond at which a lease granted at `now` is over: one
    /// past `now + lease`. The caller's clock is read in whole milliseconds
    /// (truncated), so `now` may be up to 1 ms earlier than the moment the
    /// client wrote its request; ending the lease only once `now + lease` is
    /// *past* (PROTOCOL §2.4: "a key past its expiry") keeps the server's lease
    /// from ending before the client's conservative expiry (PROTOCOL §3).
    pub(super) fn lease_end(&self, now: Millis, lease_s: u8) -> Millis {
        self.deadline(now, lease_s).add_ms(1)
    }

    /// Records that some lease now ends at `at`, for the sweep's floor.
    pub(super) fn note_lease_end(&mut self, at: Millis) {
        self.expiry_floor = self.expiry_floor.min(at);
        if self.clocked {
            self.granted_until = self.granted_until.max(at);
        }
        if let Some(pass) = &mut self.sweep {
            pass.floor = pass.floor.min(at);
        }
    }
}

//! Extend (PROTOCOL §5.2): a grant's lease moved to end later or earlier.

use super::{ConnId, Engine, Outbox};
use crate::proto::Reply;
use crate::time::Millis;

impl<T: Copy + Default> Engine<T> {
    /// PROTOCOL §5.2: extends the grant of `key` whose token is `token` to end
    /// `lease_s` seconds from `now` (possibly earlier than before). Returns
    /// true and answers `E` when it took effect; answers `X` when the key is
    /// not registered, holds another token, its lease already ended (single
    /// mode: an ended lease is never revived), or the extension would carry
    /// the grant past `max_hold_ms` from its start. The token and the
    /// waiters' places do not change. `lease_s = 0` (rejected by the codec)
    /// is treated as 1.
    pub fn extend(
        &mut self,
        now: Millis,
        conn: ConnId,
        key: &str,
        token: u64,
        lease_s: u8,
        out: &mut Outbox<T>,
    ) -> bool {
        let lease_s = lease_s.max(1);
        let expires_at = self.lease_end(now, lease_s);
        let clocked = self.clocked;
        let max_hold_ms = self.limits.max_hold_ms;
        // Token 0 is the unknown holder of a restart grace, never a
        // client's; a lease above `--max-lease` is refused as for acquire.
        let allowed = token != 0 && lease_s <= self.max_lease_s;
        let caller = self.caller;
        let slot = match self.keys.get_mut(key) {
            Some(slot) => Some(slot),
            None if !self.permits.is_empty() => self.permit_slot_mut(key, token),
            None => None,
        };
        let extended = match slot {
            Some(slot)
                if allowed
                    && slot.token == token
                    && caller.may_act_on(slot.holder)
                    && !(clocked && slot.expires_at <= now) =>
            {
                let capped = clocked
                    && max_hold_ms > 0
                    && slot.granted_at.add_ms(max_hold_ms) < now.add_secs(u64::from(lease_s));
                if !capped {
                    slot.expires_at = expires_at;
                }
                !capped
            }
            _ => false,
        };
        if !extended {
            out.push(conn, Reply::NotExtended { token, key }, 0);
            return false;
        }
        self.note_lease_end(expires_at);
        // A shorter lease may now end before the key's timer: move the timer
        // up, so it is never late. A longer one leaves it early, which is
        // allowed. Either way the key keeps exactly one index entry.
        if let Some(q) = self.queues.get(key) {
            if clocked && expires_at < q.timer_at {
                self.set_timer(key, expires_at);
            }
        }
        out.push(conn, Reply::Extended { token, key }, lease_s);
        true
    }
}

//! Deadline arithmetic of one call (PROTOCOL §3), kept apart from sockets so every
//! rule can be checked with made-up instants.
//!
//! An acquire with `wait > 0` has one monotonic deadline `D = start +
//! normalised wait`. It may be written to a socket only before `D`; the wait
//! byte on the wire is the time left until `D`, rounded *up* to whole seconds;
//! an `A` that reaches the caller after `D` is not handed over; and a request
//! that may have been sent but has no matching reply by `D + 1 s` is given up.
//! `wait = 0` and releases run under a separate transport deadline instead.

use std::time::{Duration, Instant};

use super::error::Error;
use crate::time::Millis;

/// A point in time a plan can be made on: the blocking client's `Instant`,
/// or the [`Millis`] of a caller-driven clock (the sans-IO client,
/// [`super::machine`]). The rules are the same on both.
pub trait Moment: Copy + Ord + std::fmt::Debug {
    /// `self` plus `d`.
    #[must_use]
    fn plus(self, d: Duration) -> Self;
    /// The time from `self` until `later`, zero if `later` is not after it.
    #[must_use]
    fn until(self, later: Self) -> Duration;
}

impl Moment for Instant {
    fn plus(self, d: Duration) -> Self {
        self + d
    }
    fn until(self, later: Self) -> Duration {
        later.saturating_duration_since(self)
    }
}

impl Moment for Millis {
    fn plus(self, d: Duration) -> Self {
        self.add_ms(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
    fn until(self, later: Self) -> Duration {
        Millis::until(self, later)
    }
}

/// The longest wait the wire carries; longer waits are clamped to it.
pub const MAX_WAIT: Duration = Duration::from_secs(255);
/// The longest lease the wire carries.
pub const MAX_LEASE: Duration = Duration::from_secs(255);
/// Transport deadline of a `wait = 0` acquire and of a release.
pub const TRANSPORT_DEADLINE: Duration = Duration::from_secs(5);
/// How long past `D` the client still waits for a reply: the wire wait was
/// rounded up, so the server may answer up to a second after `D`.
pub const RESPONSE_GRACE: Duration = Duration::from_secs(1);

/// The caller's wait clamped to 0..=255 s.
#[must_use]
pub fn normalise_wait(wait: Duration) -> Duration {
    wait.min(MAX_WAIT)
}

/// The wait byte for `remaining` time until `D`: whole seconds rounded up,
/// at most 255. `None` when nothing remains: such a request is not sent.
#[must_use]
pub fn wire_wait_s(remaining: Duration) -> Option<u8> {
    if remaining.is_zero() {
        return None;
    }
    let up = remaining
        .as_secs()
        .saturating_add(u64::from(remaining.subsec_nanos() > 0));
    Some(u8::try_from(up).unwrap_or(u8::MAX))
}

/// The lease byte: whole seconds in 1..=255.
pub fn lease_s(lease: Duration) -> Result<u8, Error> {
    if lease.is_zero() {
        return Err(Error::ZeroLease);
    }
    if lease > MAX_LEASE {
        return Err(Error::LeaseTooLong { lease });
    }
    if lease.subsec_nanos() != 0 {
        return Err(Error::LeaseNotWholeSeconds { lease });
    }
    // In 1..=255 after the checks above.
    Ok(u8::try_from(lease.as_secs()).unwrap_or(u8::MAX))
}

/// A key the wire can carry: 1..=`max_key_bytes` bytes, no newline.
pub fn check_key(key: &str, max_key_bytes: usize) -> Result<(), Error> {
    if key.is_empty() {
        return Err(Error::EmptyKey);
    }
    if key.as_bytes().contains(&b'\n') {
        return Err(Error::KeyContainsNewline);
    }
    if key.len() > max_key_bytes {
        return Err(Error::KeyTooLong {
            len: key.len(),
            max: max_key_bytes,
        });
    }
    Ok(())
}

/// Every instant that governs one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan<T: Moment = Instant> {
    /// `D` of an acquire with `wait > 0`: the wire wait counts down to it.
    /// `None` for `wait = 0` and for releases, which carry no wait.
    pub wait_deadline: Option<T>,
    /// The request is written only before this instant; still queued then,
    /// it is dropped unsent and the call is a definite "not done".
    pub send_deadline: T,
    /// An `A` observed by the caller after this instant is not handed over.
    pub gate: T,
    /// A request that may have been sent and still has no reply at this
    /// instant is given up: its session is closed, the call is Indeterminate.
    pub give_up: T,
}

impl<T: Moment> Plan<T> {
    /// The plan of an acquire that started at `start` with the caller's `wait`.
    #[must_use]
    pub fn acquire(start: T, wait: Duration) -> Plan<T> {
        let wait = normalise_wait(wait);
        if wait.is_zero() {
            // One direct attempt under the transport deadline: there is no
            // rounded-up wire wait, so no grace either.
            return Plan::transport(start);
        }
        let d = start.plus(wait);
        Plan {
            wait_deadline: Some(d),
            send_deadline: d,
            gate: d,
            give_up: d.plus(RESPONSE_GRACE),
        }
    }

    /// One extend attempt (PROTOCOL §5.3): sent, and answered, before the
    /// transport deadline and never after `until` (the ticket's expiry).
    #[must_use]
    pub fn until(start: T, until: T) -> Plan<T> {
        let t = start.plus(TRANSPORT_DEADLINE).min(until);
        Plan {
            wait_deadline: None,
            send_deadline: t,
            gate: t,
            give_up: t,
        }
    }

    /// The plan of a release (or a `wait = 0` acquire) started at `start`.
    #[must_use]
    pub fn transport(start: T) -> Plan<T> {
        let t = start.plus(TRANSPORT_DEADLINE);
        Plan {
            wait_deadline: None,
            send_deadline: t,
            gate: t,
            give_up: t,
        }
    }

    /// The wait byte to write at `now`, or `None` if the request must not be
    /// sent any more.
    #[must_use]
    pub fn wire_wait_at(&self, now: T) -> Option<u8> {
        if now >= self.send_deadline {
            return None;
        }
        match self.wait_deadline {
            None => Some(0),
            Some(d) => wire_wait_s(now.until(d)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn wire_wait_rounds_up_to_whole_seconds_and_caps_at_255() {
        assert_eq!(wire_wait_s(Duration::ZERO), None);
        assert_eq!(wire_wait_s(Duration::from_nanos(1)), Some(1));
        assert_eq!(wire_wait_s(Duration::from_millis(999)), Some(1));
        assert_eq!(wire_wait_s(S), Some(1));
        assert_eq!(wire_wait_s(Duration::from_millis(1001)), Some(2));
        assert_eq!(wire_wait_s(Duration::from_millis(2999)), Some(3));
        assert_eq!(wire_wait_s(255 * S), Some(255));
        assert_eq!(wire_wait_s(255 * S + Duration::from_nanos(1)), Some(255));
        assert_eq!(wire_wait_s(Duration::MAX), Some(255));
    }

    #[test]
    fn wait_is_clamped_to_255_seconds() {
        assert_eq!(normalise_wait(1000 * S), 255 * S);
        assert_eq!(normalise_wait(Duration::MAX), 255 * S);
        assert_eq!(normalise_wait(7 * S), 7 * S);
        let start = Instant::now();
        let plan = Plan::acquire(start, Duration::MAX);
        assert_eq!(plan.wait_deadline, Some(start + 255 * S));
        assert_eq!(plan.wire_wait_at(start), Some(255));
    }

    #[test]
    fn one_deadline_governs_sending_the_gate_and_the_grace() {
        let start = Instant::now();
        let plan = Plan::acquire(start, 5 * S);
        let d = start + 5 * S;
        assert_eq!(plan.send_deadline, d);
        assert_eq!(plan.gate, d);
        assert_eq!(plan.give_up, d + S);
        // Written at once: the full wait goes on the wire.
        assert_eq!(plan.wire_wait_at(start), Some(5));
        // A connection that took 2 s leaves a wait 2 s shorter, never a fresh 5.
        assert_eq!(plan.wire_wait_at(start + 2 * S), Some(3));
        assert_eq!(
            plan.wire_wait_at(start + 2 * S + Duration::from_millis(1)),
            Some(3)
        );
        assert_eq!(plan.wire_wait_at(d - Duration::from_millis(1)), Some(1));
        // Reaching D unsent: not sent at all.
        assert_eq!(plan.wire_wait_at(d), None);
        assert_eq!(plan.wire_wait_at(d + S), None);
    }

    #[test]
    fn wait_zero_is_one_attempt_under_the_transport_deadline() {
        let start = Instant::now();
        let plan = Plan::acquire(start, Duration::ZERO);
        assert_eq!(plan, Plan::transport(start));
        assert_eq!(plan.wait_deadline, None);
        assert_eq!(plan.send_deadline, start + 5 * S);
        assert_eq!(plan.give_up, start + 5 * S);
        // The wire wait stays 0 however long connecting took.
        assert_eq!(plan.wire_wait_at(start + 4 * S), Some(0));
        assert_eq!(plan.wire_wait_at(start + 5 * S), None);
    }

    #[test]
    fn lease_must_be_whole_seconds_from_1_to_255() {
        assert_eq!(lease_s(Duration::ZERO), Err(Error::ZeroLease));
        assert_eq!(lease_s(S), Ok(1));
        assert_eq!(lease_s(255 * S), Ok(255));
        assert_eq!(
            lease_s(256 * S),
            Err(Error::LeaseTooLong { lease: 256 * S })
        );
        assert_eq!(
            lease_s(Duration::from_millis(1500)),
            Err(Error::LeaseNotWholeSeconds {
                lease: Duration::from_millis(1500)
            })
        );
        assert_eq!(
            lease_s(Duration::from_millis(100)),
            Err(Error::LeaseNotWholeSeconds {
                lease: Duration::from_millis(100)
            })
        );
    }

    #[test]
    fn keys_are_checked_before_anything_is_sent() {
        assert_eq!(check_key("", 8), Err(Error::EmptyKey));
        assert_eq!(check_key("a\nb", 8), Err(Error::KeyContainsNewline));
        assert_eq!(check_key("\n", 8), Err(Error::KeyContainsNewline));
        assert_eq!(
            check_key("123456789", 8),
            Err(Error::KeyTooLong { len: 9, max: 8 })
        );
        assert_eq!(check_key("12345678", 8), Ok(()));
        // The limit counts bytes, not characters.
        assert_eq!(
            check_key("éééé é", 8),
            Err(Error::KeyTooLong { len: 11, max: 8 })
        );
    }
}

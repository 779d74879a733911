//! Monotonic milliseconds: the one clock type of ticketd.
//!
//! The engine never reads a clock: every operation takes a [`Millis`] from its
//! caller. [`MonotonicClock`] is the only place in the crate that reads the OS
//! clock (`std::time::Instant`), so wall-clock jumps never move a lease or a
//! wait.

use std::fmt;
use std::time::{Duration, Instant};

/// A point on a monotonic millisecond timeline chosen by the caller.
///
/// In the server it counts from the process start; in deterministic tests it
/// is whatever the test says it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Millis(pub u64);

impl Millis {
    /// The start of the timeline.
    pub const ZERO: Millis = Millis(0);
    /// Later than every real instant; used as "never".
    pub const NEVER: Millis = Millis(u64::MAX);

    /// `self + ms`, saturating at [`Millis::NEVER`].
    #[must_use]
    pub fn add_ms(self, ms: u64) -> Millis {
        Millis(self.0.saturating_add(ms))
    }

    /// `self + secs` seconds, saturating.
    #[must_use]
    pub fn add_secs(self, secs: u64) -> Millis {
        self.add_ms(secs.saturating_mul(1000))
    }

    /// Milliseconds from `earlier` to `self`, or 0 if `earlier` is later.
    #[must_use]
    pub fn since(self, earlier: Millis) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    /// The time from `self` until `later`, zero if `later` has passed.
    #[must_use]
    pub fn until(self, later: Millis) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0))
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// Reads the OS monotonic clock as [`Millis`] since the clock was created.
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock whose zero is now.
    #[must_use]
    pub fn new() -> Self {
        MonotonicClock {
            origin: Instant::now(),
        }
    }

    /// Milliseconds since the clock was created.
    #[must_use]
    pub fn now(&self) -> Millis {
        Millis(u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX))
    }

    /// The OS instant matching `at`, for poll timeouts.
    #[must_use]
    pub fn instant(&self, at: Millis) -> Instant {
        self.origin + Duration::from_millis(at.0)
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_instead_of_wrapping() {
        assert_eq!(Millis(5).add_secs(2), Millis(2005));
        assert_eq!(Millis(u64::MAX - 1).add_ms(10), Millis::NEVER);
        assert_eq!(Millis(3).since(Millis(10)), 0);
        assert_eq!(Millis(10).since(Millis(3)), 7);
        assert_eq!(Millis(10).until(Millis(3)), Duration::ZERO);
    }

    #[test]
    fn monotonic_clock_never_goes_back() {
        let c = MonotonicClock::new();
        let a = c.now();
        let b = c.now();
        assert!(b >= a);
    }
}

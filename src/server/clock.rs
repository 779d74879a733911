//! The server's clock: the OS monotonic clock, or a [`ManualClock`] the
//! caller moves by hand for deterministic tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::service::Service;
use crate::time::{Millis, MonotonicClock};

use super::Server;

/// A clock the caller moves by hand, for deterministic tests; see
/// [`Server::use_manual_clock`].
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// Sets the time. Moving it backwards is ignored.
    pub fn set(&self, now: Millis) {
        self.0.fetch_max(now.0, Ordering::SeqCst);
    }

    /// Moves the time forward by `ms`.
    pub fn advance_ms(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }

    /// The current time.
    #[must_use]
    pub fn now(&self) -> Millis {
        Millis(self.0.load(Ordering::SeqCst))
    }
}

/// Where the server reads the time.
#[derive(Debug)]
pub(super) enum Clock {
    Monotonic(MonotonicClock),
    Manual(ManualClock),
}

impl Clock {
    /// The current time.
    pub(super) fn now(&self) -> Millis {
        match self {
            Clock::Monotonic(c) => c.now(),
            Clock::Manual(c) => c.now(),
        }
    }
}

impl<S: Service> Server<S> {
    /// Replaces the OS monotonic clock with one the caller moves, starting at
    /// the current time, so leases and waits can be stepped through
    /// deterministically. Poll timeouts still follow the deadlines; pass a
    /// `max_wait` to [`Server::poll_once`] to keep turns short.
    pub fn use_manual_clock(&mut self) -> ManualClock {
        let clock = ManualClock::default();
        clock.set(self.clock.now());
        self.clock = Clock::Manual(clock.clone());
        clock
    }
}

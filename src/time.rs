//! Monotonic milliseconds: the one clock type of ticketd.
//!
//! The engine never reads a clock: every operation takes a [`Millis`] from its
//! caller. [`MonotonicClock`] is the only place in the crate that reads the OS
//! clock for leases and waits (`CLOCK_MONOTONIC`, the clock `std::time::Instant`
//! reads), so wall-clock jumps never move a lease or a wait.

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
///
/// The server reads it after every read that brings bytes (a lease starts
/// no earlier than its request arrived), so at pipeline depth 1 it is read
/// once per request: it calls `clock_gettime(CLOCK_MONOTONIC)`, the clock
/// `Instant` reads on Linux, and does one subtraction and one division,
/// where `Instant::elapsed().as_millis()` normalised a `timespec`
/// difference, checked it and took 128-bit milliseconds of it.
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    origin: Instant,
    /// `CLOCK_MONOTONIC` in nanoseconds, read just after `origin`.
    origin_ns: u64,
}

/// `CLOCK_MONOTONIC` in nanoseconds (584 years of uptime fit), or `None`
/// if the clock cannot be read.
#[inline]
fn monotonic_ns() -> Option<u64> {
    // Uninitialised rather than built field by field: some targets' timespec
    // (32-bit musl with 64-bit time) has private padding fields.
    let mut ts = std::mem::MaybeUninit::<libc::timespec>::uninit();
    // SAFETY: `ts` is valid, writable memory for one timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, ts.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: the call succeeded, so it filled the whole timespec.
    let ts = unsafe { ts.assume_init() };
    // The monotonic clock is never negative: the casts keep every value.
    Some(
        (ts.tv_sec as u64)
            .wrapping_mul(1_000_000_000)
            .wrapping_add(ts.tv_nsec as u64),
    )
}

impl MonotonicClock {
    /// A clock whose zero is now.
    #[must_use]
    pub fn new() -> Self {
        let origin = Instant::now();
        // `Instant` reads the same clock, so this cannot fail where it did
        // not; 0 would only make every reading take the fallback below.
        let origin_ns = monotonic_ns().unwrap_or(0);
        MonotonicClock { origin, origin_ns }
    }

    /// Milliseconds since the clock was created.
    #[must_use]
    #[inline]
    pub fn now(&self) -> Millis {
        match monotonic_ns() {
            Some(ns) if self.origin_ns != 0 && ns >= self.origin_ns => {
                Millis((ns - self.origin_ns) / 1_000_000)
            }
            _ => Millis(u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)),
        }
    }

    /// The OS instant matching `at`, for poll timeouts (within a
    /// microsecond: the two origins are read one after the other).
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

/// The host's clocks as a restart sees them: what a durable lease bound
/// is measured on (single mode's restart grace). Read by
/// [`HostTime::read`]; plain data, so the rules built on it are testable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostTime {
    /// `/proc/sys/kernel/random/boot_id`: tells a process restart on the
    /// same boot from a reboot. `None` where it cannot be read.
    pub boot_id: Option<String>,
    /// `CLOCK_BOOTTIME` in milliseconds: monotonic, counts suspend, and
    /// survives a process restart (not a reboot). `None` where unreadable.
    pub boottime_ms: Option<u64>,
    /// The wall clock in milliseconds since the Unix epoch (0 before it).
    pub wall_ms: u64,
}

impl HostTime {
    /// Reads the boot id and both clocks.
    #[must_use]
    pub fn read() -> HostTime {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty() && !s.contains(char::is_whitespace));
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec we own.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
        let boottime_ms = (rc == 0)
            .then(|| {
                let secs = u64::try_from(ts.tv_sec).ok()?;
                let ms = u64::try_from(ts.tv_nsec / 1_000_000).ok()?;
                secs.checked_mul(1000)?.checked_add(ms)
            })
            .flatten();
        let wall_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        HostTime {
            boot_id,
            boottime_ms,
            wall_ms,
        }
    }
}

/// `ms` since the Unix epoch as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC), for logs.
#[must_use]
pub fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (proleptic Gregorian): count
    // 400-year eras from 0000-03-01, so that leap days end each year.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(utc(1_795_996_799_999), "2026-11-29T23:59:59.999Z");
    }

    #[test]
    fn host_time_reads_both_clocks_on_linux() {
        let a = HostTime::read();
        let b = HostTime::read();
        assert!(a.wall_ms > 1_577_836_800_000, "after 2020");
        assert!(b.boottime_ms >= a.boottime_ms);
        assert!(a.boottime_ms.is_some() && a.boot_id.is_some(), "{a:?}");
    }

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

    /// The clock counts the milliseconds `Instant` counts: after a sleep
    /// it has moved by at least the sleep, and it never reads ahead of an
    /// `Instant` taken before it was created.
    #[test]
    fn monotonic_clock_counts_what_instant_counts() {
        let start = Instant::now();
        let c = MonotonicClock::new();
        let a = c.now();
        std::thread::sleep(Duration::from_millis(30));
        let b = c.now();
        let elapsed = start.elapsed().as_millis() as u64;
        assert!(
            b.since(a) >= 30,
            "moved {} ms over a 30 ms sleep",
            b.since(a)
        );
        assert!(b.0 <= elapsed, "clock {} ms, Instant {elapsed} ms", b.0);
    }
}

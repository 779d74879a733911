//! The restart grace's arithmetic: the durable lease bound as a record
//! ([`LeaseRecord`]), how long a start holds every key for it
//! ([`grace_for`]), and the start-up note that says so.

use std::io;
use std::path::Path;

use super::bound::{read_bound, BOUND_FILE};
use super::mark::{Loaded, MARK_FILE};
use crate::config::RestartGrace;
use crate::time::{utc, HostTime, Millis};

/// How far past the latest lease end a write of the lease bound puts it:
/// while grants keep coming with similar leases, the bound is written at
/// most once per step, and a crash adds at most this to the grace.
pub const LEASE_BOUND_STEP_MS: u64 = 1000;

/// The durable lease bound, as `DIR/lease-bound` records it: no lease
/// granted before it was written runs past it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseRecord {
    /// No record: a new directory, or one from before lease bounds.
    Unknown,
    /// The file is there but damaged (a torn write): nothing is known.
    Damaged,
    /// A clean stop with no lease outstanding.
    Nothing,
    /// No lease runs past this moment, on each of the host's clocks.
    Until {
        /// The boot the record was written on (`/proc/sys/kernel/random/boot_id`).
        boot_id: String,
        /// The bound on `CLOCK_BOOTTIME` of that boot (0: not readable).
        boottime_ms: u64,
        /// The bound on the wall clock.
        wall_ms: u64,
        /// The wall clock when the record was written: a clock reading
        /// before it after a reboot is not trusted.
        written_wall_ms: u64,
        /// The longest lease the writer could grant.
        max_lease_s: u8,
    },
}

impl LeaseRecord {
    /// The record for a bound `bound` on the engine's timeline, where
    /// `now` is the engine's present and `host` the host's clocks read
    /// no earlier than `now` (so the record is never earlier than the bound).
    #[must_use]
    pub fn at(bound: Millis, now: Millis, host: &HostTime, max_lease_s: u8) -> LeaseRecord {
        if bound <= now {
            return LeaseRecord::Nothing;
        }
        let ahead = bound.since(now);
        LeaseRecord::Until {
            boot_id: host.boot_id.clone().unwrap_or_else(|| "unknown".into()),
            boottime_ms: host.boottime_ms.map_or(0, |b| b.saturating_add(ahead)),
            wall_ms: host.wall_ms.saturating_add(ahead),
            written_wall_ms: host.wall_ms,
            max_lease_s,
        }
    }
}

/// How long a start must hold every key for the leases of `record`, seen
/// from `host`, and which clock said so.
///
/// * Same boot (the boot ids match): `CLOCK_BOOTTIME`, which a process
///   restart does not reset and which counts suspend.
/// * After a reboot: the wall clock, if it reads no earlier than when the
///   record was written; the wait is then never longer than the record's
///   own distance from its writing, nor than the writer's longest lease.
/// * After a reboot with a wall clock before the record's writing (set
///   back, or a host without a real-time clock that boots at a fixed
///   date): the full longest lease of the writer.
#[must_use]
pub fn grace_for(record: &LeaseRecord, host: &HostTime) -> (u64, &'static str) {
    let LeaseRecord::Until {
        boot_id,
        boottime_ms,
        wall_ms,
        written_wall_ms,
        max_lease_s,
    } = record
    else {
        return match record {
            LeaseRecord::Nothing => (0, "nothing was outstanding at the last stop"),
            LeaseRecord::Damaged => (
                u64::from(u8::MAX) * 1000 + LEASE_BOUND_STEP_MS,
                "the lease bound is damaged: the protocol's longest lease",
            ),
            _ => (0, "no lease bound was recorded"),
        };
    };
    let longest = u64::from(*max_lease_s) * 1000 + LEASE_BOUND_STEP_MS;
    match (host.boot_id.as_deref(), host.boottime_ms) {
        (Some(id), Some(now)) if id == boot_id && *boottime_ms > 0 => (
            boottime_ms.saturating_sub(now).min(longest),
            "same boot: CLOCK_BOOTTIME",
        ),
        _ if host.wall_ms < *written_wall_ms => (
            longest,
            "after a reboot, the wall clock reads before the bound was written: the full longest lease",
        ),
        _ => (
            wall_ms
                .saturating_sub(host.wall_ms)
                .min(wall_ms.saturating_sub(*written_wall_ms))
                .min(longest),
            "after a reboot: the wall clock",
        ),
    }
}

/// What an operator may do about a grace held for a lost lease bound.
const GRACE_OFF_ADVICE: &str = "255 s plus the step; only if no lease of the earlier run can \
     still be in use, restart with --restart-grace off to grant at once (the next start \
     writes a good bound)";

/// The lease bound the earlier run left in `dir` beside its mark
/// (`loaded`); a missing or damaged one reads as [`LeaseRecord::Damaged`],
/// with a warning.
pub(super) fn earlier_leases(dir: &Path, loaded: &Loaded) -> io::Result<LeaseRecord> {
    let mut leases = read_bound(dir)?;
    if leases == LeaseRecord::Unknown && loaded.initialised && !loaded.v1 && loaded.mark > 0 {
        // Every start of this format writes the bound before the mark:
        // a mark without one means the file was removed.
        log::warn!(
            "{} is missing beside {}: holding every key for the longest lease \
             ({GRACE_OFF_ADVICE})",
            dir.join(BOUND_FILE).display(),
            dir.join(MARK_FILE).display()
        );
        leases = LeaseRecord::Damaged;
    } else if leases == LeaseRecord::Damaged {
        log::warn!(
            "{} is damaged (a torn write?): holding every key for the longest lease \
             ({GRACE_OFF_ADVICE})",
            dir.join(BOUND_FILE).display()
        );
    }
    Ok(leases)
}

/// The start-up note on the restart grace: `grace` as configured, the
/// `remaining_ms` the earlier run's leases may still run and `why`.
pub(super) fn describe_grace(
    grace: RestartGrace,
    remaining_ms: u64,
    why: &str,
    host: &HostTime,
) -> String {
    match (grace, remaining_ms) {
        (RestartGrace::Off, 0) => format!("restart_grace=off (none was due: {why})"),
        (RestartGrace::Off, ms) => {
            format!("restart_grace=off (leases of the earlier run may run {ms} ms more: {why})")
        }
        (RestartGrace::Auto, 0) => format!("restart_grace=none ({why})"),
        (RestartGrace::Auto, ms) => format!(
            "restart_grace=in-force for {ms} ms, until {} ({why}): every key is held until then",
            utc(host.wall_ms.saturating_add(ms))
        ),
    }
}

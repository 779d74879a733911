//! Single mode's [`Service`]: the lock engine plus restart-safe fencing tokens.
//!
//! Tokens must keep increasing across restarts (PROTOCOL §2.3). Two ways:
//!
//! * With a data directory, the service keeps a *high-water mark* in
//!   `DIR/token-mark`: every token it issues is at or below the mark on disk.
//!   Tokens are reserved ahead in blocks of [`TOKEN_BLOCK`]: when the next
//!   token comes within half a block of the mark, [`Service::end_turn`] writes
//!   a new mark (temporary file, fsync, rename, fsync of the directory) before
//!   the turn's replies are written, and the engine's token ceiling is set to
//!   one above the durable mark, so a token above it is never issued (the
//!   engine answers Busy instead). After a restart the service resumes above
//!   the mark. A crash loses at most the unused rest of a block. The
//!   directory is locked (`flock` on `DIR/lock`) while the service lives, so
//!   two servers never share one mark.
//!
//!   The mark is a sealed record ([`crate::datadir`]: it carries its own
//!   length and a CRC-32). Beside it, `DIR/token-floor` is the directory's
//!   own sealed record of the lowest mark it may hold: written on first use
//!   (before the first mark) and after every mark. A directory that has a
//!   floor refuses to start when the mark is missing, short, corrupt or
//!   lower than the floor, with a message naming the file and what to do;
//!   so does one with neither mark nor floor that shows earlier use (a
//!   `lock`, `lease-bound` or other file ticketd writes). A brand-new
//!   empty directory initialises. Only regular files are opened, and a
//!   directory its group or other users may write to is refused unless
//!   `--insecure` ([`crate::datadir`]). A mark in the format before
//!   checksums (v1) is read and rewritten at once. Files are created
//!   0600 and directories 0700 whatever the umask, temporary files with
//!   `O_EXCL | O_NOFOLLOW`.
//! * Without one, the first token's sequence ([`crate::token`]) is the wall
//!   clock in units of [`WALL_SEED_UNIT_US`] microseconds since
//!   [`WALL_SEED_EPOCH_S`] (2026-01-01). This is only restart-safe if the
//!   wall clock does not go backwards across a restart, and if the server
//!   did not, on average since it started, issue more than one token per
//!   unit (250,000 grants a second). The 48-bit sequence lasts 2⁴⁸ units
//!   from the epoch: until September 2061.
//!
//! Every token carries [`crate::token::RANDOM_BITS`] random low bits from
//! the OS generator, so the mark and the floor are in token space: a block
//! holds [`TOKEN_BLOCK`] `/` [`crate::token::STEP`] grants.
//!
//! # Restart grace
//!
//! With a data directory the service also keeps a *durable lease bound* in
//! `DIR/lease-bound`: a moment after which no lease it granted can still
//! run, on `CLOCK_BOOTTIME` (with the boot id) and on the wall clock. It is
//! written ahead in steps like the mark: a grant whose lease would pass the
//! bound moves it [`LEASE_BOUND_STEP_MS`] past that lease, in
//! [`Service::end_turn`], before the turn's replies go out (one in-place
//! write and `fdatasync`; none while leases stay within the bound). A clean
//! stop ([`Service::stop`]) records exactly what is outstanding: nothing
//! (the next start grants at once) or the latest lease end.
//!
//! On start, [`grace_for`] measures what is left of the bound: on
//! `CLOCK_BOOTTIME` after a process restart on the same boot; on the wall
//! clock after a reboot; the full longest lease after a reboot whose wall
//! clock reads before the bound was written (set back, or no real-time
//! clock), or when the file is damaged. While it lasts, the engine holds
//! every key for an unknown holder ([`Engine::set_restart_grace`]); with
//! `--restart-grace off` it is only reported. If the bound cannot be
//! written, the turn's grants and extensions past the old bound are
//! withheld (their clients see no answer, so they never act on them, and
//! their leases end by themselves) and no grant is made (Busy) until the
//! bound is written.
//!
//! If writing the mark fails, the error is logged (rate-limited), the service
//! keeps serving under the old ceiling (grants stop with Busy once it is
//! reached) and the write is tried again [`MARK_RETRY_MS`] later: a failing
//! disk (where each attempt can block in `fsync`) is not hit on every loop
//! turn.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::{Config, RestartGrace, DEFAULT_MAX_LEASE_S};
use crate::datadir;
use crate::engine::{ConnId, Engine, Outbox};
use crate::limits::EngineLimits;
use crate::proto::Request;
use crate::server::ratelimit::LogLimit;
use crate::service::Service;
use crate::time::{utc, HostTime, Millis};
use crate::token::{self, TokenRng};

/// Tokens reserved by one write of the high-water mark: 2²⁰ grants, each a
/// sequence step of [`crate::token::STEP`] tokens.
pub const TOKEN_BLOCK: u64 = (1 << 20) * token::STEP;

/// The wall-clock seed's epoch (no data directory): 2026-01-01 00:00 UTC.
pub const WALL_SEED_EPOCH_S: u64 = 1_767_225_600;
/// The wall-clock seed's unit (no data directory), in microseconds: one
/// sequence step per unit.
pub const WALL_SEED_UNIT_US: u64 = 4;

/// How long after a failed write of the mark the next attempt waits.
pub const MARK_RETRY_MS: u64 = 100;

/// Name of the high-water mark file inside the data directory.
pub const MARK_FILE: &str = "token-mark";

const MARK_HEADER: &str = "ticketd token high-water mark v2";
const MARK_HEADER_V1: &str = "ticketd token high-water mark v1";

/// How far past the latest lease end a write of the lease bound puts it:
/// while grants keep coming with similar leases, the bound is written at
/// most once per step, and a crash adds at most this to the grace.
pub const LEASE_BOUND_STEP_MS: u64 = 1000;

/// Name of the durable lease bound's file inside the data directory.
pub const BOUND_FILE: &str = "lease-bound";

const BOUND_HEADER: &str = "ticketd lease bound v1";

/// The lease bound file's fixed size: each write overwrites it in place
/// (one `pwrite` and one `fdatasync`, no new block), so it keeps working
/// on a full disk; the unused tail is zeros.
const BOUND_BYTES: usize = 512;

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

    fn line(&self) -> String {
        match self {
            LeaseRecord::Unknown | LeaseRecord::Damaged => "leases unknown".into(),
            LeaseRecord::Nothing => "leases none".into(),
            LeaseRecord::Until {
                boot_id,
                boottime_ms,
                wall_ms,
                written_wall_ms,
                max_lease_s,
            } => format!(
                "leases until boot_id={boot_id} boottime_ms={boottime_ms} wall_ms={wall_ms} \
                 written_wall_ms={written_wall_ms} max_lease_s={max_lease_s}"
            ),
        }
    }

    fn parse(line: &str) -> Option<LeaseRecord> {
        let rest = line.strip_prefix("leases ")?;
        match rest {
            "unknown" => return Some(LeaseRecord::Unknown),
            "none" => return Some(LeaseRecord::Nothing),
            _ => {}
        }
        let mut words = rest.strip_prefix("until ")?.split(' ');
        let mut value = |name: &str| words.next()?.strip_prefix(name)?.strip_prefix('=');
        let boot_id = value("boot_id")?.to_string();
        let boottime_ms = value("boottime_ms")?.parse().ok()?;
        let wall_ms = value("wall_ms")?.parse().ok()?;
        let written_wall_ms = value("written_wall_ms")?.parse().ok()?;
        let max_lease_s = value("max_lease_s")?.parse().ok()?;
        Some(LeaseRecord::Until {
            boot_id,
            boottime_ms,
            wall_ms,
            written_wall_ms,
            max_lease_s,
        })
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

/// The engine with restart-safe tokens. See the module documentation.
#[derive(Debug)]
pub struct SingleService {
    engine: Engine,
    store: Option<MarkStore>,
    /// What the start found about the earlier run's leases, for the
    /// start-up line.
    grace_note: String,
}

#[derive(Debug)]
struct MarkStore {
    dir: PathBuf,
    /// Held open with an exclusive `flock` for the life of the service, so a
    /// second server on the same directory cannot issue the same tokens.
    _lock: File,
    /// Every token issued is at or below this, and it is on disk.
    durable_mark: u64,
    /// No lease granted runs past this (engine timeline), and it is on disk.
    durable_bound: Millis,
    /// The longest lease recorded with the bound: this run's `--max-lease`,
    /// or an earlier run's if longer and its leases may still run.
    record_max_lease_s: u8,
    /// `DIR/lease-bound`, open for writes in place.
    bound_file: File,
    /// Successful writes of the lease bound (each one `fdatasync`), from
    /// the start's on: `ticketd_lease_bound_writes_total`.
    bound_writes: u64,
    errors: LogLimit,
    /// No write is attempted before this, after a failed one.
    retry_at: Millis,
}

impl SingleService {
    /// Opens the service described by `config`: with `config.data_dir`, reads
    /// (or creates) the high-water mark and reserves the first block before
    /// returning, so a failure here is a start-up failure.
    ///
    /// # Errors
    /// The data directory cannot be created, read or written; its group
    /// or other users may write to it (unless `config.insecure`); a file
    /// in it is not a regular file; or its mark is missing, damaged or
    /// lower than the directory's floor record, or both are missing from
    /// a directory that shows earlier use (it is never silently
    /// replaced). Every message names the path.
    pub fn open(config: &Config) -> io::Result<Self> {
        let rng = TokenRng::os().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot read the OS random number generator (tokens need it): {e}"),
            )
        })?;
        let mut service = match &config.data_dir {
            Some(dir) => Self::with_store(
                config.engine.clone(),
                dir,
                config.restart_grace,
                config.max_lease_s,
                config.insecure,
            )?,
            None => Self::with_wall_clock_seed(config.engine.clone()),
        };
        service.engine.set_max_lease(config.max_lease_s);
        service.engine.set_token_rng(Some(rng));
        Ok(service)
    }

    /// Tokens seeded from the wall clock (no data directory; see the
    /// module doc), with random low bits from the OS generator.
    #[must_use]
    pub fn with_wall_clock_seed(limits: EngineLimits) -> Self {
        Self::with_first_token(limits, wall_clock_seed(SystemTime::now()))
    }

    /// Tokens from `first_token` on, nothing persisted: for tests and for
    /// embedding programs that manage token continuity themselves. Random
    /// low bits come from the OS generator (see
    /// [`SingleService::with_token_rng`]).
    #[must_use]
    pub fn with_first_token(limits: EngineLimits, first_token: u64) -> Self {
        let mut engine = Engine::new(limits, first_token);
        engine.set_token_rng(Some(os_rng()));
        SingleService {
            engine,
            store: None,
            grace_note: String::new(),
        }
    }

    /// Tokens that go up by one from the first, without random bits: for
    /// tests that script the tokens their clients send. Such tokens are
    /// guessable; no server started from the command line uses them.
    #[must_use]
    pub fn with_sequential_tokens(mut self) -> Self {
        self.engine.set_token_rng(None);
        self
    }

    /// Caps the leases an acquire or extend may ask for at `max_lease_s`
    /// (`--max-lease`, [`Engine::set_max_lease`]): as [`SingleService::open`]
    /// does with the configuration's value.
    #[must_use]
    pub fn with_max_lease(mut self, max_lease_s: u8) -> Self {
        self.engine.set_max_lease(max_lease_s);
        self
    }

    /// Takes tokens' random low bits from `rng` (a seeded one makes runs
    /// repeatable, for tests and simulations: such tokens are guessable).
    #[must_use]
    pub fn with_token_rng(mut self, rng: TokenRng) -> Self {
        self.engine.set_token_rng(Some(rng));
        self
    }

    /// Tokens above the high-water mark kept in `dir` (created if missing),
    /// with the default restart grace (`auto`) and longest lease (255 s).
    ///
    /// # Errors
    /// See [`SingleService::open`].
    pub fn with_data_dir(limits: EngineLimits, dir: &Path) -> io::Result<Self> {
        Self::with_data_dir_grace(limits, dir, RestartGrace::Auto, DEFAULT_MAX_LEASE_S)
    }

    /// Tokens above the high-water mark kept in `dir`, and a durable lease
    /// bound beside it: with `grace` `Auto`, a start while leases of an
    /// earlier run may still run holds every key until they have ended
    /// ([`Engine::set_restart_grace`]). `max_lease_s` is this run's
    /// longest lease (recorded with the bound).
    ///
    /// # Errors
    /// See [`SingleService::open`].
    pub fn with_data_dir_grace(
        limits: EngineLimits,
        dir: &Path,
        grace: RestartGrace,
        max_lease_s: u8,
    ) -> io::Result<Self> {
        Self::with_store(limits, dir, grace, max_lease_s, false)
    }

    /// [`SingleService::with_data_dir_grace`], and with `insecure` a data
    /// directory others may write to is used (with a warning), not refused.
    fn with_store(
        limits: EngineLimits,
        dir: &Path,
        grace: RestartGrace,
        max_lease_s: u8,
        insecure: bool,
    ) -> io::Result<Self> {
        let (lock, loaded) = open_dir(dir, insecure)?;
        let first = first_token_above(loaded.mark)?;
        let mut engine = Engine::new(limits, first);
        engine.set_token_rng(Some(os_rng()));
        let reserved = first.saturating_add(TOKEN_BLOCK - 1);
        // The leases of the earlier run: measured now, and recorded again
        // (for this boot) with the new mark, so that a crash during the
        // grace leaves the same bound.
        let host = HostTime::read();
        let leases = earlier_leases(dir, &loaded)?;
        let (remaining_ms, why) = grace_for(&leases, &host);
        let old_max = match leases {
            LeaseRecord::Until { max_lease_s, .. } if remaining_ms > 0 => max_lease_s,
            _ => 0,
        };
        let record_max_lease_s = max_lease_s.max(old_max);
        // The engine's timeline starts at the server's clock, read after
        // this: a bound measured from here ends no earlier on it.
        let bound = Millis(remaining_ms);
        let record = LeaseRecord::at(bound, Millis::ZERO, &host, record_max_lease_s);
        let bound_path = dir.join(BOUND_FILE);
        let bound_file = datadir::open_private(&bound_path)?;
        write_bound(&bound_file, &bound_path, &record)?;
        write_mark(dir, reserved)?;
        write_floor(dir, reserved)?;
        engine.set_token_ceiling(reserved.saturating_add(1));
        if grace == RestartGrace::Auto && remaining_ms > 0 {
            engine.set_restart_grace(bound);
        }
        let grace_note = describe_grace(grace, remaining_ms, why, &host);
        if loaded.v1 && grace == RestartGrace::Auto {
            log::warn!(
                "{} is from a ticketd that kept no lease bound: leases it granted are not \
                 known, so this start holds no key for them",
                dir.join(MARK_FILE).display()
            );
        }
        Ok(SingleService {
            engine,
            store: Some(MarkStore {
                dir: dir.to_path_buf(),
                _lock: lock,
                durable_mark: reserved,
                durable_bound: bound,
                record_max_lease_s,
                bound_file,
                bound_writes: 1,
                errors: LogLimit::new(1, 10_000),
                retry_at: Millis::ZERO,
            }),
            grace_note,
        })
    }

    /// The engine, for inspection.
    #[must_use]
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The durable high-water mark, when there is a data directory.
    #[must_use]
    pub fn durable_mark(&self) -> Option<u64> {
        self.store.as_ref().map(|s| s.durable_mark)
    }

    /// The durable lease bound on the engine's timeline, when there is a
    /// data directory: no lease granted runs past it.
    #[must_use]
    pub fn durable_lease_bound(&self) -> Option<Millis> {
        self.store.as_ref().map(|s| s.durable_bound)
    }

    /// How many times the lease bound was written (each one in-place write
    /// and `fdatasync`), the start's own write included, when there is a
    /// data directory.
    #[must_use]
    pub fn lease_bound_writes(&self) -> Option<u64> {
        self.store.as_ref().map(|s| s.bound_writes)
    }
}

/// Name of the lock file inside the data directory.
pub const LOCK_FILE: &str = datadir::LOCK_FILE;

/// Name of the data directory's own record of the lowest mark it may hold.
pub const FLOOR_FILE: &str = "token-floor";

const FLOOR_HEADER: &str = "ticketd data directory v1";

/// The OS generator; if it cannot be read (it always can on Linux 3.17 and
/// later), a logged error and one seeded from the clock.
fn os_rng() -> TokenRng {
    TokenRng::os().unwrap_or_else(|e| {
        log::error!("cannot read the OS random number generator: {e}; tokens are guessable");
        TokenRng::seeded(wall_clock_seed(SystemTime::now()))
    })
}

/// The first token without a data directory at wall-clock time `at`: one
/// sequence step per [`WALL_SEED_UNIT_US`] µs since [`WALL_SEED_EPOCH_S`].
/// A clock before the epoch gives the first step.
#[must_use]
pub fn wall_clock_seed(at: SystemTime) -> u64 {
    let since = at
        .duration_since(UNIX_EPOCH + std::time::Duration::from_secs(WALL_SEED_EPOCH_S))
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    let seq = (since / WALL_SEED_UNIT_US).max(1);
    seq.checked_mul(token::STEP)
        .unwrap_or(u64::MAX - token::RANDOM_MASK)
}

/// What to do about a damaged or missing mark, for every such error.
const MARK_ADVICE: &str = "refusing to start, since tokens could go back below ones already \
     issued: restore the file from a backup, or, only if no client or resource relies on \
     earlier tokens, start with a new empty --data-dir (docs/RELIABILITY.md, \"Tokens across \
     restarts\")";

fn refuse(message: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{message}; {MARK_ADVICE}"),
    )
}

/// The longest mark or floor record read: far above what ticketd writes.
const RECORD_MAX_BYTES: usize = 4096;

/// Reads a whole record file (a regular file only, see
/// [`datadir::open_regular`]); `None` when it does not exist.
fn read_optional(path: &Path) -> io::Result<Option<Vec<u8>>> {
    let bytes = datadir::read_regular(path, RECORD_MAX_BYTES)?;
    if bytes.as_ref().is_some_and(|b| b.len() > RECORD_MAX_BYTES) {
        return Err(refuse(format!(
            "{} is longer than any record ticketd writes there",
            path.display()
        )));
    }
    Ok(bytes)
}

/// The body line `name VALUE` of a record, parsed as a number.
fn field(body: &str, name: &str) -> Option<u64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Files ticketd writes in a data directory besides the mark and the
/// floor (the cluster's WAL included): any of them shows the directory was
/// used.
const USE_EVIDENCE: [&str; 6] = [
    LOCK_FILE,
    BOUND_FILE,
    "token-mark.tmp",
    "token-floor.tmp",
    "wal",
    "wal.tmp",
];

/// Creates `dir` if missing (0700), refuses it if others may write to it
/// (unless `insecure`), locks it against a second server and reads its
/// mark, writing the floor first on first use.
fn open_dir(dir: &Path, insecure: bool) -> io::Result<(File, Loaded)> {
    datadir::create_private_dir(dir)?;
    datadir::check_dir_mode(dir, insecure)?;
    // Looked for before the lock file is created.
    let used = datadir::present(dir, &USE_EVIDENCE)?;
    let lock = datadir::lock_dir(dir)?;
    let loaded = read_mark(dir, &used)?;
    if loaded.v1 {
        log::info!(
            "{} is in the format without a checksum; rewriting it with one",
            dir.join(MARK_FILE).display()
        );
    }
    if !loaded.initialised {
        // First use: the floor goes first, so that a crash before the first
        // mark leaves a directory that still starts.
        write_floor(dir, loaded.mark)?;
    }
    Ok((lock, loaded))
}

/// The first token above `mark`, on a step of the token sequence.
fn first_token_above(mark: u64) -> io::Result<u64> {
    mark.checked_add(1)
        .and_then(token::step_at_or_above)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "token high-water mark is at its maximum",
            )
        })
}

/// What an operator may do about a grace held for a lost lease bound.
const GRACE_OFF_ADVICE: &str = "255 s plus the step; only if no lease of the earlier run can \
     still be in use, restart with --restart-grace off to grant at once (the next start \
     writes a good bound)";

/// The lease bound the earlier run left in `dir` beside its mark
/// (`loaded`); a missing or damaged one reads as [`LeaseRecord::Damaged`],
/// with a warning.
fn earlier_leases(dir: &Path, loaded: &Loaded) -> io::Result<LeaseRecord> {
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
fn describe_grace(grace: RestartGrace, remaining_ms: u64, why: &str, host: &HostTime) -> String {
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

/// The mark as read from the data directory.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Loaded {
    /// Every token issued before is at or below this (0: none ever was).
    mark: u64,
    /// The directory has its floor record (it was initialised).
    initialised: bool,
    /// The mark was in the format of ticketd before checksums (v1).
    v1: bool,
}

/// Reads the data directory's floor record: `None` when there is none.
fn read_floor(dir: &Path) -> io::Result<Option<u64>> {
    let path = dir.join(FLOOR_FILE);
    let Some(bytes) = read_optional(&path)? else {
        return Ok(None);
    };
    let body = datadir::unseal(&bytes)
        .map_err(|why| refuse(format!("{} is damaged: {why}", path.display())))?;
    if body.lines().next() != Some(FLOOR_HEADER) {
        return Err(refuse(format!(
            "{} is not a ticketd data directory record",
            path.display()
        )));
    }
    field(body, "token-floor")
        .map(Some)
        .ok_or_else(|| refuse(format!("{} has no token floor", path.display())))
}

/// Reads the mark in `dir` and checks it against the directory's floor
/// record. A brand-new directory (neither file, and none of `used`, the
/// other files that show earlier use) reads as mark 0.
fn read_mark(dir: &Path, used: &[&str]) -> io::Result<Loaded> {
    let floor = read_floor(dir)?;
    let path = dir.join(MARK_FILE);
    let Some(bytes) = read_optional(&path)? else {
        if floor.is_none() && !used.is_empty() {
            return Err(refuse(format!(
                "{} and {} are both missing, but {} shows the directory was used ({}): \
                 tokens would start again below ones already issued",
                path.display(),
                dir.join(FLOOR_FILE).display(),
                dir.display(),
                used.join(", ")
            )));
        }
        return match floor {
            // Nothing was ever issued: the floor is written before the
            // first mark, and no token goes out before the floor follows it.
            None | Some(0) => Ok(Loaded {
                mark: 0,
                initialised: floor.is_some(),
                v1: false,
            }),
            Some(f) => Err(refuse(format!(
                "{} is missing, but {} records that tokens up to {f} were reserved",
                path.display(),
                dir.join(FLOOR_FILE).display()
            ))),
        };
    };
    let (mark, v1) = match parse_v1(&bytes) {
        Some(mark) => (mark, true),
        None => (parse_v2(&path, &bytes)?, false),
    };
    match floor {
        Some(f) if mark < f => Err(refuse(format!(
            "{} holds {mark}, lower than the {f} that {} records",
            path.display(),
            dir.join(FLOOR_FILE).display()
        ))),
        None if !v1 => Err(refuse(format!(
            "{} is missing, so {} cannot be checked",
            dir.join(FLOOR_FILE).display(),
            path.display()
        ))),
        _ => Ok(Loaded {
            mark,
            initialised: floor.is_some(),
            v1,
        }),
    }
}

/// A mark in the format without a checksum (ticketd before v2): read so
/// that an upgrade starts, and rewritten in the new format at once.
fn parse_v1(bytes: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut lines = text.lines();
    if lines.next() != Some(MARK_HEADER_V1) {
        return None;
    }
    lines.next()?.trim().parse().ok()
}

fn parse_v2(path: &Path, bytes: &[u8]) -> io::Result<u64> {
    let body = datadir::unseal(bytes)
        .map_err(|why| refuse(format!("{} is damaged: {why}", path.display())))?;
    if body.lines().next() != Some(MARK_HEADER) {
        return Err(refuse(format!(
            "{} is not a token high-water mark",
            path.display()
        )));
    }
    field(body, "mark").ok_or_else(|| refuse(format!("{} has no mark line", path.display())))
}

/// Makes `mark` durable in `dir` (see [`datadir::replace_file`]).
fn write_mark(dir: &Path, mark: u64) -> io::Result<()> {
    let body = format!("{MARK_HEADER}\nmark {mark}\n");
    datadir::replace_file(&dir.join(MARK_FILE), datadir::seal(&body).as_bytes())
}

/// Reads `DIR/lease-bound`: [`LeaseRecord::Unknown`] when there is none,
/// [`LeaseRecord::Damaged`] when it does not check.
fn read_bound(dir: &Path) -> io::Result<LeaseRecord> {
    let path = dir.join(BOUND_FILE);
    // Never more than the file's fixed size and one byte: a longer file
    // is not one ticketd wrote (and is not read whole into memory). Only
    // a regular file is opened (a FIFO would hang the start).
    let Some(bytes) = datadir::read_regular(&path, BOUND_BYTES)? else {
        return Ok(LeaseRecord::Unknown);
    };
    if bytes.len() > BOUND_BYTES {
        return Ok(LeaseRecord::Damaged);
    }
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let Ok(body) = datadir::unseal(&bytes[..end]) else {
        return Ok(LeaseRecord::Damaged);
    };
    let mut lines = body.lines();
    if lines.next() != Some(BOUND_HEADER) {
        return Ok(LeaseRecord::Damaged);
    }
    Ok(lines
        .next()
        .and_then(LeaseRecord::parse)
        .unwrap_or(LeaseRecord::Damaged))
}

/// Makes `record` durable in the lease bound file, in place: one write of
/// the whole fixed-size file and one `fdatasync`. A write torn by a crash
/// reads back as [`LeaseRecord::Damaged`], which holds keys for the
/// longest lease: never too short.
fn write_bound(file: &File, path: &Path, record: &LeaseRecord) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let body = format!("{BOUND_HEADER}\n{}\n", record.line());
    let mut bytes = datadir::seal(&body).into_bytes();
    debug_assert!(bytes.len() <= BOUND_BYTES, "a lease bound fits its file");
    bytes.resize(BOUND_BYTES, 0);
    let fresh = file.metadata().map_err(|e| datadir::at(path, &e))?.len() == 0;
    file.write_all_at(&bytes, 0)
        .and_then(|()| file.sync_data())
        .map_err(|e| datadir::at(path, &e))?;
    if fresh {
        // The new file's directory entry must survive a crash too.
        let dir = path.parent().unwrap_or_else(|| Path::new("."));
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| datadir::at(dir, &e))?;
    }
    Ok(())
}

/// Makes `floor` the directory's durable record of the lowest mark it may
/// hold. Written after the mark it follows, so the mark is never below it.
fn write_floor(dir: &Path, floor: u64) -> io::Result<()> {
    let body = format!("{FLOOR_HEADER}\ntoken-floor {floor}\n");
    datadir::replace_file(&dir.join(FLOOR_FILE), datadir::seal(&body).as_bytes())
}

impl MarkStore {
    /// The mark is needed when the next token comes within half a block.
    fn mark_needed(&self, engine: &Engine) -> bool {
        engine.next_token().saturating_add(TOKEN_BLOCK / 2) > self.durable_mark
    }

    /// The bound is needed when a grant's lease runs past it.
    fn bound_needed(&self, engine: &Engine) -> bool {
        engine.granted_until() > self.durable_bound
    }

    /// Writes the lease bound `bound` (engine timeline, seen at `now`).
    fn write_bound(&mut self, now: Millis, bound: Millis) -> io::Result<()> {
        let record = LeaseRecord::at(bound, now, &HostTime::read(), self.record_max_lease_s);
        write_bound(&self.bound_file, &self.dir.join(BOUND_FILE), &record)?;
        self.bound_writes += 1;
        Ok(())
    }
}

impl Service for SingleService {
    fn request(&mut self, now: Millis, conn: ConnId, req: Request<'_>, out: &mut Outbox) {
        self.engine.handle(now, conn, req, out);
    }

    /// Grants record their taker; releases and extends from another
    /// identity are refused ([`crate::engine::Caller::may_act_on`]).
    #[inline(always)]
    fn request_as(
        &mut self,
        now: Millis,
        conn: ConnId,
        who: crate::engine::Caller,
        req: Request<'_>,
        out: &mut Outbox,
    ) {
        self.engine.handle_as(now, conn, who, req, out);
    }

    fn disconnect(&mut self, now: Millis, conn: ConnId, out: &mut Outbox) {
        self.engine.disconnect(now, conn, out);
    }

    /// The engine leaves the connections' bytes out of its budget.
    fn set_connection_memory(&mut self, bytes: u64) {
        self.engine.set_outside_memory(bytes);
    }

    fn tick(&mut self, now: Millis, out: &mut Outbox) {
        self.engine.tick(now, out);
    }

    fn engine(&self) -> Option<&dyn crate::engine::LockTable> {
        Some(&self.engine)
    }

    /// The engine answers every request in the call that hands it over.
    fn answers_in_the_call(&self) -> bool {
        true
    }

    /// Nothing reads the replies back: `end_turn` only withholds grants.
    fn replies_direct(&self) -> bool {
        true
    }

    /// Only with a data directory: `end_turn` withholds grants only when
    /// the lease bound cannot be written.
    fn withholds_grants(&self) -> bool {
        self.store.is_some()
    }

    /// Ready once a grant can be made: no restart grace in force, and a
    /// durable token mark (and lease bound) above the next token.
    fn readiness(&self, now: Millis) -> Result<(), crate::service::NotReady> {
        use crate::service::NotReady;
        if let Some(until) = self.engine.restart_grace(now) {
            return Err(NotReady::RestartGrace {
                left_ms: until.since(now),
            });
        }
        if self.engine.tokens_exhausted() {
            return Err(NotReady::TokensNotDurable);
        }
        Ok(())
    }

    fn next_deadline(&self) -> Option<Millis> {
        let engine = self.engine.next_deadline();
        // After a failed write of a mark still needed, wake for the retry
        // (every turn tries once due, and pushes this past its `now`).
        let retry = self.store.as_ref().and_then(|store| {
            let needed = store.mark_needed(&self.engine) || store.bound_needed(&self.engine);
            (needed && store.retry_at > Millis::ZERO).then_some(store.retry_at)
        });
        match (engine, retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn end_turn(&mut self, now: Millis, out: &mut Outbox) -> io::Result<()> {
        let Some(store) = self.store.as_mut() else {
            return Ok(());
        };
        let mark_needed = store.mark_needed(&self.engine);
        let bound_needed = store.bound_needed(&self.engine);
        if !(mark_needed || bound_needed) || now < store.retry_at {
            return Ok(());
        }
        let mut failed = Vec::new();
        if bound_needed {
            // A grant past the bound moves it, a step ahead: written before
            // the turn's replies go out, at most once per turn.
            let bound = self.engine.granted_until().add_ms(LEASE_BOUND_STEP_MS);
            match store.write_bound(now, bound) {
                Ok(()) => store.durable_bound = bound,
                Err(e) => {
                    // This turn's grants and extensions past the durable
                    // bound are withheld: their clients never act on them
                    // (they see no answer: Indeterminate), so a restart
                    // that knows only the old bound overlaps no holder.
                    let durable = store.durable_bound;
                    let withheld = out.retain_leases(|lease_s| {
                        now.add_secs(u64::from(lease_s)).add_ms(1) <= durable
                    });
                    failed.push(format!(
                        "cannot persist the lease bound: {e}; {withheld} grants and \
                         extensions of this turn withheld (unanswered: their leases end by \
                         themselves), no grant until it is written (a restart must know \
                         every lease that may still run)"
                    ));
                }
            }
        }
        if mark_needed {
            let mark = self.engine.next_token().saturating_add(TOKEN_BLOCK - 1);
            match write_mark(&store.dir, mark).and_then(|()| write_floor(&store.dir, mark)) {
                Ok(()) => store.durable_mark = mark,
                Err(e) => failed.push(format!(
                    "cannot persist the token high-water mark in {}: {e}; serving on under the \
                     old mark {} (grants answer Busy once it is reached)",
                    store.dir.display(),
                    store.durable_mark
                )),
            }
        }
        let ceiling = if store.bound_needed(&self.engine) {
            // No grant until the bound is on disk.
            self.engine.next_token()
        } else {
            store.durable_mark.saturating_add(1)
        };
        self.engine.set_token_ceiling(ceiling);
        if !failed.is_empty() {
            store.retry_at = now.add_ms(MARK_RETRY_MS);
            if let Some(suppressed) = store.errors.allow(now) {
                log::error!(
                    "{}; retrying every {MARK_RETRY_MS} ms ({suppressed} similar errors \
                     suppressed)",
                    failed.join("; ")
                );
            }
        }
        // Handled here: the server need not log it again.
        Ok(())
    }

    fn stop(&mut self, now: Millis) {
        let Some(store) = self.store.as_mut() else {
            return;
        };
        // A clean stop records exactly what is outstanding: nothing, so
        // that the next start grants at once, or the latest lease end.
        let bound = self.engine.outstanding_until(now).unwrap_or(Millis::ZERO);
        match store.write_bound(now, bound) {
            Ok(()) => {
                store.durable_bound = bound;
                match self.engine.outstanding_until(now) {
                    None => log::info!("no lease outstanding: the next start grants at once"),
                    Some(at) => log::info!(
                        "leases outstanding for {} ms more: the next start holds every key \
                         until they end",
                        at.since(now)
                    ),
                }
            }
            Err(e) => log::error!(
                "cannot record the outstanding leases in {}: {e}; the next start keeps the \
                 earlier bound",
                store.dir.display()
            ),
        }
    }

    /// The restart grace left, and the lease bound's writes (with a data
    /// directory).
    fn write_metrics(&self, now: Millis, out: &mut crate::metrics::Exposition) {
        let left_ms = self
            .engine
            .restart_grace(now)
            .map_or(0, |until| until.since(now));
        out.gauge_seconds(
            "ticketd_restart_grace_seconds",
            "Seconds the restart grace still holds every key for leases of the earlier run \
             (0: none in force).",
            left_ms,
            1000,
        );
        if let Some(store) = &self.store {
            out.counter(
                "ticketd_lease_bound_writes_total",
                "Writes of the durable lease bound (each one in-place write and fdatasync), \
                 the start's included.",
                store.bound_writes,
            );
        }
    }

    fn describe(&self) -> String {
        match &self.store {
            Some(s) => format!(
                "mode=single data_dir={} {}",
                s.dir.display(),
                self.grace_note
            ),
            None => "mode=single data_dir=none tokens=wall-clock-seeded restart_grace=none \
                     (no data directory: nothing to remember)"
                .to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Reply;
    use std::fs;

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ticketd-single-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn grant(s: &mut SingleService, key: &str, out: &mut Outbox) -> Option<u64> {
        out.clear();
        s.request(
            Millis(0),
            1,
            Request::Acquire {
                wait_s: 0,
                lease_s: 1,
                owner: 1,
                key,
            },
            out,
        );
        let r = out.iter().next().map(|a| a.reply);
        match r {
            Some(Reply::Acquired { token, .. }) => Some(token),
            _ => None,
        }
    }

    #[test]
    fn a_reopened_data_dir_resumes_above_every_token_issued_before() {
        let dir = temp_dir("reopen");
        let mut out = Outbox::new();
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        let t1 = grant(&mut s, "a", &mut out).unwrap();
        assert_eq!(t1 >> token::RANDOM_BITS, 1, "{t1}: the first sequence step");
        let first_mark = s.durable_mark().unwrap();
        assert!(first_mark >= t1 + TOKEN_BLOCK - token::STEP);
        drop(s);
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        let t2 = grant(&mut s, "b", &mut out).unwrap();
        assert!(t2 > first_mark, "{t2} must be above the whole first block");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_a_service_with_a_data_dir_withholds_grants() {
        let s = SingleService::with_wall_clock_seed(EngineLimits::default());
        assert!(
            !s.withholds_grants(),
            "no data dir: end_turn never withholds"
        );
        let dir = temp_dir("withholds");
        let s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        assert!(
            s.withholds_grants(),
            "a failed bound write withholds grants"
        );
        drop(s);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn end_turn_moves_the_mark_before_the_block_runs_out() {
        let dir = temp_dir("advance");
        let mut out = Outbox::new();
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        let first_mark = s.durable_mark().unwrap();
        // Pretend most of the block was used.
        s.engine.raise_next_token(first_mark - TOKEN_BLOCK / 4);
        s.end_turn(Millis(0), &mut out).unwrap();
        let mark = s.durable_mark().unwrap();
        assert!(mark > first_mark);
        assert_eq!(read_mark(&dir, &[]).unwrap().mark, mark);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_token_above_the_durable_mark_when_persisting_fails() {
        let dir = temp_dir("fail");
        let mut out = Outbox::new();
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        let mark = s.durable_mark().unwrap();
        // The mark ends a sequence step: the last step below it is durable.
        assert_eq!(mark & token::RANDOM_MASK, token::RANDOM_MASK);
        let last_step = mark - token::RANDOM_MASK;
        s.engine.raise_next_token(last_step);
        // The directory disappears: the next write fails.
        fs::remove_dir_all(&dir).unwrap();
        s.end_turn(Millis(0), &mut out).unwrap();
        assert_eq!(s.durable_mark(), Some(mark));
        let x = grant(&mut s, "x", &mut out).expect("the last durable step");
        assert!(
            (last_step..=mark).contains(&x),
            "{x} in the last durable step"
        );
        assert_eq!(grant(&mut s, "y", &mut out), None, "above the mark: Busy");
        // The disk comes back: the next attempt persists and grants resume.
        fs::create_dir_all(&dir).unwrap();
        s.end_turn(Millis(MARK_RETRY_MS), &mut out).unwrap();
        assert!(s.durable_mark().unwrap() > mark);
        let y = grant(&mut s, "y", &mut out).unwrap();
        assert_eq!(
            y >> token::RANDOM_BITS,
            (mark >> token::RANDOM_BITS) + 1,
            "{y}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A failing disk is tried again after a pause, not on every loop turn
    /// (an attempt can block in fsync for as long as the disk takes).
    #[test]
    fn a_failed_mark_write_is_retried_after_a_pause_not_every_turn() {
        let dir = temp_dir("retry");
        let mut out = Outbox::new();
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        let mark = s.durable_mark().unwrap();
        s.engine.raise_next_token(mark - 10);
        fs::remove_dir_all(&dir).unwrap();
        s.end_turn(Millis(1_000), &mut out).unwrap();
        assert_eq!(s.durable_mark(), Some(mark));
        // The loop wakes for the retry.
        assert_eq!(s.next_deadline(), Some(Millis(1_000 + MARK_RETRY_MS)));
        fs::create_dir_all(&dir).unwrap();
        // Turns within the pause do not touch the disk.
        for now in [1_000, 1_001, 1_000 + MARK_RETRY_MS - 1] {
            s.end_turn(Millis(now), &mut out).unwrap();
            assert_eq!(s.durable_mark(), Some(mark), "at {now} ms");
            assert!(!dir.join(MARK_FILE).exists(), "at {now} ms");
        }
        s.end_turn(Millis(1_000 + MARK_RETRY_MS), &mut out).unwrap();
        assert!(s.durable_mark().unwrap() > mark);
        assert_eq!(
            read_mark(&dir, &[]).unwrap().mark,
            s.durable_mark().unwrap()
        );
        assert_eq!(s.next_deadline(), None, "nothing left to retry");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_data_dir_serves_one_process_at_a_time() {
        let dir = temp_dir("locked");
        let first = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        let e = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        drop(first);
        SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_corrupt_mark_refuses_to_start() {
        let dir = temp_dir("corrupt");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(MARK_FILE), "garbage\n").unwrap();
        let e = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_wall_clock_seed_counts_steps_of_four_microseconds_from_2026() {
        let epoch = UNIX_EPOCH + std::time::Duration::from_secs(WALL_SEED_EPOCH_S);
        let at = |us: u64| wall_clock_seed(epoch + std::time::Duration::from_micros(us));
        assert_eq!(wall_clock_seed(UNIX_EPOCH), token::STEP, "before the epoch");
        assert_eq!(at(4_000), 1_000 * token::STEP);
        assert_eq!(at(4_003), 1_000 * token::STEP);
        assert_eq!(at(4_004), 1_001 * token::STEP);
        // Above every token an older ticketd seeded (microseconds since 1970).
        let now = SingleService::with_wall_clock_seed(EngineLimits::default());
        let old_seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros();
        assert!(u128::from(now.engine().next_token()) > old_seed * 100);
        // The 48-bit sequence lasts until 2061.
        let year_2061 = UNIX_EPOCH + std::time::Duration::from_secs(2_871_763_200);
        assert!(wall_clock_seed(year_2061) < u64::MAX - token::RANDOM_MASK);
    }

    fn acquire(
        s: &mut SingleService,
        now: u64,
        key: &str,
        lease_s: u8,
        out: &mut Outbox,
    ) -> String {
        out.clear();
        s.request(
            Millis(now),
            1,
            Request::Acquire {
                wait_s: 0,
                lease_s,
                owner: 1,
                key,
            },
            out,
        );
        s.end_turn(Millis(now), out).unwrap();
        format!("{:?}", out.iter().next().map(|a| a.reply))
    }

    fn host(boot: &str, boottime_ms: u64, wall_ms: u64) -> HostTime {
        HostTime {
            boot_id: Some(boot.into()),
            boottime_ms: Some(boottime_ms),
            wall_ms,
        }
    }

    #[test]
    fn the_grace_is_measured_on_the_clock_that_survived_the_restart() {
        let written = host("boot-a", 10_000, 1_000_000);
        let record = LeaseRecord::at(Millis(5_000), Millis(0), &written, 30);
        assert_eq!(LeaseRecord::parse(&record.line()), Some(record.clone()));
        // Same boot, 2 s later on CLOCK_BOOTTIME (whatever the wall clock says).
        assert_eq!(
            grace_for(&LeaseRecord::Damaged, &written).0,
            255_000 + LEASE_BOUND_STEP_MS
        );
        let (ms, why) = grace_for(&record, &host("boot-a", 12_000, 0));
        assert_eq!((ms, why), (3_000, "same boot: CLOCK_BOOTTIME"));
        assert_eq!(grace_for(&record, &host("boot-a", 20_000, 0)).0, 0);
        // Rebooted, the wall clock 1 s later than the writing.
        let (ms, why) = grace_for(&record, &host("boot-b", 50, 1_001_000));
        assert_eq!((ms, why), (4_000, "after a reboot: the wall clock"));
        // Rebooted with a wall clock before the writing: the full longest
        // lease of the writer.
        let (ms, _) = grace_for(&record, &host("boot-b", 50, 999_999));
        assert_eq!(ms, 30_000 + LEASE_BOUND_STEP_MS);
        // No real-time clock: the host boots at the epoch.
        let (ms, why) = grace_for(&record, &host("boot-b", 50, 0));
        assert_eq!(ms, 30_000 + LEASE_BOUND_STEP_MS, "{why}");
        // No boot id or boot time readable now: the wall clock decides.
        let blind = HostTime {
            boot_id: None,
            boottime_ms: None,
            wall_ms: 1_002_000,
        };
        assert_eq!(grace_for(&record, &blind).0, 3_000);
        assert_eq!(grace_for(&LeaseRecord::Nothing, &written).0, 0);
        assert_eq!(grace_for(&LeaseRecord::Unknown, &written).0, 0);
        assert_eq!(
            LeaseRecord::at(Millis(5), Millis(5), &written, 30),
            LeaseRecord::Nothing
        );
    }

    #[test]
    fn a_crash_with_a_lease_out_holds_every_key_after_the_restart() {
        let dir = temp_dir("grace-crash");
        let mut out = Outbox::new();
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        assert_eq!(s.engine().restart_grace(Millis(0)), None);
        assert!(acquire(&mut s, 0, "a", 5, &mut out).contains("Acquired"));
        let bound = s.durable_lease_bound().unwrap();
        assert!(bound >= Millis(5_001), "the grant moved the bound: {bound}");
        // A shorter lease within the bound writes nothing more.
        assert!(acquire(&mut s, 10, "b", 2, &mut out).contains("Acquired"));
        assert_eq!(s.durable_lease_bound(), Some(bound));
        let text = fs::read_to_string(dir.join(BOUND_FILE)).unwrap();
        assert!(text.contains("leases until boot_id="), "{text}");
        drop(s); // a crash: no stop
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        let until = s.engine().restart_grace(Millis(0)).expect("a grace");
        assert!(until >= Millis(4_000) && until <= Millis(6_001), "{until}");
        assert!(
            s.describe().contains("restart_grace=in-force"),
            "{}",
            s.describe()
        );
        for key in ["a", "other"] {
            assert!(
                acquire(&mut s, 0, key, 5, &mut out).contains("Timeout"),
                "{key}"
            );
        }
        let after = until.0;
        assert!(acquire(&mut s, after, "a", 5, &mut out).contains("Acquired"));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_clean_stop_records_what_is_outstanding() {
        let dir = temp_dir("grace-stop");
        let mut out = Outbox::new();
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        assert!(acquire(&mut s, 0, "a", 30, &mut out).contains("Acquired"));
        // Stopped with the key held: the next start holds keys.
        s.stop(Millis(0));
        drop(s);
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        assert!(s.engine().restart_grace(Millis(0)).is_some());
        // Stopped with nothing held (the grace is over, nothing granted).
        let over = s.engine().restart_grace(Millis(0)).unwrap();
        s.stop(over);
        drop(s);
        let text = fs::read_to_string(dir.join(BOUND_FILE)).unwrap();
        assert!(text.contains("leases none"), "{text}");
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        assert_eq!(s.engine().restart_grace(Millis(0)), None);
        assert!(
            s.describe().contains("restart_grace=none"),
            "{}",
            s.describe()
        );
        assert!(acquire(&mut s, 0, "a", 30, &mut out).contains("Acquired"));
        // Off: no grace, but the bound is still kept for a later `auto`.
        drop(s);
        let mut s = SingleService::with_data_dir_grace(
            EngineLimits::default(),
            &dir,
            RestartGrace::Off,
            DEFAULT_MAX_LEASE_S,
        )
        .unwrap();
        assert_eq!(s.engine().restart_grace(Millis(0)), None);
        assert!(
            s.describe().contains("restart_grace=off"),
            "{}",
            s.describe()
        );
        assert!(acquire(&mut s, 0, "a", 30, &mut out).contains("Acquired"));
        drop(s);
        let s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        assert!(s.engine().restart_grace(Millis(0)).is_some());
        drop(s);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A lease bound that is damaged or was removed holds every key for the
    /// protocol's longest lease: the start cannot know less.
    #[test]
    fn a_damaged_or_removed_lease_bound_holds_keys_for_the_longest_lease() {
        let dir = temp_dir("grace-damaged");
        drop(SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap());
        let longest = Millis(255_000 + LEASE_BOUND_STEP_MS);
        let path = dir.join(BOUND_FILE);
        let mut bytes = fs::read(&path).unwrap();
        bytes[3] ^= 1;
        fs::write(&path, &bytes).unwrap();
        let s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        assert_eq!(s.engine().restart_grace(Millis(0)), Some(longest));
        drop(s);
        fs::remove_file(&path).unwrap();
        let s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        assert_eq!(s.engine().restart_grace(Millis(0)), Some(longest));
        drop(s);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Grants and extends within the durable bound write nothing; the first
    /// one whose lease passes it moves the bound (one write, before the
    /// reply goes out), an extend like a grant.
    #[test]
    fn the_bound_moves_in_steps_not_per_grant_and_extends_move_it_too() {
        let dir = temp_dir("grace-steps");
        let mut out = Outbox::new();
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        assert_eq!(s.lease_bound_writes(), Some(1), "the start's own write");
        assert!(acquire(&mut s, 0, "k0", 5, &mut out).contains("Acquired"));
        assert_eq!(s.lease_bound_writes(), Some(2));
        let bound = s.durable_lease_bound().unwrap();
        assert_eq!(bound, Millis(5_001 + LEASE_BOUND_STEP_MS));
        // 500 grants in the step's first 900 ms: no further write.
        for i in 1..=500_u64 {
            let key = format!("k{i}");
            assert!(acquire(&mut s, i * 9 / 5, &key, 5, &mut out).contains("Acquired"));
        }
        assert_eq!(s.lease_bound_writes(), Some(2), "no write per grant");
        // An extend that carries a lease past the bound moves it first.
        let token = s.engine().holder(Millis(900), "k0").unwrap().0;
        out.clear();
        s.request(
            Millis(900),
            1,
            Request::Extend {
                lease_s: 10,
                token,
                key: "k0",
            },
            &mut out,
        );
        s.end_turn(Millis(900), &mut out).unwrap();
        assert!(
            format!("{:?}", out.iter().next().map(|a| a.reply)).contains("Extended"),
            "the extend is answered"
        );
        assert_eq!(s.lease_bound_writes(), Some(3));
        assert_eq!(
            s.durable_lease_bound(),
            Some(Millis(10_901 + LEASE_BOUND_STEP_MS))
        );
        // What is on disk is that bound: a crash now holds keys until it.
        drop(s);
        let s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        let until = s.engine().restart_grace(Millis(0)).expect("a grace");
        assert!(until > Millis(10_000) && until <= Millis(11_901), "{until}");
        drop(s);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Writes a sealed lease bound record by hand, as an earlier run (on
    /// this boot or another) would have left it.
    fn plant_bound(dir: &Path, line: &str) {
        let body = format!("{BOUND_HEADER}\n{line}\n");
        fs::write(dir.join(BOUND_FILE), datadir::seal(&body)).unwrap();
    }

    /// The real start path, with the real clocks, on bounds an earlier run
    /// on this boot or before a reboot (another boot id) left: each case of
    /// the module documentation picks its clock and says so.
    #[test]
    fn a_start_measures_the_bound_on_the_clock_its_case_calls_for() {
        let dir = temp_dir("grace-clocks");
        drop(SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap());
        let now = HostTime::read();
        let boot = now.boot_id.clone().unwrap();
        let boottime = now.boottime_ms.unwrap();
        let wall = now.wall_ms;
        let start = |dir: &Path| {
            let s = SingleService::with_data_dir(EngineLimits::default(), dir).unwrap();
            let left = s.engine().restart_grace(Millis(0)).map_or(0, |u| u.0);
            (left, s.describe())
        };
        // Same boot: CLOCK_BOOTTIME, whatever the wall clock record says.
        plant_bound(
            &dir,
            &format!(
                "leases until boot_id={boot} boottime_ms={} wall_ms=1 written_wall_ms=1 \
                 max_lease_s=30",
                boottime + 4_000
            ),
        );
        let (left, line) = start(&dir);
        assert!((3_000..=4_000).contains(&left), "{left} ms: {line}");
        assert!(line.contains("same boot: CLOCK_BOOTTIME"), "{line}");
        assert!(
            line.contains("until 20"),
            "the start-up line says until when: {line}"
        );
        // Another boot: the wall clock (CLOCK_BOOTTIME of that boot means
        // nothing here).
        plant_bound(
            &dir,
            &format!(
                "leases until boot_id=another-boot boottime_ms={} wall_ms={} \
                 written_wall_ms={} max_lease_s=30",
                boottime + 100_000,
                wall + 4_000,
                wall - 1_000
            ),
        );
        let (left, line) = start(&dir);
        assert!((3_000..=4_000).contains(&left), "{left} ms: {line}");
        assert!(line.contains("after a reboot: the wall clock"), "{line}");
        // Another boot, the wall clock before the record's writing (set
        // back, or no real-time clock): the writer's full longest lease.
        plant_bound(
            &dir,
            &format!(
                "leases until boot_id=another-boot boottime_ms=5 wall_ms={} \
                 written_wall_ms={} max_lease_s=30",
                wall + 86_400_000 + 1_000,
                wall + 86_400_000
            ),
        );
        let (left, line) = start(&dir);
        assert_eq!(left, 30_000 + LEASE_BOUND_STEP_MS, "{line}");
        assert!(line.contains("the full longest lease"), "{line}");
        // A record that claims more than its own longest lease is held to it.
        plant_bound(
            &dir,
            &format!(
                "leases until boot_id=another-boot boottime_ms=5 wall_ms={} \
                 written_wall_ms=0 max_lease_s=3",
                wall + 86_400_000
            ),
        );
        assert_eq!(start(&dir).0, 3_000 + LEASE_BOUND_STEP_MS);
        // An over-long file is not read whole: damaged, the longest lease.
        fs::write(dir.join(BOUND_FILE), vec![b'x'; 1 << 20]).unwrap();
        assert_eq!(start(&dir).0, 255_000 + LEASE_BOUND_STEP_MS);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A grant past the durable bound whose write fails stops every grant
    /// until the bound is on disk.
    #[test]
    fn no_grant_while_the_lease_bound_cannot_be_written() {
        let dir = temp_dir("grace-fail");
        let mut out = Outbox::new();
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        // A descriptor that refuses writes stands in for a failing disk.
        let good = std::mem::replace(
            &mut s.store.as_mut().unwrap().bound_file,
            File::open("/dev/null").unwrap(),
        );
        // The grant of the failing turn is withheld: no reply at all.
        assert_eq!(acquire(&mut s, 0, "a", 5, &mut out), "None");
        assert!(s.engine().holder(Millis(0), "a").is_some());
        assert!(acquire(&mut s, 1, "b", 5, &mut out).contains("Busy"));
        s.store.as_mut().unwrap().bound_file = good;
        assert!(acquire(&mut s, MARK_RETRY_MS - 1, "b", 5, &mut out).contains("Busy"));
        assert!(acquire(&mut s, MARK_RETRY_MS, "b", 5, &mut out).contains("Busy"));
        assert!(s.durable_lease_bound().unwrap() >= Millis(5_001));
        assert!(acquire(&mut s, MARK_RETRY_MS + 1, "b", 5, &mut out).contains("Acquired"));
        fs::remove_dir_all(&dir).unwrap();
    }
}

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

mod bound;
mod error;
mod floor;
mod grace;
mod mark;
#[cfg(test)]
mod tests;

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
use crate::service::{NotReady, Observe, Service};
use crate::time::{HostTime, Millis};
use crate::token::{self, TokenRng};

pub use bound::BOUND_FILE;
pub use error::OpenError;
pub use floor::FLOOR_FILE;
pub use grace::{grace_for, LeaseRecord, LEASE_BOUND_STEP_MS};
pub use mark::{LOCK_FILE, MARK_FILE};

use bound::write_bound;
use floor::write_floor;
use grace::{describe_grace, earlier_leases};
use mark::{first_token_above, open_dir, write_mark};

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
    /// replaced). Every message names the path. The OS random number
    /// generator cannot be read. [`OpenError`] says which.
    pub fn open(config: &Config) -> Result<Self, OpenError> {
        let rng = TokenRng::os().map_err(OpenError::Rng)?;
        let mut service = match &config.data_dir {
            Some(dir) => Self::with_store(
                config.engine.clone(),
                dir,
                config.restart_grace,
                config.max_lease_s,
                config.insecure,
            )
            .map_err(|source| OpenError::DataDir {
                dir: dir.clone(),
                source,
            })?,
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

    fn observe(&self) -> Option<&dyn Observe> {
        Some(self)
    }
}

impl Observe for SingleService {
    fn lock_table(&self) -> Option<&dyn crate::engine::LockTable> {
        Some(&self.engine)
    }

    /// Ready once a grant can be made: no restart grace in force, and a
    /// durable token mark (and lease bound) above the next token.
    fn readiness(&self, now: Millis) -> Result<(), NotReady> {
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
}

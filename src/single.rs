//! Single mode's [`Service`]: the lock engine plus restart-safe fencing tokens.
//!
//! Tokens must keep increasing across restarts (SPEC §2.3). Two ways:
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
//! * Without one, the first token is the wall clock in microseconds since the
//!   Unix epoch. This is only restart-safe if the wall clock does not go
//!   backwards across a restart, and if the server did not, on average since
//!   it started, issue more than one token per microsecond (it cannot come
//!   near that rate in practice).
//!
//! If writing the mark fails, the error is logged (rate-limited), the service
//! keeps serving under the old ceiling (grants stop with Busy once it is
//! reached) and the write is tried again [`MARK_RETRY_MS`] later: a failing
//! disk (where each attempt can block in `fsync`) is not hit on every loop
//! turn.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::Config;
use crate::engine::{ConnId, Engine, Outbox};
use crate::limits::EngineLimits;
use crate::proto::Request;
use crate::server::ratelimit::LogLimit;
use crate::service::Service;
use crate::time::Millis;

/// Tokens reserved by one write of the high-water mark.
pub const TOKEN_BLOCK: u64 = 1 << 20;

/// How long after a failed write of the mark the next attempt waits.
pub const MARK_RETRY_MS: u64 = 100;

/// Name of the high-water mark file inside the data directory.
pub const MARK_FILE: &str = "token-mark";

const MARK_HEADER: &str = "ticketd token high-water mark v1";

/// The engine with restart-safe tokens. See the module documentation.
#[derive(Debug)]
pub struct SingleService {
    engine: Engine,
    store: Option<MarkStore>,
}

#[derive(Debug)]
struct MarkStore {
    dir: PathBuf,
    /// Held open with an exclusive `flock` for the life of the service, so a
    /// second server on the same directory cannot issue the same tokens.
    _lock: File,
    /// Every token issued is at or below this, and it is on disk.
    durable_mark: u64,
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
    /// The data directory cannot be created, read or written, or its mark
    /// file is corrupt (it is never silently replaced).
    pub fn open(config: &Config) -> io::Result<Self> {
        match &config.data_dir {
            Some(dir) => Self::with_data_dir(config.engine.clone(), dir),
            None => Ok(Self::with_wall_clock_seed(config.engine.clone())),
        }
    }

    /// Tokens seeded from the wall clock in microseconds (no data directory).
    #[must_use]
    pub fn with_wall_clock_seed(limits: EngineLimits) -> Self {
        let micros = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2));
        Self::with_first_token(limits, micros)
    }

    /// Tokens from `first_token` on, nothing persisted: for tests and for
    /// embedding programs that manage token continuity themselves.
    #[must_use]
    pub fn with_first_token(limits: EngineLimits, first_token: u64) -> Self {
        SingleService {
            engine: Engine::new(limits, first_token),
            store: None,
        }
    }

    /// Tokens above the high-water mark kept in `dir` (created if missing).
    ///
    /// # Errors
    /// See [`SingleService::open`].
    pub fn with_data_dir(limits: EngineLimits, dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let lock = lock_dir(dir)?;
        let mark = read_mark(dir)?;
        let first = mark.checked_add(1).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "token high-water mark is at its maximum",
            )
        })?;
        let mut engine = Engine::new(limits, first);
        let reserved = first.saturating_add(TOKEN_BLOCK - 1);
        write_mark(dir, reserved)?;
        engine.set_token_ceiling(reserved.saturating_add(1));
        Ok(SingleService {
            engine,
            store: Some(MarkStore {
                dir: dir.to_path_buf(),
                _lock: lock,
                durable_mark: reserved,
                errors: LogLimit::new(1, 10_000),
                retry_at: Millis::ZERO,
            }),
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
}

/// Name of the lock file inside the data directory.
pub const LOCK_FILE: &str = "lock";

/// Takes the data directory's lock, or fails when another process has it.
fn lock_dir(dir: &Path) -> io::Result<File> {
    use std::os::unix::io::AsRawFd;
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK_FILE))?;
    // SAFETY: flock on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} is in use by another ticketd", dir.display()),
            ));
        }
        return Err(e);
    }
    Ok(file)
}

/// Reads the mark in `dir`; 0 when there is none yet.
fn read_mark(dir: &Path) -> io::Result<u64> {
    let path = dir.join(MARK_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let corrupt = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is not a token high-water mark; refusing to guess (move it away only if no \
                 client relies on earlier tokens)",
                path.display()
            ),
        )
    };
    let mut lines = text.lines();
    if lines.next() != Some(MARK_HEADER) {
        return Err(corrupt());
    }
    lines
        .next()
        .and_then(|l| l.trim().parse::<u64>().ok())
        .ok_or_else(corrupt)
}

/// Makes `mark` durable in `dir`: temporary file, fsync, rename over the old
/// mark, fsync of the directory so the rename itself survives a crash.
fn write_mark(dir: &Path, mark: u64) -> io::Result<()> {
    let tmp = dir.join(format!("{MARK_FILE}.tmp"));
    {
        let mut f = File::create(&tmp)?;
        writeln!(f, "{MARK_HEADER}\n{mark}")?;
        f.sync_all()?;
    }
    fs::rename(&tmp, dir.join(MARK_FILE))?;
    File::open(dir)?.sync_all()
}

impl Service for SingleService {
    fn request(&mut self, now: Millis, conn: ConnId, req: Request<'_>, out: &mut Outbox) {
        self.engine.handle(now, conn, req, out);
    }

    fn disconnect(&mut self, now: Millis, conn: ConnId, out: &mut Outbox) {
        self.engine.disconnect(now, conn, out);
    }

    fn tick(&mut self, now: Millis, out: &mut Outbox) {
        self.engine.tick(now, out);
    }

    fn next_deadline(&self) -> Option<Millis> {
        let engine = self.engine.next_deadline();
        // After a failed write of a mark still needed, wake for the retry
        // (every turn tries once due, and pushes this past its `now`).
        let retry = self.store.as_ref().and_then(|store| {
            let needed =
                self.engine.next_token().saturating_add(TOKEN_BLOCK / 2) > store.durable_mark;
            (needed && store.retry_at > Millis::ZERO).then_some(store.retry_at)
        });
        match (engine, retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn end_turn(&mut self, now: Millis, _out: &mut Outbox) -> io::Result<()> {
        let Some(store) = self.store.as_mut() else {
            return Ok(());
        };
        let next = self.engine.next_token();
        if next.saturating_add(TOKEN_BLOCK / 2) <= store.durable_mark || now < store.retry_at {
            return Ok(());
        }
        let mark = next.saturating_add(TOKEN_BLOCK - 1);
        match write_mark(&store.dir, mark) {
            Ok(()) => {
                store.durable_mark = mark;
                self.engine.set_token_ceiling(mark.saturating_add(1));
                Ok(())
            }
            Err(e) => {
                store.retry_at = now.add_ms(MARK_RETRY_MS);
                if let Some(suppressed) = store.errors.allow(now) {
                    log::error!(
                        "cannot persist the token high-water mark in {}: {e}; serving on under \
                         the old mark {} (grants answer Busy once it is reached), retrying \
                         every {MARK_RETRY_MS} ms ({suppressed} similar errors suppressed)",
                        store.dir.display(),
                        store.durable_mark
                    );
                }
                // Handled here: the server need not log it again.
                Ok(())
            }
        }
    }

    fn describe(&self) -> String {
        match &self.store {
            Some(s) => format!(
                "mode=single data_dir={} next_token={}",
                s.dir.display(),
                self.engine.next_token()
            ),
            None => format!(
                "mode=single data_dir=none next_token={} (wall-clock seed)",
                self.engine.next_token()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Reply;

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
        assert_eq!(t1, 1);
        assert!(s.durable_mark().unwrap() >= t1);
        drop(s);
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        let t2 = grant(&mut s, "b", &mut out).unwrap();
        assert!(
            t2 > t1 + TOKEN_BLOCK - 1,
            "{t2} must be above the whole first block"
        );
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
        assert_eq!(read_mark(&dir).unwrap(), mark);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_token_above_the_durable_mark_when_persisting_fails() {
        let dir = temp_dir("fail");
        let mut out = Outbox::new();
        let mut s = SingleService::with_data_dir(EngineLimits::default(), &dir).unwrap();
        let mark = s.durable_mark().unwrap();
        s.engine.raise_next_token(mark);
        // The directory disappears: the next write fails.
        fs::remove_dir_all(&dir).unwrap();
        s.end_turn(Millis(0), &mut out).unwrap();
        assert_eq!(s.durable_mark(), Some(mark));
        assert_eq!(
            grant(&mut s, "x", &mut out),
            Some(mark),
            "the last durable token"
        );
        assert_eq!(grant(&mut s, "y", &mut out), None, "above the mark: Busy");
        // The disk comes back: the next attempt persists and grants resume.
        fs::create_dir_all(&dir).unwrap();
        s.end_turn(Millis(MARK_RETRY_MS), &mut out).unwrap();
        assert!(s.durable_mark().unwrap() > mark);
        assert_eq!(grant(&mut s, "y", &mut out), Some(mark + 1));
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
        assert_eq!(read_mark(&dir).unwrap(), s.durable_mark().unwrap());
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
    fn the_wall_clock_seed_is_in_microseconds() {
        let s = SingleService::with_wall_clock_seed(EngineLimits::default());
        // After 2020-01-01 in microseconds.
        assert!(s.engine().next_token() > 1_577_836_800_000_000);
    }
}

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
//!
//!   The mark is a sealed record ([`crate::datadir`]: it carries its own
//!   length and a CRC-32). Beside it, `DIR/token-floor` is the directory's
//!   own sealed record of the lowest mark it may hold: written on first use
//!   (before the first mark) and after every mark. A directory that has a
//!   floor refuses to start when the mark is missing, short, corrupt or
//!   lower than the floor, with a message naming the file and what to do;
//!   a brand-new empty directory initialises. A mark in the format before
//!   checksums (v1) is read and rewritten at once. Files are created
//!   0600 and directories 0700 whatever the umask, temporary files with
//!   `O_EXCL | O_NOFOLLOW`.
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
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::Config;
use crate::datadir;
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

const MARK_HEADER: &str = "ticketd token high-water mark v2";
const MARK_HEADER_V1: &str = "ticketd token high-water mark v1";

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
    /// is missing, damaged or lower than the directory's floor record (it
    /// is never silently replaced). Every message names the path.
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
        datadir::create_private_dir(dir)?;
        let lock = lock_dir(dir)?;
        let loaded = read_mark(dir)?;
        let mark = loaded.mark;
        if loaded.v1 {
            log::info!(
                "{} is in the format without a checksum; rewriting it with one",
                dir.join(MARK_FILE).display()
            );
        }
        if !loaded.initialised {
            // First use: the floor goes first, so that a crash before the
            // first mark leaves a directory that still starts.
            write_floor(dir, mark)?;
        }
        let first = mark.checked_add(1).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "token high-water mark is at its maximum",
            )
        })?;
        let mut engine = Engine::new(limits, first);
        let reserved = first.saturating_add(TOKEN_BLOCK - 1);
        write_mark_and_floor(dir, reserved)?;
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

/// Name of the data directory's own record of the lowest mark it may hold.
pub const FLOOR_FILE: &str = "token-floor";

const FLOOR_HEADER: &str = "ticketd data directory v1";

/// Takes the data directory's lock, or fails when another process has it.
fn lock_dir(dir: &Path) -> io::Result<File> {
    use std::os::unix::io::AsRawFd;
    let path = dir.join(LOCK_FILE);
    let file = datadir::open_private(&path)?;
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
        return Err(datadir::at(&path, &e));
    }
    Ok(file)
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

/// Reads a whole file; `None` when it does not exist.
fn read_optional(path: &Path) -> io::Result<Option<Vec<u8>>> {
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(datadir::at(path, &e)),
    }
}

/// The body line `name VALUE` of a record, parsed as a number.
fn field(body: &str, name: &str) -> Option<u64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The mark as read from the data directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
/// record. A brand-new directory (neither file) reads as mark 0.
fn read_mark(dir: &Path) -> io::Result<Loaded> {
    let floor = read_floor(dir)?;
    let path = dir.join(MARK_FILE);
    let Some(bytes) = read_optional(&path)? else {
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

/// Makes `floor` the directory's durable record of the lowest mark it may
/// hold. Written after the mark it follows, so the mark is never below it.
fn write_floor(dir: &Path, floor: u64) -> io::Result<()> {
    let body = format!("{FLOOR_HEADER}\ntoken-floor {floor}\n");
    datadir::replace_file(&dir.join(FLOOR_FILE), datadir::seal(&body).as_bytes())
}

/// The mark, then the floor that follows it.
fn write_mark_and_floor(dir: &Path, mark: u64) -> io::Result<()> {
    write_mark(dir, mark)?;
    write_floor(dir, mark)
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
        match write_mark_and_floor(&store.dir, mark) {
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
        assert_eq!(read_mark(&dir).unwrap().mark, mark);
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
        assert_eq!(read_mark(&dir).unwrap().mark, s.durable_mark().unwrap());
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

//! `DIR/token-mark`: the token high-water mark, a sealed record replaced
//! atomically; and the opening of the data directory that reads it.

use std::fs::File;
use std::io;
use std::path::Path;

use super::bound::BOUND_FILE;
use super::floor::{read_floor, write_floor, FLOOR_FILE};
use crate::datadir;
use crate::token;

/// Name of the high-water mark file inside the data directory.
pub const MARK_FILE: &str = "token-mark";

const MARK_HEADER: &str = "ticketd token high-water mark v2";
const MARK_HEADER_V1: &str = "ticketd token high-water mark v1";

/// Name of the lock file inside the data directory.
pub const LOCK_FILE: &str = datadir::LOCK_FILE;

/// What to do about a damaged or missing mark, for every such error.
const MARK_ADVICE: &str = "refusing to start, since tokens could go back below ones already \
     issued: restore the file from a backup, or, only if no client or resource relies on \
     earlier tokens, start with a new empty --data-dir (docs/RELIABILITY.md, \"Tokens across \
     restarts\")";

pub(super) fn refuse(message: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{message}; {MARK_ADVICE}"),
    )
}

/// The longest mark or floor record read: far above what ticketd writes.
const RECORD_MAX_BYTES: usize = 4096;

/// Reads a whole record file (a regular file only, see
/// [`datadir::open_regular`]); `None` when it does not exist.
pub(super) fn read_optional(path: &Path) -> io::Result<Option<Vec<u8>>> {
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
pub(super) fn field(body: &str, name: &str) -> Option<u64> {
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
pub(super) fn open_dir(dir: &Path, insecure: bool) -> io::Result<(File, Loaded)> {
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
pub(super) fn first_token_above(mark: u64) -> io::Result<u64> {
    mark.checked_add(1)
        .and_then(token::step_at_or_above)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "token high-water mark is at its maximum",
            )
        })
}

/// The mark as read from the data directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Loaded {
    /// Every token issued before is at or below this (0: none ever was).
    pub(super) mark: u64,
    /// The directory has its floor record (it was initialised).
    pub(super) initialised: bool,
    /// The mark was in the format of ticketd before checksums (v1).
    pub(super) v1: bool,
}

/// Reads the mark in `dir` and checks it against the directory's floor
/// record. A brand-new directory (neither file, and none of `used`, the
/// other files that show earlier use) reads as mark 0.
pub(super) fn read_mark(dir: &Path, used: &[&str]) -> io::Result<Loaded> {
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
pub(super) fn write_mark(dir: &Path, mark: u64) -> io::Result<()> {
    let body = format!("{MARK_HEADER}\nmark {mark}\n");
    datadir::replace_file(&dir.join(MARK_FILE), datadir::seal(&body).as_bytes())
}

//! `DIR/token-floor`: the data directory's own sealed record of the lowest
//! mark it may hold.

use std::io;
use std::path::Path;

use super::mark::{field, read_optional, refuse};
use crate::datadir;

/// Name of the data directory's own record of the lowest mark it may hold.
pub const FLOOR_FILE: &str = "token-floor";

const FLOOR_HEADER: &str = "ticketd data directory v1";

/// Reads the data directory's floor record: `None` when there is none.
pub(super) fn read_floor(dir: &Path) -> io::Result<Option<u64>> {
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

/// Makes `floor` the directory's durable record of the lowest mark it may
/// hold. Written after the mark it follows, so the mark is never below it.
pub(super) fn write_floor(dir: &Path, floor: u64) -> io::Result<()> {
    let body = format!("{FLOOR_HEADER}\ntoken-floor {floor}\n");
    datadir::replace_file(&dir.join(FLOOR_FILE), datadir::seal(&body).as_bytes())
}

//! `DIR/lease-bound`: the durable lease bound's file, a fixed-size sealed
//! record overwritten in place.

use std::fs::File;
use std::io;
use std::path::Path;

use super::grace::LeaseRecord;
use crate::datadir;

/// Name of the durable lease bound's file inside the data directory.
pub const BOUND_FILE: &str = "lease-bound";

pub(super) const BOUND_HEADER: &str = "ticketd lease bound v1";

/// The lease bound file's fixed size: each write overwrites it in place
/// (one `pwrite` and one `fdatasync`, no new block), so it keeps working
/// on a full disk; the unused tail is zeros.
const BOUND_BYTES: usize = 512;

impl LeaseRecord {
    pub(super) fn line(&self) -> String {
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

    pub(super) fn parse(line: &str) -> Option<LeaseRecord> {
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

/// Reads `DIR/lease-bound`: [`LeaseRecord::Unknown`] when there is none,
/// [`LeaseRecord::Damaged`] when it does not check.
pub(super) fn read_bound(dir: &Path) -> io::Result<LeaseRecord> {
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
pub(super) fn write_bound(file: &File, path: &Path, record: &LeaseRecord) -> io::Result<()> {
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

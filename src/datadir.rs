//! Files in a data directory: created private, replaced atomically, sealed
//! with a checksum and their own length.
//!
//! Every file and directory ticketd creates here is `0600` / `0700`
//! whatever the umask (the mode is set explicitly after creation). A
//! temporary file is created with `O_CREAT | O_EXCL | O_NOFOLLOW`, so a
//! planted symlink or file of that name is never written through: a stale
//! one (left by a crash) is unlinked, which removes the link itself, and
//! creation is tried once more. Every error names the path it is about.
//!
//! A *sealed* record is text whose last line is
//! `check length=N crc32=XXXXXXXX`: `N` is the byte length of everything
//! before that line and the CRC-32 covers those bytes, so a truncated,
//! extended or altered file is told apart from a good one.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Mode of the files ticketd creates in a data directory.
pub const FILE_MODE: u32 = 0o600;
/// Mode of the directories ticketd creates.
pub const DIR_MODE: u32 = 0o700;

/// `e` with `path` in front of its message, keeping its kind.
#[must_use]
pub fn at(path: &Path, e: &io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// Creates `dir` (and missing parents) with mode 0700 whatever the umask.
/// A directory that exists already is left as it is.
///
/// # Errors
/// The directory cannot be created, or exists and is not a directory;
/// the message names the path.
pub fn create_private_dir(dir: &Path) -> io::Result<()> {
    match fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => return Ok(()),
        // A symlink to a directory is the operator's choice: follow it.
        Ok(_) if dir.is_dir() => return Ok(()),
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a directory", dir.display()),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(at(dir, &e)),
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(|e| at(dir, &e))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(DIR_MODE)).map_err(|e| at(dir, &e))
}

/// Opens `path` for reading and writing, creating it with mode 0600
/// (whatever the umask) if it does not exist. Never follows a symlink at
/// `path`.
///
/// # Errors
/// The file cannot be opened or created; the message names the path.
pub fn open_private(path: &Path) -> io::Result<File> {
    let created = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path);
    match created {
        Ok(f) => {
            f.set_permissions(fs::Permissions::from_mode(FILE_MODE))
                .map_err(|e| at(path, &e))?;
            Ok(f)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| at(path, &e)),
        Err(e) => Err(at(path, &e)),
    }
}

/// The temporary file beside `path` that [`replace_file`] writes first.
#[must_use]
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Creates the temporary file exclusively, never through a symlink; a
/// stale one is unlinked (the link itself, not its target) and creation
/// tried once more.
fn create_temp(tmp: &Path) -> io::Result<File> {
    let open = || {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .custom_flags(libc::O_NOFOLLOW)
            .open(tmp)
    };
    let f = match open() {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            fs::remove_file(tmp).map_err(|e| at(tmp, &e))?;
            open().map_err(|e| at(tmp, &e))?
        }
        Err(e) => return Err(at(tmp, &e)),
    };
    f.set_permissions(fs::Permissions::from_mode(FILE_MODE))
        .map_err(|e| at(tmp, &e))?;
    Ok(f)
}

/// Makes `bytes` the durable content of `path`: a temporary file beside it
/// (`O_EXCL | O_NOFOLLOW`, see the module documentation), fsync, rename
/// over `path`, fsync of the directory so that the rename itself survives
/// a crash.
///
/// # Errors
/// Any step fails; the message names the file it failed on.
pub fn replace_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = temp_path(path);
    {
        let mut f = create_temp(&tmp)?;
        f.write_all(bytes).map_err(|e| at(&tmp, &e))?;
        f.sync_all().map_err(|e| at(&tmp, &e))?;
    }
    fs::rename(&tmp, path).map_err(|e| at(path, &e))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| at(dir, &e))
}

/// `body` followed by its check line (see the module documentation).
/// `body` must end with a newline.
#[must_use]
pub fn seal(body: &str) -> String {
    debug_assert!(body.ends_with('\n'), "a sealed body ends with a newline");
    let crc = crc32fast::hash(body.as_bytes());
    format!("{body}check length={} crc32={crc:08x}\n", body.len())
}

/// Why a sealed record was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsealed {
    /// No check line at the end: the file is short (cut off) or not sealed.
    NoCheck,
    /// The check line's length is not the body's: the file was cut or
    /// extended.
    Length,
    /// The body's CRC-32 is not the recorded one: the file was altered.
    Checksum,
}

impl std::fmt::Display for Unsealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unsealed::NoCheck => "it is short or not a sealed record (no check line at its end)",
            Unsealed::Length => "its length is not the one it records (cut off or extended)",
            Unsealed::Checksum => "its checksum does not match (altered or corrupt)",
        })
    }
}

/// The body of a sealed record, checked against its length and CRC-32.
///
/// # Errors
/// What is wrong with it.
pub fn unseal(bytes: &[u8]) -> Result<&str, Unsealed> {
    let text = std::str::from_utf8(bytes).map_err(|_| Unsealed::Checksum)?;
    let trimmed = text.strip_suffix('\n').ok_or(Unsealed::NoCheck)?;
    let start = trimmed.rfind('\n').map_or(0, |i| i + 1);
    let (body, check) = text.split_at(start);
    let check = check.trim_end_matches('\n');
    let fields = check
        .strip_prefix("check length=")
        .and_then(|rest| rest.split_once(" crc32="))
        .ok_or(Unsealed::NoCheck)?;
    let length: usize = fields.0.parse().map_err(|_| Unsealed::NoCheck)?;
    let crc = u32::from_str_radix(fields.1, 16).map_err(|_| Unsealed::NoCheck)?;
    if length != body.len() {
        return Err(Unsealed::Length);
    }
    if crc32fast::hash(body.as_bytes()) != crc {
        return Err(Unsealed::Checksum);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_record_reads_back_and_every_damage_is_named() {
        let sealed = seal("hello\nworld 42\n");
        assert_eq!(unseal(sealed.as_bytes()), Ok("hello\nworld 42\n"));
        // Cut anywhere: never accepted.
        for cut in 0..sealed.len() {
            assert!(unseal(&sealed.as_bytes()[..cut]).is_err(), "cut at {cut}");
        }
        // One byte of the body changed: the checksum says so.
        let altered = sealed.replacen("42", "41", 1);
        assert_eq!(unseal(altered.as_bytes()), Err(Unsealed::Checksum));
        // A line dropped from the body: the length says so.
        let shorter = sealed.replacen("hello\n", "", 1);
        assert_eq!(unseal(shorter.as_bytes()), Err(Unsealed::Length));
        assert_eq!(unseal(b"20"), Err(Unsealed::NoCheck));
        assert_eq!(unseal(b""), Err(Unsealed::NoCheck));
    }

    #[test]
    fn files_are_private_and_a_planted_temp_symlink_is_not_followed() {
        let dir = std::env::temp_dir().join(format!("ticketd-datadir-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let sub = dir.join("a/b");
        create_private_dir(&sub).unwrap();
        let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&sub), DIR_MODE);
        let victim = dir.join("victim");
        fs::write(&victim, "keep me").unwrap();
        let target = sub.join("f");
        std::os::unix::fs::symlink(&victim, temp_path(&target)).unwrap();
        replace_file(&target, b"new").unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "keep me");
        assert_eq!(fs::read(&target).unwrap(), b"new");
        assert_eq!(mode(&target), FILE_MODE);
        // A symlink at the file itself is refused, and named.
        let link = sub.join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = open_private(&link).unwrap_err();
        assert!(e.to_string().contains(&link.display().to_string()), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}

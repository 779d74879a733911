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
//! Only regular files are opened ([`open_regular`]): never through a
//! symlink, and with `O_NONBLOCK` until `fstat` has shown a regular file,
//! so a FIFO or device planted under a file's name is refused at once
//! (it would otherwise hang the start, or be read without end). A data
//! directory its group or other users may write to is refused
//! ([`check_dir_mode`]) unless the operator says otherwise (`--insecure`).
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
/// `path`, and refuses anything but a regular file ([`open_regular`]).
///
/// # Errors
/// The file cannot be opened or created, or is not a regular file; the
/// message names the path.
pub fn open_private(path: &Path) -> io::Result<File> {
    let created = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(SAFE_FLAGS)
        .open(path);
    match created {
        Ok(f) => {
            f.set_permissions(fs::Permissions::from_mode(FILE_MODE))
                .map_err(|e| at(path, &e))?;
            regular(path, f)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            open_regular(path, OpenOptions::new().read(true).write(true))
        }
        Err(e) => Err(explain(path, &e)),
    }
}

/// Flags every existing file in a data directory is opened with: never
/// through a symlink, never waiting for a FIFO's other end, never taking
/// a terminal as the controlling one.
const SAFE_FLAGS: i32 = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;

/// Opens `path` with `options` (their access mode and creation flags;
/// custom flags are replaced), only if it is a regular file: opened with
/// `O_NOFOLLOW | O_NONBLOCK`, checked with `fstat`, then `O_NONBLOCK` is
/// cleared. A symlink, FIFO, socket, device or directory is refused with
/// a message naming the path and what it is.
///
/// # Errors
/// The file cannot be opened or is not a regular file. A missing file
/// keeps [`io::ErrorKind::NotFound`].
pub fn open_regular(path: &Path, options: &mut OpenOptions) -> io::Result<File> {
    let file = options
        .custom_flags(SAFE_FLAGS)
        .open(path)
        .map_err(|e| explain(path, &e))?;
    regular(path, file)
}

/// `file`, opened at `path` with `O_NONBLOCK`, if `fstat` shows a regular
/// file; `O_NONBLOCK` is then cleared.
fn regular(path: &Path, file: File) -> io::Result<File> {
    use std::os::unix::io::AsRawFd;
    let kind = file.metadata().map_err(|e| at(path, &e))?.file_type();
    if !kind.is_file() {
        return Err(not_regular(path, &kind));
    }
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(at(path, &io::Error::last_os_error()));
    }
    Ok(file)
}

/// The error for a failed open of `path`: when something other than a
/// regular file is there (a symlink refused by `O_NOFOLLOW`, a FIFO
/// without a reader), says what; otherwise `e` with the path.
fn explain(path: &Path, e: &io::Error) -> io::Error {
    if matches!(
        e.kind(),
        io::ErrorKind::NotFound | io::ErrorKind::AlreadyExists
    ) {
        return at(path, e);
    }
    match fs::symlink_metadata(path) {
        Ok(m) if !m.is_file() => not_regular(path, &m.file_type()),
        _ => at(path, e),
    }
}

fn not_regular(path: &Path, kind: &fs::FileType) -> io::Error {
    use std::os::unix::fs::FileTypeExt;
    let what = if kind.is_symlink() {
        "a symbolic link"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    };
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "{} is {what}: ticketd opens only regular files in its data directory (remove it, \
             or put back the file that belongs there)",
            path.display()
        ),
    )
}

/// Reads the regular file at `path` ([`open_regular`]), at most `max + 1`
/// bytes: a longer result means the file is longer than any record that
/// belongs there (and it was not read whole). `None` when there is no
/// file.
///
/// # Errors
/// The file cannot be read or is not a regular file; the message names
/// the path.
pub fn read_regular(path: &Path, max: usize) -> io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    let file = match open_regular(path, OpenOptions::new().read(true)) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::with_capacity(max.saturating_add(1).min(1 << 16));
    file.take(u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| at(path, &e))?;
    Ok(Some(bytes))
}

/// Refuses the data directory `dir` when its group or other users may
/// write to it (as ssh's StrictModes does): they could remove or replace
/// the files that keep tokens increasing. With `insecure` it is accepted,
/// with a warning.
///
/// # Errors
/// `dir` cannot be read, or may be written by others and `insecure` is
/// off; the message names the directory, its mode and what to do.
pub fn check_dir_mode(dir: &Path, insecure: bool) -> io::Result<()> {
    let mode = fs::metadata(dir)
        .map_err(|e| at(dir, &e))?
        .permissions()
        .mode()
        & 0o7777;
    let who = match (mode & 0o020 != 0, mode & 0o002 != 0) {
        (false, false) => return Ok(()),
        (true, true) => "its group and by other users",
        (true, false) => "its group",
        (false, true) => "other users",
    };
    if insecure {
        log::warn!(
            "{} is writable by {who} (mode {mode:04o}): anyone among them could remove or \
             replace the files that keep tokens increasing; used anyway (--insecure)",
            dir.display()
        );
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "{d} is writable by {who} (mode {mode:04o}): anyone among them could remove or \
             replace the files that keep tokens increasing; refusing to use it. Make it \
             private (chmod go-w {d}) or pass --insecure to use it anyway (docs/SECURITY.md)",
            d = dir.display()
        ),
    ))
}

/// Which of `names` are present in `dir`, of whatever type (a symlink or
/// FIFO counts), in the order given.
///
/// # Errors
/// A name cannot be looked up for another reason than its absence.
pub fn present(dir: &Path, names: &[&'static str]) -> io::Result<Vec<&'static str>> {
    let mut found = Vec::new();
    for &name in names {
        let path = dir.join(name);
        match fs::symlink_metadata(&path) {
            Ok(_) => found.push(name),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(at(&path, &e)),
        }
    }
    Ok(found)
}

/// Name of the lock file inside a data directory.
pub const LOCK_FILE: &str = "lock";

/// Opens (creating it if needed) `DIR/lock` and takes an exclusive
/// `flock` on it, held while the returned file is open: two servers never
/// share one data directory.
///
/// # Errors
/// Another process holds the lock ([`io::ErrorKind::AddrInUse`]), or the
/// file cannot be opened; the message names the path.
pub fn lock_dir(dir: &Path) -> io::Result<File> {
    use std::os::unix::io::AsRawFd;
    let path = dir.join(LOCK_FILE);
    let file = open_private(&path)?;
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
        return Err(at(&path, &e));
    }
    Ok(file)
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

    fn mkfifo(path: &Path) {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    }

    /// A FIFO, a symlink (to a device or a file) or a directory under a
    /// file's name is refused at once, naming the path and what is there;
    /// a regular file opens without O_NONBLOCK left on.
    #[test]
    fn only_regular_files_are_opened_and_a_fifo_is_refused_without_blocking() {
        let dir = std::env::temp_dir().join(format!("ticketd-regular-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        create_private_dir(&dir).unwrap();
        let fifo = dir.join("fifo");
        mkfifo(&fifo);
        let zero = dir.join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let sub = dir.join("sub");
        fs::create_dir(&sub).unwrap();
        for (path, what) in [
            (&fifo, "a FIFO"),
            (&zero, "a symbolic link"),
            (&sub, "a directory"),
        ] {
            let name = path.display().to_string();
            for e in [
                open_private(path).unwrap_err(),
                read_regular(path, 16).unwrap_err(),
                open_regular(path, OpenOptions::new().write(true)).unwrap_err(),
            ] {
                let text = e.to_string();
                assert!(text.contains(&name) && text.contains(what), "{text}");
                assert!(text.contains("only regular files"), "{text}");
            }
        }
        // Nothing was created or replaced in their place.
        assert!(fs::symlink_metadata(&zero).unwrap().is_symlink());
        assert_eq!(read_regular(&dir.join("none"), 16).unwrap(), None);
        let file = dir.join("file");
        fs::write(&file, b"0123456789").unwrap();
        assert_eq!(read_regular(&file, 4).unwrap().unwrap(), b"01234");
        assert_eq!(read_regular(&file, 10).unwrap().unwrap(), b"0123456789");
        let f = open_private(&file).unwrap();
        // SAFETY: fcntl on a descriptor the test owns.
        let flags =
            unsafe { libc::fcntl(std::os::unix::io::AsRawFd::as_raw_fd(&f), libc::F_GETFL) };
        assert_eq!(flags & libc::O_NONBLOCK, 0, "O_NONBLOCK is cleared");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_others_may_write_to_is_refused_unless_insecure() {
        let dir = std::env::temp_dir().join(format!("ticketd-dirmode-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        create_private_dir(&dir).unwrap();
        let chmod = |m: u32| fs::set_permissions(&dir, fs::Permissions::from_mode(m)).unwrap();
        for ok in [0o700, 0o750, 0o755, 0o1700] {
            chmod(ok);
            check_dir_mode(&dir, false).unwrap();
        }
        for (bad, who) in [
            (0o777, "its group and by other users"),
            (0o770, "its group"),
            (0o1757, "other users"),
        ] {
            chmod(bad);
            let e = check_dir_mode(&dir, false).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
            let text = e.to_string();
            assert!(
                text.contains(&format!("writable by {who} (mode {bad:04o})")),
                "{text}"
            );
            assert!(text.contains("--insecure") && text.contains(&dir.display().to_string()));
            check_dir_mode(&dir, true).unwrap();
            assert_eq!(
                fs::metadata(&dir).unwrap().permissions().mode() & 0o7777,
                bad
            );
        }
        fs::write(dir.join("lock"), b"").unwrap();
        assert_eq!(present(&dir, &["wal", "lock"]).unwrap(), vec!["lock"]);
        fs::remove_dir_all(&dir).unwrap();
    }
}

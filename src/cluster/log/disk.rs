//! [`FileDisk`]: the WAL in one file, and the thread that syncs it.

use super::Disk;
use crate::metrics::{Histogram, FSYNC_BOUNDS_US};
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Zeros written ahead of the log's end at a time (see [`FileDisk`]).
pub const PREALLOC_BYTES: u64 = 1 << 20;

/// The WAL as one file, `DIR/wal`, written with `pwrite` + `fdatasync`. A
/// started sync runs on a thread of its own (see the module docs).
///
/// The file is kept up to [`PREALLOC_BYTES`] longer than the log, the
/// excess written as zeros: a record then overwrites blocks that already
/// belong to the file, so its `fdatasync` flushes data only, with no file
/// size or block allocation to commit to the filesystem's journal (on ext4
/// that makes each fsync cheaper and quicker). Recovery stops at the zeros
/// (no record has length 0 or kind 0) and does not count them as a
/// torn tail. Failing to write the zeros (a full disk) only loses that
/// saving.
#[derive(Debug)]
pub struct FileDisk {
    dir: PathBuf,
    /// `DIR/lock`, held with an exclusive `flock` while the disk lives: two
    /// nodes never share one data directory.
    _lock: File,
    /// Shared with the sync thread, which syncs the file it is handed.
    file: Arc<File>,
    /// Where the next record goes: the log's end.
    end: u64,
    /// The file's length; `[end, len)` holds zeros.
    len: u64,
    syncer: Option<Syncer>,
    waker: Option<Arc<mio::Waker>>,
    /// A sync was handed to the syncer and its result not yet taken.
    in_flight: bool,
    /// Bytes were appended after the in-flight sync began, so a blocking
    /// [`Disk::sync`] must not rely on it alone.
    appended_since_start: bool,
    /// How long each `fdatasync` took, in microseconds.
    fsync_us: Histogram,
}

/// `fdatasync` of `file`, and how long it took in microseconds.
fn timed_sync(file: &File) -> (io::Result<()>, u64) {
    let start = std::time::Instant::now();
    let r = file.sync_data();
    (
        r,
        u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
    )
}

/// The thread that runs `fdatasync` for [`FileDisk::start_sync`]. Each
/// request carries a handle on the WAL file it is for (compaction replaces
/// the file) and the waker to call when done; the thread sends back the
/// result and exits when the disk is dropped.
#[derive(Debug)]
struct Syncer {
    requests: std::sync::mpsc::Sender<(Arc<File>, Option<Arc<mio::Waker>>)>,
    /// Each sync's result and how long it took, in microseconds.
    results: std::sync::mpsc::Receiver<(io::Result<()>, u64)>,
}

impl Syncer {
    fn spawn() -> io::Result<Self> {
        let (requests, rx) = std::sync::mpsc::channel::<(Arc<File>, Option<Arc<mio::Waker>>)>();
        let (tx, results) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("ticketd-fsync".into())
            .spawn(move || {
                for (file, waker) in rx {
                    if tx.send(timed_sync(&file)).is_err() {
                        break;
                    }
                    if let Some(w) = waker {
                        // A failed wake only delays the report to the
                        // loop's next turn.
                        let _ = w.wake();
                    }
                }
            })?;
        Ok(Syncer { requests, results })
    }
}

/// Files of a single-mode data directory: a cluster node refuses one.
const SINGLE_MODE_FILES: [&str; 3] = ["token-mark", "token-floor", "lease-bound"];

/// Refuses a data directory that shows earlier use but has no log: `DIR/lock`
/// (created only after the log) without `DIR/wal`, or a single-mode
/// directory's files. Starting there would begin an empty log under the
/// node's old id: it could vote again in terms it voted in, and a
/// one-voter cluster would issue tokens again from the first index.
fn check_used_without_log(dir: &Path) -> io::Result<()> {
    use crate::datadir::{present, LOCK_FILE};
    let single = present(dir, &SINGLE_MODE_FILES)?;
    if !single.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} holds a single-mode server's files ({}), not a cluster node's: give the \
                 node a data directory of its own",
                dir.display(),
                single.join(", ")
            ),
        ));
    }
    if present(dir, &[LOCK_FILE])?.is_empty() || !present(dir, &["wal"])?.is_empty() {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "{} is missing, but {} shows the directory was used: refusing to start with an \
             empty log under this node's old id (it could vote twice in one term, and a \
             one-voter cluster would issue tokens below ones already issued). Restore the \
             WAL from a backup, or replace the node: a new id on a new empty --data-dir \
             (docs/CLUSTER.md, \"Runbook: replace a dead node\")",
            dir.join("wal").display(),
            dir.join(LOCK_FILE).display()
        ),
    ))
}

impl FileDisk {
    /// Opens (creating if needed) the log in `dir`, refusing a directory
    /// its group or other users may write to.
    pub fn open(dir: &Path) -> io::Result<Self> {
        Self::open_with(dir, false)
    }

    /// Opens (creating if needed) the log in `dir`, and takes the
    /// directory's lock. With `insecure`, a directory its group or other
    /// users may write to is used with a warning, not refused.
    pub fn open_with(dir: &Path, insecure: bool) -> io::Result<Self> {
        // Private (0700 / 0600 whatever the umask), never through a
        // symlink, only regular files, and every error names its path.
        crate::datadir::create_private_dir(dir)?;
        crate::datadir::check_dir_mode(dir, insecure)?;
        check_used_without_log(dir)?;
        let path = dir.join("wal");
        let file = crate::datadir::open_private(&path)?;
        // After the log: a lock file always has a log beside it.
        let lock = crate::datadir::lock_dir(dir)?;
        // Until recovery cuts it (`truncate`) the whole file counts as log.
        let len = file
            .metadata()
            .map_err(|e| crate::datadir::at(&path, &e))?
            .len();
        Ok(FileDisk {
            dir: dir.to_path_buf(),
            _lock: lock,
            file: Arc::new(file),
            end: len,
            len,
            syncer: None,
            waker: None,
            in_flight: false,
            appended_since_start: false,
            fsync_us: Histogram::new(FSYNC_BOUNDS_US),
        })
    }

    /// How long each `fdatasync` of the log took, in microseconds.
    #[must_use]
    pub fn fsync_histogram(&self) -> &Histogram {
        &self.fsync_us
    }

    fn sync_now(&mut self) -> io::Result<()> {
        let (r, us) = timed_sync(&self.file);
        self.fsync_us.observe(us);
        r
    }

    /// Has the sync thread wake the loop's poll when a sync it runs is
    /// over. Without a waker, started syncs run inline (as a blocking
    /// [`Disk::sync`]): nothing would tell the loop they finished.
    pub fn set_waker(&mut self, waker: Arc<mio::Waker>) {
        self.waker = Some(waker);
    }

    /// Writes zeros from the file's end to [`PREALLOC_BYTES`] past the
    /// log's. Errors are ignored: the zeros only make later fsyncs cheaper.
    fn preallocate(&mut self) {
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        let target = self.end + PREALLOC_BYTES;
        while self.len < target {
            let n = (target - self.len).min(ZEROS.len() as u64) as usize;
            if let Err(e) = self.file.write_all_at(&ZEROS[..n], self.len) {
                log::debug!("WAL: no space written ahead: {e}");
                return;
            }
            self.len += n as u64;
        }
    }

    /// Bytes of zeros written ahead of the log's end.
    #[must_use]
    pub fn preallocated(&self) -> u64 {
        self.len - self.end
    }

    /// Waits for the in-flight sync, if any, and returns its result.
    fn wait_in_flight(&mut self) -> io::Result<()> {
        if !self.in_flight {
            return Ok(());
        }
        self.in_flight = false;
        match self.syncer.as_ref().map(|s| s.results.recv()) {
            Some(Ok((result, us))) => {
                self.fsync_us.observe(us);
                result
            }
            // The thread is gone: sync here instead.
            _ => {
                self.syncer = None;
                self.sync_now()
            }
        }
    }
}

impl Drop for FileDisk {
    fn drop(&mut self) {
        // Let a running fdatasync finish before the descriptor goes away.
        let _ = self.wait_in_flight();
    }
}

impl Disk for FileDisk {
    fn append(&mut self, bytes: &[u8], sync: bool) -> io::Result<()> {
        self.appended_since_start |= self.in_flight;
        self.file.write_all_at(bytes, self.end)?;
        self.end += bytes.len() as u64;
        if self.end > self.len {
            self.len = self.end;
            self.preallocate();
        }
        if sync {
            self.sync()?;
        }
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        let started = self.in_flight;
        self.wait_in_flight()?;
        if !started || std::mem::take(&mut self.appended_since_start) {
            self.sync_now()?;
        }
        Ok(())
    }

    fn start_sync(&mut self) -> io::Result<()> {
        if self.in_flight {
            // One at a time: the caller polls this one first (`append`
            // notes what it will not cover).
            return Ok(());
        }
        if self.waker.is_none() {
            return self.sync_now();
        }
        if self.syncer.is_none() {
            // Without a thread (none could be started), sync inline.
            self.syncer = Syncer::spawn().ok();
        }
        let Some(syncer) = &self.syncer else {
            return self.sync_now();
        };
        let dup = Arc::clone(&self.file);
        if syncer.requests.send((dup, self.waker.clone())).is_err() {
            self.syncer = None;
            return self.sync_now();
        }
        self.in_flight = true;
        self.appended_since_start = false;
        Ok(())
    }

    fn poll_sync(&mut self) -> Option<io::Result<()>> {
        if !self.in_flight {
            return Some(Ok(()));
        }
        let r = match self.syncer.as_ref().map(|s| s.results.try_recv()) {
            Some(Ok((r, us))) => {
                self.fsync_us.observe(us);
                r
            }
            Some(Err(std::sync::mpsc::TryRecvError::Empty)) => return None,
            // The thread is gone: sync here instead.
            _ => {
                self.syncer = None;
                self.sync_now()
            }
        };
        self.in_flight = false;
        Some(r)
    }

    fn read_all(&mut self) -> io::Result<Vec<u8>> {
        let path = self.dir.join("wal");
        let mut f = crate::datadir::open_regular(&path, std::fs::OpenOptions::new().read(true))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf)
            .map_err(|e| crate::datadir::at(&path, &e))?;
        Ok(buf)
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.wait_in_flight()?;
        self.file.set_len(len)?;
        self.end = len;
        self.len = len;
        self.file.sync_all()
    }

    fn replace(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.wait_in_flight()?;
        // `wal.tmp` is created exclusively and never through a symlink.
        let path = self.dir.join("wal");
        crate::datadir::replace_file(&path, bytes)?;
        self.file = Arc::new(crate::datadir::open_private(&path)?);
        self.end = bytes.len() as u64;
        self.len = self.end;
        Ok(())
    }
}

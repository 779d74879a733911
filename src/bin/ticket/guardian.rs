//! The guardian of `ticket run`: a small process of its own that kills the
//! command's whole process group at once if `ticket` dies without standing
//! it down.
//!
//! `PR_SET_PDEATHSIG` kills only the command itself when `ticket` dies: its
//! children (a shell script's workers) would run on after the lease lapsed,
//! while another client holds the key. The guardian closes that gap.
//! `ticket` forks it before the command, and it holds the read end of a
//! pipe whose only write ends are `ticket`'s and, until its exec, the
//! command's (the pipe is close-on-exec, so nothing else inherits it):
//!
//! - the command, between fork and exec, writes `G` and its process group
//!   id (its own: it leads a new group) before it can start any child;
//! - `ticket` writes `S` ("stand down") when it is done, after its release;
//!   the guardian then exits at once;
//! - end of file without `S`: `ticket` died (by a signal, or it failed
//!   before standing down). The guardian sends SIGKILL to the command's
//!   process group and exits.
//!
//! The guardian is not in the command's group (signals `ticket` passes on,
//! and the end of the lease, do not reach it), leads a group of its own
//! (a Ctrl-C at the terminal does not reach it either) and ignores SIGINT,
//! SIGTERM and SIGHUP: it ends with `ticket`, never before. It closes every
//! other descriptor it inherited, so it keeps none of `ticket`'s
//! connections (it holds no lock) and none of its output pipes open.
//! Between fork and exit it makes only async-signal-safe calls (no
//! allocation, no lock): `ticket` has other threads.
//!
//! What still escapes: a process that leaves the group (`setsid`,
//! `setpgid`, as a daemonizing double fork does). A cgroup contains those
//! too; see "ticket run" in `docs/CLIENT.md`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// The command's process group follows (4 bytes, native order).
const GROUP: u8 = b'G';
/// `ticket` is done: exit without killing anything.
const STAND_DOWN: u8 = b'S';

/// The running guardian, seen from `ticket`.
pub struct Guardian {
    pid: libc::pid_t,
    /// The write end of the pipe; closing it without [`STAND_DOWN`] arms
    /// the kill.
    tx: Option<OwnedFd>,
}

impl Guardian {
    /// Forks the guardian.
    pub fn start() -> io::Result<Guardian> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2(2) fills the two-element array passed.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created and are owned only here.
        let (rx, tx) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: the child runs only `guard`, which makes async-signal-safe
        // calls only and never returns.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            // SAFETY: this is the forked child and `rx` the pipe's read end,
            // which is all `guard` requires; it never returns.
            0 => unsafe { guard(rx.as_raw_fd()) },
            pid => {
                drop(rx);
                Ok(Guardian { pid, tx: Some(tx) })
            }
        }
    }

    /// The write end, for the command's [`announce`] between fork and exec.
    pub fn fd(&self) -> RawFd {
        self.tx.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }

    /// `ticket` is done: the guardian exits without killing anything.
    pub fn stand_down(mut self) {
        if let Some(tx) = self.tx.take() {
            write_all(tx.as_raw_fd(), &[STAND_DOWN]);
        }
        self.reap();
    }

    /// Waits (briefly) for the guardian to exit, so it is not left behind.
    fn reap(&mut self) {
        self.tx = None;
        let end = Instant::now() + Duration::from_secs(2);
        loop {
            let mut status = 0;
            // SAFETY: waitpid(2) on our own child, writing only `status`.
            let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
            if r != 0 || Instant::now() >= end {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Guardian {
    /// Not stood down: closing the pipe tells the guardian to kill the
    /// command's group.
    fn drop(&mut self) {
        if self.tx.is_some() {
            self.reap();
        }
    }
}

/// Writes `bytes` (at most `PIPE_BUF`, so in one piece) to `fd`, ignoring
/// failure and without SIGPIPE. Async-signal-safe.
fn write_all(fd: RawFd, bytes: &[u8]) -> bool {
    // SAFETY: signal(2) and write(2) are async-signal-safe and touch no
    // memory of ours beyond `bytes`.
    unsafe {
        let old = libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        let n = loop {
            let n = libc::write(fd, bytes.as_ptr().cast(), bytes.len());
            if n >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break n;
            }
        };
        libc::signal(libc::SIGPIPE, old);
        usize::try_from(n) == Ok(bytes.len())
    }
}

/// Run by the command between fork and exec, after it took a process group
/// of its own: tells the guardian which group to kill. Async-signal-safe.
/// `false` if the guardian is gone (the command must not start unguarded).
pub fn announce(fd: RawFd) -> bool {
    // SAFETY: getpgrp(2) has no preconditions.
    let group = unsafe { libc::getpgrp() };
    let mut msg = [GROUP; 5];
    msg[1..].copy_from_slice(&group.to_ne_bytes());
    write_all(fd, &msg)
}

/// The guardian's whole life: see the module documentation.
///
/// # Safety
///
/// Only in the child of a fork, with `rx` the pipe's read end.
unsafe fn guard(rx: RawFd) -> ! {
    libc::setpgid(0, 0);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        libc::signal(sig, libc::SIG_IGN);
    }
    // The pipe becomes stdin; every other descriptor is closed.
    let rx = if rx == 0 || libc::dup2(rx, 0) == 0 {
        0
    } else {
        rx
    };
    close_from(1, rx);
    let mut buf = [0u8; 64];
    let mut have = 0;
    let mut group: libc::pid_t = 0;
    loop {
        let n = libc::read(rx, buf[have..].as_mut_ptr().cast(), buf.len() - have);
        if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        let Ok(n @ 1..) = usize::try_from(n) else {
            break; // End of file (or a broken pipe): `ticket` is gone.
        };
        have += n;
        let mut used = 0;
        while used < have {
            match buf[used] {
                STAND_DOWN => libc::_exit(0),
                GROUP if have - used >= 5 => {
                    let mut id = [0u8; 4];
                    id.copy_from_slice(&buf[used + 1..used + 5]);
                    group = libc::pid_t::from_ne_bytes(id);
                    used += 5;
                }
                GROUP => break,
                _ => used += 1,
            }
        }
        buf.copy_within(used..have, 0);
        have -= used;
    }
    if group > 1 {
        libc::kill(-group, libc::SIGKILL);
    }
    libc::_exit(0)
}

/// Closes every descriptor from `first` on, except `keep`.
///
/// # Safety
///
/// Only where nothing else uses those descriptors (the guardian).
unsafe fn close_from(first: RawFd, keep: RawFd) {
    let from = first.unsigned_abs();
    if keep < first && libc::syscall(libc::SYS_close_range, from, u32::MAX, 0) == 0 {
        return;
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    let top = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
        lim.rlim_cur.min(1 << 16)
    } else {
        1024
    };
    let top = RawFd::try_from(top).unwrap_or(1024);
    for fd in first..top {
        if fd != keep {
            libc::close(fd);
        }
    }
}

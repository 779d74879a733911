//! Unix-domain listeners: `--listen unix:/path`, `--socket-mode`, and the
//! peer-credential check of `--allow-uid` / `--allow-gid` at accept.
//!
//! A socket file left by a crash is replaced: a connect to it is refused,
//! so no server is behind it. A live one (the connect succeeds) is not, and
//! neither is a path that is not a socket. The file is removed when the
//! server stops, if it is still the one this server made.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use mio::net::UnixListener;

/// A bound Unix-domain listener and the file it made.
#[derive(Debug)]
pub(crate) struct UnixListen {
    pub(crate) listener: UnixListener,
    pub(crate) path: PathBuf,
    /// The socket file's inode, to remove only our own at the end.
    ino: u64,
}

/// Binds `path` with permissions `mode`, replacing a stale socket file.
///
/// # Errors
/// The path is a live socket, is not a socket, or cannot be bound; every
/// message names the path.
pub(crate) fn bind(path: &Path, mode: u32) -> io::Result<UnixListen> {
    let at = |e: io::Error, what: &str| {
        io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!(
                        "{} is the socket of a server that is running (a connect to it \
                         succeeds); not replaced",
                        path.display()
                    ),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                log::info!(
                    "{}: replacing a stale socket file (nothing listens on it)",
                    path.display()
                );
                std::fs::remove_file(path).map_err(|e| at(e, "cannot remove the stale socket"))?;
            }
            Err(e) => return Err(at(e, "cannot tell whether a server is behind")),
        },
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket; not replaced",
                    path.display()
                ),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(at(e, "cannot look at")),
    }
    let listener = UnixListener::bind(path).map_err(|e| at(e, "cannot bind"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| at(e, "cannot set the mode of"))?;
    let ino = std::fs::symlink_metadata(path)
        .map_err(|e| at(e, "cannot look at"))?
        .ino();
    Ok(UnixListen {
        listener,
        path: path.to_path_buf(),
        ino,
    })
}

impl Drop for UnixListen {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.ino);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The credentials (uid, gid, pid) of the process at the other end of a
/// connected Unix socket, as the kernel recorded them at connect.
///
/// # Errors
/// `getsockopt(SO_PEERCRED)` failed.
pub(crate) fn peer_cred(sock: &impl AsRawFd) -> io::Result<(u32, u32, i32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a valid ucred and `len` its size, as SO_PEERCRED wants.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.uid, cred.gid, cred.pid))
}

/// Whether a peer with `uid` and `gid` may connect: anyone the socket's
/// mode lets in when no list is given, else a listed uid or gid.
#[must_use]
pub(crate) fn allowed(uid: u32, gid: u32, uids: &[u32], gids: &[u32]) -> bool {
    (uids.is_empty() && gids.is_empty()) || uids.contains(&uid) || gids.contains(&gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_lists() {
        assert!(allowed(5, 6, &[], &[]));
        assert!(allowed(5, 6, &[5], &[]));
        assert!(!allowed(5, 6, &[7], &[]));
        assert!(allowed(5, 6, &[7], &[6]));
        assert!(!allowed(5, 6, &[], &[7]));
    }

    #[test]
    fn a_stale_socket_is_replaced_a_live_one_and_a_file_are_not() {
        let dir = std::env::temp_dir().join(format!("ticketd-unix-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        // Stale: bound, then the listener dropped without removing it.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let l = bind(&path, 0o600).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let (uid, _, pid) = {
            let c = std::os::unix::net::UnixStream::connect(&path).unwrap();
            let (s, _) = l.listener.accept().unwrap();
            drop(c);
            peer_cred(&s).unwrap()
        };
        // SAFETY: geteuid(2) has no preconditions and always succeeds.
        assert_eq!(uid, unsafe { libc::geteuid() });
        assert_eq!(pid, std::process::id() as i32);
        let e = bind(&path, 0o600).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        drop(l);
        assert!(!path.exists(), "removed at the end");
        std::fs::write(&path, "not a socket").unwrap();
        let e = bind(&path, 0o600).unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert!(path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

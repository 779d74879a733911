//! systemd integration, without a crate: the notify protocol (a datagram
//! of `KEY=VALUE` lines to the unix socket named by `$NOTIFY_SOCKET`) and
//! socket activation (`$LISTEN_FDS` descriptors from 3, for `$LISTEN_PID`).
//!
//! The loop sends `READY=1` once it serves (cluster mode: once a leader is
//! known), `STOPPING=1` when a shutdown begins, and `WATCHDOG=1` every half
//! `$WATCHDOG_USEC` while it turns, so a loop that stops turning is
//! restarted by systemd. A failed send is logged once and never stops the
//! server.

use std::io;
use std::os::fd::RawFd;
use std::os::unix::net::UnixDatagram;

use crate::time::Millis;

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
pub const LISTEN_FDS_START: RawFd = 3;

/// Where notifications go, and the watchdog period.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    path: String,
    /// Half of `$WATCHDOG_USEC`, in ms, when the watchdog is on.
    watchdog_ms: Option<u64>,
    next_watchdog: Millis,
    ready_sent: bool,
    failed: bool,
}

impl Notifier {
    /// A notifier for `$NOTIFY_SOCKET`, when it is set (and the watchdog
    /// from `$WATCHDOG_USEC`, when it is set for this process).
    #[must_use]
    pub fn from_env() -> Option<Notifier> {
        let path = std::env::var("NOTIFY_SOCKET")
            .ok()
            .filter(|p| !p.is_empty())?;
        let pid_ok = std::env::var("WATCHDOG_PID")
            .ok()
            .is_none_or(|p| p.parse::<u32>().ok() == Some(std::process::id()));
        let watchdog_ms = std::env::var("WATCHDOG_USEC")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&us| us > 0 && pid_ok)
            .map(|us| (us / 2000).max(1));
        match UnixDatagram::unbound() {
            Ok(socket) => Some(Notifier {
                socket,
                path,
                watchdog_ms,
                next_watchdog: Millis::ZERO,
                ready_sent: false,
                failed: false,
            }),
            Err(e) => {
                log::warn!("cannot notify systemd: no datagram socket: {e}");
                None
            }
        }
    }

    /// Sends one notification (`READY=1`, ...).
    pub fn send(&mut self, state: &str) {
        if let Err(e) = send_to(&self.socket, &self.path, state.as_bytes()) {
            if !self.failed {
                log::warn!("cannot notify systemd at {}: {e}", self.path);
                self.failed = true;
            }
        }
    }

    /// `READY=1`, once, when `ready`.
    pub fn ready(&mut self, ready: bool) {
        if ready && !self.ready_sent {
            self.ready_sent = true;
            self.send("READY=1");
            log::info!("told systemd the server is ready");
        }
    }

    /// `WATCHDOG=1` when due.
    pub fn watchdog(&mut self, now: Millis) {
        if let Some(period) = self.watchdog_ms {
            if now >= self.next_watchdog {
                self.next_watchdog = now.add_ms(period);
                self.send("WATCHDOG=1");
            }
        }
    }

    /// When the loop must turn next for the watchdog.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Millis> {
        self.watchdog_ms.map(|_| self.next_watchdog)
    }
}

fn send_to(socket: &UnixDatagram, path: &str, msg: &[u8]) -> io::Result<usize> {
    #[cfg(target_os = "linux")]
    if let Some(name) = path.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        return socket.send_to_addr(msg, &addr);
    }
    socket.send_to(msg, path)
}

/// The first socket systemd passed this process (`$LISTEN_FDS` ≥ 1 and
/// `$LISTEN_PID` this process), for the client listener.
#[must_use]
pub fn listen_fd() -> Option<RawFd> {
    let pid: u32 = std::env::var("LISTEN_PID").ok()?.parse().ok()?;
    let fds: u32 = std::env::var("LISTEN_FDS").ok()?.parse().ok()?;
    (pid == std::process::id() && fds >= 1).then_some(LISTEN_FDS_START)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notification_is_one_datagram_on_the_socket() {
        let dir = std::env::temp_dir().join(format!("ticketd-notify-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify");
        let rx = UnixDatagram::bind(&path).unwrap();
        let mut n = Notifier {
            socket: UnixDatagram::unbound().unwrap(),
            path: path.display().to_string(),
            watchdog_ms: Some(100),
            next_watchdog: Millis::ZERO,
            ready_sent: false,
            failed: false,
        };
        n.ready(false);
        n.ready(true);
        n.ready(true);
        n.watchdog(Millis(5));
        n.watchdog(Millis(50));
        assert_eq!(n.next_deadline(), Some(Millis(105)));
        let mut buf = [0u8; 64];
        rx.set_nonblocking(true).unwrap();
        let mut got = Vec::new();
        while let Ok(len) = rx.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..len]).into_owned());
        }
        assert_eq!(got, ["READY=1", "WATCHDOG=1"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

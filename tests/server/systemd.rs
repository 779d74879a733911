//! systemd integration of the real `ticketd` binary: a test-owned unix
//! datagram socket stands in for systemd's notify socket (READY=1,
//! WATCHDOG=1, STOPPING=1), and a listening socket passed as descriptor 3
//! with LISTEN_FDS / LISTEN_PID stands in for socket activation.

use ticketd_testkit::process as common;

use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Reply, Ticketd};

fn tmp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ticketd-systemd-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The next datagram within `timeout`.
fn recv(sock: &UnixDatagram, timeout: Duration) -> Option<String> {
    sock.set_read_timeout(Some(timeout)).unwrap();
    let mut buf = [0u8; 256];
    let n = sock.recv(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[test]
fn the_notify_socket_gets_ready_watchdog_and_stopping() {
    let dir = tmp_dir("notify");
    let path = dir.join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    let env_notify = format!("NOTIFY_SOCKET={}", path.display());
    let mut t = Ticketd::start_raw(
        &["env", &env_notify, "WATCHDOG_USEC=200000"],
        &["--listen", "127.0.0.1:0"],
    );
    assert_eq!(
        recv(&sock, Duration::from_secs(10)).as_deref(),
        Some("READY=1")
    );
    // The server is serving by then.
    let mut c = t.connect();
    assert!(matches!(
        c.acquire_reply("k", 1, 0, 5),
        Reply::Acquired { .. }
    ));
    // Every 100 ms (half of WATCHDOG_USEC), while the loop turns.
    let start = Instant::now();
    for _ in 0..3 {
        assert_eq!(
            recv(&sock, Duration::from_secs(5)).as_deref(),
            Some("WATCHDOG=1")
        );
    }
    assert!(
        start.elapsed() >= Duration::from_millis(150),
        "{:?}",
        start.elapsed()
    );
    t.signal(libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = recv(&sock, Duration::from_secs(10)).expect("STOPPING=1 before exit");
        if m == "STOPPING=1" {
            break;
        }
        assert_eq!(m, "WATCHDOG=1");
        assert!(Instant::now() < deadline);
    }
    t.wait_exit(Duration::from_secs(10))
        .expect("stops on SIGTERM");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn socket_activation_serves_on_the_passed_descriptor() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let fd = listener.as_raw_fd();
    // `sh` exports its own pid, which `exec` hands to ticketd unchanged.
    let mut cmd = common::bin_command(common::ticketd_bin());
    let inner: Vec<String> = std::iter::once(cmd.get_program().to_string_lossy().into_owned())
        .chain(cmd.get_args().map(|a| a.to_string_lossy().into_owned()))
        .collect();
    cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("export LISTEN_PID=$$ LISTEN_FDS=1; exec \"$@\"")
        .arg("sh")
        .args(&inner)
        .args(["--listen", "127.0.0.1:1"]);
    // SAFETY: dup2 and fcntl are async-signal-safe; the child gets the
    // listener as descriptor 3, without close-on-exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let flags = libc::fcntl(3, libc::F_GETFD);
            libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            Ok(())
        });
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(listener);
    // The requests queue in the passed socket's backlog until the server
    // takes them; it never bound 127.0.0.1:1.
    let mut c = common::Client::connect(addr);
    let r = c.acquire_reply("activated", 1, 0, 5);
    assert!(matches!(r, Reply::Acquired { .. }), "{r:?}");
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains(&format!("listening on {addr}")), "{log}");
}

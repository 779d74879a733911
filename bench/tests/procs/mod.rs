//! Real processes for the benchmark tests: the `ticketd` binary of this
//! workspace (`ticketd_testkit::process::ticketd_bin`: beside this test
//! binary, built first when missing) and this member's own programs.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The `ticketd` binary of this workspace, found (and built when missing)
/// the way every member's tests find it.
pub use ticketd_testkit::process::ticketd_bin;

/// A running `ticketd --listen 127.0.0.1:0 ARGS...`; killed when dropped.
pub struct Ticketd {
    child: Child,
    addr: SocketAddr,
}

impl Ticketd {
    /// Starts the server and waits (10 s at most) for its start-up line.
    pub fn start(args: &[&str]) -> Ticketd {
        let mut child = Command::new(ticketd_bin())
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ticketd");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&log);
        // Keeps reading, so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut r = BufReader::new(stderr);
            let mut line = String::new();
            while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                sink.lock().unwrap().push_str(&line);
                line.clear();
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = log.lock().unwrap().clone();
            if let Some(addr) = text.find("listening on ").and_then(|at| {
                text[at + "listening on ".len()..]
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            }) {
                return Ticketd { child, addr };
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("ticketd exited ({status}) before listening:\n{text}");
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("ticketd printed no start-up line:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Ticketd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub use ticketd_testkit::process::finish;

/// Runs `bin ARGS...` with `envs` to its end (at most `limit`); its output.
pub fn run(bin: &str, args: &[&str], envs: &[(&str, String)], limit: Duration) -> Output {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    finish(cmd.spawn().expect("start the program"), limit)
}

/// The number right after `prefix` in `text`.
pub fn number_after(text: &str, prefix: &str) -> u64 {
    let at = text
        .find(prefix)
        .unwrap_or_else(|| panic!("{prefix:?} not in:\n{text}"));
    let digits: String = text[at + prefix.len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after {prefix:?} in:\n{text}"))
}

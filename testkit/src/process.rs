//! Shared harness for tests that run the real `ticketd` binary.
//!
//! * [`Ticketd::start`] spawns `ticketd --listen 127.0.0.1:0 ARGS...`, reads
//!   the bound address from its start-up log line, keeps collecting its
//!   stderr (so the server never blocks on a full pipe), and kills it on drop.
//! * [`Client`] speaks raw frames over one TCP connection:
//!   [`Client::acquire`] / [`Client::release`] send, [`Client::recv`] reads
//!   one reply decoded with `ticketd::proto`.
//! * [`free_port`] picks a loopback port for a server a test starts itself.
//! * [`bin_command`] is how every test starts a binary Cargo built, so that
//!   a cross-built test run (`make cross-check`) starts it under the same
//!   emulator as the tests: `TICKETD_TEST_RUNNER="qemu-aarch64-static"` puts
//!   that command (split at spaces) in front of the binary.
//!
//! Tests reach it as `ticketd_testkit::process` (usually `use
//! ticketd_testkit::process as common;`).

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ticketd::proto::{self, Decoded, Places, Request};

/// Path of the `ticketd` binary of this workspace (see [`workspace_bin`]),
/// or `$TICKETD_BIN` when set.
#[must_use]
pub fn ticketd_bin() -> PathBuf {
    match std::env::var_os("TICKETD_BIN") {
        Some(p) => PathBuf::from(p),
        None => workspace_bin("ticketd"),
    }
}

/// Path of the `ticket` command of this workspace (see [`workspace_bin`]).
#[must_use]
pub fn ticket_bin() -> PathBuf {
    workspace_bin("ticket")
}

/// Path of the `ticketd` package's binary `name`, beside the running test
/// binary (`target/<profile>/deps/NAME-HASH` -> `target/<profile>/NAME`,
/// also under a cross target's directory). Cargo builds it before the
/// `ticketd` package's integration tests; a test of another member run
/// alone may find it missing, and then builds it first.
///
/// # Panics
///
/// If the binary is missing and `cargo build -p ticketd --bin NAME` fails.
#[must_use]
pub fn workspace_bin(name: &str) -> PathBuf {
    let path = profile_dir().join(name);
    let _one_build_at_a_time = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    if !path.is_file() {
        cargo_build(&["--bin", name]);
    }
    path
}

/// Path of the `ticketd` package's example `name`
/// (`target/<profile>/examples/NAME`), built with `cargo build --example
/// NAME --no-default-features --features FEATURES` on its first use in
/// this process: Cargo does not build examples for every test run, and one
/// left in `target/` by an earlier build may be older than its source. When
/// it is fresh the build is a no-op. `features` should be those of the test
/// binary's own `ticketd` build, so that the library is not built again.
///
/// # Panics
///
/// If `cargo build` fails.
#[must_use]
pub fn workspace_example(name: &str, features: &[&str]) -> PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !built.iter().any(|b| b == name) {
        let _one_build_at_a_time = BUILD.lock().unwrap_or_else(|e| e.into_inner());
        let features = features.join(",");
        cargo_build(&[
            "--example",
            name,
            "--no-default-features",
            "--features",
            &features,
        ]);
        built.push(name.to_owned());
    }
    profile_dir().join("examples").join(name)
}

/// Held while this process runs `cargo build`.
static BUILD: Mutex<()> = Mutex::new(());

/// The running test binary's profile directory (`target/<profile>`, also
/// under a cross target's directory).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test binary");
    exe.parent()
        .and_then(|d| d.parent())
        .expect("target profile directory")
        .to_path_buf()
}

/// `cargo build -p ticketd ARGS...` (`--release` from a release test build),
/// in the workspace.
fn cargo_build(args: &[&str]) {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args(["build", "--quiet", "-p", "ticketd"]).args(args);
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    let status = cmd
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run cargo build -p ticketd");
    assert!(
        status.success(),
        "cargo build -p ticketd {}: {status}",
        args.join(" ")
    );
}

/// A `Command` that starts the binary at `bin`: directly, or behind the
/// runner named by `TICKETD_TEST_RUNNER` when the tests were built for
/// another architecture and run under an emulator (`qemu-aarch64-static`).
/// Cargo's own `CARGO_TARGET_<TRIPLE>_RUNNER` only wraps the test binary;
/// the binaries a test starts need the same wrapper.
#[must_use]
pub fn bin_command(bin: impl AsRef<std::ffi::OsStr>) -> Command {
    let runner = std::env::var("TICKETD_TEST_RUNNER").unwrap_or_default();
    let mut words = runner.split_whitespace();
    match words.next() {
        Some(prog) => {
            let mut c = Command::new(prog);
            c.args(words).arg(bin.as_ref());
            c
        }
        None => Command::new(bin.as_ref()),
    }
}

/// Lets this test process open a few thousand sockets (its soft descriptor
/// limit raised to 8192, or to the hard limit when that is lower).
///
/// # Panics
///
/// If the limit cannot be read or set.
pub fn raise_own_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read or write only the struct passed.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max.min(8192);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
}

/// Waits for `child` (its output piped) at most `limit`, killing it past
/// that; its output.
///
/// # Panics
///
/// If it runs past `limit`, with both of its streams.
pub fn finish(mut child: Child, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().expect("wait for the program").is_some() {
            return child.wait_with_output().expect("program output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("program output");
            panic!(
                "program ran past {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `ticketd ARGS...` to completion (for `--help`, bad flags...).
#[must_use]
pub fn run_ticketd(args: &[&str]) -> Output {
    bin_command(ticketd_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run ticketd")
}

/// A running `ticketd` child process; killed when dropped.
pub struct Ticketd {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<String>>,
}

impl Ticketd {
    /// Starts `ticketd --listen 127.0.0.1:0 ARGS...` and waits for its
    /// start-up line. Do not pass `--listen` in `args` (see [`Ticketd::start_raw`]).
    #[must_use]
    pub fn start(args: &[&str]) -> Ticketd {
        let mut all = vec!["--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        Ticketd::start_raw(&[], &all)
    }

    /// Starts `WRAPPER... ticketd ARGS...` exactly as given (no `--listen`
    /// added). `wrapper` is a command that execs the rest, like
    /// `["prlimit", "--nofile=64:64"]`, or empty. Panics with the server's
    /// log if it exits or prints no start-up line within 10 s.
    #[must_use]
    pub fn start_raw(wrapper: &[&str], args: &[&str]) -> Ticketd {
        let bin = ticketd_bin();
        let mut cmd = match wrapper.split_first() {
            Some((prog, rest)) => {
                // The wrapper execs what follows: the runner, if any, then
                // the binary.
                let inner = bin_command(&bin);
                let mut c = Command::new(prog);
                c.args(rest).arg(inner.get_program()).args(inner.get_args());
                c
            }
            None => bin_command(&bin),
        };
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn ticketd");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&log);
        let reader = std::thread::spawn(move || {
            let mut r = BufReader::new(stderr);
            let mut line = String::new();
            while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                sink.lock().unwrap().push_str(&line);
                line.clear();
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = parse_listen_line(&log.lock().unwrap());
            if let Some(addr) = found {
                return Ticketd { child, addr, log };
            }
            if let Ok(Some(status)) = child.try_wait() {
                // It may have printed the line and exited (a node told at
                // once that it must stop) before the reader thread caught
                // up: read its stderr to the end before deciding.
                let _ = reader.join();
                let log_now = log.lock().unwrap().clone();
                if let Some(addr) = parse_listen_line(&log_now) {
                    return Ticketd { child, addr, log };
                }
                panic!("ticketd exited ({status}) before listening:\n{log_now}");
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("ticketd printed no start-up line:\n{}", log.lock().unwrap());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The address the server listens on.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A new raw client connection.
    #[must_use]
    pub fn connect(&self) -> Client {
        Client::connect(self.addr)
    }

    /// The admin port's TCP address, from the start-up log (`admin port
    /// (HTTP) on ADDR`); `None` without one.
    #[must_use]
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        let log = self.log();
        let at = log.find("admin port (HTTP) on ")? + "admin port (HTTP) on ".len();
        log[at..].split_whitespace().next()?.parse().ok()
    }

    /// Everything the server logged so far.
    #[must_use]
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits until the log contains `needle`; false on timeout.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.log().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.log().contains(needle)
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`) to the server.
    pub fn signal(&self, signal: i32) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid fits");
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "kill({pid}, {signal}) failed");
    }

    /// Waits up to `timeout` for the server to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then waits up to 10 s for the exit; panics if it hangs.
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait_exit(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("ticketd did not exit after SIGTERM:\n{}", self.log()))
    }

    /// Resident memory of the server in KiB (`VmRSS` in /proc/PID/status).
    #[must_use]
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("read /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS line")
    }

    /// CPU time the server used so far (user + system), in clock ticks.
    #[must_use]
    pub fn cpu_ticks(&self) -> u64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).expect("read /proc stat");
        // Fields after the parenthesised command name; utime and stime are
        // the 14th and 15th fields of the whole line.
        let rest = &stat[stat.rfind(')').expect("comm") + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }
}

impl Drop for Ticketd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Finds `listening on ADDR` in the log.
#[must_use]
pub fn parse_listen_line(log: &str) -> Option<SocketAddr> {
    let rest = &log[log.find("listening on ")? + "listening on ".len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// An owned reply, for assertions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `A token owner key`
    Acquired {
        /// Fencing token.
        token: u64,
        /// Echoed owner.
        owner: u64,
        /// Key.
        key: String,
    },
    /// `T owner key`
    Timeout {
        /// Echoed owner.
        owner: u64,
        /// Key.
        key: String,
    },
    /// `B owner key`
    Busy {
        /// Echoed owner.
        owner: u64,
        /// Key.
        key: String,
    },
    /// `R token key`
    Released {
        /// Token.
        token: u64,
        /// Key.
        key: String,
    },
    /// `N token key`
    NotReleased {
        /// Token.
        token: u64,
        /// Key.
        key: String,
    },
    /// `E token key`
    Extended {
        /// Token.
        token: u64,
        /// Key.
        key: String,
    },
    /// `X token key`
    NotExtended {
        /// Token.
        token: u64,
        /// Key.
        key: String,
    },
    /// `L owner limit key` (protocol 1.2)
    LimitMismatch {
        /// Echoed owner.
        owner: u64,
        /// The limit the key is registered with.
        limit: u16,
        /// Key.
        key: String,
    },
}

impl Reply {
    /// The token of an `Acquired` reply; panics on any other.
    #[must_use]
    pub fn token(&self) -> u64 {
        match self {
            Reply::Acquired { token, .. } => *token,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }
}

impl From<proto::Reply<'_>> for Reply {
    fn from(r: proto::Reply<'_>) -> Self {
        match r {
            proto::Reply::Acquired { token, owner, key } => Reply::Acquired {
                token,
                owner,
                key: key.into(),
            },
            proto::Reply::Timeout { owner, key } => Reply::Timeout {
                owner,
                key: key.into(),
            },
            proto::Reply::Busy { owner, key } => Reply::Busy {
                owner,
                key: key.into(),
            },
            proto::Reply::Released { token, key } => Reply::Released {
                token,
                key: key.into(),
            },
            proto::Reply::NotReleased { token, key } => Reply::NotReleased {
                token,
                key: key.into(),
            },
            proto::Reply::Extended { token, key } => Reply::Extended {
                token,
                key: key.into(),
            },
            proto::Reply::NotExtended { token, key } => Reply::NotExtended {
                token,
                key: key.into(),
            },
            proto::Reply::LimitMismatch { owner, limit, key } => Reply::LimitMismatch {
                owner,
                limit,
                key: key.into(),
            },
        }
    }
}

/// The bytes of an acquire frame.
#[must_use]
pub fn acquire_frame(key: &str, owner: u64, wait_s: u8, lease_s: u8) -> Vec<u8> {
    let mut v = Vec::new();
    proto::encode_request(
        &Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
        },
        &mut v,
    );
    v
}

/// The bytes of an acquire with a limit (protocol 1.2): one of `places`
/// of `key` (`places.limit` and `places.mode`).
#[must_use]
pub fn permit_frame(key: &str, owner: u64, places: Places, wait_s: u8, lease_s: u8) -> Vec<u8> {
    let mut v = Vec::new();
    let Places { limit, mode } = places;
    proto::encode_request(
        &Request::AcquireWithLimit {
            wait_s,
            lease_s,
            owner,
            limit,
            mode,
            key,
        },
        &mut v,
    );
    v
}

/// The bytes of a release frame.
#[must_use]
pub fn release_frame(key: &str, token: u64) -> Vec<u8> {
    let mut v = Vec::new();
    proto::encode_request(&Request::Release { token, key }, &mut v);
    v
}

/// The bytes of an extend frame.
#[must_use]
pub fn extend_frame(key: &str, token: u64, lease_s: u8) -> Vec<u8> {
    let mut v = Vec::new();
    proto::encode_request(
        &Request::Extend {
            lease_s,
            token,
            key,
        },
        &mut v,
    );
    v
}

/// How a read for a reply ended without one.
#[derive(Debug, PartialEq, Eq)]
pub enum NoReply {
    /// Nothing arrived in time.
    TimedOut,
    /// The server closed the connection (EOF or reset).
    Closed,
}

/// One raw client connection.
pub struct Client {
    /// The socket, for tests that need it directly.
    pub stream: TcpStream,
    buf: Vec<u8>,
}

/// Key limit used to decode replies: the protocol's ceiling.
const DECODE_MAX_KEY: usize = 64 * 1024;

impl Client {
    /// Connects to `addr` (panics on failure).
    #[must_use]
    pub fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).expect("connect to ticketd");
        stream.set_nodelay(true).unwrap();
        Client {
            stream,
            buf: Vec::new(),
        }
    }

    /// Connects to `addr` from the local address `from` (port 0), so a
    /// test on loopback can be a second source address (`127.0.0.2`);
    /// `None` when the connection fails.
    #[must_use]
    pub fn connect_from(from: std::net::IpAddr, addr: SocketAddr) -> Option<Client> {
        let domain = socket2::Domain::for_address(addr);
        let s = socket2::Socket::new(domain, socket2::Type::STREAM, None).ok()?;
        s.bind(&SocketAddr::new(from, 0).into()).ok()?;
        s.connect(&addr.into()).ok()?;
        let stream: TcpStream = s.into();
        stream.set_nodelay(true).ok()?;
        Some(Client {
            stream,
            buf: Vec::new(),
        })
    }

    /// Writes raw bytes.
    pub fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send to ticketd");
    }

    /// Sends an acquire.
    pub fn acquire(&mut self, key: &str, owner: u64, wait_s: u8, lease_s: u8) {
        self.send(&acquire_frame(key, owner, wait_s, lease_s));
    }

    /// Sends a release.
    pub fn release(&mut self, key: &str, token: u64) {
        self.send(&release_frame(key, token));
    }

    /// Sends an extend.
    pub fn extend(&mut self, key: &str, token: u64, lease_s: u8) {
        self.send(&extend_frame(key, token, lease_s));
    }

    /// Sends an extend and reads one reply.
    pub fn extend_reply(&mut self, key: &str, token: u64, lease_s: u8) -> Reply {
        self.extend(key, token, lease_s);
        self.recv()
    }

    /// Reads one reply within 5 s; panics otherwise.
    pub fn recv(&mut self) -> Reply {
        match self.try_recv(Duration::from_secs(5)) {
            Ok(r) => r,
            Err(e) => panic!("no reply from ticketd: {e:?}"),
        }
    }

    /// Reads one reply within `timeout`.
    pub fn try_recv(&mut self, timeout: Duration) -> Result<Reply, NoReply> {
        let deadline = Instant::now() + timeout;
        loop {
            match proto::decode_reply(&self.buf, DECODE_MAX_KEY) {
                Decoded::Frame { frame, used } => {
                    let r = Reply::from(frame);
                    self.buf.drain(..used);
                    return Ok(r);
                }
                Decoded::Malformed(m) => panic!("server sent a malformed reply: {m}"),
                Decoded::Incomplete => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(NoReply::TimedOut);
            }
            self.stream.set_read_timeout(Some(left)).unwrap();
            let mut chunk = [0u8; 64 * 1024];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(NoReply::Closed),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(NoReply::TimedOut)
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Err(NoReply::Closed),
            }
        }
    }

    /// Reads `n` replies.
    pub fn recv_n(&mut self, n: usize) -> Vec<Reply> {
        (0..n).map(|_| self.recv()).collect()
    }

    /// Sends an acquire and reads one reply.
    pub fn acquire_reply(&mut self, key: &str, owner: u64, wait_s: u8, lease_s: u8) -> Reply {
        self.acquire(key, owner, wait_s, lease_s);
        self.recv()
    }

    /// Sends a release and reads one reply.
    pub fn release_reply(&mut self, key: &str, token: u64) -> Reply {
        self.release(key, token);
        self.recv()
    }

    /// True when the server closes the connection within `timeout` without
    /// sending another reply first.
    pub fn closed_within(&mut self, timeout: Duration) -> bool {
        matches!(self.try_recv(timeout), Err(NoReply::Closed))
    }
}

/// A loopback port that is free now, for a server the test is about to
/// start: the benchmarks' picker (`ticketd_bench::free_loopback_port`,
/// below the kernel's ephemeral range, one process's picks kept apart),
/// so that tests and benchmarks pick ports one way.
///
/// # Panics
///
/// If no port in its range is free.
#[must_use]
pub fn free_port() -> u16 {
    ticketd_bench::free_loopback_port().unwrap_or_else(|e| panic!("{e}"))
}

/// One HTTP/1.1 exchange with an admin port over TCP: status and body;
/// `None` when the connection is refused or reset, or the answer is not
/// HTTP with a body of its `Content-Length`.
#[must_use]
pub fn http(addr: SocketAddr, method: &str, target: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "{method} {target} HTTP/1.1\r\nHost: test\r\n\r\n").ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    parse_http(&String::from_utf8(raw).ok()?)
}

/// Status and body of a whole HTTP/1.1 response.
#[must_use]
pub fn parse_http(text: &str) -> Option<(u16, String)> {
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))?
        .parse()
        .ok()?;
    (body.len() == len).then(|| (status, body.to_string()))
}

/// The value of an unlabelled sample `name` in a Prometheus text
/// exposition.
#[must_use]
pub fn metric(exposition: &str, name: &str) -> Option<f64> {
    exposition.lines().find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}

/// A fresh scratch directory for a test's Unix sockets, readable by every
/// uid (so clients run under other uids can reach the sockets in it).
#[must_use]
pub fn socket_dir(name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("ticketd-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// Runs `ticket ARGS` as uid and gid `uid` (with `setpriv`, which needs
/// root; 0: as this process).
#[must_use]
pub fn ticket_as(uid: u32, args: &[&str]) -> Output {
    let mut cmd = if uid == 0 {
        bin_command(ticket_bin())
    } else {
        let mut c = Command::new("setpriv");
        c.args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
        ])
        .arg(ticket_bin());
        c
    };
    cmd.args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run ticket")
}

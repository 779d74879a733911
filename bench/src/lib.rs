//! `ticket-bench`: a load generator for ticketd and, for comparison, Redis.
//!
//! Like `redis-benchmark`: many connections, a pipeline depth, a key space and
//! a workload, for a fixed time or a fixed number of requests. It prints
//! requests/s, grants/s and latency percentiles; for the contended workload
//! also the time from asking to being granted, and a FIFO check of ticketd's
//! hand-over order. The same code drives every service: only the
//! [`backend::Backend`] differs. `docs/BENCHMARKS.md` describes the method.
//!
//! The generator is synchronous: one `mio` loop per thread (one thread by
//! default), so it can drive hundreds of pipelined connections from one core
//! and leave the other core to the server under test.

pub mod backend;
pub mod cluster_limit;
mod conn;
pub mod etcd;
pub mod gen;
pub mod hist;
pub mod limit;
pub mod resp;
pub mod tls;

use std::fmt::Write as _;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend::{Backend, Ticketd};
use gen::{Config, Keys, Mode, Renew, Shared, Stats};

const USAGE: &str = "\
usage: ticket-bench [FLAGS]

  --server ADDR[,ADDR]  server address (default 127.0.0.1:7470 for ticketd,
                        127.0.0.1:6379 for redis, 127.0.0.1:2379 for etcd);
                        ticketd takes a cluster's nodes separated by commas,
                        connection i going to node i mod the count;
                        unix:/PATH dials a Unix-domain stream socket
                        (ticketd --listen unix:, redis --unixsocket; no TLS)
  --backend NAME        ticketd | redis | etcd (default ticketd; etcd through
                        its v3 HTTP gateway, one locker per connection, depth 1)
  --connections N       connections (default 50)
  --depth N             requests in flight per connection, 1..=256 (default 1;
                        not for extend, which has --locks)
  --keys SPEC           uncontended | hot:N (default uncontended;
                        hot:10 for --mode contended)
  --mode MODE           acquire | cycle | contended | extend | extend-flood
                        (default cycle). extend (ticketd only): --locks held
                        locks, one key each, acquired once, then each extended
                        every lease/3; extend-flood: one lock per slot
                        (connections x depth), extended again as soon as each
                        extend is answered. Any X (not extended) fails the run
  --locks N             extend only: held locks, 1..=1000000, spread over the
                        connections (default 1000)
  --renew HOW           extend only: coalesced (default: as the official
                        client, every lock of a connection due within lease/6
                        goes with the one that is due, in one write) | single
                        (each lock on its own when due, one round trip each)
  --wait S              seconds an acquire may wait, 0..=255 (default 0;
                        5 for contended; Redis clients poll that long)
  --lease S             lease of each grant, 1..=255 (default 30)
  --poll-ms MS          Redis only: pause between two polls of a waiter (default 10)
  --duration S          seconds measured (default 10)
  --warmup S            seconds run before measuring (default 1)
  --requests N          instead of a duration: stop starting acquires (and
                        extend-flood's extends) after N requests and end when
                        all are answered (not for extend)
  --threads N           generator threads (default 1)
  --tls-ca FILE         speak TLS (1.3 or 1.2) to ticketd (--tls-cert) or
                        Redis (--tls-port), trusting this CA (PEM)
  --tls-name NAME       the name the server certificate must carry (default:
                        the address's IP)
  --server-pid PID[,PID]  also report the server's CPU time per request
                        (a cluster's nodes together)
  --json                one JSON object on stdout instead of the text report
  --quiet               no progress line on stderr
  -h, --help            this text
";

/// The values of `--mode`.
const MODES: &str = "acquire | cycle | contended | extend | extend-flood";

/// A parsed command line.
#[derive(Clone, Debug)]
pub struct Args {
    /// Generator settings.
    pub cfg: Config,
    /// Which service.
    pub backend: BackendKind,
    /// Measured seconds.
    pub duration: Duration,
    /// Warm-up seconds.
    pub warmup: Duration,
    /// Print JSON.
    pub json: bool,
    /// No progress line.
    pub quiet: bool,
    /// The server's processes (every node of a cluster), for CPU
    /// accounting; empty when not asked for.
    pub server_pids: Vec<u32>,
}

/// The services `ticket-bench` can drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// ticketd's own protocol.
    Ticketd,
    /// Redis: `SET NX PX` and a compare-and-delete script.
    Redis,
    /// etcd's lock API through its HTTP/JSON gateway.
    Etcd,
}

fn num<T>(
    p: &mut pico_args::Arguments,
    flag: &'static str,
    lo: T,
    hi: T,
) -> Result<Option<T>, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
{
    let v: Option<String> = p
        .opt_value_from_str(flag)
        .map_err(|e| format!("{flag}: {e}"))?;
    let Some(v) = v else { return Ok(None) };
    let n: T = v
        .parse()
        .map_err(|_| format!("{flag}: {v:?} is not a number"))?;
    if n < lo || n > hi {
        return Err(format!("{flag}: {v} is out of range {lo}..={hi}"));
    }
    Ok(Some(n))
}

/// Parses the flags of `ticket-bench` (without the program or subcommand name).
pub fn parse_args(args: Vec<String>) -> Result<Args, String> {
    let mut p = pico_args::Arguments::from_vec(args.into_iter().map(Into::into).collect());
    if p.contains(["-h", "--help"]) {
        return Err(String::new());
    }
    let backend = match p
        .opt_value_from_str::<_, String>("--backend")
        .map_err(|e| format!("--backend: {e}"))?
        .as_deref()
    {
        None | Some("ticketd") => BackendKind::Ticketd,
        Some("redis") => BackendKind::Redis,
        Some("etcd") => BackendKind::Etcd,
        Some(other) => {
            return Err(format!(
                "--backend: unknown backend {other:?} (ticketd | redis | etcd)"
            ))
        }
    };
    let mode = match p
        .opt_value_from_str::<_, String>("--mode")
        .map_err(|e| format!("--mode: {e}"))?
        .as_deref()
    {
        None | Some("cycle") => Mode::Cycle,
        Some("acquire") => Mode::Acquire,
        Some("contended") => Mode::Contended,
        Some("extend") => Mode::Extend,
        Some("extend-flood") => Mode::ExtendFlood,
        Some(other) => return Err(format!("--mode: unknown mode {other:?} ({MODES})")),
    };
    if mode.extends() && backend != BackendKind::Ticketd {
        return Err(format!(
            "--mode {}: ticketd only (Redis and etcd locks have no extend by fencing token here)",
            mode_name(mode)
        ));
    }
    let keys = match p
        .opt_value_from_str::<_, String>("--keys")
        .map_err(|e| format!("--keys: {e}"))?
    {
        None if mode == Mode::Contended => Keys::Hot(10),
        None => Keys::Uncontended,
        Some(s) if s == "uncontended" => Keys::Uncontended,
        Some(s) => match s.strip_prefix("hot:").map(str::parse::<u32>) {
            Some(Ok(n)) if (1..=1_000_000).contains(&n) => Keys::Hot(n),
            _ => {
                return Err(format!(
                    "--keys: {s:?} is not uncontended or hot:N with N in 1..=1000000"
                ))
            }
        },
    };
    if mode.extends() && keys != Keys::Uncontended {
        return Err(format!(
            "--keys: --mode {} holds one key per lock (uncontended only)",
            mode_name(mode)
        ));
    }
    if mode == Mode::Contended && keys == Keys::Uncontended {
        return Err("--mode contended needs --keys hot:N".into());
    }
    let tls_ca: Option<String> = p
        .opt_value_from_str("--tls-ca")
        .map_err(|e| format!("--tls-ca: {e}"))?;
    let tls_name: Option<String> = p
        .opt_value_from_str("--tls-name")
        .map_err(|e| format!("--tls-name: {e}"))?;
    let tls = match tls_ca {
        Some(ca) if backend != BackendKind::Etcd => {
            Some(tls::Tls::load(std::path::Path::new(&ca), tls_name)?)
        }
        Some(_) => return Err("--tls-ca: for ticketd and redis only".into()),
        None if tls_name.is_some() => return Err("--tls-name needs --tls-ca".into()),
        None => None,
    };
    let server: Option<String> = p
        .opt_value_from_str("--server")
        .map_err(|e| format!("--server: {e}"))?;
    let server = server.unwrap_or_else(|| match backend {
        BackendKind::Ticketd => "127.0.0.1:7470".into(),
        BackendKind::Redis => "127.0.0.1:6379".into(),
        BackendKind::Etcd => "127.0.0.1:2379".into(),
    });
    let (addrs, unix) = match server.strip_prefix("unix:") {
        Some("") => return Err("--server unix: needs a path".into()),
        Some(_) if backend == BackendKind::Etcd => {
            return Err("--server unix:PATH is for ticketd and redis only".into())
        }
        Some(_) if tls.is_some() => return Err("--tls-ca: not over a Unix socket".into()),
        Some(path) => (Vec::new(), Some(std::path::PathBuf::from(path))),
        None => (server_addrs(&server)?, None),
    };
    if addrs.len() > 1 && backend != BackendKind::Ticketd {
        return Err(format!(
            "--server: {server:?}: several addresses (a cluster) are for ticketd only"
        ));
    }
    let mut connections = num(&mut p, "--connections", 1usize, 10_000)?.unwrap_or(50);
    let depth = num(&mut p, "--depth", 1usize, 256)?;
    if mode == Mode::Extend && depth.is_some() {
        return Err(
            "--depth: --mode extend paces its --locks (use --mode extend-flood for a pipelined flood)"
                .into(),
        );
    }
    let depth = depth.unwrap_or(1);
    let locks = num(&mut p, "--locks", 1usize, 1_000_000)?;
    if locks.is_some() && mode != Mode::Extend {
        return Err("--locks: only for --mode extend".into());
    }
    let locks = locks.unwrap_or(1000);
    let renew: Option<String> = p
        .opt_value_from_str("--renew")
        .map_err(|e| format!("--renew: {e}"))?;
    let renew = match renew.as_deref() {
        None | Some("coalesced") => Renew::Coalesced,
        Some("single") => Renew::Single,
        Some(other) => return Err(format!("--renew: {other:?} is not coalesced or single")),
    };
    if renew != Renew::Coalesced && mode != Mode::Extend {
        return Err("--renew: only for --mode extend".into());
    }
    if mode == Mode::Extend {
        // Every connection holds at least one lock.
        connections = connections.min(locks);
        if locks.div_ceil(connections) > usize::from(u16::MAX) {
            return Err(format!(
                "--locks: {locks} locks on {connections} connections is more than {} per connection",
                u16::MAX
            ));
        }
    }
    if backend == BackendKind::Etcd && depth != 1 {
        return Err("--depth: etcd lock requests block, so its depth is 1".into());
    }
    let default_wait = if mode == Mode::Contended { 5 } else { 0 };
    let wait_s = num(&mut p, "--wait", 0u8, 255)?.unwrap_or(default_wait);
    if mode == Mode::Contended && wait_s == 0 {
        return Err("--mode contended needs --wait of at least 1 second".into());
    }
    let lease_s = num(&mut p, "--lease", 1u8, 255)?.unwrap_or(30);
    let poll_ms = num(&mut p, "--poll-ms", 1u64, 10_000)?.unwrap_or(10);
    let duration_s = num(&mut p, "--duration", 0.1f64, 86_400.0)?;
    let warmup_s = num(&mut p, "--warmup", 0.0f64, 3_600.0)?;
    let requests = num(&mut p, "--requests", 1u64, 1 << 40)?;
    if mode == Mode::Extend && requests.is_some() {
        return Err("--requests: --mode extend runs for a --duration".into());
    }
    let threads = num(&mut p, "--threads", 1usize, 64)?.unwrap_or(1);
    let server_pids: Option<String> = p
        .opt_value_from_str("--server-pid")
        .map_err(|e| format!("--server-pid: {e}"))?;
    let server_pids = match server_pids {
        None => Vec::new(),
        Some(list) => list
            .split(',')
            .map(|pid| match pid.trim().parse::<u32>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("--server-pid: {pid:?} is not a process id")),
            })
            .collect::<Result<_, _>>()?,
    };
    let json = p.contains("--json");
    let quiet = p.contains("--quiet");
    let rest = p.finish();
    if let Some(first) = rest.first() {
        return Err(format!("unexpected argument {:?}", first.to_string_lossy()));
    }
    if threads > connections {
        return Err(format!(
            "--threads: {threads} threads for {connections} connections"
        ));
    }
    // A count-bounded run has no warm-up; its duration is only a safety cap.
    let (duration_s, warmup_s) = match requests {
        Some(_) => (duration_s.unwrap_or(600.0), 0.0),
        None => (duration_s.unwrap_or(10.0), warmup_s.unwrap_or(1.0)),
    };
    Ok(Args {
        cfg: Config {
            addrs,
            unix,
            connections,
            depth,
            locks,
            keys,
            mode,
            wait_s,
            lease_s,
            poll_ms,
            threads,
            requests,
            renew,
            tls,
        },
        backend,
        duration: Duration::from_secs_f64(duration_s),
        warmup: Duration::from_secs_f64(warmup_s),
        json,
        quiet,
        server_pids,
    })
}

/// `--server`'s value: one address, or several separated by commas (the
/// nodes of a cluster), each `HOST:PORT` resolved to its first address.
fn server_addrs(server: &str) -> Result<Vec<SocketAddr>, String> {
    server
        .split(',')
        .map(|one| {
            one.trim()
                .to_socket_addrs()
                .map_err(|e| format!("--server: {one:?}: {e}"))?
                .next()
                .ok_or_else(|| format!("--server: {one:?} resolves to nothing"))
        })
        .collect()
}

/// CPU seconds used by all of `pids` together, or `None` when there are
/// none or one cannot be read.
fn servers_cpu_s(pids: &[u32]) -> Option<f64> {
    if pids.is_empty() {
        return None;
    }
    pids.iter().map(|&pid| process_cpu_s(pid)).sum()
}

/// CPU seconds (user + system) a process has used, from `/proc/PID/stat`.
/// `/proc` counts in USER_HZ, which is 100 on every Linux architecture.
#[must_use]
pub fn process_cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces: skip past it.
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split(' ').collect();
    // After the name: state is field 3 of the full line, utime 14, stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

/// A loopback port that is free now, for a server a benchmark or a test is
/// about to start, taken below the kernel's ephemeral range (32768 and up
/// on Linux): a port the kernel hands out could be given to an outgoing
/// connection between this pick and the server's bind (which then fails
/// with "Address already in use"); these never are. A counter keeps one
/// process's picks apart, and the process id spreads concurrent processes.
pub fn free_loopback_port() -> std::io::Result<u16> {
    use std::sync::atomic::AtomicU32;
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let offset = (std::process::id() % 600) * 20;
    for _ in 0..SPAN {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = u16::try_from(FIRST + (offset + n) % SPAN).unwrap_or(u16::MAX);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free loopback port in {FIRST}..{}", FIRST + SPAN),
    ))
}

/// The outcome of one run.
#[derive(Debug)]
pub struct Report {
    /// The command line it ran with.
    pub args: Args,
    /// Measured seconds.
    pub elapsed_s: f64,
    /// What the workers counted.
    pub stats: Stats,
    /// (grants checked, grants out of FIFO order), for contended ticketd runs.
    pub fifo: Option<(u64, u64)>,
    /// Server CPU seconds during the measured window.
    pub server_cpu_s: Option<f64>,
}

/// One generator thread per `cfg.threads`, each driving its share of the
/// connections.
fn spawn_workers<B: Backend>(
    b: &Arc<B>,
    cfg: &Config,
    shared: &Arc<Shared>,
    base: Instant,
) -> Result<Vec<std::thread::JoinHandle<Result<Stats, String>>>, String> {
    let mut handles = Vec::new();
    for t in 0..cfg.threads {
        let ids: Vec<u64> = (0..cfg.connections as u64)
            .filter(|i| *i as usize % cfg.threads == t)
            .collect();
        let (b, cfg, shared) = (Arc::clone(b), cfg.clone(), Arc::clone(shared));
        handles.push(
            std::thread::Builder::new()
                .name(format!("bench-{t}"))
                .spawn(move || gen::run_worker(&*b, &cfg, &ids, &shared, base))
                .map_err(|e| format!("spawning a generator thread: {e}"))?,
        );
    }
    Ok(handles)
}

/// Waits for every generator thread: their stats merged, or the last
/// error one of them met.
fn join_workers(
    handles: Vec<std::thread::JoinHandle<Result<Stats, String>>>,
) -> Result<Stats, String> {
    let mut stats = Stats::default();
    let mut err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(s)) => stats.merge(s),
            Ok(Err(e)) => err = Some(e),
            Err(_) => err = Some("a generator thread panicked".into()),
        }
    }
    match err {
        Some(e) => Err(e),
        None => Ok(stats),
    }
}

// Long because it is one run, step by step: warm up, measure, report.
fn run_backend<B: Backend>(b: Arc<B>, args: &Args) -> Result<Report, String> {
    let cfg = &args.cfg;
    if cfg.mode.extends() && !b.supports_extend() {
        return Err(format!(
            "--mode {}: {} has no extend",
            mode_name(cfg.mode),
            b.name()
        ));
    }
    let shared = Arc::new(Shared::new(cfg.requests));
    // Without a warm-up, measuring starts before the first request is sent.
    let mut measure_start = if args.warmup.is_zero() {
        shared.measuring.store(true, Ordering::Relaxed);
        Some((Instant::now(), servers_cpu_s(&args.server_pids)))
    } else {
        None
    };
    let base = Instant::now();
    let handles = spawn_workers(&b, cfg, &shared, base)?;

    let threads = cfg.threads as u64;
    let warmup_end = base + args.warmup;
    let end = warmup_end + args.duration;
    let mut last = (Instant::now(), 0u64, 0u64);
    let mut tick = 1u64;
    loop {
        let now = Instant::now();
        if shared.done.load(Ordering::Relaxed) == threads || now >= end {
            break;
        }
        if measure_start.is_none() && now >= warmup_end {
            measure_start = Some((now, servers_cpu_s(&args.server_pids)));
            shared.measuring.store(true, Ordering::Relaxed);
        }
        let next = (base + Duration::from_secs(tick)).min(end);
        std::thread::sleep(
            next.saturating_duration_since(now)
                .min(Duration::from_millis(50)),
        );
        if Instant::now() >= base + Duration::from_secs(tick) {
            tick += 1;
            let sent = shared.sent.load(Ordering::Relaxed);
            let grants = shared.grants.load(Ordering::Relaxed);
            let dt = last.0.elapsed().as_secs_f64().max(1e-9);
            if !args.quiet {
                eprintln!(
                    "[{:>4}s] {:<7} {:>10.0} req/s {:>10.0} grants/s",
                    tick - 1,
                    if measure_start.is_some() {
                        "run"
                    } else {
                        "warmup"
                    },
                    (sent - last.1) as f64 / dt,
                    (grants - last.2) as f64 / dt,
                );
            }
            last = (Instant::now(), sent, grants);
        }
    }
    let stop_at = Instant::now();
    let cpu_end = servers_cpu_s(&args.server_pids);
    shared.stop.store(true, Ordering::Relaxed);
    let mut stats = join_workers(handles)?;
    let (start, cpu_start) = measure_start.unwrap_or((stop_at, None));
    let fifo = (cfg.mode == Mode::Contended && b.fifo_probe())
        .then(|| gen::fifo_violations(&mut stats.grant_log));
    Ok(Report {
        args: args.clone(),
        elapsed_s: stop_at.duration_since(start).as_secs_f64(),
        stats,
        fifo,
        server_cpu_s: match (cpu_start, cpu_end) {
            (Some(a), Some(b)) => Some(b - a),
            _ => None,
        },
    })
}

/// Runs one benchmark as the command line says.
pub fn run(args: &Args) -> Result<Report, String> {
    match args.backend {
        BackendKind::Ticketd => run_backend(Arc::new(Ticketd), args),
        BackendKind::Redis => {
            let r = match &args.cfg.unix {
                Some(path) => resp::Redis::new_unix(path)
                    .map_err(|e| format!("redis at unix:{}: {e}", path.display()))?,
                None => {
                    let addr = args.cfg.addrs[0];
                    resp::Redis::new(addr, args.cfg.tls.as_ref())
                        .map_err(|e| format!("redis at {addr}: {e}"))?
                }
            };
            run_backend(Arc::new(r), args)
        }
        BackendKind::Etcd => {
            let addr = args.cfg.addrs[0];
            let e = etcd::Etcd::new(addr, args.cfg.connections)
                .map_err(|e| format!("etcd at {addr}: {e}"))?;
            run_backend(Arc::new(e), args)
        }
    }
}

fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Acquire => "acquire",
        Mode::Cycle => "cycle",
        Mode::Contended => "contended",
        Mode::Extend => "extend",
        Mode::ExtendFlood => "extend-flood",
    }
}

fn keys_name(k: Keys) -> String {
    match k {
        Keys::Uncontended => "uncontended".into(),
        Keys::Hot(n) => format!("hot:{n}"),
    }
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

impl Report {
    /// Requests answered per second.
    #[must_use]
    pub fn requests_per_s(&self) -> f64 {
        self.stats.replies as f64 / self.elapsed_s.max(1e-9)
    }

    /// Grants per second.
    #[must_use]
    pub fn grants_per_s(&self) -> f64 {
        self.stats.grants as f64 / self.elapsed_s.max(1e-9)
    }

    /// Extends answered `E` per second.
    #[must_use]
    pub fn extends_per_s(&self) -> f64 {
        self.stats.extended as f64 / self.elapsed_s.max(1e-9)
    }

    /// Locks held: `--locks` in `extend` mode, one per slot in `extend-flood`.
    #[must_use]
    pub fn locks_held(&self) -> usize {
        let c = &self.args.cfg;
        match c.mode {
            Mode::Extend => c.locks,
            _ => c.connections * c.depth,
        }
    }

    /// Server CPU microseconds per answered extend (extend modes; the few
    /// acquires in the measured window are charged to the extends).
    #[must_use]
    pub fn server_cpu_us_per_extend(&self) -> Option<f64> {
        let answered = self.stats.extended + self.stats.not_extended;
        self.server_cpu_s
            .filter(|_| answered > 0 && self.args.cfg.mode.extends())
            .map(|s| s * 1e6 / answered as f64)
    }

    /// The server's CPU time over the measured window, in percent of one core.
    #[must_use]
    pub fn server_cpu_core_pct(&self) -> Option<f64> {
        self.server_cpu_s
            .map(|s| s * 100.0 / self.elapsed_s.max(1e-9))
    }

    /// Server CPU microseconds per answered request.
    #[must_use]
    pub fn server_cpu_us_per_request(&self) -> Option<f64> {
        // Probes are requests the server answered too.
        let answered = self.stats.replies + self.stats.probes;
        self.server_cpu_s
            .filter(|_| answered > 0)
            .map(|s| s * 1e6 / answered as f64)
    }

    fn backend_name(&self) -> &'static str {
        match self.args.backend {
            BackendKind::Ticketd => "ticketd",
            BackendKind::Redis => "redis",
            BackendKind::Etcd => "etcd",
        }
    }

    /// One flat JSON object (numbers and short strings only, so shell tools
    /// can pick fields out of it).
    // Long because it is one report, field by field, in print order.
    #[must_use]
    pub fn to_json(&self) -> String {
        let s = &self.stats;
        let c = &self.args.cfg;
        let mut j = String::from("{");
        let _ = write!(
            j,
            "\"backend\":\"{}\",\"mode\":\"{}\",\"keys\":\"{}\",\"connections\":{},\"depth\":{},\"wait_s\":{},\"lease_s\":{},",
            self.backend_name(),
            mode_name(c.mode),
            keys_name(c.keys),
            c.connections,
            c.depth,
            c.wait_s,
            c.lease_s
        );
        let _ = write!(
            j,
            "\"elapsed_s\":{:.3},\"requests\":{},\"requests_per_s\":{:.0},\"grants\":{},\"grants_per_s\":{:.0},\"not_granted\":{},\"busy\":{},\"released\":{},\"not_released\":{},\"polls\":{},\"probes\":{},",
            self.elapsed_s,
            s.replies,
            self.requests_per_s(),
            s.grants,
            self.grants_per_s(),
            s.not_granted,
            s.busy,
            s.released,
            s.not_released,
            s.polls,
            s.probes
        );
        let _ = write!(
            j,
            "\"p50_us\":{:.1},\"p99_us\":{:.1},\"p999_us\":{:.1},\"max_us\":{:.1}",
            us(s.latency.quantile(0.5)),
            us(s.latency.quantile(0.99)),
            us(s.latency.quantile(0.999)),
            us(s.latency.max())
        );
        if c.mode == Mode::Contended {
            let w = &s.wait_to_grant;
            let _ = write!(
                j,
                ",\"wait_p50_us\":{:.1},\"wait_p99_us\":{:.1},\"wait_p999_us\":{:.1},\"wait_max_us\":{:.1}",
                us(w.quantile(0.5)),
                us(w.quantile(0.99)),
                us(w.quantile(0.999)),
                us(w.max())
            );
        }
        if let Some((checked, bad)) = self.fifo {
            let _ = write!(j, ",\"fifo_checked\":{checked},\"fifo_violations\":{bad}");
        }
        if c.mode.extends() {
            let _ = write!(
                j,
                ",\"locks\":{},\"extended\":{},\"not_extended\":{},\"extends_per_s\":{:.0}",
                self.locks_held(),
                s.extended,
                s.not_extended,
                self.extends_per_s()
            );
        }
        if let (Some(cpu), Some(per)) = (self.server_cpu_s, self.server_cpu_us_per_request()) {
            let _ = write!(
                j,
                ",\"server_cpu_s\":{cpu:.2},\"server_cpu_us_per_request\":{per:.3}"
            );
        }
        if let Some(pct) = self.server_cpu_core_pct() {
            let _ = write!(j, ",\"server_cpu_core_pct\":{pct:.3}");
        }
        if let Some(per) = self.server_cpu_us_per_extend() {
            let _ = write!(j, ",\"server_cpu_us_per_extend\":{per:.3}");
        }
        j.push('}');
        j
    }

    /// The human-readable report.
    // Long because it is one report, line by line, in print order.
    #[must_use]
    pub fn to_text(&self) -> String {
        let s = &self.stats;
        let c = &self.args.cfg;
        let mut t = String::new();
        if c.mode.extends() {
            return self.extend_text();
        }
        let _ = writeln!(
            t,
            "{} {}: {} connections, depth {}, keys {}, wait {} s, lease {} s, {:.1} s measured",
            self.backend_name(),
            mode_name(c.mode),
            c.connections,
            c.depth,
            keys_name(c.keys),
            c.wait_s,
            c.lease_s,
            self.elapsed_s
        );
        let _ = writeln!(
            t,
            "  requests/s {:>12.0}   grants/s {:>12.0}",
            self.requests_per_s(),
            self.grants_per_s()
        );
        let _ = writeln!(
            t,
            "  answered {}  granted {}  not granted {}  busy {}  released {}  not released {}{}",
            s.replies,
            s.grants,
            s.not_granted,
            s.busy,
            s.released,
            s.not_released,
            match (s.polls, s.probes) {
                (0, 0) => String::new(),
                (polls, 0) => format!("  polls {polls}"),
                (_, probes) => format!("  fifo probes {probes}"),
            }
        );
        let _ = writeln!(
            t,
            "  latency    p50 {:>9.1} us  p99 {:>9.1} us  p99.9 {:>9.1} us  max {:>9.1} us",
            us(s.latency.quantile(0.5)),
            us(s.latency.quantile(0.99)),
            us(s.latency.quantile(0.999)),
            us(s.latency.max())
        );
        if c.mode == Mode::Contended {
            let w = &s.wait_to_grant;
            let _ = writeln!(
                t,
                "  wait→grant p50 {:>9.1} us  p99 {:>9.1} us  p99.9 {:>9.1} us  max {:>9.1} us",
                us(w.quantile(0.5)),
                us(w.quantile(0.99)),
                us(w.quantile(0.999)),
                us(w.max())
            );
            match self.fifo {
                Some((checked, 0)) => {
                    let _ = writeln!(t, "  fifo       {checked} grants, all in queue order");
                }
                Some((checked, bad)) => {
                    let _ = writeln!(t, "  fifo       {checked} grants, {bad} OUT OF QUEUE ORDER");
                }
                None if self.args.backend == BackendKind::Redis => {
                    let _ = writeln!(t, "  fifo       n/a (no server-side queue: clients poll)");
                }
                None => {
                    let _ = writeln!(t, "  fifo       not checked (no fencing tokens)");
                }
            }
        }
        if let (Some(cpu), Some(per)) = (self.server_cpu_s, self.server_cpu_us_per_request()) {
            let _ = writeln!(t, "  server cpu {cpu:.2} s = {per:.3} us per request");
        }
        t
    }
}

impl Report {
    /// The human-readable report of an extend run.
    fn extend_text(&self) -> String {
        let s = &self.stats;
        let c = &self.args.cfg;
        let mut t = String::new();
        let pace = if c.mode == Mode::Extend && c.renew == Renew::Single {
            format!(
                "each extended every {:.1} s, alone",
                f64::from(c.lease_s) / 3.0
            )
        } else if c.mode == Mode::Extend {
            format!(
                "each extended every {:.1} s, coalesced per connection as the client does",
                f64::from(c.lease_s) / 3.0
            )
        } else {
            format!("depth {}, extended back to back", c.depth)
        };
        let _ = writeln!(
            t,
            "{} {}: {} locks on {} connections, {pace}, lease {} s, {:.1} s measured",
            self.backend_name(),
            mode_name(c.mode),
            self.locks_held(),
            c.connections,
            c.lease_s,
            self.elapsed_s
        );
        let _ = writeln!(
            t,
            "  extends/s  {:>12.0}   extended (E) {}  not extended (X) {}{}",
            self.extends_per_s(),
            s.extended,
            s.not_extended,
            if s.not_extended > 0 { "  FAILED" } else { "" }
        );
        let _ = writeln!(
            t,
            "  answered {}  granted {}  busy {}",
            s.replies, s.grants, s.busy
        );
        let _ = writeln!(
            t,
            "  extend latency p50 {:>9.1} us  p99 {:>9.1} us  p99.9 {:>9.1} us  max {:>9.1} us",
            us(s.latency.quantile(0.5)),
            us(s.latency.quantile(0.99)),
            us(s.latency.quantile(0.999)),
            us(s.latency.max())
        );
        if let (Some(cpu), Some(pct)) = (self.server_cpu_s, self.server_cpu_core_pct()) {
            let per = self
                .server_cpu_us_per_extend()
                .map_or_else(|| "-".to_string(), |p| format!("{p:.3}"));
            let _ = writeln!(
                t,
                "  server cpu {cpu:.2} s = {per} us per extend = {pct:.2} % of one core"
            );
        }
        t
    }
}

/// Bytes offered to one `read` of the generator and of the limit server.
pub(crate) const READ_CHUNK_BYTES: usize = 16 * 1024;

/// The most a load generator's read buffer holds: far beyond any reply
/// of any backend, so only a broken server reaches it.
pub(crate) const READ_BUFFER_CAP_BYTES: usize = 64 << 20;

/// Asks for writable events on `stream` only while it has unsent bytes
/// (`want`); `registered` remembers what is asked now, so an unchanged
/// interest costs no system call.
pub(crate) fn set_write_interest(
    registry: &mio::Registry,
    stream: &mut (impl mio::event::Source + ?Sized),
    token: mio::Token,
    registered: &mut bool,
    want: bool,
) -> std::io::Result<()> {
    if want == *registered {
        return Ok(());
    }
    *registered = want;
    let interest = if want {
        mio::Interest::READABLE | mio::Interest::WRITABLE
    } else {
        mio::Interest::READABLE
    };
    registry.reregister(stream, token, interest)
}

/// Entry point of `ticket-bench ARGS` (without the program name). Returns
/// the process exit code: 0 on success, 1 if the run failed, the FIFO check
/// found a grant out of order or an extend was answered `X`, 64 for bad
/// flags (the usage status of `ticket`).
#[must_use]
pub fn main(args: Vec<String>) -> i32 {
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            return 0;
        }
        Err(e) => {
            eprintln!("ticket-bench: {e}");
            eprintln!("try 'ticket-bench --help'");
            return 64;
        }
    };
    match run(&args) {
        Ok(r) => {
            if args.json {
                println!("{}", r.to_json());
            } else {
                print!("{}", r.to_text());
            }
            match r.fifo {
                Some((_, bad)) if bad > 0 => 1,
                _ if r.stats.not_extended > 0 => 1,
                _ => 0,
            }
        }
        Err(e) => {
            eprintln!("ticket-bench: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn args(list: &[&str]) -> Result<Args, String> {
        parse_args(list.iter().map(|s| (*s).to_string()).collect())
    }

    /// A limit server on a free loopback port, serving until `stop`.
    fn limit_server(
        stop: &Arc<AtomicBool>,
    ) -> (
        String,
        std::thread::JoinHandle<std::io::Result<limit::LimitStats>>,
    ) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = Arc::clone(stop);
        (
            addr,
            std::thread::spawn(move || limit::serve(listener, &stop)),
        )
    }

    #[test]
    fn bad_flags_are_named_and_exit_64() {
        for (bad, needle) in [
            (&["--depth", "0"][..], "--depth"),
            (&["--depth", "x"][..], "not a number"),
            (&["--mode", "fast"][..], "unknown mode"),
            (&["--backend", "zk"][..], "unknown backend"),
            (&["--keys", "hot:0"][..], "--keys"),
            (
                &["--mode", "contended", "--keys", "uncontended"][..],
                "hot:N",
            ),
            (&["--mode", "contended", "--wait", "0"][..], "--wait"),
            (&["--lease", "0"][..], "--lease"),
            (
                &["--mode", "extend", "--backend", "redis"][..],
                "ticketd only",
            ),
            (
                &["--mode", "extend-flood", "--backend", "etcd"][..],
                "ticketd only",
            ),
            (&["--mode", "extend", "--depth", "4"][..], "extend-flood"),
            (
                &["--mode", "extend", "--keys", "hot:3"][..],
                "uncontended only",
            ),
            (&["--mode", "extend", "--requests", "9"][..], "--duration"),
            (&["--mode", "extend", "--locks", "0"][..], "--locks"),
            (&["--locks", "10"][..], "only for --mode extend"),
            (&["--renew", "single"][..], "only for --mode extend"),
            (&["--mode", "extend", "--renew", "each"][..], "--renew"),
            (
                &[
                    "--mode",
                    "extend",
                    "--locks",
                    "1000000",
                    "--connections",
                    "2",
                ][..],
                "per connection",
            ),
            (&["--backend", "etcd", "--depth", "2"][..], "depth is 1"),
            (&["--frobnicate"][..], "unexpected argument"),
        ] {
            let e = args(bad).unwrap_err();
            assert!(e.contains(needle), "{bad:?} gave {e:?}");
        }
        assert_eq!(main(vec!["--depth".into(), "999".into()]), 64);
    }

    #[test]
    fn defaults_follow_the_mode() {
        let a = args(&["--mode", "contended"]).unwrap();
        assert_eq!(a.cfg.keys, Keys::Hot(10));
        assert_eq!(a.cfg.wait_s, 5);
        assert_eq!(a.cfg.connections, 50);
        let b = args(&["--backend", "redis", "--requests", "5"]).unwrap();
        assert_eq!(b.cfg.addrs.len(), 1);
        assert_eq!(b.cfg.addrs[0].port(), 6379);
        assert!(b.warmup.is_zero());
    }

    #[test]
    fn extend_spreads_its_locks_over_the_connections() {
        let a = args(&["--mode", "extend", "--locks", "10", "--connections", "4"]).unwrap();
        let slots: Vec<usize> = (0..4).map(|i| gen::slots_of(&a.cfg, i)).collect();
        assert_eq!(slots, [3, 3, 2, 2]);
        // Fewer locks than connections: one lock per connection.
        let b = args(&["--mode", "extend", "--locks", "3"]).unwrap();
        assert_eq!(b.cfg.connections, 3);
        assert_eq!(gen::slots_of(&b.cfg, 2), 1);
        let f = args(&["--mode", "extend-flood", "--depth", "16"]).unwrap();
        assert_eq!(gen::slots_of(&f.cfg, 0), 16);
        // Renewals are coalesced as the client's unless asked otherwise.
        assert_eq!(a.cfg.renew, Renew::Coalesced);
        let s = args(&["--mode", "extend", "--renew", "single"]).unwrap();
        assert_eq!(s.cfg.renew, Renew::Single);
    }

    #[test]
    fn a_unix_server_is_a_path_for_ticketd_and_redis_without_tls() {
        let a = args(&["--server", "unix:/run/t.sock"]).unwrap();
        assert_eq!(
            a.cfg.unix.as_deref(),
            Some(std::path::Path::new("/run/t.sock"))
        );
        assert!(a.cfg.addrs.is_empty());
        let r = args(&["--backend", "redis", "--server", "unix:/run/r.sock"]).unwrap();
        assert!(r.cfg.unix.is_some());
        assert!(args(&["--server", "127.0.0.1:1"])
            .unwrap()
            .cfg
            .unix
            .is_none());
        for bad in [
            vec!["--server", "unix:"],
            vec!["--backend", "etcd", "--server", "unix:/run/e.sock"],
        ] {
            assert!(args(&bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_cluster_is_several_servers_and_several_pids() {
        let a = args(&[
            "--server",
            "127.0.0.1:1,127.0.0.1:2, 127.0.0.1:3",
            "--server-pid",
            "10,11,12",
        ])
        .unwrap();
        let ports: Vec<u16> = a.cfg.addrs.iter().map(SocketAddr::port).collect();
        assert_eq!(ports, [1, 2, 3]);
        assert_eq!(a.server_pids, [10, 11, 12]);
        for bad in [
            vec!["--server", "127.0.0.1:1,"],
            vec!["--server", "127.0.0.1:1,nowhere"],
            vec!["--backend", "etcd", "--server", "127.0.0.1:1,127.0.0.1:2"],
            vec!["--server-pid", "10,,12"],
            vec!["--server-pid", "0"],
        ] {
            assert!(args(&bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn connections_are_spread_over_a_clusters_nodes() {
        // Three limit servers stand in for three nodes: each must get some
        // of the connections' requests.
        let stop = Arc::new(AtomicBool::new(false));
        let servers: Vec<_> = (0..3).map(|_| limit_server(&stop)).collect();
        let list: Vec<&str> = servers.iter().map(|(a, _)| a.as_str()).collect();
        let a = args(&[
            "--server",
            &list.join(","),
            "--connections",
            "6",
            "--requests",
            "600",
            "--quiet",
        ])
        .unwrap();
        let r = run(&a).unwrap();
        stop.store(true, Ordering::Relaxed);
        let served: Vec<u64> = servers
            .into_iter()
            .map(|(_, h)| h.join().unwrap().unwrap().requests)
            .collect();
        assert_eq!(served.iter().sum::<u64>(), r.stats.replies);
        assert!(served.iter().all(|&n| n > 0), "{served:?}");
    }

    #[test]
    fn cpu_time_of_this_process_is_readable() {
        let cpu = process_cpu_s(std::process::id());
        assert!(cpu.is_some_and(|c| c >= 0.0));
    }

    #[test]
    fn a_count_bounded_cycle_run_against_the_limit_server_answers_every_request() {
        let stop = Arc::new(AtomicBool::new(false));
        let (addr, server) = limit_server(&stop);
        let a = args(&[
            "--server",
            &addr,
            "--connections",
            "4",
            "--depth",
            "8",
            "--requests",
            "2000",
            "--quiet",
            "--threads",
            "2",
        ])
        .unwrap();
        let r = run(&a).unwrap();
        stop.store(true, Ordering::Relaxed);
        let served = server.join().unwrap().unwrap();
        // Acquires stop at the budget; every grant is then released, so the
        // run ends with as many releases as grants and nothing in flight.
        assert!(
            (2000..=2000 + 32).contains(&r.stats.replies),
            "{:?}",
            r.stats
        );
        assert_eq!(r.stats.grants, r.stats.released);
        assert_eq!(r.stats.replies, r.stats.grants * 2);
        assert_eq!(served.requests, r.stats.replies);
        assert_eq!(r.stats.latency.count(), r.stats.replies);
        let j = r.to_json();
        assert!(j.contains("\"mode\":\"cycle\"") && j.contains("\"requests\":"));
    }
}

//! `ticket-bench`'s command line: the usage text, the parsed [`Args`] and
//! their parser, one step per group of flags, each checking its flags
//! against the ones parsed before it.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use ticketd::proto::Places;

use crate::gen::{Config, Keys, Mode, Renew};
use crate::tls;

/// What `ticket-bench --help` prints.
pub(crate) const USAGE: &str = "\
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
  --places SPEC         ticketd only: acquire with places (protocol 1.2) instead
                        of a mutex: semaphore:N (one of N places, shared),
                        shared or exclusive (a read/write lock, limit 65535)
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
    /// `--places`: acquires sent as Acquire With Limit (ticketd only).
    pub places: Option<Places>,
}

/// `--places`: a semaphore's place, or a read/write lock's shared or
/// exclusive hold; ticketd only.
fn parse_places(
    p: &mut pico_args::Arguments,
    backend: BackendKind,
) -> Result<Option<Places>, String> {
    let Some(spec) = opt_string(p, "--places")? else {
        return Ok(None);
    };
    if backend != BackendKind::Ticketd {
        return Err("--places: ticketd only (protocol 1.2)".into());
    }
    let places = match spec.as_str() {
        "shared" => Places::shared(),
        "exclusive" => Places::exclusive(),
        s => match s.strip_prefix("semaphore:").map(str::parse::<u16>) {
            Some(Ok(n)) if n > 0 => Places::semaphore(n),
            _ => {
                return Err(format!(
                    "--places: {s:?} is not semaphore:N (N in 1..=65535), shared or exclusive"
                ))
            }
        },
    };
    Ok(Some(places))
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

/// A number flag's value, checked against `lo..=hi`; `None` when absent.
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

/// A flag's value as a string, `None` when the flag is absent.
fn opt_string(p: &mut pico_args::Arguments, flag: &'static str) -> Result<Option<String>, String> {
    p.opt_value_from_str::<_, String>(flag)
        .map_err(|e| format!("{flag}: {e}"))
}

/// `--backend`.
fn parse_backend(p: &mut pico_args::Arguments) -> Result<BackendKind, String> {
    match opt_string(p, "--backend")?.as_deref() {
        None | Some("ticketd") => Ok(BackendKind::Ticketd),
        Some("redis") => Ok(BackendKind::Redis),
        Some("etcd") => Ok(BackendKind::Etcd),
        Some(other) => Err(format!(
            "--backend: unknown backend {other:?} (ticketd | redis | etcd)"
        )),
    }
}

/// `--mode`: the extend modes are for ticketd only.
fn parse_mode(p: &mut pico_args::Arguments, backend: BackendKind) -> Result<Mode, String> {
    let mode = match opt_string(p, "--mode")?.as_deref() {
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
    Ok(mode)
}

/// `--keys`: its default follows the mode, and the mode limits its value.
fn parse_keys(p: &mut pico_args::Arguments, mode: Mode) -> Result<Keys, String> {
    let keys = match opt_string(p, "--keys")? {
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
    Ok(keys)
}

/// `--tls-ca` and `--tls-name`: the TLS settings, loaded, or `None`.
fn parse_tls(
    p: &mut pico_args::Arguments,
    backend: BackendKind,
) -> Result<Option<tls::Tls>, String> {
    let tls_ca = opt_string(p, "--tls-ca")?;
    let tls_name = opt_string(p, "--tls-name")?;
    match tls_ca {
        Some(ca) if backend != BackendKind::Etcd => {
            Ok(Some(tls::Tls::load(std::path::Path::new(&ca), tls_name)?))
        }
        Some(_) => Err("--tls-ca: for ticketd and redis only".into()),
        None if tls_name.is_some() => Err("--tls-name needs --tls-ca".into()),
        None => Ok(None),
    }
}

/// `--server`: the addresses to dial (a cluster's several), or a Unix
/// socket's path; the backend's default address when absent.
fn parse_server(
    p: &mut pico_args::Arguments,
    backend: BackendKind,
    tls: Option<&tls::Tls>,
) -> Result<(Vec<SocketAddr>, Option<PathBuf>), String> {
    let server = opt_string(p, "--server")?;
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
        Some(path) => (Vec::new(), Some(PathBuf::from(path))),
        None => (server_addrs(&server)?, None),
    };
    if addrs.len() > 1 && backend != BackendKind::Ticketd {
        return Err(format!(
            "--server: {server:?}: several addresses (a cluster) are for ticketd only"
        ));
    }
    Ok((addrs, unix))
}

/// How the requests are spread: connections, pipeline depth, and extend
/// mode's held locks and renewal pace.
struct Shape {
    /// `--connections`, at most one per lock in extend mode.
    connections: usize,
    /// `--depth`: requests in flight per connection.
    depth: usize,
    /// `--locks`: extend mode's held locks.
    locks: usize,
    /// `--renew`: extend mode's renewal pace.
    renew: Renew,
}

/// `--connections`, `--depth`, `--locks` and `--renew`, checked against
/// the mode and the backend.
fn parse_shape(
    p: &mut pico_args::Arguments,
    mode: Mode,
    backend: BackendKind,
) -> Result<Shape, String> {
    let mut connections = num(p, "--connections", 1usize, 10_000)?.unwrap_or(50);
    let depth = num(p, "--depth", 1usize, 256)?;
    if mode == Mode::Extend && depth.is_some() {
        return Err(
            "--depth: --mode extend paces its --locks (use --mode extend-flood for a pipelined flood)"
                .into(),
        );
    }
    let depth = depth.unwrap_or(1);
    let locks = num(p, "--locks", 1usize, 1_000_000)?;
    if locks.is_some() && mode != Mode::Extend {
        return Err("--locks: only for --mode extend".into());
    }
    let locks = locks.unwrap_or(1000);
    let renew = match opt_string(p, "--renew")?.as_deref() {
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
    Ok(Shape {
        connections,
        depth,
        locks,
        renew,
    })
}

/// What each acquire asks for and how often Redis polls: `--wait`,
/// `--lease` and `--poll-ms`.
fn parse_waits(p: &mut pico_args::Arguments, mode: Mode) -> Result<(u8, u8, u64), String> {
    let default_wait = if mode == Mode::Contended { 5 } else { 0 };
    let wait_s = num(p, "--wait", 0u8, 255)?.unwrap_or(default_wait);
    if mode == Mode::Contended && wait_s == 0 {
        return Err("--mode contended needs --wait of at least 1 second".into());
    }
    let lease_s = num(p, "--lease", 1u8, 255)?.unwrap_or(30);
    let poll_ms = num(p, "--poll-ms", 1u64, 10_000)?.unwrap_or(10);
    Ok((wait_s, lease_s, poll_ms))
}

/// How long a run lasts.
struct RunLength {
    /// Measured seconds (a safety cap when `requests` bounds the run).
    duration_s: f64,
    /// Warm-up seconds.
    warmup_s: f64,
    /// `--requests`: the run ends once this many are answered.
    requests: Option<u64>,
}

/// `--duration`, `--warmup` and `--requests`: a count-bounded run has no
/// warm-up; its duration is only a safety cap.
fn parse_length(p: &mut pico_args::Arguments, mode: Mode) -> Result<RunLength, String> {
    let duration_s = num(p, "--duration", 0.1f64, 86_400.0)?;
    let warmup_s = num(p, "--warmup", 0.0f64, 3_600.0)?;
    let requests = num(p, "--requests", 1u64, 1 << 40)?;
    if mode == Mode::Extend && requests.is_some() {
        return Err("--requests: --mode extend runs for a --duration".into());
    }
    let (duration_s, warmup_s) = match requests {
        Some(_) => (duration_s.unwrap_or(600.0), 0.0),
        None => (duration_s.unwrap_or(10.0), warmup_s.unwrap_or(1.0)),
    };
    Ok(RunLength {
        duration_s,
        warmup_s,
        requests,
    })
}

/// `--server-pid`: the server's processes, comma-separated (none when
/// absent).
fn parse_server_pids(p: &mut pico_args::Arguments) -> Result<Vec<u32>, String> {
    match opt_string(p, "--server-pid")? {
        None => Ok(Vec::new()),
        Some(list) => list
            .split(',')
            .map(|pid| match pid.trim().parse::<u32>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("--server-pid: {pid:?} is not a process id")),
            })
            .collect(),
    }
}

/// Parses the flags of `ticket-bench` (without the program or subcommand name).
pub fn parse_args(args: Vec<String>) -> Result<Args, String> {
    let mut p = pico_args::Arguments::from_vec(args.into_iter().map(Into::into).collect());
    if p.contains(["-h", "--help"]) {
        return Err(String::new());
    }
    let backend = parse_backend(&mut p)?;
    let mode = parse_mode(&mut p, backend)?;
    let keys = parse_keys(&mut p, mode)?;
    let tls = parse_tls(&mut p, backend)?;
    let (addrs, unix) = parse_server(&mut p, backend, tls.as_ref())?;
    let shape = parse_shape(&mut p, mode, backend)?;
    let (wait_s, lease_s, poll_ms) = parse_waits(&mut p, mode)?;
    let length = parse_length(&mut p, mode)?;
    let threads = num(&mut p, "--threads", 1usize, 64)?.unwrap_or(1);
    let server_pids = parse_server_pids(&mut p)?;
    let places = parse_places(&mut p, backend)?;
    let json = p.contains("--json");
    let quiet = p.contains("--quiet");
    let rest = p.finish();
    if let Some(first) = rest.first() {
        return Err(format!("unexpected argument {:?}", first.to_string_lossy()));
    }
    if threads > shape.connections {
        return Err(format!(
            "--threads: {threads} threads for {} connections",
            shape.connections
        ));
    }
    Ok(Args {
        cfg: Config {
            addrs,
            unix,
            connections: shape.connections,
            depth: shape.depth,
            locks: shape.locks,
            keys,
            mode,
            wait_s,
            lease_s,
            poll_ms,
            threads,
            requests: length.requests,
            renew: shape.renew,
            tls,
        },
        backend,
        duration: Duration::from_secs_f64(length.duration_s),
        warmup: Duration::from_secs_f64(length.warmup_s),
        json,
        quiet,
        server_pids,
        places,
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

/// `--mode`'s name for `m`.
pub(crate) fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Acquire => "acquire",
        Mode::Cycle => "cycle",
        Mode::Contended => "contended",
        Mode::Extend => "extend",
        Mode::ExtendFlood => "extend-flood",
    }
}

/// `--keys`' spelling of `k`.
pub(crate) fn keys_name(k: Keys) -> String {
    match k {
        Keys::Uncontended => "uncontended".into(),
        Keys::Hot(n) => format!("hot:{n}"),
    }
}

//! One run of the load generator: its threads started, the warm-up and
//! the measured window timed (with the progress line), the server's CPU
//! time read at both ends, and the threads' figures gathered into a
//! [`Report`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::args::{mode_name, Args, BackendKind};
use crate::backend::{Backend, Ticketd};
use crate::gen::{self, Config, Mode, Shared, Stats};
use crate::report::Report;
use crate::{etcd, resp};

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
        BackendKind::Ticketd => run_backend(
            Arc::new(Ticketd {
                places: args.places,
            }),
            args,
        ),
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

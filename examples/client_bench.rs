//! Lock cycles per second of the blocking client: THREADS threads share one
//! client (a pool of two connections), each acquiring and releasing a key
//! of its own, for SECONDS seconds.
//!
//! ```text
//! cargo run --release --bin ticketd &
//! cargo run --release --example client_bench -- [HOST:PORT] [THREADS] [SECONDS]
//! ```
//!
//! It prints one line, `cycles/s N threads T`, and exits non-zero if a
//! cycle did not end in a grant and a release.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use ticketd::client::{Acquire, Client, Release, DEFAULT_ADDRESS};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| DEFAULT_ADDRESS.into());
    let threads: usize = args.next().map_or(Ok(1), |s| s.parse())?;
    let seconds: f64 = args.next().map_or(Ok(3.0), |s| s.parse())?;
    let client = Client::connect(addr)?;
    let cycles = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicBool::new(false));
    let run = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|i| {
            let (client, cycles, failed) = (client.clone(), cycles.clone(), failed.clone());
            thread::spawn(move || {
                let key = format!("bench-{i}");
                while start.elapsed() < run {
                    let got = client.acquire(&key, Duration::from_secs(5), Duration::from_secs(30));
                    let ok = match got {
                        Ok(Acquire::Acquired(t)) => matches!(t.release(), Ok(Release::Released)),
                        _ => false,
                    };
                    if !ok {
                        failed.store(true, Ordering::Relaxed);
                        return;
                    }
                    cycles.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().map_err(|_| "a worker panicked")?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let n = cycles.load(Ordering::Relaxed);
    #[allow(clippy::cast_precision_loss)]
    let rate = n as f64 / elapsed;
    println!("cycles/s {rate:.0} threads {threads}");
    if failed.load(Ordering::Relaxed) {
        return Err("a cycle was not granted and released".into());
    }
    Ok(())
}

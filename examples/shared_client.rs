//! Many threads share one client: requests are pipelined over a small pool
//! of connections and each thread gets its own outcome.
//!
//! ```text
//! cargo run --release --bin ticketd &
//! cargo run --example shared_client -- [HOST:PORT]
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use ticketd::client::{Acquire, Client, DEFAULT_ADDRESS};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| DEFAULT_ADDRESS.into());
    // One client for the whole process; clones share its connections.
    let client = Client::builder().address(addr).pool_size(2).build()?;
    let counter = Arc::new(AtomicU64::new(0));
    let start = Instant::now();

    let workers: Vec<_> = (0..8)
        .map(|id| {
            let client = client.clone();
            let counter = Arc::clone(&counter);
            thread::spawn(move || {
                for _ in 0..50 {
                    // All threads compete for one key; the server queues them
                    // FIFO and hands the key over on each release.
                    match client.acquire("counter", Duration::from_secs(10), Duration::from_secs(5))
                    {
                        Ok(Acquire::Acquired(ticket)) => {
                            // Not atomic on purpose: the lock makes it safe.
                            let v = counter.load(Ordering::SeqCst);
                            counter.store(v + 1, Ordering::SeqCst);
                            // Dropping the ticket releases it in the background.
                            drop(ticket);
                        }
                        Ok(other) => eprintln!("worker {id}: not acquired: {other:?}"),
                        Err(e) => eprintln!("worker {id}: {e}"),
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker panicked");
    }
    println!(
        "8 threads x 50 increments under one lock = {} in {:?}",
        counter.load(Ordering::SeqCst),
        start.elapsed()
    );
    Ok(())
}

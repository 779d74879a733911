//! Take a lock, do some work under it, release it.
//!
//! ```text
//! cargo run --release --bin ticketd &
//! cargo run --example acquire_release -- [HOST:PORT]
//! ```

use std::time::Duration;

use ticketd::client::{Acquire, Client, Release, DEFAULT_ADDRESS};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| DEFAULT_ADDRESS.into());
    let client = Client::connect(addr)?;

    // Wait up to 10 s for the key; hold it for at most 30 s.
    match client.acquire(
        "db-migration",
        Duration::from_secs(10),
        Duration::from_secs(30),
    )? {
        Acquire::Acquired(ticket) => {
            println!(
                "acquired {:?} with fencing token {}; {:?} left on the lease",
                ticket.key(),
                ticket.token(),
                ticket.remaining()
            );
            // The critical section. Check the lease before each step that
            // matters: past expires_at() someone else may hold the key.
            for step in 1..=3 {
                if ticket.is_expired() {
                    eprintln!("lease ran out: stopping before step {step}");
                    return Ok(());
                }
                println!("step {step}");
                std::thread::sleep(Duration::from_millis(200));
            }
            match ticket.release()? {
                Release::Released => println!("released"),
                Release::NotHeld => println!("the lease had already ended"),
                Release::Indeterminate | Release::NotSent => {
                    println!("release unconfirmed: the lease ends the lock anyway")
                }
            }
        }
        Acquire::Timeout => println!("someone else held it for the whole wait"),
        Acquire::Busy => println!("the server is at a capacity limit"),
        // Only an acquire with places (a semaphore, a read/write lock).
        Acquire::LimitMismatch(n) => println!("the key is registered with a limit of {n}"),
        // Unknown: must not enter. A grant that may exist ends with its lease.
        Acquire::Indeterminate => println!("outcome unknown: not entering"),
    }
    Ok(())
}

//! Sixteen threads fight over one key through one shared client: no two
//! critical sections overlap, and the tokens, in grant order, strictly
//! increase. Bounded in cycles and in time.

use ticketd_testkit::process as common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::Ticketd;
use ticketd::client::{Acquire, Client, Release};

const THREADS: usize = 16;
const CYCLES_PER_THREAD: usize = 500;
/// Stop early rather than overrun the suite's time budget on a slow machine.
const TIME_BUDGET: Duration = Duration::from_secs(12);

// Long because it is one scenario, step by step.
#[test]
fn sixteen_threads_one_key_tokens_increase_and_sections_never_overlap() {
    let server = Ticketd::start(&[]);
    let client = Client::builder()
        .address(server.addr().to_string())
        .pool_size(4)
        .build()
        .unwrap();
    let inside = Arc::new(AtomicBool::new(false));
    let grants = Arc::new(Mutex::new(Vec::with_capacity(THREADS * CYCLES_PER_THREAD)));
    let not_acquired = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (client, inside, grants, not_acquired) = (
                client.clone(),
                Arc::clone(&inside),
                Arc::clone(&grants),
                Arc::clone(&not_acquired),
            );
            thread::spawn(move || {
                for _ in 0..CYCLES_PER_THREAD {
                    if start.elapsed() > TIME_BUDGET {
                        break;
                    }
                    let ticket = match client
                        .acquire(
                            "contended",
                            Duration::from_secs(10),
                            Duration::from_secs(10),
                        )
                        .unwrap()
                    {
                        Acquire::Acquired(t) => t,
                        other => {
                            // Under a 10 s wait on loopback every call should
                            // be granted; count rather than hide anything else.
                            not_acquired.fetch_add(1, Ordering::SeqCst);
                            eprintln!("not acquired: {other:?}");
                            continue;
                        }
                    };
                    assert!(
                        !inside.swap(true, Ordering::SeqCst),
                        "two critical sections overlap"
                    );
                    // Recorded inside the section, so this is grant order.
                    grants.lock().unwrap().push(ticket.token());
                    assert!(!ticket.is_expired());
                    inside.store(false, Ordering::SeqCst);
                    assert_eq!(ticket.release().unwrap(), Release::Released);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let elapsed = start.elapsed();
    let grants = grants.lock().unwrap();
    assert_eq!(not_acquired.load(Ordering::SeqCst), 0);
    assert!(
        grants.len() >= 1000,
        "only {} cycles in {elapsed:?}",
        grants.len()
    );
    for w in grants.windows(2) {
        assert!(w[0] < w[1], "token {} granted after {}", w[1], w[0]);
    }
    eprintln!(
        "{} acquire/release cycles on one key in {elapsed:?} ({:.0} cycles/s, debug build)",
        grants.len(),
        grants.len() as f64 / elapsed.as_secs_f64()
    );
}

//! The limit server: ticketd's protocol with no lock behind it. Every Acquire
//! is answered `A` at once, every Release `R`. It shows the most this
//! protocol can do on a machine; `make bench` compares ticketd with it.
//!
//!     cargo run --release -p ticketd-bench --bin limit-server -- 127.0.0.1:7480
//!
//! Stops cleanly on SIGINT or SIGTERM (so profilers write their output).
use std::net::TcpListener;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

fn main() {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7480".to_string());
    let listener = match TcpListener::bind(&addr) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("limit-server: cannot listen on {addr}: {e}");
            std::process::exit(2);
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        if let Err(e) = signal_hook::flag::register(sig, Arc::clone(&stop)) {
            eprintln!("limit-server: cannot handle signal {sig}: {e}");
            std::process::exit(1);
        }
    }
    match listener.local_addr() {
        Ok(a) => println!("limit-server listening on {a}"),
        Err(_) => println!("limit-server listening on {addr}"),
    }
    match ticketd_bench::limit::serve(listener, &stop) {
        Ok(s) => println!(
            "limit-server: {} requests on {} connections",
            s.requests, s.connections
        ),
        Err(e) => {
            eprintln!("limit-server: {e}");
            std::process::exit(1);
        }
    }
}

//! `ticket-bench`: the load generator (`ticketd_bench`), against ticketd,
//! Redis or etcd:
//!
//!     cargo run --release -p ticketd-bench --bin ticket-bench -- --mode cycle --depth 16
//!
//! Exits 0, 1 when the run failed or a grant broke FIFO order, 64 on a
//! usage error.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(ticketd_bench::main(args));
}

//! Runs `ticket bench` as an example, the same code as the CLI subcommand:
//!
//!     cargo run --release --example ticket_bench -- --mode cycle --depth 16
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(ticketd::bench::main(args));
}

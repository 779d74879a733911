//! The single-mode server, mostly as the real `ticketd` and `ticket`
//! binaries: PROTOCOL §1 and §2 over TCP, limits, the daemon's command line and
//! signals, the data directory and restart grace, quotas per identity and
//! the memory budget, the admin port, systemd
//! socket activation, the `ticket` command, the library embedded in-process,
//! every program in `examples/`, and the flags the docs name.
//!
//! One test binary; `cargo test --test server MODULE::` runs one file.
//! Helpers come from `ticketd_testkit`.

mod abuse;
mod admin;
mod cli_ticket;
mod data_dir;
mod embed;
mod examples;
mod limits;
mod permits;
mod process;
mod quotas;
mod readme_flags;
mod restart_grace;
mod spec;
mod systemd;
mod wire;

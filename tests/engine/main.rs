//! The engine and everything that runs it in-process, with no socket and no
//! child process: the PROTOCOL §2 tables row by row, multi-step scenarios, the
//! reference model, the hot path's allocations, the in-memory harness, the
//! single-mode simulation, the history checker and the fuzz targets' bodies.
//!
//! One test binary; `cargo test --test engine MODULE::` runs one file.
//! Helpers come from `ticketd_testkit`.

mod alloc;
mod checker;
mod fuzz_regressions;
#[cfg(feature = "harness")]
mod harness;
mod model;
mod permits;
mod permits_model;
mod rows;
mod scenarios;
mod sim_single;

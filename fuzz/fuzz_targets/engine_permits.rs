//! cargo-fuzz entry point; the body and its checks are in `ticketd_testkit::fuzz::engine_permits`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ticketd_testkit::fuzz::engine_permits(data));

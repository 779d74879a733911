//! The tests' one pseudo-random generator: SplitMix64, so that a seed
//! reproduces a simulation or a fault schedule exactly.
//!
//! The cluster simulation, the single-mode simulation and the real-process
//! fault tests all draw from it. It is ticketd's own generator (the one raft's
//! election timeouts draw from), public with the crate's `testkit` feature:
//! one generator in the workspace.

pub use ticketd::rng::SplitMix64;

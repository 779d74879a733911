//! ticketd-testkit: what ticketd's tests share, kept beside the crate.
//!
//! None of this ships: the member is never published, and the `ticketd`
//! package holds none of it. Tests of every workspace member reach their
//! helpers here, and only here.
//!
//! * [`checker`]: the safety checker for recorded client histories (mutual
//!   exclusion, token order, FIFO hand-over, every request answered once).
//! * [`single_sim`]: the deterministic single-mode simulation (clients, the
//!   engine as the server, a hostile network, one seed).
//! * `cluster_sim` (feature `cluster`): the deterministic simulation of a
//!   whole cluster of nodes on in-memory disks.
//! * [`process`]: the real `ticketd` binary as a child process, raw-frame
//!   clients, free loopback ports, the emulator wrapper of cross-built runs.
//! * [`proxy`]: a fault-injecting TCP proxy and a black-hole listener.
//! * [`cluster`]: a cluster of real `ticketd --cluster` processes.
//! * [`netns`]: network partitions between real nodes, in a private network
//!   namespace with nftables.
//! * [`rng`]: the tests' seeded generator.
//! * [`fuzz`]: the bodies of the cargo-fuzz targets (`fuzz/`), which the
//!   tests also run over seeded inputs and every saved crash.
//!
//! It needs ticketd's `testkit` feature (the in-memory disk and the node's
//! trace hooks), which must never be on in a production build.
#![warn(missing_docs)]

pub mod certs;
pub mod checker;
pub mod cluster;
#[cfg(feature = "cluster")]
pub mod cluster_sim;
pub mod fuzz;
pub mod netns;
pub mod process;
pub mod proxy;
pub mod rng;
pub mod single_sim;

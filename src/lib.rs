//! ticketd: a small, fast, correct lock server.
//!
//! A client asks for a named lock (a *key*); the server grants it with a
//! *fencing token*, queues the client for a bounded time if someone else
//! holds it, hands it over FIFO on release, and takes it back when the
//! holder's *lease* runs out. The contract, the protocol itself, is
//! `docs/PROTOCOL.md`; its sections are cited as `PROTOCOL §N`.
//!
//! # Architecture in a page
//!
//! * [`proto`]: the wire codec, both directions. No I/O, no allocation on
//!   decode.
//! * [`readbuf`]: [`readbuf::ReadBuf`], the one read buffer of everything
//!   that reads frames (the server's connections, the client's reader, the
//!   benchmark's load generator): compaction, growth up to a cap.
//! * [`time`]: the [`time::Millis`] newtype and the one place that reads the
//!   OS monotonic clock.
//! * [`limits`]: every bound with its default.
//! * [`engine`]: the lock table, sans-IO. Every operation takes `now`; replies
//!   go to an [`engine::Outbox`] addressed by connection. Deterministic, so
//!   tests can step through it.
//! * [`client`]: the official blocking client (PROTOCOL §3): a pool of
//!   pipelined connections, one deadline per call, Indeterminate when unsure;
//!   and the same rules as a sans-IO state machine ([`client::machine`]).
//! * [`service`]: the trait between the event loop and what answers requests
//!   (single mode: the engine; cluster mode: Raft in front of the engine).
//! * [`server`]: the mio shell, the only code that touches sockets: one
//!   thread, one poll loop, a slab of connections with explicit buffers,
//!   limits on everything. Steppable turn by turn ([`server::Server::poll_once`]).
//! * [`single`]: single mode's service: the engine plus fencing tokens that
//!   keep increasing across restarts, and a restart grace that holds every
//!   key while a lease of the earlier run may still run.
//! * `tls` (feature `tls`, on by default): the rustls configurations of
//!   the client port (`--tls-cert`), the client and peer TLS, from PEM
//!   files; the server drives rustls from its own loop.
//! * [`token`]: fencing tokens with random low bits from the OS generator,
//!   so that a client cannot release or extend a grant it does not hold by
//!   guessing its token.
//! * [`datadir`]: files in a data directory: private (0600 / 0700), replaced
//!   atomically without following symlinks, sealed with their length and a
//!   checksum.
//! * [`config`]: every server setting with its default, and the command line.
//! * [`metrics`]: counters and histograms kept by plain increments, and the
//!   Prometheus text format the admin port (`--admin-listen`: health,
//!   metrics, lock introspection over HTTP, in the same loop) writes them in.
//! * `harness` (feature `harness`, for tests only): the real server loop on
//!   in-memory connections and a manual clock, stepped by the caller, for
//!   deterministic tests of code that uses ticketd.
//! * `testkit` (feature, never in production): the test doubles that must
//!   live inside the crate (cluster mode's in-memory disk, the node's trace
//!   of applied entries) and the seeded generator made public, for the
//!   `ticketd-testkit` workspace member, which holds the history checker,
//!   the simulations and the tests' helpers.
//!
//! The server is one thread and one hand-written `mio` poll loop; there is no
//! async runtime anywhere. Cluster mode adds one helper thread that does
//! nothing but `fdatasync` the write-ahead log, so the loop never waits for
//! the disk.
//!
//! # What a user needs
//!
//! The names most programs use are re-exported here: the client
//! ([`Client`], [`Acquire`], [`Release`], [`Ticket`], [`Error`]), and to run
//! or embed a server, [`Server`], its [`Config`] and single mode's
//! [`SingleService`]; for stepping the lock table in tests, [`Engine`] with
//! its [`Outbox`] and the clock type [`Millis`]. The modules hold the rest.
#![warn(missing_docs)]

#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "cluster")]
pub mod cluster;
#[cfg(feature = "server")]
pub mod codec;
#[cfg(feature = "server")]
pub mod config;
#[cfg(feature = "server")]
pub mod datadir;
#[cfg(feature = "server")]
pub mod engine;
#[cfg(feature = "harness")]
pub mod harness;
// Internal: the engine's keyed tables. Public only so that the workspace's
// tests and simulations can key them reproducibly; not part of the API.
#[cfg(feature = "server")]
#[doc(hidden)]
pub mod hash;
pub mod limits;
#[cfg(feature = "server")]
pub mod metrics;
pub mod proto;
pub mod readbuf;
// Internal: the seeded generator of raft's election timeouts. Public only
// with the `testkit` feature, so that the tests' simulations and fault
// schedules draw from the same generator; not part of the API.
#[cfg(feature = "testkit")]
#[doc(hidden)]
pub mod rng;
#[cfg(all(feature = "cluster", not(feature = "testkit")))]
pub(crate) mod rng;
#[cfg(feature = "server")]
pub mod server;
#[cfg(feature = "server")]
pub mod service;
#[cfg(feature = "server")]
pub mod single;
pub mod time;
#[cfg(feature = "tls")]
pub mod tls;
#[cfg(feature = "server")]
pub mod token;

#[cfg(feature = "client")]
pub use client::{Acquire, Client, ClientBuilder, Error, Release, Ticket};
#[cfg(feature = "server")]
pub use config::Config;
#[cfg(feature = "server")]
pub use engine::{Engine, Outbox};
#[cfg(feature = "server")]
pub use server::{Server, ShutdownHandle};
#[cfg(feature = "server")]
pub use single::SingleService;
pub use time::Millis;

//! ticketd: a small, fast, correct lock server.
//!
//! A client asks for a named lock (a *key*); the server grants it with a
//! *fencing token*, queues the client for a bounded time if someone else
//! holds it, hands it over FIFO on release, and takes it back when the
//! holder's *lease* runs out. The contract is `SPEC.md`; the protocol is
//! described in `docs/PROTOCOL.md`.
//!
//! # Architecture in a page
//!
//! * [`proto`]: the wire codec, both directions. No I/O, no allocation on
//!   decode.
//! * [`time`]: the [`time::Millis`] newtype and the one place that reads the
//!   OS monotonic clock.
//! * [`limits`]: every bound with its default.
//! * [`engine`]: the lock table, sans-IO. Every operation takes `now`; replies
//!   go to an [`engine::Outbox`] addressed by connection. Deterministic, so
//!   tests can step through it.
//! * [`checker`]: a safety checker for recorded client histories (mutual
//!   exclusion, token order, FIFO hand-over, every request answered once).
//! * [`service`]: the trait between the event loop and what answers requests
//!   (single mode: the engine; cluster mode: Raft in front of the engine).
//!
//! The server is one thread and one hand-written `mio` poll loop; there is no
//! async runtime anywhere.
#![warn(missing_docs)]

pub mod checker;
pub mod engine;
pub mod limits;
pub mod proto;
pub mod service;
pub mod time;

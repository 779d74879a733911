//! A ticketd server inside a test: in-memory connections, a manual clock,
//! turns stepped by the caller. **For tests only** (feature `harness`, off
//! by default): never enable it in a production build.
//!
//! [`Harness`] runs the real server loop ([`crate::server::Server`]): the
//! same per-connection state machine (read buffer, frame decoding, the
//! fairness budget, the output soft and hard limits, malformed-input closes
//! with their flush, the outbox and the write cursor), the same service.
//! Only the byte stream under each connection differs: a bounded in-memory
//! pipe ([`MemConn`] is the test's end) instead of a socket, with readiness
//! taken from the pipe instead of from epoll. No socket is opened, no thread
//! is started, nothing sleeps, and the OS clock is never read: the clock
//! moves only by [`Harness::advance`]. So the same calls give the same
//! bytes, the same replies and the same tokens, every run.
//!
//! ```
//! use std::time::Duration;
//! use ticketd::config::Config;
//! use ticketd::harness::Harness;
//! use ticketd::proto::{encode_request, Request};
//!
//! let mut h = Harness::new(Config::default()).unwrap();
//! let mut c = h.connect();
//! let mut frame = Vec::new();
//! encode_request(&Request::Acquire { wait_s: 0, lease_s: 5, owner: 1, key: "db" }, &mut frame);
//! c.write(&frame);
//! h.run_until_idle();
//! // `A`, a token of sequence step 1 (random low bits, seeded: the same
//! // every run), owner 1, "db".
//! let reply = c.take();
//! assert_eq!(reply[0], b'A');
//! let token = u64::from_be_bytes(reply[1..9].try_into().unwrap());
//! assert_eq!(token >> ticketd::token::RANDOM_BITS, 1);
//! h.advance(Duration::from_secs(5));
//! ```
//!
//! A turn ([`Harness::step`]) is one turn of the server loop: connections
//! whose pipe received bytes (or a close) since the last turn are read,
//! their frames handled, the service ticked at the clock's time, replies
//! encoded and written into the pipes. [`Harness::run_until_idle`] steps
//! until a turn would have nothing to do.
//!
//! [`HarnessClient`] is the official client's rules
//! ([`crate::client::machine`]) on an in-memory connection, on the same
//! clock; [`Harness::settle`] moves bytes between clients and the server
//! until nothing moves. A test of "my code calls acquire, the holder's lease
//! ends, my code is handed the key" then runs in one thread, in
//! milliseconds, the same way every time (`examples/deterministic_test.rs`).

mod client;
pub(crate) mod pipe;

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use crate::config::Config;
use crate::engine::ConnId;
use crate::server::{ManualClock, Server, Stats, Status};
use crate::service::Service;
use crate::single::SingleService;
use crate::time::Millis;

pub use client::HarnessClient;
pub use pipe::MemConn;

/// Bytes each way an in-memory connection holds before writes are short or
/// `WouldBlock`, by default: about a loopback socket's buffers.
pub const DEFAULT_PIPE_CAPACITY: usize = 256 * 1024;

/// Turns [`Harness::run_until_idle`] runs at most before it gives up (a
/// service that always has work due would otherwise never be idle).
pub const MAX_IDLE_TURNS: usize = 100_000;

/// The server on in-memory connections and a manual clock. See the module
/// documentation.
pub struct Harness<S: Service = SingleService> {
    server: Server<S>,
    clock: ManualClock,
    pipe_capacity: usize,
    next_peer: u32,
}

impl Harness<SingleService> {
    /// Single mode with `config`'s limits (the server's, the engine's and
    /// `max_lease_s`, as `ticketd` applies them), tokens from the first
    /// sequence step with seeded (repeatable) random low bits, nothing
    /// persisted, the clock at 0 ms. `config.listen`, `config.data_dir` and
    /// `config.restart_grace` are not used (a restart grace needs a data
    /// directory: pass such a service to [`Harness::with_service`]).
    ///
    /// # Errors
    /// An invalid `config`, or the poll behind the service's waker cannot
    /// be created.
    pub fn new(config: Config) -> io::Result<Self> {
        // Seeded random token bits: a run repeats exactly.
        let service = SingleService::with_first_token(config.engine.clone(), 1)
            .with_token_rng(crate::token::TokenRng::seeded(1))
            .with_max_lease(config.max_lease_s);
        Harness::with_service(config, service)
    }
}

impl<S: Service> Harness<S> {
    /// The server with `config` around `service`, the clock at 0 ms. The
    /// harness never polls: a service with event sources of its own
    /// (cluster mode's peer sockets) does not run here.
    ///
    /// # Errors
    /// See [`Harness::new`].
    pub fn with_service(config: Config, service: S) -> io::Result<Self> {
        let clock = ManualClock::default();
        let server = Server::in_memory(config, service, clock.clone())?;
        Ok(Harness {
            server,
            clock,
            pipe_capacity: DEFAULT_PIPE_CAPACITY,
            next_peer: 1,
        })
    }

    /// Sets the capacity (bytes each way) of the connections made from now
    /// on: small pipes make the server's output limits reachable.
    pub fn set_pipe_capacity(&mut self, bytes: usize) {
        self.pipe_capacity = bytes.max(1);
    }

    /// A new connection, accepted at once as the listener would: over
    /// `max_conns` (or during a shutdown) it is closed at once, and the
    /// returned end reads as closed. Connection `n` (from 1) is named
    /// `10.x.y.z:1` in the logs, where `x.y.z` is `n`.
    pub fn connect(&mut self) -> MemConn {
        self.connect_with_id().0
    }

    /// [`Harness::connect`], and the connection's id as the service sees it
    /// (`None` when it was refused).
    pub fn connect_with_id(&mut self) -> (MemConn, Option<ConnId>) {
        let (server_end, client_end) = pipe::pair(self.pipe_capacity);
        let n = self.next_peer;
        self.next_peer = self.next_peer.wrapping_add(1);
        let peer = SocketAddr::from((Ipv4Addr::from(0x0A00_0000 | (n & 0x00FF_FFFF)), 1));
        let id = self.server.connect_mem(server_end, peer);
        (client_end, id)
    }

    /// One server loop turn at the clock's current time.
    pub fn step(&mut self) -> Status {
        self.server.step_mem()
    }

    /// Moves the clock forward by `by` (whole milliseconds, rounded down).
    /// Nothing runs until the next [`Harness::step`].
    pub fn advance(&mut self, by: Duration) {
        self.clock
            .advance_ms(u64::try_from(by.as_millis()).unwrap_or(u64::MAX));
    }

    /// Steps until a turn would have nothing to do (no input, no output
    /// that can move, no deadline due, no close waiting for this moment), or
    /// the server stopped; returns the turns run. Gives up after
    /// [`MAX_IDLE_TURNS`].
    pub fn run_until_idle(&mut self) -> usize {
        let mut turns = 0;
        while turns < MAX_IDLE_TURNS && self.server.has_work_mem() {
            turns += 1;
            if self.step() == Status::Stopped {
                break;
            }
        }
        turns
    }

    /// The clock's time.
    #[must_use]
    pub fn now(&self) -> Millis {
        self.server.now()
    }

    /// Starts a graceful shutdown, as SIGTERM would: stop accepting, flush
    /// within the flush timeout, close. Happens on the next turns.
    pub fn shutdown(&mut self) {
        self.server.shutdown_handle().shutdown();
    }

    /// The server's counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.server.stats()
    }

    /// Open connections (including those being closed).
    #[must_use]
    pub fn connection_count(&self) -> usize {
        self.server.connection_count()
    }

    /// The service, for inspection.
    #[must_use]
    pub fn service(&self) -> &S {
        self.server.service()
    }

    /// The service, mutably (between turns).
    pub fn service_mut(&mut self) -> &mut S {
        self.server.service_mut()
    }
}

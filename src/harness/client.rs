//! A client of the harness: the official client's rules
//! ([`crate::client::machine::Machine`]) on an in-memory connection, on the
//! harness's clock.

use std::time::Duration;

use crate::client::machine::{CallId, Held, Machine, Outcome};
use crate::client::Error;
use crate::proto::Places;
use crate::service::Service;

use super::{Harness, MemConn};

/// Loop rounds [`Harness::settle`] runs at most.
const MAX_SETTLE_ROUNDS: usize = 10_000;

/// A [`Machine`] wired to a [`MemConn`] of a [`Harness`]. Calls are queued
/// on the machine; [`Harness::settle`] moves their bytes and the replies
/// until nothing moves any more. When the machine gives up on its
/// connection, or the server closes it, the next pump opens a new one (and
/// what was definitely not sent goes out there).
///
/// ```
/// use std::time::Duration;
/// use ticketd::client::machine::{AcquireOutcome, Outcome};
/// use ticketd::config::Config;
/// use ticketd::harness::{Harness, HarnessClient};
///
/// const S: Duration = Duration::from_secs(1);
/// let mut h = Harness::new(Config::default())?; // clock at 0 ms
/// let (mut alice, mut bob) = (HarnessClient::new(1), HarnessClient::new(2));
/// alice.acquire(&h, "db", 10 * S, 5 * S)?;
/// h.settle(&mut [&mut alice, &mut bob]); // alice holds "db"
/// bob.acquire(&h, "db", 30 * S, 30 * S)?;
/// h.settle(&mut [&mut alice, &mut bob]); // bob is queued
/// alice.crash(); // the holder dies, releasing nothing
/// h.advance(5 * S + Duration::from_millis(1)); // just past its 5 s lease
/// h.settle(&mut [&mut bob]);
/// let Some((_, Outcome::Acquire(AcquireOutcome::Acquired(held)))) = bob.poll_outcome() else {
///     panic!("bob was not handed the key");
/// };
/// assert_eq!(held.token >> ticketd::token::RANDOM_BITS, 2); // the fencing token rose
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct HarnessClient {
    machine: Machine,
    conn: Option<MemConn>,
    /// Handed out by the machine, not yet taken by the pipe.
    unsent: Vec<u8>,
    /// Bytes written and read, in order, for transcripts.
    written: usize,
    read: usize,
}

impl HarnessClient {
    /// A client whose owners come from `seed`, not connected yet.
    #[must_use]
    pub fn new(seed: u64) -> HarnessClient {
        HarnessClient {
            machine: Machine::new(seed),
            conn: None,
            unsent: Vec::new(),
            written: 0,
            read: 0,
        }
    }

    /// Queues an acquire at the harness's time (see [`Machine::acquire`]).
    ///
    /// # Errors
    /// A bad key or lease; nothing is queued.
    pub fn acquire<S: Service>(
        &mut self,
        h: &Harness<S>,
        key: &str,
        wait: Duration,
        lease: Duration,
    ) -> Result<CallId, Error> {
        self.machine.acquire(h.now(), key, wait, lease)
    }

    /// Queues an acquire of one of `places.limit` places of `key` in
    /// `places.mode` (protocol 1.2) at the harness's time (see
    /// [`Machine::acquire_with`]).
    ///
    /// # Errors
    /// A bad key or lease, or a limit of 0; nothing is queued.
    pub fn acquire_with<S: Service>(
        &mut self,
        h: &Harness<S>,
        key: &str,
        places: Places,
        wait: Duration,
        lease: Duration,
    ) -> Result<CallId, Error> {
        self.machine
            .acquire_with(h.now(), key, Some(places), wait, lease)
    }

    /// Queues a release at the harness's time (see [`Machine::release`]).
    ///
    /// # Errors
    /// A bad key; nothing is queued.
    pub fn release<S: Service>(
        &mut self,
        h: &Harness<S>,
        key: &str,
        token: u64,
    ) -> Result<CallId, Error> {
        self.machine.release(h.now(), key, token)
    }

    /// Queues an extend of `held` at the harness's time (see
    /// [`Machine::extend`]).
    ///
    /// # Errors
    /// A bad lease; nothing is queued.
    pub fn extend<S: Service>(
        &mut self,
        h: &Harness<S>,
        held: &Held,
        lease: Duration,
    ) -> Result<CallId, Error> {
        self.machine.extend(h.now(), held, lease)
    }

    /// The next decided outcome (see [`Machine::poll_outcome`]).
    pub fn poll_outcome(&mut self) -> Option<(CallId, Outcome)> {
        self.machine.poll_outcome()
    }

    /// The machine, for anything else.
    pub fn machine(&mut self) -> &mut Machine {
        &mut self.machine
    }

    /// Bytes this client has written to and read from the server so far.
    #[must_use]
    pub fn bytes_moved(&self) -> (usize, usize) {
        (self.written, self.read)
    }

    /// The process crashes: its connection closes, nothing is released, no
    /// outcome is reported any more.
    pub fn crash(self) {
        drop(self);
    }

    /// Requests out: returns whether any byte moved.
    fn push_out<S: Service>(&mut self, h: &mut Harness<S>) -> bool {
        let now = h.now();
        self.machine.handle_timeout(now);
        self.check_close();
        if self.machine.pending() == 0 && self.unsent.is_empty() {
            return false;
        }
        let conn = self.conn.get_or_insert_with(|| h.connect());
        if conn.is_closed_by_server() {
            // Refused (over max_conns) or closed: nothing queued goes out
            // on it; the next pump tries a new connection.
            self.drop_conn();
            return false;
        }
        self.machine.transmit(now, &mut self.unsent);
        let n = conn.write(&self.unsent);
        self.unsent.drain(..n);
        self.written += n;
        n > 0
    }

    /// Replies in: returns whether any byte moved.
    fn take_in<S: Service>(&mut self, h: &Harness<S>) -> bool {
        let Some(conn) = self.conn.as_mut() else {
            return false;
        };
        let bytes = conn.take();
        let closed = conn.is_closed_by_server();
        self.read += bytes.len();
        self.machine.receive(h.now(), &bytes);
        if closed {
            self.drop_conn();
        }
        self.check_close();
        !bytes.is_empty() || closed
    }

    fn check_close(&mut self) {
        if self.machine.wants_close() {
            self.drop_conn();
        }
    }

    fn drop_conn(&mut self) {
        self.conn = None;
        // What the machine handed out and the pipe never took was not sent.
        self.unsent.clear();
        self.machine.connection_lost();
    }
}

impl<S: Service> Harness<S> {
    /// Moves bytes between `clients` and the server, stepping it, until
    /// nothing moves and the server is idle, at the clock's current time.
    /// Returns the server turns run.
    pub fn settle(&mut self, clients: &mut [&mut HarnessClient]) -> usize {
        let mut turns = 0;
        for _ in 0..MAX_SETTLE_ROUNDS {
            let mut moved = false;
            for c in clients.iter_mut() {
                moved |= c.push_out(self);
            }
            let ran = self.run_until_idle();
            turns += ran;
            for c in clients.iter_mut() {
                moved |= c.take_in(self);
            }
            if !moved && ran == 0 {
                break;
            }
        }
        turns
    }
}

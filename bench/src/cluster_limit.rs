//! The cluster limit: the ceiling of a three-node, fsync-on service of
//! ticketd's protocol on this machine, built the way ticketd's cluster is.
//!
//! It is the replicated counterpart of [`super::limit`]: the least work a
//! server must do to answer a request only once a majority of three nodes
//! holds it on disk, and nothing more. No consensus, no elections, no lock
//! table, no snapshots, no checksums: node 1 is the leader for good, and the
//! clients all talk to it (the cheapest layout), or, when the followers are
//! given an address for clients, also to them (the layout ticketd's
//! cluster is benchmarked in: each node serves clients). A follower reads
//! its clients' requests each turn and forwards them to the leader in one
//! frame; they join the leader's batch like its own clients' requests, and
//! once the batch is committed the leader sends their answers back to that
//! follower in one frame, which passes each on. Those are the two messages
//! a ticketd follower's client costs (its proposals forwarded, the commit
//! notice back), and no more: nothing is applied on the follower, and only
//! a follower that forwarded something hears of the commit.
//!
//! Each loop turn the leader reads its clients' requests, prepares their
//! answers without looking anything up (as the limit server does: `A` with a
//! new token, `R`), and makes the turn's requests one batch (up to 16 MiB;
//! the rest waits for the next turn). The batch goes to both followers at
//! once, then into the leader's own log file. Each node's log is a file of
//! zeros written ahead of time, so a write overwrites blocks the file
//! already has (the log writes round within it: a benchmark keeps no
//! history). A sync thread runs `fdatasync`, one at a time, each covering
//! every batch written before it began, and wakes the loop through a `mio`
//! waker, like ticketd's cluster node (which starts each sync from its
//! loop; this thread starts the next one itself, which favours the limit).
//! A follower acknowledges the highest batch its last `fdatasync` covered.
//! A batch is committed once two of the three nodes hold it durably; then
//! its answers are sent.
//!
//! ticketd's cluster does all of this and more, so its distance to this
//! ceiling is what Raft, the lock table and the rest cost; and if this
//! ceiling is short of a target, no three-node service built the same way
//! (one `fdatasync` at a time per node, group commit per loop turn,
//! loopback TCP, the three logs on one disk) reaches it on the machine.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use mio::{Interest, Token};
use slab::Slab;

use super::conn::BufferedConn;

mod follower;
mod leader;
mod log;
#[cfg(test)]
mod tests;

pub use follower::serve_follower;
pub use leader::serve_leader;

const LISTENER: Token = Token(usize::MAX - 1);
const WAKER: Token = Token(usize::MAX - 2);
/// A follower's listener for clients of its own.
const CLIENT_LISTENER: Token = Token(usize::MAX - 3);
/// A follower's connection from the leader.
const LEADER: Token = Token(usize::MAX - 4);
/// Tokens of the leader's connections to its followers: `PEER_BASE + i`.
const PEER_BASE: usize = usize::MAX - 16;
/// Bytes of zeros each log file is given by default before the run; writes
/// wrap round within them, so every write lands on blocks the file already
/// has (as ticketd's WAL keeps zeros written ahead of its end).
pub const LOG_BYTES: u64 = 64 << 20;
/// Frame header between leader and follower: payload length (u32) and batch
/// number (u64), little-endian. An acknowledgement is a batch number alone.
const FRAME_HEADER_BYTES: usize = 12;
/// The largest batch: the leader leaves what would pass it for the next
/// turn, a follower refuses a bigger one.
const MAX_BATCH_BYTES: usize = if cfg!(test) { 64 << 10 } else { 16 << 20 };
/// A follower's words to the leader are 8 bytes, little-endian: a batch
/// number it acknowledges (always below 2^63), or, with this bit set, the
/// header of requests it forwards from its own clients, their length in the
/// low bits, the requests following back to back.
const FORWARD_FLAG: u64 = 1 << 63;
/// The most a follower forwards in one frame: half a batch, so that a frame
/// always fits the batch of the turn after one it did not fit.
const MAX_FORWARD_BYTES: usize = MAX_BATCH_BYTES / 2;
/// The batch number of a leader's frame that carries answers for a
/// follower's clients instead of a batch: their answers back to back, in
/// the order the follower forwarded the requests.
const RELAY_SEQ: u64 = u64::MAX;
/// The largest frame of answers a follower accepts: a batch's requests
/// may each be answered with a few more bytes than they took.
const MAX_RELAY_BYTES: usize = 2 * MAX_BATCH_BYTES;
/// Read at most this much from one client per turn, for fairness.
const READ_PER_TURN_BYTES: usize = 256 * 1024;
/// Stop reading a client while this many answer bytes wait to be sent.
const MAX_PENDING_REPLY_BYTES: usize = 4 << 20;

/// What one node of the cluster limit did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterLimitStats {
    /// Requests read from clients (leader) or 0 (follower).
    pub requests: u64,
    /// Batches written to this node's log.
    pub batches: u64,
    /// `fdatasync` calls this node's sync thread made.
    pub syncs: u64,
    /// Time those calls took, in total.
    pub sync_time: Duration,
}

/// A client connection; `generation` tells apart the connections that
/// reuse one slab slot.
struct Client {
    conn: BufferedConn,
    generation: u64,
}

/// Takes every connection waiting on `listener` as a client of its own
/// (a new generation in `clients`), registered for reading.
fn accept_all(
    listener: &mio::net::TcpListener,
    clients: &mut Slab<Client>,
    generation: &mut u64,
    registry: &mio::Registry,
) -> io::Result<()> {
    loop {
        match listener.accept() {
            Ok((mut stream, _)) => {
                let _ = stream.set_nodelay(true);
                let entry = clients.vacant_entry();
                registry.register(&mut stream, Token(entry.key()), Interest::READABLE)?;
                *generation += 1;
                entry.insert(Client {
                    conn: BufferedConn::new(stream),
                    generation: *generation,
                });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Ok(()),
        }
    }
}

/// Connects to `addr`, trying again every 20 ms until `within` has passed.
fn connect_retrying(addr: SocketAddr, within: Duration) -> io::Result<std::net::TcpStream> {
    let end = Instant::now() + within;
    loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= end => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Whether an I/O result on the leader's connection says the leader is gone
/// (a reset or a broken pipe: killed or closed); other errors are errors.
fn leader_gone(r: io::Result<()>) -> io::Result<bool> {
    match r {
        Ok(()) => Ok(false),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            ) =>
        {
            Ok(true)
        }
        Err(e) => Err(e),
    }
}

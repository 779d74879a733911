//! One cluster node, sans-IO: a raft-rs `RawNode` over the [`Wal`], the
//! replicated [`StateMachine`], client proposals and the leader's timers.
//!
//! The caller (the server loop, or the simulator) feeds it client requests,
//! peer messages and the time, calls [`Node::end_turn`] once per loop turn,
//! sends [`Node::take_messages`] to peers and writes the replies it put in
//! the [`Outbox`](crate::engine::Outbox). It never reads a clock and never touches a socket.
//!
//! One concept a file:
//!
//! * this file: [`Node`], its settings, its errors, opening one, the
//!   accessors and the peer-facing entry points (`step`, `take_messages`);
//! * `ready`: the Ready pipeline and the durability bookkeeping (write,
//!   background fsync, persisted messages);
//! * `propose`: client requests, proposal batching and tracking, and
//!   re-proposal of lost proposals;
//! * `apply`: applying committed entries and routing their answers;
//! * `timers`: raft's clock and the leader's lease and wait timers;
//! * `membership`: conf changes, proposed and applied, and the members;
//! * `snapshot`: installing a received snapshot and compacting the log;
//! * `guard`: peer messages checked before raft steps them (raft panics on
//!   some no correct peer sends);
//! * `holds`: the grant times behind the wait and hold histograms;
//! * `logger`: raft's slog output, forwarded to the `log` crate.
//!
//! # The Ready order (see `docs/CLUSTER.md`)
//!
//! Leader messages go out first (they may precede the local fsync); a
//! received snapshot is staged and restored; committed entries (durable on
//! a majority, and locally too except on a leader that defers its own
//! fsync) are applied; new entries and the hard state are staged;
//! forwarded proposals go out (they claim nothing about local state);
//! everything is written with one write and raft is advanced at once
//! (`advance_append_async`). The fsync runs in the background
//! ([`Wal::start_sync`]): one at a time, each covering every Ready written
//! before it began. When it is over, raft learns which Readys are durable
//! (`on_persist_ready`) and their persisted messages (votes, append acks)
//! go out. The loop never waits for the disk: while an fsync runs it keeps
//! reading requests, stepping peer messages and writing the next batch.
//!
//! # Proposals
//!
//! Each client request gets a request id (node, boot epoch, seq) and is
//! proposed at once. A node that knows no leader, or whose backlog of
//! unapplied proposals is full, answers an acquire Busy and a release
//! NotReleased at once: it was never proposed, so both are true. A proposal
//! can be lost silently (a forwarded message dropped, a deposed leader's
//! entry overwritten), so an unapplied one is proposed again, under the same
//! id, after two election timeouts, when the leader changes, or when the
//! index a local leader gave it applies with another command. The state
//! machine's dedup makes that safe. One that applied inside a snapshot this
//! node installed is proposed again at once too: when its duplicate
//! applies, an acquire still granted to it (the table records each
//! holder's request id) is answered with that grant.
//!
//! A connection that closes cancels its acquires only (PROTOCOL §2.5): its
//! releases and extends stay tracked, proposed again if lost, and apply
//! unanswered; a grant that applies for an acquire of a closed connection
//! is released at once ([`Node::disconnect`]).
//!
//! # Leader timers (PROTOCOL §2.4)
//!
//! Only the leader keeps a min-heap of deadlines: each grant's lease and each
//! queued acquire's wait, measured from when the leader applied it. When one
//! is due and still current, the leader proposes `Expire` or `WaitTimeout`,
//! which every node validates on apply. A new leader first waits until it has
//! applied its own term's first entry, then rebuilds the heap from the
//! replicated table with full durations: a key may expire late, never early.
//! A key registered with a limit (protocol 1.2, PROTOCOL §6) has a grant per
//! permit, each with its own token, lease and generation: each has its own
//! deadline and its own `Expire`, and a new leader finds every one
//! ([`StateMachine::holders`]).
//!
//! A lease's deadline is `applied_at + lease + 1 ms` ([`lease_deadline`]).
//! Clocks are read in whole milliseconds, truncated, so a leader that applies
//! a grant in the millisecond its client wrote the request may have read a
//! time up to 1 ms earlier than the client's; the extra millisecond keeps
//! `Expire` from being proposed before the client's own `written + lease`,
//! as the single-node engine does.

mod apply;
mod guard;
mod holds;
mod logger;
mod membership;
mod propose;
mod ready;
mod seqs;
mod snapshot;
#[cfg(test)]
mod tests;
mod timers;

pub use logger::{quiet_logger, raft_logger};
pub use timers::lease_deadline;

use membership::fill_addrs;
use ready::coalesce_acks;
use seqs::{ByIndex, SeqMap, SeqSet};

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::fmt;
use std::io;

use std::net::SocketAddr;

use raft::eraftpb::{ConfState, Message, MessageType};
use raft::{RawNode, SnapshotStatus, StateRole};

use crate::cluster::command::{DecodeError, Origin, Rid};
use crate::cluster::log::{Disk, LogStore, Wal};
use crate::cluster::rng::SplitMix64;
use crate::cluster::state::{Applied, StateMachine};
use crate::engine::ConnId;
use crate::limits::EngineLimits;
use crate::metrics::{Histogram, HoldIndex, HOLD_BOUNDS_MS, WAIT_BOUNDS_MS};
use crate::server::ratelimit::LogLimit;
use crate::time::Millis;
use crate::token::TokenRng;

/// Settings of one node. Every node of a cluster must use the same `limits`.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// This node's id (1..).
    pub id: u64,
    /// Every voter's id, this node's included: the configuration of a
    /// static cluster's first start. Once the data directory holds a
    /// configuration, that one is used (a difference is logged).
    pub voters: Vec<u64>,
    /// Start with no configuration of its own on an empty data directory,
    /// and wait to be added by the leader (`ticketd --join`).
    pub join: bool,
    /// Peer addresses from the command line: recorded as the members'
    /// addresses on a first static start, and for members whose address
    /// the replicated state lacks (state written by an older version).
    pub peer_addrs: BTreeMap<u64, SocketAddr>,
    /// Milliseconds per Raft tick.
    pub tick_ms: u64,
    /// Ticks without a leader before an election (randomised in [n, 2n)).
    pub election_tick: usize,
    /// Ticks between leader heartbeats.
    pub heartbeat_tick: usize,
    /// The lock table's capacity limits.
    pub limits: EngineLimits,
    /// Unapplied client proposals before new requests are refused.
    pub max_pending: usize,
    /// Applied entries between snapshots (log compaction).
    pub snapshot_every: u64,
    /// Log size that triggers a snapshot even before `snapshot_every`.
    pub max_wal_bytes: u64,
    /// Seed of the election-timeout draws.
    pub seed: u64,
    /// Record (index, term, hash) of every applied entry, for checkers
    /// (feature `testkit`, never in production).
    #[cfg(any(test, feature = "testkit"))]
    pub trace_applied: bool,
    /// Entropy for the data directory id drawn on first start (the server
    /// passes the time and process id; the simulator a seed).
    pub uuid_entropy: u64,
    /// A deliberate bug, for the simulation's self-test only (feature
    /// `testkit`, never in production): a leader's Expire timer of an
    /// earlier lease generation still fires, and the Expire it proposes ends
    /// the grant on apply as if no Extend had happened since.
    #[cfg(any(test, feature = "testkit"))]
    pub bug_stale_expire: bool,
    /// Draw the random low bits of tokens from the OS generator (the
    /// server); when false, from a generator seeded with `seed` (the
    /// simulator, so that a seed replays exactly).
    pub os_token_bits: bool,
    /// How often a leader whose followers commit without it syncs its own
    /// log, in milliseconds; 0 syncs every batch. A leader counts toward a
    /// commit only what its own finished fsync covers, so while its live
    /// followers form a majority by themselves its fsync adds nothing to
    /// commits: it defers it to this interval (or until its followers
    /// stop forming a majority) and applies what they committed straight
    /// from its log. See [`Node::end_turn`].
    pub leader_sync_ms: u64,
}

impl NodeConfig {
    /// Defaults for node `id` of `voters`: 100 ms ticks, elections after
    /// 1–2 s, heartbeats every 200 ms.
    #[must_use]
    pub fn new(id: u64, voters: Vec<u64>) -> Self {
        NodeConfig {
            id,
            voters,
            join: false,
            peer_addrs: BTreeMap::new(),
            tick_ms: 100,
            election_tick: 10,
            heartbeat_tick: 2,
            limits: EngineLimits::default(),
            max_pending: 8192,
            snapshot_every: 10_000,
            max_wal_bytes: 64 << 20,
            seed: id,
            #[cfg(any(test, feature = "testkit"))]
            trace_applied: false,
            uuid_entropy: id,
            #[cfg(any(test, feature = "testkit"))]
            bug_stale_expire: false,
            os_token_bits: true,
            leader_sync_ms: DEFAULT_LEADER_SYNC_MS,
        }
    }
}

/// Why a node cannot start or must stop.
#[derive(Debug)]
pub enum NodeError {
    /// The data directory failed.
    Io(io::Error),
    /// raft-rs refused its configuration or state.
    Raft(raft::Error),
    /// The data directory's configuration does not include this node (it
    /// belongs to another node or cluster).
    VoterMismatch {
        /// Voters and learners recorded in the data directory.
        stored: Vec<u64>,
        /// This node's id.
        given: Vec<u64>,
    },
    /// A snapshot that does not decode.
    BadSnapshot(DecodeError),
}

impl fmt::Display for NodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodeError::Io(e) => write!(f, "storage: {e}"),
            NodeError::Raft(e) => write!(f, "raft: {e}"),
            NodeError::VoterMismatch { stored, given } => write!(
                f,
                "the data directory belongs to a cluster with voters and learners \
                 {stored:?}, which do not include node {given:?}; refusing to start"
            ),
            NodeError::BadSnapshot(e) => write!(f, "snapshot: {e}"),
        }
    }
}

impl std::error::Error for NodeError {}

impl From<io::Error> for NodeError {
    fn from(e: io::Error) -> Self {
        NodeError::Io(e)
    }
}

impl From<raft::Error> for NodeError {
    fn from(e: raft::Error) -> Self {
        NodeError::Raft(e)
    }
}

#[derive(Debug)]
struct Pending {
    conn: ConnId,
    /// The log entry the request is (token bits, then the command), a
    /// slice of [`Node::entry_buf`]; emptied once the acquire is queued,
    /// as it is never proposed again.
    entry: bytes::Bytes,
    /// When the request arrived (for `ticketd_wait_seconds`).
    received_at: Millis,
    proposed_at: Millis,
    /// The acquire applied and queued: it waits for a later answer and is
    /// never proposed again.
    queued: bool,
    acquire: bool,
    /// Its connection closed before the answer: a release or an extend
    /// (PROTOCOL §2.5: only queued acquires are cancelled by a close), or the
    /// release of a grant nobody saw. It still goes into the log, is
    /// proposed again if lost, and its answer goes to nobody.
    closed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Expire {
        key: String,
        token: u64,
        generation: u64,
    },
    Wait {
        key: String,
        waiter: Rid,
    },
}

/// Counters for logs, tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Client proposals made (first attempts).
    pub proposed: u64,
    /// Proposals made again under the same rid.
    pub reproposed: u64,
    /// Requests refused without proposing (no leader, full backlog).
    pub refused: u64,
    /// Requests of ours that applied inside an installed snapshot with an
    /// answer the table cannot tell: their connections were closed.
    pub unanswerable: u64,
    /// Grants applied for requests of ours whose connections had closed
    /// (nobody can see them): each is released at once.
    pub unseen_released: u64,
    /// Expire / WaitTimeout proposals made by this node as leader.
    pub timer_proposals: u64,
    /// Ready batches written.
    pub batches: u64,
    /// Background fsyncs started (each covers every batch written before).
    pub syncs: u64,
    /// Snapshots taken locally.
    pub snapshots_taken: u64,
    /// Snapshots installed from a leader.
    pub snapshots_installed: u64,
    /// Times this node learned of a new leader.
    pub leader_changes: u64,
    /// Peer messages dropped before raft saw them: raft would have
    /// panicked on them, or trusted what no correct peer says (`guard`).
    pub refused_messages: u64,
}

/// A voter or learner as [`Node::members`] lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// Its node id.
    pub id: u64,
    /// A learner (no vote), not a voter.
    pub learner: bool,
    /// On the leader: the highest log index known to be on it.
    pub matched: Option<u64>,
    /// On the leader: whether it was heard from within an election timeout.
    pub reachable: Option<bool>,
}

/// One applied entry as seen by a checker: (index, term, hash of the data),
/// or a snapshot install at (index, term, 0) with `snapshot = true`
/// (feature `testkit`).
#[cfg(any(test, feature = "testkit"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Traced {
    /// Log index.
    pub index: u64,
    /// Entry term.
    pub term: u64,
    /// FNV-1a of the entry's data.
    pub hash: u64,
    /// A snapshot install rather than one entry.
    pub snapshot: bool,
    /// The client request this entry applied (not as a duplicate).
    pub request: Option<Rid>,
}

/// One node. See the module documentation.
pub struct Node<D: Disk> {
    cfg: NodeConfig,
    rn: RawNode<LogStore>,
    wal: Wal<D>,
    sm: StateMachine,
    applied: u64,
    epoch: u64,
    rng: SplitMix64,
    /// The random low bits of the tokens of the entries this node proposes.
    token_rng: TokenRng,
    role: (u64, StateRole),
    leader: u64,
    next_tick: Millis,
    next_repropose_check: Millis,
    next_seq: u64,
    /// This node's client requests not yet answered, by sequence.
    pending: SeqMap<Pending>,
    /// The sequences of requests in `pending` not yet applied; the lowest is
    /// the floor written into each proposed entry.
    unapplied: SeqSet,
    /// Log index -> (term, sequence) of the proposals a local leader placed.
    by_index: ByIndex,
    /// The requests in `pending` of each local connection, as (connection,
    /// sequence): one set for all, so a connection's first request and its
    /// last answer add and drop no set of their own.
    conns: BTreeSet<(ConnId, u64)>,
    cancels: VecDeque<Origin>,
    /// Local connections to close: a request of theirs applied where this
    /// node cannot tell its answer ([`Node::take_closes`]).
    closes: Vec<ConnId>,
    timers: BinaryHeap<Reverse<(Millis, u64, Timer)>>,
    timer_seq: u64,
    timers_ready: bool,
    msgs: Vec<Message>,
    /// Where client requests' entries are written, one after the other:
    /// each is split off as a `Bytes` sharing the buffer, so raft's clones
    /// of it (into its log, into each follower's append) allocate nothing.
    entry_buf: bytes::BytesMut,
    /// One request's entry on its way into `entry_buf`.
    entry_scratch: Vec<u8>,
    /// What applying an entry did, its buffers kept from entry to entry.
    apply_out: Applied,
    stats: NodeStats,
    #[cfg(any(test, feature = "testkit"))]
    trace: Vec<Traced>,
    /// The configurations applied conf changes switched to, latest last
    /// (at most [`CONF_HISTORY`]).
    #[cfg(any(test, feature = "testkit"))]
    conf_history: VecDeque<ConfState>,
    /// Readys written but not known durable, oldest first: their number
    /// and the messages that must wait for that (votes, append acks).
    unsynced: VecDeque<(u64, Vec<Message>)>,
    /// The number of the last Ready the running fsync covers.
    syncing: Option<u64>,
    /// The number of the last Ready handled.
    last_ready: u64,
    /// When this node last began an fsync.
    last_sync_began: Millis,
    /// A leader's committed conf change waits for raft, which hands it out
    /// only once durable here: the leader syncs at once.
    conf_change_waits: bool,
    /// Request to grant of this node's own clients' acquires.
    wait_ms: Histogram,
    /// Grant to release or expiry, counted by the node that is leader
    /// when the end applies (see [`Node::lock_histograms`]).
    hold_ms: Histogram,
    /// Every current grant, with when this node applied it.
    holds: HoldIndex,
    failed: Option<String>,
    /// The disk wakes the server's poll when a background fsync is over.
    sync_wakes: bool,
    /// Client requests of this turn not yet proposed (their seqs, in
    /// arrival order): [`Node::end_turn`] proposes them as one raft
    /// message, so a turn's requests travel in one forward and one append.
    batch: Vec<u64>,
    /// Raised whenever the members (addresses, configuration) change.
    members_version: u64,
    /// A conf change applied: snapshot at once, so that a node added
    /// later gets the configuration in a snapshot, never from entries
    /// that predate it.
    snapshot_now: bool,
    /// Index of the last conf change this node proposed as leader.
    conf_proposed_at: u64,
    /// A snapshot raft took from a peer: its index, term and the table its
    /// data decoded to when it was checked, for the install.
    checked_snapshot: Option<(u64, u64, StateMachine)>,
    /// Warnings about refused peer messages, rate-limited.
    refusal_log: LogLimit,
}

impl<D: Disk> fmt::Debug for Node<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.cfg.id)
            .field("epoch", &self.epoch)
            .field("applied", &self.applied)
            .field("leader", &self.leader)
            .finish_non_exhaustive()
    }
}

/// [`NodeConfig::leader_sync_ms`]'s default: a leader whose followers
/// commit without it syncs its log at most 200 times a second, not once
/// per batch; a follower that stops answering without its connection
/// failing delays commits by at most this much until raft's quorum check
/// counts it out.
pub const DEFAULT_LEADER_SYNC_MS: u64 = 5;
const MAX_CANCELS: usize = 65_536;
const MAX_TIMERS_PER_TICK: usize = 4096;
/// How many applied configurations a test build remembers.
#[cfg(any(test, feature = "testkit"))]
const CONF_HISTORY: usize = 64;

#[cfg(any(test, feature = "testkit"))]
fn fnv(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl<D: Disk> Node<D> {
    /// Opens a node on `disk`: recovers the log, checks (or, on a fresh disk,
    /// records) the voter set, raises the boot epoch durably, restores the
    /// table from the latest snapshot.
    pub fn open(cfg: NodeConfig, disk: D, logger: &slog::Logger) -> Result<Self, NodeError> {
        let (mut wal, rec) = Wal::open(disk)?;
        let mut store = rec.store;
        let fresh = settle_conf(&cfg, &mut wal, &mut store);
        if wal.identity().uuid == 0 {
            let mut r = SplitMix64::new(cfg.uuid_entropy ^ cfg.id.rotate_left(48));
            // Never 0: 0 means "not drawn" / "never seen".
            wal.stage_self(r.next_u64().max(1));
        }
        let epoch = rec.epoch + 1;
        wal.stage_epoch(epoch);
        wal.flush(true)?;
        let snap = store.latest_snapshot();
        let applied = snap.get_metadata().index;
        let mut sm = if applied > 0 {
            StateMachine::restore(cfg.limits.clone(), &snap.data).map_err(NodeError::BadSnapshot)?
        } else {
            StateMachine::new(cfg.limits.clone())
        };
        let cs = store.conf_state();
        // A member of the recorded configuration: as an outgoing voter of a
        // joint one too, or in the configuration of the snapshot the log
        // resumes from. A node that applied its own removal and stopped
        // before the snapshot that records it was written (the WAL keeps
        // the new configuration, the snapshot's table does not yet list the
        // id as removed) replays that removal from its log after opening.
        let names = |cs: &ConfState| {
            cs.voters.contains(&cfg.id)
                || cs.learners.contains(&cfg.id)
                || cs.voters_outgoing.contains(&cfg.id)
        };
        let member = names(cs) || names(snap.get_metadata().get_conf_state());
        if !fresh && !member && !sm.members().is_removed(cfg.id) {
            let mut stored = cs.voters.clone();
            stored.extend(cs.learners.iter().copied());
            return Err(NodeError::VoterMismatch {
                stored,
                given: vec![cfg.id],
            });
        }
        fill_addrs(
            cfg.id,
            sm.members_mut(),
            store.conf_state(),
            &cfg.peer_addrs,
        );
        let rn = RawNode::new(&raft_config(&cfg), store, logger)?;
        let token_rng = if cfg.os_token_bits {
            TokenRng::os()?
        } else {
            TokenRng::seeded(cfg.seed ^ epoch.rotate_left(16))
        };
        let mut node = Node::with_parts(cfg, rn, wal, sm, applied, epoch, token_rng);
        // Grants restored from the snapshot began before this boot: the
        // boot is the earliest moment this node knows of.
        node.reseed_holds(Millis::ZERO);
        node.after_raft_call();
        Ok(node)
    }

    /// A node just opened: its recovered parts, and nothing in flight.
    fn with_parts(
        cfg: NodeConfig,
        rn: RawNode<LogStore>,
        wal: Wal<D>,
        sm: StateMachine,
        applied: u64,
        epoch: u64,
        token_rng: TokenRng,
    ) -> Self {
        Node {
            rng: SplitMix64::new(cfg.seed ^ epoch.rotate_left(32)),
            token_rng,
            cfg,
            rn,
            wal,
            sm,
            applied,
            epoch,
            role: (u64::MAX, StateRole::Follower),
            leader: 0,
            next_tick: Millis::ZERO,
            next_repropose_check: Millis::ZERO,
            next_seq: 1,
            pending: SeqMap::default(),
            unapplied: SeqSet::default(),
            by_index: ByIndex::default(),
            conns: BTreeSet::new(),
            cancels: VecDeque::new(),
            closes: Vec::new(),
            timers: BinaryHeap::new(),
            timer_seq: 0,
            timers_ready: false,
            msgs: Vec::new(),
            entry_buf: bytes::BytesMut::new(),
            entry_scratch: Vec::new(),
            apply_out: Applied::default(),
            stats: NodeStats::default(),
            #[cfg(any(test, feature = "testkit"))]
            trace: Vec::new(),
            #[cfg(any(test, feature = "testkit"))]
            conf_history: VecDeque::new(),
            unsynced: VecDeque::new(),
            syncing: None,
            last_ready: 0,
            last_sync_began: Millis::ZERO,
            conf_change_waits: false,
            checked_snapshot: None,
            refusal_log: LogLimit::new(5, 10_000),
            wait_ms: Histogram::new(WAIT_BOUNDS_MS),
            hold_ms: Histogram::new(HOLD_BOUNDS_MS),
            holds: HoldIndex::default(),
            sync_wakes: false,
            failed: None,
            batch: Vec::new(),
            members_version: 1,
            snapshot_now: false,
            conf_proposed_at: 0,
        }
    }

    /// This node's id.
    #[must_use]
    pub fn id(&self) -> u64 {
        self.cfg.id
    }

    /// This boot's epoch.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The leader this node knows of (0: none).
    #[must_use]
    pub fn leader(&self) -> u64 {
        self.rn.raft.leader_id
    }

    /// True when this node is the leader.
    #[must_use]
    pub fn is_leader(&self) -> bool {
        self.rn.raft.state == StateRole::Leader
    }

    /// The current term.
    #[must_use]
    pub fn term(&self) -> u64 {
        self.rn.raft.term
    }

    /// Index of the last applied entry.
    #[must_use]
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// The commit index.
    #[must_use]
    pub fn committed(&self) -> u64 {
        self.rn.raft.raft_log.committed
    }

    /// The replicated table.
    #[must_use]
    pub fn state_machine(&self) -> &StateMachine {
        &self.sm
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> NodeStats {
        self.stats
    }

    /// Index of the latest snapshot (0: none).
    #[must_use]
    pub fn snapshot_index(&self) -> u64 {
        self.rn.store().latest_snapshot().get_metadata().index
    }

    /// Client requests waiting for an answer (proposed or queued).
    #[must_use]
    pub fn pending_requests(&self) -> usize {
        self.pending.len()
    }

    /// True when the leader has rebuilt its timers (leaders only).
    #[must_use]
    pub fn timers_ready(&self) -> bool {
        self.timers_ready
    }

    /// The disk under the WAL, for inspection (fsync times).
    pub fn disk(&self) -> &D {
        self.wal.disk()
    }

    /// True once this node has applied an entry of its current term: a
    /// new leader's first entry, through which every earlier grant is known.
    #[must_use]
    pub fn applied_current_term(&self) -> bool {
        self.rn.raft.apply_to_current_term()
    }

    /// The disk under the WAL (e.g. to give a file disk its waker).
    pub fn disk_mut(&mut self) -> &mut D {
        self.wal.disk_mut()
    }

    /// Says whether the disk wakes the server's poll when a background
    /// fsync is over; if not, [`Node::next_deadline`] asks to be polled at
    /// once while one runs.
    pub fn set_sync_wakes(&mut self, wakes: bool) {
        self.sync_wakes = wakes;
    }

    /// This data directory's id and the ids first seen for its peers.
    #[must_use]
    pub fn identity(&self) -> &crate::cluster::log::Identity {
        self.wal.identity()
    }

    /// Records (durably, with this turn's write) the data directory id of
    /// peer `id`, seen for the first time.
    pub fn record_peer(&mut self, id: u64, uuid: u64) {
        self.wal.stage_peer(id, uuid);
    }

    /// Bytes in the write-ahead log.
    #[must_use]
    pub fn wal_bytes(&self) -> u64 {
        self.wal.log_bytes()
    }

    /// The simulation's planted bug (`NodeConfig::bug_stale_expire`): off
    /// in every build without the `testkit` feature.
    fn bug_stale_expire(&self) -> bool {
        #[cfg(any(test, feature = "testkit"))]
        return self.cfg.bug_stale_expire;
        #[cfg(not(any(test, feature = "testkit")))]
        return false;
    }

    /// Applied entries recorded since the last call (with `trace_applied`;
    /// feature `testkit`).
    #[cfg(any(test, feature = "testkit"))]
    pub fn take_trace(&mut self) -> Vec<Traced> {
        std::mem::take(&mut self.trace)
    }

    /// The configurations this node's applied conf changes switched to,
    /// oldest first (the last 64; feature `testkit`).
    #[cfg(any(test, feature = "testkit"))]
    #[must_use]
    pub fn conf_history(&self) -> Vec<ConfState> {
        self.conf_history.iter().cloned().collect()
    }

    /// Messages for peers produced so far. Of the append acknowledgements
    /// to one leader in one term only the highest goes: it says all the
    /// others say (one fsync often releases the acks of several appends).
    pub fn take_messages(&mut self) -> Vec<Message> {
        let mut msgs = std::mem::take(&mut self.msgs);
        self.hold_back_appends_from_the_start(&mut msgs);
        coalesce_acks(&mut msgs);
        msgs
    }

    /// A peer added after the log began, with nothing yet, is never sent
    /// the log from index 1: that takes a snapshot ([`LogStore::begins_without`]).
    /// A leader compacts when it applies a conf change, so such a log is
    /// rare: one whose compaction a crash undid before it was durable, the
    /// conf change itself being durable. The append is dropped (as the
    /// network may drop it), the log is compacted at the end of the next
    /// turn, and raft, probing the peer again, finds the entries compacted
    /// and sends the snapshot. That compaction may come before this node
    /// has replayed the conf change again: the snapshot then carries the
    /// configuration recorded last (with the peer in it) at an earlier
    /// index, and the peer replays the conf change after it as a restarted
    /// node does (raft refuses it as already applied; the members apply it).
    fn hold_back_appends_from_the_start(&mut self, msgs: &mut Vec<Message>) {
        let store = self.rn.store();
        let before = msgs.len();
        msgs.retain(|m| {
            !(m.msg_type == MessageType::MsgAppend && m.index == 0 && store.begins_without(m.to))
        });
        if msgs.len() != before {
            log::debug!(
                "node {}: a peer the log began without is due a snapshot, not the log from index 1",
                self.cfg.id
            );
            self.snapshot_now = true;
        }
    }

    /// A peer could not be reached: raft stops pipelining to it.
    pub fn report_unreachable(&mut self, peer: u64) {
        self.rn.report_unreachable(peer);
    }

    /// The outcome of sending a snapshot to `peer`.
    pub fn report_snapshot(&mut self, peer: u64, ok: bool) {
        let status = if ok {
            SnapshotStatus::Finish
        } else {
            SnapshotStatus::Failure
        };
        self.rn.report_snapshot(peer, status);
    }

    /// raft draws election timeouts from a thread-local RNG whenever it
    /// changes term or role; redraw them from our seeded one so that a run is
    /// reproducible.
    fn after_raft_call(&mut self) {
        let now = (self.rn.raft.term, self.rn.raft.state);
        if now != self.role {
            self.role = now;
            if now.1 == StateRole::Leader {
                // Cluster tests read the leader and its term from this line.
                log::info!("node {}: became leader at term {}", self.cfg.id, now.0);
            }
            let lo = self.cfg.election_tick as u64;
            let t = self.rng.range(lo, 2 * lo);
            self.rn.raft.set_randomized_election_timeout(
                usize::try_from(t).unwrap_or(self.cfg.election_tick),
            );
        }
    }

    /// A message from a peer. One raft would panic on, or that no correct
    /// peer sends, is dropped, counted and logged instead (`guard`).
    pub fn step(&mut self, msg: Message) {
        if self.failed.is_some() {
            return;
        }
        if let Err(why) = self.admit(&msg) {
            self.refuse_message(&msg, &why);
            return;
        }
        // Errors are stale or foreign messages (e.g. from an unknown peer):
        // raft has ignored them; note them for debugging.
        let (from, kind) = (msg.from, msg.msg_type);
        if let Err(e) = self.rn.step(msg) {
            log::debug!("node {}: ignored {kind:?} from {from}: {e}", self.cfg.id);
        }
        self.after_admitted();
        self.after_raft_call();
    }
}

/// On a fresh disk of a static cluster, records the `--peers` voters; on a
/// fresh disk of a joining node, waits for the leader; otherwise keeps the
/// recorded configuration (and says so if `--peers` disagrees). Returns
/// whether the disk was fresh.
fn settle_conf<D: Disk>(cfg: &NodeConfig, wal: &mut Wal<D>, store: &mut LogStore) -> bool {
    let mut given = cfg.voters.clone();
    given.sort_unstable();
    given.dedup();
    let fresh = store.conf_state().voters.is_empty() && store.conf_state().learners.is_empty();
    if fresh && !cfg.join {
        let mut cs = ConfState::default();
        cs.voters.clone_from(&given);
        wal.stage_conf_state(&cs);
        store.set_conf_state(cs);
    } else if fresh {
        // The start-up line says it too.
        log::debug!(
            "node {}: joining: no configuration yet; waiting for the leader to add this \
             node (ticket cluster add {}=...)",
            cfg.id,
            cfg.id
        );
    } else if !cfg.join {
        let mut stored = store.conf_state().voters.clone();
        stored.sort_unstable();
        if stored != given {
            log::warn!(
                "node {}: the data directory records voters {stored:?} and learners {:?}; \
                 --peers names {given:?}: the recorded configuration is used",
                cfg.id,
                store.conf_state().learners
            );
        }
    }
    fresh
}

/// raft's settings for a node with these.
fn raft_config(cfg: &NodeConfig) -> raft::Config {
    raft::Config {
        id: cfg.id,
        election_tick: cfg.election_tick,
        heartbeat_tick: cfg.heartbeat_tick,
        pre_vote: true,
        check_quorum: true,
        max_size_per_msg: 1 << 20,
        max_inflight_msgs: 256,
        // Not `batch_append`: in raft 0.7 it merges new entries into a
        // waiting append that carries none without checking that they
        // follow its previous index, and the follower then acknowledges
        // an index it does not have (the cluster simulation panics on
        // seed 1 with it). A turn's client requests are proposed
        // together instead (`propose_batch`).
        max_uncommitted_size: 32 << 20,
        max_committed_size_per_ready: 4 << 20,
        // 0: raft starts applying after the snapshot and hands us every
        // committed entry after it again (the table is in memory).
        applied: 0,
        ..raft::Config::default()
    }
}

//! One cluster node, sans-IO: a raft-rs `RawNode` over the [`Wal`], the
//! replicated [`StateMachine`], client proposals and the leader's timers.
//!
//! The caller (the server loop, or the simulator) feeds it client requests,
//! peer messages and the time, calls [`Node::end_turn`] once per loop turn,
//! sends [`Node::take_messages`] to peers and writes the replies it put in
//! the [`Outbox`]. It never reads a clock and never touches a socket.
//!
//! # The Ready order (see `docs/CLUSTER.md`)
//!
//! Leader messages go out first (they may precede the local fsync); a
//! received snapshot is staged and restored; committed entries (already
//! durable locally) are applied; new entries and the hard state are staged;
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
//! # Leader timers (SPEC §2.4)
//!
//! Only the leader keeps a min-heap of deadlines: each grant's lease and each
//! queued acquire's wait, measured from when the leader applied it. When one
//! is due and still current, the leader proposes `Expire` or `WaitTimeout`,
//! which every node validates on apply. A new leader first waits until it has
//! applied its own term's first entry, then rebuilds the heap from the
//! replicated table with full durations: a key may expire late, never early.
//!
//! A lease's deadline is `applied_at + lease + 1 ms` ([`lease_deadline`]).
//! Clocks are read in whole milliseconds, truncated, so a leader that applies
//! a grant in the millisecond its client wrote the request may have read a
//! time up to 1 ms earlier than the client's; the extra millisecond keeps
//! `Expire` from being proposed before the client's own `written + lease`,
//! as the single-node engine does.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::fmt;
use std::io;

use std::net::SocketAddr;

use protobuf::Message as _;
use raft::eraftpb::{ConfChangeV2, ConfState, Entry, EntryType, Message, MessageType};
use raft::{RawNode, SnapshotStatus, StateRole};

use crate::cluster::command::{Command, DecodeError, Origin, Rid};
use crate::cluster::log::{Disk, LogStore, Wal};
use crate::cluster::members::{self, Change, Members, Refusal};
use crate::cluster::rng::SplitMix64;
use crate::cluster::state::{AnswerKind, Effect, StateMachine};
use crate::engine::{ConnId, Outbox};
use crate::limits::EngineLimits;
use crate::metrics::{Histogram, HoldIndex, HOLD_BOUNDS_MS, WAIT_BOUNDS_MS};
use crate::proto::{Reply, Request};
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
    data: Vec<u8>,
    /// When the request arrived (for `ticketd_wait_seconds`).
    received_at: Millis,
    proposed_at: Millis,
    /// The acquire applied and queued: it waits for a later answer and is
    /// never proposed again.
    queued: bool,
    acquire: bool,
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
    pending: BTreeMap<u64, Pending>,
    unapplied: BTreeSet<u64>,
    by_index: BTreeMap<u64, (u64, u64)>,
    conns: BTreeMap<ConnId, BTreeSet<u64>>,
    cancels: VecDeque<Origin>,
    /// Local connections to close: a request of theirs applied where this
    /// node cannot tell its answer ([`Node::take_closes`]).
    closes: Vec<ConnId>,
    timers: BinaryHeap<Reverse<(Millis, u64, Timer)>>,
    timer_seq: u64,
    timers_ready: bool,
    msgs: Vec<Message>,
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
            log::info!(
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
        let member = cs.voters.contains(&cfg.id) || cs.learners.contains(&cfg.id);
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
        let raft_cfg = raft::Config {
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
        };
        let rn = RawNode::new(&raft_cfg, store, logger)?;
        let token_rng = if cfg.os_token_bits {
            TokenRng::os()?
        } else {
            TokenRng::seeded(cfg.seed ^ epoch.rotate_left(16))
        };
        let mut node = Node {
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
            pending: BTreeMap::new(),
            unapplied: BTreeSet::new(),
            by_index: BTreeMap::new(),
            conns: BTreeMap::new(),
            cancels: VecDeque::new(),
            closes: Vec::new(),
            timers: BinaryHeap::new(),
            timer_seq: 0,
            timers_ready: false,
            msgs: Vec::new(),
            stats: NodeStats::default(),
            #[cfg(any(test, feature = "testkit"))]
            trace: Vec::new(),
            #[cfg(any(test, feature = "testkit"))]
            conf_history: VecDeque::new(),
            unsynced: VecDeque::new(),
            syncing: None,
            last_ready: 0,
            wait_ms: Histogram::new(WAIT_BOUNDS_MS),
            hold_ms: Histogram::new(HOLD_BOUNDS_MS),
            holds: HoldIndex::default(),
            sync_wakes: false,
            failed: None,
            batch: Vec::new(),
            members_version: 1,
            snapshot_now: false,
            conf_proposed_at: 0,
        };
        // Grants restored from the snapshot began before this boot: the
        // boot is the earliest moment this node knows of.
        node.reseed_holds(Millis::ZERO);
        node.after_raft_call();
        Ok(node)
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

    /// The voters and learners, ordered by id; on the leader with each
    /// one's match index and whether it was heard from recently.
    #[must_use]
    pub fn members(&self) -> Vec<Member> {
        let cs = self.rn.raft.prs().conf().to_conf_state();
        let leader = self.is_leader();
        let mut out: Vec<Member> = cs
            .get_voters()
            .iter()
            .map(|&id| (id, false))
            .chain(cs.get_learners().iter().map(|&id| (id, true)))
            .map(|(id, learner)| {
                let pr = self.rn.raft.prs().get(id).filter(|_| leader);
                Member {
                    id,
                    learner,
                    matched: pr.map(|p| p.matched),
                    reachable: pr.map(|p| id == self.cfg.id || p.recent_active),
                }
            })
            .collect();
        out.sort_by_key(|m| (m.learner, m.id));
        out
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

    /// Raised whenever the members or their addresses change: the
    /// transport then reconnects from [`Node::peer_addrs`].
    #[must_use]
    pub fn members_version(&self) -> u64 {
        self.members_version
    }

    /// The replicated members (addresses, removed ids).
    #[must_use]
    pub fn replicated_members(&self) -> &Members {
        self.sm.members()
    }

    /// The peer address of every voter and learner but this node, from
    /// the replicated state (empty before a joining node is added).
    #[must_use]
    pub fn peer_addrs(&self) -> BTreeMap<u64, SocketAddr> {
        let cs = self.rn.raft.prs().conf().to_conf_state();
        cs.voters
            .iter()
            .chain(cs.voters_outgoing.iter())
            .chain(cs.learners.iter())
            .chain(cs.learners_next.iter())
            .filter(|id| **id != self.cfg.id)
            .filter_map(|id| self.sm.members().addr(*id).map(|a| (*id, a)))
            .collect()
    }

    /// True once this node was removed from the cluster: it answers no
    /// request with a grant again.
    #[must_use]
    pub fn removed(&self) -> bool {
        self.sm.members().is_removed(self.cfg.id)
    }

    /// True while a conf change is proposed and not yet applied (leader),
    /// or the configuration is joint (until the change that leaves it
    /// applies).
    #[must_use]
    pub fn conf_change_pending(&self) -> bool {
        self.conf_change_in_flight() || !self.voters_outgoing().is_empty()
    }

    /// The outgoing voters while the configuration is joint (every change
    /// passes through one), empty otherwise.
    #[must_use]
    pub fn voters_outgoing(&self) -> Vec<u64> {
        self.rn.raft.prs().conf().to_conf_state().voters_outgoing
    }

    /// A leader that finds the configuration joint with nothing in flight
    /// (it was elected after the change that entered it applied, so raft
    /// will not leave it by itself) proposes the empty change that leaves
    /// it.
    fn leave_joint_if_left_behind(&mut self) {
        if !self.is_leader()
            || self.conf_change_in_flight()
            || !self.rn.raft.apply_to_current_term()
            || !self.rn.raft.prs().conf().auto_leave()
        {
            return;
        }
        log::info!("node {}: leaving the joint configuration", self.cfg.id);
        let before = self.rn.raft.raft_log.last_index();
        if let Err(e) = self
            .rn
            .propose_conf_change(Vec::new(), ConfChangeV2::default())
        {
            log::warn!(
                "node {}: cannot leave the joint configuration: {e}",
                self.cfg.id
            );
            return;
        }
        self.conf_proposed_at = self.rn.raft.raft_log.last_index().max(before + 1);
        self.after_raft_call();
    }

    fn conf_change_in_flight(&self) -> bool {
        self.rn.raft.has_pending_conf() || self.conf_proposed_at > self.applied
    }

    /// Proposes one membership change (leaders only), after checking it
    /// ([`members::check_change`]); `reachable` are the peers heard from
    /// within an election timeout. Returns what was proposed.
    ///
    /// # Errors
    /// Why the change is refused: not the leader (421, naming the leader),
    /// a change in flight (409), an id removed before (409), ...
    pub fn change_members(
        &mut self,
        change: Change,
        reachable: &BTreeSet<u64>,
    ) -> Result<String, Refusal> {
        if self.failed.is_some() || self.removed() {
            return Err(Refusal {
                status: 503,
                message: format!("node {} is stopped or removed", self.cfg.id),
            });
        }
        if !self.is_leader() {
            let message = match self.leader {
                0 => format!("node {} knows no leader now; try again", self.cfg.id),
                l => format!(
                    "node {} is not the leader; node {l} is (peer address {}): send the \
                     change to its admin port",
                    self.cfg.id,
                    self.sm
                        .members()
                        .addr(l)
                        .map_or_else(|| "unknown".to_owned(), |a| a.to_string())
                ),
            };
            let status = if self.leader == 0 { 503 } else { 421 };
            return Err(Refusal { status, message });
        }
        if !self.rn.raft.apply_to_current_term() {
            return Err(Refusal {
                status: 503,
                message: "the leader was just elected and has not applied its first entry; \
                          try again"
                    .into(),
            });
        }
        let conf = self.rn.raft.prs().conf().to_conf_state();
        let mut reachable = reachable.clone();
        reachable.insert(self.cfg.id);
        let view = members::View {
            conf: &conf,
            pending: self.conf_change_pending(),
            reachable: &reachable,
            members: self.sm.members(),
        };
        let cc = members::check_change(change, &view)?;
        let before = self.rn.raft.raft_log.last_index();
        if let Err(e) = self.rn.propose_conf_change(Vec::new(), cc) {
            return Err(Refusal {
                status: 503,
                message: format!("raft refused the change: {e}"),
            });
        }
        self.conf_proposed_at = self.rn.raft.raft_log.last_index().max(before + 1);
        self.after_raft_call();
        let what = match change {
            Change::AddLearner(id, addr) => format!("add learner {id} at {addr}"),
            Change::Promote(id) => format!("promote {id} to voter"),
            Change::Remove(id, _) => format!("remove {id}"),
        };
        log::info!("node {}: proposed: {what}", self.cfg.id);
        Ok(what)
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
        coalesce_acks(&mut msgs);
        msgs
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
            let lo = self.cfg.election_tick as u64;
            let t = self.rng.range(lo, 2 * lo);
            self.rn.raft.set_randomized_election_timeout(
                usize::try_from(t).unwrap_or(self.cfg.election_tick),
            );
        }
    }

    /// A message from a peer.
    pub fn step(&mut self, msg: Message) {
        if self.failed.is_some() {
            return;
        }
        // Errors are stale or foreign messages (e.g. from an unknown peer):
        // raft has ignored them; note them for debugging.
        let (from, kind) = (msg.from, msg.msg_type);
        if let Err(e) = self.rn.step(msg) {
            log::debug!("node {}: ignored {kind:?} from {from}: {e}", self.cfg.id);
        }
        self.after_raft_call();
    }

    fn refuse(&mut self, conn: ConnId, req: Request<'_>, out: &mut Outbox) {
        self.stats.refused += 1;
        match req {
            Request::Acquire { owner, key, .. } => out.push(conn, Reply::Busy { owner, key }, 0),
            Request::Release { token, key } => {
                out.push(conn, Reply::NotReleased { token, key }, 0);
            }
            // Never X: that would say the grant is gone, and a node that
            // cannot propose does not know (SPEC §5.3). Unanswered, the
            // client gives this attempt up and tries another node.
            Request::Extend { .. } => {}
        }
    }

    fn propose_data(&mut self, seq: Option<u64>, data: &[u8]) -> bool {
        let before = self.rn.raft.raft_log.last_index();
        let entry = Command::encode_entry(self.token_rng.bits(), data);
        if self.rn.propose(Vec::new(), entry).is_err() {
            return false;
        }
        let after = self.rn.raft.raft_log.last_index();
        if let Some(seq) = seq {
            if after > before {
                self.by_index.insert(after, (self.rn.raft.term, seq));
            }
        }
        true
    }

    /// A client request from local connection `conn`. Answers now (B or N)
    /// if no leader is known or the backlog is full; otherwise it is
    /// proposed with the turn's other requests in [`Node::end_turn`], which
    /// answers B or N if raft drops that proposal, and it is answered after
    /// it applies.
    pub fn request(&mut self, now: Millis, conn: ConnId, req: Request<'_>, out: &mut Outbox) {
        if self.failed.is_some()
            || self.leader() == 0
            || self.removed()
            || self.unapplied.len() >= self.cfg.max_pending
        {
            self.refuse(conn, req, out);
            return;
        }
        let seq = self.next_seq;
        let rid = Rid {
            node: self.cfg.id,
            epoch: self.epoch,
            seq,
        };
        self.unapplied.insert(seq);
        let floor = self.unapplied.first().copied().unwrap_or(seq);
        let data = Command::encode_request(rid, floor, conn, &req);
        self.next_seq += 1;
        self.batch.push(seq);
        self.pending.insert(
            seq,
            Pending {
                conn,
                data,
                received_at: now,
                proposed_at: now,
                queued: false,
                acquire: matches!(req, Request::Acquire { .. }),
            },
        );
        self.conns.entry(conn).or_default().insert(seq);
    }

    /// Proposes this turn's client requests, all in one raft message: on a
    /// leader one append per follower carries them, on a follower one
    /// forward. If raft drops it (no leader after all, the uncommitted
    /// limit), each is answered as a refused request (B, N, or nothing for
    /// an extend) and forgotten: it was never proposed.
    fn propose_batch(&mut self, out: &mut Outbox) {
        if self.batch.is_empty() {
            return;
        }
        let seqs = std::mem::take(&mut self.batch);
        let mut entries = Vec::with_capacity(seqs.len());
        let mut proposed = Vec::with_capacity(seqs.len());
        for seq in seqs {
            // A request whose connection closed in this turn is gone.
            if let Some(p) = self.pending.get(&seq) {
                // The entry carries the token bits this node draws for it,
                // as every proposal does (`propose_data`).
                entries.push(Entry {
                    data: Command::encode_entry(self.token_rng.bits(), &p.data).into(),
                    ..Entry::default()
                });
                proposed.push(seq);
            }
        }
        if entries.is_empty() {
            return;
        }
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgPropose);
        m.from = self.cfg.id;
        m.set_entries(entries.into());
        let before = self.rn.raft.raft_log.last_index();
        let ok = self.failed.is_none() && self.rn.step(m).is_ok();
        self.after_raft_call();
        if ok {
            self.stats.proposed += proposed.len() as u64;
            let after = self.rn.raft.raft_log.last_index();
            // A leader appended them in order at before + 1 ..= after.
            if after - before == proposed.len() as u64 {
                let term = self.rn.raft.term;
                for (i, seq) in (before + 1..).zip(proposed) {
                    self.by_index.insert(i, (term, seq));
                }
            }
            return;
        }
        for seq in proposed {
            let Some(p) = self.pending.remove(&seq) else {
                continue;
            };
            self.unapplied.remove(&seq);
            if let Some(set) = self.conns.get_mut(&p.conn) {
                set.remove(&seq);
            }
            self.stats.refused += 1;
            match Command::decode(&p.data) {
                Ok(Command::Acquire { owner, key, .. }) => {
                    out.push(p.conn, Reply::Busy { owner, key: &key }, 0);
                }
                Ok(Command::Release { token, key, .. }) => {
                    out.push(p.conn, Reply::NotReleased { token, key: &key }, 0);
                }
                // An extend that could not be proposed gets no answer
                // (never X, see `refuse`).
                _ => {}
            }
        }
    }

    /// Local connection `conn` is gone: forget its requests and have its
    /// queued acquires cancelled cluster-wide.
    pub fn disconnect(&mut self, conn: ConnId) {
        let Some(seqs) = self.conns.remove(&conn) else {
            return;
        };
        let mut had_acquire = false;
        for seq in seqs {
            if let Some(p) = self.pending.remove(&seq) {
                had_acquire |= p.acquire;
            }
            self.unapplied.remove(&seq);
        }
        if had_acquire {
            self.queue_cancel(Origin {
                node: self.cfg.id,
                epoch: self.epoch,
                conn,
            });
        }
    }

    /// Moves into `out` the local connections to close: each had a request
    /// that applied inside a snapshot this node installed and whose answer
    /// the table cannot tell (see [`Node::request`]). Closing it is the
    /// answer: its client reports the outcome unknown at once.
    pub fn take_closes(&mut self, out: &mut Vec<ConnId>) {
        out.append(&mut self.closes);
    }

    fn queue_cancel(&mut self, origin: Origin) {
        if self.cancels.len() >= MAX_CANCELS {
            // The leader's wait timers clear those waiters anyway.
            self.cancels.pop_front();
        }
        self.cancels.push_back(origin);
    }

    /// Takes in a finished fsync (what waited for it goes out with the next
    /// [`Node::end_turn`]), advances raft's clock, fires due leader timers
    /// and re-proposes lost proposals.
    pub fn tick(&mut self, now: Millis, _out: &mut Outbox) {
        self.poll_sync();
        if self.failed.is_some() {
            return;
        }
        let mut n = 0;
        while now >= self.next_tick && n < 2 * self.cfg.election_tick {
            self.rn.tick();
            self.after_raft_call();
            self.next_tick = self.next_tick.add_ms(self.cfg.tick_ms);
            n += 1;
        }
        if now >= self.next_tick {
            self.next_tick = now.add_ms(self.cfg.tick_ms);
        }
        self.fire_timers(now);
        self.leave_joint_if_left_behind();
        // Re-proposal looks at every unapplied proposal: once per tick is
        // plenty (it waits two election timeouts anyway).
        if now >= self.next_repropose_check {
            self.next_repropose_check = now.add_ms(self.cfg.tick_ms);
            self.repropose(now);
        }
        while self.leader() != 0 {
            let Some(origin) = self.cancels.front().copied() else {
                break;
            };
            if !self.propose_data(None, &Command::CancelWaiters { origin }.encode()) {
                break;
            }
            self.cancels.pop_front();
        }
    }

    fn repropose_ms(&self) -> u64 {
        2 * self.cfg.election_tick as u64 * self.cfg.tick_ms
    }

    fn repropose(&mut self, now: Millis) {
        if self.leader() == 0 {
            return;
        }
        let after = self.repropose_ms();
        // `proposed_at == ZERO` marks a proposal to make again at once (the
        // leader changed, its index applied with another command, a
        // snapshot covered it), also in the first `after` ms of the clock.
        let due: Vec<u64> = self
            .unapplied
            .iter()
            .copied()
            .filter(|s| {
                self.pending.get(s).is_some_and(|p| {
                    !p.queued
                        && (p.proposed_at == Millis::ZERO || now.since(p.proposed_at) >= after)
                })
            })
            .collect();
        for seq in due {
            let data = self
                .pending
                .get(&seq)
                .map(|p| p.data.clone())
                .unwrap_or_default();
            if !self.propose_data(Some(seq), &data) {
                break;
            }
            self.stats.reproposed += 1;
            if let Some(p) = self.pending.get_mut(&seq) {
                p.proposed_at = now;
            }
        }
    }

    fn push_timer(&mut self, at: Millis, t: Timer) {
        self.timer_seq += 1;
        self.timers.push(Reverse((at, self.timer_seq, t)));
    }

    fn fire_timers(&mut self, now: Millis) {
        if !self.is_leader() || !self.timers_ready {
            return;
        }
        let retry = self.repropose_ms();
        for _ in 0..MAX_TIMERS_PER_TICK {
            match self.timers.peek() {
                Some(Reverse((at, _, _))) if *at <= now => {}
                _ => break,
            }
            let Some(Reverse((_, _, timer))) = self.timers.pop() else {
                break;
            };
            let cmd = match &timer {
                Timer::Expire {
                    key,
                    token,
                    generation,
                } if self.sm.lease_of(key) == Some((*token, *generation))
                    || (self.bug_stale_expire() && self.sm.holder(key) == Some(*token)) =>
                {
                    Command::Expire {
                        key: key.clone(),
                        token: *token,
                        generation: *generation,
                    }
                }
                Timer::Wait { key, waiter } if self.sm.is_waiting(key, *waiter) => {
                    Command::WaitTimeout {
                        key: key.clone(),
                        waiter: *waiter,
                    }
                }
                _ => continue, // stale: the grant or the wait already ended
            };
            if self.propose_data(None, &cmd.encode()) {
                self.stats.timer_proposals += 1;
                // Check again later: if this proposal is lost, propose again.
                self.push_timer(now.add_ms(retry), timer);
            } else {
                self.push_timer(now.add_ms(self.cfg.tick_ms), timer);
                break;
            }
        }
    }

    /// The next moment [`Node::tick`] has work.
    #[must_use]
    pub fn next_deadline(&self) -> Millis {
        if self.syncing.is_some() && !self.sync_wakes {
            // Nothing will say when this fsync is over: look again at once.
            return Millis::ZERO;
        }
        let mut d = self.next_tick;
        if self.is_leader() && self.timers_ready {
            if let Some(Reverse((at, _, _))) = self.timers.peek() {
                d = d.min(*at);
            }
        }
        d
    }

    /// Handles raft's Readys (send, apply, write), starts the fsync they
    /// need, rebuilds a new leader's timers and compacts the log when due.
    /// An error means the disk failed: the node must stop.
    ///
    /// # Background fsync
    ///
    /// Each Ready is written and raft advanced at once; the fsync runs in
    /// the background, one at a time, covering every Ready written before
    /// it began. [`Node::tick`] takes in its end (the server's poll wakes
    /// for it) and lets out what waited for it: raft's own progress and the
    /// persisted messages (votes, append acknowledgements). Replies never
    /// wait for it: they answer applied entries, which raft hands out only
    /// once they are durable here.
    pub fn end_turn(&mut self, now: Millis, out: &mut Outbox) -> Result<(), NodeError> {
        self.check_failed()?;
        self.poll_sync();
        self.propose_batch(out);
        for _ in 0..8 {
            if self.failed.is_some() || !self.rn.has_ready() {
                break;
            }
            if let Err(e) = self.handle_ready(now, out) {
                self.failed = Some(e.to_string());
                return Err(e);
            }
            // A Ready that needed no fsync may let raft go on at once.
            self.poll_sync();
        }
        self.check_failed()?;
        if let Err(e) = self.wal.write(false) {
            self.failed = Some(e.to_string());
            return Err(e.into());
        }
        self.start_sync();
        self.check_failed()?;
        if self.is_leader() && !self.timers_ready && self.rn.raft.apply_to_current_term() {
            self.rebuild_timers(now);
        }
        if let Err(e) = self.maybe_compact() {
            self.failed = Some(e.to_string());
            return Err(e);
        }
        Ok(())
    }

    /// The disk failure that stopped this node, as an error.
    fn check_failed(&self) -> Result<(), NodeError> {
        match &self.failed {
            Some(why) => Err(NodeError::Io(io::Error::other(why.clone()))),
            None => Ok(()),
        }
    }

    /// Takes in the running fsync's end, if it is over, and lets out what
    /// waited for it; then, if written records wait for an fsync and none
    /// runs, starts one.
    fn poll_sync(&mut self) {
        if self.failed.is_some() {
            return;
        }
        if let Some(number) = self.syncing {
            match self.wal.poll_sync() {
                None => return,
                Some(Err(e)) => {
                    // raft believes these Readys will be durable: the node
                    // is dead, as after a power cut at this point.
                    self.failed = Some(format!("WAL fsync failed: {e}"));
                    return;
                }
                Some(Ok(())) => {
                    self.syncing = None;
                    self.persisted(number);
                }
            }
        }
        if !self.wal.sync_owed() && !self.unsynced.is_empty() {
            // What is left needed no fsync of its own, only its turn.
            self.persisted(self.last_ready);
        }
    }

    /// Begins the fsync that written records wait for, unless one runs.
    fn start_sync(&mut self) {
        if self.failed.is_some() || self.syncing.is_some() || !self.wal.sync_owed() {
            return;
        }
        if let Err(e) = self.wal.start_sync() {
            self.failed = Some(format!("WAL fsync failed: {e}"));
            return;
        }
        self.syncing = Some(self.last_ready);
        self.stats.syncs += 1;
        // A disk that syncs inline is done already.
        self.poll_sync();
    }

    /// Readys up to `number` are durable: tell raft and send what waited.
    fn persisted(&mut self, number: u64) {
        self.rn.on_persist_ready(number);
        while let Some((n, _)) = self.unsynced.front() {
            if *n > number {
                break;
            }
            if let Some((_, msgs)) = self.unsynced.pop_front() {
                self.msgs.extend(msgs);
            }
        }
        self.after_raft_call();
    }

    fn handle_ready(&mut self, now: Millis, out: &mut Outbox) -> Result<(), NodeError> {
        let mut rd = self.rn.ready();
        if let Some(ss) = rd.ss() {
            let leader = ss.leader_id;
            self.on_soft_state(leader);
        }
        // A leader's messages may go out before its own fsync.
        self.msgs.extend(rd.take_messages());
        if !rd.snapshot().is_empty() {
            let snap = rd.snapshot().clone();
            self.wal.stage_snapshot(&snap);
            self.sm = StateMachine::restore(self.cfg.limits.clone(), &snap.data)
                .map_err(NodeError::BadSnapshot)?;
            let meta = snap.get_metadata();
            self.applied = meta.index;
            #[cfg(any(test, feature = "testkit"))]
            if self.cfg.trace_applied {
                self.trace.push(Traced {
                    index: meta.index,
                    term: meta.term,
                    hash: fnv(&snap.data),
                    snapshot: true,
                    request: None,
                });
            }
            self.stats.snapshots_installed += 1;
            self.reseed_holds(now);
            self.members_version += 1;
            self.after_snapshot_install();
            self.rn.mut_store().apply_snapshot(snap);
        }
        // Committed entries are durable here already (raft caps them at the
        // persisted index).
        let committed = rd.take_committed_entries();
        self.apply_entries(now, &committed, out);
        if !rd.entries().is_empty() {
            self.wal.stage_entries(rd.entries());
            self.rn
                .mut_store()
                .append(rd.entries())
                .map_err(|e| NodeError::Io(io::Error::new(io::ErrorKind::InvalidData, e)))?;
        }
        if let Some(hs) = rd.hs() {
            self.wal.stage_hard_state(hs);
            let hs = hs.clone();
            self.rn.mut_store().set_hard_state(hs);
        }
        // A forwarded proposal claims nothing about local state, so it need
        // not wait for this node's fsync; votes and acks must.
        let (early, persisted): (Vec<Message>, Vec<Message>) = rd
            .take_persisted_messages()
            .into_iter()
            .partition(|m| m.msg_type == MessageType::MsgPropose);
        self.msgs.extend(early);
        // Written with the turn's other Readys, at the end of the turn.
        self.wal.end_batch(rd.must_sync());
        self.stats.batches += 1;
        let number = rd.number();
        let installs_snapshot = !rd.snapshot().is_empty();
        self.last_ready = number;
        self.rn.advance_append_async(rd);
        // Even a Ready that needs no fsync waits for the ones before it.
        self.unsynced.push_back((number, persisted));
        if installs_snapshot {
            // raft counts a snapshot applied only once it is durable; this
            // rare Ready is synced before going on.
            self.wal.sync()?;
            self.syncing = None;
            self.persisted(number);
        }
        self.rn.advance_apply();
        self.after_raft_call();
        Ok(())
    }

    fn on_soft_state(&mut self, leader: u64) {
        if leader != self.leader {
            if leader == 0 {
                log::info!(
                    "node {}: no leader known (term {})",
                    self.cfg.id,
                    self.term()
                );
            } else {
                log::info!(
                    "node {}: leader is node {leader} (term {})",
                    self.cfg.id,
                    self.term()
                );
            }
            if leader != 0 {
                self.stats.leader_changes += 1;
            }
            self.leader = leader;
            self.next_repropose_check = Millis::ZERO;
            // A forwarded proposal may have died with the old leader.
            for seq in &self.unapplied {
                if let Some(p) = self.pending.get_mut(seq) {
                    p.proposed_at = Millis::ZERO;
                }
            }
        }
        // Leaving or entering leadership: the heap is rebuilt from the
        // table once this term's first entry has applied.
        self.timers.clear();
        self.timers_ready = false;
    }

    fn after_snapshot_install(&mut self) {
        // Requests of ours the snapshot already covers: a queued acquire is
        // still answered later. The rest are proposed again at the next
        // tick: the duplicate changes nothing, and when it applies an
        // acquire still granted to it is answered from the table (see
        // `apply_entries`); other answers are gone with the entries, and
        // the request's connection is closed then (`take_closes`).
        let seqs: Vec<u64> = self.unapplied.iter().copied().collect();
        for seq in seqs {
            let rid = Rid {
                node: self.cfg.id,
                epoch: self.epoch,
                seq,
            };
            let Some(p) = self.pending.get_mut(&seq) else {
                continue;
            };
            let Ok(cmd) = Command::decode(&p.data) else {
                continue;
            };
            if let Command::Acquire { key, .. } = &cmd {
                if self.sm.is_waiting(key, rid) {
                    p.queued = true;
                    self.unapplied.remove(&seq);
                    continue;
                }
            }
            if self.sm.has_applied(rid) {
                p.proposed_at = Millis::ZERO;
                self.next_repropose_check = Millis::ZERO;
            }
        }
    }

    fn rebuild_timers(&mut self, now: Millis) {
        self.timers.clear();
        let mut list = Vec::new();
        // The latest lease of each grant, in full from now: late, never
        // early (SPEC §2.4, §5.2).
        for (key, token, lease_s, generation) in self.sm.holders() {
            list.push((
                lease_deadline(now, lease_s),
                Timer::Expire {
                    key: key.to_owned(),
                    token,
                    generation,
                },
            ));
        }
        for (key, waiter, wait_s) in self.sm.waiters() {
            list.push((
                now.add_secs(u64::from(wait_s)),
                Timer::Wait {
                    key: key.to_owned(),
                    waiter,
                },
            ));
        }
        for (at, t) in list {
            self.push_timer(at, t);
        }
        self.timers_ready = true;
    }

    fn apply_entries(&mut self, now: Millis, entries: &[Entry], out: &mut Outbox) {
        for e in entries {
            if e.index <= self.applied {
                continue;
            }
            // raft hands committed entries over in order, after the
            // snapshot or the last one applied: a gap would skip a command.
            debug_assert_eq!(e.index, self.applied + 1, "applied entries have no gap");
            self.applied = e.index;
            #[cfg(any(test, feature = "testkit"))]
            if self.cfg.trace_applied {
                self.trace.push(Traced {
                    index: e.index,
                    term: e.term,
                    hash: fnv(&e.data),
                    snapshot: false,
                    request: None,
                });
            }
            let mut lost_here = None;
            if let Some((term, seq)) = self.by_index.remove(&e.index) {
                lost_here = Some((term, seq));
            }
            // Older indices can no longer apply with our proposal.
            while let Some((&i, _)) = self.by_index.first_key_value() {
                if i > e.index {
                    break;
                }
                self.by_index.pop_first();
            }
            if e.entry_type == EntryType::EntryConfChangeV2 {
                self.apply_conf_change(e);
                self.mark_lost(lost_here, None);
                continue;
            }
            if e.entry_type != EntryType::EntryNormal || e.data.is_empty() {
                self.mark_lost(lost_here, None);
                continue;
            }
            let (cmd, token_bits) = match Command::decode_entry(&e.data) {
                Ok(c) => c,
                Err(err) => {
                    log::error!("entry {} does not decode ({err}); skipped", e.index);
                    self.mark_lost(lost_here, None);
                    continue;
                }
            };
            self.mark_lost(lost_here, cmd.rid());
            let cmd = match cmd {
                // The deliberate bug: the generation is not looked at.
                Command::Expire { key, token, .. } if self.bug_stale_expire() => {
                    let generation = match self.sm.lease_of(&key) {
                        Some((t, g)) if t == token => g,
                        _ => 0,
                    };
                    Command::Expire {
                        key,
                        token,
                        generation,
                    }
                }
                cmd => cmd,
            };
            let expiring = match &cmd {
                Command::Expire { key, token, .. } if self.sm.holder(key) == Some(*token) => {
                    Some(*token)
                }
                _ => None,
            };
            let res = self.sm.apply_entry(e.index, token_bits, &cmd);
            if let Command::Expire { key, .. } = &cmd {
                if let Some(t) = expiring.filter(|&t| self.sm.holder(key) != Some(t)) {
                    self.hold_ended(now, t);
                }
            }
            if !res.duplicate {
                #[cfg(any(test, feature = "testkit"))]
                if let Some(t) = self.trace.last_mut().filter(|t| t.index == e.index) {
                    t.request = cmd.rid();
                }
            }
            let (my_id, my_epoch) = (self.cfg.id, self.epoch);
            let mine = move |r: Rid| r.node == my_id && r.epoch == my_epoch;
            if let Some(rid) = cmd.rid().filter(|r| mine(*r)) {
                if res.duplicate {
                    // Applied before (e.g. inside a snapshot we installed):
                    // nothing more will come for it. Were it answered here,
                    // it would no longer be pending; an acquire whose grant
                    // is still current gets that grant as its answer. Any
                    // other answer went with the entries this node never
                    // applied (a release's R or N, an acquire's T or N, an
                    // extend's E or X): the connection is closed, so that
                    // its client learns at once that the outcome is unknown
                    // (Indeterminate) instead of waiting for a reply that
                    // never comes.
                    if let Some(p) = self.pending.get(&rid.seq) {
                        if !p.queued {
                            let granted = match &cmd {
                                Command::Acquire { key, owner, .. } => self
                                    .sm
                                    .granted_to(key, rid)
                                    .map(|token| (key.as_str(), *owner, token)),
                                _ => None,
                            };
                            if let Some((key, owner, token)) = granted {
                                self.wait_ms.observe(now.since(p.received_at));
                                let reply = Reply::Acquired { token, owner, key };
                                out.push(p.conn, reply, 0);
                            } else {
                                self.stats.unanswerable += 1;
                                if !self.closes.contains(&p.conn) {
                                    self.closes.push(p.conn);
                                }
                            }
                            self.finish(rid.seq);
                        }
                    }
                } else {
                    self.unapplied.remove(&rid.seq);
                }
            }
            for eff in res.effects {
                match eff {
                    Effect::Queued {
                        key,
                        waiter,
                        wait_s,
                    } => {
                        if mine(waiter) {
                            match self.pending.get_mut(&waiter.seq) {
                                Some(p) => p.queued = true,
                                None => {
                                    // Its connection closed before the acquire
                                    // applied: cancel what it queued.
                                    if let Command::Acquire { conn, .. } = &cmd {
                                        let o = waiter.origin(*conn);
                                        self.queue_cancel(o);
                                    }
                                }
                            }
                        }
                        if self.timers_ready {
                            self.push_timer(
                                now.add_secs(u64::from(wait_s)),
                                Timer::Wait { key, waiter },
                            );
                        }
                    }
                    Effect::Granted {
                        key,
                        token,
                        lease_s,
                    } => {
                        self.holds.start(token, now);
                        if self.timers_ready {
                            self.push_timer(
                                lease_deadline(now, lease_s),
                                Timer::Expire {
                                    key,
                                    token,
                                    generation: 0,
                                },
                            );
                        }
                    }
                    // The leader's deadline for an extended grant is set
                    // when it applies the Extend; the earlier generation's
                    // timer is now stale and proposes nothing.
                    Effect::Extended {
                        key,
                        token,
                        generation,
                        lease_s,
                    } => {
                        if self.timers_ready {
                            self.push_timer(
                                lease_deadline(now, lease_s),
                                Timer::Expire {
                                    key,
                                    token,
                                    generation,
                                },
                            );
                        }
                    }
                }
            }
            for ans in &res.answers {
                if let AnswerKind::Released(t) = ans.kind {
                    self.hold_ended(now, t);
                }
                if !mine(ans.rid) {
                    continue;
                }
                let Some(p) = self.pending.get(&ans.rid.seq) else {
                    continue; // its connection closed
                };
                if p.conn != ans.conn {
                    continue;
                }
                if matches!(ans.kind, AnswerKind::Acquired(_)) {
                    self.wait_ms.observe(now.since(p.received_at));
                }
                out.push(ans.conn, ans.reply(), 0);
                self.finish(ans.rid.seq);
            }
        }
    }

    /// Applies a committed conf change: raft's configuration (persisted
    /// with this Ready), then the replicated members. A leader that removed
    /// itself steps down after the turn.
    fn apply_conf_change(&mut self, e: &Entry) {
        let mut cc = ConfChangeV2::default();
        if let Err(err) = cc.merge_from_bytes(&e.data) {
            log::error!(
                "conf change at {} does not decode ({err}); skipped",
                e.index
            );
            return;
        }
        match self.rn.apply_conf_change(&cc) {
            Ok(cs) => {
                log::info!(
                    "node {}: configuration at {}: voters {:?}, learners {:?}{}",
                    self.cfg.id,
                    e.index,
                    cs.voters,
                    cs.learners,
                    if cs.voters_outgoing.is_empty() {
                        String::new()
                    } else {
                        format!(" (joint, outgoing voters {:?})", cs.voters_outgoing)
                    }
                );
                #[cfg(any(test, feature = "testkit"))]
                {
                    if self.conf_history.len() >= CONF_HISTORY {
                        self.conf_history.pop_front();
                    }
                    self.conf_history.push_back(cs.clone());
                }
                self.wal.stage_conf_state(&cs);
                self.rn.mut_store().set_conf_state(cs);
            }
            Err(err) => {
                // A restarted node replays the entries after its last
                // snapshot on the configuration its WAL recorded last, so
                // raft may refuse one it already applied (e.g. a second
                // leave). The members apply it all the same: their change
                // is idempotent and must not depend on when a node last
                // restarted.
                log::warn!("conf change at {} refused by raft: {err}", e.index);
            }
        }
        self.sm.members_mut().apply(&cc);
        self.members_version += 1;
        self.snapshot_now = true;
        if members::removed_ids(&cc).contains(&self.cfg.id) {
            log::warn!(
                "node {}: removed from the cluster at index {}; it grants nothing from now on",
                self.cfg.id,
                e.index
            );
        }
        // A leader that removed itself leads on through the joint
        // configuration (it is an outgoing voter) and steps down once the
        // change that leaves it applies.
        let voter = self.rn.raft.prs().conf().voters().contains(self.cfg.id);
        if self.removed() && !voter && self.is_leader() {
            self.step_down();
        }
    }

    /// A leader that applied its own removal steps down at once (raft-rs
    /// would keep leading, and trip over its missing progress when its
    /// own entries persist), and tells the most up-to-date voter to
    /// campaign now (`MsgTimeoutNow`, as a leadership transfer does) rather
    /// than after an election timeout. No raft step is taken: this runs
    /// between a Ready and its advance.
    fn step_down(&mut self) {
        let me = self.cfg.id;
        let voters = self.rn.raft.prs().conf().to_conf_state().voters;
        let best = self
            .rn
            .raft
            .prs()
            .iter()
            .filter(|(id, _)| **id != me && voters.contains(id))
            .max_by_key(|(id, pr)| (pr.matched, Reverse(**id)))
            .map(|(id, _)| *id);
        let term = self.rn.raft.term;
        if let Some(to) = best {
            log::info!("node {me}: removed; node {to} is asked to campaign now");
            let mut m = Message::default();
            m.set_msg_type(MessageType::MsgTimeoutNow);
            m.to = to;
            m.from = me;
            m.term = term;
            self.msgs.push(m);
        }
        self.rn.raft.become_follower(term, 0);
    }

    /// The entry at an index a local leader gave one of our proposals
    /// applied; if it is not that proposal, the proposal was lost.
    fn mark_lost(&mut self, at: Option<(u64, u64)>, applied_rid: Option<Rid>) {
        let Some((_, seq)) = at else {
            return;
        };
        let ours = applied_rid
            .is_some_and(|r| r.node == self.cfg.id && r.epoch == self.epoch && r.seq == seq);
        if !ours {
            if let Some(p) = self.pending.get_mut(&seq) {
                p.proposed_at = Millis::ZERO;
            }
        }
    }

    /// Grant `token` ended (released, or its lease expired) as this node
    /// applied it at `now`.
    fn hold_ended(&mut self, now: Millis, token: u64) {
        if let Some(began) = self.holds.end(token) {
            if self.is_leader() {
                self.hold_ms.observe(now.since(began));
            }
        }
    }

    /// The grants of the table as it is now, all begun at `at`: the
    /// table keeps no clock, so for a table restored from a snapshot
    /// the restore is the earliest moment this node knows of.
    fn reseed_holds(&mut self, at: Millis) {
        self.holds.clear();
        let mut tokens: Vec<u64> = self.sm.holders().map(|(_, t, _, _)| t).collect();
        tokens.sort_unstable();
        for t in tokens {
            self.holds.start(t, at);
        }
    }

    /// `ticketd_wait_seconds` and `ticketd_hold_seconds` in cluster mode.
    ///
    /// A wait is counted by the node its client is connected to, from the
    /// request's arrival to the grant's answer. A hold is counted once in
    /// the cluster, by the node that is leader when its end applies, from
    /// when that node applied the grant to when it applied the release or
    /// the expiry: every node keeps the grant times, so a new leader
    /// measures holds that began under the old one. Summed over the
    /// cluster's nodes, both count each grant once.
    #[must_use]
    pub fn lock_histograms(&self) -> (&Histogram, &Histogram) {
        (&self.wait_ms, &self.hold_ms)
    }

    /// When the longest-held current grant began, as this node applied it.
    #[must_use]
    pub fn oldest_hold(&self) -> Option<Millis> {
        self.holds.oldest()
    }

    fn finish(&mut self, seq: u64) {
        self.unapplied.remove(&seq);
        if let Some(p) = self.pending.remove(&seq) {
            if let Some(s) = self.conns.get_mut(&p.conn) {
                s.remove(&seq);
                if s.is_empty() {
                    self.conns.remove(&p.conn);
                }
            }
        }
    }

    fn maybe_compact(&mut self) -> Result<(), NodeError> {
        let snap_index = self.snapshot_index();
        if self.applied <= snap_index {
            return Ok(());
        }
        let since = self.applied - snap_index;
        let due = since >= self.cfg.snapshot_every
            || self.wal.log_bytes() > self.cfg.max_wal_bytes
            || self.snapshot_now;
        if !due {
            return Ok(());
        }
        // A leader keeps the entries a live follower still lacks: cutting
        // them would make it send that follower the whole table instead, and
        // the follower could not answer the requests of its own clients
        // that the snapshot covers. Up to four intervals, or the WAL size
        // limit, then it compacts regardless.
        let forced = since >= 4 * self.cfg.snapshot_every
            || self.wal.log_bytes() > self.cfg.max_wal_bytes
            || self.snapshot_now;
        self.snapshot_now = false;
        if self.is_leader() && !forced {
            let (me, applied) = (self.cfg.id, self.applied);
            let lagging = self
                .rn
                .raft
                .prs()
                .iter()
                .any(|(id, pr)| *id != me && pr.recent_active && pr.matched < applied);
            if lagging {
                return Ok(());
            }
        }
        let data = self.sm.snapshot();
        let applied = self.applied;
        self.rn
            .mut_store()
            .compact_to(applied, data)
            .map_err(|e| NodeError::Io(io::Error::new(io::ErrorKind::InvalidData, e)))?;
        self.wal.rewrite(self.rn.store(), self.epoch)?;
        // The rewritten log is durable and holds every Ready handled (a
        // running fsync was waited for).
        self.syncing = None;
        self.persisted(self.last_ready);
        self.stats.snapshots_taken += 1;
        Ok(())
    }
}

/// Records the `--peers` address of each member whose address the
/// replicated state lacks (a first static start, or state written before
/// addresses were replicated), and logs each flag that disagrees with the
/// recorded address (the recorded one wins).
fn fill_addrs(me: u64, members: &mut Members, cs: &ConfState, flags: &BTreeMap<u64, SocketAddr>) {
    for id in cs.voters.iter().chain(cs.learners.iter()) {
        if let Some(a) = flags.get(id) {
            members.fill_addr(*id, *a);
        }
    }
    for (id, a) in flags {
        match members.addr(*id) {
            Some(stored) if stored != *a => log::warn!(
                "node {me}: --peers gives node {id} the address {a}, the replicated \
                 configuration {stored}: the replicated one is used"
            ),
            _ => {}
        }
    }
}

/// Drops every accepting `MsgAppendResponse` that a later or higher one to
/// the same peer in the same term supersedes: the leader only ever raises a
/// follower's progress, so the highest index carries all the news. (The
/// commit index a response reports matters only to raft's group commit,
/// which is off.) Rejections are kept. A dropped ack is no worse than a
/// lost one, which raft survives.
fn coalesce_acks(msgs: &mut Vec<Message>) {
    let is_ack = |m: &Message| m.msg_type == MessageType::MsgAppendResponse && !m.reject;
    if msgs.iter().filter(|m| is_ack(m)).count() < 2 {
        return;
    }
    // (to, term) -> position of the ack kept so far.
    let mut kept: Vec<(u64, u64, usize)> = Vec::new();
    let mut dropped = vec![false; msgs.len()];
    for (i, m) in msgs.iter().enumerate() {
        if !is_ack(m) {
            continue;
        }
        match kept.iter_mut().find(|k| k.0 == m.to && k.1 == m.term) {
            None => kept.push((m.to, m.term, i)),
            Some(k) if m.index >= msgs[k.2].index => {
                dropped[k.2] = true;
                k.2 = i;
            }
            Some(_) => dropped[i] = true,
        }
    }
    let mut i = 0;
    msgs.retain(|_| {
        i += 1;
        !dropped[i - 1]
    });
}

/// When the leader proposes `Expire` for a grant of `lease_s` seconds it
/// applied at `applied_at`: one millisecond after `applied_at + lease`, since
/// the client's clock, truncated to whole milliseconds like ours, may have
/// read up to 1 ms later when it wrote the request (see the module docs).
#[must_use]
pub fn lease_deadline(applied_at: Millis, lease_s: u8) -> Millis {
    applied_at.add_secs(u64::from(lease_s)).add_ms(1)
}

/// A logger for raft that forwards Info and above to the `log` crate
/// (raft's Debug output is filtered here, since slog's bridge would bypass
/// the `log` level).
pub fn raft_logger() -> slog::Logger {
    slog::Logger::root(LogDrain, slog::o!())
}

/// A logger that drops everything (simulations, tests).
pub fn quiet_logger() -> slog::Logger {
    slog::Logger::root(slog::Discard, slog::o!())
}

struct LogDrain;

impl slog::Drain for LogDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &slog::Record<'_>, _: &slog::OwnedKVList) -> Result<(), slog::Never> {
        let level = match record.level() {
            slog::Level::Critical | slog::Level::Error => log::Level::Error,
            slog::Level::Warning => log::Level::Warn,
            slog::Level::Info => log::Level::Info,
            slog::Level::Debug | slog::Level::Trace => return Ok(()),
        };
        if log::log_enabled!(target: "raft", level) {
            log::log!(target: "raft", level, "{}", record.msg());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::log::MemDisk;

    /// Runs turns at `now` (the clock does not move) until `out` holds a
    /// reply or `turns` pass.
    fn turns(node: &mut Node<MemDisk>, now: Millis, out: &mut Outbox, turns: usize) {
        for _ in 0..turns {
            node.tick(now, out);
            node.end_turn(now, out).unwrap();
        }
    }

    #[test]
    fn lease_deadline_is_one_millisecond_after_the_lease() {
        assert_eq!(lease_deadline(Millis(1000), 5), Millis(6001));
        assert_eq!(lease_deadline(Millis(0), 255), Millis(255_001));
    }

    #[test]
    fn a_grant_applied_in_the_request_millisecond_expires_only_after_written_plus_lease() {
        let mut node = Node::open(NodeConfig::new(1, vec![1]), MemDisk::new(), &quiet_logger())
            .expect("opens");
        let mut out = Outbox::new();
        let mut now = Millis(0);
        for _ in 0..100 {
            now = now.add_ms(100);
            turns(&mut node, now, &mut out, 1);
            if node.is_leader() && node.timers_ready() {
                break;
            }
        }
        assert!(node.is_leader() && node.timers_ready(), "leads");
        // The client writes the request at `now` (its truncated clock may
        // read up to 1 ms later); the leader grants it in this same ms.
        let written = now;
        node.request(
            written,
            9,
            Request::Acquire {
                wait_s: 0,
                lease_s: 2,
                owner: 1,
                key: "k",
            },
            &mut out,
        );
        turns(&mut node, written, &mut out, 10);
        let reply = out.iter().next().map(|a| format!("{:?}", a.reply));
        assert!(
            reply.as_deref().is_some_and(|r| r.starts_with("Acquired")),
            "granted in the request's millisecond: {reply:?}"
        );
        let token = node.state_machine().holder("k").expect("held");
        // At written + lease the client's conservative expiry may not have
        // passed yet: no Expire.
        let lease_end = written.add_secs(2);
        turns(&mut node, lease_end, &mut out, 10);
        assert_eq!(
            node.state_machine().holder("k"),
            Some(token),
            "expired at written + lease, up to 1 ms before the client's expiry"
        );
        turns(&mut node, lease_end.add_ms(1), &mut out, 10);
        assert_eq!(node.state_machine().holder("k"), None, "expired 1 ms later");
    }

    /// Delivers every message between `nodes` (ids 1..) until none is left,
    /// running a turn on each receiver.
    fn settle_net(nodes: &mut [Node<MemDisk>], now: Millis, out: &mut Outbox) {
        for _ in 0..50 {
            let mut any = false;
            for i in 0..nodes.len() {
                for m in nodes[i].take_messages() {
                    any = true;
                    let to = usize::try_from(m.to).unwrap() - 1;
                    nodes[to].step(m);
                }
            }
            for n in nodes.iter_mut() {
                n.tick(now, out);
                n.end_turn(now, out).unwrap();
            }
            if !any {
                return;
            }
        }
    }

    /// Three nodes on `disks`, settled until one leads with its timers
    /// rebuilt.
    fn elected(disks: &[MemDisk], now: &mut Millis, out: &mut Outbox) -> Vec<Node<MemDisk>> {
        let mut nodes: Vec<Node<MemDisk>> = (1..=3)
            .map(|id| {
                Node::open(
                    NodeConfig::new(id, vec![1, 2, 3]),
                    disks[id as usize - 1].clone(),
                    &quiet_logger(),
                )
                .expect("opens")
            })
            .collect();
        for _ in 0..200 {
            *now = now.add_ms(100);
            settle_net(&mut nodes, *now, out);
            if nodes.iter().any(|n| n.is_leader() && n.timers_ready()) {
                break;
            }
        }
        nodes
    }

    /// An elected 3-node group whose `follower`'s fsyncs do not finish
    /// until its disk lets them.
    struct Trio {
        disks: Vec<MemDisk>,
        out: Outbox,
        now: Millis,
        nodes: Vec<Node<MemDisk>>,
        leader: usize,
        follower: usize,
    }

    fn trio_with_a_slow_follower() -> Trio {
        let disks: Vec<MemDisk> = (0..3).map(|_| MemDisk::new()).collect();
        let mut out = Outbox::new();
        let mut now = Millis(0);
        let nodes = elected(&disks, &mut now, &mut out);
        let leader = nodes.iter().position(Node::is_leader).expect("a leader");
        let follower = (leader + 1) % 3;
        disks[follower].hold_syncs(true);
        Trio {
            disks,
            out,
            now,
            nodes,
            leader,
            follower,
        }
    }

    #[test]
    fn one_fsync_releases_one_ack_for_all_the_appends_it_covers() {
        let Trio {
            disks,
            mut out,
            now,
            mut nodes,
            leader,
            follower,
        } = trio_with_a_slow_follower();
        // Three appends, each from its own leader turn, reach the follower
        // while its fsync is held.
        for (owner, key) in [(1, "a"), (2, "b"), (3, "c")] {
            let req = Request::Acquire {
                wait_s: 0,
                lease_s: 5,
                owner,
                key,
            };
            nodes[leader].request(now, 9, req, &mut out);
            nodes[leader].end_turn(now, &mut out).unwrap();
            for m in nodes[leader].take_messages() {
                if m.to == follower as u64 + 1 {
                    nodes[follower].step(m);
                }
            }
            nodes[follower].tick(now, &mut out);
            nodes[follower].end_turn(now, &mut out).unwrap();
        }
        let last = nodes[leader].rn.raft.raft_log.last_index();
        disks[follower].hold_syncs(false);
        nodes[follower].tick(now, &mut out);
        nodes[follower].end_turn(now, &mut out).unwrap();
        let acks: Vec<Message> = nodes[follower]
            .take_messages()
            .into_iter()
            .filter(|m| m.msg_type == MessageType::MsgAppendResponse)
            .collect();
        assert_eq!(acks.len(), 1, "one ack for three appends: {acks:?}");
        assert_eq!(acks[0].index, last, "and it acknowledges the last entry");
        for m in acks {
            nodes[leader].step(m);
        }
        for _ in 0..5 {
            nodes[leader].tick(now, &mut out);
            nodes[leader].end_turn(now, &mut out).unwrap();
        }
        let granted = out
            .iter()
            .filter(|a| format!("{:?}", a.reply).starts_with("Acquired"))
            .count();
        assert_eq!(granted, 3, "that ack committed all three");
    }

    #[test]
    fn acks_are_coalesced_per_peer_and_term_and_rejections_kept() {
        let ack = |to: u64, term: u64, index: u64, reject: bool| {
            let mut m = Message::default();
            m.set_msg_type(MessageType::MsgAppendResponse);
            m.to = to;
            m.term = term;
            m.index = index;
            m.reject = reject;
            m
        };
        let mut msgs = vec![
            ack(1, 2, 10, false),
            ack(1, 2, 9, true),
            ack(3, 2, 11, false),
            ack(1, 2, 12, false),
            ack(1, 3, 5, false),
            ack(1, 2, 11, false),
        ];
        coalesce_acks(&mut msgs);
        let left: Vec<(u64, u64, u64, bool)> = msgs
            .iter()
            .map(|m| (m.to, m.term, m.index, m.reject))
            .collect();
        assert_eq!(
            left,
            vec![
                (1, 2, 9, true),
                (3, 2, 11, false),
                (1, 2, 12, false),
                (1, 3, 5, false)
            ]
        );
    }

    #[test]
    fn a_follower_acknowledges_entries_only_after_its_fsync_ends() {
        let Trio {
            disks,
            mut out,
            now,
            mut nodes,
            leader,
            follower,
        } = trio_with_a_slow_follower();
        nodes[leader].request(
            now,
            9,
            Request::Acquire {
                wait_s: 0,
                lease_s: 5,
                owner: 1,
                key: "k",
            },
            &mut out,
        );
        nodes[leader].end_turn(now, &mut out).unwrap();
        let appends: Vec<Message> = nodes[leader]
            .take_messages()
            .into_iter()
            .filter(|m| m.msg_type == MessageType::MsgAppend && m.to == follower as u64 + 1)
            .collect();
        assert!(!appends.is_empty(), "the leader replicates at once");
        for m in appends {
            nodes[follower].step(m);
        }
        for _ in 0..3 {
            nodes[follower].tick(now, &mut out);
            nodes[follower].end_turn(now, &mut out).unwrap();
        }
        let acks = |msgs: &[Message]| {
            msgs.iter()
                .filter(|m| m.msg_type == MessageType::MsgAppendResponse)
                .count()
        };
        let early = nodes[follower].take_messages();
        assert_eq!(acks(&early), 0, "no ack while the fsync runs: {early:?}");
        assert!(
            disks[follower].unsynced() > 0,
            "the entries are written, not durable"
        );
        disks[follower].hold_syncs(false);
        nodes[follower].tick(now, &mut out);
        nodes[follower].end_turn(now, &mut out).unwrap();
        let late = nodes[follower].take_messages();
        assert!(acks(&late) > 0, "the ack goes once the fsync ended");
        assert_eq!(disks[follower].unsynced(), 0);
        // The third node never heard of it; this ack commits the grant.
        for m in late {
            nodes[leader].step(m);
        }
        nodes[leader].end_turn(now, &mut out).unwrap();
        for _ in 0..5 {
            nodes[leader].tick(now, &mut out);
            nodes[leader].end_turn(now, &mut out).unwrap();
        }
        assert!(
            out.iter()
                .any(|a| format!("{:?}", a.reply).starts_with("Acquired")),
            "granted after a quorum made it durable"
        );
    }

    #[test]
    fn a_turns_requests_travel_in_one_forward_and_one_append_per_follower() {
        let disks: Vec<MemDisk> = (0..3).map(|_| MemDisk::new()).collect();
        let mut out = Outbox::new();
        let mut now = Millis(0);
        let mut nodes = elected(&disks, &mut now, &mut out);
        let leader = nodes.iter().position(Node::is_leader).expect("a leader");
        let follower = (leader + 1) % 3;
        let keys: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
        out.clear();
        // Five acquires in one turn of a follower: one forward.
        for (i, key) in keys.iter().enumerate() {
            let req = Request::Acquire {
                wait_s: 0,
                lease_s: 30,
                owner: i as u64,
                key,
            };
            nodes[follower].request(now, i as ConnId, req, &mut out);
        }
        nodes[follower].end_turn(now, &mut out).unwrap();
        let sent = nodes[follower].take_messages();
        let forwards: Vec<&Message> = sent
            .iter()
            .filter(|m| m.msg_type == MessageType::MsgPropose)
            .collect();
        assert_eq!(forwards.len(), 1, "one forward: {sent:?}");
        assert_eq!(forwards[0].entries.len(), 5);
        for m in sent {
            let to = usize::try_from(m.to).unwrap() - 1;
            nodes[to].step(m);
        }
        // The leader appends them together: one append per follower.
        nodes[leader].end_turn(now, &mut out).unwrap();
        let sent = nodes[leader].take_messages();
        for f in (0..3).filter(|&f| f != leader) {
            let appends: Vec<&Message> = sent
                .iter()
                .filter(|m| m.msg_type == MessageType::MsgAppend && m.to == f as u64 + 1)
                .collect();
            assert_eq!(appends.len(), 1, "one append to node {}: {sent:?}", f + 1);
            assert_eq!(appends[0].entries.len(), 5);
        }
        for m in sent {
            let to = usize::try_from(m.to).unwrap() - 1;
            nodes[to].step(m);
        }
        for _ in 0..5 {
            settle_net(&mut nodes, now, &mut out);
        }
        // Each request applied once and is answered once, in order.
        let granted: Vec<u64> = out
            .iter()
            .filter_map(|a| match a.reply {
                Reply::Acquired { owner, .. } => Some(owner),
                _ => None,
            })
            .collect();
        assert_eq!(granted, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_batch_raft_drops_is_answered_busy_and_not_released() {
        let disks: Vec<MemDisk> = (0..3).map(|_| MemDisk::new()).collect();
        let mut out = Outbox::new();
        let mut now = Millis(0);
        let mut nodes = elected(&disks, &mut now, &mut out);
        let leader = nodes.iter().position(Node::is_leader).expect("a leader");
        let follower = (leader + 1) % 3;
        out.clear();
        nodes[follower].request(
            now,
            7,
            Request::Acquire {
                wait_s: 0,
                lease_s: 30,
                owner: 9,
                key: "a",
            },
            &mut out,
        );
        nodes[follower].request(now, 8, Request::Release { token: 3, key: "b" }, &mut out);
        assert!(out.is_empty(), "nothing is answered before the turn ends");
        // The follower loses its leader within the turn (a newer term,
        // no leader known yet): raft drops the proposal.
        let term = nodes[follower].term() + 1;
        nodes[follower].rn.raft.become_follower(term, 0);
        nodes[follower].end_turn(now, &mut out).unwrap();
        let replies: Vec<String> = out.iter().map(|a| format!("{:?}", a.reply)).collect();
        assert_eq!(replies.len(), 2, "{replies:?}");
        assert!(replies[0].starts_with("Busy"), "{replies:?}");
        assert!(replies[1].starts_with("NotReleased"), "{replies:?}");
        assert_eq!(nodes[follower].pending_requests(), 0, "forgotten");
        assert!(!nodes[follower]
            .take_messages()
            .iter()
            .any(|m| m.msg_type == MessageType::MsgPropose));
    }

    /// Delivers every message between `nodes` until none is left, except
    /// those to or from node index `cut` (dropped), running a turn on each
    /// receiver.
    fn settle_without(nodes: &mut [Node<MemDisk>], cut: usize, now: Millis, out: &mut Outbox) {
        for _ in 0..50 {
            let mut any = false;
            for i in 0..nodes.len() {
                for m in nodes[i].take_messages() {
                    let to = usize::try_from(m.to).unwrap() - 1;
                    if i == cut || to == cut {
                        continue;
                    }
                    any = true;
                    nodes[to].step(m);
                }
            }
            for (i, n) in nodes.iter_mut().enumerate() {
                if i != cut {
                    n.tick(now, out);
                    n.end_turn(now, out).unwrap();
                }
            }
            if !any {
                return;
            }
        }
    }

    #[test]
    fn requests_applied_inside_an_installed_snapshot_are_answered_or_their_connection_closed() {
        let disks: Vec<MemDisk> = (0..3).map(|_| MemDisk::new()).collect();
        let mut out = Outbox::new();
        let mut now = Millis(0);
        let mut nodes = elected(&disks, &mut now, &mut out);
        let leader = nodes.iter().position(Node::is_leader).expect("a leader");
        let follower = (leader + 1) % 3;
        out.clear();
        // Three clients of the follower: an acquire that is granted, an
        // acquire of a key that is held (wait 0: not granted) and a
        // release of a token that is not held.
        nodes[leader].request(
            now,
            1,
            Request::Acquire {
                wait_s: 0,
                lease_s: 30,
                owner: 1,
                key: "held",
            },
            &mut out,
        );
        settle_net(&mut nodes, now, &mut out);
        out.clear();
        let acquire = |key| Request::Acquire {
            wait_s: 0,
            lease_s: 30,
            owner: 2,
            key,
        };
        nodes[follower].request(now, 7, acquire("free"), &mut out);
        nodes[follower].request(now, 8, acquire("held"), &mut out);
        nodes[follower].request(now, 9, Request::Release { token: 1, key: "b" }, &mut out);
        nodes[follower].end_turn(now, &mut out).unwrap();
        // The forward reaches the leader, then the follower stops hearing
        // from it: the three requests commit and apply without it.
        let forward: Vec<Message> = nodes[follower].take_messages();
        assert!(forward
            .iter()
            .any(|m| m.msg_type == MessageType::MsgPropose));
        for m in forward {
            let to = usize::try_from(m.to).unwrap() - 1;
            nodes[to].step(m);
        }
        settle_without(&mut nodes, follower, now, &mut out);
        assert!(
            !out.iter().any(|a| (7..=9).contains(&a.conn)),
            "only the follower answers its clients"
        );
        assert_eq!(nodes[follower].pending_requests(), 3);
        // The leader compacts its log through them: the follower can only
        // catch up from a snapshot that covers its own requests.
        nodes[leader].snapshot_now = true;
        nodes[leader].request(now, 2, acquire("other"), &mut out);
        settle_without(&mut nodes, follower, now, &mut out);
        assert!(nodes[leader].snapshot_index() > nodes[follower].applied());
        out.clear();
        for _ in 0..50 {
            now = now.add_ms(100);
            settle_net(&mut nodes, now, &mut out);
            if nodes[follower].pending_requests() == 0 {
                break;
            }
        }
        assert!(
            nodes[follower].stats().snapshots_installed >= 1,
            "caught up by snapshot"
        );
        assert_eq!(
            nodes[follower].pending_requests(),
            0,
            "nothing left waiting"
        );
        let replies: Vec<(ConnId, String)> = out
            .iter()
            .map(|a| (a.conn, format!("{:?}", a.reply)))
            .filter(|(c, _)| (7..=9).contains(c))
            .collect();
        let mut closes = Vec::new();
        nodes[follower].take_closes(&mut closes);
        closes.sort_unstable();
        // The grant is still current: it is the answer. The other two
        // answers went with the entries: their connections are closed.
        assert_eq!(replies.len(), 1, "{replies:?}");
        assert_eq!(replies[0].0, 7, "{replies:?}");
        assert!(replies[0].1.starts_with("Acquired"), "{replies:?}");
        assert_eq!(
            closes,
            vec![8, 9],
            "every other request's connection is closed"
        );
        assert_eq!(nodes[follower].stats().unanswerable, 2);
    }

    #[test]
    fn a_leader_removes_itself_through_a_joint_configuration_that_survives_a_restart() {
        let disks: Vec<MemDisk> = (0..3).map(|_| MemDisk::new()).collect();
        let mut out = Outbox::new();
        let mut now = Millis(0);
        let mut nodes = elected(&disks, &mut now, &mut out);
        let leader = nodes.iter().position(Node::is_leader).expect("a leader");
        let me = leader as u64 + 1;
        let all: BTreeSet<u64> = [1, 2, 3].into();
        nodes[leader]
            .change_members(Change::Remove(me, false), &all)
            .expect("proposed");
        let (mut led_while_joint, mut refused, mut restarted) = (false, false, false);
        for _ in 0..400 {
            let mut any = false;
            for i in 0..nodes.len() {
                for m in nodes[i].take_messages() {
                    any = true;
                    let to = usize::try_from(m.to).unwrap() - 1;
                    nodes[to].step(m);
                }
            }
            if !any {
                now = now.add_ms(100);
            }
            for n in nodes.iter_mut() {
                n.tick(now, &mut out);
                n.end_turn(now, &mut out).unwrap();
            }
            if nodes[leader].is_leader() && !nodes[leader].voters_outgoing().is_empty() {
                led_while_joint = true;
                // A second change waits for the leave (409, see members).
                refused = nodes[leader].conf_change_pending();
                assert!(refused, "a change is in progress until the leave applies");
            }
            // A follower that restarts while joint reads the joint
            // configuration back (outgoing voters, auto leave).
            let f = (leader + 1) % 3;
            if !restarted && !nodes[f].voters_outgoing().is_empty() {
                let cs = nodes[f].rn.raft.prs().conf().to_conf_state();
                nodes[f] = Node::open(
                    NodeConfig::new(f as u64 + 1, vec![1, 2, 3]),
                    disks[f].clone(),
                    &quiet_logger(),
                )
                .expect("reopens");
                assert_eq!(nodes[f].rn.raft.prs().conf().to_conf_state(), cs);
                assert!(cs.auto_leave && cs.voters_outgoing.contains(&me), "{cs:?}");
                restarted = true;
            }
            let done = nodes.iter().enumerate().all(|(i, n)| {
                i == leader
                    || n.voters_outgoing().is_empty()
                        && !n.rn.raft.prs().conf().voters().contains(me)
            });
            if done && nodes.iter().any(Node::is_leader) && restarted {
                break;
            }
        }
        assert!(
            led_while_joint && refused && restarted,
            "saw the joint configuration"
        );
        assert!(!nodes[leader].is_leader(), "stepped down after the leave");
        assert!(nodes[leader].removed());
        let hist = nodes[leader].conf_history();
        assert_eq!(hist.len(), 2, "enter, then leave: {hist:?}");
        assert!(hist[0].voters_outgoing.contains(&me) && !hist[0].voters.contains(&me));
        assert!(hist[1].voters_outgoing.is_empty() && !hist[1].voters.contains(&me));
        let new_leader = nodes
            .iter()
            .position(Node::is_leader)
            .expect("a new leader");
        assert_ne!(new_leader, leader);
        for (i, n) in nodes.iter().enumerate().filter(|(i, _)| *i != leader) {
            assert_eq!(
                n.rn.raft.prs().conf().to_conf_state().voters.len(),
                2,
                "node {}",
                i + 1
            );
            assert!(
                n.replicated_members().addr(me).is_none(),
                "address forgotten"
            );
        }
    }
}

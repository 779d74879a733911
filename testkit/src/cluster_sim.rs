//! A deterministic simulation of a whole cluster in one process.
//!
//! N [`Node`]s on [`MemDisk`]s, a virtual millisecond clock, a network that
//! delays, reorders, duplicates and drops messages and cuts links (both ways
//! or one way), crashes that lose what was not synced (sometimes right at an
//! fsync), restarts, and clients that acquire, hold, extend, release and
//! give up.
//! Everything random comes from one seed, and raft's election timeouts are
//! drawn from the nodes' seeded generators, so a seed replays exactly.
//!
//! Keys are mutexes (`A`), except with [`SimConfig::permit_keys`]: then
//! the last two are keys of protocol 1.2 (`P`, PROTOCOL §6),
//! a semaphore of 2 or 3 permits and a read/write lock taken shared or,
//! less often, exclusive; now and then an acquire asks with the wrong limit
//! (an `L`, or the key registered with that limit while it is free).
//!
//! After every step the checker asserts:
//! * **one holder per key**: when a client receives a grant, no other client
//!   still believes it holds that key (a belief ends at release or at the
//!   client library's conservative expiry: `request sent + lease`, moved by
//!   each extension as below); on a key of limit N of 2 or more, fewer than
//!   N others do, all of that limit, and none exclusive if any is or the
//!   new grant is;
//! * **tokens increase**: a grant of a mutex received while its belief is
//!   valid carries a token above every token received before for that key
//!   (permits granted together may arrive in any order; the history
//!   checker orders tokens by real time); all tokens are distinct;
//! * **one log**: every node applies, at each index, the same entry (same
//!   term, same bytes), and each node's applied indices are consecutive
//!   (except across a snapshot install);
//! * **at most one answer** per request, and none after its client gave up;
//! * **at most one application** per request id, however often re-proposed.
//!
//! Half the clients are authenticated identities (each its own holder
//! number, as a Unix uid or a client certificate gives one), the others
//! unauthenticated. Now and then a client sends a release of a token
//! another, authenticated, client holds: it must be answered `N`, never
//! `R` (the grant is bound to its taker on every node, through leader
//! changes, re-proposals and snapshots).
//!
//! Holders sometimes extend their grant (by token, PROTOCOL §5), following the
//! client rules of §5.3: the conservative expiry moves only on a matched
//! `E`, to the moment that attempt was written plus its lease; an `E` that
//! arrives at or after the current expiry revives nothing; `X` ends the
//! holding; an attempt without an answer is given up after a while and the
//! same Extend is sent again on a new connection to another node, until the
//! expiry passes (then the grant is lost). One extend is in flight at a time
//! per client.
//!
//! The simulation also records what its clients did and saw as a
//! [`History`] on the virtual clock (milliseconds as microseconds): every
//! acquire, extend and release invoked, every answer, every give-up
//! (Indeterminate)
//! and every connection dropped (a session closed, by a give-up, a hang-up or
//! the node's crash; all remaining sessions close at the end of the run). At
//! the end [`History::check`] runs the shared checker on it: mutual exclusion
//! of grant intervals (as extended), the permit count, exclusive grants
//! alone and one limit per key on the permit keys, token order across keys
//! and leader changes, and every acquire answered once or its session
//! closed. FIFO is not checked here: a
//! client cannot see when a follower's forwarded request was queued.
//!
//! Among the faults are membership changes ([`SimConfig::conf_changes`]),
//! made through the leader's [`Node::change_members`] as the admin port
//! makes them: a spare node (started with no configuration, as `--join`
//! does) is added as a learner, a learner promoted or removed, a voter
//! removed (the leader half of the time) while more than three remain.
//! Messages from a node that is not in the receiver's configuration are
//! dropped, as the peer transport refuses them.
//!
//! At the end the network heals and every node restarts; the cluster must
//! then answer fresh acquires on every member and all members' tables must
//! be equal.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};

use crate::checker::{ExtendOutcome, History, OpId, Outcome, ReleaseOutcome};
use crate::rng::SplitMix64;
use ticketd::cluster::command::Rid;
use ticketd::cluster::log::MemDisk;
use ticketd::cluster::members::Change;
use ticketd::cluster::node::{quiet_logger, Node, NodeConfig, Traced};
use ticketd::engine::{Caller, ConnId, Outbox};
use ticketd::limits::EngineLimits;
use ticketd::proto::{Mode, Places, Reply, Request};
use ticketd::time::Millis;

mod checks;
mod clients;
mod network;
mod replies;

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The seed: everything follows from it.
    pub seed: u64,
    /// Number of nodes (3 or 5).
    pub nodes: usize,
    /// Virtual milliseconds of chaos before the final heal.
    pub chaos_ms: u64,
    /// Virtual milliseconds after the heal for the liveness check.
    pub heal_ms: u64,
    /// Clients (spread over the nodes).
    pub clients: usize,
    /// Distinct keys (few keys means contention).
    pub keys: usize,
    /// With at least three keys, the last two are a semaphore of 2 or 3
    /// (by seed) and a read/write lock (PROTOCOL §6), the others mutexes.
    /// Off in [`SimConfig::new`], so that the fixed-seed runs keep four
    /// mutex keys; the sweep (`make sim`) turns it on for half of its
    /// seeds.
    pub permit_keys: bool,
    /// Probability a message is dropped.
    pub drop_p: f64,
    /// Probability a message is delivered twice.
    pub dup_p: f64,
    /// Message delay range in ms.
    pub delay_ms: (u64, u64),
    /// Mean ms between faults (crash, partition, heal).
    pub fault_every_ms: u64,
    /// Applied entries between snapshots on each node.
    pub snapshot_every: u64,
    /// Probability that a client extends a grant it just received (and
    /// again after each `E`); 0 turns extends off.
    pub extend_p: f64,
    /// A deliberate bug in the nodes, to show the checks catch it.
    pub bug: Option<SimBug>,
    /// Membership changes among the faults.
    pub conf_changes: bool,
    /// Spare nodes (ids after `nodes`) that start empty and may be added.
    pub spares: usize,
    /// Each node's [`NodeConfig::leader_sync_ms`]: 0 (a leader syncs every
    /// batch) for one seed in three, the default for the others, so that
    /// runs cover both.
    pub leader_sync_ms: u64,
}

/// A deliberate bug, for tests that the simulation's checks catch it. With
/// a bug set, the simulation's own step-by-step holder check is off, so
/// that the history checker is what has to find the violation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimBug {
    /// A leader's `Expire` timer of an earlier lease generation still ends
    /// the grant when it fires and is applied, as if no Extend had
    /// happened since (see [`NodeConfig::bug_stale_expire`]).
    StaleExpireEndsExtendedGrant,
}

impl SimConfig {
    /// A default chaotic run of `nodes` nodes for `seed`.
    #[must_use]
    pub fn new(seed: u64, nodes: usize) -> Self {
        SimConfig {
            seed,
            nodes,
            chaos_ms: 40_000,
            heal_ms: 20_000,
            clients: 12,
            keys: 4,
            permit_keys: false,
            drop_p: 0.03,
            dup_p: 0.01,
            delay_ms: (1, 30),
            fault_every_ms: 3_000,
            snapshot_every: 64,
            extend_p: 0.4,
            bug: None,
            conf_changes: true,
            spares: 2,
            leader_sync_ms: if seed % 3 == 0 {
                0
            } else {
                ticketd::cluster::node::DEFAULT_LEADER_SYNC_MS
            },
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimReport {
    /// Grants received by clients.
    pub grants: u64,
    /// Releases answered R.
    pub releases: u64,
    /// Extend attempts sent (re-sends on a new connection included).
    pub extends: u64,
    /// Extend attempts sent again after no answer.
    pub extend_resends: u64,
    /// Extends answered E in time (each moved a conservative expiry).
    pub extended: u64,
    /// Extends answered X.
    pub not_extended: u64,
    /// Extended grants lost because no E came before the expiry.
    pub extend_lost: u64,
    /// E or X that arrived after the expiry (nothing revived).
    pub late_extend_answers: u64,
    /// Holds that lasted past their first lease thanks to extends.
    pub held_past_first_lease: u64,
    /// Extends of a token no grant had, answered X (as they must be).
    pub unknown_token_x: u64,
    /// Releases of another authenticated client's grant by its token,
    /// answered N (as they must be).
    pub others_refused: u64,
    /// Timeouts (T) received.
    pub timeouts: u64,
    /// Busy (B) received.
    pub busy: u64,
    /// LimitMismatch (L) received.
    pub limit_mismatches: u64,
    /// Grants received of a key of limit 2 or more.
    pub permit_grants: u64,
    /// NotReleased (N) received.
    pub not_released: u64,
    /// Requests given up by their client (no answer in time, or its
    /// connection closed).
    pub given_up: u64,
    /// Connections a node closed because a request of theirs applied
    /// inside a snapshot it installed, with an answer it could not tell.
    pub closed_by_node: u64,
    /// Crashes (including at an fsync).
    pub crashes: u64,
    /// Highest index applied anywhere.
    pub applied: u64,
    /// Snapshots installed from leaders.
    pub snapshot_installs: u64,
    /// Leader terms seen.
    pub max_term: u64,
    /// Expire/WaitTimeout proposals.
    pub timer_proposals: u64,
    /// Lost proposals made again.
    pub reproposals: u64,
    /// A digest of the final table (equal on every node).
    pub digest: u64,
    /// What the history checker found in the clients' history.
    pub checked: crate::checker::Report,
    /// Membership changes proposed (and accepted by the leader's checks).
    pub conf_changes: u64,
    /// Membership changes the leader refused (in flight, too few left...).
    pub conf_refused: u64,
    /// Voters at the end.
    pub final_voters: Vec<u64>,
    /// Times a leader was seen in a joint configuration after none was
    /// (every change passes through one).
    pub joint_configs: u64,
}

#[derive(Clone, Debug)]
enum ClientState {
    Idle,
    Acquiring {
        owner: u64,
        key: usize,
        /// [`crate::checker::MUTEX`] for a plain `A`.
        places: Places,
        sent: Millis,
        lease_s: u8,
        give_up: Millis,
    },
    Holding {
        key: usize,
        token: u64,
        until: Millis,
        release_at: Millis,
        extend_at: Millis,
        /// The first lease's conservative end.
        first_until: Millis,
    },
    /// An Extend of the held grant is in flight (the holding goes on: its
    /// expiry is still `until` until an `E` is matched).
    Extending {
        key: usize,
        token: u64,
        until: Millis,
        release_at: Millis,
        first_until: Millis,
        /// When this attempt was written.
        sent: Millis,
        lease_s: u8,
        /// When this attempt is given up and sent again elsewhere.
        retry_at: Millis,
    },
    Releasing {
        token: u64,
        give_up: Millis,
    },
    /// An Extend of a token no grant ever had (PROTOCOL §5.2 "not registered"
    /// or "token does not match"): it must be answered `X`, never `E`.
    ExtendingUnknown {
        token: u64,
        give_up: Millis,
    },
    /// A Release of a grant another, authenticated, client holds, with
    /// its token: it must be answered `N`, never `R`.
    ReleasingOthers {
        token: u64,
        /// The client holding it.
        victim: usize,
        give_up: Millis,
    },
}

#[derive(Debug)]
struct Client {
    node: u64,
    conn: ConnId,
    /// Who the client is: an authenticated identity's holder number, or
    /// the default (unauthenticated).
    caller: Caller,
    state: ClientState,
    next_at: Millis,
    /// The history's id of the request in flight (acquire, extend or
    /// release).
    op: Option<OpId>,
    /// Extends whose grant expired while they were in flight: their late
    /// answers may still come on this connection (token, history op).
    stale: Vec<(u64, OpId)>,
}

/// A message in flight: (deliver at, sequence, destination, bytes).
type InFlight = Reverse<(Millis, u64, u64, Vec<u8>)>;

/// A belief of holding `key`: (client, token, until, what was asked).
type Belief = (usize, u64, Millis, Places);

/// The simulation. See the module documentation.
pub struct Sim {
    cfg: SimConfig,
    rng: SplitMix64,
    now: Millis,
    nodes: Vec<Option<Node<MemDisk>>>,
    disks: Vec<MemDisk>,
    restart_at: Vec<Millis>,
    net: BinaryHeap<InFlight>,
    net_seq: u64,
    blocked: BTreeSet<(u64, u64)>,
    clients: Vec<Client>,
    conn_owner: BTreeMap<(u64, ConnId), usize>,
    next_conn: ConnId,
    next_owner: u64,
    next_fault: Millis,
    /// When the next membership change is tried.
    next_change: Millis,
    /// A leader was in a joint configuration at the end of the last step.
    joint: bool,
    beliefs: BTreeMap<usize, Vec<Belief>>,
    max_token: BTreeMap<usize, u64>,
    tokens: BTreeSet<u64>,
    log: BTreeMap<u64, (u64, u64)>,
    requests: BTreeMap<Rid, u64>,
    last_applied: Vec<u64>,
    report: SimReport,
    history: History,
    clients_active: bool,
    debug: bool,
    logger: slog::Logger,
    out: Outbox,
}

fn node_config(id: u64, cfg: &SimConfig) -> NodeConfig {
    let (n, seed, snapshot_every) = (cfg.nodes, cfg.seed, cfg.snapshot_every);
    let mut c = NodeConfig::new(id, (1..=n as u64).collect());
    if id > n as u64 {
        c.voters.clear();
        c.join = true;
    }
    c.peer_addrs = (1..=slots(cfg) as u64)
        .map(|i| {
            (
                i,
                std::net::SocketAddr::from(([127, 0, 0, 1], 7000 + i as u16)),
            )
        })
        .collect();
    c.bug_stale_expire = cfg.bug == Some(SimBug::StaleExpireEndsExtendedGrant);
    c.seed = seed.wrapping_mul(31).wrapping_add(id);
    c.os_token_bits = false;
    c.snapshot_every = snapshot_every;
    c.leader_sync_ms = cfg.leader_sync_ms;
    c.trace_applied = true;
    c.max_pending = 64;
    c.limits = EngineLimits {
        max_keys: 1000,
        max_waiters: 6,
        max_waiters_per_key: 3,
        ..EngineLimits::default()
    };
    c
}

/// Node slots: the first voters and the spares.
fn slots(cfg: &SimConfig) -> usize {
    if cfg.conf_changes {
        cfg.nodes + cfg.spares
    } else {
        cfg.nodes
    }
}

impl Sim {
    fn slots(&self) -> usize {
        slots(&self.cfg)
    }

    /// The configuration of the node that applied the most: (voters,
    /// learners). What the chaos keeps a majority of up.
    fn conf(&self) -> (Vec<u64>, Vec<u64>) {
        voters_and_learners(self.nodes.iter().flatten().max_by_key(|n| n.applied()))
    }

    /// The configuration the cluster acts on after the heal, for the final
    /// checks: the leader's of the highest term, else `conf`'s. Not the
    /// most advanced node's: a member that holds a wrong configuration
    /// may be as advanced as the leader, and must be compared with it,
    /// not taken for it.
    fn leader_conf(&self) -> (Vec<u64>, Vec<u64>) {
        let leader = self
            .nodes
            .iter()
            .flatten()
            .filter(|n| n.is_leader())
            .max_by_key(|n| n.term());
        match leader {
            Some(n) => voters_and_learners(Some(n)),
            None => self.conf(),
        }
    }

    /// A fresh cluster for `cfg`.
    pub fn new(cfg: SimConfig) -> Result<Self, String> {
        let logger = quiet_logger();
        let mut rng = SplitMix64::new(cfg.seed);
        let mut nodes = Vec::new();
        let mut disks = Vec::new();
        for id in 1..=slots(&cfg) as u64 {
            let disk = MemDisk::new();
            let node = Node::open(node_config(id, &cfg), disk.clone(), &logger)
                .map_err(|e| format!("open node {id}: {e}"))?;
            nodes.push(Some(node));
            disks.push(disk);
        }
        let (clients, conn_owner) = initial_clients(&cfg, &mut rng);
        let next_fault = Millis(rng.range(cfg.fault_every_ms / 2, cfg.fault_every_ms * 3 / 2));
        let next_change = if cfg.conf_changes {
            Millis(3_000)
        } else {
            Millis::NEVER
        };
        Ok(Sim {
            restart_at: vec![Millis::NEVER; slots(&cfg)],
            last_applied: vec![0; slots(&cfg)],
            next_conn: cfg.clients as ConnId + 1,
            cfg,
            rng,
            now: Millis::ZERO,
            nodes,
            disks,
            net: BinaryHeap::new(),
            net_seq: 0,
            blocked: BTreeSet::new(),
            clients,
            conn_owner,
            next_owner: 1,
            next_fault,
            next_change,
            joint: false,
            beliefs: BTreeMap::new(),
            max_token: BTreeMap::new(),
            tokens: BTreeSet::new(),
            log: BTreeMap::new(),
            requests: BTreeMap::new(),
            report: SimReport::default(),
            history: History::new(),
            clients_active: true,
            debug: std::env::var_os("SIM_DEBUG").is_some(),
            logger,
            out: Outbox::new(),
        })
    }

    fn fail<T>(&self, what: String) -> Result<T, String> {
        Err(format!("seed {} at {}: {what}", self.cfg.seed, self.now))
    }

    /// Runs chaos, then the heal and the final checks.
    pub fn run(self) -> Result<SimReport, String> {
        self.run_with_history().map(|(r, _)| r)
    }

    /// Like [`Sim::run`], and also returns the clients' history (already
    /// checked).
    pub fn run_with_history(mut self) -> Result<(SimReport, History), String> {
        let chaos_end = Millis(self.cfg.chaos_ms);
        while self.now < chaos_end {
            self.step(true)?;
        }
        // Heal: reconnect everything, restart every crashed node.
        self.blocked.clear();
        for i in 0..self.slots() {
            self.disks[i].disarm();
            if self.nodes[i].is_none() {
                self.restart_at[i] = self.now;
            }
        }
        let heal_end = chaos_end.add_ms(self.cfg.heal_ms);
        while self.now < heal_end {
            self.step(false)?;
        }
        // Quiesce: no new requests; leases and waits run out.
        self.clients_active = false;
        let quiet_end = self.now.add_ms(8_000);
        while self.now < quiet_end {
            self.step(false)?;
        }
        self.liveness_checks()?;
        let quiet_end = self.now.add_ms(2_000);
        while self.now < quiet_end {
            self.step(false)?;
        }
        self.final_checks()?;
        // The run is over: every client closes its connection, which settles
        // the requests that never got an answer.
        for c in 0..self.clients.len() {
            self.history
                .session_closed(self.clients[c].conn, us(self.now));
        }
        match self.history.check() {
            Ok(r) => self.report.checked = r,
            Err(v) => return self.fail(format!("history checker: {v}")),
        }
        Ok((self.report, self.history))
    }

    fn step(&mut self, chaos: bool) -> Result<(), String> {
        // Jump to the next event, at most 50 ms ahead.
        let mut next = self.now.add_ms(50);
        if let Some(Reverse((at, _, _, _))) = self.net.peek() {
            next = next.min(*at);
        }
        for n in self.nodes.iter().flatten() {
            next = next.min(n.next_deadline());
        }
        for c in &self.clients {
            next = next.min(c.next_at);
        }
        for r in &self.restart_at {
            next = next.min(*r);
        }
        if chaos {
            next = next.min(self.next_fault).min(self.next_change);
        }
        let before = self.now;
        self.now = next.max(self.now.add_ms(1));
        if self.debug && before.0 / 1000 != self.now.0 / 1000 {
            let nodes: Vec<String> = self
                .nodes
                .iter()
                .map(|n| match n {
                    Some(n) => format!(
                        "t{} l{} a{} c{}{}",
                        n.term(),
                        n.leader(),
                        n.applied(),
                        n.committed(),
                        if n.is_leader() { "*" } else { "" }
                    ),
                    None => "down".into(),
                })
                .collect();
            eprintln!("{} {:?} blocked {:?}", self.now, nodes, self.blocked);
        }
        if chaos && self.now >= self.next_fault {
            self.fault();
        }
        if chaos && self.now >= self.next_change {
            self.change_members();
            self.next_change = self.now.add_ms(self.rng.range(1_000, 4_000));
        }
        self.restarts()?;
        self.deliver();
        for i in 0..self.slots() {
            self.tick_node(i)?;
        }
        if self.clients_active {
            self.clients_act()?;
        }
        for i in 0..self.slots() {
            self.end_turn(i)?;
        }
        let joint = self
            .nodes
            .iter()
            .flatten()
            .any(|n| n.is_leader() && !n.voters_outgoing().is_empty());
        if joint && !self.joint {
            self.report.joint_configs += 1;
        }
        self.joint = joint;
        Ok(())
    }

    fn tick_node(&mut self, i: usize) -> Result<(), String> {
        let Some(node) = self.nodes[i].as_mut() else {
            return Ok(());
        };
        self.out.clear();
        node.tick(self.now, &mut self.out);
        let trace = node.take_trace();
        self.check_trace(i, &trace)?;
        let replies: Vec<(ConnId, String, Reply<'static>)> = self
            .out
            .iter()
            .map(|a| (a.conn, a.reply.key().to_owned(), owned(a.reply)))
            .collect();
        self.out.clear();
        for (conn, key, reply) in replies {
            self.on_reply(i as u64 + 1, conn, &key, reply)?;
        }
        Ok(())
    }

    fn end_turn(&mut self, i: usize) -> Result<(), String> {
        let Some(node) = self.nodes[i].as_mut() else {
            return Ok(());
        };
        let id = i as u64 + 1;
        self.out.clear();
        let res = node.end_turn(self.now, &mut self.out);
        let msgs = node.take_messages();
        let trace = node.take_trace();
        let stats = node.stats();
        let term = node.term();
        if stats.refused_messages > 0 {
            // Every message here comes from a correct node (delayed,
            // reordered, duplicated at most): none may be refused.
            return self.fail(format!(
                "node {id} refused {} message(s) of correct peers",
                stats.refused_messages
            ));
        }
        for m in msgs {
            self.send(id, m);
        }
        self.check_trace(i, &trace)?;
        self.report.max_term = self.report.max_term.max(term);
        let replies: Vec<(ConnId, String, Reply<'static>)> = self
            .out
            .iter()
            .map(|a| (a.conn, a.reply.key().to_owned(), owned(a.reply)))
            .collect();
        self.out.clear();
        for (conn, key, reply) in replies {
            self.on_reply(id, conn, &key, reply)?;
        }
        // Connections the node closes (a request of theirs applied inside
        // a snapshot it installed, with an answer it cannot tell): their
        // clients see the close, as a real client does (Indeterminate).
        let mut closes = Vec::new();
        if let Some(node) = self.nodes[i].as_mut() {
            node.take_closes(&mut closes);
        }
        for conn in closes {
            if let Some(&c) = self.conn_owner.get(&(id, conn)) {
                self.report.closed_by_node += 1;
                self.reconnect(c);
            }
        }
        if let Err(e) = res {
            // The disk failed at an fsync: the node is dead from here on.
            self.crash(i, &format!("{e}"), stats);
        }
        Ok(())
    }
}

/// A node's configuration as (voters, learners); empty for none.
fn voters_and_learners(n: Option<&Node<MemDisk>>) -> (Vec<u64>, Vec<u64>) {
    let Some(n) = n else {
        return (Vec::new(), Vec::new());
    };
    let m = n.members();
    (
        m.iter().filter(|m| !m.learner).map(|m| m.id).collect(),
        m.iter().filter(|m| m.learner).map(|m| m.id).collect(),
    )
}

/// Rounds of 10 virtual ms the liveness check waits for each node's grant.
const LIVENESS_ROUNDS: u32 = 2_500;

/// A virtual time in the history's microseconds.
fn us(t: Millis) -> u64 {
    t.0.saturating_mul(1000)
}

fn owned(r: Reply<'_>) -> Reply<'static> {
    let key = "";
    match r {
        Reply::Acquired { token, owner, .. } => Reply::Acquired { token, owner, key },
        Reply::Timeout { owner, .. } => Reply::Timeout { owner, key },
        Reply::Busy { owner, .. } => Reply::Busy { owner, key },
        Reply::Released { token, .. } => Reply::Released { token, key },
        Reply::NotReleased { token, .. } => Reply::NotReleased { token, key },
        Reply::Extended { token, .. } => Reply::Extended { token, key },
        Reply::NotExtended { token, .. } => Reply::NotExtended { token, key },
        Reply::LimitMismatch { owner, limit, .. } => Reply::LimitMismatch { owner, limit, key },
    }
}

/// Runs one seed.
pub fn run(cfg: SimConfig) -> Result<SimReport, String> {
    Sim::new(cfg)?.run()
}

/// Runs one seed and returns the clients' checked history too.
pub fn run_with_history(cfg: SimConfig) -> Result<(SimReport, History), String> {
    Sim::new(cfg)?.run_with_history()
}

/// The simulation's clients at the start, each idle on its node (spread
/// round-robin) with its first action drawn from `rng`, and the map from
/// each (node, connection) to the client on it.
fn initial_clients(
    cfg: &SimConfig,
    rng: &mut SplitMix64,
) -> (Vec<Client>, BTreeMap<(u64, ConnId), usize>) {
    let mut clients = Vec::new();
    let mut conn_owner = BTreeMap::new();
    for i in 0..cfg.clients {
        let node = 1 + (i % cfg.nodes) as u64;
        let conn = i as ConnId + 1;
        conn_owner.insert((node, conn), i);
        // Distinct odd holder numbers for the authenticated half.
        let caller = if i % 2 == 0 {
            Caller {
                holder: 0x5EED_0000_0000_0001 + 2 * i as u64,
                admin: false,
            }
        } else {
            Caller::default()
        };
        clients.push(Client {
            node,
            conn,
            caller,
            state: ClientState::Idle,
            next_at: Millis(rng.range(0, 3000)),
            op: None,
            stale: Vec::new(),
        });
    }
    (clients, conn_owner)
}

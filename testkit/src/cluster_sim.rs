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
//! After every step the checker asserts:
//! * **one holder per key**: when a client receives a grant, no other client
//!   still believes it holds that key (a belief ends at release or at the
//!   client library's conservative expiry: `request sent + lease`, moved by
//!   each extension as below);
//! * **tokens increase**: a grant received while its belief is valid carries
//!   a token above every token received before for that key; all tokens are
//!   distinct;
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
//! of grant intervals (as extended), token order across keys and leader
//! changes, and every acquire answered once or its session closed. FIFO is not checked here: a
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
use ticketd::proto::{Reply, Request};
use ticketd::time::Millis;

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

/// A belief of holding `key`: (client, token, until).
type Belief = (usize, u64, Millis);

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

    /// One membership change through the leader, as the admin port does.
    fn change_members(&mut self) {
        let Some(li) = self
            .nodes
            .iter()
            .position(|n| n.as_ref().is_some_and(Node::is_leader))
        else {
            return;
        };
        let leader = li as u64 + 1;
        let (voters, learners) = voters_and_learners(self.nodes[li].as_ref());
        let removed = self.nodes[li]
            .as_ref()
            .map(|n| n.replicated_members().removed().clone())
            .unwrap_or_default();
        let spare = (self.cfg.nodes as u64 + 1..=self.slots() as u64)
            .find(|id| !voters.contains(id) && !learners.contains(id) && !removed.contains(id));
        let change = if let Some(&l) = learners.first() {
            if self.rng.chance(0.8) {
                Change::Promote(l)
            } else {
                Change::Remove(l, false)
            }
        } else if let Some(id) = spare.filter(|_| voters.len() < 5 || self.rng.chance(0.3)) {
            Change::AddLearner(
                id,
                std::net::SocketAddr::from(([127, 0, 0, 1], 7000 + id as u16)),
            )
        } else if voters.len() > 3 {
            let id = if self.rng.chance(0.5) {
                leader
            } else {
                voters[self.rng.range(0, voters.len() as u64) as usize]
            };
            Change::Remove(id, false)
        } else {
            return;
        };
        let reachable: BTreeSet<u64> = (1..=self.slots() as u64)
            .filter(|&id| {
                self.nodes[id as usize - 1].is_some()
                    && !self.blocked.contains(&(leader, id))
                    && !self.blocked.contains(&(id, leader))
            })
            .collect();
        let Some(n) = self.nodes[li].as_mut() else {
            return;
        };
        match n.change_members(change, &reachable) {
            Ok(what) => {
                self.report.conf_changes += 1;
                if self.debug {
                    eprintln!("{} leader {leader}: {what}", self.now);
                }
            }
            Err(r) => {
                self.report.conf_refused += 1;
                if self.debug {
                    eprintln!("{} leader {leader}: refused: {r}", self.now);
                }
            }
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

    fn send(&mut self, from: u64, m: Message) {
        let to = m.to;
        if self.blocked.contains(&(from, to)) || self.rng.chance(self.cfg.drop_p) {
            if m.msg_type == MessageType::MsgSnapshot {
                if let Some(n) = self.nodes[from as usize - 1].as_mut() {
                    n.report_snapshot(to, false);
                }
            }
            return;
        }
        let bytes = m.write_to_bytes().expect("raft messages encode");
        let copies = if self.rng.chance(self.cfg.dup_p) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let at = self
                .now
                .add_ms(self.rng.range(self.cfg.delay_ms.0, self.cfg.delay_ms.1 + 1));
            self.net_seq += 1;
            self.net
                .push(Reverse((at, self.net_seq, to, bytes.clone())));
        }
        if m.msg_type == MessageType::MsgSnapshot {
            if let Some(n) = self.nodes[from as usize - 1].as_mut() {
                n.report_snapshot(to, true);
            }
        }
    }

    fn deliver(&mut self) {
        while let Some(Reverse((at, _, _, _))) = self.net.peek() {
            if *at > self.now {
                break;
            }
            let Some(Reverse((_, _, to, bytes))) = self.net.pop() else {
                break;
            };
            let Ok(m) = Message::parse_from_bytes(&bytes) else {
                continue;
            };
            if let Some(n) = self.nodes[to as usize - 1].as_mut() {
                // The peer transport refuses nodes outside this node's
                // configuration (a node that has none yet takes --peers).
                let peers = n.peer_addrs();
                if !n.members().is_empty() && !peers.contains_key(&m.from) {
                    continue;
                }
                n.step(m);
            }
        }
    }

    /// A node to hurt: the leader half of the time (that is what forces
    /// elections, lost proposals and timer rebuilds), else any node.
    fn victim(&mut self) -> u64 {
        let leader = self
            .nodes
            .iter()
            .flatten()
            .find(|n| n.is_leader())
            .map(Node::id);
        match leader {
            Some(l) if self.rng.chance(0.5) => l,
            _ => self.rng.range(1, self.slots() as u64 + 1),
        }
    }

    fn fault(&mut self) {
        let n = self.slots() as u64;
        let (voters, _) = self.conf();
        let live = voters
            .iter()
            .filter(|id| self.nodes[**id as usize - 1].is_some())
            .count();
        match self.rng.range(0, 10) {
            0..=2 => {
                // Crash a node (at most a minority of the voters down at
                // once, so the run keeps making progress; safety does not
                // depend on it).
                let i = self.victim() as usize - 1;
                let voter = voters.contains(&(i as u64 + 1));
                if (!voter || live > voters.len() / 2 + 1) && self.nodes[i].is_some() {
                    if self.rng.chance(0.5) {
                        // Die inside the next fsync.
                        self.disks[i].fail_next_sync();
                    } else {
                        let stats = self.nodes[i].as_ref().map(Node::stats).unwrap_or_default();
                        self.crash(i, "power cut", stats);
                    }
                }
            }
            3 | 4 => {
                // Isolate one node both ways.
                let a = self.victim();
                for b in 1..=n {
                    if b != a {
                        self.blocked.insert((a, b));
                        self.blocked.insert((b, a));
                    }
                }
            }
            5 => {
                // One-way cut, from or to the victim.
                let a = self.victim();
                let b = self.rng.range(1, n + 1);
                if a != b {
                    if self.rng.chance(0.5) {
                        self.blocked.insert((a, b));
                    } else {
                        self.blocked.insert((b, a));
                    }
                }
            }
            6 => {
                // Split in two groups.
                self.blocked.clear();
                let mask = self.rng.next_u64();
                for a in 1..=n {
                    for b in 1..=n {
                        if (mask >> a) & 1 != (mask >> b) & 1 {
                            self.blocked.insert((a, b));
                        }
                    }
                }
            }
            _ => self.blocked.clear(),
        }
        self.next_fault = self.now.add_ms(
            self.rng
                .range(self.cfg.fault_every_ms / 2, self.cfg.fault_every_ms * 3 / 2),
        );
    }

    fn crash(&mut self, i: usize, why: &str, stats: ticketd::cluster::node::NodeStats) {
        if self.nodes[i].take().is_none() {
            return;
        }
        let _ = why;
        self.report.crashes += 1;
        self.report.snapshot_installs += stats.snapshots_installed;
        self.report.timer_proposals += stats.timer_proposals;
        self.report.reproposals += stats.reproposed;
        let unsynced = self.disks[i].unsynced() as u64;
        let keep = self.rng.range(0, unsynced + 1) as usize;
        self.disks[i].crash(keep);
        self.restart_at[i] = self.now.add_ms(self.rng.range(200, 4000));
        // Clients connected to it lose their connection.
        let id = i as u64 + 1;
        for c in 0..self.clients.len() {
            if self.clients[c].node == id {
                self.reconnect(c);
            }
        }
    }

    /// The client's connection is gone: its outstanding request is given up
    /// (never answered); what it holds it keeps holding (a lock belongs to
    /// the token), and it continues on another node.
    fn reconnect(&mut self, c: usize) {
        let old = (self.clients[c].node, self.clients[c].conn);
        self.conn_owner.remove(&old);
        if let Some(n) = self.nodes[old.0 as usize - 1].as_mut() {
            n.disconnect(old.1);
        }
        let now_us = us(self.now);
        match (self.clients[c].state.clone(), self.clients[c].op.take()) {
            (ClientState::Acquiring { .. }, Some(op)) => {
                self.history.acquired(op, Outcome::Indeterminate, now_us);
            }
            (ClientState::Releasing { .. } | ClientState::ReleasingOthers { .. }, Some(op)) => {
                self.history
                    .released(op, ReleaseOutcome::Indeterminate, now_us);
            }
            // The attempt is given up unanswered: it moves nothing (the
            // Extend goes out again on the new connection).
            (ClientState::Extending { .. } | ClientState::ExtendingUnknown { .. }, Some(op)) => {
                self.history.extended(op, ExtendOutcome::Lost, now_us);
            }
            _ => {}
        }
        // A late answer to an expired extend can no longer come.
        self.clients[c].stale.clear();
        self.history.session_closed(old.1, now_us);
        match self.clients[c].state {
            ClientState::Acquiring { .. }
            | ClientState::Releasing { .. }
            | ClientState::ReleasingOthers { .. }
            | ClientState::ExtendingUnknown { .. } => {
                self.report.given_up += 1;
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = self.now.add_ms(self.rng.range(0, 1000));
            }
            ClientState::Extending {
                ref mut retry_at, ..
            } => {
                // The holding goes on; the same Extend goes out again on
                // the new connection (PROTOCOL §5.3).
                *retry_at = self.now;
                self.clients[c].next_at = self.now;
            }
            _ => {}
        }
        let node = self.rng.range(1, self.slots() as u64 + 1);
        let conn = self.next_conn;
        self.next_conn += 1;
        self.clients[c].node = node;
        self.clients[c].conn = conn;
        self.conn_owner.insert((node, conn), c);
    }

    fn restarts(&mut self) -> Result<(), String> {
        for i in 0..self.slots() {
            if self.restart_at[i] > self.now {
                continue;
            }
            self.restart_at[i] = Millis::NEVER;
            if self.nodes[i].is_some() {
                continue;
            }
            let id = i as u64 + 1;
            let cfg = node_config(id, &self.cfg);
            match Node::open(cfg, self.disks[i].clone(), &self.logger) {
                Ok(n) => {
                    self.last_applied[i] = n.applied();
                    self.nodes[i] = Some(n);
                }
                Err(e) => return self.fail(format!("restart of node {id} failed: {e}")),
            }
        }
        Ok(())
    }

    fn check_trace(&mut self, i: usize, trace: &[Traced]) -> Result<(), String> {
        for t in trace {
            let id = i + 1;
            if t.snapshot {
                if t.index <= self.last_applied[i] {
                    return self.fail(format!(
                        "node {id} installed snapshot {} at or below applied {}",
                        t.index, self.last_applied[i]
                    ));
                }
            } else {
                if t.index != self.last_applied[i] + 1 {
                    return self.fail(format!(
                        "node {id} applied {} after {}",
                        t.index, self.last_applied[i]
                    ));
                }
                match self.log.get(&t.index) {
                    Some(&(term, hash)) if (term, hash) != (t.term, t.hash) => {
                        return self.fail(format!(
                            "node {id} applied a different entry at index {}",
                            t.index
                        ));
                    }
                    Some(_) => {}
                    None => {
                        self.log.insert(t.index, (t.term, t.hash));
                    }
                }
                if let Some(rid) = t.request {
                    let first = *self.requests.entry(rid).or_insert(t.index);
                    if first != t.index {
                        return self.fail(format!(
                            "request {rid:?} applied at index {first} and again at {}",
                            t.index
                        ));
                    }
                }
            }
            self.last_applied[i] = t.index;
            self.report.applied = self.report.applied.max(t.index);
        }
        Ok(())
    }

    fn clients_act(&mut self) -> Result<(), String> {
        for c in 0..self.clients.len() {
            // A request that got no answer in time is given up: the client
            // closes that connection (PROTOCOL §3: Indeterminate).
            let give_up = match self.clients[c].state {
                ClientState::Acquiring { give_up, .. }
                | ClientState::Releasing { give_up, .. }
                | ClientState::ReleasingOthers { give_up, .. }
                | ClientState::ExtendingUnknown { give_up, .. } => give_up <= self.now,
                _ => false,
            };
            // Now and then a waiting client hangs up (its queued acquire
            // must be cancelled cluster-wide and never answered).
            let hang_up = matches!(self.clients[c].state, ClientState::Acquiring { .. })
                && self.rng.chance(0.0005);
            if give_up || hang_up {
                self.reconnect(c);
                continue;
            }
            match self.clients[c].state {
                ClientState::Holding {
                    key,
                    until,
                    first_until,
                    ..
                } if until <= self.now => {
                    self.hold_ended(first_until);
                    self.drop_belief(c, key);
                    self.clients[c].state = ClientState::Idle;
                }
                ClientState::Extending {
                    key,
                    until,
                    token,
                    first_until,
                    ..
                } if until <= self.now => {
                    self.hold_ended(first_until);
                    // No E before the expiry: the grant is lost. The
                    // attempt stays on its connection; an answer to it now
                    // revives nothing.
                    self.report.extend_lost += 1;
                    self.drop_belief(c, key);
                    if let Some(op) = self.clients[c].op.take() {
                        self.clients[c].stale.push((token, op));
                    }
                    self.clients[c].state = ClientState::Idle;
                    self.clients[c].next_at = self.now;
                }
                _ => {}
            }
            if self.clients[c].next_at > self.now {
                continue;
            }
            let node = self.clients[c].node;
            if self.nodes[node as usize - 1].is_none() {
                self.reconnect(c);
                continue;
            }
            match self.clients[c].state.clone() {
                ClientState::Idle if self.rng.chance(0.02) && self.others_grant(c).is_some() => {
                    self.release_others(c)?;
                }
                ClientState::Idle if self.rng.chance(0.03) => {
                    // Now and then, an extend of a token nobody was given
                    // (tokens stay far below 2^60 in a run).
                    let key = self.rng.range(0, self.cfg.keys as u64) as usize;
                    let token = (1 << 60) + self.rng.range(0, 1 << 20);
                    let lease_s = [1u8, 2, 3][self.rng.range(0, 3) as usize];
                    self.clients[c].state = ClientState::ExtendingUnknown {
                        token,
                        give_up: self.now.add_secs(8),
                    };
                    self.clients[c].next_at = Millis::NEVER;
                    self.write_extend(c, key, token, lease_s)?;
                }
                ClientState::Idle => {
                    let key = self.rng.range(0, self.cfg.keys as u64) as usize;
                    let wait_s = [0u8, 1, 2, 4][self.rng.range(0, 4) as usize];
                    let lease_s = [1u8, 2, 3][self.rng.range(0, 3) as usize];
                    let owner = self.next_owner;
                    self.next_owner += 1;
                    self.clients[c].state = ClientState::Acquiring {
                        owner,
                        key,
                        sent: self.now,
                        lease_s,
                        give_up: self.now.add_secs(u64::from(wait_s) + 8),
                    };
                    self.clients[c].next_at = Millis::NEVER;
                    let k = format!("key{key}");
                    // Recorded before the request: the answer may come at once.
                    let op = self.history.acquire(
                        c as u64,
                        self.clients[c].conn,
                        &k,
                        owner,
                        wait_s,
                        lease_s,
                        us(self.now),
                    );
                    self.clients[c].op = Some(op);
                    self.request(
                        c,
                        Request::Acquire {
                            wait_s,
                            lease_s,
                            owner,
                            key: &k,
                        },
                    )?;
                }
                ClientState::Holding {
                    key,
                    token,
                    until,
                    release_at,
                    extend_at,
                    first_until,
                } if extend_at <= self.now && extend_at < release_at => {
                    // Never a lease that would end before the current
                    // expiry: an Extend in flight may take effect unanswered,
                    // and one that shortens the lease would then end it
                    // before the expiry the client still counts on.
                    let need = until
                        .0
                        .saturating_sub(self.now.0)
                        .div_ceil(1000)
                        .clamp(1, 3);
                    let lease_s = self.rng.range(need, 4) as u8;
                    self.clients[c].state = ClientState::Extending {
                        key,
                        token,
                        until,
                        release_at,
                        first_until,
                        sent: self.now,
                        lease_s,
                        retry_at: Millis::NEVER,
                    };
                    self.send_extend(c)?;
                }
                ClientState::Extending { retry_at, .. } if retry_at <= self.now => {
                    // No answer in time: give this attempt up and send the
                    // same Extend again on a new connection (PROTOCOL §5.3).
                    if self.clients[c].op.is_some() {
                        self.report.extend_resends += 1;
                        self.reconnect(c);
                    }
                    let node = self.clients[c].node;
                    if self.nodes[node as usize - 1].is_none() {
                        // Try another node at the next step.
                        self.reconnect(c);
                        continue;
                    }
                    if let ClientState::Extending { ref mut sent, .. } = self.clients[c].state {
                        *sent = self.now;
                    }
                    self.send_extend(c)?;
                }
                ClientState::Holding {
                    key,
                    token,
                    release_at,
                    first_until,
                    ..
                } if release_at <= self.now => {
                    self.hold_ended(first_until);
                    self.drop_belief(c, key);
                    self.clients[c].state = ClientState::Releasing {
                        token,
                        give_up: self.now.add_secs(8),
                    };
                    self.clients[c].next_at = Millis::NEVER;
                    let k = format!("key{key}");
                    let op = self.history.release(
                        c as u64,
                        self.clients[c].conn,
                        &k,
                        token,
                        us(self.now),
                    );
                    self.clients[c].op = Some(op);
                    self.request(c, Request::Release { token, key: &k })?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A grant another, authenticated, client believes it holds now:
    /// (key number, token, that client).
    fn others_grant(&self, c: usize) -> Option<(usize, u64, usize)> {
        let now = self.now;
        self.beliefs.iter().find_map(|(&k, v)| {
            v.iter()
                .find(|b| b.0 != c && b.2 > now && self.clients[b.0].caller.holder & 1 == 1)
                .map(|b| (k, b.1, b.0))
        })
    }

    /// Client `c` releases, by its token, a grant another authenticated
    /// client holds ([`Sim::others_grant`]).
    fn release_others(&mut self, c: usize) -> Result<(), String> {
        let Some((key, token, victim)) = self.others_grant(c) else {
            return Ok(());
        };
        self.clients[c].state = ClientState::ReleasingOthers {
            token,
            victim,
            give_up: self.now.add_secs(8),
        };
        self.clients[c].next_at = Millis::NEVER;
        let k = format!("key{key}");
        let op = self
            .history
            .release(c as u64, self.clients[c].conn, &k, token, us(self.now));
        self.clients[c].op = Some(op);
        self.request(c, Request::Release { token, key: &k })
    }

    /// Sends the Extend of the client's current `Extending` state (its
    /// `sent` is now).
    fn send_extend(&mut self, c: usize) -> Result<(), String> {
        let ClientState::Extending {
            key,
            token,
            until,
            lease_s,
            ..
        } = self.clients[c].state
        else {
            return Ok(());
        };
        let retry = self.now.add_ms(self.rng.range(300, 1500));
        if let ClientState::Extending {
            ref mut retry_at, ..
        } = self.clients[c].state
        {
            *retry_at = retry;
        }
        // The attempt ends at the expiry at the latest.
        self.clients[c].next_at = retry.min(until);
        self.report.extends += 1;
        self.write_extend(c, key, token, lease_s)
    }

    /// Records client `c`'s extend of `token` on key number `key` in the
    /// history, as its pending operation, and sends it.
    fn write_extend(
        &mut self,
        c: usize,
        key: usize,
        token: u64,
        lease_s: u8,
    ) -> Result<(), String> {
        let k = format!("key{key}");
        let op = self.history.extend(
            c as u64,
            self.clients[c].conn,
            &k,
            token,
            lease_s,
            us(self.now),
        );
        self.clients[c].op = Some(op);
        self.request(
            c,
            Request::Extend {
                lease_s,
                token,
                key: &k,
            },
        )
    }

    /// Plans a holder's next extend and release: with `extend_p`, an
    /// extend within the first two thirds of what is left of the lease.
    fn plan_extend(&mut self, until: Millis) -> Millis {
        let left = until.0.saturating_sub(self.now.0);
        if left > 0 && self.rng.chance(self.cfg.extend_p) {
            self.now.add_ms(self.rng.range(left / 4, left * 2 / 3 + 1))
        } else {
            Millis::NEVER
        }
    }

    /// A holding ends now (released, expired or lost): count it when it
    /// lasted past its first lease.
    fn hold_ended(&mut self, first_until: Millis) {
        if self.now > first_until {
            self.report.held_past_first_lease += 1;
        }
    }

    fn answer_extend(&mut self, c: usize, outcome: ExtendOutcome) {
        if let Some(op) = self.clients[c].op.take() {
            self.history.extended(op, outcome, us(self.now));
        }
    }

    fn request(&mut self, c: usize, req: Request<'_>) -> Result<(), String> {
        let (node, conn) = (self.clients[c].node, self.clients[c].conn);
        let Some(n) = self.nodes[node as usize - 1].as_mut() else {
            return Ok(());
        };
        self.out.clear();
        n.request_as(self.now, conn, self.clients[c].caller, req, &mut self.out);
        let replies: Vec<(ConnId, String, Reply<'static>)> = self
            .out
            .iter()
            .map(|a| (a.conn, a.reply.key().to_owned(), owned(a.reply)))
            .collect();
        self.out.clear();
        for (conn, key, reply) in replies {
            self.on_reply(node, conn, &key, reply)?;
        }
        Ok(())
    }

    fn answer_acquire(&mut self, c: usize, outcome: Outcome) {
        if let Some(op) = self.clients[c].op.take() {
            self.history.acquired(op, outcome, us(self.now));
        }
    }

    fn answer_release(&mut self, c: usize, outcome: ReleaseOutcome) {
        if let Some(op) = self.clients[c].op.take() {
            self.history.released(op, outcome, us(self.now));
        }
    }

    fn drop_belief(&mut self, c: usize, key: usize) {
        if let Some(v) = self.beliefs.get_mut(&key) {
            v.retain(|b| b.0 != c);
        }
    }

    fn on_reply(
        &mut self,
        node: u64,
        conn: ConnId,
        key: &str,
        reply: Reply<'static>,
    ) -> Result<(), String> {
        let Some(&c) = self.conn_owner.get(&(node, conn)) else {
            return self.fail(format!(
                "node {node} answered connection {conn}, which is closed: {reply:?} {key}"
            ));
        };
        let state = self.clients[c].state.clone();
        if self.debug {
            eprintln!(
                "{} node {node} conn {conn} client {c}: {reply:?} {key} in {state:?}",
                self.now
            );
        }
        let idle_after = self.now.add_ms(self.rng.range(0, 1500));
        match (state, reply) {
            (
                ClientState::Acquiring {
                    owner,
                    key: k,
                    sent,
                    lease_s,
                    ..
                },
                Reply::Acquired {
                    token, owner: o, ..
                },
            ) if o == owner => {
                self.report.grants += 1;
                let late = sent.add_secs(u64::from(lease_s)) <= self.now;
                self.answer_acquire(
                    c,
                    if late {
                        Outcome::LateGrant { token }
                    } else {
                        Outcome::Granted { token }
                    },
                );
                if !self.tokens.insert(token) {
                    return self.fail(format!("token {token} issued twice"));
                }
                let until = sent.add_secs(u64::from(lease_s));
                if until > self.now {
                    let now = self.now;
                    let holder_check = self.cfg.bug.is_none();
                    if let Some(other) = self
                        .beliefs
                        .get(&k)
                        .filter(|_| holder_check)
                        .and_then(|v| v.iter().find(|b| b.0 != c && b.2 > now))
                    {
                        return self.fail(format!(
                            "two holders of key{k}: client {} (token {}, until {}) and client {c} (token {token})",
                            other.0, other.1, other.2
                        ));
                    }
                    let max = self.max_token.get(&k).copied().unwrap_or(0);
                    if token <= max {
                        return self.fail(format!(
                            "key{k} granted with token {token} after token {max}"
                        ));
                    }
                    self.beliefs.entry(k).or_default().push((c, token, until));
                    // Mostly release within the lease; sometimes let it expire.
                    // Mostly release within the lease; sometimes let it expire.
                    // A holder that extends holds for up to four leases.
                    let lease_ms = u64::from(lease_s) * 1000;
                    let extend_at = self.plan_extend(until);
                    let hold_ms = if extend_at == Millis::NEVER {
                        lease_ms / 2
                    } else {
                        lease_ms * 4
                    };
                    let release_at = if self.rng.chance(0.8) {
                        self.now.add_ms(self.rng.range(0, hold_ms + 1))
                    } else {
                        Millis::NEVER
                    };
                    self.clients[c].state = ClientState::Holding {
                        key: k,
                        token,
                        until,
                        release_at,
                        extend_at,
                        first_until: until,
                    };
                    self.clients[c].next_at = release_at.min(until).min(extend_at);
                } else {
                    // Arrived after its lease: unusable.
                    self.clients[c].state = ClientState::Idle;
                    self.clients[c].next_at = idle_after;
                }
                let max = self.max_token.entry(k).or_insert(0);
                *max = (*max).max(token);
            }
            (ClientState::Acquiring { owner, .. }, Reply::Timeout { owner: o, .. })
                if o == owner =>
            {
                self.report.timeouts += 1;
                self.answer_acquire(c, Outcome::Timeout);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (ClientState::Acquiring { owner, .. }, Reply::Busy { owner: o, .. }) if o == owner => {
                self.report.busy += 1;
                self.answer_acquire(c, Outcome::Busy);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (ClientState::Releasing { token, .. }, Reply::Released { token: t, .. })
                if t == token =>
            {
                self.report.releases += 1;
                self.answer_release(c, ReleaseOutcome::Released);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (ClientState::Releasing { token, .. }, Reply::NotReleased { token: t, .. })
                if t == token =>
            {
                self.report.not_released += 1;
                self.answer_release(c, ReleaseOutcome::NotReleased);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (
                ClientState::Extending {
                    key: k,
                    token,
                    until,
                    release_at,
                    first_until,
                    sent,
                    lease_s,
                    ..
                },
                Reply::Extended { token: t, .. },
            ) if t == token && self.clients[c].op.is_some() => {
                self.answer_extend(c, ExtendOutcome::Extended);
                if until <= self.now {
                    // At or after the expiry: lost, nothing revived.
                    self.hold_ended(first_until);
                    self.report.late_extend_answers += 1;
                    self.drop_belief(c, k);
                    self.clients[c].state = ClientState::Idle;
                    self.clients[c].next_at = idle_after;
                    return Ok(());
                }
                self.report.extended += 1;
                // Counted from this attempt's write, never from the reply.
                let until = sent.add_secs(u64::from(lease_s));
                if let Some(b) = self
                    .beliefs
                    .get_mut(&k)
                    .and_then(|v| v.iter_mut().find(|b| b.0 == c && b.1 == token))
                {
                    b.2 = until;
                }
                let extend_at = self.plan_extend(until);
                self.clients[c].state = ClientState::Holding {
                    key: k,
                    token,
                    until,
                    release_at,
                    extend_at,
                    first_until,
                };
                self.clients[c].next_at = release_at.min(until).min(extend_at);
            }
            (
                ClientState::Extending {
                    key: k,
                    token,
                    first_until,
                    ..
                },
                Reply::NotExtended { token: t, .. },
            ) if t == token && self.clients[c].op.is_some() => {
                self.hold_ended(first_until);
                // X is definitive: the grant is gone.
                self.report.not_extended += 1;
                self.answer_extend(c, ExtendOutcome::NotExtended);
                self.drop_belief(c, k);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (
                ClientState::ReleasingOthers { token, victim, .. },
                Reply::Released { token: t, .. },
            ) if t == token => {
                return self.fail(format!(
                    "client {c} released key {key} token {token}, a grant of client {victim} \
                     (another authenticated identity)"
                ));
            }
            (ClientState::ReleasingOthers { token, .. }, Reply::NotReleased { token: t, .. })
                if t == token =>
            {
                self.report.others_refused += 1;
                self.answer_release(c, ReleaseOutcome::NotReleased);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (ClientState::ExtendingUnknown { token, .. }, Reply::NotExtended { token: t, .. })
                if t == token =>
            {
                self.report.unknown_token_x += 1;
                self.answer_extend(c, ExtendOutcome::NotExtended);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (_, Reply::Extended { token: t, .. } | Reply::NotExtended { token: t, .. })
                if self.clients[c].stale.iter().any(|s| s.0 == t) =>
            {
                // The answer to an extend whose grant expired in flight:
                // recorded, and it revives nothing.
                self.report.late_extend_answers += 1;
                let outcome = if matches!(reply, Reply::Extended { .. }) {
                    ExtendOutcome::Extended
                } else {
                    ExtendOutcome::NotExtended
                };
                let stale = &mut self.clients[c].stale;
                if let Some(i) = stale.iter().position(|s| s.0 == t) {
                    let (_, op) = stale.swap_remove(i);
                    self.history.extended(op, outcome, us(self.now));
                }
            }
            (state, reply) => {
                return self.fail(format!(
                    "client {c} got {reply:?} for {key} in state {state:?}: \
                     an answer to nothing, or a second answer"
                ));
            }
        }
        Ok(())
    }

    fn final_checks(&mut self) -> Result<(), String> {
        let (voters, learners) = self.leader_conf();
        self.report.final_voters.clone_from(&voters);
        let members: BTreeSet<u64> = voters.iter().chain(learners.iter()).copied().collect();
        for (i, n) in self.nodes.iter().enumerate() {
            if !members.contains(&(i as u64 + 1)) {
                continue;
            }
            let Some(n) = n else {
                return self.fail(format!("node {} is down after the heal", i + 1));
            };
            n.state_machine().check();
            if !n.voters_outgoing().is_empty() {
                return self.fail(format!(
                    "node {} is still in a joint configuration after the heal",
                    i + 1
                ));
            }
            let s = n.stats();
            self.report.snapshot_installs += s.snapshots_installed;
            self.report.timer_proposals += s.timer_proposals;
            self.report.reproposals += s.reproposed;
        }
        let of_members = |nodes: &[Option<Node<MemDisk>>]| -> Vec<usize> {
            (0..nodes.len())
                .filter(|i| members.contains(&(*i as u64 + 1)) && nodes[*i].is_some())
                .collect()
        };
        let idx = of_members(&self.nodes);
        if idx.is_empty() {
            return self.fail("no member is up after the heal".into());
        }
        let applied: Vec<u64> = idx
            .iter()
            .filter_map(|i| self.nodes[*i].as_ref().map(Node::applied))
            .collect();
        if applied.iter().any(|&a| a != applied[0]) {
            return self.fail(format!("nodes did not converge: applied {applied:?}"));
        }
        // Every member holds the same configuration: raft's voters and
        // learners as each node sees them, not only the leader's.
        for &i in &idx {
            let (v, l) = voters_and_learners(self.nodes[i].as_ref());
            if (&v, &l) != (&voters, &learners) {
                return self.fail(format!(
                    "node {} holds the configuration voters {v:?} learners {l:?}, the \
                     others voters {voters:?} learners {learners:?}",
                    i + 1
                ));
            }
        }
        let tables: Vec<Vec<u8>> = idx
            .iter()
            .filter_map(|i| self.nodes[*i].as_ref())
            .map(|n| n.state_machine().snapshot())
            .collect();
        // A removed node grants nothing: no client ever got a grant there
        // after it applied its removal (its requests are answered B).
        for (i, n) in self.nodes.iter().enumerate() {
            if let Some(n) = n {
                if n.removed() && members.contains(&(i as u64 + 1)) {
                    return self.fail(format!("node {} is removed and a member", i + 1));
                }
            }
        }
        if tables.iter().any(|t| *t != tables[0]) {
            return self.fail("tables differ after the heal".into());
        }
        self.report.digest = tables[0].iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
        Ok(())
    }

    fn liveness_checks(&mut self) -> Result<(), String> {
        // Liveness: every member serves a fresh acquire on a fresh key.
        let (voters, learners) = self.leader_conf();
        for i in 0..self.slots() {
            let id = i as u64 + 1;
            if !voters.contains(&id) && !learners.contains(&id) {
                continue;
            }
            let conn = 1_000_000 + id;
            let key = format!("final{id}");
            let mut got = None;
            let mut sent = false;
            // The network still drops messages at random after the heal: a
            // follower's forwarded acquire may be lost, and is proposed
            // again every two election timeouts (2 s). 25 s leaves twelve
            // tries; all of them lost at 3 % is beyond any sweep.
            for _ in 0..LIVENESS_ROUNDS {
                self.out.clear();
                let Some(n) = self.nodes[i].as_mut() else {
                    return self.fail(format!("node {id} is down after the heal"));
                };
                if !sent {
                    sent = true;
                    n.request(
                        self.now,
                        conn,
                        Request::Acquire {
                            wait_s: 0,
                            lease_s: 5,
                            owner: 7,
                            key: &key,
                        },
                        &mut self.out,
                    );
                    if let Some(a) = self.out.iter().next() {
                        got = Some(format!("{:?}", a.reply));
                    }
                }
                self.now = self.now.add_ms(10);
                self.deliver();
                for j in 0..self.slots() {
                    let Some(node) = self.nodes[j].as_mut() else {
                        continue;
                    };
                    self.out.clear();
                    node.tick(self.now, &mut self.out);
                    node.end_turn(self.now, &mut self.out)
                        .map_err(|e| format!("seed {}: final turn: {e}", self.cfg.seed))?;
                    if j == i {
                        if let Some(a) = self.out.iter().find(|a| a.conn == conn) {
                            got = Some(format!("{:?}", a.reply));
                        }
                    }
                    let msgs = node.take_messages();
                    for m in msgs {
                        self.send(j as u64 + 1, m);
                    }
                }
                if got.is_some() {
                    break;
                }
            }
            match got {
                Some(r) if r.starts_with("Acquired") => {}
                other => {
                    return self.fail(format!("node {id} did not grant after the heal: {other:?}"))
                }
            }
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

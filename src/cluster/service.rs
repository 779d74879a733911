//! [`ClusterService`]: cluster mode behind the server loop's [`Service`]
//! trait. Client requests become proposals; peer sockets live in the same
//! mio poll as client connections; each loop turn ends with raft's Ready
//! (one WAL write, at most one fsync) and the peer messages it produced.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

use mio::event::Event;
use mio::Registry;

use crate::cluster::log::FileDisk;
use crate::cluster::members::Change;
use crate::cluster::node::{raft_logger, Node, NodeConfig, NodeError};
use crate::cluster::state::StateMachine;
use crate::cluster::tls::{PeerTls, TlsError, TlsFiles};
use crate::cluster::transport::{hash64, LocalInfo, PeerEvent, Transport, MEMBERSHIP_MARK};
use crate::config::ConfigError;
use crate::engine::{ConnId, Outbox};
use crate::limits::EngineLimits;
use crate::proto::Request;
use crate::server::admin::json_str;
use crate::service::{MemberChange, Membership, Observe, Refusal, RefusalKind, Service};
use crate::time::Millis;

/// Everything cluster mode needs from the command line.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// This node's id.
    pub id: u64,
    /// Every voter's peer address, this node's included (where it listens
    /// for peers).
    pub peers: BTreeMap<u64, SocketAddr>,
    /// The data directory (WAL and snapshots).
    pub data_dir: PathBuf,
    /// A name shared by the cluster's nodes; peers of another name are
    /// refused.
    pub cluster_name: String,
    /// Lock table limits; must be equal on every node.
    pub limits: EngineLimits,
    /// The longest key a client may send (`--max-key-bytes`); with
    /// `limits` it sizes the largest snapshot, hence the peer frame limit.
    /// Must be equal on every node.
    pub max_key_bytes: usize,
    /// Milliseconds per Raft tick.
    pub tick_ms: u64,
    /// `--leader-sync-ms`: how often a leader whose followers commit
    /// without it syncs its own log (0: every batch).
    pub leader_sync_ms: u64,
    /// Peer TLS files; `None`: plaintext peers.
    pub tls: Option<TlsFiles>,
    /// Plaintext peers allowed on addresses that are not loopback.
    pub insecure_peers: bool,
    /// `--insecure`: a data directory its group or other users may write
    /// to is used (with a warning), not refused.
    pub insecure_data_dir: bool,
    /// `--join`: on an empty data directory, start with no configuration
    /// and wait to be added (`ticket cluster add`).
    pub join: bool,
}

impl ClusterConfig {
    /// Whether every peer address is a loopback address.
    #[must_use]
    pub fn peers_all_loopback(&self) -> bool {
        self.peers.values().all(|a| a.ip().is_loopback())
    }

    /// Protected mode: peers off loopback speak TLS, unless
    /// `insecure_peers` says otherwise.
    ///
    /// # Errors
    /// What to do, when the configuration is refused.
    pub fn check_protected(&self) -> Result<(), ConfigError> {
        if self.tls.is_some() || self.insecure_peers || self.peers_all_loopback() {
            return Ok(());
        }
        Err(ConfigError::Invalid(format!(
            "--peers names addresses that are not loopback ({}), and peers would speak \
             plaintext: anyone who reaches a peer port could pose as a node. Set up peer \
             TLS: `ticket certs init DIR --cluster-name {} --nodes {}` makes a CA and one \
             certificate per node; give each node --peer-tls-cert DIR/nodeN.pem \
             --peer-tls-key DIR/nodeN-key.pem --peer-tls-ca DIR/ca.pem (docs/CLUSTER.md). \
             Or pass --insecure-peers to run without it on a network you trust",
            self.peers
                .values()
                .filter(|a| !a.ip().is_loopback())
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            self.cluster_name,
            self.peers.len()
        )))
    }

    /// Parses `1=HOST:PORT,2=HOST:PORT,...`.
    ///
    /// # Errors
    /// The peer at fault and why, as an error of `--peers`.
    pub fn parse_peers(s: &str) -> Result<BTreeMap<u64, SocketAddr>, ConfigError> {
        let bad = |why: String| ConfigError::Invalid(format!("--peers: {why}"));
        let mut peers = BTreeMap::new();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (id, addr) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("peer {part:?}: expected ID=HOST:PORT")))?;
            let id: u64 = id
                .trim()
                .parse()
                .map_err(|_| bad(format!("peer {part:?}: the id is not a number")))?;
            if id == 0 {
                return Err(bad(format!("peer {part:?}: ids start at 1")));
            }
            let addr = std::net::ToSocketAddrs::to_socket_addrs(addr.trim())
                .map_err(|e| bad(format!("peer {part:?}: {e}")))?
                .next()
                .ok_or_else(|| bad(format!("peer {part:?}: no address")))?;
            if peers.insert(id, addr).is_some() {
                return Err(bad(format!("peer id {id} is given twice")));
            }
        }
        if peers.is_empty() {
            return Err(bad("--peers names no node".into()));
        }
        Ok(peers)
    }
}

/// Why cluster mode cannot start.
#[derive(Debug)]
pub enum StartError {
    /// The configuration is inconsistent.
    Config(ConfigError),
    /// Peer TLS could not be set up from its files.
    Tls(TlsError),
    /// The node refused its data directory.
    Node(NodeError),
    /// The peer listener could not bind.
    Listen(io::Error),
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartError::Config(e) => e.fmt(f),
            StartError::Tls(e) => e.fmt(f),
            StartError::Node(e) => write!(f, "{e}"),
            StartError::Listen(e) => write!(f, "peer listener: {e}"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        // The first three print as their inner error: transparent.
        match self {
            StartError::Config(e) => std::error::Error::source(e),
            StartError::Tls(e) => std::error::Error::source(e),
            StartError::Node(e) => std::error::Error::source(e),
            StartError::Listen(e) => Some(e),
        }
    }
}

/// Cluster mode's service. See the module documentation.
pub struct ClusterService {
    node: Node<FileDisk>,
    transport: Transport,
    registry: Option<Registry>,
    fatal: Option<String>,
    stop_on_fatal: bool,
    describe: String,
    /// Every peer address from `--peers`, for members the replicated
    /// state has no address for.
    peers: BTreeMap<u64, SocketAddr>,
    /// Snapshots sent to followers in full.
    snapshots_sent: u64,
    /// When each peer's last raft message arrived (for the reachability
    /// check of a removal).
    heard: BTreeMap<u64, Millis>,
    /// The time of the latest call from the loop.
    now: Millis,
    /// The election timeout, in milliseconds.
    election_ms: u64,
    /// [`Node::members_version`] the transport's peers were set from.
    members_seen: u64,
}

impl fmt::Debug for ClusterService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterService")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl ClusterService {
    /// Opens the data directory and binds the peer listener.
    pub fn open(cfg: &ClusterConfig) -> Result<Self, StartError> {
        let Some(&listen) = cfg.peers.get(&cfg.id) else {
            return Err(StartError::Config(ConfigError::Invalid(format!(
                "--id {} is not among --peers {:?}",
                cfg.id,
                cfg.peers.keys().collect::<Vec<_>>()
            ))));
        };
        // Refused before the data directory is touched.
        cfg.check_protected().map_err(StartError::Config)?;
        let tls = match &cfg.tls {
            None => None,
            Some(files) => {
                Some(PeerTls::load(files, cfg.id, &cfg.cluster_name).map_err(StartError::Tls)?)
            }
        };
        let ncfg = node_config(cfg);
        let disk = FileDisk::open_with(&cfg.data_dir, cfg.insecure_data_dir).map_err(|e| {
            StartError::Config(ConfigError::Invalid(format!(
                "data dir {}: {e}",
                cfg.data_dir.display()
            )))
        })?;
        let election_ms = ncfg.tick_ms.saturating_mul(ncfg.election_tick as u64);
        let node = Node::open(ncfg, disk, &raft_logger()).map_err(StartError::Node)?;
        let transport = open_transport(cfg, &node, listen, tls, election_ms)?;
        let describe = describe(cfg, &node, &transport, listen);
        Ok(ClusterService {
            node,
            transport,
            registry: None,
            fatal: None,
            stop_on_fatal: false,
            describe,
            peers: cfg.peers.clone(),
            snapshots_sent: 0,
            heard: BTreeMap::new(),
            now: Millis::ZERO,
            election_ms,
            members_seen: 0,
        })
    }

    /// Stop the server loop when the node must stop: its disk failed or its
    /// data directory turned out to be wiped ([`Service::must_stop`]; the
    /// loop's `run` then returns the reason, and the daemon exits 1).
    /// Without it the service stops answering and `end_turn` keeps failing.
    pub fn set_stop_on_fatal(&mut self, stop: bool) {
        self.stop_on_fatal = stop;
    }

    fn die(&mut self, why: String) -> io::Error {
        log::error!("cluster node stopping: {why}");
        self.fatal.get_or_insert_with(|| why.clone());
        io::Error::other(why)
    }

    /// The node (for status and tests).
    #[must_use]
    pub fn node(&self) -> &Node<FileDisk> {
        &self.node
    }

    /// Points the transport at the members of the replicated
    /// configuration whenever it changed.
    fn sync_peers(&mut self) {
        let v = self.node.members_version();
        if v == self.members_seen {
            return;
        }
        let addrs = self.node.peer_addrs();
        // Before a joining node is added it has no configuration: keep
        // the --peers addresses.
        if addrs.is_empty() && self.node.members().is_empty() {
            self.members_seen = v;
            return;
        }
        if self.registry.is_none() {
            return;
        }
        self.members_seen = v;
        self.transport
            .set_peers(&addrs, self.now, self.registry.as_ref());
        self.heard.retain(|id, _| addrs.contains_key(id));
    }

    fn handle_peer_events(&mut self) {
        for ev in self.transport.take_events() {
            match ev {
                PeerEvent::Message(m) if self.fatal.is_none() => {
                    self.heard.insert(m.from, self.now);
                    self.node.step(m);
                }
                PeerEvent::Message(_) => {}
                PeerEvent::Unreachable(id) => self.node.report_unreachable(id),
                PeerEvent::Snapshot(id, ok) => {
                    self.snapshots_sent += u64::from(ok);
                    self.node.report_snapshot(id, ok);
                }
                PeerEvent::PeerSeen(id, uuid) => {
                    // The id itself stays out of the log: in a plaintext
                    // cluster it is part of what authenticates a peer.
                    log::info!("peer {id} authenticated; its data directory id is pinned");
                    self.node.record_peer(id, uuid);
                }
                PeerEvent::Fatal(why) => {
                    let _ = self.die(why);
                }
            }
        }
    }
}

impl Service for ClusterService {
    fn request(&mut self, now: Millis, conn: ConnId, req: Request<'_>, out: &mut Outbox) {
        self.request_as(now, conn, crate::engine::Caller::default(), req, out);
    }

    /// The caller goes into the request's log entry, so every node (and a
    /// later leader, and a node restored from a snapshot) binds its grant
    /// to `who` and refuses releases and extends `who` may not make
    /// ([`crate::engine::Caller::may_act_on`]).
    fn request_as(
        &mut self,
        now: Millis,
        conn: ConnId,
        who: crate::engine::Caller,
        req: Request<'_>,
        out: &mut Outbox,
    ) {
        if self.fatal.is_some() {
            // Never proposed: Busy / NotReleased are the truth.
            match req {
                Request::Acquire { owner, key, .. }
                | Request::AcquireWithLimit { owner, key, .. } => {
                    out.push(conn, crate::proto::Reply::Busy { owner, key }, 0);
                }
                Request::Release { token, key } => {
                    out.push(conn, crate::proto::Reply::NotReleased { token, key }, 0);
                }
                // X would say the grant is gone, which this node cannot
                // know (PROTOCOL §5.3): no answer, the client tries elsewhere.
                Request::Extend { .. } => {}
            }
            return;
        }
        self.node.request_as(now, conn, who, req, out);
    }

    fn disconnect(&mut self, _now: Millis, conn: ConnId, _out: &mut Outbox) {
        self.node.disconnect(conn);
    }

    fn take_closes(&mut self, out: &mut Vec<ConnId>) {
        self.node.take_closes(out);
    }

    fn tick(&mut self, now: Millis, out: &mut Outbox) {
        self.now = self.now.max(now);
        if self.fatal.is_some() {
            return;
        }
        self.node.tick(now, out);
        if let Some(r) = &self.registry {
            self.transport.tick(now, r);
        }
    }

    fn next_deadline(&self) -> Option<Millis> {
        let d = self.node.next_deadline();
        Some(self.transport.next_deadline().map_or(d, |t| t.min(d)))
    }

    fn must_stop(&self) -> Option<String> {
        self.fatal.clone().filter(|_| self.stop_on_fatal)
    }

    fn end_turn(&mut self, now: Millis, out: &mut Outbox) -> io::Result<()> {
        self.now = self.now.max(now);
        if let Some(why) = &self.fatal {
            return Err(io::Error::other(why.clone()));
        }
        self.handle_peer_events();
        if let Some(why) = &self.fatal {
            return Err(io::Error::other(why.clone()));
        }
        if let Err(e) = self.node.end_turn(now, out) {
            // A failed write or fsync leaves raft between ready and advance:
            // the node must not go on.
            return Err(self.die(e.to_string()));
        }
        // A conf change applied this turn: the new node is connected to
        // before raft's messages to it are sent.
        self.sync_peers();
        self.transport.send_all(self.node.take_messages());
        if let Some(r) = &self.registry {
            self.transport.flush(now, r);
        }
        // Unreachable / snapshot reports from sending reach raft now; their
        // effect shows in the next turn's Ready.
        self.handle_peer_events();
        if let Some(why) = &self.fatal {
            return Err(io::Error::other(why.clone()));
        }
        Ok(())
    }

    fn register(&mut self, registry: &Registry, token_base: usize) -> io::Result<()> {
        self.transport.register(registry, token_base)?;
        self.registry = Some(registry.try_clone()?);
        Ok(())
    }

    fn set_waker(&mut self, waker: std::sync::Arc<mio::Waker>) {
        self.node.disk_mut().set_waker(waker);
        self.node.set_sync_wakes(true);
    }

    fn event(&mut self, now: Millis, registry: &Registry, event: &Event, _out: &mut Outbox) {
        self.now = self.now.max(now);
        if self.transport.owns(event.token()) {
            self.transport.event(now, registry, event);
            self.handle_peer_events();
        }
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn serving(&self) -> bool {
        self.node.leader() != 0
    }

    fn observe(&self) -> Option<&dyn Observe> {
        Some(self)
    }

    fn membership(&mut self) -> Option<&mut dyn Membership> {
        Some(self)
    }
}

impl Observe for ClusterService {
    fn lock_table(&self) -> Option<&dyn crate::engine::LockTable> {
        Some(self.node.state_machine().engine())
    }

    fn oldest_hold_ms(&self, now: Millis) -> Option<u64> {
        self.node.oldest_hold().map(|at| now.since(at))
    }

    fn lock_histograms(&self) -> Option<(&crate::metrics::Histogram, &crate::metrics::Histogram)> {
        Some(self.node.lock_histograms())
    }

    /// Ready when a leader is known and this node has applied an entry of
    /// the leader's term (so its table includes every earlier grant).
    fn readiness(&self, _now: Millis) -> Result<(), crate::service::NotReady> {
        use crate::service::NotReady;
        if let Some(why) = &self.fatal {
            return Err(NotReady::Stopped(why.clone()));
        }
        if self.node.leader() == 0 {
            return Err(NotReady::NoLeader {
                term: self.node.term(),
            });
        }
        if !self.node.applied_current_term() {
            return Err(NotReady::CatchingUp {
                leader: self.node.leader(),
                term: self.node.term(),
                applied: self.node.applied(),
                committed: self.node.committed(),
            });
        }
        Ok(())
    }

    fn write_metrics(&self, _now: Millis, out: &mut crate::metrics::Exposition) {
        let n = &self.node;
        out.gauge("ticketd_raft_term", "The current Raft term.", n.term());
        out.gauge(
            "ticketd_raft_leader_id",
            "The leader's node id, 0 when none is known.",
            n.leader(),
        );
        out.gauge(
            "ticketd_raft_is_leader",
            "1 on the leader, 0 elsewhere.",
            u64::from(n.is_leader()),
        );
        out.gauge(
            "ticketd_raft_commit_index",
            "The highest log index known committed.",
            n.committed(),
        );
        out.gauge(
            "ticketd_raft_applied_index",
            "The highest log index applied to the lock table.",
            n.applied(),
        );
        out.counter(
            "ticketd_raft_leader_changes_total",
            "Times this node learned of a new leader.",
            n.stats().leader_changes,
        );
        out.gauge(
            "ticketd_raft_proposals_pending",
            "Client requests proposed or queued and not yet answered.",
            n.pending_requests() as u64,
        );
        out.counter(
            "ticketd_raft_snapshots_installed_total",
            "Snapshots this node installed in place of the entries they cover.",
            n.stats().snapshots_installed,
        );
        out.counter(
            "ticketd_raft_messages_refused_total",
            "Peer messages dropped before Raft saw them: Raft would have panicked on \
             them, or trusted what no correct peer says.",
            n.stats().refused_messages,
        );
        out.counter(
            "ticketd_raft_unanswerable_total",
            "Requests of this node's clients that applied inside an installed snapshot \
             with an answer the table cannot tell (their connections were closed).",
            n.stats().unanswerable,
        );
        out.counter(
            "ticketd_raft_unseen_grants_released_total",
            "Grants to this node's clients whose connections closed before the answer, \
             released at once (nobody had their tokens).",
            n.stats().unseen_released,
        );
        out.histogram(
            "ticketd_wal_fsync_seconds",
            "Duration of each fdatasync of the write-ahead log.",
            n.disk().fsync_histogram(),
            1_000_000,
        );
        out.counter(
            "ticketd_snapshots_sent_total",
            "Snapshots sent to a follower in full.",
            self.snapshots_sent,
        );
    }

    fn cluster_json(&self, _now: Millis) -> Option<String> {
        use std::fmt::Write as _;
        let n = &self.node;
        let mut j = String::new();
        let _ = write!(
            j,
            "{{\"id\":{},\"leader\":{},\"term\":{},\"commit\":{},\"applied\":{}",
            n.id(),
            n.leader(),
            n.term(),
            n.committed(),
            n.applied()
        );
        let members = n.members();
        for (name, learners) in [("voters", false), ("learners", true)] {
            let _ = write!(j, ",\"{name}\":[");
            for (i, m) in members.iter().filter(|m| m.learner == learners).enumerate() {
                if i > 0 {
                    j.push(',');
                }
                let _ = write!(j, "{{\"id\":{},\"address\":", m.id);
                let replicated = n.replicated_members().addr(m.id);
                match replicated.as_ref().or_else(|| self.peers.get(&m.id)) {
                    Some(a) => json_str(&mut j, &a.to_string()),
                    None => j.push_str("null"),
                }
                if let (Some(matched), Some(reachable)) = (m.matched, m.reachable) {
                    let _ = write!(j, ",\"match\":{matched},\"reachable\":{reachable}");
                }
                j.push('}');
            }
            j.push(']');
        }
        let outgoing = n.voters_outgoing();
        let _ = write!(
            j,
            ",\"joint\":{},\"voters_outgoing\":",
            !outgoing.is_empty()
        );
        json_numbers(&mut j, outgoing);
        j.push_str(",\"removed\":");
        json_numbers(&mut j, n.replicated_members().removed().iter().copied());
        let _ = writeln!(
            j,
            ",\"change_pending\":{},\"this_node_removed\":{}}}",
            n.is_leader() && n.conf_change_pending(),
            n.removed()
        );
        Some(j)
    }
}

impl Membership for ClusterService {
    fn member_change(&mut self, now: Millis, change: MemberChange) -> Result<String, Refusal> {
        self.now = self.now.max(now);
        if let Some(why) = &self.fatal {
            return Err(Refusal {
                kind: RefusalKind::Unavailable,
                message: format!("the node stopped: {why}"),
            });
        }
        let change = match change {
            MemberChange::Add { id, address } => Change::AddLearner(id, address),
            MemberChange::Promote { id } => Change::Promote(id),
            MemberChange::Remove { id, force } => Change::Remove(id, force),
        };
        let window = self.election_ms;
        let reachable = self
            .heard
            .iter()
            .filter(|(_, at)| at.add_ms(window) >= self.now)
            .map(|(id, _)| *id)
            .collect();
        self.node.change_members(change, &reachable)
    }
}

/// A JSON array of numbers.
fn json_numbers(out: &mut String, items: impl IntoIterator<Item = u64>) {
    use std::fmt::Write as _;
    out.push('[');
    for (i, v) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{v}");
    }
    out.push(']');
}

/// The node's settings from the daemon's: the voters from `--peers`
/// (none when joining), and seeds drawn from the clock and the pid.
fn node_config(cfg: &ClusterConfig) -> NodeConfig {
    let voters: Vec<u64> = if cfg.join {
        Vec::new()
    } else {
        cfg.peers.keys().copied().collect()
    };
    let mut ncfg = NodeConfig::new(cfg.id, voters);
    ncfg.join = cfg.join;
    ncfg.peer_addrs = cfg.peers.clone();
    ncfg.limits = cfg.limits.clone();
    ncfg.tick_ms = cfg.tick_ms.max(1);
    ncfg.leader_sync_ms = cfg.leader_sync_ms;
    let entropy = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id()).rotate_left(32);
    ncfg.uuid_entropy = entropy;
    ncfg.seed = entropy.rotate_left(17);
    ncfg
}

/// Binds the peer listener, with TLS if configured, and sizes its frames
/// for the largest snapshot the limits allow (warning when a frame cannot
/// carry one).
fn open_transport(
    cfg: &ClusterConfig,
    node: &Node<FileDisk>,
    listen: SocketAddr,
    tls: Option<PeerTls>,
    election_ms: u64,
) -> Result<Transport, StartError> {
    let local = LocalInfo {
        id: cfg.id,
        cluster: hash64(&[cfg.cluster_name.as_bytes()]),
        voters: MEMBERSHIP_MARK,
        uuid: node.identity().uuid,
        known: node.identity().peers.clone(),
    };
    // The replicated configuration's addresses win over --peers; a
    // node that has none yet (joining) starts from --peers.
    let stored = node.peer_addrs();
    let initial = if stored.is_empty() {
        &cfg.peers
    } else {
        &stored
    };
    let mut transport = Transport::bind(local, listen, initial).map_err(StartError::Listen)?;
    if let Some(tls) = tls {
        transport.set_tls(tls);
    }
    transport.set_election_timeout_ms(election_ms);
    let snapshot_bound = StateMachine::snapshot_bound(&cfg.limits, cfg.max_key_bytes);
    transport.set_max_frame_bytes(snapshot_bound);
    if snapshot_bound > transport.max_frame_bytes() as u64 {
        log::warn!(
            "these limits allow a lock table whose snapshot (up to {} MiB) is over the \
             {} MiB a peer frame can carry: a follower that needs such a snapshot \
             cannot catch up until the table shrinks",
            snapshot_bound.div_ceil(1 << 20),
            transport.max_frame_bytes().div_ceil(1 << 20)
        );
    }
    Ok(transport)
}

/// The start-up line: who this node is, its peers, its data directory.
fn describe(
    cfg: &ClusterConfig,
    node: &Node<FileDisk>,
    transport: &Transport,
    listen: SocketAddr,
) -> String {
    format!(
        "cluster node {} of {:?}{}, peers on {} ({}), data dir {}, boot epoch {}, \
         peer frames up to {} MiB",
        cfg.id,
        node.members().iter().map(|m| m.id).collect::<Vec<_>>(),
        if cfg.join && node.members().is_empty() {
            format!(
                " (joining: waiting to be added: ticket cluster add {}={})",
                cfg.id,
                transport.local_addr().map_or(listen, |a| a)
            )
        } else {
            String::new()
        },
        transport.local_addr().map_or(listen, |a| a),
        if cfg.tls.is_some() {
            "mutual TLS"
        } else {
            "plaintext"
        },
        cfg.data_dir.display(),
        node.epoch(),
        transport.max_frame_bytes().div_ceil(1 << 20)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_arrays_are_json_arrays() {
        let mut j = String::new();
        json_numbers(&mut j, []);
        j.push(' ');
        json_numbers(&mut j, [7]);
        j.push(' ');
        json_numbers(&mut j, std::collections::BTreeSet::from([3, 1, u64::MAX]));
        assert_eq!(j, "[] [7] [1,3,18446744073709551615]");
    }

    #[test]
    fn peers_parse_and_bad_ones_are_errors() {
        let p = ClusterConfig::parse_peers("1=127.0.0.1:7001,2=127.0.0.1:7002").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[&2].port(), 7002);
        for bad in [
            "",
            "1=127.0.0.1:1,1=127.0.0.1:2",
            "0=127.0.0.1:1",
            "x=127.0.0.1:1",
            "1:127.0.0.1:1",
            "1=nohost",
        ] {
            assert!(ClusterConfig::parse_peers(bad).is_err(), "{bad:?}");
        }
    }
}

//! Deterministic simulation of single-mode ticketd: clients, the lock engine
//! as the server, and a hostile network, all driven by one seed.
//!
//! One seed fixes everything: a splitmix64 generator decides every latency,
//! chunk boundary, think time, key, wait, lease and fault, and a virtual
//! microsecond clock advances only from event to event, so a run is exactly
//! reproducible, in any process: the engine's tables hash under a key drawn
//! from the seed (the daemon's is random), and the simulation's own maps are
//! ordered ones, never randomly keyed. What is simulated:
//!
//! * **Network**: each connection is two byte streams that carry the real
//!   wire encoding (`proto`), cut into chunks at random boundaries, so the
//!   server and clients decode partial frames exactly as over TCP. Bytes keep
//!   their order within a stream; streams of different connections are
//!   delayed independently (reordering between connections), a lost segment
//!   is a retransmission delay, a partition holds a client's traffic until it
//!   heals or resets its connections.
//! * **Server**: the engine, fed the same millisecond clock the daemon reads,
//!   ticked at `next_deadline()`; it can pause (a SIGSTOP longer than any
//!   lease), or crash and restart empty with its first token above every
//!   token it issued (what the daemon's token high-water mark provides) and
//!   a restart grace until every lease it granted has ended (what the
//!   daemon's durable lease bound provides).
//! * **Clients**: each follows the official client's rules (PROTOCOL §3): a fresh
//!   owner per acquire, one deadline per call, never resend what may have been
//!   sent, wire wait rounded up from the time left, Indeterminate after the
//!   deadline plus 1 s grace, a late grant released and not used. Clients
//!   crash and restart, and pause for longer than their leases.
//!
//! Every run's history goes through `ticketd::checker` (mutual exclusion
//! across restarts, since each has a grace; token order, FIFO hand-over, every request answered
//! once), and the engine's `check_invariants()` runs after every server step.
//! A failure names the seed; `SIM_SEED=N cargo test --test engine sim_single::` reruns
//! it alone, and `make sim-single SEEDS=N` runs N fresh seeds (from a random
//! first seed, or `FIRST=`).

use std::collections::BTreeMap;

use crate::checker::{ExtendOutcome, History, OpId, Outcome, ReleaseOutcome, Report};
use crate::rng::SplitMix64;
use ticketd::engine::{Acquire, AcquireOutcome, ConnId, Engine, Outbox};
use ticketd::hash::SipKey;
use ticketd::limits::EngineLimits;
use ticketd::proto::{
    decode_reply, decode_request, encode_reply, encode_request, Decoded, Reply, Request,
};
use ticketd::time::Millis;

/// A millisecond of the simulation's microsecond clock.
pub const MS: u64 = 1_000;
/// A second of the simulation's microsecond clock.
pub const S: u64 = 1_000_000;
const MAX_KEY: usize = 64;

/// The simulation's draws, on the tests' [`SplitMix64`]: `range` is
/// inclusive here, `chance` in per mille.
#[derive(Clone, Debug)]
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(SplitMix64::new(seed))
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

/// A deliberately broken server, to show the simulation and checker catch it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// After a restart, tokens start again at 1 (no high-water mark).
    TokensRestartAtOne,
    /// A closed connection releases the keys it holds (PROTOCOL §2.5 says no).
    ReleaseOnDisconnect,
    /// An extend is answered `E` but the lease is not moved.
    ExtendIgnored,
    /// A restart frees every key at once (`--restart-grace off`), while the
    /// history still claims exclusion across it.
    NoRestartGrace,
}

#[derive(Clone, Copy, Debug)]
struct Config {
    clients: usize,
    keys: usize,
    /// Virtual time during which clients start new acquires.
    run_us: u64,
    /// Mean virtual time between injected faults; 0 = no faults.
    fault_every_us: u64,
    bug: Option<Bug>,
}

impl Config {
    fn for_seed(seed: u64) -> Config {
        let mut r = Rng::new(seed ^ 0x5EED);
        Config {
            clients: r.range(2, 7) as usize,
            keys: r.range(1, 3) as usize,
            run_us: r.range(20, 60) * S,
            fault_every_us: match r.below(4) {
                0 => 0,
                1 => 8 * S,
                _ => r.range(1, 4) * S,
            },
            bug: None,
        }
    }
}

#[derive(Clone, Debug)]
enum Ev {
    ClientWake { client: usize, at: u64 },
    ToServer { conn: ConnId, bytes: Vec<u8> },
    ToClient { conn: ConnId, bytes: Vec<u8> },
    ServerSeesClose { conn: ConnId },
    ClientSeesClose { conn: ConnId },
    Connected { conn: ConnId },
    ServerTick,
    ServerRestart,
    ClientRestart { client: usize },
    Fault,
}

impl Ev {
    /// Which process handles the event: a client, the server, or neither.
    fn target(&self, conns: &BTreeMap<ConnId, Conn>) -> Target {
        match self {
            Ev::ClientWake { client, .. } | Ev::ClientRestart { client } => Target::Client(*client),
            Ev::ToClient { conn, .. } | Ev::ClientSeesClose { conn } | Ev::Connected { conn } => {
                Target::Client(conns[conn].client)
            }
            Ev::ToServer { .. } | Ev::ServerSeesClose { .. } | Ev::ServerTick => Target::Server,
            Ev::ServerRestart | Ev::Fault => Target::World,
        }
    }
}

enum Target {
    Client(usize),
    Server,
    World,
}

#[derive(Debug)]
struct Conn {
    client: usize,
    /// Which life of the client made it (a restarted client starts afresh).
    life: u64,
    /// The server incarnation the connection was made to.
    epoch: u64,
    /// Reset by the network or a crash: nothing more is delivered.
    cut: bool,
    established: bool,
    client_closed: bool,
    server_closed: bool,
    last_to_server: u64,
    last_to_client: u64,
    server_buf: Vec<u8>,
    client_buf: Vec<u8>,
}

/// What a client is doing.
#[derive(Clone, Debug)]
enum Phase {
    Idle,
    Acquiring(Pending),
    Holding {
        key: String,
        token: u64,
        /// The conservative expiry (PROTOCOL §3, §5.3).
        expires_us: u64,
        /// When the client means to release.
        hold_end_us: u64,
    },
    /// An extend of the held grant (PROTOCOL §5.3): resent on a new session
    /// after the old one died, never past `expires_us`.
    Extending {
        /// Recorded when sent: the op, its session and when it was written.
        sent: Option<(OpId, ConnId, u64)>,
        key: String,
        token: u64,
        lease_s: u8,
        expires_us: u64,
        hold_end_us: u64,
    },
    Releasing {
        /// Recorded when sent, with the session it went out on.
        sent: Option<(OpId, ConnId)>,
        key: String,
        token: u64,
        give_up_us: u64,
    },
}

#[derive(Clone, Debug)]
struct Pending {
    op: Option<OpId>,
    key: String,
    owner: u64,
    wait_s: u8,
    lease_s: u8,
    start_us: u64,
    /// When the request was written (once sent): the lease counts from it.
    sent_us: u64,
    /// The call's deadline D (PROTOCOL §3); for wait 0 the transport deadline.
    deadline_us: u64,
    /// When an unanswered sent request makes the call Indeterminate.
    give_up_us: u64,
}

#[derive(Debug)]
struct Client {
    alive: bool,
    life: u64,
    /// No new connection attempt before this (back-off after a refusal).
    retry_at: u64,
    paused_until: u64,
    partitioned_until: u64,
    session: Option<ConnId>,
    connecting: bool,
    phase: Phase,
    wake_at: u64,
    /// A late grant to release once a session exists.
    compensate: Vec<(String, u64)>,
}

struct Server {
    epoch: u64,
    up: bool,
    paused_until: u64,
    engine: Engine,
    out: Outbox,
    highest_token: u64,
    tick_at: u64,
    /// For `Bug::ReleaseOnDisconnect`: what each connection was granted.
    granted_to: BTreeMap<ConnId, Vec<(String, u64)>>,
}

struct Sim {
    cfg: Config,
    /// The engine's hash key, from the seed (see `Sim::new`).
    hash_key: SipKey,
    rng: Rng,
    now: u64,
    seq: u64,
    queue: BTreeMap<(u64, u64), Ev>,
    conns: BTreeMap<ConnId, Conn>,
    next_conn: ConnId,
    clients: Vec<Client>,
    server: Server,
    history: History,
    /// owner -> acquire op, so the server side can mark acquires queued.
    op_of_owner: BTreeMap<u64, OpId>,
    next_owner: u64,
    stats: Stats,
}

#[derive(Debug, Default, Clone, Copy)]
/// What happened in one run.
pub struct Stats {
    /// Events processed.
    pub events: u64,
    /// Server crashes (each followed by a restart).
    pub server_crashes: u64,
    /// Server pauses (a stop longer than any lease).
    pub server_pauses: u64,
    /// Client crashes.
    pub client_crashes: u64,
    /// Client pauses.
    pub client_pauses: u64,
    /// Network partitions.
    pub partitions: u64,
    /// Connection resets.
    pub resets: u64,
    /// Extends sent.
    pub extends: u64,
    /// Extends answered `E`.
    pub extended: u64,
    /// Restarts within a lease of the earlier incarnation: a grace held keys.
    pub graces: u64,
}

impl Sim {
    fn new(seed: u64, cfg: Config) -> Sim {
        let limits = EngineLimits {
            max_keys: 16,
            max_waiters: 8,
            max_waiters_per_key: 4,
            sweep_interval_ms: 2_000,
            max_hold_ms: 0,
            ..EngineLimits::default()
        };
        let clients = (0..cfg.clients)
            .map(|_| Client {
                alive: true,
                life: 0,
                retry_at: 0,
                paused_until: 0,
                partitioned_until: 0,
                session: None,
                connecting: false,
                phase: Phase::Idle,
                wake_at: 0,
                compensate: Vec::new(),
            })
            .collect();
        // The engine's tables hash under a key fixed by the seed (the
        // daemon's is random), so their order, which the stepped sweep
        // follows, is the same in every process that runs this seed.
        let mut key_rng = SplitMix64::new(seed ^ 0x7469_636b_6574_6448);
        let hash_key = SipKey::from_parts(key_rng.next_u64(), key_rng.next_u64());
        let mut sim = Sim {
            cfg,
            hash_key,
            rng: Rng::new(seed),
            now: 0,
            seq: 0,
            queue: BTreeMap::new(),
            conns: BTreeMap::new(),
            next_conn: 1,
            clients,
            server: Server {
                epoch: 0,
                up: true,
                paused_until: 0,
                engine: Engine::with_hash_key(limits, 1, hash_key),
                out: Outbox::new(),
                highest_token: 0,
                tick_at: u64::MAX,
                granted_to: BTreeMap::new(),
            },
            history: History::new(),
            op_of_owner: BTreeMap::new(),
            next_owner: 1,
            stats: Stats::default(),
        };
        for c in 0..cfg.clients {
            let at = sim.rng.range(0, 500 * MS);
            sim.wake(c, at);
        }
        if cfg.fault_every_us > 0 {
            let at = sim.rng.range(0, cfg.fault_every_us * 2);
            sim.at(at, Ev::Fault);
        }
        sim
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.queue.insert((t.max(self.now), self.seq), ev);
    }

    /// Puts an event for a stopped process back for when it resumes. It
    /// keeps its sequence number, so events of one byte stream stay in order
    /// even against events that were due exactly at the resumption.
    fn defer(&mut self, until: u64, seq: u64, ev: Ev) {
        self.queue.insert((until, seq), ev);
    }

    fn wake(&mut self, client: usize, t: u64) {
        let t = t.max(self.now);
        let c = &mut self.clients[client];
        // Keep the earliest pending wake; later ones are re-armed by the step.
        if c.wake_at > self.now && c.wake_at <= t {
            return;
        }
        c.wake_at = t;
        self.at(t, Ev::ClientWake { client, at: t });
    }

    fn server_ms(&self) -> Millis {
        // The daemon's clock: whole milliseconds, truncated.
        Millis(self.now / MS)
    }

    fn latency(&mut self) -> u64 {
        if self.cfg.fault_every_us > 0 && self.rng.chance(20) {
            self.rng.range(200 * MS, 1_000 * MS) // a lost segment, retransmitted
        } else {
            self.rng.range(30, 2 * MS)
        }
    }

    /// Sends bytes on one direction of a connection, in random chunks, in order.
    fn send(&mut self, conn: ConnId, to_server: bool, bytes: &[u8]) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        if c.cut {
            return;
        }
        let held_until = self.clients[c.client].partitioned_until;
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = if rest.len() > 1 && self.rng.chance(300) {
                self.rng.range(1, rest.len() as u64 - 1) as usize
            } else {
                rest.len()
            };
            let (chunk, tail) = rest.split_at(n);
            rest = tail;
            let lat = self.latency();
            let c = self.conns.get_mut(&conn).expect("checked above");
            let last = if to_server {
                &mut c.last_to_server
            } else {
                &mut c.last_to_client
            };
            let t = (*last).max(self.now + lat).max(held_until + lat);
            *last = t;
            let ev = if to_server {
                Ev::ToServer {
                    conn,
                    bytes: chunk.to_vec(),
                }
            } else {
                Ev::ToClient {
                    conn,
                    bytes: chunk.to_vec(),
                }
            };
            self.at(t, ev);
        }
    }

    /// The network resets a connection: both ends learn it after a while.
    fn cut(&mut self, conn: ConnId) {
        let (d1, d2) = (self.rng.range(MS, 50 * MS), self.rng.range(MS, 50 * MS));
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.cut {
            return;
        }
        c.cut = true;
        self.stats.resets += 1;
        let now = self.now;
        if !c.client_closed {
            // Nothing crosses a reset connection from now on, and the server
            // may drop its queued acquires before the client notices.
            self.history.session_closed(conn, now);
        }
        self.at(now + d1, Ev::ServerSeesClose { conn });
        self.at(now + d2, Ev::ClientSeesClose { conn });
    }

    /// The client closes its session; the server sees the FIN after the data.
    fn client_close(&mut self, client: usize) {
        let Some(conn) = self.clients[client].session.take() else {
            return;
        };
        let lat = self.latency();
        let c = self.conns.get_mut(&conn).expect("session exists");
        if !c.client_closed {
            c.client_closed = true;
            let fin = c.last_to_server.max(self.now + lat);
            self.history.session_closed(conn, self.now);
            self.at(fin, Ev::ServerSeesClose { conn });
        }
    }

    fn run(&mut self) -> Result<Report, String> {
        let hard_end = self.cfg.run_us + 120 * S;
        while let Some(((t, seq), ev)) = self.queue.pop_first() {
            self.now = t;
            self.stats.events += 1;
            if t > hard_end {
                return Err(format!("still busy at {t}us: {ev:?}"));
            }
            match ev.target(&self.conns) {
                Target::Client(c) => {
                    if !self.clients[c].alive && !matches!(ev, Ev::ClientRestart { .. }) {
                        continue; // a dead process handles nothing
                    }
                    let until = self.clients[c].paused_until;
                    if until > t {
                        self.defer(until, seq, ev); // a stopped process handles it later
                        continue;
                    }
                }
                Target::Server => {
                    if !self.server.up {
                        if let Ev::ToServer { .. } | Ev::ServerSeesClose { .. } = ev {
                            continue;
                        }
                    }
                    let until = self.server.paused_until;
                    if until > t {
                        self.defer(until, seq, ev);
                        continue;
                    }
                }
                Target::World => {}
            }
            self.handle(ev)?;
        }
        self.history.check().map_err(|v| v.to_string())
    }

    fn handle(&mut self, ev: Ev) -> Result<(), String> {
        match ev {
            Ev::ClientWake { client, at } => {
                // Only the latest wake counts; it may come late after a pause.
                if self.clients[client].wake_at == at {
                    self.clients[client].wake_at = self.now;
                    self.client_step(client);
                }
            }
            Ev::Connected { conn } => {
                let c = self.conns.get_mut(&conn).expect("conn exists");
                let client = c.client;
                if c.life != self.clients[client].life {
                    return Ok(()); // made by a life of the client that crashed
                }
                self.clients[client].connecting = false;
                // The kernel accepts while the process is stopped; a dead
                // server or a partitioned link refuses.
                let ok = !c.cut
                    && self.server.up
                    && c.epoch == self.server.epoch
                    && self.clients[client].partitioned_until <= self.now;
                if ok {
                    c.established = true;
                    self.clients[client].session = Some(conn);
                } else {
                    c.cut = true;
                    c.client_closed = true;
                    c.server_closed = true;
                    let retry = self.now + self.rng.range(50 * MS, 200 * MS);
                    self.clients[client].retry_at = retry;
                    self.wake(client, retry);
                }
                self.client_step(client);
            }
            Ev::ToServer { conn, bytes } => {
                let c = self.conns.get_mut(&conn).expect("conn exists");
                if c.cut || c.server_closed || c.epoch != self.server.epoch {
                    return Ok(());
                }
                c.server_buf.extend_from_slice(&bytes);
                self.server_read(conn)?;
            }
            Ev::ToClient { conn, bytes } => {
                let c = self.conns.get_mut(&conn).expect("conn exists");
                if c.cut || c.client_closed {
                    return Ok(());
                }
                c.client_buf.extend_from_slice(&bytes);
                let client = c.client;
                self.client_read(client, conn)?;
            }
            Ev::ServerSeesClose { conn } => {
                let c = self.conns.get_mut(&conn).expect("conn exists");
                if c.server_closed || c.epoch != self.server.epoch {
                    return Ok(());
                }
                c.server_closed = true;
                let now = self.server_ms();
                self.server
                    .engine
                    .disconnect(now, conn, &mut self.server.out);
                if self.cfg.bug == Some(Bug::ReleaseOnDisconnect) {
                    for (key, token) in self.server.granted_to.remove(&conn).unwrap_or_default() {
                        self.server
                            .engine
                            .expire(now, &key, token, &mut self.server.out);
                    }
                }
                self.server_flush()?;
            }
            Ev::ClientSeesClose { conn } => {
                let c = self.conns.get_mut(&conn).expect("conn exists");
                if c.client_closed || c.life != self.clients[c.client].life {
                    return Ok(());
                }
                c.client_closed = true;
                let client = c.client;
                self.history.session_closed(conn, self.now);
                if self.clients[client].session == Some(conn) {
                    self.clients[client].session = None;
                    self.session_lost(client);
                }
            }
            Ev::ServerTick => {
                if self.server.up && self.server.tick_at <= self.now {
                    self.server.tick_at = u64::MAX;
                    let now = self.server_ms();
                    self.server.engine.tick(now, &mut self.server.out);
                    self.server_flush()?;
                }
            }
            Ev::ServerRestart => {
                let first = match self.cfg.bug {
                    Some(Bug::TokensRestartAtOne) => 1,
                    // Above every token the old incarnation could have
                    // issued, less the unused rest of a reserved block.
                    _ => self.server.engine.next_token() + self.rng.below(1000),
                };
                let limits = self.server.engine.limits().clone();
                // The durable lease bound the daemon keeps: at or past every
                // lease granted, and past an unfinished grace (a crash
                // during one). The daemon's is a step further still.
                let old = &self.server.engine;
                let now = self.server_ms();
                let bound = old
                    .granted_until()
                    .max(old.restart_grace(now).unwrap_or(Millis::ZERO));
                self.server.engine = Engine::with_hash_key(limits, first, self.hash_key);
                if self.cfg.bug != Some(Bug::NoRestartGrace) {
                    self.server.engine.set_restart_grace(bound);
                    if bound > now {
                        self.stats.graces += 1;
                    }
                }
                self.server.epoch += 1;
                self.server.up = true;
                self.server.tick_at = u64::MAX;
                self.server.granted_to.clear();
                self.history.server_restart_with_grace(self.now, first);
            }
            Ev::ClientRestart { client } => {
                let c = &mut self.clients[client];
                c.alive = true;
                c.life += 1;
                c.retry_at = 0;
                c.wake_at = 0;
                c.phase = Phase::Idle;
                c.compensate.clear();
                let t = self.now;
                self.wake(client, t);
            }
            Ev::Fault => {
                self.fault();
                let next = self.now + self.rng.range(1, self.cfg.fault_every_us * 2);
                if next < self.cfg.run_us {
                    self.at(next, Ev::Fault);
                }
            }
        }
        Ok(())
    }

    fn fault(&mut self) {
        let client = self.rng.below(self.cfg.clients as u64) as usize;
        match self.rng.below(10) {
            0 | 1 => {
                // Partition one client's link; a long one resets its connections.
                self.stats.partitions += 1;
                let len = self.rng.range(50 * MS, 6 * S);
                let until = self.now + len;
                let c = &mut self.clients[client];
                c.partitioned_until = c.partitioned_until.max(until);
                if len > 2 * S || self.rng.chance(300) {
                    let conns: Vec<ConnId> = self
                        .conns
                        .iter()
                        .filter(|(_, c)| c.client == client && !c.cut)
                        .map(|(&id, _)| id)
                        .collect();
                    for conn in conns {
                        self.cut(conn);
                    }
                }
            }
            2 => {
                if let Some(conn) = self.clients[client].session {
                    self.cut(conn);
                }
            }
            3 | 4 => {
                // Client crash: its sockets close, its state is gone.
                if !self.clients[client].alive {
                    return;
                }
                self.stats.client_crashes += 1;
                self.client_crash(client);
                let back = self.now + self.rng.range(100 * MS, 3 * S);
                self.at(back, Ev::ClientRestart { client });
            }
            5 | 6 => {
                // A pause longer than the leases (up to 3 s here) at times.
                self.stats.client_pauses += 1;
                let len = self.rng.range(100 * MS, 8 * S);
                let c = &mut self.clients[client];
                c.paused_until = c.paused_until.max(self.now + len);
            }
            7 | 8 => {
                if !self.server.up {
                    return;
                }
                self.stats.server_pauses += 1;
                let len = self.rng.range(100 * MS, 8 * S);
                self.server.paused_until = self.server.paused_until.max(self.now + len);
            }
            _ => {
                if !self.server.up {
                    return;
                }
                self.stats.server_crashes += 1;
                self.server_crash();
                let back = self.now + self.rng.range(50 * MS, 3 * S);
                self.at(back, Ev::ServerRestart);
            }
        }
    }

    fn client_crash(&mut self, client: usize) {
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.client == client && !c.client_closed)
            .map(|(&id, _)| id)
            .collect();
        for conn in conns {
            // The kernel closes the dead process's sockets.
            let lat = self.latency();
            let c = self.conns.get_mut(&conn).expect("listed");
            c.client_closed = true;
            let fin = c.last_to_server.max(self.now + lat);
            self.history.session_closed(conn, self.now);
            self.at(fin, Ev::ServerSeesClose { conn });
        }
        let c = &mut self.clients[client];
        c.alive = false;
        c.session = None;
        c.connecting = false;
        c.paused_until = 0;
        // What it was doing ends unanswered; its sessions are closed.
        c.phase = Phase::Idle;
    }

    fn server_crash(&mut self) {
        self.server.up = false;
        self.server.paused_until = 0;
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.epoch == self.server.epoch && !c.cut)
            .map(|(&id, _)| id)
            .collect();
        for conn in conns {
            let d = self.rng.range(MS, 50 * MS);
            let c = self.conns.get_mut(&conn).expect("listed");
            c.cut = true;
            c.server_closed = true;
            let now = self.now;
            if !c.client_closed {
                self.history.session_closed(conn, now);
            }
            self.at(now + d, Ev::ClientSeesClose { conn });
        }
    }

    // ---- server side ----

    fn server_read(&mut self, conn: ConnId) -> Result<(), String> {
        let now = self.server_ms();
        loop {
            let c = self.conns.get_mut(&conn).expect("conn exists");
            let (req_owned, used) = match decode_request(&c.server_buf, MAX_KEY) {
                Decoded::Incomplete => break,
                Decoded::Malformed(m) => {
                    return Err(format!("server got a malformed frame from a client: {m}"))
                }
                Decoded::Frame { frame, used } => (OwnedReq::from(frame), used),
            };
            c.server_buf.drain(..used);
            match req_owned {
                OwnedReq::Acquire {
                    wait_s,
                    lease_s,
                    owner,
                    key,
                } => {
                    let outcome = self.server.engine.acquire(
                        now,
                        conn,
                        Acquire {
                            key: &key,
                            owner,
                            wait_s,
                            lease_s,
                        },
                        &mut self.server.out,
                    );
                    if let AcquireOutcome::Queued(_) = outcome {
                        if let Some(&op) = self.op_of_owner.get(&owner) {
                            // In the server's own (millisecond) clock, which
                            // its wait deadlines count from.
                            self.history.queued(op, now.0 * MS);
                        }
                    }
                }
                OwnedReq::Release { token, key } => {
                    self.server
                        .engine
                        .release(now, conn, token, &key, &mut self.server.out);
                }
                OwnedReq::Extend {
                    lease_s,
                    token,
                    key,
                } => {
                    if self.cfg.bug == Some(Bug::ExtendIgnored) {
                        let reply = Reply::Extended { token, key: &key };
                        self.server.out.push(conn, reply, lease_s);
                    } else {
                        self.server.engine.extend(
                            now,
                            conn,
                            &key,
                            token,
                            lease_s,
                            &mut self.server.out,
                        );
                    }
                }
            }
        }
        self.server_flush()
    }

    fn server_flush(&mut self) -> Result<(), String> {
        self.server.engine.check_invariants();
        let mut sends = Vec::new();
        for a in self.server.out.iter() {
            if let Reply::Acquired { token, key, .. } = a.reply {
                if token <= self.server.highest_token && self.cfg.bug.is_none() {
                    return Err(format!("engine issued token {token} twice"));
                }
                self.server.highest_token = self.server.highest_token.max(token);
                self.server
                    .granted_to
                    .entry(a.conn)
                    .or_default()
                    .push((key.to_string(), token));
            }
            let mut bytes = Vec::new();
            encode_reply(&a.reply, &mut bytes);
            sends.push((a.conn, bytes));
        }
        self.server.out.clear();
        for (conn, bytes) in sends {
            if self.conns.get(&conn).is_some_and(|c| !c.server_closed) {
                self.send(conn, false, &bytes);
            }
        }
        if let Some(d) = self.server.engine.next_deadline() {
            let t = d.0.saturating_mul(MS).max(self.now);
            if t < self.server.tick_at {
                self.server.tick_at = t;
                self.at(t, Ev::ServerTick);
            }
        }
        Ok(())
    }

    // ---- client side ----

    fn connect(&mut self, client: usize) {
        let c = &mut self.clients[client];
        if c.connecting || c.session.is_some() || c.retry_at > self.now {
            return;
        }
        let life = c.life;
        c.connecting = true;
        let conn = self.next_conn;
        self.next_conn += 1;
        let rtt = self.latency() + self.latency();
        self.conns.insert(
            conn,
            Conn {
                client,
                life,
                epoch: self.server.epoch,
                cut: false,
                established: false,
                client_closed: false,
                server_closed: false,
                last_to_server: 0,
                last_to_client: 0,
                server_buf: Vec::new(),
                client_buf: Vec::new(),
            },
        );
        let t = self.now + rtt;
        self.at(t, Ev::Connected { conn });
    }

    /// The client's state machine: called on wakes and whenever a session
    /// appears. Decides what to send and when to give up.
    fn client_step(&mut self, client: usize) {
        let now = self.now;
        if let Some((key, token)) = self.clients[client].compensate.first().cloned() {
            if let Some(conn) = self.clients[client].session {
                self.clients[client].compensate.remove(0);
                let mut bytes = Vec::new();
                encode_request(&Request::Release { token, key: &key }, &mut bytes);
                self.send(conn, true, &bytes);
            } else {
                self.connect(client);
            }
        }
        match self.clients[client].phase.clone() {
            Phase::Idle => {
                if now >= self.cfg.run_us {
                    return; // the run is over: start nothing new
                }
                if self.clients[client].wake_at > now {
                    return;
                }
                let key = format!("k{}", self.rng.below(self.cfg.keys as u64));
                let wait_s = match self.rng.below(5) {
                    0 => 0,
                    _ => self.rng.range(1, 4) as u8,
                };
                let lease_s = self.rng.range(1, 3) as u8;
                let owner = self.next_owner;
                self.next_owner += 1;
                let deadline_us = if wait_s == 0 {
                    now + 5 * S
                } else {
                    now + u64::from(wait_s) * S
                };
                let give_up_us = if wait_s == 0 {
                    deadline_us
                } else {
                    deadline_us + S
                };
                self.clients[client].phase = Phase::Acquiring(Pending {
                    op: None,
                    key,
                    owner,
                    wait_s,
                    lease_s,
                    start_us: now,
                    sent_us: 0,
                    deadline_us,
                    give_up_us,
                });
                self.client_step(client);
            }
            Phase::Acquiring(p) if p.op.is_none() => {
                // Not sent yet: it may still go on any session, until D.
                let left = if p.wait_s == 0 {
                    Some(0)
                } else {
                    p.deadline_us.checked_sub(now).filter(|&l| l > 0)
                };
                let Some(left) = left.filter(|_| now < p.deadline_us) else {
                    // D passed unsent: Timeout, the server never saw it.
                    let op = self.history.acquire(
                        client as u64,
                        0,
                        &p.key,
                        p.owner,
                        p.wait_s,
                        p.lease_s,
                        p.start_us,
                    );
                    self.history.acquired(op, Outcome::Timeout, now);
                    self.finish_idle(client);
                    return;
                };
                let Some(conn) = self.clients[client].session else {
                    self.connect(client);
                    self.wake(client, p.deadline_us);
                    return;
                };
                // The wire wait is the time left, rounded up (PROTOCOL §3).
                let wire_wait = if p.wait_s == 0 {
                    0
                } else {
                    left.div_ceil(S).min(255) as u8
                };
                let op = self.history.acquire(
                    client as u64,
                    conn,
                    &p.key,
                    p.owner,
                    wire_wait,
                    p.lease_s,
                    now,
                );
                self.op_of_owner.insert(p.owner, op);
                let mut bytes = Vec::new();
                encode_request(
                    &Request::Acquire {
                        wait_s: wire_wait,
                        lease_s: p.lease_s,
                        owner: p.owner,
                        key: &p.key,
                    },
                    &mut bytes,
                );
                self.send(conn, true, &bytes);
                let give_up = p.give_up_us;
                self.clients[client].phase = Phase::Acquiring(Pending {
                    op: Some(op),
                    sent_us: now,
                    ..p
                });
                self.wake(client, give_up);
            }
            Phase::Acquiring(p) => {
                if now >= p.give_up_us {
                    // Sent, unanswered past D + grace: close that session.
                    let op = p.op.expect("sent");
                    self.history.acquired(op, Outcome::Indeterminate, now);
                    self.client_close(client);
                    self.finish_idle(client);
                } else {
                    self.wake(client, p.give_up_us);
                }
            }
            Phase::Holding {
                key,
                token,
                expires_us,
                hold_end_us,
            } => {
                if self.clients[client].wake_at > now {
                    return;
                }
                if now < hold_end_us && now < expires_us {
                    // Still working: extend before the lease runs out.
                    let lease_s = self.rng.range(1, 4) as u8;
                    self.clients[client].phase = Phase::Extending {
                        sent: None,
                        key,
                        token,
                        lease_s,
                        expires_us,
                        hold_end_us,
                    };
                    self.client_step(client);
                    return;
                }
                let give_up_us = now + 3 * S;
                self.clients[client].phase = Phase::Releasing {
                    sent: None,
                    key,
                    token,
                    give_up_us,
                };
                self.client_step(client);
            }
            Phase::Extending {
                sent,
                key,
                token,
                lease_s,
                expires_us,
                hold_end_us,
            } => {
                if now >= expires_us {
                    // No E by the expiry: lost for good; stop using it.
                    if let Some((op, _, _)) = sent {
                        self.history.extended(op, ExtendOutcome::Lost, now);
                    }
                    self.finish_idle(client);
                    return;
                }
                if sent.is_none() {
                    let Some(conn) = self.clients[client].session else {
                        self.connect(client);
                        self.wake(client, expires_us);
                        return;
                    };
                    let op = self
                        .history
                        .extend(client as u64, conn, &key, token, lease_s, now);
                    // A shorter lease may take effect unanswered (PROTOCOL §5.2
                    // allows shortening): stop using the grant by then.
                    let expires_us = expires_us.min(now + u64::from(lease_s) * S);
                    self.stats.extends += 1;
                    let mut bytes = Vec::new();
                    encode_request(
                        &Request::Extend {
                            lease_s,
                            token,
                            key: &key,
                        },
                        &mut bytes,
                    );
                    self.send(conn, true, &bytes);
                    self.clients[client].phase = Phase::Extending {
                        sent: Some((op, conn, now)),
                        key,
                        token,
                        lease_s,
                        expires_us,
                        hold_end_us,
                    };
                }
                self.wake(client, expires_us);
            }
            Phase::Releasing {
                sent,
                key,
                token,
                give_up_us,
            } => {
                if now >= give_up_us {
                    if let Some((op, _)) = sent {
                        self.history
                            .released(op, ReleaseOutcome::Indeterminate, now);
                        self.client_close(client);
                    }
                    // Never sent: the lease takes the key back.
                    self.finish_idle(client);
                    return;
                }
                if sent.is_none() {
                    let Some(conn) = self.clients[client].session else {
                        self.connect(client);
                        self.wake(client, give_up_us);
                        return;
                    };
                    // Recorded when written: the client stops using the lock
                    // when it decides to release, which is no later.
                    let op = self.history.release(client as u64, conn, &key, token, now);
                    let mut bytes = Vec::new();
                    encode_request(&Request::Release { token, key: &key }, &mut bytes);
                    self.send(conn, true, &bytes);
                    self.clients[client].phase = Phase::Releasing {
                        sent: Some((op, conn)),
                        key,
                        token,
                        give_up_us,
                    };
                }
                self.wake(client, give_up_us);
            }
        }
    }

    /// The client holds `key` until `hold_end_us` (extending it on the way
    /// if that is past its expiry), waking at some point before both.
    fn hold(&mut self, client: usize, key: String, token: u64, expires_us: u64, hold_end_us: u64) {
        let now = self.now;
        // Wake at the hold's end, or somewhere in the first two thirds of
        // the lease left, to extend.
        let wake = if hold_end_us <= expires_us {
            hold_end_us
        } else {
            let left = expires_us.saturating_sub(now);
            now + self.rng.range(0, (left * 2 / 3).max(1))
        };
        self.clients[client].phase = Phase::Holding {
            key,
            token,
            expires_us,
            hold_end_us,
        };
        self.clients[client].wake_at = 0;
        self.wake(client, wake);
    }

    fn finish_idle(&mut self, client: usize) {
        self.clients[client].phase = Phase::Idle;
        let think = self.rng.range(0, 300 * MS);
        let t = self.now + think;
        self.wake(client, t);
    }

    /// The client's session closed under it.
    fn session_lost(&mut self, client: usize) {
        let now = self.now;
        match self.clients[client].phase.clone() {
            Phase::Acquiring(p) if p.op.is_some() => {
                // Maybe sent: never resent; the call is Indeterminate.
                self.history
                    .acquired(p.op.expect("sent"), Outcome::Indeterminate, now);
                self.finish_idle(client);
            }
            Phase::Releasing {
                sent: Some((op, _)),
                ..
            } => {
                self.history
                    .released(op, ReleaseOutcome::Indeterminate, now);
                self.finish_idle(client);
            }
            Phase::Extending {
                sent: Some(_),
                key,
                token,
                lease_s,
                expires_us,
                hold_end_us,
            } => {
                // An extend may be sent again (PROTOCOL §5.3): same token, key
                // and lease, on a new session, until the expiry.
                self.clients[client].phase = Phase::Extending {
                    sent: None,
                    key,
                    token,
                    lease_s,
                    expires_us,
                    hold_end_us,
                };
                self.client_step(client);
            }
            _ => self.client_step(client),
        }
    }

    fn client_read(&mut self, client: usize, conn: ConnId) -> Result<(), String> {
        loop {
            let c = self.conns.get_mut(&conn).expect("conn exists");
            let (reply, used) = match decode_reply(&c.client_buf, MAX_KEY) {
                Decoded::Incomplete => return Ok(()),
                Decoded::Malformed(m) => {
                    return Err(format!("client got a malformed reply: {m}"));
                }
                Decoded::Frame { frame, used } => (OwnedReply::from(frame), used),
            };
            c.client_buf.drain(..used);
            self.client_reply(client, conn, reply);
        }
    }

    fn client_reply(&mut self, client: usize, conn: ConnId, reply: OwnedReply) {
        let now = self.now;
        match (self.clients[client].phase.clone(), reply) {
            (Phase::Acquiring(p), OwnedReply::Owner { op, owner, token }) if owner == p.owner => {
                let Some(acq) = p.op else {
                    return;
                };
                match op {
                    b'A' if now <= p.deadline_us => {
                        self.history.acquired(acq, Outcome::Granted { token }, now);
                        let hold = match self.rng.below(8) {
                            0 => self.rng.range(0, u64::from(p.lease_s) * 2 * S),
                            // Held for several leases, extended on the way.
                            1 => self.rng.range(0, u64::from(p.lease_s) * 4 * S),
                            _ => self.rng.range(0, 500 * MS),
                        };
                        let expires_us = p.sent_us + u64::from(p.lease_s) * S;
                        self.hold(client, p.key.clone(), token, expires_us, now + hold);
                    }
                    b'A' => {
                        // Matched after D: not used, released, Indeterminate.
                        self.history
                            .acquired(acq, Outcome::LateGrant { token }, now);
                        self.clients[client].compensate.push((p.key.clone(), token));
                        self.finish_idle(client);
                    }
                    b'T' => {
                        self.history.acquired(acq, Outcome::Timeout, now);
                        self.finish_idle(client);
                    }
                    _ => {
                        self.history.acquired(acq, Outcome::Busy, now);
                        self.finish_idle(client);
                    }
                }
            }
            (
                Phase::Extending {
                    sent: Some((op, sent_on, sent_at)),
                    key,
                    token,
                    lease_s,
                    expires_us,
                    hold_end_us,
                },
                OwnedReply::Extend {
                    extended,
                    token: t,
                    key: k,
                },
            ) if t == token && k == key && sent_on == conn => {
                if extended && now < expires_us {
                    self.history.extended(op, ExtendOutcome::Extended, now);
                    self.stats.extended += 1;
                    let expires_us = sent_at + u64::from(lease_s) * S;
                    self.hold(client, key, token, expires_us, hold_end_us);
                } else {
                    // X, or an E after the expiry: lost, never revived.
                    let outcome = if extended {
                        ExtendOutcome::Lost
                    } else {
                        ExtendOutcome::NotExtended
                    };
                    self.history.extended(op, outcome, now);
                    self.finish_idle(client);
                }
            }
            (
                Phase::Releasing {
                    sent: Some((op, sent_on)),
                    key,
                    token,
                    ..
                },
                OwnedReply::Release {
                    released,
                    token: t,
                    key: k,
                },
            ) if t == token && k == key && sent_on == conn => {
                let outcome = if released {
                    ReleaseOutcome::Released
                } else {
                    ReleaseOutcome::NotReleased
                };
                self.history.released(op, outcome, now);
                self.finish_idle(client);
            }
            // Answers to compensating releases, or to requests of a call
            // this client already gave up on, are not matched to anything.
            _ => {}
        }
    }
}

/// A decoded request with its key copied, so the buffer can be drained.
enum OwnedReq {
    Acquire {
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: String,
    },
    Release {
        token: u64,
        key: String,
    },
    Extend {
        lease_s: u8,
        token: u64,
        key: String,
    },
}

impl From<Request<'_>> for OwnedReq {
    fn from(r: Request<'_>) -> Self {
        match r {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            } => OwnedReq::Acquire {
                wait_s,
                lease_s,
                owner,
                key: key.to_string(),
            },
            Request::Release { token, key } => OwnedReq::Release {
                token,
                key: key.to_string(),
            },
            Request::Extend {
                lease_s,
                token,
                key,
            } => OwnedReq::Extend {
                lease_s,
                token,
                key: key.to_string(),
            },
        }
    }
}

/// A decoded reply with its key copied.
enum OwnedReply {
    /// `A`, `T` or `B` (op byte), matched by owner.
    Owner { op: u8, owner: u64, token: u64 },
    /// `R` or `N`, matched by token and key.
    Release {
        released: bool,
        token: u64,
        key: String,
    },
    /// `E` or `X`, matched by token and key.
    Extend {
        extended: bool,
        token: u64,
        key: String,
    },
}

impl From<Reply<'_>> for OwnedReply {
    fn from(r: Reply<'_>) -> Self {
        match r {
            Reply::Acquired { token, owner, .. } => OwnedReply::Owner {
                op: b'A',
                owner,
                token,
            },
            Reply::Timeout { owner, .. } => OwnedReply::Owner {
                op: b'T',
                owner,
                token: 0,
            },
            Reply::Busy { owner, .. } => OwnedReply::Owner {
                op: b'B',
                owner,
                token: 0,
            },
            Reply::Released { token, key } => OwnedReply::Release {
                released: true,
                token,
                key: key.to_string(),
            },
            Reply::NotReleased { token, key } => OwnedReply::Release {
                released: false,
                token,
                key: key.to_string(),
            },
            Reply::Extended { token, key } => OwnedReply::Extend {
                extended: true,
                token,
                key: key.to_string(),
            },
            Reply::NotExtended { token, key } => OwnedReply::Extend {
                extended: false,
                token,
                key: key.to_string(),
            },
        }
    }
}

/// Runs one seed to the end and checks its history.
pub fn run_seed(seed: u64, bug: Option<Bug>) -> (Result<Report, String>, Stats, History) {
    let cfg = Config {
        bug,
        ..Config::for_seed(seed)
    };
    let mut sim = Sim::new(seed, cfg);
    let result = sim.run();
    (result, sim.stats, std::mem::take(&mut sim.history))
}

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
//! * **Keys**: besides the mutexes `k0`.. (plain `A`), most seeds have
//!   keys of protocol 1.2 (`P`, PROTOCOL §6): a semaphore `s0` of 2 or 3
//!   permits and a read/write lock `rw` whose clients take it shared or,
//!   less often, exclusive. Now and then an acquire asks with the wrong
//!   limit (a `P` of limit 2 on a mutex, another limit on a semaphore or
//!   the read/write lock), to meet `L`, or to register the key with that
//!   limit when it is free.
//!
//! Every run's history goes through `ticketd::checker` (mutual exclusion
//! across restarts, since each has a grace; the permit count, exclusive
//! grants alone and one limit per key on the permit keys; token order, FIFO
//! hand-over, every request answered
//! once), and the engine's `check_invariants()` runs after every server step.
//! A failure names the seed; `SIM_SEED=N cargo test --test engine sim_single::` reruns
//! it alone, and `make sim-single SEEDS=N` runs N fresh seeds (from a random
//! first seed, or `FIRST=`).

use std::collections::BTreeMap;

use crate::checker::{ExtendOutcome, History, OpId, Outcome, ReleaseOutcome, Report, MUTEX};
use crate::rng::SplitMix64;
use ticketd::engine::{Acquire, AcquireOutcome, ConnId, Engine, Outbox};
use ticketd::hash::SipKey;
use ticketd::limits::EngineLimits;
use ticketd::proto::{
    decode_reply, decode_request, encode_reply, encode_request, Decoded, Mode, Places, Reply,
    Request,
};
use ticketd::time::Millis;

mod client;
mod network;
mod owned;
mod server;

use owned::{OwnedReply, OwnedReq};

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
    /// Mutex keys, `k0`...
    keys: usize,
    /// The limit of the semaphore `s0`; 0 for none.
    sem_limit: u16,
    /// Whether the read/write lock `rw` is used.
    rw: bool,
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
            sem_limit: [0, 2, 3, 3][r.below(4) as usize],
            rw: r.below(4) != 0,
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
    /// [`MUTEX`] for a plain `A`, else what the `P` asks for.
    places: Places,
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
            Ev::Connected { conn } => self.connected(conn),
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
            Ev::ServerSeesClose { conn } => self.server_sees_close(conn)?,
            Ev::ClientSeesClose { conn } => self.client_sees_close(conn),
            Ev::ServerTick => {
                if self.server.up && self.server.tick_at <= self.now {
                    self.server.tick_at = u64::MAX;
                    let now = self.server_ms();
                    self.server.engine.tick(now, &mut self.server.out);
                    self.server_flush()?;
                }
            }
            Ev::ServerRestart => self.server_restart(),
            Ev::ClientRestart { client } => self.client_restart(client),
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

    /// A client's connection `conn` completes, or is refused (a dead server,
    /// a cut or partitioned link): the client retries later.
    fn connected(&mut self, conn: ConnId) {
        let c = self.conns.get_mut(&conn).expect("conn exists");
        let client = c.client;
        if c.life != self.clients[client].life {
            return; // made by a life of the client that crashed
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

    /// The server reads the close of `conn`: its acquires are cancelled
    /// (and, with the bug, its grants released).
    fn server_sees_close(&mut self, conn: ConnId) -> Result<(), String> {
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
        Ok(())
    }

    /// The client reads the close of `conn`: the session ends, and with it
    /// the client's call on it.
    fn client_sees_close(&mut self, conn: ConnId) {
        let c = self.conns.get_mut(&conn).expect("conn exists");
        if c.client_closed || c.life != self.clients[c.client].life {
            return;
        }
        c.client_closed = true;
        let client = c.client;
        self.history.session_closed(conn, self.now);
        if self.clients[client].session == Some(conn) {
            self.clients[client].session = None;
            self.session_lost(client);
        }
    }

    /// The server comes back: a new engine starting above every earlier
    /// token, in a restart grace up to the durable lease bound.
    fn server_restart(&mut self) {
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

    /// A crashed client comes back idle, in a new life.
    fn client_restart(&mut self, client: usize) {
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

    // ---- server side ----

    // ---- client side ----
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

//! Network faults between real `ticketd --cluster` processes.
//!
//! * **A private network namespace per test.** [`enter_private_netns`]
//!   moves the calling test thread into a new network namespace (with
//!   `unshare(CLONE_NEWNET)`, which a multi-threaded process may do for one
//!   thread) and brings its loopback up. Every process and thread the test
//!   starts afterwards inherits it, so the nodes, the clients and the
//!   nftables rules live in a network of their own: fixed addresses and
//!   ports never collide with anything else on the machine, and rules vanish
//!   with the namespace even if the test process is killed.
//! * **One address per node.** Node `i` (1-based) listens for clients on
//!   `127.0.0.1i:7470` and for peers on `127.0.0.1i:7001`; on Linux all of
//!   127.0.0.0/8 is loopback, no setup needed.
//! * **Cutting one direction of one link.** A node sends its Raft messages to
//!   a peer only on the connection it opened to that peer's peer address
//!   (connections peers open to it are read only). That outbound socket is
//!   not bound to the node's own address, so its packets leave from
//!   127.0.0.1 and the source address does not say which node sent them. The
//!   sender is told apart by the socket's group instead: each node runs with
//!   its own group id (`setpriv --regid`, still as root so it can use its
//!   data directory). An output rule `meta skgid G ip daddr 127.0.0.1j tcp
//!   dport 7001 meta mark set M` marks every packet node `i` (group `G`)
//!   sends to node `j`'s peer port, and an input rule drops marked packets:
//!   the messages `i → j` vanish, silently, as in a real partition, while
//!   `j → i` (on `j`'s own connection) still flows. Both directions together
//!   make a two-way cut. Client traffic (to port 7470, and the replies to the
//!   clients' ports) is never matched. Each change of the set of cut links
//!   is one nftables transaction (`nft -f -`), so a fault starts and ends at
//!   one instant for every link.
//! * **Why drop on input.** A packet dropped on the output path is refused
//!   to the sending TCP at once, which then retries every half second; a
//!   packet dropped after it left looks to the sender like one a network
//!   lost, so its TCP backs off exponentially (SYNs after 1, 2, 4 ... s,
//!   data from 200 ms doubling) as it would across a real partition. After
//!   the heal a link carries traffic again at the next retransmission, or
//!   sooner when the peer socket's `TCP_USER_TIMEOUT` or a peer's hello
//!   makes the node reconnect; the recovery times the tests print include
//!   whichever comes first.
//!
//! The test process needs root (`CAP_SYS_ADMIN` for the namespace,
//! `CAP_NET_ADMIN` for nftables), `nft` (nftables), `setpriv` (util-linux)
//! and `ip` (iproute2); `.ci/run` installs them. Without them a test fails
//! with a message saying what is missing; `TICKETD_SKIP_NETFAULTS=1` skips
//! these tests explicitly on machines where they cannot run.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::checker::{History, Outcome, RealClock, ReleaseOutcome};
use ticketd::client::{Acquire, Client, Release, Ticket};

use crate::process::Ticketd;

/// The port every node listens on for clients (each on its own address).
pub const CLIENT_PORT: u16 = 7470;
/// The port every node listens on for peers (each on its own address).
pub const PEER_PORT: u16 = 7001;
/// Group id of node 1; node `i` runs with `GID_BASE + i - 1`.
const GID_BASE: u32 = 64011;
/// Raft tick: elections after 0.5–1 s without a leader.
const TICK_MS: &str = "50";

/// True when the caller asked to skip network fault tests; prints why.
#[must_use]
pub fn skip_requested(test: &str) -> bool {
    let skip = std::env::var_os("TICKETD_SKIP_NETFAULTS").is_some_and(|v| v == "1");
    if skip {
        eprintln!("{test}: SKIPPED because TICKETD_SKIP_NETFAULTS=1");
    }
    skip
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| {
        panic!(
            "cannot run `{cmd}` ({e}); network fault tests need nftables, \
             util-linux and iproute2 (see .ci/run), or TICKETD_SKIP_NETFAULTS=1"
        )
    });
    assert!(
        out.status.success(),
        "`{cmd} {}` failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Moves the calling thread (and everything it starts later) into a new,
/// empty network namespace with its loopback up. Panics with what is
/// missing when that is not possible here.
pub fn enter_private_netns() {
    // SAFETY: unshare(2) with CLONE_NEWNET changes only this thread's
    // network namespace; no memory is involved.
    let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    assert_eq!(
        rc,
        0,
        "unshare(CLONE_NEWNET) failed: {}; network fault tests need root \
         (or set TICKETD_SKIP_NETFAULTS=1 to skip them)",
        std::io::Error::last_os_error()
    );
    run("ip", &["link", "set", "lo", "up"]);
}

/// The client address of node `i` (1-based).
#[must_use]
pub fn client_addr(i: usize) -> String {
    format!("127.0.0.{}:{CLIENT_PORT}", 10 + i)
}

fn peer_ip(i: usize) -> String {
    format!("127.0.0.{}", 10 + i)
}

/// An nftables table in the test's namespace; its rules drop node-to-node
/// messages. See the module documentation for how a link is identified.
///
/// Chain `out` (output hook) marks the packets of cut links with `MARK`;
/// chain `in` (input hook) drops every packet so marked.
pub struct Firewall {
    cuts: BTreeSet<(usize, usize)>,
}

const TABLE: &str = "ticketd_faults";
/// The packet mark of cut links.
const MARK: &str = "0x7d";

impl Firewall {
    /// Creates the table, the chain that drops marked packets and the
    /// (empty) chain that marks them, in one transaction.
    #[must_use]
    #[allow(clippy::new_without_default)] // acts on the system; no default value
    pub fn new() -> Firewall {
        nft_script(&format!(
            "add table inet {TABLE}\n\
             add chain inet {TABLE} out {{ type filter hook output priority 0; policy accept; }}\n\
             add chain inet {TABLE} in {{ type filter hook input priority 0; policy accept; }}\n\
             add rule inet {TABLE} in meta mark {MARK} drop\n"
        ));
        Firewall {
            cuts: BTreeSet::new(),
        }
    }

    /// Makes exactly `cuts` (as (from, to), 1-based) the links that drop
    /// their messages, replacing the previous set in one transaction, so no
    /// packet ever sees half of a change.
    pub fn set(&mut self, cuts: impl IntoIterator<Item = (usize, usize)>) {
        self.cuts = cuts.into_iter().collect();
        let mut script = format!("flush chain inet {TABLE} out\n");
        for &(from, to) in &self.cuts {
            let gid = GID_BASE + u32::try_from(from).unwrap() - 1;
            script.push_str(&format!(
                "add rule inet {TABLE} out meta skgid {gid} ip daddr {} tcp dport {PEER_PORT} \
                 meta mark set {MARK}\n",
                peer_ip(to)
            ));
        }
        nft_script(&script);
    }

    /// Also drops every message `from` sends to `to`, for each (from, to)
    /// of `links` (1-based), in one transaction.
    pub fn cut_all(&mut self, links: &[(usize, usize)]) {
        let cuts: Vec<_> = self.cuts.iter().chain(links).copied().collect();
        self.set(cuts);
    }

    /// The links that cut `node` off from every other node, both ways.
    #[must_use]
    pub fn isolation(node: usize, nodes: usize) -> Vec<(usize, usize)> {
        (1..=nodes)
            .filter(|&o| o != node)
            .flat_map(|o| [(node, o), (o, node)])
            .collect()
    }

    /// Also cuts `node` off from every other node, both ways.
    pub fn isolate(&mut self, node: usize, nodes: usize) {
        self.cut_all(&Firewall::isolation(node, nodes));
    }

    /// Removes every cut: all links carry traffic again.
    pub fn heal(&mut self) {
        self.set([]);
    }
}

/// Runs an nftables script (one atomic transaction).
fn nft_script(script: &str) {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run `nft` ({e}); network fault tests need nftables (see .ci/run), \
                 or TICKETD_SKIP_NETFAULTS=1"
            )
        });
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(script.as_bytes())
        .expect("write the nft script");
    let out = child.wait_with_output().expect("wait for nft");
    assert!(
        out.status.success(),
        "nft failed ({}) on:\n{script}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Drop for Firewall {
    fn drop(&mut self) {
        // The namespace takes the table with it anyway; this keeps a
        // panicking test from leaving rules behind while it unwinds.
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", TABLE])
            .output();
    }
}

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Three or more `ticketd --cluster` processes, node `i` on `127.0.0.1i`,
/// speaking peer TLS with certificates from `ticket certs init`
/// (`TICKETD_NETFAULTS_PLAINTEXT=1`: plaintext peers).
pub struct Cluster {
    /// The nodes, index 0 is node 1.
    pub nodes: Vec<Ticketd>,
    _dirs: Vec<Dir>,
}

impl Cluster {
    /// Starts `n` nodes named after `name` (for their data directories).
    #[must_use]
    pub fn start(name: &str, n: usize) -> Cluster {
        let peers: Vec<String> = (1..=n)
            .map(|i| format!("{i}={}:{PEER_PORT}", peer_ip(i)))
            .collect();
        let peers = peers.join(",");
        let mut dirs = Vec::new();
        let certs = std::env::temp_dir().join(format!(
            "ticketd-netfaults-{name}-{}-certs",
            std::process::id()
        ));
        let tls = std::env::var_os("TICKETD_NETFAULTS_PLAINTEXT").is_none_or(|v| v.is_empty());
        if tls {
            let _ = std::fs::remove_dir_all(&certs);
            let out = Command::new(crate::process::ticket_bin())
                .args(["certs", "init"])
                .arg(&certs)
                .args(["--cluster-name", name, "--nodes", &n.to_string()])
                .output()
                .expect("run ticket certs init");
            assert!(
                out.status.success(),
                "ticket certs init: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            dirs.push(Dir(certs.clone()));
        }
        let mut nodes = Vec::new();
        for i in 1..=n {
            let dir = std::env::temp_dir().join(format!(
                "ticketd-netfaults-{name}-{}-{i}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            let gid = format!("--regid={}", GID_BASE + u32::try_from(i).unwrap() - 1);
            let mut args = vec![
                "--cluster".to_owned(),
                "--id".to_owned(),
                i.to_string(),
                "--peers".to_owned(),
                peers.clone(),
                "--data-dir".to_owned(),
                dir.display().to_string(),
                "--listen".to_owned(),
                client_addr(i),
                "--tick-ms".to_owned(),
                TICK_MS.to_owned(),
                "--cluster-name".to_owned(),
                name.to_owned(),
            ];
            if tls {
                let file = |f: String| certs.join(f).display().to_string();
                args.extend([
                    "--peer-tls-cert".to_owned(),
                    file(format!("node{i}.pem")),
                    "--peer-tls-key".to_owned(),
                    file(format!("node{i}-key.pem")),
                    "--peer-tls-ca".to_owned(),
                    file("ca.pem".to_owned()),
                ]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            nodes.push(Ticketd::start_raw(
                &["setpriv", &gid, "--clear-groups"],
                &args,
            ));
            dirs.push(Dir(dir));
        }
        Cluster { nodes, _dirs: dirs }
    }

    /// The highest term each node says it became leader at, by its log.
    fn leader_terms(&self) -> Vec<Option<u64>> {
        self.nodes
            .iter()
            .map(|n| {
                n.log()
                    .lines()
                    .filter_map(|l| l.split("became leader at term ").nth(1))
                    .filter_map(|t| t.trim().parse::<u64>().ok())
                    .max()
            })
            .collect()
    }

    /// The node (1-based) that most recently became leader, and its term.
    #[must_use]
    pub fn leader(&self) -> Option<(usize, u64)> {
        self.leader_terms()
            .into_iter()
            .enumerate()
            .filter_map(|(i, t)| t.map(|t| (i + 1, t)))
            .max_by_key(|&(_, t)| t)
    }

    /// Waits up to `timeout` for a node to become leader at a term above
    /// `above`; returns it and its term.
    #[must_use]
    pub fn wait_leader_above(&self, above: u64, timeout: Duration) -> Option<(usize, u64)> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((i, t)) = self.leader() {
                if t > above {
                    return Some((i, t));
                }
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Every node's log, for failure messages.
    #[must_use]
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| format!("--- node {}\n{}", i + 1, n.log()))
            .collect()
    }

    /// Waits until every node has granted an acquire of its own (a leader
    /// is known everywhere); returns the tokens.
    #[must_use]
    pub fn warm_up(&self, timeout: Duration) -> Vec<u64> {
        let deadline = Instant::now() + timeout;
        (1..=self.nodes.len())
            .map(|i| {
                let c = client_for(i);
                loop {
                    let key = format!("warmup-{i}");
                    match c.acquire(&key, Duration::from_secs(1), Duration::from_secs(1)) {
                        Ok(Acquire::Acquired(t)) => {
                            let token = t.token();
                            assert_eq!(t.release().unwrap(), Release::Released);
                            break token;
                        }
                        Ok(_) if Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        other => panic!(
                            "node {i} granted nothing in {timeout:?}: {other:?}\n{}",
                            self.logs()
                        ),
                    }
                }
            })
            .collect()
    }
}

/// An official client talking to node `i` only.
#[must_use]
pub fn client_for(i: usize) -> Client {
    Client::builder()
        .address(client_addr(i))
        .pool_size(1)
        .connect_timeout(Duration::from_millis(500))
        .build()
        .expect("client configuration")
}

/// Keys the workers contend on; each worker takes them in turn and always
/// releases.
pub const KEYS: [&str; 2] = ["k0", "k1"];
/// Wait of every acquire.
pub const WAIT: Duration = Duration::from_secs(1);
/// Lease of every acquire.
pub const LEASE: Duration = Duration::from_secs(2);
/// How long a worker holds a grant (well inside the lease).
const HOLD: Duration = Duration::from_millis(30);
/// The key of the lessees: one more worker per node that walks away from
/// every `ABANDON_EVERY`th grant without releasing it, so leases also end
/// by the leader's committed Expire, across leader changes too. (A key
/// left held blocks its waiters for a lease; on a key of its own it does
/// not slow the others.)
pub const LEASED_KEY: &str = "leased";
/// See [`LEASED_KEY`].
const ABANDON_EVERY: usize = 3;

/// One acquire as a worker saw it, for the figures and timing assertions.
#[derive(Clone, Debug)]
pub struct Attempt {
    /// The node (1-based) the worker talks to.
    pub node: usize,
    /// When the acquire was invoked, in µs on the test's clock.
    pub invoked_us: u64,
    /// When it returned.
    pub done_us: u64,
    /// The token, when granted.
    pub token: Option<u64>,
    /// How it ended.
    pub outcome: Outcome,
}

/// Workers with official clients, each on one node, acquiring and
/// releasing the [`KEYS`] (and lessees on [`LEASED_KEY`]) until stopped; each records a [`History`], and
/// every acquire is also listed in a shared [`Attempt`] log the test can
/// watch while the load runs.
pub struct Load {
    stop: Arc<AtomicBool>,
    attempts: Arc<Mutex<Vec<Attempt>>>,
    handles: Vec<JoinHandle<Result<History, String>>>,
}

/// What the workers recorded.
pub struct Recorded {
    /// Every worker's history, merged.
    pub history: History,
    /// Every acquire, all workers.
    pub attempts: Vec<Attempt>,
}

impl Load {
    /// Starts `per_node` workers and one lessee on each of `nodes` nodes.
    #[must_use]
    pub fn start(clock: RealClock, nodes: usize, per_node: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let mut handles = Vec::new();
        for node in 1..=nodes {
            for w in 0..=per_node {
                let id = u64::try_from((node - 1) * (per_node + 1) + w).unwrap();
                let lessee = w == per_node;
                let (stop, attempts) = (Arc::clone(&stop), Arc::clone(&attempts));
                handles.push(std::thread::spawn(move || {
                    worker(clock, node, id, lessee, &stop, &attempts)
                }));
            }
        }
        Load {
            stop,
            attempts,
            handles,
        }
    }

    /// The acquires completed so far.
    #[must_use]
    pub fn attempts(&self) -> Vec<Attempt> {
        self.attempts.lock().unwrap().clone()
    }

    /// Waits up to `timeout` for a grant to a client of `node` for an
    /// acquire invoked at or after `from_us`; returns when it was received.
    #[must_use]
    pub fn wait_grant(&self, node: usize, from_us: u64, timeout: Duration) -> Option<u64> {
        let deadline = Instant::now() + timeout;
        loop {
            let first = self
                .attempts
                .lock()
                .unwrap()
                .iter()
                .filter(|a| a.node == node && a.token.is_some() && a.invoked_us >= from_us)
                .map(|a| a.done_us)
                .min();
            if first.is_some() || Instant::now() > deadline {
                return first;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops the workers and gathers what they recorded.
    pub fn finish(mut self) -> Result<Recorded, String> {
        self.stop.store(true, Ordering::SeqCst);
        let mut history = History::new();
        for h in std::mem::take(&mut self.handles) {
            history.merge(h.join().map_err(|_| "a worker panicked".to_owned())??);
        }
        Ok(Recorded {
            history,
            attempts: self.attempts(),
        })
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        // A failing test unwinds without `finish`: stop the workers anyway.
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn worker(
    clock: RealClock,
    node: usize,
    id: u64,
    lessee: bool,
    stop: &AtomicBool,
    attempts: &Mutex<Vec<Attempt>>,
) -> Result<History, String> {
    let client = client_for(node);
    let mut h = History::new();
    let wait_s = u8::try_from(WAIT.as_secs()).unwrap();
    let lease_s = u8::try_from(LEASE.as_secs()).unwrap();
    let mut n = usize::try_from(id).unwrap();
    let mut grants = 0usize;
    while !stop.load(Ordering::SeqCst) {
        let key = if lessee {
            LEASED_KEY
        } else {
            KEYS[n % KEYS.len()]
        };
        n += 1;
        let invoked_us = clock.now_us();
        // The owner on the wire is chosen by the client library; the
        // checker does not use it.
        let op = h.acquire(id, id, key, 0, wait_s, lease_s, invoked_us);
        let r = client
            .acquire(key, WAIT, LEASE)
            .map_err(|e| format!("node {node} worker {id}: acquire {key}: {e}"))?;
        let done_us = clock.now_us();
        let outcome = outcome_of(&r);
        h.acquired(op, outcome, done_us);
        attempts.lock().unwrap().push(Attempt {
            node,
            invoked_us,
            done_us,
            token: match outcome {
                Outcome::Granted { token } => Some(token),
                _ => None,
            },
            outcome,
        });
        match r {
            Acquire::Acquired(ticket) => {
                std::thread::sleep(HOLD.min(ticket.remaining()));
                grants += 1;
                if lessee && grants % ABANDON_EVERY == 0 {
                    // No release: the client's interval ends with its lease.
                    let _ = ticket.detach();
                    continue;
                }
                let rop = h.release(id, id, key, ticket.token(), clock.now_us());
                let released = ticket
                    .release()
                    .map_err(|e| format!("node {node} worker {id}: release {key}: {e}"))?;
                h.released(rop, release_outcome(released), clock.now_us());
            }
            // B comes at once while no leader is known: do not spin.
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    Ok(h)
}

/// One acquire by the test thread itself, recorded in `h` as client
/// `client`; returns the outcome and when it was received.
pub fn acquire_recorded(
    h: &mut History,
    clock: RealClock,
    client: u64,
    c: &Client,
    key: &str,
    wait: Duration,
    lease: Duration,
) -> (Acquire, u64) {
    let invoked_us = clock.now_us();
    let op = h.acquire(
        client,
        client,
        key,
        0,
        u8::try_from(wait.as_secs()).unwrap(),
        u8::try_from(lease.as_secs()).unwrap(),
        invoked_us,
    );
    let r = c.acquire(key, wait, lease).expect("valid acquire");
    let at_us = clock.now_us();
    let outcome = outcome_of(&r);
    h.acquired(op, outcome, at_us);
    (r, at_us)
}

/// Records a release of `ticket` by `client` in `h`.
pub fn release_recorded(h: &mut History, clock: RealClock, client: u64, ticket: Ticket) {
    let op = h.release(client, client, ticket.key(), ticket.token(), clock.now_us());
    let out = release_outcome(ticket.release().expect("valid release"));
    h.released(op, out, clock.now_us());
}

/// What the checker records for the client's answer to an acquire.
fn outcome_of(r: &Acquire) -> Outcome {
    match r {
        Acquire::Acquired(t) => Outcome::Granted { token: t.token() },
        Acquire::Timeout => Outcome::Timeout,
        Acquire::Busy => Outcome::Busy,
        Acquire::LimitMismatch(limit) => Outcome::LimitMismatch { limit: *limit },
        Acquire::Indeterminate => Outcome::Indeterminate,
    }
}

/// What the checker records for the client's answer to a release.
fn release_outcome(r: Release) -> ReleaseOutcome {
    match r {
        Release::Released => ReleaseOutcome::Released,
        Release::NotHeld => ReleaseOutcome::NotReleased,
        // Not sent: the client stopped using the lock at the release call
        // all the same; its lease ends it.
        Release::Indeterminate | Release::NotSent => ReleaseOutcome::Indeterminate,
    }
}

/// Counts of what each node's clients got in a time window.
#[must_use]
pub fn grants_by_node(
    attempts: &[Attempt],
    invoked_from_us: u64,
    done_before_us: u64,
) -> BTreeMap<usize, usize> {
    let mut m = BTreeMap::new();
    for a in attempts {
        if a.token.is_some() && a.invoked_us >= invoked_from_us && a.done_us < done_before_us {
            *m.entry(a.node).or_insert(0) += 1;
        }
    }
    m
}

/// What the clients of `node` got for acquires invoked in `[from_us,
/// to_us)`: counts by outcome, for the figures.
#[must_use]
pub fn outcomes(attempts: &[Attempt], node: usize, from_us: u64, to_us: u64) -> String {
    let mut m: BTreeMap<&str, usize> = BTreeMap::new();
    for a in attempts {
        if a.node == node && a.invoked_us >= from_us && a.invoked_us < to_us {
            let k = match a.outcome {
                Outcome::Granted { .. } | Outcome::LateGrant { .. } => "granted",
                Outcome::Timeout => "timeout",
                Outcome::Busy => "busy",
                Outcome::LimitMismatch { .. } => "limit mismatch",
                Outcome::Indeterminate => "indeterminate",
            };
            *m.entry(k).or_insert(0) += 1;
        }
    }
    format!("{m:?}")
}

/// Checks a history, printing the checker's report; panics with the
/// violation and the nodes' logs when it fails.
pub fn check_history(test: &str, history: &History, cluster: &Cluster) {
    match history.check() {
        Ok(report) => println!("{test}: history checker passed: {report}"),
        Err(v) => panic!(
            "{test}: history checker FAILED: {v}\n{} events recorded\n{}",
            history.events().len(),
            cluster.logs()
        ),
    }
}

/// Milliseconds between two µs timestamps, for printing.
#[must_use]
pub fn ms(from_us: u64, to_us: u64) -> u64 {
    to_us.saturating_sub(from_us) / 1000
}

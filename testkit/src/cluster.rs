//! A cluster of real `ticketd --cluster` processes on loopback, with extra
//! flags per node (peer TLS): started, killed and restarted one node at a
//! time, its leader read from the nodes' logs. The cluster process, peer
//! security and peer TLS tests all run their nodes with it.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::process::{free_port, Client, Reply, Ticketd};

/// A directory removed when dropped.
pub struct Dir(pub PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh temporary directory.
pub fn temp_dir(name: &str) -> Dir {
    let p = std::env::temp_dir().join(format!("ticketd-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    Dir(p)
}

/// A number no other cluster of this process has: the test modules of one
/// test binary share a process id, and may name their clusters alike.
fn next_cluster() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A cluster of `ticketd --cluster` processes, node i (1-based) at index
/// i - 1; the processes are killed when it is dropped.
pub struct Cluster {
    /// The cluster's name (`--cluster-name`).
    pub name: String,
    /// The `--peers` list every node gets.
    pub peers: String,
    /// Each node's data directory.
    pub dirs: Vec<Dir>,
    /// The running nodes (`None`: not started, or killed).
    pub nodes: Vec<Option<Ticketd>>,
    /// Extra flags of node i (index 0 is node 1).
    pub extra: Vec<Vec<String>>,
}

impl Cluster {
    /// `n` nodes, none started.
    pub fn new(name: &str, n: usize) -> Cluster {
        let peers: Vec<String> = (1..=n)
            .map(|i| format!("{i}=127.0.0.1:{}", free_port()))
            .collect();
        let seq = next_cluster();
        let dirs = (1..=n)
            .map(|i| {
                let p = std::env::temp_dir().join(format!(
                    "ticketd-cluster-{name}-{}-{seq}-{i}",
                    std::process::id()
                ));
                let _ = std::fs::remove_dir_all(&p);
                Dir(p)
            })
            .collect();
        Cluster {
            name: name.to_owned(),
            peers: peers.join(","),
            dirs,
            nodes: (0..n).map(|_| None).collect(),
            extra: vec![Vec::new(); n],
        }
    }

    /// `n` nodes, all started.
    pub fn start(name: &str, n: usize) -> Cluster {
        let mut c = Cluster::new(name, n);
        c.start_all();
        c
    }

    /// Starts every node.
    pub fn start_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.start_node(i);
        }
    }

    /// Node i's peer address.
    pub fn peer_addr(&self, i: usize) -> std::net::SocketAddr {
        self.peers
            .split(',')
            .nth(i)
            .unwrap()
            .split_once('=')
            .unwrap()
            .1
            .parse()
            .unwrap()
    }

    /// Node i's command line (without the binary).
    pub fn args(&self, i: usize) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--cluster".into(),
            "--id".into(),
            (i + 1).to_string(),
            "--peers".into(),
            self.peers.clone(),
            "--data-dir".into(),
            self.dirs[i].0.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--tick-ms".into(),
            "50".into(),
            "--cluster-name".into(),
            self.name.clone(),
        ];
        a.extend(self.extra[i].iter().cloned());
        a
    }

    /// Starts node i.
    pub fn start_node(&mut self, i: usize) {
        let args = self.args(i);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.nodes[i] = Some(Ticketd::start_raw(&[], &args));
    }

    /// Kills node i (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut t) = self.nodes[i].take() {
            t.signal(libc::SIGKILL);
            t.wait_exit(Duration::from_secs(10))
                .expect("killed node exits");
        }
    }

    /// Running node i.
    pub fn node(&self, i: usize) -> &Ticketd {
        self.nodes[i].as_ref().expect("node is running")
    }

    /// A new raw client connection to node i.
    pub fn client(&self, i: usize) -> Client {
        self.node(i).connect()
    }

    /// Every started node is still running.
    pub fn assert_all_running(&mut self) {
        let logs = self.logs();
        for (i, n) in self.nodes.iter_mut().enumerate() {
            if let Some(n) = n {
                assert!(
                    n.wait_exit(Duration::from_millis(1)).is_none(),
                    "node {} exited:\n{logs}",
                    i + 1
                );
            }
        }
    }

    /// The highest term any live node became leader at, and that node.
    pub fn leader_term(&self) -> Option<(u64, usize)> {
        let mut best = None;
        for (i, n) in self.nodes.iter().enumerate() {
            let Some(n) = n else { continue };
            let term = n
                .log()
                .lines()
                .filter_map(|l| l.split("became leader at term ").nth(1))
                .filter_map(|t| t.trim().parse::<u64>().ok())
                .max();
            if let Some(t) = term {
                if best.is_none_or(|(bt, _)| t > bt) {
                    best = Some((t, i));
                }
            }
        }
        best
    }

    /// The live node that most recently became leader, by its log.
    pub fn leader(&self) -> Option<usize> {
        self.leader_term().map(|(_, i)| i)
    }

    /// Waits (20 s at most) until a live node has become leader; that node.
    ///
    /// # Panics
    ///
    /// If none has by then, with every node's log.
    pub fn wait_leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Some(l) = self.leader() {
                return l;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("no leader elected:\n{}", self.logs());
    }

    /// Waits until every live node knows a leader: each grants and
    /// releases a key of its own. A node that knows none answers a release
    /// N at once (it never proposed it), so a test that releases through a
    /// node must first know that node has heard from the leader.
    ///
    /// # Panics
    ///
    /// If a node grants or releases nothing (20 s of Busy at most).
    pub fn wait_all_know_leader(&self) {
        for (i, n) in self.nodes.iter().enumerate() {
            let Some(n) = n else { continue };
            let mut c = n.connect();
            let key = format!("ready-{}", i + 1);
            let t = match acquire_retrying(&mut c, &key, 900 + i as u64, 30) {
                Some(Reply::Acquired { token, .. }) => token,
                other => panic!(
                    "node {} granted no {key}: {other:?}\n{}",
                    i + 1,
                    self.logs()
                ),
            };
            assert_eq!(
                c.release_reply(&key, t),
                Reply::Released { token: t, key },
                "node {} knows a leader",
                i + 1
            );
        }
    }

    /// Every node's log, for a failure message.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                n.as_ref()
                    .map(|n| format!("--- node {}\n{}", i + 1, n.log()))
            })
            .collect()
    }
}

/// Acquires with retries while the cluster answers Busy (no leader yet).
pub fn acquire_retrying(c: &mut Client, key: &str, owner: u64, lease_s: u8) -> Option<Reply> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        c.acquire(key, owner, 0, lease_s);
        match c.try_recv(Duration::from_secs(10)) {
            Ok(Reply::Busy { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Ok(Reply::Busy { .. }) => return None,
            Ok(r) => return Some(r),
            Err(_) => return None,
        }
    }
}

/// Acquires then releases `key` through node `i`: the cluster serves.
pub fn assert_serves(c: &Cluster, i: usize, key: &str) {
    let mut cl = c.client(i);
    match acquire_retrying(&mut cl, key, 7, 30) {
        Some(Reply::Acquired { token, .. }) => {
            assert!(matches!(
                cl.release_reply(key, token),
                Reply::Released { .. }
            ));
        }
        other => panic!(
            "node {} did not grant {key}: {other:?}\n{}",
            i + 1,
            c.logs()
        ),
    }
}

/// Runs `ticket certs init DIR --cluster-name NAME --nodes N`.
pub fn certs_init(dir: &std::path::Path, name: &str, nodes: usize) {
    let out = std::process::Command::new(crate::process::ticket_bin())
        .args(["certs", "init"])
        .arg(dir)
        .args(["--cluster-name", name, "--nodes", &nodes.to_string()])
        .output()
        .expect("run ticket certs init");
    assert!(
        out.status.success(),
        "ticket certs init: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The peer TLS flags of node `id` with the files `ticket certs init` wrote
/// in `dir`.
pub fn tls_args(dir: &std::path::Path, id: usize) -> Vec<String> {
    vec![
        "--peer-tls-cert".into(),
        dir.join(format!("node{id}.pem")).display().to_string(),
        "--peer-tls-key".into(),
        dir.join(format!("node{id}-key.pem")).display().to_string(),
        "--peer-tls-ca".into(),
        dir.join("ca.pem").display().to_string(),
    ]
}

impl Cluster {
    /// Every node with the files of `dir` (as `ticket certs init` names them).
    pub fn use_tls(&mut self, dir: &std::path::Path) {
        for i in 0..self.nodes.len() {
            self.extra[i] = tls_args(dir, i + 1);
        }
    }
}

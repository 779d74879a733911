//! `cluster-bench`'s command line: what to run, how many lockers, for how
//! long; a bad flag exits 2 with the usage line.

use std::path::PathBuf;

/// The load generator's limit on connections.
const MAX_CLIENTS: usize = 10_000;

/// What a bad command line prints.
const USAGE: &str = "usage: cluster-bench [--clients N] [--seconds N] [--rounds N] [--etcd] \
                     [--etcd-native DRIVER] [--no-single] [--no-cluster-limit] [--no-spread-limit] \
                     [--no-peer-tls] [--no-extend] [--depth N]";

/// A positive number flag, or exit 2 with a clear message.
fn number(args: &mut pico_args::Arguments, flag: &'static str, default: u64) -> u64 {
    match args.opt_value_from_str::<_, u64>(flag) {
        Ok(Some(0)) => {
            eprintln!("cluster-bench: {flag} must be at least 1\n{USAGE}");
            std::process::exit(2);
        }
        Ok(v) => v.unwrap_or(default),
        Err(e) => {
            eprintln!("cluster-bench: {e}\n{USAGE}");
            std::process::exit(2);
        }
    }
}

/// Prints `message` and the usage line, and exits 2.
fn fail(message: &str) -> ! {
    eprintln!("cluster-bench: {message}\n{USAGE}");
    std::process::exit(2);
}

/// What to run, read from the command line and the environment.
pub(crate) struct Options {
    /// Lockers (`--clients`).
    pub(crate) clients: usize,
    /// Measured seconds per run (`--seconds`).
    pub(crate) seconds: u64,
    /// Rounds of every system (`--rounds`).
    pub(crate) rounds: usize,
    /// Requests in flight per locker in the extra cluster row (`--depth`;
    /// 1 leaves the row out).
    pub(crate) depth: usize,
    /// Drive etcd through its JSON gateway (`--etcd`).
    pub(crate) etcd: bool,
    /// etcd's own gRPC client driver (`--etcd-native`).
    pub(crate) native: Option<PathBuf>,
    /// Run single-mode ticketd (not `--no-single`).
    pub(crate) single: bool,
    /// The cluster limit's server, unless `--no-cluster-limit`.
    pub(crate) limit: Option<PathBuf>,
    /// Run the cluster limit a second time with the lockers spread (not
    /// `--no-spread-limit`).
    pub(crate) spread_limit: bool,
    /// Run the cluster with peer TLS too (not `--no-peer-tls`).
    pub(crate) peer_tls: bool,
    /// Measure lease renewal after the plaintext cluster's cycles (not
    /// `--no-extend`).
    pub(crate) extend: bool,
    /// The ticketd binary: `$CB_BIN`, or the release build.
    pub(crate) bin: PathBuf,
}

impl Options {
    /// Reads the command line; exits 2 on a bad flag or a missing binary.
    pub(crate) fn from_env() -> Options {
        let mut args = pico_args::Arguments::from_env();
        let clients = number(&mut args, "--clients", 50) as usize;
        if clients > MAX_CLIENTS {
            fail(&format!("--clients must be at most {MAX_CLIENTS}"));
        }
        let seconds = number(&mut args, "--seconds", 10);
        let rounds = number(&mut args, "--rounds", 1) as usize;
        // The extra cluster row with several requests in flight per locker
        // (group commit at work); 1 leaves it out.
        let depth = number(&mut args, "--depth", 4) as usize;
        if depth > 256 {
            fail("--depth must be at most 256");
        }
        let etcd = args.contains("--etcd");
        let native = native_driver(&mut args);
        let single = !args.contains("--no-single");
        let no_limit = args.contains("--no-cluster-limit");
        let spread_limit = !args.contains("--no-spread-limit");
        let peer_tls = !args.contains("--no-peer-tls");
        let extend = !args.contains("--no-extend");
        let rest = args.finish();
        if !rest.is_empty() {
            fail(&format!("unexpected {rest:?}"));
        }
        let limit = if no_limit { None } else { Some(limit_server()) };
        let bin = PathBuf::from(std::env::var("CB_BIN").unwrap_or("target/release/ticketd".into()));
        Options {
            clients,
            seconds,
            rounds,
            depth,
            etcd,
            native,
            single,
            limit,
            spread_limit,
            peer_tls,
            extend,
            bin,
        }
    }
}

/// `--etcd-native DRIVER`: the driver's path, which must be a file.
fn native_driver(args: &mut pico_args::Arguments) -> Option<PathBuf> {
    let native: Option<PathBuf> = match args.opt_value_from_str("--etcd-native") {
        Ok(v) => v,
        Err(e) => fail(&e.to_string()),
    };
    if let Some(d) = &native {
        if !d.is_file() {
            eprintln!(
                "cluster-bench: --etcd-native {}: no such file (build it with \
                 cargo build --release --manifest-path bench/etcd-native/Cargo.toml)",
                d.display()
            );
            std::process::exit(2);
        }
    }
    native
}

/// The cluster limit's server: `$CB_LIMIT`, or the one built next to
/// this program; exits 2 when there is none.
fn limit_server() -> PathBuf {
    let p = std::env::var_os("CB_LIMIT").map(PathBuf::from).or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|d| d.join("cluster-limit-server")))
    });
    match p {
        Some(p) if p.is_file() => p,
        p => {
            eprintln!(
                "cluster-bench: no cluster limit server at {} (cargo build --release \
                 --bin cluster-limit-server, or set CB_LIMIT, or pass \
                 --no-cluster-limit)",
                p.map_or("?".into(), |p| p.display().to_string())
            );
            std::process::exit(2);
        }
    }
}

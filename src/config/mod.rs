//! Server configuration: every knob of the single-mode daemon with its
//! default, and the command-line parser (`pico-args`) that fills it.
//!
//! [`Config`] is plain data, usable without the command line: an embedding
//! program or a test starts from [`Config::default`] and changes fields.
//! [`parse_args`] is what the `ticketd` binary runs; [`Config::take_flags`]
//! parses the server's flags out of a [`pico_args::Arguments`] and leaves the
//! rest, so a mode with flags of its own can parse them from the same list.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use log::LevelFilter;

use crate::limits::{self, EngineLimits};

// The value parsers the quota flags share with the others.
use args::{count, flag, seconds, Why};

mod args;
mod checks;
mod error;
mod help;
mod quota;
#[cfg(test)]
mod tests;

pub use args::{parse_args, reject_leftovers};
pub use error::ConfigError;
pub use help::HELP;
pub use quota::{
    DEFAULT_HANDSHAKE_TIMEOUT_S, DEFAULT_MAX_CONNS_PER_IDENTITY,
    DEFAULT_MAX_HANDSHAKES_PER_IDENTITY, MIN_MAX_MEMORY,
};

/// Default for `--listen`.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7470";
/// The address the docs suggest for `--admin-listen`, and the default of
/// `ticket --admin`.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:7471";
/// Where the admin port listens (`--admin-listen`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdminListen {
    /// A TCP address; port 0 picks a free port.
    Tcp(SocketAddr),
    /// A Unix-domain socket file, made with `--socket-mode` and checked
    /// against `--allow-uid` / `--allow-gid` like the client sockets.
    Unix(PathBuf),
}

impl fmt::Display for AdminListen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdminListen::Tcp(a) => write!(f, "{a}"),
            AdminListen::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Default for `--max-conns`.
pub const DEFAULT_MAX_CONNS: usize = 10_000;
/// Ceiling for `--max-conns`: connection slots are numbered below it, and mio
/// tokens above it belong to the service (see [`crate::server::SERVICE_TOKEN_BASE`]).
pub const MAX_CONNS_CEILING: usize = 1 << 20;
/// Default for `--max-frames-per-turn`: requests handled per connection per
/// loop turn before the loop moves on to the other connections (fairness).
pub const DEFAULT_MAX_FRAMES_PER_TURN: usize = 128;
/// Default for `--out-soft-limit`: unsent reply bytes of one connection at
/// which the server stops reading that connection until they drain.
pub const DEFAULT_OUT_SOFT_LIMIT_BYTES: usize = 64 * 1024;
/// Default for `--out-hard-limit`: unsent reply bytes of one connection at
/// which the server closes it.
pub const DEFAULT_OUT_HARD_LIMIT_BYTES: usize = 4 * 1024 * 1024;
/// Default for `--frame-timeout`: seconds a half-received request frame, or
/// unsent replies that make no progress, may sit before the connection is closed.
pub const DEFAULT_FRAME_TIMEOUT_S: u64 = 30;
/// Default bound on flushing replies before a close (malformed input, shutdown).
pub const DEFAULT_FLUSH_TIMEOUT_MS: u64 = 1000;
/// Default permissions of a Unix socket file (`--socket-mode`).
pub const DEFAULT_SOCKET_MODE: u32 = 0o660;
/// Most Unix sockets one server listens on.
pub const MAX_UNIX_LISTENERS: usize = 8;

/// Default `listen(2)` backlog.
pub const DEFAULT_BACKLOG: u32 = 1024;

/// Default for `--max-lease`: the protocol's own longest lease, in seconds.
pub const DEFAULT_MAX_LEASE_S: u8 = u8::MAX;

/// `--restart-grace`: what a start does about leases an earlier run of
/// the server may have granted and that may still run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartGrace {
    /// With a data directory, hold every key until the durable lease
    /// bound of the earlier run has passed (nothing without one).
    Auto,
    /// Grant at once after a restart, whatever may still be held.
    Off,
}

/// Everything the server and the single-mode service need to start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Address to listen on; port 0 picks a free port.
    pub listen: SocketAddr,
    /// Listen on `listen` (TCP); false when `--listen` names only Unix
    /// sockets.
    pub listen_tcp: bool,
    /// Unix-domain sockets to listen on (`--listen unix:/path`).
    pub unix_listen: Vec<PathBuf>,
    /// Permissions of the Unix socket files (`--socket-mode`, octal).
    pub socket_mode: u32,
    /// With either list non-empty, a Unix-socket peer must have one of
    /// these user ids or group ids (`SO_PEERCRED`).
    pub allow_uids: Vec<u32>,
    /// See `allow_uids`.
    pub allow_gids: Vec<u32>,
    /// Open client connections; one more is accepted and closed at once.
    pub max_conns: usize,
    /// The lock engine's capacity limits and sweep interval.
    pub engine: EngineLimits,
    /// The longest key in bytes (PROTOCOL §1).
    pub max_key_bytes: usize,
    /// Fairness: requests handled per connection per loop turn.
    pub max_frames_per_turn: usize,
    /// Unsent reply bytes at which a connection is no longer read (backpressure).
    pub out_soft_limit_bytes: usize,
    /// Unsent reply bytes at which a connection is closed.
    pub out_hard_limit_bytes: usize,
    /// Half-received frame / stalled output timeout; `None` disables it.
    pub frame_timeout: Option<Duration>,
    /// How long replies may take to flush before a close (malformed input,
    /// shutdown).
    pub flush_timeout: Duration,
    /// `listen(2)` backlog.
    pub backlog: u32,
    /// Where the token high-water mark and the durable lease bound are
    /// kept; `None` seeds tokens from the wall clock instead (and there is
    /// no restart grace).
    pub data_dir: Option<PathBuf>,
    /// Whether a restart holds every key until the earlier run's leases
    /// have ended (with a data directory).
    pub restart_grace: RestartGrace,
    /// The longest lease an acquire may ask for, 1..=255 s; longer is
    /// answered Busy. Also the longest restart grace.
    pub max_lease_s: u8,
    /// Log verbosity.
    pub log_level: LevelFilter,
    /// Serve plaintext on an address that is not loopback (`--insecure`);
    /// without it, such a `listen` is refused (protected mode). It also
    /// lets a data directory its group or other users may write to be
    /// used (with a warning) instead of refused.
    pub insecure: bool,
    /// TLS on the TCP client listener (`--tls-cert`, `--tls-key`,
    /// `--tls-client-ca`); plaintext when `None`.
    pub tls: Option<TlsFiles>,
    /// TLS on a TCP admin port (`--admin-tls-cert`, `--admin-tls-key`,
    /// `--admin-tls-client-ca`); plaintext when `None`.
    pub admin_tls: Option<TlsFiles>,
    /// The admin port (HTTP: health, metrics, lock introspection), off
    /// when `None`; [`DEFAULT_ADMIN_LISTEN`] is the suggested address.
    pub admin_listen: Option<AdminListen>,
    /// A listening socket passed by systemd (socket activation: descriptor
    /// 3 when `$LISTEN_FDS` is set for this process), used instead of
    /// binding `listen`. [`crate::server::Server::bind`] takes ownership.
    pub listen_fd: Option<std::os::fd::RawFd>,
    /// `--admin-identity`: an identity (`cert:NAME`, `uid:N`) that may
    /// release and extend any grant whose token it gives, and that reads
    /// full tokens on the admin port.
    pub admin_identity: Option<crate::server::identity::Identity>,
    /// Open client connections of one identity (`--max-conns-per-identity`);
    /// one more is accepted and closed at once.
    pub max_conns_per_identity: usize,
    /// TLS handshakes under way from one source address
    /// (`--max-handshakes-per-identity`); one more connection is closed at
    /// once.
    pub max_handshakes_per_identity: usize,
    /// How long a TLS handshake may take from the accept
    /// (`--handshake-timeout`; [`Config::handshake_limit`]).
    pub handshake_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: DEFAULT_LISTEN.parse().expect("default address parses"),
            listen_tcp: true,
            unix_listen: Vec::new(),
            socket_mode: DEFAULT_SOCKET_MODE,
            allow_uids: Vec::new(),
            allow_gids: Vec::new(),
            max_conns: DEFAULT_MAX_CONNS,
            engine: EngineLimits::default(),
            max_key_bytes: limits::DEFAULT_MAX_KEY_BYTES,
            max_frames_per_turn: DEFAULT_MAX_FRAMES_PER_TURN,
            out_soft_limit_bytes: DEFAULT_OUT_SOFT_LIMIT_BYTES,
            out_hard_limit_bytes: DEFAULT_OUT_HARD_LIMIT_BYTES,
            frame_timeout: Some(Duration::from_secs(DEFAULT_FRAME_TIMEOUT_S)),
            flush_timeout: Duration::from_millis(DEFAULT_FLUSH_TIMEOUT_MS),
            backlog: DEFAULT_BACKLOG,
            data_dir: None,
            restart_grace: RestartGrace::Auto,
            max_lease_s: DEFAULT_MAX_LEASE_S,
            log_level: LevelFilter::Info,
            insecure: false,
            tls: None,
            admin_tls: None,
            admin_listen: None,
            listen_fd: None,
            admin_identity: None,
            max_conns_per_identity: DEFAULT_MAX_CONNS_PER_IDENTITY,
            max_handshakes_per_identity: DEFAULT_MAX_HANDSHAKES_PER_IDENTITY,
            handshake_timeout: Duration::from_secs(DEFAULT_HANDSHAKE_TIMEOUT_S),
        }
    }
}

/// The PEM files of TLS on the client port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain (`--tls-cert`).
    pub cert: PathBuf,
    /// Its private key (`--tls-key`).
    pub key: PathBuf,
    /// With it, every client must present a certificate chaining to these
    /// CA certificates (`--tls-client-ca`).
    pub client_ca: Option<PathBuf>,
}

/// What the command line asks for.
// Made once per start and matched at once: boxing the config would buy
// nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// Start the server with this configuration.
    Run(Config),
    /// `--help`: print [`HELP`] and exit 0.
    Help,
    /// `--version`: print the version and exit 0.
    Version,
}

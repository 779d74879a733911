//! Server configuration: every knob of the single-mode daemon with its
//! default, and the command-line parser (`pico-args`) that fills it.
//!
//! [`Config`] is plain data, usable without the command line: an embedding
//! program or a test starts from [`Config::default`] and changes fields.
//! [`parse_args`] is what the `ticketd` binary runs; [`Config::take_flags`]
//! parses the server's flags out of a [`pico_args::Arguments`] and leaves the
//! rest, so a mode with flags of its own can parse them from the same list.

use std::borrow::Cow;
use std::ffi::OsString;
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use log::LevelFilter;

use crate::limits::{self, EngineLimits};

mod quota;

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

/// A command-line or configuration error: which flag, the value given and
/// why it is refused. Its `Display` is the message for a person.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A flag's value does not parse: `invalid value 'VALUE' for FLAG: WHY`.
    Value {
        /// The flag, like `--max-conns`.
        flag: &'static str,
        /// The value as given.
        value: String,
        /// What was expected instead.
        why: String,
    },
    /// A flag is given without its value.
    NoValue {
        /// The flag.
        flag: &'static str,
    },
    /// A flag that takes one value is given twice.
    Repeated {
        /// The flag.
        flag: &'static str,
    },
    /// An argument no parser took (a misspelt flag, `--flag=value`).
    Unknown {
        /// The argument as given.
        arg: String,
    },
    /// Values that parse but are out of range, do not go together, or are
    /// refused by protected mode; the message names the flags.
    Invalid(String),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Value { flag, value, why } => {
                write!(f, "invalid value '{value}' for {flag}: {why}")
            }
            ConfigError::NoValue { flag } => write!(f, "{flag} needs a value"),
            ConfigError::Repeated { flag } => write!(f, "{flag} is given more than once"),
            ConfigError::Unknown { arg } => {
                write!(f, "unknown argument '{arg}'")?;
                // `--flag=value` is not accepted: say how to write it.
                match arg.split_once('=') {
                    Some((name, value)) if name.starts_with("--") => {
                        write!(f, " (write the value after a space: {name} {value})")
                    }
                    _ => Ok(()),
                }
            }
            ConfigError::Invalid(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for ConfigError {}

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

/// The text `ticketd --help` prints.
pub const HELP: &str = "\
ticketd: a lock server with FIFO queues, bounded waits, leases and fencing tokens

USAGE:
    ticketd [FLAGS]
    ticketd --cluster --id N --peers 1=HOST:PORT,... --data-dir DIR [FLAGS]
                               cluster mode; `ticketd --cluster --help` for its flags
    ticketd --cluster ... --peer-tls-cert FILE --peer-tls-key FILE --peer-tls-ca FILE
                               peers speak mutual TLS (certificates: `ticket certs
                               init DIR`); --cluster-name NAME [ticketd] is part of
                               each node's certificate name; --insecure-peers allows
                               plaintext peers off loopback (docs/SECURITY.md)

FLAGS (defaults in brackets):
    --listen ADDR              address to listen on; port 0 picks a free port [127.0.0.1:7470].
                               An address that is not loopback is refused (protected
                               mode: exit 2) unless TLS (--tls-cert) or --insecure
                               is given
                               `--listen unix:/PATH` listens on a Unix socket; --listen
                               may be given several times (one TCP address at most)
    --insecure                 serve plaintext on an address that is not loopback:
                               anyone who reaches it can take and hold any lock.
                               Also uses a --data-dir its group or other users
                               may write to (refused otherwise, exit 1), with a
                               warning
    --tls-cert FILE            TLS (1.3 and 1.2) on the TCP listener with this
                               certificate chain (PEM); needs --tls-key
    --tls-key FILE             the certificate's private key (PEM)
    --tls-client-ca FILE       every client must present a certificate chaining to
                               this CA (PEM). With it, a listener that is not
                               loopback needs no --insecure
    --socket-mode OCTAL        permissions of Unix socket files (client and admin) [0660]
    --allow-uid N              only peers of this user id may use the Unix sockets,
                               the admin one included (SO_PEERCRED; repeatable;
                               with --allow-gid: either)
    --allow-gid N              only peers of this group id (repeatable)
    --max-conns N              open client connections [10000]
    --max-keys N               registered keys [1000000]
    --max-waiters N            queued acquires over all keys [100000]
    --max-waiters-per-key N    queued acquires on one key [1000]
    --max-key-bytes N          longest key in bytes, 1..=65536 [1024]
    --max-keys-per-identity N  keys one client identity may hold (ip:ADDR, uid:N,
                               cert:NAME; docs/SECURITY.md); more get B [500000]
    --max-waiters-per-identity N
                               acquires one identity may have queued [50000]
    --max-conns-per-identity N open connections of one identity; more are
                               accepted and closed at once [5000]
    --max-handshakes-per-identity N
                               TLS handshakes under way from one address [64]
    --handshake-timeout SECS   close a connection whose TLS handshake is not done
                               this long after the accept, or after
                               --frame-timeout if shorter [10]
    --max-memory BYTES         memory budget (suffix K, M or G) for keys, waiters
                               and connection buffers; past it new keys and
                               waiters get B, and connections are refused once
                               their buffers alone fill it [256M]
    --sweep-interval SECS      seconds between sweeps of expired keys [5]
    --max-hold SECS            single mode: longest a grant may be held, extensions
                               included; an extend past it gets X [0: no cap]
    --max-frames-per-turn N    requests handled per connection per loop turn [128]
    --out-soft-limit BYTES     unsent replies at which a connection is not read
                               [65536, or one reply with the longest key if more]
    --out-hard-limit BYTES     unsent replies at which a connection is closed
                               [4194304, or the soft limit plus one reply if more]
    --frame-timeout SECS       close a connection whose half-sent frame or unread
                               replies make no progress for this long; 0 = never [30]
    --data-dir DIR             keep the token high-water mark and the lease bound
                               in DIR, so tokens keep increasing across restarts and
                               a restart can wait for earlier leases [none: seed
                               tokens from the wall clock]
    --restart-grace auto|off   auto: with --data-dir, a restart holds every key
                               (acquires get T or queue, releases N) until every
                               lease the earlier run granted has ended; off: grant
                               at once. Without --data-dir there is nothing to
                               remember and no grace [auto]
    --max-lease SECS           longest lease an acquire or extend may ask for,
                               1..=255; a longer acquire is answered B, a longer
                               extend X. Also bounds the restart grace [255]
    --log-level LEVEL          off, error, warn, info, debug or trace [info]
    --admin-identity ID        cert:NAME (a client certificate's name) or uid:N (a
                               Unix-socket peer): may release or extend any grant
                               whose token it gives, and reads full tokens on the
                               admin port [none]
    --admin-listen ADDR        serve HTTP on ADDR: /livez, /readyz, /metrics
                               (Prometheus), /v1/locks, /v1/cluster; suggested
                               127.0.0.1:7471 (docs/OPERATIONS.md); `unix:/PATH`
                               serves it on a Unix socket (--socket-mode,
                               --allow-uid and --allow-gid apply to it) [off]
    --admin-tls-cert FILE      HTTPS (TLS 1.3 and 1.2) on a TCP admin port with this
                               certificate chain (PEM); needs --admin-tls-key
    --admin-tls-key FILE       its private key (PEM)
    --admin-tls-client-ca FILE every admin client (a scraper, `ticket`) must present
                               a certificate chaining to this CA (PEM)
    -h, --help                 print this help and exit
    -V, --version              print the version and exit

EXIT STATUS:
    0 stopped by SIGTERM or SIGINT, 1 could not start or failed, 2 bad command line
";

/// Parses a full command line (without the program name).
///
/// # Errors
/// A message naming the flag for an unknown flag, a missing value or a bad one.
pub fn parse_args(args: Vec<OsString>) -> Result<Parsed, ConfigError> {
    let mut args = pico_args::Arguments::from_vec(args);
    if args.contains(["-h", "--help"]) {
        return Ok(Parsed::Help);
    }
    if args.contains(["-V", "--version"]) {
        return Ok(Parsed::Version);
    }
    let config = Config::take_flags(&mut args)?;
    reject_leftovers(args)?;
    Ok(Parsed::Run(config))
}

/// Fails on whatever [`Config::take_flags`] (and any other parser) left over.
///
/// # Errors
/// "unknown argument" naming the first leftover.
pub fn reject_leftovers(args: pico_args::Arguments) -> Result<(), ConfigError> {
    match args.finish().first() {
        None => Ok(()),
        Some(a) => Err(ConfigError::Unknown {
            arg: a.to_string_lossy().into_owned(),
        }),
    }
}

/// Why a flag's value is refused, for [`ConfigError::Value`].
type Why = Cow<'static, str>;

fn flag<T>(
    args: &mut pico_args::Arguments,
    name: &'static str,
    parse: fn(&str) -> Result<T, Why>,
) -> Result<Option<T>, ConfigError> {
    let value = args.opt_value_from_fn(name, parse).map_err(|e| match e {
        pico_args::Error::Utf8ArgumentParsingFailed { value, cause } => ConfigError::Value {
            flag: name,
            value,
            why: cause,
        },
        pico_args::Error::OptionWithoutAValue(_) => ConfigError::NoValue { flag: name },
        other => ConfigError::Invalid(format!("{name}: {other}")),
    })?;
    // A second occurrence would otherwise be left over and reported as an
    // unknown argument, or silently lose to the first.
    if value.is_some() && !matches!(args.opt_value_from_str::<_, String>(name), Ok(None)) {
        return Err(ConfigError::Repeated { flag: name });
    }
    Ok(value)
}

fn count(s: &str) -> Result<usize, Why> {
    let n: usize = s.parse().map_err(|_| "expected a whole number")?;
    if n == 0 {
        return Err("must be at least 1".into());
    }
    Ok(n)
}

fn seconds(s: &str) -> Result<u64, Why> {
    s.parse()
        .map_err(|_| "expected a whole number of seconds".into())
}

fn address(s: &str) -> Result<SocketAddr, Why> {
    s.to_socket_addrs()
        .map_err(|e| format!("expected HOST:PORT ({e})"))?
        .next()
        .ok_or_else(|| "the name resolves to no address".into())
}

fn admin_listen(s: &str) -> Result<AdminListen, Why> {
    match s.strip_prefix("unix:") {
        Some("") => Err("unix: needs a path".into()),
        Some(path) => Ok(AdminListen::Unix(PathBuf::from(path))),
        None => address(s)
            .map(AdminListen::Tcp)
            .map_err(|e| format!("{e}, or unix:/PATH").into()),
    }
}

fn directory(s: &str) -> Result<PathBuf, Why> {
    if s.is_empty() {
        return Err("expected a directory".into());
    }
    Ok(PathBuf::from(s))
}

fn grace(s: &str) -> Result<RestartGrace, Why> {
    match s {
        "auto" => Ok(RestartGrace::Auto),
        "off" => Ok(RestartGrace::Off),
        _ => Err("expected auto or off".into()),
    }
}

fn file(s: &str) -> Result<PathBuf, Why> {
    if s.is_empty() {
        return Err("needs a file name".into());
    }
    Ok(PathBuf::from(s))
}

fn octal_mode(s: &str) -> Result<u32, Why> {
    match u32::from_str_radix(s.trim_start_matches("0o"), 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err("expected permissions in octal, 0..=777 (like 0660)".into()),
    }
}

fn lease_seconds(s: &str) -> Result<u8, Why> {
    match s.parse::<u8>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err("expected a whole number of seconds, 1..=255".into()),
    }
}

fn admin_identity(s: &str) -> Result<crate::server::identity::Identity, Why> {
    let id = crate::server::identity::Identity::parse(s)?;
    if !id.authenticated() {
        return Err(
            "must be an authenticated identity (cert:NAME or uid:N): an \
                    address proves nothing"
                .into(),
        );
    }
    Ok(id)
}

fn level(s: &str) -> Result<LevelFilter, Why> {
    s.parse()
        .map_err(|_| "expected off, error, warn, info, debug or trace".into())
}

impl Config {
    /// Takes the server's flags out of `args`, leaving any other argument in
    /// place, and checks the values against each other.
    ///
    /// # Errors
    /// A message naming the flag with a bad or missing value.
    pub fn take_flags(args: &mut pico_args::Arguments) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        take_listeners(args, &mut c)?;
        take_limits(args, &mut c)?;
        quota::take_quotas(args, &mut c)?;
        if let Some(v) = flag(args, "--data-dir", directory)? {
            c.data_dir = Some(v);
        }
        if let Some(v) = flag(args, "--restart-grace", grace)? {
            c.restart_grace = v;
        }
        if let Some(v) = flag(args, "--max-lease", lease_seconds)? {
            c.max_lease_s = v;
        }
        if let Some(v) = flag(args, "--log-level", level)? {
            c.log_level = v;
        }
        c.insecure = args.contains("--insecure");
        c.tls = tls_files(args, ["--tls-cert", "--tls-key", "--tls-client-ca"])?;
        c.admin_tls = tls_files(
            args,
            [
                "--admin-tls-cert",
                "--admin-tls-key",
                "--admin-tls-client-ca",
            ],
        )?;
        if let Some(v) = flag(args, "--admin-listen", admin_listen)? {
            c.admin_listen = Some(v);
        }
        if let Some(v) = flag(args, "--admin-identity", admin_identity)? {
            c.admin_identity = Some(v);
        }
        c.listen_fd = crate::server::systemd::listen_fd();
        c.validate()?;
        Ok(c)
    }

    /// Checks the values against their ranges and against each other.
    ///
    /// # Errors
    /// A message naming the offending flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |m: String| Err(ConfigError::Invalid(m));
        if self.max_conns == 0 || self.max_conns > MAX_CONNS_CEILING {
            return fail(format!("--max-conns must be 1..={MAX_CONNS_CEILING}"));
        }
        if self.max_key_bytes == 0 || self.max_key_bytes > limits::MAX_KEY_BYTES_CEILING {
            return fail(format!(
                "--max-key-bytes must be 1..={}",
                limits::MAX_KEY_BYTES_CEILING
            ));
        }
        if self.engine.sweep_interval_ms == 0 {
            return fail("--sweep-interval must be at least 1 second".into());
        }
        if self.engine.max_keys == 0
            || self.engine.max_waiters == 0
            || self.engine.max_waiters_per_key == 0
        {
            return fail(
                "--max-keys, --max-waiters and --max-waiters-per-key must be at least 1".into(),
            );
        }
        if self.max_lease_s == 0 {
            return fail("--max-lease must be 1..=255 seconds".into());
        }
        if self.max_frames_per_turn == 0 {
            return fail("--max-frames-per-turn must be at least 1".into());
        }
        self.validate_listeners()?;
        self.validate_quotas()?;
        let one_reply = limits::max_reply_frame(self.max_key_bytes);
        if self.out_soft_limit_bytes < one_reply {
            return fail(format!(
                "--out-soft-limit must hold at least one reply ({one_reply} bytes with --max-key-bytes {})",
                self.max_key_bytes
            ));
        }
        if self.out_hard_limit_bytes < self.out_soft_limit_bytes.saturating_add(one_reply) {
            return fail(format!(
                "--out-hard-limit must exceed --out-soft-limit by at least one reply ({one_reply} bytes)"
            ));
        }
        Ok(())
    }

    /// The listeners' checks: TLS where it applies, protected mode, the
    /// Unix sockets and who may use them.
    fn validate_listeners(&self) -> Result<(), ConfigError> {
        let fail = |m: String| Err(ConfigError::Invalid(m));
        if self.tls.is_some() && !cfg!(feature = "tls") {
            return fail(
                "--tls-cert: this ticketd was built without TLS (the `tls` feature)".into(),
            );
        }
        if self.tls.is_some() && !self.listen_tcp {
            return fail(
                "--tls-cert applies to the TCP listener: give --listen HOST:PORT (Unix \
                 sockets are guarded by their file mode and --allow-uid instead)"
                    .into(),
            );
        }
        if self.admin_tls.is_some() && !cfg!(feature = "tls") {
            return fail(
                "--admin-tls-cert: this ticketd was built without TLS (the `tls` feature)".into(),
            );
        }
        if self.admin_tls.is_some() && !matches!(self.admin_listen, Some(AdminListen::Tcp(_))) {
            return fail(
                "--admin-tls-cert applies to a TCP admin port: give --admin-listen HOST:PORT \
                 (a Unix socket is guarded by its file mode and --allow-uid instead)"
                    .into(),
            );
        }
        self.check_protected()?;
        if self.unix_listen.len() > MAX_UNIX_LISTENERS {
            return fail(format!("at most {MAX_UNIX_LISTENERS} --listen unix:/path"));
        }
        let admin_unix = matches!(self.admin_listen, Some(AdminListen::Unix(_)));
        if (!self.allow_uids.is_empty() || !self.allow_gids.is_empty())
            && self.unix_listen.is_empty()
            && !admin_unix
        {
            return fail(
                "--allow-uid and --allow-gid apply to Unix sockets: give --listen unix:/path \
                 or --admin-listen unix:/path"
                    .into(),
            );
        }
        Ok(())
    }

    /// True when clients reach the listener over plaintext from beyond
    /// this host: allowed only with `insecure` (and then warned about).
    #[must_use]
    pub fn plaintext_off_loopback(&self) -> bool {
        self.listen_tcp && !self.listen.ip().is_loopback() && self.tls.is_none()
    }

    /// True when the listener speaks TLS beyond this host without
    /// `--tls-client-ca`: protected mode accepts it (tokens and keys are
    /// encrypted, the server is proven to the client), and the start-up
    /// warns that anyone who reaches it can still take and hold any key.
    #[must_use]
    pub fn unauthenticated_tls_off_loopback(&self) -> bool {
        self.listen_tcp
            && !self.listen.ip().is_loopback()
            && self.tls.is_some()
            && !self.client_certs_required()
    }

    /// TLS on the client port with `--tls-client-ca`: only clients holding
    /// a certificate from that CA get to send a request.
    #[must_use]
    pub fn client_certs_required(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.client_ca.is_some())
    }

    /// HTTPS on the admin port with `--admin-tls-client-ca`: only clients
    /// holding a certificate from that CA reach it.
    #[must_use]
    pub fn admin_certs_required(&self) -> bool {
        self.admin_tls
            .as_ref()
            .is_some_and(|t| t.client_ca.is_some())
    }

    /// A TCP admin port beyond this host that does not require client
    /// certificates (plaintext with `insecure`, or HTTPS without
    /// `--admin-tls-client-ca`): warned about at start-up.
    #[must_use]
    pub fn admin_unauthenticated_off_loopback(&self) -> bool {
        matches!(&self.admin_listen, Some(AdminListen::Tcp(a)) if !a.ip().is_loopback())
            && !self.admin_certs_required()
    }

    /// Protected mode: a listener that is not loopback is refused unless
    /// `insecure` says otherwise.
    ///
    /// # Errors
    /// What to do, when the configuration is refused.
    pub fn check_protected(&self) -> Result<(), ConfigError> {
        if self.insecure {
            return Ok(());
        }
        if let Some(AdminListen::Tcp(addr)) = &self.admin_listen {
            if !addr.ip().is_loopback() && self.admin_tls.is_none() {
                return Err(ConfigError::Invalid(format!(
                    "--admin-listen {addr} is not a loopback address, and the admin port would \
                     speak plaintext: anyone who reaches it or listens in could read every key \
                     and token (and, in cluster mode, change the members). Listen on \
                     127.0.0.1, ::1 or unix:/path, serve HTTPS (--admin-tls-cert and \
                     --admin-tls-key, with --admin-tls-client-ca to require client \
                     certificates), or pass --insecure (docs/SECURITY.md)"
                )));
            }
        }
        if !self.plaintext_off_loopback() {
            return Ok(());
        }
        Err(ConfigError::Invalid(format!(
            "--listen {} is not a loopback address, and clients would speak plaintext, not \
             authenticated: anyone who reaches it could take, hold and release any lock, and \
             anyone who listens in could read tokens. Listen on 127.0.0.1 or ::1 (and let \
             clients reach it through something you trust), turn on TLS (--tls-cert and \
             --tls-key, with --tls-client-ca to require client certificates), or pass \
             --insecure to serve it anyway on a network you trust (docs/SECURITY.md)",
            self.listen
        )))
    }

    /// The limits as `name=value` pairs, for the start-up log line.
    #[must_use]
    pub fn describe_limits(&self) -> String {
        let frame_timeout_s = self.frame_timeout.map_or(0, |d| d.as_secs());
        format!(
            "max_conns={} max_keys={} max_waiters={} max_waiters_per_key={} max_key_bytes={} \
             sweep_interval_s={} max_hold_s={} max_frames_per_turn={} out_soft_limit={} \
             out_hard_limit={} frame_timeout_s={} max_lease_s={} {}",
            self.max_conns,
            self.engine.max_keys,
            self.engine.max_waiters,
            self.engine.max_waiters_per_key,
            self.max_key_bytes,
            self.engine.sweep_interval_ms / 1000,
            self.engine.max_hold_ms / 1000,
            self.max_frames_per_turn,
            self.out_soft_limit_bytes,
            self.out_hard_limit_bytes,
            frame_timeout_s,
            self.max_lease_s,
            self.describe_quotas(),
        )
    }
}

/// `--listen` (one TCP address, any number of Unix sockets), the sockets'
/// mode and the peer ids allowed on them.
fn take_listeners(args: &mut pico_args::Arguments, c: &mut Config) -> Result<(), ConfigError> {
    let listens: Vec<String> = args
        .values_from_str("--listen")
        .map_err(|e| ConfigError::Invalid(format!("--listen: {e}")))?;
    let mut tcp = None;
    for l in &listens {
        if let Some(path) = l.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(ConfigError::Invalid("--listen unix: needs a path".into()));
            }
            c.unix_listen.push(PathBuf::from(path));
        } else if tcp.is_some() {
            return Err(ConfigError::Invalid(
                "--listen is given more than once with a TCP address (one TCP address, \
                 and any number of unix:/path)"
                    .into(),
            ));
        } else {
            let a = address(l).map_err(|why| ConfigError::Value {
                flag: "--listen",
                value: l.clone(),
                why: why.into_owned(),
            })?;
            tcp = Some(a);
        }
    }
    if let Some(a) = tcp {
        c.listen = a;
    }
    c.listen_tcp = tcp.is_some() || c.unix_listen.is_empty();
    if let Some(v) = flag(args, "--socket-mode", octal_mode)? {
        c.socket_mode = v;
    }
    for (name, list) in [
        ("--allow-uid", &mut c.allow_uids),
        ("--allow-gid", &mut c.allow_gids),
    ] {
        let ids: Vec<String> = args
            .values_from_str(name)
            .map_err(|e| ConfigError::Invalid(format!("{name}: {e}")))?;
        for id in ids {
            list.push(id.parse().map_err(|_| ConfigError::Value {
                flag: name,
                value: id.clone(),
                why: "expected a number".into(),
            })?);
        }
    }
    Ok(())
}

/// The connection and lock-table limits.
fn take_limits(args: &mut pico_args::Arguments, c: &mut Config) -> Result<(), ConfigError> {
    if let Some(v) = flag(args, "--max-conns", count)? {
        c.max_conns = v;
    }
    if let Some(v) = flag(args, "--max-keys", count)? {
        c.engine.max_keys = v;
    }
    if let Some(v) = flag(args, "--max-waiters", count)? {
        c.engine.max_waiters = v;
    }
    if let Some(v) = flag(args, "--max-waiters-per-key", count)? {
        c.engine.max_waiters_per_key = v;
    }
    if let Some(v) = flag(args, "--max-key-bytes", count)? {
        c.max_key_bytes = v;
    }
    if let Some(v) = flag(args, "--sweep-interval", seconds)? {
        c.engine.sweep_interval_ms = v.saturating_mul(1000);
    }
    if let Some(v) = flag(args, "--max-hold", seconds)? {
        c.engine.max_hold_ms = v.saturating_mul(1000);
    }
    if let Some(v) = flag(args, "--max-frames-per-turn", count)? {
        c.max_frames_per_turn = v;
    }
    // Output limits not given follow --max-key-bytes, so that every key
    // length the help allows starts with the defaults.
    let one_reply = limits::max_reply_frame(c.max_key_bytes);
    match flag(args, "--out-soft-limit", count)? {
        Some(v) => c.out_soft_limit_bytes = v,
        None => c.out_soft_limit_bytes = c.out_soft_limit_bytes.max(one_reply),
    }
    match flag(args, "--out-hard-limit", count)? {
        Some(v) => c.out_hard_limit_bytes = v,
        None => {
            c.out_hard_limit_bytes = c
                .out_hard_limit_bytes
                .max(c.out_soft_limit_bytes.saturating_add(one_reply));
        }
    }
    if let Some(v) = flag(args, "--frame-timeout", seconds)? {
        c.frame_timeout = (v > 0).then(|| Duration::from_secs(v));
    }
    Ok(())
}

/// A certificate, its key and an optional client CA from the three flags
/// named: all three, the first two, or none.
fn tls_files(
    args: &mut pico_args::Arguments,
    [cert, key, ca]: [&'static str; 3],
) -> Result<Option<TlsFiles>, ConfigError> {
    let (cert_flag, key_flag, ca_flag) = (cert, key, ca);
    let cert = flag(args, cert_flag, file)?;
    let key = flag(args, key_flag, file)?;
    let client_ca = flag(args, ca_flag, file)?;
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some(TlsFiles {
            cert,
            key,
            client_ca,
        })),
        (None, None) if client_ca.is_none() => Ok(None),
        _ => Err(ConfigError::Invalid(format!(
            "{cert_flag} and {key_flag} go together (and {ca_flag} needs both)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Parsed, ConfigError> {
        parse_args(args.iter().map(OsString::from).collect())
    }

    #[test]
    fn no_flags_gives_the_documented_defaults() {
        assert_eq!(parse(&[]), Ok(Parsed::Run(Config::default())));
        assert_eq!(Config::default().listen.to_string(), DEFAULT_LISTEN);
    }

    #[test]
    fn every_flag_lands_in_its_field() {
        let Ok(Parsed::Run(c)) = parse(&[
            "--listen",
            "127.0.0.1:0",
            "--max-conns",
            "5",
            "--max-keys",
            "6",
            "--max-waiters",
            "7",
            "--max-waiters-per-key",
            "3",
            "--max-key-bytes",
            "100",
            "--sweep-interval",
            "2",
            "--max-hold",
            "600",
            "--max-frames-per-turn",
            "9",
            "--out-soft-limit",
            "1000",
            "--out-hard-limit",
            "2000",
            "--frame-timeout",
            "0",
            "--data-dir",
            "/tmp/x",
            "--log-level",
            "debug",
            "--restart-grace",
            "off",
            "--max-lease",
            "30",
        ]) else {
            panic!("flags should parse")
        };
        assert_eq!(c.listen.port(), 0);
        assert_eq!(c.max_conns, 5);
        assert_eq!(c.engine.max_keys, 6);
        assert_eq!(c.engine.max_waiters, 7);
        assert_eq!(c.engine.max_waiters_per_key, 3);
        assert_eq!(c.max_key_bytes, 100);
        assert_eq!(c.engine.sweep_interval_ms, 2000);
        assert_eq!(c.engine.max_hold_ms, 600_000);
        assert_eq!(c.max_frames_per_turn, 9);
        assert_eq!(
            (c.out_soft_limit_bytes, c.out_hard_limit_bytes),
            (1000, 2000)
        );
        assert_eq!(c.frame_timeout, None);
        assert_eq!(c.data_dir, Some(PathBuf::from("/tmp/x")));
        assert_eq!(c.log_level, LevelFilter::Debug);
        assert_eq!(c.restart_grace, RestartGrace::Off);
        assert_eq!(c.max_lease_s, 30);
    }

    #[test]
    fn bad_values_name_the_flag() {
        let e = parse(&["--max-conns", "lots"]).unwrap_err();
        assert!(
            e.to_string().contains("--max-conns") && e.to_string().contains("lots"),
            "{e}"
        );
        let e = parse(&["--max-key-bytes", "70000"]).unwrap_err();
        assert!(e.to_string().contains("--max-key-bytes"), "{e}");
        let e = parse(&["--bogus"]).unwrap_err();
        assert!(e.to_string().contains("--bogus"), "{e}");
        let e = parse(&["--listen"]).unwrap_err();
        assert!(e.to_string().contains("--listen"), "{e}");
        let e = parse(&["--out-soft-limit", "10"]).unwrap_err();
        assert!(e.to_string().contains("--out-soft-limit"), "{e}");
        for bad in ["0", "256", "x"] {
            let e = parse(&["--max-lease", bad]).unwrap_err();
            assert!(e.to_string().contains("--max-lease"), "{e}");
        }
        let e = parse(&["--restart-grace", "sometimes"]).unwrap_err();
        assert!(e.to_string().contains("--restart-grace"), "{e}");
        let e = parse(&["--log-level", "loud"]).unwrap_err();
        assert!(e.to_string().contains("--log-level"), "{e}");
    }

    #[test]
    fn errors_carry_the_flag_and_the_value() {
        assert_eq!(
            parse(&["--max-conns", "lots"]).unwrap_err(),
            ConfigError::Value {
                flag: "--max-conns",
                value: "lots".into(),
                why: "expected a whole number".into(),
            }
        );
        assert_eq!(
            parse(&["--allow-uid", "root"]).unwrap_err(),
            ConfigError::Value {
                flag: "--allow-uid",
                value: "root".into(),
                why: "expected a number".into(),
            }
        );
        assert_eq!(
            parse(&["--max-lease"]).unwrap_err(),
            ConfigError::NoValue {
                flag: "--max-lease"
            }
        );
        assert_eq!(
            parse(&["--max-keys", "1", "--max-keys", "2"]).unwrap_err(),
            ConfigError::Repeated { flag: "--max-keys" }
        );
        let e = parse(&["--nope=1"]).unwrap_err();
        assert_eq!(
            e,
            ConfigError::Unknown {
                arg: "--nope=1".into()
            }
        );
        assert_eq!(
            e.to_string(),
            "unknown argument '--nope=1' (write the value after a space: --nope 1)"
        );
        assert!(matches!(
            parse(&["--listen", "0.0.0.0:7470"]).unwrap_err(),
            ConfigError::Invalid(m) if m.starts_with("--listen 0.0.0.0:7470 is not a loopback")
        ));
    }

    #[test]
    fn a_flag_given_twice_is_named_as_such() {
        for args in [
            &["--listen", "127.0.0.1:0", "--listen", "127.0.0.1:1"][..],
            &["--max-conns", "5", "--max-conns", "6"][..],
            &["--max-conns", "5", "--max-conns"][..],
            &["--data-dir", "/a", "--data-dir", "/b"][..],
        ] {
            let e = parse(args).unwrap_err();
            assert!(
                e.to_string().contains(args[0]) && e.to_string().contains("more than once"),
                "{args:?}: {e}"
            );
        }
    }

    #[test]
    fn every_key_length_the_help_allows_starts_with_default_output_limits() {
        for n in ["1", "1024", "65518", "65519", "65536"] {
            let Ok(Parsed::Run(c)) = parse(&["--max-key-bytes", n]) else {
                panic!("--max-key-bytes {n} should start");
            };
            assert!(c.out_soft_limit_bytes >= DEFAULT_OUT_SOFT_LIMIT_BYTES);
            assert!(c.out_hard_limit_bytes >= DEFAULT_OUT_HARD_LIMIT_BYTES);
        }
        // Limits given explicitly are still checked against the key length.
        let e = parse(&["--max-key-bytes", "65536", "--out-soft-limit", "65536"]).unwrap_err();
        assert!(e.to_string().contains("--out-soft-limit"), "{e}");
    }

    #[test]
    fn an_empty_data_dir_is_refused() {
        let e = parse(&["--data-dir", ""]).unwrap_err();
        assert!(e.to_string().contains("--data-dir"), "{e}");
    }

    #[test]
    fn an_equals_sign_gets_a_hint() {
        let e = parse(&["--max-conns=5"]).unwrap_err();
        assert!(e.to_string().contains("--max-conns 5"), "{e}");
    }

    #[test]
    #[cfg(feature = "tls")]
    fn admin_tls_flags_go_together_and_https_protects_an_admin_port_off_loopback() {
        let e = parse(&["--admin-listen", "0.0.0.0:7471"]).unwrap_err();
        assert!(
            e.to_string().contains("--admin-listen 0.0.0.0:7471")
                && e.to_string().contains("--insecure"),
            "{e}"
        );
        let tls = [
            "--admin-listen",
            "0.0.0.0:7471",
            "--admin-tls-cert",
            "c.pem",
            "--admin-tls-key",
            "k.pem",
        ];
        let Ok(Parsed::Run(c)) = parse(&tls) else {
            panic!("HTTPS is refused off loopback: {:?}", parse(&tls));
        };
        assert!(
            c.admin_unauthenticated_off_loopback(),
            "HTTPS alone is warned about"
        );
        let mut args = tls.to_vec();
        args.extend(["--admin-tls-client-ca", "ca.pem"]);
        let Ok(Parsed::Run(c)) = parse(&args) else {
            panic!("{:?}", parse(&args));
        };
        assert!(c.admin_certs_required() && c.tls.is_none());
        assert!(!c.admin_unauthenticated_off_loopback());
        assert!(parse(&["--admin-listen", "0.0.0.0:7471", "--insecure"]).is_ok());
        let e = parse(&[
            "--admin-listen",
            "127.0.0.1:7471",
            "--admin-tls-cert",
            "c.pem",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("--admin-tls-key"), "{e}");
        let e = parse(&[
            "--admin-listen",
            "unix:/tmp/a.sock",
            "--admin-tls-cert",
            "c.pem",
            "--admin-tls-key",
            "k.pem",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("TCP admin port"), "{e}");
    }

    #[test]
    #[cfg(feature = "tls")]
    fn tls_is_protected_and_without_a_client_ca_is_warned_about() {
        let tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem"];
        let mut args = vec!["--listen", "0.0.0.0:7470"];
        args.extend(tls);
        let Ok(Parsed::Run(c)) = parse(&args) else {
            panic!("TLS is refused off loopback: {:?}", parse(&args));
        };
        assert!(!c.plaintext_off_loopback() && c.unauthenticated_tls_off_loopback());
        let e = parse(&["--listen", "0.0.0.0:7470"]).unwrap_err();
        assert!(
            e.to_string().contains("plaintext") && e.to_string().contains("--tls-cert"),
            "{e}"
        );
        args.extend(["--tls-client-ca", "ca.pem"]);
        let Ok(Parsed::Run(c)) = parse(&args) else {
            panic!("TLS with a client CA is refused off loopback");
        };
        assert!(c.client_certs_required() && !c.plaintext_off_loopback());
        assert!(!c.unauthenticated_tls_off_loopback());
        assert_eq!(
            c.tls,
            Some(TlsFiles {
                cert: "c.pem".into(),
                key: "k.pem".into(),
                client_ca: Some("ca.pem".into()),
            })
        );
        let e = parse(&["--tls-cert", "c.pem"]).unwrap_err();
        assert!(e.to_string().contains("--tls-key"), "{e}");
        let e = parse(&["--tls-client-ca", "ca.pem"]).unwrap_err();
        assert!(e.to_string().contains("--tls-cert"), "{e}");
        let e = parse(&[
            "--listen",
            "unix:/tmp/x.sock",
            "--tls-cert",
            "c",
            "--tls-key",
            "k",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("TCP listener"), "{e}");
    }

    #[test]
    fn protected_mode_refuses_plaintext_off_loopback_unless_insecure() {
        for addr in ["0.0.0.0:7470", "[::]:0", "192.0.2.1:7470"] {
            let e = parse(&["--listen", addr]).unwrap_err();
            assert!(
                e.to_string().contains("not a loopback address"),
                "{addr}: {e}"
            );
            assert!(e.to_string().contains("--insecure"), "{addr}: {e}");
            let Ok(Parsed::Run(c)) = parse(&["--listen", addr, "--insecure"]) else {
                panic!("{addr} --insecure is refused");
            };
            assert!(c.insecure && c.plaintext_off_loopback());
        }
        for addr in ["127.0.0.1:0", "[::1]:0", "localhost:0"] {
            let Ok(Parsed::Run(c)) = parse(&["--listen", addr]) else {
                panic!("{addr} is refused");
            };
            assert!(!c.plaintext_off_loopback());
        }
    }

    #[test]
    fn unix_sockets_beside_one_tcp_address() {
        let Ok(Parsed::Run(c)) = parse(&[
            "--listen",
            "unix:/run/a.sock",
            "--listen",
            "127.0.0.1:9",
            "--listen",
            "unix:/run/b.sock",
            "--socket-mode",
            "0600",
            "--allow-uid",
            "5",
            "--allow-uid",
            "6",
            "--allow-gid",
            "7",
        ]) else {
            panic!("refused");
        };
        assert!(c.listen_tcp && c.listen.port() == 9);
        assert_eq!(
            c.unix_listen,
            [PathBuf::from("/run/a.sock"), PathBuf::from("/run/b.sock")]
        );
        assert_eq!(
            (c.socket_mode, &c.allow_uids[..], &c.allow_gids[..]),
            (0o600, &[5, 6][..], &[7][..])
        );
        let Ok(Parsed::Run(c)) = parse(&["--listen", "unix:/run/a.sock"]) else {
            panic!("refused");
        };
        assert!(!c.listen_tcp && !c.plaintext_off_loopback());
        assert_eq!(c.socket_mode, DEFAULT_SOCKET_MODE);
        for (args, needle) in [
            (&["--listen", "unix:"][..], "needs a path"),
            (
                &["--listen", "unix:/a", "--socket-mode", "888"][..],
                "--socket-mode",
            ),
            (
                &["--listen", "unix:/a", "--allow-uid", "x"][..],
                "--allow-uid",
            ),
            (&["--allow-gid", "3"][..], "give --listen unix:/path"),
        ] {
            let e = parse(args).unwrap_err();
            assert!(e.to_string().contains(needle), "{args:?}: {e}");
        }
    }

    #[test]
    fn the_admin_port_takes_an_address_or_a_unix_socket() {
        let Ok(Parsed::Run(c)) = parse(&["--admin-listen", "127.0.0.1:7471"]) else {
            panic!("refused");
        };
        assert_eq!(
            c.admin_listen,
            Some(AdminListen::Tcp("127.0.0.1:7471".parse().unwrap()))
        );
        let Ok(Parsed::Run(c)) = parse(&[
            "--admin-listen",
            "unix:/run/t/admin.sock",
            "--allow-uid",
            "5",
        ]) else {
            panic!("refused");
        };
        let unix = AdminListen::Unix(PathBuf::from("/run/t/admin.sock"));
        assert_eq!(unix.to_string(), "unix:/run/t/admin.sock");
        assert_eq!(c.admin_listen, Some(unix));
        assert_eq!(c.allow_uids, [5]);
        for bad in ["unix:", "nowhere", "127.0.0.1"] {
            let e = parse(&["--admin-listen", bad]).unwrap_err();
            assert!(e.to_string().contains("--admin-listen"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn ipv6_and_host_names_are_listen_addresses() {
        let Ok(Parsed::Run(c)) = parse(&["--listen", "[::1]:0"]) else {
            panic!("[::1]:0 should parse");
        };
        assert!(c.listen.is_ipv6() && c.listen.ip().is_loopback());
        let Ok(Parsed::Run(c)) = parse(&["--listen", "localhost:7"]) else {
            panic!("localhost:7 should parse");
        };
        assert!(c.listen.ip().is_loopback() && c.listen.port() == 7);
        for bad in ["[::1]", "127.0.0.1", "127.0.0.1:65536", ":0", ""] {
            let e = parse(&["--listen", bad]).unwrap_err();
            assert!(e.to_string().contains("--listen"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn help_and_version_win_over_everything_else() {
        assert_eq!(parse(&["--max-conns", "x", "--help"]), Ok(Parsed::Help));
        assert_eq!(parse(&["-V"]), Ok(Parsed::Version));
    }
}

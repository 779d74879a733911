//! The command line: the server's flags parsed (with `pico-args`) into a
//! [`Config`], each value checked by a parser that says why it is refused.

use std::borrow::Cow;
use std::ffi::OsString;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use log::LevelFilter;

use crate::limits;

use super::{quota, AdminListen, Config, ConfigError, Parsed, RestartGrace, TlsFiles};

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
pub(super) type Why = Cow<'static, str>;

pub(super) fn flag<T>(
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

pub(super) fn count(s: &str) -> Result<usize, Why> {
    let n: usize = s.parse().map_err(|_| "expected a whole number")?;
    if n == 0 {
        return Err("must be at least 1".into());
    }
    Ok(n)
}

pub(super) fn seconds(s: &str) -> Result<u64, Why> {
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

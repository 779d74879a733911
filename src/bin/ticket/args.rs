//! The command line of the subcommands that take a lock: the key, the
//! wait and the lease, the servers and their TLS files.

use std::time::Duration;

use ticketd::client::{Mode, Places};

use ticketd::client::DEFAULT_ADDRESS;

use crate::Exit;

const DEFAULT_WAIT_S: f64 = 10.0;
pub(crate) const DEFAULT_LEASE_S: u8 = 30;

/// Options shared by the subcommands that acquire.
pub(crate) struct AcquireOpts {
    pub(crate) key: String,
    pub(crate) wait: Duration,
    pub(crate) lease: Duration,
    /// `--permits N`, `--shared`, `--exclusive` (protocol 1.2); `None`:
    /// a mutex.
    pub(crate) places: Option<Places>,
    pub(crate) servers: Servers,
}

/// `--permits N`: a number of places in 1..=65535.
pub(crate) fn parse_permits(s: &str) -> Result<u16, String> {
    match s.parse::<u16>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "--permits {s:?} must be a whole number in 1..=65535"
        )),
    }
}

/// What `--permits N`, `--shared` and `--exclusive` ask for: a permit of
/// a semaphore of N (shared, or the whole key with `--exclusive`), a
/// reader's or a writer's hold of a read/write lock, or (none given) a
/// mutex.
fn parse_places(args: &mut pico_args::Arguments) -> Result<Option<Places>, Exit> {
    let permits = args
        .opt_value_from_fn("--permits", parse_permits)
        .map_err(|e| Exit::usage(e.to_string()))?;
    let shared = args.contains("--shared");
    let exclusive = args.contains("--exclusive");
    let mode = match (shared, exclusive) {
        (true, true) => return Err(Exit::usage("--shared and --exclusive exclude each other")),
        (true, false) => Some(Mode::Shared),
        (false, true) => Some(Mode::Exclusive),
        (false, false) => None,
    };
    Ok(match (permits, mode) {
        (None, None) => None,
        (Some(limit), mode) => Some(Places {
            limit,
            mode: mode.unwrap_or(Mode::Shared),
        }),
        (None, Some(mode)) => Some(Places {
            limit: Places::READ_WRITE_LIMIT,
            mode,
        }),
    })
}

pub(crate) fn parse_wait(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("--wait {s:?} is not a number of seconds"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("--wait {s:?} must be 0 or more seconds"));
    }
    // The client clamps waits to 255 s; clamp here too so huge values
    // cannot overflow the conversion.
    Ok(Duration::from_secs_f64(v.min(255.0)))
}

pub(crate) fn parse_lease(s: &str) -> Result<Duration, String> {
    match s.parse::<u8>() {
        Ok(n) if n > 0 => Ok(Duration::from_secs(u64::from(n))),
        _ => Err(format!("--lease {s:?} must be whole seconds in 1..=255")),
    }
}

pub(crate) fn parse_grace(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("--kill-grace {s:?} is not a number of seconds"))?;
    if !v.is_finite() || !(0.0..=255.0).contains(&v) {
        return Err(format!("--kill-grace {s:?} must be within 0..=255 seconds"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Where the servers are and how to speak to them.
#[derive(Debug)]
pub(crate) struct Servers {
    pub(crate) addrs: Vec<String>,
    /// `--tls-ca`, `--tls-cert`, `--tls-key` (or `TICKET_TLS_CA`,
    /// `TICKET_TLS_CERT`, `TICKET_TLS_KEY`).
    pub(crate) tls_ca: Option<std::path::PathBuf>,
    pub(crate) tls_cert: Option<std::path::PathBuf>,
    pub(crate) tls_key: Option<std::path::PathBuf>,
}

/// A TLS file from its flag, else from its environment variable (an empty
/// variable counts as unset).
pub(crate) fn tls_file(
    args: &mut pico_args::Arguments,
    flag: &'static str,
    var: &str,
) -> Result<Option<std::path::PathBuf>, Exit> {
    let v: Option<std::path::PathBuf> = args
        .opt_value_from_os_str(flag, |s| {
            Ok::<_, std::convert::Infallible>(std::path::PathBuf::from(s))
        })
        .map_err(|e| Exit::usage(e.to_string()))?;
    Ok(v.or_else(|| {
        std::env::var_os(var)
            .filter(|s| !s.is_empty())
            .map(std::path::PathBuf::from)
    }))
}

pub(crate) fn servers(args: &mut pico_args::Arguments) -> Result<Servers, Exit> {
    let mut s: Vec<String> = args
        .values_from_str("--server")
        .map_err(|e| Exit::usage(e.to_string()))?;
    if s.is_empty() {
        s.push(DEFAULT_ADDRESS.to_owned());
    }
    let tls_ca = tls_file(args, "--tls-ca", "TICKET_TLS_CA")?;
    let tls_cert = tls_file(args, "--tls-cert", "TICKET_TLS_CERT")?;
    let tls_key = tls_file(args, "--tls-key", "TICKET_TLS_KEY")?;
    if tls_cert.is_some() != tls_key.is_some() {
        return Err(Exit::usage(
            "--tls-cert and --tls-key (TICKET_TLS_CERT, TICKET_TLS_KEY) go together",
        ));
    }
    if tls_cert.is_some() && tls_ca.is_none() {
        return Err(Exit::usage(
            "--tls-cert needs --tls-ca (TICKET_TLS_CA): the CA the server's certificate \
             chains to",
        ));
    }
    if tls_ca.is_some() && !cfg!(feature = "tls") {
        return Err(Exit::usage(
            "--tls-ca: this ticket was built without TLS (the `tls` feature)",
        ));
    }
    Ok(Servers {
        addrs: s,
        tls_ca,
        tls_cert,
        tls_key,
    })
}

pub(crate) fn free_string(args: &mut pico_args::Arguments, what: &str) -> Result<String, Exit> {
    match args.opt_free_from_str::<String>() {
        Ok(Some(s)) => Ok(s),
        Ok(None) => Err(Exit::usage(format!("missing {what}"))),
        Err(e) => Err(Exit::usage(format!("{what}: {e}"))),
    }
}

pub(crate) fn finish(args: pico_args::Arguments) -> Result<(), Exit> {
    let rest = args.finish();
    if let Some(first) = rest.first() {
        return Err(Exit::usage(format!(
            "unexpected argument {:?}",
            first.to_string_lossy()
        )));
    }
    Ok(())
}

pub(crate) fn parse_acquire_opts(args: &mut pico_args::Arguments) -> Result<AcquireOpts, Exit> {
    let wait = args
        .opt_value_from_fn("--wait", parse_wait)
        .map_err(|e| Exit::usage(e.to_string()))?
        .unwrap_or(Duration::from_secs_f64(DEFAULT_WAIT_S));
    let lease = args
        .opt_value_from_fn("--lease", parse_lease)
        .map_err(|e| Exit::usage(e.to_string()))?
        .unwrap_or(Duration::from_secs(u64::from(DEFAULT_LEASE_S)));
    let places = parse_places(args)?;
    let servers = servers(args)?;
    let key = free_string(args, "KEY")?;
    Ok(AcquireOpts {
        key,
        wait,
        lease,
        places,
        servers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn places(args: &[&str]) -> Result<Option<Places>, String> {
        let args = args.iter().map(std::ffi::OsString::from).collect();
        let mut args = pico_args::Arguments::from_vec(args);
        parse_places(&mut args).map_err(|e| e.message)
    }

    #[test]
    fn permits_shared_and_exclusive_name_the_places() {
        assert_eq!(places(&[]), Ok(None));
        assert_eq!(places(&["--permits", "8"]), Ok(Some(Places::semaphore(8))));
        assert_eq!(places(&["--shared"]), Ok(Some(Places::shared())));
        assert_eq!(places(&["--exclusive"]), Ok(Some(Places::exclusive())));
        let whole = Places {
            limit: 3,
            mode: Mode::Exclusive,
        };
        assert_eq!(places(&["--permits", "3", "--exclusive"]), Ok(Some(whole)));
        assert!(places(&["--shared", "--exclusive"]).is_err());
        for bad in ["0", "65536", "-1", "two"] {
            let e = places(&["--permits", bad]).unwrap_err();
            assert!(e.contains("1..=65535"), "{e}");
        }
    }

    #[test]
    fn waits_accept_fractions_and_clamp_leases_do_not() {
        assert_eq!(parse_wait("0"), Ok(Duration::ZERO));
        assert_eq!(parse_wait("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_wait("1e9"), Ok(Duration::from_secs(255)));
        assert!(parse_wait("-1").is_err());
        assert!(parse_wait("NaN").is_err());
        assert!(parse_wait("inf").is_err());
        assert!(parse_wait("soon").is_err());
        assert_eq!(parse_lease("30"), Ok(Duration::from_secs(30)));
        assert!(parse_lease("0").is_err());
        assert!(parse_lease("256").is_err());
        assert!(parse_lease("1.5").is_err());
        assert!(parse_grace("-0.1").is_err());
        assert_eq!(parse_grace("0.25"), Ok(Duration::from_millis(250)));
    }
}

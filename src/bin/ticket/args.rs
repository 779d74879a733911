//! The command line of the subcommands that take a lock: the key, the
//! wait and the lease, the servers and their TLS files.

use std::time::Duration;

use ticketd::client::DEFAULT_ADDRESS;

use crate::Exit;

const DEFAULT_WAIT_S: f64 = 10.0;
pub(crate) const DEFAULT_LEASE_S: u8 = 30;

/// Options shared by the subcommands that acquire.
pub(crate) struct AcquireOpts {
    pub(crate) key: String,
    pub(crate) wait: Duration,
    pub(crate) lease: Duration,
    pub(crate) servers: Servers,
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
    let servers = servers(args)?;
    let key = free_string(args, "KEY")?;
    Ok(AcquireOpts {
        key,
        wait,
        lease,
        servers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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

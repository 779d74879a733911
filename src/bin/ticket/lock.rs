//! `ticket acquire`, `release` and `extend`: a lock taken, given back or
//! extended by its token, one command each.

use std::ffi::OsString;
use std::io::Write;
use std::time::Duration;

use ticketd::client::{Acquire, Client, ExtendToken, FailureKind, Places, Release, Ticket};

use crate::args::{
    finish, free_string, parse_acquire_opts, parse_lease, servers, AcquireOpts, Servers,
    DEFAULT_LEASE_S,
};
use crate::{exit, Exit};

pub(crate) const HELP_ACQUIRE: &str = "\
ticket acquire: take a lock and print its fencing token

USAGE:
    ticket acquire KEY [--wait S] [--lease S] [--permits N] [--shared | --exclusive]
                   [--server ADDR]...

OPTIONS:
    --wait S        seconds to wait in the queue if the key is held
                    (default 10, fractions allowed, 0 = one attempt, max 255)
    --lease S       whole seconds the grant lives (1..=255, default 30)
    --permits N     one of N places of KEY, a counting semaphore (1..=65535):
                    at most N holders at once, each with its own token
    --shared        a reader's place in the read/write lock KEY (beside other
                    readers, never beside a writer); with --permits N, one
                    place of the semaphore (the default)
    --exclusive     a writer's hold of the read/write lock KEY, alone; with
                    --permits N, the whole semaphore
                    These three need a protocol 1.2 server; every holder
                    of a key must give it the same limit
    --server ADDR   host:port of a server, or unix:/path; repeat for a cluster
                    (default 127.0.0.1:7470)
    --tls-ca FILE   speak TLS to TCP servers, trusting this CA (PEM); the
                    server's certificate must name the host of ADDR
    --tls-cert FILE, --tls-key FILE
                    the client certificate and key (PEM) for a server that
                    requires one (ticketd --tls-client-ca)
                    The same from TICKET_TLS_CA, TICKET_TLS_CERT, TICKET_TLS_KEY

On success prints the token on stdout and exits 0. The lock stays held
after `ticket` exits, until `ticket release KEY TOKEN` or the lease ends.
Exits 120 (timeout), 121 (busy, or the key has another limit) or 122
(indeterminate) otherwise.
";

pub(crate) const HELP_RELEASE: &str = "\
ticket release: release a lock by its token, from any process

USAGE:
    ticket release KEY TOKEN [--server ADDR]...

Locks belong to tokens, not connections: a script can acquire in one step
and release in another. Exits 0 (released), 123 (not held: wrong token, or
the lease already ended), 122 (indeterminate) or 120 (no server reachable,
nothing sent).
";

pub(crate) const HELP_EXTEND: &str = "\
ticket extend: extend a lock's lease by its token, from any process

USAGE:
    ticket extend KEY TOKEN [--lease S] [--server ADDR]...

The grant keeps its token and lives --lease seconds (1..=255, default 30)
from about now. Needs a protocol 1.1 server. Exits 0 (extended), 123 (not
held: wrong token, the lease already ended, or a --max-hold cap), 122
(indeterminate: no answer within 5 s; the lease may or may not have moved).
";

pub(crate) fn client(servers: &Servers) -> Result<Client, Exit> {
    // A refused connection ends the call at once: a command line wants
    // the reason now, not after the whole --wait.
    let b = Client::builder()
        .addresses(servers.addrs.iter().cloned())
        .fail_fast(true);
    #[cfg(feature = "tls")]
    let b = {
        let mut b = b;
        if let Some(ca) = &servers.tls_ca {
            b = b.tls_ca(ca);
        }
        if let (Some(cert), Some(key)) = (&servers.tls_cert, &servers.tls_key) {
            b = b.tls_client_cert(cert, key);
        }
        b
    };
    #[cfg(not(feature = "tls"))]
    let _ = (&servers.tls_ca, &servers.tls_cert, &servers.tls_key);
    b.build().map_err(|e| Exit::usage(e.to_string()))
}

/// Why no server could be reached, as ` (no server reachable: ...)`, or
/// nothing while a connection is up.
pub(crate) fn unreachable(client: &Client) -> String {
    if client.connected_sessions() > 0 {
        return String::new();
    }
    match client.last_failure() {
        Some(f) => format!(" (no server reachable: {f}{})", hint(f.kind())),
        None => client
            .last_connect_error()
            .map(|e| format!(" (no server reachable: {e})"))
            .unwrap_or_default(),
    }
}

/// What the connection that a call lost said about the server, as
/// `: ADDR: what happened; what to do`, or nothing. Refusals and connect
/// failures are left out: they never leave an outcome unknown.
pub(crate) fn lost_connection(client: &Client) -> String {
    match client.last_failure() {
        Some(f) if !matches!(f.kind(), FailureKind::Refused | FailureKind::Connect) => {
            format!(": {f}{}", hint(f.kind()))
        }
        _ => String::new(),
    }
}

/// The flags that fix a failure of this kind, if any.
fn hint(kind: FailureKind) -> &'static str {
    match kind {
        FailureKind::TlsExpected => {
            "; give --tls-ca FILE (TICKET_TLS_CA), the CA of its certificate"
        }
        FailureKind::CertificateRequired => {
            "; give --tls-cert FILE --tls-key FILE (TICKET_TLS_CERT, TICKET_TLS_KEY)"
        }
        FailureKind::CertificateRefused => {
            "; give a certificate from the CA of the server's --tls-client-ca"
        }
        FailureKind::Http | FailureKind::NotTicketd => {
            "; --server takes the client port (ticketd --listen)"
        }
        _ => "",
    }
}

/// Acquires, or ends the process with the status for why not.
pub(crate) fn take(client: &Client, o: &AcquireOpts) -> Result<Ticket, Exit> {
    let outcome = client
        .acquire_with(&o.key, o.places, o.wait, o.lease)
        .map_err(|e| Exit::usage(e.to_string()))?;
    match outcome {
        Acquire::Acquired(t) => Ok(t),
        Acquire::Timeout => {
            let why = unreachable(client);
            Err(Exit {
                status: exit::TIMEOUT,
                message: format!("timeout: {:?} not acquired{why}", o.key),
            })
        }
        Acquire::Busy => Err(Exit {
            status: exit::BUSY,
            message: format!(
                "busy: {:?} not acquired, the server is at a limit (a full queue, too many \
                 keys, or a lease longer than the server's --max-lease)",
                o.key
            ),
        }),
        Acquire::LimitMismatch(limit) => Err(Exit {
            status: exit::BUSY,
            message: format!(
                "limit mismatch: {:?} not acquired, the key is registered with {}",
                o.key,
                match limit {
                    1 => "a limit of 1 (a mutex)".to_owned(),
                    Places::READ_WRITE_LIMIT => format!("a limit of {limit} (a read/write lock)"),
                    n => format!("a limit of {n} (a semaphore)"),
                }
            ),
        }),
        Acquire::Indeterminate => Err(Exit {
            status: exit::INDETERMINATE,
            message: format!(
                "indeterminate: {:?} must be treated as not held (its lease ends any grant){}",
                o.key,
                lost_connection(client)
            ),
        }),
    }
}

pub(crate) fn acquire(args: Vec<OsString>) -> Result<u8, Exit> {
    let mut args = pico_args::Arguments::from_vec(args);
    if args.contains(["-h", "--help"]) {
        print!("{HELP_ACQUIRE}");
        return Ok(exit::OK);
    }
    let o = parse_acquire_opts(&mut args)?;
    finish(args)?;
    let client = client(&o.servers)?;
    let ticket = take(&client, &o)?;
    // Nobody could release a token that was never printed: give it back.
    let token = ticket.token();
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{token}").and_then(|()| out.flush()) {
        let _ = ticket.release();
        return Err(Exit {
            status: exit::FAILED,
            message: format!("cannot print the token ({e}); the lock was released"),
        });
    }
    // The lock outlives this process: it is released by token later.
    let _ = ticket.detach();
    Ok(exit::OK)
}

pub(crate) fn release(args: Vec<OsString>) -> Result<u8, Exit> {
    let mut args = pico_args::Arguments::from_vec(args);
    if args.contains(["-h", "--help"]) {
        print!("{HELP_RELEASE}");
        return Ok(exit::OK);
    }
    let servers = servers(&mut args)?;
    let key = free_string(&mut args, "KEY")?;
    let token = free_string(&mut args, "TOKEN")?;
    let token: u64 = token
        .parse()
        .map_err(|_| Exit::usage(format!("TOKEN {token:?} is not a decimal number")))?;
    finish(args)?;
    let client = client(&servers)?;
    match client
        .release(&key, token)
        .map_err(|e| Exit::usage(e.to_string()))?
    {
        Release::Released => Ok(exit::OK),
        Release::NotHeld => Err(Exit {
            status: exit::NOT_HELD,
            message: format!("not held: {key:?} is not held under token {token}"),
        }),
        Release::Indeterminate => Err(Exit {
            status: exit::INDETERMINATE,
            message: format!(
                "indeterminate: the release of {key:?} may not have taken effect{}",
                lost_connection(&client)
            ),
        }),
        Release::NotSent => Err(Exit {
            status: exit::TIMEOUT,
            message: format!("timeout: {key:?} not released{}", unreachable(&client)),
        }),
    }
}

pub(crate) fn extend(args: Vec<OsString>) -> Result<u8, Exit> {
    let mut args = pico_args::Arguments::from_vec(args);
    if args.contains(["-h", "--help"]) {
        print!("{HELP_EXTEND}");
        return Ok(exit::OK);
    }
    let lease = args
        .opt_value_from_fn("--lease", parse_lease)
        .map_err(|e| Exit::usage(e.to_string()))?
        .unwrap_or(Duration::from_secs(u64::from(DEFAULT_LEASE_S)));
    let servers = servers(&mut args)?;
    let key = free_string(&mut args, "KEY")?;
    let token = free_string(&mut args, "TOKEN")?;
    let token: u64 = token
        .parse()
        .map_err(|_| Exit::usage(format!("TOKEN {token:?} is not a decimal number")))?;
    finish(args)?;
    let client = client(&servers)?;
    match client
        .extend(&key, token, lease)
        .map_err(|e| Exit::usage(e.to_string()))?
    {
        ExtendToken::Extended => Ok(exit::OK),
        ExtendToken::NotHeld => Err(Exit {
            status: exit::NOT_HELD,
            message: format!(
                "not held: {key:?} is not held under token {token} (or a --max-hold cap was \
                 reached, or the lease is longer than the server's --max-lease)"
            ),
        }),
        ExtendToken::Indeterminate => Err(Exit {
            status: exit::INDETERMINATE,
            message: format!(
                "indeterminate: no answer; the lease of {key:?} may or may not have moved{}",
                match unreachable(&client) {
                    none if none.is_empty() => lost_connection(&client),
                    why => why,
                }
            ),
        }),
    }
}

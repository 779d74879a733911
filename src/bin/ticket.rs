//! `ticket`: take and release ticketd locks from the shell.
//!
//! ```text
//! ticket acquire KEY [--wait S] [--lease S] [--server ADDR]...
//! ticket release KEY TOKEN [--server ADDR]...
//! ticket extend KEY TOKEN [--lease S] [--server ADDR]...
//! ticket run KEY [--wait S] [--lease S] [--kill-grace S] [--no-renew | --max-hold S]
//!            [--server ADDR]... -- CMD [ARGS...]
//! ticket status KEY [--json] [--admin ADDR]
//! ticket locks [PREFIX] [--json] [--admin ADDR]
//! ticket cluster status [--json] [--admin ADDR]
//! ```
//!
//! Built on `ticketd::client`, so every PROTOCOL §3 rule holds here too: the CLI
//! never reports "acquired" unless the lock is held, and `run` never starts
//! the command on a guess. Exit statuses are listed in [`exit`] and in
//! `docs/CLIENT.md`.

use std::ffi::OsString;
use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

#[path = "ticket/guardian.rs"]
mod guardian;

use ticketd::client::admin::{self, Json};
use ticketd::client::{
    Acquire, Client, ExtendToken, FailureKind, KeptTicket, Release, Ticket, DEFAULT_ADDRESS,
};

/// The exit statuses of `ticket`. `run` otherwise exits with its command's
/// status (or 128 + the signal that ended it).
mod exit {
    /// Acquired (token printed), released, or `run`'s command exited 0.
    pub const OK: u8 = 0;
    /// Bad command line or argument (sysexits' EX_USAGE).
    pub const USAGE: u8 = 64;
    /// Not acquired: the key stayed held for the whole wait, or no server
    /// could be reached in time (then a release was not sent either).
    pub const TIMEOUT: u8 = 120;
    /// Not acquired and not queued: a server capacity limit.
    pub const BUSY: u8 = 121;
    /// Unknown outcome: the lock must be treated as not held; a grant that
    /// may exist ends with its lease.
    pub const INDETERMINATE: u8 = 122;
    /// Release or extend: the key is not held under that token.
    pub const NOT_HELD: u8 = 123;
    /// Run: the lease was about to end, or the lock was lost (an extend
    /// was refused, or no server answered in time), so the command was
    /// terminated.
    pub const LEASE_ENDED: u8 = 124;
    /// `ticket` itself failed (e.g. could not print the token, which it
    /// then released).
    pub const FAILED: u8 = 125;
    /// Run: the command was found but could not be started.
    pub const CANNOT_RUN: u8 = 126;
    /// Run: the command was not found.
    pub const NOT_FOUND: u8 = 127;
}

const DEFAULT_WAIT_S: f64 = 10.0;
const DEFAULT_LEASE_S: u8 = 30;
const DEFAULT_KILL_GRACE_S: f64 = 2.0;
/// SIGKILL goes out this long before the conservative local expiry, so the
/// command is gone before the server can grant the key to anyone else.
const KILL_MARGIN: Duration = Duration::from_millis(500);
/// How often `run` looks at its command and at signals.
const POLL: Duration = Duration::from_millis(10);

const HELP: &str = "\
ticket: take and release ticketd locks from the shell

USAGE:
    ticket acquire KEY [--wait S] [--lease S] [--server ADDR]...
    ticket release KEY TOKEN [--server ADDR]...
    ticket extend KEY TOKEN [--lease S] [--server ADDR]...
    ticket run KEY [--wait S] [--lease S] [--kill-grace S] [--no-renew | --max-hold S]
               [--server ADDR]... -- CMD [ARGS...]
    ticket status KEY [--json] [--admin ADDR]
    ticket locks [PREFIX] [--json] [--admin ADDR]
    ticket cluster status [--json] [--admin ADDR]
    ticket cluster add ID=HOST:PORT [--learner] [--catch-up-timeout S] [--admin ADDR]...
    ticket cluster promote ID [--admin ADDR]...
    ticket cluster remove ID [--force] [--admin ADDR]...
    ticket certs init DIR [--cluster-name NAME] [--nodes N]
    ticket help [SUBCOMMAND]

Each subcommand takes --help. The server defaults to 127.0.0.1:7470; give
--server several times to list the nodes of a cluster. acquire, release,
extend and run speak TLS with --tls-ca FILE (and a client certificate with
--tls-cert FILE --tls-key FILE), or TICKET_TLS_CA, TICKET_TLS_CERT and
TICKET_TLS_KEY in the environment. status, locks and
cluster status read a server's admin port (ticketd --admin-listen), by
default 127.0.0.1:7471.

EXIT STATUS:
    0    acquired (token printed) / released / extended / run: the command exited 0
    64   usage error
    120  timeout: not acquired (or no server reachable)
    121  busy: not acquired, a server capacity limit
    122  indeterminate: treat the lock as not held; its lease ends any grant
    123  not held: the release or extend found no such token on the key
    124  run: the lock was lost or its lease about to end; the command was terminated
    125  ticket itself failed (e.g. could not print the token; it released the lock)
    126  run: the command could not be started
    127  run: the command was not found
    run otherwise exits with the command's own status (128 + N for signal N).
";

const HELP_ACQUIRE: &str = "\
ticket acquire: take a lock and print its fencing token

USAGE:
    ticket acquire KEY [--wait S] [--lease S] [--server ADDR]...

OPTIONS:
    --wait S        seconds to wait in the queue if the key is held
                    (default 10, fractions allowed, 0 = one attempt, max 255)
    --lease S       whole seconds the grant lives (1..=255, default 30)
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
Exits 120 (timeout), 121 (busy) or 122 (indeterminate) otherwise.
";

const HELP_RELEASE: &str = "\
ticket release: release a lock by its token, from any process

USAGE:
    ticket release KEY TOKEN [--server ADDR]...

Locks belong to tokens, not connections: a script can acquire in one step
and release in another. Exits 0 (released), 123 (not held: wrong token, or
the lease already ended), 122 (indeterminate) or 120 (no server reachable,
nothing sent).
";

const HELP_EXTEND: &str = "\
ticket extend: extend a lock's lease by its token, from any process

USAGE:
    ticket extend KEY TOKEN [--lease S] [--server ADDR]...

The grant keeps its token and lives --lease seconds (1..=255, default 30)
from about now. Needs a protocol 1.1 server. Exits 0 (extended), 123 (not
held: wrong token, the lease already ended, or a --max-hold cap), 122
(indeterminate: no answer within 5 s; the lease may or may not have moved).
";

const HELP_RUN: &str = "\
ticket run: run a command while holding a lock

USAGE:
    ticket run KEY [--wait S] [--lease S] [--kill-grace S] [--no-renew | --max-hold S]
               [--server ADDR]... -- CMD [ARGS...]

Acquires KEY, runs CMD with these variables in its environment, releases
the lock when CMD exits and exits with CMD's status:
    TICKET_KEY         the key
    TICKET_TOKEN       the fencing token (decimal); pass it to the resource
    TICKET_EXPIRES_AT  when the first lease must be considered over, in whole
                       unix seconds (rounded down, so conservative). With
                       renewal the lock lives on past it for as long as CMD
                       runs; CMD is stopped if the lock is ever lost, so it
                       need not watch the clock itself.

By default the lock is renewed (extended by --lease) at a third of the lease
for as long as CMD runs. If it is lost (the server refuses an extend, or no
server answers before the renewal deadline, a tenth of the lease before the
expiry), or with --no-renew when the one lease is about to end, CMD's
process group gets SIGTERM, then SIGKILL --kill-grace seconds later and at
the latest half a second before the local expiry, and `ticket` exits 124.
With renewal, --kill-grace plus half a second must stay below two thirds of
the lease, so a renewal always lands before a SIGTERM is due; the default
grace is 2 s, less for leases under 7 s (half of two thirds of the lease
less 0.5 s: 0.75 s for --lease 3).

With --no-renew, SIGTERM comes --kill-grace plus half a second before the
lease ends: with --lease 3 and the default grace of 2 s, CMD gets SIGTERM
0.5 s after the grant and SIGKILL at 2.5 s. Give a longer lease or a
shorter --kill-grace for more time.

CMD runs in its own process group; SIGINT, SIGTERM and SIGHUP sent to
`ticket` are passed on. If `ticket` itself dies, even by SIGKILL, a guardian
process it started kills CMD's whole process group at once (and CMD gets
SIGKILL by PR_SET_PDEATHSIG too). A process that leaves the group (setsid,
or a daemonizing double fork) escapes both and must watch the lock itself;
a cgroup contains it: run `ticket run` as a systemd service (docs/CLIENT.md).

OPTIONS:
    --wait S, --lease S, --server ADDR   as for `ticket acquire`
    --kill-grace S   seconds between SIGTERM and SIGKILL (default 2, less
                     with renewal and a lease under 7 s)
    --no-renew       hold one lease only: CMD is stopped before it ends
    --max-hold S     stop renewing S seconds after the grant (then as
                     --no-renew: CMD is stopped before that lease ends)

Exits 120, 121 or 122 without running CMD if the lock is not acquired.
";

/// A failure that ends the process with a status and a message.
struct Exit {
    status: u8,
    message: String,
}

impl Exit {
    fn usage(message: impl Into<String>) -> Exit {
        Exit {
            status: exit::USAGE,
            message: message.into(),
        }
    }
}

fn main() -> std::process::ExitCode {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    match dispatch(args) {
        Ok(status) => std::process::ExitCode::from(status),
        Err(e) => {
            if !e.message.is_empty() {
                eprintln!("ticket: {}", e.message);
            }
            if e.status == exit::USAGE {
                eprintln!("Try 'ticket --help'.");
            }
            std::process::ExitCode::from(e.status)
        }
    }
}

/// The subcommand dispatcher.
fn dispatch(mut args: Vec<OsString>) -> Result<u8, Exit> {
    if args.is_empty() {
        print!("{HELP}");
        return Err(Exit::usage("missing subcommand"));
    }
    let sub = args.remove(0);
    let sub = sub
        .to_str()
        .ok_or_else(|| Exit::usage("the subcommand is not valid UTF-8"))?
        .to_owned();
    match sub.as_str() {
        "acquire" => acquire(args),
        "release" => release(args),
        "extend" => extend(args),
        "run" => run(args),
        "certs" => certs(args),
        "status" => status(args),
        "locks" => locks(args),
        "cluster" => cluster(args),
        "help" | "--help" | "-h" => help(args),
        other => Err(Exit::usage(format!("unknown subcommand {other:?}"))),
    }
}

const HELP_CERTS: &str = "\
ticket certs init: make a cluster CA and one certificate per node for peer TLS

USAGE:
    ticket certs init DIR [--cluster-name NAME] [--nodes N]

Writes DIR/ca.pem, DIR/ca-key.pem and, for each node id 1..=N,
DIR/nodeN.pem (subjectAltName DNS nodeN.NAME) and DIR/nodeN-key.pem. Keys
are created 0600; nothing that exists is overwritten. Give node N
--peer-tls-cert DIR/nodeN.pem --peer-tls-key DIR/nodeN-key.pem
--peer-tls-ca DIR/ca.pem and --cluster-name NAME (docs/SECURITY.md). Keep
ca-key.pem off the nodes.

OPTIONS:
    --cluster-name NAME   the nodes' --cluster-name [ticketd]
    --nodes N             how many nodes [3]
";

/// `ticket certs init DIR`: see [`HELP_CERTS`].
fn certs(args: Vec<OsString>) -> Result<u8, Exit> {
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!("{HELP_CERTS}");
        return Ok(exit::OK);
    }
    certs_init(args)
}

#[cfg(feature = "cluster")]
fn certs_init(args: Vec<OsString>) -> Result<u8, Exit> {
    let mut args = pico_args::Arguments::from_vec(args);
    match args.subcommand() {
        Ok(Some(s)) if s == "init" => {}
        Ok(Some(s)) => return Err(Exit::usage(format!("certs: unknown subcommand {s:?}"))),
        Ok(None) => return Err(Exit::usage("certs: missing subcommand (init)")),
        Err(e) => return Err(Exit::usage(format!("certs: {e}"))),
    }
    let cluster_name: String = args
        .opt_value_from_str("--cluster-name")
        .map_err(|e| Exit::usage(format!("certs init: --cluster-name: {e}")))?
        .unwrap_or_else(|| "ticketd".to_owned());
    let nodes: u64 = args
        .opt_value_from_str("--nodes")
        .map_err(|e| Exit::usage(format!("certs init: --nodes: {e}")))?
        .unwrap_or(3);
    let dir: Option<std::path::PathBuf> = args
        .opt_free_from_os_str(|s| Ok::<_, std::convert::Infallible>(s.into()))
        .map_err(|e| Exit::usage(format!("certs init: {e}")))?;
    let Some(dir) = dir else {
        return Err(Exit::usage("certs init: missing DIR"));
    };
    let rest = args.finish();
    if let Some(extra) = rest.first() {
        return Err(Exit::usage(format!("certs init: unexpected {extra:?}")));
    }
    let opts = ticketd::cluster::certs::InitOptions {
        dir,
        cluster_name,
        nodes,
    };
    match ticketd::cluster::certs::init(&opts) {
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            Ok(exit::OK)
        }
        Err(e) if e.is_usage() => Err(Exit::usage(format!("certs init: {e}"))),
        Err(e) => Err(Exit {
            status: exit::FAILED,
            message: format!("certs init: {e}"),
        }),
    }
}

#[cfg(not(feature = "cluster"))]
fn certs_init(_args: Vec<OsString>) -> Result<u8, Exit> {
    Err(Exit::usage(
        "certs: this build has no cluster mode (built without the `cluster` feature)",
    ))
}

fn help(args: Vec<OsString>) -> Result<u8, Exit> {
    let text = match args.first().and_then(|a| a.to_str()) {
        None => HELP,
        Some("acquire") => HELP_ACQUIRE,
        Some("release") => HELP_RELEASE,
        Some("extend") => HELP_EXTEND,
        Some("run") => HELP_RUN,
        Some("certs") => HELP_CERTS,
        Some("status" | "locks" | "cluster") => HELP_ADMIN,
        Some(other) => return Err(Exit::usage(format!("no help for {other:?}"))),
    };
    print!("{text}");
    Ok(exit::OK)
}

const HELP_ADMIN: &str = "\
ticket status, locks, cluster status: what a server holds, from its admin port

USAGE:
    ticket status KEY [--json] [--admin ADDR]
    ticket locks [PREFIX] [--json] [--admin ADDR]
    ticket cluster status [--json] [--admin ADDR]
    ticket cluster add ID=HOST:PORT [--learner] [--catch-up-timeout S] [--admin ADDR]...
    ticket cluster promote ID [--admin ADDR]...
    ticket cluster remove ID [--force] [--admin ADDR]...

status prints one key's token (its #sequence unless the admin port is read
as --admin-identity), holder, time left on its lease, waiters and time
held; locks every registered key starting with PREFIX, in key order;
cluster status the node's view of its cluster. Aligned tables, or with
--json the admin port's own JSON (status: the object of /v1/locks/KEY;
locks: {\"locks\": [...]} with every page; cluster: /v1/cluster).

cluster add, promote and remove change the members (docs/OPERATIONS.md);
they go to the leader's admin port: give --admin once per node, and the
first that is the leader takes the change. add adds ID as a learner, waits
until its log is within 100 entries of the leader's commit (at most
--catch-up-timeout seconds, 60 by default: it then says why and leaves it a
learner), then promotes it, unless --learner. Start the node first with
`ticketd --cluster --join`. One change at a time; a removed id is never
accepted again; remove refuses to leave fewer than a majority of the
current voters reachable, unless --force.

OPTIONS:
    --admin ADDR    host:port of the server's admin port (--admin-listen),
                    https://HOST:PORT for one with --admin-tls-cert (trusting
                    --tls-ca, presenting --tls-cert and --tls-key if given,
                    or TICKET_TLS_CA, TICKET_TLS_CERT, TICKET_TLS_KEY), or
                    unix:/PATH for one on a Unix socket (default 127.0.0.1:7471)
    --json          print JSON instead of a table

Exits 0, 123 when status finds the key not registered, 125 when the admin
port cannot be read or answers an error.
";

/// How long one admin request may take.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `ticket cluster add/promote/remove` looks for a leader that
/// takes the change (an election may be under way).
const CHANGE_DEADLINE: Duration = Duration::from_secs(20);
/// How long one admin port gets to answer a change in that search.
const CHANGE_TRY_TIMEOUT: Duration = Duration::from_secs(3);

fn admin_addr(args: &mut pico_args::Arguments) -> Result<String, Exit> {
    let addr = args
        .opt_value_from_str::<_, String>("--admin")
        .map_err(|e| Exit::usage(e.to_string()))?
        .unwrap_or_else(|| ticketd::config::DEFAULT_ADMIN_LISTEN.to_owned());
    admin_tls(args)?;
    Ok(addr)
}

/// The TLS configuration for `--admin https://HOST:PORT`, read once per
/// run from `--tls-ca`, `--tls-cert` and `--tls-key` (or `TICKET_TLS_*`)
/// by [`admin_tls`]. `None`: no CA was given.
#[cfg(feature = "tls")]
static ADMIN_TLS: std::sync::OnceLock<Option<std::sync::Arc<rustls::ClientConfig>>> =
    std::sync::OnceLock::new();

/// Reads the TLS files an HTTPS admin port is spoken to with.
fn admin_tls(args: &mut pico_args::Arguments) -> Result<(), Exit> {
    let ca = tls_file(args, "--tls-ca", "TICKET_TLS_CA")?;
    let cert = tls_file(args, "--tls-cert", "TICKET_TLS_CERT")?;
    let key = tls_file(args, "--tls-key", "TICKET_TLS_KEY")?;
    if cert.is_some() != key.is_some() {
        return Err(Exit::usage(
            "--tls-cert and --tls-key (TICKET_TLS_CERT, TICKET_TLS_KEY) go together",
        ));
    }
    #[cfg(feature = "tls")]
    {
        let config = match &ca {
            Some(ca) => {
                let pair = cert.as_deref().zip(key.as_deref());
                Some(
                    ticketd::tls::client_config(ca, pair)
                        .map_err(|e| Exit::usage(e.to_string()))?,
                )
            }
            None if cert.is_some() => {
                return Err(Exit::usage(
                    "--tls-cert needs --tls-ca (TICKET_TLS_CA): the CA the admin port's \
                     certificate chains to",
                ))
            }
            None => None,
        };
        let _ = ADMIN_TLS.set(config);
    }
    #[cfg(not(feature = "tls"))]
    if ca.is_some() || cert.is_some() {
        return Err(Exit::usage(
            "--tls-ca: this ticket was built without TLS (the `tls` feature)",
        ));
    }
    Ok(())
}

/// One admin request: HTTPS for an `https://` address (trusting
/// `--tls-ca`), HTTP otherwise.
fn admin_request(
    addr: &str,
    method: &str,
    target: &str,
    timeout: Duration,
) -> Result<(u16, String), Exit> {
    let r = if addr.starts_with("https://") {
        #[cfg(feature = "tls")]
        {
            let Some(config) = ADMIN_TLS.get().and_then(Option::as_ref) else {
                return Err(Exit::usage(format!(
                    "--admin {addr}: HTTPS needs --tls-ca (TICKET_TLS_CA), the CA its \
                     certificate chains to"
                )));
            };
            admin::request_tls(addr, config, method, target, timeout)
        }
        #[cfg(not(feature = "tls"))]
        return Err(Exit::usage(format!(
            "--admin {addr}: this ticket was built without TLS (the `tls` feature)"
        )));
    } else {
        admin::request(addr, method, target, timeout)
    };
    r.map_err(|e| failed(e.to_string()))
}

fn failed(message: impl Into<String>) -> Exit {
    Exit {
        status: exit::FAILED,
        message: message.into(),
    }
}

/// `GET target`; a body for 200, `None` for 404, an error otherwise.
fn admin_get(addr: &str, target: &str) -> Result<Option<String>, Exit> {
    let (status, body) = admin_request(addr, "GET", target, ADMIN_TIMEOUT)?;
    match status {
        200 => Ok(Some(body)),
        404 => Ok(None),
        _ => Err(failed(format!("{addr}{target}: {status} {}", body.trim()))),
    }
}

fn parse_json(body: &str) -> Result<Json, Exit> {
    Json::parse(body).map_err(|e| failed(format!("the admin port answered {e}")))
}

/// Milliseconds as seconds with one decimal, or `-` when unknown.
fn ms(v: Option<&Json>) -> String {
    match v.and_then(Json::as_u64) {
        Some(ms) => format!("{}.{}s", ms / 1000, ms % 1000 / 100),
        None => "-".into(),
    }
}

fn num(v: Option<&Json>) -> String {
    v.and_then(Json::as_u64)
        .map_or_else(|| "-".into(), |n| n.to_string())
}

fn lock_rows(locks: &[Json]) -> Vec<Vec<String>> {
    let mut rows = vec![vec![
        "KEY".to_string(),
        "TOKEN".into(),
        "HOLDER".into(),
        "EXPIRES_IN".into(),
        "WAITERS".into(),
        "HELD_FOR".into(),
    ]];
    for l in locks {
        rows.push(vec![
            l.get("key")
                .and_then(Json::as_str)
                .unwrap_or("?")
                .escape_debug()
                .to_string(),
            token_or_sequence(l),
            l.get("holder")
                .and_then(Json::as_str)
                .unwrap_or("-")
                .escape_debug()
                .to_string(),
            ms(l.get("expires_in_ms")),
            num(l.get("waiters")),
            ms(l.get("held_for_ms")),
        ]);
    }
    rows
}

/// The token when the admin port shows it (to `--admin-identity`), else
/// `#SEQUENCE`: the token's sequence, which orders grants as tokens do.
fn token_or_sequence(l: &Json) -> String {
    match l.get("token") {
        Some(Json::Int(t)) => t.to_string(),
        _ => format!("#{}", num(l.get("sequence"))),
    }
}

fn print_out(text: &str) -> Result<u8, Exit> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| failed(format!("cannot print: {e}")))?;
    Ok(exit::OK)
}

/// `ticket status KEY`.
fn status(args: Vec<OsString>) -> Result<u8, Exit> {
    let mut args = pico_args::Arguments::from_vec(args);
    if args.contains(["-h", "--help"]) {
        print!("{HELP_ADMIN}");
        return Ok(exit::OK);
    }
    let json = args.contains("--json");
    let addr = admin_addr(&mut args)?;
    let key = free_string(&mut args, "KEY")?;
    finish(args)?;
    let target = format!("/v1/locks/{}", admin::percent_encode(&key));
    let Some(body) = admin_get(&addr, &target)? else {
        eprintln!("ticket: {key:?} is not registered");
        return Ok(exit::NOT_HELD);
    };
    if json {
        return print_out(&body);
    }
    let v = parse_json(&body)?;
    print_out(&admin::table(&lock_rows(std::slice::from_ref(&v))))
}

/// `ticket locks [PREFIX]`: every page, in key order.
fn locks(args: Vec<OsString>) -> Result<u8, Exit> {
    let mut args = pico_args::Arguments::from_vec(args);
    if args.contains(["-h", "--help"]) {
        print!("{HELP_ADMIN}");
        return Ok(exit::OK);
    }
    let json = args.contains("--json");
    let addr = admin_addr(&mut args)?;
    let prefix: String = args
        .opt_free_from_str()
        .map_err(|e| Exit::usage(format!("PREFIX: {e}")))?
        .unwrap_or_default();
    finish(args)?;
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut target = format!(
            "/v1/locks?limit=1000&prefix={}",
            admin::percent_encode(&prefix)
        );
        if let Some(a) = &after {
            target.push_str("&after=");
            target.push_str(&admin::percent_encode(a));
        }
        let body = admin_get(&addr, &target)?.ok_or_else(|| failed("no /v1/locks here"))?;
        let v = parse_json(&body)?;
        all.extend(
            v.get("locks")
                .map(Json::items)
                .unwrap_or(&[])
                .iter()
                .cloned(),
        );
        match v.get("next").and_then(Json::as_str) {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    if json {
        let mut out = String::from("{\"locks\":[");
        for (i, l) in all.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_json(&mut out, l);
        }
        out.push_str("]}\n");
        return print_out(&out);
    }
    print_out(&admin::table(&lock_rows(&all)))
}

fn write_json(out: &mut String, v: &Json) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Int(n) => out.push_str(&n.to_string()),
        Json::Num(n) => match v.as_u64() {
            Some(u) => out.push_str(&u.to_string()),
            None => out.push_str(&n.to_string()),
        },
        Json::Str(s) => ticketd::server::admin::json_str(out, s),
        Json::Arr(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_json(out, x);
            }
            out.push(']');
        }
        Json::Obj(m) => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ticketd::server::admin::json_str(out, k);
                out.push(':');
                write_json(out, x);
            }
            out.push('}');
        }
    }
}

/// `ticket cluster status`.
fn cluster(args: Vec<OsString>) -> Result<u8, Exit> {
    let mut args = pico_args::Arguments::from_vec(args);
    if args.contains(["-h", "--help"]) {
        print!("{HELP_ADMIN}");
        return Ok(exit::OK);
    }
    match args.subcommand().map_err(|e| Exit::usage(e.to_string()))? {
        Some(s) if s == "status" => {}
        Some(s) if s == "add" || s == "promote" || s == "remove" => {
            return cluster_change(&s, args);
        }
        Some(other) => return Err(Exit::usage(format!("unknown cluster subcommand {other:?}"))),
        None => {
            return Err(Exit::usage(
                "cluster: missing subcommand (status, add, promote, remove)",
            ))
        }
    }
    let json = args.contains("--json");
    let addr = admin_addr(&mut args)?;
    finish(args)?;
    let body = admin_get(&addr, "/v1/cluster")?
        .ok_or_else(|| failed(format!("{addr} is not a cluster node")))?;
    if json {
        return print_out(&body);
    }
    let v = parse_json(&body)?;
    print_out(&cluster_text(&v))
}

/// `ticket cluster status`: the node's view and a table of the members.
fn cluster_text(v: &Json) -> String {
    let leader = v.get("leader").and_then(Json::as_u64).unwrap_or(0);
    let mut text = format!(
        "node {}: leader {}, term {}, commit {}, applied {}\n\n",
        num(v.get("id")),
        if leader == 0 {
            "none".to_string()
        } else {
            leader.to_string()
        },
        num(v.get("term")),
        num(v.get("commit")),
        num(v.get("applied")),
    );
    let mut rows = vec![vec![
        "ID".to_string(),
        "ADDRESS".into(),
        "ROLE".into(),
        "MATCH".into(),
        "REACHABLE".into(),
    ]];
    for (list, learner) in [("voters", false), ("learners", true)] {
        for m in v.get(list).map(Json::items).unwrap_or(&[]) {
            let id = m.get("id").and_then(Json::as_u64).unwrap_or(0);
            let role = match (learner, id == leader) {
                (true, _) => "learner",
                (false, true) => "leader",
                (false, false) => "voter",
            };
            rows.push(vec![
                id.to_string(),
                m.get("address")
                    .and_then(Json::as_str)
                    .unwrap_or("-")
                    .to_owned(),
                role.into(),
                num(m.get("match")),
                match m.get("reachable") {
                    Some(Json::Bool(true)) => "yes".into(),
                    Some(Json::Bool(false)) => "no".into(),
                    _ => "-".into(),
                },
            ]);
        }
    }
    text.push_str(&admin::table(&rows));
    if matches!(v.get("joint"), Some(Json::Bool(true))) {
        let outgoing: Vec<String> = v
            .get("voters_outgoing")
            .map(Json::items)
            .unwrap_or(&[])
            .iter()
            .filter_map(Json::as_u64)
            .map(|id| id.to_string())
            .collect();
        text.push_str(&format!(
            "joint configuration: the voters above and the outgoing voters {} must both \
             agree until the change completes\n",
            outgoing.join(",")
        ));
    }
    text
}

/// The most entries a learner may lag the leader's commit to be promoted.
const CATCH_UP_ENTRIES: u64 = 100;

/// The node of `cluster add | promote | remove`: `ID`, or `ID=HOST:PORT`
/// for add.
fn parse_member(sub: &str, what: &str) -> Result<(u64, Option<SocketAddr>), Exit> {
    let usage = |m: String| Exit::usage(format!("cluster {sub}: {m}"));
    let (id, address) = match (sub, what.split_once('=')) {
        ("add", Some((id, a))) => (id, Some(a)),
        ("add", None) => return Err(usage(format!("{what:?}: give ID=HOST:PORT"))),
        (_, None) => (what, None),
        (_, Some(_)) => return Err(usage(format!("{what:?}: give the node id only"))),
    };
    let id: u64 = id
        .parse()
        .ok()
        .filter(|i| *i > 0)
        .ok_or_else(|| usage(format!("{id:?} is not a node id (1, 2, ...)")))?;
    let address = match address {
        Some(a) => Some(
            a.to_socket_addrs()
                .ok()
                .and_then(|mut i| i.next())
                .ok_or_else(|| usage(format!("{a:?} is not a HOST:PORT that resolves")))?,
        ),
        None => None,
    };
    Ok((id, address))
}

/// The admin request that makes the change.
fn member_request(
    sub: &str,
    id: u64,
    address: Option<SocketAddr>,
    force: bool,
) -> (String, &'static str) {
    match sub {
        "add" => (
            format!(
                "/v1/cluster/members/{id}?address={}",
                admin::percent_encode(&address.map(|a| a.to_string()).unwrap_or_default())
            ),
            "POST",
        ),
        "promote" => (format!("/v1/cluster/members/{id}/promote"), "POST"),
        _ => (
            format!(
                "/v1/cluster/members/{id}{}",
                if force { "?force=true" } else { "" }
            ),
            "DELETE",
        ),
    }
}

/// `ticket cluster add | promote | remove`.
fn cluster_change(sub: &str, mut args: pico_args::Arguments) -> Result<u8, Exit> {
    let usage = |m: String| Exit::usage(format!("cluster {sub}: {m}"));
    let learner_only = sub == "add" && args.contains("--learner");
    let force = sub == "remove" && args.contains("--force");
    let catch_up: u64 = if sub == "add" {
        args.opt_value_from_str("--catch-up-timeout")
            .map_err(|e| usage(e.to_string()))?
            .unwrap_or(60)
    } else {
        60
    };
    let mut admins: Vec<String> = args
        .values_from_str("--admin")
        .map_err(|e| usage(e.to_string()))?;
    if admins.is_empty() {
        admins.push(ticketd::config::DEFAULT_ADMIN_LISTEN.to_owned());
    }
    admin_tls(&mut args)?;
    let what: String = args
        .free_from_str()
        .map_err(|_| usage("missing the node (ID, or ID=HOST:PORT for add)".into()))?;
    finish(args)?;
    let (id, address) = parse_member(sub, &what)?;
    let (target, method) = member_request(sub, id, address, force);
    let leader = send_change(&admins, method, &target)?;
    match sub {
        "add" => {
            eprintln!("node {id} added as a learner (via {leader})");
            // The change is over once raft has left the joint configuration.
            wait_applied(&leader, |v| member_of(v, "learners", id))?;
            if learner_only {
                return Ok(exit::OK);
            }
            wait_caught_up(&leader, id, Duration::from_secs(catch_up))?;
            let target = format!("/v1/cluster/members/{id}/promote");
            let leader = send_change(&admins, "POST", &target)?;
            wait_applied(&leader, |v| member_of(v, "voters", id))?;
            eprintln!("node {id} promoted to voter");
        }
        "promote" => {
            wait_applied(&leader, |v| member_of(v, "voters", id))?;
            eprintln!("node {id} promoted to voter");
        }
        _ => {
            // The leader may have removed itself: any node will do.
            let _ = wait_applied(&leader, |v| {
                !member_of(v, "voters", id) && !member_of(v, "learners", id)
            });
            eprintln!("node {id} removed; its id is never accepted again");
        }
    }
    Ok(exit::OK)
}

fn member_of(v: &Json, list: &str, id: u64) -> bool {
    v.get(list)
        .map(Json::items)
        .unwrap_or(&[])
        .iter()
        .any(|m| m.get("id").and_then(Json::as_u64) == Some(id))
}

/// Sends a change to the first admin port that is the leader's; returns
/// that address.
fn send_change(admins: &[String], method: &str, target: &str) -> Result<String, Exit> {
    let deadline = Instant::now() + CHANGE_DEADLINE;
    loop {
        let mut why = Vec::new();
        let mut retry = false;
        for a in admins {
            // A node that does not answer (stopped, partitioned) must not
            // use up the whole deadline: each port gets a short turn.
            let left = deadline.saturating_duration_since(Instant::now());
            let timeout = CHANGE_TRY_TIMEOUT.min(left).max(Duration::from_millis(100));
            match admin_request(a, method, target, timeout) {
                Ok((200, _)) => return Ok(a.clone()),
                Ok((421, body)) => why.push(format!("{a}: {}", body.trim())),
                Ok((503, body)) => {
                    retry = true;
                    why.push(format!("{a}: {}", body.trim()));
                }
                Ok((status, body)) => {
                    return Err(failed(format!("{a}: {status}: {}", body.trim())));
                }
                Err(e) if e.status == exit::USAGE => return Err(e),
                Err(e) => {
                    // Unreachable now; it may be the leader once it is back.
                    retry = true;
                    why.push(e.message);
                }
            }
        }
        if !retry || Instant::now() >= deadline {
            return Err(failed(format!(
                "no admin port took the change: {}",
                why.join("; ")
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until `ok` holds of the leader's `/v1/cluster` and no change is
/// pending.
fn wait_applied(addr: &str, ok: impl Fn(&Json) -> bool) -> Result<(), Exit> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(body)) = admin_get(addr, "/v1/cluster") {
            if let Ok(v) = Json::parse(&body) {
                let pending = matches!(v.get("change_pending"), Some(Json::Bool(true)));
                if ok(&v) && !pending {
                    return Ok(());
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(failed(format!(
                "{addr}: the change did not apply within 10 s (ticket cluster status)"
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until learner `id`'s match index is within [`CATCH_UP_ENTRIES`]
/// of the leader's commit, at most `limit`.
fn wait_caught_up(addr: &str, id: u64, limit: Duration) -> Result<(), Exit> {
    let start = Instant::now();
    loop {
        let last = match admin_get(addr, "/v1/cluster") {
            Ok(Some(body)) => match Json::parse(&body) {
                Ok(v) => {
                    let commit = v.get("commit").and_then(Json::as_u64).unwrap_or(0);
                    let me = v
                        .get("learners")
                        .map(Json::items)
                        .unwrap_or(&[])
                        .iter()
                        .find(|m| m.get("id").and_then(Json::as_u64) == Some(id));
                    match me.and_then(|m| m.get("match")).and_then(Json::as_u64) {
                        Some(matched) if matched + CATCH_UP_ENTRIES >= commit && matched > 0 => {
                            eprintln!(
                                "node {id} caught up in {:.1} s (match {matched}, commit \
                                 {commit})",
                                start.elapsed().as_secs_f64()
                            );
                            return Ok(());
                        }
                        Some(matched) => {
                            let reachable = !matches!(
                                me.and_then(|m| m.get("reachable")),
                                Some(Json::Bool(false))
                            );
                            format!(
                                "its log reaches index {matched}, the leader's commit is \
                                 {commit} ({} behind){}",
                                commit.saturating_sub(matched),
                                if reachable {
                                    ""
                                } else {
                                    "; the leader has not heard from it recently \
                                     (is it running and reachable?)"
                                }
                            )
                        }
                        None => format!(
                            "{addr} is no longer the leader, or node {id} is no longer a \
                             learner"
                        ),
                    }
                }
                Err(e) => e.to_string(),
            },
            Ok(None) => format!("{addr} is not a cluster node"),
            Err(e) => e.message,
        };
        if start.elapsed() >= limit {
            return Err(failed(format!(
                "node {id} did not catch up within {} s, so it stays a learner (not \
                 promoted): {last}. Fix it and run `ticket cluster promote {id}`, or \
                 `ticket cluster remove {id}`",
                limit.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Options shared by the subcommands that acquire.
struct AcquireOpts {
    key: String,
    wait: Duration,
    lease: Duration,
    servers: Servers,
}

fn parse_wait(s: &str) -> Result<Duration, String> {
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

fn parse_lease(s: &str) -> Result<Duration, String> {
    match s.parse::<u8>() {
        Ok(n) if n > 0 => Ok(Duration::from_secs(u64::from(n))),
        _ => Err(format!("--lease {s:?} must be whole seconds in 1..=255")),
    }
}

fn parse_grace(s: &str) -> Result<Duration, String> {
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
struct Servers {
    addrs: Vec<String>,
    /// `--tls-ca`, `--tls-cert`, `--tls-key` (or `TICKET_TLS_CA`,
    /// `TICKET_TLS_CERT`, `TICKET_TLS_KEY`).
    tls_ca: Option<std::path::PathBuf>,
    tls_cert: Option<std::path::PathBuf>,
    tls_key: Option<std::path::PathBuf>,
}

/// A TLS file from its flag, else from its environment variable (an empty
/// variable counts as unset).
fn tls_file(
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

fn servers(args: &mut pico_args::Arguments) -> Result<Servers, Exit> {
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

fn free_string(args: &mut pico_args::Arguments, what: &str) -> Result<String, Exit> {
    match args.opt_free_from_str::<String>() {
        Ok(Some(s)) => Ok(s),
        Ok(None) => Err(Exit::usage(format!("missing {what}"))),
        Err(e) => Err(Exit::usage(format!("{what}: {e}"))),
    }
}

fn finish(args: pico_args::Arguments) -> Result<(), Exit> {
    let rest = args.finish();
    if let Some(first) = rest.first() {
        return Err(Exit::usage(format!(
            "unexpected argument {:?}",
            first.to_string_lossy()
        )));
    }
    Ok(())
}

fn parse_acquire_opts(args: &mut pico_args::Arguments) -> Result<AcquireOpts, Exit> {
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

fn client(servers: &Servers) -> Result<Client, Exit> {
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
fn unreachable(client: &Client) -> String {
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
fn lost_connection(client: &Client) -> String {
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
fn take(client: &Client, o: &AcquireOpts) -> Result<Ticket, Exit> {
    let outcome = client
        .acquire(&o.key, o.wait, o.lease)
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

fn acquire(args: Vec<OsString>) -> Result<u8, Exit> {
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

fn release(args: Vec<OsString>) -> Result<u8, Exit> {
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

fn extend(args: Vec<OsString>) -> Result<u8, Exit> {
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

/// How `ticket run` keeps its lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Renew {
    /// One lease only.
    Never,
    /// At a third of the lease, for as long as the command runs, or until
    /// this long after the grant.
    Until(Option<Duration>),
}

/// `--kill-grace`, `--no-renew` and `--max-hold` of `ticket run`, checked
/// against the lease.
fn renew_policy(
    args: &mut pico_args::Arguments,
    lease: Duration,
) -> Result<(Duration, Renew), Exit> {
    let given = args
        .opt_value_from_fn("--kill-grace", parse_grace)
        .map_err(|e| Exit::usage(e.to_string()))?;
    let no_renew = args.contains("--no-renew");
    let grace = given.unwrap_or_else(|| default_grace(lease, !no_renew));
    let max_hold = args
        .opt_value_from_fn("--max-hold", parse_max_hold)
        .map_err(|e| Exit::usage(e.to_string()))?;
    let renew = match (no_renew, max_hold) {
        (true, Some(_)) => return Err(Exit::usage("--no-renew and --max-hold exclude each other")),
        (true, None) => Renew::Never,
        (false, hold) => {
            if (grace + KILL_MARGIN) * 3 >= lease * 2 {
                return Err(Exit::usage(format!(
                    "with renewal, --kill-grace ({grace:?}) plus 0.5 s must stay below two \
                     thirds of --lease ({:?}): give a longer lease, a shorter --kill-grace, \
                     or --no-renew",
                    lease
                )));
            }
            Renew::Until(hold)
        }
    };
    Ok((grace, renew))
}

/// `--kill-grace` when not given: 2 s, or, with renewal and a short lease,
/// half the room the renewal leaves (two thirds of the lease less
/// [`KILL_MARGIN`]), so that any lease makes a valid command.
fn default_grace(lease: Duration, renew: bool) -> Duration {
    let default = Duration::from_secs_f64(DEFAULT_KILL_GRACE_S);
    if !renew {
        return default;
    }
    let room = (lease * 2 / 3).saturating_sub(KILL_MARGIN);
    default.min(room / 2)
}

/// `ticket run`'s command line.
struct RunArgs {
    o: AcquireOpts,
    grace: Duration,
    renew: Renew,
    /// Everything after the first `--`, untouched.
    command: Vec<OsString>,
}

/// Parses `ticket run`'s command line; `None` once `--help` is printed.
fn parse_run(mut args: Vec<OsString>) -> Result<Option<RunArgs>, Exit> {
    let separator = args.iter().position(|a| a == "--");
    let command = match separator {
        Some(i) => {
            let cmd = args.split_off(i + 1);
            args.pop();
            cmd
        }
        None => Vec::new(),
    };
    let given = args.clone();
    let mut args = pico_args::Arguments::from_vec(args);
    if args.contains(["-h", "--help"]) {
        print!("{HELP_RUN}");
        return Ok(None);
    }
    let o = parse_acquire_opts(&mut args)?;
    let (grace, renew) = renew_policy(&mut args, o.lease)?;
    let rest = args.finish();
    if let Some(first) = rest.first() {
        let mut message = format!("unexpected argument {:?}", first.to_string_lossy());
        if separator.is_none() {
            // `ticket run KEY CMD ARGS`: the command without its `--`.
            message.push_str(&format!(
                "; the command goes after --: {}",
                with_separator(&given, &rest)
            ));
        }
        return Err(Exit::usage(message));
    }
    if command.is_empty() {
        return Err(Exit::usage(
            "missing the command: ticket run KEY -- CMD [ARGS...]",
        ));
    }
    Ok(Some(RunArgs {
        o,
        grace,
        renew,
        command,
    }))
}

/// `ticket run` as it was given, with `--` put before `rest` (the
/// arguments no option took, the last ones of `given`), quoted for a shell.
fn with_separator(given: &[OsString], rest: &[OsString]) -> String {
    // Matched from the end: the key, or an option's value, may equal a word
    // of the command.
    let mut taken = vec![false; given.len()];
    let mut tail = given.len();
    for r in rest.iter().rev() {
        if let Some(i) = given[..tail].iter().rposition(|g| g == r) {
            taken[i] = true;
            tail = i;
        }
    }
    let options = given
        .iter()
        .zip(&taken)
        .filter(|(_, t)| !**t)
        .map(|(g, _)| g);
    let dashes = OsString::from("--");
    let mut line = String::from("ticket run");
    for w in options.chain(std::iter::once(&dashes)).chain(rest) {
        line.push(' ');
        line.push_str(&shell_word(&w.to_string_lossy()));
    }
    line
}

/// `word` as a shell reads it back: bare if it is plain, else in single
/// quotes.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:=,+@%".contains(&b));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

fn run(args: Vec<OsString>) -> Result<u8, Exit> {
    let Some(RunArgs {
        o,
        grace,
        renew,
        command,
    }) = parse_run(args)?
    else {
        return Ok(exit::OK);
    };
    let Some((program, program_args)) = command.split_first() else {
        return Err(Exit::usage("missing the command"));
    };
    let client = client(&o.servers)?;
    let ticket = take(&client, &o)?;
    // Installed only now, so a Ctrl-C while waiting for the lock still ends
    // `ticket` at once (closing the connection cancels the queued acquire).
    let signals = match Forwarded::install() {
        Ok(s) => s,
        Err(e) => {
            let _ = ticket.release();
            return Err(e);
        }
    };
    // Forked before the command, so it guards the command's group from
    // the start; stood down only once the lock is released.
    let guardian = match guardian::Guardian::start() {
        Ok(g) => g,
        Err(e) => {
            let _ = ticket.release();
            return Err(Exit {
                status: exit::CANNOT_RUN,
                message: format!("cannot start the guardian process: {e}"),
            });
        }
    };
    let first_expiry = ticket.expires_at_system();
    let mut held = match renew {
        Renew::Never => Held::Once(ticket),
        Renew::Until(_) => Held::Kept(ticket.keep_alive()),
    };
    let hold_until = match renew {
        Renew::Until(Some(h)) => Some(Instant::now() + h),
        _ => None,
    };
    let cmd = Cmd {
        program,
        args: program_args,
        guardian: guardian.fd(),
    };
    let status = supervise(&mut held, first_expiry, hold_until, &cmd, grace, &signals);
    report_release(&client, held);
    guardian.stand_down();
    status
}

/// Releases `ticket run`'s lock, saying in words what went wrong, if
/// anything did.
fn report_release(client: &Client, held: Held) {
    let key = held.key().to_owned();
    match held.release() {
        Ok(Release::Released) => {}
        Ok(Release::NotHeld) => {
            eprintln!("ticket: releasing {key:?}: it was no longer held (its lease had ended)");
        }
        Ok(Release::Indeterminate) => eprintln!(
            "ticket: releasing {key:?}: no answer, so it may still be held until its lease \
             ends{}",
            lost_connection(client)
        ),
        Ok(Release::NotSent) => eprintln!(
            "ticket: releasing {key:?}: not released{}; it is held until its lease ends",
            unreachable(client)
        ),
        Err(e) => eprintln!("ticket: releasing {key:?}: {e}"),
    }
}

fn parse_max_hold(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("--max-hold {s:?} is not a number of seconds"))?;
    if !v.is_finite() || !(0.0..=1e9).contains(&v) {
        return Err(format!("--max-hold {s:?} must be 0 or more seconds"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// The lock `ticket run` holds: one lease, or renewed in the background.
enum Held {
    Once(Ticket),
    Kept(KeptTicket),
}

impl Held {
    fn key(&self) -> &str {
        match self {
            Held::Once(t) => t.key(),
            Held::Kept(k) => k.key(),
        }
    }

    fn token(&self) -> u64 {
        match self {
            Held::Once(t) => t.token(),
            Held::Kept(k) => k.token(),
        }
    }

    fn expires_at(&self) -> Instant {
        match self {
            Held::Once(t) => t.expires_at(),
            Held::Kept(k) => k.expires_at(),
        }
    }

    /// Lost for good: no renewal will move the expiry any more.
    fn is_lost(&self) -> bool {
        match self {
            Held::Once(t) => t.is_expired(),
            Held::Kept(k) => k.is_lost(),
        }
    }

    /// Whether a background renewal may still move the expiry.
    fn renewing(&self) -> bool {
        matches!(self, Held::Kept(k) if !k.is_lost() && k.is_renewing())
    }

    fn stop_renewing(&mut self) {
        if let Held::Kept(k) = self {
            k.stop_renewing();
        }
    }

    fn release(self) -> Result<Release, ticketd::client::Error> {
        match self {
            Held::Once(t) => t.release(),
            Held::Kept(k) => k.release(),
        }
    }
}

/// Signals `ticket run` passes on to its command, flagged as they arrive.
struct Forwarded {
    flags: Vec<(i32, Arc<AtomicBool>)>,
}

impl Forwarded {
    fn install() -> Result<Forwarded, Exit> {
        let mut flags = Vec::new();
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            let flag = Arc::new(AtomicBool::new(false));
            signal_hook::flag::register(sig, Arc::clone(&flag)).map_err(|e| Exit {
                status: exit::CANNOT_RUN,
                message: format!("cannot install a signal handler: {e}"),
            })?;
            flags.push((sig, flag));
        }
        Ok(Forwarded { flags })
    }

    /// Signals that arrived since the last call, in a fixed order.
    fn take(&self) -> Vec<i32> {
        self.flags
            .iter()
            .filter(|(_, f)| f.swap(false, Ordering::SeqCst))
            .map(|(sig, _)| *sig)
            .collect()
    }
}

/// Sends `sig` to the process group led by `pid`.
fn signal_group(pid: u32, sig: i32) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill(2) has no memory-safety preconditions. A negative pid
        // addresses the process group the child leads.
        unsafe {
            libc::kill(-pid, sig);
        }
    }
}

/// The command `ticket run` starts, and the guardian it reports to.
struct Cmd<'a> {
    program: &'a OsString,
    args: &'a [OsString],
    /// The write end of the guardian's pipe ([`guardian::announce`]).
    guardian: std::os::fd::RawFd,
}

/// Starts the command in its own process group with the ticket in its
/// environment, to die with `ticket`: by PR_SET_PDEATHSIG, and its whole
/// group by the guardian.
fn spawn(
    held: &Held,
    first_expiry: std::time::SystemTime,
    cmd: &Cmd<'_>,
) -> Result<std::process::Child, Exit> {
    use std::os::unix::process::CommandExt;

    let expires_unix_s = first_expiry
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // SAFETY: getpid(2) has no preconditions.
    let parent = unsafe { libc::getpid() };
    let (program, guard) = (cmd.program, cmd.guardian);
    let mut command = Command::new(program);
    command
        .args(cmd.args)
        .env("TICKET_KEY", held.key())
        .env("TICKET_TOKEN", held.token().to_string())
        .env("TICKET_EXPIRES_AT", expires_unix_s.to_string())
        // Its own group, so the end of the lease stops its children too.
        .process_group(0);
    // SAFETY: the closure runs in the child between fork and exec and calls
    // only async-signal-safe functions (prctl, getppid, setpgid, getpgrp,
    // signal, write, _exit) and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            // The command must not outlive `ticket` unnoticed: once the
            // lock's keeper is gone, nobody would stop it before the lease.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                // `ticket` died before the death signal was armed.
                libc::_exit(exit::LEASE_ENDED.into());
            }
            // The group exists before the guardian learns it (process_group
            // above did the same; doing it here does not depend on the order).
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Before exec, so before the command can start any child.
            if !guardian::announce(guard) {
                return Err(std::io::Error::from_raw_os_error(libc::EPIPE));
            }
            Ok(())
        });
    }
    match command.spawn() {
        Ok(c) => Ok(c),
        Err(e) => {
            let status = if e.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_RUN
            };
            let why = if e.raw_os_error() == Some(libc::EPIPE) {
                "the guardian process is gone".to_owned()
            } else {
                e.to_string()
            };
            Err(Exit {
                status,
                message: format!("cannot run {:?}: {why}", program.to_string_lossy()),
            })
        }
    }
}

/// Runs the command under the lock and returns `ticket`'s exit status.
///
/// The command is stopped (SIGTERM, then SIGKILL `grace` later) when the
/// lock is lost, or when its lease is about to end and no renewal can move
/// it any more; SIGKILL goes out at the latest [`KILL_MARGIN`] before the
/// conservative expiry, whatever else happens.
// Long because the poll loop's escalation (forward signals, TERM before the
// lease ends, KILL at its margin) reads the child and the lease together.
fn supervise(
    held: &mut Held,
    first_expiry: std::time::SystemTime,
    hold_until: Option<Instant>,
    cmd: &Cmd<'_>,
    grace: Duration,
    signals: &Forwarded,
) -> Result<u8, Exit> {
    let mut child = spawn(held, first_expiry, cmd)?;
    let pid = child.id();
    let mut term_at: Option<Instant> = None;
    let mut termed = false;
    let mut killed = false;
    let status: ExitStatus = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => {
                signal_group(pid, libc::SIGKILL);
                let _ = child.wait();
                return Err(Exit {
                    status: exit::CANNOT_RUN,
                    message: format!("lost track of the command: {e}"),
                });
            }
        }
        for sig in signals.take() {
            signal_group(pid, sig);
        }
        let now = Instant::now();
        if hold_until.is_some_and(|h| now >= h) {
            held.stop_renewing();
        }
        let kill_at = held.expires_at().checked_sub(KILL_MARGIN).unwrap_or(now);
        if term_at.is_none() {
            if held.is_lost() {
                term_at = Some(now);
            } else if !held.renewing() {
                term_at = Some(kill_at.checked_sub(grace).unwrap_or(now));
            } else if now + grace >= kill_at {
                // A renewal is overdue: stop the command in time anyway.
                term_at = Some(now);
            }
        }
        if !killed && (now >= kill_at || term_at.is_some_and(|t| now >= t + grace)) {
            signal_group(pid, libc::SIGKILL);
            killed = true;
        } else if !termed && term_at.is_some_and(|t| now >= t) {
            signal_group(pid, libc::SIGTERM);
            termed = true;
        }
        std::thread::sleep(POLL);
    };
    if termed || killed {
        // Whatever is left of the group must not outlive the lease either.
        signal_group(pid, libc::SIGKILL);
        let why = if held.is_lost() {
            "the lock was lost"
        } else {
            "the lease was about to end"
        };
        return Err(Exit {
            status: exit::LEASE_ENDED,
            message: format!("{why} on {:?}: the command was terminated", held.key()),
        });
    }
    use std::os::unix::process::ExitStatusExt;
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(u8::MAX),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(u8::MAX),
        (None, None) => u8::MAX,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
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

    #[test]
    fn the_default_kill_grace_fits_every_lease() {
        for lease_s in 1..=255 {
            let lease = Duration::from_secs(lease_s);
            let grace = default_grace(lease, true);
            assert!((grace + KILL_MARGIN) * 3 < lease * 2, "--lease {lease_s}");
            assert!(grace <= Duration::from_secs(2));
            let mut args = pico_args::Arguments::from_vec(Vec::new());
            assert!(renew_policy(&mut args, lease).is_ok(), "--lease {lease_s}");
        }
        assert_eq!(
            default_grace(Duration::from_secs(30), true),
            Duration::from_secs(2)
        );
        assert_eq!(
            default_grace(Duration::from_secs(3), true),
            Duration::from_millis(750)
        );
        assert_eq!(
            default_grace(Duration::from_secs(3), false),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn usage_errors_are_reported_before_connecting() {
        let usage = |v: &[&str]| match dispatch(os(v)) {
            Err(e) => e.status,
            Ok(s) => s,
        };
        assert_eq!(usage(&[]), exit::USAGE);
        assert_eq!(usage(&["frobnicate"]), exit::USAGE);
        assert_eq!(usage(&["acquire"]), exit::USAGE);
        assert_eq!(usage(&["acquire", "k", "--lease", "0"]), exit::USAGE);
        assert_eq!(usage(&["acquire", "k", "--wait", "x"]), exit::USAGE);
        assert_eq!(usage(&["acquire", "k", "extra"]), exit::USAGE);
        assert_eq!(usage(&["acquire", ""]), exit::USAGE);
        assert_eq!(usage(&["release", "k"]), exit::USAGE);
        assert_eq!(usage(&["release", "k", "-3"]), exit::USAGE);
        assert_eq!(usage(&["run", "k"]), exit::USAGE);
        assert_eq!(usage(&["run", "k", "--"]), exit::USAGE);
        assert_eq!(usage(&["extend", "k"]), exit::USAGE);
        assert_eq!(usage(&["extend", "k", "x"]), exit::USAGE);
        assert_eq!(usage(&["extend", "k", "1", "--lease", "0"]), exit::USAGE);
        // Renewal needs room between the renewal and the SIGTERM.
        assert_eq!(
            usage(&[
                "run",
                "k",
                "--lease",
                "3",
                "--kill-grace",
                "2",
                "--",
                "true"
            ]),
            exit::USAGE
        );
        assert_eq!(
            usage(&["run", "k", "--no-renew", "--max-hold", "9", "--", "true"]),
            exit::USAGE
        );
        assert_eq!(usage(&["help", "extend"]), exit::OK);
        assert_eq!(usage(&["acquire", "k", "--server", "nowhere"]), exit::USAGE);
        assert_eq!(usage(&["help", "acquire"]), exit::OK);
        assert_eq!(usage(&["run", "--help"]), exit::OK);
    }

    #[test]
    fn a_command_without_its_separator_is_shown_with_it() {
        let message = |v: &[&str]| match dispatch(os(v)) {
            Err(e) => e.message,
            Ok(_) => panic!("{v:?} was accepted"),
        };
        let m = message(&["run", "k", "sleep", "1"]);
        assert!(m.contains("\"sleep\""), "{m}");
        assert!(m.ends_with("ticket run k -- sleep 1"), "{m}");
        let m = message(&["run", "sleep", "--lease", "5", "sleep", "5"]);
        assert!(m.ends_with("ticket run sleep --lease 5 -- sleep 5"), "{m}");
        let m = message(&["run", "k", "sh", "-c", "echo it's"]);
        assert!(m.ends_with("ticket run k -- sh -c 'echo it'\\''s'"), "{m}");
        // With the separator, a stray word gets no suggestion.
        let m = message(&["run", "k", "extra", "--", "true"]);
        assert!(!m.contains("goes after"), "{m}");
    }
}

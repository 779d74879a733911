//! `ticket status` and `ticket locks`: what a server holds, read from its
//! admin port.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::time::Duration;

use ticketd::client::admin::{self, AdminError, Json};

use crate::args::{finish, free_string, tls_file};
use crate::{exit, failed, Exit};

pub(crate) const HELP_ADMIN: &str = "\
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

pub(crate) fn admin_addr(args: &mut pico_args::Arguments) -> Result<String, Exit> {
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
pub(crate) fn admin_tls(args: &mut pico_args::Arguments) -> Result<(), Exit> {
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
pub(crate) fn admin_request(
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

/// `GET target`; a body for 200, `None` for 404, an error otherwise.
pub(crate) fn admin_get(addr: &str, target: &str) -> Result<Option<String>, Exit> {
    let (status, body) = admin_request(addr, "GET", target, ADMIN_TIMEOUT)?;
    match status {
        200 => Ok(Some(body)),
        404 => Ok(None),
        _ => Err(failed(
            AdminError::Status {
                addr: addr.to_owned(),
                target: target.to_owned(),
                status,
                body,
            }
            .to_string(),
        )),
    }
}

pub(crate) fn parse_json(body: &str) -> Result<Json, Exit> {
    Json::parse(body).map_err(|e| failed(format!("the admin port answered {e}")))
}

/// Milliseconds as seconds with one decimal, or `-` when unknown.
fn ms(v: Option<&Json>) -> String {
    match v.and_then(Json::as_u64) {
        Some(ms) => format!("{}.{}s", ms / 1000, ms % 1000 / 100),
        None => "-".into(),
    }
}

pub(crate) fn num(v: Option<&Json>) -> String {
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
        if l.get("limit").is_some() {
            rows.push(permit_row(l));
            continue;
        }
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

/// A key of limit 2 or more (PROTOCOL §6): its holders as
/// `COUNT/LIMIT: T,T` (tokens or sequences, oldest first, an exclusive
/// one marked `x`), the earliest expiry, the waiters with how many are
/// shared and exclusive, the longest hold.
fn permit_row(l: &Json) -> Vec<String> {
    let holders = l.get("holders").map(Json::items).unwrap_or(&[]);
    let marks: Vec<String> = holders
        .iter()
        .map(|g| {
            let x = g.get("mode").and_then(Json::as_str) == Some("exclusive");
            format!("{}{}", token_or_sequence(g), if x { "x" } else { "" })
        })
        .collect();
    let earliest = holders
        .iter()
        .filter_map(|g| g.get("expires_in_ms").and_then(Json::as_u64))
        .min();
    let longest = holders
        .iter()
        .filter_map(|g| g.get("held_for_ms").and_then(Json::as_u64))
        .max();
    let names: Vec<&str> = holders
        .iter()
        .filter_map(|g| g.get("holder").and_then(Json::as_str))
        .collect();
    vec![
        l.get("key")
            .and_then(Json::as_str)
            .unwrap_or("?")
            .escape_debug()
            .to_string(),
        format!(
            "{}/{}: {}",
            holders.len(),
            num(l.get("limit")),
            if marks.is_empty() {
                "-".into()
            } else {
                marks.join(",")
            }
        ),
        if names.is_empty() {
            "-".into()
        } else {
            names.join(",").escape_debug().to_string()
        },
        ms(earliest.map(Json::Int).as_ref()),
        format!(
            "{} ({} shared, {} exclusive)",
            num(l.get("waiters")),
            num(l.get("waiters_shared")),
            num(l.get("waiters_exclusive"))
        ),
        ms(longest.map(Json::Int).as_ref()),
    ]
}

/// The token when the admin port shows it (to `--admin-identity`), else
/// `#SEQUENCE`: the token's sequence, which orders grants as tokens do.
fn token_or_sequence(l: &Json) -> String {
    match l.get("token") {
        Some(Json::Int(t)) => t.to_string(),
        _ => format!("#{}", num(l.get("sequence"))),
    }
}

pub(crate) fn print_out(text: &str) -> Result<u8, Exit> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| failed(format!("cannot print: {e}")))?;
    Ok(exit::OK)
}

/// `ticket status KEY`.
pub(crate) fn status(args: Vec<OsString>) -> Result<u8, Exit> {
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
pub(crate) fn locks(args: Vec<OsString>) -> Result<u8, Exit> {
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
        let out = Json::Obj(BTreeMap::from([("locks".to_owned(), Json::Arr(all))]));
        return print_out(&format!("{out}\n"));
    }
    print_out(&admin::table(&lock_rows(&all)))
}

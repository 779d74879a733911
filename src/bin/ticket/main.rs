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
//! ticket cluster add ID=HOST:PORT | promote ID | remove ID [--admin ADDR]...
//! ticket certs init DIR [--cluster-name NAME] [--nodes N]
//! ```
//!
//! One module a group of subcommands: [`lock`] (acquire, release, extend,
//! with [`args`], their command line), [`run`] (with [`guardian`]),
//! [`admin`] (status, locks), [`cluster`] and [`certs`].
//!
//! Built on `ticketd::client`, so every PROTOCOL §3 rule holds here too: the CLI
//! never reports "acquired" unless the lock is held, and `run` never starts
//! the command on a guess. Exit statuses are listed in [`exit`] and in
//! `docs/CLIENT.md`.

mod admin;
mod args;
mod certs;
mod cluster;
mod guardian;
mod lock;
mod run;

use std::ffi::OsString;

/// The exit statuses of `ticket`. `run` otherwise exits with its command's
/// status (or 128 + the signal that ended it).
pub(crate) mod exit {
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

/// A failure that ends the process with a status and a message.
pub(crate) struct Exit {
    pub(crate) status: u8,
    pub(crate) message: String,
}

impl Exit {
    pub(crate) fn usage(message: impl Into<String>) -> Exit {
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
        "acquire" => lock::acquire(args),
        "release" => lock::release(args),
        "extend" => lock::extend(args),
        "run" => run::run(args),
        "certs" => certs::certs(args),
        "status" => admin::status(args),
        "locks" => admin::locks(args),
        "cluster" => cluster::cluster(args),
        "help" | "--help" | "-h" => help(args),
        other => Err(Exit::usage(format!("unknown subcommand {other:?}"))),
    }
}

fn help(args: Vec<OsString>) -> Result<u8, Exit> {
    let text = match args.first().and_then(|a| a.to_str()) {
        None => HELP,
        Some("acquire") => lock::HELP_ACQUIRE,
        Some("release") => lock::HELP_RELEASE,
        Some("extend") => lock::HELP_EXTEND,
        Some("run") => run::HELP_RUN,
        Some("certs") => certs::HELP_CERTS,
        Some("status" | "locks" | "cluster") => admin::HELP_ADMIN,
        Some(other) => return Err(Exit::usage(format!("no help for {other:?}"))),
    };
    print!("{text}");
    Ok(exit::OK)
}

pub(crate) fn failed(message: impl Into<String>) -> Exit {
    Exit {
        status: exit::FAILED,
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
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

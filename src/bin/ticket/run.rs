//! `ticket run`: a command run while holding a lock, stopped before the
//! lock can be lost, with the guardian ([`crate::guardian`]) beside it.

use std::ffi::OsString;
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use ticketd::client::{Client, KeptTicket, Release, Ticket};

use crate::args::{parse_acquire_opts, parse_grace, AcquireOpts};
use crate::guardian;
use crate::lock::{client, lost_connection, take, unreachable};
use crate::{exit, Exit};

const DEFAULT_KILL_GRACE_S: f64 = 2.0;
/// SIGKILL goes out this long before the conservative local expiry, so the
/// command is gone before the server can grant the key to anyone else.
const KILL_MARGIN: Duration = Duration::from_millis(500);
/// How often `run` looks at its command and at signals.
const POLL: Duration = Duration::from_millis(10);

pub(crate) const HELP_RUN: &str = "\
ticket run: run a command while holding a lock

USAGE:
    ticket run KEY [--wait S] [--lease S] [--kill-grace S] [--no-renew | --max-hold S]
               [--permits N] [--shared | --exclusive] [--server ADDR]... -- CMD [ARGS...]

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
    --permits N, --shared, --exclusive   as for `ticket acquire`: run CMD
                     while holding one of N places, or a read/write hold
    --kill-grace S   seconds between SIGTERM and SIGKILL (default 2, less
                     with renewal and a lease under 7 s)
    --no-renew       hold one lease only: CMD is stopped before it ends
    --max-hold S     stop renewing S seconds after the grant (then as
                     --no-renew: CMD is stopped before that lease ends)

Exits 120, 121 or 122 without running CMD if the lock is not acquired.
";

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

pub(crate) fn run(args: Vec<OsString>) -> Result<u8, Exit> {
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
}

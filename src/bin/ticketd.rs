//! `ticketd`: the lock server daemon (single mode).
//!
//! Exit status: 0 after SIGTERM/SIGINT, 1 when it cannot start or the loop
//! fails, 2 for a bad command line. Logs go to stderr.

use std::process::ExitCode;

use ticketd::config::{self, Config, Parsed};
use ticketd::server::Server;
use ticketd::single::SingleService;

fn main() -> ExitCode {
    let config = match config::parse_args(std::env::args_os().skip(1).collect()) {
        Ok(Parsed::Run(c)) => c,
        Ok(Parsed::Help) => {
            print!("{}", config::HELP);
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Version) => {
            println!("ticketd {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("ticketd: {e}\nTry 'ticketd --help' for the list of flags.");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = simple_logger::SimpleLogger::new()
        .with_level(config.log_level)
        .with_utc_timestamps()
        .init()
    {
        eprintln!("ticketd: cannot start logging: {e}");
        return ExitCode::from(1);
    }
    match serve(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            ExitCode::from(1)
        }
    }
}

fn serve(config: Config) -> Result<(), String> {
    raise_fd_limit(config.max_conns);
    let service = SingleService::open(&config).map_err(|e| {
        let dir = config
            .data_dir
            .as_ref()
            .map_or_else(String::new, |d| format!(" {}", d.display()));
        format!("cannot open the data directory{dir}: {e}")
    })?;
    let listen = config.listen;
    let mut server =
        Server::bind(config, service).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    server
        .handle_signals()
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    server.run().map_err(|e| format!("event loop failed: {e}"))
}

/// Raises the soft open-file limit towards the hard one so `--max-conns`
/// connections fit, and warns when they cannot: beyond the limit, accepting
/// pauses on EMFILE and the extra connections wait in the backlog.
// rlim_t is u64 on some targets and not on others.
#[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
fn raise_fd_limit(max_conns: usize) {
    // Listener, poll, waker, signal pipe, stdio, a data-dir file: some spare.
    let wanted = u64::try_from(max_conns)
        .unwrap_or(u64::MAX)
        .saturating_add(32);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass and nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    let soft = u64::from(lim.rlim_cur);
    let hard = u64::from(lim.rlim_max);
    if soft < wanted {
        let target = wanted.min(hard);
        let new = libc::rlimit {
            rlim_cur: target as libc::rlim_t,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads the struct we pass and nothing else.
        let raised = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } == 0;
        let now = if raised { target } else { soft };
        if now < wanted {
            log::warn!(
                "the open-file limit is {now}, below --max-conns {max_conns} plus spare \
                 descriptors; connections beyond it wait until others close"
            );
        }
    }
}

//! `ticketd`: the lock server daemon (single mode).
//!
//! Exit status: 0 after SIGTERM/SIGINT, 1 when it cannot start or the loop
//! fails, 2 for a bad command line. Logs go to stderr.

use std::panic::{self, AssertUnwindSafe};
use std::process::ExitCode;

use ticketd::config::{self, Config, Parsed};
use ticketd::server::{Server, StartError};
use ticketd::single::{OpenError, SingleService};

fn main() -> ExitCode {
    #[cfg(feature = "cluster")]
    if std::env::args_os().any(|a| a == "--cluster") {
        return ticketd::cluster::cli::main(std::env::args_os().skip(1).collect());
    }
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
    let logger = simple_logger::SimpleLogger::new()
        .with_level(config.log_level)
        .with_utc_timestamps();
    log::set_max_level(config.log_level);
    if let Err(e) = log::set_boxed_logger(Box::new(Survivable(logger))) {
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

/// simple_logger writes with `eprintln!`, which panics when stderr is gone
/// (a closed pipe, a restarted log collector). A lost log line must not take
/// the lock server down with it: the panic is caught and the line dropped.
struct Survivable(simple_logger::SimpleLogger);

impl log::Log for Survivable {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.0.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        let _ = panic::catch_unwind(AssertUnwindSafe(|| self.0.log(record)));
    }

    fn flush(&self) {
        let _ = panic::catch_unwind(AssertUnwindSafe(|| self.0.flush()));
    }
}

fn serve(config: Config) -> Result<(), String> {
    let max_conns = config.max_conns;
    let service = SingleService::open(&config).map_err(|e| match &e {
        OpenError::DataDir { dir, .. } => {
            format!("cannot open the data directory {}: {e}", dir.display())
        }
        _ => match &config.data_dir {
            Some(dir) => format!("cannot open the data directory {}: {e}", dir.display()),
            None => format!("cannot open the data directory: {e}"),
        },
    })?;
    let listen = config.listen;
    let mut server = Server::bind(config, service).map_err(|e| match &e {
        StartError::Config(_) | StartError::SocketActivation { .. } => {
            format!("cannot start: {e}")
        }
        #[cfg(feature = "tls")]
        StartError::Tls(_) => format!("cannot start: {e}"),
        _ => format!("cannot listen on {listen}: {e}"),
    })?;
    // Before the first accept, after the start-up line (which comes first).
    raise_fd_limit(max_conns);
    server
        .handle_signals()
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    server.run().map_err(|e| format!("event loop failed: {e}"))
}

/// Makes room for `--max-conns` connections, and warns when there is none:
/// beyond the limit, accepting pauses on EMFILE and the extra connections
/// wait in the backlog.
fn raise_fd_limit(max_conns: usize) {
    // Listener, poll, waker, signal pipe, stdio, data-dir files: some spare.
    let wanted = u64::try_from(max_conns)
        .unwrap_or(u64::MAX)
        .saturating_add(32);
    match ticketd::server::raise_open_file_limit(wanted) {
        Ok(limit) if limit < wanted => log::warn!(
            "the open-file limit is {limit}, below --max-conns {max_conns} plus spare \
             descriptors; connections beyond it wait until others close"
        ),
        Ok(_) => {}
        Err(e) => log::warn!("cannot read or raise the open-file limit: {e}"),
    }
}

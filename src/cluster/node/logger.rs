//! raft-rs logs through slog: these loggers forward it to the `log` crate,
//! or drop it.

/// A logger for raft that forwards its output to the `log` crate (target
/// `raft`): warnings and errors at their level, and raft's Info messages
/// at Debug. Those are routine (elections, votes, becoming follower or
/// candidate, configuration switches); the events worth an Info line
/// (this node became leader, whom it follows, a configuration applied, a
/// snapshot installed) are logged by the node in its own words. raft's
/// Debug output is dropped here, since slog's bridge would bypass the
/// `log` level.
pub fn raft_logger() -> slog::Logger {
    slog::Logger::root(LogDrain, slog::o!())
}

/// A logger that drops everything (simulations, tests).
pub fn quiet_logger() -> slog::Logger {
    slog::Logger::root(slog::Discard, slog::o!())
}

struct LogDrain;

impl slog::Drain for LogDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &slog::Record<'_>, _: &slog::OwnedKVList) -> Result<(), slog::Never> {
        let level = match record.level() {
            slog::Level::Critical | slog::Level::Error => log::Level::Error,
            slog::Level::Warning => log::Level::Warn,
            slog::Level::Info => log::Level::Debug,
            slog::Level::Debug | slog::Level::Trace => return Ok(()),
        };
        if log::log_enabled!(target: "raft", level) {
            log::log!(target: "raft", level, "{}", record.msg());
        }
        Ok(())
    }
}

//! The limit on open files, raised at start-up to fit `--max-conns`.

use std::io;

/// Raises the soft limit on open files (`RLIMIT_NOFILE`) towards `wanted`,
/// as far as the hard limit allows, and returns the soft limit in force
/// afterwards. Never lowers it. A server with `max_conns` connections wants
/// `max_conns` plus a few descriptors for itself.
///
/// # Errors
/// The limit cannot be read.
// rlim_t is u64 on some targets and not on others.
#[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
pub fn raise_open_file_limit(wanted: u64) -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass and nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let soft = u64::from(lim.rlim_cur);
    let hard = u64::from(lim.rlim_max);
    if soft >= wanted {
        return Ok(soft);
    }
    let target = wanted.min(hard);
    let new = libc::rlimit {
        rlim_cur: target as libc::rlim_t,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit reads the struct we pass and nothing else.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } == 0 {
        Ok(target)
    } else {
        Ok(soft)
    }
}

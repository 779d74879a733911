//! [`OpenError`]: why [`super::SingleService::open`] cannot open the service.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Why single mode's service cannot open, by what failed. Its `Display`
/// is the reason for a person; the `ticketd` binary puts it after "cannot
/// open the data directory".
#[derive(Debug)]
#[non_exhaustive]
pub enum OpenError {
    /// The OS random number generator cannot be read (every token's low
    /// bits come from it).
    Rng(io::Error),
    /// The data directory cannot be used: it cannot be created, read,
    /// locked or written, others may write to it, or its token mark is
    /// missing, damaged or below its floor. The error names the file.
    DataDir {
        /// The data directory (`--data-dir`).
        dir: PathBuf,
        /// What is wrong with it.
        source: io::Error,
    },
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpenError::Rng(e) => write!(
                f,
                "cannot read the OS random number generator (tokens need it): {e}"
            ),
            OpenError::DataDir { source, .. } => write!(f, "{source}"),
        }
    }
}

impl std::error::Error for OpenError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            OpenError::Rng(e) | OpenError::DataDir { source: e, .. } => Some(e),
        }
    }
}

/// For callers that handle every start-up failure as an `io::Error`: the
/// kind of the error underneath, the message of the `Display`.
impl From<OpenError> for io::Error {
    fn from(e: OpenError) -> io::Error {
        let kind = match &e {
            OpenError::Rng(source) | OpenError::DataDir { source, .. } => source.kind(),
        };
        io::Error::new(kind, e.to_string())
    }
}

//! The client's error type: bad arguments and bad configuration.
//!
//! Transport trouble is never an [`Error`]: PROTOCOL §3 turns it into a definite
//! outcome ([`crate::client::Acquire::Timeout`] when the request was never
//! sent) or into `Indeterminate` (when it may have been). An `Err` therefore
//! always means "nothing was sent, fix the call".

use std::fmt;
use std::time::Duration;

/// Why a call or a client configuration was refused before anything was sent.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The key is empty.
    EmptyKey,
    /// The key contains a newline (`0x0A`), which ends a frame on the wire.
    KeyContainsNewline,
    /// The key is longer than the client's `max_key_bytes`.
    KeyTooLong {
        /// Length of the key in bytes.
        len: usize,
        /// The limit it exceeds.
        max: usize,
    },
    /// A lease of zero: the protocol has no such lease.
    ZeroLease,
    /// A lease over 255 seconds, the most one byte carries.
    LeaseTooLong {
        /// The lease asked for.
        lease: Duration,
    },
    /// A lease that is not a whole number of seconds; the wire carries whole
    /// seconds and the client does not round a lease silently.
    LeaseNotWholeSeconds {
        /// The lease asked for.
        lease: Duration,
    },
    /// A limit of zero places (protocol 1.2): a key admits 1 to 65,535
    /// holders.
    ZeroLimit,
    /// The client was built without any server address.
    NoAddress,
    /// A server address could not be resolved.
    Resolve {
        /// The address as given.
        addr: String,
        /// What the resolver said.
        reason: String,
    },
    /// A builder setting is out of range.
    InvalidConfig {
        /// Which setting, and why.
        reason: &'static str,
    },
    /// The TLS settings cannot be used: a file is missing or is not what
    /// it should be (feature `tls`).
    Tls {
        /// Which file, and what is wrong with it.
        reason: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::EmptyKey => f.write_str("the key is empty"),
            Error::KeyContainsNewline => f.write_str("the key contains a newline"),
            Error::KeyTooLong { len, max } => {
                write!(f, "the key is {len} bytes long, the limit is {max}")
            }
            Error::ZeroLease => f.write_str("a lease of 0 seconds is not allowed"),
            Error::LeaseTooLong { lease } => {
                write!(f, "a lease of {lease:?} is over the 255 s maximum")
            }
            Error::LeaseNotWholeSeconds { lease } => {
                write!(f, "a lease of {lease:?} is not a whole number of seconds")
            }
            Error::ZeroLimit => f.write_str("a limit of 0 places is not allowed"),
            Error::NoAddress => f.write_str("no server address was given"),
            Error::Resolve { addr, reason } => {
                write!(f, "cannot resolve server address {addr:?}: {reason}")
            }
            Error::InvalidConfig { reason } => write!(f, "invalid client setting: {reason}"),
            Error::Tls { reason } => write!(f, "client TLS: {reason}"),
        }
    }
}

impl std::error::Error for Error {}

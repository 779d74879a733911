//! The fields commands and snapshots are made of, written and read, and
//! why bytes are refused.

use std::fmt;

use super::{Origin, Rid, MAX_COMMAND_KEY_BYTES};
use crate::codec::{ByteReader, ReadError};

/// Why bytes are not a command (or not a snapshot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The bytes end early.
    Truncated,
    /// An unknown tag or version byte.
    BadTag(u8),
    /// A key that is empty, too long or not UTF-8.
    BadKey,
    /// Bytes left over after a complete value.
    Trailing,
    /// A value that is well-formed but inconsistent.
    Invalid(&'static str),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Truncated => f.write_str("truncated"),
            DecodeError::BadTag(t) => write!(f, "unknown tag {t}"),
            DecodeError::BadKey => f.write_str("bad key"),
            DecodeError::Trailing => f.write_str("trailing bytes"),
            DecodeError::Invalid(why) => write!(f, "invalid: {why}"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// Appends big-endian fields to a byte vector.
#[derive(Debug, Default)]
pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    pub(crate) fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn rid(&mut self, r: Rid) {
        self.u64(r.node);
        self.u64(r.epoch);
        self.u64(r.seq);
    }
    pub(crate) fn origin(&mut self, o: Origin) {
        self.u64(o.node);
        self.u64(o.epoch);
        self.u64(o.conn);
    }
    pub(crate) fn key(&mut self, k: &str) {
        // Keys are at most MAX_COMMAND_KEY_BYTES (64 KiB), so u32 always fits.
        self.u32(u32::try_from(k.len()).unwrap_or(u32::MAX));
        self.buf.extend_from_slice(k.as_bytes());
    }
}

impl From<ReadError> for DecodeError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Truncated => DecodeError::Truncated,
            ReadError::BadKey => DecodeError::BadKey,
        }
    }
}

/// The cluster's own fields, read from commands and snapshots with the
/// one [`ByteReader`].
pub(crate) trait ReadFields<'a> {
    /// A request id.
    fn rid(&mut self) -> Result<Rid, DecodeError>;
    /// A client connection's origin.
    fn origin(&mut self) -> Result<Origin, DecodeError>;
    /// A key of at most [`MAX_COMMAND_KEY_BYTES`], checked (length, UTF-8,
    /// no newline) and borrowed from the input.
    fn key_str(&mut self) -> Result<&'a str, DecodeError>;
    /// `Ok` when every byte was read.
    fn finish(&self) -> Result<(), DecodeError>;
}

impl<'a> ReadFields<'a> for ByteReader<'a> {
    fn rid(&mut self) -> Result<Rid, DecodeError> {
        Ok(Rid {
            node: self.u64()?,
            epoch: self.u64()?,
            seq: self.u64()?,
        })
    }
    fn origin(&mut self) -> Result<Origin, DecodeError> {
        Ok(Origin {
            node: self.u64()?,
            epoch: self.u64()?,
            conn: self.u64()?,
        })
    }
    fn key_str(&mut self) -> Result<&'a str, DecodeError> {
        Ok(self.key(MAX_COMMAND_KEY_BYTES)?)
    }
    fn finish(&self) -> Result<(), DecodeError> {
        if self.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Trailing)
        }
    }
}

//! Reading big-endian fields from a byte slice, every read bounds-checked.
//!
//! One reader for every binary format ticketd decodes by hand: the
//! engine's lock table image ([`crate::engine::ImageReader`] is this
//! reader) and, in cluster mode, the replicated commands and the state
//! machine's snapshot. A read past the end, a count the bytes left cannot
//! hold, or a bad key is an error, never a panic; each format turns a
//! [`ReadError`] into its own error type.

use std::fmt;

/// Why a read failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadError {
    /// The bytes end inside a field, or a count is larger than the bytes
    /// left could hold.
    Truncated,
    /// A key is empty, too long, not UTF-8 or holds a newline.
    BadKey,
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Truncated => f.write_str("truncated"),
            ReadError::BadKey => f.write_str("bad key"),
        }
    }
}

impl std::error::Error for ReadError {}

/// Reads big-endian fields from a byte slice, front to back.
#[derive(Debug)]
pub struct ByteReader<'a> {
    buf: &'a [u8],
}

impl<'a> ByteReader<'a> {
    /// A reader of `buf`.
    #[must_use]
    pub fn new(buf: &'a [u8]) -> Self {
        ByteReader { buf }
    }

    /// The bytes not read yet.
    #[must_use]
    pub fn rest(&self) -> &'a [u8] {
        self.buf
    }

    /// True when every byte was read.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        if self.buf.len() < n {
            return Err(ReadError::Truncated);
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// One byte.
    ///
    /// # Errors
    /// [`ReadError::Truncated`] at the end of the bytes.
    pub fn u8(&mut self) -> Result<u8, ReadError> {
        Ok(self.take(1)?[0])
    }

    /// A big-endian `u16`.
    ///
    /// # Errors
    /// [`ReadError::Truncated`] at the end of the bytes.
    pub fn u16(&mut self) -> Result<u16, ReadError> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_be_bytes(a))
    }

    /// A big-endian `u32`.
    ///
    /// # Errors
    /// [`ReadError::Truncated`] at the end of the bytes.
    pub fn u32(&mut self) -> Result<u32, ReadError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_be_bytes(a))
    }

    /// A big-endian `u64`.
    ///
    /// # Errors
    /// [`ReadError::Truncated`] at the end of the bytes.
    pub fn u64(&mut self) -> Result<u64, ReadError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }

    /// The `u32` count prefix of a sequence, checked against the bytes
    /// left: `n` items of at least `min_item_bytes` each must fit, so a
    /// corrupt count cannot make the caller reserve memory it has no data
    /// for.
    ///
    /// # Errors
    /// [`ReadError::Truncated`] when the count cannot fit.
    pub fn count(&mut self, min_item_bytes: usize) -> Result<usize, ReadError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item_bytes.max(1)) > self.buf.len() {
            return Err(ReadError::Truncated);
        }
        Ok(n)
    }

    /// A key: a `u32` length and its bytes, checked (1 to `max_key_bytes`
    /// bytes, UTF-8, no newline), borrowed from the input.
    ///
    /// # Errors
    /// [`ReadError::BadKey`] for a key that is not a lock name,
    /// [`ReadError::Truncated`] when its bytes end early.
    pub fn key(&mut self, max_key_bytes: usize) -> Result<&'a str, ReadError> {
        let len = self.u32()? as usize;
        if len == 0 || len > max_key_bytes {
            return Err(ReadError::BadKey);
        }
        let bytes = self.take(len)?;
        if ascii_without_newline(bytes) {
            // SAFETY: every ASCII byte sequence is valid UTF-8.
            return Ok(unsafe { std::str::from_utf8_unchecked(bytes) });
        }
        if bytes.contains(&b'\n') {
            return Err(ReadError::BadKey);
        }
        std::str::from_utf8(bytes).map_err(|_| ReadError::BadKey)
    }
}

/// True when every byte of `b` is ASCII and none is a newline: the common
/// key, checked eight bytes at a time in one pass (a key of any other kind
/// goes through the full UTF-8 check).
fn ascii_without_newline(b: &[u8]) -> bool {
    const LOW: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const NEWLINES: u64 = LOW * b'\n' as u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes(w.try_into().expect("chunks of 8"));
        // With no high bit set, `v` has a zero byte exactly where `w` has
        // a newline, and the borrow test below finds one if there is one.
        let v = w ^ NEWLINES;
        if w & HIGH != 0 || v.wrapping_sub(LOW) & !v & HIGH != 0 {
            return false;
        }
    }
    words
        .remainder()
        .iter()
        .all(|&c| c.is_ascii() && c != b'\n')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes with a `u32` length prefix.
    fn prefixed(b: &[u8]) -> Vec<u8> {
        let mut v = (b.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(b);
        v
    }

    #[test]
    fn fields_read_in_order_and_truncation_is_an_error() {
        let mut bytes = vec![7];
        bytes.extend_from_slice(&0x0102_0304u32.to_be_bytes());
        bytes.extend_from_slice(&u64::MAX.to_be_bytes());
        let mut r = ByteReader::new(&bytes);
        assert_eq!(r.u8(), Ok(7));
        assert_eq!(r.u32(), Ok(0x0102_0304));
        assert_eq!(r.rest().len(), 8);
        assert_eq!(r.u64(), Ok(u64::MAX));
        assert!(r.is_empty());
        assert_eq!(r.u8(), Err(ReadError::Truncated));
        for cut in 0..bytes.len() {
            let mut r = ByteReader::new(&bytes[1..cut.max(1)]);
            assert_eq!(r.u32().and_then(|_| r.u64()), Err(ReadError::Truncated));
        }
    }

    #[test]
    fn counts_the_bytes_left_cannot_hold_are_truncated() {
        let mut bytes = 3u32.to_be_bytes().to_vec();
        bytes.extend_from_slice(&[0; 24]);
        assert_eq!(ByteReader::new(&bytes).count(8), Ok(3));
        assert_eq!(ByteReader::new(&bytes).count(9), Err(ReadError::Truncated));
        let huge = u32::MAX.to_be_bytes();
        assert_eq!(ByteReader::new(&huge).count(0), Err(ReadError::Truncated));
    }

    #[test]
    fn keys_are_checked_and_borrowed() {
        let ok = prefixed("locks/é".as_bytes());
        let mut r = ByteReader::new(&ok);
        let key = r.key(64).unwrap();
        assert_eq!(key, "locks/é");
        assert_eq!(key.as_ptr(), ok[4..].as_ptr(), "borrowed, not copied");
        assert!(r.is_empty());
        for bad in [&b""[..], b"a\nb", b"\xff\xfe", b"abcdefghijklmnop\n"] {
            assert_eq!(
                ByteReader::new(&prefixed(bad)).key(64),
                Err(ReadError::BadKey)
            );
        }
        assert_eq!(
            ByteReader::new(&prefixed(b"abc")).key(2),
            Err(ReadError::BadKey)
        );
        let short = &prefixed(b"abc")[..6];
        assert_eq!(ByteReader::new(short).key(64), Err(ReadError::Truncated));
    }

    #[test]
    fn ascii_without_newline_matches_a_byte_by_byte_check() {
        let naive = |b: &[u8]| b.iter().all(|&c| c.is_ascii() && c != b'\n');
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || crate::hash::xorshift(&mut seed);
        for len in 0..40 {
            // Printable ASCII, then one byte changed to each value in turn.
            let mut b: Vec<u8> = (0..len).map(|_| b' ' + (next() % 95) as u8).collect();
            assert!(ascii_without_newline(&b), "{b:?}");
            for at in 0..len {
                let keep = b[at];
                for c in 0..=255u8 {
                    b[at] = c;
                    assert_eq!(ascii_without_newline(&b), naive(&b), "{b:?}");
                }
                b[at] = keep;
            }
            let any: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            assert_eq!(ascii_without_newline(&any), naive(&any), "{any:?}");
        }
    }
}

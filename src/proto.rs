//! Wire codec for protocol version 1.1 (PROTOCOL §1 and §5.1). No I/O.
//!
//! Every frame is a fixed binary header, a UTF-8 key and one `0x0A`. Because
//! the header is binary and may itself contain `0x0A`, a decoder consumes the
//! header by byte count first and only then searches for the newline, and it
//! never looks further than `max_key_bytes` past the header: a peer cannot make
//! the decoder buffer or scan more than one maximal frame.
//!
//! Both directions live here: the server decodes [`Request`]s and encodes
//! [`Reply`]s, the client encodes requests and decodes replies. Decoded frames
//! borrow their key from the input buffer, so decoding never allocates.

use std::fmt;

/// Op byte of an Acquire request and of an Acquired reply.
pub const OP_ACQUIRE: u8 = b'A';
/// Op byte of a Release request and of a Released reply.
pub const OP_RELEASE: u8 = b'R';
/// Op byte of a Timeout reply.
pub const OP_TIMEOUT: u8 = b'T';
/// Op byte of a Busy reply.
pub const OP_BUSY: u8 = b'B';
/// Op byte of a NotReleased reply.
pub const OP_NOT_RELEASED: u8 = b'N';
/// Op byte of an Extend request and of an Extended reply (protocol 1.1).
pub const OP_EXTEND: u8 = b'E';
/// Op byte of a NotExtended reply (protocol 1.1).
pub const OP_NOT_EXTENDED: u8 = b'X';
/// The frame terminator.
pub const NEWLINE: u8 = b'\n';

/// A request from a client (PROTOCOL §1, "Requests").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// `'A' wait:u8 lease:u8 owner:u64 key '\n'`
    Acquire {
        /// Seconds the client is willing to queue; 0 = one immediate attempt.
        wait_s: u8,
        /// Seconds the grant lives; never 0 in a well-formed frame.
        lease_s: u8,
        /// Correlation id echoed in the reply.
        owner: u64,
        /// The lock name.
        key: &'a str,
    },
    /// `'R' token:u64 key '\n'`
    Release {
        /// The fencing token of the grant being released.
        token: u64,
        /// The lock name.
        key: &'a str,
    },
    /// `'E' lease:u8 token:u64 key '\n'` (protocol 1.1, PROTOCOL §5).
    Extend {
        /// Seconds the grant lives from now on; never 0 in a well-formed frame.
        lease_s: u8,
        /// The fencing token of the grant being extended.
        token: u64,
        /// The lock name.
        key: &'a str,
    },
}

impl Request<'_> {
    /// The key the request names.
    #[must_use]
    pub fn key(&self) -> &str {
        match self {
            Request::Acquire { key, .. }
            | Request::Release { key, .. }
            | Request::Extend { key, .. } => key,
        }
    }

    /// A release or extend naming a token some grant could have: one whose
    /// `N` or `X` answer is a wrong guess (token 0 is no grant's).
    #[must_use]
    pub fn guessed_token(&self) -> bool {
        match self {
            Request::Acquire { .. } => false,
            Request::Release { token, .. } | Request::Extend { token, .. } => *token != 0,
        }
    }
}

/// A reply from the server (PROTOCOL §1, "Replies").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply<'a> {
    /// Granted: `'A' token:u64 owner:u64 key '\n'`.
    Acquired {
        /// The fencing token of the grant.
        token: u64,
        /// The owner of the acquire being answered.
        owner: u64,
        /// The lock name.
        key: &'a str,
    },
    /// Not granted, the key is held: `'T' owner:u64 key '\n'`.
    Timeout {
        /// The owner of the acquire being answered.
        owner: u64,
        /// The lock name.
        key: &'a str,
    },
    /// Not granted, not queued, a capacity limit: `'B' owner:u64 key '\n'`.
    Busy {
        /// The owner of the acquire being answered.
        owner: u64,
        /// The lock name.
        key: &'a str,
    },
    /// The release took effect: `'R' token:u64 key '\n'`.
    Released {
        /// The token that was released.
        token: u64,
        /// The lock name.
        key: &'a str,
    },
    /// Nothing changed: `'N' token:u64 key '\n'`.
    NotReleased {
        /// The token of the release being answered.
        token: u64,
        /// The lock name.
        key: &'a str,
    },
    /// The extension took effect: `'E' token:u64 key '\n'` (protocol 1.1).
    Extended {
        /// The token that was extended.
        token: u64,
        /// The lock name.
        key: &'a str,
    },
    /// Nothing changed, the grant is gone or capped: `'X' token:u64 key '\n'`
    /// (protocol 1.1).
    NotExtended {
        /// The token of the extend being answered.
        token: u64,
        /// The lock name.
        key: &'a str,
    },
}

impl<'a> Reply<'a> {
    /// The key the reply names.
    #[must_use]
    pub fn key(&self) -> &'a str {
        match *self {
            Reply::Acquired { key, .. }
            | Reply::Timeout { key, .. }
            | Reply::Busy { key, .. }
            | Reply::Released { key, .. }
            | Reply::NotReleased { key, .. }
            | Reply::Extended { key, .. }
            | Reply::NotExtended { key, .. } => key,
        }
    }
}

/// Why a frame is malformed. The protocol has no error reply: the server
/// closes the connection and logs this reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Malformed {
    /// The first byte is not an op of this direction.
    UnknownOp(u8),
    /// An Acquire or Extend with `lease = 0`.
    ZeroLease,
    /// The newline follows the header directly.
    EmptyKey,
    /// The key is not valid UTF-8.
    InvalidUtf8,
    /// No newline within `max_key_bytes` bytes after the header.
    KeyTooLong,
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Malformed::UnknownOp(op) => write!(f, "unknown op byte 0x{op:02x}"),
            Malformed::ZeroLease => f.write_str("lease of 0 seconds"),
            Malformed::EmptyKey => f.write_str("empty key"),
            Malformed::InvalidUtf8 => f.write_str("key is not valid UTF-8"),
            Malformed::KeyTooLong => {
                f.write_str("no newline within max_key_bytes after the header")
            }
        }
    }
}

impl std::error::Error for Malformed {}

/// The result of decoding from the front of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded<T> {
    /// More bytes are needed; nothing was consumed.
    Incomplete,
    /// One frame, which took the first `used` bytes of the buffer.
    Frame {
        /// The decoded frame, borrowing the buffer.
        frame: T,
        /// Bytes consumed, newline included.
        used: usize,
    },
    /// The bytes at the front of the buffer can never become a valid frame.
    Malformed(Malformed),
}

/// Header length of a request op, or `None` for a byte that is no request op.
#[must_use]
pub fn request_header_len(op: u8) -> Option<usize> {
    match op {
        OP_ACQUIRE => Some(ACQUIRE_HEADER),
        OP_RELEASE => Some(RELEASE_HEADER),
        OP_EXTEND => Some(EXTEND_HEADER),
        _ => None,
    }
}

/// Header bytes of an Acquire: op, wait, lease, owner.
const ACQUIRE_HEADER: usize = 11;
/// Header bytes of a Release: op, token.
const RELEASE_HEADER: usize = 9;
/// Header bytes of an Extend: op, lease, token.
const EXTEND_HEADER: usize = 10;

/// Header length of a reply op, or `None` for a byte that is no reply op.
#[must_use]
pub fn reply_header_len(op: u8) -> Option<usize> {
    match op {
        OP_ACQUIRE => Some(17),
        OP_TIMEOUT | OP_BUSY | OP_RELEASE | OP_NOT_RELEASED | OP_EXTEND | OP_NOT_EXTENDED => {
            Some(9)
        }
        _ => None,
    }
}

fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// Where the key's newline is in `window` (the bytes after a header), and
/// whether every byte before it is ASCII; `None` if the window has no newline.
///
/// On x86-64 the window is scanned 16 bytes a step with SSE2 (part of the
/// architecture's baseline), the newline and the non-ASCII bytes found in one
/// pass: the call chain of `memchr` plus a separate ASCII check cost more
/// than the whole search for a key of a few dozen bytes. The last step of a
/// window that is not a multiple of 16 reads the window's last 16 bytes
/// again (overlapping what was checked) instead of going byte by byte.
#[cfg(target_arch = "x86_64")]
#[inline]
fn find_key_end(window: &[u8]) -> Option<(usize, bool)> {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_set1_epi8,
    };
    let len = window.len();
    if len < 16 {
        return find_key_end_short(window);
    }
    // The positions (in the 16 bytes at `at`) of newline and non-ASCII
    // bytes, as the low 16 bits of each mask.
    let step = |at: usize| {
        debug_assert!(at + 16 <= len);
        // SAFETY: callers pass at + 16 <= len, so the 16 bytes read lie
        // inside `window`, and `_mm_loadu_si128` has no alignment
        // requirement; SSE2 is part of the x86-64 baseline, enabled in
        // every x86-64 build.
        let (eq, high) = unsafe {
            let v = _mm_loadu_si128(window.as_ptr().add(at).cast::<__m128i>());
            let newline = _mm_set1_epi8(NEWLINE as i8); // 0x0a: no wrap
            (
                _mm_movemask_epi8(_mm_cmpeq_epi8(v, newline)),
                _mm_movemask_epi8(v),
            )
        };
        // A movemask sets only the low 16 bits: never negative.
        (eq as u32, high as u32)
    };
    // The newline at bit `pos` of the step at `at`: its place, and whether
    // no byte before it (in this step or an earlier one) is non-ASCII.
    let found = |at: usize, pos: u32, high: u32, seen_high: u32| {
        let before = (1u32 << pos) - 1;
        (at + pos as usize, (seen_high | (high & before)) == 0)
    };
    // Whole steps first: a key of up to 31 bytes takes one or two.
    let mut seen_high = 0u32;
    let mut at = 0;
    while at + 16 <= len {
        let (eq, high) = step(at);
        if eq != 0 {
            return Some(found(at, eq.trailing_zeros(), high, seen_high));
        }
        seen_high |= high;
        at += 16;
    }
    if at == len {
        return None;
    }
    // The window's last 16 bytes, overlapping what was checked: the
    // newlines of the overlap were not there, so only bits from `at` on
    // count (`skip` is 1 to 15).
    let start = len - 16;
    let skip = at - start;
    let (eq, high) = step(start);
    let eq = eq & (u32::MAX << skip);
    if eq != 0 {
        return Some(found(start, eq.trailing_zeros(), high, seen_high));
    }
    None
}

/// [`find_key_end`] for a window of under 16 bytes (a frame's last bytes
/// still arriving, or a small key limit): out of line, so the common path
/// keeps its registers.
#[cfg(target_arch = "x86_64")]
#[cold]
#[inline(never)]
fn find_key_end_short(window: &[u8]) -> Option<(usize, bool)> {
    let at = memchr::memchr(NEWLINE, window)?;
    Some((at, window[..at].is_ascii()))
}

/// A key with a non-ASCII byte: the full UTF-8 check, out of line.
#[cold]
#[inline(never)]
fn key_from_utf8(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes).ok()
}

/// Where the key's newline is in `window`, and whether every byte before
/// it is ASCII (the portable version: `memchr`, then a word-at-a-time ASCII
/// check).
#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn find_key_end(window: &[u8]) -> Option<(usize, bool)> {
    let at = memchr::memchr(NEWLINE, window)?;
    Some((at, window[..at].is_ascii()))
}

/// Finds the key in `rest`, the bytes after a header of `header` bytes: the
/// shared half of both decoders. Returns the key and the frame length
/// (header included), or the reason it is bad.
#[inline(always)]
fn split_key(rest: &[u8], header: usize, max_key_bytes: usize) -> Decoded<&str> {
    // Look at most max_key_bytes + 1 bytes past the header: the key plus its newline.
    let window = &rest[..rest.len().min(max_key_bytes.saturating_add(1))];
    match find_key_end(window) {
        Some((0, _)) => Decoded::Malformed(Malformed::EmptyKey),
        Some((n, ascii)) => {
            let bytes = &window[..n];
            let key = if ascii {
                // SAFETY: every ASCII byte sequence is valid UTF-8.
                Some(unsafe { std::str::from_utf8_unchecked(bytes) })
            } else {
                key_from_utf8(bytes)
            };
            match key {
                Some(key) => Decoded::Frame {
                    frame: key,
                    used: header + n + 1,
                },
                None => Decoded::Malformed(Malformed::InvalidUtf8),
            }
        }
        None if window.len() > max_key_bytes => Decoded::Malformed(Malformed::KeyTooLong),
        None => Decoded::Incomplete,
    }
}

/// The frame of one request op whose header is `N` bytes: `build` makes the
/// request from the header and the key. Each op's decoding is specialised
/// for its header length, so the op is looked at once.
#[inline(always)]
fn request_frame<'a, const N: usize>(
    buf: &'a [u8],
    max_key_bytes: usize,
    build: impl FnOnce(&'a [u8; N], &'a str) -> Request<'a>,
) -> Decoded<Request<'a>> {
    let Some((header, rest)) = buf.split_first_chunk::<N>() else {
        return Decoded::Incomplete;
    };
    match split_key(rest, N, max_key_bytes) {
        Decoded::Frame { frame: key, used } => Decoded::Frame {
            frame: build(header, key),
            used,
        },
        Decoded::Incomplete => Decoded::Incomplete,
        Decoded::Malformed(m) => Decoded::Malformed(m),
    }
}

/// Decodes one request from the front of `buf`.
///
/// Malformed cases are reported as soon as they are certain: an unknown op or
/// a zero lease before the key arrives, an overlong key as soon as
/// `max_key_bytes + 1` key bytes are buffered without a newline.
#[must_use]
#[inline]
pub fn decode_request(buf: &[u8], max_key_bytes: usize) -> Decoded<Request<'_>> {
    match buf.first() {
        None => Decoded::Incomplete,
        Some(&OP_ACQUIRE) => {
            // The lease byte, third: refused before the key arrives.
            if buf.get(2) == Some(&0) {
                return Decoded::Malformed(Malformed::ZeroLease);
            }
            request_frame::<ACQUIRE_HEADER>(buf, max_key_bytes, |h, key| Request::Acquire {
                wait_s: h[1],
                lease_s: h[2],
                owner: be_u64(&h[3..]),
                key,
            })
        }
        Some(&OP_RELEASE) => {
            request_frame::<RELEASE_HEADER>(buf, max_key_bytes, |h, key| Request::Release {
                token: be_u64(&h[1..]),
                key,
            })
        }
        Some(&OP_EXTEND) => {
            // The lease byte, second.
            if buf.get(1) == Some(&0) {
                return Decoded::Malformed(Malformed::ZeroLease);
            }
            request_frame::<EXTEND_HEADER>(buf, max_key_bytes, |h, key| Request::Extend {
                lease_s: h[1],
                token: be_u64(&h[2..]),
                key,
            })
        }
        Some(&op) => Decoded::Malformed(Malformed::UnknownOp(op)),
    }
}

/// Decodes one reply from the front of `buf` (the client side).
#[must_use]
pub fn decode_reply(buf: &[u8], max_key_bytes: usize) -> Decoded<Reply<'_>> {
    let Some(&op) = buf.first() else {
        return Decoded::Incomplete;
    };
    let Some(header) = reply_header_len(op) else {
        return Decoded::Malformed(Malformed::UnknownOp(op));
    };
    if buf.len() < header {
        return Decoded::Incomplete;
    }
    match split_key(&buf[header..], header, max_key_bytes) {
        Decoded::Incomplete => Decoded::Incomplete,
        Decoded::Malformed(m) => Decoded::Malformed(m),
        Decoded::Frame { frame: key, used } => {
            let a = be_u64(&buf[1..9]);
            let frame = match op {
                OP_ACQUIRE => Reply::Acquired {
                    token: a,
                    owner: be_u64(&buf[9..17]),
                    key,
                },
                OP_TIMEOUT => Reply::Timeout { owner: a, key },
                OP_BUSY => Reply::Busy { owner: a, key },
                OP_RELEASE => Reply::Released { token: a, key },
                OP_EXTEND => Reply::Extended { token: a, key },
                OP_NOT_EXTENDED => Reply::NotExtended { token: a, key },
                _ => Reply::NotReleased { token: a, key },
            };
            Decoded::Frame { frame, used }
        }
    }
}

/// Appends the encoding of `req` to `out`.
///
/// The caller is responsible for the key being valid (non-empty, no newline,
/// within the limit): the client checks arguments before it encodes.
pub fn encode_request(req: &Request<'_>, out: &mut Vec<u8>) {
    match *req {
        Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
        } => {
            out.reserve(12 + key.len());
            out.push(OP_ACQUIRE);
            out.push(wait_s);
            out.push(lease_s);
            out.extend_from_slice(&owner.to_be_bytes());
            out.extend_from_slice(key.as_bytes());
        }
        Request::Release { token, key } => {
            out.reserve(10 + key.len());
            out.push(OP_RELEASE);
            out.extend_from_slice(&token.to_be_bytes());
            out.extend_from_slice(key.as_bytes());
        }
        Request::Extend {
            lease_s,
            token,
            key,
        } => {
            out.reserve(11 + key.len());
            out.push(OP_EXTEND);
            out.push(lease_s);
            out.extend_from_slice(&token.to_be_bytes());
            out.extend_from_slice(key.as_bytes());
        }
    }
    out.push(NEWLINE);
}

/// Appends the encoding of `reply` to `out`.
///
/// One reservation, the header built in a fixed 17-byte array and copied
/// whole (the key then written over its unused tail), the key, the
/// newline, with no capacity check after the reservation: a push per byte
/// checked the capacity at every byte.
pub fn encode_reply(reply: &Reply<'_>, out: &mut Vec<u8>) {
    let (op, a, b) = match *reply {
        Reply::Acquired { token, owner, .. } => (OP_ACQUIRE, token, owner),
        Reply::Timeout { owner, .. } => (OP_TIMEOUT, owner, 0),
        Reply::Busy { owner, .. } => (OP_BUSY, owner, 0),
        Reply::Released { token, .. } => (OP_RELEASE, token, 0),
        Reply::NotReleased { token, .. } => (OP_NOT_RELEASED, token, 0),
        Reply::Extended { token, .. } => (OP_EXTEND, token, 0),
        Reply::NotExtended { token, .. } => (OP_NOT_EXTENDED, token, 0),
    };
    encode_reply_parts(op, a, b, reply.key().as_bytes(), out);
}

/// What [`encode_reply`] appends, from the reply's parts: the op, its first
/// word `a` (the token, or the owner of `T` and `B`), its second word `b`
/// (the owner, `A` only: ignored for every other op), the key and the
/// newline. The engine's outbox calls it with the op known at the call
/// site, so nothing is matched at run time.
#[inline]
pub(crate) fn encode_reply_parts(op: u8, a: u64, b: u64, key: &[u8], out: &mut Vec<u8>) {
    let header = if op == OP_ACQUIRE { 17 } else { 9 };
    let mut head = [0u8; 17];
    head[0] = op;
    head[1..9].copy_from_slice(&a.to_be_bytes());
    head[9..17].copy_from_slice(&b.to_be_bytes());
    let len = header + key.len() + 1;
    out.reserve(17 + key.len() + 1);
    let start = out.len();
    // SAFETY: `reserve` left room for 17 + key.len() + 1 bytes past
    // `start`: the whole 17-byte header array lands there, the key at
    // `header` (9 or 17) over its unused tail, then the newline, all
    // inside the reserved room; the source and the vector do not overlap
    // (`out` is borrowed mutably, `key` and `head` are not in it), and
    // every byte up to the new length `start + len` is written before
    // `set_len`.
    unsafe {
        let p = out.as_mut_ptr().add(start);
        std::ptr::copy_nonoverlapping(head.as_ptr(), p, head.len());
        std::ptr::copy_nonoverlapping(key.as_ptr(), p.add(header), key.len());
        p.add(header + key.len()).write(NEWLINE);
        out.set_len(start + len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MAX: usize = 1024;

    fn enc_req(r: &Request<'_>) -> Vec<u8> {
        let mut v = Vec::new();
        encode_request(r, &mut v);
        v
    }

    /// The ASCII shortcut of the key check agrees with full UTF-8
    /// validation: at every length around a word boundary, with a
    /// non-ASCII byte at every position, valid or not.
    #[test]
    fn key_check_is_utf8_validation() {
        let frame = |key: &[u8]| {
            let mut f = vec![b'R'];
            f.extend_from_slice(&[0; 8]);
            f.extend_from_slice(key);
            f.push(b'\n');
            f
        };
        let mut samples: Vec<Vec<u8>> = Vec::new();
        for len in 1..=40 {
            let ascii: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
            samples.push(ascii.clone());
            for pos in 0..len {
                for bad in [&[0x80u8][..], &[0xff], &[0xc0, 0x80], &[0xed, 0xa0, 0x80]] {
                    let mut k = ascii.clone();
                    k.splice(pos..=pos, bad.iter().copied());
                    samples.push(k);
                }
                let mut k = ascii.clone();
                k.splice(pos..=pos, "ü€🔒".bytes());
                samples.push(k);
                let mut k = ascii.clone();
                k[pos] = 0x7f;
                samples.push(k);
            }
        }
        for key in samples {
            let want = match std::str::from_utf8(&key) {
                Ok(k) => Decoded::Frame {
                    frame: Request::Release { token: 0, key: k },
                    used: 10 + key.len(),
                },
                Err(_) => Decoded::Malformed(Malformed::InvalidUtf8),
            };
            assert_eq!(decode_request(&frame(&key), MAX), want, "{key:?}");
        }
    }

    /// The newline search and the ASCII check of the key, against a
    /// byte-by-byte reference: keys of every length across the 16-byte
    /// steps, a non-ASCII byte before, at the end of and after the key,
    /// whatever follows the frame in the buffer, and every prefix of it.
    #[test]
    fn key_end_matches_a_byte_by_byte_reference() {
        // Each request op is decoded by code of its own (specialised for
        // its header length), so each is checked against the reference.
        // The headers: op, then bytes that hold no newline and no zero
        // lease, for the key's search to start after them.
        let headers: [&[u8]; 3] = [
            &[b'A', 3, 7, 0, 0, 0, 0, 0, 0, 0, 9],
            &[b'R', 0, 0, 0, 0, 0, 0, 0, 5],
            &[b'E', 7, 0, 0, 0, 0, 0, 0, 0, 5],
        ];
        fn reference<'a>(buf: &'a [u8], header: &[u8], max: usize) -> Decoded<Request<'a>> {
            let h = header.len();
            if buf.len() < h {
                return Decoded::Incomplete;
            }
            let window = &buf[h..buf.len().min(h + max + 1)];
            match window.iter().position(|&b| b == b'\n') {
                Some(0) => Decoded::Malformed(Malformed::EmptyKey),
                Some(n) => match std::str::from_utf8(&window[..n]) {
                    Ok(key) => Decoded::Frame {
                        frame: match header[0] {
                            b'A' => Request::Acquire {
                                wait_s: buf[1],
                                lease_s: buf[2],
                                owner: be_u64(&buf[3..11]),
                                key,
                            },
                            b'R' => Request::Release {
                                token: be_u64(&buf[1..9]),
                                key,
                            },
                            _ => Request::Extend {
                                lease_s: buf[1],
                                token: be_u64(&buf[2..10]),
                                key,
                            },
                        },
                        used: h + n + 1,
                    },
                    Err(_) => Decoded::Malformed(Malformed::InvalidUtf8),
                },
                None if window.len() > max => Decoded::Malformed(Malformed::KeyTooLong),
                None => Decoded::Incomplete,
            }
        }
        let tails: [&[u8]; 5] = [
            b"",
            b"\n",
            b"\xff\xfe",
            b"R\0\0\0\0\0\0\0\x07k\n",
            &[0x80; 40],
        ];
        let mut checked = 0u32;
        for key_len in 1..=70usize {
            let ascii: Vec<u8> = (0..key_len).map(|i| b'a' + (i % 26) as u8).collect();
            let mut keys = vec![ascii.clone()];
            for pos in [0, key_len / 2, key_len - 1] {
                let mut k = ascii.clone();
                k[pos] = 0xe9; // not UTF-8 on its own
                keys.push(k);
                let mut k = ascii.clone();
                k.splice(pos..=pos, "é".bytes());
                keys.push(k);
            }
            for header in headers {
                for key in &keys {
                    for tail in tails {
                        let mut buf = header.to_vec();
                        buf.extend_from_slice(key);
                        buf.push(b'\n');
                        buf.extend_from_slice(tail);
                        for max in [
                            key.len().saturating_sub(1).max(1),
                            key.len(),
                            key.len() + 1,
                            64,
                            MAX,
                        ] {
                            for end in 0..=buf.len() {
                                let b = &buf[..end];
                                assert_eq!(
                                    decode_request(b, max),
                                    reference(b, header, max),
                                    "{b:?}, max {max}"
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 300_000);
    }

    #[test]
    fn spec_example_frame_with_newline_inside_owner() {
        let bytes = [
            0x41, 0x05, 0x1E, 0, 0, 0, 0, 0, 0, 0x0A, 0x0B, 0x64, 0x62, 0x0A,
        ];
        let req = Request::Acquire {
            wait_s: 5,
            lease_s: 30,
            owner: 0x0A0B,
            key: "db",
        };
        assert_eq!(enc_req(&req), bytes);
        assert_eq!(
            decode_request(&bytes, MAX),
            Decoded::Frame {
                frame: req,
                used: 14
            }
        );
    }

    #[test]
    fn release_header_full_of_newlines() {
        let req = Request::Release {
            token: 0x0A0A_0A0A_0A0A_0A0A,
            key: "k",
        };
        let bytes = enc_req(&req);
        assert_eq!(bytes.len(), 11);
        assert_eq!(
            decode_request(&bytes, MAX),
            Decoded::Frame {
                frame: req,
                used: 11
            }
        );
    }

    /// PROTOCOL §5.1's example: extend `token=7 key="db"` by 30 s.
    #[test]
    fn spec_example_extend_frame() {
        let bytes = [0x45, 0x1E, 0, 0, 0, 0, 0, 0, 0, 0x07, 0x64, 0x62, 0x0A];
        let req = Request::Extend {
            lease_s: 30,
            token: 7,
            key: "db",
        };
        assert_eq!(enc_req(&req), bytes);
        assert_eq!(
            decode_request(&bytes, MAX),
            Decoded::Frame {
                frame: req,
                used: 13
            }
        );
    }

    /// An Extend whose lease and token are all newline bytes is read by
    /// count, and decoding it split at every byte gives Incomplete until the
    /// last byte arrives.
    #[test]
    fn extend_header_full_of_newlines_split_at_every_byte() {
        let req = Request::Extend {
            lease_s: 0x0A,
            token: 0x0A0A_0A0A_0A0A_0A0A,
            key: "k",
        };
        let bytes = enc_req(&req);
        assert_eq!(bytes.len(), 12);
        for cut in 0..bytes.len() {
            assert_eq!(
                decode_request(&bytes[..cut], MAX),
                Decoded::Incomplete,
                "cut {cut}"
            );
        }
        assert_eq!(
            decode_request(&bytes, MAX),
            Decoded::Frame {
                frame: req,
                used: 12
            }
        );
    }

    #[test]
    fn malformed_extends_are_named() {
        // Lease 0 is known from the second byte on.
        assert_eq!(
            decode_request(&[b'E', 0], MAX),
            Decoded::Malformed(Malformed::ZeroLease)
        );
        let frame = |key: &[u8]| {
            let mut f = vec![b'E', 30];
            f.extend_from_slice(&[0; 8]);
            f.extend_from_slice(key);
            f
        };
        assert_eq!(
            decode_request(&frame(b"\n"), MAX),
            Decoded::Malformed(Malformed::EmptyKey)
        );
        assert_eq!(
            decode_request(&frame(b"\xff\n"), MAX),
            Decoded::Malformed(Malformed::InvalidUtf8)
        );
        assert_eq!(decode_request(&frame(b"kkkk"), 4), Decoded::Incomplete);
        assert_eq!(
            decode_request(&frame(b"kkkkk"), 4),
            Decoded::Malformed(Malformed::KeyTooLong)
        );
        // X is a reply op, never a request.
        assert_eq!(
            decode_request(b"X", MAX),
            Decoded::Malformed(Malformed::UnknownOp(b'X'))
        );
    }

    #[test]
    fn every_malformed_case_is_named() {
        assert_eq!(
            decode_request(b"X", MAX),
            Decoded::Malformed(Malformed::UnknownOp(b'X'))
        );
        assert_eq!(
            decode_request(&[b'A', 1, 0], MAX),
            Decoded::Malformed(Malformed::ZeroLease)
        );
        let mut empty = vec![b'A', 1, 1];
        empty.extend_from_slice(&[0; 8]);
        empty.push(b'\n');
        assert_eq!(
            decode_request(&empty, MAX),
            Decoded::Malformed(Malformed::EmptyKey)
        );
        let mut bad = vec![b'R'];
        bad.extend_from_slice(&[0; 8]);
        bad.extend_from_slice(&[0xff, 0xfe, b'\n']);
        assert_eq!(
            decode_request(&bad, MAX),
            Decoded::Malformed(Malformed::InvalidUtf8)
        );
        let mut long = vec![b'R'];
        long.extend_from_slice(&[0; 8]);
        long.extend(std::iter::repeat_n(b'k', 4));
        assert_eq!(decode_request(&long, 4), Decoded::Incomplete);
        long.push(b'k');
        assert_eq!(
            decode_request(&long, 4),
            Decoded::Malformed(Malformed::KeyTooLong)
        );
    }

    #[test]
    fn key_of_exactly_max_bytes_is_accepted() {
        let key = "k".repeat(MAX);
        let bytes = enc_req(&Request::Release {
            token: 1,
            key: &key,
        });
        assert!(matches!(
            decode_request(&bytes, MAX),
            Decoded::Frame { used, .. } if used == bytes.len()
        ));
    }

    #[test]
    fn replies_round_trip() {
        let replies = [
            Reply::Acquired {
                token: 10,
                owner: 0x0A,
                key: "a",
            },
            Reply::Timeout {
                owner: 7, key: "é"
            },
            Reply::Busy { owner: 8, key: "b" },
            Reply::Released { token: 9, key: "c" },
            Reply::NotReleased { token: 0, key: "d" },
            Reply::Extended {
                token: 0x0A0A,
                key: "e",
            },
            Reply::NotExtended {
                token: 11,
                key: "f",
            },
        ];
        for r in replies {
            let mut v = Vec::new();
            encode_reply(&r, &mut v);
            assert_eq!(
                decode_reply(&v, MAX),
                Decoded::Frame {
                    frame: r,
                    used: v.len()
                }
            );
        }
        assert_eq!(
            decode_reply(b"Z", MAX),
            Decoded::Malformed(Malformed::UnknownOp(b'Z'))
        );
    }

    /// (wait, lease, owner, token, key, op): op 0 = Acquire, 1 = Release, 2 = Extend.
    fn arb_request() -> impl Strategy<Value = (u8, u8, u64, u64, String, u8)> {
        (
            any::<u8>(),
            1u8..,
            any::<u64>(),
            any::<u64>(),
            "[^\n]{1,12}",
            0u8..3,
        )
    }

    fn make_request<'a>(
        (wait_s, lease_s, owner, token, key, op): &'a (u8, u8, u64, u64, String, u8),
    ) -> Request<'a> {
        match op {
            0 => Request::Acquire {
                wait_s: *wait_s,
                lease_s: *lease_s,
                owner: *owner,
                key,
            },
            1 => Request::Release { token: *token, key },
            _ => Request::Extend {
                lease_s: *lease_s,
                token: *token,
                key,
            },
        }
    }

    proptest! {
        #[test]
        fn a_stream_split_anywhere_decodes_to_the_same_frames(
            reqs in proptest::collection::vec(arb_request(), 1..8),
            split in any::<prop::sample::Index>(),
        ) {
            let mut stream = Vec::new();
            for r in &reqs {
                encode_request(&make_request(r), &mut stream);
            }
            // Feed in two pieces split at an arbitrary byte, like a reader would.
            let cut = split.index(stream.len() + 1);
            let mut buf: Vec<u8> = stream[..cut].to_vec();
            let mut rest = &stream[cut..];
            let mut decoded = 0;
            loop {
                match decode_request(&buf, MAX) {
                    Decoded::Frame { frame, used } => {
                        prop_assert_eq!(frame, make_request(&reqs[decoded]));
                        buf.drain(..used);
                        decoded += 1;
                    }
                    Decoded::Incomplete => {
                        prop_assert!(!rest.is_empty(), "stream ended mid-frame");
                        buf.extend_from_slice(rest);
                        rest = &[];
                    }
                    Decoded::Malformed(m) => prop_assert!(false, "malformed: {}", m),
                }
                if decoded == reqs.len() {
                    break;
                }
            }
            prop_assert!(buf.is_empty() && rest.is_empty());
        }

        #[test]
        fn random_bytes_never_panic_and_never_overrun(bytes in proptest::collection::vec(any::<u8>(), 0..64), max in 1usize..16) {
            match decode_request(&bytes, max) {
                Decoded::Frame { used, frame } => {
                    prop_assert!(used <= bytes.len());
                    prop_assert!(used <= 12 + max);
                    prop_assert!(!frame.key().is_empty() && frame.key().len() <= max);
                }
                Decoded::Incomplete => prop_assert!(bytes.len() < 12 + max),
                Decoded::Malformed(_) => {}
            }
            if let Decoded::Frame { used, .. } = decode_reply(&bytes, max) {
                prop_assert!(used <= bytes.len() && used <= 18 + max);
            }
        }
    }
}

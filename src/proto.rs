//! Wire codec for protocol version 1.2 (PROTOCOL §1, §5.1 and §6.1). No I/O.
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
/// Op byte of an Acquire With Limit request (protocol 1.2).
pub const OP_ACQUIRE_WITH_LIMIT: u8 = b'P';
/// Op byte of a LimitMismatch reply (protocol 1.2).
pub const OP_LIMIT_MISMATCH: u8 = b'L';
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
    /// `'P' wait:u8 lease:u8 owner:u64 limit:u16 mode:u8 key '\n'`
    /// (protocol 1.2, PROTOCOL §6): one place of a key that admits
    /// `limit` holders at once, shared or exclusive.
    AcquireWithLimit {
        /// Seconds the client is willing to queue; 0 = one immediate attempt.
        wait_s: u8,
        /// Seconds the grant lives; never 0 in a well-formed frame.
        lease_s: u8,
        /// Correlation id echoed in the reply.
        owner: u64,
        /// How many holders the key admits at once; never 0 in a
        /// well-formed frame.
        limit: u16,
        /// Whether the grant shares the key or needs it whole.
        mode: Mode,
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

/// How an Acquire With Limit takes its key (PROTOCOL §6.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// One of the key's places, beside other shared holders (`'S'`).
    Shared,
    /// The whole key, alone (`'X'`).
    Exclusive,
}

impl Mode {
    /// The mode's byte on the wire.
    #[must_use]
    pub fn byte(self) -> u8 {
        match self {
            Mode::Shared => b'S',
            Mode::Exclusive => b'X',
        }
    }

    /// The mode a wire byte names, if any.
    #[must_use]
    pub fn from_byte(b: u8) -> Option<Mode> {
        match b {
            b'S' => Some(Mode::Shared),
            b'X' => Some(Mode::Exclusive),
            _ => None,
        }
    }

    /// Its name in logs, JSON and the command line: `shared` or `exclusive`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Mode::Shared => "shared",
            Mode::Exclusive => "exclusive",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What an Acquire With Limit asks for beyond an Acquire (PROTOCOL §6.1):
/// one of the key's `limit` places, in `mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Places {
    /// How many grants the key admits at once, 1 to 65,535: 1 is a mutex.
    pub limit: u16,
    /// Shared (one place) or exclusive (the whole key).
    pub mode: Mode,
}

impl Places {
    /// The limit of a read/write lock: as many shared holders as the
    /// protocol counts (PROTOCOL §6.3).
    pub const READ_WRITE_LIMIT: u16 = u16::MAX;

    /// One permit of a counting semaphore of `limit` places (shared mode).
    #[must_use]
    pub fn semaphore(limit: u16) -> Places {
        Places {
            limit,
            mode: Mode::Shared,
        }
    }

    /// A reader's place in a read/write lock.
    #[must_use]
    pub fn shared() -> Places {
        Places::semaphore(Places::READ_WRITE_LIMIT)
    }

    /// A writer's hold of a read/write lock: the whole key.
    #[must_use]
    pub fn exclusive() -> Places {
        Places {
            limit: Places::READ_WRITE_LIMIT,
            mode: Mode::Exclusive,
        }
    }
}

impl Request<'_> {
    /// Whether it is an acquire (`A`, or `P` of protocol 1.2): a request
    /// that names no token, so never a guess at one.
    #[inline]
    #[must_use]
    pub fn is_acquire(&self) -> bool {
        matches!(
            self,
            Request::Acquire { .. } | Request::AcquireWithLimit { .. }
        )
    }

    /// The key the request names.
    #[must_use]
    pub fn key(&self) -> &str {
        match self {
            Request::Acquire { key, .. }
            | Request::AcquireWithLimit { key, .. }
            | Request::Release { key, .. }
            | Request::Extend { key, .. } => key,
        }
    }

    /// A release or extend naming a token some grant could have: one whose
    /// `N` or `X` answer is a wrong guess (token 0 is no grant's).
    #[must_use]
    pub fn guessed_token(&self) -> bool {
        match self {
            Request::Acquire { .. } | Request::AcquireWithLimit { .. } => false,
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
    /// Not granted, not queued: the key is registered with another limit,
    /// which this reply carries: `'L' owner:u64 limit:u16 key '\n'`
    /// (protocol 1.2).
    LimitMismatch {
        /// The owner of the acquire being answered.
        owner: u64,
        /// The limit the key is registered with.
        limit: u16,
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
            | Reply::NotExtended { key, .. }
            | Reply::LimitMismatch { key, .. } => key,
        }
    }
}

/// Why a frame is malformed. The protocol has no error reply: the server
/// closes the connection and logs this reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Malformed {
    /// The first byte is not an op of this direction.
    UnknownOp(u8),
    /// An Acquire, Acquire With Limit or Extend with `lease = 0`.
    ZeroLease,
    /// An Acquire With Limit with `limit = 0`.
    ZeroLimit,
    /// An Acquire With Limit whose mode byte is neither `'S'` nor `'X'`.
    UnknownMode(u8),
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
            Malformed::ZeroLimit => f.write_str("limit of 0 holders"),
            Malformed::UnknownMode(b) => write!(f, "unknown mode byte 0x{b:02x}"),
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
        OP_ACQUIRE_WITH_LIMIT => Some(ACQUIRE_WITH_LIMIT_HEADER),
        _ => None,
    }
}

/// Header bytes of an Acquire: op, wait, lease, owner.
const ACQUIRE_HEADER: usize = 11;
/// Header bytes of a Release: op, token.
const RELEASE_HEADER: usize = 9;
/// Header bytes of an Extend: op, lease, token.
const EXTEND_HEADER: usize = 10;
/// Header bytes of an Acquire With Limit: op, wait, lease, owner, limit, mode.
const ACQUIRE_WITH_LIMIT_HEADER: usize = 14;
/// Header bytes of a LimitMismatch reply: op, owner, limit.
const LIMIT_MISMATCH_HEADER: usize = 11;

/// Header length of a reply op, or `None` for a byte that is no reply op.
#[must_use]
pub fn reply_header_len(op: u8) -> Option<usize> {
    match op {
        OP_ACQUIRE => Some(17),
        OP_LIMIT_MISMATCH => Some(LIMIT_MISMATCH_HEADER),
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
        Some(&op) => {
            let mut decoded = Decoded::Incomplete;
            decode_other_op_into(op, buf, max_key_bytes, &mut decoded);
            decoded
        }
    }
}

/// Decodes a frame whose op is none of `A`, `R` and `E` into `decoded`:
/// an Acquire With Limit (protocol 1.2) or an unknown op.
///
/// Out of line and cold, so that [`decode_request`] tests the three ops of
/// 1.0 and 1.1 one after the other as before 1.2 (a fourth op inline made
/// it a jump table). It answers through `decoded` rather than returning:
/// a call that returns a `Decoded<Request>` writes it through a pointer
/// into the caller's result, and the `A`, `R` and `E` frames then went
/// through that memory too (stored, then copied to where the loop reads
/// them). Given a place of its own, it leaves the hot frames built as they
/// were before 1.2.
#[cold]
#[inline(never)]
fn decode_other_op_into<'a>(
    op: u8,
    buf: &'a [u8],
    max_key_bytes: usize,
    decoded: &mut Decoded<Request<'a>>,
) {
    *decoded = if op == OP_ACQUIRE_WITH_LIMIT {
        decode_acquire_with_limit(buf, max_key_bytes)
    } else {
        Decoded::Malformed(Malformed::UnknownOp(op))
    };
}

/// Decodes an Acquire With Limit (protocol 1.2). A zero lease, a zero
/// limit and an unknown mode are refused as soon as their byte arrives.
#[inline(always)]
fn decode_acquire_with_limit(buf: &[u8], max_key_bytes: usize) -> Decoded<Request<'_>> {
    if buf.get(2) == Some(&0) {
        return Decoded::Malformed(Malformed::ZeroLease);
    }
    if let (Some(&0), Some(&0)) = (buf.get(11), buf.get(12)) {
        return Decoded::Malformed(Malformed::ZeroLimit);
    }
    if let Some(&b) = buf.get(13) {
        if Mode::from_byte(b).is_none() {
            return Decoded::Malformed(Malformed::UnknownMode(b));
        }
    }
    request_frame::<ACQUIRE_WITH_LIMIT_HEADER>(buf, max_key_bytes, |h, key| {
        Request::AcquireWithLimit {
            wait_s: h[1],
            lease_s: h[2],
            owner: be_u64(&h[3..]),
            limit: u16::from_be_bytes([h[11], h[12]]),
            mode: Mode::from_byte(h[13]).unwrap_or(Mode::Exclusive),
            key,
        }
    })
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
                OP_LIMIT_MISMATCH => Reply::LimitMismatch {
                    owner: a,
                    limit: u16::from_be_bytes([buf[9], buf[10]]),
                    key,
                },
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
        Request::AcquireWithLimit {
            wait_s,
            lease_s,
            owner,
            limit,
            mode,
            key,
        } => {
            out.reserve(15 + key.len());
            out.push(OP_ACQUIRE_WITH_LIMIT);
            out.push(wait_s);
            out.push(lease_s);
            out.extend_from_slice(&owner.to_be_bytes());
            out.extend_from_slice(&limit.to_be_bytes());
            out.push(mode.byte());
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
        Reply::LimitMismatch { owner, limit, key } => {
            return encode_limit_mismatch(owner, limit, key, out);
        }
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

/// Appends a LimitMismatch reply (protocol 1.2): `'L' owner:u64
/// limit:u16 key '\n'`. Out of line: its header is the only one with a
/// 16-bit field.
#[cold]
#[inline(never)]
pub(crate) fn encode_limit_mismatch(owner: u64, limit: u16, key: &str, out: &mut Vec<u8>) {
    out.reserve(LIMIT_MISMATCH_HEADER + key.len() + 1);
    out.push(OP_LIMIT_MISMATCH);
    out.extend_from_slice(&owner.to_be_bytes());
    out.extend_from_slice(&limit.to_be_bytes());
    out.extend_from_slice(key.as_bytes());
    out.push(NEWLINE);
}

#[cfg(test)]
mod tests;

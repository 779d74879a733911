//! Bodies of the ticketd fuzz targets, with the properties they check.
//!
//! Each function takes the fuzzer's bytes and panics (with a message naming
//! the broken property) on the first violation. The cargo-fuzz targets
//! (`fuzz/fuzz_targets/`) call them, and so does
//! `tests/engine/fuzz_regressions.rs`: every crash the fuzzer finds is
//! replayed by `cargo test` without cargo-fuzz, and CI runs the bodies over a
//! seeded stream of random inputs.
//!
//! * [`decode_request`], [`decode_reply`]: arbitrary bytes and an arbitrary
//!   `max_key_bytes` through the codec. A frame never claims more bytes than
//!   it was given or than one maximal frame, its key is valid, it re-encodes
//!   to exactly the bytes it was decoded from, every strict prefix of it is
//!   `Incomplete`, and a malformed verdict never changes when more bytes
//!   arrive.
//! * [`engine_ops`]: an arbitrary sequence of acquires, releases, time steps,
//!   ticks, disconnects, token ceilings (and, in replicated mode, explicit
//!   expiries and wait timeouts) against the engine, checked after every
//!   operation against a reference model of PROTOCOL §2: `check_invariants()`,
//!   tokens strictly increasing and below the ceiling, at most one valid
//!   holder per key (no lease ends before `grant + lease`), no grant to a
//!   waiter past its wait deadline (give or take one clock tick, see
//!   `SLACK_MS`), no Timeout before it, FIFO hand-over to queued waiters,
//!   every acquire answered exactly once (or cancelled by its disconnect),
//!   nothing due left undone after a tick, and nothing happening before
//!   `next_deadline()`.

//!
//! The cluster targets' bodies ([`cluster`]: peer messages, replicated
//! commands, WAL recovery) are built with the `cluster` feature.

#[cfg(feature = "cluster")]
pub mod cluster;
mod engine_model;
mod engine_steps;
mod permits;

pub use engine_steps::engine_ops;
pub use permits::engine_permits;

use ticketd::proto::{
    decode_reply as dec_reply, decode_request as dec_request, encode_reply, encode_request,
    reply_header_len, request_header_len, Decoded, Malformed,
};

/// `max_key_bytes` from the first input byte: mostly tiny, so short inputs
/// reach the key-length limit, sometimes the default.
fn max_key_from(b: u8) -> usize {
    match b {
        0..=239 => usize::from(b % 40) + 1,
        240..=251 => ticketd::limits::DEFAULT_MAX_KEY_BYTES,
        _ => usize::from(b) * 4,
    }
}

/// A decoded frame reduced to what the checks compare: its key and its
/// re-encoding (owned, so verdicts on different buffers can be compared).
type Owned = (String, Vec<u8>);

/// Checks shared by both decoders on one verdict.
fn check_verdict(
    what: &str,
    data: &[u8],
    max_key_bytes: usize,
    header_len: Option<usize>,
    decode: &dyn Fn(&[u8]) -> Decoded<Owned>,
) {
    let verdict = decode(data);
    match &verdict {
        &Decoded::Frame {
            frame: (ref key, ref encoded),
            used,
        } => {
            let header = header_len.expect("a frame has a known op");
            check_frame_size(what, data, max_key_bytes, header, key, used);
            assert_eq!(
                &encoded[..],
                &data[..used],
                "{what}: re-encoding differs from the input"
            );
            // The verdict depends on the frame's own bytes only.
            assert_eq!(decode(&data[..used]), verdict, "{what}: needs lookahead");
            // Every strict prefix of a valid frame is incomplete, never malformed.
            let step = if used <= 96 { 1 } else { used / 32 };
            for cut in (0..used).step_by(step).chain([used - 1]) {
                assert_eq!(
                    decode(&data[..cut]),
                    Decoded::Incomplete,
                    "{what}: prefix of {cut} bytes of a valid frame"
                );
            }
        }
        Decoded::Incomplete => check_incomplete(what, data, max_key_bytes, header_len),
        &Decoded::Malformed(m) => {
            check_malformed_reason(what, data, header_len, m);
            // Malformed is final: more bytes never make it a frame.
            let mut longer = data.to_vec();
            longer.extend_from_slice(b"k\n");
            assert_eq!(
                decode(&longer),
                verdict,
                "{what}: malformed verdict changed with more bytes"
            );
        }
    }
}

/// A decoded frame of `used` bytes (header `header`, key `key`) fits in
/// `data` and in one maximal frame, and its key is valid.
fn check_frame_size(
    what: &str,
    data: &[u8],
    max_key_bytes: usize,
    header: usize,
    key: &str,
    used: usize,
) {
    assert!(
        used <= data.len(),
        "{what}: used {used} > len {}",
        data.len()
    );
    assert!(
        used <= header + max_key_bytes + 1,
        "{what}: used {used} exceeds one maximal frame"
    );
    assert!(!key.is_empty(), "{what}: empty key accepted");
    assert!(
        key.len() <= max_key_bytes,
        "{what}: key of {} bytes over max {max_key_bytes}",
        key.len()
    );
    assert!(!key.contains('\n'), "{what}: key contains a newline");
    assert_eq!(used, header + key.len() + 1, "{what}: used != frame size");
}

/// `data` decoded as incomplete: shorter than a full frame window, with no
/// newline after the header (or empty, for an unknown op).
fn check_incomplete(what: &str, data: &[u8], max_key_bytes: usize, header_len: Option<usize>) {
    if let Some(header) = header_len {
        // A full window without a newline is malformed, not incomplete.
        assert!(
            data.len() < header + max_key_bytes + 1,
            "{what}: incomplete with a full frame window ({} bytes)",
            data.len()
        );
        if data.len() > header {
            assert!(
                !data[header..].contains(&b'\n'),
                "{what}: incomplete although a newline follows the header"
            );
        }
    } else {
        assert!(data.is_empty(), "{what}: unknown op reported incomplete");
    }
}

/// The reason `m` that `data` was decoded malformed is there in its bytes.
fn check_malformed_reason(what: &str, data: &[u8], header_len: Option<usize>, m: Malformed) {
    match m {
        Malformed::UnknownOp(op) => {
            assert_eq!(Some(&op), data.first(), "{what}: wrong op reported");
            assert!(header_len.is_none(), "{what}: known op reported unknown");
        }
        Malformed::ZeroLease => {
            // The lease byte: third in an Acquire, second in an Extend.
            let zero_at = |at: usize| data.len() > at && data[at] == 0;
            assert!(
                (matches!(data.first(), Some(&b'A' | &b'P')) && zero_at(2))
                    || (data.first() == Some(&b'E') && zero_at(1)),
                "{what}: zero lease without one"
            );
        }
        Malformed::ZeroLimit => {
            // The limit: bytes 11 and 12 of an Acquire With Limit.
            assert!(
                data.first() == Some(&b'P') && data.get(11..13) == Some(&[0, 0][..]),
                "{what}: zero limit without one"
            );
        }
        Malformed::UnknownMode(b) => {
            assert!(
                data.first() == Some(&b'P') && data.get(13) == Some(&b) && b != b'S' && b != b'X',
                "{what}: unknown mode without one"
            );
        }
        Malformed::EmptyKey => {
            let header = header_len.expect("a known op");
            assert_eq!(data.get(header), Some(&b'\n'), "{what}: key not empty");
        }
        Malformed::InvalidUtf8 | Malformed::KeyTooLong => {
            assert!(header_len.is_some(), "{what}: {m} on an unknown op");
        }
    }
}

/// Decodes a stream the way the server's read loop does: frame after frame
/// until the rest is incomplete or malformed. Each frame must make progress.
fn decode_stream(data: &[u8], decode: &dyn Fn(&[u8]) -> Decoded<Owned>) {
    let mut rest = data;
    while let Decoded::Frame { used, .. } = decode(rest) {
        assert!(used > 0 && used <= rest.len(), "stream: no progress");
        rest = &rest[used..];
    }
}

/// Fuzz body: the request decoder on arbitrary bytes.
pub fn decode_request(data: &[u8]) {
    let Some((&first, data)) = data.split_first() else {
        return;
    };
    let max = max_key_from(first);
    let header = data.first().and_then(|&op| request_header_len(op));
    let decode = |b: &[u8]| -> Decoded<Owned> {
        match dec_request(b, max) {
            Decoded::Frame { frame, used } => {
                let mut v = Vec::new();
                encode_request(&frame, &mut v);
                Decoded::Frame {
                    frame: (frame.key().to_string(), v),
                    used,
                }
            }
            Decoded::Incomplete => Decoded::Incomplete,
            Decoded::Malformed(m) => Decoded::Malformed(m),
        }
    };
    check_verdict("decode_request", data, max, header, &decode);
    decode_stream(data, &decode);
}

/// Fuzz body: the reply decoder on arbitrary bytes.
pub fn decode_reply(data: &[u8]) {
    let Some((&first, data)) = data.split_first() else {
        return;
    };
    let max = max_key_from(first);
    let header = data.first().and_then(|&op| reply_header_len(op));
    let decode = |b: &[u8]| -> Decoded<Owned> {
        match dec_reply(b, max) {
            Decoded::Frame { frame, used } => {
                let mut v = Vec::new();
                encode_reply(&frame, &mut v);
                Decoded::Frame {
                    frame: (frame.key().to_string(), v),
                    used,
                }
            }
            Decoded::Incomplete => Decoded::Incomplete,
            Decoded::Malformed(m) => Decoded::Malformed(m),
        }
    };
    check_verdict("decode_reply", data, max, header, &decode);
    decode_stream(data, &decode);
}

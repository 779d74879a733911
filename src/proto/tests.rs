//! The codec against the examples of PROTOCOL §1, §5.1 and §6.1, a
//! byte-by-byte reference and random input.

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

/// What [`decode_request`] makes of `buf`, whose first bytes are `header`
/// (a well-formed header), found byte by byte.
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
                    b'E' => Request::Extend {
                        lease_s: buf[1],
                        token: be_u64(&buf[2..10]),
                        key,
                    },
                    _ => Request::AcquireWithLimit {
                        wait_s: buf[1],
                        lease_s: buf[2],
                        owner: be_u64(&buf[3..11]),
                        limit: u16::from_be_bytes([buf[11], buf[12]]),
                        mode: Mode::from_byte(buf[13]).expect("the test's headers carry a mode"),
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
    let headers: [&[u8]; 4] = [
        &[b'A', 3, 7, 0, 0, 0, 0, 0, 0, 0, 9],
        &[b'R', 0, 0, 0, 0, 0, 0, 0, 5],
        &[b'E', 7, 0, 0, 0, 0, 0, 0, 0, 5],
        &[b'P', 3, 7, 0, 0, 0, 0, 0, 0, 0, 9, 0, 8, b'S'],
    ];
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

/// (wait, lease, owner, token, key, op): op 0 = Acquire, 1 = Release,
/// 2 = Extend, 3 = Acquire With Limit (limit and mode taken from `token`).
fn arb_request() -> impl Strategy<Value = (u8, u8, u64, u64, String, u8)> {
    (
        any::<u8>(),
        1u8..,
        any::<u64>(),
        any::<u64>(),
        "[^\n]{1,12}",
        0u8..4,
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
        3 => Request::AcquireWithLimit {
            wait_s: *wait_s,
            lease_s: *lease_s,
            owner: *owner,
            limit: (*token as u16).max(1),
            mode: if token & (1 << 32) == 0 {
                Mode::Shared
            } else {
                Mode::Exclusive
            },
            key,
        },
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

/// The example of PROTOCOL §6.1, byte for byte, both ways.
#[test]
fn spec_example_acquire_with_limit_and_limit_mismatch() {
    let request: &[u8] = &[
        0x50, 0x05, 0x1E, 0, 0, 0, 0, 0, 0, 0, 0x07, 0x00, 0x08, 0x53, b'p', b'o', b'o', b'l', 0x0A,
    ];
    let want = Request::AcquireWithLimit {
        wait_s: 5,
        lease_s: 30,
        owner: 7,
        limit: 8,
        mode: Mode::Shared,
        key: "pool",
    };
    assert_eq!(
        decode_request(request, MAX),
        Decoded::Frame {
            frame: want,
            used: request.len()
        }
    );
    assert_eq!(enc_req(&want), request);
    for cut in 0..request.len() {
        assert_eq!(decode_request(&request[..cut], MAX), Decoded::Incomplete);
    }
    let reply: &[u8] = &[
        0x4C, 0, 0, 0, 0, 0, 0, 0, 0x07, 0x00, 0x04, b'p', b'o', b'o', b'l', 0x0A,
    ];
    let want = Reply::LimitMismatch {
        owner: 7,
        limit: 4,
        key: "pool",
    };
    assert_eq!(
        decode_reply(reply, MAX),
        Decoded::Frame {
            frame: want,
            used: reply.len()
        }
    );
    let mut v = Vec::new();
    encode_reply(&want, &mut v);
    assert_eq!(v, reply);
}

/// A zero lease, a zero limit and an unknown mode are refused as soon as
/// their bytes arrive, before the key; the exclusive mode byte decodes.
#[test]
fn malformed_acquires_with_limit_are_named_early() {
    assert_eq!(
        decode_request(&[b'P', 1, 0], MAX),
        Decoded::Malformed(Malformed::ZeroLease)
    );
    let mut head = vec![b'P', 1, 1];
    head.extend_from_slice(&[0; 8]);
    let mut zero = head.clone();
    zero.extend_from_slice(&[0, 0]);
    assert_eq!(
        decode_request(&zero, MAX),
        Decoded::Malformed(Malformed::ZeroLimit)
    );
    let mut one = head.clone();
    one.extend_from_slice(&[0, 1]);
    assert_eq!(decode_request(&one, MAX), Decoded::Incomplete);
    let mut odd = one.clone();
    odd.push(b'R');
    assert_eq!(
        decode_request(&odd, MAX),
        Decoded::Malformed(Malformed::UnknownMode(b'R'))
    );
    let mut exclusive = one;
    exclusive.extend_from_slice(b"Xk\n");
    assert_eq!(
        decode_request(&exclusive, MAX),
        Decoded::Frame {
            frame: Request::AcquireWithLimit {
                wait_s: 1,
                lease_s: 1,
                owner: 0,
                limit: 1,
                mode: Mode::Exclusive,
                key: "k",
            },
            used: exclusive.len()
        }
    );
}

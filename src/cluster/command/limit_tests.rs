//! The acquire with a limit (protocol 1.2) as a replicated command: round
//! trips, is written in one pass as its request's entry, fits its one
//! allocation, and refuses a zero limit, an unknown mode and every
//! truncation.

use super::*;
use crate::engine::Caller;

fn rid() -> Rid {
    Rid {
        node: 4,
        epoch: 9,
        seq: 0x0A0A,
    }
}

/// Acquires with a limit covering both modes, a limit of 1 (a mutex) and
/// the largest limit, and fields holding the newline byte.
fn limit_samples() -> Vec<Command<'static>> {
    vec![
        Command::AcquireWithLimit {
            rid: rid(),
            floor: 3,
            conn: 10,
            key: "sem\u{e9}".into(),
            owner: 0x0A0B,
            wait_s: 5,
            lease_s: 30,
            limit: 3,
            mode: Mode::Shared,
        },
        Command::AcquireWithLimit {
            rid: rid(),
            floor: 0,
            conn: 0x0A,
            key: "rw".into(),
            owner: 1,
            wait_s: 0,
            lease_s: 1,
            limit: u16::MAX,
            mode: Mode::Exclusive,
        },
        Command::AcquireWithLimit {
            rid: rid(),
            floor: 1,
            conn: 2,
            key: "m".into(),
            owner: 7,
            wait_s: 255,
            lease_s: 255,
            limit: 1,
            mode: Mode::Shared,
        },
    ]
}

/// The request `cmd` (an acquire with a limit) was made from.
fn request_of<'c>(cmd: &'c Command<'_>) -> (u64, u64, Request<'c>) {
    let Command::AcquireWithLimit {
        floor,
        conn,
        key,
        owner,
        wait_s,
        lease_s,
        limit,
        mode,
        ..
    } = cmd
    else {
        unreachable!("only acquires with a limit are sampled")
    };
    let req = Request::AcquireWithLimit {
        wait_s: *wait_s,
        lease_s: *lease_s,
        owner: *owner,
        limit: *limit,
        mode: *mode,
        key,
    };
    (*floor, *conn, req)
}

#[test]
fn an_acquire_with_a_limit_round_trips_with_its_key_borrowed() {
    for c in limit_samples() {
        let bytes = c.encode();
        assert_eq!(bytes[0], TAG_ACQUIRE_WITH_LIMIT, "{c:?}");
        let d = Command::decode(&bytes).unwrap();
        assert_eq!(d, c, "{c:?}");
        assert_eq!(d.rid(), Some(rid()));
        assert_eq!(d.key(), c.key());
        let Command::AcquireWithLimit {
            key: Cow::Borrowed(k),
            ..
        } = &d
        else {
            panic!("owned key in {d:?}");
        };
        let start = bytes.as_ptr() as usize;
        assert!((start..start + bytes.len()).contains(&(k.as_ptr() as usize)));
    }
}

#[test]
fn an_acquire_with_a_limit_encodes_as_its_request_in_one_allocation() {
    for c in limit_samples() {
        let (floor, conn, req) = request_of(&c);
        let bytes = Command::encode_request(rid(), floor, conn, &req);
        assert_eq!(bytes, c.encode(), "{c:?}");
        let key_len = req.key().len();
        // Fills its bound exactly: the largest command.
        let fixed = ENCODED_FIXED_MAX + ENCODED_LIMIT_EXTRA;
        assert_eq!(bytes.len(), fixed + key_len, "{c:?}");
        assert_eq!(c.encode().capacity(), fixed + key_len, "{c:?}");
        // As a log entry, written in one pass, with a caller.
        let who = Caller {
            holder: 5,
            admin: false,
        };
        let mut entry = Vec::new();
        Command::write_request_entry(&mut entry, 0xBEEF, who, rid(), floor, conn, &req);
        assert_eq!(Command::entry_command(&entry), &bytes[..]);
        let (decoded, bits, caller) = Command::decode_entry(&entry).unwrap();
        assert_eq!((decoded, bits, caller), (c.clone(), Some(0xBEEF), who));
    }
}

#[test]
fn every_truncation_and_extension_of_an_acquire_with_a_limit_is_an_error() {
    for c in limit_samples() {
        let bytes = c.encode();
        for cut in 0..bytes.len() {
            assert!(Command::decode(&bytes[..cut]).is_err(), "{c:?} cut {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Command::decode(&longer), Err(DecodeError::Trailing));
    }
}

#[test]
fn a_zero_limit_an_unknown_mode_and_a_zero_lease_are_errors() {
    // Tag, rid, floor, conn, owner, wait: the lease, limit and mode follow.
    let lease_at = 1 + 24 + 8 + 8 + 8 + 1;
    let (limit_at, mode_at) = (lease_at + 1, lease_at + 3);
    let good = limit_samples()[0].encode();
    let mut zero_limit = good.clone();
    zero_limit[limit_at..limit_at + 2].copy_from_slice(&[0, 0]);
    assert_eq!(
        Command::decode(&zero_limit),
        Err(DecodeError::Invalid("limit of 0"))
    );
    for bad in [0u8, b's', b'x', b'R', 0x0A, 0xFF] {
        let mut unknown = good.clone();
        unknown[mode_at] = bad;
        assert_eq!(
            Command::decode(&unknown),
            Err(DecodeError::Invalid("mode")),
            "mode byte {bad:#04x}"
        );
    }
    let mut zero_lease = good.clone();
    zero_lease[lease_at] = 0;
    assert_eq!(
        Command::decode(&zero_lease),
        Err(DecodeError::Invalid("lease of 0"))
    );
    // Every byte value in every position decodes or is refused: no panic.
    for at in 0..good.len() {
        for b in 0..=255u8 {
            let mut v = good.clone();
            v[at] = b;
            let _ = Command::decode(&v);
        }
    }
}

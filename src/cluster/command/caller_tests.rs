//! The caller prefix of a client request's entry: round trips, survives a
//! re-proposal, is absent for an unauthenticated caller (whose entries are
//! the bytes of old), and is decoded strictly.

use super::entry::{CALLER_PREFIX_BYTES, TAG_CALLER};
use super::*;
use crate::engine::Caller;

fn request_entry(caller: Caller, req: &Request<'_>) -> Vec<u8> {
    let rid = Rid {
        node: 1,
        epoch: 2,
        seq: 3,
    };
    let mut out = Vec::new();
    Command::write_request_entry(&mut out, 0x1234, caller, rid, 1, 7, req);
    out
}

#[test]
fn a_caller_prefix_round_trips_and_survives_a_reproposal() {
    let reqs = [
        Request::Acquire {
            wait_s: 2,
            lease_s: 9,
            owner: 77,
            key: "k",
        },
        Request::Release { token: 5, key: "k" },
        Request::Extend {
            lease_s: 3,
            token: 5,
            key: "k",
        },
    ];
    let callers = [
        Caller {
            holder: 0xDEAD_BEEF_0000_0001,
            admin: false,
        },
        Caller {
            holder: 0,
            admin: true,
        },
        Caller {
            holder: 7,
            admin: true,
        },
    ];
    for req in &reqs {
        for who in callers {
            let entry = request_entry(who, req);
            let cmd = Command::encode_request(
                Rid {
                    node: 1,
                    epoch: 2,
                    seq: 3,
                },
                1,
                7,
                req,
            );
            assert_eq!(entry.len(), 3 + CALLER_PREFIX_BYTES + cmd.len());
            assert_eq!(Command::entry_command(&entry), &cmd[..]);
            let (decoded, bits, got) = Command::decode_entry(&entry).unwrap();
            assert_eq!(
                (Command::decode(&cmd).unwrap(), bits, got),
                (decoded, Some(0x1234), who)
            );
            // Proposed again with other bits, the caller stays.
            let again = Command::encode_entry(0x9999, Command::entry_body(&entry));
            let (_, bits, got) = Command::decode_entry(&again).unwrap();
            assert_eq!((bits, got), (Some(0x9999), who));
            for cut in 0..entry.len() {
                assert!(Command::decode_entry(&entry[..cut]).is_err(), "cut {cut}");
            }
        }
    }
}

#[test]
fn an_unauthenticated_callers_entry_is_the_entry_of_old() {
    let req = Request::Release { token: 5, key: "k" };
    let rid = Rid {
        node: 1,
        epoch: 2,
        seq: 3,
    };
    let old = Command::encode_entry(0x1234, &Command::encode_request(rid, 1, 7, &req));
    // An address's holder number is even: recorded as unknown.
    let address = Caller {
        holder: 0x5555_0000_0000_0002,
        admin: false,
    };
    assert_eq!(entry_caller(address), Caller::default());
    assert_eq!(request_entry(entry_caller(address), &req), old);
    let uid = Caller {
        holder: 0x5555_0000_0000_0003,
        admin: false,
    };
    assert_eq!(entry_caller(uid), uid);
    let admin_address = Caller {
        holder: 2,
        admin: true,
    };
    assert_eq!(
        entry_caller(admin_address),
        Caller {
            holder: 0,
            admin: true
        }
    );
    // An entry of old decodes with the default caller, with or without
    // token bits.
    let (_, _, who) = Command::decode_entry(&old).unwrap();
    assert_eq!(who, Caller::default());
    let older = Command::encode_request(rid, 1, 7, &req);
    assert_eq!(Command::decode_entry(&older).unwrap().2, Caller::default());
}

#[test]
fn bad_caller_prefixes_are_errors() {
    let req = Request::Release { token: 5, key: "k" };
    let who = Caller {
        holder: 3,
        admin: false,
    };
    let good = request_entry(who, &req);
    let flags_at = 3 + 1 + 8;
    for flags in [2u8, 0x80, 0xFF] {
        let mut bad = good.clone();
        bad[flags_at] = flags;
        assert_eq!(
            Command::decode_entry(&bad),
            Err(DecodeError::Invalid("caller flags"))
        );
    }
    // The default caller written out: it has no prefix.
    let mut bad = good.clone();
    bad[4..flags_at].fill(0);
    assert_eq!(
        Command::decode_entry(&bad),
        Err(DecodeError::Invalid("caller prefix of the default caller"))
    );
    // A caller on a timer's command.
    let expire = Command::Expire {
        key: "k".into(),
        token: 9,
        generation: 0,
    }
    .encode();
    let mut body = good[3..3 + CALLER_PREFIX_BYTES].to_vec();
    body.extend_from_slice(&expire);
    assert_eq!(
        Command::decode_entry(&Command::encode_entry(1, &body)),
        Err(DecodeError::Invalid("caller of a command not a request"))
    );
    // Without token bits a caller prefix is no command at all.
    assert_eq!(
        Command::decode_entry(&good[3..]),
        Err(DecodeError::BadTag(TAG_CALLER))
    );
}

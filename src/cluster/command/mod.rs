//! The replicated commands and their compact binary encoding.
//!
//! Every client request becomes one [`Command`] in the Raft log: an
//! acquire [`Command::Acquire`], an acquire with a limit (protocol 1.2,
//! PROTOCOL §6) [`Command::AcquireWithLimit`], a release
//! [`Command::Release`], an extend [`Command::Extend`]; the leader's
//! timers become [`Command::Expire`] (one per grant, a permit's too) and
//! [`Command::WaitTimeout`]; a client disconnect becomes
//! [`Command::CancelWaiters`]. The encoding is hand-written
//! (big-endian integers, a length-prefixed key) so that it is small, has no
//! schema machinery, and decoding bad bytes is an error, never a panic.
//!
//! The parts: `entry` (a log entry's token bits and caller prefixes in
//! front of its command) and `fields` (the field writer and reader, and
//! [`DecodeError`]).

use std::borrow::Cow;

use crate::codec::ByteReader;
use crate::proto::{Mode, Request};

mod entry;
mod fields;

pub use entry::entry_caller;
pub use fields::DecodeError;
pub(crate) use fields::{ReadFields, Writer};

/// A request id: the node that received the request, that node's boot epoch
/// and a sequence number unique within the boot. A re-proposed command
/// carries the same rid, so the state machine applies it at most once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Rid {
    /// The node holding the client connection (the origin).
    pub node: u64,
    /// The origin's boot epoch: raised on every start from the data dir.
    pub epoch: u64,
    /// Sequence number within the boot, from 1.
    pub seq: u64,
}

/// A client connection, named cluster-wide: node, boot epoch, connection id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Origin {
    /// The node holding the connection.
    pub node: u64,
    /// That node's boot epoch.
    pub epoch: u64,
    /// The connection id on that node.
    pub conn: u64,
}

impl Rid {
    /// The origin of a request with this rid arriving on connection `conn`.
    #[must_use]
    pub fn origin(self, conn: u64) -> Origin {
        Origin {
            node: self.node,
            epoch: self.epoch,
            conn,
        }
    }
}

/// One replicated command. Applying one is deterministic; each is validated
/// on apply, so a stale timer or a duplicate does nothing. A decoded
/// command borrows its key from the entry's bytes (checked once, never
/// copied); one made here to be proposed may own it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command<'a> {
    /// A client's acquire (PROTOCOL §2.1).
    Acquire {
        /// Request id.
        rid: Rid,
        /// The origin's lowest unapplied seq: every seq below it has applied
        /// or been given up, so the dedup table may forget them.
        floor: u64,
        /// The client connection on the origin node.
        conn: u64,
        /// The lock name.
        key: Cow<'a, str>,
        /// Correlation id echoed in the reply.
        owner: u64,
        /// Seconds the client may queue.
        wait_s: u8,
        /// Seconds the grant lives.
        lease_s: u8,
    },
    /// A client's acquire with a limit (protocol 1.2, PROTOCOL §6.2): one
    /// of the `limit` places of `key`, shared or exclusive.
    AcquireWithLimit {
        /// Request id.
        rid: Rid,
        /// As for `Acquire`.
        floor: u64,
        /// The client connection on the origin node.
        conn: u64,
        /// The lock name.
        key: Cow<'a, str>,
        /// Correlation id echoed in the reply.
        owner: u64,
        /// Seconds the client may queue.
        wait_s: u8,
        /// Seconds the grant lives.
        lease_s: u8,
        /// How many grants the key admits at once; never 0.
        limit: u16,
        /// Whether the grant shares the key or takes it whole.
        mode: Mode,
    },
    /// A client's release (PROTOCOL §2.2).
    Release {
        /// Request id.
        rid: Rid,
        /// As for `Acquire`.
        floor: u64,
        /// The client connection on the origin node.
        conn: u64,
        /// The lock name.
        key: Cow<'a, str>,
        /// The token being released.
        token: u64,
    },
    /// A client's extend (PROTOCOL §5.2).
    Extend {
        /// Request id.
        rid: Rid,
        /// As for `Acquire`.
        floor: u64,
        /// The client connection on the origin node.
        conn: u64,
        /// The lock name.
        key: Cow<'a, str>,
        /// The token being extended.
        token: u64,
        /// Seconds the grant lives from the leader's apply on.
        lease_s: u8,
    },
    /// The leader's lease timer: end the grant `token` of `key`, if it is
    /// still current and still in lease generation `generation` (no Extend
    /// of it applied since the timer was set).
    Expire {
        /// The lock name.
        key: Cow<'a, str>,
        /// The grant the timer was set for.
        token: u64,
        /// The grant's lease generation when the timer was set: 0 for the
        /// grant itself, one more for each Extend that took effect.
        generation: u64,
    },
    /// The leader's wait timer: answer the queued acquire `waiter` with T.
    WaitTimeout {
        /// The lock name.
        key: Cow<'a, str>,
        /// The rid of the queued acquire.
        waiter: Rid,
    },
    /// A client connection closed: drop its queued acquires.
    CancelWaiters {
        /// The connection.
        origin: Origin,
    },
}

const TAG_ACQUIRE: u8 = 1;
const TAG_RELEASE: u8 = 2;
const TAG_EXPIRE: u8 = 3;
const TAG_WAIT_TIMEOUT: u8 = 4;
const TAG_CANCEL: u8 = 5;
const TAG_EXTEND: u8 = 6;
/// An Expire of a generation above 0. Generation 0 keeps [`TAG_EXPIRE`]'s
/// layout, so logs written before Extend existed read the same.
const TAG_EXPIRE_GENERATION: u8 = 7;
/// An acquire with a limit (protocol 1.2). Tags 8 and 9 are the log
/// entry's prefixes (`entry`), which a command never starts with.
const TAG_ACQUIRE_WITH_LIMIT: u8 = 10;

/// Longest key a command may carry (the wire protocol's hard ceiling).
pub const MAX_COMMAND_KEY_BYTES: usize = crate::limits::MAX_KEY_BYTES_CEILING;

/// The most bytes any command encodes besides its key's: tag, request id,
/// floor, connection, owner, wait, lease and the key's length (an Extend's
/// token and lease take no more than an Acquire's owner, wait and lease).
const ENCODED_FIXED_MAX: usize = 1 + 24 + 8 + 8 + 8 + 1 + 1 + 4;

/// What an acquire with a limit encodes beyond [`ENCODED_FIXED_MAX`]: its
/// limit and its mode.
const ENCODED_LIMIT_EXTRA: usize = 2 + 1;

/// The most bytes the command of client request `req` encodes besides its
/// key's.
fn encoded_fixed_max(req: &Request<'_>) -> usize {
    match req {
        Request::AcquireWithLimit { .. } => ENCODED_FIXED_MAX + ENCODED_LIMIT_EXTRA,
        _ => ENCODED_FIXED_MAX,
    }
}

impl Writer {
    /// The `Acquire`, `AcquireWithLimit`, `Release` or `Extend` command
    /// client request `req` becomes.
    fn request(&mut self, rid: Rid, floor: u64, conn: u64, req: &Request<'_>) {
        match *req {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            } => {
                self.u8(TAG_ACQUIRE);
                self.rid(rid);
                self.u64(floor);
                self.u64(conn);
                self.u64(owner);
                self.u8(wait_s);
                self.u8(lease_s);
                self.key(key);
            }
            Request::AcquireWithLimit {
                wait_s,
                lease_s,
                owner,
                limit,
                mode,
                key,
            } => {
                self.u8(TAG_ACQUIRE_WITH_LIMIT);
                self.rid(rid);
                self.u64(floor);
                self.u64(conn);
                self.u64(owner);
                self.u8(wait_s);
                self.u8(lease_s);
                self.u16(limit);
                self.u8(mode.byte());
                self.key(key);
            }
            Request::Release { token, key } => {
                self.u8(TAG_RELEASE);
                self.rid(rid);
                self.u64(floor);
                self.u64(conn);
                self.u64(token);
                self.key(key);
            }
            Request::Extend {
                lease_s,
                token,
                key,
            } => {
                self.u8(TAG_EXTEND);
                self.rid(rid);
                self.u64(floor);
                self.u64(conn);
                self.u64(token);
                self.u8(lease_s);
                self.key(key);
            }
        }
    }
}

impl<'a> Command<'a> {
    /// The command's encoding, as proposed to Raft.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        // The fixed fields take at most ENCODED_FIXED_MAX bytes (and an
        // acquire with a limit its limit and mode more): one allocation
        // holds all.
        let key_len = self.key().map_or(0, str::len);
        let fixed = match self {
            Command::AcquireWithLimit { .. } => ENCODED_FIXED_MAX + ENCODED_LIMIT_EXTRA,
            _ => ENCODED_FIXED_MAX,
        };
        let mut w = Writer {
            buf: Vec::with_capacity(fixed + key_len),
        };
        match self {
            Command::Acquire { .. }
            | Command::AcquireWithLimit { .. }
            | Command::Release { .. }
            | Command::Extend { .. } => {
                if let Some((rid, floor, conn, req)) = self.as_request() {
                    w.request(rid, floor, conn, &req);
                }
            }
            Command::Expire {
                key,
                token,
                generation: 0,
            } => {
                w.u8(TAG_EXPIRE);
                w.u64(*token);
                w.key(key);
            }
            Command::Expire {
                key,
                token,
                generation,
            } => {
                w.u8(TAG_EXPIRE_GENERATION);
                w.u64(*token);
                w.u64(*generation);
                w.key(key);
            }
            Command::WaitTimeout { key, waiter } => {
                w.u8(TAG_WAIT_TIMEOUT);
                w.rid(*waiter);
                w.key(key);
            }
            Command::CancelWaiters { origin } => {
                w.u8(TAG_CANCEL);
                w.origin(*origin);
            }
        }
        w.buf
    }

    /// A client request's command as its request id, floor, connection
    /// and the request it came from; `None` for the other commands.
    fn as_request(&self) -> Option<(Rid, u64, u64, Request<'_>)> {
        match self {
            Command::Acquire {
                rid,
                floor,
                conn,
                key,
                owner,
                wait_s,
                lease_s,
            } => {
                let req = Request::Acquire {
                    wait_s: *wait_s,
                    lease_s: *lease_s,
                    owner: *owner,
                    key,
                };
                Some((*rid, *floor, *conn, req))
            }
            Command::AcquireWithLimit {
                rid,
                floor,
                conn,
                key,
                owner,
                wait_s,
                lease_s,
                limit,
                mode,
            } => {
                let req = Request::AcquireWithLimit {
                    wait_s: *wait_s,
                    lease_s: *lease_s,
                    owner: *owner,
                    limit: *limit,
                    mode: *mode,
                    key,
                };
                Some((*rid, *floor, *conn, req))
            }
            Command::Release {
                rid,
                floor,
                conn,
                key,
                token,
            } => Some((*rid, *floor, *conn, Request::Release { token: *token, key })),
            Command::Extend {
                rid,
                floor,
                conn,
                key,
                token,
                lease_s,
            } => {
                let req = Request::Extend {
                    lease_s: *lease_s,
                    token: *token,
                    key,
                };
                Some((*rid, *floor, *conn, req))
            }
            _ => None,
        }
    }

    /// The encoding of the command client request `req` becomes (its
    /// `Acquire`, `AcquireWithLimit`, `Release` or `Extend`, as
    /// [`Command::encode`] writes it), written from the request's borrowed
    /// key.
    #[must_use]
    pub fn encode_request(rid: Rid, floor: u64, conn: u64, req: &Request<'_>) -> Vec<u8> {
        let mut w = Writer {
            buf: Vec::with_capacity(encoded_fixed_max(req) + req.key().len()),
        };
        w.request(rid, floor, conn, req);
        w.buf
    }

    /// Decodes one command; any malformed input is an error.
    pub fn decode(bytes: &'a [u8]) -> Result<Command<'a>, DecodeError> {
        let mut r = ByteReader::new(bytes);
        let cmd = match r.u8()? {
            tag @ (TAG_ACQUIRE | TAG_ACQUIRE_WITH_LIMIT | TAG_RELEASE | TAG_EXTEND) => {
                Self::decode_request(tag, &mut r)?
            }
            TAG_EXPIRE => {
                let token = r.u64()?;
                Command::Expire {
                    key: Cow::Borrowed(r.key_str()?),
                    token,
                    generation: 0,
                }
            }
            TAG_EXPIRE_GENERATION => {
                let token = r.u64()?;
                let generation = r.u64()?;
                if generation == 0 {
                    // Generation 0 has one encoding only: TAG_EXPIRE.
                    return Err(DecodeError::Invalid(
                        "generation 0 under the generation tag",
                    ));
                }
                Command::Expire {
                    key: Cow::Borrowed(r.key_str()?),
                    token,
                    generation,
                }
            }
            TAG_WAIT_TIMEOUT => {
                let waiter = r.rid()?;
                Command::WaitTimeout {
                    key: Cow::Borrowed(r.key_str()?),
                    waiter,
                }
            }
            TAG_CANCEL => Command::CancelWaiters {
                origin: r.origin()?,
            },
            t => return Err(DecodeError::BadTag(t)),
        };
        r.finish()?;
        Ok(cmd)
    }

    /// The fields of a client request's command (`tag` is one of
    /// [`TAG_ACQUIRE`], [`TAG_ACQUIRE_WITH_LIMIT`], [`TAG_RELEASE`] and
    /// [`TAG_EXTEND`]) after its tag.
    fn decode_request(tag: u8, r: &mut ByteReader<'a>) -> Result<Command<'a>, DecodeError> {
        let rid = r.rid()?;
        let floor = r.u64()?;
        let conn = r.u64()?;
        let lease = |lease_s: u8| match lease_s {
            0 => Err(DecodeError::Invalid("lease of 0")),
            l => Ok(l),
        };
        Ok(match tag {
            TAG_ACQUIRE => {
                let owner = r.u64()?;
                let wait_s = r.u8()?;
                let lease_s = lease(r.u8()?)?;
                Command::Acquire {
                    rid,
                    floor,
                    conn,
                    key: Cow::Borrowed(r.key_str()?),
                    owner,
                    wait_s,
                    lease_s,
                }
            }
            TAG_ACQUIRE_WITH_LIMIT => {
                let owner = r.u64()?;
                let wait_s = r.u8()?;
                let lease_s = lease(r.u8()?)?;
                let limit = match r.u16()? {
                    0 => return Err(DecodeError::Invalid("limit of 0")),
                    l => l,
                };
                let mode = Mode::from_byte(r.u8()?).ok_or(DecodeError::Invalid("mode"))?;
                Command::AcquireWithLimit {
                    rid,
                    floor,
                    conn,
                    key: Cow::Borrowed(r.key_str()?),
                    owner,
                    wait_s,
                    lease_s,
                    limit,
                    mode,
                }
            }
            TAG_RELEASE => Command::Release {
                rid,
                floor,
                conn,
                token: r.u64()?,
                key: Cow::Borrowed(r.key_str()?),
            },
            TAG_EXTEND => {
                let token = r.u64()?;
                let lease_s = lease(r.u8()?)?;
                Command::Extend {
                    rid,
                    floor,
                    conn,
                    key: Cow::Borrowed(r.key_str()?),
                    token,
                    lease_s,
                }
            }
            t => return Err(DecodeError::BadTag(t)),
        })
    }

    /// The lock name the command is about (none for `CancelWaiters`).
    #[must_use]
    pub fn key(&self) -> Option<&str> {
        match self {
            Command::Acquire { key, .. }
            | Command::AcquireWithLimit { key, .. }
            | Command::Release { key, .. }
            | Command::Extend { key, .. }
            | Command::Expire { key, .. }
            | Command::WaitTimeout { key, .. } => Some(key),
            Command::CancelWaiters { .. } => None,
        }
    }

    /// The rid of a client command (acquire, acquire with a limit, release
    /// or extend).
    #[must_use]
    pub fn rid(&self) -> Option<Rid> {
        match self {
            Command::Acquire { rid, .. }
            | Command::AcquireWithLimit { rid, .. }
            | Command::Release { rid, .. }
            | Command::Extend { rid, .. } => Some(*rid),
            _ => None,
        }
    }
}

#[cfg(test)]
mod caller_tests;

#[cfg(test)]
mod limit_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Caller;

    fn samples() -> Vec<Command<'static>> {
        let rid = Rid {
            node: 2,
            epoch: 7,
            seq: 0x0A0A,
        };
        vec![
            Command::Acquire {
                rid,
                floor: 3,
                conn: 10,
                key: "db\u{e9}".into(),
                owner: 0x0A0B,
                wait_s: 5,
                lease_s: 30,
            },
            Command::Release {
                rid,
                floor: 9,
                conn: 11,
                key: "k".into(),
                token: 42,
            },
            Command::Expire {
                key: "k".into(),
                token: u64::MAX,
                generation: 0,
            },
            Command::Expire {
                key: "k".into(),
                token: 12,
                generation: 0x0A0A,
            },
            Command::Extend {
                rid,
                floor: 4,
                conn: 12,
                key: "e".into(),
                token: 0x0A0A_0A0A,
                lease_s: 10,
            },
            Command::WaitTimeout {
                key: "k".into(),
                waiter: rid,
            },
            Command::CancelWaiters {
                origin: rid.origin(99),
            },
        ]
    }

    #[test]
    fn every_command_roundtrips() {
        for c in samples() {
            assert_eq!(Command::decode(&c.encode()), Ok(c.clone()), "{c:?}");
        }
    }

    #[test]
    fn a_decoded_key_is_borrowed_from_the_entry() {
        for c in samples() {
            let bytes = c.encode();
            let d = Command::decode(&bytes).unwrap();
            let key = match &d {
                Command::Acquire { key, .. }
                | Command::AcquireWithLimit { key, .. }
                | Command::Release { key, .. }
                | Command::Extend { key, .. }
                | Command::Expire { key, .. }
                | Command::WaitTimeout { key, .. } => key,
                Command::CancelWaiters { .. } => continue,
            };
            let Cow::Borrowed(k) = key else {
                panic!("owned key in {d:?}");
            };
            // The key lies inside the entry's own bytes.
            let (start, end) = (
                bytes.as_ptr() as usize,
                bytes.as_ptr() as usize + bytes.len(),
            );
            assert!((start..end).contains(&(k.as_ptr() as usize)), "{d:?}");
        }
    }

    #[test]
    fn a_request_entry_written_in_one_pass_is_its_entry_and_gives_its_command_back() {
        let rid = Rid {
            node: 3,
            epoch: 4,
            seq: 5,
        };
        let reqs = [
            Request::Acquire {
                wait_s: 2,
                lease_s: 9,
                owner: 77,
                key: "db\u{e9}",
            },
            Request::Release {
                token: 1 << 20,
                key: "k",
            },
            Request::Extend {
                lease_s: 3,
                token: 99,
                key: "e",
            },
        ];
        let mut out = b"before".to_vec();
        for req in &reqs {
            out.truncate(6);
            let caller = Caller::default();
            Command::write_request_entry(&mut out, 0xBEEF, caller, rid, 8, 21, req);
            assert_eq!(&out[..6], b"before");
            let cmd = Command::encode_request(rid, 8, 21, req);
            assert_eq!(out[6..], Command::encode_entry(0xBEEF, &cmd)[..]);
            assert_eq!(Command::entry_command(&out[6..]), &cmd[..]);
            assert_eq!(Command::entry_body(&out[6..]), &cmd[..]);
            let (decoded, bits, who) = Command::decode_entry(&out[6..]).unwrap();
            assert_eq!((decoded.rid(), bits), (Some(rid), Some(0xBEEF)));
            assert_eq!(who, Caller::default());
        }
        // An entry from before token bits is all command.
        let old = Command::encode_request(rid, 8, 21, &reqs[1]);
        assert_eq!(Command::entry_command(&old), &old[..]);
    }

    #[test]
    fn encoding_takes_one_allocation_of_the_size_it_needs_at_most() {
        for c in samples() {
            let key_len = c.key().map_or(0, str::len);
            let bytes = c.encode();
            // A vector that grew past its first capacity would have more.
            assert_eq!(bytes.capacity(), ENCODED_FIXED_MAX + key_len, "{c:?}");
            assert!(bytes.len() <= bytes.capacity(), "{c:?}");
        }
        // The acquire is the largest command: it fills the bound exactly.
        let acquire = &samples()[0];
        let Command::Acquire { key, .. } = acquire else {
            unreachable!()
        };
        assert_eq!(acquire.encode().len(), ENCODED_FIXED_MAX + key.len());
    }

    #[test]
    fn a_client_request_encodes_as_its_command() {
        for c in samples() {
            let (rid, floor, conn, req) = match &c {
                Command::Acquire {
                    rid,
                    floor,
                    conn,
                    key,
                    owner,
                    wait_s,
                    lease_s,
                } => (
                    *rid,
                    *floor,
                    *conn,
                    Request::Acquire {
                        wait_s: *wait_s,
                        lease_s: *lease_s,
                        owner: *owner,
                        key,
                    },
                ),
                Command::Release {
                    rid,
                    floor,
                    conn,
                    key,
                    token,
                } => (*rid, *floor, *conn, Request::Release { token: *token, key }),
                _ => continue,
            };
            let bytes = Command::encode_request(rid, floor, conn, &req);
            assert_eq!(bytes, c.encode(), "{c:?}");
            assert_eq!(Command::decode(&bytes), Ok(c.clone()));
        }
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        for c in samples() {
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
    fn bad_tags_keys_and_leases_are_errors() {
        assert_eq!(Command::decode(&[9]), Err(DecodeError::BadTag(9)));
        let mut w = Writer::default();
        w.u8(TAG_EXPIRE);
        w.u64(1);
        w.u32(0);
        assert_eq!(Command::decode(&w.buf), Err(DecodeError::BadKey));
        let mut w = Writer::default();
        w.u8(TAG_EXPIRE);
        w.u64(1);
        w.u32(2);
        w.buf.extend_from_slice(&[0xff, 0xfe]);
        assert_eq!(Command::decode(&w.buf), Err(DecodeError::BadKey));
        // A newline, in an ASCII key and in one that is not.
        for key in [&b"a\nb"[..], "\u{e9}\n".as_bytes()] {
            let mut w = Writer::default();
            w.u8(TAG_EXPIRE);
            w.u64(1);
            w.u32(u32::try_from(key.len()).unwrap());
            w.buf.extend_from_slice(key);
            assert_eq!(Command::decode(&w.buf), Err(DecodeError::BadKey), "{key:?}");
        }
        let mut w = Writer::default();
        w.u8(TAG_EXPIRE);
        w.u64(1);
        w.u32(u32::MAX);
        assert_eq!(Command::decode(&w.buf), Err(DecodeError::BadKey));
        let mut bytes = samples()[0].encode();
        bytes[1 + 24 + 8 + 8 + 8 + 1] = 0; // lease byte
        assert_eq!(
            Command::decode(&bytes),
            Err(DecodeError::Invalid("lease of 0"))
        );
    }
}

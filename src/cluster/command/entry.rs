//! A command's log entry: the proposer's random token bits and, on a
//! client request, its caller, in front of the command.

use super::{encoded_fixed_max, Command, DecodeError, Rid, Writer};
use crate::codec::ByteReader;
use crate::engine::Caller;
use crate::proto::Request;

/// An entry's prefix: the proposer's 16 random bits for the token of the
/// grant the entry may make (`crate::token`), then the command. Entries
/// written before tokens had random bits have no prefix (and their grant's
/// token is the bare index).
pub(super) const TAG_TOKEN_BITS: u8 = 8;
/// An entry's second prefix, after the token bits, on a client request
/// only: who sent it ([`Caller`]), as a `u64` holder number and a flags
/// byte ([`CALLER_ADMIN`]). Written only for a caller other than the
/// default ([`entry_caller`]), so an entry without it, and every entry
/// written before grants were bound to identities, applies with the
/// default caller (holder 0: the token alone decides).
pub(super) const TAG_CALLER: u8 = 9;
/// The caller prefix's flag: the caller is `--admin-identity`.
pub(super) const CALLER_ADMIN: u8 = 1;
/// Tag, holder number and flags.
pub(super) const CALLER_PREFIX_BYTES: usize = 1 + 8 + 1;

/// The caller a client request's entry records for `who`: an
/// authenticated identity's holder number (odd), and whether it is the
/// admin identity. An unauthenticated one (a source address, even) is
/// recorded as unknown (0): between addresses the token alone decides
/// anyway, and so its entries are the bytes they were before grants were
/// bound to identities.
#[must_use]
pub fn entry_caller(who: Caller) -> Caller {
    Caller {
        holder: if who.holder & 1 == 1 { who.holder } else { 0 },
        admin: who.admin,
    }
}

impl Writer {
    /// The caller prefix of an entry; nothing for the default caller.
    fn caller(&mut self, c: Caller) {
        if c != Caller::default() {
            self.u8(TAG_CALLER);
            self.u64(c.holder);
            self.u8(if c.admin { CALLER_ADMIN } else { 0 });
        }
    }
}

impl<'a> Command<'a> {
    /// The bytes of a log entry: the proposer's random token bits `bits`,
    /// then `cmd`: a command as [`Command::encode`] writes it, or what
    /// [`Command::entry_body`] gives of an entry (its caller prefix, if
    /// any, and its command).
    #[must_use]
    pub fn encode_entry(bits: u16, cmd: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(3 + cmd.len());
        v.push(TAG_TOKEN_BITS);
        v.extend_from_slice(&bits.to_le_bytes());
        v.extend_from_slice(cmd);
        v
    }

    /// Appends to `out` the log entry client request `req` of `caller`
    /// becomes: the bits, the caller prefix (none for the default caller,
    /// see [`entry_caller`]) and [`Command::encode_request`]'s command, in
    /// one pass.
    pub fn write_request_entry(
        out: &mut Vec<u8>,
        bits: u16,
        caller: Caller,
        rid: Rid,
        floor: u64,
        conn: u64,
        req: &Request<'_>,
    ) {
        let mut w = Writer {
            buf: std::mem::take(out),
        };
        w.buf
            .reserve(3 + CALLER_PREFIX_BYTES + encoded_fixed_max(req) + req.key().len());
        w.u8(TAG_TOKEN_BITS);
        w.buf.extend_from_slice(&bits.to_le_bytes());
        w.caller(caller);
        w.request(rid, floor, conn, req);
        *out = w.buf;
    }

    /// What follows the token bits of a log entry's bytes (its caller
    /// prefix, if any, and its command), to propose again with fresh bits
    /// ([`Command::encode_entry`]); the whole of an entry written before
    /// tokens had random bits.
    #[must_use]
    pub fn entry_body(bytes: &[u8]) -> &[u8] {
        match bytes {
            [TAG_TOKEN_BITS, _, _, rest @ ..] => rest,
            _ => bytes,
        }
    }

    /// The command of a log entry's bytes (as [`Command::encode_entry`]
    /// and [`Command::write_request_entry`] write them): what follows the
    /// token bits and the caller prefix.
    #[must_use]
    pub fn entry_command(bytes: &[u8]) -> &[u8] {
        match Self::entry_body(bytes) {
            [TAG_CALLER, rest @ ..] if rest.len() >= CALLER_PREFIX_BYTES - 1 => {
                &rest[CALLER_PREFIX_BYTES - 1..]
            }
            body => body,
        }
    }

    /// Decodes a log entry: the command, its proposer's token bits
    /// (`None` for an entry written before tokens had random bits) and
    /// the caller of a client request (the default without a caller
    /// prefix).
    ///
    /// # Errors
    /// Any malformed input (see [`Command::decode`]), a caller prefix that
    /// is cut short, has unknown flags, names the default caller (which has
    /// no prefix) or comes with a command that is not a client request.
    pub fn decode_entry(
        bytes: &'a [u8],
    ) -> Result<(Command<'a>, Option<u16>, Caller), DecodeError> {
        match bytes {
            [TAG_TOKEN_BITS, a, b, rest @ ..] => {
                let (caller, rest) = Self::decode_caller(rest)?;
                let cmd = Command::decode(rest)?;
                if caller != Caller::default() && cmd.rid().is_none() {
                    return Err(DecodeError::Invalid("caller of a command not a request"));
                }
                Ok((cmd, Some(u16::from_le_bytes([*a, *b])), caller))
            }
            [TAG_TOKEN_BITS, ..] => Err(DecodeError::Truncated),
            _ => Ok((Command::decode(bytes)?, None, Caller::default())),
        }
    }

    /// The caller prefix at the start of `body`, if there is one, and the
    /// bytes after it.
    fn decode_caller(body: &[u8]) -> Result<(Caller, &[u8]), DecodeError> {
        if body.first() != Some(&TAG_CALLER) {
            return Ok((Caller::default(), body));
        }
        let mut r = ByteReader::new(&body[1..]);
        let holder = r.u64()?;
        let flags = r.u8()?;
        if flags & !CALLER_ADMIN != 0 {
            return Err(DecodeError::Invalid("caller flags"));
        }
        let caller = Caller {
            holder,
            admin: flags & CALLER_ADMIN != 0,
        };
        if caller == Caller::default() {
            // The default caller has one encoding only: no prefix.
            return Err(DecodeError::Invalid("caller prefix of the default caller"));
        }
        Ok((caller, r.rest()))
    }
}

//! The engine's deterministic snapshot: its lock table as bytes, and back.
//!
//! [`Engine::write_image`] writes every registered key in byte order of
//! the key, each with its token, its grant's tag and its queue in order;
//! equal tables give equal bytes, whatever the hash key. Fields are
//! big-endian; a key is a `u32` length and its bytes:
//!
//! ```text
//! u32 keys, then per key:   key, u64 token, [u64 holder], grant tag,
//!                           u32 waiters,
//!   then per waiter:        waiter tag, [u64 holder], u64 owner, u8 wait_s,
//!                           u8 lease_s
//! ```
//!
//! The holders ([`super::Caller::holder`] of each grant's taker and of
//! each waiter's connection) are written when the codec asks for them
//! ([`TagCodec::holders`]); an image without them restores every grant
//! and waiter with holder 0 (unknown: the token alone decides).
//!
//! The tags are the caller's ([`TagCodec`]); the engine's connection ids
//! are not written (they are local to a process), so the caller's tags
//! must let it name each waiter's connection at [`Engine::restore`].
//! Restoring is for replicated (cluster-mode) engines only: single mode
//! keeps no snapshot.

use std::fmt;

use super::{Acquire, AcquireOutcome, Caller, ConnId, Engine, Outbox};
use crate::codec::ReadError;
use crate::limits::EngineLimits;
use crate::time::Millis;

/// Why image bytes were refused. Nothing is changed by a refused image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageError {
    /// The bytes end inside a field, or a count is larger than the bytes
    /// left could hold.
    Truncated,
    /// A key is empty, too long, not UTF-8 or holds a newline.
    BadKey,
    /// The fields decode but do not describe a table these limits allow.
    Invalid(&'static str),
}

impl fmt::Display for ImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageError::Truncated => f.write_str("lock table image truncated"),
            ImageError::BadKey => f.write_str("lock table image holds a bad key"),
            ImageError::Invalid(what) => write!(f, "lock table image: invalid {what}"),
        }
    }
}

impl std::error::Error for ImageError {}

impl From<ReadError> for ImageError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Truncated => ImageError::Truncated,
            ReadError::BadKey => ImageError::BadKey,
        }
    }
}

/// Reads the fields of an image: the one byte reader of [`crate::codec`].
pub use crate::codec::ByteReader as ImageReader;

/// How a caller's tags are written into an image and read back. Grants and
/// waiters may be written differently (a grant's tag may carry what a
/// waiter's need not).
pub trait TagCodec<T> {
    /// Appends the tag of a grant.
    fn write_grant(&self, tag: &T, buf: &mut Vec<u8>);
    /// Appends the tag of a waiter.
    fn write_waiter(&self, tag: &T, buf: &mut Vec<u8>);
    /// Reads what [`TagCodec::write_grant`] wrote.
    ///
    /// # Errors
    /// Truncated or invalid bytes.
    fn read_grant(&self, r: &mut ImageReader<'_>) -> Result<T, ImageError>;
    /// Reads what [`TagCodec::write_waiter`] wrote.
    ///
    /// # Errors
    /// Truncated or invalid bytes.
    fn read_waiter(&self, r: &mut ImageReader<'_>) -> Result<T, ImageError>;
    /// The fewest bytes a grant's tag takes (for count checks).
    fn min_grant_bytes(&self) -> usize;
    /// The fewest bytes a waiter's tag takes.
    fn min_waiter_bytes(&self) -> usize;
    /// Whether the image records each grant's and each waiter's holder
    /// number (a layout of the codec's choosing: it knows its version).
    fn holders(&self) -> bool {
        false
    }
}

/// A decoded image: what [`Engine::restore`] rebuilds an engine from. The
/// fields are public so that a caller can check or complete its tags
/// between reading and restoring.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Image<T> {
    /// The registered keys, in the order written (strictly increasing).
    pub keys: Vec<KeyImage<T>>,
}

/// One registered key of an [`Image`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyImage<T> {
    /// The lock name.
    pub key: String,
    /// The grant's token.
    pub token: u64,
    /// Who took the grant ([`Caller::holder`]; 0: unknown).
    pub holder: u64,
    /// The grant's tag.
    pub tag: T,
    /// The queue, head first.
    pub waiters: Vec<WaiterImage<T>>,
}

/// One queued acquire of a [`KeyImage`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaiterImage<T> {
    /// The acquire's owner.
    pub owner: u64,
    /// Its wait, in seconds.
    pub wait_s: u8,
    /// The lease it asks for, in seconds.
    pub lease_s: u8,
    /// Its connection's holder number ([`Caller::holder`]; 0: unknown),
    /// which its grant records. The waiters of one connection share it.
    pub holder: u64,
    /// Its tag.
    pub tag: T,
}

/// The engine connection the grants of a restored engine are made on (a
/// grant does not remember its connection).
const HOLDER_CONN: ConnId = 0;

impl<T> Engine<T> {
    /// The holder number of `conn`'s waiters, while it has some.
    fn conn_holder(&self, conn: ConnId) -> Option<u64> {
        let &i = self.conn_table.index.get(&conn)?;
        Some(self.conn_table.conns[i as usize].holder)
    }
}

fn put_u32(buf: &mut Vec<u8>, n: usize) {
    buf.extend_from_slice(
        &u32::try_from(n)
            .expect("table sizes are bounded by the limits")
            .to_be_bytes(),
    );
}

impl<T: Copy + Default> Engine<T> {
    /// Appends the lock table to `buf` in the canonical form of the module
    /// documentation. O(keys log keys + waiters).
    pub fn write_image(&self, codec: &impl TagCodec<T>, buf: &mut Vec<u8>) {
        let holders = codec.holders();
        let keys = self.sorted_keys();
        put_u32(buf, keys.len());
        for key in keys {
            let slot = self.keys.get(key).expect("a sorted key is registered");
            put_u32(buf, key.len());
            buf.extend_from_slice(key.as_bytes());
            buf.extend_from_slice(&slot.token.to_be_bytes());
            if holders {
                buf.extend_from_slice(&slot.holder.to_be_bytes());
            }
            codec.write_grant(&slot.tag, buf);
            put_u32(buf, self.queue(key).count());
            for w in self.queue(key) {
                codec.write_waiter(w.tag, buf);
                if holders {
                    buf.extend_from_slice(&w.holder.to_be_bytes());
                }
                buf.extend_from_slice(&w.owner.to_be_bytes());
                buf.push(w.wait_s);
                buf.push(w.lease_s);
            }
        }
    }

    /// Reads an image that [`Engine::write_image`] wrote, leaving `r` after
    /// it. Keys longer than `max_key_bytes` are refused.
    ///
    /// # Errors
    /// Truncated bytes, a bad key, keys out of order, or what `codec`
    /// refuses.
    pub fn read_image(
        r: &mut ImageReader<'_>,
        codec: &impl TagCodec<T>,
        max_key_bytes: usize,
    ) -> Result<Image<T>, ImageError> {
        let holder_bytes = if codec.holders() { 8 } else { 0 };
        let holder_of = |r: &mut ImageReader<'_>| {
            if holder_bytes == 0 {
                Ok(0)
            } else {
                r.u64()
            }
        };
        let n = r.count(4 + 8 + holder_bytes + 4 + codec.min_grant_bytes())?;
        let mut keys: Vec<KeyImage<T>> = Vec::with_capacity(n);
        for _ in 0..n {
            let key = r.key(max_key_bytes)?.to_owned();
            if keys.last().is_some_and(|k| k.key >= key) {
                return Err(ImageError::Invalid("key order"));
            }
            let token = r.u64()?;
            let holder = holder_of(r)?;
            let tag = codec.read_grant(r)?;
            let nw = r.count(holder_bytes + 8 + 2 + codec.min_waiter_bytes())?;
            let mut waiters = Vec::with_capacity(nw);
            for _ in 0..nw {
                let tag = codec.read_waiter(r)?;
                let holder = holder_of(r)?;
                waiters.push(WaiterImage {
                    owner: r.u64()?,
                    wait_s: r.u8()?,
                    lease_s: r.u8()?,
                    holder,
                    tag,
                });
            }
            keys.push(KeyImage {
                key,
                token,
                holder,
                tag,
                waiters,
            });
        }
        Ok(Image { keys })
    }

    /// A replicated engine holding exactly the table of `image`, whose next
    /// token is `next_token`; `conn_of` names the engine connection of each
    /// waiter from its tag. Grants are replayed in token order and then
    /// each queue in order, which reproduces the engine that wrote the
    /// image (waiter ids aside: they are local). Grants and waiters get
    /// their holders back.
    ///
    /// # Errors
    /// A token of 0 or not below `next_token`, a waiter without a
    /// connection, waiters of one connection with different holders, or a
    /// table over `limits`.
    pub fn restore(
        limits: EngineLimits,
        next_token: u64,
        image: &Image<T>,
        mut conn_of: impl FnMut(&T) -> Option<ConnId>,
    ) -> Result<Self, ImageError> {
        let mut e = Self::replicated_tagged(limits, 1);
        let mut out = Outbox::default();
        let mut by_token: Vec<&KeyImage<T>> = image.keys.iter().collect();
        by_token.sort_unstable_by_key(|k| k.token);
        for k in by_token {
            if k.token == 0 || k.token >= next_token {
                return Err(ImageError::Invalid("holder"));
            }
            e.raise_next_token(k.token);
            let req = Acquire {
                key: &k.key,
                owner: 0,
                wait_s: 0,
                lease_s: 1,
            };
            e.set_caller(Caller {
                holder: k.holder,
                admin: false,
            });
            let got = e.acquire_tagged(Millis::ZERO, HOLDER_CONN, req, k.tag, &mut out);
            if got != AcquireOutcome::Granted(k.token) {
                return Err(ImageError::Invalid("holder does not fit the limits"));
            }
        }
        for k in &image.keys {
            for w in &k.waiters {
                let conn =
                    conn_of(&w.tag).ok_or(ImageError::Invalid("waiter without connection"))?;
                let req = Acquire {
                    key: &k.key,
                    owner: w.owner,
                    wait_s: w.wait_s,
                    lease_s: w.lease_s,
                };
                e.set_caller(Caller {
                    holder: w.holder,
                    admin: false,
                });
                match e.acquire_tagged(Millis::ZERO, conn, req, w.tag, &mut out) {
                    AcquireOutcome::Queued(_) if w.wait_s > 0 && w.lease_s > 0 => {}
                    _ => return Err(ImageError::Invalid("waiter does not fit the limits")),
                }
                if e.conn_holder(conn) != Some(w.holder) {
                    return Err(ImageError::Invalid("waiter holder"));
                }
            }
        }
        e.set_caller(Caller::default());
        e.raise_next_token(next_token);
        Ok(e)
    }
}

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
//! [u32 permit keys, then per key:
//!                           key, u16 limit, u32 grants,
//!   then per grant:         u64 token, [u64 holder], u8 mode, grant tag,
//!   then                    u32 waiters,
//!   then per waiter:        waiter tag, [u64 holder], u64 owner, u8 wait_s,
//!                           u8 lease_s, u8 mode]
//! ```
//!
//! The holders ([`super::Caller::holder`] of each grant's taker and of
//! each waiter's connection) are written when the codec asks for them
//! ([`TagCodec::holders`]); an image without them restores every grant
//! and waiter with holder 0 (unknown: the token alone decides).
//!
//! The keys registered with a limit of 2 or more (PROTOCOL §6, module
//! `permits`) follow the mutexes when the codec asks for them
//! ([`TagCodec::permits`]), each with its limit, its grants oldest first
//! and its queue in order; a mode is its wire byte (`'S'` shared, `'X'`
//! exclusive). An image of the layout without them restores an engine
//! with no permit key, and writing one is only for an engine that has
//! none.
//!
//! The tags are the caller's ([`TagCodec`]); the engine's connection ids
//! are not written (they are local to a process), so the caller's tags
//! must let it name each waiter's connection at [`Engine::restore`].
//! Restoring is for replicated (cluster-mode) engines only: single mode
//! keeps no snapshot.

use std::fmt;

use super::{Acquire, AcquireOutcome, Caller, ConnId, Engine, Outbox, Places};
use crate::codec::ReadError;
use crate::limits::EngineLimits;
use crate::proto::Mode;
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
    /// Whether the image records the keys registered with a limit (a
    /// layout of the codec's choosing, as [`TagCodec::holders`]).
    fn permits(&self) -> bool {
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
    /// The keys registered with a limit of 2 or more, in the order
    /// written (strictly increasing); none in a layout without them.
    pub permits: Vec<PermitKeyImage<T>>,
}

/// One key registered with a limit of 2 or more (PROTOCOL §6) in an
/// [`Image`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PermitKeyImage<T> {
    /// The lock name.
    pub key: String,
    /// How many grants the key admits at once.
    pub limit: u16,
    /// Its grants, oldest (lowest token) first.
    pub grants: Vec<PermitImage<T>>,
    /// The queue, head first.
    pub waiters: Vec<WaiterImage<T>>,
}

/// One grant of a [`PermitKeyImage`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PermitImage<T> {
    /// The grant's token.
    pub token: u64,
    /// Who took the grant ([`Caller::holder`]; 0: unknown).
    pub holder: u64,
    /// Taken in exclusive mode.
    pub exclusive: bool,
    /// The grant's tag.
    pub tag: T,
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
    /// It asks for a shared place of a permit key; false for an
    /// exclusive one and for every waiter of a mutex.
    pub shared: bool,
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

/// A mode as the image writes it: its wire byte.
fn mode_byte(exclusive: bool) -> u8 {
    if exclusive {
        Mode::Exclusive.byte()
    } else {
        Mode::Shared.byte()
    }
}

/// Reads a mode byte: whether it is exclusive.
fn read_exclusive(r: &mut ImageReader<'_>) -> Result<bool, ImageError> {
    match Mode::from_byte(r.u8()?) {
        Some(mode) => Ok(mode == Mode::Exclusive),
        None => Err(ImageError::Invalid("mode")),
    }
}

/// The holder number that follows when the image has them (`holder_bytes`
/// is 8), else 0.
fn read_holder(r: &mut ImageReader<'_>, holder_bytes: usize) -> Result<u64, ImageError> {
    if holder_bytes == 0 {
        Ok(0)
    } else {
        Ok(r.u64()?)
    }
}

/// One grant to replay at [`Engine::restore`]: a mutex's (no places) or
/// a permit's.
struct GrantReplay<'i, T> {
    key: &'i str,
    token: u64,
    holder: u64,
    tag: T,
    places: Option<Places>,
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
            self.write_queue(key, codec, false, buf);
        }
        if codec.permits() {
            self.write_permits(codec, buf);
        } else {
            debug_assert!(
                self.permits.is_empty(),
                "permit keys in a layout without them"
            );
        }
    }

    /// Appends the queue of `key` (its count, then each waiter), each
    /// waiter with its mode byte when `modes`.
    fn write_queue(&self, key: &str, codec: &impl TagCodec<T>, modes: bool, buf: &mut Vec<u8>) {
        let holders = codec.holders();
        put_u32(buf, self.queue(key).count());
        for w in self.queue(key) {
            codec.write_waiter(w.tag, buf);
            if holders {
                buf.extend_from_slice(&w.holder.to_be_bytes());
            }
            buf.extend_from_slice(&w.owner.to_be_bytes());
            buf.push(w.wait_s);
            buf.push(w.lease_s);
            if modes {
                buf.push(mode_byte(!w.shared));
            }
        }
    }

    /// Appends the keys registered with a limit, sorted, each with its
    /// limit, its grants and its queue.
    fn write_permits(&self, codec: &impl TagCodec<T>, buf: &mut Vec<u8>) {
        let holders = codec.holders();
        let keys = self.sorted_permit_keys();
        put_u32(buf, keys.len());
        for key in keys {
            let set = self.permits.get(key).expect("a sorted key is registered");
            put_u32(buf, key.len());
            buf.extend_from_slice(key.as_bytes());
            buf.extend_from_slice(&set.limit.to_be_bytes());
            put_u32(buf, set.grants.len());
            for g in &set.grants {
                buf.extend_from_slice(&g.slot.token.to_be_bytes());
                if holders {
                    buf.extend_from_slice(&g.slot.holder.to_be_bytes());
                }
                buf.push(mode_byte(g.exclusive));
                codec.write_grant(&g.slot.tag, buf);
            }
            self.write_queue(key, codec, true, buf);
        }
    }

    /// Reads an image that [`Engine::write_image`] wrote, leaving `r` after
    /// it. Keys longer than `max_key_bytes` are refused.
    ///
    /// # Errors
    /// Truncated bytes, a bad key, keys out of order, a bad mode byte, or
    /// what `codec` refuses.
    pub fn read_image(
        r: &mut ImageReader<'_>,
        codec: &impl TagCodec<T>,
        max_key_bytes: usize,
    ) -> Result<Image<T>, ImageError> {
        let holder_bytes = if codec.holders() { 8 } else { 0 };
        let n = r.count(4 + 8 + holder_bytes + 4 + codec.min_grant_bytes())?;
        let mut keys: Vec<KeyImage<T>> = Vec::with_capacity(n);
        for _ in 0..n {
            let key = r.key(max_key_bytes)?.to_owned();
            if keys.last().is_some_and(|k| k.key >= key) {
                return Err(ImageError::Invalid("key order"));
            }
            let token = r.u64()?;
            let holder = read_holder(r, holder_bytes)?;
            let tag = codec.read_grant(r)?;
            let waiters = Self::read_queue(r, codec, false)?;
            keys.push(KeyImage {
                key,
                token,
                holder,
                tag,
                waiters,
            });
        }
        let permits = if codec.permits() {
            Self::read_permits(r, codec, max_key_bytes)?
        } else {
            Vec::new()
        };
        Ok(Image { keys, permits })
    }

    /// Reads a queue as [`Engine::write_queue`] wrote it.
    fn read_queue(
        r: &mut ImageReader<'_>,
        codec: &impl TagCodec<T>,
        modes: bool,
    ) -> Result<Vec<WaiterImage<T>>, ImageError> {
        let holder_bytes = if codec.holders() { 8 } else { 0 };
        let mode_bytes = usize::from(modes);
        let nw = r.count(holder_bytes + 8 + 2 + mode_bytes + codec.min_waiter_bytes())?;
        let mut waiters = Vec::with_capacity(nw);
        for _ in 0..nw {
            let tag = codec.read_waiter(r)?;
            let holder = read_holder(r, holder_bytes)?;
            let owner = r.u64()?;
            let wait_s = r.u8()?;
            let lease_s = r.u8()?;
            let shared = modes && !read_exclusive(r)?;
            waiters.push(WaiterImage {
                owner,
                wait_s,
                lease_s,
                holder,
                shared,
                tag,
            });
        }
        Ok(waiters)
    }

    /// Reads the keys registered with a limit as
    /// [`Engine::write_permits`] wrote them.
    fn read_permits(
        r: &mut ImageReader<'_>,
        codec: &impl TagCodec<T>,
        max_key_bytes: usize,
    ) -> Result<Vec<PermitKeyImage<T>>, ImageError> {
        let holder_bytes = if codec.holders() { 8 } else { 0 };
        let n = r.count(4 + 2 + 4 + 4)?;
        let mut keys: Vec<PermitKeyImage<T>> = Vec::with_capacity(n);
        for _ in 0..n {
            let key = r.key(max_key_bytes)?.to_owned();
            if keys.last().is_some_and(|k| k.key >= key) {
                return Err(ImageError::Invalid("key order"));
            }
            let limit = r.u16()?;
            let ng = r.count(8 + holder_bytes + 1 + codec.min_grant_bytes())?;
            let mut grants = Vec::with_capacity(ng);
            for _ in 0..ng {
                let token = r.u64()?;
                let holder = read_holder(r, holder_bytes)?;
                let exclusive = read_exclusive(r)?;
                let tag = codec.read_grant(r)?;
                grants.push(PermitImage {
                    token,
                    holder,
                    exclusive,
                    tag,
                });
            }
            let waiters = Self::read_queue(r, codec, true)?;
            keys.push(PermitKeyImage {
                key,
                limit,
                grants,
                waiters,
            });
        }
        Ok(keys)
    }

    /// A replicated engine holding exactly the table of `image`, whose next
    /// token is `next_token`; `conn_of` names the engine connection of each
    /// waiter from its tag. Grants (the mutexes' and the permits'
    /// together) are replayed in token order and then each queue in order,
    /// which reproduces the engine that wrote the image (waiter ids aside:
    /// they are local). Grants and waiters get their holders back, and
    /// permit waiters their modes.
    ///
    /// # Errors
    /// A token of 0 or not below `next_token`, a permit key of a limit
    /// below 2 or without grants, a waiter without a connection, waiters
    /// of one connection with different holders, or a table over `limits`.
    pub fn restore(
        limits: EngineLimits,
        next_token: u64,
        image: &Image<T>,
        mut conn_of: impl FnMut(&T) -> Option<ConnId>,
    ) -> Result<Self, ImageError> {
        let mut e = Self::replicated_tagged(limits, 1);
        let mut out = Outbox::default();
        for k in &image.permits {
            if k.limit < 2 || k.grants.is_empty() {
                return Err(ImageError::Invalid("permit key"));
            }
        }
        for g in Self::grants_by_token(image) {
            if g.token == 0 || g.token >= next_token {
                return Err(ImageError::Invalid("holder"));
            }
            e.raise_next_token(g.token);
            e.set_caller(Caller {
                holder: g.holder,
                admin: false,
            });
            let req = Acquire {
                key: g.key,
                owner: 0,
                wait_s: 0,
                lease_s: 1,
            };
            let got = match g.places {
                None => e.acquire_tagged(Millis::ZERO, HOLDER_CONN, req, g.tag, &mut out),
                Some(places) => {
                    e.acquire_with_limit(Millis::ZERO, HOLDER_CONN, req, places, g.tag, &mut out)
                }
            };
            if got != AcquireOutcome::Granted(g.token) {
                return Err(ImageError::Invalid("holder does not fit the limits"));
            }
        }
        let mutex_queues = image.keys.iter().map(|k| (&*k.key, None, &k.waiters));
        let permit_queues = image
            .permits
            .iter()
            .map(|k| (&*k.key, Some(k.limit), &k.waiters));
        for (key, limit, waiters) in mutex_queues.chain(permit_queues) {
            for w in waiters {
                let conn =
                    conn_of(&w.tag).ok_or(ImageError::Invalid("waiter without connection"))?;
                e.requeue(key, limit, w, conn, &mut out)?;
            }
        }
        e.set_caller(Caller::default());
        e.raise_next_token(next_token);
        Ok(e)
    }

    /// Every grant of `image`, the mutexes' and the permits', in token
    /// order.
    fn grants_by_token(image: &Image<T>) -> Vec<GrantReplay<'_, T>> {
        let mutexes = image.keys.iter().map(|k| GrantReplay {
            key: &k.key,
            token: k.token,
            holder: k.holder,
            tag: k.tag,
            places: None,
        });
        let permits = image.permits.iter().flat_map(|k| {
            k.grants.iter().map(move |g| GrantReplay {
                key: &k.key,
                token: g.token,
                holder: g.holder,
                tag: g.tag,
                places: Some(Places {
                    limit: k.limit,
                    mode: if g.exclusive {
                        Mode::Exclusive
                    } else {
                        Mode::Shared
                    },
                }),
            })
        });
        let mut all: Vec<GrantReplay<'_, T>> = mutexes.chain(permits).collect();
        all.sort_unstable_by_key(|g| g.token);
        all
    }

    /// Queues waiter `w` of `key` again on engine connection `conn`: as
    /// an acquire of a mutex, or with `limit` places in its mode.
    fn requeue(
        &mut self,
        key: &str,
        limit: Option<u16>,
        w: &WaiterImage<T>,
        conn: ConnId,
        out: &mut Outbox<T>,
    ) -> Result<(), ImageError> {
        let req = Acquire {
            key,
            owner: w.owner,
            wait_s: w.wait_s,
            lease_s: w.lease_s,
        };
        self.set_caller(Caller {
            holder: w.holder,
            admin: false,
        });
        let got = match limit {
            None => self.acquire_tagged(Millis::ZERO, conn, req, w.tag, out),
            Some(limit) => {
                let mode = if w.shared {
                    Mode::Shared
                } else {
                    Mode::Exclusive
                };
                let places = Places { limit, mode };
                self.acquire_with_limit(Millis::ZERO, conn, req, places, w.tag, out)
            }
        };
        match got {
            AcquireOutcome::Queued(_) if w.wait_s > 0 && w.lease_s > 0 => {}
            _ => return Err(ImageError::Invalid("waiter does not fit the limits")),
        }
        if self.conn_holder(conn) != Some(w.holder) {
            return Err(ImageError::Invalid("waiter holder"));
        }
        Ok(())
    }
}

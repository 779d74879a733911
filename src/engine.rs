//! The lock engine: keys, holders, FIFO wait queues, fencing tokens, capacity
//! limits and the deadline index (PROTOCOL §2). Sans-IO: it never touches a socket
//! and never reads a clock.
//!
//! Every operation takes `now` from its caller and appends the replies it
//! produces, addressed to connections, to an [`Outbox`]. Given the same calls
//! with the same arguments it produces the same replies in the same order.
//!
//! # Two time policies
//!
//! * [`Engine::new`] (single mode) is *clocked*: leases and waits are deadlines
//!   on the caller's timeline. An acquire takes over an expired key on the spot
//!   (ahead of any queue); [`Engine::tick`] hands an expired key to its head
//!   waiter, answers waits that ran out with Timeout, and sweeps expired keys
//!   without waiters every `sweep_interval_ms`.
//! * [`Engine::replicated`] (cluster mode) never looks at `now`: nothing
//!   expires by itself. Time enters only through the explicit, validated
//!   operations [`Engine::expire`] and [`Engine::wait_timeout`], which a leader
//!   proposes and every node applies; a stale one is a no-op.
//!
//! # Events and tags
//!
//! Besides the replies, the outbox records what happened as typed
//! [`Event`]s: a grant fresh, by takeover or by handover, a timeout, a
//! release, an extension, a lease that ran out. An [`Engine<T>`] carries a
//! tag of type `T` with every grant and queued acquire (`()` in single
//! mode, where it costs nothing): the caller gives it with
//! [`Engine::acquire_tagged`], the waiter's tag becomes its grant's, and
//! every event that answers an acquire reports it. Cluster mode tags each
//! with its request and builds its answers and timers from the events
//! alone. [`Engine::write_image`] and [`Engine::restore`] are the
//! engine's deterministic snapshot (module `image`).
//!
//! # Restart grace
//!
//! [`Engine::set_restart_grace`] (single mode, after a restart within the
//! leases of the earlier run) makes every key held by an unknown holder
//! until the given moment: a key first asked for during the grace is
//! registered with token 0 (never a client's; a release of token 0 is
//! always N) and that lease end, so the ordinary rules do the rest: T for
//! `wait = 0`, a FIFO queue handed over by the deadline index at the end,
//! N for releases. [`Engine::granted_until`] is the latest lease end of
//! every grant, which the service keeps durable for the next restart.
//!
//! # The deadline index
//!
//! `BTreeMap<(deadline, seq), key>` holds exactly one entry per key that has
//! waiters, at or before the earliest moment anything can happen to that key
//! (its lease running out or one of its waiters giving up). The queue records
//! its entry's `(timer_at, timer_seq)`, so moving the entry or dropping it
//! with the queue is a direct removal: the index never holds entries of keys
//! that moved on, whatever the request rate. An entry may be early (after a
//! takeover, a handover, a disconnect or a wait timeout it is kept rather
//! than moved): it then fires, finds nothing due, and is moved to the exact
//! moment. It is never late.
//! [`Engine::tick`] processes the keys that are due in key order, so the
//! replies and tokens of one tick depend only on the lock state.
//!
//! # Memory
//!
//! Measured by `make engine-memory` (`examples/engine_memory.rs`, a counting
//! global allocator plus the change of RSS; release build, x86-64, glibc):
//!
//! * **Held key: about 136 bytes with its own bytes** at 1,000,000 keys
//!   of 24 bytes: 119.5 measured (119.7 by RSS) before each grant recorded
//!   its holder, plus the holder's 8 bytes in each of the 2^21 buckets.
//!   A key is one hash-table entry: the key (a
//!   [`KeyStr`], 32 bytes: up to 30 bytes in place, a longer one boxed on
//!   the heap) and a 32-byte slot (token, holder, expiry, grant time for
//!   `--max-hold`), plus a control byte, in a table kept at most 7/8 full
//!   (at 1,000,000 keys it has just doubled to 2^21 buckets, the worst
//!   point). A key of up to 30 bytes has no other allocation; a longer one
//!   adds its boxed bytes and malloc's header. Boxing every key (16 bytes
//!   in the entry) cost 110 bytes by the allocator and 118 by RSS here, but
//!   one allocation per new key and a pointer to follow on every lookup;
//!   in place, a key longer than 30 bytes costs 16 bytes per bucket more
//!   (~34 per key at this point of the growth step).
//! * **Waiter: 49 bytes** at 1,000 keys x 1,000 waiters from 1,000
//!   connections: a waiter is 32 bytes in its key's `VecDeque` (the lease
//!   shares a word with the waiter id; the connection is a 4-byte index)
//!   plus a 16-byte entry in its connection's list of the keys it waits on
//!   (a shared copy of the queue's key), which lets a disconnect visit only
//!   that connection's queues. Both are vectors that double as they grow,
//!   so just past a power of two a waiter costs up to 32 bytes more. Each
//!   connection that has waiters adds an index entry, a table entry and its
//!   list (~95 bytes), so 1,000,000 waiters each on its own connection cost
//!   127 bytes each (the server caps connections, 10,000 by default). Each
//!   key with waiters adds a queue (a shared copy of the key, ~60 bytes) and
//!   its timer entries.
//! * **Hot path:** an uncontended acquire + release of a fresh key hashes
//!   the key twice (one table lookup each; the queue map is not hashed
//!   while no key has waiters), each time in one pass of a randomly keyed
//!   hash over its bytes (`hash`, internal: four AES rounds per 16 bytes
//!   where the CPU has AES, ~38 instructions for a 24-byte key; keyed
//!   SipHash-1-3 elsewhere, ~155, where the standard library's incremental
//!   hasher took ~230), and
//!   allocates only for a key longer than 30 bytes (the stored key); T, N,
//!   a tick with nothing due and a disconnect without waiters do not
//!   allocate; a reused [`Outbox`] stops allocating after warm-up
//!   (`tests/engine/alloc.rs`). The contended path allocates a
//!   queue when a key gets its first waiter (the shared key and the
//!   `VecDeque` buffer) and, now and then, a B-tree node for a timer; the
//!   list of a connection that gets its first waiter is reused from earlier
//!   ones once warm.
//!
//! # Quotas and the memory budget
//!
//! Every grant and waiter records its holder ([`Caller::holder`]); the
//! engine counts, by holder, the registered keys it took and the acquires
//! its connections queued (module `quota`: a map by holder number with the
//! last holder remembered, so that a run of requests from one identity
//! hashes nothing). A new key (or a takeover) beyond
//! `EngineLimits::max_keys_per_holder`, and an acquire that would queue
//! beyond `max_waiters_per_holder`, is answered Busy; holder 0 (unknown)
//! is never limited. A hand-over is never refused, so a holder may hold
//! its quota plus what its waiters are granted.
//!
//! The engine also keeps an estimate of its own bytes
//! ([`Engine::memory_bytes`]): 128 bytes per key plus the boxed
//! bytes of a key longer than 30 (from the figures above, at the worst
//! point of the table's growth it is short by ~16%), and per waiter, queue
//! and waiting connection their constants. A new key or waiter that would
//! take it past `EngineLimits::max_memory`, less what the service counts
//! outside the engine ([`Engine::set_outside_memory`]: single mode's
//! connection buffers), is answered Busy. The estimate is a function of
//! the table alone, so replicated engines on equal limits refuse alike.
//! The hot path pays one comparison for the budget and, per fresh grant and
//! release, one counter update of the holder.
//!
//! # Known caveats
//!
//! * The sweep visits every registered key every `sweep_interval_ms`
//!   (default 5 s) once some lease may have ended (a lower bound of all
//!   lease ends lets it skip a pass, and the loop sleep, while none can
//!   have), in steps of [`SWEEP_STEP_BUCKETS`] buckets per `tick`, so a
//!   large table is swept over many loop turns instead of stalling one.
//! * [`Engine::disconnect`] of a connection that has waiters is O(its
//!   waiters + the length of the queues they are in); without waiters it is
//!   O(1). `make engine-memory` times 10,000 disconnects of connections with
//!   one waiter each: ~12 ms when each waits on its own key, ~75 ms when
//!   they share 10 keys (1,000-long queues).
//! * [`Engine::wait_timeout`] is O(waiters of the key); a tick that processes
//!   a key is O(waiters of that key); a release or handover is O(1) unless a
//!   waiter's timer is overdue.
//! * An acquire that would queue counts waiters whose wait ran out but whose
//!   timer has not been processed yet against the queue limits (they leave
//!   at the next tick, release or expiry of their key).
//! * Expired keys are registered until swept or taken over, so they count
//!   against `max_keys`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

mod image;
mod quota;

pub use image::{Image, ImageError, ImageReader, KeyImage, TagCodec, WaiterImage};
pub use quota::{HolderUse, QuotaRefusals};

use crate::hash::{KeyStr, SipKey, StrEntry, StrMap};
use crate::limits::EngineLimits;
use crate::metrics::{GrantAges, Histogram, HOLD_BOUNDS_MS, WAIT_BOUNDS_MS};
use crate::proto::{
    encode_reply_parts, Reply, Request, OP_ACQUIRE, OP_BUSY, OP_EXTEND, OP_NOT_EXTENDED,
    OP_NOT_RELEASED, OP_RELEASE, OP_TIMEOUT,
};
use crate::time::Millis;
use crate::token::{self, TokenRng};

/// Identifies a client connection to the engine. The caller chooses them; in
/// the server they are never reused while the process lives.
pub type ConnId = u64;

/// Identifies one queued acquire, for [`Engine::wait_timeout`].
pub type WaiterId = u64;

/// Who sent a request, as far as grants are bound to their takers: the
/// identity of its connection (`crate::server::identity`) reduced to a
/// holder number, recorded with every grant it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Caller {
    /// The taker's holder number: never 0 for a known identity, odd when
    /// the identity is authenticated (a client certificate, a Unix uid),
    /// even when it is not (a source address). 0: unknown.
    pub holder: u64,
    /// The identity is `--admin-identity`: it may release and extend any
    /// grant whose token it gives.
    pub admin: bool,
}

impl Caller {
    /// Whether this caller may release or extend a grant taken by `grant`
    /// (given its token); see [`holder_may_act`].
    #[must_use]
    pub fn may_act_on(&self, grant: u64) -> bool {
        self.admin || holder_may_act(grant, self.holder)
    }
}

/// Whether a caller whose holder number is `caller` may release or extend
/// a grant taken by `grant` (given the token): always when they are the
/// same, and when neither is authenticated (the token alone decides, as in
/// protocol 1.0); never when one is authenticated and the other is someone
/// else. 0 is the holder of a grant whose taker is not known (a restart
/// grace, a cluster grant): the token alone decides.
#[must_use]
pub fn holder_may_act(grant: u64, caller: u64) -> bool {
    grant == caller || grant == 0 || (grant & 1 == 0 && caller & 1 == 0)
}

/// The arguments of one acquire (PROTOCOL §1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acquire<'a> {
    /// The lock name.
    pub key: &'a str,
    /// Correlation id echoed in the reply.
    pub owner: u64,
    /// Seconds the caller is willing to queue; 0 never queues.
    pub wait_s: u8,
    /// Seconds the grant lives.
    pub lease_s: u8,
}

/// What an acquire did at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireOutcome {
    /// Granted now with this fencing token (an `A` is in the outbox).
    Granted(u64),
    /// Queued; the reply comes later (`A` on grant, `T` when the wait runs out).
    Queued(WaiterId),
    /// Held and `wait = 0`: a `T` is in the outbox.
    Timeout,
    /// A capacity limit: a `B` is in the outbox.
    Busy,
}

/// How a grant came about (PROTOCOL §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grant {
    /// The key was not registered (or a service pushed the reply itself).
    Fresh,
    /// The key's lease had run out and an acquire took it over at once
    /// (single mode's lazy takeover, ahead of any queue).
    Takeover,
    /// The grant before it ended (release or expiry) and the head waiter
    /// got the key.
    Handover,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Acquired(Grant),
    Timeout,
    Busy,
    Released,
    NotReleased,
    Extended,
    NotExtended,
    /// A lease ran out (no reply: nobody is told). The key is
    /// `Outbox::expired_keys[frame_start..frame_end]`.
    Expired,
}

impl Kind {
    /// The reply's op byte; 0 for an event without a reply (never encoded).
    #[inline]
    fn op(self) -> u8 {
        match self {
            Kind::Acquired(_) => OP_ACQUIRE,
            Kind::Timeout => OP_TIMEOUT,
            Kind::Busy => OP_BUSY,
            Kind::Released => OP_RELEASE,
            Kind::NotReleased => OP_NOT_RELEASED,
            Kind::Extended => OP_EXTEND,
            Kind::NotExtended => OP_NOT_EXTENDED,
            Kind::Expired => 0,
        }
    }

    /// Bytes of the frame before the key: the op and one or two words.
    fn header_len(self) -> usize {
        match self {
            Kind::Acquired(_) => 17,
            Kind::Expired => 0,
            _ => 9,
        }
    }

    /// The reply's place in [`Outbox::tally`]; `None` for an event without
    /// a reply.
    fn tally_index(self) -> Option<usize> {
        Some(match self {
            Kind::Acquired(_) => 0,
            Kind::Timeout => 1,
            Kind::Busy => 2,
            Kind::Released => 3,
            Kind::NotReleased => 4,
            Kind::Extended => 5,
            Kind::NotExtended => 6,
            Kind::Expired => return None,
        })
    }
}

#[derive(Clone, Copy, Debug)]
struct OutMsg<T> {
    conn: ConnId,
    kind: Kind,
    lease_s: u8,
    token: u64,
    owner: u64,
    /// The encoded frame is `Outbox::frames[frame_start..frame_end]`.
    frame_start: usize,
    frame_end: usize,
    /// The tag of the request the event answers (see [`Engine`]).
    tag: T,
}

/// One reply addressed to a connection, as read back from an [`Outbox`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addressed<'a> {
    /// The connection the reply goes to.
    pub conn: ConnId,
    /// The reply.
    pub reply: Reply<'a>,
    /// For an `Acquired` or `Extended` reply, the lease of the grant in
    /// seconds (cluster leaders use it to schedule the Expire); 0 for every
    /// other reply.
    pub lease_s: u8,
}

/// What the engine did, as read back from an [`Outbox`] with
/// [`Outbox::events`]: every reply (with how a grant came about and the tag
/// of the request it answers) and every lease that ran out. Single mode
/// sends the replies' bytes; cluster mode builds its answers and timers
/// from these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event<'a, T> {
    /// `key` was granted to `owner` on `conn` with `token` for `lease_s`.
    Granted {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The new fencing token.
        token: u64,
        /// The acquire's owner.
        owner: u64,
        /// The lease, in seconds.
        lease_s: u8,
        /// Fresh, takeover or handover.
        how: Grant,
        /// The tag of the acquire granted.
        tag: T,
    },
    /// An acquire got Timeout: at once (`wait = 0`) or when its wait ran out.
    TimedOut {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The acquire's owner.
        owner: u64,
        /// The tag of the acquire.
        tag: T,
    },
    /// An acquire got Busy (a capacity limit).
    Busy {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The acquire's owner.
        owner: u64,
        /// The tag of the acquire.
        tag: T,
    },
    /// A release took effect.
    Released {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The grant released.
        token: u64,
    },
    /// A release did not take effect.
    NotReleased {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The token given.
        token: u64,
    },
    /// An extend took effect: the grant now lasts `lease_s` from the call.
    Extended {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The grant extended.
        token: u64,
        /// The new lease, in seconds.
        lease_s: u8,
    },
    /// An extend did not take effect.
    NotExtended {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The token given.
        token: u64,
    },
    /// The lease of grant `token` on `key` ran out (taken over, handed
    /// over, swept, or a committed `Expire`); no reply goes to its holder.
    Expired {
        /// The lock name.
        key: &'a str,
        /// The grant that ended.
        token: u64,
    },
}

/// Replies and events produced by the engine, in the order produced.
///
/// Each reply is encoded (`proto::encode_reply`) once, when it is pushed,
/// into one reusable buffer: the server copies the wire bytes of a run of
/// replies to one connection into its write buffer in one go
/// ([`Outbox::frames`]), and a long-lived outbox that is cleared after
/// each loop turn stops allocating once it has warmed up. [`Outbox::iter`]
/// reads the replies back as values, [`Outbox::events`] everything the
/// engine did, with the tag of each request answered (`T`, see [`Engine`]).
#[derive(Debug)]
pub struct Outbox<T = ()> {
    msgs: Vec<OutMsg<T>>,
    frames: Vec<u8>,
    /// The keys of [`Event::Expired`] events, which have no frame.
    expired_keys: Vec<u8>,
    /// The replies held, by [`Kind::tally_index`]: counted as they are
    /// pushed, so that neither [`Outbox::tally`] nor a turn without
    /// wrong-token answers walks the replies.
    counts: [u64; 7],
    /// Replies written straight into a connection's write buffer.
    direct: Direct,
}

/// No connection: [`Direct::conn`] while no write buffer is lent.
const NO_CONN: ConnId = ConnId::MAX;

/// The write buffer a server lends the outbox while it handles one
/// connection's requests ([`Outbox::begin_direct`]): replies to that
/// connection are encoded into it at once, with no message kept and no
/// second copy. What a turn may still take back is recorded beside it.
#[derive(Debug)]
struct Direct {
    /// The connection whose buffer `buf` is, or [`NO_CONN`].
    conn: ConnId,
    buf: Vec<u8>,
    /// Every buffer lent this turn: its connection and its length when lent
    /// (what [`Outbox::direct_lent`] cuts back to if the turn's replies
    /// must not leave).
    lent: Vec<(ConnId, usize)>,
    /// The grants and extensions (which `retain_leases` may withhold, while
    /// `mark_grants`) and the wrong-token answers (which the guess throttle
    /// counts) written into lent buffers this turn.
    marks: Vec<DirectMark>,
    /// Whether grants and extensions written into lent buffers are marked
    /// ([`Outbox::set_direct_grant_marks`]).
    mark_grants: bool,
    /// Byte ranges of lent buffers withheld by `retain_leases`:
    /// connection, start, end, in the order written.
    withdrawn: Vec<(ConnId, usize, usize)>,
}

/// One reply written into a lent buffer, at `buf[start..end]`.
#[derive(Clone, Copy, Debug)]
struct DirectMark {
    conn: ConnId,
    start: usize,
    end: usize,
    kind: Kind,
    lease_s: u8,
}

impl<T> Default for Outbox<T> {
    fn default() -> Self {
        Outbox {
            msgs: Vec::new(),
            frames: Vec::new(),
            expired_keys: Vec::new(),
            counts: [0; 7],
            direct: Direct {
                conn: NO_CONN,
                buf: Vec::new(),
                lent: Vec::new(),
                marks: Vec::new(),
                mark_grants: true,
                withdrawn: Vec::new(),
            },
        }
    }
}

impl Outbox {
    /// An empty outbox.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }
}

impl<T: Copy + Default> Outbox<T> {
    /// Number of replies and events held (not counting replies written
    /// into a lent write buffer, see [`Outbox::begin_direct`]).
    #[must_use]
    pub fn len(&self) -> usize {
        self.msgs.len()
    }

    /// True when no reply or event is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    /// Adds the replies held to `counts`, by kind: acquired, timeout,
    /// busy, released, not released, extended, not extended (for
    /// `GET /metrics`; counted at push, so no pass over the replies).
    pub fn tally(&self, counts: &mut [u64; 7]) {
        for (total, n) in counts.iter_mut().zip(self.counts) {
            *total += n;
        }
    }

    /// Forgets every reply and event, keeping the allocations (and what
    /// was recorded about lent buffers: a turn's end).
    pub fn clear(&mut self) {
        self.msgs.clear();
        self.frames.clear();
        self.expired_keys.clear();
        self.counts = [0; 7];
        debug_assert!(self.direct.conn == NO_CONN, "a write buffer is still lent");
        self.direct.lent.clear();
        self.direct.marks.clear();
        self.direct.withdrawn.clear();
    }

    /// Whether the grants and extensions written into lent write buffers
    /// ([`Outbox::begin_direct`]) are marked, so that
    /// [`Outbox::retain_leases`] can withhold them (on by default). A
    /// service that never withholds a grant turns it off: a grant then
    /// costs no mark (a pipelined turn at depth 64 writes some 1,600, more
    /// than the L1 cache holds). While it is off, [`Outbox::retain_leases`]
    /// after a buffer was lent (since the last [`Outbox::clear`]) panics
    /// rather than let a grant it cannot withhold go out.
    pub fn set_direct_grant_marks(&mut self, on: bool) {
        self.direct.mark_grants = on;
    }

    /// Whether replies to `conn` may be written straight into its write
    /// buffer now: not while the outbox holds a reply to it already, which
    /// must reach the buffer first (replies to one connection keep their
    /// order).
    #[must_use]
    pub fn may_lend(&self, conn: ConnId) -> bool {
        conn != NO_CONN
            && self.direct.conn == NO_CONN
            && !self
                .msgs
                .iter()
                .any(|m| m.conn == conn && m.kind != Kind::Expired)
    }

    /// Lends the outbox `conn`'s write buffer: until [`Outbox::end_direct`]
    /// gives it back, every reply to `conn` is encoded at its end at once
    /// (as [`Outbox::frames`] would have carried it), and is not read back
    /// by [`Outbox::iter`], [`Outbox::events`] or [`Outbox::frames`]. It is
    /// still counted by [`Outbox::tally`] and
    /// [`Outbox::wrong_token_answers`], and a grant or extension among
    /// them that [`Outbox::retain_leases`] refuses is listed by
    /// [`Outbox::direct_withdrawn`] for the caller to cut out. The caller
    /// has checked [`Outbox::may_lend`].
    pub fn begin_direct(&mut self, conn: ConnId, buf: Vec<u8>) {
        debug_assert!(self.may_lend(conn), "lent while replies to it are held");
        self.direct.lent.push((conn, buf.len()));
        self.direct.conn = conn;
        self.direct.buf = buf;
    }

    /// The lent buffer's length now (0 while none is lent).
    #[must_use]
    pub fn direct_len(&self) -> usize {
        self.direct.buf.len()
    }

    /// Gives the lent write buffer back, with the replies written into it.
    pub fn end_direct(&mut self) -> Vec<u8> {
        self.direct.conn = NO_CONN;
        std::mem::take(&mut self.direct.buf)
    }

    /// The buffers lent since the last [`Outbox::clear`], in order: each
    /// connection and the buffer's length when lent (cut back to it, the
    /// turn's direct replies are gone).
    #[must_use]
    pub fn direct_lent(&self) -> &[(ConnId, usize)] {
        &self.direct.lent
    }

    /// The byte ranges of lent buffers that [`Outbox::retain_leases`]
    /// withheld since the last [`Outbox::clear`], in the order written:
    /// connection, start, end. Cut out last first, each range is where it
    /// was written.
    #[must_use]
    pub fn direct_withdrawn(&self) -> &[(ConnId, usize, usize)] {
        &self.direct.withdrawn
    }

    /// The key of `m`, read back from the bytes its push wrote.
    fn key_of(&self, m: &OutMsg<T>) -> &str {
        let bytes = if m.kind == Kind::Expired {
            &self.expired_keys[m.frame_start..m.frame_end]
        } else {
            &self.frames[m.frame_start + m.kind.header_len()..m.frame_end - 1]
        };
        debug_assert!(std::str::from_utf8(bytes).is_ok(), "push encodes a str key");
        // SAFETY: `push_reply` and `push_expired` are the only writers of
        // `frames` and `expired_keys`, which only grow until `clear` (that
        // also empties `msgs`). Each copies a whole `&str` key: after a
        // header of `kind.header_len()` bytes and before one newline in
        // `frames` (as `encode_reply_parts` lays a frame out), alone in
        // `expired_keys`, and records where it starts and ends. So `bytes`
        // is exactly one key's bytes, valid UTF-8 (checked once already,
        // when the key became a `&str`).
        unsafe { std::str::from_utf8_unchecked(bytes) }
    }

    /// Everything the engine did, in order.
    pub fn events(&self) -> impl Iterator<Item = Event<'_, T>> + '_ {
        self.msgs.iter().map(move |m| {
            let key = self.key_of(m);
            let (conn, token, owner, tag) = (m.conn, m.token, m.owner, m.tag);
            match m.kind {
                Kind::Acquired(how) => Event::Granted {
                    conn,
                    key,
                    token,
                    owner,
                    lease_s: m.lease_s,
                    how,
                    tag,
                },
                Kind::Timeout => Event::TimedOut {
                    conn,
                    key,
                    owner,
                    tag,
                },
                Kind::Busy => Event::Busy {
                    conn,
                    key,
                    owner,
                    tag,
                },
                Kind::Released => Event::Released { conn, key, token },
                Kind::NotReleased => Event::NotReleased { conn, key, token },
                Kind::Extended => Event::Extended {
                    conn,
                    key,
                    token,
                    lease_s: m.lease_s,
                },
                Kind::NotExtended => Event::NotExtended { conn, key, token },
                Kind::Expired => Event::Expired { key, token },
            }
        })
    }

    /// The replies in the order they were produced.
    pub fn iter(&self) -> impl Iterator<Item = Addressed<'_>> + '_ {
        self.msgs
            .iter()
            .filter(|m| m.kind != Kind::Expired)
            .map(move |m| {
                let key = self.key_of(m);
                let reply = match m.kind {
                    Kind::Acquired(_) => Reply::Acquired {
                        token: m.token,
                        owner: m.owner,
                        key,
                    },
                    Kind::Timeout => Reply::Timeout {
                        owner: m.owner,
                        key,
                    },
                    Kind::Busy => Reply::Busy {
                        owner: m.owner,
                        key,
                    },
                    Kind::Released => Reply::Released {
                        token: m.token,
                        key,
                    },
                    Kind::NotReleased => Reply::NotReleased {
                        token: m.token,
                        key,
                    },
                    Kind::Extended => Reply::Extended {
                        token: m.token,
                        key,
                    },
                    Kind::NotExtended | Kind::Expired => Reply::NotExtended {
                        token: m.token,
                        key,
                    },
                };
                Addressed {
                    conn: m.conn,
                    reply,
                    lease_s: m.lease_s,
                }
            })
    }

    /// `N` and `X` answers in the outbox so far (token 0's included): a
    /// count that grows by one with each wrong-token answer pushed.
    #[must_use]
    pub fn wrong_token_count(&self) -> u64 {
        self.counts[Kind::NotReleased.tally_index().unwrap_or(4)]
            + self.counts[Kind::NotExtended.tally_index().unwrap_or(6)]
    }

    /// The connection of every `N` (not released) and `X` (not extended)
    /// reply that answered a guess (any token but 0: no grant has token 0),
    /// in order: what the server's guess throttle counts. Walks the replies
    /// only if there is an `N` or an `X`.
    pub fn wrong_token_answers(&self) -> impl Iterator<Item = ConnId> + '_ {
        let wrong = self.counts[Kind::NotReleased.tally_index().unwrap_or(4)]
            + self.counts[Kind::NotExtended.tally_index().unwrap_or(6)];
        let (msgs, marks) = if wrong == 0 {
            (&[][..], &[][..])
        } else {
            (&self.msgs[..], &self.direct.marks[..])
        };
        msgs.iter()
            .filter(|m| is_guess(m.kind, m.token))
            .map(|m| m.conn)
            .chain(
                // Only guesses are marked among the wrong-token answers.
                marks
                    .iter()
                    .filter(|m| matches!(m.kind, Kind::NotReleased | Kind::NotExtended))
                    .map(|m| m.conn),
            )
    }

    /// The replies' wire bytes, in order, as runs of consecutive replies to
    /// one connection: each item is a connection and the encoded frames of
    /// one run (as `proto::encode_reply` writes them), so that the server
    /// copies a pipelined connection's replies in one go.
    pub fn frames(&self) -> impl Iterator<Item = (ConnId, &[u8])> + '_ {
        let mut i = 0;
        std::iter::from_fn(move || {
            // Events without a reply have no bytes: skip them.
            while self.msgs.get(i)?.kind == Kind::Expired {
                i += 1;
            }
            let first = &self.msgs[i];
            let mut end = first.frame_end;
            i += 1;
            // A run stops at another connection, and at a reply that
            // `retain_leases` dropped (its bytes are skipped).
            while let Some(m) = self.msgs.get(i) {
                if m.kind == Kind::Expired {
                    i += 1;
                    continue;
                }
                if m.conn != first.conn || m.frame_start != end {
                    break;
                }
                end = m.frame_end;
                i += 1;
            }
            Some((first.conn, &self.frames[first.frame_start..end]))
        })
    }

    /// Drops every grant (`A`) and extension (`E`) whose lease `keep`
    /// refuses, keeping every other reply and event, in order; returns how
    /// many were dropped. Single mode withholds the grants of a turn whose
    /// durable lease bound could not be written: a client that never saw a
    /// grant never acts on it, and its lease ends by itself.
    pub fn retain_leases(&mut self, mut keep: impl FnMut(u8) -> bool) -> usize {
        assert!(
            self.direct.mark_grants || self.direct.lent.is_empty(),
            "retain_leases after a buffer was lent with its grants not marked"
        );
        let before = self.msgs.len() + self.direct.marks.len();
        let counts = &mut self.counts;
        self.msgs.retain(|m| {
            let kept = !matches!(m.kind, Kind::Acquired(_) | Kind::Extended) || keep(m.lease_s);
            if !kept {
                if let Some(i) = m.kind.tally_index() {
                    counts[i] -= 1;
                }
            }
            kept
        });
        let withdrawn = &mut self.direct.withdrawn;
        self.direct.marks.retain(|m| {
            let kept = !matches!(m.kind, Kind::Acquired(_) | Kind::Extended) || keep(m.lease_s);
            if !kept {
                if let Some(i) = m.kind.tally_index() {
                    counts[i] -= 1;
                }
                withdrawn.push((m.conn, m.start, m.end));
            }
            kept
        });
        before - self.msgs.len() - self.direct.marks.len()
    }

    /// Appends a reply addressed to `conn`. Used by the engine, and by
    /// services (cluster mode) that answer without it; a grant pushed here
    /// reads back as [`Grant::Fresh`] with the default tag.
    #[inline]
    pub fn push(&mut self, conn: ConnId, reply: Reply<'_>, lease_s: u8) {
        self.push_event(conn, reply, lease_s, Grant::Fresh, T::default());
    }

    /// Appends a reply with how a grant came about and its request's tag.
    #[cfg_attr(not(ticketd_profile), inline)]
    #[cfg_attr(ticketd_profile, inline(never))]
    fn push_event(&mut self, conn: ConnId, reply: Reply<'_>, lease_s: u8, how: Grant, tag: T) {
        let (kind, token, owner, key) = match reply {
            Reply::Acquired { token, owner, key } => (Kind::Acquired(how), token, owner, key),
            Reply::Timeout { owner, key } => (Kind::Timeout, 0, owner, key),
            Reply::Busy { owner, key } => (Kind::Busy, 0, owner, key),
            Reply::Released { token, key } => (Kind::Released, token, 0, key),
            Reply::NotReleased { token, key } => (Kind::NotReleased, token, 0, key),
            Reply::Extended { token, key } => (Kind::Extended, token, 0, key),
            Reply::NotExtended { token, key } => (Kind::NotExtended, token, 0, key),
        };
        self.push_reply(conn, kind, token, owner, key, lease_s, tag);
    }

    /// Appends a reply of `kind` (not [`Kind::Expired`]) from its parts:
    /// what [`Outbox::push_event`] does once it has taken the reply apart.
    /// The hot paths (a fresh grant, a release) call it with the kind known,
    /// so the reply is neither built nor matched.
    // Eight because it takes the frame's parts apart on purpose: packing
    // them into a `Reply` and matching it again is the cost it saves.
    // Always inlined: the kind is then known at each call site and the
    // frame's header, tally slot and mark test fold to constants (out of
    // line, the call and the run-time matches cost more than the copy).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn push_reply(
        &mut self,
        conn: ConnId,
        kind: Kind,
        token: u64,
        owner: u64,
        key: &str,
        lease_s: u8,
        tag: T,
    ) {
        debug_assert!(kind != Kind::Expired, "an expiry has no frame");
        if let Some(i) = kind.tally_index() {
            self.counts[i] += 1;
        }
        let (a, b) = match kind {
            Kind::Acquired(_) => (token, owner),
            Kind::Timeout | Kind::Busy => (owner, 0),
            _ => (token, 0),
        };
        if conn == self.direct.conn {
            let start = self.direct.buf.len();
            encode_reply_parts(kind.op(), a, b, key.as_bytes(), &mut self.direct.buf);
            // `kind` is known at each call site: an `R`, `T` or `B` folds
            // to no mark, an `N` or `X` to a mark, a grant or extension to
            // the one test of `mark_grants`.
            let grant = matches!(kind, Kind::Acquired(_) | Kind::Extended);
            let wrong_token = is_guess(kind, token);
            if wrong_token || (grant && self.direct.mark_grants) {
                self.direct.marks.push(DirectMark {
                    conn,
                    start,
                    end: self.direct.buf.len(),
                    kind,
                    lease_s,
                });
            }
            return;
        }
        let frame_start = self.frames.len();
        encode_reply_parts(kind.op(), a, b, key.as_bytes(), &mut self.frames);
        self.msgs.push(OutMsg {
            conn,
            kind,
            lease_s,
            token,
            owner,
            frame_start,
            frame_end: self.frames.len(),
            tag,
        });
    }

    /// Records that the lease of grant `token` on `key` ran out.
    fn push_expired(&mut self, key: &str, token: u64) {
        let frame_start = self.expired_keys.len();
        self.expired_keys.extend_from_slice(key.as_bytes());
        self.msgs.push(OutMsg {
            conn: 0,
            kind: Kind::Expired,
            lease_s: 0,
            token,
            owner: 0,
            frame_start,
            frame_end: self.expired_keys.len(),
            tag: T::default(),
        });
    }
}

/// Answers an acquire Busy (a limit, a quota or the memory budget). Cold
/// and out of line: refusals are rare, and one copy of the reply's
/// encoding keeps [`Engine::acquire_tagged`] small enough for the
/// compiler to inline what its hot path calls.
#[cold]
#[inline(never)]
fn busy<T: Copy + Default>(
    out: &mut Outbox<T>,
    conn: ConnId,
    owner: u64,
    key: &str,
    tag: T,
) -> AcquireOutcome {
    out.push_event(conn, Reply::Busy { owner, key }, 0, Grant::Fresh, tag);
    AcquireOutcome::Busy
}

/// Whether a reply answered a guess at a token: an `N` or an `X` for any
/// token but 0. No grant ever has token 0 (it names the unknown holder of
/// a restart grace), so a release or extend of token 0 is refused without
/// telling anyone anything, and a client may send one as a barrier (its
/// `N` proves that everything before it on the connection was processed)
/// without meeting the guess throttle.
#[inline(always)]
fn is_guess(kind: Kind, token: u64) -> bool {
    matches!(kind, Kind::NotReleased | Kind::NotExtended) && token != 0
}

/// Waiter ids fit in 48 bits; the low 16 bits of `Waiter::id_lease` hold the
/// wait and the lease, so a waiter is 32 bytes. 2^48 ids last nine years at
/// a million queued acquires a second; past that the counter wraps to 1 (a
/// waiter lives at most 255 s in single mode, so a wrapped id never meets a
/// live one there).
const WAITER_ID_LIMIT: u64 = 1 << 48;

/// One queued acquire: 32 bytes.
#[derive(Debug)]
struct Waiter<T = ()> {
    owner: u64,
    wait_deadline: Millis,
    /// `id << 16 | wait_s << 8 | lease_s`.
    id_lease: u64,
    /// Index of its connection in [`ConnTable::conns`].
    conn: u32,
    /// Index of its entry in that connection's [`ConnWaiters::slots`].
    slot: u32,
    /// The acquire's tag; the grant's once it is granted.
    tag: T,
}

impl<T> Waiter<T> {
    fn id(&self) -> WaiterId {
        self.id_lease >> 16
    }

    /// When it was queued (clocked mode): its wait deadline less its wait.
    fn queued_at(&self) -> Millis {
        let wait_s = (self.id_lease >> 8) & 0xFF;
        Millis(self.wait_deadline.0.saturating_sub(wait_s * 1000))
    }

    fn lease_s(&self) -> u8 {
        (self.id_lease & 0xFF) as u8
    }

    fn wait_s(&self) -> u8 {
        ((self.id_lease >> 8) & 0xFF) as u8
    }
}

/// No slot: the end of a free list in [`ConnWaiters::slots`].
const NO_SLOT: u32 = u32::MAX;

/// Waiter and connection indices are `u32`: queued acquires beyond this are
/// answered Busy whatever `max_waiters` says, so no index can overflow.
const WAITERS_CEILING: usize = (u32::MAX - 1) as usize;

/// Emptied slot lists kept for reuse, and the largest one kept: a connection
/// that queues now and then does not allocate once the engine is warm.
const SPARE_SLOT_LISTS: usize = 64;
const SPARE_SLOTS_MAX_LEN: usize = 64;

/// One entry of a connection's waiter list: 16 bytes.
#[derive(Debug)]
enum ConnSlot {
    /// A waiter of the connection is queued on this key (the queue's own
    /// shared copy of the key).
    Queued(Arc<str>),
    /// Vacant; the next vacant entry, or [`NO_SLOT`].
    Free(u32),
}

/// The waiters of one connection, so that a disconnect visits only the
/// queues it is in. Exists while the connection has waiters.
#[derive(Debug)]
struct ConnWaiters {
    id: ConnId,
    /// The connection's holder number ([`Caller::holder`]): its waiters'
    /// grants record it.
    holder: u64,
    /// The key of each of the connection's waiters, at the index that waiter
    /// records in [`Waiter::slot`]. Entries never move while in use.
    slots: Vec<ConnSlot>,
    /// Head of the free list in `slots`, or [`NO_SLOT`].
    free: u32,
    /// Waiters of this connection (the `Queued` entries of `slots`).
    count: u32,
}

/// The connections that have waiters. A waiter names its connection by its
/// index here (4 bytes, not the 8 of a [`ConnId`]), which keeps a waiter at
/// 32 bytes with its slot index beside it.
#[derive(Debug, Default)]
struct ConnTable {
    index: HashMap<ConnId, u32>,
    conns: slab::Slab<ConnWaiters>,
    spare: Vec<Vec<ConnSlot>>,
}

impl ConnTable {
    /// Records a waiter of `conn` on `key`: its connection index and slot.
    /// The caller keeps the number of waiters at most [`WAITERS_CEILING`], so
    /// neither index can reach [`NO_SLOT`].
    fn add(&mut self, conn: ConnId, holder: u64, key: Arc<str>) -> (u32, u32) {
        let idx = match self.index.get(&conn) {
            Some(&i) => i,
            None => {
                let slots = self.spare.pop().unwrap_or_else(|| Vec::with_capacity(1));
                let i = self.conns.insert(ConnWaiters {
                    id: conn,
                    holder,
                    slots,
                    free: NO_SLOT,
                    count: 0,
                });
                let i = u32::try_from(i).expect("connections with waiters < WAITERS_CEILING");
                self.index.insert(conn, i);
                i
            }
        };
        let cw = &mut self.conns[idx as usize];
        let slot = if cw.free == NO_SLOT {
            cw.slots.push(ConnSlot::Queued(key));
            u32::try_from(cw.slots.len() - 1).expect("waiters < WAITERS_CEILING")
        } else {
            let s = cw.free;
            let entry = std::mem::replace(&mut cw.slots[s as usize], ConnSlot::Queued(key));
            let ConnSlot::Free(next) = entry else {
                unreachable!("the free list holds only free entries")
            };
            cw.free = next;
            s
        };
        cw.count += 1;
        (idx, slot)
    }

    /// Forgets the waiter at (`idx`, `slot`) and returns its connection's id.
    /// The connection's entry goes when its last waiter does.
    fn remove(&mut self, idx: u32, slot: u32) -> ConnId {
        let cw = &mut self.conns[idx as usize];
        cw.slots[slot as usize] = ConnSlot::Free(cw.free);
        cw.free = slot;
        cw.count -= 1;
        let id = cw.id;
        if cw.count == 0 {
            let cw = self.conns.remove(idx as usize);
            self.index.remove(&id);
            self.recycle(cw.slots);
        }
        id
    }

    fn recycle(&mut self, mut slots: Vec<ConnSlot>) {
        if self.spare.len() < SPARE_SLOT_LISTS && slots.capacity() <= SPARE_SLOTS_MAX_LEN {
            slots.clear();
            self.spare.push(slots);
        }
    }
}

/// The wait queue of a key that has waiters. A key without waiters has none.
#[derive(Debug)]
struct Queue<T> {
    waiters: VecDeque<Waiter<T>>,
    /// Deadline of this key's entry in the deadline index, or NEVER while
    /// it has none (`tick` is processing it, or replicated mode). Never later
    /// than the first moment something is due for the key (its holder's
    /// expiry, a waiter's deadline); it may be earlier, and then the entry
    /// fires early and `tick` reschedules it.
    timer_at: Millis,
    /// Sequence number of that entry: with `timer_at`, its index key.
    timer_seq: u64,
}

/// [`take_token`] unless a grant now would exceed `ceiling` (what
/// [`Engine::tokens_exhausted`] tells): then `None`, and nothing changes.
/// The step is found once for the check and the token.
#[inline]
fn try_take_token(next_token: &mut u64, rng: Option<&mut TokenRng>, ceiling: u64) -> Option<u64> {
    let t = *next_token;
    let Some(rng) = rng else {
        if t >= ceiling {
            return None;
        }
        // `t < ceiling <= u64::MAX`: the next one exists.
        *next_token = t + 1;
        return Some(t);
    };
    // The highest token the step may carry must be below the ceiling.
    let step = token::step_at_or_above(t).filter(|s| s | token::RANDOM_MASK < ceiling)?;
    *next_token = step.saturating_add(token::STEP);
    Some(step | u64::from(rng.bits()))
}

/// Issues the next token and advances `next_token` past it: `next_token`
/// itself without `rng`, else the next sequence step at or above it with
/// fresh random low bits ([`crate::token`]). The caller has checked
/// [`Engine::tokens_exhausted`].
fn take_token(next_token: &mut u64, rng: Option<&mut TokenRng>) -> u64 {
    let t = *next_token;
    let Some(rng) = rng else {
        assert!(t < u64::MAX, "fencing tokens exhausted");
        *next_token = t + 1;
        return t;
    };
    let step = token::step_at_or_above(t).expect("fencing tokens exhausted");
    *next_token = step.saturating_add(token::STEP);
    step | u64::from(rng.bits())
}

/// A registered key: 32 bytes beside the key in the hash table.
#[derive(Debug)]
struct Slot<T = ()> {
    token: u64,
    /// Who took the grant ([`Caller::holder`]; 0: unknown).
    holder: u64,
    /// The first millisecond at which the lease is over (see `lease_end`).
    expires_at: Millis,
    /// When the grant began (single mode), for `max_hold_ms`; extensions
    /// keep it.
    granted_at: Millis,
    /// The tag of the request granted (see [`Engine`]).
    tag: T,
}

/// What the engine counts for `GET /metrics`: plain increments on the
/// paths that grant and end grants, nothing per key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineStats {
    /// Grants of a key nobody held.
    pub grants_fresh: u64,
    /// Grants of a key whose lease had run out (single mode's lazy takeover).
    pub grants_takeover: u64,
    /// Grants to the head waiter, on a release or an expiry.
    pub grants_handover: u64,
    /// Grants whose lease ran out (taken over, handed over, deleted).
    pub lease_expiries: u64,
    /// Request to grant, in ms (single mode; cluster mode leaves it empty,
    /// since its replicated engine has no clock).
    pub wait_ms: Histogram,
    /// Grant to release or expiry, in ms (single mode, as `wait_ms`).
    pub hold_ms: Histogram,
    /// Acquires refused for a holder's quota or the memory budget.
    pub quotas: QuotaRefusals,
}

impl Default for EngineStats {
    fn default() -> Self {
        EngineStats {
            grants_fresh: 0,
            grants_takeover: 0,
            grants_handover: 0,
            lease_expiries: 0,
            wait_ms: Histogram::new(WAIT_BOUNDS_MS),
            hold_ms: Histogram::new(HOLD_BOUNDS_MS),
            quotas: QuotaRefusals::default(),
        }
    }
}

/// One queued acquire, as [`Engine::queue`] shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Queued<'a, T> {
    /// Its id, for [`Engine::wait_timeout`].
    pub id: WaiterId,
    /// Its connection.
    pub conn: ConnId,
    /// Its owner.
    pub owner: u64,
    /// Its wait, in seconds.
    pub wait_s: u8,
    /// The lease it asks for, in seconds.
    pub lease_s: u8,
    /// Its connection's holder number ([`Caller::holder`]): its grant's.
    pub holder: u64,
    /// Its tag.
    pub tag: &'a T,
}

/// A registered key as `GET /v1/locks/KEY` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockInfo {
    /// The fencing token of the current grant (0: the unknown holder of a
    /// restart grace).
    pub token: u64,
    /// Milliseconds until the lease runs out, 0 once it has; `None` in
    /// cluster mode, whose replicated engine has no clock.
    pub expires_in_ms: Option<u64>,
    /// Queued acquires.
    pub waiters: usize,
    /// Milliseconds since the grant; `None` in cluster mode.
    pub held_for_ms: Option<u64>,
    /// Who took the grant ([`Caller::holder`]; 0: unknown).
    pub holder: u64,
}

/// What the admin port reads of a lock table, whatever its tags: an
/// [`Engine`] of any tag type behind one object type.
pub trait LockTable {
    /// See [`Engine::lock_info`].
    fn lock_info(&self, now: Millis, key: &str) -> Option<LockInfo>;
    /// See [`Engine::key_buckets`].
    fn key_buckets(&self) -> usize;
    /// See [`Engine::scan_keys`].
    fn scan_keys(&self, from: usize, to: usize, visit: &mut dyn FnMut(&str)) -> usize;
    /// See [`Engine::stats`].
    fn stats(&self) -> &EngineStats;
    /// See [`Engine::key_count`].
    fn key_count(&self) -> usize;
    /// See [`Engine::waiter_count`].
    fn waiter_count(&self) -> usize;
    /// See [`Engine::oldest_hold_ms`].
    fn oldest_hold_ms(&self, now: Millis) -> Option<u64>;
    /// See [`Engine::memory_bytes`].
    fn memory_bytes(&self) -> u64;
    /// See [`Engine::holder_use`].
    fn holder_use(&self, holder: u64) -> HolderUse;
}

impl<T: Copy + Default> LockTable for Engine<T> {
    fn lock_info(&self, now: Millis, key: &str) -> Option<LockInfo> {
        Engine::lock_info(self, now, key)
    }
    fn key_buckets(&self) -> usize {
        Engine::key_buckets(self)
    }
    fn scan_keys(&self, from: usize, to: usize, visit: &mut dyn FnMut(&str)) -> usize {
        Engine::scan_keys(self, from, to, visit)
    }
    fn stats(&self) -> &EngineStats {
        Engine::stats(self)
    }
    fn key_count(&self) -> usize {
        Engine::key_count(self)
    }
    fn oldest_hold_ms(&self, now: Millis) -> Option<u64> {
        Engine::oldest_hold_ms(self, now)
    }
    fn waiter_count(&self) -> usize {
        Engine::waiter_count(self)
    }
    fn memory_bytes(&self) -> u64 {
        Engine::memory_bytes(self)
    }
    fn holder_use(&self, holder: u64) -> HolderUse {
        Engine::holder_use(self, holder)
    }
}

/// The lock table. See the module documentation.
#[derive(Debug)]
pub struct Engine<T = ()> {
    limits: EngineLimits,
    clocked: bool,
    /// Hashed with a randomly keyed hash (`crate::hash`), since keys are chosen by
    /// network clients, in one pass per lookup (`crate::hash`); `entry`
    /// lets an acquire and an uncontended release hash the key once.
    keys: StrMap<KeyStr, Slot<T>>,
    /// Queues of the keys that have waiters. The key is shared with the
    /// deadline index, so scheduling a timer never allocates.
    queues: StrMap<Arc<str>, Queue<T>>,
    timers: BTreeMap<(Millis, u64), Arc<str>>,
    timer_seq: u64,
    next_token: u64,
    /// With a generator, every grant takes a fresh sequence step with
    /// random low bits ([`crate::token`]); without, tokens go up by one
    /// (cluster mode, where the state machine sets each entry's token).
    token_rng: Option<TokenRng>,
    /// Tokens at or above this are not issued (not yet durable).
    token_ceiling: u64,
    next_waiter: WaiterId,
    waiters_total: usize,
    /// Where each connection's waiters are queued.
    conn_table: ConnTable,
    next_sweep: Millis,
    /// No registered key's lease ends before this (a lower bound, lowered
    /// by every grant, recomputed by every sweep scan). Lets the sweep skip
    /// its scan, and the loop sleep, while no lease can have ended.
    expiry_floor: Millis,
    /// Reused by `tick` for the keys due in one call.
    due_scratch: Vec<Arc<str>>,
    /// Restart grace (single mode): before this, every key is held by an
    /// unknown holder of an earlier run whose lease ends here.
    grace_until: Millis,
    /// The latest lease end of every grant and extension so far (single
    /// mode): what the service's durable lease bound must cover. Raised by
    /// `note_lease_end`, which every grant and extension calls.
    granted_until: Millis,
    /// The longest lease an acquire or extend may ask for; longer is
    /// answered Busy (acquire) or NotExtended (extend).
    max_lease_s: u8,
    /// The sweep in progress, if any: it visits the key table's buckets in
    /// steps of [`SWEEP_STEP_BUCKETS`], one step per `tick`.
    sweep: Option<SweepPass>,
    stats: EngineStats,
    /// Clocked mode: the client grants (not a restart grace's token 0)
    /// counted by the second they began, for [`Engine::oldest_hold_ms`]
    /// without a scan and without memory per grant.
    holds: GrantAges,
    /// Who sent the request being handled ([`Engine::handle_as`]); the
    /// default (unknown) between requests.
    caller: Caller,
    /// Keys and waiters by holder, for the quotas per holder.
    holders: quota::Holders,
    /// Estimated bytes of the registered keys ([`quota::key_cost`]).
    key_bytes: u64,
    /// Estimated bytes of the queues' shared keys ([`quota::queue_cost`]).
    queue_bytes: u64,
    /// The memory budget left to the engine: `max_memory` less what the
    /// service counts outside it ([`Engine::set_outside_memory`]).
    mem_limit: u64,
}

/// Buckets of the key table one `tick` visits while a sweep is under way,
/// and the most keys it deletes: each step costs well under a millisecond
/// (`make engine-memory` prints the longest), so no loop turn stalls on
/// the sweep however large the table.
pub const SWEEP_STEP_BUCKETS: usize = 16 * 1024;
/// See [`SWEEP_STEP_BUCKETS`].
pub const SWEEP_STEP_DELETES: usize = 1024;

/// A sweep that has visited the key table's buckets below `cursor`.
#[derive(Debug, Clone, Copy)]
struct SweepPass {
    cursor: usize,
    /// A key was inserted while the pass ran: an insertion may grow or
    /// rehash the table, which reorders its buckets, so the pass may have
    /// missed keys and must not raise the floor.
    inserted: bool,
    /// The earliest lease end among the keys the pass kept, and among the
    /// grants and extensions made while it ran.
    floor: Millis,
}

impl Engine {
    /// A single-mode engine (clocked, lazy expiry). Tokens start at
    /// `first_token` (0 is taken as 1): the server passes a value above every
    /// token issued before a restart.
    #[must_use]
    pub fn new(limits: EngineLimits, first_token: u64) -> Self {
        Self::with_hash_key(limits, first_token, SipKey::random())
    }

    /// A single-mode engine like [`Engine::new`] whose tables hash keys
    /// under `hash_key` instead of a fresh random key, so that their order
    /// (which the stepped sweep follows) is the same in every process: for
    /// simulations and tests that reproduce a run from a seed. Never for a
    /// server that takes keys from the network: a client that knows the
    /// hash key can choose keys that all collide.
    #[must_use]
    pub fn with_hash_key(limits: EngineLimits, first_token: u64, hash_key: SipKey) -> Self {
        Self::build(limits, first_token, hash_key)
    }

    /// A cluster-mode engine: `now` arguments are ignored, nothing expires or
    /// times out except through [`Engine::expire`] and [`Engine::wait_timeout`].
    #[must_use]
    pub fn replicated(limits: EngineLimits, first_token: u64) -> Self {
        Self::replicated_tagged(limits, first_token)
    }
}

impl<T: Copy + Default> Engine<T> {
    /// A cluster-mode engine like [`Engine::replicated`] whose grants and
    /// waiters carry a tag of type `T` (see the module documentation).
    #[must_use]
    pub fn replicated_tagged(limits: EngineLimits, first_token: u64) -> Self {
        Engine {
            clocked: false,
            next_sweep: Millis::NEVER,
            ..Self::build(limits, first_token, SipKey::random())
        }
    }

    fn build(limits: EngineLimits, first_token: u64, hash_key: SipKey) -> Self {
        let next_sweep = Millis::ZERO.add_ms(limits.sweep_interval_ms);
        Engine {
            clocked: true,
            keys: StrMap::with_key(hash_key),
            queues: StrMap::with_key(hash_key),
            timers: BTreeMap::new(),
            timer_seq: 0,
            next_token: first_token.max(1),
            token_rng: None,
            token_ceiling: u64::MAX,
            next_waiter: 1,
            waiters_total: 0,
            conn_table: ConnTable::default(),
            next_sweep,
            expiry_floor: Millis::NEVER,
            due_scratch: Vec::new(),
            grace_until: Millis::ZERO,
            granted_until: Millis::ZERO,
            max_lease_s: u8::MAX,
            sweep: None,
            stats: EngineStats::default(),
            holds: GrantAges::default(),
            caller: Caller::default(),
            holders: quota::Holders::default(),
            key_bytes: 0,
            queue_bytes: 0,
            mem_limit: limits.max_memory,
            limits,
        }
    }

    /// The limits this engine enforces.
    #[must_use]
    pub fn limits(&self) -> &EngineLimits {
        &self.limits
    }

    /// What the engine counted since it started.
    #[must_use]
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Clocked mode: how long the longest-held current grant has been held
    /// at `now`, extensions included, to the second it began (so up to
    /// 1 s long); `None` when nothing is held, and in replicated mode. O(1). A grant whose lease ran out counts until a
    /// takeover, a hand-over or the sweep ends it (at most about one
    /// sweep interval later); a restart grace's unknown holders do not
    /// count.
    #[must_use]
    pub fn oldest_hold_ms(&self, now: Millis) -> Option<u64> {
        self.holds.oldest().map(|at| now.since(at))
    }

    /// `key` as the admin port shows it, or `None` when it is not
    /// registered. Two lookups; no allocation.
    #[must_use]
    pub fn lock_info(&self, now: Millis, key: &str) -> Option<LockInfo> {
        let slot = self.keys.get(key)?;
        let waiters = self.queues.get(key).map_or(0, |q| q.waiters.len());
        let clocked = self.clocked;
        Some(LockInfo {
            token: slot.token,
            expires_in_ms: clocked.then(|| slot.expires_at.since(now)),
            waiters,
            held_for_ms: clocked.then(|| now.since(slot.granted_at)),
            holder: slot.holder,
        })
    }

    /// Buckets of the key table: the range of [`Engine::scan_keys`]. It
    /// changes when the table grows, which reorders the keys.
    #[must_use]
    pub fn key_buckets(&self) -> usize {
        self.keys.num_buckets()
    }

    /// Calls `visit` with every registered key in buckets `from..to` of
    /// the key table and returns the first bucket not visited, so that a
    /// listing of a large table runs in steps over several loop turns.
    pub fn scan_keys(&self, from: usize, to: usize, mut visit: impl FnMut(&str)) -> usize {
        self.keys.visit_buckets(from, to, |k, _| visit(k))
    }

    /// Registered keys (held, or expired and not yet swept).
    #[must_use]
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// Queued acquires over all keys.
    #[must_use]
    pub fn waiter_count(&self) -> usize {
        self.waiters_total
    }

    /// The engine's estimate of the bytes its keys and waiters take (see
    /// "Quotas and the memory budget" in the module documentation).
    #[inline]
    #[must_use]
    pub fn memory_bytes(&self) -> u64 {
        self.key_bytes + self.waiter_bytes()
    }

    /// The waiters' part of [`Engine::memory_bytes`]: nothing while no
    /// key has waiters (then there is no queue and no waiting connection).
    #[inline]
    fn waiter_bytes(&self) -> u64 {
        if self.waiters_total == 0 {
            return 0;
        }
        self.waiters_total as u64 * quota::WAITER_BYTES
            + self.queue_bytes
            + self.conn_table.index.len() as u64 * quota::WAITING_CONN_BYTES
    }

    /// What holder `holder` ([`Caller::holder`]) has: keys it took and
    /// acquires it queued. Nothing for holder 0 (unknown), which is never
    /// limited nor shown.
    #[must_use]
    pub fn holder_use(&self, holder: u64) -> HolderUse {
        self.holders.get(holder)
    }

    /// Holders that have keys or waiters (holder 0 aside).
    #[must_use]
    pub fn holder_count(&self) -> usize {
        self.holders.len()
    }

    /// Tells the engine that `bytes` of the memory budget
    /// (`EngineLimits::max_memory`) are taken outside it (single mode: the
    /// connections' buffers): a new key or waiter is refused once the
    /// engine's own estimate would pass the rest. Cluster mode never calls
    /// it, so that every node refuses alike.
    pub fn set_outside_memory(&mut self, bytes: u64) {
        self.mem_limit = self.limits.max_memory.saturating_sub(bytes);
    }

    /// Counts a Busy answer for a holder's quota (`waiters`: its waiter
    /// quota, else its key quota).
    fn refused_for_quota(&mut self, holder: u64, waiters: bool) {
        let q = &mut self.stats.quotas;
        if waiters {
            q.waiters += 1;
        } else {
            q.keys += 1;
        }
        q.last_holder = holder;
    }

    /// The lowest token the next grant may carry (the token itself without
    /// a generator). Every token issued so far is lower.
    #[must_use]
    pub fn next_token(&self) -> u64 {
        self.next_token
    }

    /// Gives every later grant a fresh sequence step with random low bits
    /// from `rng` ([`crate::token`]); `None` goes back to tokens that go up
    /// by one.
    pub fn set_token_rng(&mut self, rng: Option<TokenRng>) {
        self.token_rng = rng;
    }

    /// Makes the next token at least `floor` (cluster mode: the index of the
    /// entry being applied). Never lowers it.
    pub fn raise_next_token(&mut self, floor: u64) {
        self.next_token = self.next_token.max(floor);
    }

    /// The token currently held on `key`, and whether its lease has run out
    /// at `now` (always false in replicated mode).
    #[must_use]
    pub fn holder(&self, now: Millis, key: &str) -> Option<(u64, bool)> {
        self.keys
            .get(key)
            .map(|s| (s.token, self.is_expired(s, now)))
    }

    /// The owners queued on `key`, head first.
    #[must_use]
    pub fn queued_owners(&self, key: &str) -> Vec<u64> {
        self.queues
            .get(key)
            .map(|q| q.waiters.iter().map(|w| w.owner).collect())
            .unwrap_or_default()
    }

    /// The grant on `key`: its token and the tag of the request granted.
    #[must_use]
    pub fn grant(&self, key: &str) -> Option<(u64, &T)> {
        self.keys.get(key).map(|s| (s.token, &s.tag))
    }

    /// The tag of the grant on `key`, to change (cluster mode records a
    /// lease generation in it when an extend takes effect).
    pub fn grant_tag_mut(&mut self, key: &str) -> Option<&mut T> {
        self.keys.get_mut(key).map(|s| &mut s.tag)
    }

    /// The acquires queued on `key`, head first.
    pub fn queue(&self, key: &str) -> impl Iterator<Item = Queued<'_, T>> + '_ {
        let conns = &self.conn_table.conns;
        self.queues
            .get(key)
            .into_iter()
            .flat_map(|q| q.waiters.iter())
            .map(move |w| Queued {
                id: w.id(),
                conn: conns[w.conn as usize].id,
                holder: conns[w.conn as usize].holder,
                owner: w.owner,
                wait_s: w.wait_s(),
                lease_s: w.lease_s(),
                tag: &w.tag,
            })
    }

    /// The first waiter on `key` whose tag satisfies `pred`.
    pub fn find_waiter(&self, key: &str, mut pred: impl FnMut(&T) -> bool) -> Option<WaiterId> {
        self.queues
            .get(key)?
            .waiters
            .iter()
            .find(|w| pred(&w.tag))
            .map(Waiter::id)
    }

    /// True while `conn` has a queued acquire.
    #[must_use]
    pub fn has_waiters(&self, conn: ConnId) -> bool {
        self.conn_table.index.contains_key(&conn)
    }

    /// Connections that have queued acquires.
    #[must_use]
    pub fn waiting_conn_count(&self) -> usize {
        self.conn_table.index.len()
    }

    /// Every registered key, sorted: a deterministic order, whatever the
    /// hash key. O(keys log keys).
    #[must_use]
    pub fn sorted_keys(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.keys.iter().map(|(k, _)| k.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// Every key that has waiters, sorted. O(such keys log such keys).
    #[must_use]
    pub fn sorted_queued_keys(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.queues.iter().map(|(k, _)| &**k).collect();
        v.sort_unstable();
        v
    }

    /// Tokens at or above `ceiling` will not be issued. The server sets it to
    /// one above its durable high-water mark, so no token reaches a client
    /// before a restart is sure to resume above it. While no token can be
    /// issued, an acquire that would be granted is answered Busy, and a key
    /// whose grant ends is deleted with its waiters answered Timeout.
    pub fn set_token_ceiling(&mut self, ceiling: u64) {
        self.token_ceiling = ceiling;
    }

    /// Restart grace (single mode): until `until`, every key is treated as
    /// held by an unknown holder whose lease ends at `until`. An acquire
    /// with `wait = 0` gets Timeout, one with `wait > 0` queues FIFO and is
    /// granted at `until` (or gets Timeout when its wait runs out first), a
    /// release gets NotReleased, an extend NotExtended. The unknown holder
    /// of a key is registered
    /// (token 0, which no client ever holds) when the key is first asked
    /// for; a key nobody asks for stays unregistered. Does nothing in
    /// replicated mode.
    pub fn set_restart_grace(&mut self, until: Millis) {
        if self.clocked {
            self.grace_until = until;
        }
    }

    /// The end of the restart grace, while it is in force at `now`.
    #[must_use]
    pub fn restart_grace(&self, now: Millis) -> Option<Millis> {
        (self.grace_until > now).then_some(self.grace_until)
    }

    /// The latest lease end of every grant made so far (single mode): no
    /// lease this engine granted runs past it.
    #[must_use]
    pub fn granted_until(&self) -> Millis {
        self.granted_until
    }

    /// The latest moment at which a lease may still run, as seen at `now`:
    /// of the registered keys and of the restart grace. `None` when no
    /// lease can run past `now` (nothing is outstanding). O(keys).
    #[must_use]
    pub fn outstanding_until(&self, now: Millis) -> Option<Millis> {
        let keys = self.keys.iter().map(|(_, s)| s.expires_at).max();
        let latest = keys.unwrap_or(Millis::ZERO).max(self.grace_until);
        (self.clocked && latest > now).then_some(latest)
    }

    /// The longest lease an acquire or extend may ask for (`--max-lease`):
    /// an acquire asking for more is answered Busy and an extend
    /// NotExtended (the protocol cannot carry a shorter lease back). 255,
    /// the protocol's own maximum, by default.
    pub fn set_max_lease(&mut self, max_lease_s: u8) {
        self.max_lease_s = max_lease_s.max(1);
    }

    /// See [`Engine::set_max_lease`].
    #[must_use]
    pub fn max_lease_s(&self) -> u8 {
        self.max_lease_s
    }

    /// True when a grant now would exceed the token ceiling.
    #[must_use]
    pub fn tokens_exhausted(&self) -> bool {
        if self.token_rng.is_none() {
            return self.next_token >= self.token_ceiling;
        }
        // The highest token the next step may carry must be below the ceiling.
        token::step_at_or_above(self.next_token)
            .is_none_or(|step| step | token::RANDOM_MASK >= self.token_ceiling)
    }

    fn is_expired(&self, slot: &Slot<T>, now: Millis) -> bool {
        self.clocked && slot.expires_at <= now
    }

    fn issue_token(&mut self) -> u64 {
        take_token(&mut self.next_token, self.token_rng.as_mut())
    }

    fn deadline(&self, now: Millis, secs: u8) -> Millis {
        if self.clocked {
            now.add_secs(u64::from(secs))
        } else {
            Millis::NEVER
        }
    }

    /// The first millisecond at which a lease granted at `now` is over: one
    /// past `now + lease`. The caller's clock is read in whole milliseconds
    /// (truncated), so `now` may be up to 1 ms earlier than the moment the
    /// client wrote its request; ending the lease only once `now + lease` is
    /// *past* (PROTOCOL §2.4: "a key past its expiry") keeps the server's lease
    /// from ending before the client's conservative expiry (PROTOCOL §3).
    fn lease_end(&self, now: Millis, lease_s: u8) -> Millis {
        self.deadline(now, lease_s).add_ms(1)
    }

    /// [`Engine::handle`] for `caller`: a grant it takes records its
    /// holder number, and a release or extend of a grant it may not act on
    /// ([`Caller::may_act_on`]) is answered `N` or `X` whatever the token.
    #[inline(always)]
    pub fn handle_as(
        &mut self,
        now: Millis,
        conn: ConnId,
        caller: Caller,
        req: Request<'_>,
        out: &mut Outbox<T>,
    ) {
        self.caller = caller;
        self.handle(now, conn, req, out);
        self.caller = Caller::default();
    }

    /// Sets who sends the calls that follow, until it is set again:
    /// [`Engine::handle_as`] for the other entry points
    /// ([`Engine::acquire_tagged`], [`Engine::release`], [`Engine::extend`]).
    /// Cluster mode sets it around each replicated command and sets the
    /// default (unknown) back after it.
    pub fn set_caller(&mut self, caller: Caller) {
        self.caller = caller;
    }

    /// The holder number ([`Caller::holder`]) of the grant on `key`.
    #[must_use]
    pub fn grant_holder(&self, key: &str) -> Option<u64> {
        self.keys.get(key).map(|s| s.holder)
    }

    /// Handles one decoded request: [`Engine::acquire`] or [`Engine::release`].
    #[inline(always)]
    pub fn handle(&mut self, now: Millis, conn: ConnId, req: Request<'_>, out: &mut Outbox<T>) {
        match req {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            } => {
                self.acquire(
                    now,
                    conn,
                    Acquire {
                        key,
                        owner,
                        wait_s,
                        lease_s,
                    },
                    out,
                );
            }
            Request::Release { token, key } => {
                self.release(now, conn, token, key, out);
            }
            Request::Extend {
                lease_s,
                token,
                key,
            } => {
                self.extend(now, conn, key, token, lease_s, out);
            }
        }
    }

    /// Records that some lease now ends at `at`, for the sweep's floor.
    fn note_lease_end(&mut self, at: Millis) {
        self.expiry_floor = self.expiry_floor.min(at);
        if self.clocked {
            self.granted_until = self.granted_until.max(at);
        }
        if let Some(pass) = &mut self.sweep {
            pass.floor = pass.floor.min(at);
        }
    }

    /// PROTOCOL §5.2: extends the grant of `key` whose token is `token` to end
    /// `lease_s` seconds from `now` (possibly earlier than before). Returns
    /// true and answers `E` when it took effect; answers `X` when the key is
    /// not registered, holds another token, its lease already ended (single
    /// mode: an ended lease is never revived), or the extension would carry
    /// the grant past `max_hold_ms` from its start. The token and the
    /// waiters' places do not change. `lease_s = 0` (rejected by the codec)
    /// is treated as 1.
    pub fn extend(
        &mut self,
        now: Millis,
        conn: ConnId,
        key: &str,
        token: u64,
        lease_s: u8,
        out: &mut Outbox<T>,
    ) -> bool {
        let lease_s = lease_s.max(1);
        let expires_at = self.lease_end(now, lease_s);
        let clocked = self.clocked;
        let max_hold_ms = self.limits.max_hold_ms;
        // Token 0 is the unknown holder of a restart grace, never a
        // client's; a lease above `--max-lease` is refused as for acquire.
        let allowed = token != 0 && lease_s <= self.max_lease_s;
        let caller = self.caller;
        let extended = match self.keys.get_mut(key) {
            Some(slot)
                if allowed
                    && slot.token == token
                    && caller.may_act_on(slot.holder)
                    && !(clocked && slot.expires_at <= now) =>
            {
                let capped = clocked
                    && max_hold_ms > 0
                    && slot.granted_at.add_ms(max_hold_ms) < now.add_secs(u64::from(lease_s));
                if !capped {
                    slot.expires_at = expires_at;
                }
                !capped
            }
            _ => false,
        };
        if !extended {
            out.push(conn, Reply::NotExtended { token, key }, 0);
            return false;
        }
        self.note_lease_end(expires_at);
        // A shorter lease may now end before the key's timer: move the timer
        // up, so it is never late. A longer one leaves it early, which is
        // allowed. Either way the key keeps exactly one index entry.
        if let Some(q) = self.queues.get(key) {
            if clocked && expires_at < q.timer_at {
                self.set_timer(key, expires_at);
            }
        }
        out.push(conn, Reply::Extended { token, key }, lease_s);
        true
    }

    /// PROTOCOL §2.1. `lease_s = 0` (rejected by the codec) is treated as 1.
    /// The grant or the queued acquire carries the default tag.
    #[inline]
    pub fn acquire(
        &mut self,
        now: Millis,
        conn: ConnId,
        req: Acquire<'_>,
        out: &mut Outbox<T>,
    ) -> AcquireOutcome {
        self.acquire_tagged(now, conn, req, T::default(), out)
    }

    /// [`Engine::acquire`] with the request's `tag`: the grant carries it
    /// ([`Engine::grant`]), and so does the waiter until it is granted;
    /// every event that answers this acquire reports it.
    // Long because it is the per-request acquire, kept in one piece for
    // speed: one hash of the key and one entry decide among a fresh grant,
    // a takeover, a busy or timeout answer and a queued waiter; split, each
    // step would hash the key again or carry the entry and half the tables.
    #[cfg_attr(ticketd_profile, inline(never))]
    pub fn acquire_tagged(
        &mut self,
        now: Millis,
        conn: ConnId,
        req: Acquire<'_>,
        tag: T,
        out: &mut Outbox<T>,
    ) -> AcquireOutcome {
        let Acquire {
            key,
            owner,
            wait_s,
            lease_s,
        } = req;
        let lease_s = lease_s.max(1);
        if lease_s > self.max_lease_s {
            return busy(out, conn, owner, key, tag);
        }
        let expires_at = self.lease_end(now, lease_s);
        let full = self.keys.len() >= self.limits.max_keys;
        let in_grace = self.clocked && now < self.grace_until;
        let mem_room = self.mem_limit.saturating_sub(self.memory_bytes());
        let key_cost = quota::key_cost(key.len());
        let holder = self.caller.holder;
        let key_quota = self.limits.max_keys_per_holder;
        // One hash of the key for the whole decision (the entry borrows
        // only the `keys` field, so the token is issued by field).
        let slot = match self.keys.entry(key) {
            StrEntry::Vacant(_) if full || key_cost > mem_room => {
                self.stats.quotas.memory += u64::from(!full);
                return busy(out, conn, owner, key, tag);
            }
            StrEntry::Vacant(v) if in_grace => {
                // Restart grace: the key's holder is unknown; its lease
                // ends with the grace. Token 0 is never a client's.
                let grace_until = self.grace_until;
                self.key_bytes += key_cost;
                self.holders.add_key(0);
                self.expiry_floor = self.expiry_floor.min(grace_until);
                if let Some(pass) = &mut self.sweep {
                    pass.inserted = true;
                    pass.floor = pass.floor.min(grace_until);
                }
                v.insert(
                    KeyStr::new(key),
                    Slot {
                        token: 0,
                        holder: 0,
                        expires_at: grace_until,
                        granted_at: now,
                        tag: T::default(),
                    },
                )
            }
            StrEntry::Vacant(v) => {
                if !self.holders.try_add_key(holder, key_quota) {
                    self.refused_for_quota(holder, false);
                    return busy(out, conn, owner, key, tag);
                }
                let Some(token) = try_take_token(
                    &mut self.next_token,
                    self.token_rng.as_mut(),
                    self.token_ceiling,
                ) else {
                    self.holders.remove_key(holder);
                    return busy(out, conn, owner, key, tag);
                };
                v.insert(
                    KeyStr::new(key),
                    Slot {
                        token,
                        holder,
                        expires_at,
                        granted_at: now,
                        tag,
                    },
                );
                self.key_bytes += key_cost;
                if let Some(pass) = &mut self.sweep {
                    pass.inserted = true;
                }
                self.note_lease_end(expires_at);
                self.stats.grants_fresh += 1;
                if self.clocked {
                    self.stats.wait_ms.observe(0);
                    self.holds.start(now);
                }
                out.push_reply(
                    conn,
                    Kind::Acquired(Grant::Fresh),
                    token,
                    owner,
                    key,
                    lease_s,
                    tag,
                );
                return AcquireOutcome::Granted(token);
            }
            StrEntry::Occupied(o) => o.into_mut(),
        };
        let holder_expiry = slot.expires_at;
        if self.clocked && slot.expires_at <= now {
            if holder != slot.holder && holder != 0 && self.holders.get(holder).keys >= key_quota {
                self.refused_for_quota(holder, false);
                return busy(out, conn, owner, key, tag);
            }
            let Some(token) = try_take_token(
                &mut self.next_token,
                self.token_rng.as_mut(),
                self.token_ceiling,
            ) else {
                return busy(out, conn, owner, key, tag);
            };
            // Lazy takeover: the non-FIFO expiry path, ahead of any queue.
            // The key's timer (if it has waiters) is at or before the old
            // expiry, so it is early now, never late.
            if slot.token != 0 {
                out.push_expired(key, slot.token);
                self.stats.lease_expiries += 1;
                self.stats
                    .hold_ms
                    .observe(slot.expires_at.since(slot.granted_at));
                self.holds.end(slot.granted_at);
            }
            self.holders.move_key(slot.holder, holder);
            slot.token = token;
            slot.holder = holder;
            slot.expires_at = expires_at;
            slot.granted_at = now;
            slot.tag = tag;
            self.holds.start(now);
            self.note_lease_end(expires_at);
            self.stats.grants_takeover += 1;
            self.stats.wait_ms.observe(0);
            out.push_event(
                conn,
                Reply::Acquired { token, owner, key },
                lease_s,
                Grant::Takeover,
                tag,
            );
            return AcquireOutcome::Granted(token);
        }
        if wait_s == 0 {
            out.push_event(conn, Reply::Timeout { owner, key }, 0, Grant::Fresh, tag);
            return AcquireOutcome::Timeout;
        }
        let queued = self.queues.get(key).map_or(0, |q| q.waiters.len());
        if queued >= self.limits.max_waiters_per_key
            || self.waiters_total >= self.limits.max_waiters
            || self.waiters_total >= WAITERS_CEILING
        {
            return busy(out, conn, owner, key, tag);
        }
        if self.waiter_refused(holder, queued == 0, key.len(), mem_room) {
            return busy(out, conn, owner, key, tag);
        }
        let id = self.next_waiter;
        self.next_waiter = if id + 1 >= WAITER_ID_LIMIT { 1 } else { id + 1 };
        let wait_deadline = self.deadline(now, wait_s);
        if !self.queues.contains_key(key) {
            self.queue_bytes += quota::queue_cost(key.len());
            self.queues.insert_new(
                Arc::from(key),
                Queue {
                    waiters: VecDeque::new(),
                    timer_at: Millis::NEVER,
                    timer_seq: 0,
                },
            );
        }
        let (name, _) = self
            .queues
            .get_key_value(key)
            .expect("queue inserted above");
        let (conn_idx, slot) = self.conn_table.add(conn, holder, Arc::clone(name));
        self.holders
            .add_waiter(self.conn_table.conns[conn_idx as usize].holder);
        let waiter = Waiter {
            owner,
            wait_deadline,
            id_lease: id << 16 | u64::from(wait_s) << 8 | u64::from(lease_s),
            conn: conn_idx,
            slot,
            tag,
        };
        let queue = self.queues.get_mut(key).expect("queue inserted above");
        queue.waiters.push_back(waiter);
        let due = wait_deadline.min(holder_expiry);
        if due < queue.timer_at {
            self.set_timer(key, due);
        }
        self.waiters_total += 1;
        AcquireOutcome::Queued(id)
    }

    /// Whether an acquire of `holder` that would queue on a key named
    /// `key_len` bytes long (its first waiter: `new_queue`) is refused for
    /// the holder's waiter quota or the memory budget (`mem_room` bytes
    /// left); counted if so.
    fn waiter_refused(&mut self, holder: u64, new_queue: bool, key_len: usize, room: u64) -> bool {
        if holder != 0 && self.holders.get(holder).waiters >= self.limits.max_waiters_per_holder {
            self.refused_for_quota(holder, true);
            return true;
        }
        let queue = if new_queue {
            quota::queue_cost(key_len)
        } else {
            0
        };
        if quota::WAITER_BYTES + queue > room {
            self.stats.quotas.memory += 1;
            return true;
        }
        false
    }

    /// Moves the timer entry of `key`'s queue to `at` (NEVER: removes it).
    /// The entry shares the queue's copy of the key.
    fn set_timer(&mut self, key: &str, at: Millis) {
        let Some((name, q)) = self.queues.get_key_value(key) else {
            return;
        };
        let old = (q.timer_at, q.timer_seq);
        let name = Arc::clone(name);
        if old.0 != Millis::NEVER {
            self.timers.remove(&old);
        }
        let mut seq = 0;
        if at != Millis::NEVER {
            self.timer_seq += 1;
            seq = self.timer_seq;
            self.timers.insert((at, seq), name);
        }
        if let Some(q) = self.queues.get_mut(key) {
            q.timer_at = at;
            q.timer_seq = seq;
        }
    }

    /// Drops `key`'s queue and its timer entry.
    fn drop_queue(&mut self, key: &str) {
        if let Some(q) = self.queues.remove(key) {
            self.queue_bytes -= quota::queue_cost(key.len());
            if q.timer_at != Millis::NEVER {
                self.timers.remove(&(q.timer_at, q.timer_seq));
            }
        }
    }

    /// PROTOCOL §2.2. Returns true when the release took effect (`R`).
    #[cfg_attr(ticketd_profile, inline(never))]
    pub fn release(
        &mut self,
        now: Millis,
        conn: ConnId,
        token: u64,
        key: &str,
        out: &mut Outbox<T>,
    ) -> bool {
        // No client holds token 0: it marks the unknown holder of a key
        // during a restart grace.
        if token == 0 {
            out.push(conn, Reply::NotReleased { token, key }, 0);
            return false;
        }
        if let Some(o) = self.keys.find_entry(key) {
            // The common case, a key nobody waits for, costs one hash of
            // the key (none for the queue map while no key has waiters).
            let slot = o.get();
            if slot.token == token
                && self.caller.may_act_on(slot.holder)
                && !self.queues.contains_key(key)
            {
                let (_, slot) = o.remove();
                self.forget_key(key, slot.holder);
                if self.clocked {
                    self.stats.hold_ms.observe(now.since(slot.granted_at));
                    self.holds.end(slot.granted_at);
                }
                out.push_reply(conn, Kind::Released, token, 0, key, 0, T::default());
                return true;
            }
        }
        match self.keys.get(key) {
            Some(slot) if slot.token == token && self.caller.may_act_on(slot.holder) => {
                if self.clocked {
                    self.stats.hold_ms.observe(now.since(slot.granted_at));
                    self.holds.end(slot.granted_at);
                }
                out.push(conn, Reply::Released { token, key }, 0);
                self.hand_over_or_delete(now, key, out);
                true
            }
            _ => {
                out.push(conn, Reply::NotReleased { token, key }, 0);
                false
            }
        }
    }

    /// Ends the current grant of `key` if its token is `token`: the head
    /// waiter gets the key, or the key is deleted. This is the committed
    /// `Expire{key, token}` of cluster mode; a stale one (the token moved on,
    /// or the key is gone) does nothing and returns false. No reply goes to
    /// the old holder.
    pub fn expire(&mut self, now: Millis, key: &str, token: u64, out: &mut Outbox<T>) -> bool {
        match self.keys.get(key) {
            Some(slot) if slot.token == token => {
                self.stats.lease_expiries += 1;
                out.push_expired(key, token);
                if self.clocked && token != 0 {
                    self.holds.end(slot.granted_at);
                }
                self.hand_over_or_delete(now, key, out);
                true
            }
            _ => false,
        }
    }

    /// Answers the queued acquire `waiter` on `key` with Timeout and removes
    /// it. A stale one (already granted, timed out or cancelled) does nothing
    /// and returns false.
    pub fn wait_timeout(
        &mut self,
        now: Millis,
        key: &str,
        waiter: WaiterId,
        out: &mut Outbox<T>,
    ) -> bool {
        let _ = now;
        let Some(queue) = self.queues.get_mut(key) else {
            return false;
        };
        let Some(pos) = queue.waiters.iter().position(|w| w.id() == waiter) else {
            return false;
        };
        let w = queue.waiters.remove(pos).expect("position is in range");
        let emptied = queue.waiters.is_empty();
        let conn = self.forget_waiter(&w);
        out.push_event(
            conn,
            Reply::Timeout {
                owner: w.owner,
                key,
            },
            0,
            Grant::Fresh,
            w.tag,
        );
        if emptied {
            self.drop_queue(key);
        }
        true
    }

    /// Cancels every acquire `conn` has queued, with no reply (the connection
    /// is gone). What `conn` holds stays held until released or expired.
    ///
    /// O(1) when `conn` has no waiters; otherwise it visits only the queues
    /// `conn` is in: O(its waiters + the length of those queues).
    pub fn disconnect(&mut self, now: Millis, conn: ConnId, out: &mut Outbox<T>) {
        let _ = (now, out);
        let Some(idx) = self.conn_table.index.remove(&conn) else {
            return;
        };
        let ConnWaiters {
            slots: mut keys,
            count,
            holder,
            ..
        } = self.conn_table.conns.remove(idx as usize);
        // Several waiters on one key share the queue's copy of the key:
        // visit each queue once.
        keys.retain(|s| matches!(s, ConnSlot::Queued(_)));
        keys.sort_unstable_by_key(|s| match s {
            ConnSlot::Queued(k) => Arc::as_ptr(k).cast::<u8>() as usize,
            ConnSlot::Free(_) => 0,
        });
        keys.dedup_by(|a, b| match (a, b) {
            (ConnSlot::Queued(a), ConnSlot::Queued(b)) => Arc::ptr_eq(a, b),
            _ => false,
        });
        let mut removed = 0usize;
        for entry in keys.drain(..) {
            let ConnSlot::Queued(key) = entry else {
                continue;
            };
            let Some(q) = self.queues.get_mut(&key) else {
                continue;
            };
            let before = q.waiters.len();
            // The index is this connection's until the table reuses it,
            // which it cannot before this call returns.
            q.waiters.retain(|w| w.conn != idx);
            removed += before - q.waiters.len();
            if q.waiters.is_empty() {
                self.drop_queue(&key);
            }
        }
        debug_assert_eq!(removed, count as usize, "per-connection count drifted");
        self.waiters_total -= removed;
        self.holders.remove_waiters(holder, removed);
        self.conn_table.recycle(keys);
    }

    /// Forgets a waiter taken out of its queue; returns its connection.
    fn forget_waiter(&mut self, w: &Waiter<T>) -> ConnId {
        self.waiters_total -= 1;
        let holder = self.conn_table.conns[w.conn as usize].holder;
        self.holders.remove_waiters(holder, 1);
        self.conn_table.remove(w.conn, w.slot)
    }

    /// Deletes the registration of `key`, whatever it holds.
    fn delete_key(&mut self, key: &str) {
        if let Some(slot) = self.keys.remove(key) {
            self.forget_key(key, slot.holder);
        }
    }

    /// Uncounts a registered key named `key`, taken by `holder`, that was
    /// just deleted.
    #[inline]
    fn forget_key(&mut self, key: &str, holder: u64) {
        self.holders.remove_key(holder);
        self.key_bytes -= quota::key_cost(key.len());
    }

    /// Answers with Timeout every waiter of `key` whose wait ran out by `now`
    /// (all of them with `all`), in queue order. Leaves an empty queue in
    /// place; callers drop it.
    fn time_out_waiters(&mut self, now: Millis, key: &str, all: bool, out: &mut Outbox<T>) {
        let Some(queue) = self.queues.get_mut(key) else {
            return;
        };
        let mut gone = 0usize;
        let conns = &mut self.conn_table;
        let holders = &mut self.holders;
        queue.waiters.retain(|w| {
            let leaving = all || w.wait_deadline <= now;
            if leaving {
                gone += 1;
                holders.remove_waiters(conns.conns[w.conn as usize].holder, 1);
                let conn = conns.remove(w.conn, w.slot);
                out.push_event(
                    conn,
                    Reply::Timeout {
                        owner: w.owner,
                        key,
                    },
                    0,
                    Grant::Fresh,
                    w.tag,
                );
            }
            !leaving
        });
        self.waiters_total -= gone;
    }

    /// The current grant of `key` ends: grant the head waiter whose wait has
    /// not run out (FIFO, a new token, its own lease from `now`), or delete
    /// the key when nobody is waiting.
    fn hand_over_or_delete(&mut self, now: Millis, key: &str, out: &mut Outbox<T>) {
        // Most keys never get a waiter: one queue lookup (no hashing at all
        // while no key has waiters) settles the common case, then one more
        // hash deletes the key. Every lookup hashes the whole key with the
        // table's keyed hasher, which dominates an uncontended cycle.
        let Some(q) = self.queues.get(key) else {
            self.delete_key(key);
            return;
        };
        // A waiter whose wait ran out gets T even if its timer has not
        // fired. `timer_at` is never later than the first waiter deadline,
        // so when it is still ahead nobody ran out (and inside `tick`,
        // NEVER, the caller just did this).
        if self.tokens_exhausted() {
            self.time_out_waiters(now, key, true, out);
        } else if self.clocked && q.timer_at <= now {
            self.time_out_waiters(now, key, false, out);
        }
        let head = self.queues.get_mut(key).and_then(|q| q.waiters.pop_front());
        let Some(w) = head else {
            self.drop_queue(key);
            self.delete_key(key);
            return;
        };
        let holder = self.conn_table.conns[w.conn as usize].holder;
        let conn = self.forget_waiter(&w);
        let token = self.issue_token();
        self.stats.grants_handover += 1;
        if self.clocked {
            self.stats.wait_ms.observe(now.since(w.queued_at()));
            self.holds.start(now);
        }
        let lease_s = w.lease_s();
        let expires_at = self.lease_end(now, lease_s);
        let slot = self
            .keys
            .get_mut(key)
            .expect("a key with a queue is registered");
        self.holders.move_key(slot.holder, holder);
        slot.token = token;
        slot.holder = holder;
        slot.expires_at = expires_at;
        slot.granted_at = now;
        slot.tag = w.tag;
        self.note_lease_end(expires_at);
        out.push_event(
            conn,
            Reply::Acquired {
                token,
                owner: w.owner,
                key,
            },
            lease_s,
            Grant::Handover,
            w.tag,
        );
        self.reschedule(key);
    }

    /// After a change of holder or a tick: drops an empty queue, or points
    /// the key's timer at or before the first thing due. Keeps an existing
    /// early entry (O(1)); computes the exact moment (O(waiters)) only when
    /// the key has no entry, that is inside `tick`.
    fn reschedule(&mut self, key: &str) {
        let Some(queue) = self.queues.get(key) else {
            return;
        };
        if queue.waiters.is_empty() {
            self.drop_queue(key);
            return;
        }
        if !self.clocked {
            return;
        }
        let holder_expiry = self.keys.get(key).map_or(Millis::NEVER, |s| s.expires_at);
        let due = if queue.timer_at == Millis::NEVER {
            queue
                .waiters
                .iter()
                .map(|w| w.wait_deadline)
                .min()
                .unwrap_or(Millis::NEVER)
                .min(holder_expiry)
        } else {
            queue.timer_at.min(holder_expiry)
        };
        if due != queue.timer_at {
            self.set_timer(key, due);
        }
    }

    /// Processes everything due by `now` (single mode): waits that ran out get
    /// T, an expired key with waiters goes to its head waiter, and every
    /// `sweep_interval_ms` expired keys without waiters are deleted. Does
    /// nothing in replicated mode.
    pub fn tick(&mut self, now: Millis, out: &mut Outbox<T>) {
        if !self.clocked {
            return;
        }
        // Collect the keys that are due, then process them in key order: the
        // order of replies and tokens within one tick then depends only on
        // the lock state, not on the history of the timer index (entries can
        // be early: see `Queue::timer_at`). Keys do not interact, so any
        // order is correct; a canonical one is checkable against a model.
        let mut due = std::mem::take(&mut self.due_scratch);
        while let Some(entry) = self.timers.first_entry() {
            let (at, seq) = *entry.key();
            if at > now {
                break;
            }
            let key = entry.remove();
            if let Some(q) = self.queues.get_mut(&key) {
                // Entries are removed when they move, so this is the
                // queue's own; checked anyway rather than trusted.
                if (q.timer_at, q.timer_seq) == (at, seq) {
                    q.timer_at = Millis::NEVER;
                    due.push(key);
                }
            }
        }
        due.sort_unstable();
        for key in due.drain(..) {
            self.time_out_waiters(now, &key, false, out);
            let expired = self.keys.get(&key).is_some_and(|s| s.expires_at <= now);
            let waiting = self.queues.get(&key).is_some_and(|q| !q.waiters.is_empty());
            if expired && waiting {
                if let Some(s) = self.keys.get(&key).filter(|s| s.token != 0) {
                    out.push_expired(&key, s.token);
                    self.stats.lease_expiries += 1;
                    self.stats.hold_ms.observe(s.expires_at.since(s.granted_at));
                    self.holds.end(s.granted_at);
                }
                self.hand_over_or_delete(now, &key, out);
            } else {
                self.reschedule(&key);
            }
        }
        self.due_scratch = due;
        self.sweep_step(now, out);
    }

    /// One step of the sweep of expired keys without waiters: it starts
    /// every `sweep_interval_ms` once some lease may have ended, and then
    /// visits [`SWEEP_STEP_BUCKETS`] buckets of the key table per call (or
    /// fewer, once [`SWEEP_STEP_DELETES`] keys are deleted), so
    /// a table of any size is swept over several loop turns instead of
    /// stalling one. Deleting never moves other entries; an insertion
    /// during a pass may reorder the buckets, so that pass may miss keys
    /// (they go in the next one) and does not raise the floor.
    fn sweep_step(&mut self, now: Millis, out: &mut Outbox<T>) {
        let mut pass = match self.sweep {
            Some(pass) => pass,
            // When no lease can have ended, a pass would delete nothing.
            None if now >= self.next_sweep && self.expiry_floor <= now => SweepPass {
                cursor: 0,
                inserted: false,
                floor: Millis::NEVER,
            },
            None => {
                if now >= self.next_sweep {
                    self.next_sweep = now.add_ms(self.limits.sweep_interval_ms.max(1));
                }
                return;
            }
        };
        let end = pass.cursor.saturating_add(SWEEP_STEP_BUCKETS);
        let queues = &self.queues;
        let stats = &mut self.stats;
        let holds = &mut self.holds;
        let holders = &mut self.holders;
        let mut freed = 0u64;
        let mut floor = pass.floor;
        // Keep a key unless it expired and nobody waits for it.
        let reached = self
            .keys
            .retain_buckets(pass.cursor, end, SWEEP_STEP_DELETES, |k, s| {
                let keep = s.expires_at > now || queues.contains_key(k);
                if keep {
                    floor = floor.min(s.expires_at);
                    return true;
                }
                holders.remove_key(s.holder);
                freed += quota::key_cost(k.len());
                if s.token != 0 {
                    out.push_expired(k, s.token);
                    stats.lease_expiries += 1;
                    stats.hold_ms.observe(s.expires_at.since(s.granted_at));
                    holds.end(s.granted_at);
                }
                false
            });
        self.key_bytes -= freed;
        pass.floor = floor;
        pass.cursor = reached;
        if pass.cursor < self.keys.num_buckets() {
            self.sweep = Some(pass);
            return;
        }
        self.sweep = None;
        self.expiry_floor = if pass.inserted {
            pass.floor.min(self.expiry_floor)
        } else {
            pass.floor
        };
        self.next_sweep = now.add_ms(self.limits.sweep_interval_ms.max(1));
    }

    /// The next moment [`Engine::tick`] has work, for the poll timeout.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Millis> {
        if !self.clocked {
            return None;
        }
        let timer = self.timers.first_key_value().map(|(&(at, _), _)| at);
        // The sweep has work once it is due and some lease may have ended,
        // and at once while a pass is under way.
        let sweep = if self.sweep.is_some() {
            Some(Millis::ZERO)
        } else {
            (!self.keys.is_empty()).then_some(self.next_sweep.max(self.expiry_floor))
        };
        match (timer, sweep) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Checks the engine's internal invariants, panicking with a message on
    /// the first one broken. For tests and fuzzing; O(keys + waiters × timers).
    /// Long on purpose: a checklist read top to bottom, one statement per
    /// invariant over one walk of the tables; split, the pieces would only
    /// pass the same tables and tallies to each other.
    pub fn check_invariants(&self) {
        let mut total = 0usize;
        let mut by_conn: HashMap<u32, u32> = HashMap::new();
        let mut seen_slots = std::collections::HashSet::new();
        let mut granted = 0usize;
        let mut first_grant = None::<Millis>;
        for (key, slot) in self.keys.iter() {
            if self.clocked && slot.token != 0 {
                granted += 1;
                first_grant = Some(first_grant.map_or(slot.granted_at, |g| g.min(slot.granted_at)));
            }
            assert!(
                slot.token < self.next_token,
                "token {} of {key:?} not below next {}",
                slot.token,
                self.next_token
            );
            assert!(
                slot.token > 0 || slot.expires_at <= self.grace_until,
                "token 0 on {key:?} outside the restart grace"
            );
            assert!(
                self.expiry_floor <= slot.expires_at,
                "expiry floor {} above the lease end {} of {key:?}",
                self.expiry_floor,
                slot.expires_at
            );
        }
        if self.clocked {
            assert_eq!(
                self.holds.len(),
                granted,
                "the grant ages do not count every grant"
            );
            assert_eq!(
                self.holds.oldest(),
                first_grant.map(|g| Millis(g.0 / 1000 * 1000)),
                "the grant ages' oldest second is not the table's"
            );
        }
        for (key, q) in self.queues.iter() {
            let slot = self
                .keys
                .get(key)
                .unwrap_or_else(|| panic!("{key:?} has a queue but is not registered"));
            assert!(!q.waiters.is_empty(), "{key:?} has an empty queue");
            assert!(
                q.waiters.len() <= self.limits.max_waiters_per_key,
                "{key:?} over max_waiters_per_key"
            );
            if self.clocked {
                assert!(
                    self.timers
                        .get(&(q.timer_at, q.timer_seq))
                        .is_some_and(|k| Arc::ptr_eq(k, key)),
                    "{key:?} has waiters but no timer"
                );
                let first_due = q
                    .waiters
                    .iter()
                    .map(|w| w.wait_deadline)
                    .min()
                    .unwrap_or(Millis::NEVER)
                    .min(slot.expires_at);
                assert!(
                    q.timer_at <= first_due,
                    "{key:?} timer at {} is later than {first_due}",
                    q.timer_at
                );
            }
            for w in &q.waiters {
                total += 1;
                *by_conn.entry(w.conn).or_insert(0) += 1;
                assert!(w.lease_s() > 0, "waiter on {key:?} with lease 0");
                assert!(
                    seen_slots.insert((w.conn, w.slot)),
                    "two waiters share connection slot {}/{}",
                    w.conn,
                    w.slot
                );
                let cw = self
                    .conn_table
                    .conns
                    .get(w.conn as usize)
                    .unwrap_or_else(|| panic!("waiter on {key:?} names no connection"));
                match cw.slots.get(w.slot as usize) {
                    Some(ConnSlot::Queued(k)) if Arc::ptr_eq(k, key) => {}
                    other => panic!("waiter on {key:?} recorded as {other:?}"),
                }
            }
        }
        assert_eq!(total, self.waiters_total, "waiter count drifted");
        let queues_with_timers = if self.clocked { self.queues.len() } else { 0 };
        assert_eq!(
            self.timers.len(),
            queues_with_timers,
            "timer entries of keys without waiters, or two for one key"
        );
        assert_eq!(
            self.conn_table.index.len(),
            self.conn_table.conns.len(),
            "connection index and table differ"
        );
        for (i, cw) in &self.conn_table.conns {
            let i = u32::try_from(i).expect("index fits");
            assert_eq!(
                self.conn_table.index.get(&cw.id),
                Some(&i),
                "connection {} not indexed",
                cw.id
            );
            assert!(cw.count > 0, "connection {} kept without waiters", cw.id);
            assert_eq!(
                by_conn.get(&i).copied().unwrap_or(0),
                cw.count,
                "per-connection waiter count of {} drifted",
                cw.id
            );
            let queued = cw
                .slots
                .iter()
                .filter(|s| matches!(s, ConnSlot::Queued(_)))
                .count();
            assert_eq!(queued, cw.count as usize, "slots of {} drifted", cw.id);
            let mut free = 0usize;
            let mut at = cw.free;
            while at != NO_SLOT {
                free += 1;
                assert!(free <= cw.slots.len(), "free list of {} loops", cw.id);
                match cw.slots.get(at as usize) {
                    Some(ConnSlot::Free(next)) => at = *next,
                    other => panic!("free list of {} reaches {other:?}", cw.id),
                }
            }
            assert_eq!(free + queued, cw.slots.len(), "lost slots in {}", cw.id);
        }
        assert!(
            self.waiters_total <= self.limits.max_waiters,
            "over max_waiters"
        );
        assert!(self.keys.len() <= self.limits.max_keys, "over max_keys");
        self.check_accounting();
    }

    /// The holders' counts and the memory estimate against a recount of
    /// the tables.
    fn check_accounting(&self) {
        let mut uses: HashMap<u64, HolderUse> = HashMap::new();
        let mut key_bytes = 0;
        for (key, slot) in self.keys.iter() {
            key_bytes += quota::key_cost(key.len());
            if slot.holder != 0 {
                uses.entry(slot.holder).or_default().keys += 1;
            }
        }
        for (_, cw) in &self.conn_table.conns {
            if cw.holder != 0 {
                uses.entry(cw.holder).or_default().waiters += cw.count as usize;
            }
        }
        let queue_bytes: u64 = self
            .queues
            .iter()
            .map(|(k, _)| quota::queue_cost(k.len()))
            .sum();
        assert_eq!(self.key_bytes, key_bytes, "key bytes drifted");
        assert_eq!(self.queue_bytes, queue_bytes, "queue bytes drifted");
        let counted: HashMap<u64, HolderUse> = self.holders.iter().collect();
        assert_eq!(counted, uses, "holder counts drifted");
        assert_eq!(counted.len(), self.holders.len(), "a holder counted twice");
        for (h, u) in &counted {
            assert_eq!(self.holder_use(*h), *u, "holder {h} found wrong");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::encode_reply;

    /// The server copies `frames()` to the sockets and services read
    /// `iter()`: both must tell the same replies, in order, the bytes being
    /// the codec's, a run per connection, and nothing of a withheld grant.
    /// Long because every check reuses the one table of replies, which
    /// rustfmt spreads a field to a line.
    #[test]
    fn outbox_frames_are_the_encoded_replies_in_runs_per_connection() {
        let replies = [
            (
                1,
                Reply::Acquired {
                    token: 7,
                    owner: 0x0A0B,
                    key: "db",
                },
                30,
            ),
            (
                1,
                Reply::Released {
                    token: 7,
                    key: "db",
                },
                0,
            ),
            (
                2,
                Reply::Timeout {
                    owner: 3, key: "é"
                },
                0,
            ),
            (2, Reply::Extended { token: 9, key: "k" }, 5),
            (2, Reply::Busy { owner: 4, key: "k" }, 0),
            (1, Reply::NotExtended { token: 1, key: "x" }, 0),
            (1, Reply::NotReleased { token: 2, key: "x" }, 0),
        ];
        let mut out = Outbox::new();
        for &(conn, reply, lease_s) in &replies {
            out.push(conn, reply, lease_s);
        }
        let read: Vec<_> = out.iter().map(|a| (a.conn, a.reply, a.lease_s)).collect();
        assert_eq!(read, replies);
        let wire = |rs: &[(ConnId, Reply<'_>, u8)]| {
            let mut v = Vec::new();
            for (_, r, _) in rs {
                encode_reply(r, &mut v);
            }
            v
        };
        let runs: Vec<(ConnId, Vec<u8>)> = out.frames().map(|(c, f)| (c, f.to_vec())).collect();
        assert_eq!(
            runs,
            vec![
                (1, wire(&replies[0..2])),
                (2, wire(&replies[2..5])),
                (1, wire(&replies[5..7])),
            ]
        );
        // Withholding the grant and the extension splits their runs.
        assert_eq!(out.retain_leases(|_| false), 2);
        let runs: Vec<(ConnId, Vec<u8>)> = out.frames().map(|(c, f)| (c, f.to_vec())).collect();
        assert_eq!(
            runs,
            vec![
                (1, wire(&replies[1..2])),
                (2, wire(&replies[2..3])),
                (2, wire(&replies[4..5])),
                (1, wire(&replies[5..7])),
            ]
        );
        assert_eq!(out.iter().count(), 5);
        // Counted at push, less what was withheld; wrong-token answers in
        // order.
        let mut counts = [0; 7];
        out.tally(&mut counts);
        assert_eq!(counts, [0, 1, 1, 1, 1, 0, 1]);
        assert_eq!(out.wrong_token_answers().collect::<Vec<_>>(), [1, 1]);
        out.clear();
        assert!(out.is_empty() && out.frames().next().is_none());
        out.tally(&mut counts);
        assert_eq!(counts, [0, 1, 1, 1, 1, 0, 1], "nothing held adds nothing");
        assert_eq!(out.wrong_token_answers().count(), 0);
        out.push(3, Reply::NotReleased { token: 1, key: "a" }, 0);
        out.push(4, Reply::Released { token: 1, key: "a" }, 0);
        out.push(5, Reply::NotExtended { token: 1, key: "a" }, 0);
        assert_eq!(out.wrong_token_answers().collect::<Vec<_>>(), [3, 5]);
        out.tally(&mut counts);
        assert_eq!(counts, [0, 1, 1, 2, 2, 0, 2]);
        // An N or X to token 0 guessed at nothing: answered and counted,
        // but not a wrong-token answer.
        out.clear();
        out.push(6, Reply::NotReleased { token: 0, key: "a" }, 0);
        out.push(7, Reply::NotExtended { token: 0, key: "a" }, 0);
        out.push(8, Reply::NotReleased { token: 2, key: "a" }, 0);
        assert_eq!(out.wrong_token_answers().collect::<Vec<_>>(), [8]);
        assert_eq!(out.iter().count(), 3);
    }

    /// Replies to the connection whose write buffer is lent are encoded at
    /// its end, byte for byte what `frames()` would have carried, in order
    /// after what the buffer held; replies to others stay in the outbox.
    /// They are counted, their wrong-token answers listed, and a withheld
    /// grant or extension among them is listed as the range to cut out.
    #[test]
    fn a_lent_write_buffer_gets_its_replies_encoded_and_withheld_ranges_listed() {
        let mine = [
            (
                Reply::Acquired {
                    token: 7,
                    owner: 1,
                    key: "db",
                },
                30,
            ),
            (
                Reply::Released {
                    token: 7,
                    key: "db",
                },
                0,
            ),
            (Reply::Extended { token: 9, key: "k" }, 5),
            (Reply::NotReleased { token: 2, key: "x" }, 0),
            (Reply::Busy { owner: 4, key: "k" }, 0),
        ];
        let other = Reply::Acquired {
            token: 11,
            owner: 2,
            key: "q",
        };
        let mut routed = Outbox::new();
        let mut out = Outbox::new();
        assert!(out.may_lend(1));
        out.begin_direct(1, b"old".to_vec());
        assert!(!out.may_lend(2), "one buffer at a time");
        for (i, &(reply, lease_s)) in mine.iter().enumerate() {
            out.push(1, reply, lease_s);
            routed.push(1, reply, lease_s);
            if i == 1 {
                out.push(2, other, 10);
            }
        }
        let buf = out.end_direct();
        let want: Vec<u8> = routed.frames().flat_map(|(_, f)| f.to_vec()).collect();
        assert_eq!(buf[..3], *b"old");
        assert_eq!(buf[3..], want[..]);
        // Only the reply to connection 2 is held as a message.
        assert_eq!(out.len(), 1);
        let runs: Vec<(ConnId, Vec<u8>)> = out.frames().map(|(c, f)| (c, f.to_vec())).collect();
        let mut wire = Vec::new();
        encode_reply(&other, &mut wire);
        assert_eq!(runs, vec![(2, wire)]);
        assert!(!out.may_lend(2), "a reply to 2 is held: it goes first");
        assert!(out.may_lend(1));
        let mut counts = [0; 7];
        out.tally(&mut counts);
        assert_eq!(counts, [2, 0, 1, 1, 1, 1, 0]);
        assert_eq!(out.wrong_token_answers().collect::<Vec<_>>(), [1]);
        assert_eq!(out.direct_lent(), [(1, 3)]);
        // Withholding leases over 10 s: the 30 s grant in the buffer goes,
        // the 5 s extension and the 10 s grant to connection 2 stay.
        assert_eq!(out.retain_leases(|lease_s| lease_s <= 10), 1);
        let mut first = Vec::new();
        encode_reply(&mine[0].0, &mut first);
        assert_eq!(out.direct_withdrawn(), [(1, 3, 3 + first.len())]);
        let mut counts = [0; 7];
        out.tally(&mut counts);
        assert_eq!(counts, [1, 0, 1, 1, 1, 1, 0]);
        assert_eq!(
            out.retain_leases(|_| false),
            2,
            "the extension and the grant to 2"
        );
        assert_eq!(out.direct_withdrawn().len(), 2);
        out.clear();
        assert!(out.direct_lent().is_empty() && out.direct_withdrawn().is_empty());
        assert_eq!(out.wrong_token_answers().count(), 0);
        // Not lent: replies are held as before.
        out.push(1, mine[0].0, 30);
        assert_eq!(out.len(), 1);
        assert_eq!(out.direct_len(), 0);
    }

    #[test]
    fn unmarked_direct_grants_keep_their_bytes_counts_and_wrong_token_marks() {
        let replies = [
            (
                Reply::Acquired {
                    token: 7,
                    owner: 1,
                    key: "db",
                },
                30,
            ),
            (
                Reply::Extended {
                    token: 7,
                    key: "db",
                },
                5,
            ),
            (Reply::NotReleased { token: 2, key: "x" }, 0),
            (Reply::NotExtended { token: 3, key: "y" }, 0),
            (
                Reply::Released {
                    token: 7,
                    key: "db",
                },
                0,
            ),
        ];
        let mut routed = Outbox::new();
        for (marked, want_marks) in [(true, 4), (false, 2)] {
            let mut out = Outbox::new();
            out.set_direct_grant_marks(marked);
            out.begin_direct(1, Vec::new());
            for &(reply, lease_s) in &replies {
                out.push(1, reply, lease_s);
                if marked {
                    routed.push(1, reply, lease_s);
                }
            }
            let buf = out.end_direct();
            let want: Vec<u8> = routed.frames().flat_map(|(_, f)| f.to_vec()).collect();
            assert_eq!(buf, want, "marked: {marked}");
            assert_eq!(out.direct.marks.len(), want_marks, "marked: {marked}");
            let mut counts = [0; 7];
            out.tally(&mut counts);
            assert_eq!(counts, [1, 0, 0, 1, 1, 1, 1]);
            assert_eq!(out.wrong_token_answers().collect::<Vec<_>>(), [1, 1]);
            out.clear();
            // Nothing lent since the clear: held grants are withheld as
            // ever, whatever the setting.
            out.push(2, replies[0].0, 30);
            assert_eq!(out.retain_leases(|_| false), 1);
        }
    }

    #[test]
    #[should_panic(expected = "not marked")]
    fn retain_leases_refuses_a_turn_whose_lent_grants_are_not_marked() {
        let mut out = Outbox::new();
        out.set_direct_grant_marks(false);
        out.begin_direct(1, Vec::new());
        out.push(
            1,
            Reply::Acquired {
                token: 7,
                owner: 1,
                key: "db",
            },
            30,
        );
        let _ = out.end_direct();
        out.retain_leases(|_| false);
    }

    /// What happened reads back as typed events, each carrying the tag of
    /// the request it answers: a grant's tag moves from waiter to holder.
    /// Long because it walks one scenario, step by step, with its events.
    #[test]
    fn events_tell_how_each_grant_came_and_which_lease_ran_out() {
        let mut e: Engine<u32> = Engine::replicated_tagged(EngineLimits::default(), 1);
        let mut out = Outbox::default();
        let now = Millis::ZERO;
        e.acquire_tagged(now, 1, acq("k", 10, 0, 5), 100, &mut out);
        e.acquire_tagged(now, 2, acq("k", 20, 9, 6), 200, &mut out);
        e.acquire_tagged(now, 3, acq("k", 30, 0, 5), 300, &mut out);
        assert!(e.release(now, 1, 1, "k", &mut out));
        assert_eq!(e.grant("k"), Some((2, &200)));
        assert!(e.expire(now, "k", 2, &mut out));
        let got: Vec<Event<'_, u32>> = out.events().collect();
        assert_eq!(
            got,
            vec![
                Event::Granted {
                    conn: 1,
                    key: "k",
                    token: 1,
                    owner: 10,
                    lease_s: 5,
                    how: Grant::Fresh,
                    tag: 100
                },
                Event::TimedOut {
                    conn: 3,
                    key: "k",
                    owner: 30,
                    tag: 300
                },
                Event::Released {
                    conn: 1,
                    key: "k",
                    token: 1
                },
                Event::Granted {
                    conn: 2,
                    key: "k",
                    token: 2,
                    owner: 20,
                    lease_s: 6,
                    how: Grant::Handover,
                    tag: 200
                },
                Event::Expired { key: "k", token: 2 },
            ]
        );
        // The expiry is no reply: the wire carries the four others.
        assert_eq!(out.iter().count(), 4);
        let mut counts = [0; 7];
        out.tally(&mut counts);
        assert_eq!(counts, [2, 1, 0, 1, 0, 0, 0]);
        // Single mode: a lazy takeover reports the lease that ended first.
        let mut e = Engine::new(EngineLimits::default(), 1);
        let mut out = Outbox::new();
        e.acquire(Millis(0), 1, acq("j", 1, 0, 1), &mut out);
        out.clear();
        e.acquire(Millis(5_000), 2, acq("j", 2, 0, 1), &mut out);
        let how: Vec<_> = out
            .events()
            .map(|ev| match ev {
                Event::Granted { how, token, .. } => format!("{how:?} {token}"),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(how, ["Expired { key: \"j\", token: 1 }", "Takeover 2"]);
        let frames: Vec<u8> = out.frames().flat_map(|(_, f)| f.to_vec()).collect();
        let mut wire = Vec::new();
        encode_reply(
            &Reply::Acquired {
                token: 2,
                owner: 2,
                key: "j",
            },
            &mut wire,
        );
        assert_eq!(frames, wire);
    }

    fn acq(key: &str, owner: u64, wait_s: u8, lease_s: u8) -> Acquire<'_> {
        Acquire {
            key,
            owner,
            wait_s,
            lease_s,
        }
    }

    fn replies(out: &mut Outbox) -> Vec<(ConnId, String)> {
        let v = out
            .iter()
            .map(|a| (a.conn, format!("{:?}", a.reply)))
            .collect();
        out.clear();
        v
    }

    #[test]
    fn release_hands_over_fifo_and_expiry_hands_over_on_tick() {
        let mut e = Engine::new(EngineLimits::default(), 1);
        let mut out = Outbox::new();
        let t0 = Millis(1000);
        assert_eq!(
            e.acquire(t0, 1, acq("k", 10, 0, 5), &mut out),
            AcquireOutcome::Granted(1)
        );
        assert!(matches!(
            e.acquire(t0, 2, acq("k", 20, 9, 3), &mut out),
            AcquireOutcome::Queued(_)
        ));
        assert!(matches!(
            e.acquire(t0, 3, acq("k", 30, 60, 3), &mut out),
            AcquireOutcome::Queued(_)
        ));
        e.check_invariants();
        replies(&mut out);
        assert!(e.release(t0, 1, 1, "k", &mut out));
        let r = replies(&mut out);
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].0, 2, "head waiter gets the key");
        e.check_invariants();
        // owner 20 holds with a 3 s lease from t0, over once t0 + 3 s is
        // past; owner 30 waits until t0 + 60 s.
        let lease_over = t0.add_secs(3).add_ms(1);
        assert_eq!(e.next_deadline(), Some(lease_over));
        e.tick(t0.add_secs(3), &mut out);
        assert!(out.is_empty(), "not yet past the expiry");
        e.tick(lease_over, &mut out);
        let r = replies(&mut out);
        assert_eq!(
            r,
            vec![(
                3,
                "Acquired { token: 3, owner: 30, key: \"k\" }".to_string()
            )]
        );
        e.check_invariants();
    }

    /// The memory figures of the module doc rest on these sizes.
    #[test]
    fn slots_are_32_bytes_and_waiters_32() {
        assert_eq!(std::mem::size_of::<Slot>(), 32);
        assert_eq!(std::mem::size_of::<Waiter>(), 32);
        assert_eq!(std::mem::size_of::<ConnSlot>(), 16);
        let w = Waiter {
            owner: 1,
            wait_deadline: Millis(3),
            id_lease: (WAITER_ID_LIMIT - 1) << 16 | 2 << 8 | 255,
            conn: 2,
            slot: 4,
            tag: (),
        };
        assert_eq!((w.id(), w.lease_s()), (WAITER_ID_LIMIT - 1, 255));
        let w = Waiter {
            wait_deadline: Millis(5_000),
            ..w
        };
        assert_eq!(w.queued_at(), Millis(3_000));
    }

    /// Waiter ids share a word with the wait and lease, so they wrap below 2^48,
    /// skipping 0, and still name the right waiter.
    #[test]
    fn waiter_ids_wrap_below_the_lease_bits() {
        let mut e = Engine::replicated(EngineLimits::default(), 1);
        let mut out = Outbox::new();
        e.next_waiter = WAITER_ID_LIMIT - 1;
        e.acquire(Millis(0), 1, acq("k", 1, 0, 5), &mut out);
        let a = e.acquire(Millis(0), 2, acq("k", 2, 9, 7), &mut out);
        let b = e.acquire(Millis(0), 3, acq("k", 3, 9, 8), &mut out);
        assert_eq!(a, AcquireOutcome::Queued(WAITER_ID_LIMIT - 1));
        assert_eq!(b, AcquireOutcome::Queued(1));
        out.clear();
        assert!(e.wait_timeout(Millis(0), "k", 1, &mut out));
        assert_eq!(e.queued_owners("k"), vec![2]);
        assert!(e.expire(Millis(0), "k", 1, &mut out));
        let r = replies(&mut out);
        assert_eq!(
            r[1],
            (2, "Acquired { token: 2, owner: 2, key: \"k\" }".to_string())
        );
        assert_eq!(out.len(), 0);
        e.check_invariants();
    }

    #[test]
    fn a_waiter_whose_wait_ran_out_is_never_granted() {
        let mut e = Engine::new(EngineLimits::default(), 7);
        let mut out = Outbox::new();
        e.acquire(Millis(0), 1, acq("k", 1, 0, 30), &mut out);
        e.acquire(Millis(0), 2, acq("k", 2, 1, 30), &mut out);
        out.clear();
        // The release comes after the wait ran out but before any tick.
        assert!(e.release(Millis(1000), 1, 7, "k", &mut out));
        let r = replies(&mut out);
        assert_eq!(r[1], (2, "Timeout { owner: 2, key: \"k\" }".to_string()));
        assert_eq!(e.key_count(), 0);
        e.check_invariants();
    }

    /// After a restart within the leases of the previous run, every key
    /// is held by an unknown holder until the grace ends: T at once, a
    /// FIFO queue granted at the end, N for any release.
    #[test]
    fn a_restart_grace_holds_every_key_until_it_ends() {
        let mut e = Engine::new(EngineLimits::default(), 100);
        let mut out = Outbox::new();
        let end = Millis(5_000);
        e.set_restart_grace(end);
        assert_eq!(e.restart_grace(Millis(1_000)), Some(end));
        let t = Millis(1_000);
        for key in ["held-before", "never-seen"] {
            assert_eq!(
                e.acquire(t, 1, acq(key, 1, 0, 5), &mut out),
                AcquireOutcome::Timeout
            );
        }
        assert!(matches!(
            e.acquire(t, 2, acq("held-before", 2, 60, 5), &mut out),
            AcquireOutcome::Queued(_)
        ));
        assert!(matches!(
            e.acquire(t, 3, acq("held-before", 3, 60, 5), &mut out),
            AcquireOutcome::Queued(_)
        ));
        assert!(matches!(
            e.acquire(t, 4, acq("short", 4, 2, 5), &mut out),
            AcquireOutcome::Queued(_)
        ));
        for token in [0, 1, 99, 100] {
            assert!(!e.release(t, 5, token, "held-before", &mut out));
            assert!(!e.extend(t, 5, "held-before", token, 5, &mut out));
        }
        e.check_invariants();
        replies(&mut out);
        // The short wait runs out inside the grace: Timeout, never the key.
        e.tick(Millis(3_000), &mut out);
        assert_eq!(
            replies(&mut out),
            vec![(4, "Timeout { owner: 4, key: \"short\" }".to_string())]
        );
        assert_eq!(e.next_deadline(), Some(end));
        e.tick(Millis(4_999), &mut out);
        assert!(out.is_empty());
        // At the end the head waiter gets the key, FIFO.
        e.tick(end, &mut out);
        assert_eq!(
            replies(&mut out),
            vec![(
                2,
                "Acquired { token: 100, owner: 2, key: \"held-before\" }".to_string()
            )]
        );
        assert_eq!(e.queued_owners("held-before"), vec![3]);
        assert_eq!(e.restart_grace(end), None);
        assert_eq!(
            e.acquire(end, 1, acq("never-seen", 6, 0, 5), &mut out),
            AcquireOutcome::Granted(101)
        );
        assert_eq!(
            e.acquire(end, 1, acq("new", 7, 0, 5), &mut out),
            AcquireOutcome::Granted(102)
        );
        e.check_invariants();
    }

    #[test]
    fn a_lease_above_the_maximum_is_busy_and_grants_track_their_latest_end() {
        let mut e = Engine::new(EngineLimits::default(), 1);
        let mut out = Outbox::new();
        e.set_max_lease(10);
        assert_eq!(
            e.acquire(Millis(0), 1, acq("k", 1, 0, 11), &mut out),
            AcquireOutcome::Busy
        );
        assert_eq!(
            e.acquire(Millis(0), 1, acq("k", 1, 9, 11), &mut out),
            AcquireOutcome::Busy
        );
        assert_eq!(e.granted_until(), Millis::ZERO);
        assert_eq!(e.outstanding_until(Millis(0)), None);
        assert_eq!(
            e.acquire(Millis(0), 1, acq("k", 1, 0, 10), &mut out),
            AcquireOutcome::Granted(1)
        );
        assert_eq!(
            e.acquire(Millis(0), 1, acq("j", 1, 0, 3), &mut out),
            AcquireOutcome::Granted(2)
        );
        assert_eq!(e.granted_until(), Millis(10_001));
        assert_eq!(e.outstanding_until(Millis(0)), Some(Millis(10_001)));
        // An extend past the maximum is refused; one within it moves the
        // latest lease end.
        assert!(!e.extend(Millis(0), 1, "j", 2, 11, &mut out));
        assert!(e.extend(Millis(2_000), 1, "j", 2, 10, &mut out));
        assert_eq!(e.granted_until(), Millis(12_001));
        assert!(e.extend(Millis(2_000), 1, "j", 2, 1, &mut out));
        assert!(e.release(Millis(0), 1, 1, "k", &mut out));
        assert_eq!(
            e.granted_until(),
            Millis(12_001),
            "a release does not lower it"
        );
        assert_eq!(e.outstanding_until(Millis(0)), Some(Millis(3_001)));
        assert_eq!(e.outstanding_until(Millis(3_001)), None, "the lease ended");
    }
}

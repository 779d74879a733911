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
//! # Permits (protocol 1.2)
//!
//! [`Engine::acquire_with_limit`] registers a key with a limit of N
//! places: a counting semaphore, or with shared and exclusive acquires a
//! read/write lock (PROTOCOL §6). Such a key lives in a table of its own
//! (module `permits`), each grant with its own token and lease; its
//! waiters share the queues, the deadline index and the connection table
//! with the mutexes, the mode in a bit of the waiter. The mutex paths pay
//! for it only when they miss: a release, extend or expiry of a key that
//! is not a mutex looks in the permit table while it is not empty. The
//! server does not take `P` yet: the codec decodes it, the engine serves
//! it and cluster mode replicates it (its snapshot image records the
//! permits, module `image`), but the server's connection loop still
//! closes a connection that sends it.
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
//! * **Permit holder (protocol 1.2): 46 bytes** after the first, at
//!   100,000 semaphores of 8 places with every place held (allocator;
//!   49 by RSS): a key's first grant is kept in its table entry; a second
//!   moves both into a vector of 40-byte grants (4 places, doubling as it
//!   grows, so just past a power of two a holder costs up to 40 bytes
//!   more). A key with its first holder: 106 bytes (108 by RSS) at that
//!   size, a table entry like a mutex's with its grant in place of the
//!   slot, and no allocation of its own. The memory budget counts every
//!   grant as a key (the estimate below), so it errs high for the holders
//!   after the first.
//! * **Hot path:** an uncontended acquire + release of a fresh key hashes
//!   the key twice (one table lookup each; the queue map is not hashed
//!   while no key has waiters), each time in one pass of a randomly seeded
//!   hash over its bytes (foldhash, `crate::hash`: ~26 instructions for a
//!   24-byte key), and allocates only for a key longer than 30 bytes (the stored key); T, N,
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
//!
//! # Where things are
//!
//! This file holds the types, the [`Engine`] with its constructors and its
//! request dispatch; each concern has a file of its own: `acquire` (a
//! fresh grant, a takeover, a queued waiter: the hot path), `release`
//! (release, a committed expiry and the handover to the head waiter),
//! `extend`, `waiters` (queues, wait timeouts, disconnects), `conns` (the
//! connection table), `deadlines` (the deadline index and `tick`), `sweep`,
//! `leases` (lease ends, the longest lease, the restart grace), `tokens`,
//! `budget` (quotas and the memory budget as acquires meet them),
//! `permits` (keys of a limit of 2 or more: semaphores and
//! shared/exclusive locks, PROTOCOL §6), `quota`
//! (the counts by holder and the cost estimates), `outbox` (replies and
//! events), `view` (what the engine shows), `image` (the snapshot) and
//! `invariants` (the checker for tests and fuzzing).

use std::collections::BTreeMap;
use std::sync::Arc;

mod acquire;
mod budget;
mod conns;
mod deadlines;
mod extend;
mod image;
#[cfg(test)]
mod image_tests;
mod invariants;
mod leases;
mod outbox;
mod permit_set;
mod permits;
mod quota;
mod release;
mod sweep;
#[cfg(test)]
mod tests;
mod tokens;
mod view;
mod waiters;

pub use image::{
    Image, ImageError, ImageReader, KeyImage, PermitImage, PermitKeyImage, TagCodec, WaiterImage,
};
pub use outbox::{Addressed, Event, Outbox};
pub use quota::{HolderUse, QuotaRefusals};
pub use sweep::{SWEEP_STEP_BUCKETS, SWEEP_STEP_DELETES};
pub use view::{HeldGrant, LockInfo, LockTable, PermitInfo, PermitsInfo, Queued};

pub use crate::proto::Places;
use conns::ConnTable;
use outbox::Kind;
use permits::PermitSet;
use sweep::SweepPass;
use waiters::Queue;

use crate::hash::{KeyStr, SipKey, StrMap};
use crate::limits::EngineLimits;
use crate::metrics::{GrantAges, Histogram, HOLD_BOUNDS_MS, WAIT_BOUNDS_MS};
use crate::proto::Request;
use crate::time::Millis;
use crate::token::TokenRng;

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
    /// The key is registered with another limit, the one given (PROTOCOL
    /// §6.2): an `L` is in the outbox.
    LimitMismatch(u16),
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
    /// Grants of keys of limit 2 or more (PROTOCOL §6) in shared mode
    /// (also counted by path above).
    pub permit_grants_shared: u64,
    /// The same in exclusive mode.
    pub permit_grants_exclusive: u64,
    /// Acquires with a limit answered LimitMismatch.
    pub limit_mismatches: u64,
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
            permit_grants_shared: 0,
            permit_grants_exclusive: 0,
            limit_mismatches: 0,
        }
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
    /// Keys registered with a limit of 2 or more (PROTOCOL §6), each with
    /// its grants; their waiters are in `queues` like a mutex's. A key is
    /// in `keys` or here, never both.
    permits: StrMap<KeyStr, PermitSet<T>>,
    /// The grants held in `permits`, all keys together.
    permit_grants: usize,
    /// Grant vectors of deleted permit keys, for new ones (module
    /// `permits`).
    spare_grants: Vec<Vec<permit_set::Permit<T>>>,
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
            permits: StrMap::with_key(hash_key),
            permit_grants: 0,
            spare_grants: Vec::new(),
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

    /// Handles one decoded request: [`Engine::acquire`],
    /// [`Engine::acquire_with_limit`], [`Engine::release`] or
    /// [`Engine::extend`].
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
            Request::AcquireWithLimit {
                wait_s,
                lease_s,
                owner,
                limit,
                mode,
                key,
            } => {
                let req = Acquire {
                    key,
                    owner,
                    wait_s,
                    lease_s,
                };
                let places = Places { limit, mode };
                self.acquire_with_limit(now, conn, req, places, T::default(), out);
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
}

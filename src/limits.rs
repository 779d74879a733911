//! Every bound of ticketd with its default, in one place.
//!
//! "Put a limit on everything": each limit here is a command-line flag of the
//! server, and the relations between them are checked at compile time.

/// Default for `--max-key-bytes`: the longest key, in bytes (PROTOCOL §1).
pub const DEFAULT_MAX_KEY_BYTES: usize = 1024;
/// Hard ceiling for `--max-key-bytes`, so one frame always fits a small buffer.
pub const MAX_KEY_BYTES_CEILING: usize = 64 * 1024;
/// Default for `--max-keys`: registered keys (held or queued on).
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;
/// Default for `--max-waiters`: queued acquires over all keys.
pub const DEFAULT_MAX_WAITERS: usize = 100_000;
/// Default for `--max-waiters-per-key`.
pub const DEFAULT_MAX_WAITERS_PER_KEY: usize = 1_000;
/// Default for `--sweep-interval`: seconds between sweeps of expired keys.
pub const DEFAULT_SWEEP_INTERVAL_S: u64 = 5;
/// Default for `--max-keys-per-identity`: half of `--max-keys`, so one
/// identity leaves room for the others.
pub const DEFAULT_MAX_KEYS_PER_IDENTITY: usize = DEFAULT_MAX_KEYS / 2;
/// Default for `--max-waiters-per-identity`: half of `--max-waiters`.
pub const DEFAULT_MAX_WAITERS_PER_IDENTITY: usize = DEFAULT_MAX_WAITERS / 2;
/// Default for `--max-memory`: bytes of keys, waiters and connection
/// buffers (docs/SECURITY.md, "Quotas and the memory budget").
pub const DEFAULT_MAX_MEMORY: u64 = 256 * 1024 * 1024;

/// The longest request frame: `'A' wait lease owner` + key + `'\n'`.
#[must_use]
pub const fn max_request_frame(max_key_bytes: usize) -> usize {
    12 + max_key_bytes
}

/// The longest reply frame: `'A' token owner` + key + `'\n'`. (Extend is
/// one byte shorter than Acquire, its replies shorter than an Acquired.)
#[must_use]
pub const fn max_reply_frame(max_key_bytes: usize) -> usize {
    18 + max_key_bytes
}

/// The most bytes one allocation can hold in this build. Rust refuses any
/// allocation over `isize::MAX` bytes: 8 EiB on a 64-bit target, but 2 GiB
/// less one byte on a 32-bit one (armv7), where sizes derived from the
/// limits (a cluster node's snapshot and peer frames) can reach it. Sizes
/// are computed in `u64` and checked against this (or against a smaller
/// bound that tests pass in, to play a 32-bit build on a 64-bit one).
pub const MAX_ALLOC_BYTES: u64 = isize::MAX as u64;

const _: () = assert!(DEFAULT_MAX_KEY_BYTES <= MAX_KEY_BYTES_CEILING);
const _: () = assert!(DEFAULT_MAX_WAITERS_PER_KEY <= DEFAULT_MAX_WAITERS);
const _: () = assert!(DEFAULT_SWEEP_INTERVAL_S > 0);
const _: () = assert!(DEFAULT_MAX_KEYS_PER_IDENTITY < DEFAULT_MAX_KEYS);
const _: () = assert!(DEFAULT_MAX_WAITERS_PER_IDENTITY < DEFAULT_MAX_WAITERS);

/// The capacity limits of the lock engine (PROTOCOL §2.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineLimits {
    /// Registered keys; a new key beyond this is answered Busy.
    pub max_keys: usize,
    /// Queued acquires over all keys; beyond this an acquire that would queue is Busy.
    pub max_waiters: usize,
    /// Queued acquires on one key; beyond this an acquire that would queue is Busy.
    pub max_waiters_per_key: usize,
    /// Milliseconds between sweeps that delete expired keys without waiters.
    pub sweep_interval_ms: u64,
    /// Single mode: the longest a grant may be held, extensions included,
    /// in milliseconds from its grant (`--max-hold`); an Extend that would
    /// carry it further is answered `X`. 0: no cap.
    pub max_hold_ms: u64,
    /// Keys one holder (a client identity) may have registered
    /// (`--max-keys-per-identity`); a new key beyond this is answered
    /// Busy. Holder 0 (unknown: a restart grace, cluster mode) has none.
    pub max_keys_per_holder: usize,
    /// Acquires one holder may have queued (`--max-waiters-per-identity`);
    /// beyond this an acquire that would queue is Busy.
    pub max_waiters_per_holder: usize,
    /// The memory budget in bytes (`--max-memory`): a new key or waiter
    /// that would take the engine's estimate of its own bytes, plus what
    /// the service counts outside it, past this is answered Busy.
    pub max_memory: u64,
}

impl Default for EngineLimits {
    fn default() -> Self {
        EngineLimits {
            max_keys: DEFAULT_MAX_KEYS,
            max_waiters: DEFAULT_MAX_WAITERS,
            max_waiters_per_key: DEFAULT_MAX_WAITERS_PER_KEY,
            sweep_interval_ms: DEFAULT_SWEEP_INTERVAL_S * 1000,
            max_hold_ms: 0,
            max_keys_per_holder: DEFAULT_MAX_KEYS_PER_IDENTITY,
            max_waiters_per_holder: DEFAULT_MAX_WAITERS_PER_IDENTITY,
            max_memory: DEFAULT_MAX_MEMORY,
        }
    }
}

//! Keyed hashing of lock names, and the string-keyed table the engine keeps
//! them in.
//!
//! Keys are chosen by network clients, so the engine's tables must not let a
//! client predict which keys collide (a "hash flood" would turn every lookup
//! into a scan of one long probe sequence). They are hashed with SipHash-1-3,
//! the keyed hash the standard library's `HashMap` uses, under a 128-bit key
//! drawn afresh for every table from the standard library's randomly seeded
//! `RandomState` (itself seeded from the operating system's random source).
//!
//! What differs from `HashMap<Box<str>, V>` is how the hash is computed. The
//! standard hasher is incremental: it buffers every `write` into a pending
//! word, and hashing a `str` makes two writes (the bytes, then a `0xff`
//! terminator that keeps composite keys prefix-free). For the 24-byte keys of
//! a typical lock name that bookkeeping cost more than SipHash's rounds. Here
//! a key is hashed in one pass over its bytes ([`SipKey::hash`]): whole
//! little-endian words straight from the slice, the last partial word and the
//! length folded in as the algorithm prescribes, no buffering and no
//! terminator (a table keyed by one string needs none). The output is
//! SipHash-1-3 exactly, checked against published vectors in the tests.
//!
//! [`StrMap`] is a small map over hashbrown's `HashTable` (the table that
//! `HashMap` is built on, with the same layout and probing) that hashes
//! every lookup once, with a [`KeyHasher`].
//!
//! # The AES-round hash
//!
//! SipHash-1-3 of a 24-byte key costs ~157 instructions, a fifth of a whole
//! request. On x86-64 CPUs with the AES instructions (detected at run time
//! when a table is made; nearly every x86-64 server since 2010) a table
//! hashes with AES rounds instead, and keeps SipHash-1-3 as the fallback
//! elsewhere (~38 instructions for the same key, call included). With nine
//! 128-bit round keys `K0..K8` derived from the table's secret [`SipKey`]
//! (SipHash-1-3 under it of a label and the index: pseudo-random and
//! independent-looking, as secret as the key), and `P(x)` the four AES
//! encryption rounds keyed `K1..K4` (`aesenc`: SubBytes, ShiftRows,
//! MixColumns, round key):
//!
//! * the key's bytes become 16-byte blocks: whole blocks from the start,
//!   then, if the length is not a multiple of 16, the last 16 bytes
//!   (overlapping the block before); a key of 1 to 15 bytes is one block of
//!   its first and last 8 bytes, its first and last 4, or its first,
//!   middle and last byte. Given the length, the blocks determine the key;
//! * the state starts at `K0`, and each block is absorbed as
//!   `s = P(s ^ block)`, a CBC-MAC over a 4-round AES;
//! * the length is XORed into the state, four more rounds keyed `K5..K8`
//!   follow, and the low 64 bits are the hash.
//!
//! **Why it resists flooding.** A flood needs many keys whose hashes share
//! their low bits (the bucket), chosen without seeing a single hash: the
//! server never shows one, only, at best, the timing of slower probes.
//! Two keys of the same length differ in some first block; from there
//! their states differ by a difference the attacker cannot see, and a
//! later block can cancel it only if the attacker predicts the output
//! difference of four keyed AES rounds. The best such prediction for
//! four rounds with independent round keys succeeds with probability at
//! most ~2^-113 (the maximum expected differential probability of 4-round
//! AES, Keliher and Sui, 2007); ciphertext-only and chosen-difference
//! attacks on reduced AES (square, impossible-differential) need to see
//! the outputs of the rounds, which the server never shows. Keys of
//! different lengths can be made to reach the same state before the
//! length (an overlapping last block and a first-block difference make
//! that easy), which is why the length goes in last and is followed by
//! four rounds: the two inputs to those rounds then differ by a known
//! constant, and a collision of their outputs again needs a four-round
//! differential. So a hash flood against this hash is as hard as guessing
//! hash values blind, the same footing SipHash stands on; what it gives
//! up is SipHash's published security proof against an attacker who sees
//! the outputs (which are never shown here). The tests check the
//! construction against a byte-by-byte reference with a software AES
//! round (itself checked against FIPS-197), the length, padding and
//! overlap cases that a weaker construction collides on, and the spread
//! of sequential names over buckets and tags.

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::BuildHasher;

use hashbrown::hash_table::{Entry, HashTable, OccupiedEntry, VacantEntry};

/// A secret 128-bit SipHash key. `Debug` does not show it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SipKey {
    k0: u64,
    k1: u64,
}

impl fmt::Debug for SipKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SipKey(..)")
    }
}

/// One SipRound on the four state words.
#[inline(always)]
fn sip_round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13) ^ v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16) ^ v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21) ^ v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17) ^ v[2];
    v[2] = v[2].rotate_left(32);
}

/// The last `b.len() < 8` bytes as a little-endian word, high bytes zero.
/// Three loads at most, no loop and no copy through a buffer.
#[inline(always)]
fn tail_word(b: &[u8]) -> u64 {
    let n = b.len();
    debug_assert!(n < 8);
    let mut w = 0u64;
    let mut i = 0;
    if n >= 4 {
        w = u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        i = 4;
    }
    if n - i >= 2 {
        w |= u64::from(u16::from_le_bytes([b[i], b[i + 1]])) << (8 * i);
        i += 2;
    }
    if i < n {
        w |= u64::from(b[i]) << (8 * i);
    }
    w
}

impl SipKey {
    /// A key from its two halves (the first and last 8 bytes of a 16-byte
    /// key, read little-endian). For tests and reproducible runs; tables
    /// that hold client keys use [`SipKey::random`].
    #[must_use]
    pub const fn from_parts(k0: u64, k1: u64) -> Self {
        SipKey { k0, k1 }
    }

    /// A fresh secret key. Derived from a new standard `RandomState` (two of
    /// its SipHash outputs under its own secret, OS-seeded key), so it is as
    /// unpredictable as the key the standard library's `HashMap` would use,
    /// without a system call or a failure path of its own.
    #[must_use]
    pub fn random() -> Self {
        let state = RandomState::new();
        SipKey {
            k0: state.hash_one(0x7469_636b_6574_6430_u64),
            k1: state.hash_one(0x7469_636b_6574_6431_u64),
        }
    }

    /// SipHash-1-3 of `bytes` under this key, in one pass.
    #[must_use]
    #[inline]
    pub fn hash(&self, bytes: &[u8]) -> u64 {
        // The initial state: the key XORed with "somepseudorandomlygeneratedbytes".
        let mut v = [
            self.k0 ^ 0x736f_6d65_7073_6575,
            self.k1 ^ 0x646f_7261_6e64_6f6d,
            self.k0 ^ 0x6c79_6765_6e65_7261,
            self.k1 ^ 0x7465_6462_7974_6573,
        ];
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let m = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
            v[3] ^= m;
            sip_round(&mut v); // c = 1
            v[0] ^= m;
        }
        // The last word: the remaining bytes, and the length mod 256 in the
        // top byte (the truncating cast is the algorithm's).
        let m = tail_word(words.remainder()) | (bytes.len() as u64) << 56;
        v[3] ^= m;
        sip_round(&mut v);
        v[0] ^= m;
        v[2] ^= 0xff;
        sip_round(&mut v); // d = 3
        sip_round(&mut v);
        sip_round(&mut v);
        v[0] ^ v[1] ^ v[2] ^ v[3]
    }
}

/// How a table hashes its keys: keyed SipHash-1-3, or, on an x86-64 CPU
/// with the AES instructions (detected at run time when the hasher is made),
/// the AES-round hash described in the [module documentation](self), whose
/// round keys are derived from the same secret [`SipKey`]. `Debug` shows
/// which, never the key.
#[derive(Clone, Copy)]
pub struct KeyHasher {
    sip: SipKey,
    #[cfg(target_arch = "x86_64")]
    aes: Option<aes::RoundKeys>,
}

impl fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.uses_aes() {
            "KeyHasher(AES rounds, ..)"
        } else {
            "KeyHasher(SipHash-1-3, ..)"
        })
    }
}

impl KeyHasher {
    /// The hasher for `sip`: the AES-round hash where the CPU has AES,
    /// SipHash-1-3 under `sip` elsewhere.
    #[must_use]
    pub fn new(sip: SipKey) -> Self {
        KeyHasher {
            sip,
            #[cfg(target_arch = "x86_64")]
            aes: aes::RoundKeys::derive(&sip),
        }
    }

    /// SipHash-1-3 under `sip` whatever the CPU has (the fallback, and tests
    /// that compare the two).
    #[must_use]
    pub fn sip_only(sip: SipKey) -> Self {
        KeyHasher {
            sip,
            #[cfg(target_arch = "x86_64")]
            aes: None,
        }
    }

    /// Whether this hasher uses the AES rounds.
    #[must_use]
    pub fn uses_aes(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self.aes.is_some();
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// The hash of `bytes`.
    #[must_use]
    #[inline]
    pub fn hash(&self, bytes: &[u8]) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if let Some(keys) = &self.aes {
            return keys.hash(bytes);
        }
        self.sip.hash(bytes)
    }
}

/// The AES-round keyed hash (x86-64 with AES-NI): see the module
/// documentation for the construction and why it resists flooding.
#[cfg(target_arch = "x86_64")]
mod aes {
    use std::arch::x86_64::{
        __m128i, _mm_aesenc_si128, _mm_cvtsi128_si64, _mm_cvtsi64_si128, _mm_loadu_si128,
        _mm_set_epi64x, _mm_xor_si128,
    };

    use super::SipKey;

    /// Round keys: `K[0]` the initial state, `K[1..=4]` the four rounds of
    /// each block, `K[5..=8]` the four rounds after the length.
    #[derive(Clone, Copy)]
    pub(super) struct RoundKeys(pub(super) [__m128i; 9]);

    impl RoundKeys {
        /// Round keys derived from `sip` (SipHash-1-3 under it of a label and
        /// a counter, 64 bits at a time), if this CPU has AES; `None` if not.
        pub(super) fn derive(sip: &SipKey) -> Option<Self> {
            if !std::arch::is_x86_feature_detected!("aes") {
                return None;
            }
            let word = |i: u8, half: u8| {
                // A reinterpretation of the 64 bits, not a conversion.
                sip.hash(&[b'a', b'e', b's', i, half]) as i64
            };
            // SAFETY: `_mm_set_epi64x` is SSE2, part of the x86-64 baseline.
            let keys = std::array::from_fn(|i| {
                let i = i as u8; // i < 9
                unsafe { _mm_set_epi64x(word(i, 1), word(i, 0)) }
            });
            Some(RoundKeys(keys))
        }

        /// The hash of `bytes` under these keys.
        #[inline]
        pub(super) fn hash(&self, bytes: &[u8]) -> u64 {
            // SAFETY: a `RoundKeys` exists only if `derive` found AES on
            // this CPU (SSE2 is the baseline), which is all `hash_aes`
            // needs.
            unsafe { hash_aes(&self.0, bytes) }
        }
    }

    /// The message as 16-byte blocks, each passed through four AES rounds
    /// after it is XORed into the state (see the module documentation).
    #[target_feature(enable = "aes")]
    unsafe fn hash_aes(k: &[__m128i; 9], bytes: &[u8]) -> u64 {
        let absorb = |s: __m128i, block: __m128i| {
            let mut s = _mm_xor_si128(s, block);
            s = _mm_aesenc_si128(s, k[1]);
            s = _mm_aesenc_si128(s, k[2]);
            s = _mm_aesenc_si128(s, k[3]);
            _mm_aesenc_si128(s, k[4])
        };
        let len = bytes.len();
        let mut s = k[0];
        if len >= 16 {
            let p = bytes.as_ptr();
            let mut at = 0;
            while at + 16 <= len {
                // SAFETY: at + 16 <= len: the 16 bytes lie in `bytes`;
                // unaligned loads are allowed.
                s = absorb(s, unsafe { _mm_loadu_si128(p.add(at).cast()) });
                at += 16;
            }
            if at < len {
                // The last 16 bytes, overlapping the block before (the
                // length, folded in below, makes the split unambiguous).
                // SAFETY: len >= 16, so len - 16 .. len lies in `bytes`.
                s = absorb(s, unsafe { _mm_loadu_si128(p.add(len - 16).cast()) });
            }
        } else if len > 0 {
            s = absorb(s, short_block(bytes));
        }
        // The length, then four more rounds: different lengths never share a
        // last state difference an attacker could choose.
        s = _mm_xor_si128(s, _mm_cvtsi64_si128(len as i64));
        s = _mm_aesenc_si128(s, k[5]);
        s = _mm_aesenc_si128(s, k[6]);
        s = _mm_aesenc_si128(s, k[7]);
        s = _mm_aesenc_si128(s, k[8]);
        // The low 64 bits, reinterpreted.
        _mm_cvtsi128_si64(s) as u64
    }

    /// A key of 1 to 15 bytes as one block: its first and last 8 bytes
    /// (overlapping), 4 bytes, or 1 to 3 single bytes, which, with the
    /// length, determine the key.
    #[inline(always)]
    fn short_block(b: &[u8]) -> __m128i {
        let n = b.len();
        debug_assert!((1..16).contains(&n));
        let le64 = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let le32 =
            |at: usize| u64::from(u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]));
        let (lo, hi) = if n >= 8 {
            (le64(0), le64(n - 8))
        } else if n >= 4 {
            (le32(0), le32(n - 4))
        } else {
            (
                u64::from(b[0]) | u64::from(b[n / 2]) << 8 | u64::from(b[n - 1]) << 16,
                0,
            )
        };
        // SAFETY: SSE2, the x86-64 baseline. The casts reinterpret bits.
        unsafe { _mm_set_epi64x(hi as i64, lo as i64) }
    }
}

/// The longest key a [`KeyStr`] keeps in place; longer keys are boxed.
pub const INLINE_KEY_BYTES: usize = 30;

/// A string as a table entry stores it: up to [`INLINE_KEY_BYTES`] bytes in
/// place, with no allocation of its own, longer ones on the heap. 32 bytes
/// either way (a `Box<str>` is 16, plus the allocation and the allocator's
/// own header, and a pointer to chase on every lookup).
#[derive(Clone)]
pub struct KeyStr(KeyRepr);

#[derive(Clone)]
enum KeyRepr {
    /// The first `len` bytes of `bytes` are the string's (valid UTF-8: they
    /// are copied from a `&str` whole, never changed).
    Inline {
        len: u8,
        bytes: [u8; INLINE_KEY_BYTES],
    },
    Heap(Box<str>),
}

const _: () = assert!(std::mem::size_of::<KeyStr>() == 32);
const _: () = assert!(INLINE_KEY_BYTES <= u8::MAX as usize);

impl KeyStr {
    /// A copy of `s`: in place when it fits, else boxed.
    #[must_use]
    #[inline]
    pub fn new(s: &str) -> Self {
        let b = s.as_bytes();
        if b.len() <= INLINE_KEY_BYTES {
            let mut bytes = [0u8; INLINE_KEY_BYTES];
            bytes[..b.len()].copy_from_slice(b);
            KeyStr(KeyRepr::Inline {
                // Fits: checked just above.
                len: b.len() as u8,
                bytes,
            })
        } else {
            KeyStr(KeyRepr::Heap(s.into()))
        }
    }

    /// The string.
    #[must_use]
    #[inline]
    pub fn as_str(&self) -> &str {
        match &self.0 {
            KeyRepr::Inline { len, bytes } => {
                let b = &bytes[..usize::from(*len)];
                // SAFETY: `new` copied these bytes whole from a `&str` and
                // nothing changes them, so they are valid UTF-8.
                unsafe { std::str::from_utf8_unchecked(b) }
            }
            KeyRepr::Heap(s) => s,
        }
    }

    /// True when the string is kept in place (no allocation of its own).
    #[must_use]
    pub fn is_inline(&self) -> bool {
        matches!(self.0, KeyRepr::Inline { .. })
    }
}

impl From<&str> for KeyStr {
    fn from(s: &str) -> Self {
        KeyStr::new(s)
    }
}

impl Borrow<str> for KeyStr {
    #[inline]
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl std::ops::Deref for KeyStr {
    type Target = str;

    #[inline]
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Debug for KeyStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl PartialEq for KeyStr {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for KeyStr {}

/// Whether two keys are equal. A key of up to 32 bytes (every one a
/// [`KeyStr`] keeps in place) is compared by two overlapping loads from
/// each side, in line; a longer one by the slice comparison. A table
/// lookup that finds its key makes exactly one such comparison, and a call
/// out to `memcmp` for it cost more than the comparison itself.
#[inline(always)]
fn key_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let n = a.len();
    if n != b.len() {
        return false;
    }
    // Each arm reads the first and the last `W` bytes (they overlap when
    // `n < 2 W`), so every byte is compared and none outside the slices.
    macro_rules! two_loads {
        ($t:ty, $w:expr) => {{
            let at = |s: &[u8], i: usize| {
                let mut w = [0u8; $w];
                w.copy_from_slice(&s[i..i + $w]);
                <$t>::from_ne_bytes(w)
            };
            ((at(a, 0) ^ at(b, 0)) | (at(a, n - $w) ^ at(b, n - $w))) == 0
        }};
    }
    match n {
        0 => true,
        1..=3 => a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1],
        4..=7 => two_loads!(u32, 4),
        8..=15 => two_loads!(u64, 8),
        16..=32 => two_loads!(u128, 16),
        _ => a == b,
    }
}

/// A map from string keys (`K` is [`KeyStr`], `Box<str>`, `Arc<str>`, ...) to `V`,
/// looked up by `&str`, hashed by a [`KeyHasher`] under a per-table random
/// [`SipKey`]. Each operation hashes its key at most once;
/// a lookup in an empty map does not hash at all.
pub struct StrMap<K, V> {
    table: HashTable<(K, V)>,
    hasher: KeyHasher,
}

impl<K: Borrow<str>, V: fmt::Debug> fmt::Debug for StrMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.table.iter().map(|(k, v)| (k.borrow(), v)))
            .finish()
    }
}

impl<K: Borrow<str>, V> Default for StrMap<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Borrow<str>, V> StrMap<K, V> {
    /// An empty map with a fresh random key. Does not allocate.
    #[must_use]
    pub fn new() -> Self {
        Self::with_key(SipKey::random())
    }

    /// An empty map hashing under `sip` (tests that need a fixed layout):
    /// with [`KeyHasher::new`], so the AES-round hash where the CPU has AES.
    #[must_use]
    pub fn with_key(sip: SipKey) -> Self {
        Self::with_hasher(KeyHasher::new(sip))
    }

    /// An empty map hashing with `hasher`.
    #[must_use]
    pub fn with_hasher(hasher: KeyHasher) -> Self {
        StrMap {
            table: HashTable::new(),
            hasher,
        }
    }

    /// Entries in the map.
    #[must_use]
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether the map is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    #[inline]
    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash(key.as_bytes())
    }

    /// The stored key and value for `key`.
    #[must_use]
    #[inline]
    pub fn get_key_value(&self, key: &str) -> Option<(&K, &V)> {
        if self.table.is_empty() {
            return None;
        }
        self.table
            .find(self.hash(key), |(k, _)| key_eq(k.borrow(), key))
            .map(|(k, v)| (k, v))
    }

    /// The value for `key`.
    #[must_use]
    #[inline]
    pub fn get(&self, key: &str) -> Option<&V> {
        self.get_key_value(key).map(|(_, v)| v)
    }

    /// Whether `key` is in the map.
    #[must_use]
    #[inline]
    pub fn contains_key(&self, key: &str) -> bool {
        self.get_key_value(key).is_some()
    }

    /// The value for `key`, mutably.
    #[must_use]
    #[inline]
    pub fn get_mut(&mut self, key: &str) -> Option<&mut V> {
        if self.table.is_empty() {
            return None;
        }
        let hash = self.hash(key);
        self.table
            .find_mut(hash, |(k, _)| key_eq(k.borrow(), key))
            .map(|(_, v)| v)
    }

    /// Removes `key`, returning its value.
    #[inline]
    pub fn remove(&mut self, key: &str) -> Option<V> {
        if self.table.is_empty() {
            return None;
        }
        let hash = self.hash(key);
        match self
            .table
            .find_entry(hash, |(k, _)| key_eq(k.borrow(), key))
        {
            Ok(o) => Some(o.remove().0 .1),
            Err(_) => None,
        }
    }

    /// Inserts `key` (which must not be in the map yet: the caller checked)
    /// with `value`.
    #[inline]
    pub fn insert_new(&mut self, key: K, value: V) -> &mut V {
        let hasher = &self.hasher;
        let hash = hasher.hash(key.borrow().as_bytes());
        debug_assert!(self
            .table
            .find(hash, |(k, _)| key_eq(k.borrow(), key.borrow()))
            .is_none());
        let (_, v) = self
            .table
            .insert_unique(hash, (key, value), |(k, _)| {
                hasher.hash(k.borrow().as_bytes())
            })
            .into_mut();
        v
    }

    /// The entry for `key`: one hash for a lookup followed by an update,
    /// an insert or a removal.
    #[inline]
    pub fn entry<'a>(&'a mut self, key: &str) -> StrEntry<'a, K, V> {
        let hasher = &self.hasher;
        let hash = hasher.hash(key.as_bytes());
        match self.table.entry(
            hash,
            |(k, _)| key_eq(k.borrow(), key),
            |(k, _)| hasher.hash(k.borrow().as_bytes()),
        ) {
            Entry::Occupied(o) => StrEntry::Occupied(StrOccupied(o)),
            Entry::Vacant(v) => StrEntry::Vacant(StrVacant(v)),
        }
    }

    /// The entry for `key` if it is in the map: one hash for a lookup that
    /// may be followed by an update or a removal, never an insert (so,
    /// unlike [`StrMap::entry`], it never makes room).
    #[inline]
    pub fn find_entry<'a>(&'a mut self, key: &str) -> Option<StrOccupied<'a, K, V>> {
        if self.table.is_empty() {
            return None;
        }
        let hash = self.hash(key);
        self.table
            .find_entry(hash, |(k, _)| key_eq(k.borrow(), key))
            .ok()
            .map(StrOccupied)
    }

    /// Keeps the entries for which `keep` returns true.
    #[cfg(test)]
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        self.table.retain(|(k, v)| keep(k, v));
    }

    /// Buckets of the table: the range of bucket indices for
    /// [`StrMap::retain_buckets`].
    #[must_use]
    pub fn num_buckets(&self) -> usize {
        self.table.num_buckets()
    }

    /// Keeps the entries in buckets `from..to` (clamped to the table) for
    /// which `keep` returns true, stopping early once `max_removed` entries
    /// are gone: a scan in steps, by bucket index. Returns the index of the
    /// first bucket not visited. A removal never moves another entry, so
    /// the indices of the rest stay put; an insertion may grow or rehash the
    /// table and reorder them.
    pub fn retain_buckets(
        &mut self,
        from: usize,
        to: usize,
        max_removed: usize,
        mut keep: impl FnMut(&K, &mut V) -> bool,
    ) -> usize {
        let end = to.min(self.table.num_buckets());
        let mut removed = 0;
        for i in from..end {
            if removed >= max_removed {
                return i;
            }
            if let Ok(mut entry) = self.table.get_bucket_entry(i) {
                let (k, v) = entry.get_mut();
                if !keep(k, v) {
                    entry.remove();
                    removed += 1;
                }
            }
        }
        end.max(from)
    }

    /// Calls `visit` on the entries in buckets `from..to` (clamped to the
    /// table) and returns the index of the first bucket not visited: a
    /// read-only scan in steps, like [`StrMap::retain_buckets`].
    pub fn visit_buckets(&self, from: usize, to: usize, mut visit: impl FnMut(&K, &V)) -> usize {
        let end = to.min(self.table.num_buckets());
        for i in from..end {
            if let Some((k, v)) = self.table.get_bucket(i) {
                visit(k, v);
            }
        }
        end.max(from)
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.table.iter().map(|(k, v)| (k, v))
    }
}

/// A map entry from [`StrMap::entry`].
pub enum StrEntry<'a, K, V> {
    /// The key is in the map.
    Occupied(StrOccupied<'a, K, V>),
    /// The key is not in the map; a slot for it is found.
    Vacant(StrVacant<'a, K, V>),
}

/// An entry whose key is in the map.
pub struct StrOccupied<'a, K, V>(OccupiedEntry<'a, (K, V)>);

impl<'a, K, V> StrOccupied<'a, K, V> {
    /// The value.
    #[must_use]
    pub fn get(&self) -> &V {
        &self.0.get().1
    }

    /// The value, for as long as the map was borrowed.
    #[must_use]
    pub fn into_mut(self) -> &'a mut V {
        &mut self.0.into_mut().1
    }

    /// Removes the entry, returning its key and value.
    pub fn remove(self) -> (K, V) {
        self.0.remove().0
    }
}

/// An entry whose key is not in the map.
pub struct StrVacant<'a, K, V>(VacantEntry<'a, (K, V)>);

impl<'a, K, V> StrVacant<'a, K, V> {
    /// Inserts `key`, which must equal the key the entry was looked up with.
    pub fn insert(self, key: K, value: V) -> &'a mut V {
        &mut self.0.insert((key, value)).into_mut().1
    }
}

/// A small deterministic generator (xorshift64) for the tests' keys,
/// messages and random inputs.
#[cfg(test)]
pub(crate) fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// `key_eq` agrees with the slice comparison for every length up to
    /// 40 and a difference at every position, in both directions, and for
    /// keys of different lengths that share a prefix.
    #[test]
    fn key_eq_agrees_with_the_slice_comparison() {
        let mut state = 0x5eed_u64;
        let mut checked = 0;
        for n in 0..=40usize {
            let a: String = (0..n)
                .map(|_| char::from(b'!' + (xorshift(&mut state) % 90) as u8))
                .collect();
            assert!(key_eq(&a, &a.clone()));
            for i in 0..n {
                let mut b = a.clone().into_bytes();
                b[i] = if b[i] == b'~' { b'!' } else { b[i] + 1 };
                let b = String::from_utf8(b).unwrap();
                assert!(!key_eq(&a, &b), "length {n}, byte {i}");
                assert!(!key_eq(&b, &a), "length {n}, byte {i}");
                checked += 1;
            }
            for m in 0..=40usize {
                let b: String = a.chars().chain("xyz".chars().cycle()).take(m).collect();
                assert_eq!(key_eq(&a, &b), a == b, "lengths {n} and {m}");
                checked += 1;
            }
        }
        assert!(checked > 2_000);
    }

    /// SipHash-c-d written directly from the paper's description, one byte
    /// at a time and with any number of rounds, to check [`SipKey::hash`]
    /// against something that shares none of its shortcuts.
    fn reference(c: usize, d: usize, k0: u64, k1: u64, msg: &[u8]) -> u64 {
        let mut v = [
            k0 ^ 0x736f6d6570736575,
            k1 ^ 0x646f72616e646f6d,
            k0 ^ 0x6c7967656e657261,
            k1 ^ 0x7465646279746573,
        ];
        // Pad: append zero bytes up to one less than a multiple of 8, then
        // the length mod 256.
        let mut padded = msg.to_vec();
        while padded.len() % 8 != 7 {
            padded.push(0);
        }
        padded.push(msg.len() as u8);
        for block in padded.chunks(8) {
            let mut m = 0u64;
            for (i, &byte) in block.iter().enumerate() {
                m |= u64::from(byte) << (8 * i);
            }
            v[3] ^= m;
            for _ in 0..c {
                sip_round(&mut v);
            }
            v[0] ^= m;
        }
        v[2] ^= 0xff;
        for _ in 0..d {
            sip_round(&mut v);
        }
        v[0] ^ v[1] ^ v[2] ^ v[3]
    }

    /// The paper's key: bytes 00 01 .. 0f.
    const PAPER_K0: u64 = 0x0706050403020100;
    const PAPER_K1: u64 = 0x0f0e0d0c0b0a0908;

    fn counting(n: usize) -> Vec<u8> {
        (0..n).map(|i| i as u8).collect()
    }

    #[test]
    fn the_reference_is_siphash_2_4_as_published() {
        // The paper's appendix: key 00..0f, message 00..0e (15 bytes).
        assert_eq!(
            reference(2, 4, PAPER_K0, PAPER_K1, &counting(15)),
            0xa129ca6149be45e5
        );
        // The first and last of the reference implementation's 64 vectors
        // (message 00..(n-1) for n = 0 and 63).
        assert_eq!(reference(2, 4, PAPER_K0, PAPER_K1, &[]), 0x726fdb47dd0e0e31);
        assert_eq!(
            reference(2, 4, PAPER_K0, PAPER_K1, &counting(63)),
            0x958a324ceb064572
        );
        // And the standard library's (deprecated, stable) SipHash-2-4 on
        // random keys and every length up to 80.
        #[allow(deprecated)]
        fn std_sip24(k0: u64, k1: u64, msg: &[u8]) -> u64 {
            use std::hash::Hasher;
            let mut h = std::hash::SipHasher::new_with_keys(k0, k1);
            h.write(msg);
            h.finish()
        }
        let mut s = 0x9e37_79b9_7f4a_7c15;
        for n in 0..=80 {
            let (k0, k1) = (xorshift(&mut s), xorshift(&mut s));
            let msg: Vec<u8> = (0..n).map(|_| xorshift(&mut s) as u8).collect();
            assert_eq!(
                reference(2, 4, k0, k1, &msg),
                std_sip24(k0, k1, &msg),
                "n={n}"
            );
        }
    }

    #[test]
    fn siphash_1_3_matches_published_vectors() {
        let zero = SipKey::from_parts(0, 0);
        let paper = SipKey::from_parts(PAPER_K0, PAPER_K1);
        let cases: [(SipKey, &[u8], u64); 6] = [
            (zero, b"", 0xd1fba762150c532c),
            (zero, b"test", 0xe0969da9b8fb378d),
            (zero, b"siphash", 0x8264ceeccb16bcbe),
            (zero, b"digest-sip_hash", 0xce31007e34130c0a),
            (zero, &[b'x'; 1000], 0x1b47c0cc4dd21f05),
            (paper, b"", 0xabac0158050fc4dc),
        ];
        for (key, msg, want) in cases {
            assert_eq!(key.hash(msg), want, "{:?}", String::from_utf8_lossy(msg));
            assert_eq!(reference(1, 3, key.k0, key.k1, msg), want);
        }
    }

    #[test]
    fn one_pass_equals_the_reference_at_every_length() {
        let mut s = 0x2545_f491_4f6c_dd1d;
        for n in 0..=300 {
            for _ in 0..4 {
                let (k0, k1) = (xorshift(&mut s), xorshift(&mut s));
                let msg: Vec<u8> = (0..n).map(|_| xorshift(&mut s) as u8).collect();
                let key = SipKey::from_parts(k0, k1);
                assert_eq!(key.hash(&msg), reference(1, 3, k0, k1, &msg), "n={n}");
            }
        }
        // The length byte wraps at 256, as the algorithm says.
        let key = SipKey::from_parts(1, 2);
        let msg = counting(256 + 5);
        assert_eq!(key.hash(&msg), reference(1, 3, 1, 2, &msg));
    }

    /// The AES S-box computed from its definition (the inverse in GF(2^8)
    /// modulo x^8 + x^4 + x^3 + x + 1, then the affine map), not copied.
    fn sbox() -> [u8; 256] {
        fn mul(mut a: u8, mut b: u8) -> u8 {
            let mut p = 0u8;
            while b != 0 {
                if b & 1 != 0 {
                    p ^= a;
                }
                let carry = a & 0x80 != 0;
                a <<= 1;
                if carry {
                    a ^= 0x1b;
                }
                b >>= 1;
            }
            p
        }
        let mut sbox = [0u8; 256];
        for x in 0..=255u8 {
            let inv = if x == 0 {
                0
            } else {
                (1..=255u8).find(|&y| mul(x, y) == 1).unwrap()
            };
            sbox[usize::from(x)] = inv
                ^ inv.rotate_left(1)
                ^ inv.rotate_left(2)
                ^ inv.rotate_left(3)
                ^ inv.rotate_left(4)
                ^ 0x63;
        }
        sbox
    }

    /// One AES encryption round (SubBytes, ShiftRows, MixColumns, then the
    /// round key), byte `i` of the state in row `i % 4`, column `i / 4`:
    /// what `aesenc` computes, written out from FIPS-197.
    fn aes_round(sbox: &[u8; 256], s: [u8; 16], key: [u8; 16]) -> [u8; 16] {
        let xtime = |b: u8| (b << 1) ^ if b & 0x80 != 0 { 0x1b } else { 0 };
        let mut t = [0u8; 16];
        for c in 0..4 {
            for r in 0..4 {
                t[r + 4 * c] = sbox[usize::from(s[r + 4 * ((c + r) % 4)])];
            }
        }
        let mut out = [0u8; 16];
        for c in 0..4 {
            let a = &t[4 * c..4 * c + 4];
            for r in 0..4 {
                let (a0, a1, a2, a3) = (a[r], a[(r + 1) % 4], a[(r + 2) % 4], a[(r + 3) % 4]);
                out[r + 4 * c] = xtime(a0) ^ (xtime(a1) ^ a1) ^ a2 ^ a3 ^ key[r + 4 * c];
            }
        }
        out
    }

    /// The AES-round hash written out byte by byte from the module
    /// documentation, with the software round above.
    fn aes_reference(sip: &SipKey, msg: &[u8]) -> u64 {
        let sbox = sbox();
        let keys: Vec<[u8; 16]> = (0..9u8)
            .map(|i| {
                let mut k = [0u8; 16];
                k[..8].copy_from_slice(&sip.hash(&[b'a', b'e', b's', i, 0]).to_le_bytes());
                k[8..].copy_from_slice(&sip.hash(&[b'a', b'e', b's', i, 1]).to_le_bytes());
                k
            })
            .collect();
        let n = msg.len();
        let mut blocks: Vec<[u8; 16]> = Vec::new();
        let block = |b: &[u8]| <[u8; 16]>::try_from(b).unwrap();
        if n >= 16 {
            blocks.extend(msg.chunks_exact(16).map(block));
            if n % 16 != 0 {
                blocks.push(block(&msg[n - 16..]));
            }
        } else if n >= 8 {
            blocks.push(block(&[&msg[..8], &msg[n - 8..]].concat()));
        } else if n >= 4 {
            blocks.push(block(
                &[&msg[..4], &[0; 4], &msg[n - 4..], &[0; 4]].concat(),
            ));
        } else if n > 0 {
            let mut b = [0u8; 16];
            b[..3].copy_from_slice(&[msg[0], msg[n / 2], msg[n - 1]]);
            blocks.push(b);
        }
        let xor = |a: [u8; 16], b: [u8; 16]| std::array::from_fn(|i| a[i] ^ b[i]);
        let mut s = keys[0];
        for b in blocks {
            s = xor(s, b);
            for k in &keys[1..=4] {
                s = aes_round(&sbox, s, *k);
            }
        }
        let mut len = [0u8; 16];
        len[..8].copy_from_slice(&(n as u64).to_le_bytes());
        s = xor(s, len);
        for k in &keys[5..=8] {
            s = aes_round(&sbox, s, *k);
        }
        u64::from_le_bytes(s[..8].try_into().unwrap())
    }

    #[test]
    fn the_software_aes_round_matches_fips_197() {
        // FIPS-197 appendix B: the state at the start of round 1 and after
        // its MixColumns (the round key is then XORed: here zero).
        let start = [
            0x19, 0x3d, 0xe3, 0xbe, 0xa0, 0xf4, 0xe2, 0x2b, 0x9a, 0xc6, 0x8d, 0x2a, 0xe9, 0xf8,
            0x48, 0x08,
        ];
        let mixed = [
            0x04, 0x66, 0x81, 0xe5, 0xe0, 0xcb, 0x19, 0x9a, 0x48, 0xf8, 0xd3, 0x7a, 0x28, 0x06,
            0x26, 0x4c,
        ];
        assert_eq!(aes_round(&sbox(), start, [0; 16]), mixed);
    }

    #[test]
    fn the_aes_hash_is_the_documented_construction() {
        let sip = SipKey::from_parts(0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908);
        let hasher = KeyHasher::new(sip);
        if !hasher.uses_aes() {
            // This CPU has no AES: the table falls back to SipHash.
            assert_eq!(hasher.hash(b"db"), sip.hash(b"db"));
            return;
        }
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for n in 0..=70 {
            let msg: Vec<u8> = (0..n).map(|_| xorshift(&mut state) as u8).collect();
            assert_eq!(hasher.hash(&msg), aes_reference(&sip, &msg), "n={n}");
        }
        assert_ne!(hasher.hash(b"db"), sip.hash(b"db"));
        assert_eq!(format!("{hasher:?}"), "KeyHasher(AES rounds, ..)");
        let fallback = KeyHasher::sip_only(sip);
        assert_eq!(fallback.hash(b"db"), sip.hash(b"db"));
        assert_eq!(format!("{fallback:?}"), "KeyHasher(SipHash-1-3, ..)");
    }

    #[test]
    fn the_aes_hash_separates_lengths_padding_and_overlaps() {
        // Messages that a construction without the length, or with the
        // length XORed in before the blocks, would collide under every key:
        // zero padding, overlapping last blocks, a first-block difference
        // that cancels a length difference.
        let hasher = KeyHasher::new(SipKey::random());
        let mut msgs: Vec<Vec<u8>> = Vec::new();
        for n in 0..=70usize {
            msgs.push(vec![0; n]);
            msgs.push(vec![b'c'; n]);
            let mut cancel = vec![b'c'; n];
            if let Some(b) = cancel.first_mut() {
                *b ^= (n as u8) ^ ((n + 1) as u8);
            }
            msgs.push(cancel);
            // Every single-bit flip of a random message.
            let mut state = 0x9e37_79b9_7f4a_7c15_u64 ^ n as u64;
            let base: Vec<u8> = (0..n).map(|_| xorshift(&mut state) as u8).collect();
            for bit in 0..8 * n {
                let mut m = base.clone();
                m[bit / 8] ^= 1 << (bit % 8);
                msgs.push(m);
            }
            msgs.push(base);
        }
        msgs.sort();
        msgs.dedup();
        let mut hashes: Vec<u64> = msgs.iter().map(|m| hasher.hash(m)).collect();
        hashes.sort_unstable();
        hashes.dedup();
        assert_eq!(
            hashes.len(),
            msgs.len(),
            "a collision among {} messages",
            msgs.len()
        );
    }

    #[test]
    fn the_key_hashes_spread_sequential_names_over_buckets() {
        // 65,536 names that differ in a few digits, into 4,096 buckets by
        // the low bits (hashbrown's bucket index) and into 128 groups by the
        // top 7 (its tag): each bucket expects 16, each tag 512.
        for hasher in [
            KeyHasher::new(SipKey::random()),
            KeyHasher::sip_only(SipKey::random()),
        ] {
            let mut low = vec![0u32; 4096];
            let mut top = vec![0u32; 128];
            for i in 0..65_536 {
                let h = hasher.hash(format!("tenant-7/lock-{i:08}").as_bytes());
                low[(h & 4095) as usize] += 1;
                top[(h >> 57) as usize] += 1;
            }
            let (lmin, lmax) = (low.iter().min().unwrap(), low.iter().max().unwrap());
            let (tmin, tmax) = (top.iter().min().unwrap(), top.iter().max().unwrap());
            assert!(
                *lmax <= 44 && *lmin >= 1,
                "{hasher:?}: buckets {lmin}..{lmax}"
            );
            assert!(
                *tmax <= 630 && *tmin >= 400,
                "{hasher:?}: tags {tmin}..{tmax}"
            );
        }
    }

    #[test]
    fn random_keys_differ_and_change_the_hash() {
        let a = SipKey::random();
        let b = SipKey::random();
        assert_ne!(a, b);
        assert_ne!(a.hash(b"db"), b.hash(b"db"));
        assert_eq!(format!("{a:?}"), "SipKey(..)");
    }

    #[test]
    fn str_map_behaves_like_a_map() {
        use std::collections::btree_map::Entry::Vacant;
        let mut m: StrMap<Box<str>, u32> = StrMap::new();
        let mut model = std::collections::BTreeMap::new();
        assert!(m.get("a").is_none() && m.remove("a").is_none() && m.is_empty());
        let mut s = 7u64;
        for i in 0..5000u32 {
            let key = format!("k{}", xorshift(&mut s) % 700);
            match xorshift(&mut s) % 5 {
                0 => {
                    assert_eq!(m.remove(&key), model.remove(&key));
                }
                4 => match m.find_entry(&key) {
                    Some(o) => {
                        assert_eq!(Some(o.get()), model.get(&key));
                        assert_eq!(o.remove().1, model.remove(&key).unwrap());
                    }
                    None => assert!(!model.contains_key(&key)),
                },
                1 => match m.entry(&key) {
                    StrEntry::Occupied(o) => {
                        assert_eq!(Some(o.get()), model.get(&key));
                        let (k, v) = o.remove();
                        assert_eq!((&*k, Some(v)), (&*key, model.remove(&key)));
                    }
                    StrEntry::Vacant(v) => {
                        assert!(!model.contains_key(&key));
                        assert_eq!(*v.insert(key.clone().into(), i), i);
                        model.insert(key, i);
                    }
                },
                2 => {
                    if let Some(v) = m.get_mut(&key) {
                        *v += 1;
                        *model.get_mut(&key).unwrap() += 1;
                    } else if let Vacant(e) = model.entry(key.clone()) {
                        m.insert_new(key.into(), i);
                        e.insert(i);
                    }
                }
                _ => {
                    assert_eq!(m.get(&key), model.get(&key));
                    assert_eq!(m.contains_key(&key), model.contains_key(&key));
                }
            }
            assert_eq!(m.len(), model.len());
        }
        m.retain(|k, v| k.len() % 2 == 0 || *v % 3 == 0);
        model.retain(|k, v| k.len() % 2 == 0 || *v % 3 == 0);
        let mut got: Vec<(String, u32)> = m.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        got.sort();
        let want: Vec<(String, u32)> = model.into_iter().collect();
        assert_eq!(got, want);
    }

    #[test]
    fn key_str_keeps_short_keys_in_place_and_long_ones_boxed() {
        for n in [0, 1, 7, 8, 24, INLINE_KEY_BYTES, INLINE_KEY_BYTES + 1, 200] {
            let s: String = "é".repeat(n / 2) + &"k".repeat(n % 2);
            let k = KeyStr::new(&s);
            assert_eq!(k.as_str(), s, "n={n}");
            assert_eq!(&*k, s.as_str());
            assert_eq!(format!("{k:?}"), format!("{s:?}"));
            assert_eq!(k.is_inline(), s.len() <= INLINE_KEY_BYTES, "n={n}");
            assert_eq!(k.clone(), k);
        }
        assert_ne!(KeyStr::new("a"), KeyStr::new("b"));
        let mut m: StrMap<KeyStr, u8> = StrMap::new();
        let long = "x".repeat(100);
        m.insert_new(KeyStr::new("db"), 1);
        m.insert_new(KeyStr::new(&long), 2);
        assert_eq!(
            (m.get("db"), m.get(&long), m.get("d")),
            (Some(&1), Some(&2), None)
        );
    }

    #[test]
    fn str_map_takes_shared_keys() {
        let mut m: StrMap<Arc<str>, u8> = StrMap::with_key(SipKey::from_parts(3, 4));
        m.insert_new(Arc::from("q"), 1);
        let (k, v) = m.get_key_value("q").unwrap();
        assert_eq!((&**k, *v), ("q", 1));
        assert_eq!(format!("{m:?}"), r#"{"q": 1}"#);
    }
}

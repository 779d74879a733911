//! Keyed hashing of lock names, and the string-keyed table the engine keeps
//! them in.
//!
//! Keys are chosen by network clients, so the engine's tables must not let a
//! client predict which keys collide: a "hash flood" of keys that share a
//! bucket would turn every lookup into a scan of one long probe sequence.
//! So every table's hash is keyed with a secret drawn afresh when the table
//! is made, from the standard library's `RandomState` (seeded from the
//! operating system's random source): collisions depend on that secret, so
//! they cannot be precomputed, and the server never shows a hash value from
//! which to learn it.
//!
//! [`StrMap`], a small map over hashbrown's `HashTable` (the table that
//! `HashMap` is built on), hashes every key once per operation with
//! foldhash (its `quality` variant, the hash hashbrown itself uses by
//! default), seeded from the table's [`SipKey`]: the 64-bit per-table seed
//! and the shared seed foldhash expands from another 64 bits. foldhash is
//! built for hash tables: a handful of multiplies for a lock-sized key, its
//! seeds make the bucket of a key unpredictable to a client that sees no
//! hash, and it makes no claim beyond that (no cryptographic strength), which
//! is all a table whose hashes never leave the process needs. The
//! deterministic simulations key their tables with a fixed [`SipKey`] so
//! that a seed replays exactly.
//!
//! [`SipKey::hash`] is SipHash-1-3 (the `siphasher` crate), for what must
//! stay the same on every node and in every build, such as the holder
//! number of an identity: foldhash's output may change between its
//! versions, SipHash's is fixed by its specification (checked against
//! published vectors in the tests).

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};

use foldhash::SharedSeed;
use hashbrown::hash_table::{Entry, HashTable, OccupiedEntry, VacantEntry};

/// A secret 128-bit key: the seed of a table's hash, or a SipHash key.
/// `Debug` does not show it.
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

impl SipKey {
    /// A key from its two halves (the first and last 8 bytes of a 16-byte
    /// key, read little-endian). For fixed keys and reproducible runs;
    /// tables that hold client keys use [`SipKey::random`].
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

    /// SipHash-1-3 of `bytes` under this key: the same in every build.
    #[must_use]
    pub fn hash(&self, bytes: &[u8]) -> u64 {
        let mut h = siphasher::sip::SipHasher13::new_with_keys(self.k0, self.k1);
        h.write(bytes);
        h.finish()
    }
}

/// How a [`StrMap`] hashes its keys: foldhash, seeded from the table's
/// [`SipKey`]. `Debug` does not show the seeds.
#[derive(Clone)]
struct TableHasher {
    per_table: u64,
    shared: SharedSeed,
}

impl fmt::Debug for TableHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TableHasher(..)")
    }
}

impl TableHasher {
    fn new(key: SipKey) -> Self {
        TableHasher {
            per_table: key.k0,
            shared: SharedSeed::from_u64(key.k1),
        }
    }

    /// The hash of a key's bytes (its length included).
    #[inline]
    fn hash(&self, bytes: &[u8]) -> u64 {
        let mut h = foldhash::quality::FoldHasher::with_seed(self.per_table, &self.shared);
        h.write(bytes);
        h.finish()
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
/// looked up by `&str`, hashed by foldhash seeded from a per-table random
/// [`SipKey`]. Each operation hashes its key at most once;
/// a lookup in an empty map does not hash at all.
pub struct StrMap<K, V> {
    table: HashTable<(K, V)>,
    hasher: TableHasher,
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

    /// An empty map whose hash is seeded from `key` (a fixed key gives a
    /// fixed layout, for reproducible runs). Does not allocate.
    #[must_use]
    pub fn with_key(key: SipKey) -> Self {
        StrMap {
            table: HashTable::new(),
            hasher: TableHasher::new(key),
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

    /// The stored key and value for `key`. The test for an empty map is
    /// always in line, so a lookup in a table that is empty (the queue
    /// map while nobody waits, the mutex table while only permits are
    /// held) costs no call.
    #[must_use]
    #[inline(always)]
    pub fn get_key_value(&self, key: &str) -> Option<(&K, &V)> {
        if self.table.is_empty() {
            return None;
        }
        self.find_key_value(key)
    }

    /// [`StrMap::get_key_value`] in a map that is not empty.
    #[inline]
    fn find_key_value(&self, key: &str) -> Option<(&K, &V)> {
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

    /// Looks `key` up once: its hash, and its bucket if it is in the map.
    /// [`StrMap::get_bucket`], [`StrMap::get_bucket_mut`] and
    /// [`StrMap::insert_probed`] then reach the key without hashing it
    /// again, so long as nothing is inserted into the map in between (an
    /// insertion may move every entry; a removal moves none).
    #[must_use]
    #[inline(always)]
    pub fn probe(&self, key: &str) -> Probe {
        let hash = self.hash(key);
        let bucket = if self.table.is_empty() {
            None
        } else {
            self.table
                .find_bucket_index(hash, |(k, _)| key_eq(k.borrow(), key))
        };
        Probe { hash, bucket }
    }

    /// The value in bucket `bucket` (from a [`Probe`]), if one is there.
    #[must_use]
    #[inline]
    pub fn get_bucket(&self, bucket: usize) -> Option<&V> {
        self.table.get_bucket(bucket).map(|(_, v)| v)
    }

    /// The value in bucket `bucket` (from a [`Probe`]), mutably.
    #[must_use]
    #[inline]
    pub fn get_bucket_mut(&mut self, bucket: usize) -> Option<&mut V> {
        self.table.get_bucket_mut(bucket).map(|(_, v)| v)
    }

    /// Inserts `key`, which `probe` found absent, with `value`: no second
    /// hash of the key.
    #[inline]
    pub fn insert_probed(&mut self, probe: Probe, key: K, value: V) -> &mut V {
        debug_assert!(probe.bucket.is_none());
        debug_assert_eq!(probe.hash, self.hash(key.borrow()));
        let hasher = &self.hasher;
        let (_, v) = self
            .table
            .insert_unique(probe.hash, (key, value), |(k, _)| {
                hasher.hash(k.borrow().as_bytes())
            })
            .into_mut();
        v
    }

    /// Keeps the entries for which `keep` returns true.
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

/// A key looked up in a [`StrMap`] ([`StrMap::probe`]): its hash and
/// where it is, if it is there. Valid for that map until something is
/// inserted into it.
#[derive(Clone, Copy, Debug)]
pub struct Probe {
    hash: u64,
    bucket: Option<usize>,
}

impl Probe {
    /// The key's bucket, if the key was in the map.
    #[must_use]
    #[inline]
    pub fn bucket(&self) -> Option<usize> {
        self.bucket
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

    /// The value, mutably.
    #[must_use]
    pub fn get_mut(&mut self) -> &mut V {
        &mut self.0.get_mut().1
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

    /// A probe finds what `get` finds, reaches it by bucket, and inserts
    /// an absent key where `get` then finds it, through growth of the
    /// table; an empty table's probe finds nothing.
    #[test]
    fn a_probe_reaches_what_get_finds_and_inserts_what_it_missed() {
        let mut m: StrMap<KeyStr, u32> = StrMap::with_key(SipKey::from_parts(3, 4));
        assert!(m.probe("k0").bucket().is_none());
        for i in 0..200u32 {
            let key = format!("key-{i}-{}", "x".repeat(i as usize % 40));
            let p = m.probe(&key);
            assert!(p.bucket().is_none(), "{key} before its insert");
            *m.insert_probed(p, KeyStr::new(&key), i) += 1_000;
            let p = m.probe(&key);
            let b = p.bucket().expect("found after its insert");
            assert_eq!(m.get_bucket(b), Some(&(i + 1_000)));
            *m.get_bucket_mut(b).unwrap() += 1;
            assert_eq!(m.get(&key), Some(&(i + 1_001)));
        }
        for i in (0..200u32).step_by(3) {
            let key = format!("key-{i}-{}", "x".repeat(i as usize % 40));
            assert_eq!(m.remove(&key), Some(i + 1_001));
            assert!(m.probe(&key).bucket().is_none());
        }
        assert_eq!(m.len(), 200 - 67);
    }

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

    /// The paper's key: bytes 00 01 .. 0f.
    const PAPER_K0: u64 = 0x0706050403020100;
    const PAPER_K1: u64 = 0x0f0e0d0c0b0a0908;

    /// [`SipKey::hash`] is SipHash-1-3 as published, so what it numbers
    /// (an identity's holder) stays the same in every build.
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
        }
    }

    /// Keys that a hash without the length, or with a weak mix of the last
    /// bytes, would collide under every seed: zero padding, runs of one
    /// byte, a first byte changed with the length, every single-bit flip
    /// of a random key. None collide.
    #[test]
    fn the_table_hash_separates_lengths_padding_and_bit_flips() {
        let hasher = TableHasher::new(SipKey::random());
        let mut msgs: Vec<Vec<u8>> = Vec::new();
        for n in 0..=70usize {
            msgs.push(vec![0; n]);
            msgs.push(vec![b'c'; n]);
            let mut cancel = vec![b'c'; n];
            if let Some(b) = cancel.first_mut() {
                *b ^= (n as u8) ^ ((n + 1) as u8);
            }
            msgs.push(cancel);
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

    /// The seed is the whole key: the same key gives the same hashes (a
    /// simulation replays), a key that differs in either half gives others.
    #[test]
    fn the_table_hash_follows_both_halves_of_its_key() {
        let hash = |k0, k1| {
            let h = TableHasher::new(SipKey::from_parts(k0, k1));
            (0..64)
                .map(|i| h.hash(format!("lock-{i}").as_bytes()))
                .collect::<Vec<u64>>()
        };
        assert_eq!(hash(1, 2), hash(1, 2));
        assert_ne!(hash(1, 2), hash(3, 2));
        assert_ne!(hash(1, 2), hash(1, 3));
        let (a, b) = (hash(1, 2), hash(1, 3));
        assert!(
            a.iter().zip(&b).all(|(x, y)| x != y),
            "a key half changed nothing"
        );
        assert_eq!(
            format!("{:?}", TableHasher::new(SipKey::from_parts(1, 2))),
            "TableHasher(..)"
        );
    }

    #[test]
    fn the_key_hashes_spread_sequential_names_over_buckets() {
        // 65,536 names that differ in a few digits, into 4,096 buckets by
        // the low bits (hashbrown's bucket index) and into 128 groups by the
        // top 7 (its tag): each bucket expects 16, each tag 512.
        for hasher in [
            TableHasher::new(SipKey::random()),
            TableHasher::new(SipKey::from_parts(0, 0)),
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

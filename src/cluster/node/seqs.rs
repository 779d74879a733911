//! The node's client-request bookkeeping, keyed by sequence number and by
//! log index.
//!
//! Sequence numbers are handed out by the node in increasing order
//! (`Node::next_seq`), and a leader appends proposals at increasing log
//! indices, so ordered trees are more than these lookups need:
//!
//! - [`SeqMap`]: the pending requests by sequence, a hash map with a
//!   one-multiply hasher ([`SeqHasher`]) that shrinks after a burst
//!   ([`shrink`]).
//! - [`SeqSet`]: the sequences not yet applied, a sorted deque with "gone"
//!   marks; the lowest live sequence, the live count and ordered iteration.
//! - [`ByIndex`]: log index -> (term, sequence) of this node's proposals, a
//!   sorted deque; [`ByIndex::take_upto`] takes the entry at an applied
//!   index and drops every lower one.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// Hashes a `u64` sequence number with one multiply.
///
/// Sequence numbers are node-local counters, never chosen by a client, so
/// hash flooding is not a concern here.
#[derive(Default, Clone, Copy)]
pub(super) struct SeqHasher(u64);

impl Hasher for SeqHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used for `u64` keys; this keeps the hasher
        // total for any other key.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        // The high bits of the product select the bucket (hashbrown takes
        // the top 7 bits as the tag and the low bits as the position), so
        // fold them down.
        let h = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 32);
    }
}

/// A map keyed by sequence number.
pub(super) type SeqMap<V> = HashMap<u64, V, BuildHasherDefault<SeqHasher>>;

/// Capacity below which [`shrink`] leaves a map alone.
const SHRINK_FLOOR: usize = 1024;

/// Shrinks `map` once it holds less than a quarter of its capacity (and
/// that capacity is above [`SHRINK_FLOOR`]), so a burst does not keep a
/// large table forever. The new capacity is under 4 × len (or under the
/// floor), so the next removal does not shrink again.
pub(super) fn shrink<V>(map: &mut SeqMap<V>) {
    let cap = map.capacity();
    let len = map.len();
    if cap > SHRINK_FLOOR && len * 4 < cap {
        map.shrink_to((len + len / 2).max(SHRINK_FLOOR / 2));
    }
}

/// A set of sequence numbers inserted in increasing order: a deque sorted
/// by sequence, each with a "gone" mark once removed and not yet dropped.
#[derive(Default)]
pub(super) struct SeqSet {
    seqs: VecDeque<(u64, bool)>,
    live: usize,
}

impl SeqSet {
    /// Adds `seq`, which must be above every sequence added before (those
    /// removed included); a lower or equal one is inserted in order (or
    /// revived) all the same.
    pub(super) fn insert(&mut self, seq: u64) {
        match self.seqs.back() {
            Some(&(last, _)) if last >= seq => self.insert_slow(seq),
            _ => {
                self.seqs.push_back((seq, false));
                self.live += 1;
            }
        }
    }

    #[cold]
    fn insert_slow(&mut self, seq: u64) {
        match self.find(seq) {
            Ok(i) => {
                if self.seqs[i].1 {
                    self.seqs[i].1 = false;
                    self.live += 1;
                }
            }
            Err(i) => {
                self.seqs.insert(i, (seq, false));
                self.live += 1;
            }
        }
    }

    /// Removes `seq`; whether it was there.
    pub(super) fn remove(&mut self, seq: u64) -> bool {
        let Ok(i) = self.find(seq) else {
            return false;
        };
        if self.seqs[i].1 {
            return false;
        }
        self.seqs[i].1 = true;
        self.live -= 1;
        while self.seqs.front().is_some_and(|&(_, gone)| gone) {
            self.seqs.pop_front();
        }
        if self.seqs.len() > 2 * self.live + 33 {
            // Drop every entry marked gone.
            self.seqs.retain(|&(_, gone)| !gone);
        }
        true
    }

    /// The lowest sequence in the set.
    pub(super) fn first(&self) -> Option<u64> {
        // Gone entries at the front are always dropped (`remove`).
        debug_assert!(self.seqs.front().is_none_or(|&(_, gone)| !gone));
        self.seqs.front().map(|&(s, _)| s)
    }

    /// How many sequences are in the set.
    pub(super) fn len(&self) -> usize {
        self.live
    }

    /// Whether `seq` is in the set.
    #[cfg(test)]
    pub(super) fn contains(&self, seq: u64) -> bool {
        self.find(seq).is_ok_and(|i| !self.seqs[i].1)
    }

    /// The sequences in the set, in increasing order.
    pub(super) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.seqs
            .iter()
            .filter(|&&(_, gone)| !gone)
            .map(|&(s, _)| s)
    }

    fn find(&self, seq: u64) -> Result<usize, usize> {
        self.seqs.binary_search_by_key(&seq, |&(s, _)| s)
    }
}

/// Log index -> (term, sequence) of this node's proposals, sorted by index.
#[derive(Default)]
pub(super) struct ByIndex {
    entries: VecDeque<(u64, u64, u64)>,
}

impl ByIndex {
    /// Records that proposal `seq` was placed at `index` in `term`,
    /// replacing what was recorded at `index`.
    pub(super) fn insert(&mut self, index: u64, term: u64, seq: u64) {
        match self.entries.back() {
            Some(&(last, _, _)) if last >= index => {
                match self.entries.binary_search_by_key(&index, |&(i, _, _)| i) {
                    Ok(i) => self.entries[i] = (index, term, seq),
                    Err(i) => self.entries.insert(i, (index, term, seq)),
                }
            }
            _ => self.entries.push_back((index, term, seq)),
        }
    }

    /// The (term, sequence) recorded at `index`, if any; every entry at
    /// `index` or below is dropped.
    pub(super) fn take_upto(&mut self, index: u64) -> Option<(u64, u64)> {
        let mut here = None;
        while let Some(&(i, term, seq)) = self.entries.front() {
            if i > index {
                break;
            }
            if i == index {
                here = Some((term, seq));
            }
            self.entries.pop_front();
        }
        here
    }

    /// How many entries are recorded.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::xorshift;
    use std::collections::{BTreeMap, BTreeSet};

    #[test]
    fn seq_set_matches_btreeset() {
        for round in 0..300u64 {
            let mut rng = 0x9E37_79B9_7F4A_7C15 ^ (round + 1);
            let mut set = SeqSet::default();
            let mut model = BTreeSet::new();
            let mut next = 1u64;
            let span = 1 + xorshift(&mut rng) % 200;
            for _ in 0..2000 {
                let r = xorshift(&mut rng) % 100;
                if r < 45 {
                    set.insert(next);
                    model.insert(next);
                    next += 1 + xorshift(&mut rng) % 3;
                } else if r < 47 && next > 1 {
                    // Out of order, as the set allows.
                    let s = 1 + xorshift(&mut rng) % next;
                    set.insert(s);
                    model.insert(s);
                } else {
                    // Mostly recent sequences, sometimes old or absent ones.
                    let back = xorshift(&mut rng) % span.min(next);
                    let s = next - back;
                    assert_eq!(set.remove(s), model.remove(&s));
                }
                assert_eq!(set.len(), model.len());
                assert_eq!(set.first(), model.first().copied());
                let probe = xorshift(&mut rng) % (next + 2);
                assert_eq!(set.contains(probe), model.contains(&probe));
                assert!(set.seqs.len() <= 2 * set.live + 33);
            }
            assert!(set.iter().eq(model.iter().copied()));
            for s in model.iter().copied().collect::<Vec<_>>() {
                assert!(set.remove(s));
                model.remove(&s);
                assert_eq!(set.first(), model.first().copied());
            }
            assert_eq!(set.len(), 0);
            assert!(set.seqs.is_empty());
        }
    }

    #[test]
    fn seq_set_compacts_when_the_front_stays() {
        let mut set = SeqSet::default();
        for s in 1..=1000 {
            set.insert(s);
        }
        // The lowest stays, so nothing is popped from the front.
        for s in 2..=1000 {
            assert!(set.remove(s));
            assert!(set.seqs.len() <= 2 * set.len() + 33);
        }
        assert_eq!(set.len(), 1);
        assert_eq!(set.first(), Some(1));
        assert!(set.iter().eq([1]));
    }

    #[test]
    fn by_index_matches_btreemap() {
        for round in 0..300u64 {
            let mut rng = 0xD1B5_4A32_D192_ED03 ^ (round + 1);
            let mut by = ByIndex::default();
            let mut model: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
            let mut next = 1u64;
            let mut applied = 0u64;
            for _ in 0..1000 {
                let r = xorshift(&mut rng) % 100;
                if r < 50 {
                    let (i, t, s) = (next, xorshift(&mut rng) % 5, xorshift(&mut rng));
                    by.insert(i, t, s);
                    model.insert(i, (t, s));
                    next += 1 + xorshift(&mut rng) % 2;
                } else if r < 60 && next > applied + 1 {
                    // Out of order: a new leader's index below earlier
                    // ones, sometimes equal to one recorded.
                    let i = applied + 1 + xorshift(&mut rng) % (next - applied - 1);
                    let (t, s) = (xorshift(&mut rng) % 5, xorshift(&mut rng));
                    by.insert(i, t, s);
                    model.insert(i, (t, s));
                } else {
                    applied = (applied + xorshift(&mut rng) % 3).min(next);
                    let here = model.remove(&applied);
                    model.retain(|&i, _| i > applied);
                    assert_eq!(by.take_upto(applied), here);
                }
                assert_eq!(by.len(), model.len());
                assert!(by
                    .entries
                    .iter()
                    .map(|&(i, t, s)| (i, (t, s)))
                    .eq(model.iter().map(|(&i, &v)| (i, v))));
            }
        }
    }

    #[test]
    fn seq_map_shrinks_after_a_burst() {
        let mut map: SeqMap<u64> = SeqMap::default();
        for s in 0..100_000 {
            map.insert(s, s);
        }
        let big = map.capacity();
        for s in 0..99_990 {
            map.remove(&s);
            shrink(&mut map);
        }
        assert!(map.capacity() < big / 8);
        for s in 99_990..100_000 {
            assert_eq!(map.get(&s), Some(&s));
        }
    }
}

//! Fresh acquire owners (PROTOCOL §3): unique within the process, unlikely to
//! collide across processes.
//!
//! An owner is `mix(base + n)`: `base` is 64 random bits drawn once per
//! process, `n` a process-wide counter. `mix` is a bijection on `u64`, so two
//! calls in one process never share an owner (until 2^64 calls), and two
//! processes collide only if their random bases happen to fall within a call
//! count of each other. Mixing spreads consecutive owners over the whole range,
//! which keeps server-side logs and hash maps from seeing long runs.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

static BASE: OnceLock<u64> = OnceLock::new();
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh owner for one acquire call.
#[must_use]
pub fn next_owner() -> u64 {
    let base = *BASE.get_or_init(process_base);
    mix(base.wrapping_add(COUNTER.fetch_add(1, Ordering::Relaxed)))
}

/// 64 random bits: the kernel's generator, or, where it cannot be read,
/// std's randomly keyed hasher over the time, the process id and an address.
fn process_base() -> u64 {
    let mut bytes = [0u8; 8];
    let urandom = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if urandom.is_ok() {
        return u64::from_ne_bytes(bytes);
    }
    let mut h = RandomState::new().build_hasher();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(now);
    h.write_u32(std::process::id());
    h.write_usize(&bytes as *const _ as usize);
    h.finish()
}

/// The splitmix64 finaliser: a bijection, so distinct inputs stay distinct.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn owners_are_unique_across_threads() {
        let handles: Vec<_> = (0..4)
            .map(|_| std::thread::spawn(|| (0..20_000).map(|_| next_owner()).collect::<Vec<_>>()))
            .collect();
        let mut seen = HashSet::new();
        for h in handles {
            for o in h.join().unwrap() {
                assert!(seen.insert(o), "owner {o:#x} issued twice");
            }
        }
        assert_eq!(seen.len(), 80_000);
    }

    #[test]
    fn consecutive_owners_are_spread_over_the_range() {
        let a = next_owner();
        let b = next_owner();
        assert!(
            (a ^ b).count_ones() > 8,
            "{a:#x} and {b:#x} look sequential"
        );
    }

    #[test]
    fn mix_is_injective_on_a_sample() {
        let mut seen = HashSet::new();
        for i in 0..10_000u64 {
            assert!(seen.insert(mix(i)));
            assert!(seen.insert(mix(u64::MAX - i)));
        }
    }

    #[test]
    fn the_process_base_is_not_a_constant() {
        // Two draws agreeing on all 64 bits would mean no randomness at all.
        assert_ne!(process_base(), process_base());
    }
}

//! A tiny deterministic PRNG (SplitMix64) for Raft's election-timeout
//! draws, so a seed reproduces a run exactly. Internal; with the `testkit`
//! feature it is public, and `ticketd_testkit::rng`, from which the tests'
//! simulations and fault schedules draw, is this generator.

/// SplitMix64: 64 bits of state, good statistical quality, no dependency.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator from `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `[lo, hi)`; `lo` when the range is empty.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo)
    }

    /// A number in `[0, n)`; 0 when `n` is 0.
    #[cfg(any(test, feature = "testkit"))]
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// True with probability `p` (0.0..=1.0).
    #[cfg(any(test, feature = "testkit"))]
    pub fn chance(&mut self, p: f64) -> bool {
        // 53 random bits as a fraction in [0, 1).
        let f = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        f < p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_ranges_hold() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut seen = [false; 5];
        for _ in 0..1000 {
            let v = a.range(10, 15);
            assert!((10..15).contains(&v));
            seen[(v - 10) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(a.range(3, 3), 3);
        assert_ne!(SplitMix64::new(1).next_u64(), SplitMix64::new(2).next_u64());
        let y = a.below(5);
        assert!(y < 5);
        assert_eq!(a.below(0), 0);
        assert!(!a.chance(0.0));
        assert!(a.chance(1.0));
    }

    #[test]
    fn the_first_value_of_seed_zero_is_splitmix64s() {
        // The reference sequence of SplitMix64 from state 0.
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }
}

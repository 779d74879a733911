//! A fixed-size latency histogram with bounded relative error.
//!
//! Values (nanoseconds) are kept in log-linear buckets: below 64 every value
//! has its own bucket; above, each power of two is split into 32 buckets, so a
//! reported percentile is within 1/32 (about 3 %) of the true value. The
//! histogram is a flat array of counters: recording is a few instructions and
//! never allocates, which matters because the load generator records one value
//! per request on the same machine that runs the server under test.

/// Sub-buckets per power of two (5 bits of mantissa).
const SUB: u64 = 32;
/// Buckets needed to cover every `u64`.
const BUCKETS: usize = (64 - 5 + 1) * SUB as usize;

/// A latency histogram over `u64` nanosecond values.
#[derive(Clone)]
pub struct Histogram {
    counts: Box<[u64; BUCKETS]>,
    total: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("total", &self.total)
            .field("max", &self.max)
            .finish()
    }
}

fn bucket_of(v: u64) -> usize {
    if v < 2 * SUB {
        return v as usize;
    }
    let msb = 63 - u64::from(v.leading_zeros());
    let shift = msb - 5;
    ((shift + 1) * SUB + ((v >> shift) - SUB)) as usize
}

/// The largest value that falls into bucket `b`.
fn bucket_high(b: usize) -> u64 {
    let b = b as u64;
    if b < 2 * SUB {
        return b;
    }
    let shift = b / SUB - 1;
    let mantissa = b % SUB + SUB;
    // The bucket holds [mantissa << shift, (mantissa + 1) << shift).
    ((mantissa + 1) << shift).wrapping_sub(1)
}

impl Histogram {
    /// An empty histogram.
    #[must_use]
    pub fn new() -> Self {
        Histogram {
            counts: Box::new([0; BUCKETS]),
            total: 0,
            max: 0,
        }
    }

    /// Records one value.
    #[inline]
    pub fn record(&mut self, v: u64) {
        self.counts[bucket_of(v)] += 1;
        self.total += 1;
        if v > self.max {
            self.max = v;
        }
    }

    /// Number of values recorded.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The largest value recorded (exact), 0 when empty.
    #[must_use]
    pub fn max(&self) -> u64 {
        self.max
    }

    /// Adds every value of `other` to `self`.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += *b;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
    }

    /// Forgets every value (end of the warm-up).
    pub fn clear(&mut self) {
        self.counts.fill(0);
        self.total = 0;
        self.max = 0;
    }

    /// The value at quantile `q` (0.0..=1.0): the upper edge of the bucket
    /// holding the `ceil(q * count)`-th smallest value, capped at the exact
    /// maximum. 0 when empty.
    #[must_use]
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let q = q.clamp(0.0, 1.0);
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0u64;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return bucket_high(b).min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_ordered() {
        let mut last = 0;
        for v in (0..5000u64).chain([1 << 20, (1 << 20) + 1, u64::MAX / 3, u64::MAX]) {
            let b = bucket_of(v);
            assert!(b < BUCKETS, "value {v} bucket {b}");
            assert!(v <= bucket_high(b), "value {v} above its bucket edge");
            if b > 0 {
                assert!(v > bucket_high(b - 1), "value {v} belongs lower");
            }
            assert!(b >= last || v > 5000);
            last = b;
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn small_values_are_exact() {
        let mut h = Histogram::new();
        for v in 1..=50 {
            h.record(v);
        }
        assert_eq!(h.quantile(0.5), 25);
        assert_eq!(h.quantile(0.99), 50);
        assert_eq!(h.quantile(0.0), 1);
        assert_eq!(h.count(), 50);
    }

    #[test]
    fn percentiles_of_a_uniform_spread_are_within_the_bucket_error() {
        let mut h = Histogram::new();
        // 1 µs .. 100 ms in 1 µs steps.
        for us in 1..=100_000u64 {
            h.record(us * 1000);
        }
        for (q, want) in [
            (0.5, 50_000_000u64),
            (0.99, 99_000_000),
            (0.999, 99_900_000),
        ] {
            let got = h.quantile(q);
            let err = (got as f64 - want as f64).abs() / want as f64;
            assert!(err <= 1.0 / 32.0, "q {q}: got {got}, want {want}");
            assert!(got >= want, "upper edge must not under-report");
        }
        assert_eq!(h.quantile(1.0), 100_000_000);
    }

    #[test]
    fn merge_and_clear() {
        let mut a = Histogram::new();
        let mut b = Histogram::new();
        a.record(10);
        b.record(1_000_000);
        b.record(2_000_000);
        a.merge(&b);
        assert_eq!(a.count(), 3);
        assert_eq!(a.max(), 2_000_000);
        assert_eq!(a.quantile(0.34), bucket_high(bucket_of(1_000_000)));
        a.clear();
        assert_eq!((a.count(), a.quantile(0.5)), (0, 0));
    }
}

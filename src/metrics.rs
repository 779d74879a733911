//! Counters and histograms for the admin port's `GET /metrics`, and the
//! Prometheus text exposition format (version 0.0.4) they are written in.
//!
//! Counting sits on the hot path, so it is plain integer arithmetic on
//! fields the loop owns: no atomics (one thread), no allocation, no
//! per-key labels. A [`Histogram`] is a fixed array of bucket counts in
//! whole milliseconds; an observation is a short scan of at most
//! [`MAX_BUCKETS`] bounds and two additions. Text is produced only when
//! the admin port is scraped ([`Exposition`]).

use std::collections::VecDeque;
use std::fmt::Write as _;

use crate::time::Millis;

/// The most finite buckets a [`Histogram`] has.
pub const MAX_BUCKETS: usize = 16;

/// Bucket bounds of `ticketd_wait_seconds` (request to grant), in ms:
/// waits last at most 255 s on the wire.
pub const WAIT_BOUNDS_MS: &[u64] = &[
    1, 5, 10, 50, 100, 500, 1_000, 5_000, 10_000, 30_000, 60_000, 120_000, 255_000,
];

/// Bucket bounds of `ticketd_hold_seconds` (grant to release or expiry),
/// in ms: extensions let a grant run for hours.
pub const HOLD_BOUNDS_MS: &[u64] = &[
    10, 100, 1_000, 5_000, 10_000, 30_000, 60_000, 300_000, 900_000, 3_600_000, 14_400_000,
    86_400_000,
];

/// Bucket bounds of `ticketd_wal_fsync_seconds`, in microseconds.
pub const FSYNC_BOUNDS_US: &[u64] = &[
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 5_000_000,
];

const _: () = assert!(WAIT_BOUNDS_MS.len() <= MAX_BUCKETS);
const _: () = assert!(HOLD_BOUNDS_MS.len() <= MAX_BUCKETS);
const _: () = assert!(FSYNC_BOUNDS_US.len() <= MAX_BUCKETS);

/// A histogram of integer observations (in one unit, fixed by its bounds):
/// per-bucket counts and the sum (the count is the buckets' total).
/// Observing is allocation-free.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Histogram {
    bounds: &'static [u64],
    /// `counts[i]` holds observations in `(bounds[i-1], bounds[i]]`;
    /// `counts[bounds.len()]` those above the last bound.
    counts: [u64; MAX_BUCKETS + 1],
    sum: u64,
}

impl Histogram {
    /// An empty histogram with these (increasing) upper bounds.
    #[must_use]
    pub const fn new(bounds: &'static [u64]) -> Self {
        assert!(bounds.len() <= MAX_BUCKETS, "too many buckets");
        Histogram {
            bounds,
            counts: [0; MAX_BUCKETS + 1],
            sum: 0,
        }
    }

    /// Counts one observation of `v`.
    #[inline]
    pub fn observe(&mut self, v: u64) {
        let mut i = 0;
        while i < self.bounds.len() && v > self.bounds[i] {
            i += 1;
        }
        self.counts[i] += 1;
        self.sum = self.sum.saturating_add(v);
    }

    /// Observations so far.
    #[must_use]
    pub fn count(&self) -> u64 {
        // The buckets' total: kept by no counter of its own, so an
        // observation on the hot path is one increment fewer.
        self.counts.iter().sum()
    }

    /// Sum of the observations so far.
    #[must_use]
    pub fn sum(&self) -> u64 {
        self.sum
    }

    /// `(upper bound, cumulative count)` of every finite bucket, then
    /// `(u64::MAX, count)` for `+Inf`.
    pub fn cumulative(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut acc = 0;
        (0..=self.bounds.len()).map(move |i| {
            acc += self.counts[i];
            (self.bounds.get(i).copied().unwrap_or(u64::MAX), acc)
        })
    }
}

/// The current grants by fencing token, each with the moment it began, for
/// hold times where the lock table keeps no clock (cluster mode).
///
/// Tokens grow with every grant (a later grant has a larger token), so the
/// grants are kept in a queue sorted by token, which is also grant order:
/// a grant is pushed at the back, [`HoldIndex::oldest`] is the front (O(1)),
/// and an ended grant is found by binary search and left as a tombstone,
/// popped once it reaches the front and swept out when tombstones
/// outnumber the live grants (amortised O(1)). Once the queue has grown to
/// the most grants held at once, nothing allocates.
#[derive(Clone, Debug, Default)]
pub struct HoldIndex {
    /// `(token, granted_at)`, increasing tokens; `granted_at` is
    /// [`Millis::NEVER`] for an ended grant.
    q: VecDeque<(u64, Millis)>,
    live: usize,
}

impl HoldIndex {
    /// Grant `token` began at `now`.
    pub fn start(&mut self, token: u64, now: Millis) {
        match self.q.back() {
            Some(&(last, _)) if last >= token => {
                // Not expected (tokens only grow); kept sorted regardless.
                let at = self.q.partition_point(|&(t, _)| t < token);
                if self.q.get(at).is_some_and(|&(t, _)| t == token) {
                    if self.q[at].1 == Millis::NEVER {
                        self.live += 1;
                    }
                    self.q[at].1 = now;
                    return;
                }
                self.q.insert(at, (token, now));
            }
            _ => self.q.push_back((token, now)),
        }
        self.live += 1;
    }

    /// Grant `token` ended: when it began, if it was known.
    pub fn end(&mut self, token: u64) -> Option<Millis> {
        let at = self.q.partition_point(|&(t, _)| t < token);
        let slot = self
            .q
            .get_mut(at)
            .filter(|(t, g)| *t == token && *g != Millis::NEVER)?;
        let began = std::mem::replace(&mut slot.1, Millis::NEVER);
        self.live -= 1;
        while self.q.front().is_some_and(|&(_, g)| g == Millis::NEVER) {
            self.q.pop_front();
        }
        if self.q.len() > 2 * self.live + 64 {
            self.q.retain(|&(_, g)| g != Millis::NEVER);
        }
        Some(began)
    }

    /// When the longest-held current grant began.
    #[must_use]
    pub fn oldest(&self) -> Option<Millis> {
        self.q.front().map(|&(_, g)| g)
    }

    /// Current grants.
    #[must_use]
    pub fn len(&self) -> usize {
        self.live
    }

    /// No current grant.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Forgets every grant.
    pub fn clear(&mut self) {
        self.q.clear();
        self.live = 0;
    }
}

/// The current grants counted by the second they began, for the longest
/// current hold where the lock table keeps each grant's start itself
/// (single mode): nothing per grant, only one counter per second that
/// still has a current grant.
///
/// Grants begin at a clock that never goes back, so nearly every start
/// and end is of the newest second: that second's count is two plain
/// fields (its first millisecond and its count), compared and counted
/// without a division or a queue access. The older seconds are a queue;
/// a start in a later second moves the newest count to its back, an end
/// of an older second finds it by binary search and takes one off.
/// Emptied seconds are popped from the front, and swept out when they
/// outnumber the others (amortised O(1)). [`GrantAges::oldest`] is the
/// front, or the newest second: O(1), to the second.
#[derive(Clone, Debug, Default)]
pub struct GrantAges {
    /// `(second, current grants begun in it)`, increasing seconds, all
    /// before the newest second.
    q: VecDeque<(u64, u64)>,
    /// Entries of `q` whose count is 0.
    empty: usize,
    live: usize,
    /// The first millisecond of the newest second a grant began in.
    newest_ms: u64,
    /// Current grants begun in that second (may be 0).
    newest_n: u64,
}

impl GrantAges {
    /// A grant began at `at`.
    #[inline]
    pub fn start(&mut self, at: Millis) {
        self.live += 1;
        if at.0.wrapping_sub(self.newest_ms) < 1000 {
            self.newest_n += 1;
        } else {
            self.start_other(at.0 / 1000);
        }
    }

    /// [`GrantAges::start`] outside the newest second: a later one becomes
    /// the newest, an earlier one (not expected: the clock does not go
    /// back) is counted in the queue, kept sorted.
    #[cold]
    #[inline(never)]
    fn start_other(&mut self, s: u64) {
        let newest = self.newest_ms / 1000;
        if s > newest || (self.newest_n == 0 && self.q.is_empty()) {
            if self.newest_n > 0 {
                self.q.push_back((newest, self.newest_n));
            }
            self.newest_ms = s * 1000;
            self.newest_n = 1;
            return;
        }
        let i = self.q.partition_point(|&(t, _)| t < s);
        match self.q.get_mut(i) {
            Some((t, n)) if *t == s => {
                if *n == 0 {
                    self.empty -= 1;
                }
                *n += 1;
            }
            _ => self.q.insert(i, (s, 1)),
        }
    }

    /// A grant that began at `at` ended.
    #[inline]
    pub fn end(&mut self, at: Millis) {
        // Most grants end while another grant of the newest second is
        // current: one off its count, nothing to search.
        if at.0.wrapping_sub(self.newest_ms) < 1000 && self.newest_n > 0 {
            self.newest_n -= 1;
            self.live -= 1;
            return;
        }
        self.end_searched(at.0 / 1000);
    }

    /// [`GrantAges::end`] for an older second `s`, found by binary search.
    #[cold]
    #[inline(never)]
    fn end_searched(&mut self, s: u64) {
        let i = self.q.partition_point(|&(t, _)| t < s);
        let Some((_, n)) = self.q.get_mut(i).filter(|(t, n)| *t == s && *n > 0) else {
            debug_assert!(false, "a grant of second {s} ended that never began");
            return;
        };
        *n -= 1;
        self.live -= 1;
        if *n == 0 {
            self.empty += 1;
        }
        while self.q.front().is_some_and(|&(_, n)| n == 0) {
            self.q.pop_front();
            self.empty -= 1;
        }
        if self.empty > 2 * (self.q.len() - self.empty) + 64 {
            self.q.retain(|&(_, n)| n > 0);
            self.empty = 0;
        }
    }

    /// The start of the second the longest-held current grant began in.
    #[must_use]
    pub fn oldest(&self) -> Option<Millis> {
        match self.q.front() {
            Some(&(s, _)) => Some(Millis(s * 1000)),
            None => (self.newest_n > 0).then_some(Millis(self.newest_ms)),
        }
    }

    /// Current grants.
    #[must_use]
    pub fn len(&self) -> usize {
        self.live
    }

    /// No current grant.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }
}

/// Writes a scrape in the Prometheus text format 0.0.4: every metric family
/// once, with its `# HELP` and `# TYPE` lines before its samples.
#[derive(Debug, Default)]
pub struct Exposition {
    text: String,
}

/// The `Content-Type` of [`Exposition`] text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

impl Exposition {
    /// An empty scrape.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    /// A gauge with one sample.
    pub fn gauge(&mut self, name: &str, help: &str, v: u64) {
        self.header(name, "gauge", help);
        let _ = writeln!(self.text, "{name} {v}");
    }

    /// A gauge of a duration in `1 / per_second` seconds, written in seconds.
    pub fn gauge_seconds(&mut self, name: &str, help: &str, v: u64, per_second: u64) {
        self.header(name, "gauge", help);
        let _ = writeln!(self.text, "{name} {}", Seconds(v, per_second));
    }

    /// A counter (its name ends in `_total`) with one sample.
    pub fn counter(&mut self, name: &str, help: &str, v: u64) {
        debug_assert!(name.ends_with("_total"), "{name}: counters end in _total");
        self.header(name, "counter", help);
        let _ = writeln!(self.text, "{name} {v}");
    }

    /// A counter with one label taking each of `values`.
    pub fn labelled_counter(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        values: &[(&str, u64)],
    ) {
        debug_assert!(name.ends_with("_total"), "{name}: counters end in _total");
        self.header(name, "counter", help);
        for (l, v) in values {
            let _ = writeln!(self.text, "{name}{{{label}=\"{}\"}} {v}", escape_label(l));
        }
    }

    /// A gauge with one label taking each of `values`.
    pub fn labelled_gauge(&mut self, name: &str, help: &str, label: &str, values: &[(&str, u64)]) {
        self.header(name, "gauge", help);
        for (l, v) in values {
            let _ = writeln!(self.text, "{name}{{{label}=\"{}\"}} {v}", escape_label(l));
        }
    }

    /// A gauge with one sample labelled `labels` (already `k="v"` pairs).
    pub fn info(&mut self, name: &str, help: &str, labels: &[(&str, &str)]) {
        self.header(name, "gauge", help);
        let mut first = true;
        self.text.push_str(name);
        self.text.push('{');
        for (k, v) in labels {
            if !first {
                self.text.push(',');
            }
            first = false;
            let _ = write!(self.text, "{k}=\"{}\"", escape_label(v));
        }
        self.text.push_str("} 1\n");
    }

    /// A histogram whose observations are in units of `1 / per_second`
    /// seconds (1000: milliseconds), written in seconds.
    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram, per_second: u64) {
        self.header(name, "histogram", help);
        for (le, n) in h.cumulative() {
            if le == u64::MAX {
                let _ = writeln!(self.text, "{name}_bucket{{le=\"+Inf\"}} {n}");
            } else {
                let _ = writeln!(
                    self.text,
                    "{name}_bucket{{le=\"{}\"}} {n}",
                    Seconds(le, per_second)
                );
            }
        }
        let _ = writeln!(self.text, "{name}_sum {}", Seconds(h.sum(), per_second));
        let _ = writeln!(self.text, "{name}_count {}", h.count());
    }

    /// The text written so far.
    #[must_use]
    pub fn finish(self) -> String {
        self.text
    }
}

/// `units / per_second` seconds, written exactly in decimal (no float).
struct Seconds(u64, u64);

impl std::fmt::Display for Seconds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (v, per) = (self.0, self.1.max(1));
        let whole = v / per;
        let frac = v % per;
        if frac == 0 {
            return write!(f, "{whole}");
        }
        let digits = per.ilog10() as usize;
        let s = format!("{frac:0digits$}");
        write!(f, "{whole}.{}", s.trim_end_matches('0'))
    }
}

/// Label values escape `\`, `"` and newlines.
fn escape_label(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return v.into();
    }
    let mut s = String::with_capacity(v.len() + 2);
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_upper_inclusive_and_cumulative() {
        let mut h = Histogram::new(&[10, 100]);
        for v in [0, 10, 11, 100, 101, 5000] {
            h.observe(v);
        }
        let c: Vec<_> = h.cumulative().collect();
        assert_eq!(c, vec![(10, 2), (100, 4), (u64::MAX, 6)]);
        assert_eq!((h.count(), h.sum()), (6, 5222));
    }

    #[test]
    fn the_hold_index_knows_the_oldest_grant_and_forgets_ended_ones() {
        let mut h = HoldIndex::default();
        assert_eq!(h.oldest(), None);
        h.start(10, Millis(1));
        h.start(20, Millis(2));
        h.start(30, Millis(3));
        assert_eq!((h.oldest(), h.len()), (Some(Millis(1)), 3));
        // From the middle: the oldest stays.
        assert_eq!(h.end(20), Some(Millis(2)));
        assert_eq!(h.end(20), None, "ended once");
        assert_eq!(h.end(25), None, "never began");
        assert_eq!(h.oldest(), Some(Millis(1)));
        assert_eq!(h.end(10), Some(Millis(1)));
        assert_eq!((h.oldest(), h.len()), (Some(Millis(3)), 1));
        // Out of order (not expected) still lands sorted.
        h.start(5, Millis(4));
        assert_eq!(h.oldest(), Some(Millis(4)));
        assert_eq!(h.end(5), Some(Millis(4)));
        assert_eq!(h.end(30), Some(Millis(3)));
        assert!(h.is_empty() && h.oldest().is_none());
    }

    #[test]
    fn the_hold_index_stays_bounded_when_an_old_grant_outlives_many() {
        let mut h = HoldIndex::default();
        h.start(1, Millis(0));
        for t in 2..100_000 {
            h.start(t, Millis(t));
            assert_eq!(h.end(t), Some(Millis(t)));
        }
        assert_eq!(h.oldest(), Some(Millis(0)));
        assert!(h.q.len() <= 2 * h.len() + 65, "{} entries", h.q.len());
    }

    #[test]
    fn grant_ages_count_by_second_and_know_the_oldest() {
        let mut g = GrantAges::default();
        assert_eq!(g.oldest(), None);
        g.start(Millis(1_200));
        g.start(Millis(1_900));
        g.start(Millis(5_000));
        assert_eq!((g.oldest(), g.len()), (Some(Millis(1_000)), 3));
        g.end(Millis(1_200));
        assert_eq!(g.oldest(), Some(Millis(1_000)), "one of second 1 is left");
        g.end(Millis(1_900));
        assert_eq!((g.oldest(), g.len()), (Some(Millis(5_000)), 1));
        g.end(Millis(5_000));
        assert!(g.is_empty() && g.oldest().is_none());
        // An old grant outliving many: the queue stays bounded.
        g.start(Millis(0));
        for s in 1..100_000u64 {
            g.start(Millis(s * 1000));
            g.end(Millis(s * 1000));
        }
        assert_eq!((g.oldest(), g.len()), (Some(Millis(0)), 1));
        assert!(g.q.len() <= 70, "{} entries", g.q.len());
    }

    #[test]
    fn grant_ages_count_a_start_before_the_newest_second() {
        // Not expected of the clock, but counted: the oldest is right.
        let mut g = GrantAges::default();
        g.start(Millis(5_500));
        g.start(Millis(3_100));
        assert_eq!((g.oldest(), g.len()), (Some(Millis(3_000)), 2));
        g.start(Millis(3_900));
        g.end(Millis(3_100));
        assert_eq!(g.oldest(), Some(Millis(3_000)));
        g.end(Millis(3_900));
        assert_eq!((g.oldest(), g.len()), (Some(Millis(5_000)), 1));
        g.end(Millis(5_500));
        assert!(g.is_empty() && g.oldest().is_none());
        // Nothing current: an earlier second simply becomes the newest.
        g.start(Millis(2_000));
        assert_eq!((g.oldest(), g.len()), (Some(Millis(2_000)), 1));
        g.start(Millis(7_000));
        g.end(Millis(7_000));
        assert_eq!(g.oldest(), Some(Millis(2_000)));
        g.end(Millis(2_000));
        assert!(g.is_empty() && g.oldest().is_none());
    }

    #[test]
    fn grant_ages_agree_with_a_count_per_second() {
        // Starts at a clock that moves forward by 0 to 2 s, ends of random
        // current grants (often of the newest second, the fast path),
        // against a plain map of counts.
        let mut g = GrantAges::default();
        let mut model = std::collections::BTreeMap::<u64, u64>::new();
        let mut current: Vec<Millis> = Vec::new();
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || crate::hash::xorshift(&mut state);
        let mut now = 0u64;
        for _ in 0..200_000 {
            let r = next();
            if r % 3 != 0 || current.is_empty() {
                // Mostly under 64 ms apart, one in four up to 2.047 s.
                now += (r >> 40) & if r & 0x30 == 0 { 0x7ff } else { 0x3f };
                g.start(Millis(now));
                *model.entry(now / 1000).or_default() += 1;
                current.push(Millis(now));
            } else {
                // Half the ends take the newest grant, half a random one.
                let i = if r & 8 == 0 {
                    current.len() - 1
                } else {
                    (r >> 8) as usize % current.len()
                };
                let at = current.swap_remove(i);
                g.end(at);
                let n = model.get_mut(&(at.0 / 1000)).unwrap();
                *n -= 1;
                if *n == 0 {
                    model.remove(&(at.0 / 1000));
                }
            }
            assert_eq!(g.len(), current.len());
            assert_eq!(g.oldest(), model.keys().next().map(|&s| Millis(s * 1000)));
            assert!(g.q.len() <= 3 * model.len() + 65);
        }
    }

    #[test]
    fn seconds_are_written_exactly() {
        assert_eq!(Seconds(1, 1000).to_string(), "0.001");
        assert_eq!(Seconds(1500, 1000).to_string(), "1.5");
        assert_eq!(Seconds(255_000, 1000).to_string(), "255");
        assert_eq!(Seconds(250, 1_000_000).to_string(), "0.00025");
    }

    #[test]
    fn a_histogram_is_written_with_bucket_sum_and_count() {
        let mut h = Histogram::new(&[5, 1000]);
        h.observe(3);
        h.observe(2000);
        let mut e = Exposition::new();
        e.histogram("x_seconds", "X.", &h, 1000);
        assert_eq!(
            e.finish(),
            "# HELP x_seconds X.\n# TYPE x_seconds histogram\n\
             x_seconds_bucket{le=\"0.005\"} 1\nx_seconds_bucket{le=\"1\"} 1\n\
             x_seconds_bucket{le=\"+Inf\"} 2\nx_seconds_sum 2.003\nx_seconds_count 2\n"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let mut e = Exposition::new();
        e.info("b", "B.", &[("version", "a\"b\\c")]);
        assert!(e.finish().ends_with("b{version=\"a\\\"b\\\\c\"} 1\n"));
    }
}

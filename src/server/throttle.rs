//! The guess throttle: a connection that collects many `N` (not released)
//! and `X` (not extended) replies is slowed down.
//!
//! Tokens carry random low bits ([`crate::token`]), so a release or extend
//! of a grant the client does not hold succeeds with probability 2⁻¹⁶ per
//! try; the throttle bounds the tries. Each `N`/`X` costs one
//! [`GUESS_INTERVAL_MS`] slot on a virtual schedule (the generic cell rate
//! algorithm): a connection may run [`GUESS_BURST`] slots ahead of the
//! clock, and while it is that far ahead its reads are paused. After a
//! burst of 100 a connection gets at most 100 wrong answers a second
//! (plus the frames of one loop turn, read before the turn's answers are
//! counted); a well-behaved client, whose releases and extends name its own
//! grants, never meets it. Answers to token 0 are not charged: no grant has
//! it, so they guess at nothing (see `engine::is_guess`).

use crate::time::Millis;
pub use crate::token::{GUESS_BURST, GUESS_PER_SEC};

/// One wrong answer's slot on the schedule.
pub const GUESS_INTERVAL_MS: u64 = 1000 / GUESS_PER_SEC as u64;
/// How far ahead of the clock the schedule may run before reads pause.
const WINDOW_MS: u64 = GUESS_BURST as u64 * GUESS_INTERVAL_MS;

/// One connection's schedule of wrong answers.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GuessThrottle {
    /// When the schedule's next free slot starts (0: never charged).
    next_free: Millis,
    /// Wrong answers counted on this connection.
    pub(crate) misses: u64,
    /// Releases and extends read this turn, not yet answered: each may
    /// come back `N` or `X`, so each counts as one until the answers are
    /// in (the loop reads a turn's frames before it sees their answers).
    pending: u64,
    /// The connection has been throttled at least once.
    pub(crate) ever: bool,
}

impl GuessThrottle {
    /// Counts one `N` or `X` answered at `now`. True when this one made the
    /// connection throttled for the first time.
    pub(crate) fn charge(&mut self, now: Millis) -> bool {
        self.next_free = self.next_free.max(now).add_ms(GUESS_INTERVAL_MS);
        self.misses += 1;
        let first = !self.ever && self.blocked(now);
        self.ever |= first;
        first
    }

    /// A release or extend was read; its answer is not in yet.
    pub(crate) fn note_request(&mut self) {
        self.pending += 1;
    }

    /// The answers to the requests read so far are in (and charged).
    pub(crate) fn answered(&mut self) {
        self.pending = 0;
    }

    /// True while reads are paused: one more wrong answer would run the
    /// schedule past the burst.
    pub(crate) fn blocked(&self, now: Millis) -> bool {
        let ahead = self
            .next_free
            .max(now)
            .add_ms(self.pending * GUESS_INTERVAL_MS);
        ahead > now.add_ms(WINDOW_MS - GUESS_INTERVAL_MS)
    }

    /// How many more releases and extends may be read at `now` (noted with
    /// `note_request`) while `blocked(now)` stays false; `None` when it is
    /// true already. The read loop counts this down per frame instead of
    /// asking `blocked` before each one: its clock only moves between reads.
    pub(crate) fn room(&self, now: Millis) -> Option<u64> {
        // blocked(now) is: max(next_free, now) + pending · interval > limit.
        let base = self.next_free.max(now).0;
        let limit = now.add_ms(WINDOW_MS - GUESS_INTERVAL_MS).0;
        let most = limit.checked_sub(base)? / GUESS_INTERVAL_MS;
        most.checked_sub(self.pending)
    }

    /// When reads resume (the first moment `blocked` is false).
    pub(crate) fn resume_at(&self) -> Millis {
        Millis(
            self.next_free
                .0
                .saturating_sub(WINDOW_MS - GUESS_INTERVAL_MS),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_100_then_100_a_second() {
        let mut t = GuessThrottle::default();
        let now = Millis(50_000);
        for i in 0..99 {
            assert!(!t.charge(now), "miss {i}");
            assert!(!t.blocked(now), "after miss {i}");
        }
        assert!(t.charge(now), "the 100th miss throttles");
        assert!(t.blocked(now));
        let resume = t.resume_at();
        assert_eq!(resume, now.add_ms(GUESS_INTERVAL_MS));
        assert!(t.blocked(Millis(resume.0 - 1)));
        assert!(!t.blocked(resume));
        // From then on, one miss per interval.
        let mut at = resume;
        for _ in 0..1000 {
            assert!(!t.blocked(at));
            assert!(!t.charge(at), "only the first throttling is reported");
            assert!(t.blocked(at));
            at = t.resume_at();
        }
        assert_eq!(at, now.add_ms(1001 * GUESS_INTERVAL_MS));
        assert_eq!(t.misses, 1100);
        // Idle for a burst's worth of time: a fresh burst.
        let later = at.add_ms(WINDOW_MS);
        for _ in 0..99 {
            t.charge(later);
        }
        assert!(!t.blocked(later));
    }

    #[test]
    fn unanswered_releases_count_until_their_answers_are_in() {
        let mut t = GuessThrottle::default();
        let now = Millis(7_000);
        for _ in 0..99 {
            t.note_request();
        }
        assert!(!t.blocked(now));
        t.note_request();
        assert!(t.blocked(now), "100 answers that may be N");
        // They were all R: nothing charged, reading goes on.
        t.answered();
        assert!(!t.blocked(now));
        // 60 misses charged, 40 more unanswered: at the burst.
        for _ in 0..60 {
            t.charge(now);
        }
        for _ in 0..39 {
            t.note_request();
        }
        assert!(!t.blocked(now));
        t.note_request();
        assert!(t.blocked(now));
    }

    /// `room` says exactly how many more releases `blocked` lets through,
    /// from every mix of charged and pending wrong answers and clock.
    #[test]
    fn room_counts_down_to_blocked() {
        let mut states = 0;
        for charged in 0..130u64 {
            for offset in [0u64, 1, 9, 10, 11, 500, 999, 1000, 1001, 5000] {
                let mut t = GuessThrottle::default();
                let start = Millis(20_000);
                for _ in 0..charged {
                    t.charge(start);
                }
                let now = start.add_ms(offset);
                for pending in 0..120u64 {
                    let mut u = t;
                    for _ in 0..pending {
                        u.note_request();
                    }
                    let room = u.room(now);
                    assert_eq!(
                        room.is_none(),
                        u.blocked(now),
                        "{charged} {offset} {pending}"
                    );
                    if let Some(r) = room {
                        let mut v = u;
                        for i in 0..r {
                            v.note_request();
                            assert!(
                                !v.blocked(now),
                                "{charged} {offset} {pending}: note {i} of {r}"
                            );
                        }
                        v.note_request();
                        assert!(v.blocked(now), "{charged} {offset} {pending}: after {r}");
                    }
                    states += 1;
                }
            }
        }
        assert_eq!(states, 130 * 10 * 120);
    }

    #[test]
    fn misses_spread_below_the_rate_never_throttle() {
        let mut t = GuessThrottle::default();
        for i in 0..10_000u64 {
            assert!(!t.charge(Millis(1_000 + i * GUESS_INTERVAL_MS)), "miss {i}");
        }
    }
}

//! The guess budget: an identity (`super::identity`) that collects many `N`
//! (not released) and `X` (not extended) replies is slowed down, over all
//! its connections and reconnects.
//!
//! Tokens carry random low bits ([`crate::token`]), so a release or extend
//! of a grant the client does not hold succeeds with probability 2⁻¹⁶ per
//! try; the budget bounds the tries. Each `N`/`X` takes one slot on two
//! virtual schedules (the generic cell rate algorithm), and the identity's
//! connections pause their reads at the next release or extend while
//! either schedule runs too far ahead of the clock:
//!
//! * the **burst** schedule: [`GUESS_BURST`] at once, then
//!   [`GUESS_PER_SEC`] a second;
//! * the **allowance** schedule: [`GUESS_ALLOWANCE`] in all, refilled at
//!   [`GUESS_SUSTAINED_PER_SEC`] a second.
//!
//! So an identity with any number of connections gets at most
//! `GUESS_ALLOWANCE + GUESS_SUSTAINED_PER_SEC · t` wrong answers in `t`
//! seconds. In single mode each wrong answer is charged as the engine
//! makes it, so an identity's releases of its own grants never count
//! against it however deep its pipelines; in cluster mode answers come
//! after Raft commits, so every release and extend read in a turn counts
//! as a possible wrong answer until the turn's answers are in
//! ([`GuessBudget::note_request`]), which bounds what one turn reads. Only connections that send a
//! release or extend while the identity is over budget pause; acquires are
//! never held up, and other identities never notice. A well-behaved client,
//! whose releases and extends name its own grants, never meets it. Answers
//! to token 0 are not charged: no grant has it, so they guess at nothing
//! (see `engine::is_guess`).

use crate::time::Millis;
pub use crate::token::{GUESS_ALLOWANCE, GUESS_BURST, GUESS_PER_SEC, GUESS_SUSTAINED_PER_SEC};

/// One wrong answer's slot on the burst schedule.
pub const GUESS_INTERVAL_MS: u64 = 1000 / GUESS_PER_SEC as u64;
/// One wrong answer's slot on the allowance schedule.
pub const SUSTAINED_INTERVAL_MS: u64 = 1000 / GUESS_SUSTAINED_PER_SEC as u64;

/// A virtual schedule of slots `INTERVAL` ms apart that may run at most
/// `SLOTS` slots ahead of the clock.
#[derive(Debug, Clone, Copy, Default)]
struct Schedule<const INTERVAL: u64, const SLOTS: u64> {
    /// When the schedule's next free slot starts (0: never charged).
    next_free: Millis,
}

impl<const INTERVAL: u64, const SLOTS: u64> Schedule<INTERVAL, SLOTS> {
    const WINDOW_MS: u64 = SLOTS * INTERVAL;

    fn charge(&mut self, now: Millis) {
        self.next_free = self.next_free.max(now).add_ms(INTERVAL);
    }

    /// How many more slots may be taken at `now` beyond `pending` ones
    /// already promised, while the schedule stays within its window;
    /// `None` when it would not.
    fn room(&self, now: Millis, pending: u64) -> Option<u64> {
        let base = self.next_free.max(now).0;
        let limit = now.add_ms(Self::WINDOW_MS - INTERVAL).0;
        let most = limit.checked_sub(base)? / INTERVAL;
        most.checked_sub(pending)
    }

    /// The first moment at which one more slot fits.
    fn resume_at(&self) -> Millis {
        Millis(self.next_free.0.saturating_sub(Self::WINDOW_MS - INTERVAL))
    }

    /// No slot is taken ahead of `now`: the schedule is as if never used.
    fn idle(&self, now: Millis) -> bool {
        self.next_free <= now
    }
}

/// One identity's budget of wrong answers.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GuessBudget {
    burst: Schedule<GUESS_INTERVAL_MS, { GUESS_BURST as u64 }>,
    allowance: Schedule<SUSTAINED_INTERVAL_MS, { GUESS_ALLOWANCE as u64 }>,
    /// Wrong answers counted for this identity.
    pub(crate) misses: u64,
    /// Releases and extends read in loop turn `pending_turn`, not yet
    /// answered: each may come back `N` or `X`, so each counts as one
    /// until the turn's answers are in (the loop reads a turn's frames
    /// before it sees their answers).
    pending: u64,
    pending_turn: u64,
    /// The identity has been slowed down at least once.
    pub(crate) ever: bool,
}

impl GuessBudget {
    /// Counts one `N` or `X` answered at `now`. True when this one made the
    /// identity over budget for the first time.
    pub(crate) fn charge(&mut self, now: Millis) -> bool {
        self.burst.charge(now);
        self.allowance.charge(now);
        self.misses += 1;
        let first = !self.ever && self.room(now, u64::MAX).is_none();
        self.ever |= first;
        first
    }

    /// A release or extend was read in loop turn `turn`; its answer is not
    /// in yet. Those of earlier turns are answered (and charged) by now.
    pub(crate) fn note_request(&mut self, turn: u64) {
        if self.pending_turn != turn {
            self.pending_turn = turn;
            self.pending = 0;
        }
        self.pending += 1;
    }

    /// How many more releases and extends may be read at `now` in loop turn
    /// `turn` (each noted with `note_request`) before the identity is over
    /// budget; `None` when it is already. The read loop counts this down
    /// per frame: its clock only moves between reads.
    pub(crate) fn room(&self, now: Millis, turn: u64) -> Option<u64> {
        let pending = if self.pending_turn == turn {
            self.pending
        } else {
            0
        };
        let a = self.burst.room(now, pending)?;
        let b = self.allowance.room(now, pending)?;
        Some(a.min(b))
    }

    /// True while the identity's releases and extends are held back at
    /// `now` (no turn's requests pending).
    #[cfg(test)]
    pub(crate) fn blocked(&self, now: Millis) -> bool {
        self.room(now, u64::MAX).is_none()
    }

    /// When the identity may send one more release or extend.
    pub(crate) fn resume_at(&self) -> Millis {
        self.burst.resume_at().max(self.allowance.resume_at())
    }

    /// Nothing is owed: forgetting this budget loses nothing.
    pub(crate) fn idle(&self, now: Millis) -> bool {
        self.burst.idle(now) && self.allowance.idle(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Charges misses as fast as the budget lets them through, from
    /// `start` for `secs` seconds; returns how many it got.
    fn drain(b: &mut GuessBudget, start: Millis, secs: u64) -> u64 {
        let end = start.add_secs(secs);
        let mut now = start;
        let mut n = 0;
        while now < end {
            if b.blocked(now) {
                now = b.resume_at().max(now.add_ms(1));
                continue;
            }
            b.charge(now);
            n += 1;
        }
        n
    }

    #[test]
    fn a_burst_then_the_fast_rate_then_the_sustained_rate() {
        let mut b = GuessBudget::default();
        let now = Millis(50_000);
        for i in 0..99 {
            assert!(!b.charge(now), "miss {i}");
            assert!(!b.blocked(now), "after miss {i}");
        }
        assert!(b.charge(now), "the 100th miss slows it down");
        assert!(b.blocked(now));
        assert_eq!(b.resume_at(), now.add_ms(GUESS_INTERVAL_MS));
        // The first second: the burst and 100 more.
        let mut b = GuessBudget::default();
        let first = drain(&mut b, now, 1);
        assert_eq!(
            first, 199,
            "burst of 100, then one every 10 ms after the first"
        );
        // After the allowance is spent: 10 a second, whatever the tries.
        let mut b = GuessBudget::default();
        let in_60 = drain(&mut b, now, 60);
        let bound = u64::from(GUESS_ALLOWANCE) + 60 * u64::from(GUESS_SUSTAINED_PER_SEC);
        assert!(in_60 <= bound, "{in_60} > {bound}");
        assert!(in_60 >= bound - 20, "{in_60} well below {bound}");
        let next = drain(&mut b, now.add_secs(60), 10);
        assert_eq!(next, 10 * u64::from(GUESS_SUSTAINED_PER_SEC));
        assert_eq!(b.misses, in_60 + next);
    }

    #[test]
    fn an_idle_budget_refills_and_is_then_forgettable() {
        let mut b = GuessBudget::default();
        let now = Millis(10_000);
        let n = drain(&mut b, now, 30);
        assert!(n > 1000);
        assert!(!b.idle(now.add_secs(30)));
        // The allowance refills at 10 a second: 100 s for all of it.
        let later = now.add_secs(30 + 101);
        assert!(b.idle(later));
        assert_eq!(drain(&mut b, later, 1), 199);
    }

    #[test]
    fn unanswered_releases_of_this_turn_count_until_the_next() {
        let mut b = GuessBudget::default();
        let now = Millis(7_000);
        for _ in 0..99 {
            b.note_request(1);
        }
        assert_eq!(b.room(now, 1), Some(0));
        b.note_request(1);
        assert_eq!(b.room(now, 1), None, "100 answers that may be N");
        // The next turn: they were all R, nothing charged.
        assert_eq!(b.room(now, 2), Some(99));
        for _ in 0..60 {
            b.charge(now);
        }
        for _ in 0..39 {
            b.note_request(3);
        }
        assert_eq!(b.room(now, 3), Some(0));
        b.note_request(3);
        assert_eq!(b.room(now, 3), None);
    }

    /// `room` says exactly how many more releases fit before `blocked`,
    /// from every mix of charged and pending wrong answers and clock.
    #[test]
    fn room_counts_down_to_blocked() {
        for charged in [0u64, 1, 50, 99, 100, 101, 130, 999, 1000, 1001, 1500] {
            for offset in [0u64, 1, 9, 10, 11, 99, 100, 101, 999, 1000, 5000] {
                let mut b = GuessBudget::default();
                let start = Millis(20_000);
                for _ in 0..charged {
                    b.charge(start);
                }
                let now = start.add_ms(offset);
                let room = b.room(now, 9);
                assert_eq!(room.is_none(), b.blocked(now), "{charged} {offset}");
                if let Some(r) = room {
                    let mut c = b;
                    for i in 0..r {
                        c.note_request(9);
                        assert!(c.room(now, 9).is_some(), "{charged} {offset}: {i} of {r}");
                    }
                    c.note_request(9);
                    assert!(c.room(now, 9).is_none(), "{charged} {offset}: after {r}");
                }
            }
        }
    }

    #[test]
    fn misses_spread_below_the_sustained_rate_never_slow_down() {
        let mut b = GuessBudget::default();
        for i in 0..10_000u64 {
            assert!(
                !b.charge(Millis(1_000 + i * SUSTAINED_INTERVAL_MS)),
                "miss {i}"
            );
        }
    }
}

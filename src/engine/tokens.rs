//! Fencing tokens: issuing them, in sequence or in random steps, below the
//! durable ceiling.

use super::Engine;
use crate::token::{self, TokenRng};

/// [`take_token`] unless a grant now would exceed `ceiling` (what
/// [`Engine::tokens_exhausted`] tells): then `None`, and nothing changes.
/// The step is found once for the check and the token.
#[inline]
pub(super) fn try_take_token(
    next_token: &mut u64,
    rng: Option<&mut TokenRng>,
    ceiling: u64,
) -> Option<u64> {
    let t = *next_token;
    let Some(rng) = rng else {
        if t >= ceiling {
            return None;
        }
        // `t < ceiling <= u64::MAX`: the next one exists.
        *next_token = t + 1;
        return Some(t);
    };
    // The highest token the step may carry must be below the ceiling.
    let step = token::step_at_or_above(t).filter(|s| s | token::RANDOM_MASK < ceiling)?;
    *next_token = step.saturating_add(token::STEP);
    Some(step | u64::from(rng.bits()))
}

/// Issues the next token and advances `next_token` past it: `next_token`
/// itself without `rng`, else the next sequence step at or above it with
/// fresh random low bits ([`crate::token`]). The caller has checked
/// [`Engine::tokens_exhausted`].
fn take_token(next_token: &mut u64, rng: Option<&mut TokenRng>) -> u64 {
    let t = *next_token;
    let Some(rng) = rng else {
        assert!(t < u64::MAX, "fencing tokens exhausted");
        *next_token = t + 1;
        return t;
    };
    let step = token::step_at_or_above(t).expect("fencing tokens exhausted");
    *next_token = step.saturating_add(token::STEP);
    step | u64::from(rng.bits())
}

impl<T: Copy + Default> Engine<T> {
    /// The lowest token the next grant may carry (the token itself without
    /// a generator). Every token issued so far is lower.
    #[must_use]
    pub fn next_token(&self) -> u64 {
        self.next_token
    }

    /// Gives every later grant a fresh sequence step with random low bits
    /// from `rng` ([`crate::token`]); `None` goes back to tokens that go up
    /// by one.
    pub fn set_token_rng(&mut self, rng: Option<TokenRng>) {
        self.token_rng = rng;
    }

    /// Makes the next token at least `floor` (cluster mode: the index of the
    /// entry being applied). Never lowers it.
    pub fn raise_next_token(&mut self, floor: u64) {
        self.next_token = self.next_token.max(floor);
    }

    /// Tokens at or above `ceiling` will not be issued. The server sets it to
    /// one above its durable high-water mark, so no token reaches a client
    /// before a restart is sure to resume above it. While no token can be
    /// issued, an acquire that would be granted is answered Busy, and a key
    /// whose grant ends is deleted with its waiters answered Timeout.
    pub fn set_token_ceiling(&mut self, ceiling: u64) {
        self.token_ceiling = ceiling;
    }

    /// True when a grant now would exceed the token ceiling.
    #[must_use]
    pub fn tokens_exhausted(&self) -> bool {
        if self.token_rng.is_none() {
            return self.next_token >= self.token_ceiling;
        }
        // The highest token the next step may carry must be below the ceiling.
        token::step_at_or_above(self.next_token)
            .is_none_or(|step| step | token::RANDOM_MASK >= self.token_ceiling)
    }

    pub(super) fn issue_token(&mut self) -> u64 {
        take_token(&mut self.next_token, self.token_rng.as_mut())
    }
}

//! Fencing tokens that cannot be guessed.
//!
//! A token is `(sequence << 16) | r`: the sequence goes up by one per grant
//! (single mode) or is the index of the entry that granted it (cluster
//! mode), and `r` is [`RANDOM_BITS`] bits from the OS random number
//! generator, drawn afresh for every grant (in cluster mode by the node that
//! proposes the entry, carried in it). Tokens therefore still increase
//! strictly in grant order, are never 0 (the sequence starts at 1), and a
//! client that knows every other token ever issued still guesses a grant's
//! token with probability 2⁻¹⁶ per try; the server slows down an identity
//! (a client certificate, a Unix uid, else a source address) that keeps
//! guessing, over all its connections (`crate::server`, [`GUESS_BURST`],
//! [`GUESS_PER_SEC`], [`GUESS_ALLOWANCE`], [`GUESS_SUSTAINED_PER_SEC`]).
//!
//! The sequence has 48 bits: 2⁴⁸ ≈ 2.8 · 10¹⁴ grants, which at a sustained
//! 1,000,000 grants a second lasts 2.8 · 10⁸ s ≈ 8.9 years, at 100,000 a
//! second 89 years (docs/SECURITY.md).

use std::io::{self, Read};

/// Unpredictable low bits in every token.
pub const RANDOM_BITS: u32 = 16;
/// One sequence step in token space.
pub const STEP: u64 = 1 << RANDOM_BITS;
/// The random part of a token.
pub const RANDOM_MASK: u64 = STEP - 1;

/// `N` and `X` replies one identity may collect at once, over all its
/// connections, before the server pauses the reads of those that send more.
pub const GUESS_BURST: u32 = 100;
/// `N` and `X` replies an identity may collect per second after its burst,
/// until its allowance is spent.
pub const GUESS_PER_SEC: u32 = 100;
/// `N` and `X` replies an identity may collect in all before it is held to
/// [`GUESS_SUSTAINED_PER_SEC`]: the allowance refills at that rate.
pub const GUESS_ALLOWANCE: u32 = 1000;
/// `N` and `X` replies an identity may collect per second, sustained. A
/// guesser that knows a grant's sequence needs 2¹⁵ guesses on average, so
/// about 55 minutes at this rate.
pub const GUESS_SUSTAINED_PER_SEC: u32 = 10;

const _: () = assert!(GUESS_BURST <= GUESS_ALLOWANCE);
const _: () = assert!(GUESS_SUSTAINED_PER_SEC <= GUESS_PER_SEC);

/// The first token of the sequence step at or above `floor`, never 0: its
/// random bits are 0. `None` when no step is left.
#[must_use]
pub fn step_at_or_above(floor: u64) -> Option<u64> {
    let up = floor.checked_add(RANDOM_MASK)? & !RANDOM_MASK;
    Some(up.max(STEP))
}

/// The token of a grant made by cluster entry `index` with the proposer's
/// random bits `bits`. `None` past the 48-bit sequence space.
#[must_use]
pub fn for_entry(index: u64, bits: u16) -> Option<u64> {
    if index == 0 || index > (u64::MAX >> RANDOM_BITS) {
        return None;
    }
    Some((index << RANDOM_BITS) | u64::from(bits))
}

/// Random bytes read from the source at a time: one getrandom(2) per
/// 1,024 grants (at 256 bytes it was one per 128 grants, 0.0039 syscalls
/// per request of `cycle`, a tenth of all the server's syscalls at depth 64).
const BUF_BYTES: usize = 2048;
const _: () = assert!(BUF_BYTES.is_power_of_two() && BUF_BYTES >= 2);

/// Where a token's random bits come from.
#[derive(Debug)]
pub struct TokenRng {
    source: Source,
    buf: [u8; BUF_BYTES],
    pos: usize,
}

#[derive(Debug)]
enum Source {
    /// The OS generator (`getrandom(2)`, else `/dev/urandom`).
    Os,
    /// A fixed seed (splitmix64): for deterministic tests and simulations
    /// only; such tokens are guessable.
    Seeded(u64),
}

impl TokenRng {
    /// The OS random number generator, checked now.
    ///
    /// # Errors
    /// The OS generator cannot be read.
    pub fn os() -> io::Result<Self> {
        let mut rng = TokenRng {
            source: Source::Os,
            buf: [0; BUF_BYTES],
            pos: BUF_BYTES,
        };
        rng.refill()?;
        Ok(rng)
    }

    /// A deterministic generator from `seed` (tests and simulations).
    #[must_use]
    pub fn seeded(seed: u64) -> Self {
        TokenRng {
            source: Source::Seeded(seed),
            buf: [0; BUF_BYTES],
            pos: BUF_BYTES,
        }
    }

    /// Sixteen fresh random bits: two bytes of the buffer, refilled from
    /// the source once used up (every 1,024 draws).
    #[inline]
    pub fn bits(&mut self) -> u16 {
        if self.pos + 2 > self.buf.len() {
            self.refill_or_fall_back();
        }
        // `pos` is even and at most `BUF_BYTES - 2` here (a refill sets it
        // to 0), so the mask changes nothing; it only shows the compiler
        // that both bytes are in the buffer, which saves the two bounds
        // checks of every grant.
        let at = self.pos & (BUF_BYTES - 2);
        let b = u16::from_le_bytes([self.buf[at], self.buf[at + 1]]);
        self.pos = at + 2;
        b
    }

    /// Refills the buffer. getrandom(2) does not fail once the pool is
    /// initialised (it was at start); a failure here keeps serving on a
    /// generator seeded from the last random bytes and the clock.
    #[cold]
    #[inline(never)]
    fn refill_or_fall_back(&mut self) {
        if let Err(e) = self.refill() {
            log::error!("cannot read the OS random number generator: {e}; using a fallback");
            let mut seed = 0u64;
            for c in self.buf.chunks_exact(8) {
                seed ^= u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
            }
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            self.source = Source::Seeded(seed ^ now);
            // A seeded source cannot fail.
            let _ = self.refill();
        }
    }

    fn refill(&mut self) -> io::Result<()> {
        match &mut self.source {
            Source::Os => fill_os(&mut self.buf)?,
            Source::Seeded(state) => {
                for c in self.buf.chunks_exact_mut(8) {
                    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                    let mut z = *state;
                    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    c.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
                }
            }
        }
        self.pos = 0;
        Ok(())
    }
}

/// Fills `buf` from the OS generator.
fn fill_os(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid, writable buffer of `rest.len()` bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n > 0 {
            done += n as usize;
            continue;
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::ENOSYS) => {
                return std::fs::File::open("/dev/urandom")?.read_exact(rest);
            }
            _ => return Err(err),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_aligned_and_never_zero() {
        assert_eq!(step_at_or_above(0), Some(STEP));
        assert_eq!(step_at_or_above(1), Some(STEP));
        assert_eq!(step_at_or_above(STEP), Some(STEP));
        assert_eq!(step_at_or_above(STEP + 1), Some(2 * STEP));
        assert_eq!(
            step_at_or_above(u64::MAX - RANDOM_MASK),
            Some(u64::MAX - RANDOM_MASK)
        );
        assert_eq!(step_at_or_above(u64::MAX - RANDOM_MASK + 1), None);
        assert_eq!(for_entry(0, 5), None);
        assert_eq!(for_entry(3, 5), Some(3 * STEP + 5));
        assert_eq!(for_entry(1 << 48, 0), None);
    }

    #[test]
    fn os_bits_vary_and_seeded_bits_repeat() {
        let mut os = TokenRng::os().unwrap();
        // 2,500 draws cross two refills of the buffer (1,024 draws each).
        let draws: std::collections::HashSet<u16> = (0..2500).map(|_| os.bits()).collect();
        // About 2,453 distinct values are expected; fewer than 2,350 is
        // astronomically unlikely from a working generator.
        assert!(draws.len() > 2350, "{}", draws.len());
        let a: Vec<u16> = {
            let mut r = TokenRng::seeded(7);
            (0..2500).map(|_| r.bits()).collect()
        };
        let b: Vec<u16> = {
            let mut r = TokenRng::seeded(7);
            (0..2500).map(|_| r.bits()).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 2350);
    }
}

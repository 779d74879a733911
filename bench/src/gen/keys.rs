//! The generator's keys (all [`KEY_BYTES`] long: hot keys shared by many
//! slots, fresh keys used once) and its cheap per-connection random numbers.

use super::KEY_BYTES;

/// Writes `n` in decimal into `out`, right-aligned and zero-padded.
fn put_digits(out: &mut [u8], mut n: u64) {
    for d in out.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

/// The `i`-th hot key: `hot`, 7 digits that differ between runs (so a run
/// never queues behind waiters an earlier run left in the server), and 14
/// digits of `i`.
#[must_use]
pub fn hot_key(i: u32) -> [u8; KEY_BYTES] {
    let mut k = [0u8; KEY_BYTES];
    k[..3].copy_from_slice(b"hot");
    put_digits(&mut k[3..10], run_nonce() / 1_000_000_000_000);
    put_digits(&mut k[10..], u64::from(i));
    k
}

/// A key no other request of the run uses: connection (5 digits), then a
/// per-connection sequence (19 digits).
#[must_use]
pub fn fresh_key(conn: u64, seq: u64) -> [u8; KEY_BYTES] {
    let mut k = [0u8; KEY_BYTES];
    put_digits(&mut k[..5], conn);
    put_digits(&mut k[5..], seq);
    k
}

/// Replaces `out` with the ASCII key `k` without a UTF-8 check per request.
pub(super) fn set_key(out: &mut String, k: &[u8; KEY_BYTES]) {
    out.clear();
    out.extend(k.iter().map(|&b| char::from(b)));
}

/// Where a run's fresh-key sequence starts: different for every run, so a
/// run never meets keys an earlier run left held (replies still in flight
/// when it stopped), without the server being restarted between runs.
pub(super) fn run_nonce() -> u64 {
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        // 19 digits of sequence: the nonce takes the top 7, a run the rest.
        (t ^ u64::from(std::process::id()).rotate_left(32)) % 10_000_000 * 1_000_000_000_000
    })
}

/// xorshift64*: cheap, deterministic per connection, good enough to spread
/// acquires over hot keys.
pub(super) fn next_rand(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_24_bytes_and_distinct() {
        let hot = hot_key(7);
        assert!(hot.starts_with(b"hot") && hot.ends_with(b"00000000000007"));
        assert_eq!(hot[3..10], hot_key(8)[3..10], "one run, one prefix");
        assert_eq!(&fresh_key(3, 12), b"000030000000000000000012");
        assert_ne!(fresh_key(1, 23), fresh_key(12, 3));
    }
}

//! Rate-limited logging: a flood of the same event (malformed frames, refused
//! connections, a failing disk) must not flood the log or slow the loop.

use crate::time::Millis;

/// Lets through at most `burst` events per `window_ms`, and counts the rest so
/// the next line that gets through can say how many were suppressed.
#[derive(Debug)]
pub struct LogLimit {
    window_ms: u64,
    burst: u32,
    window_start: Option<Millis>,
    in_window: u32,
    suppressed: u64,
}

impl LogLimit {
    /// At most `burst` lines per `window_ms` milliseconds.
    #[must_use]
    pub const fn new(burst: u32, window_ms: u64) -> Self {
        LogLimit {
            window_ms,
            burst,
            window_start: None,
            in_window: 0,
            suppressed: 0,
        }
    }

    /// Whether to log an event at `now`. `Some(n)`: log it, and mention that
    /// `n` similar events were suppressed before it (when `n > 0`). `None`:
    /// stay quiet; it has been counted.
    pub fn allow(&mut self, now: Millis) -> Option<u64> {
        let fresh = match self.window_start {
            None => true,
            Some(start) => now.since(start) >= self.window_ms,
        };
        if fresh {
            self.window_start = Some(now);
            self.in_window = 0;
        }
        if self.in_window < self.burst {
            self.in_window += 1;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_the_rest_is_counted_until_the_next_window() {
        let mut l = LogLimit::new(2, 1000);
        assert_eq!(l.allow(Millis(0)), Some(0));
        assert_eq!(l.allow(Millis(1)), Some(0));
        assert_eq!(l.allow(Millis(2)), None);
        assert_eq!(l.allow(Millis(3)), None);
        assert_eq!(l.allow(Millis(1000)), Some(2));
        assert_eq!(l.allow(Millis(1001)), Some(0));
    }
}

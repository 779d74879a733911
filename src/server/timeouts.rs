//! The periodic scan for timeouts: TLS handshakes unfinished for
//! `--handshake-timeout`, frames half-sent and replies unread for
//! `--frame-timeout`.

use crate::service::Service;
use crate::time::Millis;

use super::{millis, Server};

/// How often connections are checked for timeouts.
pub(super) const SCAN_INTERVAL_MS: u64 = 1000;

impl<S: Service> Server<S> {
    /// Timeouts: TLS handshakes, half-sent frames and replies that make
    /// no progress.
    pub(super) fn scan(&mut self, now: Millis) {
        self.next_scan = now.add_ms(SCAN_INTERVAL_MS);
        self.identities.sweep(now);
        let frame_limit = self.config.frame_timeout.map(millis);
        let handshake_limit = millis(self.config.handshake_limit());
        let mut expired = Vec::new();
        for (key, c) in &self.conns {
            if !c.is_open() {
                continue;
            }
            let handshake = c.handshake_expired(now, handshake_limit);
            let (partial, stalled) = frame_limit.map_or((false, false), |limit| {
                (c.partial_expired(now, limit), c.output_stalled(now, limit))
            });
            if handshake || partial || stalled {
                expired.push((key, partial || handshake, handshake));
            }
        }
        for (key, partial, handshake) in expired {
            self.stats.limit_closes += 1;
            if let Some(n) = self.logs.limits.allow(now) {
                let peer = self.conns[key].peer();
                let what = if handshake {
                    "a TLS handshake unfinished for --handshake-timeout"
                } else if partial {
                    "a frame half-sent for --frame-timeout"
                } else {
                    "unread replies for --frame-timeout"
                };
                log::warn!("closing {peer}: {what} ({n} similar closes not logged)");
            }
            if partial {
                self.start_close(now, key, true);
            } else {
                self.close_now(now, key);
            }
        }
    }
}

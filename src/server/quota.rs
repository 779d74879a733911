//! The quotas per identity and the memory budget, as the loop keeps them
//! (docs/SECURITY.md, "Quotas and the memory budget"):
//!
//! * a new connection is refused (accepted and closed at once) when its
//!   identity has `--max-conns-per-identity` connections open, when it is
//!   TLS and its source address has `--max-handshakes-per-identity`
//!   handshakes under way, or when the connections' buffers alone fill
//!   `--max-memory`; a TLS connection whose client certificate names an
//!   identity at its connection quota is closed when its handshake is done;
//! * the connections' bytes (buffers' capacities, a TLS session's
//!   estimate, a fixed part) are kept as a running total, recounted for a
//!   connection only where the loop touches it anyway (the end of its input
//!   turn, its write), and handed to the service each turn: single mode's
//!   engine refuses new keys and waiters past what is left of the budget;
//! * the engine's quota refusals (`EngineStats::quotas`) are logged once
//!   per turn at most, naming the identity, at one line per 10 s per kind.

use std::fmt::Display;

use crate::engine::QuotaRefusals;
use crate::service::Service;
use crate::time::Millis;

use super::conn::{Conn, CONN_BYTES, RBUF_INITIAL};
use super::identity::{Identities, Identity};
use super::ratelimit::LogLimit;
use super::{Server, Stats};

/// One log line per kind of refusal per this many milliseconds.
const LOG_WINDOW_MS: u64 = 10_000;

/// The rate limits of the quotas' log lines, one per kind.
#[derive(Debug)]
pub(super) struct QuotaLogs {
    conns: LogLimit,
    handshakes: LogLimit,
    memory: LogLimit,
    keys: LogLimit,
    waiters: LogLimit,
    /// The engine's refusals already logged or passed over.
    seen: QuotaRefusals,
}

impl Default for QuotaLogs {
    fn default() -> Self {
        QuotaLogs {
            conns: LogLimit::new(1, LOG_WINDOW_MS),
            handshakes: LogLimit::new(1, LOG_WINDOW_MS),
            memory: LogLimit::new(1, LOG_WINDOW_MS),
            keys: LogLimit::new(1, LOG_WINDOW_MS),
            waiters: LogLimit::new(1, LOG_WINDOW_MS),
            seen: QuotaRefusals::default(),
        }
    }
}

impl<S: Service> Server<S> {
    /// Whether the TCP listener speaks TLS.
    pub(super) fn tls_listener(&self) -> bool {
        #[cfg(feature = "tls")]
        return self.tls.is_some();
        #[cfg(not(feature = "tls"))]
        false
    }

    /// Whether a new connection of `identity` from `peer` (a TLS one:
    /// `tls`) is refused for its identity's quotas or the memory budget:
    /// if so, counted and (rate-limited) logged; the caller drops it.
    pub(super) fn refused_by_quota(
        &mut self,
        now: Millis,
        peer: &dyn Display,
        identity: &Identity,
        tls: bool,
    ) -> bool {
        let (conns, handshakes) = self.identities.counts(identity);
        let logs = &mut self.quota_logs;
        let (log, why) = if conns as usize >= self.config.max_conns_per_identity {
            self.stats.refused_identity += 1;
            let why = format!("{conns} connections open, its --max-conns-per-identity quota");
            (&mut logs.conns, why)
        } else if tls && handshakes as usize >= self.config.max_handshakes_per_identity {
            self.stats.refused_handshakes += 1;
            let why =
                format!("{handshakes} TLS handshakes under way, its --max-handshakes-per-identity");
            (&mut logs.handshakes, why)
        } else if self.conn_bytes + (CONN_BYTES + RBUF_INITIAL) as u64
            > self.config.engine.max_memory
        {
            self.stats.refused_memory += 1;
            let why = format!(
                "the connections' buffers take {} bytes of --max-memory {}",
                self.conn_bytes, self.config.engine.max_memory
            );
            (&mut logs.memory, why)
        } else {
            return false;
        };
        if let Some(n) = log.allow(now) {
            log::warn!("refused {peer} ({identity}): {why} ({n} similar refusals not logged)");
        }
        true
    }

    /// Logs the quota refusals the engine made since the last call, one
    /// line per kind per window, naming the identity refused last.
    pub(super) fn note_quota_refusals(&mut self, now: Millis) {
        let Some(q) = self
            .service
            .observe()
            .and_then(|o| o.lock_table())
            .map(|e| e.stats().quotas)
        else {
            return;
        };
        let logs = &mut self.quota_logs;
        if q == logs.seen {
            return;
        }
        let who = self
            .identities
            .name_of(q.last_holder)
            .unwrap_or_else(|| "an identity".to_owned());
        let max = &self.config.engine;
        for (now_n, seen_n, log, what) in [
            (
                q.keys,
                logs.seen.keys,
                &mut logs.keys,
                format!(
                    "{who} holds its --max-keys-per-identity {}",
                    max.max_keys_per_holder
                ),
            ),
            (
                q.waiters,
                logs.seen.waiters,
                &mut logs.waiters,
                format!(
                    "{who} has its --max-waiters-per-identity {} queued",
                    max.max_waiters_per_holder
                ),
            ),
            (
                q.memory,
                logs.seen.memory,
                &mut logs.memory,
                format!(
                    "keys, waiters and connection buffers reach --max-memory {}",
                    max.max_memory
                ),
            ),
        ] {
            if now_n > seen_n {
                if let Some(n) = log.allow(now) {
                    log::warn!(
                        "answered B to {} acquires: {what} ({n} similar lines not logged)",
                        now_n - seen_n
                    );
                }
            }
        }
        logs.seen = q;
    }
}

/// A new connection's place in the quotas: counted as half-open while its
/// TLS handshake is under way.
pub(super) fn count_new(identities: &mut Identities, c: &Conn) {
    if c.handshaking() {
        if let Some(e) = identities.get_mut(c.ident()) {
            e.handshakes += 1;
        }
    }
}

/// A connection leaves for good: no longer half-open.
pub(super) fn uncount(identities: &mut Identities, c: &Conn) {
    if c.handshaking() {
        if let Some(e) = identities.get_mut(c.ident()) {
            e.handshakes = e.handshakes.saturating_sub(1);
        }
    }
}

/// The TLS handshake of `c` was found done, with the identity its client
/// certificate names (`cert`): it is no longer half-open, and moves to that
/// identity unless the identity is at its connection quota. False: refused
/// (counted and logged); the caller closes it.
pub(super) fn handshake_done(
    server: (&mut Identities, &mut Stats, &mut QuotaLogs, usize),
    c: &mut Conn,
    cert: Option<Identity>,
    now: Millis,
) -> bool {
    let (identities, stats, logs, max_conns) = server;
    if let Some(e) = identities.get_mut(c.ident()) {
        e.handshakes = e.handshakes.saturating_sub(1);
    }
    let Some(identity) = cert else {
        return true;
    };
    let (conns, _) = identities.counts(&identity);
    if conns as usize >= max_conns {
        stats.refused_identity += 1;
        if let Some(n) = logs.conns.allow(now) {
            log::warn!(
                "closing {} ({identity}): {conns} connections open, its \
                 --max-conns-per-identity quota ({n} similar refusals not logged)",
                c.peer()
            );
        }
        return false;
    }
    // Its requests count as its certificate's from the first one.
    let old = c.ident();
    c.set_ident(identities.attach(identity));
    identities.detach(old, now);
    true
}

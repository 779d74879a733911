//! `GET /metrics`: the scrape, in the Prometheus text format.

use crate::engine::LockTable;
use crate::metrics::Exposition;
use crate::service::Observe;
use crate::time::Millis;

use super::super::Stats;
use super::View;

/// The scrape: the server's counters, the engine's, then the service's own.
pub(super) fn render_metrics(now: Millis, view: &View<'_>) -> String {
    let mut e = Exposition::new();
    connection_metrics(&mut e, view);
    request_metrics(&mut e, view.stats);
    if let Some(observed) = view.observed {
        if let Some(engine) = observed.lock_table() {
            lock_metrics(&mut e, now, engine, observed);
        }
    }
    quota_metrics(&mut e, view);
    if let Some(observed) = view.observed {
        observed.write_metrics(now, &mut e);
    }
    e.finish()
}

/// The build, and the client connections: open, refused, malformed.
fn connection_metrics(e: &mut Exposition, view: &View<'_>) {
    let s = view.stats;
    e.info(
        "ticketd_build_info",
        "Always 1; the version of this ticketd.",
        &[("version", env!("CARGO_PKG_VERSION"))],
    );
    e.gauge(
        "ticketd_connections",
        "Open client connections.",
        view.connections as u64,
    );
    e.labelled_counter(
        "ticketd_connections_refused_total",
        "Connections accepted and closed at once, by the limit reached.",
        "reason",
        &[
            ("max_conns", s.refused),
            ("peer_not_allowed", s.refused_peer),
            ("admin_max_conns", s.admin_refused),
            ("admin_peer_not_allowed", s.admin_refused_peer),
            ("identity", s.refused_identity),
            ("handshakes", s.refused_handshakes),
            ("memory", s.refused_memory),
        ],
    );
    e.counter(
        "ticketd_malformed_total",
        "Client connections closed for a malformed frame.",
        s.malformed,
    );
    e.gauge(
        "ticketd_identities",
        "Client identities remembered: with open connections, or owing guess budget.",
        view.identities.len() as u64,
    );
    e.counter(
        "ticketd_guess_misses_total",
        "N and X answers charged to the guess budgets of client identities.",
        s.guesses,
    );
    e.counter(
        "ticketd_guess_slowdowns_total",
        "Times an identity's guess budget first held back its releases and extends.",
        s.throttled,
    );
}

/// The quotas per identity and the memory budget: refusals and bytes.
fn quota_metrics(e: &mut Exposition, view: &View<'_>) {
    let s = view.stats;
    let engine = view.lock_table();
    let q = engine.map(|e| e.stats().quotas).unwrap_or_default();
    e.labelled_counter(
        "ticketd_quota_refusals_total",
        "Acquires answered B and connections refused, by the quota or budget reached.",
        "quota",
        &[
            ("keys", q.keys),
            ("waiters", q.waiters),
            ("connections", s.refused_identity),
            ("handshakes", s.refused_handshakes),
            ("memory", q.memory + s.refused_memory),
        ],
    );
    e.labelled_gauge(
        "ticketd_memory_bytes",
        "The memory budget's estimate of the bytes in use, by part.",
        "part",
        &[
            ("locks", engine.map_or(0, LockTable::memory_bytes)),
            ("connections", view.connection_bytes),
        ],
    );
    e.gauge(
        "ticketd_memory_limit_bytes",
        "The memory budget (--max-memory).",
        view.max_memory,
    );
}

/// The requests handled and the replies produced, by kind.
fn request_metrics(e: &mut Exposition, s: &Stats) {
    e.labelled_counter(
        "ticketd_requests_total",
        "Well-formed requests handled, by operation.",
        "op",
        &[
            ("acquire", s.requests[0]),
            ("release", s.requests[1]),
            ("extend", s.requests[2]),
        ],
    );
    let r = &s.replies;
    e.labelled_counter(
        "ticketd_replies_total",
        "Replies produced, by kind (one to a connection that closed meanwhile is dropped).",
        "reply",
        &[
            ("acquired", r[0]),
            ("timeout", r[1]),
            ("busy", r[2]),
            ("released", r[3]),
            ("not_released", r[4]),
            ("extended", r[5]),
            ("not_extended", r[6]),
        ],
    );
}

/// The lock table: keys, waiters, grants, expiries, wait and hold times.
fn lock_metrics(e: &mut Exposition, now: Millis, engine: &dyn LockTable, service: &dyn Observe) {
    let es = engine.stats();
    e.gauge(
        "ticketd_keys",
        "Registered keys.",
        engine.key_count() as u64,
    );
    e.gauge(
        "ticketd_waiters",
        "Queued acquires over all keys.",
        engine.waiter_count() as u64,
    );
    e.labelled_counter(
        "ticketd_grants_total",
        "Grants, by path: a free key, an expired one taken over, a hand-over to the head waiter.",
        "path",
        &[
            ("fresh", es.grants_fresh),
            ("takeover", es.grants_takeover),
            ("handover", es.grants_handover),
        ],
    );
    e.labelled_counter(
        "ticketd_permit_grants_total",
        "Grants of keys of limit 2 or more (protocol 1.2), by mode; also in ticketd_grants_total.",
        "mode",
        &[
            ("shared", es.permit_grants_shared),
            ("exclusive", es.permit_grants_exclusive),
        ],
    );
    e.counter(
        "ticketd_limit_mismatches_total",
        "Acquires with a limit other than their key's, answered LimitMismatch (protocol 1.2).",
        es.limit_mismatches,
    );
    e.counter(
        "ticketd_lease_expiries_total",
        "Grants whose lease ran out before a release.",
        es.lease_expiries,
    );
    let (wait, hold) = service
        .lock_histograms()
        .unwrap_or((&es.wait_ms, &es.hold_ms));
    e.histogram(
        "ticketd_wait_seconds",
        "Request to grant, for every grant.",
        wait,
        1000,
    );
    e.histogram(
        "ticketd_hold_seconds",
        "Grant to release or expiry.",
        hold,
        1000,
    );
    e.gauge_seconds(
        "ticketd_oldest_hold_seconds",
        "How long the longest-held current lock has been held; 0 when none is.",
        service.oldest_hold_ms(now).unwrap_or(0),
        1000,
    );
}

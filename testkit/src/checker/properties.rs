//! The checks of each property on the gathered records.

use super::*;

/// Every operation answered exactly once, or its session closed after it was
/// invoked; no answer on a session after it closed.
pub(super) fn check_answered(
    acqs: &BTreeMap<OpId, AcqRec>,
    rels: &BTreeMap<OpId, RelRec>,
    closed: &HashMap<SessionId, u64>,
) -> Result<(), Violation> {
    check_acquires_answered(acqs, closed)?;
    check_releases_answered(rels, closed)
}

/// The acquire half of [`check_answered`]: each acquire answered, or its
/// session closed after it was invoked and before any answer but its own
/// `Indeterminate`.
fn check_acquires_answered(
    acqs: &BTreeMap<OpId, AcqRec>,
    closed: &HashMap<SessionId, u64>,
) -> Result<(), Violation> {
    for a in acqs.values() {
        let closed_us = closed.get(&a.session).copied();
        match (a.answer, closed_us) {
            (None, None) => {
                return Err(violation(
                    Property::AnsweredOnce,
                    format!(
                        "{} on key {:?} was never answered and its session stayed open",
                        a.describe(),
                        a.key
                    ),
                ))
            }
            (None, Some(c)) if c < a.invoked_us => {
                return Err(violation(
                    Property::AnsweredOnce,
                    format!(
                        "{} on key {:?} was invoked on session {} after it closed at {c}us",
                        a.describe(),
                        a.key,
                        a.session
                    ),
                ))
            }
            // Indeterminate is how a client reports closing the session itself.
            (Some((outcome, at)), Some(c)) if at > c && outcome != Outcome::Indeterminate => {
                return Err(violation(
                    Property::AnsweredOnce,
                    format!(
                        "{} on key {:?} answered {outcome:?} at {at}us, after its session \
                         closed at {c}us",
                        a.describe(),
                        a.key
                    ),
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// The release half of [`check_answered`]: each release answered at most
/// once, and at least once unless its session closed.
fn check_releases_answered(
    rels: &BTreeMap<OpId, RelRec>,
    closed: &HashMap<SessionId, u64>,
) -> Result<(), Violation> {
    for r in rels.values() {
        let closed_us = closed.get(&r.session).copied();
        if r.answers.len() > 1 {
            return Err(violation(
                Property::AnsweredOnce,
                format!(
                    "release op {} of token {} on key {:?} by client {} answered {} times: {:?}",
                    r.op,
                    r.token,
                    r.key,
                    r.client,
                    r.answers.len(),
                    r.answers
                ),
            ));
        }
        if r.answers.is_empty() && closed_us.is_none() {
            return Err(violation(
                Property::AnsweredOnce,
                format!(
                    "release op {} of token {} on key {:?} by client {} was never answered \
                     and its session stayed open",
                    r.op, r.token, r.key, r.client
                ),
            ));
        }
    }
    Ok(())
}

/// Tokens unique, non-zero, and in real-time order across all grants.
pub(super) fn check_tokens(acqs: &BTreeMap<OpId, AcqRec>) -> Result<(), Violation> {
    let grants: Vec<(&AcqRec, u64, u64)> = acqs
        .values()
        .filter_map(|a| Some((a, a.token()?, a.answer?.1)))
        .collect();
    let mut by_token: HashMap<u64, &AcqRec> = HashMap::new();
    for &(a, token, _) in &grants {
        if token == 0 {
            return Err(violation(
                Property::TokenOrder,
                format!("{} on key {:?} was granted token 0", a.describe(), a.key),
            ));
        }
        if let Some(other) = by_token.insert(token, a) {
            return Err(violation(
                Property::TokenOrder,
                format!(
                    "token {token} granted twice: to {} on key {:?} and to {} on key {:?}",
                    other.describe(),
                    other.key,
                    a.describe(),
                    a.key
                ),
            ));
        }
    }
    // Sweep acquires in invocation order; every grant received strictly
    // before an acquire was invoked must carry a smaller token than it.
    let mut by_received: Vec<&(&AcqRec, u64, u64)> = grants.iter().collect();
    by_received.sort_by_key(|g| g.2);
    let mut by_invoked: Vec<&(&AcqRec, u64, u64)> = grants.iter().collect();
    by_invoked.sort_by_key(|g| g.0.invoked_us);
    let mut highest: Option<&(&AcqRec, u64, u64)> = None;
    let mut i = 0;
    for g in by_invoked {
        while i < by_received.len() && by_received[i].2 < g.0.invoked_us {
            if highest.is_none_or(|h| by_received[i].1 > h.1) {
                highest = Some(by_received[i]);
            }
            i += 1;
        }
        if let Some(h) = highest {
            if h.1 >= g.1 {
                return Err(violation(
                    Property::TokenOrder,
                    format!(
                        "token {} (to {} on key {:?}, received at {}us) is not below token {} \
                         (to {} on key {:?}), which was invoked later",
                        h.1,
                        h.0.describe(),
                        h.0.key,
                        h.2,
                        g.1,
                        g.0.describe(),
                        g.0.key
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Every grant received before a restart carries a token below the first
/// token of the incarnation that restart began.
pub(super) fn check_restarts(
    acqs: &BTreeMap<OpId, AcqRec>,
    restarts: &[(u64, u64, bool)],
) -> Result<(), Violation> {
    for a in acqs.values() {
        let (Some(token), Some((_, received_us))) = (a.token(), a.answer) else {
            continue;
        };
        for &(at_us, first_token, _) in restarts {
            if received_us <= at_us && token >= first_token {
                return Err(violation(
                    Property::TokenOrder,
                    format!(
                        "token {token} (to {} on key {:?}, received at {received_us}us) is not \
                         below the first token {first_token} of the restart at {at_us}us",
                        a.describe(),
                        a.key
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Among acquires queued on one key, a later one is never granted while an
/// earlier one is still waiting; on a key of limit 2 or more (no takeover,
/// PROTOCOL §6.2) neither is one granted without queueing.
pub(super) fn check_fifo(
    acqs: &BTreeMap<OpId, AcqRec>,
    closed: &HashMap<SessionId, u64>,
) -> Result<(), Violation> {
    let mut per_key: HashMap<&str, Vec<&AcqRec>> = HashMap::new();
    let mut unqueued: HashMap<&str, Vec<&AcqRec>> = HashMap::new();
    for a in acqs.values() {
        if a.queued_us.is_some() {
            per_key.entry(a.key.as_str()).or_default().push(a);
        } else if a.places.limit > 1 && a.token().is_some() {
            unqueued.entry(a.key.as_str()).or_default().push(a);
        }
    }
    let mut keys: Vec<_> = per_key.into_iter().collect();
    keys.sort_by(|x, y| x.0.cmp(y.0));
    for (key, mut queue) in keys {
        queue.sort_by_key(|a| (a.queued_us, a.op));
        for (j, later) in queue.iter().enumerate() {
            let later_q = later.queued_us.unwrap_or(0);
            // Queued at the same moment: no order to keep.
            let before = queue[..j]
                .iter()
                .filter(|e| e.queued_us.unwrap_or(0) < later_q);
            check_not_passed(key, later, "queued", later_q, before, closed)?;
        }
        for later in unqueued.get(key).map_or(&[][..], Vec::as_slice) {
            // Queued a server clock tick (a millisecond) before the later
            // one was even sent: the server had it in the queue first.
            let before = queue.iter().filter(|e| {
                e.places.limit > 1 && e.queued_us.unwrap_or(0) + 1_000 <= later.invoked_us
            });
            let invoked = later.invoked_us;
            check_not_passed(key, later, "not queued, invoked", invoked, before, closed)?;
        }
    }
    Ok(())
}

/// Fails when acquire `later` (on `key`, `what` at `since_us`) was granted
/// while one of the queued acquires `before` it was still waiting: session
/// open, wait not run out, and later answered Timeout, Busy or
/// LimitMismatch, or granted a larger token.
fn check_not_passed<'a>(
    key: &str,
    later: &AcqRec,
    what: &str,
    since_us: u64,
    before: impl Iterator<Item = &'a &'a AcqRec>,
    closed: &HashMap<SessionId, u64>,
) -> Result<(), Violation> {
    let (Some(later_token), Some((_, granted_us))) = (later.token(), later.answer) else {
        return Ok(());
    };
    for earlier in before {
        let q = earlier.queued_us.unwrap_or(0);
        let wait_end = q.saturating_add(u64::from(earlier.wait_s) * 1_000_000);
        // Only an earlier acquire known not to have been served first
        // counts: one that never saw its answer may have been granted
        // (its client paused or gone) and lost the grant to its lease.
        let passed_over = match earlier.answer {
            Some((Outcome::Timeout | Outcome::Busy | Outcome::LimitMismatch { .. }, at)) => {
                at > granted_us
            }
            Some((Outcome::Granted { token } | Outcome::LateGrant { token }, _)) => {
                token > later_token
            }
            Some((Outcome::Indeterminate, _)) | None => false,
        };
        let still_waiting = passed_over
            && wait_end > granted_us
            && closed.get(&earlier.session).is_none_or(|&c| c > granted_us);
        if still_waiting {
            return Err(violation(
                Property::Fifo,
                format!(
                    "key {key:?}: {} ({what} at {since_us}us) was granted token {later_token} \
                     at {granted_us}us while {} (queued at {q}us, waiting until \
                     {wait_end}us) was still waiting; it got {:?}",
                    later.describe(),
                    earlier.describe(),
                    earlier.answer.map(|(o, _)| o)
                ),
            ));
        }
    }
    Ok(())
}

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

/// The conservative lease end of a grant invoked at `invoked_us` for
/// `lease_s`, as its extensions move it (PROTOCOL §5.3), walked in time order:
///
/// * an extension invoked before the end lowers it at once to its own
///   invocation plus its lease if that is earlier: a shorter lease may take
///   effect on the server before any answer comes back;
/// * an `E` answered before the end sets it to that extension's invocation
///   plus its lease, but no later than the same bound of every other
///   extension that may still apply after it (invoked before that answer,
///   and not answered before this one was invoked, nor refused);
/// * a late `E`, an `X` or no answer moves nothing else.
pub(super) fn lease_end_us(invoked_us: u64, lease_s: u8, exts: &[ExtRec]) -> u64 {
    let mut end = invoked_us.saturating_add(u64::from(lease_s.max(1)) * 1_000_000);
    // (time, is an answer, index): invocations before answers at one time.
    let mut steps: Vec<(u64, bool, usize)> = Vec::new();
    for (i, x) in exts.iter().enumerate() {
        steps.push((x.invoked_us, false, i));
        if let Some((ExtendOutcome::Extended, at)) = x.answer {
            steps.push((at, true, i));
        }
    }
    steps.sort_unstable();
    for (at, is_answer, i) in steps {
        if at >= end {
            continue;
        }
        let x = &exts[i];
        if !is_answer {
            end = end.min(x.ends_us());
            continue;
        }
        let mut new_end = x.ends_us();
        for (j, y) in exts.iter().enumerate() {
            let settled_before = y.answer.is_some_and(|(_, ans)| ans < x.invoked_us);
            if j != i && y.invoked_us <= at && !settled_before && y.may_apply() {
                new_end = new_end.min(y.ends_us());
            }
        }
        end = new_end;
    }
    end
}

/// The interval during which a client may act on a grant: from receipt to
/// the earlier of its first release and its conservative lease end as its
/// extensions moved it ([`lease_end_us`]).
pub(super) fn interval(
    a: &AcqRec,
    rels: &HashMap<(&str, u64), u64>,
    exts: &Extensions<'_>,
    margin_us: u64,
) -> Option<(u64, u64, u64)> {
    let (Outcome::Granted { token }, received_us) = a.answer? else {
        return None;
    };
    let grant_exts = exts
        .get(&(a.key.as_str(), token))
        .map_or(&[][..], Vec::as_slice);
    let lease_end = lease_end_us(a.invoked_us, a.lease_s, grant_exts).saturating_sub(margin_us);
    let end = rels
        .get(&(a.key.as_str(), token))
        .map_or(lease_end, |&r| r.min(lease_end));
    Some((received_us, end, token))
}

/// A grant's interval: start, end (exclusive), token, and its acquire.
type Interval<'a> = (u64, u64, u64, &'a AcqRec);

/// Per key and server incarnation, no two grant intervals overlap.
pub(super) fn check_exclusion(
    acqs: &BTreeMap<OpId, AcqRec>,
    releases: &BTreeMap<OpId, RelRec>,
    exts: &Extensions<'_>,
    restarts: &[(u64, u64, bool)],
    margin_us: u64,
) -> Result<(), Violation> {
    // Which incarnation issued a token: tokens only grow across restarts
    // (checked by check_restarts), so it is the number of restarts whose
    // first token is at or below it. A restart with a grace does not begin
    // a new one for this check: it kept exclusion across it.
    let incarnation = |token: u64| restarts.iter().filter(|r| !r.2 && r.1 <= token).count();
    // The earliest release of each (key, token), whoever sent it.
    let mut first_release: HashMap<(&str, u64), u64> = HashMap::new();
    for r in releases.values() {
        let t = first_release
            .entry((r.key.as_str(), r.token))
            .or_insert(r.invoked_us);
        *t = (*t).min(r.invoked_us);
    }
    let mut per_key: HashMap<(&str, usize), Vec<Interval<'_>>> = HashMap::new();
    for a in acqs.values() {
        if let Some((start, end, token)) = interval(a, &first_release, exts, margin_us) {
            if start < end {
                per_key
                    .entry((a.key.as_str(), incarnation(token)))
                    .or_default()
                    .push((start, end, token, a));
            }
        }
    }
    let mut keys: Vec<_> = per_key.into_iter().collect();
    keys.sort_by(|x, y| x.0.cmp(&y.0));
    for ((key, _), mut ivs) in keys {
        ivs.sort_by_key(|iv| (iv.0, iv.1));
        let mut widest: Option<&Interval<'_>> = None;
        for iv in &ivs {
            if let Some(w) = widest {
                if iv.0 < w.1 {
                    return Err(violation(
                        Property::MutualExclusion,
                        format!(
                            "key {key:?}: token {} held by client {} during [{}us, {}us) \
                             overlaps token {} held by client {} during [{}us, {}us)",
                            w.2, w.3.client, w.0, w.1, iv.2, iv.3.client, iv.0, iv.1
                        ),
                    ));
                }
            }
            if widest.is_none_or(|w| iv.1 > w.1) {
                widest = Some(iv);
            }
        }
    }
    Ok(())
}

/// Among acquires queued on one key, a later one is never granted while an
/// earlier one is still waiting.
pub(super) fn check_fifo(
    acqs: &BTreeMap<OpId, AcqRec>,
    closed: &HashMap<SessionId, u64>,
) -> Result<(), Violation> {
    let mut per_key: HashMap<&str, Vec<&AcqRec>> = HashMap::new();
    for a in acqs.values().filter(|a| a.queued_us.is_some()) {
        per_key.entry(a.key.as_str()).or_default().push(a);
    }
    let mut keys: Vec<_> = per_key.into_iter().collect();
    keys.sort_by(|x, y| x.0.cmp(y.0));
    for (key, mut queue) in keys {
        queue.sort_by_key(|a| (a.queued_us, a.op));
        for (j, later) in queue.iter().enumerate() {
            let (Some(later_token), Some((_, granted_us))) = (later.token(), later.answer) else {
                continue;
            };
            let later_q = later.queued_us.unwrap_or(0);
            for earlier in &queue[..j] {
                let q = earlier.queued_us.unwrap_or(0);
                if q >= later_q {
                    continue; // queued at the same moment: no order to keep
                }
                let wait_end = q.saturating_add(u64::from(earlier.wait_s) * 1_000_000);
                // Only an earlier acquire known not to have been served first
                // counts: one that never saw its answer may have been granted
                // (its client paused or gone) and lost the grant to its lease.
                let passed_over = match earlier.answer {
                    Some((Outcome::Timeout | Outcome::Busy, at)) => at > granted_us,
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
                            "key {key:?}: {} (queued at {}us) was granted token {later_token} at \
                             {granted_us}us while {} (queued at {q}us, waiting until \
                             {wait_end}us) was still waiting; it got {:?}",
                            later.describe(),
                            later_q,
                            earlier.describe(),
                            earlier.answer.map(|(o, _)| o)
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

//! Mutual exclusion and its generalisation to permits (PROTOCOL §6.2):
//! the grant intervals of each key, swept in time order.

use super::*;

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
fn lease_end_us(invoked_us: u64, lease_s: u8, exts: &[ExtRec]) -> u64 {
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
fn interval(
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

/// The grant intervals per key and server incarnation, each list in order
/// of start (then end), the keys in order.
fn intervals_per_key<'a>(
    acqs: &'a BTreeMap<OpId, AcqRec>,
    releases: &'a BTreeMap<OpId, RelRec>,
    exts: &Extensions<'_>,
    restarts: &[(u64, u64, bool)],
    margin_us: u64,
) -> Vec<((&'a str, usize), Vec<Interval<'a>>)> {
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
    for (_, ivs) in &mut keys {
        ivs.sort_by_key(|iv| (iv.0, iv.1));
    }
    keys
}

/// Per key and server incarnation, the grant intervals standing at any
/// instant fit the key: one alone on a key of limit 1 (mutual exclusion);
/// otherwise all of one limit, at most that many, and an exclusive one
/// alone.
pub(super) fn check_exclusion(
    acqs: &BTreeMap<OpId, AcqRec>,
    releases: &BTreeMap<OpId, RelRec>,
    exts: &Extensions<'_>,
    restarts: &[(u64, u64, bool)],
    margin_us: u64,
) -> Result<(), Violation> {
    for ((key, _), ivs) in intervals_per_key(acqs, releases, exts, restarts, margin_us) {
        // The intervals standing when the next one starts.
        let mut standing: Vec<&Interval<'_>> = Vec::new();
        for iv in &ivs {
            standing.retain(|s| s.1 > iv.0);
            check_beside(key, iv, &standing)?;
            standing.push(iv);
        }
    }
    Ok(())
}

/// The limit an acquire asked for (0, which the codec refuses, as 1).
fn limit_of(a: &AcqRec) -> u16 {
    a.places.limit.max(1)
}

/// A grant interval as a failure message names it.
fn held(iv: &Interval<'_>) -> String {
    format!(
        "token {} held by client {} during [{}us, {}us)",
        iv.2, iv.3.client, iv.0, iv.1
    )
}

/// Checks that interval `iv` of `key` may start beside the intervals
/// `standing` at its start.
fn check_beside(key: &str, iv: &Interval<'_>, standing: &[&Interval<'_>]) -> Result<(), Violation> {
    // The one that stands longest (the first of them), as the mutex
    // check has always named it.
    let Some(widest) = standing
        .iter()
        .copied()
        .reduce(|w, s| if s.1 > w.1 { s } else { w })
    else {
        return Ok(());
    };
    let limit = limit_of(iv.3);
    let mutex = if limit == 1 {
        Some(widest)
    } else {
        standing.iter().copied().find(|s| limit_of(s.3) == 1)
    };
    if let Some(other) = mutex {
        return Err(violation(
            Property::MutualExclusion,
            format!("key {key:?}: {} overlaps {}", held(other), held(iv)),
        ));
    }
    if let Some(other) = standing.iter().find(|s| limit_of(s.3) != limit) {
        return Err(violation(
            Property::KeyLimit,
            format!(
                "key {key:?}: {} granted with limit {} overlaps {} granted with limit {limit}",
                held(other),
                limit_of(other.3),
                held(iv)
            ),
        ));
    }
    let exclusive = |s: &Interval<'_>| s.3.places.mode == Mode::Exclusive;
    let beside = if exclusive(iv) {
        Some(widest)
    } else {
        standing.iter().copied().find(|s| exclusive(s))
    };
    if let Some(other) = beside {
        return Err(violation(
            Property::ExclusiveAlone,
            format!(
                "key {key:?} (limit {limit}): {} {} overlaps {} {}",
                other.3.places.mode,
                held(other),
                iv.3.places.mode,
                held(iv)
            ),
        ));
    }
    if standing.len() >= usize::from(limit) {
        let all: Vec<String> = standing.iter().map(|s| held(s)).chain([held(iv)]).collect();
        return Err(violation(
            Property::PermitCount,
            format!(
                "key {key:?} (limit {limit}): {} grants at once at {}us: {}",
                all.len(),
                iv.0,
                all.join(", ")
            ),
        ));
    }
    Ok(())
}

/// A LimitMismatch answer names the limit of a grant that stood on its key
/// from before the acquire was invoked until after it was answered, and
/// never the acquire's own limit. Checked against grants only in histories
/// without a restart: a restarted single-mode server has forgotten every
/// key's limit, even while a grace keeps the keys held, so a client's
/// interval says nothing of the limit the new server registered.
pub(super) fn check_limit_answers(
    acqs: &BTreeMap<OpId, AcqRec>,
    releases: &BTreeMap<OpId, RelRec>,
    exts: &Extensions<'_>,
    restarts: &[(u64, u64, bool)],
    margin_us: u64,
) -> Result<(), Violation> {
    let lost_state = !restarts.is_empty();
    let per_key: HashMap<&str, Vec<Interval<'_>>> = if lost_state {
        HashMap::new()
    } else {
        intervals_per_key(acqs, releases, exts, restarts, margin_us)
            .into_iter()
            .map(|((key, _), ivs)| (key, ivs))
            .collect()
    };
    for a in acqs.values() {
        let Some((Outcome::LimitMismatch { limit: named }, answered_us)) = a.answer else {
            continue;
        };
        if named == limit_of(a) {
            return Err(violation(
                Property::KeyLimit,
                format!(
                    "{} on key {:?} with limit {named} was answered LimitMismatch naming \
                     its own limit",
                    a.describe(),
                    a.key
                ),
            ));
        }
        let ivs = per_key.get(a.key.as_str()).map_or(&[][..], Vec::as_slice);
        let covering = ivs
            .iter()
            .find(|iv| iv.0 <= a.invoked_us && iv.1 >= answered_us && limit_of(iv.3) != named);
        if let Some(iv) = covering {
            return Err(violation(
                Property::KeyLimit,
                format!(
                    "{} on key {:?} was answered LimitMismatch with limit {named} at \
                     {answered_us}us, while {} granted with limit {} stood throughout",
                    a.describe(),
                    a.key,
                    held(iv),
                    limit_of(iv.3)
                ),
            ));
        }
    }
    Ok(())
}

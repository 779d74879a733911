//! A history's events gathered into per-operation records, checking on the
//! way that the history is well formed.

use super::*;

impl History {
    /// Every extension per (key, token), in invocation order; checks each is
    /// answered at most once, after it was invoked.
    pub(super) fn extensions(&self) -> Result<Extensions<'_>, Violation> {
        let mut invoked: HashMap<OpId, (&str, u64, u8, u64)> = HashMap::new();
        for e in &self.events {
            if let Event::Extend {
                op,
                key,
                token,
                lease_s,
                at_us,
                ..
            } = e
            {
                if invoked
                    .insert(*op, (key.as_str(), *token, *lease_s, *at_us))
                    .is_some()
                {
                    return Err(violation(
                        Property::Malformed,
                        format!("extension op {op} invoked twice"),
                    ));
                }
            }
        }
        let mut answered: HashMap<OpId, (ExtendOutcome, u64)> = HashMap::new();
        for e in &self.events {
            let Event::Extended { op, outcome, at_us } = e else {
                continue;
            };
            let Some(&(key, token, _, inv)) = invoked.get(op) else {
                return Err(violation(
                    Property::Malformed,
                    format!("answer {outcome:?} to unknown extension op {op}"),
                ));
            };
            if *at_us < inv {
                return Err(violation(
                    Property::Malformed,
                    format!("extension op {op} answered at {at_us}us, before it was invoked"),
                ));
            }
            if answered.insert(*op, (*outcome, *at_us)).is_some() {
                return Err(violation(
                    Property::AnsweredOnce,
                    format!("extension op {op} of {key:?} token {token} answered twice"),
                ));
            }
        }
        let mut out: Extensions<'_> = HashMap::new();
        for (op, &(key, token, lease_s, inv)) in &invoked {
            out.entry((key, token)).or_default().push(ExtRec {
                invoked_us: inv,
                lease_s,
                answer: answered.get(op).copied(),
            });
        }
        for v in out.values_mut() {
            v.sort_unstable_by_key(|x| (x.invoked_us, x.lease_s));
        }
        Ok(out)
    }

    /// The restarts as (time, first token, graced), in time order; time
    /// and token must both grow.
    pub(super) fn restarts(&self) -> Result<Vec<(u64, u64, bool)>, Violation> {
        let mut r: Vec<(u64, u64, bool)> = self
            .events
            .iter()
            .filter_map(|e| match e {
                Event::ServerRestart {
                    at_us,
                    first_token,
                    graced,
                } => Some((*at_us, *first_token, *graced)),
                _ => None,
            })
            .collect();
        r.sort_unstable();
        for w in r.windows(2) {
            if w[1].1 < w[0].1 {
                return Err(violation(
                    Property::TokenOrder,
                    format!(
                        "the restart at {}us resumed at token {}, below the restart at {}us \
                         (token {})",
                        w[1].0, w[1].1, w[0].0, w[0].1
                    ),
                ));
            }
        }
        Ok(r)
    }

    /// Builds per-operation records and checks the history is well formed.
    #[allow(clippy::type_complexity)]
    pub(super) fn gather(
        &self,
    ) -> Result<
        (
            BTreeMap<OpId, AcqRec>,
            BTreeMap<OpId, RelRec>,
            HashMap<SessionId, u64>,
        ),
        Violation,
    > {
        let (mut acqs, mut rels) = self.invocations()?;
        self.record_answers(&mut acqs, &mut rels)?;
        Ok((acqs, rels, self.closed_sessions()))
    }

    /// When each session closed (its earliest close).
    fn closed_sessions(&self) -> HashMap<SessionId, u64> {
        let mut closed: HashMap<SessionId, u64> = HashMap::new();
        for e in &self.events {
            if let Event::SessionClosed { session, at_us } = e {
                let t = closed.entry(*session).or_insert(*at_us);
                *t = (*t).min(*at_us);
            }
        }
        closed
    }

    /// A record of every acquire and release invoked, not yet answered;
    /// checks no operation id is invoked twice.
    #[allow(clippy::type_complexity)]
    fn invocations(&self) -> Result<(BTreeMap<OpId, AcqRec>, BTreeMap<OpId, RelRec>), Violation> {
        let mut acqs = BTreeMap::new();
        let mut rels = BTreeMap::new();
        for e in &self.events {
            match e {
                Event::Acquire {
                    op,
                    client,
                    session,
                    key,
                    wait_s,
                    lease_s,
                    places,
                    at_us,
                    ..
                } => {
                    let rec = AcqRec {
                        op: *op,
                        client: *client,
                        session: *session,
                        key: key.clone(),
                        wait_s: *wait_s,
                        lease_s: *lease_s,
                        places: *places,
                        invoked_us: *at_us,
                        queued_us: None,
                        answer: None,
                    };
                    let again = acqs.insert(*op, rec).is_some() || rels.contains_key(op);
                    invoked_once(*op, again)?;
                }
                Event::Release {
                    op,
                    client,
                    session,
                    key,
                    token,
                    at_us,
                } => {
                    let rec = RelRec {
                        op: *op,
                        client: *client,
                        session: *session,
                        key: key.clone(),
                        token: *token,
                        invoked_us: *at_us,
                        answers: Vec::new(),
                    };
                    let again = rels.insert(*op, rec).is_some() || acqs.contains_key(op);
                    invoked_once(*op, again)?;
                }
                _ => {}
            }
        }
        Ok((acqs, rels))
    }

    /// Puts each queued event and answer into the record of its operation;
    /// checks each is of an operation invoked before it, and an acquire is
    /// answered at most once.
    fn record_answers(
        &self,
        acqs: &mut BTreeMap<OpId, AcqRec>,
        rels: &mut BTreeMap<OpId, RelRec>,
    ) -> Result<(), Violation> {
        for e in &self.events {
            match e {
                Event::Queued { op, at_us } => {
                    let Some(a) = acqs.get_mut(op) else {
                        return Err(violation(
                            Property::Malformed,
                            format!("queued event for unknown acquire op {op}"),
                        ));
                    };
                    a.queued_us = Some(*at_us);
                }
                Event::Acquired { op, outcome, at_us } => {
                    let Some(a) = acqs.get_mut(op) else {
                        return Err(violation(
                            Property::Malformed,
                            format!("answer {outcome:?} to unknown acquire op {op}"),
                        ));
                    };
                    record_acquire_answer(a, *outcome, *at_us)?;
                }
                Event::Released { op, outcome, at_us } => {
                    let Some(r) = rels.get_mut(op) else {
                        return Err(violation(
                            Property::Malformed,
                            format!("answer {outcome:?} to unknown release op {op}"),
                        ));
                    };
                    if *at_us < r.invoked_us {
                        return Err(violation(
                            Property::Malformed,
                            format!("release op {op} answered before it was invoked"),
                        ));
                    }
                    r.answers.push((*outcome, *at_us));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Fails when operation `op` was `again` invoked a second time.
fn invoked_once(op: OpId, again: bool) -> Result<(), Violation> {
    if again {
        return Err(violation(
            Property::Malformed,
            format!("operation id {op} invoked twice"),
        ));
    }
    Ok(())
}

/// Records `outcome` at `at_us` as the answer to acquire `a`; checks it
/// came after the invocation and is the first answer.
fn record_acquire_answer(a: &mut AcqRec, outcome: Outcome, at_us: u64) -> Result<(), Violation> {
    if at_us < a.invoked_us {
        return Err(violation(
            Property::Malformed,
            format!(
                "{} answered at {at_us}us, before it was invoked",
                a.describe()
            ),
        ));
    }
    if let Some((first, first_us)) = a.answer {
        return Err(violation(
            Property::AnsweredOnce,
            format!(
                "{} on key {:?} answered twice: {first:?} at {first_us}us \
                 and {outcome:?} at {at_us}us",
                a.describe(),
                a.key
            ),
        ));
    }
    a.answer = Some((outcome, at_us));
    Ok(())
}

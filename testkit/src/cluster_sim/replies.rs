//! A client's handling of a node's reply: the checks of one holder per key
//! and increasing tokens, and the history's answers.

use super::*;

impl Sim {
    pub(super) fn on_reply(
        &mut self,
        node: u64,
        conn: ConnId,
        key: &str,
        reply: Reply<'static>,
    ) -> Result<(), String> {
        let Some(&c) = self.conn_owner.get(&(node, conn)) else {
            return self.fail(format!(
                "node {node} answered connection {conn}, which is closed: {reply:?} {key}"
            ));
        };
        let state = self.clients[c].state.clone();
        if self.debug {
            eprintln!(
                "{} node {node} conn {conn} client {c}: {reply:?} {key} in {state:?}",
                self.now
            );
        }
        let idle_after = self.now.add_ms(self.rng.range(0, 1500));
        match (state, reply) {
            (
                ClientState::Acquiring {
                    owner,
                    key: k,
                    sent,
                    lease_s,
                    ..
                },
                Reply::Acquired {
                    token, owner: o, ..
                },
            ) if o == owner => {
                self.report.grants += 1;
                let late = sent.add_secs(u64::from(lease_s)) <= self.now;
                self.answer_acquire(
                    c,
                    if late {
                        Outcome::LateGrant { token }
                    } else {
                        Outcome::Granted { token }
                    },
                );
                if !self.tokens.insert(token) {
                    return self.fail(format!("token {token} issued twice"));
                }
                let until = sent.add_secs(u64::from(lease_s));
                if until > self.now {
                    let now = self.now;
                    let holder_check = self.cfg.bug.is_none();
                    if let Some(other) = self
                        .beliefs
                        .get(&k)
                        .filter(|_| holder_check)
                        .and_then(|v| v.iter().find(|b| b.0 != c && b.2 > now))
                    {
                        return self.fail(format!(
                            "two holders of key{k}: client {} (token {}, until {}) and client {c} (token {token})",
                            other.0, other.1, other.2
                        ));
                    }
                    let max = self.max_token.get(&k).copied().unwrap_or(0);
                    if token <= max {
                        return self.fail(format!(
                            "key{k} granted with token {token} after token {max}"
                        ));
                    }
                    self.beliefs.entry(k).or_default().push((c, token, until));
                    // Mostly release within the lease; sometimes let it expire.
                    // Mostly release within the lease; sometimes let it expire.
                    // A holder that extends holds for up to four leases.
                    let lease_ms = u64::from(lease_s) * 1000;
                    let extend_at = self.plan_extend(until);
                    let hold_ms = if extend_at == Millis::NEVER {
                        lease_ms / 2
                    } else {
                        lease_ms * 4
                    };
                    let release_at = if self.rng.chance(0.8) {
                        self.now.add_ms(self.rng.range(0, hold_ms + 1))
                    } else {
                        Millis::NEVER
                    };
                    self.clients[c].state = ClientState::Holding {
                        key: k,
                        token,
                        until,
                        release_at,
                        extend_at,
                        first_until: until,
                    };
                    self.clients[c].next_at = release_at.min(until).min(extend_at);
                } else {
                    // Arrived after its lease: unusable.
                    self.clients[c].state = ClientState::Idle;
                    self.clients[c].next_at = idle_after;
                }
                let max = self.max_token.entry(k).or_insert(0);
                *max = (*max).max(token);
            }
            (ClientState::Acquiring { owner, .. }, Reply::Timeout { owner: o, .. })
                if o == owner =>
            {
                self.report.timeouts += 1;
                self.answer_acquire(c, Outcome::Timeout);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (ClientState::Acquiring { owner, .. }, Reply::Busy { owner: o, .. }) if o == owner => {
                self.report.busy += 1;
                self.answer_acquire(c, Outcome::Busy);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (ClientState::Releasing { token, .. }, Reply::Released { token: t, .. })
                if t == token =>
            {
                self.report.releases += 1;
                self.answer_release(c, ReleaseOutcome::Released);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (ClientState::Releasing { token, .. }, Reply::NotReleased { token: t, .. })
                if t == token =>
            {
                self.report.not_released += 1;
                self.answer_release(c, ReleaseOutcome::NotReleased);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (
                ClientState::Extending {
                    key: k,
                    token,
                    until,
                    release_at,
                    first_until,
                    sent,
                    lease_s,
                    ..
                },
                Reply::Extended { token: t, .. },
            ) if t == token && self.clients[c].op.is_some() => {
                self.answer_extend(c, ExtendOutcome::Extended);
                if until <= self.now {
                    // At or after the expiry: lost, nothing revived.
                    self.hold_ended(first_until);
                    self.report.late_extend_answers += 1;
                    self.drop_belief(c, k);
                    self.clients[c].state = ClientState::Idle;
                    self.clients[c].next_at = idle_after;
                    return Ok(());
                }
                self.report.extended += 1;
                // Counted from this attempt's write, never from the reply.
                let until = sent.add_secs(u64::from(lease_s));
                if let Some(b) = self
                    .beliefs
                    .get_mut(&k)
                    .and_then(|v| v.iter_mut().find(|b| b.0 == c && b.1 == token))
                {
                    b.2 = until;
                }
                let extend_at = self.plan_extend(until);
                self.clients[c].state = ClientState::Holding {
                    key: k,
                    token,
                    until,
                    release_at,
                    extend_at,
                    first_until,
                };
                self.clients[c].next_at = release_at.min(until).min(extend_at);
            }
            (
                ClientState::Extending {
                    key: k,
                    token,
                    first_until,
                    ..
                },
                Reply::NotExtended { token: t, .. },
            ) if t == token && self.clients[c].op.is_some() => {
                self.hold_ended(first_until);
                // X is definitive: the grant is gone.
                self.report.not_extended += 1;
                self.answer_extend(c, ExtendOutcome::NotExtended);
                self.drop_belief(c, k);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (
                ClientState::ReleasingOthers { token, victim, .. },
                Reply::Released { token: t, .. },
            ) if t == token => {
                return self.fail(format!(
                    "client {c} released key {key} token {token}, a grant of client {victim} \
                     (another authenticated identity)"
                ));
            }
            (ClientState::ReleasingOthers { token, .. }, Reply::NotReleased { token: t, .. })
                if t == token =>
            {
                self.report.others_refused += 1;
                self.answer_release(c, ReleaseOutcome::NotReleased);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (ClientState::ExtendingUnknown { token, .. }, Reply::NotExtended { token: t, .. })
                if t == token =>
            {
                self.report.unknown_token_x += 1;
                self.answer_extend(c, ExtendOutcome::NotExtended);
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = idle_after;
            }
            (_, Reply::Extended { token: t, .. } | Reply::NotExtended { token: t, .. })
                if self.clients[c].stale.iter().any(|s| s.0 == t) =>
            {
                // The answer to an extend whose grant expired in flight:
                // recorded, and it revives nothing.
                self.report.late_extend_answers += 1;
                let outcome = if matches!(reply, Reply::Extended { .. }) {
                    ExtendOutcome::Extended
                } else {
                    ExtendOutcome::NotExtended
                };
                let stale = &mut self.clients[c].stale;
                if let Some(i) = stale.iter().position(|s| s.0 == t) {
                    let (_, op) = stale.swap_remove(i);
                    self.history.extended(op, outcome, us(self.now));
                }
            }
            (state, reply) => {
                return self.fail(format!(
                    "client {c} got {reply:?} for {key} in state {state:?}: \
                     an answer to nothing, or a second answer"
                ));
            }
        }
        Ok(())
    }
}

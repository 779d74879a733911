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
        let handled = self.acquire_answered(c, &state, &reply, idle_after)?
            || self.release_answered(c, key, &state, &reply, idle_after)?
            || self.extend_answered(c, &state, &reply, idle_after)?
            || self.stale_extend_answered(c, &reply);
        if !handled {
            return self.fail(format!(
                "client {c} got {reply:?} for {key} in state {state:?}: \
                 an answer to nothing, or a second answer"
            ));
        }
        Ok(())
    }

    /// Moves client `c` to idle, acting again at `at`.
    fn go_idle(&mut self, c: usize, at: Millis) {
        self.clients[c].state = ClientState::Idle;
        self.clients[c].next_at = at;
    }

    /// Handles `reply` when it answers client `c`'s acquire in flight
    /// (`state`); false when it does not.
    fn acquire_answered(
        &mut self,
        c: usize,
        state: &ClientState,
        reply: &Reply<'static>,
        idle_after: Millis,
    ) -> Result<bool, String> {
        match (state, reply) {
            (
                &ClientState::Acquiring {
                    owner,
                    key: k,
                    places,
                    sent,
                    lease_s,
                    ..
                },
                &Reply::Acquired {
                    token, owner: o, ..
                },
            ) if o == owner => {
                let asked = (places, sent, lease_s);
                self.on_granted(c, k, token, asked, idle_after)?;
            }
            (&ClientState::Acquiring { owner, .. }, &Reply::Timeout { owner: o, .. })
                if o == owner =>
            {
                self.report.timeouts += 1;
                self.answer_acquire(c, Outcome::Timeout);
                self.go_idle(c, idle_after);
            }
            (&ClientState::Acquiring { owner, .. }, &Reply::Busy { owner: o, .. })
                if o == owner =>
            {
                self.report.busy += 1;
                self.answer_acquire(c, Outcome::Busy);
                self.go_idle(c, idle_after);
            }
            (
                &ClientState::Acquiring { owner, .. },
                &Reply::LimitMismatch {
                    owner: o, limit, ..
                },
            ) if o == owner => {
                self.report.limit_mismatches += 1;
                self.answer_acquire(c, Outcome::LimitMismatch { limit });
                self.go_idle(c, idle_after);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Client `c`'s acquire of key `k` (`asked`: its places, written at
    /// `sent` with a lease of `lease_s`) was granted `token`: checks the
    /// token is new and, while the lease lasts, that the key has room for
    /// it and (a mutex's) token grows; the client then holds the key (or,
    /// past its lease, goes idle).
    fn on_granted(
        &mut self,
        c: usize,
        k: usize,
        token: u64,
        asked: (Places, Millis, u8),
        idle_after: Millis,
    ) -> Result<(), String> {
        let (places, sent, lease_s) = asked;
        self.report.grants += 1;
        self.report.permit_grants += u64::from(places.limit > 1);
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
            self.hold_granted(c, k, (token, places), until, lease_s)?;
        } else {
            // Arrived after its lease: unusable.
            self.go_idle(c, idle_after);
        }
        let max = self.max_token.entry(k).or_insert(0);
        *max = (*max).max(token);
        Ok(())
    }

    /// Client `c` holds key `k` with `token` (asked as `places`) until
    /// `until`: checks the key has room for it beside the others who
    /// believe they hold it and, on a mutex, the token is above every one
    /// granted on it; then plans the release and extensions.
    fn hold_granted(
        &mut self,
        c: usize,
        k: usize,
        (token, places): (u64, Places),
        until: Millis,
        lease_s: u8,
    ) -> Result<(), String> {
        if self.cfg.bug.is_none() {
            self.check_room(c, k, token, places)?;
        }
        self.beliefs
            .entry(k)
            .or_default()
            .push((c, token, until, places));
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
        Ok(())
    }

    /// The checks of [`Sim::hold_granted`]: before client `c`'s grant of
    /// `token` on key `k`, asked as `places`, another holder's belief is
    /// valid only where the key has room for both (PROTOCOL §6.2), and a
    /// mutex's token is above every one received on it.
    fn check_room(&self, c: usize, k: usize, token: u64, places: Places) -> Result<(), String> {
        let now = self.now;
        let others: Vec<&Belief> = self
            .beliefs
            .get(&k)
            .map(|v| v.iter().filter(|b| b.0 != c && b.2 > now).collect())
            .unwrap_or_default();
        let limit = places.limit.max(1);
        let exclusive = |p: Places| p.mode == Mode::Exclusive;
        let clash = others.iter().find(|b| {
            limit == 1 || b.3.limit != places.limit || exclusive(b.3) || exclusive(places)
        });
        if let Some(other) = clash {
            return self.fail(format!(
                "two holders of key{k}: client {} (token {}, until {}, {:?}) and client {c} \
                 (token {token}, {places:?})",
                other.0, other.1, other.2, other.3
            ));
        }
        if others.len() >= usize::from(limit) {
            return self.fail(format!(
                "{} holders of key{k} (limit {limit}) with client {c} (token {token}): {others:?}",
                others.len() + 1
            ));
        }
        let max = self.max_token.get(&k).copied().unwrap_or(0);
        if limit == 1 && token <= max {
            return self.fail(format!(
                "key{k} granted with token {token} after token {max}"
            ));
        }
        Ok(())
    }

    /// Handles `reply` when it answers client `c`'s release in flight, of
    /// its own grant or of another's (`state`); false when it does not.
    fn release_answered(
        &mut self,
        c: usize,
        key: &str,
        state: &ClientState,
        reply: &Reply<'static>,
        idle_after: Millis,
    ) -> Result<bool, String> {
        match (state, reply) {
            (&ClientState::Releasing { token, .. }, &Reply::Released { token: t, .. })
                if t == token =>
            {
                self.report.releases += 1;
                self.answer_release(c, ReleaseOutcome::Released);
                self.go_idle(c, idle_after);
            }
            (&ClientState::Releasing { token, .. }, &Reply::NotReleased { token: t, .. })
                if t == token =>
            {
                self.report.not_released += 1;
                self.answer_release(c, ReleaseOutcome::NotReleased);
                self.go_idle(c, idle_after);
            }
            (
                &ClientState::ReleasingOthers { token, victim, .. },
                &Reply::Released { token: t, .. },
            ) if t == token => {
                return self.fail(format!(
                    "client {c} released key {key} token {token}, a grant of client {victim} \
                     (another authenticated identity)"
                ));
            }
            (&ClientState::ReleasingOthers { token, .. }, &Reply::NotReleased { token: t, .. })
                if t == token =>
            {
                self.report.others_refused += 1;
                self.answer_release(c, ReleaseOutcome::NotReleased);
                self.go_idle(c, idle_after);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Handles `reply` when it answers client `c`'s extend in flight, of
    /// its grant or of an unknown token (`state`); false when it does not.
    fn extend_answered(
        &mut self,
        c: usize,
        state: &ClientState,
        reply: &Reply<'static>,
        idle_after: Millis,
    ) -> Result<bool, String> {
        match (state, reply) {
            (&ClientState::Extending { token, .. }, &Reply::Extended { token: t, .. })
                if t == token && self.clients[c].op.is_some() =>
            {
                self.on_extended(c, state, idle_after);
            }
            (
                &ClientState::Extending {
                    key: k,
                    token,
                    first_until,
                    ..
                },
                &Reply::NotExtended { token: t, .. },
            ) if t == token && self.clients[c].op.is_some() => {
                self.hold_ended(first_until);
                // X is definitive: the grant is gone.
                self.report.not_extended += 1;
                self.answer_extend(c, ExtendOutcome::NotExtended);
                self.drop_belief(c, k);
                self.go_idle(c, idle_after);
            }
            (
                &ClientState::ExtendingUnknown { token, .. },
                &Reply::NotExtended { token: t, .. },
            ) if t == token => {
                self.report.unknown_token_x += 1;
                self.answer_extend(c, ExtendOutcome::NotExtended);
                self.go_idle(c, idle_after);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Client `c`'s extend (`state`, an `Extending`) was answered `E`: before
    /// the expiry the hold goes on with the new lease, counted from the
    /// attempt's write; at or after it the grant is lost, nothing revived.
    fn on_extended(&mut self, c: usize, state: &ClientState, idle_after: Millis) {
        let &ClientState::Extending {
            key: k,
            token,
            until,
            release_at,
            first_until,
            sent,
            lease_s,
            ..
        } = state
        else {
            unreachable!("only an extend in flight is answered E");
        };
        self.answer_extend(c, ExtendOutcome::Extended);
        if until <= self.now {
            // At or after the expiry: lost, nothing revived.
            self.hold_ended(first_until);
            self.report.late_extend_answers += 1;
            self.drop_belief(c, k);
            self.go_idle(c, idle_after);
            return;
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

    /// Handles `reply` when it answers an extend of client `c` whose grant
    /// expired in flight: recorded, and it revives nothing. False when it
    /// is not one.
    fn stale_extend_answered(&mut self, c: usize, reply: &Reply<'static>) -> bool {
        let (&Reply::Extended { token: t, .. } | &Reply::NotExtended { token: t, .. }) = reply
        else {
            return false;
        };
        if !self.clients[c].stale.iter().any(|s| s.0 == t) {
            return false;
        }
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
        true
    }
}

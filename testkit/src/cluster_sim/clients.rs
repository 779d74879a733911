//! The simulated clients: what they send (acquire, extend, release, a
//! release of another's token) and what they believe they hold.

use super::*;

impl Sim {
    pub(super) fn clients_act(&mut self) -> Result<(), String> {
        for c in 0..self.clients.len() {
            self.client_acts(c)?;
        }
        Ok(())
    }

    /// One step of client `c`: it gives up or hangs up, its hold ends, or,
    /// when due, it sends its next request.
    fn client_acts(&mut self, c: usize) -> Result<(), String> {
        if self.drops_call(c) {
            self.reconnect(c);
            return Ok(());
        }
        self.end_expired_hold(c);
        if self.clients[c].next_at > self.now {
            return Ok(());
        }
        let node = self.clients[c].node;
        if self.nodes[node as usize - 1].is_none() {
            self.reconnect(c);
            return Ok(());
        }
        match self.clients[c].state.clone() {
            ClientState::Idle if self.rng.chance(0.02) && self.others_grant(c).is_some() => {
                self.release_others(c)?;
            }
            ClientState::Idle if self.rng.chance(0.03) => self.extend_unknown_token(c)?,
            ClientState::Idle => self.start_acquire(c)?,
            ClientState::Holding {
                key,
                token,
                until,
                release_at,
                extend_at,
                first_until,
            } if extend_at <= self.now && extend_at < release_at => {
                // Never a lease that would end before the current
                // expiry: an Extend in flight may take effect unanswered,
                // and one that shortens the lease would then end it
                // before the expiry the client still counts on.
                let need = until
                    .0
                    .saturating_sub(self.now.0)
                    .div_ceil(1000)
                    .clamp(1, 3);
                let lease_s = self.rng.range(need, 4) as u8;
                self.clients[c].state = ClientState::Extending {
                    key,
                    token,
                    until,
                    release_at,
                    first_until,
                    sent: self.now,
                    lease_s,
                    retry_at: Millis::NEVER,
                };
                self.send_extend(c)?;
            }
            ClientState::Extending { retry_at, .. } if retry_at <= self.now => {
                self.resend_extend(c)?;
            }
            ClientState::Holding {
                key,
                token,
                release_at,
                first_until,
                ..
            } if release_at <= self.now => self.start_release(c, key, token, first_until)?,
            _ => {}
        }
        Ok(())
    }

    /// Whether client `c` drops its call in flight (and reconnects): it
    /// gives up a request unanswered past its time, or hangs up waiting.
    fn drops_call(&mut self, c: usize) -> bool {
        // A request that got no answer in time is given up: the client
        // closes that connection (PROTOCOL §3: Indeterminate).
        let give_up = match self.clients[c].state {
            ClientState::Acquiring { give_up, .. }
            | ClientState::Releasing { give_up, .. }
            | ClientState::ReleasingOthers { give_up, .. }
            | ClientState::ExtendingUnknown { give_up, .. } => give_up <= self.now,
            _ => false,
        };
        // Now and then a waiting client hangs up (its queued acquire
        // must be cancelled cluster-wide and never answered).
        let hang_up = matches!(self.clients[c].state, ClientState::Acquiring { .. })
            && self.rng.chance(0.0005);
        give_up || hang_up
    }

    /// Ends client `c`'s hold (or its extension in flight) when its lease
    /// has run out: it drops its belief and goes idle.
    fn end_expired_hold(&mut self, c: usize) {
        match self.clients[c].state {
            ClientState::Holding {
                key,
                until,
                first_until,
                ..
            } if until <= self.now => {
                self.hold_ended(first_until);
                self.drop_belief(c, key);
                self.clients[c].state = ClientState::Idle;
            }
            ClientState::Extending {
                key,
                until,
                token,
                first_until,
                ..
            } if until <= self.now => {
                self.hold_ended(first_until);
                // No E before the expiry: the grant is lost. The
                // attempt stays on its connection; an answer to it now
                // revives nothing.
                self.report.extend_lost += 1;
                self.drop_belief(c, key);
                if let Some(op) = self.clients[c].op.take() {
                    self.clients[c].stale.push((token, op));
                }
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = self.now;
            }
            _ => {}
        }
    }

    /// Client `c` sends an extend of a token nobody was given (tokens stay
    /// far below 2^60 in a run).
    fn extend_unknown_token(&mut self, c: usize) -> Result<(), String> {
        let key = self.rng.range(0, self.cfg.keys as u64) as usize;
        let token = (1 << 60) + self.rng.range(0, 1 << 20);
        let lease_s = [1u8, 2, 3][self.rng.range(0, 3) as usize];
        self.clients[c].state = ClientState::ExtendingUnknown {
            token,
            give_up: self.now.add_secs(8),
        };
        self.clients[c].next_at = Millis::NEVER;
        self.write_extend(c, key, token, lease_s)
    }

    /// What client `c` asks of key number `key`: a plain acquire of a
    /// mutex (without [`SimConfig::permit_keys`], always, drawing nothing);
    /// with it, on the first keys, a mutex or, one time in 40, a `P` of
    /// limit 2, and a permit of the semaphore
    /// (the last key but one, of 2 or 3 by seed) or the read/write lock
    /// (the last key), shared or, one time in four, exclusive, one time in
    /// 40 with the wrong limit.
    fn pick_places(&mut self, key: usize) -> Places {
        let keys = self.cfg.keys;
        if !self.cfg.permit_keys {
            // Protocol 1.1 only, every draw as it always was.
            return crate::checker::MUTEX;
        }
        let wrong = self.rng.chance(0.025);
        if keys < 3 || key < keys - 2 {
            return if wrong {
                Places::semaphore(2)
            } else {
                crate::checker::MUTEX
            };
        }
        if key == keys - 2 {
            let limit = 2 + (self.cfg.seed % 2) as u16;
            return Places::semaphore(if wrong { limit + 1 } else { limit });
        }
        let mode = if self.rng.chance(0.25) {
            Mode::Exclusive
        } else {
            Mode::Shared
        };
        let limit = if wrong { 4 } else { Places::READ_WRITE_LIMIT };
        Places { limit, mode }
    }

    /// Client `c` sends an acquire of a random key, with a random wait and
    /// lease, as a new owner.
    fn start_acquire(&mut self, c: usize) -> Result<(), String> {
        let key = self.rng.range(0, self.cfg.keys as u64) as usize;
        let places = self.pick_places(key);
        let wait_s = [0u8, 1, 2, 4][self.rng.range(0, 4) as usize];
        let lease_s = [1u8, 2, 3][self.rng.range(0, 3) as usize];
        let owner = self.next_owner;
        self.next_owner += 1;
        self.clients[c].state = ClientState::Acquiring {
            owner,
            key,
            places,
            sent: self.now,
            lease_s,
            give_up: self.now.add_secs(u64::from(wait_s) + 8),
        };
        self.clients[c].next_at = Millis::NEVER;
        let k = format!("key{key}");
        // Recorded before the request: the answer may come at once.
        let op = self.history.acquire_with(
            c as u64,
            self.clients[c].conn,
            &k,
            owner,
            wait_s,
            lease_s,
            places,
            us(self.now),
        );
        self.clients[c].op = Some(op);
        let request = if places == crate::checker::MUTEX {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key: &k,
            }
        } else {
            Request::AcquireWithLimit {
                wait_s,
                lease_s,
                owner,
                limit: places.limit,
                mode: places.mode,
                key: &k,
            }
        };
        self.request(c, request)
    }

    /// Client `c`'s extend got no answer in time: it gives this attempt up
    /// and sends the same Extend again on a new connection (PROTOCOL §5.3).
    fn resend_extend(&mut self, c: usize) -> Result<(), String> {
        if self.clients[c].op.is_some() {
            self.report.extend_resends += 1;
            self.reconnect(c);
        }
        let node = self.clients[c].node;
        if self.nodes[node as usize - 1].is_none() {
            // Try another node at the next step.
            self.reconnect(c);
            return Ok(());
        }
        if let ClientState::Extending { ref mut sent, .. } = self.clients[c].state {
            *sent = self.now;
        }
        self.send_extend(c)
    }

    /// Client `c`'s hold of `key` (granted `token`) is over: it drops its
    /// belief and sends the release.
    fn start_release(
        &mut self,
        c: usize,
        key: usize,
        token: u64,
        first_until: Millis,
    ) -> Result<(), String> {
        self.hold_ended(first_until);
        self.drop_belief(c, key);
        self.clients[c].state = ClientState::Releasing {
            token,
            give_up: self.now.add_secs(8),
        };
        self.clients[c].next_at = Millis::NEVER;
        let k = format!("key{key}");
        let op = self
            .history
            .release(c as u64, self.clients[c].conn, &k, token, us(self.now));
        self.clients[c].op = Some(op);
        self.request(c, Request::Release { token, key: &k })
    }

    /// A grant another, authenticated, client believes it holds now:
    /// (key number, token, that client).
    pub(super) fn others_grant(&self, c: usize) -> Option<(usize, u64, usize)> {
        let now = self.now;
        self.beliefs.iter().find_map(|(&k, v)| {
            v.iter()
                .find(|b| b.0 != c && b.2 > now && self.clients[b.0].caller.holder & 1 == 1)
                .map(|b| (k, b.1, b.0))
        })
    }

    /// Client `c` releases, by its token, a grant another authenticated
    /// client holds ([`Sim::others_grant`]).
    pub(super) fn release_others(&mut self, c: usize) -> Result<(), String> {
        let Some((key, token, victim)) = self.others_grant(c) else {
            return Ok(());
        };
        self.clients[c].state = ClientState::ReleasingOthers {
            token,
            victim,
            give_up: self.now.add_secs(8),
        };
        self.clients[c].next_at = Millis::NEVER;
        let k = format!("key{key}");
        let op = self
            .history
            .release(c as u64, self.clients[c].conn, &k, token, us(self.now));
        self.clients[c].op = Some(op);
        self.request(c, Request::Release { token, key: &k })
    }

    /// Sends the Extend of the client's current `Extending` state (its
    /// `sent` is now).
    pub(super) fn send_extend(&mut self, c: usize) -> Result<(), String> {
        let ClientState::Extending {
            key,
            token,
            until,
            lease_s,
            ..
        } = self.clients[c].state
        else {
            return Ok(());
        };
        let retry = self.now.add_ms(self.rng.range(300, 1500));
        if let ClientState::Extending {
            ref mut retry_at, ..
        } = self.clients[c].state
        {
            *retry_at = retry;
        }
        // The attempt ends at the expiry at the latest.
        self.clients[c].next_at = retry.min(until);
        self.report.extends += 1;
        self.write_extend(c, key, token, lease_s)
    }

    /// Records client `c`'s extend of `token` on key number `key` in the
    /// history, as its pending operation, and sends it.
    pub(super) fn write_extend(
        &mut self,
        c: usize,
        key: usize,
        token: u64,
        lease_s: u8,
    ) -> Result<(), String> {
        let k = format!("key{key}");
        let op = self.history.extend(
            c as u64,
            self.clients[c].conn,
            &k,
            token,
            lease_s,
            us(self.now),
        );
        self.clients[c].op = Some(op);
        self.request(
            c,
            Request::Extend {
                lease_s,
                token,
                key: &k,
            },
        )
    }

    /// Plans a holder's next extend and release: with `extend_p`, an
    /// extend within the first two thirds of what is left of the lease.
    pub(super) fn plan_extend(&mut self, until: Millis) -> Millis {
        let left = until.0.saturating_sub(self.now.0);
        if left > 0 && self.rng.chance(self.cfg.extend_p) {
            self.now.add_ms(self.rng.range(left / 4, left * 2 / 3 + 1))
        } else {
            Millis::NEVER
        }
    }

    /// A holding ends now (released, expired or lost): count it when it
    /// lasted past its first lease.
    pub(super) fn hold_ended(&mut self, first_until: Millis) {
        if self.now > first_until {
            self.report.held_past_first_lease += 1;
        }
    }

    pub(super) fn answer_extend(&mut self, c: usize, outcome: ExtendOutcome) {
        if let Some(op) = self.clients[c].op.take() {
            self.history.extended(op, outcome, us(self.now));
        }
    }

    pub(super) fn request(&mut self, c: usize, req: Request<'_>) -> Result<(), String> {
        let (node, conn) = (self.clients[c].node, self.clients[c].conn);
        let Some(n) = self.nodes[node as usize - 1].as_mut() else {
            return Ok(());
        };
        self.out.clear();
        n.request_as(self.now, conn, self.clients[c].caller, req, &mut self.out);
        let replies: Vec<(ConnId, String, Reply<'static>)> = self
            .out
            .iter()
            .map(|a| (a.conn, a.reply.key().to_owned(), owned(a.reply)))
            .collect();
        self.out.clear();
        for (conn, key, reply) in replies {
            self.on_reply(node, conn, &key, reply)?;
        }
        Ok(())
    }

    pub(super) fn answer_acquire(&mut self, c: usize, outcome: Outcome) {
        if let Some(op) = self.clients[c].op.take() {
            self.history.acquired(op, outcome, us(self.now));
        }
    }

    pub(super) fn answer_release(&mut self, c: usize, outcome: ReleaseOutcome) {
        if let Some(op) = self.clients[c].op.take() {
            self.history.released(op, outcome, us(self.now));
        }
    }

    pub(super) fn drop_belief(&mut self, c: usize, key: usize) {
        if let Some(v) = self.beliefs.get_mut(&key) {
            v.retain(|b| b.0 != c);
        }
    }
}

//! The simulated clients, each following the official client's rules
//! (PROTOCOL §3).

use super::*;

impl Sim {
    pub(super) fn connect(&mut self, client: usize) {
        let c = &mut self.clients[client];
        if c.connecting || c.session.is_some() || c.retry_at > self.now {
            return;
        }
        let life = c.life;
        c.connecting = true;
        let conn = self.next_conn;
        self.next_conn += 1;
        let rtt = self.latency() + self.latency();
        self.conns.insert(
            conn,
            Conn {
                client,
                life,
                epoch: self.server.epoch,
                cut: false,
                established: false,
                client_closed: false,
                server_closed: false,
                last_to_server: 0,
                last_to_client: 0,
                server_buf: Vec::new(),
                client_buf: Vec::new(),
            },
        );
        let t = self.now + rtt;
        self.at(t, Ev::Connected { conn });
    }

    /// The client's state machine: called on wakes and whenever a session
    /// appears. Decides what to send and when to give up.
    pub(super) fn client_step(&mut self, client: usize) {
        let now = self.now;
        self.send_compensation(client);
        match self.clients[client].phase.clone() {
            Phase::Idle => {
                if now >= self.cfg.run_us {
                    return; // the run is over: start nothing new
                }
                if self.clients[client].wake_at > now {
                    return;
                }
                self.start_acquire(client);
            }
            Phase::Acquiring(p) if p.op.is_none() => self.send_acquire(client, p),
            Phase::Acquiring(p) => {
                if now >= p.give_up_us {
                    // Sent, unanswered past D + grace: close that session.
                    let op = p.op.expect("sent");
                    self.history.acquired(op, Outcome::Indeterminate, now);
                    self.client_close(client);
                    self.finish_idle(client);
                } else {
                    self.wake(client, p.give_up_us);
                }
            }
            Phase::Holding {
                key,
                token,
                expires_us,
                hold_end_us,
            } => {
                if self.clients[client].wake_at > now {
                    return;
                }
                self.hold_step(client, key, token, expires_us, hold_end_us);
            }
            phase @ Phase::Extending { .. } => self.extending_step(client, phase),
            phase @ Phase::Releasing { .. } => self.releasing_step(client, phase),
        }
    }

    /// Sends the client's oldest compensating release (of a grant it got
    /// too late to use) on its session, or opens one for it.
    fn send_compensation(&mut self, client: usize) {
        if let Some((key, token)) = self.clients[client].compensate.first().cloned() {
            if let Some(conn) = self.clients[client].session {
                self.clients[client].compensate.remove(0);
                let mut bytes = Vec::new();
                encode_request(&Request::Release { token, key: &key }, &mut bytes);
                self.send(conn, true, &bytes);
            } else {
                self.connect(client);
            }
        }
    }

    /// A random key and what to ask of it: a mutex `k0`.. (a plain `A`),
    /// a permit of the semaphore `s0`, or the read/write lock `rw` shared
    /// or exclusive; one acquire in 40 asks with the wrong limit.
    fn pick_key(&mut self) -> (String, Places) {
        let sem = u64::from(self.cfg.sem_limit > 0);
        let rw = u64::from(self.cfg.rw);
        let n = self.rng.below(self.cfg.keys as u64 + sem + rw);
        let wrong = self.rng.chance(25);
        if n < self.cfg.keys as u64 {
            let places = if wrong { Places::semaphore(2) } else { MUTEX };
            return (format!("k{n}"), places);
        }
        if n == self.cfg.keys as u64 && sem == 1 {
            let limit = self.cfg.sem_limit;
            let limit = match (wrong, self.rng.chance(500)) {
                (false, _) => limit,
                (true, true) => 1,
                (true, false) => limit + 1,
            };
            return ("s0".to_string(), Places::semaphore(limit));
        }
        let mode = if self.rng.chance(250) {
            Mode::Exclusive
        } else {
            Mode::Shared
        };
        let limit = if wrong { 4 } else { Places::READ_WRITE_LIMIT };
        ("rw".to_string(), Places { limit, mode })
    }

    /// An idle client starts an acquire of a random key, with a random wait
    /// and lease, as a new owner.
    fn start_acquire(&mut self, client: usize) {
        let now = self.now;
        let (key, places) = self.pick_key();
        let wait_s = match self.rng.below(5) {
            0 => 0,
            _ => self.rng.range(1, 4) as u8,
        };
        let lease_s = self.rng.range(1, 3) as u8;
        let owner = self.next_owner;
        self.next_owner += 1;
        let deadline_us = if wait_s == 0 {
            now + 5 * S
        } else {
            now + u64::from(wait_s) * S
        };
        let give_up_us = if wait_s == 0 {
            deadline_us
        } else {
            deadline_us + S
        };
        self.clients[client].phase = Phase::Acquiring(Pending {
            op: None,
            key,
            places,
            owner,
            wait_s,
            lease_s,
            start_us: now,
            sent_us: 0,
            deadline_us,
            give_up_us,
        });
        self.client_step(client);
    }

    /// The acquire `p`, not sent yet, goes out on the client's session (or
    /// opens one) with the wait left; past its deadline D it times out
    /// unsent.
    fn send_acquire(&mut self, client: usize, p: Pending) {
        let now = self.now;
        // Not sent yet: it may still go on any session, until D.
        let left = if p.wait_s == 0 {
            Some(0)
        } else {
            p.deadline_us.checked_sub(now).filter(|&l| l > 0)
        };
        let Some(left) = left.filter(|_| now < p.deadline_us) else {
            // D passed unsent: Timeout, the server never saw it.
            let op = self.history.acquire_with(
                client as u64,
                0,
                &p.key,
                p.owner,
                p.wait_s,
                p.lease_s,
                p.places,
                p.start_us,
            );
            self.history.acquired(op, Outcome::Timeout, now);
            self.finish_idle(client);
            return;
        };
        let Some(conn) = self.clients[client].session else {
            self.connect(client);
            self.wake(client, p.deadline_us);
            return;
        };
        // The wire wait is the time left, rounded up (PROTOCOL §3).
        let wire_wait = if p.wait_s == 0 {
            0
        } else {
            left.div_ceil(S).min(255) as u8
        };
        let op = self.history.acquire_with(
            client as u64,
            conn,
            &p.key,
            p.owner,
            wire_wait,
            p.lease_s,
            p.places,
            now,
        );
        self.op_of_owner.insert(p.owner, op);
        self.send(conn, true, &acquire_bytes(&p, wire_wait));
        let give_up = p.give_up_us;
        self.clients[client].phase = Phase::Acquiring(Pending {
            op: Some(op),
            sent_us: now,
            ..p
        });
        self.wake(client, give_up);
    }

    /// A holder wakes: it extends while it still works and the lease
    /// lasts, else it releases.
    fn hold_step(
        &mut self,
        client: usize,
        key: String,
        token: u64,
        expires_us: u64,
        hold_end_us: u64,
    ) {
        let now = self.now;
        if now < hold_end_us && now < expires_us {
            // Still working: extend before the lease runs out.
            let lease_s = self.rng.range(1, 4) as u8;
            self.clients[client].phase = Phase::Extending {
                sent: None,
                key,
                token,
                lease_s,
                expires_us,
                hold_end_us,
            };
            self.client_step(client);
            return;
        }
        let give_up_us = now + 3 * S;
        self.clients[client].phase = Phase::Releasing {
            sent: None,
            key,
            token,
            give_up_us,
        };
        self.client_step(client);
    }

    /// A client extending (`phase`): lost at the expiry, else its extend
    /// goes out if not sent yet, and it waits for the answer.
    fn extending_step(&mut self, client: usize, phase: Phase) {
        let Phase::Extending {
            sent,
            key,
            token,
            lease_s,
            expires_us,
            hold_end_us,
        } = phase
        else {
            unreachable!("called for an extending client only");
        };
        let now = self.now;
        if now >= expires_us {
            // No E by the expiry: lost for good; stop using it.
            if let Some((op, _, _)) = sent {
                self.history.extended(op, ExtendOutcome::Lost, now);
            }
            self.finish_idle(client);
            return;
        }
        if sent.is_none() {
            let Some(conn) = self.clients[client].session else {
                self.connect(client);
                self.wake(client, expires_us);
                return;
            };
            let op = self
                .history
                .extend(client as u64, conn, &key, token, lease_s, now);
            // A shorter lease may take effect unanswered (PROTOCOL §5.2
            // allows shortening): stop using the grant by then.
            let expires_us = expires_us.min(now + u64::from(lease_s) * S);
            self.stats.extends += 1;
            let mut bytes = Vec::new();
            encode_request(
                &Request::Extend {
                    lease_s,
                    token,
                    key: &key,
                },
                &mut bytes,
            );
            self.send(conn, true, &bytes);
            self.clients[client].phase = Phase::Extending {
                sent: Some((op, conn, now)),
                key,
                token,
                lease_s,
                expires_us,
                hold_end_us,
            };
        }
        self.wake(client, expires_us);
    }

    /// A client releasing (`phase`): past its give-up time the release is
    /// Indeterminate (its session closed), else it goes out if not sent
    /// yet, and the client waits for the answer.
    fn releasing_step(&mut self, client: usize, phase: Phase) {
        let Phase::Releasing {
            sent,
            key,
            token,
            give_up_us,
        } = phase
        else {
            unreachable!("called for a releasing client only");
        };
        let now = self.now;
        if now >= give_up_us {
            if let Some((op, _)) = sent {
                self.history
                    .released(op, ReleaseOutcome::Indeterminate, now);
                self.client_close(client);
            }
            // Never sent: the lease takes the key back.
            self.finish_idle(client);
            return;
        }
        if sent.is_none() {
            let Some(conn) = self.clients[client].session else {
                self.connect(client);
                self.wake(client, give_up_us);
                return;
            };
            // Recorded when written: the client stops using the lock
            // when it decides to release, which is no later.
            let op = self.history.release(client as u64, conn, &key, token, now);
            let mut bytes = Vec::new();
            encode_request(&Request::Release { token, key: &key }, &mut bytes);
            self.send(conn, true, &bytes);
            self.clients[client].phase = Phase::Releasing {
                sent: Some((op, conn)),
                key,
                token,
                give_up_us,
            };
        }
        self.wake(client, give_up_us);
    }

    /// The client holds `key` until `hold_end_us` (extending it on the way
    /// if that is past its expiry), waking at some point before both.
    pub(super) fn hold(
        &mut self,
        client: usize,
        key: String,
        token: u64,
        expires_us: u64,
        hold_end_us: u64,
    ) {
        let now = self.now;
        // Wake at the hold's end, or somewhere in the first two thirds of
        // the lease left, to extend.
        let wake = if hold_end_us <= expires_us {
            hold_end_us
        } else {
            let left = expires_us.saturating_sub(now);
            now + self.rng.range(0, (left * 2 / 3).max(1))
        };
        self.clients[client].phase = Phase::Holding {
            key,
            token,
            expires_us,
            hold_end_us,
        };
        self.clients[client].wake_at = 0;
        self.wake(client, wake);
    }

    pub(super) fn finish_idle(&mut self, client: usize) {
        self.clients[client].phase = Phase::Idle;
        let think = self.rng.range(0, 300 * MS);
        let t = self.now + think;
        self.wake(client, t);
    }

    /// The client's session closed under it.
    pub(super) fn session_lost(&mut self, client: usize) {
        let now = self.now;
        match self.clients[client].phase.clone() {
            Phase::Acquiring(p) if p.op.is_some() => {
                // Maybe sent: never resent; the call is Indeterminate.
                self.history
                    .acquired(p.op.expect("sent"), Outcome::Indeterminate, now);
                self.finish_idle(client);
            }
            Phase::Releasing {
                sent: Some((op, _)),
                ..
            } => {
                self.history
                    .released(op, ReleaseOutcome::Indeterminate, now);
                self.finish_idle(client);
            }
            Phase::Extending {
                sent: Some(_),
                key,
                token,
                lease_s,
                expires_us,
                hold_end_us,
            } => {
                // An extend may be sent again (PROTOCOL §5.3): same token, key
                // and lease, on a new session, until the expiry.
                self.clients[client].phase = Phase::Extending {
                    sent: None,
                    key,
                    token,
                    lease_s,
                    expires_us,
                    hold_end_us,
                };
                self.client_step(client);
            }
            _ => self.client_step(client),
        }
    }

    pub(super) fn client_read(&mut self, client: usize, conn: ConnId) -> Result<(), String> {
        loop {
            let c = self.conns.get_mut(&conn).expect("conn exists");
            let (reply, used) = match decode_reply(&c.client_buf, MAX_KEY) {
                Decoded::Incomplete => return Ok(()),
                Decoded::Malformed(m) => {
                    return Err(format!("client got a malformed reply: {m}"));
                }
                Decoded::Frame { frame, used } => (OwnedReply::from(frame), used),
            };
            c.client_buf.drain(..used);
            self.client_reply(client, conn, reply);
        }
    }

    pub(super) fn client_reply(&mut self, client: usize, conn: ConnId, reply: OwnedReply) {
        let now = self.now;
        match (self.clients[client].phase.clone(), reply) {
            (Phase::Acquiring(p), OwnedReply::Owner { op, owner, token }) if owner == p.owner => {
                self.acquire_answered(client, &p, op, token);
            }
            (
                Phase::Extending {
                    sent: Some((op, sent_on, sent_at)),
                    key,
                    token,
                    lease_s,
                    expires_us,
                    hold_end_us,
                },
                OwnedReply::Extend {
                    extended,
                    token: t,
                    key: k,
                },
            ) if t == token && k == key && sent_on == conn => {
                if extended && now < expires_us {
                    self.history.extended(op, ExtendOutcome::Extended, now);
                    self.stats.extended += 1;
                    let expires_us = sent_at + u64::from(lease_s) * S;
                    self.hold(client, key, token, expires_us, hold_end_us);
                } else {
                    // X, or an E after the expiry: lost, never revived.
                    let outcome = if extended {
                        ExtendOutcome::Lost
                    } else {
                        ExtendOutcome::NotExtended
                    };
                    self.history.extended(op, outcome, now);
                    self.finish_idle(client);
                }
            }
            (
                Phase::Releasing {
                    sent: Some((op, sent_on)),
                    key,
                    token,
                    ..
                },
                OwnedReply::Release {
                    released,
                    token: t,
                    key: k,
                },
            ) if t == token && k == key && sent_on == conn => {
                let outcome = if released {
                    ReleaseOutcome::Released
                } else {
                    ReleaseOutcome::NotReleased
                };
                self.history.released(op, outcome, now);
                self.finish_idle(client);
            }
            // Answers to compensating releases, or to requests of a call
            // this client already gave up on, are not matched to anything.
            _ => {}
        }
    }

    /// The client's sent acquire `p` was answered with the reply op `op`
    /// (`A` with `token`, `T`, `B`, or `L` with the limit as `token`): a grant in time is held, a late one
    /// compensated by a release; either way the call is recorded.
    fn acquire_answered(&mut self, client: usize, p: &Pending, op: u8, token: u64) {
        let now = self.now;
        let Some(acq) = p.op else {
            return;
        };
        match op {
            b'A' if now <= p.deadline_us => {
                self.history.acquired(acq, Outcome::Granted { token }, now);
                let hold = match self.rng.below(8) {
                    0 => self.rng.range(0, u64::from(p.lease_s) * 2 * S),
                    // Held for several leases, extended on the way.
                    1 => self.rng.range(0, u64::from(p.lease_s) * 4 * S),
                    _ => self.rng.range(0, 500 * MS),
                };
                let expires_us = p.sent_us + u64::from(p.lease_s) * S;
                self.hold(client, p.key.clone(), token, expires_us, now + hold);
            }
            b'A' => {
                // Matched after D: not used, released, Indeterminate.
                self.history
                    .acquired(acq, Outcome::LateGrant { token }, now);
                self.clients[client].compensate.push((p.key.clone(), token));
                self.finish_idle(client);
            }
            b'T' => {
                self.history.acquired(acq, Outcome::Timeout, now);
                self.finish_idle(client);
            }
            b'L' => {
                // The key's limit travels in the token's place (OwnedReply).
                let limit = u16::try_from(token).unwrap_or(u16::MAX);
                let outcome = Outcome::LimitMismatch { limit };
                self.history.acquired(acq, outcome, now);
                self.finish_idle(client);
            }
            _ => {
                self.history.acquired(acq, Outcome::Busy, now);
                self.finish_idle(client);
            }
        }
    }

    /// The client closes its session; the server sees the FIN after the data.
    pub(super) fn client_close(&mut self, client: usize) {
        let Some(conn) = self.clients[client].session.take() else {
            return;
        };
        let lat = self.latency();
        let c = self.conns.get_mut(&conn).expect("session exists");
        if !c.client_closed {
            c.client_closed = true;
            let fin = c.last_to_server.max(self.now + lat);
            self.history.session_closed(conn, self.now);
            self.at(fin, Ev::ServerSeesClose { conn });
        }
    }
}

/// The wire bytes of acquire `p` with the wire wait `wait_s`: a plain `A`
/// for a mutex, else a `P` with its limit and mode.
fn acquire_bytes(p: &Pending, wait_s: u8) -> Vec<u8> {
    let (lease_s, owner, key) = (p.lease_s, p.owner, p.key.as_str());
    let request = if p.places == MUTEX {
        Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
        }
    } else {
        Request::AcquireWithLimit {
            wait_s,
            lease_s,
            owner,
            limit: p.places.limit,
            mode: p.places.mode,
            key,
        }
    };
    let mut bytes = Vec::new();
    encode_request(&request, &mut bytes);
    bytes
}

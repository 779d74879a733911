//! The server side: the engine reading its connections' bytes and flushing
//! its replies.

use super::*;

impl Sim {
    pub(super) fn server_read(&mut self, conn: ConnId) -> Result<(), String> {
        let now = self.server_ms();
        loop {
            let c = self.conns.get_mut(&conn).expect("conn exists");
            let (req_owned, used) = match decode_request(&c.server_buf, MAX_KEY) {
                Decoded::Incomplete => break,
                Decoded::Malformed(m) => {
                    return Err(format!("server got a malformed frame from a client: {m}"))
                }
                Decoded::Frame { frame, used } => (OwnedReq::from(frame), used),
            };
            c.server_buf.drain(..used);
            match req_owned {
                OwnedReq::Acquire {
                    wait_s,
                    lease_s,
                    owner,
                    key,
                    places,
                } => {
                    let req = Acquire {
                        key: &key,
                        owner,
                        wait_s,
                        lease_s,
                    };
                    let (engine, out) = (&mut self.server.engine, &mut self.server.out);
                    let outcome = match places {
                        None => engine.acquire(now, conn, req, out),
                        Some(p) => engine.acquire_with_limit(now, conn, req, p, (), out),
                    };
                    if let AcquireOutcome::Queued(_) = outcome {
                        if let Some(&op) = self.op_of_owner.get(&owner) {
                            // In the server's own (millisecond) clock, which
                            // its wait deadlines count from.
                            self.history.queued(op, now.0 * MS);
                        }
                    }
                }
                OwnedReq::Release { token, key } => {
                    self.server
                        .engine
                        .release(now, conn, token, &key, &mut self.server.out);
                }
                OwnedReq::Extend {
                    lease_s,
                    token,
                    key,
                } => {
                    if self.cfg.bug == Some(Bug::ExtendIgnored) {
                        let reply = Reply::Extended { token, key: &key };
                        self.server.out.push(conn, reply, lease_s);
                    } else {
                        self.server.engine.extend(
                            now,
                            conn,
                            &key,
                            token,
                            lease_s,
                            &mut self.server.out,
                        );
                    }
                }
            }
        }
        self.server_flush()
    }

    pub(super) fn server_flush(&mut self) -> Result<(), String> {
        self.server.engine.check_invariants();
        let mut sends = Vec::new();
        for a in self.server.out.iter() {
            if let Reply::Acquired { token, key, .. } = a.reply {
                if token <= self.server.highest_token && self.cfg.bug.is_none() {
                    return Err(format!("engine issued token {token} twice"));
                }
                self.server.highest_token = self.server.highest_token.max(token);
                self.server
                    .granted_to
                    .entry(a.conn)
                    .or_default()
                    .push((key.to_string(), token));
            }
            let mut bytes = Vec::new();
            encode_reply(&a.reply, &mut bytes);
            sends.push((a.conn, bytes));
        }
        self.server.out.clear();
        for (conn, bytes) in sends {
            if self.conns.get(&conn).is_some_and(|c| !c.server_closed) {
                self.send(conn, false, &bytes);
            }
        }
        if let Some(d) = self.server.engine.next_deadline() {
            let t = d.0.saturating_mul(MS).max(self.now);
            if t < self.server.tick_at {
                self.server.tick_at = t;
                self.at(t, Ev::ServerTick);
            }
        }
        Ok(())
    }
}

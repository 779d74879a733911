//! The checks on the nodes: one log (the applied traces), and at the end the
//! equal tables and the liveness of every member.

use super::*;

impl Sim {
    pub(super) fn check_trace(&mut self, i: usize, trace: &[Traced]) -> Result<(), String> {
        for t in trace {
            let id = i + 1;
            if t.snapshot {
                if t.index <= self.last_applied[i] {
                    return self.fail(format!(
                        "node {id} installed snapshot {} at or below applied {}",
                        t.index, self.last_applied[i]
                    ));
                }
            } else {
                if t.index != self.last_applied[i] + 1 {
                    return self.fail(format!(
                        "node {id} applied {} after {}",
                        t.index, self.last_applied[i]
                    ));
                }
                match self.log.get(&t.index) {
                    Some(&(term, hash)) if (term, hash) != (t.term, t.hash) => {
                        return self.fail(format!(
                            "node {id} applied a different entry at index {}",
                            t.index
                        ));
                    }
                    Some(_) => {}
                    None => {
                        self.log.insert(t.index, (t.term, t.hash));
                    }
                }
                if let Some(rid) = t.request {
                    let first = *self.requests.entry(rid).or_insert(t.index);
                    if first != t.index {
                        return self.fail(format!(
                            "request {rid:?} applied at index {first} and again at {}",
                            t.index
                        ));
                    }
                }
            }
            self.last_applied[i] = t.index;
            self.report.applied = self.report.applied.max(t.index);
        }
        Ok(())
    }

    pub(super) fn final_checks(&mut self) -> Result<(), String> {
        let (voters, learners) = self.leader_conf();
        self.report.final_voters.clone_from(&voters);
        let members: BTreeSet<u64> = voters.iter().chain(learners.iter()).copied().collect();
        self.check_members_up_and_settled(&members)?;
        let of_members = |nodes: &[Option<Node<MemDisk>>]| -> Vec<usize> {
            (0..nodes.len())
                .filter(|i| members.contains(&(*i as u64 + 1)) && nodes[*i].is_some())
                .collect()
        };
        let idx = of_members(&self.nodes);
        if idx.is_empty() {
            return self.fail("no member is up after the heal".into());
        }
        let applied: Vec<u64> = idx
            .iter()
            .filter_map(|i| self.nodes[*i].as_ref().map(Node::applied))
            .collect();
        if applied.iter().any(|&a| a != applied[0]) {
            return self.fail(format!("nodes did not converge: applied {applied:?}"));
        }
        // Every member holds the same configuration: raft's voters and
        // learners as each node sees them, not only the leader's.
        for &i in &idx {
            let (v, l) = voters_and_learners(self.nodes[i].as_ref());
            if (&v, &l) != (&voters, &learners) {
                return self.fail(format!(
                    "node {} holds the configuration voters {v:?} learners {l:?}, the \
                     others voters {voters:?} learners {learners:?}",
                    i + 1
                ));
            }
        }
        let tables: Vec<Vec<u8>> = idx
            .iter()
            .filter_map(|i| self.nodes[*i].as_ref())
            .map(|n| n.state_machine().snapshot())
            .collect();
        // A removed node grants nothing: no client ever got a grant there
        // after it applied its removal (its requests are answered B).
        for (i, n) in self.nodes.iter().enumerate() {
            if let Some(n) = n {
                if n.removed() && members.contains(&(i as u64 + 1)) {
                    return self.fail(format!("node {} is removed and a member", i + 1));
                }
            }
        }
        if tables.iter().any(|t| *t != tables[0]) {
            return self.fail("tables differ after the heal".into());
        }
        self.report.digest = tables[0].iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
        Ok(())
    }

    /// Every member is up, its table is consistent and it has left any
    /// joint configuration; its counters go into the report.
    fn check_members_up_and_settled(&mut self, members: &BTreeSet<u64>) -> Result<(), String> {
        for (i, n) in self.nodes.iter().enumerate() {
            if !members.contains(&(i as u64 + 1)) {
                continue;
            }
            let Some(n) = n else {
                return self.fail(format!("node {} is down after the heal", i + 1));
            };
            n.state_machine().check();
            if !n.voters_outgoing().is_empty() {
                return self.fail(format!(
                    "node {} is still in a joint configuration after the heal",
                    i + 1
                ));
            }
            let s = n.stats();
            self.report.snapshot_installs += s.snapshots_installed;
            self.report.timer_proposals += s.timer_proposals;
            self.report.reproposals += s.reproposed;
        }
        Ok(())
    }

    pub(super) fn liveness_checks(&mut self) -> Result<(), String> {
        // Liveness: every member serves a fresh acquire on a fresh key.
        let (voters, learners) = self.leader_conf();
        for i in 0..self.slots() {
            let id = i as u64 + 1;
            if !voters.contains(&id) && !learners.contains(&id) {
                continue;
            }
            let conn = 1_000_000 + id;
            let key = format!("final{id}");
            let mut got = None;
            let mut sent = false;
            // The network still drops messages at random after the heal: a
            // follower's forwarded acquire may be lost, and is proposed
            // again every two election timeouts (2 s). 25 s leaves twelve
            // tries; all of them lost at 3 % is beyond any sweep.
            for _ in 0..LIVENESS_ROUNDS {
                self.out.clear();
                let Some(n) = self.nodes[i].as_mut() else {
                    return self.fail(format!("node {id} is down after the heal"));
                };
                if !sent {
                    sent = true;
                    n.request(
                        self.now,
                        conn,
                        Request::Acquire {
                            wait_s: 0,
                            lease_s: 5,
                            owner: 7,
                            key: &key,
                        },
                        &mut self.out,
                    );
                    if let Some(a) = self.out.iter().next() {
                        got = Some(format!("{:?}", a.reply));
                    }
                }
                self.now = self.now.add_ms(10);
                self.deliver();
                if let Some(reply) = self.liveness_turn(i, conn)? {
                    got = Some(reply);
                }
                if got.is_some() {
                    break;
                }
            }
            match got {
                Some(r) if r.starts_with("Acquired") => {}
                other => {
                    return self.fail(format!("node {id} did not grant after the heal: {other:?}"))
                }
            }
        }
        Ok(())
    }

    /// One turn of every node up after the heal (tick, end of turn, its
    /// messages sent); the reply node `i` gave connection `conn` in it, if
    /// any, as text.
    fn liveness_turn(&mut self, i: usize, conn: ConnId) -> Result<Option<String>, String> {
        let mut got = None;
        for j in 0..self.slots() {
            let Some(node) = self.nodes[j].as_mut() else {
                continue;
            };
            self.out.clear();
            node.tick(self.now, &mut self.out);
            node.end_turn(self.now, &mut self.out)
                .map_err(|e| format!("seed {}: final turn: {e}", self.cfg.seed))?;
            if j == i {
                if let Some(a) = self.out.iter().find(|a| a.conn == conn) {
                    got = Some(format!("{:?}", a.reply));
                }
            }
            let msgs = node.take_messages();
            for m in msgs {
                self.send(j as u64 + 1, m);
            }
        }
        Ok(got)
    }
}

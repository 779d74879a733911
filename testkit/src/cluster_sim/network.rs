//! The simulated network and its faults: messages in flight, delivery,
//! crashes, partitions, restarts and membership changes.

use super::*;

impl Sim {
    pub(super) fn send(&mut self, from: u64, m: Message) {
        let to = m.to;
        if self.blocked.contains(&(from, to)) || self.rng.chance(self.cfg.drop_p) {
            if m.msg_type == MessageType::MsgSnapshot {
                if let Some(n) = self.nodes[from as usize - 1].as_mut() {
                    n.report_snapshot(to, false);
                }
            }
            return;
        }
        let bytes = m.write_to_bytes().expect("raft messages encode");
        let copies = if self.rng.chance(self.cfg.dup_p) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let at = self
                .now
                .add_ms(self.rng.range(self.cfg.delay_ms.0, self.cfg.delay_ms.1 + 1));
            self.net_seq += 1;
            self.net
                .push(Reverse((at, self.net_seq, to, bytes.clone())));
        }
        if m.msg_type == MessageType::MsgSnapshot {
            if let Some(n) = self.nodes[from as usize - 1].as_mut() {
                n.report_snapshot(to, true);
            }
        }
    }

    pub(super) fn deliver(&mut self) {
        while let Some(Reverse((at, _, _, _))) = self.net.peek() {
            if *at > self.now {
                break;
            }
            let Some(Reverse((_, _, to, bytes))) = self.net.pop() else {
                break;
            };
            let Ok(m) = Message::parse_from_bytes(&bytes) else {
                continue;
            };
            if let Some(n) = self.nodes[to as usize - 1].as_mut() {
                // The peer transport refuses nodes outside this node's
                // configuration (a node that has none yet takes --peers).
                let peers = n.peer_addrs();
                if !n.members().is_empty() && !peers.contains_key(&m.from) {
                    continue;
                }
                n.step(m);
            }
        }
    }

    /// A node to hurt: the leader half of the time (that is what forces
    /// elections, lost proposals and timer rebuilds), else any node.
    pub(super) fn victim(&mut self) -> u64 {
        let leader = self
            .nodes
            .iter()
            .flatten()
            .find(|n| n.is_leader())
            .map(Node::id);
        match leader {
            Some(l) if self.rng.chance(0.5) => l,
            _ => self.rng.range(1, self.slots() as u64 + 1),
        }
    }

    pub(super) fn fault(&mut self) {
        let n = self.slots() as u64;
        let (voters, _) = self.conf();
        let live = voters
            .iter()
            .filter(|id| self.nodes[**id as usize - 1].is_some())
            .count();
        match self.rng.range(0, 10) {
            0..=2 => {
                // Crash a node (at most a minority of the voters down at
                // once, so the run keeps making progress; safety does not
                // depend on it).
                let i = self.victim() as usize - 1;
                let voter = voters.contains(&(i as u64 + 1));
                if (!voter || live > voters.len() / 2 + 1) && self.nodes[i].is_some() {
                    if self.rng.chance(0.5) {
                        // Die inside the next fsync.
                        self.disks[i].fail_next_sync();
                    } else {
                        let stats = self.nodes[i].as_ref().map(Node::stats).unwrap_or_default();
                        self.crash(i, "power cut", stats);
                    }
                }
            }
            3 | 4 => {
                // Isolate one node both ways.
                let a = self.victim();
                for b in 1..=n {
                    if b != a {
                        self.blocked.insert((a, b));
                        self.blocked.insert((b, a));
                    }
                }
            }
            5 => {
                // One-way cut, from or to the victim.
                let a = self.victim();
                let b = self.rng.range(1, n + 1);
                if a != b {
                    if self.rng.chance(0.5) {
                        self.blocked.insert((a, b));
                    } else {
                        self.blocked.insert((b, a));
                    }
                }
            }
            6 => {
                // Split in two groups.
                self.blocked.clear();
                let mask = self.rng.next_u64();
                for a in 1..=n {
                    for b in 1..=n {
                        if (mask >> a) & 1 != (mask >> b) & 1 {
                            self.blocked.insert((a, b));
                        }
                    }
                }
            }
            _ => self.blocked.clear(),
        }
        self.next_fault = self.now.add_ms(
            self.rng
                .range(self.cfg.fault_every_ms / 2, self.cfg.fault_every_ms * 3 / 2),
        );
    }

    pub(super) fn crash(&mut self, i: usize, why: &str, stats: ticketd::cluster::node::NodeStats) {
        if self.nodes[i].take().is_none() {
            return;
        }
        let _ = why;
        self.report.crashes += 1;
        self.report.snapshot_installs += stats.snapshots_installed;
        self.report.timer_proposals += stats.timer_proposals;
        self.report.reproposals += stats.reproposed;
        let unsynced = self.disks[i].unsynced() as u64;
        let keep = self.rng.range(0, unsynced + 1) as usize;
        self.disks[i].crash(keep);
        self.restart_at[i] = self.now.add_ms(self.rng.range(200, 4000));
        // Clients connected to it lose their connection.
        let id = i as u64 + 1;
        for c in 0..self.clients.len() {
            if self.clients[c].node == id {
                self.reconnect(c);
            }
        }
    }

    /// The client's connection is gone: its outstanding request is given up
    /// (never answered); what it holds it keeps holding (a lock belongs to
    /// the token), and it continues on another node.
    pub(super) fn reconnect(&mut self, c: usize) {
        let old = (self.clients[c].node, self.clients[c].conn);
        self.conn_owner.remove(&old);
        if let Some(n) = self.nodes[old.0 as usize - 1].as_mut() {
            n.disconnect(old.1);
        }
        let now_us = us(self.now);
        match (self.clients[c].state.clone(), self.clients[c].op.take()) {
            (ClientState::Acquiring { .. }, Some(op)) => {
                self.history.acquired(op, Outcome::Indeterminate, now_us);
            }
            (ClientState::Releasing { .. } | ClientState::ReleasingOthers { .. }, Some(op)) => {
                self.history
                    .released(op, ReleaseOutcome::Indeterminate, now_us);
            }
            // The attempt is given up unanswered: it moves nothing (the
            // Extend goes out again on the new connection).
            (ClientState::Extending { .. } | ClientState::ExtendingUnknown { .. }, Some(op)) => {
                self.history.extended(op, ExtendOutcome::Lost, now_us);
            }
            _ => {}
        }
        // A late answer to an expired extend can no longer come.
        self.clients[c].stale.clear();
        self.history.session_closed(old.1, now_us);
        match self.clients[c].state {
            ClientState::Acquiring { .. }
            | ClientState::Releasing { .. }
            | ClientState::ReleasingOthers { .. }
            | ClientState::ExtendingUnknown { .. } => {
                self.report.given_up += 1;
                self.clients[c].state = ClientState::Idle;
                self.clients[c].next_at = self.now.add_ms(self.rng.range(0, 1000));
            }
            ClientState::Extending {
                ref mut retry_at, ..
            } => {
                // The holding goes on; the same Extend goes out again on
                // the new connection (PROTOCOL §5.3).
                *retry_at = self.now;
                self.clients[c].next_at = self.now;
            }
            _ => {}
        }
        let node = self.rng.range(1, self.slots() as u64 + 1);
        let conn = self.next_conn;
        self.next_conn += 1;
        self.clients[c].node = node;
        self.clients[c].conn = conn;
        self.conn_owner.insert((node, conn), c);
    }

    pub(super) fn restarts(&mut self) -> Result<(), String> {
        for i in 0..self.slots() {
            if self.restart_at[i] > self.now {
                continue;
            }
            self.restart_at[i] = Millis::NEVER;
            if self.nodes[i].is_some() {
                continue;
            }
            let id = i as u64 + 1;
            let cfg = node_config(id, &self.cfg);
            match Node::open(cfg, self.disks[i].clone(), &self.logger) {
                Ok(n) => {
                    self.last_applied[i] = n.applied();
                    self.nodes[i] = Some(n);
                }
                Err(e) => return self.fail(format!("restart of node {id} failed: {e}")),
            }
        }
        Ok(())
    }

    /// One membership change through the leader, as the admin port does.
    pub(super) fn change_members(&mut self) {
        let Some(li) = self
            .nodes
            .iter()
            .position(|n| n.as_ref().is_some_and(Node::is_leader))
        else {
            return;
        };
        let leader = li as u64 + 1;
        let (voters, learners) = voters_and_learners(self.nodes[li].as_ref());
        let removed = self.nodes[li]
            .as_ref()
            .map(|n| n.replicated_members().removed().clone())
            .unwrap_or_default();
        let spare = (self.cfg.nodes as u64 + 1..=self.slots() as u64)
            .find(|id| !voters.contains(id) && !learners.contains(id) && !removed.contains(id));
        let change = if let Some(&l) = learners.first() {
            if self.rng.chance(0.8) {
                Change::Promote(l)
            } else {
                Change::Remove(l, false)
            }
        } else if let Some(id) = spare.filter(|_| voters.len() < 5 || self.rng.chance(0.3)) {
            Change::AddLearner(
                id,
                std::net::SocketAddr::from(([127, 0, 0, 1], 7000 + id as u16)),
            )
        } else if voters.len() > 3 {
            let id = if self.rng.chance(0.5) {
                leader
            } else {
                voters[self.rng.range(0, voters.len() as u64) as usize]
            };
            Change::Remove(id, false)
        } else {
            return;
        };
        let reachable: BTreeSet<u64> = (1..=self.slots() as u64)
            .filter(|&id| {
                self.nodes[id as usize - 1].is_some()
                    && !self.blocked.contains(&(leader, id))
                    && !self.blocked.contains(&(id, leader))
            })
            .collect();
        let Some(n) = self.nodes[li].as_mut() else {
            return;
        };
        match n.change_members(change, &reachable) {
            Ok(what) => {
                self.report.conf_changes += 1;
                if self.debug {
                    eprintln!("{} leader {leader}: {what}", self.now);
                }
            }
            Err(r) => {
                self.report.conf_refused += 1;
                if self.debug {
                    eprintln!("{} leader {leader}: refused: {r}", self.now);
                }
            }
        }
    }
}

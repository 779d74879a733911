//! Client requests on their way into the log: refusals, the turn's batch,
//! the tracking of each proposal until it applies, and re-proposal.

use bytes::Bytes;
use raft::eraftpb::{Entry, Message, MessageType};

use crate::cluster::command::{entry_caller, Command, Origin, Rid};
use crate::cluster::log::Disk;
use crate::engine::{Caller, ConnId, Outbox};
use crate::proto::{Reply, Request};
use crate::time::Millis;

use super::{Node, Pending, MAX_CANCELS};

/// The size of the buffers client requests' entries are written into.
const ENTRY_BUF_BYTES: usize = 8 << 10;

impl<D: Disk> Node<D> {
    pub(super) fn refuse(&mut self, conn: ConnId, req: Request<'_>, out: &mut Outbox) {
        self.stats.refused += 1;
        match req {
            Request::Acquire { owner, key, .. } | Request::AcquireWithLimit { owner, key, .. } => {
                out.push(conn, Reply::Busy { owner, key }, 0);
            }
            Request::Release { token, key } => {
                out.push(conn, Reply::NotReleased { token, key }, 0);
            }
            // Never X: that would say the grant is gone, and a node that
            // cannot propose does not know (PROTOCOL §5.3). Unanswered, the
            // client gives this attempt up and tries another node.
            Request::Extend { .. } => {}
        }
    }

    pub(super) fn propose_data(&mut self, seq: Option<u64>, data: &[u8]) -> bool {
        let before = self.rn.raft.raft_log.last_index();
        let entry = Command::encode_entry(self.token_rng.bits(), data);
        if self.rn.propose(Vec::new(), entry).is_err() {
            return false;
        }
        let after = self.rn.raft.raft_log.last_index();
        if let Some(seq) = seq {
            if after > before {
                self.by_index.insert(after, self.rn.raft.term, seq);
            }
        }
        true
    }

    /// A client request from local connection `conn`. Answers now (B or N)
    /// if no leader is known or the backlog is full; otherwise it is
    /// proposed with the turn's other requests in [`Node::end_turn`], which
    /// answers B or N if raft drops that proposal, and it is answered after
    /// it applies.
    pub fn request(&mut self, now: Millis, conn: ConnId, req: Request<'_>, out: &mut Outbox) {
        self.request_as(now, conn, Caller::default(), req, out);
    }

    /// [`Node::request`] from a connection of identity `who`: its entry
    /// records the caller ([`entry_caller`]), so that every node applies
    /// it as `who` (a grant records its holder; a release or extend of a
    /// grant `who` may not act on is refused), also when it is proposed
    /// again.
    pub fn request_as(
        &mut self,
        now: Millis,
        conn: ConnId,
        who: Caller,
        req: Request<'_>,
        out: &mut Outbox,
    ) {
        if !self.may_propose() {
            self.refuse(conn, req, out);
            return;
        }
        self.track(now, conn, entry_caller(who), &req, false);
    }

    /// Whether a client request can be proposed now: a leader is known,
    /// this node works and is a member, and the backlog has room.
    fn may_propose(&self) -> bool {
        self.failed.is_none()
            && self.leader() != 0
            && !self.removed()
            && self.unapplied.len() < self.cfg.max_pending
    }

    /// Gives `req` of `caller` on connection `conn` a request id, and
    /// queues it for this turn's proposal and for its answer (to nobody
    /// when `closed`).
    fn track(
        &mut self,
        now: Millis,
        conn: ConnId,
        caller: Caller,
        req: &Request<'_>,
        closed: bool,
    ) {
        let seq = self.next_seq;
        let rid = Rid {
            node: self.cfg.id,
            epoch: self.epoch,
            seq,
        };
        self.unapplied.insert(seq);
        let floor = self.unapplied.first().unwrap_or(seq);
        let entry = self.request_entry(caller, rid, floor, conn, req);
        // The state machine finds the request again in what it decodes.
        debug_assert!(
            Command::decode_entry(&entry)
                .is_ok_and(|(c, _, who)| c.rid() == Some(rid) && who == caller),
            "a proposed request decodes to its own request id"
        );
        self.next_seq += 1;
        self.batch.push(seq);
        self.pending.insert(
            seq,
            Pending {
                conn,
                entry,
                received_at: now,
                proposed_at: now,
                queued: false,
                acquire: matches!(
                    req,
                    Request::Acquire { .. } | Request::AcquireWithLimit { .. }
                ),
                closed,
            },
        );
        if !closed {
            self.conns.insert((conn, seq));
        }
    }

    /// A grant applied for an acquire of ours whose connection `conn` had
    /// closed: nobody has its token, so it is released at once rather
    /// than held by nobody until its lease ends. If nothing can be
    /// proposed now, the lease ends it. The node releases it as the admin
    /// identity: the grant may be bound to its taker's identity, and the
    /// token is the one the grant was just given.
    pub(super) fn release_unseen(&mut self, now: Millis, conn: ConnId, key: &str, token: u64) {
        if !self.may_propose() {
            return;
        }
        log::debug!(
            "node {}: releasing grant {token} of {key:?}: its connection closed before the answer",
            self.cfg.id
        );
        self.stats.unseen_released += 1;
        let node = Caller {
            holder: 0,
            admin: true,
        };
        self.track(now, conn, node, &Request::Release { token, key }, true);
    }

    /// The log entry of client request `req` of `caller`, with the token
    /// bits drawn for it: written after the ones before it in
    /// [`Node::entry_buf`] and split off, so it shares that buffer (one
    /// allocation for many entries; raft's clones of it only count
    /// references).
    fn request_entry(
        &mut self,
        caller: Caller,
        rid: Rid,
        floor: u64,
        conn: ConnId,
        req: &Request<'_>,
    ) -> Bytes {
        self.entry_scratch.clear();
        Command::write_request_entry(
            &mut self.entry_scratch,
            self.token_rng.bits(),
            caller,
            rid,
            floor,
            conn,
            req,
        );
        let n = self.entry_scratch.len();
        if self.entry_buf.capacity() < n {
            // A buffer that outlives its entries is at most this size.
            self.entry_buf.reserve(n.max(ENTRY_BUF_BYTES));
        }
        self.entry_buf.extend_from_slice(&self.entry_scratch);
        self.entry_buf.split().freeze()
    }

    /// Proposes this turn's client requests, all in one raft message: on a
    /// leader one append per follower carries them, on a follower one
    /// forward. If raft drops it (no leader after all, the uncommitted
    /// limit), each is answered as a refused request (B, N, or nothing for
    /// an extend) and forgotten: it was never proposed.
    pub(super) fn propose_batch(&mut self, out: &mut Outbox) {
        if self.batch.is_empty() {
            return;
        }
        let seqs = std::mem::take(&mut self.batch);
        let mut entries = Vec::with_capacity(seqs.len());
        let mut proposed = Vec::with_capacity(seqs.len());
        for seq in seqs {
            // A request whose connection closed in this turn is gone.
            if let Some(p) = self.pending.get(&seq) {
                // The entry carries the token bits this node drew for it
                // (`request_entry`), as every proposal does.
                entries.push(Entry {
                    data: p.entry.clone(),
                    ..Entry::default()
                });
                proposed.push(seq);
            }
        }
        if entries.is_empty() {
            return;
        }
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgPropose);
        m.from = self.cfg.id;
        m.set_entries(entries.into());
        let before = self.rn.raft.raft_log.last_index();
        let ok = self.failed.is_none() && self.rn.step(m).is_ok();
        self.after_raft_call();
        if ok {
            self.stats.proposed += proposed.len() as u64;
            let after = self.rn.raft.raft_log.last_index();
            // A leader appended them in order at before + 1 ..= after.
            if after - before == proposed.len() as u64 {
                let term = self.rn.raft.term;
                for (i, seq) in (before + 1..).zip(proposed) {
                    self.by_index.insert(i, term, seq);
                }
            }
            return;
        }
        for seq in proposed {
            let Some(p) = self.pending.remove(&seq) else {
                continue;
            };
            self.unapplied.remove(seq);
            self.conns.remove(&(p.conn, seq));
            self.stats.refused += 1;
            if p.closed {
                continue; // nobody to answer
            }
            match Command::decode(Command::entry_command(&p.entry)) {
                Ok(
                    Command::Acquire { owner, key, .. }
                    | Command::AcquireWithLimit { owner, key, .. },
                ) => {
                    out.push(p.conn, Reply::Busy { owner, key: &key }, 0);
                }
                Ok(Command::Release { token, key, .. }) => {
                    out.push(p.conn, Reply::NotReleased { token, key: &key }, 0);
                }
                // An extend that could not be proposed gets no answer
                // (never X, see `refuse`).
                _ => {}
            }
        }
        super::seqs::shrink(&mut self.pending);
    }

    /// Local connection `conn` is gone. Its acquires are forgotten and its
    /// queued ones cancelled cluster-wide (one that applies later queues
    /// nothing that stays, and a grant it gets is released at once, since
    /// nobody has its token). Its releases and extends were read, so
    /// they take effect (PROTOCOL §2.5): they stay proposed, are proposed
    /// again if lost, and their answers go to nobody.
    pub fn disconnect(&mut self, conn: ConnId) {
        let seqs: Vec<u64> = self
            .conns
            .range((conn, 0)..=(conn, u64::MAX))
            .map(|&(_, seq)| seq)
            .collect();
        if seqs.is_empty() {
            return;
        }
        let mut had_acquire = false;
        for seq in seqs {
            self.conns.remove(&(conn, seq));
            match self.pending.get_mut(&seq) {
                Some(p) if !p.acquire => p.closed = true,
                Some(_) => {
                    self.pending.remove(&seq);
                    self.unapplied.remove(seq);
                    had_acquire = true;
                }
                None => {
                    self.unapplied.remove(seq);
                }
            }
        }
        super::seqs::shrink(&mut self.pending);
        if had_acquire {
            self.queue_cancel(Origin {
                node: self.cfg.id,
                epoch: self.epoch,
                conn,
            });
        }
    }

    /// Moves into `out` the local connections to close: each had a request
    /// that applied inside a snapshot this node installed and whose answer
    /// the table cannot tell (see [`Node::request`]). Closing it is the
    /// answer: its client reports the outcome unknown at once.
    pub fn take_closes(&mut self, out: &mut Vec<ConnId>) {
        out.append(&mut self.closes);
    }

    pub(super) fn queue_cancel(&mut self, origin: Origin) {
        if self.cancels.len() >= MAX_CANCELS {
            // The leader's wait timers clear those waiters anyway.
            self.cancels.pop_front();
        }
        self.cancels.push_back(origin);
    }

    pub(super) fn repropose_ms(&self) -> u64 {
        2 * self.cfg.election_tick as u64 * self.cfg.tick_ms
    }

    pub(super) fn repropose(&mut self, now: Millis) {
        if self.leader() == 0 {
            return;
        }
        let after = self.repropose_ms();
        // `proposed_at == ZERO` marks a proposal to make again at once (the
        // leader changed, its index applied with another command, a
        // snapshot covered it), also in the first `after` ms of the clock.
        let due: Vec<u64> = self
            .unapplied
            .iter()
            .filter(|s| {
                self.pending.get(s).is_some_and(|p| {
                    !p.queued
                        && (p.proposed_at == Millis::ZERO || now.since(p.proposed_at) >= after)
                })
            })
            .collect();
        for seq in due {
            // Proposed again with token bits drawn afresh, and with its
            // caller.
            let entry = self
                .pending
                .get(&seq)
                .map(|p| p.entry.clone())
                .unwrap_or_default();
            if !self.propose_data(Some(seq), Command::entry_body(&entry)) {
                break;
            }
            self.stats.reproposed += 1;
            if let Some(p) = self.pending.get_mut(&seq) {
                p.proposed_at = now;
            }
        }
    }

    /// The entry at an index a local leader gave one of our proposals
    /// applied; if it is not that proposal, the proposal was lost.
    pub(super) fn mark_lost(&mut self, at: Option<(u64, u64)>, applied_rid: Option<Rid>) {
        let Some((_, seq)) = at else {
            return;
        };
        let ours = applied_rid
            .is_some_and(|r| r.node == self.cfg.id && r.epoch == self.epoch && r.seq == seq);
        if !ours {
            if let Some(p) = self.pending.get_mut(&seq) {
                p.proposed_at = Millis::ZERO;
            }
        }
    }

    pub(super) fn finish(&mut self, seq: u64) {
        self.unapplied.remove(seq);
        if let Some(p) = self.pending.remove(&seq) {
            self.conns.remove(&(p.conn, seq));
            super::seqs::shrink(&mut self.pending);
        }
    }
}

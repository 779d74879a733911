//! The Ready pipeline: what one loop turn does with raft's Readys, and
//! the durability bookkeeping behind it.

use std::io;

use raft::eraftpb::{Entry, EntryType, Message, MessageType};
use raft::ProgressState;

use crate::cluster::log::Disk;
use crate::engine::Outbox;
use crate::time::Millis;

use super::{Node, NodeError};

impl<D: Disk> Node<D> {
    /// Handles raft's Readys (send, apply, write), starts the fsync they
    /// need, rebuilds a new leader's timers and compacts the log when due.
    /// An error means the disk failed: the node must stop.
    ///
    /// # Background fsync
    ///
    /// Each Ready is written and raft advanced at once; the fsync runs in
    /// the background, one at a time, covering every Ready written before
    /// it began. [`Node::tick`] takes in its end (the server's poll wakes
    /// for it) and lets out what waited for it: raft's own progress and the
    /// persisted messages (votes, append acknowledgements). Replies answer
    /// applied entries: committed, so durable on a majority; raft hands
    /// them out only once they are durable here too, except to a leader
    /// that defers its own fsync (below).
    ///
    /// # A leader's own fsync
    ///
    /// raft counts a leader toward a commit only up to what its finished
    /// fsync covers. While the followers that are live and replicating
    /// form a majority by themselves, they commit without the leader, and
    /// its fsync would only let raft hand it entries it can read from its
    /// own log already. So such a leader syncs only every
    /// [`leader_sync_ms`](super::NodeConfig::leader_sync_ms) (and at once
    /// when its followers stop forming a majority, or a committed conf
    /// change waits), and applies
    /// the committed entries past its durable ones straight from its log
    /// store. They are committed: a majority holds them durably, so every
    /// later leader has them, whatever happens to this node's unsynced
    /// tail. raft's applied index trails behind until the sync, and the
    /// entries it hands out then are skipped as already applied.
    pub fn end_turn(&mut self, now: Millis, out: &mut Outbox) -> Result<(), NodeError> {
        self.check_failed()?;
        self.poll_sync();
        self.propose_batch(out);
        for _ in 0..8 {
            if self.failed.is_some() || !self.rn.has_ready() {
                break;
            }
            if let Err(e) = self.handle_ready(now, out) {
                self.failed = Some(e.to_string());
                return Err(e);
            }
            // A Ready that needed no fsync may let raft go on at once.
            self.poll_sync();
        }
        self.check_failed()?;
        self.apply_committed_ahead(now, out);
        if let Err(e) = self.wal.write(false) {
            self.failed = Some(e.to_string());
            return Err(e.into());
        }
        if !self.leader_defers_sync(now) {
            self.start_sync(now);
        }
        self.check_failed()?;
        if self.is_leader() && !self.timers_ready && self.rn.raft.apply_to_current_term() {
            self.rebuild_timers(now);
        }
        if let Err(e) = self.maybe_compact() {
            self.failed = Some(e.to_string());
            return Err(e);
        }
        Ok(())
    }

    /// The disk failure that stopped this node, as an error.
    fn check_failed(&self) -> Result<(), NodeError> {
        match &self.failed {
            Some(why) => Err(NodeError::Io(io::Error::other(why.clone()))),
            None => Ok(()),
        }
    }

    /// Takes in the running fsync's end, if it is over, and lets out what
    /// waited for it; then, if written records wait for an fsync and none
    /// runs, starts one.
    pub(super) fn poll_sync(&mut self) {
        if self.failed.is_some() {
            return;
        }
        if let Some(number) = self.syncing {
            match self.wal.poll_sync() {
                None => return,
                Some(Err(e)) => {
                    // raft believes these Readys will be durable: the node
                    // is dead, as after a power cut at this point.
                    self.failed = Some(format!("WAL fsync failed: {e}"));
                    return;
                }
                Some(Ok(())) => {
                    self.syncing = None;
                    self.persisted(number);
                }
            }
        }
        if !self.wal.sync_owed() && !self.unsynced.is_empty() {
            // What is left needed no fsync of its own, only its turn.
            self.persisted(self.last_ready);
        }
    }

    /// Begins the fsync that written records wait for, unless one runs.
    pub(super) fn start_sync(&mut self, now: Millis) {
        if self.failed.is_some() || self.syncing.is_some() || !self.wal.sync_owed() {
            return;
        }
        if let Err(e) = self.wal.start_sync() {
            self.failed = Some(format!("WAL fsync failed: {e}"));
            return;
        }
        self.syncing = Some(self.last_ready);
        self.last_sync_began = now;
        self.stats.syncs += 1;
        // A disk that syncs inline is done already.
        self.poll_sync();
    }

    /// True while this node leads, its live followers commit without it,
    /// and its last fsync began less than
    /// [`leader_sync_ms`](super::NodeConfig::leader_sync_ms) ago: its own
    /// fsync can wait (see [`Node::end_turn`]).
    fn leader_defers_sync(&self, now: Millis) -> bool {
        let every = self.cfg.leader_sync_ms;
        every > 0
            && self.is_leader()
            && !self.conf_change_waits
            && now.since(self.last_sync_began) < every
            && self.followers_commit_alone()
    }

    /// True when the voters other than this node that are live (heard from
    /// within raft's quorum check) and replicating form a quorum of the
    /// configuration (both halves of a joint one).
    fn followers_commit_alone(&self) -> bool {
        let me = self.cfg.id;
        let prs = self.rn.raft.prs();
        // Not a follower whose window of appends in flight is full: it is
        // behind, and the commit would wait for it.
        let live = |id: &u64| {
            *id != me
                && prs.get(*id).is_some_and(|pr| {
                    pr.recent_active && pr.state == ProgressState::Replicate && !pr.is_paused()
                })
        };
        let majority = |ids: &[u64]| {
            ids.is_empty() || 2 * ids.iter().filter(|id| live(id)).count() > ids.len()
        };
        let cs = self.rn.store().conf_state();
        majority(&cs.voters) && majority(&cs.voters_outgoing)
    }

    /// A leader applies the committed entries raft does not hand out yet
    /// because this node's fsync has not covered them (see
    /// [`Node::end_turn`]), in order, reading them from its log store. It
    /// stops before a conf change, which only raft's own path applies, and
    /// then syncs at once.
    fn apply_committed_ahead(&mut self, now: Millis, out: &mut Outbox) {
        self.conf_change_waits = false;
        if self.cfg.leader_sync_ms == 0 || !self.is_leader() {
            return;
        }
        // Up to the commit index staged for the WAL, never past it: a
        // compaction writes the stored hard state with the snapshot.
        let committed = self
            .rn
            .raft
            .raft_log
            .committed
            .min(self.rn.store().hard_state().commit);
        if committed <= self.applied {
            return;
        }
        let entries = self
            .rn
            .store()
            .entries_between(self.applied + 1, committed + 1);
        for e in &entries {
            if e.entry_type != EntryType::EntryNormal {
                self.conf_change_waits = true;
                return;
            }
            self.apply_one(now, e, out);
        }
    }

    /// Readys up to `number` are durable: tell raft and send what waited.
    pub(super) fn persisted(&mut self, number: u64) {
        self.rn.on_persist_ready(number);
        while let Some((n, _)) = self.unsynced.front() {
            if *n > number {
                break;
            }
            if let Some((_, msgs)) = self.unsynced.pop_front() {
                self.msgs.extend(msgs);
            }
        }
        self.after_raft_call();
    }

    fn handle_ready(&mut self, now: Millis, out: &mut Outbox) -> Result<(), NodeError> {
        let mut rd = self.rn.ready();
        if let Some(ss) = rd.ss() {
            let leader = ss.leader_id;
            self.on_soft_state(leader);
        }
        // A leader's messages may go out before its own fsync.
        self.msgs.extend(rd.take_messages());
        if !rd.snapshot().is_empty() {
            self.install_snapshot(now, rd.snapshot().clone())?;
        }
        // Committed entries are durable here already (raft caps them at the
        // persisted index).
        let committed = rd.take_committed_entries();
        self.apply_entries(now, &committed, out);
        if !rd.entries().is_empty() {
            debug_assert!(
                entries_follow_on(rd.entries()),
                "raft hands the WAL contiguous indices with non-decreasing terms"
            );
            self.wal.stage_entries(rd.entries());
            self.rn
                .mut_store()
                .append(rd.entries())
                .map_err(|e| NodeError::Io(io::Error::new(io::ErrorKind::InvalidData, e)))?;
        }
        if let Some(hs) = rd.hs() {
            self.wal.stage_hard_state(hs);
            let hs = hs.clone();
            self.rn.mut_store().set_hard_state(hs);
        }
        // A forwarded proposal claims nothing about local state, so it need
        // not wait for this node's fsync; votes and acks must.
        let (early, persisted): (Vec<Message>, Vec<Message>) = rd
            .take_persisted_messages()
            .into_iter()
            .partition(|m| m.msg_type == MessageType::MsgPropose);
        self.msgs.extend(early);
        // Written with the turn's other Readys, at the end of the turn.
        self.wal.end_batch(rd.must_sync());
        self.stats.batches += 1;
        let number = rd.number();
        let installs_snapshot = !rd.snapshot().is_empty();
        // What raft handed out for applying: its last committed entry, or
        // the snapshot.
        let handed = if installs_snapshot {
            Some(rd.snapshot().get_metadata().index)
        } else {
            committed.last().map(|e| e.index)
        };
        self.last_ready = number;
        self.rn.advance_append_async(rd);
        // Even a Ready that needs no fsync waits for the ones before it.
        self.unsynced.push_back((number, persisted));
        if installs_snapshot {
            // raft counts a snapshot applied only once it is durable; this
            // rare Ready is synced before going on.
            self.wal.sync()?;
            self.syncing = None;
            self.persisted(number);
        }
        // raft's applied index may be ahead of what it hands out: a
        // compaction moves it past entries a leader applied before raft
        // handed them out (see `maybe_compact`).
        if let Some(i) = handed.filter(|&i| i > self.rn.raft.raft_log.applied) {
            self.rn.advance_apply_to(i);
        }
        self.after_raft_call();
        Ok(())
    }

    fn on_soft_state(&mut self, leader: u64) {
        if leader != self.leader {
            if leader == 0 {
                log::info!(
                    "node {}: no leader known (term {})",
                    self.cfg.id,
                    self.term()
                );
            } else if leader != self.cfg.id {
                // A leader says so when it becomes one (`after_raft_call`).
                log::info!(
                    "node {}: leader is node {leader} (term {})",
                    self.cfg.id,
                    self.term()
                );
            }
            if leader != 0 {
                self.stats.leader_changes += 1;
            }
            self.leader = leader;
            self.next_repropose_check = Millis::ZERO;
            // A forwarded proposal may have died with the old leader.
            for seq in self.unapplied.iter() {
                if let Some(p) = self.pending.get_mut(&seq) {
                    p.proposed_at = Millis::ZERO;
                }
            }
        }
        // Leaving or entering leadership: the heap is rebuilt from the
        // table once this term's first entry has applied.
        self.timers.clear();
        self.timers_ready = false;
    }
}

/// Drops every accepting `MsgAppendResponse` that a later or higher one to
/// the same peer in the same term supersedes: the leader only ever raises a
/// follower's progress, so the highest index carries all the news. (The
/// commit index a response reports matters only to raft's group commit,
/// which is off.) Rejections are kept. A dropped ack is no worse than a
/// lost one, which raft survives.
pub(super) fn coalesce_acks(msgs: &mut Vec<Message>) {
    let is_ack = |m: &Message| m.msg_type == MessageType::MsgAppendResponse && !m.reject;
    if msgs.iter().filter(|m| is_ack(m)).count() < 2 {
        return;
    }
    // (to, term) -> position of the ack kept so far.
    let mut kept: Vec<(u64, u64, usize)> = Vec::new();
    let mut dropped = vec![false; msgs.len()];
    for (i, m) in msgs.iter().enumerate() {
        if !is_ack(m) {
            continue;
        }
        match kept.iter_mut().find(|k| k.0 == m.to && k.1 == m.term) {
            None => kept.push((m.to, m.term, i)),
            Some(k) if m.index >= msgs[k.2].index => {
                dropped[k.2] = true;
                k.2 = i;
            }
            Some(_) => dropped[i] = true,
        }
    }
    let mut i = 0;
    msgs.retain(|_| {
        i += 1;
        !dropped[i - 1]
    });
}

/// True when each entry's index is one more than the one before it and no
/// term goes down: what the WAL's recovery and raft's log rely on.
pub(super) fn entries_follow_on(entries: &[Entry]) -> bool {
    entries
        .windows(2)
        .all(|w| w[1].index == w[0].index + 1 && w[1].term >= w[0].term)
}

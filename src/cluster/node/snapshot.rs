//! Snapshots: installing one a leader sent (and what that does to this
//! node's pending requests), and compaction (a snapshot of the table, then the log rewritten).

use std::io;

use raft::eraftpb::Snapshot;

use crate::cluster::command::{Command, Rid};
use crate::cluster::log::Disk;
use crate::cluster::state::StateMachine;
use crate::time::Millis;

#[cfg(any(test, feature = "testkit"))]
use super::{fnv, Traced};
use super::{Node, NodeError};

impl<D: Disk> Node<D> {
    /// Installs the snapshot a leader sent: staged for the WAL, the table
    /// restored from it, then raft's log store.
    pub(super) fn install_snapshot(
        &mut self,
        now: Millis,
        snap: Snapshot,
    ) -> Result<(), NodeError> {
        self.wal.stage_snapshot(&snap);
        let meta = snap.get_metadata();
        // Decoded when it was admitted (`guard`): a snapshot whose table
        // does not decode never reaches raft.
        self.sm = match self.take_checked_snapshot(meta.index, meta.term) {
            Some(sm) => sm,
            None => StateMachine::restore(self.cfg.limits.clone(), &snap.data)
                .map_err(NodeError::BadSnapshot)?,
        };
        self.applied = meta.index;
        #[cfg(any(test, feature = "testkit"))]
        if self.cfg.trace_applied {
            self.trace.push(Traced {
                index: meta.index,
                term: meta.term,
                hash: fnv(&snap.data),
                snapshot: true,
                request: None,
            });
        }
        self.stats.snapshots_installed += 1;
        log::info!(
            "node {}: installed the leader's snapshot at index {} (term {})",
            self.cfg.id,
            meta.index,
            meta.term
        );
        self.reseed_holds(now);
        self.members_version += 1;
        self.after_snapshot_install();
        self.rn.mut_store().apply_snapshot(snap);
        Ok(())
    }

    fn after_snapshot_install(&mut self) {
        // Requests of ours the snapshot already covers: a queued acquire is
        // still answered later. The rest are proposed again at the next
        // tick: the duplicate changes nothing, and when it applies an
        // acquire still granted to it is answered from the table (see
        // `apply_entries`); other answers are gone with the entries, and
        // the request's connection is closed then (`take_closes`).
        let seqs: Vec<u64> = self.unapplied.iter().collect();
        for seq in seqs {
            let rid = Rid {
                node: self.cfg.id,
                epoch: self.epoch,
                seq,
            };
            let Some(p) = self.pending.get_mut(&seq) else {
                continue;
            };
            let Ok(cmd) = Command::decode(Command::entry_command(&p.entry)) else {
                continue;
            };
            if let Command::Acquire { key, .. } | Command::AcquireWithLimit { key, .. } = &cmd {
                if self.sm.is_waiting(key, rid) {
                    p.queued = true;
                    p.entry = bytes::Bytes::new();
                    self.unapplied.remove(seq);
                    continue;
                }
            }
            if self.sm.has_applied(rid) {
                p.proposed_at = Millis::ZERO;
                self.next_repropose_check = Millis::ZERO;
            }
        }
    }

    pub(super) fn maybe_compact(&mut self) -> Result<(), NodeError> {
        let snap_index = self.snapshot_index();
        if self.applied <= snap_index {
            return Ok(());
        }
        let since = self.applied - snap_index;
        let due = since >= self.cfg.snapshot_every
            || self.wal.log_bytes() > self.cfg.max_wal_bytes
            || self.snapshot_now;
        if !due {
            return Ok(());
        }
        // A leader keeps the entries a live follower still lacks: cutting
        // them would make it send that follower the whole table instead, and
        // the follower could not answer the requests of its own clients
        // that the snapshot covers. Up to four intervals, or the WAL size
        // limit, then it compacts regardless.
        let forced = since >= 4 * self.cfg.snapshot_every
            || self.wal.log_bytes() > self.cfg.max_wal_bytes
            || self.snapshot_now;
        self.snapshot_now = false;
        if self.is_leader() && !forced {
            let (me, applied) = (self.cfg.id, self.applied);
            let lagging = self
                .rn
                .raft
                .prs()
                .iter()
                .any(|(id, pr)| *id != me && pr.recent_active && pr.matched < applied);
            if lagging {
                return Ok(());
            }
        }
        let data = self.sm.snapshot();
        let applied = self.applied;
        // A leader that applied past raft's applied index (see
        // `Node::end_turn`) compacts entries raft will now never hand out:
        // they leave raft's count of uncommitted bytes as they would when
        // handed out (else it only grows, until proposals are refused).
        let raft_applied = self.rn.raft.raft_log.applied;
        if raft_applied < applied {
            let skipped = self
                .rn
                .store()
                .entries_between(raft_applied + 1, applied + 1);
            self.rn.raft.reduce_uncommitted_size(&skipped);
        }
        self.rn
            .mut_store()
            .compact_to(applied, data)
            .map_err(|e| NodeError::Io(io::Error::new(io::ErrorKind::InvalidData, e)))?;
        self.wal.rewrite(self.rn.store(), self.epoch)?;
        // The rewritten log is durable and holds every Ready handled (a
        // running fsync was waited for).
        self.syncing = None;
        self.persisted(self.last_ready);
        // A leader may have applied past raft's applied index (entries its
        // followers committed before its own fsync covered them; see
        // `Node::end_turn`). raft reads its unapplied entries from the
        // store (a campaign looks for conf changes among them), and the
        // store now begins after `applied`: raft's applied index catches
        // up, as it may now that every entry is durable here.
        if self.rn.raft.raft_log.applied < applied {
            self.rn.advance_apply_to(applied);
        }
        self.stats.snapshots_taken += 1;
        Ok(())
    }
}

//! Applying committed entries: each command to the state machine, its
//! effects to the leader's timers, its answers to this node's clients.

use raft::eraftpb::{Entry, EntryType};

use crate::cluster::command::{Command, Rid};
use crate::cluster::log::Disk;
use crate::cluster::state::{Answer, AnswerKind, Applied, Effect};
use crate::engine::{Caller, Outbox};
use crate::proto::Reply;
use crate::time::Millis;

#[cfg(any(test, feature = "testkit"))]
use super::{fnv, Traced};
use super::{lease_deadline, Node, Timer};

impl<D: Disk> Node<D> {
    /// Applies committed entries, in order, skipping those already applied
    /// (raft hands over again every entry after the snapshot).
    pub(super) fn apply_entries(&mut self, now: Millis, entries: &[Entry], out: &mut Outbox) {
        for e in entries {
            if e.index > self.applied {
                self.apply_one(now, e, out);
            }
        }
    }

    /// Applies entry `e`, the one after the last applied.
    pub(super) fn apply_one(&mut self, now: Millis, e: &Entry, out: &mut Outbox) {
        // raft hands committed entries over in order, after the
        // snapshot or the last one applied: a gap would skip a command.
        debug_assert_eq!(e.index, self.applied + 1, "applied entries have no gap");
        self.applied = e.index;
        #[cfg(any(test, feature = "testkit"))]
        if self.cfg.trace_applied {
            self.trace.push(Traced {
                index: e.index,
                term: e.term,
                hash: fnv(&e.data),
                snapshot: false,
                request: None,
            });
        }
        let lost_here = self.take_proposed_at(e.index);
        if e.entry_type == EntryType::EntryConfChangeV2 {
            self.apply_conf_change(e);
            self.mark_lost(lost_here, None);
            return;
        }
        if e.entry_type != EntryType::EntryNormal || e.data.is_empty() {
            self.mark_lost(lost_here, None);
            return;
        }
        let (cmd, token_bits, caller) = match Command::decode_entry(&e.data) {
            Ok(c) => c,
            Err(err) => {
                log::error!("entry {} does not decode ({err}); skipped", e.index);
                self.mark_lost(lost_here, None);
                return;
            }
        };
        self.mark_lost(lost_here, cmd.rid());
        let cmd = self.with_planted_bug(cmd);
        self.apply_command(now, e.index, (token_bits, caller), &cmd, out);
    }

    /// The proposal of ours a local leader placed at `index`, if any; the
    /// ones placed at earlier indices can no longer apply there and are
    /// forgotten.
    fn take_proposed_at(&mut self, index: u64) -> Option<(u64, u64)> {
        self.by_index.take_upto(index)
    }

    /// The simulation's planted bug: an `Expire` applies whatever its
    /// generation (`NodeConfig::bug_stale_expire`, never in production).
    fn with_planted_bug<'a>(&self, cmd: Command<'a>) -> Command<'a> {
        match cmd {
            Command::Expire { key, token, .. } if self.bug_stale_expire() => {
                let generation = self.sm.generation_of(&key, token).unwrap_or(0);
                Command::Expire {
                    key,
                    token,
                    generation,
                }
            }
            cmd => cmd,
        }
    }

    /// Applies one decoded command (with its entry's token bits and
    /// caller) to the state machine, then hands its effects to the
    /// leader's timers and its answers to this node's clients.
    fn apply_command(
        &mut self,
        now: Millis,
        index: u64,
        (token_bits, caller): (Option<u16>, Caller),
        cmd: &Command,
        out: &mut Outbox,
    ) {
        // The grant an Expire names (a mutex's or a permit's), while it
        // stands: if applying ends it, its hold is over.
        let expiring = match cmd {
            Command::Expire { key, token, .. } if self.sm.holds_grant(key, *token) => Some(*token),
            _ => None,
        };
        // The answers and effects go into buffers kept from entry to entry.
        let mut res = std::mem::take(&mut self.apply_out);
        self.sm
            .apply_entry_into(index, token_bits, caller, cmd, &mut res);
        if let Command::Expire { key, .. } = cmd {
            if let Some(t) = expiring.filter(|&t| !self.sm.holds_grant(key, t)) {
                self.hold_ended(now, t);
            }
        }
        #[cfg(any(test, feature = "testkit"))]
        if !res.duplicate {
            if let Some(t) = self.trace.last_mut().filter(|t| t.index == index) {
                t.request = cmd.rid();
            }
        }
        if let Some(rid) = cmd.rid().filter(|r| self.is_mine(*r)) {
            if res.duplicate {
                self.answer_duplicate(now, rid, cmd, out);
            } else {
                self.unapplied.remove(rid.seq);
            }
        }
        for eff in &res.effects {
            self.take_effect(now, cmd, *eff, &res);
        }
        for ans in &res.answers {
            self.deliver(now, ans, &res, out);
        }
        res.clear();
        self.apply_out = res;
    }

    /// True for a request id this node gave in this boot.
    fn is_mine(&self, rid: Rid) -> bool {
        rid.node == self.cfg.id && rid.epoch == self.epoch
    }

    /// One of our requests applied before (e.g. inside a snapshot we
    /// installed): nothing more will come for it. Were it answered, it
    /// would no longer be pending; an acquire whose grant is still current
    /// gets that grant as its answer. Any other answer went with the
    /// entries this node never applied (a release's R or N, an acquire's T
    /// or N, an extend's E or X): the connection is closed
    /// ([`Node::take_closes`]), so that its client learns at once that the
    /// outcome is unknown (Indeterminate) instead of waiting for a reply
    /// that never comes.
    fn answer_duplicate(&mut self, now: Millis, rid: Rid, cmd: &Command, out: &mut Outbox) {
        let Some(p) = self.pending.get(&rid.seq) else {
            return;
        };
        if p.queued {
            return;
        }
        if p.closed {
            // It took effect before; nobody waits for its answer.
            self.finish(rid.seq);
            return;
        }
        let granted = match cmd {
            Command::Acquire { key, owner, .. } | Command::AcquireWithLimit { key, owner, .. } => {
                self.sm
                    .granted_to(key, rid)
                    .map(|token| (&**key, *owner, token))
            }
            _ => None,
        };
        if let Some((key, owner, token)) = granted {
            self.wait_ms.observe(now.since(p.received_at));
            out.push(p.conn, Reply::Acquired { token, owner, key }, 0);
        } else {
            self.stats.unanswerable += 1;
            if !self.closes.contains(&p.conn) {
                self.closes.push(p.conn);
            }
        }
        self.finish(rid.seq);
    }

    /// A grant or a queued acquire: the leader's timer for it, the grant's
    /// start time, and our own queued acquire marked as such.
    fn take_effect(&mut self, now: Millis, cmd: &Command, eff: Effect, res: &Applied) {
        // Only a leader with its timers keeps the key.
        let key = |at| {
            if self.timers_ready {
                res.key(at).to_owned()
            } else {
                String::new()
            }
        };
        let (at, timer) = match eff {
            Effect::Queued {
                key: key_at,
                waiter,
                wait_s,
            } => {
                let timer = Timer::Wait {
                    key: key(key_at),
                    waiter,
                };
                if self.is_mine(waiter) {
                    self.mark_queued(waiter, cmd);
                }
                (now.add_secs(u64::from(wait_s)), timer)
            }
            Effect::Granted {
                key: key_at,
                token,
                lease_s,
            } => {
                let timer = Timer::Expire {
                    key: key(key_at),
                    token,
                    generation: 0,
                };
                self.holds.start(token, now);
                (lease_deadline(now, lease_s), timer)
            }
            // The leader's deadline for an extended grant is set when it
            // applies the Extend; the earlier generation's timer is now
            // stale and proposes nothing.
            Effect::Extended {
                key: key_at,
                token,
                generation,
                lease_s,
            } => {
                let timer = Timer::Expire {
                    key: key(key_at),
                    token,
                    generation,
                };
                (lease_deadline(now, lease_s), timer)
            }
        };
        if self.timers_ready {
            self.push_timer(at, timer);
        }
    }

    /// Our acquire `waiter` queued: it waits for a grant, not for its
    /// entry. If its connection closed before it applied, what it queued
    /// is cancelled.
    fn mark_queued(&mut self, waiter: Rid, cmd: &Command) {
        match self.pending.get_mut(&waiter.seq) {
            Some(p) => {
                // Never proposed again: its entry need not hold its buffer.
                p.queued = true;
                p.entry = bytes::Bytes::new();
            }
            None => {
                if let Command::Acquire { conn, .. } | Command::AcquireWithLimit { conn, .. } = cmd
                {
                    self.queue_cancel(waiter.origin(*conn));
                }
            }
        }
    }

    /// An answer of the state machine: the hold it ends is measured, and
    /// if it is for one of this node's open requests, it goes out. A grant
    /// to one of ours whose connection closed is released
    /// ([`Node::release_unseen`]).
    fn deliver(&mut self, now: Millis, ans: &Answer, res: &Applied, out: &mut Outbox) {
        if let AnswerKind::Released(t) = ans.kind {
            self.hold_ended(now, t);
        }
        if !self.is_mine(ans.rid) {
            return;
        }
        let Some(p) = self.pending.get(&ans.rid.seq) else {
            // Its connection closed: a grant goes back at once.
            if let AnswerKind::Acquired(token) = ans.kind {
                self.release_unseen(now, ans.conn, res.key(ans.key), token);
            }
            return;
        };
        if p.conn != ans.conn {
            return;
        }
        if p.closed {
            // A release or an extend that took effect; nobody to tell.
            self.finish(ans.rid.seq);
            return;
        }
        if matches!(ans.kind, AnswerKind::Acquired(_)) {
            self.wait_ms.observe(now.since(p.received_at));
        }
        out.push(ans.conn, res.reply(ans), 0);
        self.finish(ans.rid.seq);
    }
}

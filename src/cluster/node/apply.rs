//! Applying committed entries: each command to the state machine, its
//! effects to the leader's timers, its answers to this node's clients.

use raft::eraftpb::{Entry, EntryType};

use crate::cluster::command::{Command, Rid};
use crate::cluster::log::Disk;
use crate::cluster::state::{AnswerKind, Effect};
use crate::engine::Outbox;
use crate::proto::Reply;
use crate::time::Millis;

#[cfg(any(test, feature = "testkit"))]
use super::{fnv, Traced};
use super::{lease_deadline, Node, Timer};

impl<D: Disk> Node<D> {
    pub(super) fn apply_entries(&mut self, now: Millis, entries: &[Entry], out: &mut Outbox) {
        for e in entries {
            if e.index <= self.applied {
                continue;
            }
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
            let mut lost_here = None;
            if let Some((term, seq)) = self.by_index.remove(&e.index) {
                lost_here = Some((term, seq));
            }
            // Older indices can no longer apply with our proposal.
            while let Some((&i, _)) = self.by_index.first_key_value() {
                if i > e.index {
                    break;
                }
                self.by_index.pop_first();
            }
            if e.entry_type == EntryType::EntryConfChangeV2 {
                self.apply_conf_change(e);
                self.mark_lost(lost_here, None);
                continue;
            }
            if e.entry_type != EntryType::EntryNormal || e.data.is_empty() {
                self.mark_lost(lost_here, None);
                continue;
            }
            let (cmd, token_bits) = match Command::decode_entry(&e.data) {
                Ok(c) => c,
                Err(err) => {
                    log::error!("entry {} does not decode ({err}); skipped", e.index);
                    self.mark_lost(lost_here, None);
                    continue;
                }
            };
            self.mark_lost(lost_here, cmd.rid());
            let cmd = match cmd {
                // The deliberate bug: the generation is not looked at.
                Command::Expire { key, token, .. } if self.bug_stale_expire() => {
                    let generation = match self.sm.lease_of(&key) {
                        Some((t, g)) if t == token => g,
                        _ => 0,
                    };
                    Command::Expire {
                        key,
                        token,
                        generation,
                    }
                }
                cmd => cmd,
            };
            let expiring = match &cmd {
                Command::Expire { key, token, .. } if self.sm.holder(key) == Some(*token) => {
                    Some(*token)
                }
                _ => None,
            };
            let res = self.sm.apply_entry(e.index, token_bits, &cmd);
            if let Command::Expire { key, .. } = &cmd {
                if let Some(t) = expiring.filter(|&t| self.sm.holder(key) != Some(t)) {
                    self.hold_ended(now, t);
                }
            }
            if !res.duplicate {
                #[cfg(any(test, feature = "testkit"))]
                if let Some(t) = self.trace.last_mut().filter(|t| t.index == e.index) {
                    t.request = cmd.rid();
                }
            }
            let (my_id, my_epoch) = (self.cfg.id, self.epoch);
            let mine = move |r: Rid| r.node == my_id && r.epoch == my_epoch;
            if let Some(rid) = cmd.rid().filter(|r| mine(*r)) {
                if res.duplicate {
                    // Applied before (e.g. inside a snapshot we installed):
                    // nothing more will come for it. Were it answered here,
                    // it would no longer be pending; an acquire whose grant
                    // is still current gets that grant as its answer.
                    if let Some(p) = self.pending.get(&rid.seq) {
                        if !p.queued {
                            if let Command::Acquire { key, owner, .. } = &cmd {
                                if let Some(token) = self.sm.granted_to(key, rid) {
                                    self.wait_ms.observe(now.since(p.received_at));
                                    let reply = Reply::Acquired {
                                        token,
                                        owner: *owner,
                                        key,
                                    };
                                    out.push(p.conn, reply, 0);
                                }
                            }
                            self.finish(rid.seq);
                        }
                    }
                } else {
                    self.unapplied.remove(&rid.seq);
                }
            }
            for eff in res.effects {
                match eff {
                    Effect::Queued {
                        key,
                        waiter,
                        wait_s,
                    } => {
                        if mine(waiter) {
                            match self.pending.get_mut(&waiter.seq) {
                                Some(p) => p.queued = true,
                                None => {
                                    // Its connection closed before the acquire
                                    // applied: cancel what it queued.
                                    if let Command::Acquire { conn, .. } = &cmd {
                                        let o = waiter.origin(*conn);
                                        self.queue_cancel(o);
                                    }
                                }
                            }
                        }
                        if self.timers_ready {
                            self.push_timer(
                                now.add_secs(u64::from(wait_s)),
                                Timer::Wait { key, waiter },
                            );
                        }
                    }
                    Effect::Granted {
                        key,
                        token,
                        lease_s,
                    } => {
                        self.holds.start(token, now);
                        if self.timers_ready {
                            self.push_timer(
                                lease_deadline(now, lease_s),
                                Timer::Expire {
                                    key,
                                    token,
                                    generation: 0,
                                },
                            );
                        }
                    }
                    // The leader's deadline for an extended grant is set
                    // when it applies the Extend; the earlier generation's
                    // timer is now stale and proposes nothing.
                    Effect::Extended {
                        key,
                        token,
                        generation,
                        lease_s,
                    } => {
                        if self.timers_ready {
                            self.push_timer(
                                lease_deadline(now, lease_s),
                                Timer::Expire {
                                    key,
                                    token,
                                    generation,
                                },
                            );
                        }
                    }
                }
            }
            for ans in &res.answers {
                if let AnswerKind::Released(t) = ans.kind {
                    self.hold_ended(now, t);
                }
                if !mine(ans.rid) {
                    continue;
                }
                let Some(p) = self.pending.get(&ans.rid.seq) else {
                    continue; // its connection closed
                };
                if p.conn != ans.conn {
                    continue;
                }
                if matches!(ans.kind, AnswerKind::Acquired(_)) {
                    self.wait_ms.observe(now.since(p.received_at));
                }
                out.push(ans.conn, ans.reply(), 0);
                self.finish(ans.rid.seq);
            }
        }
    }
}

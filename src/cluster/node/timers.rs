//! Time: raft's ticks, and the leader's lease and wait timers.

use std::cmp::Reverse;

use crate::cluster::command::Command;
use crate::cluster::log::Disk;
use crate::engine::Outbox;
use crate::time::Millis;

use super::{Node, Timer, MAX_TIMERS_PER_TICK};

impl<D: Disk> Node<D> {
    /// Takes in a finished fsync (what waited for it goes out with the next
    /// [`Node::end_turn`]), advances raft's clock, fires due leader timers
    /// and re-proposes lost proposals.
    pub fn tick(&mut self, now: Millis, _out: &mut Outbox) {
        self.poll_sync();
        if self.failed.is_some() {
            return;
        }
        let mut n = 0;
        while now >= self.next_tick && n < 2 * self.cfg.election_tick {
            self.rn.tick();
            self.after_raft_call();
            self.next_tick = self.next_tick.add_ms(self.cfg.tick_ms);
            n += 1;
        }
        if now >= self.next_tick {
            self.next_tick = now.add_ms(self.cfg.tick_ms);
        }
        self.fire_timers(now);
        self.leave_joint_if_left_behind();
        // Re-proposal looks at every unapplied proposal: once per tick is
        // plenty (it waits two election timeouts anyway).
        if now >= self.next_repropose_check {
            self.next_repropose_check = now.add_ms(self.cfg.tick_ms);
            self.repropose(now);
        }
        while self.leader() != 0 {
            let Some(origin) = self.cancels.front().copied() else {
                break;
            };
            if !self.propose_data(None, &Command::CancelWaiters { origin }.encode()) {
                break;
            }
            self.cancels.pop_front();
        }
    }

    pub(super) fn push_timer(&mut self, at: Millis, t: Timer) {
        self.timer_seq += 1;
        self.timers.push(Reverse((at, self.timer_seq, t)));
    }

    fn fire_timers(&mut self, now: Millis) {
        if !self.is_leader() || !self.timers_ready {
            return;
        }
        let retry = self.repropose_ms();
        for _ in 0..MAX_TIMERS_PER_TICK {
            match self.timers.peek() {
                Some(Reverse((at, _, _))) if *at <= now => {}
                _ => break,
            }
            let Some(Reverse((_, _, timer))) = self.timers.pop() else {
                break;
            };
            let cmd = match &timer {
                Timer::Expire {
                    key,
                    token,
                    generation,
                } if self.sm.generation_of(key, *token) == Some(*generation)
                    || (self.bug_stale_expire() && self.sm.holds_grant(key, *token)) =>
                {
                    Command::Expire {
                        key: key.as_str().into(),
                        token: *token,
                        generation: *generation,
                    }
                }
                Timer::Wait { key, waiter } if self.sm.is_waiting(key, *waiter) => {
                    Command::WaitTimeout {
                        key: key.as_str().into(),
                        waiter: *waiter,
                    }
                }
                _ => continue, // stale: the grant or the wait already ended
            };
            if self.propose_data(None, &cmd.encode()) {
                self.stats.timer_proposals += 1;
                // Check again later: if this proposal is lost, propose again.
                self.push_timer(now.add_ms(retry), timer);
            } else {
                self.push_timer(now.add_ms(self.cfg.tick_ms), timer);
                break;
            }
        }
    }

    /// The next moment [`Node::tick`] has work.
    #[must_use]
    pub fn next_deadline(&self) -> Millis {
        if self.syncing.is_some() && !self.sync_wakes {
            // Nothing will say when this fsync is over: look again at once.
            return Millis::ZERO;
        }
        let mut d = self.next_tick;
        if self.is_leader()
            && self.cfg.leader_sync_ms > 0
            && self.syncing.is_none()
            && self.wal.sync_owed()
        {
            // A leader's deferred fsync is due then (see `Node::end_turn`).
            d = d.min(self.last_sync_began.add_ms(self.cfg.leader_sync_ms));
        }
        if self.is_leader() && self.timers_ready {
            if let Some(Reverse((at, _, _))) = self.timers.peek() {
                d = d.min(*at);
            }
        }
        d
    }

    pub(super) fn rebuild_timers(&mut self, now: Millis) {
        self.timers.clear();
        let mut list = Vec::new();
        // The latest lease of each grant (every permit of a key with a
        // limit too, each by its token), in full from now: late, never
        // early (PROTOCOL §2.4, §5.2).
        for (key, token, lease_s, generation) in self.sm.holders() {
            list.push((
                lease_deadline(now, lease_s),
                Timer::Expire {
                    key: key.to_owned(),
                    token,
                    generation,
                },
            ));
        }
        for (key, waiter, wait_s) in self.sm.waiters() {
            list.push((
                now.add_secs(u64::from(wait_s)),
                Timer::Wait {
                    key: key.to_owned(),
                    waiter,
                },
            ));
        }
        for (at, t) in list {
            self.push_timer(at, t);
        }
        self.timers_ready = true;
    }
}

/// When the leader proposes `Expire` for a grant of `lease_s` seconds it
/// applied at `applied_at`: one millisecond after `applied_at + lease`, since
/// the client's clock, truncated to whole milliseconds like ours, may have
/// read up to 1 ms later when it wrote the request (see the module docs).
#[must_use]
pub fn lease_deadline(applied_at: Millis, lease_s: u8) -> Millis {
    applied_at.add_secs(u64::from(lease_s)).add_ms(1)
}

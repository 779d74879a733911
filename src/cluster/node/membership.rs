//! Membership: the members as raft and the replicated state see them,
//! conf changes proposed by the leader and applied by every node, and a
//! removed leader stepping down.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use protobuf::Message as _;
use raft::eraftpb::{ConfChangeV2, ConfState, Entry, Message, MessageType};

use crate::cluster::log::Disk;
use crate::cluster::members::{self, Change, Members, Refusal, RefusalKind};

#[cfg(any(test, feature = "testkit"))]
use super::CONF_HISTORY;
use super::{Member, Node};

impl<D: Disk> Node<D> {
    /// The voters and learners, ordered by id; on the leader with each
    /// one's match index and whether it was heard from recently.
    #[must_use]
    pub fn members(&self) -> Vec<Member> {
        let cs = self.rn.raft.prs().conf().to_conf_state();
        let leader = self.is_leader();
        let mut out: Vec<Member> = cs
            .get_voters()
            .iter()
            .map(|&id| (id, false))
            .chain(cs.get_learners().iter().map(|&id| (id, true)))
            .map(|(id, learner)| {
                let pr = self.rn.raft.prs().get(id).filter(|_| leader);
                Member {
                    id,
                    learner,
                    matched: pr.map(|p| p.matched),
                    reachable: pr.map(|p| id == self.cfg.id || p.recent_active),
                }
            })
            .collect();
        out.sort_by_key(|m| (m.learner, m.id));
        out
    }

    /// Raised whenever the members or their addresses change: the
    /// transport then reconnects from [`Node::peer_addrs`].
    #[must_use]
    pub fn members_version(&self) -> u64 {
        self.members_version
    }

    /// The replicated members (addresses, removed ids).
    #[must_use]
    pub fn replicated_members(&self) -> &Members {
        self.sm.members()
    }

    /// The peer address of every voter and learner but this node, from
    /// the replicated state (empty before a joining node is added).
    #[must_use]
    pub fn peer_addrs(&self) -> BTreeMap<u64, SocketAddr> {
        let cs = self.rn.raft.prs().conf().to_conf_state();
        cs.voters
            .iter()
            .chain(cs.voters_outgoing.iter())
            .chain(cs.learners.iter())
            .chain(cs.learners_next.iter())
            .filter(|id| **id != self.cfg.id)
            .filter_map(|id| self.sm.members().addr(*id).map(|a| (*id, a)))
            .collect()
    }

    /// True once this node was removed from the cluster: it answers no
    /// request with a grant again.
    #[must_use]
    pub fn removed(&self) -> bool {
        self.sm.members().is_removed(self.cfg.id)
    }

    /// True while a conf change is proposed and not yet applied (leader),
    /// or the configuration is joint (until the change that leaves it
    /// applies).
    #[must_use]
    pub fn conf_change_pending(&self) -> bool {
        self.conf_change_in_flight() || !self.voters_outgoing().is_empty()
    }

    /// The outgoing voters while the configuration is joint (every change
    /// passes through one), empty otherwise.
    #[must_use]
    pub fn voters_outgoing(&self) -> Vec<u64> {
        self.rn.raft.prs().conf().to_conf_state().voters_outgoing
    }

    /// A leader that finds the configuration joint with nothing in flight
    /// (it was elected after the change that entered it applied, so raft
    /// will not leave it by itself) proposes the empty change that leaves
    /// it.
    pub(super) fn leave_joint_if_left_behind(&mut self) {
        if !self.is_leader()
            || self.conf_change_in_flight()
            || !self.rn.raft.apply_to_current_term()
            || !self.rn.raft.prs().conf().auto_leave()
        {
            return;
        }
        log::info!("node {}: leaving the joint configuration", self.cfg.id);
        let before = self.rn.raft.raft_log.last_index();
        if let Err(e) = self
            .rn
            .propose_conf_change(Vec::new(), ConfChangeV2::default())
        {
            log::warn!(
                "node {}: cannot leave the joint configuration: {e}",
                self.cfg.id
            );
            return;
        }
        self.conf_proposed_at = self.rn.raft.raft_log.last_index().max(before + 1);
        self.after_raft_call();
    }

    fn conf_change_in_flight(&self) -> bool {
        self.rn.raft.has_pending_conf() || self.conf_proposed_at > self.applied
    }

    /// Proposes one membership change (leaders only), after checking it
    /// ([`members::check_change`]); `reachable` are the peers heard from
    /// within an election timeout. Returns what was proposed.
    ///
    /// # Errors
    /// Why the change is refused: not the leader (naming the leader), a
    /// change in flight, an id removed before, ...
    pub fn change_members(
        &mut self,
        change: Change,
        reachable: &BTreeSet<u64>,
    ) -> Result<String, Refusal> {
        if self.failed.is_some() || self.removed() {
            return Err(Refusal {
                kind: RefusalKind::Unavailable,
                message: format!("node {} is stopped or removed", self.cfg.id),
            });
        }
        if !self.is_leader() {
            let message = match self.leader {
                0 => format!("node {} knows no leader now; try again", self.cfg.id),
                l => format!(
                    "node {} is not the leader; node {l} is (peer address {}): send the \
                     change to its admin port",
                    self.cfg.id,
                    self.sm
                        .members()
                        .addr(l)
                        .map_or_else(|| "unknown".to_owned(), |a| a.to_string())
                ),
            };
            let kind = if self.leader == 0 {
                RefusalKind::Unavailable
            } else {
                RefusalKind::NotLeader
            };
            return Err(Refusal { kind, message });
        }
        if !self.rn.raft.apply_to_current_term() {
            return Err(Refusal {
                kind: RefusalKind::Unavailable,
                message: "the leader was just elected and has not applied its first entry; \
                          try again"
                    .into(),
            });
        }
        let conf = self.rn.raft.prs().conf().to_conf_state();
        let mut reachable = reachable.clone();
        reachable.insert(self.cfg.id);
        let view = members::View {
            conf: &conf,
            pending: self.conf_change_pending(),
            reachable: &reachable,
            members: self.sm.members(),
        };
        let cc = members::check_change(change, &view)?;
        let before = self.rn.raft.raft_log.last_index();
        if let Err(e) = self.rn.propose_conf_change(Vec::new(), cc) {
            return Err(Refusal {
                kind: RefusalKind::Unavailable,
                message: format!("raft refused the change: {e}"),
            });
        }
        self.conf_proposed_at = self.rn.raft.raft_log.last_index().max(before + 1);
        self.after_raft_call();
        let what = match change {
            Change::AddLearner(id, addr) => format!("add learner {id} at {addr}"),
            Change::Promote(id) => format!("promote {id} to voter"),
            Change::Remove(id, _) => format!("remove {id}"),
        };
        log::info!("node {}: proposed: {what}", self.cfg.id);
        Ok(what)
    }

    /// Applies a committed conf change: raft's configuration (persisted
    /// with this Ready), then the replicated members. A leader that removed
    /// itself steps down after the turn.
    pub(super) fn apply_conf_change(&mut self, e: &Entry) {
        let mut cc = ConfChangeV2::default();
        if let Err(err) = cc.merge_from_bytes(&e.data) {
            log::error!(
                "conf change at {} does not decode ({err}); skipped",
                e.index
            );
            return;
        }
        match self.rn.apply_conf_change(&cc) {
            Ok(cs) => {
                log::info!(
                    "node {}: configuration at {}: voters {:?}, learners {:?}{}",
                    self.cfg.id,
                    e.index,
                    cs.voters,
                    cs.learners,
                    if cs.voters_outgoing.is_empty() {
                        String::new()
                    } else {
                        format!(" (joint, outgoing voters {:?})", cs.voters_outgoing)
                    }
                );
                #[cfg(any(test, feature = "testkit"))]
                {
                    if self.conf_history.len() >= CONF_HISTORY {
                        self.conf_history.pop_front();
                    }
                    self.conf_history.push_back(cs.clone());
                }
                self.wal.stage_conf_state(&cs);
                self.rn.mut_store().set_conf_state(cs);
            }
            Err(err) => {
                // A restarted node replays the entries after its last
                // snapshot on the configuration its WAL recorded last, so
                // raft may refuse one it already applied (e.g. a second
                // leave). The members apply it all the same: their change
                // is idempotent and must not depend on when a node last
                // restarted.
                log::warn!("conf change at {} refused by raft: {err}", e.index);
            }
        }
        self.sm.members_mut().apply(&cc);
        debug_assert!(
            self.conf_agrees_with_members(),
            "no voter or learner of the applied configuration is a removed id, none is both"
        );
        self.members_version += 1;
        self.snapshot_now = true;
        if members::removed_ids(&cc).contains(&self.cfg.id) {
            log::warn!(
                "node {}: removed from the cluster at index {}; it grants nothing from now on",
                self.cfg.id,
                e.index
            );
        }
        // A leader that removed itself leads on through the joint
        // configuration (it is an outgoing voter) and steps down once the
        // change that leaves it applies.
        let voter = self.rn.raft.prs().conf().voters().contains(self.cfg.id);
        if self.removed() && !voter && self.is_leader() {
            self.step_down();
        }
    }

    /// The configuration raft applied and the replicated members agree: an
    /// incoming voter or learner is never a removed id (ids are never
    /// reused), and no id is both a voter and a learner.
    pub(super) fn conf_agrees_with_members(&self) -> bool {
        let cs = self.rn.raft.prs().conf().to_conf_state();
        let members = self.sm.members();
        cs.voters.iter().all(|id| !cs.learners.contains(id))
            && cs
                .voters
                .iter()
                .chain(cs.learners.iter())
                .all(|id| !members.is_removed(*id))
    }

    /// A leader that applied its own removal steps down at once (raft-rs
    /// would keep leading, and trip over its missing progress when its
    /// own entries persist), and tells the most up-to-date voter to
    /// campaign now (`MsgTimeoutNow`, as a leadership transfer does) rather
    /// than after an election timeout. No raft step is taken: this runs
    /// between a Ready and its advance.
    fn step_down(&mut self) {
        let me = self.cfg.id;
        let voters = self.rn.raft.prs().conf().to_conf_state().voters;
        let best = self
            .rn
            .raft
            .prs()
            .iter()
            .filter(|(id, _)| **id != me && voters.contains(id))
            .max_by_key(|(id, pr)| (pr.matched, Reverse(**id)))
            .map(|(id, _)| *id);
        let term = self.rn.raft.term;
        if let Some(to) = best {
            log::info!("node {me}: removed; node {to} is asked to campaign now");
            let mut m = Message::default();
            m.set_msg_type(MessageType::MsgTimeoutNow);
            m.to = to;
            m.from = me;
            m.term = term;
            self.msgs.push(m);
        }
        self.rn.raft.become_follower(term, 0);
    }
}

/// Records the `--peers` address of each member whose address the
/// replicated state lacks (a first static start, or state written before
/// addresses were replicated), and logs each flag that disagrees with the
/// recorded address (the recorded one wins).
pub(super) fn fill_addrs(
    me: u64,
    members: &mut Members,
    cs: &ConfState,
    flags: &BTreeMap<u64, SocketAddr>,
) {
    for id in cs.voters.iter().chain(cs.learners.iter()) {
        if let Some(a) = flags.get(id) {
            members.fill_addr(*id, *a);
        }
    }
    for (id, a) in flags {
        match members.addr(*id) {
            Some(stored) if stored != *a => log::warn!(
                "node {me}: --peers gives node {id} the address {a}, the replicated \
                 configuration {stored}: the replicated one is used"
            ),
            _ => {}
        }
    }
}

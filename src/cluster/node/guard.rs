//! Peer messages checked before raft steps them.
//!
//! raft-rs trusts its peers: some messages no correct peer sends make it
//! panic. A heartbeat whose commit is past the end of this node's log
//! (`commit_to`: "to_commit ... is out of range"); an append whose entries
//! do not follow its previous index one by one (a slice out of range, a
//! conflict below the commit index); an append whose previous index is past
//! the log with term 0 (raft reads the term of an index past its log as 0,
//! so it would take the entries after a hole); a snapshot whose
//! configuration raft cannot restore; a proposal without entries; a
//! message without a term, which raft takes for one of its own. [`check`]
//! refuses each of them, and what raft would trust in an acknowledgement
//! (an index or commit past this leader's log). The node drops a refused
//! message, counts it (`ticketd_raft_messages_refused_total`) and logs it,
//! rate-limited, instead of stepping it; a snapshot's data must also decode
//! into a table ([`Node::admit`]), or installing it would stop the node.
//!
//! Every rule is an invariant of the messages raft itself sends, so a
//! correct peer's messages always pass. Content is checked only where raft
//! reads it: an append, heartbeat or snapshot of a term below this node's
//! is answered without being read, and acknowledgements are read by the
//! leader of their term only. The checks compare a few integers (one pair
//! per entry of an append), on the replication path; only a snapshot costs
//! more, and snapshots are rare.

use raft::eraftpb::{ConfChangeSingle, ConfChangeType, ConfState, Message, MessageType};
use raft::{Changer, ProgressTracker, Raft, StateRole, Storage};

use crate::cluster::log::Disk;
use crate::cluster::members::MAX_MEMBERS;
use crate::cluster::state::StateMachine;

use super::Node;

/// Terms from here on are refused: raft adds 1 to a term unchecked, and no
/// cluster holds 2^62 elections.
pub(super) const MAX_TERM: u64 = 1 << 62;

/// Why raft must not see `m`, if it must not.
pub(super) fn check<S: Storage>(r: &Raft<S>, m: &Message) -> Result<(), &'static str> {
    use MessageType as T;
    match m.msg_type {
        // Forwarded to the leader without a term (raft's own `send`).
        T::MsgPropose | T::MsgReadIndex if m.term != 0 => {
            return Err("a forwarded request with a term");
        }
        T::MsgPropose | T::MsgReadIndex => {}
        _ if m.term == 0 => return Err("no term: raft would take it for its own"),
        _ if m.term >= MAX_TERM => return Err("a term past 2^62"),
        _ => {}
    }
    let last = r.raft_log.last_index();
    // raft reads these only at its own term or above (and an older one
    // only gets an answer).
    let read = m.term >= r.term;
    // Acknowledgements count only at the leader of their term, whose log
    // holds everything any node of that term can acknowledge.
    let leads = r.state == StateRole::Leader && m.term == r.term;
    match m.msg_type {
        T::MsgPropose if m.entries.is_empty() => Err("a proposal without entries"),
        T::MsgReadIndex if m.entries.len() != 1 => Err("a read request without exactly one entry"),
        T::MsgAppend if read => check_append(m, last),
        T::MsgHeartbeat if read && m.commit > last => {
            Err("a heartbeat committing past the end of this node's log")
        }
        T::MsgSnapshot if read => check_snapshot(m),
        T::MsgAppendResponse | T::MsgHeartbeatResponse if leads => check_ack(m, last),
        _ => Ok(()),
    }
}

/// An append's previous entry and entries: what a leader's log can hold.
fn check_append(m: &Message, last: u64) -> Result<(), &'static str> {
    if m.log_term > m.term {
        return Err("an append whose previous entry's term is past its own");
    }
    if m.index > last && m.log_term == 0 {
        return Err("an append past the end of this node's log with previous term 0");
    }
    let (mut index, mut term) = (m.index, m.log_term);
    for e in &m.entries {
        if index.checked_add(1) != Some(e.index) {
            return Err("an append whose entries do not follow its previous index one by one");
        }
        if e.term < term || e.term > m.term {
            return Err("an append whose entry terms go down or past its own term");
        }
        (index, term) = (e.index, e.term);
    }
    Ok(())
}

/// An acknowledgement, at its leader: nothing past the leader's log.
fn check_ack(m: &Message, last: u64) -> Result<(), &'static str> {
    if m.commit > last {
        return Err("an acknowledgement of a commit past the end of this leader's log");
    }
    if m.msg_type == MessageType::MsgAppendResponse {
        if m.index > last {
            return Err("an append acknowledged past the end of this leader's log");
        }
        if m.reject && m.reject_hint > m.index {
            return Err("an append rejection hinting past the rejected index");
        }
    }
    Ok(())
}

/// A snapshot's metadata: an index and term a leader's log can have, and a
/// configuration raft can restore.
fn check_snapshot(m: &Message) -> Result<(), &'static str> {
    if !m.has_snapshot() {
        return Err("a snapshot message without a snapshot");
    }
    let meta = m.get_snapshot().get_metadata();
    if meta.index == 0 || meta.term == 0 || meta.term > m.term {
        return Err("a snapshot at index or term 0, or of a term past its message's");
    }
    if !restores(meta.get_conf_state()) {
        return Err("a snapshot whose configuration raft cannot restore");
    }
    Ok(())
}

/// Whether raft restores `cs` without a panic: the changes raft makes to
/// restore a configuration succeed on a scratch tracker, and lead to the
/// same configuration (the same ids, none twice).
pub(super) fn restores(cs: &ConfState) -> bool {
    let lists = [
        &cs.voters,
        &cs.learners,
        &cs.voters_outgoing,
        &cs.learners_next,
    ];
    if lists.iter().map(|l| l.len()).sum::<usize>() > 4 * MAX_MEMBERS {
        return false;
    }
    let change = |ids: &[u64], kind: ConfChangeType| -> Vec<ConfChangeSingle> {
        ids.iter()
            .map(|&node_id| {
                let mut c = ConfChangeSingle {
                    node_id,
                    ..Default::default()
                };
                c.set_change_type(kind);
                c
            })
            .collect()
    };
    let mut incoming = change(&cs.voters_outgoing, ConfChangeType::RemoveNode);
    incoming.extend(change(&cs.voters, ConfChangeType::AddNode));
    incoming.extend(change(&cs.learners, ConfChangeType::AddLearnerNode));
    incoming.extend(change(&cs.learners_next, ConfChangeType::AddLearnerNode));
    let mut t = ProgressTracker::new(1);
    let simple = if cs.voters_outgoing.is_empty() {
        incoming.clone()
    } else {
        change(&cs.voters_outgoing, ConfChangeType::AddNode)
    };
    for c in simple {
        let Ok((conf, changes)) = Changer::new(&t).simple(&[c]) else {
            return false;
        };
        t.apply_conf(conf, changes, 1);
    }
    if !cs.voters_outgoing.is_empty() {
        let Ok((conf, changes)) = Changer::new(&t).enter_joint(cs.auto_leave, &incoming) else {
            return false;
        };
        t.apply_conf(conf, changes, 1);
    }
    let got = t.conf().to_conf_state();
    same_ids(&got.voters, &cs.voters)
        && same_ids(&got.learners, &cs.learners)
        && same_ids(&got.voters_outgoing, &cs.voters_outgoing)
        && same_ids(&got.learners_next, &cs.learners_next)
        && got.auto_leave == cs.auto_leave
}

/// The same ids, each once in `want` (`got` is a set).
fn same_ids(got: &[u64], want: &[u64]) -> bool {
    let mut a = got.to_vec();
    let mut b = want.to_vec();
    a.sort_unstable();
    b.sort_unstable();
    a == b
}

impl<D: Disk> Node<D> {
    /// Whether `m` may reach raft ([`check`]); a snapshot's data must also
    /// decode into a table, which is kept for the install when raft takes
    /// the snapshot.
    pub(super) fn admit(&mut self, m: &Message) -> Result<(), String> {
        check(&self.rn.raft, m).map_err(str::to_owned)?;
        if m.msg_type != MessageType::MsgSnapshot || m.term < self.rn.raft.term {
            return Ok(());
        }
        let snap = m.get_snapshot();
        let meta = snap.get_metadata();
        let log = &self.rn.raft.raft_log;
        // Below the commit index raft ignores it; on the log's own entry
        // it only commits up to it. Neither reads the data.
        if meta.index < log.committed || log.match_term(meta.index, meta.term) {
            return Ok(());
        }
        let sm = StateMachine::restore(self.cfg.limits.clone(), &snap.data)
            .map_err(|e| format!("a snapshot whose table does not decode: {e}"))?;
        self.checked_snapshot = Some((meta.index, meta.term, sm));
        Ok(())
    }

    /// After raft stepped a message: a checked snapshot raft did not take
    /// is let go.
    pub(super) fn after_admitted(&mut self) {
        if let Some((index, term, _)) = &self.checked_snapshot {
            let taken = self
                .rn
                .raft
                .raft_log
                .unstable_snapshot()
                .as_ref()
                .is_some_and(|s| {
                    let meta = s.get_metadata();
                    meta.index == *index && meta.term == *term
                });
            if !taken {
                self.checked_snapshot = None;
            }
        }
    }

    /// The table a snapshot at (`index`, `term`) decoded to when it was
    /// admitted, if it is that snapshot.
    pub(super) fn take_checked_snapshot(&mut self, index: u64, term: u64) -> Option<StateMachine> {
        match self.checked_snapshot.take() {
            Some((i, t, sm)) if (i, t) == (index, term) => Some(sm),
            _ => None,
        }
    }

    /// Drops a message [`Node::admit`] refused: counted, and logged (at
    /// most 5 lines per 10 s of the node's clock, each with the count).
    pub(super) fn refuse_message(&mut self, m: &Message, why: &str) {
        self.stats.refused_messages += 1;
        if let Some(more) = self.refusal_log.allow(self.next_tick) {
            log::warn!(
                "node {}: dropped {:?} from {} at term {}: {why} ({} refused so far{})",
                self.cfg.id,
                m.msg_type,
                m.from,
                m.term,
                self.stats.refused_messages,
                if more > 0 {
                    format!(", {more} not logged")
                } else {
                    String::new()
                }
            );
        }
    }
}

//! Cluster membership as replicated state: every member's peer address and
//! the ids removed from the cluster.
//!
//! Raft's own `ConfState` (voters and learners) is kept by raft-rs, in the
//! write-ahead log and in every snapshot's metadata. [`Members`] adds what
//! raft does not know: the peer address of each node, and the ids that were
//! removed, which are never accepted again. It changes only when a
//! conf-change entry applies ([`Members::apply`]): an added learner's
//! address travels in the `ConfChangeV2`'s `context`. It is part of the
//! state machine's snapshot, so a node that joins (or restarts) learns
//! every peer's address from the log or a snapshot.
//!
//! The admin requests that propose conf changes are checked here too
//! ([`check_change`]), so that the rules (one change at a time, ids never
//! reused, no removal that leaves too few voters reachable) are in one
//! place and testable without a cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use raft::eraftpb::{
    ConfChangeSingle, ConfChangeTransition, ConfChangeType, ConfChangeV2, ConfState,
};

use crate::cluster::command::{DecodeError, ReadFields, Writer};
use crate::codec::ByteReader;

/// The most members (voters and learners) a cluster may have.
pub const MAX_MEMBERS: usize = 64;
/// The most removed ids recorded (each is 8 bytes in a snapshot).
pub const MAX_REMOVED: usize = 65_536;
/// The longest address text accepted.
const MAX_ADDR_BYTES: usize = 256;

/// Peer addresses and removed ids. See the module documentation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Members {
    addrs: BTreeMap<u64, SocketAddr>,
    removed: BTreeSet<u64>,
}

/// A membership change an operator asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Add a new node as a learner, with its peer address.
    AddLearner(u64, SocketAddr),
    /// Make a learner a voter.
    Promote(u64),
    /// Remove a voter or learner; `force` skips the reachability check.
    Remove(u64, bool),
}

pub use crate::service::{Refusal, RefusalKind};

fn refuse(kind: RefusalKind, message: String) -> Refusal {
    Refusal { kind, message }
}

/// What the leader knows when it checks a change.
#[derive(Clone, Debug)]
pub struct View<'a> {
    /// The current configuration.
    pub conf: &'a ConfState,
    /// A conf change is proposed and not yet applied.
    pub pending: bool,
    /// Ids heard from within an election timeout (the leader included).
    pub reachable: &'a BTreeSet<u64>,
    /// The replicated members.
    pub members: &'a Members,
}

/// Checks `change` against the leader's `view`, and returns the
/// `ConfChangeV2` to propose.
///
/// # Errors
/// The refusal, with the reason.
pub fn check_change(change: Change, view: &View<'_>) -> Result<ConfChangeV2, Refusal> {
    if view.pending {
        return Err(refuse(
            RefusalKind::Conflict,
            "a membership change is already in progress; wait until it has applied \
             (ticket cluster status) and try again"
                .into(),
        ));
    }
    if !view.conf.voters_outgoing.is_empty() {
        return Err(refuse(
            RefusalKind::Conflict,
            "the cluster is between two configurations (joint consensus); wait until it \
             has left it"
                .into(),
        ));
    }
    let mut single = ConfChangeSingle::default();
    let mut cc = ConfChangeV2::default();
    match change {
        Change::AddLearner(id, addr) => {
            check_add(id, addr, view)?;
            single.set_change_type(ConfChangeType::AddLearnerNode);
            single.node_id = id;
            cc.context = addr.to_string().into_bytes().into();
        }
        Change::Promote(id) => {
            check_promote(id, view)?;
            single.set_change_type(ConfChangeType::AddNode);
            single.node_id = id;
        }
        Change::Remove(id, force) => {
            check_remove(id, force, view)?;
            single.set_change_type(ConfChangeType::RemoveNode);
            single.node_id = id;
        }
    }
    cc.changes.push(single);
    // Every change goes through joint consensus: raft enters the joint
    // configuration (old and new voters must both agree) when this entry
    // applies, and the leader proposes the empty change that leaves it.
    cc.set_transition(ConfChangeTransition::Implicit);
    Ok(cc)
}

fn is_voter(view: &View<'_>, id: u64) -> bool {
    view.conf.voters.contains(&id)
}

fn is_learner(view: &View<'_>, id: u64) -> bool {
    view.conf.learners.contains(&id)
}

/// A new learner `id` at `addr`: a fresh id, a free address, room left.
fn check_add(id: u64, addr: SocketAddr, view: &View<'_>) -> Result<(), Refusal> {
    if id == 0 {
        return Err(refuse(RefusalKind::Invalid, "node ids start at 1".into()));
    }
    if view.members.is_removed(id) {
        return Err(refuse(
            RefusalKind::Conflict,
            format!(
                "node {id} was removed from this cluster, and ids are never reused; \
                 give the new node another id"
            ),
        ));
    }
    if is_voter(view, id) || is_learner(view, id) {
        return Err(refuse(
            RefusalKind::Conflict,
            format!("node {id} is already a member (ticket cluster status)"),
        ));
    }
    if view.conf.voters.len() + view.conf.learners.len() >= MAX_MEMBERS {
        return Err(refuse(
            RefusalKind::Conflict,
            format!("the cluster has {MAX_MEMBERS} members already"),
        ));
    }
    if let Some((other, _)) = view.members.addrs.iter().find(|(_, a)| **a == addr) {
        return Err(refuse(
            RefusalKind::Conflict,
            format!("address {addr} is node {other}'s peer address"),
        ));
    }
    Ok(())
}

/// Promoting `id`: a learner, not yet a voter.
fn check_promote(id: u64, view: &View<'_>) -> Result<(), Refusal> {
    if is_voter(view, id) {
        return Err(refuse(
            RefusalKind::Conflict,
            format!("node {id} is a voter already"),
        ));
    }
    if !is_learner(view, id) {
        return Err(refuse(
            RefusalKind::Conflict,
            format!("node {id} is not a learner of this cluster (add it first)"),
        ));
    }
    Ok(())
}

/// Removing `id`: a member, never the only voter, and (unless `force`)
/// leaving a reachable majority of the current voters.
fn check_remove(id: u64, force: bool, view: &View<'_>) -> Result<(), Refusal> {
    if is_learner(view, id) {
        // A learner has no vote: removing it never costs a quorum.
    } else if is_voter(view, id) {
        if view.conf.voters.len() == 1 {
            return Err(refuse(
                RefusalKind::Conflict,
                format!("node {id} is the only voter; a cluster needs one"),
            ));
        }
        let majority = view.conf.voters.len() / 2 + 1;
        let left = view
            .conf
            .voters
            .iter()
            .filter(|v| **v != id && view.reachable.contains(v))
            .count();
        if left < majority && !force {
            return Err(refuse(
                RefusalKind::Conflict,
                format!(
                    "removing node {id} would leave {left} reachable voter(s), fewer \
                     than a majority ({majority}) of the {} current voters; bring \
                     the others back first, or use --force",
                    view.conf.voters.len()
                ),
            ));
        }
    } else {
        return Err(refuse(
            RefusalKind::Conflict,
            format!("node {id} is not a member of this cluster"),
        ));
    }
    Ok(())
}

impl Members {
    /// Members with these addresses (a static cluster's first start).
    #[must_use]
    pub fn from_peers(peers: &BTreeMap<u64, SocketAddr>) -> Self {
        Members {
            addrs: peers.clone(),
            removed: BTreeSet::new(),
        }
    }

    /// The peer address recorded for `id`.
    #[must_use]
    pub fn addr(&self, id: u64) -> Option<SocketAddr> {
        self.addrs.get(&id).copied()
    }

    /// Every recorded address, by id.
    #[must_use]
    pub fn addrs(&self) -> &BTreeMap<u64, SocketAddr> {
        &self.addrs
    }

    /// True when `id` was removed from the cluster.
    #[must_use]
    pub fn is_removed(&self, id: u64) -> bool {
        self.removed.contains(&id)
    }

    /// The removed ids.
    #[must_use]
    pub fn removed(&self) -> &BTreeSet<u64> {
        &self.removed
    }

    /// True when nothing is recorded (a snapshot of an older version).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.addrs.is_empty() && self.removed.is_empty()
    }

    /// Records the address of a member that has none (from `--peers`, for
    /// state written before addresses were replicated). Returns whether it
    /// was missing.
    pub fn fill_addr(&mut self, id: u64, addr: SocketAddr) -> bool {
        if self.removed.contains(&id) || self.addrs.contains_key(&id) {
            return false;
        }
        self.addrs.insert(id, addr);
        true
    }

    /// Applies a committed conf change: an added learner's address (from
    /// the context) is recorded, a removed node's id is remembered. A
    /// removed node stays an outgoing voter of the joint configuration, so
    /// its address is forgotten only when the change that leaves the joint
    /// configuration applies. Deterministic: reads only the entry.
    pub fn apply(&mut self, cc: &ConfChangeV2) {
        if cc.leave_joint() {
            let removed = &self.removed;
            self.addrs.retain(|id, _| !removed.contains(id));
            return;
        }
        for c in &cc.changes {
            match c.get_change_type() {
                ConfChangeType::AddLearnerNode | ConfChangeType::AddNode => {
                    if let Some(addr) = parse_addr(&cc.context) {
                        self.addrs.insert(c.node_id, addr);
                    }
                }
                ConfChangeType::RemoveNode => {
                    if self.removed.len() < MAX_REMOVED {
                        self.removed.insert(c.node_id);
                    } else {
                        self.addrs.remove(&c.node_id);
                    }
                }
            }
        }
    }

    /// Appends the canonical encoding to a snapshot.
    pub(crate) fn encode(&self, w: &mut Writer) {
        w.u32(self.addrs.len() as u32);
        for (id, addr) in &self.addrs {
            w.u64(*id);
            w.key(&addr.to_string());
        }
        w.u32(self.removed.len() as u32);
        for id in &self.removed {
            w.u64(*id);
        }
    }

    /// Reads what [`Members::encode`] wrote.
    pub(crate) fn decode(r: &mut ByteReader<'_>) -> Result<Self, DecodeError> {
        let mut m = Members::default();
        let n = r.count(8 + 4 + 1)?;
        if n > MAX_MEMBERS * 2 {
            return Err(DecodeError::Invalid("member count"));
        }
        for _ in 0..n {
            let id = r.u64()?;
            let text = r.key_str()?.to_owned();
            let addr = parse_addr(text.as_bytes()).ok_or(DecodeError::Invalid("address"))?;
            if m.addrs.insert(id, addr).is_some() {
                return Err(DecodeError::Invalid("duplicate member"));
            }
        }
        let n = r.count(8)?;
        if n > MAX_REMOVED {
            return Err(DecodeError::Invalid("removed count"));
        }
        for _ in 0..n {
            m.removed.insert(r.u64()?);
        }
        Ok(m)
    }
}

/// A peer address as the context of a conf change carries it.
#[must_use]
pub fn parse_addr(bytes: &[u8]) -> Option<SocketAddr> {
    if bytes.len() > MAX_ADDR_BYTES {
        return None;
    }
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

/// The ids a conf change removes.
#[must_use]
pub fn removed_ids(cc: &ConfChangeV2) -> Vec<u64> {
    cc.changes
        .iter()
        .filter(|c| c.get_change_type() == ConfChangeType::RemoveNode)
        .map(|c| c.node_id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(voters: &[u64], learners: &[u64]) -> ConfState {
        ConfState {
            voters: voters.to_vec(),
            learners: learners.to_vec(),
            ..ConfState::default()
        }
    }

    fn addr(p: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], p))
    }

    #[test]
    fn changes_are_checked_and_ids_never_reused() {
        let mut m = Members::from_peers(&[(1, addr(1)), (2, addr(2)), (3, addr(3))].into());
        let cs = conf(&[1, 2, 3], &[]);
        let all: BTreeSet<u64> = [1, 2, 3].into();
        fn view<'a>(
            cs: &'a ConfState,
            pending: bool,
            reachable: &'a BTreeSet<u64>,
            members: &'a Members,
        ) -> View<'a> {
            View {
                conf: cs,
                pending,
                reachable,
                members,
            }
        }
        let cc = check_change(Change::AddLearner(4, addr(4)), &view(&cs, false, &all, &m)).unwrap();
        assert_eq!(parse_addr(&cc.context), Some(addr(4)));
        // Through a joint configuration that raft leaves by itself.
        assert_eq!(cc.enter_joint(), Some(true), "{cc:?}");
        assert!(!cc.leave_joint());
        let e =
            check_change(Change::AddLearner(4, addr(4)), &view(&cs, true, &all, &m)).unwrap_err();
        assert_eq!(e.kind, RefusalKind::Conflict);
        assert!(e.message.contains("already in progress"), "{e}");
        let e =
            check_change(Change::AddLearner(2, addr(9)), &view(&cs, false, &all, &m)).unwrap_err();
        assert!(e.message.contains("already a member"), "{e}");
        let e =
            check_change(Change::AddLearner(5, addr(2)), &view(&cs, false, &all, &m)).unwrap_err();
        assert!(e.message.contains("node 2's peer address"), "{e}");
        let e = check_change(Change::Promote(3), &view(&cs, false, &all, &m)).unwrap_err();
        assert!(e.message.contains("voter already"), "{e}");
        // Two of three reachable: removing a reachable one leaves one.
        let two: BTreeSet<u64> = [1, 2].into();
        let e = check_change(Change::Remove(2, false), &view(&cs, false, &two, &m)).unwrap_err();
        assert!(e.message.contains("--force"), "{e}");
        assert!(check_change(Change::Remove(2, true), &view(&cs, false, &two, &m)).is_ok());
        assert!(check_change(Change::Remove(3, false), &view(&cs, false, &two, &m)).is_ok());
        // Once removed, an id is refused for ever.
        let cc = check_change(Change::Remove(3, false), &view(&cs, false, &all, &m)).unwrap();
        assert_eq!(cc.enter_joint(), Some(true), "{cc:?}");
        m.apply(&cc);
        // An outgoing voter while joint: its address is still needed.
        assert!(m.is_removed(3) && m.addr(3) == Some(addr(3)));
        let joint = ConfState {
            voters_outgoing: vec![1, 2, 3],
            auto_leave: true,
            ..conf(&[1, 2], &[])
        };
        let e = check_change(Change::Promote(4), &view(&joint, false, &all, &m)).unwrap_err();
        assert!(e.message.contains("joint consensus"), "{e}");
        m.apply(&ConfChangeV2::default());
        assert!(m.is_removed(3) && m.addr(3).is_none());
        assert_eq!(m.addr(1), Some(addr(1)));
        let e =
            check_change(Change::AddLearner(3, addr(3)), &view(&cs, false, &all, &m)).unwrap_err();
        assert!(e.message.contains("never reused"), "{e}");
    }

    #[test]
    fn the_encoding_round_trips_and_bad_bytes_are_errors() {
        let mut m = Members::from_peers(&[(1, addr(1)), (7, "[::1]:9".parse().unwrap())].into());
        m.removed.insert(3);
        let mut w = Writer::default();
        m.encode(&mut w);
        let bytes = w.buf;
        let mut r = ByteReader::new(&bytes);
        assert_eq!(Members::decode(&mut r).unwrap(), m);
        r.finish().unwrap();
        for cut in 0..bytes.len() {
            let mut r = ByteReader::new(&bytes[..cut]);
            assert!(Members::decode(&mut r).is_err(), "cut at {cut}");
        }
        assert_eq!(parse_addr(b"not an address"), None);
    }
}

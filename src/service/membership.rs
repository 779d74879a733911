//! [`Membership`]: cluster mode's membership changes, asked for on the
//! admin port, and why one is refused. The admin port alone turns the
//! outcome into an HTTP answer.

use std::fmt;

use crate::time::Millis;

/// A membership change as the admin port parses it (see
/// `docs/OPERATIONS.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberChange {
    /// `POST /v1/cluster/members/ID?address=HOST:PORT`: add a learner.
    Add {
        /// The new node's id.
        id: u64,
        /// Its peer address.
        address: std::net::SocketAddr,
    },
    /// `POST /v1/cluster/members/ID/promote`: make a learner a voter.
    Promote {
        /// The learner's id.
        id: u64,
    },
    /// `DELETE /v1/cluster/members/ID[?force=true]`: remove a member.
    Remove {
        /// The member's id.
        id: u64,
        /// Skip the check that a majority of the voters stays reachable.
        force: bool,
    },
}

/// What kind of refusal a membership change met: the admin port answers
/// each with its own HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusalKind {
    /// The change itself is malformed (a node id of 0).
    Invalid,
    /// The change conflicts with the cluster's state: a change in
    /// flight, an id or address in use, a quorum it would cost.
    Conflict,
    /// This node is not the leader, and another is known (the message
    /// names it).
    NotLeader,
    /// No change can be made here now: no leader known, a leader not yet
    /// caught up, a node stopped or removed.
    Unavailable,
}

/// Why a membership change is refused: its kind and a message for the
/// operator, saying what to do about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The kind of refusal.
    pub kind: RefusalKind,
    /// What to do about it.
    pub message: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Refusal {}

/// Where membership changes go (cluster mode); reached through
/// [`super::Service::membership`].
pub trait Membership {
    /// Proposes `change`, asked for at `now` on the admin port
    /// (`POST`/`DELETE /v1/cluster/members/...`).
    ///
    /// # Errors
    /// Why the change is refused.
    fn member_change(&mut self, now: Millis, change: MemberChange) -> Result<String, Refusal>;
}

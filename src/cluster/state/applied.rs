//! What applying one entry produces: answers for the requests' origins
//! and effects for the leader's timers.

use crate::cluster::command::Rid;
use crate::proto::Reply;

/// The kind of an answer to a client request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerKind {
    /// Acquired, with the token.
    Acquired(u64),
    /// Timeout.
    Timeout,
    /// Busy.
    Busy,
    /// Released, with the token.
    Released(u64),
    /// NotReleased, with the token.
    NotReleased(u64),
    /// Extended, with the token.
    Extended(u64),
    /// NotExtended, with the token.
    NotExtended(u64),
    /// LimitMismatch (protocol 1.2), with the limit the key is registered
    /// with.
    LimitMismatch(u16),
}

/// One answer produced by applying a command, for the request `rid`. Only the
/// origin node (`rid.node`, in boot epoch `rid.epoch`) delivers it, to `conn`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The request answered.
    pub rid: Rid,
    /// The client connection on the origin node.
    pub conn: u64,
    /// The acquire's owner (0 for releases and extends).
    pub owner: u64,
    /// The lock name, in the [`Applied`] it came with.
    pub key: KeyAt,
    /// What the answer says.
    pub kind: AnswerKind,
}

/// Where the key of an [`Answer`] or an [`Effect`] lies in its
/// [`Applied`]: the keys of one entry's answers and effects share one
/// buffer, kept from entry to entry, instead of a `String` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyAt {
    start: usize,
    end: usize,
}

impl Applied {
    /// The key at `at`.
    #[must_use]
    pub fn key(&self, at: KeyAt) -> &str {
        &self.keys[at.start..at.end]
    }

    /// The wire reply of answer `a`.
    #[must_use]
    pub fn reply(&self, a: &Answer) -> Reply<'_> {
        let key = self.key(a.key);
        let owner = a.owner;
        match a.kind {
            AnswerKind::Acquired(token) => Reply::Acquired { token, owner, key },
            AnswerKind::Timeout => Reply::Timeout { owner, key },
            AnswerKind::Busy => Reply::Busy { owner, key },
            AnswerKind::Released(token) => Reply::Released { token, key },
            AnswerKind::NotReleased(token) => Reply::NotReleased { token, key },
            AnswerKind::Extended(token) => Reply::Extended { token, key },
            AnswerKind::NotExtended(token) => Reply::NotExtended { token, key },
            AnswerKind::LimitMismatch(limit) => Reply::LimitMismatch { owner, limit, key },
        }
    }
}

/// What applying one entry did, beyond answers: the leader schedules timers
/// from these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// `key` was granted with `token` for `lease_s` seconds.
    Granted {
        /// The lock name, in the [`Applied`] it came with.
        key: KeyAt,
        /// The new token.
        token: u64,
        /// The lease.
        lease_s: u8,
    },
    /// The grant `token` of `key` was extended: it is now in lease
    /// generation `generation`, for `lease_s` seconds from this apply.
    Extended {
        /// The lock name, in the [`Applied`] it came with.
        key: KeyAt,
        /// The grant's token (unchanged).
        token: u64,
        /// Its new lease generation.
        generation: u64,
        /// The new lease.
        lease_s: u8,
    },
    /// An acquire queued on `key` for at most `wait_s` seconds.
    Queued {
        /// The lock name, in the [`Applied`] it came with.
        key: KeyAt,
        /// The queued request.
        waiter: Rid,
        /// Its wait.
        wait_s: u8,
    },
}

/// The result of applying one entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Answers to deliver at the requests' origins.
    pub answers: Vec<Answer>,
    /// Grants and queued acquires, for the leader's timers.
    pub effects: Vec<Effect>,
    /// The command was a client request already applied (or forgotten):
    /// it changed nothing.
    pub duplicate: bool,
    /// The answers' and effects' keys, one after the other.
    keys: String,
}

impl Applied {
    /// Empties it for the next entry, keeping its buffers.
    pub fn clear(&mut self) {
        self.answers.clear();
        self.effects.clear();
        self.duplicate = false;
        self.keys.clear();
    }

    pub(super) fn push_key(&mut self, key: &str) -> KeyAt {
        let start = self.keys.len();
        self.keys.push_str(key);
        KeyAt {
            start,
            end: self.keys.len(),
        }
    }
}

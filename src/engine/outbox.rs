//! The outbox: the replies the engine produces, encoded once as they are
//! pushed, and the events that tell what it did.

use super::{ConnId, Grant};
use crate::proto::{
    encode_limit_mismatch, encode_reply_parts, Reply, OP_ACQUIRE, OP_BUSY, OP_EXTEND,
    OP_LIMIT_MISMATCH, OP_NOT_EXTENDED, OP_NOT_RELEASED, OP_RELEASE, OP_TIMEOUT,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Acquired(Grant),
    Timeout,
    Busy,
    Released,
    NotReleased,
    Extended,
    NotExtended,
    /// An acquire with a limit other than its key's (PROTOCOL §6.2); the
    /// message's `token` holds the key's limit.
    LimitMismatch,
    /// A lease ran out (no reply: nobody is told). The key is
    /// `Outbox::expired_keys[frame_start..frame_end]`.
    Expired,
}

impl Kind {
    /// The reply's op byte; 0 for an event without a reply (never encoded).
    #[inline]
    fn op(self) -> u8 {
        match self {
            Kind::Acquired(_) => OP_ACQUIRE,
            Kind::Timeout => OP_TIMEOUT,
            Kind::Busy => OP_BUSY,
            Kind::Released => OP_RELEASE,
            Kind::NotReleased => OP_NOT_RELEASED,
            Kind::Extended => OP_EXTEND,
            Kind::NotExtended => OP_NOT_EXTENDED,
            Kind::LimitMismatch => OP_LIMIT_MISMATCH,
            Kind::Expired => 0,
        }
    }

    /// Bytes of the frame before the key: the op and one or two words.
    fn header_len(self) -> usize {
        match self {
            Kind::Acquired(_) => 17,
            Kind::LimitMismatch => 11,
            Kind::Expired => 0,
            _ => 9,
        }
    }

    /// The reply's place in [`Outbox::tally`]; `None` for an event without
    /// a reply.
    fn tally_index(self) -> Option<usize> {
        Some(match self {
            Kind::Acquired(_) => 0,
            Kind::Timeout => 1,
            Kind::Busy => 2,
            Kind::Released => 3,
            Kind::NotReleased => 4,
            Kind::Extended => 5,
            Kind::NotExtended => 6,
            // Not among the seven replies of protocol 1.1 that the reply
            // counters of `GET /metrics` name.
            Kind::LimitMismatch | Kind::Expired => return None,
        })
    }
}

#[derive(Clone, Copy, Debug)]
struct OutMsg<T> {
    conn: ConnId,
    kind: Kind,
    lease_s: u8,
    token: u64,
    owner: u64,
    /// The encoded frame is `Outbox::frames[frame_start..frame_end]`.
    frame_start: usize,
    frame_end: usize,
    /// The tag of the request the event answers (see [`Engine`](super::Engine)).
    tag: T,
}

/// One reply addressed to a connection, as read back from an [`Outbox`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addressed<'a> {
    /// The connection the reply goes to.
    pub conn: ConnId,
    /// The reply.
    pub reply: Reply<'a>,
    /// For an `Acquired` or `Extended` reply, the lease of the grant in
    /// seconds (cluster leaders use it to schedule the Expire); 0 for every
    /// other reply.
    pub lease_s: u8,
}

/// What the engine did, as read back from an [`Outbox`] with
/// [`Outbox::events`]: every reply (with how a grant came about and the tag
/// of the request it answers) and every lease that ran out. Single mode
/// sends the replies' bytes; cluster mode builds its answers and timers
/// from these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event<'a, T> {
    /// `key` was granted to `owner` on `conn` with `token` for `lease_s`.
    Granted {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The new fencing token.
        token: u64,
        /// The acquire's owner.
        owner: u64,
        /// The lease, in seconds.
        lease_s: u8,
        /// Fresh, takeover or handover.
        how: Grant,
        /// The tag of the acquire granted.
        tag: T,
    },
    /// An acquire got Timeout: at once (`wait = 0`) or when its wait ran out.
    TimedOut {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The acquire's owner.
        owner: u64,
        /// The tag of the acquire.
        tag: T,
    },
    /// An acquire got Busy (a capacity limit).
    Busy {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The acquire's owner.
        owner: u64,
        /// The tag of the acquire.
        tag: T,
    },
    /// A release took effect.
    Released {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The grant released.
        token: u64,
    },
    /// A release did not take effect.
    NotReleased {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The token given.
        token: u64,
    },
    /// An extend took effect: the grant now lasts `lease_s` from the call.
    Extended {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The grant extended.
        token: u64,
        /// The new lease, in seconds.
        lease_s: u8,
    },
    /// An extend did not take effect.
    NotExtended {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The token given.
        token: u64,
    },
    /// An acquire with a limit gave a limit other than the key's.
    LimitMismatch {
        /// The connection answered.
        conn: ConnId,
        /// The lock name.
        key: &'a str,
        /// The acquire's owner.
        owner: u64,
        /// The limit the key is registered with.
        limit: u16,
        /// The tag of the acquire.
        tag: T,
    },
    /// The lease of grant `token` on `key` ran out (taken over, handed
    /// over, swept, or a committed `Expire`); no reply goes to its holder.
    Expired {
        /// The lock name.
        key: &'a str,
        /// The grant that ended.
        token: u64,
    },
}

/// Replies and events produced by the engine, in the order produced.
///
/// Each reply is encoded (`proto::encode_reply`) once, when it is pushed,
/// into one reusable buffer: the server copies the wire bytes of a run of
/// replies to one connection into its write buffer in one go
/// ([`Outbox::frames`]), and a long-lived outbox that is cleared after
/// each loop turn stops allocating once it has warmed up. [`Outbox::iter`]
/// reads the replies back as values, [`Outbox::events`] everything the
/// engine did, with the tag of each request answered (`T`, see
/// [`Engine`](super::Engine)).
#[derive(Debug)]
pub struct Outbox<T = ()> {
    msgs: Vec<OutMsg<T>>,
    frames: Vec<u8>,
    /// The keys of [`Event::Expired`] events, which have no frame.
    expired_keys: Vec<u8>,
    /// The replies held, by [`Kind::tally_index`]: counted as they are
    /// pushed, so that neither [`Outbox::tally`] nor a turn without
    /// wrong-token answers walks the replies.
    counts: [u64; 7],
    /// Replies written straight into a connection's write buffer.
    direct: Direct,
}

/// No connection: [`Direct::conn`] while no write buffer is lent.
const NO_CONN: ConnId = ConnId::MAX;

/// The write buffer a server lends the outbox while it handles one
/// connection's requests ([`Outbox::begin_direct`]): replies to that
/// connection are encoded into it at once, with no message kept and no
/// second copy. What a turn may still take back is recorded beside it.
#[derive(Debug)]
struct Direct {
    /// The connection whose buffer `buf` is, or [`NO_CONN`].
    conn: ConnId,
    buf: Vec<u8>,
    /// Every buffer lent this turn: its connection and its length when lent
    /// (what [`Outbox::direct_lent`] cuts back to if the turn's replies
    /// must not leave).
    lent: Vec<(ConnId, usize)>,
    /// The grants and extensions (which `retain_leases` may withhold, while
    /// `mark_grants`) and the wrong-token answers (which the guess throttle
    /// counts) written into lent buffers this turn.
    marks: Vec<DirectMark>,
    /// Whether grants and extensions written into lent buffers are marked
    /// ([`Outbox::set_direct_grant_marks`]).
    mark_grants: bool,
    /// Byte ranges of lent buffers withheld by `retain_leases`:
    /// connection, start, end, in the order written.
    withdrawn: Vec<(ConnId, usize, usize)>,
}

/// One reply written into a lent buffer, at `buf[start..end]`.
#[derive(Clone, Copy, Debug)]
struct DirectMark {
    conn: ConnId,
    start: usize,
    end: usize,
    kind: Kind,
    lease_s: u8,
}

impl<T> Default for Outbox<T> {
    fn default() -> Self {
        Outbox {
            msgs: Vec::new(),
            frames: Vec::new(),
            expired_keys: Vec::new(),
            counts: [0; 7],
            direct: Direct {
                conn: NO_CONN,
                buf: Vec::new(),
                lent: Vec::new(),
                marks: Vec::new(),
                mark_grants: true,
                withdrawn: Vec::new(),
            },
        }
    }
}

impl Outbox {
    /// An empty outbox.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }
}

impl<T: Copy + Default> Outbox<T> {
    /// Number of replies and events held (not counting replies written
    /// into a lent write buffer, see [`Outbox::begin_direct`]).
    #[must_use]
    pub fn len(&self) -> usize {
        self.msgs.len()
    }

    /// True when no reply or event is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    /// Adds the replies held to `counts`, by kind: acquired, timeout,
    /// busy, released, not released, extended, not extended (for
    /// `GET /metrics`; counted at push, so no pass over the replies).
    pub fn tally(&self, counts: &mut [u64; 7]) {
        for (total, n) in counts.iter_mut().zip(self.counts) {
            *total += n;
        }
    }

    /// Forgets every reply and event, keeping the allocations (and what
    /// was recorded about lent buffers: a turn's end).
    pub fn clear(&mut self) {
        self.msgs.clear();
        self.frames.clear();
        self.expired_keys.clear();
        self.counts = [0; 7];
        debug_assert!(self.direct.conn == NO_CONN, "a write buffer is still lent");
        self.direct.lent.clear();
        self.direct.marks.clear();
        self.direct.withdrawn.clear();
    }

    /// Whether the grants and extensions written into lent write buffers
    /// ([`Outbox::begin_direct`]) are marked, so that
    /// [`Outbox::retain_leases`] can withhold them (on by default). A
    /// service that never withholds a grant turns it off: a grant then
    /// costs no mark (a pipelined turn at depth 64 writes some 1,600, more
    /// than the L1 cache holds). While it is off, [`Outbox::retain_leases`]
    /// after a buffer was lent (since the last [`Outbox::clear`]) panics
    /// rather than let a grant it cannot withhold go out.
    pub fn set_direct_grant_marks(&mut self, on: bool) {
        self.direct.mark_grants = on;
    }

    /// Whether replies to `conn` may be written straight into its write
    /// buffer now: not while the outbox holds a reply to it already, which
    /// must reach the buffer first (replies to one connection keep their
    /// order).
    #[must_use]
    pub fn may_lend(&self, conn: ConnId) -> bool {
        conn != NO_CONN
            && self.direct.conn == NO_CONN
            && !self
                .msgs
                .iter()
                .any(|m| m.conn == conn && m.kind != Kind::Expired)
    }

    /// Lends the outbox `conn`'s write buffer: until [`Outbox::end_direct`]
    /// gives it back, every reply to `conn` is encoded at its end at once
    /// (as [`Outbox::frames`] would have carried it), and is not read back
    /// by [`Outbox::iter`], [`Outbox::events`] or [`Outbox::frames`]. It is
    /// still counted by [`Outbox::tally`] and
    /// [`Outbox::wrong_token_answers`], and a grant or extension among
    /// them that [`Outbox::retain_leases`] refuses is listed by
    /// [`Outbox::direct_withdrawn`] for the caller to cut out. The caller
    /// has checked [`Outbox::may_lend`].
    pub fn begin_direct(&mut self, conn: ConnId, buf: Vec<u8>) {
        debug_assert!(self.may_lend(conn), "lent while replies to it are held");
        self.direct.lent.push((conn, buf.len()));
        self.direct.conn = conn;
        self.direct.buf = buf;
    }

    /// The lent buffer's length now (0 while none is lent).
    #[must_use]
    pub fn direct_len(&self) -> usize {
        self.direct.buf.len()
    }

    /// Gives the lent write buffer back, with the replies written into it.
    pub fn end_direct(&mut self) -> Vec<u8> {
        self.direct.conn = NO_CONN;
        std::mem::take(&mut self.direct.buf)
    }

    /// The buffers lent since the last [`Outbox::clear`], in order: each
    /// connection and the buffer's length when lent (cut back to it, the
    /// turn's direct replies are gone).
    #[must_use]
    pub fn direct_lent(&self) -> &[(ConnId, usize)] {
        &self.direct.lent
    }

    /// The byte ranges of lent buffers that [`Outbox::retain_leases`]
    /// withheld since the last [`Outbox::clear`], in the order written:
    /// connection, start, end. Cut out last first, each range is where it
    /// was written.
    #[must_use]
    pub fn direct_withdrawn(&self) -> &[(ConnId, usize, usize)] {
        &self.direct.withdrawn
    }

    /// Replies written into lent buffers this turn that are marked (for
    /// the unit tests).
    #[cfg(test)]
    pub(super) fn direct_mark_count(&self) -> usize {
        self.direct.marks.len()
    }

    /// The key of `m`, read back from the bytes its push wrote.
    fn key_of(&self, m: &OutMsg<T>) -> &str {
        let bytes = if m.kind == Kind::Expired {
            &self.expired_keys[m.frame_start..m.frame_end]
        } else {
            &self.frames[m.frame_start + m.kind.header_len()..m.frame_end - 1]
        };
        debug_assert!(std::str::from_utf8(bytes).is_ok(), "push encodes a str key");
        // SAFETY: `push_reply` and `push_expired` are the only writers of
        // `frames` and `expired_keys`, which only grow until `clear` (that
        // also empties `msgs`). Each copies a whole `&str` key: after a
        // header of `kind.header_len()` bytes and before one newline in
        // `frames` (as `encode_reply_parts` lays a frame out), alone in
        // `expired_keys`, and records where it starts and ends. So `bytes`
        // is exactly one key's bytes, valid UTF-8 (checked once already,
        // when the key became a `&str`).
        unsafe { std::str::from_utf8_unchecked(bytes) }
    }

    /// Everything the engine did, in order.
    pub fn events(&self) -> impl Iterator<Item = Event<'_, T>> + '_ {
        self.msgs.iter().map(move |m| {
            let key = self.key_of(m);
            let (conn, token, owner, tag) = (m.conn, m.token, m.owner, m.tag);
            match m.kind {
                Kind::Acquired(how) => Event::Granted {
                    conn,
                    key,
                    token,
                    owner,
                    lease_s: m.lease_s,
                    how,
                    tag,
                },
                Kind::Timeout => Event::TimedOut {
                    conn,
                    key,
                    owner,
                    tag,
                },
                Kind::Busy => Event::Busy {
                    conn,
                    key,
                    owner,
                    tag,
                },
                Kind::Released => Event::Released { conn, key, token },
                Kind::NotReleased => Event::NotReleased { conn, key, token },
                Kind::Extended => Event::Extended {
                    conn,
                    key,
                    token,
                    lease_s: m.lease_s,
                },
                Kind::NotExtended => Event::NotExtended { conn, key, token },
                Kind::LimitMismatch => Event::LimitMismatch {
                    conn,
                    key,
                    owner,
                    limit: limit_of(token),
                    tag,
                },
                Kind::Expired => Event::Expired { key, token },
            }
        })
    }

    /// The replies in the order they were produced.
    pub fn iter(&self) -> impl Iterator<Item = Addressed<'_>> + '_ {
        self.msgs
            .iter()
            .filter(|m| m.kind != Kind::Expired)
            .map(move |m| {
                let key = self.key_of(m);
                let reply = match m.kind {
                    Kind::Acquired(_) => Reply::Acquired {
                        token: m.token,
                        owner: m.owner,
                        key,
                    },
                    Kind::Timeout => Reply::Timeout {
                        owner: m.owner,
                        key,
                    },
                    Kind::Busy => Reply::Busy {
                        owner: m.owner,
                        key,
                    },
                    Kind::Released => Reply::Released {
                        token: m.token,
                        key,
                    },
                    Kind::NotReleased => Reply::NotReleased {
                        token: m.token,
                        key,
                    },
                    Kind::Extended => Reply::Extended {
                        token: m.token,
                        key,
                    },
                    Kind::LimitMismatch => Reply::LimitMismatch {
                        owner: m.owner,
                        limit: limit_of(m.token),
                        key,
                    },
                    Kind::NotExtended | Kind::Expired => Reply::NotExtended {
                        token: m.token,
                        key,
                    },
                };
                Addressed {
                    conn: m.conn,
                    reply,
                    lease_s: m.lease_s,
                }
            })
    }

    /// `N` and `X` answers in the outbox so far (token 0's included): a
    /// count that grows by one with each wrong-token answer pushed.
    #[must_use]
    pub fn wrong_token_count(&self) -> u64 {
        self.counts[Kind::NotReleased.tally_index().unwrap_or(4)]
            + self.counts[Kind::NotExtended.tally_index().unwrap_or(6)]
    }

    /// The connection of every `N` (not released) and `X` (not extended)
    /// reply that answered a guess (any token but 0: no grant has token 0),
    /// in order: what the server's guess throttle counts. Walks the replies
    /// only if there is an `N` or an `X`.
    pub fn wrong_token_answers(&self) -> impl Iterator<Item = ConnId> + '_ {
        let wrong = self.counts[Kind::NotReleased.tally_index().unwrap_or(4)]
            + self.counts[Kind::NotExtended.tally_index().unwrap_or(6)];
        let (msgs, marks) = if wrong == 0 {
            (&[][..], &[][..])
        } else {
            (&self.msgs[..], &self.direct.marks[..])
        };
        msgs.iter()
            .filter(|m| is_guess(m.kind, m.token))
            .map(|m| m.conn)
            .chain(
                // Only guesses are marked among the wrong-token answers.
                marks
                    .iter()
                    .filter(|m| matches!(m.kind, Kind::NotReleased | Kind::NotExtended))
                    .map(|m| m.conn),
            )
    }

    /// The replies' wire bytes, in order, as runs of consecutive replies to
    /// one connection: each item is a connection and the encoded frames of
    /// one run (as `proto::encode_reply` writes them), so that the server
    /// copies a pipelined connection's replies in one go.
    pub fn frames(&self) -> impl Iterator<Item = (ConnId, &[u8])> + '_ {
        let mut i = 0;
        std::iter::from_fn(move || {
            // Events without a reply have no bytes: skip them.
            while self.msgs.get(i)?.kind == Kind::Expired {
                i += 1;
            }
            let first = &self.msgs[i];
            let mut end = first.frame_end;
            i += 1;
            // A run stops at another connection, and at a reply that
            // `retain_leases` dropped (its bytes are skipped).
            while let Some(m) = self.msgs.get(i) {
                if m.kind == Kind::Expired {
                    i += 1;
                    continue;
                }
                if m.conn != first.conn || m.frame_start != end {
                    break;
                }
                end = m.frame_end;
                i += 1;
            }
            Some((first.conn, &self.frames[first.frame_start..end]))
        })
    }

    /// Drops every grant (`A`) and extension (`E`) whose lease `keep`
    /// refuses, keeping every other reply and event, in order; returns how
    /// many were dropped. Single mode withholds the grants of a turn whose
    /// durable lease bound could not be written: a client that never saw a
    /// grant never acts on it, and its lease ends by itself.
    pub fn retain_leases(&mut self, mut keep: impl FnMut(u8) -> bool) -> usize {
        assert!(
            self.direct.mark_grants || self.direct.lent.is_empty(),
            "retain_leases after a buffer was lent with its grants not marked"
        );
        let before = self.msgs.len() + self.direct.marks.len();
        let counts = &mut self.counts;
        self.msgs.retain(|m| {
            let kept = !matches!(m.kind, Kind::Acquired(_) | Kind::Extended) || keep(m.lease_s);
            if !kept {
                if let Some(i) = m.kind.tally_index() {
                    counts[i] -= 1;
                }
            }
            kept
        });
        let withdrawn = &mut self.direct.withdrawn;
        self.direct.marks.retain(|m| {
            let kept = !matches!(m.kind, Kind::Acquired(_) | Kind::Extended) || keep(m.lease_s);
            if !kept {
                if let Some(i) = m.kind.tally_index() {
                    counts[i] -= 1;
                }
                withdrawn.push((m.conn, m.start, m.end));
            }
            kept
        });
        before - self.msgs.len() - self.direct.marks.len()
    }

    /// Appends a reply addressed to `conn`. Used by the engine, and by
    /// services (cluster mode) that answer without it; a grant pushed here
    /// reads back as [`Grant::Fresh`] with the default tag.
    #[inline]
    pub fn push(&mut self, conn: ConnId, reply: Reply<'_>, lease_s: u8) {
        self.push_event(conn, reply, lease_s, Grant::Fresh, T::default());
    }

    /// Appends a reply with how a grant came about and its request's tag.
    #[cfg_attr(not(ticketd_profile), inline)]
    #[cfg_attr(ticketd_profile, inline(never))]
    pub(super) fn push_event(
        &mut self,
        conn: ConnId,
        reply: Reply<'_>,
        lease_s: u8,
        how: Grant,
        tag: T,
    ) {
        let (kind, token, owner, key) = match reply {
            Reply::Acquired { token, owner, key } => (Kind::Acquired(how), token, owner, key),
            Reply::Timeout { owner, key } => (Kind::Timeout, 0, owner, key),
            Reply::Busy { owner, key } => (Kind::Busy, 0, owner, key),
            Reply::Released { token, key } => (Kind::Released, token, 0, key),
            Reply::NotReleased { token, key } => (Kind::NotReleased, token, 0, key),
            Reply::Extended { token, key } => (Kind::Extended, token, 0, key),
            Reply::NotExtended { token, key } => (Kind::NotExtended, token, 0, key),
            Reply::LimitMismatch { owner, limit, key } => {
                return self.push_limit_mismatch(conn, owner, limit, key, tag);
            }
        };
        self.push_reply(conn, kind, token, owner, key, lease_s, tag);
    }

    /// Appends a reply of `kind` (not [`Kind::Expired`]) from its parts:
    /// what [`Outbox::push_event`] does once it has taken the reply apart.
    /// The hot paths (a fresh grant, a release) call it with the kind known,
    /// so the reply is neither built nor matched.
    // Eight because it takes the frame's parts apart on purpose: packing
    // them into a `Reply` and matching it again is the cost it saves.
    // Always inlined: the kind is then known at each call site and the
    // frame's header, tally slot and mark test fold to constants (out of
    // line, the call and the run-time matches cost more than the copy).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(super) fn push_reply(
        &mut self,
        conn: ConnId,
        kind: Kind,
        token: u64,
        owner: u64,
        key: &str,
        lease_s: u8,
        tag: T,
    ) {
        debug_assert!(kind != Kind::Expired, "an expiry has no frame");
        if let Some(i) = kind.tally_index() {
            self.counts[i] += 1;
        }
        let (a, b) = match kind {
            Kind::Acquired(_) => (token, owner),
            Kind::Timeout | Kind::Busy => (owner, 0),
            _ => (token, 0),
        };
        if conn == self.direct.conn {
            let start = self.direct.buf.len();
            encode_reply_parts(kind.op(), a, b, key.as_bytes(), &mut self.direct.buf);
            // `kind` is known at each call site: an `R`, `T` or `B` folds
            // to no mark, an `N` or `X` to a mark, a grant or extension to
            // the one test of `mark_grants`.
            let grant = matches!(kind, Kind::Acquired(_) | Kind::Extended);
            let wrong_token = is_guess(kind, token);
            if wrong_token || (grant && self.direct.mark_grants) {
                self.direct.marks.push(DirectMark {
                    conn,
                    start,
                    end: self.direct.buf.len(),
                    kind,
                    lease_s,
                });
            }
            return;
        }
        let frame_start = self.frames.len();
        encode_reply_parts(kind.op(), a, b, key.as_bytes(), &mut self.frames);
        self.msgs.push(OutMsg {
            conn,
            kind,
            lease_s,
            token,
            owner,
            frame_start,
            frame_end: self.frames.len(),
            tag,
        });
    }

    /// Appends a LimitMismatch: out of line, since its frame is laid out
    /// unlike the others (the limit is a `u16`). The message keeps the
    /// limit in its `token`.
    #[cold]
    #[inline(never)]
    fn push_limit_mismatch(&mut self, conn: ConnId, owner: u64, limit: u16, key: &str, tag: T) {
        if conn == self.direct.conn {
            encode_limit_mismatch(owner, limit, key, &mut self.direct.buf);
            return;
        }
        let frame_start = self.frames.len();
        encode_limit_mismatch(owner, limit, key, &mut self.frames);
        self.msgs.push(OutMsg {
            conn,
            kind: Kind::LimitMismatch,
            lease_s: 0,
            token: u64::from(limit),
            owner,
            frame_start,
            frame_end: self.frames.len(),
            tag,
        });
    }

    /// Records that the lease of grant `token` on `key` ran out.
    pub(super) fn push_expired(&mut self, key: &str, token: u64) {
        let frame_start = self.expired_keys.len();
        self.expired_keys.extend_from_slice(key.as_bytes());
        self.msgs.push(OutMsg {
            conn: 0,
            kind: Kind::Expired,
            lease_s: 0,
            token,
            owner: 0,
            frame_start,
            frame_end: self.expired_keys.len(),
            tag: T::default(),
        });
    }
}

/// Whether a reply answered a guess at a token: an `N` or an `X` for any
/// token but 0. No grant ever has token 0 (it names the unknown holder of
/// a restart grace), so a release or extend of token 0 is refused without
/// telling anyone anything, and a client may send one as a barrier (its
/// `N` proves that everything before it on the connection was processed)
/// without meeting the guess throttle.
#[inline(always)]
pub(super) fn is_guess(kind: Kind, token: u64) -> bool {
    matches!(kind, Kind::NotReleased | Kind::NotExtended) && token != 0
}

/// The limit a [`Kind::LimitMismatch`] message keeps in its `token`.
fn limit_of(token: u64) -> u16 {
    u16::try_from(token).unwrap_or(u16::MAX)
}

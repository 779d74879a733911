//! The input side of a turn: for each connection with input, read, decode
//! frames straight from its read buffer and hand them to the service, until
//! the connection is drained or a bound is met (frames per turn, projected
//! output, the guess budget), then settle how the pass ended.
//!
//! A pass over one connection's input is a [`Dispatch`]: the parts of the
//! server a request touches, borrowed beside the connection (which stays
//! borrowed from the slab with its frame bytes), and the pass's running
//! counts.

use std::io;

use crate::config::Config;
use crate::engine::{Caller, ConnId, Outbox};
use crate::limits::{max_reply_frame, max_request_frame};
use crate::proto::{decode_request, Decoded, Malformed, Request};
use crate::service::Service;
use crate::time::Millis;

use super::clock::Clock;
use super::conn::{Conn, Fill, PeerAddr};
use super::guess_pause::{charge_guess, note_paused};
use super::identity::{Entry, Identities};
use super::{quota, Logs, Server, Stats};

/// How a pass over a connection's input ended.
enum End {
    /// Drained, paused, or throttled: nothing more to do this turn.
    Idle,
    /// A bound was met with input left: the connection is handled again
    /// next turn.
    Again,
    /// The connection closes.
    Close(Closing),
}

/// Why a pass over a connection's input closes it.
enum Closing {
    /// A malformed frame: closed after a flush of what it was answered.
    Malformed(Malformed),
    /// The peer closed its end: closed after a flush.
    PeerClosed,
    /// A read failed: closed at once.
    Failed(io::Error),
}

/// Why a decoded request was not handed to the service.
enum Held {
    /// The identity's guess budget has no room for a release or extend: the
    /// frame stays in the read buffer and the connection pauses.
    Throttled,
    /// The request is refused as malformed: the connection closes.
    Refused(Malformed),
}

/// One pass over a connection's input: what handing its requests to the
/// service needs beside the connection, and the pass's running counts.
struct Dispatch<'a, S: Service> {
    service: &'a mut S,
    out: &'a mut Outbox,
    stats: &'a mut Stats,
    logs: &'a mut Logs,
    /// The connection, for the service and the logs.
    id: ConnId,
    peer: PeerAddr,
    /// The clock reading after the last read that brought bytes: a request
    /// is never handled with a reading from before it was written.
    now: Millis,
    /// The loop turn, for the guess budget.
    turn: u64,
    /// The service answers releases and extends in the call that hands them
    /// over: each wrong answer is charged as it is made, so an identity's
    /// pipelined releases of its own grants never count as possible guesses
    /// (see `throttle`).
    at_once: bool,
    /// Debug logging is on: each request is logged.
    debug: bool,
    /// `--max-key-bytes`, and the longest request frame it allows.
    max_key_bytes: usize,
    max_frame: usize,
    /// `--out-soft-limit`.
    soft: usize,
    /// Frames that may still be handled this turn (`--max-frames-per-turn`).
    budget: usize,
    /// Unsent bytes plus the largest replies the turn's requests can still
    /// add: decoding stops when that reaches the soft limit, so a client
    /// that does not read overshoots it by at most one reply.
    projected_out: usize,
    /// The identity's guess budget held a release or extend back.
    throttled: bool,
    /// The length of the connection's write buffer when it was lent to the
    /// outbox, if it was.
    lent: Option<usize>,
    /// Who sends the requests, as the engine sees it.
    who: Caller,
    /// What the identity's budget would say before every release or extend,
    /// counted down: `now` only moves with a read.
    room: Option<u64>,
}

impl<S: Service> Server<S> {
    /// Handles the input of every active connection; returns `now` as it
    /// stands after the last read of the turn.
    #[cfg_attr(ticketd_profile, inline(never))]
    pub(super) fn handle_input(&mut self, mut now: Millis) -> Millis {
        let mut list = std::mem::take(&mut self.active);
        for &key in &list {
            self.handle_conn_input(&mut now, key);
        }
        list.clear();
        // Whatever was queued during the turn (leftover budget, resumed
        // connections) is for the next turn; keep the allocation.
        self.active = std::mem::replace(&mut self.active_next, list);
        now
    }

    /// Decodes and handles what `key` has sent, reading until `WouldBlock`
    /// or a bound ([`Dispatch::run`]), then settles the connection: its
    /// write buffer back from the outbox, a pause for the guess budget, its
    /// memory recounted, and how the pass ended. `now` moves forward after
    /// every read that brought bytes: a request must never be handled with
    /// a clock reading from before it was written, or its lease would be
    /// counted from before the client's own start and could end before the
    /// client's conservative expiry (PROTOCOL §3: written + lease).
    #[cfg_attr(ticketd_profile, inline(never))]
    fn handle_conn_input(&mut self, now_ref: &mut Millis, key: usize) {
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        c.clear_active();
        if !c.is_open() {
            return; // reads of a closing connection are the reaper's
        }
        if let Some(cert) = c.take_handshake() {
            let max = self.config.max_conns_per_identity;
            let quotas = (
                &mut self.identities,
                &mut self.stats,
                &mut self.quota_logs,
                max,
            );
            if !quota::handshake_done(quotas, c, cert, *now_ref) {
                self.close_now(*now_ref, key);
                return;
            }
        }
        let mut pass = Dispatch::new(
            &self.config,
            &mut self.service,
            &mut self.out,
            &mut self.stats,
            &mut self.logs,
            c,
            *now_ref,
        );
        let end = pass.run(c, &mut self.identities, self.admin_holder, &self.clock);
        let (now, throttled, lent) = (pass.now, pass.throttled, pass.lent);
        *now_ref = now;
        if let Some(len) = lent {
            if c.return_output(self.out.end_direct(), len) && c.mark_dirty() {
                self.dirty.push(key);
            }
        }
        if throttled && c.pause_for_guesses() {
            // Reads resume when the budget says so (see `resume_throttled`).
            note_paused(&mut self.identities, &mut self.paused_idents, c, key);
        }
        c.end_input_turn(now, throttled, self.config.out_soft_limit_bytes);
        let (was, is) = c.recount_memory();
        self.conn_bytes = self.conn_bytes + is as u64 - was as u64;
        if c.stream_has_output() && c.mark_dirty() {
            // TLS handshake records the socket did not take: write them.
            self.dirty.push(key);
        }
        match end {
            End::Idle => {}
            End::Again => {
                c.mark_active();
                self.active_next.push(key);
            }
            End::Close(why) => {
                let peer = c.peer();
                self.close_after_input(now, key, peer, why);
            }
        }
    }

    /// Closes `key` (from `peer`) as its input asks: after a flush for a
    /// malformed frame (counted and, rate-limited, logged) or the peer's
    /// close; at once for a failed read.
    fn close_after_input(&mut self, now: Millis, key: usize, peer: PeerAddr, why: Closing) {
        match why {
            Closing::Malformed(m) => {
                self.stats.malformed += 1;
                if let Some(n) = self.logs.malformed.allow(now) {
                    log::warn!(
                        "closing {peer}: malformed frame: {m} ({n} similar closes not logged)"
                    );
                }
                self.start_close(now, key, true);
            }
            Closing::PeerClosed => {
                log::debug!("{peer}: closed by the peer");
                self.start_close(now, key, false);
            }
            Closing::Failed(e) => {
                log::debug!("{peer}: read failed: {e}");
                self.close_now(now, key);
            }
        }
    }
}

impl<'a, S: Service> Dispatch<'a, S> {
    /// A pass over `c`'s input at `now`. The replies to the connection's
    /// requests are encoded straight into its write buffer, lent to the
    /// outbox for the pass (not while debug logging reads them back from the
    /// outbox, nor while the outbox holds a reply to it that must go first).
    #[inline]
    fn new(
        config: &Config,
        service: &'a mut S,
        out: &'a mut Outbox,
        stats: &'a mut Stats,
        logs: &'a mut Logs,
        c: &mut Conn,
        now: Millis,
    ) -> Self {
        let debug = log::log_enabled!(log::Level::Debug);
        let max_key_bytes = config.max_key_bytes;
        let (id, peer) = (c.id(), c.peer());
        let at_once = service.answers_in_the_call();
        let projected_out = c.unsent();
        let lent = (service.replies_direct() && !debug && out.may_lend(id)).then(|| {
            let buf = c.lend_output();
            let len = buf.len();
            out.begin_direct(id, buf);
            len
        });
        Dispatch {
            turn: stats.turns,
            service,
            out,
            stats,
            logs,
            id,
            peer,
            now,
            at_once,
            debug,
            max_key_bytes,
            max_frame: max_request_frame(max_key_bytes),
            soft: config.out_soft_limit_bytes,
            budget: config.max_frames_per_turn,
            projected_out,
            throttled: false,
            lent,
            who: Caller::default(),
            room: None,
        }
    }

    /// Reads from `c` and hands over its requests as the identity
    /// `identities` hold for it, until it is drained or a bound is met.
    #[inline(always)]
    fn run(
        &mut self,
        c: &mut Conn,
        identities: &mut Identities,
        admin_holder: Option<u64>,
        clock: &Clock,
    ) -> End {
        loop {
            let unsent = match self.lent {
                Some(_) => c.unsent_lent(self.out.direct_len()),
                None => c.unsent(),
            };
            if unsent >= self.soft {
                c.pause_input();
                return End::Idle;
            }
            let Some(ident) = identities.get_mut(c.ident()) else {
                return End::Idle; // never: an open connection has its identity
            };
            self.who = Caller {
                holder: ident.holder,
                admin: admin_holder == Some(ident.holder),
            };
            self.room = ident.guesses.room(self.now, self.turn);
            match self.frames(c, ident) {
                Err(Held::Refused(m)) => return End::Close(Closing::Malformed(m)),
                Err(Held::Throttled) => {
                    self.throttled = true;
                    return End::Idle;
                }
                Ok(()) => {}
            }
            if self.budget == 0 || self.projected_out >= self.soft {
                // Next turn: the replies will be counted for real by then.
                return End::Again;
            }
            if c.peer_closed() {
                return End::Close(Closing::PeerClosed);
            }
            if !c.may_read() {
                return End::Idle;
            }
            match c.read_more(self.max_frame) {
                Ok(Fill::Bytes) => {
                    self.now = self.now.max(clock.now());
                    if c.handshake_untaken() {
                        // The read finished a TLS handshake and brought
                        // requests: they are handled next turn, as the
                        // identity its certificate names.
                        return End::Again;
                    }
                }
                Ok(Fill::Eof | Fill::WouldBlock) => {}
                Ok(Fill::Full) => return End::Again,
                Err(e) => return End::Close(Closing::Failed(e)),
            }
        }
    }

    /// Decodes the frames `c` has read and hands each to the service, until
    /// none is whole or the frame budget or the projected output is spent.
    #[inline(always)]
    fn frames(&mut self, c: &mut Conn, ident: &mut Entry) -> Result<(), Held> {
        while self.budget > 0 && self.projected_out < self.soft {
            match decode_request(c.frame_bytes(), self.max_key_bytes) {
                Decoded::Frame { frame, used } => {
                    self.request(frame, ident)?;
                    c.consume(used);
                    self.budget -= 1;
                }
                Decoded::Incomplete => break,
                Decoded::Malformed(m) => return Err(Held::Refused(m)),
            }
        }
        Ok(())
    }

    /// Hands one decoded request to the service, counting it, and charges
    /// a wrong-token answer made at once to the identity `ident`. Held back
    /// (not handed over) when the identity's guess budget has no room for a
    /// release or extend.
    #[inline(always)]
    fn request(&mut self, frame: Request<'_>, ident: &mut Entry) -> Result<(), Held> {
        if !frame.is_acquire() {
            let Some(left) = self.room else {
                return Err(Held::Throttled);
            };
            if !self.at_once {
                ident.guesses.note_request(self.turn);
                self.room = left.checked_sub(1);
            }
        }
        if self.debug {
            // Copies: a field's address handed to the logger would keep the
            // whole pass out of registers.
            let (peer, id) = (self.peer, self.id);
            log::debug!("{peer} ({id}): {frame:?}");
        }
        self.projected_out += max_reply_frame(frame.key().len());
        self.stats.requests[match frame {
            Request::Acquire { .. } => 0,
            Request::Release { .. } => 1,
            Request::Extend { .. } => 2,
            Request::AcquireWithLimit { .. } => 0,
        }] += 1;
        let wrong_before = self.out.wrong_token_count();
        let guess = frame.guessed_token();
        let now = self.now;
        self.service
            .request_as(now, self.id, self.who, frame, self.out);
        if self.at_once && guess && self.out.wrong_token_count() > wrong_before {
            // Answered N or X at once: charged now, and the room left is
            // what the budget says after it.
            charge_guess(ident, self.stats, self.logs, now, self.peer);
            self.room = ident.guesses.room(now, self.turn);
        }
        Ok(())
    }
}

//! Lease renewal (PROTOCOL §5.3): extending a ticket, and keeping it alive in
//! the background.
//!
//! An extend is retried, unlike an acquire: applying it twice only moves
//! the expiry of the caller's own grant. Every attempt ends at the ticket's
//! conservative expiry, and only an `E` matched before it moves that expiry,
//! to the time the matched attempt was written plus the new lease. Until
//! then the old expiry stands: an extend in flight extends nothing. An
//! extend may also shorten a lease, and that can take effect before any
//! answer: so from the moment it is sent, the expiry is no later than the
//! send plus its lease.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::machine::{ExtendOutcome, Outcome, Unsent};
use super::renew::{Kept, KeptState, Shared};
use super::session::lock;
use super::{Client, Error, Release};

/// The outcome of [`crate::client::Ticket::extend`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "a lost ticket's token must not be used any more"]
pub enum Extend {
    /// The server extended the grant: [`crate::client::Ticket::expires_at`]
    /// is now the time this extend was written plus the new lease.
    Extended,
    /// The grant is gone (`X`: it expired, was released or taken over, or a
    /// `--max-hold` cap was reached; or the lease asked for is longer than
    /// the server's `--max-lease`, which also answers `X` and leaves the
    /// grant's lease as it was), or the ticket's conservative expiry
    /// passed without an `E`. Stop using the token: the lock may already
    /// be someone else's.
    Lost,
}

/// The outcome of [`Client::extend`], an extend by key and token with no
/// ticket (and so no expiry) to bound it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "an extend can fail"]
pub enum ExtendToken {
    /// `E`: the grant lives `lease` from about when the call was made.
    Extended,
    /// `X`: the grant is gone or capped, or the lease asked for is longer
    /// than the server's `--max-lease`; nothing changed.
    NotHeld,
    /// No reply within the 5 s transport deadline: the extend may or may
    /// not have applied.
    Indeterminate,
}

/// How one extend call ended, inside the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Extended {
    /// `E` matched: the grant now expires at this time (the answered
    /// attempt's write plus the lease).
    Yes { expires_at: Instant },
    /// `X`.
    No,
    /// `until` passed with no `E` or `X`.
    NoAnswer,
}

impl Client {
    /// Extends the grant `token` of `key` to live `lease` from now (PROTOCOL
    /// §5), under the 5 s transport deadline, retrying on another
    /// connection while no reply has come. This is what `ticket extend`
    /// does; a program that holds a [`crate::client::Ticket`] should call
    /// its [`crate::client::Ticket::extend`] instead, which keeps the
    /// conservative expiry.
    ///
    /// # Errors
    /// The key or lease is invalid; nothing was sent.
    pub fn extend(&self, key: &str, token: u64, lease: Duration) -> Result<ExtendToken, Error> {
        let max = self.inner.max_key_bytes;
        let call = Unsent::extend_token(Instant::now(), key, token, lease, max)?;
        Ok(match self.extend_call(call) {
            Extended::Yes { .. } => ExtendToken::Extended,
            Extended::No => ExtendToken::NotHeld,
            Extended::NoAnswer => ExtendToken::Indeterminate,
        })
    }

    /// Sends the extend until an `E` or `X` matches or its limit passes. An
    /// attempt that got no reply is given up after the transport deadline
    /// (its session is closed) and sent again elsewhere, never past the
    /// limit. An `E` matched at or after the limit counts for nothing:
    /// whoever waits for it has been told the ticket is lost.
    pub(crate) fn extend_call(&self, call: Unsent<Instant>) -> Extended {
        let Some((session, decided)) = self.run(call, true) else {
            return Extended::NoAnswer;
        };
        match decided.outcome {
            Outcome::Extend(ExtendOutcome::Extended(held)) => Extended::Yes {
                expires_at: held.expires_at,
            },
            Outcome::Extend(ExtendOutcome::Lost) if decided.refused => Extended::No,
            Outcome::Extend(ExtendOutcome::Lost) | Outcome::Acquire(_) | Outcome::Release(_) => {
                self.inner.pool.note_failure(&session);
                Extended::NoAnswer
            }
        }
    }
}

/// A ticket renewed in the background by [`crate::client::Ticket::keep_alive`].
///
/// The client's renewer (one thread per [`Client`], shared by every kept
/// ticket of it and of its clones) extends the grant a third of the lease
/// after each `E`, for the same lease, for as long as the holder keeps this
/// value. Renewals are coalesced: when one kept ticket is due, every kept
/// ticket of the client due within a sixth of its lease is extended with
/// it, in one write of several `E` frames on one connection, so a ticket is
/// renewed between a sixth and a third of its lease after its previous
/// extend. The moment the ticket is lost (an `X`, or no `E` before the
/// renewal deadline) it is marked lost and renewed no more;
/// [`KeptTicket::wait_lost`] wakes then. The renewal deadline is a tenth of
/// the lease before the conservative expiry, so a holder that watches
/// [`KeptTicket::is_lost`] hears of a dead or cut-off server while the
/// lease still runs.
///
/// Dropping it stops the renewals and releases the lock in the background;
/// [`KeptTicket::release`] does the same and reports the outcome. Neither
/// leaves a thread or a connection behind: the renewer ends with the last
/// kept ticket of its client.
#[derive(Debug)]
pub struct KeptTicket {
    client: Client,
    key: Arc<str>,
    token: u64,
    id: u64,
    shared: Arc<Shared>,
    /// `release` has run: drop has nothing left to do.
    released: bool,
}

impl KeptTicket {
    pub(crate) fn start(
        client: Client,
        key: String,
        token: u64,
        lease: Duration,
        expires_at: Instant,
    ) -> KeptTicket {
        let shared = Arc::new(Shared {
            state: Mutex::new(KeptState {
                expires_at,
                lease,
                lost: Instant::now() >= expires_at,
                stop: false,
                release_on_stop: false,
                exited: true,
            }),
            cv: Condvar::new(),
        });
        let key: Arc<str> = Arc::from(key);
        let kept = Kept::new(Arc::clone(&key), token, Arc::clone(&shared));
        let id = kept.id;
        let me = KeptTicket {
            client,
            key,
            token,
            id,
            shared,
            released: false,
        };
        if !me.is_lost() {
            lock(&me.shared.state).exited = false;
            if !me.client.inner.renewer.add(&me.client, kept) {
                // No renewer, no renewals: the holder must know at once.
                let mut st = lock(&me.shared.state);
                st.exited = true;
                st.lost = true;
                drop(st);
                me.shared.cv.notify_all();
            }
        }
        me
    }

    /// The key held.
    #[must_use]
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token of the grant (an extension keeps it).
    #[must_use]
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The conservative expiry as of the latest matched `E`: leave the
    /// critical section before it, and as soon as [`KeptTicket::is_lost`].
    #[must_use]
    pub fn expires_at(&self) -> Instant {
        lock(&self.shared.state).expires_at
    }

    /// Whether the ticket is lost: stop using the token.
    #[must_use]
    pub fn is_lost(&self) -> bool {
        let st = lock(&self.shared.state);
        st.lost || Instant::now() >= st.expires_at
    }

    /// Waits up to `timeout` for the ticket to be lost; true once it is.
    #[must_use]
    pub fn wait_lost(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut st = lock(&self.shared.state);
        loop {
            let now = Instant::now();
            if st.lost || now >= st.expires_at {
                return true;
            }
            if now >= end {
                return false;
            }
            let limit = end.min(st.expires_at);
            st = self
                .shared
                .cv
                .wait_timeout(st, limit - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Stops the renewals (waiting for one in flight, at most the 5 s
    /// transport deadline), then releases the lock and reports how.
    ///
    /// # Errors
    /// Never in practice: the key was checked when the lock was acquired.
    pub fn release(mut self) -> Result<Release, Error> {
        self.stop();
        self.released = true;
        self.client.release(&self.key, self.token)
    }

    /// Stops the renewals and keeps the lock until its current lease ends
    /// (or it is released): waits for a renewal in flight, at most the 5 s
    /// transport deadline, so [`KeptTicket::expires_at`] is final after it.
    pub fn stop_renewing(&mut self) {
        self.stop();
    }

    /// Whether renewals still run (not stopped, not lost).
    #[must_use]
    pub fn is_renewing(&self) -> bool {
        let st = lock(&self.shared.state);
        !st.exited && !st.stop && !st.lost
    }

    /// Stops the renewals and waits until the renewer has let the ticket go.
    fn stop(&mut self) {
        let running = {
            let mut st = lock(&self.shared.state);
            st.stop = true;
            !st.exited
        };
        if !running {
            return;
        }
        self.client.inner.renewer.stop(self.id);
        let mut st = lock(&self.shared.state);
        while !st.exited {
            st = self
                .shared
                .cv
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for KeptTicket {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        // Decided under the lock: either the renewer still has the ticket
        // and releases it as it lets it go, or it has and the release is
        // ours. Never waited for: a renewal in flight must not block a drop.
        let renewer_releases = {
            let mut st = lock(&self.shared.state);
            st.stop = true;
            st.release_on_stop = !st.exited;
            !st.exited
        };
        if renewer_releases {
            self.client.inner.renewer.stop(self.id);
        } else {
            self.client
                .release_in_background(self.key.to_string(), self.token);
        }
    }
}

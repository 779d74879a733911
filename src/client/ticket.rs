//! A held lock: key, fencing token and a conservative local expiry.

use std::fmt;
use std::time::{Duration, Instant, SystemTime};

use super::extend::Extended;
use super::machine::Unsent;
use super::{Client, Error, Extend, KeptTicket, Release};

/// A lock this process holds, as granted by the server.
///
/// Pass [`Ticket::token`] to the resource you guard: tokens only grow, so the
/// resource can reject any write carrying a token lower than one it has seen
/// (a fence). [`Ticket::expires_at`] is conservative: it counts the lease from
/// the moment the acquire was handed to the socket, which is before the server
/// started the lease, so the server's lease always ends later.
///
/// Dropping a ticket releases it in the background, once, within the 5 s
/// transport deadline counted from the drop. [`Ticket::release`]
/// releases it and reports the outcome; [`Ticket::detach`] stops managing it
/// (the lease, or a later [`Client::release`] with the token, ends it).
pub struct Ticket {
    client: Client,
    key: String,
    token: u64,
    lease: Duration,
    expires_at: Instant,
    /// An `X` or a passed expiry: no extend will ever be sent again.
    lost: bool,
    armed: bool,
}

impl Ticket {
    pub(crate) fn new(
        client: Client,
        key: String,
        token: u64,
        lease: Duration,
        expires_at: Instant,
    ) -> Ticket {
        Ticket {
            client,
            key,
            token,
            lease,
            expires_at,
            lost: false,
            armed: true,
        }
    }

    /// The key this ticket holds.
    #[must_use]
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token of the grant.
    #[must_use]
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The lease the grant was asked for, or its latest extension's.
    #[must_use]
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// When the lock must be considered lost: the time the acquire (or the
    /// latest extend answered `E`) was written plus its lease. Leave the
    /// critical section before it.
    #[must_use]
    pub fn expires_at(&self) -> Instant {
        self.expires_at
    }

    /// Time left until [`Ticket::expires_at`], zero once it has passed.
    #[must_use]
    pub fn remaining(&self) -> Duration {
        self.expires_at.saturating_duration_since(Instant::now())
    }

    /// Whether [`Ticket::expires_at`] has passed.
    #[must_use]
    pub fn is_expired(&self) -> bool {
        Instant::now() >= self.expires_at
    }

    /// [`Ticket::expires_at`] on the wall clock, for other processes. Rounded
    /// down to the millisecond, so it stays conservative.
    #[must_use]
    pub fn expires_at_system(&self) -> SystemTime {
        let left =
            Duration::from_millis(u64::try_from(self.remaining().as_millis()).unwrap_or(u64::MAX));
        SystemTime::now() + left
    }

    /// Extends the grant to live `lease` from now (PROTOCOL §5.3), keeping the
    /// token. Retried on another connection while no reply has come, until
    /// [`Ticket::expires_at`]; on `E` the expiry becomes the time the
    /// answered attempt was written plus `lease`. A lease shorter than the
    /// time left takes effect at once, answered or not: from the call on,
    /// [`Ticket::expires_at`] is no later than the call's start plus `lease`.
    /// Returns [`Extend::Lost`] on `X`, when the expiry passes first, and
    /// at once, sending nothing, once the ticket is lost or expired: an
    /// ended lease is never revived.
    ///
    /// # Errors
    /// `lease` is not whole seconds within 1..=255; nothing was sent.
    pub fn extend(&mut self, lease: Duration) -> Result<Extend, Error> {
        let now = Instant::now();
        let call = Unsent::extend(now, &self.key, self.token, lease, self.expires_at)?;
        if self.lost || now >= self.expires_at {
            self.lost = true;
            return Ok(Extend::Lost);
        }
        // A shorter lease may take effect on the server before its answer
        // comes back: from now on the expiry is no later than now + lease.
        self.expires_at = call.send_deadline();
        match self.client.extend_call(call) {
            Extended::Yes { expires_at } => {
                self.expires_at = expires_at;
                self.lease = lease;
                Ok(Extend::Extended)
            }
            Extended::No | Extended::NoAnswer => {
                self.lost = true;
                Ok(Extend::Lost)
            }
        }
    }

    /// Whether the ticket is lost: an extend got `X`, or the expiry passed.
    #[must_use]
    pub fn is_lost(&self) -> bool {
        self.lost || self.is_expired()
    }

    /// Renews the ticket in the background at a third of its lease, for
    /// as long as the returned [`KeptTicket`] lives (see there).
    #[must_use = "dropping the kept ticket releases the lock"]
    pub fn keep_alive(mut self) -> KeptTicket {
        self.armed = false;
        let key = std::mem::take(&mut self.key);
        let expires_at = if self.lost {
            Instant::now().min(self.expires_at)
        } else {
            self.expires_at
        };
        KeptTicket::start(self.client.clone(), key, self.token, self.lease, expires_at)
    }

    /// Releases the lock and waits for the outcome (at most the 5 s
    /// transport deadline). The ticket is not released again on drop.
    pub fn release(mut self) -> Result<Release, Error> {
        self.armed = false;
        self.client.release(&self.key, self.token)
    }

    /// Stops managing the lock without releasing it and returns its key and
    /// token; the lease, or [`Client::release`], ends it.
    #[must_use]
    pub fn detach(mut self) -> (String, u64) {
        self.armed = false;
        (std::mem::take(&mut self.key), self.token)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.armed {
            self.armed = false;
            self.client
                .release_in_background(std::mem::take(&mut self.key), self.token);
        }
    }
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("lease", &self.lease)
            .field("remaining", &self.remaining())
            .finish()
    }
}

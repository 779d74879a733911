//! The lock services the load generator can drive, behind one trait.
//!
//! The generator owns sockets, timing and the workload; a [`Backend`] only
//! knows how to say "acquire", "release" and how to read the answer in its
//! service's wire format. The ticketd backend uses [`ticketd::proto`], the same
//! codec as the server; the Redis backend speaks RESP by hand.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use ticketd::proto::{self, Decoded, Places, Reply, Request};

/// What one reply said, in the terms the generator needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The acquire was granted.
    Granted {
        /// What the release must present: ticketd's fencing token; `None`
        /// when the reply does not carry one (Redis: the release presents the
        /// acquire's owner).
        token: Option<u64>,
        /// The acquire's owner, when the reply names it.
        owner: Option<u64>,
    },
    /// The acquire was not granted (held and no wait, or the wait ran out).
    NotGranted {
        /// The acquire's owner, when the reply names it.
        owner: Option<u64>,
    },
    /// The acquire was refused for capacity (ticketd `B`).
    Busy {
        /// The acquire's owner, when the reply names it.
        owner: Option<u64>,
    },
    /// The release took effect.
    Released {
        /// The released token, when the reply names it.
        token: Option<u64>,
    },
    /// The release changed nothing.
    NotReleased {
        /// The token of the release, when the reply names it.
        token: Option<u64>,
    },
    /// The extend took effect (ticketd `E`).
    Extended {
        /// The extended token, when the reply names it.
        token: Option<u64>,
    },
    /// The extend changed nothing (ticketd `X`).
    NotExtended {
        /// The token of the extend, when the reply names it.
        token: Option<u64>,
    },
}

impl Outcome {
    /// True for replies to acquires, false for replies to releases.
    #[must_use]
    pub fn answers_acquire(&self) -> bool {
        matches!(
            self,
            Outcome::Granted { .. } | Outcome::NotGranted { .. } | Outcome::Busy { .. }
        )
    }
}

/// A lock service's wire format, as the generator drives it.
pub trait Backend: Send + Sync + 'static {
    /// Short name for reports.
    fn name(&self) -> &'static str;

    /// Opens one connection and does any handshake; the generator then makes
    /// the stream non-blocking.
    fn connect(&self, addr: SocketAddr) -> io::Result<TcpStream> {
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_nodelay(true)?;
        Ok(s)
    }

    /// True if the server answers each connection's requests in order, so a
    /// reply is matched to the oldest outstanding request.
    fn ordered_replies(&self) -> bool;

    /// True if the service queues waiters itself (`wait` is sent to it);
    /// false if clients must poll.
    fn queues_waiters(&self) -> bool;

    /// True if the FIFO check applies: the service grants with fencing
    /// tokens in grant order and a release of token 0 is a harmless probe.
    fn fifo_probe(&self) -> bool {
        false
    }

    /// Appends an acquire of `key` for `owner`.
    fn encode_acquire(&self, out: &mut Vec<u8>, key: &str, owner: u64, wait_s: u8, lease_s: u8);

    /// Appends a release of `key`; `token` is what [`Outcome::Granted`] gave.
    fn encode_release(&self, out: &mut Vec<u8>, key: &str, token: u64);

    /// True if the service renews a grant by its token ([`Backend::encode_extend`]).
    fn supports_extend(&self) -> bool {
        false
    }

    /// Appends an extend of the grant `token` of `key` by `lease_s`. Only
    /// called when [`Backend::supports_extend`]; the default appends nothing.
    fn encode_extend(&self, out: &mut Vec<u8>, key: &str, token: u64, lease_s: u8) {
        let _ = (out, key, token, lease_s);
    }

    /// Decodes one reply from the front of `buf`: `Ok(None)` if incomplete,
    /// `Ok(Some((outcome, used)))`, or `Err` for bytes that are no reply.
    fn decode(&self, buf: &[u8]) -> Result<Option<(Outcome, usize)>, String>;
}

/// ticketd's binary protocol, through [`ticketd::proto`]: mutex acquires,
/// or with `places` Acquire With Limit (protocol 1.2).
#[derive(Clone, Copy, Debug, Default)]
pub struct Ticketd {
    /// Send every acquire as an Acquire With Limit of these places.
    pub places: Option<Places>,
}

/// Keys the generator makes are short; this only bounds how far a decoder
/// scans for a newline on a corrupt stream.
const MAX_KEY_BYTES: usize = ticketd::limits::DEFAULT_MAX_KEY_BYTES;

impl Backend for Ticketd {
    fn name(&self) -> &'static str {
        "ticketd"
    }

    fn ordered_replies(&self) -> bool {
        false
    }

    fn queues_waiters(&self) -> bool {
        true
    }

    fn fifo_probe(&self) -> bool {
        true
    }

    fn encode_acquire(&self, out: &mut Vec<u8>, key: &str, owner: u64, wait_s: u8, lease_s: u8) {
        let req = match self.places {
            None => Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
            },
            Some(Places { limit, mode }) => Request::AcquireWithLimit {
                wait_s,
                lease_s,
                owner,
                limit,
                mode,
                key,
            },
        };
        proto::encode_request(&req, out);
    }

    fn encode_release(&self, out: &mut Vec<u8>, key: &str, token: u64) {
        proto::encode_request(&Request::Release { token, key }, out);
    }

    fn supports_extend(&self) -> bool {
        true
    }

    fn encode_extend(&self, out: &mut Vec<u8>, key: &str, token: u64, lease_s: u8) {
        proto::encode_request(
            &Request::Extend {
                lease_s,
                token,
                key,
            },
            out,
        );
    }

    fn decode(&self, buf: &[u8]) -> Result<Option<(Outcome, usize)>, String> {
        match proto::decode_reply(buf, MAX_KEY_BYTES) {
            Decoded::Incomplete => Ok(None),
            Decoded::Malformed(m) => Err(format!("bad reply from ticketd: {m}")),
            Decoded::Frame { frame, used } => {
                let o = match frame {
                    Reply::Acquired { token, owner, .. } => Outcome::Granted {
                        token: Some(token),
                        owner: Some(owner),
                    },
                    Reply::Timeout { owner, .. } => Outcome::NotGranted { owner: Some(owner) },
                    Reply::Busy { owner, .. } | Reply::LimitMismatch { owner, .. } => {
                        Outcome::Busy { owner: Some(owner) }
                    }
                    Reply::Released { token, .. } => Outcome::Released { token: Some(token) },
                    Reply::NotReleased { token, .. } => Outcome::NotReleased { token: Some(token) },
                    Reply::Extended { token, .. } => Outcome::Extended { token: Some(token) },
                    Reply::NotExtended { token, .. } => Outcome::NotExtended { token: Some(token) },
                };
                Ok(Some((o, used)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticketd_backend_reads_what_the_server_codec_writes() {
        let b = Ticketd::default();
        let mut v = Vec::new();
        proto::encode_reply(
            &Reply::Acquired {
                token: 7,
                owner: 0x0A0A,
                key: "k",
            },
            &mut v,
        );
        proto::encode_reply(&Reply::NotReleased { token: 9, key: "k" }, &mut v);
        let (o, used) = b.decode(&v).unwrap().unwrap();
        assert_eq!(
            o,
            Outcome::Granted {
                token: Some(7),
                owner: Some(0x0A0A)
            }
        );
        let (o2, used2) = b.decode(&v[used..]).unwrap().unwrap();
        assert_eq!(o2, Outcome::NotReleased { token: Some(9) });
        assert_eq!(used + used2, v.len());
        assert_eq!(b.decode(&v[..used - 1]).unwrap(), None);
        assert!(b.decode(b"Zjunk\n").is_err());

        let mut req = Vec::new();
        b.encode_acquire(&mut req, "db", 0x0A0B, 5, 30);
        assert_eq!(
            req,
            [0x41, 0x05, 0x1E, 0, 0, 0, 0, 0, 0, 0x0A, 0x0B, 0x64, 0x62, 0x0A]
        );

        // PROTOCOL §5.1's example: extend token 7 of "db" by 30 s.
        assert!(b.supports_extend());
        let mut ext = Vec::new();
        b.encode_extend(&mut ext, "db", 7, 30);
        assert_eq!(
            ext,
            [0x45, 0x1E, 0, 0, 0, 0, 0, 0, 0, 0x07, 0x64, 0x62, 0x0A]
        );
        let mut v = Vec::new();
        proto::encode_reply(
            &Reply::Extended {
                token: 7,
                key: "db",
            },
            &mut v,
        );
        proto::encode_reply(
            &Reply::NotExtended {
                token: 8,
                key: "db",
            },
            &mut v,
        );
        let (o, used) = b.decode(&v).unwrap().unwrap();
        assert_eq!(o, Outcome::Extended { token: Some(7) });
        let (o2, _) = b.decode(&v[used..]).unwrap().unwrap();
        assert_eq!(o2, Outcome::NotExtended { token: Some(8) });
    }
}

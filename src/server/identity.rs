//! Who is at the other end of a client connection, for accounting and for
//! binding grants: every connection has one [`Identity`].
//!
//! * **A client certificate** (TLS with `--tls-client-ca`): its subject's
//!   common name, else its first DNS or URI subject alternative name, else
//!   its serial number. Authenticated: the CA vouches for it.
//! * **A Unix-socket peer's uid** (`SO_PEERCRED` at accept).
//!   Authenticated: the kernel vouches for it.
//! * **Otherwise the source address**: an IPv4 address, or an IPv6
//!   address's /64 prefix (one host's usual allocation, so a host cannot
//!   multiply itself by its addresses). Not authenticated: addresses are
//!   shared (NAT, one host's users) and proven by nothing.
//!
//! `Identities` keeps the ones in use with what is counted against each:
//! open connections and TLS handshakes under way (`super::quota`) and the
//! guess budget (`super::throttle`). An entry
//! lives while it has connections and while its budget owes anything, so
//! reconnecting never resets an identity's budget.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

#[cfg(test)]
use crate::engine::holder_may_act;
use crate::hash::SipKey;
use crate::time::Millis;

use super::throttle::GuessBudget;

/// Longest identity name kept (bytes); longer certificate names are cut.
const MAX_NAME_BYTES: usize = 128;

/// The fixed key of [`Identity::holder`]: the same on every node and build,
/// so that a cluster's nodes agree on who holds a grant.
const HOLDER_KEY: SipKey = SipKey::from_parts(0x7469_636b_6574_6421, 0x686f_6c64_6572_2121);

/// Who a connection is from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Identity {
    /// A verified client certificate's name.
    Cert(Box<str>),
    /// A Unix-socket peer's user id.
    Uid(u32),
    /// A source address (IPv6: its /64 prefix).
    Ip(IpAddr),
}

impl Identity {
    /// The identity of a TCP connection from `peer` before (or without) a
    /// client certificate.
    #[must_use]
    pub fn of_addr(peer: SocketAddr) -> Identity {
        match peer.ip() {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Identity::Ip(IpAddr::V4(v4)),
                None => {
                    let bits = u128::from(v6) & !((1u128 << 64) - 1);
                    Identity::Ip(IpAddr::V6(Ipv6Addr::from(bits)))
                }
            },
            v4 => Identity::Ip(v4),
        }
    }

    /// The identity a verified client certificate (DER) names; `None` when
    /// it cannot be parsed (never the case for one rustls accepted).
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn of_cert(der: &[u8]) -> Option<Identity> {
        let der = rustls::pki_types::CertificateDer::from(der);
        let cert = webpki::EndEntityCert::try_from(&der).ok()?;
        let name = common_name(cert.subject())
            .or_else(|| cert.valid_dns_names().next().map(str::to_owned))
            .or_else(|| cert.valid_uri_names().next().map(str::to_owned))
            .unwrap_or_else(|| {
                let hex: String = cert.serial().iter().map(|b| format!("{b:02x}")).collect();
                format!("serial {hex}")
            });
        Some(Identity::Cert(clean_name(&name).into()))
    }

    /// Whether something other than the network vouches for it: a grant
    /// taken by an authenticated identity can be released and extended by
    /// that identity only (and `--admin-identity`).
    #[must_use]
    pub fn authenticated(&self) -> bool {
        !matches!(self, Identity::Ip(_))
    }

    /// What a grant records of its holder: a 64-bit hash of the name,
    /// never 0, odd for an authenticated identity and even for one that is
    /// not (see [`crate::engine::holder_may_act`]).
    #[must_use]
    pub fn holder(&self) -> u64 {
        let h = HOLDER_KEY.hash(self.to_string().as_bytes());
        if self.authenticated() {
            h | 1
        } else {
            (h & !1).max(2)
        }
    }

    /// Parses the form [`Identity`]'s `Display` writes (`cert:NAME`,
    /// `uid:N`, `ip:ADDR`), as `--admin-identity` takes it.
    pub fn parse(s: &str) -> Result<Identity, String> {
        let bad = || format!("{s:?} is not an identity: use cert:NAME, uid:N or ip:ADDRESS");
        let (kind, rest) = s.split_once(':').ok_or_else(bad)?;
        match kind {
            "cert" if !rest.is_empty() && rest.len() <= MAX_NAME_BYTES => {
                Ok(Identity::Cert(rest.into()))
            }
            "uid" if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) => {
                rest.parse().map(Identity::Uid).map_err(|_| bad())
            }
            "ip" => {
                let ip: IpAddr = rest.trim_end_matches("/64").parse().map_err(|_| bad())?;
                Ok(Identity::of_addr(SocketAddr::new(ip, 0)))
            }
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Cert(name) => write!(f, "cert:{name}"),
            Identity::Uid(uid) => write!(f, "uid:{uid}"),
            Identity::Ip(IpAddr::V6(v6)) => write!(f, "ip:{v6}/64"),
            Identity::Ip(ip) => write!(f, "ip:{ip}"),
        }
    }
}

/// Printable ASCII, at most [`MAX_NAME_BYTES`], for logs and JSON.
#[cfg(feature = "tls")]
fn clean_name(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .take(MAX_NAME_BYTES)
        .collect()
}

#[cfg(feature = "tls")]
/// Reads one DER element's tag and contents from `input`: `(tag, body,
/// rest)`. Definite lengths of up to four bytes only.
fn der_element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

#[cfg(feature = "tls")]
/// The first common name (OID 2.5.4.3) in a DER-encoded X.501 Name's
/// contents (a sequence of sets of attribute type-and-value sequences).
/// webpki hands the subject over raw and parses no attribute of it, so
/// this walks the three levels of nesting itself.
fn common_name(mut rdns: &[u8]) -> Option<String> {
    const CN_OID: [u8; 3] = [0x55, 0x04, 0x03];
    while !rdns.is_empty() {
        let (_, mut set, rest) = der_element(rdns)?;
        rdns = rest;
        while !set.is_empty() {
            let (_, atv, more) = der_element(set)?;
            set = more;
            let (oid_tag, oid, value) = der_element(atv)?;
            if oid_tag == 0x06 && oid == CN_OID {
                let (_, text, _) = der_element(value)?;
                return String::from_utf8(text.to_vec()).ok();
            }
        }
    }
    None
}

/// Index of an identity in [`Identities`], kept by each connection.
pub(crate) type IdentKey = usize;

/// An identity in use and what is counted against it.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) identity: Identity,
    /// [`Identity::holder`], computed once.
    pub(crate) holder: u64,
    /// Open connections.
    pub(crate) conns: u32,
    /// Of those, TLS connections whose handshake is under way.
    pub(crate) handshakes: u32,
    /// Wrong-token answers and the pause they earn.
    pub(crate) guesses: GuessBudget,
    /// Its connections paused by the guess budget (slab key, id), in the
    /// order they paused; some may have closed since.
    pub(crate) paused: std::collections::VecDeque<(usize, u64)>,
}

/// Names of forgotten identities kept for `/v1/locks` (a grant outlives
/// its taker's connections); cleared when full.
const RECENT_NAMES: usize = 4096;

/// The identities in use. See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct Identities {
    index: HashMap<Identity, IdentKey>,
    by_holder: HashMap<u64, IdentKey>,
    entries: slab::Slab<Entry>,
    /// Holder numbers and names of identities forgotten lately.
    recent: HashMap<u64, Box<str>>,
}

impl Identities {
    /// Counts a new connection of `identity`; returns its key.
    pub(crate) fn attach(&mut self, identity: Identity) -> IdentKey {
        let key = match self.index.get(&identity) {
            Some(&k) => k,
            None => {
                let holder = identity.holder();
                let k = self.entries.insert(Entry {
                    identity: identity.clone(),
                    holder,
                    conns: 0,
                    handshakes: 0,
                    guesses: GuessBudget::default(),
                    paused: std::collections::VecDeque::new(),
                });
                self.index.insert(identity, k);
                self.by_holder.insert(holder, k);
                k
            }
        };
        self.entries[key].conns += 1;
        key
    }

    /// A connection of `key` closed: forget the identity if nothing is left.
    pub(crate) fn detach(&mut self, key: IdentKey, now: Millis) {
        if let Some(e) = self.entries.get_mut(key) {
            e.conns = e.conns.saturating_sub(1);
        }
        self.forget_if_idle(key, now);
    }

    fn forget_if_idle(&mut self, key: IdentKey, now: Millis) {
        let idle = self
            .entries
            .get(key)
            .is_some_and(|e| e.conns == 0 && e.guesses.idle(now) && e.paused.is_empty());
        if idle {
            let e = self.entries.remove(key);
            self.index.remove(&e.identity);
            self.by_holder.remove(&e.holder);
            if self.recent.len() >= RECENT_NAMES {
                self.recent.clear();
            }
            self.recent
                .insert(e.holder, e.identity.to_string().into_boxed_str());
        }
    }

    /// Forgets the identities without connections whose budget owes
    /// nothing any more.
    pub(crate) fn sweep(&mut self, now: Millis) {
        let idle: Vec<IdentKey> = self
            .entries
            .iter()
            .filter(|(_, e)| e.conns == 0 && e.guesses.idle(now) && e.paused.is_empty())
            .map(|(k, _)| k)
            .collect();
        for k in idle {
            self.forget_if_idle(k, now);
        }
    }

    /// Open connections of `identity`, and of those the TLS handshakes
    /// under way.
    pub(crate) fn counts(&self, identity: &Identity) -> (u32, u32) {
        self.index.get(identity).map_or((0, 0), |&k| {
            (self.entries[k].conns, self.entries[k].handshakes)
        })
    }

    pub(crate) fn get(&self, key: IdentKey) -> Option<&Entry> {
        self.entries.get(key)
    }

    pub(crate) fn get_mut(&mut self, key: IdentKey) -> Option<&mut Entry> {
        self.entries.get_mut(key)
    }

    /// Identities remembered (with connections or owing).
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The name of the identity whose holder number
    /// ([`Identity::holder`]) is `holder`: one in use, or one of the last
    /// [`RECENT_NAMES`] forgotten.
    pub(crate) fn name_of(&self, holder: u64) -> Option<String> {
        match self.by_holder.get(&holder) {
            Some(&k) => Some(self.entries[k].identity.to_string()),
            None => self.recent.get(&holder).map(|n| n.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_name_hosts_and_ipv6_by_its_64_prefix() {
        let a: SocketAddr = "10.1.2.3:5000".parse().unwrap();
        assert_eq!(Identity::of_addr(a).to_string(), "ip:10.1.2.3");
        let b: SocketAddr = "[2001:db8:1:2:3:4:5:6]:80".parse().unwrap();
        let c: SocketAddr = "[2001:db8:1:2:ffff::1]:81".parse().unwrap();
        assert_eq!(Identity::of_addr(b), Identity::of_addr(c));
        assert_eq!(Identity::of_addr(b).to_string(), "ip:2001:db8:1:2::/64");
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:9".parse().unwrap();
        assert_eq!(Identity::of_addr(mapped).to_string(), "ip:127.0.0.1");
        assert!(!Identity::of_addr(a).authenticated());
        let h = Identity::of_addr(a).holder();
        assert!(h != 0 && h & 1 == 0);
    }

    #[test]
    fn authenticated_holders_differ_and_are_never_0() {
        let ids = [
            Identity::Uid(0),
            Identity::Uid(1000),
            Identity::Cert("alice".into()),
            Identity::Cert("bob".into()),
        ];
        for (i, a) in ids.iter().enumerate() {
            assert!(a.authenticated());
            assert_eq!(a.holder() & 1, 1);
            assert_eq!(a.holder(), a.clone().holder());
            for b in &ids[i + 1..] {
                assert_ne!(a.holder(), b.holder(), "{a} {b}");
            }
        }
    }

    #[test]
    fn only_the_same_authenticated_identity_may_act_on_its_grants() {
        let alice = Identity::Cert("alice".into()).holder();
        let bob = Identity::Uid(1000).holder();
        let ip1 = Identity::Ip("10.0.0.1".parse().unwrap()).holder();
        let ip2 = Identity::Ip("10.0.0.2".parse().unwrap()).holder();
        assert!(holder_may_act(alice, alice));
        assert!(!holder_may_act(alice, bob));
        assert!(
            !holder_may_act(alice, ip1),
            "an address never acts for a certificate"
        );
        assert!(!holder_may_act(ip1, bob), "a uid never acts for an address");
        assert!(
            holder_may_act(ip1, ip2),
            "between addresses the token decides"
        );
        assert!(holder_may_act(0, alice) && holder_may_act(0, ip1));
    }

    #[test]
    fn parse_reads_what_display_writes() {
        for s in [
            "cert:node client 1",
            "uid:1000",
            "ip:192.0.2.1",
            "ip:2001:db8::/64",
        ] {
            assert_eq!(Identity::parse(s).unwrap().to_string(), s);
        }
        for bad in [
            "", "uid:", "uid:-1", "uid:+5", "cert:", "ip:host", "user:x", "1000",
        ] {
            assert!(Identity::parse(bad).is_err(), "{bad}");
        }
    }

    #[cfg(feature = "tls")]
    #[test]
    fn common_name_is_found_among_other_attributes() {
        // SEQUENCE-less Name contents: SET{ SEQ{ OID 2.5.4.10, "Org" } },
        // SET{ SEQ{ OID 2.5.4.3, "client-7" } }.
        let mut name = vec![
            0x31, 0x0c, 0x30, 0x0a, 0x06, 0x03, 0x55, 0x04, 0x0a, 0x0c, 0x03,
        ];
        name.extend_from_slice(b"Org");
        name.extend_from_slice(&[
            0x31, 0x11, 0x30, 0x0f, 0x06, 0x03, 0x55, 0x04, 0x03, 0x0c, 0x08,
        ]);
        name.extend_from_slice(b"client-7");
        assert_eq!(common_name(&name).as_deref(), Some("client-7"));
        assert_eq!(common_name(&name[..name.len() - 1]), None, "truncated");
        assert_eq!(common_name(&[0x31, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
    }

    #[test]
    fn an_identity_lives_while_it_has_connections_or_owes() {
        let mut ids = Identities::default();
        let now = Millis(1_000);
        let who = Identity::Uid(7);
        let k = ids.attach(who.clone());
        assert_eq!(ids.attach(who.clone()), k);
        ids.detach(k, now);
        assert_eq!(ids.len(), 1);
        ids.get_mut(k).unwrap().guesses.charge(now);
        ids.detach(k, now);
        assert_eq!(ids.len(), 1, "it owes a slot");
        ids.sweep(now);
        assert_eq!(ids.len(), 1);
        let holder = who.holder();
        assert_eq!(ids.name_of(holder).as_deref(), Some("uid:7"));
        ids.sweep(now.add_secs(1));
        assert_eq!(ids.len(), 0);
        assert_eq!(
            ids.name_of(holder).as_deref(),
            Some("uid:7"),
            "kept as recent"
        );
    }
}

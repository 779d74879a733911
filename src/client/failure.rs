//! Why a connection to a server failed or ended, as far as the client can
//! tell from what came back: [`crate::client::Client::last_failure`].
//!
//! Outcomes do not change with it (PROTOCOL §3: a request that may have been
//! sent is still Indeterminate); it only names the cause, so that a
//! plaintext client on a TLS port, a missing client certificate or an
//! address that is not a ticketd client port can be told apart from a
//! server that is merely slow.

use std::fmt;
use std::io;

/// The kind of a [`Failure`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureKind {
    /// The connection was refused: nothing listens at the address (or no
    /// socket file is there).
    Refused,
    /// Connecting failed otherwise: unreachable, or timed out.
    Connect,
    /// The server answered plaintext with TLS: it speaks TLS
    /// ([`crate::client::ClientBuilder::tls_ca`]).
    TlsExpected,
    /// The server requires a client certificate and was given none
    /// ([`crate::client::ClientBuilder::tls_client_cert`]).
    CertificateRequired,
    /// The server refused the client certificate it was given.
    CertificateRefused,
    /// TLS failed otherwise (e.g. the server's certificate is not trusted).
    Tls,
    /// The peer answered HTTP: an HTTP port (such as ticketd's admin
    /// port), not a ticketd client port.
    Http,
    /// The peer answered bytes that are no ticketd reply.
    NotTicketd,
    /// The server closed or reset the connection.
    Closed,
    /// A request got no reply by its deadline; the client closed the
    /// connection.
    NoReply,
}

impl FailureKind {
    /// Whether trying the same address again at once would fail the same
    /// way (nothing listens; TLS refused).
    pub(crate) fn is_definite(self) -> bool {
        matches!(
            self,
            FailureKind::Refused
                | FailureKind::CertificateRequired
                | FailureKind::CertificateRefused
                | FailureKind::Tls
        )
    }
}

/// Why a connection to a server failed or ended: its address, a kind, and
/// a description in words (its `Display` gives both).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    address: String,
    kind: FailureKind,
    detail: String,
}

impl Failure {
    pub(crate) fn new(address: String, kind: FailureKind, detail: String) -> Failure {
        Failure {
            address,
            kind,
            detail,
        }
    }

    /// The server address the connection was to (`host:port`, or
    /// `unix:/path`).
    #[must_use]
    pub fn address(&self) -> &str {
        &self.address
    }

    /// What went wrong.
    #[must_use]
    pub fn kind(&self) -> FailureKind {
        self.kind
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.address, self.detail)
    }
}

/// The kind and words for bytes that came where a reply should have:
/// `None` if they say nothing about the peer.
pub(crate) fn classify_reply(bytes: &[u8]) -> Option<(FailureKind, String)> {
    match bytes.first()? {
        // TLS record types: alert and handshake.
        0x15 | 0x16 => Some((
            FailureKind::TlsExpected,
            "the server answered with TLS: it expects a TLS client".into(),
        )),
        _ if bytes.starts_with(b"HTTP/") => Some((
            FailureKind::Http,
            "it answered HTTP: not a ticketd client port (an admin port?)".into(),
        )),
        _ => None,
    }
}

/// The kind and words for a failed connect, read or write.
pub(crate) fn classify_io(e: &io::Error) -> (FailureKind, String) {
    #[cfg(feature = "tls")]
    if let Some(t) = tls_cause(e) {
        return classify_tls(t);
    }
    let kind = match e.kind() {
        io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound => FailureKind::Refused,
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::UnexpectedEof => FailureKind::Closed,
        _ => FailureKind::Connect,
    };
    (kind, e.to_string())
}

/// The rustls error under an I/O error, if there is one.
#[cfg(feature = "tls")]
fn tls_cause(e: &io::Error) -> Option<&rustls::Error> {
    let inner = e.get_ref()?;
    inner
        .downcast_ref::<super::tls::TlsError>()
        .map(|t| &t.0)
        .or_else(|| inner.downcast_ref::<rustls::Error>())
}

#[cfg(feature = "tls")]
fn classify_tls(e: &rustls::Error) -> (FailureKind, String) {
    use rustls::AlertDescription as A;
    let rustls::Error::AlertReceived(alert) = e else {
        return (FailureKind::Tls, format!("TLS: {e}"));
    };
    let words = match alert {
        A::CertificateRequired => {
            return (
                FailureKind::CertificateRequired,
                "the server requires a client certificate".into(),
            )
        }
        A::BadCertificate => "bad certificate",
        A::UnknownCA => "unknown certificate authority",
        A::CertificateUnknown => "certificate unknown",
        A::CertificateExpired => "certificate expired",
        A::CertificateRevoked => "certificate revoked",
        A::UnsupportedCertificate => "unsupported certificate",
        A::AccessDenied => "access denied",
        _ => return (FailureKind::Tls, format!("TLS: {e}")),
    };
    (
        FailureKind::CertificateRefused,
        format!("the server refused the client certificate ({words})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_that_name_the_peer() {
        assert_eq!(
            classify_reply(&[0x15, 3, 3, 0, 2, 2, 50]).map(|c| c.0),
            Some(FailureKind::TlsExpected)
        );
        assert_eq!(
            classify_reply(b"HTTP/1.1 400 Bad Request\r\n").map(|c| c.0),
            Some(FailureKind::Http)
        );
        assert_eq!(classify_reply(b"Zzz"), None);
        assert_eq!(classify_reply(b""), None);
    }

    #[test]
    fn io_errors() {
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(classify_io(&refused).0, FailureKind::Refused);
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        assert_eq!(classify_io(&reset).0, FailureKind::Closed);
        let timeout = io::Error::from(io::ErrorKind::TimedOut);
        assert_eq!(classify_io(&timeout).0, FailureKind::Connect);
        assert!(FailureKind::Refused.is_definite());
        assert!(!FailureKind::Connect.is_definite());
        assert!(!FailureKind::Closed.is_definite());
    }

    #[cfg(feature = "tls")]
    #[test]
    fn tls_alerts() {
        use rustls::AlertDescription as A;
        let io = |e: rustls::Error| io::Error::new(io::ErrorKind::InvalidData, e);
        let wrapped = |e| super::super::tls::tls_error(e);
        let required = rustls::Error::AlertReceived(A::CertificateRequired);
        assert_eq!(
            classify_io(&wrapped(required.clone())).0,
            FailureKind::CertificateRequired
        );
        assert_eq!(
            classify_io(&io(required)).0,
            FailureKind::CertificateRequired
        );
        let (kind, words) = classify_io(&wrapped(rustls::Error::AlertReceived(A::UnknownCA)));
        assert_eq!(kind, FailureKind::CertificateRefused);
        assert!(words.contains("unknown certificate authority"), "{words}");
        let other = rustls::Error::AlertReceived(A::HandshakeFailure);
        assert_eq!(classify_io(&wrapped(other)).0, FailureKind::Tls);
    }
}

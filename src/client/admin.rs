//! A blocking reader of the admin port (`ticketd --admin-listen`): one
//! HTTP/1.1 request per call, and the JSON it answers as a [`Json`] value.
//! `ticket status`, `ticket locks` and `ticket cluster` are built on it.
//!
//! JSON is read with `serde_json` (strict RFC 8259, 64-bit integers read
//! exactly), bounded in nesting depth and by the size of the response,
//! which is itself bounded ([`MAX_RESPONSE_BYTES`]).

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// The largest response read: a page of 1,000 locks with the longest keys.
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;
/// Deepest JSON nesting accepted.
const MAX_DEPTH: usize = 32;

/// Why an admin request failed, or why its answer could not be used.
#[derive(Debug)]
#[non_exhaustive]
pub enum AdminError {
    /// `addr` is no address this call can reach an admin port at: `unix:`
    /// without a path, a host with no address, or `https://` given to
    /// [`request`] (HTTPS needs [`request_tls`]).
    Address {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The host of `addr` could not be resolved.
    Resolve {
        /// The address as given.
        addr: String,
        /// The resolver's error.
        source: io::Error,
    },
    /// No connection could be made (refused, unreachable, timed out).
    Connect {
        /// The address as given.
        addr: String,
        /// The connect error.
        source: io::Error,
    },
    /// The connection failed once made: setting its timeouts (`op`
    /// "socket"), sending the request ("send") or reading the answer
    /// ("read"; a failed TLS handshake or a timeout shows here).
    Io {
        /// The address as given.
        addr: String,
        /// What was being done.
        op: &'static str,
        /// The error.
        source: io::Error,
    },
    /// A TLS session could not be set up for `addr` (its host is no name a
    /// certificate can be checked against).
    Tls {
        /// The address as given.
        addr: String,
        /// Why not.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The answer is no HTTP/1.1 response this reader takes: not HTTP, not
    /// UTF-8, or over [`MAX_RESPONSE_BYTES`].
    Response {
        /// The address as given.
        addr: String,
        /// What is wrong with the answer.
        reason: String,
    },
    /// The port answered with a status the caller did not expect, such as
    /// 404 for a key that is not registered or 503 from a node that is not
    /// ready.
    Status {
        /// The address as given.
        addr: String,
        /// The request target.
        target: String,
        /// The HTTP status.
        status: u16,
        /// The body, which says why.
        body: String,
    },
    /// The body is not JSON, or is nested deeper than 32.
    MalformedJson {
        /// What the JSON reader found.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl fmt::Display for AdminError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdminError::Address { addr, reason } => write!(f, "{addr}: {reason}"),
            AdminError::Resolve { addr, source } => write!(f, "{addr}: bad address: {source}"),
            AdminError::Connect { addr, source } => write!(f, "{addr}: connect: {source}"),
            AdminError::Io { addr, op, source } => write!(f, "{addr}: {op}: {source}"),
            AdminError::Tls { addr, source } => write!(f, "{addr}: TLS: {source}"),
            AdminError::Response { addr, reason } => write!(f, "{addr}: {reason}"),
            AdminError::Status {
                addr,
                target,
                status,
                body,
            } => write!(f, "{addr}{target}: {status} {}", body.trim()),
            AdminError::MalformedJson { source } => write!(f, "bad JSON: {source}"),
        }
    }
}

impl std::error::Error for AdminError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AdminError::Resolve { source, .. }
            | AdminError::Connect { source, .. }
            | AdminError::Io { source, .. } => Some(source),
            AdminError::Tls { source, .. } | AdminError::MalformedJson { source } => {
                Some(source.as_ref())
            }
            AdminError::Address { .. }
            | AdminError::Response { .. }
            | AdminError::Status { .. } => None,
        }
    }
}

/// `GET target` from the admin port at `addr` (`host:port`, or
/// `unix:/path` for `--admin-listen unix:/path`): the status and the body.
///
/// # Errors
/// The port cannot be reached within `timeout`, or the answer is not an
/// HTTP response.
pub fn get(addr: &str, target: &str, timeout: Duration) -> Result<(u16, String), AdminError> {
    request(addr, "GET", target, timeout)
}

/// `GET target` from the admin port at `addr`, as [`get`], and its body
/// read as JSON: `/v1/locks/KEY`, `/v1/locks?prefix=...`, `/v1/cluster`.
///
/// # Errors
/// As [`get`]; [`AdminError::Status`] for any status but 200 (404: no such
/// key, or not a cluster node), [`AdminError::MalformedJson`] for a body
/// that is not JSON.
pub fn get_json(addr: &str, target: &str, timeout: Duration) -> Result<Json, AdminError> {
    match get(addr, target, timeout)? {
        (200, body) => Json::parse(&body),
        (status, body) => Err(AdminError::Status {
            addr: addr.to_owned(),
            target: target.to_owned(),
            status,
            body,
        }),
    }
}

/// `METHOD target` (no body) to the admin port at `addr`: the status and
/// the body. `POST` and `DELETE` change a cluster's members.
///
/// # Errors
/// As [`get`].
pub fn request(
    addr: &str,
    method: &str,
    target: &str,
    timeout: Duration,
) -> Result<(u16, String), AdminError> {
    if addr.starts_with("https://") {
        return Err(AdminError::Address {
            addr: addr.to_owned(),
            reason: "HTTPS needs the CA to trust: use request_tls (ticket: --tls-ca)",
        });
    }
    if let Some(path) = addr.strip_prefix("unix:") {
        if path.is_empty() {
            return Err(AdminError::Address {
                addr: addr.to_owned(),
                reason: "needs a path (unix:/PATH)",
            });
        }
        // A local connect does not wait for a network: no connect timeout.
        let s = UnixStream::connect(path).map_err(|e| connect_error(addr, e))?;
        s.set_read_timeout(Some(timeout))
            .and_then(|()| s.set_write_timeout(Some(timeout)))
            .map_err(|e| io_error(addr, "socket", e))?;
        return exchange(s, addr, "localhost", method, target);
    }
    let s = connect_tcp(addr, addr, timeout)?;
    exchange(s, addr, addr, method, target)
}

/// `METHOD target` to an HTTPS admin port (`ticketd --admin-tls-cert`)
/// at `addr` (`https://host:port` or `host:port`), trusting servers with
/// `config` (see [`crate::tls::client_config`]; a client certificate in
/// it is presented when the port asks for one); the certificate must name
/// the host part of `addr`.
///
/// # Errors
/// As [`get`], and a failed handshake (an untrusted certificate, a client
/// certificate the port refuses).
#[cfg(feature = "tls")]
pub fn request_tls(
    addr: &str,
    config: &std::sync::Arc<rustls::ClientConfig>,
    method: &str,
    target: &str,
    timeout: Duration,
) -> Result<(u16, String), AdminError> {
    let hostport = addr.strip_prefix("https://").unwrap_or(addr);
    let tls_error = |e: Box<dyn std::error::Error + Send + Sync>| AdminError::Tls {
        addr: addr.to_owned(),
        source: e,
    };
    let name = super::tls::name_of(hostport).map_err(|e| tls_error(Box::new(e)))?;
    let s = connect_tcp(addr, hostport, timeout)?;
    let session = rustls::ClientConnection::new(std::sync::Arc::clone(config), name)
        .map_err(|e| tls_error(Box::new(e)))?;
    exchange(
        rustls::StreamOwned::new(session, s),
        addr,
        hostport,
        method,
        target,
    )
}

fn connect_error(addr: &str, source: io::Error) -> AdminError {
    AdminError::Connect {
        addr: addr.to_owned(),
        source,
    }
}

fn io_error(addr: &str, op: &'static str, source: io::Error) -> AdminError {
    AdminError::Io {
        addr: addr.to_owned(),
        op,
        source,
    }
}

/// A TCP connection to `hostport` (`addr` as given, for errors), with
/// `timeout` on the connect and on every read and write.
fn connect_tcp(addr: &str, hostport: &str, timeout: Duration) -> Result<TcpStream, AdminError> {
    let sock = hostport
        .to_socket_addrs()
        .map_err(|source| AdminError::Resolve {
            addr: addr.to_owned(),
            source,
        })?
        .next()
        .ok_or_else(|| AdminError::Address {
            addr: addr.to_owned(),
            reason: "no address",
        })?;
    let s = TcpStream::connect_timeout(&sock, timeout).map_err(|e| connect_error(addr, e))?;
    s.set_read_timeout(Some(timeout))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|e| io_error(addr, "socket", e))?;
    Ok(s)
}

/// One request on a connected stream, and the response read to its end.
fn exchange(
    mut s: impl Read + Write,
    addr: &str,
    host: &str,
    method: &str,
    target: &str,
) -> Result<(u16, String), AdminError> {
    write!(
        s,
        "{method} {target} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: \
         close\r\n\r\n"
    )
    .map_err(|e| io_error(addr, "send", e))?;
    let mut raw = Vec::new();
    s.take(MAX_RESPONSE_BYTES as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(|e| io_error(addr, "read", e))?;
    let bad = |reason: String| AdminError::Response {
        addr: addr.to_owned(),
        reason,
    };
    if raw.len() > MAX_RESPONSE_BYTES {
        return Err(bad(format!("response over {MAX_RESPONSE_BYTES} bytes")));
    }
    let text = String::from_utf8(raw).map_err(|_| bad("not UTF-8".into()))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| bad("not an HTTP response".into()))?;
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad("not an HTTP/1.1 response".into()))?;
    Ok((status, body.to_owned()))
}

/// `s` with every byte outside the unreserved set percent-encoded, for a
/// key or a query value in a request target.
#[must_use]
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A JSON value.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    /// `null`
    Null,
    /// `true` / `false`
    Bool(bool),
    /// A non-negative integer written without fraction or exponent, read
    /// exactly (a fencing token uses all 64 bits).
    Int(u64),
    /// Any other number.
    Num(f64),
    /// A string.
    Str(String),
    /// An array.
    Arr(Vec<Json>),
    /// An object.
    Obj(BTreeMap<String, Json>),
}

impl Json {
    /// Parses JSON text.
    ///
    /// # Errors
    /// [`AdminError::MalformedJson`]: not JSON, or nested deeper than 32.
    pub fn parse(text: &str) -> Result<Json, AdminError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| AdminError::MalformedJson {
                source: Box::new(e),
            })?;
        Json::from_value(value, 0)
    }

    /// `v` as a [`Json`], nested at `depth`.
    fn from_value(v: serde_json::Value, depth: usize) -> Result<Json, AdminError> {
        use serde_json::Value;
        if depth > MAX_DEPTH {
            return Err(AdminError::MalformedJson {
                source: format!("nested deeper than {MAX_DEPTH}").into(),
            });
        }
        Ok(match v {
            Value::Null => Json::Null,
            Value::Bool(b) => Json::Bool(b),
            // serde_json keeps a non-negative integer as a u64, exactly.
            Value::Number(n) => match n.as_u64() {
                Some(u) => Json::Int(u),
                None => Json::Num(n.as_f64().unwrap_or(f64::NAN)),
            },
            Value::String(s) => Json::Str(s),
            Value::Array(a) => Json::Arr(
                a.into_iter()
                    .map(|x| Json::from_value(x, depth + 1))
                    .collect::<Result<_, _>>()?,
            ),
            Value::Object(m) => Json::Obj(
                m.into_iter()
                    .map(|(k, x)| Ok((k, Json::from_value(x, depth + 1)?)))
                    .collect::<Result<_, AdminError>>()?,
            ),
        })
    }

    /// `self` as serde_json's value, to be written out.
    fn to_value(&self) -> serde_json::Value {
        use serde_json::Value;
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Int(n) => Value::from(*n),
            // A whole number reads back as the integer it is; NaN and the
            // infinities, which JSON cannot write, as null.
            Json::Num(n) => match self.as_u64() {
                Some(u) => Value::from(u),
                None => serde_json::Number::from_f64(*n).map_or(Value::Null, Value::Number),
            },
            Json::Str(s) => Value::String(s.clone()),
            Json::Arr(a) => Value::Array(a.iter().map(Json::to_value).collect()),
            Json::Obj(m) => {
                Value::Object(m.iter().map(|(k, x)| (k.clone(), x.to_value())).collect())
            }
        }
    }

    /// The member `name` of an object.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&Json> {
        match self {
            Json::Obj(m) => m.get(name),
            _ => None,
        }
    }

    /// A non-negative integer.
    #[must_use]
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Json::Int(n) => Some(n),
            // Exact below 2^53.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            Json::Num(n) if n >= 0.0 && n.fract() == 0.0 && n < 9_007_199_254_740_992.0 => {
                Some(n as u64)
            }
            _ => None,
        }
    }

    /// A string.
    #[must_use]
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The elements of an array (none for anything else).
    #[must_use]
    pub fn items(&self) -> &[Json] {
        match self {
            Json::Arr(v) => v,
            _ => &[],
        }
    }
}

/// Compact JSON text (no spaces), object members in key order.
impl fmt::Display for Json {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_value().to_string())
    }
}

/// Lines of `rows` with each column padded to its widest cell (the last
/// column unpadded), columns two spaces apart.
#[must_use]
pub fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c + 1 == r.len() {
                line.push_str(cell);
            } else {
                line.push_str(cell);
                let pad = widths[c] - cell.chars().count() + 2;
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_values_parse_and_bad_text_is_an_error() {
        let v = Json::parse(r#"{"a":[1,2.5,-3e2],"b":"x\"\u00e9\ud83d\ude00","c":null,"d":true}"#)
            .unwrap();
        assert_eq!(v.get("a").unwrap().items().len(), 3);
        assert_eq!(v.get("a").unwrap().items()[0].as_u64(), Some(1));
        assert_eq!(v.get("b").unwrap().as_str(), Some("x\"\u{e9}\u{1f600}"));
        assert_eq!(v.get("c"), Some(&Json::Null));
        // A token near 2^64 is read exactly, not through an f64.
        let t = Json::parse("18446744073709551557").expect("parses");
        assert_eq!(t.as_u64(), Some(18_446_744_073_709_551_557));
        assert_eq!(Json::parse("2.5").expect("parses").as_u64(), None);
        for bad in [
            "",
            "{",
            "[1,]",
            "{\"a\" 1}",
            "\"\\x\"",
            "\"\\ud800\"",
            "nul",
            "1 2",
            "\"a\nb\"",
        ] {
            assert!(Json::parse(bad).is_err(), "{bad:?}");
        }
        let deep = "[".repeat(100) + &"]".repeat(100);
        assert!(Json::parse(&deep).is_err());
    }

    #[test]
    fn malformed_json_is_its_own_error_with_a_source() {
        use std::error::Error as _;
        for bad in ["{", "01", "[1,]", &("[".repeat(40) + &"]".repeat(40))] {
            let e = Json::parse(bad).expect_err(bad);
            assert!(
                matches!(e, AdminError::MalformedJson { .. }),
                "{bad:?}: {e:?}"
            );
            assert!(e.source().is_some(), "{bad:?}");
            assert!(e.to_string().starts_with("bad JSON: "), "{e}");
        }
        let deep = "[".repeat(40) + &"]".repeat(40);
        let e = Json::parse(&deep).expect_err("too deep");
        assert_eq!(e.to_string(), "bad JSON: nested deeper than 32");
        // 33 levels (depths 0 to 32) are still taken.
        assert!(Json::parse(&("[".repeat(33) + &"]".repeat(33))).is_ok());
    }

    #[test]
    fn json_is_written_back_compact_in_key_order_and_exact() {
        let text = r#"{ "b": [1, 2.5, -3e2, 1e2], "a": "x\"\u0001/é", "t": 18446744073709551557,
            "n": null, "y": true }"#;
        let v = Json::parse(text).expect("parses");
        assert_eq!(
            v.to_string(),
            r#"{"a":"x\"\u0001/é","b":[1,2.5,-300.0,100],"n":null,"t":18446744073709551557,"y":true}"#
        );
        let again = Json::parse(&v.to_string()).expect("reads back");
        assert_eq!(again.to_string(), v.to_string());
        assert_eq!(again.get("t"), v.get("t"));
        assert_eq!(Json::Num(f64::NAN).to_string(), "null");
    }

    /// A one-shot server on a free loopback port that answers `answer` to
    /// whatever it is sent.
    fn answering(answer: &'static str) -> (String, std::thread::JoinHandle<()>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            let _ = s.write_all(answer.as_bytes());
        });
        (addr, t)
    }

    #[test]
    fn each_failure_of_a_request_has_its_variant() {
        use std::error::Error as _;
        let t = Duration::from_secs(5);
        let (addr, server) = answering("HTTP/1.1 503 Service Unavailable\r\n\r\nnot ready\n");
        match get_json(&addr, "/readyz", t) {
            Err(AdminError::Status {
                status: 503,
                ref body,
                ref target,
                ..
            }) if body == "not ready\n" && target == "/readyz" => {}
            other => panic!("{other:?}"),
        }
        server.join().unwrap();
        let (addr, server) = answering("HTTP/1.1 200 OK\r\n\r\n{\"locks\":");
        let e = get_json(&addr, "/v1/locks", t).expect_err("truncated JSON");
        assert!(matches!(e, AdminError::MalformedJson { .. }), "{e:?}");
        server.join().unwrap();
        let (addr, server) = answering("SSH-2.0-OpenSSH\r\n");
        let e = get(&addr, "/", t).expect_err("not HTTP");
        assert_eq!(e.to_string(), format!("{addr}: not an HTTP response"));
        assert!(matches!(e, AdminError::Response { .. }) && e.source().is_none());
        server.join().unwrap();

        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").to_string()
        };
        match get(&closed, "/", t) {
            Err(e @ AdminError::Connect { .. }) => {
                let io = e.source().and_then(|s| s.downcast_ref::<io::Error>());
                assert_eq!(
                    io.map(io::Error::kind),
                    Some(io::ErrorKind::ConnectionRefused)
                );
                assert!(
                    e.to_string().starts_with(&format!("{closed}: connect: ")),
                    "{e}"
                );
            }
            other => panic!("{other:?}"),
        }
        for addr in ["unix:", "https://127.0.0.1:1"] {
            let e = get(addr, "/", t).expect_err(addr);
            assert!(matches!(e, AdminError::Address { .. }), "{addr}: {e:?}");
        }
        let e = get("no-port-here", "/", t).expect_err("no port");
        assert!(
            matches!(e, AdminError::Resolve { .. }) && e.source().is_some(),
            "{e:?}"
        );
    }

    #[test]
    fn keys_are_percent_encoded_outside_the_unreserved_set() {
        assert_eq!(percent_encode("db/1 é"), "db%2F1%20%C3%A9");
        assert_eq!(percent_encode("a-b_c.d~"), "a-b_c.d~");
    }

    #[test]
    fn tables_align_columns() {
        let t = table(&[
            vec!["KEY".into(), "TOKEN".into()],
            vec!["long-key".into(), "1".into()],
        ]);
        assert_eq!(t, "KEY       TOKEN\nlong-key  1\n");
    }
}

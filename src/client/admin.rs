//! A blocking reader of the admin port (`ticketd --admin-listen`): one
//! HTTP/1.1 `GET` per call, and a small JSON reader for what the port
//! answers. `ticket status`, `ticket locks` and `ticket cluster status`
//! are built on it.
//!
//! The JSON reader takes any JSON text (objects, arrays, strings with
//! escapes, numbers, booleans, null), bounded in nesting depth and by the
//! size of the response, which is itself bounded ([`MAX_RESPONSE_BYTES`]).

use std::collections::BTreeMap;
use std::fmt;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// The largest response read: a page of 1,000 locks with the longest keys.
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;
/// Deepest JSON nesting accepted.
const MAX_DEPTH: usize = 32;

/// Why an admin request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdminError(pub String);

impl fmt::Display for AdminError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AdminError {}

/// `GET target` from the admin port at `addr` (`host:port`, or
/// `unix:/path` for `--admin-listen unix:/path`): the status and the body.
///
/// # Errors
/// The port cannot be reached within `timeout`, or the answer is not an
/// HTTP response.
pub fn get(addr: &str, target: &str, timeout: Duration) -> Result<(u16, String), AdminError> {
    request(addr, "GET", target, timeout)
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
    let fail = |what: &str, e: &dyn fmt::Display| AdminError(format!("{addr}: {what}: {e}"));
    if addr.starts_with("https://") {
        return Err(AdminError(format!(
            "{addr}: HTTPS needs the CA to trust: use request_tls (ticket: --tls-ca)"
        )));
    }
    if let Some(path) = addr.strip_prefix("unix:") {
        if path.is_empty() {
            return Err(AdminError("unix: needs a path".into()));
        }
        // A local connect does not wait for a network: no connect timeout.
        let s = UnixStream::connect(path).map_err(|e| fail("connect", &e))?;
        s.set_read_timeout(Some(timeout))
            .and_then(|()| s.set_write_timeout(Some(timeout)))
            .map_err(|e| fail("socket", &e))?;
        return exchange(s, addr, "localhost", method, target);
    }
    let sock = addr
        .to_socket_addrs()
        .map_err(|e| fail("bad address", &e))?
        .next()
        .ok_or_else(|| AdminError(format!("{addr}: no address")))?;
    let s = TcpStream::connect_timeout(&sock, timeout).map_err(|e| fail("connect", &e))?;
    s.set_read_timeout(Some(timeout))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|e| fail("socket", &e))?;
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
    let fail = |what: &str, e: &dyn fmt::Display| AdminError(format!("{addr}: {what}: {e}"));
    let name = super::tls::name_of(hostport).map_err(|e| fail("TLS", &e))?;
    let sock = hostport
        .to_socket_addrs()
        .map_err(|e| fail("bad address", &e))?
        .next()
        .ok_or_else(|| AdminError(format!("{addr}: no address")))?;
    let s = TcpStream::connect_timeout(&sock, timeout).map_err(|e| fail("connect", &e))?;
    s.set_read_timeout(Some(timeout))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|e| fail("socket", &e))?;
    let session = rustls::ClientConnection::new(std::sync::Arc::clone(config), name)
        .map_err(|e| fail("TLS", &e))?;
    exchange(
        rustls::StreamOwned::new(session, s),
        addr,
        hostport,
        method,
        target,
    )
}

/// One request on a connected stream, and the response read to its end.
fn exchange(
    mut s: impl Read + Write,
    addr: &str,
    host: &str,
    method: &str,
    target: &str,
) -> Result<(u16, String), AdminError> {
    let fail = |what: &str, e: &dyn fmt::Display| AdminError(format!("{addr}: {what}: {e}"));
    write!(
        s,
        "{method} {target} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: \
         close\r\n\r\n"
    )
    .map_err(|e| fail("send", &e))?;
    let mut raw = Vec::new();
    s.take(MAX_RESPONSE_BYTES as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(|e| fail("read", &e))?;
    if raw.len() > MAX_RESPONSE_BYTES {
        return Err(AdminError(format!(
            "{addr}: response over {MAX_RESPONSE_BYTES} bytes"
        )));
    }
    let text = String::from_utf8(raw).map_err(|_| AdminError(format!("{addr}: not UTF-8")))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| AdminError(format!("{addr}: not an HTTP response")))?;
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| AdminError(format!("{addr}: not an HTTP/1.1 response")))?;
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
    /// Not JSON, or nested deeper than 32.
    pub fn parse(text: &str) -> Result<Json, AdminError> {
        let mut p = Parser {
            b: text.as_bytes(),
            i: 0,
        };
        let v = p.value(0)?;
        p.ws();
        if p.i != p.b.len() {
            return Err(p.err("trailing characters"));
        }
        Ok(v)
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

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn err(&self, what: &str) -> AdminError {
        AdminError(format!("bad JSON at byte {}: {what}", self.i))
    }

    fn ws(&mut self) {
        while self.i < self.b.len() && matches!(self.b[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.b[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }

    // Long because it is the JSON grammar, one arm per kind of value.
    fn value(&mut self, depth: usize) -> Result<Json, AdminError> {
        if depth > MAX_DEPTH {
            return Err(self.err("nested too deep"));
        }
        self.ws();
        match self.b.get(self.i) {
            None => Err(self.err("unexpected end")),
            Some(b'{') => {
                self.i += 1;
                let mut m = BTreeMap::new();
                self.ws();
                if self.eat("}") {
                    return Ok(Json::Obj(m));
                }
                loop {
                    self.ws();
                    let k = self.string()?;
                    self.ws();
                    if !self.eat(":") {
                        return Err(self.err("expected ':'"));
                    }
                    let v = self.value(depth + 1)?;
                    m.insert(k, v);
                    self.ws();
                    if self.eat("}") {
                        return Ok(Json::Obj(m));
                    }
                    if !self.eat(",") {
                        return Err(self.err("expected ',' or '}'"));
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut v = Vec::new();
                self.ws();
                if self.eat("]") {
                    return Ok(Json::Arr(v));
                }
                loop {
                    v.push(self.value(depth + 1)?);
                    self.ws();
                    if self.eat("]") {
                        return Ok(Json::Arr(v));
                    }
                    if !self.eat(",") {
                        return Err(self.err("expected ',' or ']'"));
                    }
                }
            }
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(b't') if self.eat("true") => Ok(Json::Bool(true)),
            Some(b'f') if self.eat("false") => Ok(Json::Bool(false)),
            Some(b'n') if self.eat("null") => Ok(Json::Null),
            Some(b'-' | b'0'..=b'9') => {
                let start = self.i;
                while self.i < self.b.len()
                    && matches!(
                        self.b[self.i],
                        b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'
                    )
                {
                    self.i += 1;
                }
                let text = std::str::from_utf8(&self.b[start..self.i]).ok();
                if let Some(n) = text
                    .filter(|t| t.bytes().all(|c| c.is_ascii_digit()))
                    .and_then(|t| t.parse::<u64>().ok())
                {
                    return Ok(Json::Int(n));
                }
                text.and_then(|s| s.parse().ok())
                    .map(Json::Num)
                    .ok_or_else(|| self.err("bad number"))
            }
            Some(_) => Err(self.err("unexpected character")),
        }
    }

    fn hex4(&mut self) -> Result<u32, AdminError> {
        let h = self
            .b
            .get(self.i..self.i + 4)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .ok_or_else(|| self.err("bad \\u escape"))?;
        self.i += 4;
        Ok(h)
    }

    fn string(&mut self) -> Result<String, AdminError> {
        if !self.eat("\"") {
            return Err(self.err("expected a string"));
        }
        let mut out = Vec::new();
        loop {
            let Some(&c) = self.b.get(self.i) else {
                return Err(self.err("unterminated string"));
            };
            self.i += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let Some(&e) = self.b.get(self.i) else {
                        return Err(self.err("unterminated escape"));
                    };
                    self.i += 1;
                    let ch = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let code = if (0xD800..0xDC00).contains(&hi) {
                                if !self.eat("\\u") {
                                    return Err(self.err("lone surrogate"));
                                }
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return Err(self.err("bad surrogate pair"));
                                }
                                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                            } else {
                                hi
                            };
                            char::from_u32(code).ok_or_else(|| self.err("bad code point"))?
                        }
                        _ => return Err(self.err("bad escape")),
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
                c if c < 0x20 => return Err(self.err("control character in a string")),
                c => out.push(c),
            }
        }
        String::from_utf8(out).map_err(|_| self.err("not UTF-8"))
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

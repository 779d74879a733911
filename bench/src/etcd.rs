//! etcd as a lock service, through its v3 HTTP/JSON gateway: the baseline a
//! replicated ticketd is compared with.
//!
//! etcd's lock API ties every lock to a *lease* (a session): `POST
//! /v3/lock/lock {"name", "lease"}` blocks until the lock is held and returns
//! the lock's own key (`name/<lease in hex>`), and `POST /v3/lock/unlock
//! {"key"}` releases it. Each connection is one locker with its own lease,
//! granted before the run (`POST /v3/lease/grant`). Waiters queue inside
//! etcd in the order of their keys' revisions, so etcd also has a server-side
//! queue; a lock request has no wait limit.
//!
//! HTTP/1.1 is written and read by hand: requests with `Content-Length`,
//! responses with `Content-Length` (what etcd's gateway sends), one request
//! in flight per connection.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::backend::{Backend, Outcome};

/// Seconds each locker's lease lives: longer than any run, so a lease never
/// expires under a locker that is still working.
pub const LEASE_TTL_S: u64 = 600;
/// Largest HTTP response head or body accepted.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

/// Standard base64 with padding (etcd's JSON carries keys that way).
pub fn base64(input: &[u8], out: &mut Vec<u8>) {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(ABC[(n >> 18) as usize & 63]);
        out.push(ABC[(n >> 12) as usize & 63]);
        out.push(if chunk.len() > 1 {
            ABC[(n >> 6) as usize & 63]
        } else {
            b'='
        });
        out.push(if chunk.len() > 2 {
            ABC[n as usize & 63]
        } else {
            b'='
        });
    }
}

/// One complete HTTP response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response<'a> {
    /// The status code.
    pub status: u16,
    /// The body, borrowing the input.
    pub body: &'a [u8],
    /// Bytes the response took, head and body.
    pub used: usize,
}

/// One HTTP response from the front of `buf`: `Ok(None)` if incomplete.
pub fn parse_response(buf: &[u8]) -> Result<Option<Response<'_>>, String> {
    let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        if buf.len() > MAX_RESPONSE_BYTES {
            return Err("HTTP response head too long".into());
        }
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| "HTTP head is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad HTTP status line {status_line:?}"))?;
    let mut length = None;
    for l in lines {
        let Some((name, value)) = l.split_once(':') else {
            continue;
        };
        if name.eq_ignore_ascii_case("content-length") {
            length = value.trim().parse::<usize>().ok();
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err("chunked HTTP responses are not supported".into());
        }
    }
    let length = length.ok_or("HTTP response without Content-Length")?;
    if length > MAX_RESPONSE_BYTES {
        return Err(format!("HTTP body of {length} bytes"));
    }
    let body_start = head_end + 4;
    if buf.len() < body_start + length {
        return Ok(None);
    }
    Ok(Some(Response {
        status,
        body: &buf[body_start..body_start + length],
        used: body_start + length,
    }))
}

fn post(out: &mut Vec<u8>, path: &str, body: &[u8]) {
    out.extend_from_slice(b"POST ");
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(
        b" HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\nContent-Length: ",
    );
    out.extend_from_slice(body.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n\r\n");
    out.extend_from_slice(body);
}

/// The string value of `"field":"..."` in a flat JSON object.
fn json_str<'a>(body: &'a [u8], field: &str) -> Option<&'a str> {
    let body = std::str::from_utf8(body).ok()?;
    let pat = format!("\"{field}\":\"");
    let start = body.find(&pat)? + pat.len();
    let len = body[start..].find('"')?;
    Some(&body[start..start + len])
}

/// One blocking request on a fresh connection (lease grants, before a run).
fn call(addr: SocketAddr, path: &str, body: &[u8]) -> io::Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut req = Vec::new();
    post(&mut req, path, body);
    s.write_all(&req)?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "etcd closed the connection",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
        match parse_response(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))? {
            None => {}
            Some(Response {
                status: 200, body, ..
            }) => return Ok(body.to_vec()),
            Some(Response { status, body, .. }) => {
                return Err(io::Error::other(format!(
                    "etcd {path}: HTTP {status}: {}",
                    String::from_utf8_lossy(body)
                )))
            }
        }
    }
}

/// etcd locks, driven by the generator. Connection `i` is locker `i`.
#[derive(Clone, Debug)]
pub struct Etcd {
    leases: Vec<u64>,
}

impl Etcd {
    /// Grants one lease per locker at `addr`.
    pub fn new(addr: SocketAddr, lockers: usize) -> io::Result<Etcd> {
        let mut leases = Vec::with_capacity(lockers);
        for _ in 0..lockers {
            let body = call(
                addr,
                "/v3/lease/grant",
                format!("{{\"TTL\":{LEASE_TTL_S}}}").as_bytes(),
            )?;
            let id = json_str(&body, "ID")
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("no lease ID in {}", String::from_utf8_lossy(&body)),
                    )
                })?;
            leases.push(id);
        }
        Ok(Etcd { leases })
    }

    /// A backend with known leases (tests).
    #[must_use]
    pub fn with_leases(leases: Vec<u64>) -> Etcd {
        Etcd { leases }
    }

    fn lease_of(&self, owner: u64) -> u64 {
        // The generator puts the connection number in the owner's top bits.
        let conn = (owner >> 40) as usize;
        self.leases.get(conn).copied().unwrap_or(0)
    }
}

impl Backend for Etcd {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn ordered_replies(&self) -> bool {
        true
    }

    fn queues_waiters(&self) -> bool {
        true
    }

    fn encode_acquire(&self, out: &mut Vec<u8>, key: &str, owner: u64, _wait_s: u8, _lease_s: u8) {
        let mut body = b"{\"name\":\"".to_vec();
        base64(key.as_bytes(), &mut body);
        body.extend_from_slice(format!("\",\"lease\":\"{}\"}}", self.lease_of(owner)).as_bytes());
        post(out, "/v3/lock/lock", &body);
    }

    fn encode_release(&self, out: &mut Vec<u8>, key: &str, token: u64) {
        // The lock's key is the name, a slash and the lease in hex.
        let lock_key = format!("{key}/{:x}", self.lease_of(token));
        let mut body = b"{\"key\":\"".to_vec();
        base64(lock_key.as_bytes(), &mut body);
        body.extend_from_slice(b"\"}");
        post(out, "/v3/lock/unlock", &body);
    }

    fn decode(&self, buf: &[u8]) -> Result<Option<(Outcome, usize)>, String> {
        let Some(Response { status, body, used }) = parse_response(buf)? else {
            return Ok(None);
        };
        if status != 200 {
            return Err(format!(
                "etcd: HTTP {status}: {}",
                String::from_utf8_lossy(body)
            ));
        }
        // A lock response names the lock's key; an unlock response does not.
        let o = if json_str(body, "key").is_some() {
            Outcome::Granted {
                token: None,
                owner: None,
            }
        } else {
            Outcome::Released { token: None }
        };
        Ok(Some((o, used)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        for (input, want) in [
            (&b""[..], &b""[..]),
            (b"f", b"Zg=="),
            (b"fo", b"Zm8="),
            (b"foo", b"Zm9v"),
            (
                b"mykey/1497a22b5175a507",
                b"bXlrZXkvMTQ5N2EyMmI1MTc1YTUwNw==",
            ),
        ] {
            let mut out = Vec::new();
            base64(input, &mut out);
            assert_eq!(out, want, "{input:?}");
        }
    }

    #[test]
    fn responses_parse_whole_and_wait_when_partial() {
        let lock = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 24\r\n\r\n{\"header\":{},\"key\":\"aw\"}";
        let unlock = b"HTTP/1.1 200 OK\r\ncontent-length: 13\r\n\r\n{\"header\":{}}";
        let mut stream = lock.to_vec();
        stream.extend_from_slice(unlock);
        let b = Etcd::with_leases(vec![0x1497]);
        let (o, used) = b.decode(&stream).unwrap().unwrap();
        assert_eq!(
            o,
            Outcome::Granted {
                token: None,
                owner: None
            }
        );
        assert_eq!(used, lock.len());
        assert_eq!(
            b.decode(&stream[used..]).unwrap(),
            Some((Outcome::Released { token: None }, unlock.len()))
        );
        for cut in 0..lock.len() {
            assert_eq!(b.decode(&lock[..cut]).unwrap(), None);
        }
        assert!(b
            .decode(b"HTTP/1.1 400 Bad\r\nContent-Length: 2\r\n\r\n{}")
            .is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
    }

    #[test]
    fn release_names_the_lock_key_of_the_connections_lease() {
        let b = Etcd::with_leases(vec![7, 0x1497_a22b_5175_a507]);
        let mut out = Vec::new();
        b.encode_release(&mut out, "mykey", 1 << 40 | 5);
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("POST /v3/lock/unlock HTTP/1.1\r\n"));
        assert!(text.ends_with("\r\n\r\n{\"key\":\"bXlrZXkvMTQ5N2EyMmI1MTc1YTUwNw==\"}"));
        let mut out = Vec::new();
        b.encode_acquire(&mut out, "k", 5, 0, 30);
        assert!(String::from_utf8(out)
            .unwrap()
            .ends_with("{\"name\":\"aw==\",\"lease\":\"7\"}"));
    }
}

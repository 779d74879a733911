//! Redis as a lock service, the way Redis users lock: `SET key owner NX PX
//! ms` to acquire, and the standard compare-and-delete Lua script, loaded
//! once with `SCRIPT LOAD` and run with `EVALSHA`, to release.
//!
//! RESP (the Redis protocol) is written and read by hand here: the generator
//! needs five reply shapes, and a client library would bring its own I/O.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::backend::{Backend, Outcome};

/// Deletes the key only if it still holds our owner value: the release every
/// Redis locking guide prescribes, so a late release never frees a lock that
/// expired and went to someone else.
pub const RELEASE_SCRIPT: &str = "if redis.call(\"get\",KEYS[1]) == ARGV[1] then return redis.call(\"del\",KEYS[1]) else return 0 end";

/// Longest line (simple string, error, integer, length) accepted in a reply.
const MAX_LINE_BYTES: usize = 64 * 1024;
/// Largest bulk string accepted in a reply; lock replies are tiny.
const MAX_BULK_BYTES: usize = 1 << 20;
/// Deepest array nesting accepted.
const MAX_DEPTH: usize = 8;

/// One decoded RESP value, borrowing the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resp<'a> {
    /// `+text`
    Simple(&'a [u8]),
    /// `-text`
    Error(&'a [u8]),
    /// `:n`
    Int(i64),
    /// `$n` and `n` bytes, or `None` for the null bulk string `$-1`.
    Bulk(Option<&'a [u8]>),
    /// `*n` followed by `n` values (skipped), or `None` for `*-1`.
    Array(Option<usize>),
}

/// Appends a command as a RESP array of bulk strings.
pub fn encode_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.push(b'*');
    push_decimal(out, args.len() as u64);
    out.extend_from_slice(b"\r\n");
    for a in args {
        out.push(b'$');
        push_decimal(out, a.len() as u64);
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// The owner value stored in Redis: 16 lower-case hex digits.
#[must_use]
pub fn owner_hex(owner: u64) -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut b = [0u8; 16];
    for (i, d) in b.iter_mut().enumerate() {
        *d = HEX[((owner >> (60 - 4 * i)) & 0xf) as usize];
    }
    b
}

fn line(buf: &[u8], from: usize) -> Result<Option<(&[u8], usize)>, String> {
    let window = &buf[from..buf.len().min(from + MAX_LINE_BYTES + 2)];
    match window.windows(2).position(|w| w == b"\r\n") {
        Some(n) => Ok(Some((&window[..n], from + n + 2))),
        None if window.len() >= MAX_LINE_BYTES + 2 => Err("RESP line too long".into()),
        None => Ok(None),
    }
}

fn int(text: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| format!("bad RESP integer {:?}", String::from_utf8_lossy(text)))
}

fn parse_at(buf: &[u8], at: usize, depth: usize) -> Result<Option<(Resp<'_>, usize)>, String> {
    let Some(&kind) = buf.get(at) else {
        return Ok(None);
    };
    let Some((text, next)) = line(buf, at + 1)? else {
        return Ok(None);
    };
    match kind {
        b'+' => Ok(Some((Resp::Simple(text), next))),
        b'-' => Ok(Some((Resp::Error(text), next))),
        b':' => Ok(Some((Resp::Int(int(text)?), next))),
        b'$' => {
            let n = int(text)?;
            if n < 0 {
                return Ok(Some((Resp::Bulk(None), next)));
            }
            let n = usize::try_from(n).map_err(|_| "bad bulk length".to_string())?;
            if n > MAX_BULK_BYTES {
                return Err(format!("RESP bulk string of {n} bytes"));
            }
            if buf.len() < next + n + 2 {
                return Ok(None);
            }
            if &buf[next + n..next + n + 2] != b"\r\n" {
                return Err("RESP bulk string without CRLF".into());
            }
            Ok(Some((Resp::Bulk(Some(&buf[next..next + n])), next + n + 2)))
        }
        b'*' => {
            let n = int(text)?;
            if n < 0 {
                return Ok(Some((Resp::Array(None), next)));
            }
            if depth >= MAX_DEPTH {
                return Err("RESP arrays nested too deep".into());
            }
            let n = usize::try_from(n).map_err(|_| "bad array length".to_string())?;
            let mut pos = next;
            for _ in 0..n {
                match parse_at(buf, pos, depth + 1)? {
                    Some((_, p)) => pos = p,
                    None => return Ok(None),
                }
            }
            Ok(Some((Resp::Array(Some(n)), pos)))
        }
        other => Err(format!("bad RESP type byte 0x{other:02x}")),
    }
}

/// Decodes one RESP value from the front of `buf`: `Ok(None)` if more bytes
/// are needed, else the value and the bytes it used.
pub fn parse(buf: &[u8]) -> Result<Option<(Resp<'_>, usize)>, String> {
    parse_at(buf, 0, 0)
}

/// Redis locks, driven by the generator.
#[derive(Clone, Debug)]
pub struct Redis {
    sha: [u8; 40],
}

impl Redis {
    /// Loads [`RELEASE_SCRIPT`] into the server at `addr` and remembers its
    /// SHA for `EVALSHA`.
    ///
    /// # Errors
    /// The server cannot be reached or does not load the script.
    pub fn new(addr: SocketAddr, tls: Option<&crate::tls::Tls>) -> io::Result<Redis> {
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        match tls {
            Some(t) => Redis::load(crate::tls::blocking(s, addr, t)?),
            None => Redis::load(s),
        }
    }

    /// Like [`Redis::new`], over the Unix socket at `path`
    /// (`redis-server --unixsocket`).
    ///
    /// # Errors
    /// The socket cannot be reached or the server does not load the script.
    pub fn new_unix(path: &std::path::Path) -> io::Result<Redis> {
        let s = std::os::unix::net::UnixStream::connect(path)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        Redis::load(s)
    }

    fn load(mut s: impl Read + Write) -> io::Result<Redis> {
        let mut cmd = Vec::new();
        encode_command(&mut cmd, &[b"SCRIPT", b"LOAD", RELEASE_SCRIPT.as_bytes()]);
        s.write_all(&cmd)?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 512];
        loop {
            let n = s.read(&mut chunk)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "Redis closed the connection during SCRIPT LOAD",
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
            let parsed = parse(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            match parsed {
                None => continue,
                Some((Resp::Bulk(Some(sha)), _)) if sha.len() == 40 => {
                    let mut out = [0u8; 40];
                    out.copy_from_slice(sha);
                    return Ok(Redis { sha: out });
                }
                Some((other, _)) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("unexpected SCRIPT LOAD reply {other:?}"),
                    ))
                }
            }
        }
    }

    /// A backend with a known script SHA (tests).
    #[must_use]
    pub fn with_sha(sha: [u8; 40]) -> Redis {
        Redis { sha }
    }
}

impl Backend for Redis {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn ordered_replies(&self) -> bool {
        true
    }

    fn queues_waiters(&self) -> bool {
        false
    }

    fn encode_acquire(&self, out: &mut Vec<u8>, key: &str, owner: u64, _wait_s: u8, lease_s: u8) {
        let mut ms = Vec::with_capacity(8);
        push_decimal(&mut ms, u64::from(lease_s) * 1000);
        encode_command(
            out,
            &[b"SET", key.as_bytes(), &owner_hex(owner), b"NX", b"PX", &ms],
        );
    }

    fn encode_release(&self, out: &mut Vec<u8>, key: &str, token: u64) {
        encode_command(
            out,
            &[
                b"EVALSHA",
                &self.sha,
                b"1",
                key.as_bytes(),
                &owner_hex(token),
            ],
        );
    }

    fn decode(&self, buf: &[u8]) -> Result<Option<(Outcome, usize)>, String> {
        let Some((v, used)) = parse(buf)? else {
            return Ok(None);
        };
        let o = match v {
            Resp::Simple(b"OK") => Outcome::Granted {
                token: None,
                owner: None,
            },
            Resp::Bulk(None) => Outcome::NotGranted { owner: None },
            Resp::Int(1) => Outcome::Released { token: None },
            Resp::Int(0) => Outcome::NotReleased { token: None },
            Resp::Error(e) => return Err(format!("Redis error: {}", String::from_utf8_lossy(e))),
            other => return Err(format!("unexpected Redis reply {other:?}")),
        };
        Ok(Some((o, used)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_nx_px_is_a_resp_array_of_bulk_strings() {
        let b = Redis::with_sha([b'a'; 40]);
        let mut v = Vec::new();
        b.encode_acquire(&mut v, "k1", 0xff, 5, 30);
        assert_eq!(
            v,
            b"*6\r\n$3\r\nSET\r\n$2\r\nk1\r\n$16\r\n00000000000000ff\r\n$2\r\nNX\r\n$2\r\nPX\r\n$5\r\n30000\r\n"
        );
        v.clear();
        b.encode_release(&mut v, "k1", 0xff);
        let mut want = b"*5\r\n$7\r\nEVALSHA\r\n$40\r\n".to_vec();
        want.extend_from_slice(&[b'a'; 40]);
        want.extend_from_slice(b"\r\n$1\r\n1\r\n$2\r\nk1\r\n$16\r\n00000000000000ff\r\n");
        assert_eq!(v, want);
    }

    #[test]
    fn every_reply_shape_parses_and_partial_input_waits() {
        let stream = b"+OK\r\n$-1\r\n:1\r\n:0\r\n$3\r\nabc\r\n*2\r\n:5\r\n$1\r\nx\r\n-ERR no\r\n";
        let mut at = 0;
        let mut got = Vec::new();
        while at < stream.len() {
            // Every strict prefix of the next value is incomplete, never an error.
            let (v, used) = parse(&stream[at..]).unwrap().unwrap();
            for cut in 0..used {
                assert_eq!(parse(&stream[at..at + cut]).unwrap(), None, "cut {cut}");
            }
            got.push(v);
            at += used;
        }
        assert_eq!(
            got,
            vec![
                Resp::Simple(b"OK"),
                Resp::Bulk(None),
                Resp::Int(1),
                Resp::Int(0),
                Resp::Bulk(Some(b"abc")),
                Resp::Array(Some(2)),
                Resp::Error(b"ERR no"),
            ]
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(parse(b"?x\r\n").is_err());
        assert!(parse(b":abc\r\n").is_err());
        assert!(parse(b"$3\r\nabcd\r\n").is_err());
        assert!(parse(b"$99999999999\r\n").is_err());
        let deep = b"*1\r\n".repeat(20);
        assert!(parse(&deep).is_err());
    }

    #[test]
    fn redis_replies_map_to_outcomes() {
        let b = Redis::with_sha([b'0'; 40]);
        let cases: [(&[u8], Outcome); 4] = [
            (
                b"+OK\r\n",
                Outcome::Granted {
                    token: None,
                    owner: None,
                },
            ),
            (b"$-1\r\n", Outcome::NotGranted { owner: None }),
            (b":1\r\n", Outcome::Released { token: None }),
            (b":0\r\n", Outcome::NotReleased { token: None }),
        ];
        for (bytes, want) in cases {
            assert_eq!(b.decode(bytes).unwrap(), Some((want, bytes.len())));
        }
        assert!(b.decode(b"-NOSCRIPT x\r\n").is_err());
        assert_eq!(owner_hex(0x0123_4567_89ab_cdef), *b"0123456789abcdef");
    }
}

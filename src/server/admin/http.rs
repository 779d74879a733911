//! The admin port's HTTP/1.1 exchange: the request head read and parsed
//! (with `httparse`), the response written, one `write` per turn.

use std::io::{self, Read, Write};

use crate::time::Millis;

use super::routes::route;
use super::{AdminConn, State, View, MAX_REQUEST_BYTES};

/// Reads of one connection per turn.
const READS_PER_TURN: usize = 4;
/// The most headers a request may have.
const MAX_HEADERS: usize = 32;

/// Reads what has arrived and, once the head is complete, routes it.
pub(super) fn read_request(c: &mut AdminConn, now: Millis, view: &View<'_>) {
    let mut chunk = [0u8; 2048];
    let mut eof = false;
    for _ in 0..READS_PER_TURN {
        let room = MAX_REQUEST_BYTES + 1 - c.rbuf.len();
        let want = room.min(chunk.len());
        match c.stream.read(&mut chunk[..want]) {
            Ok(0) => {
                // The peer shut its side: what it sent is all there is.
                eof = true;
                c.readable = false;
                break;
            }
            Ok(n) => {
                c.rbuf.extend_from_slice(&chunk[..n]);
                if c.rbuf.len() > MAX_REQUEST_BYTES {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                c.readable = false;
                break;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                c.done = true;
                return;
            }
        }
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(&c.rbuf) {
        Ok(httparse::Status::Complete(_)) => {
            let method = req.method.unwrap_or("");
            let path = req.path.unwrap_or("");
            let path = path.to_owned();
            let method = method.to_owned();
            route(c, now, &method, &path, view);
        }
        Ok(httparse::Status::Partial) if c.rbuf.len() > MAX_REQUEST_BYTES => {
            respond(
                c,
                431,
                "text/plain",
                &format!("request head over {MAX_REQUEST_BYTES} bytes\n"),
            );
        }
        // Closed before the head was complete: nobody to answer.
        Ok(httparse::Status::Partial) if eof => c.done = true,
        Ok(httparse::Status::Partial) => {}
        Err(httparse::Error::TooManyHeaders) => {
            respond(
                c,
                431,
                "text/plain",
                &format!("more than {MAX_HEADERS} headers\n"),
            );
        }
        Err(e) => respond(c, 400, "text/plain", &format!("bad request: {e}\n")),
    }
}

pub(super) fn respond(c: &mut AdminConn, status: u16, content_type: &str, body: &str) {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        421 => "Misdirected Request",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    c.wbuf.clear();
    let _ = write!(
        c.wbuf,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nConnection: close\r\n",
        body.len()
    );
    if status == 405 {
        c.wbuf.extend_from_slice(b"Allow: GET\r\n");
    }
    c.wbuf.extend_from_slice(b"\r\n");
    c.wbuf.extend_from_slice(body.as_bytes());
    c.cursor = 0;
    c.writable = true;
    c.state = State::Writing;
}

/// One `write`; the connection is done once everything is sent.
pub(super) fn write_some(c: &mut AdminConn) {
    if !c.writable {
        return;
    }
    // With TLS, the session may hold records after the last byte is
    // taken: an empty write sends them, and the exchange ends when none is
    // left (`buffered() == 0`).
    match c.stream.write(&c.wbuf[c.cursor..]) {
        Ok(n) => {
            c.cursor += n;
            if c.cursor >= c.wbuf.len() && c.stream.buffered() == 0 {
                let _ = c.stream.shutdown_write();
                c.done = true;
            }
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => c.writable = false,
        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
        Err(_) => c.done = true,
    }
}

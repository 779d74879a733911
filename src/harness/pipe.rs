//! An in-memory connection: two bounded byte queues, one each way, shared
//! by the server's end ([`ServerEnd`], what a connection of the server reads
//! and writes instead of a socket) and the test's end ([`MemConn`]).
//!
//! It behaves as a non-blocking socket does where the server can tell:
//! a read of an empty queue is `WouldBlock`, a read after the peer shut its
//! side is `Ok(0)` once the queue is empty, a write to a full queue is
//! `WouldBlock`, a write short of room is a short write, and a write to a
//! peer that has gone is `BrokenPipe`. Readiness comes as edges, as from
//! edge-triggered epoll: bytes (or a close) arriving raise the server's read
//! edge, room made by the test's reads raises its write edge; the harness
//! takes them before each turn.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

/// One direction of the pipe.
#[derive(Debug, Default)]
struct Queue {
    bytes: VecDeque<u8>,
    /// The writing side shut down (or went away): EOF once drained.
    shut: bool,
}

#[derive(Debug)]
struct Shared {
    to_server: Queue,
    to_client: Queue,
    /// Bytes each queue holds at most (the socket buffer of a pipe).
    capacity: usize,
    /// The test's end is gone: the server's writes fail.
    client_gone: bool,
    /// The server's end is gone (the connection was closed and reaped).
    server_gone: bool,
    /// Something for the server to read arrived since the last turn.
    read_edge: bool,
    /// Room for the server to write was made since the last turn.
    write_edge: bool,
}

/// A connected pair whose queues hold at most `capacity` bytes each way.
pub(crate) fn pair(capacity: usize) -> (ServerEnd, MemConn) {
    let shared = Arc::new(Mutex::new(Shared {
        to_server: Queue::default(),
        to_client: Queue::default(),
        capacity: capacity.max(1),
        client_gone: false,
        server_gone: false,
        read_edge: false,
        write_edge: false,
    }));
    (
        ServerEnd {
            shared: Arc::clone(&shared),
        },
        MemConn { shared },
    )
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // A panic while holding the lock cannot leave the queues half-updated in
    // a way that matters to a test that is failing anyway.
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The server's end of an in-memory connection.
#[derive(Debug)]
pub(crate) struct ServerEnd {
    shared: Arc<Mutex<Shared>>,
}

impl ServerEnd {
    pub(crate) fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut s = lock(&self.shared);
        if s.to_server.bytes.is_empty() {
            return if s.to_server.shut {
                Ok(0)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            };
        }
        let n = buf.len().min(s.to_server.bytes.len());
        for (dst, src) in buf.iter_mut().zip(s.to_server.bytes.drain(..n)) {
            *dst = src;
        }
        Ok(n)
    }

    pub(crate) fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut s = lock(&self.shared);
        if s.client_gone {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let room = s.capacity - s.to_client.bytes.len();
        if room == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = buf.len().min(room);
        s.to_client.bytes.extend(&buf[..n]);
        Ok(n)
    }

    pub(crate) fn shutdown_write(&mut self) {
        lock(&self.shared).to_client.shut = true;
    }

    /// The read and write edges raised since the last call, cleared.
    pub(crate) fn take_edges(&mut self) -> (bool, bool) {
        let mut s = lock(&self.shared);
        let edges = (s.read_edge, s.write_edge);
        s.read_edge = false;
        s.write_edge = false;
        edges
    }

    /// Edges are waiting for the next turn.
    pub(crate) fn has_edges(&self) -> bool {
        let s = lock(&self.shared);
        s.read_edge || s.write_edge
    }
}

impl Drop for ServerEnd {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        s.server_gone = true;
        s.to_client.shut = true;
        // What the test had sent and the server never read is lost, as the
        // receive queue of a closed socket is.
        s.to_server.bytes.clear();
    }
}

/// The test's end of an in-memory connection to a [`super::Harness`]: what a
/// client writes its requests into and reads its replies from. Nothing moves
/// until the harness steps. Dropping it closes the connection (both ways).
#[derive(Debug)]
pub struct MemConn {
    shared: Arc<Mutex<Shared>>,
}

impl MemConn {
    /// Queues as much of `bytes` as there is room for (the pipe's capacity
    /// minus what the server has not read yet) and returns how much. Returns
    /// 0 once the server has closed the connection or this end shut its
    /// write side.
    pub fn write(&mut self, bytes: &[u8]) -> usize {
        let mut s = lock(&self.shared);
        if s.server_gone || s.to_server.shut {
            return 0;
        }
        let n = bytes.len().min(s.capacity - s.to_server.bytes.len());
        s.to_server.bytes.extend(&bytes[..n]);
        if n > 0 {
            s.read_edge = true;
        }
        n
    }

    /// Moves every byte the server has written so far onto the end of `into`;
    /// returns how many.
    pub fn read(&mut self, into: &mut Vec<u8>) -> usize {
        let mut s = lock(&self.shared);
        let n = s.to_client.bytes.len();
        into.extend(s.to_client.bytes.drain(..));
        if n > 0 {
            s.write_edge = true;
        }
        n
    }

    /// Everything the server has written so far, taken out of the pipe.
    #[must_use]
    pub fn take(&mut self) -> Vec<u8> {
        let mut v = Vec::new();
        self.read(&mut v);
        v
    }

    /// Bytes written by this end that the server has not read yet.
    #[must_use]
    pub fn unread_by_server(&self) -> usize {
        lock(&self.shared).to_server.bytes.len()
    }

    /// The server shut its side or closed the connection, and every byte it
    /// sent before that has been read: a socket would read EOF now.
    #[must_use]
    pub fn is_closed_by_server(&self) -> bool {
        let s = lock(&self.shared);
        s.to_client.shut && s.to_client.bytes.is_empty()
    }

    /// The server has closed the connection for good (reaped it).
    #[must_use]
    pub fn is_gone(&self) -> bool {
        lock(&self.shared).server_gone
    }

    /// Shuts this end's write side: the server reads EOF after what was
    /// sent, and can still write replies.
    pub fn shutdown_write(&mut self) {
        let mut s = lock(&self.shared);
        if !s.to_server.shut {
            s.to_server.shut = true;
            s.read_edge = true;
        }
    }
}

impl Drop for MemConn {
    fn drop(&mut self) {
        let mut s = lock(&self.shared);
        s.client_gone = true;
        s.to_server.shut = true;
        s.read_edge = true;
        s.write_edge = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_behave_as_a_non_blocking_socket() {
        let (mut server, mut client) = pair(4);
        let mut buf = [0u8; 8];
        let would_block = server.read(&mut buf).unwrap_err();
        assert_eq!(would_block.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(server.take_edges(), (false, false));
        assert_eq!(client.write(b"abcdef"), 4, "short of room: a short write");
        assert_eq!(server.take_edges(), (true, false), "a read edge");
        assert_eq!(server.read(&mut buf[..3]).unwrap(), 3);
        assert_eq!(server.read(&mut buf).unwrap(), 1);
        assert_eq!(server.write(b"0123456").unwrap(), 4);
        assert_eq!(
            server.write(b"x").unwrap_err().kind(),
            io::ErrorKind::WouldBlock,
            "full"
        );
        assert_eq!(client.take(), b"0123");
        assert_eq!(
            server.take_edges(),
            (false, true),
            "room made: a write edge"
        );
        client.shutdown_write();
        assert_eq!(server.read(&mut buf).unwrap(), 0, "EOF after a shutdown");
        assert!(!client.is_closed_by_server());
        server.shutdown_write();
        assert!(client.is_closed_by_server());
        drop(client);
        assert_eq!(
            server.write(b"x").unwrap_err().kind(),
            io::ErrorKind::BrokenPipe
        );
    }

    #[test]
    fn a_closed_server_end_reads_as_gone_and_takes_no_more_bytes() {
        let (server, mut client) = pair(16);
        drop(server);
        assert!(client.is_gone() && client.is_closed_by_server());
        assert_eq!(client.write(b"late"), 0);
    }
}

//! ticketd as a library: a server bound in-process, stepped turn by turn
//! with a hand-moved clock, a custom service, and a shutdown from another
//! thread.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use ticketd::config::Config;
use ticketd::engine::{ConnId, Outbox};
use ticketd::proto::{self, Decoded, Reply, Request};
use ticketd::server::{Server, Status};
use ticketd::service::Service;
use ticketd::single::SingleService;
use ticketd::time::Millis;

fn config() -> Config {
    Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..Config::default()
    }
}

struct Client {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    fn connect<S: Service>(server: &mut Server<S>) -> Client {
        let stream = TcpStream::connect(server.local_addr()).unwrap();
        stream.set_nonblocking(true).unwrap();
        server.poll_once(Some(Duration::from_millis(5))).unwrap();
        Client {
            stream,
            buf: Vec::new(),
        }
    }

    fn send(&mut self, req: Request<'_>) {
        let mut v = Vec::new();
        proto::encode_request(&req, &mut v);
        self.stream.write_all(&v).unwrap();
    }

    /// Steps the server up to `turns` times; the first reply that arrives,
    /// rendered as `(op, token_or_owner)`.
    fn step<S: Service>(&mut self, server: &mut Server<S>, turns: usize) -> Option<(char, u64)> {
        for _ in 0..turns {
            server.poll_once(Some(Duration::from_millis(2))).unwrap();
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
            if let Decoded::Frame { frame, used } = proto::decode_reply(&self.buf, 1024) {
                let r = match frame {
                    Reply::Acquired { token, .. } => ('A', token),
                    Reply::Timeout { owner, .. } => ('T', owner),
                    Reply::Busy { owner, .. } => ('B', owner),
                    Reply::Released { token, .. } => ('R', token),
                    Reply::NotReleased { token, .. } => ('N', token),
                    Reply::Extended { token, .. } => ('E', token),
                    Reply::NotExtended { token, .. } => ('X', token),
                    Reply::LimitMismatch { owner, .. } => ('L', owner),
                };
                self.buf.drain(..used);
                return Some(r);
            }
        }
        None
    }
}

fn acquire(owner: u64, wait_s: u8, lease_s: u8) -> Request<'static> {
    Request::Acquire {
        wait_s,
        lease_s,
        owner,
        key: "k",
    }
}

#[test]
fn a_lease_expires_when_the_manual_clock_says_so_and_not_before() {
    let service = SingleService::with_first_token(config().engine, 1);
    let mut server = Server::bind(config(), service).unwrap();
    let clock = server.use_manual_clock();
    let mut holder = Client::connect(&mut server);
    let mut waiter = Client::connect(&mut server);
    holder.send(acquire(1, 0, 5));
    let step = |r: Option<(char, u64)>| r.map(|(c, t)| (c, t >> ticketd::token::RANDOM_BITS));
    // Tokens: sequence steps 1 and 2, with random low bits.
    assert_eq!(step(holder.step(&mut server, 50)), Some(('A', 1)));
    waiter.send(acquire(2, 30, 5));
    assert_eq!(waiter.step(&mut server, 20), None, "queued");
    clock.advance_ms(5_000);
    assert_eq!(
        waiter.step(&mut server, 20),
        None,
        "at the expiry, not past it"
    );
    clock.advance_ms(1);
    assert_eq!(
        step(waiter.step(&mut server, 50)),
        Some(('A', 2)),
        "handed over once the expiry is past"
    );
    assert_eq!(server.service().engine().key_count(), 1);
}

/// Answers every request with Busy, and also sends a Busy to every
/// connection it has ever seen: a reply addressed to a closed connection
/// must never reach the connection that took its slot.
#[derive(Default)]
struct Haunted {
    seen: Vec<ConnId>,
}

impl Service for Haunted {
    fn request(&mut self, _now: Millis, conn: ConnId, req: Request<'_>, out: &mut Outbox) {
        if !self.seen.contains(&conn) {
            self.seen.push(conn);
        }
        for &c in &self.seen {
            out.push(
                c,
                Reply::Busy {
                    owner: c,
                    key: req.key(),
                },
                0,
            );
        }
    }
    fn disconnect(&mut self, _now: Millis, _conn: ConnId, _out: &mut Outbox) {}
    fn tick(&mut self, _now: Millis, _out: &mut Outbox) {}
    fn next_deadline(&self) -> Option<Millis> {
        None
    }
}

#[test]
fn a_reply_to_a_closed_connection_never_reaches_the_next_one_in_its_slot() {
    let mut server = Server::bind(config(), Haunted::default()).unwrap();
    let mut first = Client::connect(&mut server);
    first.send(acquire(1, 0, 5));
    let (op, first_id) = first.step(&mut server, 50).unwrap();
    assert_eq!(op, 'B');
    drop(first);
    for _ in 0..20 {
        server.poll_once(Some(Duration::from_millis(2))).unwrap();
    }
    assert_eq!(server.connection_count(), 0);
    let mut second = Client::connect(&mut server);
    second.send(acquire(2, 0, 5));
    let (op, second_id) = second.step(&mut server, 50).unwrap();
    assert_eq!(op, 'B');
    assert_ne!(second_id, first_id, "connection ids are never reused");
    assert_eq!(
        second.step(&mut server, 20),
        None,
        "the stale reply was dropped"
    );
    assert_eq!(server.service().seen.len(), 2);
}

#[test]
fn run_returns_after_a_shutdown_from_another_thread() {
    let service = SingleService::with_first_token(config().engine, 1);
    let mut server = Server::bind(config(), service).unwrap();
    let handle = server.shutdown_handle();
    let addr = server.local_addr();
    let t = std::thread::spawn(move || {
        let _c = TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        handle.shutdown();
    });
    server.run().unwrap();
    t.join().unwrap();
    assert_eq!(server.poll_once(None).unwrap(), Status::Stopped);
    assert_eq!(server.connection_count(), 0);
}

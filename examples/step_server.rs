//! Steps a ticketd server through a scenario turn by turn, inside one
//! thread, with a clock the program moves by hand: the shape of a
//! deterministic test of code that uses ticketd.
//!
//! A holder takes a lock with a 5 s lease and a second client queues for it.
//! The clock jumps 5,000 ms: the lease is not over yet (it ends one
//! millisecond past grant + lease), so the waiter still waits. One more
//! millisecond: on the next turn the lease expires and the waiter gets the
//! key with a new, higher fencing token. No sleeping, no threads.
//!
//! Run it with `cargo run --example step_server`.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use ticketd::config::Config;
use ticketd::proto::{self, Decoded, Reply, Request};
use ticketd::server::{Server, Status};
use ticketd::service::Service;
use ticketd::single::SingleService;

/// A non-blocking test client that keeps what it has read.
struct Client {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    fn send(&mut self, req: Request<'_>) -> io::Result<()> {
        let mut bytes = Vec::new();
        proto::encode_request(&req, &mut bytes);
        self.stream.write_all(&bytes)
    }

    /// One reply if a whole one has arrived, as text for printing.
    fn poll_reply(&mut self) -> io::Result<Option<String>> {
        let mut chunk = [0u8; 4096];
        match self.stream.read(&mut chunk) {
            Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        match proto::decode_reply(&self.buf, 1024) {
            Decoded::Frame { frame, used } => {
                let text = describe(&frame);
                self.buf.drain(..used);
                Ok(Some(text))
            }
            Decoded::Incomplete => Ok(None),
            Decoded::Malformed(m) => Err(io::Error::new(ErrorKind::InvalidData, m)),
        }
    }
}

fn describe(r: &Reply<'_>) -> String {
    match r {
        Reply::Acquired { token, owner, key } => format!("A token={token} owner={owner} {key}"),
        Reply::Timeout { owner, key } => format!("T owner={owner} {key}"),
        Reply::Busy { owner, key } => format!("B owner={owner} {key}"),
        Reply::Released { token, key } => format!("R token={token} {key}"),
        Reply::NotReleased { token, key } => format!("N token={token} {key}"),
        Reply::Extended { token, key } => format!("E token={token} {key}"),
        Reply::NotExtended { token, key } => format!("X token={token} {key}"),
        Reply::LimitMismatch { owner, limit, key } => {
            format!("L owner={owner} limit={limit} {key}")
        }
    }
}

/// Runs server turns until `client` has a reply, at most `turns` of them.
fn step_until_reply<S: Service>(
    server: &mut Server<S>,
    client: &mut Client,
    turns: usize,
) -> io::Result<Option<String>> {
    for _ in 0..turns {
        server.poll_once(Some(Duration::from_millis(5)))?;
        if let Some(r) = client.poll_reply()? {
            return Ok(Some(r));
        }
    }
    Ok(None)
}

fn connect<S: Service>(server: &mut Server<S>) -> io::Result<Client> {
    let stream = TcpStream::connect(server.local_addr())?;
    stream.set_nonblocking(true)?;
    // One turn accepts it.
    server.poll_once(Some(Duration::from_millis(5)))?;
    Ok(Client {
        stream,
        buf: Vec::new(),
    })
}

fn main() -> io::Result<()> {
    let config = Config {
        listen: "127.0.0.1:0".parse().expect("address"),
        ..Config::default()
    };
    // Tokens from 1, nothing persisted: reproducible runs.
    let service = SingleService::with_first_token(config.engine.clone(), 1);
    let mut server = Server::bind(config, service)?;
    let clock = server.use_manual_clock();
    println!("server on {}", server.local_addr());

    let mut holder = connect(&mut server)?;
    let mut waiter = connect(&mut server)?;

    holder.send(Request::Acquire {
        wait_s: 0,
        lease_s: 5,
        owner: 1,
        key: "db",
    })?;
    println!(
        "holder  <- {:?}",
        step_until_reply(&mut server, &mut holder, 100)?
    );

    waiter.send(Request::Acquire {
        wait_s: 30,
        lease_s: 5,
        owner: 2,
        key: "db",
    })?;
    println!(
        "waiter  <- {:?} (queued)",
        step_until_reply(&mut server, &mut waiter, 10)?
    );

    // A lease granted at `t` ends at `t + lease + 1 ms`, the first
    // millisecond *past* `t + lease` (PROTOCOL §2.4: "a key past its expiry").
    // The server reads its clock in whole milliseconds, truncated, so `t`
    // may be up to 1 ms before the moment the holder wrote its request;
    // ending the lease only once `t + lease` is past keeps it from ending
    // before the holder's own conservative expiry (written + lease). So at
    // exactly 5,000 ms the holder still has the key.
    clock.advance_ms(5_000);
    println!("clock moved 5,000 ms: the lease ends 1 ms later, the waiter waits");
    println!(
        "waiter  <- {:?} (still queued)",
        step_until_reply(&mut server, &mut waiter, 10)?
    );

    clock.advance_ms(1);
    println!("clock moved 1 ms more: the holder's lease is over");
    println!(
        "waiter  <- {:?}",
        step_until_reply(&mut server, &mut waiter, 100)?
    );

    server.shutdown_handle().shutdown();
    while server.poll_once(Some(Duration::from_millis(5)))? == Status::Running {}
    println!("stopped after {} turns", server.stats().turns);
    Ok(())
}

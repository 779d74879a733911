//! One test driver over two transports: the in-memory harness ([`Mem`]) and
//! the real server on loopback TCP, stepped in this thread ([`Tcp`]).

use super::*;

/// One side of a comparison: something that takes request bytes on numbered
/// connections and gives back what each connection received.
pub(super) trait Wire {
    fn connect(&mut self) -> usize;
    fn send(&mut self, c: usize, bytes: &[u8]);
    /// Sends a sentinel release with `token` on `c` and waits for its reply:
    /// everything sent on `c` before it has been handled, and every reply
    /// the server produced up to then has arrived.
    fn settle(&mut self, c: usize, token: u64);
    /// Moves the clock and runs one turn with no input (the deadlines).
    fn advance(&mut self, ms: u64);
    /// Waits until the server closed `c` (read EOF), then closes this end.
    fn await_close(&mut self, c: usize);
    /// Closes this end of `c` and waits until the server has reaped it.
    fn close(&mut self, c: usize);
    fn received(&self, c: usize) -> &[u8];
    fn stats(&self) -> Stats;
    fn connection_count(&self) -> usize;
}

/// The harness with tokens that go up by one from 1: the scenarios here
/// script the tokens their releases and extends send.
pub(super) fn sequential_harness(config: Config) -> std::io::Result<Harness> {
    let service =
        SingleService::with_first_token(config.engine.clone(), 1).with_sequential_tokens();
    Harness::with_service(config, service)
}

pub(super) struct Mem {
    h: Harness,
    conns: Vec<Option<MemConn>>,
    got: Vec<Vec<u8>>,
}

impl Mem {
    pub(super) fn new(config: Config) -> Mem {
        Mem::around(sequential_harness(config).expect("harness"))
    }

    pub(super) fn around(mut h: Harness) -> Mem {
        h.advance(Duration::from_millis(START_MS));
        Mem {
            h,
            conns: Vec::new(),
            got: Vec::new(),
        }
    }

    pub(super) fn pump(&mut self) {
        self.h.run_until_idle();
        for (c, got) in self.conns.iter_mut().zip(&mut self.got) {
            if let Some(c) = c {
                c.read(got);
            }
        }
    }
}

impl Wire for Mem {
    fn connect(&mut self) -> usize {
        self.conns.push(Some(self.h.connect()));
        self.got.push(Vec::new());
        self.pump();
        self.conns.len() - 1
    }

    fn send(&mut self, c: usize, bytes: &[u8]) {
        let conn = self.conns[c].as_mut().expect("open");
        assert_eq!(conn.write(bytes), bytes.len(), "the pipe has room");
    }

    fn settle(&mut self, c: usize, token: u64) {
        self.send(c, &release(SYNC_KEY, token));
        self.pump();
        assert!(
            self.got[c].ends_with(&sentinel_reply(token)),
            "no sentinel reply on {c}: {:?}",
            replies(&self.got[c])
        );
    }

    fn advance(&mut self, ms: u64) {
        self.h.advance(Duration::from_millis(ms));
        self.h.step();
        self.pump();
    }

    fn await_close(&mut self, c: usize) {
        self.pump();
        let conn = self.conns[c].take().expect("open");
        assert!(conn.is_closed_by_server(), "the server closed {c}");
        drop(conn);
        self.pump();
    }

    fn close(&mut self, c: usize) {
        self.conns[c] = None;
        self.pump();
    }

    fn received(&self, c: usize) -> &[u8] {
        &self.got[c]
    }

    fn stats(&self) -> Stats {
        self.h.stats()
    }

    fn connection_count(&self) -> usize {
        self.h.connection_count()
    }
}

pub(super) struct Tcp {
    server: Server<SingleService>,
    clock: ManualClock,
    conns: Vec<Option<TcpStream>>,
    got: Vec<Vec<u8>>,
    eof: Vec<bool>,
}

impl Tcp {
    pub(super) fn new(config: Config) -> Tcp {
        let config = Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            ..config
        };
        let service =
            SingleService::with_first_token(config.engine.clone(), 1).with_sequential_tokens();
        let mut server = Server::bind(config, service).expect("bind");
        let clock = server.use_manual_clock();
        assert!(clock.now() < Millis(START_MS), "bound in under 10 s");
        clock.set(Millis(START_MS));
        Tcp {
            server,
            clock,
            conns: Vec::new(),
            got: Vec::new(),
            eof: Vec::new(),
        }
    }

    /// One turn, then everything readable on every socket.
    pub(super) fn turn(&mut self) {
        self.server
            .poll_once(Some(Duration::from_millis(1)))
            .expect("poll");
        for (i, s) in self.conns.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            let mut chunk = [0u8; 4096];
            loop {
                match s.read(&mut chunk) {
                    Ok(0) => {
                        self.eof[i] = true;
                        break;
                    }
                    Ok(n) => self.got[i].extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => panic!("read: {e}"),
                }
            }
        }
    }

    pub(super) fn turn_until(&mut self, what: &str, done: impl Fn(&Tcp) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done(self) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            self.turn();
        }
    }
}

impl Wire for Tcp {
    fn connect(&mut self) -> usize {
        let before = self.server.stats().accepted;
        let s = TcpStream::connect(self.server.local_addr()).expect("connect");
        s.set_nonblocking(true).unwrap();
        s.set_nodelay(true).unwrap();
        self.conns.push(Some(s));
        self.got.push(Vec::new());
        self.eof.push(false);
        self.turn_until("the accept", |t| t.server.stats().accepted > before);
        self.conns.len() - 1
    }

    fn send(&mut self, c: usize, bytes: &[u8]) {
        self.conns[c]
            .as_mut()
            .expect("open")
            .write_all(bytes)
            .expect("write");
    }

    fn settle(&mut self, c: usize, token: u64) {
        self.send(c, &release(SYNC_KEY, token));
        let want = sentinel_reply(token);
        self.turn_until("the sentinel reply", |t| t.got[c].ends_with(&want));
    }

    fn advance(&mut self, ms: u64) {
        self.clock.advance_ms(ms);
        self.turn();
    }

    fn await_close(&mut self, c: usize) {
        self.turn_until("the server's close", |t| t.eof[c]);
        let open = self.server.connection_count();
        self.conns[c] = None;
        self.turn_until("the reap", |t| t.server.connection_count() < open);
    }

    fn close(&mut self, c: usize) {
        let open = self.server.connection_count();
        self.conns[c] = None;
        self.turn_until("the reap", |t| t.server.connection_count() < open);
    }

    fn received(&self, c: usize) -> &[u8] {
        &self.got[c]
    }

    fn stats(&self) -> Stats {
        self.server.stats()
    }

    fn connection_count(&self) -> usize {
        self.server.connection_count()
    }
}

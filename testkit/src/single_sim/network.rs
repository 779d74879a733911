//! The simulated network and its faults: byte streams cut into chunks,
//! connections cut, partitions, pauses and crashes of clients and server.

use super::*;

impl Sim {
    /// Sends bytes on one direction of a connection, in random chunks, in order.
    pub(super) fn send(&mut self, conn: ConnId, to_server: bool, bytes: &[u8]) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        if c.cut {
            return;
        }
        let held_until = self.clients[c.client].partitioned_until;
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = if rest.len() > 1 && self.rng.chance(300) {
                self.rng.range(1, rest.len() as u64 - 1) as usize
            } else {
                rest.len()
            };
            let (chunk, tail) = rest.split_at(n);
            rest = tail;
            let lat = self.latency();
            let c = self.conns.get_mut(&conn).expect("checked above");
            let last = if to_server {
                &mut c.last_to_server
            } else {
                &mut c.last_to_client
            };
            let t = (*last).max(self.now + lat).max(held_until + lat);
            *last = t;
            let ev = if to_server {
                Ev::ToServer {
                    conn,
                    bytes: chunk.to_vec(),
                }
            } else {
                Ev::ToClient {
                    conn,
                    bytes: chunk.to_vec(),
                }
            };
            self.at(t, ev);
        }
    }

    /// The network resets a connection: both ends learn it after a while.
    pub(super) fn cut(&mut self, conn: ConnId) {
        let (d1, d2) = (self.rng.range(MS, 50 * MS), self.rng.range(MS, 50 * MS));
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.cut {
            return;
        }
        c.cut = true;
        self.stats.resets += 1;
        let now = self.now;
        if !c.client_closed {
            // Nothing crosses a reset connection from now on, and the server
            // may drop its queued acquires before the client notices.
            self.history.session_closed(conn, now);
        }
        self.at(now + d1, Ev::ServerSeesClose { conn });
        self.at(now + d2, Ev::ClientSeesClose { conn });
    }

    pub(super) fn fault(&mut self) {
        let client = self.rng.below(self.cfg.clients as u64) as usize;
        match self.rng.below(10) {
            0 | 1 => {
                // Partition one client's link; a long one resets its connections.
                self.stats.partitions += 1;
                let len = self.rng.range(50 * MS, 6 * S);
                let until = self.now + len;
                let c = &mut self.clients[client];
                c.partitioned_until = c.partitioned_until.max(until);
                if len > 2 * S || self.rng.chance(300) {
                    let conns: Vec<ConnId> = self
                        .conns
                        .iter()
                        .filter(|(_, c)| c.client == client && !c.cut)
                        .map(|(&id, _)| id)
                        .collect();
                    for conn in conns {
                        self.cut(conn);
                    }
                }
            }
            2 => {
                if let Some(conn) = self.clients[client].session {
                    self.cut(conn);
                }
            }
            3 | 4 => {
                // Client crash: its sockets close, its state is gone.
                if !self.clients[client].alive {
                    return;
                }
                self.stats.client_crashes += 1;
                self.client_crash(client);
                let back = self.now + self.rng.range(100 * MS, 3 * S);
                self.at(back, Ev::ClientRestart { client });
            }
            5 | 6 => {
                // A pause longer than the leases (up to 3 s here) at times.
                self.stats.client_pauses += 1;
                let len = self.rng.range(100 * MS, 8 * S);
                let c = &mut self.clients[client];
                c.paused_until = c.paused_until.max(self.now + len);
            }
            7 | 8 => {
                if !self.server.up {
                    return;
                }
                self.stats.server_pauses += 1;
                let len = self.rng.range(100 * MS, 8 * S);
                self.server.paused_until = self.server.paused_until.max(self.now + len);
            }
            _ => {
                if !self.server.up {
                    return;
                }
                self.stats.server_crashes += 1;
                self.server_crash();
                let back = self.now + self.rng.range(50 * MS, 3 * S);
                self.at(back, Ev::ServerRestart);
            }
        }
    }

    pub(super) fn client_crash(&mut self, client: usize) {
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.client == client && !c.client_closed)
            .map(|(&id, _)| id)
            .collect();
        for conn in conns {
            // The kernel closes the dead process's sockets.
            let lat = self.latency();
            let c = self.conns.get_mut(&conn).expect("listed");
            c.client_closed = true;
            let fin = c.last_to_server.max(self.now + lat);
            self.history.session_closed(conn, self.now);
            self.at(fin, Ev::ServerSeesClose { conn });
        }
        let c = &mut self.clients[client];
        c.alive = false;
        c.session = None;
        c.connecting = false;
        c.paused_until = 0;
        // What it was doing ends unanswered; its sessions are closed.
        c.phase = Phase::Idle;
    }

    pub(super) fn server_crash(&mut self) {
        self.server.up = false;
        self.server.paused_until = 0;
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.epoch == self.server.epoch && !c.cut)
            .map(|(&id, _)| id)
            .collect();
        for conn in conns {
            let d = self.rng.range(MS, 50 * MS);
            let c = self.conns.get_mut(&conn).expect("listed");
            c.cut = true;
            c.server_closed = true;
            let now = self.now;
            if !c.client_closed {
                self.history.session_closed(conn, now);
            }
            self.at(now + d, Ev::ClientSeesClose { conn });
        }
    }
}

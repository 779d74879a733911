// TLS against the real ticketd, with certificates made by openssl.

import assert from "node:assert/strict";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { Client } from "../dist/index.js";
import { makeCerts, removeDir, startServer, tempDir } from "./support.mjs";

let certs;
const cleanups = [];
before(() => {
  certs = makeCerts();
  cleanups.push(() => removeDir(certs));
});
after(async () => {
  for (const f of cleanups.reverse()) await f();
});

/** ticketd with TLS on 127.0.0.1:0 and a plaintext unix socket beside it. */
async function tlsServer(...extra) {
  const d = tempDir();
  cleanups.push(() => removeDir(d));
  const sock = join(d, "t.sock");
  const s = await startServer([
    "--listen",
    `unix:${sock}`,
    "--tls-cert",
    join(certs, "server.pem"),
    "--tls-key",
    join(certs, "server-key.pem"),
    ...extra,
  ]);
  cleanups.push(() => s.stop());
  return { s, plain: client(`unix:${sock}`) };
}
function client(addr, opts) {
  const c = new Client(addr, opts);
  cleanups.push(() => c.close());
  return c;
}
async function holds(c, key) {
  const r = await c.acquire(key, { wait: 0, lease: 1 });
  if (r.ticket) {
    assert.equal(await r.ticket.release(), "released");
    return false;
  }
  assert.equal(r.outcome, "timeout");
  return true;
}

test("acquire, extend and release over TLS, many callers pipelined on two connections", async () => {
  const { s, plain } = await tlsServer();
  const c = client(s.addr, { tlsCa: join(certs, "ca.pem") });
  const t = (await c.acquire("tls", { wait: 1, lease: 5 })).ticket;
  assert.ok(t, c.lastConnectError);
  assert.ok(await holds(plain, "tls"), "the unix socket stays plaintext");
  assert.equal(await t.extend(5), "extended");
  assert.equal(await t.release(), "released");
  const tokens = await Promise.all(
    Array.from({ length: 16 }, async (_, i) => {
      const r = await c.acquire(`k${i}`, { wait: 5, lease: 5 });
      assert.equal(await r.ticket.release(), "released");
      return r.ticket.token;
    }),
  );
  assert.equal(new Set(tokens).size, 16);
  assert.ok(c.connectedSessions() <= 2);
  // By name: localhost is in the certificate too.
  const byName = client(s.addr.replace("127.0.0.1", "localhost"), { tlsCa: join(certs, "ca.pem") });
  assert.equal((await byName.acquire("n", { wait: 1 })).outcome, "acquired");
});

test("a server certificate from another CA or for another name is refused", async () => {
  const { s, plain } = await tlsServer();
  const other = client(s.addr, { tlsCa: join(certs, "other.pem") });
  assert.equal((await other.acquire("r", { wait: 0.5 })).outcome, "timeout");
  assert.match(other.lastConnectError, /TLS: .*(certificate|verify)/i);
  const wrongName = client(s.addr, { tlsCa: join(certs, "ca.pem"), tlsServerName: "db.example" });
  assert.equal((await wrongName.acquire("r", { wait: 0.5 })).outcome, "timeout");
  assert.match(wrongName.lastConnectError, /db\.example/);
  // A plaintext client to the TLS port never gets a grant.
  const noTls = client(s.addr);
  assert.notEqual((await noTls.acquire("r", { wait: 0.5 })).outcome, "acquired");
  assert.equal(await holds(plain, "r"), false);
});

test("a client certificate is presented when the server requires one", async () => {
  const { s, plain } = await tlsServer("--tls-client-ca", join(certs, "ca.pem"));
  const ca = join(certs, "ca.pem");
  for (const extra of [{}, { tlsCert: join(certs, "stranger.pem"), tlsKey: join(certs, "stranger-key.pem") }]) {
    const c = client(s.addr, { tlsCa: ca, poolSize: 1, ...extra });
    // TLS 1.3 ends the client's side of the handshake before the server
    // judges the certificate: the refusal may come after the write.
    const r = await c.acquire("m", { wait: 0.5, lease: 5 });
    assert.ok(["timeout", "indeterminate"].includes(r.outcome), r.outcome);
    assert.equal(await holds(plain, "m"), false);
  }
  const c = client(s.addr, { tlsCa: ca, tlsCert: join(certs, "client.pem"), tlsKey: join(certs, "client-key.pem") });
  const t = (await c.acquire("m", { wait: 1, lease: 5 })).ticket;
  assert.ok(t, c.lastConnectError);
  assert.ok(await holds(plain, "m"));
  assert.equal(await t.release(), "released");
});

test("TLS settings are checked at construction", () => {
  const ca = join(certs, "ca.pem");
  assert.throws(() => new Client("127.0.0.1:1", { tlsCa: ca, tlsCert: join(certs, "client.pem") }), /go together/);
  assert.throws(
    () => new Client("127.0.0.1:1", { tlsCa: ca, tlsCert: join(certs, "client.pem"), tlsKey: join(certs, "stranger-key.pem") }),
    /TLS settings/,
  );
  assert.throws(() => new Client("127.0.0.1:1", { tlsCa: join(certs, "server.ext") }), /TLS settings/);
});

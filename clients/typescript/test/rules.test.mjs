// PROTOCOL §3 against the real ticketd, and against fake servers where a
// rule needs a fault.

import assert from "node:assert/strict";
import { after, test } from "node:test";
import { execFile } from "node:child_process";
import { join } from "node:path";
import { promisify } from "node:util";

import { Client } from "../dist/index.js";
import {
  PKG,
  delayingProxy,
  holds,
  refusedAddr,
  removeDir,
  silentServer,
  sleep,
  startServer,
  tempDir,
} from "./support.mjs";

const run = promisify(execFile);
const cleanups = [];
after(async () => {
  for (const f of cleanups.reverse()) await f();
});
async function server(args) {
  const s = await startServer(args);
  cleanups.push(() => s.stop());
  return s;
}
function client(addr, opts) {
  const c = new Client(addr, opts);
  cleanups.push(() => c.close());
  return c;
}
async function silent() {
  const s = await silentServer();
  cleanups.push(() => s.close());
  return s;
}
async function until(pred, ms = 3000) {
  const end = performance.now() + ms;
  while (performance.now() < end) {
    if (await pred()) return true;
    await sleep(20);
  }
  return false;
}

test("acquire and release against the real server", async () => {
  const s = await server();
  const c = client(s.addr);
  const r = await c.acquire("db", { wait: 1, lease: 5 });
  assert.equal(r.outcome, "acquired");
  const t = r.ticket;
  assert.equal(t.key, "db");
  assert.equal(typeof t.token, "bigint");
  assert.ok(t.token > 0n);
  assert.ok(await s.holds("db"));
  // The local expiry is conservative: at most the lease from now.
  assert.ok(t.remainingMs() <= 5000 && t.remainingMs() > 4000);
  assert.equal(await t.release(), "released");
  assert.equal(await s.holds("db"), false);
  assert.equal(await c.release("db", t.token), "not_held");
  const again = await c.acquire("db", { wait: 1, lease: 5 });
  assert.ok(again.ticket.token > t.token, "tokens only grow");
  assert.equal(await again.ticket.release(), "released");
});

test("timeout is definitive and comes at the deadline", async () => {
  const s = await server();
  const c = client(s.addr);
  const holder = (await c.acquire("k", { wait: 1, lease: 10 })).ticket;
  const start = performance.now();
  const r = await c.acquire("k", { wait: 1, lease: 5 });
  const took = performance.now() - start;
  assert.equal(r.outcome, "timeout");
  assert.equal(r.ticket, null);
  assert.ok(took >= 900 && took < 2000, `took ${took} ms`);
  assert.equal((await c.acquire("k", { wait: 0, lease: 5 })).outcome, "timeout");
  assert.equal(await holder.release(), "released");
});

test("busy is definitive and immediate; the queued waiter gets the key FIFO", async () => {
  const s = await server(["--max-waiters-per-key", "1"]);
  const c = client(s.addr);
  const holder = (await c.acquire("k", { wait: 1, lease: 30 })).ticket;
  const waiter = c.acquire("k", { wait: 10, lease: 5 });
  await sleep(300);
  const start = performance.now();
  assert.equal((await c.acquire("k", { wait: 10, lease: 1 })).outcome, "busy");
  assert.ok(performance.now() - start < 1000);
  assert.equal(await holder.release(), "released");
  const w = await waiter;
  assert.equal(w.outcome, "acquired");
  assert.ok(w.ticket.token > holder.token);
  await w.ticket.release();
});

test("bad arguments throw before anything is sent", async () => {
  const fake = await silent();
  const c = client(fake.addr, { maxKeyBytes: 8 });
  await assert.rejects(c.acquire("", { wait: 1 }), RangeError);
  await assert.rejects(c.acquire("a\nb"), RangeError);
  await assert.rejects(c.acquire("123456789"), RangeError);
  await assert.rejects(c.acquire("k", { lease: 1.5 }), RangeError);
  await assert.rejects(c.acquire("k", { lease: 0 }), RangeError);
  await assert.rejects(c.acquire("k", { lease: 256 }), RangeError);
  await assert.rejects(c.acquire("k", { wait: -1 }), RangeError);
  await assert.rejects(c.acquire("k", { wait: NaN }), RangeError);
  assert.throws(() => c.release("k", 5), TypeError);
  await assert.rejects(c.extend("k", 5n, 0), RangeError);
  await sleep(100);
  assert.equal(fake.bytes().length, 0);
  assert.equal(c.connectedSessions(), 0);
});

test("the wire wait is the time left rounded up, clamped to 255; an abort before sending sends nothing", async () => {
  const fake = await silent();
  const c = client(fake.addr);
  const ctl = new AbortController();
  const p1 = c.acquire("w", { wait: 2.5, lease: 7, signal: ctl.signal });
  const p2 = c.acquire("w", { wait: 1000, lease: 7, signal: ctl.signal });
  assert.ok(await until(() => fake.bytes().length >= 26));
  ctl.abort();
  assert.equal((await p1).outcome, "indeterminate");
  assert.equal((await p2).outcome, "indeterminate");
  const b = fake.bytes();
  assert.deepEqual([b[0], b[1], b[2]], [0x41, 3, 7]);
  assert.deepEqual([b[13], b[14], b[15]], [0x41, 255, 7]);
  assert.notEqual(b.readBigUInt64BE(3), b.readBigUInt64BE(16), "each call has its own owner");
  const before = fake.bytes().length;
  const r = await c.acquire("w", { wait: 5, signal: AbortSignal.abort() });
  assert.equal(r.outcome, "timeout");
  await sleep(50);
  assert.equal(fake.bytes().length, before);
});

test("no reply by D + 1 s is indeterminate, sent once, and closes that connection", async () => {
  const fake = await silent();
  const c = client(fake.addr);
  const start = performance.now();
  const r = await c.acquire("silent", { wait: 1, lease: 5 });
  const took = performance.now() - start;
  assert.equal(r.outcome, "indeterminate");
  assert.ok(took >= 1900 && took < 3000, `took ${took} ms`);
  assert.equal(fake.bytes().length, 12 + 6, "the acquire was sent exactly once");
  assert.ok(await until(() => fake.connections() === 0), "the client closed the connection");
  assert.match(c.lastConnectError, /no reply/);
});

test("wait 0 is one attempt with a zero wire wait under the 5 s transport deadline", async () => {
  const fake = await silent();
  const c = client(fake.addr);
  const start = performance.now();
  const r = await c.acquire("z", { wait: 0, lease: 5 });
  const took = performance.now() - start;
  assert.equal(r.outcome, "indeterminate");
  assert.ok(took >= 4900 && took < 6000, `took ${took} ms`);
  const b = fake.bytes();
  assert.equal(b.length, 13);
  assert.equal(b[1], 0);
});

test("a server that dies under a queued acquire makes it indeterminate at once", async () => {
  const s = await startServer();
  cleanups.push(() => s.stop());
  const c = client(s.addr);
  const holder = (await c.acquire("q", { wait: 1, lease: 30 })).ticket;
  assert.ok(holder);
  const waiter = c.acquire("q", { wait: 30, lease: 5 });
  await sleep(300);
  const start = performance.now();
  await s.kill();
  const r = await waiter;
  assert.equal(r.outcome, "indeterminate");
  assert.ok(performance.now() - start < 1000);
  // Nothing reachable now: a release is indeterminate (nothing sent) within 5 s.
  assert.equal(await holder.release(), "indeterminate");
});

test("a late grant is given back at once, not held for its lease", async () => {
  const s = await server();
  const proxy = await delayingProxy(s.addr, 1500);
  cleanups.push(() => proxy.close());
  const c = client(proxy.addr);
  const start = performance.now();
  const r = await c.acquire("late", { wait: 1, lease: 30 });
  assert.equal(r.outcome, "indeterminate");
  assert.ok(performance.now() - start < 2000);
  // The release went out at once (its own reply is delayed too).
  assert.ok(await until(async () => !(await s.holds("late")), 2500), "the late grant was released");
});

test("an acquire whose caller gave up is released when it is granted later", async () => {
  const s = await server();
  const c = client(s.addr);
  const holder = (await c.acquire("g", { wait: 1, lease: 30 })).ticket;
  const start = performance.now();
  const r = await c.acquire("g", { wait: 20, lease: 30, signal: AbortSignal.timeout(300) });
  assert.equal(r.outcome, "indeterminate");
  assert.ok(performance.now() - start < 1000);
  // The server still queues it: the holder's release hands it the key,
  // and the client gives that grant back.
  assert.equal(await holder.release(), "released");
  assert.ok(await until(async () => !(await s.holds("g")), 2000), "the abandoned grant was released");
  assert.ok(await until(() => c.pendingBackgroundReleases() === 0));
});

test("a server that is down costs the caller its wait and no more, and says why", async () => {
  const down = await refusedAddr();
  const c = client(down);
  const start = performance.now();
  const r = await c.acquire("k", { wait: 1, lease: 5 });
  const took = performance.now() - start;
  assert.equal(r.outcome, "timeout");
  assert.ok(took >= 900 && took < 1600, `took ${took} ms`);
  assert.match(c.lastConnectError, /ECONNREFUSED/);
});

test("addresses rotate: an unsent acquire moves on to the next address", async () => {
  const s = await server();
  const down = await refusedAddr();
  const c = client([down, s.addr], { poolSize: 1 });
  const r = await c.acquire("rot", { wait: 2, lease: 5 });
  assert.equal(r.outcome, "acquired");
  assert.match(c.lastConnectError ?? "", new RegExp(down.replace(/\./g, "\\.")));
  assert.equal(await r.ticket.release(), "released");
});

test("a unix socket address works and a missing socket says why", async () => {
  const d = tempDir();
  cleanups.push(() => removeDir(d));
  const sock = join(d, "t.sock");
  const s = await startServer(["--listen", `unix:${sock}`], { tcp: false });
  cleanups.push(() => s.stop());
  const c = client(`unix:${sock}`);
  const r = await c.acquire("u", { wait: 1, lease: 5 });
  assert.equal(r.outcome, "acquired");
  assert.equal(await r.ticket.release(), "released");
  const missing = client(`unix:${join(d, "nothing.sock")}`);
  assert.equal((await missing.acquire("u", { wait: 0.3 })).outcome, "timeout");
  assert.match(missing.lastConnectError, /nothing\.sock.*ENOENT/);
});

test("a malformed reply closes that connection with a clear error", async () => {
  const fake = await silent();
  const c = client(fake.addr);
  const p = c.acquire("m", { wait: 5, lease: 5 });
  assert.ok(await until(() => fake.bytes().length > 0));
  fake.replyWith(Buffer.from("HTTP/1.1 400 Bad Request\r\n\r\n"));
  assert.equal((await p).outcome, "indeterminate");
  assert.match(c.lastConnectError, /malformed reply .*unknown reply op 0x48/);
  assert.ok(await until(() => fake.connections() === 0));
});

test("a grant for an owner nobody waits for is released at once", async () => {
  const fake = await silent();
  const c = client(fake.addr);
  const p = c.acquire("o", { wait: 0.5, lease: 5 });
  assert.ok(await until(() => fake.bytes().length > 0));
  const grant = Buffer.from("41000000000000002a00000000000000016f0a", "hex");
  fake.replyWith(grant);
  const release = Buffer.from("52000000000000002a6f0a", "hex");
  assert.ok(await until(() => fake.bytes().includes(release)), "the client released token 42");
  assert.equal((await p).outcome, "indeterminate");
});

test("many concurrent callers share a pool: sections never overlap and tokens grow", async () => {
  const s = await server();
  const c = client(s.addr, { poolSize: 2 });
  let inside = 0;
  let last = 0n;
  let cycles = 0;
  const worker = async () => {
    for (let i = 0; i < 25; i++) {
      const r = await c.acquire("shared", { wait: 30, lease: 10 });
      assert.equal(r.outcome, "acquired");
      inside += 1;
      assert.equal(inside, 1, "two callers inside at once");
      assert.ok(r.ticket.token > last);
      last = r.ticket.token;
      await sleep(0);
      inside -= 1;
      cycles += 1;
      assert.equal(await r.ticket.release(), "released");
    }
  };
  await Promise.all(Array.from({ length: 16 }, worker));
  assert.equal(cycles, 400);
  assert.ok(c.connectedSessions() <= 2);
});

test("a closed client refuses new calls", async () => {
  const s = await server();
  const c = client(s.addr);
  c.close();
  await assert.rejects(c.acquire("k"), /closed/);
  assert.equal(await holds(s.addr, "k"), false);
});

test("a ticket dropped while held is released in the background", async () => {
  const s = await server();
  // A child with a collector the test can run: the ticket is acquired,
  // dropped, and the child waits until the release has gone out.
  const script = `
    const { Client } = require(${JSON.stringify(join(PKG, "dist", "index.js"))});
    const c = new Client(process.argv[1]);
    (async () => {
      await c.acquire("dropped", { wait: 1, lease: 30 }).then((r) => console.log(r.outcome));
      for (let i = 0; i < 50; i++) {
        globalThis.gc();
        await new Promise((r) => setTimeout(r, 20));
        if (c.pendingBackgroundReleases() > 0) break;
      }
      while (c.pendingBackgroundReleases() > 0) await new Promise((r) => setTimeout(r, 10));
      console.log("done");
    })();`;
  const out = await run(process.execPath, ["--expose-gc", "-e", script, s.addr], { timeout: 20000 });
  assert.equal(out.stdout, "acquired\ndone\n");
  assert.equal(await s.holds("dropped"), false);
});

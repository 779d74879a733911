// Protocol 1.2 (PROTOCOL §6): semaphores and read/write locks. The codec
// against the §6.1 example, L matching against a fake server, and the
// client against the real single-mode ticketd.

import assert from "node:assert/strict";
import { after, test } from "node:test";

import * as proto from "../dist/proto.js";
import { Client, Places, READ_WRITE_LIMIT } from "../dist/index.js";
import { delayingProxy, silentServer, sleep, startServer } from "./support.mjs";

const hex = (s) => Buffer.from(s.replace(/ /g, ""), "hex");
// PROTOCOL §6.1: a permit of "pool", a semaphore of 8, wait=5, lease=30,
// owner 7, and the answer when "pool" is registered with a limit of 4.
const SPEC_REQUEST = hex("50 05 1E 00 00 00 00 00 00 00 07 00 08 53 70 6F 6F 6C 0A");
const SPEC_REPLY = hex("4C 00 00 00 00 00 00 00 07 00 04 70 6F 6F 6C 0A");

const cleanups = [];
after(async () => {
  for (const f of cleanups.reverse()) await f();
});
async function server() {
  const s = await startServer();
  cleanups.push(() => s.stop());
  return s;
}
async function silent() {
  const s = await silentServer();
  cleanups.push(() => s.close());
  return s;
}
function client(addr, opts) {
  const c = new Client(addr, opts);
  cleanups.push(() => c.close());
  return c;
}
async function until(pred, ms = 3000) {
  const end = performance.now() + ms;
  while (performance.now() < end) {
    if (await pred()) return true;
    await sleep(20);
  }
  return false;
}
/** An L for the owner of the request frame `req`, with `limit`. */
function limitMismatchFor(req, limit, key) {
  const l = Buffer.alloc(11);
  l[0] = 0x4c;
  req.copy(l, 1, 3, 11);
  l.writeUInt16BE(limit, 9);
  return Buffer.concat([l, Buffer.from(`${key}\n`)]);
}

test("an acquire with limit encodes as the PROTOCOL §6.1 example", () => {
  const pool = Buffer.from("pool");
  assert.deepEqual(proto.encodeAcquireWithLimit(5, 30, 7n, 8, proto.MODE_SHARED, pool), SPEC_REQUEST);
  const x = proto.encodeAcquireWithLimit(0, 1, 0x0an, 65535, proto.MODE_EXCLUSIVE, Buffer.from("k"));
  assert.deepEqual(x, hex("50 00 01 00 00 00 00 00 00 00 0A FF FF 58 6B 0A"));
});

test("a LimitMismatch decodes as the §6.1 example, only once whole", () => {
  for (let cut = 0; cut < SPEC_REPLY.length; cut++) {
    assert.equal(proto.decodeReply(SPEC_REPLY.subarray(0, cut), 0, 1024), null, `cut ${cut}`);
  }
  const d = proto.decodeReply(Buffer.concat([SPEC_REPLY, hex("54")]), 0, 1024);
  assert.equal(d.kind, "frame");
  assert.equal(d.used, SPEC_REPLY.length);
  assert.deepEqual(d.reply, { op: 0x4c, a: 7n, owner: 0n, key: "pool", limit: 4 });
  // Its header may hold newlines: owner 0x0A, limit 0x0A0A.
  const nl = proto.decodeReply(hex("4C 00 00 00 00 00 00 00 0A 0A 0A 6B 0A"), 0, 1024);
  assert.deepEqual(nl.reply, { op: 0x4c, a: 0x0an, owner: 0n, key: "k", limit: 0x0a0a });
});

test("places and a limit of 0 are checked before anything is sent", async () => {
  assert.deepEqual(Places.semaphore(8), { limit: 8, mode: "shared" });
  assert.deepEqual(Places.shared(), { limit: 65535, mode: "shared" });
  assert.deepEqual(Places.exclusive(), { limit: READ_WRITE_LIMIT, mode: "exclusive" });
  const s = await silent();
  const c = client(s.addr);
  await assert.rejects(c.acquirePermit("k", 0), RangeError);
  await assert.rejects(c.acquireWith("k", { limit: 0, mode: "exclusive" }), RangeError);
  await assert.rejects(c.acquirePermit("k", 65536), RangeError);
  await assert.rejects(c.acquirePermit("k", 1.5), RangeError);
  await assert.rejects(c.acquireWith("k", { limit: 2, mode: "both" }), RangeError);
  assert.equal(c.connectedSessions(), 0);
  assert.equal(s.bytes().length, 0);
});

test("an L is matched by owner, split across reads, and is final", async () => {
  const s = await silent();
  const c = client(s.addr);
  const res = c.acquirePermit("pool", 8, { wait: 5, lease: 30 });
  assert.ok(await until(() => s.bytes().length >= 19));
  const req = s.bytes();
  assert.equal(req.length, 19);
  assert.deepEqual(req.subarray(11), hex("00 08 53 70 6F 6F 6C 0A"));
  const l = limitMismatchFor(req, 4, "pool");
  s.replyWith(l.subarray(0, 5));
  await sleep(50);
  s.replyWith(l.subarray(5));
  const r = await res;
  assert.equal(r.outcome, "limit_mismatch");
  assert.equal(r.limit, 4);
  assert.equal(r.ticket, null);
  await sleep(100);
  assert.equal(s.bytes().length, 19, "sent again");
});

test("an L for a plain acquire is indeterminate and closes the connection", async () => {
  const s = await silent();
  const c = client(s.addr, { poolSize: 1 });
  const res = c.acquire("m", { wait: 5, lease: 30 });
  assert.ok(await until(() => s.bytes().length >= 13));
  s.replyWith(limitMismatchFor(s.bytes(), 1, "m"));
  const r = await res;
  assert.equal(r.outcome, "indeterminate");
  assert.ok(await until(() => s.connections() === 0), "the connection was kept");
});

test("a semaphore of 2 against the real server", async () => {
  const s = await server();
  const c = client(s.addr, { poolSize: 4 });
  const first = await c.acquirePermit("sem", 2, { wait: 1, lease: 30 });
  const second = await c.acquirePermit("sem", 2, { wait: 1, lease: 30 });
  assert.equal(first.outcome, "acquired");
  assert.equal(second.outcome, "acquired");
  assert.ok(first.ticket.token < second.ticket.token);
  // Full: a third with wait 0 times out at once, not queued.
  const third = await c.acquirePermit("sem", 2, { wait: 0, lease: 30 });
  assert.equal(third.outcome, "timeout");
  // Another limit is answered with the key's own, never retried.
  const other = await c.acquirePermit("sem", 3, { wait: 1, lease: 30 });
  assert.deepEqual([other.outcome, other.limit, other.ticket], ["limit_mismatch", 2, null]);
  // A queued permit goes in when a holder releases.
  let queuedDone = false;
  const queued = c.acquirePermit("sem", 2, { wait: 10, lease: 30 }).then((r) => {
    queuedDone = true;
    return r;
  });
  await sleep(300);
  assert.equal(queuedDone, false, "granted while both places were held");
  assert.equal(await first.ticket.release(), "released");
  const q = await queued;
  assert.equal(q.outcome, "acquired");
  assert.ok(q.ticket.token > second.ticket.token);
  assert.equal(await second.ticket.release(), "released");
  assert.equal(await q.ticket.release(), "released");
});

test("a read/write lock against the real server", async () => {
  const s = await server();
  const c = client(s.addr, { poolSize: 4 });
  const r1 = (await c.acquireShared("rw", { wait: 1, lease: 30 })).ticket;
  const r2 = (await c.acquireShared("rw", { wait: 1, lease: 30 })).ticket;
  assert.ok(r1 !== null && r2 !== null && r1.token < r2.token);
  let writerDone = false;
  const writer = c.acquireExclusive("rw", { wait: 10, lease: 30 }).then((r) => {
    writerDone = true;
    return r;
  });
  await sleep(300);
  assert.equal(writerDone, false, "a writer granted beside readers");
  // The queued writer holds back a later reader.
  assert.equal((await c.acquireShared("rw", { wait: 0, lease: 30 })).outcome, "timeout");
  assert.equal(await r1.release(), "released");
  await sleep(200);
  assert.equal(writerDone, false, "a writer granted beside a reader");
  assert.equal(await r2.release(), "released");
  const w = await writer;
  assert.equal(w.outcome, "acquired");
  assert.ok(w.ticket.token > r2.token);
  assert.equal(await w.ticket.release(), "released");
});

test("a late permit is given back at once, not held for its lease", async () => {
  const s = await server();
  const proxy = await delayingProxy(s.addr, 1500);
  cleanups.push(() => proxy.close());
  const c = client(proxy.addr);
  const start = performance.now();
  // A semaphore of 1, so that the plain probe of holds() sees T while held.
  const r = await c.acquirePermit("late", 1, { wait: 1, lease: 30 });
  assert.equal(r.outcome, "indeterminate");
  assert.ok(performance.now() - start < 2000);
  // The release went out at once (its own reply is delayed too).
  assert.ok(await until(async () => !(await s.holds("late")), 2500), "the late grant was released");
});

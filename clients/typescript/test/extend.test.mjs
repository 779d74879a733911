// PROTOCOL §5: extend, keep-alive and its "lost" event, lock/withLock.

import assert from "node:assert/strict";
import { once } from "node:events";
import { after, test } from "node:test";

import { Client, NotAcquired } from "../dist/index.js";
import { silentServer, sleep, startServer } from "./support.mjs";

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

test("extend moves the expiry, counted from the write, and keeps the token", async () => {
  const s = await server();
  const c = client(s.addr);
  const t = (await c.acquire("e", { wait: 1, lease: 2 })).ticket;
  const before = t.expiresAt;
  await sleep(200);
  const start = performance.now();
  assert.equal(await t.extend(5), "extended");
  const done = performance.now();
  assert.equal(t.lease, 5);
  assert.ok(t.expiresAt >= start + 5000 && t.expiresAt <= done + 5000, "from the write, not the reply");
  assert.ok(t.expiresAt > before);
  // Past the first lease, still held, same token.
  await sleep(2000);
  assert.ok(await s.holds("e"));
  assert.equal(await c.release("e", t.token), "released");
});

test("a ticket expired locally is lost for good and nothing is sent", async () => {
  const s = await server();
  const c = client(s.addr);
  const t = (await c.acquire("x1", { wait: 1, lease: 1 })).ticket;
  await sleep(1100);
  assert.ok(t.isExpired());
  const lost = once(t, "lost");
  const start = performance.now();
  assert.equal(await t.extend(), "lost");
  assert.ok(performance.now() - start < 50, "nothing was sent");
  await lost;
  assert.ok(t.lostSignal.aborted && t.isLost());
});

test("X is definitive: the ticket is lost and stays lost", async () => {
  const s = await server();
  const c = client(s.addr);
  const t = (await c.acquire("x2", { wait: 1, lease: 10 })).ticket;
  assert.equal(await c.release("x2", t.token), "released");
  assert.equal(await t.extend(), "lost");
  assert.match(t.lostSignal.reason.message, /X/);
  const again = (await c.acquire("x2", { wait: 1, lease: 10 })).ticket;
  assert.equal(await t.extend(), "lost", "lost for good, even with the key held again");
  assert.equal(await again.release(), "released");
});

test("extend by token from any client; an extend past --max-hold is X", async () => {
  const s = await server(["--max-hold", "4"]);
  const c = client(s.addr);
  const other = client(s.addr);
  const t = (await c.acquire("cap", { wait: 1, lease: 2 })).ticket;
  assert.equal(await other.extend("cap", t.token, 2), "extended");
  assert.equal(await other.extend("cap", t.token + 1n, 2), "not_held");
  const expiry = t.expiresAt;
  assert.equal(await t.extend(10), "lost");
  assert.equal(t.expiresAt, expiry);
  assert.ok(await s.holds("cap"), "the current lease stands");
});

test("an extend in flight extends nothing; unanswered, the ticket is lost at its expiry", async () => {
  // A fake server that grants the acquire and then never answers.
  const fake = await silentServer();
  cleanups.push(() => fake.close());
  const c = client(fake.addr);
  const pending = c.acquire("stall", { wait: 1, lease: 2 });
  while (fake.bytes().length < 17) await sleep(10);
  const owner = fake.bytes().subarray(3, 11);
  fake.replyWith(Buffer.concat([Buffer.from([0x41]), Buffer.alloc(8, 7), owner, Buffer.from("stall\n")]));
  const t = (await pending).ticket;
  assert.equal(t.token, 0x0707070707070707n);
  const expiry = t.expiresAt;
  const lost = once(t, "lost");
  const ext = t.extend();
  await sleep(100);
  assert.equal(t.expiresAt, expiry, "an extend in flight extends nothing");
  assert.equal(await ext, "lost");
  const now = performance.now();
  assert.ok(now >= expiry && now < expiry + 500, "given up at the expiry");
  await lost;
  const b = fake.bytes().subarray(17);
  assert.equal(b[0], 0x45);
  assert.equal(b.readBigUInt64BE(2), t.token);
  assert.equal(b.length, 11 + 5, "one Extend, sent once");
  // By token, an extend with no answer is indeterminate at the transport deadline or an abort.
  const got = await c.extend("stall", t.token, 2, { signal: AbortSignal.timeout(300) });
  assert.equal(got, "indeterminate");
});

test("the keep-alive renews past the lease and release stops it", async () => {
  const s = await server();
  const c = client(s.addr);
  const t = await c.lock("ka", { wait: 1, lease: 2 });
  let lost = false;
  t.on("lost", () => (lost = true));
  await sleep(3500);
  assert.equal(lost, false);
  assert.ok(await s.holds("ka"), "held past its first lease");
  assert.ok(t.remainingMs() > 500);
  assert.equal(await t.release(), "released");
  assert.equal(await s.holds("ka"), false);
});

test("the keep-alive tells the holder at once on an X", async () => {
  const s = await server();
  const c = client(s.addr);
  const t = await c.lock("kx", { wait: 1, lease: 3 });
  assert.equal(await c.release("kx", t.token), "released");
  const start = performance.now();
  const [why] = await once(t, "lost");
  assert.match(why.message, /lost/);
  assert.ok(performance.now() - start < 1500, "told by the next renewal");
  assert.ok(t.lostSignal.aborted);
});

test("the keep-alive reports lost before the expiry when the server dies", async () => {
  const s = await startServer();
  cleanups.push(() => s.stop());
  const c = client(s.addr);
  const t = await c.lock("kd", { wait: 1, lease: 3 });
  await s.kill();
  await once(t, "lost");
  assert.ok(performance.now() < t.expiresAt, "told while the lease still runs");
  // Leaving a lost lock does not wait for the dead server.
  const start = performance.now();
  await t[Symbol.asyncDispose]();
  assert.ok(performance.now() - start < 100);
});

test("withLock renews, passes the lost signal and releases, also when the body throws", async () => {
  const s = await server();
  const c = client(s.addr);
  const got = await c.withLock(
    "wl",
    async (t, lost) => {
      assert.equal(lost.aborted, false);
      assert.ok(await s.holds("wl"));
      return t.token;
    },
    { wait: 1, lease: 5 },
  );
  assert.equal(typeof got, "bigint");
  assert.equal(await s.holds("wl"), false);
  await assert.rejects(
    c.withLock("wl", () => {
      throw new Error("body failed");
    }),
    /body failed/,
  );
  assert.equal(await s.holds("wl"), false);
  const holder = (await c.acquire("wl", { wait: 1, lease: 5 })).ticket;
  let ran = false;
  await assert.rejects(
    c.withLock("wl", () => (ran = true), { wait: 0.2 }),
    (e) => e instanceof NotAcquired && e.outcome === "timeout",
  );
  assert.equal(ran, false);
  await holder.release();
});

// The codec, the deadline plans, argument checks and owners, without a server.

import assert from "node:assert/strict";
import { test } from "node:test";

import * as proto from "../dist/proto.js";
import * as plan from "../dist/plan.js";
import { mix, nextOwner } from "../dist/owner.js";
import { Client } from "../dist/index.js";

const hex = (s) => Buffer.from(s.replace(/ /g, ""), "hex");

test("requests encode as the PROTOCOL §1 and §5.1 examples", () => {
  const db = Buffer.from("db");
  assert.deepEqual(proto.encodeAcquire(5, 30, 0x0a0bn, db), hex("41 05 1E 00 00 00 00 00 00 0A 0B 64 62 0A"));
  assert.deepEqual(proto.encodeRelease(1n, db), hex("52 00 00 00 00 00 00 00 01 64 62 0A"));
  assert.deepEqual(proto.encodeExtend(30, 7n, db), hex("45 1E 00 00 00 00 00 00 00 07 64 62 0A"));
  // Tokens are 64-bit: the top bit survives.
  const big = 0xfedcba9876543210n;
  assert.equal(proto.encodeRelease(big, db).readBigUInt64BE(1), big);
});

test("a reply header may contain newlines; replies decode by length first", () => {
  const a = hex("41 00 00 00 00 00 00 00 01 00 00 00 00 00 00 0A 0B 64 62 0A");
  const d = proto.decodeReply(a, 0, 1024);
  assert.equal(d.kind, "frame");
  assert.deepEqual(d.reply, { op: 0x41, a: 1n, owner: 0x0a0bn, key: "db" });
  assert.equal(d.used, a.length);
  const t = proto.decodeReply(hex("54 00 00 00 00 00 00 0A 0B 64 62 0A"), 0, 1024);
  assert.deepEqual(t.reply, { op: 0x54, a: 0x0a0bn, owner: 0n, key: "db" });
  // Two frames back to back, the second read from its offset; a partial one needs more.
  const two = Buffer.concat([a, hex("58 00 00 00 00 00 00 00 07 64 62 0A")]);
  assert.equal(proto.decodeReply(two, a.length, 1024).reply.op, 0x58);
  assert.equal(proto.decodeReply(a.subarray(0, 12), 0, 1024), null);
  assert.equal(proto.decodeReply(a.subarray(0, 19), 0, 1024), null);
});

test("a malformed reply stream is found within bounded input", () => {
  assert.equal(proto.decodeReply(hex("5A 00"), 0, 1024).kind, "malformed");
  const noNewline = Buffer.concat([hex("52 00 00 00 00 00 00 00 01"), Buffer.alloc(9, 0x61)]);
  assert.equal(proto.decodeReply(noNewline, 0, 8).kind, "malformed");
  assert.equal(proto.decodeReply(noNewline.subarray(0, 17), 0, 8), null);
  assert.equal(proto.decodeReply(hex("52 00 00 00 00 00 00 00 01 0A"), 0, 8).kind, "malformed");
  assert.equal(proto.decodeReply(hex("52 00 00 00 00 00 00 00 01 FF 0A"), 0, 8).kind, "malformed");
});

test("the wire wait rounds up to whole seconds and caps at 255", () => {
  assert.equal(plan.wireWaitS(0), null);
  assert.equal(plan.wireWaitS(-5), null);
  assert.equal(plan.wireWaitS(1), 1);
  assert.equal(plan.wireWaitS(1000), 1);
  assert.equal(plan.wireWaitS(1001), 2);
  assert.equal(plan.wireWaitS(254_500), 255);
  assert.equal(plan.wireWaitS(10_000_000), 255);
});

test("one deadline governs sending, the gate and the grace", () => {
  const p = plan.acquirePlan(1000, 2.5);
  assert.equal(p.waitDeadline, 3500);
  assert.equal(p.sendDeadline, 3500);
  assert.equal(p.gate, 3500);
  assert.equal(p.giveUp, 4500);
  // Written 2 s late: the wire wait is what is left, rounded up.
  assert.equal(p.wireWaitAt(3000), 1);
  assert.equal(p.wireWaitAt(1000), 3);
  assert.equal(p.wireWaitAt(3500), null);
  // wait = 0: one attempt under the 5 s transport deadline, wire wait 0.
  const z = plan.acquirePlan(1000, 0);
  assert.equal(z.waitDeadline, null);
  assert.equal(z.wireWaitAt(1000), 0);
  assert.equal(z.giveUp, 6000);
  // An extend attempt ends at the transport deadline or at the expiry.
  assert.equal(plan.extendPlan(1000, 3000).giveUp, 3000);
  assert.equal(plan.extendPlan(1000, 9000).giveUp, 6000);
});

test("waits, leases and keys are checked before anything is sent", () => {
  assert.equal(plan.normaliseWait(1000), 255);
  assert.equal(plan.normaliseWait(0.25), 0.25);
  assert.throws(() => plan.normaliseWait(-1), RangeError);
  assert.throws(() => plan.normaliseWait(NaN), RangeError);
  assert.throws(() => plan.normaliseWait("5"), TypeError);
  assert.equal(plan.checkLease(255), 255);
  for (const bad of [0, -1, 256, 1.5, NaN, Infinity]) {
    assert.throws(() => plan.checkLease(bad), RangeError, String(bad));
  }
  assert.throws(() => plan.checkLease("30"), TypeError);
  assert.deepEqual(plan.checkKey("é", 2), Buffer.from("é"));
  assert.throws(() => plan.checkKey("é", 1), RangeError);
  assert.throws(() => plan.checkKey("", 10), RangeError);
  assert.throws(() => plan.checkKey("a\nb", 10), RangeError);
  assert.throws(() => plan.checkKey("\ud800", 10), RangeError);
  assert.throws(() => plan.checkKey(5, 10), TypeError);
  assert.throws(() => plan.checkToken(-1n), RangeError);
  assert.throws(() => plan.checkToken(1n << 64n), RangeError);
  assert.throws(() => plan.checkToken(5), TypeError);
});

test("owners are unique and spread; mix is a bijection on a sample", () => {
  const seen = new Set();
  for (let i = 0; i < 10000; i++) {
    seen.add(nextOwner());
  }
  assert.equal(seen.size, 10000);
  const high = [...seen].filter((o) => o >= 1n << 63n).length;
  assert.ok(high > 4000 && high < 6000, `${high} of 10000 owners have the top bit`);
  const images = new Set();
  for (let i = 0n; i < 5000n; i++) {
    images.add(mix(i * 0x9e3779b97f4a7c15n));
  }
  assert.equal(images.size, 5000);
});

test("client settings are checked at construction", () => {
  assert.throws(() => new Client([]), RangeError);
  assert.throws(() => new Client("nohost"), RangeError);
  assert.throws(() => new Client("h:0"), RangeError);
  assert.throws(() => new Client("h:70000"), RangeError);
  assert.throws(() => new Client("::1:7470"), RangeError);
  assert.throws(() => new Client("unix:"), RangeError);
  assert.throws(() => new Client("127.0.0.1:7470", { poolSize: 0 }), RangeError);
  assert.throws(() => new Client("127.0.0.1:7470", { poolSize: 65 }), RangeError);
  assert.throws(() => new Client("127.0.0.1:7470", { maxKeyBytes: 65537 }), RangeError);
  assert.throws(() => new Client("127.0.0.1:7470", { connectTimeout: 0 }), RangeError);
  assert.throws(() => new Client("127.0.0.1:7470", { tlsCert: "c.pem", tlsKey: "k.pem" }), RangeError);
  assert.throws(() => new Client("127.0.0.1:7470", { tlsCa: "/nonexistent/ca.pem" }), /cannot read tlsCa/);
  const c = new Client(["[::1]:7470", "localhost:1", "unix:/tmp/x.sock"]);
  assert.deepEqual(c.addresses, ["[::1]:7470", "localhost:1", "unix:/tmp/x.sock"]);
  c.close();
});

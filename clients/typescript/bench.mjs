#!/usr/bin/env node
// Acquire+release cycles per second through the TypeScript client, for 1
// and 16 concurrent callers, beside a Redis lock taken with the npm `redis`
// client (SET NX PX, and a Lua compare-and-delete to release) on a local
// redis-server, in the same run.
//
// Each caller cycles on a key of its own (no contention: this measures the
// client and the round trip, not queueing). ticketd's callers share one
// Client (requests pipelined over its pool); Redis's share one connection
// (the npm client pipelines every caller's commands on it). Rounds
// alternate between the two so that machine noise hits both alike.
//
//     node bench.mjs                    # starts ticketd and redis-server itself
//     node bench.mjs --seconds 5 --rounds 3 --callers 1,16,64
//     node bench.mjs --addr 127.0.0.1:7470 --redis 127.0.0.1:6379
//
// Starting ticketd needs target/{release,debug}/ticketd (or --ticketd-bin,
// or $TICKETD_BIN); the Redis column needs the `redis` devDependency and
// redis-server on the PATH (or --redis), and is skipped, saying so, without.

import { spawn, spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import * as net from "node:net";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import { Client } from "./dist/index.js";

const REPO = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
const { values: opt } = parseArgs({
  options: {
    addr: { type: "string" },
    "ticketd-bin": { type: "string" },
    redis: { type: "string" },
    seconds: { type: "string", default: "3" },
    rounds: { type: "string", default: "3" },
    callers: { type: "string", default: "1,16" },
    "pool-size": { type: "string", default: "2" },
    help: { type: "boolean", default: false },
  },
});
if (opt.help) {
  console.log("node bench.mjs [--addr HOST:PORT] [--ticketd-bin PATH] [--redis HOST:PORT]");
  console.log("               [--seconds S] [--rounds N] [--callers 1,16] [--pool-size N]");
  process.exit(0);
}
const seconds = Number(opt.seconds);
const rounds = Number(opt.rounds);
const callers = opt.callers.split(",").map(Number);
const children = [];

function startProcess(bin, args, pattern) {
  const p = spawn(bin, args, { stdio: ["ignore", "pipe", "pipe"] });
  children.push(p);
  return new Promise((resolve, reject) => {
    let out = "";
    const look = (d) => {
      out += d.toString();
      const m = pattern.exec(out);
      if (m) resolve(m[1]);
    };
    p.stdout.on("data", look);
    p.stderr.on("data", look);
    p.on("exit", (code) => reject(new Error(`${bin} exited (${code}): ${out}`)));
    setTimeout(() => reject(new Error(`${bin} did not start: ${out}`)), 15000).unref();
  });
}

function ticketdBinary() {
  const bin = opt["ticketd-bin"] ?? process.env.TICKETD_BIN;
  if (bin) return bin;
  const found = ["release", "debug"].map((p) => join(REPO, "target", p, "ticketd")).find(existsSync);
  if (!found) {
    console.error("no target/{release,debug}/ticketd: cargo build --release --bin ticketd");
    process.exit(1);
  }
  return found;
}

function freePort() {
  return new Promise((resolve) => {
    const s = net.createServer().listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

async function redisLock() {
  let redis;
  try {
    redis = await import("redis");
  } catch {
    return [null, "the npm redis package is not installed: Redis column skipped"];
  }
  let addr = opt.redis;
  if (!addr) {
    if (spawnSync("redis-server", ["--version"]).status !== 0) {
      return [null, "no redis-server on the PATH and no --redis: Redis column skipped"];
    }
    const port = await freePort();
    const args = ["--port", `${port}`, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"];
    await startProcess("redis-server", args, /(Ready to accept connections)/);
    addr = `127.0.0.1:${port}`;
  }
  const r = redis.createClient({ url: `redis://${addr}` });
  await r.connect();
  const release = 'if redis.call("get", KEYS[1]) == ARGV[1] then return redis.call("del", KEYS[1]) else return 0 end';
  let n = 0;
  const cycle = async (i) => {
    const key = `bench-${i}`;
    const token = `${process.pid}-${n++}`;
    const end = performance.now() + 10000;
    while ((await r.set(key, token, { NX: true, PX: 30000 })) !== "OK") {
      if (performance.now() > end) throw new Error("redis: not acquired");
      await new Promise((res) => setTimeout(res, 1));
    }
    if ((await r.eval(release, { keys: [key], arguments: [token] })) !== 1) {
      throw new Error("redis: not released");
    }
  };
  return [{ cycle, addr, close: () => r.quit() }, null];
}

/** Cycles per second of `n` concurrent callers for `secs` seconds. */
async function run(n, secs, cycle) {
  let count = 0;
  const start = performance.now();
  const stopAt = start + secs * 1000;
  await Promise.all(
    Array.from({ length: n }, async (_, i) => {
      while (performance.now() < stopAt) {
        await cycle(i);
        count += 1;
      }
    }),
  );
  return count / ((performance.now() - start) / 1000);
}

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

async function main() {
  let addr = opt.addr;
  let bin = "(running)";
  if (!addr) {
    bin = ticketdBinary();
    addr = await startProcess(bin, ["--listen", "127.0.0.1:0"], /listening on (\S+)/);
  }
  const client = new Client(addr, { poolSize: Number(opt["pool-size"]) });
  const tcycle = async (i) => {
    const r = await client.acquire(`bench-${i}`, { wait: 10, lease: 30 });
    if (r.ticket === null) throw new Error(`ticketd: not acquired: ${r.outcome}`);
    if ((await r.ticket.release()) !== "released") throw new Error("ticketd: not released");
  };
  const [rl, why] = await redisLock();
  if (why) console.log(why);
  console.log(`ticketd ${bin} at ${addr}; redis ${rl?.addr ?? "-"}; node ${process.version}`);
  console.log(`${rounds} rounds x ${seconds} s per cell, median shown`);
  await run(Math.max(...callers), 0.3, tcycle);
  if (rl) await run(Math.max(...callers), 0.3, rl.cycle);
  console.log(`${"callers".padStart(8)} ${"ticketd/s".padStart(12)} ${"redis/s".padStart(12)} ${"ratio".padStart(7)}`);
  for (const n of callers) {
    const ts = [];
    const rs = [];
    for (let k = 0; k < rounds; k++) {
      ts.push(await run(n, seconds, tcycle));
      if (rl) rs.push(await run(n, seconds, rl.cycle));
    }
    const tm = median(ts);
    const rm = rl ? median(rs) : null;
    const cells = rm ? [rm.toFixed(0), (tm / rm).toFixed(2)] : ["-", "-"];
    console.log(`${`${n}`.padStart(8)} ${tm.toFixed(0).padStart(12)} ${cells[0].padStart(12)} ${cells[1].padStart(7)}`);
  }
  client.close();
  if (rl) await rl.close();
}

try {
  await main();
} finally {
  for (const p of children) p.kill("SIGTERM");
}

// A worker for cross-language contention tests:
//
//     node contention-worker.mjs ADDR KEY CYCLES COUNTER_FILE
//
// For each cycle: acquire KEY (wait 30 s, lease 30 s); read COUNTER_FILE as
// a decimal integer n (empty or missing: 0); write n+1 to it; print
// "n token" on stdout; release. Exits 2 if an acquire is not granted (why
// on stderr), 3 if a release is not answered "released", 1 on bad
// arguments, 0 when every cycle is done. Workers in any language that share
// the key and the file must never lose an increment, and the tokens printed
// must grow with n.

import { readFileSync, writeFileSync } from "node:fs";
import { Client } from "../dist/index.js";

const [addr, key, cyclesText, counterFile] = process.argv.slice(2);
const cycles = Number(cyclesText);
if (!counterFile || !Number.isInteger(cycles) || cycles < 0) {
  process.stderr.write("usage: node contention-worker.mjs ADDR KEY CYCLES COUNTER_FILE\n");
  process.exit(1);
}

function readCounter() {
  let text;
  try {
    text = readFileSync(counterFile, "utf8").trim();
  } catch (e) {
    if (e.code === "ENOENT") return 0n;
    throw e;
  }
  return text === "" ? 0n : BigInt(text);
}

const client = new Client(addr);
try {
  for (let i = 0; i < cycles; i++) {
    const r = await client.acquire(key, { wait: 30, lease: 30 });
    if (r.ticket === null) {
      process.stderr.write(`cycle ${i}: ${key} not acquired: ${r.outcome} (${client.lastConnectError ?? "no connection error"})\n`);
      process.exit(2);
    }
    const n = readCounter();
    writeFileSync(counterFile, `${n + 1n}`);
    process.stdout.write(`${n} ${r.ticket.token}\n`);
    const rel = await r.ticket.release();
    if (rel !== "released") {
      process.stderr.write(`cycle ${i}: release of ${key} answered ${rel}\n`);
      process.exit(3);
    }
  }
} finally {
  client.close();
}

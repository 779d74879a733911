// The shipped artefacts: the contention worker against the real server,
// and the npm package, packed and installed into a fresh directory.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, test } from "node:test";
import { promisify } from "node:util";

import { PKG, removeDir, startServer, tempDir } from "./support.mjs";

const run = promisify(execFile);
const cleanups = [];
after(async () => {
  for (const f of cleanups.reverse()) await f();
});

test("three contention workers never lose an increment and tokens grow with the counter", async () => {
  const s = await startServer();
  cleanups.push(() => s.stop());
  const d = tempDir();
  cleanups.push(() => removeDir(d));
  const counter = join(d, "counter");
  const worker = join(PKG, "examples", "contention-worker.mjs");
  const outs = await Promise.all(
    [0, 1, 2].map(() => run(process.execPath, [worker, s.addr, "shared", "30", counter], { timeout: 60000 })),
  );
  assert.equal(readFileSync(counter, "utf8"), "90");
  const lines = outs.flatMap((o) => o.stdout.trim().split("\n"));
  assert.equal(lines.length, 90);
  const byN = new Map(lines.map((l) => l.split(" ")).map(([n, tok]) => [Number(n), BigInt(tok)]));
  assert.equal(byN.size, 90, "every n printed once");
  for (let n = 1; n < 90; n++) {
    assert.ok(byN.get(n) > byN.get(n - 1), `token of ${n} grows`);
  }
});

test("npm pack gives a package that installs offline and runs a cycle", async () => {
  const d = tempDir("tkd-pack");
  cleanups.push(() => removeDir(d));
  const { stdout } = await run("npm", ["pack", "--ignore-scripts", "--pack-destination", d], { cwd: PKG });
  const tgz = stdout.trim().split("\n").pop();
  assert.match(tgz, /^ticketd-\d+\.\d+\.\d+\.tgz$/);
  const app = join(d, "app");
  await run("mkdir", ["-p", app]);
  writeFileSync(join(app, "package.json"), '{"name":"app","version":"1.0.0","private":true}');
  await run("npm", ["install", "--offline", "--no-audit", "--no-fund", join(d, tgz)], { cwd: app });
  const installed = join(app, "node_modules", "ticketd");
  assert.ok(existsSync(join(installed, "dist", "index.d.ts")), "types are shipped");
  assert.ok(!existsSync(join(installed, "src")), "sources stay out");
  const s = await startServer();
  cleanups.push(() => s.stop());
  const cycle = `
    const r = await c.acquire("pack", { wait: 1, lease: 5 });
    console.log(r.outcome, await r.ticket.release());
    c.close();`;
  writeFileSync(join(app, "esm.mjs"), `import { Client } from "ticketd";\nconst c = new Client(process.argv[2]);\n${cycle}`);
  writeFileSync(
    join(app, "cjs.cjs"),
    `const { Client } = require("ticketd");\nconst c = new Client(process.argv[2]);\n(async () => {${cycle}})();`,
  );
  for (const f of ["esm.mjs", "cjs.cjs"]) {
    const out = await run(process.execPath, [f, s.addr], { cwd: app, timeout: 30000 });
    assert.equal(out.stdout.trim(), "acquired released", f);
  }
});

// Test support: the real ticketd started on port 0 (or a unix socket), a raw
// connection that asks the server what it holds, a fake server that never
// answers, a proxy that delays or cuts replies, and certificates made by
// openssl.

import { spawn, execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, statSync, writeFileSync, rmSync } from "node:fs";
import * as net from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const HERE = dirname(fileURLToPath(import.meta.url));
export const PKG = resolve(HERE, "..");
export const REPO = resolve(PKG, "..", "..");

/** `$TICKETD_BIN`, else the newest of target/{debug,release}/ticketd. */
export function ticketdBin() {
  if (process.env.TICKETD_BIN) {
    return process.env.TICKETD_BIN;
  }
  const found = ["debug", "release"]
    .map((p) => join(REPO, "target", p, "ticketd"))
    .filter((p) => existsSync(p))
    .sort((a, b) => statSync(b).mtimeMs - statSync(a).mtimeMs);
  if (found.length === 0) {
    throw new Error("no ticketd binary: build it (cargo build --bin ticketd) or set TICKETD_BIN");
  }
  return found[0];
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** A fresh temporary directory with a short path (unix socket paths are short). */
export function tempDir(prefix = "tkd") {
  return mkdtempSync(join(tmpdir(), prefix));
}

/**
 * Starts the real ticketd (`--listen 127.0.0.1:0` unless `args` has a
 * --listen of its own first) and resolves once it says where it listens.
 */
export async function startServer(args = [], { tcp = true } = {}) {
  const full = tcp ? ["--listen", "127.0.0.1:0", ...args] : args;
  const proc = spawn(ticketdBin(), full, { stdio: ["ignore", "ignore", "pipe"] });
  let log = "";
  const addr = await new Promise((res, rej) => {
    const timer = setTimeout(() => rej(new Error(`ticketd did not start: ${log}`)), 30000);
    proc.stderr.on("data", (d) => {
      log += d.toString();
      const m = /listening on (\S+)/.exec(log);
      if (m) {
        clearTimeout(timer);
        res(m[1]);
      }
    });
    proc.on("exit", (code) => {
      clearTimeout(timer);
      rej(new Error(`ticketd exited (${code}): ${log}`));
    });
  });
  const exited = new Promise((r) => proc.on("exit", r));
  return {
    addr,
    proc,
    log: () => log,
    async stop() {
      if (proc.exitCode === null && proc.signalCode === null) {
        proc.kill("SIGTERM");
        await exited;
      }
    },
    async kill() {
      if (proc.exitCode === null && proc.signalCode === null) {
        proc.kill("SIGKILL");
        await exited;
      }
    },
    /** Whether the server holds `key`: a raw wait-0 acquire is answered T. */
    holds: (key) => holds(addr, key),
  };
}

/** Sends `frame` on a fresh raw connection to `addr` and returns the first reply frame. */
export function rawExchange(addr, frame) {
  const [host, port] = splitAddr(addr);
  return new Promise((res, rej) => {
    const s = net.connect({ host, port });
    let buf = Buffer.alloc(0);
    s.setTimeout(5000, () => {
      s.destroy();
      rej(new Error("raw exchange timed out"));
    });
    s.on("connect", () => s.write(frame));
    s.on("data", (d) => {
      buf = Buffer.concat([buf, d]);
      const header = buf[0] === 0x41 ? 17 : 9;
      const nl = buf.indexOf(0x0a, header);
      if (buf.length > header && nl >= 0) {
        s.destroy();
        res(buf.subarray(0, nl + 1));
      }
    });
    s.on("error", rej);
  });
}

function splitAddr(addr) {
  const i = addr.lastIndexOf(":");
  return [addr.slice(0, i), Number(addr.slice(i + 1))];
}

/** Whether the server at `addr` holds `key` (a grant found instead is given back). */
export async function holds(addr, key) {
  const k = Buffer.from(key);
  const acq = Buffer.concat([Buffer.from([0x41, 0, 1]), Buffer.alloc(8, 0xfe), k, Buffer.from("\n")]);
  const r = await rawExchange(addr, acq);
  if (r[0] === 0x54) {
    return true;
  }
  if (r[0] !== 0x41) {
    throw new Error(`unexpected reply ${r.toString("hex")}`);
  }
  const rel = Buffer.concat([Buffer.from([0x52]), r.subarray(1, 9), k, Buffer.from("\n")]);
  await rawExchange(addr, rel);
  return false;
}

/**
 * A server that accepts, reads and never answers. `frames` counts the
 * request op bytes seen at frame starts (requests are whole in these tests).
 */
export async function silentServer() {
  const conns = new Set();
  const seen = [];
  const srv = net.createServer((c) => {
    conns.add(c);
    c.on("data", (d) => seen.push(Buffer.from(d)));
    c.on("error", () => {});
    c.on("close", () => conns.delete(c));
  });
  await new Promise((r) => srv.listen(0, "127.0.0.1", r));
  return {
    addr: `127.0.0.1:${srv.address().port}`,
    bytes: () => Buffer.concat(seen),
    connections: () => conns.size,
    replyWith(buf) {
      for (const c of conns) c.write(buf);
    },
    close() {
      for (const c of conns) c.destroy();
      srv.close();
    },
  };
}

/** A listening address nothing answers on: bound, then closed. */
export async function refusedAddr() {
  const srv = net.createServer();
  await new Promise((r) => srv.listen(0, "127.0.0.1", r));
  const port = srv.address().port;
  await new Promise((r) => srv.close(r));
  return `127.0.0.1:${port}`;
}

/**
 * A proxy in front of `target` that forwards requests at once and replies
 * after `delayMs`.
 */
export async function delayingProxy(target, delayMs) {
  const [host, port] = splitAddr(target);
  const socks = new Set();
  const srv = net.createServer((c) => {
    const up = net.connect({ host, port });
    socks.add(c).add(up);
    c.on("data", (d) => up.write(d));
    up.on("data", (d) => setTimeout(() => c.destroyed || c.write(d), delayMs));
    for (const s of [c, up]) {
      s.on("error", () => {});
      s.on("close", () => {
        c.destroy();
        up.destroy();
      });
    }
  });
  await new Promise((r) => srv.listen(0, "127.0.0.1", r));
  return {
    addr: `127.0.0.1:${srv.address().port}`,
    close() {
      for (const s of socks) s.destroy();
      srv.close();
    },
  };
}

/**
 * Two CAs (ca, other), a server certificate for localhost and 127.0.0.1
 * from ca, and a client certificate from each (client, stranger), made by
 * openssl in a fresh directory.
 */
export function makeCerts() {
  const d = tempDir("tkd-tls");
  const openssl = (...args) => execFileSync("openssl", args, { cwd: d, stdio: "pipe" });
  writeFileSync(
    join(d, "server.ext"),
    "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
  );
  writeFileSync(join(d, "client.ext"), "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n");
  const ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
  for (const ca of ["ca", "other"]) {
    openssl("req", "-x509", ...ec, "-days", "2", "-subj", `/CN=test ${ca}`, "-keyout", `${ca}-key.pem`, "-out", `${ca}.pem`);
  }
  for (const [leaf, ca, ext] of [
    ["server", "ca", "server.ext"],
    ["client", "ca", "client.ext"],
    ["stranger", "other", "client.ext"],
  ]) {
    openssl("req", ...ec, "-subj", `/CN=${leaf}`, "-keyout", `${leaf}-key.pem`, "-out", `${leaf}.csr`);
    openssl("x509", "-req", "-in", `${leaf}.csr`, "-CA", `${ca}.pem`, "-CAkey", `${ca}-key.pem`,
      "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", `${leaf}.pem`);
  }
  return d;
}

export function removeDir(d) {
  rmSync(d, { recursive: true, force: true });
}

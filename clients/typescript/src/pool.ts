/**
 * Addresses, connecting (TCP, TLS, unix sockets) and the small pool of
 * sessions every caller of one client shares.
 *
 * Slots fill lazily, one connection each, round-robin over the server
 * addresses; a dead session leaves its slot at once, so the pool never holds
 * more than `size` connections. Finding a session never waits past the
 * caller's send deadline: connecting is capped by it, and with nothing
 * reachable the caller backs off and tries again until the deadline passes.
 */

import * as net from "node:net";
import * as tls from "node:tls";

import { now } from "./plan";
import { Session, type SessionHooks } from "./session";

/** One place to connect to. */
export interface Address {
  /** As given: `host:port`, `[v6]:port` or `unix:/path`. */
  text: string;
  /** The host (no brackets), or `""` for a unix socket. */
  host: string;
  port: number;
  /** The socket path of a `unix:` address, else `""`. */
  path: string;
}

/** Parses `host:port`, `[v6]:port` or `unix:/path`; `RangeError` if malformed. */
export function parseAddress(text: unknown): Address {
  if (typeof text !== "string") {
    throw new TypeError(`a server address must be a string, not ${typeof text}`);
  }
  if (text.startsWith("unix:")) {
    const path = text.slice("unix:".length);
    if (path.length === 0) {
      throw new RangeError(`server address ${JSON.stringify(text)} has no socket path`);
    }
    return { text, host: "", port: 0, path };
  }
  const colon = text.lastIndexOf(":");
  let host = colon > 0 ? text.slice(0, colon) : "";
  const portText = colon > 0 ? text.slice(colon + 1) : "";
  if (host.length === 0 || !/^[0-9]{1,5}$/.test(portText)) {
    throw new RangeError(`server address ${JSON.stringify(text)} is not host:port or unix:/path`);
  }
  if (host.startsWith("[") && host.endsWith("]")) {
    host = host.slice(1, -1);
    if (net.isIPv6(host) === false) {
      throw new RangeError(`server address ${JSON.stringify(text)} has no valid IPv6 address`);
    }
  } else if (host.includes(":") || /[\s/]/.test(host)) {
    throw new RangeError(`server address ${JSON.stringify(text)}: write an IPv6 host in brackets`);
  }
  const port = Number(portText);
  if (port < 1 || port > 65535) {
    throw new RangeError(`server address ${JSON.stringify(text)} has a port out of range`);
  }
  return { text, host, port, path: "" };
}

/** How to speak TLS to the TCP addresses. */
export interface TlsDial {
  ca: Buffer;
  cert: Buffer | undefined;
  key: Buffer | undefined;
  /** Checked against every server's certificate instead of each host. */
  serverName: string | undefined;
}

/** A connection attempt that ran out of time. */
class ConnectTimedOut extends Error {}

/** Opens one connection (and runs its TLS handshake) within `timeoutMs`. */
function connectOne(addr: Address, timeoutMs: number, dial: TlsDial | null): Promise<net.Socket> {
  return new Promise((resolve, reject) => {
    let sock: net.Socket;
    let ready = "connect";
    if (addr.path !== "") {
      sock = net.connect({ path: addr.path });
    } else if (dial !== null) {
      const name = dial.serverName ?? addr.host;
      sock = tls.connect({
        host: addr.host,
        port: addr.port,
        ca: dial.ca,
        cert: dial.cert,
        key: dial.key,
        minVersion: "TLSv1.2",
        // SNI carries host names only, never an IP address.
        servername: net.isIP(name) === 0 ? name : "",
        checkServerIdentity: (_host, cert) => tls.checkServerIdentity(name, cert),
      });
      ready = "secureConnect";
    } else {
      sock = net.connect({ host: addr.host, port: addr.port });
    }
    const timer = setTimeout(() => {
      sock.destroy();
      reject(new ConnectTimedOut(`timed out after ${Math.round(timeoutMs)} ms`));
    }, timeoutMs);
    sock.once(ready, () => {
      clearTimeout(timer);
      sock.removeAllListeners("error");
      if (addr.path === "") {
        sock.setNoDelay(true);
      }
      resolve(sock);
    });
    sock.once("error", (e: Error) => {
      clearTimeout(timer);
      sock.destroy();
      const tlsError = dial !== null && addr.path === "" && !(e as NodeJS.ErrnoException).syscall;
      reject(new Error(tlsError ? `TLS: ${e.message}` : e.message));
    });
  });
}

/** Resolves `true` at `at` (ms on `now()`), or `false` as soon as `signal` aborts. */
export function sleepUntil(at: number, signal?: AbortSignal, unref = false): Promise<boolean> {
  return new Promise((resolve) => {
    if (signal?.aborted) {
      resolve(false);
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      resolve(false);
    };
    const timer = setTimeout(
      () => {
        signal?.removeEventListener("abort", onAbort);
        resolve(true);
      },
      Math.max(0, at - now()),
    );
    if (unref) {
      timer.unref();
    }
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** Up to `size` sessions over `addrs`. */
export class Pool {
  private readonly slots: (Session | Promise<Session | null> | null)[];
  private rr = 0;
  private nextAddr = 0;
  /** The last connection failure, for {@link Client.lastConnectError}. */
  lastError: string | null = null;
  closed = false;

  constructor(
    readonly addrs: Address[],
    size: number,
    private readonly connectTimeoutMs: number,
    private readonly maxKeyBytes: number,
    private readonly dial: TlsDial | null,
    private readonly hooks: Pick<SessionHooks, "orphanGrant">,
  ) {
    this.slots = new Array<Session | Promise<Session | null> | null>(size).fill(null);
  }

  /** Sessions open now. */
  live(): Session[] {
    return this.slots.filter((s): s is Session => s instanceof Session && !s.dead);
  }

  /**
   * A live session, connecting one if the slot whose turn it is is empty;
   * `null` once `sendDeadline` passes (or `signal` aborts) with none found,
   * or when the pool is closed.
   */
  async get(sendDeadline: number, signal?: AbortSignal): Promise<Session | null> {
    let backoff = 10;
    for (;;) {
      if (this.closed || signal?.aborted || now() >= sendDeadline) {
        return null;
      }
      const i = this.rr % this.slots.length;
      this.rr += 1;
      const slot = this.slots[i];
      if (slot instanceof Session && !slot.dead) {
        return slot;
      }
      if (slot instanceof Promise) {
        // Someone else is connecting this slot: any live session will do,
        // else wait for that connection rather than open one per caller.
        const other = this.live()[0];
        if (other !== undefined) {
          return other;
        }
        const got = await raceUntil(slot, sendDeadline, signal);
        if (got instanceof Session && !got.dead) {
          return got;
        }
        continue;
      }
      const filling = this.connectAny(sendDeadline);
      this.slots[i] = filling;
      const s = await filling;
      if (this.slots[i] === filling) {
        this.slots[i] = s;
      }
      if (s !== null) {
        return s;
      }
      const other = this.live()[0];
      if (other !== undefined) {
        return other;
      }
      // Nothing reachable: pause, never past the deadline.
      await sleepUntil(Math.min(now() + backoff, sendDeadline), signal);
      backoff = Math.min(backoff * 2, 500);
    }
  }

  /** Tries every address once, from the next in rotation. */
  private async connectAny(sendDeadline: number): Promise<Session | null> {
    const first = this.nextAddr;
    this.nextAddr += 1;
    for (let k = 0; k < this.addrs.length; k++) {
      const addr = this.addrs[(first + k) % this.addrs.length] as Address;
      const left = sendDeadline - now();
      if (left <= 0 || this.closed) {
        break;
      }
      const cut = left < this.connectTimeoutMs;
      try {
        const sock = await connectOne(addr, cut ? left : this.connectTimeoutMs, this.dial);
        if (this.closed) {
          sock.destroy();
          return null;
        }
        return new Session(sock, this.maxKeyBytes, addr.text, {
          orphanGrant: (key, token) => this.hooks.orphanGrant(key, token),
          died: (s, why, failure) => this.died(s, why, failure),
        });
      } catch (e) {
        // Kept even if a later address answers: it explains a slow call.
        // An attempt cut short by the call's own deadline says nothing new.
        if (!(e instanceof ConnectTimedOut && cut)) {
          this.lastError = `${addr.text}: cannot connect: ${(e as Error).message}`;
        }
      }
    }
    return null;
  }

  private died(s: Session, why: string, failure: boolean): void {
    const i = this.slots.indexOf(s);
    if (i >= 0) {
      this.slots[i] = null;
    }
    if (failure && !this.closed) {
      this.lastError = `${s.peer}: ${why}`;
    }
  }

  /** Closes every session; later gets return `null`. */
  close(): void {
    this.closed = true;
    for (const s of this.slots) {
      if (s instanceof Session) {
        s.close("client closed", false);
      }
    }
    this.slots.fill(null);
  }
}

/** `p`'s value, or `null` once `at` passes or `signal` aborts first. */
async function raceUntil<T>(p: Promise<T>, at: number, signal?: AbortSignal): Promise<T | null> {
  const ctl = new AbortController();
  const onAbort = (): void => ctl.abort();
  signal?.addEventListener("abort", onAbort, { once: true });
  try {
    return await Promise.race([p, sleepUntil(at, ctl.signal).then(() => null)]);
  } finally {
    ctl.abort();
    signal?.removeEventListener("abort", onAbort);
  }
}
